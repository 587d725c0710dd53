"""The generic path: any Hugging Face causal LM as verifier (or draft model), through its own forward and cache.

The static-cache runtime (eval/engine/runtime.py) calls the decoder layers of the families in `SUPPORTED_MODEL_TYPES`
itself, with tree masks and per-row lengths in one batched forward. Every other family (Gemma 3, OLMo 2, Phi-3, ...)
runs here instead: the model's own decoder forward with one `transformers.DynamicCache` per row, so the model
applies its own masks (sliding windows included), rotary embeddings, embedding scale and norms.

What that costs and allows:
  - chains only: a step verifies root + N drafts causally, which the model's own causal mask expresses; a tree
    needs a custom mask (refused by the decoder with a message naming the model type and the method);
  - rows one at a time (each row has its own cache length), so a batch of B costs B forwards per step;
  - rollback by cropping: a forward whose first slot is s first crops the row's cache to s entries, which drops the
    rejected drafts of the previous step (everything before s is committed). The cache keeps every layer's full
    past (no sliding-window trimming) so that it can always be cropped; the model's mask still applies the window.
Same interface as `ModelRunner` (forward(cache, input_ids, positions, slots, mask, layer_ids, logits)), so the
decoder and the drafters use either; `mask` is not read here (chains are causal by construction).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import DynamicCache

from draftheads.eval.engine.runtime import (
    SUPPORTED_MODEL_TYPES,
    ModelRunner,
    RunnerBase,
    RunnerOutput,
    UnsupportedModelError,
)
from draftheads.models.verifier import capture_layer_inputs

_announced: set[str] = set()


class GenericCache:
    """One DynamicCache per row; `length(b)` says how many entries row b holds."""

    def __init__(self, batch_size: int, capacity: int):
        self.rows = [DynamicCache() for _ in range(batch_size)]
        self.capacity = capacity

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def length(self, b: int) -> int:
        return self.rows[b].get_seq_length()

    def crop_to(self, b: int, n: int) -> None:
        have = self.length(b)
        if n > have:
            raise RuntimeError(f"generic cache row {b}: a forward starts at slot {n} but the row holds {have} entries")
        if n < have:
            self.rows[b].crop(n - have)  # transformers 5: a negative count of entries to drop

    def compact(self, base, path) -> None:
        raise UnsupportedModelError("the generic path verifies chains only; a tree's accepted path cannot be "
                                    "compacted in a model's own cache")


class GenericRunner(RunnerBase):
    """Drives any HF causal LM with a cache, row by row (see the module docstring); ModelRunner's interface."""

    generic = True

    def __init__(self, model: nn.Module, what: str = "verifier"):
        self.model = model
        self.config = model.config
        decoder = model.get_decoder()
        if not hasattr(decoder, "layers"):
            raise UnsupportedModelError(
                f"{what} model_type {model.config.model_type!r} ({type(model).__name__}) has no `layers` on its "
                "decoder; the generic path needs a decoder with a list of layers")
        self.decoder = decoder
        self.layers = decoder.layers
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = model.config.vocab_size

    def new_cache(self, batch_size: int, capacity: int) -> GenericCache:
        return GenericCache(batch_size, capacity)

    def forward(self, cache: GenericCache, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None = None, layer_ids: tuple[int, ...] | list[int] = (), logits: bool = True,
                ) -> RunnerOutput:
        """input_ids, positions, slots (B, n): row b's n tokens enter its cache after its first `slots[b].min()`
        entries (the rest is cropped first). Returns the outputs at the n positions, as ModelRunner does."""
        starts = slots.min(1).values.tolist()
        finals, feats = [], {i: [] for i in layer_ids}
        with capture_layer_inputs(self.layers, layer_ids) as captured:  # each row's forward refills `captured`
            for b, start in enumerate(starts):
                cache.crop_to(b, start)
                out = self.decoder(input_ids=input_ids[b: b + 1], position_ids=positions[b: b + 1],
                                   cache=cache.rows[b], use_cache=True)
                finals.append(out.last_hidden_state)
                for i in layer_ids:
                    feats[i].append(captured[i])
        final = torch.cat(finals)
        layers = {i: torch.cat(v) for i, v in feats.items()}
        return RunnerOutput(final=final, layers=layers, logits=self.lm_head(final) if logits else None)

    __call__ = forward


def on_generic_path(config) -> bool:
    """Whether a model with this config decodes on the generic path (not one of the static runtime's families)."""
    return getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES


def make_runner(model: nn.Module, what: str = "verifier"):
    """The static-cache runner for the families it supports, the generic one for any other (said once per model
    type: it is slower, rows one at a time, and verifies chains only)."""
    if not on_generic_path(model.config):
        return ModelRunner(model, what)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if model_type not in _announced:
        _announced.add(model_type)
        warnings.warn(
            f"{what} model_type {model_type!r} runs on the generic path (the model's own forward and cache, rows one "
            f"at a time, chains only): slower than the static-cache runtime of {', '.join(SUPPORTED_MODEL_TYPES)}",
            stacklevel=2)
    return GenericRunner(model, what)


def is_generic(runner) -> bool:
    return getattr(runner, "generic", False)
