"""C templates for GEMM ``C[M, N] = epilogue(A[M, K] @ B[K, N])`` on the native toolchain.

Kernel structure (one exported function per register tile ``MR x NR``):

- ``B`` arrives packed in column panels of ``NR`` (``[ceil(N/NR)][K][NR]``, zero padded; float32 or
  bfloat16, see :mod:`~torchport.gemm.pack`), so the micro-kernel reads one contiguous stream;
- ``A`` is read in place through its two strides (float32; bf16 ``A`` is widened first), each
  element broadcast once per ``k`` against ``NR / VW`` vector loads of ``B``;
- threads split the ``N`` panels (``nthreads`` explicit); each thread walks ``M`` in blocks of
  ``mc`` rows (a runtime parameter; ``mc >= M`` is the weight-streaming order used for small ``M``:
  every panel of ``B`` is read from memory once and reused from L1/L2 by all rows);
- accumulators stay in registers over the whole ``K`` (no partial stores), so the epilogue is applied
  once, on the fp32 accumulator, right before the single store; ``pf`` is a software-prefetch
  distance in ``k`` rows (0 = off).

ISA levels: ``avx2`` (8-wide ymm, FMA) is what runs on AVX2 machines; ``avx512`` (16-wide zmm) and,
on AVX512-BF16 machines, ``vdpbf16ps`` tiles for bf16 (``render_source(dp=True)``,
:data:`DP_TILES`): ``A`` read as k-pair words, ``B`` pair-packed, two products per lane and
instruction and no widening. The "large" ones (M > 32) use the drivers, blocking and epilogue store
above; the "small" ones (M <= 32, where the widening tiles are compute-bound on bf16 at M >= 8)
have their own weight-streaming driver ``tp_gemm_dp_{MR}x{NR}`` over whole K. ``scalar`` is
portable C. Remainder columns go through
a small buffer and the scalar epilogue. Remainder rows (``M % MR``) run the 1-row tile of the
same width, so only two tiles per width are compiled (the autotuner prefers an ``MR`` dividing
small ``M``).
"""

from __future__ import annotations

import math
import struct

from torchport.gemm.epilogue import TRANSCENDENTAL_KINDS, EpilogueSpec, emit_c, emit_prefetch
from torchport.native.prelude import AMX_TILE_C

VW = {"avx2": 8, "avx512": 16, "scalar": 1}

# Cache level the K loop's software prefetch of the B panel targets (x86 hint)
B_PREFETCH_HINT = "_MM_HINT_T1"

# C type of the fp32 ``tp_gemm_{mr}x{nr}`` entry points (``_driver`` below), for generated code in
# other subsystems that calls them through a function pointer (the graphs native tier). Keep the
# two in step: a mismatch is undefined behaviour at the call, not a compile error.
GEMM_F32_ENTRY_TYPEDEF = (
    "typedef int (*tp_gemm_t)(float *C, int64_t ldc, const float *A, int64_t sa0, int64_t sa1,\n"
    "    const float *Bp, int64_t M, int64_t N, int64_t K, int64_t mc, int64_t pf,\n"
    "    const void *const *ep, const int64_t *eld, int64_t nthreads, int64_t kc, int64_t ks,\n"
    "    float *W);\n"
)

# erf(x) = x * P(x^2) / Q(x^2) on |x| <= 3.92 (x clamped there: erf(3.92) rounds to 1 in fp32).
# Our own fit: float64 weighted least squares on the linearised problem P - erf(x)/x * Q, reweighted
# (Lawson) towards minimax relative error; fit error 1.9e-8, all Q coefficients positive (no poles).
_ERF_CLAMP = "3.92f"
_ERF_P = (
    "1.128379107e+00f",
    "1.903941482e-01f",
    "5.274715647e-02f",
    "3.765106434e-03f",
    "2.848743461e-04f",
    "2.050222292e-06f",
)
_ERF_Q = (
    "1.000000000e+00f",
    "5.020651817e-01f",
    "1.141040772e-01f",
    "1.496819220e-02f",
    "1.162417582e-03f",
    "3.809267946e-05f",
)
# 2^f = 1 + f * E(f) on |f| <= 1/2: the exp(r) = 1 + r E'(r) fit above's kind on |r| <= ln2 / 2
# (relative error 9.1e-8), its coefficients times ln2^(k+1) (the same polynomial in f = r / ln2)
_EXP2_E = (
    "6.931469740e-01f",
    "2.402224261e-01f",
    "5.550733592e-02f",
    "9.671512848e-03f",
    "1.326471879e-03f",
)


def _twice(c: str) -> str:
    """A C float literal for twice the float32 that ``c`` rounds to (exact: a float32 still)."""
    return _c_float(2.0 * struct.unpack("f", struct.pack("f", float(c.rstrip("f"))))[0])


def _horner(var: str, coefs: tuple[str, ...], fma: str, set1: str) -> str:
    expr = f"{set1}({coefs[-1]})"
    for c in coefs[-2::-1]:
        expr = f"{fma}({expr}, {var}, {set1}({c}))"
    return expr


_VOCAB = {
    "avx2": r"""
#define VEC __m256
#define VLOAD_f32(p) _mm256_loadu_ps(p)
#define VLOAD_bf16(p) tp_bf16x8_to_f32(p)
#define VSTORE_f32(p, v) _mm256_storeu_ps((p), (v))
#define VSTORE_bf16(p, v) tp_f32x8_to_bf16((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
/* 2^(n-1) from t = n + 1.5 * 2^23 (n in t's low mantissa bits): shift them into the exponent, add
   the bias less one (n in [-125, 128]: n = 128 is 2^127, finite; n = -126 gives 0) */
#define VPOW2BITS(t) _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23), _mm256_set1_epi32(126 << 23)))
#define VPREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define VPREFETCH_L2(p) _mm_prefetch((const char *)(p), TP_B_PREFETCH_HINT)
/* 16 bf16 weights [c0..c15] in one load as two fp32 vectors: the even columns [c0, c2, ..., c14]
   (a shift) and the odd ones [c1, ..., c15] (an and). Two widening loads take two shuffles and
   two shifts, which share their ports with the FMAs (see _k_body). The and's mask is read
   where it is used (volatile): hoisted into a register, the 4x24 tile's 17th, it made GCC
   spill accumulators in the prefetching K loop */
static const uint32_t tp_hi_mask[8] __attribute__((aligned(32))) = {
    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
#define VPAIR_bf16(p, e, o) do { \
    __m256i w_ = _mm256_loadu_si256((const __m256i *)(p)); \
    (e) = _mm256_castsi256_ps(_mm256_slli_epi32(w_, 16)); \
    (o) = _mm256_castsi256_ps(_mm256_and_si256(w_, *(const volatile __m256i *)tp_hi_mask)); \
} while (0)
/* columns [c0..c7], [c8..c15] -> even [c0, c2, ..., c14], odd [c1, ..., c15], and back */
TP_INLINE void tp_to_eo(__m256 *a, __m256 *b) {
    __m256 e = _mm256_shuffle_ps(*a, *b, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(*a, *b, _MM_SHUFFLE(3, 1, 3, 1));
    *a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}
TP_INLINE void tp_from_eo(__m256 *a, __m256 *b) {
    __m256 lo = _mm256_unpacklo_ps(*a, *b), hi = _mm256_unpackhi_ps(*a, *b);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}
""",
    "avx512": r"""
#define VEC __m512
#define VLOAD_f32(p) _mm512_loadu_ps(p)
#define VLOAD_bf16(p) tp_bf16x16_to_f32(p)
#define VSTORE_f32(p, v) _mm512_storeu_ps((p), (v))
#define VSTORE_bf16(p, v) tp_f32x16_to_bf16((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VPOW2BITS(t) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_castps_si512(t), 23), _mm512_set1_epi32(126 << 23)))
#define VPREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define VPREFETCH_L2(p) _mm_prefetch((const char *)(p), TP_B_PREFETCH_HINT)
""",
    "scalar": r"""
#define VEC float
#define VLOAD_f32(p) (*(p))
#define VLOAD_bf16(p) tp_bf16_to_f32(*(p))
#define VSTORE_f32(p, v) (*(p) = (v))
#define VSTORE_bf16(p, v) (*(p) = tp_f32_to_bf16(v))
#define VSET1(x) ((float)(x))
#define VZERO() 0.0f
#define VADD(a, b) ((a) + (b))
#define VMUL(a, b) ((a) * (b))
#define VFMA(a, b, c) fmaf(a, b, c)
#define VMAX(a, b) ((b) < (a) ? (a) : (b))
#define VPREFETCH(p) __builtin_prefetch(p)
#define VPREFETCH_L2(p) __builtin_prefetch(p, 0, 2)
""",
}

_SCALAR_MATH = r"""
#define SLOAD_f32(p) (*(p))
#define SLOAD_bf16(p) tp_bf16_to_f32(*(p))
#define SSTORE_f32(p, v) (*(p) = (v))
#define SSTORE_bf16(p, v) (*(p) = tp_f32_to_bf16(v))
TP_INLINE float tp_sgelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
TP_INLINE float tp_sgelu_tanh(float x) {
    float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * y));
}
TP_INLINE float tp_ssilu(float x) { return x / (1.0f + expf(-x)); }
"""


def _c_float(v: float) -> str:
    """The C float literal of the float32 nearest to the double ``v``: that float32's exact
    value as a C99 hexadecimal literal. (A decimal printed from the double and parsed by the
    compiler as a float rounds twice, which may land one float32 away from the nearest; none
    of the constants here did, but the literal is exact by construction now.)"""
    assert math.isfinite(v), f"not a finite constant: {v!r}"
    f32 = struct.unpack("f", struct.pack("f", v))[0]
    mantissa, exponent = f32.hex().split("p")
    return f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"


def _gelu_erf_coefs(coefs: tuple[str, ...], scale: float) -> tuple[str, ...]:
    """``coefs`` of a polynomial in ``u = y^2`` re-expressed in ``x^2`` for ``y = x / sqrt(2)``
    (``c_k / 2^k``), times ``scale``."""
    return tuple(_c_float(float(c.rstrip("f")) * scale / 2.0**k) for k, c in enumerate(coefs))


# 0.5 erf(x / sqrt2) = x P'(x^2) / Q'(x^2): the erf fit with x / sqrt2 and the 0.5 folded in
_GELU_P = _gelu_erf_coefs(_ERF_P, 0.5 * math.sqrt(0.5))
_GELU_Q = _gelu_erf_coefs(_ERF_Q, 1.0)
_GELU_CLAMP = _c_float(4.05 * math.sqrt(2.0))

