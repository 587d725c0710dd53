"""A small draft model for vanilla speculative decoding (`--method draft-model`, HF `assistant_model`): the
verifier cut down to its first `--layers` decoder layers (embedding, final norm and lm_head kept), then distilled
briefly on the verifier's next-token distribution over the stdlib `drafter` split.

    PYTHONPATH=. python scripts/train_draft_model.py --verifier tiny-code --out runs/draft-1layer [--layers 1]
        [--steps 300] [--batch-size 8] [--seq-len 256] [--lr 1e-3] [--threads N]

Why this model: it shares the verifier's tokenizer (a draft model must), costs about what an EAGLE drafter costs
per token (one decoder layer plus an lm_head over the full vocabulary, against EAGLE-3's one layer plus a pruned
lm_head), so "our engine with EAGLE vs HF assisted generation with this" compares drafters of similar cost; and
starting from the verifier's own weights, a few hundred distillation steps give it useful acceptance. The output
folder is an ordinary HF model folder (safetensors + the verifier's tokenizer).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def stdlib_windows(tokenizer, seq_len: int, max_files: int | None = None) -> torch.Tensor:
    """(N, seq_len) token windows of the stdlib `drafter` split, files packed back to back with EOS between."""
    from draftheads.data.stdlib import read_source, stdlib_files

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    for path in stdlib_files("drafter")[:max_files]:
        stream += tokenizer(read_source(path))["input_ids"] + [eos]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"the drafter split has {len(stream)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def truncated_copy(model, layers: int):
    """The verifier with only its first `layers` decoder layers (a new module; the verifier is untouched)."""
    if not 1 <= layers < model.config.num_hidden_layers:
        raise ValueError(f"--layers {layers}: expected 1 .. {model.config.num_hidden_layers - 1}")
    student = copy.deepcopy(model)
    decoder = student.get_decoder()
    decoder.layers = torch.nn.ModuleList(list(decoder.layers)[:layers])
    student.config.num_hidden_layers = layers
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = student.config.layer_types[:layers]
    return student


def train_draft_model(verifier: str, out: str | Path, layers: int = 1, steps: int = 300, batch_size: int = 8,
                      seq_len: int = 256, lr: float = 1e-3, seed: int = 0, progress: bool = True) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from draftheads.models.schedule import warmup_cosine_schedule
    from draftheads.models.verifier import Verifier

    torch.manual_seed(seed)
    teacher = Verifier.from_pretrained(verifier, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(teacher.path)
    windows = stdlib_windows(tokenizer, seq_len)
    student = truncated_copy(teacher.model, layers).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = warmup_cosine_schedule(optimizer, warmup=min(20, steps // 10), total=steps, floor=0.1)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    started = time.perf_counter()
    losses = []
    bar = tqdm(range(steps), desc=f"draft model ({layers} layer{'s' * (layers > 1)})", disable=not progress)
    for step in bar:
        idx = order[(torch.arange(batch_size) + step * batch_size) % len(windows)]
        ids = windows[idx]  # (B, T)
        with torch.no_grad():
            target = F.log_softmax(teacher.model(ids).logits.float(), -1)  # (B, T, V)
        logits = student(ids).logits.float()  # (B, T, V)
        # KL(verifier || draft) per token: the draft model learns the verifier's distribution, what acceptance needs
        loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") / ids.shape[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = loss.detach()
        losses.append(loss)
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(kl=f"{loss.item():.3f}")  # a sync every 20 steps
    bar.close()
    student.eval().requires_grad_(False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {"verifier": str(verifier), "verifier_fingerprint": teacher.fingerprint, "layers": layers, "steps": steps,
            "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "windows": len(windows),
            "final_kl": float(torch.stack(losses[-20:]).mean()), "seconds": round(time.perf_counter() - started, 1)}
    (out / "draft_model.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from draftheads.data.progress import quiet

    info = train_draft_model(args.verifier, args.out, args.layers, args.steps, args.batch_size, args.seq_len, args.lr,
                             args.seed, progress=not quiet())
    print(f"[draft-model] {args.out}: {info['layers']} layer(s), {info['steps']} steps, final KL {info['final_kl']:.3f} "
          f"nats/token, {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
