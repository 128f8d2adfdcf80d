"""Core of the complex decomposition: the (real, imag) :class:`Pair`, the graph emitter, complex
arithmetic on pairs, and the rule type.

The rules live in themed modules (:mod:`~torchport.compiler.complex_elementwise`,
:mod:`~torchport.compiler.complex_reductions`, :mod:`~torchport.compiler.complex_shape`,
:mod:`~torchport.compiler.complex_linalg`), each with its own table;
:mod:`torchport.compiler.complex_rules` collects them into the one table the lowering reads.
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
    """A complex value as two real graph values; ``im is None`` means the imaginary part is 0:
    +0, or -0 where ``neg_zero`` says so (a negated or conjugated real-valued complex value,
    a complex number's -0j). Only what eager computes with that zero reads its sign (ATen's
    products, :func:`c_mul_promoted` and :func:`c_add_scaled`, and the dense part)."""

    re: Any
    im: Any
    neg_zero: bool = False


def _is_complex_val(v: object) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


def _node_val(n: object) -> Any:
    return n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None


def same_traced_shape(v: object, val: object) -> bool:
    """True when ``v`` and ``val`` are tensors whose shapes are statically known equal (a
    symbolic size counts only where the shape environment proves it)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(v, torch.Tensor) or not isinstance(val, torch.Tensor):
        return False
    if v.dim() != val.dim():
        return False
    return all(statically_known_true(d == w) for d, w in zip(v.shape, val.shape))


def operands_have_its_shape(n: fx.Node) -> bool:
    """True when every graph operand of ``n`` has ``n``'s traced shape (statically): no operand
    is broadcast, so parts taken from one operand have the result's shape."""
    val = _node_val(n)
    if not isinstance(val, torch.Tensor):
        return False
    for x in n.args:
        if not isinstance(x, fx.Node):
            continue
        v = _node_val(x)
        if v is None:
            return False
        if not isinstance(v, torch.Tensor):
            continue  # a SymInt alpha or size
        if not same_traced_shape(v, val):
            return False
    return True


def broadcast_parts(e: _Emitter, re: Any, im: Any) -> Pair:
    """``Pair(re, im)`` with both parts expanded to their broadcast shape (views)."""
    both = e.call(torch.broadcast_tensors, re, im)
    return Pair(e.call(operator.getitem, both, 0), e.call(operator.getitem, both, 1))


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
            # 0 - b, not -b: they differ for b = +0 (+0 vs -0), and ATen computes with the zero
            # (1/(2 + 0i) = 0.5 + 0i, not 0.5 - 0i); same cost, one op either way
            return -b if isinstance(b, (int, float)) and b != 0 else self.sub(0.0, b)
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

    def dense_im(self, p: Pair, ref: Any) -> Any:
        """``p``'s imaginary part as a graph tensor: a known zero with its sign."""
        return self.dense(zero_im(p) if p.im is None and p.neg_zero else p.im, ref)

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
        if v.imag != 0:
            return Pair(v.real, v.imag)
        return Pair(v.real, None, math.copysign(1.0, v.imag) < 0)  # 2 - 0j keeps its -0
    return Pair(v, None)


def zero_im(p: Pair) -> float:
    """The known-zero imaginary part of ``p`` (``im is None``) as a signed number."""
    return -0.0 if p.neg_zero else 0.0


# --- complex arithmetic on Pairs -------------------------------------------------------------


def c_add(e: _Emitter, a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)
    return Pair(e.add(pa.re, pb.re), e.add(pa.im, pb.im))


def c_sub(e: _Emitter, a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)
    return Pair(e.sub(pa.re, pb.re), e.sub(pa.im, pb.im))


def c_add_scaled(e: _Emitter, a: Any, b: Any, alpha_re: Any, alpha_im: Any) -> Pair:
    """``a + alpha·b`` as ATen's add kernel computes it (``sub`` passes ``-alpha``): a full
    complex product in which alpha's imaginary part and any known-zero part take part, so
    ``1 + 2·(inf + 0i)`` is inf + NaN i (2·0 + 0·inf) and ``-0 + 1·(-0 - 0i)`` has real part +0,
    as in eager. A known-zero real part counts as +0, a known-zero imaginary part with its sign."""
    pb = _pair(b)
    c, d = (0.0 if pb.re is None else pb.re), (zero_im(pb) if pb.im is None else pb.im)
    t_re = e.sub(e.mul(c, alpha_re), e.mul(d, alpha_im))
    t_im = e.add(e.mul(d, alpha_re), e.mul(c, alpha_im))
    return c_add_product(e, a, t_re, t_im)


def c_add_product(e: _Emitter, a: Any, t_re: Any, t_im: Any) -> Pair:
    """``a + t`` for the product ``t = t_re + t_im·i`` of :func:`c_add_scaled` (or one computed
    in the node's precision): ``a``'s known-zero parts take part as in ATen's sum (a real part
    as +0, an imaginary one with its sign)."""
    pa = _pair(a)
    x, y = (0.0 if pa.re is None else pa.re), (zero_im(pa) if pa.im is None else pa.im)
    return Pair(e.add(x, t_re), e.add(y, t_im))


