"""The scale bench: memory and speed of our trainers (and the peers') at the shapes users train, 8B verifiers.

    python scripts/bench_scale.py --out runs/scale                      # everything; table in runs/scale/scale-cpu.md
    python scripts/bench_scale.py --trainers eagle3 --models llama3-8b --seqs 1024 2048 --memory-gib 20 \
        --features online offline --out runs/scale --reuse              # a part; --reuse keeps rows already measured
    python scripts/bench_scale.py --tiny --out runs/scale-tiny          # the whole pipeline at small shapes (< 1 min)
    python scripts/bench_scale.py --device cuda --memory-gib 75 --out runs/scale-gpu

Opt-in, never in CI: at 8B shapes one step on a 2-core CPU takes 30 s to minutes and 10-20 GiB.

Stand-ins, not the models: no hub here, and an 8B verifier in bf16 (16 GiB) would not fit beside the drafter. Each
model is a random-weight Hugging Face folder (`--work`, built once: config.json, model.safetensors in bf16, a
placeholder tokenizer) with the real model's hidden size, heads, KV heads, head_dim, intermediate size,
vocabulary, RoPE and norm settings, and only as many decoder layers as the trainer reads, its layer ids remapped
onto them:
  - EAGLE-3, P-EAGLE: 3 layers; the inputs of layers 0, 1, 2 stand for those of 2, L//2, L-3 (2, 16, 29 of
    Llama-3.1-8B's 32; 2, 18, 33 of Qwen3-8B's 36);
  - DFlash: 6 layers; the outputs of layers 0..4 stand for those of 1, 9, 17, 25, 33 (the config's 5 target layers);
  - Medusa: 1 layer (it reads the final hidden state only).
So the drafter, its optimizer, the embedding and lm_head it reads, and every feature tensor have the real shapes;
what is smaller is the verifier forward of `features: online` (the stand-in's layers, not 32 or 36: the online
rows' times and memory are a floor) and the verifier's weights held in memory (the stand-in's layers: 0.4 GiB each
at these shapes). `features: offline` reads a feature cache of random bf16 features in our cache format
(data/hidden_states.py), written once per (model, trainer, seq) into `--work`, so no verifier forward runs.

Each trainer runs its config at these shapes (`configs/<model>-eagle3.yaml`; eagle3-frozen: the same with
speculators' settings, its lm_head frozen; P-EAGLE: the same with the parallel drafting of configs/peagle-tiny.yaml; DFlash: configs/qwen3-8b-dflash.yaml, 5 layers, block 16, 512 anchors (--anchors);
Medusa: configs/llama3-8b-medusa.yaml, 4 heads), batch 1, bf16 autocast where the device multiplies bf16 natively
(else fp32, said in the table), AdamW (its moments in fp32, or with `--optimizer-state float32 bfloat16` also in bf16:
train.optimizer_state, a row each), clipping: the trainer's own step (its drafter, loss and optimizer from its
modules; EAGLE-3's is scripts/bench_train.py's step builder) for `--warmup` + `--steps` steps on random tokens, in a
child process of its own (one at a time, so the memory is that trainer's alone), measured by scripts/scale_meter.py
at the optimizer's step, as the peers' loops are (scripts/bench_scale_peer.py, in their own environments, on the same
stand-ins and features written in their formats). Per row:
  - peak memory: the child's peak RSS on the CPU (its own `ru_maxrss`, set-up included); on CUDA
    torch.cuda.max_memory_allocated;
  - static: the weights held (trainable and frozen, the verifier's included), the gradients and the optimizer
    state, counted from the tensors after the first step; "rest" = peak - static, what grows with the tokens (and,
    on the CPU, the process's own ~1 GiB of libraries), also per token;
  - seconds and CPU-seconds (every thread of the child) per step, the median of the measured steps, and tokens/s,
    tokens per CPU-second.
The seq ladder (without --seqs): 1024, 2048, 4096, ... while it fits `--memory-gib`: a rung whose peak, predicted
from the measured rungs (static + rest growing linearly in the tokens), would exceed it is skipped, a child that
passes it is killed (on CUDA its allocator is capped there), and either is recorded as "did not fit", never a crash.
Before a child over 8 GiB starts, the machine must have that much available (`free`); it waits for it.

--reuse keeps the rows of an earlier run in the same --out whose settings are the same (device, shapes, steps,
threads, precision), so a long ladder continues where it stopped; a "did not fit" is kept only when it was
measured with at least this --memory-gib. Writes OUT/scale-<device>.json and OUT/scale-<device>.md
(default --out docs/benchmarks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
MIB = 2**20
BIG_CHILD_GIB = 8.0
"""A child predicted above this waits until the machine has that much memory available."""
FIRST_RUNG_GIB = 12.0
"""What a ladder's first rung is taken to need before anything is measured (EAGLE-3 at seq 1024 on the CPU: 12.3)."""


def say(*args) -> None:
    print("[bench_scale]", *args, file=sys.stderr, flush=True)


# ---- the models: real shapes, few layers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    name: str
    """What the stand-in stands for."""
    layers: int
    """The real model's decoder layers (what the layer ids refer to)."""
    config: dict
    """config.json of the real model, but num_hidden_layers (set per stand-in)."""


MODELS = {
    "llama3-8b": Model("Llama-3.1-8B", 32, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}),
    "qwen3-8b": Model("Qwen3-8B", 36, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}),
}
TINY = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2}
"""--tiny: the same families at hidden 256 and a 4k vocabulary (and a 1k draft vocabulary), to test the pipeline."""


def model_config(model: str, layers: int, tiny: bool) -> dict:
    config = {**MODELS[model].config, "num_hidden_layers": layers}
    if tiny:
        config.update(TINY)
        config.pop("rope_scaling", None)
    return config


# ---- the trainers ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trainer:
    label: str
    kind: str
    """ours: eagle | medusa | dflash; a peer: speculators-eagle3 | speculators-dflash | specforge-eagle3."""
    config: str
    """The config file ({model} is replaced), relative to the repository root."""
    standin_layers: int
    flags: tuple[str, ...] = ()
    peer: str | None = None
    """The peer's environment (.venv-<peer>), or None for ours."""
    features: tuple[str, ...] = ("online", "offline")
    draft_layers: int | None = None
    """DFlash: the drafter's layers when not the config's 5 (ours: dflash.num_hidden_layers; speculators: --num-layers)."""


