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
"""

from __future__ import annotations

import functools

import torch

from torchport import native
from torchport.gemm import pack_b, pack_b_reference
from torchport.lowp.formats import LowPrecisionError
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


__all__ = ["pack_rows", "pack_rows_reference"]
