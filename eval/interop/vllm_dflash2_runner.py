"""vLLM's own DFlash2 model class on a DFlash2 export, outside its engine: load it the way vLLM's proposer does, report
what its load_weights wrote and skipped, and run its forward on given blocks.

    .venv-vllm/bin/python eval/interop/vllm_dflash2_runner.py JOB.json RESULT.json

This file runs in vLLM's environment and imports nothing of draftheads. Why outside the engine: vLLM 0.32 serves a
DFlash2 folder's candidate selector only in its V2 model runner, which needs Triton with a CPU backend, and the CPU
build has none (result `serving`: what vLLM's own config code says about it on this machine). Its model code runs on
a CPU all the same: the grouped convolution takes its torch path for a tensor that is not on CUDA.

What runs, all vLLM's: EngineArgs(...).create_engine_config() with speculative_config {"method": "dflash", "model":
FOLDER, "num_speculative_tokens": k} (the draft's model config, its architecture resolved by vLLM's registry), then
`get_model(vllm_config, model_config=draft_model_config)`, vLLM's default loader reading the folder's safetensors
into `DFlash2Qwen3ForCausalLM.load_weights`. Instrumented, not changed: just before load_weights runs every
parameter is set to NaN and every parameter's weight_loader is wrapped to record which file tensor reached it; after
it, a parameter still holding NaN was not written, a file tensor that reached no weight_loader was skipped. The
verifier's embedding and lm_head are then copied in (vLLM's proposer shares the target's).

A block: the context's keys and values through vLLM's own `precompute_and_store_context_kv` (its fc, hidden_norm,
fused kv projection, k_norm and RoPE; one kernel swapped, below), then the block [anchor, MASK x k] at positions
n .. n+k through its forward,
`compute_logits`, `compute_candidates` and `model.candidate_selector` (the edge scores its speculator walks). The one
part that is not vLLM's: the attention kernel (a backend, not model code), replaced by a plain softmax attention of
the block's queries over [context keys; block keys], bidirectional as a full-attention DFlash layer is, the context
keys being the ones vLLM's precompute wrote to the cache. And one kernel: the precompute norms every layer's context
keys in one `ops.rms_norm` call with the layers' k_norm weights stacked (L, d), "selected per layer by the outermost
index" as its comment says; the CPU build's kernel applies row 0 to every layer (measured: `k_norm_kernel_drift`,
the largest difference between its output and the per-layer norm, reported per block), so the per-layer norm its
comment describes is computed in torch instead. A drafter of one layer, or whose layers share one k_norm, is not
affected.

A job is {"verifier", "drafter", "k", "blocks": [{"features": (n, L*H), "anchor": id}]}; the result {"vllm",
"serving", "load": {...}, "blocks": [{"hidden", "logits", "candidates", "unary", "scores"}]} or {"error"}.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import traceback

import torch

DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}


CONFIG_CONTEXT = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInAttention(torch.nn.Module):
    """In place of a layer's vLLM `Attention`: records the context keys/values vLLM's precompute writes to the
    cache (`impl.do_kv_cache_update`), and attends the block's queries over them and the block's own keys."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.impl, self.kv_cache, self.context = self, None, None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.context = (key.clone(), value.clone())  # (n, nkv, d) each

    def forward(self, q, k, v):
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim).transpose(0, 1)  # (nh, T, d)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.context is not None:
            k, v = torch.cat([self.context[0], k]), torch.cat([self.context[1], v])
        groups = self.num_heads // self.num_kv_heads
        k = k.transpose(0, 1).repeat_interleave(groups, 0)  # (nh, S, d)
        v = v.transpose(0, 1).repeat_interleave(groups, 0)
        weights = torch.softmax((q @ k.transpose(1, 2)).float() * self.scale, -1)
        return (weights.to(v.dtype) @ v).transpose(0, 1).reshape(T, -1)


def serving_report(vllm_config) -> dict:
    """What vLLM's own config code says about serving this draft here."""
    from vllm.triton_utils import HAS_TRITON

    report = {"has_triton": bool(HAS_TRITON)}
    try:
        report["unsupported_on_v2"] = list(vllm_config._get_v2_model_runner_unsupported_features())
        report["uses_v2_model_runner"] = bool(vllm_config.use_v2_model_runner)
        report["candidate_head_draft"] = bool(vllm_config._is_dflash_candidate_draft())
    except Exception as err:  # a reading that vLLM's code no longer offers is reported, not fatal
        report["error"] = f"{type(err).__name__}: {err}"
    return report