_GELU_RATIONAL = (
    r"""
/* GELU(x) = x (1/2 + 1/2 erf(x / sqrt2)) with 1/2 erf(x / sqrt2) = x P'(x^2) / Q'(x^2) (the erf
   fit with x / sqrt2 and the 1/2 folded into the coefficients), clamped to +-1/2: the fit passes 1
   at |x / sqrt2| = 3.97 and grows beyond, so x clamped to +-${gelu_clamp} (4.05 sqrt2) gives exactly
   +-1/2 there (x = -inf: -inf * 0 = NaN, as torch). A true division: GELU near x = -5 needs erf to
   ~1e-7 absolute, which an estimate-plus-Newton reciprocal (2^-22 relative) missed */
TP_INLINE VEC tp_vgelu(VEC x) {
    VEC c = VMIN(VMAX(x, VSET1(-${gelu_clamp})), VSET1(${gelu_clamp}));
    VEC c2 = VMUL(c, c);
    VEC p = ${gelu_p};
    VEC q = ${gelu_q};
    VEC e = VMIN(VMAX(VDIV(VMUL(c, p), q), VSET1(-0.5f)), VSET1(0.5f));
    return VMUL(x, VADD(VSET1(0.5f), e));
}
""".replace("${gelu_p}", _horner("c2", _GELU_P, "VFMA", "VSET1"))
    .replace("${gelu_q}", _horner("c2", _GELU_Q, "VFMA", "VSET1"))
    .replace("${gelu_clamp}", _GELU_CLAMP)
)

# Phi(x) = 1/2 (1 + erf(x / sqrt2)) on [k/2 - 1/4, k/2 + 1/4], k = -11..11 (a row each, columns
# c0..c5), as the degree-5 polynomial c0 + c1 r + ... + c5 r^5 in r = x - k/2. Our own fit per
# interval: float64 weighted least squares on 600 Chebyshev points reweighted towards minimax
# absolute error (Lawson), then rounded to float32 from c5 down, the lower coefficients refitted
# after each rounding. Fit error with the float32 coefficients 4.5e-8 at most (k >= 0, where c0's
# own rounding is that size); on the negative side it shrinks with Phi (1.8e-8 at x = -1, 4e-12 at
# -5.5), so x Phi(x) stays accurate where Phi is small. Beyond +-5.75 Phi is taken as 1 and 0:
# x Phi(x) is then off by at most 5.75 Phi(-5.75) = 2.6e-8.
_GELU_PHI = """
 1.89936404e-08  1.07713021e-07  2.94997847e-07  5.23468657e-07  7.22114180e-07  7.02734042e-07
 2.86683047e-07  1.48682079e-06  3.70775547e-06  5.93663663e-06  7.19793661e-06  6.19690672e-06
 3.39784515e-06  1.59841875e-05  3.59139231e-05  5.12359838e-05  5.38025379e-05  4.00508252e-05
 3.16718761e-05  1.33831389e-04  2.67478317e-04  3.34457611e-04  2.97728460e-04  1.84967488e-04
 2.32630438e-04  8.72683653e-04  1.52680033e-03  1.63618405e-03  1.19406905e-03  5.81215427e-04
 1.34989887e-03  4.43184469e-03  6.64754026e-03  5.90952346e-03  3.33395065e-03  1.09737192e-03
 6.20966125e-03  1.75282881e-02  2.19115075e-02  1.53384712e-02  5.88575797e-03  6.33806223e-04
 2.27501225e-02  5.39909601e-02  5.39939068e-02  2.69960091e-02  4.37351549e-03 -2.26394413e-03
 6.68071955e-02  1.29517615e-01  9.71395969e-02  2.69802753e-02 -6.13145716e-03 -5.79949841e-03
 1.58655271e-01  2.41970763e-01  1.20980963e-01 -3.51197491e-06 -1.99760962e-02 -3.93783534e-03
 3.08537573e-01  3.52065325e-01  8.80096629e-02 -4.40066606e-02 -1.98849179e-02  4.54354519e-03
 5.00000000e-01  3.98942262e-01  5.19176817e-15 -6.64863661e-02 -1.25512922e-13  9.84472595e-03
 6.91462457e-01  3.52065325e-01 -8.80096629e-02 -4.40066606e-02  1.98849179e-02  4.54354519e-03
 8.41344714e-01  2.41970763e-01 -1.20980963e-01 -3.51197491e-06  1.99760962e-02 -3.93783534e-03
 9.33192790e-01  1.29517615e-01 -9.71395969e-02  2.69802753e-02  6.13145716e-03 -5.79949841e-03
 9.77249861e-01  5.39909601e-02 -5.39939068e-02  2.69960091e-02 -4.37351549e-03 -2.26394413e-03
 9.93790329e-01  1.75282881e-02 -2.19115075e-02  1.53384712e-02 -5.88575797e-03  6.33806223e-04
 9.98650074e-01  4.43184469e-03 -6.64754026e-03  5.90952346e-03 -3.33395065e-03  1.09737192e-03
 9.99767363e-01  8.72683653e-04 -1.52680033e-03  1.63618405e-03 -1.19406905e-03  5.81215427e-04
 9.99968350e-01  1.33831389e-04 -2.67478317e-04  3.34457611e-04 -2.97728460e-04  1.84967474e-04
 9.99996603e-01  1.59841875e-05 -3.59139231e-05  5.12359838e-05 -5.38025379e-05  4.00508252e-05
 9.99999702e-01  1.48682079e-06 -3.70775547e-06  5.93663663e-06 -7.19793661e-06  6.19690582e-06
 1.00000000e+00  1.07713021e-07 -2.94997847e-07  5.23468486e-07 -7.22113953e-07  7.02735917e-07
"""
# The same at degree 4 (c0..c4) for bfloat16 outputs: one FMA, one vpermt2ps and two table loads
# fewer per vector. Our own fit as above, but reweighted towards minimax relative error (weight
# 1 / Phi), so x Phi stays relatively accurate on the negative side; float32 coefficients rounded
# from c4 down, the lower ones refitted after each. Phi off by 7.4e-7 at most (x >= 0), relative
# 3.4e-4 at most on [-4, -2]; on every 2^-13 the bf16 GELU is within 0.57 bf16 ulp of the exact
# value for x > -4, 1 ulp on (-5.75, -4] (epilogue.py's docstring;
# test_vector_gelu_bf16_output_against_float64); over every float32 there 0.582 and 1.007 ulp
_GELU_PHI4 = """
 1.89538554e-08  1.07236403e-07  3.01291976e-07  5.69862209e-07  6.14319902e-07
 2.86340622e-07  1.48215815e-06  3.76003550e-06  6.35652941e-06  6.31254625e-06
 3.39571193e-06  1.59512219e-05  3.62293758e-05  5.40149267e-05  4.85138189e-05
 3.16625010e-05  1.33666967e-04  2.68825999e-04  3.47567606e-04  2.75335100e-04
 2.32602761e-04  8.72132601e-04  1.53068604e-03  1.67814852e-03  1.12999871e-03
 1.34984998e-03  4.43075132e-03  6.65427232e-03  5.98992873e-03  3.22361989e-03
 6.20963238e-03  1.75276659e-02  2.19155233e-02  1.53847216e-02  5.81980543e-03
 2.27501895e-02  5.39935306e-02  5.39850295e-02  2.68233139e-02  4.51669702e-03
 6.68073595e-02  1.29524291e-01  9.71184745e-02  2.65360754e-02 -5.79137774e-03
 1.58655375e-01  2.41975307e-01  1.20967209e-01 -3.05529480e-04 -1.97545979e-02
 3.08537513e-01  3.52059811e-01  8.80167112e-02 -4.36526015e-02 -1.99977010e-02
 4.99999881e-01  3.98930311e-01  1.53499168e-05 -6.57189935e-02 -2.45524076e-04
 6.91462398e-01  3.52059841e-01 -8.80021527e-02 -4.36529815e-02  1.97645929e-02
 8.41344714e-01  2.41975576e-01 -1.20981239e-01 -3.11230659e-04  1.99804604e-02
 9.33192849e-01  1.29524708e-01 -9.71418247e-02  2.65270732e-02  6.16708398e-03
 9.77249861e-01  5.39937206e-02 -5.39954603e-02  2.68192627e-02 -4.34865803e-03
 9.93790329e-01  1.75275225e-02 -2.19119787e-02  1.53878424e-02 -5.87820075e-03
 9.98650074e-01  4.43050545e-03 -6.64742570e-03  5.99524425e-03 -3.33578116e-03
 9.99767363e-01  8.71974393e-04 -1.52662396e-03  1.68158766e-03 -1.19688886e-03
 9.99968350e-01  1.33605688e-04 -2.67397059e-04  3.48906644e-04 -2.99028325e-04
 9.99996603e-01  1.59353240e-05 -3.58917641e-05  5.43645001e-05 -5.41569971e-05
 9.99999702e-01  1.47926141e-06 -3.70368957e-06  6.42067562e-06 -7.26297503e-06
 1.00000000e+00  1.06855921e-07 -2.94469118e-07  5.78355866e-07 -7.30571287e-07
"""
_GELU_PHI_K = 11


def _gelu_phi_lanes(table: str) -> list[list[str]]:
    """A ``_GELU_PHI`` table as one table of 32 lanes per coefficient: lane ``k % 32`` holds
    interval ``k``'s coefficient (``k`` in [-12, 12]; -12 and 12 are the constants 0 and 1; lanes
    13..19 are unused zeros)."""
    rows = table.split("\n")[1:-1]
    lanes = [["0.0f"] * 32 for _ in rows[0].split()]
    for i, row in enumerate(rows):
        for j, c in enumerate(row.split()):
            lanes[j][(i - _GELU_PHI_K) % 32] = _c_float(float(c))
    lanes[0][_GELU_PHI_K + 1] = "1.0f"
    return lanes


def _gelu_phi_coef(lanes: list[list[str]], j: int) -> str:
    """Coefficient ``j`` of every lane's interval: one ``vpermt2ps`` of two 16-lane constants."""
    lo, hi = (", ".join(lanes[j][h * 16 : h * 16 + 16]) for h in (0, 1))
    return f"_mm512_permutex2var_ps(_mm512_setr_ps({lo}), k, _mm512_setr_ps({hi}))"


def _gelu_piecewise(table: str) -> str:
    """``tp_vgelu`` by one interval table (its degree: the number of columns less one)."""
    lanes = _gelu_phi_lanes(table)
    deg = len(lanes) - 1
    horner = [
        f"    VEC p = VFMA({_gelu_phi_coef(lanes, deg)}, r, {_gelu_phi_coef(lanes, deg - 1)});"
    ]
    horner += [f"    p = VFMA(p, r, {_gelu_phi_coef(lanes, j)});" for j in range(deg - 2, -1, -1)]
    return _GELU_PIECEWISE_HEAD + "\n".join(horner) + "\n    return VMUL(x, p);\n}\n"


