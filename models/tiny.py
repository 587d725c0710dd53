"""The embedded default verifier: a small Llama trained from scratch on the Python standard library's source.

No model hub is needed anywhere in draftheads: this module trains a byte-level BPE tokenizer and a Llama-architecture
causal LM on the stdlib's `verifier` split (see `data.stdlib`) and saves them as an ordinary Hugging Face model folder
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json, a ChatML chat
template) that `AutoModelForCausalLM` / `AutoTokenizer` / `Verifier.from_pretrained` load offline.

    python -m models.tiny build --recipe default|micro [--out DIR] [--seed N] [--force]
    python -m models.tiny path  --recipe default      # print the cached folder, building it first if needed

`ensure_built("default")` is what `Verifier.from_pretrained("tiny-code")` calls: the folder lives in
`$DRAFTHEADS_HOME/<name>` (default `~/.cache/draftheads`), is built once under a file lock into a temp folder that is
renamed into place, and is rebuilt when the recipe (or this builder) changes.

A build is a fixed number of optimizer steps over a fixed data order from `torch.manual_seed(seed)`: the same seed on
the same machine (and thread count) gives the same bytes. Training uses bf16 autocast where the CPU multiplies bf16
natively (AVX512-BF16 / AMX; ~2.3x faster here) and fp32 elsewhere; the saved weights are always fp32. The
decoder's matrices train with Muon (torch.optim.Muon), the rest with AdamW: at equal steps Muon reached a held-out
loss ~0.5 nats/token lower than AdamW here, for ~10% more time per step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

if __name__ == "__main__":
    # libgomp's worker threads spin while they wait; on a shared machine that made training ~6x slower (measured),
    # sleeping costs little on a quiet one. Only effective before torch is imported, i.e. in the CLI (which is
    # also how `ensure_built` builds).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from models.atomic import atomic_dir
from models.schedule import warmup_cosine

#: Bumped whenever the build code changes what a recipe produces; part of the recorded recipe hash.
BUILDER_VERSION = 2  # 2: the learning rate comes from models/schedule.py (the trainers' warm-up formula)
BUILD_INFO = "draftheads_build.json"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2

#: ChatML. The assistant's content and its <|im_end|> sit in a generation block, so
#: `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly those tokens (not the header, not the
#: newline after <|im_end|>).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Pre-tokenizer split (GPT-4 style): words keep one leading space, digits go in threes, a newline run is a piece of
#: its own (so the "\n" ending a ChatML header never merges with the content after it), indentation is one piece.
PRETOKENIZE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Precision = Literal["auto", "bf16", "fp32"]


@dataclass(frozen=True)
class Recipe:
    """Everything that decides what a build produces (besides the seed). Its hash is recorded in the folder."""

    name: str
    """Folder name under $DRAFTHEADS_HOME (`tiny-code`, `tiny-micro`)."""
    vocab_size: int = 4096
    """BPE vocabulary size, the three special tokens included."""
    tokenizer_files: int | None = None
    """Train the tokenizer on the first N files of the `verifier` split (sorted); None: all of them."""
    train_files: int | None = None
    """Train the model on the first N files of the `verifier` split; None: all of them."""
    eval_files: int | None = None
    """Held-out bits per byte over the first N files of the `eval` split; None: all of them, 0: skip."""
    hidden_size: int = 256
    """Model width H."""
    intermediate_size: int = 768
    """SwiGLU MLP width."""
    num_layers: int = 8
    """Decoder layers; >= 4 so EAGLE-3's feature layers 2, L//2, L-3 exist (distinct from 7 layers on)."""
    num_heads: int = 4
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads; fewer than num_heads (GQA) like the real models drafters are trained for."""
    seq_len: int = 512
    """Training context: packed windows of this many tokens."""
    max_position_embeddings: int = 2048
    """Recorded in config.json; generation past seq_len works but was not trained on."""
    rope_theta: float = 10000.0
    """RoPE base."""
    init_std: float = 0.02
    """Normal init std of every matrix (config.initializer_range)."""
    scaled_residual_init: bool = True
    """GPT-2 style: o_proj and down_proj start at init_std / sqrt(2 * num_layers), so the residual stream's scale
    does not grow with depth."""
    batch_size: int = 8
    """Packed windows per optimizer step."""
    steps: int = 900
    """Optimizer steps (the budget is steps, never wall-clock, so builds are reproducible)."""
    optimizer: Literal["adamw", "muon"] = "muon"
    """adamw: AdamW everywhere. muon: Muon on the decoder layers' matrices, AdamW on embeddings, lm_head, norms."""
    lr: float = 2e-3
    """Peak learning rate (Muon's update is scaled to AdamW's RMS, so the same value serves both)."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 50
    """Linear warmup from ~0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms)."""
    beta2: float = 0.95
    """AdamW beta2 (beta1 is 0.9); Muon's momentum is 0.95 (Nesterov)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    precision: Precision = "auto"
    """Training autocast: auto = bf16 where the CPU has native bf16 matmuls, else fp32. Weights stay fp32."""
    eval_batch_size: int = 8
    """Windows per forward when measuring held-out bits per byte."""

    def __post_init__(self):
        if self.num_layers < 4:
            raise ValueError(f"recipe {self.name!r}: num_layers={self.num_layers}; EAGLE-3 needs >= 4")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"recipe {self.name!r}: hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads} do not divide")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"recipe {self.name!r}: vocab_size={self.vocab_size} is below the 256 bytes + specials")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"recipe {self.name!r}: warmup_steps={self.warmup_steps} must be in [0, steps)")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"recipe {self.name!r}: optimizer={self.optimizer!r}; expected adamw or muon")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"recipe {self.name!r}: precision={self.precision!r}; expected auto, bf16 or fp32")

    def digest(self) -> str:
        """Hash of the recipe and the builder version: a cached folder with another digest is rebuilt."""
        blob = json.dumps({"builder": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


RECIPES: dict[str, Recipe] = {
    # ~12.5 minutes on 2 quiet CPU cores with native bf16 (see README for the measured figures)
    "default": Recipe(name="tiny-code"),
    # for tests: Python-looking greedy text in well under a minute
    "micro": Recipe(
        name="tiny-micro", vocab_size=1024, tokenizer_files=80, eval_files=4, hidden_size=128,
        intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=128, batch_size=8, steps=300,
        lr=5e-3, warmup_steps=20,
    ),
}


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"unknown tiny verifier recipe {recipe!r}; expected one of {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise ValueError(f"unknown recipe field(s) {sorted(unknown)}; see models.tiny.Recipe")
    return dataclasses.replace(recipe, **overrides) if overrides else recipe


# ---- small helpers ----------------------------------------------------------------------------------------------------
def _quiet() -> bool:
    return os.environ.get("DRAFTHEADS_QUIET", "") not in ("", "0", "false", "False")


def _log(msg: str) -> None:
    if not _quiet():
        print(f"[tiny] {msg}", file=sys.stderr, flush=True)


def _bar(iterable=None, disable: bool = False, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=disable or _quiet(), dynamic_ncols=True, file=sys.stderr, **kwargs)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _load_average() -> float | None:
    """1-minute load average: recorded with timings, since the build machine may be shared."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def native_bf16() -> bool:
    """True where this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); bf16 elsewhere is slower than fp32."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def _autocast_dtype(recipe: Recipe) -> torch.dtype | None:
    if recipe.precision == "bf16" or (recipe.precision == "auto" and native_bf16()):
        return torch.bfloat16
    return None


def learning_rate(step: int, recipe: Recipe) -> float:
    """The learning rate at `step`: the project's one warm-up + cosine schedule (models/schedule.py), peak `lr`,
    reaching the floor lr * min_lr_ratio at step `steps`."""
    return recipe.lr * warmup_cosine(step, recipe.warmup_steps, recipe.steps, recipe.min_lr_ratio)


# ---- tokenizer --------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = 2048):
    """A byte-level BPE (Hugging Face fast tokenizer) with <|endoftext|>, <|im_start|>, <|im_end|> and ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_bar(texts, desc="training tokenizer", unit="file", leave=False), trainer,
                            length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None, unk_token=None,
        additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- data -------------------------------------------------------------------------------------------------------------
def pack_documents(docs: list[list[int]], eos_id: int) -> torch.Tensor:
    """One token stream: each document preceded by <|endoftext|>. (N,) int64."""
    out = []
    for ids in docs:
        out.append(eos_id)
        out.extend(ids)
    return torch.tensor(out, dtype=torch.long)


def training_batches(stream: torch.Tensor, seq_len: int, batch_size: int, steps: int,
                     seed: int) -> Iterator[torch.Tensor]:
    """`steps` batches of (B, seq_len + 1) windows of the stream, in a fixed order for a seed.

    Each epoch cuts the stream into non-overlapping windows from a seeded random offset (so window borders move
    between epochs) and visits them in a seeded random order.
    """
    span = seq_len + 1
    if len(stream) < span * batch_size:
        raise ValueError(f"the training corpus has {len(stream)} tokens, fewer than one batch "
                         f"({batch_size} x {span}); use more train_files or a smaller batch")
    gen = torch.Generator().manual_seed(seed)
    epoch_windows = torch.empty(0, span, dtype=torch.long)
    done = 0
    while done < steps:
        offset = int(torch.randint(0, seq_len, (1,), generator=gen))
        n = (len(stream) - offset) // span
        windows = stream[offset: offset + n * span].view(n, span)  # (n, T+1)
        windows = torch.cat([epoch_windows, windows[torch.randperm(n, generator=gen)]])
        while len(windows) >= batch_size and done < steps:
            yield windows[:batch_size]
            windows = windows[batch_size:]
            done += 1
        epoch_windows = windows  # the remainder carries into the next epoch


def eval_windows(docs: list[list[int]], seq_len: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every document token as a prediction target exactly once: (inputs, targets), each (W, seq_len).

    A document is [eos] + ids cut into windows of seq_len + 1 tokens that overlap by one; targets past a document's
    end are -100 (ignored). Context does not cross window borders.
    """
    inputs, targets = [], []
    for ids in docs:
        seq = [eos_id] + list(ids)
        for start in range(0, len(seq) - 1, seq_len):
            chunk = seq[start: start + seq_len + 1]
            pad = seq_len + 1 - len(chunk)
            inputs.append(chunk[:-1] + [eos_id] * pad)
            targets.append(chunk[1:] + [-100] * pad)
    return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


@torch.no_grad()
def bits_per_byte(model, tokenizer, texts: list[str], seq_len: int = 512, batch_size: int = 8,
                  progress: bool = True) -> dict:
    """Held-out compression: total nats over the texts' tokens / ln 2 / total UTF-8 bytes, in fp32.

    Returns {"bits_per_byte", "nats_per_token", "tokens", "bytes"}.
    """
    docs = [enc.ids for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    inputs, targets = eval_windows(docs, seq_len, tokenizer.eos_token_id)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    starts = range(0, len(inputs), batch_size)
    for i in _bar(starts, desc="held-out bits/byte", leave=False, disable=not progress):
        logits = model(input_ids=inputs[i: i + batch_size]).logits.float()  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1), targets[i: i + batch_size].flatten(), ignore_index=-100,
                                 reduction="sum").double()
    model.train(was_training)
    n_tokens = sum(len(d) for d in docs)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    nats = float(total)
    return {"bits_per_byte": nats / math.log(2) / n_bytes, "nats_per_token": nats / n_tokens,
            "tokens": n_tokens, "bytes": n_bytes}


