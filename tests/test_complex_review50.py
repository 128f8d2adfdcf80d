"""Complex compilation at special values: ``z ** w`` takes C's complex product of w and log z
(C99 Annex G, as glibc's cpow), and a division multiplies by the reciprocal of its denominator
(as ATen's), each compared with eager value by value (NaN equal to NaN, signs of zeros and
infinities compared)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport.compiler.complex import join_outputs, lower_complex, split_inputs
from torchport.compiler.complex_base import Pair, _Emitter, c_mul_c99, c_mul_c99_reference

_NAN, _INF = math.nan, math.inf
_PARTS = (0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1e30, _INF, -_INF, _NAN)
_EXP_PARTS = (0.0, -0.0, 1.0, -1.0, 3.0, -2.0, 0.5, 1e38, _INF, -_INF, _NAN)


def _lowered(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)[0]


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """Indices where ``got`` and ``want`` differ: NaN against a number, a zero or an infinity of
    another sign, or finite values off by more than a relative 1e-5 (1e-12 in complex128)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = torch.view_as_real(got).reshape(-1, 2), torch.view_as_real(want).reshape(-1, 2)
    tol = 1e-5 if got.dtype == torch.complex64 else 1e-12
    exact = (w == 0) | w.isinf()
    close = torch.where(
        exact, (g == w) & (g.signbit() == w.signbit()), torch.isclose(g, w, rtol=tol, atol=0.0)
    )
    ok = (g.isnan() & w.isnan()) | (~g.isnan() & ~w.isnan() & close)
    return torch.nonzero(~ok.all(-1)).flatten().tolist()


def _report(bad: list[int], got: torch.Tensor, want: torch.Tensor, *ops: torch.Tensor) -> str:
    rows = [f"{[o[i].item() for o in ops]}: {got[i].item()} != {want[i].item()}" for i in bad]
    return f"{len(bad)} of {got.numel()} differ; " + "; ".join(rows[:6])


def _grid(values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([complex(a, b) for a in values for b in values], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_pow_of_tensors_at_special_values_matches_eager(dtype: torch.dtype) -> None:
    # where w·log z was NaN + NaN i the compiled power was NaN + NaN i; eager's (glibc's cpow)
    # product recovers infinities: 0 ** (3 + NaN i) is 0 - 0i, 2 ** (inf - inf i) inf + NaN i,
    # (1e30 + 0i) ** (1e38 + NaN i) inf + NaN i in complex64 (a partial product overflowed). A
    # real exponent tensor is promoted (w + 0i): 0 ** 0. is NaN + NaN i there, as eager
    # (1e38 overflows a partial product in complex64 only; in complex128 it is a finite exponent
    # whose e^(w log z) has sin and cos of ~1e38, where libm and torch.sin may differ in sign)
    exp_parts = _EXP_PARTS if dtype == torch.complex64 else _EXP_PARTS[:7] + _EXP_PARTS[8:]
    z, w = _grid(_PARTS, dtype), _grid(exp_parts, dtype)
    zz, ww = z.repeat_interleave(len(w)), w.repeat(len(z))
    real_w = torch.tensor(exp_parts, dtype=dtype.to_real())
    cases = [
        (zz, ww),  # complex ** complex
        (z.repeat_interleave(len(real_w)), real_w.repeat(len(z))),  # complex ** real tensor
        (
            torch.tensor(_PARTS, dtype=dtype.to_real()).repeat_interleave(len(w)),
            w.repeat(len(_PARTS)),
        ),
    ]
    for base, exponent in cases:
        got, want = _lowered(torch.pow, base, exponent), torch.pow(base, exponent)
        bad = _mismatches(got, want)
        assert not bad, _report(bad, got, want, base, exponent)


@pytest.mark.parametrize("base", [0, 0.0, 2, -1, 1j, -2.5], ids=repr)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_number_to_a_complex_power_at_special_values_matches_eager(
    base: complex, dtype: torch.dtype
) -> None:
    # 2 ** (inf + inf i) is inf + NaN i and 0 ** (1 + NaN i) is 0 - 0i in eager; both were NaN
    w = _grid(_EXP_PARTS, dtype)

    def power(t: torch.Tensor) -> torch.Tensor:
        return torch.pow(base, t)

    got, want = _lowered(power, w), power(w)
    bad = _mismatches(got, want)
    assert not bad, _report(bad, got, want, w)


def test_pow_at_special_values_under_torchport_compile() -> None:
    z = torch.tensor([0j, complex(-0.0, 0.0), 2j, complex(_INF, 1.0), complex(1e30, 0.0), 1 + 1j])
    w_re = [3, -_INF, _NAN, 3, 1e38, _INF]
    w_im = [_NAN, _NAN, -_INF, _NAN, _NAN, -_INF]
    w = torch.complex(torch.tensor(w_re), torch.tensor(w_im))

    def power(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a**b

    got, want = torchport.compile(power)(z, w), power(z, w)
    assert not want.isnan().all(), want  # the cases have eager values other than NaN + NaN i
    bad = _mismatches(got, want)
    assert not bad, _report(bad, got, want, z, w)


def _c99_product_graph() -> fx.GraphModule:
    g = fx.Graph()
    p, q, r, s = (g.placeholder(name) for name in "pqrs")
    out = c_mul_c99(_Emitter(g), Pair(p, q), Pair(r, s))
    g.output((out.re, out.im))
    return fx.GraphModule(torch.nn.Module(), g)


def test_c99_product_matches_the_libgcc_reference() -> None:
    # every combination of parts: zeros of both signs, infinities, NaN, and products that
    # overflow (3e200 · 3e200) or underflow
    vals = (0.0, -0.0, 1.0, -2.0, 3e200, -3e200, 1e-300, _INF, -_INF, _NAN)
    combos = list(itertools.product(vals, repeat=4))
    cols = [torch.tensor(c, dtype=torch.float64) for c in zip(*combos)]
    re, im = _c99_product_graph()(*cols)
    got = torch.complex(re, im)
    want = torch.tensor(
        [c_mul_c99_reference(complex(p, q), complex(r, s)) for p, q, r, s in combos],
        dtype=torch.complex128,
    )
    bad = _mismatches(got, want)
    assert not bad, _report(bad, got, want, *cols)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_division_multiplies_by_the_reciprocal_of_the_denominator(dtype: torch.dtype) -> None:
    # ATen's complex division (Smith's) takes 1/den and multiplies; where 1/den overflows (a
    # denominator below ~3e-39 in complex64, a subnormal in complex128) 0/(tiny i) is NaN + NaN i
    # and 1/(tiny + 0i) is inf + NaN i there. Divided by den, the compiled ones were 0 and inf + 0i
    tiny = 1e-40 if dtype == torch.complex64 else 1e-310
    z, w = _grid((0.0, -0.0, 1.0, -2.5, _INF, _NAN), dtype), _grid((tiny, -tiny, 0.0, 2.0), dtype)
    zz, ww = z.repeat_interleave(len(w)), w.repeat(len(z))
    for fn, args in ((torch.div, (zz, ww)), (torch.reciprocal, (z,)), (torch.rsqrt, (z,))):
        got, want = _lowered(fn, *args), fn(*args)
        # (no tiny numerator part: eager's kernel fuses a * b + c into an FMA, and where a
        # product of two tiny parts underflows to a zero its sign differs from the graph's)
        bad = _mismatches(got, want)
        assert not bad, _report(bad, got, want, *args)
    assert _lowered(torch.div, zz, ww).isnan().any()  # the overflowing reciprocal is reached
