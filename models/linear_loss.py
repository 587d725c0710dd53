"""The loss of a linear layer's logits without ever holding all of them: only (C, V) chunks exist at a time.

    out = linear_loss(x, weight, target, token_weight, teacher_logits=None, ce_weight=1.0, kl_weight=0.0)
    out.loss.backward()

x (N, H) @ weight (V, H)^T gives logits (N, V); the loss is

    Σ_i w_i · [ce_weight · CE(logits_i, target_i) + kl_weight · KL(softmax(teacher_logits_i) || softmax(logits_i))]

with w = token_weight (N,) (put valid / count there for a masked mean). Why: a drafter head over a real vocabulary
is huge at the logits. Llama-3 with B·T = 16k tokens and V = 128k holds 8.4 GB of fp32 logits per head, and autograd
keeps them (plus softmax, plus their gradient) until backward; four Medusa heads would need far more than the GPU
has. Here each chunk of C rows computes its logits, its loss, and right away its gradient (softmax − one-hot, or
softmax − teacher), turned into grad_x = g @ W (C, H) and grad_W += g^T @ x (V, H); the logits are then dropped.
The forward does the backward's matmuls, so nothing is recomputed: the FLOPs equal plain autograd's, peak memory
is a few (C, V) buffers plus one (V, H) gradient. Backward only scales the stored gradients by the upstream scalar.

Also returned, detached, for logging: the CE and KL parts and `hits` (R,) = how many rows with w > 0 have their
target at rank r of the logits (top-1 accuracy is hits[0] / rows). Under `torch.no_grad()` (or when neither x
nor weight needs grad) the same chunks run without any gradient work: that is the held-out evaluation path.
Works under autocast (the matmuls run in the autocast dtype, the softmax in fp32) and with frozen weights.

A second linear term may be added to the logits, `extra=(x2 (N, r), weight2 (V, r))`: logits = x W^T + x2 W2^T
(DSpark's low-rank Markov bias beside a frozen lm_head); each pair gets its own gradients, so a frozen W never gets a
(V, H) gradient because W2 trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Bytes of one (C, V) fp32 chunk buffer; about five of them are alive at once. Not smaller: every chunk adds a
#: (V, H) product into grad_W, and below ~1k rows (Llama-3: 128k x 4k) that read-modify-write costs a GPU more time
#: than the chunk's matmul itself. 512 MB gives 1024 rows at V = 128k, and the whole batch at small vocabularies.
CHUNK_BYTES = 1 << 29


@dataclass
class LinearLossOut:
    """What `linear_loss` returns."""

    loss: torch.Tensor
    """() Σ w·(ce_weight·CE + kl_weight·KL), differentiable w.r.t. x and weight."""
    ce: torch.Tensor
    """() Σ w·CE, detached."""
    kl: torch.Tensor
    """() Σ w·KL(teacher || student), detached (0 without a teacher)."""
    hits: torch.Tensor
    """(R,) rows with w > 0 whose target is the rank-r prediction, detached."""
    argmax: torch.Tensor | None = None
    """(N,) every row's top prediction (weighted or not), with `argmax=True`; else None."""


