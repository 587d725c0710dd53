#!/usr/bin/env python
"""Load a drafter folder with SGLang's own loader and report what it wrote, skipped and would capture.

    .venv-sglang/venv/bin/python eval/interop/sglang_runner.py DRAFTER_DIR [--target VERIFIER_DIR]
        [--algo EAGLE|EAGLE3|DFLASH]

This file runs in SGLang's environment (scripts/setup_sglang.sh) and imports nothing of draftheads.

Runs SGLang 0.5.23's real code path on CPU (tp=1, gloo):
  ServerArgs -> publish -> init_distributed_environment/initialize_model_parallel
  -> ModelConfig.from_server_args(is_draft_model=True) -> get_model_loader()
  -> DefaultModelLoader.load_model()  (registry lookup, model __init__,
     safetensors iterator, model.load_weights, process_weights_after_loading)
and, for EAGLE-3 and DFlash, resolve_spec_aux_hidden_state_config() +
configure_aux_hidden_state_capture() on the target model (built on 'meta'); for DFlash also the block size, mask
token and target layers SGLang's parse_dflash_draft_config reads from the folder.

Instrumentation (no SGLang file is changed):
  * every parameter is filled with NaN just before load_weights runs, so a
    parameter still holding NaN afterwards was not written (or only in part);
  * each parameter's weight_loader is wrapped to record which checkpoint
    tensor (and shard id) wrote it; a checkpoint name that reached no
    weight_loader was skipped by SGLang's load_weights;
  * the written values are compared with the checkpoint tensors.

The last line printed is the JSON report; the exit status is 0 when nothing is missing, skipped or different.
"""
import argparse
import importlib.util  # noqa: E402
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
_spec = importlib.util.spec_from_file_location("_sglstub", os.path.join(HERE, "sglang_stubs.py"))
_sglstub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sglstub)

# torchvision: the PyPI wheel is the CUDA build (its _C.so needs libc10_cuda.so);
#   SGLang only imports it at module level for multimodal processors/configs.
# vllm._custom_ops: SGLang's non-CUDA/non-CPU branches import CUDA kernels from
#   vLLM (RotaryEmbedding fallback kernel, rms_norm); they are only stored for
#   use in forward(). Only these two module names are faked, nothing under them.
_sglstub.install(trees=["torchvision"], exact=["vllm", "vllm._custom_ops"])

import torch  # noqa: E402

