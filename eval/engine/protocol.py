"""The drafter protocol: what the decode loop gives a drafter, and what it gets back.

The loop (eval/engine/loop.py, running eval/engine/decoder.py's pieces) per step:

    draft = drafter.propose(state, sampling)            # Draft: tokens (B, N), tree, probs (B, N, V) or None
    out   = verify(state, draft)                        # ONE verifier forward over root + N draft nodes
    acc   = accept(draft, out.logits, sampling)         # draftheads.eval.engine.acceptance: accepted path + next token per row
    committed = commit(state, draft, acc, out)          # verifier KV compaction, lengths, tokens buffer
    drafter.observe(state, committed)                   # the drafter updates its own state and rolls back

and once before the first step, after the verifier's prefill over the prompt minus its last token:

    drafter.start(state, sampling)                      # allocate own buffers (KV cache) for this batch
    drafter.observe(state, committed)                   # Committed for the prompt tokens (prefill=True)

State seen by a drafter (`DecodeState`, all on the device): `tokens[b, :lengths[b]]` are row b's committed tokens,
all in the verifier's KV cache at slot = position; `tokens[b, lengths[b]]` is the pending root token, chosen by
the verifier (or the prompt's last token) and not yet run through it. A draft continues from the root.

What a drafter returns (`Draft`): N draft tokens as nodes 1..N of a tree (`draftheads.eval.engine.tree.Tree`) whose node 0 is the
root, and for sampling the exact distribution each node was drawn from (see eval/engine/acceptance.py; None means every
node is a deterministic pick, i.e. a one-hot draft distribution, always lossless). N, the tree's depth D and its
branching must not change between steps of one `generate` call (fixed shapes; dynamic trees vary only which
parent each node has, with the same N, D and max children).

What a drafter is told after each step (`Committed`): the tokens that just entered the verifier's cache
(root + accepted drafts, `count` per row), the token that follows each of them (`next_tokens`: the accepted
drafts shifted by one, then the new root), the verifier's outputs at those tokens (post-norm hidden states, the
inputs of the decoder layers the drafter listed in `layer_ids`, logits), and the accepted tree path. A drafter
with its own KV cache rolls it back here: everything it wrote for rejected nodes is simply not counted
(lengths), and accepted tree nodes are compacted to consecutive slots (`StaticKVCache.compact`).

Rows whose prompt is a single token have no committed token before the first step (count 0, empty features):
a drafter that drafts from verifier features proposes anything it likes there (say, the root repeated);
acceptance stays lossless whatever is proposed, only that step's acceptance is poor.

How Medusa and EAGLE plug in (eval/drafters/medusa.py, eval/drafters/eagle.py):
  - Medusa (wants_final): observe keeps `final` at the last committed token of each row
    (`committed.last(committed.final)`); propose runs the heads on it and fills the static tree
    (`Tree.from_paths`) with each head's top-k (deterministic picks, probs=None) or draws without replacement.
  - EAGLE-1 (wants_final) / EAGLE-3 (layer_ids = the three feature layers): observe feeds the pairs
    (next_tokens_t, feature_t) of the `count` committed tokens through the draft layer into its own KV cache at
    their positions (ragged per row: padded to M, causal mask); draft entries of the last step sit after the
    committed slots and are simply overwritten, since accepted drafts are recomputed from the verifier's features.
    Propose expands the chain, or EAGLE-2's dynamic tree by cumulative log-prob, from the last pair's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from draftheads.eval.engine.tree import Tree


@dataclass
class Sampling:
    """How the next tokens are chosen; drafters use the same temperature / top-p for their own distributions."""

    temperature: float = 0.0
    """0 = greedy; otherwise softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus mass, 1 = the whole vocabulary."""
    generator: torch.Generator | None = None
    """Source of all randomness in the step (seeded by `generate(seed=...)`)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: expected >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: expected 0 < top_p <= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class DecodeState:
    """The batch being decoded. Device tensors, plus host mirrors refreshed by the loop's one sync per step."""

    tokens: torch.Tensor
    """(B, capacity) long: committed tokens, then the pending root at index `lengths[b]`; beyond that, garbage."""
    lengths: torch.Tensor
    """(B,) long: committed tokens per row (= the verifier's KV-cache length; the root's position)."""
    active: torch.Tensor
    """(B,) bool: rows still generating. Finished rows keep being computed (fixed shapes) but never advance."""
    prompt_lengths: torch.Tensor
    """(B,) long."""
    capacity: int
    """Slots per row in the token buffer and in every KV cache."""
    lengths_host: list[int] = field(default_factory=list)
    """`lengths` as Python ints (valid at the start of each step)."""
    active_host: list[bool] = field(default_factory=list)
    """`active` as Python bools (the loop's copy; it switches rows off in both)."""
    prefill_tokens: list[int] | None = None
    """Per row, the first new token when the prefill chose it (`first_token="prefill"`, vLLM's convention); None
    when the first token comes out of the first verification step, as every later one does."""

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def roots(self) -> torch.Tensor:
        """(B,) the pending root token of each row."""
        return self.tokens.gather(1, self.lengths[:, None])[:, 0]


