"""Tiny random verifiers of each supported family, saved as ordinary HF model folders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "mistral")
"""The families whose drafter layer is their own decoder layer (tested everywhere)."""
STATIC_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe")
"""Families the engine decodes on its static-cache runtime."""
GENERIC_FAMILIES = ("gemma3", "olmo2", "phi3")
"""Families it decodes on the generic path (the model's own forward and cache)."""


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package), loaded once and registered under NAME in
    sys.modules, as its dataclasses and a script importing it by name (`import bench_peers`) need."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def tiny_eagle3_args(verifier, source, output_dir, *extra, seq_len: int = 32, draft_vocab_size: int = 200) -> list:
    """A 3-step EAGLE-3 run of configs/eagle3-tiny.yaml on a tiny verifier: the command-line arguments."""
    return ["--config", str(SCRIPTS.parent / "configs" / "eagle3-tiny.yaml"), f"--verifier={verifier}",
            f"--data.source={source}", f"--output_dir={output_dir}", "--wandb.enabled=false",
            f"--data.seq_len={seq_len}", "--data.max_rows=null", "--data.eval_rows=2", "--train.batch_size=2",
            "--train.max_steps=3", "--train.save_every=0", "--train.log_every=1", "--train.eval_every=0",
            "--train.eval_batches=1", "--train.warmup_steps=1", "--train.mixed_precision=no", "--eagle.ttt_steps=2",
            f"--eagle.draft_vocab_size={draft_vocab_size}", "--eagle.layer_ids=null", *extra]


