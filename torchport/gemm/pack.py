"""Packing of GEMM ``B`` operands into column panels, with a cache for weights that do not change.

``pack_b(b, nr)`` lays a logical ``[K, N]`` matrix (any strides: an ``nn.Linear`` weight arrives as
``weight.t()``) out as ``[ceil(N/nr), K, nr]``, zero padded in the last panel, keeping its dtype
(bf16 stays bf16, so the small-M kernels stream half the bytes and widen in registers).

:class:`PackCache` (``pack_cache``) keeps the result per (storage pointer, shape, strides, dtype,
``nr``) and validates it on every lookup (version counter and sampled values), so an in-place update
(an optimiser step) repacks. Keys do not depend on the Python tensor object: Inductor passes a fresh
alias of the same weight on every call.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

MAX_BYTES = 2 << 30


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
    """Pack ``b`` ``[K, N]`` into ``[ceil(N/nr), K, nr]`` panels (one strided copy; only the
    last, partial panel is zero padded)."""
    k, n = b.shape
    full, rest = divmod(n, nr)
    out = torch.empty(full + (1 if rest else 0), k, nr, dtype=b.dtype)
    if full:
        out[:full].copy_(b[:, : full * nr].unflatten(1, (full, nr)).permute(1, 0, 2))
    if rest:
        out[full].zero_()
        out[full, :, :rest].copy_(b[:, full * nr :])
    return out


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


class _Probe:
    """Up to 16 spread-out elements of ``b``, read as raw bytes straight from its memory.

    A bitwise fingerprint (a NaN compares equal to itself) that costs a few microseconds to
    re-read, where indexing the tensor costs tens. The entry holding the probe also holds ``b``,
    so the memory stays valid.
    """

    def __init__(self, b: torch.Tensor) -> None:
        k, n = b.shape
        es = b.element_size()
        count = min(16, k * n)
        s0, s1 = b.stride()
        offs = []
        for i in range(count):
            flat = (i * (k * n - 1)) // max(count - 1, 1)
            r, c = divmod(flat, max(n, 1))
            offs.append((r * s0 + c * s1) * es)
        self._es = es
        self._offs = offs
        self._tensor = b  # its storage may be reallocated in place (resize_): checked per read
        self._base = b.data_ptr()
        span = (max(offs) + es) if offs else 1
        self._raw: Any = (ctypes.c_char * span).from_address(self._base) if offs else None
        self._value = self.read()

    def read(self) -> bytes:
        raw, es = self._raw, self._es
        if raw is None:
            return b""
        return b"".join([raw[o : o + es] for o in self._offs])

    def unchanged(self) -> bool:
        if self._tensor.data_ptr() != self._base:  # memory moved: never read the old address
            return False
        return self.read() == self._value


@dataclass
class _Entry:
    tensor: torch.Tensor  # held: its storage cannot be freed and reused while cached
    version: int
    probe: _Probe
    packed: torch.Tensor


class PackCache:
    """Packed operands keyed by storage, layout and panel width, validated on every lookup.

    An entry is valid while the tensor's version counter is unchanged (in-place updates, such as
    optimiser steps, bump it) and 16 sampled values still match bit for bit (which also catches
    writes through ``.data``, except ones that leave every sampled value alone). Entries hold their tensor, so a
    storage address is never reused under a live entry; the least recently used entries are dropped
    beyond ``max_bytes``.
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, b: torch.Tensor, nr: int) -> torch.Tensor:
        """Packed ``b`` for panel width ``nr``, from the cache when still valid."""
        key = (b.data_ptr(), b.shape, b.stride(), b.dtype, nr)
        ver = _version(b)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.version == ver and ver >= 0 and e.probe.unchanged():
                self._entries.move_to_end(key)
                self.hits += 1
                return e.packed
        b = b.detach()
        packed = pack_b(b, nr)
        size = packed.numel() * packed.element_size()
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.packed.numel() * old.packed.element_size()
            if ver >= 0 and size <= self.max_bytes:
                self._entries[key] = _Entry(b, ver, _Probe(b), packed)
                self._bytes += size
                while self._bytes > self.max_bytes and self._entries:
                    _, ev = self._entries.popitem(last=False)
                    self._bytes -= ev.packed.numel() * ev.packed.element_size()
        return packed

    def clear(self) -> None:
        """Drop every entry (and the references to the tensors they hold)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


pack_cache = PackCache()
