"""Native replay tier: a capture compiled into one C function, control flow included.

When every op of a capture is in the supported set below, the recording is lowered to C through
:mod:`torchport.native` and replay is a single ctypes call: no interpreter, no dispatcher. Every
tensor of the capture keeps the memory it had at capture time (its storage is held by the
program), so each op is C code on fixed addresses read from the real tensors' storage offsets and
strides; view ops (``t``, ``view``, ``expand``, ``slice``…) emit no code at all. A
:func:`~torchport.switch` becomes a C ``switch`` over the (clamped) index read from its tensor at
replay, each case running its branch and copying its outputs into the switch's output buffers; a
:func:`~torchport.while_loop` becomes ``for (;;) { cond; if (!pred) break; body; carry }`` over
the loop-variable buffers, so branch choices and trip counts follow the data. Anything else
(other ops, dtypes or tensor subclasses) uses the TorchScript tier.

Supported: ``mm``/``addmm`` (float32, any strides, ``beta``/``alpha``; the GEMM engine's register
tiles, :mod:`torchport.gemm`, on ``B`` packed at every replay, on torch's thread count at
replay), pointwise arithmetic, comparisons, ``where``, ``clamp``, ``abs``, bitwise/logical ops
and casts on float/int/bool tensors (tensor or scalar operands, broadcasting), float32
``relu/tanh/sigmoid/exp/sin/cos/sqrt/rsqrt``, copies, fills and factory ops, their in-place
forms, ``sum/mean/amax/amin`` over any dims (float32; ``sum``/``amax``/``amin`` also int64), and
the transformer ops of :mod:`.native_ops` (embedding, softmax, layer norm, GELU, ``bmm``,
``index_copy``, ``argmax``...). Not supported (TorchScript tier): integer division and remainder
(ATen raises on a zero divisor; C would trap), float-to-int casts, other reductions.

Numerics: GEMMs accumulate in float32 with FMA over K (the engine's order, not ATen's); pointwise
ops compute in the output's type with scalars converted as ATen does (a float32 tensor times a
Python float multiplies in float32); ``exp``/``tanh``/``sigmoid`` use branch-free polynomials
(≤ 2 ulp), ``sin``/``cos`` libm; float32 ``sum``/``mean`` accumulate in double (rounded
once); integer arithmetic wraps (``-fwrapv``), as ATen's does.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchport import native
from torchport.gemm.templates import GEMM_F32_ENTRY_TYPEDEF
from torchport.graphs.capture import layout
from torchport.graphs.native_gemv import GEMV_ENTRY_TYPEDEF, emit_gemv
from torchport.graphs.native_ops import emit_model_op

__all__ = ["lower"]

# Branch-free exp/tanh so that gcc vectorises the loops (libm calls would stay scalar).
# exp: range reduction x = k ln2 + r (ln2 split in two), degree-6 polynomial for e^r on
# [-ln2/2, ln2/2], scale by 2^k as two powers of two (each a valid exponent field for k in
# [-150, 128]: the product overflows to inf past ln(FLT_MAX) and rounds into the subnormals
# below -87.3, once); <= 2 ulp where the result is normal. (Clamped at 88 with 2^k in one
# field, exp(88.5) came out 0.61x and exp(-87.2) 0.)
_MATH = r"""
TP_INLINE float tp_expf(float x0) {
    float x = x0 < -104.0f ? -104.0f : (x0 > 89.0f ? 89.0f : x0);
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
    int32_t k1 = (int32_t)k / 2, k2 = (int32_t)k - k1;
    int32_t b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    float y = (p * s1) * s2;
    y = x0 > 89.0f ? __builtin_inff() : y;  /* overflow, as expf (the product does it up to 89) */
    y = x0 < -104.0f ? 0.0f : y;            /* below the smallest subnormal */
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
/* a * b + c rounded twice, as an ATen build without FMA computes it: the empty asm hides the
   product, which gcc would otherwise contract into an FMA. */
TP_INLINE double tp_mul_add(double a, double b, double c) {
    double p = a * b;
    __asm__("" : "+m"(p));
    return p + c;
}
"""

# GEMM support (the engine's entry point type is torchport.gemm.templates.GEMM_F32_ENTRY_TYPEDEF,
# prepended to this): the packing of B
# into its [ceil(N/nr)][K][nr] panels, done at every replay (weights are read at replay, as CUDA
# graphs read theirs). A Linear weight arrives as W.t() (unit stride along K): 8x8 AVX2
# transposes; rows contiguous along N: row copies; anything else: one element at a time.
_PACK = r"""

static void tp_pack(const float *B, int64_t bs0, int64_t bs1, int64_t K, int64_t N, int64_t nr,
                    float *out) {
    const int64_t np = (N + nr - 1) / nr;
    for (int64_t jp = 0; jp < np; ++jp) {
        float *o = out + jp * K * nr;
        const int64_t j0 = jp * nr, w = TP_MIN(nr, N - j0);
        if (bs1 == 1) {
            for (int64_t k = 0; k < K; ++k) {
                memcpy(o + k * nr, B + k * bs0 + j0, (size_t)w * sizeof(float));
                for (int64_t c = w; c < nr; ++c) o[k * nr + c] = 0.0f;
            }
            continue;
        }
        int64_t c = 0;
#if defined(__AVX2__)
        if (bs0 == 1) {
            for (; c + 8 <= w; c += 8) {
                const float *col = B + (j0 + c) * bs1;
                int64_t k = 0;
                for (; k + 8 <= K; k += 8) {
                    __m256 r0 = _mm256_loadu_ps(col + k), r1 = _mm256_loadu_ps(col + bs1 + k);
                    __m256 r2 = _mm256_loadu_ps(col + 2 * bs1 + k);
                    __m256 r3 = _mm256_loadu_ps(col + 3 * bs1 + k);
                    __m256 r4 = _mm256_loadu_ps(col + 4 * bs1 + k);
                    __m256 r5 = _mm256_loadu_ps(col + 5 * bs1 + k);
                    __m256 r6 = _mm256_loadu_ps(col + 6 * bs1 + k);
                    __m256 r7 = _mm256_loadu_ps(col + 7 * bs1 + k);
                    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
                    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
                    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                    float *d = o + k * nr + c;
                    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
                    _mm256_storeu_ps(d + nr, _mm256_permute2f128_ps(u1, u5, 0x20));
                    _mm256_storeu_ps(d + 2 * nr, _mm256_permute2f128_ps(u2, u6, 0x20));
                    _mm256_storeu_ps(d + 3 * nr, _mm256_permute2f128_ps(u3, u7, 0x20));
                    _mm256_storeu_ps(d + 4 * nr, _mm256_permute2f128_ps(u0, u4, 0x31));
                    _mm256_storeu_ps(d + 5 * nr, _mm256_permute2f128_ps(u1, u5, 0x31));
                    _mm256_storeu_ps(d + 6 * nr, _mm256_permute2f128_ps(u2, u6, 0x31));
                    _mm256_storeu_ps(d + 7 * nr, _mm256_permute2f128_ps(u3, u7, 0x31));
                }
                for (; k < K; ++k)
                    for (int64_t q = 0; q < 8; ++q) o[k * nr + c + q] = col[q * bs1 + k];
            }
        }
#endif
        for (; c < w; ++c) {
            const float *col = B + (j0 + c) * bs1;
            for (int64_t k = 0; k < K; ++k) o[k * nr + c] = col[k * bs0];
        }
        for (; c < nr; ++c)
            for (int64_t k = 0; k < K; ++k) o[k * nr + c] = 0.0f;
    }
}
"""


_CTYPE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.int64: "int64_t",
    torch.int32: "int32_t",
    torch.int16: "int16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.bool: "uint8_t",
}
# Factory ops: the fill value (None: uninitialised; "arg1": the op's second argument).
_FACTORY: dict[str, Any] = {
    "empty_like": None,
    "empty": None,
    "zeros_like": 0,
    "zeros": 0,
    "ones_like": 1,
    "ones": 1,
    "full_like": "arg1",
    "full": "arg1",
}
_FLOAT_ONLY = {"tanh", "sigmoid", "exp", "sin", "cos", "sqrt", "rsqrt"}  # float32 math
_UNARY = {
    "relu": "({a} < 0 ? 0 : {a})",  # NaN propagates, as in ATen
    "tanh": "tp_tanhf({a})",
    "sigmoid": "(1.0f / (1.0f + tp_expf(-{a})))",
    "neg": "(-{a})",
    "exp": "tp_expf({a})",
    "sin": "sinf({a})",  # libm (correctly rounded to 1 ulp, like ATen's SLEEF), not vectorised
    "cos": "cosf({a})",
    "sqrt": "__builtin_sqrtf({a})",
    "rsqrt": "(1.0f / __builtin_sqrtf({a}))",
    "clone": "{a}",
    "logical_not": "(!{a})",
}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^", "logical_and": "&&"}
_BITWISE["logical_or"] = "||"


def _scalar(v: Any, ct: str) -> str:
    """A Python number as a C literal of type ``ct``."""
    if ct in ("float", "double"):
        f = float(v)
        if f != f:
            return '__builtin_nanf("")' if ct == "float" else '__builtin_nan("")'
        if f in (float("inf"), float("-inf")):
            return ("-" if f < 0 else "") + "__builtin_inff()"
        return f"(({ct}){f!r})"
    if isinstance(v, float):
        raise _Unsupported(f"float scalar {v} in {ct} arithmetic")
    return f"(({ct}){int(v)}LL)"


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
        self.fns: list[Any] = []  # GEMM-engine entry points, passed to the program as F[i]
        self._fid: dict[tuple[tuple[int, int], bool], int] = {}
        self.pack_floats = 0  # scratch W: packed B panels
        self.tmp_floats = 0  # scratch T: a product before a general beta/alpha combine
        self.reads_threads = False  # the program reads the replay-time thread count (NT)
        self.extra: list[torch.Tensor] = []  # buffers the program itself needs, kept alive
        self.written: list[torch.Tensor] = []  # tensors the ops write in place (see lower)
        self.errors: list[str] = []  # runtime errors, by code - 1
        self._counter = 0

    def error(self, message: str) -> int:
        """A nonzero code the program returns for a runtime error; replay raises ``message``."""
        self.errors.append(message)
        return len(self.errors)

    @staticmethod
    def unsupported(reason: str) -> Exception:
        return _Unsupported(reason)

    @staticmethod
    def ctype(dtype: torch.dtype) -> str:
        ct = _CTYPE.get(dtype)
        if ct is None:
            raise _Unsupported(str(dtype))
        return ct

    def replay_threads(self) -> str:
        """C expression for torch's intra-op thread count at replay, not at capture: ``run``
        writes it to a cell the program reads (set_num_threads may change it in between)."""
        self.reads_threads = True
        return "NT"

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def ref(self, t: torch.Tensor) -> tuple[str, list[int], list[int]]:
        """C pointer expression (typed by ``t.dtype``), shape and strides of ``t``."""
        ctype = _CTYPE.get(t.dtype)
        if (
            ctype is None
            or t.device.type != "cpu"
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
        ):
            raise _Unsupported(f"tensor {t.dtype} {t.device}")
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._sid:
            self._sid[key] = len(self.storages)
            self.storages.append(t)
        off = t.storage_offset()
        base = f"(({ctype}*)s{self._sid[key]} + {off})"
        return base, list(t.shape), list(t.stride())

    def pointwise(
        self,
        out: torch.Tensor,
        expr: str,
        ins: Sequence[Any],
        temp: Any = None,
        ctype: str | None = None,
    ) -> None:
        """``out[idx] = expr`` over ``out``'s shape, inputs broadcast and converted to ``ctype``
        (default: ``out``'s C type); ``temp`` stands for the float scratch ``T``."""
        ob, shape, ostr = self.ref(out)
        ct = ctype or _CTYPE[out.dtype]
        nd = len(shape)
        idx = [f"i{d}" for d in range(nd)]
        names = {}
        for name, v in ins:
            if isinstance(v, torch.Tensor):
                b, s, st = ("T", list(v.shape), list(v.stride())) if v is temp else self.ref(v)
                pad = nd - len(s)
                if pad < 0:
                    raise _Unsupported("input larger than output")
                terms = [
                    f"{idx[pad + d]}*{st[d]}" for d in range(len(s)) if s[d] != 1 and st[d] != 0
                ]
                names[name] = f"(({ct}){b}[{' + '.join(terms) or '0'}])"
            else:
                names[name] = _scalar(v, ct)
        oterms = [f"{idx[d]}*{ostr[d]}" for d in range(nd)]
        value = expr.format(**names)
        if out.dtype == torch.bool:  # a bool byte must hold 0 or 1 (e.g. True + True)
            value = f"(({value}) != 0)"
        body = f"{ob}[{' + '.join(oterms) or '0'}] = {value};"
        loops = [f"for (long {idx[d]} = 0; {idx[d]} < {shape[d]}; ++{idx[d]})" for d in range(nd)]
        if loops:
            loops[-1] = '_Pragma("omp simd") ' + loops[-1]
        self.lines.append(f"  {{ {' '.join(loops)} {body} }}")

    def reduce(self, out: torch.Tensor, x: torch.Tensor, dims: Sequence[int], kind: str) -> None:
        """``out = sum/mean/amax/amin of x over dims`` (out keeps or drops the reduced dims).

        ``sum``/``mean`` of float32 accumulate in double in index order, then round once (ATen
        sums float32 pairwise in float32: results agree to its rounding; a float32 running total
        stopped growing at 2**24, so the sum of 2**25 ones came out 2**24); ``mean`` divides the
        rounded sum by the count in float32, as ATen's ``sum / count`` does. int64 sums wrap, as
        ATen's do; ``amax``/``amin`` propagate NaN, as ATen does.
        """
        ob, _, ostr = self.ref(out)
        xb, xshape, xstr = self.ref(x)
        ct = _CTYPE[out.dtype]
        acc = "double" if ct == "float" and kind in ("sum", "mean") else ct
        nd = len(xshape)
        red = sorted({d % nd for d in dims}) if nd else []
        keep = [d for d in range(nd) if d not in red]
        if out.dim() == nd:  # keepdim
            ostr = [ostr[d] for d in keep]
        assert len(ostr) == len(keep), "reduction output rank"
        idx = [f"i{d}" for d in range(nd)]
        oidx = " + ".join(f"{idx[d]}*{st}" for d, st in zip(keep, ostr)) or "0"
        xidx = " + ".join(f"{idx[d]}*{xstr[d]}" for d in range(nd)) or "0"
        init = {"sum": "0", "mean": "0", "amax": f"{xb}[{xidx}]", "amin": f"{xb}[{xidx}]"}[kind]
        a, o = f"(({acc}){xb}[{xidx}])", f"{ob}[{oidx}]"
        step = {
            "sum": f"r += {a};",
            "mean": f"r += {a};",
            "amax": f"{{ {ct} v = {a}; r = (v > r || v != v) ? v : r; }}",
            "amin": f"{{ {ct} v = {a}; r = (v < r || v != v) ? v : r; }}",
        }[kind]
        count = 1
        for d in red:
            count *= xshape[d]
        outer = "".join(
            f"for (long {idx[d]} = 0; {idx[d]} < {xshape[d]}; ++{idx[d]}) " for d in keep
        )
        inner = "".join(
            f"for (long {idx[d]} = 0; {idx[d]} < {xshape[d]}; ++{idx[d]}) " for d in red
        )
        zero = "".join(f"const long {idx[d]} = 0; " for d in red)
        fin = f"({ct})r / ({ct}){count}" if kind == "mean" else f"({ct})r"
        self.lines.append(
            f"  {{ {outer}{{ {acc} r; {{ {zero}r = {init}; }} {inner}{step} {o} = {fin}; }} }}"
        )

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for equal dtypes (loop-carried values, branch outputs)."""
        self.pointwise(dst, "{b}", [("b", src)])

    def addmm(
        self,
        out: torch.Tensor,
        bias: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        beta: float,
        alpha: float,
    ) -> None:
        """``out = beta * bias + alpha * (a @ b)`` through a GEMM-engine tile (see :func:`_gemm`)."""
        for t in (out, a, b, *([bias] if isinstance(bias, torch.Tensor) else [])):
            if t.dtype != torch.float32:
                raise _Unsupported(f"matmul on {t.dtype}")
        beta, alpha = float(beta), float(alpha)
        if alpha == 0.0:
            # ATen (BLAS) skips the product at alpha 0: inf/NaN in a or b never reach out, which
            # the GEMM's 0 * inf let through as NaN rows. out = beta * bias (0 at beta 0).
            if bias is None or beta == 0.0:
                self.pointwise(out, "{v}", [("v", 0.0)])
            else:
                self.pointwise(out, "({beta} * {c})", [("beta", beta), ("c", bias)])
            return
        ob, (m, n), (os0, os1) = self.ref(out)
        ab, (_, k), (as0, as1) = self.ref(a)
        bb, _, (bs0, bs1) = self.ref(b)
        fast_bias = (
            bias is not None
            and bias.dim() == 1
            and bias.shape[0] == n
            and (bias.stride(0) == 1 or n <= 1)
            and beta == 1.0
            and alpha == 1.0
            and bias.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
        )
        cbias = self.ref(bias)[0] if fast_bias else ""
        optr = out.untyped_storage().data_ptr()
        direct = (
            (bias is None or beta == 0.0 or fast_bias)
            and alpha == 1.0
            and (os1 == 1 or n <= 1)
            and optr not in (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
        )
        cfg = _tile_for(m, n, k)
        fid = self.gemm_fn(cfg, fast_bias)
        npan = (n + cfg[1] - 1) // cfg[1]
        self.pack_floats = max(self.pack_floats, npan * k * cfg[1])
        dst, ldc = (ob, os0) if direct else ("T", n)
        if not direct:
            self.tmp_floats = max(self.tmp_floats, m * n)
        ep = f"{{ {cbias} }}" if fast_bias else "{ 0 }"
        # on torch's threads at replay, as eager mm (the capture's count, baked in, ran a replay
        # after set_num_threads(1) on the captured two threads)
        self.lines.append(
            f"  {{ const void* ep[1] = {ep}; const int64_t eld[1] = {{ 1 }};\n"
            f"    tp_pack({bb}, {bs0}, {bs1}, {k}, {n}, {cfg[1]}, W);\n"
            f"    ((tp_gemm_t)F[{fid}])({dst}, {ldc}, {ab}, {as0}, {as1}, W, {m}, {n}, {k}, {m}, 0,"
            f" ep, eld, {self.replay_threads()}, 0, 1, NULL); }}"
        )
        if direct:
            return
        # General beta/alpha, a 2-D or aliasing bias, a strided output: ATen's formula
        # beta * bias + alpha * (a @ b) elementwise from the product in T (bias ignored at beta 0;
        # a fast bias is in T already, added by the epilogue: adding it here doubled it).
        prod = torch.empty(m, n)  # stand-in with T's layout, to generate the index expression
        terms = ["{p}" if alpha == 1.0 else f"{alpha!r}f * {{p}}"]
        ins: list[tuple[str, Any]] = [("p", prod)]
        if bias is not None and beta != 0.0 and not fast_bias:
            terms.insert(0, "{c}" if beta == 1.0 else f"{beta!r}f * {{c}}")
            ins.append(("c", bias))
        self.pointwise(out, "(" + " + ".join(terms) + ")", ins, temp=prod)

    def add_fn(self, fn: Any) -> int:
        """Index in ``F`` of a native entry point (a ctypes function), added once."""
        for i, f in enumerate(self.fns):
            if f is fn:
                return i
        self.fns.append(fn)
        return len(self.fns) - 1

    def gemm_fn(self, cfg: tuple[int, int], bias: bool) -> int:
        """Index in ``F`` of the engine's ``tp_gemm_{mr}x{nr}`` (no epilogue or a column bias)."""
        key = (cfg, bias)
        if key not in self._fid:
            from torchport.gemm.epilogue import EpilogueSpec, Op
            from torchport.gemm.kernels import _function

            spec = EpilogueSpec((Op("bias_col", "f32"),) if bias else ())
            fn = _function(spec, "f32", "f32", native.cpu_info().isa, cfg[0], cfg[1])
            self._fid[key] = len(self.fns)
            self.fns.append(fn)
        return self._fid[key]


def _tile_for(m: int, n: int, k: int) -> tuple[int, int]:
    """The engine's register tile with the fewest estimated cycles for an ``m x n x k`` product.

    Per ``k`` step a tile ``MR x NR`` (``NV = NR / VW`` vectors) issues ``NV + MR`` loads and
    ``MR * NV`` FMAs (two of each per cycle) and cannot beat the FMA latency (4 cycles) on its
    accumulator chains; remainder rows run the 1-row tile of the same width.
    """
    from torchport.gemm.kernels import TILES
    from torchport.gemm.templates import VW

    isa = native.cpu_info().isa
    vw = VW[isa]

    def per_k(mr: int, nv: int) -> float:
        return max((nv + mr) / 2, mr * nv / 2, 4.0)

    def cost(t: tuple[int, int]) -> float:
        mr, nr = t
        nv = nr // vw
        panels = -(-n // nr)
        return panels * (m // mr * per_k(mr, nv) + m % mr * per_k(1, nv)) * max(k, 1)

    return min(TILES[isa], key=lambda t: (cost(t), -t[0] * t[1]))


def _emit(cg: _Codegen, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    name = func._schema.name.split("::")[-1]
    if _is_view(func) or name in ("detach", "alias", "lift_fresh"):
        return
    base = name.rstrip("_")
    if func._schema.name.startswith("torchport::"):  # capture admits only the GEMV ops
        emit_gemv(cg, name, args, kwargs, out)
        return
    if emit_model_op(cg, name, args, kwargs, out):
        return
    if not isinstance(out, torch.Tensor):
        raise _Unsupported(name)
    floating = out.dtype.is_floating_point
    if base in ("mm", "addmm"):
        if base == "mm":
            cg.addmm(out, None, args[0], args[1], 0.0, 1.0)
        else:
            beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
            alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
            cg.addmm(out, args[0], args[1], args[2], beta, alpha)
        return
    if base in _UNARY:
        if kwargs.get("memory_format") not in (
            None,
            torch.preserve_format,
            torch.contiguous_format,
        ):
            raise _Unsupported(name)
        if base in _FLOAT_ONLY and out.dtype != torch.float32:
            raise _Unsupported(f"{name} on {out.dtype}")
        if base == "logical_not":
            cg.pointwise(out, _UNARY[base], [("a", args[0])], ctype=_CTYPE[args[0].dtype])
            return
        if args[0].dtype != out.dtype:
            raise _Unsupported(f"{name} {args[0].dtype} -> {out.dtype}")
        cg.pointwise(out, _UNARY[base], [("a", args[0])])
        return
    if name == "copy_" or name == "_to_copy":
        src = args[1] if name == "copy_" else args[0]
        if name == "_to_copy" and set(kwargs) - {"dtype", "device", "layout"}:
            raise _Unsupported(name)
        if src.dtype.is_floating_point and not floating:
            raise _Unsupported(f"{name} {src.dtype} -> {out.dtype}")  # C leaves NaN/inf undefined
        if out.dtype == torch.bool and src.dtype != torch.bool:
            cg.pointwise(out, "({b} != 0)", [("b", src)], ctype=_CTYPE[src.dtype])
            return
        cg.pointwise(out, "{b}", [("b", src)])
        return
    if base in ("fill", "zero"):
        cg.pointwise(out, "{v}", [("v", args[1] if base == "fill" else 0)])
        return
    if base in _FACTORY:  # fresh buffers: empty needs no code, the others a fill
        value = _FACTORY[base]
        if value is not None:
            cg.pointwise(out, "{v}", [("v", args[1] if value == "arg1" else value)])
        return
    if base in ("sum", "mean", "amax", "amin"):
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = list(range(x.dim())) if dims is None or list(dims) == [] else list(dims)
        if set(kwargs) - {"dim", "keepdim", "dtype"} or kwargs.get("dtype") not in (
            None,
            out.dtype,
        ):
            raise _Unsupported(name)
        if x.dtype != out.dtype or out.dtype not in (torch.float32, torch.int64):
            raise _Unsupported(f"{name} {x.dtype} -> {out.dtype}")
        if base == "mean" and out.dtype != torch.float32:
            raise _Unsupported(name)
        if x.numel() == 0 and base in ("amax", "amin"):
            raise _Unsupported(name)
        cg.reduce(out, x, dims, base)
        return
    if base == "bitwise_not":
        if floating:
            raise _Unsupported(name)
        cg.pointwise(out, "(!{a})" if out.dtype == torch.bool else "(~{a})", [("a", args[0])])
        return
    if base == "abs":
        # fabs clears the sign bit, as ATen does: a < 0 ? -a : a kept it on -0.0 and -NaN.
        expr = {
            torch.float32: "__builtin_fabsf({a})",
            torch.float64: "__builtin_fabs({a})",
        }.get(out.dtype, "({a} < 0 ? -{a} : {a})")
        cg.pointwise(out, expr, [("a", args[0])])
        return
    if base in ("clamp", "clamp_min", "clamp_max"):
        lo = args[1] if base != "clamp_max" and len(args) > 1 else kwargs.get("min")
        hi = args[2] if base == "clamp" and len(args) > 2 else kwargs.get("max")
        if base == "clamp_max":
            lo, hi = None, args[1]
        if (
            isinstance(lo, torch.Tensor)
            or isinstance(hi, torch.Tensor)
            or not isinstance(args[0], torch.Tensor)
        ):
            raise _Unsupported(f"{name} with tensor bounds")
        expr, ins = "{a}", [("a", args[0])]
        if any(isinstance(v, float) and v != v for v in (lo, hi)):
            # ATen returns NaN everywhere for a NaN bound; a < NaN is false, so the
            # comparisons below returned the input unchanged.
            cg.pointwise(out, "{v}", [("v", float("nan"))])
            return
        if lo is not None:
            expr = f"({expr} < {{lo}} ? {{lo}} : {expr})"
            ins.append(("lo", lo))
        if hi is not None:
            expr = f"(({expr}) > {{hi}} ? {{hi}} : ({expr}))"
            ins.append(("hi", hi))
        cg.pointwise(out, expr, ins)
        return
    if base in _COMPARE:
        ct = _CTYPE[torch.result_type(args[0], args[1])]
        cg.pointwise(
            out, f"({{a}} {_COMPARE[base]} {{b}})", [("a", args[0]), ("b", args[1])], ctype=ct
        )
        return
    if base in _BITWISE:
        ct = _CTYPE[torch.result_type(args[0], args[1])]
        if base.startswith("bitwise"):
            if floating or ct in ("float", "double"):
                raise _Unsupported(name)
            expr = f"({{a}} {_BITWISE[base]} {{b}})"
        else:  # logical: any nonzero is true, the result is bool
            expr = f"(({{a}} != 0) {_BITWISE[base]} ({{b}} != 0))"
        cg.pointwise(out, expr, [("a", args[0]), ("b", args[1])], ctype=ct)
        return
    if base == "where" and len(args) == 3:
        cg.pointwise(out, "({c} ? {a} : {b})", [("c", args[0]), ("a", args[1]), ("b", args[2])])
        return
    if base in _BINARY:
        if base == "div" and (kwargs.get("rounding_mode") is not None or not floating):
            raise _Unsupported(name)  # integer division by zero would trap
        alpha = kwargs.get("alpha", 1)
        rhs = "{b}" if alpha == 1 else "({alpha} * {b})"
        ins = [("a", args[0]), ("b", args[1]), ("alpha", alpha)]
        cg.pointwise(out, f"({{a}} {_BINARY[base]} {rhs})", ins)
        return
    raise _Unsupported(name)


def _read_scalar(cg: _Codegen, t: torch.Tensor) -> str:
    """C expression reading the single element of ``t``."""
    if t.numel() != 1:
        raise _Unsupported("control value with more than one element")
    return f"{cg.ref(t)[0]}[0]"


def _emit_block(cg: _Codegen, trace: Sequence[tuple[Any, ...]]) -> None:
    """Ops, N-way branches and loops of one recorded block, in order."""
    for item in trace:
        kind = item[0]
        if any(layout(t) != was for t, was in item[-1]):
            # (a later op of the capture resized or moved one of its tensors, see _seen)
            raise _Unsupported("a tensor changed layout later in the capture")
        item = item[:-1]
        if kind == "op":
            _, func, args, kwargs, out = item
            cg.written.extend(_writes(func, args, kwargs))
            _emit(cg, func, args, kwargs, out)
        elif kind == "switch":
            _, index, branches, outs = item
            k = cg.fresh("k")
            n = len(branches)
            cg.lines.append(f"  {{ int64_t {k} = (int64_t){_read_scalar(cg, index)};")
            cg.lines.append(f"  {k} = {k} < 0 ? 0 : ({k} > {n - 1} ? {n - 1} : {k});")
            cg.lines.append(f"  switch ({k}) {{")
            for i, (btrace, leaves) in enumerate(branches):
                cg.lines.append(f"  case {i}: {{")
                _emit_block(cg, btrace)
                for dst, src in zip(outs, leaves):
                    if isinstance(dst, torch.Tensor):
                        cg.copy(dst, src)
                cg.lines.append("  } break;")
            cg.lines.append("  } }")
        elif kind == "while":
            _, init, carried, cond_trace, pred, body_trace, body_outs, final = item
            for dst, src in zip(carried, init):
                cg.copy(dst, src)
            cg.lines.append("  for (;;) {")
            _emit_block(cg, cond_trace)
            cg.lines.append(f"  if (!{_read_scalar(cg, pred)}) break;")
            _emit_block(cg, body_trace)
            overlap = {t.untyped_storage().data_ptr() for t in carried} & {
                t.untyped_storage().data_ptr() for t in body_outs
            }
            if overlap:  # e.g. a body returning a carried value: stage the new values first
                staged = [torch.empty_like(t) for t in body_outs]
                cg.extra.extend(staged)
                for dst, src in zip(staged, body_outs):
                    cg.copy(dst, src)
                body_outs = staged
            for dst, src in zip(carried, body_outs):
                cg.copy(dst, src)
            cg.lines.append("  }")
            for dst, src in zip(final, carried):
                cg.copy(dst, src)
        else:
            raise AssertionError(f"unknown trace item {kind}")


def _writes(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (``self`` of ``add_``, ``out=``, a foreach list)."""
    found: list[torch.Tensor] = []
    for i, sa in enumerate(func._schema.arguments):
        if sa.alias_info is None or not sa.alias_info.is_write:
            continue
        v = args[i] if not sa.kwarg_only and i < len(args) else kwargs.get(sa.name)
        found.extend(x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor))
    return found


def lower(
    trace: Sequence[tuple[Any, ...]],
    static: Sequence[torch.Tensor] = (),
) -> tuple[Callable[[], None], Callable[..., None], str] | None:
    """C function for ``trace`` (see :class:`~torchport.graphs.capture.Recorder`: ops with their
    real tensors, ``switch`` and ``while`` items), or ``None`` if something is unsupported.

    ``static`` are the capture's static inputs: ``run`` bumps the version counter of each tensor
    the program writes in place on their memory (``p.add_``, ``out=p``, a view of ``p``), as the
    ops did in eager. The C program writes them behind autograd's back: a cache keyed on
    ``(data_ptr, _version)`` (``torchport.compile``'s batched weights) kept serving the values
    from before a replayed optimizer step, and autograd could not see a saved tensor change.
    Replays of one program run one at a time (a lock, as CUDA launches of one executable graph
    are serialised): they share the loop-variable, switch-output and scratch buffers, and two
    threads replaying it at once (ctypes releases the GIL) corrupted each other's results.

    Returns ``(run, guard, source)``. The program holds raw pointers into the captured storages
    (and keeps those storages alive): after a ``resize_`` that reallocates one, or a ``set_``
    that moves a captured tensor to other memory, a replay would use freed memory or write where
    the tensor no longer looks; after an in-place layout change at the same address (``t_``,
    ``transpose_``, a shrinking ``resize_``, ``as_strided_``) it would read and write the tensor
    with its capture-time shape and strides (wrong values, an output of the old shape).
    ``guard(tensors, labels, then)`` makes ``run`` compare each tensor's ``data_ptr()``, shape
    and strides with ``then`` (their values as the capture ended) and raise
    :class:`~torchport.graphs.GraphError` naming the first that changed (about 0.35 us per
    tensor). Any reallocation of a storage moves every
    tensor on it, and a view's layout is derived from its base's at capture time, so guarding
    the tensors the caller can reach (static inputs and outputs) suffices; intermediates nobody
    holds cannot change.
    """
    if not native.enabled():
        return None
    cg = _Codegen()
    try:
        _emit_block(cg, trace)
    except _Unsupported:
        return None
    decls = [f"  char* const s{i} = P[{i}];" for i in range(len(cg.storages))]
    ns = len(cg.storages)
    decls += [f"  float* const W = (float*)P[{ns}];", f"  float* const T = (float*)P[{ns + 1}];"]
    decls += [f"  const int64_t NT = TP_MAX(*(const int64_t*)P[{ns + 2}], 1);"]
    src = (
        native.PRELUDE
        + _MATH
        + GEMM_F32_ENTRY_TYPEDEF
        + GEMV_ENTRY_TYPEDEF
        + _PACK
        + "\nTP_EXPORT int tp_graph(char** P, void** F) {\n"
        + "\n".join([*decls, "  (void)F; (void)W; (void)T; (void)NT;", *cg.lines])
        + "\n  return 0;\n}\n"
    )
    try:
        # No FP-exception side effects to keep: lets gcc if-convert (vectorise) the math loops;
        # integer arithmetic wraps, as ATen's does.
        lib = native.build(src, name="tp_graph", extra_flags=["-fno-trapping-math", "-fwrapv"])
    except native.NativeError as e:
        native.note_fallback("graphs.native", f"graph program did not compile: {e}")
        return None
    fn = lib.tp_graph
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    scratch = [torch.empty(max(1, cg.pack_floats)), torch.empty(max(1, cg.tmp_floats))]
    # The storages themselves, not tensors on them: a later ``set_`` of a captured tensor then
    # leaves the memory the program writes alive (and the guard reports the move).
    keep = [t.untyped_storage() for t in cg.storages]
    threads = ctypes.c_int64(native.num_threads())  # NT: set before each call that reads it
    reads_threads = cg.reads_threads
    lock = threading.Lock()
    memory = {t.untyped_storage().data_ptr() for t in static}
    bump = list({id(t): t for t in cg.written if t.untyped_storage().data_ptr() in memory}.values())
    ptrs = (ctypes.c_void_p * (ns + 3))(
        *[st.data_ptr() for st in keep],
        *[t.data_ptr() for t in scratch],
        ctypes.addressof(threads),
    )
    fptrs = (ctypes.c_void_p * max(1, len(cg.fns)))(
        *[ctypes.cast(f, ctypes.c_void_p).value for f in cg.fns]
    )

    errors = list(cg.errors)
    watch: list[torch.Tensor] = []  # filled by guard() once the capture knows its outputs
    expect: list[int] = []
    sizes: list[torch.Size] = []
    strides: list[tuple[int, ...]] = []
    labels: list[str] = []

    def run() -> None:
        # The addresses of the 51 watched tensors (static inputs and outputs) of `bench graphs`'
        # 200-op MLP, whose replay is ~65 us, cost 3.4 us (a list comprehension took 4.2 us);
        # shapes and strides too, ~4x that (4.4 -> 18.4 us measured on a loaded machine)
        if (
            list(map(_data_ptr, watch)) != expect
            or list(map(_size, watch)) != sizes
            or list(map(_stride, watch)) != strides
        ):
            _changed(watch, expect, sizes, strides, labels)
        with lock:
            if reads_threads:  # (torch's getter direct: native.num_threads() cost 0.3 us more)
                threads.value = _get_num_threads()
            rc = fn(ptrs, fptrs)
        if bump:  # (before an error too: the program may have written part of them)
            _increment_version(bump)
        if rc:
            raise IndexError(f"graph replay: {errors[rc - 1]}")

    def guard(
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        then: Sequence[tuple[int, torch.Size, tuple[int, ...]]],
    ) -> None:
        watch[:] = tensors
        expect[:] = [p for p, _, _ in then]
        sizes[:] = [size for _, size, _ in then]
        strides[:] = [stride for _, _, stride in then]
        labels[:] = names

    run.__dict__["_keep"] = (lib, ptrs, fptrs, cg.fns, keep, scratch, threads)
    return run, guard, src


_data_ptr = torch.Tensor.data_ptr
_size = torch.Tensor.size
_stride = torch.Tensor.stride
_get_num_threads = torch.get_num_threads
_increment_version = torch._C._increment_version


def _changed(
    watch: Sequence[torch.Tensor],
    expect: Sequence[int],
    sizes: Sequence[torch.Size],
    strides: Sequence[tuple[int, ...]],
    labels: Sequence[str],
) -> None:
    """Raise for the first watched tensor that left its capture-time address or layout."""
    from torchport.graphs.capture import GraphError

    for t, label, p, size, stride in zip(watch, labels, expect, sizes, strides):
        if t.data_ptr() != p:
            raise GraphError(
                f"Graph.replay: {label} (Tensor{tuple(t.shape)} {t.dtype}) is no longer at its "
                f"capture-time address (0x{p:x}, now 0x{t.data_ptr():x}): its storage was "
                "replaced or reallocated (set_, resize_, share_memory_) since the capture, and "
                "the native program would use freed memory; write new values with copy_, or "
                "reset() and capture again"
            )
        if t.shape != size or t.stride() != stride:
            raise GraphError(
                f"Graph.replay: {label} has shape {tuple(t.shape)} and strides {t.stride()} but "
                f"was captured with shape {tuple(size)} and strides {stride} (t_, transpose_, "
                "resize_ or as_strided_ since the capture), and the native program reads and "
                "writes it with its capture-time layout; shapes and layouts are frozen at "
                "capture time: write new values with copy_, or reset() and capture again"
            )
