"""EAGLE-1 and EAGLE-3 drafters: one decoder layer on the frozen verifier's features.

Notation. A training sequence is x_0 .. x_{T-1}. The verifier, run once over it, gives at position t
  f_t        its final post-norm hidden state (input of lm_head); q_t = lm_head(f_t) predicts x_{t+1};
  g_t^(i)    the input of decoder layer i (HF `hidden_states[i]`), for the EAGLE-3 feature layers i.
`loss_mask[b, t] = 1` marks x_t as a token the drafter should learn to predict (assistant tokens; 0 on prompts
and padding). A prediction *of* x_j is trained and scored iff loss_mask[j] = 1. Padding goes on the right.

EAGLE-1 (Li et al. 2024; SafeAILab/EAGLE `eagle/train/main.py`, `cnets1.py`)
  At drafter position t (position id t) the input pair is (x_{t+1}, f_t):
      f'_t = Layer(fc([embed(x_{t+1}); f_t]))                 fc = Linear(2H, H, bias=fc_bias), no bias by default
  Layer is one decoder layer of the verifier's family (Llama's for families other than Llama, Qwen2 and Mistral,
  `llama_layer_config`) *without* input_layernorm (the fc output is the residual);
  there is no final norm: f'_t is fed straight to the verifier's lm_head. f'_t regresses f_{t+1}, and
  lm_head(f'_t) predicts x_{t+2}:
      loss = feature_weight * SmoothL1(f'_t, f_{t+1}) + token_weight * CE(softmax(q_{t+1}), log_softmax(lm_head(f'_t)))
  averaged over positions with loss_mask[t+2] = 1 (SmoothL1 averaged over H first, as the EAGLE repo does; that repo
  leaves the mask unshifted, scoring x_{t+2} with loss_mask[t]).
  Optional noise: f_t + (U(0,1) - 0.5) * noise on the *input* features only (the EAGLE repo uses 0.2 * 512/T).

EAGLE-3 (Li et al. 2025; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`, sgl-project/SpecForge
`specforge/algorithms/eagle3/model.py`, `specforge/modeling/draft/llama3_eagle.py`)
  Features: h_t = fc([g_t^(a); g_t^(b); g_t^(c)]), fc = Linear(3H, H, bias=False), layers (a, b, c) default
  `verifier.default_eagle3_layers()` = inputs of layers 2, L//2, L-3 (vLLM's default).
  Layer(e, h): residual = h (or hidden_norm(h) when norm_before_residual)
               a = Attn(cat[input_layernorm(e); hidden_norm(h)])      q/k/v take 2H, o_proj gives H
               u = residual + a;  out = u + MLP(post_attention_layernorm(u))
  out is the drafter's hidden (fed back at the next step, *pre*-norm); logits = lm_head(norm(out)) over a draft
  vocabulary of size Vd, mapped to verifier ids by `target_id = draft_id + d2t[draft_id]`.

  Training-time test (TTT), steps k = 0 .. K-1 (K = ttt_steps), stream position t:
      step 0:  input (x_{t+1}, h_t)              at position id t
      step k:  input (x_{t+1+k}, out^{k-1}_t)    at position id t + k
      out^k_t predicts x_{t+2+k}; target softmax of q_{t+1+k} renormalised over the draft vocabulary; trained iff
      loss_mask[t+2+k] = 1 and argmax q_{t+1+k} is in the draft vocabulary.
      Attention of query (k, t) sees keys (0, s) for s <= t (the step-0 prefix, causally) and (j, t) for
      1 <= j <= k (its own chain). This is exactly what inference does: the drafter's KV cache holds step-0 entries
      for the verified prefix 0..t, then one entry per drafted token of this chain at positions t+1, t+2, ...
      loss = sum_k decay^k * mean over trained positions of soft-CE_k           (decay = 0.8)
  The EAGLE repo and SpecForge pair the same (token, hidden) inputs, shift targets one per step and add the step
  index to the position ids (`position_ids + lck`). They shift `loss_mask` by k only (scoring x_{t+2+k} with
  loss_mask[t+k]); here the mask is shifted to the predicted token itself, per the convention above.

  Implementation of the TTT attention: by definition, step k attends over the keys of all steps so far concatenated
  along the sequence, [K_0 | K_1 | ... | K_k] of length (k+1)T, with the boolean mask `ttt_attention_mask(T, k)` =
  [causal | I | ... | I]. Most of that mask is False, so `ttt_attention` computes the same thing in O(T^2 + kT):
  causal scores against K_0 (B, nh, T, T), plus one score per later step against the query's own key,
  (q_t . k_j,t) (B, nh, T, k), one softmax over both, and the matching sum of values. Step 0 is plain causal SDPA.

EAGLE-3 variants (each an `EagleConfig` switch, exported with the fields vLLM reads: models/layouts/eagle_vllm.py)
  parallel (P-EAGLE, arXiv 2602.01469; vLLM `parallel_drafting`): step k >= 1 reads (mask token, fc(mask_hidden))
      instead of (x_{t+1+k}, out^{k-1}_t), at position id t + k with the same TTT attention (the step-0 prefix
      causally, then its own chain's mask positions). Nothing a step reads depends on an earlier step's output, so
      at inference all K drafts come from one drafter forward over the committed pairs followed by K-1 mask
      positions. mask_hidden (3H) lives in the verifier-feature space and goes through fc (and fc_norm) like a
      feature, as vLLM computes it; the mask token's embedding is the verifier's, frozen. Training keeps a
      random nested share max(decay^k, floor) of the chains at step k (`parallel_keep`, as speculators samples).
  fc_norm (EAGLE 3.1): h_t = fc([n_a(g^(a)); n_b(g^(b)); n_c(g^(c))]), one RMS norm per feature layer.
  norm_output (EAGLE 3.1): the layer's output is norm(out), which is both what the next step reads and what
      lm_head reads (logits apply no second norm).
Token losses and step weights: models/draft_losses.py (`loss`, `step_weights`); forward_kl is the soft CE above.

Metrics (on device, summed over batches as `StepCounts`): per step k, accuracy acc_k (greedy draft token equals the
verifier's argmax, among positions with loss_mask[t+2+k] = 1, out-of-draft-vocab targets counting as misses),
conditional accuracy c_k = P(step k right | steps 0..k-1 right at that position), cumulative
accuracy prod_{j<=k} c_j, and the simulated acceptance length 1 + sum_k prod_{j<=k} c_j (bonus token included).
EAGLE-3's `training_loss` counts its K = ttt_steps steps; EAGLE-1's counts its one trained step, and
`chain_counts(..., steps)` scores either version on chains it drafts from its own outputs (EAGLE-1 at inference).

Inference API (for the spec-decode engine), the same for both versions:
  drafter(input_ids (B,N), hidden (B,N,H), position_ids (B,N) | None, attention_mask | None,
          past_key_value (k, v) | None) -> (out_hidden (B,N,H), (k, v))
    hidden          EAGLE-1: the verifier's final feature f_t or the drafter's own previous out_hidden.
                    EAGLE-3: `project_features(...)` of verifier features, or the drafter's own previous
                    out_hidden; raw (B,N,3H) verifier features are projected on the fly.
    attention_mask  (B or 1, 1, N, S_past + N), bool (True = attend) or additive float; None = causal over the new
                    tokens with the whole cache visible. Trees: ancestor-only masks with position id = depth.
    past_key_value  (k, v), each (B, num_kv_heads, S_past, head_dim), keys already rotated (RoPE). The return value
                    is the cache extended by the N new entries, (B, num_kv_heads, S_past + N, head_dim).
  drafter.logits(out_hidden) -> (B,N,V) for EAGLE-1 (the verifier's lm_head, no extra norm), (B,N,Vd) for EAGLE-3.
  drafter.to_target_ids(draft_ids) -> verifier ids (identity for EAGLE-1).
  drafter.project_features(list of (B,T,H)) -> (B,T,H): EAGLE-3's fc; EAGLE-1 returns its single final feature.
  drafter.feature_layers: the verifier layer ids to request (EAGLE-1: none, it uses the final feature).

Export and load: models/export.py (`export_eagle`, `load_eagle`), in the layouts of models/layouts/ (vLLM's,
SGLang's); this module holds the drafter, its losses and math only.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.draft_losses import masked_mean, step_weights, token_loss

#: Verifier families whose own decoder layer the drafter copies; every other family gets a Llama layer with its dims
#: (`llama_layer_config`), which is also what the engines build for them.
OWN_LAYER_FAMILIES = ("llama", "qwen2", "mistral")


class EagleError(ValueError):
    """An EAGLE drafter that cannot be built, trained or loaded as asked; the message says what to fix."""


# ---- config ------------------------------------------------------------------------------------------------------
@dataclass
class EagleConfig:
    """The `eagle:` section of a run config: which EAGLE, its layer, vocabulary and loss."""

    version: Literal[1, 3] = 3
    """1: EAGLE-1 (feature regression on the final hidden state); 3: EAGLE-3 (three layers, draft vocab, TTT)."""
    layer_ids: list[int] | None = None
    """EAGLE-3 feature layers (inputs of these verifier layers, HF hidden_states[i]); None: 2, L//2, L-3."""
    draft_vocab_size: int | None = 32000
    """EAGLE-3 draft vocabulary size, capped at the verifier's vocab; None: the whole vocabulary."""
    ttt_steps: int = 7
    """EAGLE-3 training-time-test unroll length (steps fed the drafter's own output); EAGLE-1 trains one step and
    is scored on chains of this many steps (`chain_counts`)."""
    decay: float = 0.8
    """EAGLE-3 weight of step k's loss is decay**k."""
    feature_weight: float = 1.0
    """EAGLE-1 weight of the SmoothL1 feature-regression loss."""
    token_weight: float = 0.1
    """EAGLE-1 weight of the soft cross-entropy against the verifier's next-token distribution."""
    noise: float | None = None
    """Uniform noise width on the input verifier features during training; None: 0.2 for EAGLE-1, 0 for EAGLE-3."""
    fc_bias: bool | None = None
    """Bias on fc; None: none (vLLM builds both EAGLE versions' fc without one, SGLang reads a zero one for
    EAGLE-1). The EAGLE repo trains EAGLE-1 with one: true, for engine sglang only."""
    qkv_bias: bool | None = None
    """Bias on q/k/v projections; None: as in the verifier's family (Qwen2: true)."""
    norm_before_residual: bool = False
    """EAGLE-3: take the residual after hidden_norm (vLLM option); false as in the EAGLE repo and SpecForge."""
    init_from_verifier: bool = True
    """EAGLE-3: start lm_head from the verifier's rows of the draft vocabulary and norm from its final norm."""
    loss: Literal["forward_kl", "reverse_kl", "jsd", "tv", "lk", "lk_hybrid"] = "forward_kl"
    """The token loss against the verifier's distribution (models/draft_losses.py): forward_kl is the soft
    cross-entropy of the EAGLE repo; EAGLE-1 uses it for its token term."""
    step_weights: Literal["exponential", "uniform", "reach"] = "exponential"
    """EAGLE-3 weight of step k: decay**k, 1, or the measured chance of reaching step k (draft_losses.py)."""
    lk_eta: float = 3.0
    """loss=lk_hybrid: the KL term's weight is exp(-lk_eta * alpha) per position (speculators' and the paper's 3)."""
    parallel: bool = False
    """EAGLE-3 parallel drafting (P-EAGLE, vLLM `parallel_drafting`): the draft steps after the first read the mask
    token and a learned `mask_hidden` instead of the previous draft, so one drafter forward drafts all of them."""
    mask_token_id: int | None = None
    """parallel: the token id at the mask positions (the verifier's embedding of it, frozen); None: the verifier's
    pad token, else its eos token."""
    parallel_keep: tuple[float, float] = (0.7, 0.2)
    """parallel: (decay, floor): step k trains a random max(decay**k, floor) of the positions, nested over k
    (P-EAGLE's sampling, as in speculators: 0.7, 0.2); (1, 1) trains them all."""
    fc_norm: bool = False
    """EAGLE 3.1: an RMS norm on each verifier layer's feature before fc (vLLM `fc_norm`)."""
    norm_output: bool = False
    """EAGLE 3.1: the hidden handed to the next draft step is the final norm's output, not the pre-norm one (vLLM
    `norm_output`)."""

    def __post_init__(self):
        if self.version not in (1, 3):
            raise EagleError(f"eagle.version={self.version!r}: expected 1 or 3")
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
            if len(self.layer_ids) != 3:
                raise EagleError(f"eagle.layer_ids={self.layer_ids}: expected exactly three layer ids")
            if any(a >= b for a, b in zip(self.layer_ids, self.layer_ids[1:])):
                raise EagleError(f"eagle.layer_ids={self.layer_ids}: expected distinct ids in increasing order; vLLM "
                                 f"and SGLang concatenate the features in layer order, so any other order would be "
                                 f"served with the fc blocks swapped (use {sorted(set(self.layer_ids))})")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise EagleError(f"eagle.draft_vocab_size={self.draft_vocab_size}: expected a positive size or null")
        if self.ttt_steps < 1:
            raise EagleError(f"eagle.ttt_steps={self.ttt_steps}: expected at least 1")
        if not 0 < self.decay <= 1:
            raise EagleError(f"eagle.decay={self.decay}: expected 0 < decay <= 1")
        for key in ("feature_weight", "token_weight"):
            if getattr(self, key) < 0:
                raise EagleError(f"eagle.{key}={getattr(self, key)}: expected >= 0")
        # None-valued defaults are resolved where used, not here: config parsers build the default section first
        # and then set fields one by one, so a value fixed now would outlive a later `version` override.
        if self.noise is not None and self.noise < 0:
            raise EagleError(f"eagle.noise={self.noise}: expected >= 0")
        if self.version == 3 and self.fc_bias:
            raise EagleError("eagle.fc_bias=true: EAGLE-3 engines (vLLM, SGLang) build fc without a bias; use false")
        if self.lk_eta < 0:
            raise EagleError(f"eagle.lk_eta={self.lk_eta}: expected >= 0")
        self.parallel_keep = tuple(float(x) for x in self.parallel_keep)
        if len(self.parallel_keep) != 2 or not all(0 < x <= 1 for x in self.parallel_keep):
            raise EagleError(f"eagle.parallel_keep={list(self.parallel_keep)}: expected [decay, floor], each in (0, 1]")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise EagleError(f"eagle.mask_token_id={self.mask_token_id}: expected a token id >= 0 or null")
        for key in ("parallel", "fc_norm", "norm_output"):
            if getattr(self, key) and self.version != 3:
                raise EagleError(f"eagle.{key}=true is an EAGLE-3 option; eagle.version is {self.version}")

    @property
    def input_noise(self) -> float:
        """The noise width in effect: `noise`, or 0.2 for EAGLE-1 / 0 for EAGLE-3 when unset."""
        if self.noise is not None:
            return self.noise
        return 0.2 if self.version == 1 else 0.0

    @property
    def use_fc_bias(self) -> bool:
        """Whether fc has a bias: `fc_bias`, false when unset."""
        return bool(self.fc_bias)