# ---- model ------------------------------------------------------------------------------------------------------------
def model_config(recipe: Recipe, tokenizer):
    from transformers import LlamaConfig

    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads, head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": recipe.rope_theta},
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        attention_bias=False, mlp_bias=False, initializer_range=recipe.init_std, dtype="float32",
    )


def make_optimizers(model, recipe: Recipe) -> list[torch.optim.Optimizer]:
    """AdamW for everything; or Muon for the decoder layers' matrices and AdamW for embeddings, lm_head and norms.

    Each param group keeps its peak rate in "peak_lr"; the schedule scales it every step.
    """
    adamw_kw = dict(betas=(0.9, recipe.beta2), eps=1e-8, foreach=True)
    layer_mats = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]
    other_mats = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." not in n]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    if recipe.optimizer == "adamw":
        groups = [{"params": layer_mats + other_mats, "weight_decay": recipe.weight_decay},
                  {"params": vectors, "weight_decay": 0.0}]
        opts = [torch.optim.AdamW(groups, lr=recipe.lr, **adamw_kw)]
    else:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"recipe {recipe.name!r} trains with torch.optim.Muon, which torch {torch.__version__} "
                               "lacks (added in torch 2.9); upgrade torch")
        # "match_rms_adamw" scales Muon's orthogonal update to AdamW's size, so one lr serves both
        muon = torch.optim.Muon(layer_mats, lr=recipe.lr, weight_decay=recipe.weight_decay, momentum=0.95,
                                nesterov=True, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW([{"params": other_mats, "weight_decay": recipe.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], lr=recipe.lr, **adamw_kw)
        opts = [muon, adamw]
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


@contextlib.contextmanager
def _deterministic_torch(threads: int):
    """Fixed thread count and deterministic kernels for the build; the caller's settings come back after."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def train_model(recipe: Recipe, tokenizer, stream: torch.Tensor, seed: int) -> tuple[torch.nn.Module, dict]:
    """Train the Llama from scratch on the packed stream; returns the model and its training figures."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(recipe, tokenizer)).train()
    if recipe.scaled_residual_init:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.normal_(0.0, recipe.init_std / math.sqrt(2 * recipe.num_layers))
    opts = make_optimizers(model, recipe)
    amp = _autocast_dtype(recipe)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model: Llama {recipe.num_layers} layers x {recipe.hidden_size}, {n_params / 1e6:.2f}M params; "
         f"{recipe.steps} steps x {recipe.batch_size} x {recipe.seq_len} tokens "
         f"({'bf16 autocast' if amp else 'fp32'}, {torch.get_num_threads()} threads)")
    losses = torch.zeros(recipe.steps)  # kept on device; read at log points only
    log_every = max(1, min(25, recipe.steps // 20))
    bar = _bar(total=recipe.steps, desc=f"training {recipe.name}", unit="step")
    start = last = time.perf_counter()
    cpu_start = time.process_time()
    fastest = 0.0  # best steps/s over one log interval: a hint of the speed without other jobs on the machine
    load_before = _load_average()
    curve: list[tuple[int, float]] = []  # (step, mean loss over the last log interval)
    for step, batch in enumerate(training_batches(stream, recipe.seq_len, recipe.batch_size, recipe.steps, seed)):
        scale = warmup_cosine(step, recipe.warmup_steps, recipe.steps, recipe.min_lr_ratio)
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * scale
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            logits = model(input_ids=inputs).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        bar.update(1)
        if (step + 1) % log_every == 0 or step + 1 == recipe.steps:
            recent = losses[max(0, step + 1 - log_every): step + 1].mean()
            curve.append((step + 1, round(float(recent), 4)))
            if not torch.isfinite(recent):
                raise FloatingPointError(f"recipe {recipe.name!r}: training loss became {float(recent)} at step "
                                         f"{step + 1}; lower lr")
            now = time.perf_counter()
            if step + 1 > log_every:  # the first interval pays one-off warm-up costs
                fastest = max(fastest, log_every / (now - last))
            last = now
            tokens = (step + 1) * recipe.batch_size * recipe.seq_len
            bar.set_postfix(loss=f"{float(recent):.3f}", tok_s=f"{tokens / (now - start):.0f}")
    bar.close()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tail = max(1, recipe.steps // 20)
    tokens = recipe.steps * recipe.batch_size * recipe.seq_len
    return model.eval(), {
        "params": n_params, "precision": "bf16" if amp else "fp32", "threads": torch.get_num_threads(),
        "train_tokens": tokens, "train_seconds": round(seconds, 2), "train_cpu_seconds": round(cpu_seconds, 1),
        "train_tokens_per_s": round(tokens / seconds, 1), "steps_per_s": round(recipe.steps / seconds, 3),
        "train_loss": round(float(losses[-tail:].mean()), 4),
        "fastest_steps_per_s": round(fastest or recipe.steps / seconds, 3),
        "load_average": [load_before, _load_average()], "loss_curve": curve,
    }


# ---- build ------------------------------------------------------------------------------------------------------------
def build(recipe: str | Recipe, out: str | Path, seed: int = 0, **overrides) -> Path:
    """Train tokenizer + model for a recipe and write the HF folder `out` (atomically; replaces an earlier build).

    `overrides` replace recipe fields (tests use them for cheap builds). Returns `out`.
    """
    from data.stdlib import read_source, stdlib_files

    recipe = get_recipe(recipe, **overrides)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not (out / BUILD_INFO).is_file():
        raise FileExistsError(f"--out {str(out)!r} is a non-empty folder that is not a tiny verifier build; "
                              "pick an empty or new folder")
    begin = time.perf_counter()

    with _deterministic_torch(_cpu_count()):
        verifier_files = stdlib_files("verifier")
        texts = [read_source(p) for p in _bar(verifier_files, desc="reading stdlib", unit="file", leave=False)]
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(texts[: recipe.tokenizer_files], recipe.vocab_size,
                                    recipe.max_position_embeddings)
        tokenizer_seconds = time.perf_counter() - t0
        train_texts = texts[: recipe.train_files]
        docs = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(train_texts, add_special_tokens=False)]
        stream = pack_documents(docs, tokenizer.eos_token_id)
        _log(f"tokenizer: {len(tokenizer)} tokens in {tokenizer_seconds:.1f}s; corpus {len(train_texts)} files, "
             f"{len(stream)} tokens, {sum(len(t.encode()) for t in train_texts) / len(stream):.2f} bytes/token")

        model, figures = train_model(recipe, tokenizer, stream, seed)

        held_out = {}
        if recipe.eval_files != 0:
            t0 = time.perf_counter()
            eval_texts = [read_source(p) for p in stdlib_files("eval")[: recipe.eval_files]]
            held_out = bits_per_byte(model, tokenizer, eval_texts, recipe.seq_len, recipe.eval_batch_size)
            held_out.update(files=len(eval_texts), seconds=round(time.perf_counter() - t0, 2))

    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, do_sample=False)
    info = {
        "recipe_name": recipe.name, "recipe_hash": recipe.digest(), "seed": seed, "recipe": dataclasses.asdict(recipe),
        "builder_version": BUILDER_VERSION,
        "corpus": {"python": sys.version.split()[0], "train_files": len(train_texts), "train_tokens": len(stream),
                   "tokenizer_files": len(texts[: recipe.tokenizer_files])},
        "figures": {**figures, "tokenizer_seconds": round(tokenizer_seconds, 2),
                    "total_seconds": round(time.perf_counter() - begin, 2)},
        "held_out": held_out,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers")},
    }
    with atomic_dir(out) as tmp:  # an older build there is replaced in one rename
        with _transformers_bars_off():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")  # written last: marks a finished build
    return out


@contextlib.contextmanager
def _transformers_bars_off():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if _quiet():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def read_build_info(folder: str | Path) -> dict | None:
    """The build record of a tiny verifier folder, or None if there is none (or it is unreadable)."""
    try:
        return json.loads((Path(folder) / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: str | Path, recipe: str | Recipe, seed: int | None = None) -> bool:
    """Whether `folder` holds a finished build of this exact recipe (and seed, unless seed is None)."""
    info = read_build_info(folder)
    return (bool(info) and info.get("recipe_hash") == get_recipe(recipe).digest()
            and (seed is None or info.get("seed") == seed) and (Path(folder) / "model.safetensors").is_file())


def cache_home(home: str | Path | None = None) -> Path:
    """Where embedded verifiers live: `home`, else $DRAFTHEADS_HOME, else ~/.cache/draftheads."""
    return Path(home or os.environ.get("DRAFTHEADS_HOME") or "~/.cache/draftheads").expanduser()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, also if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(recipe: str | Recipe = "default", home: str | Path | None = None, seed: int | None = None,
                 force: bool = False) -> Path:
    """The built folder `<home>/<recipe name>`, building it first if it is missing or from another recipe.

    Safe for concurrent callers (pytest workers, accelerate ranks): one builds under a file lock, the rest wait and
    then find it; nobody sees a half-written folder. `seed=None` accepts a cached build of any seed (a new build
    uses seed 0); `force` rebuilds regardless. The build runs in a child process (`python -m models.tiny build`),
    so this process's torch thread settings are untouched.
    """
    r = get_recipe(recipe)
    folder = cache_home(home) / r.name
    if not force and is_current(folder, r, seed):
        return folder
    with _file_lock(folder.parent / f".{r.name}.lock"):
        if not force and is_current(folder, r, seed):  # built by another process while we waited
            return folder
        for stale in [*folder.parent.glob(f".{r.name}.tmp-*"), *folder.parent.glob(f".{r.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the lock
        seed = 0 if seed is None else seed
        _log(f"building the embedded verifier {r.name!r} (seed {seed}) into {folder}; this happens once")
        _build_in_child(r, folder, seed)
    return folder


def _build_in_child(recipe: Recipe, out: Path, seed: int) -> None:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # so `-m models.tiny` resolves without an install
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "models.tiny", "build", "--recipe-json", json.dumps(dataclasses.asdict(recipe)),
           "--out", str(out), "--seed", str(seed)]
    quiet = _quiet()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True)
    if proc.returncode != 0:
        detail = f":\n{proc.stderr[-3000:]}" if quiet else " (its error is printed above)"
        raise RuntimeError(f"building the embedded verifier {recipe.name!r} into {str(out)!r} failed with exit code "
                           f"{proc.returncode}{detail}")
    info = read_build_info(out) or {}
    _log(f"built {recipe.name!r} in {info.get('figures', {}).get('total_seconds', 0):.0f}s; held-out "
         f"{info.get('held_out', {}).get('bits_per_byte', float('nan')):.3f} bits per byte")


@torch.no_grad()
def greedy_generate(folder: str | Path, prompts: list[str], max_new_tokens: int = 64) -> list[str]:
    """Greedy continuations (text after each prompt) from a model folder, with plain HF `generate`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with _transformers_bars_off():
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # (1, T)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


# ---- CLI --------------------------------------------------------------------------------------------------------------
def summary(folder: str | Path) -> str:
    info = read_build_info(folder) or {}
    fig, held = info.get("figures", {}), info.get("held_out", {})
    lines = [f"{info.get('recipe_name', '?')} (seed {info.get('seed')}): {folder}"]
    if held:
        lines.append(f"  held-out bits per byte: {held['bits_per_byte']:.4f} "
                     f"({held['nats_per_token']:.4f} nats/token over {held['files']} eval files, "
                     f"{held['tokens']} tokens, {held['bytes']} bytes)")
    if fig:
        lines.append(f"  training: {fig['train_tokens']} tokens at {fig['train_tokens_per_s']:.0f} tokens/s "
                     f"({fig['steps_per_s']:.2f} steps/s, {fig['precision']}, {fig['threads']} threads), "
                     f"final train loss {fig['train_loss']:.4f} nats/token")
        lines.append(f"  build time: {fig['total_seconds']:.0f}s (tokenizer {fig['tokenizer_seconds']:.1f}s, "
                     f"training {fig['train_seconds']:.0f}s, held-out eval {held.get('seconds', 0):.0f}s)")
        if fig.get("fastest_steps_per_s"):
            quiet = fig["total_seconds"] - fig["train_seconds"] + info["recipe"]["steps"] / fig["fastest_steps_per_s"]
            cpu = (f"training used {fig['train_cpu_seconds']:.0f} CPU-seconds on {fig['threads']} threads; "
                   if "train_cpu_seconds" in fig else "")
            lines.append(f"  load average {fig['load_average'][0]} -> {fig['load_average'][1]} (CPUs: {_cpu_count()}); "
                         f"{cpu}at its fastest interval ({fig['fastest_steps_per_s']:.2f} steps/s) the build would "
                         f"take {quiet:.0f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a recipe (into the cache unless --out; a current cached build is kept)")
    p = sub.add_parser("path", help="print the cached folder of a recipe, building it first if needed")
    g = sub.add_parser("generate", help="greedy continuations of prompts (building the recipe first if needed)")
    g.add_argument("prompts", nargs="+", help="prompt texts; \\n and \\t escapes are expanded")
    g.add_argument("--max-new-tokens", type=int, default=64)
    for s in (b, p, g):
        s.add_argument("--recipe", default="default", choices=sorted(RECIPES))
        s.add_argument("--recipe-json", default=None, help="a whole Recipe as JSON (overrides --recipe)")
        s.add_argument("--home", default=None, help="cache folder (default $DRAFTHEADS_HOME or ~/.cache/draftheads)")
    b.add_argument("--out", default=None, help="write the model folder here instead of the cache")
    b.add_argument("--seed", type=int, default=None, help="default 0 (a cached build of any seed is kept)")
    b.add_argument("--force", action="store_true", help="rebuild even if the cached build is current")
    args = parser.parse_args(argv)
    recipe = Recipe(**json.loads(args.recipe_json)) if args.recipe_json else args.recipe
    if args.command == "path":
        print(ensure_built(recipe, home=args.home))
        return 0
    if args.command == "generate":
        prompts = [p.replace("\\n", "\n").replace("\\t", "\t") for p in args.prompts]
        for prompt, text in zip(prompts, greedy_generate(ensure_built(recipe, home=args.home), prompts,
                                                         args.max_new_tokens)):
            print(f"--- {prompt!r}\n{prompt}{text}\n")
        return 0
    if args.out:
        folder = build(recipe, args.out, seed=args.seed or 0)
    else:
        folder = ensure_built(recipe, home=args.home, seed=args.seed, force=args.force)
    print(summary(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
