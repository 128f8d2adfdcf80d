"""bfloat16 and E4M3 decode GEMV on the AVX512-BF16 pair dot (``vdpbf16ps``).

The float kernel of :mod:`torchport.gemv.kernels` widens every bf16 weight to float32 (a 16-bit
zero-extend and shift per eight weights) before its FMAs, so one core decodes slower than it can
read. ``vdpbf16ps`` multiplies 32 bf16 pairs and adds each pair's two products to a float32 lane:
one instruction per 32 weights, the weights used as loaded.

The activations arrive as float32 (the GEMV's contract). Where every one of them is a bf16 value
(activations of a bf16 model, widened by the caller: the low 16 bits of each are zero), they are
narrowed back once per call, exactly, and meet the weights in ``vdpbf16ps``: the product of two
bf16 values is exact in float32 (unless it falls below ``2⁻¹²⁶``, see below) and the row sums
are float32 accumulations, as in the float kernel, which accumulates the same products; only the
summation order differs. Other float32 activations would need two or three bf16 parts each for
exact products (measured: three parts ran at half the widening kernel's rate, the parts not
staying in L1 beside the stream), so the kernel hands those to the float kernel itself (its
source is compiled into this library with the entry renamed: the one-row loop, 512 bytes of T0
prefetch, :data:`FLOAT_PREFETCH`): the same results as :func:`torchport.gemv.kernels.gemv_kernel`
``("bf16", isa, 512, rows4=0)``, bit for bit. The tuner (:func:`torchport.gemv.ops.plan_for`)
times the kernels on bf16-valued activations, the case of a bf16 model; float32 activations with
bf16 weights reach the float kernel through it when it won that tuning.

``vdpbf16ps`` treats subnormal inputs as zero and flushes subnormal results whatever MXCSR says:
weights or activations below ``2⁻¹²⁶`` (``≈ 1.2e-38``) in magnitude, and products or partial
sums that fall below it, count as zero. Each flush loses less than ``2⁻¹²⁶``, so a row sum of
``K`` products is off by less than about ``K · 2⁻¹²⁶`` beyond float32 rounding: the tests'
absolute term (``1e-30``) bounds it, where the float kernel carries such values as float32
subnormals.

Weights stream as two 256-bit loads per 64-byte line (one 512-bit load per line streamed from
DRAM at about half the rate in the FP8 kernel's measurements), prefetched ``prefetch`` bytes
ahead with locality ``hint`` (default ``prefetch=0``: the hint touches the line being loaded,
no look-ahead; the hardware prefetchers keep up with a kernel this light, see
:data:`torchport.gemv.ops.DP_PREFETCH`); a K that is not a multiple of 32 ends with a masked
load (the narrowed activations are zero-padded to a multiple of 32). Threads claim row ranges as
the other GEMV kernels do (:data:`torchport.gemv.kernels.CHUNK_BYTES`). From four activation rows
two consecutive weight rows share every activation load (the same operations per row in the same
order: the same bits); there four bf16 activation rows fill L1 (8 KB each at K = 4096), and the
shared loads halve what is re-read from L2: 11008×4096 from DRAM, interleaved medians of 11 (load
2-3), ``T0``/0 prefetch B=4 one thread 9.93 → 7.15 ms, two threads 5.39 → 4.12 ms, B=8 14.4 →
9.7 / 7.4 → 5.3 ms; ``NTA``/2048 B=4 10.1 → 9.1 / 5.3 → 5.0 ms; B=1 unchanged. For two to four
rows whose narrowed activations exceed :data:`XBLOCK_BYTES` (16 KB, half of L1), eight weight
rows at a time run K in blocks that keep a block of every activation row in L1 instead, the
accumulators parked between blocks (the same dot products in the same order: the same bits),
the next eight rows prefetched into L2: B=4 one thread 7.6 (two-row loop) → 4.4–4.7 ms, two
threads 4.2 → 3.7–3.8 ms (interleaved medians of 9, load 1.6–1.8); at B=8 the blocks measured
no better than the two-row loop (one thread 9.4–9.8 vs 9.6 ms, two threads 5.9–6.4 vs 5.4).
The blocks run their weight rows in pairs too, every activation load serving two rows (a row
alone when the group's count is odd; per row the same operations: the same bits). With one
weight row per load the K loop issued a 512-bit activation load per ``vdpbf16ps``: a step of
64 weights against four rows ran at about 2.8 G ``vdpbf16ps``/s on one core (the instruction
alone: 3.65), and the kernel below that from DRAM. Kernels alone, from DRAM, interleaved medians
of 22, two threads (load 1.2, ``sum`` 35–59 GB/s; one weight copy per round, old build first, so
the later kernels read part of it from L3: absolute times low, 4096² most), one row per load →
pairs: E4M3 B=4 11008×4096
2.10 → 1.54 ms (NTA 2048; T0 2.15 → 1.56), 4096×11008 1.92 → 1.57, 4096×4096 0.74 → 0.52, B=2
11008×4096 1.24 → 1.13, B=1 4096×11008 (blocks from one row) 1.41 → 1.16; bf16 B=4 11008×4096
3.24 → 2.54, 4096×11008 3.92 → 3.27. K in one piece keeps one weight row per load below four
activation rows (:data:`PAIR_MIN_B`). The activations are narrowed 16 at a time (``vpmovdw``):
the call's fixed cost at B=4 fell from 20 to 4.5 µs (K = 4096) and from 50 to 7 µs (K = 11008). Needs ``isa="avx512"``
on a CPU with AVX512-BF16; the caller (:func:`torchport.gemv.ops.candidates`) offers it only
there. Returns status 3 when the narrowed activations (``2 · B · K`` bytes) cannot be allocated.

**E4M3 weights** (``weights="fp8_e4m3"``): the same kernel, each 64-byte line of codes decoded to
two bf16 vectors in five instructions (two ``vpermi2b`` look up each code's high and low bf16
byte in 128-entry tables, a ``vpternlogd`` adds the sign bit, two byte unpacks pair the bytes
into words), where the shift decode of :mod:`torchport.gemv.fp8_kernel` spends eleven per line
to float32 and then twice the FMAs. Every E4M3 value, subnormal codes included, is a normal
bf16 number, so the decode is exact and ``vdpbf16ps``'s flushing only touches activations and
products below ``2⁻¹²⁶`` (the bf16 weights' bound above). The unpacks work within 128-bit lanes:
word ``8L + t`` of the first vector is element ``16L + t`` of the line, of the second ``16L + 8
+ t``; the narrowed activations are stored in that order. K's last partial line is one masked
load (zero codes decode to zero). Rows are scaled by the row scale, then the bias is added, as
in the float kernel. A finite activation of ``2¹¹⁹`` or more in magnitude, whose product with an
E4M3 code (up to 448) could overflow where its product with the dequantized weight does not,
hands the call to the float kernel (:data:`torchport.gemv.kernels.NONFINITE_STATUS`), which
rescales such activation rows. Only bf16-valued activations: others return status 4 (the tuner
offers this kernel only for bfloat16 activation tensors, :func:`torchport.gemv.ops.candidates`),
except in the AMX build (below), which splits float32 ones. Kernels
alone, 11008×4096 from DRAM, bf16-valued activations, interleaved medians of 15 (load 3-4,
helper running): B=1 two threads 1.14 ms (NTA 2048) against the shift kernel's 1.31, one thread
1.46 against 2.60; B=4 two threads 2.07 against 3.18 (the shift kernel's AVX2 build, what B > 1
takes), one thread 3.73 against 6.10. E4M3 weights run K in blocks from one activation row on
(bf16 weights from two): at K = 11008 a bf16 activation row (22 KB) shared L1 with the weight
stream and was re-read from L2; 4096×11008 B=1 one thread 3.2–4.0 → 1.9–2.1 ms, two threads
1.93–2.39 → 1.84–2.16 (same bits; bf16 weights measured 6–8 % slower in blocks on two threads).

**AMX build** (``amx=True``, AMX-BF16): per 16 weight rows and 64 weights the two bf16 weight
vectors of the decode are two A tiles, the narrowed activations B tiles with one column per
activation row, and ``tdpbf16ps`` accumulates a C tile over all of K (1 to 16 rows). With E4M3
weights it also serves float32 activations that are not bf16 values: each is split into three
bf16 parts ``h + m + l`` equal to it exactly (``h`` its rounding to bf16, ``m`` the rounding of
``x - h``, which float32 holds exactly, and ``l = x - h - m``, at most eight significant bits:
exact), each part a column of its own, so a weight's three products are exact and the row's
three float32 sums add up (smallest first) to what the float kernel's one product per weight
gives within the same float32 bound; one to ten rows (up to 16 columns in one C tile, the rest
in a second), status 4 beyond. Parts below ``2⁻¹²⁶`` flush, as the products do (an activation
under about ``2⁻¹¹⁸`` may lose its low part: less than ``2⁻¹²⁶``). Activations that
are not finite or reach ``2¹¹⁹`` in magnitude (where a part times an E4M3 weight, up to 448,
could overflow where the float kernel's product does not, or the rounding itself overflow) return
:data:`torchport.gemv.kernels.NONFINITE_STATUS`: the format's float kernel takes the call.
"""