# ---- draft vocabulary (pure) -------------------------------------------------------------------------------------
def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64 count of each token at loss-masked positions; sum these over the training data."""
    ids = input_ids[loss_mask.bool()]
    return torch.bincount(ids.flatten().long(), minlength=vocab_size)[:vocab_size]


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent tokens (ties: lower id first), in ascending target-id order.

    Returns d2t (int64 [Vd], target_id - draft_id, so `target = draft + d2t[draft]`) and t2d (bool [V]).
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise EagleError(f"draft_vocab_size={draft_vocab_size}: expected 1..{vocab_size} (the verifier's vocab)")
    order = torch.sort(counts.cpu(), descending=True, stable=True).indices  # stable: ties keep id order
    target_ids = order[:draft_vocab_size].sort().values
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t.long(), t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Verifier token ids of draft ids (the vLLM/SGLang offset convention)."""
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of verifier token ids, -1 where the token is outside the draft vocabulary."""
    rank = torch.cumsum(t2d.long(), 0) - 1  # (V,) draft id of each kept target id
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))


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
    target_ids = target_logits.argmax(-1)
    columns = torch.arange(d2t.numel(), device=d2t.device) + d2t  # (Vd,) target id of each draft id
    logp = torch.log_softmax(target_logits.index_select(-1, columns).float(), dim=-1)
    return logp, target_ids, t2d[target_ids]


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, (step+1)T) bool, True = attend: step `step`'s queries over keys [step 0 | step 1 | ... | step `step`].

    Query t sees step-0 keys s <= t (causal) and, for each later step j <= step, only key t (its own chain).
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step k >= 1 of the TTT attention, (B, nh, T, d): what SDPA over [K_0 | ... | K_k] with `ttt_attention_mask`
    gives, without the (k+1)T-wide score matrix.

    q (B, nh, T, d) (RoPE applied); keys, values: k+1 tensors (B, nkv, T, d), step 0 first (nh a multiple of nkv).
    """
    B, nh, T, d = q.shape
    groups = nh // keys[0].shape[1]

    def per_head(x):  # GQA: each kv head serves `groups` query heads
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    scale = d ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    prefix = (q @ per_head(keys[0]).transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # (B, nh, T, T)
    chain_k = torch.stack([per_head(k) for k in keys[1:]], dim=3)  # (B, nh, T, k, d)
    chain_v = torch.stack([per_head(v) for v in values[1:]], dim=3)
    own = torch.einsum("bhtd,bhtkd->bhtk", q, chain_k) * scale  # (B, nh, T, k): q_t . k_{j,t}
    p = torch.softmax(torch.cat([prefix, own], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, T, T + k)
    return p[..., :T] @ per_head(values[0]) + torch.einsum("bhtk,bhtkd->bhtd", p[..., T:], chain_v)


@dataclass
class StepCounts:
    """Per-step counts, (K,) float tensors on device; add them over batches, `summary()` at log time."""

    correct: torch.Tensor
    """Positions where step k's greedy draft equals the verifier's argmax (and the position is scored)."""
    valid: torch.Tensor
    """Positions scored at step k (loss_mask of the predicted token)."""
    chain_correct: torch.Tensor
    """Positions where steps 0..k are all right."""
    chain_valid: torch.Tensor
    """Positions where steps 0..k-1 are all right and step k is scored (the denominator of conditional acc)."""

    def __add__(self, other: "StepCounts") -> "StepCounts":
        return StepCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def summary(self) -> dict[str, torch.Tensor]:
        """acc (K,), cond_acc (K,), cum_acc (K,), accept_length (scalar): device tensors, no host sync."""
        acc = self.correct / self.valid.clamp(min=1)
        cond = self.chain_correct / self.chain_valid.clamp(min=1)
        cum = torch.cumprod(cond, 0)
        return {"acc": acc, "cond_acc": cond, "cum_acc": cum, "accept_length": 1 + cum.sum()}


def step_counts(correct: torch.Tensor, valid: torch.Tensor) -> StepCounts:
    """Counts from per-step booleans aligned on the chain's start position: correct, valid (K, B, T)."""
    correct = correct & valid
    chain = torch.cumprod(correct.long(), 0).bool()  # steps 0..k all right
    before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]], 0)  # steps 0..k-1 all right
    dims = tuple(range(1, correct.dim()))
    return StepCounts(correct=correct.sum(dims).float(), valid=valid.sum(dims).float(),
                      chain_correct=chain.sum(dims).float(), chain_valid=(before & valid).sum(dims).float())


