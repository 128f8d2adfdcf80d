"""FP4 (NVFP4/MXFP4) decode GEMV with int8 activations: the lane-block, whole-block, pair-split and
AMX kernels (the last: :func:`gemv_fp4_amx_kernel`, AMX-INT8 tiles, for several activation rows).

**Lane-block kernel** (:func:`gemv_fp4_block_kernel`, K a multiple of 128, tried first). Per
128 weights (64 bytes, one cache line) it loads the line as two 32-byte halves ``n0``/``n1`` and
deinterleaves their dwords with ``vshufps`` (0x88: even dwords, 0xDD: odd ones) into ``A``/``B``:
dword ``d`` of ``A`` and of ``B`` are the two halves of one 16-element block (lane ``d`` ↔ block
``{0,1,4,5,2,3,6,7}[d]``; the activations are reordered to match once per call). Each of the
four nibble vectors (A/B × low/high) maps through the ``vpshufb`` table ``u = 2·e2m1 + 12`` (as
below) and meets its activations in ``vpmaddubsw``; the four int16 results add up in int16 (``|lane| ≤ 8·24·127 =
24384``) before one ``vpmaddwd``, so int32 lane ``d`` holds a whole block's dot product: the
block scale is then one float per lane (NVFP4: 8 E4M3 bytes through one ``vpshufb`` into
half-precision bit patterns and F16C; MX: 4 E8M0 bytes broadcast, ``vpshufb``, shift and
``vpmaxud`` for the ``e = 0`` subnormal), one ``cvt`` + ``mul`` + ``fma`` per 128 weights instead
of per 64. About 28 vector µops per 128 weights (pair-split: about 37); one thread over
L2-resident NVFP4 weights 3.71 → 2.95–3.36 ns per 128 weights (a C harness, load ≈ 3). The
weight stream is prefetched ``prefetch`` bytes ahead (default 4096): a core streams from DRAM
only as fast as it keeps misses in flight.

At ``isa="avx512"`` with VNNI the lane-block kernel works on whole lines: the 64 bytes (two
256-bit loads) are one zmm, the activations per 128-chunk are the even elements then the odd ones,
and two ``vpdpbusd`` (u8 × s8, four products per int32 lane, accumulated onto the lane's
correction ``-12·Σx``) leave int32 lane ``d`` (0…15) holding elements ``8d…8d+7``: an NVFP4
block is two lanes, an MX block four; then one ``cvt`` + ``mul`` + ``fma`` per 128 weights, about
17 vector instructions. Kernel-level A/B in one process (11008×4096, thread CPU time for one
thread, wall for two, medians of 21, load 3-5): L3-resident 2048×4096 one thread NVFP4
1.18 → 0.83 ns per 64 weights, MXFP4 1.16 → 0.76; from DRAM one thread NVFP4 0.85 → 0.72 ms,
MXFP4 1.10 → 0.80 ms; two threads NVFP4 0.54 → 0.52 ms, MXFP4 0.58 → 0.47 ms.
From three activation rows the roles swap: the weights are the signed operand (``2·e2m1``) and
the activations the unsigned one (``q + 128``), so the offset's products depend on the weights
alone and are computed once per chunk for all rows (one ``vpdpbusd`` on the two nibble vectors'
byte sum); a row then carries no correction lanes and four scale floats per chunk instead of
sixteen, and four rows fit L1 (they filled it before). The int32 lanes are the same either way,
so the bits are too. 11008×4096 from DRAM, one thread, interleaved: B=4 NVFP4 3.30–3.88 →
2.23–2.81 ms, MXFP4 2.91–3.81 → 2.39–2.92 ms.
With AVX512-VBMI the nibble lookup is ``vpermb`` on the line (low nibbles) and on the line shifted
right by four (high ones): it reads six index bits and the table repeats every 16 bytes, so the
two masks go. One thread, L3-resident 1024×4096, same process, interleaved medians of 15 (Zen 4,
load 1.6-2.4; six runs over both prefetch settings): NVFP4 3.64-4.25 → 3.50-3.87 ns per 128
weights, MXFP4 3.16-3.42 → 2.94-3.04; from DRAM (11008×4096, two threads) no difference beyond
noise (0.89-0.97 ms either way). A single 512-bit load per line streamed from DRAM slower
(two threads 1.15-1.27 ms against 0.96-1.01, before the copies were visited in random order).
With per-row corrections (one or two activation rows, AVX-512) K runs in blocks where the rows'
prepared activations exceed 20 KB (K > 10240 for one row): the weight stream through L1 evicted a
22 KB row at K = 11008 (4096×11008 B=1 two threads NVFP4 1.14–1.15 → 1.01–1.06 ms, MXFP4
1.18–1.25 → 0.92–0.96; same bits, see ``TP_XMIN``).

**Whole-block kernel** (:func:`gemv_fp4_wblock_kernel`, AVX-512 VNNI, K a multiple of 256): the
lane-block kernel's int32 lanes hold eight elements, so a 16-element NVFP4 block is two lanes and
its scale is applied twice. This kernel takes 256 weights (two lines) at a time and gathers their
even and their odd dwords with two ``vpermt2d``: dword ``j`` of both is a half of block ``j``, four
``vpdpbusd`` (the weights unsigned, ``2·e2m1 + 12``, onto each activation row's correction lane)
leave int32 lane ``j`` holding block ``j``'s whole dot product, and the float work is one ``cvt`` +
``mul`` + ``fma`` per 256 weights and row (MX: a 32-element block is two lanes). Its activations are
quantized by vector code with the scalar routine's products and rounding.

**Pair-split kernel** (:func:`gemv_fp4_pair_kernel`, K a multiple of 64):

The int8-activation kernel of :mod:`torchport.gemv.kernels` interleaves the two nibbles of every
weight byte back into element order (unpack + 128→256 insert) and recovers signs with
``abs``/``sign`` before ``vpmaddubsw``: about 18 µops per 32 weights. This kernel instead

- reorders the *activations* once per call: per 64-element chunk, the 32 even elements then the 32
  odd ones, so the low nibbles of 32 weight bytes (the even elements) and the high nibbles (the odd
  ones) are used as they come out of one 256-bit load, ``and`` and shift;
- maps each FP4 code with ``vpshufb`` to an *unsigned* byte ``u = 2·e2m1 + 12`` (0…24), so
  ``vpmaddubsw(u, x)`` needs no sign fix-up; the bias ``12·Σx`` is subtracted per int32 lane from a
  correction precomputed with the activations (``Σ u·x − 12·Σx = Σ 2·e2m1·x``, exact in int32);
- adds the even and odd ``vpmaddubsw`` results in int16 (|sum| ≤ 4·24·127 < 2¹⁵) before one
  ``vpmaddwd``: int32 lane ``i`` then holds elements ``8i … 8i+7`` of the chunk, so an NVFP4 block
  (16) is two lanes and an MX block (32) four; block scales become per-lane float vectors (E4M3 via
  the half-precision bit trick and F16C, E8M0 by exponent shift), multiplied by the activation
  group scale and FMA'd into the float32 accumulator.

That is about 20 µops per 64 weights (0.31/weight, vs 0.56). Activation quantization is the same as
the other int8 kernel (per 32 elements, ``amax/127``, round half to even), so the same error bound
holds; only the float summation order differs. K must be a multiple of 64 (the caller falls back to
the other kernel otherwise). AVX2 only: there is no scalar variant (the caller never selects it
below AVX2).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from torchport import native
from torchport.gemv.kernels import GemvKernel
from torchport.native import IntArg, Kernel, TensorArg

# The start of every FP4 GEMV source (parameter fmt): its format macro, the factor folded into the
# activation scales and the block scales' row stride.
_FORMAT_C = r"""
#include <stdlib.h>
#define FMT_${fmt} 1
#if defined(FMT_nvfp4)
#define TP_FOLD(pts) (0.5f * 256.0f * (float)(pts))   /* 2*e2m1 table, E4M3 decoded as v * 2^-8 */
#define TP_SSTRIDE(K) ((K) / 16)
#else
#define TP_FOLD(pts) (0.5f)
#define TP_SSTRIDE(K) ((K) / 32)
#endif
#if defined(__AVX512F__)
/* Sixteen E4M3 scale bytes, each the high byte of a 16-bit word (low byte 0), as floats holding
   value * 2^-8 (the 2^8 is folded into the activation scale): shifted one bit down and bit 14
   cleared, each word is the half with the byte's sign, exponent and mantissa. */
TP_INLINE __m512 tp_e4m3_words_ps(__m256i h) {
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF)));
}
/* FP4 code -> 2 * e2m1 (signed), or 2 * e2m1 + 12 (unsigned), in every 128-bit lane */
#define TP_LUT_SIGNED _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12))
#define TP_LUT_UNSIGNED _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0))
/* tp_quant32 in vector code, the same codes and scale (cvtps2dq rounds as nearbyintf, the
   products are the same; a group with amax < 2^-64 goes through tp_quant32 itself) */
TP_INLINE float tp_quant32_v(const float *p, int8_t *q) {
    const __m512 a = _mm512_loadu_ps(p), c = _mm512_loadu_ps(p + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    if (amax < 0x1p-64f) return tp_quant32(p, q);
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(c, inv))));
    return amax / 127.0f;
}
/* Sixteen E8M0 scale bytes, each the top byte of a dword (the rest 0), as floats 2^(e - 127):
   shifted into the exponent field; e = 0 gives 2^-127, a subnormal. */
TP_INLINE __m512 tp_e8m0_dwords_ps(__m512i t) {
    return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_srli_epi32(t, 1), _mm512_set1_epi32(0x00400000)));
}
#endif
"""

_SOURCE = r"""

/* Activation row -> int8 in pair-split order per 64-chunk, per-lane corrections and scales. */
static void tp_prep_x(const float *x, int64_t K, float fold, int8_t *xr, int32_t *corr, float *xsv) {
    for (int64_t c = 0; c < K / 64; ++c) {
        int8_t q[64];
        for (int h = 0; h < 2; ++h) {
            const float s = tp_quant32(x + c * 64 + h * 32, q + h * 32);
            for (int l = 0; l < 4; ++l) xsv[c * 8 + h * 4 + l] = s * fold;
        }
        for (int j = 0; j < 32; ++j) { xr[c * 64 + j] = q[2 * j]; xr[c * 64 + 32 + j] = q[2 * j + 1]; }
        for (int i = 0; i < 8; ++i) {
            int32_t t = 0;
            for (int e = 0; e < 8; ++e) t += q[8 * i + e];
            corr[c * 8 + i] = 12 * t;
        }
    }
}

#if defined(__AVX2__)
TP_INLINE float tp_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block scales of two consecutive 64-chunks as per-lane vectors (lane i <-> elements 8i..8i+7). */
TP_INLINE void tp_scales2(const uint8_t *sc, int64_t c, __m256 *s0, __m256 *s1) {
#if defined(FMT_nvfp4)
    /* 8 E4M3 bytes -> halves holding value * 2^-8 (the 2^8 is folded into the activation scale) */
    __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sc + c * 4)));
    __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(u, 8), 1), _mm_set1_epi16((short)0xBFFF));
    *s0 = _mm256_cvtph_ps(_mm_unpacklo_epi16(h, h));
    *s1 = _mm256_cvtph_ps(_mm_unpackhi_epi16(h, h));
