"""Medusa heads: K extra next-next-token heads on the verifier's last hidden state, their losses, tree and export.

Head k (k = 0..K-1) reads the verifier's final post-norm hidden state h_t and predicts token t+k+2; the verifier's
own lm_head predicts t+1. A head is n ResBlocks (x + SiLU(W x + b), W and b zero-initialised, so a new head starts
as exactly the verifier's head) followed by its own Linear(H, V, bias=False) initialised from the verifier's lm_head.

Training (Medusa-1, verifier frozen):
    heads = MedusaHeads.from_verifier(verifier, num_heads=4, num_layers=1)
    feats = verifier.features(input_ids, attention_mask, return_logits=cfg.loss == "distill")
    head_logits = heads(feats.final)                                   # (K, B, T, V)
    loss, per_head = medusa_loss(head_logits, input_ids, loss_mask, cfg.loss, feats.logits, cfg.decay)
Medusa-2 (verifier fine-tuned jointly through LoRA):
    add_lora(verifier, r=..., alpha=..., dropout=..., target_modules=...)
    joint = MedusaJoint(verifier, heads)                               # one module: hand it to accelerator.prepare
    logits, head_logits = joint(input_ids, attention_mask)             # (B, T, V), (K, B, T, V), with grad
    reference = joint.reference_logits(input_ids, attention_mask)      # adapters disabled, no grad
    loss, parts = medusa2_loss(logits, reference, head_logits, input_ids, loss_mask, ...)
Held-out metrics stay on device: `head_accuracy` (top-1/top-5 per head) and `head_rank_hits` (how often the true
token is each head's rank-r prediction), whose ratio feeds `build_medusa_tree`.

Export (`save_medusa` / `load_medusa`): the folder vLLM's Medusa loader reads (checked against vLLM's
`transformers_utils/configs/medusa.py` and `model_executor/models/medusa.py`):
    config.json         architectures ["MedusaModel"], model_type "medusa", hidden_size, vocab_size, num_heads,
                        num_hidden_layers (ResBlocks per head), medusa_fc_bias, torch_dtype, and our `draftheads`
                        block (method, verifier describe() incl. fingerprint, tree, rank accuracies, training summary)
    model.safetensors   blocks.{h}.layers.{l}.weight (+ .bias), lm_heads.{h}.weight   (H x H and V x H)
    adapter/            Medusa-2 only: peft's adapter_config.json + adapter_model.safetensors
Notes from vLLM's source: its ResBlock linears default to bias=False when `medusa_fc_bias` is absent, so we always
write it; its lm_heads have no bias; `MedusaConfig.from_pretrained` renames any top-level key containing "num" and
"heads" to `num_heads` (and "num" + "layers" to `num_hidden_layers`), so config.json must hold no other such key
(ours are nested inside `draftheads`); it ignores unknown weight names and strips a `medusa_heads.` prefix; it
drafts only the top-1 chain (no tree), so the tree is for our engine.

Inference (the spec-decode engine):
    heads, meta = load_medusa(folder, verifier)                 # refuses a drafter trained for another verifier
    verifier = load_medusa_verifier(folder, verifier)           # Medusa-2: adds (merges) the adapter; else no-op
    logits = heads(h_last)                                      # h_last (B, H) -> (K, B, V); any (..., H) works
    tree = meta["tree"]                                         # list of rank paths, e.g. [(0,), (1,), (0, 0), ...]
`h_last` is the verifier's final post-norm hidden state at the last accepted token. A tree path (r_0, ..., r_d)
is the node whose token at depth i is head i's rank-r_i prediction; every prefix of a path is itself in the tree,
the root (the verifier's own next token) is not listed, and paths are sorted by (depth, ranks).
`meta["rank_accuracy"]` (K x R) lets the engine rebuild a tree for another node budget with `build_medusa_tree`.
"""

from __future__ import annotations

import heapq
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterFormatError,
    metadata_block,
    read_drafter,
    read_metadata,
    require_keys,
    write_drafter,
)
from models.linear_loss import linear_loss
from models.verifier import Verifier, VerifierError, check_drafter_matches

METHOD = "medusa"
ADAPTER_DIR = "adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- config ----------------------------------------------------------------------------------------------------

