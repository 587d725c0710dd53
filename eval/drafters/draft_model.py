"""Vanilla speculative decoding: a separate small causal LM drafts a chain or a tree, with its own KV cache.

Medusa heads and EAGLE drafters follow the same protocol (eval/engine/protocol.py) in their own modules.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from draftheads.eval.drafters.sampling import TREE_SAMPLING, pick_children
from draftheads.eval.engine.generic_runtime import is_generic, make_runner
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.runtime import UnsupportedModelError, bucket, causal_mask
from draftheads.eval.engine.tree import Tree, tree_attention_mask


def load_causal_lm(model_or_path, device=None, dtype=None, what: str = "draft model") -> nn.Module:
    """An HF causal LM from a Verifier, a module, or a name/folder (resolved and loaded like a verifier:
    safetensors only)."""
    from draftheads.models.verifier import Verifier

    if isinstance(model_or_path, Verifier):
        model = model_or_path.model
    elif isinstance(model_or_path, nn.Module):
        model = model_or_path
    elif isinstance(model_or_path, (str, os.PathLike)):
        model = Verifier.from_pretrained(model_or_path, dtype=dtype, device=device).model
    else:
        raise TypeError(f"{what}: expected a model folder/name, a Verifier or an nn.Module, got "
                        f"{type(model_or_path).__name__}")
    model = model.eval().requires_grad_(False)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


class DraftModelDrafter(Drafter):
    """Vanilla speculative decoding with a small causal LM over the same vocabulary, with its own static KV cache.

    Chain of `num_draft_tokens`, or a tree with `branching` (each node at depth d-1 gets branching[d-1]
    children: top-k when greedy or tree_sampling="topk", draws without replacement when tree_sampling="sample").
    Per step: one forward over the last committed token and the root (the last committed token may be one the
    draft model never saw, the deepest accepted draft), then one forward per tree level except the last.
    Rollback: accepted tree nodes are compacted in the draft cache like in the verifier's; rejected slots are
    overwritten later. A draft vocabulary larger than the verifier's is cut, a smaller one padded with -inf.
    """

    name = "draft-model"
    capturable = True  # device ops on fixed buffers only (eval/engine/cuda_loop.py may graph them)

    def __init__(self, model: nn.Module, vocab_size: int, num_draft_tokens: int = 4,
                 branching: list[int] | tuple[int, ...] | None = None, tree_sampling: str = "sample"):
        if tree_sampling not in TREE_SAMPLING:
            raise ValueError(f"tree_sampling={tree_sampling!r}: expected one of {TREE_SAMPLING}")
        if branching is None:
            if num_draft_tokens < 1:
                raise ValueError(f"num_draft_tokens={num_draft_tokens}: expected >= 1")
            branching = [1] * num_draft_tokens
        self.branching = [int(k) for k in branching]
        self.tree = Tree.from_branching(self.branching)
        self.num_draft_tokens = self.tree.num_nodes - 1
        self.max_depth = self.tree.max_depth
        self.tree_sampling = tree_sampling
        self.runner = make_runner(model, "draft model")
        if is_generic(self.runner) and not self.tree.is_chain:
            raise UnsupportedModelError(
                f"draft model model_type {model.config.model_type!r} runs on the generic path, which drafts chains "
                f"only; branching={self.branching} is a tree: pass num_draft_tokens=N instead")
        self.vocab_size = vocab_size
        # Breadth-first numbering: the nodes of depth d are one consecutive range.
        depth = self.tree.depth[0].tolist()
        self.levels = [(depth.index(d), len(depth) - depth[::-1].index(d)) for d in range(self.max_depth + 1)]
        self.cache = None

    def describe(self) -> dict:
        return {**super().describe(), "branching": self.branching, "tree_sampling": self.tree_sampling}

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        self.tree = self.tree.to(state.device)
        if self.cache is None or self.cache.batch_size != state.batch_size or self.cache.capacity < state.capacity:
            self.cache = self.runner.new_cache(state.batch_size, state.capacity)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        V, Vd = self.vocab_size, logits.shape[-1]
        if Vd > V:
            return logits[..., :V]
        if Vd < V:
            return torch.nn.functional.pad(logits, (0, V - Vd), value=torch.finfo(logits.dtype).min)
        return logits

    def observe(self, state: DecodeState, committed: Committed) -> None:
        if committed.prefill:
            M = committed.tokens.shape[1]
            if M == 0:
                return
            pos = torch.arange(M, device=state.device).expand(state.batch_size, M)
            mask = causal_mask(M, min(state.capacity, bucket(M)), state.device).expand(state.batch_size, -1, -1)
            self.runner(self.cache, committed.tokens, pos, pos, mask, logits=False)
        elif not self.tree.is_chain:
            self.cache.compact(committed.start, committed.path)

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        B, dev = state.batch_size, state.device
        L = state.lengths  # (B,)
        spare = state.capacity - 1  # a slot no row ever commits to (see SpeculativeDecoder._capacity)
        window = state.capacity if min(state.lengths_host) == 0 else \
            min(state.capacity, bucket(max(state.lengths_host) + self.num_draft_tokens + 1))
        # 1. The last committed token (again, in case it is an accepted leaf never run here) and the root.
        prev = (L - 1).clamp_min(0)
        prev_slot = torch.where(L > 0, L - 1, spare)  # prompts of one token have no previous token: scratch slot
        ids = torch.stack([state.tokens.gather(1, prev[:, None])[:, 0], state.roots()], 1)  # (B, 2)
        pos = torch.stack([prev, L], 1)
        slots = torch.stack([prev_slot, L], 1)
        j = torch.arange(window, device=dev)
        mask = torch.stack([(j[None] < L[:, None]) | (j[None] == prev_slot[:, None]), j[None] <= L[:, None]], 1)
        level_logits = self.runner(self.cache, ids, pos, slots, mask).logits[:, 1:]  # (B, 1, Vd) after the root
        # 2. Expand the tree level by level; the deepest level is never run through the draft model.
        tree = self.tree.expand(B)
        tokens, probs = [], []
        for d in range(1, self.max_depth + 1):
            t, p = pick_children(self._logits(level_logits), self.branching[d - 1], sampling, self.tree_sampling)
            t = t.flatten(1)  # (B, n_d) in breadth-first order
            tokens.append(t)
            if p is not None:
                probs.append(p.flatten(1, 2))
            if d < self.max_depth:
                s, e = self.levels[d]
                nodes = torch.arange(s, e, device=dev)
                mask = tree_attention_mask(L, tree.ancestors[:, s:e], window)
                level_logits = self.runner(self.cache, t, (L[:, None] + d).expand(-1, e - s), L[:, None] + nodes,
                                           mask).logits
        return Draft(torch.cat(tokens, 1), self.tree, torch.cat(probs, 1) if probs else None)