EAGLE_LAYERS = ("--eagle.layer_ids=[0,1,2]",)
SPECULATORS_SETTINGS = ("--eagle.freeze_lm_head=true", "--eagle.norm_init=ones", "--eagle.init_std=0.02",
                        "--eagle.skip_out_of_draft=false")
"""eagle3-frozen (opt-in): our EAGLE-3 trained as speculators 0.9 trains it (its row in this bench): the lm_head kept at
the verifier's rows of the draft vocabulary, a fresh final norm, normal(0, 0.02) weights, every position trained."""
SWA_WINDOW = 1024
"""eagle3-window (opt-in, not in the default run): EAGLE-3 with eagle.sliding_window of this many positions."""
DFLASH_LAYERS = ("--dflash.target_layer_ids=[0,1,2,3,4]",)
TRAINERS = {
    "eagle3": Trainer("EAGLE-3", "eagle", "configs/{model}-eagle3.yaml", 3, EAGLE_LAYERS),
    "peagle": Trainer("P-EAGLE", "eagle", "configs/{model}-eagle3.yaml", 3,
                      EAGLE_LAYERS + ("--eagle.parallel=true", "--eagle.parallel_keep=[0.7,0.2]")),
    "eagle3-frozen": Trainer("EAGLE-3, speculators' settings (lm_head frozen)", "eagle", "configs/{model}-eagle3.yaml",
                             3, EAGLE_LAYERS + SPECULATORS_SETTINGS),
    "eagle3-ckpt": Trainer("EAGLE-3, checkpointed layers", "eagle", "configs/{model}-eagle3.yaml", 3,
                           EAGLE_LAYERS + ("--eagle.checkpoint_layers=true",)),
    "eagle3-window": Trainer(f"EAGLE-3, window {SWA_WINDOW}", "eagle", "configs/{model}-eagle3.yaml", 3,
                             EAGLE_LAYERS + (f"--eagle.sliding_window={SWA_WINDOW}",)),
    "dflash": Trainer("DFlash", "dflash", "configs/qwen3-8b-dflash.yaml", 6, DFLASH_LAYERS),
    "dflash-ckpt": Trainer("DFlash, checkpointed layers", "dflash", "configs/qwen3-8b-dflash.yaml", 6,
                           DFLASH_LAYERS + ("--dflash.checkpoint_layers=true",)),
    "dflash-1layer": Trainer("DFlash, 1 layer", "dflash", "configs/qwen3-8b-dflash.yaml", 6,
                             DFLASH_LAYERS + ("--dflash.num_hidden_layers=1",), draft_layers=1),
    "medusa": Trainer("Medusa", "medusa", "configs/llama3-8b-medusa.yaml", 1),
    "medusa-shared": Trainer("Medusa, shared lm_head (frozen)", "medusa", "configs/llama3-8b-medusa.yaml", 1,
                             ("--medusa.shared_lm_head=true",)),
    "speculators-eagle3": Trainer("speculators 0.9 EAGLE-3", "speculators-eagle3", "", 3, peer="speculators",
                                  features=("offline",)),
    "speculators-dflash": Trainer("speculators 0.9 DFlash", "speculators-dflash", "", 6, peer="speculators",
                                  features=("offline",)),
    "speculators-dflash-1layer": Trainer("speculators 0.9 DFlash, 1 layer", "speculators-dflash", "", 6,
                                         peer="speculators", features=("offline",), draft_layers=1),
    "specforge-eagle3": Trainer("SpecForge 0.2 EAGLE-3", "specforge-eagle3", "", 3, peer="specforge",
                                features=("offline",)),
}
OURS = ("eagle3", "peagle", "dflash", "medusa", "medusa-shared")
STATE_LABELS = {"bfloat16": "bf16 AdamW state"}
"""--optimizer-state: how a row of ours with train.optimizer_state other than float32 is labelled."""
PEERS = ("speculators-eagle3", "speculators-dflash", "specforge-eagle3")
DRAFT_VOCAB = 32000
TINY_DRAFT_VOCAB = 1024
DFLASH_LAYERS_N, DFLASH_BLOCK, DFLASH_ANCHORS, TTT_STEPS = 5, 16, 512, 7
TINY_ANCHORS = 16
"""--tiny: DFlash's anchored blocks per row (a row of 64 tokens has no room for 512)."""
SPECFORGE_LAYERS = [0, 1, 2]
"""SpecForge's capture layers (SGLang's convention, the layer whose output is the feature: ours - 1, which for the
stand-in's 0, 1, 2 would start at -1, which it refuses). Offline it reads the features from the files and uses the
ids only to check there are three; 0, 1, 2 are layers of the stand-in."""


def our_flags(trainer: Trainer, model: str, seq: int, features: str, standin: Path, cache: Path | None,
              tiny: bool, precision: str, work: Path, optimizer_state: str = "float32",
              anchors: int | None = None) -> list[str]:
    """The config flags of one of our runs: the trainer's config at the stand-in, batch 1, this seq."""
    flags = ["--config", str(ROOT / trainer.config.format(model=model)), f"--verifier={standin}",
             f"--output_dir={work / 'unused-run'}", f"--data.seq_len={seq}", "--train.batch_size=1",
             "--train.grad_accum=1", f"--train.mixed_precision={precision}", "--wandb.enabled=false",
             f"--features={features}", f"--train.optimizer_state={optimizer_state}", *trainer.flags]
    if cache is not None:
        flags.append(f"--feature_cache={cache}")
    if trainer.kind == "eagle" and tiny:
        flags.append(f"--eagle.draft_vocab_size={TINY_DRAFT_VOCAB}")
    if trainer.kind == "dflash" and (model != "qwen3-8b" or tiny):
        flags.append("--dflash.mask_token_id=null")  # the config's id is a row of Qwen3's embedding
    if trainer.kind == "dflash" and (tiny or anchors):
        flags.append(f"--dflash.num_anchors={anchors or TINY_ANCHORS}")
    return flags


