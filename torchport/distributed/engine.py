"""Communicators: one group's ranks, transport, step epoch and error state.

A :class:`Communicator` is one group's state: its ranks (as global ranks of the shared
:class:`~torchport.distributed.transport_tcp.Mesh`), its shared-memory arena when every member
is on this host, the step epoch, and its first error. Collectives are sequences of *steps*
(``Communicator.step``): each rank publishes some bytes, all ranks meet, and each applies a
list of reads (copy or fold) from any rank's published bytes. On shared memory a step is one
native call; over TCP the published bytes go to every peer in one frame and the reads are
applied to the received buffers by the same native code.

Each communicator owns an :class:`~torchport.distributed.progress.Engine`: a thread that runs
issued operations in order, so issuing never blocks the caller (Work handles and the engine live
in :mod:`~torchport.distributed.progress`). Point-to-point receives complete from the mesh's reader threads.

Error model (see :mod:`~torchport.distributed.errors`): the first failure is kept
(``get_error()``), broadcast to peers (the arena's abort word and ABORT frames), and fails every
queued and later operation. ``abort()`` does the same with :class:`CommAbortedError`; peers see a
:class:`RemoteError` within one spin/poll interval (well under 100 ms).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import increment_version

from torchport.distributed.errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    CommAbortedError,
    CommError,
    CommTimeoutError,
    CommunicatorErrorState,
    PeerLeftError,
    RemoteError,
)
from torchport.distributed.exchange import Blob, exchange
from torchport.distributed.progress import Engine, TorchportWork
from torchport.distributed.shm_kernels import shm_lib
from torchport.distributed.transport_shm import (
    ABORTED,
    GONE,
    MISMATCH,
    TIMEOUT,
    Read,
    ShmArena,
    StepError,
)
from torchport.distributed.transport_tcp import (
    RECEIVED,
    Delivery,
    Mesh,
    Once,
    SendSource,
    Target,
    on_reader_thread,
)
from torchport.distributed.wire import Kind

# Abort reasons (low byte of the abort word / seq of ABORT frames).
REASON_ABORT, REASON_TIMEOUT, REASON_MISMATCH, REASON_ERROR, REASON_SHUTDOWN = 1, 2, 3, 4, 5
# An operation needed a rank that left the job: the abort word's rank is the one that left
# (not the one that found it), and an ABORT frame's seq carries it above the reason byte
# (``REASON_LEFT | (rank + 1) << 8``), so every rank's error names the rank that left.
REASON_LEFT = 6
REASONS = {
    REASON_ABORT: "called abort()",
    REASON_TIMEOUT: "timed out",
    REASON_MISMATCH: "detected mismatched collectives",
    REASON_ERROR: "failed",
    REASON_SHUTDOWN: "shut down",
    REASON_LEFT: "left the job",
}

OP_NAMES = (
    "barrier",
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "gather",
    "scatter",
    "reduce_scatter",
    "alltoall",
    "alltoall_sizes",
)
# Op codes of the step signature: the index of the name above (shared by the shm and tcp algorithms,
# so a mismatched call is detected whichever transport carries it).
OP_BARRIER, OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER = range(5)
OP_GATHER, OP_SCATTER, OP_REDUCE_SCATTER, OP_ALLTOALL, OP_ALLTOALL_SIZES = range(5, 10)
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
# Codes below NATIVE_CODES name a dtype the native kernels fold; every other torch dtype
# (uint16/32/64, the float8 and sub-byte types, the quantized ones) is moved as bytes, never
# reduced, but still gets a code of its own after them, so two ranks calling with different
# dtypes of one size (float8_e4m3fn and float8_e5m2) see a signature mismatch instead of
# reinterpreting the bytes. The extra codes follow the dtypes' names: every rank runs one torch.
NATIVE_CODES = len(DTYPES)
ALL_DTYPES: tuple[torch.dtype, ...] = DTYPES + tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)} - set(DTYPES), key=str)
)
DTYPE_CODE = {d: i for i, d in enumerate(ALL_DTYPES)}
assert len(ALL_DTYPES) <= 0xFF, "the signature holds a dtype code in 8 bits"
RED_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
# A reduce-op code's low four bits are the fold the native kernels run (RED_NAMES); the bits
# above only tell ops apart in the step signature: AVG and PREMUL_SUM fold as SUM (the division
# or the scaling happens around the collective), and a rank's AVG met another's SUM unnoticed
# (each got its own answer)
FOLD_MASK = 0xF
RED_AVG, RED_PREMUL = 1 << 4, 2 << 4


def red_name(red: int) -> str:
    """The reduce op of a signature's code."""
    if red & RED_AVG:
        return "AVG"
    if red & RED_PREMUL:
        return "PREMUL_SUM"
    return RED_NAMES[red] if red < len(RED_NAMES) else str(red)


def dtype_code(dt: torch.dtype) -> int:
    """``dt``'s code in the step signature (below NATIVE_CODES: one the native kernels fold)."""
    return DTYPE_CODE[dt]


def make_sig(
    op_seq: int, op: int, dtype: int, red: int, root: int, nbytes: int, step: int
) -> tuple[int, int, int, int]:
    """The 4-word step signature every rank must agree on."""
    return (op_seq, op | (dtype << 8) | (red << 16) | ((root + 1) << 24), nbytes, step)


