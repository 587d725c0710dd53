"""Medusa in the engine: K heads on the verifier's last hidden state propose a static tree of draft tokens.

Per step the drafter reads h = the verifier's final post-norm hidden state at the last committed token (the token
before the pending root). The verifier's own head already chose the root from h; head k predicts the token after
it by k+1, so head k fills depth k+1 of the tree. A tree is a list of rank paths (`draftheads.models.medusa`): the node
(r_1, ..., r_d) holds head d-1's rank-r_d token. Heads do not look at the tokens above them, so every node of one
depth draws from the same head: the tree is one top-k per head and a gather, no per-node forward.

Which tokens the ranks mean (`tree_sampling`):
  "topk"   (default) head d-1's r-th most likely token. A deterministic pick: one-hot draft distribution, lossless
           with the tree rule of eval/engine/acceptance.py; what the Medusa paper's static trees are built for.
  "sample" at T > 0, the r-th draw without replacement from head d-1's softmax (temperature / top-p applied),
           with that draw's exact distribution (earlier draws removed) for the lossless tree rule. One sequence of
           draws per head is shared by every node of that depth: a node's children are drawn independently of
           everything that decided whether the node itself is accepted, which is what the rule needs.
At T = 0 both are the top-k (greedy acceptance).

Acceptance: lossless by default. `acceptance="typical"` switches sampled steps to Medusa's typical acceptance
(draftheads.eval.engine.acceptance.typical_tree, posterior threshold epsilon and alpha): more tokens per step, but the output
distribution is NOT the verifier's; DecodeStats.lossless says so.

Medusa-2 exports carry a LoRA adapter for the verifier: `make_medusa` merges it into the verifier in place
(`draftheads.models.medusa.load_medusa_verifier`) before the decoder builds its runner, so the verifier that verifies is
the one the heads were trained with.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftheads.eval.drafters.sampling import TREE_SAMPLING, pick_children
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.tree import Tree

ACCEPTANCE = ("lossless", "typical")


class MedusaDrafter(Drafter):
    """Medusa heads drafting a static tree (paths of ranks); see the module docstring."""

    name = "medusa"
    capturable = True  # every step op is a device op on fixed buffers (eval/engine/cuda_loop.py may graph it)
    wants_final = True

    def __init__(self, heads, paths, tree_sampling: str = "topk", typical: tuple[float, float] | None = None,
                 tree_source: str = "paths"):
        from draftheads.models.medusa import check_tree

        if tree_sampling not in TREE_SAMPLING:
            raise ValueError(f"medusa tree_sampling={tree_sampling!r}: expected one of {TREE_SAMPLING}")
        paths = check_tree(paths, heads.num_heads, where="medusa tree")
        if not paths:
            raise ValueError("medusa tree: expected at least one path")
        self.heads = heads
        self.paths = sorted(paths, key=lambda p: (len(p), p))  # Tree.from_paths numbers nodes in this order
        self.tree = Tree.from_paths(self.paths)
        self.num_draft_tokens = len(self.paths)
        self.max_depth = self.tree.max_depth
        self.tree_sampling = tree_sampling
        self.typical = typical
        self.tree_source = tree_source
        """Where the tree came from (the export, paths, a rebuilt budget, a chain): reported by describe()."""
        self.node_head = torch.tensor([len(p) - 1 for p in self.paths])  # (N,) head that fills each node
        self.node_rank = torch.tensor([p[-1] for p in self.paths])  # (N,) its rank among that head's tokens
        self.num_ranks = int(self.node_rank.max()) + 1
        self._hidden: torch.Tensor | None = None

    def describe(self) -> dict:
        return {**super().describe(), "tree": [list(p) for p in self.paths], "tree_sampling": self.tree_sampling,
                "tree_source": self.tree_source, "num_heads": self.heads.num_heads}

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        dev = state.device
        self.tree = self.tree.to(dev)
        self.node_head, self.node_rank = self.node_head.to(dev), self.node_rank.to(dev)
        self._hidden = torch.zeros(state.batch_size, self.heads.hidden_size, dtype=self.heads.dtype, device=dev)

    def observe(self, state: DecodeState, committed: Committed) -> None:
        if committed.final.shape[1] == 0:  # one-token prompts: nothing committed yet, keep the zeros
            return
        self._hidden = committed.last(committed.final)  # (B, H) at each row's last committed token

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (D, B, V): the heads this tree uses (the first D), not all K."""
        h = hidden.to(self.heads.dtype)
        heads = self.heads
        return torch.stack([heads.head_logits(k, h) for k in range(self.max_depth)])

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        logits = self.head_logits(self._hidden)  # (D, B, V)
        if sampling.greedy or self.tree_sampling == "topk":
            ranked = logits.topk(self.num_ranks, dim=-1).indices  # (D, B, R) best first
            tokens = ranked[self.node_head, :, self.node_rank].T  # (B, N)
            return Draft(tokens, self.tree)
        picks, probs = pick_children(logits[:, :, None], self.num_ranks, sampling, "sample")  # (D,B,1,R), +V
        tokens = picks[self.node_head, :, 0, self.node_rank].T  # (B, N)
        probs = probs[self.node_head, :, 0, self.node_rank].transpose(0, 1)  # (B, N, V)
        return Draft(tokens, self.tree, probs)