# ---- stand-in folders and feature caches -----------------------------------------------------------------------------
def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """A bf16 safetensors file written tensor by tensor (never all in memory): 1-D tensors (norms) ones, matrices
    normal(0, 0.02), drawn in row chunks from one seeded generator."""
    import torch

    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in shapes.items():
            if len(shape) == 1:
                f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
                continue
            rows = max(1, (64 * MIB) // (4 * shape[-1]))
            for start in range(0, shape[0], rows):
                chunk = torch.randn((min(rows, shape[0] - start), *shape[1:]), generator=gen) * 0.02
                f.write(chunk.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    tmp.replace(path)


def build_standin(model: str, layers: int, tiny: bool, work: Path) -> Path:
    """The stand-in folder for `model` with `layers` decoder layers (built once; reused when its stamp matches)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = model_config(model, layers, tiny)
    stamp = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    folder = work / f"standin-{model}{'-tiny' if tiny else ''}-{layers}l"
    if (folder / ".built").is_file() and (folder / ".built").read_text() == stamp:
        return folder
    say(f"building the stand-in {folder.name}: {MODELS[model].name}'s shapes, {layers} decoder layers, random bf16")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".built").unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    hf_config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    write_safetensors(folder / "model.safetensors", shapes, seed=0)
    write_placeholder_tokenizer(folder)
    (folder / ".built").write_text(stamp)
    return folder


def write_placeholder_tokenizer(folder: Path) -> None:
    """A 4-token word-level tokenizer: the loaders require one (and no larger than the vocabulary); the bench's rows
    are random token ids, never text."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "x": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(folder)


def random_rows(vocab: int, seq: int, rows: int, seed: int = 0):
    """(rows, seq) random token ids and all-ones masks: the bench's rows (one document each, every token trained)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    ones = torch.ones(rows, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones,
            "position_ids": torch.arange(seq).expand(rows, seq).contiguous()}


def feature_layers(trainer: Trainer) -> list[int]:
    """Which stand-in layers' inputs the cache holds: EAGLE-3's [0, 1, 2]; DFlash's outputs of 0..4 = inputs of 1..5."""
    return {"eagle": [0, 1, 2], "dflash": [1, 2, 3, 4, 5], "medusa": []}[trainer.kind]


def build_cache(trainer: Trainer, model: str, seq: int, rows: int, standin: Path, tiny: bool, work: Path,
                device: str = "cpu") -> Path:
    """A feature cache in our format (data/hidden_states.py) of random bf16 features for `rows` random rows (EAGLE-3
    and DFlash: with the stand-in's argmax of them, computed on `device`)."""
    import torch

    from draftheads.data.hidden_states import FORMAT, VERSION, shard_name
    from draftheads.models.verifier import fingerprint_files
    from draftheads.train.dump_features import ARGMAX_METHODS, _write_shard, write_index

    config = json.loads((standin / "config.json").read_text())
    method = {"eagle": "eagle3", "dflash": "dflash", "medusa": "medusa"}[trainer.kind]
    layer_ids = feature_layers(trainer)
    argmax = method in ARGMAX_METHODS  # as `dump-features` writes it: the verifier's argmax stored
    folder = work / f"cache-{standin.name}-{method}-{seq}x{rows}{'-argmax' if argmax else ''}"
    if (folder / "index.json").is_file():
        return folder
    say(f"writing the feature cache {folder.name}: random bf16 features, {len(layer_ids)} layers + final")
    H = config["hidden_size"]
    verifier = {"name": str(standin), "fingerprint": fingerprint_files(standin, config),
                **{k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}}
    plan = {"format": FORMAT, "version": VERSION, "method": method, "verifier": verifier,
            "verifier_dtype": "bfloat16", "layer_ids": layer_ids, "dtype": "bfloat16", "seq_len": seq,
            "hidden_size": H, "rows_per_shard": 1, "rows": {"train": rows, "eval": 1},
            "data": {"source": "random token ids (scripts/bench_scale.py)", "seq_len": seq, "seed": 0},
            "argmax": argmax}
    folder.mkdir(parents=True, exist_ok=True)
    head = None
    if argmax:
        from draftheads.models.verifier import Verifier

        head = Verifier.load_head(standin, dtype="bfloat16", device=device)
    gen = torch.Generator().manual_seed(1)
    for split, n in plan["rows"].items():
        tokens = random_rows(config["vocab_size"], seq, n, seed=2 + (split == "eval"))
        for r in range(n):
            tensors = {k: v[r:r + 1].to(dtype).contiguous() for k, v in tokens.items()
                       for dtype in [{"input_ids": torch.int32, "position_ids": torch.int32}.get(k, torch.int8)]}
            tensors["final"] = torch.randn(1, seq, H, generator=gen).to(torch.bfloat16)
            if layer_ids:
                tensors["layers"] = torch.randn(1, len(layer_ids), seq, H, generator=gen).to(torch.bfloat16)
            if head is not None:
                tensors["argmax"] = head.head_argmax(tensors["final"])
            _write_shard(folder, shard_name(split, r), tensors, 1, plan)  # the dump's own shard writer
    write_index(folder, plan)
    del head
    if device == "cuda":
        torch.cuda.empty_cache()  # the children measure; this process keeps none of the head
    return folder


# ---- the peers' inputs: the same stand-ins, random features in their formats ---------------------------------------
def draft_vocab_maps(vocab: int, draft: int):
    """(d2t (Vd,) offsets, t2d (V,) bool): a draft vocabulary of `draft` random token ids (which ones does not
    change the cost), in the maps' usual form (draft id i -> target id i + d2t[i])."""
    import torch

    keep = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(draft), t2d


def speculators_data(kind: str, config: dict, seq: int, rows: int, folder: Path, draft: int) -> Path:
    """speculators' offline layout (scripts/bench_peers.write_speculators_data): rows + 1 random documents (the
    last its validation tail), hidden_states (T, layers + 1, H) random bf16: the layers read, then the last
    pre-norm state."""
    import torch

    from bench_peers import write_speculators_data

    if (folder / ".done").is_file():
        return folder
    n_layers = 3 if kind == "speculators-eagle3" else DFLASH_LAYERS_N
    tokens = random_rows(config["vocab_size"], seq, rows + 1, seed=2)
    gen = torch.Generator().manual_seed(1)

    def docs():
        for r in range(rows + 1):
            yield {"input_ids": tokens["input_ids"][r], "loss_mask": tokens["loss_mask"][r],
                   "hidden_states": torch.randn(seq, n_layers + 1, config["hidden_size"], generator=gen
                                                ).to(torch.bfloat16)}

    d2t, t2d = draft_vocab_maps(config["vocab_size"], draft)
    write_speculators_data(folder, docs(), d2t, t2d)
    (folder / ".done").write_text("")
    return folder


def specforge_data(config: dict, seq: int, rows: int, folder: Path, draft: int) -> Path:
    """SpecForge's offline layout (as scripts/bench_peers.dump_specforge): one torch-saved dict per row, random bf16
    hidden_state (1, T, H) and aux_hidden_state (1, T, 3H), and the vocabulary maps."""
    import torch

    if (folder / ".done").is_file():
        return folder
    (folder / "features").mkdir(parents=True, exist_ok=True)
    tokens = random_rows(config["vocab_size"], seq, rows, seed=2)
    gen = torch.Generator().manual_seed(1)
    H = config["hidden_size"]
    for r in range(rows):
        torch.save({"input_ids": tokens["input_ids"][r], "loss_mask": tokens["loss_mask"][r],
                    "hidden_state": torch.randn(1, seq, H, generator=gen).to(torch.bfloat16),
                    "aux_hidden_state": torch.randn(1, seq, 3 * H, generator=gen).to(torch.bfloat16)},
                   folder / "features" / f"data_{r:06d}.ckpt")
    d2t, t2d = draft_vocab_maps(config["vocab_size"], draft)
    torch.save({"d2t": d2t, "t2d": t2d}, folder / "vocab_mapping.pt")
    (folder / ".done").write_text("")
    return folder


def peer_spec(kind: str, model: str, seq: int, rows: int, standin: Path, tiny: bool, work: Path, device: str,
              run: Path, draft_layers: int | None = None, anchors: int | None = None) -> dict:
    """What scripts/bench_scale_peer.py runs: the peer's own training command at the bench's settings (batch 1,
    one row of `seq` tokens per step, 7 TTT steps / block 16 and 512 anchors, AdamW, lr of our configs), on
    `rows` rows of random features written in its format."""
    config = json.loads((standin / "config.json").read_text())
    draft = TINY_DRAFT_VOCAB if tiny else DRAFT_VOCAB
    cpu = device == "cpu"
    if kind.startswith("speculators"):
        data = speculators_data(kind, config, seq, rows, work / f"{kind}-{standin.name}-{seq}x{rows}", draft)
        flags = ["--verifier-name-or-path", str(standin), "--data-path", str(data), "--num-workers", "0",
                 "--hidden-states-dtype", "bfloat16", "--total-seq-len", str(seq),
                 "--train-data-ratio", str((rows + 0.5) / (rows + 1)), "--optimizer", "adamw",
                 "--weight-decay", "0.0", "--scheduler-type", "cosine", "--epochs", "1", "--seed", "0",
                 "--save-path", str(run / "save"), "--log-dir", str(run / "logs"), "--no-resume-from-checkpoint",
                 *(["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"] if cpu else [])]
        if kind == "speculators-eagle3":
            flags += ["--speculator-type", "eagle3", "--num-layers", "1", "--draft-arch", "llama",
                      "--target-layer-ids", "0", "1", "2", "--draft-vocab-size", str(draft),
                      "--d2t-path", str(data / f"d2t-{draft}.npy"), "--t2d-path", str(data / f"t2d-{draft}.npy"),
                      "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
                      "--sliding-window", str(seq * 4), "--ttt-steps", str(TTT_STEPS), "--ttt-step-loss-decay", "0.8",
                      "--lr", "1e-4"]
        else:  # the verifier's vocabulary (no draft vocabulary), as configs/qwen3-8b-dflash.yaml
            flags += ["--speculator-type", "dflash", "--num-layers", str(draft_layers or DFLASH_LAYERS_N),
                      "--target-layer-ids", *map(str, range(DFLASH_LAYERS_N)), "--block-size", str(DFLASH_BLOCK),
                      "--max-anchors", str(anchors or (TINY_ANCHORS if tiny else DFLASH_ANCHORS)), "--lr", "6e-4"]
        return {"peer": "speculators", "flags": flags}
    import yaml

    data = specforge_data(config, seq, rows, work / f"{kind}-{standin.name}-{seq}x{rows}", draft)
    run.mkdir(parents=True, exist_ok=True)
    layer = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                         "max_position_embeddings", "rope_theta", "rope_scaling", "vocab_size",
                                         "bos_token_id", "eos_token_id")}
    draft_config = {**layer, "model_type": "llama", "num_hidden_layers": 1, "attention_bias": False,
                    "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": SPECFORGE_LAYERS}}
    (run / "draft.json").write_text(json.dumps(draft_config, indent=1))
    run_cfg = {"model": {"target_model_path": str(standin), "draft_model_config": str(run / "draft.json"),
                         "vocab_mapping_path": str(data / "vocab_mapping.pt"),
                         "aux_hidden_state_layer_ids": SPECFORGE_LAYERS, "torch_dtype": "bfloat16"},
               "data": {"hidden_states_path": str(data / "features"), "max_length": seq},
               "training": {"num_epochs": 1, "batch_size": 1, "accumulation_steps": 1, "max_steps": rows,
                            "fsdp_sharding": "NO_SHARD", "learning_rate": 1e-4, "warmup_ratio": 0.02,
                            "lr_scheduler": "cosine", "ttt_length": TTT_STEPS, "log_interval": 1, "seed": 0,
                            **({"attention_backend": "sdpa"} if cpu else {})},
               "output_dir": str(run / "out")}
    (run / "run.yaml").write_text(yaml.safe_dump(run_cfg))
    env = {"SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1"} if cpu else {}
    return {"peer": "specforge", "run_yaml": str(run / "run.yaml"), "env": env}


