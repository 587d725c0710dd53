"""DFlash2: the DFlash drafter (models/dflash/) with a grouped dynamic convolution around each layer's attention and
MLP (causal within the block: conv.py) and a candidate selector that re-ranks the lm_head's top-k tokens at each
block position by the token drafted before it (selector.py), as vLLM 0.32 serves it (qwen3_dflash2.py,
`DFlash2DraftModel`) and speculators / SpecForge train it.

Chosen by `dflash.variant: dflash2` in a DFlash run config (train/dflash.py). This package's `build_drafter`
builds either variant's drafter (models/dflash/ knows only DFlash), as `load_dflash` reads either; the engine drafts
it through the `dflash` method (eval/drafters/dflash2.py); the export is vLLM's layout
(models/layouts/dflash2_vllm.py).
"""

from draftheads.models.dflash2.conv import GroupedConv, grouped_conv  # noqa: F401
from draftheads.models.dflash2.drafter import DFlash2Drafter, DFlash2Layer, build_drafter, drafter_class  # noqa: F401
from draftheads.models.dflash2.selector import (  # noqa: F401
    CandidateSelector,
    candidate_logits,
    selector_loss,
    training_candidates,
    walk,
)
