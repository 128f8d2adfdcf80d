"""FP8 E4M3 decode GEMV with an integer-shift decode: nine (AVX2) or eleven instructions per 32 weights.

The float kernel of :mod:`torchport.gemv.kernels` decodes E4M3 through half precision (widen to
16 bits, shift, mask, then two F16C conversions per 16 weights: about 18 µops per 32 weights, the
conversions on the vector ports the FMAs need). This kernel builds the float32 bit pattern
directly from one 32-byte load, for byte ``j`` (0…3) of every dword:

- ``vpslld 8·(3-j)`` (none for ``j = 3``; ``j = 0`` reuses the ``j = 2`` shift) moves the byte
  to bits 31…24;
- ``vpsrad 4`` moves ``EEEE MMM`` to bits 26…20 (the float32 exponent's low four bits and the
  top three mantissa bits) and copies of the sign bit ``S`` into bits 31…27;
- ``vpand 0x87F00000`` keeps the sign bit and clears the four copies in the exponent's top bits
  (and the lower bytes, which landed in bits 19…0).

The AVX2 build does the same in 16-bit lanes (``vpsraw 4`` decodes bytes 1 and 3 of every dword
at once, ``vpsllw 8`` then ``vpsraw 4`` bytes 0 and 2; bytes 0 and 1 then move to the dword's top
by ``vpslld 16``): nine instructions per 32 weights (five shifts, four masks) instead of eleven
(seven shifts, on the two vector ports that also run the FMAs), and its one-row loop keeps eight
FMA accumulators instead of four. One thread, L2-resident 96×4096 weights (thread CPU time per
call, incl. ≈ 11 µs of call overhead, one process, medians of 11, load ≈ 2.5): 30.0 → 27.0 µs;
streamed from DRAM (11008×4096) no change measurable on the shared machine (4.5 ms either way:
one core's stream is bound by misses in flight, not by the decode).

Vector ``j`` lane ``l`` holds byte ``4l + j`` of the 32: the activations are permuted to that
order once per call (with the rescaling below). Eleven vector instructions and one load per 32
weights, against twelve and four loads with ``vpmovsxbd`` per eight bytes (the previous decode):
one thread over L2-resident weights 3.41 → 3.13 ns per 64 weights (C harness, load ≈ 7).

The lane then holds the float32 whose value is exactly ``e4m3 · 2⁻¹²⁰`` for every code: normal
codes (exponent ``e`` → ``e + 0``, bias 127 instead of 7) and subnormal ones (``e = 0`` → a
float32 subnormal ``m/8 · 2⁻¹²⁶``). Products of such tiny weights with ordinary activations would
underflow, so the activations are rescaled once per call, per row, by an exact power of two
``2^k`` that brings the row's amax to ``[2⁹⁹, 2¹⁰⁰)``: products ``x·2^k · w·2⁻¹²⁰`` are then
normal float32 numbers (a product underflows only where ``|x·w|`` is below ``2⁻¹⁰⁶ · amax`` —
nothing a float32 sum of the row could hold), and the row sum is multiplied by ``2^(120-k)`` and
the row scale at the end. The decoded weights are exact, so results equal the float kernel's
up to float32 summation order (the same tolerance, :func:`torchport.gemv.gemv_reference`).

Subnormal operands are only the rare subnormal weight codes. The kernel clears the MXCSR
denormals-are-zero / flush-to-zero bits in each of its threads for the call (``torch.set_flush_
denormal(True)`` would otherwise read subnormal codes as zero) and restores them. E4M3's NaN codes
(0x7F/0xFF) decode to finite values in registers, as in the float kernel (quantized data never
holds them; a cached ``Float8Tensor`` pack gives a row holding one a NaN row scale, so its output
is NaN as torch's); the tail's table decode reads them as NaN.
At ``isa="avx512"`` the same decode runs on 512-bit vectors: 64 weights (one cache line, loaded
as two 256-bit halves) per eleven instructions, the activations permuted per 64 (byte ``4l + j``
↔ vector ``j`` lane ``l``, ``l`` < 16). Kernel-level A/B in one process (one thread, thread CPU
time, load 3-6): L2-resident 256×4096 2.60 → 1.79 ns per 64 weights, 11008×4096 streamed from
DRAM 1.77 → 1.33 ms per call; with single 512-bit weight loads the DRAM stream was 2.8 ms (slower
than the 256-bit kernel). The AVX2 build keeps the 256-bit kernel, and serves two or more
activation rows on AVX-512 machines too (:func:`torchport.gemv.ops._native_kernel`: at B=4 the
512-bit kernel streamed slower). No scalar variant (the caller never selects it below AVX2).

``rows=2`` or ``4`` builds a row-unrolled loop for one activation row: each activation vector
(folded into the FMA as a load) serves two or four weight rows, each row's stream prefetched
once per 64-byte line, 8 / rows accumulators per row; the per-row results follow the one-row
formula (the same tolerance; the summation order differs). AVX2, one thread, thread CPU time per
call (medians of 21, load 5-8): L2-resident 96×4096 35 → 30 (two rows) → 29 µs (four); an
8-row call 14 → 10 → 9 µs. From DRAM (11008×4096) four rows with T0 8192 ahead cost about what
the one-row loop with NTA 2048 does (3.5-4.0 vs 3.6-3.9 ms CPU time, four runs), with NTA 2048
ahead more (4.4-4.6 ms); two threads from DRAM, four rows T0 8192 2.433 / 2.568 ms against one
row NTA 2048 2.623 / 2.710 ms (kernels alone, interleaved medians of 21, read peak 21.9 GB/s,
two runs): the tuner tries it (:data:`torchport.gemv.ops.SHIFT4_PREFETCH`).

From two activation rows (one in the AVX-512 one-row build), where the rows' prescaled
activations (``4·B·K`` bytes) exceed :data:`XBLOCK_BYTES` (8 KB, a quarter of L1; 16 KB before the
twentieth session), eight weight rows at a time run K in blocks that keep
a block of every activation row in L1, the accumulators parked in memory between blocks (the
same FMAs in the same order: the same bits as K in one piece), and the next eight rows' lines are
prefetched into L2 as the current ones are read (a lone activation row left after groups of
four, the fifth of five, takes the multi-row loop's two chains there instead of the one-row
loop's four or eight: its bits differ from K in one piece, within the same tolerance). Before, at
B=4 and K=4096 (64 KB of activations) every weight line met activation vectors re-read from L2:
11008×4096 from DRAM,
interleaved medians of 9 (load 2-3), B=4 one thread (CPU time) 9.3 → 6.0–6.4 ms, two threads 4.6–4.9
→ 3.3–3.5 ms; eight or sixteen rows at a time measured 6.4 and 6.7–7.1 ms. The AVX-512 build's
blocks run two to four activation rows against weight rows in pairs, every activation load (one
per FMA otherwise) serving two rows (per row the same FMAs in the same order: the same bits; 16
accumulators, which the AVX2 build's sixteen registers cannot hold beside the decode). Kernels
alone from DRAM, two threads, interleaved medians of 18 (load 1.2; one weight copy per round,
partly from L3 after its first kernel), one row → pairs: B=4
4096×11008 3.15 → 2.40 ms, 11008×4096 3.50 → 3.35, B=2 11008×4096 1.67 → 1.46; the tuner offers
it beside the AVX2 build (:data:`torchport.gemv.ops.SHIFT512_PREFETCH`).
"""