_GELU_PIECEWISE_HEAD = r"""
/* GELU(x) = x Phi(x), Phi(x) = 1/2 (1 + erf(x / sqrt2)) piecewise: a degree-5 polynomial (degree
   4 for bf16 outputs) per interval of width 1/2 (k/2 +- 1/4, k = -11..11) in r = c - k/2, its
   coefficients picked per lane by k from two registers (vpermt2ps: 32 lanes). 15 vector
   instructions, 6 of them on the FMA pipes (the rational erf: 19, 13 and a division), plus the
   12 table vectors' loads (degree 4: 13 and 10). c = x clamped
   to +-6 with x's sign (vrangeps, AVX512DQ: the smaller of |x| and 6); k = +-12 are the constants 1
   and 0 (x = -inf or -huge: -inf * 0 = NaN and -huge * 0 = -0, as torch; NaN stays NaN).
   k = round(2c) from the 1.5 * 2^22 shifter's low mantissa bits (vpermt2ps reads 5: negative k
   wrap to lanes 20..31), r = c - round(2c) / 2 exactly (vreduceps, the same rounding). Phi near 0
   comes from the negative side's own small coefficients, so x Phi keeps its relative accuracy
   there (no 1/2 + 1/2 erf cancellation) */
TP_INLINE VEC tp_vgelu(VEC x) {
    VEC c = _mm512_range_ps(x, VSET1(6.0f), 0x02);
    __m512i k = _mm512_castps_si512(VADD(c, VSET1(6291456.0f)));
    VEC r = _mm512_reduce_ps(c, 0x18);
"""
_GELU_PIECEWISE = _gelu_piecewise(_GELU_PHI)
_GELU_PIECEWISE4 = _gelu_piecewise(_GELU_PHI4)

_VECTOR_MATH = (
    r"""
/* exp(-x) for x clamped to [-89, 87]: 2^n 2^f with n = round(-x log2e) by the 1.5 * 2^23 shifter
   (t's low mantissa bits are n; m = -n exactly), f = -x log2e - n in [-1/2, 1/2] by one FMA (the
   float log2e's error adds |x| 1.3e-8 relative), 2 * 2^f = 2 + f 2E(f) (degree 5, evaluated in
   pairs: a shorter dependency chain than Horner's; every coefficient doubled, which is exact) times
   2^(n-1) from its exponent bits. At n = 128 (x in [-88.72, -88.38]) exp(-x) is a finite float
   that 2^128 = inf made inf (SiLU gave -0 there, torch ~-3e-37); now the product overflows to inf
   exactly where exp(-x) does. n = -126 (x >= 87.0) gives 0 for exp(-x) < 2^-125.5: 1 + it is 1
   either way. The same instructions as with 2^n */
TP_INLINE VEC tp_vexpm(VEC x) {
    x = VMIN(VMAX(x, VSET1(-89.0f)), VSET1(87.0f));
    VEC t = VFMA(x, VSET1(-1.44269504088896341f), VSET1(12582912.0f));
    VEC m = VSUB(VSET1(12582912.0f), t);
    VEC f = VFMA(x, VSET1(-1.44269504088896341f), m);
    VEC f2 = VMUL(f, f);
    VEC p = VFMA(VFMA(VSET1(${e4}), f, VSET1(${e3})), VMUL(f2, f2),
        VFMA(VFMA(VSET1(${e2}), f, VSET1(${e1})), f2, VFMA(VSET1(${e0}), f, VSET1(2.0f))));
    return VMUL(p, VPOW2BITS(t));
}
/* x * sigmoid(y) = x / (1 + exp(-y)) (a true division: measured faster here than an estimate
   plus a Newton step, 0.32 vs 0.37 ns per SiLU). y -> -inf: x / inf, so -0 for finite x and NaN
   for x = -inf, as torch */
TP_INLINE VEC tp_vxsigmoid(VEC x, VEC y) {
    return VDIV(x, VADD(VSET1(1.0f), tp_vexpm(y)));
}
/* tanh-GELU(x) = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) */
TP_INLINE VEC tp_vgelu_tanh(VEC x) {
    VEC y = VMUL(x, VFMA(VMUL(x, x), VSET1(0.0713548162726008f), VSET1(1.5957691216057308f)));
    return tp_vxsigmoid(x, y);
}
TP_INLINE VEC tp_vsilu(VEC x) { return tp_vxsigmoid(x, x); }
""".replace("${e0}", _twice(_EXP2_E[0]))
    .replace("${e1}", _twice(_EXP2_E[1]))
    .replace("${e2}", _twice(_EXP2_E[2]))
    .replace("${e3}", _twice(_EXP2_E[3]))
    .replace("${e4}", _twice(_EXP2_E[4]))
)

_SCALAR_VMATH = r"""
#define tp_vgelu tp_sgelu
#define tp_vgelu_tanh tp_sgelu_tanh
#define tp_vsilu tp_ssilu
"""


def vocabulary(isa: str, piecewise_gelu: bool = True, otag: str = "f32") -> str:
    """Vector macros plus exp/erf/GELU/SiLU helpers for one ISA level, for outputs of ``otag``.

    ``piecewise_gelu`` (AVX-512 only): ``tp_vgelu`` by the interval tables (fewer instructions per
    vector, but 12 table vectors, 768 bytes (10, 640, for bf16 outputs), loaded wherever it is
    inlined) rather than the
    rational erf (scalar constants). The fp32-accumulating tiles take the rational: their M = 1
    tiles apply the epilogue to 2 vectors per tile, between weight streams that evict the tables
    (``bench gemm_epilogue_ab --m 1 --cfg 6:32:1:0:0:1:1``, bf16, bias+GELU+residual over bare,
    three interleaved pairs of 400 rounds, load 1.2-1.7: rational 1.060-1.088, tables
    1.117-1.159). ``otag`` "bf16": the tables' degree-4 Phi (:data:`_GELU_PHI4`), whose error
    the output's rounding hides unless a fused Add after the GELU cancels most of its value (a
    residual of about -GELU(x): up to 2.1 bf16 ulp, 0.6 at degree 5); float32 outputs keep
    degree 5."""
    head = _VOCAB[isa] + _SCALAR_MATH
    if isa == "scalar":
        return head + _SCALAR_VMATH
    if isa == "avx512" and piecewise_gelu:
        gelu = _GELU_PIECEWISE4 if otag == "bf16" else _GELU_PIECEWISE
    else:
        gelu = _GELU_RATIONAL
    return head + _VECTOR_MATH + gelu


def _eo_pairs(nv: int, vw: int, btag: str) -> int:
    """How many pairs of B vectors a tile's unit-stride K loops read as even/odd columns
    (``VPAIR_bf16``): bf16 weights on AVX2, ``nv // 2`` pairs (vectors 2p and 2p + 1; an odd
    last one widened alone). The accumulators of a pair then hold the even and the odd columns
    of its 16: :func:`_k_loop` puts them in that order before the loop and back after it.
    Measured on a Zen 3 (``bench gemm_eo_ab``: one process, the same config with and without,
    interleaved): two threads, bf16 4096->11008 M=32 4x24 0.919x the time, 6x16 kc256 0.964x;
    1024->4096 M=512 6x16 mc96 0.901-0.975x, mc48 0.961-0.963x, 4x24 mc128 0.879-0.893x; one
    thread M=8 4096->1024 (weights in L3) 0.89-0.92x, with the 64-row prefetch 0.86-0.88x;
    M=8 4096->11008 streamed, two threads, prefetch 64: 0.93-1.05x (noise). The prefetching
    loop then steps one k at a time (a prefetch every :func:`prefetch_group` rows): unrolled
    four k per step, as the widening loop is, GCC spilled two accumulators and the tile ran
    1.09-1.19x slower."""
    return nv // 2 if btag == "bf16" and vw == 8 else 0


def _k_body(
    mr: int, nr: int, nv: int, vw: int, btag: str, a_idx: str, k: str, eo: bool = False
) -> list[str]:
    """One ``k`` row of a tile: ``nv`` vector loads of B (with ``eo``, pairs of them as even/odd
    columns: :func:`_eo_pairs`), ``mr`` broadcasts of A (element ``ar[r][a_idx]`` with ``k``
    substituted), ``mr * nv`` FMAs."""
    idx = a_idx.replace("k", f"({k})" if " " in k else k)
    pairs = _eo_pairs(nv, vw, btag) if eo else 0
    loads = [
        f"            VPAIR_bf16(bk + {2 * q * vw}, b[{2 * q}], b[{2 * q + 1}]);"
        for q in range(pairs)
    ]
    if 2 * pairs < nv:
        loads += [
            f"            #pragma GCC unroll {nv}",
            f"            for (int v = {2 * pairs}; v < {nv}; ++v) b[v] = VLOAD_{btag}(bk + v * {vw});",
        ]
    return [
        "            {",
        f"            const btype_t *bk = bp + ({k}) * {nr};",
        f"            VEC b[{nv}];",
        *loads,
        f"            #pragma GCC unroll {mr}",
        f"            for (int r = 0; r < {mr}; ++r) {{",
        f"                VEC a = VSET1(ar[r][{idx}]);",
        f"                #pragma GCC unroll {nv}",
        f"                for (int v = 0; v < {nv}; ++v) acc[r][v] = VFMA(a, b[v], acc[r][v]);",
        "            }",
        "            }",
    ]


def prefetch_group(nr: int, btag: str) -> tuple[int, int]:
    """``(u, lines)``: the K loop with prefetch steps ``u`` rows of a ``nr``-wide panel at a
    time, ``u * nr`` elements being a whole number (``lines``) of 64-byte lines, and prefetches
    each line once (one prefetch per row touched a 32-byte row's line twice)."""
    row = nr * (4 if btag == "f32" else 2)
    u = 64 // math.gcd(row, 64)
    return u, u * row // 64


def _k_loop(
    mr: int, nr: int, nv: int, vw: int, btag: str, a_idx: str, pf: bool, eo: bool = False
) -> list[str]:
    """The K loop of a tile (rows ``k0 <= k < k1``); ``pf``: prefetch the panel ``pf`` rows
    ahead into L2, once per line (groups of :func:`prefetch_group` rows, then the remaining
    rows without prefetch); ``eo``: B's vector pairs as even/odd columns (:func:`_eo_pairs`),
    the accumulators permuted before and after the loop, which with ``pf`` steps one k at a
    time and prefetches every :func:`prefetch_group` rows (the tail rows too)."""
    pairs = _eo_pairs(nv, vw, btag) if eo else 0
    u, lines = prefetch_group(nr, btag)
    if not pf or pairs:

        def permute(fn: str) -> list[str]:
            """Every row's accumulator pairs through ``fn`` (``tp_to_eo`` / ``tp_from_eo``)."""
            if not pairs:
                return []
            return [
                f"        #pragma GCC unroll {mr}",
                f"        for (int r = 0; r < {mr}; ++r) {{",
                *[
                    f"            {fn}(&acc[r][{2 * q}], &acc[r][{2 * q + 1}]);"
                    for q in range(pairs)
                ],
                "        }",
            ]

        ahead = [
            f"            if (!((k - k0) & {u - 1})) {{",
            f"                const char *pfp = (const char *)(bp + (k + pf) * {nr});",
            *[f"                VPREFETCH_L2(pfp + {64 * c});" for c in range(lines)],
            "            }",
        ]
        return [
            *permute("tp_to_eo"),
            "        for (int64_t k = k0; k < k1; ++k) {",
            *(ahead if pf else []),
            *_k_body(mr, nr, nv, vw, btag, a_idx, "k", eo),
            "        }",
            *permute("tp_from_eo"),
        ]
    out = [
        "        int64_t k = k0;",
        f"        for (; k + {u} <= k1; k += {u}) {{",
        f"            const char *pfp = (const char *)(bp + (k + pf) * {nr});",
        *[f"            VPREFETCH_L2(pfp + {64 * c});" for c in range(lines)],
    ]
    for kk in range(u):
        out += _k_body(mr, nr, nv, vw, btag, a_idx, f"k + {kk}" if kk else "k")
    out += [
        "        }",
        "        for (; k < k1; ++k)",
        *_k_body(mr, nr, nv, vw, btag, a_idx, "k"),
    ]
    return out


