"""Do our EAGLE-3 trainer and speculators 0.9.0's compute the same step? The same drafter weights and the same batch
go through each trainer's own code path; the script prints, per TTT step, the positions each trains, its loss and
its argmax accuracy, then each parameter's gradient difference, and the weights after a few AdamW steps.

    python scripts/peer_step_check.py --verifier tiny-code --docs runs/peers-tiny-code/docs.jsonl \\
        --out runs/peer-step-tiny-code [--drafter FOLDER] [--rows 2] [--perturb 0.1] [--optimizer-steps 2]

(without --docs it writes the bench's documents into OUT first). Settings are the peer bench's
(scripts/bench_peers.py): its layer ids and draft vocabulary, OUR d2t/t2d map (counted from the bench's training rows
by our trainer's own `draft_vocab_counts`), 7 TTT steps, decay 0.8, plain EAGLE-3, float32, one thread. --float64
runs both trainers in float64 and gives ours speculators' position numbers (from 1; RoPE is relative, so only the
rounding changes): what differs then is the rounding of the float32 steps both keep.

  1. weights: our drafter as `build_drafter` starts it (seed --seed), its four norms then scaled by
     1 + perturb * N(0, 1) so that no two are alike (or, with --drafter, a trained export of ours, where the
     accuracies mean something); written in speculators' key names by our speculators layout
     (models/layouts/eagle_speculators.py) and loaded by speculators' Eagle3DraftModel, built by its own `train`
     command's functions from the bench's flags (eval/interop/speculators_step.py).
  2. the batch: the first --rows of our training rows (best-fit packed, `data.batching.build_datasets`) that hold one
     document; the verifier's features of them from our online feature source, handed to speculators in its offline
     layout (hs_i.safetensors [T, 4, H]: the three layers' inputs and the last pre-norm state), so both read the very
     same tensors.
  3. ours: `EagleTrainModule(drafter)(input_ids, features, loss_mask, position_ids)` and backward, as train/eagle.py
     steps; speculators: its `ArrowDataset` + `CollateFn(shift_batch)` + `model(**batch, **train_call_kwargs)` and
     backward, as its Trainer steps.

Two comparisons:
  matched (each row alone): the differences by design switched off. Ours with `eagle.skip_out_of_draft=false`;
     speculators' lm_head made trainable (it freezes it); speculators handed the loss mask shifted by one
     (`ours_rule_mask`), since it weighs the prediction of token j by mask[j-1] where ours reads mask[j]: with it,
     both train the same (position, step) pairs. Expected: equal within float rounding.
  as benched (the rows together, each trainer as the bench runs it): ours with its defaults, one row per document;
     speculators with the raw mask, its lm_head frozen, the documents packed into one sequence. The position counts
     differ by what the design says (`expected_extra`); the gradients are compared by cosine.
Then --optimizer-steps AdamW steps on the matched batch with the same hyperparameters in both (lr 6e-3 constant,
betas (0.9, 0.999), weight decay 0, clipping at 1.0: ours `build_optimizer` + `clip_grad_norm_`, speculators'
`build_optimizers` + its trainer's clipping), and the weights compared after each; and one step of our optimizer
fed speculators' gradients, against speculators' own step.

Loss values: ours trains the soft cross-entropy -sum p log q, speculators the KL, which is that minus the entropy of
the verifier's distribution p (no gradient); the table gives both as KL (ours: its step loss minus the mean entropy
of p over its trained positions). "rel" is max|g_ours - g_theirs| / max|g_ours| per parameter. The report goes to
stdout and OUT/report.md (numbers in OUT/summary.json); exit status 1 when a matched gradient differs by more than
--tol.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import bench_peers as bench  # this script's folder is on the path: the bench's documents, settings and flags

ROOT = Path(__file__).resolve().parents[1]

SPECULATORS_PYTHON = ROOT / ".venv-speculators/bin/python"
OPT_LR, OPT_BETAS, OPT_CLIP = 6e-3, (0.9, 0.999), 1.0
"""The optimizer both sides run in the optimizer check: speculators' AdamW (torch's default betas) and clipping."""


# ---- pure pieces -----------------------------------------------------------------------------------------------------
def ours_rule_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """A document's loss mask (T,) rewritten so that speculators' rule trains what ours trains: speculators weighs
    the prediction of token j by mask[j-1], ours by mask[j]; mask'[j-1] = mask[j], and the last entry 0 (ours has no
    target after a document's last token)."""
    return torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])


