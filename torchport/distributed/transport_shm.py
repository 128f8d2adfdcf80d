"""Shared-memory transport: one arena per communicator, mapped by every local rank.

Layout of the arena (a file under ``/dev/shm``)::

    [0, 64)            magic, world, slot bytes (written by the creator)
    [64, 72)           abort word: 0, or (rank + 1) << 8 | reason, set once by the first aborter
    [72, 80)           futex word and sleeper count
    [80, 88)           yield cap in ns (0: none; set when ranks outnumber this host's cores)
    [256, 256 + 256 W) per-rank control lines (arrive epoch, pipeline counters, gone word,
                       two signature halves)
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
import re
import secrets
import stat
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
    GONE,
    HDR_MAGIC,
    LINE,
    MISMATCH,
    OK,
    OVERSUBSCRIBED_YIELD_NS,
    RING_DATA,
    RING_MAGIC,
    RING_MAPPED_OFF,
    SIG_WORDS,
    SIZES_LEFT,
    TIMEOUT,
    YIELD_CAP_OFF,
    shm_lib,
)

SHM_DIR = "/dev/shm"
Read = tuple[int, int, int, int, int]  # (peer, offset in peer's slot, dst pointer, length, mode)
COPY, FOLD, STREAM = 0, 1, 2  # STREAM: a copy with streaming stores (a large op's output)
ALLREDUCE_ARGS = 21  # tp_shm_allreduce_packed's block: 16 arguments, 5 info words
_PACK_ALLREDUCE = struct.Struct("<11q").pack_into  # epoch .. timeout_ns at word 5
# tp_shm_step_packed's block: hdr, data, world, rank, slot, epoch, the signature, npubs,
# nreads, dtype, op, timeout_ns, three ``bad`` words, then 2 words per pub and 5 per read
STEP_HEAD = 6 + SIG_WORDS + 8
STEP_BAD = 6 + SIG_WORDS + 5
STEP_CAP = 64  # pub and read words the arena's own block holds (a longer step packs its own)
_PACK_STEP = struct.Struct(f"<{1 + SIG_WORDS + 5}q").pack_into  # epoch .. timeout_ns at word 5
# tp_shm_alltoall_packed's block: hdr .. sig as above, dtype, mode, timeout_ns, three ``bad``
# words, then in_lens, out_lens, ins, outs and every rank's sizes
A2A_HEAD = 6 + SIG_WORDS + 6
_PACK_A2A = struct.Struct(f"<{1 + SIG_WORDS + 3}q").pack_into  # epoch .. timeout_ns at word 5


def _ns(timeout_s: float) -> int:
    """A step's timeout in whole nanoseconds for the native side, within 0 .. 2**62 (a group
    timeout of centuries overflowed the argument block's int64: an untyped struct.error)."""
    return max(0, int(timeout_s * 1e9)) if timeout_s < 4.6e9 else 1 << 62


def _sig_words(sig: Sequence[int]) -> Sequence[int]:
    """A step signature as the native side's SIG_WORDS words (zeros past the given ones)."""
    return sig if len(sig) == SIG_WORDS else (*sig, *(0,) * (SIG_WORDS - len(sig)))


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


class _ShmFile:
    """A file under ``/dev/shm`` mapped here (``_mm``, its address ``base`` through the
    ``_anchor`` view): what an arena and a ring share."""

    path: str
    _mm: mmap.mmap | None
    _anchor: ctypes.c_char

    def unlink(self) -> None:
        """Remove the file name (mappings stay valid)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _unmap(self) -> None:
        """Unmap (the caller holds the lock that keeps native calls off the mapping)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            del self._anchor
            with contextlib.suppress(BufferError):  # a live pointer view: unmapped at exit
                mm.close()