from __future__ import annotations

import functools

from torchport import native
from torchport.gemv.kernels import GemvKernel

_SOURCE = r"""
#include <float.h>
#include <stdlib.h>
static const float TP_E4M3F[256] = { ${e4m3_table} };

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512: 64 E4M3 bytes (one cache line) per decode, four 16-lane float32 vectors. The line is
   loaded as two 256-bit halves: one 512-bit load per line streamed 16 GB/s from DRAM where the
   two halves stream 32 (one thread, Zen 5, thread CPU time), and is slower on cached data too. */
#define TP_V 16
typedef __m512 tp_vf;
#define TP_ZERO() _mm512_setzero_ps()
#define TP_LOADX(p) _mm512_loadu_ps(p)
#define TP_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define TP_ADD(a, b) _mm512_add_ps(a, b)
#define TP_HSUM(v) _mm512_reduce_add_ps(v)
#define TP_E4M3X(p, w0, w1, w2, w3) do {                                                     \
        const __m512i v_ = _mm512_inserti64x4(_mm512_castsi256_si512(                       \
            _mm256_loadu_si256((const __m256i *)(p))), _mm256_loadu_si256((const __m256i *)(p) + 1), 1); \
        const __m512i m_ = _mm512_set1_epi32((int)0x87F00000), v8_ = _mm512_slli_epi32(v_, 8); \
        w3 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(v_, 4), m_));             \
        w2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(v8_, 4), m_));            \
        w1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(v_, 16), 4), m_)); \
        w0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(v8_, 16), 4), m_)); \
    } while (0)
#else
/* AVX2: 32 E4M3 bytes per decode, four 8-lane float32 vectors */
#define TP_V 8
typedef __m256 tp_vf;
#define TP_ZERO() _mm256_setzero_ps()
#define TP_LOADX(p) _mm256_loadu_ps(p)
#define TP_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define TP_ADD(a, b) _mm256_add_ps(a, b)
#define TP_HSUM(v) tp_hsum(v)
TP_INLINE float tp_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 16-bit arithmetic shifts by 4 decode two bytes per dword at once: t1 = srai16(v) holds byte 3
   at bits 26..20 (sign copies above) and byte 1 at bits 10..4; t2 = srai16(slli16(v, 8)) holds
   bytes 2 and 0 the same way. Bytes 3 and 2 are masked in place (bit 31 and 26..20 kept); bytes
   1 and 0 move up by a 32-bit shift of 16 first. Nine instructions per 32 bytes. */
#define TP_E4M3X(p, w0, w1, w2, w3) do {                                                     \
        const __m256i v_ = _mm256_loadu_si256((const __m256i *)(p));                        \
        const __m256i m_ = _mm256_set1_epi32((int)0x87F00000);                              \
        const __m256i t1_ = _mm256_srai_epi16(v_, 4), t2_ = _mm256_srai_epi16(_mm256_slli_epi16(v_, 8), 4); \
        w3 = _mm256_castsi256_ps(_mm256_and_si256(t1_, m_));                                  \
        w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(t1_, 16), m_));           \
        w2 = _mm256_castsi256_ps(_mm256_and_si256(t2_, m_));                                  \
        w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(t2_, 16), m_));           \
    } while (0)
#endif
/* TP_E4M3X decodes TP_G = 4 * TP_V bytes into four float32 vectors holding value * 2^-120
   (exact, subnormals included): vector j, lane l <-> byte 4l + j. */
#define TP_G (4 * TP_V)

/* x row scaled by 2^k (exact) so that its amax lies in [2^99, 2^100); returns 2^(120 - k). */
static double tp_prescale(const float *x, int64_t K, float *xs) {
    float amax = 0.0f;
    for (int64_t i = 0; i < K; ++i) { float a = fabsf(x[i]); amax = a > amax ? a : amax; }
    int e = 0;
    if (amax > 0.0f && amax <= FLT_MAX) frexpf(amax, &e);   /* amax = f * 2^e, f in [0.5, 1) */
    int k = 100 - e;                                          /* |e| <= 149: k in [-28, 249] */
    const float s1 = ldexpf(1.0f, k / 2), s2 = ldexpf(1.0f, k - k / 2);
    /* per TP_G-group, in TP_E4M3X's order: xs[TP_V j + l] <- x[4l + j] (the K % TP_G tail is unused) */
    for (int64_t g = 0; g + TP_G <= K; g += TP_G)
        for (int j = 0; j < 4; ++j)
            for (int l = 0; l < TP_V; ++l) xs[g + TP_V * j + l] = x[g + 4 * l + j] * s1 * s2;
    return ldexp(1.0, 120 - k);
}

/* The multi-row loop (NB >= 2) of R (1 or 2) consecutive weight rows over k0 <= k < k1 (multiples
   of TP_G), every activation load serving the R rows; weight row r at w + r K, its accumulators
   (NB x 2 vectors) at accp + 2 NB r, kept there between calls, so each row's sums depend neither on
   whether K runs in one piece (tp_row) or in blocks nor on R (per row the same operations in the
   same order). At each k prefetches each row's pfa + r K + k with the kernel's hint (the row's own
   stream ahead) unless pfa is NULL, and for the first pfr rows the line of pfw + r K + k (the rows
   the next row group reads) into L2. */
TP_INLINE void tp_row_part(const float *xs, int64_t K, const uint8_t *w, const char *pfa, const uint8_t *pfw,
                           int pfr, int64_t k0, int64_t k1, tp_vf *accp, const int NB, const int R) {
    tp_vf acc[2][4][2];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            acc[r][b][0] = accp[2 * (NB * r + b)];
            acc[r][b][1] = accp[2 * (NB * r + b) + 1];
        }
    for (int64_t k = k0; k < k1; k += TP_G) {
        for (int r = 0; r < R; ++r) {
            if (pfa) _mm_prefetch(pfa + r * K + k, _MM_HINT_${hint});
            if (r < pfr) _mm_prefetch((const char *)(pfw + r * K + k), _MM_HINT_T1);
        }
        tp_vf wv[2][4];
        for (int r = 0; r < R; ++r) TP_E4M3X(w + r * K + k, wv[r][0], wv[r][1], wv[r][2], wv[r][3]);
        for (int b = 0; b < NB; ++b)
            for (int j = 0; j < 4; ++j) {   /* vectors 0 and 2 into accumulator 0, 1 and 3 into 1 */
                const tp_vf xv = TP_LOADX(xs + b * K + k + j * TP_V);
                for (int r = 0; r < R; ++r) acc[r][b][j & 1] = TP_FMA(wv[r][j], xv, acc[r][b][j & 1]);
            }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) {
            accp[2 * (NB * r + b)] = acc[r][b][0];
            accp[2 * (NB * r + b) + 1] = acc[r][b][1];
        }
}

/* One activation row over k0 <= k < k1 (multiples of TP_G): the one-row loop's four FMA chains,
   kept in accp[0..3] between calls (tp_row's one-row loop, after the AVX2 build's 64-weight steps,
   and the AVX-512 build's K blocks from one row, so a row's sums do not depend on whether K runs
   in one piece). Prefetches as tp_row_part. */
TP_INLINE void tp_row1_part(const float *xs, const uint8_t *w, const char *pfa, const uint8_t *pfw,
                            int64_t k0, int64_t k1, tp_vf *accp) {
    tp_vf a0 = accp[0], a1 = accp[1], a2 = accp[2], a3 = accp[3];
    for (int64_t k = k0; k < k1; k += TP_G) {   /* four independent chains hide FMA latency */
        if (pfa) _mm_prefetch(pfa + k, _MM_HINT_${hint});
        if (pfw) _mm_prefetch((const char *)(pfw + k), _MM_HINT_T1);
        tp_vf w0, w1, w2, w3;
        TP_E4M3X(w + k, w0, w1, w2, w3);
        a0 = TP_FMA(w0, TP_LOADX(xs + k), a0);
        a1 = TP_FMA(w1, TP_LOADX(xs + k + TP_V), a1);
        a2 = TP_FMA(w2, TP_LOADX(xs + k + 2 * TP_V), a2);
        a3 = TP_FMA(w3, TP_LOADX(xs + k + 3 * TP_V), a3);
    }
    accp[0] = a0; accp[1] = a1; accp[2] = a2; accp[3] = a3;
}

/* The K % TP_G tail of a row from k on: the unscaled activations x times the table decode, in
   double (exact products, which cannot overflow: a float32 one could from |x| ~ 7.6e35, where x
   times the dequantized weight does not). */
TP_INLINE double tp_tail(const float *x, int64_t k, int64_t K, const uint8_t *w) {
    double tail = 0.0;
    for (int64_t j = k; j < K; ++j) tail += (double)TP_E4M3F[w[j]] * (double)x[j];
    return tail;
}

/* A row's result from its two accumulators: their sum times fac (2^(120 - k) of the prescale), plus
   the K % TP_G tail from k on (tp_tail), times the row scale. */
TP_INLINE float tp_row_end(tp_vf a0, tp_vf a1, const float *x, double fac, int64_t k, int64_t K,
                           const uint8_t *w, float post) {
    const double s = (double)TP_HSUM(TP_ADD(a0, a1)) * fac + tp_tail(x, k, K, w);
    return (float)(s * (double)post);
}

/* One weight row against NB (<= 4) prescaled activation rows. */
TP_INLINE void tp_row(const float *xs, const float *x, const double *fac, int64_t K, const uint8_t *w,
                      float post, float *out, int64_t ldo, const int NB) {
    tp_vf acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = TP_ZERO(); acc[b][1] = TP_ZERO(); }
    tp_vf acc1[2] = {TP_ZERO(), TP_ZERO()};
    int64_t k = 0;
    if (NB > 1) {
        tp_vf a[8];
        for (int i = 0; i < 2 * NB; ++i) a[i] = TP_ZERO();
        k = K / TP_G * TP_G;
        tp_row_part(xs, K, w, (const char *)w + ${prefetch}, NULL, 0, 0, k, a, NB, 1);
        for (int b = 0; b < NB; ++b) { acc[b][0] = a[2 * b]; acc[b][1] = a[2 * b + 1]; }
    }
#if TP_V == 8
    if (NB == 1) {   /* 64 weights (one cache line) per step: one prefetch per line */
        tp_vf acc2[4] = {TP_ZERO(), TP_ZERO(), TP_ZERO(), TP_ZERO()};
        for (; k + 64 <= K; k += 64) {
            _mm_prefetch((const char *)(w + k) + ${prefetch}, _MM_HINT_${hint});
            tp_vf w0, w1, w2, w3;
            TP_E4M3X(w + k, w0, w1, w2, w3);
            acc[0][0] = TP_FMA(w0, TP_LOADX(xs + k), acc[0][0]);
            acc[0][1] = TP_FMA(w1, TP_LOADX(xs + k + 8), acc[0][1]);
            acc1[0] = TP_FMA(w2, TP_LOADX(xs + k + 16), acc1[0]);
            acc1[1] = TP_FMA(w3, TP_LOADX(xs + k + 24), acc1[1]);
            TP_E4M3X(w + k + 32, w0, w1, w2, w3);
            acc2[0] = TP_FMA(w0, TP_LOADX(xs + k + 32), acc2[0]);
            acc2[1] = TP_FMA(w1, TP_LOADX(xs + k + 40), acc2[1]);
            acc2[2] = TP_FMA(w2, TP_LOADX(xs + k + 48), acc2[2]);
            acc2[3] = TP_FMA(w3, TP_LOADX(xs + k + 56), acc2[3]);
        }
        acc[0][0] = TP_ADD(acc[0][0], acc2[0]);
        acc[0][1] = TP_ADD(acc[0][1], acc2[1]);
        acc1[0] = TP_ADD(acc1[0], acc2[2]);
        acc1[1] = TP_ADD(acc1[1], acc2[3]);
    }
#endif
    if (NB == 1) {   /* the rest of the row's whole TP_G groups on the four chains */
        tp_vf a[4] = {acc[0][0], acc[0][1], acc1[0], acc1[1]};
        const int64_t kf = K / TP_G * TP_G;
        tp_row1_part(xs, w, (const char *)w + ${prefetch}, NULL, k, kf, a);
        acc[0][0] = a[0]; acc[0][1] = a[1]; acc1[0] = a[2]; acc1[1] = a[3];
        k = kf;
    }
    if (NB == 1) { acc[0][0] = TP_ADD(acc[0][0], acc1[0]); acc[0][1] = TP_ADD(acc[0][1], acc1[1]); }
    for (int b = 0; b < NB; ++b) out[b * ldo] = tp_row_end(acc[b][0], acc[b][1], x + b * K, fac[b], k, K, w, post);
}

/* K blocks (from two activation rows): the prescaled activations of B rows are 4 B K bytes,
   beyond L1 from two rows at K = 4096, and each weight line meets every row's vectors there. So
   TP_KR weight rows at a time run K in blocks of TP_XBYTES / (4 B) activations (a block of every
   row stays in L1 while the TP_KR rows use it), their accumulators parked between blocks, and the
   next TP_KR rows' lines are prefetched into L2 as the current ones are read. */
#define TP_KR 8
#define TP_XBYTES ${xblock}
/* The AVX-512 one-row build takes the blocks from one activation row on: a prescaled row beyond
   TP_XBYTES (K > 2048) shared L1 with the weight stream and was re-read from L2. 4096x11008 B=1
   from DRAM, interleaved medians of 21 (load 3-4): two threads 2.44/2.63 -> 1.85/2.19 ms, one
   thread 4.65/4.83 -> 2.22/2.29 (16 KB blocks); 11008x4096, blocked since XBLOCK_BYTES is 8 KB,
   see there. tp_row1_part keeps the one-row loop's
   chains, so the bits are those of K in one piece. (The AVX2 build's one-row loop takes 64
   weights a step into eight chains, and the row-unrolled builds stream several rows: both keep
   K in one piece at B = 1.) */
#if TP_V == 16 && ${rows} == 1
#define TP_KB_MIN_B 1
#else
#define TP_KB_MIN_B 2
#endif

/* TP_R (> 1) weight rows against one prescaled activation row: each activation vector (an L1
   load folded into the FMA) serves TP_R rows, and TP_R weight streams are in flight, each
   prefetched once per 64-byte line. 8 / TP_R accumulators per row: eight FMA chains in all. */
#define TP_R ${rows}
#if TP_R > 1
#define TP_A (8 / TP_R)
TP_INLINE void tp_rows(const float *xs, const float *x, double fac, int64_t K, const uint8_t *w,
                       const float *post, float *out) {
    tp_vf acc[TP_R][TP_A];
    for (int r = 0; r < TP_R; ++r)
        for (int a = 0; a < TP_A; ++a) acc[r][a] = TP_ZERO();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        for (int r = 0; r < TP_R; ++r) _mm_prefetch((const char *)(w + r * K + k) + ${prefetch}, _MM_HINT_${hint});
        for (int h = 0; h < 64 / TP_G; ++h) {
            const int64_t kh = k + h * TP_G;
            for (int r = 0; r < TP_R; ++r) {
                tp_vf w0, w1, w2, w3;
                TP_E4M3X(w + r * K + kh, w0, w1, w2, w3);
                acc[r][(4 * h) % TP_A] = TP_FMA(w0, TP_LOADX(xs + kh), acc[r][(4 * h) % TP_A]);
                acc[r][(4 * h + 1) % TP_A] = TP_FMA(w1, TP_LOADX(xs + kh + TP_V), acc[r][(4 * h + 1) % TP_A]);
                acc[r][(4 * h + 2) % TP_A] = TP_FMA(w2, TP_LOADX(xs + kh + 2 * TP_V), acc[r][(4 * h + 2) % TP_A]);
                acc[r][(4 * h + 3) % TP_A] = TP_FMA(w3, TP_LOADX(xs + kh + 3 * TP_V), acc[r][(4 * h + 3) % TP_A]);
            }
        }
    }
    for (; k + TP_G <= K; k += TP_G) {
        for (int r = 0; r < TP_R; ++r) {
            tp_vf w0, w1, w2, w3;
            TP_E4M3X(w + r * K + k, w0, w1, w2, w3);
            acc[r][0] = TP_FMA(w0, TP_LOADX(xs + k), acc[r][0]);
            acc[r][1 % TP_A] = TP_FMA(w1, TP_LOADX(xs + k + TP_V), acc[r][1 % TP_A]);
            acc[r][2 % TP_A] = TP_FMA(w2, TP_LOADX(xs + k + 2 * TP_V), acc[r][2 % TP_A]);
            acc[r][3 % TP_A] = TP_FMA(w3, TP_LOADX(xs + k + 3 * TP_V), acc[r][3 % TP_A]);
        }
    }
    for (int r = 0; r < TP_R; ++r) {
        for (int a = 1; a < TP_A; ++a) acc[r][0] = TP_ADD(acc[r][0], acc[r][a]);
        const double s = (double)TP_HSUM(acc[r][0]) * fac + tp_tail(x, k, K, w + r * K);
        out[r] = (float)(s * (double)post[r]);
    }
}
#endif

/* Same contract as torchport.gemv.kernels' tp_gemv for fp8_e4m3 (scales and pts unused). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint8_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    (void)scales; (void)pts_d;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(B * K) + 64);
    double fac[8];
    if (!xs) return 3;
    if (B > 8) { free(xs); return 2; }
    for (int64_t b = 0; b < B; ++b) fac[b] = tp_prescale(x + b * K, K, xs + b * K);
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K, ${chunk});
    const int64_t KF = K / TP_G * TP_G;
    int64_t kb_len = 0;   /* K block (activations per row), 0: K in one piece */
    if (TP_XBYTES > 0 && B >= TP_KB_MIN_B && (int64_t)sizeof(float) * B * K > TP_XBYTES) {
        kb_len = TP_XBYTES / ((int64_t)sizeof(float) * B) / TP_G * TP_G;
        if (kb_len < TP_G) kb_len = TP_G;
    }
    #pragma omp parallel num_threads(nt)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr & ~0x8040u);   /* subnormal weight codes must not read as zero */
        int64_t lo, hi, nlo = 0, nhi = 0;
        int tp_st_ = 0, ahead = 0;
        while (kb_len ? tp_claim_rows_ahead(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi, nlo, nhi, &ahead)
                      : tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        if (kb_len) {   /* K blocks (B >= TP_KB_MIN_B, see TP_KR) */
            for (int64_t n0 = lo; n0 < hi; n0 += TP_KR) {
                const int64_t n1 = n0 + TP_KR < hi ? n0 + TP_KR : hi;
                int64_t p1;   /* the next row group [p0, p1), prefetched into L2 while this one runs */
                const int64_t p0 = tp_next_group(n1, hi, TP_KR, &tp_next_, N, tp_step_, &tp_st_, &nlo, &nhi, &ahead, &p1);
                tp_vf accb[TP_KR * 16];
                for (int64_t i = 0; i < (n1 - n0) * (B > 1 ? 2 * B : 4); ++i) accb[i] = TP_ZERO();
                for (int64_t kb = 0; kb < KF; kb += kb_len) {
                    const int64_t ke = kb + kb_len < KF ? kb + kb_len : KF;
                    for (int64_t n = n0; n < n1; ++n) {
                        const int64_t pn = p0 + (n - n0), pfr = p1 - pn;   /* rows to prefetch */
                        const uint8_t *wr = w + n * K, *pfw = pfr > 0 ? w + pn * K : NULL;
#if TP_KB_MIN_B == 1
                        if (B == 1) {   /* the one-row chains (four accumulators a row) */
                            tp_row1_part(xs, wr, NULL, pfw, kb, ke, accb + (n - n0) * 4);
                            continue;
                        }
#endif
#if TP_V == 16
                        if (B <= 4 && n + 1 < n1) {   /* AVX-512: two weight rows per activation load */
                            const int ipf = pfr < 2 ? (int)pfr : 2;
                            tp_vf *ap = accb + (n - n0) * B * 2;
                            switch (B) {
                                case 2: tp_row_part(xs, K, wr, NULL, pfw, ipf, kb, ke, ap, 2, 2); break;
                                case 3: tp_row_part(xs, K, wr, NULL, pfw, ipf, kb, ke, ap, 3, 2); break;
                                default: tp_row_part(xs, K, wr, NULL, pfw, ipf, kb, ke, ap, 4, 2); break;
                            }
                            ++n;   /* the pair's second row done */
                            continue;
                        }
#endif
                        for (int64_t b = 0; b < B; b += 4) {
                            const int64_t nb = B - b < 4 ? B - b : 4;
                            const float *xb = xs + b * K;
                            tp_vf *ap = accb + ((n - n0) * B + b) * 2;
                            const int pf = b == 0 && pfw != NULL;
                            switch (nb) {
                                case 1: tp_row_part(xb, K, wr, NULL, pfw, pf, kb, ke, ap, 1, 1); break;
                                case 2: tp_row_part(xb, K, wr, NULL, pfw, pf, kb, ke, ap, 2, 1); break;
                                case 3: tp_row_part(xb, K, wr, NULL, pfw, pf, kb, ke, ap, 3, 1); break;
                                default: tp_row_part(xb, K, wr, NULL, pfw, pf, kb, ke, ap, 4, 1); break;
                            }
                        }
                    }
                }
                for (int64_t n = n0; n < n1; ++n)
                    for (int64_t b = 0; b < B; ++b) {
#if TP_KB_MIN_B == 1
                        if (B == 1) {   /* as tp_row ends its one-row loop */
                            const tp_vf *a = accb + (n - n0) * 4;
                            out[n] = tp_row_end(TP_ADD(a[0], a[2]), TP_ADD(a[1], a[3]), x, fac[0], KF, K,
                                                w + n * K, rowscale[n]);
                            if (has_bias) out[n] += bias[n];
                            continue;
                        }
#endif
                        const tp_vf *ap = accb + ((n - n0) * B + b) * 2;
                        out[b * N + n] = tp_row_end(ap[0], ap[1], x + b * K, fac[b], KF, K, w + n * K, rowscale[n]);
                        if (has_bias) out[b * N + n] += bias[n];
                    }
            }
            continue;
        }
        for (int64_t n = lo; n < hi; ++n) {
#if TP_R > 1
            if (B == 1 && n + TP_R <= hi) {   /* TP_R rows at once (then n += TP_R) */
                tp_rows(xs, x, fac[0], K, w + n * K, rowscale + n, out + n);
                if (has_bias) for (int r = 0; r < TP_R; ++r) out[n + r] += bias[n + r];
                n += TP_R - 1;
                continue;
            }
#endif
            const uint8_t *wr = w + n * K;
            const float post = rowscale[n];
            for (int64_t b = 0; b < B; b += 4) {
                int64_t nb = B - b < 4 ? B - b : 4;
                const float *xb = xs + b * K, *xo = x + b * K;
                float *ob = out + b * N + n;
                switch (nb) {
                    case 1: tp_row(xb, xo, fac + b, K, wr, post, ob, N, 1); break;
                    case 2: tp_row(xb, xo, fac + b, K, wr, post, ob, N, 2); break;
                    case 3: tp_row(xb, xo, fac + b, K, wr, post, ob, N, 3); break;
                    default: tp_row(xb, xo, fac + b, K, wr, post, ob, N, 4); break;
                }
            }
            if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
        }
        }
        _mm_setcsr(csr);
    }
    free(xs);
    return 0;
}
"""


