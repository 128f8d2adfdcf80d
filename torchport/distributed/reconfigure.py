"""2.14's reconfiguration API — ``_reconfigure`` & co. — on torchport (default) or gloo.

``init_process_group(backend, enable_reconfigure=True)`` returns a :class:`ReconfigurableGroup`
whose communicator is formed at the first :func:`_reconfigure`. Each rank hands out an opaque handle
(:func:`_get_reconfigure_handle`): ``tp1:<host>:<control port>:<store port>:<nonce>``. The nonce
rotates after every successful reconfigure, so a handle from before it is *stale*.

``_reconfigure(uuid, handles)`` runs in two phases:

1. **Validation, one round trip.** Every rank asks every other handle's control server, in parallel,
   "is this nonce current, and have you completed a reconfigure with this uuid?". A stale handle
   (rotated nonce, or a process that is gone: connection refused) or a reused uuid is seen by
   *every* rank in that same round trip, and every rank's Work fails with
   :class:`ReconfigureError` — no rank is left waiting (gloo in 2.14 fails one rank and leaves the
   others waiting 10 s).
2. **Forming the group.** Ranks follow the handles' order (a set is sorted).

   * ``torchport``: the validation replies also carry each member's mesh address, and the group
     is formed in place on this process's :class:`~torchport.distributed.elastic.ElasticMesh`:
     live connections are reused (a shrink opens none, a grow only the newcomers'), a fresh
     shared-memory arena is exchanged over the mesh when all members share the host, and a new
     communicator takes over (:func:`~torchport.distributed.elastic.form_group`).
   * ``gloo``: the first rank's store (each group hosts a ``TCPStore`` for this) rendezvouses a new
     gloo group under the prefix ``tp-reconf/<uuid>``.

   Shrink and grow are the same operation with fewer or more handles.

After a reconfigure each rank watches its peers: a crashed peer (connection lost) is noticed at
once, a hung one after three heartbeat periods; in-flight ops issued through the group
(:meth:`ReconfigurableGroup.allreduce` etc.) then fail with :class:`PeerFailure` and the error
stays queryable (``get_error()``). A rank that detects the fault itself sends every other healthy
member a fault notice naming the culprit before it aborts the communicator, so every survivor
reports the same culprit, never the messenger whose abort reached it first.

* ``torchport``: watching costs no connection and no thread per peer. One watcher thread per
  process sends a beat over the :class:`~torchport.distributed.elastic.ElasticMesh` connections
  every heartbeat period and checks when each member was last heard from (any frame counts); the
  mesh reports a lost connection at once. Connections to surviving members simply stay, so a
  reconfigure only changes the set of members watched. Fault notices travel on the mesh too,
  ahead of the ABORT frames on the same connection.
* ``gloo``: each rank opens a watch connection to every peer's control server, which sends beats
  on it; the handshake has the same three-heartbeat bound (a peer stopped before its watcher
  connected is hung too).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchport import config
from torchport.distributed._control import (
    CommError,
    PeerFailure,
    Server,
    connect,
    job_secret,
    master_store,
    recv_msg,
    send_msg,
)
from torchport.distributed._gloo import gloo_group, retire
from torchport.distributed.elastic import (
    ElasticMesh,
    Member,
    drop_group,
    form_group,
    retire_group,
)
from torchport.distributed.engine import REASON_ERROR
from torchport.distributed.errors import CommTimeoutError, WireError, clip_repr
from torchport.distributed.ft.lighthouse import check_number
from torchport.distributed.progress import wait_limit_s

_log = logging.getLogger(__name__)
_MAX_CAUSE = 512  # bytes of a fault notice's cause text that are kept
# The largest uuid: a fault notice on the mesh carries the generation in a frame's u64 seq
# field (two uuids 2**64 apart were the same generation there), and a peer's JSON decoder refuses
# an integer of more than 4300 digits (a larger uuid failed every peer's check request).
MAX_UUID = (1 << 64) - 1
_SPARE = 8  # idle threads kept by the control server and the mesh (see _threads.WarmPool)
_CURRENT = object()  # ReconfigurableGroup._fail: whichever communicator is current


class ReconfigureError(CommError):
    """A reconfigure was rejected (stale handle, reused uuid, bad arguments) or failed."""


@dataclass
class ReconfigureOptions:
    """Options of one reconfigure, as in 2.14.

    ``handles``: a list assigns ranks by position; a set lets the backend choose (sorted order).
    ``hints`` (torchport backend): ``{"transport": "auto" | "shm" | "tcp"}`` picks the new
    communicator's transport (the first rank's hint decides); other keys are rejected.
    """

    uuid: int = -1
    handles: list[str] | set[str] | None = None
    timeout: timedelta | None = None
    hints: dict[str, str] | None = None


HINTS = {"transport": ("auto", "shm", "tcp")}


def _transport_hint(hints: dict[str, str] | None) -> str | None:
    """The ``transport`` hint, validated; :class:`ReconfigureError` for unknown keys/values."""
    if hints is None:
        return None
    if not isinstance(hints, dict):
        raise ReconfigureError(f"hints must be a dict of str, got {type(hints).__name__}")
    for k, v in hints.items():
        if k not in HINTS:
            raise ReconfigureError(f"unknown reconfigure hint {k!r}; supported: {sorted(HINTS)}")
        if v not in HINTS[k]:
            raise ReconfigureError(f"hint {k!r} must be one of {HINTS[k]}, got {v!r}")
    return hints.get("transport")


def _check_timeout(timeout: Any, unset: str) -> None:
    """A group's or a reconfigure's timeout is None (meaning ``unset``) or a ``timedelta`` > 0
    and at most ``threading.TIMEOUT_MAX`` s (the longest a socket waits); else
    :class:`ReconfigureError` naming the value."""
    if timeout is None:
        return
    if not (
        isinstance(timeout, timedelta) and 0 < timeout.total_seconds() <= threading.TIMEOUT_MAX
    ):
        raise ReconfigureError(
            f"timeout must be a datetime.timedelta > 0 and at most {threading.TIMEOUT_MAX:g} s "
            f"(or None: {unset}), got {clip_repr(timeout)}"
        )


def _warm(pool: cf.ThreadPoolExecutor, n: int) -> cf.ThreadPoolExecutor:
    """Start all ``n`` threads of ``pool`` now (a pool otherwise starts one per submit)."""
    gate = threading.Barrier(n)
    cf.wait([pool.submit(gate.wait, 10.0) for _ in range(n)], timeout=10.0)
    return pool


class Work:
    """An async result in the shape of ``torch.distributed.Work`` (``name`` is what error
    messages call the operation)."""

    def __init__(self, fut: cf.Future[Any], name: str = "operation") -> None:
        self._fut = fut
        self.name = name

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done; re-raise the operation's error, or :class:`CommTimeoutError`.

        ``timeout`` (a ``timedelta`` or seconds), as the backend's Work
        (:func:`~torchport.distributed.progress.wait_limit_s`): None or zero waits without
        limit (as gloo), and so does one of ``threading.TIMEOUT_MAX`` or more. A negative one
        does not wait: unless the operation is done it raises :class:`CommTimeoutError` at
        once. NaN, or what is no timeout, raises
        :class:`~torchport.distributed.errors.CollectiveArgumentError`. A ``wait`` that times
        out leaves the operation running (a later ``wait`` may still succeed).
        """
        # (zero raised "did not complete within 0.0 s" at once, one past TIMEOUT_MAX an
        # OverflowError from the future's lock, NaN "timed out after nan s" at once, a string
        # an untyped TypeError)
        t = wait_limit_s(timeout, self.name)
        try:
            self._fut.result(timeout=t)  # (a negative t only looks: the condition's wait polls)
        except cf.TimeoutError:
            # (cf.TimeoutError is the builtin TimeoutError, which the operation's own
            # CommTimeoutError also is: it came out as "did not complete within None s")
            if not self._fut.done():
                assert t is not None
                if t < 0:
                    raise CommTimeoutError(
                        f"{self.name}: wait() with a negative timeout ({t:g} s) timed out at "
                        "once: the operation had not finished"
                    ) from None
                raise CommTimeoutError(f"{self.name}: wait() timed out after {t:g} s") from None
            self._fut.result()  # finished meanwhile (or with that error): its own outcome
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self._fut.exception() is None

    def exception(self) -> BaseException | None:
        return self._fut.exception() if self._fut.done() else None

    def get_future(self) -> torch.futures.Future[Any]:
        out: torch.futures.Future[Any] = torch.futures.Future()

        def done(f: cf.Future[Any]) -> None:
            err = f.exception()
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(f.result())

        self._fut.add_done_callback(done)
        return out