# ---- our child: one measurement in its own process -------------------------------------------------------------------
def build_our_step(kind: str, cfg, verifier):
    """(step(batch), the modules it holds, its optimizer): the trainer's drafter, loss, features and AdamW."""
    import torch

    from bench_train import autocast  # the trainers' mixed precision; the child runs as a script: its folder is on
    #                                   the path (scale_meter, bench_train, bench_peers)
    from draftheads.train.features import feature_source
    from draftheads.train.optim import build_optimizer

    if kind == "eagle":
        from draftheads.models.eagle import EagleTrainModule, build_drafter, count_tokens
        from draftheads.train.eagle import hold_draft_rows

        counts = count_tokens(torch.randint(0, verifier.vocab_size, (1, 65536)), torch.ones(1, 65536, dtype=torch.long),
                              verifier.vocab_size)
        model = EagleTrainModule(build_drafter(verifier, cfg.eagle, token_counts=counts)).train()
        hold_draft_rows(cfg, model.drafter, verifier)  # as train/eagle.py: offline, the draft rows of lm_head only
        features = feature_source(cfg, verifier, layer_ids=model.drafter.feature_layers)

        def forward(batch, feats):
            return model(batch["input_ids"], feats, batch["loss_mask"], batch.get("position_ids")).loss
    elif kind == "dflash":
        from draftheads.models.dflash import DFlashTrainModule, build_drafter

        model = DFlashTrainModule(build_drafter(verifier, cfg.dflash)).train()
        features = feature_source(cfg, verifier, layer_ids=model.drafter.feature_layers)

        def forward(batch, feats):
            return model(batch["input_ids"], feats, batch["loss_mask"], position_ids=batch.get("position_ids")).loss
    else:
        from draftheads.models.medusa import MedusaHeads
        from draftheads.train.medusa import HeadsObjective

        heads = MedusaHeads.from_config(cfg.medusa, verifier)
        model = HeadsObjective(heads, cfg.medusa).train()
        features = feature_source(cfg, verifier, return_logits=cfg.medusa.loss == "distill")

        def forward(batch, feats):
            return model(feats, batch)[0]
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict) -> None:  # as bench_train's steps and the trainers' loops: features outside autocast
        feats = features(batch)
        with autocast(cfg, verifier.device):
            loss = forward(batch, feats)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, [model, verifier], optimizer  # the verifier's tensors: its model's and the lm_head rows it kept


