"""Native decode GEMV: ``out[b, n] = sum_k x[b, k] * W[n, k]`` for few activation rows.

Weights stay in their storage format and are decoded in registers, 32 elements at a time, then
FMA'd with float32 activations (float32 accumulation):

- ``f32``/``bf16``: load (bf16 widens by a 16-bit shift);
- ``fp8_e4m3``/``fp8_e5m2``: bytes widen to 16 bits and are re-biased into IEEE half bit patterns
  (E5M2 is the top byte of a half; E4M3 becomes ``value * 2**-8`` exactly), then F16C converts; the
  ``2**8`` and the per-row scale multiply the row sum once;
- ``nvfp4``/``mxfp4``: nibbles are split with shifts and masks, and a 16-entry ``pshufb`` table maps
  each E2M1 code to the high byte of its IEEE half (the low byte is always 0), F16C converts, and
  the block scale (E4M3 × per-tensor scale, or E8M0) multiplies the decoded weights;
- ``mxfp8_e4m3``/``mxfp8_e5m2``: FP8 elements as above with an E8M0 scale per 32-element block.

Decoded weights equal the reference dequantization bit for bit; only the summation order differs
from :func:`torchport.gemv.gemv_reference`, so results agree within float32 rounding
(tolerance stated in the tests: ``|err| ≤ 1e-5 · sum_k |x_k w_k|`` + tiny absolute term).

FP8 weights (``fp8_e4m3``/``fp8_e5m2``) multiply the activations by the codes' values (up to 57344,
E5M2) and apply the row scale to the row sum, so an activation from about 6e33 could overflow
float32 where its product with the dequantized weight (``code * row scale``) does not. Each
activation row is therefore checked once per call (one vectorized max pass): a row whose amax is
finite and outside ``[2⁻⁶⁴, 2⁶⁴)`` is read from a copy scaled by the exact power of two ``2^k``
that brings its amax into ``[2⁶³, 2⁶⁴)``, and ``2^-k`` joins the row scale (the two multiply the
row sum in double, rounded once); rows within the range are read as they are (no copy: the same
bits as before). No product or partial sum overflows then for any finite activation (products
below ``2⁸⁰``); a product loses precision only where it falls below ``2⁻¹²⁶`` in the kernel's
units (an activation below ``2⁻¹⁰⁹`` times the smallest codes in a row read as it is, or below
``2⁻¹⁷³`` of its row's amax in a scaled one), by less than ``2⁻¹⁴⁹`` there: results are within
the tolerance above of the float64 reference for activations of every finite magnitude, and
finite wherever ``F.linear`` on the dequantized weight is. Infinite and NaN activations are read
as they are (IEEE results, as ``F.linear``'s). Cost, one thread, thread CPU time, before → after
interleaved in one process (medians of 41 calls from DRAM, 1001 from L2; load 3-4): E5M2
4096×11008 B=1 4.15 → 4.16 ms, B=4 7.49 → 7.38; 96×4096 B=1 40.0 → 40.2 µs, B=4 71.0 → 70.8;
E4M3 4096×11008 B=1 5.22 → 5.22 ms, B=4 7.78 → 7.92; 96×4096 B=1 70.0 → 70.9 µs, B=4 77.8 → 78.5.
Threads claim ranges of N in turn (about :data:`CHUNK_BYTES` of weights each; ``chunk=0`` builds the
static equal split); activation rows are processed four at a time against one weight row that stays
in L1. From two to eight activation rows whose float32 activations exceed :data:`XBLOCK_BYTES` (8
KB, a quarter of L1, since the twentieth session; two rows at K = 4096 fill L1), eight weight rows
at a time run K in blocks that keep
a block of every activation row in L1, the accumulators parked between blocks (the same FMAs in the
same order: the same bits as K in one piece, except a lone fifth row's, which takes the multi-row
loop's two chains instead of the one-row loop's four), the next eight rows prefetched into L2:
fp32 11008×4096 from DRAM, interleaved medians of 7 (load 1.6–1.8), B=4 one thread 23.8 →
10.2–11.0 ms, two threads 13.8 → 10.0–10.3 ms; B=8 one thread 33.6 → 20.2–21.4 ms. AVX2+FMA+F16C
path; a portable scalar path is used below AVX2.
"""

from __future__ import annotations

import ctypes
import functools
import math
import subprocess
from collections.abc import Sequence

import torch

from torchport import native
from torchport.native import FloatArg, IntArg, Kernel, TensorArg

