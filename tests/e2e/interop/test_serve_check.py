"""`draftheads serve-check`: passing verdicts for each export flavour in real vLLM; a drafter whose layer ids were
edited in config.json after training (both copies) fails, naming the field, with vLLM's acceptance beside the
drafter as trained; folders shaped as SpecForge and speculators write them (tests/peer_folders.py) fail, and pass
once `draftheads import-peer --fix` has rewritten them (vLLM's accepted counts equal our engine's on the fixed
folder); one-line errors for bad flags and a missing vLLM."""

from __future__ import annotations

import json

import pytest

from draftheads.eval.interop import peer_folder, serve_check
from draftheads.models.export import export_eagle, save_medusa
from draftheads.models.verifier import Verifier
from tests.e2e.interop.test_vllm import SIZE, medusa_heads
from tests.peer_folders import specforge_folder, speculators_folder
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
    broken = export_eagle(eagle3, root / "broken", verifier)  # the layer ids edited after training, both copies
    config = json.loads((broken / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-1, 0, 1]
    (broken / "config.json").write_text(json.dumps(config))
    peers = {"specforge": specforge_folder(eagle3, root / "specforge"),
             "speculators": speculators_folder(eagle3, verifier, root / "speculators-ckpt")}
    fixed = {name: peer_folder.fix(peer_folder.inspect(folder, verifier), root / f"{name}-fixed", verifier)
             for name, folder in peers.items()}
    return vdir, drafts, broken, peers, fixed


def verdict(out: str, folder) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"VERDICT {folder}:"))


def test_every_flavour_passes_and_misread_drafters_fail(folders, capsys, vllm_ready):
    vdir, drafts, broken, peers, fixed = folders
    code = serve_check.main(["--verifier", str(vdir), "--draft", *map(str, drafts.values()), str(broken),
                             *map(str, peers.values()), *map(str, fixed.values()),
                             "--num-prompts", "3", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert code == 1, out
    for folder in [*drafts.values(), *fixed.values()]:
        assert verdict(out, folder) == (
            f"VERDICT {folder}: PASS - vLLM reads it as trained, its outputs equal plain greedy decoding on 3 of 3 "
            "prompts, and it accepts exactly what draftheads accepts reading it the same way"), out
    # the edit: vLLM serves other layers than the drafter was trained on, and says nothing
    line = verdict(out, broken)
    assert line.startswith(f"VERDICT {broken}: FAIL - config.json disagrees with how it was trained "
                           "(eagle_aux_hidden_state_layer_ids, config.json): vLLM accepts "), out
    section = out.split(f"== {broken} ")[1].split("VERDICT")[0]
    assert "DISAGREES eagle_aux_hidden_state_layer_ids: vLLM reads [0, 1, 2]" in section, section
    assert "as trained" in section and "accepted per step: DIFFERENT" not in section, section
    vllm_total, trained_total = (int(x.split()[0]) for x in line.split("vLLM accepts ")[1].split(", the drafter as "
                                                                                                  "trained "))
    assert vllm_total < trained_total, line
    # the peers' folders as written: SpecForge's names no top-level layer ids (vLLM's default for 4 layers, 2 and
    # 1, feeds a 3-wide fc two features), speculators' carries a bf16 copy of the verifier's embedding
    line = verdict(out, peers["specforge"])
    assert line.startswith(f"VERDICT {peers['specforge']}: FAIL - config.json disagrees with how it was trained "
                           "(eagle_aux_hidden_state_layer_ids)"), out
    line = verdict(out, peers["speculators"])
    assert line.startswith(f"VERDICT {peers['speculators']}: FAIL - config.json disagrees with how it was trained "
                           "(embed_tokens.weight)"), out


def test_usage_errors_are_one_line(folders, capsys, monkeypatch):
    vdir, drafts = folders[:2]
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(drafts["eagle3"]), "-k", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: -k 0: expected a positive number"
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(vdir / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --draft {vdir / 'nope'}: no such folder"
    monkeypatch.setenv("DRAFTHEADS_VLLM_PYTHON", "/nonexistent/python")
    assert serve_check.main(["--verifier", str(vdir), "--draft", str(drafts["eagle3"]), "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: DRAFTHEADS_VLLM_PYTHON='/nonexistent/python': no such file"
