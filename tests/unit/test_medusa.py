"""Medusa heads, losses, metrics and the static tree, against slow references."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from draftheads.models.medusa import MedusaConfig, MedusaHeads, build_medusa_tree, check_tree, expected_accepted_length
from draftheads.models.verifier import Verifier
from tests.medusa_reference import head_accuracy, head_rank_hits, medusa_loss, topk_from_hits
from tests.utils import FAMILIES


def _batch(B=2, T=11, V=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, :3] = 0  # a "prompt": never a target
    return ids, mask, g


# ---- heads -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_new_heads_are_the_verifiers_head(tiny_verifier_dirs, family):
    """Zero-initialised ResBlocks + a copied lm_head: every new head's logits equal lm_head(h)."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs[family])
    heads = MedusaHeads.from_verifier(verifier, num_heads=3, num_layers=2)
    ids = torch.randint(0, verifier.vocab_size, (2, 9))
    feats = verifier.features(ids, return_logits=True)
    with torch.no_grad():
        logits = heads(feats.final)
    assert logits.shape == (3, 2, 9, verifier.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[k], feats.logits, rtol=0, atol=0)
    # the engine's call: one hidden state per sequence
    assert heads(feats.final[:, -1]).shape == (3, 2, verifier.vocab_size)


def test_heads_are_distinct_modules_with_vllm_names(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    heads = MedusaHeads.from_verifier(verifier, num_heads=4, num_layers=2, bias=True)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 4 * (2 * 2 + 1)
    assert heads.lm_heads[0].weight.data_ptr() != verifier.lm_head.weight.data_ptr()
    assert set(heads.state_dict()) == {
        *(f"blocks.{h}.layers.{l}.{p}" for h in range(4) for l in range(2) for p in ("weight", "bias")),
        *(f"lm_heads.{h}.weight" for h in range(4)),
    }
    no_bias = MedusaHeads.from_verifier(verifier, num_heads=2, num_layers=1, bias=False)
    assert not any(k.endswith(".bias") for k in no_bias.state_dict())


def test_shared_head_is_the_verifiers_own_tensor_and_only_the_blocks_train(llama_dir):
    """shared_lm_head: no lm_heads, every head ends in the verifier's lm_head itself (no copy, not a parameter), and
    the loss's gradient reaches the ResBlocks and nothing else."""
    from draftheads.models.medusa import medusa_head_losses

    verifier = Verifier.from_pretrained(llama_dir)
    heads = MedusaHeads.from_verifier(verifier, num_heads=3, num_layers=1, shared_lm_head=True)
    assert not hasattr(heads, "lm_heads") and heads.shared_head.data_ptr() == verifier.lm_head.weight.data_ptr()
    assert set(heads.state_dict()) == {f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias")}
    H, V = verifier.hidden_size, verifier.vocab_size
    assert sum(p.numel() for p in heads.parameters()) == 3 * (H * H + H)
    ids = torch.randint(0, V, (2, 9))
    feats = verifier.features(ids, return_logits=True)
    with torch.no_grad():
        for k in range(3):  # new heads: the verifier's logits
            torch.testing.assert_close(heads(feats.final)[k], feats.logits, rtol=0, atol=0)
        for p in heads.parameters():
            p.normal_(0, 0.02)
    out = medusa_head_losses(heads, feats.final, ids, torch.ones_like(ids))
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())
    assert verifier.lm_head.weight.grad is None
    own = MedusaHeads.from_verifier(verifier, num_heads=3, num_layers=1)  # the same blocks, own copies of the head
    own.load_state_dict({**heads.state_dict(), **{f"lm_heads.{k}.weight": verifier.lm_head.weight for k in range(3)}})
    with torch.no_grad():
        torch.testing.assert_close(heads(feats.final), own(feats.final), rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_layers >= 1"):
        MedusaHeads(H, V, num_layers=0, shared_lm_head=True)
    with pytest.raises(ValueError, match="holds no lm_head yet"):
        MedusaHeads(H, V, shared_lm_head=True)(feats.final)


def test_shared_bf16_head_trains_in_the_heads_dtype(llama_dir):
    """A bf16 verifier, fp32 heads, no autocast: the shared head's products run in fp32, as own heads' would (the
    same loss as own heads holding the head's values in fp32), not in the verifier's bf16."""
    from draftheads.models.medusa import medusa_head_losses

    verifier = Verifier.from_pretrained(llama_dir, dtype="bfloat16")
    heads = MedusaHeads.from_verifier(verifier, num_heads=2, num_layers=1, shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    own = MedusaHeads.from_verifier(verifier, num_heads=2, num_layers=1)
    own.load_state_dict({**heads.state_dict(), **{f"lm_heads.{k}.weight": verifier.lm_head.weight.float()
                                                  for k in range(2)}})
    ids = torch.randint(0, verifier.vocab_size, (2, 9))
    final = verifier.features(ids).final
    got = medusa_head_losses(heads, final, ids, torch.ones_like(ids))
    want = medusa_head_losses(own, final, ids, torch.ones_like(ids))
    assert heads.shared_head.dtype == torch.bfloat16 and got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)


def test_resblock_math():
    heads = MedusaHeads(8, 5, num_heads=2, num_layers=2)
    torch.manual_seed(0)
    for p in heads.parameters():
        p.data.normal_()
    x = torch.randn(3, 8)
    out = heads(x)
    for k in range(2):
        h = x
        for layer in heads.blocks[k].layers:
            h = h + F.silu(h @ layer.weight.T + layer.bias)
        torch.testing.assert_close(out[k], h @ heads.lm_heads[k].weight.T)


# ---- losses ----------------------------------------------------------------------------------------------------

def _slow_medusa_loss(head_logits, ids, mask, mode, verifier_logits, decay):
    K, B, T, V = head_logits.shape
    per_head = []
    for k in range(K):
        total, count = 0.0, 0
        for b in range(B):
            for t in range(T):
                target = t + k + 2
                if target >= T or not mask[b, target]:
                    continue
                log_q = F.log_softmax(head_logits[k, b, t].double(), -1)
                if mode == "labels":
                    total += -log_q[ids[b, target]].item()
                else:
                    p = F.softmax(verifier_logits[b, t + k + 1].double(), -1)
                    total += (p * (p.log() - log_q)).sum().item()
                count += 1
        per_head.append(total / count if count else 0.0)
    return sum(decay ** k * l for k, l in enumerate(per_head)), per_head


@pytest.mark.parametrize("mode", ["labels", "distill"])
def test_medusa_loss_matches_slow_reference(mode):
    ids, mask, g = _batch()
    K, V = 3, 17
    head_logits = torch.randn(K, *ids.shape, V, generator=g)
    verifier_logits = torch.randn(*ids.shape, V, generator=g)
    loss, per_head = medusa_loss(head_logits, ids, mask, mode, verifier_logits, decay=0.7)
    ref_loss, ref_per_head = _slow_medusa_loss(head_logits, ids, mask, mode, verifier_logits, 0.7)
    assert per_head.shape == (K,) and not per_head.requires_grad
    torch.testing.assert_close(per_head.double(), torch.tensor(ref_per_head, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)


def shifted_heads(source: torch.Tensor, K: int, offset_of_k) -> torch.Tensor:
    """(K, B, T, V) head logits: head k at t is source[:, t + offset_of_k(k)] (B, T, V), zero past the row's end."""
    B, T, V = source.shape
    logits = torch.zeros(K, B, T, V)
    for k in range(K):
        for t in range(T):
            s = t + offset_of_k(k)
            if 0 <= s < T:
                logits[k, :, t] = source[:, s]
    return logits


def test_labels_loss_offsets_only_the_right_one_is_zero():
    """Head k at t is scored against token t+k+2: logits that point at t+k+2 give zero loss, t+k+1 / t+k+3 do not."""
    ids, mask, _ = _batch(T=12, V=13)
    K, (B, T), V = 3, ids.shape, 13

    def pointing_at(offset_of_k):
        return shifted_heads(100.0 * F.one_hot(ids, V).float(), K, offset_of_k)

    right, _ = medusa_loss(pointing_at(lambda k: k + 2), ids, mask)
    assert right.item() < 1e-6
    for wrong in (lambda k: k + 1, lambda k: k + 3):
        loss, per_head = medusa_loss(pointing_at(wrong), ids, mask)
        assert (per_head > 1.0).all()


def test_distill_loss_offsets_only_the_right_one_is_zero():
    """Distill: head k at t matches the verifier's distribution at t+k+1 (its prediction of token t+k+2)."""
    ids, mask, g = _batch(T=12, V=13)
    K, (B, T), V = 3, ids.shape, 13
    verifier_logits = 3 * torch.randn(B, T, V, generator=g)

    def copying(offset_of_k):
        return shifted_heads(verifier_logits, K, offset_of_k)

    right, _ = medusa_loss(copying(lambda k: k + 1), ids, mask, "distill", verifier_logits)
    assert right.item() < 1e-6
    for wrong in (lambda k: k, lambda k: k + 2):
        _, per_head = medusa_loss(copying(wrong), ids, mask, "distill", verifier_logits)
        assert (per_head > 1e-2).all()


def test_loss_mask_is_read_at_the_target_and_segments_are_respected():
    ids, _, g = _batch(B=1, T=10, V=11)
    head_logits = torch.randn(2, 1, 10, 11, generator=g, requires_grad=True)
    mask = torch.zeros(1, 10, dtype=torch.long)
    mask[0, 6] = 1  # only token 6 is trained: head 0 learns it from t=4, head 1 from t=3
    loss, _ = medusa_loss(head_logits, ids, mask)
    loss.backward()
    touched = head_logits.grad.abs().sum(-1)[:, 0]  # (K, T)
    assert touched[0].nonzero().flatten().tolist() == [4]
    assert touched[1].nonzero().flatten().tolist() == [3]
    # a target in another packed document is not trained
    segments = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    _, per_head = medusa_loss(head_logits.detach(), ids, mask, segment_ids=segments)
    assert per_head.tolist() == [0.0, 0.0]


def test_loss_with_short_sequences_and_empty_masks_is_finite():
    ids = torch.tensor([[1, 2, 3]])
    head_logits = torch.randn(4, 1, 3, 5, requires_grad=True)
    loss, per_head = medusa_loss(head_logits, ids, torch.ones_like(ids))
    assert torch.isfinite(loss) and per_head[1:].eq(0).all()  # heads 1..3 have no target inside T=3
    loss, _ = medusa_loss(head_logits, ids, torch.zeros_like(ids))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="verifier_logits"):
        medusa_loss(head_logits, ids, torch.ones_like(ids), "distill")


# ---- metrics ---------------------------------------------------------------------------------------------------

def test_rank_hits_and_accuracy_match_slow_reference():
    ids, mask, g = _batch(B=3, T=13, V=7)
    K, R = 3, 4
    head_logits = torch.randn(K, *ids.shape, 7, generator=g)
    hits, counts = head_rank_hits(head_logits, ids, mask, max_rank=R)
    assert hits.shape == (K, R) and counts.shape == (K,)
    ref_hits, ref_counts = torch.zeros(K, R), torch.zeros(K)
    for k, b, t in itertools.product(range(K), range(3), range(13)):
        target = t + k + 2
        if target < 13 and mask[b, target]:
            ref_counts[k] += 1
            order = head_logits[k, b, t].argsort(descending=True).tolist()
            rank = order.index(ids[b, target].item())
            if rank < R:
                ref_hits[k, rank] += 1
    torch.testing.assert_close(hits, ref_hits)
    torch.testing.assert_close(counts, ref_counts)
    acc = head_accuracy(head_logits, ids, mask, ks=(1, 3))
    assert acc.shape == (K, 2)
    torch.testing.assert_close(acc[:, 0], ref_hits[:, 0] / ref_counts)
    torch.testing.assert_close(acc[:, 1], ref_hits[:, :3].sum(-1) / ref_counts)
    torch.testing.assert_close(topk_from_hits(hits, counts, (1, 3)), acc)


# ---- tree ------------------------------------------------------------------------------------------------------

def _brute_force_best(rows, budget):
    K, R = len(rows), len(rows[0])
    nodes = [p for d in range(1, K + 1) for p in itertools.product(range(R), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(nodes, min(budget, len(nodes))):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in subset):
            best = max(best, expected_accepted_length(subset, rows))
    return best


@pytest.mark.parametrize("shape,seed", [((2, 3), 0), ((3, 2), 1), ((2, 3), 2), ((3, 2), 3)])
def test_tree_is_optimal_against_brute_force(shape, seed):
    g = torch.Generator().manual_seed(seed)
    K, R = shape
    raw = torch.rand(K, R + 1, generator=g)
    rows = (raw / raw.sum(-1, keepdim=True))[:, :R].tolist()  # each head's ranks sum to < 1, not sorted
    for budget in range(1, 8):
        tree = build_medusa_tree(rows, budget)
        assert len(tree) == budget
        assert check_tree(tree, K) == tree
        assert tree == sorted(tree, key=lambda p: (len(p), p))
        assert expected_accepted_length(tree, rows) == pytest.approx(_brute_force_best(rows, budget), rel=1e-12)


def test_tree_shapes_and_limits():
    acc = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]])
    for budget in (16, 32, 64):
        tree = build_medusa_tree(acc, budget)
        assert len(tree) == budget and tree[0] == (0,)
        assert max(len(p) for p in tree) <= 4
    assert len(build_medusa_tree(acc[:2, :2], 64)) == 2 + 4  # the whole 2-deep, 2-wide tree
    # a perfect head 0 at rank 0: the chain comes first
    chain = build_medusa_tree([[1.0, 0.0], [1.0, 0.0]], 2)
    assert chain == [(0,), (0, 0)]
    with pytest.raises(ValueError, match="probabilities"):
        build_medusa_tree([[1.5]], 4)
    with pytest.raises(ValueError, match="prefix"):
        check_tree([(0,), (1, 0)], 4)
    with pytest.raises(ValueError, match="depth"):
        check_tree([(0,), (0, 0)], 1)


