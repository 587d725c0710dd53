"""DSpark's two heads on a DFlash drafter: the Markov head and the confidence head (`dflash.markov_rank`).

The DFlash backbone drafts a block in one parallel forward; each block position's logits then get a transition bias
from the token before it, so the drafts are taken left to right (vLLM's qwen3_dspark.py / DSparkSpeculator):

    e_k = markov_w1[x_{k-1}]                 (r,)   x_0 is the anchor, x_{k-1} the previous draft (a verifier id)
    logits_k = lm_head(h_k) + markov_w2 e_k   (Vd,)  in the drafter's vocabulary (the verifier's, or its own)
    x_k = pick(logits_k)                             argmax at T = 0, a draw at T > 0
    confidence_k = sigmoid(proj([h_k; e_k]))         with confidence_with_markov, else proj(h_k)

Names are vLLM's (`markov_head.markov_w1.weight` (V, r), `markov_head.markov_w2.weight` (Vd, r),
`confidence_head.proj.{weight,bias}`), so the export writes the state dict as it is. Training teacher-forces x_{k-1}
(the anchor, then the targets), as speculators' and SpecForge's DSpark trainers do; the losses are
models/dflash/losses.py.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class MarkovHead(nn.Module):
    """markov_w1: Embedding(V, r) over the verifier's vocabulary (the previous token); markov_w2: Linear(r, Vd), the
    bias over the drafter's vocabulary. w1 starts at normal(0, 0.01) (speculators' init), so the bias starts small."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        with torch.no_grad():
            self.markov_w1.weight.normal_(0.0, 0.01)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(...,) verifier ids -> (..., r)."""
        return self.markov_w1(token_ids.long())

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        """(..., r) -> (..., Vd)."""
        return self.markov_w2(embed.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """proj: Linear(H (+ r), 1, bias) -> a logit of the drafted token's acceptance probability; computed in fp32, as
    vLLM holds it (params_dtype float32)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """hidden (..., H), embed (..., r) -> (...,) logits (fp32)."""
        x = torch.cat([hidden, embed.to(hidden.dtype)], -1) if self.with_markov else hidden
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


def markov_chain(base: torch.Tensor, root: torch.Tensor, head: MarkovHead,
                 pick: Callable[[torch.Tensor, int], torch.Tensor],
                 spread: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft a block left to right: base (B, K, Vd) the backbone's logits at block positions 1..K, root (B,) the
    anchor (a verifier id). At position k, spread(base_k + bias(embed(prev))) -> (B, V) verifier-vocabulary logits,
    pick(logits, k) -> (B,) the drafted verifier ids, which become prev. Returns (tokens (B, K), logits (B, K, V),
    embeds (B, K, r): the Markov embedding each position read)."""
    prev, tokens, logits, embeds = root, [], [], []
    for k in range(base.shape[1]):
        e = head.embed(prev)  # (B, r)
        step = spread(base[:, k] + head.bias(e).to(base.dtype))  # (B, V)
        prev = pick(step, k)
        tokens.append(prev)
        logits.append(step)
        embeds.append(e)
    return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(embeds, 1)
