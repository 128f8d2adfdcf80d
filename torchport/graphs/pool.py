"""``MemPool``: a placement allocator over large heaps, with size buckets and statistics.

CPU stand-in for the CUDA caching allocator's private graph pools. Requests are rounded to a size
class: multiples of 512 B below 1 MiB ("small"), otherwise one of four buckets per power of two
("large": 1, 1.25, 1.5, 1.75 × 2^k). Blocks are placed (best fit, split, coalesced on free) inside
heaps: 2 MiB heaps for small requests, and for large ones a heap of the request rounded up to
2 MiB. Before a new heap is reserved, heaps that are entirely free are released, so replaying or
re-capturing with varying sizes keeps ``reserved`` close to the live peak instead of growing with
every new size.

Each allocation is a tensor over its *own* non-owning storage placed in a heap, so its block is
returned to the pool exactly when no tensor (or view) references that storage any more; the heap
memory itself lives as long as any block in it is live, even if the pool object is dropped.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["MemPool", "MemPoolError", "PoolStats", "round_size"]

SMALL_LIMIT = 1 << 20
SMALL_ALIGN = 512
HEAP_GRANULE = 2 << 20
# (heaps, blocks) of dropped pools that still had live blocks: swept whenever a pool is made or
# dropped, their blocks returned as their tensors die and a heap freed once it has none
_ORPHANS: list[tuple[list[Any], list[Any]]] = []


_SWEEPING = threading.Lock()


def _sweep_orphans() -> None:
    """Return the orphaned blocks whose storage died; forget the heaps left without any (before,
    orphans were kept forever: a pool dropped in the same collection as its last tensors, as a
    deleted graph's is, leaked its heaps: 40 graphs, 80 MiB).

    The blocks' storages do not own their memory, so an orphan entry must never be lost while
    a tensor lives: one sweep at a time (another thread's, or this thread's re-entered from a
    collection inside it, is skipped), entries updated in place and removed one by one, so an
    entry appended meanwhile (``list.append`` is atomic) stays."""
    if not _SWEEPING.acquire(blocking=False):
        return
    try:
        for entry in list(_ORPHANS):
            heaps, blocks = entry
            left = []
            for ref, heap, off, size in blocks:
                if ref.expired():
                    heap.give(off, size)
                else:
                    left.append((ref, heap, off, size))
            blocks[:] = left
            heaps[:] = [h for h in heaps if h.live]
            if not heaps:  # by index (only the sweeper removes; appends go to the end)
                for i, e in enumerate(_ORPHANS):
                    if e is entry:
                        del _ORPHANS[i]
                        break
    finally:
        _SWEEPING.release()


class MemPoolError(ValueError):
    """A bad request to a :class:`MemPool`."""


def round_size(nbytes: int) -> int:
    """The size class a request of ``nbytes`` is served from."""
    if nbytes < 0:
        raise MemPoolError(f"MemPool: allocation size must be >= 0 bytes, got {nbytes}")
    if nbytes < SMALL_LIMIT:
        return max(SMALL_ALIGN, -(-nbytes // SMALL_ALIGN) * SMALL_ALIGN)
    k = 1 << (nbytes.bit_length() - 1)
    step = k // 4
    return -(-nbytes // step) * step


@dataclass
class PoolStats:
    """Byte counts: ``reserved`` (heaps held), ``allocated`` (live blocks), their peaks, counts."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    heaps: int = 0
    allocations: int = 0
    heap_allocs: int = 0
    heap_releases: int = 0


@dataclass
class _Heap:
    buf: torch.Tensor  # uint8, owns the memory
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, size)
    live: int = 0

    @property
    def size(self) -> int:
        return self.buf.numel()

    def take(self, size: int) -> int | None:
        best = None
        for i, (_, sz) in enumerate(self.free):
            if sz >= size and (best is None or sz < self.free[best][1]):
                best = i
        if best is None:
            return None
        off, sz = self.free[best]
        if sz == size:
            del self.free[best]
        else:
            self.free[best] = (off + size, sz - size)
        self.live += 1
        return off

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect(self.free, (off, size))
        self.free.insert(i, (off, size))
        # Coalesce with the right then the left neighbour.
        if i + 1 < len(self.free) and off + size == self.free[i + 1][0]:
            self.free[i] = (off, size + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]
        self.live -= 1


