"""vLLM as the data engine: one long-lived vLLM `LLM` that regenerates answers or captures hidden states on request.

    .venv-vllm/bin/python eval/interop/vllm_data_runner.py        # driven by eval/interop/vllm_data.py

This file runs in vLLM's own environment (scripts/setup_vllm.sh), so it imports nothing of draftheads: only the
standard library, vLLM, and the connector beside it (vllm_hidden_states_connector.py). It reads one JSON request per
line on stdin and answers one JSON line per request on the stdout it was started with; everything vLLM prints goes
to stderr. A request that fails is answered {"error": "<Type>: <the message on one line>"} and the process
stays up for the next one (a failed "start" leaves nothing to use: the caller stops).

    {"op": "start", "verifier": DIR, "dtype": "float32", "max_model_len": N, "seed": 0,
     "tensor_parallel_size": 1, "capture_layers": [ids] | null, "storage": DIR,
     "prefix_caching": null, "block_size": null}                 -> {"ok": true, "vllm": version}
        capture_layers: vLLM's `eagle_aux_hidden_state_layer_ids`; with them the LLM runs the `extract_hidden_states`
        speculative method and writes each request's states under `storage`
        prefix_caching: default on without capture_layers, off with them; block_size: tokens per KV block (vLLM's
        default when null). With capture_layers the states live in a cache-only layer's KV blocks, so a prefix
        served from the cache serves its states too (what `regenerate --capture` relies on)
    {"op": "capture", "requests": [[token ids], ...]}  -> {"files": [path, ...], "cached_tokens": N}  (request order)
        each file: safetensors {"hidden_states": (tokens, layers, H) in ascending layer order, "token_ids"};
        cached_tokens: the requests' tokens vLLM's prefix cache served
    {"op": "generate", "prompts": [[token ids], ...], "max_tokens": N, "temperature": 0.0, "top_p": 1.0,
     "stop_ids": [ids], "seed": 0}                               -> {"outputs": [[new token ids], ...]}
        request i is seeded with seed + i at temperature > 0; generation ends at a stop id (kept in the output)
        or after max_tokens; vLLM's own EOS handling and the model's generation_config are not used. On an engine
        with capture_layers the prompts' state files the connector writes are removed
    {"op": "stop"}                                               -> {"ok": true}, then exit

Settings for a small CPU machine are vllm_runner.py's (each overridable in the environment).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
CONNECTOR = {"kv_connector": "HostHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_states_connector",
             "kv_role": "kv_producer"}
FLUSH_S = 600.0


class Engine:
    def __init__(self, job: dict):
        from vllm import LLM

        self.capture_layers = job.get("capture_layers")
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        tp = int(job.get("tensor_parallel_size", 1))
        kwargs = dict(dtype=job.get("dtype", "float32"), max_model_len=int(job["max_model_len"]),
                      seed=int(job.get("seed", 0)), tensor_parallel_size=tp, enforce_eager=True,
                      skip_tokenizer_init=True, generation_config="vllm", trust_remote_code=False)
        prefix_caching = job.get("prefix_caching")
        kwargs["enable_prefix_caching"] = not self.capture_layers if prefix_caching is None else bool(prefix_caching)
        if job.get("block_size"):
            kwargs["block_size"] = int(job["block_size"])
        if tp == 1 and self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if self.capture_layers:
            self.storage = Path(job["storage"])
            self.storage.mkdir(parents=True, exist_ok=True)
            kwargs["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.capture_layers)}}}
            kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": {
                "shared_storage_path": str(self.storage), "use_synchronization_lock": False}}
        self.llm = LLM(model=job["verifier"], **kwargs)

    def capture(self, job: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not self.capture_layers:
            raise ValueError("this engine was started without capture_layers")
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["requests"]]
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        files = self._flush(outs)
        return {"files": [str(f) for f in files], "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}

    def _flush(self, outs) -> list[Path]:
        """The state files of finished requests `outs`, once all are written."""
        files = [Path((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outs]
        # The connector writes a request's file one engine step after the request finished: the last ones are
        # still pending when generate returns. In-process, step the engine until they are written; otherwise the
        # engine's own loop keeps stepping while the connector holds finished requests.
        deadline = time.monotonic() + FLUSH_S
        while not all(f.is_file() for f in files):
            if time.monotonic() > deadline:
                missing = next(f for f in files if not f.is_file())
                raise TimeoutError(f"{missing}: vLLM did not write the hidden states within {FLUSH_S:.0f} s")
            if self.in_process:
                self.llm.llm_engine.step()
            else:
                time.sleep(0.02)
        return files

    def generate(self, job: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        temperature, seed = float(job.get("temperature", 0.0)), int(job.get("seed", 0))
        params = [SamplingParams(max_tokens=int(job["max_tokens"]), temperature=temperature,
                                 top_p=float(job.get("top_p", 1.0)),
                                 stop_token_ids=list(job.get("stop_ids") or []), ignore_eos=True,
                                 seed=seed + i if temperature > 0 else None)
                  for i in range(len(job["prompts"]))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompts"]]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.capture_layers:  # the prompts' states, written as for a capture: not asked for here
            for path in self._flush(outs):
                path.unlink()
        return {"outputs": [list(o.outputs[0].token_ids) for o in outs]}


def one_line(err: BaseException) -> str:
    """The error in one line (vLLM's validation errors span several: they are joined), at most 400 characters."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:400].rstrip(": ")


def main() -> int:
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    # the connector is imported by module name: here from the script's own folder (the first entry of the path),
    # in any worker process vLLM starts through PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever vLLM or a library prints goes to stderr, not into the answers
    engine = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            op = job.get("op")
            if op == "stop":
                answers.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op == "start":
                engine = Engine(job)
                import vllm

                answer = {"ok": True, "vllm": vllm.__version__}
            elif engine is None:
                raise RuntimeError(f"op {op!r} before a successful start")
            elif op == "capture":
                answer = engine.capture(job)
            elif op == "generate":
                answer = engine.generate(job)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as err:  # answered as one line; the details go to stderr (the caller's log)
            traceback.print_exc()
            answer = {"error": one_line(err)}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
