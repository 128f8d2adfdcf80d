"""Regressions from review 47 of the GEMM engine: what ``torchport::gemm``'s autograd saves
(only what its backward reads, as eager's ops), meta calls with operands on another device,
and constant scales compiled into C as float32 values rounded once (as torch rounds them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import torchport.gemm as G
from torchport import config, native
from torchport.gemm import kernels
from torchport.gemm.epilogue import EpilogueError, EpilogueSpec, Op
from torchport.nn.functional import linear

M, K, N = 4, 6, 5


def _leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).requires_grad_()
    w = torch.randn(N, K, generator=g).requires_grad_()
    return x, w, torch.randn(M, N, generator=g)


def _residual_updated(tp: bool) -> list[torch.Tensor]:
    x, w, r = _leaves()
    y = G.mm(x, w.t(), epilogue=[G.Add(r)]) if tp else x @ w.t() + r
    r.add_(1.0)  # add saves no residual
    y.backward(torch.ones(M, N))
    return [x.grad, w.grad]


def _frozen_bias_updated(tp: bool) -> list[torch.Tensor]:
    x, w, _ = _leaves()
    b = torch.linspace(-1.0, 1.0, N)
    y = linear(x, w, b) if tp else F.linear(x, w, b)
    b.mul_(2.0)  # addmm saves no bias
    y.backward(torch.ones(M, N))
    return [x.grad, w.grad]


def _input_of_frozen_weight_updated(tp: bool) -> list[torch.Tensor]:
    x, w, _ = _leaves()
    w = w.detach()
    h = x * 2
    y = linear(h, w) if tp else F.linear(h, w)
    h.add_(1.0)  # grad_h = g @ w: mm saves its input only for the weight's gradient
    y.backward(torch.ones(M, N))
    return [x.grad]


def _inference_operands(tp: bool) -> list[torch.Tensor]:
    x, w, r = _leaves()
    with torch.inference_mode():  # (an inference tensor cannot be saved for backward)
        b_inf, r_inf = torch.linspace(-1.0, 1.0, N), r.clone()
    y = G.mm(x, w.t(), bias=b_inf, epilogue=[G.Add(r_inf)]) if tp else F.linear(x, w, b_inf) + r_inf
    y.backward(torch.ones(M, N))
    return [x.grad, w.grad]


@pytest.mark.parametrize(
    "case",
    [_residual_updated, _frozen_bias_updated, _input_of_frozen_weight_updated, _inference_operands],
    ids=["residual-updated", "frozen-bias-updated", "input-updated", "inference-operands"],
)
def test_backward_saves_only_what_it_reads_as_eager(case: Callable[[bool], list[torch.Tensor]]):
    """Every operand and both of a and b were saved: a residual or frozen bias updated in place
    after the forward, the input of a frozen weight's layer updated, or an operand made under
    inference_mode failed the backward ("modified by an inplace operation", "Inference tensors
    cannot be saved") where eager's ops, which save none of them, work."""
    with config.override(max_autotune_gemm_backends="ATEN"):  # (autograd is the backend's)
        got = case(True)
    want = case(False)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_what_the_backward_reads_is_still_version_checked_as_eager():
    # relu's derivative needs its input, recomputed from a and b; a scale operand is read by
    # its own gradient: modified in place, both fail as eager's (which saves them as well)
    x, w, _ = _leaves()
    s = torch.linspace(0.5, 1.5, N)
    with config.override(max_autotune_gemm_backends="ATEN"):
        for tp in (True, False):
            h = x * 2
            y = linear(h, w, epilogue=["relu"]) if tp else F.relu(F.linear(h, w))
            h.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
            s1 = s.clone().requires_grad_()
            y = G.mm(x, w.t(), epilogue=[G.Scale(s1)]) if tp else (x @ w.t()) * s1
            with torch.no_grad():
                s1.mul_(2.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


def test_double_backward_with_only_the_weight_saved():
    # w frozen: only w is saved; the second-order gradient goes through g @ w again
    x, w, _ = _leaves()
    w = w.detach()
    x2 = x.detach().clone().requires_grad_()
    hv = []
    with config.override(max_autotune_gemm_backends="ATEN"):
        for y, inp in ((linear(x, w), x), (F.linear(x2, w), x2)):
            (g,) = torch.autograd.grad(y.pow(3).sum(), inp, create_graph=True)
            hv.append(torch.autograd.grad(g.pow(2).sum(), inp)[0])
    torch.testing.assert_close(hv[0], hv[1], rtol=1e-5, atol=1e-5)


# --- meta tensors ---------------------------------------------------------------------------------


def _meta_ab() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(4, 5, device="meta"), torch.empty(5, 3, device="meta")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bias": torch.zeros(3)}, "epilogue step 0 bias must be on device 'meta' as a and b"),
        (
            {"epilogue": [G.Add(torch.zeros(4, 3))]},
            "epilogue step 0 residual must be on device 'meta' as a and b are, got cpu",
        ),
        (
            {"bias": torch.empty(3, device="meta"), "epilogue": ["relu", G.Scale(torch.ones(3))]},
            "epilogue step 2 scale must be on device 'meta' as a and b are, got cpu",
        ),
    ],
    ids=["bias", "residual", "scale"],
)
def test_meta_call_with_an_operand_on_the_cpu_raises_typed(kwargs, match):
    # as torch's ops raise for a CPU operand of meta tensors (an untyped AssertionError from
    # the fake-tensor mode before: "Please convert all Tensors to FakeTensors first")
    with pytest.raises(EpilogueError, match=match):
        G.mm(*_meta_ab(), **kwargs)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_meta_call_takes_a_0d_scale_as_torch(device):
    # (meta @ meta) * a 0-d tensor, meta or a CPU scalar, is meta in torch; the 0-d meta scale
    # was read with float() (DataDependentOutputException), a CPU one failed the fake mode
    a, b = _meta_ab()
    s = torch.tensor(2.0, device=device)
    want = (a @ b) * s
    y = G.mm(a, b, epilogue=[G.Scale(s), "relu"])
    assert (y.device, y.shape, y.dtype) == (want.device, want.shape, want.dtype)


