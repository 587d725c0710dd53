"""EAGLE's training losses (pure): EAGLE-1's feature + token loss, EAGLE-3's draft-vocabulary targets and its
per-step token loss with the draft head's backward done in the forward, chunked over the positions read (`HeadLoss`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftheads.models.draft_losses import masked_mean, soft_cross_entropy, soft_cross_entropy_grad, token_loss
from draftheads.models.linear_loss import matmul_dtype


# ---- losses and metrics (pure) -----------------------------------------------------------------------------------
def add_uniform_noise(x: torch.Tensor, width: float) -> torch.Tensor:
    """x + U(-width/2, width/2), elementwise."""
    return x + (torch.rand_like(x) - 0.5) * width


def eagle1_loss(pred: torch.Tensor, target: torch.Tensor, pred_logits: torch.Tensor, target_logits: torch.Tensor,
                mask: torch.Tensor, feature_weight: float = 1.0, token_weight: float = 0.1,
                token_kind: str = "forward_kl", lk_eta: float = 3.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 loss: (total, feature SmoothL1, token loss), each a mean over masked positions; the token loss is
    `token_kind` (models/draft_losses.py; forward_kl: the soft cross-entropy of the EAGLE repo).

    pred, target (B, T, H); pred_logits, target_logits (B, T, V); mask (B, T).
    """
    feature = masked_mean(F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1), mask)
    per_position, _ = token_loss(token_kind, pred_logits, torch.log_softmax(target_logits.float(), dim=-1),
                                 lk_eta)
    token = masked_mean(per_position, mask)
    return feature_weight * feature + token_weight * token, feature, token


