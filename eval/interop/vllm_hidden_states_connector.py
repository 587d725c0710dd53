"""A KV connector for vLLM's `extract_hidden_states` speculative method that copies on whatever device vLLM runs.

vLLM loads it by module path (`kv_transfer_config={"kv_connector": "HostHiddenStatesConnector",
"kv_connector_module_path": "vllm_hidden_states_connector", ...}`), in vLLM's own environment; it imports nothing
of draftheads (eval/interop/vllm_data_runner.py puts this folder on the path).

The contract it keeps is vLLM's own `ExampleHiddenStatesConnector`'s (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py): with `extract_hidden_states`, the verifier's aux hidden states of every token
(`eagle_aux_hidden_state_layer_ids`) are written into a cache-only attention layer's KV slots; when a request
finishes, the scheduler hands its block ids to the worker, which reads those slots and writes
{"hidden_states": (tokens, layers, H), "token_ids": (tokens,)} as safetensors at the request's
`hidden_states_path`. vLLM's connector does the read on a CUDA copy stream into pinned host memory, which the CPU
build refuses ("pin_memory=True requires a CUDA or other accelerator backend"); this one overrides only that read:
a plain copy to host memory, then the file written to a temporary name and renamed, so a file that exists is whole.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """What vLLM's connector keeps per request as its copy's CUDA event: here the copy is finished when recorded."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's ExampleHiddenStatesConnector with the slot read done synchronously on the host (any device)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()  # (blocks * block_size,)
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        tensors = {"hidden_states": hidden.to("cpu").contiguous(),  # (tokens, layers, H)
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = pending.filename + ".tmp"
        save_file(tensors, tmp)
        os.replace(tmp, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases a reader waiting on the .lock file, as vLLM's connector does
        self._req_copy_events[pending.req_id] = _Done()
