"""`draftheads serve-check`: passing verdicts for each export flavour in real vLLM, and a drafter that vLLM reads
differently from us (its layer ids edited in config.json) caught with the acceptance side by side; one-line errors
for bad flags and a missing vLLM."""

from __future__ import annotations

import json

import pytest

from draftheads.eval.interop import serve_check
from draftheads.models.export import export_eagle, save_medusa
from draftheads.models.verifier import Verifier
from tests.e2e.interop.test_vllm import SIZE, medusa_heads
from tests.utils import fit_eagle, greedy_corpus, save_tiny_verifier_with_tokenizer

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoTokenizer

    from draftheads.data.prompts import load_prompts, prompt_ids

    root = tmp_path_factory.mktemp("serve-check")
    vdir = save_tiny_verifier_with_tokenizer(root / "verifier", "llama", initializer_range=0.1, **SIZE)
    verifier = Verifier.from_pretrained(vdir)
    tokenizer = AutoTokenizer.from_pretrained(vdir)
    prompts = [prompt_ids(p, tokenizer) for p in load_prompts("humaneval", 3)]
    corpus = greedy_corpus(verifier.model, prompts, 40)
    eagle3 = fit_eagle(verifier, 3, corpus, draft_vocab_size=200, layer_ids=[1, 2, 3])
    drafts = {"eagle3": export_eagle(eagle3, root / "eagle3", verifier),
              "speculators": export_eagle(eagle3, root / "speculators", verifier, engine="speculators"),
              "eagle1": export_eagle(fit_eagle(verifier, 1, corpus), root / "eagle1", verifier),
              "medusa": save_medusa(root / "medusa", medusa_heads(verifier, corpus), verifier),
              "parallel": export_eagle(fit_eagle(verifier, 3, corpus, layer_ids=[1, 2, 3], ttt_steps=3,
                                                 parallel=True), root / "parallel", verifier)}
    broken = export_eagle(eagle3, root / "broken", verifier)  # what vLLM reads changed, ours not: other layers
    config = json.loads((broken / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (broken / "config.json").write_text(json.dumps(config))
    return vdir, drafts, broken


def test_every_flavour_passes_and_a_misread_drafter_fails(folders, capsys, vllm_ready):
    vdir, drafts, broken = folders
    code = serve_check.main(["--verifier", str(vdir), "--draft", *map(str, drafts.values()), str(broken),
                             "--num-prompts", "3", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert code == 1, out
    for folder in drafts.values():
        assert f"VERDICT {folder}: PASS - vLLM loads it, its outputs equal plain greedy decoding on 3 of 3 prompts, " \
               "and accepts exactly what draftheads accepts" in out, out
    verdict = next(line for line in out.splitlines() if line.startswith(f"VERDICT {broken}"))
    assert "FAIL" in verdict and "vLLM accepts" in verdict and "where draftheads accepts" in verdict, out
    assert "accepted per step: DIFFERENT" in out


def test_usage_errors_are_one_line(folders, capsys, monkeypatch):
    vdir, drafts, _ = folders
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(drafts["eagle3"]), "-k", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: -k 0: expected a positive number"
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(vdir / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --draft {vdir / 'nope'}: no such folder"
    monkeypatch.setenv("DRAFTHEADS_VLLM_PYTHON", "/nonexistent/python")
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(drafts["eagle3"]), "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: DRAFTHEADS_VLLM_PYTHON='/nonexistent/python': no such file"
