"""Complex decomposition: every rule vs eager (grid), compiled fw+bw vs eager, gradcheck, errors."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import torchport
from torchport.compiler.complex import (
    ComplexCompiled,
    ComplexDecompositionError,
    join_outputs,
    lower_complex,
    split_inputs,
)


def _run_lowered(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> list[torch.Tensor]:
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    assert not any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()
        for n in real.graph.nodes
    )
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)


UNARY = {
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "reciprocal": torch.reciprocal,
    "neg": torch.neg,
    "conj": lambda z: torch.conj_physical(z),
    "abs": torch.abs,
    "angle": torch.angle,
    "sgn": torch.sgn,
    "real": lambda z: z.real * 1,
    "imag": lambda z: z.imag * 1,
    "square": lambda z: z**2,
    "pow_frac": lambda z: z**0.5 + z ** (1 + 1j),
    "view_as_real": lambda z: torch.view_as_real(z) * 1,
    "to_c128": lambda z: z.to(torch.complex128),
    "pad_real_fill": lambda z: torch.nn.functional.pad(z, (1, 2), value=2.0),
    "pad_complex_fill": lambda z: torch.constant_pad_nd(z, (0, 1, 1, 0), 1 - 3j),
    "sum_dtype": lambda z: z.sum(dtype=torch.complex128) + z.mean(-1, dtype=torch.complex128),
    "cumsum_dtype": lambda z: z.cumsum(-1, dtype=torch.complex128),
    "nan_inf_finite": lambda z: (
        z.isnan().float() + z.isinf().float() + z.isfinite().float() + z.isnan().logical_not()
    ),
    "log10_log2": lambda z: torch.log10(z) + torch.log2(z),
    "vector_norms": lambda z: (
        torch.linalg.vector_norm(z, dim=-1) + torch.linalg.vector_norm(z, ord=1, dim=-1)
    ),
    "polar": lambda z: torch.polar(z.abs(), z.angle()) * 2,
    "expm1": torch.expm1,
    "log1p": torch.log1p,
    "exp2": torch.exp2,
    "tril_triu_trace": lambda z: z.tril() + z.triu(1) * 2 + z.t().tril(-1).t() + torch.trace(z),
    "sinh_cosh_tan": lambda z: torch.sinh(z) + torch.cosh(z) * 0.5 + torch.tan(z),
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "prod": lambda z: z.prod() * 1e-3 + z.prod(-1, keepdim=True) + z.prod(0).sum(),
    "prod_dtype": lambda z: z.prod(-1, dtype=torch.complex128),
    "cumprod": lambda z: z.cumprod(-1) + z.cumprod(0, dtype=torch.complex128),
    "complex_fills": lambda z: (
        torch.full_like(z, 1 + 2j) * z + torch.where(z.real > 0, z, 1j) + torch.full(z.shape, -2j)
    ),
}
BINARY = {
    "add": lambda a, b: a + b * 2 - 1j,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b * (0.5 - 2j),
    "div": lambda a, b: a / (b + 3) + 1 / (a + 5),
    "real_mix": lambda a, b: a * b.real + b.imag,
    "where": lambda a, b: torch.where(a.real > 0, a, b),
    "eq": lambda a, b: (a == b).float() + (a != 0).float(),
    "complex": lambda a, b: (
        torch.complex(a.real, b.imag) + torch.view_as_complex(torch.view_as_real(b))
    ),
}
SHAPES = [(0, 3), (1, 1), (7, 5)]


def _randc(shape: tuple[int, ...], dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_rules_match_eager(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = _randc(shape) + 0.1
    (got,) = _run_lowered(UNARY[name], x)
    torch.testing.assert_close(got, UNARY[name](x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_rules_match_eager(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    a, b = _randc(shape), _randc(shape)
    b[..., :1] = a[..., :1]  # some equal entries for eq/ne
    (got,) = _run_lowered(BINARY[name], a, b)
    torch.testing.assert_close(got, BINARY[name](a, b), rtol=1e-4, atol=1e-5)


def test_complex_scalar_fills_through_compile() -> None:
    # masked_fill/lerp decompose to full/where with a complex fill constant
    def fn(z: torch.Tensor) -> torch.Tensor:
        return z.masked_fill(z.imag > 0, 0.5 - 1j) + torch.lerp(z, 2 * z, 0.25)

    z = _randc((4, 3))
    got = torchport.compile(fn, inner="eager", batching=False)(z)
    torch.testing.assert_close(got, fn(z), rtol=1e-5, atol=1e-6)


def test_tanh_of_a_large_real_part_is_finite() -> None:
    # cosh 2x and sinh 2x overflow float32 beyond |x| ~ 44; tanh there is ±1
    x = torch.tensor([50 + 0.5j, -60 + 1j, 300 - 2j, 0.3 - 0.2j, 10 + 3j], dtype=torch.complex64)
    (got,) = _run_lowered(torch.tanh, x)
    torch.testing.assert_close(got, torch.tanh(x), rtol=1e-5, atol=1e-6)


def test_abs_log_of_huge_and_tiny_magnitudes() -> None:
    # |z|² overflows float32 above ~1.8e19 and underflows to 0 below ~1e-19
    x = torch.tensor([1e20 + 1e20j, 3e-25 - 4e-25j, -2e30 + 0j, 1 - 1j], dtype=torch.complex64)

    def fn(z: torch.Tensor) -> torch.Tensor:
        return torch.stack([z.abs(), torch.log(z).real])

    (got,) = _run_lowered(fn, x)
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_log_near_the_unit_circle(dtype: torch.dtype) -> None:
    # log hypot(x, y) cancels near |z| = 1: log(1 + 1e-4i) had real part 0 in complex64 (5e-9)
    g = torch.Generator().manual_seed(0)
    phasors = torch.polar(
        torch.ones(64, dtype=torch.float64), torch.rand(64, dtype=torch.float64, generator=g) * 6.28
    )
    x = torch.cat(
        [
            torch.tensor([1 + 1e-4j, 0.9999 + 0.01j, -1 + 1e-3j, 1e-3 - 1.0001j, 1 + 0j, -1 + 0j]),
            phasors * (1 + 1e-3 * torch.randn(64, dtype=torch.float64, generator=g)),
        ]
    ).to(dtype)
    (got,) = _run_lowered(torch.log, x)
    torch.testing.assert_close(got, torch.log(x), rtol=1e-5, atol=0.0)


def test_division_by_huge_and_tiny_complex_magnitudes() -> None:
    # c² + d² overflows float32 above ~1.8e19 (quotient 0) and underflows below ~1e-19 (inf/nan)
    a = torch.tensor([1 + 1j, 2 - 3j, 1e20 + 0j, 0.5 + 0.25j, 3 + 0j], dtype=torch.complex64)
    b = torch.tensor(
        [1e-23 + 1e-23j, 4e20 - 1e20j, 1e20 + 1e20j, 0.3 - 2j, 2j], dtype=torch.complex64
    )
    (got,) = _run_lowered(lambda x, y: x / y, a, b)
    torch.testing.assert_close(got, a / b, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_sqrt_without_cancellation_or_overflow(dtype: torch.dtype) -> None:
    # (|z| - x)/2 cancelled for a small imaginary part (1 + 1e-3i: imaginary part 2% off in
    # complex64; -4 + 1e-5i: real part 0) and |x| + |z| overflowed (3e38 + 3e38i gave inf)
    x = torch.tensor(
        [1 + 1e-3j, -4 + 1e-5j, 3e38 + 3e38j, -2e38 - 1j, 1e-3 + 0j, 0j, complex(2, -0.0), -9 - 0j],
        dtype=dtype,
    )
    (got,) = _run_lowered(torch.sqrt, x)
    want = torch.sqrt(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    assert torch.equal(torch.signbit(got.imag), torch.signbit(want.imag))


_INVERSE = {
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("name", sorted(_INVERSE))
def test_branch_cuts_and_extreme_magnitudes(name: str, dtype: torch.dtype) -> None:
    # both sides of every branch cut (signed zeros on the real and imaginary axes beyond ±1),
    # tiny and huge magnitudes (|1-z|² and 4x overflow in atanh; log(iz + sqrt(1-z²)) cancels)
    parts = (2.0, -2.0, 0.5, -0.5, 0.0, -0.0, 1.0, -1.0)
    vals = [complex(a, b) for a in parts for b in (0.0, -0.0, 2.0, -2.0, 0.5)]
    vals += [1e-4 + 1e-5j, 1e-20 + 1e-20j, 3e-30 - 1e-30j, 0.3 + 1e-3j, 1 - 1e-6j]
    if name != "expm1":
        vals += [1e10 - 3e9j, -1e18 + 1e18j, 1e30 + 0j]
    x = torch.tensor(vals, dtype=dtype)
    fn = _INVERSE[name]
    (got,) = _run_lowered(fn, x)
    want = fn(x)
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=0.0)
    # the sign of a zero part says which side of a cut; ATen's complex128 acos (not its
    # complex64 one, nor C99's cacos) gives acos(x + 0i) = acos x + 0i on (-1, 1): Kahan's -0i
    nonzero = (want.imag != 0) | (name != "acos") | (dtype == torch.complex64)
    assert torch.equal(torch.signbit(got.real), torch.signbit(want.real))
    assert torch.equal(torch.signbit(got.imag)[nonzero], torch.signbit(want.imag)[nonzero])


def test_long_complex64_product_is_accurate() -> None:
    # as |.| product and angle sum in float32, 2000 unit phasors multiplied to an error of 1.5e-5
    # (ATen's sequential product: 2.6e-6); in float64 the result is the exact one rounded
    g = torch.Generator().manual_seed(0)
    z = torch.polar(torch.ones(2000), torch.rand(2000, generator=g) * 6.28)
    z = z * (1 + 1e-4 * torch.randn(2000, dtype=torch.complex64, generator=g))
    (got,) = _run_lowered(lambda w: torch.stack([w.prod(), w.cumprod(0)[-1]]), z)
    exact = z.to(torch.complex128).prod().to(torch.complex64)
    torch.testing.assert_close(got, exact.expand(2), rtol=2e-7, atol=0.0)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_new_elementary_ops_and_products_forward_backward(inner: str) -> None:
    # prod/cumprod, expm1/log1p, sinh/cosh/tan and the inverse functions raised
    # ComplexDecompositionError (atanh's gradient also needs a complex empty_permuted)
    def fn(z: torch.Tensor) -> torch.Tensor:
        if inner != "eager":  # Inductor compiles the other rules alike, taking seconds
            return torch.atanh(z).cumprod(1).sum(0) + z.prod()
        w = torch.asin(z) + torch.acos(z) * 0.5 + torch.atan(z) + torch.asinh(z)
        w = w + torch.acosh(z + 2) + torch.atanh(z) + torch.expm1(z) + torch.log1p(z + 1)
        w = w + torch.sinh(z) + torch.cosh(z) + torch.tan(z)
        return w.prod(0) + w.cumprod(1).sum(0) + z.prod()

    z = (_randc((3, 4)) * 0.5).requires_grad_(True)
    z2 = z.detach().clone().requires_grad_(True)
    torch._dynamo.reset()
    out = torchport.compile(fn, inner=inner, batching=False)(z2)
    assert torchport.compiler.last_report().complex  # type: ignore[union-attr]
    ref = fn(z)
    gv = _randc(tuple(ref.shape))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        torch.autograd.grad(out, z2, gv)[0],
        torch.autograd.grad(ref, z, gv)[0],
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_ffts_inside_a_decomposed_graph_forward_backward(inner: str) -> None:
    # fft/ifft/rfft/irfft/fftn raised ComplexDecompositionError; they now run as ATen's FFT on
    # the rebuilt complex tensor, in the forward and the backward graph
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        z = torch.fft.fft(x * w, dim=-1)
        y = torch.fft.irfft(z[..., :5] * 2, n=8)
        r = torch.fft.ifft(torch.fft.rfft(y), norm="ortho")
        return (z.abs() ** 2).sum() + y.sum() + r.real.sum() + torch.fft.fftn(x).abs().sum()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.complex64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.complex64, generator=g, requires_grad=True)
    torch._dynamo.reset()
    out = torchport.compile(fn, inner=inner, batching=False)(x, w)
    assert torchport.compiler.last_report().complex  # type: ignore[union-attr]
    ref = fn(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(
        torch.autograd.grad(out, (x, w)), torch.autograd.grad(ref, (x, w)), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gradcheck_new_ops_complex128() -> None:
    def fn(z: torch.Tensor) -> torch.Tensor:
        w = torch.asin(z) * torch.atanh(z) + torch.acosh(z + 2) * torch.log1p(z) + torch.expm1(z)
        return w.prod(-1) + w.cumprod(0).sum(1)

    fn_c = torchport.compile(fn, inner="eager", batching=False)
    z = (torch.randn(3, 2, dtype=torch.complex128) * 0.4).requires_grad_(True)
    assert torch.autograd.gradcheck(fn_c, (z,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ["exp", "sin", "cos"])
def test_overflow_times_an_exact_zero_is_zero(name: str) -> None:
    # exp(100 + 0j) = inf + 0j and sin(100j) = 0 + inf j in ATen; inf * 0 gave nan parts
    fn = UNARY[name]
    x = torch.tensor(
        [100 + 0j, -100 - 0j, 100j, -100j, complex(0.0, -0.0), 0.5 - 0.25j] * 4,
        dtype=torch.complex64,
    )
    (got,) = _run_lowered(fn, x)
    want = fn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    assert torch.equal(torch.signbit(got.imag), torch.signbit(want.imag))


def test_zero_to_a_complex_power_is_zero() -> None:
    # exp(w log 0) = exp(-inf - inf j): 0 * cos(-inf) was nan, ATen gives 0
    x = torch.tensor([0j, 1 + 1j, 0j, -2 + 0.5j], dtype=torch.complex64)
    (got,) = _run_lowered(lambda z: z ** (2 + 1j), x)
    torch.testing.assert_close(got[[0, 2]], torch.zeros(2, dtype=torch.complex64))
    torch.testing.assert_close(got[[1, 3]], (x ** (2 + 1j))[[1, 3]], rtol=1e-5, atol=1e-6)


def _shape_ops(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = torch.cat([a, b], 0)
    s = torch.stack([a, b], 0).permute(1, 2, 0).reshape(a.shape[0], -1)
    idx = torch.tensor([0, a.shape[0] - 1])
    p, q = c.split([a.shape[0], b.shape[0]])
    return (
        c[idx].sum(0)
        + s[:, : a.shape[1]].mean(0)
        + a.t().flip(0).t().sum(0)
        + p.unsqueeze(0).squeeze(0).sum(0)
        + q.transpose(0, 1).cumsum(1)[:, -1]
        + torch.unbind(a, 0)[0]
        + a.expand(2, *a.shape).sum(0).select(0, 0)
    )


def test_shape_ops_and_reductions_match_eager() -> None:
    a, b = _randc((4, 3)), _randc((4, 3))
    (got,) = _run_lowered(_shape_ops, a, b)
    torch.testing.assert_close(got, _shape_ops(a, b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mk", [(0, 3, 2), (1, 1, 1), (5, 7, 3)], ids=str)
def test_matmul_bmm_match_eager(mk: tuple[int, int, int]) -> None:
    m, k, n = mk

    def f(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (
            (a @ b).sum(0)
            + torch.bmm(a.unsqueeze(0), b.unsqueeze(0))[0].sum(0)
            + (a @ r.to(a.dtype)).sum(0)
        )

    a, b, r = _randc((m, k)), _randc((k, n)), torch.randn(k, n)
    (got,) = _run_lowered(f, a, b, r)
    torch.testing.assert_close(got, f(a, b, r), rtol=1e-4, atol=1e-4)


# --- through torchport.compile: forward + backward ---------------------------------------------------


def _model(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    z = x @ w
    z = torch.exp(0.1j * z) * g + torch.sin(z).conj() - torch.cos(z) / (z + 2)
    z = torch.cat([z, torch.stack([z[:, 0], z[:, 1]], 1)], 1)
    z = torch.sqrt(z + 3) + torch.log(z + 4) * torch.tanh(z) * torch.sigmoid(z.real)
    return (z.abs() ** 2).mean() + torch.angle(z).mean() + z.imag.sum()


def _args(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 6), (6, 6), (6,)]
    return [(torch.randn(s, dtype=dtype, generator=g) * 0.3).requires_grad_() for s in shapes]


def _check_fw_bw(fn: Callable[..., torch.Tensor], dtype: torch.dtype, tol: float) -> None:
    args = _args(dtype)
    ref = _model(*args)
    ref_g = torch.autograd.grad(ref, args)
    out = fn(*args)
    got_g = torch.autograd.grad(out, args)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_compile_complex_forward_backward_eager_inner() -> None:
    fn = torchport.compile(_model, inner="eager", batching=False)
    _check_fw_bw(fn, torch.complex64, 1e-4)
    assert torchport.compiler.last_report().complex  # type: ignore[union-attr]


def test_backward_of_slicing_selecting_and_indexing() -> None:
    # their gradients scatter into zeros: slice_scatter, select_scatter, diagonal_scatter and
    # index_put had no rule, so any such training graph failed to compile
    def fn(x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor([0, 2, 0])
        return x[:, 1:-1].sum(1) * x[1, :3] + x[idx][:, 0] * 1j + x.diagonal() * 2

    x = _randc((3, 4)).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    out = torchport.compile(fn, inner="eager", batching=False)(x2)
    ref = fn(x)
    gv = _randc(tuple(ref.shape))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(out, x2, gv)[0],
        torch.autograd.grad(ref, x, gv)[0],
        rtol=1e-5,
        atol=1e-5,
    )


def test_roll_gather_index_select_forward_and_backward() -> None:
    # roll decomposes to index_select; the gradients of gather and index_select are
    # scatter_add and index_add into zeros: none of them had a rule
    def fn(x: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor([2, 0, 1])
        picked = x.gather(1, torch.tensor([[0], [1], [3]]))
        return x.roll(1, 0) * picked + x.index_select(0, rows)

    x = _randc((3, 4)).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    out = torchport.compile(fn, inner="eager", batching=False)(x2)
    ref = fn(x)
    gv = _randc(tuple(ref.shape))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(out, x2, gv)[0],
        torch.autograd.grad(ref, x, gv)[0],
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_tensor_constants_and_item_assignment(inner: str) -> None:
    # a complex constant stayed complex inside the real graph (view_as_complex error, or its
    # imaginary part dropped by a real copy: y[0] = 1j wrote 0); with Inductor any tensor
    # constant failed the fake re-trace
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * torch.tensor([1j, 2j, 3j]) + x * torch.tensor([1.0, 2.0, 3.0])
        y[0] = 1j
        return y

    x = _randc((4, 3))
    torch._dynamo.reset()
    got = torchport.compile(fn, inner=inner, batching=False)(x)
    torch.testing.assert_close(got, fn(x))


def test_gradcheck_complex128() -> None:
    fn = torchport.compile(_model, inner="eager", batching=False)
    assert torch.autograd.gradcheck(fn, tuple(_args(torch.complex128)), eps=1e-6, atol=1e-5)


def test_compile_complex_forward_backward_inductor() -> None:
    """Inductor compiles both real graphs (the test fails if either falls back to complex)."""

    def small(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        z = x @ w
        return (torch.exp(0.5j * z) * z.conj() / (z + 2)).abs().sum()

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, dtype=torch.complex64, generator=g, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.complex64, generator=g, requires_grad=True)
    ref = small(x, w)
    rg = torch.autograd.grad(ref, (x, w))
    out = torchport.compile(small, batching=False)(x, w)
    gg = torch.autograd.grad(out, (x, w))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(gg, rg, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --- unsupported ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["aten.sinc", "aten.logaddexp", "aten._linalg_det"])
def test_unsupported_op_raises_naming_it(op: str) -> None:
    fns = {
        "aten.sinc": lambda z: torch.sinc(z),
        "aten.logaddexp": lambda z: torch.logaddexp(z, z * 2),
        "aten._linalg_det": lambda z: torch.linalg.det(torch.eye(3) + z.unsqueeze(0) * 0.1),
    }
    gm = make_fx(fns[op])(_randc((3,)))
    with pytest.raises(ComplexDecompositionError, match=rf"no real decomposition for {op}"):
        lower_complex(gm)


def test_as_strided_of_a_complex_input_is_refused_and_of_an_intermediate_exact() -> None:
    # the input's parts are views of the interleaved complex storage: the same strides applied
    # to each part read real and imaginary values mixed
    x = _randc((4, 3))
    with pytest.raises(
        ComplexDecompositionError, match=r"as_strided\.default on a complex graph input"
    ):
        _run_lowered(lambda z: z.t().as_strided((2, 2), (1, 2)) * 2, x)
    (got,) = _run_lowered(lambda z: (z * 2).as_strided((2, 2), (1, 3), 1), x)
    torch.testing.assert_close(got, (x * 2).as_strided((2, 2), (1, 3), 1))
    # one output of split (an operator.getitem of a view op) is still a view of the input: the
    # walk back to it stopped at getitem and the strides read mixed parts ([2+2j, 3+3j])
    with pytest.raises(ComplexDecompositionError, match=r"as_strided"):
        _run_lowered(lambda z: z.reshape(-1).split(2)[1].as_strided((2,), (1,), 1), x)


def test_atanh_and_atan_near_the_branch_points() -> None:
    # the real part is odd in x: computed for |x| (for x near -1 the formula in x lost every
    # digit: atanh(-0.99999) gave -inf), and as logs where 4|x|/|1-z|^2 would overflow
    for dt in (torch.complex64, torch.complex128):
        z = torch.tensor([-0.999, -0.99999, 0.99999, 1 + 1e-20j, -1 + 1e-3j, 0.5j, -0.0], dtype=dt)
        (got,) = _run_lowered(torch.atanh, z)
        torch.testing.assert_close(got, torch.atanh(z), rtol=2e-5, atol=1e-6)
        w = torch.tensor([0.99999j, 0.001 + 1j, -0.3 - 0.2j], dtype=dt)
        (got,) = _run_lowered(torch.atan, w)
        torch.testing.assert_close(got, torch.atan(w), rtol=2e-5, atol=1e-6)


def test_unsupported_op_through_compile_is_a_clear_error() -> None:
    fn = torchport.compile(
        lambda z: torch.linalg.det(z.reshape(1, 3) * torch.ones(3, 1) + torch.eye(3)),
        inner="eager",
        batching=False,
    )
    with pytest.raises(Exception, match=r"no real decomposition for aten\._linalg_det"):
        fn(_randc((3,)))


def test_complex_false_leaves_complex_to_inner() -> None:
    fn = torchport.compile(lambda z: (z * 2).prod(), inner="eager", complex=False, batching=False)
    z = _randc((3,))
    torch.testing.assert_close(fn(z), (z * 2).prod())


class _SpecSpectral(torch.nn.Module):
    """A complex model whose sequence length is declared dynamic with @dynamic_spec."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64, generator=g) / 3)
        self.phase = torch.nn.Parameter(torch.randn(8, generator=g))

    @torchport.dynamic_spec(
        {"x": torchport.TensorSpec([torchport.ShapeVar("T", max=512), torchport.STATIC])}
    )
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.w
        z = z * torch.exp(1j * self.phase)
        z = z / (1 + z.abs())
        return (z.abs() ** 2).sum() + torch.angle(z).sum(0).mean() + z.real.sum()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_complex_with_dynamic_spec_one_graph_fw_bw(inner: str) -> None:
    """Complex decomposition under a dynamic spec: one graph for sizes 0, 1 and large, with
    forward and gradients equal to eager (a size-1 specialisation once gave garbage gradients)."""
    m = _SpecSpectral()
    fn = torchport.compile(m, inner=inner, batching=False)
    n0 = torchport.compiler.report_count()
    for t in (5, 1, 0, 17, 2, 64):
        x = torch.randn(t, 8, dtype=torch.complex64)
        m.zero_grad()
        ref = m(x)
        ref.backward()
        want = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
        m.zero_grad()
        out = fn(x)
        out.backward()
        got = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    reps = torchport.compiler.reports(n0)
    assert len(reps) == 1 and reps[0].complex


