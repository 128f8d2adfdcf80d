"""Complex decomposition rules: matrix products, the inverse (``linalg_inv_ex``) and the FFTs."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from torchport.compiler.complex_base import (
    Pair,
    Rule,
    _Emitter,
    _is_complex_val,
    _node_val,
    _packets,
    _pair,
    aten,
    c_add,
    c_mul,
    registrar,
)

RULES: dict[Any, Rule] = {}
_rule = registrar(RULES)


def c_matmul(e: _Emitter, mm: Callable[..., Any], a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)

    def prod(x: Any, y: Any) -> Any:
        return None if x is None or y is None else e.call(mm, x, y)

    return Pair(
        e.sub(prod(pa.re, pb.re), prod(pa.im, pb.im)), e.add(prod(pa.re, pb.im), prod(pa.im, pb.re))
    )


@_rule(aten.linalg_inv_ex.default)
def _r_inv_ex(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # (A + iB)^-1 = X + iY from the real 2n x 2n matrix whose 2x2 block (i, j) is
    # [[a, -b], [b, a]] for the entry a + ib: its inverse has the same structure, with X and Y in
    # the first column of each block. The blocks interleave (rather than [[A, -B], [B, A]]) for
    # the info: partial-pivoted LU meets its first zero pivot at the first column in the span of
    # those before it; the real span of columns 1..2k is the complex span of columns 1..k, and a
    # column i·c_k never is the first dependent one, so torch's info k (the complex LU's first
    # zero pivot) is (real info + 1) / 2 in exact arithmetic.
    e, p = lw.e, _pair(a[0])
    if p.im is None:
        res = e.call(aten.linalg_inv_ex.default, p.re, **kw)
        return (Pair(e.call(operator.getitem, res, 0), None), e.call(operator.getitem, res, 1))
    re, im = p.re, p.im
    rows = (e.call(torch.stack, [re, e.neg(im)], -1), e.call(torch.stack, [im, re], -1))
    blocks = e.call(torch.stack, list(rows), -3)  # [..., i, r, j, c]
    m = e.call(torch.flatten, e.call(torch.flatten, blocks, -2, -1), -3, -2)
    res = e.call(aten.linalg_inv_ex.default, m, **kw)
    inv, info = e.call(operator.getitem, res, 0), e.call(operator.getitem, res, 1)
    inv = e.call(torch.unflatten, e.call(torch.unflatten, inv, -1, (-1, 2)), -3, (-1, 2))
    first_col = e.call(torch.select, inv, -1, 0)  # [..., i, r, j]
    x, y = e.call(torch.select, first_col, -2, 0), e.call(torch.select, first_col, -2, 1)
    info = e.call(torch.div, e.add(info, 1), 2, rounding_mode="floor")
    return (Pair(x, y), info)


@_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _r_mm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    assert callable(n.target)
    return c_matmul(lw.e, n.target, a[0], a[1])  # four real products


@_rule(aten.addmm.default)
def _r_addmm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    prod = c_matmul(e, aten.mm.default, a[1], a[2])
    # The scalars from the node: a complex number was mapped to a Pair in ``kw``.
    alpha, beta = n.kwargs.get("alpha", 1), n.kwargs.get("beta", 1)
    if _is_zero(alpha):
        # alpha = 0 ignores the product, as eager (BLAS's rule: NaN and inf in the matrices are
        # not propagated; 0·NaN was NaN); only its shape is kept, for the bias to broadcast to
        zero = e.call(torch.zeros_like, _pair(prod).re)
        prod = Pair(zero, zero)  # (both parts: c_add takes a missing part's shape from the other)
    else:
        prod = c_mul(e, prod, kw.get("alpha", 1))
    if _is_zero(beta):
        return prod  # beta = 0 ignores the bias the same way
    return c_add(e, c_mul(e, a[0], kw.get("beta", 1)), prod)  # beta*bias + alpha*A@B


def _is_zero(scalar: Any) -> bool:
    return isinstance(scalar, (int, float, complex)) and scalar == 0


@_rule(*_packets("_fft_c2c", "_fft_r2c", "_fft_c2r"))
def _r_fft(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # The FFT itself stays ATen's, on a complex tensor rebuilt from the parts, its result split
    # again: in real ops a DFT is a dense O(n²) matmul (slower and less accurate than pocketfft/
    # MKL) or a radix FFT written from slices; Inductor has no FFT code generation and calls
    # ATen's anyway (warning that it does not generate code for complex operators). The rest
    # of the graph is still decomposed, and the FFTs of the backward graph take this rule too.
    e = lw.e

    def whole(x: Any) -> Any:
        if not isinstance(x, Pair):
            return x
        return e.call(torch.complex, x.re, e.dense_im(x, x.re))

    out = e.call(n.target, *(whole(x) for x in a), **kw)
    if _is_complex_val(_node_val(n)):
        return Pair(e.call(torch.real, out), e.call(torch.imag, out))
    return out
