"""models/lean_layer.py: the lean MLP and the single cast give the modules' outputs and gradients, and keep less."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from draftheads.models.lean_layer import cast_once, swiglu_mlp


def mlp_and_input(seed=0, hidden=32, inter=88):
    torch.manual_seed(seed)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4))
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.2)
    return mlp, torch.randn(2, 7, hidden, requires_grad=True)


def grads(fn, mlp, x):
    out = fn(mlp, x * 1.0)  # a non-leaf input, as a norm's output is (autocast caches the casts of leaves only)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    result = [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    return result


def test_swiglu_mlp_equals_the_module_in_fp32():
    mlp, x = mlp_and_input()
    for got, want in zip(grads(swiglu_mlp, mlp, x), grads(lambda m, v: m(v), mlp, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_swiglu_mlp_under_bf16_autocast_equals_the_module():
    mlp, x = mlp_and_input(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = grads(swiglu_mlp, mlp, x)
        plain = grads(lambda m, v: m(v), mlp, x)
    assert lean[0].dtype == plain[0].dtype == torch.bfloat16
    assert torch.equal(lean[0], plain[0])  # the forward is the module's, op for op
    for got, want in zip(lean[2:], plain[2:]):  # so are the weights' gradients, the product recomputed bit for bit
        assert torch.equal(got, want)
    # the input's: summed in fp32 after the two casts' gradients are cast, as the plain graph does
    torch.testing.assert_close(lean[1], plain[1], rtol=1e-5, atol=1e-6)


def test_swiglu_mlp_keeps_gate_and_up_only():
    mlp, x = mlp_and_input(2, hidden=16, inter=64)
    for fn, kept in ((swiglu_mlp, 2), (lambda m, v: m(v), 4)):
        wide = []

        def pack(t):
            if t.numel() == x.shape[0] * x.shape[1] * 64:  # (B, T, intermediate) activations (or 2-D views)
                wide.append(t.untyped_storage().data_ptr())
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(mlp, x)
        assert len(set(wide)) == kept


def test_swiglu_mlp_under_checkpointing_keeps_what_checkpointing_decides():
    from torch.utils.checkpoint import checkpoint

    mlp, x = mlp_and_input(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = grads(lambda m, v: checkpoint(swiglu_mlp, m, v, use_reentrant=False), mlp, x)
        plain = grads(lambda m, v: m(v), mlp, x)
    assert torch.equal(lean[0], plain[0])
    for got, want in zip(lean[1:], plain[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cast_once_keeps_one_copy_and_sums_gradients_in_fp32():
    x = torch.randn(3, 8, requires_grad=True)
    ws = [torch.randn(5, 8, requires_grad=True) for _ in range(3)]
    saved = set()

    def pack(t):
        if t.shape == (3, 8):
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = [nn.functional.linear(xi, w) for xi, w in zip(cast_once(x, 3), ws)]
    assert len(saved) == 1
    sum(o.float().sum() for o in outs).backward()
    assert x.grad.dtype == torch.float32
    expected = sum(w.to(torch.bfloat16).float().sum(0) for w in ws).expand(3, 8)
    torch.testing.assert_close(x.grad, expected, rtol=1e-2, atol=1e-2)
    assert cast_once(x, 2) == (x, x)  # no autocast: the input itself


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_other_activations_and_no_grad_run_the_module(act):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, hidden_act=act, num_attention_heads=4, num_key_value_heads=4))
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        assert torch.equal(swiglu_mlp(mlp, x), mlp(x))
    torch.testing.assert_close(swiglu_mlp(mlp, x), mlp(x))
