"""`draftheads tune` and the brief's exercise.

The exercise: expected tokens per verifier call (1 - a^(N+1)) / (1 - a) for a = 0.5, 0.7, 0.85 against a
simulation of i.i.d. acceptance, and the optimal N under a draft cost. The command: its prediction formula on
made-up measurements, and a run end to end on a tiny verifier (n-gram, a draft model and EAGLE-3 as candidates): a
ranked table, the winner among the confirmed choices, its vLLM and SGLang settings, tune.json and the plot.
"""

import json

import pytest

from draftheads.eval.measure.tune import (
    DecodeRun,
    DrafterProfile,
    Prediction,
    expected_tokens,
    optimal_draft_length,
    predict,
    serve_config,
    simulated_tokens,
    speedup_iid,
)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.85])
def test_expected_tokens_equal_the_simulation(alpha):
    for n in range(0, 9):
        exact = expected_tokens(alpha, n)
        assert abs(simulated_tokens(alpha, n, steps=200_000, seed=n) - exact) < 0.01 * exact + 0.01, (alpha, n)
    assert expected_tokens(alpha, 0) == 1.0
    assert abs(expected_tokens(alpha, 200) - 1 / (1 - alpha)) < 1e-9  # the limit: a geometric series


def test_optimal_draft_length():
    for alpha in (0.5, 0.7, 0.85):
        for cost in (0.02, 0.1, 0.3):
            n = optimal_draft_length(alpha, cost)
            assert all(speedup_iid(alpha, n, cost) >= speedup_iid(alpha, m, cost) for m in range(65))
    # better acceptance or cheaper drafts: longer drafts pay
    assert optimal_draft_length(0.5, 0.1) < optimal_draft_length(0.7, 0.1) < optimal_draft_length(0.85, 0.1)
    assert optimal_draft_length(0.85, 0.3) < optimal_draft_length(0.85, 0.02)
    assert optimal_draft_length(0.5, 2.0) == 0  # drafting costs more than it saves
    assert optimal_draft_length(0.85, 0.0) == 64


def test_prediction_formula():
    """time(N) = prefill + new tokens / tau(N) x (verifier(N+1) + drafter(N)); speedup = plain time / time(N)."""
    verify = {n: 0.010 + 0.001 * n for n in range(1, 5)}
    plain = DecodeRun(seconds=0.1 + 100 * 0.011, prefill_s=0.1, new_tokens=100, verifier_calls=100, accepted=0,
                      per_position=[])
    prof = DrafterProfile("d", "eagle", "x", [0.8, 0.6, 0.4], {1: 0.0, 3: 0.0}, drafter_s={1: 0.002, 3: 0.006})
    rows = {r.n: r for r in predict([prof], verify, plain, 3)}
    assert set(rows) == {1, 2, 3}
    tau2 = 1 + 0.8 + 0.6
    want = plain.seconds / (0.1 + 100 / tau2 * (verify[3] + 0.004))
    assert rows[2].tau == pytest.approx(tau2) and rows[2].speedup == pytest.approx(want)
    assert prof.cost_per_draft_token == pytest.approx(0.002)


def test_medusa_trees_from_calibrated_rank_accuracies():
    from draftheads.eval.measure.tune import calibrated_ranks, medusa_tree_tau

    ranks = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    measured = [0.6, 0.3]  # the chain accepted more at depth 1 and less at depth 2 than the table says
    rows = calibrated_ranks(ranks, measured)
    assert rows[0][0] == pytest.approx(0.6) and rows[1][0] == pytest.approx(0.5)  # P(2 | 1) = 0.3 / 0.6
    assert rows[0][1] == pytest.approx(0.24)
    assert medusa_tree_tau(ranks, measured, 2) == pytest.approx(1 + 0.6 + max(0.24, 0.3))  # rank 1, or depth 2
    assert medusa_tree_tau(ranks, measured, 1) == pytest.approx(1.6)


def test_serve_settings_for_each_method(tmp_path):
    vllm, sglang = serve_config(Prediction("ngram", "ngram", None, 4, 2.0, 1.5))
    assert vllm == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert "--speculative-num-draft-tokens 5" in sglang
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                             "draftheads": {"method": "eagle3"}}))
    vllm, sglang = serve_config(Prediction("e", "eagle", str(tmp_path / "e3"), 3, 2.5, 1.8))
    assert vllm == {"method": "eagle3", "model": str(tmp_path / "e3"), "num_speculative_tokens": 3}
    assert "--speculative-algorithm EAGLE3" in sglang and "--speculative-num-steps 3" in sglang


@pytest.mark.usefixtures("one_thread")
def test_tune_end_to_end(tmp_path, capsys):
    from draftheads.eval.__main__ import main
    from tests.eval_fixtures import build_eval_setup

    setup = build_eval_setup(tmp_path / "setup")
    out = tmp_path / "tune"
    code = main(["tune", "--verifier", str(setup / "verifier"), "--candidate", "ngram",
                 "--candidate", f"draft-model={setup / 'draft'}", "--candidate", f"eagle={setup / 'eagle3'}",
                 "--prompts", "humaneval", "--num-prompts", "2", "--max-new-tokens", "16", "--max-draft", "3",
                 "--confirm", "2", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "tune.json").read_text())
    preds = result["predictions"]
    assert len(preds) == 3 * 3 and preds == sorted(preds, key=lambda p: -p["speedup"])  # no Medusa here: no trees
    confirmed = [p for p in preds if p["measured_speedup"] is not None]
    assert preds[:2] == confirmed[:2] and {p["label"] for p in confirmed} == {p["label"] for p in preds}
    for label in {p["label"] for p in preds}:  # each candidate's best prediction is among the confirmed
        assert next(p for p in preds if p["label"] == label) in confirmed
    assert result["winner"]["measured_speedup"] == max(p["measured_speedup"] for p in confirmed)
    assert set(result["verifier_seconds"]) == {"1", "2", "3", "4"}
    assert all(len(p["per_position"]) == 3 for p in result["profiles"])
    assert result["vllm_speculative_config"]["num_speculative_tokens"] == result["winner"]["n"]
    assert (out / "tune.png").stat().st_size > 1000
    assert "| rank | candidate |" in printed and "vLLM: speculative_config=" in printed


def test_tune_usage_errors_are_one_line(tmp_path, capsys):
    from draftheads.eval.__main__ import main

    assert main(["tune", "--verifier", "x", "--candidate", "medusa", "--prompts", "humaneval",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "medusa needs a drafter" in err
    assert main(["tune", "--verifier", "x", "--candidate", "ngram", "--prompts", "humaneval", "--max-draft", "0",
                 "--out", str(tmp_path)]) == 2
    assert "--max-draft 0" in capsys.readouterr().err