def c_mul(e: _Emitter, a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)
    re = e.sub(e.mul(pa.re, pb.re), e.mul(pa.im, pb.im))
    im = e.add(e.mul(pa.re, pb.im), e.mul(pa.im, pb.re))
    return Pair(re, im)


def c_mul_promoted(e: _Emitter, a: Any, b: Any) -> Pair:
    """``a·b`` as ATen's complex mul kernel computes it: a real operand is promoted to complex
    first and its imaginary part +0 takes part in the products, so (inf + 0i)·2 is inf + NaN i
    (inf·0 + 0·2), (nan + 0i)² is nan + nan i and (-2 + 0i)² is 4 - 0i, as in eager, where
    :func:`c_mul` leaves those products out (inf + 0i, nan + 0i, 4 + 0i). A known-zero
    imaginary part takes part with its sign ((-2 - 0i)² is 4 + 0i). Each known zero costs one
    product with it and one add, not a full complex product; a square of a real-valued complex
    costs one op (a·z + z·a is a·z)."""
    pa, pb = _pair(a), _pair(b)
    if pa.im is not None and pb.im is not None:
        return c_mul(e, pa, pb)
    if pa.im is None and pb.im is None:
        # (a + za·i)(c + zb·i) = (ac - za·zb) + (a·zb + za·c)i. ac - (+0) is ac for every ac;
        # ac - (-0) turns a -0 product to +0, and a·a is never -0
        za, zb = zero_im(pa), zero_im(pb)
        re = e.mul(pa.re, pb.re)
        if not (pb.re is pa.re or _is_plus_zero(za * zb)):
            re = e.sub(re, -0.0)
        t = e.mul(pa.re, zb)
        if pb.re is pa.re and pa.neg_zero == pb.neg_zero:
            return Pair(re, t)  # a·z is ±0 or NaN, and so is its sum with itself
        return Pair(re, e.add(t, e.mul(za, pb.re)))
    if pa.im is None:
        pa, pb = pb, pa  # the product is symmetric, bit for bit (x·c - y·0 is c·x - 0·y)
    (x, y), c, zc = (pa.re, pa.im), pb.re, zero_im(pb)
    yz = e.mul(y, zc)
    # x·c - (+0) is x·c (a number y makes one: 1j * x), so only a graph value, -0 or NaN is
    # subtracted
    re = (
        e.mul(x, c)
        if isinstance(yz, (int, float)) and _is_plus_zero(yz)
        else e.sub(e.mul(x, c), yz)
    )
    return Pair(re, e.add(e.mul(x, zc), e.mul(y, c)))


def c_mul_c99(e: _Emitter, a: Any, b: Any) -> Pair:
    """``a·b`` as C's complex multiply (C99 Annex G, libgcc's ``__mulsc3``/``__muldc3``), the
    product glibc's ``cpow`` takes of ``w·log z``, and so eager's complex pow: ATen's product
    (:func:`c_mul_promoted`), and where both its parts are NaN although a part of an operand or
    a partial product is infinite, the product recomputed times inf, with each infinite part
    boxed to ±1, the other part of that operand set to 0, and NaN parts to 0. So 0 ** (3 + NaN i)
    is 0 - 0i (w·log 0 = (3 + NaN i)(-inf + 0i) is -inf + NaN i there) and 2 ** (inf + inf i)
    inf + NaN i; both were NaN + NaN i. The recovery is a masked fix-up of 38 elementwise ops:
    where a part of the product is not NaN, ATen's product is the result.
    :func:`c_mul_c99_reference` is the same steps on numbers."""
    prod = c_mul_promoted(e, a, b)
    pa, pb = _pair(a), _pair(b)
    ref = prod.re if isinstance(prod.re, fx.Node) else prod.im
    assert isinstance(ref, fx.Node), "c_mul_c99 needs a graph operand"
    x, y = e.dense(prod.re, ref), e.dense(prod.im, ref)
    parts = (e.dense(pa.re, ref), e.dense_im(pa, ref), e.dense(pb.re, ref), e.dense_im(pb, ref))
    inf = [e.f(torch.isinf, v) for v in parts]
    a_inf, b_inf = e.call(torch.logical_or, inf[0], inf[1]), e.call(torch.logical_or, *inf[2:])

    def box(v: Any, v_inf: Any, op_inf: Any) -> Any:
        # ±inf to ±1 and NaN to 0; a finite part to 0 beside an infinite one (the sign of a zero
        # is immaterial: the products are multiplied by inf, and inf·±0 is the same NaN)
        kept = e.f(torch.nan_to_num, v, nan=0.0, posinf=1.0, neginf=-1.0)
        return e.call(torch.where, e.call(torch.logical_xor, op_inf, v_inf), 0.0, kept)

    p, q = box(parts[0], inf[0], a_inf), box(parts[1], inf[1], a_inf)
    r, s = box(parts[2], inf[2], b_inf), box(parts[3], inf[3], b_inf)
    t_re, t_im = e.sub(e.mul(p, r), e.mul(q, s)), e.add(e.mul(p, s), e.mul(q, r))
    # C recomputes if an operand has an infinite part or a partial product overflowed. Where
    # both parts are NaN and no operand part is infinite, an operand part is NaN, so each of
    # t_re, t_im is one partial product (the other is 0): it is infinite where one overflowed
    finite_t = e.call(torch.logical_and, e.f(torch.isfinite, t_re), e.f(torch.isfinite, t_im))
    recalc = e.call(
        torch.logical_or,
        e.call(torch.logical_or, a_inf, b_inf),
        e.call(torch.logical_not, finite_t),
    )
    both_nan = e.call(torch.logical_and, e.f(torch.isnan, x), e.f(torch.isnan, y))
    fix = e.call(torch.logical_and, both_nan, recalc)
    re, im = e.mul(t_re, math.inf), e.mul(t_im, math.inf)
    return Pair(e.call(torch.where, fix, re, x), e.call(torch.where, fix, im, y))


