"""DFlash2's candidate selector: the lm_head proposes its top-k tokens at each block position, and a low-rank
bilinear term re-scores each one by the token drafted just before it:

    score(prev -> c | h_j) = unary_j[c] + sum_r P[prev, r] * (W h_j)[r] * S[c, r]

with unary_j the lm_head's logits at block position j (h_j its final-normed hidden state), P and S the predecessor
and successor codebooks (V x rank) and W the hidden projection (rank x H). Drafting walks the block left to right:
position 1's predecessor is the anchor (the verified token), position j's is the candidate chosen at j - 1
(`walk`). Names and shapes are vLLM's (qwen3_dflash2.py `CandidateSelector`: predecessor_codebook,
successor_codebook, hidden_projection.weight).

Training (`selector_loss`) is teacher-forced, as speculators' DFlash2 trainer does it: each position's predecessor is
the previous position's target (the anchor at position 1), the candidates are the lm_head's top-k with the target
put in the last slot where it is missing (so every position has a k-way label), and the loss is the cross-entropy of
the scores over the k candidates, weighted per block position as DFlash's loss is. The unary logits of the k
candidates are recomputed with gradient from the lm_head's rows; the top-k itself needs the whole vocabulary's
logits, taken a chunk of rows at a time without gradient, so nothing (rows, V) is kept for the backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.models.linear_loss import default_chunk_rows


class CandidateSelector(nn.Module):
    """The codebooks and projection of the module docstring; `init_std` draws all three from normal(0, std)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=init_std)

    def transition(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term: hidden (..., H), predecessors (..., P) ids, candidates (..., C) ids ->
        (..., P, C)."""
        context = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # (..., r)
        pred = self.predecessor_codebook[predecessors] * context[..., None, :]  # (..., P, r)
        succ = self.successor_codebook[candidates]  # (..., C, r)
        return pred @ succ.transpose(-1, -2)  # (..., P, C)

    def edge_scores(self, unary: torch.Tensor, hidden: torch.Tensor, candidates: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
        """Every edge of a block's candidate lattice, as vLLM's selector computes them: unary / candidates (B, K, C)
        the lm_head's top-C values / ids at block positions 1..K, hidden (B, K, H), anchors (B,) the verified
        token. -> (B, K, C, C): [b, j, p, c] scores candidate c at position j + 1 after candidate p of position j
        (at j = 0 every p stands for the anchor)."""
        C = candidates.shape[-1]
        predecessors = torch.cat([anchors[:, None, None].expand(-1, 1, C), candidates[:, :-1]], dim=1)  # (B, K, C)
        return unary[:, :, None, :].float() + self.transition(hidden, predecessors, candidates).float()


def walk(scores: torch.Tensor, candidates: torch.Tensor, pick=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft a block from its lattice, left to right: scores (B, K, C, C) (`edge_scores`), candidates (B, K, C).
    At position j the row of scores after the candidate chosen at j - 1 (row 0 at j = 0) is `pick`ed from
    (default argmax; pick(j, row (B, C)) -> index (B,)). Returns tokens (B, K) and the rows scored (B, K, C)."""
    B, K, C, _ = scores.shape
    previous = torch.zeros(B, dtype=torch.long, device=scores.device)
    tokens, rows = [], []
    for j in range(K):
        row = scores[:, j].gather(1, previous[:, None, None].expand(-1, 1, C)).squeeze(1)  # (B, C)
        previous = row.argmax(-1) if pick is None else pick(j, row)
        tokens.append(candidates[:, j].gather(1, previous[:, None]).squeeze(1))
        rows.append(row)
    return torch.stack(tokens, 1), torch.stack(rows, 1)


class _CandidateLogits(torch.autograd.Function):
    """logits[m, c] = x[m] . weight[index[m, c]], a chunk of rows at a time, the gathered rows (M, C, H) never held
    whole nor kept for the backward (weight is frozen: no gradient for it)."""

    @staticmethod
    def forward(ctx, x, weight, index):
        ctx.save_for_backward(index)
        ctx.weight = weight
        step = _chunk(index.shape[1], weight.shape[1])
        return torch.cat([torch.einsum("mh,mch->mc", x[i:i + step], weight[index[i:i + step]])
                          for i in range(0, x.shape[0], step)])

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        weight = ctx.weight
        step = _chunk(index.shape[1], weight.shape[1])
        grad_x = torch.cat([torch.einsum("mc,mch->mh", grad[i:i + step].to(weight.dtype), weight[index[i:i + step]])
                            for i in range(0, grad.shape[0], step)])
        return grad_x, None, None


def _chunk(columns: int, hidden: int) -> int:
    return max(1, (1 << 24) // max(1, columns * hidden))  # 16M gathered weights (64 MB fp32) at a time


def candidate_logits(x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(M, C): x (M, H) times the lm_head rows index (M, C) of weight (V, H), differentiable in x only."""
    return _CandidateLogits.apply(x, weight.detach(), index)


@torch.no_grad()
def top_candidates(x: torch.Tensor, lm_weight: torch.Tensor, k: int) -> torch.Tensor:
    """(M, k) ids of the k largest logits of x (M, H) @ lm_weight (V, H)^T, a chunk of rows at a time."""
    step = default_chunk_rows(lm_weight.shape[0])
    return torch.cat([(x[i:i + step] @ lm_weight.T).topk(k, dim=-1).indices for i in range(0, x.shape[0], step)])


def training_candidates(candidates: torch.Tensor, targets: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates (..., C), targets (...): the candidates with a missing target put in the last slot, the target's
    slot (...), and whether the target was among the original candidates (...)."""
    match = candidates.eq(targets[..., None])
    present = match.any(-1)
    slot = torch.where(present, match.long().argmax(-1), torch.full_like(targets, candidates.shape[-1] - 1))
    trained = candidates.clone()
    trained[..., -1] = torch.where(present, candidates[..., -1], targets)
    return trained, slot, present


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, lm_weight: torch.Tensor, targets: torch.Tensor,
                  predecessors: torch.Tensor, trained: torch.Tensor, weights: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's teacher-forced loss (module docstring) over one batch of blocks.

    hidden (B, A, K, H) the drafter's output at block positions 1..K; lm_weight (V, H); targets (B, A, K) ids;
    predecessors (B, A, K): the token before each target (the anchor, then the previous target); trained (B, A, K)
    bool; weights (K,) per block position. Returns (loss (): sum of w_k * CE over trained positions / sum of their
    w_k, step_losses (K,) each position's mean CE (detached), drafted (B, A, K): the selector's pick among the
    original top-k (without the injected target), what the engine would draft with these predecessors)."""
    B, A, K, H = hidden.shape
    C = selector.top_k
    x = hidden.reshape(-1, H).to(lm_weight.dtype)  # (M, H), M = B*A*K
    candidates = top_candidates(x.detach(), lm_weight.detach(), C)  # (M, C)
    flat_targets = targets.reshape(-1)
    cands, slot, _ = training_candidates(candidates, flat_targets)
    both = torch.cat([cands, candidates[:, -1:]], -1)  # (M, C + 1): the last column is the original k-th candidate
    unary = candidate_logits(x, lm_weight, both)  # (M, C + 1), with gradient into hidden
    transition = selector.transition(hidden.reshape(-1, H), predecessors.reshape(-1, 1), both).squeeze(1)
    scores = unary.float() + transition.float()  # (M, C + 1)
    ce = F.cross_entropy(scores[:, :C], slot, reduction="none").view(B, A, K)
    w = trained.float() * weights.to(hidden.device)  # (B, A, K)
    loss = (w * ce).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        original = torch.cat([scores[:, :C - 1], scores[:, C:]], -1)  # the original top-k's scores
        drafted = candidates.gather(1, original.argmax(-1, keepdim=True)).view(B, A, K)
        mask = trained.float()
        step_losses = (ce.detach() * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)
    return loss, step_losses, drafted