@dataclass
class MedusaConfig:
    """Medusa heads, their loss, Medusa-2 joint LoRA training, and the static tree (the `medusa:` config section)."""

    num_heads: int = 4
    """Heads K; head k predicts token t+k+2 (the verifier's own head predicts t+1)."""
    num_layers: int = 1
    """ResBlocks per head (vLLM's `num_hidden_layers`)."""
    bias: bool = True
    """ResBlock linears have a bias (vLLM's `medusa_fc_bias`)."""
    loss: Literal["labels", "distill"] = "labels"
    """`labels`: cross-entropy against the data token t+k+2; `distill`: KL to the verifier's own distribution there."""
    decay: float = 0.8
    """Head k's loss is weighted decay^k."""
    joint: bool = False
    """Medusa-2: train LoRA adapters on the verifier together with the heads."""
    lora_r: int = 16
    """LoRA rank (joint only)."""
    lora_alpha: int = 32
    """LoRA scaling numerator; the update is scaled by alpha / r (joint only)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input (joint only)."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Names of the verifier's linear layers that get adapters (joint only)."""
    head_lr_multiplier: float = 4.0
    """Heads learn at train.lr x this while the adapters learn at train.lr (joint only)."""
    lm_loss_weight: float = 1.0
    """Joint loss: weight of the verifier's own next-token cross-entropy."""
    kl_loss_weight: float = 1.0
    """Joint loss: weight of KL(original verifier || adapted verifier), which keeps the verifier faithful."""
    heads_loss_weight: float = 0.2
    """Joint loss: weight of the (decayed) Medusa head losses."""
    tree_budget: int = 64
    """Draft-token nodes in the exported static tree (the root, the verifier's own token, not counted)."""
    tree_max_rank: int = 10
    """Top-r ranks per head measured on held-out data and considered for the tree."""

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"medusa.num_heads={self.num_heads}: expected at least 1 head")
        if self.num_layers < 0:
            raise ValueError(f"medusa.num_layers={self.num_layers}: expected >= 0 ResBlocks per head")
        if not 0 < self.decay <= 1:
            raise ValueError(f"medusa.decay={self.decay}: expected a value in (0, 1]")
        if self.lora_r < 1:
            raise ValueError(f"medusa.lora_r={self.lora_r}: expected a positive rank")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"medusa.lora_dropout={self.lora_dropout}: expected a value in [0, 1)")
        if not self.lora_target_modules:
            raise ValueError("medusa.lora_target_modules is empty: name at least one linear layer, e.g. q_proj")
        for key in ("head_lr_multiplier", "lm_loss_weight", "kl_loss_weight", "heads_loss_weight"):
            if getattr(self, key) < 0:
                raise ValueError(f"medusa.{key}={getattr(self, key)}: expected >= 0")
        for key in ("tree_budget", "tree_max_rank"):
            if getattr(self, key) < 1:
                raise ValueError(f"medusa.{key}={getattr(self, key)}: expected a positive integer")


# ---- heads -----------------------------------------------------------------------------------------------------

