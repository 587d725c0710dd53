"""One training step of speculators 0.9's EAGLE-3 on given weights and batches: its loss per TTT step, the positions
it trains, its gradients and (optionally) the weights after a few AdamW steps; the speculators side of
scripts/peer_step_check.py.

    .venv-speculators/bin/python eval/interop/speculators_step.py REQUEST.json

This file runs in the speculators environment (scripts/setup_peers.sh), so it imports nothing of draftheads. It runs
speculators' own code paths: the draft model is built by its `speculators train` command's functions from the bench's
flags (`cli.parse_vocab_mappings`, `cli.build_draft_model`), each batch is read by its `ArrowDataset` and collated by
its `CollateFn` with `shift_batch` (rows packed into one sequence with document ids), the forward is the trainer's
call, `model(**batch, **train_call_kwargs)`, and the optimizer is `build_optimizers` plus the trainer's clipping
(`clip_grad_norm_(..., 1.0)`). The CPU patches are the bench runner's (speculators_runner.patch_for_cpu).

REQUEST.json: {flags: [speculators train flags], weights: init.safetensors (speculators key names), seq_len, dtype,
cases: [{name, data: a folder in speculators' offline layout, lm_head_trainable: bool, optimizer_steps: int,
lr: float}], out: folder}. For each case it writes OUT/speculators-NAME.safetensors: `grad.P` for every parameter
with a gradient, `logits.K` (n_K, Vd) and `mask.K` (n_K,) as the step's loss sees them (aligned by speculators'
`align_for_step`, read by wrapping `core.compute_metrics`), `target.K` (n_K, Vd), `loss.K` (the step's KL mean,
its decay factor divided out) and `after.S.P` (P after optimizer step S); and the total loss as `loss`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speculators_runner import patch_for_cpu  # run as a file, its folder is on the path: the bench runner's patches

VERIFIER_OWNED = {"verifier_lm_head.weight", "verifier_norm.weight"}
"""Tensors the model loads from the verifier that our weights file does not carry (its own copies of the verifier's
lm_head rows and final norm, for the targets)."""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: speculators_step.py REQUEST.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text())
    patch_for_cpu()
    import torch
    from safetensors.torch import load_file, save_file

    import speculators.models.eagle3.core as core
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.metrics import align_for_step
    from speculators.train import cli
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.optimizers import build_optimizers

    torch.set_num_threads(1)
    args = argparse.Namespace(**TrainConfig.resolve(request["flags"]).flatten())
    cli.set_seed(args.seed)
    d2t, t2d, draft_vocab_size = cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry["eagle3"]
    model = cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    dtype = getattr(torch, request.get("dtype", "float32"))  # float64: the rounding-free comparison
    model.to(dtype)
    weights = load_file(request["weights"])
    hidden_size = model.config.transformer_layer_config.hidden_size

    seen: list[tuple] = []  # (logits, targets, loss_mask) of each TTT step, as its loss aligns them
    compute_metrics = core.compute_metrics

    def probe(logits, targets, loss_mask, prev_correct, ttt_step, *rest, **kwargs):
        s_logits, s_targets, s_mask, _ = align_for_step(logits, targets, loss_mask, None, ttt_step)
        seen.append((s_logits.detach().clone(), s_targets.detach().clone(), s_mask.detach().clone()))
        return compute_metrics(logits, targets, loss_mask, prev_correct, ttt_step, *rest, **kwargs)

    core.compute_metrics = probe  # the forward calls it by this module-level name
    out = Path(request["out"])
    for case in request["cases"]:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - VERIFIER_OWNED:
            raise SystemExit(f"[speculators_step] {request['weights']}: missing {sorted(set(missing) - VERIFIER_OWNED)}"
                             f", unexpected {sorted(unexpected)} against speculators' Eagle3DraftModel")
        model.lm_head.weight.requires_grad_(bool(case["lm_head_trainable"]))  # speculators freezes it
        model.train()
        dataset = ArrowDataset(max_len=request["seq_len"] * 64, datapath=case["data"], on_missing="raise",
                               train_ratio=1.0, split="train", hidden_states_dtype=dtype)
        items = [dataset[i] for i in range(len(dataset))]
        max_len = request["seq_len"] * len(items)  # the bench packs --batch documents into batch x seq_len
        batch = CollateFn(max_len, hidden_size, len(model.target_layer_ids), dtype, shift_batch)(items)
        optimizers = build_optimizers(model, argparse.Namespace(optimizer="adamw", lr=case.get("lr", args.lr),
                                                                weight_decay=args.weight_decay))
        tensors: dict[str, torch.Tensor] = {}

        def forward_backward():
            seen.clear()
            for opt in optimizers:
                opt.zero_grad()
            _drafts, loss, metrics = model(**batch, **train_kwargs)  # the trainer's call
            loss.backward()
            return loss, metrics

        loss, metrics = forward_backward()
        tensors["loss"] = loss.detach().reshape(1)
        decay = args.ttt_step_loss_decay
        for k, (logits, targets, mask) in enumerate(seen):
            tensors[f"logits.{k}"] = logits[0].contiguous()
            tensors[f"target.{k}"] = targets[0].contiguous()
            tensors[f"mask.{k}"] = mask[0].to(torch.int8).contiguous()
            tensors[f"loss.{k}"] = (metrics[f"loss_{k}_sum"] / decay ** k).reshape(1)
        for name, p in model.named_parameters():
            if p.grad is not None:
                tensors[f"grad.{name}"] = p.grad.detach().clone()
        for step in range(case.get("optimizer_steps", 0)):
            if step:
                forward_backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the trainer's clipping, fixed at 1.0
            for opt in optimizers:
                opt.step()
            for name, p in model.named_parameters():
                if p.requires_grad:
                    tensors[f"after.{step}.{name}"] = p.detach().clone()
        save_file(tensors, str(out / f"speculators-{case['name']}.safetensors"))
        print(f"[speculators_step] {case['name']}: loss {float(loss):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
