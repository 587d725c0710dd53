"""Sliding-window EAGLE-3 drafters (eagle.sliding_window) in real vLLM (the CPU build of 0.32, in .venv-vllm).

vLLM builds the draft layer's attention with the window of `layer_types` / `sliding_window` in the drafter's config
(llama.py; its CPU attention kernel takes it). For a Llama verifier and a window of W = 4 positions, far shorter than
the prompts plus 32 new tokens: the vLLM layout, the speculators format served as `LLM(model=DRAFTER_DIR)` and a
parallel drafter (P-EAGLE, `parallel_drafting: true`, trained with the window), one batch of one prompt and one of
three:
  - vLLM's greedy outputs equal plain greedy decoding of the verifier;
  - vLLM's accepted draft tokens, per request and per verification step, equal our engine's (chain of k = 3,
    first token from the prefill, as in test_vllm.py);
  - and the comparison has teeth: our engine with the same weights and a window of W - 1, W + 1 or none accepts
    differently, so vLLM counts the window exactly as we do (W keys, the query's own included).
"""

from __future__ import annotations

import copy

import pytest

from draftheads.eval import build_decoder
from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
from draftheads.models.export import export_eagle
from draftheads.models.verifier import Verifier
from tests.e2e.interop.test_vllm import BATCHES, FIT, K, MAX_NEW, PROMPTS, SIZE
from tests.utils import fit_eagle, greedy_corpus, hf_greedy, peaked_model, train_eagle_briefly

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

WINDOW = 4
CASES = ("eagle3", "speculators", "parallel")


def accepted(drafter, verifier, window):
    """Our engine's accepted counts per batch, request and step, for `drafter`'s weights with `window`."""
    model = copy.deepcopy(drafter)
    model.cfg.sliding_window = window
    dec = build_decoder(verifier, draft=model, method="eagle", chain=K, first_token="prefill")
    return [dec.generate(batch, MAX_NEW, eos_token_id=None).stats.accepted for batch in BATCHES]


@pytest.fixture(scope="module")
def interop(tmp_path_factory, vllm_ready):
    root = tmp_path_factory.mktemp("interop-window")
    vdir = root / "verifier"
    peaked_model("llama", **SIZE).save_pretrained(vdir, safe_serialization=True)
    verifier = Verifier.from_pretrained(vdir)
    corpus = greedy_corpus(verifier.model, FIT, 40)
    drafters = {
        # the attention's share kept whole (fit_eagle's default 0.1 leaves it too little say over the drafts for a
        # window one position longer or shorter to show); the parallel drafter's training needs half
        "eagle3": fit_eagle(verifier, 3, corpus, residual_scale=1.0, draft_vocab_size=160, layer_ids=[1, 2, 3],
                            sliding_window=WINDOW),
        "parallel": train_eagle_briefly(fit_eagle(verifier, 3, corpus, residual_scale=0.5, layer_ids=[1, 2, 3],
                                                  ttt_steps=K, parallel=True, parallel_keep=(1.0, 1.0),
                                                  sliding_window=WINDOW), verifier, corpus),
    }
    drafters["speculators"] = drafters["eagle3"]
    cases, ours, others = [], {}, {}
    for name in CASES:
        drafter = drafters[name]
        if name == "speculators":
            folder = export_eagle(drafter, root / name, verifier, engine="speculators", num_speculative_tokens=K)
            cases.append(VllmCase(name, str(vdir), str(folder), None, batches=BATCHES, k=K, max_tokens=MAX_NEW,
                                  serve_drafter=True))
        else:
            folder = export_eagle(drafter, root / name, verifier)
            options = {"parallel_drafting": True} if name == "parallel" else {}
            cases.append(VllmCase(name, str(vdir), str(folder), "eagle3", batches=BATCHES, k=K, max_tokens=MAX_NEW,
                                  speculative_options=options))
        dec = build_decoder(verifier, draft=str(folder), method="eagle", chain=K, first_token="prefill")
        ours[name] = [dec.generate(batch, MAX_NEW, eos_token_id=None) for batch in BATCHES]
        others[name] = {w: accepted(drafter, verifier, w) for w in (WINDOW - 1, WINDOW + 1, None)}
    result = run_vllm(cases)
    references = {tuple(p): hf_greedy(verifier.model, p, MAX_NEW) for p in PROMPTS}
    print(f"\nvLLM {result['vllm']}, window {WINDOW}: case | accepted ours / vLLM | ours at window "
          f"{WINDOW - 1} / {WINDOW + 1} / none")  # what the notes quote: pytest ... test_vllm_window.py -s
    for case in result["cases"]:
        name = case["name"]
        theirs = sum(b["metrics"]["vllm:spec_decode_num_accepted_tokens"] for b in case.get("batches", []))
        total = [sum(a for batch in counts for row in batch for a in row) for counts in
                 [[o.stats.accepted for o in ours[name]], *others[name].values()]]
        print(f"{name} | {total[0]} / {theirs} | {' / '.join(map(str, total[1:]))}")
    return {"vllm": {c["name"]: c for c in result["cases"]}, "ours": ours, "others": others,
            "references": references}


@pytest.mark.parametrize("name", CASES)
def test_vllm_serves_the_window_as_we_train_and_decode_it(interop, name):
    vllm = interop["vllm"][name]
    assert vllm["ok"], f"vLLM refused the windowed {name} drafter: {vllm.get('error')}"
    for batch, ours, theirs in zip(BATCHES, interop["ours"][name], vllm["batches"]):
        want = [interop["references"][tuple(p)] for p in batch]
        assert theirs["outputs"] == want, f"{name}: vLLM's output is not plain greedy decoding"
        assert ours.output_ids == want
        assert theirs["per_step_accepted"] == ours.stats.accepted, name
    mine = [o.stats.accepted for o in interop["ours"][name]]
    assert sum(a for batch in mine for row in batch for a in row) >= 10, f"{name}: too few accepted to compare"
    for window, counts in interop["others"][name].items():
        assert counts != mine, f"{name}: window {window} accepts as window {WINDOW} does: the comparison shows nothing"
