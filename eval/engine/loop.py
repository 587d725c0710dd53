"""The one decode loop: `generate` is `begin` + a loop of `step`, for every engine that decodes a batch.

    run = engine.begin(prompts, max_new_tokens, sampling, timings)   # prefill, the drafter's start
    while rows are active:
        rows = engine.step(run, sampling, timings)                    # one verifier call, ONE host sync
        if progress.take(rows, stats): engine.set_active(run, progress.active)

`SpeculativeDecoder` (eval/engine/decoder.py) and `FusedDecoder` (eval/engine/cuda_loop.py) are the two engines: they differ in how
a step runs (eager pieces, or static buffers and CUDA graphs), not in what happens around it. What happens around
it lives here once: checking the prompts, the EOS set, seeding, stopping each row at its first EOS or at
max_new_tokens, the per-row statistics (`DecodeStats`) and the result.

A step returns, per real row, a `StepRow` (eval/engine/protocol.py): `accepted` draft tokens, then the token the
verifier chose after them (`next_token`: the correction, or the bonus token when all were accepted); the row's new
tokens are `row.new_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftheads.eval.engine.protocol import Sampling, StepRow

CONFIG_EOS = object()
"""`eos_token_id` default: the verifier config's eos_token_id(s)."""


@dataclass
class DecodeStats:
    """What one `generate` call did. Accepted counts exclude the bonus / corrected token (a step yields a+1)."""

    method: str
    batch_size: int
    num_draft_tokens: int
    """N: draft tokens proposed per row per step."""
    verifier_calls: int = 0
    """Decode steps, one verifier forward each (the prefill is counted in `prefill_calls`)."""
    prefill_calls: int = 0
    accepted: list[list[int]] = field(default_factory=list)
    """Per row: accepted draft tokens at each step the row was active."""
    draft_tokens: int = 0
    """Draft tokens proposed, over active rows and steps."""
    new_tokens: list[int] = field(default_factory=list)
    """Per row: tokens returned."""
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    """Drafter time: propose + observe (its own prefill and rollback included)."""
    time_verify_s: float = 0.0
    """Verifier forwards of the decode steps."""
    time_other_s: float = 0.0
    """Acceptance, commit (KV compaction), the host sync and bookkeeping."""
    time_total_s: float = 0.0
    lossless: bool = True
    """False when a lossy acceptance rule ran (Medusa typical acceptance at T > 0): outputs do not follow the
    verifier's distribution."""

    @property
    def steps_per_row(self) -> list[int]:
        return [len(a) for a in self.accepted]

    @property
    def tau(self) -> float:
        """Mean tokens per verifier call per row, bonus token included (vLLM's acceptance length)."""
        steps = sum(self.steps_per_row)
        return (sum(map(sum, self.accepted)) + steps) / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return sum(map(sum, self.accepted)) / self.draft_tokens if self.draft_tokens else 0.0

    def per_position_acceptance(self, depth: int | None = None) -> list[float]:
        """Fraction of steps whose accepted length reached k, for k = 1..depth (default: the longest seen)."""
        flat = [a for row in self.accepted for a in row]
        if not flat:
            return []
        depth = depth if depth is not None else max(flat + [0])
        return [sum(a >= k for a in flat) / len(flat) for k in range(1, depth + 1)]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.time_total_s if self.time_total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"method": self.method, "batch_size": self.batch_size, "num_draft_tokens": self.num_draft_tokens,
                "verifier_calls": self.verifier_calls, "prefill_calls": self.prefill_calls,
                "accepted": self.accepted, "draft_tokens": self.draft_tokens, "new_tokens": self.new_tokens,
                "tau": self.tau, "acceptance_rate": self.acceptance_rate,
                "per_position_acceptance": self.per_position_acceptance(), "tokens_per_s": self.tokens_per_s,
                "time_prefill_s": self.time_prefill_s, "time_draft_s": self.time_draft_s,
                "time_verify_s": self.time_verify_s, "time_other_s": self.time_other_s,
                "time_total_s": self.time_total_s, "lossless": self.lossless}


@dataclass
class GenerationResult:
    output_ids: list[list[int]]
    """Per row: the new token ids only, ending with the first EOS if one came."""
    stats: DecodeStats