#else
    /* 4 E8M0 bytes -> 2^(e-127) (e = 0 -> 2^-127, a subnormal) */
    int32_t v;
    memcpy(&v, sc + c * 2, 4);
    __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(v));
    __m128i bits = _mm_blendv_epi8(_mm_slli_epi32(e, 23), _mm_set1_epi32(0x00400000),
                                   _mm_cmpeq_epi32(e, _mm_setzero_si128()));
    __m256i b = _mm256_castsi128_si256(bits);
    *s0 = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
    *s1 = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)));
#endif
}
TP_INLINE __m256 tp_scale1(const uint8_t *sc, int64_t c) {   /* one chunk (odd tail) */
#if defined(FMT_nvfp4)
    int32_t v;
    memcpy(&v, sc + c * 4, 4);
    __m128i u = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(v));
    __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(u, 8), 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(_mm_unpacklo_epi16(h, h));
#else
    const uint8_t e0 = sc[c * 2], e1 = sc[c * 2 + 1];
    float f0, f1;
    uint32_t b0 = e0 ? (uint32_t)e0 << 23 : 0x00400000u, b1 = e1 ? (uint32_t)e1 << 23 : 0x00400000u;
    memcpy(&f0, &b0, 4);
    memcpy(&f1, &b1, 4);
    return _mm256_set_m128(_mm_set1_ps(f1), _mm_set1_ps(f0));
#endif
}

/* 32 weight bytes (64 codes) -> unsigned even / odd element vectors u = 2*e2m1 + 12 */
#define TP_DECODE64(ptr, ulo, uhi) do {                                          \
        __m256i v_ = _mm256_loadu_si256((const __m256i *)(ptr));              \
        ulo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v_, m4));              \
        uhi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v_, 4), m4)); \
    } while (0)
/* int32 lanes of sum 2*e2m1*x for one chunk of one activation row */
#define TP_DOT64(ulo, uhi, xr_, corr_)                                                     \
    _mm256_sub_epi32(_mm256_madd_epi16(_mm256_add_epi16(                                   \
        _mm256_maddubs_epi16(ulo, _mm256_loadu_si256((const __m256i *)(xr_))),            \
        _mm256_maddubs_epi16(uhi, _mm256_loadu_si256((const __m256i *)((xr_) + 32)))),    \
        ones), _mm256_loadu_si256((const __m256i *)(corr_)))

/* One weight row against NB (<= 4) prepared activation rows. */
TP_INLINE void tp_row(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t K,
                      const uint8_t *w, const uint8_t *sc, float *out, int64_t ldo, const int NB) {
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t C = K / 64;
    __m256 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = _mm256_setzero_ps(); acc[b][1] = _mm256_setzero_ps(); }
    int64_t c = 0;
    for (; c + 2 <= C; c += 2) {
        _mm_prefetch((const char *)(w + c * 32) + ${prefetch}, _MM_HINT_T0);
        __m256i ulo0, uhi0, ulo1, uhi1;
        TP_DECODE64(w + c * 32, ulo0, uhi0);
        TP_DECODE64(w + c * 32 + 32, ulo1, uhi1);
        __m256 s0, s1;
        tp_scales2(sc, c, &s0, &s1);
        for (int b = 0; b < NB; ++b) {
            const int8_t *xb = xr + b * K + c * 64;
            const int32_t *cb = corr + b * (K / 8) + c * 8;
            const float *sb = xsv + b * (K / 8) + c * 8;
            __m256i p0 = TP_DOT64(ulo0, uhi0, xb, cb);
            __m256i p1 = TP_DOT64(ulo1, uhi1, xb + 64, cb + 8);
            acc[b][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(s0, _mm256_loadu_ps(sb)), acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(s1, _mm256_loadu_ps(sb + 8)), acc[b][1]);
        }
    }
    if (c < C) {
        __m256i ulo0, uhi0;
        TP_DECODE64(w + c * 32, ulo0, uhi0);
        __m256 s0 = tp_scale1(sc, c);
        for (int b = 0; b < NB; ++b) {
            __m256i p0 = TP_DOT64(ulo0, uhi0, xr + b * K + c * 64, corr + b * (K / 8) + c * 8);
            acc[b][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),
                                        _mm256_mul_ps(s0, _mm256_loadu_ps(xsv + b * (K / 8) + c * 8)), acc[b][0]);
        }
    }
    for (int b = 0; b < NB; ++b) out[b * ldo] = tp_hsum(_mm256_add_ps(acc[b][0], acc[b][1]));
}

/* The N loop over prepared activation rows (threads split N). */
static void tp_gemv_core(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t B, int64_t K,
                         const uint8_t *w, const uint8_t *scales, const float *bias, int64_t has_bias,
                         float *out, int64_t N, int64_t nthreads) {
    const int64_t sstride = TP_SSTRIDE(K);
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K / 2 + sstride, ${chunk});
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        int tp_st_ = 0;
        while (tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        for (int64_t n = lo; n < hi; ++n) {
            const uint8_t *wr = w + n * (K / 2), *sr = scales + n * sstride;
            for (int64_t b = 0; b < B; b += 4) {
                int64_t nb = B - b < 4 ? B - b : 4;
                const int8_t *xb = xr + b * K;
                const int32_t *cb = corr + b * (K / 8);
                const float *sb = xsv + b * (K / 8);
                float *ob = out + b * N + n;
                switch (nb) {
                    case 1: tp_row(xb, cb, sb, K, wr, sr, ob, N, 1); break;
                    case 2: tp_row(xb, cb, sb, K, wr, sr, ob, N, 2); break;
                    case 3: tp_row(xb, cb, sb, K, wr, sr, ob, N, 3); break;
                    default: tp_row(xb, cb, sb, K, wr, sr, ob, N, 4); break;
                }
            }
            if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
        }
        }
    }
}

/* Same contract as the other GEMVs (rowscale unused); K must be a multiple of 64. */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    if (K % 64) return 2;
    if (tp_any_nonfinite(x, B * K)) return TP_NONFINITE;
    const float fold = TP_FOLD(pts_d);
    int8_t *xr = (int8_t *)malloc((size_t)(B * K) + 64);
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * K / 8) + 64);
    float *xsv = (float *)malloc(sizeof(float) * (size_t)(B * K / 8) + 64);
    if (!xr || !corr || !xsv) { free(xr); free(corr); free(xsv); return 3; }
    for (int64_t b = 0; b < B; ++b) tp_prep_x(x + b * K, K, fold, xr + b * K, corr + b * (K / 8), xsv + b * (K / 8));
    tp_gemv_core(xr, corr, xsv, B, K, w, scales, bias, has_bias, out, N, nthreads);
    free(xr);
    free(corr);
    free(xsv);
    return 0;
}

/* Activations already quantized to FP4 (prepared by the caller: int8 2*e2m1 values in pair-split
   order, per-lane bias corrections and per-lane scales that include the weight-side fold):
   every product is exact in int32; only the float accumulation over lanes rounds. */
TP_EXPORT int tp_gemv_prepped(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t B,
                              int64_t K, const uint8_t *w, const uint8_t *scales, const float *bias,
                              int64_t has_bias, float *out, int64_t N, int64_t nthreads) {
    if (K % 64) return 2;
    tp_gemv_core(xr, corr, xsv, B, K, w, scales, bias, has_bias, out, N, nthreads);
    return 0;
}
#else
#error "the pair-split FP4 GEMV needs AVX2"
#endif
"""


_BLOCK_SOURCE = r"""

/* One 128-chunk of an activation row quantized to int8: per 32 elements, scale amax / 127 and
   round half to even (the pair-split kernel's quantization). */
static void tp_quant128(const float *x, int8_t *q, float *s) {
    for (int g = 0; g < 4; ++g) s[g] = tp_quant32(x + g * 32, q + g * 32);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* AVX-512 + VNNI: a chunk's 64 weight bytes are one zmm; vpdpbusd sums four u8 x s8 products per
   int32 lane, so lane d (0..15) of the low-nibble and the high-nibble products together covers
   elements 8d..8d+7: an NVFP4 block is lanes 2b, 2b+1, an MX block lanes 4b..4b+3. Two ways to
   make the unsigned operand, with the same int32 lanes (sum 2 * e2m1 * q) and so the same bits:
   - per-row corrections (below TP_WC_MIN_B activation rows): the weights are unsigned,
     u = 2 * e2m1 + 12 (0..24), the activations signed, and each row carries a correction lane
     -12 * sum q and sixteen scale floats per chunk (one per lane);
   - shared corrections (from TP_WC_MIN_B rows): the weights are signed (2 * e2m1, -12..12), the
     activations unsigned, q + 128 (1..255); the offset's products, 128 * (sum of the lane's
     weights), depend on the weights alone, so they are computed once per chunk for every row, and
     a row keeps four scale floats per chunk (one per 32-element group). A row is then K + K / 8
     bytes instead of 2 K: four rows and their scales fit L1 (32 KB before, all of it). Zen 4,
     11008x4096 from DRAM, thread CPU time, interleaved medians of 15 (load 1.0-1.5): B=4 NVFP4
     3.72-3.88 -> 2.61-2.81 ms, MXFP4 3.72-3.81 -> 2.73-2.92; B=8 NVFP4 6.44 -> 5.22, MXFP4 6.84
     -> 4.94; B=3 NVFP4 2.70 -> 2.47, MXFP4 2.61 -> 2.08; but B=1 1.37-1.45 -> 1.47-1.50 (three
     more operations per chunk for one row). */
#define TP_LPC 16   /* int32 corrections per 128-chunk (per-row corrections) */
#define TP_XPC 16   /* activation scale floats per 128-chunk (per-row corrections; 4 shared) */
#define TP_WC_MIN_B 3

/* Activation row -> per 128-chunk the even elements, then the odd ones (the low and high nibbles
   of the chunk's bytes). wc 0: int8 q, per-lane corrections -12 * sum and per-lane scales; wc 1:
   q + 128 and the four group scales (corr unused). */
static void tp_prep_x128(const float *x, int64_t K, float fold, int8_t *xr, int32_t *corr, float *xsv, int wc) {
    for (int64_t c = 0; c < K / 128; ++c) {
        int8_t q[128];
        float s[4];
        tp_quant128(x + c * 128, q, s);
        uint8_t *o = (uint8_t *)xr + c * 128;
        const int off = wc ? 128 : 0;
        for (int i = 0; i < 64; ++i) {
            o[i] = (uint8_t)(q[2 * i] + off);
            o[64 + i] = (uint8_t)(q[2 * i + 1] + off);
        }
        if (wc) {
            for (int g = 0; g < 4; ++g) xsv[c * 4 + g] = s[g] * fold;
            continue;
        }
        for (int d = 0; d < 16; ++d) {
            int32_t sum = 0;
            for (int e = 0; e < 8; ++e) sum += q[8 * d + e];
            corr[c * 16 + d] = -12 * sum;
            xsv[c * 16 + d] = s[d / 4] * fold;
        }
    }
}
#else
#define TP_LPC 8
#define TP_XPC 8
#define TP_WC_MIN_B 0x7fffffff   /* per-row corrections only */
/* Dword d (0..7) of the A vector of a 128-chunk is dword TP_SRC_A[d] of the chunk's 64 weight
   bytes, and of the B vector dword TP_SRC_A[d] + 1: int32 lane d covers 16-element block
   TP_SRC_A[d] / 2 = {0, 1, 4, 5, 2, 3, 6, 7}[d] (what vshufps 0x88 / 0xDD of two loads give). */
