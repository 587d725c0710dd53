"""Medusa heads: K extra next-next-token heads on the verifier's last hidden state, their losses and static tree.

Head k (k = 0..K-1) reads the verifier's final post-norm hidden state h_t and predicts token t+k+2; the verifier's
own lm_head predicts t+1. A head is n ResBlocks (x + SiLU(W x + b), W and b zero-initialised, so a new head starts
as exactly the verifier's head) followed by its own Linear(H, V, bias=False) initialised from the verifier's lm_head,
or, with `shared_lm_head` (vLLM's `original_lm_head`), by the verifier's lm_head itself, frozen and shared by every
head: then only the ResBlocks train (K·n·H² weights instead of K·V·H more: 67M instead of 2.2B at Llama-3-8B's
shapes).

Losses. Head k at position t is scored against token t+k+2, where t+k+2 < T, loss_mask[t+k+2] = 1 (the mask is
read at the *target* token, so a prompt token is never a target, whatever position predicts it) and, in packed rows,
token t+k+2 is in t's document (position_ids[t+k+2] == position_ids[t] + k+2: data/documents.py):
    labels:  L_k = mean over valid t of CE(head_k(h_t), x_{t+k+2})
    distill: L_k = mean over valid t of KL(softmax(q_{t+k+1}) || softmax(head_k(h_t))), the verifier's own
             distribution of that same token
    loss = sum_k decay^k L_k   (not normalised by sum_k decay^k; a head with no valid position contributes 0)
Medusa-2 (the verifier fine-tuned jointly through LoRA) adds lm_weight * CE of the adapted verifier and
kl_weight * KL(original || adapted) per position where token t+1 is trained (and in t's document), with the heads
at heads_weight; in `distill` mode the heads learn the *adapted* verifier's distribution (detached).
`medusa_head_losses` and `medusa2_losses` compute these through models/linear_loss.py, so each head's logits exist only as (C, V) chunks and
no (K, B, T, V) tensor is ever built; they also return rank hits (how often the true token is head k's rank-r
prediction), whose ratio to the counts feeds `build_medusa_tree`. (Readable materialised references of the same
losses live in tests/medusa_reference.py.)

    heads = MedusaHeads.from_verifier(verifier, num_heads=4, num_layers=1)
    feats = verifier.features(input_ids, attention_mask, return_logits=cfg.loss == "distill")
    head = medusa_head_losses(heads, feats.final, input_ids, loss_mask, cfg.loss, feats.logits, cfg.decay)
    add_lora(verifier, r=..., alpha=..., dropout=..., target_modules=...)       # Medusa-2
    joint = MedusaJoint(verifier, heads)                               # one module: hand it to accelerator.prepare

Inference (the spec-decode engine): `logits = heads(h_last)`, h_last (B, H) -> (K, B, V) (any (..., H) works), where
`h_last` is the verifier's final post-norm hidden state at the last accepted token. A tree path (r_0, ..., r_d)
is the node whose token at depth i is head i's rank-r_i prediction; every prefix of a path is itself in the tree,
the root (the verifier's own next token) is not listed, and paths are sorted by (depth, ranks). The per-rank
accuracies (K x R) rebuild a tree for another node budget with `build_medusa_tree`.

Export and load (`save_medusa`, `load_medusa`, `load_medusa_verifier`): models/export.py, in vLLM's layout
(models/layouts/medusa_vllm.py).
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.data.documents import same_document
from draftheads.models.linear_loss import linear_loss
from draftheads.models.verifier import Verifier, VerifierError

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
    shared_lm_head: bool = False
    """Every head ends in the verifier's lm_head, frozen, instead of its own trained copy (vLLM's `original_lm_head`):
    only the ResBlocks train; the export carries the one head. Needs num_layers >= 1."""
    loss: Literal["labels", "distill"] = "labels"
    """`labels`: cross-entropy against the data token t+k+2; `distill`: KL to the verifier's own distribution there."""
    decay: float = 0.8
    """Head k's loss is weighted decay^k."""
    joint: bool = False
    """Medusa-2: train LoRA adapters on the verifier together with the heads."""
    lora_r: int = 16
    """LoRA rank (joint only)."""
    lora_alpha: int = 32
    """LoRA scaling numerator, > 0; the update is scaled by alpha / r (joint only)."""
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
        if self.shared_lm_head and self.num_layers < 1:
            raise ValueError(f"medusa.shared_lm_head=true with medusa.num_layers={self.num_layers}: every head would "
                             "be the verifier's own head; expected num_layers >= 1")
        if not 0 < self.decay <= 1:
            raise ValueError(f"medusa.decay={self.decay}: expected a value in (0, 1]")
        if self.lora_r < 1:
            raise ValueError(f"medusa.lora_r={self.lora_r}: expected a positive rank")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"medusa.lora_dropout={self.lora_dropout}: expected a value in [0, 1)")
        if self.lora_alpha <= 0:
            raise ValueError(f"medusa.lora_alpha={self.lora_alpha}: expected a positive scaling numerator (the update "
                             "is scaled by alpha / r)")
        if not self.lora_target_modules:
            raise ValueError("medusa.lora_target_modules is empty: name at least one linear layer, e.g. q_proj")
        names = [str(m) for m in self.lora_target_modules]
        bad = [m for m in names if not re.fullmatch(r"[A-Za-z_][\w.]*", m)]
        if bad or len(set(names)) != len(names):
            what = f"{bad} are not module names" if bad else "a name is repeated"
            raise ValueError(f"medusa.lora_target_modules={names}: {what}; expected distinct names of the verifier's "
                             "linear layers (e.g. q_proj, v_proj)")
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
    With `shared_lm_head` there are no `lm_heads`: every head ends in `shared_head` (V, H), a tensor held, not a
    parameter (so nothing trains, checkpoints, syncs or shards it, and `.to()` leaves it where it is): the verifier's
    lm_head itself while training (`from_verifier`, no copy), the file's `lm_head.weight` once loaded (`load_medusa`
    places it; `place_shared_head` moves or casts it).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 bias: bool = True, device=None, dtype=None, shared_lm_head: bool = False):
        super().__init__()
        if shared_lm_head and num_layers < 1:
            raise ValueError("MedusaHeads(shared_lm_head=True) needs num_layers >= 1: else every head is the "
                             "verifier's own head")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.bias = num_heads, num_layers, bias
        self.shared_lm_head = shared_lm_head
        self.shared_head: torch.Tensor | None = None
        self.blocks = nn.ModuleList([
            ResBlock(hidden_size, num_layers, bias, device=device, dtype=dtype) for _ in range(num_heads)
        ])
        if shared_lm_head:
            return
        # skip_init: a V x H matrix per head is large (128k x 4k for Llama-3) and is overwritten right away
        self.lm_heads = nn.ModuleList([
            _uninitialised_linear(hidden_size, vocab_size, False, device, dtype) for _ in range(num_heads)
        ])
        for head in self.lm_heads:
            nn.init.zeros_(head.weight)

    @classmethod
    def from_verifier(cls, verifier: Verifier, num_heads: int = 4, num_layers: int = 1, bias: bool = True,
                      dtype: torch.dtype = torch.float32, shared_lm_head: bool = False) -> "MedusaHeads":
        """New heads on the verifier's device; each starts as the verifier's own head (ResBlocks = identity)."""
        heads = cls(verifier.hidden_size, verifier.vocab_size, num_heads, num_layers, bias,
                    device=verifier.device, dtype=dtype, shared_lm_head=shared_lm_head)
        if shared_lm_head:
            heads.shared_head = verifier.lm_head.weight.detach()  # (V, H), the verifier's own tensor
            return heads
        with torch.no_grad():
            source = verifier.lm_head.weight  # (V, H); may be tied to the embedding: we copy, never share
            for head in heads.lm_heads:
                head.weight.copy_(source)
        return heads

    @classmethod
    def from_config(cls, cfg: MedusaConfig, verifier: Verifier, dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        return cls.from_verifier(verifier, cfg.num_heads, cfg.num_layers, cfg.bias, dtype=dtype,
                                 shared_lm_head=cfg.shared_lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return (self.blocks[0].layers[0] if self.shared_lm_head else self.lm_heads[0]).weight.dtype

    def head_weight(self, k: int) -> torch.Tensor:
        """(V, H) head k's output projection: its own, or the shared one."""
        if not self.shared_lm_head:
            return self.lm_heads[k].weight
        if self.shared_head is None:
            raise ValueError("MedusaHeads(shared_lm_head=True) holds no lm_head yet: build it with from_verifier or "
                             "load_medusa")
        return self.shared_head

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V): head k's logits (hidden in the heads' dtype)."""
        weight = self.head_weight(k)
        return F.linear(self.blocks[k](hidden), weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype))

    def place_shared_head(self, device=None, dtype=None) -> None:
        """Move or cast the held shared head (a copy where that changes it; the verifier's tensor stays as it is)."""
        if self.shared_head is not None:
            self.shared_head = self.shared_head.to(device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.dtype)  # the verifier may run in bf16 while the heads train in fp32
        # (K, ..., V); stacking costs one extra copy of the logits, small next to what the loss keeps for backward
        return torch.stack([self.head_logits(k, hidden) for k in range(self.num_heads)])


# ---- losses: chunked, no (K, B, T, V) logits (definitions in the module docstring) --------------------------

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


def target_weights(loss_mask: torch.Tensor, shift: int, position_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (B, T), count ()) for predicting token t+shift from position t: w = valid / count, valid where
    t+shift < T, loss_mask is 1 at the target and (with position_ids of packed rows) the target is in t's
    document (`data.documents.same_document`), zero elsewhere, so Σ w·loss is the masked mean."""
    B, T = loss_mask.shape
    valid = torch.zeros(B, T, dtype=torch.float32, device=loss_mask.device)
    valid[:, :max(T - shift, 0)] = loss_mask[:, shift:].float()
    if position_ids is not None:
        valid = valid * same_document(position_ids, shift)
    count = valid.sum()
    return valid / count.clamp(min=1), count


def medusa_head_losses(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                       mode: Literal["labels", "distill"] = "labels", verifier_logits: torch.Tensor | None = None,
                       decay: float = 0.8, max_rank: int = 1, chunk_rows: int | None = None,
                       position_ids: torch.Tensor | None = None) -> HeadLosses:
    """Medusa-1's loss (module docstring) without the (K, B, T, V) logits, plus rank hits for accuracy.

    hidden (B, T, H) the verifier's final post-norm state; input_ids, loss_mask (B, T); verifier_logits (B, T, V)
    for `distill`; position_ids (B, T) of packed rows: no target in another document (`target_weights`). Under
    `torch.no_grad()` it is the held-out evaluation (max_rank=R gives what the tree needs).
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
    shared = None
    if heads.shared_lm_head and not torch.is_autocast_enabled(hidden.device.type):
        # without autocast the products run in the heads' dtype, as own heads' do (not in the verifier's bf16):
        # one cast for all K heads
        shared = heads.head_weight(0).to(heads.dtype)
    ids = input_ids.reshape(N)
    teacher_all = verifier_logits.reshape(N, V) if mode == "distill" else None
    losses, hits, counts = [], [], []
    for k, block in enumerate(heads.blocks):
        shift = k + 2
        n = max(N - shift, 0)
        w, count = target_weights(loss_mask, shift, position_ids)  # (B, T)
        x = block(hidden).reshape(N, H)[:n]  # (n, H)
        teacher = teacher_all[shift - 1:shift - 1 + n] if teacher_all is not None else None  # (n, V) view
        weight = shared if shared is not None else heads.head_weight(k)  # (V, H)
        out = linear_loss(x, weight, ids[shift:], w.reshape(N)[:n], teacher,
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
                   chunk_rows: int | None = None, position_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], HeadLosses]:
    """Medusa-2's loss (module docstring) from the adapted verifier's hidden state (B, T, H).

    lm_head_weight (V, H) is the verifier's output projection (frozen or not); reference_logits (B, T, V) come from
    the verifier with adapters disabled. Returns (loss, parts {lm, kl, heads} detached, the head results).
    In `distill` mode the heads learn the adapted verifier's distribution, computed here once without grad.
    """
    B, T = input_ids.shape
    N, V = B * T, lm_head_weight.shape[0]
    w, _ = target_weights(loss_mask, 1, position_ids)  # (B, T)
    own = linear_loss(hidden.reshape(N, -1)[:N - 1], lm_head_weight, input_ids.reshape(N)[1:], w.reshape(N)[:N - 1],
                      reference_logits.reshape(N, V)[:N - 1], ce_weight=lm_weight, kl_weight=kl_weight,
                      chunk_rows=chunk_rows)
    adapted = None
    if mode == "distill":
        with torch.no_grad():
            adapted = hidden.detach() @ lm_head_weight.T  # (B, T, V)
    head = medusa_head_losses(heads, hidden, input_ids, loss_mask, mode, adapted, decay, max_rank, chunk_rows,
                              position_ids)
    loss = own.loss + heads_weight * head.loss
    return loss, {"lm": own.ce, "kl": own.kl, "heads": head.loss.detach()}, head


# ---- static tree -----------------------------------------------------------------------------------------------

def as_rows(rank_acc) -> list[list[float]]:
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
    rows = as_rows(rank_acc)
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
    rows = as_rows(rank_acc)
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
