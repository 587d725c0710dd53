"""EAGLE's point, measured: the first draft token of an EAGLE drafter against Medusa head 0, on the same batches.

    python scripts/step0_accuracy.py --verifier tiny-code \
        --drafter runs/medusa-tiny/drafter runs/eagle1-tiny/drafter runs/eagle3-tiny/drafter

Both predict x_{t+2} from what is known at position t: Medusa head 0 from the verifier's final hidden state f_t
alone; EAGLE's step 0 from f_t (EAGLE-1) or three of the verifier's layer features (EAGLE-3) *and* the token
x_{t+1} that the verifier has just produced. Each is scored at every held-out position whose target x_{t+2} is a
training target (loss_mask), two ways:
  verifier   the prediction equals argmax q_{t+1}, the verifier's greedy token: what greedy speculative decoding
             accepts, and what the EAGLE trainer logs as eval/acc_0;
  data       the prediction equals the data token x_{t+2}: what the Medusa trainer logs as eval/head0_top1.
An EAGLE-3 prediction is first mapped from its draft vocabulary to verifier ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def first_draft_tokens(drafter, input_ids: torch.Tensor, feats, position_ids: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """(B, T) verifier ids: a drafter's first draft token at each position t (its guess of x_{t+2}).

    `drafter` is an EAGLE drafter or Medusa heads (head 0); `feats` the verifier's features of input_ids;
    position_ids of packed rows (restarting per document) keep EAGLE's attention inside each document.
    """
    from draftheads.models.eagle import EagleDrafter

    if not isinstance(drafter, EagleDrafter):  # Medusa: head 0 on f_t
        return drafter(feats.final)[0].argmax(-1)
    hidden = drafter.project_features(feats.layers if drafter.version == 3 else [feats.final])  # (B, T, H)
    next_ids = F.pad(input_ids[:, 1:], (0, 1))  # x_{t+1} at position t
    out, _ = drafter(next_ids, hidden, position_ids, attention_mask=drafter.document_mask(position_ids))
    return drafter.to_target_ids(drafter.logits(out).argmax(-1))


@torch.no_grad()
def step0_accuracy(drafters: dict, verifier, batches) -> dict[str, dict[str, float]]:
    """{name: {verifier, data, positions}} over batches of {input_ids, attention_mask, loss_mask}."""
    from draftheads.data.documents import same_document
    from draftheads.models.verifier import VerifierFeatures

    layer_ids = sorted({i for d in drafters.values() for i in getattr(d, "feature_layers", [])})
    hits = {name: torch.zeros(2, dtype=torch.long) for name in drafters}
    positions = 0
    for batch in batches:
        ids = batch["input_ids"].to(verifier.device)
        doc_pos = batch["position_ids"].to(verifier.device) if "position_ids" in batch else None
        feats = verifier.features(ids, batch["attention_mask"].to(verifier.device), layer_ids=layer_ids,
                                  return_logits=True, position_ids=doc_pos)
        by_layer = dict(zip(layer_ids, feats.layers))
        greedy = feats.logits[:, 1:-1].argmax(-1)  # (B, T-2): argmax q_{t+1}
        data = ids[:, 2:]  # x_{t+2}
        valid = batch["loss_mask"][:, 2:].to(ids.device).bool()
        if doc_pos is not None:  # packed rows: only targets in the position's own document
            valid = valid & same_document(doc_pos, 2)[:, :-2]
        positions += int(valid.sum())
        for name, drafter in drafters.items():
            own = [by_layer[i] for i in getattr(drafter, "feature_layers", [])]
            pred = first_draft_tokens(drafter, ids, VerifierFeatures(final=feats.final, layers=own),
                                      doc_pos)[:, :-2]
            hits[name] += torch.stack([((pred == greedy) & valid).sum(), ((pred == data) & valid).sum()]).cpu()
    return {name: {"verifier": int(h[0]) / max(positions, 1), "data": int(h[1]) / max(positions, 1),
                   "positions": positions} for name, h in hits.items()}


def load_any(folder: Path, verifier):
    """An exported drafter folder of any method, read back for `verifier`: (label, module)."""
    from draftheads.models.export import load_eagle, load_medusa, read_metadata

    config = json.loads((folder / "config.json").read_text())
    method = read_metadata(config, str(folder / "config.json")).get("method")
    if method == "medusa":
        if (folder / "adapter").is_dir():
            raise SystemExit(f"{folder}: a Medusa-2 drafter changes the verifier; compare Medusa-1 heads")
        heads, _ = load_medusa(folder, verifier)
        return f"medusa head 0 ({folder})", heads.float().eval()
    drafter = load_eagle(folder, verifier)
    return f"{method} step 0 ({folder})", drafter.float().eval()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier", default="tiny-code", help="the verifier all drafters were trained for")
    parser.add_argument("--drafter", nargs="+", required=True, type=Path, help="exported drafter folders")
    parser.add_argument("--source", default="stdlib", help="data.source whose held-out rows are scored")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per held-out row (the tiny configs' 256)")
    parser.add_argument("--eval-rows", type=int, default=4, help="held-out source rows (the tiny configs' 4)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from draftheads.data.batching import build_datasets, collate
    from draftheads.data.config import DataConfig
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(args.verifier)
    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    _, heldout = build_datasets(DataConfig(source=args.source, seq_len=args.seq_len, eval_rows=args.eval_rows),
                                tokenizer)
    drafters = dict(load_any(folder, verifier) for folder in args.drafter)
    results = step0_accuracy(drafters, verifier, DataLoader(heldout, batch_size=args.batch_size, collate_fn=collate))
    positions = next(iter(results.values()))["positions"]
    print(f"first draft token (x_(t+2)) accuracy on {positions} held-out positions of {args.source} "
          f"({args.eval_rows} rows, {args.seq_len} tokens each):")
    print(f"  {'drafter':<60} {'vs verifier argmax':>18} {'vs data token':>14}")
    for name, r in results.items():
        print(f"  {name:<60} {r['verifier']:>18.4f} {r['data']:>14.4f}")
    return results


if __name__ == "__main__":
    main()