static const int TP_SRC_A[8] = {0, 2, 8, 10, 4, 6, 12, 14};

/* Activation row -> int8 in lane-block order per 128-chunk, per-lane corrections and scales. */
static void tp_prep_x128(const float *x, int64_t K, float fold, int8_t *xr, int32_t *corr, float *xsv, int wc) {
    (void)wc;
    for (int64_t c = 0; c < K / 128; ++c) {
        int8_t q[128];
        float s[4];
        tp_quant128(x + c * 128, q, s);
        int8_t *o = xr + c * 128;
        for (int d = 0; d < 8; ++d) {
            const int a = TP_SRC_A[d], b = a + 1, blk = a / 2;
            for (int t = 0; t < 4; ++t) {
                o[4 * d + t] = q[2 * (4 * a + t)];            /* A, low nibbles */
                o[32 + 4 * d + t] = q[2 * (4 * a + t) + 1];   /* A, high nibbles */
                o[64 + 4 * d + t] = q[2 * (4 * b + t)];       /* B, low */
                o[96 + 4 * d + t] = q[2 * (4 * b + t) + 1];   /* B, high */
            }
            int32_t sum = 0;
            for (int e = 0; e < 16; ++e) sum += q[16 * blk + e];
            corr[c * 8 + d] = 12 * sum;
            xsv[c * 8 + d] = s[blk / 2] * fold;
        }
    }
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#if defined(FMT_nvfp4)
#define TP_SPC 8   /* scale bytes per 128-chunk */
#else
#define TP_SPC 4
#endif
/* The block scales of 128-chunk c as per-lane floats (lane d <-> elements 8d..8d+7). */
TP_INLINE __m512 tp_scales128(const uint8_t *sc, int64_t c) {
#if defined(FMT_nvfp4)
    /* 8 E4M3 bytes, each into the high byte of two 16-bit words -> halves holding value * 2^-8
       (the 2^8 is folded into the activation scale) */
    const __m256i perm = _mm256_setr_epi8(-128, 0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3,
                                          -128, 4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7);
    int64_t v;
    memcpy(&v, sc + c * 8, 8);
    return tp_e4m3_words_ps(_mm256_shuffle_epi8(_mm256_set1_epi64x(v), perm));
#else
    /* 4 E8M0 bytes (32-element blocks: 128-bit lane j <-> byte j) into bits 30..23; e = 0 -> 2^-127 */
    const __m512i perm = _mm512_setr_epi32(0x00808080, 0x00808080, 0x00808080, 0x00808080,
                                           0x01808080, 0x01808080, 0x01808080, 0x01808080,
                                           0x02808080, 0x02808080, 0x02808080, 0x02808080,
                                           0x03808080, 0x03808080, 0x03808080, 0x03808080);
    int32_t v;
    memcpy(&v, sc + c * 4, 4);
    return tp_e8m0_dwords_ps(_mm512_shuffle_epi8(_mm512_set1_epi32(v), perm));
#endif
}

/* -128 * (the sum of each lane's eight weights), from a chunk's decoded low and high nibbles */
TP_INLINE __m512i tp_negsum128(__m512i c128, __m512i lo, __m512i hi) {
    /* |lo + hi| <= 24 per byte: one vpdpbusd on their sum */
    const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, _mm512_add_epi8(lo, hi));
    return _mm512_sub_epi32(_mm512_setzero_si512(), t);
}
/* The four group scales of a chunk (floats p[0..3]) as lanes {4g..4g+3} <- p[g] */
#define TP_XS_IDX _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
#define TP_XS(p) _mm512_permutexvar_ps(xsi, _mm512_castps128_ps512(_mm_loadu_ps(p)))

/* R (1 or 2) consecutive weight rows' chunks c0 <= c < c1 (c0 even) against NB (<= 4) prepared
   activation rows (K a multiple of 128), every activation load (int8 values, corrections, lane
   scales) serving the R rows: weight row r at w + r K / 2, its scales at sc + r sstride, its
   accumulators (NB x 2 vectors) at accp + 2 NB r, kept there between calls: chunk c goes to
   accumulator c & 1 whether K runs in one piece (tp_row128) or in blocks of an even number of
   chunks, so a row's sums depend neither on that nor on R (per row the same operations in the
   same order). Prefetches each row's pfa + r K / 2 + 64 c with the kernel's hint (the row's own
   stream ahead) unless pfa is NULL, and for the first pfr rows pfw + r K / 2 + 64 c (the rows the
   next row group reads) into L2, with their block scales (pfs + r sstride, every fourth chunk and
   the last).
   Without the scales' prefetch the K blocks read each row's scales as short runs from DRAM:
   4096x11008 NVFP4 B=1 from DRAM, two threads, old / new interleaved: 0.82 / 0.69 ms (sum 45
   GB/s), 0.88 / 0.81 ms (sum 35 GB/s). */
TP_INLINE void tp_row128_part(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t K,
                              const uint8_t *w, const uint8_t *sc, int64_t sstride, const char *pfa,
                              const uint8_t *pfw, const uint8_t *pfs, int pfr, int64_t c0, int64_t c1, __m512 *accp,
                              const int NB, const int WC, const int R) {
    const __m512i lut = WC ? TP_LUT_SIGNED : TP_LUT_UNSIGNED;
#if defined(__AVX512VBMI__)
    /* vpermb reads six index bits; the table repeats every 16 bytes, so bits 4-5 do not matter and
       no mask is needed (bits 6-7 are ignored) */
#define TP_NIBBLES(idx) _mm512_permutexvar_epi8((idx), lut)
#else
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#define TP_NIBBLES(idx) _mm512_shuffle_epi8(lut, _mm512_and_si512((idx), m4))
#endif
    const int64_t L = K / 8, LX = WC ? K / 32 : K / 8, WR = K / 2;
    const __m512i c128 = _mm512_set1_epi8((char)0x80), xsi = TP_XS_IDX;
    __m512 acc[2][4][2];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            acc[r][b][0] = accp[2 * (NB * r + b)];
            acc[r][b][1] = accp[2 * (NB * r + b) + 1];
        }
    /* chunk c into accumulator j (two chains, constant indices: acc stays in registers) */
#define TP_CHUNK(c, j) do {                                                                           \
        __m512i lo[2], hi[2], cw[2];                                                               \
        __m512 s[2];                                                                               \
        for (int r = 0; r < R; ++r) {                                                              \
            const uint8_t *wp = w + r * WR + (c) * 64;                                             \
            if (pfa) _mm_prefetch(pfa + r * WR + (c) * 64, _MM_HINT_${hint});                      \
            if (r < pfr) _mm_prefetch((const char *)(pfw + r * WR + (c) * 64), _MM_HINT_T1);       \
            if (r < pfr && (((c) & 3) == 0 || (c) == c1 - 1))   /* their scales (a row's last line too) */ \
                _mm_prefetch((const char *)(pfs + r * sstride + (c) * TP_SPC), _MM_HINT_T1);       \
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(                           \
                _mm256_loadu_si256((const __m256i *)wp)), _mm256_loadu_si256((const __m256i *)(wp + 32)), 1); \
            lo[r] = TP_NIBBLES(v);                                                                 \
            hi[r] = TP_NIBBLES(_mm512_srli_epi16(v, 4));                                           \
            s[r] = tp_scales128(sc + r * sstride, (c));                                            \
            cw[r] = WC ? tp_negsum128(c128, lo[r], hi[r]) : _mm512_setzero_si512();                \
        }                                                                                          \
        for (int b = 0; b < NB; ++b) {                                                             \
            const int8_t *xp = xr + b * K + (c) * 128;                                             \
            const __m512i xl = _mm512_loadu_si512((const void *)xp);                               \
            const __m512i xh = _mm512_loadu_si512((const void *)(xp + 64));                        \
            __m512i pc = _mm512_setzero_si512();                                                   \
            __m512 xs;                                                                             \
            if (WC) {                                                                              \
                xs = TP_XS(xsv + b * LX + (c) * 4);                                                \
            } else {                                                                               \
                pc = _mm512_loadu_si512((const void *)(corr + b * L + (c) * 16));                  \
                xs = _mm512_loadu_ps(xsv + b * LX + (c) * 16);                                     \
            }                                                                                      \
            for (int r = 0; r < R; ++r) {                                                          \
                __m512i p;                                                                         \
                if (WC) p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(cw[r], xl, lo[r]), xh, hi[r]); \
                else p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(pc, lo[r], xl), hi[r], xh);        \
                acc[r][b][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(s[r], xs), acc[r][b][j]); \
            }                                                                                      \
        }                                                                                          \
    } while (0)
    /* Weights: two 256-bit loads per line (one 512-bit load per line streamed from DRAM about 20 %
       slower here, two threads, Zen 4; half the rate in the FP8 kernel on Zen 5). Products:
       -12 * sum q + sum u * q, or -128 * sum w + sum w * (q + 128): both sum 2 * e2m1 * q, exact
       in int32 (|lane| <= 8 * 24 * 127, 8 * 12 * 255). */
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) {
        TP_CHUNK(c, 0);
        TP_CHUNK(c + 1, 1);
    }
    if (c < c1) TP_CHUNK(c, 0);
#undef TP_CHUNK
#undef TP_NIBBLES
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            accp[2 * (NB * r + b)] = acc[r][b][0];
            accp[2 * (NB * r + b) + 1] = acc[r][b][1];
        }
}

/* A row's sums from its accumulators (NB x 2 vectors). */
TP_INLINE void tp_row128_end(const __m512 *accp, float *out, int64_t ldo, const int NB) {
    for (int b = 0; b < NB; ++b) out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(accp[2 * b], accp[2 * b + 1]));
}

/* One weight row against NB (<= 4) prepared activation rows; K a multiple of 128. */
TP_INLINE void tp_row128(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t K,
                         const uint8_t *w, const uint8_t *sc, float *out, int64_t ldo, const int NB,
                         const int WC) {
    __m512 acc[8];
    for (int i = 0; i < 2 * NB; ++i) acc[i] = _mm512_setzero_ps();
    tp_row128_part(xr, corr, xsv, K, w, sc, 0, (const char *)w + ${prefetch}, NULL, NULL, 0, 0, K / 128, acc, NB, WC, 1);
    tp_row128_end(acc, out, ldo, NB);
}

/* Two consecutive weight rows against NB (<= 4) prepared activation rows: every activation load
   (int8 values, corrections, lane scales) serves both rows. Per row the same operations in the
   same order as tp_row128, so the results are bit-identical whichever path a row takes. Used from
   four activation rows, where the kernel is bound by its per-row work rather than the stream
   (11008x4096 from DRAM, interleaved medians, load 0.3-0.7: NVFP4 two threads B=4 2.11-2.23 ->
   1.84-1.92 ms, B=8 4.56 -> 3.89, MXFP4 B=4 1.79 -> 1.59; B=2 and B=3 no gain, B=2 one thread
   1.67 -> 1.80). tp_row128_part with R = 2 does the same operations (the K blocks use it), but in
   its place here GCC kept more accumulators on the stack and the loop ran slower (11008x4096 T0
   4096, two threads, alternated medians of 38: NVFP4 B=4 1.193 -> 1.342 ms, MXFP4 1.080 -> 1.123,
   B=8 2.094 -> 2.159), so this specialised copy stays. */
