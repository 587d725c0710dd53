"""MTP-head fine-tuning: a verifier's own shipped multi-token-prediction layer, trained further as its drafter.

Some verifiers ship one more decoder layer that predicts a second token ahead (DeepSeek-V3, GLM-4.5: their MTP
layer, stored in the checkpoint beside the model's own layers; the layouts and what vLLM serves from them are in
models/layouts/mtp_checkpoint.py). vLLM drafts with it (`method: glm4_moe_mtp`; GLM-4.5 is the family offered),
reusing the one
layer for every draft. This package builds that layer from the checkpoint's weights, as the verifier's own decoder
layer class, and trains it on the verifier's hidden states (`MtpDrafter`, drafter.py); train/mtp.py is the trainer
and models/layouts/mtp_checkpoint.py writes the fine-tuned layer back under the checkpoint's names.

The step (a draft), at position p: out_p = block(eh_proj([enorm(E x_{p+1}); hnorm(h_p)])) with the verifier's
final post-norm hidden state h_p (zero embedding at p = 0, as vLLM feeds it); the draft of x_{p+2} is the argmax of
head(shared_head.norm(out_p)). The next draft reads (E d, out_p) one position later. Trained: every weight of the
layer (enorm, hnorm, eh_proj, the decoder block, shared_head.norm); frozen: the embedding and the LM head, which
it shares with the verifier. The loss unrolls `mtp.steps` drafts, each step's input hidden state the previous
step's output (cross-entropy, step k weighted step_decay^(k-1), normalised).
"""

from draftheads.models.mtp.config import MtpConfig, MtpError  # noqa: F401
from draftheads.models.mtp.drafter import MtpDrafter, MtpOutput, build_mtp_drafter  # noqa: F401