class ShmArena(_ShmFile):
    """A mapped arena; ``step`` runs one collective step on it."""

    def __init__(self, path: str, world: int, rank: int, slot: int, *, create: bool) -> None:
        if world > 256:
            raise CommError(
                f"shared-memory transport supports at most 256 local ranks, got {world}"
            )
        self.path, self.world, self.rank, self.slot = path, world, rank, slot
        self.data_off, self.size = arena_bytes(world, slot)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError as e:
            if create:  # (no such directory)
                raise
            raise CommError(
                f"shared-memory arena {path} does not exist: its creator never made it or "
                f"already removed it (it does once every rank mapped it, or when it stops "
                f"waiting for them at its timeout)"
            ) from e
        try:
            if create:
                os.ftruncate(fd, self.size)
            elif os.fstat(fd).st_size != self.size:
                raise CommError(
                    f"shared-memory arena {path} has {os.fstat(fd).st_size} bytes, "
                    f"expected {self.size} (world {world}, slot {slot})"
                )
            self._mm = mmap.mmap(fd, self.size)
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
        # argument block of tp_shm_allreduce_packed: the arena's fields once, the rest per call
        self._ar = (ctypes.c_int64 * ALLREDUCE_ARGS)(
            self.base, self.base + self.data_off, world, rank, slot
        )
        self._ar_addr = ctypes.addressof(self._ar)
        # argument block of tp_shm_step_packed, likewise
        self._st = (ctypes.c_int64 * (STEP_HEAD + STEP_CAP))(
            self.base, self.base + self.data_off, world, rank, slot
        )
        self._st_addr = ctypes.addressof(self._st)
        self._a2a: ctypes.Array[ctypes.c_int64] | None = None  # alltoall's, made at first use

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
        flat = [v for p in pubs for v in p]
        flat += [v for r in reads for v in r]
        a, addr = self._st, self._st_addr
        if len(flat) > STEP_CAP:  # (a wide group's step: a block of its own)
            a = (ctypes.c_int64 * (STEP_HEAD + len(flat)))(*self._st[:5])
            addr = ctypes.addressof(a)
        _PACK_STEP(a, 40, epoch, *_sig_words(sig), len(pubs), len(reads), dtype, op, _ns(timeout_s))
        if flat:
            struct.pack_into(f"<{len(flat)}q", a, 8 * STEP_HEAD, *flat)
        st = self.lib.step_packed(addr)
        if st != OK:
            raise StepError(st, (a[STEP_BAD], a[STEP_BAD + 1], a[STEP_BAD + 2]))

    def alltoall_sizes(
        self,
        epoch: int,
        sig: Sequence[int],
        in_lens: Sequence[int],
        out_lens: Sequence[int],
        ins: Sequence[int],
        outs: Sequence[int],
        dtype: int,
        mode: int,
        timeout_s: float,
    ) -> tuple[int, ...] | None:
        """alltoall's first step (sizes, and the pieces when every rank's fit) in one native
        call. None when the whole exchange is done; else every rank's sizes, flat (rank q's
        sends to each rank, then its receives), for the caller to report a mismatch or go on
        in steps."""
        assert self._mm is not None, "arena closed"
        w, a = self.world, self._a2a
        if a is None:
            a = self._a2a = (ctypes.c_int64 * (A2A_HEAD + 4 * w + 2 * w * w))(*self._st[:5])
        _PACK_A2A(a, 40, epoch, *_sig_words(sig), dtype, mode, _ns(timeout_s))
        struct.pack_into(f"<{4 * w}q", a, 8 * A2A_HEAD, *in_lens, *out_lens, *ins, *outs)
        st = self.lib.alltoall_packed(ctypes.addressof(a))
        if st == OK:
            return None
        if st == SIZES_LEFT:
            return struct.unpack_from(f"<{2 * w * w}q", a, 8 * (A2A_HEAD + 4 * w))
        bad = A2A_HEAD - 3
        raise StepError(st, (a[bad], a[bad + 1], a[bad + 2]))

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
        _PACK_ALLREDUCE(a, 40, epoch, *sig3, ptr, nbytes, esize, small, dtype, op, _ns(timeout_s))
        st = self.lib.allreduce_packed(self._ar_addr)
        if st != OK:
            err = StepError(st, (a[16], a[17], a[18]))
            err.step = int(a[20])
            raise err
        return int(a[19])

    def set_abort(self, rank: int, reason: int) -> int:
        """Raise the abort flag (first writer wins); return the stored word."""
        with self._unmap_lock:
            if self._mm is None:
                return 0
            return int(self.lib.set_abort(self.base, ((rank + 1) << 8) | reason))

    def mark_gone(self, rank: int) -> None:
        """Mark ``rank`` as gone from the group (it left the job: its goodbye was read, after
        its last step): a step of any rank that waits for it to arrive where it never will
        fails at once (``GONE``) instead of at its timeout; a step it already finished is
        unaffected."""
        assert 0 <= rank < self.world, f"rank {rank} outside the arena's {self.world}"
        with self._unmap_lock:
            if self._mm is not None:
                self.lib.mark_gone(self.base, rank)

    def abort_word(self) -> int:
        """0 while healthy, else ``(rank + 1) << 8 | reason`` of the first aborter."""
        with self._unmap_lock:
            return 0 if self._mm is None else int(self.lib.get_abort(self.base))

    def close(self) -> None:
        """Unmap (after in-flight steps ended)."""
        with self._unmap_lock:
            self._unmap()


RING_NAME = re.compile(r"/dev/shm/torchport-ring-([0-9]+)-[0-9a-f]{16}")
# a ring name older than this whose creator is not a live process here is removed when a ring
# is made (both ends were killed before the reader mapped it; a live offer is mapped within
# the time its peer's reader thread takes to read one frame)
STALE_RING_S = 60.0


