"""Complex decomposition rules: elementwise arithmetic and functions (exp/log, the trigonometric
and hyperbolic functions and their inverses, pow, sqrt, abs/angle/sgn, the isnan family, polar).

Each rule takes the lowering (whose ``e`` emits real graph nodes), the complex node and its mapped
arguments (complex values as :class:`Pair`), and returns a Pair or a real value; the formulas are
stated beside each rule.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from torchport.compiler.complex_base import (
    ComplexDecompositionError,
    Pair,
    Rule,
    _Emitter,
    _is_complex_val,
    _node_val,
    _packets,
    _pair,
    aten,
    broadcast_parts,
    c_abs,
    c_add,
    c_add_product,
    c_add_scaled,
    c_angle,
    c_div,
    c_mul,
    c_mul_c99,
    c_mul_promoted,
    c_sub,
    operands_have_its_shape,
    registrar,
    same_traced_shape,
    zero_im,
)

RULES: dict[Any, Rule] = {}
_rule = registrar(RULES)


def _keep_zero(e: _Emitter, z: Any, zero: Any, value: Any) -> Any:
    """``zero`` where ``z == 0``, else ``value``: a product with a factor that is exactly 0
    (sin 0) is 0 in ATen's complex functions even where the other factor overflowed to inf,
    where the real formula computes inf * 0 = nan."""
    return e.call(torch.where, e.call(operator.eq, z, 0), zero, value)


def exp_shift(n: fx.Node) -> float:
    """c_exp's scaling point for the dtype of ``n``'s value: glibc's cexp threshold
    floor((max_exp - 1) ln 2), 88 for complex64 and 709 for complex128 (e^t is finite there).
    complex128 scaled from 88 was 1 ulp off eager for most x in (88, 709]."""
    val = _node_val(n)
    double = isinstance(val, torch.Tensor) and val.dtype in (torch.complex128, torch.float64)
    return 709.0 if double else 88.0


def c_exp(e: _Emitter, a: Pair, shift: float) -> Pair:
    if a.im is None:
        # e^x (cos ±0 + i sin ±0) = e^x ± 0i: the zero keeps its sign, as C's cexp (a +0 put
        # log(-exp(conj(x.to(c64)))) on the upper side of the cut, eager's on the lower)
        return Pair(e.f(torch.exp, a.re), None, a.neg_zero)
    # ATen's complex exp is C's cexp, which scales where e^x overflows but e^x cos y need not
    # (exp(88.5 + 1i) is 1.47e38 + 2.29e38i in complex64, and z ** p near |z|^p = float max):
    # for x above the dtype's ``shift`` t (:func:`exp_shift`) it takes (cos y · e^t) · e^(x - t);
    # e^x alone was inf. Below t the values are as before; the rule costs 7 nodes per element
    # (a compare, a subtraction, 2 products and 3 wheres), also where no x exceeds t.
    big = e.call(operator.gt, a.re, shift)
    ex = e.f(torch.exp, e.call(torch.where, big, e.sub(a.re, shift), a.re))
    cos_y, sin_y = e.f(torch.cos, a.im), e.f(torch.sin, a.im)
    # e^t rounded to the parts' dtype, as the product with a tensor rounds it
    cos_y = e.call(torch.where, big, e.mul(cos_y, math.exp(shift)), cos_y)
    sin_y = e.call(torch.where, big, e.mul(sin_y, math.exp(shift)), sin_y)
    im = _keep_zero(e, a.im, a.im, e.mul(ex, sin_y))  # e^x + 0i for y = ±0
    # x = -inf (as in 0 ** w = exp(w log 0)) gives 0 whatever y, even y = ±inf or NaN, with the
    # signs of cos y and sin y where y is finite and of y where not, as ATen; an e^x that
    # underflowed (x finite) times cos y or sin y is ±0 anyway, and NaN for y = ±inf, as ATen
    # (exp(-1e38 + inf i) is NaN + NaN i there)
    fin_y = e.f(torch.isfinite, a.im)
    # (e^x is 0 there; a NaN y gives its sign bit to the zero, as C's copysign in cexp: 0 - 0i
    # for the NaN of -inf·0, whose sign bit is set on x86)
    zero_re = e.call(torch.where, fin_y, e.f(torch.copysign, ex, cos_y), 0.0)
    zero_im = e.f(torch.copysign, ex, e.call(torch.where, fin_y, sin_y, a.im))
    minus_inf = e.call(operator.eq, a.re, -math.inf)
    re = e.call(torch.where, minus_inf, zero_re, e.mul(ex, cos_y))
    # x = +inf, y = ±inf or NaN: inf + NaN i, as ATen (C99), where inf · cos y was NaN
    inf_re = e.call(
        torch.logical_and, e.call(operator.eq, a.re, math.inf), e.call(torch.logical_not, fin_y)
    )
    re = e.call(torch.where, inf_re, math.inf, re)
    return Pair(re, e.call(torch.where, minus_inf, zero_im, im))


def c_log(e: _Emitter, a: Pair) -> Pair:
    return Pair(_log_abs(e, a), c_angle(e, a))


def _log_abs(e: _Emitter, a: Pair) -> Any:
    """log|z|, without the cancellation of log(hypot) near |z| = 1: there log|z| =
    ½ log1p((b-1)(b+1) + s²) with b, s the larger and smaller of |x|, |y|; b - 1 is exact for b in
    [0.5, 2] (log(1 + 1e-4i) in complex64 gave 0, ATen 5e-9)."""
    r = c_abs(e, a)
    if a.im is None:
        return e.f(torch.log, r)
    ax, ay = e.f(torch.abs, a.re), e.f(torch.abs, a.im)
    big, small = e.f(torch.maximum, ax, ay), e.f(torch.minimum, ax, ay)
    near = e.call(torch.logical_and, e.call(torch.ge, big, 0.5), e.call(torch.le, big, 2.0))
    t = e.add(e.mul(e.sub(big, 1.0), e.add(big, 1.0)), e.mul(small, small))
    return e.call(torch.where, near, e.mul(e.f(torch.log1p, t), 0.5), _log_hypot(e, a.re, a.im, r))


def _log_hypot(e: _Emitter, u: Any, v: Any, r: Any = None) -> Any:
    """log hypot(u, v), also where the hypot overflows although its log is finite (|z| of
    1e38 + 3.4e38i is above float32's max: log z had real part inf, ATen 88.76): there it is
    log hypot(u/2, v/2) + log 2 (halving is exact above the subnormals)."""
    r = e.f(torch.hypot, u, v) if r is None else r
    halved = e.add(e.f(torch.log, e.f(torch.hypot, e.mul(u, 0.5), e.mul(v, 0.5))), math.log(2.0))
    return e.call(torch.where, e.f(torch.isinf, r), halved, e.f(torch.log, r))


def c_sqrt(e: _Emitter, a: Pair) -> Pair:
    # t = sqrt((|x| + |z|)/2), then sqrt z = t + i y/(2t) for x >= 0 and |y|/(2t) + i copysign(t, y)
    # for x < 0: the part that (|z| - |x|)/2 would give cancels (1 + 1e-3i: |z| - x lost every
    # digit but one in float32, the imaginary part was 2% off; -4 + 1e-5i had real part 0), and
    # quartering before adding keeps |z| and |x| + |z| from overflowing (3e38 + 3e38i gave inf):
    # t = sqrt 2 · sqrt(|x|/4 + |z/4|). Quartering a subnormal part drops its low bits (sqrt of
    # complex64 values near 1e-40 was 40 ulp off), so a z with both parts below 2^-60 is scaled
    # by 2^100 first, the result by 2^-50 after (powers of two: exact)
    x = a.re
    y = e.dense_im(a, x)  # the sign of a known-zero y picks the side of the cut at x < 0
    ax0, ay0 = e.f(torch.abs, x), e.f(torch.abs, y)
    tiny = e.call(torch.lt, e.f(torch.maximum, ax0, ay0), 2.0**-60)
    up, down = e.call(torch.where, tiny, 2.0**100, 1.0), e.call(torch.where, tiny, 2.0**-50, 1.0)
    x, y = e.mul(x, up), e.mul(y, up)
    quarter_r = c_abs(e, Pair(e.mul(x, 0.25), e.mul(y, 0.25)))
    q = e.add(e.mul(e.f(torch.abs, x), 0.25), quarter_r)
    t = e.mul(e.f(torch.sqrt, q), math.sqrt(2.0))
    two_t = e.call(torch.where, e.call(operator.eq, t, 0), 1.0, e.mul(t, 2.0))  # z = 0: 0 + yi
    inf_y = e.f(torch.isinf, y)  # y/(2t) is inf/inf there; sqrt(x ± inf i) = inf ± inf i
    small = e.call(torch.where, inf_y, y, e.div(y, two_t))
    ay = e.f(torch.abs, y)
    small_abs = e.call(torch.where, inf_y, ay, e.div(ay, two_t))
    # (and for x NaN: sqrt(nan ± inf i) = inf ± inf i, as ATen; t is NaN there)
    nonneg = e.call(torch.logical_or, e.call(torch.ge, x, 0), inf_y)
    re = e.call(
        torch.where,
        e.call(torch.logical_and, nonneg, e.call(torch.logical_not, inf_y)),
        t,
        small_abs,
    )
    im = e.call(torch.where, nonneg, small, e.f(torch.copysign, t, y))
    return Pair(e.mul(re, down), e.mul(im, down))


def finite_max(n: fx.Node) -> float:
    """The largest finite value of the real dtype of ``n``'s value (float32 unless complex128
    or float64), the bound of :func:`_times_cosh_sinh` beyond three shifts."""
    val = _node_val(n)
    double = isinstance(val, torch.Tensor) and val.dtype in (torch.complex128, torch.float64)
    return torch.finfo(torch.float64 if double else torch.float32).max


def _times_cosh_sinh(
    e: _Emitter, c: Any, s: Any, y: Any, shift: float, fmax: float
) -> tuple[Any, Any]:
    """``(c · cosh y, s · sinh y)`` as C's csin/ccos/csinh/ccosh compute them: for finite |y|
    above the shift t (:func:`exp_shift`) cosh y and sinh y are sign · e^|y|/2 and taken as
    e^(|y| - t) · (c · e^t/2), once more times e^t where |y| - t still exceeds t, and with the
    dtype's max for e^(...) beyond that; cosh y alone overflows there (cosh 89 in float32), where
    the product with c need not: sin(89i) is 2.24e38i in complex64, it was inf·i."""
    ay = e.f(torch.abs, y)
    big = e.call(
        torch.logical_and, e.call(operator.gt, ay, shift), e.call(operator.lt, ay, math.inf)
    )
    r = e.sub(ay, shift)
    twice = e.call(operator.gt, r, shift)
    r = e.call(torch.where, twice, e.sub(r, shift), r)
    huge = e.call(operator.gt, r, shift)
    ev = e.call(torch.where, huge, fmax, e.f(torch.exp, e.call(torch.where, huge, 0.0, r)))
    # (the products round as C's do: the factor times e^t/2, times e^t, then times e^r)
    s_signed = e.call(torch.where, e.call(operator.lt, y, 0), e.neg(s), s)

    def shifted(f: Any) -> Any:
        f = e.mul(f, math.exp(shift) / 2)
        return e.mul(ev, e.call(torch.where, twice, e.mul(f, math.exp(shift)), f))

    c_cosh = e.mul(c, e.f(torch.cosh, y))
    s_sinh = e.mul(s, e.f(torch.sinh, y))
    return (
        e.call(torch.where, big, shifted(c), c_cosh),
        e.call(torch.where, big, shifted(s_signed), s_sinh),
    )


def c_sin(e: _Emitter, a: Pair, shift: float, fmax: float) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.sin, a.re), None)
    sin_cosh, cos_sinh = _times_cosh_sinh(
        e, e.f(torch.sin, a.re), e.f(torch.cos, a.re), a.im, shift, fmax
    )
    # sin(±0 + iy) = ±0 + i sinh y, also where cosh y overflows
    re = _keep_zero(e, a.re, a.re, sin_cosh)
    im = cos_sinh
    # x = ±inf or NaN: ATen's imaginary part is y for y = ±0 and +inf for y = ±inf (cos x times
    # sinh y was NaN), NaN otherwise
    y = a.im
    odd = e.call(
        torch.where,
        e.call(operator.eq, y, 0),
        y,
        e.call(torch.where, e.f(torch.isinf, y), math.inf, math.nan),
    )
    return Pair(re, e.call(torch.where, e.f(torch.isfinite, a.re), im, odd))


def c_cos(e: _Emitter, a: Pair, shift: float, fmax: float) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.cos, a.re), None)
    re, sin_sinh = _times_cosh_sinh(
        e, e.f(torch.cos, a.re), e.f(torch.sin, a.re), a.im, shift, fmax
    )
    # cos(±0 + iy) = cosh y - i (±0 · sign y), also where sinh y overflows
    zero = e.neg(e.mul(a.re, e.f(torch.copysign, e.dense(1.0, a.im), a.im)))
    im = _keep_zero(e, a.re, zero, e.neg(sin_sinh))
    # x = ±inf or NaN: ATen gives inf + NaN i for y = ±inf and NaN + 0i for y = ±0 (cos x and
    # sin x are NaN there)
    y, odd_x = a.im, e.call(torch.logical_not, e.f(torch.isfinite, a.re))
    re = e.call(torch.where, e.call(torch.logical_and, odd_x, e.f(torch.isinf, y)), math.inf, re)
    im = e.call(torch.where, e.call(torch.logical_and, odd_x, e.call(operator.eq, y, 0)), 0.0, im)
    return Pair(re, im)


def c_tanh(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.tanh, a.re), None, a.neg_zero)  # Im = ±0 · (a positive number)
    # (sinh 2x + i sin 2y)/(cosh 2x + cos 2y), with numerator and denominator divided by
    # cosh 2x: sinh and cosh overflow for |x| > ~44 in float32 (inf/inf = nan where tanh is
    # ±1), while tanh 2x and sech 2x = 1/cosh 2x stay finite (sech → 0)
    # sin 2y and cos 2y from sin y and cos y: 2y overflows for |y| above half the max (tanh of
    # 3.4e38i was NaN, ATen -0.61i)
    x2 = e.mul(a.re, 2.0)
    sin_y, cos_y = e.f(torch.sin, a.im), e.f(torch.cos, a.im)
    sin_2y = e.mul(e.mul(sin_y, cos_y), 2.0)
    cos_2y = e.mul(e.sub(cos_y, sin_y), e.add(cos_y, sin_y))
    sech = e.f(torch.reciprocal, e.f(torch.cosh, x2))
    den = e.add(1.0, e.mul(cos_2y, sech))
    re, im = e.div(e.f(torch.tanh, x2), den), e.div(e.mul(sin_2y, sech), den)
    # infinite parts, as ATen (C99): tanh(±0 + iy) = ±0 + i tan y for every y (0/den was NaN
    # for y = ±inf), tanh(±inf + iy) = ±1 ± 0i also for y = ±inf or NaN (sin 2y was NaN there)
    x, y = a.re, a.im
    inf_x = e.f(torch.isinf, x)
    re = e.call(torch.where, e.call(operator.eq, x, 0), x, re)
    re = e.call(torch.where, inf_x, e.f(torch.copysign, e.dense(1.0, x), x), re)
    odd_y = e.call(torch.logical_and, inf_x, e.call(torch.logical_not, e.f(torch.isfinite, y)))
    return Pair(re, e.call(torch.where, odd_y, e.f(torch.copysign, e.dense(0.0, y), y), im))


def c_sigmoid(e: _Emitter, a: Pair, shift: float) -> Pair:
    return c_div(e, 1.0, c_add(e, 1.0, c_exp(e, Pair(e.neg(a.re), e.neg(a.im)), shift)))


def _xy(e: _Emitter, a: Pair) -> tuple[Any, Any]:
    """The parts of ``a`` as graph tensors (a known-zero imaginary part with its sign: the
    branch-cut functions read it, so log(conj(x.to(c64))) at x < 0 is log|x| - πi, as eager)."""
    return a.re, e.dense_im(a, a.re)


def c_expm1(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.expm1, a.re), None)
    # e^z - 1 = (expm1 x cos y - 2 sin²(y/2)) + i e^x sin y: no cancellation of e^x cos y - 1
    # near z = 0
    x, y = a.re, a.im
    s = e.f(torch.sin, e.mul(y, 0.5))
    re = e.sub(e.mul(e.f(torch.expm1, x), e.f(torch.cos, y)), e.mul(e.mul(s, s), 2.0))
    # (e^x sin y without keeping y = ±0 exact: ATen's expm1(1e38 + 0i) is inf + NaN i, unlike
    # its exp; for a finite e^x the product is ±0 = y anyway)
    ex = e.f(torch.exp, x)
    return Pair(re, e.mul(ex, e.f(torch.sin, y)))


def c_log1p(e: _Emitter, a: Pair) -> Pair:
    x, y = _xy(e, a)
    xp1 = e.add(x, 1.0)
    # log|1+z| = ½ log1p(x(x+2) + y²) near z = 0 (log|1+z| cancels there), log hypot(1+x, y)
    # elsewhere (where x(x+2) + y² could overflow), as ATen
    near = e.call(
        torch.logical_and,
        e.call(torch.lt, e.f(torch.abs, x), 0.5),
        e.call(torch.lt, e.f(torch.abs, y), 0.5),
    )
    # (the y = 0 case apart so that log1p(-0) keeps its sign: -0 + 0² is +0)
    t = e.mul(x, e.add(x, 2.0))
    t = e.call(torch.where, e.call(operator.eq, y, 0), t, e.add(t, e.mul(y, y)))
    small = e.mul(e.f(torch.log1p, t), 0.5)
    big = _log_hypot(e, xp1, y)
    return Pair(e.call(torch.where, near, small, big), e.f(torch.atan2, y, xp1))


def _times_i(e: _Emitter, a: Pair) -> Pair:
    x, y = _xy(e, a)
    return Pair(e.neg(y), x)  # i(x + iy) = -y + ix


def _times_minus_i(e: _Emitter, a: Pair) -> Pair:
    x, y = _xy(e, a)
    return Pair(y, e.neg(x))  # -i(x + iy) = y - ix


def c_atanh(e: _Emitter, a: Pair) -> Pair:
    # atanh z = ½ (log(1+z) - log(1-z)). Real part ¼ log1p(4x/|1-z|²) (Kahan): the difference of
    # logs cancels for large |z|. The real part is odd in x, so it is computed for |x| and given
    # x's sign (copysign keeps -0): for x near -1 the formula in x itself rounded 4x/|1-z|² to -1
    # and log1p lost everything (atanh(-0.99999) gave -inf). 4|x|/|1-z|² is formed as
    # (|x|/d)(4/d), d = hypot(1-|x|, y), and where d < 2^-60 (the product could overflow) as
    # log(4|x|) - 2 log d instead. Imaginary part ½ (arg(1+z) - arg(1-z)): the signed zero of
    # -y puts the branch cuts (real axis beyond ±1) where ATen has them.
    x, y = _xy(e, a)
    one_m_x = e.sub(1.0, x)
    ax = e.f(torch.abs, x)
    d = e.f(torch.hypot, e.sub(1.0, ax), y)
    near_one = e.call(torch.lt, d, 2.0**-60)
    # each form gets harmless arguments where the other is taken, so that neither puts an
    # inf or NaN into the gradient through where (log |x| at x = 0, 1/d at d = 0)
    d_f = e.call(torch.where, near_one, 1.0, d)
    fine = e.f(torch.log1p, e.mul(e.div(ax, d_f), e.div(4.0, d_f)))
    ax_t = e.call(torch.where, near_one, ax, 1.0)
    d_t = e.call(torch.where, near_one, d, 1.0)
    tiny = e.sub(e.f(torch.log, e.mul(ax_t, 4.0)), e.mul(e.f(torch.log, d_t), 2.0))
    re = e.f(torch.copysign, e.mul(e.call(torch.where, near_one, tiny, fine), 0.25), x)
    arg_p = e.f(torch.atan2, y, e.add(x, 1.0))
    arg_m = e.f(torch.atan2, e.neg(y), one_m_x)
    im = e.mul(e.sub(arg_p, arg_m), 0.5)
    # an infinite part, as ATen (C99): atanh z = ±0 + i copysign(π/2, y) (the real part's
    # 4|x|/d² was inf/inf = NaN; the imaginary part is NaN where y is); atan inherits it
    inf_z = e.call(torch.logical_or, e.f(torch.isinf, x), e.f(torch.isinf, y))
    re = e.call(torch.where, inf_z, e.f(torch.copysign, e.dense(0.0, x), x), re)
    half_pi = e.f(torch.copysign, e.dense(math.pi / 2, y), y)
    keep_nan = e.call(torch.logical_and, inf_z, e.call(torch.logical_not, e.f(torch.isnan, y)))
    return Pair(re, e.call(torch.where, keep_nan, half_pi, im))


def c_atan(e: _Emitter, a: Pair) -> Pair:
    return _times_minus_i(e, c_atanh(e, _times_i(e, a)))  # atan z = -i atanh(iz)


def _sqrt_1_pm(e: _Emitter, a: Pair, sign: float) -> Pair:
    """sqrt(1 + sign·z), with the sign of a zero imaginary part following ``sign·y``."""
    x, y = _xy(e, a)
    if sign > 0:
        return c_sqrt(e, Pair(e.add(x, 1.0), y))
    return c_sqrt(e, Pair(e.sub(1.0, x), e.neg(y)))


_FAR = 2.0**30  # |x| or |y| above this: the inverse functions' asymptotic forms are exact


def _far(e: _Emitter, x: Any, y: Any) -> tuple[Any, Any]:
    """``(far, L)``: where |x| or |y| exceeds 2^30, and L = log 2|z| there. Kahan's products of
    square roots overflow for |z| near the dtype's max (asinh(1e308i) gave inf, ATen 710.5);
    out there √(1-z)√(1+z) ~ ±iz up to a relative 1/|z|² (below either dtype's rounding), so
    asin, acos, asinh and acosh are ±log 2|z| plus an argument. L takes |z| = 1 where not far,
    so that its gradient through ``where`` is finite."""
    far = e.call(
        torch.logical_or,
        e.call(torch.gt, e.f(torch.abs, x), _FAR),
        e.call(torch.gt, e.f(torch.abs, y), _FAR),
    )
    xs, ys = e.call(torch.where, far, x, 1.0), e.call(torch.where, far, y, 0.0)
    return far, e.add(_log_hypot(e, xs, ys), math.log(2.0))


def c_asin(e: _Emitter, a: Pair) -> Pair:
    # Kahan: asin z = atan2(x, Re(√(1-z) √(1+z))) + i asinh(Im(conj(√(1-z)) √(1+z))): no log of a
    # difference (log(iz + √(1-z²)) cancels), and the square roots' branch cuts give asin's
    m, p = _sqrt_1_pm(e, a, -1.0), _sqrt_1_pm(e, a, 1.0)
    x, y = _xy(e, a)
    re = e.f(torch.atan2, x, e.sub(e.mul(m.re, p.re), e.mul(m.im, p.im)))
    im = e.f(torch.asinh, e.sub(e.mul(m.re, p.im), e.mul(m.im, p.re)))
    far, big_l = _far(e, x, y)  # far out: atan2(x, |y|) + i copysign(log 2|z|, y)
    re = e.call(torch.where, far, e.f(torch.atan2, x, e.f(torch.abs, y)), re)
    return Pair(re, e.call(torch.where, far, e.f(torch.copysign, big_l, y), im))


def c_acos(e: _Emitter, a: Pair) -> Pair:
    # Kahan: acos z = 2 atan2(Re √(1-z), Re √(1+z)) + i asinh(Im(conj(√(1+z)) √(1-z)))
    m, p = _sqrt_1_pm(e, a, -1.0), _sqrt_1_pm(e, a, 1.0)
    re = e.mul(e.f(torch.atan2, m.re, p.re), 2.0)
    im = e.f(torch.asinh, e.sub(e.mul(p.re, m.im), e.mul(p.im, m.re)))
    x, y = _xy(e, a)
    far, big_l = _far(e, x, y)  # far out: atan2(|y|, x) - i copysign(log 2|z|, y)
    re = e.call(torch.where, far, e.f(torch.atan2, e.f(torch.abs, y), x), re)
    return Pair(re, e.call(torch.where, far, e.f(torch.copysign, big_l, e.neg(y)), im))


def c_acosh(e: _Emitter, a: Pair) -> Pair:
    # Kahan: acosh z = asinh(Re(conj(√(z-1)) √(z+1))) + i 2 atan2(Im √(z-1), Re √(z+1))
    x, y = _xy(e, a)
    m = c_sqrt(e, Pair(e.sub(x, 1.0), y))
    p = c_sqrt(e, Pair(e.add(x, 1.0), y))
    re = e.f(torch.asinh, e.add(e.mul(m.re, p.re), e.mul(m.im, p.im)))
    im = e.mul(e.f(torch.atan2, m.im, p.re), 2.0)
    far, big_l = _far(e, x, y)  # far out: log 2|z| + i arg z
    return Pair(e.call(torch.where, far, big_l, re), e.call(torch.where, far, c_angle(e, a), im))


def c_asinh(e: _Emitter, a: Pair) -> Pair:
    return _times_minus_i(e, c_asin(e, _times_i(e, a)))  # asinh z = -i asin(iz)


def c_pow(e: _Emitter, a: Pair, p: Any, shift: float) -> Pair:
    # the exponents ATen computes as other functions (pow_Tensor_Scalar: 0 fills ones, 1 copies;
    # its complex kernel: 0.5 sqrt, -0.5 rsqrt, -1 reciprocal, 2 and 3 products, -2 the
    # reciprocal of the square; int or float alike), so with their values at the branch cut and
    # at infinities: z ** 0.5 through e^(0.5 log z) was -inf + inf i at -inf (ATen's sqrt: inf i)
    # and -4e-8 + 1i at -1 (1i). Every other exponent, 4 and 1e300 too, is ATen's std::pow,
    # e^(p log z)
    if isinstance(p, (int, float)) and not isinstance(p, bool):
        if p == 0.5:
            return c_sqrt(e, a)
        if p == -0.5:
            return c_div(e, 1.0, c_sqrt(e, a))
        # the products are ATen's complex ones, in which a known-zero imaginary part takes
        # part as +0 (z·z, (z·z)·z; not 1·z·z, whose 0·y is NaN for an infinite y)
        if p in (-1, -2):
            return c_div(e, 1.0, a if p == -1 else c_mul_promoted(e, a, a))
        if p in (2, 3):
            sq = c_mul_promoted(e, a, a)
            return sq if p == 2 else c_mul_promoted(e, sq, a)
        if p in (0, 1):
            one = Pair(e.dense(1.0, a.re), None)
            if p == 0:
                return one
            copy = c_mul(e, one, a)  # 1·x, 1·y: a copy, as ATen's (a zero's sign kept)
            return Pair(copy.re, copy.im, a.neg_zero)
    # std::pow(z, p + 0i) is exp((p + 0i)·log z), whose +0 takes part in the imaginary part:
    # p·y + 0·x is NaN for x = log|z| = ±inf (z ** 4 at 1 + inf i is inf + NaN i, z ** -3 at 0 is
    # inf + NaN i; p·y alone gave inf + inf i and inf - 0i), and gives a zero's sign. The real
    # part stays p·x: p·x - 0·y differs only where y is NaN, where x is NaN too or infinite,
    # and there C's multiply (Annex G) recovers ±inf = p·x (z ** -3 at inf + NaN i is 0 - 0i:
    # the sign is that of the NaN of inf·0, which ATen's add returns from its second operand)
    lg = c_log(e, a)
    return c_exp(e, Pair(e.mul(lg.re, p), e.add(e.mul(lg.im, p), e.mul(lg.re, 0.0))), shift)


def _alpha_parts(
    e: _Emitter, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any], negate: bool
) -> tuple[Any, Any]:
    """(re, im) of the ``alpha`` (``-alpha`` for sub/rsub) ATen's add kernel multiplies by: a
    real alpha has imaginary part +0, also negated (``-Scalar(2)`` is -2 + 0i); a complex one
    keeps the signs of its parts (``-(1j)`` is -0 - 1i), so a number is read from the node,
    where a zero imaginary part still has its sign. A graph value (a SymInt/SymFloat alpha such
    as ``r.shape[0]`` under ``dynamic=True``) is a real number, taken from the lowered arguments
    ``a``/``kw``: the node's own argument belongs to the source graph. The ``.Scalar`` overloads
    take alpha positionally."""
    raw = n.args[2] if len(n.args) > 2 else n.kwargs["alpha"]
    if isinstance(raw, complex):
        raw = -raw if negate else raw
        return raw.real, raw.imag
    if isinstance(raw, (int, float)):
        return (-raw if negate else raw), 0.0
    alpha = a[2] if len(a) > 2 else kw["alpha"]
    return (e.neg(alpha) if negate else alpha), 0.0


def _has_alpha(n: fx.Node) -> bool:
    return len(n.args) > 2 or "alpha" in n.kwargs


def _add_scaled(e: _Emitter, n: fx.Node, a: Any, b: Any, alpha: tuple[Any, Any]) -> Pair:
    """``a + alpha·b`` (:func:`c_add_scaled`); with ``b`` and alpha both numbers, alpha·b is
    computed in the node's precision first, as ATen does (folded in Python's double,
    ``sub(z, 1 - 3j, alpha=1e30)`` in complex64 was 1 ulp off)."""
    pb, (ar, ai) = _pair(b), alpha
    parts = (pb.re, pb.im, ar, ai)
    if not all(x is None or isinstance(x, (int, float)) for x in parts):
        return c_add_scaled(e, a, b, ar, ai)
    val = _node_val(n)
    rdt = val.dtype.to_real() if isinstance(val, torch.Tensor) else torch.float64
    if pb.im is None:
        parts = (pb.re, zero_im(pb), ar, ai)  # b's known-zero imaginary part with its sign
    c, d, ar_t, ai_t = (torch.tensor(0.0 if x is None else x, dtype=rdt) for x in parts)
    t_re, t_im = (c * ar_t - d * ai_t).item(), (d * ar_t + c * ai_t).item()
    return c_add_product(e, a, t_re, t_im)


# Without alpha, add/sub/rsub are componentwise, one real op per part. ATen's kernel computes
# a + 1·b as a complex product even then, so where b has an infinite or NaN part the other part
# of the sum is NaN in eager (1 + (inf + 0i) = inf + NaN i; compiled: inf + 0i), and a -0 part
# may come out +0; matching that would triple the arithmetic of the most common complex op
# (Inductor's own complex add decomposition is componentwise too). With an explicit alpha
# (alpha=1 is dropped at tracing) the product is ATen's, bit for bit.


def _full_parts(e: _Emitter, n: fx.Node, p: Pair, terms: tuple[Any, ...] = ()) -> Pair:
    """A sum's parts as tensors of the result's shape. Where one operand's imaginary part is a
    known zero the sum's is the other's: of that operand's shape, so x.to(c64) + w for x [5, 3]
    and w [3] had a [3] imaginary part (its sum() a fifth of eager's, silently; an output
    failed to stack), and for a number a number (x.to(c64) + 1j: sum and exp of it raised,
    a rule applied a tensor op to 1.0). A part of another shape is expanded (a view), a number
    part beside a tensor one is filled to its shape. ``terms``, the lowered operands where each
    part of the sum is the sum of their same parts (no alpha): a part both gave a tensor to, or
    that one operand of the result's shape gave, has that shape already and stays as it is
    (z[5, 3] + w[3] took a broadcast_tensors and two getitems, 3 nodes to 6)."""
    if isinstance(p.re, fx.Node) and isinstance(p.im, (int, float)):
        return Pair(p.re, e.dense(p.im, p.re))
    if isinstance(p.im, fx.Node) and isinstance(p.re, (int, float)):
        return Pair(e.dense(p.re, p.im), p.im)
    if p.im is None or not isinstance(p.re, fx.Node) or operands_have_its_shape(n):
        return p
    if terms:
        re_full = _part_has_its_shape(n, [_pair(t).re for t in terms])
        im_full = _part_has_its_shape(n, [_pair(t).im for t in terms])
        if re_full and im_full:
            return p
        if re_full:
            return Pair(p.re, e.call(torch.Tensor.expand_as, p.im, p.re), p.neg_zero)
        if im_full:
            return Pair(e.call(torch.Tensor.expand_as, p.re, p.im), p.im, p.neg_zero)
    full = broadcast_parts(e, p.re, p.im)
    return Pair(full.re, full.im, p.neg_zero)


def _part_has_its_shape(n: fx.Node, parts: list[Any]) -> bool:
    """True if the part of the componentwise sum ``n`` that adds ``parts`` (the same part of
    each operand, in ``n.args`` order) has ``n``'s shape: two tensor terms broadcast to it,
    one has it if its operand does."""
    tensors = [i for i, x in enumerate(parts) if isinstance(x, fx.Node)]
    if len(tensors) != 1:
        return len(tensors) == 2
    return same_traced_shape(_node_val(n.args[tensors[0]]), _node_val(n))


@_rule(*_packets("add"))
def _r_add(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if not _has_alpha(n):
        return _full_parts(lw.e, n, c_add(lw.e, a[0], a[1]), a[:2])  # (a+bi)+(c+di) = (a+c)+(b+d)i
    alpha = _alpha_parts(lw.e, n, a, kw, negate=False)
    return _full_parts(lw.e, n, _add_scaled(lw.e, n, a[0], a[1], alpha))


@_rule(*_packets("sub"))
def _r_sub(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if not _has_alpha(n):
        return _full_parts(lw.e, n, c_sub(lw.e, a[0], a[1]), a[:2])  # componentwise difference
    alpha = _alpha_parts(lw.e, n, a, kw, negate=True)
    return _full_parts(lw.e, n, _add_scaled(lw.e, n, a[0], a[1], alpha))


@_rule(*_packets("rsub"))
def _r_rsub(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if not _has_alpha(n):
        return _full_parts(lw.e, n, c_sub(lw.e, a[1], a[0]), a[:2])  # b - a
    alpha = _alpha_parts(lw.e, n, a, kw, negate=True)
    return _full_parts(lw.e, n, _add_scaled(lw.e, n, a[1], a[0], alpha))


# mul of a complex value by a real one (a real tensor or number) scales each part alone; ATen
# promotes the real operand to complex first and its imaginary +0 takes part, so where the
# complex operand has an infinite or NaN part eager's product has NaN in its other part
# ((inf + 1i)·2 = inf + NaN i there; compiled: inf + 2i). Matching that adds four ops per
# element to the most common mixed op (and to its backward): a fused elementwise kernel of
# such products measured 1.2-2.3x slower, the complex frontend benchmark's speedup over eager
# 2.0-2.5x against 2.7-3.0x (two runs each, loaded machine). Two real-valued operands (x.to(c64) * y, x.to(c64) ** 2) have no imaginary part to
# scale, and their product is ATen's (its 0 parts cost one op per operand).


@_rule(*_packets("mul"))
def _r_mul(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    pa, pb = _pair(a[0]), _pair(a[1])
    if pa.im is None and pb.im is None:
        return c_mul_promoted(lw.e, pa, pb)  # (a·c - 0·0) + (a·0 + 0·c)i
    return c_mul(lw.e, pa, pb)  # (ac-bd) + (ad+bc)i


@_rule(*_packets("div"))
def _r_div(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if kw.get("rounding_mode") is not None:
        raise ComplexDecompositionError(f"{n.target}: rounding_mode is undefined for complex")
    return c_div(lw.e, a[0], a[1])  # multiply by conj, divide by |b|²


@_rule(aten.reciprocal.default)
def _r_recip(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_div(lw.e, 1.0, a[0])  # 1/z


@_rule(aten.neg.default)
def _r_neg(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    # -z; a known-zero imaginary part changes sign as eager's does ((-x.to(c64))² reads it)
    return Pair(lw.e.neg(p.re), lw.e.neg(p.im), p.im is None and not p.neg_zero)


@_rule(
    aten.conj.default, aten._conj.default, aten.conj_physical.default, aten._conj_physical.default
)
def _r_conj(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return Pair(p.re, lw.e.neg(p.im), p.im is None and not p.neg_zero)  # conj(a+bi) = a-bi


@_rule(
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
)
def _r_identity(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return a[0]  # lazy-bit resolution and aliasing do not change the value


@_rule(aten.exp.default)
def _r_exp(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_exp(lw.e, _pair(a[0]), exp_shift(n))  # e^x (cos y + i sin y)


@_rule(aten.log.default)
def _r_log(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_log(lw.e, _pair(a[0]))  # log|z| + i arg z


@_rule(aten.sqrt.default)
def _r_sqrt(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sqrt(lw.e, _pair(a[0]))  # principal square root


@_rule(aten.rsqrt.default)
def _r_rsqrt(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_div(lw.e, 1.0, c_sqrt(lw.e, _pair(a[0])))  # 1/sqrt z


@_rule(aten.sin.default)
def _r_sin(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # sin x cosh y + i cos x sinh y
    return c_sin(lw.e, _pair(a[0]), exp_shift(n), finite_max(n))


@_rule(aten.cos.default)
def _r_cos(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # cos x cosh y - i sin x sinh y
    return c_cos(lw.e, _pair(a[0]), exp_shift(n), finite_max(n))


@_rule(aten.tanh.default)
def _r_tanh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_tanh(lw.e, _pair(a[0]))  # (sinh 2x + i sin 2y)/(cosh 2x + cos 2y)


@_rule(aten.sigmoid.default)
def _r_sigmoid(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sigmoid(lw.e, _pair(a[0]), exp_shift(n))  # 1/(1+e^-z)


def _real_as_result(e: _Emitter, x: fx.Node, src_node: Any, n: fx.Node) -> Any:
    """Real tensor ``x`` (lowered from ``src_node``) in the real dtype of ``n``'s complex value:
    an integer base, or a float32 one of a complex128 result, is converted first, as ATen
    promotes it; ``x`` itself where the dtypes agree or are unknown."""
    val, src = _node_val(n), _node_val(src_node)
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return x
    rdt = val.dtype.to_real()
    return x if src.dtype == rdt else e.call(torch.Tensor.to, x, rdt)


def _number_pow(e: _Emitter, n: fx.Node, base: complex, p: Any) -> Pair:
    """``base ** p`` for a Python number ``base`` (``2 ** z``, ``torch.pow(1j, z)``), as ATen's
    pow.Scalar: base 1 (not True) fills ones (also where p is NaN); any other base is converted
    to the result's dtype and raised by std::pow, e^(p log base) with the full complex product.
    log base is a constant, ATen's own log of the converted base, taken here once (the graph
    had torch.abs(2), an error, from the tensor rule). The product is C's (:func:`c_mul_c99`),
    which recovers infinities where it is NaN + NaN i (2 ** (inf + inf i) is inf + NaN i and
    0 ** (1 + NaN i) is 0 - 0i), as for a tensor base."""
    val = _node_val(n)
    cdt = val.dtype if _is_complex_val(val) else torch.complex128
    if complex(base) == 1 and not isinstance(base, bool):  # (a bool Scalar equals no number)
        # (a real exponent, an integer one too, gives the ones its shape, in the result's dtype)
        ref = p.re if isinstance(p, Pair) else p
        return Pair(e.call(torch.full_like, ref, 1.0, dtype=cdt.to_real()), None)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the compiler may run under AOTAutograd's fake mode
        lg = complex(torch.log(torch.tensor(complex(base), dtype=cdt)).item())
    log_base = Pair(lg.real, lg.imag)
    return c_exp(e, c_mul_c99(e, _pair(p), log_base), exp_shift(n))


@_rule(*_packets("pow"))
def _r_pow(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    base, p = a[0], a[1]
    if isinstance(p, Pair) and p.im is None and isinstance(p.re, (int, float)):
        # a complex exponent with zero imaginary part takes ATen's real-exponent cases too
        # (z ** (3 + 0j) is z·z·z there: its overflow is NaN where e^(3 log z) is finite)
        p = p.re
        if isinstance(base, fx.Node):
            # a real base is promoted to complex first, and its imaginary part +0 takes part
            # in those products (nan ** (2 + 0j) is (nan + 0i)² = nan + nan i, (-0.) ** (-1 + 0j)
            # is 1/(-0 + 0i) = inf + nan i); as a known zero it dropped out (nan + 0i, -inf + 0i)
            re = _real_as_result(lw.e, base, n.args[0], n)
            base = Pair(re, lw.e.zeros_like(re))
    if isinstance(n.args[0], (int, float, complex)):
        # a number base (read from the node: a complex one was mapped to a Pair)
        return _number_pow(lw.e, n, n.args[0], p)
    if isinstance(p, (Pair, fx.Node, complex)):
        # z^w = e^(w log z), as glibc's cpow: C's product (a real w is w + 0i, whose +0 takes
        # part: z ** w for z = 0 and w = 0. is NaN + NaN i, as eager; w·log z gave NaN + 0i)
        return c_exp(lw.e, c_mul_c99(lw.e, p, c_log(lw.e, _pair(base))), exp_shift(n))
    return c_pow(lw.e, _pair(base), p, exp_shift(n))  # small integer powers by products


@_rule(aten.expm1.default)
def _r_expm1(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_expm1(lw.e, _pair(a[0]))  # e^z - 1


@_rule(aten.exp2.default)
def _r_exp2(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_exp(lw.e, c_mul(lw.e, _pair(a[0]), math.log(2.0)), exp_shift(n))  # e^(z log 2)


@_rule(aten.log1p.default)
def _r_log1p(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_log1p(lw.e, _pair(a[0]))  # log(1 + z)


@_rule(aten.sinh.default)
def _r_sinh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    sin_iz = c_sin(e, _times_i(e, _pair(a[0])), exp_shift(n), finite_max(n))
    return _times_minus_i(e, sin_iz)  # sinh z = -i sin(iz)


@_rule(aten.cosh.default)
def _r_cosh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # cosh z = cos(iz)
    return c_cos(lw.e, _times_i(lw.e, _pair(a[0])), exp_shift(n), finite_max(n))


@_rule(aten.tan.default)
def _r_tan(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    return _times_minus_i(e, c_tanh(e, _times_i(e, _pair(a[0]))))  # tan z = -i tanh(iz)


_INVERSE: dict[Any, Callable[[_Emitter, Pair], Pair]] = {
    aten.asin.default: c_asin,
    aten.acos.default: c_acos,
    aten.atan.default: c_atan,
    aten.asinh.default: c_asinh,
    aten.acosh.default: c_acosh,
    aten.atanh.default: c_atanh,
}


@_rule(*_INVERSE)
def _r_inverse_trig(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return _INVERSE[n.target](lw.e, _pair(a[0]))  # principal values, ATen's branch cuts


@_rule(aten.abs.default)
def _r_abs(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_abs(lw.e, _pair(a[0]))  # sqrt(x² + y²) (a real tensor)


@_rule(aten.angle.default)
def _r_angle(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_angle(lw.e, _pair(a[0]))  # atan2(y, x) (a real tensor)


@_rule(aten.sgn.default)
def _r_sgn(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, p = lw.e, _pair(a[0])
    r = c_abs(e, p)
    zero = e.call(operator.eq, r, 0)
    safe = e.call(torch.where, zero, 1.0, r)
    q = c_div(e, p, safe)
    return Pair(
        e.call(torch.where, zero, 0.0, q.re), e.call(torch.where, zero, 0.0, e.dense(q.im, q.re))
    )  # z/|z|, 0 at 0


@_rule(aten.isnan.default, aten.isinf.default)
def _r_isnan(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, p = lw.e, _pair(a[0])
    fn = torch.isnan if n.target is aten.isnan.default else torch.isinf
    re = e.call(fn, p.re)
    return re if p.im is None else e.call(torch.logical_or, re, e.call(fn, p.im))  # either part


@_rule(aten.isfinite.default)
def _r_isfinite(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, p = lw.e, _pair(a[0])
    re = e.call(torch.isfinite, p.re)
    return re if p.im is None else e.call(torch.logical_and, re, e.call(torch.isfinite, p.im))


@_rule(aten.log10.default, aten.log2.default)
def _r_log_base(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    scale = 1.0 / math.log(10.0 if n.target is aten.log10.default else 2.0)
    return c_mul(lw.e, c_log(lw.e, _pair(a[0])), scale)  # log z / log b


@_rule(aten.polar.default)
def _r_polar(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, r, theta = lw.e, a[0], a[1]  # r (cos θ + i sin θ)
    return Pair(e.mul(r, e.f(torch.cos, theta)), e.mul(r, e.f(torch.sin, theta)))