class MemPool:
    """A pool of heaps from which tensors are placed; shareable between graphs.

    Example::

        pool = MemPool()
        x = pool.empty((8, 64), torch.float32)
        pool.stats().allocated  # 2048
    """

    def __init__(self, *, heap_bytes: int = HEAP_GRANULE) -> None:
        if (
            not isinstance(heap_bytes, int)
            or isinstance(heap_bytes, bool)
            or heap_bytes <= 0
            or heap_bytes % SMALL_ALIGN
        ):
            raise MemPoolError(
                f"MemPool: heap_bytes must be a positive multiple of {SMALL_ALIGN}, got {heap_bytes!r}"
            )
        _sweep_orphans()
        self.heap_bytes = heap_bytes
        self._heaps: list[_Heap] = []
        self._blocks: list[tuple[StorageWeakRef, _Heap, int, int]] = []
        self._stats = PoolStats()
        self._lock = threading.Lock()

    def empty(
        self, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor placed in this pool."""
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise MemPoolError(f"MemPool.empty: sizes must be >= 0, got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise MemPoolError(f"MemPool.empty: dtype must be a torch.dtype, got {dtype!r}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = round_size(nbytes)
        with self._lock:
            self._collect()
            heap, off = self._place(size)
            storage = torch._C._construct_storage_from_data_pointer(
                heap.buf.data_ptr() + off, torch.device("cpu"), nbytes
            )
            self._blocks.append((StorageWeakRef(storage), heap, off, size))
            st = self._stats
            st.allocated += size
            st.allocations += 1
            st.peak_allocated = max(st.peak_allocated, st.allocated)
        t = torch.empty(0, dtype=dtype)
        strides = torch.empty(shape, device="meta").stride() if shape else ()
        return t.set_(storage, 0, shape, strides)

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """A pool tensor with ``t``'s shape and dtype (contiguous)."""
        return self.empty(tuple(t.shape), t.dtype)

    def _place(self, size: int) -> tuple[_Heap, int]:
        small = size < SMALL_LIMIT
        for h in self._heaps:
            if h.small == small:
                off = h.take(size)
                if off is not None:
                    return h, off
        self._release_free_heaps()
        heap_size = max(self.heap_bytes, -(-size // HEAP_GRANULE) * HEAP_GRANULE)
        if small:
            heap_size = max(self.heap_bytes, size)
        h = _Heap(torch.empty(heap_size, dtype=torch.uint8), small, [(0, heap_size)])
        self._heaps.append(h)
        st = self._stats
        st.reserved += heap_size
        st.heaps += 1
        st.heap_allocs += 1
        st.peak_reserved = max(st.peak_reserved, st.reserved)
        off = h.take(size)
        assert off == 0
        return h, off

    def _collect(self) -> None:
        """Return the blocks whose storage no tensor references any more."""
        keep = []
        for ref, heap, off, size in self._blocks:
            if ref.expired():
                heap.give(off, size)
                self._stats.allocated -= size
            else:
                keep.append((ref, heap, off, size))
        self._blocks = keep

    def _release_free_heaps(self) -> None:
        keep = []
        for h in self._heaps:
            if h.live == 0:
                self._stats.reserved -= h.size
                self._stats.heaps -= 1
                self._stats.heap_releases += 1
            else:
                keep.append(h)
        self._heaps = keep

    def empty_cache(self) -> None:
        """Release every heap that holds no live block."""
        with self._lock:
            self._collect()
            self._release_free_heaps()

    def stats(self) -> PoolStats:
        """Current counters (after returning the blocks of dead tensors)."""
        with self._lock:
            self._collect()
            return PoolStats(**vars(self._stats))

    def reset_peak(self) -> None:
        """Set the peaks to the current values."""
        with self._lock:
            self._collect()
            self._stats.peak_reserved = self._stats.reserved
            self._stats.peak_allocated = self._stats.allocated

    def __del__(self) -> None:
        # blocks whose tensors are gone go back first (every heap that had a block counted as
        # live); the rest wait in _ORPHANS until their tensors die
        if hasattr(self, "_blocks"):
            self._collect()
        live = [h for h in getattr(self, "_heaps", []) if h.live]
        if live:
            _ORPHANS.append((live, list(getattr(self, "_blocks", []))))
        _sweep_orphans()
