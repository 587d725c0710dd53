"""What a drafter's token loss can be: divergences between the verifier's next-token distribution p and the
drafter's q, and how the steps of a draft chain are weighted. Pure functions on tensors.

At one position, with p the verifier's distribution (over the drafter's vocabulary: EAGLE-3 renormalises it over
its draft vocabulary) and q = softmax(drafter logits):

  forward_kl   -sum_v p_v log q_v, the soft cross-entropy of the EAGLE repo, SpecForge and speculators: KL(p || q)
               plus the entropy of p, which does not depend on the drafter (same gradient, same optimum). Mass-
               covering: q spreads over every token p might choose.
  reverse_kl   KL(q || p) = sum_v q_v (log q_v - log p_v). Mode-seeking: q may drop p's tail and pile onto its peak.
  jsd          Jensen-Shannon, (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2; bounded by log 2.
  tv           total variation, sum_v |p_v - q_v| / 2 = 1 - alpha, where alpha = sum_v min(p_v, q_v) is the
               probability that speculative sampling at temperature 1 accepts a token drawn from q.
  lk           -log(alpha): acceptance targeted directly (LK losses, Samarin et al. 2026, arXiv 2602.23881; "nla" in
               speculators). Its gradient is the total variation's divided by alpha, so positions the drafter gets
               badly wrong count the most.
  lk_hybrid    lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-eta * alpha) per position with alpha taken
               without gradient (`hybrid_weight`; eta = 3 as in speculators and the paper's released drafters):
               KL's dense signal where the drafter is far from p, the acceptance objective as it gets close.
               (SpecForge computes lam from the batch's mean alpha instead; here it is per position.)

All are >= 0 except forward_kl (>= H(p)); each is 0 (forward_kl: H(p)) exactly when q = p. They are computed in
float32 from log-probabilities, so no term takes the log of an underflowed 0.

Step weights: a chain of K draft steps sums w_k * loss_k.
  exponential  w_k = decay**k (EAGLE-3's 0.8**k): later steps matter less, since they are reached less often.
  uniform      w_k = 1.
  reach        w_k = prod_{j<k} a_j, with a_j the batch's mean measured acceptance (alpha) at step j, no gradient:
               the chance the chain gets to step k at all, as the data says, instead of a fixed 0.8 per step.
"""

from __future__ import annotations

import itertools
import math

import torch

TOKEN_LOSSES = ("forward_kl", "reverse_kl", "jsd", "tv", "lk", "lk_hybrid")
STEP_WEIGHTS = ("exponential", "uniform", "reach")


def acceptance(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p_v, q_v) (..., V) -> (...): the chance speculative sampling accepts a draw from q."""
    return torch.minimum(target_logp, draft_logp).exp().sum(-1)


def hybrid_weight(alpha: torch.Tensor, eta: float) -> torch.Tensor:
    """lk_hybrid's weight on the KL term, exp(-eta * alpha), computed without gradient."""
    return torch.exp(-eta * alpha.detach())