def _uninitialised_linear(in_features: int, out_features: int, bias: bool, device=None, dtype=None) -> nn.Linear:
    # skip_init builds on the meta device, then allocates without running the default (kaiming) init
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, device=device or "cpu", dtype=dtype)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), n times; W and b start at zero so the block starts as the identity."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.layers = nn.ModuleList([
            _uninitialised_linear(hidden_size, hidden_size, bias, device, dtype) for _ in range(num_layers)
        ])
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads. `forward(hidden (..., H)) -> logits (K, ..., V)`; head k predicts token t+k+2.

    Module names are vLLM's checkpoint names: `blocks.{h}.layers.{l}` and `lm_heads.{h}`. A bare constructor gives
    zero ResBlocks and zero lm_heads; `from_verifier` copies the verifier's lm_head, `load_medusa` loads weights.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.bias = num_heads, num_layers, bias
        self.blocks = nn.ModuleList([
            ResBlock(hidden_size, num_layers, bias, device=device, dtype=dtype) for _ in range(num_heads)
        ])
        # skip_init: a V x H matrix per head is large (128k x 4k for Llama-3) and is overwritten right away
        self.lm_heads = nn.ModuleList([
            _uninitialised_linear(hidden_size, vocab_size, False, device, dtype) for _ in range(num_heads)
        ])
        for head in self.lm_heads:
            nn.init.zeros_(head.weight)

    @classmethod
    def from_verifier(cls, verifier: Verifier, num_heads: int = 4, num_layers: int = 1, bias: bool = True,
                      dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        """New heads on the verifier's device; each starts as the verifier's own head (ResBlocks = identity)."""
        heads = cls(verifier.hidden_size, verifier.vocab_size, num_heads, num_layers, bias,
                    device=verifier.device, dtype=dtype)
        with torch.no_grad():
            source = verifier.lm_head.weight  # (V, H); may be tied to the embedding: we copy, never share
            for head in heads.lm_heads:
                head.weight.copy_(source)
        return heads

    @classmethod
    def from_config(cls, cfg: MedusaConfig, verifier: Verifier, dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        return cls.from_verifier(verifier, cfg.num_heads, cfg.num_layers, cfg.bias, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_heads[0].weight.dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.dtype)  # the verifier may run in bf16 while the heads train in fp32
        # (K, ..., V); stacking costs one extra copy of the logits, small next to what the loss keeps for backward
        return torch.stack([lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads)])


# ---- losses (pure functions) -----------------------------------------------------------------------------------

def _shifted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, shift: int,
                     segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and validity for predicting token t+shift from position t, for t in [0, T-shift).

    The mask is read at the *target* token, so a prompt token (loss_mask 0) is never a target, whatever position
    predicts it. With `segment_ids` (packed documents), a target in another document than its source is excluded.
    """
    T = input_ids.shape[1]
    n = max(T - shift, 0)
    target = input_ids[:, T - n:]  # (B, n)
    valid = loss_mask[:, T - n:].bool()  # (B, n)
    if segment_ids is not None:
        valid = valid & (segment_ids[:, T - n:] == segment_ids[:, :n])
    return target, valid


def medusa_loss(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                mode: Literal["labels", "distill"] = "labels", verifier_logits: torch.Tensor | None = None,
                decay: float = 0.8, segment_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k decay^k · L_k, and the per-head losses L_k (K,) (detached, for logging).

    head_logits (K, B, T, V); input_ids, loss_mask (B, T); verifier_logits (B, T, V), needed for `distill`.
    Head k at position t is scored against token t+k+2:
      labels:  L_k = mean over valid t of CE(head_logits[k, :, t], input_ids[:, t+k+2])
      distill: L_k = mean over valid t of KL(softmax(verifier_logits[:, t+k+1]) || softmax(head_logits[k, :, t])),
               the verifier's own distribution of that same token t+k+2.
    Valid: t+k+2 < T and loss_mask[:, t+k+2] (the mask is read at the target token), and same segment if given.
    A head with no valid position contributes 0. The total is not normalised by Σ decay^k (head 0 has weight 1).
    """
    if mode not in ("labels", "distill"):
        raise ValueError(f"medusa loss mode {mode!r}: expected 'labels' or 'distill'")
    if mode == "distill" and verifier_logits is None:
        raise ValueError("medusa loss mode 'distill' needs verifier_logits (B, T, V)")
    K, T = head_logits.shape[0], head_logits.shape[2]
    per_head = []
    for k in range(K):
        target, valid = _shifted_targets(input_ids, loss_mask, k + 2, segment_ids)  # (B, n)
        n = target.shape[1]
        logits = head_logits[k, :, :n].float()  # (B, n, V)
        if mode == "labels":
            token_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        else:
            log_p = F.log_softmax(verifier_logits[:, k + 1:k + 1 + n].float(), dim=-1)  # (B, n, V)
            log_q = F.log_softmax(logits, dim=-1)
            token_loss = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).flatten()
        valid = valid.flatten()
        per_head.append((token_loss * valid).sum() / valid.sum().clamp(min=1))
    per_head = torch.stack(per_head)  # (K,)
    weights = decay ** torch.arange(K, device=per_head.device, dtype=per_head.dtype)
    return (weights * per_head).sum(), per_head.detach()


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The verifier's own CE: logits (B, T, V) at t against input_ids[:, t+1], masked at the target token."""
    target, valid = _shifted_targets(input_ids, loss_mask, 1, segment_ids)  # (B, T-1)
    token_loss = F.cross_entropy(logits[:, :target.shape[1]].float().flatten(0, 1), target.flatten(),
                                 reduction="none")
    valid = valid.flatten()
    return (token_loss * valid).sum() / valid.sum().clamp(min=1)