def child(spec_path: str) -> int:
    """Run one measurement (SPEC.json from the parent) and write its report; exit 0 unless the bench is broken."""
    spec = json.loads(Path(spec_path).read_text())
    out = spec["report"]
    import torch

    from scale_meter import Enough, StepMeter, write_failure

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    meter = StepMeter(spec["warmup"], spec["steps"]).install()
    device = torch.device(spec["device"])
    limit = spec["memory_gib"] * GIB
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    from draftheads.train.config import parse_config
    from draftheads.train.placement import load_verifier

    module, _, name = spec["config_class"].partition(":")
    import importlib

    cfg = parse_config(getattr(importlib.import_module(module), name), spec["flags"])
    # offline: only what the trainer holds of the verifier then (embedding, lm_head, final norm), as train/placement does
    verifier, _ = load_verifier(cfg, device, head_only=cfg.features == "offline")
    rows = spec["warmup"] + spec["steps"]
    if cfg.features == "offline":
        from draftheads.data.hidden_states import CachedRows, collate_cached, read_index

        cached = CachedRows(cfg.feature_cache, read_index(cfg.feature_cache), "train")

        def batch_at(i):  # read from the cache in the step, as the trainer's loader does
            return {k: v.to(device) for k, v in collate_cached([cached[i % len(cached)]]).items()}
    else:
        data = random_rows(verifier.vocab_size, cfg.data.seq_len, rows)

        def batch_at(i):
            return {k: v[i:i + 1].to(device) for k, v in data.items()}
    step, modules, optimizer = build_our_step(spec["kind"], cfg, verifier)
    meter.watch(*modules)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    # weights now, gradients and AdamW's two moments as the first step will make them (train.optimizer_state)
    from scale_meter import memory_split

    moment = {"float32": None, "bfloat16": 2}[cfg.train.optimizer_state]
    # on a GPU what the device holds (the verifier's embedding may stay in host memory: verifier_embedding)
    expected = (memory_split(modules, [], device.type)["weights_bytes"]
                + sum(p.numel() * (p.element_size() + 2 * (moment or p.element_size())) for p in trainable))
    extra = {"trainable_params": sum(p.numel() for p in trainable), "static_expected_bytes": expected,
             "tokens_per_step": cfg.data.seq_len}
    if expected > limit:
        write_failure(out, f"did not fit: weights, gradients and AdamW state alone are {expected / GIB:.1f} GiB "
                           f"> --memory-gib {spec['memory_gib']:g}", {**extra, "did_not_fit": True})
        return 0
    try:
        for i in range(rows):
            step(batch_at(i))
    except Enough:
        pass
    except torch.OutOfMemoryError as err:
        write_failure(out, f"did not fit: CUDA out of memory at --memory-gib {spec['memory_gib']:g} ({err})",
                      {**extra, "did_not_fit": True})
        return 0
    meter.write(out, extra)
    return 0


# ---- the parent: the ladder, the children, the table -----------------------------------------------------------------
def available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return float("inf")


