"""The speculative decoder: draft, verify in one forward, accept, commit — repeat, without changing what the
verifier would have said.

    from draftheads.eval import build_decoder
    dec = build_decoder("tiny-code", method="draft-model", draft="path/to/small-lm")   # or SpeculativeDecoder(v, drafter)
    out = dec.generate([[1, 5, 9], [1, 7]], max_new_tokens=64, temperature=0.0)
    out.output_ids, out.stats.tau

The decoder runs any `Drafter` (draftheads.eval.engine.protocol) it is handed and imports none: the methods and the
registry that builds them by name live in draftheads.eval.drafters.

Batching: rows are left-aligned in the token buffer and in every KV cache (slot = position) with per-row lengths,
so prompts of different lengths need no padding inside the sequence, and each row accepts its own number of
tokens per step. Finished rows stay in the batch (fixed shapes) and stop advancing. Trees run batched as well.

Host syncs: one per decode step (the accepted tokens, copied to the host to extend the outputs and decide
whether to stop; drafters are then shown only the longest accepted path, `Committed.trim`). Everything else in a
step stays on the device.

Exactness: greedy output equals the verifier's plain greedy decoding token for token in float32. In bf16/fp16 a
near-tie can flip when kernel shapes change (the attention window here is bucketed, `window_bucket=64`, so it
covers a few masked slots; `window_bucket=1` gives the exact shapes of a cached Hugging Face decode), just as
Hugging Face's own cached and uncached greedy decoding can disagree in bf16.

Where the first token comes from (`first_token`): by default ("draft") the first step's root is the prompt's last
token: prefill runs the prompt minus that token, so every generated token comes out of a verification step (and a
drafter drafts from the very first token). With "prefill" (vLLM's and SGLang's convention) the prefill runs the
whole prompt and chooses the first token itself (argmax, or a sample at T > 0), and drafting starts after it: the
accepted-token counts then compare one for one with vLLM's. Outputs are the same either way (greedy), or follow the
same distribution (sampled).
"""

from __future__ import annotations

import torch
from torch import nn

from draftheads.eval.engine.acceptance import Acceptance, accept, probs_from_logits, sample
from draftheads.eval.engine.generic_runtime import is_generic, make_runner
from draftheads.eval.engine.loop import CONFIG_EOS, GenerationResult, add_times, generate, tick
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, NoDrafter, Sampling, StepRow
from draftheads.eval.engine.runtime import RunnerOutput, UnsupportedModelError, bucket, causal_mask
from draftheads.eval.engine.tree import tree_attention_mask

FIRST_TOKEN = ("draft", "prefill")


def cache_capacity(longest_prompt: int, max_new_tokens: int, num_draft_tokens: int, num_extra_nodes: int = 0,
                   first_token: str = "draft") -> int:
    """The one formula for how many KV-cache slots a batch needs. An active row has length <= T + max_new - 2; its
    last step may commit D + 1 more, and a finished row is still verified (fixed shapes): N + 1 slots past that, and
    its tokens written up to D + 1 past it; the E extra nodes of a step (lookahead's window) come on top. Plus one
    spare scratch slot at the end (drafters use it), never reached by any row, and with first_token="prefill" the
    slot of the token the prefill chose."""
    return longest_prompt + max_new_tokens + 2 * num_draft_tokens + 2 + num_extra_nodes + (first_token == "prefill")


def load_verifier(verifier, device=None, dtype=None):
    """A Verifier from a name/folder, or the given Verifier moved to `device` / `dtype` when they are given."""
    from draftheads.models.verifier import Verifier

    if isinstance(verifier, Verifier):
        if device is not None or dtype is not None:
            verifier.model.to(device=device, dtype=dtype)
        return verifier
    return Verifier.from_pretrained(verifier, dtype=dtype, device=device)


def check_generic(verifier, drafter: Drafter, method: str) -> None:
    """A verifier on the generic path (eval/engine/generic_runtime.py) verifies chains, with logits = lm_head(final)."""
    model_type = verifier.config.model_type
    if drafter.num_extra_nodes:
        raise UnsupportedModelError(
            f"verifier model_type {model_type!r} runs on the generic path, which cannot run method {method!r} "
            "(its lookahead window needs a custom attention mask in the verifier's forward)")
    if drafter.max_depth != drafter.num_draft_tokens:
        raise UnsupportedModelError(
            f"verifier model_type {model_type!r} runs on the generic path, which verifies chains only; method "
            f"{method!r} drafts a tree here ({drafter.num_draft_tokens} nodes, depth {drafter.max_depth}): ask for "
            "a chain (option chain=N for medusa or eagle, num_draft_tokens=N for draft-model; eval CLI: "
            "--option chain=N)")
    verifier.check_head(f"the generic path's verification ({method})")


