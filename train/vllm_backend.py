"""vLLM as the backend of the data stages: the features `draftheads dump-features --backend vllm` writes, computed
by vLLM's `extract_hidden_states` speculative method (eval/interop/vllm_data.py drives vLLM in its own environment).

What vLLM captures and what the cache stores (data/hidden_states.py), layer by layer:

    vLLM `eagle_aux_hidden_state_layer_ids` id i   = the residual stream entering decoder layer i (i < L), and
                                                    for i = L the last layer's output, before the final norm
    cache `layers` (EAGLE-3's, DFlash's id + 1)   = the inputs of those layers: vLLM's id i, as it is
    cache `final` (every method)                  = the final post-norm state: vLLM's id L through the verifier's
                                                    own final norm module, applied here

vLLM answers the ids in ascending layer order whatever order they are asked in (duplicates once), so they are asked
sorted and placed back by id. One request is one sequence with positions from 0: a row is split into its documents
(position_ids restarting at 0, `data.pack`), each document one request, and the states are put back in place, which
is what the Hugging Face path computes (its attention stays inside each document); a row's right padding is a
request with the row's last document, as the HF path computes it (positions counting on: `join_padding`), or, with
padding "zeros", left out of the requests and stored as zeros (data/hidden_states.py: no loss reads it).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from draftheads.data.documents import join_padding, restarts
from draftheads.data.hidden_states import PADDINGS, TOKEN_DTYPES, CacheError


def documents(position_ids: torch.Tensor, attention_mask: torch.Tensor, padding: str = "joined"
              ) -> list[list[tuple[int, int]]]:
    """Per row of (N, T) position_ids, the [start, end) spans vLLM runs as separate requests: the row's documents,
    its right padding joined to the last one (padding "joined") or left out ("zeros"). A span must count 0, 1, 2, ...
    (a request starts at position 0)."""
    if padding not in PADDINGS:
        raise CacheError(f"padding={padding!r}: expected one of {PADDINGS}")
    joined = join_padding(position_ids, attention_mask)
    starts = restarts(joined)
    real = attention_mask.sum(dim=1).tolist()  # right padding: the real tokens come first
    spans = []
    for r in range(joined.shape[0]):
        end = joined.shape[1] if padding == "joined" else int(real[r])
        cut = [c for c in starts[r].nonzero().flatten().tolist() if c < end] + [end]
        row = list(zip(cut[:-1], cut[1:]))
        for a, b in row:
            if int(joined[r, a]) != 0:
                raise CacheError(f"row {r}: a document starts at position {int(joined[r, a])} (token {a}); vLLM "
                                 "runs each document as a request from position 0")
        spans.append(row)
    return spans


class VllmFeatures:
    """A shard's tensors (as dump_features._run_verifier's) from a running VllmEngine started with `aux_ids`."""

    def __init__(self, engine, verifier, layer_ids: list[int], dtype: torch.dtype, padding: str = "joined"):
        self.engine, self.verifier, self.layer_ids, self.dtype = engine, verifier, list(layer_ids), dtype
        self.padding = padding
        self.aux = aux_ids(layer_ids, verifier.num_layers)

    @torch.no_grad()
    def __call__(self, rows: dict) -> dict:
        from safetensors.torch import load_file

        ids, attn, positions = rows["input_ids"], rows["attention_mask"], rows["position_ids"]
        N, T = ids.shape
        H = self.verifier.hidden_size
        spans = documents(positions, attn, self.padding)
        requests = [ids[r, a:b].tolist() for r, row in enumerate(spans) for a, b in row]
        files = self.engine.capture(requests)
        final = torch.zeros(N, T, H, dtype=self.dtype)  # (N, T, H); what no span covers stays 0
        layers = torch.zeros(N, len(self.layer_ids), T, H, dtype=self.dtype) if self.layer_ids else None
        where = {i: j for j, i in enumerate(self.aux)}  # layer id -> slot in vLLM's (tokens, layers, H)
        norm = self.verifier.norm
        k = 0
        for r, row in enumerate(spans):
            for a, b in row:
                path = files[k]
                got = load_file(str(path))
                states, tokens = got["hidden_states"], got["token_ids"]  # (n, A, H), (n,)
                if states.shape != (b - a, len(self.aux), H) or tokens.tolist() != requests[k]:
                    raise CacheError(f"{path}: vLLM's hidden states are {tuple(states.shape)} for tokens "
                                     f"{len(tokens)}, expected ({b - a}, {len(self.aux)}, {H}) for the request's "
                                     "tokens")
                last = states[:, where[self.verifier.num_layers]].to(self.verifier.dtype)
                final[r, a:b] = norm(last.to(norm.weight.device)).to("cpu", self.dtype)
                if layers is not None:
                    for j, i in enumerate(self.layer_ids):
                        layers[r, j, a:b] = states[:, where[i]].to(self.dtype)
                os.unlink(path)
                k += 1
        out = {key: rows[key].to(TOKEN_DTYPES[key]).contiguous() for key in TOKEN_DTYPES}
        out["final"] = final
        if layers is not None:
            out["layers"] = layers
        return out


def aux_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` for a cache's layers plus its final state (module docstring)."""
    return sorted(set(layer_ids) | {num_layers})


def start_capture(cfg, verifier, layer_ids: list[int], storage: Path, tensor_parallel_size: int = 1,
                  env: dict | None = None):
    """A started VllmEngine capturing what a cache of `layer_ids` needs, vLLM's files under `storage`."""
    from draftheads.eval.interop.vllm_data import VllmEngine

    engine = VllmEngine(verifier.path, dtype=cfg.verifier_dtype, max_model_len=cfg.data.seq_len + 1,
                        capture_layers=aux_ids(layer_ids, verifier.num_layers), storage=storage,
                        tensor_parallel_size=tensor_parallel_size, seed=cfg.train.seed, env=env)
    return engine.start()


class VllmGenerator:
    """What `draftheads regenerate --backend vllm` generates with: `train.regenerate` reads `config` (the context
    it may fill: vLLM's max_model_len) and calls `generate_ids`; a running VllmEngine does the work."""

    def __init__(self, engine, max_model_len: int, seed: int = 0):
        from types import SimpleNamespace

        self.engine, self.seed = engine, seed
        self.config = SimpleNamespace(max_position_embeddings=max_model_len)

    @classmethod
    @contextmanager
    def start(cls, folder: str | os.PathLike, dtype: str, tensor_parallel_size: int = 1, seed: int = 0,
              max_model_len: int | None = None):
        """A started generator over the verifier folder (stopped at the end of the block); max_model_len: vLLM's
        context, default the model's max_position_embeddings."""
        import json

        from draftheads.eval.interop.vllm_data import VllmEngine

        context = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
        max_model_len = max_model_len or context or 2048
        with VllmEngine(folder, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                        seed=seed) as engine:
            yield cls(engine, max_model_len, seed)

    def generate_ids(self, prompts: list[list[int]], stop_ids: list[int], max_new_tokens: int,
                     temperature: float) -> list[list[int]]:
        """New token ids per prompt (a stop id, when one ended it, last); at temperature > 0 the requests of a run
        are seeded seed, seed + 1, ... in order, so a rerun samples the same rows."""
        out = self.engine.generate(prompts, max_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids,
                                   seed=self.seed)
        self.seed += len(prompts)
        return out
