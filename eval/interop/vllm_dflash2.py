"""vLLM's own DFlash2 model class on our DFlash2 exports, from this environment: eval/interop/vllm_dflash2_runner.py
runs in vLLM's venv (`vllm_peer.vllm_python()`) and reports what vLLM's loader wrote and skipped and what its forward,
logits, candidates and candidate-selector scores are on the blocks given.

    from draftheads.eval.interop.vllm_dflash2 import run_vllm_dflash2
    result = run_vllm_dflash2(verifier_dir, drafter_dir, k=3, blocks=[{"features": [[...]], "anchor": 5}])
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from draftheads.eval.interop.vllm_peer import VllmUnavailable, vllm_python

RUNNER = Path(__file__).with_name("vllm_dflash2_runner.py")


def run_vllm_dflash2(verifier: str, drafter: str, k: int, blocks: list[dict], timeout: float = 900) -> dict:
    """One runner process over the blocks ({"features": (n, L*H) the verifier's target-layer outputs at the
    context's positions 0..n-1, "anchor": the verified token at position n}); returns its result (runner
    docstring). VllmUnavailable when vLLM cannot be started."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-dflash2-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"verifier": str(verifier), "drafter": str(drafter), "k": int(k),
                                   "blocks": blocks}))
        env = {key: v for key, v in os.environ.items() if not key.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
        try:
            proc = subprocess.run([python, str(RUNNER), str(job), str(out)], env=env, capture_output=True,
                                  text=True, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise VllmUnavailable(f"vLLM ({python}) did not finish the DFlash2 job in {timeout:.0f} s") from None
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise VllmUnavailable(f"vLLM ({python}) exited with {proc.returncode}: {tail[0][:500]}")
        return json.loads(out.read_text())
