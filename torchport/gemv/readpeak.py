"""Native read-bandwidth probe: stream a buffer once, as fast as this CPU reads memory.

The decode GEMV is bound by how fast the weights stream in from DRAM; ``Tensor.sum`` is the
ATen yardstick but not the machine's limit (the fp32 GEMV has read faster than it).
:func:`read_checksum` is the ceiling the GEMV is measured against: each of ``nthreads`` threads
reads its contiguous share of the buffer (4 KiB aligned) with aligned 256-bit loads, into eight
independent accumulators (``vpsadbw`` adds the 32 bytes of a load into four 64-bit lanes: one
µop per load besides the add, far below what the stream leaves free). A :class:`ReadConfig`
sets how: ``streams`` contiguous parts of the thread's share read side by side (256 bytes of
each per step: more streams for the hardware prefetchers to follow), and a software prefetch
``prefetch`` bytes ahead of each (one hint per 64-byte line, ``hint`` T0/T1/NTA; 0: none).
:data:`READ_CONFIGS` are the ones the GEMV benchmark times, keeping the fastest.

The result is the sum of all bytes of the buffer as unsigned 8-bit integers (exact in 64 bits
for any buffer below 2⁵⁶ bytes), so nothing is optimised away and every configuration is
checked against :func:`read_checksum_reference` (``buf.view(torch.uint8).sum()``) bit for bit.
Below AVX2 a scalar loop computes the same sum.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchport import native
from torchport.native import IntArg, Kernel, TensorArg

_SOURCE = r"""
/* Sum of the bytes [lo, hi) of p, reading with 256-bit loads from the first 32-byte boundary:
   the range is read as ${streams} contiguous parts side by side, 256 bytes of each per step. */
static uint64_t tp_read_part(const uint8_t *p, int64_t lo, int64_t hi) {
    uint64_t s = 0;
    int64_t i = lo;
#if defined(__AVX2__)
    while (i < hi && ((uintptr_t)(p + i) & 31)) s += p[i++];
    const __m256i z = _mm256_setzero_si256();
    __m256i a[8];
    for (int j = 0; j < 8; ++j) a[j] = z;
    const int S = ${streams};
    const int64_t part = (hi - i) / (256 * S) * 256;   /* bytes of each part, whole steps */
    for (int64_t o = 0; o < part; o += 256) {
        for (int st = 0; st < S; ++st) {
            const uint8_t *q = p + i + st * part + o;
#if ${prefetch} > 0
            for (int l = 0; l < 4; ++l) _mm_prefetch((const char *)q + ${prefetch} + 64 * l, ${hint});
#endif
            for (int j = 0; j < 8; ++j)
                a[j] = _mm256_add_epi64(a[j], _mm256_sad_epu8(_mm256_load_si256((const __m256i *)(q + 32 * j)), z));
        }
    }
    i += part * S;
    for (; i + 32 <= hi; i += 32)
        a[0] = _mm256_add_epi64(a[0], _mm256_sad_epu8(_mm256_load_si256((const __m256i *)(p + i)), z));
    for (int j = 1; j < 8; ++j) a[0] = _mm256_add_epi64(a[0], a[j]);
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, a[0]);
    s += t[0] + t[1] + t[2] + t[3];
#endif
    for (; i < hi; ++i) s += p[i];
    return s;
}

