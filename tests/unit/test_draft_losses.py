"""models/draft_losses.py: every token loss against a slow per-token reference (values and gradients), the step
weights, and the losses wired into the EAGLE drafters by config."""

import math

import pytest
import torch

from draftheads.models.draft_losses import (STEP_WEIGHTS, TOKEN_LOSSES, acceptance, masked_mean, soft_cross_entropy,
                                           soft_cross_entropy_grad,
                                           step_weights, token_loss)
from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.verifier import Verifier


def slow_loss(kind: str, logits: list[float], target: list[float], eta: float = 3.0) -> torch.Tensor:
    """One position, written from the definitions with Python sums over the vocabulary (float64 autograd)."""
    z = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    slow_loss.last_input = z
    m = max(logits)
    exps = [torch.exp(z[v] - m) for v in range(len(logits))]
    total = sum(exps)
    q = [e / total for e in exps]
    p = [torch.tensor(x, dtype=torch.float64) for x in target]
    alpha = sum(torch.minimum(p[v], q[v]) for v in range(len(q)))
    kl_pq = sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in range(len(q)))
    if kind == "forward_kl":
        return -sum(p[v] * torch.log(q[v]) for v in range(len(q)))
    if kind == "reverse_kl":
        return sum(q[v] * (torch.log(q[v]) - torch.log(p[v])) for v in range(len(q)))
    if kind == "jsd":
        mid = [(p[v] + q[v]) / 2 for v in range(len(q))]
        return 0.5 * sum(p[v] * torch.log(p[v] / mid[v]) + q[v] * torch.log(q[v] / mid[v]) for v in range(len(q)))
    if kind == "tv":
        return 0.5 * sum(torch.abs(p[v] - q[v]) for v in range(len(q)))
    if kind == "lk":
        return -torch.log(alpha)
    lam = math.exp(-eta * alpha.detach().item())  # lk_hybrid: the weight carries no gradient
    return lam * kl_pq + (1 - lam) * (1 - alpha)


@pytest.mark.parametrize("kind", TOKEN_LOSSES)
def test_each_loss_matches_its_slow_reference_in_value_and_gradient(kind):
    g = torch.Generator().manual_seed(0)
    V = 7
    logits = torch.randn(2, 3, V, generator=g, dtype=torch.float64) * 2
    target = torch.softmax(torch.randn(2, 3, V, generator=g, dtype=torch.float64) * 2, -1)
    fast_in = logits.clone().requires_grad_(True)
    fast, alpha = token_loss(kind, fast_in, target.log())
    fast.sum().backward()
    for b in range(2):
        for t in range(3):
            ref = slow_loss(kind, logits[b, t].tolist(), target[b, t].tolist())
            ref.backward()
            torch.testing.assert_close(fast[b, t].double(), ref.detach(), atol=1e-5, rtol=1e-5, msg=(kind, b, t))
            torch.testing.assert_close(fast_in.grad[b, t], slow_loss.last_input.grad, atol=1e-5, rtol=1e-4,
                                       msg=(kind, "grad", b, t))
            q = torch.softmax(logits[b, t], -1)
            torch.testing.assert_close(alpha[b, t].double(), torch.minimum(q, target[b, t]).sum(), atol=1e-6,
                                       rtol=1e-6)


@pytest.mark.parametrize("kind", TOKEN_LOSSES)
def test_every_loss_is_smallest_where_the_drafter_equals_the_verifier(kind):
    target = torch.softmax(torch.randn(5, 9, generator=torch.Generator().manual_seed(1)), -1)
    exact, alpha = token_loss(kind, target.log(), target.log())
    torch.testing.assert_close(alpha, torch.ones(5))
    floor = -(target * target.log()).sum(-1) if kind == "forward_kl" else torch.zeros(5)  # H(p) for the CE
    torch.testing.assert_close(exact, floor, atol=1e-5, rtol=1e-5)
    # its own generator: the global one may have been seeded with 1 by a test before this one on the worker, and
    # then torch.randn(5, 9) draws the very logits of the target (CI failed that way once)
    worse, _ = token_loss(kind, torch.randn(5, 9, generator=torch.Generator().manual_seed(2)), target.log())
    assert (worse > exact + 1e-4).all()


