"""DFlash in the engine: block-diffusion drafting, one drafter forward per step (models/dflash/).

The drafter's context. Its layers' keys and values come from two places: the *context*, the verifier's features at
committed tokens (the outputs of `target_layer_ids`, i.e. the inputs of layers t + 1, concatenated, through fc and
hidden_norm, then each layer's k_proj / v_proj, k_norm and RoPE at the token's position), and the *block*. The
context keys/values live in the drafter's own static cache at slot = position: `observe` writes the committed
tokens' entries (the prompt, then per step the root and the accepted drafts), so the cache grows by what was
accepted. Nothing is rolled back by hand: the block's entries (written after the committed slots while drafting)
and a ragged batch's padding sit at positions >= the new length, where the next observe writes the next committed
tokens, and attention never reads past a row's length outside its block. The cache after a step therefore equals
a fresh context computation over the committed tokens, which is what the reference (`dflash_generate`) and vLLM
keep (they crop their caches to the committed length).

A step (`propose`). The block is [root, MASK x K] at positions L .. L+K (L = the row's committed length, the root
the pending token the verifier chose last), embedded with the verifier's embedding (the mask token is the verifier's
embedding row `mask_token_id`). Through every layer its queries attend to the row's context slots 0..L-1 and to the
whole block (full-attention layers: bidirectional; sliding layers: causal, within the window); the block's
keys/values go into slots L..L+K. The final norm and the verifier's lm_head at the K mask positions give draft j
(position L+j) for j = 1..K. T = 0: argmax. T > 0: each draft drawn from its own distribution (temperature and
top-p applied); none reads another's draw, so that distribution is exactly the one the lossless chain rule needs.
The verifier checks them as a chain, plus the bonus token.

DSpark (a drafter with a Markov head, `dflash.markov_rank`): the same forward, then the drafts are taken left to
right, draft j's logits biased by the Markov head from draft j-1 (the root for j = 1), as vLLM's DSparkSpeculator
samples them; at T > 0 each draw's distribution is the biased one given the drafts before it, which is what the
chain rule verifies against.

K. `block_size` - 1 by default, the block the drafter was trained on; `num_draft_tokens=K` drafts another K (as
vLLM does with num_speculative_tokens = K: a block of K + 1). The first token: with the decoder's
first_token="prefill" (vLLM's convention, and the reference's) the whole prompt is context and the block starts
after it; with "draft" the prompt's last token is the first root.
"""

from __future__ import annotations

import os

import torch

from draftheads.eval.engine.acceptance import exponential_noise, probs_from_logits
from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.runtime import bucket
from draftheads.eval.engine.tree import Tree


