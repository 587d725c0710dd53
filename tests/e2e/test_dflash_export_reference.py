"""Our DFlash *export folder* in z-lab's reference (`dflash` 0.1.0 in .venv-dflash: scripts/setup_dflash_reference.sh):
`DFlashDraftModel.from_pretrained(export)` loads it strictly (config fields and weight names as written by
`export_dflash`), and the reference's `dflash_generate` with it decodes token for token what our engine decodes
from the same folder (`method="dflash"`, first token from the prefill as the reference takes it), with the same
tokens per step. tests/e2e/test_dflash_reference.py compares the drafter's computation itself."""

from __future__ import annotations

import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.export import export_dflash
from draftheads.models.verifier import Verifier
from tests.dflash_reference import write_case
from tests.e2e.test_dflash_reference import NEW_TOKENS, PROMPT, run_reference
from tests.e2e.test_dflash_reference import pytestmark, reference_ready  # noqa: F401 (the venv check)
from tests.utils import tiny_model


def test_reference_reads_our_export_and_decodes_as_our_engine(tmp_path):
    target = tiny_model("qwen3", seed=1, num_layers=6, vocab_size=4, initializer_range=0.5)
    verifier = Verifier(target)
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=4, mask_token_id=3)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(0)
    n, N, H = 5, drafter.block_size, drafter.cfg.hidden_size
    inputs = {"target_hidden": torch.randn(1, n, 2 * H, generator=g),
              "noise_embedding": torch.randn(1, N, H, generator=g), "position_ids": torch.arange(n + N)[None]}
    case = write_case(tmp_path / "case", drafter, inputs, target,
                      {"input_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "stop": None})
    export_dflash(drafter, case / "drafter", verifier)  # the reference loads the export itself
    ref = run_reference(case)

    dec = SpeculativeDecoder(verifier, make_drafter("dflash", verifier, str(case / "drafter")), "dflash",
                             first_token="prefill")
    out = dec.generate([PROMPT], NEW_TOKENS, eos_token_id=None)
    assert out.output_ids[0] == ref["output_ids"][len(PROMPT):].tolist()
    produced = [a + 1 for a in out.stats.accepted[0]]
    assert produced[:-1] == ref["acceptance_lengths"][:-1].tolist()
    assert len(set(produced)) > 2 and max(produced) == N  # the counts vary: a misread export would show
