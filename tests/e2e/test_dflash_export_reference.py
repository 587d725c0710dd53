"""Our DFlash *export folder* in z-lab's reference (`dflash` 0.1.0 in .venv-dflash: scripts/setup_dflash_reference.sh):
`DFlashDraftModel.from_pretrained(export)` loads it strictly (config fields and weight names as written by
`export_dflash`), and the reference's `dflash_generate` with it decodes token for token what our engine decodes
from the same folder (`method="dflash"`, first token from the prefill as the reference takes it), with the same
tokens per step. tests/e2e/test_dflash_reference.py compares the drafter's computation itself."""

from __future__ import annotations

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.export import export_dflash
from tests.dflash_reference import NEW_TOKENS, PROMPT, lively_case
from tests.e2e.test_dflash_reference import run_reference
from tests.e2e.test_dflash_reference import pytestmark, reference_ready  # noqa: F401 (the venv check)


def test_reference_reads_our_export_and_decodes_as_our_engine(tmp_path):
    _, verifier, drafter, _, case = lively_case(tmp_path / "case", rows=1, first_position=0)
    export_dflash(drafter, case / "drafter", verifier)  # the reference loads the export itself
    ref = run_reference(case)

    dec = SpeculativeDecoder(verifier, make_drafter("dflash", verifier, str(case / "drafter")), "dflash",
                             first_token="prefill")
    out = dec.generate([PROMPT], NEW_TOKENS, eos_token_id=None)
    assert out.output_ids[0] == ref["output_ids"][len(PROMPT):].tolist()
    produced = [a + 1 for a in out.stats.accepted[0]]
    assert produced[:-1] == ref["acceptance_lengths"][:-1].tolist()
    assert len(set(produced)) > 2 and max(produced) == drafter.block_size  # the counts vary: a misread export shows