def rss_of(pid: int) -> float:
    """Resident GiB of a process now (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 0.0


def run_child(cmd: list[str], report: Path, log: Path, memory_gib: float, watch_rss: bool, timeout: float,
              env: dict | None = None) -> dict:
    """Run one measuring child; its report, or a one-line failure: killed past --memory-gib (RSS polled every
    0.2 s), killed by the system, timed out, or its own error (the log's last line)."""
    report.unlink(missing_ok=True)
    started = time.perf_counter()
    killed, top = None, 0.0
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                                start_new_session=True)  # its own process group: killed whole, with any helpers
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                rss = rss_of(proc.pid) if watch_rss else 0.0
                top = max(top, rss)
                if watch_rss and rss > memory_gib:
                    killed = f"did not fit: killed at {rss:.1f} GiB RSS (--memory-gib {memory_gib:g})"
                elif time.perf_counter() - started > timeout:
                    killed = f"timed out after {timeout:.0f} s"
                if killed:
                    break
        finally:  # killed past the limit, or the bench itself stopped (Ctrl-C, SIGTERM): the child goes too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    code = proc.returncode
    seconds = time.perf_counter() - started
    if killed:
        return {"error": killed, "did_not_fit": killed.startswith("did not fit"), "peak_rss_mib": top * 1024,
                "wall_seconds": seconds}
    if report.is_file():
        result = json.loads(report.read_text())
        result["wall_seconds"] = seconds
        return result
    lines = [x for x in log.read_text(errors="replace").strip().splitlines() if x.strip()]
    if code in (-signal.SIGKILL, 137):
        return {"error": f"did not fit: killed by the system (SIGKILL) at {top:.1f} GiB RSS", "did_not_fit": True,
                "peak_rss_mib": top * 1024}
    last = lines[-1][:300] if lines else f"exit status {code}"
    return {"error": f"failed (exit {code}): {last}; log {log}"}


def predict_gib(rows: list[dict], seq: int) -> float | None:
    """The peak at `seq` from the rungs measured so far: linear in the tokens through the last two, or from one
    (static + rest x seq / its seq, i.e. all of the rest taken to grow: an over-estimate)."""
    done = sorted((r for r in rows if r.get("peak_gib")), key=lambda r: r["seq"])
    if not done:
        return None
    last = done[-1]
    if len(done) >= 2:
        prev = done[-2]
        slope = (last["peak_gib"] - prev["peak_gib"]) / (last["seq"] - prev["seq"])
        return last["peak_gib"] + max(slope, 0.0) * (seq - last["seq"])
    fixed = (last.get("static_gib") or 0.0) + (last.get("baseline_gib") or 0.0)
    return fixed + (last["peak_gib"] - fixed) * seq / last["seq"]


def row_key(r: dict) -> tuple:
    return (r["trainer"], r["model"], r["features"], r["seq"], r.get("optimizer_state", "float32"))


def summarize(result: dict, device: str) -> dict:
    """The table's numbers from a child's report."""
    row = {k: result.get(k) for k in ("error", "did_not_fit", "trainable_params", "steps_measured", "threads",
                                      "step_seconds", "step_cpu_seconds", "cuda_device")}
    if result.get("error"):
        row["status"] = "did not fit" if result.get("did_not_fit") else "error"
        if result.get("peak_rss_mib"):
            row["peak_rss_gib"] = result["peak_rss_mib"] / 1024
        return row
    peak_mib = result["cuda_max_allocated_mib"] if device == "cuda" else result["peak_rss_mib"]
    tokens, s, cpu = result["tokens_per_step"], result["seconds_per_step"], result["cpu_seconds_per_step"]
    row.update(status="ok", peak_gib=peak_mib / 1024, peak_rss_gib=result["peak_rss_mib"] / 1024,
               seconds_per_step=s, cpu_seconds_per_step=cpu, tokens_per_step=tokens,
               tokens_per_s=tokens / s if s else None, tokens_per_cpu_s=tokens / cpu if cpu else None)
    if result.get("static_bytes") is not None:
        static = result["static_bytes"] / GIB
        row.update(static_gib=static, weights_gib=result["weights_bytes"] / GIB,
                   baseline_gib=result.get("baseline_rss_mib", 0) / 1024 if device == "cpu" else 0.0,
                   grads_gib=result["grads_bytes"] / GIB, optimizer_gib=result["optimizer_bytes"] / GIB,
                   rest_gib=row["peak_gib"] - static,
                   rest_mib_per_token=(row["peak_gib"] - static) * 1024 / tokens)
    return row


@dataclass
class Bench:
    args: argparse.Namespace
    out: Path
    work: Path
    settings: dict
    rows: list = field(default_factory=list)

    @property
    def json_path(self) -> Path:
        return self.out / f"scale-{self.args.device}{'-tiny' if self.args.tiny else ''}.json"

    @property
    def md_path(self) -> Path:
        return self.json_path.with_suffix(".md")

    def load(self) -> dict:
        """Rows of an earlier run with the same settings (--reuse), by (trainer, model, features, seq)."""
        if not (self.args.reuse and self.json_path.is_file()):
            return {}
        old = json.loads(self.json_path.read_text())
        if old.get("settings") != self.settings:
            diff = sorted(k for k in self.settings if old.get("settings", {}).get(k) != self.settings[k])
            say(f"--reuse: {self.json_path} was measured with other settings ({', '.join(diff)}); measuring again")
            return {}
        return {row_key(r): r for r in old["rows"]}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"settings": self.settings, "command": self.settings_command(), "rows": self.rows}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.json_path)
        self.md_path.write_text(markdown(doc))

    def settings_command(self) -> str:
        return "python scripts/bench_scale.py " + " ".join(shlex.quote(a) for a in self.args.argv)


def settings_of(args) -> dict:
    import torch

    from draftheads.models.tiny.pretrain import native_bf16

    cuda = args.device == "cuda"
    bf16 = cuda or native_bf16()
    return {"device": args.device, "tiny": args.tiny, "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads, "precision": "bf16" if bf16 else "no",
            "precision_note": ("bf16 autocast (CUDA)" if cuda else "bf16 autocast (this CPU multiplies bf16 natively)"
                               if bf16 else "fp32 (this CPU has no native bf16)"),
            "batch": 1, "torch": torch.__version__,
            "cpu": platform_cpu() if not cuda else None,
            **({"dflash_anchors": args.anchors}
               if args.anchors and any("dflash" in TRAINERS[t].kind for t in args.trainers) else {})}


