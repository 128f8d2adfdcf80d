"""Native quantize/dequantize kernels for FP8, NVFP4 and MX, bit-exact with the references.

The C here mirrors the plain-torch references in :mod:`torchport.lowp.fp8`, ``nvfp4`` and ``mx``
step by step in float32 (same operations, same order, IEEE division where the reference divides),
so results match bit for bit; tests compare them over shape grids and random bit patterns.
Rows are independent and split over threads. Every kernel returns 1 (and writes garbage-free
partial output the caller discards) if it meets a non-finite input.
"""

from __future__ import annotations

import functools

import torch

from torchport import native
from torchport.lowp.formats import fp8_code_values
from torchport.native import FloatArg, IntArg, Kernel, TensorArg

_SOURCE = r"""
/* ---- element casts (inputs already clamped to the format's range and finite) ---- */
TP_INLINE uint32_t tp_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
TP_INLINE float tp_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

TP_INLINE uint8_t tp_f32_to_e4m3(float x) {
    uint32_t u = tp_bits(x), sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    if (u < 0x3c800000u) {                 /* below 2^-6: subnormal steps of 2^-9 */
        float m = nearbyintf(tp_float(u) * 512.0f);
        return (uint8_t)(sign | (uint32_t)m);
    }
    uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;   /* RNE to 3 mantissa bits */
    r -= 120u << 3;                        /* rebias exponent 127 -> 7 */
    if (r > 0x7eu) r = 0x7eu;              /* saturate at 448 */
    return (uint8_t)(sign | r);
}

TP_INLINE uint8_t tp_f32_to_e5m2(float x) {
    uint32_t u = tp_bits(x), sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    if (u < 0x38800000u) {                 /* below 2^-14: subnormal steps of 2^-16 */
        float m = nearbyintf(tp_float(u) * 65536.0f);
        return (uint8_t)(sign | (uint32_t)m);
    }
    uint32_t r = (u + 0xfffffu + ((u >> 21) & 1u)) >> 21;   /* RNE to 2 mantissa bits */
    r -= 112u << 2;                        /* rebias exponent 127 -> 15 */
    if (r > 0x7bu) r = 0x7bu;              /* saturate at 57344 */
    return (uint8_t)(sign | r);
}

/* Every FP8 code's float32 bits as torch's cast gives them (tables: one load per element, where
   the decode by fields branched per element: MX FP8 2048x4096 one thread 42-47 -> 5-8 ms, load
   3-5), NaN codes included:
   E4M3FN 0x7F / 0xFF are 0x7ff00000 / 0xfff00000 (the code's sign and mantissa; C's NAN is
   0x7fc00000), E5M2's exponent 31 infinities and NaNs the code's bits widened */
static const uint32_t TP_E4M3_BITS[256] = { ${e4m3_bits} };
static const uint32_t TP_E5M2_BITS[256] = { ${e5m2_bits} };
TP_INLINE float tp_e4m3_to_f32(uint8_t b) { return tp_float(TP_E4M3_BITS[b]); }
TP_INLINE float tp_e5m2_to_f32(uint8_t b) { return tp_float(TP_E5M2_BITS[b]); }

/* E2M1 code: RNE with ties to the even code, saturating at 6, sign of zero kept */
TP_INLINE uint8_t tp_f32_to_e2m1(float x) {
    float a = fabsf(x);
    uint8_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return (uint8_t)(c | ((tp_bits(x) >> 28) & 8u));
}
static const float TP_E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

TP_INLINE float tp_e8m0_to_f32(uint8_t e) {
    if (e == 255) return tp_float(0x7fc00001u);   /* NaN as torch's cast has it (NAN: 0x7fc00000) */
    return e ? tp_float((uint32_t)e << 23) : tp_float(0x00400000u);
}

TP_INLINE float tp_clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }


/* ---- AVX2 helpers: the same element casts, eight lanes at a time (same bits as the scalar ones) ---- */
#if defined(__AVX2__)
#define TP_VEC 1
TP_INLINE __m256 tp_abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
TP_INLINE float tp_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* all-ones lanes where v is Inf or NaN (exponent all ones) */
TP_INLINE __m256i tp_nonfinite8(__m256 v) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), e), e);
}
/* E2M1 codes in int32 lanes: the seven threshold compares of tp_f32_to_e2m1 summed, plus the sign */
TP_INLINE __m256i tp_e2m1_codes8(__m256 y) {
    const __m256 a = tp_abs8(y);
    __m256i c = _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_GT_OQ));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.75f), _CMP_GE_OQ)));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(1.25f), _CMP_GT_OQ)));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(1.75f), _CMP_GE_OQ)));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(2.5f), _CMP_GT_OQ)));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(3.5f), _CMP_GE_OQ)));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(5.0f), _CMP_GT_OQ)));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 28), _mm256_set1_epi32(8));
    return _mm256_or_si256(_mm256_sub_epi32(_mm256_setzero_si256(), c), sign);
}
/* 32 int32 byte values (four vectors, in element order) -> 32 bytes in element order */
TP_INLINE __m256i tp_bytes32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
/* 32 E2M1 codes -> 16 packed bytes, element 2i in the low nibble */
TP_INLINE __m128i tp_pack_fp4_32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i w = _mm256_maddubs_epi16(tp_bytes32(c0, c1, c2, c3), _mm256_set1_epi16(0x1001));
    return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
/* FP8 codes of finite inputs already clamped to the format's range (tp_f32_to_e4m3 / e5m2) */
TP_INLINE __m256i tp_fp8_codes8(__m256 y, int e5m2) {
    __m256i u = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    u = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const int sh = e5m2 ? 21 : 20;
    const __m128i shv = _mm_cvtsi32_si128(sh);
    const __m256 sub_mul = _mm256_set1_ps(e5m2 ? 65536.0f : 512.0f);
    const __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_mul_ps(_mm256_castsi256_ps(u), sub_mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i half = _mm256_set1_epi32(e5m2 ? 0xfffff : 0x7ffff);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srl_epi32(u, shv), _mm256_set1_epi32(1))));
    r = _mm256_sub_epi32(_mm256_srl_epi32(r, shv), _mm256_set1_epi32(e5m2 ? (112 << 2) : (120 << 3)));
    r = _mm256_min_epi32(r, _mm256_set1_epi32(e5m2 ? 0x7b : 0x7e));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(e5m2 ? 0x38800000 : 0x3c800000), u);
    return _mm256_or_si256(sign, _mm256_blendv_epi8(r, sub, is_sub));
}
TP_INLINE __m256 tp_clamp8(__m256 v, float lim) {
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-lim)), _mm256_set1_ps(lim));
}
#endif

${load_macro}

/* ---- NVFP4 (torchao nvfp4_quantize): per 16-block amax/6 -> E4M3 scale, data / scale -> E2M1 ---- */
TP_EXPORT int tp_nvfp4_quant(const IN_T *x, uint8_t *q, uint8_t *scales, int64_t rows, int64_t k,
                             double pts_d, int64_t has_pts, int64_t nthreads) {
    const float pts = (float)pts_d;
    const int64_t nb = k / 16;
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        int64_t b = 0;
#if defined(TP_VEC)
        __m256i badv = _mm256_setzero_si256();
        for (; b < nb; b += 2) {               /* two blocks per step; an odd last block runs half */
            const int two = b + 1 < nb;
            const IN_T *src = x + r * k + b * 16;
            __m256 v[4];
            v[0] = LOAD8_IN(src);
            v[1] = LOAD8_IN(src + 8);
            v[2] = two ? LOAD8_IN(src + 16) : _mm256_setzero_ps();
            v[3] = two ? LOAD8_IN(src + 24) : _mm256_setzero_ps();
            float total[2];
            for (int h = 0; h < 2; ++h) {
                badv = _mm256_or_si256(badv, _mm256_or_si256(tp_nonfinite8(v[2 * h]), tp_nonfinite8(v[2 * h + 1])));
                const float amax = tp_hmax8(_mm256_max_ps(tp_abs8(v[2 * h]), tp_abs8(v[2 * h + 1])));
                const float bs = amax / 6.0f;
                uint8_t s8;
                if (has_pts) {
                    s8 = tp_f32_to_e4m3(tp_clampf(bs / pts, 0.015625f, 448.0f));
                    total[h] = pts * tp_e4m3_to_f32(s8);
                } else {
                    s8 = tp_f32_to_e4m3(tp_clampf(bs, 0.015625f, 448.0f));
                    total[h] = tp_e4m3_to_f32(s8);
                }
                if (h == 0 || two) scales[r * nb + b + h] = s8;
            }
            const __m256 t0 = _mm256_set1_ps(total[0]), t1 = _mm256_set1_ps(total[1]);
            const __m128i packed = tp_pack_fp4_32(
                tp_e2m1_codes8(_mm256_div_ps(v[0], t0)), tp_e2m1_codes8(_mm256_div_ps(v[1], t0)),
                tp_e2m1_codes8(_mm256_div_ps(v[2], t1)), tp_e2m1_codes8(_mm256_div_ps(v[3], t1)));
            uint8_t *dst = q + r * (k / 2) + b * 8;
            if (two) _mm_storeu_si128((__m128i *)dst, packed);
            else _mm_storel_epi64((__m128i *)dst, packed);
        }
        if (!_mm256_testz_si256(badv, badv)) bad = 1;
#endif
        for (; b < nb; ++b) {
            const IN_T *src = x + r * k + b * 16;
            float v[16], amax = 0.0f;
            for (int i = 0; i < 16; ++i) {
                v[i] = LOAD_IN(src + i);
                if (!isfinite(v[i])) bad = 1;
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float bs = amax / 6.0f, total;
            uint8_t s8;
            if (has_pts) {
                s8 = tp_f32_to_e4m3(tp_clampf(bs / pts, 0.015625f, 448.0f));
                total = pts * tp_e4m3_to_f32(s8);
            } else {
                s8 = tp_f32_to_e4m3(tp_clampf(bs, 0.015625f, 448.0f));
                total = tp_e4m3_to_f32(s8);
            }
            scales[r * nb + b] = s8;
            uint8_t *dst = q + r * (k / 2) + b * 8;
            for (int i = 0; i < 8; ++i) {
                uint8_t lo = tp_f32_to_e2m1(tp_clampf(v[2 * i] / total, -6.0f, 6.0f));
                uint8_t hi = tp_f32_to_e2m1(tp_clampf(v[2 * i + 1] / total, -6.0f, 6.0f));
                dst[i] = (uint8_t)(lo | (hi << 4));
            }
        }
    }
    return bad;
}

/* ---- MX (OCP MX v1.0, torchao to_mx FLOOR): E8M0 = floor(log2 amax) - emax(elem), data * 2^-scale ---- */
/* elem: 0 = FP4 E2M1 (packed), 1 = FP8 E4M3FN, 2 = FP8 E5M2 */
TP_EXPORT int tp_mx_quant(const IN_T *x, uint8_t *q, uint8_t *scales, int64_t rows, int64_t k,
                          int64_t elem, int64_t nthreads) {
    const int64_t nb = k / 32;
    const int target = elem == 0 ? 2 : (elem == 1 ? 8 : 15);
    const float maxpos = elem == 0 ? 6.0f : (elem == 1 ? 448.0f : 57344.0f);
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        int64_t b = 0;
#if defined(TP_VEC)
        __m256i badv = _mm256_setzero_si256();
        for (; b < nb; ++b) {
            const IN_T *src = x + r * k + b * 32;
            __m256 v[4];
            for (int j = 0; j < 4; ++j) {
                v[j] = LOAD8_IN(src + 8 * j);
                badv = _mm256_or_si256(badv, tp_nonfinite8(v[j]));
            }
            const float amax = tp_hmax8(_mm256_max_ps(_mm256_max_ps(tp_abs8(v[0]), tp_abs8(v[1])),
                                                      _mm256_max_ps(tp_abs8(v[2]), tp_abs8(v[3]))));
            int e = (int)((tp_bits(amax) >> 23) & 0xffu) - 127 - target;
            e = e < -127 ? -127 : (e > 128 ? 128 : e);
            const uint8_t s = (uint8_t)(e + 127);
            scales[r * nb + b] = s;
            const uint8_t rb = (uint8_t)(254 - (int)s);
            const __m256 inv = _mm256_set1_ps(rb ? tp_float((uint32_t)rb << 23) : tp_float(0x00400000u));
            for (int j = 0; j < 4; ++j) v[j] = _mm256_mul_ps(v[j], inv);
            if (elem == 0) {
                _mm_storeu_si128((__m128i *)(q + r * (k / 2) + b * 16),
                                 tp_pack_fp4_32(tp_e2m1_codes8(v[0]), tp_e2m1_codes8(v[1]),
                                                tp_e2m1_codes8(v[2]), tp_e2m1_codes8(v[3])));
            } else {
                __m256i c[4];
                for (int j = 0; j < 4; ++j) c[j] = tp_fp8_codes8(tp_clamp8(v[j], maxpos), elem == 2);
                _mm256_storeu_si256((__m256i *)(q + r * k + b * 32), tp_bytes32(c[0], c[1], c[2], c[3]));
            }
        }
        if (!_mm256_testz_si256(badv, badv)) bad = 1;
#endif
        for (; b < nb; ++b) {
            const IN_T *src = x + r * k + b * 32;
            float v[32], amax = 0.0f;
            for (int i = 0; i < 32; ++i) {
                v[i] = LOAD_IN(src + i);
                if (!isfinite(v[i])) bad = 1;
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            int e = (int)((tp_bits(amax) >> 23) & 0xffu) - 127 - target;
            e = e < -127 ? -127 : (e > 128 ? 128 : e);
            uint8_t s = (uint8_t)(e + 127);
            scales[r * nb + b] = s;
            uint8_t rb = (uint8_t)(254 - (int)s);
            float inv = rb ? tp_float((uint32_t)rb << 23) : tp_float(0x00400000u);
            if (elem == 0) {
                uint8_t *dst = q + r * (k / 2) + b * 16;
                for (int i = 0; i < 16; ++i) {
                    uint8_t lo = tp_f32_to_e2m1(v[2 * i] * inv), hi = tp_f32_to_e2m1(v[2 * i + 1] * inv);
                    dst[i] = (uint8_t)(lo | (hi << 4));
                }
            } else {
                uint8_t *dst = q + r * k + b * 32;
                for (int i = 0; i < 32; ++i) {
                    float y = tp_clampf(v[i] * inv, -maxpos, maxpos);
                    dst[i] = elem == 1 ? tp_f32_to_e4m3(y) : tp_f32_to_e5m2(y);
                }
            }
        }
    }
    return bad;
}

/* ---- FP8 per row (torchao float8 recipe): s = max(amax, lb) / max, q = clamp(x / s) ---- */
/* rowwise = 0: one scale for the whole tensor, given in scale[0] (computed by the caller) */
TP_EXPORT int tp_fp8_quant(const IN_T *x, uint8_t *q, float *scale, int64_t rows, int64_t k,
                           int64_t e5m2, int64_t rowwise, int64_t nthreads) {
    const float maxpos = e5m2 ? 57344.0f : 448.0f;
    int bad = 0;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static) reduction(|:bad)
    for (int64_t r = 0; r < rows; ++r) {
        const IN_T *src = x + r * k;
        float s;
        if (rowwise) {
            float amax = 0.0f;
            int64_t i = 0;
#if defined(TP_VEC)
            __m256 m = _mm256_setzero_ps();
            __m256i badv = _mm256_setzero_si256();
            for (; i + 8 <= k; i += 8) {
                const __m256 v = LOAD8_IN(src + i);
                badv = _mm256_or_si256(badv, tp_nonfinite8(v));
                m = _mm256_max_ps(m, tp_abs8(v));
            }
            if (!_mm256_testz_si256(badv, badv)) bad = 1;
            amax = tp_hmax8(m);
#endif
            for (; i < k; ++i) {
                float v = LOAD_IN(src + i);
                if (!isfinite(v)) bad = 1;
                float a = fabsf(v);
                amax = a > amax ? a : amax;
            }
            s = (amax > 1e-12f ? amax : 1e-12f) / maxpos;
            scale[r] = s;
        } else {
            s = scale[0];
        }
        int64_t i = 0;
#if defined(TP_VEC)
        const __m256 sv = _mm256_set1_ps(s);
        for (; i + 32 <= k; i += 32) {
            __m256i c[4];
            for (int j = 0; j < 4; ++j)
                c[j] = tp_fp8_codes8(tp_clamp8(_mm256_div_ps(LOAD8_IN(src + i + 8 * j), sv), maxpos), (int)e5m2);
            _mm256_storeu_si256((__m256i *)(q + r * k + i), tp_bytes32(c[0], c[1], c[2], c[3]));
        }
#endif
        for (; i < k; ++i) {
            float y = tp_clampf(LOAD_IN(src + i) / s, -maxpos, maxpos);
            q[r * k + i] = e5m2 ? tp_f32_to_e5m2(y) : tp_f32_to_e4m3(y);
        }
    }
    return bad;
}

/* ---- dequantize to float32 ---- */
/* fmt: 0 = NVFP4 (E4M3 scales / 16, times pts), 1 = MXFP4, 2 = MX E4M3, 3 = MX E5M2 (E8M0 / 32) */
TP_EXPORT int tp_block_dequant(const uint8_t *q, const uint8_t *scales, float *out, int64_t rows,
                               int64_t k, int64_t fmt, double pts_d, int64_t nthreads) {
    const float pts = (float)pts_d;
    const int64_t bl = fmt == 0 ? 16 : 32, nb = k / bl;
    #pragma omp parallel for num_threads(rows * k < 65536 ? 1 : nthreads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t sb = scales[r * nb + b];
            float s = fmt == 0 ? (pts != pts ? pts : pts * tp_e4m3_to_f32(sb)) : tp_e8m0_to_f32(sb);
            float *o = out + r * k + b * bl;
            if (s != s) {   /* a NaN scale: its NaN in every element, as the reference's product
                               (torch's keeps the scale's NaN where the element is NaN too, and the
                               per-tensor scale's where the block scale is; a multiply here could
                               keep either operand's, as the compiler orders them) */
                for (int i = 0; i < bl; ++i) o[i] = s;
                continue;
            }
            if (fmt <= 1) {
                const uint8_t *p = q + r * (k / 2) + b * (bl / 2);
                for (int i = 0; i < bl / 2; ++i) {
                    o[2 * i] = TP_E2M1[p[i] & 15] * s;
                    o[2 * i + 1] = TP_E2M1[p[i] >> 4] * s;
                }
            } else {
                const uint8_t *p = q + r * k + b * bl;
                for (int i = 0; i < bl; ++i) o[i] = (fmt == 2 ? tp_e4m3_to_f32(p[i]) : tp_e5m2_to_f32(p[i])) * s;
            }
        }
    }
    return 0;
}
"""