FORMATS = ("f32", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")

# Weight bytes a GEMV thread claims at a time (0: one static equal split per thread). Threads
# claim row ranges in turn from a shared counter, so a thread that starts late or runs on a busy
# core takes fewer rows instead of holding up the call; measured A/B in bench_gemv_sched.
CHUNK_BYTES = 256 << 10

# The bf16-in, bf16-out entry of the GEMVs whose kernels take float32 activations (appended after
# their ``tp_gemv``; the vdpbf16ps kernel defines its own, reading bf16 activations as they are).
BF16IO_C = r"""
/* tp_gemv for a bf16 model's decode: the activations widened (exactly) into a float32 copy, the
   float32 results rounded as torch's cast rounds them (tp_bf16_as_torch): tp_gemv on x.float()
   followed by .bfloat16(), without the caller's two torch calls. Status 3: no memory. */
TP_EXPORT int tp_gemv_bf16io(const uint16_t *x, int64_t B, int64_t K, const void *w, const uint8_t *scales,
                             const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                             uint16_t *out, int64_t N, int64_t nthreads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(B * K) + 64);
    float *of = (float *)malloc(sizeof(float) * (size_t)(B * N) + 64);
    if (!xf || !of) { free(xf); free(of); return 3; }
    for (int64_t i = 0; i < B * K; ++i) {
        const uint32_t u = (uint32_t)x[i] << 16;
        memcpy(xf + i, &u, 4);
    }
    const int status = tp_gemv(xf, B, K, w, scales, rowscale, pts_d, bias, has_bias, of, N, nthreads);
    if (!status)
        for (int64_t i = 0; i < B * N; ++i) out[i] = tp_bf16_as_torch(of[i]);
    free(xf);
    free(of);
    return status;
}
"""


# Locality hints of the weight-stream prefetch (``_MM_HINT_<hint>``) the lane-block and
# whole-block FP4, the shift-decode FP8 and the ``vdpbf16ps`` kernels accept: ``T0`` (into every
# cache level), ``T1`` (into L2, not L1: the line fill buffers stay free for the loads that hit
# L2) or ``NTA`` (non-temporal: the line is meant to leave the caches without displacing other
# data). The native read peak streamed fastest with NTA on Zen; on the Intel Xeon VM of sessions
# 28-34, T1 2048-3072 bytes ahead streamed the FP4 kernels from DRAM at B=1 1.00-1.38x as fast as
# T0 4096 (three shapes, both kernels) and NTA 2048 at 0.69-0.97x (see
# torchport.gemv.ops.BLOCK_PREFETCH).
PREFETCH_HINTS = ("T0", "NTA", "T1")


def build_amx(src: str, name: str, flags: Sequence[str], unbuildable: list[bool]) -> ctypes.CDLL:
    """Build an AMX GEMV library at the avx512 level with the tile flags ``flags``; a compiler's
    rejection (not a timeout) is recorded in ``unbuildable``, which ends the kernel's candidates
    for the process, and re-raised."""
    try:
        return native.build(src, name=name, isa="avx512", extra_flags=flags)
    except native.CompileError as e:
        if not isinstance(e.__cause__, subprocess.TimeoutExpired):
            unbuildable.append(True)
        raise


def check_hint(hint: str) -> None:
    """Raise ``ValueError`` unless ``hint`` is one of :data:`PREFETCH_HINTS`."""
    if hint not in PREFETCH_HINTS:
        raise ValueError(f"gemv prefetch hint must be one of {PREFETCH_HINTS}, got {hint!r}")


# The status an int8-activation kernel returns for non-finite activations (TP_NONFINITE in SCHED_C)
NONFINITE_STATUS = 5

# Row scheduling shared by every GEMV kernel source (prepended before rendering; no placeholders).
SCHED_C = r"""
/* A result as torch's CPU cast to bf16 writes it: nearest even, and every NaN 0xffff (its
   vectorized conversion's NaN, whatever the length; not c10's scalar 0x7fc0). */
static inline uint16_t tp_bf16_as_torch(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* 1 when any of the n floats is NaN or infinite. The int8-activation kernels (FP4 weights) return
   TP_NONFINITE for such activations, whose quantization would turn them into finite values: the
   caller then runs the float kernel, whose IEEE products give NaN and infinities as torch does. */
#define TP_NONFINITE ${nonfinite}
static inline int tp_any_nonfinite(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        m |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return (int)m;
}
/* One 32-element activation group to int8 for the int8-activation kernels: codes
   round_half_even(x * 127 / amax) into q, returns the group scale amax / 127. A group whose amax
   is below 2^-64 is read times 2^64 (exact), so 127 / amax stays finite (from amax < 3.7e-37 it
   was infinite, and converting the infinite or NaN products to int8 was undefined: the group
   gave 0) and the codes are those an unbounded exponent gives; other groups are unchanged (their
   loop is the one multiply per element it was: the rare case branches per group). Its scale is
   then subnormal from amax < 127 * 2^-126, rounded to a multiple of 2^-149. (amax is never NaN:
   the comparison keeps the previous maximum for a NaN element.) */
static inline float tp_quant32(const float *p, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) { float a = fabsf(p[i]); amax = a > amax ? a : amax; }
    if (amax < 0x1p-64f) {
        const float inv = amax > 0.0f ? 127.0f / (amax * 0x1p64f) : 0.0f;
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)nearbyintf(p[i] * 0x1p64f * inv);
    } else {
        const float inv = 127.0f / amax;
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)nearbyintf(p[i] * inv);
    }
    return amax / 127.0f;
}
/* Rows per claim: about chunk_bytes of weights, a multiple of 8 rows; 0 = static split. */
static inline int64_t tp_chunk_rows(int64_t nt, int64_t row_bytes, int64_t chunk_bytes) {
    if (chunk_bytes <= 0 || nt <= 1) return 0;
    int64_t r = chunk_bytes / (row_bytes > 0 ? row_bytes : 1);
    r = (r + 7) / 8 * 8;
    return r < 8 ? 8 : r;
}
/* The next row range [lo, hi) of this thread: with step 0 its static share once; otherwise
   `step` rows claimed from the shared counter `next` (relaxed atomics: rows are disjoint). */
static inline int tp_claim_rows(int64_t *next, int64_t N, int64_t step, int *state,
                                int64_t *lo, int64_t *hi) {
    if (step <= 0) {
        if (*state) return 0;
        *state = 1;
        tp_chunk(N, omp_get_num_threads(), omp_get_thread_num(), 8, lo, hi);
        return *lo < *hi;
    }
    int64_t s = __atomic_fetch_add(next, step, __ATOMIC_RELAXED);
    if (s >= N) return 0;
    *lo = s;
    *hi = s + step < N ? s + step : N;
    return 1;
}
/* Row claims of the K-block loops, which prefetch the next row group into L2 while one runs: a
   range's last group claims the next range ahead ([nlo, nhi), *ahead = 0 when none is left) and
   prefetches its first rows, which otherwise start from DRAM (one group in six with 256 KiB claims
   at K = 11008); the loop then takes that range (tp_claim_rows_ahead) instead of a new claim. The
   claim is made at the last group, not with the range: a call of two claims would otherwise go to
   one thread. Two threads, weights from DRAM, previous / this build interleaved: 4096x11008 NVFP4
   B=1 0.94 / 0.78 ms, E4M3 vdpbf16ps B=4 1.68 / 1.29, float32 B=4 8.8 / 5.7; 11008x4096 E4M3
   vdpbf16ps B=4 1.52 / 1.41. */
static inline int tp_claim_rows_ahead(int64_t *next, int64_t N, int64_t step, int *state, int64_t *lo,
                                      int64_t *hi, int64_t nlo, int64_t nhi, int *ahead) {
    if (*ahead) {
        *ahead = 0;
        *lo = nlo;
        *hi = nhi;
        return 1;
    }
    return tp_claim_rows(next, N, step, state, lo, hi);
}
/* The row group after [n0, n1) (groups of kr rows) in [lo, hi): its first row, its end in *end;
   at the range's last group the next range's first group, claimed here (see above), and 0 with
   *end = 0 when there is none. */
static inline int64_t tp_next_group(int64_t n1, int64_t hi, int64_t kr, int64_t *next, int64_t N,
                                    int64_t step, int *state, int64_t *nlo, int64_t *nhi, int *ahead,
                                    int64_t *end) {
    if (n1 < hi) {
        *end = n1 + kr < hi ? n1 + kr : hi;
        return n1;
    }
    *ahead = tp_claim_rows(next, N, step, state, nlo, nhi);
    *end = *ahead ? (*nlo + kr < *nhi ? *nlo + kr : *nhi) : 0;
    return *ahead ? *nlo : 0;
}
/* The row groups of kr rows a thread works through, over the ranges it claims, each with the
   group after it ([p0, p1): the next group of the range, or the first of the range claimed
   ahead at a range's last group; p1 = 0 when none) for the caller to prefetch. Start with
   tp_groups_init, then while (tp_groups_next(&g)) { rows [g.n0, g.n0 + g.nr) }. */
typedef struct {
    int64_t *next;
    int64_t N, step, kr, lo, hi, nlo, nhi, n0, nr, p0, p1;
    int st, ahead;
} tp_groups_t;
static inline void tp_groups_init(tp_groups_t *g, int64_t *next, int64_t N, int64_t step, int64_t kr) {
    memset(g, 0, sizeof *g);
    g->next = next;
    g->N = N;
    g->step = step;
    g->kr = kr;
}
static inline int tp_groups_next(tp_groups_t *g) {
    if (g->n0 + g->nr < g->hi) {
        g->n0 += g->nr;
    } else {
        if (!tp_claim_rows_ahead(g->next, g->N, g->step, &g->st, &g->lo, &g->hi, g->nlo, g->nhi, &g->ahead))
            return 0;
        g->n0 = g->lo;
    }
    g->nr = g->hi - g->n0 < g->kr ? g->hi - g->n0 : g->kr;
    g->p0 = tp_next_group(g->n0 + g->nr, g->hi, g->kr, g->next, g->N, g->step, &g->st, &g->nlo, &g->nhi,
                          &g->ahead, &g->p1);
    return 1;
}
""".replace("${nonfinite}", str(NONFINITE_STATUS))


def e4m3_values() -> torch.Tensor:
    """The float32 value of every E4M3 code 0..255 as the decoding kernels' tables have it: torch's,
    the NaN codes 0x7F/0xFF included (quantized data never holds them, but a raw float8 weight
    can, and torch's cast of it gives NaN)."""
    from torchport.lowp.formats import fp8_code_values  # (lowp imports this module)

    return fp8_code_values(torch.float8_e4m3fn)


def _e4m3_table() -> str:
    return ", ".join("NAN" if v != v else f"{v!r}f" for v in e4m3_values().tolist())


def _e8m0_table() -> str:
    """Every E8M0 scale byte's value as a C initializer: ``2**(e - 127)`` as exact hexadecimal
    literals (``e = 0`` is the subnormal ``2**-127``), the NaN code 0xFF as ``NAN``."""
    vals = [math.ldexp(1.0, e - 127) for e in range(255)]
    return ", ".join([f"{v.hex()}f" for v in vals] + ["NAN"])


# The scale and FP8 decode tables and helpers the float and the int8-activation kernels share
# (placed ahead of either source; parameters e4m3_table and e8m0_table)
DECODE_C = r"""
static const float TP_E4M3F[256] = { ${e4m3_table} };
static const float TP_E8M0F[256] = { ${e8m0_table} };
TP_INLINE float tp_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* 2^(e - 127), 0xFF NaN: one load, where the shift and the test for e = 0 were three operations
   and read 0xFF as infinity */
TP_INLINE float tp_e8m0f(uint8_t e) { return TP_E8M0F[e]; }
"""

_SOURCE = r"""
static const float TP_E2M1F[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* E5M2 is the top byte of an IEEE half: exponent 31 is infinity (m = 0) or NaN, as in float32 */
TP_INLINE float tp_e5m2f(uint8_t b) {
    uint32_t e = (b >> 2) & 31u, m = b & 3u;
    float v = e ? tp_f(((e == 31u ? 255u : e + 112u) << 23) | (m << 21)) : (float)m * (1.0f / 65536.0f);
    return (b & 0x80u) ? -v : v;
}

/* ---- per-format: scalar decode of element k of row (for tails / scalar ISA) ---- */
#define FMT_${fmt} 1
#if defined(FMT_f32)
  typedef float W_T;
  #define ROW_BYTES(k) ((k) * 4)
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) { return w[k]; }
#elif defined(FMT_bf16)
  typedef uint16_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) { return tp_bf16_to_f32(w[k]); }
#elif defined(FMT_fp8_e4m3)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) { return TP_E4M3F[w[k]]; }
#elif defined(FMT_fp8_e5m2)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) { return tp_e5m2f(w[k]); }
#elif defined(FMT_nvfp4)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) {
      return TP_E2M1F[(w[k >> 1] >> ((k & 1) * 4)) & 15] * (pts * TP_E4M3F[sc[k >> 4]]);
  }
#elif defined(FMT_mxfp4)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) {
      return TP_E2M1F[(w[k >> 1] >> ((k & 1) * 4)) & 15] * tp_e8m0f(sc[k >> 5]);
  }
#elif defined(FMT_mxfp8_e4m3)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) {
      return TP_E4M3F[w[k]] * tp_e8m0f(sc[k >> 5]);
  }
#elif defined(FMT_mxfp8_e5m2)
  typedef uint8_t W_T;
  TP_INLINE float tp_wel(const W_T *w, const uint8_t *sc, int64_t k, float pts) {
      return tp_e5m2f(w[k]) * tp_e8m0f(sc[k >> 5]);
  }
#endif

#if defined(FMT_nvfp4) || defined(FMT_mxfp4)
  #define ROW_STRIDE(k) ((k) / 2)
#else
  #define ROW_STRIDE(k) (k)
#endif
#if defined(FMT_fp8_e4m3) || defined(FMT_fp8_e5m2)
  #define HAS_ROWSCALE 1
#endif
#if defined(FMT_fp8_e4m3)
  #define ROW_FACTOR 256.0f   /* E4M3 decoded as value * 2^-8 */
#else
  #define ROW_FACTOR 1.0f
#endif

#if defined(__AVX2__)
TP_INLINE float tp_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 16 fp16 high bytes (as 128-bit) -> two fp32 vectors */
TP_INLINE void tp_hb_to_f32(__m128i h, __m256 *a, __m256 *b) {
    const __m128i z = _mm_setzero_si128();
    *a = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, h));
    *b = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, h));
}
/* 16 E4M3 bytes -> two fp32 vectors holding value * 2^-8 */
TP_INLINE void tp_e4m3x16(const uint8_t *p, __m256 *a, __m256 *b) {
    __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1), _mm256_set1_epi16((short)0xBFFF));
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* Decode 32 consecutive weights of row w starting at element k into w4[0..3]. */
TP_INLINE void tp_decode32(const W_T *w, const uint8_t *sc, int64_t k, float pts, __m256 *w4) {
#if defined(FMT_f32)
    for (int j = 0; j < 4; ++j) w4[j] = _mm256_loadu_ps(w + k + 8 * j);
#elif defined(FMT_bf16)
    for (int j = 0; j < 4; ++j) w4[j] = tp_bf16x8_to_f32(w + k + 8 * j);
#elif defined(FMT_fp8_e4m3) || defined(FMT_mxfp8_e4m3)
    tp_e4m3x16(w + k, &w4[0], &w4[1]);
    tp_e4m3x16(w + k + 16, &w4[2], &w4[3]);
  #if defined(FMT_mxfp8_e4m3)
    __m256 s = _mm256_set1_ps(tp_e8m0f(sc[k >> 5]) * 256.0f);
    for (int j = 0; j < 4; ++j) w4[j] = _mm256_mul_ps(w4[j], s);
  #endif
#elif defined(FMT_fp8_e5m2) || defined(FMT_mxfp8_e5m2)
    for (int j = 0; j < 2; ++j) {
        __m128i v = _mm_loadu_si128((const __m128i *)(w + k + 16 * j));
        tp_hb_to_f32(v, &w4[2 * j], &w4[2 * j + 1]);
    }
  #if defined(FMT_mxfp8_e5m2)
    __m256 s = _mm256_set1_ps(tp_e8m0f(sc[k >> 5]));
    for (int j = 0; j < 4; ++j) w4[j] = _mm256_mul_ps(w4[j], s);
  #endif
#else /* nvfp4 / mxfp4: 16 bytes, 32 codes */
    const __m128i lut = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46,
                                      (char)0x80, (char)0xB8, (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)(w + k / 2));
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    __m128i h0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    __m128i h1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
    tp_hb_to_f32(h0, &w4[0], &w4[1]);
    tp_hb_to_f32(h1, &w4[2], &w4[3]);
  #if defined(FMT_nvfp4)
    __m256 s0 = _mm256_set1_ps(pts * TP_E4M3F[sc[k >> 4]]);
    __m256 s1 = _mm256_set1_ps(pts * TP_E4M3F[sc[(k >> 4) + 1]]);
  #else
    __m256 s0 = _mm256_set1_ps(tp_e8m0f(sc[k >> 5])), s1 = s0;
  #endif
    w4[0] = _mm256_mul_ps(w4[0], s0); w4[1] = _mm256_mul_ps(w4[1], s0);
    w4[2] = _mm256_mul_ps(w4[2], s1); w4[3] = _mm256_mul_ps(w4[3], s1);
#endif
}

/* The multi-row loop (NB >= 2) over k0 <= k < k1 (multiples of 32), the accumulators kept in accp
   (NB x 2 vectors) between calls, so a row's sums do not depend on whether K runs in one piece
   (tp_row) or in blocks. At each step prefetches pfa + ROW_STRIDE(k) into L1 (the row's own
   stream ahead) and the lines of pfw (the weight row the next row group reads) into L2, either
   unless NULL. */
TP_INLINE void tp_row_part(const float *x, int64_t ldx, const W_T *w, const char *pfa, const W_T *pfw,
                           const uint8_t *sc, float pts, int64_t k0, int64_t k1, __m256 *accp, const int NB) {
    __m256 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = accp[2 * b]; acc[b][1] = accp[2 * b + 1]; }
    for (int64_t k = k0; k < k1; k += 32) {
        if (pfa) _mm_prefetch(pfa + ROW_STRIDE(k) * sizeof(W_T), _MM_HINT_T0);
        if (pfw)
            for (int64_t o = 0; o < (int64_t)(ROW_STRIDE(32) * sizeof(W_T)); o += 64)
                _mm_prefetch((const char *)(pfw + ROW_STRIDE(k)) + o, _MM_HINT_T1);
        __m256 w4[4];
        tp_decode32(w, sc, k, pts, w4);
        for (int b = 0; b < NB; ++b) {
            const float *xb = x + b * ldx + k;
            acc[b][0] = _mm256_fmadd_ps(w4[0], _mm256_loadu_ps(xb), acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(w4[1], _mm256_loadu_ps(xb + 8), acc[b][1]);
            acc[b][0] = _mm256_fmadd_ps(w4[2], _mm256_loadu_ps(xb + 16), acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(w4[3], _mm256_loadu_ps(xb + 24), acc[b][1]);
        }
    }
    for (int b = 0; b < NB; ++b) { accp[2 * b] = acc[b][0]; accp[2 * b + 1] = acc[b][1]; }
}
/* A row's result from its two accumulators: their sum (times ROW_FACTOR) plus the K % 32 tail from
   k on, element by element, times post (in double: the float32 product s * post, exact there,
   is rounded once, as a float32 multiply rounds it, and a post holding the 2^-k of an FP8
   activation row's prescale (tp_fp8_rows) cannot overflow or underflow before the rounding). */
TP_INLINE float tp_row_end(__m256 a0, __m256 a1, const float *x, int64_t k, int64_t K, const W_T *w,
                           const uint8_t *sc, float pts, double post) {
    float s = tp_hsum(_mm256_add_ps(a0, a1)) * ROW_FACTOR;
    for (int64_t j = k; j < K; ++j) s += tp_wel(w, sc, j, pts) * x[j];
    return (float)((double)s * post);
}

/* One weight row against NB activation rows (NB <= 4); activation row b's result times post fac[b]. */
TP_INLINE void tp_row(const float *x, int64_t ldx, int64_t K, const W_T *w, const uint8_t *sc, float pts,
                      float post, const double *fac, float *out, int64_t ldo, const int NB) {
    __m256 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = _mm256_setzero_ps(); acc[b][1] = _mm256_setzero_ps(); }
    __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t k = 0;
    if (NB > 1) {
        __m256 a[8];
        for (int i = 0; i < 2 * NB; ++i) a[i] = _mm256_setzero_ps();
        k = K / 32 * 32;
        tp_row_part(x, ldx, w, (const char *)w + ${prefetch}, NULL, sc, pts, 0, k, a, NB);
        for (int b = 0; b < NB; ++b) { acc[b][0] = a[2 * b]; acc[b][1] = a[2 * b + 1]; }
    }
    for (; NB == 1 && k + 32 <= K; k += 32) {   /* four independent chains hide FMA latency */
        _mm_prefetch((const char *)(w + ROW_STRIDE(k)) + ${prefetch}, _MM_HINT_T0);
        __m256 w4[4];
        tp_decode32(w, sc, k, pts, w4);
        acc[0][0] = _mm256_fmadd_ps(w4[0], _mm256_loadu_ps(x + k), acc[0][0]);
        acc[0][1] = _mm256_fmadd_ps(w4[1], _mm256_loadu_ps(x + k + 8), acc[0][1]);
        acc1[0] = _mm256_fmadd_ps(w4[2], _mm256_loadu_ps(x + k + 16), acc1[0]);
        acc1[1] = _mm256_fmadd_ps(w4[3], _mm256_loadu_ps(x + k + 24), acc1[1]);
    }
    if (NB == 1) { acc[0][0] = _mm256_add_ps(acc[0][0], acc1[0]); acc[0][1] = _mm256_add_ps(acc[0][1], acc1[1]); }
    for (int b = 0; b < NB; ++b)
        out[b * ldo] = tp_row_end(acc[b][0], acc[b][1], x + b * ldx, k, K, w, sc, pts, (double)post * fac[b]);
}

#define TP_HAVE_KBLOCKS 1
/* K blocks (two to eight activation rows whose 4 B K bytes exceed ${fxblock}): TP_FKR weight rows at
   a time run K in blocks of ${fxblock} / (4 B) activations (a block of every row stays in L1 while
   the rows use it), accumulators parked between blocks, the next TP_FKR rows' lines prefetched
   into L2 as the current ones are read */
#define TP_FKR 8

/* Four weight rows against one activation row: four streams in flight, x loaded once. */
TP_INLINE void tp_rows4(const float *x, int64_t K, const W_T *w, int64_t wstride, const uint8_t *sc,
                        int64_t sstride, float pts, const double *post, float *out) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; ++r) { acc[r][0] = _mm256_setzero_ps(); acc[r][1] = _mm256_setzero_ps(); }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        for (int r = 0; r < 4; ++r) {
            const W_T *wr = w + r * wstride;
            _mm_prefetch((const char *)(wr + ROW_STRIDE(k)) + ${prefetch}, _MM_HINT_T0);
            __m256 w4[4];
            tp_decode32(wr, sc + r * sstride, k, pts, w4);
            acc[r][0] = _mm256_fmadd_ps(w4[0], x0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w4[1], x1, acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(w4[2], x2, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w4[3], x3, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; ++r)
        out[r] = tp_row_end(acc[r][0], acc[r][1], x, k, K, w + r * wstride, sc + r * sstride, pts, post[r]);
}
#define TP_HAVE_ROWS4 1
#else
TP_INLINE void tp_row(const float *x, int64_t ldx, int64_t K, const W_T *w, const uint8_t *sc, float pts,
                      float post, const double *fac, float *out, int64_t ldo, const int NB) {
    for (int b = 0; b < NB; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < K; ++j) s += tp_wel(w, sc, j, pts) * x[b * ldx + j];
        out[b * ldo] = (float)((double)s * ((double)post * fac[b]));
    }
}
#endif

#if defined(HAS_ROWSCALE)
#include <float.h>
/* The largest |x[i]| of n floats (NaNs skipped, infinities kept). */
TP_INLINE float tp_absmax(const float *x, int64_t n) {
    float m = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)   /* four chains: vmaxps latency; a NaN lane keeps the maximum */
        for (int j = 0; j < 4; ++j) v[j] = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 8 * j), abs), v[j]);
    float t[8];
    _mm256_storeu_ps(t, _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    for (int j = 0; j < 8; ++j) m = t[j] > m ? t[j] : m;
#endif
    for (; i < n; ++i) { const float a = fabsf(x[i]); m = a > m ? a : m; }
    return m;
}
/* The activation rows an FP8 GEMV reads. The kernel multiplies the activations by the codes' values
   (E5M2 up to 57344, E4M3 decoded as value * 2^-8) and applies the row scale to the row sum, so a
   product could overflow float32 where x times the dequantized weight (code * row scale) does not
   (E5M2 from |x| ~ 6e33). A row whose amax is finite and outside [2^-64, 2^64) is read scaled by
   the exact power of two 2^k that brings its amax into [2^63, 2^64), and fac[b] = 2^-k joins the
   row scale on its sums; the other rows are read as they are, fac[b] = 1 (the usual case: one max
   pass over the activations, no copy). Returns x, or a copy (in *buf, which the caller frees)
   when some row is scaled; NULL when the copy cannot be allocated. */
static const float *tp_fp8_rows(const float *x, int64_t B, int64_t K, double *fac, float **buf) {
    int need = 0;
    *buf = NULL;
    for (int64_t b = 0; b < B; ++b) {
        const float amax = tp_absmax(x + b * K, K);
        fac[b] = 1.0;
        if (amax > 0.0f && amax <= FLT_MAX && (amax < 0x1p-64f || amax >= 0x1p64f)) {
            int e;
            frexpf(amax, &e);   /* amax = f 2^e, f in [0.5, 1): k = 64 - e in [-64, 212] */
            fac[b] = ldexp(1.0, e - 64);
            need = 1;
        }
    }
    if (!need) return x;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(B * K) + 64);
    if (!xs) return NULL;
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * K;
        float *ob = xs + b * K;
        const int k = -ilogb(fac[b]);
        if (k < 0) {   /* one multiply (2^k is a float): its rounding, if any, is the only one */
            const float s = ldexpf(1.0f, k);
            for (int64_t i = 0; i < K; ++i) ob[i] = xb[i] * s;
        } else {   /* scaling up: both multiplies exact */
            const float s1 = ldexpf(1.0f, k / 2), s2 = ldexpf(1.0f, k - k / 2);
            for (int64_t i = 0; i < K; ++i) ob[i] = xb[i] * s1 * s2;
        }
    }
    *buf = xs;
    return xs;
}
#endif

/* out[b, n] = post_n * sum_k x[b, k] W[n, k] (+ bias[n]); post_n = rowscale[n] for fp8, else 1 */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const W_T *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    const float pts = (float)pts_d;
    const int64_t wstride = ROW_STRIDE(K);
#if defined(FMT_nvfp4)
    const int64_t sstride = K / 16;
#elif defined(FMT_mxfp4) || defined(FMT_mxfp8_e4m3) || defined(FMT_mxfp8_e5m2)
    const int64_t sstride = K / 32;
#else
    const int64_t sstride = 0;
#endif
    /* fac[b]: the factor of activation row b's sums beside the row scale (tp_fp8_rows) */
    double fac8[8], *fac = B <= 8 ? fac8 : (double *)malloc(sizeof(double) * (size_t)B);
    float *xbuf = NULL;
    if (!fac) return 3;
#if defined(HAS_ROWSCALE)
    x = tp_fp8_rows(x, B, K, fac, &xbuf);
    if (!x) {
        if (fac != fac8) free(fac);
        return 3;
    }
#else
    for (int64_t b = 0; b < B; ++b) fac[b] = 1.0;
#endif
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, wstride * (int64_t)sizeof(W_T) + sstride, ${chunk});
    int64_t kb_len = 0;   /* K block (activations per row), 0: K in one piece (see TP_FKR) */
#if defined(TP_HAVE_KBLOCKS)
    const int64_t KF = K / 32 * 32;
    if (${fxblock} > 0 && B >= 2 && B <= 8 && (int64_t)sizeof(float) * B * K > ${fxblock}) {
        kb_len = ${fxblock} / ((int64_t)sizeof(float) * B) / 32 * 32;
        if (kb_len < 32) kb_len = 32;
    }
#endif
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi, nlo = 0, nhi = 0;
        int tp_st_ = 0, ahead = 0;
        while (kb_len ? tp_claim_rows_ahead(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi, nlo, nhi, &ahead)
                      : tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
#if defined(TP_HAVE_KBLOCKS)
        if (kb_len) {
            for (int64_t n0 = lo; n0 < hi; n0 += TP_FKR) {
                const int64_t n1 = n0 + TP_FKR < hi ? n0 + TP_FKR : hi;
                int64_t p1;   /* the next row group [p0, p1), prefetched into L2 while this one runs */
                const int64_t p0 = tp_next_group(n1, hi, TP_FKR, &tp_next_, N, tp_step_, &tp_st_, &nlo, &nhi, &ahead, &p1);
                __m256 accb[TP_FKR * 16];
                for (int64_t i = 0; i < (n1 - n0) * B * 2; ++i) accb[i] = _mm256_setzero_ps();
                for (int64_t kb = 0; kb < KF; kb += kb_len) {
                    const int64_t ke = kb + kb_len < KF ? kb + kb_len : KF;
                    for (int64_t n = n0; n < n1; ++n) {
                        const int64_t pn = p0 + (n - n0);   /* the row to prefetch */
                        const W_T *wr = w + n * wstride, *pfw = pn < p1 ? w + pn * wstride : NULL;
                        const uint8_t *sr = scales ? scales + n * sstride : (const uint8_t *)0;
                        for (int64_t b = 0; b < B; b += 4) {
                            const int64_t nb = B - b < 4 ? B - b : 4;
                            const float *xb = x + b * K;
                            const W_T *pf = b ? NULL : pfw;
                            __m256 *ap = accb + ((n - n0) * B + b) * 2;
                            switch (nb) {
                                case 1: tp_row_part(xb, K, wr, NULL, pf, sr, pts, kb, ke, ap, 1); break;
                                case 2: tp_row_part(xb, K, wr, NULL, pf, sr, pts, kb, ke, ap, 2); break;
                                case 3: tp_row_part(xb, K, wr, NULL, pf, sr, pts, kb, ke, ap, 3); break;
                                default: tp_row_part(xb, K, wr, NULL, pf, sr, pts, kb, ke, ap, 4); break;
                            }
                        }
                    }
                }
                for (int64_t n = n0; n < n1; ++n) {
                    const W_T *wr = w + n * wstride;
                    const uint8_t *sr = scales ? scales + n * sstride : (const uint8_t *)0;
#if defined(HAS_ROWSCALE)
                    const float post = rowscale[n];
#else
                    const float post = 1.0f;
#endif
                    for (int64_t b = 0; b < B; ++b) {
                        const __m256 *ap = accb + ((n - n0) * B + b) * 2;
                        out[b * N + n] = tp_row_end(ap[0], ap[1], x + b * K, KF, K, wr, sr, pts, (double)post * fac[b]);
                        if (has_bias) out[b * N + n] += bias[n];
                    }
                }
            }
            continue;
        }
#endif
        int64_t n = lo;
#if defined(TP_HAVE_ROWS4) && ${rows4}
        if (B == 1) {
            for (; n + 4 <= hi; n += 4) {
                double post4[4];
                for (int r = 0; r < 4; ++r) {
#if defined(HAS_ROWSCALE)
                    post4[r] = (double)rowscale[n + r] * fac[0];
#else
                    post4[r] = 1.0;
#endif
                }
                tp_rows4(x, K, w + n * wstride, wstride, scales ? scales + n * sstride : (const uint8_t *)0,
                         sstride, pts, post4, out + n);
                if (has_bias) for (int r = 0; r < 4; ++r) out[n + r] += bias[n + r];
            }
        }
#endif
        for (; n < hi; ++n) {
            const W_T *wr = w + n * wstride;
            const uint8_t *sr = scales ? scales + n * sstride : (const uint8_t *)0;
#if defined(HAS_ROWSCALE)
            float post = rowscale[n];
#else
            float post = 1.0f;
#endif
            for (int64_t b = 0; b < B; b += 4) {
                int64_t nb = B - b < 4 ? B - b : 4;
                const float *xb = x + b * K;
                float *ob = out + b * N + n;
                switch (nb) {
                    case 1: tp_row(xb, K, K, wr, sr, pts, post, fac + b, ob, N, 1); break;
                    case 2: tp_row(xb, K, K, wr, sr, pts, post, fac + b, ob, N, 2); break;
                    case 3: tp_row(xb, K, K, wr, sr, pts, post, fac + b, ob, N, 3); break;
                    default: tp_row(xb, K, K, wr, sr, pts, post, fac + b, ob, N, 4); break;
                }
            }
            if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
        }
        }
    }
    free(xbuf);
    if (fac != fac8) free(fac);
    return 0;
}
"""

W_DTYPE = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "nvfp4": torch.uint8,
    "mxfp4": torch.uint8,
    "mxfp8_e4m3": torch.uint8,
    "mxfp8_e5m2": torch.uint8,
}
PREFETCH = (0, 256, 512, 1024)

