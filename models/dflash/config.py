"""What a DFlash drafter is: `DFlashConfig` (the `dflash` section of a run config), `DFlashError`, and the defaults
the reference (`dflash` 0.1.0, z-lab) derives from the verifier: target layers and the loss decay gamma."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

HIDDEN_ACTS = ("silu",)
"""The MLP activations a DFlash export can be served with (vLLM's qwen3_dflash: SiluAndMul only)."""
#: Layer fields that default to the verifier's own (None in the config means "as the verifier").
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act")


class DFlashError(ValueError):
    """A DFlash drafter that cannot be built, trained or loaded as asked; the message says what to fix."""


class DFlashWarning(UserWarning):
    """A DFlash drafter that builds and trains, but whose layout leaves some block positions unable to draft."""


def _spread(start: int, end: int, n: int) -> list[int]:
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default target layers (0-based verifier layers whose *outputs* are read): one per drafter
    layer, spread evenly over 1 .. L-3 and rounded (a one-layer drafter reads the middle layer, L // 2). Where that
    repeats a layer (a shallow verifier: 4 layers, 2 drafter layers gives 1, 1), the spread goes over every
    readable layer, 0 .. L-2, instead; a drafter with more layers than that has no default."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    ids = _spread(1, L - 3, n)
    if len(set(ids)) == n:
        return ids
    ids = _spread(0, L - 2, n)
    if len(set(ids)) != n:
        raise DFlashError(f"dflash.target_layer_ids=null: a verifier of {L} layers has {L - 1} readable layer "
                          f"outputs, fewer than the drafter's {n} layers; set dflash.target_layer_ids")
    return ids


def default_gamma(block_size: int) -> float:
    """The loss decay for a block size: 1 + 3B/8, the line through the published pairs (B=16: 7, B=8: 4); B=4
    gets 2.5, B=32 gets 13."""
    return 1.0 + 3.0 * block_size / 8.0


@dataclass
class DFlashConfig:
    """The `dflash:` section of a run config: the drafter's layers, block, target layers, mask token and loss.

    Layer sizes left null take the verifier's (a Qwen3-shaped layer: q/k norms, SwiGLU MLP); hidden_size must be
    the verifier's, since the drafter reads the verifier's embedding and lm_head."""

    num_hidden_layers: int = 1
    """Drafter decoder layers (z-lab's Qwen3-8B block-16 drafter: 5)."""
    block_size: int = 16
    """Tokens per drafted block: the anchor plus block_size - 1 mask positions, drafted in one forward."""
    target_layer_ids: list[int] | None = None
    """0-based verifier layers whose outputs (HF hidden_states[i + 1]) are concatenated into the context; null:
    spread over 1 .. L-3 as the reference does (`default_target_layers`)."""
    mask_token_id: int | None = None
    """Token id at the mask positions (its verifier embedding, frozen); null: the verifier's pad token, else eos,
    unless that token's embedding row is all zeros: then the lowest token id whose row is not (`default_mask_token`)."""
    gamma: float | None = None
    """Loss decay: block position k's weight is exp(-(k-1)/gamma); null: 1 + 3B/8 (B=16: 7, B=8: 4)."""
    num_anchors: int = 512
    """Training: anchored blocks per sequence (random distinct loss-masked positions; fewer if the row has fewer)."""
    targets: Literal["data", "verifier"] = "data"
    """Training: what block position k learns, the data token anchor+k (self-distilled data: the verifier's own
    output) or the verifier's greedy token there (argmax of its logits at anchor+k-1)."""
    loss: Literal["ce", "kl", "dpace"] = "ce"
    """Training: `ce`, cross-entropy against the `targets` token weighted exp(-(k-1)/gamma) (the DFlash paper's);
    `kl`, KL(verifier || drafter) against the verifier's whole next-token distribution at anchor+k (its logits at
    anchor+k-1: soft targets, as our EAGLE-3 trains), weighted as ce; `dpace`, D-PACE: cross-entropy against the
    `targets` token, position k weighted by the sum over positions m >= k of the drafter's smoothed probability of
    drafting positions 1..m right (its own confidence, `dpace_alpha`; gamma unused), summed per block and averaged
    over blocks (arXiv 2605.18810; speculators' DFlash default)."""
    dpace_alpha: float | None = None
    """Training, loss dpace: the confidence smoothing, q~ = (1 - alpha) q + alpha, in (0, 1]; 1 weighs position k
    by the number of trained positions from k on, whatever the drafter's confidence; null: 0.5 (the paper's and
    speculators' default)."""
    init_std: float | None = None
    """Training: initial weights of fc and the layers' linear maps; null keeps PyTorch's default (Kaiming-uniform,
    std 1/sqrt(3 fan_in)); a number draws them from normal(0, init_std), as transformers' `initializer_range` (0.02)
    does in the reference's and SpecForge's drafters."""
    init_layers: list[int] | None = None
    """Training: 0-based verifier layers whose weights start the drafter's layers, one per drafter layer (attention
    projections, MLP, the two norms; q/k norms where the verifier has them, else ones); null: random layers. The
    drafter's layer sizes must then be the verifier's."""
    checkpoint_layers: bool = False
    """Training: keep only each drafter layer's input and run the layer again in the backward (activation
    checkpointing): less memory, one more forward of the layers."""
    draft_vocab_size: int | None = None
    """null: the drafter's logits are the verifier's lm_head, frozen and shared (z-lab's drafters, the reference).
    A number: the drafter has its own lm_head, trained, over that many tokens (the most frequent in the training
    data, as EAGLE-3's draft vocabulary; the verifier's vocabulary size: all of them), started from the verifier's
    rows; the export carries it and the d2t map, which vLLM reads (`has_own_lm_head`, `draft_vocab_size`)."""
    markov_rank: int | None = None
    """DSpark: the rank r of the Markov head, a low-rank transition bias W2 W1[x] (V x r, r x V) from the previous
    block token x added to each block position's logits, drafted left to right (vLLM's qwen3_dspark); null: plain
    DFlash. The export is then vLLM's Qwen3DSparkModel (method dspark)."""
    confidence_head: bool | None = None
    """DSpark: a confidence head, a linear map of [hidden; Markov embedding] to each drafted token's acceptance
    probability, trained on the drafter/verifier overlap sum_v min(q_v, p_v) (vLLM's adaptive verification reads
    it); null: on with markov_rank, off without."""
    confidence_with_markov: bool = True
    """DSpark: the confidence head reads the Markov embedding of the previous token beside the hidden state (vLLM's
    confidence_head_with_markov); false: the hidden state only."""
    confidence_weight: float = 1.0
    """Training, DSpark: the confidence head's loss (binary cross-entropy against the overlap, weighted
    exp(-(k-1)/gamma) over block positions) is added to the token loss times this."""
    hidden_size: int | None = None
    """Drafter width; null: the verifier's (it must be)."""
    intermediate_size: int | None = None
    """MLP width; null: the verifier's."""
    num_attention_heads: int | None = None
    """Query heads; null: the verifier's."""
    num_key_value_heads: int | None = None
    """Key/value heads; null: the verifier's."""
    head_dim: int | None = None
    """Per-head width; null: the verifier's (hidden_size / heads when it has none)."""
    rms_norm_eps: float | None = None
    """RMS norm epsilon; null: the verifier's."""
    rope_theta: float | None = None
    """RoPE base; null: the verifier's (positions are the verifier's positions)."""
    max_position_embeddings: int | None = None
    """Longest position; null: the verifier's."""
    hidden_act: str | None = None
    """MLP activation; null: the verifier's (silu)."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections (Qwen3: none)."""
    layer_types: list[str] | None = None
    """Per drafter layer, `full_attention` (bidirectional inside the block) or `sliding_attention` (causal, within
    `sliding_window`); null: all full."""
    sliding_window: int | None = None
    """Window of the sliding_attention layers."""
    num_target_layers: int | None = None
    """The verifier's layer count (checks target_layer_ids; written into the export); null: the verifier's."""
    vocab_size: int | None = None
    """The verifier's vocabulary size (the drafter's logits are the verifier's lm_head); null: the verifier's."""
    variant: Literal["dflash", "dflash2"] = "dflash"
    """`dflash`: the DFlash drafter; `dflash2`: DFlash2 (models/dflash2/), the same layers with a grouped dynamic
    convolution around each attention and MLP (causal within the block) and a candidate selector that re-ranks the
    lm_head's top `selector_top_k` tokens at each block position by the token drafted before it (vLLM's
    `DFlash2DraftModel`, qwen3_dflash2.py)."""
    conv_kernel_size: int = 2
    """dflash2: taps of each grouped convolution (block position j mixes positions j-taps+1 .. j of its block)."""
    conv_group_size: int = 16
    """dflash2: hidden channels sharing one token-dependent kernel coefficient; must divide hidden_size."""
    selector_rank: int = 256
    """dflash2: rank of the candidate selector's predecessor / successor codebooks (V x rank each)."""
    selector_top_k: int = 16
    """dflash2: candidates per block position, the lm_head's top-k, that the selector re-ranks."""
    selector_loss_weight: float = 1.0
    """dflash2, training: weight of the selector's cross-entropy over the top-k candidates (added to the `loss`)."""

    def __post_init__(self):
        for key in ("num_hidden_layers", "num_anchors"):
            if getattr(self, key) < 1:
                raise DFlashError(f"dflash.{key}={getattr(self, key)}: expected a positive integer")
        if self.block_size < 2:
            raise DFlashError(f"dflash.block_size={self.block_size}: expected at least 2 (the anchor and one "
                              "mask position)")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings", "num_target_layers", "vocab_size", "sliding_window", "draft_vocab_size",
                    "markov_rank"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise DFlashError(f"dflash.{key}={value}: expected a positive integer or null")
        for key in ("gamma", "rms_norm_eps", "rope_theta"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise DFlashError(f"dflash.{key}={value}: expected a number > 0 or null")
        if self.hidden_act is not None and self.hidden_act not in HIDDEN_ACTS:
            raise DFlashError(f"dflash.hidden_act={self.hidden_act!r}: expected {' or '.join(HIDDEN_ACTS)} (vLLM's "
                              "DFlash drafter, qwen3_dflash, builds its MLP with SiluAndMul and serves no other "
                              "activation) or null for the verifier's")
        for key, allowed in (("targets", ("data", "verifier")), ("loss", ("ce", "kl", "dpace")),
                             ("variant", ("dflash", "dflash2"))):
            if getattr(self, key) not in allowed:
                raise DFlashError(f"dflash.{key}={getattr(self, key)!r}: expected one of {', '.join(allowed)}")
        if self.variant == "dflash2" and self.markov_rank is not None:
            raise DFlashError(f"dflash.markov_rank={self.markov_rank} with dflash.variant=dflash2: DSpark's Markov head "
                              "and DFlash2's candidate selector are two drafters (vLLM serves them as two "
                              "architectures); set one of them")
        if self.confidence_head and self.markov_rank is None:
            raise DFlashError("dflash.confidence_head=true needs dflash.markov_rank (the confidence head belongs to "
                              "a DSpark drafter: vLLM builds it only beside the Markov head)")
        if not (isinstance(self.confidence_weight, (int, float)) and self.confidence_weight >= 0):
            raise DFlashError(f"dflash.confidence_weight={self.confidence_weight}: expected a number >= 0")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, key) < 1:
                raise DFlashError(f"dflash.{key}={getattr(self, key)}: expected a positive integer")
        if not self.selector_loss_weight >= 0:
            raise DFlashError(f"dflash.selector_loss_weight={self.selector_loss_weight}: expected a number >= 0")
        if self.variant == "dflash2":
            if self.conv_kernel_size > self.block_size:
                raise DFlashError(f"dflash.conv_kernel_size={self.conv_kernel_size}: expected at most block_size "
                                  f"({self.block_size}); a tap past the block start reads nothing")
            if self.hidden_size is not None and self.hidden_size % self.conv_group_size:
                raise DFlashError(f"dflash.conv_group_size={self.conv_group_size}: expected a divisor of hidden_size "
                                  f"({self.hidden_size})")
            if self.vocab_size is not None and self.selector_top_k > self.vocab_size:
                raise DFlashError(f"dflash.selector_top_k={self.selector_top_k}: expected at most the vocabulary "
                                  f"({self.vocab_size})")
            if self.draft_vocab_size is not None:
                raise DFlashError(f"dflash.draft_vocab_size={self.draft_vocab_size} with variant dflash2: the "
                                  "candidate selector ranks the verifier's whole vocabulary (vLLM's DFlash2 and "
                                  "speculators' take no draft vocabulary); set dflash.draft_vocab_size=null")
        if self.dpace_alpha is not None and not 0 < self.dpace_alpha <= 1:
            raise DFlashError(f"dflash.dpace_alpha={self.dpace_alpha}: expected a number in (0, 1] (the confidence "
                              "smoothing of loss dpace)")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise DFlashError(f"dflash.mask_token_id={self.mask_token_id}: expected a token id >= 0 or null")
        if self.mask_token_id is not None and self.vocab_size is not None and self.mask_token_id >= self.vocab_size:
            raise DFlashError(f"dflash.mask_token_id={self.mask_token_id}: expected an id below vocab_size "
                              f"{self.vocab_size}")
        if None not in (self.draft_vocab_size, self.vocab_size) and self.draft_vocab_size > self.vocab_size:
            raise DFlashError(f"dflash.draft_vocab_size={self.draft_vocab_size}: expected at most the verifier's "
                              f"vocabulary ({self.vocab_size}) or null")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise DFlashError(f"dflash.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        if self.target_layer_ids is not None:
            ids = [int(i) for i in self.target_layer_ids]
            self.target_layer_ids = ids
            if not ids or len(set(ids)) != len(ids) or any(i < 0 for i in ids):
                raise DFlashError(f"dflash.target_layer_ids={ids}: expected distinct layer ids >= 0")
            if self.num_target_layers is not None and max(ids) > self.num_target_layers - 2:
                raise DFlashError(f"dflash.target_layer_ids={ids}: the verifier has {self.num_target_layers} layers; "
                                  f"expected ids in 0..{self.num_target_layers - 2} (the last layer's output is "
                                  "not read: HF reports it after the final norm)")
        if self.init_std is not None and not self.init_std > 0:
            raise DFlashError(f"dflash.init_std={self.init_std}: expected a number > 0 or null")
        if self.init_layers is not None:
            ids = [int(i) for i in self.init_layers]
            self.init_layers = ids
            if len(ids) != self.num_hidden_layers or any(i < 0 for i in ids):
                raise DFlashError(f"dflash.init_layers={ids}: expected one verifier layer id >= 0 per drafter layer "
                                  f"({self.num_hidden_layers}) or null")
            if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
                raise DFlashError(f"dflash.init_layers={ids}: the verifier has {self.num_target_layers} layers; "
                                  f"expected ids in 0..{self.num_target_layers - 1}")
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            if len(self.layer_types) != self.num_hidden_layers:
                raise DFlashError(f"dflash.layer_types has {len(self.layer_types)} entries; expected one per "
                                  f"drafter layer ({self.num_hidden_layers})")
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad:
                raise DFlashError(f"dflash.layer_types: {bad} unknown; expected full_attention or sliding_attention")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise DFlashError("dflash.layer_types has sliding_attention layers; set dflash.sliding_window")

    # ---- resolved values -----------------------------------------------------------------------------------------
    @property
    def loss_gamma(self) -> float:
        """gamma in effect: `gamma`, else `default_gamma(block_size)`."""
        return float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)

    @property
    def loss_alpha(self) -> float:
        """D-PACE's smoothing in effect: `dpace_alpha`, else 0.5."""
        return float(self.dpace_alpha) if self.dpace_alpha is not None else 0.5

    @property
    def dspark(self) -> bool:
        """A DSpark drafter: a DFlash drafter with a Markov head (`markov_rank`)."""
        return self.markov_rank is not None

    @property
    def has_confidence_head(self) -> bool:
        """The confidence head in effect: `confidence_head`, else on exactly for DSpark."""
        return self.dspark if self.confidence_head is None else bool(self.confidence_head)

    @property
    def resolved(self) -> bool:
        """Every field a drafter is built from is set (see `resolve`)."""
        return all(getattr(self, key) is not None for key in (*LAYER_FIELDS, "target_layer_ids", "mask_token_id",
                                                             "num_target_layers", "vocab_size"))

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types is not None else "full_attention"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "dflash") -> "DFlashConfig":
        """A config from a plain dict (an export's metadata); unknown keys are refused naming `where`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DFlashError(f"{where}: unknown DFlash config keys {unknown}")
        return cls(**values)

    def resolve(self, verifier_config, embedding=None) -> "DFlashConfig":
        """A copy with every null filled from the verifier's HF config (`verifier_config`): its layer sizes,
        layer count, vocabulary, the default target layers and mask token (`embedding`, the verifier's input
        embedding weight (V, H), lets the default pass over a token embedded as zeros). Refuses a hidden_size other
        than the verifier's, and target layers the verifier does not have."""
        vc = verifier_config
        heads = vc.num_attention_heads
        rope = dict(getattr(vc, "rope_parameters", None) or {})
        if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' rope
            rope = dict(rope["full_attention"])
        theirs = {
            "hidden_size": vc.hidden_size,
            "intermediate_size": vc.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(vc, "num_key_value_heads", None) or heads,
            "head_dim": getattr(vc, "head_dim", None) or vc.hidden_size // heads,
            "rms_norm_eps": getattr(vc, "rms_norm_eps", None) or 1e-6,
            "rope_theta": float(rope.get("rope_theta") or getattr(vc, "rope_theta", None) or 10000.0),
            "max_position_embeddings": getattr(vc, "max_position_embeddings", None) or 4096,
            "hidden_act": getattr(vc, "hidden_act", None) or "silu",
            "num_target_layers": vc.num_hidden_layers,
            "vocab_size": vc.vocab_size,
        }
        values = self.to_dict()
        for key, value in theirs.items():
            if values[key] is None:
                values[key] = value
        if values["hidden_size"] != vc.hidden_size:
            raise DFlashError(f"dflash.hidden_size={values['hidden_size']}: the drafter reads the verifier's "
                              f"embedding and lm_head, so it must be the verifier's hidden_size {vc.hidden_size}")
        for key in ("num_target_layers", "vocab_size"):
            if values[key] != theirs[key]:
                raise DFlashError(f"dflash.{key}={values[key]}, but the verifier has {theirs[key]}")
        if values["target_layer_ids"] is None:
            values["target_layer_ids"] = default_target_layers(vc.num_hidden_layers, self.num_hidden_layers)
        if values["mask_token_id"] is None:
            values["mask_token_id"] = default_mask_token(vc, embedding)
        return DFlashConfig(**values)


def default_mask_token(verifier_config, embedding=None) -> int:
    """The verifier's pad token id, else its (first) eos token id. Given the verifier's input embedding (V, H), a
    token whose row is all zeros is passed over for the lowest id whose row is not: HF zeroes the pad token's row
    when it initialises a model (our embedded verifiers, a model trained from scratch), and a mask embedded as zeros
    reaches the first layer as zeros, so its queries, keys and values at every mask position are zero and its
    attention there is a fixed average that no weight can steer (tiny-code: the pad token's row is zero; id 1
    drafts better, docs/train-dflash.md#the-mask-tokens-embedding)."""
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(verifier_config, key, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int):
            if embedding is not None and 0 <= value < embedding.shape[0] and not bool(embedding[value].ne(0).any()):
                nonzero = embedding.detach().ne(0).any(dim=-1).nonzero()
                if len(nonzero):
                    return int(nonzero[0, 0])
            return value
    raise DFlashError("the verifier's config has no pad_token_id or eos_token_id to use as the mask token; set "
                      "dflash.mask_token_id")