# Prescaled activation bytes (all rows) one K block keeps in L1 (0: K in one piece; see TP_KR in
# the source). 8 KB rather than 16: 11008x4096 from DRAM, interleaved medians of 15-21 (load
# 0.7): AVX-512 one-row build B=1 two threads 2.26/2.47 -> 1.61/1.68 ms (16 KB was not blocked),
# one thread 4.08/4.22 -> 2.15/2.11; AVX2 build (several rows) B=2 two threads 2.73 -> 2.10, one
# 4.36 -> 3.53, B=4 3.86 -> 3.46 / 7.12 -> 6.16; the AVX-512 build at B=2/4 unchanged; 4 KB no
# better than 8.
XBLOCK_BYTES = 8192

# Weight rows the shift-decode kernel can stream at once for one activation row.
SHIFT_ROWS = (1, 2, 4)


@functools.cache
def gemv_fp8_shift_kernel(
    isa: str,
    prefetch: int = 2048,
    chunk: int | None = None,
    hint: str = "T0",
    rows: int = 1,
    xblock: int | None = None,
) -> GemvKernel:
    """The shift-decode E4M3 GEMV (entry ``tp_gemv``, the same arguments as
    :func:`torchport.gemv.kernels.gemv_kernel`'s ``fp8_e4m3`` kernel). ``prefetch``: bytes ahead
    of the weight stream, ``hint``: its locality (:data:`torchport.gemv.kernels.PREFETCH_HINTS`);
    ``chunk``: weight bytes per row claim (default :data:`torchport.gemv.kernels.CHUNK_BYTES`;
    0 = static split); ``rows`` (1, 2 or 4): weight rows streamed at once for one activation row
    (each activation load serves them all; 1: the one-row loop); ``xblock``: bytes of prescaled
    activations (all rows) a K block keeps in L1 from two activation rows (default
    :data:`XBLOCK_BYTES`; 0: K in one piece)."""
    from torchport.gemv.kernels import BF16IO_C, CHUNK_BYTES, SCHED_C, _e4m3_table, check_hint

    check_hint(hint)
    if isa == "scalar":
        raise native.NativeError("the shift-decode FP8 GEMV needs AVX2 (isa is 'scalar')")
    if rows not in SHIFT_ROWS:
        raise ValueError(f"shift-decode FP8 gemv rows must be one of {SHIFT_ROWS}, got {rows!r}")
    if xblock is not None and xblock < 0:
        raise ValueError(f"shift-decode FP8 gemv xblock must be >= 0 bytes, got {xblock!r}")
    chunk = CHUNK_BYTES if chunk is None else chunk
    src = native.render(
        SCHED_C + _SOURCE + BF16IO_C,
        e4m3_table=_e4m3_table(),
        prefetch=prefetch,
        chunk=chunk,
        hint=hint,
        rows=rows,
        xblock=XBLOCK_BYTES if xblock is None else xblock,
    )
    name = f"gemv_fp8shift_{isa}_p{prefetch}{hint}_c{chunk}" + (f"_r{rows}" if rows > 1 else "")
    name += "" if xblock is None else f"_x{xblock}"
    return GemvKernel(native.build(src, name=name, isa=isa), "fp8_e4m3")
