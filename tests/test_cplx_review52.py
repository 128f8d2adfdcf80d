"""Review 52: complex compilation of dtype views, of non-dense inputs saved for the backward, of
sin/cos/sinh/cosh beyond the exponential's overflow, and of nansum; a spec'd export that needs
only Dims.

- ``Tensor.view(dtype)`` between complex and real dtypes is a bitcast: complex64 [2, 3] viewed as
  float32 is [2, 6], real and imaginary parts interleaved (it was applied to each part: complex64
  [2, 3], and values downstream were wrong); a real tensor viewed as complex raised.
- With Inductor and grad, a non-dense complex input (``z[::2]``, an expanded row) saved for the
  backward reached it laid out afresh, not as traced: the backward's stride check failed.
- Complex sin/cos/sinh/cosh take e^|y| shifted, as C's csin and ccosh do, where cosh y overflows
  but its product with sin x or cos x does not (sin(89i) in complex64 is 2.24e38i, it was inf·i).
- ``torch.nansum`` / ``torch.nanmean`` of a complex tensor raise in eager; compiled they summed.
- ``torchport.export`` with a spec of Dims only (no assumptions) refused a slice that plain
  ``torch.export`` accepts (``m[: x.shape[0]]`` with m [2*B+1]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport import STATIC, ShapesSpec, ShapeVar, TensorSpec
from torchport.compiler.complex import join_outputs, lower_complex, split_inputs
from torchport.compiler.complex_base import ComplexDecompositionError


def _lowered(fn: Callable[..., Any], *args: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` traced to aten ops, lowered to a real graph and run (no Dynamo: cheap)."""
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in its logical order (a bitcast compares bit for bit)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return (dense.reshape(1) if dense.dim() == 0 else dense).view(torch.uint8)


def _example(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -100, 100, shape, generator=gen).to(dtype)


_c64, _c128 = torch.complex64, torch.complex128


@pytest.mark.parametrize(
    ("src", "dst", "shape"),
    [
        (_c64, torch.float32, (2, 3)),  # interleaved, twice the last size
        (_c64, torch.float64, (2, 3)),  # one complex element is one float64
        (_c64, torch.float16, (2, 3)),
        (_c128, torch.float32, (2, 3)),
        (_c128, torch.int64, (3,)),
        (_c64, _c128, (2, 4)),
        (_c128, _c64, (2, 3)),
        (torch.float32, _c64, (2, 6)),
        (torch.int64, _c64, (3, 4)),
        (torch.float16, _c128, (2, 8)),
        (torch.uint8, _c64, (2, 16)),
        (_c64, torch.float64, ()),  # 0-d: the same element size only
        (torch.float64, _c64, ()),
        (_c64, torch.float32, (0, 3)),
    ],
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, tuple) else f"{v}",
)
def test_view_dtype_between_complex_and_real_is_a_bitcast(
    src: torch.dtype, dst: torch.dtype, shape: tuple[int, ...]
) -> None:
    x = _example(src, shape)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (x * 1).view(dst)
        return y, y + 1

    got = _lowered(fn, x)
    want = fn(x)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    assert torch.equal(_bits(got[0]), _bits(want[0]))  # bit for bit
    torch.testing.assert_close(got[1], want[1], equal_nan=True, rtol=0, atol=0)


def test_view_dtype_compiled_matches_eager_and_refuses_what_eager_refuses() -> None:
    # the review's repro: a sum over the interleaved parts was a sum of the parts' own views
    z = torch.randn(2, 3, dtype=_c64, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))

    def fn(z: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        r = (z * 2).view(torch.float32)  # float32 [2, 6]
        c = x.view(torch.complex64) * (1 + 1j)  # complex64 [3, 4]
        back = torch.view_as_complex(torch.view_as_real(c).flip(-1))  # the parts swapped
        return r, r.sum(-1).abs(), c, back

    torch._dynamo.reset()
    got = torchport.compile(fn, inner="eager", batching=False)(z, x)
    want = fn(z, x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)
    # a last dim of stride 2: eager refuses, and so does the trace (before any lowering)
    with pytest.raises(RuntimeError, match=r"stride\(-1\) must be 1 to view ComplexFloat as Float"):
        torch._dynamo.reset()
        torchport.compile(lambda z: z[:, ::2].view(torch.float32), inner="eager", batching=False)(z)


def test_non_dense_complex_inputs_saved_for_the_backward_under_inductor() -> None:
    # z[::2] (row stride 12) and an expanded row (stride 0) are saved for the backward of the
    # products; the forward's joined outputs reached the backward contiguous, whose Inductor
    # code checked the traced strides: "expected size 3==3, stride 12==24 at dim=0"
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, 6, dtype=_c64, generator=gen)
    w = torch.randn(6, 6, dtype=_c64, generator=gen)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * a.conj() + a * b

    def leaves() -> tuple[torch.Tensor, torch.Tensor]:
        zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
        return zz, ww

    torch._dynamo.reset()
    compiled = torchport.compile(fn, inner="inductor", batching=False)
    results = []
    for run in (compiled, fn):
        zz, ww = leaves()
        a, b = zz[::2], ww[:1].expand(3, 6)
        out = run(a, b)
        out.abs().sum().backward()
        results.append((out.detach(), zz.grad, ww.grad))
    for g, w_ in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(g, w_)