def split_even(n: int, w: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``w`` near-equal ``(start, length)`` parts (the first
    ``n % w`` one longer): how every algorithm assigns blocks to ranks."""
    per, extra = divmod(n, w)
    out, lo = [], 0
    for q in range(w):
        k = per + (1 if q < extra else 0)
        out.append((lo, k))
        lo += k
    return out


def chunk_ranges(total: int, per: int) -> list[tuple[int, int]]:
    """``(offset, length)`` chunks of at most ``per``; one empty chunk when ``total`` is 0."""
    if total <= per:  # (a small message's one chunk without the comprehension)
        return [(0, total)]
    return [(lo, min(per, total - lo)) for lo in range(0, total, per)]


# Frames of a point-to-point message hold at most this many bytes (or the frame bound, if
# lower): between two of them an ABORT can go out (abort within 100 ms: 16 MiB is ~8 ms at
# loopback's 2 GB/s, where a 256 MiB frame held the connection ~125 ms)
P2P_FRAME_BYTES = 16 << 20


def p2p_bound(max_frame: int) -> int:
    """The frame size of point-to-point messages under the frame bound ``max_frame``."""
    return min(max_frame, P2P_FRAME_BYTES)


def p2p_frames(
    payload: memoryview, code: int, numel: int, bound: int
) -> list[tuple[memoryview, tuple[int, int, int, int]]]:
    """A point-to-point message's frames ``(bytes, sig)``: one when it fits in ``bound`` bytes,
    else consecutive pieces of ``bound`` bytes whose signature is (dtype code, numel, byte
    offset, frame count) -- sent back to back (``Mesh.send_frames``), so no frame of the
    receiver's buffers exceeds the bound and the message may be any size."""
    n = len(payload)
    if n <= bound:
        return [(payload, (code, numel, 0, 0))]
    count = -(-n // bound)
    return [(payload[o : o + bound], (code, numel, o, count)) for o in range(0, n, bound)]


def dtype_name(code: int) -> str:
    """The dtype of a signature's dtype code, without ``torch.``."""
    return (
        str(ALL_DTYPES[code]).removeprefix("torch.") if code < len(ALL_DTYPES) else f"dtype{code}"
    )


def _code_fields(code: int) -> tuple[str, list[tuple[str, str]]]:
    """A signature's code word as (op name, its ``(field, value)`` pairs that apply to it)."""
    op, dt, red, root = code & 0xFF, (code >> 8) & 0xFF, (code >> 16) & 0xFF, (code >> 24) - 1
    name = OP_NAMES[op] if op < len(OP_NAMES) else f"op{op}"
    fields = [("dtype", dtype_name(dt))]
    if name in ("allreduce", "reduce", "reduce_scatter"):
        fields.append(("op", red_name(red)))
    if root >= 0 and name in ("broadcast", "reduce", "gather", "scatter"):
        fields.append(("root", str(root)))
    return name, fields


def describe_sig(sig: Sequence[int]) -> str:
    """Human-readable form of a signature."""
    name, fields = _code_fields(sig[1])
    parts = [f"{k}={v}" for k, v in fields[:1]] + [f"bytes={sig[2]}"]
    parts += [f"{k}={v}" for k, v in fields[1:]]
    return f"collective #{sig[0]} {name}({', '.join(parts)}) step {sig[3]}"


def describe_code_mismatch(ours: int, theirs: int) -> str:
    """Which fields of two signatures' code words differ, and the peer's operation as far as
    its code word tells (its sequence number, byte count and step are not known):
    "op/dtype/reduce-op/root: its dtype (theirs: allreduce(dtype=int32, op=SUM))". (It had read
    the code word as a whole signature: "collective #0 allreduce(dtype=int32, bytes=0, ...)
    step 0".)"""
    (mine, a), (name, b) = _code_fields(ours), _code_fields(theirs)
    if mine != name:
        differ = ["collective"]
    else:
        da, db = dict(a), dict(b)
        differ = [k for k in ("dtype", "op", "root") if da.get(k) != db.get(k)]
    shown = ", ".join(f"{k}={v}" for k, v in b)
    its = f"its {' and '.join(differ)} " if differ else ""
    return f"op/dtype/reduce-op/root: {its}(theirs: {name}({shown}))"


# Two strided tensors whose byte ranges intersect are compared on a byte map of the shared range
# up to this size (one allocation, the fastest exact test there); past it they are compared
# by walking one tensor's elements in chunks of OVERLAP_CHUNK (bounded memory, exact for any span).
OVERLAP_MAP_BYTES = 64 << 20
OVERLAP_CHUNK = 1 << 16


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the addresses ``t``'s elements occupy (``t`` non-empty; strides >= 0)."""
    es, lo = t.element_size(), t.data_ptr()
    hi = lo + es + sum((n - 1) * st * es for n, st in zip(t.shape, t.stride()))
    return lo, hi


def _layout(t: torch.Tensor) -> list[tuple[int, int]]:
    """``t``'s ``(size, byte stride)`` dims that move an element, largest stride first (size-1
    and stride-0 dims only repeat addresses, so they change no byte set)."""
    es = t.element_size()
    dims = [(n, st * es) for n, st in zip(t.shape, t.stride()) if n > 1 and st > 0]
    return sorted(dims, key=lambda d: d[1], reverse=True)


def _nested(dims: list[tuple[int, int]]) -> bool:
    """Whether each stride exceeds the reach of the dims inside it (every view of a plain buffer
    by slicing, striding or permuting is): element starts are then distinct and ordered block by
    block, which :func:`_last_start_at_or_below` relies on."""
    reach = 0
    for n, st in reversed(dims):
        if st <= reach:
            return False
        reach += (n - 1) * st
    return True


def _starts(t: torch.Tensor, dims: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """Absolute start addresses of ``t``'s distinct elements, OVERLAP_CHUNK at a time (int64)."""
    total = 1
    for n, _ in dims:
        total *= n
    base = t.data_ptr()
    for lo in range(0, total, OVERLAP_CHUNK):
        idx = torch.arange(lo, min(total, lo + OVERLAP_CHUNK), dtype=torch.int64)
        addr = torch.full_like(idx, base)
        for n, st in reversed(dims):
            addr += (idx % n) * st
            idx = idx // n
        yield addr


def _last_start_at_or_below(
    y: torch.Tensor, base: int, dims: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each address in ``y``: whether some element of the nested layout ``(base, dims)``
    starts at or below it, and ``y`` minus the highest such start (greedy, outer dim first)."""
    rem = y - base
    found = rem >= 0
    for n, st in dims:
        rem = rem - (rem // st).clamp_(0, n - 1) * st
    return found, rem


def _overlap_by_walk(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact overlap test in memory bounded by OVERLAP_CHUNK: walk the elements of one tensor
    and find, for each, the nearest element of the other (which must have a nested layout); when
    neither is nested, compare the two on byte maps of OVERLAP_MAP_BYTES windows instead."""
    da, db = _layout(a), _layout(b)
    na, nb = _nested(da), _nested(db)
    if na or nb:
        # probe with the tensor of fewer elements when the other one can be searched
        if not nb or (na and a.numel() > b.numel()):
            a, b, da, db = b, a, db, da
        ea, eb = a.element_size(), b.element_size()
        for start in _starts(a, da):
            # a's element [x, x + ea) meets b's element starting at s <= x + ea - 1 (the highest
            # such s) iff s + eb > x, i.e. the remainder is below ea - 1 + eb
            found, rem = _last_start_at_or_below(start + (ea - 1), b.data_ptr(), db)
            if bool((found & (rem < ea - 1 + eb)).any()):
                return True
        return False
    (alo, ahi), (blo, bhi) = _byte_span(a), _byte_span(b)
    lo, hi = max(alo, blo), min(ahi, bhi)
    for w0 in range(lo, hi, OVERLAP_MAP_BYTES):
        w1 = min(hi, w0 + OVERLAP_MAP_BYTES)
        seen = [torch.zeros(w1 - w0, dtype=torch.bool) for _ in range(2)]
        for marks, t, dims in ((seen[0], a, da), (seen[1], b, db)):
            es = t.element_size()
            for start in _starts(t, dims):
                start = start[(start < w1) & (start + es > w0)]
                for j in range(es):  # every byte of the element that lies in the window
                    pos = start + (j - w0)
                    marks[pos[(pos >= 0) & (pos < w1 - w0)]] = True
        if bool((seen[0] & seen[1]).any()):
            return True
    return False


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some byte belongs to an element of both ``a`` and ``b`` (CPU tensors). Exact for
    any layout and span; memory stays bounded (OVERLAP_MAP_BYTES, OVERLAP_CHUNK)."""
    if not a.numel() or not b.numel():
        return False
    (alo, ahi), (blo, bhi) = _byte_span(a), _byte_span(b)
    if ahi <= blo or bhi <= alo:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    lo, hi = min(alo, blo), max(ahi, bhi)
    if hi - lo > OVERLAP_MAP_BYTES:
        # (this answered "no overlap" for two column views of a 20000x1000 float32 matrix
        # sharing a column: their span passed the map's limit)
        return _overlap_by_walk(a, b)
    marks = torch.zeros(hi - lo, dtype=torch.uint8)

    def bytes_of(t: torch.Tensor) -> torch.Tensor:  # t's elements as rows of their bytes
        es = t.element_size()
        shape, strides = (*t.shape, es), (*(st * es for st in t.stride()), 1)
        return marks.as_strided(shape, strides, t.data_ptr() - lo)

    bytes_of(a).fill_(1)
    return bool(bytes_of(b).any())


def plain_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous tensor whose memory holds them as they read: ``t`` itself
    when it is one, else a copy. A conjugate or negative view (``x.conj()``, ``x.conj().imag``,
    ``torch._neg_view(x)``) keeps its bit through ``.contiguous()``: its raw bytes, which the
    transports move and fold, are the conjugate / negation of its values."""
    if t.is_conj() or t.is_neg():
        out = torch.empty(t.shape, dtype=t.dtype)
        out.copy_(t.detach())  # (copy_ applies the bits)
        return out
    return t.contiguous()


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0


def _timeout_s(value: Any, default: float) -> float:
    """Seconds from a c10d options timeout (``timedelta``; unset/zero/negative -> default)."""
    if isinstance(value, datetime.timedelta):
        s = value.total_seconds()
        return s if s > 0 else default
    return default


# Closing first lets queued and running operations finish for up to this long (their peers may
# still be on their way to join them: gloo's destructor and NCCL's graceful shutdown flush
# pending work too), capped by the group timeout; what is still in flight then is aborted.
SHUTDOWN_FLUSH_S = 5.0
# How long closing waits for the engine threads to end once stopped.
SHUTDOWN_GRACE_S = 0.05
SLOT_EXTRA = 4096  # a step may publish chunk + this many bytes (room for a header beside a chunk)
# a receive of at least this many bytes (contiguous, from a named rank) is read straight into
# its tensor, frame by frame, when it is posted before its message arrives (no buffer, no copy)
P2P_DIRECT_BYTES = 8 << 10
# how long a failing group waits for a receive's frame being read into its tensor to reach the
# reader's next slice (4 MiB) before it shuts that connection (abort's budget is 100 ms)
RECV_CUT_S = 0.05


class Communicator:
    """One group: ranks, transport, epoch, error state, engine. See the module docstring."""

    def __init__(
        self,
        mesh: Mesh,
        group_id: int,
        ranks: Sequence[int],
        rank: int,
        *,
        arena: ShmArena | None,
        timeout_s: float,
        chunk: int,
        stream_bytes: int,
        name: str,
        local: ShmArena | None = None,
        local_ranks: Sequence[int] = (),
        spawn: Callable[..., None] | None = None,
    ) -> None:
        self.mesh, self.group_id, self.ranks = mesh, group_id, list(ranks)
        self.rank, self.world, self.arena = rank, len(ranks), arena
        self.timeout_s, self.chunk, self.name = timeout_s, chunk, name
        self.slot = chunk + SLOT_EXTRA  # bytes one step may publish
        # outputs of at least this many bytes take streaming stores (algorithms._copy); 0 never
        self.stream_bytes = stream_bytes
        # Hybrid group: an arena among this host's members (group ranks ``local_ranks``); the
        # other peers are reached by TCP. Ops sending a block per peer then cut chunk / world.
        self.local, self.local_ranks, self.local_epoch = local, list(local_ranks), 1
        self.peer_chunk = max(1, chunk // len(ranks)) if local is not None else chunk
        self.epoch = 1
        self.owns_mesh = False  # True for a group that built its own mesh (no root group)
        # True for a sub-group on a mesh that stays when it closes (groups): closing cleanly,
        # it tells each peer (Mesh.send_group_goodbye), whose waits for it then fail at once
        self.says_goodbye = False
        # called once the close ended, for a group on a mesh it does not own (groups: the last
        # group on the root mesh to close after the default group leaves the mesh)
        self.on_closed: Callable[[], None] | None = None
        self.op_seq = 0
        self.error: BaseException | None = None
        # set by close(): a later op would queue on a stopped engine, or run inline on an
        # unmapped arena; it fails at once instead
        self.closed = False
        # set once the flush ended: an op queued before the close and run after it (a wait()
        # running the queue inline) would touch the unmapped arena; it fails instead
        self._stopped = False
        self._pending: list[tuple[Any, Callable[..., None], TorchportWork]] = []
        # point-to-point sends queued or in flight, with the bytes they read (SendSource)
        self._sends: dict[TorchportWork, SendSource] = {}
        self._lock = threading.Lock()
        self._running = threading.local()  # .work: the operation run() runs on this thread
        self.lib = shm_lib()
        self.engine = Engine(f"tp-engine-{name}", self.run, spawn)
        self.sender = Engine(f"tp-send-{name}", self.run, spawn)
        mesh.register(group_id, self)

    @property
    def transport(self) -> str:
        if self.arena is not None:
            return "shm"
        return "hybrid" if self.local is not None else "tcp"

    @property
    def _shm(self) -> ShmArena | None:
        """The arena whose abort word this rank raises and watches (pure or local)."""
        return self.arena if self.arena is not None else self.local

    # -- error model -------------------------------------------------------------------
    def check(self) -> None:
        """Raise if the communicator has failed."""
        if self.error is not None:
            raise CommunicatorErrorState(
                f"communicator {self.name!r} (rank {self.rank}) is in error state: {self.error}"
            ) from self.error

    def fail(self, error: BaseException, reason: int) -> None:
        """Record the first error and tell every peer (arena abort word and ABORT frames)."""
        self._failed(error, (self.rank, reason), tell=reason)

    def _failed(
        self, error: BaseException, word: tuple[int, int] | None, tell: int | None = None
    ) -> None:
        """Record ``error`` as this group's error, unless it already failed, and end what is
        in flight here: posted receives withdrawn and failed, sends failed
        (:meth:`_fail_sends`), the group's frames buried. ``word`` ``(rank, reason)``: set the
        arena's abort word too; ``tell`` (a reason): send every peer an ABORT frame and wake the
        mailbox's waiters (this rank failed; a peer's failure is told by that peer). A peer's
        failure comes here by its ABORT frame or by a step that saw its abort word first,
        whichever comes first (before, the abort word left posted receives pending for good
        and sends uncut, and the ABORT frame after it then found the group failed and did
        nothing)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            pending, self._pending = self._pending, []
        if word is not None and self._shm is not None:
            self._shm.set_abort(*word)
        if tell is not None:
            for q, g in enumerate(self.ranks):
                if q != self.rank and g in self.mesh.peers:
                    self.mesh.send_abort(g, self.group_id, tell)
            self.mesh.mailbox.wake()
        self._cancel_receives(pending, error)
        self._fail_sends(error)
        self.mesh.bury(self.group_id, self)

    def _cancel_receives(
        self, pending: list[tuple[Any, Callable[..., None], TorchportWork]], error: BaseException
    ) -> None:
        """Withdraw the posted receives and fail their Works; one whose frame is being read
        into its tensor is cut off first (``Mailbox.cancel``: nothing lands in the tensor
        after its ``wait()`` raised), within ``RECV_CUT_S`` or by shutting that connection."""
        for key, cb, work in pending:
            on_stuck = None
            if key is not None and key[2] in self.mesh.peers:
                on_stuck = functools.partial(self.mesh.shutdown_peer, key[2])
            self.mesh.mailbox.cancel(key, cb, time.monotonic() + RECV_CUT_S, on_stuck)
            work._finish(error)

    def _fail_sends(self, error: BaseException) -> None:
        """Fail the Works of the sends queued or in flight: one whose frame waits for a
        receiver that stopped reading cannot stop part-way (the stream would break for every
        group on the connection), so it goes on in the background while its ``wait()`` raises
        now -- from a private copy of the bytes it may still read (``SendSource.detach``: the
        user may reuse the tensor at once, and the receiver gets the contents it had now,
        whole, not torn); later frames of it are not sent."""
        with self._lock:
            sends, self._sends = list(self._sends.items()), {}
        for work, source in sends:
            if not work._ended:
                source.detach()
            work._finish(error)

    def abort(self) -> None:
        """Fail every in-flight and later operation here and on every peer."""
        self.fail(
            CommAbortedError(f"communicator {self.name!r} aborted by rank {self.rank}"),
            REASON_ABORT,
        )

    def on_remote_abort(self, src: int, reason: int) -> None:
        q = self.ranks.index(src) if src in self.ranks else src
        if reason & 0xFF == REASON_LEFT and reason >> 8:  # (q found that rank gone)
            gone = (reason >> 8) - 1
            self._failed(self._gone_error(f"an operation of rank {q}", gone), (gone, REASON_LEFT))
            return
        err = RemoteError(
            f"communicator {self.name!r}: rank {q} {REASONS.get(reason, f'failed ({reason})')}"
        )
        self._failed(err, (q, reason))

    def _departure(self, q: int) -> str:
        """How group rank ``q`` left: the job, or (its goodbye for this group read here, not
        one for the job) this group only."""
        g = self.ranks[q] if 0 <= q < self.world else -1
        mailbox = self.mesh.mailbox
        if g not in mailbox.left and (self.group_id, g) in mailbox.left_groups:
            return "left the group (it destroyed it)"
        return "left the job (it destroyed its process group or exited)"

    def _gone_error(self, what: str, q: int) -> PeerLeftError:
        """The error of ``what`` (an operation) that needed group rank ``q``, which left."""
        return PeerLeftError(
            f"{what} on communicator {self.name!r} (rank {self.rank}): rank {q} "
            f"{self._departure(q)} before joining it"
        )

    def on_peer_lost(self, src: int, error: BaseException) -> None:
        if src in self.ranks:
            self.fail(error, REASON_ERROR)

    def on_peer_left(self, src: int) -> None:
        """Global rank ``src`` left the job or this group (its goodbye, for the mesh or for the
        group, was read after every frame it sent there):
        the receives posted from it fail with :class:`PeerLeftError` -- its frames would have
        been delivered by now --, and so do any-source receives once every other rank of the
        group left (while one can still send, it stays posted: the message may still come from
        that rank, and only its goodbye tells that it will not). The group itself fails only
        when an operation that needs ``src`` runs (a collective still finishing with what it
        got from ``src`` completes)."""
        if src not in self.ranks:
            return
        # a collective step waiting for it to arrive fails at once (GONE), one it finished
        # before it left does not (the goodbye came after its last step: its process group's
        # communicators closed first, or it exits)
        q = self.ranks.index(src)
        if self.arena is not None:
            self.arena.mark_gone(q)
        elif self.local is not None and q in self.local_ranks:
            self.local.mark_gone(self.local_ranks.index(q))
        has_left = self.mesh.mailbox.has_left
        with self._lock:
            named = [
                p
                for p in self._pending
                if p[0] is not None and p[0][2] == src and not isinstance(p[1], Once)
            ]
            # (a Once that fired is taking a frame from a rank that left after sending it)
            anys = [
                p
                for p in self._pending
                if isinstance(p[1], Once)
                and not p[1].fired
                and p[1].keys
                and all(has_left(k[0], k[2]) for k in p[1].keys)
            ]
            gone = named + anys
            self._pending = [p for p in self._pending if not any(p is g for g in gone)]
        if named:
            err = PeerLeftError(
                f"communicator {self.name!r} (rank {self.rank}): a recv from rank {q}, which "
                f"{self._departure(q)} without sending it"
            )
            self._cancel_receives(named, err)
        others = [r for r in range(self.world) if r != self.rank]
        how = (
            "left the job (each destroyed its process group or exited)"
            if all(self.ranks[r] in self.mesh.mailbox.left for r in others)
            else "left this group or the job (each destroyed one of them or exited)"
        )
        for key, once, work in anys:
            err = PeerLeftError(
                f"communicator {self.name!r} (rank {self.rank}): {work.name}: every rank that "
                f"could send it ({', '.join(map(str, others))}) {how} without sending it"
            )
            if self.mesh.mailbox.cancel(key, once):  # (else a frame won the race: it finishes)
                work._finish(err)

    # -- running operations ------------------------------------------------------------
    def run(self, work: TorchportWork, fn: Callable[[], None]) -> None:
        """Engine-side wrapper: refuse when failed or stopped, map errors, complete the work."""
        # (failed: issued after it failed; stopped: the engine's queue outlived the flush)
        if (self.error is not None or self._stopped) and self.check_now(work):
            with self._lock:  # a send refused here never runs its own cleanup
                self._sends.pop(work, None)
            return
        outer = getattr(self._running, "work", None)
        self._running.work = work
        try:
            fn()
        except StepError as e:
            work._finish(self._step_error(e, work.name))
        except CommunicatorErrorState as e:  # failed while in flight: report the typed cause
            work._finish(self.error if self.error is not None else e)
        except BaseException as e:
            reason = REASON_TIMEOUT if isinstance(e, CommTimeoutError) else REASON_ERROR
            self.fail(
                e if isinstance(e, Exception) else self._interrupted(work, e),
                REASON_MISMATCH if isinstance(e, CollectiveMismatchError) else reason,
            )
            work._finish(e)  # (the caller gets a KeyboardInterrupt back as is)
        else:
            work._finish()
        finally:
            self._running.work = outer

    def _interrupted(self, work: TorchportWork, e: BaseException) -> CommAbortedError:
        """The group's error for an operation cut off by a ``KeyboardInterrupt`` or another
        ``BaseException`` that is no error (recorded as is, ``get_error()`` was untyped and
        later operations raised "in error state: " with no reason)."""
        err = CommAbortedError(
            f"{work.name} on communicator {self.name!r} (rank {self.rank}) was interrupted by "
            f"{type(e).__name__}"
        )
        err.__cause__ = e
        return err

    def cut_short(self) -> None:
        """The operation running on this thread stopped touching its tensors after the group
        failed (frames part-way received still drain, into scratch): report the failure now.
        An operation run inline by ``wait()`` (``Engine.help``) returns only after the drain."""
        work = getattr(self._running, "work", None)
        if work is not None and self.error is not None:
            work._finish(self.error)

    def submit(
        self, name: str, fn: Callable[[], None], result: list[torch.Tensor] | None = None
    ) -> TorchportWork:
        """Issue ``fn`` on the engine; return its Work at once."""
        work = TorchportWork(name, result)
        if self.error is not None or self.closed:
            self.check_now(work)
            return work
        self._enqueue(self.engine, work, fn)
        return work

    def _enqueue(self, engine: Engine, work: TorchportWork, fn: Callable[[], None]) -> None:
        """Queue ``fn`` on ``engine``. A close whose stop came after the caller's check may
        have drained the queue already: then what is queued now is refused here (nothing would
        run it or finish it; a future waiter or an ``is_completed()`` poller waited for good)."""
        engine.submit(work, fn)
        if self._stopped:  # (set before the close's drain: one of the two takes the item)
            self._refuse_queued(engine)

    def _refuse_queued(self, engine: Engine) -> None:
        """Finish every operation still queued on ``engine`` (stopped: none will run)."""
        for work in engine.drain():
            work._finish(
                self.error
                if self.error is not None
                else CommAbortedError(f"communicator {self.name!r} was shut down")
            )
            with self._lock:  # (a send that never ran)
                self._sends.pop(work, None)

    def next_op(self) -> int:
        self.op_seq += 1
        return self.op_seq

    def deadline(self, timeout_s: float | None = None) -> float:
        return time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)

    def _time_out(self, opname: str, why: str) -> CommTimeoutError:
        """Fail the group with a timeout of ``opname`` (``why``: what it waited for), as every
        timeout does (the peers learn it); return the error."""
        err = CommTimeoutError(
            f"{opname} on communicator {self.name!r} (rank {self.rank} of {self.world}) "
            f"timed out{why}"
        )
        self.fail(err, REASON_TIMEOUT)
        return err

    def _step_error(self, e: StepError, opname: str) -> BaseException:
        if e.status == TIMEOUT:
            err: BaseException = self._time_out(opname, " waiting for peers")
        elif e.status == GONE:  # a rank it waited for left the group (the detail names it)
            gone = e.detail[0]
            err = self._gone_error(opname, gone)
            self._failed(err, (gone, REASON_LEFT), tell=REASON_LEFT | (gone + 1) << 8)
        elif e.status == ABORTED:
            word = self._shm.abort_word() if self._shm is not None else 0
            who, reason = (word >> 8) - 1, word & 0xFF
            if who == self.rank and self.error is not None:
                err = self.error
            elif reason == REASON_LEFT:  # (another rank found ``who`` gone)
                err = self._gone_error(opname, who)
                self._failed(err, None)
            else:
                err = RemoteError(
                    f"{opname} on communicator {self.name!r}: rank {who} "
                    f"{REASONS.get(reason, f'failed ({reason})')}"
                )
                self._failed(err, None)
        elif e.status == MISMATCH:
            q, word, theirs = e.detail
            if word == 1:  # the code word: the differing field(s) and their op as far as known
                what = describe_code_mismatch(self._last_sig[1], theirs)
            else:
                field = ("sequence number", "", "byte count", "step")[word] if word < 4 else ""
                what = f"{field or 'signature'} (theirs: {theirs})"
            err = CollectiveMismatchError(
                f"mismatched collectives on communicator {self.name!r}: rank {self.rank} issued "
                f"{describe_sig(self._last_sig)} but rank {q} differs in {what}"
            )
            self.fail(err, REASON_MISMATCH)
        else:
            err = CommError(
                f"{opname}: shared-memory step rejected its arguments (status {e.status})"
            )
            self.fail(err, REASON_ERROR)
        return err

    def step(
        self,
        sig: tuple[int, int, int, int],
        pubs: Sequence[tuple[int, int]],
        reads: Sequence[Read],
        dtype: int,
        red: int,
        deadline: float,
    ) -> None:
        """One collective step on this group's transport (see module docstring)."""
        self._last_sig = sig
        if self.arena is None:
            self._tcp_step(sig, pubs, reads, dtype, red, deadline)
            return
        epoch = self.epoch
        self.epoch += 1
        self.arena.step(
            epoch, sig, pubs, reads, dtype, red & FOLD_MASK, deadline - time.monotonic()
        )

    def shm_allreduce(
        self,
        sig: tuple[int, int, int, int],
        ptr: int,
        nbytes: int,
        esize: int,
        small: int,
        dtype: int,
        red: int,
        deadline: float,
    ) -> None:
        """A whole allreduce on the arena in one native call (``sig[3]`` is replaced per step)."""
        assert self.arena is not None
        epoch = self.epoch
        try:
            used = self.arena.allreduce(
                epoch,
                sig[:3],
                ptr,
                nbytes,
                esize,
                small,
                dtype,
                red & FOLD_MASK,
                deadline - time.monotonic(),
            )
        except StepError as e:
            self._last_sig = (sig[0], sig[1], sig[2], max(0, e.step))
            raise
        self.epoch = epoch + used

    def shm_alltoall_sizes(
        self,
        sig: tuple[int, int, int, int],
        in_lens: Sequence[int],
        out_lens: Sequence[int],
        ins: Sequence[int],
        outs: Sequence[int],
        dtype: int,
        mode: int,
        deadline: float,
    ) -> tuple[int, ...] | None:
        """alltoall's first step on the arena (:meth:`ShmArena.alltoall_sizes`)."""
        assert self.arena is not None
        self._last_sig = sig
        epoch = self.epoch
        self.epoch += 1
        return self.arena.alltoall_sizes(
            epoch, sig, in_lens, out_lens, ins, outs, dtype, mode, deadline - time.monotonic()
        )

    def _tcp_step(
        self,
        sig: tuple[int, int, int, int],
        pubs: Sequence[tuple[int, int]],
        reads: Sequence[Read],
        dtype: int,
        red: int,
        deadline: float,
    ) -> None:
        """A publish-to-all step as an exchange (the same segments to every peer). With
        nothing published (a barrier) every peer's frame is known to be empty: the exchange
        is then one native transfer, not a wait on the mailbox (whose waiting consumer stops
        the reader threads from leaving early frames of the next collective in the socket)."""
        own = sum(n for _, n in pubs)
        into = [(0, 0)] * self.world if own == 0 else None
        blobs = exchange(self, sig, [list(pubs)] * self.world, deadline, into)
        if reads and any(r[0] == self.rank for r in reads):  # reads of our own publication
            buf = bytearray(own)
            off = 0
            for ptr, n in pubs:
                if n:
                    ctypes.memmove(_addr(buf) + off, ptr, n)
                off += n
            blobs[self.rank] = Blob(_addr(buf), own, buf)
        self._apply_blobs(blobs, reads, dtype, red)

    def _apply_blobs(
        self, blobs: Sequence[Blob], reads: Sequence[Read], dtype: int, red: int
    ) -> None:
        for peer, off, _dst, n, _mode in reads:
            if off + n > blobs[peer].size:
                raise CommError(
                    f"rank {peer} published {blobs[peer].size} bytes, fewer than the {off + n} read"
                )
        self.apply([b.addr for b in blobs], reads, dtype, red)

    def apply(self, bases: Sequence[int], reads: Sequence[Read], dtype: int, red: int) -> None:
        """Run ``reads`` (copies and folds) over the buffers at ``bases`` (one per rank) in the
        native kernel; ``red``'s signature-only bits are dropped (:data:`FOLD_MASK`)."""
        if not reads:
            return
        b = (ctypes.c_int64 * len(bases))(*bases)
        ra = (ctypes.c_int64 * (5 * len(reads)))(*[v for r in reads for v in r])
        if self.lib.apply(b, ra, len(reads), dtype, red & FOLD_MASK) != 0:
            raise CommError(f"reduction of dtype code {dtype} with op code {red} is unsupported")

    # -- point to point ----------------------------------------------------------------
    def send_p2p(self, tensor: torch.Tensor, dst: int, tag: int) -> TorchportWork:
        # the tensor's own bytes when contiguous (not copied: as with gloo, an isend's tensor
        # must not change before its wait returns); flat before the byte view (a 0-dim tensor
        # of a wider dtype cannot view); a conjugate / negative view's values (its byte view
        # raised an untyped RuntimeError here)
        data = (
            plain_contiguous(tensor.detach()).reshape(-1).view(torch.uint8)
            if tensor.numel()
            else None
        )
        code, numel = dtype_code(tensor.dtype), tensor.numel()

        source = SendSource(data)
        deadline = [0.0]  # set as the send starts (sends run one at a time, as collectives)

        def late() -> bool:
            """Whether the send is past the group timeout, failing the group then (as a
            collective's timeout does: its receiver learns it, and the frame in flight goes
            on in the background from a private copy)."""
            if time.monotonic() <= deadline[0]:
                return False
            self._time_out(
                f"send(dst={dst}, tag={tag})",
                f": the receiver did not take it within {self.timeout_s:g} s",
            )
            return True

        def go() -> None:
            deadline[0] = self.deadline()
            try:
                payload = data.numpy().data if data is not None else memoryview(b"")
                parts = p2p_frames(payload, code, numel, p2p_bound(self.mesh.max_frame))
                self.mesh.send_frames(
                    self.ranks[dst],
                    Kind.P2P,
                    self.group_id,
                    tag,
                    parts,
                    check=self.check,
                    source=source if data is not None else None,
                    late=late,
                )
            finally:
                with self._lock:
                    self._sends.pop(work, None)

        work = TorchportWork(f"send(dst={dst}, tag={tag})", [tensor])
        # recorded only while the group has not failed (under the lock fail() sets the error
        # under, so _fail_sends sees every send recorded before it): one recorded after the
        # failure was never run, nor dropped from _sends (its tensor kept for the group's life)
        with self._lock:
            live = self.error is None and not self.closed
            if live:
                self._sends[work] = source
        if live:
            self._enqueue(self.sender, work, go)
        else:
            self.check_now(work)
        return work

    def recv_p2p(self, tensor: torch.Tensor, src: int | None, tag: int) -> TorchportWork:
        """Receive into ``tensor`` from group rank ``src`` (None: from any rank; the Work's
        ``source_rank()`` then names the sender)."""
        name = f"recv(src={'any' if src is None else src}, tag={tag})"
        if torch._debug_has_internal_overlap(tensor) == 1:
            raise CollectiveArgumentError(
                f"{name}: the output tensor must not overlap itself (an expanded view writes "
                f"several elements to one place), got shape {tuple(tensor.shape)} strides "
                f"{tensor.stride()}"
            )
        work = TorchportWork(name, [tensor])
        if self.check_now(work):
            return work

        def late() -> None:
            """A wait saw nothing arrive within the group timeout: the group fails (as on a
            collective's timeout: the peers learn it), and with it this receive."""
            self._time_out(name, f": nothing arrived within {self.timeout_s:g} s")

        work._wait_limit_s, work._late = self.timeout_s, late
        seq = tag & 0xFFFFFFFFFFFFFFFF
        want = (dtype_code(tensor.dtype), tensor.numel())
        total = tensor.numel() * tensor.element_size()
        # a message in several frames (p2p_frames): they may be handed over by two threads at
        # once (queued ones by the poster, later ones by the reader), in any order; each writes
        # its own bytes of ``flat`` (the tensor's, or a staging copy), ``got`` counts them and
        # the last one finishes the receive
        parts = threading.Lock()
        got = [0]
        flat: list[torch.Tensor] = []
        staged = not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg()

        def unpend() -> None:
            with self._lock:
                self._pending = [p for p in self._pending if p[2] is not work]

        def mismatch(hdr: Any, who: int, why: str) -> None:
            unpend()
            work._finish(
                CollectiveMismatchError(
                    f"recv from rank {who} tag {tag}: expected {want[1]} elements of "
                    f"{tensor.dtype}, the sender sent {hdr.sig[1]} elements of "
                    f"{dtype_name(hdr.sig[0])}"
                    f"{why}"
                )
            )

        def deliver(frame: Any) -> None:
            hdr, body = frame
            off, count = hdr.sig[2], hdr.sig[3]
            if work._ended:  # failed (a mismatch, a timeout): the rest of the message is dropped
                return
            who = self.ranks.index(hdr.src) if hdr.src in self.ranks else -1
            work._src = who
            if (hdr.sig[0], hdr.sig[1]) != want:
                mismatch(hdr, who, "")
                return
            if body is RECEIVED:  # read straight into the tensor (its Target)
                if count >= 2:  # one frame of several
                    with parts:
                        got[0] += hdr.length
                        if got[0] != total:
                            return
                # as the copy of a buffered frame does: autograd sees the tensor changed (a
                # tensor saved for backward then raises, as it did on the buffered path)
                increment_version(tensor)
                unpend()
                work._finish()
                return
            if count < 2:  # the message is one frame
                if off != 0 or len(body) != total:
                    mismatch(hdr, who, f" in a frame of {len(body)} bytes at offset {off}")
                    return
                unpend()
                if len(body):
                    data = torch.frombuffer(body, dtype=torch.uint8).view(tensor.dtype)
                    with torch.no_grad():  # (a leaf that requires grad receives, as with gloo)
                        tensor.copy_(data.view(tensor.shape))
                work._finish()
                return
            if off < 0 or off + len(body) > total or not len(body):
                mismatch(hdr, who, f" (a frame of {len(body)} bytes at offset {off})")
                return
            with parts:
                if not flat:
                    flat.append(
                        torch.empty(total, dtype=torch.uint8)
                        if staged
                        else tensor.detach().reshape(-1).view(torch.uint8)
                    )
                dst = flat[0]
            with torch.no_grad():
                dst[off : off + len(body)].copy_(torch.frombuffer(body, dtype=torch.uint8))
            with parts:
                got[0] += len(body)
                last = got[0] == total
            if last:
                if staged:
                    with torch.no_grad():
                        tensor.copy_(dst.view(tensor.dtype).view(tensor.shape))
                unpend()
                work._finish()

        def failed(e: BaseException) -> None:
            # the copy into the user's tensor raised (an expanded view): the mailbox hands the
            # exception here and the connection's reader thread goes on reading
            unpend()
            err = CollectiveArgumentError(
                f"recv from rank {work._src} tag {tag}: could not write the received "
                f"{tensor.dtype} data into the tensor: {type(e).__name__}: {e}"
            )
            err.__cause__ = e
            work._finish(err)

        if src is not None:
            key = (self.group_id, int(Kind.P2P), self.ranks[src], seq)
            one = Delivery(deliver, failed)
            if not self._post(work, tensor, (key, one, work)):
                return work
            into = None
            if total >= P2P_DIRECT_BYTES and not staged:
                bound = p2p_bound(self.mesh.max_frame)  # (the sender's: one configuration)
                if total <= bound:
                    into = Target(tensor.data_ptr(), total, (*want, 0, 0))
                else:  # its frames one after another (p2p_frames)
                    count = -(-total // bound)
                    into = Target(tensor.data_ptr(), bound, (*want, 0, count), total=total)
            self.mesh.mailbox.expect(key, one, into)
            if self.mesh.mailbox.has_left(key[0], key[2]):  # (left before this was posted)
                self.on_peer_left(key[2])
            return work
        keys = [
            (self.group_id, int(Kind.P2P), g, seq)
            for q, g in enumerate(self.ranks)
            if q != self.rank
        ]
        once = Once(deliver, keys, failed)
        if not self._post(work, tensor, (keys[0] if keys else None, once, work)):
            return work
        self.mesh.mailbox.expect_any(once)
        if keys and self.mesh.mailbox.has_left(keys[0][0], keys[0][2]):  # (all may have left)
            self.on_peer_left(keys[0][2])
        return work

    def _post(
        self,
        work: TorchportWork,
        tensor: torch.Tensor,
        entry: tuple[Any, Callable[..., None], TorchportWork],
    ) -> bool:
        """Add a posted receive to ``_pending`` once it overlaps none of the receives there.

        The overlap tests run outside ``_lock`` on a snapshot (an exact test of two large
        strided views walks their elements, 0.36 s for two column halves of a 20000x1000 matrix,
        and the mailbox reader needs the lock to deliver); receives posted meanwhile are tested
        in another round, so the entry is appended under the same lock that saw none left.

        False (``work`` finished with the error) if the group failed or closed meanwhile: the
        failure took the pending list already, so the entry would never be finished."""
        checked: dict[int, TorchportWork] = {}  # (holds the works: their ids stay unique)
        while True:
            with self._lock:
                if self.error is None and not self.closed:
                    fresh = [p[2] for p in self._pending if id(p[2]) not in checked]
                    if not fresh:
                        self._pending.append(entry)
                        return True
                else:
                    fresh = []
            if not fresh:
                self.check_now(work)
                return False
            self._refuse_overlap(work, tensor, fresh)
            checked.update((id(w), w) for w in fresh)

    def _refuse_overlap(
        self, work: TorchportWork, tensor: torch.Tensor, pending: list[TorchportWork]
    ) -> None:
        """Refuse a receive into memory an in-flight receive of this group also writes: which
        frame lands last is a race (gloo does not check; a batch_isend_irecv with two receives
        into one buffer gave either sender's data)."""
        for other in pending:
            if other._ended:  # delivered since the snapshot: it writes no more
                continue
            theirs = other._result[0] if other._result else None
            # (the test may take a while: one delivered meanwhile is no conflict either)
            if theirs is not None and tensors_overlap(tensor, theirs) and not other._ended:
                raise CollectiveArgumentError(
                    f"{work.name}: the output tensor overlaps the output of {other.name}, "
                    f"still in flight (shape {tuple(theirs.shape)} at {theirs.data_ptr():#x}, "
                    f"this one shape {tuple(tensor.shape)} at {tensor.data_ptr():#x})"
                )

    def check_now(self, work: TorchportWork) -> bool:
        """Finish ``work`` with :class:`CommAbortedError` if closed (once the close has stopped
        the engines, whether or not the group also failed meanwhile: a peer's shutdown racing
        this rank's destroy must not turn "destroyed" into an error state), else with the error
        state if failed; True if it did."""
        if self.closed and (self.error is None or self._stopped):
            cause = "" if self.error is None else f" (it had failed: {self.error})"
            work._finish(
                CommAbortedError(
                    f"{work.name} on communicator {self.name!r} (rank {self.rank}): the group "
                    f"was destroyed{cause}"
                )
            )
            return True
        try:
            self.check()
        except CommunicatorErrorState as e:
            work._finish(e)
            return True
        return False

    def close(self) -> None:
        """Stop the engine threads and release the arena.

        Operations still queued or running get up to :data:`SHUTDOWN_FLUSH_S` (at most the
        group timeout) to finish, as gloo's destructor and NCCL's graceful shutdown flush pending
        work, so a peer that joins late still gets its result. One still in flight after that
        (a peer never joined) is aborted: its Work fails with :class:`CommAbortedError` and the
        peers see the group shut down. An idle group closes at once without telling anyone.

        Operations issued once this is called fail at once, even while the flush runs on.
        Called from inside an operation of this group on this thread (a Work's future callback
        runs where the Work completes: the engine thread, or a caller of ``wait()`` running the
        queue inline), or on a connection's reader thread (where a receive completes), the
        close runs on a thread of its own: here it would wait for its own thread, or for
        receives only this thread delivers. A group that built its own mesh closes the mesh
        last (its peers would see the connections lost while the group still flushes).
        """
        with self._lock:  # (_post appends a receive under it only while not closed)
            self.closed = True
        if getattr(self._running, "work", None) is not None or on_reader_thread():
            threading.Thread(target=self._close, daemon=True, name=f"tp-close-{self.name}").start()
            return
        self._close()

    def _close(self) -> None:
        try:
            self._stop()
        finally:
            if self.owns_mesh:
                self.mesh.leave()
            elif self.on_closed is not None:
                self.on_closed()

    def _stop(self) -> None:
        self.engine.urge()  # queued async work starts now rather than at the next poll
        self.sender.urge()
        flush_end = time.monotonic() + min(SHUTDOWN_FLUSH_S, self.timeout_s)
        while self.error is None and (
            self.engine.busy() or self.sender.busy() or self._pending
        ):  # posted receives count: their senders may still come
            if time.monotonic() >= flush_end:
                break
            time.sleep(0.002)
        self._stopped = True  # before the joins: an inline runner after them refuses its op
        self.engine.stop()
        self.sender.stop()
        # an idle engine thread ends as soon as the stop rings; one still in an operation
        # would run it to the group timeout (destroy blocked for the 5 s join, then the op
        # ran on and its Work completed only at the timeout)
        quiet = self.engine.join(SHUTDOWN_GRACE_S) & self.sender.join(SHUTDOWN_GRACE_S)
        # (in_flight: an op whose Work is just completing still holds the runner; it is no
        # reason to tell the peers the group shut down)
        if (not quiet and (self.engine.in_flight() or self.sender.in_flight())) or self._pending:
            self.fail(
                CommAbortedError(
                    f"communicator {self.name!r} (rank {self.rank}) was shut down with an "
                    f"operation in flight"
                ),
                REASON_SHUTDOWN,
            )
        if not quiet:
            # the engine thread may still be in a collective on the arena: wait before
            # unmapping it. The sender thread moves point-to-point frames (the mesh's sockets
            # and rings, not the arena); one still finishing a frame that its peer is not
            # reading (from the copy the failure took, SendSource.detach) ends when the peer
            # reads or the connection closes: not waited for (destroy after an abort took 5 s)
            quiet = self.engine.join(5.0)
        for engine in (self.engine, self.sender):  # queued behind the stop
            self._refuse_queued(engine)
        self.mesh.unregister(self.group_id, self)
        if not quiet:  # an op still runs (e.g. a stalled thread): unmapping would crash it
            return  # the mappings go with the process
        if self.says_goodbye and self.error is None:  # (a failed group told its peers)
            # after the group's last frame and step here: its peers' waits for this rank in
            # the group fail at once (PeerLeftError), not at their timeout
            for q, g in enumerate(self.ranks):
                if q != self.rank:
                    self.mesh.send_group_goodbye(g, self.group_id)
        for arena in (self.arena, self.local):
            if arena is not None:
                arena.close()