def expected_extra(docs: int, step: int) -> int:
    """Positions speculators trains at TTT step `step` beyond ours (skip_out_of_draft off) on `docs` documents whose
    loss mask is 1 throughout, packed into one sequence: per document the verifier's distribution after its last
    token (mask[j-1] of a target one past the end), and per boundary between two documents `step` chains that read
    on into the next document (its features and tokens; attention stays in the first)."""
    return docs + step * (docs - 1)


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |ours|: the largest difference on the scale of the tensor."""
    return float((ours - theirs).abs().max() / ours.abs().max().clamp(min=1e-30))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


# ---- our side ------------------------------------------------------------------------------------------------------
def one_document_rows(dataset, count: int) -> list[int]:
    """Indices of the first `count` rows holding exactly one document (and padding after it)."""
    from draftheads.data.documents import restarts

    found = []
    for i in range(len(dataset)):
        row = dataset[i]
        n = int(row["attention_mask"].sum())
        if not restarts(row["position_ids"][None, :n].long())[0, 1:].any():
            found.append(i)
            if len(found) == count:
                return found
    raise SystemExit(f"[peer_step_check] only {len(found)} rows hold one document; asked for {count}")


def features_with_last(verifier, layer_ids, batch):
    """Our online features of a batch, and the verifier's last pre-norm state (B, T, H), which speculators' targets
    are computed from."""
    from draftheads.train.features import online_features

    seen = {}
    hook = verifier.norm.register_forward_pre_hook(lambda module, a: seen.setdefault("last", a[0]))
    try:
        feats = online_features(verifier, layer_ids)(batch)
    finally:
        hook.remove()
    return feats, seen["last"]


def our_step(drafter, batch, feats) -> dict:
    """One step of our trainer on `batch`: loss, per-step losses (soft cross-entropy), trained positions and their
    targets' entropy, per-step logits and argmax accuracy, and the gradients. The same calls train/eagle.py makes."""
    from draftheads.models.eagle import EagleTrainModule
    from draftheads.models.eagle.losses import draft_targets

    module = EagleTrainModule(drafter).train()
    drafter.zero_grad(set_to_none=True)
    positions = batch["position_ids"]
    out = module(batch["input_ids"], feats, batch["loss_mask"], positions)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    with torch.no_grad():  # what the loss read, step by step (the same functions `training_loss` calls)
        T = batch["input_ids"].shape[1]
        target_logp, _, in_draft = draft_targets(drafter._target_logits(feats), drafter.d2t, drafter.t2d)
        outs = drafter.ttt_unroll(batch["input_ids"], drafter.project_features(torch.cat(feats.layers, -1)),
                                  positions)
        steps = []
        for k, hidden in enumerate(outs):
            n = T - 2 - k
            scored, trained = drafter.loss_positions(batch["loss_mask"], positions, in_draft, k)
            logp = target_logp[:, 1 + k:T - 1]
            entropy = -(logp.exp() * logp).sum(-1)
            logits = drafter.logits(hidden[:, :n])
            hit = logits.max(-1).indices == logp.max(-1).indices
            count = int(trained.sum())
            steps.append({"trained": trained, "logits": logits, "count": count, "scored": int(scored.sum()),
                          "kl": float(out.step_losses[k]) - float(entropy[trained].sum()) / max(count, 1),
                          "acc": float(hit[trained].float().mean())})
    return {"loss": float(out.loss.detach()), "steps": steps, "grads": grads}


def our_optimizer_steps(drafter, batch, feats, steps: int, first_grads: dict | None = None
                        ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """`steps` AdamW steps on the batch with the check's shared hyperparameters, our code (`build_optimizer`, and
    the clipping our loop does in one process): the trained weights after each, and the first step's gradients as
    clipped. `first_grads` replaces our first backward (the optimizer alone, fed another trainer's gradients)."""
    from draftheads.models.eagle import EagleTrainModule
    from draftheads.train.optim import build_optimizer

    module = EagleTrainModule(drafter).train()
    cfg = SimpleNamespace(train=SimpleNamespace(optimizer="adamw", lr=OPT_LR, betas=list(OPT_BETAS), weight_decay=0.0))
    optimizer = build_optimizer(module, cfg)
    after, clipped = [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if step == 0 and first_grads is not None:
            for name, param in drafter.named_parameters():
                param.grad = first_grads[name].clone()
        else:
            module(batch["input_ids"], feats, batch["loss_mask"], batch["position_ids"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), OPT_CLIP)
        if step == 0:
            clipped = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad})
    return after, clipped