def draft_targets(target_logits: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's distribution renormalised over the draft vocabulary, its argmax and whether that is drafted.

    target_logits (B, T, V) -> log-probs (B, T, Vd) (log-softmax over the draft columns), target_ids (B, T) (argmax
    over the whole vocabulary), in_draft (B, T) bool.
    """
    target_ids = target_logits.max(-1).indices  # argmax (the first maximum), about 2x faster on a CPU
    columns = torch.arange(d2t.numel(), device=d2t.device) + d2t  # (Vd,) target id of each draft id
    # gather, not index_select: on a CPU index_select along the last dim is ~8x slower (a strided copy per column)
    drafted = torch.gather(target_logits, -1, columns.expand(*target_logits.shape[:-1], -1))  # (B, T, Vd)
    logp = torch.log_softmax(drafted.float(), dim=-1)
    return logp, target_ids, t2d[target_ids]


#: Bytes of the verifier's (B, c, V) logits that `chunked_draft_targets` computes at a time: 1 GiB, 4,096 positions
#: of Llama-3's 128k vocabulary in bf16, where the whole row's would be 8 GiB at 32k tokens. Not smaller: on a CPU the
#: bf16 lm_head product ran 2-5x slower per position in 512-position chunks than over 1,024 at once (oneDNN's choice
#: of kernel for the shorter product, measured inside the training step at Llama-3.1-8B's shapes).
TARGET_CHUNK_BYTES = 1 << 30


def target_chunk(B: int, T: int, V: int, itemsize: int) -> int:
    """Positions per chunk of a (B, T, V) target computation: equal chunks of at most TARGET_CHUNK_BYTES of
    `itemsize`-byte logits, so that every product has the same shape."""
    parts = -(-T * B * V * itemsize // TARGET_CHUNK_BYTES)
    return -(-T // max(1, parts))


def chunked_draft_targets(logits_at: Callable[[int, int], torch.Tensor], B: int, T: int, V: int, d2t: torch.Tensor,
                          t2d: torch.Tensor, itemsize: int = 2, chunk: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draft_targets` of a row whose (B, T, V) logits are never whole: `logits_at(s, e)` gives positions s..e-1's
    (B, e - s, V), `chunk` positions at a time (default: equal chunks of at most TARGET_CHUNK_BYTES of `itemsize`-byte
    logits), each chunk's results written into the (B, T, Vd) / (B, T) outputs. Equal to `draft_targets` of the
    whole, position by position (every operation is per position)."""
    if chunk is None:
        chunk = target_chunk(B, T, V, itemsize)
    logp = ids = in_draft = None
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        part_logp, part_ids, part_in = draft_targets(logits_at(s, e), d2t, t2d)
        if logp is None:
            logp = part_logp.new_empty(B, T, part_logp.shape[-1])
            ids, in_draft = part_ids.new_empty(B, T), part_in.new_empty(B, T)
        logp[:, s:e], ids[:, s:e], in_draft[:, s:e] = part_logp, part_ids, part_in
        del part_logp
    return logp, ids, in_draft


def row_draft_targets(final: torch.Tensor, rows: torch.Tensor, target_ids: torch.Tensor, t2d: torch.Tensor,
                      chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draft_targets` from the draft vocabulary's lm_head rows `rows` (Vd, H) and the verifier's argmax over the
    whole vocabulary `target_ids` (B, T) (a feature cache stores it): the draft columns' logits are final @ rows^T,
    the numbers the whole head gives at those columns, `chunk` positions at a time (default: equal chunks of at
    most TARGET_CHUNK_BYTES of logits). final (B, T, H)."""
    B, T, _ = final.shape
    Vd = rows.shape[0]
    if chunk is None:
        chunk = target_chunk(B, T, Vd, matmul_dtype(final, rows).itemsize)
    logp = None
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        part = torch.log_softmax(F.linear(final[:, s:e], rows).float(), dim=-1)  # (B, c, Vd)
        if logp is None:
            logp = part.new_empty(B, T, Vd)
        logp[:, s:e] = part
        del part
    ids = target_ids.to(torch.long)
    return logp, ids, t2d[ids]


#: Bytes of one (B, C, Vd) fp32 buffer of `HeadLoss`: a chunk of C positions at a time (a few such buffers are alive
#: while a chunk runs). 128 MiB: 1,024 positions of a 32k draft vocabulary, 261 of a 128k one; small vocabularies
#: take every position in one chunk.
CHUNK_BYTES = 1 << 27
#: Vocabulary rows of the lm_head gradient added at a time: the product g^T x of a block, (4096, H) in the matmul
#: dtype, is the only temporary; a whole (Vd, H) one would be 0.25-0.5 GiB at Llama-3's shapes.
GRAD_BLOCK_ROWS = 4096


@dataclass
class StepResult:
    """What `HeadLoss.step` returns for one TTT step, over the R positions it was given; all detached."""

    loss: torch.Tensor
    """() the step's loss: sum of the token weights times the per-position loss (a masked mean for weights
    trained / count)."""
    alpha: torch.Tensor | None
    """() acceptance alpha weighted the same way; None on the fused forward_kl path, which does not compute it."""
    argmax: torch.Tensor
    """(B, R) the drafter's top draft id."""
    top: torch.Tensor | None
    """(B, R, topk) its top `topk` draft ids (topk > 1), else None."""


class HeadLoss:
    """EAGLE-3's draft head (final norm, lm_head) and token loss over the TTT steps, with the head's backward done in
    the forward: no (B, n, Vd) tensor of any step is kept, and nothing of the head runs twice.

        head = HeadLoss(drafter.norm, drafter.lm_head.weight, "forward_kl")
        for k, rows in ...: head.step(hidden_rows, target, weights, step_weight=w_k, ...)
        loss = head.loss()   # sum_k w_k * loss_k, differentiable w.r.t. every hidden_rows and the head's weights

    Each step runs `chunk_rows` positions at a time: the chunk's logits, its loss and right away the loss's gradient
    with respect to the logits; from it the lm_head's gradient (accumulated over chunks and steps, scaled by the
    step weight), the gradient of the final norm's weight and of the chunk's hidden input. Only the last of these,
    (B, R, H) per step, is kept until backward; the head's weight gradients are one buffer for all steps (the
    lm_head's in the matmul dtype, each step's product added inside the GEMM, as autograd sums the steps' gradients
    of autocast's one cast of the weight; float32 from backward on). forward_kl's loss and gradient are one
    in-place pass over the chunk's float32 logits (`soft_cross_entropy_grad`). Against
    recomputing the head in backward (activation checkpointing) this saves one (R, H) x (H, Vd) matmul a chunk;
    against plain autograd, the (B, n, Vd) softmax of every step. A frozen lm_head gets no (Vd, H) product at all.
    The callers pass only the positions that are read (scored, or needed by a later step): a prompt's positions
    never reach the head.

    backward multiplies the stored gradients by the upstream one and hands them over: a second backward through
    the same loss (retain_graph) is refused, naming why. The arithmetic is plain autograd's, op for op (under
    autocast too: the head's matmuls in the autocast dtype, the softmaxes in fp32), so the results equal the
    straightforward computation within float rounding (tests/unit/test_eagle_step_loss.py).
    """

    def __init__(self, norm: nn.Module | None, weight: torch.Tensor, kind: str = "forward_kl", lk_eta: float = 3.0,
                 chunk_rows: int | None = None, logits_of: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.norm, self.weight, self.kind, self.lk_eta = norm, weight, kind, lk_eta
        self.chunk_rows = chunk_rows
        # a weight DeepSpeed ZeRO-3 partitioned (`ds_id`) is whole only inside its module's forward, and its gradient
        # must come through that module: there the head runs as modules (`logits_of`, the norm and lm_head), each
        # chunk recomputed in backward (activation checkpointing), not with its backward in the forward
        self.partitioned = hasattr(weight, "ds_id")
        if self.partitioned and logits_of is None:
            raise ValueError("HeadLoss: a ZeRO-3 partitioned lm_head needs logits_of, the head as modules")
        self.logits_of = logits_of
        self.plain = None  # the partitioned path's sum_k w_k loss_k, differentiable
        self.params = [p for p in ([weight] + (list(norm.parameters()) if norm is not None else []))
                       if p.requires_grad]
        self.norm_params = [p for p in self.params if p is not weight]  # the final norm's trained weight
        self.grads = {}  # id(param) -> fp32 gradient of sum_k w_k loss_k, accumulated
        # the weight's, in blocks of GRAD_BLOCK_ROWS vocabulary rows in the matmul dtype: each step's product adds
        # into its block inside the GEMM (as autograd sums the steps' gradients of autocast's cached cast: in bf16
        # under bf16 autocast), no fp32 copy of a product; one float32 gradient made at backward, block by block
        self.weight_blocks: list[torch.Tensor] = []
        self.inputs, self.input_grads = [], []  # the steps' hidden rows and their gradients
        self.total = None
        self.spent = False
        self._cast = None  # (dtype, the weight in it): one cast for every step of the batch
        self._buffers = {}  # `_scratch`'s

    def step(self, hidden: torch.Tensor, target: torch.Tensor, token_weight: torch.Tensor,
             target_mass: torch.Tensor | None = None, rows: torch.Tensor | None = None, step_weight: float = 1.0,
             topk: int = 1) -> StepResult:
        """One step's loss over R positions: hidden (B, R, H) (the drafter's outputs there); target (B, n, Vd), the
        verifier's probabilities p when `target_mass` ((B, n), sum of p) is given (forward_kl's fused soft
        cross-entropy), else its log-probabilities (`token_loss(kind, ...)`); rows (R,) sorted, which of target's n
        positions hidden's R are (None: the first R); token_weight (B, R), 0 where a position is not trained;
        step_weight: the step's weight in `loss()`."""
        B, R = hidden.shape[:2]
        if token_weight.shape != (B, R) or (rows is not None and rows.shape != (R,)):
            raise ValueError(f"HeadLoss.step: hidden {tuple(hidden.shape)}, token_weight "
                             f"{tuple(token_weight.shape)}, rows {None if rows is None else tuple(rows.shape)}: "
                             f"expected (B, R, H), (B, R), (R,)")
        if self.spent:
            raise RuntimeError("HeadLoss.step after backward: build a new HeadLoss for a new batch")
        fused = target_mass is not None
        if self.partitioned:
            return self._module_step(hidden, target, token_weight, target_mass, rows, step_weight, topk)
        grads = torch.is_grad_enabled() and (hidden.requires_grad or bool(self.params))
        chunk = self._chunk(target, B)
        mm = matmul_dtype(hidden, self.weight)
        if self._cast is None or self._cast[0] != mm:
            self._cast = (mm, self.weight.detach().to(mm))
        w_mm = self._cast[1]
        grad_h = torch.empty_like(hidden, dtype=hidden.dtype) if grads and hidden.requires_grad else None
        loss = hidden.new_zeros((), dtype=torch.float32)
        alpha_sum = None if fused else loss.clone()
        argmax = torch.empty(B, R, dtype=torch.long, device=hidden.device)
        top = torch.empty(B, R, min(topk, self.weight.shape[0]), dtype=torch.long, device=hidden.device) \
            if topk > 1 else None
        # the targets at the rows: a slice where they are consecutive (no copy of a (B, R, Vd) block), else gathered
        start = 0 if rows is None else _run_start(rows)
        for a in range(0, R, chunk):
            b = min(a + chunk, R)
            pick = slice(start + a, start + b) if start is not None else rows[a:b]
            tgt = target[:, pick]
            mass = target_mass[:, pick] if fused else None
            w_c = token_weight[:, a:b].float()
            # the chunk's own graph lives only inside this call: outer saved-tensor hooks (offloading, measuring what
            # backward keeps) are not for it
            with torch.enable_grad() if grads else torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(
                    _as_is, _as_is):
                h = hidden[:, a:b].detach().requires_grad_(grads and hidden.requires_grad)
                # the norm's own forward, not the module call: global module hooks (FlopCounterMode's tracker) would
                # hang backward hooks on this chunk's leaf, which the local autograd.grad below cannot run
                normed = self.norm.forward(h) if self.norm is not None else h  # (B, C, H)
                with torch.no_grad():  # (B, C, Vd), as autocast's linear; into a buffer reused over the chunks
                    x_mm = normed.detach().to(mm)
                    logits = torch.mm(x_mm.flatten(0, 1), w_mm.T, out=self._scratch(
                        "logits", (B * (b - a), w_mm.shape[0]), mm)).view(B, b - a, -1)
                if fused and grads:  # the loss and its gradient in one pass, without a graph (the step weight in it)
                    with torch.no_grad():
                        exact = torch.promote_types(logits.dtype, torch.float32)
                        per_position, g = soft_cross_entropy_grad(logits, tgt, mass, w_c * step_weight,
                                                                  out=self._scratch("exact", logits.shape, exact))
                        if g.dtype != mm:
                            g = self._scratch("grad", g.shape, mm).copy_(g)
                    piece, alpha = (w_c * per_position).sum(), None
                else:
                    lg = logits.requires_grad_(grads)
                    if fused:
                        per_position, alpha = soft_cross_entropy(lg, tgt, mass), None
                    else:
                        per_position, alpha = token_loss(self.kind, lg, tgt, self.lk_eta)
                    piece = (w_c * per_position).sum()
                    g = torch.autograd.grad(piece, lg)[0].to(mm).mul_(step_weight) if grads else None  # (B, C, Vd)
                    del lg
            loss += piece.detach()
            if alpha is not None:
                alpha_sum += (w_c * alpha).sum()
            with torch.no_grad():
                argmax[:, a:b] = logits.max(-1).indices  # the first maximum, about 2x faster than argmax on a CPU
                if top is not None:
                    top[:, a:b] = logits.topk(top.shape[-1], dim=-1).indices
            del logits, per_position, alpha
            if g is None:
                continue
            flat_g = g.flatten(0, 1)  # (B*C, Vd)
            if self.weight.requires_grad:  # (Vd, H), a block of vocabulary rows at a time, summed in the GEMM
                x_mm = x_mm.flatten(0, 1)  # (B*C, H)
                for i, r in enumerate(range(0, self.weight.shape[0], GRAD_BLOCK_ROWS)):
                    block = flat_g[:, r:r + GRAD_BLOCK_ROWS].T  # (rows, B*C)
                    if i < len(self.weight_blocks):
                        self.weight_blocks[i].addmm_(block, x_mm)
                    else:
                        self.weight_blocks.append(block @ x_mm)
            d_normed = g @ w_mm  # (B, C, H)
            del g, flat_g
            if self.norm is None:
                if h.requires_grad:
                    grad_h[:, a:b] = d_normed
                continue
            wanted = ([h] if h.requires_grad else []) + self.norm_params
            if wanted:
                got = list(torch.autograd.grad(normed, wanted, d_normed.to(normed.dtype)))
                if h.requires_grad:
                    grad_h[:, a:b] = got.pop(0)
                for p, d in zip(self.norm_params, got):
                    self._add(p, d)
        if grad_h is not None:
            self.inputs.append(hidden)
            self.input_grads.append(grad_h)  # of w_k * loss_k: g carried the step weight
        total = loss * step_weight
        self.total = total if self.total is None else self.total + total
        return StepResult(loss, alpha_sum, argmax, top)

    def _module_step(self, hidden, target, token_weight, target_mass, rows, step_weight, topk) -> StepResult:
        """`step` through the head's modules, for parameters only their module call makes whole (ZeRO-3)."""
        B, R = hidden.shape[:2]
        chunk = self._chunk(target, B)
        fused = target_mass is not None

        def piece(h, tgt, mass, w):
            logits = self.logits_of(h)  # (B, C, Vd)
            if fused:
                per_position, alpha = soft_cross_entropy(logits, tgt, mass), None
            else:
                per_position, alpha = token_loss(self.kind, logits, tgt, self.lk_eta)
            with torch.no_grad():
                argmax = logits.max(-1).indices
                top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices if topk > 1 else None
            return (w * per_position).sum(), None if alpha is None else (w * alpha).sum(), argmax, top

        keep = torch.is_grad_enabled() and hidden.requires_grad
        parts = []
        for a in range(0, R, chunk):
            pick = slice(a, min(a + chunk, R)) if rows is None else rows[a:a + chunk]
            args = (hidden[:, a:a + chunk], target[:, pick], target_mass[:, pick] if fused else None,
                    token_weight[:, a:a + chunk].float())
            parts.append(checkpoint(piece, *args, use_reentrant=False) if keep else piece(*args))
        loss = sum(p[0] for p in parts)
        alpha = None if fused else sum(p[1] for p in parts)
        argmax = torch.cat([p[2] for p in parts], 1)
        top = torch.cat([p[3] for p in parts], 1) if topk > 1 else None
        self.plain = loss * step_weight if self.plain is None else self.plain + loss * step_weight
        self.total = self.plain.detach()
        return StepResult(loss.detach(), alpha, argmax, top)

    def _chunk(self, target: torch.Tensor, B: int) -> int:
        """Positions a chunk: `chunk_rows`, else as many as keep one (B, C, Vd) fp32 buffer to CHUNK_BYTES."""
        return self.chunk_rows or max(1, CHUNK_BYTES // (4 * target.shape[-1] * max(B, 1)))

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` for the chunks' (B, C, Vd)-sized temporaries, one per name for the whole batch: the
        chunks and steps reuse it (freed in `loss()`)."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=self.weight.device)
        return buffer[:numel].view(shape)

    def _acc(self, param: torch.Tensor) -> torch.Tensor:
        """The gradient sum of `param`, zeros at first: fp32 (fp64 for an fp64 parameter)."""
        acc = self.grads.get(id(param))
        if acc is None:
            acc = self.grads[id(param)] = torch.zeros_like(param, dtype=torch.promote_types(param.dtype,
                                                                                              torch.float32))
        return acc

    def _add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._acc(param).add_(grad)

    def loss(self) -> torch.Tensor:
        """() sum_k w_k * loss_k over the steps run, differentiable (once) w.r.t. each step's hidden rows and the
        head's trained weights."""
        if self.plain is not None:
            return self.plain
        total = self.total if self.total is not None else self.weight.new_zeros((), dtype=torch.float32)
        self._cast, self._buffers = None, {}
        if not (self.inputs or self.grads or self.weight_blocks):
            return total
        return _HeadGradients.apply(self, total, *self.inputs, *self.params)


def _run_start(rows: torch.Tensor) -> int | None:
    """rows (R,) sorted distinct: rows[0] when they are consecutive (rows[0] .. rows[0] + R - 1), else None."""
    if rows.numel() == 0:
        return 0
    first, last = rows[[0, -1]].tolist()
    return first if last - first == rows.numel() - 1 else None


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class _HeadGradients(torch.autograd.Function):
    """The loss `HeadLoss` computed, with the gradients it computed already: backward scales them by the upstream
    gradient and hands them over (in place, so once)."""

    @staticmethod
    def forward(ctx, head, total, *tensors):
        ctx.head = head
        return total.detach().clone()

    @staticmethod
    def backward(ctx, upstream):
        head = ctx.head
        if head.spent:
            raise RuntimeError("HeadLoss: a second backward through the EAGLE-3 head loss; its gradients were "
                               "computed in the forward and handed over in the first backward (retain_graph is not "
                               "supported): compute the loss again")
        head.spent = True
        scale = upstream.float()
        inputs = [g.mul_(scale.to(g.dtype)) for g in head.input_grads]
        params = []
        for p in head.params:
            acc = head.grads.pop(id(p), None) if p is not head.weight else _gathered(head.weight_blocks, p)
            params.append(None if acc is None else acc.mul_(scale).to(p.dtype))
        head.input_grads, head.inputs = [], []
        return (None, None, *inputs, *params)


def _gathered(blocks: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor | None:
    """The weight's gradient from its row blocks, float32 (float64 for a float64 weight), each block freed once
    copied (so the float32 gradient and the blocks are not all alive at once, on the CPU); None without blocks."""
    if not blocks:
        return None
    grad = torch.empty_like(param, dtype=torch.promote_types(param.dtype, torch.float32))
    r = 0
    while blocks:
        block = blocks.pop(0)
        grad[r:r + block.shape[0]].copy_(block)
        r += block.shape[0]
        del block
    return grad
