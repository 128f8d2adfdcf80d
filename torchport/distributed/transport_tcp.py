"""TCP transport: an authenticated full mesh of sockets with framed, bounded messages.

Every rank of a root communicator listens on the configured address (``TORCHPORT_DIST_ADDR``,
default 127.0.0.1) and publishes ``host:port`` and its host identity through the store. Rank
``r`` connects to every rank below it and accepts from every rank above; each connection is
authenticated both ways (:mod:`~torchport.distributed.auth`) before it is used, and a peer that
fails the handshake is closed and counted in :attr:`Mesh.rejected`. At most ``MAX_HANDSHAKES``
connections are in the handshake at once, each for ``HANDSHAKE_TIMEOUT_S`` at most; a connection
past that bound is closed at once (and counted), and a dialling rank tries again.

One reader thread per connection decodes frames (:mod:`~torchport.distributed.wire`) into a
:class:`Mailbox` keyed by ``(group, kind, src, seq)``; ABORT frames go straight to the group's
abort handler, or wait for it when the group is not registered here yet (a peer failed it
first). Sub-communicators share the mesh: frames carry their group id.

A collective that knows where a peer's bytes belong posts a :class:`Target` (pointer, length,
signature) for the frame's key before it sends; the reader thread then receives the payload
straight into that memory with large ``recv_into`` calls (no per-frame buffer, no copy
afterwards). Only a frame whose header already passed the bounds check and whose length and
signature equal the target's is received this way; any other frame takes the ordinary buffered
path, where the collective reports the mismatch. A target is withdrawn before its collective
returns, waiting for a receive in progress (which a lost connection or ``shutdown`` ends).

Internal API other modules build on:

- ``Mesh.send(peer, kind, group, seq, payload, sig, deadline=, check=)``: send one control
  frame to a global rank;
- ``Mesh.mailbox.get(key, deadline, check)`` / ``expect(key, callback)``: receive frames (a
  :class:`Delivery` callback names the operation its exceptions fail);
- ``Mesh.register(group_id, handler)``: route ABORT frames and lost peers to a communicator;
- ``Mesh.leave()``: close with a goodbye (``GOODBYE_GROUP``) its peers tell from a crash: a
  later wait for the leaver's frames, or a send to it, raises :class:`PeerLeftError`;
- ``Mesh.send_group_goodbye(peer, group)``: the same for one group that closed here while the
  mesh stays (``GROUP_GOODBYE_SEQ``): the peer's waits for this rank's frames of that group,
  and its sends to this rank there, raise :class:`PeerLeftError`; its other groups go on;
- ``Mesh.peers``: the connection map ``{global rank: Connection}``.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import functools
import os
import select
import socket
import struct
import termios
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy

from torchport.distributed import auth
from torchport.distributed._control import (
    ACCEPT_RETRY_ERRNOS,
    ACCEPT_RETRY_S,
    MAX_HANDSHAKES,
    _until,
)
from torchport.distributed.errors import (
    AuthError,
    CommAbortedError,
    CommError,
    CommTimeoutError,
    CommunicatorErrorState,
    PeerLeftError,
    WireError,
)
from torchport.distributed.shm_kernels import ABORTED as SHM_ABORTED
from torchport.distributed.shm_kernels import RING_CORRUPT
from torchport.distributed.shm_kernels import TIMEOUT as SHM_TIMEOUT
from torchport.distributed.tcp_kernels import (
    CLOSED,
    DONE,
    FOREIGN,
    IDLE,
    MAXFD,
    NOTIFY,
    OPW,
    OWN_COLL,
    SENT,
    SLICE,
    tcp_lib,
)
from torchport.distributed.transport_shm import ShmRing, StepError
from torchport.distributed.wire import (
    FLAG_RING,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    WIRE_VERSION,
    Header,
    Kind,
    decode_header,
    encode_header,
)

# A listener's whole handshake with one connection ends within this (one deadline: a timeout
# per recv let a stranger sending a byte every few seconds hold its thread without end); it
# also bounds each step of a dial's. At most MAX_HANDSHAKES (_control's bound) run at once:
# without one, every silent unauthenticated connection got a thread (1000: 1000 threads), and
# once no thread could start the acceptor died, so no later rank got in. Past the bound a new
# connection is closed at once (Mesh._accept_loop) and a legitimate dialler tries again
# (Mesh._connect); a client reopening connections as fast as they expire can still keep
# legitimate peers waiting (a denial of service the bound does not prevent).
HANDSHAKE_TIMEOUT_S = 10.0
REDIAL_S = 0.02  # a dial the listener closed before its challenge is tried again this often
# A transfer sending or receiving this much runs pinned to its rank's CPU (Mesh.pin_cpu; an
# elastic mesh, whose members come and go, pins to the CPU the thread runs on)
PIN_BYTES = 256 << 10
# Receives this large are also posted as targets for the reader thread (a frame it reads first
# then lands in place, not in a buffer copied afterwards). 4 MB, not 64 KB: smaller ones were
# faster unposted (1 MB cells: alltoall w2 -25 %, allgather w2 -16 %, reduce_scatter w4 -6 %).
POST_BYTES = 4 << 20
SLICE_MS = 10  # a native transfer returns this often, progress or not (abort, deadline checks)
LATE_SLICE_MS = 1  # ... and this often while a socket it claimed is still being read (Mesh._own)
READER_SLICE_MS = 200  # a parked or idle reader thread re-checks the mesh this often
LOCK_POLL_S = SLICE_MS / 1000  # a transfer waiting for a send lock checks abort and deadline
# A COLL frame arriving while no collective owns its socket is left there this long for the
# collective to take the socket and receive it in place (tp_conn_wait): read by the reader
# thread first, it costs a buffer, a copy and a thread wake-up. Frames behind it (an ABORT
# too) wait at most this long; ones arriving back to back are read at once. Only where this
# host runs no more ranks than this process may use CPUs (Mesh.linger_us): with more, a
# rank often waits for a CPU longer than the linger, which then only adds wake-ups (w4 on 2
# CPUs: 1 MB broadcast -3 %, 64 KB alltoall -9 %; w2: 1 MB alltoall +12 %).
LINGER_US = 2000
# ... and a frame of at least POST_BYTES this long, however many ranks share the CPUs: read by
# the reader first it costs a buffer (a new, zero-filled one above SPARE_MAX_BYTES) and a copy of
# its whole length (alltoall 64 MB w4 on 2 CPUs, 16 MB frames, bench_collectives_cell 20
# samples: 0.87x gloo with the socket claims of Mesh._own alone, 0.95-0.96x with this linger;
# 0.79x before both).
LINGER_BIG_US = 20000
MAX_EARLY_ABORTS = 1024  # ABORT frames kept for groups not registered yet (oldest dropped)
FINISH_S = 1.0  # after an error, frames part-way sent or received get this long to complete
ABORT_FINISH_S = 0.05  # the same after an abort (check() raised): abort unblocks within 100 ms
# ... and after a timeout (the group fails on every rank then, as after an abort). A live
# peer's reader takes the rest of a collective's frame (at most a chunk, dist_chunk_bytes:
# 1 MiB, ~8 ms over 1 GbE) well within this; a stopped peer's broadcast, allgather, alltoall,
# reduce_scatter and scatter over TCP failed FINISH_S past their timeout with FINISH_S here
TIMEOUT_FINISH_S = 0.2
SPARE_BUFFERS = 2  # early-frame payload buffers kept per connection for reuse (Connection)
# ... each at most this long: a frame bound of 256 MiB must not keep 2 such buffers per peer
# alive for the mesh's lifetime (the measured gain was at 1 MB frames).
SPARE_MAX_BYTES = POST_BYTES
Key = tuple[int, int, int, int]  # (group, kind, src, seq)
Frame = tuple[Header, bytearray]
RECEIVED = bytearray()  # the body of a frame received straight into its posted Target
# P2P messages of at least this many bytes to a rank of this host go through a shared-memory
# ring (Mesh._ring_to) when the mesh has one: below it the socket's latency is the cost anyway
RING_MIN_BYTES = 64 << 10
RING_SLICE_NS = SLICE_MS * 1_000_000  # a ring copy returns this often, progress or not
MAX_RING_BYTES = 1 << 30  # the largest ring a peer may offer (config's bound)
U64 = 0xFFFFFFFFFFFFFFFF  # a header's seq is stored as u64 (wire.encode_header)
DEAD_KINDS = (int(Kind.COLL), int(Kind.P2P))  # what a dead group's mailbox drops
# A rank leaving the job (Mesh.leave: destroy_process_group, or the process's exit) sends this
# CTRL frame's group id on every connection after everything else it sent there, then ends its
# side of the stream: its peers take the end of that connection for a departure, not a crash.
# No group takes the id (sub-group ids are below 2**31, groups.group_id_for).
GOODBYE_GROUP = 0xFFFFFFFF
# A group closing here while the mesh stays (destroy_process_group(subgroup)) sends each of its
# members a CTRL frame of the group's id with this seq, after everything of that group it sent
# there: the peer takes that group's frames from this rank for done (Mesh._group_goodbye), not
# the connection's. (The elastic groups' CTRL frames use the seqs 1 to 3.)
GROUP_GOODBYE_SEQ = 0xFFFFFFFF
# How long a leaving mesh waits for its goodbyes to go out and its peers to end their side of
# each connection (their reader threads do at once), before it closes the sockets anyway...
LEAVE_S = 2.0
# ... but once every goodbye (and the end of this side's stream) is acknowledged by the peer's
# host -- it then reads them even after this side closed, resets included -- only this long: a
# live peer ends its side within milliseconds; a stopped one (SIGSTOP, a debugger) never does,
# and cost every destroy_process_group and exit the whole LEAVE_S (2 s, vs 3 ms with live
# peers). A goodbye still unacknowledged (a peer whose buffer is full) keeps LEAVE_S.
LEAVE_SETTLED_S = 0.2
LEAVE_POLL_S = 0.01  # ... the acknowledgements are checked this often meanwhile
JOIN_S = 1.0  # ... and then for its reader threads and acceptor to end


def _left(rank: int, peer: int, what: str, group: int | None = None) -> PeerLeftError:
    """``what`` (waiting for a frame, sending) needed ``peer``, which left the job, or with
    ``group`` only closed that group (its goodbye for the group was read)."""
    if group is not None:
        return PeerLeftError(
            f"rank {rank}: {what} rank {peer}, which left the group (id {group:#x}: it "
            f"destroyed that group, with a goodbye after everything it sent there)"
        )
    return PeerLeftError(
        f"rank {rank}: {what} rank {peer}, which left the job (it destroyed its process group "
        f"or exited: its connection closed with a goodbye after everything it sent)"
    )


def unacked_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` (its FIN counts one) that the peer's host has not acknowledged
    yet (Linux ``SIOCOUTQ``); 0 for a closed socket."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # (ValueError: closed, its fileno is -1)
        return 0
    return int(struct.unpack("i", raw)[0])


def frames_after(frame: Frame) -> int:
    """How many frames of the same message follow ``frame``: a point-to-point message larger
    than the frame bound is cut into consecutive frames (``sig`` = dtype code, numel, byte
    offset, frame count), sent back to back on one connection; only its first frame (offset 0)
    counts the others."""
    hdr = frame[0]
    if hdr.kind != Kind.P2P or hdr.sig[2] != 0 or hdr.sig[3] < 2:
        return 0
    return hdr.sig[3] - 1


def _cpu_host(hid: str) -> str:
    """The machine part of a ``groups.host_id()`` (hostname and boot id, without the
    ``/dev/shm`` device): processes that share CPUs though not ``/dev/shm`` (host-network
    containers on one machine) count together for CPU pinning and busy polling."""
    return hid.split("/shm", 1)[0]  # (hostnames hold no '/')


def _spread_cpu(local: int) -> int:
    """The CPU a large transfer of this host's ``local``-th rank pins its thread to: the ranks
    of a host take this process's allowed CPUs in turn, lowest first (at four ranks on two
    CPUs, two on each). Pinning each sender to the CPU it happened to run on instead put both
    ranks of two on one CPU in about one 1 MB transfer of five, and three or four of four on
    one in most 64 MB ones (cell bench, alternated with that, median over 11-20 rounds:
    alltoall 1 MB w2 0.79x -> 0.98x gloo, allreduce 64 MB w4 0.96x -> 1.03x).
    """
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[local % len(cpus)]


class GroupHandler(Protocol):
    """What a communicator exposes to the mesh (and, where it has one, ``on_peer_left(src)``:
    the peer's goodbye was read, for the whole mesh (:meth:`Mesh._goodbye`) or for this group
    (:meth:`Mesh._group_goodbye`))."""

    def on_remote_abort(self, src: int, reason: int) -> None: ...

    def on_peer_lost(self, src: int, error: BaseException) -> None: ...


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Receive exactly ``n`` bytes; with ``deadline`` (``time.monotonic()``) all of them by
    then (``TimeoutError``), however the peer spreads them out."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            _until(sock, deadline, f"after {got} of {n} bytes")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return buf


def _spare(spares: list[bytearray], n: int) -> bytearray:
    """A payload buffer of ``n`` bytes for an early COLL frame: a spare of that length handed
    back by a transfer (not zeroed: every byte is received over), else a new one."""
    try:
        buf = spares.pop()  # atomic under the GIL, like the transfer's append
    except IndexError:
        return bytearray(n)
    return buf if len(buf) == n else bytearray(n)


def _recv_body(sock: socket.socket, body: bytearray | memoryview) -> None:
    """Receive exactly ``len(body)`` bytes into ``body`` (blocking, ``MSG_WAITALL``: one call
    per frame unless a signal interrupts it)."""
    view, got, n = memoryview(body), 0, len(body)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def recv_into_ptr(sock: socket.socket, ptr: int, n: int) -> None:
    """Receive exactly ``n`` bytes into the memory at ``ptr`` (large reads, GIL released)."""
    view = memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")
    got = 0
    while got < n:  # MSG_WAITALL: one call per frame unless a signal interrupts it
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer's end of ``sock`` is gone (end of stream or an error), taking no byte."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def recv_bounded(
    sock: socket.socket, view: memoryview, deadline: float, check: Callable[[], None]
) -> None:
    """Receive exactly ``len(view)`` bytes on a collective's thread: non-blocking reads and
    ``poll`` waits of at most ``SLICE_MS``, ``check()`` every ``SLICE_MS`` of wall time (bytes
    arriving or not) and :class:`CommTimeoutError` past ``deadline``."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    got, n = 0, len(view)
    watch_at = time.monotonic() + SLICE_MS / 1000
    while got < n:
        now = time.monotonic()
        if now >= watch_at:
            check()
            if now > deadline:
                raise CommTimeoutError(f"timed out with {got} of {n} bytes of a frame read")
            watch_at = now + SLICE_MS / 1000
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
        except BlockingIOError:
            poller.poll(SLICE_MS)
            continue
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def withdraw_until(deadline: float, error: BaseException | None) -> float:
    """Until when a ``finally`` that withdraws posted receive targets waits for a receive into
    one that is in progress (``Mailbox.withdraw``; past it the receive's connection is shut).

    With no ``error`` (the operation's own, caught on its way out): ``deadline``, the
    operation's. After an error, the budget :meth:`Mesh.transfer` gives a frame part-way,
    never past ``deadline``: ``ABORT_FINISH_S`` once the group failed or was aborted (what
    ``check()`` raises: an abort unblocks the call within 100 ms, where it waited out the
    operation's deadline for a peer stopped mid-frame), ``TIMEOUT_FINISH_S`` after a timeout
    (or an error raised from one), ``FINISH_S`` after any other error."""
    if error is None:
        return deadline
    status = getattr(error, "status", None) if isinstance(error, StepError) else None
    if (
        isinstance(error, CommTimeoutError)
        or isinstance(error.__cause__, CommTimeoutError)
        or status == SHM_TIMEOUT
    ):
        budget = TIMEOUT_FINISH_S
    elif isinstance(error, CommunicatorErrorState | CommAbortedError) or status == SHM_ABORTED:
        budget = ABORT_FINISH_S  # (a hybrid group's shared-memory step: its arena's abort word)
    else:
        budget = FINISH_S
    return min(deadline, time.monotonic() + budget)