def test_losses_see_no_log_of_zero():
    """Draft vocabularies renormalise the verifier's distribution, whose tail underflows: no nan, no inf."""
    target_logp = torch.log_softmax(torch.tensor([[0.0, -200.0, -1000.0]]), -1)
    logits = torch.tensor([[5.0, -300.0, 2.0]], requires_grad=True)
    for kind in TOKEN_LOSSES:
        loss, _ = token_loss(kind, logits, target_logp)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), kind
    with pytest.raises(ValueError, match="expected one of"):
        token_loss("kl", logits, target_logp)


def test_acceptance_is_one_minus_total_variation():
    p = torch.softmax(torch.randn(4, 6), -1)
    q = torch.softmax(torch.randn(4, 6), -1)
    torch.testing.assert_close(acceptance(p.log(), q.log()), 1 - 0.5 * (p - q).abs().sum(-1))


def test_step_weights():
    torch.testing.assert_close(step_weights("exponential", 4, 0.8), torch.tensor([1, 0.8, 0.64, 0.512]))
    torch.testing.assert_close(step_weights("uniform", 3), torch.ones(3))
    a = torch.tensor([0.9, 0.5, 0.4], requires_grad=True)
    w = step_weights("reach", 3, step_alpha=a)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.9, 0.45]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="mean acceptance"):
        step_weights("reach", 3)
    with pytest.raises(ValueError, match="expected one of"):
        step_weights("linear", 3)
    assert set(STEP_WEIGHTS) == {"exponential", "uniform", "reach"}


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert masked_mean(x, torch.tensor([[True, False, True]])) == 2.0
    assert masked_mean(x, torch.zeros(1, 3, dtype=torch.bool)) == 0.0


# ---- wired into the drafters ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier(tiny_verifier_dirs):
    return Verifier.from_pretrained(tiny_verifier_dirs["llama"])


def losses_of(verifier, version, **cfg):
    torch.manual_seed(0)
    drafter = build_drafter(verifier, EagleConfig(version=version, ttt_steps=3, draft_vocab_size=None, **cfg)).eval()
    ids = torch.randint(3, verifier.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    return drafter, drafter.training_loss(ids, feats, torch.ones(2, 10)), ids, feats


@pytest.mark.parametrize("kind", TOKEN_LOSSES)
def test_eagle3_trains_the_configured_loss_with_its_step_weights(verifier, kind):
    drafter, out, ids, feats = losses_of(verifier, 3, loss=kind)
    outs = drafter.ttt_unroll(ids, drafter.project_features(feats.layers))
    logp = torch.log_softmax(feats.logits, -1)
    expected = []
    for k, o in enumerate(outs):  # every position is scored and in the (whole) draft vocabulary
        n = 10 - 2 - k
        loss, _ = token_loss(kind, drafter.logits(o[:, :n]), logp[:, 1 + k:9])
        expected.append(loss.mean())
    torch.testing.assert_close(out.step_losses, torch.stack(expected).detach())
    torch.testing.assert_close(out.loss, sum(0.8 ** k * x for k, x in enumerate(expected)))
    _, uniform, _, _ = losses_of(verifier, 3, loss=kind, step_weights="uniform")
    torch.testing.assert_close(uniform.loss, sum(expected))


def test_eagle1_token_term_follows_the_loss(verifier):
    _, ce, _, _ = losses_of(verifier, 1)
    _, tv, _, _ = losses_of(verifier, 1, loss="tv")
    torch.testing.assert_close(ce.parts["feature_loss"], tv.parts["feature_loss"])
    assert 0 <= tv.parts["token_loss"] <= 1 < ce.parts["token_loss"]


def test_loss_config_errors():
    with pytest.raises(EagleError, match="lk_eta"):
        EagleConfig(lk_eta=-1)
    with pytest.raises(EagleError, match="EAGLE-3 option"):
        EagleConfig(version=1, parallel=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_is_forward_kl_in_value_and_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    target_logp = torch.log_softmax(torch.randn(3, 5, 11, generator=g) * 3, -1)
    fast_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fast = soft_cross_entropy(fast_in, target_logp.exp())
    ref, _ = token_loss("forward_kl", ref_in, target_logp)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    weights = torch.rand(3, 5, generator=g)
    (fast * weights).sum().backward()
    (ref * weights).sum().backward()
    assert fast_in.grad.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fast_in.grad, ref_in.grad, **tol)
    # the loss and the gradient at once, in place: the same numbers as the autograd pair, the logits untouched
    before = logits.clone()
    loss, grad = soft_cross_entropy_grad(logits, target_logp.exp(), target_logp.exp().sum(-1), weights)
    assert torch.equal(logits, before) and grad.dtype == torch.float32 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, fast.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, fast_in.grad.float(), **tol)
