"""Complex compilation against eager where review 47 found them apart: a number raised to a
complex tensor, addmm with beta = 0, real exponents at infinite parts and at 0, and a dynamic
spec's relaxed fallback served at size 0 after size 1."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport import STATIC, ShapesSpec, ShapeVar, TensorSpec
from torchport.compiler.complex import join_outputs, lower_complex, split_inputs

INF, NAN = math.inf, math.nan


def _lowered(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``fn`` traced, lowered to real ops and run (no dynamo: fast)."""
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)[0]


def _mismatches(got: torch.Tensor, want: torch.Tensor, rtol: float) -> list[int]:
    """Flat indices where a part differs beyond ``rtol``, in the sign of a zero, or in NaN-ness."""
    g, w = torch.view_as_real(got).double(), torch.view_as_real(want).double()
    close = (g == w) | ((g - w).abs() <= rtol * w.abs())
    same = (close & ((torch.signbit(g) == torch.signbit(w)) | (w != 0))) | (g.isnan() & w.isnan())
    return torch.nonzero(~same.all(-1).flatten()).flatten().tolist()


# finite values, signed zeros, large parts, infinities and NaNs; an exponent whose product with
# log(base) is NaN + NaN i (inf + inf i, 1 + NaN i) is left out: there C's complex multiply
# recovers infinities (Annex G), which the compiled product does not (README)
_Z = [1 + 2j, -0.5 + 0.25j, 0j, complex(0, -0.0), 3 + 0j, -3 + 0j, 2.5j, 1e-3 + 1e-3j]
_Z += [40 + 3j, 100 - 1j, -100 + 0j, complex(INF, 0), complex(-INF, 0), complex(0, INF)]
_Z += [complex(1, INF), complex(NAN, 0)]
_BASES = [2, 3.0, -2, -0.5, 0, 0.0, -0.0, 1, 1.0, 1 + 0j, 1 + 1j, -1j, complex(2, -0.0), 0j]
_BASES += [1e30, 2**40, 1e-30, 0.1, True]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_number_base_to_a_complex_power_matches_eager(dtype: torch.dtype) -> None:
    # the rule took the tensor path and emitted torch.abs(2) / torch.hypot(1., 1.) on numbers
    z = torch.tensor(_Z, dtype=dtype)

    def powers(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.pow(b, w) for b in _BASES])

    got, want = _lowered(powers, z), powers(z)
    rtol = 4e-6 if dtype == torch.complex64 else 1e-14
    bad = _mismatches(got, want, rtol)
    where = [(_BASES[i // len(_Z)], _Z[i % len(_Z)]) for i in bad]
    assert not bad, f"(base, z) apart from eager: {where}"


def test_number_base_to_a_real_tensor_power_is_complex_as_eager() -> None:
    x = torch.tensor([0.5, -2.0, 0.0, 3.0])
    k = torch.tensor([0, 1, -2, 3])

    def powers(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.pow(1 + 1j, x), torch.pow(-1j, k), torch.pow(1 + 0j, k)

    gm = make_fx(powers)(x, k)
    real, in_l, out_l = lower_complex(gm)
    got = join_outputs(list(real(*split_inputs([x, k], in_l))), out_l)
    for g, w in zip(got, powers(x, k)):
        assert g.dtype == w.dtype
        assert not _mismatches(g, w, 4e-6), (g, w)


def test_number_base_pow_compiles_with_inductor() -> None:
    z = torch.tensor([1 + 2j, -0.5 + 0.25j, 0j], dtype=torch.complex64)

    def f(w: torch.Tensor) -> torch.Tensor:
        return 2**w + (1 + 1j) ** w + torch.pow(3.0, w)

    torch._dynamo.reset()
    got = torchport.compile(f, inner="inductor")(z)
    torch.testing.assert_close(got, f(z), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0, 0.0, 0j], ids=["int", "float", "complex"])
def test_addmm_with_beta_zero_ignores_input(beta: complex) -> None:
    # torch: "If beta is 0, then input will be ignored, and nan and inf in it will not be
    # propagated"; 0·(NaN + inf i) made every element NaN
    torch.manual_seed(0)
    c = torch.full((2, 2), complex(NAN, INF), dtype=torch.complex64)
    a, b = torch.randn(2, 3, dtype=torch.complex64), torch.randn(3, 2, dtype=torch.complex64)

    def f(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, a, b, beta=beta, alpha=2)

    got, want = _lowered(f, c, a, b), f(c, a, b)
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_real_exponents_take_the_promoted_product(dtype: torch.dtype) -> None:
    # std::pow(z, p + 0i): the +0 takes part in p·log z, so z ** 4 at 1 + inf i is inf + NaN i
    # (inf + inf i compiled), and 0 ** 4 is 0 - 0i (the NaN of -inf·0 gives its sign); at
    # inf + NaN i C's multiply recovers the real part (z ** -3 is 0 - 0i there, not NaN)
    vals = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1e-3, INF, -INF, NAN, 1e300]
    z = torch.tensor([complex(a, b) for a in vals for b in vals], dtype=dtype)
    ps = [4.0, 4, 2.5, -2.5, -3, 7, -7, 0.25, 1e300, -1e300]

    def powers(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([w**p for p in ps])

    got, want = _lowered(powers, z), powers(z)
    bad = _mismatches(got, want, 4e-6 if dtype == torch.complex64 else 1e-13)
    where = [(ps[i // len(z)], z[i % len(z)].item()) for i in bad]
    assert not bad, f"(p, z) apart from eager: {where[:10]}"


def test_exp_at_minus_inf_keeps_the_sign_of_a_nan_imaginary_part() -> None:
    nan = torch.tensor([NAN, -NAN])
    z = torch.complex(torch.full((2,), -INF), nan)
    got, want = _lowered(torch.exp, z), torch.exp(z)
    assert torch.equal(torch.signbit(want.imag), torch.tensor([False, True]))
    assert not _mismatches(got, want, 0.0)


def test_spec_fallback_is_not_served_at_sizes_it_was_not_traced_for() -> None:
    # prod's backward guards size != 1, so the spec falls back to unenforced marks; the graph
    # then traced size-obliviously decided numel != 0 without a guard and, once a size-1 call
    # had gone through the compiled path, served size 0 ([2, 1] gradient for a [2, 0] input)
    def f(z: torch.Tensor) -> torch.Tensor:
        return z.prod(-1).abs().sum()

    spec = ShapesSpec({"z": TensorSpec([STATIC, ShapeVar("B", max=64)])})
    torch._dynamo.reset()
    g = torchport.compile(f, inner="eager", batching=False, dynamic_shapes=spec)
    for n in (5, 1, 0, 3, 0):
        z = torch.randn(2, n, dtype=torch.complex64, requires_grad=True)
        ref = z.detach().clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torchport.compile: the function specialises")
            g(z).backward()
        f(ref).backward()
        assert z.grad is not None and ref.grad is not None
        torch.testing.assert_close(z.grad, ref.grad, rtol=1e-4, atol=1e-5, msg=f"B={n}")