def load(job: dict):
    """vLLM's config, model and load report for the job's folder (module docstring)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    from vllm.config import VllmConfig

    args = EngineArgs(model=job["verifier"], dtype="float32", enforce_eager=True, max_model_len=512,
                      skip_tokenizer_init=True, distributed_executor_backend="uni",
                      speculative_config={"method": "dflash", "model": job["drafter"],
                                          "num_speculative_tokens": job["k"]})
    serving = {}
    for runner in ("0", "1"):  # what each model runner says of serving this folder here
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
        try:
            args.create_engine_config()
            serving[f"v{int(runner) + 1}"] = "accepted"
        except Exception as err:
            found = re.search(r"Model Runner V\d [^\[]*", str(err))
            serving[f"v{int(runner) + 1}"] = (found.group(0) if found else str(err)).strip()[:300]
    del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    # No runner is started here: its refusal (above) is skipped to build the config the model class reads.
    check = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        vllm_config = args.create_engine_config()
    finally:
        VllmConfig._validate_v1_model_runner = check
    global CONFIG_CONTEXT  # held for the rest of this one-job process (the forward reads it too)
    CONFIG_CONTEXT = set_current_vllm_config(vllm_config)
    CONFIG_CONTEXT.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
    initialize_model_parallel(1, 1)
    draft_config = vllm_config.speculative_config.draft_model_config

    from vllm.model_executor.models.registry import ModelRegistry

    cls, arch = ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)
    fed, reached, unwritten = [], {}, []
    original = cls.load_weights

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, param in self.named_parameters():
            param.data.fill_(float("nan"))
            inner = getattr(param, "weight_loader", default_weight_loader)

            def wrapped(p, loaded, *rest, _inner=inner, _name=name, **kw):
                reached.setdefault(id(loaded), set()).add(_name)
                return _inner(p, loaded, *rest, **kw)

            param.weight_loader = wrapped

        def tee():
            for name, tensor in weights:
                fed.append((name, id(tensor), tensor))
                yield name, tensor

        loaded = original(self, tee())
        unwritten.extend(sorted(n for n, p in self.named_parameters() if torch.isnan(p).any()))
        verifier = load_file(os.path.join(job["verifier"], "model.safetensors"))
        with torch.no_grad():  # the verifier's, as vLLM's proposer shares them; before the CPU repacks weights
            self.model.embed_tokens.weight.copy_(verifier["model.embed_tokens.weight"])
            self.lm_head.weight.copy_(verifier.get("lm_head.weight", verifier["model.embed_tokens.weight"]))
            self.model.mask_embedding.zero_()  # vLLM's own value when the folder has no mask_embedding.pt
        return loaded

    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before it loads a model
    cls.load_weights = load_weights
    try:
        model = get_model(vllm_config=vllm_config, model_config=draft_config)
    finally:
        cls.load_weights = original
    skipped = sorted(name for name, ident, _ in fed if ident not in reached)
    written_by = {name: sorted(reached.get(ident, ())) for name, ident, _ in fed}
    report = {"serving": serving, "model_class": type(model).__name__, "architecture": arch,
              "file_tensors": [n for n, _, _ in fed],
              "skipped": skipped, "unwritten": unwritten, "written_by": written_by,
              "parameters": sorted(n for n, _ in model.named_parameters())}
    return vllm_config, model, report


def run_block(model, block: dict, k: int, mask_token_id: int) -> dict:
    features = torch.tensor(block["features"], dtype=torch.float32)  # (n, L*H)
    n = features.shape[0]
    stand_ins = []
    for layer in model.model.layers:
        attn = layer.self_attn
        stand_ins.append(StandInAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling))
        attn.attn = stand_ins[-1]
    model.model._attn_layers = stand_ins
    inner = model.model
    kernel = type(inner)._normalize_context_k
    drift = []

    def per_layer_k_norm(all_k):  # (L, n, nkv, d): layer i's keys normed with layer i's k_norm weight
        theirs = kernel(inner, all_k)
        x = all_k.float()
        ours = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inner._rms_norm_eps)).to(all_k.dtype) \
            * inner._k_norm_weights[:, None, None, :]
        drift.append(float((theirs - ours).abs().max()))
        return ours

    inner._normalize_context_k = per_layer_k_norm
    with torch.no_grad():
        context = model.combine_hidden_states(features)
        model.precompute_and_store_context_kv(context, torch.arange(n), torch.arange(n))
        ids = torch.tensor([block["anchor"]] + [mask_token_id] * k)
        hidden = model(ids, torch.arange(n, n + k + 1))  # (k + 1, H), final-normed
        logits = model.compute_logits(hidden)
        candidates, unary = model.compute_candidates(hidden[1:])  # (k, C) each
        scores = model.model.candidate_selector(candidates[None], unary[None], hidden[None, 1:],
                                                torch.tensor([block["anchor"]]))  # (1, k, C, C)
    return {"k_norm_kernel_drift": drift[0], "hidden": hidden.tolist(), "logits": logits.tolist(),
            "candidates": candidates.tolist(),
            "unary": unary.tolist(), "scores": scores[0].tolist()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_dflash2_runner.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    with open(argv[0]) as f:
        job = json.load(f)
    import vllm

    torch.set_num_threads(1)
    result = {"vllm": vllm.__version__}
    try:
        vllm_config, model, result["load"] = load(job)
        result["serving"] = serving_report(vllm_config)
        mask = int(model.config.dflash_config["mask_token_id"])
        result["blocks"] = [run_block(model, block, job["k"], mask) for block in job["blocks"]]
    except Exception as err:  # reported to the caller
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-4000:]
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, allow_nan=True)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
