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
staying in L1 beside the stream), so there the weights are widened instead and FMA'd with the
float32 activations: the float kernel's one-row loop (eight weights per zero-extend and shift,
512 bytes of T0 prefetch whatever ``prefetch`` says), its rounding (fused multiply-adds; the
last ``K % 8`` products rounded, then added). The tuner (:func:`torchport.gemv.ops.plan_for`)
times the kernels on bf16-valued activations, the case of a bf16 model; float32 activations with
bf16 weights take this kernel's widening path when it won that tuning.

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
the other GEMV kernels do (:data:`torchport.gemv.kernels.CHUNK_BYTES`). Needs ``isa="avx512"``
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

/* One weight row against NB (<= 4) bf16 activation rows (row b at xp + b * K32). */
TP_INLINE void tp_row(const uint16_t *xp, int64_t K32, const uint16_t *w, int64_t K, float *out,
                      int64_t ldo, const int NB) {
    __m512 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = _mm512_setzero_ps(); acc[b][1] = _mm512_setzero_ps(); }
    const int64_t KF = K / 32 * 32;   /* whole lines */
#define TP_LINE(wv, k, j) do {                                                                       \
        for (int b = 0; b < NB; ++b)                                                               \
            acc[b][j] = _mm512_dpbf16_ps(acc[b][j], wv,                                            \
                (__m512bh)_mm512_loadu_si512((const void *)(xp + b * K32 + (k))));                 \
    } while (0)
    int64_t k = 0;
    for (; k + 64 <= KF; k += 64) {
        _mm_prefetch((const char *)(w + k) + ${prefetch}, _MM_HINT_${hint});
        _mm_prefetch((const char *)(w + k) + ${prefetch} + 64, _MM_HINT_${hint});
        const __m512bh w0 = tp_wline(w, k), w1 = tp_wline(w, k + 32);
        TP_LINE(w0, k, 0);
        TP_LINE(w1, k + 32, 1);
    }
    if (k < KF) {
        _mm_prefetch((const char *)(w + k) + ${prefetch}, _MM_HINT_${hint});
        const __m512bh w0 = tp_wline(w, k);
        TP_LINE(w0, k, 0);
        k += 32;
    }
    if (k < K) {   /* the last K % 32 weights */
        const __mmask32 m = (__mmask32)((1u << (K - k)) - 1u);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        TP_LINE(w0, k, 0);
    }
#undef TP_LINE
    for (int b = 0; b < NB; ++b) out[b * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
}

/* Float32 activations that are not all bf16 values: the float kernel's one-row loop (widening on
   256-bit vectors, 8 weights per zero-extend and shift, 512 bytes of prefetch; 512-bit widening
   streamed at half this rate here), FMA'd with the float32 activations; the last K % 8 scalar. */
TP_INLINE __m256 tp_widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
TP_INLINE float tp_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
TP_INLINE void tp_row_f(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *out,
                        int64_t ldo, const int NB) {
    __m256 acc[4][2];
    for (int b = 0; b < NB; ++b) { acc[b][0] = _mm256_setzero_ps(); acc[b][1] = _mm256_setzero_ps(); }
    __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};   /* NB == 1: four chains */
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + 512, _MM_HINT_T0);   /* the float kernel's default */
        __m256 w4[4];
        for (int j = 0; j < 4; ++j) w4[j] = tp_widen8(w + k + 8 * j);
        if (NB == 1) {
            acc[0][0] = _mm256_fmadd_ps(w4[0], _mm256_loadu_ps(x + k), acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(w4[1], _mm256_loadu_ps(x + k + 8), acc[0][1]);
            acc1[0] = _mm256_fmadd_ps(w4[2], _mm256_loadu_ps(x + k + 16), acc1[0]);
            acc1[1] = _mm256_fmadd_ps(w4[3], _mm256_loadu_ps(x + k + 24), acc1[1]);
        } else {
            for (int b = 0; b < NB; ++b) {
                const float *xb = x + b * ldx + k;
                acc[b][0] = _mm256_fmadd_ps(w4[0], _mm256_loadu_ps(xb), acc[b][0]);
                acc[b][1] = _mm256_fmadd_ps(w4[1], _mm256_loadu_ps(xb + 8), acc[b][1]);
                acc[b][0] = _mm256_fmadd_ps(w4[2], _mm256_loadu_ps(xb + 16), acc[b][0]);
                acc[b][1] = _mm256_fmadd_ps(w4[3], _mm256_loadu_ps(xb + 24), acc[b][1]);
            }
        }
    }
    if (NB == 1) { acc[0][0] = _mm256_add_ps(acc[0][0], acc1[0]); acc[0][1] = _mm256_add_ps(acc[0][1], acc1[1]); }
    for (; k + 8 <= K; k += 8) {
        const __m256 w8 = tp_widen8(w + k);
        for (int b = 0; b < NB; ++b) acc[b][0] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(x + b * ldx + k), acc[b][0]);
    }
    for (int b = 0; b < NB; ++b) {
        float s = tp_hsum8(_mm256_add_ps(acc[b][0], acc[b][1]));
        for (int64_t j = k; j < K; ++j) {
            uint32_t u = (uint32_t)w[j] << 16;
            float wf;
            memcpy(&wf, &u, 4);
            s += wf * x[b * ldx + j];
        }
        out[b * ldo] = s;
    }
}