# Activation bytes (all rows) one K block of the float kernel keeps in L1 for two to eight
# activation rows (0: K in one piece; see TP_FKR in the source). 8 KB rather than 16 (twentieth
# session): fp32 weights from DRAM, two threads, interleaved medians of 9-11, two runs (load
# 2.9-3.3): 11008x4096 B=2 7.35/8.25 -> 6.90/7.77 ms, B=4 7.75/9.39 -> 7.50/9.20; 4096x11008 B=2
# 8.78/9.59 -> 7.90/9.14, B=4 10.26/10.62 -> 9.15/9.82 (one thread within noise either way).
XBLOCK_BYTES = 8192


@functools.cache
def gemv_kernel(
    fmt: str,
    isa: str,
    prefetch: int = 512,
    rows4: int | None = None,
    chunk: int = CHUNK_BYTES,
    xblock: int | None = None,
) -> GemvKernel:
    """The compiled GEMV for one weight format (cached per process and on disk).

    ``rows4``: for one activation row, stream four weight rows at once (x loaded once). Default:
    on for f32/bf16 (memory-bound: more streams in flight help), off for the decoding formats
    (compute-bound: the extra register pressure costs more than it saves; measured A/B).
    ``xblock``: bytes of activations (all rows) a K block keeps in L1 for two to eight
    activation rows (AVX2 and up; default :data:`XBLOCK_BYTES`; 0: K in one piece).
    """
    if rows4 is None:
        rows4 = int(fmt in ("f32", "bf16"))
    if fmt not in FORMATS:
        raise ValueError(f"gemv format must be one of {FORMATS}, got {fmt!r}")
    if xblock is not None and xblock < 0:
        raise ValueError(f"gemv xblock must be >= 0 bytes, got {xblock!r}")
    src = native.render(
        SCHED_C + DECODE_C + _SOURCE + BF16IO_C,
        e4m3_table=_e4m3_table(),
        e8m0_table=_e8m0_table(),
        fmt=fmt,
        prefetch=prefetch,
        rows4=rows4,
        chunk=chunk,
        fxblock=XBLOCK_BYTES if xblock is None else xblock,
    )
    name = f"gemv_{fmt}_{isa}_p{prefetch}_r{rows4}_c{chunk}"
    name += "" if xblock is None else f"_x{xblock}"
    return GemvKernel(native.build(src, name=name, isa=isa), fmt)


