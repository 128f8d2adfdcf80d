"""Native replay tier: a straight-line float32 capture compiled into one C function.

When a capture has no ``switch``/``while_loop`` and every op is in the supported set below, the
recording is lowered to C through :mod:`torchport.native` and replay is a single ctypes call:
no interpreter, no dispatcher. Every tensor of the capture keeps the memory it had at capture time
(its storage is held by the program), so each op is C code on fixed addresses read from the real
tensors' storage offsets and strides; view ops (``t``, ``view``, ``expand``, ``slice``…) emit no
code at all. Anything else (other ops or dtypes, control flow) uses the TorchScript tier.

Supported: ``mm``, ``addmm`` (any strides, ``beta``/``alpha``), pointwise ``add/sub/mul/div``
(tensor or scalar, broadcasting, ``alpha``), ``relu``, ``tanh``, ``sigmoid``, ``neg``, ``exp``,
``copy_``/``clone``, and their in-place forms. Numerics: float32 with fp32 accumulation in
``k`` order; pointwise ops match ATen to rounding (``expf``/``tanhf`` from libm).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchport import native

__all__ = ["lower"]

# Branch-free exp/tanh so that gcc vectorises the loops (libm calls would stay scalar).
# exp: range reduction x = k ln2 + r (ln2 split in two), degree-6 polynomial for e^r on
# [-ln2/2, ln2/2], scale by 2^k through the exponent bits; <= 2 ulp on [-87, 88].
_MATH = r"""
TP_INLINE float tp_expf(float x0) {
    float x = x0 < -87.0f ? -87.0f : (x0 > 88.0f ? 88.0f : x0);
    x = x0 != x0 ? 0.0f : x;
    float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    float y = p * scale;
    y = x0 > 88.7f ? __builtin_inff() : y;  /* overflow, as expf */
    y = x0 < -87.0f ? 0.0f : y;             /* below the normal range */
    return x0 != x0 ? x0 : y;               /* NaN stays NaN */
}
TP_INLINE float tp_tanhf(float x) {
    float a = x < 0.0f ? -x : x;
    float t = tp_expf(-2.0f * a);
    float big = (1.0f - t) / (1.0f + t);
    float x2 = x * x;
    float small = a * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * -0.053968254f)));
    float r = a < 0.0625f ? small : big;
    r = x != x ? x : r;
    return x < 0.0f ? -r : r;
}
"""

_UNARY = {
    "relu": "({a} < 0.0f ? 0.0f : {a})",  # NaN propagates, as in ATen
    "tanh": "tp_tanhf({a})",
    "sigmoid": "(1.0f / (1.0f + tp_expf(-{a})))",
    "neg": "(-{a})",
    "exp": "tp_expf({a})",
    "clone": "{a}",
    "copy": "{b}",
}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


class _Unsupported(Exception):
    pass


def _is_view(func: Any) -> bool:
    rets = func._schema.returns
    return len(rets) == 1 and rets[0].alias_info is not None and not rets[0].alias_info.is_write


class _Codegen:
    def __init__(self) -> None:
        self.storages: list[torch.Tensor] = []  # one tensor per distinct storage, kept alive
        self._sid: dict[int, int] = {}
        self.lines: list[str] = []

    def ref(self, t: torch.Tensor) -> tuple[str, list[int], list[int]]:
        if t.dtype != torch.float32 or t.device.type != "cpu" or type(t) is not torch.Tensor:
            raise _Unsupported(f"tensor {t.dtype} {t.device}")
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._sid:
            self._sid[key] = len(self.storages)
            self.storages.append(t)
        off = t.storage_offset()
        base = f"(s{self._sid[key]} + {off})" if off else f"s{self._sid[key]}"
        return base, list(t.shape), list(t.stride())

    def pointwise(self, out: torch.Tensor, expr: str, ins: Sequence[Any]) -> None:
        ob, shape, ostr = self.ref(out)
        nd = len(shape)
        idx = [f"i{d}" for d in range(nd)]
        names = {}
        for name, v in ins:
            if isinstance(v, torch.Tensor):
                b, s, st = self.ref(v)
                pad = nd - len(s)
                if pad < 0:
                    raise _Unsupported("input larger than output")
                terms = [
                    f"{idx[pad + d]}*{st[d]}" for d in range(len(s)) if s[d] != 1 and st[d] != 0
                ]
                names[name] = f"{b}[{' + '.join(terms) or '0'}]"
            else:
                names[name] = f"{float(v)!r}f"
        oterms = [f"{idx[d]}*{ostr[d]}" for d in range(nd)]
        body = f"{ob}[{' + '.join(oterms) or '0'}] = {expr.format(**names)};"
        loops = [f"for (long {idx[d]} = 0; {idx[d]} < {shape[d]}; ++{idx[d]})" for d in range(nd)]
        if loops:
            loops[-1] = '_Pragma("omp simd") ' + loops[-1]
        self.lines.append(f"  {{ {' '.join(loops)} {body} }}")

    def addmm(
        self,
        out: torch.Tensor,
        bias: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        beta: float,
        alpha: float,
    ) -> None:
        ob, (m, n), (os0, os1) = self.ref(out)
        ab, (_, k), (as0, as1) = self.ref(a)
        bb, _, (bs0, bs1) = self.ref(b)
        init = "0.0f"
        if bias is not None:
            cb, cs, cst = self.ref(bias)
            pad = 2 - len(cs)
            sidx = ["i", "j"][pad:]
            terms = [f"{sidx[d]}*{cst[d]}" for d in range(len(cs)) if cs[d] != 1]
            init = f"{float(beta)!r}f * {cb}[{' + '.join(terms) or '0'}]"
            if float(beta) == 0.0:
                init = "0.0f"  # ATen ignores the bias (even NaN) when beta == 0
        if k * n > (1 << 16) or n > 4096:
            raise _Unsupported("matmul too large for the native tier")
        alpha_s = f"{float(alpha)!r}f"
        if bs1 == 1:
            # B rows contiguous along j: rank-1 updates of one output row, vectorised over j.
            self.lines.append(
                f"  {{ float acc[{n}];\n"
                f"    for (long i = 0; i < {m}; ++i) {{\n"
                f'      _Pragma("omp simd") for (long j = 0; j < {n}; ++j) acc[j] = 0.0f;\n'
                f"      for (long p = 0; p < {k}; ++p) {{ const float a = {ab}[i*{as0} + p*{as1}];\n"
                f'        _Pragma("omp simd") for (long j = 0; j < {n}; ++j)'
                f" acc[j] += a * {bb}[p*{bs0} + j]; }}\n"
                f'      _Pragma("omp simd") for (long j = 0; j < {n}; ++j)'
                f" {ob}[i*{os0} + j*{os1}] = {init} + {alpha_s} * acc[j];\n"
                f"    }}\n  }}"
            )
            return
        # B strided along j (e.g. a transposed Linear weight): row-major copy of B, then the
        # same rank-1 updates (measured faster here than dot products or a transposed-A kernel).
        self.lines.append(
            f"  {{ float bt[{k * n}]; float acc[{n}];\n"
            f'    for (long p = 0; p < {k}; ++p) _Pragma("omp simd") for (long j = 0; j < {n}; ++j)'
            f" bt[p*{n} + j] = {bb}[p*{bs0} + j*{bs1}];\n"
            f"    for (long i = 0; i < {m}; ++i) {{\n"
            f'      _Pragma("omp simd") for (long j = 0; j < {n}; ++j) acc[j] = 0.0f;\n'
            f"      for (long p = 0; p < {k}; ++p) {{ const float a = {ab}[i*{as0} + p*{as1}];\n"
            f'        _Pragma("omp simd") for (long j = 0; j < {n}; ++j) acc[j] += a * bt[p*{n} + j]; }}\n'
            f'      _Pragma("omp simd") for (long j = 0; j < {n}; ++j)'
            f" {ob}[i*{os0} + j*{os1}] = {init} + {alpha_s} * acc[j];\n"
            f"    }}\n  }}"
        )


def _emit(cg: _Codegen, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    name = func._schema.name.split("::")[-1]
    if _is_view(func) or name in ("detach", "alias", "lift_fresh"):
        return
    base = name.rstrip("_")
    if not isinstance(out, torch.Tensor):
        raise _Unsupported(name)
    if base in ("mm", "addmm"):
        if base == "mm":
            cg.addmm(out, None, args[0], args[1], 0.0, 1.0)
        else:
            beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
            alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
            cg.addmm(out, args[0], args[1], args[2], beta, alpha)
        return
    if base in _UNARY and base != "copy":
        if kwargs.get("memory_format") not in (
            None,
            torch.preserve_format,
            torch.contiguous_format,
        ):
            raise _Unsupported(name)
        cg.pointwise(out, _UNARY[base], [("a", args[0])])
        return
    if name == "copy_":
        cg.pointwise(out, "{b}", [("b", args[1])])
        return
    if base in _BINARY:
        alpha = kwargs.get("alpha", 1)
        rhs = "{b}" if alpha == 1 else f"({float(alpha)!r}f * {{b}})"
        cg.pointwise(out, f"({{a}} {_BINARY[base]} {rhs})", [("a", args[0]), ("b", args[1])])
        return
    raise _Unsupported(name)


def lower(
    trace: Sequence[tuple[Any, tuple[Any, ...], dict[str, Any], Any]],
) -> tuple[Callable[[], None], list[torch.Tensor], str] | None:
    """C function for ``trace`` (ops with their real tensors), or ``None`` if unsupported."""
    if not native.enabled():
        return None
    cg = _Codegen()
    try:
        for func, args, kwargs, out in trace:
            _emit(cg, func, args, kwargs, out)
    except _Unsupported:
        return None
    decls = [f"  float* const s{i} = (float*)P[{i}];" for i in range(len(cg.storages))]
    src = (
        native.PRELUDE
        + _MATH
        + "\nTP_EXPORT void tp_graph(char** P) {\n"
        + "\n".join(decls + cg.lines)
        + "\n}\n"
    )
    try:
        lib = native.build(src, name="tp_graph")
    except native.NativeError as e:
        native.note_fallback("graphs.native", f"graph program did not compile: {e}")
        return None
    fn = lib.tp_graph
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = None
    ptrs = (ctypes.c_void_p * max(1, len(cg.storages)))(
        *[t.untyped_storage().data_ptr() for t in cg.storages]
    )
    keep = list(cg.storages)

    def run() -> None:
        fn(ptrs)

    run.__dict__["_keep"] = (lib, ptrs, keep)
    return run, keep, src