class DFlashBlockDrafter(Drafter):
    """A DFlash drafter (`draftheads.models.dflash.DFlashDrafter`) driven by the decode loop; see the module
    docstring."""

    name = "dflash"
    variant = "dflash"
    capturable = True  # every step op is a device op on fixed buffers (eval/engine/cuda_loop.py may graph it)

    def __init__(self, model, num_draft_tokens: int | None = None, window_bucket: int = 64):
        cfg = model.cfg
        if cfg.variant != self.variant:  # a DFlash2 drafter drafts through its selector (dflash2.py)
            raise ValueError(f"method 'dflash': a dflash.variant={cfg.variant} drafter drafts through "
                             f"{'DFlash2BlockDrafter' if cfg.variant == 'dflash2' else 'its own engine class'}, "
                             f"not {type(self).__name__}")
        self.model = model.eval().requires_grad_(False)
        self.cfg = cfg
        K = cfg.block_size - 1 if num_draft_tokens is None else int(num_draft_tokens)
        if K < 1:
            raise ValueError(f"method 'dflash': num_draft_tokens={num_draft_tokens}; expected >= 1")
        self.num_draft_tokens = self.max_depth = K
        self.layer_ids = tuple(i + 1 for i in cfg.target_layer_ids)  # outputs of t = inputs of t + 1
        self.mask_token_id = int(cfg.mask_token_id)
        self.tree = Tree.chain(K)
        self.window_bucket = window_bucket
        self.sliding = [cfg.layer_type(i) == "sliding_attention" for i in range(cfg.num_hidden_layers)]
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.num_draft_tokens + 1,
                "trained_block_size": self.cfg.block_size, "num_layers": self.cfg.num_hidden_layers,
                "target_layer_ids": list(self.cfg.target_layer_ids)}

    # ---- buffers -----------------------------------------------------------------------------------------------------
    def start(self, state: DecodeState, sampling: Sampling) -> None:
        cfg, m = self.cfg, self.model
        B, dev = state.batch_size, state.device
        capacity = state.capacity + self.num_draft_tokens + 1  # the block may sit past the verifier's last slot
        dtype = m.dtype
        if self.cache_k is None or self.cache_k.shape[1] != B or self.cache_k.shape[3] < capacity \
                or self.cache_k.device != dev or self.cache_k.dtype != dtype:
            shape = (cfg.num_hidden_layers, B, cfg.num_key_value_heads, capacity, cfg.head_dim)
            self.cache_k = torch.zeros(shape, dtype=dtype, device=dev)
            self.cache_v = torch.zeros(shape, dtype=dtype, device=dev)
            self.rows = torch.arange(B, device=dev)[:, None]  # captured forwards read it: public, so a move is seen
        self.capacity = self.cache_k.shape[3]
        self.tree = self.tree.to(dev)

    def _window(self, n: int) -> int:
        return min(self.capacity, bucket(n, self.window_bucket))

    # ---- protocol ----------------------------------------------------------------------------------------------------
    def observe(self, state: DecodeState, committed: Committed) -> None:
        """Write the committed tokens' context keys/values at their positions (slot = position)."""
        B, M = committed.tokens.shape
        if M == 0:
            return
        pos = committed.start[:, None] + torch.arange(M, device=state.device)  # (B, M)
        features = torch.cat([committed.layers[i] for i in self.layer_ids], -1)  # (B, M, n*H)
        for l, (k, v) in enumerate(self.model.context_kv(features, pos)):  # k/v (B, nkv, M, d)
            self.cache_k[l, self.rows, :, pos] = k.transpose(1, 2)  # (B, M, nkv, d)
            self.cache_v[l, self.rows, :, pos] = v.transpose(1, 2)

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        hidden = self.block_hidden(state)  # (B, K+1, H), final-normed
        if self.cfg.dspark:  # left to right through the Markov head
            return self._markov_draft(hidden[:, 1:], state.roots(), sampling, state.device)
        logits = self.model.logits(hidden[:, 1:])  # (B, K, V): draft j from mask position j
        if sampling.greedy:
            return Draft(logits.argmax(-1), self.tree)
        probs = probs_from_logits(logits, sampling.temperature, sampling.top_p)  # (B, K, V)
        tokens = (probs / exponential_noise(probs.shape, sampling.generator, state.device)).argmax(-1)
        return Draft(tokens, self.tree, probs)

    def block_hidden(self, state: DecodeState) -> torch.Tensor:
        """The drafter over this step's block [root, MASK x K]: its final-normed hidden states (B, K+1, H)."""
        m, K = self.model, self.num_draft_tokens
        B, dev = state.batch_size, state.device
        L = state.lengths  # (B,)
        pos = L[:, None] + torch.arange(K + 1, device=dev)  # (B, K+1) the block's positions = slots
        ids = torch.full((B, K + 1), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = state.roots()
        W = self._window(max(state.lengths_host) + K + 1)
        j = torch.arange(W, device=dev)[None, None, :]  # (1, 1, W) slot index = key position
        q = pos[:, :, None]  # (B, K+1, 1) query position
        in_block = (j >= L[:, None, None]) & (j <= (L + K)[:, None, None])
        full = (j < L[:, None, None]) | in_block  # the row's context and its whole block
        masks = {False: full}
        if any(self.sliding):
            masks[True] = full & (j <= q) & (q - j < int(self.cfg.sliding_window))

        def attend(l, qh, k, v):  # qh (B, nh, K+1, d), k/v (B, nkv, K+1, d): the block's own, RoPE applied
            self.cache_k[l, self.rows, :, pos] = k.transpose(1, 2)
            self.cache_v[l, self.rows, :, pos] = v.transpose(1, 2)
            return m.layers[l].self_attn.attend(qh, self.cache_k[l, :, :, :W], self.cache_v[l, :, :, :W],
                                                masks[self.sliding[l]][:, None])

        return m.block(m.embed(ids), pos, attend)

    def _markov_draft(self, hidden: torch.Tensor, roots: torch.Tensor, sampling: Sampling, dev) -> Draft:
        """DSpark's drafts: draft j from its Markov-biased logits given draft j-1 (`DFlashDrafter.draft_block`)."""
        if sampling.greedy:
            tokens, _ = self.model.draft_block(hidden, roots, lambda logits, k: logits.argmax(-1))
            return Draft(tokens, self.tree)
        probs = []

        def draw(logits, k):  # (B, V) -> (B,): a draw from the biased distribution at this position
            p = probs_from_logits(logits, sampling.temperature, sampling.top_p)
            probs.append(p)
            return (p / exponential_noise(p.shape, sampling.generator, dev)).argmax(-1)

        tokens, _ = self.model.draft_block(hidden, roots, draw)
        return Draft(tokens, self.tree, torch.stack(probs, 1))


def make_dflash(verifier, draft, num_draft_tokens: int | None = None) -> DFlashBlockDrafter:
    """The `dflash` method: `draft` is an exported folder (`draftheads.models.export.export_dflash`) or a
    DFlashDrafter module. Drafts block_size - 1 tokens a step unless num_draft_tokens says otherwise."""
    return DFlashBlockDrafter(dflash_model(verifier, draft), num_draft_tokens)


def dflash_model(verifier, draft):
    """The drafter module of the `dflash` method's `draft` (a folder, read for `verifier`, or a module)."""
    from draftheads.models.dflash import DFlashDrafter
    from draftheads.models.export import load_dflash

    if draft is None:
        raise ValueError("method 'dflash' needs draft=<a DFlash export folder (export_dflash) or DFlashDrafter>")
    if isinstance(draft, (str, os.PathLike)):
        model = load_dflash(draft, verifier)
    elif isinstance(draft, DFlashDrafter):
        cfg = draft.cfg
        if (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) != \
                (verifier.hidden_size, verifier.vocab_size, verifier.num_layers):
            raise ValueError(f"method 'dflash': the drafter is for hidden_size={cfg.hidden_size}, vocab_size="
                             f"{cfg.vocab_size}, {cfg.num_target_layers} layers; the verifier has "
                             f"{verifier.hidden_size}, {verifier.vocab_size}, {verifier.num_layers}")
        model = draft.attach(verifier).to(verifier.device)
    else:
        raise TypeError(f"method 'dflash': draft must be an export folder or a DFlashDrafter, got "
                        f"{type(draft).__name__}")
    return model
