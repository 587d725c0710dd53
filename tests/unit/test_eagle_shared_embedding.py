"""EAGLE-3's unroll projects the embedding half of q, k and v once for all TTT steps (`shared_embedding`): step k at
stream position t reads the token step 0 reads at t + k. The loss and every gradient equal the step-by-step
projection's (fp32, within 1e-5 relative), with packed rows, kept positions, qkv biases and P-EAGLE; under
checkpointing the step-by-step path runs."""

import pytest
import torch

from draftheads.models import eagle
from draftheads.models.eagle import EagleConfig
from draftheads.models.verifier import Verifier
from tests.utils import tiny_model

T = 24
PACKED = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, T)  # two documents a row


@pytest.fixture(scope="module")
def verifiers():
    return {"llama": Verifier(tiny_model("llama", vocab_size=64)),  # GQA: 4 query heads, 2 kv heads
            "qwen2": Verifier(tiny_model("qwen2", vocab_size=64))}  # q, k, v biases


def loss_and_grads(drafter, verifier, position_ids, shared: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, T), generator=g)
    loss_mask = torch.ones(2, T, dtype=torch.long)
    loss_mask[:, :6] = 0  # a prompt: the later steps compute only the positions still read
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True, position_ids=position_ids)
    if not shared:
        drafter.shared_embedding = lambda input_ids, steps: None  # every step projects its own [embed; hidden]
    calls = []
    hook = drafter.layer.self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    try:
        drafter.zero_grad()
        loss = drafter.training_loss(ids, feats, loss_mask, position_ids).loss
        loss.backward()
    finally:
        hook.remove()
        drafter.__dict__.pop("shared_embedding", None)
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}, len(calls)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", ["plain", "packed", "checkpointed", "parallel"])
def test_shared_embedding_gives_the_same_loss_and_gradients(verifiers, family, variant):
    torch.manual_seed(0)
    cfg = EagleConfig(version=3, ttt_steps=4, draft_vocab_size=None, checkpoint_layers=variant == "checkpointed",
                      parallel=variant == "parallel", mask_token_id=1 if variant == "parallel" else None)
    drafter = eagle.build_drafter(verifiers[family], cfg).train()
    if variant == "parallel":
        drafter.cfg.parallel_keep = (1.0, 1.0)  # every chain kept: no random draw between the two runs
    positions = PACKED if variant == "packed" else None
    loss, grads, projected = loss_and_grads(drafter, verifiers[family], positions, shared=True)
    loss_ref, grads_ref, projected_ref = loss_and_grads(drafter, verifiers[family], positions, shared=False)
    # the step-by-step path calls q_proj once a step (twice with checkpointing, which keeps that path); the shared
    # one only for P-EAGLE's mask steps
    expected = {"parallel": projected_ref - projected_ref // 4, "checkpointed": projected_ref}.get(variant, 0)
    assert projected_ref >= 4 and projected == expected
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(drafter.parameters()))
    for name, grad in grads_ref.items():
        error = ((grads[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-30)).item()
        assert error <= 1e-5, f"{name}: {error:.2e} relative"


def test_checkpointed_steps_keep_no_copy_of_the_shared_projection(verifiers):
    """Under checkpointing a step keeps its inputs only: the unroll keeps no more than the step-by-step projection's
    (the shared projection and its weight would be kept beside them: checkpointing runs the plain path)."""
    torch.manual_seed(0)
    drafter = eagle.build_drafter(verifiers["llama"], EagleConfig(version=3, ttt_steps=4, draft_vocab_size=None,
                                                                  checkpoint_layers=True)).train()
    ids = torch.randint(3, 64, (2, T), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, T, verifiers["llama"].hidden_size, requires_grad=True)

    def kept() -> int:
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            drafter.ttt_unroll(ids, hidden)
        return sum(storages.values())

    shared = kept()
    drafter.shared_embedding = lambda input_ids, steps: None
    assert shared <= kept()
