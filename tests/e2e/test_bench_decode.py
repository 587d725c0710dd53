"""scripts/bench_decode.py, scripts/train_draft_model.py and scripts/selfdistill_data.py on a tiny random verifier."""

import json

import pytest

from tests.eval_fixtures import build_eval_setup
from tests.utils import script_module

pytestmark = pytest.mark.usefixtures("one_thread")


script = script_module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_eval_setup(tmp_path_factory.mktemp("bench"))


def test_function_prompts_end_after_the_docstring():
    source = ('import os\n\n\n@cache\ndef add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n'
              '    return a + b\n\n\nclass C:\n    def m(self):\n        "One line."\n        return 1\n\n'
              '    def no_doc(self):\n        return 2\n')
    prompts = script("selfdistill_data").function_prompts(source)
    assert prompts == ['@cache\ndef add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n',
                       'def m(self):\n    "One line."\n']
    assert script("selfdistill_data").function_prompts("def broken(:\n") == []


def test_bench_writes_results_and_goals(setup, tmp_path, capsys):
    bench = script("bench_decode")
    out = tmp_path / "bench"
    assert bench.main(["--out", str(out), "--verifier", str(setup / "verifier"), "--eagle3", str(setup / "eagle3"),
                       "--draft-model", str(setup / "draft"), "--num-prompts", "2", "--max-new-tokens", "8",
                       "--temperatures", "0", "1", "--variants", "ngram", "eagle3-chain4", "eagle3-tree-d6k2n10",
                       "hf", "hf-assisted"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["results"]) == {"0.0", "1.0"}
    summary = result["results"]["0.0"]["summary"]
    assert list(summary) == ["autoregressive", "draft-model-chain3", "ngram", "eagle3-chain4",
                             "eagle3-tree-d6k2n10", "hf", "hf-assisted"]
    assert all(row["tau"] >= 1 and row["speedup"] > 0 for row in summary.values())
    profile = result["results"]["0.0"]["step_profile"]
    assert profile["autoregressive"]["x_autoregressive_step"] == 1.0 and "eagle3-chain4" in profile
    goals = result["goals"]
    assert set(goals) == set(bench.GOALS) and goals["medusa_tau_T0"]["measured"] is None
    assert goals["eagle3_tau_T0"]["measured"] == max(summary[k]["tau"] for k in summary if k.startswith("eagle3"))
    assert (out / "T0" / "report.md").is_file() and (out / "T1" / "results.json").is_file()
    printed = capsys.readouterr().out
    assert "x HF assisted" in printed and "eagle3_tau_T0" in printed


def test_train_draft_model(setup, tmp_path):
    from draftheads.eval import build_decoder
    from draftheads.models.verifier import Verifier

    info = script("train_draft_model").train_draft_model(str(setup / "verifier"), tmp_path / "d", layers=1, steps=3,
                                                         batch_size=2, seq_len=32, progress=False)
    assert info["layers"] == 1 and info["steps"] == 3
    draft = Verifier.from_pretrained(tmp_path / "d")
    assert draft.num_layers == 1 and (tmp_path / "d" / "tokenizer.json").is_file()
    verifier = Verifier.from_pretrained(setup / "verifier")
    assert draft.lm_head.weight.shape == verifier.lm_head.weight.shape and verifier.num_layers == 4
    dec = build_decoder(verifier, draft=str(tmp_path / "d"), method="draft-model")
    assert len(dec.generate([[5, 6, 7]], 8).output_ids[0]) == 8


def test_extra_eagle3_exports_and_the_parallel_draft_cost(tmp_path):
    """--eagle3-extra LABEL=DIR adds eagle3-LABEL-chainK variants; a parallel drafter's draft time per step is put
    beside one autoregressive pass (an EAGLE-3 chain of 1) from the same run."""
    bench = script("bench_decode")
    for name, parallel in (("ar", False), ("par", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"draftheads": {"eagle": {"parallel": parallel}}}))
    drafters = {}
    added = bench.add_extra_eagle3([f"ar={tmp_path / 'ar'}", f"par={tmp_path / 'par'}"], [1, 4], drafters)
    assert added == ["eagle3-ar-chain1", "eagle3-ar-chain4", "eagle3-par-chain1", "eagle3-par-chain4"]
    assert bench.VARIANTS["eagle3-par-chain4"] == ("eagle", "eagle3:par", {"chain": 4})
    profile = {"eagle3-ar-chain1": {"draft_ms": 2.0}, "eagle3-ar-chain4": {"draft_ms": 6.0},
               "eagle3-par-chain1": {"draft_ms": 2.1}, "eagle3-par-chain4": {"draft_ms": 2.4}}
    cost = bench.parallel_draft_cost(profile, drafters)
    assert set(cost) == {"eagle3-par-chain1", "eagle3-par-chain4"}
    assert cost["eagle3-par-chain4"]["reference"] == "eagle3-ar-chain1"
    assert cost["eagle3-par-chain4"]["ratio"] == pytest.approx(1.2)
    with pytest.raises(SystemExit, match="LABEL=DIR"):
        bench.add_extra_eagle3([f"nolabel{tmp_path}"], [4], {})
    with pytest.raises(SystemExit, match="LABEL=DIR"):
        bench.add_extra_eagle3([f"x={tmp_path / 'missing'}"], [4], {})


def test_dflash_extra_decodes_beside_eagle3(setup, tmp_path):
    """--dflash-extra LABEL=DIR (scripts/bench_dflash.sh's decode): a DFlash export decodes as variant dflash-LABEL
    beside EAGLE-3, with its tau, per-position acceptance (one entry per mask position) and drafter time per step."""
    import torch

    from draftheads.models.dflash import DFlashConfig, build_drafter
    from draftheads.models.export import export_dflash
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(setup / "verifier")
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=4, target_layer_ids=[0, 2]))
    folder = export_dflash(drafter, tmp_path / "dflash", verifier)
    bench = script("bench_decode")
    out = tmp_path / "bench"
    assert bench.main(["--out", str(out), "--verifier", str(setup / "verifier"), "--eagle3", str(setup / "eagle3"),
                       "--num-prompts", "2", "--max-new-tokens", "8", "--temperatures", "0",
                       "--variants", "eagle3-chain4", "--dflash-extra", f"b4={folder}"]) == 0
    result = json.loads((out / "bench.json").read_text())["results"]["0.0"]
    row = result["summary"]["dflash-b4"]
    assert row["tau"] >= 1 and row["tokens_per_s"] > 0 and len(row["per_position_acceptance"]) == 3
    assert result["step_profile"]["dflash-b4"]["draft_ms"] > 0
    with pytest.raises(SystemExit, match="LABEL=DIR"):
        bench.add_extra_dflash([f"x={tmp_path / 'missing'}"], {})
