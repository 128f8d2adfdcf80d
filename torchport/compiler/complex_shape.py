"""Complex decomposition rules: views, shape ops and linear reductions applied to each part,
indexing and the scatters of its backward, cat/stack, where/eq, fills and dtype casts.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch import fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from torchport.compiler.complex_base import (
    ComplexDecompositionError,
    Pair,
    Rule,
    _is_complex_val,
    _node_val,
    _packets,
    _pair,
    aten,
    broadcast_parts,
    operands_have_its_shape,
    registrar,
    zero_im,
)

RULES: dict[Any, Rule] = {}
_rule = registrar(RULES)


@_rule(aten.view_as_real.default)
def _r_view_as_real(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.call(torch.stack, [p.re, lw.e.dense_im(p, p.re)], -1)  # [..., 2] real tensor


@_rule(aten.view_as_complex.default)
def _r_view_as_complex(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e = lw.e
    return Pair(e.call(torch.select, a[0], -1, 0), e.call(torch.select, a[0], -1, 1))  # last dim


@_rule(aten.complex.default)
def _r_complex(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # complex(re, im) broadcasts its parts: each part of a Pair has the complex shape (sizes,
    # real/imag and fills read it from a part), so parts of other shapes are expanded to it (a
    # view). complex(a[3], b[5, 3]) kept a as the real part: numel() was 3, real [3]
    if operands_have_its_shape(n):
        return Pair(a[0], a[1])
    return broadcast_parts(lw.e, a[0], a[1])


@_rule(aten.real.default)
def _r_real(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return _pair(a[0]).re  # Re z


@_rule(aten.imag.default)
def _r_imag(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    p = _pair(a[0])
    return lw.e.dense_im(p, p.re)  # Im z


def _componentwise(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """Apply a shape op or linear reduction to each part (a zero part stays zero)."""
    p = _pair(a[0])
    val = _node_val(n)
    if kw.get("dtype") is not None and _is_complex_val(val):
        # sum/mean/cumsum(dtype=complex128) of complex64 accumulate in the requested precision:
        # cast each part to its real dtype first, as ATen casts the input
        rdt = val.dtype.to_real()
        re, im = (None if x is None else lw.e.call(torch.Tensor.to, x, rdt) for x in (p.re, p.im))
        p = Pair(re, im, p.neg_zero)
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    # a part may be a stride-0 expansion where the complex value was dense (complex(a[3], b[5, 3])
    # or x.to(c64) + w[3] broadcast their parts): view(-1) of it raised, so a view reshapes (a
    # view wherever one exists, a copy only where eager's dense value had no copy to make)
    target = torch.reshape if n.target in _VIEWS else n.target
    re = lw.e.call(target, p.re, *a[1:], **kw)
    im = None if p.im is None else lw.e.call(target, p.im, *a[1:], **kw)
    # a view, copy or selection keeps a known zero's sign; a sum, or tril's zeros, make +0
    return Pair(re, im, p.neg_zero and n.target not in _SUMS)


_SUMS = frozenset(_packets("sum", "mean", "cumsum", "trace", "tril", "triu", "unfold_backward"))
_VIEWS = frozenset((aten.view.default, aten._unsafe_view.default))

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
    "unfold",
    "unfold_backward",
):
    RULES[_op] = _componentwise


@_rule(aten.view.dtype, aten.view_copy.dtype)
def _r_view_dtype(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # a bitcast (not a part-by-part view: view(float32) of complex64 [2, 3] is float32 [2, 6]).
    # A complex element's bytes are its real then its imaginary part, so a complex operand is
    # its parts interleaved, [..., 2n] in the part dtype; a complex result is the even and odd
    # elements of that interleaving in its part dtype. Between the two, torch's view(dtype)
    # on a last dim of stride 1 scales the last size by the ratio of element sizes. The traced
    # value met torch's requirements (stride(-1) 1, divisible size, offset and strides, not
    # 0-d for a change of size): the trace raised as eager does where it did not.
    e, src, val = lw.e, _node_val(n.args[0]), _node_val(n)
    if src.dtype == val.dtype:
        return a[0]
    if _is_complex_val(src):
        p = _pair(a[0])
        x = e.call(torch.stack, [p.re, e.dense_im(p, p.re)], -1)  # [..., n, 2]; 0-d: [2]
        if src.dim() > 0:
            x = e.call(torch.flatten, x, -2)
        part_dtype = src.dtype.to_real()
    else:
        x = a[0] if src.dim() > 0 else e.call(torch.unsqueeze, a[0], 0)
        part_dtype = src.dtype
    out_dtype = val.dtype.to_real() if _is_complex_val(val) else val.dtype
    if out_dtype != part_dtype:
        x = e.call(torch.Tensor.view, e.call(torch.Tensor.contiguous, x), out_dtype)
    if not _is_complex_val(val):
        return x if val.dim() > 0 else e.call(torch.select, x, -1, 0)
    if val.dim() == 0:
        return Pair(e.call(torch.select, x, -1, 0), e.call(torch.select, x, -1, 1))
    even, odd = (e.call(aten.slice.Tensor, x, -1, k, None, 2) for k in (0, 1))
    return Pair(even, odd)


def _alias_root(x: Any) -> Any:
    """The node whose value owns the storage graph value ``x`` addresses: ``x`` itself, or the
    node it views through aliasing ops (a graph input is such a root too); None for a constant."""
    while isinstance(x, fx.Node):
        if x.op == "placeholder":
            return x
        if x.target is operator.getitem:  # one output of split/unbind/chunk: a view of its input
            x = x.args[0]
            continue
        schema = getattr(x.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return x
        x = x.args[0] if x.args else None
    return None


def _views_an_input(x: Any) -> bool:
    """True if graph value ``x`` is a graph input or a view of one (through aliasing ops)."""
    root = _alias_root(x)
    return isinstance(root, fx.Node) and root.op == "placeholder"


def _storage_of(n: fx.Node, x: Any) -> tuple[torch.Tensor, torch.Tensor, fx.Node]:
    """``(value of x, value of its storage root, root node)`` for an op ``n`` that addresses the
    storage of ``x`` (as_strided and its scatter), refused where the storage is not known as a
    whole: a graph input's (it enters as two real views of the interleaved complex storage),
    one with symbolic sizes, or one that its root does not cover densely from offset 0."""
    root = _alias_root(x)
    if not isinstance(root, fx.Node) or root.op == "placeholder":
        raise ComplexDecompositionError(
            f"{n.target} on a complex graph input (or a view of one) is not supported by "
            f"torchport complex compilation (node {n.name!r}): it addresses the complex storage, "
            "which the real/imaginary split does not keep; compile with complex=False"
        )
    xv, rv = _node_val(x), _node_val(root)
    static = all(
        isinstance(s, int) for v in (xv, rv) for s in (*v.shape, *v.stride(), v.storage_offset())
    )
    whole = (
        static
        and rv.dtype == xv.dtype  # not a complex view of a real storage (view_as_complex)
        and rv.storage_offset() == 0
        and rv.untyped_storage().nbytes() == rv.numel() * rv.element_size()
        and is_non_overlapping_and_dense_or_false(rv)
    )
    if not whole:
        raise ComplexDecompositionError(
            f"{n.target} (node {n.name!r}) needs the storage it addresses to be one value of the "
            "graph laid out densely from offset 0 with static sizes; that of "
            f"{x.name!r} is {root.name!r}, {rv.dtype}, shape {tuple(rv.shape)}, strides "
            f"{tuple(rv.stride())}, offset {rv.storage_offset()}, {rv.untyped_storage().nbytes()} bytes"
        )
    return xv, rv, root


def _flat_storage(lw: Any, part: Any, rv: torch.Tensor) -> Any:
    """A part of a storage root as the 1-d real tensor that its storage order gives: element k
    is the part's value at the complex storage's element k (a permuted root is copied)."""
    order = sorted(range(rv.dim()), key=lambda d: -rv.stride()[d])  # outermost first
    if order != list(range(rv.dim())):
        part = lw.e.call(torch.permute, part, order)
    return lw.e.call(torch.reshape, part, [-1])


@_rule(*_packets("as_strided"))
def _r_as_strided(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # as_strided addresses the storage, not the tensor: its size/stride/offset count complex
    # elements of the storage of its operand's root. Each part of the root, flattened in the
    # root's storage order, is that storage in real elements, where as_strided applies as it is
    # (the parts' own layouts are the compiler's, and Inductor takes a view's offset as relative)
    xv, rv, root = _storage_of(n, n.args[0])
    size, stride = a[1], a[2]
    offset = a[3] if len(a) > 3 else kw.get("storage_offset")
    offset = xv.storage_offset() if offset is None else offset
    p = _pair(lw.env[root])

    def part(x: Any) -> Any:
        return lw.e.call(aten.as_strided.default, _flat_storage(lw, x, rv), size, stride, offset)

    return Pair(part(p.re), None if p.im is None else part(p.im), p.neg_zero)


@_rule(aten.as_strided_scatter.default)
def _r_as_strided_scatter(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # the functional form of an in-place write through an as_strided view: a copy of the whole
    # storage of self's root with src written at size/stride/offset, returned laid out as self
    # (ATen's clone_preserve_strides); per part on the flattened root, as _r_as_strided
    xv, rv, root = _storage_of(n, n.args[0])
    size, stride = a[2], a[3]
    offset = a[4] if len(a) > 4 else kw.get("storage_offset")
    offset = xv.storage_offset() if offset is None else offset
    e, dst, src = lw.e, _pair(lw.env[root]), _pair(a[1])

    def part(d: Any, s: Any) -> Any:
        flat = e.call(
            aten.as_strided_scatter.default, _flat_storage(lw, d, rv), s, size, stride, offset
        )
        return e.call(
            aten.as_strided.default, flat, list(xv.shape), list(xv.stride()), xv.storage_offset()
        )

    re = part(dst.re, src.re)
    if dst.im is None and src.im is None and dst.neg_zero == src.neg_zero:
        return Pair(re, None, dst.neg_zero)
    return Pair(re, part(e.dense_im(dst, dst.re), e.dense_im(src, src.re)))


@_rule(*_packets("constant_pad_nd"))
def _r_constant_pad(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # the fill is a complex number: its real part pads the real part, its imaginary part the
    # imaginary part (a real fill v pads with v + 0i, so the imaginary part with 0, not v)
    e, p = lw.e, _pair(a[0])
    fill = _pair(a[2] if len(a) > 2 else kw.get("value", 0.0))
    re = e.call(n.target, p.re, a[1], 0.0 if fill.re is None else fill.re)
    if p.im is None and fill.im is None and p.neg_zero == fill.neg_zero:
        return Pair(re, None, p.neg_zero)
    im_fill = zero_im(fill) if fill.im is None else fill.im  # a -0 part stays -0 (branch cuts)
    return Pair(re, e.call(n.target, e.dense_im(p, p.re), a[1], im_fill))


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
        if dst.im is None and src.im is None and dst.neg_zero == src.neg_zero:
            return Pair(re, None, dst.neg_zero)
        return Pair(re, part(e.dense_im(dst, dst.re), e.dense_im(src, src.re)))

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
    re = lw.e.call(operator.getitem, p.re, a[1])
    return Pair(re, im, p.neg_zero)  # element of a split/unbind


@_rule(*_packets("cat", "stack"))
def _r_cat(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    parts = [_pair(x) for x in a[0]]
    e = lw.e
    re = e.call(n.target, [p.re for p in parts], *a[1:], **kw)
    if all(p.im is None and p.neg_zero == parts[0].neg_zero for p in parts):
        return Pair(re, None, parts[0].neg_zero)
    im = e.call(n.target, [e.dense_im(p, p.re) for p in parts], *a[1:], **kw)
    return Pair(re, im)  # concatenate each part


@_rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _r_where(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    e, x, y = lw.e, _pair(a[1]), _pair(a[2])
    re = e.call(torch.where, a[0], x.re, y.re)
    if x.im is None and y.im is None and x.neg_zero == y.neg_zero:
        return Pair(re, None, x.neg_zero)
    # a known-zero part keeps its sign: where(x < 0, conj(x.to(c64)), ...) fed to log is on the
    # lower side of the cut, as eager (a +0 there gave log|x| + πi)
    # (shaped and typed like the real result: two signed scalars made a float32 tensor shaped
    # like the condition, wrong for a broadcast condition or complex128)
    xi, yi = (e.dense_im(p, re) if p.im is None else p.im for p in (x, y))
    return Pair(re, e.call(torch.where, a[0], xi, yi))


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


_NEW_FILLS: dict[Any, complex] = {aten.new_zeros.default: 0j, aten.new_ones.default: 1 + 0j}


@_rule(
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
)
def _r_new(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # a new tensor with self's dtype (unless one is given) and the given size: the buffer that
    # AOTAutograd's backward of an in-place write through a view copies the gradient into
    # (new_empty_strided, then copy). Made from self's real part, in the real dtype
    val = _node_val(n)
    ref = _part_ref(_pair(a[0]))
    kw = dict(kw)
    kw["dtype"] = val.dtype.to_real() if _is_complex_val(val) else val.dtype
    if n.target in (aten.new_empty.default, aten.new_empty_strided.default):
        out = lw.e.call(n.target, ref, *a[1:], **kw)
        return Pair(out, None) if _is_complex_val(val) else out  # an undefined imaginary part
    fill = _fill_value(a[2]) if n.target is aten.new_full.default else _NEW_FILLS[n.target]
    re = lw.e.call(aten.new_full.default, ref, a[1], fill.real, **kw)
    if not _is_complex_val(val):
        return re
    im = lw.e.call(aten.new_full.default, ref, a[1], fill.imag, **kw) if fill.imag else None
    return Pair(re, im)  # constant parts


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
        im = None if x.im is None else lw.e.call(torch.Tensor.to, x.im, rdt)
        return Pair(re, im, x.neg_zero)
    return lw.e.call(torch.Tensor.to, x.re, val.dtype)  # complex → real keeps the real part


def _part_ref(p: Pair) -> Any:
    """A graph part of ``p`` with its shape (the real part, unless that is a constant)."""
    return p.re if isinstance(p.re, fx.Node) else p.im


@_rule(aten.sym_size.int, aten.sym_numel.default)
def _r_sym_size(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # under symbolic tracing (make_fx(tracing_mode="symbolic")) a size of a complex tensor is a
    # node on it; each part has the complex shape, so the size is the part's
    return lw.e.call(n.target, _part_ref(_pair(a[0])), *a[1:], **kw)


@_rule(aten.sym_stride.int)
def _r_sym_stride(lw: Any, n: fx.Node, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # a stride of the complex tensor counts complex elements; a part's own stride does not say
    # it (the real view of an interleaved input has twice the stride, a computed part is laid
    # out by the compiler), so it is taken from the traced value: a static stride as the number,
    # a symbolic one as the product of the sizes (of the part, so symbolic) it is known to equal:
    # the later dims' for a contiguous layout, others for a permuted one (channels-last's
    # stride(3) is C, its stride(2) W*C)
    from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

    src = _node_val(n.args[0])
    dim = a[1]
    if not isinstance(src, torch.Tensor) or type(dim) is not int:
        raise ComplexDecompositionError(
            f"{n.target}: needs the traced complex tensor and an int dim, got {n.args!r}"
        )
    dim %= max(src.dim(), 1)
    stride = src.stride(dim)
    if is_concrete_int(stride):
        return int(stride)
    dims = range(src.dim())
    contiguous = tuple(range(dim + 1, src.dim()))
    subsets = [contiguous] + [c for r in dims for c in itertools.combinations(dims, r + 1)]
    for subset in subsets:
        want = 1
        for d in subset:
            want = want * src.shape[d]
        if statically_known_true(stride == want):
            break
    else:
        raise ComplexDecompositionError(
            f"{n.target}: a symbolic stride of a complex tensor is computed where it is a "
            f"product of its sizes; dim {dim} has stride {stride} for sizes {tuple(src.shape)}"
        )
    ref = _part_ref(_pair(a[0]))
    out: Any = 1
    for d in subset:
        size = lw.e.call(aten.sym_size.int, ref, d)
        out = size if out == 1 else lw.e.call(operator.mul, out, size)
    return out
