"""Shared-memory transport: one arena per communicator, mapped by every local rank.

Layout of the arena (a file under ``/dev/shm``)::

    [0, 64)            magic, world, slot bytes (written by the creator)
    [64, 72)           abort word: 0, or (rank + 1) << 8 | reason, set once by the first aborter
    [72, 80)           futex word and sleeper count
    [80, 88)           yield cap in ns (0: none; set when ranks outnumber this host's cores)
    [256, 256 + 256 W) per-rank control lines (arrive epoch, two signature halves)
    [data, ...)        per rank, two halves of ``slot`` bytes each (double buffering)

Rank 0 creates the file with a random name, publishes the name through the store, waits for
every rank to map it, then unlinks it: the arena lives exactly as long as its mappings, and a
crash leaves nothing behind in ``/dev/shm``. A collective step is one native call
(:mod:`~torchport.distributed.shm_kernels`), so the hot path runs no Python per chunk beyond the
call itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence

import torch

from torchport.distributed.errors import CommError
from torchport.distributed.shm_kernels import (
    ABORTED,
    BAD_ARG,
    CTRL_OFF,
    DATA_ALIGN,
    HDR_MAGIC,
    LINE,
    MISMATCH,
    OK,
    OVERSUBSCRIBED_YIELD_NS,
    SIG_WORDS,
    TIMEOUT,
    YIELD_CAP_OFF,
    shm_lib,
)

SHM_DIR = "/dev/shm"
Read = tuple[int, int, int, int, int]  # (peer, offset in peer's slot, dst pointer, length, mode)
COPY, FOLD = 0, 1
ALLREDUCE_ARGS = 21  # tp_shm_allreduce_packed's block: 16 arguments, 5 info words
_PACK_ALLREDUCE = struct.Struct("<11q").pack_into  # epoch .. timeout_ns at word 5


def arena_bytes(world: int, slot: int) -> tuple[int, int]:
    """(data offset, total size) of an arena for ``world`` ranks with ``slot`` bytes per half."""
    data = -(-(CTRL_OFF + LINE * world) // DATA_ALIGN) * DATA_ALIGN
    return data, data + 2 * world * slot


class StepError(Exception):
    """Internal: a failed step, with the native status and mismatch details."""

    def __init__(self, status: int, detail: tuple[int, int, int] = (0, 0, 0)) -> None:
        super().__init__(status, detail)
        self.status = status
        self.detail = detail
        self.step = -1


class ShmArena:
    """A mapped arena; ``step`` runs one collective step on it."""

    def __init__(self, path: str, world: int, rank: int, slot: int, *, create: bool) -> None:
        if world > 256:
            raise CommError(
                f"shared-memory transport supports at most 256 local ranks, got {world}"
            )
        self.path, self.world, self.rank, self.slot = path, world, rank, slot
        self.data_off, self.size = arena_bytes(world, slot)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
            elif os.fstat(fd).st_size != self.size:
                raise CommError(
                    f"shared-memory arena {path} has {os.fstat(fd).st_size} bytes, "
                    f"expected {self.size} (world {world}, slot {slot})"
                )
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        # set_abort / abort_word come from other threads (a peer's abort notice, a watcher):
        # they and close() hold this lock, so none of them writes to an unmapped arena
        self._unmap_lock = threading.Lock()
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        if create:
            struct.pack_into("<QQQ", self._mm, 0, HDR_MAGIC, world, slot)
            if world > len(os.sched_getaffinity(0)):  # waiters sleep sooner (shm_kernels)
                struct.pack_into("<q", self._mm, YIELD_CAP_OFF, OVERSUBSCRIBED_YIELD_NS)
        else:
            magic, w, s = struct.unpack_from("<QQQ", self._mm, 0)
            if (magic, w, s) != (HDR_MAGIC, world, slot):
                raise CommError(f"shared-memory arena {path} has a foreign header")
        self.lib = shm_lib()
        self._sig = (ctypes.c_int64 * SIG_WORDS)()
        self._bad = (ctypes.c_int64 * 3)()
        # argument block of tp_shm_allreduce_packed: the arena's fields once, the rest per call
        self._ar = (ctypes.c_int64 * ALLREDUCE_ARGS)(
            self.base, self.base + self.data_off, world, rank, slot
        )
        self._ar_addr = ctypes.addressof(self._ar)

    @staticmethod
    def new_path() -> str:
        """A fresh, unguessable arena path."""
        return os.path.join(SHM_DIR, f"torchport-{os.getpid()}-{secrets.token_hex(8)}")

    def step(
        self,
        epoch: int,
        sig: Sequence[int],
        pubs: Sequence[tuple[int, int]],
        reads: Sequence[Read],
        dtype: int,
        op: int,
        timeout_s: float,
    ) -> None:
        """Publish ``pubs`` (pointer, length), barrier, check signatures, apply ``reads``."""
        assert self._mm is not None, "arena closed"
        for i in range(SIG_WORDS):
            self._sig[i] = sig[i] if i < len(sig) else 0
        pa = (ctypes.c_int64 * (2 * len(pubs) or 1))(*[v for p in pubs for v in p])
        ra = (ctypes.c_int64 * (5 * len(reads) or 1))(*[v for r in reads for v in r])
        st = self.lib.step(
            self.base,
            self.base + self.data_off,
            self.world,
            self.rank,
            self.slot,
            epoch,
            self._sig,
            pa,
            len(pubs),
            ra,
            len(reads),
            dtype,
            op,
            max(0, int(timeout_s * 1e9)),
            self._bad,
        )
        if st != OK:
            raise StepError(st, (self._bad[0], self._bad[1], self._bad[2]))

    def allreduce(
        self,
        epoch: int,
        sig3: Sequence[int],
        ptr: int,
        nbytes: int,
        esize: int,
        small: int,
        dtype: int,
        op: int,
        timeout_s: float,
    ) -> int:
        """A whole in-place allreduce in one native call; returns the number of steps used.

        On failure raises :class:`StepError` whose ``step`` attribute names the failing step.
        """
        assert self._mm is not None, "arena closed"
        a = self._ar
        _PACK_ALLREDUCE(
            a, 40, epoch, *sig3, ptr, nbytes, esize, small, dtype, op, max(0, int(timeout_s * 1e9))
        )
        st = self.lib.allreduce_packed(self._ar_addr)
        if st != OK:
            err = StepError(st, (a[16], a[17], a[18]))
            err.step = int(a[20])
            raise err
        return int(a[19])

    def reread(self, epoch: int, reads: Sequence[Read], dtype: int, op: int) -> None:
        """More reads from the slots published at ``epoch`` (the step just completed)."""
        assert self._mm is not None, "arena closed"
        ra = (ctypes.c_int64 * (5 * len(reads) or 1))(*[v for r in reads for v in r])
        st = self.lib.reread(
            self.base + self.data_off, self.world, self.slot, epoch, ra, len(reads), dtype, op
        )
        if st != OK:
            raise StepError(st)

    def set_abort(self, rank: int, reason: int) -> int:
        """Raise the abort flag (first writer wins); return the stored word."""
        with self._unmap_lock:
            if self._mm is None:
                return 0
            return int(self.lib.set_abort(self.base, ((rank + 1) << 8) | reason))

    def abort_word(self) -> int:
        """0 while healthy, else ``(rank + 1) << 8 | reason`` of the first aborter."""
        with self._unmap_lock:
            return 0 if self._mm is None else int(self.lib.get_abort(self.base))

    def unlink(self) -> None:
        """Remove the file name (mappings stay valid)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap (after in-flight steps ended)."""
        with self._unmap_lock:
            mm, self._mm = self._mm, None
            if mm is not None:
                del self._anchor
                with contextlib.suppress(BufferError):  # a live pointer view: unmapped at exit
                    mm.close()


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``pred`` until true or raise :class:`CommError` naming ``what``."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise CommError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(0.001)


def tensor_ptr(t: torch.Tensor) -> int:
    """Data pointer of a contiguous CPU tensor (0 for empty tensors)."""
    return t.data_ptr() if t.numel() else 0


__all__ = ["ABORTED", "BAD_ARG", "COPY", "FOLD", "MISMATCH", "TIMEOUT", "ShmArena", "StepError"]