from __future__ import annotations

import functools

from torchport import native
from torchport.gemm.templates import AMX_FLAGS
from torchport.gemv.kernels import GemvKernel, build_amx
from torchport.native.prelude import AMX_TILE_C

_SOURCE = r"""
#include <stdlib.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TP_W_${wfmt} 1
#if defined(TP_W_fp8_e4m3)
/* E4M3 weights: one byte each, decoded per 64-byte line to two bf16 vectors (see tp_wstep) */
typedef uint8_t tp_wt;
#define TP_WB 1    /* bytes per weight */
#define TP_KP 64   /* narrowed activation rows are padded to a multiple of this */
#else
typedef uint16_t tp_wt;
#define TP_WB 2
#define TP_KP 32
#endif

/* Where element k of an activation row goes in the narrowed row: E4M3 weights in the order tp_wstep
   leaves a line's weights in (per 64 elements, bf16 word 8 L + t of the first vector is element
   16 L + t, of the second 16 L + 8 + t, L = 0..3, t = 0..7); bf16 weights as they are. */
TP_INLINE int64_t tp_xpos(int64_t k) {
#if defined(TP_W_fp8_e4m3)
    const int64_t j = k % 64;
    return k - j + (j % 16 < 8 ? 0 : 32) + (j / 16) * 8 + j % 8;
#else
    return k;
#endif
}
/* Sixteen bf16 activations, elements k + 16 L .. k + 16 L + 15 (k a multiple of 64), into xh at
   their tp_xpos places. */
TP_INLINE void tp_xstore16(uint16_t *xh, int64_t k, int L, __m256i h) {
#if defined(TP_W_fp8_e4m3)
    _mm_storeu_si128((__m128i *)(xh + k + 8 * L), _mm256_castsi256_si128(h));
    _mm_storeu_si128((__m128i *)(xh + k + 32 + 8 * L), _mm256_extracti128_si256(h, 1));
#else
    _mm256_storeu_si256((__m256i *)(xh + k + 16 * L), h);
#endif
}

/* Row x (K floats) as bf16 values into xh[0..KP) at their tp_xpos places (zero past K) if every
   element is one (a bf16 activation widened to float32); returns 0 (xh then unusable) as soon as
   one is not. */
static int tp_bf16_row(const float *x, int64_t K, int64_t KP, uint16_t *xh) {
    /* whole groups of 64, 16 floats at a time: their high halves, narrowed by vpmovdw, unless a
       low half is not zero */
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int L = 0; L < 4; ++L) {
            const __m512i v = _mm512_loadu_si512((const void *)(x + k + 16 * L));
            if (_mm512_test_epi32_mask(v, _mm512_set1_epi32(0xFFFF))) return 0;
            tp_xstore16(xh, k, L, _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
        }
    for (; k < KP; ++k) {
        float v = k < K ? x[k] : 0.0f;
        uint32_t u;
        memcpy(&u, &v, 4);
        if (u & 0xFFFFu) return 0;
        xh[tp_xpos(k)] = (uint16_t)(u >> 16);
    }
    return 1;
}

/* Row x (K bf16 values) into xh[0..KP) at their tp_xpos places (zero past K). */
static void tp_bf16_copy(const uint16_t *x, int64_t K, int64_t KP, uint16_t *xh) {
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int L = 0; L < 4; ++L) tp_xstore16(xh, k, L, _mm256_loadu_si256((const __m256i *)(x + k + 16 * L)));
    for (; k < KP; ++k) xh[tp_xpos(k)] = k < K ? x[k] : 0;
}

#if defined(TP_W_fp8_e4m3)
/* 1 if some of the n narrowed (bf16) activations is finite and at least 2^119 in magnitude, else
   0: its product with an E4M3 weight (up to 448 < 2^9) could overflow where x times the
   dequantized weight does not; the float kernel, which rescales such activation rows, takes them
   (an infinity or NaN gives the IEEE results here as there) */
static int tp_any_big16(const uint16_t *h, int64_t n) {
    int m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const unsigned a = h[i] & 0x7fffu;
        m |= a >= 0x7b00u && a < 0x7f80u;
    }
    return m;
}
/* E4M3 magnitude (7 bits) -> the high byte (bits 14..8; the sign comes from the code) and the low
   byte of its bf16 value, as 128-byte tables for vpermi2b: every E4M3 value, subnormals included,
   is a normal bf16 number (exact); the NaN codes decode as the float kernel's table has them. */
static const uint8_t TP_E4M3_BF16_HI[128] = { ${e4m3_hi} };
static const uint8_t TP_E4M3_BF16_LO[128] = { ${e4m3_lo} };
/* Sixty-four E4M3 weights (one 64-byte line, two 256-bit loads) -> two bf16 vectors: two vpermi2b
   look up each code's high and low bf16 byte, one vpternlogd puts the sign into the high byte,
   and the byte unpacks pair them into words (within 128-bit lanes: the order tp_bf16_row gives
   the activations). Five instructions per 64 weights. */
TP_INLINE void tp_wdecode(__m512i v, __m512bh *w0, __m512bh *w1) {
    const __m512i th0 = _mm512_loadu_si512((const void *)TP_E4M3_BF16_HI);
    const __m512i th1 = _mm512_loadu_si512((const void *)(TP_E4M3_BF16_HI + 64));
    const __m512i tl0 = _mm512_loadu_si512((const void *)TP_E4M3_BF16_LO);
    const __m512i tl1 = _mm512_loadu_si512((const void *)(TP_E4M3_BF16_LO + 64));
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(th0, v, th1), v,
                                                 _mm512_set1_epi8((char)0x80), 0xF8);  /* a | (b & c) */
    const __m512i lo = _mm512_permutex2var_epi8(tl0, v, tl1);
    *w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}
TP_INLINE void tp_wstep(const uint8_t *w, int64_t k, __m512bh *w0, __m512bh *w1) {
    tp_wdecode(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + k))),
                                  _mm256_loadu_si256((const __m256i *)(w + k + 32)), 1), w0, w1);
}
/* The last K - k (< 64) weights of a row, zero beyond */
TP_INLINE void tp_wtail(const uint8_t *w, int64_t k, int64_t K, __m512bh *w0, __m512bh *w1) {
    tp_wdecode(_mm512_maskz_loadu_epi8((__mmask64)((~0ULL) >> (64 - (K - k))), w + k), w0, w1);
}
#else
/* The 32 bf16 weights from element k (one 64-byte line as two 256-bit loads). */
TP_INLINE __m512bh tp_wline(const uint16_t *w, int64_t k) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + k))),
                                         _mm256_loadu_si256((const __m256i *)(w + k + 16)), 1);
    return (__m512bh)v;
}
/* The 64 weights from element k as two vectors (two lines) */
TP_INLINE void tp_wstep(const uint16_t *w, int64_t k, __m512bh *w0, __m512bh *w1) {
    *w0 = tp_wline(w, k);
    *w1 = tp_wline(w, k + 32);
}
#endif

/* R (1 or 2) consecutive weight rows' two-line steps over k0 <= k < k1 (multiples of 64) against
   NB (<= 4) bf16 activation rows (row b at xp + b * K32), every activation load serving the R
   weight rows; weight row r at w + r K, its accumulators (NB x 2 vectors) at accp + 2 NB r, kept
   there between calls, so a row's sums do not depend on whether K runs in one piece (tp_rows_dp)
   or in blocks, nor on R (per row the same operations in the same order: the same bits). At each
   step prefetches each row's pfa + TP_WB k (each line of the step: two for bf16, one for E4M3)
   with the kernel's hint (the row's own stream ahead) unless pfa is NULL, and for the first pfr
   rows the lines of pfw + r K (the rows the next row group reads) into L2. */
TP_INLINE void tp_dp_part(const uint16_t *xp, int64_t K32, const tp_wt *w, int64_t K, const char *pfa,
                          const tp_wt *pfw, int pfr, int64_t k0, int64_t k1, __m512 *accp,
                          const int NB, const int R) {
    __m512 acc[2][4][2];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            acc[r][b][0] = accp[2 * (NB * r + b)];
            acc[r][b][1] = accp[2 * (NB * r + b) + 1];
        }
    for (int64_t k = k0; k < k1; k += 64) {
        for (int r = 0; r < R; ++r)
            for (int l = 0; l < TP_WB; ++l) {  /* the step's TP_WB lines */
                if (pfa) _mm_prefetch(pfa + TP_WB * (r * K + k) + 64 * l, _MM_HINT_${hint});
                if (r < pfr) _mm_prefetch((const char *)(pfw + r * K + k) + 64 * l, _MM_HINT_T1);
            }
        __m512bh wv[2][2];
        for (int r = 0; r < R; ++r) tp_wstep(w + r * K, k, &wv[r][0], &wv[r][1]);
        for (int b = 0; b < NB; ++b)
            for (int j = 0; j < 2; ++j) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k + 32 * j));
                for (int r = 0; r < R; ++r) acc[r][b][j] = _mm512_dpbf16_ps(acc[r][b][j], wv[r][j], xv);
            }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            accp[2 * (NB * r + b)] = acc[r][b][0];
            accp[2 * (NB * r + b) + 1] = acc[r][b][1];
        }
}

/* The end of a row from k = K / 64 * 64, then the row sums. bf16: a last whole 32-weight line
   (prefetching pfa + 2 k unless NULL) and the masked K % 32 tail, both into accumulator 0.
   E4M3: one masked line of the last K % 64 weights into both accumulators. */
TP_INLINE void tp_dp_rest(const uint16_t *xp, int64_t K32, const tp_wt *w, const char *pfa, int64_t K,
                          const __m512 *accp, float *out, int64_t ldo, const int NB) {
    __m512 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = accp[2 * b]; acc[b][1] = accp[2 * b + 1]; }
    int64_t k = K / 64 * 64;
#if defined(TP_W_fp8_e4m3)
    (void)pfa;
    if (k < K) {  /* the masked tail line, into both accumulators */
        __m512bh w0, w1;
        tp_wtail(w, k, K, &w0, &w1);
        for (int b = 0; b < NB; ++b) {
            acc[b][0] = _mm512_dpbf16_ps(acc[b][0], w0, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k)));
            acc[b][1] = _mm512_dpbf16_ps(acc[b][1], w1, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k + 32)));
        }
    }
#else
    if (k + 32 <= K) {
        if (pfa) _mm_prefetch(pfa + 2 * k, _MM_HINT_${hint});
        const __m512bh w0 = tp_wline(w, k);
        for (int b = 0; b < NB; ++b)
            acc[b][0] = _mm512_dpbf16_ps(acc[b][0], w0, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k)));
        k += 32;
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (int b = 0; b < NB; ++b)
            acc[b][0] = _mm512_dpbf16_ps(acc[b][0], w0, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k)));
    }
#endif
    for (int b = 0; b < NB; ++b) out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
}

/* F(NB, R) for run-time nb (1..4) and r (1..2), with NB and R compile-time constants (each pair
   its own inlined loop) */
#define TP_NB_R(nb, r, F) do {                                                                      \
        switch ((nb) * 2 + (r) - 1) {                                                              \
            case 2: F(1, 1); break;                                                                \
            case 3: F(1, 2); break;                                                                \
            case 4: F(2, 1); break;                                                                \
            case 5: F(2, 2); break;                                                                \
            case 6: F(3, 1); break;                                                                \
            case 7: F(3, 2); break;                                                                \
            case 8: F(4, 1); break;                                                                \
            default: F(4, 2); break;                                                               \
        }                                                                                          \
    } while (0)

/* R (1 or 2) consecutive weight rows against NB (<= 4) bf16 activation rows (row b at xp + b *
   K32), K in one piece, every activation load serving the R rows; row r's sums to out + r. */
TP_INLINE void tp_rows_dp(const uint16_t *xp, int64_t K32, const tp_wt *w, int64_t K, float *out,
                          int64_t ldo, const int NB, const int R) {
    __m512 acc[16];
    for (int i = 0; i < 2 * NB * R; ++i) acc[i] = _mm512_setzero_ps();
    const char *pfa = (const char *)w + ${dp_prefetch};
    tp_dp_part(xp, K32, w, K, pfa, NULL, 0, 0, K / 64 * 64, acc, NB, R);
    for (int r = 0; r < R; ++r)
        tp_dp_rest(xp, K32, w + r * K, pfa + TP_WB * r * K, K, acc + 2 * NB * r, out + r, ldo, NB);
}

/* K blocks (two to four activation rows; E4M3 weights from one): where the narrowed rows
   (2 B K32 bytes) exceed TP_XBYTES, TP_KR weight rows at a time run K in blocks of TP_XBYTES / (2 B) activations (a block
   of every row stays in L1 while the TP_KR rows use it), their accumulators parked between
   blocks, and the next TP_KR rows' lines are prefetched into L2 as the current ones are read. */
#define TP_KR 8
#define TP_XBYTES ${xblock}
/* E4M3 weights take the blocks from one activation row on: a bf16 row beyond TP_XBYTES (K > 4096
   with the default 8 KB; the figures below were measured with 16 KB blocks) shares L1 with a weight
   stream that evicts it. 4096x11008 from DRAM, bf16-valued activations,
   interleaved medians of 25, two runs (load 2.7-3.6): one thread 3.20 / 4.04 -> 1.93 / 2.12 ms,
   two threads 1.93 / 2.39 -> 1.84 / 2.16. bf16 weights keep one piece at B = 1: two threads were
   6-8 % slower in blocks there (3.44 / 4.14 -> 3.73 / 4.40 ms; one thread 5.30 / 6.63 -> 4.55 /
   5.79), the eight interleaved 16 KB row pieces streaming worse than one row. */
#if defined(TP_W_fp8_e4m3)
#define TP_KB_MIN_B 1
#else
#define TP_KB_MIN_B 2
#endif

#define TP_AMX ${amx}
#if TP_AMX
/* AMX-BF16 (TDPBF16PS) for several activation rows: per 16 weight rows and 64 weights the two
   bf16 weight vectors of tp_wstep (E4M3 decoded; bf16 as loaded) of each row are two A tiles'
   rows, and the narrowed activations (already in tp_wstep's order) are B tiles of 16 k-pairs x B
   columns, built once per call: tile c, row p, column b holds activation row b's pair
   (2 p, 2 p + 1) of its 32-element chunk c. The sums stay in one C tile over all of K: no
   per-step work beyond the decode. Float32 activations of E4M3 weights split into three bf16
   rows each (tp_bf16_split3) are three columns per row, from 17 columns on in a second set of
   B tiles and a second C tile. */

/* Sixteen rows of sixteen 32-bit values -> r[i] = value i of every row (lane b: row b): pairs
   of rows interleaved by 32 then 64 bits, then 128-bit lanes gathered in two steps. */
TP_INLINE void tp_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   /* u[4 g + c], 128-bit lane L: rows 4 g..4 g + 3, value 4 L + c */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {   /* t[c]: values c and 8 + c of rows 0-7, t[4 + c]: 4 + c, 12 + c */
        t[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; ++c) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
    }
}

/* The B tiles of columns [c0, c0 + nc) (nc <= 16): bt[c][p][b] = narrowed row c0 + b's 32-bit
   pair 16 c + p (K32 / 32 chunks), sixteen pairs of every row at a time through a transpose
   (the scalar copy took 103 us for sixteen rows of K = 11008, this 8). */
static void tp_amx_btiles(const uint16_t *xp, int64_t c0, int64_t nc, int64_t K32, uint32_t *bt) {
    const int64_t Q = K32 / 2;   /* pairs per narrowed row: a multiple of 16 (K32 of 32) */
    const uint32_t *xr = (const uint32_t *)(xp + c0 * K32);
    const __mmask16 m = (__mmask16)((1u << nc) - 1u);
    for (int64_t q = 0; q < Q; q += 16) {
        __m512i r[16];
        for (int b = 0; b < 16; ++b)
            r[b] = b < nc ? _mm512_loadu_si512((const void *)(xr + b * Q + q)) : _mm512_setzero_si512();
        tp_transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_mask_storeu_epi32((void *)(bt + (q + i) * nc), m, r[i]);
    }
}

#if defined(TP_W_fp8_e4m3)
/* 1 if some x[i] is not finite or at least 2^119 in magnitude, else 0: there h (x rounded up
   to bf16) times an E4M3 weight (up to 448 < 2^9) could overflow where x times it does not */
static int tp_any_big(const float *x, int64_t n) {
    const __m512 lim = _mm512_set1_ps(0x1p119f);
    __mmask16 m = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + i)), lim, _CMP_NLT_UQ);
    for (; i < n; ++i)
        if (!(fabsf(x[i]) < 0x1p119f)) return 1;
    return m != 0;
}
/* Sixteen floats (each finite, below 2^119) -> their three bf16 parts h, m, l (p[0..2]):
   h = v rounded to bf16 (vcvtneps2bf16: to nearest even; subnormal inputs and results flushed),
   m = the rounding of v - h (exact in float32), l = v - h - m (exact, at most 8 significant bits). */
TP_INLINE void tp_bf16_parts(__m512 v, __m256i p[3]) {
#define TP_WIDEN(h) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    p[0] = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 r = _mm512_sub_ps(v, TP_WIDEN(p[0]));
    p[1] = (__m256i)_mm512_cvtneps_pbh(r);
    p[2] = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r, TP_WIDEN(p[1])));
#undef TP_WIDEN
}
/* Row x (K finite floats, each below 2^119 in magnitude) as three bf16 rows h, m, l at their
   tp_xpos places (zero past K) with h + m + l = x element by element, exactly: h rounds x to 8
   significant bits, x - h (exact in float32) has at most 16 and m rounds it to 8, x - h - m
   (exact) has at most 8 and is l; below 2^-126 a part is flushed (less than 2^-126 lost, as the
   pair dot flushes such products). */
static void tp_bf16_split3(const float *x, int64_t K, int64_t KP, uint16_t *h, uint16_t *m, uint16_t *l) {
    int64_t k = 0;
    __m256i p[3];
    for (; k + 64 <= K; k += 64)
        for (int L = 0; L < 4; ++L) {
            tp_bf16_parts(_mm512_loadu_ps(x + k + 16 * L), p);
            tp_xstore16(h, k, L, p[0]);
            tp_xstore16(m, k, L, p[1]);
            tp_xstore16(l, k, L, p[2]);
        }
    for (; k < KP; k += 16) {   /* the last partial group, 16 at a time, zero past K */
        float t[16] __attribute__((aligned(64)));
        uint16_t q[3][16];
        for (int j = 0; j < 16; ++j) t[j] = k + j < K ? x[k + j] : 0.0f;
        tp_bf16_parts(_mm512_load_ps(t), p);
        for (int i = 0; i < 3; ++i) _mm256_storeu_si256((__m256i *)q[i], p[i]);
        for (int j = 0; j < 16 && k + j < KP; ++j) {
            h[tp_xpos(k + j)] = q[0][j];
            m[tp_xpos(k + j)] = q[1][j];
            l[tp_xpos(k + j)] = q[2][j];
        }
    }
}
#endif

/* Rows [n0, n0 + nr) (nr <= 16) against every column: their float sums into sums (16 rows x 16
   per C tile: row i's first c0 sums at 16 i, its c1 next ones, if any, at 256 + 16 i). Columns
   [0, c0) (c0 <= 16) come from B tiles bt, columns [16, 16 + c1) (c1 <= 16; 0: none) from bt1,
   each tile's sums in a C tile of its own. Double-buffered stage: step s's weights decode into
   half s & 1 while the tile unit still reads the other half's; the next group's rows [p0, p1)
   (contiguous) are prefetched meanwhile, a step's share at a time. */
TP_INLINE void tp_amx_dp_rows(const tp_wt *w, int64_t K, const uint32_t *bt, int64_t c0,
                              const uint32_t *bt1, int64_t c1, int64_t n0, int nr, int64_t p0,
                              int64_t p1, uint16_t *stage, float *sums) {
    const int64_t steps = (K + 63) / 64, K64 = K / 64 * 64;
    const char *pw = (const char *)(w + p0 * K);
    const int64_t lw = (p1 - p0) * K * TP_WB / 64;
    _tile_zero(4);
    if (c1) _tile_zero(7);
    for (int64_t s = 0; s < steps; ++s) {
        const int64_t k = 64 * s;
        for (int64_t l = s * lw / steps; l < (s + 1) * lw / steps; ++l) _mm_prefetch(pw + 64 * l, _MM_HINT_${hint});
        uint16_t *st = stage + 1024 * (s & 1);
        for (int i = 0; i < nr; ++i) {
            const tp_wt *wr = w + (n0 + i) * K;
            __m512bh w0, w1;
            if (k < K64) {
                tp_wstep(wr, k, &w0, &w1);
            } else {
#if defined(TP_W_fp8_e4m3)
                tp_wtail(wr, k, K, &w0, &w1);
#else
                const int64_t r0 = K - k < 32 ? K - k : 32, r1 = K - k - r0;
                w0 = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)(r0 >= 32 ? ~0u : (1u << r0) - 1u), wr + k);
                w1 = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)(r1 >= 32 ? ~0u : (1u << r1) - 1u), wr + k + 32);
#endif
            }
            _mm512_store_si512((void *)(st + 32 * i), (__m512i)w0);
            _mm512_store_si512((void *)(st + 512 + 32 * i), (__m512i)w1);
        }
        TP_TILE_FENCE();
        _tile_loadd(0, st, 64);
        _tile_loadd(1, st + 512, 64);
        _tile_loadd(2, bt + (2 * s) * 16 * c0, c0 * 4);
        _tile_loadd(3, bt + (2 * s + 1) * 16 * c0, c0 * 4);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(4, 1, 3);
        if (c1) {
            _tile_loadd(5, bt1 + (2 * s) * 16 * c1, c1 * 4);
            _tile_loadd(6, bt1 + (2 * s + 1) * 16 * c1, c1 * 4);
            _tile_dpbf16ps(7, 0, 5);
            _tile_dpbf16ps(7, 1, 6);
        }
    }
    _tile_stored(4, sums, 64);
    if (c1) _tile_stored(7, sums + 256, 64);
    TP_TILE_FENCE();
}
#endif

/* Same contract as the float kernel's GEMV of this weight format (bf16: tp_gemv_float above, the
   float kernel itself, serves activations that are not all bf16 values; E4M3: status 4 for them,
   the caller takes another kernel). E4M3 rows are scaled by rowscale[n] before the bias. */
static int tp_gemv_io(const float *x, const uint16_t *xh, int64_t B, int64_t K, const tp_wt *w,
                      const uint8_t *scales, const float *rowscale, double pts_d, const float *bias,
                      int64_t has_bias, float *out, uint16_t *outh, int64_t N, int64_t nthreads) {
    const int64_t K32 = (K + TP_KP - 1) / TP_KP * TP_KP;   /* narrowed activation row stride */
    uint16_t *xp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(B * K32) + 64);
    if (!xp) return 3;
    int dp = 1;   /* every activation a bf16 value: the pair-dot path */
    if (xh)
        for (int64_t b = 0; b < B; ++b) tp_bf16_copy(xh + b * K, K, K32, xp + b * K32);
    else
        for (int64_t b = 0; b < B && dp; ++b) dp = tp_bf16_row(x + b * K, K, K32, xp + b * K32);
#if defined(TP_W_fp8_e4m3)
    if (dp && tp_any_big16(xp, B * K32)) {   /* 2^119 and up: the float kernel takes them */
        free(xp);
        return TP_NONFINITE;
    }
#endif
    if (outh) {   /* bf16 results: float sums here, each rounded (as torch) once final */
        out = (float *)malloc(sizeof(float) * (size_t)(B * N) + 64);
        if (!out) { free(xp); return 3; }
    }
    int64_t parts = 1;   /* bf16 rows per activation row: 3 for float32 ones split (AMX, E4M3) */
#if TP_AMX && defined(TP_W_fp8_e4m3)
    if (!dp && B >= 1 && 3 * B <= 32) {   /* float32 activations as three bf16 rows each (exact) */
        if (tp_any_big(x, B * K)) {   /* non-finite, or 2^119 and up: the float kernel takes them */
            free(xp);
            return TP_NONFINITE;
        }
        free(xp);
        xp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(3 * B * K32) + 64);
        if (!xp) return 3;
        for (int64_t b = 0; b < B; ++b)
            tp_bf16_split3(x + b * K, K, K32, xp + b * K32, xp + (B + b) * K32, xp + (2 * B + b) * K32);
        parts = 3;
        dp = 1;
    }
#endif
    if (!dp) {   /* float32 activations (tp_gemv only: tp_gemv_bf16io's are bf16) */
        free(xp);
#if defined(TP_W_fp8_e4m3)
        (void)scales; (void)pts_d; (void)rowscale; (void)bias; (void)has_bias; (void)N; (void)nthreads;
        if (outh) free(out);
        return 4;
#else
        return tp_gemv_float(x, B, K, w, scales, rowscale, pts_d, bias, has_bias, out, N, nthreads);
#endif
    }
#if defined(TP_W_fp8_e4m3)
#define TP_POST(n) rowscale[n]
#else
#define TP_POST(n) 1.0f
#endif
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
#if TP_AMX
    if (B < 1 || B > 16 || !tp_amx_permit()) {
        free(xp);
        if (outh) free(out);
        return B < 1 || B > 16 ? 7 : 6;
    }
    /* columns: part p of activation row b is column p B + b (narrowed row p B + b of xp); the
       first 16 in one C tile, the rest (split float32 rows from six on) in a second */
    const int64_t ncol = parts * B, c0 = ncol < 16 ? ncol : 16, c1 = ncol - c0;
    const int64_t npairs = (K + 63) / 64 * 32;   /* k-pairs the tiles cover: whole 64-weight steps */
    uint32_t *bt = (uint32_t *)aligned_alloc(64, ((size_t)(npairs * ncol) * 4 + 63) / 64 * 64);
    if (!bt) { free(xp); if (outh) free(out); return 3; }
    memset(bt, 0, (size_t)(npairs * ncol) * 4);
    uint32_t *bt1 = bt + npairs * c0;
    tp_amx_btiles(xp, 0, c0, K32, bt);
    if (c1) tp_amx_btiles(xp, c0, c1, K32, bt1);
    const int64_t tp_astep_ = (tp_chunk_rows(nt, K * TP_WB, ${chunk}) + 15) / 16 * 16;
    #pragma omp parallel num_threads(nt)
    {
        tp_tilecfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < (c1 ? 8 : 5); ++t) cfg.rows[t] = 16;
        cfg.colsb[0] = cfg.colsb[1] = 64;                                    /* A: 16 rows x 32 bf16 */
        cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[4] = (uint16_t)(c0 * 4);     /* B: 16 k-pairs x c0; C */
        if (c1) cfg.colsb[5] = cfg.colsb[6] = cfg.colsb[7] = (uint16_t)(c1 * 4);   /* the same, c1 */
        TP_TILE_FENCE();
        _tile_loadconfig(&cfg);
        uint16_t stage[2048] __attribute__((aligned(64)));   /* two halves of two A tiles */
        float sums[512] __attribute__((aligned(64)));
        memset(stage, 0, sizeof stage);
        tp_groups_t gr;
        tp_groups_init(&gr, &tp_next_, N, tp_astep_, 16);
        while (tp_groups_next(&gr)) {
            const int64_t n0 = gr.n0;
            const int nr = (int)gr.nr;
            tp_amx_dp_rows(w, K, bt, c0, bt1, c1, n0, nr, gr.p0, gr.p1, stage, sums);
#define TP_COL(i, c) ((c) < 16 ? sums[16 * (i) + (c)] : sums[256 + 16 * (i) + (c) - 16])
            for (int i = 0; i < nr; ++i)
                for (int64_t b = 0; b < B; ++b) {
                    const int64_t n = n0 + i;
                    /* a split row's parts, the smallest first */
                    float v = parts == 1 ? TP_COL(i, b) : (TP_COL(i, 2 * B + b) + TP_COL(i, B + b)) + TP_COL(i, b);
                    v *= TP_POST(n);
                    if (has_bias) v += bias[n];
                    out[b * N + n] = v;
                    if (outh) outh[b * N + n] = tp_bf16_as_torch(v);
                }
        }
#undef TP_COL
        _tile_release();
    }
    free(bt);
    free(xp);
    if (outh) free(out);
    return 0;
#endif
    const int64_t tp_step_ = tp_chunk_rows(nt, K * TP_WB, ${chunk});
    const int64_t K64 = K / 64 * 64;
    int64_t kb_len = 0;   /* K block (activations per row), 0: K in one piece */
    if (TP_XBYTES > 0 && B >= TP_KB_MIN_B && B <= 4 && 2 * B * K32 > TP_XBYTES) {
        kb_len = TP_XBYTES / (2 * B) / 64 * 64;
        if (kb_len < 64) kb_len = 64;
    }
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi, nlo = 0, nhi = 0;
        int tp_st_ = 0, ahead = 0;
        while (kb_len ? tp_claim_rows_ahead(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi, nlo, nhi, &ahead)
                      : tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        if (kb_len) {   /* K blocks (see TP_KR) */
            for (int64_t n0 = lo; n0 < hi; n0 += TP_KR) {
                const int64_t n1 = n0 + TP_KR < hi ? n0 + TP_KR : hi;
                int64_t p1;   /* the next row group [p0, p1), prefetched into L2 while this one runs */
                const int64_t p0 = tp_next_group(n1, hi, TP_KR, &tp_next_, N, tp_step_, &tp_st_, &nlo, &nhi, &ahead, &p1);
                __m512 accb[TP_KR * 16];
                for (int64_t i = 0; i < (n1 - n0) * B * 2; ++i) accb[i] = _mm512_setzero_ps();
                for (int64_t kb = 0; kb < K64; kb += kb_len) {
                    const int64_t ke = kb + kb_len < K64 ? kb + kb_len : K64;
                    for (int64_t n = n0; n < n1; n += 2) {   /* rows in pairs: one activation load, two rows */
                        const int R = n + 1 < n1 ? 2 : 1;
                        const int64_t pn = p0 + (n - n0), pfr = p1 - pn;   /* rows to prefetch */
                        const tp_wt *wr = w + n * K, *pfw = pfr > 0 ? w + pn * K : NULL;
                        __m512 *ap = accb + (n - n0) * B * 2;
#define TP_PART(nb, r) tp_dp_part(xp, K32, wr, K, NULL, pfw, pfr < (r) ? (int)pfr : (r), kb, ke, ap, nb, r)
                        TP_NB_R(B, R, TP_PART);   /* blocks only from B <= 4 (kb_len) */
#undef TP_PART
                    }
                }
                for (int64_t n = n0; n < n1; ++n) {
                    for (int64_t b = 0; b < B; b += 4) {
                        const int64_t nb = B - b < 4 ? B - b : 4;
                        const uint16_t *xb = xp + b * K32;
                        const tp_wt *wr = w + n * K;
                        const __m512 *ap = accb + ((n - n0) * B + b) * 2;
                        float *ob = out + b * N + n;
                        switch (nb) {
                            case 1: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 1); break;
                            case 2: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 2); break;
                            case 3: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 3); break;
                            default: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 4); break;
                        }
                    }
                    for (int64_t b = 0; b < B; ++b) {
                        out[b * N + n] *= TP_POST(n);
                        if (has_bias) out[b * N + n] += bias[n];
                        if (outh) outh[b * N + n] = tp_bf16_as_torch(out[b * N + n]);
                    }
                }
            }
            continue;
        }
        for (int64_t n = lo; n < hi;) {
            const tp_wt *wr = w + n * K;
            const int rows = (${pair_min_b} && B >= ${pair_min_b} && n + 1 < hi) ? 2 : 1;
            for (int64_t b = 0; b < B; b += 4) {
                const int64_t nb = B - b < 4 ? B - b : 4;
                const uint16_t *xb = xp + b * K32;
                float *ob = out + b * N + n;
#define TP_ROWS(nb_, r) tp_rows_dp(xb, K32, wr, K, ob, N, nb_, r)
                TP_NB_R(nb, rows, TP_ROWS);
#undef TP_ROWS
            }
            for (int r = 0; r < rows; ++r)
                for (int64_t b = 0; b < B; ++b) {
                    out[b * N + n + r] *= TP_POST(n + r);
                    if (has_bias) out[b * N + n + r] += bias[n + r];
                    if (outh) outh[b * N + n + r] = tp_bf16_as_torch(out[b * N + n + r]);
                }
            n += rows;
        }
        }
    }
    free(xp);
    if (outh) free(out);
    return 0;
#undef TP_POST
}

/* The GEMV's contract: float32 activations and results (see tp_gemv_io). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const tp_wt *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    return tp_gemv_io(x, NULL, B, K, w, scales, rowscale, pts_d, bias, has_bias, out, NULL, N, nthreads);
}

/* The same for a bf16 model's decode: bf16 activations read as they are (no float32 copy to
   narrow back), results rounded to bf16 as torch's cast rounds (tp_bf16_as_torch): the bits of
   tp_gemv on the widened activations followed by that cast, without the caller's two torch
   calls. */
TP_EXPORT int tp_gemv_bf16io(const uint16_t *x, int64_t B, int64_t K, const tp_wt *w, const uint8_t *scales,
                             const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                             uint16_t *out, int64_t N, int64_t nthreads) {
    return tp_gemv_io(NULL, x, B, K, w, scales, rowscale, pts_d, bias, has_bias, NULL, out, N, nthreads);
}
#else
#error "the vdpbf16ps GEMV needs AVX-512 with AVX512-BF16"
#endif
"""