_LOAD = {
    torch.float32: (
        "#define IN_T float\n#define LOAD_IN(p) (*(p))\n#define LOAD8_IN(p) _mm256_loadu_ps(p)"
    ),
    torch.bfloat16: (
        "#define IN_T uint16_t\n#define LOAD_IN(p) tp_bf16_to_f32(*(p))\n"
        "#define LOAD8_IN(p) _mm256_castsi256_ps(_mm256_slli_epi32("
        "_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))"
    ),
}
_TAG = {torch.float32: "f32", torch.bfloat16: "bf16"}
IN_DTYPES = (torch.float32, torch.bfloat16)


def _fp8_bits(dtype: torch.dtype) -> str:
    """A ``TP_E4M3_BITS`` / ``TP_E5M2_BITS`` initializer: torch's float32 value of every code of
    the FP8 ``dtype``, as bits (NaN payloads included)."""
    bits = fp8_code_values(dtype).view(torch.int32).tolist()
    return ", ".join(f"0x{b & 0xFFFFFFFF:08x}u" for b in bits)


def library(dtype: torch.dtype) -> object:
    """The compiled quantization library for input ``dtype`` at the current ISA level.

    AVX2 builds take the vector paths (eight lanes per step, the same bits); ``config.isa="scalar"``
    builds the scalar loops alone. Raises NativeError if unbuildable.
    """
    return _library(dtype, native.cpu_info().isa)


