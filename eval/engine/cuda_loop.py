"""The fused decode loop: static shapes, CUDA graphs, fused acceptance + KV compaction, one host sync per step.

    from draftheads.eval import FusedDecoder, build_decoder
    dec = build_decoder(verifier, method="draft-model", draft=draft, device="cuda", dtype="bf16")
    out = FusedDecoder(dec).generate(prompts, max_new_tokens=256)    # same results as dec.generate(...)

Design note (issue 7)
---------------------
Why. On a GPU at small batch, a decode step of a 1B model is ~1.7 GB of weights read once, ~0.4 ms at the
~4.3 TB/s an H200 copies at; the eager step is several times that, spent in Python, in ~20 kernel launches per
layer, in the ~100 small launches of tree acceptance and KV compaction, and in host syncs. Real speedup then sits
far below tau (tokens per verifier call). This loop removes that overhead and keeps the verifier's math unchanged.

What a step is. The same pieces as `SpeculativeDecoder` (eval/engine/decoder.py), run as two segments (the loop around
the steps, EOS and per-row bookkeeping included, is eval/engine/loop.py's, shared with the unfused decoder):
    V   verify    verifier forward over root + N nodes (decoder.verify), the acceptance kernel
                  (draftheads.eval.engine.kernels.accept: the same draws from the same generator as draftheads.eval.engine.acceptance.accept),
                  decoder.commit with the cache's one-launch compaction kernel (kernels.FusedKVCache)
                                                               -> static acceptance / committed buffers
    OP  observe + propose   drafter.observe(state, committed), then drafter.propose(state) for the next step
                                                               -> static draft buffers (tokens, probs, tree)
then ONE device->host copy of (accepted length, accepted tokens, next token) per row, waited on through an event
recorded before OP, so the host's bookkeeping (EOS, max_new_tokens, outputs) overlaps the drafter's work. Rows that
finish are switched off with a host->device copy (no sync). Nothing else reads the device. The first proposal of a
batch runs eagerly in `begin`, after the prefill; the last step's proposal is never used. Observe and the next
propose share a segment because drafters hand state from one to the other in Python attributes (EAGLE's and
Medusa's last hidden state are rebound in observe): inside one captured segment that is safe, across two it is not.
The order of operations, and of random draws, is exactly the unfused loop's.

Static shapes. A batch is padded to a batch bucket (inactive dummy rows of one pad token), the KV cache to a
capacity bucket, and each step's attention window is rounded up to a window bucket. Within one (batch,
capacity) bucket every tensor the segments exchange lives in `StepBuffers`, allocated once at fixed addresses;
segments communicate only through them, so a captured segment reads and writes the same memory at every replay.
Drafters size their attention windows from `state.lengths_host`; the loop hands them the window bucket's upper
bound (W - N - 1 for every row) instead of the exact lengths, so a drafter's shapes depend on the bucket alone.

CUDA graphs (`SegmentGraphs`). Key = (segment, window, temperature, top_p). The first time a key is seen the
segment runs eagerly on the capture stream: that is the warm-up (cuBLAS handles, Triton compilation, lazy
allocations of `StepBuffers`) and it does the step's real work, so nothing runs twice (commit and compaction are
not idempotent). The second time it is captured (`torch.cuda.CUDAGraph`, explicit, a private pool per graph;
capture records without running) and replayed; after that it is replayed. Sampling draws inside the graphs from
one generator owned by the loop and registered with each graph (`register_generator_state`), re-seeded per call.
The verifier segment is always captured; the drafter's only for drafters known to keep to the contract below
(`capture_drafter=None` picks the drafters whose class says `capturable = True`: n-gram, draft-model, Medusa, EAGLE); others run
eagerly between the verifier's graphs. Graphs are dropped when the batch/capacity bucket changes or when the
drafter's buffers move (checked once per call).

Capturable drafter contract: `propose` / `observe` do no host syncs and no host->device copies, allocate only
tensors whose shapes follow from (batch, capacity, max(state.lengths_host)), read `lengths_host` only to size
windows (an upper bound must do), draw randomness only from `sampling.generator`, hand nothing from propose to the
next observe in a rebound Python attribute, and keep every tensor that `start` allocates and the segments read at
the same address for the same batch size and capacity (the loop compares the tensors in the drafter's public
attributes once per call and recaptures when they moved; private ones are the drafter's promise).

Equivalence. With graphs off (the CPU path, and what tests run) the loop computes exactly what
`SpeculativeDecoder.generate` computes from the same seed: the same segments, the same random draws in the same
order, the kernels' torch references. Greedy output equals plain greedy decoding token for token (in float32;
in bf16 near-ties may flip with kernel shapes, exactly as decoder.py says for its window buckets).

Predicted floor (H200, bf16, batch 1, the 1B-shaped verifier of scripts/bench_gpu.py:
hidden 2048, 16 layers, vocab 32000, ~0.85B parameters). Bytes: a verifier step reads ~1.6 GB -> ~0.37 ms at
4.3 TB/s whatever N+1 <= ~64 (memory-bound); an EAGLE-1 draft pass (layer + full lm_head) ~0.24 GB -> ~0.06 ms,
an EAGLE-3 pass with an 8k draft vocabulary ~0.14 GB -> ~0.03 ms. Launches: even replayed from a graph, each
kernel costs a few microseconds, ~250 per verifier step (~0.5-0.8 ms) and ~35 per draft pass. A chain of 4 is
four draft passes per step, so efficiency = speedup / tau is bounded near 0.6 (EAGLE-1) to 0.8 (EAGLE-3) at
batch 1 on this model, and grows with the verifier. Eager, a step costs several ms of Python and launches: that
gap, not the math, is what this loop removes.

Wiring: the caller picks this loop by wrapping a decoder, `FusedDecoder(SpeculativeDecoder(...))` (`draftheads eval
--fused`); eval/engine/decoder.py does not know about it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from draftheads.eval.engine import kernels
from draftheads.eval.engine.acceptance import Acceptance
from draftheads.eval.engine.decoder import SpeculativeDecoder
from draftheads.eval.engine.generic_runtime import is_generic
from draftheads.eval.engine.loop import CONFIG_EOS, GenerationResult, add_times, generate, tick
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, ExtraNodes, Sampling, StepRow
from draftheads.eval.engine.runtime import bucket
from draftheads.eval.engine.tree import Tree


# ---- static shapes -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Buckets:
    """How batch size, cache capacity and attention windows are rounded so that shapes (and graphs) repeat."""

    batch: tuple[int, ...] | None = (1, 2, 4, 8, 16, 32, 64)
    """Batch sizes a batch is padded to (the smallest that fits; larger batches run as they are); None: no padding."""
    capacity: int = 512
    """KV-cache capacities are multiples of this."""
    window: int = 256
    """Attention windows are multiples of this (one set of graphs per window in use)."""

    def __post_init__(self):
        if self.batch is not None and (not self.batch or any(int(b) < 1 for b in self.batch)):
            raise ValueError(f"Buckets.batch={self.batch!r}: expected positive batch sizes or None")
        if self.capacity < 1 or self.window < 1:
            raise ValueError(f"Buckets(capacity={self.capacity}, window={self.window}): expected positive sizes")

    def batch_size(self, n: int) -> int:
        fits = [b for b in sorted(self.batch or ()) if b >= n]
        return fits[0] if fits else n

    def capacity_for(self, n: int) -> int:
        return bucket(n, self.capacity)

    def window_for(self, n: int, capacity: int) -> int:
        return min(capacity, bucket(n, self.window))


# ---- static buffers ----------------------------------------------------------------------------------------------
class StepBuffers:
    """Every tensor the segments exchange, for one (batch, capacity) bucket, at fixed addresses.

    The draft, acceptance and committed buffers are allocated on first use (their shapes come from the drafter and
    the verifier's outputs); that first use is always an eager run, never a capture.
    """

    def __init__(self, runner, batch_size: int, capacity: int, backend: str):
        dev = runner.device
        self.batch_size, self.capacity, self.device = batch_size, capacity, dev
        self.tokens = torch.zeros(batch_size, capacity, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.active = torch.zeros(batch_size, dtype=torch.bool, device=dev)
        self.prompt_lengths = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.cache = kernels.FusedKVCache.for_runner(runner, batch_size, capacity, backend)
        pin = dev.type == "cuda"
        self.active_host = torch.zeros(batch_size, dtype=torch.bool, pin_memory=pin)
        self.draft: Draft | None = None
        self._probs: torch.Tensor | None = None
        self._extra: torch.Tensor | None = None
        self.acceptance: Acceptance | None = None
        self.committed: Committed | None = None
        self.packed: torch.Tensor | None = None
        """(B, D+3) long: accepted length, root + accepted tokens (D+1), next token: what the host reads."""
        self.packed_host: torch.Tensor | None = None
        self.observed = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.fetched = torch.cuda.Event() if dev.type == "cuda" else None

    # ---- per batch ----
    def load(self, prompts: list[list[int]], pad: int) -> DecodeState:
        """Prompts into the token buffer (padded rows: one pad token, inactive); a DecodeState over the buffers."""
        B, C = self.batch_size, self.capacity
        rows = prompts + [[pad]] * (B - len(prompts))
        host = torch.full((B, C), pad, dtype=torch.long)
        for b, row in enumerate(rows):
            host[b, : len(row)] = torch.tensor(row)
        plen = torch.tensor([len(r) for r in rows])
        self.tokens.copy_(host)
        self.prompt_lengths.copy_(plen)
        self.lengths.copy_(plen - 1)
        self.set_active([b < len(prompts) for b in range(B)])
        return DecodeState(tokens=self.tokens, lengths=self.lengths, active=self.active,
                           prompt_lengths=self.prompt_lengths, capacity=C, lengths_host=[len(r) - 1 for r in rows])

    def set_active(self, active: list[bool]) -> None:
        self.active_host.copy_(torch.tensor(active))
        self.active.copy_(self.active_host, non_blocking=True)

    # ---- written by the segments ----
    def write_draft(self, d: Draft) -> None:
        """Copy a proposal into the static draft (allocated at the first one; N, D and K never change)."""
        tree = d.tree.expand(self.batch_size)
        if self.draft is None:
            self.draft = Draft(torch.empty_like(d.tokens), Tree(*(t.clone() for t in (
                tree.parents, tree.depth, tree.ancestors, tree.children)), tree.max_depth, tree.is_chain))
        s = self.draft
        if d.tokens.shape != s.tokens.shape or tree.children.shape != s.tree.children.shape or \
                tree.max_depth != s.tree.max_depth or tree.is_chain != s.tree.is_chain:
            raise ValueError(f"the drafter changed its draft's shape within a bucket (tokens "
                             f"{tuple(s.tokens.shape)} -> {tuple(d.tokens.shape)}, children "
                             f"{tuple(s.tree.children.shape)} -> {tuple(tree.children.shape)}); N, the depth and the "
                             "branching must stay fixed (eval/engine/protocol.py)")
        if d.probs is not None and (self._probs is None or self._probs.shape != d.probs.shape):
            self._probs = torch.empty_like(d.probs)  # first sampled step (an eager run, never a capture)
        s.tokens.copy_(d.tokens)
        for dst, src in ((s.tree.parents, tree.parents), (s.tree.depth, tree.depth),
                         (s.tree.ancestors, tree.ancestors), (s.tree.children, tree.children)):
            dst.copy_(src)
        if d.probs is not None:
            self._probs.copy_(d.probs)
        extra = None
        if d.extra is not None:  # lookahead's window: its tokens change, its layout (offsets, mask) does not
            if self._extra is None or self._extra.shape != d.extra.tokens.shape:
                self._extra = torch.empty_like(d.extra.tokens)
            self._extra.copy_(d.extra.tokens)
            extra = ExtraNodes(self._extra, d.extra.offsets, d.extra.mask)
        self.draft = Draft(s.tokens, s.tree, self._probs if d.probs is not None else None, extra=extra)

    def write_step(self, acc: Acceptance, committed: Committed) -> None:
        if self.committed is None:
            self.acceptance = Acceptance(*(torch.empty_like(t) for t in (acc.num_accepted, acc.path,
                                                                          acc.next_token)))
            c = committed
            self.committed = Committed(
                tokens=torch.empty_like(c.tokens), next_tokens=torch.empty_like(c.next_tokens),
                count=torch.empty_like(c.count), start=torch.empty_like(c.start), prefill=False,
                path=torch.empty_like(c.path), final=None if c.final is None else torch.empty_like(c.final),
                layers={i: torch.empty_like(h) for i, h in c.layers.items()},
                logits=None if c.logits is None else torch.empty_like(c.logits))
            self.packed = torch.empty(self.batch_size, c.tokens.shape[1] + 2, dtype=torch.long, device=self.device)
            self.packed_host = torch.empty(self.packed.shape, dtype=torch.long,
                                           pin_memory=self.device.type == "cuda")
        for dst, src in ((self.acceptance.num_accepted, acc.num_accepted), (self.acceptance.path, acc.path),
                         (self.acceptance.next_token, acc.next_token)):
            dst.copy_(src)
        s, c = self.committed, committed
        for dst, src in ((s.tokens, c.tokens), (s.next_tokens, c.next_tokens), (s.count, c.count),
                         (s.start, c.start), (s.path, c.path), (s.final, c.final), (s.logits, c.logits)):
            if dst is not None:
                dst.copy_(src)
        for i, h in c.layers.items():
            s.layers[i].copy_(h)
        torch.cat([acc.num_accepted[:, None], c.tokens, acc.next_token[:, None]], 1, out=self.packed)

    # ---- the step's one sync ----
    def fetch(self) -> None:
        """Start copying `packed` to the host (asynchronous on CUDA: waited on by `fetched_rows`)."""
        if self.fetched is not None:
            self.packed_host.copy_(self.packed, non_blocking=True)
            self.fetched.record()
        else:
            self.packed_host.copy_(self.packed)

    def fetched_rows(self) -> list[list[int]]:
        if self.fetched is not None:
            self.fetched.synchronize()  # THE host sync of the step
        return self.packed_host.tolist()


# ---- CUDA graphs ---------------------------------------------------------------------------------------------------
class SegmentGraphs:
    """Runs a segment eagerly (disabled, or first use of a key) or as a captured CUDA graph (second use: capture
    and replay; later: replay). A segment must read and write only memory that outlives the graph.

    A segment that cannot be captured (an op that syncs or is not capturable) runs eagerly from then on, with a
    warning and its key in `failures` (the capture ran nothing, so the eager run is the step's only one); with
    `strict=True` the error propagates instead.
    """

    def __init__(self, device: torch.device, enabled: bool, strict: bool = False):
        if enabled and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the verifier is on {device}")
        self.device, self.enabled, self.strict = device, enabled, strict
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.seen: set[tuple] = set()
        self.failures: dict[tuple, str] = {}
        """Keys whose capture failed, with the error: they run eagerly."""
        self.stream = torch.cuda.Stream(device) if enabled else None
        self.captures = 0
        """Graphs captured so far (for tests and reports)."""

    def clear(self, segments: tuple[str, ...] | None = None) -> None:
        """Forget the graphs (of some segments): their memory is freed and their keys warm up again."""
        for key in [k for k in self.seen if segments is None or k[0] in segments]:
            self.seen.discard(key)
            self.graphs.pop(key, None)
            self.failures.pop(key, None)

    def run(self, key: tuple, fn, generator: torch.Generator | None = None, capture: bool = True):
        if not (self.enabled and capture) or key in self.failures:
            return fn()
        rec = self.graphs.get(key)
        if rec is not None:
            rec[0].replay()
            return rec[1]
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        if key not in self.seen:  # first use: the warm-up is this step's real work, on the capture stream
            self.seen.add(key)
            with torch.cuda.stream(self.stream):
                out = fn()
            current.wait_stream(self.stream)
            return out
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                out = fn()  # recorded, not run
        except Exception as e:
            if self.strict:
                raise
            self.failures[key] = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of segment {key} failed; it runs eagerly: {self.failures[key]}")
            torch.cuda.synchronize(self.device)
            return fn()
        self.graphs[key] = (graph, out)  # `out` keeps what the segment returned (and the graph reads) alive
        self.captures += 1
        graph.replay()
        return out


# ---- the loop ------------------------------------------------------------------------------------------------------
@dataclass
class LoopState:
    """A batch in the fused loop: the device-side DecodeState (over `StepBuffers`) and the host's view of it."""

    state: DecodeState
    lengths: list[int]
    """Committed tokens per row (all rows of the bucket), kept on the host from the step's one sync."""
    active: list[bool]
    """Rows still generating; padding rows are never active."""
    num_rows: int
    """Real rows (the first `num_rows` of the bucket)."""


def _tensor_addresses(obj, depth: int = 4) -> tuple[int, ...]:
    """Data pointers of the tensors reachable from obj's public attributes (parameters and `_private` attributes
    excluded: per-call scratch such as StaticKVCache._slots lives there). A drafter whose buffers moved since its
    graphs were captured needs new graphs. So a persistent tensor that a captured segment reads must be public (a
    cache's `rows`, say): a private one can move unseen while the rest stays put, and a replay then reads freed
    memory (tests/integration/test_cuda_loop.py::test_graph_read_buffers_are_public)."""
    found: list[int] = []
    seen: set[int] = set()

    def walk(x, d):
        if id(x) in seen or isinstance(x, torch.nn.Parameter):
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x.data_ptr())
        elif d > 0:
            if isinstance(x, (list, tuple)):
                items = x
            elif isinstance(x, dict):
                items = x.values()
            elif hasattr(x, "__dict__") and not isinstance(x, type):
                items = [v for k, v in vars(x).items() if not k.startswith("_")]
            else:
                return
            for y in items:
                walk(y, d - 1)

    walk(obj, depth)
    return tuple(found)


class FusedDecoder:
    """The decode loop of a `SpeculativeDecoder` on static buffers, with CUDA graphs and the fused kernels.

    graphs: capture CUDA graphs (default: when the verifier is on CUDA). backend: the kernels' backend
    (draftheads.eval.engine.kernels; "auto" = Triton on CUDA, the torch references elsewhere). capture_drafter: capture the drafter's
    segments too (None: for drafters known to be capturable). sync_timings: synchronise around segments so that
    the per-phase timings in the stats are exact (slower). strict_graphs: a failed capture is an error instead
    of a warning and an eager segment.
    """

    def __init__(self, decoder: SpeculativeDecoder, graphs: bool | None = None, buckets: Buckets = Buckets(),
                 backend: str = "auto", capture_drafter: bool | None = None, sync_timings: bool = False,
                 strict_graphs: bool = False):
        if is_generic(decoder.runner):
            raise ValueError(f"the fused loop runs on the static-cache runtime; verifier model_type "
                             f"{decoder.verifier.config.model_type!r} runs on the generic path (use the unfused "
                             "decoder)")
        if decoder.first_token != "draft":
            raise ValueError(f"the fused loop takes its first token from the first verification step; this decoder "
                             f"has first_token={decoder.first_token!r} (use the unfused decoder for that)")
        self.decoder = decoder
        self.drafter = decoder.drafter
        self.device = decoder.device
        self.buckets = buckets
        self.backend = backend
        kernels.kernel_mode(self.device, backend)  # an unusable backend is an error now, not at the first step
        self.graphs = SegmentGraphs(self.device, self.device.type == "cuda" if graphs is None else graphs,
                                    strict=strict_graphs)
        if capture_drafter is None:
            capture_drafter = self.drafter.capturable
        self.capture_drafter = capture_drafter and self.drafter.num_draft_tokens > 0
        self.sync_timings = sync_timings
        self.generator = torch.Generator(self.device)
        self.buffers: StepBuffers | None = None
        self._drafter_addresses: tuple[int, ...] | None = None

    @property
    def num_draft_tokens(self) -> int:
        return self.drafter.num_draft_tokens

    # ---- buffers ---------------------------------------------------------------------------------------------
    def _buffers_for(self, batch_size: int, capacity: int) -> StepBuffers:
        S = self.buffers
        if S is None or S.batch_size != batch_size or S.capacity < capacity:
            self.graphs.clear()
            S = self.buffers = StepBuffers(self.decoder.runner, batch_size, capacity, self.backend)
        self.decoder.cache = S.cache  # decoder.prefill / verify / commit run on the bucket's cache
        return S

    def _check_drafter_buffers(self) -> None:
        addresses = _tensor_addresses(self.drafter)
        if addresses != self._drafter_addresses:
            self.graphs.clear(("observe_propose",))
            self._drafter_addresses = addresses

    # ---- begin / step ----------------------------------------------------------------------------------------
    def begin(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
              timings: dict[str, float] | None = None) -> LoopState:
        """Token buffer and KV cache of the bucket, the verifier's prefill, the drafter's start and its first
        proposal (all eager; timed together as the prefill)."""
        t0 = self.tick()
        B = self.buckets.batch_size(len(prompts))
        capacity = self.buckets.capacity_for(self.decoder.capacity(prompts, max_new_tokens))
        S = self._buffers_for(B, capacity)
        pad = self.decoder.verifier.config.pad_token_id or 0
        state = S.load(prompts, pad)
        committed = self.decoder.prefill(state)
        self.drafter.start(state, sampling)
        self._check_drafter_buffers()
        self.drafter.observe(state, committed)
        loop = LoopState(state, list(state.lengths_host), [b < len(prompts) for b in range(B)], len(prompts))
        self._plan(loop)
        self._propose(state, sampling)  # the first draft, eagerly (the drafter's state is fresh from the prefill)
        if timings is not None:
            add_times(timings, prefill=self.tick() - t0)
        return loop

    def _plan(self, loop: LoopState) -> int:
        """This step's window W, and the lengths drafters and decoder.verify size their windows by: W - N - 1.
        W covers verifying N+1 nodes, observing up to D+1 committed tokens and the next proposal."""
        N, E = self.num_draft_tokens, self.drafter.num_extra_nodes
        W = self.buckets.window_for(max(loop.lengths) + 3 * (N + 1) + E, self.buffers.capacity)
        loop.state.lengths_host = [W - N - 1 - E] * self.buffers.batch_size
        return W

    def step(self, loop: LoopState, sampling: Sampling, timings: dict | None = None) -> list[StepRow]:
        """One decode step: V, the one sync, OP (the next draft). Returns a `StepRow` per real row; advances the
        host's lengths."""
        S, state = self.buffers, loop.state
        W = self._plan(loop)
        key = (W, sampling.temperature, sampling.top_p)
        gen = None if sampling.greedy else sampling.generator
        t0 = self.tick()
        self.graphs.run(("verify",) + key, lambda: self._verify(state, sampling), gen)
        S.fetch()
        t1 = self.tick()
        self.graphs.run(("observe_propose",) + key, lambda: self._observe_propose(state, sampling), gen,
                        self.capture_drafter)
        t2 = self.tick()
        rows = [StepRow.unpack(r) for r in S.fetched_rows()]
        for b in range(S.batch_size):
            if loop.active[b]:
                loop.lengths[b] += rows[b].accepted + 1
        if timings is not None:
            add_times(timings, verify=t1 - t0, draft=t2 - t1, other=self.tick() - t2)
        return rows[: loop.num_rows]

    def set_active(self, loop: LoopState, active: list[bool]) -> None:
        """Switch finished real rows off (host lists and the device mask; no sync)."""
        loop.active[: len(active)] = active
        self.buffers.set_active(loop.active)

    def _propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        draft = self.drafter.propose(state, sampling)
        self.buffers.write_draft(draft)
        return draft

    def _verify(self, state: DecodeState, sampling: Sampling):
        S, dec = self.buffers, self.decoder
        draft = S.draft
        out = dec.verify(state, draft)
        if getattr(self.drafter, "typical", None) is not None:  # lossy typical acceptance: no kernel, the reference
            acc = dec.accept(draft, out, sampling)
        else:
            acc = kernels.accept(draft.tokens, draft.tree, draft.probs, out.logits, sampling.temperature,
                                 sampling.top_p, sampling.generator, backend=self.backend)
        committed = dec.commit(state, draft, acc, out)  # compaction through S.cache: the fused kernel
        S.write_step(acc, committed)
        return out, acc, committed

    def _observe_propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        S = self.buffers
        S.observed.copy_(S.committed.count)  # one kernel, so the graph is never empty
        self.drafter.observe(state, S.committed)
        return self._propose(state, sampling)

    # ---- what eval/engine/loop.py's loop asks of an engine ---------------------------------------------------------
    @property
    def verifier(self):
        return self.decoder.verifier

    @property
    def method(self) -> str:
        return self.decoder.method

    @property
    def eos_token_ids(self) -> list[int]:
        return self.decoder.eos_token_ids

    def sampling_generator(self) -> torch.Generator:
        return self.generator  # one generator, registered with every captured graph

    @property
    def phase_timings(self) -> bool:
        """Per-phase times are reported only when synchronised: replayed graphs return before the GPU is done."""
        return self.sync_timings

    def tick(self) -> float:
        return tick(self.device, self.sync_timings)

    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id=CONFIG_EOS) -> GenerationResult:
        """`SpeculativeDecoder.generate`, fused: same arguments, same results (see the module docstring)."""
        return generate(self, input_ids, max_new_tokens, temperature, top_p, seed, eos_token_id)
