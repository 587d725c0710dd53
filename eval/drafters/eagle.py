"""EAGLE in the engine: an EAGLE-1 / EAGLE-3 drafter (models/eagle/) with its own static KV cache, drafting a
chain or EAGLE-2's dynamic tree.

The drafter's sequence. At position t the drafter reads the pair (x_{t+1}, f_t): the token after t and the
verifier's feature at t (EAGLE-1: the final post-norm hidden state; EAGLE-3: fc over three layer inputs). Its
output o_t predicts x_{t+2}. The verifier commits tokens x_0 .. x_{L-1} and holds the pending root x_L, so after
`observe` the drafter's cache holds one entry per committed position 0..L-1 (slot = position), each computed from
the verifier's own features, and o_{L-1} gives the first draft level (the token after the root).

Drafting. A draft node at depth d sits at position L+d-1 and reads (its token, its parent's output), like the
training-time-test unroll; its output gives its children. Draft entries are written after the committed slots
(L, L+1, ...) and are thrown away at the next `observe`, which writes the newly committed positions from the
verifier's features: the rollback is free (accepted drafts are recomputed from the verifier's features, as in the
EAGLE repo, which is what the drafter was trained on) and the cache after a step equals a fresh forward over the
committed tokens.

Modes:
  chain=K   K tokens, one drafter forward per token after the first. T = 0: argmax. T > 0: tree_sampling
            "sample" (default) draws each token from the drafter's softmax (temperature / top-p applied) and hands
            that distribution to the lossless chain rule; "topk" takes the argmax (one-hot, also lossless).
  tree      (default) EAGLE-2's dynamic tree: depth D, top_k k, total_tokens N. Level 1 is the top k tokens after
            the root; at each further level the k frontier nodes with the highest cumulative draft log-prob are
            run through the drafter (one batched forward of k nodes) and each proposes its top k children, so
            k + (D-1) k^2 candidates; finally the N candidates with the highest cumulative log-prob (ties: the
            earlier candidate, so a parent always ranks before its children) form the tree. Picks are
            deterministic given the drafter: one-hot draft distribution, lossless (as in the EAGLE repo, whose
            tree sampling also treats them as one-hot). All on the device: topk / gather / sort, and
            `Tree.from_parents(..., max_depth=D, max_children=k)`; no host sync while drafting.
  parallel  a drafter trained with eagle.parallel (P-EAGLE): a chain of K (default its ttt_steps) from ONE drafter
            forward per step. observe runs the committed pairs and, after them, K-1 mask positions (the mask token
            with fc(mask_hidden), positions L .. L+K-2, causal; padding of ragged rows goes to a scratch slot);
            the last committed pair's output gives draft 1, mask position j's gives draft j+2, each drawn from its
            own distribution (none depends on an earlier draft, so that is the exact distribution the lossless
            chain rule needs). Mask entries sit where the next step's committed pairs go and are overwritten.
Sizes. The default tree (depth 6, top_k 4, total_tokens 16) is sized for CPUs, where verifying N+1 tokens costs
far more than verifying one (scripts/profile_decode_step.py: on 1 core, an 8-layer H=256 verifier takes ~1.4x an
autoregressive step to verify 4 tokens, ~2.2x for 17, ~4x for 49); on a GPU, where a wide verification is nearly
free, EAGLE-2's own depth 6, top_k 10, total_tokens 60 accepts more per step.
EAGLE-3 drafts over its draft vocabulary; tokens are mapped to verifier ids with d2t, and its sampled draft
distribution over the verifier vocabulary is zero outside the draft vocabulary (the lossless rule only needs the
exact distribution each token was drawn from).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from draftheads.eval.engine.acceptance import exponential_noise, probs_from_logits
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.runtime import bucket
from draftheads.eval.engine.tree import Tree, tree_attention_mask

EAGLE_TREE_SAMPLING = ("sample", "topk")
TREE_TOP_K = 4
"""The dynamic tree's children per node by default (the engine's, the train/serve check's): a drafter needs at least
this many draft-vocabulary tokens to draft it."""


class EagleTreeDrafter(Drafter):
    """An EAGLE-1/3 drafter (`draftheads.models.eagle.EagleDrafter`) driven by the decode loop; see the module docstring."""

    name = "eagle"
    capturable = True  # every step op is a device op on fixed buffers (eval/engine/cuda_loop.py may graph it)

    def __init__(self, model, chain: int | None = None, depth: int = 6, top_k: int = TREE_TOP_K, total_tokens: int = 16,
                 tree_sampling: str | None = None, window_bucket: int = 64):
        self.model = model.eval().requires_grad_(False)
        self.version = model.version
        self.parallel = bool(getattr(model, "parallel", False))
        if self.parallel:  # always a chain: the dynamic tree's options do not apply
            chain = model.cfg.ttt_steps if chain is None else chain
        self.chain = chain is not None
        if self.chain:
            if int(chain) < 1:
                raise ValueError(f"method 'eagle': chain={chain}; expected >= 1 draft tokens")
            tree_sampling = tree_sampling or "sample"
            if tree_sampling not in EAGLE_TREE_SAMPLING:
                raise ValueError(f"method 'eagle': tree_sampling={tree_sampling!r}; expected one of "
                                 f"{EAGLE_TREE_SAMPLING}")
            self.depth, self.top_k = int(chain), 1
            self.num_draft_tokens = self.max_depth = self.depth
            self.tree = Tree.chain(self.depth)
        else:
            if tree_sampling not in (None, "topk"):
                raise ValueError("method 'eagle': the dynamic tree picks the top-k children (one-hot, lossless); "
                                 "tree_sampling='sample' is for chain=K only")
            tree_sampling = "topk"
            if depth < 1 or top_k < 1:
                raise ValueError(f"method 'eagle': depth={depth}, top_k={top_k}; expected >= 1")
            candidates = top_k + (depth - 1) * top_k * top_k
            if not 1 <= total_tokens <= candidates:
                raise ValueError(f"method 'eagle': total_tokens={total_tokens}; expected 1..{candidates} (depth "
                                 f"{depth} with top_k {top_k} proposes top_k + (depth-1)*top_k^2 candidates)")
            draft_vocab = model.draft_vocab_size if model.version == 3 else model.verifier_vocab_size
            if top_k > draft_vocab:
                raise ValueError(f"method 'eagle': top_k={top_k}, but the drafter drafts from a vocabulary of "
                                 f"{draft_vocab} tokens (its draft_vocab_size); set --option top_k={draft_vocab} or "
                                 "lower, or draft a chain (--option chain=K)")
            self.depth, self.top_k = int(depth), int(top_k)
            self.num_draft_tokens = int(total_tokens)
            self.max_depth = min(self.depth, self.num_draft_tokens)
            self.tree = None
        self.tree_sampling = tree_sampling
        self.window_bucket = window_bucket
        if self.parallel:
            self.mask_token_id = model.mask_token_id
        if self.version == 3:
            self.layer_ids = tuple(model.feature_layers)
        else:
            self.wants_final = True
        self.hidden_size = model.hidden_size
        self.vocab_size = model.verifier_vocab_size
        # Draft id -> verifier id (identity for EAGLE-1, whose logits are the verifier's lm_head).
        draft_vocab = model.draft_vocab_size if self.version == 3 else self.vocab_size
        self.draft_to_target = model.to_target_ids(torch.arange(draft_vocab, device=model.device))
        self._gqa = model.num_heads != model.num_kv_heads
        self.sliding_window = model.cfg.sliding_window if self.version == 3 else None
        self.cache_k = self.cache_v = None
        self.mask_feature: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None

    def describe(self) -> dict:
        d = {**super().describe(), "eagle_version": self.version, "tree_sampling": self.tree_sampling,
             "parallel": self.parallel}
        if self.chain:
            d["chain"] = self.depth
        else:
            d.update(depth=self.depth, top_k=self.top_k, total_tokens=self.num_draft_tokens)
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        return d

    # ---- buffers -----------------------------------------------------------------------------------------------------
    @property
    def draft_slots(self) -> int:
        """Cache slots after the committed prefix that one propose() writes: (D-1) frontier levels of k nodes."""
        return (self.depth - 1) * self.top_k

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        m = self.model
        B, dev = state.batch_size, state.device
        capacity = state.capacity + self.draft_slots + 1
        if self.cache_k is None or self.cache_k.shape[0] != B or self.cache_k.shape[2] < capacity \
                or self.cache_k.device != dev:
            shape = (B, m.num_kv_heads, capacity, m.head_dim)
            self.cache_k = torch.zeros(shape, dtype=m.dtype, device=dev)
            self.cache_v = torch.zeros(shape, dtype=m.dtype, device=dev)
            self.rows = torch.arange(B, device=dev)[:, None]  # captured forwards read it: public, so a move is seen
        self.capacity = self.cache_k.shape[2]
        self._hidden = torch.zeros(B, self.depth if self.parallel else 1, self.hidden_size, dtype=m.dtype, device=dev)
        if self.parallel:
            with torch.no_grad():
                # (H,): fc(mask_hidden), the same every step. One buffer, refilled: captured graphs read it, so a
                # new tensor at each start would leave a replay reading freed memory.
                feature = m.mask_feature().to(dev)
                if self.mask_feature is None or self.mask_feature.shape != feature.shape or \
                        self.mask_feature.device != feature.device or self.mask_feature.dtype != feature.dtype:
                    self.mask_feature = feature
                else:
                    self.mask_feature.copy_(feature)
        self.draft_to_target = self.draft_to_target.to(dev)
        if self.chain:
            self.tree = self.tree.to(dev)

    def _window(self, n: int) -> int:
        return min(self.capacity, bucket(n, self.window_bucket))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, slot_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run n new pairs through the drafter layer over its static cache. ids, positions, slots (B, n);
        hidden (B, n, H); mask (B, n, W) bool over cache slots 0..W-1, the new tokens' own slots included (their
        keys/values are written first). With a sliding window (eagle.sliding_window) the mask is narrowed to the
        slots whose position, `slot_positions` (B, W) (None: the slot itself), is fewer than the window before the
        query's, as vLLM's KV cache is. Returns the drafter's outputs (B, n, H).

        The same computation as `draftheads.models.eagle.EagleDrafter.forward` (the engine tests check it against that
        public API), through the layer's one public step with this drafter's own attention: keys/values go straight
        into preallocated buffers and grouped-query attention reads the kv heads in place (no cache concatenation,
        no repeated kv heads).
        """
        m = self.model
        B, n = ids.shape
        W = mask.shape[-1]
        if self.sliding_window is not None:
            if slot_positions is None:
                slot_positions = torch.arange(W, device=mask.device)[None]
            mask = mask & (positions[:, :, None] - slot_positions[:, None, :] < self.sliding_window)

        def attend(q, k, v):  # q (B, nh, n, d), k/v (B, nkv, n, d), RoPE applied
            self.cache_k[self.rows, :, slots] = k.transpose(1, 2)  # (B, n, nkv, d)
            self.cache_v[self.rows, :, slots] = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, self.cache_k[:, :, :W], self.cache_v[:, :, :W],
                                                  attn_mask=mask[:, None], enable_gqa=self._gqa)  # (B, nh, n, d)
            return attn.transpose(1, 2).reshape(B, n, -1)

        return m.step(ids, hidden.to(m.dtype), positions, attend)

    # ---- protocol ----------------------------------------------------------------------------------------------------
    def features(self, committed: Committed) -> torch.Tensor:
        """(B, M, H) the drafter's input features at the committed tokens."""
        if self.version == 1:
            return committed.final
        return self.model.project_features([committed.layers[i] for i in self.layer_ids])

    def observe(self, state: DecodeState, committed: Committed) -> None:
        """Write the committed pairs (next token, verifier feature) at their positions; keep the last output."""
        B, M = committed.tokens.shape
        if M == 0:
            return
        if self.parallel:
            return self._observe_parallel(state, committed)
        dev = state.device
        start = committed.start  # (B,) first committed position (= slot) of each row
        steps = torch.arange(M, device=dev)
        pos = start[:, None] + steps  # (B, M)
        # Rows start at most at max(lengths_host) (prefill: 0; a step: the old lengths, not yet advanced on host).
        W = self._window(max(state.lengths_host) + M)  # covers every row's start + M
        mask = torch.arange(W, device=dev)[None, None, :] <= pos[:, :, None]  # (B, M, W): causal over the cache
        out = self.forward(committed.next_tokens, self.features(committed), pos, pos, mask)
        self._hidden = committed.last(out)[:, None]  # (B, 1, H): o_{L-1}, the first draft level's hidden

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        if self.parallel:
            return self._parallel_chain(sampling)
        if self.chain:
            return self._chain(state, sampling)
        return self._dynamic_tree(state)

    # ---- parallel drafting (P-EAGLE) -----------------------------------------------------------------------------
    def _observe_parallel(self, state: DecodeState, committed: Committed) -> None:
        """One drafter forward per step: the committed pairs, then K-1 mask positions after the new length L
        (the mask token with fc(mask_hidden), positions L .. L+K-2, causal), as vLLM's parallel drafting runs
        them. The last committed pair's output gives draft 1, mask j's gives draft j+2. Mask entries sit where the
        next step's committed pairs go (slot = position), so they are overwritten like any draft."""
        B, M = committed.tokens.shape
        dev, m = state.device, self.model
        K1 = self.depth - 1
        start, L = committed.start, state.lengths
        steps = torch.arange(M, device=dev)
        pos_c = start[:, None] + steps  # (B, M)
        slot_c = torch.where(steps[None] < committed.count[:, None], pos_c, self.capacity - 1)  # padding: scratch
        pos_m = L[:, None] + torch.arange(K1, device=dev)  # (B, K-1)
        ids = torch.cat([committed.next_tokens, torch.full((B, K1), self.mask_token_id, device=dev)], 1)
        hidden = torch.cat([self.features(committed).to(m.dtype), self.mask_feature.expand(B, K1, -1)], 1)
        pos = torch.cat([pos_c, pos_m], 1)
        W = self._window(max(state.lengths_host) + M + K1)  # covers every row's L + K - 2
        mask = torch.arange(W, device=dev)[None, None, :] <= pos[:, :, None]  # causal over slots = positions
        out = self.forward(ids, hidden, pos, torch.cat([slot_c, pos_m], 1), mask)
        self._hidden = torch.cat([committed.last(out[:, :M])[:, None], out[:, M:]], 1)  # (B, K, H)

    def _parallel_chain(self, sampling: Sampling) -> Draft:
        """K draft tokens from the K outputs of the last observe; each drawn from its own distribution (none reads
        an earlier draft, so that distribution is the exact one the chain rule needs)."""
        logits = self.model.logits(self._hidden)  # (B, K, V')
        picks = [self._pick(logits[:, d], sampling) for d in range(self.depth)]
        probs = None if picks[0][1] is None else torch.stack([p for _, p in picks], 1)
        return Draft(torch.stack([t for t, _ in picks], 1), self.tree, probs)

    # ---- chain ---------------------------------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, V') draft logits -> verifier token ids (B,), and the distribution over the verifier vocabulary it
        was drawn from (B, V), or None for an argmax."""
        if sampling.greedy or self.tree_sampling == "topk":
            return self.draft_to_target[logits.argmax(-1)], None
        p = probs_from_logits(logits, sampling.temperature, sampling.top_p)  # (B, V') over the draft vocab
        draft_id = (p / exponential_noise(p.shape, sampling.generator, p.device)).argmax(-1)
        full = p.new_zeros(p.shape[0], self.vocab_size)
        full[:, self.draft_to_target] = p  # zero outside the draft vocabulary
        return self.draft_to_target[draft_id], full

    def _chain(self, state: DecodeState, sampling: Sampling) -> Draft:
        B, dev = state.batch_size, state.device
        L = state.lengths
        W = self._window(max(state.lengths_host) + self.depth)
        j = torch.arange(W, device=dev)
        hidden = self._hidden  # (B, 1, H)
        logits = self.model.logits(hidden)[:, 0]  # (B, V')
        tokens, probs = [], []
        for d in range(1, self.depth + 1):
            tok, p = self._pick(logits, sampling)
            tokens.append(tok)
            probs.append(p)
            if d == self.depth:
                break
            at = (L + d - 1)[:, None]  # (B, 1) the node's position and slot
            mask = (j[None, :] <= at)[:, None, :]  # (B, 1, W): the prefix, the chain above, itself
            hidden = self.forward(tok[:, None], hidden, at, at, mask)
            logits = self.model.logits(hidden)[:, 0]
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)  # (B, K, V)
        return Draft(torch.stack(tokens, 1), self.tree, draft_probs)

    # ---- EAGLE-2 dynamic tree ------------------------------------------------------------------------------------
    def _dynamic_tree(self, state: DecodeState) -> Draft:
        m = self.model
        B, dev = state.batch_size, state.device
        k, D, N = self.top_k, self.depth, self.num_draft_tokens
        S = self.draft_slots
        L = state.lengths
        W = self._window(max(state.lengths_host) + S)
        H = self.hidden_size
        ar_k = torch.arange(k, device=dev)

        # Level 1: the top k tokens after the root, from the last committed position's output.
        logp = torch.log_softmax(m.logits(self._hidden).float(), -1)[:, 0]  # (B, V')
        score, draft_id = logp.topk(k, -1)  # (B, k)
        cand_tokens = [self.draft_to_target[draft_id]]
        cand_scores = [score]
        cand_parents = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        front_tok, front_score, front_cand = cand_tokens[0], score, ar_k.expand(B, k)
        front_hidden = self._hidden.expand(B, k, H)
        front_anc = torch.zeros(B, k, max(S, 1), dtype=torch.bool, device=dev)  # draft slots above each node
        # own_slot[d-1, i]: the one-hot of frontier node i's slot at depth d, (D-1, k, S).
        own_slot = torch.arange(max(S, 1), device=dev) == (torch.arange(D - 1, device=dev)[:, None, None] * k
                                                             + ar_k[None, :, None])
        # each slot's position: the prefix's slot = position; frontier level d's k slots sit at position L+d-1
        j = torch.arange(W, device=dev)[None]
        slot_positions = torch.where(j < L[:, None], j, L[:, None] + (j - L[:, None]).div(k, rounding_mode="floor"))
        for d in range(1, D):
            # Run the frontier (depth d, positions L+d-1) through the drafter: k nodes in one forward.
            slots = L[:, None] + (d - 1) * k + ar_k  # (B, k)
            # Each node's own slot (its children inherit it). An OR with a one-hot, not `front_anc[:, i, j] = True`:
            # that index_put_ copies the scalar from host memory, which a CUDA graph capture refuses (H200 run of
            # 2026-12-04); an eager CUDA run pays a host-to-device copy for it at every level.
            front_anc = front_anc | own_slot[d - 1]
            mask = tree_attention_mask(L, front_anc, W)  # (B, k, W): prefix + ancestors-or-self draft slots
            out = self.forward(front_tok, front_hidden, (L + d - 1)[:, None].expand(B, k), slots, mask,
                               slot_positions)
            logp = torch.log_softmax(m.logits(out).float(), -1)  # (B, k, V')
            child_lp, child_id = logp.topk(k, -1)  # (B, k, k)
            cum = (front_score[..., None] + child_lp).flatten(1)  # (B, k*k) cumulative draft log-prob
            first = k + (d - 1) * k * k  # candidate index of this level's first candidate
            cand_tokens.append(self.draft_to_target[child_id].flatten(1))
            cand_scores.append(cum)
            cand_parents.append(front_cand[..., None].expand(B, k, k).flatten(1))
            if d < D - 1:  # the next frontier: the k best of this level
                best = cum.topk(k, -1).indices  # (B, k)
                parent = best // k  # index into the current frontier
                front_tok = cand_tokens[-1].gather(1, best)
                front_score = cum.gather(1, best)
                front_cand = first + best
                front_hidden = out.gather(1, parent[..., None].expand(B, k, H))
                front_anc = front_anc.gather(1, parent[..., None].expand(B, k, front_anc.shape[-1]))
        tokens, scores, parents = (torch.cat(x, 1) for x in (cand_tokens, cand_scores, cand_parents))  # (B, C)

        # Rerank: the N best candidates by cumulative log-prob, in candidate order (parents before children).
        keep = scores.sort(dim=-1, descending=True, stable=True).indices[:, :N].sort(-1).values  # (B, N)
        node_of = torch.zeros_like(scores, dtype=torch.long).scatter_(
            1, keep, torch.arange(1, N + 1, device=dev).expand(B, N))  # candidate -> node index (1..N)
        cand_parent = parents.gather(1, keep)  # (B, N)
        node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp_min(0)))
        tree = Tree.from_parents(torch.cat([torch.full((B, 1), -1, device=dev, dtype=torch.long), node_parent], 1),
                                 max_depth=self.max_depth, max_children=k)
        return Draft(tokens.gather(1, keep), tree)


def make_eagle(verifier, draft, chain: int | None = None, depth: int = 6, top_k: int = TREE_TOP_K,
               total_tokens: int = 16,
               tree_sampling: str | None = None) -> EagleTreeDrafter:
    """The `eagle` method: `draft` is an exported folder (`draftheads.models.eagle.export_eagle`) or an EagleDrafter module.
    Default: EAGLE-2's dynamic tree (depth, top_k, total_tokens); chain=K for a chain of K tokens."""
    from draftheads.models.eagle import EagleDrafter
    from draftheads.models.export import load_eagle

    if draft is None:
        raise ValueError("method 'eagle' needs draft=<an EAGLE export folder (export_eagle) or EagleDrafter>")
    if isinstance(draft, (str, os.PathLike)):
        model = load_eagle(draft, verifier)
    elif isinstance(draft, EagleDrafter):
        if (draft.hidden_size, draft.verifier_vocab_size) != (verifier.hidden_size, verifier.vocab_size):
            raise ValueError(f"method 'eagle': the drafter is for hidden_size={draft.hidden_size}, vocab_size="
                             f"{draft.verifier_vocab_size}; the verifier has {verifier.hidden_size}, "
                             f"{verifier.vocab_size}")
        model = draft.to(verifier.device)
    else:
        raise TypeError(f"method 'eagle': draft must be an export folder or an EagleDrafter, got "
                        f"{type(draft).__name__}")
    return EagleTreeDrafter(model, chain, depth, top_k, total_tokens, tree_sampling)
