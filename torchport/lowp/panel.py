"""Native packing of a decoded weight panel into the GEMM engine's B layout.

A quantized weight ``W [N, K]`` is decoded one row panel at a time to float32; the GEMM engine
multiplies ``x @ W.T`` from ``W.T`` packed as ``[ceil(N/nr), K, nr]`` (``nr`` rows of ``W``
interleaved per K step, the last group zero padded: :func:`torchport.gemm.pack_b` of ``W.T``).
Through torch that is a strided copy costing about as much as the GEMM on the panel (a fresh
panel is packed on every call: the engine's pack cache is for weights that stay), so this
kernel does it in one pass: each thread takes groups of ``nr`` rows and, with AVX2, moves 8 rows x
8 columns at a time through an 8x8 register transpose, writing its packed group sequentially
(scalar loops for a partial last group, the K tail and non-AVX2 builds).
:func:`pack_rows_reference` (``pack_b_reference`` of ``W.T``) is the reference.

:func:`decode_rows_bf16` decodes a panel of quantized rows straight to bfloat16 for the bf16
prefill path (:mod:`torchport.lowp.scaled_mm`): element value times block scale, computed in
float32 and rounded to nearest even. The products it is used for are exact in bfloat16 (an E2M1
or FP8 value has at most 4 significant bits, an E4M3 block scale 4 and an E8M0 scale 1: at most
8 bits together; the caller keeps them out of bfloat16's subnormal range), so the rounding never
acts there. For FP4 each block's 16 possible bf16 values are tabulated once and every byte is two
table reads. :func:`decode_rows_bf16_reference` (plain torch) is the reference, bit for bit.
"""

from __future__ import annotations

import functools

import torch

from torchport import native
from torchport.gemm import pack_b, pack_b_reference
from torchport.lowp.formats import (
    LowPrecisionError,
    e2m1_to_f32,
    e4m3_to_f32,
    e8m0_to_f32,
    unpack_fp4,
)
from torchport.native import IntArg, Kernel, TensorArg

_SOURCE = r"""
#if defined(__AVX2__)
/* 8 rows of 8 floats (r[i] = row i) -> r[t] = column t */
static inline void tp_tr8x8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

TP_EXPORT int tp_pack_rows(const float *w, float *out, int64_t rows, int64_t k, int64_t nr,
                           int64_t nthreads) {
    const int64_t groups = (rows + nr - 1) / nr;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * nr;
        const int64_t h = rows - r0 < nr ? rows - r0 : nr;
        float *dst = out + g * k * nr;
        int64_t kv = 0;
#if defined(__AVX2__)
        if (h == nr && nr % 8 == 0) {  /* full group: 8x8 register transposes */
            kv = k - k % 8;
            for (int64_t k0 = 0; k0 < kv; k0 += 8) {
                for (int64_t j = 0; j < nr; j += 8) {
                    __m256 r[8];
                    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + (r0 + j + i) * k + k0);
                    tp_tr8x8(r);
                    for (int t = 0; t < 8; ++t) _mm256_storeu_ps(dst + (k0 + t) * nr + j, r[t]);
                }
            }
        }
#endif
        for (int64_t kk = kv; kk < k; ++kk) {
            float *d = dst + kk * nr;
            int64_t j = 0;
            for (; j < h; ++j) d[j] = w[(r0 + j) * k + kk];
            for (; j < nr; ++j) d[j] = 0.0f;
        }
    }
    return 0;
}
"""

