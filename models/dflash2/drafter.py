"""The DFlash2 drafter (`DFlash2Drafter`): the DFlash drafter (models/dflash/) whose layers wrap attention and MLP in
grouped dynamic convolutions (conv.py) and whose drafts are chosen by a candidate selector (selector.py). Everything
else (the context, the anchored blocks, the unary loss, the export's other weights) is DFlash's.

Parameters beyond DFlash's: layers.{i}.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight},
candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight} (vLLM's names).

The convolutions run along each block: in training the A blocks of a row sit side by side (block_size positions
each), in the engine one block of K + 1 (vLLM convolves its blocks of 1 + num_speculative_tokens the same way).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftheads.data.documents import same_document
from draftheads.models.dflash.blocks import block_targets, sample_anchors
from draftheads.models.dflash.config import DFlashConfig
from draftheads.models.dflash.drafter import DFlashDrafter, build_drafter as build_dflash
from draftheads.models.dflash.layer import Attend, DecoderLayer
from draftheads.models.dflash.losses import position_weights
from draftheads.models.dflash2.conv import GroupedConv
from draftheads.models.dflash2.selector import CandidateSelector, selector_loss
from draftheads.models.eagle.metrics import EagleOutput, step_counts


class DFlash2Layer(DecoderLayer):
    """A DFlash layer with a grouped dynamic convolution around its attention and one around its MLP:
    h = x + conv_a(o_proj(attn(conv_a(input_layernorm(x))))); out = h + conv_m(mlp(conv_m(post_norm(h)))), each
    pair's output side using the coefficients computed from its input side's input."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                block_len: int | None = None) -> torch.Tensor:
        attn = self.self_attn
        n = hidden.shape[1] if block_len is None else block_len
        x, delta = self.attention_conv.prepare(self.input_layernorm(hidden), n)
        q = attn.queries(x, cos, sin)
        k, v = attn.kv(x, cos, sin)
        h = hidden + self.attention_conv.finish(attn.o_proj(attend(attn.layer_idx, q, k, v)), delta, n)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h), n)
        return h + self.mlp_conv.finish(self.mlp(x), delta, n)


class DFlash2Drafter(DFlashDrafter):
    """See the module docstring; `build_drafter` builds one for dflash.variant dflash2."""

    variant = "dflash2"

    def __init__(self, cfg: DFlashConfig, verifier=None, d2t=None, t2d=None):
        super().__init__(cfg, verifier, d2t=d2t, t2d=t2d)
        self.layers = nn.ModuleList([DFlash2Layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                    cfg.selector_top_k)
        self._block_len: int | None = None  # training: the blocks' length while anchored_hidden runs
        self._hidden: torch.Tensor | None = None  # training: the last anchored_hidden, for the selector's loss

    def reset_convolutions(self) -> None:
        """Every convolution back to the identity (a fresh DFlash2 layer computes what a DFlash layer does)."""
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()

    def block(self, noise_embedding: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        """DFlash's `block`, the convolutions reading blocks of `block_size` positions side by side in training
        (anchored_hidden) and the whole input as one block otherwise (the engine's K + 1, z-lab's `forward`)."""
        hidden = noise_embedding.to(self.dtype)
        block_len = self._block_len or hidden.shape[1]
        cos, sin = self._rope(position_ids.expand(hidden.shape[0], -1), hidden)
        checkpointed = self.cfg.checkpoint_layers and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if checkpointed:
                hidden = checkpoint(layer, hidden, cos, sin, attend, block_len, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, attend, block_len)
        return self.norm(hidden)

    def anchored_hidden(self, *args, **kwargs) -> torch.Tensor:
        self._block_len = self.cfg.block_size
        try:
            self._hidden = super().anchored_hidden(*args, **kwargs)
        finally:
            self._block_len = None
        return self._hidden

    def selector_logits(self, hidden: torch.Tensor, anchors: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A block's candidate lattice, as vLLM computes it: hidden (B, K, H) at block positions 1..K, anchors (B,)
        -> candidates (B, K, C), unary logits (B, K, C) (the lm_head's top C, descending), edge scores
        (B, K, C, C)."""
        unary, candidates = self.logits(hidden).float().topk(self.cfg.selector_top_k, dim=-1)
        return candidates, unary, self.candidate_selector.edge_scores(unary, hidden, candidates, anchors)

    def training_loss(self, input_ids, features, loss_mask, anchors=None, generator=None, position_ids=None
                      ) -> EagleOutput:
        """DFlash's loss (`dflash.loss`) plus selector_loss_weight times the selector's teacher-forced loss
        (selector.py), weighted per block position exp(-(k-1)/gamma) whatever `loss` is; the counts are the
        selector's drafts (what the engine drafts) against the verifier's greedy tokens."""
        cfg = self.cfg
        N = cfg.block_size
        if anchors is None:
            candidates = loss_mask if position_ids is None else loss_mask * same_document(position_ids, 1)
            anchors = sample_anchors(candidates, cfg.num_anchors, generator=generator)
        out = super().training_loss(input_ids, features, loss_mask, anchors=anchors, position_ids=position_ids)
        hidden, self._hidden = self._hidden[:, :, 1:], None  # (B, A, N-1, H)
        anchors, valid = anchors
        B, T = input_ids.shape
        data_targets, trained = block_targets(input_ids, loss_mask, anchors, valid, N, position_ids)  # (B, A, N-1)
        index = (anchors[:, :, None] + torch.arange(N - 1, device=anchors.device)).clamp(max=T - 1)
        greedy = self._greedy_tokens(features, index.view(B, -1)).view_as(index)
        targets = data_targets if cfg.targets == "data" else greedy
        anchor_ids = input_ids.gather(1, anchors.clamp(max=T - 1))  # (B, A)
        predecessors = torch.cat([anchor_ids[:, :, None], targets[:, :, :-1]], -1)  # (B, A, N-1)
        loss, _, drafted = selector_loss(self.candidate_selector, hidden, self._need_verifier().lm_head.weight,
                                         targets, predecessors, trained, position_weights(N, cfg.loss_gamma))
        with torch.no_grad():
            counts = step_counts((drafted == greedy).permute(2, 0, 1), trained.permute(2, 0, 1))
        return EagleOutput(loss=out.loss + cfg.selector_loss_weight * loss, step_losses=out.step_losses,
                           counts=counts, parts={**out.parts, "selector_loss": loss.detach()})


def drafter_class(cfg: DFlashConfig) -> type[DFlashDrafter]:
    """The drafter class of `cfg.variant`: DFlashDrafter (dflash) or DFlash2Drafter (dflash2)."""
    return DFlash2Drafter if cfg.variant == "dflash2" else DFlashDrafter


def build_drafter(verifier, cfg: DFlashConfig, dtype: torch.dtype | None = None,
                  token_counts: torch.Tensor | None = None) -> DFlashDrafter:
    """`draftheads.models.dflash.build_drafter` with the class of `cfg.variant` (either variant)."""
    return build_dflash(verifier, cfg, dtype=dtype, token_counts=token_counts, drafter_class=drafter_class(cfg))