@functools.cache
def _library(dtype: torch.dtype, isa: str) -> object:
    src = native.render(
        _SOURCE,
        load_macro=_LOAD[dtype],
        e4m3_bits=_fp8_bits(torch.float8_e4m3fn),
        e5m2_bits=_fp8_bits(torch.float8_e5m2),
    )
    return native.build(src, name=f"lowp_quant_{_TAG[dtype]}", isa=isa)


def kernel(name: str, dtype: torch.dtype = torch.float32) -> Kernel:
    """One bound kernel of the quantization library for input ``dtype`` (current ISA level)."""
    return _kernel(name, dtype, native.cpu_info().isa)


@functools.cache
def _kernel(name: str, dtype: torch.dtype, isa: str) -> Kernel:
    lib = _library(dtype, isa)
    u8, f32 = (torch.uint8,), (torch.float32,)
    x = TensorArg("x", (dtype,))
    specs: dict[str, list[native.launch.ArgSpec]] = {
        "tp_nvfp4_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scales", u8),
            IntArg("rows"),
            IntArg("k"),
            FloatArg("pts"),
            IntArg("has_pts"),
            IntArg("nthreads"),
        ],
        "tp_mx_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scales", u8),
            IntArg("rows"),
            IntArg("k"),
            IntArg("elem"),
            IntArg("nthreads"),
        ],
        "tp_fp8_quant": [
            x,
            TensorArg("q", u8),
            TensorArg("scale", f32),
            IntArg("rows"),
            IntArg("k"),
            IntArg("e5m2"),
            IntArg("rowwise"),
            IntArg("nthreads"),
        ],
        "tp_block_dequant": [
            TensorArg("q", u8),
            TensorArg("scales", u8),
            TensorArg("out", f32),
            IntArg("rows"),
            IntArg("k"),
            IntArg("fmt"),
            FloatArg("pts"),
            IntArg("nthreads"),
        ],
    }
    return Kernel(lib, name, specs[name])  # type: ignore[arg-type]


def run(name: str, dtype: torch.dtype, *args: object) -> int:
    """Call a kernel without raising on status (status 1 = non-finite input)."""
    k = kernel(name, dtype)
    raw: list[object] = []
    for spec, v in zip(k.args, args):
        if isinstance(spec, TensorArg):
            assert isinstance(v, torch.Tensor)
            native.check_tensor(spec, v, k.name)
            raw.append(v.data_ptr())
        else:
            raw.append(v)
    return k.call_unchecked(*raw)