class PostedTargets:
    """Receive targets a mailbox path posts into its caller's memory (:meth:`post`), withdrawn
    when its ``with`` block ends (:meth:`Mailbox.withdraw`, which waits for a receive in
    progress into one): by the operation's ``deadline``, or after an error within
    :func:`withdraw_until`'s budget for it (the ``with`` hands the error over). Past that the
    receive's connection is shut."""

    def __init__(self, mesh: Mesh, deadline: float) -> None:
        self.mesh, self.deadline = mesh, deadline
        self._keys: list[tuple[Key, int]] = []

    def post(self, key: Key, target: Target, peer: int) -> None:
        """Post ``target`` for ``key``, a frame from global rank ``peer``."""
        self.mesh.mailbox.post(key, target)
        self._keys.append((key, peer))

    def __enter__(self) -> PostedTargets:
        return self

    def __exit__(self, _type: Any, error: BaseException | None, _tb: Any) -> None:
        until = withdraw_until(self.deadline, error)
        for key, peer in self._keys:
            self.mesh.mailbox.withdraw(key, until, functools.partial(self.mesh.shutdown_peer, peer))


def _cut(what: str, why: BaseException) -> ConnectionError:
    """The error of a connection closed because a frame on it was left part-way ``what``."""
    cause = f"{type(why).__name__}: {why}" if str(why) else type(why).__name__
    return ConnectionError(
        f"a frame was left part-way {what} when a transfer ended ({cause}); the connection "
        "is closed so that no later byte is read as a header"
    )


def _byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """``payload`` as a flat view of its bytes (its length is the frame's)."""
    view = memoryview(payload)
    # (cast raises on a non-contiguous view: before anything is sent)
    return view if view.format == "B" and view.ndim == 1 and view.c_contiguous else view.cast("B")


def _frame_views(head: bytes, view: memoryview) -> list[memoryview]:
    """A frame as the byte views one ``sendmsg`` sends: its header, then its payload (a flat
    byte view, :func:`_byte_view`) if any."""
    return [memoryview(head), view] if len(view) else [memoryview(head)]


def read_frame(sock: socket.socket, max_length: int, deadline: float | None = None) -> Frame:
    """Read and validate one frame (header bound checked before the payload is read), the
    whole of it by ``deadline`` if given (:func:`_recv_exact`)."""
    hdr = decode_header(_recv_exact(sock, HEADER_SIZE, deadline), max_length=max_length)
    return hdr, _recv_exact(sock, hdr.length, deadline) if hdr.length else bytearray()


