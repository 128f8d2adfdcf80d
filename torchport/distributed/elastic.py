"""Torchport communicators formed, shrunk and grown in place over a long-lived mesh.

``init_process_group("torchport", enable_reconfigure=True)`` and the fault-tolerance manager
(:mod:`torchport.distributed.ft`) need communicators whose membership changes while the process
lives. Each such process owns one :class:`ElasticMesh`: a listener plus authenticated TCP
connections (the same handshake and frames as the backend's
:class:`~torchport.distributed.transport_tcp.Mesh`) to the processes it has shared a group with.
Processes are named by a random 31-bit *member id* instead of a rank, so ids stay valid across
reconfigurations and a restarted process (new id) never collides with its previous life.

:func:`form_group` builds a :class:`~torchport.distributed.backend.TorchportProcessGroup` for an
ordered member list:

1. connections: live connections are reused; a missing one is dialled by the member with the
   higher id (the lower one accepts), so shrinking opens no connection and growing opens only the
   new members' ones;
2. a rendezvous over the mesh that doubles as a barrier: member 0 offers a fresh shared-memory
   arena when every member runs on this host (or none), waits for every member's
   acknowledgement, unlinks the arena (a crash leaves nothing in ``/dev/shm`` except within that
   exchange) and only then tells everyone to go. The offer carries the attempt's token (frames
   of an earlier attempt under the same name are told apart and dropped) and a digest of
   member 0's member order (a member given another order refuses, and member 0 aborts the
   attempt on every member);
3. a :class:`~torchport.distributed.engine.Communicator` under a group id derived from the
   group's name (unique per reconfiguration), ranks = positions in the member list.

A lost connection (crashed peer) fails every communicator that contains the peer at once; the
connection is dropped so that later groups never use it.

The mesh also carries what failure detection needs, so a reconfigurable group opens no extra
connection to watch its members: :meth:`ElasticMesh.beat` sends an empty ``NOTE`` frame to every
connected peer (never blocking: a peer whose connection is busy or full is skipped, the frames in
flight prove liveness as well), every received frame refreshes ``Connection.seen``, a lost
connection is reported to ``on_lost`` and a ``NOTE`` with a payload (a fault notice, sent by
:meth:`ElasticMesh.notify`) to ``on_notice``. A notice travels on the same ordered connection as
the ABORT frames that follow it, so the receiver learns the cause before the abort.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchport import config
from torchport.distributed import engine
from torchport.distributed._threads import WarmPool, in_background
from torchport.distributed.backend import TorchportProcessGroup
from torchport.distributed.engine import Communicator
from torchport.distributed.errors import (
    CommAbortedError,
    CommError,
    CommTimeoutError,
    clip_repr,
    is_int,
)
from torchport.distributed.groups import group_id_for, host_id
from torchport.distributed.shm_kernels import shm_lib
from torchport.distributed.transport_shm import ShmArena
from torchport.distributed.transport_tcp import Connection, Mesh
from torchport.distributed.wire import Kind, encode_header

_OFFER, _ACK, _GO = 1, 2, 3  # seq of the control frames of the formation rendezvous
MAX_NOTICE = 4096  # bytes of a fault notice's text; a longer NOTE is dropped


def _sizes() -> tuple[int, int, int]:
    """(shm chunk, arena slot bytes, tcp chunk), chosen as the backend's group builder does.

    Read defensively so this module follows the backend's layout (an engine that reserves
    ``SLOT_EXTRA`` bytes per slot, a separate TCP step size) whichever version it runs with.
    """
    chunk = int(config.get("dist_chunk_bytes"))
    extra = int(getattr(engine, "SLOT_EXTRA", 0))
    tcp = (
        int(config.get("dist_tcp_chunk_bytes"))
        if "dist_tcp_chunk_bytes" in config.SETTINGS
        else chunk
    )
    return chunk, chunk + extra, tcp


@dataclass(frozen=True)
class Member:
    """Where a member's mesh listens: its id, address, and host identity."""

    id: int
    host: str
    port: int
    host_id: str

    def to_json(self) -> list[Any]:
        return [self.id, self.host, self.port, self.host_id]

    @staticmethod
    def from_json(v: Any) -> Member:
        """The member a peer's ``[id, host, port, host_id]`` record names; :class:`CommError`
        for any other value (an ``int()`` of a peer's string raised a bare ValueError, which
        the callers' retry on CommError let through)."""
        if not (isinstance(v, list) and len(v) == 4):
            raise CommError(f"member record must be [id, host, port, host_id], got {clip_repr(v)}")
        mid, host, port, hid = v
        if not (is_int(mid) and 0 <= mid < 1 << 31):
            raise CommError(
                f"member record's id must be an int in [0, 2**31), got {clip_repr(mid)}"
            )
        if not (isinstance(host, str) and host):
            raise CommError(
                f"member record's host must be a non-empty string, got {clip_repr(host)}"
            )
        if not (is_int(port) and 0 < port < 1 << 16):
            raise CommError(
                f"member record's port must be an int in [1, 65535], got {clip_repr(port)}"
            )
        if not isinstance(hid, str):
            raise CommError(f"member record's host_id must be a string, got {clip_repr(hid)}")
        return Member(mid, host, port, hid)