def test_cpu_call_rejects_a_0d_meta_scale_typed():
    with pytest.raises(EpilogueError, match="epilogue step 0 scale must be on cpu, got meta"):
        G.mm(torch.ones(4, 5), torch.ones(5, 3), epilogue=[G.Scale(torch.empty((), device="meta"))])


# --- constant scales in C -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    # 1 + 2**-24 is halfway between float32 1 and 1 + 2**-23 (ties to even: 1); 1 + 3 * 2**-24
    # halfway between 1 + 2**-23 and 1 + 2**-22 (to 1 + 2**-22); 1e300 is beyond float32: inf
    [(1 + 2**-24, 1 + 3 * 2**-24, -(1 + 2**-24)), (1e300,)],
    ids=["ties", "overflow"],
)
def test_constant_scale_is_the_float32_torch_rounds_to(values):
    """The C literal was ``repr(v) + "f"``: the compiler rounded the shortest decimal of the
    double to float32, a second rounding (1 + 2**-24 became 1 + 2**-23, torch's 1.0). Both the
    vector and the scalar epilogue body (N = 35: vectors, then a scalar tail) must give torch's
    product with the scalar."""
    spec = EpilogueSpec(tuple(Op("scale", value=v) for v in values))
    run = kernels.epilogue_pass(spec, torch.float32, native.cpu_info().isa)
    got = run(torch.ones(2, 35), [])
    want = torch.ones(2, 35)
    for v in values:
        want = want * v
    assert torch.equal(got, want), (got[0, 0].item(), got[0, -1].item(), want[0, 0].item())