def faithfulness_kl(logits: torch.Tensor, reference_logits: torch.Tensor, input_ids: torch.Tensor,
                    loss_mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per position (B, T, V each), averaged where token t+1 is trained."""
    _, valid = _shifted_targets(input_ids, loss_mask, 1, segment_ids)  # (B, T-1)
    n = valid.shape[1]
    log_p = F.log_softmax(reference_logits[:, :n].float(), dim=-1)
    log_q = F.log_softmax(logits[:, :n].float(), dim=-1)
    token_kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).flatten()
    valid = valid.flatten()
    return (token_kl * valid).sum() / valid.sum().clamp(min=1)


def medusa2_loss(logits: torch.Tensor, reference_logits: torch.Tensor, head_logits: torch.Tensor,
                 input_ids: torch.Tensor, loss_mask: torch.Tensor, mode: Literal["labels", "distill"] = "labels",
                 decay: float = 0.8, lm_weight: float = 1.0, kl_weight: float = 1.0, heads_weight: float = 0.2,
                 segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Medusa-2: lm_weight·CE(verifier) + kl_weight·KL(original || adapted) + heads_weight·Σ_k decay^k L_k.

    logits (B, T, V) from the adapted verifier (with grad); reference_logits (B, T, V) from the same verifier with
    adapters disabled (no grad); head_logits (K, B, T, V). In `distill` mode the heads learn the *adapted*
    verifier's distribution (detached: the head loss must not pull the verifier towards the heads), since that is
    the model that verifies their drafts at inference. Returns (loss, parts) with detached parts for logging:
    `lm`, `kl`, `heads` (the weighted head sum) and `per_head` (K,).
    """
    lm = next_token_loss(logits, input_ids, loss_mask, segment_ids)
    kl = faithfulness_kl(logits, reference_logits, input_ids, loss_mask, segment_ids)
    heads, per_head = medusa_loss(head_logits, input_ids, loss_mask, mode,
                                  logits.detach() if mode == "distill" else None, decay, segment_ids)
    loss = lm_weight * lm + kl_weight * kl + heads_weight * heads
    return loss, {"lm": lm.detach(), "kl": kl.detach(), "heads": heads.detach(), "per_head": per_head}


# ---- the same losses for training: chunked, no (K, B, T, V) logits ----------------------------------------------
# `medusa_loss` / `medusa2_loss` above take materialised logits and are the readable reference (the tests compare
# against them). The trainer uses these, which give the same values and gradients through `linear_loss`: each head's
# logits exist only as (C, V) chunks, so peak memory does not grow with K·B·T·V (see models/linear_loss.py).

@dataclass
class HeadLosses:
    """Per-head results of `medusa_head_losses` (everything but `loss` is detached; sums add across batches)."""

    loss: torch.Tensor
    """() Σ_k decay^k · L_k, differentiable."""
    per_head: torch.Tensor
    """(K,) L_k: mean CE (labels) or KL (distill) of head k over its valid positions."""
    hits: torch.Tensor
    """(K, R) valid positions where token t+k+2 is head k's rank-r prediction."""
    counts: torch.Tensor
    """(K,) valid positions of head k."""


def target_weights(loss_mask: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (B, T), count ()) for predicting token t+shift from position t: w = valid / count, valid as in
    `_shifted_targets` (t+shift < T and loss_mask at the target), zero elsewhere, so Σ w·loss is the masked mean."""
    B, T = loss_mask.shape
    valid = torch.zeros(B, T, dtype=torch.float32, device=loss_mask.device)
    valid[:, :max(T - shift, 0)] = loss_mask[:, shift:].float()
    count = valid.sum()
    return valid / count.clamp(min=1), count


def medusa_head_losses(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                       mode: Literal["labels", "distill"] = "labels", verifier_logits: torch.Tensor | None = None,
                       decay: float = 0.8, max_rank: int = 1, chunk_rows: int | None = None) -> HeadLosses:
    """`medusa_loss(heads(hidden), ...)` without the (K, B, T, V) logits, plus rank hits for accuracy.

    hidden (B, T, H) the verifier's final post-norm state; input_ids, loss_mask (B, T); verifier_logits (B, T, V)
    for `distill`. Under `torch.no_grad()` it is the held-out evaluation (max_rank=R gives what the tree needs).
    Rows are flattened to N = B·T and head k's position i is paired with token i+k+2 and teacher row i+k+1 by
    offset views; pairs that would cross into the next sequence have weight 0, so nothing (N, V) is copied.
    """
    if mode not in ("labels", "distill"):
        raise ValueError(f"medusa loss mode {mode!r}: expected 'labels' or 'distill'")
    if mode == "distill" and verifier_logits is None:
        raise ValueError("medusa loss mode 'distill' needs verifier_logits (B, T, V)")
    B, T = input_ids.shape
    N, H, V = B * T, heads.hidden_size, heads.vocab_size
    hidden = hidden.to(heads.dtype)
    ids = input_ids.reshape(N)
    teacher_all = verifier_logits.reshape(N, V) if mode == "distill" else None
    losses, hits, counts = [], [], []
    for k, (block, lm_head) in enumerate(zip(heads.blocks, heads.lm_heads)):
        shift = k + 2
        n = max(N - shift, 0)
        w, count = target_weights(loss_mask, shift)  # (B, T)
        x = block(hidden).reshape(N, H)[:n]  # (n, H)
        teacher = teacher_all[shift - 1:shift - 1 + n] if teacher_all is not None else None  # (n, V) view
        out = linear_loss(x, lm_head.weight, ids[shift:], w.reshape(N)[:n], teacher,
                          ce_weight=float(mode == "labels"), kl_weight=float(mode == "distill"),
                          max_rank=max_rank, chunk_rows=chunk_rows)
        losses.append(out.loss)
        hits.append(out.hits)
        counts.append(count)
    per_head = torch.stack(losses)  # (K,)
    weights = decay ** torch.arange(len(losses), device=per_head.device, dtype=per_head.dtype)
    return HeadLosses(loss=(weights * per_head).sum(), per_head=per_head.detach(), hits=torch.stack(hits),
                      counts=torch.stack(counts))


def medusa2_losses(hidden: torch.Tensor, lm_head_weight: torch.Tensor, reference_logits: torch.Tensor,
                   heads: MedusaHeads, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   mode: Literal["labels", "distill"] = "labels", decay: float = 0.8, lm_weight: float = 1.0,
                   kl_weight: float = 1.0, heads_weight: float = 0.2, max_rank: int = 1,
                   chunk_rows: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], HeadLosses]:
    """`medusa2_loss` from the adapted verifier's hidden state (B, T, H) instead of its logits.

    lm_head_weight (V, H) is the verifier's output projection (frozen or not); reference_logits (B, T, V) come from
    the verifier with adapters disabled. Returns (loss, parts {lm, kl, heads} detached, the head results).
    In `distill` mode the heads learn the adapted verifier's distribution, computed here once without grad.
    """
    B, T = input_ids.shape
    N, V = B * T, lm_head_weight.shape[0]
    w, _ = target_weights(loss_mask, 1)  # (B, T)
    own = linear_loss(hidden.reshape(N, -1)[:N - 1], lm_head_weight, input_ids.reshape(N)[1:], w.reshape(N)[:N - 1],
                      reference_logits.reshape(N, V)[:N - 1], ce_weight=lm_weight, kl_weight=kl_weight,
                      chunk_rows=chunk_rows)
    adapted = None
    if mode == "distill":
        with torch.no_grad():
            adapted = hidden.detach() @ lm_head_weight.T  # (B, T, V)
    head = medusa_head_losses(heads, hidden, input_ids, loss_mask, mode, adapted, decay, max_rank, chunk_rows)
    loss = own.loss + heads_weight * head.loss
    return loss, {"lm": own.ce, "kl": own.kl, "heads": head.loss.detach()}, head


# ---- held-out metrics (on device, no host sync) ----------------------------------------------------------------

@torch.no_grad()
def head_rank_hits(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   max_rank: int = 10, segment_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits (K, R), counts (K,)): hits[k, r] = valid positions where token t+k+2 is head k's rank-r prediction.

    Sums, not means, so they add up across batches and processes; hits / counts[:, None] is the per-rank accuracy
    the tree is built from, and hits[:, :k].sum(-1) / counts is top-k accuracy. Validity as in `medusa_loss`.
    """
    K, V = head_logits.shape[0], head_logits.shape[-1]
    R = min(max_rank, V)
    hits, counts = [], []
    for k in range(K):
        target, valid = _shifted_targets(input_ids, loss_mask, k + 2, segment_ids)  # (B, n)
        top = head_logits[k, :, :target.shape[1]].topk(R, dim=-1).indices  # (B, n, R), best first
        match = (top == target[..., None]) & valid[..., None]  # (B, n, R)
        hits.append(match.sum((0, 1)))
        counts.append(valid.sum())
    return torch.stack(hits).float(), torch.stack(counts).float()


@torch.no_grad()
def head_accuracy(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  ks: Sequence[int] = (1, 5), segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(K, len(ks)) top-k accuracy of each head against token t+k+2 (0 where a head has no valid position)."""
    hits, counts = head_rank_hits(head_logits, input_ids, loss_mask, max(ks), segment_ids)
    return topk_from_hits(hits, counts, ks)


def topk_from_hits(hits: torch.Tensor, counts: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Top-k accuracies (K, len(ks)) from accumulated `head_rank_hits` sums."""
    cumulative = hits.cumsum(-1)  # (K, R): hits within the top r+1
    columns = [cumulative[:, min(k, hits.shape[1]) - 1] for k in ks]
    return torch.stack(columns, dim=-1) / counts.clamp(min=1)[:, None]


# ---- static tree -----------------------------------------------------------------------------------------------

def _as_rows(rank_acc) -> list[list[float]]:
    rows = rank_acc.detach().float().cpu().tolist() if isinstance(rank_acc, torch.Tensor) else \
        [list(map(float, row)) for row in rank_acc]
    if not rows or not rows[0]:
        raise ValueError("rank accuracies must be a non-empty (K, R) table")
    if any(len(row) != len(rows[0]) for row in rows):
        raise ValueError("rank accuracies must be a rectangular (K, R) table")
    if any(not (0.0 <= p <= 1.0) or math.isnan(p) for row in rows for p in row):
        raise ValueError("rank accuracies must be probabilities in [0, 1]")
    return rows


def path_probability(path: Sequence[int], rows: list[list[float]]) -> float:
    """P(every token on the path is right), assuming heads are independent: Π_i acc[i][path[i]]."""
    return math.prod(rows[depth][rank] for depth, rank in enumerate(path))


def expected_accepted_length(tree: Sequence[Sequence[int]], rank_acc) -> float:
    """Expected number of accepted draft tokens (without the bonus token; τ = 1 + this) for a static tree.

    Siblings are mutually exclusive (different ranks of one head are different tokens), so exactly one node per
    depth is accepted down to the accepted depth: E[length] = Σ_nodes P(node's whole path is right).
    """
    rows = _as_rows(rank_acc)
    return sum(path_probability(path, rows) for path in tree)


def build_medusa_tree(rank_acc, budget: int) -> list[tuple[int, ...]]:
    """The static tree of `budget` draft nodes maximising expected accepted length under head independence.

    rank_acc (K, R): rank_acc[k][r] = P(token t+k+2 is head k's rank-r prediction), from held-out data
    (`head_rank_hits` / counts). Returns paths sorted by (depth, ranks), each prefix-closed; fewer than `budget`
    paths only when the whole K-deep, R-wide tree is smaller.

    Why greedy is optimal: the objective is Σ over chosen nodes of w(node) = Π of its ranks' accuracies (see
    `expected_accepted_length`), and w(child) = w(parent) · acc <= w(parent). So the `budget` heaviest nodes
    (ties broken towards shallower nodes) already contain all their ancestors, and no prefix-closed set of that
    size weighs more. Growing the tree from the root by always taking the heaviest frontier node picks exactly those
    nodes: every node heavier than the one taken has an ancestor chain at least as heavy, taken earlier.
    """
    rows = _as_rows(rank_acc)
    if budget < 1:
        raise ValueError(f"tree budget {budget}: expected a positive number of nodes")
    K, R = len(rows), len(rows[0])
    # heap of (-weight, depth, path): the heaviest first, then shallower, then lexicographic (deterministic)
    frontier = [(-rows[0][r], 1, (r,)) for r in range(R)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg_weight, depth, path = heapq.heappop(frontier)
        chosen.append(path)
        if depth < K:
            for r in range(R):
                heapq.heappush(frontier, (neg_weight * rows[depth][r], depth + 1, path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def check_tree(tree, num_heads: int, where: str = "tree") -> list[tuple[int, ...]]:
    """A tree as a list of tuples, after checking depth <= num_heads, ranks >= 0, prefixes present, no repeats."""
    paths = [tuple(int(r) for r in path) for path in tree]
    seen = set(paths)
    if len(seen) != len(paths):
        raise ValueError(f"{where}: a path appears twice")
    for path in paths:
        if not 1 <= len(path) <= num_heads:
            raise ValueError(
                f"{where}: path {list(path)} has depth {len(path)}, expected 1..{num_heads} (one rank per head)")
        if min(path) < 0:
            raise ValueError(f"{where}: path {list(path)} has a negative rank")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"{where}: path {list(path)} is present but its prefix {list(path[:-1])} is not")
    return paths


# ---- Medusa-2: LoRA on the verifier ----------------------------------------------------------------------------

def lora_model(verifier: Verifier):
    """The peft model wrapping the verifier when it carries LoRA adapters, else None."""
    from peft import PeftModel

    return verifier.model if isinstance(verifier.model, PeftModel) else None


def add_lora(verifier: Verifier, r: int = 16, alpha: int = 32, dropout: float = 0.05,
             target_modules: Sequence[str] = DEFAULT_LORA_TARGETS):
    """Put trainable LoRA adapters on the verifier's linear layers, in place; returns the peft model.

    `verifier.model` becomes the peft wrapper (so `verifier.model.disable_adapter()` gives the original model and
    the adapter travels with the verifier); `verifier.decoder` and `features` now run through the adapters. Only the
    adapter weights require grad.
    """
    from peft import LoraConfig, get_peft_model

    if lora_model(verifier) is not None:
        raise VerifierError(f"verifier {verifier.name!r} already carries LoRA adapters")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(verifier.model, config)
    except ValueError as err:  # peft: target modules not found in the model
        raise VerifierError(
            f"medusa.lora_target_modules={list(target_modules)}: cannot put LoRA adapters on verifier "
            f"{verifier.name!r} ({err})") from None
    verifier.model = peft_model
    return peft_model


def add_lora_from_config(verifier: Verifier, cfg: MedusaConfig):
    return add_lora(verifier, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)


class MedusaJoint(nn.Module):
    """Medusa-2: the verifier (with LoRA adapters, see `add_lora`) and the heads as one trainable module."""

    def __init__(self, verifier: Verifier, heads: MedusaHeads):
        super().__init__()
        if lora_model(verifier) is None:
            raise VerifierError(f"verifier {verifier.name!r} has no LoRA adapters; call add_lora(verifier, ...) first")
        self.verifier, self.heads = verifier, heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, T, V), head_logits (K, B, T, V)), both with grad through the adapters."""
        out = self.verifier.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False)
        hidden = out.last_hidden_state  # (B, T, H), post-norm
        return self.verifier.lm_head(hidden), self.heads(hidden)

    @torch.no_grad()
    def reference_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, V) logits of the original verifier: the same weights with the adapters switched off."""
        with lora_model(self.verifier).disable_adapter():
            return self.verifier.features(input_ids, attention_mask, return_logits=True,
                                          position_ids=position_ids).logits

    def param_groups(self, lr: float, head_lr_multiplier: float = 4.0, weight_decay: float = 0.0) -> list[dict]:
        """Optimizer groups: the adapters at `lr`, the heads at `lr x head_lr_multiplier`."""
        adapters = [p for p in self.verifier.parameters() if p.requires_grad]
        return [{"params": adapters, "lr": lr, "weight_decay": weight_decay, "name": "lora"},
                {"params": list(self.heads.parameters()), "lr": lr * head_lr_multiplier,
                 "weight_decay": weight_decay, "name": "heads"}]


def _adapter_files(peft_model) -> dict[str, bytes]:
    """peft's own adapter format (adapter_config.json + adapter_model.safetensors) as bytes for `write_drafter`."""
    with tempfile.TemporaryDirectory(prefix="medusa-adapter-") as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        return {f"{ADAPTER_DIR}/{name}": (Path(tmp) / name).read_bytes() for name in ADAPTER_FILES}


# ---- export ----------------------------------------------------------------------------------------------------

REQUIRED_CONFIG_FIELDS = ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads",
                          "num_hidden_layers", "medusa_fc_bias")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_medusa(folder: str | os.PathLike, heads: MedusaHeads, verifier: Verifier,
                tree: Sequence[Sequence[int]] | None = None, training_summary: dict | None = None,
                rank_accuracy=None) -> Path:
    """Export heads (and, when the verifier carries LoRA adapters, the adapter) as a vLLM-loadable drafter folder.

    tree: the static tree (`build_medusa_tree`); rank_accuracy (K, R): what it was built from, kept so the
    engine can rebuild a tree for another budget; training_summary: any JSON-able dict (steps, losses, accuracy).
    Written atomically through `write_drafter`. Returns the folder.
    """
    if (heads.hidden_size, heads.vocab_size) != (verifier.hidden_size, verifier.vocab_size):
        raise VerifierError(
            f"heads are for hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size}, but verifier "
            f"{verifier.name!r} has hidden_size={verifier.hidden_size}, vocab_size={verifier.vocab_size}")
    paths = check_tree(tree, heads.num_heads) if tree is not None else None
    if rank_accuracy is not None:
        rank_accuracy = _as_rows(rank_accuracy)
    adapter = lora_model(verifier)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": heads.bias,
        "torch_dtype": _dtype_name(heads.dtype),
        "draftheads": metadata_block(
            METHOD, verifier,
            num_heads=heads.num_heads, num_layers=heads.num_layers, bias=heads.bias,
            adapter=ADAPTER_DIR if adapter is not None else None,
            tree=[list(p) for p in paths] if paths is not None else None,
            rank_accuracy=rank_accuracy,
            training=training_summary or {},
        ),
    }
    extra = _adapter_files(adapter) if adapter is not None else None
    return write_drafter(folder, config, heads.state_dict(), extra)