class ElasticMesh(Mesh):
    """A mesh of processes named by member ids, connected on demand (see module docstring).

    Args:
        secret: job secret authenticating every connection (both ways).
        addr: listening address; default ``TORCHPORT_DIST_ADDR``.
    """

    def __init__(self, secret: bytes, addr: str | None = None) -> None:
        # Mesh.__init__ builds a fixed world from a store; this mesh fills itself lazily.
        _, slot, tcp = _sizes()
        self._init_state(
            secrets.randbelow((1 << 31) - 2) + 1,
            1 << 32,  # accept any id above ours (the handshake's rank check)
            secret,
            max(int(config.get("dist_max_frame_bytes")), max(slot, tcp) + 4096),
            addr or str(config.get("dist_addr")),
            backlog=64,
        )
        host, port = self.address.rsplit(":", 1)
        self.me = Member(self.rank, host, int(port), host_id())
        self.hosts: dict[int, str] = {self.rank: self.me.host_id}
        # handshakes, readers and dials run on warm threads: no thread start while forming
        self._warm = WarmPool(16)
        self._dials: dict[int, tuple[threading.Event, list[BaseException]]] = {}
        self.on_lost: Callable[[int], None] | None = None  # member id whose connection was lost
        self.on_notice: Callable[[int, int, bytes], None] | None = None  # (member, seq, text)
        self._beat = encode_header(Kind.NOTE, 0, self.rank, 0, 0)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="tp-accept")
        self._acceptor.start()
        shm_lib()  # build/load the native step kernels now, not while a group is forming

    def register(self, group: int, handler: Any) -> None:
        super().register(group, _RankNaming(handler))

    def _read_loop(self, conn: Connection) -> None:
        super()._read_loop(conn)
        with self._lock:  # a lost connection is never reused
            live = self.peers.get(conn.peer) is conn
            if live:
                del self.peers[conn.peer]
        with contextlib.suppress(OSError):
            conn.sock.close()
        cb = self.on_lost
        if live and cb is not None and not self.closed:
            cb(conn.peer)

    def _spawn(self, fn: Callable[..., None], *args: Any, name: str) -> None:
        self._warm.run(fn, *args)

    def refill(self) -> None:
        """Top the warm threads up again (call after a group formed, off the critical path)."""
        self._warm.refill()

    def close(self) -> None:
        super().close()
        self._warm.close()

    def on_note(self, peer: int, seq: int, body: bytearray) -> None:
        cb = self.on_notice
        if body and cb is not None and len(body) <= MAX_NOTICE:
            cb(peer, seq, bytes(body))

    def beat(self) -> None:
        """Send a liveness beat to every connected peer; never blocks (see module docstring)."""
        for conn in list(self.peers.values()):
            if not conn.lock.acquire(blocking=False):
                continue  # a frame is being sent on it: that frame is the beat
            handed = False
            try:
                n = conn.sock.send(self._beat, socket.MSG_DONTWAIT)
                if 0 < n < len(self._beat):  # keep the stream framed (rare: a full buffer)
                    # the rest from a thread of its own, which keeps the lock until it is
                    # out: a peer that stopped reading holds that thread, not the beats to
                    # every other peer (their silence would make this member look hung)
                    handed = self._hand_rest(conn, self._beat[n:], "tp-beat")
            except OSError:
                pass  # full (the peer is not reading) or lost (its reader reports that)
            finally:
                if not handed:
                    conn.lock.release()

    def notify(self, peer: int, seq: int, text: str, deadline: float) -> None:
        """Send a fault notice (``text``, at most ``MAX_NOTICE`` bytes) to member ``peer``,
        waiting for its connection until ``deadline`` at most (:class:`CommTimeoutError`)."""
        self.send(peer, Kind.NOTE, 0, seq, text.encode()[:MAX_NOTICE], deadline=deadline)

    def dial(self, m: Member, deadline: float) -> bool:
        """Start dialling ``m`` in the background if this member is the one to dial it.

        Returns whether a new dial was started. Used to open connections while a reconfigure is
        still validating; :meth:`ensure` waits for the dial and reports its failure.
        """
        with self._lock:
            if m.host_id:  # empty: not known yet (a dial started from a handle)
                self.hosts[m.id] = m.host_id
            old = self._dials.get(m.id)
            if old is not None and old[1] and old[0].is_set():
                del self._dials[m.id]  # an earlier dial failed: try again
            if m.id >= self.rank or m.id in self.peers or m.id in self._dials:
                return False
            box: list[BaseException] = []
            done = threading.Event()

            def run() -> None:
                try:
                    self._connect(m.id, m.host, m.port, deadline)
                except BaseException as e:  # reported by ensure()
                    box.append(e)
                finally:
                    done.set()
                    with self._ready:
                        self._ready.notify_all()

            self._dials[m.id] = (done, box)
        self._warm.run(run)
        return True

    def ensure(self, members: Sequence[Member], deadline: float, check: Callable[[], None]) -> int:
        """Connect to every member not yet connected; returns the number of connections dialled.

        Of two members the one with the higher id dials (the handshake accepts only higher ids),
        so a pair never opens two connections. All dials run concurrently (and may have been
        started earlier by :meth:`dial`).
        """
        mine: list[int] = []
        for m in members:
            self.dial(m, deadline)
            with self._lock:
                if m.id in self._dials:
                    mine.append(m.id)
        fresh = 0
        for mid in mine:
            with self._lock:
                entry = self._dials.get(mid)
            if entry is None:
                continue
            done, box = entry
            done.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._dials.get(mid) is entry and done.is_set():
                    del self._dials[mid]
            if box:
                raise box[0]
            fresh += 1
        want = {m.id for m in members if m.id != self.rank}
        with self._ready:
            while not want <= set(self.peers):
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(want - set(self.peers))
                    raise CommTimeoutError(f"members {missing} did not connect in time")
                self._ready.wait(min(left, 0.01))
        return fresh