def platform_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def measure(bench: Bench, trainer_name: str, model: str, features: str, seq: int, standin: Path,
            optimizer_state: str = "float32") -> dict:
    """One row: write the child's spec (and the features it reads), run it, summarize."""
    args, work = bench.args, bench.work
    trainer = TRAINERS[trainer_name]
    rows = args.warmup + args.steps
    tag = (f"{trainer_name}-{model}-{features}-{seq}" + ("" if optimizer_state == "float32" else f"-{optimizer_state}")
           + (f"-a{args.anchors}" if bench.settings.get("dflash_anchors") and "dflash" in trainer.kind else ""))
    spec_path, report, log = work / f"{tag}.spec.json", work / f"{tag}.report.json", bench.out / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    spec = {"trainer": trainer_name, "kind": trainer.kind, "model": model, "seq": seq, "features": features,
            "warmup": args.warmup, "steps": args.steps, "threads": args.threads, "device": args.device,
            "memory_gib": args.memory_gib, "report": str(report), "standin": str(standin), "tiny": args.tiny}
    env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if trainer.peer is None:
        cache = (build_cache(trainer, model, seq, rows, standin, args.tiny, work, args.device)
                 if features == "offline" else None)
        spec.update(flags=our_flags(trainer, model, seq, features, standin, cache, args.tiny,
                                    bench.settings["precision"], work, optimizer_state, args.anchors),
                    config_class={"eagle": "draftheads.train.eagle:EagleRunConfig",
                                  "dflash": "draftheads.train.dflash:DFlashRunConfig",
                                  "medusa": "draftheads.train.medusa:MedusaRunConfig"}[trainer.kind])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
    else:
        python = ROOT / f".venv-{trainer.peer}" / "bin" / "python"
        if not python.is_file():
            return {"status": "error", "error": f"not run: {python.parent.parent.name} is missing "
                                                "(bash scripts/setup_peers.sh)"}
        spec.update(peer_spec(trainer.kind, model, seq, rows, standin, args.tiny, work, args.device,
                              work / f"{tag}.run", trainer.draft_layers, args.anchors))
        cmd = [str(python), str(ROOT / "scripts" / "bench_scale_peer.py"), str(spec_path)]
        env.update(spec.pop("env", {}))
    spec_path.write_text(json.dumps(spec, indent=1))
    result = run_child(cmd, report, log, args.memory_gib, args.device == "cpu", args.timeout, env)
    return summarize(result, args.device)


def wait_for_memory(need_gib: float, patience: float) -> bool:
    """Wait (up to `patience` seconds) until the machine has `need_gib` available; whether it has."""
    deadline = time.time() + patience
    warned = False
    while available_gib() < need_gib:
        if time.time() > deadline:
            return False
        if not warned:
            say(f"waiting for {need_gib:.1f} GiB of available memory (now {available_gib():.1f} GiB)")
            warned = True
        time.sleep(10)
    return True


def ladder(args) -> list[int]:
    if args.seqs:
        return sorted(set(args.seqs))
    start = 64 if args.tiny else 1024
    seqs, s = [], start
    while s <= args.max_seq:
        seqs.append(s)
        s *= 2
    return seqs


def run(args) -> dict:
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, out, work, settings_of(args))
    previous = bench.load()
    bench.rows = list(previous.values())  # --reuse: rows of other trainers, models and seqs stay in the table
    say(f"{bench.settings['precision_note']}; device {args.device}; {args.threads} threads; memory limit "
        f"{args.memory_gib:g} GiB; out {bench.json_path}")
    for trainer_name in args.trainers:
        trainer = TRAINERS[trainer_name]
        for model in args.models:
            if trainer.kind in ("dflash", "speculators-dflash") and model != "qwen3-8b" and not args.all_pairs:
                continue  # DFlash's config is Qwen3-8B's (z-lab's drafter); --all-pairs measures it on Llama too
            if trainer.kind == "medusa" and model != "llama3-8b" and not args.all_pairs:
                continue
            standin = None
            runs = [(f, state) for f in args.features for state in
                    (args.optimizer_state if trainer.peer is None else ["float32"])]
            for features, state in runs:
                if features not in trainer.features:
                    continue
                label = trainer.label + ("" if state == "float32" else f" ({STATE_LABELS[state]})")
                done: list[dict] = []
                for seq in ladder(args):
                    key = (trainer_name, model, features, seq, state)
                    old = previous.get(key)
                    if old and (old["status"] == "ok" or old["status"] == "did not fit"
                                and old.get("memory_gib", 0) >= args.memory_gib):
                        say(f"{label} {model} {features} seq {seq}: kept from {bench.json_path.name}")
                        row = old
                    else:
                        predicted = predict_gib(done, seq)
                        base = {"trainer": trainer_name, "label": label, "model": model,
                                "features": features, "seq": seq, "memory_gib": args.memory_gib,
                                "predicted_gib": predicted, "command": bench.settings_command(),
                                **({} if state == "float32" else {"optimizer_state": state})}
                        if predicted is not None and predicted > args.memory_gib:
                            row = {**base, "status": "did not fit", "did_not_fit": True,
                                   "error": f"did not fit: predicted {predicted:.1f} GiB > --memory-gib "
                                            f"{args.memory_gib:g} (not run)"}
                        else:
                            need = min(predicted or (1.0 if args.tiny else FIRST_RUNG_GIB), args.memory_gib)
                            big = args.device == "cpu" and need > BIG_CHILD_GIB
                            if big and not wait_for_memory(need, args.patience):
                                say(f"{label} {model} {features} seq {seq}: the machine never had "
                                    f"{need:.1f} GiB available; not run (rerun with --reuse)")
                                break
                            if standin is None:
                                standin = build_standin(model, trainer.standin_layers, args.tiny, work)
                            say(f"{label} {model} features {features} seq {seq}: measuring"
                                + (f" (predicted {predicted:.1f} GiB)" if predicted else ""))
                            row = {**base, **measure(bench, trainer_name, model, features, seq, standin, state)}
                    bench.rows = [r for r in bench.rows if row_key(r) != key] + [row]
                    bench.save()
                    say(f"  -> {one_line(row)}")
                    done.append(row)
                    if row["status"] != "ok":
                        break  # longer rows do not fit either, and an error repeats
    bench.save()
    print(markdown({"settings": bench.settings, "command": bench.settings_command(), "rows": bench.rows}))
    return {"settings": bench.settings, "rows": bench.rows}


