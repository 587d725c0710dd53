"""draftheads.eval.measure.metrics: tau, per-position acceptance, acceptance rate, tokens/s, speedup and efficiency, by hand and
against the decoder's own DecodeStats."""

import random

import pytest

from draftheads.eval.engine.loop import DecodeStats
from draftheads.eval.measure.metrics import (
    MethodRun,
    Sample,
    acceptance_rate,
    accepted_length_histogram,
    efficiency,
    per_position_acceptance,
    speedup,
    summarize,
    tau,
    tokens_per_s,
    verifier_calls,
)

# Two samples: 3 calls accepting 2, 0, 3 drafts, then 2 calls accepting 1, 1. Chain of N = 3.
ACCEPTED = [[2, 0, 3], [1, 1]]


def test_tau_counts_the_bonus_token():
    # 7 accepted drafts + 5 bonus tokens over 5 calls
    assert verifier_calls(ACCEPTED) == 5
    assert tau(ACCEPTED) == pytest.approx(12 / 5)
    assert tau([[0, 0, 0]]) == 1.0  # plain decoding
    assert tau([]) is None and tau([[]]) is None


def test_acceptance_rate_and_positions():
    assert acceptance_rate(ACCEPTED, 3) == pytest.approx(7 / 15)
    assert acceptance_rate([[0, 0]], 0) is None  # autoregressive proposes nothing
    # reached >= 1: 2, 3, 1, 1 (4 of 5); >= 2: 2, 3 (2 of 5); >= 3: 3 (1 of 5)
    assert per_position_acceptance(ACCEPTED, 3) == pytest.approx([4 / 5, 2 / 5, 1 / 5])
    assert per_position_acceptance(ACCEPTED, 5) == pytest.approx([4 / 5, 2 / 5, 1 / 5, 0, 0])
    assert per_position_acceptance(ACCEPTED) == pytest.approx([4 / 5, 2 / 5, 1 / 5])  # depth: the longest seen
    assert per_position_acceptance([]) == []
    assert accepted_length_histogram(ACCEPTED, 3) == [1, 2, 1, 1]
    with pytest.raises(ValueError, match="exceeds max_depth"):
        accepted_length_histogram(ACCEPTED, 2)


def test_positions_are_non_increasing_and_sum_to_tau_minus_one():
    """E[accepted] = sum_k P(accepted >= k): the per-position rates add up to tau - 1."""
    rng = random.Random(0)
    accepted = [[rng.randint(0, 6) for _ in range(rng.randint(1, 20))] for _ in range(7)]
    positions = per_position_acceptance(accepted, 6)
    assert all(a >= b for a, b in zip(positions, positions[1:]))
    assert all(0 <= p <= 1 for p in positions)
    assert sum(positions) == pytest.approx(tau(accepted) - 1)
    assert sum(accepted_length_histogram(accepted, 6)) == verifier_calls(accepted)


def test_same_as_decode_stats():
    stats = DecodeStats("eagle", 2, 3, verifier_calls=3, accepted=ACCEPTED, draft_tokens=15)
    assert tau(stats.accepted) == pytest.approx(stats.tau)
    assert acceptance_rate(stats.accepted, 3) == pytest.approx(stats.acceptance_rate)
    assert per_position_acceptance(stats.accepted) == pytest.approx(stats.per_position_acceptance())


def test_speedup_and_efficiency():
    assert tokens_per_s(100, 4.0) == 25.0 and tokens_per_s(100, 0.0) is None
    assert speedup(50.0, 25.0) == 2.0 and speedup(50.0, None) is None
    assert efficiency(2.0, 2.5) == pytest.approx(0.8) and efficiency(None, 2.5) is None


def run(label, method, outputs, accepted, seconds, n=3):
    samples = [Sample(f"p{i}", [1, 2], out, acc, call=i) for i, (out, acc) in enumerate(zip(outputs, accepted))]
    return MethodRun(label, method, samples, list(seconds), draft_tokens_per_call=n, max_depth=n)


def test_summarize_against_the_baseline():
    base = run("autoregressive", "autoregressive", [[5] * 6, [5] * 4], [[0] * 6, [0] * 4], [1.0, 1.0], n=0)
    spec = run("eagle", "eagle", [[5] * 6, [5] * 4], [[2, 1, 0], [3]], [0.25, 0.25])
    row = summarize(spec, base)
    assert row["tau"] == pytest.approx(10 / 4)
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["speedup"] == pytest.approx(4.0)
    assert row["efficiency"] == pytest.approx(4.0 / 2.5)
    assert row["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert row["verifier_calls"] == 4 and row["new_tokens"] == 10 and row["acceptance_rate"] == pytest.approx(6 / 12)
    own = summarize(base, base)
    assert own["tau"] == 1.0 and own["speedup"] == 1.0 and own["efficiency"] == 1.0
    assert own["acceptance_rate"] is None and own["per_position_acceptance"] == []
    # An HF run: no per-call counts, tau from counted verifier forwards.
    hf = MethodRun("hf-assisted", "hf-assisted", [Sample("p0", [1], [5] * 10, None)], [0.5], verifier_calls=4)
    row = summarize(hf, base)
    assert row["tau"] == 2.5 and row["per_position_acceptance"] is None and row["speedup"] == pytest.approx(4.0)
