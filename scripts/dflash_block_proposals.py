"""What trained DFlash drafters propose at each block position: how often position k repeats position k-1's token
and how many distinct tokens a position proposes over many blocks, beside the same figures for the data itself.

    PYTHONPATH=. python scripts/dflash_block_proposals.py --data runs/bench-dflash/selfdistill.jsonl \
        runs/bench-dflash/dflash-b8/drafter [DRAFTER ...] [--verifier tiny-code] [--rows 8] [--anchors 32]

A drafter whose first layer attends within a window of W positions, causally inside the block, sees only mask
tokens there at block positions k >= W: their first-layer outputs are one and the same vector, and the later
layers tell them apart only by their positions (docs/train-dflash.md#positions-past-the-window). This prints what that
does to the proposals. Rows: the last `--rows` rows of `--data` (`text` rows), `--anchors` random anchors each
(seed 0), the same anchors for every drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", help="exported DFlash drafter folders")
    p.add_argument("--data", required=True, help="a JSONL file of {\"text\": ...} rows")
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)
    for key in ("rows", "anchors", "seq_len"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected a positive integer")
    for folder in args.drafters:
        if not (Path(folder) / "config.json").is_file():
            p.error(f"{folder}: no exported drafter there (no config.json)")
    texts = []
    with open(args.data) as f:
        for n, line in enumerate(f, 1):
            row = json.loads(line) if line.strip() else {}
            if not isinstance(row.get("text"), str):
                p.error(f"{args.data}:{n}: expected a JSON object with a string \"text\"")
            texts.append(row["text"])
    texts = texts[-args.rows:]

    import torch
    import transformers

    from draftheads.models.dflash.blocks import sample_anchors
    from draftheads.models.export import load_dflash
    from draftheads.models.verifier import Verifier

    torch.set_num_threads(1)
    verifier = Verifier.from_pretrained(args.verifier)
    tokenizer = transformers.AutoTokenizer.from_pretrained(verifier.path)
    rows = [torch.tensor([tokenizer(t)["input_ids"][:args.seq_len]]) for t in texts]
    anchors = [sample_anchors(torch.ones_like(ids), args.anchors, torch.Generator().manual_seed(0)) for ids in rows]

    def report(label: str, tokens: list[torch.Tensor]) -> None:  # tokens: (A, N-1) per row, positions 1..N-1
        t = torch.cat(tokens)
        repeats = " ".join(f"{(t[:, k] == t[:, k - 1]).float().mean():.2f}" for k in range(1, t.shape[1]))
        distinct = " ".join(str(len(set(t[:, k].tolist()))) for k in range(t.shape[1]))
        print(f"{label}: {t.shape[0]} blocks\n  repeats position k-1's token, k = 2..{t.shape[1]}: {repeats}\n"
              f"  distinct tokens, k = 1..{t.shape[1]}: {distinct}")

    for folder in args.drafters:
        drafter = load_dflash(folder, verifier).eval()
        N = drafter.block_size
        proposed, data = [], []
        for ids, (a, valid) in zip(rows, anchors):
            features = verifier.features(ids, layer_ids=drafter.feature_layers)
            with torch.no_grad():
                hidden = drafter.anchored_hidden(ids, torch.cat(features.layers, -1), a, valid)
                proposed.append(drafter.logits(hidden[0, :, 1:]).argmax(-1)[valid[0]])
            index = (a[0, :, None] + torch.arange(1, N)).clamp(max=ids.shape[1] - 1)
            data.append(ids[0][index][valid[0]])
        window = drafter.cfg.sliding_window if "sliding_attention" in (drafter.cfg.layer_types or []) else None
        report(f"{folder} (block {N}, layers {drafter.cfg.layer_types or 'all full'}, window {window})", proposed)
        report("  the data at the same blocks", data)


if __name__ == "__main__":
    sys.exit(main())