@dataclass
class ExtraNodes:
    """Tokens a drafter wants run through the verifier in the same forward but never accepted (lookahead decoding's
    Jacobi window): after the tree's nodes, each at position root + `offsets[e]`, attending to the committed
    prefix, the root and the extra nodes `mask[e]` marks. Their logits go back to `Drafter.see_extra`."""

    tokens: torch.Tensor
    """(B, E) long."""
    offsets: torch.Tensor
    """(E,) long: position relative to the root (>= 1)."""
    mask: torch.Tensor
    """(E, E) bool: extra node e attends to extra node e' (itself included)."""


@dataclass
class Draft:
    """A drafter's proposal for one step."""

    tokens: torch.Tensor
    """(B, N) long: draft tokens, nodes 1..N of `tree`."""
    tree: Tree
    """The tree over root + N nodes (batch 1 or B)."""
    probs: torch.Tensor | None = None
    """(B, N, V): for each node, the exact distribution it was drawn from; None = all deterministic picks."""
    extra: ExtraNodes | None = None
    """Nodes run in the same verifier forward that are not candidates (None for every drafter but lookahead)."""

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


@dataclass
class Committed:
    """The verifier's outputs for the tokens that just entered its KV cache."""

    tokens: torch.Tensor
    """(B, M) long: committed tokens (prefill: the prompt minus its last token; step: root + accepted drafts,
    M = the largest count of the step)."""
    next_tokens: torch.Tensor
    """(B, M) long: the token after each (so next_tokens[b, count[b] - 1] is the new pending root)."""
    count: torch.Tensor
    """(B,) long: valid entries per row (0 for finished rows); entries past it are padding."""
    start: torch.Tensor
    """(B,) long: position (= cache slot) of tokens[:, 0]."""
    prefill: bool
    """True for the prompt, False after a decode step."""
    path: torch.Tensor | None = None
    """(B, D+1) long: after a step, the accepted tree path (node indices, padded with the last accepted node)."""
    final: torch.Tensor | None = None
    """(B, M, H) post-norm hidden states at `tokens`, if the drafter wants_final."""
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer id -> (B, M, H) that decoder layer's input at `tokens`, for the drafter's layer_ids."""
    logits: torch.Tensor | None = None
    """(B, M, V) verifier logits at `tokens`, if the drafter wants_logits."""

    def trim(self, m: int) -> "Committed":
        """The first m columns of every (B, M, ...) field (m >= the largest count): what the decoder hands drafters
        after a step, so a drafter runs over max(count) tokens rather than the deepest possible path."""
        cut = lambda x: None if x is None else x[:, :m]  # noqa: E731
        return dataclasses.replace(self, tokens=self.tokens[:, :m], next_tokens=self.next_tokens[:, :m],
                                   final=cut(self.final), layers={i: h[:, :m] for i, h in self.layers.items()},
                                   logits=cut(self.logits))

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """Entry count-1 of a (B, M, ...) tensor per row: the value at the last committed token, (B, ...).
        Rows with count 0 get entry 0."""
        idx = (self.count - 1).clamp_min(0)
        return x[torch.arange(x.shape[0], device=x.device), idx]


class StepRow(NamedTuple):
    """What one decode step did for one row, read back in the step's one host sync (both engines return a list of
    these, one per real row, from `step`)."""

    accepted: int
    """a: the draft tokens the verifier accepted."""
    root: int
    """The token verified as node 0 of the tree (it entered the cache this step)."""
    drafts: tuple[int, ...]
    """The accepted path after the root, padded to the tree's depth D: the first `accepted` are real."""
    next_token: int
    """The token the verifier chose after them: the correction, or the bonus token when all were accepted."""

    @property
    def new_tokens(self) -> list[int]:
        """What the step adds to the row's output: the accepted drafts, then the next token."""
        return [*self.drafts[: self.accepted], self.next_token]

    @classmethod
    def unpack(cls, packed: list[int]) -> "StepRow":
        """From the packed host row [a, root, drafts (D), next token] the device writes."""
        return cls(packed[0], packed[1], tuple(packed[2:-1]), packed[-1])