def load_medusa(folder: str | os.PathLike, verifier: Verifier | None = None,
                device: str | torch.device | None = None) -> tuple[MedusaHeads, dict]:
    """Read a drafter folder back: (heads, the `draftheads` metadata with `tree` as a list of tuples or None).

    Weights come back bit-exactly in their stored dtype (on `device`, else the verifier's, else CPU). With a
    verifier, a drafter trained for another one (fingerprint, hidden size, layers, vocab) is refused by name.
    """
    folder = Path(folder)
    config, tensors = read_drafter(folder, expect_method=METHOD)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for key in REQUIRED_CONFIG_FIELDS:
        if key not in config:
            raise DrafterFormatError(f"{config_path}: missing field {key!r} (vLLM's Medusa loader needs it)")
    if "MedusaModel" not in config["architectures"] or config["model_type"] != "medusa":
        raise DrafterFormatError(f"{config_path}: architectures={config['architectures']}, model_type="
                                 f"{config['model_type']!r}; expected ['MedusaModel'] and 'medusa'")
    meta = read_metadata(config, config_path)
    if verifier is not None:
        check_drafter_matches(meta.get("verifier", {}), verifier, folder)
        for key in ("hidden_size", "vocab_size"):
            if config[key] != getattr(verifier, key):
                raise VerifierError(f"drafter {str(folder)!r} has {key}={config[key]}, but verifier "
                                    f"{verifier.name!r} has {key}={getattr(verifier, key)}")
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    heads = MedusaHeads(config["hidden_size"], config["vocab_size"], config["num_heads"],
                        config["num_hidden_layers"], bool(config["medusa_fc_bias"]), dtype=dtype)
    require_keys(tensors, {k: tuple(v.shape) for k, v in heads.state_dict().items()}, str(weights_path))
    heads.load_state_dict(tensors, strict=True)
    target = device if device is not None else (verifier.device if verifier is not None else None)
    if target is not None:
        heads = heads.to(target)
    meta = dict(meta)
    try:
        meta["tree"] = check_tree(meta["tree"], heads.num_heads) if meta.get("tree") is not None else None
    except (ValueError, TypeError) as err:
        raise DrafterFormatError(f"{config_path}: bad `draftheads.tree`: {err}") from None
    return heads, meta


