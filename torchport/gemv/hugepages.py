"""Weight buffers backed by 2 MiB transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

A decode GEMV streams 25-180 MB of weights per call; with 4 KiB pages that is 6,000-44,000 TLB
entries per call, which the hardware page walker refills as the stream goes. On a kernel whose
transparent huge pages are in ``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/enabled``),
a buffer must ask for them before its pages are first touched: :func:`hugepage_copy` allocates a
2 MiB-aligned range of fresh (untouched) memory, advises it, then copies the tensor in.

Where ``madvise`` is unavailable or refuses, the copy is still made (plain pages): the result is
always a correct contiguous copy; only its page size is best effort.

Advising is skipped where it gets no huge pages (:func:`huge_pages_granted`, probed once per
process). On a Firecracker VM with THP in ``madvise`` mode and ``defrag`` ``madvise`` (advised
faults try compaction there) none was ever granted (``AnonHugePages`` stayed 0 kB) while the
advised faults cost three times the plain ones: packing 180 MB (11008x4096 fp32) into a fresh
advised buffer took 271-292 ms against 78-95 ms into plain pages (28-29 ms into touched ones),
and a cold tune of that linear layer packs four times.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
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


def _anon_huge_kb() -> int | None:
    """This process's ``AnonHugePages`` (kB, ``/proc/self/smaps_rollup``); None if unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always / madvise / never); None if unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@functools.cache
def huge_pages_granted() -> bool:
    """Whether advised memory gets transparent huge pages in this process: probed once by
    advising and touching 4 MiB of fresh anonymous memory and reading ``AnonHugePages`` before
    and after. True where ``AnonHugePages`` cannot be read (the advice is kept, as before);
    False where THP is ``never`` or its mode unknown, ``madvise`` is missing, or the probe got
    none."""
    madvise = _madvise()
    if madvise is None:
        return False
    if _thp_mode() in ("never", None):
        return False
    before = _anon_huge_kb()
    if before is None:
        return True
    region = mmap.mmap(-1, 3 * HUGE)  # fresh pages: never touched before the advice
    try:
        view = (ctypes.c_char * (3 * HUGE)).from_buffer(region)
        base = ctypes.addressof(view)
        off = (-base) % HUGE
        madvise(base + off, 2 * HUGE, MADV_HUGEPAGE)  # type: ignore[operator]
        ctypes.memset(base + off, 1, 2 * HUGE)
        after = _anon_huge_kb()
        del view
    finally:
        region.close()
    return after is not None and after > before


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` whose storage starts on a 2 MiB boundary and is
    advised to use transparent huge pages (best effort; see the module docstring)."""
    return hugepage_empty(tuple(t.shape), t.dtype).copy_(t)


def hugepage_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose storage starts on a 2 MiB boundary, its
    (untouched) pages advised to be transparent huge pages before anything writes them (best
    effort; not advised where advice gets none: :func:`huge_pages_granted`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE
    span = (buf.numel() - off) // HUGE * HUGE
    madvise = _madvise()
    if madvise is not None and span and huge_pages_granted():
        madvise(buf.data_ptr() + off, span, MADV_HUGEPAGE)  # type: ignore[operator]
    return buf[off : off + nbytes].view(dtype).view(shape)