def _split_handle(handle: str) -> list[str]:
    parts = handle.split(":") if isinstance(handle, str) else []
    ok = len(parts) in (5, 6) and parts[0] == "tp1" and parts[2].isdigit() and parts[3].isdigit()
    if ok and len(parts) == 6:
        mid, _, mport = parts[5].partition(".")
        ok = mid.isdigit() and mport.isdigit()
    if not ok:
        raise ReconfigureError(
            "reconfigure handle must look like 'tp1:host:port:store_port:nonce[:member.port]', "
            f"got {handle!r}"
        )
    return parts


def parse_handle(handle: str) -> tuple[str, int, int, str]:
    """(host, control port, store port, nonce) of a handle; :class:`ReconfigureError` if malformed."""
    parts = _split_handle(handle)
    return parts[1], int(parts[2]), int(parts[3]), parts[4]


def handle_mesh(handle: str) -> tuple[int, int] | None:
    """(member id, mesh port) a torchport handle names (its mesh listens on the handle's host)."""
    parts = _split_handle(handle)
    if len(parts) < 6:
        return None
    mid, _, mport = parts[5].partition(".")
    return int(mid), int(mport)


class ReconfigurableGroup:
    """A process group whose membership is set, shrunk and grown by :func:`_reconfigure`.

    Collective methods (``allreduce``, ``broadcast``, ``allgather``, ``barrier``) run on the current
    communicator (``pg``: a :class:`~torchport.distributed.TorchportProcessGroup` or a gloo group)
    and fail with :class:`PeerFailure` as soon as a peer is detected dead.

    Args:
        backend: ``"torchport"`` (default) or ``"gloo"``.
        timeout: default limit of reconfigures and collectives (30 s).
        host: address of the control server, the store and the mesh listener; default
            ``TORCHPORT_DIST_ADDR``.
        heartbeat: period (s) of failure-detection heartbeats; default ``config.ft_heartbeat``.
        secret: job secret authenticating every connection; default ``TORCHPORT_SECRET``.
    """

    supports_reconfigure = True
    _closed = False  # (set by close(); a class default for a group built without __init__)

    def __init__(
        self,
        *,
        backend: str = "torchport",
        timeout: timedelta | None = None,
        host: str | None = None,
        heartbeat: float | None = None,
        secret: bytes | None = None,
    ) -> None:
        if backend not in ("torchport", "gloo"):
            raise ReconfigureError(
                f"reconfigure needs backend 'torchport' or 'gloo', got {backend!r}"
            )
        if heartbeat is not None:
            # zero: every watch connection's server thread sent beats flat out; a string failed
            # with a bare TypeError, and 1e10 s (past what a wait takes, for three periods)
            # killed the watcher thread with an OverflowError
            try:
                heartbeat = check_number("heartbeat", heartbeat, most=config.FT_HEARTBEAT_MAX)
            except ValueError as e:
                raise ReconfigureError(str(e)) from None
        _check_timeout(timeout, "30 s")
        host = host or str(config.get("dist_addr"))
        self.backend = backend
        self.timeout = timeout or timedelta(seconds=30)
        self.heartbeat = config.get("ft_heartbeat") if heartbeat is None else heartbeat
        try:
            self._secret = job_secret(secret)
        except (TypeError, ValueError) as e:
            raise ReconfigureError(str(e)) from None
        self._host = host
        self._nonce = secrets.token_hex(8)
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self._mesh: ElasticMesh | None = None
        self.store: Any = None
        if backend == "torchport":
            self._mesh = ElasticMesh(self._secret, host)
        else:
            self.store = master_store(host)  # (on host only, not on *)
        # a newcomer's peers all validate its handle at once: handler threads are kept ready
        self._server = Server(
            self._handle, secret=self._secret, role="reconf", host=host, spare=_SPARE
        )
        # Threads are started here, with the process, not while a reconfigure is timed: a thread
        # start waits for the new thread to be scheduled, which costs milliseconds on a busy host.
        self._pool = _warm(cf.ThreadPoolExecutor(1, thread_name_prefix="tp-reconf"), 1)
        self._checker = _warm(cf.ThreadPoolExecutor(8, thread_name_prefix="tp-reconf-check"), 8)
        self._bg = _warm(cf.ThreadPoolExecutor(1, thread_name_prefix="tp-reconf-bg"), 1)
        self._clients: dict[tuple[str, int], dist.Store] = {}
        self._ctl: dict[tuple[str, int], socket.socket] = {}
        self._generation = -1
        self.pg: Any = None
        self._rank, self._size = -1, 0
        self._error: BaseException | None = None
        self._waiters: set[threading.Event] = set()
        self._watch: list[socket.socket] = []
        self._members: list[str] = []  # the handles of the current membership, in rank order
        self._closed = False
        self._forming = False  # a reconfigure is running (the watcher defers housekeeping)
        self._member_ids: list[int] = []  # torchport: their mesh member ids, in rank order
        self._watched: dict[int, int] = {}  # torchport: member id -> rank, of watched peers
        self._watch_since = 0.0  # when the current membership was formed (monotonic)
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        if self._mesh is not None:
            self._mesh.on_lost = self._on_lost
            self._mesh.on_notice = self._on_notice
            self._watcher = threading.Thread(
                target=self._watch_loop, name="tp-reconf-watch", daemon=True
            )
            self._watcher.start()
        self.last_reconfigure_s = 0.0
        self.phases: dict[str, float] = {}  # cumulative seconds of the last reconfigure's phases

    # -- handles and the control server ---------------------------------------------------
    def get_reconfigure_handle(self) -> str:
        """This rank's current handle (changes after every successful reconfigure)."""
        self._check_open("_get_reconfigure_handle")  # (it named a server that had stopped)
        h, p = self._server.address
        store_port = self.store.port if self.store is not None else 0
        # torchport: the mesh listener too, so peers can dial it while they validate
        mesh = f":{self._mesh.me.id}.{self._mesh.me.port}" if self._mesh is not None else ""
        return f"tp1:{h}:{p}:{store_port}:{self._nonce}{mesh}"

    def _handle(self, conn: socket.socket) -> None:
        while True:  # a peer keeps its check connection open and reuses it
            try:
                msg = recv_msg(conn)
            except WireError as e:  # not a frame to answer: one line, and the connection closes
                _log.warning("reconfigure control server: %s; closing the connection", e)
                return
            if msg.get("t") == "check":
                uuid = msg.get("uuid")
                why = _bad_uuid(uuid)
                if why is not None:
                    # int() of it raised out of this thread (a traceback, no reply) for "abc",
                    # null, a list or Infinity, and truncated 1.5 to 1: refused with a reply;
                    # the connection stays usable (the frame itself was well formed)
                    _log.warning("reconfigure control server: refused a check request: %s", why)
                    send_msg(conn, {"t": "error", "error": f"malformed check request: {why}"})
                    continue
                with self._lock:
                    reply = {
                        "t": "check",
                        "current": msg.get("nonce") == self._nonce,
                        "uuid_used": uuid in self._used,
                        "mesh": self._mesh.me.to_json() if self._mesh is not None else None,
                    }
                send_msg(conn, reply)
            elif msg.get("t") == "fault":
                # a member aborted the group because it detected a fault in another member:
                # learn the real culprit before the abort's own frames blame the messenger
                uuid, src, cause = msg.get("uuid"), msg.get("src"), msg.get("cause")
                if (
                    isinstance(uuid, int)
                    and isinstance(src, int)
                    and isinstance(cause, str)
                    and uuid == self._generation
                ):
                    self._fail(PeerFailure(f"{cause[:_MAX_CAUSE]} (reported by rank {src})"))
                return
            elif msg.get("t") == "watch":
                conn.settimeout(None)
                while not self._closed:
                    send_msg(conn, {"t": "hb"})
                    time.sleep(self.heartbeat)
                return
            else:
                why = f"unknown control request {clip_repr(msg.get('t'))}"
                _log.warning("reconfigure control server: %s; closing the connection", why)
                send_msg(conn, {"t": "error", "error": why})
                return

    # -- reconfigure -----------------------------------------------------------------------
    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Start a reconfigure (see module docstring); the returned Work raises on failure."""
        # in the caller's context: forming the group reads config (dist_transport, chunk sizes,
        # dist_addr), whose overrides are context variables the pool thread does not inherit
        # (closed: the pool's bare RuntimeError "cannot schedule new futures after shutdown")
        self._check_open("_reconfigure")
        run = contextvars.copy_context().run
        return Work(self._pool.submit(run, self._reconfigure_flagged, opts), "reconfigure")

    def _reconfigure_flagged(self, opts: ReconfigureOptions) -> None:
        self._forming = True
        try:
            self._reconfigure(opts)
        finally:
            self._forming = False

    def _order(self, opts: ReconfigureOptions) -> list[str]:
        why = _bad_uuid(opts.uuid)
        if why is not None:
            raise ReconfigureError(why)
        hs = opts.handles
        if isinstance(hs, set | frozenset):
            order = sorted(hs)
        elif isinstance(hs, list | tuple):
            order = list(hs)
        else:
            raise ReconfigureError(
                f"handles must be a list or a set of str, got {type(hs).__name__}"
            )
        if not order:
            raise ReconfigureError("handles must name at least one rank, got an empty collection")
        for h in order:  # (before the set: a list among them raised a bare TypeError there)
            parse_handle(h)
        if len(set(order)) != len(order):
            raise ReconfigureError(f"handles must be distinct, got duplicates in {order}")
        mine = self.get_reconfigure_handle()
        if mine not in order:
            raise ReconfigureError(
                f"this rank's current handle {mine!r} is not among the handles {order} "
                f"(a stale handle of this rank?)"
            )
        return order

    def _ask(self, host: str, port: int, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One request/response on a cached authenticated connection (reconnects once)."""
        for attempt in (0, 1):
            sock = self._ctl.pop((host, port), None)
            fresh = sock is None
            if sock is None:  # the request rides behind the authentication answer
                sock = connect(
                    (host, port),
                    self._secret,
                    "reconf",
                    timeout=max(0.05, deadline - time.monotonic()),
                    first=msg,
                )
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                if not fresh:
                    send_msg(sock, msg)
                reply = recv_msg(sock)
            except (OSError, CommError):
                sock.close()
                if fresh or attempt:
                    raise
                continue  # the cached connection went away: try a new one
            self._ctl[(host, port)] = sock
            return reply
        raise CommError("unreachable")

    def _check_all(
        self, handles: list[str], uuid: int, deadline: float
    ) -> dict[str, tuple[str | None, Any]]:
        """Validate every handle in one round trip.

        Requests on cached connections are pipelined from this thread (all sent, then all
        answers read); handles without a live connection are checked in parallel on the pool.
        """
        out: dict[str, tuple[str | None, Any]] = {}
        sent: list[tuple[str, socket.socket]] = []
        fresh: list[str] = []
        for h in handles:
            host, port, _, nonce = parse_handle(h)
            sock = self._ctl.pop((host, port), None)
            if sock is None:
                fresh.append(h)
                continue
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                send_msg(sock, {"t": "check", "nonce": nonce, "uuid": uuid})
                sent.append((h, sock))
            except OSError:
                sock.close()
                fresh.append(h)
        futs = {h: self._checker.submit(self._check, h, uuid, deadline) for h in fresh}
        for h, sock in sent:
            try:
                reply = recv_msg(sock)
            except (OSError, CommError):
                sock.close()  # the cached connection went away: ask on a new one
                futs[h] = self._checker.submit(self._check, h, uuid, deadline)
                continue
            host, port, _, _ = parse_handle(h)
            self._ctl[(host, port)] = sock
            out[h] = self._verdict(h, uuid, reply, deadline)
        for h, f in futs.items():
            out[h] = f.result()
        return out

    def _verdict(
        self, handle: str, uuid: int, r: dict[str, Any], deadline: float | None = None
    ) -> tuple[str | None, Any]:
        """(problem or None, the peer's mesh record) from a check reply."""
        if r.get("t") == "error":  # the peer refused the request (a malformed one)
            return f"handle {handle!r}: the peer refused the check: {r.get('error')}", None
        if not r.get("current"):
            return f"handle {handle!r} is stale: that rank has been reconfigured since", None
        if r.get("uuid_used"):
            used = f"uuid {uuid} was already used by a completed reconfigure (rank {handle!r})"
            return used, None
        if self._mesh is not None and r.get("mesh") is None:
            return f"handle {handle!r} belongs to a group of another backend (not torchport)", None
        if self._mesh is not None and deadline is not None:
            # open the mesh connection while the other handles are still being validated
            with contextlib.suppress(CommError, ValueError, TypeError):
                self._mesh.dial(Member.from_json(r.get("mesh")), deadline)
        return None, r.get("mesh")

    def _check(self, handle: str, uuid: int, deadline: float) -> tuple[str | None, Any]:
        """(problem or None, the peer's mesh record) for one handle."""
        host, port, _, nonce = parse_handle(handle)
        try:
            r = self._ask(host, port, {"t": "check", "nonce": nonce, "uuid": uuid}, deadline)
        except (OSError, CommError) as e:
            return f"handle {handle!r} is stale: no process answers at {host}:{port} ({e})", None
        return self._verdict(handle, uuid, r, deadline)

    def _reconfigure(self, opts: ReconfigureOptions) -> None:
        t0 = time.perf_counter()
        # (a float failed in Work.wait with an AttributeError; a negative timedelta was taken,
        # and a zero one read as "unset": the group's 30 s)
        _check_timeout(opts.timeout, "the group's")
        timeout = (self.timeout if opts.timeout is None else opts.timeout).total_seconds()
        deadline = time.monotonic() + timeout
        order = self._order(opts)
        _transport_hint(opts.hints)
        uuid = opts.uuid
        if uuid in self._used:
            raise ReconfigureError(f"uuid {uuid} was already used by a completed reconfigure")
        mine = self.get_reconfigure_handle()
        others = [h for h in order if h != mine]
        if self._mesh is not None:  # open mesh connections while the handles are validated
            for h in others:
                at = handle_mesh(h)
                if at is not None:
                    self._mesh.dial(Member(at[0], parse_handle(h)[0], at[1], ""), deadline)
        answers = self._check_all(others, uuid, deadline)
        problems = [p for p, _ in answers.values() if p]
        if problems:
            raise ReconfigureError("reconfigure rejected: " + "; ".join(sorted(problems)))
        self.phases = {"validate_s": time.perf_counter() - t0}
        rank, size = order.index(mine), len(order)
        with self._lock:  # the kept membership's watch, resumed if the formation fails
            kept = (self._generation, dict(self._watched))
        self._stop_watch()
        old = self.pg
        try:
            if self._mesh is not None:
                stats: dict[str, float] = {}
                members = [
                    self._mesh.me if h == mine else Member.from_json(answers[h][1]) for h in order
                ]
                pg = form_group(
                    self._mesh,
                    members,
                    f"tp-reconf/{uuid}",
                    max(0.05, deadline - time.monotonic()),
                    stats=stats,
                    transport=_transport_hint(opts.hints),
                )
                self.phases.update({k: v + self.phases["validate_s"] for k, v in stats.items()})
                self.phases["new_connections"] = stats["new_connections"]
                ids = [m.id for m in members]
            else:
                ids = []
                lhost, _, lport, _ = parse_handle(order[0])
                # torch's store and gloo add their timeout to a nanosecond clock: TIMEOUT_MAX (a
                # valid timeout here) wrapped around there, and they timed out at once
                native = min(timeout, threading.TIMEOUT_MAX / 2)
                store = self.store if rank == 0 else self._client(lhost, lport, native)
                self.phases["store_s"] = time.perf_counter() - t0
                pg = gloo_group(
                    dist.PrefixStore(f"tp-reconf/{uuid}", store), rank, size, native, self._host
                )
        except Exception as e:
            # the old communicator stays in use: watch its members again (unwatched, a crash was
            # noticed late here and blamed on the messenger whose abort came first)
            self._resume_watch(*kept)
            raise ReconfigureError(f"forming the group for uuid {uuid} failed: {e}") from None
        with self._lock:
            self.pg, self._rank, self._size = pg, rank, size
            self._members = list(order)
            self._member_ids = ids
            self._used.add(uuid)
            self._generation = uuid
            self._nonce = secrets.token_hex(8)
            self._error = None
            # torchport: the watcher thread checks these members from now on
            self._watched = {m: r for r, m in enumerate(ids) if r != rank}
            self._watch_since = time.monotonic()
        self.phases["group_s"] = time.perf_counter() - t0
        self._retire(old)
        self.last_reconfigure_s = time.perf_counter() - t0
        if self._mesh is None:  # gloo: peers start watching each other off the critical path
            threading.Thread(
                target=self._start_watch, args=(order, rank, uuid), daemon=True
            ).start()

    def _client(self, host: str, port: int, timeout: float) -> dist.Store:
        key = (host, port)
        store = self._clients.get(key)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
            self._clients[key] = store
        return store

    # -- failure detection -----------------------------------------------------------------
    def _watch_loop(self) -> None:
        """torchport: beat to every mesh peer each period; report a member silent for 3 periods.

        Runs for the life of the group; a reconfigure only swaps the members it checks.
        """
        mesh = self._mesh
        assert mesh is not None
        next_beat = 0.0
        while not self._closed:
            period = self.heartbeat
            now = time.monotonic()
            if now >= next_beat:
                mesh.beat()
                next_beat = now + period
                if not self._forming:  # top the warm thread pools up after a reconfigure
                    mesh.refill()
                    self._server.refill()
            patience = 3 * period
            with self._lock:
                watched, since = list(self._watched.items()), self._watch_since
            wake = next_beat
            for mid, r in watched:
                conn = mesh.peers.get(mid)
                if conn is None:  # lost before it was watched (on_lost found no member)
                    self._report(mid, f"rank {r} crashed: its connection was lost")
                    continue
                expiry = max(conn.seen, since) + patience
                if now > expiry:
                    self._report(mid, f"rank {r} hung: no heartbeat for {patience:.2f} s")
                else:
                    wake = min(wake, expiry)
            # sleep until the next beat is due or the first member could expire (no polling)
            self._wake.wait(max(0.001, wake - time.monotonic()) + 0.001)

    def _report(self, mid: int, why: str) -> None:
        """Fail the group because of watched member ``mid`` (once per membership)."""
        with self._lock:
            r, pg = self._watched.pop(mid, None), self.pg
        if r is not None:
            self._fail(PeerFailure(why), culprit=r, background=True, pg=pg)

    def _on_lost(self, mid: int) -> None:
        """The mesh lost its connection to member ``mid`` (called from its reader thread)."""
        r = self._watched.get(mid)
        if r is not None:
            self._report(mid, f"rank {r} crashed: its connection was lost")

    def _on_notice(self, mid: int, seq: int, text: bytes) -> None:
        """A fault notice from member ``mid`` about the membership of generation ``seq``."""
        with self._lock:
            gen, ids = self._generation, self._member_ids
            ok = gen >= 0 and seq == gen and mid in ids  # (a uuid fits the u64 field: MAX_UUID)
        if ok:
            cause = text.decode(errors="replace")[:_MAX_CAUSE]
            self._fail(PeerFailure(f"{cause} (reported by rank {ids.index(mid)})"), background=True)

    def _start_watch(self, order: list[str], rank: int, uuid: int) -> None:
        """gloo: watch every other member, each from its own thread (a stopped peer delays none)."""
        if self._generation != uuid:
            return  # a newer reconfigure took over
        for r, h in enumerate(order):
            if r != rank:
                threading.Thread(target=self._watch_one, args=(h, r, uuid), daemon=True).start()

    def _watch_one(self, handle: str, r: int, uuid: int) -> None:
        if self._generation != uuid:
            return
        host, port, _, _ = parse_handle(handle)
        patience = 3 * self.heartbeat
        try:
            # A peer that cannot finish the handshake within three heartbeats is hung (it may
            # have been stopped before this watcher reached it): the same bound as a missed beat.
            sock = connect(
                (host, port), self._secret, "reconf", timeout=patience, first={"t": "watch"}
            )
        except (OSError, CommError) as e:
            if self._generation == uuid:
                if "timed out" in str(e):
                    why = f"rank {r} hung: no answer to the watch request within {patience:.2f} s"
                else:
                    why = f"rank {r} unreachable after reconfigure: {e}"
                self._fail(PeerFailure(why), culprit=r)
            return
        with self._lock:
            if self._generation != uuid:
                sock.close()
                return
            self._watch.append(sock)
        self._watch_peer(sock, r)

    def _watch_peer(self, sock: socket.socket, r: int) -> None:
        try:
            sock.settimeout(3 * self.heartbeat)
            while True:
                recv_msg(sock, limit=256)
        except TimeoutError:
            if sock in self._watch:  # a watcher of an older membership is not a failure
                self._fail(
                    PeerFailure(f"rank {r} hung: no heartbeat for {3 * self.heartbeat:.2f} s"),
                    culprit=r,
                )
        except (OSError, CommError):
            if sock in self._watch:
                self._fail(PeerFailure(f"rank {r} crashed: its connection was lost"), culprit=r)

    def _stop_watch(self) -> None:
        with self._lock:
            socks, self._watch = self._watch, []
            self._generation = -1
            self._watched = {}
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _resume_watch(self, generation: int, watched: dict[int, int]) -> None:
        """Watch the kept membership of ``generation`` again (``watched``: torchport's member
        id -> rank) after a reconfigure stopped watching it and then failed while forming."""
        with self._lock:
            self._generation, self._watched = generation, watched
            self._watch_since = time.monotonic()
            order, rank = list(self._members), self._rank
        if self._mesh is not None:
            self._wake.set()  # a member lost meanwhile has no connection: reported at once
        elif generation >= 0:
            threading.Thread(
                target=self._start_watch, args=(order, rank, generation), daemon=True
            ).start()

    def _fail(
        self,
        e: BaseException,
        culprit: int | None = None,
        background: bool = False,
        pg: Any = _CURRENT,
    ) -> None:
        """Record the first failure, end in-flight ops here and on every peer.

        When this rank detected the fault itself (``culprit`` is the faulty member), it first
        tells the other healthy members the cause, so that a survivor whose own detection is
        later does not blame this rank for the abort that follows. With ``background`` the
        error is recorded at once and the messages (which may wait on a stuck connection) are
        sent from a separate thread.

        ``pg``: the communicator the failure was seen on; when a reconfigure has replaced it
        since, the failure is stale and ignored (it recorded the error on the new membership
        and aborted the new communicator on every rank).
        """
        with self._lock:
            if pg is not _CURRENT and pg is not self.pg:
                return
            first = self._error is None
            if first:
                self._error = e
            waiters = list(self._waiters)
            pg = self.pg
            uuid, members, me = self._generation, list(self._members), self._rank
            ids = list(self._member_ids)
        for w in waiters:
            w.set()

        def tell() -> None:
            if first and culprit is not None and uuid >= 0 and not self._closed:
                if self._mesh is not None:
                    self._notify_mesh(uuid, me, culprit, str(e), ids)
                else:
                    self._notify(uuid, me, culprit, str(e), members)
            if self._mesh is not None and pg is not None:
                pg.comm.fail(e, REASON_ERROR)  # in-flight ops here and on every peer end now

        if background:
            threading.Thread(target=tell, name="tp-reconf-fail", daemon=True).start()
        else:
            tell()

    def _notify_mesh(self, uuid: int, me: int, culprit: int, cause: str, ids: list[int]) -> None:
        """torchport: a fault notice to every member but this one and the culprit, on the mesh."""
        assert self._mesh is not None
        # every notice within three heartbeats in all (a connection busy with a stuck send,
        # which only the group's failure after the notices ends, must not hold them up longer)
        end = time.monotonic() + 3 * self.heartbeat
        for r, mid in enumerate(ids):
            if r not in (me, culprit):
                with contextlib.suppress(CommError, CommTimeoutError):
                    self._mesh.notify(mid, uuid, cause[:_MAX_CAUSE], end)

    def _notify(self, uuid: int, me: int, culprit: int, cause: str, members: list[str]) -> None:
        """Send a fault notice to every member but this one and the culprit (bounded wait)."""
        msg = {"t": "fault", "uuid": uuid, "src": me, "cause": cause[:_MAX_CAUSE]}

        def send(handle: str) -> None:
            host, port, _, _ = parse_handle(handle)
            with contextlib.suppress(OSError, CommError):
                sock = connect(
                    (host, port), self._secret, "reconf", timeout=3 * self.heartbeat, first=msg
                )
                sock.close()

        threads = [
            threading.Thread(target=send, args=(h,), daemon=True)
            for r, h in enumerate(members)
            if r not in (me, culprit)
        ]
        for t in threads:
            t.start()
        end = time.monotonic() + max(0.2, self.heartbeat)
        for t in threads:  # the abort frames follow the notices; a slow peer does not hold them
            t.join(max(0.0, end - time.monotonic()))

    def _retire(self, pg: Any) -> None:
        if self._mesh is not None:
            if pg is not None:
                self._bg.submit(drop_group, pg)  # on a warm thread, off the critical path
        else:
            retire(pg)
            self._server.refill()

    def _check_open(self, name: str) -> None:
        """:class:`ReconfigureError` once :meth:`close` ran (``name``: the refused call)."""
        if self._closed:
            raise ReconfigureError(f"{name}: the group was closed")

    def get_error(self) -> BaseException | None:
        """The failure detected since the last reconfigure, if any."""
        return self._error

    # -- collectives -----------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _replaced(self, name: str, cause: object) -> ReconfigureError:
        """The error of an op whose communicator a reconfigure replaced while it was in flight
        (the new membership is not failed by it)."""
        return ReconfigureError(
            f"{name}: the group was reconfigured while {name} was in flight; it ran on the "
            f"replaced communicator and did not complete ({cause})"
        )

    def _run(self, name: str, issue: Any, timeout: float | None = None) -> None:
        self._check_open(name)
        ev = threading.Event()
        with self._lock:  # the communicator this op runs on, with its error state
            pg, error = self.pg, self._error
            if pg is not None and error is None:
                self._waiters.add(ev)
        if pg is None:
            raise ReconfigureError(
                f"{name}: the group has no communicator yet; call _reconfigure first"
            )
        if error is not None:
            raise PeerFailure(f"{name}: group failed earlier: {error}")
        try:
            work = issue(pg)
            work.get_future().add_done_callback(lambda _f: ev.set())
            t = self.timeout.total_seconds() if timeout is None else timeout
            if not ev.wait(t):
                if self.pg is not pg:  # (gloo: a replaced group's op is not aborted)
                    raise self._replaced(name, f"no result within {t} s")
                # the op is still in flight: fail the group (as c10d's watchdog aborts a timed-out
                # communicator), or it completed later with a slow peer and rewrote the tensor
                # this rank had been told failed, while the peer reported success. On gloo only
                # the group's error is set: a gloo op cannot be aborted (abort()/shutdown() of a
                # torch 2.13 ProcessGroupGloo return without ending it), so it can still complete
                # with a slow peer (README)
                err = CommError(f"{name} timed out after {t} s")
                self._fail(err, pg=pg)
                raise err
            if self._error is not None and not work.is_completed():
                if self.pg is not pg:  # a failure of the new membership is not this op's
                    raise self._replaced(name, "its communicator was retired")
                raise PeerFailure(f"{name} aborted: {self._error}")
            try:
                work.get_future().value()
            except (RuntimeError, CommError) as e:  # gloo: RuntimeError; torchport: CommError
                # A peer's abort may arrive before this rank's own watchers name the cause
                # (which rank crashed or hung): give them up to the hang-detection time. A
                # peer that finished a reconfigure first and retired this communicator ends
                # the op too: then this rank's reconfigure completes meanwhile.
                end = time.monotonic() + 6 * self.heartbeat + 1.0
                while (
                    self._error is None
                    and self.pg is pg
                    and self._mesh is not None
                    and time.monotonic() < end
                ):
                    time.sleep(0.005)
                # (the old op's failure, recorded on the new membership, failed it on every
                # rank: the error state and the abort belong to the communicator it ran on)
                if self.pg is not pg:
                    raise self._replaced(name, e) from None
                if self._error is not None:
                    raise PeerFailure(f"{name} failed: {self._error}") from None
                err = PeerFailure(f"{name} failed: {e}")
                self._fail(err, pg=pg)
                raise err from None
        finally:
            with self._lock:
                self._waiters.discard(ev)

    def allreduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        """In-place allreduce over the current members."""
        o = dist.AllreduceOptions()
        o.reduceOp = op
        self._run("allreduce", lambda pg: pg.allreduce([tensor], o))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        o = dist.BroadcastOptions()
        o.rootRank = src
        self._run("broadcast", lambda pg: pg.broadcast([tensor], o))

    def allgather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._run("allgather", lambda pg: pg.allgather([out], [tensor]))

    def barrier(self) -> None:
        self._run("barrier", lambda pg: pg.allreduce([torch.zeros(1)]))

    def close(self) -> None:
        """Stop serving and watching; retire the communicator."""
        self._closed = True
        self._wake.set()
        self._stop_watch()
        self._server.close()
        self._pool.shutdown(wait=False)
        self._checker.shutdown(wait=False)
        for sock in self._ctl.values():
            sock.close()
        self._ctl.clear()
        if self._mesh is not None:
            retire_group(self.pg)
        else:
            retire(self.pg)
        self._bg.shutdown(wait=False)
        self.pg = None
        if self._mesh is not None:
            self._mesh.close()