torch.set_num_threads(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("--target", help="verifier dir (default: draftheads.verifier.name)")
    ap.add_argument("--algo", choices=["EAGLE", "EAGLE3", "DFLASH"])
    args = ap.parse_args()
    drafter = os.path.abspath(args.drafter)
    cfg_json = json.load(open(os.path.join(drafter, "config.json")))
    arch = (cfg_json.get("architectures") or [""])[0]
    algo = args.algo or ("DFLASH" if arch == "DFlashDraftModel" else "EAGLE3" if "Eagle3" in arch else "EAGLE")
    target = args.target or (cfg_json.get("draftheads", {}).get("verifier", {}).get("name"))
    if not target or not os.path.isdir(target):
        sys.exit(f"need --target (verifier folder with config.json); got {target!r}")

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # Same as sglang.test.layer_ut_utils.init_single_process_dist +
    # sglang.test.test_utils.publish_build_topology (not imported: test_utils
    # pulls in the benchmark stack / `datasets`), but with the speculative args.
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    # SGLang's argument hook refuses DFLASH on a CPU device (its drafting kernels are CUDA / NPU / XPU); what this
    # runner checks, the draft loader and the capture of the target's layers, does not run those kernels. While the
    # arguments are resolved (publish), that hook alone sees the platform as an out-of-tree one that supports DFLASH
    # with the in-tree draft attention backends (falling back to triton); every other hook sees the real platform.
    from sglang.srt.arg_groups import speculative_hook

    real = speculative_hook.current_platform

    class DFlashOnCpu:
        def __getattr__(self, name):
            return getattr(real, name)

        def is_out_of_tree(self):
            return True

        def supports_speculative_algorithm(self, name):
            return name == "DFLASH"

        def supports_speculative_draft_attention_backend(self, name, backend):
            return backend in speculative_hook.DRAFT_ATTENTION_BACKEND_CHOICES

        def get_default_speculative_draft_attention_backend(self, name):
            return "triton"  # the in-tree fallback off CUDA (XPU, ROCm); only recorded in the arguments here

    if algo == "DFLASH":
        speculative_hook.current_platform = DFlashOnCpu()
    try:
        sa = ServerArgs(
            model_path=target, tp_size=1, ep_size=1, pp_size=1, device="cpu",
            speculative_algorithm=algo, speculative_draft_model_path=drafter,
        )
        publish(sa, role="test", ranks=SpawnRanks(world_rank=0))  # resolves the arguments
    finally:
        speculative_hook.current_platform = real
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")

    from safetensors import safe_open
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader as loader_mod
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    ckpt = {}
    for fn in sorted(os.listdir(drafter)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(drafter, fn), "pt") as f:
                for k in f.keys():
                    ckpt[k] = f.get_tensor(k)

    rec = {"yielded": [], "writes": {}, "params": {}, "wrap_failed": []}
    current = [None]

    orig_lwp = loader_mod.DefaultModelLoader.load_weights_and_postprocess

    def instrumented(model, weights, target_device):
        for pname, p in model.named_parameters():
            if p.is_floating_point():
                p.data.fill_(float("nan"))
            rec["params"][pname] = p
            inner = getattr(p, "weight_loader", None)

            def wrapper(param, loaded, *a, _inner=inner, _pname=pname, **kw):
                shard = a[0] if a else kw.get("loaded_shard_id", kw.get("shard_id"))
                rec["writes"].setdefault(current[0], []).append((_pname, shard))
                return (_inner or default_weight_loader)(param, loaded, *a, **kw)

            try:
                p.weight_loader = wrapper
            except Exception:  # property-style params: fall back to NaN check only
                rec["wrap_failed"].append(pname)

        def names(it):
            for name, t in it:
                current[0] = name
                rec["yielded"].append(name)
                yield name, t
            current[0] = None

        return orig_lwp(model, names(weights), target_device)

    loader_mod.DefaultModelLoader.load_weights_and_postprocess = staticmethod(instrumented)

    _sglstub.mark_imports_done()  # from here on any non-import stub use is recorded
    mc = ModelConfig.from_server_args(sa, model_path=drafter, is_draft_model=True)
    load_config = LoadConfig(load_format="auto")
    try:
        model = get_model_loader(load_config, mc).load_model(
            model_config=mc, device_config=DeviceConfig("cpu")
        )
    except Exception as e:  # e.g. SGLang's shape assertions in weight_loader
        err = {"model_class": arch, "algo": algo, "ok": False,
               "load_error": f"{type(e).__name__}: {e}",
               "while_loading_checkpoint_name": current[0]}
        del e
        return err

    # ---- parameter coverage ------------------------------------------------
    by_param = {}
    for cname, ws in rec["writes"].items():
        for pname, shard in ws:
            by_param.setdefault(pname, []).append((cname, shard))
    written, partial, not_written, mismatched, checked = [], {}, [], {}, 0
    order = {"q": 0, "k": 1, "v": 2}
    for pname, p in model.named_parameters():
        d = p.detach()
        if d.is_floating_point():
            nan = int(torch.isnan(d).sum())
        else:
            nan = 0 if pname in by_param else d.numel()
        if nan == d.numel():
            not_written.append(pname)
            continue
        written.append(pname)
        if nan:
            partial[pname] = f"{d.numel() - nan}/{d.numel()} elements written"
        srcs = sorted(by_param.get(pname, []), key=lambda s: order.get(s[1], s[1] or 0))
        if srcs and all(c in ckpt for c, _ in srcs):
            exp = torch.cat([ckpt[c] for c, _ in srcs], 0) if len(srcs) > 1 else ckpt[srcs[0][0]]
            got = d[: exp.shape[0]] if d.dim() and exp.shape != d.shape else d
            checked += 1
            if got.shape != exp.shape or not torch.equal(got, exp.to(d.dtype)):
                mismatched[pname] = f"sources {[c for c, _ in srcs]}"
    # rows beyond the real vocab that ParallelLMHead/VocabParallelEmbedding pad
    for pname in list(partial):
        mod = model.get_submodule(pname.rsplit(".", 1)[0])
        org = getattr(mod, "org_vocab_size", None)
        if org is not None:
            rows_ok = not torch.isnan(model.get_parameter(pname)[:org]).any()
            partial[pname] += (
                f"; rows {org}.. are vocab padding (padded {mod.num_embeddings_padded})"
                if rows_ok else f"; real vocab rows [0,{org}) NOT all written"
            )

    # ---- what SGLang's EAGLE worker fills from the target afterwards ----------
    from_target = []
    if algo == "EAGLE3":
        hid, thid = model.config.hidden_size, getattr(model.config, "target_hidden_size", None)
        if getattr(model, "load_lm_head_from_target", False):
            from_target += ["model.embed_tokens.weight", "lm_head.weight"]
        elif thid is None or thid == hid:  # LlamaForCausalLM.set_embed condition
            from_target.append("model.embed_tokens.weight")
    elif algo == "EAGLE":  # EAGLE-1: set_embed_and_head(embed, head)
        from_target += ["model.embed_tokens.weight", "lm_head.weight"]
    # DFLASH: the draft model has no embedding or lm_head parameters; its worker uses the target's

    consumed = {c for c in rec["writes"] if c is not None}
    skipped = [n for n in rec["yielded"] if n not in consumed]
    hot = getattr(model, "hot_token_id", None)
    if "d2t" in ckpt:
        skipped = [n for n in skipped if not (n == "d2t" and hot is not None)]
    hot_ok = None
    if algo == "EAGLE3":
        hot_ok = False
        if hot is not None and "t2d" in ckpt and "d2t" in ckpt:
            want = torch.nonzero(ckpt["t2d"].bool()).flatten()
            lm_rows = getattr(model.lm_head, "org_vocab_size", None)
            hot_ok = bool(
                hot.shape == want.shape and torch.equal(hot.long(), want.long())
                and (lm_rows is None or lm_rows == hot.numel())
                and int(hot.max()) < model.config.vocab_size
            )
        elif hot is not None:
            hot_ok = bool(int(hot.max()) < model.config.vocab_size)

    # ---- EAGLE-3 / DFlash aux layers: SGLang's resolver + target's capture hook --------
    aux_read, layers_to_capture, aux_err = None, None, None
    if algo in ("EAGLE3", "DFLASH"):
        try:
            from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
                configure_aux_hidden_state_capture,
            )
            from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
                resolve_spec_aux_hidden_state_config,
            )
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            tmc = ModelConfig.from_server_args(sa, model_path=target)
            aux = resolve_spec_aux_hidden_state_config(
                server_args=sa, model_config=tmc,
                spec_algorithm=SpeculativeAlgorithm.from_string(algo),
                is_draft_worker=False,
            )
            aux_read = aux.dflash_target_layer_ids if algo == "DFLASH" else aux.eagle_aux_hidden_state_layer_ids
            with loader_mod.set_default_torch_dtype(tmc.dtype), torch.device("meta"):
                tmodel = loader_mod._initialize_model(tmc, load_config)
            configure_aux_hidden_state_capture(
                model=tmodel,
                eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
                eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
                dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state,
                dflash_target_layer_ids=aux.dflash_target_layer_ids, is_dspark=False,
            )
            layers_to_capture = list(getattr(tmodel.model, "layers_to_capture", []))
        except Exception as e:  # report, don't die
            aux_err = f"{type(e).__name__}: {e}"

    dflash = None
    if algo == "DFLASH":
        dc = model.draft_config
        from sglang.srt.arg_groups.model_override_base import resolved_view

        # the verify window SGLang's argument hook resolved from the folder (its --speculative-num-draft-tokens)
        window = resolved_view(sa).speculative_num_draft_tokens
        dflash = {"block_size": model.block_size, "num_draft_tokens": window,
                  "mask_token_id": dc.mask_token_id,
                  "target_layer_ids": dc.target_layer_ids, "num_context_features": model.num_context_features}

    real_missing = [p for p in not_written if p not in from_target]
    report = {
        "model_class": type(model).__name__,
        "algo": algo,
        "dtype": str(mc.dtype),
        "params_total": len(list(model.named_parameters())),
        "params_written": len(written),
        "params_not_written": not_written,
        "params_not_written_filled_from_target_by_sglang": [p for p in not_written if p in from_target],
        "params_not_written_and_not_from_target": real_missing,
        "params_partially_written": partial,
        "params_value_checked": checked,
        "params_value_mismatch": mismatched,
        "checkpoint_names_skipped": skipped,
        "checkpoint_names_skipped_unexpected": [n for n in skipped if n != "t2d"],
        "hot_token_id_ok": hot_ok,
        "aux_layer_ids_read": aux_read,
        "target_layers_to_capture": layers_to_capture,
        "aux_error": aux_err,
        "dflash": dflash,
        "weight_loader_wrap_failed": rec["wrap_failed"],
        "stub_uses_after_load": _sglstub.LATE_USES,
        "load_error": None,
        "ok": not real_missing and not mismatched
        and not [n for n in skipped if n != "t2d"]
        and hot_ok is not False and aux_err is None,
    }
    return report


if __name__ == "__main__":
    import gc

    result = main()
    gc.collect()  # let progress bars of an aborted load finish writing first
    sys.stderr.flush()
    print(json.dumps(result), flush=True)
    # exit now: nothing (atexit hooks, torch.distributed warnings) prints after
    # the JSON line. Exit status 0 = ok, 1 = a problem was found.
    os._exit(0 if result.get("ok") else 1)
