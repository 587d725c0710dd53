"""Our DFlash drafter against z-lab's reference (`dflash` 0.1.0, in .venv-dflash: scripts/setup_dflash_reference.sh),
run in a subprocess on the same weights and inputs: the reference loads our state dict strictly into its
`DFlashDraftModel`, its hidden states and logits equal ours (float32), and its `dflash_generate` decodes greedily
what our reference-style loop decodes, token for token and with the same tokens accepted at every step."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.dflash_reference import NEW_TOKENS, PROMPT, greedy_decode, lively_case

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-dflash" / "bin" / "python"


@pytest.fixture
def reference_ready():
    """The reference's venv, as the vLLM interop suite treats vLLM: a missing one fails (a skipped equality check
    would pass unseen); DRAFTHEADS_DFLASH_REFERENCE=0 leaves the check out, as scripts/test.sh does then."""
    if os.environ.get("DRAFTHEADS_DFLASH_REFERENCE") == "0":
        pytest.skip("DRAFTHEADS_DFLASH_REFERENCE=0: the check against z-lab's reference DFlash is left out")
    if not PYTHON.exists():
        pytest.fail(f"no {PYTHON.parent.parent}: `bash scripts/setup_dflash_reference.sh` installs z-lab's reference "
                    "DFlash for this check (DRAFTHEADS_DFLASH_REFERENCE=0 leaves it out)", pytrace=False)


pytestmark = pytest.mark.usefixtures("reference_ready")

def run_reference(case: Path) -> dict:
    from safetensors.torch import load_file

    proc = subprocess.run([str(PYTHON), str(ROOT / "tests" / "dflash_reference_runner.py"), str(case)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(case / "reference.safetensors"))


def test_reference_equality(tmp_path):
    target, _, drafter, inputs, case = lively_case(tmp_path / "case", rows=2, first_position=3)
    ref = run_reference(case)

    with torch.no_grad():
        hidden = drafter(**inputs)
        logits = drafter.logits(hidden)
    assert torch.allclose(hidden, ref["hidden"], atol=1e-5, rtol=1e-5), (hidden - ref["hidden"]).abs().max()
    assert torch.allclose(logits, ref["logits"], atol=1e-5, rtol=1e-5), (logits - ref["logits"]).abs().max()

    output, produced = greedy_decode(drafter, target, torch.tensor([PROMPT]), NEW_TOKENS)
    assert output[0].tolist() == ref["output_ids"].tolist()
    assert produced == ref["acceptance_lengths"].tolist()
    assert len(set(produced)) > 2 and max(produced) == drafter.block_size  # counts vary: a wrong drafter shows
