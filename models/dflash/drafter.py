"""The DFlash drafter (`DFlashDrafter`): N Qwen3-shaped layers that draft a whole block in one forward, conditioned on
the outputs of chosen verifier layers. Its parameters and its `forward` are those of z-lab's `DFlashDraftModel`
(`dflash` 0.1.0): a state dict loads into either unchanged (tests/e2e/test_dflash_reference.py checks it).

Parameters: layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight, norm.weight,
fc.weight [H, n*H], hidden_norm.weight. No embedding and no lm_head: the verifier's are read (frozen, shared).
With `draft_vocab_size` set (not the reference's), the drafter also has its own lm_head.weight [Vd, H], trained, and
the buffers d2t [Vd] (target id - draft id) and t2d [V] (bool) of EAGLE-3's draft vocabulary. DSpark
(`markov_rank` r): markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [Vd, r], and with the
confidence head confidence_head.proj.weight [1, H (+ r)], confidence_head.proj.bias [1] (models/dflash/dspark.py).

API for the spec-decode engine (shapes: B rows, n context tokens, N = block_size, H hidden, L = len(target layers)):

  drafter.feature_layers -> list[int]
      The verifier layer *inputs* (HF hidden_states[i]) to capture: target_layer_ids + 1, i.e. the outputs of the
      target layers. Concatenate them in this order on the last dim: target_hidden (B, n, L*H).
  drafter.context_kv(target_hidden (B, n, L*H), position_ids (B, n)) -> [(k, v)] * num_layers
      The context's keys/values for every drafter layer, k/v (B, nkv, n, d), RoPE applied at position_ids. They
      depend on nothing else, so an engine computes them once per committed token and keeps them in its own KV
      cache (slot = position, as the EAGLE drafter does): append what the verifier accepted (the anchor and the
      accepted drafts of a step, whose features the verification forward produced), never the rejected ones.
  drafter.block(noise_embedding (B, N, H), position_ids (B, N), attend) -> hidden (B, N, H), final-normed
      The block: row b is [anchor, MASK x (N-1)] at positions p_b .. p_b+N-1, where p_b is the anchor's position
      (the last committed token, whose own feature is not yet in the context). noise_embedding =
      drafter.embed(ids) (the verifier's embedding rows). attend(layer_idx, q (B, nh, N, d), k, v (B, nkv, N, d))
      is the engine's: it puts the layer's cached context keys/values (slots < p_b, nothing else) in front of the
      block's own k/v and returns the attention output (B, N, nh*d) (bidirectional over context + block for
      full_attention layers; `drafter.attention_mask` builds that mask for a cache of slots = positions).
  drafter.logits(hidden) -> (B, N, V): the verifier's lm_head, or the drafter's own over its draft vocabulary
      spread into the verifier's (-inf at tokens outside it); block position j >= 1 proposes the token at p_b + j.
  drafter.draft_block(hidden (B, K, H), root (B,), pick) -> (tokens (B, K), logits (B, K, V))
      The drafts of block positions 1..K: argmax/draw per position from drafter.logits, or for DSpark left to right
      with the Markov bias of the previous token (root first); pick(logits (B, V), k) -> (B,) ids.
  drafter.confidence(hidden (..., H), prev_ids (...,)) -> (...,) DSpark's acceptance probability of each draft.
  drafter.attention_mask(context_lengths (B,), num_slots, position_ids (B, N)) -> (B, 1, N, num_slots + N) bool
      For keys laid out [cache slots 0..num_slots-1 | block]: slot s visible iff s < context_lengths[b] (and
      within the window, causal, for sliding layers: pass layer_idx).
  DFlashCache: a simple per-layer cache with the reference's interface (update / get_seq_length / crop), for
      `forward` and reference-style loops; `forward(..., past_key_values=cache)` appends context *and* block, so
      crop the block back off afterwards (cache.crop(-N)), as the reference's generate loop does.

  forward(position_ids (B, n+N), attention_mask=None, noise_embedding (B, N, H), target_hidden (B, n, L*H),
          past_key_values=None, use_cache=False) -> (B, N, H)
      z-lab's contract: the context's n positions then the block's N; keys [cache | context | block].

Training (`training_loss`): many anchored blocks per row in one forward over the whole row's context; the anchors,
block inputs, targets and mask are models/dflash/blocks.py, the weighted loss models/dflash/losses.py.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftheads.data.documents import same_document
from draftheads.models.dflash.blocks import (anchored_block_mask, anchored_context_ranges, block_inputs,
                                             block_targets, own_block_mask, sample_anchors)
from draftheads.models.dflash.config import DFlashConfig, DFlashError, DFlashWarning
from draftheads.models.dflash.layer import Attend, DecoderLayer, RMSNorm, rope_cos_sin
from draftheads.models.dflash.dspark import ConfidenceHead, MarkovHead, markov_chain
from draftheads.models.dflash.losses import confidence_loss, dflash_loss, dpace_loss, token_overlap
from draftheads.models.placed import Placed, embedding_rows
from draftheads.models.eagle.layer import norm_scale, normal_init
from draftheads.models.eagle.metrics import EagleOutput, step_counts
from draftheads.models.eagle.vocab import draft_to_target, maps_problem, select_draft_vocab, target_to_draft


class DFlashCache:
    """Per-layer keys/values, concatenated as they come (the reference's DynamicCache interface, one length for
    every row): update(k, v, layer_idx) -> the layer's whole k/v; get_seq_length(); crop(-n) drops the last n."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, cache_kwargs=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[2]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove entries (a negative count, HF's convention; 0 does nothing)."""
        if tokens_to_remove > 0:
            raise DFlashError(f"DFlashCache.crop({tokens_to_remove}): expected a negative count of entries to drop")
        if tokens_to_remove == 0:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :keep], self.values[i][:, :, :keep]

    def crop_to(self, length: int) -> None:
        """Keep the first `length` entries (rejected tokens' entries go)."""
        self.crop(min(length - self.get_seq_length(), 0))


class _Held:
    """The verifier's embedding and lm_head: read by the drafter, not its parameters (untouched by .to(dtype))."""

    def __init__(self, **modules):
        self.__dict__.update(modules)


class DFlashDrafter(Placed, nn.Module):
    """See the module docstring. Build with `build_drafter(verifier, cfg)` (or `DFlashDrafter(resolved_cfg)` for a
    bare model, then `attach(verifier)` to read its embedding and lm_head)."""

    placed_by = "fc"
    variant = "dflash"
    """The dflash.variant this class builds (a subclass builds another)."""

    def __init__(self, cfg: DFlashConfig, verifier=None, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None):
        super().__init__()
        if not cfg.resolved:
            raise DFlashError("DFlashDrafter needs a resolved config (cfg.resolve(verifier.config))")
        if cfg.variant != self.variant:
            raise DFlashError(f"dflash.variant={cfg.variant}: {type(self).__name__} builds variant {self.variant}; "
                              "build it with draftheads.models.dflash2.build_drafter")
        self.cfg = cfg
        H = cfg.hidden_size
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.draft_vocab_size is not None:  # its own lm_head over a draft vocabulary (maps: placeholders until
            V, Vd = cfg.vocab_size, cfg.draft_vocab_size  # given, or loaded with the state dict)
            if d2t is None:
                d2t, t2d = select_draft_vocab(torch.zeros(V, dtype=torch.long), Vd)
            problem = maps_problem(d2t, t2d, V) or (None if d2t.numel() == Vd else
                                                    f"d2t has {d2t.numel()} entries; draft_vocab_size is {Vd}")
            if problem:
                raise DFlashError(problem)
            self.lm_head = nn.Linear(H, Vd, bias=False)
            # Saved only for a pruned vocabulary: over the whole one they are the identity, and vLLM refuses a d2t
            # there (its drafter then has no draft_id_to_target_id to load it into).
            self.register_buffer("d2t", d2t.clone(), persistent=Vd < V)
            self.register_buffer("t2d", t2d.clone(), persistent=Vd < V)
        if cfg.dspark:  # DSpark: the Markov head (and the confidence head), vLLM's names
            r = cfg.markov_rank
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, r)
            if cfg.has_confidence_head:
                self.confidence_head = ConfidenceHead(H + (r if cfg.confidence_with_markov else 0),
                                                      cfg.confidence_with_markov)
        self._held = _Held(embed_tokens=None, lm_head=None)
        if verifier is not None:
            self.attach(verifier)

    def attach(self, verifier) -> "DFlashDrafter":
        """Read `verifier`'s embedding and lm_head (after checking that they fit this drafter)."""
        if (verifier.hidden_size, verifier.vocab_size, verifier.num_layers) != (
                self.cfg.hidden_size, self.cfg.vocab_size, self.cfg.num_target_layers):
            raise DFlashError(f"verifier {verifier.name!r} has hidden_size {verifier.hidden_size}, vocab "
                              f"{verifier.vocab_size}, {verifier.num_layers} layers; this drafter was built for "
                              f"{self.cfg.hidden_size}, {self.cfg.vocab_size}, {self.cfg.num_target_layers}")
        self._held = _Held(embed_tokens=verifier.embed_tokens, lm_head=verifier.lm_head)
        return self

    # ---- handles -------------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def own_lm_head(self) -> bool:
        """True when the drafter has its own lm_head over a draft vocabulary (`draft_vocab_size`)."""
        return self.cfg.draft_vocab_size is not None

    def draft_token_ids(self) -> torch.Tensor:
        """(Vd,) the verifier token id of each draft-vocabulary id (own lm_head only)."""
        return draft_to_target(torch.arange(self.d2t.numel(), device=self.d2t.device), self.d2t)

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.cfg.target_layer_ids)

    @property
    def feature_layers(self) -> list[int]:
        """Verifier layer inputs to capture (HF hidden_states[i]): the outputs of the target layers."""
        return [i + 1 for i in self.cfg.target_layer_ids]

    @property
    def num_kv_heads(self) -> int:
        return self.cfg.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim

    def _need_verifier(self):
        if self._held.embed_tokens is None:
            raise DFlashError("this DFlash drafter reads the verifier's embedding and lm_head: attach(verifier) first")
        return self._held

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, N) -> (B, N, H): the verifier's embedding rows (frozen), in the drafter's dtype."""
        with torch.no_grad():
            return embedding_rows(self._need_verifier().embed_tokens.weight, input_ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V): the verifier's lm_head, or the drafter's own (draft_logits) placed at its tokens'
        verifier ids, -inf elsewhere (as vLLM spreads a pruned vocabulary), so argmax and softmax need no map."""
        if self.own_lm_head:
            draft = self.draft_logits(hidden)
            out = draft.new_full((*draft.shape[:-1], self.cfg.vocab_size), float("-inf"))
            return out.index_copy(-1, self.draft_token_ids(), draft)
        lm_head = self._need_verifier().lm_head
        return lm_head(hidden.to(lm_head.weight.dtype))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., Vd): the drafter's own lm_head (own lm_head only)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def _base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., Vd): logits in the drafter's own vocabulary (the verifier's when it shares its head)."""
        if self.own_lm_head:
            return self.draft_logits(hidden)
        lm_head = self._need_verifier().lm_head
        return lm_head(hidden.to(lm_head.weight.dtype))

    def _spread(self, draft: torch.Tensor) -> torch.Tensor:
        """(..., Vd) -> (..., V): a draft vocabulary's logits at its tokens' verifier ids, -inf elsewhere."""
        if not self.own_lm_head:
            return draft
        out = draft.new_full((*draft.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy(-1, self.draft_token_ids(), draft)

    def draft_block(self, hidden: torch.Tensor, root: torch.Tensor,
                    pick) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts of block positions 1..K from their final-normed hidden (B, K, H): pick(logits (B, V), k) -> (B,)
        verifier ids. DFlash: every position from its own logits; DSpark: left to right, position k's logits biased
        by the Markov head from the token before it (root (B,) the anchor, then the previous draft). Returns
        (tokens (B, K), logits (B, K, V): the distributions the drafts came from)."""
        if not self.cfg.dspark:
            logits = self.logits(hidden)
            return torch.stack([pick(logits[:, k], k) for k in range(logits.shape[1])], 1), logits
        tokens, logits, _ = markov_chain(self._base_logits(hidden), root, self.markov_head, pick, self._spread)
        return tokens, logits

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence head: (..., H), the previous tokens (...,) -> (...,) acceptance probabilities."""
        if not hasattr(self, "confidence_head"):
            raise DFlashError("this drafter has no confidence head (dflash.confidence_head)")
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev_ids)))

    # ---- the computation -----------------------------------------------------------------------------------------
    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(B, n, L*H) concatenated target-layer outputs -> (B, n, H): hidden_norm(fc(.)), the fused context."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def _rope(self, position_ids: torch.Tensor, like: torch.Tensor):
        return rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, like.dtype)

    def context_kv(self, target_hidden: torch.Tensor, position_ids: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys/values (B, nkv, n, d) of the context at position_ids (B, n), one pair per drafter layer."""
        ctx = self.project(target_hidden)
        cos, sin = self._rope(position_ids.expand(ctx.shape[0], -1), ctx)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block(self, noise_embedding: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layers over a block (B, N, H) at position_ids (B, N), attention by `attend`; final-normed output.
        With dflash.checkpoint_layers in training, each layer (and its `attend`) runs again in the backward."""
        hidden = noise_embedding.to(self.dtype)
        cos, sin = self._rope(position_ids.expand(hidden.shape[0], -1), hidden)
        checkpointed = self.cfg.checkpoint_layers and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if checkpointed:  # only the layer's input kept; the layer runs again in the backward
                hidden = checkpoint(layer, hidden, cos, sin, attend, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, attend)
        return self.norm(hidden)

    def forward(self, position_ids: torch.Tensor, attention_mask=None, noise_embedding: torch.Tensor | None = None,
                target_hidden: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **kwargs) -> torch.Tensor:
        """z-lab's contract: position_ids (B, n+N) of the context then the block; keys are [past | context | block]
        (past: whatever `past_key_values.update` returns, which this call extends by context and block).
        attention_mask: None (full_attention layers see every key; sliding layers causal within the window, by key
        index), a bool/additive tensor (B, 1, N, S) for every layer, or a dict {layer_type: tensor}.
        Returns the final-normed hidden states of the block (B, N, H)."""
        if noise_embedding is None:
            raise DFlashError("DFlashDrafter.forward needs noise_embedding (the embedded block)")
        N = noise_embedding.shape[1]
        n = 0 if target_hidden is None else target_hidden.shape[1]
        if position_ids.shape[-1] != n + N:
            raise DFlashError(f"position_ids has {position_ids.shape[-1]} positions; expected {n} context + {N} block")
        ctx_kv = self.context_kv(target_hidden, position_ids[:, :n]) if n else None

        def attend(i, q, k, v):
            if ctx_kv is not None:
                k = torch.cat([ctx_kv[i][0], k], dim=2)
                v = torch.cat([ctx_kv[i][1], v], dim=2)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, i)
            attn = self.layers[i].self_attn
            mask = attention_mask.get(attn.layer_type) if isinstance(attention_mask, dict) else attention_mask
            if mask is None and attn.sliding_window is not None:
                mask = index_mask(N, k.shape[2], attn.sliding_window, q.device)
            return attn.attend(q, k, v, mask)

        return self.block(noise_embedding, position_ids[:, n:], attend)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """The reference's name: logits of `output_head` (the verifier's lm_head) over hidden."""
        return output_head(hidden)

    def attention_mask(self, context_lengths: torch.Tensor, num_slots: int, position_ids: torch.Tensor,
                       layer_idx: int = 0) -> torch.Tensor:
        """(B, 1, N, num_slots + N) bool for keys [cache slots 0..num_slots-1 (slot = position) | block]: slot s is
        visible iff s < context_lengths[b]; the block sees itself (full layers) or causally within the window
        (sliding layers), with the window also applied to the cache slots."""
        dev = position_ids.device
        B, N = position_ids.shape
        slots = torch.arange(num_slots, device=dev)
        ctx = slots[None, None, :] < context_lengths.to(dev)[:, None, None]  # (B, 1, S)
        ctx = ctx.expand(B, N, num_slots)
        own = torch.ones(N, N, dtype=torch.bool, device=dev)
        window = self.layers[layer_idx].self_attn.sliding_window
        if window is not None:
            ctx = ctx & (position_ids[:, :, None] - slots[None, None, :] < window)
            i = torch.arange(N, device=dev)
            own = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        return torch.cat([ctx, own.expand(B, N, N)], dim=-1)[:, None]

    # ---- training ------------------------------------------------------------------------------------------------
    def anchored_hidden(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, anchors: torch.Tensor,
                        valid: torch.Tensor, position_ids: torch.Tensor | None = None,
                        attention: Literal["ranges", "dense"] = "ranges") -> torch.Tensor:
        """Every anchored block of every row in one forward: input_ids (B, T), target_hidden (B, T, L*H) (the
        whole row's context), anchors / valid (B, A). Block j of row b reads [x_a, MASK x (N-1)] at positions
        a .. a+N-1 (a = anchors[b, j]), sees the context strictly before a and its own block, no other block.
        position_ids (B, T) of packed rows (restarting per document): the context at its document positions, a
        block at its anchor's, attending inside the anchor's document only (models/dflash/blocks.py).
        Returns the final-normed hidden (B, A, N, H).

        attention "ranges" (training's, on every device): each block token scores its context range and its own
        block only (`Attention.attend_ranges`), in query chunks whose scores the backward recomputes: memory
        linear in T, nothing (A*N, T) kept, not even a mask. "dense": SDPA over [context | every block] with the
        (B, 1, A*N, T + A*N) anchored mask, most of it hidden: the reference, equal to float rounding."""
        B, T = input_ids.shape
        if attention not in ("ranges", "dense"):
            raise DFlashError(f"anchored_hidden: attention={attention!r}; expected 'ranges' or 'dense'")
        A, N = anchors.shape[1], self.cfg.block_size
        ids, positions = block_inputs(input_ids, anchors, valid, N, self.cfg.mask_token_id,
                                      position_ids)  # (B, A*N) each
        context_positions = (torch.arange(T, device=input_ids.device).expand(B, T) if position_ids is None
                             else position_ids.long())
        if attention == "dense":
            masks = {kind: anchored_block_mask(anchors, valid, T, N, window, position_ids)[:, None]
                     for kind, window in self._mask_kinds()}
            hidden = self(torch.cat([context_positions, positions], 1), masks, self.embed(ids), target_hidden)
            return hidden.view(B, A, N, -1)
        ranges = {kind: (*anchored_context_ranges(anchors, valid, T, N, window, position_ids),
                         own_block_mask(N, window, input_ids.device))
                  for kind, window in self._mask_kinds()}
        ctx_kv = self.context_kv(target_hidden, context_positions)

        def attend(i, q, k, v):
            attn = self.layers[i].self_attn
            return attn.attend_ranges(q, ctx_kv[i], k, v, *ranges[attn.layer_type])

        return self.block(self.embed(ids), positions, attend).view(B, A, N, -1)

    def _mask_kinds(self):
        kinds = {}
        for layer in self.layers:
            kinds[layer.self_attn.layer_type] = layer.self_attn.sliding_window
        return kinds.items()

    def training_loss(self, input_ids: torch.Tensor, features, loss_mask: torch.Tensor,
                      anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
                      generator: torch.Generator | None = None,
                      position_ids: torch.Tensor | None = None) -> EagleOutput:
        """Loss and counts for one batch: input_ids (B, T), `VerifierFeatures` with the `feature_layers` inputs,
        loss_mask (B, T); anchors: (anchors, valid) (B, A), else sampled (`cfg.num_anchors` per row) among the
        loss-masked positions whose next token is in their document; position_ids (B, T): packed rows' positions
        (restarting per document; the features were computed with them), so no block reads or predicts across a
        document boundary.

        Block position k = 1..N-1 predicts the token at anchor + k (the data token, or the verifier's greedy token
        with cfg.targets = verifier; cfg.loss = kl: the verifier's whole distribution there), trained where it exists
        and loss_mask is 1, with weight exp(-(k-1)/gamma), normalised by the sum of the weights (a weighted mean);
        cfg.loss = dpace: D-PACE's weights from the drafter's own confidence, averaged over blocks (`dpace_loss`).
        The lm_head's logits are never all held at once (models/linear_loss.py). Counts: block position k is right
        when its argmax equals the verifier's greedy token at anchor + k, scored where loss_mask is 1 (`StepCounts`
        over K = N-1 positions)."""
        cfg = self.cfg
        N = cfg.block_size
        B, T = input_ids.shape
        if len(features.layers) != len(cfg.target_layer_ids):
            raise DFlashError(f"DFlash needs the verifier features of layers {self.feature_layers} (the outputs of "
                              f"target layers {cfg.target_layer_ids}); got {len(features.layers)} layer tensors")
        target_hidden = torch.cat(features.layers, dim=-1)  # (B, T, L*H)
        if anchors is None:
            candidates = loss_mask if position_ids is None else loss_mask * same_document(position_ids, 1)
            anchors = sample_anchors(candidates, cfg.num_anchors, generator=generator)
        anchors, valid = anchors
        hidden = self.anchored_hidden(input_ids, target_hidden, anchors, valid, position_ids)[:, :, 1:]
        data_targets, trained = block_targets(input_ids, loss_mask, anchors, valid, N, position_ids)  # (B, A, N-1)
        index = anchors[:, :, None] + torch.arange(N - 1, device=anchors.device)  # (B, A, N-1): anchor + k
        index = index.clamp(max=T - 1)  # past the row: not trained (block_targets), scored at the last position
        greedy_targets = self._greedy_tokens(features, index.view(B, -1)).view_as(index)
        targets = data_targets if cfg.targets == "data" else greedy_targets
        verifier_ids = targets  # (B, A, N-1) verifier ids, before an own lm_head maps them to draft ids
        teacher = (lambda k: self._teacher_at(features, anchors, k)) if cfg.loss == "kl" else None
        lm_weight, trained_here = self._need_verifier().lm_head.weight, trained
        if self.own_lm_head:  # targets as draft ids; one outside the draft vocabulary is not trained (EAGLE-3's
            lm_weight = self.lm_head.weight  # skip_out_of_draft) but still scored, as a miss
            targets = target_to_draft(targets, self.t2d)
            trained_here = trained & (targets >= 0)
            targets = targets.clamp(min=0)
            if teacher is not None:  # the verifier's distribution over the draft vocabulary's columns
                columns = self.draft_token_ids()
                teacher = (lambda k: self._teacher_at(features, anchors, k)[..., columns])
        markov = embed = None
        if cfg.dspark:  # teacher-forced previous token: the anchor, then the targets before each position
            anchor_ids = input_ids.gather(1, anchors.clamp(max=T - 1))  # (B, A)
            prev = torch.cat([anchor_ids[:, :, None], verifier_ids[:, :, :-1]], -1)  # (B, A, N-1)
            embed = self.markov_head.embed(prev)  # (B, A, N-1, r)
            markov = (embed, self.markov_head.markov_w2.weight)
        if cfg.loss == "dpace":  # an out-of-vocabulary target stays on the acceptance chain: confidence 0 there
            loss, step_losses, drafted = dpace_loss(hidden, lm_weight, targets, trained_here, cfg.loss_alpha, trained,
                                                    markov=markov)
        else:
            loss, step_losses, drafted = dflash_loss(hidden, lm_weight, targets, trained_here, cfg.loss_gamma,
                                                     teacher, markov=markov)
        if cfg.dspark and cfg.has_confidence_head:
            loss = loss + cfg.confidence_weight * self._confidence_loss(hidden, embed, lm_weight, features, anchors,
                                                                        trained)
        with torch.no_grad():  # the loss's own argmaxes: a draft id with an own lm_head, its verifier id here
            drafted = self.draft_token_ids()[drafted] if self.own_lm_head else drafted
            correct = (drafted == greedy_targets).permute(2, 0, 1)  # (N-1, B, A)
            counts = step_counts(correct, trained.permute(2, 0, 1))  # scored where loss_mask is 1
        return EagleOutput(loss=loss, step_losses=step_losses, counts=counts)

    def _confidence_loss(self, hidden: torch.Tensor, embed: torch.Tensor, lm_weight: torch.Tensor, features,
                         anchors: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence head against the overlap of the drafter's (Markov-biased) distribution with the
        verifier's at each block position (`token_overlap`, no gradient), BCE weighted as the token loss
        (`confidence_loss`). hidden (B, A, K, H), embed (B, A, K, r)."""
        B, A, K, H = hidden.shape
        columns = self.draft_token_ids() if self.own_lm_head else None
        w2 = self.markov_head.markov_w2.weight.detach()
        target = torch.stack([
            token_overlap(hidden[:, :, k].reshape(-1, H).detach().to(lm_weight.dtype), lm_weight.detach(),
                          self._teacher_at(features, anchors, k).reshape(B * A, -1),
                          (embed[:, :, k].reshape(B * A, -1).detach(), w2), columns).view(B, A)
            for k in range(K)], -1)  # (B, A, K)
        logits = self.confidence_head(hidden, embed)  # (B, A, K)
        return confidence_loss(logits, target, trained, self.cfg.loss_gamma)

    @torch.no_grad()
    def _greedy_tokens(self, features, index: torch.Tensor) -> torch.Tensor:
        """(B, M): the verifier's greedy next token at positions index (B, M), from the cache's argmax, features.logits
        or lm_head(final), each distinct position once (the blocks of nearby anchors overlap) and a few positions'
        logits at a time."""
        if features.argmax is not None:
            return features.argmax.gather(1, index)
        if features.logits is not None:
            return features.logits.argmax(-1).gather(1, index)
        final = features.final  # (B, T, H)
        B, T, _ = final.shape
        flat = (index + T * torch.arange(B, device=index.device)[:, None]).reshape(-1)  # into (B*T,)
        positions, where = flat.unique(return_inverse=True)
        rows = final.reshape(B * T, -1)
        lm_head = self._need_verifier().lm_head
        step = max(1, (1 << 26) // lm_head.weight.shape[0])  # (step, V) fp32 logits: 256 MB at most
        tokens = torch.cat([lm_head(rows[positions[i:i + step]]).argmax(-1)
                            for i in range(0, positions.shape[0], step)])
        return tokens[where].view_as(index)

    @torch.no_grad()
    def _teacher_at(self, features, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """(B, A, V): the verifier's logits for block position k + 1, i.e. its next-token logits at anchor + k
        (clamped inside the row; positions past it are not trained), from features.logits or lm_head(final)."""
        final = features.final  # (B, T, H)
        index = (anchors + k).clamp(max=final.shape[1] - 1)  # (B, A)
        if features.logits is not None:
            return features.logits.gather(1, index[:, :, None].expand(-1, -1, features.logits.shape[-1]))
        h = final.gather(1, index[:, :, None].expand(-1, -1, final.shape[-1]))  # (B, A, H)
        return self._need_verifier().lm_head(h)


def index_mask(num_queries: int, num_keys: int, window: int, device) -> torch.Tensor:
    """(1, 1, Nq, Nk) causal sliding-window mask by key index, the queries being the last Nq keys (the reference's
    rule for sliding layers without an explicit mask)."""
    q = num_keys - num_queries + torch.arange(num_queries, device=device)[:, None]
    k = torch.arange(num_keys, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]


def blind_positions_warning(cfg: DFlashConfig, mask_embedding: torch.Tensor) -> str | None:
    """One line when block positions see only mask tokens in the first layer (a sliding first layer whose window is
    narrower than the block: positions window .. block_size-1), else None; `mask_embedding` (H,) is the verifier's
    embedding row of the mask token. Such a position's first-layer output is the same vector for every one of them
    whatever the weights (they attend to mask tokens only), and with an all-zero row (HF zeroes the pad token's,
    the default mask token) exactly zero, so the drafter proposes one token at all of them
    (docs/train-dflash.md#positions-past-the-window)."""
    if cfg.layer_type(0) != "sliding_attention" or cfg.sliding_window is None \
            or cfg.sliding_window >= cfg.block_size:
        return None
    W, N = cfg.sliding_window, cfg.block_size
    zero = not bool(mask_embedding.detach().ne(0).any())
    why = (f"the mask token's embedding row (dflash.mask_token_id={cfg.mask_token_id}) is all zeros, so their "
           "first-layer output is exactly zero and they propose one and the same token"
           if zero else "their first-layer output is one and the same vector")
    return (f"dflash.block_size={N} with a first layer that attends within a window of {W}: block positions "
            f"{W}..{N - 1} see only mask tokens there, and {why}; expect them to accept almost nothing. Set "
            f"dflash.sliding_window to at least {N}, or dflash.block_size to {W}")


def zero_mask_warning(cfg: DFlashConfig, mask_embedding: torch.Tensor) -> str | None:
    """One line when the mask token's embedding row is all zeros (only a mask_token_id set by hand: the default
    passes over such a token), else None."""
    if bool(mask_embedding.detach().ne(0).any()):
        return None
    return (f"dflash.mask_token_id={cfg.mask_token_id}: the verifier embeds this token as all zeros, so the first "
            "layer's queries, keys and values are zero at every mask position and its attention there is a fixed "
            "average; choose a token whose embedding row is not zero (leave it null for one)")


def build_drafter(verifier, cfg: DFlashConfig, dtype: torch.dtype | None = None,
                  token_counts: torch.Tensor | None = None, drafter_class: type | None = None) -> DFlashDrafter:
    """A fresh drafter for `verifier` (its config resolved from the verifier's; fp32 unless `dtype`), on the
    verifier's device, reading the verifier's embedding and lm_head. Its final norm starts as the verifier's (the
    per-channel scale the verifier's lm_head is used to reading), as EAGLE-3's does. With `draft_vocab_size` set,
    its own lm_head starts as the verifier's rows of the draft vocabulary: the `draft_vocab_size` tokens most
    frequent in `token_counts` ((V,) from models.eagle.count_tokens over the training data; needed unless the
    draft vocabulary is the whole vocabulary). `drafter_class`: a subclass for another dflash.variant
    (draftheads.models.dflash2.build_drafter picks it)."""
    resolved = cfg.resolve(verifier.config, verifier.embed_tokens.weight)
    verifier.check_layer_ids([i + 1 for i in resolved.target_layer_ids], key="dflash.target_layer_ids (+1)")
    d2t = t2d = None
    if resolved.draft_vocab_size is not None:
        V, Vd = resolved.vocab_size, resolved.draft_vocab_size
        if token_counts is None and Vd < V:
            raise DFlashError(f"dflash.draft_vocab_size={Vd} < vocab {V}: pass token counts of the training data "
                              "(build_drafter(..., token_counts=count_tokens(...))) to choose the draft vocabulary")
        d2t, t2d = select_draft_vocab(torch.zeros(V, dtype=torch.long) if token_counts is None else token_counts, Vd)
    drafter = (drafter_class or DFlashDrafter)(resolved, verifier, d2t=d2t, t2d=t2d)
    mask_row = verifier.embed_tokens.weight[resolved.mask_token_id]
    warning = blind_positions_warning(resolved, mask_row) or zero_mask_warning(resolved, mask_row)
    if warning:
        warnings.warn(warning, DFlashWarning, stacklevel=2)
    with torch.no_grad():
        drafter.norm.weight.copy_(norm_scale(verifier.norm, resolved.hidden_size))
        if resolved.init_std is not None:
            normal_init(drafter.modules(), resolved.init_std)
        if hasattr(drafter, "reset_convolutions"):  # after init_std: DFlash2's convolutions start as the identity
            drafter.reset_convolutions()
        if drafter.own_lm_head:  # after init_std: the head starts as the verifier's rows, whatever the layers do
            drafter.lm_head.weight.copy_(verifier.lm_head.weight.detach().float().cpu()[drafter.draft_token_ids()])
        if resolved.init_layers is not None:
            for layer, source in zip(drafter.layers, resolved.init_layers):
                copy_verifier_layer(layer, verifier.layers[source], f"dflash.init_layers: verifier layer {source}")
    return drafter.to(device=verifier.device, dtype=dtype or torch.float32)


#: Drafter layer parameters that a verifier layer must have (same name, same shape) to start it.
_COPIED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
#: Copied where the verifier's layer has them (Qwen2's q/k/v biases).
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")


def copy_verifier_layer(layer: DecoderLayer, source: nn.Module, where: str) -> None:
    """Start a drafter layer from a verifier decoder layer: its projections and MLP as they are, its norms as the
    per-channel scale they apply (any family's convention), q/k norms only where the verifier has them. A weight
    the verifier's layer lacks or holds in another shape is refused naming `where` and the key."""
    theirs = dict(source.named_parameters())
    ours = dict(layer.named_parameters())
    for key in _COPIED:
        if key not in theirs or theirs[key].shape != ours[key].shape:
            got = "missing" if key not in theirs else f"shape {list(theirs[key].shape)}"
            raise DFlashError(f"{where}: {key} is {got}; the drafter's layer needs {list(ours[key].shape)} (set the "
                              "drafter's layer sizes to the verifier's, or dflash.init_layers=null)")
        ours[key].copy_(theirs[key].detach().float())
    modules = dict(source.named_modules())
    for key in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        module = modules.get(key)
        if module is None:
            if key in ("input_layernorm", "post_attention_layernorm"):
                raise DFlashError(f"{where}: has no {key}; expected a pre-norm decoder layer (Llama, Qwen, Mistral)")
            continue
        size = ours[f"{key}.weight"].numel()
        ours[f"{key}.weight"].copy_(norm_scale(module, size))
    for key in _BIASES:
        if key in theirs and key not in ours:
            raise DFlashError(f"{where}: has {key}; the drafter's layer has no biases (set dflash.attention_bias=true)")
        if key in ours:
            ours[key].copy_(theirs[key].detach().float() if key in theirs else torch.zeros_like(ours[key]))