def one_line(r: dict) -> str:
    if r["status"] != "ok":
        return r.get("error") or r["status"]
    return (f"peak {r['peak_gib']:.2f} GiB, {r['seconds_per_step']:.2f} s/step, {r['cpu_seconds_per_step']:.2f} "
            f"CPU-s/step, {r['tokens_per_s']:.0f} tokens/s")


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(doc: dict) -> str:
    s = doc["settings"]
    commands = dict.fromkeys([r["command"] for r in doc["rows"] if r.get("command")] or [doc["command"]])
    where = s.get("cpu") or next((r.get("cuda_device") for r in doc["rows"] if r.get("cuda_device")), "CUDA")
    lines = [
        f"# Scale bench ({s['device']}{', tiny shapes' if s['tiny'] else ''})", "",
        *(f"    {c}" for c in commands), "",
        f"{where}; {s['precision_note']}; batch 1; {s['threads']} threads; {s['warmup']} warm-up step(s), then the "
        f"median of {s['steps']}; torch {s['torch']}"
        + (f"; DFlash: {s['dflash_anchors']} anchored blocks per row (ours and speculators')"
           if s.get("dflash_anchors") else "") + ". Stand-ins: random weights with the model's shapes and only the "
        "layers the trainer reads (EAGLE-3 / P-EAGLE 3, DFlash 6, Medusa 1; see scripts/bench_scale.py): `online` "
        "runs those layers, not the model's 32 or 36, so its times and memory are a floor; `offline` reads random "
        "bf16 features from a cache. Peak: RSS of the trainer's process" + (" (CUDA: max_memory_allocated)"
                                                                             if s["device"] == "cuda" else "")
        + "; static: weights held (the verifier's too), gradients and optimizer state; rest = peak - static.", "",
        "| trainer | model | features | seq | peak GiB | static GiB (weights + grads + optimizer) | rest GiB | "
        "rest MiB/token | s/step | CPU-s/step | tokens/s | tokens/CPU-s | trainable |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(doc["rows"], key=lambda r: (list(TRAINERS).index(r["trainer"]) if r["trainer"] in TRAINERS
                                                 else 99, r["model"], r["features"], r["seq"],
                                                 r.get("optimizer_state") or "")):
        head = f"| {r.get('label', r['trainer'])} | {r['model']} | {r['features']} | {r['seq']} |"
        params = f"{r['trainable_params'] / 1e6:.1f}M" if r.get("trainable_params") else "-"
        if r["status"] != "ok":
            lines.append(f"{head} {r.get('error') or r['status']} | | | | | | | | {params} |")
            continue
        static = (f"{r['static_gib']:.2f} ({r['weights_gib']:.2f} + {r['grads_gib']:.2f} + "
                  f"{r['optimizer_gib']:.2f})" if r.get("static_gib") is not None else "-")
        lines.append(f"{head} {r['peak_gib']:.2f} | {static} | {fmt(r.get('rest_gib'), '.2f')} | "
                     f"{fmt(r.get('rest_mib_per_token'), '.2f')} | {r['seconds_per_step']:.2f} | "
                     f"{r['cpu_seconds_per_step']:.2f} | {fmt(r['tokens_per_s'], '.1f')} | "
                     f"{fmt(r['tokens_per_cpu_s'], '.1f')} | {params} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", nargs="+", default=list(OURS + PEERS), choices=list(TRAINERS),
                   help="ours (eagle3 peagle dflash medusa; on request eagle3-frozen: EAGLE-3 with speculators' "
                        "settings, eagle3-window, eagle3-ckpt and dflash-ckpt: with checkpoint_layers, "
                        "dflash-1layer: one drafter layer) and the peers (offline only; on request "
                        "speculators-dflash-1layer, the pair of dflash-1layer)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seqs", nargs="+", type=int, help="these seq lengths only (default: the ladder 1024, 2048, ... "
                                                       "while it fits)")
    p.add_argument("--max-seq", type=int, default=131072, help="the ladder's top")
    p.add_argument("--features", nargs="+", default=["online", "offline"], choices=["online", "offline"])
    p.add_argument("--optimizer-state", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="our trainers' train.optimizer_state, a row each (the peers keep their own AdamW)")
    p.add_argument("--steps", type=int, default=2, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-gib", type=float, default=20.0,
                   help="a row whose peak would pass this does not fit (CPU: RSS; CUDA: allocated)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each child")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--work", help="stand-ins, feature caches, specs (default OUT/work; several GiB at 8B shapes)")
    p.add_argument("--reuse", action="store_true", help="keep rows already measured in OUT with the same settings")
    p.add_argument("--tiny", "--dry-run", action="store_true", dest="tiny",
                   help="small shapes (hidden 256, vocab 4k), seqs 64 and 128: the whole pipeline in under a minute")
    p.add_argument("--all-pairs", action="store_true",
                   help="also DFlash on Llama-3.1-8B and Medusa on Qwen3-8B (their configs are the other model's)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a child is stopped")
    p.add_argument("--patience", type=float, default=1800,
                   help="seconds to wait for free memory before a big child; then the row is left for --reuse")
    p.add_argument("--anchors", type=int,
                   help="DFlash's anchored blocks per row, ours and speculators' (default: the config's 512; 16 with "
                        "--tiny)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.tiny and not args.seqs:
        args.seqs = [64, 128]
    for name, value in (("--steps", args.steps), ("--threads", args.threads),
                        ("--anchors", 1 if args.anchors is None else args.anchors)):
        if value < 1:
            p.error(f"{name}={value}: expected at least 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: expected 0 or more")
    if not args.memory_gib > 0:
        p.error(f"--memory-gib={args.memory_gib}: expected a number of GiB > 0")
    if args.seqs and min(args.seqs) < 32:
        p.error(f"--seqs {args.seqs}: expected lengths of at least 32 tokens")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here")
    return args


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    args = parse(argv)
    if argv is None:  # a SIGTERM ends the bench as Ctrl-C does: the running child is killed, the rows so far kept
        signal.signal(signal.SIGTERM, interrupted)
    if args.child:
        return child(args.child)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
