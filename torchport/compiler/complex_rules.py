"""Rules of the complex decomposition: complex arithmetic on (real, imag) pairs and one rule per aten op.

Each rule takes the lowering (whose ``e`` emits real graph nodes), the complex node and its mapped
arguments (complex values as :class:`Pair`), and returns a Pair or a real value. The formulas are
stated beside each rule; :mod:`torchport.compiler.complex` drives them over a graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten


class ComplexDecompositionError(RuntimeError):
    """A complex-valued op in the graph has no real decomposition."""


@dataclass
class Pair:
    """A complex value as two real graph values; ``im is None`` means the imaginary part is 0."""

    re: Any
    im: Any


def _is_complex_val(v: object) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


def _node_val(n: object) -> Any:
    return n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None


def fold_select_of_stack(x: Any, dim: Any, index: Any, ndim: int | None = None) -> Any:
    """``select(stack(parts, -1), last dim, i)`` → ``parts[i]``, else None.

    Complex boundaries stack (real, imag) into ``[..., 2]`` and the next op often selects a part
    back (``real``/``view_as_complex`` after ``view_as_real``). Folding keeps the graph free of
    the round trip, which matters beyond speed: Inductor lowers a select to a squeeze view whose
    stride computation guards every symbolic size != 1 (a recompile at size 1).
    """
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is torch.stack):
        return None
    parts = x.args[0]
    sdim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    last = dim == -1 or (ndim is not None and dim == ndim - 1)
    if sdim != -1 or not last or not isinstance(parts, (list, tuple)) or type(index) is not int:
        return None
    if not -len(parts) <= index < len(parts):
        return None
    return parts[index]


class _Emitter:
    """Builds the real graph; arithmetic helpers treat ``None`` as an exact zero."""

    def __init__(self, graph: fx.Graph) -> None:
        self.g = graph

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if fn is torch.select and not kwargs and len(args) == 3:
            part = fold_select_of_stack(args[0], args[1], args[2])
            if part is not None:
                return part
        return self.g.call_function(fn, tuple(args), kwargs)

    def add(self, a: Any, b: Any) -> Any:
        if a is None:
            return b
        if b is None:
            return a
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a + b
        return self.call(operator.add, a, b)

    def sub(self, a: Any, b: Any) -> Any:
        if b is None:
            return a
        if a is None:
            return self.neg(b)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a - b
        return self.call(operator.sub, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        if a is None or b is None:
            return None
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a * b
        return self.call(operator.mul, a, b)

    def div(self, a: Any, b: Any) -> Any:
        if a is None:
            return None
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a / b
        return self.call(operator.truediv, a, b)

    def neg(self, a: Any) -> Any:
        if a is None:
            return None
        if isinstance(a, (int, float)):
            return -a
        return self.call(operator.neg, a)

    def f(self, fn: Callable[..., Any], a: Any, *rest: Any, **kw: Any) -> Any:
        """Apply a real function; a known-zero input is materialised as zeros if needed."""
        return self.call(fn, a, *rest, **kw)

    def zeros_like(self, ref: Any) -> Any:
        return self.call(torch.zeros_like, ref)

    def dense(self, a: Any, ref: Any) -> Any:
        """``a`` as a graph tensor (zeros shaped like ``ref`` when a is a known zero)."""
        if a is None:
            return self.zeros_like(ref)
        if isinstance(a, (int, float)):
            return self.call(torch.full_like, ref, a)
        return a


def _pair(v: Any) -> Pair:
    """View any value (real tensor node, number, complex number, Pair) as a Pair."""
    if isinstance(v, Pair):
        return v
    if isinstance(v, complex):
        return Pair(v.real, v.imag if v.imag != 0 else None)
    return Pair(v, None)


# --- complex arithmetic on Pairs -------------------------------------------------------------


def c_add(e: _Emitter, a: Any, b: Any, alpha: Any = 1) -> Pair:
    pa, pb = _pair(a), _pair(b)
    if alpha != 1:
        pb = c_mul(e, pb, alpha)
    return Pair(e.add(pa.re, pb.re), e.add(pa.im, pb.im))


def c_sub(e: _Emitter, a: Any, b: Any, alpha: Any = 1) -> Pair:
    pa, pb = _pair(a), _pair(b)
    if alpha != 1:
        pb = c_mul(e, pb, alpha)
    return Pair(e.sub(pa.re, pb.re), e.sub(pa.im, pb.im))


def c_mul(e: _Emitter, a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)
    re = e.sub(e.mul(pa.re, pb.re), e.mul(pa.im, pb.im))
    im = e.add(e.mul(pa.re, pb.im), e.mul(pa.im, pb.re))
    return Pair(re, im)


def c_div(e: _Emitter, a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)
    if pb.im is None:
        return Pair(e.div(pa.re, pb.re), e.div(pa.im, pb.re))
    if isinstance(pb.re, fx.Node) or isinstance(pb.im, fx.Node):
        return _smith_div(e, pa, pb)
    den = e.add(e.mul(pb.re, pb.re), e.mul(pb.im, pb.im))
    re = e.add(e.mul(pa.re, pb.re), e.mul(pa.im, pb.im))
    im = e.sub(e.mul(pa.im, pb.re), e.mul(pa.re, pb.im))
    return Pair(e.div(re, den), e.div(im, den))


def _smith_div(e: _Emitter, pa: Pair, pb: Pair) -> Pair:
    """(a+bi)/(c+di) by Smith's algorithm, as ATen: scale by the ratio of the smaller to the
    larger of |c|, |d| instead of dividing by c² + d², which overflows for |c+di| above ~1.8e19
    in complex64 (a result of 0) and underflows below ~1e-19 (inf/nan)."""
    ref = pb.re if isinstance(pb.re, fx.Node) else pb.im
    c, d = e.dense(pb.re, ref), e.dense(pb.im, ref)
    big = e.call(torch.ge, e.f(torch.abs, c), e.f(torch.abs, d))  # |c| >= |d|
    rat = e.call(torch.where, big, e.div(d, c), e.div(c, d))  # smaller / larger
    den = e.call(torch.where, big, e.add(c, e.mul(d, rat)), e.add(d, e.mul(c, rat)))
    x, y = pa.re, pa.im
    re_big, re_small = e.add(x, e.mul(y, rat)), e.add(e.mul(x, rat), y)
    im_big, im_small = e.sub(y, e.mul(x, rat)), e.sub(e.mul(y, rat), x)

    def pick(u: Any, v: Any) -> Any:
        return e.call(torch.where, big, 0.0 if u is None else u, 0.0 if v is None else v)

    re, im = e.div(pick(re_big, re_small), den), e.div(pick(im_big, im_small), den)
    # 0/0 made rat, and so both parts, NaN; ATen divides each part by 0 instead (a complex inf
    # or NaN: 1j/0 = nan + inf i, 1/(0+0i) = inf + nan i)
    ac, ad = e.f(torch.abs, c), e.f(torch.abs, d)
    by_zero = e.call(torch.logical_and, e.call(operator.eq, ac, 0), e.call(operator.eq, ad, 0))
    x0, y0 = 0.0 if x is None else x, 0.0 if y is None else y
    return Pair(
        e.call(torch.where, by_zero, e.div(x0, ac), re),
        e.call(torch.where, by_zero, e.div(y0, ad), im),
    )


def c_abs(e: _Emitter, a: Pair) -> Any:
    if a.im is None:
        return e.f(torch.abs, a.re)
    # hypot, as ATen's complex abs: sqrt(x² + y²) overflows for |z| > ~1.8e19 in complex64 and
    # underflows to 0 below ~1e-19 (and log|z|, sqrt z and sgn z inherit that)
    return e.f(torch.hypot, a.re, a.im)


def _keep_zero(e: _Emitter, z: Any, zero: Any, value: Any) -> Any:
    """``zero`` where ``z == 0``, else ``value``: a product with a factor that is exactly 0
    (sin 0) is 0 in ATen's complex functions even where the other factor overflowed to inf,
    where the real formula computes inf * 0 = nan."""
    return e.call(torch.where, e.call(operator.eq, z, 0), zero, value)


def c_exp(e: _Emitter, a: Pair) -> Pair:
    ex = e.f(torch.exp, a.re)
    if a.im is None:
        return Pair(ex, None)
    cos_y, sin_y = e.f(torch.cos, a.im), e.f(torch.sin, a.im)
    im = _keep_zero(e, a.im, a.im, e.mul(ex, sin_y))  # e^x + 0i for y = ±0
    # e^x = 0 (x = -inf, as in 0 ** w = exp(w log 0)) gives 0 whatever y, even y = ±inf, with
    # the signs of cos y and sin y (exp(-1e38 - 1i) = 0 - 0i)
    re = _keep_zero(e, ex, e.f(torch.copysign, ex, cos_y), e.mul(ex, cos_y))
    return Pair(re, _keep_zero(e, ex, e.f(torch.copysign, ex, sin_y), im))


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


def c_angle(e: _Emitter, a: Pair) -> Any:
    return e.f(torch.atan2, e.dense(a.im, a.re), a.re)


def c_sqrt(e: _Emitter, a: Pair) -> Pair:
    # t = sqrt((|x| + |z|)/2), then sqrt z = t + i y/(2t) for x >= 0 and |y|/(2t) + i copysign(t, y)
    # for x < 0: the part that (|z| - |x|)/2 would give cancels (1 + 1e-3i: |z| - x lost every
    # digit but one in float32, the imaginary part was 2% off; -4 + 1e-5i had real part 0), and
    # quartering before adding keeps |z| and |x| + |z| from overflowing (3e38 + 3e38i gave inf):
    # t = sqrt 2 · sqrt(|x|/4 + |z/4|). Quartering a subnormal part drops its low bits (sqrt of
    # complex64 values near 1e-40 was 40 ulp off), so a z with both parts below 2^-60 is scaled
    # by 2^100 first, the result by 2^-50 after (powers of two: exact)
    x = a.re
    y = e.dense(a.im, x)
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


def c_sin(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.sin, a.re), None)
    # sin(±0 + iy) = ±0 + i sinh y, also where cosh y overflows
    re = _keep_zero(e, a.re, a.re, e.mul(e.f(torch.sin, a.re), e.f(torch.cosh, a.im)))
    im = e.mul(e.f(torch.cos, a.re), e.f(torch.sinh, a.im))
    return Pair(re, im)


def c_cos(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.cos, a.re), None)
    re = e.mul(e.f(torch.cos, a.re), e.f(torch.cosh, a.im))
    # cos(±0 + iy) = cosh y - i (±0 · sign y), also where sinh y overflows
    zero = e.neg(e.mul(a.re, e.f(torch.copysign, e.dense(1.0, a.im), a.im)))
    im = _keep_zero(e, a.re, zero, e.neg(e.mul(e.f(torch.sin, a.re), e.f(torch.sinh, a.im))))
    return Pair(re, im)


def c_tanh(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.tanh, a.re), None)
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
    return Pair(e.div(e.f(torch.tanh, x2), den), e.div(e.mul(sin_2y, sech), den))


def c_sigmoid(e: _Emitter, a: Pair) -> Pair:
    return c_div(e, 1.0, c_add(e, 1.0, c_exp(e, Pair(e.neg(a.re), e.neg(a.im)))))


def _xy(e: _Emitter, a: Pair) -> tuple[Any, Any]:
    """The parts of ``a`` as graph tensors (a known-zero imaginary part as +0)."""
    return a.re, e.dense(a.im, a.re)


def c_expm1(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.expm1, a.re), None)
    # e^z - 1 = (expm1 x cos y - 2 sin²(y/2)) + i e^x sin y: no cancellation of e^x cos y - 1
    # near z = 0
    x, y = a.re, a.im
    s = e.f(torch.sin, e.mul(y, 0.5))
    re = e.sub(e.mul(e.f(torch.expm1, x), e.f(torch.cos, y)), e.mul(e.mul(s, s), 2.0))
    ex = e.f(torch.exp, x)
    return Pair(re, _keep_zero(e, y, y, e.mul(ex, e.f(torch.sin, y))))


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
    return Pair(re, e.mul(e.sub(arg_p, arg_m), 0.5))


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


def c_matmul(e: _Emitter, mm: Callable[..., Any], a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)

    def prod(x: Any, y: Any) -> Any:
        return None if x is None or y is None else e.call(mm, x, y)

    return Pair(
        e.sub(prod(pa.re, pb.re), prod(pa.im, pb.im)), e.add(prod(pa.re, pb.im), prod(pa.im, pb.re))
    )


def c_pow(e: _Emitter, a: Pair, p: Any) -> Pair:
    if isinstance(p, int) and 0 <= p <= 4:
        out: Pair = Pair(e.dense(1.0, a.re), None)
        for _ in range(p):
            out = c_mul(e, out, a)
        return out
    return c_exp(e, c_mul(e, _pair(p), c_log(e, a)))


# --- rules: aten op → real decomposition -------------------------------------------------------

Rule = Callable[[Any, fx.Node, tuple[Any, ...], dict[str, Any]], Any]
RULES: dict[Any, Rule] = {}


def _rule(*ops: Any) -> Callable[[Rule], Rule]:
    def reg(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return reg


def _packets(*names: str) -> list[Any]:
    """Every overload of the named aten ops."""
    out: list[Any] = []
    for name in names:
        pkt = getattr(aten, name)
        out.extend(getattr(pkt, o) for o in pkt.overloads())
    return out


@_rule(*_packets("add"))
def _r_add(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_add(lw.e, a[0], a[1], kw.get("alpha", 1))  # (a+bi)+(c+di) = (a+c)+(b+d)i


@_rule(*_packets("sub"))
def _r_sub(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sub(lw.e, a[0], a[1], kw.get("alpha", 1))  # componentwise difference


@_rule(*_packets("rsub"))
def _r_rsub(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sub(lw.e, a[1], c_mul(lw.e, a[0], kw.get("alpha", 1)))  # b - alpha*a


@_rule(*_packets("mul"))
def _r_mul(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_mul(lw.e, a[0], a[1])  # (ac-bd) + (ad+bc)i


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
    return Pair(lw.e.neg(p.re), lw.e.neg(p.im))  # -z


@_rule(
    aten.conj.default, aten._conj.default, aten.conj_physical.default, aten._conj_physical.default
)
def _r_conj(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return Pair(p.re, lw.e.neg(p.im))  # conj(a+bi) = a-bi


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
    return c_exp(lw.e, _pair(a[0]))  # e^x (cos y + i sin y)


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
    return c_sin(lw.e, _pair(a[0]))  # sin x cosh y + i cos x sinh y


@_rule(aten.cos.default)
def _r_cos(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_cos(lw.e, _pair(a[0]))  # cos x cosh y - i sin x sinh y


@_rule(aten.tanh.default)
def _r_tanh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_tanh(lw.e, _pair(a[0]))  # (sinh 2x + i sin 2y)/(cosh 2x + cos 2y)


@_rule(aten.sigmoid.default)
def _r_sigmoid(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sigmoid(lw.e, _pair(a[0]))  # 1/(1+e^-z)


@_rule(*_packets("pow"))
def _r_pow(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    base, p = a[0], a[1]
    if isinstance(p, (Pair, fx.Node, complex)) or not isinstance(base, (Pair, fx.Node)):
        return c_exp(lw.e, c_mul(lw.e, p, c_log(lw.e, _pair(base))))  # z^w = e^(w log z)
    return c_pow(lw.e, _pair(base), p)  # small integer powers by repeated products


@_rule(aten.expm1.default)
def _r_expm1(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_expm1(lw.e, _pair(a[0]))  # e^z - 1


@_rule(aten.exp2.default)
def _r_exp2(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_exp(lw.e, c_mul(lw.e, _pair(a[0]), math.log(2.0)))  # 2^z = e^(z log 2)


@_rule(aten.log1p.default)
def _r_log1p(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_log1p(lw.e, _pair(a[0]))  # log(1 + z)


@_rule(aten.sinh.default)
def _r_sinh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    return _times_minus_i(e, c_sin(e, _times_i(e, _pair(a[0]))))  # sinh z = -i sin(iz)


@_rule(aten.cosh.default)
def _r_cosh(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_cos(lw.e, _times_i(lw.e, _pair(a[0])))  # cosh z = cos(iz)


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


@_rule(aten.linalg_vector_norm.default)
def _r_vector_norm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # every p-norm of a complex vector is that norm of the magnitudes |z|
    e = lw.e
    mag = c_abs(e, _pair(a[0]))
    if kw.get("dtype") is not None:
        mag = e.call(torch.Tensor.to, mag, _node_val(n).dtype)
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    return e.call(aten.linalg_vector_norm.default, mag, *a[1:], **kw)


@_rule(aten.view_as_real.default)
def _r_view_as_real(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.call(torch.stack, [p.re, lw.e.dense(p.im, p.re)], -1)  # [..., 2] real tensor


@_rule(aten.view_as_complex.default)
def _r_view_as_complex(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    return Pair(e.call(torch.select, a[0], -1, 0), e.call(torch.select, a[0], -1, 1))  # last dim


@_rule(aten.complex.default)
def _r_complex(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return Pair(a[0], a[1])  # complex(re, im)


@_rule(aten.real.default)
def _r_real(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return _pair(a[0]).re  # Re z


@_rule(aten.imag.default)
def _r_imag(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.dense(p.im, p.re)  # Im z


@_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _r_mm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    assert callable(n.target)
    return c_matmul(lw.e, n.target, a[0], a[1])  # four real products


@_rule(aten.addmm.default)
def _r_addmm(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    prod = c_matmul(lw.e, aten.mm.default, a[1], a[2])
    prod = c_mul(lw.e, prod, kw.get("alpha", 1))
    return c_add(lw.e, c_mul(lw.e, a[0], kw.get("beta", 1)), prod)  # beta*bias + alpha*A@B


def _componentwise(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """Apply a shape op or linear reduction to each part (a zero part stays zero)."""
    p = _pair(a[0])
    val = _node_val(n)
    if kw.get("dtype") is not None and _is_complex_val(val):
        # sum/mean/cumsum(dtype=complex128) of complex64 accumulate in the requested precision:
        # cast each part to its real dtype first, as ATen casts the input
        rdt = val.dtype.to_real()
        p = Pair(*(None if x is None else lw.e.call(torch.Tensor.to, x, rdt) for x in (p.re, p.im)))
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    re = lw.e.call(n.target, p.re, *a[1:], **kw)
    im = None if p.im is None else lw.e.call(n.target, p.im, *a[1:], **kw)
    return Pair(re, im)


for _op in _packets(
    "view",
    "_unsafe_view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "index",
    "index_select",
    "gather",
    "clone",
    "flip",
    "roll",
    "repeat",
    "sum",
    "mean",
    "cumsum",
    "trace",
    "tril",
    "triu",
    "diagonal",
    "split",
    "split_with_sizes",
    "unbind",
    "narrow",
    "squeeze_copy",
    "view_copy",
    "permute_copy",
    "expand_copy",
    "slice_copy",
    "select_copy",
    "unsqueeze_copy",
    "transpose_copy",
    "t_copy",
    "alias_copy",
):
    RULES[_op] = _componentwise


def _views_an_input(x: Any) -> bool:
    """True if graph value ``x`` is a graph input or a view of one (through aliasing ops)."""
    while isinstance(x, fx.Node):
        if x.op == "placeholder":
            return True
        if x.target is operator.getitem:  # one output of split/unbind/chunk: a view of its input
            x = x.args[0]
            continue
        schema = getattr(x.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return False
        x = x.args[0] if x.args else None
    return False


@_rule(*_packets("as_strided"))
def _r_as_strided(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # as_strided addresses the storage, not the tensor. A complex graph input enters as its
    # real/imag views, which address the interleaved complex storage in real elements (strides
    # and offset doubled), so applying the same size/stride/offset to each part would read real
    # and imaginary values mixed; an intermediate's parts are dense buffers laid out like the
    # complex one, where applying it to each part is exact.
    if _views_an_input(n.args[0]):
        raise ComplexDecompositionError(
            f"{n.target} on a complex graph input (or a view of one) is not supported by "
            f"torchport complex compilation (node {n.name!r}): it addresses the complex storage, "
            "which the real/imaginary split does not keep; compile with complex=False"
        )
    return _componentwise(lw, n, a, kw)


@_rule(*_packets("constant_pad_nd"))
def _r_constant_pad(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # the fill is a complex number: its real part pads the real part, its imaginary part the
    # imaginary part (a real fill v pads with v + 0i, so the imaginary part with 0, not v)
    e, p = lw.e, _pair(a[0])
    fill = _pair(a[2] if len(a) > 2 else kw.get("value", 0.0))
    re = e.call(n.target, p.re, a[1], 0.0 if fill.re is None else fill.re)
    if p.im is None and fill.im is None:
        return Pair(re, None)
    im_fill = 0.0 if fill.im is None else fill.im
    return Pair(re, e.call(n.target, e.dense(p.im, p.re), a[1], im_fill))


def _scatter(src_pos: int) -> Rule:
    """A rule for an op that writes ``args[src_pos]`` into (a copy of) ``args[0]`` at positions its
    other arguments name: the backward of slicing, selecting and indexing (``slice_scatter``,
    ``select_scatter``, ``index_put``, ...). Both parts scatter alike."""

    def rule(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        e, dst, src = lw.e, _pair(a[0]), _pair(a[src_pos])

        def part(d: Any, s: Any) -> Any:
            args = list(a)
            args[0], args[src_pos] = d, s
            return e.call(n.target, *args, **kw)

        re = part(dst.re, src.re)
        if not _is_complex_val(_node_val(n)):
            return re  # a complex src written into a real tensor keeps its real part
        if dst.im is None and src.im is None:
            return Pair(re, None)
        return Pair(re, part(e.dense(dst.im, dst.re), e.dense(src.im, src.re)))

    return rule


# copy(self, src): src in self's shape and dtype (an in-place write such as y[0] = 1j)
for _op in _packets("slice_scatter", "select_scatter", "diagonal_scatter", "copy"):
    RULES[_op] = _scatter(1)
for _op in _packets("index_put"):
    RULES[_op] = _scatter(2)
# gather's and index_select's gradients: scatter_add / index_add of the gradient into zeros
for _op in (aten.scatter.src, aten.scatter_add.default):
    RULES[_op] = _scatter(3)


@_rule(aten.index_add.default)
def _r_index_add(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if isinstance(kw.get("alpha", 1), Pair):  # a complex alpha would mix the parts
        raise ComplexDecompositionError(f"{n.target}: a complex alpha is not supported")
    return _scatter(3)(lw, n, a, kw)  # self + alpha * source at index, per part


@_rule(operator.getitem)
def _r_getitem(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = a[0]
    if isinstance(p, (tuple, list)):  # one result of a rule that returns several (inv_ex)
        return p[a[1]]
    assert isinstance(p, Pair)
    im = None if p.im is None else lw.e.call(operator.getitem, p.im, a[1])
    return Pair(lw.e.call(operator.getitem, p.re, a[1]), im)  # element of a split/unbind


@_rule(*_packets("cat", "stack"))
def _r_cat(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    parts = [_pair(x) for x in a[0]]
    e = lw.e
    re = e.call(n.target, [p.re for p in parts], *a[1:], **kw)
    if all(p.im is None for p in parts):
        return Pair(re, None)
    im = e.call(n.target, [e.dense(p.im, p.re) for p in parts], *a[1:], **kw)
    return Pair(re, im)  # concatenate each part


@_rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _r_where(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, x, y = lw.e, _pair(a[1]), _pair(a[2])
    re = e.call(torch.where, a[0], x.re, y.re)
    if x.im is None and y.im is None:
        return Pair(re, None)
    return Pair(
        re, e.call(torch.where, a[0], 0.0 if x.im is None else x.im, 0.0 if y.im is None else y.im)
    )


@_rule(aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor)
def _r_eq(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, x, y = lw.e, _pair(a[0]), _pair(a[1])
    ref = x.re if isinstance(x.re, fx.Node) else y.re
    same_re = (
        e.call(torch.eq, x.re, y.re) if isinstance(x.re, fx.Node) else e.call(torch.eq, y.re, x.re)
    )
    xi, yi = e.dense(x.im, ref), (0.0 if y.im is None else y.im)
    both = e.call(torch.logical_and, same_re, e.call(torch.eq, xi, yi))
    return both if n.target in (aten.eq.Scalar, aten.eq.Tensor) else e.call(torch.logical_not, both)


def _fill_value(v: Any) -> complex:
    """A fill scalar as a complex number (the lowering maps a complex constant to a Pair)."""
    if isinstance(v, Pair):
        return complex(v.re, 0.0 if v.im is None else v.im)
    return complex(v)


@_rule(aten.full.default, aten.scalar_tensor.default)
def _r_full(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    kw = dict(kw)
    kw["dtype"] = val.dtype.to_real()
    fill = _fill_value(a[-1] if n.target is aten.full.default else a[0])
    if n.target is aten.full.default:
        re = lw.e.call(aten.full.default, a[0], fill.real, **kw)
        im = lw.e.call(aten.full.default, a[0], fill.imag, **kw) if fill.imag else None
    else:
        re = lw.e.call(aten.scalar_tensor.default, fill.real, **kw)
        im = lw.e.call(aten.scalar_tensor.default, fill.imag, **kw) if fill.imag else None
    return Pair(re, im)  # constant parts


@_rule(aten.empty_permuted.default, aten.empty.memory_format, aten.empty_strided.default)
def _r_empty(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # an uninitialised complex buffer (the ``ones_like`` of atanh's gradient, then filled):
    # a real one in the real dtype; its imaginary part is as undefined as zero
    kw = dict(kw)
    kw["dtype"] = _node_val(n).dtype.to_real()
    return Pair(lw.e.call(n.target, *a, **kw), None)


@_rule(
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default
)
def _r_full_like(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    kw = {k: v for k, v in kw.items() if k not in ("dtype", "memory_format")}
    ref = _pair(a[0]).re
    if n.target is aten.full_like.default:
        fill = _fill_value(a[1])
    else:
        fill = 1 + 0j if n.target is aten.ones_like.default else 0j
    if _is_complex_val(val):
        rdt = val.dtype.to_real()
        re = lw.e.call(torch.full_like, ref, fill.real, dtype=rdt, **kw)
        im = lw.e.call(torch.full_like, ref, fill.imag, dtype=rdt, **kw) if fill.imag else None
        return Pair(re, im)
    return lw.e.call(torch.full_like, ref, fill.real, dtype=val.dtype, **kw)


@_rule(aten._to_copy.default, aten.to.dtype)
def _r_to(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    x = _pair(a[0])
    if _is_complex_val(val):
        rdt = val.dtype.to_real()
        re = lw.e.call(torch.Tensor.to, x.re, rdt)
        return Pair(re, None if x.im is None else lw.e.call(torch.Tensor.to, x.im, rdt))
    return lw.e.call(torch.Tensor.to, x.re, val.dtype)  # complex → real keeps the real part


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
        return e.call(torch.complex, x.re, e.dense(x.im, x.re))

    out = e.call(n.target, *(whole(x) for x in a), **kw)
    if _is_complex_val(_node_val(n)):
        return Pair(e.call(torch.real, out), e.call(torch.imag, out))
    return out