TP_INLINE void tp_row128_r2(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t K,
                            const uint8_t *w, const uint8_t *sc, int64_t sstride, float *out,
                            int64_t ldo, const int NB) {
    (void)corr;   /* shared corrections only: used from TP_WC_MIN_B rows */
    const __m512i lut = TP_LUT_SIGNED;
#if defined(__AVX512VBMI__)
#define TP_NIBBLES(idx) _mm512_permutexvar_epi8((idx), lut)
#else
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#define TP_NIBBLES(idx) _mm512_shuffle_epi8(lut, _mm512_and_si512((idx), m4))
#endif
    const int64_t C = K / 128, L = K / 32, R = K / 2;
    const __m512i c128 = _mm512_set1_epi8((char)0x80), xsi = TP_XS_IDX;
    __m512 acc[2][4][2];
    for (int b = 0; b < NB; ++b)
        for (int r = 0; r < 2; ++r) { acc[r][b][0] = _mm512_setzero_ps(); acc[r][b][1] = _mm512_setzero_ps(); }
#define TP_LINE2(wp_) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wp_))), \
                                         _mm256_loadu_si256((const __m256i *)((wp_) + 32)), 1)
#define TP_CHUNK2(c, j) do {                                                                          \
        const uint8_t *w0 = w + (c) * 64, *w1 = w + R + (c) * 64;                                  \
        _mm_prefetch((const char *)w0 + ${prefetch}, _MM_HINT_${hint});                            \
        _mm_prefetch((const char *)w1 + ${prefetch}, _MM_HINT_${hint});                            \
        const __m512i v0 = TP_LINE2(w0), v1 = TP_LINE2(w1);                                        \
        const __m512i lo0 = TP_NIBBLES(v0), hi0 = TP_NIBBLES(_mm512_srli_epi16(v0, 4));            \
        const __m512i lo1 = TP_NIBBLES(v1), hi1 = TP_NIBBLES(_mm512_srli_epi16(v1, 4));            \
        const __m512 s0 = tp_scales128(sc, (c)), s1 = tp_scales128(sc + sstride, (c));            \
        const __m512i cw0 = tp_negsum128(c128, lo0, hi0), cw1 = tp_negsum128(c128, lo1, hi1);     \
        for (int b = 0; b < NB; ++b) {                                                             \
            const int8_t *xp = xr + b * K + (c) * 128;                                             \
            const __m512i xl = _mm512_loadu_si512((const void *)xp);                               \
            const __m512i xh = _mm512_loadu_si512((const void *)(xp + 64));                        \
            const __m512 xs = TP_XS(xsv + b * L + (c) * 4);                                        \
            __m512i p0 = _mm512_dpbusd_epi32(cw0, xl, lo0), p1 = _mm512_dpbusd_epi32(cw1, xl, lo1); \
            p0 = _mm512_dpbusd_epi32(p0, xh, hi0);                                                 \
            p1 = _mm512_dpbusd_epi32(p1, xh, hi1);                                                 \
            acc[0][b][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, xs), acc[0][b][j]); \
            acc[1][b][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(s1, xs), acc[1][b][j]); \
        }                                                                                          \
    } while (0)
    int64_t c = 0;
    for (; c + 2 <= C; c += 2) {
        TP_CHUNK2(c, 0);
        TP_CHUNK2(c + 1, 1);
    }
    if (c < C) TP_CHUNK2(c, 0);
#undef TP_CHUNK2
#undef TP_LINE2
#undef TP_NIBBLES
    for (int b = 0; b < NB; ++b) {
        out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][b][0], acc[0][b][1]));
        out[b * ldo + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc[1][b][0], acc[1][b][1]));
    }
}
#define TP_HAVE_R2 1
/* K blocks (AVX-512, per-row corrections: one or two activation rows): where the rows' prepared
   activations (int8 values, corrections, scales: B (K + 4 L + 4 LX) bytes, 2 K a row) exceed
   TP_XMIN, TP_KR weight rows at a time run K in blocks holding TP_XBYTES of them (a block of every
   row stays in L1 while the TP_KR rows use it), accumulators parked between blocks, the next rows
   prefetched into L2. At K = 11008 one row's are 22 KB and the weight stream through L1 evicted
   them: per weight B=1 ran 20-24 % slower than at K = 4096 (22016x2048 and 11008x4096 equal).
   4096x11008 from DRAM, previous build vs blocks, interleaved medians of 15 (load 2.6-2.9): NVFP4
   B=1 two threads 1.15/1.14 -> 1.01/1.06 ms, B=2 1.64 -> 1.56 (one thread 2.98 -> 2.52); MXFP4
   B=1 1.25/1.18 -> 0.92/0.96, B=2 1.64 -> 1.29. With shared corrections (from TP_WC_MIN_B rows)
   blocks measured slower (B=3 two threads NVFP4 1.44 -> 1.64, MXFP4 1.35 -> 1.46; B=4, which then
   loses the two-row loop, 1.65 -> 2.05), so those keep K in one piece. The blocks run their weight
   rows in pairs, every activation load serving two (per row the same operations: the same bits).
   4096x11008 from DRAM, previous / this build interleaved, medians of 18 (load 0.4-1.0, sum 29-34
   GB/s; every kernel of a round read one weight copy, partly from L3 after the first: absolute
   times low), NTA 2048 / T0 4096 prefetch: NVFP4 B=1 two threads 1.06 / 0.78 -> 0.80 / 0.75 ms, one
   thread 1.49 / 1.31 -> 1.31 / 1.23; MXFP4 B=1 0.98 / 0.68 -> 0.69 / 0.61; NVFP4 B=2 1.37 / 1.16 ->
   1.19 / 1.08. */
#define TP_KR 8
#define TP_XBYTES ${xblock}
#define TP_XMIN 20480
#if TP_WC_MIN_B > 4
#error "tp_row128_r2 (from four rows) assumes the shared corrections, TP_WC_MIN_B <= 4"
#endif
#elif defined(__AVX2__)
TP_INLINE float tp_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The block scales of 128-chunk c as per-lane floats (lane d <-> block {0,1,4,5,2,3,6,7}[d]). */
TP_INLINE __m256 tp_scales128(const uint8_t *sc, int64_t c) {
#if defined(FMT_nvfp4)
    /* 8 E4M3 bytes, permuted into the high byte of 16-bit words -> halves holding value * 2^-8
       (the 2^8 is folded into the activation scale) */
    const __m128i perm = _mm_setr_epi8(-128, 0, -128, 1, -128, 4, -128, 5, -128, 2, -128, 3, -128, 6, -128, 7);
    __m128i u = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(sc + c * 8)), perm);
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(u, 1), _mm_set1_epi16((short)0xBFFF)));
#else
    /* 4 E8M0 bytes (32-element blocks: lanes {0,0,2,2,1,1,3,3}) into bits 30..23; e = 0 -> 2^-127 */
    const __m256i perm = _mm256_setr_epi8(-128, -128, -128, 0, -128, -128, -128, 0, -128, -128, -128, 2, -128, -128, -128, 2,
                                          -128, -128, -128, 1, -128, -128, -128, 1, -128, -128, -128, 3, -128, -128, -128, 3);
    int32_t v;
    memcpy(&v, sc + c * 4, 4);
    __m256i e = _mm256_srli_epi32(_mm256_shuffle_epi8(_mm256_set1_epi32(v), perm), 1);
    return _mm256_castsi256_ps(_mm256_max_epu32(e, _mm256_set1_epi32(0x00400000)));
#endif
}

/* One weight row against NB (<= 4) prepared activation rows; K a multiple of 128. */
TP_INLINE void tp_row128(const int8_t *xr, const int32_t *corr, const float *xsv, int64_t K,
                         const uint8_t *w, const uint8_t *sc, float *out, int64_t ldo, const int NB,
                         const int WC) {
    (void)WC;   /* per-row corrections only */
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t C = K / 128, L = K / 16;
    /* One accumulator per activation row (two, chunks alternating, were 8 registers beside the
       7 constants and nibble vectors: GCC kept them on the stack, the FMA chain through memory).
       Its 4-cycle chain is well inside a chunk's ~20 cycles. 11008x4096 from DRAM, two threads,
       the two builds interleaved (41 and 31 rounds): NVFP4 B=4 1.974 -> 1.861 ms, B=2 1.350 ->
       1.295, MXFP4 B=4 1.628 -> 1.556, B=1 within 2 % (4096x11008 B=4 1.924 -> 1.955: there four
       rows' activations overflow L1 either way); L3-resident 2048x4096 B=4, one thread: 25.8 ->
       22.6 cycles per 128 weights. The pair-split kernel's tp_row (two 64-chunks a step, each
       with its own accumulator) gained nothing from one (11008x4032 B=4 / 2 / 1: 0.991 / 1.027 /
       1.025 the time). */
    __m256 acc[4];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
        const uint8_t *wp = w + c * 64;
        _mm_prefetch((const char *)wp + ${prefetch}, _MM_HINT_${hint});
        const __m256 n0 = _mm256_loadu_ps((const float *)wp), n1 = _mm256_loadu_ps((const float *)(wp + 32));
        const __m256i va = _mm256_castps_si256(_mm256_shuffle_ps(n0, n1, 0x88));
        const __m256i vb = _mm256_castps_si256(_mm256_shuffle_ps(n0, n1, 0xDD));
        const __m256i la = _mm256_shuffle_epi8(lut, _mm256_and_si256(va, m4));
        const __m256i ha = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(va, 4), m4));
        const __m256i lb = _mm256_shuffle_epi8(lut, _mm256_and_si256(vb, m4));
        const __m256i hb = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(vb, 4), m4));
        const __m256 s = tp_scales128(sc, c);
        for (int b = 0; b < NB; ++b) {
            const int8_t *xp = xr + b * K + c * 128;
            /* |each int16 lane| <= 8 * 24 * 127 = 24384: the four products add without overflow */
            const __m256i s16 = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(la, _mm256_loadu_si256((const __m256i *)xp)),
                                 _mm256_maddubs_epi16(ha, _mm256_loadu_si256((const __m256i *)(xp + 32)))),
                _mm256_add_epi16(_mm256_maddubs_epi16(lb, _mm256_loadu_si256((const __m256i *)(xp + 64))),
                                 _mm256_maddubs_epi16(hb, _mm256_loadu_si256((const __m256i *)(xp + 96)))));
            const __m256i p = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones),
                                               _mm256_loadu_si256((const __m256i *)(corr + b * L + c * 8)));
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                     _mm256_mul_ps(s, _mm256_loadu_ps(xsv + b * L + c * 8)), acc[b]);
        }
    }
    for (int b = 0; b < NB; ++b) out[b * ldo] = tp_hsum(acc[b]);
}

#endif

