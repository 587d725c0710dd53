"""Lookahead decoding (Fu et al. 2024): no draft model, no training. Each step's one verifier forward carries two
branches besides the root:

  - the lookahead branch: a Jacobi window of W future positions kept for N-1 iterations (a 2D window of (N-1) x W
    tokens). The token of level r (0 = oldest) and column j (1..W) sits at position root + j + r and attends to the
    prefix, the root, level 0's columns 1..j and its own column's levels 1..r: one consistent guessed sequence of
    consecutive positions, so its output is a Jacobi update of the next position. The newest level's outputs are the
    new level; each column's trajectory (level 0, level 1, ..., level N-2, the new token) is an n-gram of N
    consecutive guesses, added to the n-gram pool under its first token; the oldest level is dropped.
  - the verification branch: up to G n-grams from the pool whose first token is the root, their N-1 continuation
    tokens drafted as G chains off the root (a tree: the engine's greedy rule takes the deepest matching chain, the
    sampled rule is the recursive rejection sampling every tree uses, so sampling stays lossless).
The two branches cannot see each other (the extra nodes, `draftheads.eval.engine.protocol.ExtraNodes`, attend only to the prefix, the
root and their own window). The pool also takes the n-grams of the prompt and of the committed text (`context_pool`,
on by default: n-grams that occur in the text itself, as prompt lookup finds them; off gives the paper's pool of
trajectory n-grams only). Window and pool are kept per row on the host: propose reads the root and the new level
in one host sync, and with `context_pool` observe reads the committed tokens. A step runs 1 + G(N-1) + W(N-1) tokens through the verifier. The fused loop runs it with the drafter
eager (host work) between the verifier's segments.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, ExtraNodes, Sampling
from draftheads.eval.engine.tree import Tree

#: n-grams kept per first token (most recent first when drafting)
POOL_PER_KEY = 32


class LookaheadDrafter(Drafter):
    """window W, ngram_size N, guesses G, as the paper names them (module docstring)."""

    name = "lookahead"

    def __init__(self, window: int = 4, ngram_size: int = 3, guesses: int | None = None, context_pool: bool = True):
        guesses = window if guesses is None else guesses
        if window < 1 or ngram_size < 2 or guesses < 1:
            raise ValueError(f"lookahead window={window}, ngram_size={ngram_size}, guesses={guesses}: expected "
                             "window >= 1, ngram_size >= 2, guesses >= 1")
        self.W, self.N, self.G = window, ngram_size, guesses
        self.context_pool = context_pool
        depth = ngram_size - 1
        self.tree = Tree.from_branching([guesses] + [1] * (depth - 1))
        self.num_draft_tokens, self.max_depth = guesses * depth, depth
        self.num_extra_nodes = depth * window
        # the window's layout: node (r, j) at index r * W + (j - 1)
        r = torch.arange(depth).repeat_interleave(window)
        j = torch.arange(1, window + 1).repeat(depth)
        self._offsets = j + r
        first_level = (r[None, :] == 0) & (j[None, :] <= j[:, None])  # level 0, columns 1..j
        own_column = (j[None, :] == j[:, None]) & (r[None, :] >= 1) & (r[None, :] <= r[:, None])
        self._mask = first_level | own_column
        self.levels: list[list[list[int]]] = []
        self.pools: list[dict[int, OrderedDict]] = []
        self._new: torch.Tensor | None = None
        self._device = torch.device("cpu")

    def describe(self) -> dict:
        return {**super().describe(), "window": self.W, "ngram_size": self.N, "guesses": self.G,
                "context_pool": self.context_pool, "extra_nodes": self.num_extra_nodes}

    # ---- the pool ----------------------------------------------------------------------------------------------
    def _add(self, b: int, gram: list[int]) -> None:
        bucket = self.pools[b].setdefault(gram[0], OrderedDict())
        rest = tuple(gram[1:])
        bucket.pop(rest, None)
        bucket[rest] = None  # most recent last
        if len(bucket) > POOL_PER_KEY:
            bucket.popitem(last=False)

    def _add_text(self, b: int, tokens: list[int]) -> None:
        for i in range(len(tokens) - self.N + 1):
            self._add(b, tokens[i: i + self.N])

    # ---- protocol ----------------------------------------------------------------------------------------------
    def start(self, state: DecodeState, sampling: Sampling) -> None:
        B = state.batch_size
        self._device = state.device
        self.tree = self.tree.to(state.device)
        self._offsets, self._mask = self._offsets.to(state.device), self._mask.to(state.device)
        self.pools = [{} for _ in range(B)]
        self._new = None
        self._tail: list[list[int]] = [[] for _ in range(B)]  # the last N-1 committed tokens, to join n-grams
        prompts = state.tokens[:, : max(state.lengths_host) + 1].tolist()
        self.levels = []
        for b in range(B):
            ctx = prompts[b][: state.lengths_host[b] + 1]  # committed prompt tokens and the root
            # the first guesses: tokens of the prompt, spread over the window (any guess is lossless)
            self.levels.append([[ctx[(7919 * (r * self.W + j) + r) % len(ctx)] for j in range(self.W)]
                                for r in range(self.N - 1)])

    def observe(self, state: DecodeState, committed: Committed) -> None:
        if not self.context_pool:
            return
        rows, counts = committed.tokens.tolist(), committed.count.tolist()
        for b, (row, c) in enumerate(zip(rows, counts)):
            if c == 0:
                continue
            text = self._tail[b] + row[:c]  # the committed tokens (the root comes with the next step's)
            self._add_text(b, text)
            self._tail[b] = text[-(self.N - 1):]

    def see_extra(self, logits: torch.Tensor) -> None:
        last = (self.N - 2) * self.W
        self._new = logits[:, last: last + self.W].argmax(-1)  # (B, W): the newest level's Jacobi update

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        B, depth = state.batch_size, self.N - 1
        roots = state.roots()
        host = torch.cat([roots[:, None], self._new], 1).tolist() if self._new is not None else \
            [[r] for r in roots.tolist()]  # the step's one host sync
        drafts, window = [], []
        for b in range(B):
            root = host[b][0]
            if len(host[b]) > 1:  # finished rows too (harmless): the fused loop keeps no per-row host flags here
                new = host[b][1:]
                levels = self.levels[b]
                for j in range(self.W):  # each column's trajectory is an n-gram of N consecutive guesses
                    self._add(b, [levels[r][j] for r in range(depth)] + [new[j]])
                self.levels[b] = levels[1:] + [new]
            found = list(reversed(self.pools[b].get(root, {})))[: self.G]  # most recent first
            while len(found) < self.G:
                found.append(found[0] if found else (root,) * depth)
            drafts.append([found[g][d] for d in range(depth) for g in range(self.G)])  # breadth first
            window.append([t for level in self.levels[b] for t in level])
        tokens = torch.tensor(drafts, dtype=torch.long, device=self._device)
        extra = ExtraNodes(torch.tensor(window, dtype=torch.long, device=self._device), self._offsets, self._mask)
        return Draft(tokens, self.tree, None, extra=extra)
