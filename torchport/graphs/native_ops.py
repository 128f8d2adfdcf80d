"""Native replay tier, model ops: the ops a transformer decode step needs, as C loops.

``embedding``, ``index_copy``, ``arange``, ``cat``, ``stack``, ``bmm``, ``masked_fill``, ``_softmax``,
``native_layer_norm``, ``gelu``, ``argmax`` and ``_unsafe_view``, emitted by
:func:`emit_model_op` into a :class:`torchport.graphs.native._Codegen` program. Index reads are
bounds-checked: an out-of-range index makes the program return an error code, which replay
raises as ``IndexError`` naming the op (ATen raises there too; C would read out of bounds).

Numerics (float32): ``_softmax`` subtracts the row max and uses the tier's ``exp`` polynomial
(≤ 2 ulp); ``native_layer_norm`` computes mean and variance in two passes in double (rounded
once; a float32 running sum lost ~10x ATen's accuracy on rows with a large mean) and writes
``mean``/``rstd`` as ATen does; ``gelu`` uses libm ``erff``/``tanhf``; ``argmax`` returns the first
maximum, NaN counting as the maximum (ATen's rule). ``arange`` is bit-exact to ATen's CPU
kernel: integers in int64, float32/float64 by :func:`arange_reference`'s position-dependent
formula (for the running CPU capability, and the thread count at replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["arange_reference", "emit_model_op"]


def _loops(shape: Sequence[int], names: Sequence[str]) -> str:
    return "".join(f"for (long {v} = 0; {v} < {n}; ++{v}) " for v, n in zip(names, shape))


def _at(base: str, strides: Sequence[int], names: Sequence[str]) -> str:
    terms = [f"{v}*{s}" for v, s in zip(names, strides) if s != 0]
    return f"{base}[{' + '.join(terms) or '0'}]"


def _index(cg: Any, idx: torch.Tensor, pos: str, limit: int, what: str) -> str:
    """C statements: ``long r = idx[pos]``, returning an error code when out of range: negative
    too, as ATen's ``embedding`` and ``index_copy_`` raise for it (a -1 read or wrote the last
    row: a decode position of -1 overwrote the last cache row)."""
    if idx.dim() > 1 or idx.dtype not in (torch.int64, torch.int32):
        raise cg.unsupported("index layout")
    ib, _, ist = cg.ref(idx)
    stride = ist[0] if idx.dim() else 0
    code = cg.error(f"{what}: index out of range for size {limit}")
    return f"long r = (long){ib}[{pos}*{stride}]; if (r < 0 || r >= {limit}) return {code}; "


def emit_model_op(
    cg: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any
) -> bool:
    """Emit ``name`` if it is one of this module's ops; return ``False`` if it is not."""
    f = _OPS.get(name)
    if f is None:
        return False
    f(cg, args, kwargs, out)
    return True


