"""vLLM's own DSpark model class on a drafter folder, outside a server: construct, load, run (a vllm_runner.py case).

This file runs in vLLM's environment (imported by eval/interop/vllm_runner.py) and imports nothing of draftheads.

vLLM 0.32's CPU build cannot serve DSpark: `VllmConfig` refuses method "dspark" on the V1 model runner ("Model Runner
V1 does not support: dspark speculative decoding"), and the V2 runner, the only one with a DSpark speculator
(v1/worker/gpu/spec_decode/dspark/), needs Triton with a CPU backend, which the registry's triton lacks
(triton_utils/importing.py sets HAS_TRITON false; VLLM_USE_V2_MODEL_RUNNER=1 gives "Model Runner V2 requires
Triton"). The case records that refusal, then builds what serving would build, piece by piece:

  - the SpeculativeConfig vLLM makes for {"method": "dspark", "model": FOLDER, "num_speculative_tokens": k} (its
    own parsing of config.json, speculators format included), attached to the verifier's VllmConfig;
  - `Qwen3DSparkForCausalLM(vllm_config=...)` (what the registry maps Qwen3DSparkModel to) and its own
    `load_weights` over the folder's tensors. Instrumented as our SGLang runner is: every parameter is NaN before
    the load, so one still NaN was never written; each parameter's weight_loader records which file tensor wrote
    it, so a file tensor that reached none was skipped. embed_tokens and lm_head are then the verifier's, as
    load_dspark_model shares them (the mask_embedding placeholder vLLM drops: it masks through the vocab row);
  - the forward: fc (`combine_hidden_states`) and vLLM's own context-KV precompute
    (`precompute_and_store_context_kv`: hidden_norm, the layers' k/v projections, k_norm, RoPE) with the paged
    cache write replaced by a recorder, then the block through `forward` (its embedding, layers, norms, MLPs), each
    layer's `attn` (the paged-attention kernel) replaced by plain softmax attention of the block's queries over
    [context keys; block keys], bidirectional (full-attention layers);
  - DSpark's heads through the methods DSparkSpeculator calls: compute_draft_logits, markov_embed, markov_bias,
    compute_confidence, map_draft_to_target, and a greedy left-to-right chain in the speculator's order.

A case: name, verifier, drafter, k, target_hidden (n, L*H) (the verifier's target-layer outputs at positions
0..n-1), block_ids (N,) ([anchor, mask...], the anchor at position n), prev (K,) the previous token of each
drafted position (teacher-forced). The result: ok, serve_refusal, unwritten (parameters never written),
skipped (file tensors that reached no parameter), shared, hidden (N, H), base_logits (K, Vd), markov_bias (K, Vd),
confidence (K,), chain (K,) its greedy drafts.
"""

from __future__ import annotations

import os
import traceback


def _configs(case: dict):
    """(the VllmConfig with DSpark's SpeculativeConfig attached, the refusal vLLM gives when asked to serve it)."""
    from vllm.engine.arg_utils import EngineArgs

    common = dict(model=case["verifier"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=256)
    spec = {"method": "dspark", "model": case["drafter"], "num_speculative_tokens": case["k"]}
    refusal = None
    try:
        EngineArgs(**common, speculative_config=dict(spec)).create_engine_config()
    except Exception as err:  # the V1 runner's refusal (the CPU build has no V2 runner: no Triton CPU backend)
        refusal = f"{type(err).__name__}: {err}".splitlines()
        refusal = next((line.strip() for line in refusal if "does not support" in line or "requires" in line),
                       refusal[-1])
    vllm_config = EngineArgs(**common).create_engine_config()
    speculative = EngineArgs(**common, speculative_config=dict(spec)).create_speculative_config(
        vllm_config.model_config, vllm_config.parallel_config)
    object.__setattr__(vllm_config, "speculative_config", speculative)
    return vllm_config, refusal


def _init_distributed():
    import torch
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not torch.distributed.is_initialized():
        port = 29500 + os.getpid() % 1000
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    if not model_parallel_is_initialized():
        initialize_model_parallel(1, 1)


def _read_safetensors(folder: str) -> dict:
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fn), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _load_instrumented(model, tensors: dict) -> tuple[list, list]:
    """model.load_weights(tensors) with every parameter NaN first and each weight_loader recording which file tensor
    (known by its storage: load_weights renames and regroups before it writes) reached it. Returns (the parameters
    never written, the file tensors that wrote nothing)."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    owner = {t.untyped_storage().data_ptr(): name for name, t in tensors.items()}
    written = set()
    for pname, p in model.named_parameters():
        if p.is_floating_point():
            p.data.fill_(float("nan"))
        inner = getattr(p, "weight_loader", None)

        def wrapper(param, loaded, *a, _inner=inner, **kw):
            written.add(owner.get(loaded.untyped_storage().data_ptr()))
            return (_inner or default_weight_loader)(param, loaded, *a, **kw)

        p.weight_loader = wrapper

    model.load_weights(iter(tensors.items()))
    unwritten = [n for n, p in model.named_parameters() if p.is_floating_point() and bool(torch.isnan(p).any())]
    return unwritten, sorted(set(tensors) - written)


class _Recorder:
    """Stands in for a layer's paged Attention in the context-KV precompute: keeps the keys/values written."""

    def __init__(self):
        self.kv_cache, self.k, self.v = None, None, None
        self.impl = self

    def do_kv_cache_update(self, attn, k, v, kv_cache, slot_mapping):
        self.k, self.v = k.clone(), v.clone()  # (n, nkv, d)


