"""Packing of GEMM ``B`` operands into column panels, with a cache for weights that do not change.

``pack_b(b, nr)`` lays a logical ``[K, N]`` matrix (any strides: an ``nn.Linear`` weight arrives as
``weight.t()``) out as ``[ceil(N/nr), K, nr]``, zero padded in the last panel, keeping its dtype
(bf16 stays bf16, so the small-M kernels stream half the bytes and widen in registers). It runs a
native copy kernel (panels split across the threads; for ``weight.t()`` the ``nr`` source rows
are read in 64-element K blocks so the reads stay sequential and the output block stays in L1),
or torch's strided copy when native kernels are off; both are bit-exact copies of
:func:`pack_b_reference`. The native kernel matters for cold tuning and training, where every
new weight version is packed: measured 310–350 ms → see the README for 180 MB fp32.

:class:`PackCache` (``pack_cache``) keeps the result per (storage pointer, shape, strides, dtype,
``nr``) and validates it on every lookup (storage alive, version counter and sampled values), so
an in-place update (an optimiser step) repacks. Keys do not depend on the Python tensor object:
Inductor passes a fresh alias of the same weight on every call. Entries hold the storage weakly:
a freed weight's packing is dropped, never kept alive or matched by a later tensor at its address.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchport import native
from torchport.gemv.hugepages import hugepage_empty
from torchport.native.launch import tensor_version

MAX_BYTES = 2 << 30
# operands packed once and not kept that the cache remembers by key (see PackCache)
SEEN_KEYS = 4096
# Packed buffers of at least this many bytes live in 2 MiB transparent huge pages (Linux, best
# effort). The small-M kernels stream the whole packed weight per call; with 4 KiB pages the
# hardware prefetchers restart at every page and the TLB refills 4096 times per 16 MB. Measured
# (M=8 1024->4096 fp32 8x8 tile, 16 MB copies rotated over 192 MB, interleaved medians of 31,
# load ~3): 1 thread 1.63 -> 1.41 ms, 2 threads 0.91 -> 0.84 ms; K=4096: 6.30 -> 5.70 ms,
# 4.82 -> 4.29 ms.
HUGEPAGE_MIN_BYTES = 4 << 20
_PROBE_WORDS: dict[int, Any] = {
    1: ctypes.c_uint8,
    2: ctypes.c_uint16,
    4: ctypes.c_uint32,
    8: ctypes.c_uint64,
}

_PACK_SOURCE = r"""
/* out[p][k][c] = B[k, p * nr + c] (zero for p * nr + c >= N); B[k, j] at src[k * s0 + j * s1] */
TP_EXPORT int tp_pack_${bits}(uint${bits}_t *out, const uint${bits}_t *src, int64_t K, int64_t N,
        int64_t s0, int64_t s1, int64_t nr, int64_t nthreads) {
    if (K <= 0 || N <= 0 || nr <= 0) return 0;
    const int64_t np = (N + nr - 1) / nr;
    #pragma omp parallel num_threads(TP_MIN(nthreads, np))
    {
        int64_t p0, p1;
        tp_chunk(np, omp_get_num_threads(), omp_get_thread_num(), 1, &p0, &p1);
        for (int64_t p = p0; p < p1; ++p) {
            uint${bits}_t *o = out + p * K * nr;
            const int64_t j0 = p * nr, w = TP_MIN(nr, N - j0);
            if (s0 == 1 && s1 != 1) {  /* columns contiguous in k (weight.t()) */
                for (int64_t k0 = 0; k0 < K; k0 += 64) {
                    const int64_t k1 = TP_MIN(K, k0 + 64);
                    for (int64_t c = 0; c < w; ++c) {
                        const uint${bits}_t *col = src + (j0 + c) * s1;
                        for (int64_t k = k0; k < k1; ++k) o[k * nr + c] = col[k];
                    }
                    for (int64_t k = k0; k < k1; ++k)
                        for (int64_t c = w; c < nr; ++c) o[k * nr + c] = 0;
                }
            } else {
                for (int64_t k = 0; k < K; ++k) {
                    const uint${bits}_t *row = src + k * s0 + j0 * s1;
                    for (int64_t c = 0; c < w; ++c) o[k * nr + c] = row[c * s1];
                    for (int64_t c = w; c < nr; ++c) o[k * nr + c] = 0;
                }
            }
        }
    }
    return 0;
}
"""


@functools.cache
def _pack_fn(bits: int) -> object:
    src = native.render(_PACK_SOURCE, bits=bits)
    # -O2, as the GEMM tiles: one precompiled header serves both (with -O3 a fresh cache's first
    # GEMM built a second one, ~0.4 s of compiler CPU; the loops pack equally fast either way:
    # 11008x4096 transposed, two threads, interleaved medians of 9, fp32 43.9 vs 45.3 ms, bf16
    # 51.5 vs 47.8 ms)
    lib = native.build(src, name=f"gemm_pack{bits}", extra_flags=["-O2"])
    argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6
    return native.c_function(lib, f"tp_pack_{bits}", argtypes, ctypes.c_int)


def pack_b_reference(b: torch.Tensor, nr: int) -> torch.Tensor:
    """Obviously correct packing by indexing (slow; for tests)."""
    k, n = b.shape
    npan = (n + nr - 1) // nr
    out = torch.zeros(npan, k, nr, dtype=b.dtype)
    for p in range(npan):
        w = min(nr, n - p * nr)
        out[p, :, :w] = b[:, p * nr : p * nr + w]
    return out


def pack_b(b: torch.Tensor, nr: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``b`` ``[K, N]`` into ``[ceil(N/nr), K, nr]`` panels (native copy kernel; torch's
    strided copy when native kernels are off or cannot be built), into ``out`` when given (a
    contiguous tensor of that shape and ``b``'s dtype)."""
    k, n = b.shape
    shape = ((n + nr - 1) // nr, k, nr)
    if out is not None:
        assert out.shape == shape and out.dtype == b.dtype and out.is_contiguous()
    if native.enabled() and b.element_size() in (2, 4) and k > 0 and n > 0:
        try:
            fn: Any = _pack_fn(8 * b.element_size())
        except native.NativeError as e:
            native.note_fallback("gemm.pack", e)
        else:
            if out is None:
                out = packed_empty(shape, b.dtype)
            s0, s1 = b.stride()
            status = fn(out.data_ptr(), b.data_ptr(), k, n, s0, s1, nr, native.num_threads())
            if status != 0:
                raise RuntimeError(f"tp_pack returned status {status}")
            return out
    return pack_b_torch(b, nr, out)


def packed_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised memory for a packed operand: huge-page backed from
    :data:`HUGEPAGE_MIN_BYTES` up (its pages advised before the packing kernel first writes
    them), plain ``torch.empty`` below."""
    if math.prod(shape) * dtype.itemsize >= HUGEPAGE_MIN_BYTES:
        return hugepage_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def pack_b_torch(b: torch.Tensor, nr: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pack_b` with torch ops (one strided copy; only the last, partial panel is zero
    padded)."""
    k, n = b.shape
    full, rest = divmod(n, nr)
    if out is None:
        out = packed_empty((full + (1 if rest else 0), k, nr), b.dtype)
    if full:
        out[:full].copy_(b[:, : full * nr].unflatten(1, (full, nr)).permute(1, 0, 2))
    if rest:
        out[full].zero_()
        out[full, :, :rest].copy_(b[:, full * nr :])
    return out


def pair_words(b: torch.Tensor) -> torch.Tensor | None:
    """bf16 ``b [K, N]`` as 32-bit words ``[K/2, N]``, word ``(k, j)`` holding ``b[2k, j]`` (low
    half) and ``b[2k+1, j]``: a view (no copy) of a weight stored as ``[N, K]`` rows
    (``weight.t()``) with even ``K``, so that :func:`pack_b` of it (the 32-bit kernel) writes
    :func:`pack_b_pairs`' layout; ``None`` for other dtypes, layouts and odd ``K``."""
    k = b.shape[0]
    s0, s1 = b.stride()
    if (
        b.dtype != torch.bfloat16
        or k % 2
        or (s0 != 1 and k > 1)
        or s1 % 2
        or b.storage_offset() % 2
    ):
        return None
    return b.t().view(torch.int32).t()


def pack_pairs_reference(b: torch.Tensor, nr: int) -> torch.Tensor:
    """Obviously correct pair packing (tests): ``[ceil(N/nr), ceil(K/2), nr, 2]`` bf16, element
    ``[p, k, c, h] = b[2k + h, p * nr + c]`` (zero beyond ``K`` and ``N``)."""
    k, n = b.shape
    kp, npan = (k + 1) // 2, (n + nr - 1) // nr
    b = torch.cat([b, b.new_zeros(2 * kp - k, n)])
    out = torch.zeros(npan, kp, nr, 2, dtype=b.dtype)
    for p in range(npan):
        w = min(nr, n - p * nr)
        out[p, :, :w, :] = b[:, p * nr : p * nr + w].reshape(kp, 2, w).transpose(1, 2)
    return out


def pack_b_pairs(b: torch.Tensor, nr: int = 32, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``[K, N]`` → ``[ceil(N/nr), ceil(K/2), nr, 2]`` for the ``vdpbf16ps`` kernels (zero
    padded in K and N), into ``out`` when given (contiguous, that shape). A ``weight.t()`` with
    even K goes through :func:`pack_b` of its :func:`pair_words` (the native 32-bit kernel, no
    copy first); other layouts and odd K take one strided torch copy from a zero-padded view."""
    k, n = b.shape
    kp, npan = (k + 1) // 2, (n + nr - 1) // nr
    shape = (npan, kp, nr, 2)
    if out is None:
        out = packed_empty(shape, b.dtype)
    assert out.shape == shape and out.dtype == b.dtype and out.is_contiguous()
    words = pair_words(b)
    if words is not None and n > 0:
        pack_b(words, nr, out=out.view(torch.int32).view(npan, kp, nr))
        return out
    if 2 * kp == k and npan * nr == n:
        src = b
    else:
        src = b.new_zeros(2 * kp, npan * nr)
        src[:k, :n] = b
    out.copy_(src.view(kp, 2, npan, nr).permute(2, 0, 3, 1))
    return out


class _Probe:
    """Up to 16 spread-out elements of ``b``, read as raw bits straight from its memory.

    A bitwise fingerprint (a NaN compares equal to itself) that costs about a microsecond to
    re-read, where indexing the tensor costs tens. It holds ``b``'s storage weakly
    (``StorageWeakRef``): a read first takes a strong reference to that storage and reads only
    while it is alive and its memory has not moved (``resize_``), so it never touches freed or
    reused memory and never keeps a dead tensor's memory alive.
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
        storage = b.untyped_storage()
        self._ref = StorageWeakRef(storage)
        # the storage's memory when probed: it may be reallocated in place (resize_), checked
        # per read; also what PackCache.invalidate matches parameters' storages against
        self.storage_ptr = storage.data_ptr()
        self._base = b.data_ptr()
        # the sampled elements as unsigned integers of the element's width (bitwise; NaN-safe),
        # gathered by one itemgetter over a typed view of the memory (~3x faster than slicing
        # and joining bytes: this runs on every packed-weight lookup)
        word = _PROBE_WORDS[es]
        span = (max(offs) // es + 1) if offs else 0
        raw: Any = (word * span).from_address(self._base) if offs else None
        self._read: Callable[[], object] = (
            functools.partial(operator.itemgetter(*[o // es for o in offs]), raw)
            if raw is not None
            else tuple
        )
        self._raw = raw
        self._value: object = self._read()

    def read(self) -> object:
        """The sampled elements' current bits (compared with ``==``)."""
        return self._read()

    def expired(self) -> bool:
        """True once the probed tensor's storage is freed (its entry can never be valid again:
        a storage later allocated at the same address is other memory)."""
        return self._ref.expired()

    def unchanged(self) -> bool:
        """The probed storage is alive, still at the same memory, and the sampled bits match."""
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        if storage is None or storage.data_ptr() != self.storage_ptr:
            return False  # freed, or moved: never read the old address
        return self._read() == self._value  # (``storage`` keeps the memory alive meanwhile)


# an entry version no lookup matches (version counters start at 0; -1 is an inference tensor)
_STALE = -2


@dataclass
class _Entry:
    version: int  # _STALE once an optimiser stepped the tensor (see PackCache.invalidate)
    probe: _Probe  # holds the tensor's storage weakly: the entry is void once it is freed
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class PackCache:
    """Packed operands keyed by storage, layout and panel width, validated on every lookup.

    An entry is valid while the tensor's storage is alive and unmoved, its version counter is
    unchanged (in-place updates, such as optimiser steps, bump it) and 16 sampled values still
    match bit for bit (which also catches writes through ``.data``, except ones that leave every
    sampled value alone). An inference tensor (made under ``torch.inference_mode()``) keeps no
    version counter: its entry is validated by the storage and the sampled values alone, the
    guarantee ``.data`` writes get (an in-place write inside inference mode that leaves every
    sampled value alone is not seen); before, such weights were never kept and every call
    repacked them.

    Entries hold their tensor's storage weakly and only the packing strongly, so ``max_bytes``
    bounds all the cache keeps alive: an entry whose storage was freed is void (a storage
    allocated later at the same address never matches it) and is dropped at its next lookup and
    at every insertion. Before, entries held their tensors: a weight derived afresh on every call
    (``weight_norm``, autocast's bf16 copy of an fp32 weight) added an entry, with a dead tensor
    and its packing, every few calls (60 calls: 24 entries, 194 MiB), and a deleted model's
    weights and packings stayed until :meth:`clear`. The least recently used entries are dropped
    beyond ``max_bytes``.

    A parameter's packing (or a view's of one, as ``weight.t()``) is kept from its first use; any
    other operand's from its second with the same key and sampled values (a weight Inductor passes
    as a fresh alias, a constant), so one-off operands are not kept: an activation recomputed at a
    reused address holds other values. Every packing used to be kept, each entry holding its
    tensor: 60 calls on new 1 MiB operands held 60 entries and 120 MiB until the byte bound.
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
        # operands packed once and not kept: key -> sampled values (no tensor held)
        self._seen: OrderedDict[tuple[object, ...], object] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, b: torch.Tensor, nr: int, pairs: bool = False) -> torch.Tensor:
        """Packed ``b`` for panel width ``nr`` (``pairs``: :func:`pack_b_pairs`' layout), from
        the cache when still valid."""
        key = (b.data_ptr(), b.shape, b.stride(), b.dtype, nr, pairs)
        ver = tensor_version(b)  # -1: an inference tensor (_STALE, -2, never matches)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.version == ver and e.probe.unchanged():
                self._entries.move_to_end(key)
                self.hits += 1
                return e.packed
            stale = self._entries.pop(key, None) if e is not None else None
            if stale is not None:
                self._bytes -= stale.nbytes
        param = isinstance(b, torch.nn.Parameter) or isinstance(b._base, torch.nn.Parameter)
        b = b.detach()
        reuse = None
        if stale is not None:
            buf = stale.packed
            # a new version of a cached weight (an optimiser step): repack into the old
            # buffer unless someone else still holds it (the popped entry, ``buf`` and
            # getrefcount's argument are the only references then). Writing memory that is already mapped skips the
            # page faults that dominate packing into fresh memory (measured for 180 MB fp32:
            # ~75 ms into mapped memory, 170-210 ms into fresh memory).
            if sys.getrefcount(buf) <= 3:
                reuse = buf
            del buf, stale
        packed = pack_b_pairs(b, nr, out=reuse) if pairs else pack_b(b, nr, out=reuse)
        size = packed.numel() * packed.element_size()
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            probe = _Probe(b) if size <= self.max_bytes else None
            if probe is not None and (param or self._seen.pop(key, None) == probe.read()):
                self._prune_locked()
                self._entries[key] = _Entry(ver, probe, packed)
                self._bytes += size
                while self._bytes > self.max_bytes and self._entries:
                    _, ev = self._entries.popitem(last=False)
                    self._bytes -= ev.nbytes
            elif probe is not None:  # first sighting (or other values): remembered, not kept
                self._seen[key] = probe.read()
                if len(self._seen) > SEEN_KEYS:
                    self._seen.popitem(last=False)
        return packed

    def _prune_locked(self) -> None:
        """Drop the entries whose tensor's storage was freed (they can never be hit again)."""
        dead = [k for k, e in self._entries.items() if e.probe.expired()]
        for k in dead:
            self._bytes -= self._entries.pop(k).nbytes

    def prune(self) -> int:
        """Drop the entries whose tensor's storage was freed now (insertions do it anyway);
        returns how many."""
        with self._lock:
            n = len(self._entries)
            self._prune_locked()
            return n - len(self._entries)

    def invalidate(self, tensors: Iterable[torch.Tensor]) -> int:
        """Mark stale every entry whose tensor shares storage with one of ``tensors`` (its next
        lookup repacks, into the old buffer when nothing else holds it); returns how many.

        For writes that leave the version counter alone: fused optimisers
        (``torch.optim.Adam(fused=True)`` and the other ``_fused_*_`` kernels) update their
        parameters without bumping it, as do steps written with ``p.data.add_(...)``, so a step
        that changed no sampled element (rows without gradient) kept the old packing: the next
        GEMM read the weights from before the step. Every optimiser step calls this (a global
        step hook, :func:`_after_optimizer_step`)."""
        if not self._entries:
            return 0
        storages = set()
        for t in tensors:
            try:
                storages.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage (sparse, a wrapper
                continue  # subclass): nothing the cache holds
        count = 0
        with self._lock:
            for e in self._entries.values():
                if e.version != _STALE and e.probe.storage_ptr in storages:
                    e.version = _STALE
                    count += 1
        return count

    def clear(self) -> None:
        """Drop every entry and every remembered first sighting."""
        with self._lock:
            self._entries.clear()
            self._seen.clear()
            self._bytes = 0

    def __len__(self) -> int:
        """How many packings the cache holds for live tensors (dead ones are dropped first)."""
        with self._lock:
            self._prune_locked()
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the packings the cache holds for live tensors (dead ones are dropped
        first): everything it keeps alive besides keys and sampled values."""
        with self._lock:
            self._prune_locked()
            return self._bytes


pack_cache = PackCache()


def _after_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimiser step hook: the stepped parameters' packings are stale, whether or not
    the step bumped their version counters (:meth:`PackCache.invalidate`). Costs a storage
    lookup per parameter, and nothing while the cache is empty. A parameter without a gradient
    is skipped, as every torch optimiser skips it: a frozen weight (``requires_grad=False``,
    listed through ``model.parameters()``) was repacked after every step."""
    if pack_cache._entries:  # (not len(), which first drops the entries of freed tensors)
        pack_cache.invalidate(_stepped(opt))


def _stepped(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters an optimiser step may have written: those with a gradient (dense or
    sparse); torch's optimisers leave a parameter whose ``.grad`` is None untouched."""
    return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]


register_optimizer_step_post_hook(_after_optimizer_step)