def test_expected_length_counts_one_node_per_depth():
    rows = [[0.5, 0.3], [0.5, 0.5]]
    tree = [(0,), (1,), (0, 0), (0, 1)]
    assert expected_accepted_length(tree, rows) == pytest.approx(0.5 + 0.3 + 0.25 + 0.25)
    assert math.isclose(expected_accepted_length([(0,)], rows), 0.5)


# ---- config ----------------------------------------------------------------------------------------------------

def test_config_checks_and_nests_in_a_run_config():
    from dataclasses import dataclass, field

    from draftheads.train.config import ConfigError, RunConfig, parse_config

    with pytest.raises(ValueError, match="medusa.decay"):
        MedusaConfig(decay=0)
    with pytest.raises(ValueError, match="medusa.num_heads"):
        MedusaConfig(num_heads=0)

    @dataclass
    class MedusaRun(RunConfig):
        medusa: MedusaConfig = field(default_factory=MedusaConfig)
        """Medusa heads."""

    cfg = parse_config(MedusaRun, ["--medusa.num_heads=3", "--medusa.loss=distill",
                                   "--medusa.lora_target_modules=[q_proj,v_proj]"])
    assert (cfg.medusa.num_heads, cfg.medusa.loss) == (3, "distill")
    assert cfg.medusa.lora_target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="loss"):
        parse_config(MedusaRun, ["--medusa.loss=mse"])
    with pytest.raises(ConfigError, match=r"medusa.shared_lm_head=true with medusa.num_layers=0: .*num_layers >= 1"):
        parse_config(MedusaRun, ["--medusa.shared_lm_head=true", "--medusa.num_layers=0"])