def _dp_k_loop(mr: int, nr: int) -> list[str]:
    """The K loop of a ``vdpbf16ps`` tile: one k pair per step (``k0``, ``k1`` even), ``nr / 16``
    loads of the pair-packed panel, one 32-bit broadcast of each row's bf16 pair of ``A``, and
    ``mr * nr / 16`` dot-accumulates into the fp32 accumulators."""
    nv = nr // 16
    return [
        "    (void)sa1; (void)pf;  /* A rows contiguous (pairs in place); no software prefetch */",
        "    for (int64_t k = k0; k < k1; k += 2) {",
        f"        const btype_t *bk = bp + k * {nr};",
        f"        __m512bh b[{nv}];",
        f"        #pragma GCC unroll {nv}",
        f"        for (int v = 0; v < {nv}; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bk + v * 32);",
        f"        #pragma GCC unroll {mr}",
        f"        for (int r = 0; r < {mr}; ++r) {{",
        "            int32_t w; memcpy(&w, ar[r] + k, 4);",
        "            __m512bh a = (__m512bh)_mm512_set1_epi32(w);",
        f"            #pragma GCC unroll {nv}",
        f"            for (int v = 0; v < {nv}; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);",
        "        }",
        "    }",
    ]


def _tile(mr: int, nr: int, vw: int, btag: str, otag: str, dp: bool = False) -> str:
    """One micro-kernel: ``mr`` rows x ``nr`` columns over ``k0 <= k < k1``, accumulators in
    registers. ``mode`` bit 1: start from the fp32 partial sums in ``W`` (else from zero); bit 2:
    apply the epilogue and store to ``C`` (else store the raw sums to ``W``). ``dp``: the
    ``vdpbf16ps`` K loop (:func:`_dp_k_loop`) over bf16 ``A`` and pair-packed ``B``."""
    nv = nr // vw
    kloop: list[str] = []  # the non-dp K loop's function, defined before the tile
    if dp:
        k_loops = _dp_k_loop(mr, nr)
    else:
        # the K loop is its own (not inlined) function, register-allocated apart from the
        # epilogue: inlined, a GELU/SiLU epilogue's live values made GCC keep two of the
        # 4x24 tile's 12 accumulators on the stack through the whole K loop (a load-FMA-store
        # chain per k; measured bf16 M=32 1024->4096, one thread: fused 1.20-1.24x the bare
        # kernel, where the bare library keeps all 12 in registers)
        kloop = [
            f"static __attribute__((noinline)) void kloop_{mr}_{nr}(VEC *accp,"
            " const atype_t *const *arp, const btype_t *bp, int64_t k0, int64_t k1,"
            " int64_t pf, int64_t sa1) {",
            f"    VEC acc[{mr}][{nv}];",
            f"    const atype_t *ar[{mr}];",
            f"    for (int r = 0; r < {mr}; ++r) {{",
            "        ar[r] = arp[r];",
            f"        for (int v = 0; v < {nv}; ++v) acc[r][v] = accp[r * {nv} + v];",
            "    }",
            # one loop per case, so the compiler sees unit-stride A and no prefetch test per k
            # (measured 1.3-1.6x faster than the single general loop for M=8 tiles, one thread)
            "    if (sa1 == 1 && !pf) {  /* rows of A contiguous, no prefetch: the common case */",
            *_k_loop(mr, nr, nv, vw, btag, "k", False, eo=True),
            "    } else if (sa1 == 1) {",
            *_k_loop(mr, nr, nv, vw, btag, "k", True, eo=True),
            "    } else {",
            *_k_loop(mr, nr, nv, vw, btag, "k * sa1", True),
            "    }",
            f"    for (int r = 0; r < {mr}; ++r)",
            f"        for (int v = 0; v < {nv}; ++v) accp[r * {nv} + v] = acc[r][v];",
            "}",
        ]
        k_loops = [f"    kloop_{mr}_{nr}(&acc[0][0], ar, bp, k0, k1, pf, sa1);"]
    lines = [
        *kloop,
        f"static void tile_{mr}_{nr}(const atype_t *A, int64_t sa0, int64_t sa1, const btype_t *bp,",
        "        int64_t k0, int64_t k1, otype_t *C, int64_t ldc, int64_t i, int64_t j,",
        "        int64_t nr, int64_t pf, const void *const *ep, const int64_t *eld, float *W,",
        "        int64_t ldw, int mode) {",
        f"    VEC acc[{mr}][{nv}];",
        f"    const atype_t *ar[{mr}];",
        f"    float tmp[{nr}];",
        f"    for (int r = 0; r < {mr}; ++r) {{",
        "        ar[r] = A + (i + r) * sa0;",
        "        if (!(mode & TP_ACC)) {",
        f"            for (int v = 0; v < {nv}; ++v) acc[r][v] = VZERO();",
        f"        }} else if (nr == {nr}) {{",
        f"            for (int v = 0; v < {nv}; ++v)"
        f" acc[r][v] = VLOAD_f32(W + (i + r) * ldw + j + v * {vw});",
        "        } else {",
        f"            for (int64_t c = 0; c < {nr}; ++c)"
        " tmp[c] = c < nr ? W[(i + r) * ldw + j + c] : 0.0f;",
        f"            for (int v = 0; v < {nv}; ++v) acc[r][v] = VLOAD_f32(tmp + v * {vw});",
        "        }",
        "    }",
        "    if (mode & TP_FIN) {  /* the store's operands and output lines: fetched during K */",
        f"        for (int r = 0; r < {mr}; ++r) {{",
        "            tp_epi_pf(i + r, j, nr, ep, eld);",
        "            VPREFETCH(C + (i + r) * ldc + j); VPREFETCH(C + (i + r) * ldc + j + nr - 1);",
        "        }",
        "    }",
        *k_loops,
        "    if (!(mode & TP_FIN)) {",
        f"        for (int r = 0; r < {mr}; ++r) {{",
        f"            if (nr == {nr}) {{",
        f"                for (int v = 0; v < {nv}; ++v)"
        f" VSTORE_f32(W + (i + r) * ldw + j + v * {vw}, acc[r][v]);",
        "            } else {",
        f"                for (int v = 0; v < {nv}; ++v) VSTORE_f32(tmp + v * {vw}, acc[r][v]);",
        "                for (int64_t c = 0; c < nr; ++c) W[(i + r) * ldw + j + c] = tmp[c];",
        "            }",
        "        }",
        f"    }} else if (nr == {nr}) {{",
        f"        for (int r = 0; r < {mr}; ++r)",
        f"            for (int v = 0; v < {nv}; ++v) {{",
        f"                int64_t jj = j + v * {vw};",
        "                VEC x = tp_epi_v(acc[r][v], i + r, jj, ep, eld);",
        f"                VSTORE_{otag}(C + (i + r) * ldc + jj, x);",
        "            }",
        "    } else {",
        f"        for (int r = 0; r < {mr}; ++r) {{",
        f"            for (int v = 0; v < {nv}; ++v) VSTORE_f32(tmp + v * {vw}, acc[r][v]);",
        "            for (int64_t c = 0; c < nr; ++c)",
        f"                SSTORE_{otag}(C + (i + r) * ldc + j + c,"
        " tp_epi_s(tmp[c], i + r, j + c, ep, eld));",
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(lines)


_COMMON = r"""
#define TP_ACC 1
#define TP_FIN 2
/* C[i, j] = epilogue(sum over s < ks of W[s][i, j]) for r0 <= i < r1, j0 <= j < j1 (the K-split's
   reduction; W rows have stride N, split s starts at W + s * M * N) */
#if TP_DEFER_EPI
/* C[i, j] = epilogue(S[i, j]) for r0 <= i < r1, j0 <= j < j1: S is the raw fp32 sums, C itself
   (in place) for fp32 output, the workspace W (row stride lds) for bf16 output */
static void tp_epi_rows(otype_t *C, int64_t ldc, const float *S, int64_t lds, int64_t r0,
        int64_t r1, int64_t j0, int64_t j1, const void *const *ep, const int64_t *eld) {
    for (int64_t i = r0; i < r1; ++i) {
        otype_t *c = C + i * ldc;
        const float *x = S + i * lds;
        int64_t j = j0;
        for (; j + VWIDTH <= j1; j += VWIDTH)
            VSTORE_OTAG(c + j, tp_epi_v(VLOAD_f32(x + j), i, j, ep, eld));
        for (; j < j1; ++j) SSTORE_OTAG(c + j, tp_epi_s(x[j], i, j, ep, eld));
    }
}
#else
#define tp_epi_rows(C, ldc, S, lds, r0, r1, j0, j1, ep, eld) ((void)0)
#endif
static void tp_reduce_rows(otype_t *C, int64_t ldc, const float *W, int64_t M, int64_t N,
        int64_t ks, int64_t r0, int64_t r1, int64_t j0, int64_t j1, const void *const *ep,
        const int64_t *eld) {
    for (int64_t i = r0; i < r1; ++i) {
        int64_t j = j0;
        for (; j + VWIDTH <= j1; j += VWIDTH) {
            VEC x = VLOAD_f32(W + i * N + j);
            for (int64_t s = 1; s < ks; ++s) x = VADD(x, VLOAD_f32(W + s * M * N + i * N + j));
            VSTORE_OTAG(C + i * ldc + j, tp_epi_v(x, i, j, ep, eld));
        }
        for (; j < j1; ++j) {
            float x = W[i * N + j];
            for (int64_t s = 1; s < ks; ++s) x += W[s * M * N + i * N + j];
            SSTORE_OTAG(C + i * ldc + j, tp_epi_s(x, i, j, ep, eld));
        }
    }
}
"""


def _driver(mr: int, nr: int) -> str:
    def call(k0: str, k1: str, w: str, ldw: str, mode: str, row: str = "i") -> str:
        return (
            f"(A, sa0, sa1, bp, {k0}, {k1}, C, ldc, {row}, j, nr, pf, ep, eld, {w}, {ldw}, {mode})"
        )

    def rows(k0: str, k1: str, w: str, ldw: str, mode: str) -> str:
        return (
            f"                    if (mcur - ir >= {mr}) tile_{mr}_{nr}{call(k0, k1, w, ldw, mode)};\n"
            f"                    else for (int64_t r = 0; r < mcur - ir; ++r)"
            f" tile_1_{nr}{call(k0, k1, w, ldw, mode, 'i + r')};"
        )

    return f"""
/* C[M, N] (row stride ldc) = epilogue(A[M, K] (strides sa0, sa1) @ unpack(Bp)).
   kc in (0, K): K blocks of kc, partial sums in W[M, N] (fp32); ks > 1: K split ks ways across
   threads, partial sums in W[ks][M, N], then one reduction pass applies the epilogue. */
TP_EXPORT int tp_gemm_{mr}x{nr}(otype_t *C, int64_t ldc, const atype_t *A, int64_t sa0, int64_t sa1,
        const btype_t *Bp, int64_t M, int64_t N, int64_t K, int64_t mc, int64_t pf,
        const void *const *ep, const int64_t *eld, int64_t nthreads, int64_t kc, int64_t ks,
        float *W) {{
    if (M <= 0 || N <= 0) return 0;
    if (mc < 1 || kc < 0 || ks < 1) return 1;
    if ((ks > 1 || (kc > 0 && kc < K)) && W == NULL) return 2;
    const int64_t np = (N + {nr} - 1) / {nr};
    int64_t nt = TP_MIN(nthreads, ks > 1 ? ks * np : np);
    if ((double)M * (double)N * (double)K < 65536.0) nt = 1;
    if (ks > 1) {{
        #pragma omp parallel num_threads(nt)
        {{
            int64_t w0, w1, r0, r1;
            tp_chunk(ks * np, omp_get_num_threads(), omp_get_thread_num(), 1, &w0, &w1);
            for (int64_t w = w0; w < w1; ++w) {{
                int64_t s = w / np, jp = w % np;
                int64_t k0 = K * s / ks, k1 = K * (s + 1) / ks;
                float *Ws = W + s * M * N;
                const btype_t *bp = Bp + jp * K * {nr};
                int64_t j = jp * {nr}, nr = TP_MIN({nr}, N - j), mcur = M, ic = 0;
                for (int64_t ir = 0; ir < mcur; ir += {mr}) {{
                    int64_t i = ic + ir;
{rows("k0", "k1", "Ws", "N", "0")}
                }}
            }}
            #pragma omp barrier
            /* by rows when every thread gets one, else by columns (whole vectors): with
               fewer rows than threads (M = 1) one thread did the whole sum and epilogue */
            int64_t j0 = 0, j1 = N, nth = omp_get_num_threads(), th = omp_get_thread_num();
            r0 = 0, r1 = M;
            if (M >= nth) tp_chunk(M, nth, th, 1, &r0, &r1);
            else tp_chunk(N, nth, th, VWIDTH, &j0, &j1);
            tp_reduce_rows(C, ldc, W, M, N, ks, r0, r1, j0, j1, ep, eld);
        }}
        return 0;
    }}
    const int64_t kb = (kc > 0 && kc < K) ? kc : K;
    /* up to TP_TILE_DEFER_MAX_M rows with a transcendental epilogue (whole K per tile): the
       tiles store raw sums and a separate pass over the chunk's columns applies the epilogue.
       The raw sums go to C itself for fp32 output, else to the fp32 workspace W [M, N] */
    const int defer = TP_DEFER_EPI && kb == K && M <= TP_TILE_DEFER_MAX_M
        && (sizeof(otype_t) == sizeof(float) || W != NULL);
    float *const S = sizeof(otype_t) == sizeof(float) ? (float *)(void *)C : W;
    const int64_t lds = sizeof(otype_t) == sizeof(float) ? ldc : N;
    /* panels in contiguous chunks handed out dynamically, TP_CHUNKS_PER_THREAD per thread: a
       thread that starts late or is preempted (a busy or virtualised machine) takes fewer
       chunks instead of the whole call waiting for its fixed half; single panels from
       TP_PANEL_CHUNK_M rows up */
    /* from TP_PANEL_CHUNK_M rows a chunk is one panel and one M block of mc rows (panel-major,
       so the threads work on the same panel's blocks side by side): the threads finish within
       one block of each other rather than one panel over all M rows */
    const int64_t nmb = nt >= 2 && M >= TP_PANEL_CHUNK_M ? (M + mc - 1) / mc : 1;
    const int64_t nch = nt < 2 ? 1
        : M >= TP_PANEL_CHUNK_M ? np * nmb : TP_MIN(np, nt * TP_CHUNKS_PER_THREAD);
    #pragma omp parallel num_threads(nt)
    {{
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t ch = 0; ch < nch; ++ch) {{
        const int64_t pch = ch / nmb, npch = nch / nmb;
        const int64_t p0 = np * pch / npch, p1 = np * (pch + 1) / npch;
        const int64_t ib = (ch % nmb) * mc, ie = nmb > 1 ? TP_MIN(M, ib + mc) : M;
        for (int64_t ic = ib; ic < ie; ic += mc) {{
            int64_t mcur = TP_MIN(mc, M - ic);
            for (int64_t pc = 0; pc < K || pc == 0; pc += kb) {{
                int64_t k1 = TP_MIN(K, pc + kb);
                int mode = (pc > 0 ? TP_ACC : 0) | (k1 >= K ? TP_FIN : 0);
                /* deferred epilogue: tiles store raw sums into C, one pass over the chunk then */
                int tmode = defer ? 0 : mode;
                float *tw = defer ? S : W;
                int64_t tld = defer ? lds : N;
                for (int64_t jp = p0; jp < p1; ++jp) {{
                    const btype_t *bp = Bp + jp * K * {nr};
                    int64_t j = jp * {nr}, nr = TP_MIN({nr}, N - j);
                    for (int64_t ir = 0; ir < mcur; ir += {mr}) {{
                        int64_t i = ic + ir;
{rows("pc", "k1", "tw", "tld", "tmode")}
                    }}
                }}
                if (defer)
                    tp_epi_rows(C, ldc, S, lds, ic, ic + mcur, p0 * {nr},
                        TP_MIN(N, p1 * {nr}), ep, eld);
                if (k1 >= K) break;
            }}
        }}
        }}
    }}
    return 0;
}}
"""


# Work chunks per thread in the N-split drivers (handed out dynamically; see _driver)
CHUNKS_PER_THREAD = 8

# From this M up, the N-split drivers hand out one panel and one M block (``mc`` rows) at a time:
# that is then enough work to amortise the hand-out, and the threads finish within one block of
# each other instead of half a chunk (one whole panel over all M rows before the seventeenth
# session; see mm.candidates) (measured, bf16 M=512 1024->4096, vdpbf16ps 8x48: 1.067x eager vs 1.000x with
# 8 chunks per thread; 4096->11008: 1.062x vs 0.997x)
PANEL_CHUNK_M = 128

# Largest M whose transcendental epilogue runs as a separate pass after the tiles: the small-M
# vdpbf16ps driver (_dp_driver, bf16 output through the launcher's workspace). 0: each tile's
# store applies it, as in the fp32 tiles (TILE_DEFER_MAX_M below). With two threads the pass
# (the chunk's raw sums re-read, the residual read cold, no weight stream while it runs) cost
# more than the store's epilogue, which runs while the K loop's prefetches (32 k-pairs ahead)
# are still in flight. dp8x32, bf16 1024->4096, bias+GELU+residual / bias+SiLU over the bare
# kernel, interleaved, 400 rounds, 10th percentiles of two runs (load 2.6-4.2), deferred (16)
# vs per tile (0): two threads (wall) M=8 1.056, 1.046 / 1.036, 1.035 vs 1.031, 1.038 / 1.011,
# 1.016; M=16 1.171, 1.079 / 1.141, 1.051 vs 1.022, 1.038 / 1.013, 1.021; one thread (thread
# CPU time) within noise, M=8 1.049, 1.050 / 1.039, 1.034 vs 1.051, 1.040 / 1.033, 1.031
# (bare/bare control 0.97-1.02)
DEFER_MAX_M = 0

# The same for the fp32-accumulating tiles' driver (_driver): 0, every epilogue in the tile's
# store. Since the K loop is its own noinline function the per-tile GELU/SiLU no longer stalls
# it, and the deferred pass (raw sums written, re-read, the residual read cold after the chunk)
# cost more: fp32 1024->4096 bias+GELU+residual / bias+SiLU over the bare launch, interleaved
# medians of 300, deferred (16) vs per tile (0): one thread (thread CPU time) M=8 8x8 1.027 /
# 1.028 vs 1.014 / 1.011, 4x24 1.051 / 1.030 vs 1.030 / 1.023, M=16 1.045 / 1.022 vs 1.026 /
# 1.017; two threads (wall) M=8 8x8 1.066 / 1.043 vs 1.036 / 1.000, M=16 1.052 / 1.040 vs
# 1.036 / 1.034; M <= 4 within 1 % either way (bare/bare control 0.98-1.01; load 1.5-4)
TILE_DEFER_MAX_M = 0

# vdpbf16ps register tiles (MR, NR; NR output columns, 16 per zmm) on AVX512-BF16 machines, by the
# M they serve (mm.candidates): "small" (M <= 32) run the weight-streaming pair-dot driver
# (_dp_driver: whole K, every row against each panel); "large" (M > 32) the blocked drivers shared
# with the fp32 tiles (_driver: M and K blocks), 24 of the 32 zmm registers accumulating.
DP_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "small": ((8, 32), (4, 64), (2, 128)),
    "large": ((6, 64), (8, 48), (4, 96)),
}