class Delivery:
    """A mailbox callback together with the operation it belongs to.

    An exception the callback raises (a copy into a user tensor that fails) is handed to
    ``on_error``, which fails that operation; the thread that delivered the frame -- usually a
    connection's reader -- goes on. It ended the reader before, and the connection silently
    stopped delivering.
    """

    def __init__(
        self,
        callback: Callable[[Frame], None],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.callback, self.on_error = callback, on_error

    def __call__(self, frame: Frame) -> None:
        self.callback(frame)


class Once(Delivery):
    """A callback waiting on several keys that fires for the first frame of any of them."""

    def __init__(
        self,
        callback: Callable[[Frame], None],
        keys: list[Key],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(callback, on_error)
        self.keys, self.fired = keys, False


WAITING, FILLING, FILLED, FAILED = 0, 1, 2, 3
# a receive's own target whose receive failed while its frame was being read into it: the reader
# sends the rest of the frame to a sink from its next slice on (DROPPING), and the cancel waits
# for that (so no byte lands in the tensor once the receive has failed)
CANCELLED, DROPPING = 4, 5
OWNED_SLICE = 4 << 20  # bytes a reader reads into a receive's own target between state checks
CUT_GIVE_UP_S = 1.0  # a cancel waits this long past its deadline (and on_stuck) at most
P2P_EMPTY_BYTES = 1 << 20  # a buffered point-to-point payload from this size: not zero-filled


@dataclass
class Target:
    """Where the payload of one expected frame goes: ``size`` bytes at ``ptr``. A ``quiet``
    one does not count among the mailbox's waiters: the collective that posts it takes the
    socket itself (``Mesh.transfer``), so a reader lingering on that frame should go on
    lingering, not read it. An ``owner`` (a point-to-point receive's callback, ``expect``)
    takes the frame received into it, and the target goes with the frame: one per receive.
    For a message in frames (:func:`frames_after`), ``total`` is the message's length and the
    target moves on to each next frame (:meth:`advance`) until the last."""

    ptr: int
    size: int
    sig: tuple[int, int, int, int]
    state: int = WAITING
    quiet: bool = False
    owner: Callable[[Frame], None] | None = None
    total: int = 0

    def advance(self) -> bool:
        """Point at the message's next frame (the same length, but the last); False after the
        last one."""
        code, numel, off, count = self.sig
        off += self.size
        if off >= self.total:
            return False
        self.ptr += self.size
        self.size = min(self.size, self.total - off)
        self.sig = (code, numel, off, count)
        self.state = WAITING
        return True


class Mailbox:
    """Received frames by key, with blocking ``get`` and callback ``expect`` / ``expect_any``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._frames: dict[Key, deque[Frame]] = {}
        self._waiting: dict[Key, deque[Callable[[Frame], None]]] = {}
        self._targets: dict[Key, Target] = {}
        # A message cut into frames (:func:`frames_after`) goes whole to the callback that took
        # its first frame: key -> [callback, frames still to come]. Its later frames share the
        # key, and another receive waiting on that key must not take one.
        self._streams: dict[Key, list[Any]] = {}
        self._loud = 0  # targets that are not quiet (Target)
        # Groups that failed or closed here: their queued COLL/P2P frames were purged and
        # later ones are dropped on arrival (``dropped`` counts both) -- nothing would ever
        # take them. CTRL frames are kept: a group forming under a reused id exchanges them
        # before it registers (``revive``).
        self._dead: set[int] = set()
        self.dropped = 0
        # Consumers that wait here for what the reader threads deliver (blocked ``get`` calls,
        # ``expect`` callbacks, posted targets but quiet ones), read by the readers without the
        # lock: while non-zero a reader never lingers on a collective frame (tp_conn_wait),
        # since no collective will take the socket for it. ``on_wait`` (the mesh: poke every reader)
        # ends a linger already begun when a consumer starts waiting.
        self.waiters = ctypes.c_int32(0)
        self.waiters_addr = ctypes.addressof(self.waiters)
        self.on_wait: Callable[[], None] | None = None
        self._blocked = 0
        # Exceptions of callbacks that name no operation to fail (not a :class:`Delivery`
        # with ``on_error``, or its ``on_error`` raised too): counted, the last one kept, and
        # warned about; the delivering thread goes on either way.
        self.callback_errors = 0
        self.last_callback_error: BaseException | None = None
        # Peers whose goodbye was read (Mesh.leave): every frame they sent came before it, so a
        # frame of theirs not here now never comes (``get`` fails at once instead of waiting).
        self.left: set[int] = set()
        # (group, peer) of peers whose goodbye for that group was read (the group closed there,
        # the mesh stays): the same for that group's frames only (``Mesh._group_goodbye``)
        self.left_groups: set[tuple[int, int]] = set()
        self.rank = -1  # this process's rank (for messages; set by the mesh)

    def has_left(self, group: int, peer: int) -> bool:
        """Whether ``peer`` sends ``group`` nothing more: it left the job, or that group."""
        return peer in self.left or (group, peer) in self.left_groups

    def left_error(self, group: int, peer: int, what: str) -> PeerLeftError | None:
        """The error of ``what`` that needs ``group``'s frames from, or sends to, ``peer``
        (None while ``peer`` has not left)."""
        if peer in self.left:
            return _left(self.rank, peer, what)
        if (group, peer) in self.left_groups:
            return _left(self.rank, peer, what, group)
        return None

    def _call(self, cb: Callable[[Frame], None], frame: Frame) -> None:
        """Run a waiting callback (unlocked); route its exception instead of raising it."""
        try:
            cb(frame)
        except Exception as e:
            on_error = getattr(cb, "on_error", None)
            if on_error is not None:
                try:
                    on_error(e)
                    return
                except Exception as e2:
                    e = e2
            self.callback_errors += 1
            self.last_callback_error = e
            warnings.warn(
                f"a mailbox callback for frame {frame[0]} raised and names no operation to "
                f"fail: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _sync_waiters(self) -> None:
        """Refresh ``waiters`` (under ``cond``) and poke lingering readers when it rises."""
        n = self._blocked + len(self._waiting) + self._loud
        rose = n > self.waiters.value
        self.waiters.value = n
        if rose and self.on_wait is not None:
            self.on_wait()

    def kill(self, group: int) -> int:
        """Purge ``group``'s queued COLL/P2P frames and drop later ones; returns how many
        were purged."""
        with self.cond:
            self._dead.add(group)
            gone = [k for k in self._frames if k[0] == group and k[1] in DEAD_KINDS]
            n = sum(len(self._frames.pop(k)) for k in gone)
            for k in [k for k in self._streams if k[0] == group]:
                del self._streams[k]
            for k, t in list(self._targets.items()):
                if k[0] == group and t.owner is not None:
                    if t.state == FILLING:  # (its reader sinks the rest: see cancel)
                        t.state = CANCELLED
                    self._drop_owned(k, t.owner)
            self.dropped += n
            return n

    def revive(self, group: int) -> None:
        """``group`` (re)registered: its frames are delivered again."""
        with self.cond:
            self._dead.discard(group)

    def post(self, key: Key, target: Target) -> None:
        """Receive the next frame for ``key`` into ``target`` if it matches (see module doc)."""
        if target.size <= 0:
            return
        with self.cond:
            old = self._targets.get(key)
            self._loud += (not target.quiet) - (old is not None and not old.quiet)
            self._targets[key] = target
            self._sync_waiters()

    def claim(self, key: Key, hdr: Header) -> Target | None:
        """Reader side: the posted target a frame with this header may be received into."""
        with self.cond:
            if key[0] in self._dead and key[1] in DEAD_KINDS:  # (dropped on delivery)
                return None
            t = self._targets.get(key)
            if t is None or t.state != WAITING or t.size != hdr.length or t.sig != hdr.sig:
                return None
            if t.owner is not None and not self._next_for(key, t.owner):
                return None  # (not the first receive on the key: never, kept as a guard)
            t.state = FILLING
            return t

    def finish(
        self, target: Target, ok: bool, key: Key | None = None, hdr: Header | None = None
    ) -> None:
        """Reader side: the receive into ``target`` ended; when it succeeded and ``key`` is
        given, its frame is delivered in the same locked section (one wake-up of the waiting
        collective instead of two: one for the state change, one for the frame)."""
        cb, frame = None, None
        with self.cond:
            cancelled = target.state in (CANCELLED, DROPPING)
            target.state = FILLED if ok else FAILED
            if target.owner is not None and key is not None:  # a receive's own target
                stream = self._streams.get(key)
                mid = stream is not None and stream[0] is target.owner
                cbs = self._waiting.get(key)
                keep = False
                if ok and hdr is not None and (mid or cancelled or (cbs and target.owner in cbs)):
                    frame = (hdr, RECEIVED)
                    if stream is not None and mid:  # a later frame of the receive's message
                        self._stream_took(key, stream)
                    else:  # its first frame: the rest of the message goes to it too
                        if cbs is not None and target.owner in cbs:
                            cbs.remove(target.owner)  # (the first)
                            if not cbs:
                                del self._waiting[key]
                        # (a cancelled receive's callback drops them)
                        self._open_stream(key, target.owner, frame)
                    if cancelled:  # the frame went to the sink: nothing to hand over
                        self.dropped += 1
                    else:
                        cb = target.owner
                        keep = bool(target.total) and target.advance()  # (its next frame too)
                elif ok:  # its receive was cancelled while the frame was read into it
                    self.dropped += 1
                if not keep and self._targets.get(key) is target:
                    del self._targets[key]
                    self._loud -= 1
                self._sync_waiters()
            elif ok and key is not None and hdr is not None:
                frame = (hdr, RECEIVED)
                cb = self._deliver_locked(key, frame)
            self.cond.notify_all()
        if cb is not None and frame is not None:
            self._call(cb, frame)

    def withdraw(self, key: Key, deadline: float, on_stuck: Callable[[], None]) -> None:
        """Remove ``key``'s target; wait for a receive into it that is in progress.

        Past ``deadline`` a stuck receive is ended by ``on_stuck`` (it shuts the connection).
        """
        with self.cond:
            t = self._targets.pop(key, None)
            self._loud -= t is not None and not t.quiet
            self._sync_waiters()
            stuck = False
            while t is not None and t.state == FILLING:
                left = deadline - time.monotonic()
                if not stuck and left < 0:
                    stuck = True
                    on_stuck()
                self.cond.wait(0.05 if stuck else min(0.05, max(left, 0.001)))

    def _deliver_locked(self, key: Key, frame: Frame) -> Callable[[Frame], None] | None:
        """Queue ``frame`` (waking ``get``) or return the waiting callback to call unlocked
        (a frame of a dead group is dropped)."""
        if key[0] in self._dead and key[1] in DEAD_KINDS:
            self.dropped += 1
            return None
        stream = self._streams.get(key)
        if stream is not None:  # a later frame of a message whose first frame was taken
            self._stream_took(key, stream)
            self._drop_owned(key, stream[0])  # (the rest of it comes buffered too)
            return stream[0]
        cbs = self._waiting.get(key)
        cb = None
        while cbs and cb is None:
            cb = cbs.popleft()
            if isinstance(cb, Once):  # an any-source waiter: first key to deliver wins
                if cb.fired:
                    cb = None
                else:
                    cb.fired = True
        if cb is not None:  # (a receive's own target is not for a frame it took this way)
            self._drop_owned(key, cb)
        if cbs is not None and not cbs:
            del self._waiting[key]
            self._sync_waiters()
        if cb is None:
            self._frames.setdefault(key, deque()).append(frame)
            self.cond.notify_all()
        else:
            self._open_stream(key, cb, frame)
        return cb

    def _open_stream(self, key: Key, owner: Callable[[Frame], None], frame: Frame) -> None:
        """Under ``cond``: ``owner`` took ``frame``; the later frames of its message (if any)
        go to it too (a dead group's are dropped on arrival: no stream)."""
        more = frames_after(frame)
        if more and key[0] not in self._dead:
            self._streams[key] = [owner, more]

    def _stream_took(self, key: Key, stream: list[Any]) -> None:
        """Under ``cond``: one more frame of ``key``'s stream was handed over."""
        stream[1] -= 1
        if stream[1] <= 0:
            del self._streams[key]

    def _pop_message(self, key: Key, callback: Callable[[Frame], None]) -> list[Frame]:
        """Under ``cond``: the first queued frame for ``key`` with the queued later frames of
        its message; those still to come are routed to ``callback`` (``_streams``)."""
        q = self._frames[key]
        frames = [q.popleft()]
        more = frames_after(frames[0])
        while more and q:
            frames.append(q.popleft())
            more -= 1
        if not q:
            del self._frames[key]
        if more:
            self._streams[key] = [callback, more]
        return frames

    def deliver(self, key: Key, frame: Frame) -> None:
        with self.cond:
            cb = self._deliver_locked(key, frame)
        if cb is not None:
            self._call(cb, frame)

    def _next_for(self, key: Key, owner: Callable[[Frame], None]) -> bool:
        """Under ``cond``: the next frame for ``key`` goes to ``owner`` (the later frames of a
        message it took, or the first receive waiting on the key)."""
        stream = self._streams.get(key)
        if stream is not None:
            return stream[0] is owner
        return self._waiting.get(key, [None])[0] is owner

    def _drop_owned(self, key: Key, owner: Callable[[Frame], None]) -> None:
        """Under ``cond``: remove ``key``'s target if ``owner``'s and not being filled."""
        t = self._targets.get(key)
        if t is not None and t.owner is owner and t.state == WAITING:
            del self._targets[key]
            self._loud -= 1
            self._sync_waiters()

    def expect(
        self, key: Key, callback: Callable[[Frame], None], target: Target | None = None
    ) -> None:
        """Call ``callback(frame)`` when the next frame for ``key`` is (or was) delivered.

        With ``target``, a frame not yet arrived that matches it (length and signature) is
        read straight into it, when this receive is the first waiting on ``key``; the
        callback then gets ``(header, RECEIVED)``."""
        with self.cond:
            if not self._frames.get(key):
                q = self._waiting.setdefault(key, deque())
                if (
                    target is not None
                    and target.size > 0
                    and not q
                    and key not in self._targets
                    and key[0] not in self._dead  # (a group failed meanwhile: never filled)
                ):
                    target.owner = callback
                    self._targets[key] = target
                    self._loud += 1
                q.append(callback)
                self._sync_waiters()
                return
            frames = self._pop_message(key, callback)
        for frame in frames:
            self._call(callback, frame)

    def expect_any(self, once: Once) -> None:
        """Call ``once`` for the first frame of any of ``once.keys`` (queued frames first)."""
        with self.cond:
            key = next((k for k in once.keys if self._frames.get(k)), None)
            if key is None:
                for k in once.keys:
                    self._waiting.setdefault(k, deque()).append(once)
                self._sync_waiters()
                return
            if once.fired:  # cancelled before it was registered
                return
            once.fired = True
            frames = self._pop_message(key, once)
        for frame in frames:
            self._call(once, frame)

    def dropping(self, target: Target) -> None:
        """Reader side: a cancelled receive's frame goes to a sink from here on."""
        with self.cond:
            if target.state == CANCELLED:
                target.state = DROPPING
                self.cond.notify_all()

    def cancel(
        self,
        key: Key,
        callback: Callable[[Frame], None],
        deadline: float | None = None,
        on_stuck: Callable[[], None] | None = None,
    ) -> bool:
        """Withdraw an ``expect`` that has not fired; True if it was withdrawn.

        A receive part-way through a message in frames keeps its stream, which swallows the
        rest of the message, but not its target. A frame being read into its target is cut off:
        its reader sends the rest to a sink from its next slice on, and this waits for that, so
        nothing more lands in the receive's tensor once it returns (past ``deadline``,
        ``on_stuck`` shuts the connection: a sender stalled inside a slice; the wait ends
        :data:`CUT_GIVE_UP_S` after the deadline whatever happened)."""
        with self.cond:
            if isinstance(callback, Once):
                was, callback.fired = not callback.fired, True
                return was
            t = self._targets.get(key)
            if t is not None and t.owner is callback and t.state == FILLING:
                t.state = CANCELLED
                stuck = False
                until = time.monotonic() + 1.0 if deadline is None else deadline
                while t.state == CANCELLED:
                    left = until - time.monotonic()
                    if left < 0 and not stuck:
                        stuck = True
                        if on_stuck is not None:
                            on_stuck()
                    if left < -CUT_GIVE_UP_S:  # (bounded: a shut socket ends the read at once)
                        break
                    self.cond.wait(0.05 if left < 0 else min(0.05, left))
            self._drop_owned(key, callback)
            cbs = self._waiting.get(key)
            if cbs and callback in cbs:
                cbs.remove(callback)
                if not cbs:
                    del self._waiting[key]
                self._sync_waiters()
                return True
            self._sync_waiters()
            return False

    def queued(self) -> bool:
        """Whether any frame is queued (unlocked: exact for the frames of sockets the caller
        owns, whose readers delivered them before it took the sockets)."""
        return bool(self._frames)

    def take(self, key: Key) -> Frame | None:
        """The first queued frame for ``key``, if any (never blocks)."""
        with self.cond:
            q = self._frames.get(key)
            if not q:
                return None
            frame = q.popleft()
            if not q:
                del self._frames[key]
            return frame

    def get(self, key: Key, deadline: float, check: Callable[[], None]) -> Frame:
        """Block until a frame for ``key`` arrives; ``check()`` raises if the group failed."""
        with self.cond:
            blocked = False
            try:
                while True:
                    q = self._frames.get(key)
                    if q:
                        frame = q.popleft()
                        if not q:
                            del self._frames[key]
                        return frame
                    check()
                    gone = self.left_error(key[0], key[2], f"waiting for a frame {key} from")
                    if gone is not None:
                        raise gone
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommTimeoutError(f"timed out waiting for a frame {key}")
                    if not blocked:
                        blocked = True
                        self._blocked += 1
                        self._sync_waiters()
                    self.cond.wait(min(left, 0.05))
            finally:
                if blocked:
                    self._blocked -= 1
                    self._sync_waiters()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


@dataclass
class Connection:
    """One authenticated socket to a peer, with a send lock and a reader thread."""

    peer: int
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    # held for a whole point-to-point message in frames (send_frames), whose frames must not
    # interleave with another message's of the same key; ``lock`` is taken per frame, so an
    # ABORT or a collective's frame can go out between them
    msg_lock: threading.Lock = field(default_factory=threading.Lock)
    seen: float = 0.0  # time.monotonic() of the last frame header received (liveness)
    # Read ownership word (see tcp_kernels): 0 free, 1 the reader thread, 2 a collective,
    # 3 the reader thread with a collective's claim (handed over when its frame is in).
    own: ctypes.c_int32 = field(default_factory=ctypes.c_int32)
    own_addr: int = 0  # its address (set once: a transfer passes it to native calls)
    # Payload buffers of frames the reader thread read before a collective owned the socket
    # (early frames), handed back by the transfer that copied them into place: the next
    # early frame of the same length reuses one instead of a new, zero-filled allocation
    # whose pages fault in again (1 MB: ~70 us). At most SPARE_BUFFERS, each a frame's
    # length (bounded by the mesh's max_frame in decode_header) of at most SPARE_MAX_BYTES.
    spares: list[bytearray] = field(default_factory=list)
    # Shared-memory rings with a peer of this host (ShmRing): ours to it, made at the first
    # large P2P frame and offered by a RING frame (under msg_lock); its to us, mapped when its
    # offer is read. ``ring_tried``: ours was made or could not be (not tried again).
    ring_out: ShmRing | None = None
    ring_in: ShmRing | None = None
    ring_tried: bool = False
    left: bool = False  # the peer's goodbye was read (GOODBYE_GROUP): its end is no loss
    ended: threading.Event = field(default_factory=threading.Event)  # its reader returned

    def __post_init__(self) -> None:
        self.own_addr = ctypes.addressof(self.own)


@dataclass
class XSend:
    """One frame for :meth:`Mesh.transfer` to send: ``size`` bytes at ``ptr`` (sent once
    every receive of the same transfer with an index from ``after_from`` up to ``after``
    completed, and once gate ``gate`` is open when it is not 0)."""

    peer: int
    kind: Kind
    group: int
    seq: int
    ptr: int
    size: int
    sig: tuple[int, int, int, int]
    after: int = -1
    after_from: int = 0
    gate: int = 0


@dataclass
class XRecv:
    """One COLL frame for :meth:`Mesh.transfer` to receive into ``size`` bytes at ``ptr``
    (``notify``: the transfer's ``on_notify`` is called with its index once it is in).

    A receive never waits on anything but its socket (no gate of the caller's): a socket whose
    next receive waited would stay unread -- a peer's ABORT frame behind it too -- while the
    rank whose frame would open the gate may have given up. Flow control belongs to the sender
    (an ``XSend`` waits on receives or a gate). (``Mesh.transfer`` itself gates the receives of
    a socket its reader thread is still reading from: that socket is being read.)"""

    peer: int
    group: int
    seq: int
    sig: tuple[int, int, int, int]
    ptr: int
    size: int
    notify: bool = False

    @property
    def key(self) -> Key:
        return (self.group, int(Kind.COLL), self.peer, self.seq)


def _settle(frame: Frame, x: XRecv, spares: list[bytearray]) -> tuple[Frame, bool]:
    """A frame for ``x`` that came through the mailbox: copy its payload into place when its
    header is the expected one (True; its buffer then joins ``spares``, the connection's
    early-frame buffers, unless SPARE_BUFFERS are there), else return it as is (False: a
    mismatch)."""
    hdr, body = frame
    want = (Kind.COLL, x.group, x.peer, x.seq & U64, tuple(x.sig), x.size)
    if (hdr.kind, hdr.group, hdr.src, hdr.seq, hdr.sig, hdr.length) != want:
        return frame, False
    if body is not RECEIVED and x.size:
        ctypes.memmove(x.ptr, (ctypes.c_char * x.size).from_buffer(body), x.size)
        if len(spares) < SPARE_BUFFERS and len(body) <= SPARE_MAX_BYTES:
            spares.append(body)
    return (hdr, RECEIVED), True


def _skip_receives(ops: ctypes.Array, ns: int, n: int) -> None:
    """After a mismatch: mark every receive done but one part-way through its frame (it
    still takes the rest of that frame off the stream: cut short, the reader would take
    payload bytes for a header), and every send not yet started that waits on receives or
    behind a gate (nothing is forwarded from a receive that failed). Other sends still go,
    so every peer gets this rank's frame of the step and detects the mismatch itself. No
    receive notifies any more."""
    for i in range(n):
        done, total = ops[OPW * i + 5], HEADER_SIZE + ops[OPW * i + 4]
        waits = ops[OPW * i + 6] >= 0 or ops[OPW * i + 8] != 0
        if (i >= ns and not 0 < done < total) or (i < ns and done == 0 and waits):
            ops[OPW * i + 5] = total
        ops[OPW * i + 9] = 0


# Set on a thread while it reads a connection: a receive's Work completes there, so a future
# callback of it runs there too (see on_reader_thread).
_reader = threading.local()


def on_reader_thread() -> bool:
    """Whether this thread reads a mesh connection. A group closed here would wait for
    receives only this thread can deliver (Communicator.close hands the close off)."""
    return bool(getattr(_reader, "active", False))


class SendSource:
    """The bytes a point-to-point send reads (a flat ``uint8`` tensor), a piece at a time under
    ``lock``. :meth:`detach` (its Work failed while a frame of it may be in flight) puts a
    private copy in their place, so nothing of the user's tensor is read once the send's
    ``wait()`` has raised: a frame that goes on (a receiver resuming) carries the contents the
    tensor had at the failure, whole, never bytes written into it after."""

    __slots__ = ("buf", "detached", "end", "lock")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.lock = threading.Lock()
        self.end = 0  # where the frame begun last ends (set under lock as it begins)
        self.detached = False  # no frame begins any more

    def detach(self) -> None:
        """Copy what a frame in flight may still read (up to ``end``: no later frame begins
        once detached) and read from the copy from now on."""
        with self.lock:
            if not self.detached:
                self.detached = True
                self.buf = self.buf[: self.end].clone()


class Mesh:
    """The authenticated connections of one process to every other rank of a root group."""

    def _init_state(
        self, rank: int, world: int, secret: bytes, max_frame: int, addr: str, *, backlog: int
    ) -> None:
        """Per-process state and the listening socket, shared by every kind of mesh (a fixed
        world here, the elastic mesh of reconfigurable groups), so a field added here reaches
        both. Sets ``address`` to the reachable ``host:port``; the acceptor is started by the
        caller."""
        self.rank, self.world, self.secret = rank, world, secret
        self.max_frame = max_frame
        self.mailbox = Mailbox()
        self.mailbox.on_wait = self._poke_readers
        self.peers: dict[int, Connection] = {}
        self.mailbox.rank = rank
        self.rejected = 0
        self.closed = False
        self.leaving = False  # leave() runs: the ends of the connections are expected
        # connections in the listener's handshake (see HANDSHAKE_TIMEOUT_S)
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.linger_us = 0  # LINGER_US once the ranks on this host are known (fixed meshes)
        self.linger_big_us = 0  # LINGER_BIG_US (fixed meshes)
        # bytes of a shared-memory ring for large P2P payloads to a rank of this host (fixed
        # meshes; 0: none, TCP); ``host_id`` / ``hosts``: whose ranks are on this host
        self.ring_bytes = 0
        self.host_id = ""
        self.hosts: dict[int, str] = {}
        self.pin_cpu = -1  # a large transfer's CPU (tcp_kernels.tp_pin; -1: the one it runs on)
        self._pins = 0  # large transfers running now (_pin_begin): only the first takes pin_cpu
        self._pins_lock = threading.Lock()
        self._handlers: dict[int, GroupHandler] = {}
        # ABORT frames of groups not registered here yet ({group: (src, reason)}, the first
        # one): a peer may fail a new group before this rank has created it. Groups that
        # were registered and closed keep no abort (``_retired``): a late frame of theirs
        # must not fail a later group of the same id.
        self._early_aborts: dict[int, tuple[int, int]] = {}
        self._retired: set[int] = set()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.listener = socket.create_server((addr, 0), backlog=backlog)
        self.listener.settimeout(0.2)
        host, port = self.listener.getsockname()[:2]
        if host in ("0.0.0.0", ""):
            host = socket.gethostbyname(socket.gethostname())
        self.address = f"{host}:{port}"

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        *,
        secret: bytes,
        addr: str,
        timeout_s: float,
        max_frame: int,
        host_id: str,
        key_prefix: str = "tp/",
        ring_bytes: int = 0,
    ) -> None:
        # key_prefix: a group re-created in the same store prefix must not read the addresses
        # its destroyed predecessor published there
        self._init_state(rank, world, secret, max_frame, addr, backlog=max(16, world))
        self.ring_bytes, self.host_id = ring_bytes, host_id
        store.set(f"{key_prefix}addr/{rank}", self.address)
        store.set(f"{key_prefix}host/{rank}", host_id)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="tp-accept")
        self._acceptor.start()
        deadline = time.monotonic() + timeout_s
        for q in range(world):
            self.hosts[q] = store.get(f"{key_prefix}host/{q}").decode()
        # CPUs are the machine's, not the /dev/shm mount's: ranks of host-network containers
        # on one machine (each its own /dev/shm) share them, so they are counted together
        cpus = [_cpu_host(self.hosts[q]) for q in range(world)]
        mine = _cpu_host(host_id)
        here = cpus.count(mine)
        self.linger_us = LINGER_US if here <= len(os.sched_getaffinity(0)) else 0
        self.linger_big_us = LINGER_BIG_US
        self.pin_cpu = _spread_cpu(cpus[:rank].count(mine))
        for q in range(rank):
            h, p = store.get(f"{key_prefix}addr/{q}").decode().rsplit(":", 1)
            self._connect(q, h, int(p), deadline)
        with self._ready:
            while len(self.peers) < world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(self.peers) - {rank})
                    self.close()
                    raise CommTimeoutError(
                        f"rank {rank}: peers {missing} did not connect within {timeout_s:g} s"
                    )
                self._ready.wait(min(left, 0.1))

    # -- connection set-up -------------------------------------------------------------
    def _dial(self, q: int, host: str, port: int, deadline: float) -> socket.socket:
        """A TCP connection to rank ``q``'s listener, tried again until ``deadline``."""
        while True:
            try:
                return socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise CommError(
                        f"rank {self.rank}: cannot connect to rank {q} at {host}:{port}: {e}"
                    ) from e
                time.sleep(0.01)

    def _greet(
        self, q: int, host: str, port: int, deadline: float
    ) -> tuple[socket.socket, bytes, float]:
        """Dial rank ``q`` and send our HELLO; returns the socket, our nonce and the handshake's
        deadline (``HANDSHAKE_TIMEOUT_S`` from the dial, at most ``deadline``) once its
        challenge is readable. A listener with every handshake slot taken closes a new
        connection before its challenge (:meth:`_accept_loop`): such a dial is tried again,
        every ``REDIAL_S``, until ``deadline``."""
        while True:
            sock = self._dial(q, host, port, deadline)
            hs = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            nonce_c = auth.new_nonce()
            try:
                _until(sock, hs, f"sending the hello to rank {q}")
                sock.sendall(encode_header(Kind.HELLO, 0, self.rank, 0, len(nonce_c)) + nonce_c)
                # (the challenge is read by the caller; an end of stream is seen here)
                _until(sock, hs, f"waiting for rank {q}'s challenge")
                if sock.recv(1, socket.MSG_PEEK):
                    return sock, nonce_c, hs
                why: BaseException = ConnectionError("connection closed by peer")
            except ConnectionError as e:  # (reset: closed with our HELLO unread)
                why = e
            except OSError as e:  # (a timeout: nobody answers)
                sock.close()
                raise CommError(f"rank {self.rank}: handshake with rank {q} failed: {e}") from e
            except BaseException:
                sock.close()
                raise
            sock.close()
            if time.monotonic() > deadline:
                raise CommError(
                    f"rank {self.rank}: rank {q} at {host}:{port} closed every connection before "
                    f"its challenge until the deadline (all its handshake slots taken, or it "
                    f"does not expect rank {self.rank}): {why}"
                )
            time.sleep(REDIAL_S)

    def _connect(self, q: int, host: str, port: int, deadline: float) -> None:
        # the whole handshake by one deadline (a listener trickling its challenge held a dial
        # ~64 s past a 3 s deadline: the socket's timeout bounded each recv only)
        sock, nonce_c, hs = self._greet(q, host, port, deadline)
        try:
            hdr, body = read_frame(sock, 2 * auth.NONCE_BYTES, hs)
            if hdr.kind != Kind.CHALLENGE or len(body) != auth.NONCE_BYTES + auth.MAC_BYTES:
                raise AuthError(f"rank {q} sent {hdr.kind.name} instead of a challenge")
            nonce_s, proof = bytes(body[: auth.NONCE_BYTES]), bytes(body[auth.NONCE_BYTES :])
            if not auth.verify(auth.mac(self.secret, b"srv", nonce_c, nonce_s, q), proof):
                raise AuthError(f"rank {q} failed to prove it knows the job secret")
            mine = auth.mac(self.secret, b"cli", nonce_s, nonce_c, self.rank)
            _until(sock, hs, f"sending our proof to rank {q}")
            sock.sendall(encode_header(Kind.PROOF, 0, self.rank, 0, len(mine)) + mine)
            hdr, _ = read_frame(sock, 0, hs)
            if hdr.kind != Kind.ACCEPT:
                raise AuthError(f"rank {q} did not accept our proof")
        except (OSError, WireError, ConnectionError) as e:
            sock.close()
            raise CommError(f"rank {self.rank}: handshake with rank {q} failed: {e}") from e
        except AuthError:
            sock.close()
            raise
        self._add(q, sock)

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.closed or e.errno not in ACCEPT_RETRY_ERRNOS:
                    return
                time.sleep(ACCEPT_RETRY_S)  # (the connection waits in the backlog meanwhile)
                continue
            # a handshake slot (see HANDSHAKE_TIMEOUT_S), else the connection is closed now
            if not self._slots.acquire(blocking=False):
                self._refuse(sock)
                continue
            try:
                self._spawn(self._handshake, sock, name="tp-handshake")
            except (RuntimeError, OSError):  # no thread could start: later connections may
                self._slots.release()
                self._refuse(sock)

    def _refuse(self, sock: socket.socket) -> None:
        """Close a connection that gets no handshake (counted in :attr:`rejected`)."""
        with self._lock:
            self.rejected += 1
        sock.close()

    def _handshake(self, sock: socket.socket) -> None:
        """Authenticate an accepted connection (holding a slot of ``_slots``, released here),
        the whole exchange by one deadline (``HANDSHAKE_TIMEOUT_S``)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            try:
                hdr, nonce_c = read_frame(sock, auth.NONCE_BYTES, deadline)
                q = hdr.src
                if hdr.kind != Kind.HELLO or len(nonce_c) != auth.NONCE_BYTES:
                    raise AuthError("expected HELLO with a nonce")
                if not (self.rank < q < self.world) or q in self.peers:
                    raise AuthError(f"unexpected or duplicate rank {q}")
                nonce_s = auth.new_nonce()
                proof = auth.mac(self.secret, b"srv", bytes(nonce_c), nonce_s, self.rank)
                body = nonce_s + proof
                _until(sock, deadline, "sending the challenge")
                sock.sendall(encode_header(Kind.CHALLENGE, 0, self.rank, 0, len(body)) + body)
                hdr, got = read_frame(sock, auth.MAC_BYTES, deadline)
                want = auth.mac(self.secret, b"cli", nonce_s, bytes(nonce_c), q)
                if hdr.kind != Kind.PROOF or not auth.verify(want, bytes(got)):
                    raise AuthError(f"connection claiming rank {q} failed authentication")
                _until(sock, deadline, "accepting the peer")
                sock.sendall(encode_header(Kind.ACCEPT, 0, self.rank, 0, 0))
            finally:
                self._slots.release()
        except (OSError, CommError):  # (WireError, AuthError; a timeout is an OSError)
            self._refuse(sock)
            return
        self._add(q, sock)

    def _poke_readers(self) -> None:
        """End any reader's linger on a collective frame: a consumer now waits on the mailbox
        for what the readers deliver (``Mailbox.on_wait``; called under its lock)."""
        if not self.linger_us and not self.linger_big_us:
            return
        poke = tcp_lib().conn_poke
        for conn in list(self.peers.values()):
            poke(conn.own_addr)

    def _add(self, q: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(q, sock, seen=time.monotonic())
        with self._ready:
            self.peers[q] = conn
            self._ready.notify_all()
        try:
            self._spawn(self._read_loop, conn, name=f"tp-read-{q}")
        except RuntimeError as e:  # no thread could start: nothing would read from ``q``
            with contextlib.suppress(OSError):  # (the peer's reader ends: it loses us too)
                sock.shutdown(socket.SHUT_RDWR)
            conn.ended.set()
            self._lost(conn, CommError(f"no reader thread could start: {e}"))

    def _spawn(self, fn: Callable[..., None], *args: Any, name: str) -> None:
        """Run ``fn(*args)`` on a thread of its own (the elastic mesh uses warm threads)."""
        threading.Thread(target=fn, args=args, daemon=True, name=name).start()

    # -- data path ---------------------------------------------------------------------
    def _read_loop(self, conn: Connection) -> None:
        _reader.active = True  # (a warm thread of the elastic mesh runs other tasks later)
        try:
            self._read_frames(conn)
        finally:
            _reader.active = False
            conn.ended.set()

    def _read_frames(self, conn: Connection) -> None:
        lib, fd, own = tcp_lib(), conn.sock.fileno(), conn.own_addr
        waiters = self.mailbox.waiters_addr
        stream = 0  # a frame was just read: the next one is not lingered on (tp_conn_wait)
        try:
            while True:
                # Parked (no GIL) while a collective owns the socket (Mesh.transfer).
                if not lib.conn_wait(
                    own,
                    fd,
                    READER_SLICE_MS,
                    self.linger_us,
                    self.linger_big_us,
                    POST_BYTES,
                    stream,
                    waiters,
                ):
                    stream = 0
                    if self.closed:
                        return
                    continue
                stream = 1
                try:
                    raw = _recv_exact(conn.sock, HEADER_SIZE)
                    self._take_frame(conn, decode_header(raw, max_length=self.max_frame))
                finally:
                    lib.conn_done(own)  # (to a collective that claimed it meanwhile)
        except (OSError, ConnectionError, WireError) as e:
            self._lost(conn, e)

    def _lost(self, conn: Connection, e: BaseException) -> None:
        """Tell every group that the connection to ``conn.peer`` is gone -- unless the peer said
        goodbye first (it left: this end of the stream is closed too, which ends its
        :meth:`leave`) or this mesh is leaving."""
        if conn.left and not self.closed:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            if not self.leaving:  # (leaving too: close() drains the ring the peer still reads)
                self._close_rings(conn)
            self.mailbox.wake()
            return
        if not self.closed and not self.leaving:  # (close() settles the rings)
            self._close_rings(conn)
            err = CommError(f"connection to rank {conn.peer} lost: {e}")
            for handler in list(self._handlers.values()):
                handler.on_peer_lost(conn.peer, err)
            self.mailbox.wake()

    def _take_frame(
        self, conn: Connection, hdr: Header, fill: Callable[[memoryview], None] | None = None
    ) -> None:
        """Receive the payload of a frame whose header was read, and route the frame: into a
        posted target, to a waiting collective, or to a group's abort handler. ``fill(view)``
        reads the payload bytes when given (a collective's bounded reads, :func:`recv_bounded`);
        the reader thread's blocking reads otherwise."""
        conn.seen = time.monotonic()
        if fill is None and hdr.flags & FLAG_RING:  # the payload is in the peer's ring
            fill = functools.partial(self._ring_read, conn)
        key = (hdr.group, int(hdr.kind), conn.peer, hdr.seq)
        target = (
            self.mailbox.claim(key, hdr)
            if hdr.kind in (Kind.COLL, Kind.P2P) and hdr.src == conn.peer and hdr.length
            else None
        )
        if target is not None:
            ok = False
            try:
                if target.owner is not None:  # a receive's tensor: in slices (Mailbox.cancel)
                    self._fill_owned(conn, target, hdr.length, fill)
                elif fill is None:
                    recv_into_ptr(conn.sock, target.ptr, hdr.length)
                else:
                    dst = (ctypes.c_char * hdr.length).from_address(target.ptr)
                    fill(memoryview(dst).cast("B"))
                ok = True
            finally:
                self.mailbox.finish(target, ok, key, hdr)
            return
        if fill is None:
            if hdr.kind == Kind.COLL and hdr.length:
                body = _spare(conn.spares, hdr.length)
                _recv_body(conn.sock, body)
            elif hdr.kind == Kind.P2P and hdr.length >= P2P_EMPTY_BYTES:
                # a message that came before its receive: an uninitialised buffer (a bytearray
                # is zero-filled first: 64 MiB cost ~6 ms of a 32 ms transfer), one blocking read
                body = numpy.empty(hdr.length, dtype=numpy.uint8)  # type: ignore[assignment]
                _recv_body(conn.sock, body)
            else:
                body = _recv_exact(conn.sock, hdr.length) if hdr.length else bytearray()
        else:
            if hdr.kind == Kind.P2P and hdr.length >= P2P_EMPTY_BYTES:  # (as above)
                body = numpy.empty(hdr.length, dtype=numpy.uint8)  # type: ignore[assignment]
            else:
                body = bytearray(hdr.length)
            if hdr.length:
                fill(memoryview(body))
        if hdr.src != conn.peer:
            raise WireError(f"frame claims src {hdr.src} on the connection of rank {conn.peer}")
        if hdr.kind == Kind.ABORT:
            with self._lock:  # against register(): the abort is either stashed or handled
                handler = self._handlers.get(hdr.group)
                early = self._early_aborts
                if handler is None and hdr.group not in self._retired and hdr.group not in early:
                    if len(early) >= MAX_EARLY_ABORTS:  # the oldest: likeliest a group never formed
                        del early[next(iter(early))]
                    early[hdr.group] = (conn.peer, hdr.seq)
            if handler is not None:
                handler.on_remote_abort(conn.peer, hdr.seq)
            self.mailbox.wake()
            return
        if hdr.kind == Kind.NOTE:
            self.on_note(conn.peer, hdr.seq, body)
            return
        if hdr.kind == Kind.CTRL and hdr.group == GOODBYE_GROUP:
            self._goodbye(conn)
            return
        if hdr.kind == Kind.CTRL and hdr.seq == GROUP_GOODBYE_SEQ:
            self._group_goodbye(conn.peer, hdr.group)
            return
        if hdr.kind == Kind.RING:
            self._ring_offered(conn, hdr, body)
            return
        if hdr.kind not in (Kind.COLL, Kind.P2P, Kind.CTRL):
            raise WireError(f"unexpected {hdr.kind.name} frame after the handshake")
        self.mailbox.deliver(key, (hdr, body))

    def _fill_owned(
        self,
        conn: Connection,
        target: Target,
        n: int,
        fill: Callable[[memoryview], None] | None,
    ) -> None:
        """Read ``n`` payload bytes into a receive's own target, :data:`OWNED_SLICE` at a time;
        once its receive is cancelled (``CANCELLED``) the rest goes to a sink (``DROPPING``)."""
        sink: bytearray | None = None
        done = 0
        while done < n:
            k = min(OWNED_SLICE, n - done)
            if target.state == CANCELLED:
                self.mailbox.dropping(target)
            if target.state == DROPPING:
                if sink is None:
                    sink = bytearray(min(OWNED_SLICE, n))
                view = memoryview(sink)[:k]
            else:
                view = memoryview((ctypes.c_char * k).from_address(target.ptr + done)).cast("B")
            if fill is None:
                _recv_body(conn.sock, view)
            else:
                fill(view)
            done += k

    # -- shared-memory rings (large P2P payloads between ranks of one host) ---------------
    def _ring_to(self, conn: Connection, watch: Callable[[], None]) -> ShmRing | None:
        """The ring for large P2P payloads to ``conn.peer``, made and offered (a RING frame)
        the first time; None across hosts, with rings off, or when it could not be made (its
        messages then go by TCP, with a warning). Called under ``conn.msg_lock``; the offer
        goes out as :meth:`_send_queued` sends (``watch()`` may end its wait)."""
        if conn.ring_out is not None or conn.ring_tried:
            return conn.ring_out
        conn.ring_tried = True
        if not self.ring_bytes or self.hosts.get(conn.peer) != self.host_id:
            return None
        try:
            ring = ShmRing("", self.ring_bytes, create=True)
        except (OSError, CommError) as e:
            warnings.warn(
                f"torchport: no shared-memory ring to rank {conn.peer} ({e}); large "
                "point-to-point messages to it go by TCP",
                stacklevel=3,
            )
            return None
        path = ring.path.encode()
        head = encode_header(Kind.RING, 0, self.rank, 0, len(path), (ring.capacity, 0, 0, 0))
        offer = [_frame_views(head, _byte_view(path))]
        try:
            self._send_queued({conn.peer: offer}, watch)
        finally:
            if offer:  # not sent whole: no peer maps it (one cut part-way shut the connection)
                ring.close()
                ring.unlink()
                conn.ring_tried = False  # (the next large message offers one again)
            else:  # it went out whole (also when the call raised after): the peer maps it
                conn.ring_out = ring
                if self.closed:  # (closed meanwhile: close() may have passed this connection)
                    self._close_rings(conn)
        return conn.ring_out

    def _ring_offered(self, conn: Connection, hdr: Header, body: Any) -> None:
        """Map the ring ``conn.peer`` offers for its large P2P payloads, and unlink its name
        (the mappings keep it). A ring that cannot be mapped is a broken connection: the
        frames after the offer have their payloads there."""
        cap = hdr.sig[0]
        if conn.ring_in is not None or not 0 < cap <= MAX_RING_BYTES:
            raise WireError(
                f"rank {conn.peer} offered a shared-memory ring of {cap} bytes "
                f"({'a second one' if conn.ring_in is not None else 'out of bounds'})"
            )
        try:
            ring = ShmRing(bytes(body).decode("ascii"), cap, create=False)
        except (UnicodeDecodeError, OSError, CommError) as e:
            hint = (
                "; ranks of another user share no memory: TORCHPORT_DIST_P2P_RING_BYTES=0 on "
                "the sender sends large point-to-point messages by TCP"
                if isinstance(e, PermissionError)
                else ""
            )
            raise WireError(
                f"cannot map the shared-memory ring rank {conn.peer} offered ({e}){hint}"
            ) from e
        ring.unlink()
        conn.ring_in = ring
        if self.closed:
            self._close_rings(conn)

    def _ring_read(
        self,
        conn: Connection,
        view: memoryview,
        deadline: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Take ``len(view)`` payload bytes of a ring frame from ``conn``'s ring. Each slice
        without data looks at the socket: the peer's end closed (it exited part-way, or this
        rank shut the connection) raises ConnectionError; ``check()`` and ``deadline`` as in
        :func:`recv_bounded` (a collective's thread)."""
        ring = conn.ring_in
        if ring is None:
            raise WireError(f"rank {conn.peer} sent a frame through a ring it never offered")
        ptr = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        done, n = 0, len(view)
        while done < n:
            k = ring.move(ptr + done, n - done, put=False, budget_ns=RING_SLICE_NS)
            if k == RING_CORRUPT:
                raise WireError(
                    f"the shared-memory ring from rank {conn.peer} is corrupt (its write "
                    "position is out of the ring's bounds)"
                )
            if k < 0:
                raise ConnectionError(f"the shared-memory ring from rank {conn.peer} was closed")
            done += k
            if k == 0:
                if _peer_closed(conn.sock):
                    raise ConnectionError("connection closed by peer")
                if check is not None:
                    check()
                if deadline is not None and time.monotonic() > deadline:
                    raise CommTimeoutError(f"timed out with {done} of {n} bytes of a frame read")

    def _send_sourced(
        self,
        conn: Connection,
        head: bytes,
        source: SendSource,
        off: int,
        n: int,
        ring: ShmRing | None,
        late: Callable[[], bool] | None = None,
    ) -> None:
        """Send one point-to-point frame whose payload is bytes ``[off, off + n)`` of
        ``source``: its header by the socket, then the payload by the socket or, with ``ring``
        (the header carries ``FLAG_RING``), into the ring, which the peer's reader empties once
        it has read the header. Every piece is read under ``source.lock`` by a call that copies
        it at once (a non-blocking send, a ring copy of at most ``RING_SLICE_NS``), so a
        :meth:`SendSource.detach` between two pieces moves the rest onto its private copy.

        A frame whose send fails part-way -- the source detached (``abort()``, a peer's
        failure) or ``late()`` true (the send's deadline passed; it fails the group, which
        detaches the source) -- cannot stop there (the stream would break for every group on
        the connection): its rest goes on from a thread of its own (:meth:`_send_rest_of`),
        which holds the connection until the frame is whole, and this call raises
        :class:`CommunicatorErrorState` (the send fails with the group's error). A caller
        that runs the send inline in ``wait()`` stayed in this loop for as long as the receiver
        took nothing (a frozen peer: for good, through abort and past the group timeout)."""

        def stop() -> bool:
            if not source.detached and late is not None and late():
                source.detach()  # (normally done by the failure late() reported)
            return source.detached

        while not conn.lock.acquire(timeout=LOCK_POLL_S):  # (a frame to a stopped reader)
            if stop():
                raise CommunicatorErrorState(f"send to rank {conn.peer} stopped: its group failed")
        handed = begun = False
        left: list[Any] = [None, 0]  # what is left of the header (None once sent), bytes sent
        try:
            with source.lock:
                if source.detached:  # (its Work failed just before this frame began)
                    raise CommunicatorErrorState(
                        f"send to rank {conn.peer} stopped: its group failed"
                    )
                source.end = off + n
                if ring is None and n <= 65536:  # (small: one copy, one system call)
                    head = head + source.buf[off : off + n].numpy().tobytes()
                    off = n = 0
            left[0] = memoryview(head)
            begun = True
            self._pump(conn, left, source, off, n, ring, stop)
            if left[0] is not None or left[1] < n:
                # (not a return: the send must not complete as a success past its group's
                # failure, whose own finishing of the Work may come after this thread's)
                handed = self._hand_over(conn, head, left, source, off, n, ring)
                raise CommunicatorErrorState(f"send to rank {conn.peer} stopped: its group failed")
        except OSError as e:
            raise CommError(f"send to rank {conn.peer} failed: {e}") from e
        except CommError:
            raise  # (the connection or its ring is gone: so is every group on it)
        except BaseException:
            # (e.g. KeyboardInterrupt in a blocking send: the frame begun still completes,
            # from a copy, or the connection's other groups would read a broken stream)
            if begun and not handed and (left[0] is not None or left[1] < n):
                source.detach()
                handed = self._hand_over(conn, head, left, source, off, n, ring)
            raise
        finally:
            if not handed:
                conn.lock.release()

    def _hand_over(
        self,
        conn: Connection,
        head: bytes,
        left: list[Any],
        source: SendSource,
        off: int,
        n: int,
        ring: ShmRing | None,
    ) -> bool:
        """Give a frame's rest (``left``, as :meth:`_pump` keeps it) to a thread of its own,
        which releases ``conn.lock`` once the frame is whole; True if it did. A frame of which
        nothing went out is dropped instead (False: the caller releases the lock)."""
        buf = left[0]
        if buf is not None and len(buf) == len(head):
            return False
        self._spawn(
            self._send_rest_of,
            conn,
            buf,
            source,
            off + left[1],
            n - left[1],
            ring,
            name="tp-send-rest",
        )
        return True

    def _pump(
        self,
        conn: Connection,
        left: list[Any],
        source: SendSource,
        off: int,
        n: int,
        ring: ShmRing | None,
        stop: Callable[[], bool],
    ) -> None:
        """Send ``left[0]`` (bytes by the socket; None: nothing), then bytes ``[off + left[1],
        off + n)`` of ``source`` (by ``ring`` or the socket), without blocking for longer than a
        slice at a time, until everything went or ``stop()`` is true when a slice passed with
        some left. ``left`` follows the progress as it goes (what is left of the bytes, None
        once they went; the source's bytes sent), also when an exception ends the call."""
        poller = None
        while True:
            buf = left[0]
            if buf is not None:
                with contextlib.suppress(BlockingIOError):
                    left[0] = buf = buf[conn.sock.send(buf, socket.MSG_DONTWAIT) :]
                if not len(buf):
                    left[0] = None
                    continue
                k = 0
            elif left[1] < n:
                done = left[1]
                with source.lock:
                    at = source.buf.data_ptr() + off + done
                    if ring is not None:
                        k = ring.move(at, n - done, put=True, budget_ns=RING_SLICE_NS)
                    else:
                        view = memoryview((ctypes.c_char * (n - done)).from_address(at))
                        try:
                            k = conn.sock.send(view.cast("B"), socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            k = 0
                if k == RING_CORRUPT:
                    raise CommError(
                        f"send to rank {conn.peer} failed: the shared-memory ring to it is "
                        "corrupt (its read position is out of the ring's bounds)"
                    )
                if k < 0:
                    raise CommError(
                        f"send to rank {conn.peer} failed: the connection to it was lost or "
                        "closed (its shared-memory ring was closed)"
                    )
                left[1] = done + k
                if left[1] >= n:
                    return
            else:
                return
            if k == 0 and (left[0] is not None or ring is None):  # the socket is full: wait
                if poller is None:
                    poller = select.poll()
                    poller.register(conn.sock.fileno(), select.POLLOUT)
                poller.poll(SLICE_MS)
            if stop():
                return

    def _send_rest_of(
        self,
        conn: Connection,
        buf: memoryview | None,
        source: SendSource,
        off: int,
        n: int,
        ring: ShmRing | None,
    ) -> None:
        """The rest of a frame whose send failed part-way (its source detached: a private copy
        of the bytes), then the connection's lock (held for it by the thread that began the
        frame). Ends early once the mesh closes or the connection fails."""
        try:
            with contextlib.suppress(OSError, CommError):
                self._pump(conn, [buf, 0], source, off, n, ring, lambda: self.closed)
        finally:
            conn.lock.release()

    @staticmethod
    def _close_rings(conn: Connection, *, clean: bool = False) -> None:
        """Close ``conn``'s rings (a copy waiting on one ends). ``clean`` (this mesh closes):
        the peer still takes what our ring holds -- a send that returned is delivered, as the
        socket delivers its buffered bytes after a close -- and a ring it has not mapped yet
        keeps its name, for the peer to map when it reads the offer. Otherwise (the connection
        is lost or cut) both stop now and the name goes."""
        out = conn.ring_out
        keep = clean and out is not None and not out.mapped
        if out is not None:
            if not keep:  # (first: whoever waits on the ring may end this process next)
                out.unlink()
            out.close(drain=clean)
        if conn.ring_in is not None:
            conn.ring_in.close()

    def send(
        self,
        peer: int,
        kind: Kind,
        group: int,
        seq: int,
        payload: bytes | bytearray | memoryview = b"",
        sig: tuple[int, int, int, int] = (0, 0, 0, 0),
        *,
        deadline: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send one frame to global rank ``peer`` (not held up by a message in frames being
        sent to it: see :meth:`send_frames`); for control frames and notices.

        Before the frame begins, the wait for the connection's send lock and for room in its
        socket ends at ``deadline`` (:class:`CommTimeoutError`; None: no bound) or at a
        ``check()`` that raises; nothing is sent then. A frame the socket took only in part is
        finished by a thread of its own, which holds the lock until the rest is out (a receiver
        that stopped reading holds that thread, not the caller; the stream stays framed and the
        connection whole), as a beat's or an ABORT's rest."""
        view = _byte_view(payload)
        if len(view) > self.max_frame:
            raise CommError(f"frame of {len(view)} bytes exceeds the bound {self.max_frame}")
        conn = self._conn(peer)
        data = encode_header(kind, group, self.rank, seq, len(view), sig) + bytes(view)

        def watch() -> None:
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeoutError(f"rank {self.rank}: a send to rank {peer} timed out")

        while not conn.lock.acquire(timeout=LOCK_POLL_S):
            watch()
        handed = False
        try:
            poller: select.poll | None = None
            flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
            while True:
                try:
                    k = conn.sock.send(data, flags)
                except BlockingIOError:
                    k = 0
                except OSError as e:
                    raise CommError(f"send to rank {peer} failed: {e}") from e
                if k == len(data):
                    return
                if k:
                    handed = self._hand_rest(conn, data[k:], "tp-send")
                    if not handed:
                        raise CommError(
                            f"send to rank {peer} failed: no thread to finish the frame "
                            "(the connection is shut down: its stream would break)"
                        )
                    return
                watch()  # (nothing of the frame sent yet)
                if poller is None:
                    poller = select.poll()
                    poller.register(conn.sock.fileno(), select.POLLOUT)
                poller.poll(SLICE_MS)
        finally:
            if not handed:
                conn.lock.release()

    def _hand_rest(self, conn: Connection, rest: bytes, name: str) -> bool:
        """Give the rest of a frame begun under ``conn.lock`` (held by the caller) to a thread
        that sends it and then releases the lock (:meth:`_send_rest`). False when no thread
        could take it (the mesh closing, no thread to start): the connection is then shut
        down, since a frame left part-way would be read on as headers; the lock stays the
        caller's to release."""
        try:
            self._spawn(self._send_rest, conn, rest, name=name)
        except RuntimeError:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            return False
        return True

    def send_abort(self, peer: int, group: int, reason: int) -> None:
        """Send ``group``'s ABORT frame to global rank ``peer`` without waiting behind a frame
        being sent to it (a receiver that stopped reading holds that one for as long as it
        stays stopped): here when the connection is free and its socket takes the header at
        once, else from a thread of its own once it can go."""
        self._send_header(peer, encode_header(Kind.ABORT, group, self.rank, reason, 0), "tp-abort")

    def _send_header(self, peer: int, head: bytes, name: str) -> None:
        """Send a payload-less frame to ``peer`` without waiting (see :meth:`send_abort`), from
        a thread named ``name`` when it cannot go at once."""
        conn = self.peers.get(peer)
        if conn is None:
            return
        if conn.lock.acquire(blocking=False):
            handed = False
            try:
                k = conn.sock.send(head, socket.MSG_DONTWAIT)
                if 0 < k < len(head):  # the rest must follow before any other byte: a thread
                    handed = self._hand_rest(conn, head[k:], name)  # (unlocks)
                    return
            except BlockingIOError:
                k = 0
            except OSError:
                return  # (the connection is gone: so is every group on it)
            finally:
                if not handed:
                    conn.lock.release()
            if k == len(head):
                return
        self._spawn(self._send_quietly, conn, head, name=name)

    def _send_quietly(self, conn: Connection, head: bytes) -> None:
        with contextlib.suppress(CommError):
            self._send_frame(conn, head, b"")

    @staticmethod
    def _send_rest(conn: Connection, rest: bytes) -> None:
        """The rest of a header whose start went out under ``conn.lock``, then the lock (held
        for it by the thread that sent the start)."""
        try:
            with contextlib.suppress(OSError):
                conn.sock.sendall(rest)
        finally:
            conn.lock.release()

    def _conn(self, peer: int) -> Connection:
        conn = self.peers.get(peer)
        if conn is None:
            raise CommError(f"rank {self.rank} has no connection to rank {peer}")
        if conn.left:
            raise _left(self.rank, peer, "sending to")
        return conn

    def _send_frame(
        self, conn: Connection, head: bytes, payload: bytes | bytearray | memoryview
    ) -> None:
        try:
            with conn.lock:
                if len(payload) <= 65536:
                    conn.sock.sendall(head + bytes(payload))
                else:
                    conn.sock.sendall(head)
                    conn.sock.sendall(payload)
        except OSError as e:
            raise CommError(f"send to rank {conn.peer} failed: {e}") from e

    def send_frames(
        self,
        peer: int,
        kind: Kind,
        group: int,
        seq: int,
        parts: Sequence[tuple[bytes | bytearray | memoryview, tuple[int, int, int, int]]],
        check: Callable[[], None] | None = None,
        source: SendSource | None = None,
        late: Callable[[], bool] | None = None,
    ) -> None:
        """Send frames ``(payload, sig)`` to global rank ``peer`` in order, with no frame of
        another such call between them (one message cut into frames; other frames, an ABORT's,
        may go out between two of them). ``check()`` runs before every frame after the first
        and raises to stop (the group failed: the receiver's side fails too). With ``source``
        (a send's bytes; the payloads are its consecutive pieces, of these lengths) every
        payload is read from it piece by piece (:meth:`_send_sourced`), else from ``parts``;
        a frame through the peer's ring needs a source. ``late()`` (true once the send's
        deadline passed, having failed the group) and ``check()`` also end a wait for the
        connection while another message to the peer holds it."""
        for payload, _sig in parts:
            if len(payload) > self.max_frame:
                raise CommError(f"frame of {len(payload)} bytes exceeds the bound {self.max_frame}")
        conn = self._conn(peer)
        if (group, peer) in self.mailbox.left_groups:  # (it would drop them unread)
            raise _left(self.rank, peer, "sending to", group)
        big = kind == Kind.P2P and sum(len(p) for p, _ in parts) >= RING_MIN_BYTES

        def watch() -> None:
            timed_out = late is not None and late()  # (then it failed the group)
            if check is not None:
                check()
            if timed_out:
                raise CommTimeoutError(f"rank {self.rank}: a send to rank {peer} timed out")

        while not conn.msg_lock.acquire(timeout=LOCK_POLL_S):  # (another message's, held up)
            watch()
        with contextlib.ExitStack() as held:
            held.callback(conn.msg_lock.release)
            # (the ring, if any, for every frame)
            ring = self._ring_to(conn, watch) if big and source is not None else None
            off = 0
            for i, (payload, sig) in enumerate(parts):
                if i and check is not None:
                    check()
                n = len(payload)
                if source is not None and n:
                    flags = FLAG_RING if ring is not None else 0
                    head = encode_header(kind, group, self.rank, seq, n, sig, flags)
                    self._send_sourced(conn, head, source, off, n, ring, late)
                else:  # (an empty frame, or no source) watched as a collective's sends
                    view = _byte_view(payload)
                    head = encode_header(kind, group, self.rank, seq, len(view), sig)
                    self._send_queued({peer: [_frame_views(head, view)]}, watch)
                off += n

    def send_all(
        self,
        frames: list[tuple[int, Kind, int, int, bytes | bytearray | memoryview, tuple]],
        deadline: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send frames ``(peer, kind, group, seq, payload, sig)`` from this thread, to every
        peer at once: each socket takes as many bytes as its buffer holds (``MSG_DONTWAIT``,
        head and payload in one ``sendmsg``: the reader thread's blocking ``recv`` on the same
        socket is unaffected), then ``poll`` waits until one can take more. One slow receiver
        does not hold the others back, and there is no sender thread to hand off to.

        While a socket or a connection's send lock is not free, ``check()`` (raises once the
        group failed or was aborted) runs and ``deadline`` is tested (:class:`CommTimeoutError`)
        every ``SLICE_MS``; a receiver that stopped reading held this call for as long as it
        stayed stopped. Frames not begun are then dropped; one part-way sent gets
        ``ABORT_FINISH_S`` (after ``check()`` raised, unless from a timeout),
        ``TIMEOUT_FINISH_S`` or ``FINISH_S`` to complete (see :meth:`_send_queued`; its
        payload, the caller's memory, is read only until this returns), else its
        connection is shut down (a frame cut short would be read on as headers) and reported
        lost.
        """
        queues: dict[int, list[list[memoryview]]] = {}
        for peer, kind, group, seq, payload, sig in frames:
            view = _byte_view(payload)
            if len(view) > self.max_frame:
                raise CommError(f"frame of {len(view)} bytes exceeds the bound {self.max_frame}")
            head = encode_header(kind, group, self.rank, seq, len(view), sig)
            queues.setdefault(peer, []).append(_frame_views(head, view))

        def watch() -> None:
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeoutError(f"rank {self.rank}: a send timed out")

        self._send_queued(queues, watch)

    def _send_queued(
        self, queues: dict[int, list[list[memoryview]]], watch: Callable[[], None]
    ) -> None:
        """Send the frames queued per peer (each frame its views: header, payload) from this
        thread (:meth:`send_all`), each connection's send lock held until its frames are out.
        ``watch()`` runs every ``SLICE_MS`` while a socket or a send lock is not free and
        raises to stop: a frame part-way sent then gets ``TIMEOUT_FINISH_S`` to complete after
        a :class:`CommTimeoutError` or an error raised from one (a group that its own timeout
        failed), ``ABORT_FINISH_S`` after any other error of ``watch()`` (the group failed
        otherwise or was aborted) and ``FINISH_S`` after an error of the sending
        itself (a connection lost: the other peers' frames still complete). A frame still
        part-way then is cut: its connection is shut down (the connection this call locked,
        even if the mesh dropped it meanwhile) and reported lost. Frames not begun are not
        sent. What went out whole has left ``queues`` (a one-frame queue left empty went out;
        after an error the frames behind a part-way one are dropped from it too)."""
        conns = [self._conn(peer) for peer in sorted(queues)]
        held: dict[int, Connection] = {}
        cut: list[tuple[Connection, BaseException]] = []
        stopped = False

        def watching() -> None:
            nonlocal stopped
            if self.closed:
                raise CommError(f"rank {self.rank}: mesh closed during a send")
            try:
                watch()
            except BaseException:
                stopped = True
                raise

        def release(conn: Connection) -> None:
            if held.pop(conn.peer, None) is not None:
                conn.lock.release()

        pending: dict[int, tuple[Connection, list[list[memoryview]]]] = {}  # by peer
        begun: set[int] = set()  # the peers whose first queued frame is part-way sent
        try:
            try:
                for conn in conns:  # ascending peer order: no lock-order cycle with another
                    while not conn.lock.acquire(timeout=LOCK_POLL_S):
                        watching()
                    held[conn.peer] = conn
                    pending[conn.peer] = (conn, queues[conn.peer])
                self._push_all(pending, begun, watching, None, release, None)
            except BaseException as e:
                # (bound before anything else: past a second KeyboardInterrupt here, the
                # finally below still cuts what is part-way)
                part_way = {p: (c, q) for p, (c, q) in pending.items() if p in begun}
                try:
                    finish = FINISH_S
                    if stopped:
                        # a timeout, or a group its own timeout failed (check() raises the
                        # group's error from it: send_frames' watch once late() failed it)
                        timeout = isinstance(e, CommTimeoutError) or isinstance(
                            e.__cause__, CommTimeoutError
                        )
                        finish = TIMEOUT_FINISH_S if timeout else ABORT_FINISH_S
                    for p, (c, q) in pending.items():
                        if p in begun:
                            del q[1:]  # the frames after the one part-way are dropped
                        else:
                            release(c)
                    if part_way:
                        end = time.monotonic() + finish
                        # (a copy: a peer whose socket fails now leaves it, not part_way)
                        self._push_all(dict(part_way), begun, lambda: None, end, release, {})
                finally:  # (also past a second KeyboardInterrupt)
                    for p, (c, _q) in part_way.items():
                        if p in begun:
                            with contextlib.suppress(OSError):
                                c.sock.shutdown(socket.SHUT_RDWR)
                            self._close_rings(c)
                            cut.append((c, _cut("sent", e)))
                raise
        finally:
            for conn in list(held.values()):
                release(conn)
            for conn, err in cut:  # (no send lock held: the failure handlers send ABORTs)
                self._lost(conn, err)

    @staticmethod
    def _push_all(
        pending: dict[int, tuple[Connection, list[list[memoryview]]]],
        begun: set[int],
        watch: Callable[[], None],
        end: float | None,
        done: Callable[[Connection], None],
        broken: dict[int, BaseException] | None,
    ) -> None:
        """Send the frames queued for each peer (each frame a list of views), without blocking
        on a socket; between passes poll for room, running ``watch()`` every ``SLICE_MS``
        (until ``end``, if given). A peer whose frames are all out leaves ``pending`` and goes
        to ``done(conn)``; ``begun`` holds the peers whose first queued frame is part-way
        sent. A socket error raises :class:`CommError`, or with ``broken`` is recorded there
        (the peer leaves ``pending``, still ``begun`` if part-way) while the others go on."""
        poller: select.poll | None = None
        fds: dict[int, int] = {}  # the descriptor each peer was registered under
        flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
        while pending:
            for peer, (conn, queue) in list(pending.items()):
                try:
                    while queue:
                        parts = queue[0]
                        k = conn.sock.sendmsg(parts, (), flags)
                        if k:
                            begun.add(peer)
                        while parts and k >= len(parts[0]):
                            k -= len(parts.pop(0))
                        if parts:
                            parts[0] = parts[0][k:]
                        else:
                            queue.pop(0)
                            begun.discard(peer)
                except BlockingIOError:
                    continue
                except OSError as e:
                    if broken is None:
                        raise CommError(f"send to rank {peer} failed: {e}") from e
                    broken[peer] = e
                else:
                    done(conn)
                del pending[peer]
                fd = fds.pop(peer, -1)
                if poller is not None and fd >= 0:
                    poller.unregister(fd)
            if not pending:
                return
            if end is not None and time.monotonic() > end:
                return
            watch()
            if poller is None:
                poller = select.poll()
                for p, (c, _q) in pending.items():
                    fd = c.sock.fileno()
                    if fd >= 0:  # (closed meanwhile: its next send fails)
                        poller.register(fd, select.POLLOUT)
                        fds[p] = fd
            poller.poll(SLICE_MS)

    def _pin_begin(self) -> int:
        """The CPU a large transfer starting now pins to: the rank's own (``pin_cpu``) unless
        another transfer of this process is pinned already, then -1 (the CPU its thread runs on):
        two groups' transfers running at once on one rank would otherwise share one CPU. Every
        call is paired with :meth:`_pin_end`."""
        with self._pins_lock:
            self._pins += 1
            return self.pin_cpu if self._pins == 1 else -1

    def _pin_end(self) -> None:
        with self._pins_lock:
            self._pins -= 1

    def _own(self, peers: list[int]) -> tuple[list[Connection], list[Connection]] | None:
        """Claim read ownership of the connections to ``peers`` without waiting: returns
        those owned now and those claimed (their reader thread is mid-frame and hands the
        socket over once that frame is in: ``tcp_kernels.tp_conn_claim``); None (nothing
        held or claimed) when another collective owns or claimed one."""
        lib = tcp_lib()
        got, claimed = list[Connection](), list[Connection]()

        def give_back() -> None:
            for c in got:
                lib.conn_release(c.own_addr)
            for c in claimed:
                lib.conn_unclaim(c.own_addr)

        for peer in sorted(set(peers)):
            conn = self.peers.get(peer)
            if conn is None:
                give_back()
                raise CommError(f"rank {self.rank} has no connection to rank {peer}")
            rc = lib.conn_claim(conn.own_addr)
            if rc == 0:
                give_back()
                return None
            (got if rc == 1 else claimed).append(conn)
        return got, claimed

    def transfer(
        self,
        sends: list[XSend],
        recvs: list[XRecv],
        deadline: float,
        check: Callable[[], None],
        on_notify: Callable[[int], list[int]] | None = None,
        on_cut: Callable[[], None] | None = None,
    ) -> list[Frame | None] | None:
        """Send ``sends`` and receive ``recvs`` (COLL frames) in one native loop on this thread.

        ``on_notify(j)`` runs on this thread as soon as receive ``j`` (one with ``notify``)
        is in, while the peers' frames keep flowing into the socket buffers; it returns the
        gates to open (the sends with such a ``gate`` may then start).

        Returns one frame per receive: ``(header, RECEIVED)`` when its payload is in place
        (its header equal to the expected one), or the differing frame as received (the
        caller reports the mismatch; then receives not yet done are ``None``). Returns None,
        having sent nothing, when a connection to receive from cannot be owned now (another
        collective holds or claimed it; one whose reader thread is mid-frame is claimed and
        read from once that frame is in, the rest of the transfer moving meanwhile) or the
        transfer spans more than ``MAXFD`` peers (what the native loop tracks): the caller
        takes the mailbox path instead. Raises
        :class:`CommError` on a lost connection, :class:`CommTimeoutError` past ``deadline``
        and whatever ``check()`` raises (checked every ``SLICE_MS``, progress or not).

        ``on_cut()`` runs on this thread once ``check()`` raised (the group failed or was
        aborted) and the caller's buffers are no longer touched -- the frames part-way sent
        are whole, the rest of those part-way received goes to scratch -- with this transfer's
        send locks released: the caller's operation may report its failure then, before the
        receives drain.
        """
        if len({x.peer for x in sends} | {x.peer for x in recvs}) > MAXFD:
            return None
        lib = tcp_lib()
        ns, nr = len(sends), len(recvs)
        n = ns + nr
        heads = ctypes.create_string_buffer(HEADER_SIZE * (ns + 2 * nr) or 1)
        hbase = ctypes.addressof(heads)
        out = (ctypes.c_int64 * 1)()
        frames: list[Frame | None] = [None] * nr
        conns: dict[int, Connection] = {}
        # the table's words and every header (sent, and expected: compared byte for byte by
        # the native loop) packed straight into place, before the sockets are owned
        pack, rank, words = HEADER.pack_into, self.rank, list[int]()
        for i, xs in enumerate(sends):
            conn = self.peers.get(xs.peer)
            if conn is None:
                raise CommError(f"rank {self.rank} has no connection to rank {xs.peer}")
            if conn.left:  # (its socket would still take the frame: no one reads it)
                raise _left(self.rank, xs.peer, "sending to")
            if xs.size > self.max_frame:
                raise CommError(f"frame of {xs.size} bytes exceeds the bound {self.max_frame}")
            conns[xs.peer] = conn
            h = HEADER_SIZE * i
            s0, s1, s2, s3 = xs.sig
            pack(
                heads,
                h,
                MAGIC,
                WIRE_VERSION,
                xs.kind,
                0,
                xs.group,
                rank,
                xs.seq & U64,
                s0,
                s1,
                s2,
                s3,
                xs.size,
            )
            after = xs.after + ns if xs.after >= 0 else -1
            words += (
                conn.sock.fileno(),
                0,
                hbase + h,
                xs.ptr,
                xs.size,
                0,
                after,
                xs.after_from + ns,
                1,  # (gated until this transfer holds the peer's send lock: relock below)
                0,
            )
        for j, x in enumerate(recvs):
            conn = self.peers.get(x.peer)
            if conn is None:
                raise CommError(f"rank {self.rank} has no connection to rank {x.peer}")
            conns[x.peer] = conn
            h = HEADER_SIZE * (ns + 2 * j)
            s0, s1, s2, s3 = x.sig
            pack(
                heads,
                h,
                MAGIC,
                WIRE_VERSION,
                Kind.COLL,
                0,
                x.group,
                x.peer,
                x.seq & U64,
                s0,
                s1,
                s2,
                s3,
                x.size,
            )
            words += (
                conn.sock.fileno(),
                1,
                hbase + h,
                x.ptr,
                x.size,
                0,
                -1,
                hbase + h + 64,
                0,
                int(x.notify),
            )
        # one C-level conversion of the words: a ctypes array built from the list converts
        # them one by one through Python (~0.23 us a word: 0.3 ms for the 130 operations of
        # a 64 MB chain broadcast over four ranks); the array.array stays its buffer
        ops = (ctypes.c_int64 * (OPW * n)).from_buffer(array.array("q", words))
        # A frame the reader thread reads before this thread owns the socket (its sender is
        # ahead) still goes straight into place when it is large.
        posted = [x for x in recvs if x.size >= POST_BYTES]
        gates: dict[int, list[int]] = {}
        for i, gate in enumerate(x.gate for x in sends):
            if gate:
                gates.setdefault(gate, []).append(i)

        def notify(j: int) -> None:
            assert on_notify is not None, "a receive notifies a transfer without on_notify"
            for g in on_notify(j):
                for i in gates.pop(g, []):
                    if conns[sends[i].peer].lock in held:  # (else relock opens it)
                        ops[OPW * i + 8] = 0

        for x in posted:
            self.mailbox.post(x.key, Target(x.ptr, x.size, x.sig, quiet=True))
        # Sockets whose reader thread is mid-frame (a peer ahead of this rank) are claimed,
        # not waited for: this transfer's sends and other receives start at once, the
        # receives on such a socket gated until the reader hands it over (``late``, by peer;
        # their targets stay posted meanwhile, so that frame still lands in place).
        late: dict[int, Connection] = {}

        def withdraw(peers: set[int], until: float) -> None:
            for x in posted:
                if x.peer in peers:
                    self.mailbox.withdraw(
                        x.key, until, functools.partial(self.shutdown_peer, x.peer)
                    )

        got = None
        error: BaseException | None = None
        try:
            got = self._own([r.peer for r in recvs])
        except BaseException as e:
            error = e
            raise
        finally:
            if posted:  # owned (or given up): the reader fills no target any more
                mid = {c.peer for c in got[1]} if got else set()
                until, error = withdraw_until(deadline, error), None  # (no reference cycle)
                withdraw({x.peer for x in posted} - mid, until)
        if got is None:
            return None
        owned = got[0]
        late.update((c.peer, c) for c in got[1])

        def set_gate(peers: set[int] | dict[int, Connection], shut: int) -> None:
            """Gate (1) or ungate (0) the receives from ``peers`` (table word 8)."""
            for j, x in enumerate(recvs):
                if x.peer in peers:
                    ops[OPW * (ns + j) + 8] = shut

        set_gate(late, 1)
        bad = aborting = False

        # (group, peer) of the receives not known to be in, made once a peer's goodbye for a
        # group was read (Mesh._group_goodbye): a receive from a peer that left its group
        # never ends. Never scanned for another group's goodbye (a watch per piece of a
        # pipelined transfer scanned every receive: quadratic in the pieces).
        pending: set[tuple[int, int]] | None = None

        def watch() -> None:
            nonlocal aborting, pending
            aborting = True  # whatever check() raises is the group's abort or failure
            check()
            aborting = False
            gone = self.mailbox.left_groups
            if gone:
                if pending is None:
                    pending = {(x.group, x.peer) for x in recvs}
                if not pending.isdisjoint(gone):
                    for j, x in enumerate(recvs):
                        if (x.group, x.peer) in gone and not received(j):
                            raise _left(self.rank, x.peer, "receiving from", x.group)
                    pending -= gone  # (every receive from those peers is in)

        def received(j: int) -> bool:
            """Whether receive ``j`` is complete (in place, or settled from the mailbox)."""
            return ops[OPW * (ns + j) + 5] >= HEADER_SIZE + recvs[j].size

        def take_early(peers: set[int] | None) -> None:
            """Settle the frames the reader threads of ``peers`` (None: all) delivered to the
            mailbox before this transfer owned their sockets (a socket's frames arrive in
            its receives' order: the first receive with none ends that peer's)."""
            nonlocal bad
            notified: list[int] = []  # receives completed here
            done: set[int] = set()
            for j, x in enumerate(recvs):
                if (peers is not None and x.peer not in peers) or x.peer in done:
                    continue
                if received(j):
                    continue  # settled before (several receives may share a key)
                early = self.mailbox.take(x.key)
                if early is None:
                    done.add(x.peer)
                    continue
                i = ns + j
                frames[j], ok = _settle(early, x, conns[x.peer].spares)
                ops[OPW * i + 5] = HEADER_SIZE + x.size
                bad = bad or not ok
                if ok and x.notify:
                    ops[OPW * i + 9] = 2
                    notified.append(j)
            if bad:
                _skip_receives(ops, ns, n)
            else:
                for j in notified:
                    notify(j)

        def adopt(wait_ms: int) -> None:
            """Own the claimed sockets handed over by now (waiting up to ``wait_ms`` for one):
            their early frames settled, their receives ungated."""
            nonlocal owned
            first = next(iter(late.values())).own_addr
            end = time.monotonic() + wait_ms / 1000
            while True:
                took = [c for c in late.values() if c.own.value == OWN_COLL]
                if took or time.monotonic() >= end:
                    break
                lib.conn_await(first, 1000)  # (another one's hand-over is seen within 1 ms)
            if took:
                peers = {c.peer for c in took}
                for peer in peers:
                    del late[peer]
                owned = owned + took  # released by the caller from here on, whatever happens
                withdraw(peers, deadline)
                take_early(peers)
                set_gate(peers, 0)

        def drop_late(peers: set[int], until: float) -> None:
            """Give the claims on ``peers`` up: their targets first (a frame a reader fills into
            one gets until ``until``, then its connection is shut), then the claims (a reader
            could otherwise go on to a next frame for a target still posted)."""
            withdraw(peers, until)
            for peer in peers:
                lib.conn_unclaim(late.pop(peer).own_addr)

        # Send locks: a peer's is held only while this transfer has a frame for that peer
        # part-way sent or ready to go. Held across a wait for a receive or a gate (a piece of
        # the pipelined allreduce), it deadlocked two groups sharing the connections: each
        # rank's transfer of one group held the lock its other group's send needed, while
        # waiting for a frame that the peer's other group could not send for the same reason
        # (two threads, one group each: 0 of 200 allreduces, then the group timeout).
        locked: list[Connection] = []
        held: set[threading.Lock] = set()
        by_peer: dict[int, list[int]] = {}
        for i, xs in enumerate(sends):
            by_peer.setdefault(xs.peer, []).append(i)
        head = dict.fromkeys(by_peer, 0)  # per peer: the index in by_peer of its next send

        def may_start(i: int) -> bool:
            xs = sends[i]
            if xs.gate and xs.gate in gates:
                return False
            return xs.after < 0 or all(received(j) for j in range(xs.after_from, xs.after + 1))

        def take(peer: int) -> None:
            conn = conns[peer]
            held.add(conn.lock)
            locked.append(conn)
            for i in by_peer[peer][head[peer] :]:
                xs = sends[i]
                ops[OPW * i + 8] = 1 if xs.gate and xs.gate in gates else 0

        def relock() -> int:
            """Release the send locks of peers with nothing left to send or whose next frame
            waits (not begun), take those of peers whose next frame may go now; returns a
            peer whose lock another thread holds (-1: none), for an idle loop to wait on."""
            busy = -1
            for peer, idx in by_peer.items():
                k = head[peer]
                while k < len(idx) and ops[OPW * idx[k] + 5] >= HEADER_SIZE + sends[idx[k]].size:
                    k += 1
                head[peer] = k
                conn = conns[peer]
                if conn.lock in held:
                    if k == len(idx) or (ops[OPW * idx[k] + 5] == 0 and not may_start(idx[k])):
                        for i in idx[k:]:
                            ops[OPW * i + 8] = 1
                        held.discard(conn.lock)
                        locked.remove(conn)
                        conn.lock.release()
                elif k < len(idx) and may_start(idx[k]):
                    if conn.lock.acquire(blocking=False):
                        take(peer)
                    elif busy < 0:
                        busy = peer
            return busy

        lost: list[tuple[Connection, BaseException]] = []  # reported once the locks are free
        broken: set[int] = set()  # sockets whose stream is unreadable (a frame cut short)
        pinned = counted = False
        settle_by = deadline
        try:  # from here on the sockets are owned: every error path must release them
            # Frames read by the reader threads before we owned the sockets. Never one for a
            # reused slot (the pipelined allreduce): its sender waits for a frame that this
            # transfer sends.
            if self.mailbox.queued():
                take_early(None)
                # a claimed socket whose receives all came through the mailbox: nothing to wait for
                drop_late(
                    {
                        p
                        for p in late
                        if all(received(j) for j, x in enumerate(recvs) if x.peer == p)
                    },
                    deadline,
                )
            # A sender migrating between CPUs mid-stream reorders loopback segments, which TCP
            # takes for loss (retransmits, 200 ms stalls): pin this thread while it sends, to
            # its rank's own CPU. A large receive pins too: the receiver stays on its rank's
            # CPU, at two ranks not its sender's (broadcast 1 MB w2, 15-23 alternated rounds:
            # 0.85x gloo with only senders pinned, 0.98x with receivers too, 0.91x before).
            moved = sum(xs.size for xs in sends) + sum(x.size for x in recvs)
            if moved >= PIN_BYTES:
                counted = True
                pinned = lib.pin(self._pin_begin()) >= 0
            # the abort/deadline/close checks run at least once a slice: a NOTIFY return (a
            # piece in) restarts the native loop's slice, so pieces arriving faster than
            # SLICE_MS would otherwise keep them from ever running
            checked = time.monotonic()
            while True:
                busy = relock() if sends else -1
                # a handed-over socket is noticed between native calls: short ones meanwhile
                rc = lib.xfer(ops, n, LATE_SLICE_MS if late else SLICE_MS, out)
                if late:
                    adopt(SLICE_MS if rc == IDLE else 0)
                if rc == IDLE:
                    if busy >= 0 and not late:
                        # another thread holds the connection (a sender thread's frame to a
                        # peer that stopped reading may hold it long): the group's abort,
                        # failure and deadline still end the wait
                        conn = conns[busy]
                        if conn.lock.acquire(timeout=LOCK_POLL_S):
                            take(busy)
                        elif time.monotonic() > deadline:
                            watch()
                            raise CommTimeoutError(
                                f"rank {self.rank}: a transfer timed out waiting to send to "
                                f"rank {busy} (its connection was busy with another frame)"
                            )
                    rc = SLICE
                if rc == DONE:
                    break
                if rc == SENT:
                    for conn in locked:
                        conn.lock.release()
                    locked.clear()
                    held.clear()
                    continue
                if rc == NOTIFY:
                    if not bad:  # (a mismatch settled by adopt: nothing notifies any more)
                        notify(int(out[0]) - ns)
                    if time.monotonic() - checked < SLICE_MS / 1000:
                        # the group's error flag only: an abort on this rank is seen at the
                        # next piece in, not at the end of the slice
                        watch()
                        continue
                    rc = SLICE
                if rc == SLICE:
                    checked = time.monotonic()
                    owned = self._release_done(ops, ns, n, owned)
                    watch()
                    if self.closed:
                        raise CommError(f"rank {self.rank}: mesh closed during a transfer")
                    if time.monotonic() > deadline:
                        raise CommTimeoutError(f"rank {self.rank}: a transfer timed out")
                    continue
                i = int(out[0])
                peer = recvs[i - ns].peer if i >= ns else sends[i].peer if i >= 0 else -1
                conn = conns.get(peer)
                if rc == FOREIGN and conn is not None:
                    j = i - ns
                    raw = ctypes.string_at(hbase + HEADER_SIZE * (ns + 2 * j) + 64, 64)
                    ops[OPW * i + 5] = 0  # that frame is read here; the expected one comes next
                    self._route_foreign(conn, raw, deadline, watch, lost, broken)
                    frame = self.mailbox.take(recvs[j].key)
                    if frame is not None:
                        frames[j], ok = _settle(frame, recvs[j], conn.spares)
                        ops[OPW * i + 5] = HEADER_SIZE + recvs[j].size
                        bad = bad or not ok
                        if ok and not bad and ops[OPW * i + 9] == 1:
                            ops[OPW * i + 9] = 2
                            notify(j)
                    if bad:  # also a receive that started after the mismatch
                        _skip_receives(ops, ns, n)
                    watch()
                    continue
                why = "closed by peer" if rc == CLOSED else f"errno {-rc}"
                if conn is not None and conn.left:  # (its reader ends the connection)
                    raise _left(self.rank, peer, "receiving from" if i >= ns else "sending to")
                if conn is not None:
                    lost.append((conn, ConnectionError(why)))
                raise CommError(f"connection to rank {peer} lost: {why}")
            now = time.monotonic()
            for conn in owned:
                conn.seen = now
            for j, x in enumerate(recvs):
                if not bad and frames[j] is None and received(j):
                    frames[j] = (Header(Kind.COLL, x.group, x.peer, x.seq, x.sig, x.size), RECEIVED)
        except BaseException as e:
            finish = FINISH_S
            if aborting:
                finish = ABORT_FINISH_S
            elif isinstance(e, CommTimeoutError):
                finish = TIMEOUT_FINISH_S
            settle_by = time.monotonic() + finish
            if late:  # before on_cut reports the failure: no reader fills the caller's buffer
                drop_late(set(late), settle_by)
            # one budget for both (an abort still fails the call within ABORT_FINISH_S)
            finish_s = max(0.0, settle_by - time.monotonic())
            owned = self._finish_partial(
                ops, n, owned, e, lost, broken, finish_s, locked, on_cut if aborting else None
            )
            raise
        finally:
            if pinned:
                lib.pin(-2)
            if counted:
                self._pin_end()
            for conn in locked:
                conn.lock.release()
            # Only now (no send lock held): a group's failure handler sends ABORT frames.
            for conn, err in lost:
                self._lost(conn, err)
            for conn in owned:
                lib.conn_release(conn.own_addr)
            if late:  # (a mismatch settled them) the readers keep those sockets; a frame one
                # still reads into a target gets as long as one part-way received by this thread
                drop_late(set(late), min(settle_by, time.monotonic() + FINISH_S))
        return frames

    def _release_done(
        self, ops: ctypes.Array, ns: int, n: int, owned: list[Connection]
    ) -> list[Connection]:
        """Give the sockets with no receive left in this transfer back to their reader threads
        (the transfer still sends on them); returns the connections still owned. An owned
        socket is read only for this transfer's receives, so once they are in, a frame the peer
        sends next would sit unread until the transfer ends -- an ABORT too: a rank whose
        frame from a failed peer is in, waiting for one from a rank that learned of the
        failure before its own call (and so sends nothing), would otherwise never hear of it
        and wait for its deadline."""
        lib = tcp_lib()
        fds = (ctypes.c_int64 * MAXFD)()
        pending = set(fds[: lib.open_fds(ops, ns, n, fds, MAXFD)])
        if all(c.sock.fileno() in pending for c in owned):
            return owned
        now, keep = time.monotonic(), list[Connection]()
        for conn in owned:
            if conn.sock.fileno() in pending:
                keep.append(conn)
            else:
                conn.seen = now
                lib.conn_release(conn.own_addr)
        return keep

    def _finish_partial(
        self,
        ops: ctypes.Array,
        n: int,
        owned: list[Connection],
        error: BaseException,
        lost: list[tuple[Connection, BaseException]],
        broken: set[int],
        finish_s: float,
        locked: list[Connection],
        on_cut: Callable[[], None] | None,
    ) -> list[Connection]:
        """After ``error``: complete every frame already part-way sent or received, for up to
        ``finish_s`` (``FINISH_S``; ``ABORT_FINISH_S`` after an abort, ``TIMEOUT_FINISH_S``
        after a timeout) -- a frame cut short corrupts the stream (the peer's reader, or
        ours, would take payload bytes for a header). Sockets with no frame part-way received
        go back to their readers at once (peers' frames keep draining), the others once their
        frame is in. A connection whose frame does not complete in time is shut down
        deliberately, with an error saying why queued in ``lost``, as is one in ``broken``
        (its stream already unreadable); returns the connections still owned (those), for
        the caller to release after it reported the loss."""
        lib = tcp_lib()
        # one native pass over the table (a pipelined allreduce in small pieces has thousands of
        # operations): the frames part-way stay, one per socket and way; the rest count as done
        bad = (ctypes.c_int64 * max(len(broken), 1))(*sorted(broken))
        idx = (ctypes.c_int64 * n)()
        rows = idx[: lib.settle(ops, n, bad, len(broken), idx, n)]
        reading = {ops[OPW * i] for i in rows if ops[OPW * i + 1] == 1}
        by_fd = {c.sock.fileno(): c for c in owned}
        for fd, conn in by_fd.items():
            if fd not in reading and fd not in broken:
                lib.conn_release(conn.own_addr)
        sink = None
        if on_cut is not None:
            # the rest of every frame part-way received lands in scratch, not the caller's
            # buffer, so the operation may fail (on_cut) before those frames complete
            got = {i: max(ops[OPW * i + 5] - HEADER_SIZE, 0) for i in rows if ops[OPW * i + 1]}
            if got:
                sink = ctypes.create_string_buffer(
                    max(ops[OPW * i + 4] - k for i, k in got.items())
                )
                for i, k in got.items():
                    ops[OPW * i + 3] = ctypes.addressof(sink) - k

        def undone(i: int) -> bool:
            return ops[OPW * i + 5] < HEADER_SIZE + ops[OPW * i + 4]

        sending = [i for i in rows if ops[OPW * i + 1] == 0]
        pending_cut = [on_cut]

        def unlock() -> None:
            # once the frames part-way sent are whole (a send still reads the caller's tensor):
            # the send locks go (the group's ABORT frames may follow those frames), then the
            # operation fails -- its Work's callbacks run with no lock of this transfer held
            if any(undone(i) for i in sending):
                return
            for conn in locked:
                conn.lock.release()
            locked.clear()
            report, pending_cut[0] = pending_cut[0], None
            if report is not None:
                report()

        unlock()
        if rows:
            out = (ctypes.c_int64 * 1)()
            end = time.monotonic() + finish_s
            rc = SLICE
            while rc in (SLICE, SENT, FOREIGN) and time.monotonic() < end and not self.closed:
                rc = lib.xfer(ops, n, SLICE_MS, out)
                unlock()
                if rc != FOREIGN:
                    continue
                # a header completed here belongs to another frame: route it as the reader would
                i = int(out[0])
                fd = ops[OPW * i]
                ops[OPW * i + 5] = HEADER_SIZE + ops[OPW * i + 4]
                raw = ctypes.string_at(ops[OPW * i + 7], HEADER_SIZE)
                try:
                    self._route_foreign(by_fd[fd], raw, end, lambda: None, lost, broken)
                except Exception:  # queued in lost; its other frames are given up
                    for k in rows:
                        if ops[OPW * k] == fd:
                            ops[OPW * k + 5] = HEADER_SIZE + ops[OPW * k + 4]
        cut: dict[int, str] = {}
        for i in rows:
            if undone(i):
                cut.setdefault(ops[OPW * i], "sent" if ops[OPW * i + 1] == 0 else "received")
        for conn in list(self.peers.values()):
            fd = conn.sock.fileno()
            if fd in cut or fd in broken:
                self.shutdown_peer(conn.peer)
            if fd in cut:
                lost.append((conn, _cut(cut[fd], error)))
        del sink  # (the scratch outlives the loop that fills it)
        stuck = []
        for fd in reading | (broken & by_fd.keys()):
            if fd in cut or fd in broken:
                stuck.append(by_fd[fd])
            else:
                lib.conn_release(by_fd[fd].own_addr)
        return stuck

    def _route_foreign(
        self,
        conn: Connection,
        raw: bytes,
        deadline: float,
        check: Callable[[], None],
        lost: list[tuple[Connection, BaseException]],
        broken: set[int],
    ) -> None:
        """Read the rest of a frame the native loop found where it expected another (header
        ``raw``) and route it as the reader thread would; its payload is read in slices
        (:func:`recv_bounded`: ``check()`` between them, :class:`CommTimeoutError` past
        ``deadline``). On failure the stream is unreadable: the socket joins ``broken`` (the
        transfer shuts it down), the loss is queued in ``lost`` and the error propagates."""
        try:
            hdr = decode_header(raw, max_length=self.max_frame)
            if hdr.flags & FLAG_RING:
                fill = functools.partial(self._ring_read, conn, deadline=deadline, check=check)
            else:
                fill = functools.partial(recv_bounded, conn.sock, deadline=deadline, check=check)
            self._take_frame(conn, hdr, fill)
        except BaseException as e:
            broken.add(conn.sock.fileno())
            if isinstance(e, (OSError, WireError)) and not isinstance(e, CommTimeoutError):
                lost.append((conn, e))
                raise CommError(f"connection to rank {conn.peer} lost: {e}") from e
            lost.append((conn, _cut("received", e)))  # stopped by check() or the deadline
            raise

    def _goodbye(self, conn: Connection) -> None:
        """``conn.peer`` left (its GOODBYE frame, read after every other byte it sent): the
        end of its stream that follows is no loss. A frame of its not delivered by now never
        comes: waits for one fail (:class:`PeerLeftError`; ``Mailbox.get``, and each group's
        ``on_peer_left`` for its posted receives), as do sends to it."""
        conn.left = True
        with self.mailbox.cond:
            self.mailbox.left.add(conn.peer)
            self.mailbox.cond.notify_all()
        for handler in list(self._handlers.values()):
            on_left = getattr(handler, "on_peer_left", None)
            if on_left is not None:
                on_left(conn.peer)

    def _group_goodbye(self, peer: int, group: int) -> None:
        """``peer`` closed ``group`` (its goodbye for it, read after every frame of the group
        it sent here): waits for its frames of the group fail (:class:`PeerLeftError`;
        ``Mailbox.get``, :meth:`transfer`, and the group's ``on_peer_left`` for its posted
        receives), as do sends to it there; the connection and its other groups go on. Kept
        for a group not registered here yet (the peer built and closed it first); one that
        closed here already is done with."""
        with self._lock:
            handler = self._handlers.get(group)
            if handler is None and group in self._retired:
                return
            with self.mailbox.cond:
                self.mailbox.left_groups.add((group, peer))
                self.mailbox.cond.notify_all()
        on_left = getattr(handler, "on_peer_left", None)
        if on_left is not None:
            on_left(peer)

    def send_group_goodbye(self, peer: int, group: int) -> None:
        """Tell global rank ``peer`` that ``group`` closed here (``GROUP_GOODBYE_SEQ``), after
        every frame of it sent there, without waiting behind a frame being sent to it (as
        :meth:`send_abort`). Call once the group sends nothing more."""
        head = encode_header(Kind.CTRL, group, self.rank, GROUP_GOODBYE_SEQ, 0)
        self._send_header(peer, head, "tp-goodbye")

    def leave(self, wait_s: float = LEAVE_S, settled_s: float = LEAVE_SETTLED_S) -> None:
        """Close the mesh so that its peers can tell it from a crash: on every connection a
        GOODBYE frame after every byte sent there (under the send lock, which a frame part-way
        out holds until its end), then the end of this side's stream (``SHUT_WR``). The reader
        threads go on draining what the peers still send -- a socket closed with unread bytes
        resets the connection, which drops what this side has not sent yet -- until each
        peer ends its side (its reader does once it read the goodbye), for up to ``wait_s``
        in all, or ``settled_s`` once the peers' hosts acknowledged every goodbye
        (:func:`unacked_bytes`: a peer reads what its host took, even after a reset, so only a
        peer that does not end its side, a stopped one, waits past that); then :meth:`close`,
        which joins the threads. A connection whose send lock or socket stays busy for
        ``wait_s`` (a peer that stopped reading) gets no goodbye: to that peer the close is a
        loss, as before."""
        if self.closed:
            return
        self.leaving = True
        start = time.monotonic()
        end = start + wait_s
        for conn in list(self.peers.values()):
            # a peer that left first ends its stream, and this side's ends when that is read
            if conn.left or conn.ended.is_set():  # (ended: the connection was lost)
                continue
            try:
                self.send(conn.peer, Kind.CTRL, GOODBYE_GROUP, 0, deadline=end)
            except CommError:  # (CommTimeoutError too)
                continue
            # (the goodbye's rest, if a thread finishes it, goes before the end of the stream)
            if conn.lock.acquire(timeout=max(0.0, end - time.monotonic())):
                try:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_WR)
                finally:
                    conn.lock.release()
        settled = start + settled_s
        while True:
            waiting = [c for c in self.peers.values() if not c.ended.is_set()]
            now = time.monotonic()
            if not waiting or now >= end:
                break
            if now >= settled and not any(unacked_bytes(c.sock) for c in waiting):
                break
            waiting[0].ended.wait(min(LEAVE_POLL_S, end - now))
        self.close()

    def on_note(self, peer: int, seq: int, body: bytearray) -> None:
        """A NOTE frame (beats and fault notices of elastic groups; see ``ElasticMesh``)."""
        raise WireError(f"unexpected NOTE frame from rank {peer} on a fixed mesh")

    def shutdown_peer(self, peer: int) -> None:
        """Shut the connection to ``peer`` down (ends a receive stuck in its reader)."""
        conn = self.peers.get(peer)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            self._close_rings(conn)

    def register(self, group: int, handler: GroupHandler) -> None:
        """Route ``group``'s ABORT frames and lost peers to ``handler``; an ABORT that arrived
        before (the peer failed the group first) is handed to it now."""
        with self._lock:
            self._handlers[group] = handler
            self._retired.discard(group)
            self.mailbox.revive(group)
            early = self._early_aborts.pop(group, None)
        if early is not None:
            handler.on_remote_abort(*early)
            self.mailbox.wake()

    def _is_current(self, group: int, handler: object) -> bool:
        """Whether ``handler`` (or the communicator a wrapper routes to) is ``group``'s."""
        h = self._handlers.get(group)
        return h is not None and (h is handler or getattr(h, "comm", None) is handler)

    def unregister(self, group: int, handler: object = None) -> None:
        """The group closed: its ABORTs are no longer kept and its frames are purged and
        dropped (:meth:`Mailbox.kill`). With ``handler``, only while it is still the one
        registered (a new group of the same id may have replaced it)."""
        with self._lock:
            if handler is not None and not self._is_current(group, handler):
                return
            if self._handlers.pop(group, None) is not None:
                self._retired.add(group)
                self.mailbox.kill(group)
                with self.mailbox.cond:  # (its peers' goodbyes for it are done with too)
                    self.mailbox.left_groups -= {
                        k for k in self.mailbox.left_groups if k[0] == group
                    }

    def bury(self, group: int, handler: object) -> None:
        """``handler``'s group failed (aborted, a peer lost or failed it): purge its queued
        frames and drop later ones (nothing takes them; they stayed until the process
        exited). The handler stays registered (ABORTs still reach it)."""
        with self._lock:
            if self._is_current(group, handler):
                self.mailbox.kill(group)

    def close(self) -> None:
        """Close the listener and every connection; the acceptor and the reader threads end
        (waited for up to ``JOIN_S``, unless called on one of them)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # (ends an accept waiting in it at once)
        with contextlib.suppress(OSError):
            self.listener.close()
        conns = list(self.peers.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            self._close_rings(conn, clean=True)
        self.mailbox.wake()
        # the readers first, then the sockets: a descriptor closed under a reader thread could
        # be reused by a new socket that thread would then read from
        end = time.monotonic() + JOIN_S
        acceptor = getattr(self, "_acceptor", None)
        if acceptor is not None and acceptor is not threading.current_thread():
            acceptor.join(max(0.0, end - time.monotonic()))
        mine = on_reader_thread()
        for conn in conns:
            if not mine:
                conn.ended.wait(max(0.0, end - time.monotonic()))
            if conn.ended.is_set() or mine:
                conn.sock.close()