def load_medusa_verifier(folder: str | os.PathLike, verifier: Verifier, merge: bool = True) -> Verifier:
    """The verifier a Medusa drafter was trained with: for Medusa-2, `verifier` plus the stored LoRA adapter.

    Modifies `verifier` in place and returns it: with merge=True the adapter is folded into the linear weights
    (plain forward speed); with merge=False `verifier.model` becomes the peft model. The fingerprint stays the base
    verifier's, the one the drafter records. A Medusa-1 drafter (no adapter) returns `verifier` unchanged.
    """
    from peft import PeftModel

    folder = Path(folder)
    config, _ = read_drafter(folder, expect_method=METHOD)
    meta = read_metadata(config, folder / CONFIG_NAME)
    check_drafter_matches(meta.get("verifier", {}), verifier, folder)
    if not meta.get("adapter"):
        return verifier
    if lora_model(verifier) is not None:
        raise VerifierError(f"verifier {verifier.name!r} already carries LoRA adapters; pass the base verifier")
    adapter_dir = folder / meta["adapter"]
    for name in ADAPTER_FILES:
        if not (adapter_dir / name).is_file():
            raise DrafterFormatError(f"drafter {str(folder)!r} is Medusa-2 but has no {meta['adapter']}/{name}")
    try:
        peft_model = PeftModel.from_pretrained(verifier.model, str(adapter_dir), is_trainable=False)
    except Exception as err:  # wrong shapes or module names: say which folder
        raise DrafterFormatError(f"{adapter_dir}: cannot load the LoRA adapter onto verifier {verifier.name!r} "
                                 f"({type(err).__name__}: {err})") from None
    verifier.model = peft_model.merge_and_unload() if merge else peft_model
    verifier.model.eval().requires_grad_(False)
    verifier.name = f"{verifier.name}+{meta['adapter']}"
    return verifier