def _bad_uuid(uuid: Any) -> str | None:
    """Why ``uuid`` is not a reconfigure uuid (an int in [0, MAX_UUID]), or None."""
    if not isinstance(uuid, int) or isinstance(uuid, bool) or uuid < 0:
        return f"uuid must be a non-negative int, got {clip_repr(uuid)}"
    if uuid > MAX_UUID:
        return f"uuid must be at most 2**64 - 1 ({MAX_UUID}), got {clip_repr(uuid)}"
    return None


_default: ReconfigurableGroup | None = None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    enable_reconfigure: bool = False,
    **kwargs: Any,
) -> ReconfigurableGroup | None:
    """``torch.distributed.init_process_group`` plus 2.14's ``enable_reconfigure``.

    With ``enable_reconfigure=True`` no communicator is formed: the returned group (also the
    default for the functions below) is formed by the first :func:`_reconfigure`, on backend
    ``"torchport"`` (the default) or ``"gloo"``; the rendezvous arguments are not needed then.
    """
    global _default
    if not enable_reconfigure:
        dist.init_process_group(backend, init_method, timeout, world_size, rank, store, **kwargs)
        return None
    _default = ReconfigurableGroup(backend=backend or "torchport", timeout=timeout)
    return _default


def _resolve(group: Any) -> Any:
    if group is not None:
        return group
    if _default is not None:
        return _default
    if dist.is_initialized():
        return dist.group.WORLD
    raise ReconfigureError("no group given and no default group: call init_process_group first")


def _supports_reconfigure(group: Any = None) -> bool:
    """Whether ``group`` supports the reconfigure API."""
    return bool(getattr(_resolve(group), "supports_reconfigure", False))


def _get_reconfigure_handle(group: Any = None) -> str:
    """This rank's opaque handle for ``group`` (exchange it out of band)."""
    pg = _resolve(group)
    if not getattr(pg, "supports_reconfigure", False):
        raise ReconfigureError(
            f"group {pg!r} does not support reconfigure; use init_process_group(..., "
            f"enable_reconfigure=True)"
        )
    return str(pg.get_reconfigure_handle())


def _reconfigure(
    uuid: int,
    handles: set[str] | list[str],
    group: Any = None,
    timeout: timedelta | None = None,
    hints: dict[str, str] | None = None,
) -> Work:
    """Reconfigure ``group`` to the ranks named by ``handles`` (fresh ``uuid`` each time)."""
    pg = _resolve(group)
    if not getattr(pg, "supports_reconfigure", False):
        raise ReconfigureError(f"group {pg!r} does not support reconfigure")
    opts = ReconfigureOptions(uuid=uuid, handles=handles, timeout=timeout, hints=hints)
    return pg.reconfigure(opts)