# ---- inputs --------------------------------------------------------------------------------------------------------
def check_prompts(input_ids, vocab_size: int) -> list[list[int]]:
    """input_ids as a LongTensor [B, T] (or [T]) or a list of token-id lists -> lists; errors name the row."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int, torch.int32, torch.int16):
            raise ValueError(f"input_ids: expected a LongTensor [B, T], got {input_ids.dtype} of shape "
                             f"{tuple(input_ids.shape)}")
        prompts = input_ids.tolist()
    else:
        prompts = [list(map(int, row)) for row in input_ids]
    if not prompts:
        raise ValueError("input_ids: empty batch")
    for b, row in enumerate(prompts):
        if not row:
            raise ValueError(f"input_ids row {b} is empty; every prompt needs at least one token")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input_ids row {b} has token ids {bad[:5]} outside the verifier's vocabulary "
                             f"(0..{vocab_size - 1})")
    return prompts


def eos_set(eos_token_id, default: list[int]) -> set[int]:
    """`CONFIG_EOS` -> the verifier's ids; None -> no EOS; an id or a list of ids."""
    if eos_token_id is CONFIG_EOS:
        return set(default)
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


# ---- per-row bookkeeping -------------------------------------------------------------------------------------------
class RowProgress:
    """The host's view of a batch: each row's output so far and whether it still generates."""

    def __init__(self, batch_size: int, max_new_tokens: int, eos: set[int]):
        self.outputs: list[list[int]] = [[] for _ in range(batch_size)]
        self.active = [True] * batch_size
        self.max_new_tokens, self.eos = max_new_tokens, eos

    def take(self, rows: list[StepRow], stats: DecodeStats) -> bool:
        """Append one step's new tokens to the active rows, stopping a row at its first EOS or at max_new_tokens.
        Returns whether a row finished (the caller then switches it off on the device)."""
        newly_done = False
        for b, row in enumerate(rows):
            if not self.active[b]:
                continue
            stats.accepted[b].append(row.accepted)
            out = self.outputs[b]
            for tok in row.new_tokens:
                out.append(tok)
                if tok in self.eos or len(out) >= self.max_new_tokens:
                    self.active[b] = False
                    newly_done = True
                    break
        stats.verifier_calls += 1
        return newly_done

    def take_first(self, tokens: list[int]) -> bool:
        """The prefill's own first token of each row (first_token="prefill"); True when one already finished."""
        newly_done = False
        for b, tok in enumerate(tokens):
            self.outputs[b].append(tok)
            if tok in self.eos or len(self.outputs[b]) >= self.max_new_tokens:
                self.active[b] = False
                newly_done = True
        return newly_done


def add_times(timings: dict[str, float], **seconds: float) -> None:
    for key, value in seconds.items():
        timings[key] = timings.get(key, 0.0) + value


# ---- the loop ------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def generate(engine, input_ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, eos_token_id=CONFIG_EOS) -> GenerationResult:
    """Decode up to `max_new_tokens` per row with `engine` (a SpeculativeDecoder or a FusedDecoder).

    The engine provides `verifier`, `drafter`, `method`, `eos_token_ids`, `sampling_generator()`, `tick()`,
    `phase_timings` (whether its per-phase times are meaningful), `begin`, `step` and `set_active`.
    """
    prompts = check_prompts(input_ids, engine.verifier.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 0")
    eos = eos_set(eos_token_id, engine.eos_token_ids)
    generator = engine.sampling_generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    sampling = Sampling(temperature, top_p, generator)
    B, drafter = len(prompts), engine.drafter
    N = drafter.num_draft_tokens
    stats = DecodeStats(engine.method, B, N, accepted=[[] for _ in range(B)],
                        lossless=getattr(drafter, "typical", None) is None or sampling.greedy)
    progress = RowProgress(B, max_new_tokens, eos)
    t_start = engine.tick()
    if max_new_tokens == 0:
        stats.new_tokens = [0] * B
        return GenerationResult(progress.outputs, stats)
    timings: dict[str, float] = {}
    run = engine.begin(prompts, max_new_tokens, sampling, timings)
    first = getattr(run, "prefill_tokens", None)  # vLLM's convention: the prefill chose the first token
    stats.prefill_calls = int(first is not None or max(map(len, prompts)) > 1)  # else it runs each prompt but one
    if first is not None and progress.take_first(first):
        engine.set_active(run, progress.active)
    while any(progress.active):
        stats.draft_tokens += N * sum(progress.active)
        rows = engine.step(run, sampling, timings)
        t = engine.tick()
        if progress.take(rows, stats):
            engine.set_active(run, progress.active)
        add_times(timings, other=engine.tick() - t)
    stats.time_total_s = engine.tick() - t_start
    stats.time_prefill_s = timings.get("prefill", 0.0)
    if engine.phase_timings:
        stats.time_draft_s, stats.time_verify_s, stats.time_other_s = (timings.get(k, 0.0) for k in
                                                                       ("draft", "verify", "other"))
    stats.new_tokens = [len(o) for o in progress.outputs]
    return GenerationResult(progress.outputs, stats)


def tick(device: torch.device, sync: bool) -> float:
    """A timestamp; with `sync` on a CUDA device, after the queued work finished (exact per-phase timings)."""
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