/* Same contract as the float kernel's bf16 GEMV (scales, rowscale and pts unused). */
TP_EXPORT int tp_gemv(const float *x, int64_t B, int64_t K, const uint16_t *w, const uint8_t *scales,
                      const float *rowscale, double pts_d, const float *bias, int64_t has_bias,
                      float *out, int64_t N, int64_t nthreads) {
    (void)scales;
    (void)rowscale;
    (void)pts_d;
    const int64_t K32 = (K + 31) / 32 * 32;
    uint16_t *xp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(B * K32) + 64);
    if (!xp) return 3;
    int dp = 1;   /* every activation a bf16 value: the pair-dot path */
    for (int64_t b = 0; b < B && dp; ++b) dp = tp_bf16_row(x + b * K, K, K32, xp + b * K32);
    int64_t nt = (N * K * (B < 4 ? B : 4) < 65536) ? 1 : nthreads;
    int64_t tp_next_ = 0;
    const int64_t tp_step_ = tp_chunk_rows(nt, K * 2, ${chunk});
    #pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        int tp_st_ = 0;
        while (tp_claim_rows(&tp_next_, N, tp_step_, &tp_st_, &lo, &hi)) {
        for (int64_t n = lo; n < hi; ++n) {
            const uint16_t *wr = w + n * K;
            for (int64_t b = 0; b < B; b += 4) {
                const int64_t nb = B - b < 4 ? B - b : 4;
                const uint16_t *xb = xp + b * K32;
                const float *xf = x + b * K;
                float *ob = out + b * N + n;
                if (dp) {
                    switch (nb) {
                        case 1: tp_row(xb, K32, wr, K, ob, N, 1); break;
                        case 2: tp_row(xb, K32, wr, K, ob, N, 2); break;
                        case 3: tp_row(xb, K32, wr, K, ob, N, 3); break;
                        default: tp_row(xb, K32, wr, K, ob, N, 4); break;
                    }
                } else {
                    switch (nb) {
                        case 1: tp_row_f(xf, K, wr, K, ob, N, 1); break;
                        case 2: tp_row_f(xf, K, wr, K, ob, N, 2); break;
                        case 3: tp_row_f(xf, K, wr, K, ob, N, 3); break;
                        default: tp_row_f(xf, K, wr, K, ob, N, 4); break;
                    }
                }
            }
            if (has_bias) for (int64_t b = 0; b < B; ++b) out[b * N + n] += bias[n];
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


@functools.cache
def gemv_bf16_dp_kernel(
    isa: str, prefetch: int = 0, chunk: int | None = None, hint: str = "T0"
) -> Kernel:
    """The ``vdpbf16ps`` bf16 GEMV (entry ``tp_gemv``, the same arguments as
    :func:`torchport.gemv.kernels.gemv_kernel`'s ``bf16`` kernel). ``prefetch``: bytes ahead of
    the weight stream, ``hint``: its locality (:data:`torchport.gemv.kernels.PREFETCH_HINTS`);
    ``chunk``: weight bytes per row claim (default :data:`torchport.gemv.kernels.CHUNK_BYTES`;
    0 = static split). Raises ``NativeError`` unless ``isa`` is ``"avx512"`` on a CPU with
    AVX512-BF16."""
    from torchport.gemv.kernels import CHUNK_BYTES, SCHED_C, check_hint, gemv_args

    check_hint(hint)
    if isa != "avx512" or not native.cpu_info().has_avx512_bf16:
        raise native.NativeError(
            f"the vdpbf16ps GEMV needs isa 'avx512' with AVX512-BF16 (isa is {isa!r}, "
            f"AVX512-BF16 {'present' if native.cpu_info().has_avx512_bf16 else 'absent'})"
        )
    chunk = CHUNK_BYTES if chunk is None else chunk
    src = native.render(SCHED_C + _SOURCE, prefetch=prefetch, chunk=chunk, hint=hint)
    lib = native.build(src, name=f"gemv_bf16dp_{isa}_p{prefetch}{hint}_c{chunk}", isa=isa)
    return Kernel(lib, "tp_gemv", gemv_args("bf16"))