#if defined(__AVX2__)
/* Weight row n (and n + 1 when rows == 2) against nb (<= 4) prepared activation rows. */
TP_INLINE void tp_group(const int8_t *xb, const int32_t *cb, const float *sb, int64_t K, const uint8_t *wr,
                        const uint8_t *sr, int64_t sstride, float *ob, int64_t ldo, int64_t nb, int rows,
                        int wc) {
#if defined(TP_HAVE_R2)
    if (rows == 2) {
        switch (nb) {
            case 1: tp_row128_r2(xb, cb, sb, K, wr, sr, sstride, ob, ldo, 1); break;
            case 2: tp_row128_r2(xb, cb, sb, K, wr, sr, sstride, ob, ldo, 2); break;
            case 3: tp_row128_r2(xb, cb, sb, K, wr, sr, sstride, ob, ldo, 3); break;
            default: tp_row128_r2(xb, cb, sb, K, wr, sr, sstride, ob, ldo, 4); break;
        }
        return;
    }
#endif
    (void)sstride;
    (void)rows;
    if (wc) {
        switch (nb) {
            case 1: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 1, 1); break;
            case 2: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 2, 1); break;
            case 3: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 3, 1); break;
            default: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 4, 1); break;
        }
        return;
    }
    switch (nb) {
        case 1: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 1, 0); break;
        case 2: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 2, 0); break;
        case 3: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 3, 0); break;
        default: tp_row128(xb, cb, sb, K, wr, sr, ob, ldo, 4, 0); break;
    }
}

/* Same contract as the other GEMVs (rowscale unused); K must be a multiple of 128. */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    (void)rowscale;
    if (K % 128) return 2;
    if (tp_any_nonfinite(x, B * K)) return TP_NONFINITE;
    const float fold = TP_FOLD(pts_d);
    const int64_t sstride = TP_SSTRIDE(K);
    const int wc = B >= TP_WC_MIN_B;   /* shared corrections (AVX-512 only) */
    const int64_t L = wc ? 0 : K / 128 * TP_LPC, LX = K / 128 * (wc ? 4 : TP_XPC);
    int8_t *xr = (int8_t *)malloc((size_t)(B * K) + 64);
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * L) + 64);
    float *xsv = (float *)malloc(sizeof(float) * (size_t)(B * LX) + 64);
    if (!xr || !corr || !xsv) { free(xr); free(corr); free(xsv); return 3; }
    for (int64_t b = 0; b < B; ++b)
        tp_prep_x128(x + b * K, K, fold, xr + b * K, corr + b * L, xsv + b * LX, wc);
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K / 2 + sstride, ${chunk});
    int64_t cb_len = 0;   /* K block in 128-chunks (even), 0: K in one piece */
#if defined(TP_HAVE_R2)
    const int64_t xbytes = B * (K + 4 * L + 4 * LX);   /* the prepared activations of every row */
    if (TP_XBYTES > 0 && !wc && xbytes > TP_XMIN && K / 128 > 2) {
        cb_len = TP_XBYTES / (xbytes / (K / 128)) / 2 * 2;
        if (cb_len < 2) cb_len = 2;
    }
#endif
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi, nlo = 0, nhi = 0;
        int tp_st_ = 0, ahead = 0;
        while (cb_len ? tp_claim_rows_ahead(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi, nlo, nhi, &ahead)
                      : tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
#if defined(TP_HAVE_R2)
        if (cb_len) {   /* K blocks (see TP_XMIN) */
            const int64_t C = K / 128;
            for (int64_t n0 = lo; n0 < hi; n0 += TP_KR) {
                const int64_t n1 = n0 + TP_KR < hi ? n0 + TP_KR : hi;
                int64_t p1;   /* the next row group [p0, p1), prefetched into L2 while this one runs */
                const int64_t p0 = tp_next_group(n1, hi, TP_KR, &tp_next_, N, tp_step_, &tp_st_, &nlo, &nhi, &ahead, &p1);
                __m512 accb[TP_KR * 16];
                for (int64_t i = 0; i < (n1 - n0) * B * 2; ++i) accb[i] = _mm512_setzero_ps();
                for (int64_t cb = 0; cb < C; cb += cb_len) {
                    const int64_t ce = cb + cb_len < C ? cb + cb_len : C;
                    /* per-row corrections (blocks only without shared ones): one or two activation
                       rows, the weight rows in pairs (every activation load serving two) */
                    for (int64_t n = n0; n < n1; n += 2) {
                        const int R = n + 1 < n1 ? 2 : 1;
                        const int64_t pn = p0 + (n - n0), pfr = p1 - pn;   /* rows to prefetch */
                        const uint8_t *wr = w + n * (K / 2), *sr = scales + n * sstride;
                        const uint8_t *pfw = pfr > 0 ? w + pn * (K / 2) : NULL;
                        const uint8_t *pfs = pfr > 0 ? scales + pn * sstride : NULL;
                        const int ipf = pfr < R ? (int)pfr : R;
                        __m512 *ap = accb + (n - n0) * B * 2;
                        switch (B * 2 + R - 1) {   /* (B, R), B <= 2 here */
                            case 2: tp_row128_part(xr, corr, xsv, K, wr, sr, sstride, NULL, pfw, pfs, ipf, cb, ce, ap, 1, 0, 1); break;
                            case 3: tp_row128_part(xr, corr, xsv, K, wr, sr, sstride, NULL, pfw, pfs, ipf, cb, ce, ap, 1, 0, 2); break;
                            case 4: tp_row128_part(xr, corr, xsv, K, wr, sr, sstride, NULL, pfw, pfs, ipf, cb, ce, ap, 2, 0, 1); break;
                            default: tp_row128_part(xr, corr, xsv, K, wr, sr, sstride, NULL, pfw, pfs, ipf, cb, ce, ap, 2, 0, 2); break;
                        }
                    }
                }
                for (int64_t n = n0; n < n1; ++n)
                    for (int64_t b = 0; b < B; b += 4) {
                        const int64_t nb = B - b < 4 ? B - b : 4;
                        const __m512 *ap = accb + ((n - n0) * B + b) * 2;
                        float *ob = out + b * N + n;
                        if (nb == 1) tp_row128_end(ap, ob, N, 1);   /* one or two rows, as above */
                        else tp_row128_end(ap, ob, N, 2);
                        if (has_bias) for (int64_t i = 0; i < nb; ++i) out[(b + i) * N + n] += bias[n];
                    }
            }
            continue;
        }
#endif
        for (int64_t n = lo; n < hi;) {
            const uint8_t *wr = w + n * (K / 2), *sr = scales + n * sstride;
            int rows = 1;   /* weight rows sharing each activation load */
#if defined(TP_HAVE_R2)
            if (B >= 4 && n + 1 < hi) rows = 2;   /* (TP_WC_MIN_B <= 4: shared corrections) */
#endif
            for (int64_t b = 0; b < B; b += 4) {
                int64_t nb = B - b < 4 ? B - b : 4;
                tp_group(xr + b * K, corr + b * L, xsv + b * LX, K, wr, sr, sstride, out + b * N + n, N, nb, rows,
                         wc);
            }
            if (has_bias)
                for (int r = 0; r < rows; ++r)
                    for (int64_t b = 0; b < B; ++b) out[b * N + n + r] += bias[n + r];
            n += rows;
        }
        }
    }
    free(xr);
    free(corr);
    free(xsv);
    return 0;
}
#else
#error "the lane-block FP4 GEMV needs AVX2"
#endif
"""

_WBLOCK_SOURCE = r"""
/* each weight line as one 512-bit load (1) or two 256-bit loads and an insert (0): see WBLOCK_LOADS */
#define TP_LOAD512 ${load512}
#if !(defined(__AVX512BW__) && defined(__AVX512VNNI__))
#error "the whole-block FP4 GEMV needs AVX-512 BW and VNNI"
#endif
#if defined(FMT_nvfp4)
#define TP_SPU 16   /* scale bytes per 256-unit: sixteen 16-element blocks */
#else
#define TP_SPU 8    /* eight 32-element blocks */
#endif

/* One 256-unit of an activation row -> four 64-byte vectors whose int32 lane j (four bytes) meets
   the four weight bytes lane j of A / B holds (block j, see tp_row256_part): lo(A) elements 16j+2t,
   hi(A) 16j+2t+1, lo(B) 16j+8+2t, hi(B) 16j+9+2t (t = 0..3), the int8 codes of tp_quant32 (per 32
   elements, amax / 127, round half even: cvtps2dq rounds as nearbyintf, the products are the
   same; a group with amax < 2^-64 goes through tp_quant32 itself); corr: -12 * the sum of block
   j's sixteen codes (the weights' +12 offset), xs: the unit's eight group scales times fold. */
TP_INLINE void tp_prep_unit256(const float *x, float fold, int8_t *o, int32_t *corr, float *xs) {
    int8_t q[256];
    for (int g = 0; g < 8; ++g) xs[g] = tp_quant32_v(x + g * 32, q + g * 32) * fold;
    /* per 16-byte block: the even bytes 0..6, odd 1..7, even 8..14, odd 9..15 as dwords 0..3,
       then dword d of block j to vector d, lane j */
    const __m512i sh = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    __m512i y[4];
    for (int i = 0; i < 4; ++i) y[i] = _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)(q + 64 * i)), sh);
    const __m512i p01 = _mm512_permutex2var_epi32(y[0], i01, y[1]), p23 = _mm512_permutex2var_epi32(y[2], i01, y[3]);
    const __m512i q01 = _mm512_permutex2var_epi32(y[0], i23, y[1]), q23 = _mm512_permutex2var_epi32(y[2], i23, y[3]);
    const __m512i v[4] = {_mm512_shuffle_i64x2(p01, p23, 0x44), _mm512_shuffle_i64x2(p01, p23, 0xEE),
                          _mm512_shuffle_i64x2(q01, q23, 0x44), _mm512_shuffle_i64x2(q01, q23, 0xEE)};
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512();
    for (int d = 0; d < 4; ++d) {
        _mm512_storeu_si512((void *)(o + 64 * d), v[d]);
        sum = _mm512_dpbusd_epi32(sum, ones, v[d]);
    }
    _mm512_storeu_si512((void *)corr, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-12)));
}

/* The block scales of unit u as per-lane floats: lane j <-> 16-element block j (NVFP4: its E4M3
   scale as a half holding value * 2^-8, the 2^8 folded into the activation scale; MX: the 32-
   element block j / 2's E8M0 as 2^(e - 127), e = 0 -> 2^-127). */
TP_INLINE __m512 tp_scales256(const uint8_t *sc, int64_t u) {
#if defined(FMT_nvfp4)
    const __m256i perm = _mm256_setr_epi8(-128, 0, -128, 1, -128, 2, -128, 3, -128, 4, -128, 5, -128, 6, -128, 7,
                                          -128, 8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15);
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(sc + u * 16)));
    return tp_e4m3_words_ps(_mm256_shuffle_epi8(b, perm));
#else
    const __m512i perm = _mm512_setr_epi32(0x00808080, 0x00808080, 0x01808080, 0x01808080,
                                           0x02808080, 0x02808080, 0x03808080, 0x03808080,
                                           0x04808080, 0x04808080, 0x05808080, 0x05808080,
                                           0x06808080, 0x06808080, 0x07808080, 0x07808080);
    int64_t v;
    memcpy(&v, sc + u * 8, 8);
    return tp_e8m0_dwords_ps(_mm512_shuffle_epi8(_mm512_set1_epi64(v), perm));
#endif
}