# The float kernel's launch for activations that are not bf16 values: its one-row loop, 512 bytes
# of prefetch (its defaults: the tuner times this kernel on bf16-valued activations only).
FLOAT_PREFETCH = 512

# Narrowed activation bytes (all rows) one K block keeps in L1 for two to four activation rows
# (0: K in one piece; see TP_KR in the source).
XBLOCK_BYTES = 16384
# The same for E4M3 weights (from one row): 8 KB. 11008x4096 from DRAM, interleaved medians of
# 15, two runs (load 3.2-3.6, a helper running): B=2 two threads 1.96/2.42 -> 1.82/1.74 ms (16 KB
# of two rows was not blocked), one thread 2.85/4.52 -> 2.34/2.49; B=4 2.23/2.58 -> 2.13/2.42,
# one thread 4.32/3.68 -> 4.15/3.62. bf16 weights keep 16 KB: at B=4 two threads 4.32/4.42 ->
# 4.70/4.37 with 8 KB.
FP8_XBLOCK_BYTES = 8192

# K in one piece: from this many activation rows two weight rows share every activation load
# (0: never). Below four rows a pair's two weight streams per thread measured slower than one:
# E4M3 from DRAM, interleaved medians of 22 (load 1.1-1.4, ``sum`` 30-32 GB/s), one row per load
# -> pairs: B=1 11008x4096 two threads NTA 2048 1.07 -> 1.53 ms, one thread T0 1.53 -> 2.84; B=2
# 11008x2048 two threads T0 0.67 -> 1.05 (NTA 0.48 -> 0.50). K blocks always pair their rows.
PAIR_MIN_B = 4