def gemv_args(fmt: str, io: torch.dtype = torch.float32) -> list:
    """The argument spec of every GEMV kernel's ``tp_gemv`` entry for weight format ``fmt`` (the
    kernels of one format share it; building it compiles nothing). ``io``: the activations' and
    results' dtype (bfloat16: the ``tp_gemv_bf16io`` entry, :class:`GemvKernel`)."""
    f32 = (torch.float32,)
    return [
        TensorArg("x", (io,), ndim=2),
        IntArg("B"),
        IntArg("K"),
        TensorArg("w", (W_DTYPE[fmt],), ndim=2),
        TensorArg("scales", (torch.uint8,), contiguous=True),
        TensorArg("rowscale", f32),
        FloatArg("pts"),
        TensorArg("bias", f32),
        IntArg("has_bias"),
        TensorArg("out", (io,), ndim=2),
        IntArg("N"),
        IntArg("nthreads"),
    ]


class GemvKernel(Kernel):
    """A GEMV library's ``tp_gemv`` entry (float32 activations and results, the
    :func:`gemv_args` contract) with its twin :attr:`bf16io` (``tp_gemv_bf16io``: the same
    arguments with bf16 activations and bf16 results: the bits of ``tp_gemv`` on the widened
    activations, then torch's cast, NaN as 0xffff).

    ``twin_isa``: the kernel may return :data:`NONFINITE_STATUS` without writing ``out`` (the
    int8-activation kernels of FP4 weights when the activations hold a NaN or an infinity, which
    int8 would turn finite; the AMX-BF16 E4M3 build when float32 activations it would split into
    bf16 parts are not finite or reach 2¹¹⁹; either ``vdpbf16ps`` E4M3 build when a finite
    activation reaches 2¹¹⁹); the caller then runs :meth:`float_twin`, the
    format's float kernel built for that ISA. None: the kernel hands no call back."""

    def __init__(self, lib: ctypes.CDLL, fmt: str, twin_isa: str | None = None) -> None:
        super().__init__(lib, "tp_gemv", gemv_args(fmt))
        self.bf16io = Kernel(lib, "tp_gemv_bf16io", gemv_args(fmt, io=torch.bfloat16))
        self.fmt = fmt
        self.twin_isa = twin_isa

    def float_twin(self) -> GemvKernel | None:
        """The float-activation kernel of this kernel's format and :attr:`twin_isa` (built on
        first use) for calls it hands back with :data:`NONFINITE_STATUS`; None where it hands
        none back."""
        return None if self.twin_isa is None else gemv_kernel(self.fmt, self.twin_isa)