def test_lowering_keeps_an_unused_in_place_update() -> None:
    def fn(z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b.add_(1)  # a call_method nothing reads: its effect is the update of b
        return torch.ops.aten.mul.Tensor(z, z)

    gm = fx.symbolic_trace(fn)
    z, b = _randc((3,)), torch.zeros(3)
    FakeTensorProp(gm).propagate(z, b.clone())
    real, in_l, out_l = lower_complex(gm)
    (out,) = join_outputs(list(real(*split_inputs([z, b], in_l))), out_l)
    torch.testing.assert_close(out, z * z)
    assert b.tolist() == [1.0] * 3


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_huge_magnitudes_subnormals_and_zero_divisors(dtype: torch.dtype) -> None:
    # |z| above the dtype's max made log|z| (log, log1p, log10) and Kahan's products (asin,
    # acos, asinh, acosh) inf, 2y overflowed in tanh (NaN), 0/0 in Smith's division made both
    # parts NaN (ATen: 1j/0 = nan + inf i), quartering subnormal parts cost sqrt 40 ulp, and
    # sqrt(nan + inf i) was nan + inf i (ATen: inf + inf i)
    big = 1e38 if dtype == torch.complex64 else 1e300
    mx = torch.finfo(dtype.to_real()).max
    sub = torch.finfo(dtype.to_real()).smallest_normal * 2**-20
    z = torch.tensor(
        [
            complex(big, mx),
            complex(-big, mx),
            complex(mx, -mx),
            complex(0.0, mx),
            complex(-mx, 0.0),
            complex(3e9, -2e10),
            0.5 - 0.25j,
        ],
        dtype=dtype,
    )
    fns = {
        "log": torch.log,
        "log1p": torch.log1p,
        "log10": torch.log10,
        "asin": torch.asin,
        "acos": torch.acos,
        "asinh": torch.asinh,
        "acosh": torch.acosh,
        "tanh_imag": lambda w: torch.tanh(w.imag * 1j),
    }
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    for name, fn in fns.items():
        (got,) = _run_lowered(fn, z)
        torch.testing.assert_close(got, fn(z), rtol=tol, atol=0.0, msg=name)
    g = torch.Generator().manual_seed(0)
    parts = torch.randint(1, 2**20, (2, 64), generator=g).to(dtype.to_real()) * sub
    w = torch.complex(parts[0], -parts[1])
    w = torch.cat([w, w * 2**18, torch.tensor([complex(math.nan, math.inf)], dtype=dtype)])
    (got,) = _run_lowered(torch.sqrt, w)
    torch.testing.assert_close(got, torch.sqrt(w), rtol=tol / 10, atol=0.0)
    a = torch.tensor([1j, 1 + 0j, -2 + 1j, 0.5 - 1j], dtype=dtype)
    b = torch.tensor([0j, 0j, complex(0.0, -0.0), 1 + 1j], dtype=dtype)
    (got,) = _run_lowered(lambda u, v: u / v, a, b)
    torch.testing.assert_close(got, a / b, rtol=tol, atol=0.0, equal_nan=True)
    (got,) = _run_lowered(torch.exp, torch.tensor([complex(-big, -1.0)] * 9, dtype=dtype))
    assert torch.signbit(got.imag).all()  # exp(-1e38 - 1i) = 0 - 0i


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_logcumsumexp_is_stable_and_takes_atens_branch(dtype: torch.dtype) -> None:
    # terms 1000 below the running maximum and one far above it (exp overflows, cumsum of
    # exp(z - max) underflows); the imaginary part is ATen's scan's, not the principal arg
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 30, dtype=dtype, generator=g) * 3
    z[0, 0], z[1, 5], z[2, 7] = -1000 + 2j, 80 + 1j, 0.5 + 40j
    tol = 1e-5 if dtype == torch.complex64 else 1e-12

    def along(d: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: torch.logcumsumexp(w, d)

    for dim in (1, 0, -1):
        (got,) = _run_lowered(along(dim), z)
        torch.testing.assert_close(got, torch.logcumsumexp(z, dim), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_logcumsumexp_ties_and_pure_imaginary_take_atens_branch(dtype: torch.dtype) -> None:
    # ATen's scan resets on a tie (Re z_k equal to Re of the sum so far): [0j, 4j] is 5.1416i,
    # not -1.1416i, which needs the first sum to be exactly z_0; a 0-dim input is itself
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.tensor([0j, 4j, 1j, 1j], dtype=dtype),
        1j * (torch.randn(60, 6, generator=g) * 6).to(dtype),
        (
            torch.randint(-2, 3, (60, 6), generator=g)
            + 1j * torch.randint(-3, 4, (60, 6), generator=g)
        ).to(dtype),
    ]
    for z in cases:
        for dim in (0, -1):
            (got,) = _run_lowered(functools.partial(torch.logcumsumexp, dim=dim), z)
            torch.testing.assert_close(got, torch.logcumsumexp(z, dim), rtol=1e-5, atol=1e-5)
    z0 = torch.tensor(1 + 2j, dtype=dtype)
    (got,) = _run_lowered(lambda w: torch.logcumsumexp(w, 0), z0)
    assert got.shape == () and got == z0


def test_logcumsumexp_nan_and_inf_as_atens_scan() -> None:
    # a NaN imaginary part dropped out of the signed sums ([1, 2+nan j, 3] gave 1+nan j, 3.13);
    # +inf real parts gave the wrong angle; ATen's fold: NaN infects the rest, Im z = inf is
    # NaN once a second term counts, Re z = -inf adds nothing, Re z = +inf sets the sum
    inf, nan = math.inf, math.nan
    rows = [
        [1, complex(2, nan), 3, 4j],
        [1, complex(nan, 0), 3, 4j],
        [1 + 1j, complex(-inf, 3), 2j, 1],
        [complex(-inf, 2), 1 + 1j, complex(-inf, 0), 2],
        [complex(1, inf), complex(-inf, 0), 2, 3],
        [1 + 1j, complex(inf, 0.5), 3, complex(inf, 0.25)],
        [complex(inf, 1), 5, complex(inf, 2), 3j],
        [complex(inf, 3), complex(inf, -3), 1, 2],
        [complex(1, inf), complex(inf, 2), 3, complex(inf, inf)],
    ]
    z = torch.tensor(rows, dtype=torch.complex128)
    (got,) = _run_lowered(lambda w: torch.logcumsumexp(w, 1), z)
    want = torch.logcumsumexp(z, 1)
    torch.testing.assert_close(torch.view_as_real(got), torch.view_as_real(want), equal_nan=True)


def test_restrided_output_stays_on_its_device() -> None:
    # the copy that lays a complex output out as traced (column-major here) was allocated on
    # the CPU whatever the output's device: a meta output failed to copy out of meta
    cc = ComplexCompiled.__new__(ComplexCompiled)
    cc.in_layout, cc.out_layout, cc.contiguous = [True], [True], False
    cc.out_strides = [(0, (1, 3))]
    cc._run = lambda a: [torch.stack([a[0] * 2, a[1] * 2], -1)]
    z = torch.empty(3, 3, dtype=torch.complex64, device="meta")
    (out,) = cc(z)
    assert out.device.type == "meta" and out.stride() == (1, 3)


def test_column_major_output_is_written_as_traced() -> None:
    # exp(t.t()) * 2 is column-major in eager; the real graph stacked its parts row-major, so
    # ComplexCompiled restrided every call's output with a copy; it now stacks in stride order
    x = torch.randn(4, 3, dtype=torch.complex64)
    (got,) = _run_lowered(lambda t: torch.exp(t.t()) * 2, x)
    want = torch.exp(x.t()) * 2
    assert got.stride() == want.stride() == (1, 3)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_linalg_inv_ex_inverse_and_info(dtype: torch.dtype) -> None:
    # the inverse from the real 2n x 2n embedding; info is the complex LU's first zero pivot
    # (exactly singular: a zero column, a zero matrix)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 4, dtype=dtype, generator=g) + 2 * torch.eye(4, dtype=dtype)
    (inv, info) = _run_lowered(torch.linalg.inv_ex, a)
    want = torch.linalg.inv_ex(a)
    tol = 1e-4 if dtype == torch.complex64 else 1e-10
    torch.testing.assert_close(inv, want.inverse, rtol=tol, atol=tol)
    assert torch.equal(info, want.info)
    s = torch.zeros(3, 3, dtype=dtype)
    s[:, 0], s[1, 1] = 1, 1j
    for m in (s, torch.zeros(2, 2, dtype=dtype), s[:2, :2] * (1 + 2j)):
        (_, info) = _run_lowered(torch.linalg.inv_ex, m)
        assert torch.equal(info, torch.linalg.inv_ex(m).info)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_logcumsumexp_and_inverse_forward_backward(inner: str) -> None:
    # both raised ComplexDecompositionError; the backward graph takes logcumsumexp (of the
    # flipped gradient) and the inverse's products
    def fn(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(z, 1) * 0.5 + (torch.linalg.inv(m) @ z.mT).sum(-1)

    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 3, dtype=torch.complex64, generator=g, requires_grad=True)
    m0 = torch.randn(3, 3, dtype=torch.complex64, generator=g) + 3 * torch.eye(3)
    m = m0.requires_grad_(True)
    z2 = z.detach().clone().requires_grad_(True)
    m2 = m.detach().clone().requires_grad_(True)
    torch._dynamo.reset()
    out = torchport.compile(fn, inner=inner, batching=False)(z2, m2)
    assert torchport.compiler.last_report().complex  # type: ignore[union-attr]
    ref = fn(z, m)
    gv = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    got_g = torch.autograd.grad(out, (z2, m2), gv)
    for a, b in zip(got_g, torch.autograd.grad(ref, (z, m), gv), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gradcheck_logcumsumexp_and_inverse_complex128() -> None:
    def fn(z: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(z, 0) + torch.linalg.inv(z[:2, :2] + 2 * torch.eye(2)).sum()

    fn_c = torchport.compile(fn, inner="eager", batching=False)
    z = (torch.randn(2, 2, dtype=torch.complex128) * 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(fn_c, (z,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_tanh_and_atanh_of_infinite_parts(dtype: torch.dtype) -> None:
    # atanh(±inf + iy) had real part inf/inf = NaN (ATen ±0 + i copysign(π/2, y)), tanh(±inf +
    # i inf) was NaN (ATen ±1 ± 0i) and tanh(0 + i inf) NaN + NaN i (ATen 0 + NaN i); atan and
    # tan are the same functions rotated
    parts = (0.0, -0.0, 1.0, -0.5, 1e30, math.inf, -math.inf)
    z = torch.tensor([complex(a, b) for a in parts for b in parts], dtype=dtype)
    for fn in (torch.tanh, torch.atanh, torch.tan, torch.atan):
        (got,) = _run_lowered(fn, z)
        want = fn(z)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0, equal_nan=True, msg=str(fn))
        for g, w in ((got.real, want.real), (got.imag, want.imag)):
            zero = w == 0
            assert torch.equal(torch.signbit(g[zero]), torch.signbit(w[zero])), fn


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_exp_sin_cos_of_infinite_parts(dtype: torch.dtype) -> None:
    # sin(inf + 0i) and cos(nan + 0i) were NaN + NaN i (ATen NaN ± 0i), cos(inf + inf i) NaN
    # (ATen inf + NaN i); exp(-1e38 + inf i) was 0 (ATen NaN + NaN i: only x = -inf gives 0)
    # and exp(inf + inf i) NaN + NaN i (ATen inf + NaN i); sinh/cosh and pow inherit these
    parts = (0.0, -0.0, 1.0, -2.5, -1e30, math.inf, -math.inf, math.nan)
    z = torch.tensor([complex(a, b) for a in parts for b in parts], dtype=dtype)
    for fn in (torch.exp, torch.sin, torch.cos, torch.sinh, torch.cosh):
        (got,) = _run_lowered(fn, z)
        want = fn(z)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0, equal_nan=True, msg=str(fn))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_signed_zeros_of_a_real_numerator_and_expm1_overflow(dtype: torch.dtype) -> None:
    # a known-zero part was left out of the formulas (0 - b as -b, a·rat + 0 as a·rat), so zero
    # results had the other sign: 1/(2 + 0i) = 0.5 - 0i and 1/(0 - 1i) = +0 + 1i (ATen 0.5 + 0i,
    # -0 + 1i; reciprocal, rsqrt, sigmoid); expm1(1e38 + 0i) kept 0i where ATen gives NaN
    z = torch.tensor(
        [2 + 0j, complex(0.0, -1.0), complex(-1.0, -0.0), complex(0.0, 0.5), complex(-0.0, 2.0)],
        dtype=dtype,
    )
    for fn in (torch.reciprocal, torch.rsqrt, torch.sigmoid):
        (got,) = _run_lowered(fn, z)
        want = fn(z)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0, msg=str(fn))
        for g, w in ((got.real, want.real), (got.imag, want.imag)):
            assert torch.equal(torch.signbit(g[w == 0]), torch.signbit(w[w == 0])), fn
    big = 1e38 if dtype == torch.complex64 else 1e300
    x = torch.tensor([complex(big, 0.0), complex(big, -0.0), complex(-big, -0.0)], dtype=dtype)
    (got,) = _run_lowered(torch.expm1, x)
    torch.testing.assert_close(got, torch.expm1(x), equal_nan=True)


def test_pow_by_the_exponents_aten_computes_as_other_functions() -> None:
    # ATen computes z ** 0.5 as sqrt (and -0.5, -1, -2 as rsqrt/reciprocal); through
    # e^(p log z), (-inf) ** 0.5 was -inf + inf i (ATen inf i), (-1) ** 0.5 was -4e-8 + 1i
    # (ATen 1i), and a float 2.0 took that path too
    z = torch.tensor(
        [complex(-math.inf, 0.0), -1 + 0j, complex(-4.0, -0.0), 2 + 3j, 0j, 0.3 - 0.2j],
        dtype=torch.complex64,
    )

    def powers(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([w**0.5, w**-0.5, w**-1.0, w**-2.0, w**2.0, w**3.0])

    (got,) = _run_lowered(powers, z)
    torch.testing.assert_close(got, powers(z), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_pow_by_other_integral_floats_is_exp_log() -> None:
    # z ** 1e300 raised OverflowError (int(1e300) of an integral float, run at each call) and
    # z ** 4.0 took the repeated product, where ATen's kernel takes e^(p log z) for every
    # exponent but 0, ±0.5, ±1, ±2, 3: their non-finite values differ
    vals = [0.0, 1.0, -1.0, 0.5, -2.5, math.inf, -math.inf, math.nan, 1e300]
    z = torch.tensor([complex(a, b) for a in vals for b in vals], dtype=torch.complex128)

    def powers(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([w**4.0, w**4, w**1e300, w**-3.0])

    (got,) = _run_lowered(powers, z)
    want = powers(z)
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-9, atol=1e-12)
    assert (got.isfinite() == fin).float().mean() > 0.9


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per element: equal parts with equal signs (of zeros too), or NaN where eager has NaN."""
    g, w = torch.view_as_real(got), torch.view_as_real(want)
    same = ((g == w) & (torch.signbit(g) == torch.signbit(w))) | (g.isnan() & w.isnan())
    return same.all(-1)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_add_sub_with_alpha_take_atens_complex_product(dtype: torch.dtype) -> None:
    # ATen's add kernel computes a + alpha·b as a complex product: 1 + 2·(inf + 0i) is
    # inf + NaN i (2·0 + 0·inf); the real alpha was applied to each part alone (inf + 0i),
    # rsub(z, 2, alpha=3) (the .Scalar overload, alpha positional) ignored alpha (2 - z), and
    # alpha·b of two numbers was folded in double (1e30 · 3 off by 1 ulp in complex64)
    parts = (0.0, -0.0, 1.0, -2.5, 1e30, math.inf, -math.inf, math.nan)
    vals = [complex(x, y) for x in parts for y in parts]
    a = torch.tensor([v for v in vals for _ in vals], dtype=dtype)
    b = torch.tensor(vals * len(vals), dtype=dtype)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [
                torch.add(x, y, alpha=2),
                torch.sub(x, y, alpha=-2.5),
                torch.rsub(x, y, alpha=1e30),
                torch.add(x, y, alpha=complex(2.0, -0.0)),
                torch.sub(x, y, alpha=0.5 - 3j),
                torch.add(x, y.real, alpha=1j),
                torch.add(y.real, x, alpha=-1),
                torch.add(x, complex(math.inf, 0.0), alpha=2),
                torch.sub(x, 1 - 3j, alpha=1e30),
                torch.rsub(x, 2, alpha=3),
            ]
        )

    (got,) = _run_lowered(fn, a, b)
    assert _same_bits(got, fn(a, b)).all()


def test_add_sub_with_a_symbolic_alpha_under_dynamic_shapes() -> None:
    # a keyword alpha that is a graph value (r.shape[0] under dynamic=True) was read from the
    # source graph's node, so the lowered graph used a node of another graph: compilation failed
    # ("Argument 'sym_size_int' ... does not belong to this Graph")
    z = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j], dtype=torch.complex64)
    w = torch.tensor([2 + 1j, -1 + 4j, 0.5 + 0j], dtype=torch.complex64)

    def fn(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        n = r.shape[0]
        return torch.add(x, y, alpha=n) + torch.sub(x, y, alpha=n) + torch.rsub(x, y, alpha=n)

    compiled = torchport.compile(fn, inner="eager", dynamic=True, batching=False)
    for n in (3, 5):
        r = torch.zeros(n)
        torch.testing.assert_close(compiled(z, w, r), fn(z, w, r), rtol=0.0, atol=0.0)


def test_differentiating_the_lowered_graph_is_refused() -> None:
    # autograd through the real graph gave wrong gradients where rules pick ATen's values with
    # masks: logcumsumexp's and exp's imaginary gradients at zero imaginary parts (d/dy of the
    # mask is 0); the compiled path lowers forward and backward separately and stays exact
    from torchport.compiler.complex import ComplexAutogradError

    z = torch.tensor([[1 + 0j, 2 + 0j, 0.5 + 1j, -1 + 0j]], dtype=torch.complex128)
    real, in_l, _ = lower_complex(make_fx(lambda w: torch.logcumsumexp(w, 1))(z))
    parts = split_inputs([z.clone().requires_grad_(True)], in_l)
    with pytest.raises(ComplexAutogradError, match="input 0 requires grad"):
        real(*parts)
    with torch.no_grad():
        real(*parts)
    fn = torchport.compile(lambda w: torch.logcumsumexp(w, 1), inner="eager", batching=False)
    gv = torch.tensor([[1 - 2j, 0.5 + 1j, -1j, 2 + 0j]], dtype=torch.complex128)
    zc, ze = (z.clone().requires_grad_(True) for _ in range(2))
    (got,) = torch.autograd.grad(fn(zc), zc, gv)
    (want,) = torch.autograd.grad(torch.logcumsumexp(ze, 1), ze, gv)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_exp_and_pow_where_e_to_the_x_overflows_but_the_result_does_not(dtype: torch.dtype) -> None:
    # ATen's complex exp (C's cexp) scales e^x above x = 88: exp(88.5 + 1i) is 1.47e38 + 2.29e38i
    # in complex64 and z ** p with |z|^p near the dtype's max finite, where e^x alone gave inf;
    # z ** (3 + 0j) is z·z·z in ATen (NaN + inf i where a product overflows), it was e^(3 log z)
    rdt = dtype.to_real()
    g = torch.Generator().manual_seed(0)
    ang = (torch.rand(200, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    log_max = math.log(torch.finfo(rdt).max)
    tol = 1e-4 if dtype == torch.complex64 else 1e-10
    z = torch.tensor([88.5 + 1j, 89.5 + 1.5j, 100 + 1.5707963j, 88.03 - 2j, 700 + 3j], dtype=dtype)
    (got,) = _run_lowered(torch.exp, z)
    want = torch.view_as_real(torch.exp(z))
    torch.testing.assert_close(torch.view_as_real(got), want, rtol=tol, atol=0.0)
    for p in (4.0, -3.7):
        target = log_max + torch.rand(200, generator=g, dtype=torch.float64) * 3 - 2
        w = torch.polar(torch.exp(target / p), ang).to(dtype)
        (got,) = _run_lowered(functools.partial(torch.pow, exponent=p), w)
        want = torch.view_as_real(w**p)
        torch.testing.assert_close(torch.view_as_real(got), want, rtol=tol, atol=0.0, msg=str(p))
    w = torch.polar(torch.exp((log_max + ang[50:100] / 6) / 3), ang[:50])
    w = w.to(dtype)
    (got,) = _run_lowered(lambda v: v ** (3 + 0j), w)
    want = torch.view_as_real(w ** (3 + 0j))
    torch.testing.assert_close(torch.view_as_real(got), want, rtol=tol, atol=0.0, equal_nan=True)


def test_complex128_exp_scales_only_above_709() -> None:
    # glibc's cexp scales e^x by e^t only above t = 709 for double (88 for float); complex128
    # exp was scaled from 88, which rounded (cos y · e^88) · e^(x - 88) differently from
    # e^x cos y: 1 ulp off eager for most x in (88, 709] (bit-equal 37 %, before the rule 99 %)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2000, generator=g, dtype=torch.float64) * 620 + 88
    y = (torch.rand(2000, generator=g, dtype=torch.float64) * 2 - 1) * 3
    (got,) = _run_lowered(torch.exp, torch.complex(x, y))
    assert torch.equal(got.real, torch.exp(x) * torch.cos(y))
    assert torch.equal(got.imag, torch.exp(x) * torch.sin(y))
    want = torch.exp(torch.complex(x, y))
    assert (_same_bits(got, want).double().mean()) > 0.9
    w = torch.tensor([709.5 + 1j, 710 - 2j], dtype=torch.complex128)  # scaled: finite in eager
    (got,) = _run_lowered(torch.exp, w)
    torch.testing.assert_close(got, torch.exp(w), rtol=1e-14, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_real_base_to_a_complex_exponent_with_zero_imaginary_part(dtype: torch.dtype) -> None:
    # ATen promotes a real base to complex (imaginary part +0) before its real-exponent cases;
    # the rule dropped the +0 from their products: nan ** (2 + 0j) gave nan + 0i (eager
    # nan + nan i), (-0.) ** (-1 + 0j) gave -inf + 0i (eager 1/(-0 + 0i) = inf + nan i)
    if dtype == torch.int64:
        x = torch.tensor([0, 1, -2, 3, -7])
    else:
        parts = (0.0, -0.0, 1.0, -2.5, 3.0, 1e20, -1e20, math.inf, -math.inf, math.nan)
        x = torch.tensor(parts, dtype=dtype)
    for p in (2 + 0j, 3 + 0j, -1 + 0j, -2 + 0j, 0j, 1 + 0j):
        fn = functools.partial(torch.pow, exponent=p)
        (got,) = _run_lowered(fn, x)
        want = fn(x)
        assert got.dtype == want.dtype and _same_bits(got, want).all(), p


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_mul_with_a_real_operand_takes_its_zero_imaginary_part(dtype: torch.dtype) -> None:
    # ATen promotes a real operand to complex before its complex product, so its imaginary
    # part +0 takes part: x.to(c64) ** (2 + 0j) and x.to(c64) * x.to(c64) at x = inf gave
    # inf + 0i (eager inf·0 + 0·inf: inf + NaN i), x.to(c64) ** 3 at x = 1e30 inf + 0i (eager
    # inf + NaN i) and (-2 + 0i)² 4 + 0i (eager 4 - 0i). A complex value times a real one still
    # scales each part alone (README): z * 2 is not compared
    parts = (0.0, -0.0, 1.0, -2.5, 1e30, math.inf, -math.inf, math.nan)
    rdt = dtype.to_real()
    x = torch.tensor([p for p in parts for _ in parts], dtype=rdt)
    y = torch.tensor(list(parts) * len(parts), dtype=rdt)
    z = torch.complex(x, y)

    def fn(z: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xc, yc = x.to(dtype), y.to(dtype)
        return torch.stack(
            [
                xc * yc,
                yc * 2,
                xc * xc,
                xc * -0.0,
                xc ** (2 + 0j),
                xc**3,
                xc**-2,
                z**2,
                z**3,
            ]
        )

    (got,) = _run_lowered(fn, z, x, y)
    want = fn(z, x, y)
    bad = ~_same_bits(got, want)
    assert not bad.any(), (bad.nonzero()[:4].tolist(), got[bad][:4], want[bad][:4])


def test_symbolic_sizes_and_strides_of_a_complex_tensor() -> None:
    # make_fx(tracing_mode="symbolic") traces z.shape[0], z.numel() and z.stride(0) as
    # sym_size/sym_numel/sym_stride nodes on the complex tensor, which had no rule
    # (ComplexDecompositionError: no real decomposition for aten.sym_size.int)
    def fn(z: torch.Tensor) -> torch.Tensor:
        return z * z.shape[0] + z.sum() * z.numel() + z.stride(0) + z.unsqueeze(0).stride(0)

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(5, 3, dtype=torch.complex64))
    targets = {n.target for n in gm.graph.nodes}
    assert {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int} <= targets
    real, in_l, out_l = lower_complex(gm)
    for shape in ((5, 3), (2, 7), (1, 1)):
        z = torch.randn(shape, dtype=torch.complex64)
        outs = real(*split_inputs([z], in_l))
        (got,) = join_outputs(list(outs), out_l)
        torch.testing.assert_close(got, fn(z))

    # an input every other column of a complex matrix: stride 2·s0 for sizes (s1, s0), not a
    # contiguous layout, which a stride of the parts does not give either
    strided = torch.randn(4, 6, dtype=torch.complex64)[:, ::2]
    gm = make_fx(lambda z: z * z.stride(0), tracing_mode="symbolic")(strided)
    with pytest.raises(ComplexDecompositionError, match="a product of its sizes"):
        lower_complex(gm)


@pytest.mark.parametrize("mode", ["real", "symbolic"])
def test_complex_of_broadcast_parts_has_the_broadcast_shape(mode: str) -> None:
    # torch.complex(a[3], b[5, 3]) broadcasts; the lowering kept a as the real part, so
    # z.numel() was the real part's 3 (b*3 + 5, not b*15 + 5), z.real [3] and zeros_like(z) [3]
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = torch.complex(a, b)
        return b * z.numel() + z.shape[0], z.real * 1, torch.zeros_like(z) + z, z - 1

    for a, b in (
        (torch.randn(3), torch.randn(5, 3)),
        (torch.randn(5, 1), torch.randn(3)),
    ):
        gm = make_fx(fn, tracing_mode=mode)(a, b)
        real, in_l, out_l = lower_complex(gm)
        outs = real(*split_inputs([a, b], in_l))
        got = join_outputs(list(outs), out_l)
        for g, w in zip(got, fn(a, b)):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_negated_and_conjugated_real_valued_products_keep_the_zeros_sign(
    dtype: torch.dtype,
) -> None:
    # conj and -z of x.to(c64) have imaginary part -0, which ATen's products read; the lowering
    # kept it as +0, so conj(xc)·xc at x = -2 was 4 - 0i (eager 4 + 0i), conj(xc)² at 2 4 + 0i
    # (eager 4 - 0i), (-xc)² at 2 4 - 0i (eager's -z: 4 + 0i), xc·(2 - 0j) at -0 -0 + 0i
    base = [2.0, -2.0, 0.0, -0.0, math.inf, math.nan]

    def conj_fn(x: torch.Tensor) -> torch.Tensor:
        xc = x.to(dtype)
        c = xc.conj_physical()
        return torch.stack(
            [c * xc, c**2, torch.conj(xc) ** 2, c**3, xc * complex(2.0, -0.0), c.flip(0) ** 2]
        )

    def neg_fn(x: torch.Tensor) -> torch.Tensor:
        xc = x.to(dtype)
        n = -xc
        return torch.stack(
            [
                n**2,
                n * n,
                n * xc,
                n**3,
                n**-2,
                n,
                torch.cat([n, n])[: x.numel()] ** 2,
                torch.cat([n, xc]).view(2, -1)[0] ** 2,
                n.add(xc, alpha=2),
                torch.view_as_complex(torch.view_as_real(n) * 1),
            ]
        )

    for reps in (1, 16):
        x = torch.tensor(base * reps, dtype=dtype.to_real())
        (got,) = _run_lowered(conj_fn, x)
        want = conj_fn(x)
        bad = ~_same_bits(got, want)
        assert not bad.any(), (reps, bad.nonzero()[:4].tolist(), got[bad][:4], want[bad][:4])
        # eager's neg is -z in its scalar loop but 0 - z in its vectorized one (+0 where -z
        # has -0), so eager's own product depends on the element's place in the tensor (whole
        # vectors: 8 complex64 / 4 complex128 with AVX-512); the lowering's is -z's, eager's
        # one element at a time
        (got,) = _run_lowered(neg_fn, x)
        want = torch.cat([neg_fn(x[i : i + 1]) for i in range(x.numel())], dim=1)
        bad = ~_same_bits(got, want)
        assert not bad.any(), (reps, bad.nonzero()[:4].tolist(), got[bad][:4], want[bad][:4])


def test_symbolic_strides_of_a_channels_last_complex_tensor() -> None:
    # a channels-last [N, C, H, W] tensor's strides are (H*W*C, 1, W*C, C): products of its
    # sizes, but not of the later dims', and the stride rule raised for stride(3) and stride(2)
    # (ComplexDecompositionError: computed for a contiguous layout only)
    def fn(z: torch.Tensor) -> torch.Tensor:
        return z * z.stride(3) + z.stride(2) - z.stride(0)

    def make(*shape: int) -> torch.Tensor:
        z = torch.randn(shape, dtype=torch.complex64)
        return z.to(memory_format=torch.channels_last)

    gm = make_fx(fn, tracing_mode="symbolic")(make(2, 3, 4, 5))
    real, in_l, out_l = lower_complex(gm)
    for shape in ((2, 3, 4, 5), (3, 6, 2, 7)):
        z = make(*shape)
        (got,) = join_outputs(list(real(*split_inputs([z], in_l))), out_l)
        torch.testing.assert_close(got, fn(z), rtol=0, atol=0)


def test_sum_of_a_real_valued_and_a_broadcast_complex_tensor_has_full_parts() -> None:
    # x.to(c64) + w for x [5, 3] and w [3]: the sum's imaginary part was w's, shape [3], so
    # (x.to(c64) + w).sum() had a fifth of eager's imaginary part (silently, also through
    # torchport.compile) and returning the sum failed to stack its parts
    x, w = torch.randn(5, 3), torch.randn(3, dtype=torch.complex64)

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xc = x.to(torch.complex64)
        return (
            (xc + w).sum(),
            (xc - w).sum(0),
            torch.rsub(xc, w),
            xc.add(w, alpha=2).imag,
            w - xc,
            torch.view_as_real(xc + w),
        )

    real, in_l, out_l = lower_complex(make_fx(fn)(x, w))
    got = join_outputs(list(real(*split_inputs([x, w], in_l))), out_l)
    for g, want in zip(got, fn(x, w)):
        assert g.shape == want.shape
        torch.testing.assert_close(g, want)


def test_real_valued_complex_plus_an_imaginary_number_is_a_tensor() -> None:
    # x.to(c64) + 1j had the number 1.0 as its imaginary part, and the next rule applied a
    # tensor op to it: sum() and exp() raised (RuntimeError / BackendCompilerFailed)
    x = torch.tensor([2.0, -0.5, 0.0])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xc = x.to(torch.complex64)
        return (xc + 1j).sum(), (xc - 2j).exp(), (1j + xc).imag, xc.add(1j, alpha=2).sum(0)

    got = _run_lowered_all(fn, x)
    for g, want in zip(got, fn(x)):
        assert g.shape == want.shape
        torch.testing.assert_close(g, want)


def _run_lowered_all(fn: Callable[..., object], *args: torch.Tensor) -> list[torch.Tensor]:
    real, in_l, out_l = lower_complex(make_fx(fn)(*args))
    return join_outputs(list(real(*split_inputs(list(args), in_l))), out_l)


def _close_with_signs(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values with equal signs of zero, NaN matching NaN (real or complex tensors)."""
    g = torch.view_as_real(got) if got.is_complex() else got
    w = torch.view_as_real(want) if want.is_complex() else want
    close = torch.isclose(g, w, rtol=1e-6, atol=0.0, equal_nan=True)
    return bool((close & ((torch.signbit(g) == torch.signbit(w)) | w.isnan())).all())


_CUT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "log": torch.log,
    "sqrt": torch.sqrt,
    "angle": torch.angle,
    "asin": torch.asin,
    "acos": torch.acos,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "pow_half": lambda z: z**0.5,
}


@pytest.mark.parametrize("name", sorted(_CUT_FNS))
def test_conjugated_real_valued_complex_keeps_its_side_of_the_branch_cut(name: str) -> None:
    # conj(x.to(c64)) has imaginary part -0: log/sqrt/angle/asin/... read it as +0 and returned
    # the conjugate of eager's value at x < 0 (log|x| + πi for log|x| - πi), silently
    f = _CUT_FNS[name]
    x = torch.tensor([-2.0, -0.0, 0.0, 2.0])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xc = x.to(torch.complex64)
        physical, lazy = torch.conj_physical(xc), torch.conj(xc).clone()
        picked = torch.where(x < 0, physical, xc)  # -0 where x < 0, +0 elsewhere
        padded = torch.nn.functional.pad(physical, (1, 0), value=3.0)
        return f(physical), f(lazy), f(picked), f(padded)

    got = _run_lowered_all(fn, x)
    for i, (g, want) in enumerate(zip(got, fn(x))):
        assert _close_with_signs(g, want), (name, i, g, want)


def test_where_and_scatter_of_signed_known_zeros_keep_shape_dtype_and_sign() -> None:
    # where() between two known-zero imaginary parts of different signs made them from two
    # Python scalars: a float32 part shaped like the condition (a broadcast condition failed
    # at run time, complex128 failed in the FFT fallback); a scatter of two known zeros
    # dropped their sign (log of it then on the wrong side of the cut)
    x = torch.tensor([[-2.0, -0.0, 0.0, 2.0]] * 3, dtype=torch.float64)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xc = x.to(torch.complex128)
        picked = torch.where(x[0] < 0, torch.conj_physical(xc), xc)  # broadcast condition
        spread = torch.fft.fft(torch.where(x < 0, torch.conj_physical(xc), xc))
        scattered = torch.select_scatter(torch.conj_physical(xc), xc[0] * 0 - 1, 0, 0)
        return picked * 2, spread, torch.log(scattered)

    for got in (
        _run_lowered_all(fn, x),
        torchport.compile(fn, inner="eager", batching=False)(x),
    ):
        for i, (g, want) in enumerate(zip(got, fn(x))):
            assert g.shape == want.shape and g.dtype == want.dtype, i
            assert _close_with_signs(g, want), (i, g, want)


def test_view_of_a_broadcast_complex_value_reshapes_its_parts() -> None:
    # complex(a[3], b[5, 3]) and x.to(c64) + w[3] have parts expanded with stride 0 (the complex
    # value itself is dense): view(-1) of a part raised (RuntimeError, and BackendCompilerFailed
    # through compile) where eager's view of the dense value is fine
    torch.manual_seed(0)
    a, b, x = torch.randn(3), torch.randn(5, 3), torch.randn(5, 3)
    w = torch.randn(3, dtype=torch.complex64)

    def fn(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple:
        z, s = torch.complex(a, b), x.to(torch.complex64) + w
        return z.view(-1), z.reshape(15) * 2, s.view(-1), s.flatten().exp(), s.view(3, 5).sum(0)

    args = (a, b, x, w)
    for got in (
        _run_lowered_all(fn, *args),
        torchport.compile(fn, inner="eager", batching=False)(*args),
    ):
        for g, want in zip(got, fn(*args)):
            assert g.shape == want.shape
            torch.testing.assert_close(g, want)


def test_broadcast_add_sub_adds_no_expand_where_parts_have_the_result_shape() -> None:
    # z[5, 3] + w[3] has both parts of shape [5, 3] already (each the sum of two tensors), yet
    # the parts were broadcast again: broadcast_tensors and two getitems, 3 nodes became 6
    z, w = torch.randn(5, 3, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)
    r, c, x = torch.randn(3), torch.randn(5, 1), torch.randn(1, 3)
    counts = {
        (lambda z, w: z + w, (z, w)): 3,  # add, add, stack
        (lambda z, w: w - z, (z, w)): 3,
        (lambda z, r: z + r, (z, r)): 2,  # the imaginary part is z's: [5, 3] already
        (lambda z, r: torch.rsub(z, r), (z, r)): 3,  # r - Re z, 0 - Im z
    }
    for (fn, args), want in counts.items():
        gm, _, _ = lower_complex(make_fx(fn)(*args))
        assert sum(nd.op == "call_function" for nd in gm.graph.nodes) == want
        (got,) = _run_lowered_all(fn, *args)
        torch.testing.assert_close(got, fn(*args))

    def mixed(c: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # a part only one operand of another shape gives still takes the result's shape
        cc = c.to(torch.complex64)
        return cc + w, w - cc, cc + x, x.to(torch.complex64) - cc * 1j, (cc + w).sum()

    for g, want in zip(_run_lowered_all(mixed, c, x, w), mixed(c, x, w)):
        assert g.shape == want.shape
        torch.testing.assert_close(g, want)


def test_exp_of_a_conjugated_real_valued_complex_keeps_the_zeros_sign() -> None:
    # exp(x - 0i) is e^x - 0i in eager; the lowering made it + 0i, so log(-exp(conj(x))) was
    # log e^x - πi where eager has + πi (tanh likewise dropped the sign)
    x = torch.tensor([-2.0, -0.0, 0.0, 2.0, math.inf, -math.inf, math.nan])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = torch.conj_physical(x.to(torch.complex64))
        plain = x.to(torch.complex64)
        return torch.exp(c), torch.log(-torch.exp(c)), torch.exp(plain), torch.tanh(c)

    for g, want in zip(_run_lowered_all(fn, x), fn(x)):
        assert _close_with_signs(g, want), (g, want)
