"""Run a Hugging Face Llama-family causal LM over a preallocated static KV cache, with tree attention.

Design. We keep Hugging Face's own modules (embedding, rotary embedding, decoder layers, final norm, lm_head) and
call them ourselves, layer by layer, with three things of ours:
  - `StaticKVCache`, a `transformers.Cache` subclass whose `update` writes the new keys/values into preallocated
    per-layer buffers (B, H_kv, capacity, head_dim) at explicit slots and returns a window of the buffer;
  - a boolean attention mask built once per forward (prefix + ancestor-or-self tree slots, `draftheads.eval.engine.tree`), turned
    into one additive mask shared by every layer (a second one for sliding-window layers, if any);
  - explicit position ids (prefix length + depth in the tree).
Why not call `model(...)`: the model forward rebuilds the mask through `create_causal_mask` every call, wraps the
loop in output-capturing decorators and expects a cache whose length is one number for the whole batch, while
rows here have different lengths (left-aligned rows, per-row lengths) and the draft tree needs a non-causal mask.
Why not a custom `AttentionInterface` function: it would still need the model forward (same mask and cache
problems), and it would replace the attention kernel that the user configured. Calling the layers keeps the
attention kernel (SDPA or eager), the layer code and the weights exactly Hugging Face's, costs one Python call per
layer, and leaves every buffer at a fixed address for CUDA graphs later. One substitution: for "sdpa" models each
forward routes attention to `sdpa_gqa_attention`, the same SDPA call with `enable_gqa` instead of Hugging Face's
copy of every kv head per query group (which its sdpa path makes whenever a mask is given). The price is depending
on the decoder layer's call signature (`hidden_states, attention_mask=, position_embeddings=, position_ids=,
cache=`), shared by the families in `SUPPORTED_MODEL_TYPES`; any other model type runs on the generic path
(eval/engine/generic_runtime.py: the model's own forward and cache, chains only).

Cache layout: row b's committed tokens occupy slots 0 .. len_b - 1 (slot = position); a forward writes its n new
tokens at caller-chosen slots (the tree after the prefix), and `compact` moves the accepted path to consecutive
slots after verification. Nothing beyond a row's length is ever read unmasked, so rollback is free: the length
simply does not advance over rejected slots.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from draftheads.models.placed import Placed

#: Model types whose decoder layers this runtime drives (same layer signature; Qwen2/Mistral sliding windows are
#: honoured through the mask).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA that reads grouped kv heads in place (`enable_gqa`). Hugging Face's own "sdpa" function copies them
    `num_key_value_groups` times whenever a mask is given (every tree verification here): (B, H, W, d) per layer,
    per forward, which on CPU costs as much memory traffic as a good part of the weights."""
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=groups > 1)  # (B, H, n, d)
    return out.transpose(1, 2).contiguous(), None


SDPA_GQA = "draftheads_sdpa_gqa"
AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)


class UnsupportedModelError(ValueError):
    """A model family the static-cache runtime cannot drive; the message names the model_type."""


class StaticKVCache(Cache):
    """Per-layer K/V buffers of shape (B, H_kv, capacity, head_dim), written at explicit slots.

    Before each forward the runner calls `begin(slots, positions, window)`; every layer's `update` then writes its
    new keys/values at `slots` (B, n) and returns the first `window` slots of the buffers.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        # One tensor for every layer's keys and values, so rollback compaction is one gather and one scatter.
        self.kv = torch.zeros(2, num_layers, batch_size, num_kv_heads, capacity, head_dim, dtype=dtype,
                              device=device)
        self.keys = list(self.kv[0])  # per-layer views (B, H_kv, capacity, head_dim)
        self.values = list(self.kv[1])
        self.key_positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        """(B, capacity) the position of the token in each slot (read by sliding-window masks)."""
        self.capacity = capacity
        # (B, 1). Public, like the buffers: captured graphs read it, so the fused loop's check that a drafter's
        # buffers have not moved (cuda_loop._tensor_addresses, public attributes only) must see it too.
        self.rows = torch.arange(batch_size, device=device)[:, None]
        self._slots: torch.Tensor | None = None
        self._window = capacity

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def __repr__(self):
        return (f"StaticKVCache(layers={len(self.keys)}, batch={self.batch_size}, capacity={self.capacity}, "
                f"kv_heads={self.keys[0].shape[1]}, head_dim={self.keys[0].shape[3]})")

    def begin(self, slots: torch.Tensor, positions: torch.Tensor, window: int) -> None:
        """Set where the next forward's n tokens go: slots (B, n), their positions (B, n); attend over `window`."""
        if window > self.capacity:
            raise ValueError(f"attention window {window} exceeds the KV cache capacity {self.capacity}")
        self._slots, self._window = slots, window
        self.key_positions[self.rows, slots] = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states (B, H_kv, n, hd) -> written at (row, :, slot); advanced indices first: (B, n, H_kv, hd)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self.rows, :, self._slots] = key_states.transpose(1, 2)
        v[self.rows, :, self._slots] = value_states.transpose(1, 2)
        return k[:, :, : self._window], v[:, :, : self._window]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only for code that asks; lengths are per row here
        return 0

    def compact(self, base: torch.Tensor, path: torch.Tensor) -> None:
        """Move the accepted path to consecutive slots: slot base+path[:, j] -> slot base+j. base (B,), path (B, P).

        Gathers before scattering, so overlapping moves are safe. Entries of `path` past the accepted length only
        move garbage into slots the row's length never covers.
        """
        src = base[:, None] + path  # (B, P)
        dst = base[:, None] + torch.arange(path.shape[1], device=path.device)
        self.kv[:, :, self.rows, :, dst] = self.kv[:, :, self.rows, :, src]  # all layers, keys and values
        self.key_positions[self.rows, dst] = dst

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class RunnerOutput:
    """One forward's outputs at the n input positions."""

    final: torch.Tensor
    """(B, n, H) post-norm hidden states (lm_head's input)."""
    layers: dict[int, torch.Tensor]
    """layer id -> (B, n, H) that decoder layer's input (HF `hidden_states[i]`)."""
    logits: torch.Tensor | None
    """(B, n, V) when asked for."""