@dataclass
class EagleOutput:
    """One training forward: the loss to backpropagate and what to log."""

    loss: torch.Tensor
    """Scalar, differentiable."""
    step_losses: torch.Tensor
    """(K,) detached per-step losses (EAGLE-1: K = 1, the total)."""
    counts: StepCounts
    """Per-step accuracy counts (EAGLE-1: one step)."""
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached loss components (EAGLE-1: feature_loss, token_loss)."""


# ---- the drafter -------------------------------------------------------------------------------------------------
def _family(model_type: str):
    """(DecoderLayer, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb) of the drafter's layer: the verifier's own for
    the families in `OWN_LAYER_FAMILIES`, a Llama layer for every other family."""
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return m.Qwen2DecoderLayer, m.Qwen2RMSNorm, m.Qwen2RotaryEmbedding, m.apply_rotary_pos_emb
    if model_type == "mistral":
        from transformers.models.mistral import modeling_mistral as m

        return m.MistralDecoderLayer, m.MistralRMSNorm, m.MistralRotaryEmbedding, m.apply_rotary_pos_emb
    from transformers.models.llama import modeling_llama as m

    return m.LlamaDecoderLayer, m.LlamaRMSNorm, m.LlamaRotaryEmbedding, m.apply_rotary_pos_emb


def _layer_config(verifier_config):
    """The drafter layer's config: the verifier's config cut to one layer (its own families), or a one-layer Llama
    config with the verifier's dims, activation, norm eps and (global) rope for any other family."""
    if verifier_config.model_type in OWN_LAYER_FAMILIES:
        cfg = copy.deepcopy(verifier_config)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"]
        return cfg
    return llama_layer_config(verifier_config)


