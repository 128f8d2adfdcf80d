"""Complex compilation: ``addmm`` with ``alpha = 0`` ignores the matrix product, as eager."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport.compiler.complex import join_outputs, lower_complex, split_inputs


def _lowered(fn, *args: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)[0]


def _operands(bias_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    c = torch.randn(bias_shape, dtype=torch.complex64)
    a, b = torch.randn(3, 4, dtype=torch.complex64), torch.randn(4, 2, dtype=torch.complex64)
    a[0, 1] = complex(math.nan, 0)  # a NaN and an infinity in the product's operands
    b[2, 0] = complex(0, math.inf)
    return c, a, b


@pytest.mark.parametrize("alpha", [0, 0.0, 0j], ids=["int", "float", "complex"])
@pytest.mark.parametrize("beta", [1, 2.5, -1j, 0], ids=["one", "real", "imag", "zero"])
@pytest.mark.parametrize("bias_shape", [(3, 2), (2,), (1, 2), (3, 1)], ids=str)
def test_addmm_with_alpha_zero_ignores_the_product(
    alpha: complex, beta: complex, bias_shape: tuple[int, ...]
) -> None:
    # torch's addmm, as BLAS: with alpha = 0 the product's NaN and inf are not propagated
    # (the compiled product was multiplied by 0, which made NaN rows and columns)
    c, a, b = _operands(bias_shape)

    def f(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)

    want = f(c, a, b)
    assert want.shape == (3, 2) and want.isfinite().all()
    got = _lowered(f, c, a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_addmm_with_alpha_zero_under_torchport_compile() -> None:
    c, a, b = _operands((3, 2))

    def f(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, a, b, alpha=0, beta=2) * 1j

    got = torchport.compile(f)(c, a, b)
    torch.testing.assert_close(got, f(c, a, b), rtol=1e-6, atol=1e-6)