_DECODE_SOURCE = r"""
#include <string.h>

static inline uint16_t tp_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;  /* NaN: torch's bf16 NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* rows of q (fp4: k/2 bytes, element 2i in the low nibble; else k bytes) -> bf16 out [rows, k].
   value = lut[code] * slut[scale byte of its block of bl] (bl == 0: no block scale). */
TP_EXPORT int tp_decode_bf16(const uint8_t *q, const uint8_t *sc, const float *lut,
                             const float *slut, uint16_t *out, int64_t rows, int64_t k,
                             int64_t fp4, int64_t bl, int64_t nthreads) {
    const int64_t rb = fp4 ? k / 2 : k, nb = bl ? k / bl : 0;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *p = q + r * rb;
        uint16_t *o = out + r * k;
        if (fp4) {
#if defined(__AVX512F__)
            if (bl % 16 == 0) {  /* 16 elements (8 bytes) per step: table permute, RNE, pack */
                const __m512 tab = _mm512_loadu_ps(lut);
                const __m128i low4 = _mm_set1_epi8(15);
                const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
                const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
                const __m512i qnan = _mm512_set1_epi32(0xffff);
                for (int64_t b = 0; b < nb; ++b) {
                    const __m512 s = _mm512_set1_ps(slut[sc[r * nb + b]]);
                    for (int64_t i = b * bl; i < (b + 1) * bl; i += 16) {
                        __m128i x = _mm_loadl_epi64((const __m128i *)(p + i / 2));
                        __m128i lo = _mm_and_si128(x, low4);
                        __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), low4);
                        __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
                        __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(idx, tab), s));
                        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
                        __m512i rn = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, odd)), 16);
                        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
                        rn = _mm512_mask_mov_epi32(rn, nan, qnan);
                        _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(rn));
                    }
                }
                continue;
            }
#endif
            for (int64_t b = 0; b < nb; ++b) {
                const float s = slut[sc[r * nb + b]];
                uint32_t t[16];
                for (int i = 0; i < 16; ++i) t[i] = tp_bf16_rne(lut[i] * s);
                const uint8_t *pb = p + b * (bl / 2);
                uint16_t *ob = o + b * bl;
                for (int64_t i = 0; i < bl / 2; ++i) {
                    uint32_t w = t[pb[i] & 15] | (t[pb[i] >> 4] << 16);
                    memcpy(ob + 2 * i, &w, 4);
                }
            }
        } else if (bl) {
            for (int64_t b = 0; b < nb; ++b) {
                const float s = slut[sc[r * nb + b]];
                for (int64_t i = b * bl; i < (b + 1) * bl; ++i) o[i] = tp_bf16_rne(lut[p[i]] * s);
            }
        } else {
            for (int64_t i = 0; i < k; ++i) o[i] = tp_bf16_rne(lut[p[i]]);
        }
    }
    return 0;
}
"""


@functools.cache
def _kernel(isa: str) -> Kernel:
    lib = native.build(native.render(_SOURCE), name="lowp_pack_rows", isa=isa)
    f32 = (torch.float32,)
    args = [TensorArg("w", f32, 2), TensorArg("out", f32, 3)]
    return Kernel(
        lib, "tp_pack_rows", [*args, IntArg("rows"), IntArg("k"), IntArg("nr"), IntArg("nthreads")]
    )


def pack_rows_reference(w: torch.Tensor, nr: int) -> torch.Tensor:
    """``W [N, K]`` packed as the engine's B operand ``W.T`` (by indexing; for tests)."""
    return pack_b_reference(w.t(), nr)