# --- FP4 weights × int8-quantized activations (maddubs) ------------------------------------------

_I8_SOURCE = r"""
#include <stdlib.h>
#define FMT_${fmt} 1

/* Activations: per 32-element group g, xs = amax / 127 and xq = round_half_even(x / xs). */
static void tp_quant_x(const float *x, int64_t n, int8_t *xq, float *xs) {
    for (int64_t g = 0; g < n / 32; ++g) xs[g] = tp_quant32(x + g * 32, xq + g * 32);
}

#if defined(__AVX2__)
TP_INLINE float tp_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 FP4 codes (16 bytes) -> 32 signed int8 values 2*e2m1 (in element order) */
TP_INLINE __m256i tp_fp4x32_i8(const uint8_t *p, __m256i lut) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    __m256i c = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    return _mm256_shuffle_epi8(lut, c);
}

/* per-lane weight scale (x0.5 undoes the 2x of the int8 table) for 32-element group g */
TP_INLINE __m256 tp_wscale(const uint8_t *sc, int64_t g, float pts) {
#if defined(FMT_nvfp4)
    return _mm256_set_m128(_mm_set1_ps(0.5f * pts * TP_E4M3F[sc[2 * g + 1]]),
                           _mm_set1_ps(0.5f * pts * TP_E4M3F[sc[2 * g]]));
#else
    return _mm256_set1_ps(0.5f * tp_e8m0f(sc[g]));
#endif
}

TP_INLINE __m256 tp_dot_i8(__m256i aw, __m256i w8, const int8_t *xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w8)), ones));
}

/* Four FP4 weight rows against one int8 activation row. */
TP_INLINE void tp_rows4_i8(const int8_t *xq, const float *xs, int64_t K, const uint8_t *w, int64_t wstride,
                           const uint8_t *sc, int64_t sstride, float pts, float *out) {
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                         0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t G = K / 32;
    for (int64_t g = 0; g < G; ++g) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + g * 32));
        __m256 xsv = _mm256_set1_ps(xs[g]);
        for (int r = 0; r < 4; ++r) {
            const uint8_t *wr = w + r * wstride;
            _mm_prefetch((const char *)(wr + g * 16) + ${prefetch}, _MM_HINT_T0);
            __m256i w8 = tp_fp4x32_i8(wr + g * 16, lut);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w8), _mm256_sign_epi8(xv, w8)), ones);
            __m256 s = _mm256_mul_ps(tp_wscale(sc + r * sstride, g, pts), xsv);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r]);
        }
    }
    for (int r = 0; r < 4; ++r) out[r] = tp_hsum(acc[r]);
}
#define TP_HAVE_ROWS4 1

TP_INLINE void tp_row_i8(const int8_t *xq, const float *xs, int64_t K, const uint8_t *w, const uint8_t *sc,
                         float pts, float *out, int64_t ldo, const int NB) {
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                         0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const int64_t G = K / 32;
    if (NB == 1) {  /* two groups per step, two accumulators: FMA latency overlaps */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 2 <= G; g += 2) {
            _mm_prefetch((const char *)(w + g * 16) + ${prefetch}, _MM_HINT_T0);
            __m256i w0 = tp_fp4x32_i8(w + g * 16, lut), w1 = tp_fp4x32_i8(w + g * 16 + 16, lut);
            __m256 s0 = _mm256_mul_ps(tp_wscale(sc, g, pts), _mm256_set1_ps(xs[g]));
            __m256 s1 = _mm256_mul_ps(tp_wscale(sc, g + 1, pts), _mm256_set1_ps(xs[g + 1]));
            a0 = _mm256_fmadd_ps(tp_dot_i8(_mm256_abs_epi8(w0), w0, xq + g * 32), s0, a0);
            a1 = _mm256_fmadd_ps(tp_dot_i8(_mm256_abs_epi8(w1), w1, xq + g * 32 + 32), s1, a1);
        }
        for (; g < G; ++g) {
            __m256i w0 = tp_fp4x32_i8(w + g * 16, lut);
            __m256 s0 = _mm256_mul_ps(tp_wscale(sc, g, pts), _mm256_set1_ps(xs[g]));
            a0 = _mm256_fmadd_ps(tp_dot_i8(_mm256_abs_epi8(w0), w0, xq + g * 32), s0, a0);
        }
        out[0] = tp_hsum(_mm256_add_ps(a0, a1));
        return;
    }
    __m256 acc[4];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        _mm_prefetch((const char *)(w + g * 16) + ${prefetch}, _MM_HINT_T0);
        __m256i w8 = tp_fp4x32_i8(w + g * 16, lut);
        __m256i aw = _mm256_abs_epi8(w8);
        __m256 ws = tp_wscale(sc, g, pts);
        for (int b = 0; b < NB; ++b) {
            __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(xs[b * G + g]));
            acc[b] = _mm256_fmadd_ps(tp_dot_i8(aw, w8, xq + b * K + g * 32), s, acc[b]);
        }
    }
    for (int b = 0; b < NB; ++b) out[b * ldo] = tp_hsum(acc[b]);
}
#else
static const float TP_E2M1F[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
TP_INLINE void tp_row_i8(const int8_t *xq, const float *xs, int64_t K, const uint8_t *w, const uint8_t *sc,
                         float pts, float *out, int64_t ldo, const int NB) {
    for (int b = 0; b < NB; ++b) {
        float s = 0.0f;
        for (int64_t g = 0; g < K / 32; ++g) {
            for (int h = 0; h < 2; ++h) {
                int32_t acc = 0;
                for (int i = 0; i < 16; ++i) {
                    int64_t k = g * 32 + h * 16 + i;
                    acc += (int32_t)(2.0f * TP_E2M1F[(w[k >> 1] >> ((k & 1) * 4)) & 15]) * xq[b * K + k];
                }
#if defined(FMT_nvfp4)
                float wsc = 0.5f * pts * TP_E4M3F[sc[2 * g + h]];
#else
                float wsc = 0.5f * tp_e8m0f(sc[g]);
#endif
                s += (float)acc * wsc * xs[b * (K / 32) + g];
            }
        }
        out[b * ldo] = s;
    }
}
#endif

/* Same contract as tp_gemv (rowscale unused); K must be a multiple of 32. */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    if (K % 32) return 2;
    if (tp_any_nonfinite(x, B * K)) return TP_NONFINITE;
    const float pts = (float)pts_d;
    const int64_t G = K / 32;
#if defined(FMT_nvfp4)
    const int64_t sstride = K / 16;
#else
    const int64_t sstride = K / 32;
#endif
    int8_t *xq = (int8_t *)malloc((size_t)(B * K) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(B * G) + 64);
    if (!xq || !xs) { free(xq); free(xs); return 3; }
    for (int64_t b = 0; b < B; ++b) tp_quant_x(x + b * K, K, xq + b * K, xs + b * G);
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K / 2 + sstride, ${chunk});
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        int tp_st_ = 0;
        while (tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        int64_t n = lo;
#if defined(TP_HAVE_ROWS4) && ${rows4}
        if (B == 1) {
            for (; n + 4 <= hi; n += 4) {
                tp_rows4_i8(xq, xs, K, w + n * (K / 2), K / 2, scales + n * sstride, sstride, pts, out + n);
                if (has_bias) for (int r = 0; r < 4; ++r) out[n + r] += bias[n + r];
            }
        }
#endif
        for (; n < hi; ++n) {
            const uint8_t *wr = w + n * (K / 2), *sr = scales + n * sstride;
            for (int64_t b = 0; b < B; b += 4) {
                int64_t nb = B - b < 4 ? B - b : 4;
                const int8_t *xb = xq + b * K;
                const float *sb = xs + b * G;
                float *ob = out + b * N + n;
                switch (nb) {
                    case 1: tp_row_i8(xb, sb, K, wr, sr, pts, ob, N, 1); break;
                    case 2: tp_row_i8(xb, sb, K, wr, sr, pts, ob, N, 2); break;
                    case 3: tp_row_i8(xb, sb, K, wr, sr, pts, ob, N, 3); break;
                    default: tp_row_i8(xb, sb, K, wr, sr, pts, ob, N, 4); break;
                }
            }
            if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
        }
        }
    }
    free(xq);
    free(xs);
    return 0;
}
"""

I8_FORMATS = ("nvfp4", "mxfp4")


@functools.cache
def gemv_i8_kernel(
    fmt: str, isa: str, prefetch: int = 512, rows4: int = 0, chunk: int = CHUNK_BYTES
) -> GemvKernel:
    """FP4-weight GEMV with activations quantized to int8 per 32 (``maddubs`` dot products)."""
    if fmt not in I8_FORMATS:
        raise ValueError(f"int8-activation gemv format must be one of {I8_FORMATS}, got {fmt!r}")
    src = native.render(
        SCHED_C + DECODE_C + _I8_SOURCE + BF16IO_C,
        e4m3_table=_e4m3_table(),
        e8m0_table=_e8m0_table(),
        fmt=fmt,
        prefetch=prefetch,
        rows4=rows4,
        chunk=chunk,
    )
    lib = native.build(src, name=f"gemv_i8_{fmt}_{isa}_p{prefetch}_r{rows4}_c{chunk}", isa=isa)
    return GemvKernel(lib, fmt, twin_isa=isa)