/* R (1 or 2) consecutive weight rows' units u0 <= u < u1 against NB (<= 4) prepared activation
   rows, every activation load serving the R rows. A unit is 256 weights, two lines (v1, v2):
   vpermt2d gathers their even dwords into A and the odd ones into B, so dword j of A and of B are
   the two halves of 16-element block j; each nibble vector maps through the table
   u = 2 * e2m1 + 12, and four vpdpbusd (onto the lane's correction) leave int32 lane j holding
   block j's whole dot product sum 2 * e2m1 * q (exact: |lane| <= 16 * 24 * 127): one cvt, mul
   and fma per 256 weights and row. Weight row r at w + r K / 2, its scales at sc + r sstride, its
   NB accumulators at accp + NB r, kept there between calls (a row's sums do not depend on K
   blocks or R: the same operations in the same order). Prefetch as the lane-block kernel's
   tp_row128_part. */
TP_INLINE void tp_row256_part(const int8_t *xr, const int32_t *corr, const float *xs, int64_t K,
                              const uint8_t *w, const uint8_t *sc, int64_t sstride, const char *pfa,
                              const uint8_t *pfw, const uint8_t *pfs, int pfr, int64_t u0, int64_t u1,
                              __m512 *accp, const int NB, const int R) {
    const __m512i lut = TP_LUT_UNSIGNED;
#if defined(__AVX512VBMI__)
#define TP_NIBBLES(idx) _mm512_permutexvar_epi8((idx), lut)
#else
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#define TP_NIBBLES(idx) _mm512_shuffle_epi8(lut, _mm512_and_si512((idx), m4))
#endif
    const int64_t WR = K / 2, LC = K / 16, LX = K / 32;
    const __m512i ia = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i ib = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i xsi = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[2][4];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) acc[r][b] = accp[NB * r + b];
    for (int64_t u = u0; u < u1; ++u) {
        __m512i al[2], ah[2], bl[2], bh[2];
        __m512 s[2];
        for (int r = 0; r < R; ++r) {
            const uint8_t *wp = w + r * WR + u * 128;
            if (pfa) {
                _mm_prefetch(pfa + r * WR + u * 128, _MM_HINT_${hint});
                _mm_prefetch(pfa + r * WR + u * 128 + 64, _MM_HINT_${hint});
            }
            if (r < pfr) {
                _mm_prefetch((const char *)(pfw + r * WR + u * 128), _MM_HINT_T1);
                _mm_prefetch((const char *)(pfw + r * WR + u * 128 + 64), _MM_HINT_T1);
                if ((u & 3) == 0 || u == u1 - 1)   /* their scales (a row's last unit too) */
                    _mm_prefetch((const char *)(pfs + r * sstride + u * TP_SPU), _MM_HINT_T1);
            }
#if TP_LOAD512
            const __m512i v1 = _mm512_loadu_si512((const void *)wp), v2 = _mm512_loadu_si512((const void *)(wp + 64));
#else
            const __m512i v1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)wp)),
                                                  _mm256_loadu_si256((const __m256i *)(wp + 32)), 1);
            const __m512i v2 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wp + 64))),
                                                  _mm256_loadu_si256((const __m256i *)(wp + 96)), 1);
#endif
            const __m512i A = _mm512_permutex2var_epi32(v1, ia, v2), B = _mm512_permutex2var_epi32(v1, ib, v2);
            al[r] = TP_NIBBLES(A);
            ah[r] = TP_NIBBLES(_mm512_srli_epi16(A, 4));
            bl[r] = TP_NIBBLES(B);
            bh[r] = TP_NIBBLES(_mm512_srli_epi16(B, 4));
            s[r] = tp_scales256(sc + r * sstride, u);
        }
        for (int b = 0; b < NB; ++b) {
            const int8_t *xp = xr + b * K + u * 256;
            const __m512i x0 = _mm512_loadu_si512((const void *)xp), x1 = _mm512_loadu_si512((const void *)(xp + 64));
            const __m512i x2 = _mm512_loadu_si512((const void *)(xp + 128)), x3 = _mm512_loadu_si512((const void *)(xp + 192));
            const __m512i pc = _mm512_loadu_si512((const void *)(corr + b * LC + u * 16));
            const __m512 xv = _mm512_permutexvar_ps(xsi, _mm512_castps256_ps512(_mm256_loadu_ps(xs + b * LX + u * 8)));
            for (int r = 0; r < R; ++r) {
                __m512i p = _mm512_dpbusd_epi32(pc, al[r], x0);
                p = _mm512_dpbusd_epi32(p, ah[r], x1);
                p = _mm512_dpbusd_epi32(p, bl[r], x2);
                p = _mm512_dpbusd_epi32(p, bh[r], x3);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(s[r], xv), acc[r][b]);
            }
        }
    }
#undef TP_NIBBLES
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) accp[NB * r + b] = acc[r][b];
}

/* (NB, R) dispatch with constant arguments (the loops above unroll, acc stays in registers) */
TP_INLINE void tp_rows256(const int8_t *xr, const int32_t *corr, const float *xs, int64_t K,
                          const uint8_t *w, const uint8_t *sc, int64_t sstride, const char *pfa,
                          const uint8_t *pfw, const uint8_t *pfs, int pfr, int64_t u0, int64_t u1,
                          __m512 *accp, int64_t nb, int R) {
    switch ((int)nb * 2 + R - 1) {
        case 2: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 1, 1); break;
        case 3: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 1, 2); break;
        case 4: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 2, 1); break;
        case 5: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 2, 2); break;
        case 6: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 3, 1); break;
        case 7: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 3, 2); break;
        case 8: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 4, 1); break;
        default: tp_row256_part(xr, corr, xs, K, w, sc, sstride, pfa, pfw, pfs, pfr, u0, u1, accp, 4, 2); break;
    }
}

#define TP_KR 8   /* weight rows per group (K blocks) */

/* Same contract as the other GEMVs (rowscale unused); K must be a multiple of 256 (status 2). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    (void)rowscale;
    if (K % 256) return 2;
    if (tp_any_nonfinite(x, B * K)) return TP_NONFINITE;
    const float fold = TP_FOLD(pts_d);
    const int64_t sstride = TP_SSTRIDE(K);
    const int64_t U = K / 256, LC = K / 16, LX = K / 32;
    int8_t *xr = (int8_t *)malloc((size_t)(B * K) + 64);
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * LC) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(B * LX) + 64);
    if (!xr || !corr || !xs) { free(xr); free(corr); free(xs); return 3; }
    for (int64_t i = 0; i < B * U; ++i) {
        const int64_t b = i / U, u = i % U;
        tp_prep_unit256(x + b * K + u * 256, fold, xr + b * K + u * 256, corr + b * LC + u * 16, xs + b * LX + u * 8);
    }
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K / 2 + sstride, ${chunk});
    /* K blocks where up to four rows' prepared activations (K + 4 LC + 4 LX bytes a row) exceed
       ${xmin} bytes: a block of ${xblock} bytes of them stays in L1 while a group of TP_KR weight
       rows uses it */
    const int64_t xrow = K + 4 * LC + 4 * LX, nbmax = B < 4 ? B : 4;
    int64_t ub = U;
    if (${xblock} > 0 && nbmax * xrow > ${xmin}) {
        int64_t per = ${xblock} / (nbmax * (xrow / U));   /* units a block may hold */
        per = per < 1 ? 1 : per;
        const int64_t nblk = (U + per - 1) / per;
        ub = (U + nblk - 1) / nblk;   /* blocks of equal length (the last one shorter by < nblk) */
    }
    const int blocked = ub < U;
    /* weight rows in pairs (every activation load serving two) in passes of three or four
       activation rows: at one row pairs streamed slower (11008x4096 from DRAM, two threads,
       interleaved medians of 11: 1.25 against 1.03 ms), at two about equal */
    const int pair = ${rows} == 2;
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi, nlo = 0, nhi = 0;
        int tp_st_ = 0, ahead = 0;
        __m512 accb[TP_KR * 4];
        while (blocked ? tp_claim_rows_ahead(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi, nlo, nhi, &ahead)
                       : tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
            for (int64_t n0 = lo; n0 < hi; n0 += TP_KR) {
                const int64_t n1 = n0 + TP_KR < hi ? n0 + TP_KR : hi;
                int64_t p0 = 0, p1 = 0;   /* the next row group [p0, p1), prefetched into L2 (K blocks) */
                if (blocked) p0 = tp_next_group(n1, hi, TP_KR, &tp_next_, N, tp_step_, &tp_st_, &nlo, &nhi, &ahead, &p1);
                for (int64_t b = 0; b < B; b += 4) {
                    const int64_t nb = B - b < 4 ? B - b : 4;
                    const int pr = pair && nb >= 3;   /* this pass pairs its weight rows */
                    const int8_t *xb = xr + b * K;
                    const int32_t *cb = corr + b * LC;
                    const float *sb = xs + b * LX;
                    for (int64_t i = 0; i < (n1 - n0) * nb; ++i) accb[i] = _mm512_setzero_ps();
                    for (int64_t u = 0; u < U; u += ub) {
                        const int64_t ue = u + ub < U ? u + ub : U;
                        for (int64_t n = n0; n < n1; n += 1 + pr) {
                            const int R = pr && n + 1 < n1 ? 2 : 1;
                            const uint8_t *wr = w + n * (K / 2), *sr = scales + n * sstride;
                            const int64_t pn = p0 + (n - n0), pfr = blocked && b == 0 ? p1 - pn : 0;
                            const uint8_t *pfw = pfr > 0 ? w + pn * (K / 2) : NULL;
                            const uint8_t *pfs = pfr > 0 ? scales + pn * sstride : NULL;
                            const int ipf = pfr < R ? (int)(pfr > 0 ? pfr : 0) : R;
                            const char *pfa = blocked ? NULL : (const char *)wr + ${prefetch};
                            tp_rows256(xb, cb, sb, K, wr, sr, sstride, pfa, pfw, pfs, ipf, u, ue,
                                       accb + (n - n0) * nb, nb, R);
                        }
                    }
                    for (int64_t n = n0; n < n1; ++n)
                        for (int64_t i = 0; i < nb; ++i) {
                            float v = _mm512_reduce_add_ps(accb[(n - n0) * nb + i]);
                            if (has_bias) v += bias[n];
                            out[(b + i) * N + n] = v;
                        }
                }
            }
        }
    }
    free(xr);
    free(corr);
    free(xs);
    return 0;
}
"""

_AMX_SOURCE = r"""
#if !(defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AMX_INT8__))
#error "the AMX FP4 GEMV needs AVX-512 BW and VBMI and AMX-INT8"
#endif
#if defined(FMT_nvfp4)
#define TP_NJ 4   /* blocks (and scale bytes) per 64-weight chunk: tile columns per activation row */
#else
#define TP_NJ 2
#endif
#define TP_SCH (16 / TP_NJ)   /* chunks whose block scales one 16-byte decode covers */
/* The block of k-quad r of a chunk: a tile row of A holds the chunk's even elements in bytes
   0..31 (byte p: element 2p) and its odd ones in 32..63 (element 2(p - 32) + 1), so bytes
   4r..4r+3 are elements 8r, +2, +4, +6 (r < 8) or 8(r - 8) + 1, +3, +5, +7 */
#define TP_BLK(r) ((((r) & 7) * TP_NJ) / 8)
#define TP_QUAD0(r) ((r) < 8 ? 8 * (r) : 8 * ((r) - 8) + 1)

/* B tiles, one per 64-weight chunk u: 16 k-quads x C = B * TP_NJ int32 columns, column
   b * TP_NJ + j holding activation row b's four codes of k-quad r when r is in block j, else 0
   (block-diagonal: one TDPBSSD leaves every (weight row, activation row, block) dot apart). */
