"""vLLM as the data engine, from this environment: a vLLM process that regenerates answers or captures hidden states.

    with VllmEngine(verifier_dir, dtype="float32", max_model_len=512, capture_layers=[0, 2, 4],
                    storage=tmp) as engine:
        files = engine.capture([[ids...], ...])            # safetensors per request: (tokens, layers, H)
    with VllmEngine(verifier_dir, dtype="bfloat16", max_model_len=4096, tensor_parallel_size=2) as engine:
        new_ids = engine.generate(prompts, max_tokens=256, temperature=0.0, stop_ids=[eos])

vLLM pins its own torch and transformers, so it runs in its own environment (`bash scripts/setup_vllm.sh` makes
`.venv-vllm/`; which Python: `vllm_peer.vllm_python`), as one long-lived subprocess running
eval/interop/vllm_data_runner.py: vLLM starts once (~20 s on a small CPU) and serves every request of a dump or a
regeneration. Requests and answers are JSON lines on its stdin/stdout; its own output goes to a log file, named
in every error.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from draftheads.eval.interop.vllm_peer import vllm_python

RUNNER = Path(__file__).with_name("vllm_data_runner.py")


class VllmError(RuntimeError):
    """vLLM refused a request or stopped; the message is one line (vLLM's own error) and names its log."""


class VllmEngine:
    """One vLLM `LLM` in a subprocess (module docstring). Start it with `with` or `start()`; `close()` stops it."""

    def __init__(self, verifier: str | os.PathLike, *, dtype: str = "float32", max_model_len: int = 2048,
                 capture_layers: list[int] | None = None, storage: str | os.PathLike | None = None,
                 tensor_parallel_size: int = 1, seed: int = 0, env: dict | None = None,
                 prefix_caching: bool | None = None, block_size: int | None = None):
        """prefix_caching: None = vLLM's prefix cache on for generation, off for a capture engine (the runner's
        docstring: with capture_layers on, a cached prefix serves its states too); block_size: tokens per KV block."""
        if capture_layers and storage is None:
            raise ValueError("capture_layers needs a storage folder for vLLM's hidden-state files")
        self.job = {"op": "start", "verifier": str(verifier), "dtype": dtype, "max_model_len": int(max_model_len),
                    "seed": int(seed), "tensor_parallel_size": int(tensor_parallel_size),
                    "capture_layers": list(capture_layers) if capture_layers else None,
                    "storage": str(storage) if storage is not None else None, "prefix_caching": prefix_caching,
                    "block_size": block_size}
        self.storage = Path(storage) if storage is not None else None
        self.env = dict(env or {})
        """More environment for vLLM (CUDA_VISIBLE_DEVICES, VLLM_CPU_KVCACHE_SPACE, ...)."""
        self.proc: subprocess.Popen | None = None
        self.failed = False
        """An error named the log, which close() then keeps."""
        self.version: str | None = None
        self.log: Path | None = None
        self.start_s: float | None = None
        self.captured_tokens = 0
        """Tokens of every capture request so far, and how many of them vLLM's prefix cache served."""
        self.cached_tokens = 0

    def start(self) -> "VllmEngine":
        python = vllm_python()
        fd, log = tempfile.mkstemp(prefix="draftheads-vllm-", suffix=".log")
        self.log = Path(log)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}, **self.env}
        with os.fdopen(fd, "w") as err:
            self.proc = subprocess.Popen([python, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, text=True, bufsize=1)
        t0 = time.perf_counter()
        try:
            self.version = self._ask(self.job)["vllm"]
            self.start_s = time.perf_counter() - t0
            """Seconds vLLM took to start (import, load, warm-up)."""
        except BaseException:
            self.close(keep_log=True)
            raise
        return self

    def _ask(self, job: dict) -> dict:
        if self.proc is None:
            raise VllmError("the vLLM engine is not started")
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.failed = True
            code = self.proc.wait()
            tail = [t for t in self.log.read_text(errors="replace").splitlines() if t.strip()][-1:] or ["no output"]
            raise VllmError(f"vLLM exited with {code} during {job['op']!r}: {tail[0].strip()[:300]} "
                            f"(log: {self.log})")
        answer = json.loads(line)
        if "error" in answer:
            self.failed = True
            what = "could not load" if job["op"] == "start" else f"failed to {job['op']} with"
            what = f"vLLM {what} the verifier {self.job['verifier']!r}"
            raise VllmError(f"{what}: {answer['error']} (log: {self.log})")
        return answer

    def capture(self, requests: list[list[int]]) -> list[Path]:
        """Each request's hidden-state file (runner docstring), in order; the caller reads and deletes them."""
        answer = self._ask({"op": "capture", "requests": requests})
        self.captured_tokens += sum(len(r) for r in requests)
        self.cached_tokens += answer.get("cached_tokens", 0)
        return [Path(f) for f in answer["files"]]

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 stop_ids: list[int] | None = None, seed: int = 0) -> list[list[int]]:
        """New token ids per prompt, in order (a stop id, when one ended it, is the last)."""
        return self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "temperature": temperature,
                          "top_p": top_p, "stop_ids": list(stop_ids or []), "seed": seed})["outputs"]

    def close(self, keep_log: bool = False) -> None:
        """Stop vLLM; its log is removed when it exited cleanly and no error named it (or keep_log)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            if proc.poll() is None:
                proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                proc.stdin.flush()
            proc.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.returncode == 0 and self.log is not None and not (keep_log or self.failed):
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> "VllmEngine":
        return self.start()

    def __exit__(self, kind, *exc) -> None:
        self.close(keep_log=kind is not None)
