"""Vectorised elementwise and reduction kernels: fused ``a*x + y`` and row sums.

The first kernel family on the native toolchain, with references beside them.

Numerics the native paths must match:

- ``axpy(alpha, x, y) = alpha * x + y`` elementwise. float32 and float64 compute one fused
  multiply-add per element; bfloat16 loads widen to float32, compute the same FMA and round to
  nearest-even once. Tolerance vs :func:`axpy_reference` (float64 math, one rounding): float64
  1e-12, float32 ≤ 1 ulp, bfloat16 ≤ 1 ulp.
- ``rowsum(x)[i] = sum_j x[i, j]`` over the last dimension of a 2-D tensor (rows may be strided).
  float32/bfloat16 accumulate in float32 with ``unroll`` independent vector accumulators; float64
  in float64. bfloat16 rounds once at the end. Tolerance vs :func:`rowsum_reference` (float64):
  relative 1e-5·sqrt(n) for float32, 1e-12·sqrt(n) for float64, one bf16 ulp for bfloat16.

Both are ``torch.library`` custom ops (``torchport::axpy``, ``torchport::rowsum``) with fake
implementations; when no native kernel can be built they fall back, visibly, to ATen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torchport import autotune, native
from torchport.autotune import ATEN, Candidate, InvalidCandidate
from torchport.native import FloatArg, IntArg, Kernel, TensorArg

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_TAG = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
UNROLLS = (1, 2, 4)


class ElementwiseInputError(ValueError):
    """Inputs to an elementwise kernel do not meet its requirements."""


# --- vector vocabulary per (dtype, ISA): the templates are written against these macros ---------


def _vector_macros(dtype: torch.dtype, isa: str) -> str:
    """C macros VEC/VL/LOAD/STORE/FMA/ADD/SET1/ZERO/HSUM plus scalar SLOAD/SSTORE and ACC_T."""
    if dtype == torch.float64:
        scalar = "#define ELEM double\n#define ACC_T double\n#define SFMA fma\n#define SLOAD(p) (*(p))\n#define SSTORE(p, v) (*(p) = (v))\n"
        if isa == "avx512":
            return scalar + (
                "#define VEC __m512d\n#define VL 8\n#define LOAD(p) _mm512_loadu_pd(p)\n"
                "#define STORE(p, v) _mm512_storeu_pd((p), (v))\n#define FMA(a, b, c) _mm512_fmadd_pd(a, b, c)\n"
                "#define ADD(a, b) _mm512_add_pd(a, b)\n#define SET1(x) _mm512_set1_pd(x)\n"
                "#define ZERO() _mm512_setzero_pd()\n#define HSUM(v) _mm512_reduce_add_pd(v)\n"
            )
        if isa == "avx2":
            return scalar + (
                "#define VEC __m256d\n#define VL 4\n#define LOAD(p) _mm256_loadu_pd(p)\n"
                "#define STORE(p, v) _mm256_storeu_pd((p), (v))\n#define FMA(a, b, c) _mm256_fmadd_pd(a, b, c)\n"
                "#define ADD(a, b) _mm256_add_pd(a, b)\n#define SET1(x) _mm256_set1_pd(x)\n"
                "#define ZERO() _mm256_setzero_pd()\n"
                "TP_INLINE double HSUM(__m256d v) { __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));"
                " return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s))); }\n"
            )
    else:
        if dtype == torch.float32:
            scalar = "#define ELEM float\n#define ACC_T float\n#define SFMA fmaf\n#define SLOAD(p) (*(p))\n#define SSTORE(p, v) (*(p) = (v))\n"
            ld512, st512 = "_mm512_loadu_ps(p)", "_mm512_storeu_ps((p), (v))"
            ld256, st256 = "_mm256_loadu_ps(p)", "_mm256_storeu_ps((p), (v))"
        else:
            scalar = (
                "#define ELEM uint16_t\n#define ACC_T float\n#define SFMA fmaf\n#define SLOAD(p) tp_bf16_to_f32(*(p))\n"
                "#define SSTORE(p, v) (*(p) = tp_f32_to_bf16(v))\n"
            )
            ld512, st512 = "tp_bf16x16_to_f32(p)", "tp_f32x16_to_bf16((p), (v))"
            ld256, st256 = "tp_bf16x8_to_f32(p)", "tp_f32x8_to_bf16((p), (v))"
        if isa == "avx512":
            return scalar + (
                f"#define VEC __m512\n#define VL 16\n#define LOAD(p) {ld512}\n#define STORE(p, v) {st512}\n"
                "#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)\n#define ADD(a, b) _mm512_add_ps(a, b)\n"
                "#define SET1(x) _mm512_set1_ps(x)\n#define ZERO() _mm512_setzero_ps()\n"
                "#define HSUM(v) _mm512_reduce_add_ps(v)\n"
            )
        if isa == "avx2":
            return scalar + (
                f"#define VEC __m256\n#define VL 8\n#define LOAD(p) {ld256}\n#define STORE(p, v) {st256}\n"
                "#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)\n#define ADD(a, b) _mm256_add_ps(a, b)\n"
                "#define SET1(x) _mm256_set1_ps(x)\n#define ZERO() _mm256_setzero_ps()\n"
                "TP_INLINE float HSUM(__m256 v) { __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));"
                " s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s); }\n"
            )
    # portable scalar "vectors" of width 1
    return scalar + (
        "#define VEC ACC_T\n#define VL 1\n#define LOAD(p) SLOAD(p)\n#define STORE(p, v) SSTORE((p), (v))\n"
        "#define FMA(a, b, c) SFMA((a), (b), (c))\n#define ADD(a, b) ((a) + (b))\n#define SET1(x) ((ACC_T)(x))\n"
        "#define ZERO() ((ACC_T)0)\n#define HSUM(v) (v)\n"
    )


_AXPY = r"""
${macros}
/* out[i] = alpha * x[i] + y[i] for i in [0, n); ${unroll} vectors per iteration */
TP_EXPORT int tp_axpy(ELEM *out, const ELEM *x, const ELEM *y, double alpha_d, int64_t n, int64_t nthreads) {
    const ACC_T alpha = (ACC_T)alpha_d;
    const int64_t step = (int64_t)VL * ${unroll};
    int64_t nt = n < 65536 ? 1 : nthreads;
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        tp_chunk(n, omp_get_num_threads(), omp_get_thread_num(), step, &lo, &hi);
        VEC va = SET1(alpha);
        int64_t i = lo;
        for (; i + step <= hi; i += step) {
            #pragma GCC unroll 8
            for (int u = 0; u < ${unroll}; ++u) {
                VEC r = FMA(va, LOAD(x + i + u * VL), LOAD(y + i + u * VL));
                STORE(out + i + u * VL, r);
            }
        }
        for (; i < hi; ++i) SSTORE(out + i, SFMA(alpha, SLOAD(x + i), SLOAD(y + i)));
    }
    return 0;
}
"""

_ROWSUM = r"""
${macros}
TP_INLINE ACC_T tp_row(const ELEM *x, int64_t lo, int64_t hi) {
    VEC acc[${unroll}];
    for (int u = 0; u < ${unroll}; ++u) acc[u] = ZERO();
    const int64_t step = (int64_t)VL * ${unroll};
    int64_t j = lo;
    for (; j + step <= hi; j += step) {
        #pragma GCC unroll 8
        for (int u = 0; u < ${unroll}; ++u) acc[u] = ADD(acc[u], LOAD(x + j + u * VL));
    }
    for (; j + VL <= hi; j += VL) acc[0] = ADD(acc[0], LOAD(x + j));
    for (int u = 1; u < ${unroll}; ++u) acc[0] = ADD(acc[0], acc[u]);
    ACC_T s = HSUM(acc[0]);
    for (; j < hi; ++j) s += SLOAD(x + j);
    return s;
}