def tiny_config(family: str = "llama", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                **overrides):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen3":  # head_dim apart from hidden/heads, as in Qwen3-0.6B (1024 / 16 heads, head_dim 128)
        return Qwen3Config(**{"head_dim": 2 * common["hidden_size"] // common["num_attention_heads"], **common})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": common["hidden_size"] // 2, **common})
    if family == "gemma3":  # sliding-window layers (window 8) between global ones, scaled embeddings, (1+w) norms
        return Gemma3TextConfig(**{"head_dim": common["hidden_size"] // common["num_attention_heads"],
                                   "sliding_window": 8, **common})
    if family == "olmo2":
        return Olmo2Config(**common)
    if family == "phi3":
        return Phi3Config(**common)
    raise ValueError(f"unknown family {family!r}")


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()


def save_tiny_verifier(folder: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random tiny causal LM written with safetensors, loadable by `Verifier.from_pretrained(folder)`."""
    folder = Path(folder)
    tiny_model(family, seed, **overrides).save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_verifier_with_tokenizer(folder: str | Path, family: str = "llama", seed: int = 0,
                                      **overrides) -> Path:
    """A random tiny verifier and a small byte-level BPE tokenizer (tests/chat_tokenizers.py) in one folder, so
    `train.placement.load_verifier` (and any trainer) can use it as `verifier: <folder>`."""
    from tests.chat_tokenizers import plain_tokenizer

    tokenizer = plain_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as real vocabularies are
    overrides = {"vocab_size": vocab, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id,
                 **overrides}
    folder = save_tiny_verifier(folder, family, seed, **overrides)
    tokenizer.save_pretrained(folder)
    return folder


def unsettle_norms_and_biases(module):
    """Norm weights drawn from U(0.5, 1.5) and biases from N(0, 0.1), in place, so a wrong wiring shows (at init
    they are 1 and 0); returns `module`."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return module


def peaked_model(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random model with larger weights (init std 0.1): peaked next-token distributions and varied greedy
    continuations, so drafts are accepted or rejected for real."""
    overrides.setdefault("initializer_range", 0.1)
    return tiny_model(family, seed, **overrides)


def peaked_with_references(family: str, prompts: list[list[int]], max_new_tokens: int):
    """(peaked_model(family), its Verifier, {tuple(prompt): the HF greedy continuation (eos 2) of each prompt})."""
    from draftheads.models.verifier import Verifier

    model = peaked_model(family)
    verifier = Verifier(model)
    return model, verifier, {tuple(p): hf_greedy(model, p, max_new_tokens, eos_token_id=2) for p in prompts}


def noisy_copy(model, scale: float = 0.1, seed: int = 1):
    """The same model with Gaussian noise (scale x each matrix's std) on every matrix: a draft model that agrees
    with the original often, not always."""
    import copy

    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.dim() > 1:
                p += scale * p.std() * torch.randn(p.shape, generator=gen)
    return noisy


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Plain greedy decoding with Hugging Face `generate` (no sampling, no processors); new tokens only."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                              pad_token_id=0, num_beams=1)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of observed counts to probabilities (float64, cells with an expected
    count under `min_expected` pooled into one)."""
    import numpy as np
    from scipy.stats import chisquare

    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, f"{obs[-1]} samples fell on outcomes of probability 0"
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


# ---- partially right drafters, without training ------------------------------------------------------------------
def greedy_corpus(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the model's own greedy continuation (no EOS stop)."""
    return [p + hf_greedy(model, p, max_new_tokens) for p in prompts]


def fit_eagle(verifier, version: int, corpus: list[list[int]], residual_scale: float = 0.1, seed: int = 0,
              **overrides):
    """An EAGLE drafter that is right part of the time: its fc is the least-squares map from the drafter's input
    (EAGLE-1: [embed(x_{t+1}); f_t]; EAGLE-3: the three layer features at t) to the verifier's next feature
    f_{t+1} on `corpus`, and its random decoder layer is kept but scaled down (o_proj and down_proj times
    `residual_scale`), so attention and the KV cache still shape every prediction. Eval mode, float32."""
    from draftheads.models.eagle import EagleConfig, build_drafter

    torch.manual_seed(seed)
    cfg = EagleConfig(version=version, draft_vocab_size=overrides.pop("draft_vocab_size", None), **overrides)
    counts = None
    if version == 3 and cfg.draft_vocab_size is not None:  # the corpus' most frequent tokens
        counts = torch.bincount(torch.tensor([t for row in corpus for t in row]), minlength=verifier.vocab_size)
    drafter = build_drafter(verifier, cfg, token_counts=counts)
    xs, ys = [], []
    for row in corpus:
        ids = torch.tensor([row])
        feats = verifier.features(ids, layer_ids=drafter.feature_layers)
        if version == 1:
            x = torch.cat([drafter.embed(ids[:, 1:]), feats.final[:, :-1]], -1)  # (1, T-1, 2H)
        else:
            x = torch.cat(feats.layers, -1)[:, :-1]  # (1, T-1, 3H)
        xs.append(x[0])
        ys.append(feats.final[0, 1:])
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    if drafter.fc.bias is not None:
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    w = torch.linalg.lstsq(x, y, driver="gelsd").solution  # (in [+1], H)
    layer = drafter.layer
    with torch.no_grad():
        if drafter.fc.bias is not None:
            drafter.fc.weight.copy_(w[:-1].T)
            drafter.fc.bias.copy_(w[-1])
        else:
            drafter.fc.weight.copy_(w.T)
        layer.self_attn.o_proj.weight.mul_(residual_scale)
        layer.mlp.down_proj.weight.mul_(residual_scale)
    return drafter.eval().requires_grad_(False)


def train_eagle_briefly(drafter, verifier, corpus: list[list[int]], steps: int = 60, lr: float = 3e-3, seed: int = 0):
    """A few Adam steps of the drafter's own training loss on `corpus` (rows cut to the shortest length): what a
    fitted drafter cannot learn by least squares, such as a parallel drafter's mask_hidden. Eval mode after."""
    torch.manual_seed(seed)
    T = min(len(row) for row in corpus)
    ids = torch.tensor([row[:T] for row in corpus])
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    mask = torch.ones_like(ids)
    drafter.train().requires_grad_(True)
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        drafter.training_loss(ids, feats, mask).loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


def free_port() -> int:
    """A TCP port nothing listens on now, for a multi-process launch's rendezvous: the default 29500 may still be held
    by the previous launch's store, or by another test worker's."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reset_accelerate() -> None:
    """draftheads.train.tracking.reset_accelerate, imported when first called (it pulls in the trainer's modules)."""
    from draftheads.train.tracking import reset_accelerate as reset

    reset()


def crash_after_step(monkeypatch, step: int, run) -> None:
    """Call run() with the training loop raising right after step `step` (like a kill just after that step's
    checkpoint), then restore the loop: what is left is a run folder to continue."""
    from draftheads.train.loop import TrainLoop

    class Killed(Exception):
        pass

    original = TrainLoop.step

    def step_then_crash(self, *a, **kw):
        original(self, *a, **kw)
        if self.state.step == step:
            raise Killed

    monkeypatch.setattr(TrainLoop, "step", step_then_crash)
    try:
        run()
    except Killed:
        pass
    else:
        raise AssertionError(f"the run ended before step {step}")
    finally:
        monkeypatch.setattr(TrainLoop, "step", original)


def record_wandb_logs(monkeypatch) -> list[tuple[int | None, set[str]]]:
    """(step, keys) of every wandb `Run.log` call from now on, the calls still made. Every log should name the
    training step and never go back: wandb drops a log to an earlier step than its last (an unstepped table once
    pushed the counter ahead and the eval/* metrics after it were lost)."""
    import wandb

    logged, log = [], wandb.sdk.wandb_run.Run.log

    def recording_log(self, data, step=None, *args, **kwargs):
        logged.append((step, set(data)))
        return log(self, data, step, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", recording_log)
    return logged


#: A tiny GLM-4.5-shaped verifier (glm4_moe: layer 0 dense, the rest MoE, partial rotary) that vLLM's CPU build
#: serves: head_dim 32 (its CPU attention needs >= 32), at least one MoE layer (vLLM's Glm4Moe needs one).
MTP_GLM = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
               max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
MTP_RECIPES = {"glm4_moe": MTP_GLM}


def save_tiny_mtp_checkpoint(folder: str | Path, family: str = "glm4_moe", seed: int = 0, mtp: bool = True,
                             tokenizer: bool = False, **overrides) -> Path:
    """A random tiny checkpoint of `family` shipping an MTP layer as the real ones do: the model built with one layer
    more, saved by transformers (per-expert names), config.json's num_hidden_layers lowered by one, and the last
    layer completed into the MTP layer (enorm, hnorm, eh_proj, shared_head.norm, shared_head.head = lm_head), all
    under `model.layers.{L}.`. mtp=False: the same checkpoint without the MTP layer's weights. tokenizer: with a
    small byte-level BPE tokenizer (tests/chat_tokenizers.py) and the vocabulary sized for it, for the trainer."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in MTP_RECIPES:
        raise ValueError(f"save_tiny_mtp_checkpoint: no tiny recipe for {family!r}")
    folder = Path(folder)
    fields = {**MTP_RECIPES[family], **overrides}
    if tokenizer:
        from tests.chat_tokenizers import plain_tokenizer

        tok = plain_tokenizer()
        fields.update(vocab_size=-(-len(tok) // 64) * 64, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    L = fields["num_hidden_layers"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**fields, "num_hidden_layers": L + 1}))
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(folder / "model.safetensors")
    H, prefix, gen = fields["hidden_size"], f"model.layers.{L}.", torch.Generator().manual_seed(seed + 1)
    if mtp:
        tensors.update({prefix + "enorm.weight": torch.ones(H), prefix + "hnorm.weight": torch.ones(H),
                        prefix + "shared_head.norm.weight": torch.ones(H),
                        prefix + "eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * fields["initializer_range"],
                        prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    else:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        tok.save_pretrained(folder)
    return folder