def _preamble(
    spec: EpilogueSpec, btag: str, otag: str, isa: str, piecewise_gelu: bool
) -> list[str]:
    """Vocabulary, element typedefs, tuning constants and the epilogue functions (``tp_epi_v``,
    ``tp_epi_s``, ``tp_epi_pf``) every GEMM source starts with; ``piecewise_gelu``: the bf16
    pair-dot kernels' (``atype_t`` bf16, GELU by the interval tables)."""
    vec, sca = emit_c(spec)
    vw = VW[isa]
    return [
        vocabulary(isa, piecewise_gelu=piecewise_gelu, otag=otag),
        f"typedef {'uint16_t' if piecewise_gelu else 'float'} atype_t;",
        f"typedef {'float' if btag == 'f32' else 'uint16_t'} btype_t;",
        f"typedef {'float' if otag == 'f32' else 'uint16_t'} otype_t;",
        f"#define VWIDTH {vw}\n#define VSTORE_OTAG VSTORE_{otag}\n#define SSTORE_OTAG SSTORE_{otag}",
        f"#define TP_DEFER_EPI {int(spec.deferrable)}\n#define TP_DEFER_MAX_M {DEFER_MAX_M}",
        f"#define TP_TILE_DEFER_MAX_M {TILE_DEFER_MAX_M}",
        f"#define TP_B_PREFETCH_HINT {B_PREFETCH_HINT}",
        f"#define TP_CHUNKS_PER_THREAD {CHUNKS_PER_THREAD}",
        f"#define TP_PANEL_CHUNK_M {PANEL_CHUNK_M}",
        "TP_INLINE VEC tp_epi_v(VEC v, int64_t i, int64_t j, const void *const *ep,"
        " const int64_t *eld) {\n        (void)i; (void)j; (void)ep; (void)eld;\n        "
        + vec
        + "\n    return v;\n}",
        "TP_INLINE void tp_epi_pf(int64_t i, int64_t j, int64_t nr, const void *const *ep,"
        " const int64_t *eld) {\n        (void)i; (void)j; (void)nr; (void)ep; (void)eld;\n        "
        + emit_prefetch(spec)
        + "\n}",
        "TP_INLINE float tp_epi_s(float s, int64_t i, int64_t j, const void *const *ep,"
        " const int64_t *eld) {\n        (void)i; (void)j; (void)ep; (void)eld;\n        "
        + sca
        + "\n    return s;\n}",
    ]


