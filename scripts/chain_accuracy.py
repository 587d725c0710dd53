"""Teacher-forced chain acceptance of EAGLE drafters on the same token sequences: every position a draft start.

    python scripts/chain_accuracy.py --verifier tiny-code --results runs/cand/eval/results.json \
        --drafter ours=runs/peers-tiny-code/draftheads-online/drafter \
        --drafter speculators=runs/peers-tiny-code/speculators-fixed [--docs runs/peers-tiny-code/docs.jsonl]

A decode (`draftheads eval`) drafts from the few positions where a verifier call ended: on 16 HumanEval prompts
of 64 new tokens, a few hundred chains. Here each drafter drafts a K-token greedy chain from *every* position of
the same sequences (the prompts and their greedy continuations, read from an eval's results.json, whose outputs are
the verifier's greedy tokens), the chain's step k reading the true token and the previous step's hidden (the
training-time unroll, `chain_counts`): where the chain is right so far the true token is the draft, so the share
of chains whose first k tokens all equal the verifier's argmax is the acceptance at position k that a decode from
there would see. Scored three ways: the prompts' positions, the continuations' positions (what decoding drafts
from), and, with --docs, held-out rows of the training documents (the last --heldout rows of a bench's
docs.jsonl, which the bench's trainers hold out). Prints acceptance at k = 1..K and tau = 1 + their sum.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


@torch.no_grad()
def chain_hits(drafter, verifier, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """(steps, n) bool for a sequence ids (T,), n = T-1-steps (the starts whose whole chain has a target): [k, t] is
    true where the chain drafted from t has its first k+1 tokens equal to the verifier's argmax (a chain from t
    predicts x_(t+2) first)."""
    ids = ids[None].to(verifier.device)
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    n = ids.shape[1] - 1 - steps
    hidden = drafter.project_features(feats.layers)
    outs = drafter.ttt_unroll(ids, hidden.to(drafter.dtype), None, steps)
    target = feats.logits.argmax(-1)[0]
    right = torch.ones(n, dtype=torch.bool, device=ids.device)
    hits = []
    for k, out in enumerate(outs):
        draft = drafter.to_target_ids(drafter.logits(out[:, :n]).argmax(-1))[0]
        right = right & (draft == target[1 + k:1 + k + n])
        hits.append(right)
    return torch.stack(hits).cpu()


def chain_acceptance(hits: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[list[float], int]:
    """(acceptance at k = 1..steps, starts scored) from each sequence's chain_hits and its mask (T,) of the starts
    scored."""
    chain = torch.zeros(hits[0].shape[0])
    total = 0
    for right, mask in zip(hits, masks):
        scored = mask.bool()[:right.shape[1]]
        chain += (right & scored).sum(1)
        total += int(scored.sum())
    return (chain / max(total, 1)).tolist(), total


def repeated_context(ids: torch.Tensor, n: int = 3) -> torch.Tensor:
    """(T,) bool: start t whose last n tokens x_(t+2-n) .. x_(t+1) (the chain from t has read x_(t+1)) also occur
    earlier in `ids`, ending before t+1."""
    out = torch.zeros(len(ids), dtype=torch.bool)
    seen = set()
    for t in range(n - 2, len(ids) - 1):
        gram = tuple(ids[t + 2 - n: t + 2].tolist())
        out[t] = gram in seen
        seen.add(gram)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--drafter", action="append", required=True, metavar="LABEL=FOLDER",
                   help="an exported EAGLE-3 folder (ours, or a peer's after import-peer --fix); repeatable")
    p.add_argument("--results", required=True, type=Path, help="a `draftheads eval` results.json (its samples)")
    p.add_argument("--docs", type=Path, help="a bench's docs.jsonl: also score its held-out tail")
    p.add_argument("--heldout", type=int, default=4, help="rows at the end of --docs to score")
    p.add_argument("-k", type=int, default=3, help="chain length")
    p.add_argument("--split-repeats", action="store_true",
                   help="also score the continuations' starts apart by whether their context repeats (the three "
                        "tokens x_(t-1), x_t, x_(t+1) occurred earlier in the sequence: a copy would draft there)")
    args = p.parse_args(argv)
    for spec in args.drafter:
        if not spec.partition("=")[2]:
            p.error(f"--drafter {spec}: expected LABEL=FOLDER")

    from draftheads.models.export import load_eagle
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(args.verifier)
    samples = json.loads(args.results.read_text())["samples"]
    seen, prompt_seqs, prompt_masks, out_masks = set(), [], [], []
    for s in samples:
        if s["id"] in seen:
            continue
        seen.add(s["id"])
        ids = torch.tensor(s["prompt_ids"] + s["output_ids"])
        P = len(s["prompt_ids"])
        in_prompt = torch.zeros(len(ids), dtype=torch.bool)
        in_prompt[:P - 1] = True  # a chain from t < P-1 first predicts a prompt token or the first output
        prompt_seqs.append(ids)
        prompt_masks.append(in_prompt)
        out_masks.append(~in_prompt)
    sets = {"humaneval prompts": (prompt_seqs, prompt_masks), "humaneval outputs": (prompt_seqs, out_masks)}
    if args.split_repeats:
        repeats = [repeated_context(ids) for ids in prompt_seqs]
        sets["outputs, repeated ctx"] = (prompt_seqs, [m & r for m, r in zip(out_masks, repeats)])
        sets["outputs, new ctx"] = (prompt_seqs, [m & ~r for m, r in zip(out_masks, repeats)])
    if args.docs:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(verifier.path)
        lines = args.docs.read_text().splitlines()[-args.heldout:]
        docs = [torch.tensor(tokenizer(json.loads(line)["text"])["input_ids"]) for line in lines]
        sets[f"docs.jsonl last {len(docs)}"] = (docs, [torch.ones(len(d), dtype=torch.bool) for d in docs])
    results = {}
    for spec in args.drafter:
        label, _, folder = spec.partition("=")
        try:
            drafter = load_eagle(folder, verifier).float().eval()
        except ValueError as err:  # DrafterFormatError, EagleError: a folder that is not an EAGLE-3 export
            raise SystemExit(f"[chain_accuracy] --drafter {spec}: {err}") from None
        hits = {}  # one verifier forward and one unroll per sequence, shared by every set that scores it
        for name, (seqs, masks) in sets.items():
            for ids in seqs:
                if id(ids) not in hits:
                    hits[id(ids)] = chain_hits(drafter, verifier, ids, args.k)
            acc, n = chain_acceptance([hits[id(ids)] for ids in seqs], masks)
            results[(label, name)] = acc
            print(f"{label:<24} {name:<22} {n:>6} starts  acceptance " + " / ".join(f"{a:.3f}" for a in acc)
                  + f"  tau {1 + sum(acc):.3f}", flush=True)
    return results


if __name__ == "__main__":
    main()