def check_supported(model: nn.Module, what: str = "verifier") -> None:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{what} model_type {model_type!r} is not supported by the spec-decode runtime (static KV cache with "
            f"tree attention); supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"{what} uses attn_implementation={impl!r}; the spec-decode runtime needs custom tree masks, which "
            "'sdpa' and 'eager' support. Load it with attn_implementation='sdpa'."
        )


class RunnerBase(Placed):
    """What both runners (this one and eval/engine/generic_runtime.py's) expose besides forward: device and dtype, read
    off the model's input embedding table (`embed_tokens`, set by the subclass)."""

    embed_tokens: nn.Module
    placed_by = "embed_tokens"


class ModelRunner(RunnerBase):
    """Drives one HF causal LM (verifier or draft model) over a `StaticKVCache`."""

    def __init__(self, model: nn.Module, what: str = "verifier"):
        check_supported(model, what)
        self.model = model
        self.config = model.config
        decoder = model.get_decoder()
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.lm_head = model.get_output_embeddings()
        cfg = model.config
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        # Sliding window per layer: Mistral applies config.sliding_window to every layer, Qwen2/Qwen3 only to the
        # layers that `layer_types` marks "sliding_attention".
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if types is not None:
            self.layer_windows = [window if t == "sliding_attention" else None for t in types[: len(self.layers)]]
        else:
            self.layer_windows = [window] * len(self.layers)

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        return StaticKVCache(len(self.layers), batch_size, capacity, self.num_kv_heads, self.head_dim, self.dtype,
                             self.device)

    @contextmanager
    def _attention(self):
        """For "sdpa" models, route attention to `sdpa_gqa_attention` for the duration of one forward (the same
        kernel without copying the kv heads); "eager" stays eager. Restored even on error."""
        cfg = self.config
        if cfg._attn_implementation != "sdpa":
            yield
            return
        cfg._attn_implementation_internal = SDPA_GQA
        try:
            yield
        finally:
            cfg._attn_implementation_internal = "sdpa"

    def _layer_masks(self, mask: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor):
        """(B, n, W) bool -> one additive (B, 1, n, W) mask per layer (shared objects between equal windows)."""
        neg = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=mask.device)
        full = torch.where(mask, zero, neg)[:, None]
        masks = {None: full}
        for w in set(self.layer_windows) - {None}:
            near = positions[:, :, None] - key_positions[:, None, :] < w  # (B, n, W) within the window
            masks[w] = torch.where(mask & near, zero, neg)[:, None]
        return [masks[w] for w in self.layer_windows]

    def forward(self, cache: StaticKVCache, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, layer_ids: tuple[int, ...] | list[int] = (), logits: bool = True,
                ) -> RunnerOutput:
        """input_ids, positions, slots (B, n); mask (B, n, W) bool over cache slots 0..W-1 (the new tokens' own
        slots included). Writes the new keys/values at `slots` and returns the outputs at the n positions."""
        window = mask.shape[-1]
        cache.begin(slots, positions, window)
        masks = self._layer_masks(mask, positions, cache.key_positions[:, :window])
        h = self.embed_tokens(input_ids)  # (B, n, H)
        position_embeddings = self.rotary_emb(h, positions)
        wanted = set(layer_ids)
        feats = {}
        with self._attention():
            for i, layer in enumerate(self.layers):
                if i in wanted:
                    feats[i] = h
                h = layer(h, attention_mask=masks[i], position_embeddings=position_embeddings,
                          position_ids=positions, cache=cache)
                if isinstance(h, tuple):  # older layer signatures return (hidden_states, ...)
                    h = h[0]
        final = self.norm(h)
        return RunnerOutput(final=final, layers=feats, logits=self.lm_head(final) if logits else None)

    __call__ = forward


def causal_mask(n: int, window: int, device) -> torch.Tensor:
    """(1, n, W) bool: query i (at slot i) reads slots 0..i. For prefills that start at slot 0."""
    return (torch.arange(window, device=device)[None, :] <= torch.arange(n, device=device)[:, None])[None]


def bucket(n: int, size: int = 64) -> int:
    """Round up to a multiple of `size`, so attention windows (and compiled shapes) change rarely."""
    return -(-n // size) * size