# ---- the report ----------------------------------------------------------------------------------------------------
def step_table(ours: dict, theirs: dict, matched: bool, docs: int) -> tuple[list[str], float]:
    """Lines of the per-TTT-step table and the largest logit difference (matched only)."""
    lines = ["| TTT step | positions ours | positions theirs | "
             + ("same positions | " if matched else "ours, skip_out_of_draft off | expected extra | accounted | ")
             + "KL ours | KL theirs | argmax acc ours | argmax acc theirs |"
             + (" max abs logit diff |" if matched else ""),
             "|---:|---:|---:|" + ("---|" if matched else "---:|---:|---|") + "---:|---:|---:|---:|"
             + ("---:|" if matched else "")]
    worst = 0.0
    for k, step in enumerate(ours["steps"]):
        mask = theirs[f"mask.{k}"].bool()
        logits, target = theirs[f"logits.{k}"], theirs[f"target.{k}"]
        acc = float((logits.max(-1).indices == target.max(-1).indices)[mask].float().mean())
        count = int(mask.sum())
        if matched:  # one document: speculators' aligned index i is our stream position t
            n = step["trained"].shape[1]
            same = torch.equal(step["trained"][0], mask[:n]) and not mask[n:].any()
            diff = float((step["logits"][0] - logits[:n])[step["trained"][0]].abs().max())
            worst = max(worst, diff)
            middle = f"{'yes' if same else 'NO'} | "
            tail = f" {diff:.2e} |"
        else:
            extra = expected_extra(docs, k)
            accounted = "yes" if count == step["scored"] + extra else "NO"
            middle, tail = f"{step['scored']} | {extra} | {accounted} | ", ""
        lines.append(f"| {k} | {step['count']} | {count} | {middle}{step['kl']:.6f} | "
                     f"{float(theirs[f'loss.{k}']):.6f} | "
                     f"{step['acc']:.4f} | {acc:.4f} |{tail}")
    return lines, worst


def grad_table(ours: dict, theirs: dict) -> tuple[list[str], float]:
    lines = ["| parameter | shape | max abs grad (ours) | rel | cosine |", "|---|---|---:|---:|---:|"]
    worst = 0.0
    for name, g in ours["grads"].items():
        other = theirs.get(f"grad.{name}")
        if other is None:
            lines.append(f"| {name} | {list(g.shape)} | {float(g.abs().max()):.3e} | (frozen in speculators) | |")
            continue
        r = rel_diff(g, other)
        worst = max(worst, r)
        lines.append(f"| {name} | {list(g.shape)} | {float(g.abs().max()):.3e} | {r:.1e} | {cosine(g, other):.7f} |")
    missing = sorted(k[5:] for k in theirs if k.startswith("grad.") and k[5:] not in ours["grads"])
    if missing:
        lines.append(f"| (speculators only: {', '.join(missing)}) | | | | |")
    return lines, worst


def schedule_lines(steps: int) -> list[str]:
    """The learning rate of the first optimizer steps as each trainer schedules the bench's run (warm-up over 5% of
    `steps`, then cosine to 0): ours `warmup_cosine`, speculators transformers' `get_cosine_schedule_with_warmup`."""
    from transformers import get_cosine_schedule_with_warmup

    from draftheads.models.schedule import warmup_cosine

    ours = [bench.LR * warmup_cosine(s, max(1, round(bench.WARMUP * steps)), steps, 0.0) for s in range(8)]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=bench.LR)
    schedule = get_cosine_schedule_with_warmup(opt, int(steps * bench.WARMUP), steps)
    theirs = []
    for _ in range(8):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return [f"## The optimizer as the bench runs each trainer ({steps} steps)", "",
            "AdamW betas: ours (0.9, 0.95), speculators (0.9, 0.999); gradient clipping: ours 0.5, speculators 1.0. "
            "Learning rate of optimizer steps 1 to 8:", "",
            "| trainer | " + " | ".join(str(s + 1) for s in range(8)) + " |", "|---|" + "---:|" * 8,
            "| ours | " + " | ".join(f"{x:.1e}" for x in ours) + " |",
            "| speculators | " + " | ".join(f"{x:.1e}" for x in theirs) + " |", ""]