def _float_kernel_source() -> str:
    """The float kernel's source (:data:`torchport.gemv.kernels._SOURCE`, after the decode
    tables it reads, ``DECODE_C``) with its entry renamed ``tp_gemv_float``, a static function
    the pair-dot entry hands float32 activations to."""
    from torchport.gemv.kernels import _SOURCE as FLOAT_SOURCE
    from torchport.gemv.kernels import DECODE_C

    entry = "TP_EXPORT int tp_gemv("
    if FLOAT_SOURCE.count(entry) != 1:
        raise RuntimeError("the float GEMV source must define its tp_gemv entry exactly once")
    return DECODE_C + FLOAT_SOURCE.replace(entry, "static int tp_gemv_float(")


def _e4m3_bf16_bytes() -> tuple[str, str]:
    """The vpermi2b tables of the E4M3 decode: for each 7-bit magnitude code, the high byte (sign
    bit clear) and the low byte of its value as bf16 (exact: every E4M3 value is a normal bf16
    number), the NaN code as the float kernel's table has it (NaN: 0x7FC0, whose products are NaN)."""
    import torch

    from torchport.gemv.kernels import e4m3_values

    vals = e4m3_values()[:128]
    b16 = vals.bfloat16()
    if not torch.allclose(b16.float(), vals, rtol=0.0, atol=0.0, equal_nan=True):
        raise RuntimeError("an E4M3 value is not exact in bf16")
    bits = b16.view(torch.int16).to(torch.int32) & 0xFFFF
    hi = ", ".join(str(int(b) >> 8) for b in bits)
    lo = ", ".join(str(int(b) & 0xFF) for b in bits)
    return hi, lo


