"""Complex decomposition rules: products, scans and norms (prod/cumprod, logcumsumexp, vector
norms). The linear reductions (sum, mean, cumsum, trace) apply to each part alike and are in
:mod:`~torchport.compiler.complex_shape` with the shape ops.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from torchport.compiler.complex_base import (
    Pair,
    Rule,
    _Emitter,
    _node_val,
    _pair,
    aten,
    c_abs,
    c_angle,
    registrar,
)

RULES: dict[Any, Rule] = {}
_rule = registrar(RULES)


def _cast_parts(lw: Any, n: fx.Node, p: Pair, kw: dict[str, Any]) -> Pair:
    """The parts in the real dtype of a requested complex ``dtype=`` (ATen casts the input)."""
    if kw.get("dtype") is None:
        return p
    rdt = _node_val(n).dtype.to_real()
    return Pair(*(None if x is None else lw.e.call(torch.Tensor.to, x, rdt) for x in (p.re, p.im)))


@_rule(aten.logcumsumexp.default)
def _r_logcumsumexp(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # log Σ_{j≤k} e^(x_j) (cos y_j + i sin y_j): each of the four signed sums Σ e^(x_j) c_j over
    # the terms with c_j = ±cos y_j > 0 (±sin y_j > 0) is a real logcumsumexp of x_j + log c_j,
    # which never overflows; their difference is taken after shifting all four by their
    # maximum m_k, and log S_k = m_k + log|S_k e^-m_k| + i arg S_k. (cumsum(exp(z - max)) with one
    # shift per slice underflowed the terms far below the maximum: log 0 = -inf.)
    e, p = lw.e, _pair(a[0])
    dim = a[1] if len(a) > 1 else kw["dim"]
    if p.im is None:
        return Pair(e.call(aten.logcumsumexp.default, p.re, dim), None)
    x = p.re

    def signed_sums(f: Any) -> tuple[Any, Any]:
        sums = []
        for sel, mag in ((e.call(torch.gt, f, 0), f), (e.call(torch.lt, f, 0), e.neg(f))):
            log_mag = e.f(torch.log, e.call(torch.where, sel, mag, 1.0))  # no log 0 unselected
            terms = e.call(torch.where, sel, e.add(x, log_mag), -math.inf)
            sums.append(e.call(aten.logcumsumexp.default, terms, dim))
        return sums[0], sums[1]

    cos_p, cos_n = signed_sums(e.f(torch.cos, p.im))
    sin_p, sin_n = signed_sums(e.f(torch.sin, p.im))
    m = e.f(torch.maximum, e.f(torch.maximum, cos_p, cos_n), e.f(torch.maximum, sin_p, sin_n))
    m = e.call(torch.where, e.f(torch.isinf, m), 0.0, m)  # all terms -inf (or one +inf): no shift

    def shifted(u: Any, v: Any) -> Any:
        return e.sub(e.f(torch.exp, e.sub(u, m)), e.f(torch.exp, e.sub(v, m)))

    re, im = shifted(cos_p, cos_n), shifted(sin_p, sin_n)
    log_abs, arg = e.add(m, e.f(torch.log, e.f(torch.hypot, re, im))), e.f(torch.atan2, im, re)
    return Pair(log_abs, _scan_branch(e, p, log_abs, arg, dim))


def _scan_branch(e: _Emitter, z: Pair, log_abs: Any, arg: Any, dim: Any) -> Any:
    """The imaginary part of ATen's complex logcumsumexp, which is not the principal arg: its
    scan adds z_k as ``max + log1p(e^(min - max))``, max and min by real part, so the result takes
    Im z_k plus a correction in (-π/2, π/2) where Re z_k exceeds log|S_(k-1)| (a reset), and
    otherwise the previous imaginary part plus such a correction: arg S_k unwrapped from the last
    reset. Each correction is the principal difference of consecutive args, summed by cumsum."""

    def wrap(t: Any) -> Any:  # to (-π, π]
        return e.f(torch.atan2, e.f(torch.sin, t), e.f(torch.cos, t))

    idx = e.sub(e.call(torch.cumsum, e.call(torch.ones_like, arg), dim), 1.0)  # k along dim
    first = e.call(operator.eq, idx, 0)
    prev_abs = e.call(torch.roll, log_abs, 1, dim)
    reset = e.call(torch.logical_or, first, e.call(torch.gt, z.re, prev_abs))
    step = e.call(torch.where, reset, 0.0, wrap(e.sub(arg, e.call(torch.roll, arg, 1, dim))))
    steps = e.call(torch.cumsum, step, dim)
    at_reset = e.add(z.im, wrap(e.sub(arg, z.im)))
    last = e.call(torch.cummax, e.call(torch.where, reset, idx, -1.0), dim)
    last = e.call(torch.Tensor.long, e.call(operator.getitem, last, 0))
    base = e.call(torch.gather, e.sub(at_reset, steps), dim, last)
    return e.add(base, steps)


@_rule(aten.prod.default, aten.prod.dim_int, aten.cumprod.default)
def _r_prod(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # Π z_k = Π|z_k| · (cos Σ arg z_k + i sin Σ arg z_k) (cumulative for cumprod): a real product
    # and a real sum, for any (also symbolic) reduced size. Each error is relative to |Π z_k|, as
    # in the sequential complex product; sums of the parts' products would not reduce.
    e = lw.e
    p = _cast_parts(lw, n, _pair(a[0]), kw)
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    if p.im is None:
        return Pair(e.call(n.target, p.re, *a[1:], **kw), None)
    rdt = _node_val(n).dtype.to_real()
    if rdt != torch.float64:
        # in float32 each angle's and magnitude's rounding adds up over the product: 2000 unit
        # phasors came out 6x less accurate than ATen's (1.5e-5 vs 2.6e-6); float64 parts
        # make the result as accurate as its rounding to float32
        p = Pair(*(e.call(torch.Tensor.to, x, torch.float64) for x in (p.re, p.im)))
    mag, arg = c_abs(e, p), c_angle(e, p)
    if n.target is aten.prod.default:
        r, theta = e.call(aten.prod.default, mag), e.call(aten.sum.default, arg)
    elif n.target is aten.prod.dim_int:
        keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
        r = e.call(aten.prod.dim_int, mag, a[1], keep)
        theta = e.call(aten.sum.dim_IntList, arg, [a[1]], keep)
    else:
        r, theta = e.call(aten.cumprod.default, mag, a[1]), e.call(aten.cumsum.default, arg, a[1])
    re, im = e.mul(r, e.f(torch.cos, theta)), e.mul(r, e.f(torch.sin, theta))
    if rdt != torch.float64:
        re, im = e.call(torch.Tensor.to, re, rdt), e.call(torch.Tensor.to, im, rdt)
    return Pair(re, im)


@_rule(aten.linalg_vector_norm.default)
def _r_vector_norm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # every p-norm of a complex vector is that norm of the magnitudes |z|
    e = lw.e
    mag = c_abs(e, _pair(a[0]))
    if kw.get("dtype") is not None:
        mag = e.call(torch.Tensor.to, mag, _node_val(n).dtype)
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    return e.call(aten.linalg_vector_norm.default, mag, *a[1:], **kw)