def _plain_attention(recorder: _Recorder, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
    import torch

    class Attend(torch.nn.Module):
        """softmax(q [k_ctx; k]^T * scale) [v_ctx; v], every block query over the whole context and block."""

        def forward(self, q, k, v):
            N = q.shape[0]
            q = q.view(N, num_heads, head_dim).transpose(0, 1)  # (nh, N, d)
            keys = torch.cat([recorder.k, k.view(N, num_kv_heads, head_dim)], 0).transpose(0, 1)  # (nkv, n+N, d)
            values = torch.cat([recorder.v, v.view(N, num_kv_heads, head_dim)], 0).transpose(0, 1)
            rep = num_heads // num_kv_heads
            keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
            weights = torch.softmax((q @ keys.transpose(1, 2)).float() * scale, -1).to(values.dtype)
            return (weights @ values).transpose(0, 1).reshape(N, num_heads * head_dim)

    return Attend()


def dspark_forward(case: dict) -> dict:
    result = {"name": case["name"], "ok": False}
    try:
        import torch
        from vllm.config import set_current_vllm_config

        vllm_config, refusal = _configs(case)
        result["serve_refusal"] = refusal
        with set_current_vllm_config(vllm_config):
            _init_distributed()
            from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

            model = Qwen3DSparkForCausalLM(vllm_config=vllm_config).eval()
            unwritten, skipped = _load_instrumented(model, _read_safetensors(case["drafter"]))
            target = _read_safetensors(case["verifier"])
            embed = target["model.embed_tokens.weight"]
            shared = {"model.embed_tokens.weight": embed,
                      "lm_head.weight": target.get("lm_head.weight", embed)}  # tied: the embedding
            with torch.no_grad():
                for name, value in shared.items():
                    if name in unwritten:
                        model.get_parameter(name).copy_(value)
            unwritten = [n for n in unwritten if n not in shared and n != "model.mask_embedding"]
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(model, vllm_config.speculative_config.draft_model_config,
                                          torch.device("cpu"))  # as vLLM's loader does (its CPU GEMM set-up)
            result.update(model_class=type(model).__name__, unwritten=unwritten, skipped=skipped,
                          shared=sorted(shared), confidence_head=model.model.confidence_head is not None)

            inner = model.model
            recorders = [_Recorder() for _ in inner.layers]
            inner._attn_layers = recorders
            for layer, rec in zip(inner.layers, recorders):
                a = layer.self_attn
                a.attn = _plain_attention(rec, a.num_heads, a.num_kv_heads, a.head_dim, a.scaling)
            features = torch.tensor(case["target_hidden"], dtype=torch.float32)  # (n, L*H)
            n = features.shape[0]
            block = torch.tensor(case["block_ids"])
            prev = torch.tensor(case["prev"])
            with torch.no_grad():
                context = model.combine_hidden_states(features)  # fc
                model.precompute_and_store_context_kv(context, torch.arange(n), torch.arange(n))
                hidden = model(block, torch.arange(n, n + block.shape[0]))  # (N, H)
                drafted = hidden[1:]
                base = model.compute_draft_logits(drafted)  # (K, Vd)
                embeds = model.markov_embed(prev)
                bias = model.markov_bias(embeds)
                confidence = model.compute_confidence(drafted, embeds) if inner.confidence_head is not None \
                    else None
                chain, last = [], block[:1]  # DSparkSpeculator's greedy order: embed(prev), bias, argmax, d2t
                for k in range(base.shape[0]):
                    step = base[k:k + 1] + model.markov_bias(model.markov_embed(last))
                    last = model.map_draft_to_target(step.argmax(-1))
                    chain.append(int(last[0]))
            result.update(ok=True, hidden=hidden.tolist(), base_logits=base.tolist(), markov_bias=bias.tolist(),
                          confidence=None if confidence is None else confidence.tolist(), chain=chain)
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    return result
