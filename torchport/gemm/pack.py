"""Packing of GEMM ``B`` operands into column panels, with a cache for weights that do not change.

``pack_b(b, nr)`` lays a logical ``[K, N]`` matrix (any strides: an ``nn.Linear`` weight arrives as
``weight.t()``) out as ``[ceil(N/nr), K, nr]``, zero padded in the last panel, keeping its dtype
(bf16 stays bf16, so the small-M kernels stream half the bytes and widen in registers).

``packed_b(b, nr)`` caches the result per (storage pointer, shape, strides, dtype, ``nr``) and checks
the tensor's version counter, so an in-place update (an optimiser step) repacks; an entry dies with
its tensor. The cache holds at most ``MAX_BYTES``; the oldest entries go first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_BYTES = 4 << 30


def pack_b_reference(b: torch.Tensor, nr: int) -> torch.Tensor:
    """Obviously correct packing by indexing (slow; for tests)."""
    k, n = b.shape
    npan = (n + nr - 1) // nr
    out = torch.zeros(npan, k, nr, dtype=b.dtype)
    for p in range(npan):
        w = min(nr, n - p * nr)
        out[p, :, :w] = b[:, p * nr : p * nr + w]
    return out


def pack_b(b: torch.Tensor, nr: int) -> torch.Tensor:
    """Pack ``b`` ``[K, N]`` into ``[ceil(N/nr), K, nr]`` panels (two torch copies)."""
    k, n = b.shape
    npan = (n + nr - 1) // nr
    wt = torch.zeros(npan * nr, k, dtype=b.dtype)
    wt[:n].copy_(b.t())
    return wt.view(npan, nr, k).transpose(1, 2).contiguous()


def pack_b_pairs(b: torch.Tensor, nr: int = 32) -> torch.Tensor:
    """bf16 ``[K, N]`` → ``[ceil(N/nr), ceil(K/2), nr, 2]`` for the AVX512-BF16 dot kernel."""
    k = b.shape[0]
    kp = (k + 1) // 2
    p = pack_b(b, nr)  # [np, K, nr]
    if k % 2:
        p = torch.cat([p, p.new_zeros(p.shape[0], 1, nr)], dim=1)
    return p.view(p.shape[0], kp, 2, nr).transpose(2, 3).contiguous()


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have no version counter
        return -1


@dataclass
class _Entry:
    owner: weakref.ref[torch.Tensor]
    version: int
    packed: torch.Tensor


class PackCache:
    """Packed operands keyed by storage, layout and panel width, validated by version."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, b: torch.Tensor, nr: int) -> torch.Tensor:
        """Packed ``b`` for panel width ``nr``, from the cache when still valid."""
        owner = b._base if b._base is not None else b
        key = (b.data_ptr(), tuple(b.shape), tuple(b.stride()), b.dtype, nr)
        ver = _version(owner)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.owner() is owner and e.version == ver and ver >= 0:
                self._entries.move_to_end(key)
                self.hits += 1
                return e.packed
        packed = pack_b(b.detach(), nr)
        size = packed.numel() * packed.element_size()
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.packed.numel() * old.packed.element_size()
            if ver >= 0 and size <= self.max_bytes:
                self._entries[key] = _Entry(weakref.ref(owner, self._dropper(key)), ver, packed)
                self._bytes += size
                while self._bytes > self.max_bytes and self._entries:
                    _, ev = self._entries.popitem(last=False)
                    self._bytes -= ev.packed.numel() * ev.packed.element_size()
        return packed

    def _dropper(self, key: tuple[object, ...]) -> Callable[[object], None]:
        def drop(_: object) -> None:
            with self._lock:
                e = self._entries.pop(key, None)
                if e is not None:
                    self._bytes -= e.packed.numel() * e.packed.element_size()

        return drop

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


pack_cache = PackCache()
