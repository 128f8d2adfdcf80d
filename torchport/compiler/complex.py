"""Complex-number compilation: rewrite complex graphs into real ones, forward and backward.

torch 2.13's Inductor has no code generation for complex operators (it warns and falls back to
ATen per op), and ``torch._functorch.config.enable_complex_wrapper`` fails on CPU. Here every
complex tensor of an aten graph (as produced by AOTAutograd, so both the forward and the backward
graph) becomes a pair ``(real, imag)`` of real tensors (``imag`` may be known zero), and every op on
complex values becomes real ops, one rule per op in :data:`RULES`:

    (a+bi)(c+di) = (ac - bd) + (ad + bc)i          exp(x+iy) = e^x cos y + i e^x sin y
    (a+bi)/(c+di) = ((ac+bd) + (bc-ad)i)/(c²+d²)    log z = log|z| + i atan2(y, x)
    A@B = (Ar@Br - Ai@Bi) + (Ar@Bi + Ai@Br)i        sqrt z = sqrt((|z|+x)/2) + i copysign(sqrt((|z|-x)/2), y)

Shape ops (view, permute, slice, select, index, cat, stack, ...) and linear reductions (sum, mean)
apply to both parts. Complex graph inputs are split at the boundary (``x.real``/``x.imag`` views),
complex outputs are rebuilt with ``torch.complex``. An op with complex inputs or outputs and no rule
raises :class:`ComplexDecompositionError` naming the op — never a silent fallback.

Numerics: the real graph computes the same formulas as ATen's complex kernels in the parts' real
dtype (float32 for complex64, float64 for complex128); results match eager to rounding (the tests
compare with ``rtol=1e-5`` in complex64 and run ``gradcheck`` in complex128).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
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


def graph_has_complex(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> bool:
    """True if any input or node value of the graph is a complex tensor."""
    if any(_is_complex_val(x) for x in example_inputs):
        return True
    for n in gm.graph.nodes:
        v = _node_val(n)
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(_is_complex_val(x) for x in vals):
            return True
    return False


class _Emitter:
    """Builds the real graph; arithmetic helpers treat ``None`` as an exact zero."""

    def __init__(self, graph: fx.Graph) -> None:
        self.g = graph

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
    den = e.add(e.mul(pb.re, pb.re), e.mul(pb.im, pb.im))
    re = e.add(e.mul(pa.re, pb.re), e.mul(pa.im, pb.im))
    im = e.sub(e.mul(pa.im, pb.re), e.mul(pa.re, pb.im))
    return Pair(e.div(re, den), e.div(im, den))


def c_abs(e: _Emitter, a: Pair) -> Any:
    if a.im is None:
        return e.f(torch.abs, a.re)
    return e.f(torch.sqrt, e.add(e.mul(a.re, a.re), e.mul(a.im, a.im)))


def c_exp(e: _Emitter, a: Pair) -> Pair:
    ex = e.f(torch.exp, a.re)
    if a.im is None:
        return Pair(ex, None)
    return Pair(e.mul(ex, e.f(torch.cos, a.im)), e.mul(ex, e.f(torch.sin, a.im)))


def c_log(e: _Emitter, a: Pair) -> Pair:
    return Pair(e.f(torch.log, c_abs(e, a)), c_angle(e, a))


def c_angle(e: _Emitter, a: Pair) -> Any:
    return e.f(torch.atan2, e.dense(a.im, a.re), a.re)


def c_sqrt(e: _Emitter, a: Pair) -> Pair:
    r = c_abs(e, a)
    re = e.f(torch.sqrt, e.mul(e.add(r, a.re), 0.5))
    mag = e.f(torch.sqrt, e.f(torch.clamp_min, e.mul(e.sub(r, a.re), 0.5), 0.0))
    return Pair(re, e.f(torch.copysign, mag, e.dense(a.im, a.re)))


def c_sin(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.sin, a.re), None)
    re = e.mul(e.f(torch.sin, a.re), e.f(torch.cosh, a.im))
    im = e.mul(e.f(torch.cos, a.re), e.f(torch.sinh, a.im))
    return Pair(re, im)


def c_cos(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.cos, a.re), None)
    re = e.mul(e.f(torch.cos, a.re), e.f(torch.cosh, a.im))
    im = e.neg(e.mul(e.f(torch.sin, a.re), e.f(torch.sinh, a.im)))
    return Pair(re, im)


def c_tanh(e: _Emitter, a: Pair) -> Pair:
    if a.im is None:
        return Pair(e.f(torch.tanh, a.re), None)
    x2, y2 = e.mul(a.re, 2.0), e.mul(a.im, 2.0)
    den = e.add(e.f(torch.cosh, x2), e.f(torch.cos, y2))
    return Pair(e.div(e.f(torch.sinh, x2), den), e.div(e.f(torch.sin, y2), den))


def c_sigmoid(e: _Emitter, a: Pair) -> Pair:
    return c_div(e, 1.0, c_add(e, 1.0, c_exp(e, Pair(e.neg(a.re), e.neg(a.im)))))


def c_matmul(e: _Emitter, mm: Callable[..., Any], a: Any, b: Any) -> Pair:
    pa, pb = _pair(a), _pair(b)

    def prod(x: Any, y: Any) -> Any:
        return None if x is None or y is None else e.call(mm, x, y)

    return Pair(e.sub(prod(pa.re, pb.re), prod(pa.im, pb.im)), e.add(prod(pa.re, pb.im), prod(pa.im, pb.re)))


def c_pow(e: _Emitter, a: Pair, p: Any) -> Pair:
    if isinstance(p, int) and 0 <= p <= 4:
        out: Pair = Pair(e.dense(1.0, a.re), None)
        for _ in range(p):
            out = c_mul(e, out, a)
        return out
    return c_exp(e, c_mul(e, _pair(p), c_log(e, a)))


# --- rules: aten op → real decomposition -------------------------------------------------------

Rule = Callable[["_Lowering", fx.Node, tuple[Any, ...], dict[str, Any]], Any]
RULES: dict[Any, Rule] = {}


def _rule(*ops: Any) -> Callable[[Rule], Rule]:
    def reg(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return reg


def _packets(*names: str) -> list[Any]:
    """Every overload of the named aten ops."""
    out = []
    for name in names:
        pkt = getattr(aten, name)
        out.extend(getattr(pkt, o) for o in pkt.overloads())
    return out


@_rule(*_packets("add"))
def _r_add(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_add(lw.e, a[0], a[1], kw.get("alpha", 1))  # (a+bi)+(c+di) = (a+c)+(b+d)i


@_rule(*_packets("sub"))
def _r_sub(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sub(lw.e, a[0], a[1], kw.get("alpha", 1))  # componentwise difference


@_rule(*_packets("rsub"))
def _r_rsub(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sub(lw.e, a[1], c_mul(lw.e, a[0], kw.get("alpha", 1)))  # b - alpha*a


@_rule(*_packets("mul"))
def _r_mul(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_mul(lw.e, a[0], a[1])  # (ac-bd) + (ad+bc)i


@_rule(*_packets("div"))
def _r_div(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if kw.get("rounding_mode") is not None:
        raise ComplexDecompositionError(f"{n.target}: rounding_mode is undefined for complex")
    return c_div(lw.e, a[0], a[1])  # multiply by conj, divide by |b|²


@_rule(aten.reciprocal.default)
def _r_recip(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_div(lw.e, 1.0, a[0])  # 1/z


@_rule(aten.neg.default)
def _r_neg(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return Pair(lw.e.neg(p.re), lw.e.neg(p.im))  # -z


@_rule(aten.conj.default, aten._conj.default, aten.conj_physical.default, aten._conj_physical.default)
def _r_conj(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return Pair(p.re, lw.e.neg(p.im))  # conj(a+bi) = a-bi


@_rule(
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
)
def _r_identity(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return a[0]  # lazy-bit resolution and aliasing do not change the value


@_rule(aten.exp.default)
def _r_exp(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_exp(lw.e, _pair(a[0]))  # e^x (cos y + i sin y)


@_rule(aten.log.default)
def _r_log(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_log(lw.e, _pair(a[0]))  # log|z| + i arg z


@_rule(aten.sqrt.default)
def _r_sqrt(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sqrt(lw.e, _pair(a[0]))  # principal square root


@_rule(aten.rsqrt.default)
def _r_rsqrt(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_div(lw.e, 1.0, c_sqrt(lw.e, _pair(a[0])))  # 1/sqrt z


@_rule(aten.sin.default)
def _r_sin(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sin(lw.e, _pair(a[0]))  # sin x cosh y + i cos x sinh y


@_rule(aten.cos.default)
def _r_cos(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_cos(lw.e, _pair(a[0]))  # cos x cosh y - i sin x sinh y


@_rule(aten.tanh.default)
def _r_tanh(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_tanh(lw.e, _pair(a[0]))  # (sinh 2x + i sin 2y)/(cosh 2x + cos 2y)


@_rule(aten.sigmoid.default)
def _r_sigmoid(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_sigmoid(lw.e, _pair(a[0]))  # 1/(1+e^-z)


@_rule(*_packets("pow"))
def _r_pow(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    base, p = a[0], a[1]
    if isinstance(p, (Pair, fx.Node)) or isinstance(base, (int, float, complex)):
        if isinstance(base, Pair) or isinstance(base, complex) or isinstance(p, Pair):
            return c_exp(lw.e, c_mul(lw.e, p, c_log(lw.e, _pair(base))))  # z^w = e^(w log z)
    return c_pow(lw.e, _pair(base), p)  # small integer powers by repeated products


@_rule(aten.abs.default)
def _r_abs(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_abs(lw.e, _pair(a[0]))  # sqrt(x² + y²) (a real tensor)


@_rule(aten.angle.default)
def _r_angle(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_angle(lw.e, _pair(a[0]))  # atan2(y, x) (a real tensor)


@_rule(aten.sgn.default)
def _r_sgn(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, p = lw.e, _pair(a[0])
    r = c_abs(e, p)
    zero = e.call(operator.eq, r, 0)
    safe = e.call(torch.where, zero, 1.0, r)
    q = c_div(e, p, safe)
    return Pair(e.call(torch.where, zero, 0.0, q.re), e.call(torch.where, zero, 0.0, e.dense(q.im, q.re)))  # z/|z|, 0 at 0


@_rule(aten.view_as_real.default)
def _r_view_as_real(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.call(torch.stack, [p.re, lw.e.dense(p.im, p.re)], -1)  # [..., 2] real tensor


@_rule(aten.view_as_complex.default)
def _r_view_as_complex(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    return Pair(e.call(torch.select, a[0], -1, 0), e.call(torch.select, a[0], -1, 1))  # last dim


@_rule(aten.complex.default)
def _r_complex(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return Pair(a[0], a[1])  # complex(re, im)


@_rule(aten.real.default)
def _r_real(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return _pair(a[0]).re  # Re z


@_rule(aten.imag.default)
def _r_imag(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.dense(p.im, p.re)  # Im z


@_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _r_mm(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return c_matmul(lw.e, n.target, a[0], a[1])  # four real products


@_rule(aten.addmm.default)
def _r_addmm(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    prod = c_matmul(lw.e, aten.mm.default, a[1], a[2])
    prod = c_mul(lw.e, prod, kw.get("alpha", 1))
    return c_add(lw.e, c_mul(lw.e, a[0], kw.get("beta", 1)), prod)  # beta*bias + alpha*A@B


def _componentwise(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """Apply a shape op or linear reduction to each part (a zero part stays zero)."""
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    p = _pair(a[0])
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
    "clone",
    "flip",
    "roll",
    "repeat",
    "sum",
    "mean",
    "cumsum",
    "constant_pad_nd",
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
    "as_strided",
):
    RULES[_op] = _componentwise


@_rule(operator.getitem)
def _r_getitem(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = a[0]
    assert isinstance(p, Pair)
    im = None if p.im is None else lw.e.call(operator.getitem, p.im, a[1])
    return Pair(lw.e.call(operator.getitem, p.re, a[1]), im)  # element of a split/unbind


@_rule(*_packets("cat", "stack"))
def _r_cat(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    parts = [_pair(x) for x in a[0]]
    e = lw.e
    re = e.call(n.target, [p.re for p in parts], *a[1:], **kw)
    if all(p.im is None for p in parts):
        return Pair(re, None)
    im = e.call(n.target, [e.dense(p.im, p.re) for p in parts], *a[1:], **kw)
    return Pair(re, im)  # concatenate each part


@_rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _r_where(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, x, y = lw.e, _pair(a[1]), _pair(a[2])
    re = e.call(torch.where, a[0], x.re, y.re)
    if x.im is None and y.im is None:
        return Pair(re, None)
    return Pair(re, e.call(torch.where, a[0], 0.0 if x.im is None else x.im, 0.0 if y.im is None else y.im))


@_rule(aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor)
def _r_eq(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, x, y = lw.e, _pair(a[0]), _pair(a[1])
    ref = x.re if isinstance(x.re, fx.Node) else y.re
    same_re = e.call(torch.eq, x.re, y.re) if isinstance(x.re, fx.Node) else e.call(torch.eq, y.re, x.re)
    xi, yi = e.dense(x.im, ref), (0.0 if y.im is None else y.im)
    both = e.call(torch.logical_and, same_re, e.call(torch.eq, xi, yi))
    return both if n.target in (aten.eq.Scalar, aten.eq.Tensor) else e.call(torch.logical_not, both)


@_rule(aten.full.default, aten.scalar_tensor.default)
def _r_full(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    kw = dict(kw)
    kw["dtype"] = val.dtype.to_real()
    fill = complex(a[-1] if n.target is aten.full.default else a[0])
    if n.target is aten.full.default:
        re = lw.e.call(aten.full.default, a[0], fill.real, **kw)
        im = lw.e.call(aten.full.default, a[0], fill.imag, **kw) if fill.imag else None
    else:
        re = lw.e.call(aten.scalar_tensor.default, fill.real, **kw)
        im = lw.e.call(aten.scalar_tensor.default, fill.imag, **kw) if fill.imag else None
    return Pair(re, im)  # constant parts


@_rule(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default)
def _r_full_like(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    kw = {k: v for k, v in kw.items() if k not in ("dtype", "memory_format")}
    ref = _pair(a[0]).re
    fill: complex = {aten.zeros_like.default: 0j, aten.ones_like.default: 1 + 0j}.get(
        n.target, complex(a[1]) if n.target is aten.full_like.default else 0j
    )
    if _is_complex_val(val):
        rdt = val.dtype.to_real()
        re = lw.e.call(torch.full_like, ref, fill.real, dtype=rdt, **kw)
        im = lw.e.call(torch.full_like, ref, fill.imag, dtype=rdt, **kw) if fill.imag else None
        return Pair(re, im)
    return lw.e.call(torch.full_like, ref, fill.real, dtype=val.dtype, **kw)


@_rule(aten._to_copy.default, aten.to.dtype)
def _r_to(lw: _Lowering, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    val = _node_val(n)
    x = _pair(a[0])
    if _is_complex_val(val):
        rdt = val.dtype.to_real()
        re = lw.e.call(torch.Tensor.to, x.re, rdt)
        return Pair(re, None if x.im is None else lw.e.call(torch.Tensor.to, x.im, rdt))
    return lw.e.call(torch.Tensor.to, x.re, val.dtype)  # complex → real keeps the real part


# --- the lowering driver --------------------------------------------------------------------------


class _Lowering:
    """Walks a complex aten graph in order and emits the real graph."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.src = gm
        self.graph = fx.Graph()
        self.e = _Emitter(self.graph)
        self.env: dict[fx.Node, Any] = {}
        self.in_layout: list[bool] = []  # per original input: complex?
        self.out_layout: list[bool] = []  # per original output: complex?

    def lookup(self, x: Any) -> Any:
        if isinstance(x, fx.Node):
            return self.env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.lookup(y) for y in x)
        if isinstance(x, dict):
            return {k: self.lookup(v) for k, v in x.items()}
        if isinstance(x, complex):
            return Pair(x.real, x.imag if x.imag else None)
        return x

    def run(self) -> fx.GraphModule:
        for n in self.src.graph.nodes:
            if n.op == "placeholder":
                self._placeholder(n)
            elif n.op == "output":
                self._output(n)
            elif n.op == "get_attr":
                self.env[n] = self.graph.get_attr(n.target)
            else:
                self.env[n] = self._call(n)
        gm = fx.GraphModule(self.src, self.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    def _placeholder(self, n: fx.Node) -> None:
        val = _node_val(n)
        if _is_complex_val(val):
            ri = self.graph.placeholder(f"{n.name}_ri")  # view_as_real(x): [..., 2]
            re = self.e.call(torch.select, ri, -1, 0)
            im = self.e.call(torch.select, ri, -1, 1)
            self.env[n] = Pair(re, im)
            self.in_layout.append(True)
        else:
            self.env[n] = self.graph.placeholder(n.name)
            self.in_layout.append(False)

    def _output(self, n: fx.Node) -> None:
        outs = []
        results = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        for o in results:
            v = self.lookup(o)
            if isinstance(v, Pair):
                ref = v.re if isinstance(v.re, fx.Node) else None
                assert ref is not None, "complex output with a constant real part"
                outs.append(self.e.call(torch.stack, [v.re, self.e.dense(v.im, ref)], -1))
                self.out_layout.append(True)
            else:
                outs.append(v)
                self.out_layout.append(False)
        self.graph.output(tuple(outs))

    def _call(self, n: fx.Node) -> Any:
        args, kwargs = self.lookup(n.args), self.lookup(n.kwargs)
        val = _node_val(n)
        touches = _is_complex_val(val) or any(
            isinstance(x, Pair) for x in _flat(args) + _flat(list(kwargs.values()))
        )
        if isinstance(val, (list, tuple)) and any(_is_complex_val(v) for v in val):
            touches = True
        if not touches:
            return self.graph.create_node(n.op, n.target, args, kwargs, name=n.name)
        rule = RULES.get(n.target)
        if rule is None:
            raise ComplexDecompositionError(
                f"torchport complex compilation has no real decomposition for {n.target} "
                f"(node {n.name!r}: {n.format_node()}); compile with complex=False to run complex "
                "graphs through Inductor's ATen fallback instead"
            )
        out = rule(self, n, args, kwargs)
        if _is_complex_val(val) and not isinstance(out, Pair):
            out = Pair(out, None)
        return out


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [z for y in x for z in _flat(y)]
    return [x]


def lower_complex(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[bool], list[bool]]:
    """Rewrite a complex aten graph into a real one.

    Returns ``(real_gm, in_layout, out_layout)``: a complex input becomes its ``view_as_real``
    (``[..., 2]``), a complex output is returned as ``[..., 2]`` (real, imag); the layouts say which
    inputs and outputs were complex.
    """
    lw = _Lowering(gm)
    real = lw.run()
    return real, lw.in_layout, lw.out_layout


def split_inputs(args: Sequence[Any], in_layout: Sequence[bool]) -> list[Any]:
    """Complex tensors → ``view_as_real`` views (no copy unless a conj/neg bit is set)."""
    return [
        torch.view_as_real(x.resolve_conj().resolve_neg()) if is_c else x
        for x, is_c in zip(args, in_layout, strict=True)
    ]


def join_outputs(outs: Sequence[Any], out_layout: Sequence[bool]) -> list[Any]:
    """``[..., 2]`` (real, imag) outputs → complex tensors."""
    return [
        torch.view_as_complex(o if o.stride(-1) == 1 else o.contiguous()) if is_c else o
        for o, is_c in zip(outs, out_layout, strict=True)
    ]


class ComplexCompiled:
    """Runs a complex aten graph (from AOTAutograd) as a real graph compiled by ``inner``.

    With ``inner="inductor"`` the real graph is re-traced to aten ops on the (fake) example inputs
    and handed to Inductor's ``compile_fx_inner``, as Inductor's own forward/backward compilers do.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        inner: str,
        *,
        is_backward: bool = False,
    ) -> None:
        self.real_gm, self.in_layout, self.out_layout = lower_complex(gm)
        self.inner = inner
        if inner == "eager":
            self._run: Callable[[list[Any]], Any] = lambda a: self.real_gm(*a)
        else:
            self._run = self._inductor(example_inputs, is_backward)

    def _inductor(self, example_inputs: Sequence[Any], is_backward: bool) -> Callable[..., Any]:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        fake_mode = detect_fake_mode(list(example_inputs))
        assert fake_mode is not None, "AOTAutograd hands the compiler fake example inputs"
        with fake_mode:
            fake_real = split_inputs(list(example_inputs), self.in_layout)
            aten_gm = make_fx(
                self.real_gm, decomposition_table=select_decomp_table(), tracing_mode="fake"
            )(*fake_real)
        compiled = compile_fx_inner(aten_gm, fake_real, is_backward=is_backward)
        # Inductor reported the strides of the *real* outputs ([..., 2]); AOTAutograd would apply
        # them to the complex outputs it sees, so report "unknown" for every output instead.
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        if tc is not None and tc.output_strides is not None:
            tc.output_strides[:] = [None] * len(self.out_layout)
        return compiled  # type: ignore[return-value]

    def __call__(self, *call_args: Any) -> list[Any]:
        # AOTAutograd may call boxed (one list, which we clear) or unboxed; graph inputs are
        # never lists, so the two are unambiguous.
        if len(call_args) == 1 and isinstance(call_args[0], list):
            args = call_args[0]
            real_args = split_inputs(args, self.in_layout)
            args.clear()
        else:
            real_args = split_inputs(call_args, self.in_layout)
        outs = self._run(real_args)
        return join_outputs(list(outs), self.out_layout)


def complex_aot_backend(inner: str) -> Callable[..., Any]:
    """An AOTAutograd backend whose forward and backward graphs go through :class:`ComplexCompiled`
    (graphs that hold no complex value go to Inductor's ``compile_fx_inner`` or run eagerly)."""
    from functorch.compile import make_boxed_func
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    def make(is_backward: bool) -> Callable[..., Any]:
        def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            if inner == "eager" and not graph_has_complex(gm, example_inputs):
                return make_boxed_func(gm.forward)
            cc = ComplexCompiled(gm, example_inputs, inner, is_backward=is_backward)
            boxed = make_boxed_func(cc)
            return boxed

        return compiler

    return aot_autograd(
        fw_compiler=make(False),
        bw_compiler=make(True),
        decompositions=core_aten_decompositions(),
    )