# ---- main ------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--docs", help="the bench's docs.jsonl (default: written into --out as the bench writes it)")
    p.add_argument("--out", help="folder for the exchange with speculators and the report (default runs/peer-step-V)")
    p.add_argument("--rows", type=int, default=2, help="training rows (one document each) to compare")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--drafter", help="start from this export of ours (e.g. the bench's trained drafter, "
                   "runs/peers-tiny-code/draftheads-online/drafter) instead of a fresh drafter")
    p.add_argument("--perturb", type=float, default=0.1,
                   help="a fresh drafter's norms scaled by 1 + perturb * N(0, 1)")
    p.add_argument("--optimizer-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, help="largest rel gradient difference counted as equal; default 1e-4 in "
                   "float32 (its rounding through 7 TTT steps of a trained drafter reaches 1e-5, as --float64 shows), "
                   "1e-5 in float64 (both losses still take their softmax in float32)")
    p.add_argument("--float64", action="store_true",
                   help="both trainers in float64 and ours given speculators' position numbers (from 1): what is "
                        "left is the rounding of the float32 steps both keep (RoPE angles, the loss's softmax)")
    args = p.parse_args(argv)
    if not SPECULATORS_PYTHON.exists():
        raise SystemExit(f"[peer_step_check] {SPECULATORS_PYTHON} is missing: run scripts/setup_peers.sh first")
    torch.set_num_threads(1)
    args.tol = args.tol if args.tol is not None else 1e-5 if args.float64 else 1e-4
    out = Path(args.out or f"runs/peer-step-{args.verifier}")
    out.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from draftheads.data.batching import build_datasets, collate
    from draftheads.data.config import DataConfig
    from draftheads.models.eagle import EagleConfig, build_drafter
    from draftheads.models.export import load_eagle
    from draftheads.models.layouts import eagle_speculators
    from draftheads.models.verifier import Verifier, resolve_verifier
    from draftheads.train.eagle import draft_vocab_counts

    verifier_path = resolve_verifier(args.verifier)
    dtype = torch.float64 if args.float64 else torch.float32
    verifier = Verifier.from_pretrained(verifier_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    layer_ids, vocab = bench.drafter_settings(verifier)
    docs = Path(args.docs) if args.docs else bench.write_docs_jsonl(tokenizer, 400, args.seq_len, 4, out)
    # our trainer's rows, as the bench's run of ours reads docs.jsonl (best-fit packing, document masks)
    train, _ = build_datasets(DataConfig(source=str(docs), seq_len=args.seq_len, eval_rows=bench.HELDOUT_DOCS),
                              tokenizer)
    counts = draft_vocab_counts(train, verifier.vocab_size)  # OUR draft vocabulary, as train/eagle.py picks it
    cfg = EagleConfig(version=3, layer_ids=layer_ids, draft_vocab_size=vocab, ttt_steps=bench.TTT, decay=bench.DECAY)
    torch.manual_seed(args.seed)
    drafter = build_drafter(verifier, cfg, token_counts=counts, dtype=dtype)
    if args.drafter:  # its weights, in a drafter built as above (its d2t/t2d must be the bench's map)
        try:
            trained = load_eagle(args.drafter, verifier)
        except ValueError as err:  # DrafterFormatError, EagleError: a folder that is not an EAGLE-3 export
            raise SystemExit(f"[peer_step_check] --drafter {args.drafter}: {err}") from None
        if not torch.equal(trained.d2t.cpu(), drafter.d2t.cpu()) or trained.layer_ids != drafter.layer_ids:
            raise SystemExit(f"[peer_step_check] --drafter {args.drafter}: its layer ids or draft vocabulary differ "
                             f"from the bench's on {docs} (layer ids {layer_ids}, our map of {vocab} tokens)")
        drafter.load_state_dict(trained.to(dtype).state_dict())
        start = f"the drafter in {args.drafter}"
    else:
        with torch.no_grad():
            for name, param in drafter.named_parameters():
                if name.endswith("norm.weight"):  # hidden_norm, input_layernorm, post_attention_layernorm, norm
                    param.mul_(1 + args.perturb * torch.randn_like(param))
        start = f"our drafter at init (seed {args.seed}), norms scaled by 1 + {args.perturb} N(0, 1)"
    init = {k: v.detach().clone().contiguous() for k, v in eagle_speculators.tensors(drafter).items()}
    save_file(init, str(out / "init.safetensors"))

    rows = one_document_rows(train, args.rows)
    batches, documents = [], []
    for r in rows:
        batch = collate([train[r]])
        feats, last = features_with_last(verifier, layer_ids, batch)
        n = int(batch["attention_mask"].sum())
        documents.append({"input_ids": batch["input_ids"][0, :n], "loss_mask": batch["loss_mask"][0, :n],
                          "hidden_states": torch.cat([torch.stack([x[0, :n] for x in feats.layers], 1),
                                                      last[0, :n, None]], 1)})  # (T, 4, H)
        batches.append((batch, feats))

    # the speculators side: one request, every case
    bench_args = SimpleNamespace(verifier_path=verifier_path, batch=len(rows), seq_len=args.seq_len, rows=len(rows),
                                 epochs=1, seed=args.seed, optimizer="adamw")
    raw = bench.write_speculators_data(out / "data-benched", documents, drafter.d2t.cpu(), drafter.t2d.cpu())
    flags = bench.speculators_flags(bench_args, raw, layer_ids, vocab, out / "speculators-save", out / "logs")
    cases = [{"name": "benched", "data": str(raw), "lm_head_trainable": False}]
    for i, doc in enumerate(documents):
        shifted = {**doc, "loss_mask": ours_rule_mask(doc["loss_mask"])}
        data = bench.write_speculators_data(out / f"data-matched-{i}", [shifted], drafter.d2t.cpu(), drafter.t2d.cpu())
        cases.append({"name": f"matched-{i}", "data": str(data), "lm_head_trainable": True,
                      "optimizer_steps": args.optimizer_steps if i == 0 else 0, "lr": OPT_LR})
    request = {"flags": flags, "weights": str(out / "init.safetensors"), "seq_len": args.seq_len, "cases": cases,
               "out": str(out), "dtype": str(dtype).removeprefix("torch.")}
    (out / "request.json").write_text(json.dumps(request, indent=1))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    with open(out / "speculators.log", "w") as log:
        code = subprocess.run([str(SPECULATORS_PYTHON), str(ROOT / "eval/interop/speculators_step.py"),
                               str(out / "request.json")], stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT).returncode
    if code:
        tail = "\n".join((out / "speculators.log").read_text().splitlines()[-15:])
        raise SystemExit(f"[peer_step_check] the speculators side failed ({code}); {out / 'speculators.log'}:\n{tail}")

    # our side, and the report
    report = [f"# One training step, ours against speculators 0.9.0 ({args.verifier})", "",
              f"layer ids {layer_ids}, draft vocabulary {vocab} (our d2t/t2d), {bench.TTT} TTT steps, decay "
              f"{bench.DECAY}, {str(dtype).removeprefix('torch.')}; rows {rows} of our training rows from {docs} "
              f"(one document each, "
              f"{[len(d['input_ids']) for d in documents]} tokens); weights: {start}."
              + (" Float64 in both trainers; in the matched comparisons ours gets speculators' position numbers "
                 "(from 1; RoPE is relative, so only rounding changes)." if args.float64 else ""), ""]
    worst_grad, worst_logit, summary = 0.0, 0.0, {}
    matched_drafter = copy.deepcopy(drafter)
    matched_drafter.cfg = dataclasses.replace(drafter.cfg, skip_out_of_draft=False)
    if args.float64:  # speculators numbers a position by its token's (shift_batch), ours by its feature's: t + 1
        batches = [({**batch, "position_ids": batch["position_ids"] + 1}, feats) for batch, feats in batches]
    for i, (batch, feats) in enumerate(batches):
        theirs = load_file(str(out / f"speculators-matched-{i}.safetensors"))
        ours = our_step(matched_drafter, batch, feats)
        steps, logit = step_table(ours, theirs, matched=True, docs=1)
        grads, grad = grad_table(ours, theirs)
        worst_grad, worst_logit = max(worst_grad, grad), max(worst_logit, logit)
        summary[f"matched-{i}"] = {"loss_ours_ce": ours["loss"], "loss_theirs_kl": float(theirs["loss"]),
                                   "max_rel_grad": grad, "max_abs_logit": logit}
        report += [f"## Matched, row {rows[i]} alone", "",
                   "Ours with eagle.skip_out_of_draft=false; speculators with its lm_head trainable and the loss mask "
                   "shifted by one (mask[j] for the prediction of token j, ours' rule).", "", *steps, "",
                   f"Total loss: ours {ours['loss']:.6f} (soft cross-entropy), speculators {float(theirs['loss']):.6f} "
                   "(KL).", "", *grads, ""]

    if args.optimizer_steps:
        theirs = load_file(str(out / "speculators-matched-0.safetensors"))
        their_grads = {k[5:]: v for k, v in theirs.items() if k.startswith("grad.")}
        alone, _ = our_optimizer_steps(copy.deepcopy(matched_drafter), *batches[0], 1, first_grads=their_grads)
        after, clipped = our_optimizer_steps(copy.deepcopy(matched_drafter), *batches[0], args.optimizer_steps)
        same_grads = max(rel_diff(w - init[n], theirs[f"after.0.{n}"] - init[n]) for n, w in alone[0].items())
        summary["adamw_same_gradients_max_rel_update"] = same_grads
        report += [f"## AdamW steps on row {rows[0]} (lr {OPT_LR} constant, betas {OPT_BETAS}, weight decay 0, "
                   f"clipping at {OPT_CLIP})", "",
                   f"The optimizers alone (speculators' gradients through our optimizer and clipping, one step): max "
                   f"rel difference of the update {same_grads:.1e}.", "",
                   "Each trainer's own steps (its own forward and backward each step). Adam's first update is about "
                   "lr g / (|g| + eps), eps = 1e-8, so at the few elements whose clipped gradient is near eps a "
                   "float rounding difference in g shows in the update; the last column leaves out the elements "
                   "whose clipped first gradient is below 1e-6:", "",
                   "| after step | max rel difference of the update | parameter "
                   "| same, elements with clipped g >= 1e-6 |",
                   "|---:|---:|---|---:|"]
        for s, weights in enumerate(after):
            diffs = {n: rel_diff(w - init[n], theirs[f"after.{s}.{n}"] - init[n]) for n, w in weights.items()}
            big = max(rel_diff((w - init[n])[clipped[n].abs() >= 1e-6],
                               (theirs[f"after.{s}.{n}"] - init[n])[clipped[n].abs() >= 1e-6])
                      for n, w in weights.items())
            name = max(diffs, key=diffs.get)
            report.append(f"| {s + 1} | {diffs[name]:.1e} | {name} | {big:.1e} |")
            summary[f"adamw_step_{s + 1}_max_rel_update"] = diffs[name]
            summary[f"adamw_step_{s + 1}_max_rel_update_g_ge_1e-6"] = big
        report.append("")

    report += schedule_lines(steps=97)

    theirs = load_file(str(out / "speculators-benched.safetensors"))
    both = collate([train[r] for r in rows])
    both_feats = features_with_last(verifier, layer_ids, both)[0]
    ours = our_step(copy.deepcopy(drafter), both, both_feats)
    no_skip = our_step(copy.deepcopy(matched_drafter), both, both_feats)
    steps, _ = step_table(ours, theirs, matched=False, docs=len(rows))
    grads = ["| parameter | cosine, ours (defaults) | cosine, ours (skip_out_of_draft=false) |", "|---|---:|---:|"]
    summary["benched"] = {}
    for name, g in ours["grads"].items():
        if f"grad.{name}" not in theirs:
            grads.append(f"| {name} | (frozen in speculators) | |")
            continue
        pair = cosine(g, theirs[f"grad.{name}"]), cosine(no_skip["grads"][name], theirs[f"grad.{name}"])
        grads.append(f"| {name} | {pair[0]:.5f} | {pair[1]:.5f} |")
        summary["benched"][name] = pair
    report += ["## As benched, the rows together", "",
               "Ours with its defaults (eagle.skip_out_of_draft=true: no loss where the verifier's argmax is outside "
               "the draft vocabulary; lm_head trained), one row per document; speculators as the bench runs it (the "
               "raw loss mask, lm_head frozen, the documents packed into one sequence). Expected extra: what "
               "speculators trains beyond ours with skip_out_of_draft off (one target after each document's last "
               "token, and `step` chains per document boundary reading on into the next document); accounted: "
               "its positions are ours with skip_out_of_draft off plus that.", "", *steps, "",
               "Cosine of each parameter's gradient with speculators', ours with its defaults and ours with "
               "skip_out_of_draft off (then the positions differ only by the extra ones above):", "", *grads, ""]
    verdict = (f"Matched: max rel gradient difference {worst_grad:.1e}, max abs logit difference {worst_logit:.1e}: "
               + ("the two trainers compute the same step." if worst_grad <= args.tol else
                  f"ABOVE the tolerance {args.tol:g}: the trainers differ."))
    report += [verdict, ""]
    text = "\n".join(report)
    print(text)
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if worst_grad <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