def llama_layer_config(vc):
    """A one-layer LlamaConfig with the dims of verifier config `vc` (any family): what vLLM and SGLang build for an
    EAGLE drafter whatever the verifier (their EAGLE-3 class is Llama's for a Qwen3, Gemma 3 or Llama target).
    Kept from `vc`: hidden, intermediate, heads, kv heads, head_dim, activation, norm eps, positions, the rope of
    its full-attention layers, vocab and token ids; not kept: q/k norms (Qwen3, OLMo 2), sliding windows, Gemma's
    (1 + w) norms and embedding scale — the drafter layer is trained, not copied."""
    from transformers import LlamaConfig

    heads = vc.num_attention_heads
    rope = dict(getattr(vc, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' rope
        rope = dict(rope["full_attention"])
    if not rope:
        rope = {"rope_type": "default", "rope_theta": getattr(vc, "rope_theta", 10000.0)}
    return LlamaConfig(
        vocab_size=vc.vocab_size, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(vc, "num_key_value_heads", None) or heads,
        head_dim=getattr(vc, "head_dim", None) or vc.hidden_size // heads,
        hidden_act=getattr(vc, "hidden_act", None) or getattr(vc, "hidden_activation", None) or "silu",
        rms_norm_eps=getattr(vc, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(vc, "max_position_embeddings", 4096), rope_parameters=rope,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=getattr(vc, "bos_token_id", None), eos_token_id=getattr(vc, "eos_token_id", None),
        pad_token_id=getattr(vc, "pad_token_id", None))


def norm_scale(norm: nn.Module, hidden_size: int) -> torch.Tensor:
    """The per-channel scale an RMS norm applies (x * w, or x * (1 + w) in Gemma's convention): its output for an
    input of RMS 1, times sqrt(1 + eps). Used to start the drafter's Llama norm from any family's final norm."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 0.0
    w = next(norm.parameters())
    with torch.no_grad():
        out = norm(torch.ones(1, hidden_size, dtype=w.dtype, device=w.device))[0].float()
    return (out * (1.0 + eps) ** 0.5).cpu()


class _Held:
    """Modules the drafter uses but does not own: not its parameters or state, untouched by `.to(dtype)`.

    embed_tokens and lm_head are the verifier's (frozen, shared); rotary_emb keeps its inverse frequencies in fp32.
    """

    def __init__(self, **modules: nn.Module):
        self.__dict__.update(modules)


class EagleDrafter(nn.Module):
    """The layer and attention both EAGLE versions share; see the module docstring for the inference API."""

    version: int
    parallel: bool = False  # EAGLE-3 sets it from eagle.parallel

    def __init__(self, verifier, cfg: EagleConfig):
        super().__init__()
        if cfg.version != self.version:
            raise EagleError(f"eagle.version={cfg.version} given to the EAGLE-{self.version} drafter")
        model_type = verifier.config.model_type
        layer_cls, norm_cls, rope_cls, self._apply_rope = _family(model_type)
        self.cfg = cfg
        self.model_type = model_type
        self.layer_config = _layer_config(verifier.config)
        self.verifier_vocab_size = verifier.vocab_size
        H = verifier.hidden_size
        self.hidden_size = H

        layer = layer_cls(self.layer_config, layer_idx=0)
        attn = layer.self_attn
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        qkv_bias = cfg.qkv_bias if cfg.qkv_bias is not None else attn.q_proj.bias is not None
        qkv_in = 2 * H if self.version == 3 else H
        attn.q_proj = nn.Linear(qkv_in, self.num_heads * self.head_dim, bias=qkv_bias)
        attn.k_proj = nn.Linear(qkv_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        attn.v_proj = nn.Linear(qkv_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        eps = self.layer_config.rms_norm_eps
        if self.version == 1:
            del layer.input_layernorm  # EAGLE-1: the fc output enters attention un-normalised
        else:
            layer.hidden_norm = norm_cls(H, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.fc = nn.Linear((2 if self.version == 1 else 3) * H, H, bias=cfg.use_fc_bias)
        self._held = _Held(embed_tokens=verifier.embed_tokens, lm_head=verifier.lm_head,
                           rotary_emb=rope_cls(self.layer_config))

    # ---- handles -------------------------------------------------------------------------------------------------
    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def feature_layers(self) -> list[int]:
        """Verifier layer ids whose inputs this drafter consumes (EAGLE-1: none, it uses the final feature)."""
        return []

    @property
    def token_embedding(self) -> torch.Tensor:
        """(V, H) the verifier's token embedding, which the drafter reads (frozen, shared, not its parameter)."""
        return self._held.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # frozen, shared with the verifier; the table itself, as the engines read it (a
            # family that scales its embeddings in the module, Gemma, is not scaled here: vLLM scales in the model)
            return F.embedding(input_ids, self.token_embedding).to(self.dtype)

    # ---- the layer -----------------------------------------------------------------------------------------------
    def _layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) for token embeddings and hidden states (B, N, H)."""
        raise NotImplementedError

    def _qkv(self, x: torch.Tensor, position_ids: torch.Tensor):
        """q (B, nh, N, d), k and v (B, nkv, N, d); RoPE applied to q and k."""
        attn = self.layer.self_attn
        B, N, _ = x.shape
        q = attn.q_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        rope = self._held.rotary_emb
        if rope.inv_freq.device != x.device:
            rope.to(x.device)  # moved, never cast: angles in fp32, cos/sin returned in v's dtype
        cos, sin = rope(v, position_ids)  # (B, N, d)
        q, k = self._apply_rope(q, k, cos, sin)
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) v, heads merged: (B, N, nh*d)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # GQA: each kv head serves `groups` query heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        B, _, N, _ = out.shape
        return out.transpose(1, 2).reshape(B, N, -1)

    def _block(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the MLP sub-block: the layer's output (B, N, H)."""
        layer = self.layer
        h = residual + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ---- inference API -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Run N new tokens against an optional cache; see the module docstring. Returns (out_hidden, (k, v))."""
        B, N = input_ids.shape
        past = 0 if past_key_value is None else past_key_value[0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past, past + N, device=input_ids.device).expand(B, N)
        x, residual = self._layer_input(self.embed(input_ids), hidden.to(self.dtype))
        q, k, v = self._qkv(x, position_ids)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0].to(k.dtype), k], dim=2)
            v = torch.cat([past_key_value[1].to(v.dtype), v], dim=2)
        if attention_mask is None and past:  # causal over the new tokens, the whole cache visible
            attention_mask = torch.ones(N, past + N, dtype=torch.bool, device=x.device).tril(past)
        elif attention_mask is not None and attention_mask.shape[-2:] != (N, past + N):
            raise EagleError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                             f"(B, 1, {N}, {past + N}) for {N} new tokens after {past} cached ones")
        out = self._block(self._attend(q, k, v, attention_mask, causal=attention_mask is None), residual)
        return out, (k, v)

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def project_features(self, layer_feats) -> torch.Tensor:
        raise NotImplementedError

    # ---- training ------------------------------------------------------------------------------------------------
    def training_loss(self, input_ids: torch.Tensor, features, loss_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> EagleOutput:
        """Loss and counts for one batch: input_ids (B, T), `VerifierFeatures` of them, loss_mask (B, T)."""
        raise NotImplementedError

    def ttt_unroll(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                   steps: int | None = None) -> list[torch.Tensor]:
        """The training-time-test unroll: out_hidden (B, T, H) of each step, step k at stream position t having
        consumed (x_{t+1+k}, previous step's output) at position id t + k; `hidden` (B, T, H) is step 0's
        hidden input: EAGLE-3 h_t = fc(features), EAGLE-1 the verifier's final feature f_t."""
        steps = self.cfg.ttt_steps if steps is None else steps
        B, T = input_ids.shape
        position_ids = self._default_positions(input_ids, position_ids)
        keys, values, outs = [], [], []
        for k in range(steps):
            ids_k, hidden = self._step_inputs(input_ids, hidden, k)
            x, residual = self._layer_input(self.embed(ids_k), hidden)
            q, kk, vv = self._qkv(x, position_ids + k)
            keys.append(kk)
            values.append(vv)
            if k == 0:
                attn = self._attend(q, kk, vv, None, causal=True)
            else:  # the step-0 prefix causally, plus this position's own chain of keys (see `ttt_attention`)
                attn = ttt_attention(q, keys, values).transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*d)
            hidden = self._block(attn, residual)
            outs.append(hidden)
        return outs

    def _step_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor, k: int):
        """(token ids, hidden) that TTT step k reads at every stream position: x_{t+1+k} (zero past the end) and
        `hidden`, the previous step's output (step 0: the features)."""
        return F.pad(input_ids[:, 1 + k:], (0, 1 + k)), hidden

    @torch.no_grad()
    def chain_counts(self, input_ids: torch.Tensor, features, loss_mask: torch.Tensor, steps: int | None = None,
                     position_ids: torch.Tensor | None = None) -> StepCounts:
        """Greedy draft chains of `steps` tokens (default ttt_steps) from every position, each step fed the
        drafter's own previous output, scored against the verifier's argmax: the metrics of the module docstring.

        EAGLE-3 with steps = ttt_steps gives the counts of `training_loss` in eval mode; EAGLE-1, which trains one
        step, is scored on the chain it drafts at inference.
        """
        B, T = input_ids.shape
        hidden = self.project_features(features.layers if self.version == 3 else [features.final])
        outs = self.ttt_unroll(input_ids, hidden.to(self.dtype), position_ids, steps)
        target_ids = self._target_logits(features).argmax(-1)  # (B, T): argmax q_t predicts x_{t+1}
        correct = torch.zeros(len(outs), B, T, dtype=torch.bool, device=input_ids.device)
        valid = torch.zeros_like(correct)
        for k, out in enumerate(outs):
            n = T - 2 - k  # stream positions t = 0..n-1 predict x_{t+2+k}
            if n <= 0:
                continue
            draft = self.to_target_ids(self.logits(out[:, :n]).argmax(-1))  # (B, n)
            correct[k, :, :n] = draft == target_ids[:, 1 + k:T - 1]
            valid[k, :, :n] = loss_mask[:, 2 + k:].bool()
        return step_counts(correct, valid)

    def _target_logits(self, features) -> torch.Tensor:
        if features.logits is not None:
            return features.logits
        with torch.no_grad():
            return self._held.lm_head(features.final)

    def _default_positions(self, input_ids, position_ids):
        if position_ids is None:
            B, T = input_ids.shape
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        return position_ids


class Eagle1Drafter(EagleDrafter):
    """EAGLE-1: f'_t = Layer(fc([embed(x_{t+1}); f_t])), decoded by the verifier's lm_head."""

    version = 1

    def _layer_input(self, embeds, hidden):
        x = self.fc(torch.cat([embeds, hidden], dim=-1))  # (B, N, H)
        return x, x

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self._held.lm_head
        return lm_head(out_hidden.to(lm_head.weight.dtype))  # (B, N, V), no extra norm

    def project_features(self, layer_feats) -> torch.Tensor:
        if isinstance(layer_feats, torch.Tensor):
            return layer_feats
        if len(layer_feats) != 1:
            raise EagleError(f"EAGLE-1 takes the verifier's final feature only; got {len(layer_feats)} tensors")
        return layer_feats[0]

    def training_loss(self, input_ids, features, loss_mask, position_ids=None) -> EagleOutput:
        B, T = input_ids.shape
        if T < 3:
            raise EagleError(f"EAGLE-1 needs sequences of at least 3 tokens; got {T}")
        final = features.final  # (B, T, H)
        hidden = final.to(self.dtype)
        if self.training and self.cfg.input_noise > 0:
            hidden = add_uniform_noise(hidden, self.cfg.input_noise)
        ids_in = F.pad(input_ids[:, 1:], (0, 1))  # x_{t+1} at position t
        out, _ = self(ids_in, hidden, self._default_positions(input_ids, position_ids))
        n = T - 2  # positions t = 0..T-3 predict x_{t+2}, which exists
        pred, target = out[:, :n], final[:, 1:n + 1]
        target_logits = self._target_logits(features)[:, 1:n + 1]  # q_{t+1}
        pred_logits = self.logits(pred)
        mask = loss_mask[:, 2:].bool()
        loss, feature, token = eagle1_loss(pred, target, pred_logits, target_logits, mask,
                                           self.cfg.feature_weight, self.cfg.token_weight, self.cfg.loss,
                                           self.cfg.lk_eta)
        with torch.no_grad():
            correct = pred_logits.argmax(-1) == target_logits.argmax(-1)
            counts = step_counts(correct[None], mask[None])
        return EagleOutput(loss=loss, step_losses=loss.detach()[None], counts=counts,
                           parts={"feature_loss": feature.detach(), "token_loss": token.detach()})


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3: fc over three verifier layers, [embed; hidden] attention input, own norm + lm_head over Vd."""

    version = 3

    def __init__(self, verifier, cfg: EagleConfig, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__(verifier, cfg)
        layer_ids = list(cfg.layer_ids) if cfg.layer_ids is not None else verifier.default_eagle3_layers()
        verifier.check_layer_ids(layer_ids, key="eagle.layer_ids")
        self.layer_ids = layer_ids
        V = verifier.vocab_size
        if d2t is None:
            size = V if cfg.draft_vocab_size is None else min(cfg.draft_vocab_size, V)
            if size < V:
                raise EagleError(
                    f"eagle.draft_vocab_size={size} < vocab {V}: pass token counts of the training data "
                    "(build_drafter(..., token_counts=count_tokens(...))) to choose the draft vocabulary")
            d2t, t2d = select_draft_vocab(torch.zeros(V, dtype=torch.long), V)
        if t2d is None or t2d.numel() != V or d2t.dtype != torch.long or t2d.dtype != torch.bool:
            raise EagleError(f"draft vocab maps must be d2t int64 [Vd] and t2d bool [{V}]")
        if not torch.equal(target_to_draft(draft_to_target(torch.arange(d2t.numel()), d2t), t2d),
                           torch.arange(d2t.numel())):
            raise EagleError("d2t and t2d disagree: draft id -> target id -> draft id does not round-trip")
        Vd = d2t.numel()
        H = self.hidden_size
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        norm_cls = _family(self.model_type)[1]
        eps = self.layer_config.rms_norm_eps
        self.norm = norm_cls(H, eps=eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if cfg.fc_norm:  # EAGLE 3.1: one norm per feature layer, before fc (vLLM fc_norm.{0,1,2})
            self.fc_norm = nn.ModuleList([norm_cls(H, eps=eps) for _ in range(3)])
        self.parallel = cfg.parallel
        if cfg.parallel:  # P-EAGLE: the feature-space input of every mask position, through fc like a feature
            self.mask_token_id = resolve_mask_token(verifier, cfg.mask_token_id)
            self.mask_hidden = nn.Parameter(torch.randn(3 * H))
        if cfg.init_from_verifier:
            with torch.no_grad():
                columns = torch.arange(Vd) + d2t
                self.lm_head.weight.copy_(verifier.lm_head.weight.detach().float().cpu()[columns])
                if self.model_type in OWN_LAYER_FAMILIES:
                    self.norm.weight.copy_(verifier.norm.weight.detach().float().cpu())
                else:  # the same per-channel scale in the Llama norm's convention (Gemma's is 1 + w)
                    self.norm.weight.copy_(norm_scale(verifier.norm, H))

    @property
    def feature_layers(self) -> list[int]:
        return list(self.layer_ids)

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def full_vocab(self) -> bool:
        """The draft vocabulary is the verifier's whole vocabulary (d2t is zero, t2d all true)."""
        return self.draft_vocab_size == self.verifier_vocab_size

    def project_features(self, layer_feats) -> torch.Tensor:
        """fc over the concatenated verifier features: list of 3 x (B, T, H), or (B, T, 3H) -> (B, T, H); with
        fc_norm, each layer's H-wide block is normalised first."""
        if isinstance(layer_feats, torch.Tensor):
            layer_feats = layer_feats.chunk(3, dim=-1) if self.cfg.fc_norm else [layer_feats]
        layer_feats = [x.to(self.dtype) for x in layer_feats]
        if self.cfg.fc_norm:
            layer_feats = [norm(x) for norm, x in zip(self.fc_norm, layer_feats)]
        return self.fc(torch.cat(layer_feats, dim=-1))

    def keep_fraction(self, step: int) -> float:
        """parallel: the share of positions step `step` trains, max(decay**step, floor) (1 at step 0). Kept sets
        are nested, as in speculators: a chain trained at step k was trained at step k-1."""
        decay, floor = self.cfg.parallel_keep
        return max(decay ** step, floor)

    def mask_feature(self) -> torch.Tensor:
        """parallel: (H,) the hidden input of every mask position, fc(mask_hidden) (fc_norm first, if on)."""
        return self.project_features(self.mask_hidden[None, None])[0, 0]

    def _step_inputs(self, input_ids, hidden, k):
        if not self.parallel or k == 0:
            return super()._step_inputs(input_ids, hidden, k)
        B, T = input_ids.shape
        return torch.full_like(input_ids, self.mask_token_id), self.mask_feature().expand(B, T, -1)

    def _block(self, attn_out, residual):
        out = super()._block(attn_out, residual)
        return self.norm(out) if self.cfg.norm_output else out  # EAGLE 3.1: the next step reads the normed hidden

    def _layer_input(self, embeds, hidden):
        if hidden.shape[-1] == self.fc.in_features:  # raw verifier features
            hidden = self.project_features(hidden)
        layer = self.layer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return torch.cat([layer.input_layernorm(embeds), normed], dim=-1), residual  # (B, N, 2H), (B, N, H)

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        if self.cfg.norm_output:  # the hidden is already the final norm's output
            return self.lm_head(out_hidden)
        return self.lm_head(self.norm(out_hidden))  # (B, N, Vd)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def training_loss(self, input_ids, features, loss_mask, position_ids=None) -> EagleOutput:
        B, T = input_ids.shape
        if len(features.layers) != 3:
            raise EagleError(f"EAGLE-3 needs the verifier features of layers {self.layer_ids}; got "
                             f"{len(features.layers)} layer tensors (request layer_ids=drafter.feature_layers)")
        feats = torch.cat(features.layers, dim=-1).to(self.dtype)  # (B, T, 3H)
        if self.training and self.cfg.input_noise > 0:
            feats = add_uniform_noise(feats, self.cfg.input_noise)
        outs = self.ttt_unroll(input_ids, self.project_features(feats), position_ids)
        with torch.no_grad():
            target_logp, target_ids, in_draft = draft_targets(self._target_logits(features), self.d2t, self.t2d)
        loss_mask = loss_mask.bool()
        K = len(outs)
        correct = torch.zeros(K, B, T, dtype=torch.bool, device=input_ids.device)  # aligned on stream position t
        valid = torch.zeros_like(correct)
        zero = torch.zeros((), device=input_ids.device)
        step_losses, step_alpha = [], []
        kept = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # parallel: chains still trained
        for k, out in enumerate(outs):
            n = T - 2 - k  # stream positions t = 0..n-1 predict x_{t+2+k}, which exists
            if n <= 0:
                step_losses.append(outs[0].sum() * 0)
                step_alpha.append(zero)
                continue
            logits = self.logits(out[:, :n])  # (B, n, Vd)
            scored = loss_mask[:, 2 + k:]  # (B, n)
            trained = scored & in_draft[:, 1 + k:T - 1]
            if self.parallel and k > 0 and self.training:  # P-EAGLE: chains kept with chance f_k / f_{k-1}
                ratio = self.keep_fraction(k) / self.keep_fraction(k - 1)
                kept = kept & (torch.rand(kept.shape, device=kept.device) < ratio)
                trained = trained & kept[:, :n]
            per_position, alpha = token_loss(self.cfg.loss, logits, target_logp[:, 1 + k:T - 1],
                                             self.cfg.lk_eta)
            step_losses.append(masked_mean(per_position, trained))
            step_alpha.append(masked_mean(alpha, trained))
            with torch.no_grad():
                correct[k, :, :n] = self.to_target_ids(logits.argmax(-1)) == target_ids[:, 1 + k:T - 1]
                valid[k, :, :n] = scored
        weights = step_weights(self.cfg.step_weights, K, self.cfg.decay, torch.stack(step_alpha)).to(zero.device)
        loss = (weights * torch.stack(step_losses)).sum()
        step_losses = [x.detach() for x in step_losses]
        return EagleOutput(loss=loss, step_losses=torch.stack(step_losses), counts=step_counts(correct, valid))


def resolve_mask_token(verifier, mask_token_id: int | None) -> int:
    """The mask token of a parallel drafter: `mask_token_id`, or the verifier's pad token, else its eos token."""
    config = verifier.config
    if mask_token_id is None:
        for key in ("pad_token_id", "eos_token_id"):
            value = getattr(config, key, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int):
                mask_token_id = value
                break
        else:
            raise EagleError("eagle.parallel=true: the verifier's config has no pad_token_id or eos_token_id to use "
                             "as the mask token; set eagle.mask_token_id")
    if not 0 <= mask_token_id < verifier.vocab_size:
        raise EagleError(f"eagle.mask_token_id={mask_token_id}: expected a token id below the verifier's vocab "
                         f"size {verifier.vocab_size}")
    return int(mask_token_id)


def build_drafter(verifier, cfg: EagleConfig, token_counts: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> EagleDrafter:
    """A fresh drafter for `verifier` (fp32 unless `dtype`), on the verifier's device.

    EAGLE-3 with a draft vocabulary smaller than the verifier's needs `token_counts` ((V,) from `count_tokens`
    summed over the training data); the most frequent tokens become the draft vocabulary.
    """
    if cfg.version == 1:
        drafter = Eagle1Drafter(verifier, cfg)
    else:
        d2t = t2d = None
        if token_counts is not None:
            V = verifier.vocab_size
            if token_counts.numel() != V:
                raise EagleError(f"token_counts has {token_counts.numel()} entries; the verifier's vocab has {V}")
            size = V if cfg.draft_vocab_size is None else min(cfg.draft_vocab_size, V)
            d2t, t2d = select_draft_vocab(token_counts, size)
        drafter = Eagle3Drafter(verifier, cfg, d2t=d2t, t2d=t2d)
    return drafter.to(device=verifier.device, dtype=dtype or torch.float32)


class EagleTrainModule(nn.Module):
    """What a trainer hands to `accelerator.prepare`: DDP/FSDP sync gradients only through `forward`.

    forward(input_ids, features, loss_mask, position_ids=None) -> EagleOutput; the drafter is `.drafter`.
    forward(..., chain_steps=N) -> StepCounts of `drafter.chain_counts` (EAGLE-1's held-out scoring), also through
    `forward`, so it runs when FSDP has sharded the drafter (its weights are gathered only inside `forward`).
    """

    def __init__(self, drafter: EagleDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, features, loss_mask, position_ids=None, chain_steps: int | None = None):
        if chain_steps is not None:
            return self.drafter.chain_counts(input_ids, features, loss_mask, chain_steps, position_ids)
        return self.drafter.training_loss(input_ids, features, loss_mask, position_ids)