def resolve_tree(num_heads: int, meta: dict, paths=None, tree_budget: int | None = None, chain=None
                 ) -> tuple[list[tuple[int, ...]], str]:
    """The tree to draft and where it came from: `paths`, a tree of `tree_budget` nodes rebuilt from the export's
    rank accuracies, a `chain` of K top-1 tokens (True: one per head), or else the export's own tree (a chain of
    every head when the export has none)."""
    from draftheads.models.medusa import build_medusa_tree

    given = [name for name, v in (("paths", paths), ("tree_budget", tree_budget), ("chain", chain)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"method 'medusa': give at most one of paths, tree_budget, chain (got {', '.join(given)})")
    if paths is not None:
        return [tuple(int(r) for r in p) for p in paths], "paths"
    if tree_budget is not None:
        if not meta.get("rank_accuracy"):
            raise ValueError("method 'medusa': tree_budget needs the export's `draftheads.rank_accuracy` (written by "
                             "the Medusa trainer); this export has none. Pass paths=[...] instead.")
        return build_medusa_tree(meta["rank_accuracy"], int(tree_budget)), f"rank_accuracy, budget {tree_budget}"
    if chain is not None:
        k = num_heads if chain is True else int(chain)
        if not 1 <= k <= num_heads:
            raise ValueError(f"method 'medusa': chain={chain!r}; expected 1..{num_heads} (one token per head) or True")
        return [(0,) * d for d in range(1, k + 1)], "chain"
    if meta.get("tree"):
        return list(meta["tree"]), "export"
    return [(0,) * d for d in range(1, num_heads + 1)], "chain (the export has no tree)"


def make_medusa(verifier, draft, paths=None, tree_budget: int | None = None, chain=None,
                tree_sampling: str = "topk", acceptance: str = "lossless", typical_epsilon: float = 0.09,
                typical_alpha: float = 0.3) -> MedusaDrafter:
    """The `medusa` method: `draft` is an exported folder (`draftheads.models.medusa.save_medusa`) or a MedusaHeads module.

    A Medusa-2 folder's LoRA adapter is merged into `verifier` in place (once; loading the same folder again is a
    no-op, another adapter on an already adapted verifier is an error)."""
    from draftheads.models.export import load_medusa
    from draftheads.models.medusa import MedusaHeads

    if acceptance not in ACCEPTANCE:
        raise ValueError(f"method 'medusa': acceptance={acceptance!r}; expected one of {ACCEPTANCE}")
    if acceptance == "typical" and not (0 < typical_epsilon < 1 and 0 < typical_alpha <= 1):
        raise ValueError(f"method 'medusa': typical_epsilon={typical_epsilon}, typical_alpha={typical_alpha}; "
                         "expected 0 < epsilon < 1 and 0 < alpha <= 1")
    if draft is None:
        raise ValueError("method 'medusa' needs draft=<a Medusa export folder (save_medusa) or MedusaHeads>")
    if isinstance(draft, MedusaHeads):
        heads, meta = draft, {}
    elif isinstance(draft, (str, os.PathLike)):
        heads, meta = load_medusa(draft, verifier)  # checks the folder and that it was trained for this verifier
        if meta.get("adapter"):
            _merge_adapter_once(Path(draft), meta["adapter"], verifier)
    else:
        raise TypeError(f"method 'medusa': draft must be an export folder or MedusaHeads, got {type(draft).__name__}")
    if (heads.hidden_size, heads.vocab_size) != (verifier.hidden_size, verifier.vocab_size):
        raise ValueError(f"method 'medusa': heads have hidden_size={heads.hidden_size}, vocab_size="
                         f"{heads.vocab_size}; the verifier has {verifier.hidden_size}, {verifier.vocab_size}")
    heads = heads.to(verifier.device).eval().requires_grad_(False)
    if heads.shared_lm_head:  # in the heads' dtype once, not cast in every step (the verifier's tensor untouched)
        heads.place_shared_head(verifier.device, heads.dtype)
    tree, source = resolve_tree(heads.num_heads, meta, paths, tree_budget, chain)
    typical = (float(typical_epsilon), float(typical_alpha)) if acceptance == "typical" else None
    return MedusaDrafter(heads, tree, tree_sampling, typical, source)


def _merge_adapter_once(folder: Path, adapter: str, verifier) -> None:
    """Medusa-2: merge the export's adapter into the verifier unless this very adapter is already merged."""
    from draftheads.models.export import load_medusa_verifier

    source = str((folder / adapter).resolve())
    merged = getattr(verifier, "merged_medusa_adapter", None)
    if merged == source:
        return
    if merged is not None:
        raise ValueError(f"verifier {verifier.name!r} already carries the Medusa-2 adapter {merged}; load "
                         f"{source} onto a fresh base verifier")
    load_medusa_verifier(folder, verifier, merge=True)
    verifier.merged_medusa_adapter = source