/* out[i] = sum_j x[i * ld + j], j < cols */
TP_EXPORT int tp_rowsum(ELEM *out, const ELEM *x, int64_t rows, int64_t cols, int64_t ld, int64_t nthreads) {
    if (rows >= nthreads || cols < 65536) {
        int64_t nt = (rows * cols < 32768) ? 1 : nthreads;
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < rows; ++i) SSTORE(out + i, tp_row(x + i * ld, 0, cols));
        return 0;
    }
    for (int64_t i = 0; i < rows; ++i) {  /* few long rows: split each row across threads */
        ACC_T part[256];
        int64_t nt = TP_MIN(nthreads, 256), got = 1;
        /* the threads OpenMP grants may be fewer than nt (OMP_THREAD_LIMIT, OMP_DYNAMIC, a
           nested region): only their parts are summed (the rest held stack garbage) */
        #pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi, t = omp_get_thread_num(), n = omp_get_num_threads();
            if (t == 0) got = n;
            tp_chunk(cols, n, t, 64, &lo, &hi);
            part[t] = tp_row(x + i * ld, lo, hi);
        }
        ACC_T s = 0;
        for (int64_t t = 0; t < got; ++t) s += part[t];
        SSTORE(out + i, s);
    }
    return 0;
}
"""


@functools.cache
def _kernel(op: str, dtype: torch.dtype, isa: str, unroll: int) -> Kernel:
    """Render, build and bind one variant (cached per process; the .so is cached on disk)."""
    if unroll not in UNROLLS:
        raise InvalidCandidate(f"unroll must be one of {UNROLLS}, got {unroll}")
    body = _AXPY if op == "axpy" else _ROWSUM
    src = native.render(body, macros=_vector_macros(dtype, isa), unroll=unroll)
    lib = native.build(src, name=f"{op}_{_TAG[dtype]}_{isa}_u{unroll}", isa=isa)
    t = TensorArg
    spec: tuple[native.launch.ArgSpec, ...]
    if op == "axpy":
        spec = (
            t("out", (dtype,)),
            t("x", (dtype,)),
            t("y", (dtype,)),
            FloatArg("alpha"),
            IntArg("n"),
            IntArg("nthreads"),
        )
        return Kernel(lib, "tp_axpy", spec)
    spec = (
        t("out", (dtype,)),
        t("x", (dtype,), ndim=2, contiguous=False),
        IntArg("rows"),
        IntArg("cols"),
        IntArg("ld"),
        IntArg("nthreads"),
    )
    return Kernel(lib, "tp_rowsum", spec)


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ElementwiseInputError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # (sparse / mkldnn: an unrelated RuntimeError further on)
        raise ElementwiseInputError(f"{op}: {name} must be a strided tensor, got {t.layout}")
    if t.dtype not in DTYPES:
        raise ElementwiseInputError(
            f"{op}: {name} must be float32, float64 or bfloat16, got {t.dtype}"
        )
    if t.device.type != "cpu":
        raise ElementwiseInputError(f"{op}: {name} must be on cpu, got {t.device}")


# --- axpy ----------------------------------------------------------------------------------------


def axpy_reference(alpha: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``alpha * x + y`` in float64, rounded once to the inputs' dtype."""
    return (alpha * x.double() + y.double()).to(x.dtype)