def default_chunk_rows(vocab_size: int) -> int:
    return max(16, CHUNK_BYTES // (4 * vocab_size))


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype x @ weight.T runs (and returns) in: autocast's where it is on for x's device, else the weight's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def _chunks(x, weight, target, token_weight, teacher_logits, ce_weight, kl_weight, max_rank, chunk_rows, grads,
            want_argmax=False, x2=None, weight2=None):
    """The shared loop: yields nothing, returns sums (and gradients when `grads`), and each row's argmax (an empty
    tensor unless `want_argmax`)."""
    N = x.shape[0]
    argmax = torch.empty(N if want_argmax else 0, dtype=torch.long, device=x.device)
    mm = matmul_dtype(x, weight)
    acc = torch.promote_types(mm, torch.float32)  # softmax and sums: fp32 (fp64 when the inputs are)
    w_mm = weight.to(mm)
    loss = x.new_zeros((), dtype=acc)
    ce_sum, kl_sum = loss.clone(), loss.clone()
    hits = x.new_zeros((max_rank,), dtype=torch.float32)
    grad_x = torch.empty_like(x) if grads and x.requires_grad else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
        if grads and weight.requires_grad else None
    w2_mm = weight2.to(mm) if weight2 is not None else None
    grad_x2 = torch.empty_like(x2) if grads and x2 is not None and x2.requires_grad else None
    grad_w2 = torch.zeros(weight2.shape, dtype=acc, device=weight2.device) \
        if grads and weight2 is not None and weight2.requires_grad else None
    rows = min(chunk_rows, N)  # one (C, V) buffer in fp32 (and one in the matmul dtype) reused by every chunk:
    V = weight.shape[0]
    buf = torch.empty(rows, V, dtype=acc, device=x.device)  # a fresh one a chunk costs the CPU its page faults
    buf_mm = torch.empty(rows, V, dtype=mm, device=x.device) if mm != acc else None
    with torch.autocast(x.device.type, enabled=False):  # dtypes are explicit below
        for start in range(0, N, chunk_rows):
            stop = min(start + chunk_rows, N)
            n = stop - start
            x_c = x[start:stop].to(mm)  # (C, H)
            t_c, w_c = target[start:stop], token_weight[start:stop].to(acc)  # (C,)
            if buf_mm is None:
                logits = torch.mm(x_c, w_mm.T, out=buf[:n])  # (C, V)
            else:
                logits = buf[:n].copy_(torch.mm(x_c, w_mm.T, out=buf_mm[:n]))
            if w2_mm is not None:
                x2_c = x2[start:stop].to(mm)  # (C, r)
                logits += (x2_c @ w2_mm.T).to(acc)
            if max_rank or want_argmax:
                top = logits.topk(max_rank, dim=-1).indices if max_rank > 1 else logits.argmax(-1, keepdim=True)
                hits += ((top[:, :max_rank] == t_c[:, None]) & (w_c > 0)[:, None]).sum(0)
                if want_argmax:
                    argmax[start:stop] = top[:, 0]
            p = None
            if kl_weight:
                log_q = torch.log_softmax(logits, dim=-1)
                ce = -log_q.gather(-1, t_c[:, None]).squeeze(-1)  # (C,)
                log_p = torch.log_softmax(teacher_logits[start:stop].to(acc), dim=-1)  # (C, V)
                p = torch.exp(log_p, out=buf[:n])  # the logits are read: their buffer takes p
                # where p underflows to 0 (or the teacher masks a token with -inf) the term is 0, not nan
                kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)  # (C,)
                del log_p
                kl_sum += (w_c * kl).sum()
                total = ce_weight * ce + kl_weight * kl
                q = log_q.exp_()  # softmax, in log_q's memory
            else:  # CE alone: softmax in place in the buffer, its log-sum-exp from the same pass
                peak = logits.amax(-1, keepdim=True)
                picked = logits.gather(-1, t_c[:, None])
                q = logits.sub_(peak).exp_()  # (C, V) exp(logits - max): the softmax times `mass`
                mass = q.sum(-1, keepdim=True)
                ce = (mass.log() + peak - picked).squeeze(-1)  # (C,) log-sum-exp - the target's logit
                total = ce_weight * ce
            ce_sum += (w_c * ce).sum()
            loss += (w_c * total).sum()
            if grad_x is None and grad_w is None and grad_x2 is None and grad_w2 is None:
                continue
            # d/dlogits of ce_weight·CE + kl_weight·KL = (ce_weight + kl_weight)·q − ce_weight·onehot − kl_weight·p,
            # times w, in q's memory
            if p is None:
                g = q.mul_(w_c[:, None] * ce_weight / mass)  # (C, V): w·ce_weight·softmax
                g.scatter_add_(-1, t_c[:, None], (w_c * -ce_weight)[:, None])
            else:
                g = q.mul_(ce_weight + kl_weight)
                g.scatter_add_(-1, t_c[:, None], torch.full_like(ce[:, None], -ce_weight))
                g.sub_(p, alpha=kl_weight)
                del p
                g.mul_(w_c[:, None])
            if buf_mm is not None:
                g = buf_mm[:n].copy_(g)
            if grad_x is not None:
                grad_x[start:stop] = (g @ w_mm).to(x.dtype)  # (C, H)
            if grad_w is not None:
                if mm == acc:
                    grad_w.addmm_(g.T, x_c)  # (V, H), accumulated in place
                else:
                    grad_w += g.T @ x_c  # a bf16/fp16 product, added into the fp32 sum
            if grad_x2 is not None:
                grad_x2[start:stop] = (g @ w2_mm).to(x2.dtype)  # (C, r)
            if grad_w2 is not None:
                grad_w2 += (g.T @ x2_c).to(acc)  # (V, r)
    return loss, ce_sum, kl_sum, hits, grad_x, grad_w, argmax, grad_x2, grad_w2


