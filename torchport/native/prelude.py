"""The C prelude every generated kernel starts with: headers, export macro, bf16/fp16 helpers.

bf16 conversion rounds to nearest, ties to even, and maps NaN to the quiet NaN 0x7FC0, exactly as
``torch`` does (``c10::BFloat16`` ``round_to_nearest_even``).
"""

from __future__ import annotations

import string

# The system and intrinsics headers every kernel starts with (``native.pch`` precompiles them)
HEADERS = r"""
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX2__) && !defined(_IMMINTRIN_H_INCLUDED)
/* The intrinsics of the extensions the flags enable, not all of <immintrin.h>: it declares every
   x86 extension's, and reading it took 0.18 of a pack kernel's 0.25 s compile at -mavx512* */
#include <smmintrin.h>
#if __GNUC__ >= 11
#include <x86gprintrin.h>
#endif
#define _IMMINTRIN_H_INCLUDED
#include <avxintrin.h>
#include <avx2intrin.h>
#include <fmaintrin.h>
#if defined(__F16C__)
#include <f16cintrin.h>
#endif
#if defined(__AVX512F__)
#include <avx512fintrin.h>
#endif
#if defined(__AVX512VL__)
#include <avx512vlintrin.h>
#endif
#if defined(__AVX512BW__)
#include <avx512bwintrin.h>
#endif
#if defined(__AVX512DQ__)
#include <avx512dqintrin.h>
#endif
#if defined(__AVX512VL__) && defined(__AVX512BW__)
#include <avx512vlbwintrin.h>
#endif
#if defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <avx512vldqintrin.h>
#endif
#if defined(__AVX512VNNI__)
#include <avx512vnniintrin.h>
#if defined(__AVX512VL__)
#include <avx512vnnivlintrin.h>
#endif
#endif
#if defined(__AVX512VBMI__)
#include <avx512vbmiintrin.h>
#if defined(__AVX512VL__)
#include <avx512vbmivlintrin.h>
#endif
#endif
#if defined(__AVX512BF16__)
#if defined(__AVX512VL__)
#include <avx512bf16vlintrin.h>
#endif
#include <avx512bf16intrin.h>
#endif
#if defined(__AMX_TILE__)
#include <amxtileintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <amxbf16intrin.h>
#endif
#if defined(__AMX_INT8__)
#include <amxint8intrin.h>
#endif
#elif defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
"""

_DEFINITIONS = r"""
#define TP_EXPORT __attribute__((visibility("default")))
#define TP_INLINE static inline __attribute__((always_inline))
#define TP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TP_MAX(a, b) ((a) > (b) ? (a) : (b))
/* In sources that typedef T (float or double): the exponent e of the power-of-two scale 2^-e that
   brings a matrix whose largest |entry| is amax into [1, 2) before its sums of squares (0 for a
   zero or non-finite amax), clamped at the smallest normal exponent so that 2^-e stays finite for
   a subnormal-only matrix */
#define TP_MIN_NORMAL_EXP ((int)(sizeof(T) == 4 ? -126 : -1022))
#define TP_SCALE_EXP(amax) \
    ((amax) > 0 && isfinite(amax) ? TP_MAX(ilogb(amax), TP_MIN_NORMAL_EXP) : 0)

TP_INLINE float tp_bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

TP_INLINE uint16_t tp_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX2__)
/* 8 bf16 -> 8 fp32 */
TP_INLINE __m256 tp_bf16x8_to_f32(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* 8 fp32 -> 8 bf16, round to nearest even, NaN -> 0x7fc0 */
TP_INLINE void tp_f32x8_to_bf16(uint16_t *p, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
TP_INLINE __m512 tp_bf16x16_to_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* 16 fp32 -> their bf16 bits in the low halves of 16 words (round to nearest even, NaN -> 0x7fc0) */
TP_INLINE __m512i tp_f32x16_bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
TP_INLINE void tp_f32x16_to_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(tp_f32x16_bf16_bits(v)));
}
/* 32 fp32 (lo: the first 16) -> one 64-byte vector of 32 bf16, rounded as tp_f32x16_to_bf16.
   With AVX512-BF16 one vcvtne2ps2bf16 (nearest even too) unless a lane is NaN or subnormal,
   which that instruction keeps the payload of or flushes to zero */
TP_INLINE __m512i tp_f32x32_to_bf16_line(__m512 lo, __m512 hi) {
#if defined(__AVX512BF16__)
    const int odd = 0x01 | 0x20 | 0x80; /* fpclass: quiet NaN, subnormal, signalling NaN */
    if (__builtin_expect((_mm512_fpclass_ps_mask(lo, odd) | _mm512_fpclass_ps_mask(hi, odd)) == 0, 1))
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#endif
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
        34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_epi16(tp_f32x16_bf16_bits(lo), even, tp_f32x16_bf16_bits(hi));
}
#endif

/* Split [0, n) into nt nearly equal chunks aligned to `align`; chunk t is [*lo, *hi). */
TP_INLINE void tp_chunk(int64_t n, int64_t nt, int64_t t, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t blocks = (n + align - 1) / align;
    int64_t per = blocks / nt, extra = blocks % nt;
    int64_t b0 = t * per + TP_MIN(t, extra);
    int64_t b1 = b0 + per + (t < extra ? 1 : 0);
    *lo = TP_MIN(n, b0 * align);
    *hi = TP_MIN(n, b1 * align);
}
"""

PRELUDE = HEADERS + _DEFINITIONS

# The start of every source that runs AMX tiles (the GEMM engine's AMX-BF16 kernel, the FP4
# GEMV's AMX-INT8 one; compiled with -mamx-tile): the tile state's permission, a compiler barrier
# for tile loads and the tile configuration's layout.
AMX_TILE_C = r"""
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
   XTILEDATA, once per process; torch's oneDNN asks the same): 1 granted, 0 refused */
static int tp_amx_ok = -1;
static int tp_amx_permit(void) {
    int ok = __atomic_load_n(&tp_amx_ok, __ATOMIC_ACQUIRE);
    if (ok < 0) {
        ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&tp_amx_ok, ok, __ATOMIC_RELEASE);
    }
    return ok;
}
/* gcc's tile intrinsics tell the compiler of no memory access (_tile_loadd has no memory operand,
   _tile_loadconfig an 8-byte one): a compiler barrier before each tile load of memory that C
   code wrote (the config, the packed A, the sums) keeps those stores ahead of it */
#define TP_TILE_FENCE() __asm__ volatile("" ::: "memory")
TP_EXPORT int tp_amx_available(void) { return tp_amx_permit(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tp_tilecfg_t;
_Static_assert(sizeof(tp_tilecfg_t) == 64, "the tile configuration is 64 bytes");
"""


def render(body: str, **params: object) -> str:
    """Prelude + a template body with ``${name}`` parameters substituted (``string.Template``).

    Every parameter must be used and every placeholder given, so a template and its parameters
    cannot drift apart silently.
    """
    tpl = string.Template(body)
    names = set(tpl.get_identifiers())
    if names != set(params):
        raise ValueError(
            f"template parameters mismatch: missing {sorted(names - set(params))}, "
            f"unused {sorted(set(params) - names)}"
        )
    header = "\n".join(f"/* param {k} = {v} */" for k, v in sorted(params.items()))
    return PRELUDE + "\n" + header + "\n" + tpl.substitute(params)
