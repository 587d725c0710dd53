"""DFlash2 in the engine (models/dflash2/): DFlash's block forward (dflash.py: the context cache, the block
[root, MASK x K], its convolutions over the K + 1 positions), then the candidate selector instead of one argmax per
position, as vLLM's DFlash2 speculator drafts.

At each mask position j = 1..K the lm_head's top `selector_top_k` tokens are the candidates; the selector scores
every candidate after every candidate of position j - 1 (after the root at j = 1), and the draft walks the block left
to right: T = 0, the best-scored candidate after the one just chosen; T > 0, a draw from the scores after the one
just chosen (as logits over the candidates, -inf elsewhere, with temperature and top-p applied), which is the draft
distribution the verifier's rejection sampling reads for that position (it depends on the draws before it, which
the chain rule allows: the verifier checks position j only when positions before it were accepted as drawn)."""

from __future__ import annotations

import torch

from draftheads.eval.drafters.dflash import DFlashBlockDrafter
from draftheads.eval.engine.acceptance import exponential_noise, probs_from_logits
from draftheads.eval.engine.protocol import DecodeState, Draft, Sampling
from draftheads.models.dflash2 import walk


class DFlash2BlockDrafter(DFlashBlockDrafter):
    """A DFlash2 drafter (`draftheads.models.dflash2.DFlash2Drafter`) driven by the decode loop; see the module
    docstring."""

    name = "dflash"
    variant = "dflash2"

    def describe(self) -> dict:
        return {**super().describe(), "variant": "dflash2", "selector_top_k": self.cfg.selector_top_k}

    def propose(self, state: DecodeState, sampling: Sampling) -> Draft:
        hidden = self.block_hidden(state)[:, 1:]  # (B, K, H), final-normed
        candidates, _, scores = self.model.selector_logits(hidden, state.roots())  # (B,K,C), (B,K,C,C)
        if sampling.greedy:
            tokens, _ = walk(scores, candidates)
            return Draft(tokens, self.tree)
        V = self.cfg.vocab_size
        probs = []

        def draw(j: int, row: torch.Tensor) -> torch.Tensor:  # row (B, C): the scores after the previous draw
            logits = row.new_full((row.shape[0], V), float("-inf")).scatter(-1, candidates[:, j], row)
            p = probs_from_logits(logits, sampling.temperature, sampling.top_p)  # (B, V)
            token = (p / exponential_noise(p.shape, sampling.generator, state.device)).argmax(-1)  # (B,)
            probs.append(p)
            return (candidates[:, j] == token[:, None]).long().argmax(-1)

        tokens, _ = walk(scores, candidates, pick=draw)
        return Draft(tokens, self.tree, torch.stack(probs, 1))
