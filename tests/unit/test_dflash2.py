"""DFlash2 (models/dflash2/): the grouped convolution, the selector's scores, walk and loss against slow references
(tests/dflash2_reference.py), the convolutions' identity start, training that means inference (a block trained
among many equals it drafted alone), the engine drafting it, its config rules and its export."""

import copy
import json

import pytest
import torch

from draftheads.eval import build_decoder
from draftheads.models.dflash import DFlashConfig, DFlashDrafter, DFlashError, position_weights
from draftheads.models.dflash import build_drafter as build_dflash
from draftheads.models.dflash2 import (DFlash2Drafter, build_drafter, candidate_logits, grouped_conv,
                                       selector_loss, walk)
from draftheads.models.export import check_dflash_engine, export_dflash, load_dflash
from draftheads.models.verifier import Verifier
from tests.dflash2_reference import slow_grouped_conv, slow_selector_loss, slow_walk
from tests.utils import tiny_model

N = 4


@pytest.fixture(scope="module")
def verifier():
    return Verifier(tiny_model("qwen3", num_layers=6, vocab_size=64))


def make(verifier, seed=0, **overrides):
    """A DFlash2 drafter with every weight random (convolutions and selector included)."""
    torch.manual_seed(seed)
    values = dict(num_hidden_layers=2, block_size=N, variant="dflash2", conv_kernel_size=2, conv_group_size=16,
                  selector_rank=8, selector_top_k=5)
    drafter = build_drafter(verifier, DFlashConfig(**{**values, **overrides})).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter


def test_grouped_conv_matches_slow_reference_and_stays_in_its_block():
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(1, 8, 6, generator=g), torch.randn(1, 8, 3, 2, generator=g)
    base = torch.randn(3, 6, generator=g)
    out = grouped_conv(x, delta, base, block_len=4)
    torch.testing.assert_close(out[0].double(), slow_grouped_conv(x[0], delta[0], base, 4), atol=1e-6, rtol=1e-6)
    moved = x.clone()
    moved[0, 3] += 5.0  # the last position of block 0: block 1 does not see it
    assert torch.equal(grouped_conv(moved, delta, base, 4)[0, 4:], out[0, 4:])