def _axpy_native(alpha: float, x: torch.Tensor, y: torch.Tensor, unroll: int = 4) -> torch.Tensor:
    k = _kernel("axpy", x.dtype, native.cpu_info().isa, unroll)
    xc, yc = x.contiguous(), y.contiguous()
    out = torch.empty_like(xc)
    k(out, xc, yc, float(alpha), xc.numel(), native.num_threads())
    return out


def _axpy_impl(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    if native.enabled():
        try:
            return _axpy_native(alpha, x, y)
        except native.NativeError as e:
            native.note_fallback("axpy", e)
    return torch.add(y, x, alpha=alpha)


_axpy_op = torch.library.custom_op("torchport::axpy", _axpy_impl, mutates_args=())


@_axpy_op.register_fake
def _(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _axpy_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.alpha = inputs[2]


def _axpy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    # d(alpha*x + y)/dx = alpha, /dy = 1
    return grad * ctx.alpha, grad, None


_axpy_op.register_autograd(_axpy_backward, setup_context=_axpy_setup)


def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fused ``alpha * x + y`` (same shape and dtype; float32/float64/bfloat16; CPU)."""
    _check_dtype("axpy", "x", x)
    _check_dtype("axpy", "y", y)
    if x.shape != y.shape:
        raise ElementwiseInputError(
            f"axpy: x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.dtype != y.dtype:
        raise ElementwiseInputError(
            f"axpy: x and y must have the same dtype, got {x.dtype} and {y.dtype}"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ElementwiseInputError(f"axpy: alpha must be a real number, got {alpha!r}")
    try:
        alpha_f = float(alpha)
    except OverflowError:  # (an int past the double range raised it bare)
        raise ElementwiseInputError(
            f"axpy: alpha must fit in a double, got an int of {int(alpha).bit_length()} bits"
        ) from None
    if native.eager_fast_path(x, y):
        return _axpy_impl(x, y, alpha_f)
    return _axpy_op(x, y, alpha_f)


# --- rowsum --------------------------------------------------------------------------------------


def rowsum_reference(x: torch.Tensor) -> torch.Tensor:
    """Row sums in float64, rounded once to the input dtype."""
    return x.double().sum(dim=1).to(x.dtype)


def _rowsum_native(x: torch.Tensor, unroll: int) -> torch.Tensor:
    k = _kernel("rowsum", x.dtype, native.cpu_info().isa, unroll)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, dtype=x.dtype)
    ld = x.stride(0) if rows > 0 else cols
    k(out, x, rows, cols, ld, native.num_threads())
    return out


def _rowsum_candidates() -> list[Candidate]:
    return [Candidate("aten_sum", ATEN)] + [
        Candidate(f"native_u{u}", params=(("unroll", u),)) for u in UNROLLS
    ]


def _rowsum_factory(c: Candidate) -> Callable[[torch.Tensor], torch.Tensor]:
    if c.is_anchor:
        return lambda x: x.sum(dim=1)
    unroll = int(c.param("unroll"))
    return lambda x: _rowsum_native(x, unroll)


def _rowsum_close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    tol = 1e-2 if out.dtype == torch.bfloat16 else 1e-4
    return bool(torch.allclose(out.double(), ref.double(), rtol=tol, atol=tol))


def rowsum_choice(x: torch.Tensor) -> autotune.Choice:
    """Autotuned candidate for a row sum of this shape/dtype/layout (ATen anchor timed)."""
    key = {"shape": list(x.shape), "dtype": str(x.dtype), "stride": list(x.stride())}
    return autotune.select(
        "rowsum",
        key,
        _rowsum_candidates(),
        _rowsum_factory,
        lambda: (torch.randn(tuple(x.shape), generator=autotune.sample_generator()).to(x.dtype),),
        cold=True,
        check=_rowsum_close,
        backends={"NATIVE", "ATEN"} if native.enabled() else {"ATEN"},
    )


def _rowsum_impl(x: torch.Tensor, unroll: int) -> torch.Tensor:
    if native.enabled() and unroll > 0:
        try:
            return _rowsum_native(x, unroll)
        except native.NativeError as e:
            native.note_fallback("rowsum", e)
    return x.sum(dim=1)


_rowsum_op = torch.library.custom_op("torchport::rowsum", _rowsum_impl, mutates_args=())


@_rowsum_op.register_fake
def _(x: torch.Tensor, unroll: int) -> torch.Tensor:
    return x.new_empty((x.shape[0],))


def _rowsum_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.shape = inputs[0].shape


def _rowsum_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # every element of row i contributes once to out[i]
    return grad.unsqueeze(1).expand(ctx.shape), None


_rowsum_op.register_autograd(_rowsum_backward, setup_context=_rowsum_setup)


def rowsum(x: torch.Tensor, *, unroll: int | None = None) -> torch.Tensor:
    """Sum over the last dimension of a 2-D tensor (float32/float64/bfloat16; CPU).

    ``unroll=None`` asks the autotuner (cached per shape); ``0`` forces ATen.
    """
    _check_dtype("rowsum", "x", x)
    if x.dim() != 2:
        raise ElementwiseInputError(
            f"rowsum: x must be 2-D, got {x.dim()}-D shape {tuple(x.shape)}"
        )
    if unroll is None:
        c = rowsum_choice(x)
        unroll = 0 if c.candidate.is_anchor else int(c.candidate.param("unroll"))
    elif (
        isinstance(unroll, bool)
        or not isinstance(unroll, int)
        or (unroll and unroll not in UNROLLS)
    ):
        # (True == 1 and 2.0 == 2 passed the membership test, and reached the C source)
        raise ElementwiseInputError(f"rowsum: unroll must be 0 or one of {UNROLLS}, got {unroll}")
    if native.eager_fast_path(x):
        return _rowsum_impl(x, unroll)
    return _rowsum_op(x, unroll)
