"""The chunked linear loss and the Medusa training losses built on it, against materialised-logits references."""

import pytest
import torch
import torch.nn.functional as F

from draftheads.models.linear_loss import linear_loss
from draftheads.models.medusa import MedusaHeads, medusa2_losses, medusa_head_losses
from tests.medusa_reference import head_rank_hits, medusa2_loss, medusa_loss


def _reference(x, weight, target, w, teacher, ce_weight, kl_weight):
    logits = x @ weight.T  # (N, V): what linear_loss never holds
    ce = F.cross_entropy(logits, target, reduction="none")
    kl = torch.zeros_like(ce)
    if kl_weight:
        log_p = teacher.double().log_softmax(-1)
        kl = torch.where(log_p.exp() > 0, log_p.exp() * (log_p - logits.log_softmax(-1)), 0.0).sum(-1)
    return (w * (ce_weight * ce + kl_weight * kl)).sum(), (w * ce).sum(), (w * kl).sum(), logits


@pytest.mark.parametrize("ce_weight,kl_weight", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3)])
@pytest.mark.parametrize("chunk_rows", [3, 64])
def test_linear_loss_matches_autograd(ce_weight, kl_weight, chunk_rows):
    g = torch.Generator().manual_seed(0)
    N, H, V = 23, 8, 31
    x = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (N,), generator=g)
    w = (torch.rand(N, generator=g) > 0.3).double()
    w = w / w.sum()
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64)
    teacher[:, 0] = float("-inf")  # a teacher that rules a token out entirely must not give nan

    out = linear_loss(x, weight, target, w, teacher, ce_weight, kl_weight, max_rank=4, chunk_rows=chunk_rows)
    (3.0 * out.loss).backward()  # any upstream scale reaches the stored gradients
    got = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    loss, ce, kl, logits = _reference(x, weight, target, w, teacher, ce_weight, kl_weight)
    (3.0 * loss).backward()

    torch.testing.assert_close(out.loss, loss)
    torch.testing.assert_close(out.ce, ce)
    torch.testing.assert_close(out.kl, kl)
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], weight.grad)
    ranks = logits.topk(4, -1).indices
    expected = ((ranks == target[:, None]) & (w > 0)[:, None]).sum(0).float()
    assert torch.equal(out.hits, expected)


def test_frozen_weight_no_grad_and_eval_path():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, generator=g)  # frozen (Medusa-2's lm_head)
    target = torch.randint(0, 9, (10,), generator=g)
    w = torch.full((10,), 0.1)
    out = linear_loss(x, weight, target, w)
    out.loss.backward()
    assert x.grad is not None and weight.grad is None
    with torch.no_grad():
        again = linear_loss(x, weight, target, w)
    assert torch.equal(again.loss, out.loss.detach()) and not again.loss.requires_grad


