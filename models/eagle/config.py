"""What an EAGLE drafter is: `EagleConfig` (the `eagle` section of a run config) and `EagleError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    norm_init: Literal["verifier", "ones"] = "verifier"
    """EAGLE-3 final norm at the start: the verifier's final norm (with init_from_verifier) or ones, as speculators
    starts it (its lm_head is the verifier's, its norm a fresh one)."""
    init_std: float | None = None
    """Initial weights of fc and the drafter layer's linear maps: None keeps PyTorch's default (Kaiming-uniform, std
    1/sqrt(3 fan_in)); a number draws them from normal(0, init_std), as transformers' `initializer_range` (0.02)
    does in speculators' and SpecForge's drafters."""
    skip_out_of_draft: bool = True
    """EAGLE-3: leave out of the loss the positions whose verifier argmax is outside the draft vocabulary (no draft
    can be accepted there); false trains them too, against the verifier's distribution renormalised over the draft
    vocabulary, as speculators and SpecForge do."""
    freeze_lm_head: bool = False
    """EAGLE-3: keep lm_head as initialised (the verifier's rows with init_from_verifier) instead of training it, as
    speculators does."""
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
    align_topk: int | None = None
    """EAGLE-3 token alignment (GRIFFIN's idea of token-alignable training): step k > 0 of a chain trains only where the
    verifier's argmax was among the drafter's top `align_topk` at every earlier step of that chain, the chains a
    decode would still be verifying (1: a chain at T = 0); null trains every step at every position. Training only:
    held-out losses are over every position, as without it."""
    fc_norm: bool = False
    """EAGLE 3.1: an RMS norm on each verifier layer's feature before fc (vLLM `fc_norm`)."""
    norm_output: bool = False
    """EAGLE 3.1: the hidden handed to the next draft step is the final norm's output, not the pre-norm one (vLLM
    `norm_output`)."""
    sliding_window: int | None = None
    """EAGLE-3: the drafter layer attends only to the last `sliding_window` positions, the query's own included (as
    vLLM and flash-attn count a window), in training (each TTT step by its own position) and at decode; written into
    the export as layer_types ["sliding_attention"] + sliding_window, which vLLM and the speculators library read.
    null: full attention."""
    checkpoint_layers: bool = False
    """EAGLE-3 training: keep only each TTT step's layer inputs and outputs and run its layer pass again in the
    backward (activation checkpointing): less memory, one more forward of the layer per step."""

    def __post_init__(self):
        if self.version not in (1, 3):
            raise EagleError(f"eagle.version={self.version!r}: expected 1 or 3")
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
            if len(self.layer_ids) != 3:
                raise EagleError(f"eagle.layer_ids={self.layer_ids}: expected exactly three layer ids")
            if min(self.layer_ids) < 0:
                raise EagleError(f"eagle.layer_ids={self.layer_ids}: expected layer ids >= 0 (the inputs of those "
                                 "verifier layers; 0 is the embedding's output)")
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
        if self.init_std is not None and not self.init_std > 0:
            raise EagleError(f"eagle.init_std={self.init_std}: expected a positive standard deviation or null")
        if self.norm_init not in ("verifier", "ones"):
            raise EagleError(f"eagle.norm_init={self.norm_init!r}: expected 'verifier' or 'ones'")
        if self.lk_eta < 0:
            raise EagleError(f"eagle.lk_eta={self.lk_eta}: expected >= 0")
        self.parallel_keep = tuple(float(x) for x in self.parallel_keep)
        if len(self.parallel_keep) != 2 or not all(0 < x <= 1 for x in self.parallel_keep):
            raise EagleError(f"eagle.parallel_keep={list(self.parallel_keep)}: expected [decay, floor], each in (0, 1]")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise EagleError(f"eagle.mask_token_id={self.mask_token_id}: expected a token id >= 0 or null")
        if self.align_topk is not None and self.align_topk < 1:
            raise EagleError(f"eagle.align_topk={self.align_topk}: expected a positive number of drafts or null")
        if self.align_topk is not None and self.version != 3:
            raise EagleError(f"eagle.align_topk={self.align_topk} is an EAGLE-3 option; eagle.version is "
                             f"{self.version}")
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or int(self.sliding_window) != self.sliding_window \
                    or self.sliding_window < 1:
                raise EagleError(f"eagle.sliding_window={self.sliding_window!r}: expected a whole number of positions "
                                 ">= 1, or null for full attention")
            self.sliding_window = int(self.sliding_window)
            if self.version != 3:
                raise EagleError(f"eagle.sliding_window={self.sliding_window} is an EAGLE-3 option; eagle.version is "
                                 f"{self.version}")
        for key in ("parallel", "fc_norm", "norm_output", "freeze_lm_head", "checkpoint_layers"):
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