class _RankNaming:
    """Routes mesh events to a communicator, naming a lost peer by its rank in that group."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def on_remote_abort(self, src: int, reason: int) -> None:
        self.comm.on_remote_abort(src, reason)

    def on_peer_lost(self, src: int, error: BaseException) -> None:
        ranks = getattr(self.comm, "ranks", [])
        if src in ranks:
            cause = str(error).rsplit(": ", 1)[-1]
            error = CommError(
                f"rank {ranks.index(src)} of group {self.comm.name!r} lost its connection "
                f"(member {src}): {cause}"
            )
        self.comm.on_peer_lost(src, error)


# Every formation attempt is told apart by a token that member 0 draws from this counter (a
# process's tokens only grow, and a restarted process has a new member id): the control frames
# of an attempt that failed stay queued at the members it reached, keyed like the retry's
# (same group name, same member 0), and a retry under the same name took them for its own.
_attempts = itertools.count(1)
_TOKEN = struct.Struct("<QQ")  # OFFER: token, digest of the member order; then the arena path
_VERDICT = struct.Struct("<QB")  # ACK: token, status; GO: token, verdict; then a reason
_GO_AHEAD, _STALE, _ABORT = 0, 1, 2  # GO verdicts ("stale": your offer is an old attempt's)


def _order_digest(ids: list[int]) -> int:
    """64-bit digest of a member order (ranks = positions: every member must hold the same)."""
    raw = b"".join(i.to_bytes(4, "little") for i in ids)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _unpack(frame_kind: str, fmt: struct.Struct, body: bytearray, src: int) -> tuple[Any, ...]:
    if len(body) < fmt.size:
        raise CommError(
            f"{frame_kind} frame from member {src} has {len(body)} bytes, fewer than "
            f"{fmt.size} (every member must run the same torchport)"
        )
    return (*fmt.unpack_from(body), bytes(body[fmt.size :]).decode(errors="replace"))


def _rendezvous(
    mesh: ElasticMesh,
    gid: int,
    ids: list[int],
    rank: int,
    slot: int,
    local: bool,
    deadline: float,
    check: Callable[[], None],
) -> ShmArena | None:
    """Member 0 offers an arena path (or none), collects every ack, then says go.

    The final "go" makes formation a barrier: no member finishes (and, in a reconfigure,
    rotates its handle) before every member has validated and joined. The offer carries the
    attempt's token and a digest of member 0's member order: a member holding another order
    (ranks would repeat) refuses, and member 0 then aborts the attempt on every member. A
    member that took an earlier attempt's offer (its ack names an old token) is told the
    current token and takes the offers up to it; frames of old attempts are dropped.
    """
    ctrl = int(Kind.CTRL)
    digest = _order_digest(ids)
    if rank == 0:
        token = next(_attempts)
        arena = ShmArena(ShmArena.new_path(), len(ids), 0, slot, create=True) if local else None
        try:
            path = arena.path.encode() if arena is not None else b""
            offer = _TOKEN.pack(token, digest) + path
            for g in ids[1:]:
                mesh.send(g, Kind.CTRL, gid, _OFFER, offer, deadline=deadline, check=check)
            refusal = None
            for g in ids[1:]:
                while refusal is None:
                    _, body = mesh.mailbox.get((gid, ctrl, g, _ACK), deadline, check)
                    got, status, why = _unpack("ACK", _VERDICT, body, g)
                    if got == token:
                        if status:
                            refusal = f"{why} (member {ids[0]}'s order: {ids})"
                        break
                    stale = _VERDICT.pack(token, _STALE)  # (or a late ack of an old attempt)
                    mesh.send(g, Kind.CTRL, gid, _GO, stale, deadline=deadline, check=check)
            if refusal is not None:
                end = _VERDICT.pack(token, _ABORT) + refusal.encode()
                for g in ids[1:]:  # every member fails now, not at its timeout
                    with contextlib.suppress(CommError, CommTimeoutError):
                        mesh.send(g, Kind.CTRL, gid, _GO, end, deadline=deadline, check=check)
                raise CommError(f"the formation was abandoned: {refusal}")
        except BaseException:
            if arena is not None:
                arena.close()
            raise
        finally:
            if arena is not None:
                arena.unlink()
        try:
            go = _VERDICT.pack(token, _GO_AHEAD)
            for g in ids[1:]:
                mesh.send(g, Kind.CTRL, gid, _GO, go, deadline=deadline, check=check)
        except BaseException:
            if arena is not None:  # (not left mapped until the collector finds it)
                arena.close()
            raise
        return arena
    lead, floor = ids[0], 0
    while True:  # once per offer taken (a later one only after an old attempt's)
        while True:
            _, body = mesh.mailbox.get((gid, ctrl, lead, _OFFER), deadline, check)
            token, theirs, path = _unpack("OFFER", _TOKEN, body, lead)
            if token >= floor:
                break
        arena, refusal = None, ""
        if theirs != digest:
            refusal = (
                f"member {mesh.rank} was given the member order {ids}, not member {lead}'s "
                "(ranks are positions in the order: every rank must pass the handles in the "
                "same order)"
            )
        elif path:
            try:
                arena = ShmArena(path, len(ids), rank, slot, create=False)
            except (OSError, CommError) as e:  # (an old attempt's is gone: CommError)
                refusal = f"cannot map the arena of member {lead}: {e}"
        try:
            ack = _VERDICT.pack(token, 1 if refusal else 0) + refusal.encode()
            mesh.send(lead, Kind.CTRL, gid, _ACK, ack, deadline=deadline, check=check)
            while True:
                _, body = mesh.mailbox.get((gid, ctrl, lead, _GO), deadline, check)
                got, verdict, why = _unpack("GO", _VERDICT, body, lead)
                if got < token or (got == token and verdict == _STALE):
                    continue  # an old attempt's, or the answer to an old attempt's ack
                if verdict == _ABORT:  # (this member's own refusal, or another's)
                    mine = refusal if got == token else ""
                    raise CommError(mine or f"member {lead} abandoned the formation: {why}")
                if verdict == _STALE:  # this offer was an old attempt's
                    break
                if got != token or refusal:  # (member 0 goes ahead only on this ack)
                    raise CommError(f"member {lead} went ahead with attempt {got}, not {token}")
                return arena
        except BaseException:
            if arena is not None:
                arena.close()
            raise
        if arena is not None:
            arena.close()
        floor = got


def form_group(
    mesh: ElasticMesh,
    members: Sequence[Member],
    name: str,
    timeout_s: float,
    check: Callable[[], None] | None = None,
    stats: dict[str, float] | None = None,
    transport: str | None = None,
) -> TorchportProcessGroup:
    """A torchport group over ``members`` (in rank order; must include ``mesh.me``).

    Called by every member with the same list and ``name`` (``name`` must be new for each
    formation: it derives the group id). ``check()`` may raise to abandon the formation.
    ``stats`` (optional) receives ``new_connections`` and the cumulative seconds ``connect_s``,
    ``arena_s`` and ``comm_s``. ``transport`` (``auto``/``shm``/``tcp``) overrides
    ``TORCHPORT_DIST_TRANSPORT``; member 0's choice is the one every member follows.
    """
    ids = [m.id for m in members]
    if mesh.rank not in ids:
        raise CommError(f"this process (member {mesh.rank}) is not among the members {ids}")
    chk = check or (lambda: None)
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    rank, world = ids.index(mesh.rank), len(ids)
    fresh = mesh.ensure(members, deadline, chk)
    t_conn = time.perf_counter() - t0
    gid = group_id_for(name)
    transport = transport or str(config.get("dist_transport"))
    local = all(m.host_id == mesh.me.host_id for m in members)
    if transport == "shm" and not local:
        raise CommError("TORCHPORT_DIST_TRANSPORT=shm but the group spans several hosts")
    shm_chunk, slot, tcp_chunk = _sizes()
    arena = None
    if world > 1:
        arena = _rendezvous(mesh, gid, ids, rank, slot, local and transport != "tcp", deadline, chk)
    chunk = shm_chunk if arena is not None else tcp_chunk
    t_arena = time.perf_counter() - t0
    comm = Communicator(
        mesh,
        gid,
        ids,
        rank,
        arena=arena,
        timeout_s=timeout_s,
        chunk=chunk,
        stream_bytes=int(config.get("dist_stream_bytes")),
        name=name,
        spawn=mesh._warm.run,
    )
    if stats is not None:
        stats.update(
            new_connections=fresh,
            connect_s=t_conn,
            arena_s=t_arena,
            comm_s=time.perf_counter() - t0,
        )
    return TorchportProcessGroup(comm)


def drop_group(pg: Any) -> None:
    """Abort a torchport group (ends its in-flight ops here and on every peer) and shut it down."""
    if pg is None:
        return
    if pg.comm.error is None:
        pg.comm.fail(CommAbortedError(f"group {pg.comm.name!r} retired"), 5)
    pg.shutdown()


def retire_group(pg: Any) -> None:
    """:func:`drop_group` in the background (never blocks the caller)."""
    if pg is not None:
        in_background(drop_group, pg)