class _LinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, token_weight, teacher_logits, ce_weight, kl_weight, max_rank, chunk_rows,
                want_argmax, x2, weight2):
        loss, ce, kl, hits, grad_x, grad_w, argmax, grad_x2, grad_w2 = _chunks(
            x, weight, target, token_weight, teacher_logits, ce_weight, kl_weight, max_rank, chunk_rows, grads=True,
            want_argmax=want_argmax, x2=x2, weight2=weight2)
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype) if grad_w is not None else None, grad_x2,
                              grad_w2.to(weight2.dtype) if grad_w2 is not None else None)
        ctx.mark_non_differentiable(ce, kl, hits, argmax)
        return loss, ce, kl, hits, argmax

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads = [g * grad_loss.to(g.dtype) if g is not None else None for g in ctx.saved_tensors]
        grad_x, grad_w, grad_x2, grad_w2 = grads
        return grad_x, grad_w, None, None, None, None, None, None, None, None, grad_x2, grad_w2


def linear_loss(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, token_weight: torch.Tensor,
                teacher_logits: torch.Tensor | None = None, ce_weight: float = 1.0, kl_weight: float = 0.0,
                max_rank: int = 1, chunk_rows: int | None = None, argmax: bool = False,
                extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> LinearLossOut:
    """Σ w·(ce_weight·CE + kl_weight·KL) of logits x @ weight^T, chunked (see the module doc).

    x (N, H); weight (V, H); target (N,) token ids (always needed: accuracy is counted against them);
    token_weight (N,); teacher_logits (N, V) (needed when kl_weight > 0; never gets a gradient). Rows may be views
    into larger tensors: nothing of size (N, V) is copied. argmax: also return every row's top prediction (a
    caller scoring against other targets than `target` needs no second pass over the logits). extra: (x2 (N, r),
    weight2 (V, r)), a second term added to the logits (module doc).
    """
    N, V = x.shape[0], weight.shape[0]
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_loss: x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected (N, H), (V, H)")
    if target.shape != (N,) or token_weight.shape != (N,):
        raise ValueError(f"linear_loss: target {tuple(target.shape)} and token_weight {tuple(token_weight.shape)}: "
                         f"expected ({N},)")
    if kl_weight and (teacher_logits is None or teacher_logits.shape != (N, V)):
        raise ValueError(f"linear_loss: kl_weight={kl_weight} needs teacher_logits of shape ({N}, {V})")
    x2, weight2 = extra if extra is not None else (None, None)
    if extra is not None and (x2.dim() != 2 or weight2.dim() != 2 or x2.shape[0] != N or weight2.shape[0] != V
                              or x2.shape[1] != weight2.shape[1]):
        raise ValueError(f"linear_loss: extra x2 {tuple(x2.shape)} and weight2 {tuple(weight2.shape)}: expected "
                         f"({N}, r), ({V}, r)")
    chunk_rows = chunk_rows or default_chunk_rows(V)
    teacher_logits = teacher_logits.detach() if teacher_logits is not None else None
    args = (x, weight, target, token_weight.detach(), teacher_logits, float(ce_weight), float(kl_weight),
            int(max_rank), int(chunk_rows))
    trains = [t.requires_grad for t in (x, weight, x2, weight2) if t is not None]
    if torch.is_grad_enabled() and any(trains):
        loss, ce, kl, hits, top = _LinearLoss.apply(*args, bool(argmax), x2, weight2)
    else:
        loss, ce, kl, hits, _, _, top, _, _ = _chunks(*args, grads=False, want_argmax=bool(argmax), x2=x2,
                                                      weight2=weight2)
    return LinearLossOut(loss=loss, ce=ce, kl=kl, hits=hits, argmax=top if argmax else None)
