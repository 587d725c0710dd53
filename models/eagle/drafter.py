"""The EAGLE-1 and EAGLE-3 drafters (`EagleDrafter.step` is the one layer pass the trainer and the engine's
cached drafter share) and `build_drafter`."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftheads.data.documents import causal_document_mask, document_ids, is_packed, same_document
from draftheads.models.draft_losses import step_weights
from draftheads.models.eagle.config import EagleConfig, EagleError
from draftheads.models.eagle.layer import (
    OWN_LAYER_FAMILIES,
    _family,
    _Held,
    _layer_config,
    norm_scale,
    normal_init,
)
from draftheads.models.eagle.losses import (
    HeadLoss,
    add_uniform_noise,
    chunked_draft_targets,
    eagle1_loss,
    row_draft_targets,
)
from draftheads.models.eagle.metrics import EagleOutput, StepCounts, step_counts
from draftheads.models.placed import Placed, embedding_rows
from draftheads.models.eagle.ttt import ttt_attention
from draftheads.models.eagle.vocab import draft_to_target, maps_problem, select_draft_vocab
from draftheads.models.lean_layer import _autocast_dtype, cast_once, swiglu_mlp
from draftheads.models.linear_loss import matmul_dtype


class EagleDrafter(Placed, nn.Module):
    """The layer and attention both EAGLE versions share; see the module docstring for the inference API."""

    placed_by = "fc"

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
        if cfg.init_std is not None:
            normal_init((self.fc, *self.layers.modules()), cfg.init_std)
        self._held = _Held(embed_tokens=verifier.embed_tokens, lm_head=verifier.lm_head,
                           rotary_emb=rope_cls(self.layer_config))

    # ---- handles -------------------------------------------------------------------------------------------------
    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

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
            return embedding_rows(self.token_embedding, input_ids).to(self.dtype)

    # ---- the layer -----------------------------------------------------------------------------------------------
    def _layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) for token embeddings and hidden states (B, N, H)."""
        raise NotImplementedError

    def _qkv(self, x: torch.Tensor, position_ids: torch.Tensor):
        """q (B, nh, N, d), k and v (B, nkv, N, d); RoPE applied to q and k."""
        attn = self.layer.self_attn
        xq, xk, xv = cast_once(x, 3)  # under autocast one cast of x kept for the three backwards, not three
        return self._heads(attn.q_proj(xq), attn.k_proj(xk), attn.v_proj(xv), position_ids)

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        """q (B, N, nh*d), k, v (B, N, nkv*d) as projected -> q (B, nh, N, d), k, v (B, nkv, N, d), RoPE applied."""
        B, N, _ = q.shape
        q = q.view(B, N, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, N, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, N, -1, self.head_dim).transpose(1, 2)
        rope = self._held.rotary_emb
        if rope.inv_freq.device != v.device:
            rope.to(v.device)  # moved, never cast: angles in fp32, cos/sin returned in v's dtype
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
        return h + swiglu_mlp(layer.mlp, layer.post_attention_layernorm(h))  # the MLP keeps gate and up only

    # ---- inference API -------------------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
             embedded: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """One pass of the drafter layer over N new (token, hidden) pairs: the one computation that training (the
        TTT unroll), `forward` and the engine's cached drafter (draftheads.eval.drafters.eagle) all run.

        input_ids, position_ids (B, N); hidden (B, N, H) in the drafter's dtype. The cache is the caller's:
        `attend(q, k, v)` gets the new tokens' q (B, nh, N, d) and k, v (B, nkv, N, d), RoPE applied, stores k/v
        wherever it keeps them and returns the attention output over what it holds, heads merged (B, N, nh*d).
        embedded (EAGLE-3's unroll): (the embedding half of q, k, v already projected (B, S, (nh+2nkv)d), the rows
        (N,) of it these tokens read, the hidden half's weight ((nh+2nkv)d, H), its bias or None),
        `shared_embedding`'s; input_ids then unread.
        Returns the layer's output (B, N, H)."""
        if embedded is None:
            x, residual = self._layer_input(self.embed(input_ids), hidden)
            q, k, v = self._qkv(x, position_ids)
        else:
            q, k, v, residual = self._qkv_embedded(hidden, position_ids, *embedded)
        return self._block(attend(q, k, v), residual)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Run N new tokens against an optional cache; see the module docstring. Returns (out_hidden, (k, v))."""
        B, N = input_ids.shape
        past = 0 if past_key_value is None else past_key_value[0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past, past + N, device=input_ids.device).expand(B, N)
        if attention_mask is None and past:  # causal over the new tokens, the whole cache visible
            attention_mask = torch.ones(N, past + N, dtype=torch.bool, device=input_ids.device).tril(past)
        elif attention_mask is not None and attention_mask.shape[-2:] != (N, past + N):
            raise EagleError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                             f"(B, 1, {N}, {past + N}) for {N} new tokens after {past} cached ones")
        window = self.cfg.sliding_window
        if window is not None:  # the cache holds positions 0..past-1, then the new tokens at their position_ids
            key_pos = torch.cat([torch.arange(past, device=input_ids.device).expand(B, past), position_ids], 1)
            near = (position_ids[:, :, None] - key_pos[:, None, :] < window)[:, None]  # (B, 1, N, past+N)
            if attention_mask is None:
                attention_mask = torch.ones(N, past + N, dtype=torch.bool, device=input_ids.device).tril(past)
            attention_mask = (attention_mask & near if attention_mask.dtype == torch.bool
                              else attention_mask.masked_fill(~near, float("-inf")))
        kv = []

        def attend(q, k, v):  # the cache is this call's: the past keys/values, then the new ones
            if past_key_value is not None:
                k = torch.cat([past_key_value[0].to(k.dtype), k], dim=2)
                v = torch.cat([past_key_value[1].to(v.dtype), v], dim=2)
            kv.extend((k, v))
            return self._attend(q, k, v, attention_mask, causal=attention_mask is None)

        out = self.step(input_ids, hidden.to(self.dtype), position_ids, attend)
        return out, (kv[0], kv[1])

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def project_features(self, layer_feats) -> torch.Tensor:
        raise NotImplementedError

    # ---- training ------------------------------------------------------------------------------------------------
    def training_loss(self, input_ids: torch.Tensor, features, loss_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> EagleOutput:
        """Loss and counts for one batch: input_ids (B, T), `VerifierFeatures` of them, loss_mask (B, T);
        position_ids (B, T) of packed rows restart at 0 per document (data/documents.py): attention stays inside
        a document and a prediction is trained only when its target is in its position's document (the
        `trained_mask` rule)."""
        raise NotImplementedError

    @staticmethod
    def trained_mask(loss_mask: torch.Tensor, position_ids: torch.Tensor | None, k: int) -> torch.Tensor:
        """(B, T-2-k) bool: which stream positions t step k (EAGLE-1: k = 0) scores. Step k at t has read tokens
        t+1 .. t+1+k and predicts token t+2+k; it counts iff loss_mask[t+2+k] and, with position_ids, token t+2+k
        is in t's document (position_ids[t+2+k] == position_ids[t] + 2+k; every token it read lies between, so
        in that document too). A chain that runs into the next document is neither trained nor scored."""
        n = loss_mask.shape[1] - 2 - k
        scored = loss_mask[:, 2 + k:].bool()
        if position_ids is not None:
            scored = scored & same_document(position_ids, 2 + k)[:, :n]
        return scored

    @staticmethod
    def document_mask(position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """(B, 1, T, T) bool causal attention inside each document of packed rows; None when every row is one
        document (plain causal attention: the fast path)."""
        return causal_document_mask(position_ids) if is_packed(position_ids) else None

    def ttt_unroll(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                   steps: int | None = None, keep: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The training-time-test unroll: out_hidden (B, T, H) of each step, step k at stream position t having
        consumed (x_{t+1+k}, previous step's output) at position id t + k; `hidden` (B, T, H) is step 0's
        hidden input: EAGLE-3 h_t = fc(features), EAGLE-1 the verifier's final feature f_t. With position_ids of
        packed rows (restarting per document) every step attends inside its position's document only.

        keep: per step, the stream positions (M_k,) sorted, nested (each step's within the one before) whose outputs
        are still read, at that step or a later one; None (or keep[k] None): every position. Step k then computes
        those rows only, (B, M_k, H), against the whole step-0 prefix (`ttt_attention`'s `where`): a row's prompt
        and its last positions, which no later target reads, cost the later steps nothing. The unroll stops at the
        first step that keeps no position."""
        steps = self.cfg.ttt_steps if steps is None else steps
        B, T = input_ids.shape
        documents = document_ids(position_ids) if is_packed(position_ids) else None  # (B, T); None: one per row
        position_ids = self._default_positions(input_ids, position_ids)
        keys, values, outs = [], [], []
        checkpointed = self.cfg.checkpoint_layers and self.training and torch.is_grad_enabled()
        # EAGLE-3: the embedding half of q/k/v once for all steps; not under checkpointing, which keeps a step's inputs
        # only (the shared projection and its weight would be kept beside them)
        shared = None if checkpointed else self.shared_embedding(input_ids, steps)
        at = None  # the positions of `hidden`'s rows and of the chain's keys (None: the whole row)
        for k in range(steps):
            where = None if keep is None or k == 0 else keep[k]
            if where is not None and where.numel() == 0:
                break
            ids_k, hidden = self._step_inputs(input_ids, hidden, k)
            ids_k, pos_k = _rows(ids_k, None, where, 1), _rows(position_ids + k, None, where, 1)
            hidden = _rows(hidden, None if hidden.shape[1] == T else at, where, 1)  # P-EAGLE's mask rows: whole
            keys = [keys[0], *(_rows(x, at, where, 2) for x in keys[1:])] if keys else keys
            values = [values[0], *(_rows(x, at, where, 2) for x in values[1:])] if values else values
            embedded = ()  # step k at stream position t reads token x_{t+1+k}: the shared row t + k
            if shared is not None and (not self.parallel or k == 0):
                rows = torch.arange(k, T + k, device=input_ids.device) if where is None else where + k
                embedded = (shared[0], rows, *shared[1:])
            args = (ids_k, hidden, pos_k, documents, tuple(keys), tuple(values), where, *embedded)
            if checkpointed:  # keep the step's inputs and outputs only; its layer pass runs again in the backward
                hidden, kk, vv = checkpoint(self._ttt_step, *args, use_reentrant=False)
            else:
                hidden, kk, vv = self._ttt_step(*args)
            keys.append(kk)
            values.append(vv)
            outs.append(hidden)
            at = where
        return outs

    def _ttt_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                  documents: torch.Tensor | None, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
                  where: torch.Tensor | None = None, *embedded: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One TTT step's layer pass over the row, or its rows at the positions `where` (M,): (out (B, M, H), its
        keys, its values (B, nkv, M, d)), attending to the step-0 prefix causally (inside the document) plus each
        position's own chain, the earlier steps' keys and values given (the prefix's whole, the chain's at the same
        rows); `embedded`: `step`'s, the step's rows of the shared embedding projection (none: computed here). A
        function of its arguments alone, so that checkpointing can run it again."""
        B, M = input_ids.shape
        kv = []

        def attend(q, k, v):
            kv.extend((k, v))
            out = ttt_attention(q, [*keys, k], [*values, v], documents, window=self.cfg.sliding_window, where=where)
            return out.transpose(1, 2).reshape(B, M, -1)

        out = self.step(input_ids, hidden, position_ids, attend, embedded or None)
        return out, kv[0], kv[1]

    def shared_embedding(self, input_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...] | None:
        """What the unroll's steps share of the layer's input projection, or None (EAGLE-1: nothing)."""
        return None

    def _qkv_embedded(self, hidden, position_ids, projected, rows, weight, bias):
        raise NotImplementedError

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
        target_ids = self._target_ids(features)  # (B, T): argmax q_t predicts x_{t+1}
        correct = torch.zeros(len(outs), B, T, dtype=torch.bool, device=input_ids.device)
        valid = torch.zeros_like(correct)
        for k, out in enumerate(outs):
            n = T - 2 - k  # stream positions t = 0..n-1 predict x_{t+2+k}
            if n <= 0:
                continue
            draft = self.to_target_ids(self.logits(out[:, :n]).argmax(-1))  # (B, n)
            correct[k, :, :n] = draft == target_ids[:, 1 + k:T - 1]
            valid[k, :, :n] = self.trained_mask(loss_mask, position_ids, k)
        return step_counts(correct, valid)

    def _target_logits(self, features) -> torch.Tensor:
        if features.logits is not None:
            return features.logits
        with torch.no_grad():
            return self._held.lm_head(features.final)

    def _target_ids(self, features) -> torch.Tensor:
        """(B, T) the verifier's argmax: the cache's when it stored one, else of its logits."""
        if features.argmax is not None:
            return features.argmax
        return self._target_logits(features).argmax(-1)

    @torch.no_grad()
    def _draft_targets(self, features, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draft_targets` of the verifier's logits, computed over the row in chunks of positions; from the draft
        vocabulary's lm_head rows alone when the run holds only those (`hold_draft_rows`) and the features carry
        the verifier's argmax."""
        rows = getattr(self._held, "draft_rows", None)
        if rows is not None and features.logits is None:
            if features.argmax is None:
                raise EagleError("the verifier holds only the draft vocabulary's lm_head rows (hold_draft_rows): the "
                                 "features must carry the verifier's argmax (a feature cache that stored it)")
            return row_draft_targets(features.final, rows, features.argmax, self.t2d)
        if features.logits is not None:
            logits = features.logits
            return chunked_draft_targets(lambda s, e: logits[:, s:e], B, T, logits.shape[-1], self.d2t, self.t2d,
                                         logits.element_size())
        lm_head = self._held.lm_head
        return chunked_draft_targets(lambda s, e: lm_head(features.final[:, s:e]), B, T, lm_head.weight.shape[0],
                                     self.d2t, self.t2d, matmul_dtype(features.final, lm_head.weight).itemsize)

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
        out, _ = self(ids_in, hidden, self._default_positions(input_ids, position_ids),
                      attention_mask=self.document_mask(position_ids))
        n = T - 2  # positions t = 0..T-3 predict x_{t+2}, which exists
        pred, target = out[:, :n], final[:, 1:n + 1]
        target_logits = self._target_logits(features)[:, 1:n + 1]  # q_{t+1}
        pred_logits = self.logits(pred)
        mask = self.trained_mask(loss_mask, position_ids, 0)
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
        problem = maps_problem(d2t, t2d, V)
        if problem:
            raise EagleError(problem)
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
                self.lm_head.weight.copy_(verifier.lm_head_rows(self.target_columns()).float().cpu())
                if cfg.norm_init == "ones":
                    pass  # the fresh norm: ones (the drafter's norm is a Llama one for every family)
                elif self.model_type in OWN_LAYER_FAMILIES:
                    self.norm.weight.copy_(verifier.norm.weight.detach().float().cpu())
                else:  # the same per-channel scale in the Llama norm's convention (Gemma's is 1 + w)
                    self.norm.weight.copy_(norm_scale(verifier.norm, H))
        self.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)

    @property
    def feature_layers(self) -> list[int]:
        return list(self.layer_ids)

    def target_columns(self) -> torch.Tensor:
        """(Vd,) the target (verifier) token id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def hold_draft_rows(self, verifier) -> None:
        """Train on the draft vocabulary's rows of the verifier's lm_head alone: the verifier frees the others
        (`Verifier.keep_head_rows`; at Llama-3.1-8B's shapes 0.25 of 0.98 GiB) and the targets are computed from
        these rows and the verifier's argmax, which the features must then carry (a feature cache that stored it).
        The targets are the same numbers: the draft columns' logits are these rows' products. Where nothing would be
        freed (a draft vocabulary that is the whole vocabulary; `keep_head_rows`: a tied head, a head with a bias)
        the whole head stays and the targets come from it."""
        if self.draft_vocab_size < verifier.vocab_size:
            self._held.draft_rows = verifier.keep_head_rows(self.target_columns().cpu())

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

    def shared_embedding(self, input_ids, steps):
        """(projected (B, T+steps-1, (nh+2nkv)d), the hidden half's weight ((nh+2nkv)d, H), bias or None): the
        attention input is [input_layernorm(embed(x)); hidden_norm(h)], so q, k and v are the embedding half's
        product plus the hidden half's. Step k at stream position t reads token x_{t+1+k} (`_step_inputs`), which
        step 0 reads at t + k: the embedding half is one product over the row (and the `steps` - 1 padded positions
        after it) for every step, not one a step; its weight gradient one product too. The weights are cast to the
        autocast dtype once for the unroll. None where the steps read other tokens (P-EAGLE's mask positions read
        the plain path), and under DeepSpeed ZeRO-3, whose partitioned weights are whole only inside their module's
        forward."""
        attn, H = self.layer.self_attn, self.hidden_size
        if any(hasattr(m.weight, "ds_id") for m in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return None
        ids = F.pad(input_ids[:, 1:], (0, steps))  # x_{j+1} at stream index j; token 0 past the row, as _step_inputs
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # (nh+2nkv)d, 2H
        bias = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        cast = _autocast_dtype(weight)  # under autocast: one cast for the unroll, as autocast's cached one
        if cast is not None:
            weight = weight.to(cast)
        embeds = self.layer.input_layernorm(self.embed(ids))
        return F.linear(embeds.to(weight.dtype), weight[:, :H]), weight[:, H:], bias

    def _qkv_embedded(self, hidden, position_ids, projected, rows, weight, bias):
        """q, k, v (RoPE applied) and the residual from the hidden rows and rows `rows` of the shared embedding
        projection."""
        if hidden.shape[-1] == self.fc.in_features:  # raw verifier features
            hidden = self.project_features(hidden)
        normed = self.layer.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        qkv = projected[:, rows] + F.linear(normed.to(weight.dtype), weight, bias)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        return (*self._heads(q, k, v.contiguous(), position_ids), residual)

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

    def loss_positions(self, loss_mask: torch.Tensor, position_ids: torch.Tensor | None, in_draft: torch.Tensor,
                       k: int, scored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scored, trained), each (B, T-2-k) bool, at TTT step k: the positions `trained_mask` scores (`scored`,
        when the caller has them already), and those of them the loss trains (with eagle.skip_out_of_draft, not where
        the verifier's argmax, `in_draft` (B, T) from `draft_targets`, is outside the draft vocabulary)."""
        if scored is None:
            scored = self.trained_mask(loss_mask, position_ids, k)
        if not self.cfg.skip_out_of_draft:
            return scored, scored
        return scored, scored & in_draft[:, 1 + k:loss_mask.shape[1] - 1]

    def training_loss(self, input_ids, features, loss_mask, position_ids=None) -> EagleOutput:
        B, T = input_ids.shape
        if len(features.layers) != 3:
            raise EagleError(f"EAGLE-3 needs the verifier features of layers {self.layer_ids}; got "
                             f"{len(features.layers)} layer tensors (request layer_ids=drafter.feature_layers)")
        feats = torch.cat(features.layers, dim=-1).to(self.dtype)  # (B, T, 3H)
        if self.training and self.cfg.input_noise > 0:
            feats = add_uniform_noise(feats, self.cfg.input_noise)
        K = self.cfg.ttt_steps
        align = self.cfg.align_topk is not None and self.training  # a training mask: held-out losses stay comparable
        with torch.no_grad():
            scored_at = [self.trained_mask(loss_mask, position_ids, k) if T - 2 - k > 0 else None for k in range(K)]
            keep, read = read_positions(scored_at, ahead=align)
            # the targets before the unroll, so that the verifier's logits (chunked, never (B, T, V) at once) and
            # their softmax temporaries are not alive beside the unroll's saved activations, the step's peak
            target_logp, target_ids, in_draft = self._draft_targets(features, B, T)
            # forward_kl weighted without the measured acceptance needs only p: exp'd once for every step
            fused = self.cfg.loss == "forward_kl" and self.cfg.step_weights != "reach"
            if fused:
                target_p = target_logp.exp_()  # (B, T, Vd), in place: log p is not read again
                target_mass = target_p.sum(-1)
                target_logp = None  # only p is read from here on
        outs = self.ttt_unroll(input_ids, self.project_features(feats), position_ids, keep=keep)
        # the norm, lm_head and loss over the positions read, in chunks, the head's backward in the forward
        head = HeadLoss(None if self.cfg.norm_output else self.norm, self.lm_head.weight, self.cfg.loss,
                        self.cfg.lk_eta, logits_of=self.logits)
        reach = self.cfg.step_weights == "reach"
        fixed = None if reach else step_weights(self.cfg.step_weights, K, self.cfg.decay).tolist()
        correct = torch.zeros(K, B, T, dtype=torch.bool, device=input_ids.device)  # aligned on stream position t
        valid = torch.zeros_like(correct)
        zero = torch.zeros((), device=input_ids.device)
        reached = torch.ones((), device=input_ids.device)  # reach: the weight of step k, prod_{j<k} alpha_j
        step_losses, step_alpha = [], []
        kept = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # parallel: chains still trained
        aligned = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # align_topk: chains still verified
        for k in range(K):
            n = T - 2 - k  # stream positions t = 0..n-1 predict x_{t+2+k}, which exists
            if n <= 0:
                step_losses.append(zero)
                step_alpha.append(zero)
                reached = reached * 0
                continue
            scored, trained = self.loss_positions(loss_mask, position_ids, in_draft, k, scored_at[k])  # (B, n)
            if self.parallel and k > 0 and self.training:  # P-EAGLE: chains kept with chance f_k / f_{k-1}
                ratio = self.keep_fraction(k) / self.keep_fraction(k - 1)
                kept = kept & (torch.rand(kept.shape, device=kept.device) < ratio)
                trained = trained & kept[:, :n]
            if align:
                trained = trained & aligned[:, :n]
            valid[k, :, :n] = scored
            rows = read[k]  # (R,) every trained position among them
            if k >= len(outs) or rows.numel() == 0:  # nothing read here (nor later: the unroll stopped)
                step_losses.append(zero)
                step_alpha.append(zero)
                reached = reached * 0
                continue
            hidden = _rows(outs[k], None if k == 0 else keep[k], rows, 1)  # (B, R, H)
            weight = trained[:, rows].float() / trained.sum().clamp(min=1)  # a masked mean over the trained
            step = head.step(hidden, (target_p if fused else target_logp)[:, 1 + k:T - 1],
                             weight, target_mass[:, 1 + k:T - 1] if fused else None, rows,
                             step_weight=reached if reach else fixed[k], topk=self.cfg.align_topk if align else 1)
            step_losses.append(step.loss)
            step_alpha.append(zero if fused else step.alpha)  # fused: the step weights are fixed, alpha unread
            if reach:
                reached = reached * step.alpha
            with torch.no_grad():
                target_k = target_ids[:, 1 + k + rows]  # (B, R)
                correct[k, :, rows] = self.to_target_ids(step.argmax) == target_k
                if align:  # the chain from t goes on past step k iff the verifier's argmax is drafted
                    hit = correct[k, :, rows]
                    if step.top is not None:  # align_topk > 1
                        hit = (self.to_target_ids(step.top) == target_k[..., None]).any(-1)
                    aligned[:, rows] &= hit
        loss = head.loss()
        if not any(r is not None and r.numel() for r in read) and torch.is_grad_enabled():
            # nothing read in the batch (every target a prompt's): a zero that still reaches every parameter, so
            # that each gets its (zero) gradient, as every process of a data-parallel run expects
            loss = loss + 0 * (outs[0].sum() + sum(p.sum() for p in head.params))
        return EagleOutput(loss=loss, step_losses=torch.stack(step_losses), counts=step_counts(correct, valid))


def _rows(x: torch.Tensor, at: torch.Tensor | None, where: torch.Tensor | None, dim: int) -> torch.Tensor:
    """x's rows along `dim` at the sorted positions `where`, given that they sit at the sorted positions `at` (None:
    every position, and `where` None: keep them all); a prefix is a slice, not a copy."""
    if where is None:
        return x
    M = where.numel()
    if int(where[-1]) == M - 1:  # the first M positions, which are the first M rows of any superset
        return x.narrow(dim, 0, M)
    index = where if at is None else torch.searchsorted(at, where)
    return x.index_select(dim, index)


def read_positions(scored: list[torch.Tensor | None], ahead: bool) -> tuple[list, list]:
    """(keep, read): per TTT step k, the stream positions its layer pass must compute (`ttt_unroll`'s keep: what
    step k or a later one scores, in any row; step 0 all) and those its head must score (read: what step k scores
    in any row, and with `ahead` what a later step scores too, whose training depends on this step's draft).
    scored: per step the (B, n_k) bool scored positions, None where the step has no position."""
    K = len(scored)
    need = [None if s is None else s.any(0) for s in scored]  # (n_k,)
    keep, read = [None] * K, [None] * K
    later = None  # (n,) positions scored at a step after k
    for k in reversed(range(K)):
        if need[k] is None:
            continue
        n = need[k].shape[0]
        after = torch.zeros_like(need[k]) if later is None else F.pad(later, (0, n - later.shape[0]))
        keep[k] = None if k == 0 else (need[k] | after).nonzero().squeeze(1)
        read[k] = ((need[k] | after) if ahead else need[k]).nonzero().squeeze(1)
        later = need[k] | after
    return keep, read


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
