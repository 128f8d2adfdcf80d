"""bfloat16 decode GEMV on the AVX512-BF16 pair dot (``vdpbf16ps``): no widening of the weights.

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
no better than the two-row loop (one thread 9.4–9.8 vs 9.6 ms, two threads 5.9–6.4 vs 5.4). Needs ``isa="avx512"``
on a CPU with AVX512-BF16; the caller (:func:`torchport.gemv.ops.candidates`) offers it only
there. Returns status 3 when the narrowed activations (``2 · B · K`` bytes) cannot be allocated.
"""

from __future__ import annotations

import functools

from torchport import native
from torchport.native import Kernel

_SOURCE = r"""
#include <stdlib.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Row x (K floats) as bf16 values into xh[0..K32) (zero past K) if every element is one (a bf16
   activation widened to float32); returns 0 (xh then unusable) as soon as one is not. */
static int tp_bf16_row(const float *x, int64_t K, int64_t K32, uint16_t *xh) {
    for (int64_t k = 0; k < K32; ++k) {
        float v = k < K ? x[k] : 0.0f;
        uint32_t u;
        memcpy(&u, &v, 4);
        if (u & 0xFFFFu) return 0;
        xh[k] = (uint16_t)(u >> 16);
    }
    return 1;
}

/* The 32 bf16 weights from element k (one 64-byte line as two 256-bit loads). */
TP_INLINE __m512bh tp_wline(const uint16_t *w, int64_t k) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + k))),
                                         _mm256_loadu_si256((const __m256i *)(w + k + 16)), 1);
    return (__m512bh)v;
}

/* A weight row's two-line steps over k0 <= k < k1 (multiples of 64) against NB (<= 4) bf16
   activation rows (row b at xp + b * K32), the accumulators kept in accp (NB x 2 vectors) between
   calls, so a row's sums do not depend on whether K runs in one piece (tp_row_dp) or in blocks. At
   each step prefetches pfa + 2 k with the kernel's hint (the row's own stream ahead) and the lines
   of pfw (the weight row the next row group reads) into L2, either unless NULL. */
TP_INLINE void tp_dp_part(const uint16_t *xp, int64_t K32, const uint16_t *w, const char *pfa,
                          const uint16_t *pfw, int64_t k0, int64_t k1, __m512 *accp, const int NB) {
    __m512 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = accp[2 * b]; acc[b][1] = accp[2 * b + 1]; }
    for (int64_t k = k0; k < k1; k += 64) {
        if (pfa) {
            _mm_prefetch(pfa + 2 * k, _MM_HINT_${hint});
            _mm_prefetch(pfa + 2 * k + 64, _MM_HINT_${hint});
        }
        if (pfw) {
            _mm_prefetch((const char *)(pfw + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(pfw + k) + 64, _MM_HINT_T1);
        }
        const __m512bh w0 = tp_wline(w, k), w1 = tp_wline(w, k + 32);
        for (int b = 0; b < NB; ++b) {
            acc[b][0] = _mm512_dpbf16_ps(acc[b][0], w0, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k)));
            acc[b][1] = _mm512_dpbf16_ps(acc[b][1], w1, (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + k + 32)));
        }
    }
    for (int b = 0; b < NB; ++b) { accp[2 * b] = acc[b][0]; accp[2 * b + 1] = acc[b][1]; }
}

/* The end of a row: from k = K / 64 * 64 a last whole line (prefetching pfa + 2 k unless NULL)
   and the masked K % 32 tail, both into accumulator 0, then the row sums. */
TP_INLINE void tp_dp_rest(const uint16_t *xp, int64_t K32, const uint16_t *w, const char *pfa, int64_t K,
                          const __m512 *accp, float *out, int64_t ldo, const int NB) {
    __m512 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = accp[2 * b]; acc[b][1] = accp[2 * b + 1]; }
    int64_t k = K / 64 * 64;
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
    for (int b = 0; b < NB; ++b) out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
}

/* One weight row against NB (<= 4) bf16 activation rows (row b at xp + b * K32): K in one piece. */
TP_INLINE void tp_row_dp(const uint16_t *xp, int64_t K32, const uint16_t *w, int64_t K, float *out,
                         int64_t ldo, const int NB) {
    __m512 acc[8];
    for (int i = 0; i < 2 * NB; ++i) acc[i] = _mm512_setzero_ps();
    const char *pfa = (const char *)w + ${dp_prefetch};
    tp_dp_part(xp, K32, w, pfa, NULL, 0, K / 64 * 64, acc, NB);
    tp_dp_rest(xp, K32, w, pfa, K, acc, out, ldo, NB);
}

/* Two consecutive weight rows against NB (<= 4) bf16 activation rows: every activation load
   serves both; per row the same operations in the same order as tp_row_dp (same bits). */
TP_INLINE void tp_row_dp_r2(const uint16_t *xp, int64_t K32, const uint16_t *w, int64_t K, float *out,
                            int64_t ldo, const int NB) {
    __m512 acc[2][4][2];
    for (int b = 0; b < NB; ++b)
        for (int r = 0; r < 2; ++r) { acc[r][b][0] = _mm512_setzero_ps(); acc[r][b][1] = _mm512_setzero_ps(); }
    const int64_t KF = K / 32 * 32;
    const uint16_t *w1 = w + K;
#define TP_LINE2(v0, v1, k, j) do {                                                                  \
        for (int b = 0; b < NB; ++b) {                                                             \
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + (k)));  \
            acc[0][b][j] = _mm512_dpbf16_ps(acc[0][b][j], v0, xv);                                 \
            acc[1][b][j] = _mm512_dpbf16_ps(acc[1][b][j], v1, xv);                                 \
        }                                                                                          \
    } while (0)
    int64_t k = 0;
    for (; k + 64 <= KF; k += 64) {
        _mm_prefetch((const char *)(w + k) + ${dp_prefetch}, _MM_HINT_${hint});
        _mm_prefetch((const char *)(w + k) + ${dp_prefetch} + 64, _MM_HINT_${hint});
        _mm_prefetch((const char *)(w1 + k) + ${dp_prefetch}, _MM_HINT_${hint});
        _mm_prefetch((const char *)(w1 + k) + ${dp_prefetch} + 64, _MM_HINT_${hint});
        TP_LINE2(tp_wline(w, k), tp_wline(w1, k), k, 0);
        TP_LINE2(tp_wline(w, k + 32), tp_wline(w1, k + 32), k + 32, 1);
    }
    if (k < KF) {
        TP_LINE2(tp_wline(w, k), tp_wline(w1, k), k, 0);
        k += 32;
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        TP_LINE2((__m512bh)_mm512_maskz_loadu_epi16(m, w + k), (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + k), k, 0);
    }
#undef TP_LINE2
    for (int b = 0; b < NB; ++b) {
        out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][b][0], acc[0][b][1]));
        out[b * ldo + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc[1][b][0], acc[1][b][1]));
    }
}

/* K blocks (two to four activation rows): where the narrowed rows (2 B K32 bytes) exceed
   TP_XBYTES, TP_KR weight rows at a time run K in blocks of TP_XBYTES / (2 B) activations (a block
   of every row stays in L1 while the TP_KR rows use it), their accumulators parked between
   blocks, and the next TP_KR rows' lines are prefetched into L2 as the current ones are read. */
#define TP_KR 8
#define TP_XBYTES ${xblock}

/* Same contract as the float kernel's bf16 GEMV (tp_gemv_float above: the float kernel itself,
   which serves activations that are not all bf16 values). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint16_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32;
    uint16_t *xp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(B * K32) + 64);
    if (!xp) return 3;
    int dp = 1;   /* every activation a bf16 value: the pair-dot path */
    for (int64_t b = 0; b < B && dp; ++b) dp = tp_bf16_row(x + b * K, K, K32, xp + b * K32);
    if (!dp) {   /* float32 activations: the float kernel */
        free(xp);
        return tp_gemv_float(x, B, K, w, scales, rowscale, pts_d, bias, has_bias, out, N, nthreads);
    }
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K * 2, ${chunk});
    const int64_t K64 = K / 64 * 64;
    int64_t kb_len = 0;   /* K block (activations per row), 0: K in one piece */
    if (TP_XBYTES > 0 && B >= 2 && B <= 4 && 2 * B * K32 > TP_XBYTES) {
        kb_len = TP_XBYTES / (2 * B) / 64 * 64;
        if (kb_len < 64) kb_len = 64;
    }
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        int tp_st_ = 0;
        while (tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        if (kb_len) {   /* K blocks (see TP_KR) */
            for (int64_t n0 = lo; n0 < hi; n0 += TP_KR) {
                const int64_t n1 = n0 + TP_KR < hi ? n0 + TP_KR : hi;
                __m512 accb[TP_KR * 16];
                for (int64_t i = 0; i < (n1 - n0) * B * 2; ++i) accb[i] = _mm512_setzero_ps();
                for (int64_t kb = 0; kb < K64; kb += kb_len) {
                    const int64_t ke = kb + kb_len < K64 ? kb + kb_len : K64;
                    for (int64_t n = n0; n < n1; ++n) {
                        const uint16_t *wr = w + n * K, *pfw = n + TP_KR < hi ? wr + TP_KR * K : NULL;
                        for (int64_t b = 0; b < B; b += 4) {
                            const int64_t nb = B - b < 4 ? B - b : 4;
                            const uint16_t *xb = xp + b * K32, *pf = b ? NULL : pfw;
                            __m512 *ap = accb + ((n - n0) * B + b) * 2;
                            switch (nb) {
                                case 1: tp_dp_part(xb, K32, wr, NULL, pf, kb, ke, ap, 1); break;
                                case 2: tp_dp_part(xb, K32, wr, NULL, pf, kb, ke, ap, 2); break;
                                case 3: tp_dp_part(xb, K32, wr, NULL, pf, kb, ke, ap, 3); break;
                                default: tp_dp_part(xb, K32, wr, NULL, pf, kb, ke, ap, 4); break;
                            }
                        }
                    }
                }
                for (int64_t n = n0; n < n1; ++n) {
                    for (int64_t b = 0; b < B; b += 4) {
                        const int64_t nb = B - b < 4 ? B - b : 4;
                        const uint16_t *xb = xp + b * K32, *wr = w + n * K;
                        const __m512 *ap = accb + ((n - n0) * B + b) * 2;
                        float *ob = out + b * N + n;
                        switch (nb) {
                            case 1: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 1); break;
                            case 2: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 2); break;
                            case 3: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 3); break;
                            default: tp_dp_rest(xb, K32, wr, NULL, K, ap, ob, N, 4); break;
                        }
                    }
                    if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
                }
            }
            continue;
        }
        for (int64_t n = lo; n < hi;) {
            const uint16_t *wr = w + n * K;
            const int rows = (B >= 4 && n + 1 < hi) ? 2 : 1;
            for (int64_t b = 0; b < B; b += 4) {
                const int64_t nb = B - b < 4 ? B - b : 4;
                const uint16_t *xb = xp + b * K32;
                float *ob = out + b * N + n;
                if (rows == 2) {
                    switch (nb) {
                        case 1: tp_row_dp_r2(xb, K32, wr, K, ob, N, 1); break;
                        case 2: tp_row_dp_r2(xb, K32, wr, K, ob, N, 2); break;
                        case 3: tp_row_dp_r2(xb, K32, wr, K, ob, N, 3); break;
                        default: tp_row_dp_r2(xb, K32, wr, K, ob, N, 4); break;
                    }
                    continue;
                }
                switch (nb) {
                    case 1: tp_row_dp(xb, K32, wr, K, ob, N, 1); break;
                    case 2: tp_row_dp(xb, K32, wr, K, ob, N, 2); break;
                    case 3: tp_row_dp(xb, K32, wr, K, ob, N, 3); break;
                    default: tp_row_dp(xb, K32, wr, K, ob, N, 4); break;
                }
            }
            if (has_bias)
                for (int r = 0; r < rows; ++r)
                    for (int64_t b = 0; b < B; ++b) out[b * N + n + r] += bias[n + r];
            n += rows;
        }
        }
    }
    free(xp);
    return 0;
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


def _float_kernel_source() -> str:
    """The float kernel's source (:data:`torchport.gemv.kernels._SOURCE`) with its entry renamed
    ``tp_gemv_float``, a static function the pair-dot entry hands float32 activations to."""
    from torchport.gemv.kernels import _SOURCE as FLOAT_SOURCE

    entry = "TP_EXPORT int tp_gemv("
    if FLOAT_SOURCE.count(entry) != 1:
        raise RuntimeError("the float GEMV source must define its tp_gemv entry exactly once")
    return FLOAT_SOURCE.replace(entry, "static int tp_gemv_float(")


@functools.cache
def gemv_bf16_dp_kernel(
    isa: str,
    prefetch: int = 0,
    chunk: int | None = None,
    hint: str = "T0",
    xblock: int | None = None,
) -> Kernel:
    """The ``vdpbf16ps`` bf16 GEMV (entry ``tp_gemv``, the same arguments as
    :func:`torchport.gemv.kernels.gemv_kernel`'s ``bf16`` kernel). ``prefetch``: bytes ahead of
    the weight stream, ``hint``: its locality (:data:`torchport.gemv.kernels.PREFETCH_HINTS`);
    ``chunk``: weight bytes per row claim (default :data:`torchport.gemv.kernels.CHUNK_BYTES`;
    0 = static split); ``xblock``: bytes of narrowed activations (all rows) a K block keeps in L1
    for two to four activation rows (default :data:`XBLOCK_BYTES`; 0: K in one piece). Raises
    ``NativeError`` unless ``isa`` is ``"avx512"`` on a CPU with AVX512-BF16."""
    from torchport.gemv.kernels import CHUNK_BYTES, SCHED_C, _e4m3_table, check_hint, gemv_args
    from torchport.gemv.kernels import XBLOCK_BYTES as FLOAT_XBLOCK_BYTES

    check_hint(hint)
    if isa != "avx512" or not native.cpu_info().has_avx512_bf16:
        raise native.NativeError(
            f"the vdpbf16ps GEMV needs isa 'avx512' with AVX512-BF16 (isa is {isa!r}, "
            f"AVX512-BF16 {'present' if native.cpu_info().has_avx512_bf16 else 'absent'})"
        )
    if xblock is not None and xblock < 0:
        raise ValueError(f"vdpbf16ps gemv xblock must be >= 0 bytes, got {xblock!r}")
    chunk = CHUNK_BYTES if chunk is None else chunk
    src = native.render(
        SCHED_C + _float_kernel_source() + _SOURCE,
        e4m3_table=_e4m3_table(),
        fmt="bf16",
        prefetch=FLOAT_PREFETCH,
        rows4=0,
        chunk=chunk,
        dp_prefetch=prefetch,
        hint=hint,
        xblock=XBLOCK_BYTES if xblock is None else xblock,
        fxblock=FLOAT_XBLOCK_BYTES,
    )
    name = f"gemv_bf16dp_{isa}_p{prefetch}{hint}_c{chunk}"
    name += "" if xblock is None else f"_x{xblock}"
    lib = native.build(src, name=name, isa=isa)
    return Kernel(lib, "tp_gemv", gemv_args("bf16"))