def _grid(dtype: torch.dtype) -> torch.Tensor:
    """x + iy around the overflow of e^|y| (t = 88 for complex64, 709 for complex128; twice and
    three times t), with signed zeros, a subnormal x, infinities and NaN."""
    res = [0.0, -0.0, 1e-45, 1e-310, 1e-30, 0.5, -2.5, math.pi / 2, 100.0, math.inf, math.nan]
    ims = [0.0, 1.0, 87.9, 88.0, 88.5, 89.0, 89.5, 100.0, 176.5, 180.0, 265.0, 300.0]
    ims += [708.0, 709.5, 710.0, 711.0, 1420.0, 1500.0, 2200.0, math.inf, math.nan]
    ims += [-v for v in ims]
    return torch.tensor([complex(a, b) for a in res for b in ims], dtype=dtype)


@pytest.mark.parametrize("dtype", [_c64, _c128], ids=["complex64", "complex128"])
def test_sin_cos_sinh_cosh_beyond_the_exponential_overflow(dtype: torch.dtype) -> None:
    z = _grid(dtype)

    def fn(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        iz = z * 1j
        return torch.sin(z), torch.cos(z), torch.sinh(iz), torch.cosh(iz)

    got = _lowered(fn, z)
    want = fn(z)
    # sin(89i) in complex64 is 2.24e38i (finite: sinh 89 < float max); it was inf·i
    if dtype == _c64:
        assert got[0][z.tolist().index(89j)].imag.item() == pytest.approx(2.2448064e38, rel=1e-6)
    rtol = 4e-7 if dtype == _c64 else 1e-15
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=0, equal_nan=True)


def test_nansum_of_a_complex_tensor_is_refused_as_in_eager() -> None:
    z = torch.randn(4, 3, dtype=_c64, generator=torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="nansum on CPU does not support complex inputs"):
        torch.nansum(z)
    for fn in (lambda z: torch.nansum(z * 1, 0), lambda z: torch.nanmean(z * 1)):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match=r"nansum.*need a real input and a real dtype"):
            torchport.compile(fn, inner="eager", batching=False)(z)
    # a real nansum in a complex graph still computes
    z.real[0, 0] = math.nan

    def real_nansum(z: torch.Tensor) -> torch.Tensor:
        return z * torch.nansum(z.real, 0) + torch.nanmean(z.imag)

    torch._dynamo.reset()
    got = torchport.compile(real_nansum, inner="eager", batching=False)(z)
    torch.testing.assert_close(got, real_nansum(z), equal_nan=True)
    # the lowering names the op where the graph holds it
    gm = make_fx(torch.nansum, tracing_mode="fake")(z)
    with pytest.raises(ComplexDecompositionError, match=r"aten\.nansum\.default .*complex64"):
        lower_complex(gm)


def _readme_fn(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.sum(-1) * 2 + m[: x.shape[0], None]


class _ReadmeModule(torch.nn.Module):
    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _readme_fn(x, m)


@pytest.mark.parametrize("as_module", [False, True], ids=["function", "module"])
def test_export_with_a_dims_only_spec_takes_a_slice_plain_export_takes(as_module: bool) -> None:
    # no assumptions: the Dims-only path exported without deferred runtime asserts, and under
    # size-oblivious sizes the guard B == min(B, 2*B + 1) was refused ("Constraints violated")
    B, T = ShapeVar("B", max=64), ShapeVar("T", min=2, max=512)
    spec = ShapesSpec({"x": TensorSpec([B, T, STATIC]), "m": TensorSpec([2 * B + 1])})
    target: Any = _ReadmeModule() if as_module else _readme_fn
    ep = torchport.export(target, (torch.randn(3, 8, 4), torch.randn(7)), dynamic_shapes=spec)
    for b in (0, 1, 5):
        x, m = torch.randn(b, 8, 4), torch.randn(2 * b + 1)
        torch.testing.assert_close(ep.module()(x, m), _readme_fn(x, m))
    with pytest.raises(AssertionError, match=r"Guard failed: .*size\(\)\[0\] == 1 \+ 2"):
        ep.module()(torch.randn(2, 8, 4), torch.randn(6))