# Weight formats of the pair-dot kernel: bf16 as loaded, E4M3 decoded to bf16 (exact)
DP_WEIGHTS = ("bf16", "fp8_e4m3")


@functools.cache
def gemv_bf16_dp_kernel(
    isa: str,
    prefetch: int = 0,
    chunk: int | None = None,
    hint: str = "T0",
    xblock: int | None = None,
    weights: str = "bf16",
    amx: bool = False,
) -> GemvKernel:
    """The ``vdpbf16ps`` GEMV (entry ``tp_gemv``, the same arguments as
    :func:`torchport.gemv.kernels.gemv_kernel`'s kernel of the weight format ``weights``: bf16 or
    ``fp8_e4m3``). ``prefetch``: bytes ahead of
    the weight stream, ``hint``: its locality (:data:`torchport.gemv.kernels.PREFETCH_HINTS`);
    ``chunk``: weight bytes per row claim (default :data:`torchport.gemv.kernels.CHUNK_BYTES`;
    0 = static split); ``xblock``: bytes of narrowed activations (all rows) a K block keeps in L1
    for two to four activation rows, E4M3 weights from one (default :data:`XBLOCK_BYTES`, E4M3
    :data:`FP8_XBLOCK_BYTES`; 0: K in one piece); ``amx``: the AMX-BF16 build (one C tile per
    16 weight rows over all of K; ``prefetch`` and ``xblock`` unused; 1 to 16 activation rows,
    status 7 beyond; status 6 without the OS's tile state; with E4M3 weights float32 activations
    split into three bf16 parts, 1 to 10 rows, status 4 beyond). Raises ``NativeError`` unless
    ``isa`` is ``"avx512"`` on a CPU with AVX512-BF16, or, with ``amx``, naming what
    :func:`amx_dp_ready` misses."""
    from torchport.gemv.kernels import CHUNK_BYTES, SCHED_C, _e4m3_table, _e8m0_table, check_hint
    from torchport.gemv.kernels import XBLOCK_BYTES as FLOAT_XBLOCK_BYTES

    check_hint(hint)
    if isa != "avx512" or not native.cpu_info().has_avx512_bf16:
        raise native.NativeError(
            f"the vdpbf16ps GEMV needs isa 'avx512' with AVX512-BF16 (isa is {isa!r}, "
            f"AVX512-BF16 {'present' if native.cpu_info().has_avx512_bf16 else 'absent'})"
        )
    if xblock is not None and xblock < 0:
        raise ValueError(f"vdpbf16ps gemv xblock must be >= 0 bytes, got {xblock!r}")
    if weights not in DP_WEIGHTS:
        raise ValueError(f"vdpbf16ps gemv weights must be one of {DP_WEIGHTS}, got {weights!r}")
    chunk = CHUNK_BYTES if chunk is None else chunk
    missing = _amx_dp_missing(isa) if amx else None
    if missing is not None:
        raise native.NativeError(f"the AMX-BF16 GEMV needs {missing}")
    fp8 = weights == "fp8_e4m3"
    hi, lo = _e4m3_bf16_bytes() if fp8 else ("0", "0")
    params: dict[str, object] = dict(
        wfmt=weights,
        e4m3_hi=hi,
        e4m3_lo=lo,
        chunk=chunk,
        dp_prefetch=prefetch,
        pair_min_b=PAIR_MIN_B,
        hint=hint,
        xblock=(FP8_XBLOCK_BYTES if fp8 else XBLOCK_BYTES) if xblock is None else xblock,
        amx=int(amx),
    )
    if not fp8:  # bf16 weights: the float kernel serves float32 activations (its parameters)
        params.update(
            e4m3_table=_e4m3_table(),
            e8m0_table=_e8m0_table(),
            fmt="bf16",
            prefetch=FLOAT_PREFETCH,
            rows4=0,
            fxblock=FLOAT_XBLOCK_BYTES,
        )
    tiles = AMX_TILE_C if amx else ""
    src = native.render(
        SCHED_C + tiles + ("" if fp8 else _float_kernel_source()) + _SOURCE, **params
    )
    name = (
        f"gemv_{'fp8' if fp8 else 'bf16'}dp{'amx' if amx else ''}_{isa}_p{prefetch}{hint}_c{chunk}"
    )
    name += "" if xblock is None else f"_x{xblock}"
    # E4M3: activations of 2^119 and up (and, AMX, float32 ones it cannot split exactly) go to
    # the float kernel (TP_NONFINITE)
    twin = isa if fp8 else None
    if not amx:
        return GemvKernel(native.build(src, name=name, isa=isa), weights, twin_isa=twin)
    lib = build_amx(src, name, AMX_FLAGS, _amx_dp_unbuildable)
    return GemvKernel(lib, weights, twin_isa=twin)


# Set when an AMX build of this kernel fails to compile (a compiler without -mamx-bf16): no
# "dpamx" candidates from then on in this process
_amx_dp_unbuildable: list[bool] = []


def _amx_dp_missing(isa: str | None = None) -> str | None:
    """Why the AMX-BF16 build cannot run here (None: it can); ``isa``: the level asked for
    (default the one in force)."""
    need = {"amx_tile", "amx_bf16", "avx512_bf16"}
    return native.amx_missing(
        need, unbuildable=bool(_amx_dp_unbuildable), compiler="AMX-BF16", isa=isa
    )


def amx_dp_ready() -> bool:
    """True when the AMX build of this kernel can run: AMX-BF16 on the CPU at the avx512 ISA
    level, the OS granting the tile state, and no AMX build of this kernel having failed to
    compile in this process."""
    return _amx_dp_missing() is None