def _float32(cg: Any, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32:
            raise cg.unsupported(f"{t.dtype} (float32 only)")


def _embedding(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    weight, idx = args[0], args[1]
    if weight.dim() != 2 or idx.dim() > 1:
        raise cg.unsupported("embedding layout")
    wb, (vocab, d), (ws0, ws1) = cg.ref(weight)
    ob, _, ost = cg.ref(out)
    n = idx.numel()
    row = "" if idx.dim() == 0 else f"i*{ost[0]} + "
    cg.lines.append(
        f"  for (long i = 0; i < {n}; ++i) {{ {_index(cg, idx, 'i', vocab, 'embedding')}"
        f"for (long j = 0; j < {d}; ++j) {ob}[{row}j*{ost[-1]}] = {wb}[r*{ws0} + j*{ws1}]; }}"
    )


def _index_copy(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    self_, dim, idx, src = args[0], args[1] % max(1, args[0].dim()), args[2], args[3]
    if out.data_ptr() != self_.data_ptr():
        cg.copy(out, self_)
    ob, oshape, ost = cg.ref(out)
    sb, sshape, sst = cg.ref(src)
    names = [f"j{d}" for d in range(len(sshape))]
    onames = [("r" if d == dim else v) for d, v in enumerate(names)]
    inner = _loops(
        [s for d, s in enumerate(sshape) if d != dim], [v for d, v in enumerate(names) if d != dim]
    )
    cg.lines.append(
        f"  for (long j{dim} = 0; j{dim} < {idx.numel()}; ++j{dim}) {{ "
        f"{_index(cg, idx, f'j{dim}', oshape[dim], 'index_copy')}"
        f"{inner}{_at(ob, ost, onames)} = {_at(sb, sst, names)}; }}"
    )


# ATen's CPU arange kernel (RangeFactoriesKernel.cpp) per CPU capability: (vector width in
# bytes, whether the build fuses ``a * b + c`` into an FMA). Float values come from two formulas,
# by position: a scalar tail and vector lanes (see :func:`arange_reference`).
_ARANGE_VEC = {"AVX512": (64, True), "AVX2": (32, True), "DEFAULT": (32, False)}
_ARANGE_GRAIN = 32768  # at::internal::GRAIN_SIZE: the parallel_for chunk that splits the range


def _arange_chunks(n: int, threads: int) -> list[tuple[int, int]]:
    """The ranges at::parallel_for (OpenMP) hands each thread: its own vector/tail split."""
    if n <= _ARANGE_GRAIN or threads <= 1:
        return [(0, n)]
    tasks = min(threads, -(-n // _ARANGE_GRAIN))
    size = -(-n // tasks)
    return [(b, min(n, b + size)) for b in range(0, n, size)]


def arange_reference(
    start: float, step: float, n: int, dtype: torch.dtype, capability: str, threads: int
) -> torch.Tensor:
    """ATen's float arange, bit for bit, in exact arithmetic (for tests; slow).

    Accumulation is in ``acc_type`` (double for float32/float64, float for bfloat16/float16).
    Within each parallel chunk ``[b, e)``, blocks of two vectors of ``V`` elements take lane
    ``j`` of the vector at ``k`` as ``out(acc(j * step + out(start + step * k)))`` (the base is
    rounded to the output type first); the tail, fewer than ``2V`` elements, is
    ``out(start + step * k)``. On AVX2/AVX512 builds each ``x * y + z`` is one FMA, except a
    bfloat16/float16 lane: there ``j * step`` is an argument of ``operator+(BFloat16, float)``,
    rounded to float before the add.
    """
    from fractions import Fraction

    width, fused = _ARANGE_VEC[capability]
    wide = dtype in (torch.float32, torch.float64)

    def to(x: Fraction | float, dt: torch.dtype) -> float:
        return _round_exact(Fraction(x), dt)

    acc = torch.float64 if wide else torch.float32
    s, st = to(start, acc), to(step, acc)

    def mul_add(x: float, y: float, z: float, fma: bool = fused) -> float:
        if fma:
            return to(Fraction(x) * Fraction(y) + Fraction(z), acc)
        return to(Fraction(to(Fraction(x) * Fraction(y), acc)) + Fraction(z), acc)

    vec = width // torch.empty(0, dtype=dtype).element_size()
    out = [0.0] * n
    for b, e in _arange_chunks(n, threads):
        blocks = (e - b) // (2 * vec) * (2 * vec)
        for k in range(b, b + blocks, vec):
            base = to(mul_add(st, to(k, acc), s), dtype)
            for j in range(vec):
                out[k + j] = to(mul_add(float(j), st, base, fused and wide), dtype)
        for k in range(b + blocks, e):
            out[k] = to(mul_add(st, to(k, acc), s), dtype)
    return torch.tensor(out, dtype=torch.float64).to(dtype)


def _round_exact(x: Any, dtype: torch.dtype) -> float:
    """``x`` (a Fraction) rounded to ``dtype`` once, to nearest even (no double rounding)."""
    bits, emin = {
        torch.float64: (53, -1022),
        torch.float32: (24, -126),
        torch.bfloat16: (8, -126),
        torch.float16: (11, -14),
    }[dtype]
    if x == 0:
        return 0.0
    mag, two = abs(x), type(x)(2)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()  # 2**e <= mag < 2**(e+1),
    e += 1 if mag >= two ** (e + 1) else 0  # within one
    e -= 1 if mag < two**e else 0
    unit = two ** (max(e, emin) - bits + 1)
    q, r = divmod(mag, unit)
    q += 1 if 2 * r > unit or (2 * r == unit and q % 2) else 0
    return float(q * unit) * (1 if x > 0 else -1)


def _arange(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = (nums[0], nums[2] if len(nums) > 2 else 1) if len(nums) > 1 else (0, 1)
    ob, (n,), (os0,) = cg.ref(out)
    ct = cg.ctype(out.dtype)
    if not out.dtype.is_floating_point:
        # ATen computes an integer arange in int64 from start and step truncated to integers
        # (in double, values past 2**53 collapsed: arange(2**60, 2**60 + 4) gave four equal ones).
        value = f"(int64_t){int(start)}LL + (int64_t){int(step)}LL * (int64_t)i"
        cg.lines.append(f"  for (long i = 0; i < {n}; ++i) {ob}[i*{os0}] = ({ct})({value});")
        return
    # Float: ATen's formulas by position (arange_reference), so that each value is bit-exact;
    # ``start + i * step`` in double differed by 1 ulp at some points. float32 accumulates in
    # double; float64 in double; the tier has no bfloat16/float16 (they stay on ATen).
    layout = _ARANGE_VEC.get(torch.backends.cpu.get_cpu_capability())
    if layout is None or out.dtype not in (torch.float32, torch.float64):
        raise cg.unsupported(f"arange {out.dtype} on {torch.backends.cpu.get_cpu_capability()}")
    width, fused = layout
    vec = width // out.element_size()
    # Unfused: an empty asm on the product keeps gcc from contracting it into an FMA.
    mad = "fma({a}, {b}, {c})" if fused else "tp_mul_add({a}, {b}, {c})"
    s, st = f"{float(start)!r}", f"{float(step)!r}"
    lane = mad.format(a="(double)j", b=st, c=f"({ct})" + mad.format(a=st, b="(double)k", c=s))
    tail = mad.format(a=st, b="(double)k", c=s)
    if n > _ARANGE_GRAIN:
        # ATen splits the range by the thread count when it runs (_arange_chunks), so the program
        # does too, from the replay-time count: the capture-time one gave other positions the
        # lane formula (1 ulp off torch.arange at ~20% of them after set_num_threads)
        tasks = f"TP_MIN(TP_MAX({cg.replay_threads()}, 1), {-(-n // _ARANGE_GRAIN)})"
        cg.lines.append(
            f"  {{ const long size_ = ({n} + {tasks} - 1) / {tasks};"
            f" for (long b = 0; b < {n}; b += size_) {{"
            f" const long e = TP_MIN({n}, b + size_), m = b + (e - b) / {2 * vec} * {2 * vec};"
        )
        b, m, e = "b", "m", "e"
    else:  # one chunk, whatever the thread count
        b, m, e = "0", str(n // (2 * vec) * (2 * vec)), str(n)
    cg.lines.append(
        f"  for (long k = {b}; k < {m}; k += {vec}) for (long j = 0; j < {vec}; ++j) "
        f"{ob}[(k+j)*{os0}] = ({ct})({lane});"
    )
    cg.lines.append(f"  for (long k = {m}; k < {e}; ++k) {ob}[k*{os0}] = ({ct})({tail});")
    if n > _ARANGE_GRAIN:
        cg.lines.append("  } }")


def _cat(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    tensors = [t for t in args[0] if t.numel() > 0 or t.dim() > 1]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
    off = 0
    for t in tensors:
        size = t.shape[dim]
        cg.copy(out.narrow(dim, off, size), t)
        off += size


def _stack(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
    for i, t in enumerate(args[0]):
        cg.copy(out.select(dim, i), t)


def _bmm(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    a, b = args[0], args[1]
    _float32(cg, a, b, out)
    if out.shape[0] > 256:
        raise cg.unsupported("bmm batch > 256 (unrolled)")
    for i in range(out.shape[0]):
        cg.addmm(out[i], None, a[i], b[i], 0.0, 1.0)


def _masked_fill(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    cg.pointwise(out, "({m} ? {v} : {a})", [("a", args[0]), ("m", args[1]), ("v", args[2])])


def _rows(t: torch.Tensor, dim: int) -> tuple[list[int], list[str]]:
    other = [d for d in range(t.dim()) if d != dim]
    return other, [f"o{d}" for d in other]


def _softmax(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    x, dim = args[0], args[1] % max(1, args[0].dim())
    _float32(cg, x, out)
    if x.dim() == 0:
        raise cg.unsupported("0-dim softmax")
    xb, shape, xst = cg.ref(x)
    ob, _, ost = cg.ref(out)
    other, names = _rows(x, dim)
    full = [("j" if d == dim else f"o{d}") for d in range(x.dim())]
    n = shape[dim]
    xa, oa = _at(xb, xst, full), _at(ob, ost, full)
    cg.lines.append(
        f"  {{ {_loops([shape[d] for d in other], names)}{{ float m = -__builtin_inff(); "
        f"for (long j = 0; j < {n}; ++j) {{ float v = {xa}; m = (v > m || v != v) ? v : m; }} "
        f"float s = 0.0f; for (long j = 0; j < {n}; ++j) {{ float e = tp_expf({xa} - m); {oa} = e; s += e; }} "
        f"const float inv = 1.0f / s; for (long j = 0; j < {n}; ++j) {oa} *= inv; }} }}"
    )


def _layer_norm(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    x, shape, w, b, eps = args[0], list(args[1]), args[2], args[3], float(args[4])
    y, mean, rstd = out
    for t in (x, y):
        if not t.is_contiguous():
            raise cg.unsupported("layer_norm on a strided tensor")
    _float32(cg, x, y, mean, rstd, *[t for t in (w, b) if t is not None])
    n = 1
    for s in shape:
        n *= s
    rows = x.numel() // max(1, n)
    xb, yb = cg.ref(x)[0], cg.ref(y)[0]
    mb, rb = cg.ref(mean)[0], cg.ref(rstd)[0]
    if any(t is not None and not t.is_contiguous() for t in (w, b)):
        raise cg.unsupported("strided layer_norm affine")
    wv = f"{cg.ref(w)[0]}[j]" if w is not None else "1.0f"
    bv = f"{cg.ref(b)[0]}[j]" if b is not None else "0.0f"
    # Two passes in double, each over 8 partial sums (independent add chains, which gcc
    # vectorises) and a tail; x - mean in double before rounding to float.
    lanes = "((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))"
    body = n // 8 * 8
    cg.lines.append(
        f"  for (long i = 0; i < {rows}; ++i) {{ const float* xr = {xb} + i*{n}; "
        f"float* yr = {yb} + i*{n}; double a[8] = {{ 0 }}; "
        f"for (long j = 0; j < {body}; j += 8) for (int k = 0; k < 8; ++k) a[k] += xr[j + k]; "
        f"double s = {lanes}; for (long j = {body}; j < {n}; ++j) s += xr[j]; "
        f"const double mu = s / {n}.0; for (int k = 0; k < 8; ++k) a[k] = 0.0; "
        f"for (long j = 0; j < {body}; j += 8) for (int k = 0; k < 8; ++k) "
        f"{{ double c = xr[j + k] - mu; a[k] += c * c; }} "
        f"double q = {lanes}; for (long j = {body}; j < {n}; ++j) {{ double c = xr[j] - mu; q += c * c; }} "
        f"const double rs = 1.0 / __builtin_sqrt(q / {n}.0 + {eps!r}); "
        f"{mb}[i] = (float)mu; {rb}[i] = (float)rs; "
        f"for (long j = 0; j < {n}; ++j) yr[j] = (float)((xr[j] - mu) * rs) * {wv} + {bv}; }}"
    )


def _gelu(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    _float32(cg, args[0], out)
    approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    if approx == "tanh":
        expr = "(0.5f * {a} * (1.0f + tanhf(0.7978845608028654f * ({a} + 0.044715f * {a} * {a} * {a}))))"
    else:
        expr = "(0.5f * {a} * (1.0f + erff({a} * 0.70710678118654752f)))"
    cg.pointwise(out, expr, [("a", args[0])])


def _argmax(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        if not x.is_contiguous():
            raise cg.unsupported("argmax over a strided tensor")
        x = x.reshape(-1)
        dim = 0
    dim %= max(1, x.dim())
    if x.dim() == 0 or x.shape[dim] == 0 or not x.dtype.is_floating_point:
        raise cg.unsupported("argmax input")
    _float32(cg, x)
    xb, shape, xst = cg.ref(x)
    ob, _, ost = cg.ref(out)
    other, names = _rows(x, dim)
    if out.dim() == x.dim():  # keepdim
        ost = [ost[d] for d in other]
    full = [("j" if d == dim else f"o{d}") for d in range(x.dim())]
    xa = _at(xb, xst, full)
    first = _at(xb, xst, [("0" if d == dim else f"o{d}") for d in range(x.dim())])
    cg.lines.append(
        f"  {{ {_loops([shape[d] for d in other], names)}{{ float best = {first}; long bi = 0; "
        f"for (long j = 1; j < {shape[dim]}; ++j) {{ float v = {xa}; "
        f"if (best == best && (v > best || v != v)) {{ best = v; bi = j; }} }} "
        f"{_at(ob, ost, names)} = bi; }} }}"
    )


def _unsafe_view(cg: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
    src = args[0]
    if out.data_ptr() == src.data_ptr() and src.is_contiguous():
        return  # an alias of a contiguous input: no data moves
    if not (src.is_contiguous() and out.is_contiguous()):
        raise cg.unsupported("_unsafe_view of a strided tensor")
    cg.copy(out.reshape(-1), src.reshape(-1))


_OPS = {
    "embedding": _embedding,
    "index_copy": _index_copy,
    "index_copy_": _index_copy,
    "arange": _arange,
    "cat": _cat,
    "stack": _stack,
    "bmm": _bmm,
    "masked_fill": _masked_fill,
    "masked_fill_": _masked_fill,
    "_softmax": _softmax,
    "native_layer_norm": _layer_norm,
    "gelu": _gelu,
    "argmax": _argmax,
    "_unsafe_view": _unsafe_view,
}