def test_fresh_convolutions_are_the_identity_so_dflash2_starts_as_dflash(verifier):
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=2, block_size=N, num_anchors=3)
    two = build_drafter(verifier, DFlashConfig(variant="dflash2", conv_group_size=16, **cfg))
    one = build_dflash(verifier, DFlashConfig(**cfg))
    one.load_state_dict({k: v for k, v in two.state_dict().items() if k in one.state_dict()})
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    ctx = torch.cat(verifier.features(ids, layer_ids=one.feature_layers).layers, -1)
    anchors, valid = torch.tensor([[0, 4, 7]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(two.anchored_hidden(ids, ctx, anchors, valid),
                                   one.anchored_hidden(ids, ctx, anchors, valid))


def test_anchored_blocks_equal_blocks_drafted_alone(verifier):
    """Blocks side by side in training (their convolutions per block) = each block drafted alone (z-lab's
    forward, the block being the whole input), with random convolution weights."""
    drafter = make(verifier)
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(3))
    ctx = torch.cat(verifier.features(ids, layer_ids=drafter.feature_layers).layers, -1)
    anchors, valid = torch.tensor([[1, 5, 9]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        trained = drafter.anchored_hidden(ids, ctx, anchors, valid)  # (1, 3, N, H)
        for j, a in enumerate(anchors[0].tolist()):
            block = torch.full((1, N), drafter.mask_token_id)
            block[0, 0] = ids[0, a]
            alone = drafter(torch.arange(a + N)[None], noise_embedding=drafter.embed(block), target_hidden=ctx[:, :a])
            torch.testing.assert_close(trained[0, j], alone[0], atol=1e-5, rtol=1e-5)


def test_selector_scores_and_walk_match_slow_reference(verifier):
    drafter = make(verifier)
    hidden = torch.randn(2, 3, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([7, 11])
    with torch.no_grad():
        candidates, unary, scores = drafter.selector_logits(hidden, anchors)
        tokens, _ = walk(scores, candidates)
        logits = drafter.logits(hidden)
    for b in range(2):
        assert tokens[b].tolist() == slow_walk(drafter.candidate_selector, logits[b], hidden[b], int(anchors[b]), 5)


def test_selector_loss_matches_slow_reference_and_its_gradient_autograd(verifier):
    drafter = make(verifier)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, 3, drafter.cfg.hidden_size, generator=g, requires_grad=True)
    lm = verifier.lm_head.weight.detach()
    targets = torch.randint(0, 64, (2, 3, 3), generator=g)
    targets[0, 0, 0] = (lm @ hidden[0, 0, 0].detach()).argmax()  # one target inside the top-k, most outside
    predecessors = torch.randint(0, 64, (2, 3, 3), generator=g)
    trained = torch.rand(2, 3, 3, generator=g) > 0.3
    weights = position_weights(N, 2.5)
    loss, _, _ = selector_loss(sel, hidden, lm, targets, predecessors, trained, weights)
    want = slow_selector_loss(sel, hidden.detach(), lm, targets, predecessors, trained, weights)
    assert abs(float(loss.detach()) - want) < 1e-4
    x = hidden.detach().reshape(-1, hidden.shape[-1]).requires_grad_()
    index = torch.randint(0, 64, (18, 5), generator=g)
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(18, 5, generator=g)
    (candidate_logits(x, lm, index) * grad).sum().backward()
    (torch.einsum("mh,mch->mc", x2, lm[index]) * grad).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_training_loss_trains_the_convolutions_and_the_selector(verifier):
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=N, variant="dflash2",
                                                   conv_group_size=16, selector_rank=8, selector_top_k=4,
                                                   num_anchors=4)).train()
    ids = torch.randint(0, 64, (2, 16))
    out = drafter.training_loss(ids, verifier.features(ids, layer_ids=drafter.feature_layers), torch.ones_like(ids))
    out.loss.backward()
    assert float(out.parts["selector_loss"]) > 0 and drafter._hidden is None
    for name, p in drafter.named_parameters():
        if "conv" in name or "candidate_selector" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_engine_drafts_through_the_selector_losslessly(verifier):
    drafter = make(verifier)
    prompt = [[5, 9, 3, 17, 2]]
    plain = build_decoder(verifier, method="autoregressive").generate(prompt, 16, eos_token_id=None)
    dec = build_decoder(verifier, draft=drafter, method="dflash")
    assert type(dec.drafter).__name__ == "DFlash2BlockDrafter"
    assert dec.generate(prompt, 16, eos_token_id=None).output_ids == plain.output_ids
    sampled = dec.generate(prompt, 16, eos_token_id=None, temperature=1.0, seed=0)
    assert len(sampled.output_ids[0]) == 16


def test_config_rules_are_one_line(verifier):
    for values, message in [({"conv_group_size": 48}, "dflash.conv_group_size=48: expected a divisor of hidden_size"),
                            ({"conv_kernel_size": 5}, "dflash.conv_kernel_size=5: expected at most block_size"),
                            ({"draft_vocab_size": 32}, "dflash.draft_vocab_size=32 with variant dflash2"),
                            ({"selector_top_k": 65}, "dflash.selector_top_k=65: expected at most the vocabulary"),
                            ({"selector_rank": 0}, "dflash.selector_rank=0: expected a positive integer")]:
        with pytest.raises(DFlashError, match=message.replace("(", r"\(")):
            DFlashConfig(block_size=N, variant="dflash2", **values).resolve(verifier.config)
    with pytest.raises(DFlashError, match="dflash.variant='dflash3': expected one of dflash, dflash2"):
        DFlashConfig(variant="dflash3")
    cfg = DFlashConfig(block_size=N, variant="dflash2", conv_group_size=16).resolve(verifier.config)
    with pytest.raises(DFlashError, match="dflash.variant=dflash2: DFlashDrafter builds variant dflash"):
        DFlashDrafter(cfg)
    with pytest.raises(DFlashError, match="dflash.variant=dflash2 with engine sglang"):
        check_dflash_engine(cfg, "sglang")


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_export_is_vllms_dflash2_layout_and_reads_back(verifier, tmp_path, engine):
    drafter = make(verifier)
    folder = export_dflash(drafter, tmp_path / "d2", verifier, engine=engine)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    fields = config["dflash_config"] if engine == "vllm" else config
    if engine == "speculators":
        assert config["speculators_model_type"] == config["speculators_config"]["algorithm"] == "dflash2"
    assert {k: fields[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k")} == {"conv_kernel_size": 2,
                                                                           "conv_group_size": 16,
                                                                           "selector_rank": 8, "selector_top_k": 5}
    back = load_dflash(folder, verifier)
    assert isinstance(back, DFlash2Drafter)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
    names = set(back.state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    edited = copy.deepcopy(config)  # an engine field edited after training is refused, naming it
    (edited["dflash_config"] if engine == "vllm" else edited)["selector_top_k"] = 4
    (folder / "config.json").write_text(json.dumps(edited))
    with pytest.raises(Exception, match="dflash_config" if engine == "vllm" else "selector_top_k"):
        load_dflash(folder, verifier)