def token_loss(kind: str, draft_logits: torch.Tensor, target_logp: torch.Tensor,
               lk_eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss and acceptance alpha, each (...), for drafter logits and the verifier's log-probs (..., V).

    alpha is returned without gradient (the step weights and the logs read it).
    """
    if kind not in TOKEN_LOSSES:
        raise ValueError(f"token loss {kind!r}: expected one of {TOKEN_LOSSES}")
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    logp = target_logp.float()
    p = logp.exp()
    alpha = acceptance(logp, logq)
    if kind == "forward_kl":
        loss = -(p * logq).sum(-1)
    elif kind == "reverse_kl":
        loss = (logq.exp() * (logq - logp)).sum(-1)
    elif kind == "jsd":
        q = logq.exp()
        logm = torch.logaddexp(logp, logq) - math.log(2.0)
        loss = 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    elif kind == "tv":
        loss = 1.0 - alpha
    elif kind == "lk":
        loss = -torch.log(alpha.clamp_min(1e-30))
    else:  # lk_hybrid
        lam = hybrid_weight(alpha, lk_eta)
        loss = lam * (p * (logp - logq)).sum(-1) + (1 - lam) * (1.0 - alpha)
    return loss, alpha.detach()


def soft_cross_entropy(draft_logits: torch.Tensor, target_p: torch.Tensor,
                       target_mass: torch.Tensor | None = None) -> torch.Tensor:
    """forward_kl's per-position loss, -sum_v p_v log q_v (...), from drafter logits and the verifier's
    probabilities p (..., V): `token_loss("forward_kl", logits, log p)` without the acceptance alpha, in one pass
    each way. log q = logits - logsumexp(logits), so the loss is logsumexp * sum(p) - sum(p * logits) and its
    gradient (softmax(logits) * sum(p) - p) * g; `target_mass` is sum_v p_v (...) when the caller has it (a
    trainer slicing one target tensor for several steps computes it once). Float32 whatever the logits' dtype."""
    if target_mass is None:
        target_mass = target_p.float().sum(-1)
    return _SoftCrossEntropy.apply(draft_logits, target_p, target_mass)


def soft_cross_entropy_grad(draft_logits: torch.Tensor, target_p: torch.Tensor, target_mass: torch.Tensor,
                            weight: torch.Tensor, out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_cross_entropy`'s per-position loss (...) and, at once, the gradient of sum(weight * loss) with respect to
    the logits, weight * (softmax(logits) * sum(p) - p) (..., V): what its autograd backward gives for the upstream
    `weight` (...), computed in place in one float32 copy of the logits (float64 for float64 ones), without a graph,
    under autocast too. For a caller that needs the gradient right away (the EAGLE-3 head's backward in its
    forward). out: a buffer of the logits' shape in that dtype to compute in (a caller looping over chunks reuses
    one: a fresh (C, V) buffer a chunk costs the CPU its page faults, more than the arithmetic); the gradient is it."""
    exact = torch.promote_types(draft_logits.dtype, torch.float32)  # float64 stays float64
    if out is None:
        out = torch.empty_like(draft_logits, dtype=exact)
    x = out.copy_(draft_logits)
    p = target_p.to(exact)
    top = x.amax(-1, keepdim=True)
    dot = _row_dot(p, x)
    total = x.sub_(top).exp_().sum(-1, keepdim=True)  # x: exp(logits - max)
    loss = (total.log() + top).squeeze(-1) * target_mass - dot
    weight = weight.to(exact)
    x.mul_((weight * target_mass)[..., None] / total)  # weight * sum(p) * softmax
    return loss, x.addcmul_(p, weight[..., None], value=-1)


#: Rows of the product a block of `_row_dot` holds at once.
DOT_BLOCK_ELEMENTS = 1 << 21


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) of (..., V) tensors (views of any strides) through one small product buffer reused over blocks
    of rows, not a whole (..., V) product (elementwise, exact: no matmul, which autocast would run in bf16)."""
    if a.dim() == 1:
        return _row_dot(a[None], b[None])[0]
    C, V = a.shape[-2:]
    rows = max(1, min(C, DOT_BLOCK_ELEMENTS // max(V, 1)))
    out = torch.empty(a.shape[:-1], dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    tmp = torch.empty(rows, V, dtype=out.dtype, device=a.device)
    for lead in itertools.product(*(range(n) for n in a.shape[:-2])):
        a1, b1, o1 = a[lead], b[lead], out[lead]  # (C, V), (C,)
        for r in range(0, C, rows):
            n = min(rows, C - r)
            torch.sum(torch.mul(a1[r:r + n], b1[r:r + n], out=tmp[:n]), -1, out=o1[r:r + n])
    return out


class _SoftCrossEntropy(torch.autograd.Function):
    """Autograd over log_softmax and the product keeps log q, recomputes exp(log q) in the gradient and adds the
    product's own backward; here softmax(logits) is kept from the forward and the gradient is one expression."""

    @staticmethod
    def forward(ctx, logits, target_p, target_mass):
        x = logits.float()
        top = x.amax(-1, keepdim=True)
        q = (x - top).exp_()
        total = q.sum(-1, keepdim=True)
        lse = (total.log() + top).squeeze(-1)
        q.div_(total)  # softmax(logits)
        p = target_p.float()
        ctx.save_for_backward(q, p, target_mass)
        ctx.logits_dtype = logits.dtype
        return lse * target_mass - (p * x).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        q, p, mass = ctx.saved_tensors
        grad = grad.float()[..., None]
        d_logits = q * (grad * mass[..., None])
        d_logits -= p * grad
        return d_logits.to(ctx.logits_dtype), None, None


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where mask is true; 0 when nothing is masked in."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def step_weights(kind: str, num_steps: int, decay: float = 0.8,
                 step_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """(K,) weights of a chain's K step losses; `reach` needs step_alpha (K,), each step's mean acceptance."""
    if kind == "exponential":
        return decay ** torch.arange(num_steps, dtype=torch.float32)
    if kind == "uniform":
        return torch.ones(num_steps)
    if kind == "reach":
        if step_alpha is None or step_alpha.numel() != num_steps:
            raise ValueError(f"step weights 'reach' need the {num_steps} steps' mean acceptance")
        a = step_alpha.detach().float()
        return torch.cat([a.new_ones(1), torch.cumprod(a, 0)[:-1]])
    raise ValueError(f"step weights {kind!r}: expected one of {STEP_WEIGHTS}")