@pytest.mark.parametrize("max_rank", [0, 1, 3])
def test_argmax_is_every_rows_top_prediction(max_rank):
    """argmax=True hands back each row's top prediction, weighted or not, with and without gradients, chunked; the
    loss and hits stay what they were."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 4, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, requires_grad=True)
    target = torch.randint(0, 9, (11,), generator=g)
    w = torch.rand(11, generator=g) * (torch.arange(11) % 3 > 0)  # a third of the rows weigh nothing
    plain = linear_loss(x, weight, target, w, max_rank=max_rank, chunk_rows=4)
    out = linear_loss(x, weight, target, w, max_rank=max_rank, chunk_rows=4, argmax=True)
    expected = (x @ weight.T).argmax(-1)
    assert plain.argmax is None and torch.equal(out.argmax, expected)
    assert torch.equal(out.loss, plain.loss) and torch.equal(out.hits, plain.hits)
    out.loss.backward()
    assert x.grad is not None and weight.grad is not None
    with torch.no_grad():
        assert torch.equal(linear_loss(x, weight, target, w, max_rank=max_rank, argmax=True).argmax, expected)


def test_autocast_bf16_is_close_to_fp32():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (40,), generator=g)
    w = torch.full((40,), 1 / 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_loss(x, weight, target, w)
    out.loss.backward()
    assert x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    loss, *_ = _reference(x.detach(), weight.detach(), target, w, None, 1.0, 0.0)
    torch.testing.assert_close(out.loss, loss, rtol=0.03, atol=0.03)


def _close(a, b, **kw):
    """The references compute in fp32 even for fp64 inputs."""
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6, **kw)


def _heads_and_batch(K=3, B=2, T=13, H=8, V=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(H, V, num_heads=K, num_layers=1).double()
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, :3] = 0
    verifier_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    return heads, hidden, ids, mask, verifier_logits


@pytest.mark.parametrize("mode", ["labels", "distill"])
def test_medusa_head_losses_equal_medusa_loss(mode):
    """Same value, same gradients as the materialised reference; rank hits as head_rank_hits."""
    heads, hidden, ids, mask, verifier_logits = _heads_and_batch()
    got = medusa_head_losses(heads, hidden, ids, mask, mode, verifier_logits, decay=0.8, max_rank=5, chunk_rows=7)
    got.loss.backward()
    grads = {n: p.grad.clone() for n, p in heads.named_parameters()}
    heads.zero_grad()
    loss, per_head = medusa_loss(heads(hidden), ids, mask, mode, verifier_logits, decay=0.8)
    loss.backward()
    _close(got.loss, loss)
    _close(got.per_head, per_head)
    for n, p in heads.named_parameters():
        _close(grads[n], p.grad, msg=n)
    hits, counts = head_rank_hits(heads(hidden).detach(), ids, mask, max_rank=5)
    assert torch.equal(got.hits, hits) and torch.equal(got.counts, counts)


@pytest.mark.parametrize("mode", ["labels", "distill"])
def test_packed_documents_equal_the_reference_with_segments(mode):
    """position_ids restarting per document: no target in another document, as the reference's segment_ids."""
    from draftheads.data.documents import document_ids

    heads, hidden, ids, mask, verifier_logits = _heads_and_batch(seed=5)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0, 1], list(range(13))])
    got = medusa_head_losses(heads, hidden, ids, mask, mode, verifier_logits, decay=0.8, chunk_rows=7,
                             position_ids=positions)
    loss, per_head = medusa_loss(heads(hidden), ids, mask, mode, verifier_logits, decay=0.8,
                                 segment_ids=document_ids(positions))
    _close(got.loss, loss)
    _close(got.per_head, per_head)
    plain = medusa_head_losses(heads, hidden, ids, mask, mode, verifier_logits, decay=0.8, chunk_rows=7)
    assert (plain.counts > got.counts).all()  # the rule took targets away
    lm = torch.randn(heads.vocab_size, heads.hidden_size, dtype=torch.float64)
    total, parts, _ = medusa2_losses(hidden, lm, verifier_logits, heads, ids, mask, mode, position_ids=positions)
    ref_total, ref_parts = medusa2_loss(hidden @ lm.T, verifier_logits, heads(hidden), ids, mask, mode,
                                        segment_ids=document_ids(positions))
    _close(total, ref_total)
    _close(parts["lm"], ref_parts["lm"])


@pytest.mark.parametrize("mode", ["labels", "distill"])
def test_medusa2_losses_equal_medusa2_loss(mode):
    heads, hidden, ids, mask, reference = _heads_and_batch(seed=3)
    g = torch.Generator().manual_seed(4)
    lm_head = torch.randn(heads.vocab_size, heads.hidden_size, generator=g, dtype=torch.float64)
    hidden.requires_grad_(True)
    loss, parts, head = medusa2_losses(hidden, lm_head, reference, heads, ids, mask, mode, decay=0.8,
                                       lm_weight=1.0, kl_weight=0.5, heads_weight=0.2, chunk_rows=5)
    loss.backward()
    grad_hidden = hidden.grad.clone()
    hidden.grad = None
    ref_loss, ref_parts = medusa2_loss(hidden @ lm_head.T, reference, heads(hidden), ids, mask, mode, decay=0.8,
                                       lm_weight=1.0, kl_weight=0.5, heads_weight=0.2)
    ref_loss.backward()
    _close(loss, ref_loss)
    for key in ("lm", "kl", "heads"):
        _close(parts[key], ref_parts[key], msg=key)
    _close(head.per_head, ref_parts["per_head"])
    _close(grad_hidden, hidden.grad)  # what flows back into the LoRA adapters