static void tp_amx_btiles(const int8_t *q, int64_t B, int64_t K, int32_t *bt) {
    const int64_t C = B * TP_NJ, U = K / 64;
    memset(bt, 0, (size_t)(U * 16 * C) * sizeof(int32_t));
    for (int64_t u = 0; u < U; ++u)
        for (int64_t b = 0; b < B; ++b) {
            const int8_t *xq = q + b * K + u * 64;
            for (int r = 0; r < 16; ++r) {
                const int e = TP_QUAD0(r);
                const int8_t v[4] = {xq[e], xq[e + 2], xq[e + 4], xq[e + 6]};
                memcpy(bt + (u * 16 + r) * C + b * TP_NJ + TP_BLK(r), v, 4);
            }
        }
}

/* The 16 rows' next 128 weights (chunks u, u + 1) as two A tiles' codes in stage (1024 bytes each,
   row i at 64 i): vpermb of the low and the high nibbles, table 2 * e2m1, and one 512-bit store
   per tile row (two 256-bit halves each: 10 % slower, one thread, L2-resident 256x4096 B=4). */
TP_INLINE void tp_amx_decode(const uint8_t *w, int64_t WR, int64_t n0, int nr, int64_t u, int8_t *stage) {
    const __m512i lut = TP_LUT_SIGNED;
    for (int i = 0; i < nr; ++i) {
        const uint8_t *wp = w + (n0 + i) * WR + u * 32;
        const __m512i v = _mm512_loadu_si512((const void *)wp);
        const __m512i lo = _mm512_permutexvar_epi8(v, lut), hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
        _mm512_store_si512((void *)(stage + 64 * i), _mm512_shuffle_i64x2(lo, hi, 0x44));
        _mm512_store_si512((void *)(stage + 1024 + 64 * i), _mm512_shuffle_i64x2(lo, hi, 0xEE));
    }
}

/* The int32 block dots of chunks u, u + 1 (cbuf: two 16 x 16 tiles) into the rows' float
   accumulators, each lane (b, j) times the row's block scale and the activation group scale;
   the block scales of TP_SCH chunks decoded into sbuf when u starts them. */
TP_INLINE void tp_amx_scale(const uint8_t *scales, int64_t sstride, int64_t n0, int nr, int64_t u,
                            const float *asv, const int32_t *cbuf, float *sbuf, __m512 *acc) {
    if (u % TP_SCH == 0) {
        const int64_t rem = sstride - u * TP_NJ;
        const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1u);
        for (int i = 0; i < nr; ++i) {
            const uint8_t *sp = scales + (n0 + i) * sstride + u * TP_NJ;
            const __m128i sb = _mm_maskz_loadu_epi8(m, sp);
#if defined(FMT_nvfp4)
            const __m512 f = tp_e4m3_words_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(sb), 8));
#else
            const __m512 f = tp_e8m0_dwords_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(sb), 24));
#endif
            _mm512_store_ps(sbuf + 16 * i, f);
        }
    }
    const __m512 a0 = _mm512_load_ps(asv + u * 16), a1 = _mm512_load_ps(asv + u * 16 + 16);
    const int s0 = (int)(u % TP_SCH) * TP_NJ;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
#if defined(FMT_nvfp4)
        const __m512 v0 = _mm512_broadcast_f32x4(_mm_load_ps(sbuf + 16 * i + s0));
        const __m512 v1 = _mm512_broadcast_f32x4(_mm_load_ps(sbuf + 16 * i + s0 + TP_NJ));
#else
        const __m512 v0 = _mm512_broadcast_f32x2(_mm_castpd_ps(_mm_load_sd((const double *)(sbuf + 16 * i + s0))));
        const __m512 v1 = _mm512_broadcast_f32x2(_mm_castpd_ps(_mm_load_sd((const double *)(sbuf + 16 * i + s0 + TP_NJ))));
#endif
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cbuf + 16 * i))), _mm512_mul_ps(v0, a0), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cbuf + 256 + 16 * i))), _mm512_mul_ps(v1, a1), acc[i]);
    }
}

/* Rows [n0, n0 + nr) (nr <= 16) of the weight against every activation row, two chunks (128
   weights) a step, software-pipelined: step t loads its A and B tiles and issues its two
   TDPBSSDs, then (while the tile unit works) decodes step t + 1's weights into the other stage
   buffer and scales step t - 1's dots (stored at the end of step t - 1, in the other cbuf half)
   into the accumulators, then stores its own dots. (C tiles alternating between steps, each
   stored a step later, measured no faster.) Meanwhile the next group's rows [p0, p1), whose
   weights and scales are contiguous, stream into the cache, a step's share of their lines at a
   time: the group's own rows then load from L2, and memory is read in order rather than as
   sixteen interleaved row streams. */
TP_INLINE void tp_amx_rows(const uint8_t *w, const uint8_t *scales, int64_t sstride, int64_t K,
                           const int32_t *bt, const float *asv, int64_t C, int64_t n0, int nr,
                           int64_t p0, int64_t p1, int8_t *stage, int32_t *cbuf, float *sbuf, __m512 *acc) {
    const int64_t WR = K / 2, steps = K / 128;
    const char *pw = (const char *)(w + p0 * WR), *ps = (const char *)(scales + p0 * sstride);
    const int64_t lw = (p1 - p0) * WR / 64, ls = ((p1 - p0) * sstride + 63) / 64;
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    tp_amx_decode(w, WR, n0, nr, 0, stage);
    for (int64_t t = 0; t < steps; ++t) {
        const int64_t u = 2 * t;
        for (int64_t l = t * lw / steps; l < (t + 1) * lw / steps; ++l) _mm_prefetch(pw + 64 * l, _MM_HINT_${hint});
        for (int64_t l = t * ls / steps; l < (t + 1) * ls / steps; ++l) _mm_prefetch(ps + 64 * l, _MM_HINT_${hint});
        const int8_t *st = stage + 2048 * (t & 1);
        int32_t *cb = cbuf + 512 * (t & 1);
        TP_TILE_FENCE();
        _tile_loadd(0, st, 64);
        _tile_loadd(1, st + 1024, 64);
        _tile_loadd(2, bt + u * 16 * C, C * 4);
        _tile_loadd(3, bt + (u + 1) * 16 * C, C * 4);
        _tile_zero(4);
        _tile_zero(5);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 1, 3);
        if (t + 1 < steps) tp_amx_decode(w, WR, n0, nr, u + 2, stage + 2048 * ((t + 1) & 1));
        if (t) tp_amx_scale(scales, sstride, n0, nr, u - 2, asv, cbuf + 512 * ((t - 1) & 1), sbuf, acc);
        _tile_stored(4, cb, 64);
        _tile_stored(5, cb + 256, 64);
        TP_TILE_FENCE();
    }
    tp_amx_scale(scales, sstride, n0, nr, 2 * steps - 2, asv, cbuf + 512 * ((steps - 1) & 1), sbuf, acc);
}

