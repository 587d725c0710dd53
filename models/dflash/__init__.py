"""DFlash (z-lab, 2026): block-diffusion drafting. A drafter of N Qwen3-shaped layers drafts a whole block of
tokens in one forward, conditioned on the outputs of chosen verifier layers.

Notation. The verifier has L_v layers; `target_layer_ids` (0-based) name the layers whose *outputs* the drafter
reads (HF hidden_states[i + 1]; the reference spreads one per drafter layer over 1 .. L_v-3). At each committed
position t their concatenation c_t (L*H) is fused once: ctx_t = hidden_norm(fc(c_t)) (H).

A step. The anchor x_p is the last committed token (the verifier's own, so its features are not known yet). The
block [x_p, MASK x (N-1)] (the verifier's embedding of each id, frozen) goes through the layers at positions
p .. p+N-1. In every layer the queries come from the block, the keys and values from [ctx_0 .. ctx_{p-1}; block]
(k_norm and RoPE on both; the context's depend only on ctx, so they are cached across steps); attention is
bidirectional (sliding-window layers: causal within the window). After the final norm, the verifier's lm_head at
block position k (1 <= k < N) proposes x_{p+k}: N-1 draft tokens, verified as a chain (+ the bonus token). With
`draft_vocab_size` set (not z-lab's), the drafter's own trained lm_head over a draft vocabulary does instead.

Training (models/dflash/blocks.py, losses.py): A random anchors per row at loss-masked positions, all blocks in one
forward over the row's whole context with the anchored block mask (a block sees the context strictly before its
anchor and itself, never another block; on a CPU scored block by block, not as one dense mask); position k learns
x_{a+k} (or the verifier's greedy token there) with cross-entropy (loss: kl, KL against the verifier's distribution)
weighted exp(-(k-1)/gamma), gamma = 7 for N = 16, 4 for N = 8 (1 + 3N/8 in general), or (loss: dpace) with
cross-entropy weighted by D-PACE's weights, from the drafter's own confidence in each position's target.

DSpark (`markov_rank`, models/dflash/dspark.py): a Markov head adds to block position k's logits a low-rank
transition bias from the token before it, so the block is drafted left to right, and a confidence head estimates
each draft's acceptance probability; both trained with the backbone (teacher-forced previous tokens; the confidence
head on the drafter/verifier overlap). Exported as vLLM's Qwen3DSparkModel.

Parameter names and `forward` follow z-lab's `DFlashDraftModel` (`dflash` 0.1.0), so weights move between the two
unchanged; the engine API is in drafter.py's docstring. Export / load: models/export.py.
"""

from draftheads.models.dflash.blocks import (  # noqa: F401
    anchored_block_mask,
    anchored_context_mask,
    anchored_context_ranges,
    block_inputs,
    block_targets,
    own_block_mask,
    sample_anchors,
)
from draftheads.models.dflash.config import (  # noqa: F401
    DFlashConfig,
    DFlashError,
    DFlashWarning,
    default_gamma,
    default_mask_token,
    default_target_layers,
)
from draftheads.models.dflash.drafter import (  # noqa: F401
    DFlashCache,
    DFlashDrafter,
    blind_positions_warning,
    build_drafter,
    zero_mask_warning,
)
from draftheads.models.dflash.dspark import ConfidenceHead, MarkovHead, markov_chain  # noqa: F401
from draftheads.models.dflash.losses import (confidence_loss, dflash_loss, dpace_loss, dpace_weights,  # noqa: F401
                                             position_weights, token_overlap)
from draftheads.models.dflash.train import DFlashTrainModule  # noqa: F401
