"""Decode metrics: pure functions over per-sample statistics.

What one verifier call yields is the unit of speculative decoding. A step that accepts `a` draft tokens commits
a + 1 tokens (the accepted drafts, then the verifier's own bonus / corrected token), so:

    tau                      mean tokens per verifier call, bonus included (vLLM's "acceptance length"):
                             (sum of a + calls) / calls; plain decoding has tau = 1, a chain of K at most K + 1
    per-position acceptance  for k = 1..D: the fraction of calls whose accepted length reached k (non-increasing)
    draft acceptance rate    accepted draft tokens / proposed draft tokens (N per call)
    tokens/s                 new tokens / wall-clock seconds of the timed generate calls (prefill included)
    speedup                  tokens/s over the `autoregressive` baseline's tokens/s, measured in the same run on
                             the same prompts (a throughput ratio, so sampled runs whose outputs differ in length
                             compare fairly; greedy runs produce the same tokens, where it equals the time ratio)
    efficiency               speedup / tau: 1.0 is the limit where drafting, a wider verification and the
                             bookkeeping cost nothing; below 1 is what they do cost

`accepted` is always a list of per-sample lists: the accepted draft count at each verifier call of that sample
(the decoder's `DecodeStats.accepted`). Undefined values (a rate over no draft tokens, a speedup without a
baseline) are None, which JSON writes as null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

Accepted = Sequence[Sequence[int]]


def verifier_calls(accepted: Accepted) -> int:
    """Verifier forwards of the decode steps (one per entry; the prefill is not a call)."""
    return sum(len(row) for row in accepted)


def tau(accepted: Accepted) -> float | None:
    """Mean tokens per verifier call, bonus token included; None when there was no call."""
    calls = verifier_calls(accepted)
    return (sum(map(sum, accepted)) + calls) / calls if calls else None


def acceptance_rate(accepted: Accepted, draft_tokens_per_call: int) -> float | None:
    """Accepted draft tokens / proposed draft tokens (N per call); None when nothing was proposed."""
    proposed = draft_tokens_per_call * verifier_calls(accepted)
    return sum(map(sum, accepted)) / proposed if proposed else None


def per_position_acceptance(accepted: Accepted, max_depth: int | None = None) -> list[float]:
    """[P(accepted >= k) for k = 1..max_depth] over all calls (default depth: the longest accepted run seen)."""
    flat = [a for row in accepted for a in row]
    if not flat:
        return []
    depth = max(flat) if max_depth is None else max_depth
    return [sum(a >= k for a in flat) / len(flat) for k in range(1, depth + 1)]


def accepted_length_histogram(accepted: Accepted, max_depth: int | None = None) -> list[int]:
    """counts[j] = verifier calls that yielded j + 1 tokens (accepted length j), for j = 0..max_depth."""
    flat = [a for row in accepted for a in row]
    depth = max(flat, default=0) if max_depth is None else max_depth
    counts = [0] * (depth + 1)
    for a in flat:
        if a > depth:
            raise ValueError(f"accepted length {a} exceeds max_depth={depth}")
        counts[a] += 1
    return counts


def tokens_per_s(new_tokens: int, seconds: float) -> float | None:
    return new_tokens / seconds if seconds > 0 else None


def speedup(method_tokens_per_s: float | None, baseline_tokens_per_s: float | None) -> float | None:
    """Throughput ratio to the baseline."""
    if not method_tokens_per_s or not baseline_tokens_per_s:
        return None
    return method_tokens_per_s / baseline_tokens_per_s


def efficiency(speedup_: float | None, tau_: float | None) -> float | None:
    """speedup / tau: the share of the ideal speedup (tau, at zero drafting and bookkeeping cost) realised."""
    if speedup_ is None or not tau_:
        return None
    return speedup_ / tau_


# ---- one method's run over a prompt set ------------------------------------------------------------------------
@dataclass
class Sample:
    """One prompt decoded by one method."""

    prompt_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    """New tokens only, ending with the first EOS if one came."""
    accepted: list[int] | None = None
    """Accepted draft tokens at each verifier call (None where the generator does not expose it: HF runs)."""
    call: int = 0
    """Index of the timed generate call (batch) that produced it, into `MethodRun.call_seconds`."""


@dataclass
class MethodRun:
    """Everything measured for one method (or HF baseline) over the prompt set."""

    label: str
    """Row name in tables and plots (`eagle`, `medusa`, `hf`, `hf-assisted`, ...)."""
    method: str
    """Engine method (`autoregressive`, `ngram`, `draft-model`, `medusa`, `eagle`) or `hf` / `hf-assisted`."""
    samples: list[Sample] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)
    """Wall-clock seconds of each timed generate call (the best of the repeats, if repeated)."""
    draft_tokens_per_call: int = 0
    """N: draft tokens proposed per row per verifier call."""
    max_depth: int = 0
    """D: the deepest draft position (per-position acceptance is reported for 1..D)."""
    lossless: bool = True
    """False when a lossy acceptance rule ran (Medusa's typical acceptance at T > 0)."""
    verifier_calls: int | None = None
    """Counted verifier forwards where per-call accepted counts are not observable (HF runs: tau = tokens / calls)."""
    details: dict = field(default_factory=dict)
    """Drafter description, options, per-phase engine timings; reported as is."""

    @property
    def accepted(self) -> list[list[int]] | None:
        if any(s.accepted is None for s in self.samples):
            return None
        return [s.accepted for s in self.samples]

    @property
    def new_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def seconds(self) -> float:
        return sum(self.call_seconds)


def summarize(run: MethodRun, baseline: MethodRun | None = None) -> dict:
    """The summary row of one run; `baseline` (the autoregressive run on the same prompts) gives the speedup."""
    accepted = run.accepted
    if accepted is not None:
        calls = verifier_calls(accepted)
        tau_ = tau(accepted)
        rate = acceptance_rate(accepted, run.draft_tokens_per_call)
        positions = per_position_acceptance(accepted, run.max_depth)
        histogram = accepted_length_histogram(accepted, run.max_depth)
    else:
        calls = run.verifier_calls
        tau_ = run.new_tokens / calls if calls else None
        rate, positions, histogram = None, None, None
    tps = tokens_per_s(run.new_tokens, run.seconds)
    base_tps = tokens_per_s(baseline.new_tokens, baseline.seconds) if baseline is not None else None
    up = speedup(tps, base_tps)
    return {"method": run.method, "tau": tau_, "acceptance_rate": rate, "per_position_acceptance": positions,
            "accepted_length_histogram": histogram, "verifier_calls": calls, "new_tokens": run.new_tokens,
            "seconds": run.seconds, "tokens_per_s": tps, "speedup": up, "efficiency": efficiency(up, tau_),
            "draft_tokens_per_call": run.draft_tokens_per_call, "max_depth": run.max_depth,
            "lossless": run.lossless, "num_samples": len(run.samples), "generate_calls": len(run.call_seconds),
            **run.details}