def render_source(
    spec: EpilogueSpec,
    btag: str,
    otag: str,
    isa: str,
    tiles: tuple[tuple[int, int], ...],
    dp: bool = False,
) -> str:
    """Body (before :func:`torchport.native.render`) with every tile variant in ``tiles``.
    ``dp``: the ``vdpbf16ps`` tiles instead (:data:`DP_TILES`, AVX512-BF16 builds only): ``A``
    bf16 read as k pairs, ``B`` pair-packed ``[ceil(N/NR)][K/2][NR][2]`` (``K`` even), fp32
    accumulators; the large-M tiles with the same drivers, blocking and epilogue as the fp32
    tiles (``tp_gemm_{MR}x{NR}``), the small-M ones with :func:`_dp_driver`."""
    vw = VW[isa]
    if dp and (isa != "avx512" or btag != "bf16"):
        raise ValueError(f"vdpbf16ps tiles need isa avx512 and bf16 B, got {isa} and {btag}")
    parts = _preamble(spec, btag, otag, isa, piecewise_gelu=dp)
    parts.append(_COMMON)
    seen: set[tuple[int, int, bool]] = set()
    for mr, nr in tiles:
        if dp and (mr, nr) in DP_TILES["small"]:  # the small-M driver and its tiles
            parts += [_dp_tile(r, nr) for r in sorted({1, mr}) if (r, nr, True) not in seen]
            seen |= {(1, nr, True), (mr, nr, True)}
            parts.append(_dp_driver(mr, nr))
            continue
        if dp and (mr, nr) not in DP_TILES["large"]:
            raise ValueError(f"no vdpbf16ps tile {mr}x{nr}")
        if nr % vw:
            raise ValueError(f"tile NR={nr} must be a multiple of the vector width {vw} ({isa})")
        for r in sorted({1, mr}):
            if (r, nr, False) not in seen:
                seen.add((r, nr, False))
                parts.append(_tile(r, nr, vw, btag, otag, dp))
        parts.append(_driver(mr, nr))
    if isa == "avx512" and not dp:
        parts.append(DPBF16.replace("SSTORE_bf16((uint16_t *)C", f"SSTORE_{otag}(C"))
    return "\n".join(parts)


# --- small-M bf16 tiles on vdpbf16ps (AVX512-BF16) -----------------------------------------------


def _dp_tile(mr: int, nr: int) -> str:
    """One ``vdpbf16ps`` micro-kernel: ``mr`` rows x ``nr`` columns over all ``kp`` k-pairs.

    ``A`` is bf16 read as 32-bit words (pair ``k`` of row ``r`` at ``A[r * lda + k]``), ``B`` the
    pair-packed panel (``[kp][nr]`` words, each two consecutive ``k`` of one column). Each word of
    ``A`` is broadcast once per pair against ``nr / 16`` panel loads, so a k-pair costs ``mr * nr /
    16`` dot instructions where the widening fp32 tile spends twice the FMAs plus the widening.
    ``raw``: store the fp32 sums to ``S`` (row stride ``lds``; the deferred epilogue pass reads
    them), else apply the epilogue and store to ``C``."""
    nv = nr // 16
    u, lines = prefetch_group(nr, "f32")  # a word per column: the fp32 panel's line geometry

    def body(k: str) -> list[str]:
        return [
            "            {",
            f"            const uint32_t *bk = bp + ({k}) * {nr};",
            f"            __m512bh b[{nv}];",
            f"            #pragma GCC unroll {nv}",
            f"            for (int v = 0; v < {nv}; ++v)"
            " b[v] = (__m512bh)_mm512_loadu_si512(bk + v * 16);",
            f"            #pragma GCC unroll {mr}",
            f"            for (int r = 0; r < {mr}; ++r) {{",
            f"                __m512bh a = (__m512bh)_mm512_set1_epi32((int)ar[r][{k}]);",
            f"                #pragma GCC unroll {nv}",
            f"                for (int v = 0; v < {nv}; ++v)"
            " acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);",
            "            }",
            "            }",
        ]

    pf_loop = [
        "        int64_t k = 0;",
        f"        for (; k + {u} <= kp; k += {u}) {{",
        f"            const char *pfp = (const char *)(bp + (k + pf) * {nr});",
        *[f"            VPREFETCH_L2(pfp + {64 * c});" for c in range(lines)],
        *[ln for kk in range(u) for ln in body(f"k + {kk}" if kk else "k")],
        "        }",
        "        for (; k < kp; ++k)",
        *body("k"),
    ]
    return "\n".join(
        [
            f"static void dtile_{mr}_{nr}(const uint32_t *A, int64_t lda, const uint32_t *bp,",
            "        int64_t kp, otype_t *C, int64_t ldc, int64_t i, int64_t j, int64_t nr,",
            "        int64_t pf, const void *const *ep, const int64_t *eld, float *S, int64_t lds,",
            "        int raw) {",
            f"    __m512 acc[{mr}][{nv}];",
            f"    const uint32_t *ar[{mr}];",
            f"    float tmp[{nr}];",
            f"    for (int r = 0; r < {mr}; ++r) {{",
            "        ar[r] = A + (i + r) * lda;",
            f"        for (int v = 0; v < {nv}; ++v) acc[r][v] = _mm512_setzero_ps();",
            "        if (!raw) {",
            "            tp_epi_pf(i + r, j, nr, ep, eld);",
            "            VPREFETCH(C + (i + r) * ldc + j); VPREFETCH(C + (i + r) * ldc + j + nr - 1);",
            "        }",
            "    }",
            "    if (!pf) {",
            "        for (int64_t k = 0; k < kp; ++k)",
            *body("k"),
            "    } else {",
            *pf_loop,
            "    }",
            f"    for (int r = 0; r < {mr}; ++r) {{",
            f"        if (raw && nr == {nr}) {{",
            f"            for (int v = 0; v < {nv}; ++v)"
            " _mm512_storeu_ps(S + (i + r) * lds + j + v * 16, acc[r][v]);",
            f"        }} else if (nr == {nr}) {{",
            f"            for (int v = 0; v < {nv}; ++v) {{",
            "                int64_t jj = j + v * 16;",
            "                VSTORE_OTAG(C + (i + r) * ldc + jj, tp_epi_v(acc[r][v], i + r, jj, ep, eld));",
            "            }",
            "        } else {",
            f"            for (int v = 0; v < {nv}; ++v) _mm512_storeu_ps(tmp + v * 16, acc[r][v]);",
            "            for (int64_t c = 0; c < nr; ++c) {",
            "                if (raw) S[(i + r) * lds + j + c] = tmp[c];",
            "                else SSTORE_OTAG(C + (i + r) * ldc + j + c,"
            " tp_epi_s(tmp[c], i + r, j + c, ep, eld));",
            "            }",
            "        }",
            "    }",
            "}",
        ]
    )


def _dp_driver(mr: int, nr: int) -> str:
    tile = f"dtile_{mr}_{nr}"
    args = "(A, lda, bp, kp, C, ldc, {row}, j, nr, pf, ep, eld, S, lds, defer)"
    return f"""
/* C[M, N] (row stride ldc) = epilogue(A[M, 2 kp] @ B): A bf16 rows as k-pair words (row stride
   lda words), Bp pair-packed panels [ceil(N/{nr})][kp][{nr}] words. The weight-streaming order
   of the small-M driver above: panels in dynamic chunks, every row against each panel. */
TP_EXPORT int tp_gemm_dp_{mr}x{nr}(otype_t *C, int64_t ldc, const uint32_t *A, int64_t lda,
        const uint32_t *Bp, int64_t M, int64_t N, int64_t kp, int64_t pf,
        const void *const *ep, const int64_t *eld, int64_t nthreads, float *W) {{
    if (M <= 0 || N <= 0) return 0;
    const int64_t np = (N + {nr} - 1) / {nr};
    int64_t nt = TP_MIN(nthreads, np);
    if ((double)M * (double)N * (double)kp < 32768.0) nt = 1;
    const int defer = TP_DEFER_EPI && M <= TP_DEFER_MAX_M
        && (sizeof(otype_t) == sizeof(float) || W != NULL);
    float *const S = sizeof(otype_t) == sizeof(float) ? (float *)(void *)C : W;
    const int64_t lds = sizeof(otype_t) == sizeof(float) ? ldc : N;
    const int64_t nch = nt > 1 ? TP_MIN(np, nt * TP_CHUNKS_PER_THREAD) : 1;
    #pragma omp parallel num_threads(nt)
    {{
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t ch = 0; ch < nch; ++ch) {{
            const int64_t p0 = np * ch / nch, p1 = np * (ch + 1) / nch;
            for (int64_t jp = p0; jp < p1; ++jp) {{
                const uint32_t *bp = Bp + jp * kp * {nr};
                int64_t j = jp * {nr}, nr = TP_MIN({nr}, N - j), i = 0;
                for (; i + {mr} <= M; i += {mr}) {tile}{args.format(row="i")};
                for (; i < M; ++i) dtile_1_{nr}{args.format(row="i")};
            }}
            if (defer)
                tp_epi_rows(C, ldc, S, lds, 0, M, p0 * {nr}, TP_MIN(N, p1 * {nr}), ep, eld);
        }}
    }}
    return 0;
}}
"""