/* Same contract as the other GEMVs (rowscale unused); K must be a multiple of 128 (status 2), the
   OS must grant the AMX tile state (status 6) and B be 1 to 16 / TP_NJ (status 7). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    (void)rowscale;
    if (K <= 0 || K % 128) return 2;
    if (!tp_amx_permit()) return 6;
    if (B < 1 || B * TP_NJ > 16) return 7;
    if (tp_any_nonfinite(x, B * K)) return TP_NONFINITE;
    const float fold = TP_FOLD(pts_d);
    const int64_t sstride = TP_SSTRIDE(K), U = K / 64, LX = K / 32, C = B * TP_NJ;
    int8_t *q = (int8_t *)malloc((size_t)(B * K) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(B * LX) + 64);
    int32_t *bt = (int32_t *)aligned_alloc(64, ((size_t)(U * 16 * C) * 4 + 63) / 64 * 64);
    float *asv = (float *)aligned_alloc(64, (size_t)U * 64);
    if (!q || !xs || !bt || !asv) { free(q); free(xs); free(bt); free(asv); return 3; }
    for (int64_t g = 0; g < B * LX; ++g) xs[g] = tp_quant32_v(x + g * 32, q + g * 32) * fold;
    tp_amx_btiles(q, B, K, bt);
    /* the activation group scale of every column (b, j) of chunk u (0 past column C) */
    for (int64_t u = 0; u < U; ++u)
        for (int c = 0; c < 16; ++c)
            asv[u * 16 + c] = c < C ? xs[(c / TP_NJ) * LX + 2 * u + (2 * (c % TP_NJ)) / TP_NJ] : 0.0f;
    const int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = (tp_chunk_rows(nt, K / 2 + sstride, ${chunk}) + 15) / 16 * 16;
    #pragma omp parallel num_threads(nt)
    {
        tp_tilecfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 6; ++t) cfg.rows[t] = 16;
        cfg.colsb[0] = cfg.colsb[1] = 64;                                  /* A: 16 rows x 64 codes */
        for (int t = 2; t < 6; ++t) cfg.colsb[t] = (uint16_t)(C * 4);   /* B, C */
        TP_TILE_FENCE();
        _tile_loadconfig(&cfg);
        int8_t stage[4096] __attribute__((aligned(64)));
        int32_t cbuf[1024] __attribute__((aligned(64)));
        float sbuf[256] __attribute__((aligned(64)));
        float sums[16] __attribute__((aligned(64)));
        memset(stage, 0, sizeof stage);
        memset(cbuf, 0, sizeof cbuf);
        memset(sbuf, 0, sizeof sbuf);
        __m512 acc[16];
        tp_groups_t gr;
        tp_groups_init(&gr, &tp_next_, N, tp_step_, 16);
        while (tp_groups_next(&gr)) {
            const int64_t n0 = gr.n0;
            const int nr = (int)gr.nr;
            tp_amx_rows(w, scales, sstride, K, bt, asv, C, n0, nr, gr.p0, gr.p1, stage, cbuf, sbuf, acc);
            for (int i = 0; i < nr; ++i) {   /* (rows past nr of a part group: unused) */
                _mm512_store_ps(sums, acc[i]);
                for (int64_t b = 0; b < B; ++b) {
                    float v = 0.0f;
                    for (int j = 0; j < TP_NJ; ++j) v += sums[b * TP_NJ + j];
                    if (has_bias) v += bias[n0 + i];
                    out[b * N + n0 + i] = v;
                }
            }
        }
        _tile_release();
    }
    free(q);
    free(xs);
    free(bt);
    free(asv);
    return 0;
}
"""

FORMATS = ("nvfp4", "mxfp4")

# Prepared activation bytes (all rows) one K block of the lane-block kernel keeps in L1 where they
# exceed TP_XMIN (20 KB; AVX-512 build; see TP_XBYTES in the source).
XBLOCK_BYTES = 8192
# Prepared activation bytes (up to four rows) above which the whole-block kernel runs K in blocks.
WBLOCK_XMIN = 20480


@functools.cache
def gemv_fp4_pair_kernel(
    fmt: str, isa: str, prefetch: int = 512, chunk: int | None = None
) -> GemvKernel:
    """The pair-split int8-activation FP4 GEMV (AVX2; raises NativeError below AVX2). ``chunk``:
    weight bytes per row claim (default :data:`torchport.gemv.kernels.CHUNK_BYTES`; 0 = static)."""
    from torchport.gemv.kernels import CHUNK_BYTES

    if fmt not in FORMATS:
        raise ValueError(f"pair-split FP4 gemv format must be one of {FORMATS}, got {fmt!r}")
    if isa == "scalar":
        raise native.NativeError("the pair-split FP4 GEMV needs AVX2 (isa is 'scalar')")
    chunk = CHUNK_BYTES if chunk is None else chunk
    return GemvKernel(_library(fmt, isa, prefetch, chunk), fmt, twin_isa=isa)


@functools.cache
def gemv_fp4_block_kernel(
    fmt: str,
    isa: str,
    prefetch: int = 4096,
    chunk: int | None = None,
    hint: str = "T0",
    xblock: int | None = None,
) -> GemvKernel:
    """The lane-block int8-activation FP4 GEMV (AVX2; K a multiple of 128; raises NativeError
    below AVX2). ``prefetch``: bytes ahead of the weight stream, ``hint``: its locality
    (:data:`torchport.gemv.kernels.PREFETCH_HINTS`); ``chunk``: weight bytes per row claim
    (default :data:`torchport.gemv.kernels.CHUNK_BYTES`; 0 = static); ``xblock``: bytes of
    prepared activations (all rows) a K block keeps in L1 where they exceed 20 KB (AVX-512 only;
    default :data:`XBLOCK_BYTES`; 0: K in one piece)."""
    chunk, xb = _lane_args("lane-block", fmt, hint, chunk, xblock)
    if isa == "scalar":
        raise native.NativeError("the lane-block FP4 GEMV needs AVX2 (isa is 'scalar')")
    name = f"gemv_fp4blk_{fmt}_{isa}_p{prefetch}{hint}_c{chunk}"
    name += "" if xblock is None else f"_x{xblock}"
    return _build(
        _BLOCK_SOURCE, name, fmt, isa, prefetch=prefetch, chunk=chunk, hint=hint, xblock=xb
    )


def _lane_args(
    kind: str, fmt: str, hint: str, chunk: int | None, xblock: int | None
) -> tuple[int, int]:
    """Check the arguments the lane-block and whole-block kernels share; their claim size and K
    block bytes with the defaults filled in."""
    from torchport.gemv.kernels import CHUNK_BYTES, check_hint

    if fmt not in FORMATS:
        raise ValueError(f"{kind} FP4 gemv format must be one of {FORMATS}, got {fmt!r}")
    if xblock is not None and xblock < 0:
        raise ValueError(f"{kind} FP4 gemv xblock must be >= 0 bytes, got {xblock!r}")
    check_hint(hint)
    return (CHUNK_BYTES if chunk is None else chunk), (XBLOCK_BYTES if xblock is None else xblock)


def _build(source: str, name: str, fmt: str, isa: str, **params: object) -> GemvKernel:
    """An FP4 kernel source with the scheduling prelude, the format's definitions and the
    bf16-in, bf16-out entry, rendered and built."""
    from torchport.gemv.kernels import BF16IO_C, SCHED_C

    src = native.render(SCHED_C + _FORMAT_C + source + BF16IO_C, fmt=fmt, **params)
    return GemvKernel(native.build(src, name=name, isa=isa), fmt, twin_isa=isa)


@functools.cache
def gemv_fp4_wblock_kernel(
    fmt: str,
    isa: str,
    prefetch: int = 4096,
    chunk: int | None = None,
    hint: str = "T0",
    xblock: int | None = None,
    rows: int = 2,
    xmin: int = WBLOCK_XMIN,
    load: int = 512,
) -> GemvKernel:
    """The whole-block int8-activation FP4 GEMV (AVX-512 BW + VNNI; K a multiple of 256; raises
    NativeError elsewhere): every int32 lane of its ``vpdpbusd`` sums holds one 16-element block,
    so a block scale costs one ``cvt``/``mul``/``fma`` per 256 weights and row. ``prefetch``,
    ``hint``, ``chunk`` as :func:`gemv_fp4_block_kernel`; ``rows``: 2 runs weight rows in pairs
    (each activation load serving two) in passes of three or four activation rows, 1 never;
    ``xblock``: bytes of prepared activations a K block keeps in L1 where up to four rows' exceed
    ``xmin`` bytes (default :data:`XBLOCK_BYTES`; 0: K in one piece); ``load``: bits per weight
    load (512: one per line; 256: two and an insert)."""
    chunk, xb = _lane_args("whole-block", fmt, hint, chunk, xblock)
    if rows not in (1, 2):
        raise ValueError(f"whole-block FP4 gemv rows must be 1 or 2, got {rows!r}")
    if load not in (256, 512):
        raise ValueError(f"whole-block FP4 gemv load must be 256 or 512 bits, got {load!r}")
    if isa != "avx512" or not native.cpu_info().has("avx512_vnni"):
        raise native.NativeError(f"the whole-block FP4 GEMV needs AVX-512 VNNI (isa is {isa!r})")
    name = f"gemv_fp4wblk_{fmt}_p{prefetch}{hint}_c{chunk}_x{xb}_m{xmin}_r{rows}_l{load}"
    params = {"prefetch": prefetch, "chunk": chunk, "hint": hint, "xblock": xb, "xmin": xmin}
    return _build(_WBLOCK_SOURCE, name, fmt, isa, rows=rows, load512=int(load == 512), **params)


# Compiler flags of the AMX FP4 GEMV (on top of the avx512 level's): tiles and their int8 dot
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
# Activation rows the AMX kernel takes at most: its tile has 16 int32 columns, one per
# (activation row, block of a 64-weight chunk): four NVFP4 blocks, two MX blocks
AMX_MAX_ROWS = {"nvfp4": 4, "mxfp4": 8}


# Set when an AMX GEMV library fails to compile (a compiler without -mamx-int8): no AMX candidates
# from then on in this process, rather than a failing compile for every new shape
_amx_unbuildable: list[bool] = []


def _amx_int8_missing() -> str | None:
    """Why the AMX FP4 GEMV cannot run here (None: it can)."""
    need = {"avx512vbmi", "amx_tile", "amx_int8"}
    return native.amx_missing(need, unbuildable=bool(_amx_unbuildable), compiler="AMX-INT8")


def amx_int8_ready() -> bool:
    """True when the AMX FP4 GEMV can run here: the avx512 ISA level in force on a CPU with
    AVX-512 VBMI, AMX-TILE and AMX-INT8, the OS granting the tile state, and no AMX GEMV
    library having failed to compile in this process."""
    return _amx_int8_missing() is None


@functools.cache
def gemv_fp4_amx_kernel(fmt: str, hint: str = "T1", chunk: int | None = None) -> GemvKernel:
    """The AMX-INT8 FP4 GEMV for one to :data:`AMX_MAX_ROWS` activation rows (K a multiple of
    128; raises NativeError, naming what is missing, where :func:`amx_int8_ready` is false).

    Per 16 weight rows and 128 weights the decoded int8 weights (``2·e2m1``: a ``vpermb`` of
    the low and of the high nibbles, a ``vshufi64x2`` and a store per tile row and 64 weights)
    are two A tiles and the activations block-diagonal B tiles, so one ``tdpbssd`` per 64
    weights gives every (weight row, activation row, block) dot product; per 64 weights and row a
    ``cvt``, ``mul`` and ``fma`` then scale them for all activation rows at once. There is no
    prefetch distance: while a group of 16 rows runs, the next group's rows (contiguous in
    memory) are prefetched with locality ``hint`` (``T1``: into L2; ``T0``: every level).
    ``chunk``: weight bytes per row claim as :func:`gemv_fp4_block_kernel` (rounded up to 16
    rows; 0 = one static split)."""
    from torchport.gemv.kernels import BF16IO_C, CHUNK_BYTES, SCHED_C, build_amx, check_hint
    from torchport.native.prelude import AMX_TILE_C

    if fmt not in FORMATS:
        raise ValueError(f"AMX FP4 gemv format must be one of {FORMATS}, got {fmt!r}")
    check_hint(hint)
    missing = _amx_int8_missing()
    if missing is not None:
        raise native.NativeError(f"the AMX FP4 GEMV needs {missing}")
    chunk = CHUNK_BYTES if chunk is None else chunk
    src = native.render(
        SCHED_C + AMX_TILE_C + _FORMAT_C + _AMX_SOURCE + BF16IO_C, fmt=fmt, hint=hint, chunk=chunk
    )
    lib = build_amx(src, f"gemv_fp4amx_{fmt}_{hint}_c{chunk}", AMX_FLAGS, _amx_unbuildable)
    return GemvKernel(lib, fmt, twin_isa="avx512")


@functools.cache
def _library(fmt: str, isa: str, prefetch: int, chunk: int) -> ctypes.CDLL:
    from torchport.gemv.kernels import BF16IO_C, SCHED_C

    src = native.render(
        SCHED_C + _FORMAT_C + _SOURCE + BF16IO_C, fmt=fmt, prefetch=prefetch, chunk=chunk
    )
    return native.build(src, name=f"gemv_fp4pair_{fmt}_{isa}_p{prefetch}_c{chunk}", isa=isa)


@functools.cache
def gemv_fp4_prepped_kernel(fmt: str, isa: str) -> Kernel:
    """Entry ``tp_gemv_prepped``: FP4 weights × activations already quantized to FP4."""
    from torchport.gemv.kernels import CHUNK_BYTES

    if fmt not in FORMATS:
        raise ValueError(f"pair-split FP4 gemv format must be one of {FORMATS}, got {fmt!r}")
    if isa == "scalar":
        raise native.NativeError("the pair-split FP4 GEMV needs AVX2 (isa is 'scalar')")
    f32 = (torch.float32,)
    return Kernel(
        _library(fmt, isa, 512, CHUNK_BYTES),
        "tp_gemv_prepped",
        [
            TensorArg("xr", (torch.int8,), ndim=2),
            TensorArg("corr", (torch.int32,), ndim=2),
            TensorArg("xsv", f32, ndim=2),
            IntArg("B"),
            IntArg("K"),
            TensorArg("w", (torch.uint8,), ndim=2),
            TensorArg("scales", (torch.uint8,), contiguous=True),
            TensorArg("bias", f32),
            IntArg("has_bias"),
            TensorArg("out", f32, ndim=2),
            IntArg("N"),
            IntArg("nthreads"),
        ],
    )


_I8_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8
)


def prepare_fp4_activations(
    codes: torch.Tensor, lane_scale: torch.Tensor, weight_fold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prepared activations for :func:`gemv_fp4_prepped_kernel` from FP4 codes ``[B, K]`` (uint8
    0..15) and the activation scale of every 8-element lane ``[B, K/8]`` (float32).

    Returns int8 ``2·e2m1`` values in pair-split order (per 64-chunk: even elements, then odd),
    int32 corrections ``12·Σ`` per lane and float32 lane scales ``0.5 · lane_scale · weight_fold``.
    """
    b, k = codes.shape
    vals = _I8_VALUES[codes.long()]
    xr = vals.reshape(b, k // 64, 32, 2).transpose(2, 3).reshape(b, k).contiguous()
    corr = (vals.reshape(b, k // 8, 8).sum(-1, dtype=torch.int32) * 12).to(torch.int32)
    xsv = (lane_scale.float() * (0.5 * weight_fold)).contiguous()
    return xr, corr.contiguous(), xsv