/* *sum = sum of the n bytes at p; nthreads threads, each its contiguous share (4 KiB aligned). */
TP_EXPORT int tp_read_peak(const uint8_t *p, int64_t n, int64_t *sum, int64_t nthreads) {
    uint64_t total = 0;
    #pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int64_t lo, hi;
        tp_chunk(n, omp_get_num_threads(), omp_get_thread_num(), 4096, &lo, &hi);
        total += tp_read_part(p, lo, hi);
    }
    *sum = (int64_t)total;
    return 0;
}
"""

HINTS = ("T0", "T1", "NTA")


@dataclass(frozen=True, kw_only=True)
class ReadConfig:
    """How :func:`read_checksum` streams (see the module docstring); validated on construction."""

    prefetch: int = 0  # bytes ahead, a multiple of 64; 0: no software prefetch
    hint: str = "T0"  # _MM_HINT_<hint> of the prefetch
    streams: int = 1  # contiguous parts of each thread's share read side by side

    def __post_init__(self) -> None:
        if self.prefetch < 0 or self.prefetch % 64:
            raise ValueError(
                f"ReadConfig.prefetch must be a non-negative multiple of 64, got {self.prefetch}"
            )
        if self.hint not in HINTS:
            raise ValueError(f"ReadConfig.hint must be one of {HINTS}, got {self.hint!r}")
        if not 1 <= self.streams <= 16:
            raise ValueError(f"ReadConfig.streams must be in [1, 16], got {self.streams}")

    @property
    def name(self) -> str:
        return f"p{self.prefetch}_{self.hint}_s{self.streams}"


# The configurations the GEMV benchmark times. Exploration, two threads over a 256 MiB buffer on
# 2 MiB pages, Zen 3 shared with other jobs, interleaved medians of 15 (load 2.5-3.7, sum
# 31.6-33.2 GB/s): no prefetch 31.0-31.5 GB/s, 512 bytes ahead 30.7-32.1, NTA 31.3, 1024-4096
# ahead 27.2-30.4; 4 KiB pages 1-3 GB/s slower than 2 MiB ones. In six quick GEMV benchmark
# runs (load 1.4-4.5) four streams per thread with NTA 512 bytes ahead read fastest each time:
# 33.9-43.2 GB/s against 31.8-35.2 with one stream and no prefetch, and Tensor.sum 30.3-32.5.
READ_CONFIGS = (
    ReadConfig(),
    ReadConfig(prefetch=512, hint="NTA"),
    ReadConfig(prefetch=512, hint="NTA", streams=4),
)


@functools.cache
def read_peak_kernel(isa: str, cfg: ReadConfig = ReadConfig()) -> Kernel:
    """The compiled read probe (entry ``tp_read_peak(buf, nbytes, sum_out, nthreads)``)."""
    src = native.render(
        _SOURCE, prefetch=cfg.prefetch, hint=f"_MM_HINT_{cfg.hint}", streams=cfg.streams
    )
    lib = native.build(src, name=f"gemv_readpeak_{isa}_{cfg.name}", isa=isa)
    u8, i64 = (torch.uint8,), (torch.int64,)
    return Kernel(
        lib,
        "tp_read_peak",
        [TensorArg("buf", u8, ndim=1), IntArg("n"), TensorArg("sum", i64), IntArg("nthreads")],
    )


def read_checksum_reference(buf: torch.Tensor) -> int:
    """Sum of the bytes of contiguous CPU tensor ``buf`` as unsigned 8-bit integers."""
    return int(buf.contiguous().view(torch.uint8).sum())


def _flat_bytes(buf: torch.Tensor, nthreads: int) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor) or not buf.is_cpu or not buf.is_contiguous():
        got = type(buf).__name__ if not isinstance(buf, torch.Tensor) else f"{buf.device} "
        raise ValueError(f"read_checksum: buf must be a contiguous CPU tensor, got {got}")
    if nthreads < 0:
        raise ValueError(f"read_checksum: nthreads must be >= 0, got {nthreads}")
    if buf.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return buf.reshape(-1).view(torch.uint8)


def read_checksum(buf: torch.Tensor, nthreads: int = 0, cfg: ReadConfig = ReadConfig()) -> int:
    """:func:`read_checksum_reference` by the native probe: every byte of ``buf`` read once by
    ``nthreads`` threads (0: :func:`torchport.native.num_threads`). Raises ``ValueError`` for a
    ``buf`` that is not a contiguous CPU tensor or a negative thread count."""
    flat = _flat_bytes(buf, nthreads)
    out = torch.zeros(1, dtype=torch.int64)
    kern = read_peak_kernel(native.cpu_info().isa, cfg)
    kern(flat, flat.numel(), out, nthreads or native.num_threads())
    return int(out.item())


def read_launcher(
    buf: torch.Tensor, nthreads: int = 0, cfg: ReadConfig = ReadConfig()
) -> Callable[[], int]:
    """A no-argument call returning :func:`read_checksum` ``(buf, nthreads, cfg)``, with the
    pointers validated once (for timing loops: a read of a large buffer without the
    per-call checks)."""
    flat = _flat_bytes(buf, nthreads)
    fn = read_peak_kernel(native.cpu_info().isa, cfg).raw_call
    out = torch.zeros(1, dtype=torch.int64)
    ptr, n, optr = flat.data_ptr(), flat.numel(), out.data_ptr()
    nt = nthreads or native.num_threads()
    result = ctypes.c_int64.from_address(optr)

    def go() -> int:
        fn(ptr, n, optr, nt)
        return int(result.value)

    go.keep_alive = (flat, out)  # type: ignore[attr-defined]
    return go
