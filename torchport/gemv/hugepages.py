"""Weight buffers backed by 2 MiB transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

A decode GEMV streams 25-180 MB of weights per call; with 4 KiB pages that is 6,000-44,000 TLB
entries per call, which the hardware page walker refills as the stream goes. On a kernel whose
transparent huge pages are in ``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/enabled``),
a buffer must ask for them before its pages are first touched: :func:`hugepage_copy` allocates a
2 MiB-aligned range of fresh (untouched) memory, advises it, then copies the tensor in.

Where ``madvise`` is unavailable or refuses, the copy is still made (plain pages): the result is
always a correct contiguous copy; only its page size is best effort.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` whose storage starts on a 2 MiB boundary and is
    advised to use transparent huge pages (best effort; see the module docstring)."""
    return hugepage_empty(tuple(t.shape), t.dtype).copy_(t)


def hugepage_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose storage starts on a 2 MiB boundary, its
    (untouched) pages advised to be transparent huge pages before anything writes them (best
    effort)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE
    span = (buf.numel() - off) // HUGE * HUGE
    madvise = _madvise()
    if madvise is not None and span:
        madvise(buf.data_ptr() + off, span, MADV_HUGEPAGE)  # type: ignore[operator]
    return buf[off : off + nbytes].view(dtype).view(shape)
