"""Pretraining the embedded verifier: its data stream, model config, optimizers (Muon + AdamW), the loop,
and the held-out bits per byte."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Iterator

import torch
import torch.nn.functional as F

from draftheads.models.schedule import warmup_cosine
from draftheads.models.muon import Muon
from draftheads.models.tiny.recipe import Recipe


# ---- small helpers ----------------------------------------------------------------------------------------------------
def _quiet() -> bool:
    return os.environ.get("DRAFTHEADS_QUIET", "") not in ("", "0", "false", "False")


def _log(msg: str) -> None:
    if not _quiet():
        print(f"[tiny] {msg}", file=sys.stderr, flush=True)


def _bar(iterable=None, disable: bool = False, **kwargs):
    from draftheads.data.progress import EtaBar

    return EtaBar(iterable, disable=disable or _quiet(), dynamic_ncols=True, file=sys.stderr, **kwargs)


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


#: oneDNN instruction-set caps (ONEDNN_MAX_CPU_ISA) under which its bf16 matmuls are emulated, not native.
_ONEDNN_NO_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def native_bf16() -> bool:
    """True where torch multiplies bf16 in hardware here: the CPU has AVX512-BF16 or AMX, *and* torch may use them.
    ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 hold torch's kernels to AVX2 (which is how a CPU without
    AVX-512 runs, and how one is imitated on a CPU with it); bf16 is then emulated and ~10x slower than fp32."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if not any(getattr(cpu, name, lambda: False)() for name in checks):
        return False
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):  # ATEN_CPU_CAPABILITY (or an old build)
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    return cap not in _ONEDNN_NO_BF16


def compute_dtype(recipe: Recipe, device: str | torch.device = "cpu") -> torch.dtype:
    """The build's low-precision dtype, chosen per machine: bf16 where the GPU or CPU has it natively
    (autocast and Muon's orthogonalisation in bf16, torch's own choices), fp32 elsewhere (emulated bf16 is ~10x
    slower than fp32 there). `recipe.precision` "bf16" / "fp32" forces it."""
    device = torch.device(device)
    native = (torch.cuda.is_bf16_supported(including_emulation=False) if device.type == "cuda" else native_bf16())
    if recipe.precision == "bf16" or (recipe.precision == "auto" and native):
        return torch.bfloat16
    return torch.float32


def _autocast_dtype(recipe: Recipe, device: str | torch.device = "cpu") -> torch.dtype | None:
    return torch.bfloat16 if compute_dtype(recipe, device) == torch.bfloat16 else None


def learning_rate(step: int, recipe: Recipe) -> float:
    """The learning rate at `step`: the project's one warm-up + cosine schedule (models/schedule.py), peak `lr`,
    reaching the floor lr * min_lr_ratio at step `steps`."""
    return recipe.lr * warmup_cosine(step, recipe.warmup_steps, recipe.steps, recipe.min_lr_ratio)


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
    """Held-out compression: total nats over the texts' tokens / ln 2 / total UTF-8 bytes, in fp32, on the model's
    device.

    Returns {"bits_per_byte", "nats_per_token", "tokens", "bytes"}.
    """
    docs = [enc.ids for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    inputs, targets = eval_windows(docs, seq_len, tokenizer.eos_token_id)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    starts = range(0, len(inputs), batch_size)
    for i in _bar(starts, desc="held-out bits/byte", leave=False, disable=not progress):
        logits = model(input_ids=inputs[i: i + batch_size].to(device)).logits.float()  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1), targets[i: i + batch_size].to(device).flatten(),
                                 ignore_index=-100, reduction="sum").double()
    model.train(was_training)
    n_tokens = sum(len(d) for d in docs)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    nats = float(total)
    return {"bits_per_byte": nats / math.log(2) / n_bytes, "nats_per_token": nats / n_tokens,
            "tokens": n_tokens, "bytes": n_bytes}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


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


def make_optimizers(model, recipe: Recipe, device: str | torch.device = "cpu") -> list[torch.optim.Optimizer]:
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
        muon = Muon(layer_mats, ns_dtype=compute_dtype(recipe, device), lr=recipe.lr,
                    weight_decay=recipe.weight_decay, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW([{"params": other_mats, "weight_decay": recipe.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], lr=recipe.lr, **adamw_kw)
        opts = [muon, adamw]
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


@contextlib.contextmanager
def _deterministic_torch(threads: int, device: str | torch.device = "cpu"):
    """Fixed thread count and deterministic kernels for the build; the caller's settings come back after.

    On a GPU some kernels (attention's backward among them) have no deterministic variant: there torch only warns
    (`warn_only`), so a GPU build is reproducible in its recipe and steps but not bit for bit."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    on_gpu = torch.device(device).type != "cpu"
    if on_gpu:  # cuBLAS is deterministic only with a fixed workspace, read when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=on_gpu)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


def build_device(name: str) -> torch.device:
    """The device a build trains on, from `--device`: cpu, or cuda[:N] when torch sees that GPU. One line otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: torch {torch.__version__} sees no CUDA GPU here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]")
    return device


def train_model(recipe: Recipe, tokenizer, stream: torch.Tensor, seed: int,
                device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
    """Train the Llama from scratch on the packed stream on `device`; returns the model (still there) and its
    training figures."""
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(model_config(recipe, tokenizer)).train()
    if recipe.scaled_residual_init:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.normal_(0.0, recipe.init_std / math.sqrt(2 * recipe.num_layers))
    opts = make_optimizers(model, recipe, device)
    amp = _autocast_dtype(recipe, device)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"on {_device_name(device)}" if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    _log(f"model: Llama {recipe.num_layers} layers x {recipe.hidden_size}, {n_params / 1e6:.2f}M params; "
         f"{recipe.steps} steps x {recipe.batch_size} x {recipe.seq_len} tokens "
         f"({'bf16 autocast and Muon' if amp else 'fp32, Muon included'}, {where})")
    losses = torch.zeros(recipe.steps, device=device)  # kept on the device; read at log points only
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
        batch = batch.to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tail = max(1, recipe.steps // 20)
    tokens = recipe.steps * recipe.batch_size * recipe.seq_len
    return model.eval(), {
        "params": n_params, "precision": "bf16" if amp else "fp32", "native_bf16": native_bf16(),
        "threads": torch.get_num_threads(), "device": _device_name(device),
        "train_tokens": tokens, "train_seconds": round(seconds, 2), "train_cpu_seconds": round(cpu_seconds, 1),
        "train_tokens_per_s": round(tokens / seconds, 1), "steps_per_s": round(recipe.steps / seconds, 3),
        "train_loss": round(float(losses[-tail:].mean()), 4),
        "fastest_steps_per_s": round(fastest or recipe.steps / seconds, 3),
        "load_average": [load_before, _load_average()], "loss_curve": curve,
    }
