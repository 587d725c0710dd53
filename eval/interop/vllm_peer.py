"""vLLM as a decoding peer: run cases in real vLLM (its CPU build works) from this environment and read back what
it did, so our exports are proven in the engine people serve with, not only against our reading of its loader.

    from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
    results = run_vllm([VllmCase("eagle3", verifier_dir, drafter_dir, "eagle3", batches=[[ids, ...]])])

vLLM pins its own torch and transformers, so it lives in its own environment (`bash scripts/setup_vllm.sh` makes
`.venv-vllm/`); the cases run there in one subprocess (eval/interop/vllm_runner.py, which imports nothing of ours). Which
Python: $DRAFTHEADS_VLLM_PYTHON, else `.venv-vllm/bin/python` of this checkout, else this interpreter when it can
import vllm.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_runner.py")
ROOT = Path(__file__).resolve().parents[2]  # the checkout: eval/interop/ -> eval/ -> the root


class VllmUnavailable(RuntimeError):
    """No Python with vLLM could be found or started; the message says how to set one up."""


@dataclass
class VllmCase:
    """One LLM(...) in vLLM and the generate calls made with it (eval/interop/vllm_runner.py's case)."""

    name: str
    verifier: str
    drafter: str | None = None
    method: str | None = None
    batches: list[list[list[int]]] = field(default_factory=list)
    k: int = 3
    dtype: str = "float32"
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    serve_drafter: bool = False
    repeat: int = 1
    max_model_len: int = 512
    ignore_eos: bool = True
    """Generate max_tokens whatever comes (comparisons); False: stop at the verifier's EOS, as a server does."""
    request_seeds: bool = True
    speculative_options: dict = field(default_factory=dict)
    """More fields of vLLM's speculative_config (e.g. draft_sample_method)."""
    """At T > 0, seed request i with seed + i (reproducible); False: vLLM's own random stream."""


def vllm_python() -> str:
    """The Python that runs vLLM (module docstring); VllmUnavailable when there is none."""
    explicit = os.environ.get("DRAFTHEADS_VLLM_PYTHON")
    if explicit:
        if not Path(explicit).is_file():
            raise VllmUnavailable(f"DRAFTHEADS_VLLM_PYTHON={explicit!r}: no such file")
        return explicit
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.is_file():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmUnavailable("vLLM is not installed: run `bash scripts/setup_vllm.sh` (a separate .venv-vllm with the "
                          "CPU build, ~3.5 min and 2.7 GB) or set DRAFTHEADS_VLLM_PYTHON to a Python that has vllm")


@dataclass
class SpeculatorsLogits:
    """The speculators library loads a folder with its own classes and computes EAGLE-3 logits for one step."""

    name: str
    drafter: str
    input_ids: list[int]
    """(T,) the token of each pair (x_{t+1})."""
    hidden_states: list[list[float]]
    """(T, 3H) the verifier's features at t (the three layers concatenated)."""
    kind: str = "speculators_logits"


@dataclass
class SpeculatorsDFlashLogits:
    """The speculators library loads a DFlash folder with its own classes and computes the logits of anchored blocks
    through its own forward."""

    name: str
    drafter: str
    input_ids: list[int]
    """(T,) one row of tokens."""
    hidden_states: list[list[float]]
    """(T, nH) the verifier's target-layer outputs at each position, concatenated in layer order."""
    anchors: list[int]
    """increasing positions, each < T - block_size: the blocks drafted (the only loss-masked positions, so its
    anchor sampling takes exactly these)."""
    kind: str = "speculators_dflash_logits"


@dataclass
class VllmDSparkForward:
    """vLLM's own Qwen3DSparkForCausalLM constructed on a DSpark folder, loaded through its load_weights and run
    forward on one block (eval/interop/vllm_dspark.py)."""

    name: str
    verifier: str
    drafter: str
    k: int
    target_hidden: list[list[float]]
    """(n, L*H) the verifier's target-layer outputs at positions 0..n-1, concatenated in layer order."""
    block_ids: list[int]
    """(N,) [anchor, mask x (N-1)], the anchor at position n."""
    prev: list[int]
    """(N-1,) the token before each drafted position (the Markov head's input)."""
    kind: str = "vllm_dspark_forward"


def run_vllm(cases: list, timeout: float = 1800) -> dict:
    """Run the cases in one vLLM process; returns the runner's result ({"vllm": version, "cases": [...]}), one
    entry per case in order (a case vLLM refused has ok False and vLLM's error)."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-job-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"cases": [dataclasses.asdict(c) for c in cases]}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
        try:
            proc = subprocess.run([python, str(RUNNER), str(job), str(out)], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise VllmUnavailable(f"vLLM ({python}) did not finish {len(cases)} case(s) in {timeout:.0f} s") from None
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise VllmUnavailable(f"vLLM ({python}) exited with {proc.returncode}: {tail[0][:500]}")
        return json.loads(out.read_text())