# AVX512-BF16 kernel: B packed as [ceil(N/16)][ceil(K/2)][16][2] bf16 pairs, A as bf16 rows padded to
# an even K. Each k-pair broadcasts one 32-bit word of A; vdpbf16ps accumulates two products per
# lane in fp32. Built on AVX512-BF16 machines (and by the build test); never run on AVX2 ones.
DPBF16 = r"""
#if defined(__AVX512BF16__)
TP_EXPORT int tp_gemm_dpbf16_4x32(otype_t *C, int64_t ldc, const uint16_t *A, int64_t lda,
        const uint16_t *Bp, int64_t M, int64_t N, int64_t K, const void *const *ep,
        const int64_t *eld, int64_t nthreads) {
    const int64_t kp = (K + 1) / 2, np = (N + 31) / 32;
    #pragma omp parallel for num_threads(TP_MIN(nthreads, np)) schedule(static)
    for (int64_t jp = 0; jp < np; ++jp) {
        const uint16_t *bp = Bp + jp * kp * 64;
        int64_t j = jp * 32, nr = TP_MIN(32, N - j);
        for (int64_t i = 0; i < M; i += 4) {
            int64_t mr = TP_MIN(4, M - i);
            __m512 acc[4][2];
            for (int r = 0; r < 4; ++r) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
            for (int64_t k = 0; k < kp; ++k) {
                __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + k * 64);
                __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + k * 64 + 32);
                for (int r = 0; r < mr; ++r) {
                    int32_t w; memcpy(&w, A + (i + r) * lda + 2 * k, 4);
                    __m512bh a = (__m512bh)_mm512_set1_epi32(w);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
                }
            }
            for (int r = 0; r < mr; ++r) {
                float tmp[32];
                _mm512_storeu_ps(tmp, acc[r][0]);
                _mm512_storeu_ps(tmp + 16, acc[r][1]);
                for (int64_t c = 0; c < nr; ++c)
                    SSTORE_bf16((uint16_t *)C + (i + r) * ldc + j + c, tp_epi_s(tmp[c], i + r, j + c, ep, eld));
            }
        }
    }
    return 0;
}
#endif
"""


# --- bf16 on AMX tiles (Intel AMX-BF16: TDPBF16PS) ---------------------------------------------

# Compiler flags of the AMX library (on top of the avx512 level's): the tile intrinsics
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")

# Output block of one AMX step: 2 x 2 tiles of 16 x 16 fp32 (tiles 0-3), two A tiles of 16 rows x
# 32 bf16 (4, 5), two B tiles of 16 k pairs x 16 columns (6, 7): all eight tile registers
AMX_MR, AMX_NR = 32, 32

# Outputs from this size up are written with non-temporal stores (measured two threads, bf16
# M=2048 1024->4096, mc 512, kc 256, best of 7 in a C harness: 2541 / 2749 GFLOP/s against 2113 /
# 2187 with ordinary stores, whose read for ownership doubles the output's memory traffic). From
# 16 MiB until the thirtieth session; at 1 MiB (half a core's L2), interleaved medians of 7 against
# ATen in the same run, GFLOP/s, best mc: M=512 768->3072 (3 MiB out) 2388-2648 against 2076-2292
# with ordinary stores, 2048 768->3072 2489-2552 against 1858-1989, 512 1024->4096 2507-2715
# against 2135-2307; in one process, the two builds interleaved on the same operands (bias, mc
# 256, kc 256), ordinary stores took 1.65x / 1.59x / 1.54x the time; an up and a down projection
# in a row (the second reads the streamed output) lost nothing measurable
AMX_STREAM_MIN_BYTES = 1 << 20
# K pieces: an M block's A beyond this many bytes (mc rows x K bf16) runs in K pieces of at most
# this size, so the piece stays in L2 (2 MiB per core on the AMX Xeons) across panels; the sums of
# AMX_SUM_SLOTS panels are kept between pieces (each thread's workspace: that many 32-column slots
# of mc rows).
AMX_A_PIECE_BYTES = 1 << 20
AMX_SUM_SLOTS = 8

