"""Run decoding jobs in real vLLM and write what it did: outputs, per-request accepted counts per step, metrics.

    .venv-vllm/bin/python eval/interop/vllm_runner.py JOB.json RESULT.json

This file runs in vLLM's own environment (scripts/setup_vllm.sh: its Python, its torch, its transformers), so it
imports nothing of draftheads: only the standard library and vLLM. eval/interop/vllm_peer.py writes the job and reads the
result. One process runs every case of a job, so vLLM is imported once (~10 s here).

A job is {"cases": [case, ...]}; a case:
    name            a label
    verifier        the verifier folder
    drafter         the drafter folder, or null for plain decoding
    method          vLLM's speculative method ("eagle", "eagle3", "medusa"), or null with serve_drafter
    serve_drafter   LLM(model=drafter): a speculators-format folder names its verifier itself
    k               num_speculative_tokens
    dtype           "float32" | "bfloat16"
    batches         [[prompt token ids, ...], ...]: each batch is one `generate` call
    max_tokens, temperature, top_p, seed
    repeat          time each batch this many times and keep the fastest (default 1)
A result is {"cases": [{name, ok, error, construct_s, batches: [{outputs, per_step_accepted, per_step_drafted,
generate_s, tokens, metrics}]}], "vllm": version}. `metrics` are the batch's deltas of vLLM's own counters
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._per_pos`).

Settings for a small CPU machine, found by measuring (each can be overridden in the environment): the KV cache
1 GiB (unset, vLLM takes ~85% of free memory), engine and worker in this process (the default spawns two more
processes that import vLLM again, ~10 s each), no thread binding (binding pins the whole process to one core), no
hub access. Sampling requests get seeds seed, seed+1, ... in batch order.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            values = getattr(m, "values", None)
            out[m.name] = list(values) if values is not None else getattr(m, "value", None)
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - (old or 0)
    return out


def run_case(case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result = {"name": case["name"], "ok": False}
    kwargs = dict(dtype=case.get("dtype", "float32"), enforce_eager=True, disable_log_stats=False,
                  seed=case.get("seed", 0), max_model_len=case.get("max_model_len", 512), skip_tokenizer_init=True,
                  distributed_executor_backend="uni")
    model = case["verifier"]
    if case.get("serve_drafter"):
        model = case["drafter"]
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    elif case.get("drafter"):
        kwargs["speculative_config"] = {"method": case["method"], "model": case["drafter"],
                                        "num_speculative_tokens": case.get("k", 3),
                                        **case.get("speculative_options", {})}
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    llm = None
    try:
        t0 = time.perf_counter()
        llm = LLM(model=model, **kwargs)
        result["construct_s"] = round(time.perf_counter() - t0, 2)
        result["batches"] = []
        seed = case.get("seed", 0)
        for prompts in case["batches"]:
            params = []
            for _ in prompts:
                params.append(SamplingParams(temperature=case.get("temperature", 0.0), top_p=case.get("top_p", 1.0),
                                             max_tokens=case["max_tokens"], ignore_eos=case.get("ignore_eos", True),
                                             seed=seed if case.get("temperature", 0.0) > 0 and case.get("request_seeds", True) else None))
                seed += 1
            requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            best, outs, spec = None, None, None
            for _ in range(max(1, case.get("repeat", 1))):
                before = metrics(llm)
                t0 = time.perf_counter()
                outs = llm.generate(requests, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                spec = delta(metrics(llm), before)
                best = seconds if best is None else min(best, seconds)
            per_request = [o.outputs[0].spec_decode_metrics for o in outs]
            result["batches"].append({
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "per_step_accepted": [list(getattr(m, "per_step_accepted", None) or []) for m in per_request],
                "per_step_drafted": [list(getattr(m, "per_step_drafted", None) or []) for m in per_request],
                "generate_s": round(best, 4), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "metrics": spec})
        result["ok"] = True
    except Exception as err:  # reported to the caller, who decides what it means (a refusal is a result)
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        del llm
        gc.collect()
    return result


def speculators_logits(case: dict) -> dict:
    """The speculators library's own reading of a speculators-format folder: `SpeculatorModel.from_pretrained`, then
    its Eagle3 forward for one step over the given (input ids, verifier features) pairs; the logits are read at its
    lm_head (a forward hook), so nothing of the forward is rewritten here."""
    import torch
    from speculators import SpeculatorModel

    result = {"name": case["name"], "ok": False}
    try:
        model = SpeculatorModel.from_pretrained(case["drafter"]).eval().float()
        seen, heads = [], {}
        model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
        for key, name in (("markov_bias", "markov_head.markov_w2"), ("confidence", "confidence_head")):
            try:  # a DSpark folder: its Markov bias and confidence logits, as its own heads compute them
                module = model.get_submodule(name)
            except AttributeError:
                continue
            module.register_forward_hook(lambda module, args, out, key=key: heads.setdefault(key, out.detach()))
        ids = torch.tensor([case["input_ids"]])
        hidden = torch.tensor([case["hidden_states"]], dtype=torch.float32)
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
        result.update(ok=True, model_class=type(model).__name__, logits=seen[0][0].tolist())
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    return result


def speculators_dflash_logits(case: dict) -> dict:
    """The speculators library's own reading of a speculators-format DFlash folder: `SpeculatorModel.from_pretrained`
    (the verifier's embedding and lm_head loaded from the folder's verifier path, as it does), then its training
    forward over one row whose loss mask holds only the given anchors, so its anchor sampling draws exactly those
    blocks; the logits are read at its lm_head (a forward hook), and for a DSpark folder its Markov head's bias and
    its confidence head's logits too (hooks on markov_head.markov_w2 and confidence_head). Two switches a CPU needs,
    the same its trainer takes as flags: sdpa attention (its default builds a compiled flex-attention block mask)
    and the eager loss (its default is a Triton kernel)."""
    import torch
    from speculators import SpeculatorModel, SpeculatorModelConfig

    result = {"name": case["name"], "ok": False}
    try:
        config = SpeculatorModelConfig.from_pretrained(case["drafter"])
        config.transformer_layer_config._attn_implementation = "sdpa"  # --draft-attn-impl sdpa
        model = SpeculatorModel.from_pretrained(case["drafter"], config=config).eval().float()
        seen, heads = [], {}
        model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
        for key, name in (("markov_bias", "markov_head.markov_w2"), ("confidence", "confidence_head")):
            try:  # a DSpark folder: its Markov bias and confidence logits, as its own heads compute them
                module = model.get_submodule(name)
            except AttributeError:
                continue
            module.register_forward_hook(lambda module, args, out, key=key: heads.setdefault(key, out.detach()))
        ids = torch.tensor([case["input_ids"]])
        hidden = torch.tensor([case["hidden_states"]], dtype=torch.float32)
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, case["anchors"]] = 1
        kwargs, _ = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                  max_anchors=len(case["anchors"]))
        last = torch.zeros(1, ids.shape[1], config.transformer_layer_config.hidden_size)  # only its loss reads it
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=last,
                  document_ids=torch.zeros_like(ids), **kwargs)
        logits = seen[0][0]
        if logits.shape[0] != len(case["anchors"]) * model.block_size:  # an anchor its sampling could not draw
            raise ValueError(f"{logits.shape[0]} block positions for {len(case['anchors'])} anchors of block "
                             f"{model.block_size}: anchors must be distinct and < T - block_size")
        result.update(ok=True, model_class=type(model).__name__, block_size=model.block_size, logits=logits.tolist())
        if "markov_bias" in heads:
            result["markov_bias"] = heads["markov_bias"].reshape(logits.shape[0], -1).tolist()
        if "confidence" in heads:
            result["confidence_logits"] = heads["confidence"].reshape(-1).tolist()
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    return result


def _dspark_forward(case: dict) -> dict:
    """vLLM's Qwen3DSparkModel class on a DSpark folder (eval/interop/vllm_dspark.py, loaded by path: this file
    runs as a script in vLLM's environment)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vllm_dspark", os.path.join(os.path.dirname(__file__),
                                                                               "vllm_dspark.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dspark_forward(case)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    with open(argv[0]) as f:
        job = json.load(f)
    import vllm

    run = {"speculators_logits": speculators_logits, "speculators_dflash_logits": speculators_dflash_logits,
           "vllm_dspark_forward": _dspark_forward}
    results = {"vllm": vllm.__version__,
               "cases": [run.get(case.get("kind"), run_case)(case) for case in job["cases"]]}
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
