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
    ComplexDecompositionError,
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
    re, im = (None if x is None else lw.e.call(torch.Tensor.to, x, rdt) for x in (p.re, p.im))
    return Pair(re, im, p.neg_zero)


@_rule(aten.nansum.default)
def _r_nansum(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # ATen's nansum refuses a complex operand (RuntimeError "nansum on CPU does not support
    # complex inputs") and a complex dtype= (NotImplementedError); so does nanmean, which sums
    # with it. The compiled graph keeps the op (complex_aot_backend does not decompose it into
    # where(isnan) + sum, which computed a value eager has none for) to refuse it here.
    src, val = _node_val(n.args[0]), _node_val(n)
    raise ComplexDecompositionError(
        f"{n.target} (node {n.name!r}): torch.nansum and torch.nanmean need a real input and a "
        f"real dtype, as eager's (which raises 'nansum on CPU does not support complex inputs'); "
        f"got input {getattr(src, 'dtype', src)} and result {getattr(val, 'dtype', val)}"
    )


@_rule(aten.logcumsumexp.default)
def _r_logcumsumexp(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # log Σ_{j≤k} e^(x_j) (cos y_j + i sin y_j): each of the four signed sums Σ e^(x_j) c_j over
    # the terms with c_j = ±cos y_j > 0 (±sin y_j > 0) is a real logcumsumexp of x_j + log c_j,
    # which never overflows; their difference is taken after shifting all four by their
    # maximum m_k, and log S_k = m_k + log|S_k e^-m_k| + i arg S_k. (cumsum(exp(z - max)) with one
    # shift per slice underflowed the terms far below the maximum: log 0 = -inf.) Non-finite
    # parts take ATen's scan's values afterwards (:func:`_scan_special`).
    e, p = lw.e, _pair(a[0])
    dim = a[1] if len(a) > 1 else kw["dim"]
    if p.im is None:
        return Pair(e.call(aten.logcumsumexp.default, p.re, dim), None)
    if _node_val(n).dim() == 0:
        # a scalar is its own scan (torch.roll below needs a dimension): z, but NaN+NaNj for a
        # NaN part and -inf+0j for Re z = -inf, as ATen's fold from -inf+0j gives
        one = Pair(*(e.call(torch.reshape, x, [1]) for x in (p.re, p.im)))
        re, im = _lcse_parts(e, one, 0)
        return Pair(*(e.call(torch.reshape, x, []) for x in (re, im)))
    return Pair(*_lcse_parts(e, p, dim))


def _lcse_parts(e: _Emitter, p: Pair, dim: Any) -> tuple[Any, Any]:
    """Both parts of logcumsumexp of ``p`` (complex, at least one dimension) along ``dim``."""
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
    idx = e.sub(e.call(torch.cumsum, e.call(torch.ones_like, x), dim), 1.0)  # k along dim
    # Re z = -inf adds e^-inf = 0 (ATen's fold keeps its sum); while one term counts, ATen's
    # sum is that z itself, exactly: the next step's tie test (Re z_k against Re of the sum,
    # resetting on equality) must see that exact value, as for pure-imaginary input
    counted = e.call(torch.logical_not, e.call(operator.eq, x, -math.inf))
    n_counted = e.call(torch.cumsum, e.call(torch.Tensor.type_as, counted, x), dim)
    only = _at_last(
        e, e.call(torch.logical_and, counted, e.call(operator.eq, n_counted, 1.0)), idx, dim
    )
    single = e.call(operator.eq, n_counted, 1.0)
    log_abs = e.call(torch.where, single, e.call(torch.gather, x, dim, only), log_abs)
    log_abs = e.call(torch.where, e.call(operator.eq, n_counted, 0.0), -math.inf, log_abs)
    im = _scan_branch(e, p, log_abs, arg, idx, dim)
    im = e.call(torch.where, single, e.call(torch.gather, p.im, dim, only), im)
    im = e.call(torch.where, e.call(operator.eq, n_counted, 0.0), 0.0, im)
    return _scan_special(e, p, log_abs, im, idx, n_counted, dim)


def _at_last(e: _Emitter, sel: Any, idx: Any, dim: Any) -> Any:
    """The index of the last ``sel`` at or before each position (0 where none is)."""
    last = e.call(torch.cummax, e.call(torch.where, sel, idx, 0.0), dim)
    return e.call(torch.Tensor.long, e.call(operator.getitem, last, 0))


def _scan_special(
    e: _Emitter, z: Pair, log_abs: Any, im: Any, idx: Any, n_counted: Any, dim: Any
) -> tuple[Any, Any]:
    """ATen's fold ``log1p(exp(min - max)) + max`` on non-finite parts: a NaN part gives
    NaN+NaNj from there on; Im z = ±inf (Re z finite) gives NaN once a second term counts;
    Re z = +inf gives +inf + i Im z, a second one log(e^S + e^z), whose parts are sums of
    ±inf by the signs of cos and sin (inf - inf = NaN), so its imaginary part is atan2 of them
    (NaN where a sum is)."""
    nan, inf = math.nan, math.inf
    is_nan = e.call(torch.logical_or, e.f(torch.isnan, z.re), e.f(torch.isnan, z.im))
    im_inf = e.call(torch.logical_and, e.f(torch.isinf, z.im), e.f(torch.isfinite, z.re))
    seen_im_inf = e.call(
        operator.getitem, e.call(torch.cummax, e.call(torch.Tensor.type_as, im_inf, idx), dim), 0
    )
    bad = e.call(
        torch.logical_and,
        e.call(operator.gt, seen_im_inf, 0.0),
        e.call(operator.ge, n_counted, 2.0),
    )
    log_abs = e.call(torch.where, bad, nan, log_abs)
    im = e.call(torch.where, bad, nan, im)
    # +inf real parts: the first sets the sum to z, later finite terms add e^-inf = 0
    pinf = e.call(operator.eq, z.re, inf)
    n_pinf = e.call(torch.cumsum, e.call(torch.Tensor.type_as, pinf, idx), dim)
    first = _at_last(e, e.call(torch.logical_and, pinf, e.call(operator.eq, n_pinf, 1.0)), idx, dim)
    first_im = e.call(torch.gather, z.im, dim, first)

    def seen(t: Any) -> Any:  # some +inf term so far with t
        hit = e.call(torch.Tensor.type_as, e.call(torch.logical_and, pinf, t), idx)
        return e.call(operator.gt, e.call(torch.cumsum, hit, dim), 0.0)

    # e^(inf + i inf) is +inf + NaN i (glibc's cexp; C leaves the sign open): cos inf = NaN
    # counts as positive
    c, s = e.f(torch.cos, z.im), e.f(torch.sin, z.im)
    c_pos = seen(e.call(torch.logical_not, e.call(operator.le, c, 0.0)))
    c_neg, s_pos, s_neg = (
        seen(e.call(operator.lt, c, 0.0)),
        seen(e.call(operator.gt, s, 0.0)),
        seen(e.call(operator.lt, s, 0.0)),
    )
    s_bad = seen(e.f(torch.isinf, z.im))
    sum_re = e.call(
        torch.where,
        e.call(torch.logical_and, c_pos, c_neg),
        nan,
        e.call(torch.where, c_pos, inf, -inf),
    )
    sum_im = e.call(torch.where, s_pos, inf, e.call(torch.where, s_neg, -inf, 0.0))
    sum_im = e.call(
        torch.where,
        e.call(torch.logical_or, s_bad, e.call(torch.logical_and, s_pos, s_neg)),
        nan,
        sum_im,
    )
    many_im = e.f(torch.atan2, sum_im, sum_re)
    # log(NaN + i inf) = inf + NaN i, log(NaN + 0i) = log(NaN + NaN i) = NaN + NaN i
    many_re = e.call(
        torch.where,
        e.call(
            torch.logical_and,
            e.f(torch.isnan, sum_re),
            e.call(torch.logical_not, e.f(torch.isinf, sum_im)),
        ),
        nan,
        inf,
    )
    one_pinf = e.call(operator.eq, n_pinf, 1.0)
    some_pinf = e.call(operator.ge, n_pinf, 1.0)
    log_abs = e.call(torch.where, some_pinf, e.call(torch.where, one_pinf, inf, many_re), log_abs)
    im = e.call(torch.where, some_pinf, e.call(torch.where, one_pinf, first_im, many_im), im)
    # a NaN part (of z or of the sum before it) makes this and every later sum NaN+NaNj
    out_nan = e.call(torch.logical_or, e.f(torch.isnan, log_abs), e.f(torch.isnan, im))
    before = e.call(torch.roll, e.call(torch.Tensor.type_as, out_nan, idx), 1, dim)
    before = e.call(torch.where, e.call(operator.eq, idx, 0.0), 0.0, before)
    hit = e.call(torch.logical_or, is_nan, e.call(operator.gt, before, 0.0))
    infected = e.call(
        operator.gt,
        e.call(
            operator.getitem, e.call(torch.cummax, e.call(torch.Tensor.type_as, hit, idx), dim), 0
        ),
        0.0,
    )
    return (e.call(torch.where, infected, nan, log_abs), e.call(torch.where, infected, nan, im))


def _scan_branch(e: _Emitter, z: Pair, log_abs: Any, arg: Any, idx: Any, dim: Any) -> Any:
    """The imaginary part of ATen's complex logcumsumexp, which is not the principal arg: its
    scan adds z_k as ``max + log1p(e^(min - max))``, max and min by real part with z_k the max
    on a tie, so the result takes Im z_k plus a correction in [-π/2, π/2] where Re z_k is not
    below log|S_(k-1)| (a reset), and otherwise the previous imaginary part plus such a
    correction: arg S_k unwrapped from the last reset. Each correction is the principal
    difference of consecutive args, summed by cumsum."""

    def wrap(t: Any) -> Any:  # to (-π, π]
        return e.f(torch.atan2, e.f(torch.sin, t), e.f(torch.cos, t))

    first = e.call(operator.eq, idx, 0)
    prev_abs = e.call(torch.where, first, -math.inf, e.call(torch.roll, log_abs, 1, dim))
    reset = e.call(torch.logical_not, e.call(torch.lt, z.re, prev_abs))
    step = e.call(torch.where, reset, 0.0, wrap(e.sub(arg, e.call(torch.roll, arg, 1, dim))))
    steps = e.call(torch.cumsum, step, dim)
    at_reset = e.add(z.im, wrap(e.sub(arg, z.im)))
    last = _at_last(e, reset, idx, dim)
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