_AMX = r"""
/* Tiles 0-3: the 2 x 2 block of 16 x 16 fp32 sums; 4, 5: A, 16 rows x 32 bf16; 6, 7: B, 16 k
   pairs x 16 columns (every tile 16 rows of 64 bytes) */
static void tp_amx_config(void) {
    tp_tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    TP_TILE_FENCE();
    _tile_loadconfig(&c);
}

/* The k pairs past the last whole tile (kp % 16 of them) for rows [0, nrow) of the block:
   vdpbf16ps on the fp32 sums the tiles stored (acc, 32 x 32, row stride 32) */
static void tp_amx_ktail(float *acc, int nrow, const uint32_t *A, int64_t lda, const uint32_t *bp,
        int64_t k0, int64_t kp) {
    for (int r = 0; r < nrow; ++r) {
        __m512 s0 = _mm512_loadu_ps(acc + r * 32), s1 = _mm512_loadu_ps(acc + r * 32 + 16);
        for (int64_t k = k0; k < kp; ++k) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + k]);
            s0 = _mm512_dpbf16_ps(s0, a, (__m512bh)_mm512_loadu_si512(bp + k * 32));
            s1 = _mm512_dpbf16_ps(s1, a, (__m512bh)_mm512_loadu_si512(bp + k * 32 + 16));
        }
        _mm512_storeu_ps(acc + r * 32, s0);
        _mm512_storeu_ps(acc + r * 32 + 16, s1);
    }
}

/* rows ahead of the epilogue whose operand lines are prefetched */
#define TP_AMX_EPI_AHEAD 8

/* Finished sums (rows of 32 floats: a 32-row block, or with TP_AMX_PANEL_EPI a whole panel of
   the chunk) whose epilogue and store are still due: rows [done, rows), C's rows i + done.. and
   columns j.. j + nr */
typedef struct {
    const float *blk;
    int64_t i, j, nr;
    int rows, done;
} tp_amx_pend_t;

/* Applies the epilogue to rows [p->done, upto) of the pending block and stores them to C, a
   row's 32 outputs from registers (bf16: one 64-byte vector), with non-temporal stores when
   stream and the row's line(s) are aligned (no read for ownership) */
TP_INLINE void tp_amx_store_rows(tp_amx_pend_t *p, int upto, otype_t *C, int64_t ldc, int stream,
        const void *const *ep, const int64_t *eld) {
    const float *blk = p->blk;
    const int64_t i = p->i, j = p->j, nr = p->nr;
    for (int r = p->done; r < upto; ++r) {
        otype_t *c = C + (i + r) * ldc + j;
        if (r + TP_AMX_EPI_AHEAD < p->rows) { /* a later row's sums and operand lines */
            VPREFETCH(blk + (r + TP_AMX_EPI_AHEAD) * 32);
            VPREFETCH(blk + (r + TP_AMX_EPI_AHEAD) * 32 + 16);
            tp_epi_pf(i + r + TP_AMX_EPI_AHEAD, j, nr, ep, eld);
        }
        if (nr == 32) {
            const __m512 lo = tp_epi_v(_mm512_load_ps(blk + r * 32), i + r, j, ep, eld);
            const __m512 hi = tp_epi_v(_mm512_load_ps(blk + r * 32 + 16), i + r, j + 16, ep, eld);
            const int nt = stream && ((uintptr_t)c & 63) == 0;
#if TP_OUT_BF16
            const __m512i line = tp_f32x32_to_bf16_line(lo, hi);
            if (nt)
                _mm512_stream_si512((__m512i *)c, line);
            else
                _mm512_storeu_si512(c, line);
#else
            if (nt) {
                _mm512_stream_ps(c, lo);
                _mm512_stream_ps(c + 16, hi);
            } else {
                _mm512_storeu_ps(c, lo);
                _mm512_storeu_ps(c + 16, hi);
            }
#endif
        } else {
            for (int64_t q = 0; q < nr; ++q)
                SSTORE_OTAG(c + q, tp_epi_s(blk[r * 32 + q], i + r, j + q, ep, eld));
        }
    }
    if (upto > p->done) p->done = upto;
}

/* C[M, N] (row stride ldc) = epilogue(A[M, 2 kp] @ B): A bf16 rows as k-pair words (row stride lda
   words), Bp pair-packed panels [ceil(N/32)][kp][32] words (pack_b_pairs with nr 32, the layout of
   AMX's B tile: a tile row is a k pair of 16 columns, 64 bytes, rows 128 bytes apart).
   First the threads copy A's whole k tiles into W as [ceil(M/16)][kp/16][16 rows][16 words]
   (rows past M zero), so every A tile is one contiguous kilobyte. Then work chunks are handed
   out dynamically: an M block of mc rows and a run of panels. For each panel a chunk takes K
   blocks of kc (outer) and its 32-row blocks (inner; 16 rows for the last odd one), the sums
   carried between K blocks in an fp32 buffer (two halves, alternate panels; with K pieces, below,
   a slot per panel of a sub-run). A block finished by its last K block gets the K tail
   (kp % 16 pairs, vdpbf16ps from A itself) and becomes pending: its epilogue and its one store
   of C run a few rows per k step of the next block's K loop (the last one at the chunk's end);
   with TP_AMX_PANEL_EPI (epilogues with a transcendental or a residual) a finished panel
   becomes pending instead, its rows spread evenly over all of the chunk's next panel's k steps.
   S holds the threads' sums: nthreads x (mc rounded up to 32) x 32 x TP_AMX_SUM_SLOTS floats,
   64-byte aligned
   (the caller's workspace: an allocation here of 128 KB per thread went to mmap, so every
   call paid its page faults and the unmap).
   Returns -1 when the OS refuses AMX (nothing written), 0 when done. */
TP_EXPORT int tp_gemm_amx_32x32(otype_t *C, int64_t ldc, const uint32_t *A, int64_t lda,
        const uint32_t *Bp, int64_t M, int64_t N, int64_t kp, int64_t mc, int64_t kc,
        int64_t pf, const void *const *ep, const int64_t *eld, int64_t nthreads, uint32_t *W,
        float *S) {
    if (M <= 0 || N <= 0) return 0;
    if (!tp_amx_permit()) return -1;
    mc = TP_MAX(32, (mc + 31) / 32 * 32);
    const int64_t np = (N + 31) / 32, nmb = (M + mc - 1) / mc, kt = kp / 16;
    const int64_t mb16 = (M + 15) / 16;
    const int64_t kcb = kc > 0 ? TP_MAX(1, kc / 32) : TP_MAX(1, kt);
    int64_t nt = TP_MIN(nthreads, np * nmb);
    if ((double)M * (double)N * (double)kp < 65536.0) nt = 1;
    /* a chunk is an M block and a run of panels (TP_CHUNKS_PER_THREAD runs per thread and M
       block), so the B prefetches below run on into the chunk's next panel */
    const int64_t npc = nt > 1 ? TP_MIN(np, nt * TP_CHUNKS_PER_THREAD) : 1;
    const int64_t nch = npc * nmb;
    const int64_t pfb = pf * 2048; /* bytes of the panel stream ahead (pf k steps of 2 KB) */
    /* an output larger than TP_AMX_STREAM_MIN_BYTES is written with non-temporal stores (whole
       64-byte lines, no read for ownership): it would not stay in L2 anyway */
    const int stream = (double)M * (double)N * sizeof(otype_t) >= (double)TP_AMX_STREAM_MIN_BYTES;
    /* K pieces: where an M block's A (mc rows x kt tiles of 64 bytes per row) exceeds
       TP_AMX_A_PIECE_BYTES, it no longer stays in L2 from one panel to the next and every panel
       reads it again from L3. A chunk then runs its panels in sub-runs of TP_AMX_SUM_SLOTS, each
       sub-run K piece by K piece (kpc tiles, whole K blocks), the sums of every panel of the
       sub-run in their own slot between pieces: a piece's A stays in L2 across the sub-run's
       panels. */
    int64_t kpc = TP_MAX(1, kt);
    const int64_t mrows = TP_MIN(mc, (M + 31) / 32 * 32); /* (an M block's rows at most) */
    if (kt > kcb && (double)mrows * 64.0 * (double)kt > (double)TP_AMX_A_PIECE_BYTES)
        kpc = TP_MAX(kcb, (int64_t)(TP_AMX_A_PIECE_BYTES / ((size_t)mrows * 64)) / kcb * kcb);
    const int64_t nq = (TP_MAX(1, kt) + kpc - 1) / kpc;
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < mb16 * kt; ++t) {
            const int64_t ib = t / kt, kk = t % kt;
            uint32_t *dst = W + t * 256;
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t row = ib * 16 + r;
                if (row < M)
                    _mm512_storeu_si512(dst + r * 16, _mm512_loadu_si512(A + row * lda + kk * 16));
                else
                    _mm512_storeu_si512(dst + r * 16, _mm512_setzero_si512());
            }
        }
        /* the fp32 sums, one 32 x 32 block (row stride 32) per 32 rows of the chunk, in two
           halves used by alternate panels (a block whose epilogue is pending stays intact while
           the next panel's blocks fill the other half), or with K pieces in a slot per panel of
           the sub-run (the last sub-run's last panel, pending, stays intact while the next
           sub-run's first panel fills slot 0) */
        float *const acc = S + (size_t)omp_get_thread_num() * (size_t)mc * 32 * TP_AMX_SUM_SLOTS;
        int configured = 0;
        tp_amx_pend_t pend = {0, 0, 0, 0, 0, 0};
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t ch = 0; ch < nch; ++ch) {
            const int64_t i0 = (ch / npc) * mc, i1 = TP_MIN(M, i0 + mc), pc = ch % npc;
            if (!configured) {
                tp_amx_config();
                configured = 1;
            }
            TP_TILE_FENCE(); /* W's copy (the omp for's barrier is a call too) */
            const int64_t jbeg = np * pc / npc, jend = np * (pc + 1) / npc;
            const int64_t nsub = nq > 1 ? TP_AMX_SUM_SLOTS : jend - jbeg;
            for (int64_t sub = jbeg; sub < jend; sub += nsub) {
            const int64_t send = TP_MIN(jend, sub + nsub);
            for (int64_t q = 0; q < nq; ++q) {
            const int64_t kq0 = q * kpc, kq1 = TP_MIN(kt, kq0 + kpc);
            for (int64_t jp = sub; jp < send; ++jp) {
            const int64_t j = jp * 32, nr = TP_MIN(32, N - j), nb = (i1 - i0 + 31) / 32;
            const uint32_t *bp = Bp + jp * kp * 32;
            /* two halves for alternate panels, or a slot per panel of the sub-run (K pieces) */
            float *const half = acc + (nq > 1 ? jp - sub : (jp & 1)) * mc * 32;
            TP_TILE_FENCE(); /* (the pending sums read before this panel's tiles store into them) */
            /* K blocks of kcb tiles (one empty block when K has no whole tile: zero sums, then the
               K tail alone): the panel's kcb x 16 k pairs (2 kcb KB) stay in L1 while every
               32-row block of the chunk uses them; the sums go through acc between blocks. The
               pending epilogue runs a few rows per k step: vector work beside the tile unit's,
               which slows the tiles less the thinner it is spread. A block's over the next
               block's steps of the last K block (a third of the time at K = 768, K blocks of
               256); a heavy epilogue's (TP_AMX_PANEL_EPI) a whole panel's over all of the next
               panel's steps, the same rows per step from the first K block to the last
               (in-process A/B, bench gemm_amx_ab-style, bf16, M=512 768->3072, 512 1024->4096,
               2048 768->3072: block spreading took 1.068-1.111x the time for bias + GELU +
               residual, 1.008-1.041x for bias + SiLU; for no epilogue or a bias, panel
               spreading took 0.986-1.036x, 5 of 6 slower: its pending sums come from L2) */
#if TP_AMX_PANEL_EPI
            const int64_t psteps = nb * TP_MAX(1, kq1 - kq0); /* this panel's k steps (this piece) */
            const int per = pend.done < pend.rows
                ? (int)((pend.rows - pend.done + psteps - 1) / psteps) : 0;
#endif
            for (int64_t k0 = kq0; k0 == kq0 || k0 < kq1; k0 += kcb) {
                const int64_t k1 = TP_MIN(kq1, k0 + kcb), steps = TP_MAX(1, k1 - k0);
                /* the next K block's slice of B (this panel's, or the chunk's next panel's
                   first), a few lines per k step over this K block's row blocks, so the first
                   row block of the next K block finds it in L1 (a C harness of this loop, one
                   thread, random bf16, 16 row blocks of 8 k steps, B from L3: 1.38-1.51 ->
                   1.52-1.67 TFLOP/s, three runs each; in the whole kernel, in-process, bias,
                   M=512 and 2048 768->3072, 512 1024->4096, 2048 4096->1024: 0.990-1.029x the
                   time without it, within the noise) */
                const char *nx = NULL;
                int64_t nxl = 0, nxq = 0;
                if (kcb >= kt) {
                    /* (whole K in one block, the weight-streaming path: the next slice would be a
                       whole panel, into L1: in-process, bias, M=32 1024->4096 1.10x and M=8
                       4096->11008 1.03x the time with it) */
                } else if (k1 < kq1) {
                    nx = (const char *)(bp + k1 * 512);
                    nxl = (TP_MIN(kq1, k1 + kcb) - k1) * 32;
                } else if (jp + 1 < send) { /* (the next panel's first block of this piece) */
                    nx = (const char *)(Bp + (jp + 1) * kp * 32 + kq0 * 512);
                    nxl = (TP_MIN(kq1, kq0 + kcb) - kq0) * 32;
                } else if (q + 1 < nq) { /* (the sub-run's first panel, the next piece) */
                    nx = (const char *)(Bp + sub * kp * 32 + kq1 * 512);
                    nxl = (TP_MIN(kt, kq1 + kcb) - kq1) * 32;
                } else if (send < jend) { /* (the next sub-run's first panel, the first piece) */
                    nx = (const char *)(Bp + send * kp * 32);
                    nxl = TP_MIN(kt, kcb) * 32;
                }
                const int64_t nxper = (nxl + nb * steps - 1) / (nb * steps);
                for (int64_t b = 0; b < nb; ++b) {
                    const int64_t i = i0 + 32 * b;
                    const int two = i + 16 < i1;
                    const uint32_t *w0 = W + (i / 16) * kt * 256, *w1 = w0 + kt * 256;
                    float *blk = half + b * 1024;
#if !TP_AMX_PANEL_EPI
                    const int per = pend.done < pend.rows
                        ? (int)((pend.rows - pend.done + steps - 1) / steps) : 0;
                    if (k1 == kt) /* the epilogue's operand lines, in flight during the last K block */
                        for (int64_t r = i; r < TP_MIN(i + 32, i1); ++r) tp_epi_pf(r, j, nr, ep, eld);
#endif
                    if (k0 == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                    } else {
                        TP_TILE_FENCE();
                        _tile_loadd(0, blk, 128);
                        _tile_loadd(1, blk + 16, 128);
                    }
                    if (two) {
                        if (k0 == 0) {
                            _tile_zero(2);
                            _tile_zero(3);
                        } else {
                            _tile_loadd(2, blk + 512, 128);
                            _tile_loadd(3, blk + 528, 128);
                        }
                    }
                    for (int64_t kk = k0; kk < k1; ++kk) {
                        const uint32_t *bk = bp + kk * 16 * 32;
                        for (int64_t e = 0; e < nxper && nxq < nxl; ++e, ++nxq) VPREFETCH(nx + 64 * nxq);
                        if (pfb) {
                            const char *q = (const char *)bk + pfb;
                            for (int l = 0; l < 32; ++l) VPREFETCH_L2(q + 64 * l);
                        }
                        _tile_loadd(4, w0 + kk * 256, 64);
                        _tile_loadd(6, bk, 128);
                        _tile_loadd(7, bk + 16, 128);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (two) { /* (the same every k step: predicted) */
                            _tile_loadd(5, w1 + kk * 256, 64);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                        if (per)
                            tp_amx_store_rows(&pend, TP_MIN(pend.rows, pend.done + per), C, ldc,
                                stream, ep, eld);
                    }
                    if (two) {
                        _tile_stored(2, blk + 512, 128);
                        _tile_stored(3, blk + 528, 128);
                    }
                    _tile_stored(0, blk, 128);
                    _tile_stored(1, blk + 16, 128);
                    if (k1 == kt) { /* the block is complete: its K tail */
                        const int nrow = (int)TP_MIN(32, i1 - i);
                        TP_TILE_FENCE(); /* (the tile stores before C code reads the sums) */
                        if (kt * 16 < kp) tp_amx_ktail(blk, nrow, A + i * lda, lda, bp, kt * 16, kp);
#if !TP_AMX_PANEL_EPI /* and its epilogue the next pending */
                        tp_amx_store_rows(&pend, pend.rows, C, ldc, stream, ep, eld);
                        pend = (tp_amx_pend_t){blk, i, j, nr, nrow, 0};
#endif
                    }
                }
            }
#if TP_AMX_PANEL_EPI /* the panel is complete: the previous one's last rows out, this one pending */
            if (q == nq - 1) {
                tp_amx_store_rows(&pend, pend.rows, C, ldc, stream, ep, eld);
                pend = (tp_amx_pend_t){half, i0, j, nr, (int)(i1 - i0), 0};
                for (int64_t r = i0; r < TP_MIN(i1, i0 + TP_AMX_EPI_AHEAD); ++r) tp_epi_pf(r, j, nr, ep, eld);
            }
#endif
            }
            }
            }
            tp_amx_store_rows(&pend, pend.rows, C, ldc, stream, ep, eld);
        }
        if (configured) _tile_release();
        if (stream) _mm_sfence(); /* the streamed lines ordered before the region's barrier */
    }
    return 0;
}
"""


def render_amx_source(spec: EpilogueSpec, otag: str) -> str:
    """Body of the AMX-BF16 library (compiled with :data:`AMX_FLAGS` at the avx512 level):
    ``tp_gemm_amx_32x32`` for this epilogue and output dtype, and ``tp_amx_available``."""
    parts = _preamble(spec, "bf16", otag, "avx512", piecewise_gelu=True)
    parts.append(f"#define TP_AMX_STREAM_MIN_BYTES {AMX_STREAM_MIN_BYTES}")
    parts.append(f"#define TP_AMX_A_PIECE_BYTES {AMX_A_PIECE_BYTES}")
    parts.append(f"#define TP_AMX_SUM_SLOTS {AMX_SUM_SLOTS}")
    parts.append(f"#define TP_OUT_BF16 {int(otag == 'bf16')}")
    heavy = any(op.kind in (*TRANSCENDENTAL_KINDS, "add") for op in spec.ops)
    parts.append(f"#define TP_AMX_PANEL_EPI {int(heavy)}")
    return "\n".join([*parts, AMX_TILE_C + _AMX])
