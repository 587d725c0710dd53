"""N-gram prompt lookup: drafts the tokens that followed the latest earlier occurrence of the row's last n tokens.
No model, no training."""

from __future__ import annotations

import torch

from draftheads.eval.engine.protocol import DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.tree import Tree


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens (n from max_ngram
    down to min_ngram) and propose what followed it. Deterministic, so the draft distribution is one-hot.

    The continuation repeats with the match's period when it runs into the end of the context ("a b a b" -> the
    last "b" matched one step back -> "a b a b ..."). Without any match it proposes the root token repeated,
    a guess like any other: acceptance stays lossless whatever is proposed.
    """

    name = "ngram"
    capturable = True  # device ops on fixed buffers only (eval/engine/cuda_loop.py may graph them)

    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: expected >= 1")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: expected 1 <= min_ngram <= max_ngram")
        self.num_draft_tokens = self.max_depth = num_draft_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tree = Tree.chain(num_draft_tokens)

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        self._tree = self._tree.to(state.device)

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        return Draft(ngram_lookup(state.tokens, state.lengths, self.num_draft_tokens, self.max_ngram,
                                  self.min_ngram, window=min(state.capacity, max(state.lengths_host) + 1)),
                     self._tree)

    def describe(self) -> dict:
        return {**super().describe(), "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


def ngram_lookup(tokens: torch.Tensor, lengths: torch.Tensor, k: int, max_ngram: int, min_ngram: int,
                 window: int) -> torch.Tensor:
    """tokens (B, C) with the context tokens[b, :lengths[b] + 1]; -> (B, k) proposed continuation.

    `window` >= max(lengths) + 1 bounds the search (a Python int, so no host sync here).
    """
    B = tokens.shape[0]
    dev = tokens.device
    ctx = tokens[:, :window]
    last = lengths  # (B,) index of the context's last token (the root)
    end = torch.full((B,), -1, dtype=torch.long, device=dev)  # end index of the chosen match
    for n in range(max_ngram, min_ngram - 1, -1):
        if window < n + 1:
            continue
        pattern = ctx.gather(1, (last[:, None] - n + 1 + torch.arange(n, device=dev)).clamp_min(0))  # (B, n)
        starts = ctx.unfold(1, n, 1)  # (B, W-n+1, n): the n-gram starting at each slot
        match = (starts == pattern[:, None, :]).all(-1)  # (B, W-n+1)
        s = torch.arange(match.shape[1], device=dev)
        ok = match & (s[None, :] <= (last - n)[:, None])  # ends strictly before the pattern's own end
        found = torch.where(ok, s[None, :] + n - 1, -1).amax(-1)  # (B,) most recent end
        end = torch.where((end < 0) & (last + 1 >= n), found, end)
    end = torch.where(end < 0, last - 1, end)  # no match: period 1 from the root
    period = last - end  # (B,) >= 1
    idx = end[:, None] + 1 + torch.arange(k, device=dev)[None, :] % period[:, None]
    return tokens.gather(1, idx)
