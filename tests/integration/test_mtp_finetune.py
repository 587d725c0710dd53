"""Fine-tuning a shipped MTP layer raises its held-out acceptance (models/mtp/, the loss train/mtp.py trains with).

The verifier is a tiny GLM-4.5-shaped checkpoint (glm4_moe, an MoE layer, partial rotary) whose shipped MTP layer
is random, as a tiny model's is; the outputs of its own layers' attention and MLP are scaled down (x 0.01), so
its greedy next token is mostly a function of the current one (a table over the vocabulary that a few Adam steps
can learn from rows holding every token). The layer is fine-tuned on 16 rows of random permutations of the
vocabulary (the loss of `MtpDrafter.train_forward`, 2 unrolled drafts, targets the verifier's greedy tokens) and
measured on 4 random prompts by our engine drafting 3 tokens per step (`method mtp`) over the verifier's own
continuations, which it never saw: the acceptance length goes from the shipped layer's (nothing accepted) to
well above it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from draftheads.models.verifier import Verifier
    from tests.utils import save_tiny_mtp_checkpoint

    folder = save_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "glm")
    tensors = load_file(folder / "model.safetensors")
    for name in tensors:  # the verifier's own layers only (0, 1); the MTP layer (2) stays as shipped
        if name.startswith(("model.layers.0.", "model.layers.1.")) and name.endswith(("o_proj.weight",
                                                                                      "down_proj.weight")):
            tensors[name] = tensors[name] * 0.01
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    verifier = Verifier.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    train = torch.cat([torch.randperm(verifier.vocab_size, generator=gen) for _ in range(2)]).view(16, 32)
    feats = verifier.features(train, return_logits=True)
    heldout = torch.randint(0, verifier.vocab_size, (4, 6), generator=gen).tolist()
    return verifier, train, feats.final, feats.logits.argmax(-1), heldout


def heldout_tau(verifier, drafter, prompts) -> float:
    from draftheads.eval import build_decoder

    dec = build_decoder(verifier, method="mtp", draft=drafter.eval(), num_draft_tokens=3, first_token="prefill")
    steps = [a for p in prompts for a in dec.generate([p], 16, eos_token_id=None).stats.accepted[0]]
    return 1 + sum(steps) / len(steps)


def test_fine_tuning_raises_the_shipped_mtp_layers_heldout_acceptance(setup):
    from draftheads.models.mtp import MtpConfig, build_mtp_drafter

    verifier, train, final, labels, heldout = setup
    torch.manual_seed(0)
    drafter = build_mtp_drafter(verifier, cfg=MtpConfig(steps=2))  # the shipped weights
    shipped = heldout_tau(verifier, drafter, heldout)
    drafter.train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        out = drafter.train_forward(train, final, torch.ones_like(train), labels)
        out.loss.backward()
        opt.step()
    assert out.counts.summary()["acc"][0] > 0.9  # it fits what it trained on
    tuned = heldout_tau(verifier, drafter, heldout)
    assert shipped < 1.05 and tuned > shipped + 0.8, (shipped, tuned)