def pack_rows(w: torch.Tensor, nr: int) -> torch.Tensor:
    """``W [N, K]`` (contiguous float32) packed as ``[ceil(N/nr), K, nr]``, zero padded:
    the layout :func:`torchport.gemm.pack_b` gives ``W.T``."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.dim() != 2:
        got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise LowPrecisionError(f"pack_rows: w must be a 2-D float32 tensor, got {got}")
    if isinstance(nr, bool) or not isinstance(nr, int) or nr < 1:
        raise LowPrecisionError(f"pack_rows: nr must be a positive int, got {nr!r}")
    n, k = w.shape
    w = w.contiguous()
    out = torch.empty((n + nr - 1) // nr, k, nr, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if not native.enabled():
        return pack_b(w.t(), nr)
    kern = _kernel(native.cpu_info().isa)
    # one thread per 8 MiB: a default panel packs in ~1 ms on one thread (18 GB/s), where a
    # second thread on a loaded machine can cost a whole scheduler tick (4 ms) waiting for it
    threads = max(1, min(native.num_threads(), (n * k * 4) >> 23))
    kern.call_unchecked(w.data_ptr(), out.data_ptr(), n, k, nr, threads)
    return out


# element formats: (bits per element, torch float8 dtype or None for E2M1)
_ELEMS = {"fp4_e2m1": 4, "fp8_e4m3": 8, "fp8_e5m2": 8}
_FP8_OF = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_FMTS = ("e4m3", "e8m0")


def _elem_values(elem: str, codes: torch.Tensor) -> torch.Tensor:
    if elem == "fp4_e2m1":
        return e2m1_to_f32(codes)
    return codes.view(_FP8_OF[elem]).float()


def _scale_values(fmt: str, codes: torch.Tensor) -> torch.Tensor:
    return e4m3_to_f32(codes) if fmt == "e4m3" else e8m0_to_f32(codes)


@functools.cache
def _luts(elem: str, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.arange(16 if _ELEMS[elem] == 4 else 256, dtype=torch.uint8)
    all_bytes = torch.arange(256, dtype=torch.uint8)
    slut = _scale_values(scale_fmt, all_bytes) if scale_fmt else torch.ones(256)
    return _elem_values(elem, codes).contiguous(), slut.contiguous()


def _check_decode(
    q: torch.Tensor, scales: torch.Tensor | None, elem: str, scale_fmt: str | None, block: int
) -> int:
    if elem not in _ELEMS:
        raise LowPrecisionError(
            f"decode_rows_bf16: elem must be one of {tuple(_ELEMS)}, got {elem!r}"
        )
    if scale_fmt is not None and scale_fmt not in SCALE_FMTS:
        raise LowPrecisionError(f"decode_rows_bf16: scale_fmt must be one of {SCALE_FMTS} or None")
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.element_size() != 1:
        raise LowPrecisionError("decode_rows_bf16: q must be a 2-D tensor of bytes")
    k = q.shape[1] * (2 if _ELEMS[elem] == 4 else 1)
    bad = scale_fmt is not None and (
        scales is None or block < 1 or k % block or tuple(scales.shape) != (q.shape[0], k // block)
    )
    if bad:
        got = None if scales is None else tuple(scales.shape)
        raise LowPrecisionError(
            f"decode_rows_bf16: scales must be [{q.shape[0]}, K/{block}] for K={k}, got {got}"
        )
    return k


def decode_rows_bf16_reference(
    q: torch.Tensor,
    scales: torch.Tensor | None,
    elem: str,
    scale_fmt: str | None = None,
    block: int = 0,
) -> torch.Tensor:
    """Rows of quantized elements (``elem``; FP4 packed two per byte) times their block scale
    (``scale_fmt`` bytes, one per ``block`` elements; None: no scale), float32 then bfloat16."""
    k = _check_decode(q, scales, elem, scale_fmt, block)
    u8 = q.view(torch.uint8)
    vals = _elem_values(elem, unpack_fp4(u8) if _ELEMS[elem] == 4 else u8)
    if scale_fmt is not None and scales is not None:
        s = _scale_values(scale_fmt, scales.view(torch.uint8))
        vals = (vals.reshape(q.shape[0], k // block, block) * s.unsqueeze(-1)).reshape(-1, k)
    return vals.to(torch.bfloat16)


def decode_rows_bf16(
    q: torch.Tensor,
    scales: torch.Tensor | None,
    elem: str,
    scale_fmt: str | None = None,
    block: int = 0,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_rows_bf16_reference` natively (the same bits), rows split over threads;
    into ``out`` (contiguous bfloat16 ``[rows, K]``) when given."""
    k = _check_decode(q, scales, elem, scale_fmt, block)
    rows = q.shape[0]
    if out is None:
        out = torch.empty(rows, k, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, k) or not out.is_contiguous():
        raise LowPrecisionError(f"decode_rows_bf16: out must be contiguous bfloat16 ({rows}, {k})")
    if out.numel() == 0:
        return out
    if not native.enabled():
        out.copy_(decode_rows_bf16_reference(q, scales, elem, scale_fmt, block))
        return out
    q8 = q.view(torch.uint8).contiguous()
    s8 = _EMPTY_U8 if scale_fmt is None or scales is None else scales.view(torch.uint8).contiguous()
    lut, slut = _luts(elem, scale_fmt)
    threads = max(1, min(native.num_threads(), (rows * k * 2) >> 20))
    _decode_kernel(native.cpu_info().isa).call_unchecked(
        q8.data_ptr(),
        s8.data_ptr(),
        lut.data_ptr(),
        slut.data_ptr(),
        out.data_ptr(),
        rows,
        k,
        int(_ELEMS[elem] == 4),
        block if scale_fmt is not None else 0,
        threads,
    )
    return out


_EMPTY_U8 = torch.zeros(1, dtype=torch.uint8)


def panel_workspace(rows: int, k: int) -> torch.Tensor:
    """A bfloat16 ``[rows, K]`` buffer reused by this thread's next call (an inference tensor,
    which the GEMM engine's pack cache never keeps): decoding each panel into fresh memory costs
    its page faults, about as much as the decode (measured, 32 MB: 16 ms to allocate and zero,
    17 ms to decode into it)."""
    need = rows * k
    return native.thread_scratch("lowp.panel", need, torch.bfloat16)[:need].view(rows, k)


@functools.cache
def _decode_kernel(isa: str) -> Kernel:
    lib = native.build(native.render(_DECODE_SOURCE), name="lowp_decode_bf16", isa=isa)
    u8, f32, bf = (torch.uint8,), (torch.float32,), (torch.bfloat16,)
    args = [
        TensorArg("q", u8, 2),
        TensorArg("scales", u8),
        TensorArg("lut", f32, 1),
        TensorArg("slut", f32, 1),
        TensorArg("out", bf, 2),
    ]
    ints = ("rows", "k", "fp4", "bl", "nthreads")
    return Kernel(lib, "tp_decode_bf16", [*args, *(IntArg(n) for n in ints)])


__all__ = [
    "SCALE_FMTS",
    "decode_rows_bf16",
    "decode_rows_bf16_reference",
    "pack_rows",
    "pack_rows_reference",
    "panel_workspace",
]
