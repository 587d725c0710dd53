"""models/muon.py: torch.optim.Muon's update with the orthogonalisation in bf16 (torch's, to the bit) or fp32,
and the build's choice between them following the machine."""

from __future__ import annotations

import pytest
import torch

from draftheads.models.tiny import get_recipe, make_optimizers, pretrain
from draftheads.models.muon import Muon, newton_schulz

SHAPES = [(24, 8), (8, 24), (16, 16)]


def run(optimizer_cls, steps: int = 3, **kwargs) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in SHAPES]
    opt = optimizer_cls(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                        adjust_lr_fn="match_rms_adamw", **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def test_bf16_is_torchs_update_to_the_bit():
    for ours, theirs in zip(run(Muon, ns_dtype=torch.bfloat16), run(torch.optim.Muon)):
        assert torch.equal(ours, theirs)


def test_fp32_is_the_same_iteration_with_less_rounding():
    fp32, bf16, fp64 = run(Muon, ns_dtype=torch.float32), run(torch.optim.Muon), run(Muon, ns_dtype=torch.float64)
    for a, b, c in zip(fp32, bf16, fp64):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)  # bf16 has ~3 significant digits
        assert (a - c).abs().max() < (b - c).abs().max()  # fp32 is nearer the exact iteration than bf16


def test_newton_schulz_orthogonalises_and_keeps_the_shape():
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o = newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float64)
    singular = torch.linalg.svdvals(o)
    assert o.shape == x.shape and o.dtype == torch.float64
    assert 0.5 < singular.min() and singular.max() < 1.5  # US'V^T with S' near 1, as the quintic promises


@pytest.mark.parametrize("native, precision, want", [(True, "auto", torch.bfloat16), (False, "auto", torch.float32),
                                                     (False, "bf16", torch.bfloat16), (True, "fp32", torch.float32)])
def test_the_build_precision_follows_the_machine(monkeypatch, native, precision, want):
    """Forced both ways: a CPU with native bf16 (or a recipe asking for bf16) orthogonalises and autocasts in bf16,
    any other in fp32."""
    monkeypatch.setattr(pretrain, "native_bf16", lambda: native)
    recipe = get_recipe("micro", precision=precision)
    assert pretrain.compute_dtype(recipe) == want
    assert pretrain._autocast_dtype(recipe) == (torch.bfloat16 if want == torch.bfloat16 else None)
    model = torch.nn.Module()  # named like a Llama: decoder matrices under ".layers.", an lm_head, a norm
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=False)])
    model.lm_head, model.norm = torch.nn.Linear(8, 8, bias=False), torch.nn.LayerNorm(8)
    muon = [opt for opt in make_optimizers(model, recipe) if isinstance(opt, Muon)]
    assert len(muon) == 1 and muon[0].ns_dtype == want


@pytest.mark.parametrize("env, native", [({}, None), ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
                                         ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, None),
                                         ({"DNNL_MAX_CPU_ISA": "AVX512_CORE"}, False)])
def test_native_bf16_respects_a_cap_on_torchs_instruction_set(monkeypatch, env, native):
    """A CPU with AVX512-BF16 held to AVX2 by the environment (how a CPU without AVX-512 is imitated) emulates bf16:
    the build must choose fp32 there. None: the answer is the hardware's."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert pretrain.native_bf16() is (True if native is None else native)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert pretrain.native_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert pretrain.native_bf16() is False  # no bf16 in the hardware