class ShmRing(_ShmFile):
    """A one-way byte ring in a shared file, from one process to another of the same host.

    The TCP mesh sends the payload of a large point-to-point frame through it instead of the
    socket (the header still goes by the socket, so the reader knows what to take from the
    ring, and in which order). The writer creates the file (``create=True``: a random name,
    mode 0600, its pages reserved with ``posix_fallocate`` so that a full ``/dev/shm`` is an
    error here and not a SIGBUS later) and offers its path to the reader, which maps it and
    unlinks the name. Either side's :meth:`close` ends the other's waits; the writer's
    ``drain`` close lets the reader take what is still in the ring first.

    The file is writable by the peer: this side's position is kept here (the shared word only
    publishes it) and the native copy checks the peer's word against the capacity, so a peer
    that scribbles on the file breaks the connection (``RING_CORRUPT``), not this process."""

    def __init__(self, path: str, capacity: int = 0, *, create: bool) -> None:
        if create:
            if capacity <= 0:
                raise CommError(f"a ring needs a positive capacity, got {capacity}")
            _sweep_stale_rings()
            path = self.new_path()
        elif not RING_NAME.fullmatch(path):
            raise CommError(f"refusing to map {path!r}: not a torchport ring name")
        self.path = path
        self.lib = shm_lib()
        # a move holds _use for one native call; close() marks the ring closed first (under
        # _state, while mapped), which ends such a call, and unmaps under both
        self._use = threading.Lock()
        self._state = threading.Lock()
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                size = RING_DATA + capacity
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            else:
                st = os.fstat(fd)
                size = st.st_size
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    raise CommError(f"refusing to map {path}: not a regular file of this user")
                if size != RING_DATA + capacity:
                    raise CommError(
                        f"ring {path} has {size} bytes, expected {RING_DATA + capacity}"
                    )
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.capacity = capacity
        self._pos = ctypes.c_int64(0)  # this side's position (bytes written, or read)
        self._pos_addr = ctypes.addressof(self._pos)
        # bytes copied between two publications: a quarter of the ring (the other side copies
        # the last quarter meanwhile; 64 MiB through a 4 MiB ring took 26.5-43.5 ms in 256 KiB
        # publications, 7.9-11.4 ms in 1 MiB ones here: a reader right behind the writer
        # fights it for the lines being written)
        self.chunk = max(1 << 16, capacity // 4)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        if create:
            struct.pack_into("<QQ", self._mm, 0, RING_MAGIC, capacity)
        elif struct.unpack_from("<QQ", self._mm, 0) != (RING_MAGIC, capacity):
            self.close()
            raise CommError(f"ring {path} has a foreign header")
        else:
            struct.pack_into("<q", self._mm, RING_MAPPED_OFF, 1)

    @staticmethod
    def new_path() -> str:
        """A fresh, unguessable ring path."""
        return os.path.join(SHM_DIR, f"torchport-ring-{os.getpid()}-{secrets.token_hex(8)}")

    def move(self, ptr: int, n: int, *, put: bool, budget_ns: int) -> int:
        """Copy up to ``n`` bytes into the ring from ``ptr`` (``put``) or out of it to ``ptr``
        (0: dropped), publishing every ``chunk`` bytes; the bytes moved once all are or the
        budget passed with no room or data (0 possible); -1 once closed (by either side)."""
        with self._use:
            if self._mm is None:
                return -1
            return int(
                self.lib.ring_move(
                    self.base,
                    self.capacity,
                    self._pos_addr,
                    ptr,
                    n,
                    self.chunk,
                    budget_ns,
                    int(put),
                )
            )

    @property
    def mapped(self) -> bool:
        """Whether the reader has mapped the ring (and so removed its name)."""
        with self._state:
            if self._mm is None:
                return False
            return struct.unpack_from("<q", self._mm, RING_MAPPED_OFF)[0] != 0

    def close(self, *, drain: bool = False) -> None:
        """Mark the ring closed for both sides, then unmap it. ``drain`` (the writer, closing
        cleanly): the reader still takes what is in the ring, then sees it closed."""
        with self._state:
            if self._mm is None:
                return
            self.lib.ring_close(self.base, 1 if drain else 2)
        with self._use, self._state:
            self._unmap()


def _sweep_stale_rings() -> None:
    """Remove ring names of this user older than ``STALE_RING_S`` whose creator is no live
    process here: left when both ends were killed before the reader mapped the ring (its
    reader removes a name; a writer closing cleanly keeps one its reader has yet to map)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    uid, now = os.getuid(), time.time()
    for name in names:
        path = os.path.join(SHM_DIR, name)
        m = RING_NAME.fullmatch(path)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            if pid != os.getpid():
                os.kill(pid, 0)
            continue  # its creator lives (or is another user's: not ours to remove)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_uid == uid and now - st.st_mtime > STALE_RING_S:
                os.unlink(path)


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


__all__ = [
    "ABORTED",
    "BAD_ARG",
    "COPY",
    "FOLD",
    "GONE",
    "MISMATCH",
    "STREAM",
    "TIMEOUT",
    "ShmArena",
    "ShmRing",
    "StepError",
]
