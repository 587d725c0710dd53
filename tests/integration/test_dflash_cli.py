"""The dflash method through the commands people run: `draftheads eval --method dflash --draft EXPORT` (greedy
outputs equal plain decoding's, the block's drafts counted) and `draftheads tune --candidate dflash=EXPORT` (chains
only up to the trained block; the settings vLLM and SGLang take)."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.eval.__main__ import main
from draftheads.eval.measure.report import read_results
from draftheads.eval.measure.tune import Prediction, serve_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from draftheads.models.dflash import DFlashConfig, build_drafter
    from draftheads.models.export import export_dflash
    from draftheads.models.verifier import Verifier
    from tests.eval_fixtures import build_eval_setup

    root = build_eval_setup(tmp_path_factory.mktemp("dflash-cli"))
    verifier = Verifier.from_pretrained(root / "verifier")
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=4, mask_token_id=0))
    export_dflash(drafter, root / "dflash", verifier)
    return root


def test_eval_runs_dflash(setup, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--verifier", str(setup / "verifier"), "--method", "dflash", "--draft", str(setup / "dflash"),
                 "--prompts", "humaneval", "--num-prompts", "2", "--max-new-tokens", "12", "--batch-size", "2",
                 "--threads", "1", "--out", str(out)]) == 0
    assert "| dflash |" in capsys.readouterr().out
    results = read_results(out)
    row = results["summary"]["dflash"]
    assert row["lossless"] and row["tau"] >= 1.0
    for sample in results["samples"]:  # greedy: the same tokens as plain decoding
        runs = sample["runs"]
        assert runs["dflash"]["output_ids"] == runs["autoregressive"]["output_ids"], sample["id"]


def test_tune_takes_a_dflash_candidate(setup, tmp_path, capsys):
    out = tmp_path / "tune"
    code = main(["tune", "--verifier", str(setup / "verifier"), "--candidate", f"dflash={setup / 'dflash'}",
                 "--prompts", "humaneval", "--num-prompts", "2", "--max-new-tokens", "12", "--max-draft", "5",
                 "--confirm", "1", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "tune.json").read_text())
    assert {p["n"] for p in result["predictions"]} == {1, 2, 3}  # no longer than the trained block's 3 drafts
    assert result["vllm_speculative_config"]["method"] == "dflash"


def test_serve_settings_for_dflash():
    vllm, sglang = serve_config(Prediction("d", "dflash", "runs/d/drafter", 7, 3.0, 2.0))
    assert vllm == {"method": "dflash", "model": "runs/d/drafter", "num_speculative_tokens": 7}
    assert "--speculative-algorithm DFLASH" in sglang and "--speculative-num-draft-tokens 8" in sglang