def c_mul_c99_reference(a: complex, b: complex) -> complex:
    """:func:`c_mul_c99` on Python numbers (double precision), step by step as libgcc's
    ``__muldc3``, for tests."""
    p, q, r, s = a.real, a.imag, b.real, b.imag
    ac, bd, ad, bc = p * r, q * s, p * s, q * r
    x, y = ac - bd, ad + bc
    if not (math.isnan(x) and math.isnan(y)):
        return complex(x, y)
    recalc = False
    if math.isinf(p) or math.isinf(q):
        p = math.copysign(1.0 if math.isinf(p) else 0.0, p)
        q = math.copysign(1.0 if math.isinf(q) else 0.0, q)
        r, s = (math.copysign(0.0, v) if math.isnan(v) else v for v in (r, s))
        recalc = True
    if math.isinf(r) or math.isinf(s):
        r = math.copysign(1.0 if math.isinf(r) else 0.0, r)
        s = math.copysign(1.0 if math.isinf(s) else 0.0, s)
        p, q = (math.copysign(0.0, v) if math.isnan(v) else v for v in (p, q))
        recalc = True
    if not recalc and any(math.isinf(v) for v in (ac, bd, ad, bc)):
        p, q, r, s = (math.copysign(0.0, v) if math.isnan(v) else v for v in (p, q, r, s))
        recalc = True
    if recalc:
        x, y = math.inf * (p * r - q * s), math.inf * (p * s + q * r)
    return complex(x, y)


def _is_plus_zero(v: float) -> bool:
    return v == 0 and math.copysign(1.0, v) > 0


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
    # a real (or imaginary) numerator's zero part takes part as +0, as in ATen, where it decides
    # signs of zero results: 1/(0 - 1i) = -0 + 1i ((+0 · -0 + 0)/-1), not +0 + 1i
    x, y = (0.0 if pa.re is None else pa.re), (0.0 if pa.im is None else pa.im)
    re_big, re_small = e.add(x, e.mul(y, rat)), e.add(e.mul(x, rat), y)
    im_big, im_small = e.sub(y, e.mul(x, rat)), e.sub(e.mul(y, rat), x)

    def pick(u: Any, v: Any) -> Any:
        return e.call(torch.where, big, 0.0 if u is None else u, 0.0 if v is None else v)

    # times 1/den, as ATen (c10::complex's operator/=), not divided by den: the two differ in
    # rounding, and where 1/den overflows (|b| below ~3e-39 in complex64) 0/(1e-40i) is NaN + NaN i
    # and 1/(1e-40 + 0i) inf + NaN i there, where the quotient gave 0 and inf + 0i
    scl = e.div(1.0, den)
    re, im = e.mul(pick(re_big, re_small), scl), e.mul(pick(im_big, im_small), scl)
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


def c_angle(e: _Emitter, a: Pair) -> Any:
    return e.f(torch.atan2, e.dense_im(a, a.re), a.re)  # atan2(-0, x < 0) = -π, as eager


# --- rule tables ------------------------------------------------------------------------------

Rule = Callable[[Any, fx.Node, tuple[Any, ...], dict[str, Any]], Any]


def registrar(table: dict[Any, Rule]) -> Callable[..., Callable[[Rule], Rule]]:
    """A decorator ``rule(*ops)`` that enters the decorated rule in ``table`` for each op (each
    themed module keeps its own table; :mod:`torchport.compiler.complex_rules` collects them)."""

    def rule(*ops: Any) -> Callable[[Rule], Rule]:
        def reg(fn: Rule) -> Rule:
            for op in ops:
                table[op] = fn
            return fn

        return reg

    return rule


def _packets(*names: str) -> list[Any]:
    """Every overload of the named aten ops."""
    out: list[Any] = []
    for name in names:
        pkt = getattr(aten, name)
        out.extend(getattr(pkt, o) for o in pkt.overloads())
    return out
