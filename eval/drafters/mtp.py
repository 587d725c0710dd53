"""A verifier's own MTP layer as the drafter (models/mtp/): a chain of K drafts, as vLLM's `*_mtp` methods draft.

    dec = build_decoder("runs/mtp/drafter", method="mtp", num_draft_tokens=3)     # the layer from the verifier's folder
    dec = build_decoder(verifier, method="mtp", draft=mtp_drafter_or_checkpoint_folder)

Per step, for each row with L committed tokens: the layer runs over the pairs (x_{p+1}, h_p), p < L (the committed
tokens, then the pending root; h the verifier's final hidden states, kept from `observe`), and its output at
position L-1 drafts d_1; draft k+1 appends the pair (d_k, the previous output) one position later and runs again.
The layer is recomputed over the whole row each time (no KV cache of its own): exact, and what vLLM's cached
drafting computes, but quadratic in the row's length, so this drafter is for checking acceptance (interop, the
end-of-run check), not for timing.
"""

from __future__ import annotations

import os

import torch

from draftheads.eval.engine.protocol import Committed, DecodeState, Draft, Drafter, Sampling
from draftheads.eval.engine.tree import Tree


class MtpEngineDrafter(Drafter):
    """Chain drafting with an `MtpDrafter` (greedy picks: deterministic drafts, lossless at any temperature)."""

    name = "mtp"
    wants_final = True

    def __init__(self, mtp, num_draft_tokens: int = 3):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: expected >= 1")
        self.mtp = mtp.eval()
        self.num_draft_tokens = self.max_depth = num_draft_tokens
        self.tree = Tree.chain(num_draft_tokens)
        self.hidden = None

    def describe(self) -> dict:
        return {**super().describe(), "mtp_layer": self.mtp.layer_index, "family": self.mtp.model_type}

    def start(self, state: DecodeState, sampling: Sampling) -> None:
        self.tree = self.tree.to(state.device)
        H = self.mtp.eh_proj.in_features // 2
        self.hidden = torch.zeros(state.batch_size, state.capacity, H, device=state.device)  # (B, capacity, H)

    def observe(self, state: DecodeState, committed: Committed) -> None:
        """Keep the verifier's final hidden state at every committed position (slot = position)."""
        for b, (start, count) in enumerate(zip(committed.start.tolist(), committed.count.tolist())):
            self.hidden[b, start:start + count] = committed.final[b, :count].float()

    @torch.no_grad()
    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        B, K = state.batch_size, self.num_draft_tokens
        drafts = state.roots()[:, None].repeat(1, K)  # rows with nothing committed yet draft the root (any guess)
        for b, L in enumerate(state.lengths_host):
            if L == 0 or not state.active_host[b]:
                continue
            tokens = state.tokens[b, 1:L + 1]  # (L,) x_1 .. x_L (x_L: the pending root)
            hidden = self.hidden[b, :L]  # (L, H) h_0 .. h_{L-1}
            for k in range(K):
                pos = torch.arange(tokens.shape[0], device=state.device)[None]
                out = self.mtp(tokens[None], hidden[None], pos, self.mtp.attention_mask(pos))[0, -1]  # (H,)
                d = self.mtp.logits(out).argmax(-1)
                drafts[b, k] = d
                tokens, hidden = torch.cat([tokens, d[None]]), torch.cat([hidden, out[None].float()])
        return Draft(drafts, self.tree)


def make_mtp(verifier, draft, num_draft_tokens: int = 3) -> MtpEngineDrafter:
    """`draft`: an in-memory MtpDrafter, a checkpoint folder holding the MTP layer, or None (the verifier's own)."""
    from draftheads.models.layouts.mtp_checkpoint import read_mtp_layer
    from draftheads.models.mtp import MtpDrafter, build_mtp_drafter

    if isinstance(draft, MtpDrafter):
        return MtpEngineDrafter(draft, num_draft_tokens)
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise TypeError(f"method 'mtp': draft must be an MtpDrafter, a checkpoint folder or None, got "
                        f"{type(draft).__name__}")
    weights = read_mtp_layer(draft) if draft is not None else None
    return MtpEngineDrafter(build_mtp_drafter(verifier, weights), num_draft_tokens)