# ---- the decoder -------------------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """A verifier, a drafter, a static KV cache, and the decode loop (`prefill`, `draft`, `verify`, `accept`,
    `commit`)."""

    def __init__(self, verifier, drafter: Drafter | None = None, method: str | None = None, window_bucket: int = 64,
                 sync_timings: bool = False, first_token: str = "draft"):
        from draftheads.models.verifier import Verifier

        if isinstance(verifier, nn.Module) and not isinstance(verifier, Verifier):
            verifier = Verifier(verifier)
        self.verifier = verifier
        self.drafter = drafter if drafter is not None else NoDrafter()
        self.method = method or self.drafter.name
        self.runner = make_runner(verifier.model, "verifier")
        if is_generic(self.runner):
            check_generic(verifier, self.drafter, self.method)
        self.window_bucket = window_bucket
        self.sync_timings = sync_timings
        """Synchronise the device around timed phases (exact per-phase timings on CUDA, slightly slower)."""
        if first_token not in FIRST_TOKEN:
            raise ValueError(f"first_token={first_token!r}: expected one of {', '.join(FIRST_TOKEN)}")
        self.first_token = first_token
        """Where the first new token comes from: "draft" (the first verification step) or "prefill" (module doc)."""
        self.cache = None
        eos = verifier.config.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        # A drafter that reads decoder-layer inputs (EAGLE-3) must name layers this verifier has.
        if self.drafter.layer_ids:
            verifier.check_layer_ids(list(self.drafter.layer_ids), key=f"{self.method} layer_ids")

    @classmethod
    def from_pretrained(cls, verifier, drafter: Drafter | None = None, device=None, dtype=None,
                        first_token: str = "draft", method: str | None = None) -> "SpeculativeDecoder":
        """verifier: a name/folder (`draftheads.models.verifier.Verifier.from_pretrained`) or a Verifier; drafter:
        a built `Drafter` (None: autoregressive). By method name: `draftheads.eval.build_decoder`."""
        return cls(load_verifier(verifier, device, dtype), drafter, method=method, first_token=first_token)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ---- inputs --------------------------------------------------------------------------------------------------
    def capacity(self, prompts, max_new_tokens: int) -> int:
        """KV-cache slots a batch needs (`cache_capacity`); the fused loop rounds the same number up to its bucket."""
        return cache_capacity(max(map(len, prompts)), max_new_tokens, self.drafter.num_draft_tokens,
                              self.drafter.num_extra_nodes, self.first_token)

    def _new_state(self, prompts: list[list[int]], max_new_tokens: int) -> DecodeState:
        B, dev = len(prompts), self.device
        capacity = self.capacity(prompts, max_new_tokens)
        if self.cache is None or self.cache.batch_size != B or self.cache.capacity < capacity:
            self.cache = self.runner.new_cache(B, capacity)
        capacity = self.cache.capacity  # a reused cache may be larger; every buffer of the batch uses its size
        pad = self.verifier.config.pad_token_id or 0
        tokens = torch.full((B, capacity), pad, dtype=torch.long)
        for b, row in enumerate(prompts):
            tokens[b, : len(row)] = torch.tensor(row)
        plen = torch.tensor([len(r) for r in prompts])
        held = int(self.first_token == "draft")  # the prompt's last token waits as the first root, or it is run too
        return DecodeState(tokens=tokens.to(dev), lengths=(plen - held).to(dev),
                           active=torch.ones(B, dtype=torch.bool, device=dev), prompt_lengths=plen.to(dev),
                           capacity=capacity, lengths_host=[len(r) - held for r in prompts], active_host=[True] * B)

    def _window(self, state: DecodeState, new: int) -> int:
        return min(state.capacity, bucket(max(state.lengths_host) + new, self.window_bucket))

    # ---- the loop pieces -----------------------------------------------------------------------------------------
    def prefill(self, state: DecodeState, sampling: Sampling | None = None) -> Committed:
        """Run every prompt minus its last token (left-aligned, padded to the longest) into the KV cache; with
        first_token="prefill" the whole prompt, and the verifier's choice at its last token becomes each row's root
        (`state.prefill_tokens`, one host sync)."""
        B, dev = state.batch_size, state.device
        M = max(state.lengths_host)
        if M == 0:  # one-token prompts only: nothing to run, empty features of the usual shapes
            committed = self._committed_prefill(state, M)
            H, V = self.verifier.hidden_size, self.verifier.vocab_size
            empty = torch.zeros(B, 0, H, dtype=self.runner.dtype, device=dev)
            committed.final = empty if self.drafter.wants_final else None
            committed.layers = {i: empty for i in self.drafter.layer_ids}
            committed.logits = torch.zeros(B, 0, V, dtype=self.runner.dtype, device=dev) \
                if self.drafter.wants_logits else None
            return committed
        tokens = state.tokens[:, :M].clone()  # a copy: slots past a short row's length are rewritten later
        pos = torch.arange(M, device=dev).expand(B, M)
        mask = causal_mask(M, self._window(state, 0), dev).expand(B, -1, -1)
        out = self.runner(self.cache, tokens, pos, pos, mask, layer_ids=self.drafter.layer_ids,
                          logits=self.drafter.wants_logits)
        if self.first_token == "prefill":
            last = out.final[torch.arange(B, device=dev), state.lengths - 1]  # (B, H): each prompt's last token
            logits = self.runner.lm_head(last)  # (B, V)
            greedy = sampling is None or sampling.greedy
            first = logits.argmax(-1) if greedy else \
                sample(probs_from_logits(logits, sampling.temperature, sampling.top_p), sampling.generator)
            state.tokens.scatter_(1, state.lengths[:, None], first[:, None])  # the first root
            state.prefill_tokens = first.tolist()
        committed = self._committed_prefill(state, M)
        committed.final = out.final if self.drafter.wants_final else None
        committed.layers = out.layers
        committed.logits = out.logits
        return committed

    def _committed_prefill(self, state: DecodeState, M: int) -> Committed:
        B = state.batch_size
        return Committed(tokens=state.tokens[:, :M].clone(), next_tokens=state.tokens[:, 1: M + 1].clone(),
                         count=state.lengths.clone(), start=torch.zeros(B, dtype=torch.long, device=state.device),
                         prefill=True)

    def draft(self, state: DecodeState, sampling: Sampling) -> Draft:
        return self.drafter.propose(state, sampling)

    def verify(self, state: DecodeState, draft: Draft) -> RunnerOutput:
        """ONE verifier forward over root + N draft nodes at slots len .. len+N, positions len + depth."""
        B = state.batch_size
        tree = draft.tree.expand(B)
        L = state.lengths
        n = tree.num_nodes
        ids = torch.cat([state.roots()[:, None], draft.tokens], 1)  # (B, N+1)
        if draft.extra is not None:
            return self._verify_with_extra(state, draft, tree, ids)
        slots = L[:, None] + torch.arange(n, device=state.device)
        mask = tree_attention_mask(L, tree.ancestors, self._window(state, n))  # (B, N+1, W)
        return self.runner(self.cache, ids, L[:, None] + tree.depth, slots, mask, layer_ids=self.drafter.layer_ids)

    def _verify_with_extra(self, state: DecodeState, draft: Draft, tree, ids: torch.Tensor) -> RunnerOutput:
        """The same forward with the drafter's extra nodes after the tree (slots len+N+1 .., their own mask: prefix,
        root, the extra nodes they name); their logits go to the drafter, the rest is verify's usual output."""
        extra, L, dev = draft.extra, state.lengths, state.device
        B, n, E = state.batch_size, tree.num_nodes, extra.tokens.shape[1]
        window = self._window(state, n + E)
        slots = L[:, None] + torch.arange(n + E, device=dev)
        pos = torch.cat([L[:, None] + tree.depth, L[:, None] + extra.offsets[None]], 1)
        j = torch.arange(window, device=dev)
        sees = (j[None, None, :] <= L[:, None, None]).expand(B, E, window).clone()  # prefix and root
        cols = (L[:, None] + n + torch.arange(E, device=dev))[:, None, :].expand(B, E, E)  # the extra nodes' slots
        sees.scatter_(2, cols, extra.mask[None].expand(B, E, E))  # past the root: nothing there to overwrite
        mask = torch.cat([tree_attention_mask(L, tree.ancestors, window), sees], 1)  # (B, N+1+E, W)
        out = self.runner(self.cache, torch.cat([ids, extra.tokens], 1), pos, slots, mask,
                          layer_ids=self.drafter.layer_ids)
        self.drafter.see_extra(out.logits[:, n:])
        cut = lambda x: x[:, :n]  # noqa: E731
        return RunnerOutput(final=cut(out.final), layers={i: cut(h) for i, h in out.layers.items()},
                            logits=cut(out.logits))

    def accept(self, draft: Draft, out: RunnerOutput, sampling: Sampling) -> Acceptance:
        return accept(draft.tokens, draft.tree, draft.probs, out.logits, sampling.temperature, sampling.top_p,
                      sampling.generator, typical=self.drafter.typical)

    def commit(self, state: DecodeState, draft: Draft, acc: Acceptance, out: RunnerOutput) -> Committed:
        """Keep the accepted path: compact its K/V to consecutive slots, write its tokens and the new root, advance
        the active rows' lengths. Rejected nodes' slots are left behind the new length (rollback)."""
        B, dev = state.batch_size, state.device
        start = state.lengths.clone()
        path, a = acc.path, acc.num_accepted  # (B, D+1), (B,)
        if not draft.tree.is_chain:
            self.cache.compact(start, path)
        nodes = torch.cat([state.roots()[:, None], draft.tokens], 1)  # (B, N+1)
        path_tokens = nodes.gather(1, path)  # (B, D+1), root first
        steps = torch.arange(path.shape[1], device=dev)
        state.tokens.scatter_(1, start[:, None] + steps, path_tokens)
        state.tokens.scatter_(1, (start + a + 1)[:, None], acc.next_token[:, None])
        count = (a + 1) * state.active
        state.lengths += count
        shifted = torch.cat([path_tokens[:, 1:], acc.next_token[:, None]], 1)
        next_tokens = torch.where(steps[None] == a[:, None], acc.next_token[:, None], shifted)
        d = self.drafter
        return Committed(
            tokens=path_tokens, next_tokens=next_tokens, count=count, start=start, prefill=False, path=path,
            final=out.final.gather(1, path[..., None].expand(-1, -1, out.final.shape[-1])) if d.wants_final else None,
            layers={i: h.gather(1, path[..., None].expand(-1, -1, h.shape[-1])) for i, h in out.layers.items()},
            logits=out.logits.gather(1, path[..., None].expand(-1, -1, out.logits.shape[-1]))
            if d.wants_logits else None)

    # ---- the loop (eval/engine/loop.py runs it: begin, then step until every row stopped) -------------------------
    def begin(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
              timings: dict[str, float] | None = None) -> DecodeState:
        """A new batch: token buffer and KV cache for these prompts, the verifier's prefill, the drafter's start."""
        timings = {} if timings is None else timings
        t0 = self.tick()
        state = self._new_state(prompts, max_new_tokens)
        committed = self.prefill(state, sampling)
        t1 = self.tick()
        self.drafter.start(state, sampling)
        self.drafter.observe(state, committed)
        add_times(timings, prefill=t1 - t0, draft=self.tick() - t1)
        return state

    def step(self, state: DecodeState, sampling: Sampling, timings: dict[str, float] | None = None
             ) -> list[StepRow]:
        """One decode step: draft, verify (one forward), accept, commit, the step's one host sync, observe.

        Returns a `StepRow` per row and advances `state.lengths_host` of the active rows (`state.active_host`)."""
        timings = {} if timings is None else timings
        t0 = self.tick()
        draft = self.draft(state, sampling)
        t1 = self.tick()
        out = self.verify(state, draft)
        t2 = self.tick()
        acc = self.accept(draft, out, sampling)
        committed = self.commit(state, draft, acc, out)
        # The step's one device -> host sync: accepted lengths, the accepted tokens, the new roots. Before the
        # drafter's observe, so that it runs over the longest accepted path only (on a CPU a forward over 1-2
        # tokens costs much less than over the deepest possible D+1).
        packed = torch.cat([acc.num_accepted[:, None], committed.tokens, acc.next_token[:, None]], 1).tolist()
        rows = [StepRow.unpack(r) for r in packed]
        active = state.active_host
        committed = committed.trim(max([rows[b].accepted + 1 for b in range(len(rows)) if active[b]], default=1))
        t3 = self.tick()
        self.drafter.observe(state, committed)
        t4 = self.tick()
        for b, row in enumerate(rows):
            if active[b]:
                state.lengths_host[b] += row.accepted + 1
        add_times(timings, draft=(t1 - t0) + (t4 - t3), verify=t2 - t1, other=t3 - t2)
        return rows

    def set_active(self, state: DecodeState, active: list[bool]) -> None:
        """Switch finished rows off (host list and device mask; no sync)."""
        state.active_host = list(active)
        state.active.copy_(torch.tensor(active), non_blocking=True)

    def sampling_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device)

    @property
    def phase_timings(self) -> bool:
        return True

    def tick(self) -> float:
        return tick(self.device, self.sync_timings)

    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id=CONFIG_EOS) -> GenerationResult:
        """Decode up to `max_new_tokens` per row. input_ids: LongTensor [B, T] or a list of token-id lists.

        temperature 0 is greedy; otherwise samples exactly from softmax(logits / T) restricted to the top-p
        nucleus (nothing else: no generation-config top-k). `seed` makes sampling reproducible. Rows stop after
        their first EOS (the verifier config's eos_token_id(s), or `eos_token_id`: an id, a list, or None).
        The loop is eval/engine/loop.py's, shared with the fused CUDA loop (`FusedDecoder(decoder).generate`).
        """
        return generate(self, input_ids, max_new_tokens, temperature, top_p, seed, eos_token_id)