class Drafter:
    """Base class of everything that proposes draft tokens. Subclasses set the class attributes and override
    `propose`; `start` / `observe` default to doing nothing (stateless drafters such as n-gram lookup)."""

    name: str = "drafter"
    num_draft_tokens: int = 0
    """N: draft tokens per step (tree nodes besides the root)."""
    max_depth: int = 0
    """D: the deepest draft node (N for a chain)."""
    layer_ids: tuple[int, ...] = ()
    """Verifier decoder layers whose inputs the drafter needs in `Committed.layers` (EAGLE-3)."""
    wants_final: bool = False
    """Whether `Committed.final` (post-norm hidden states) is needed (Medusa, EAGLE-1)."""
    wants_logits: bool = False
    """Whether `Committed.logits` is needed."""
    num_extra_nodes: int = 0
    """E: extra nodes per step (`Draft.extra`, the same E every step), run through the verifier but never accepted."""
    typical: tuple[float, float] | None = None
    """(epsilon, alpha): sampled steps use Medusa's typical acceptance, which is LOSSY (the output no longer
    follows the verifier's distribution). None, the default for every drafter: the lossless rules."""
    capturable: bool = False
    """Whether every op of `propose` / `observe` is a device op on fixed buffers, so the fused loop
    (eval/engine/cuda_loop.py) may capture them in a CUDA graph."""

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        """A new batch: allocate or reuse own buffers for `state.batch_size` rows of `state.capacity` slots."""

    def observe(self, state: DecodeState, committed: Committed) -> None:
        """Tokens entered the verifier's cache (prompt or one step); update own state, drop rejected speculation.
        `state.lengths` is already advanced; `committed.start` holds the old lengths."""

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        raise NotImplementedError

    def see_extra(self, logits: torch.Tensor) -> None:
        """The verifier's logits (B, E, V) at this step's extra nodes (only drafters with num_extra_nodes > 0)."""

    def describe(self) -> dict:
        """Options worth reporting (goes into stats / results.json)."""
        d = {"name": self.name, "num_draft_tokens": self.num_draft_tokens, "max_depth": self.max_depth}
        if self.typical is not None:
            d["acceptance"] = {"typical": list(self.typical), "lossless": False}
        return d


class NoDrafter(Drafter):
    """Autoregressive decoding in the same runtime: the tree is the root alone, one token per verifier call."""

    name = "autoregressive"

    def __init__(self):
        self._tree = Tree.chain(0)
        self._empty: torch.Tensor | None = None

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        self._tree = self._tree.to(state.device)
        self._empty = torch.zeros(state.batch_size, 0, dtype=torch.long, device=state.device)

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        return Draft(self._empty, self._tree)
