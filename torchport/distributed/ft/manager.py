"""The fault-tolerance manager: one per replica, in the manner of torchft's ``Manager``.

Per training step (see :class:`~torchport.distributed.ft.OptimizerWrapper`)::

    manager.start_quorum()        # join this step's quorum; rebuild the group / heal if needed
    loss.backward()               # DDP wrapper calls manager.allreduce(bucket) during backward
    if manager.should_commit():   # commit vote: everyone applies the step, or no one does
        optimizer.step()

* ``start_quorum`` blocks until the lighthouse forms a quorum. If the membership changed (or the last
  commit failed) it forms a new group: on the ``torchport`` backend (default) a communicator in place
  on this replica's :class:`~torchport.distributed.elastic.ElasticMesh` (live connections reused,
  shared memory between local replicas); on ``gloo`` a new gloo group under a fresh store prefix. A replica whose committed step
  is behind the quorum's highest step heals first: it fetches the full state (model + optimizer +
  step) from a member at that step as raw tensor bytes (:mod:`.transfer`) and loads it.
* ``allreduce`` sums a tensor over the quorum and divides by the number of members (so it takes
  floating-point and complex tensors only, float8 excepted, and refuses others at the call). It
  never raises on a peer failure: the failure is recorded (``errored()``), waits return promptly,
  and the vote fails.
* ``should_commit`` waits for outstanding allreduces and votes; the step counter advances only on a
  unanimous commit, so a step is never lost (it is retried with the same step number, hence the same
  data) and never applied twice. It is called once per step, after ``start_quorum``; without a
  quorum, or a second time, it raises :class:`QuorumError`. The vote also carries this replica's
  request for the next step's quorum: in steady state (same members, nobody joining) the
  lighthouse answers both at once and the next ``start_quorum`` returns without asking, so a
  step costs one lighthouse round trip.
  A failure noticed in between discards that quorum, and the next ``start_quorum`` asks as usual.

Failures reach the manager three ways: the lighthouse pushes a "dead" notice (crash: connection
loss, within milliseconds; hang: three missed heartbeats), a collective fails (a torchport
communicator fails at once when a member's connection drops), or a wait times out. A failed step's
torchport group is aborted, so its in-flight ops end on every member.
"""

from __future__ import annotations

import contextlib
import operator
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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
    recv_msg,
    send_msg,
)
from torchport.distributed._gloo import gloo_group, retire
from torchport.distributed.backend_args import AVG_DTYPES
from torchport.distributed.elastic import ElasticMesh, Member, form_group, retire_group
from torchport.distributed.errors import (
    CollectiveArgumentError,
    TorchportDistError,
    clip_repr,
    is_int,
)
from torchport.distributed.flight_recorder import FlightRecorder, already_recorded
from torchport.distributed.ft.lighthouse import check_number
from torchport.distributed.ft.transfer import StateTransferError, fetch_state, send_state

# heal connections one replica serves at once (each on its own thread); more are refused at once
# and their healers' quorums retry. Authenticated idle connections held a thread each, unbounded
MAX_HEAL_CONNECTIONS = 16

# the longest wait (s) of ``shutdown`` for the lighthouse to acknowledge this replica's leave,
# and then for the listener thread to end (a failure dump it is writing completes): capped by
# the manager's ``timeout``
LEAVE_WAIT = 2.0

# the longest wait a timer or socket takes (the longest timeout accepted), and the longest handed
# to torch's TCPStore and gloo: they add it to a nanosecond clock, where TIMEOUT_MAX itself
# wrapped around and they timed out at once
_MAX_WAIT = threading.TIMEOUT_MAX
_NATIVE_MAX_WAIT = _MAX_WAIT / 2

# what the average can take: the dtypes the torchport backend averages (gloo reduces them too;
# float8 is floating-point, but neither backend reduces it: it failed the step, not the call)
AVERAGEABLE = AVG_DTYPES


class QuorumError(CommError):
    """No quorum could be formed within the timeout, or a commit vote was asked for without
    one (``should_commit`` before ``start_quorum``, or twice in one step)."""


class ReplicaSupersededError(QuorumError):
    """Another process registered with the lighthouse under this manager's ``replica_id``
    (a restart of this replica, or two processes given one id): this manager may not join a
    quorum or vote again, and every later ``start_quorum`` / ``should_commit`` raises this."""


def lighthouse_address(value: Any) -> tuple[str, int]:
    """The lighthouse's ``(host, port)`` from a pair, or from a ``"host:port"`` or
    ``"http://host:port"`` string (torchft's ``TORCHFT_LIGHTHOUSE`` form; an IPv6 host in
    brackets); else ``TypeError`` / ``ValueError`` naming the value.

    It took ``value[0]`` and ``value[1]``: the string ``"127.0.0.1:40775"`` was dialled as
    host ``"1"``, port 2, a port of 2.7 became 2, and None or a URL failed with a bare error."""
    if isinstance(value, str):
        text = value.strip()
        rest = text.removeprefix("http://")
        host, sep, port_text = rest.removesuffix("/").rpartition(":")
        host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
        if "://" in rest or "/" in host or not sep or not port_text.isdigit():
            raise ValueError(
                f"lighthouse must be (host, port), 'host:port' or 'http://host:port', "
                f"got {clip_repr(value)}"
            )
        pair: Any = (host, int(port_text))
    elif isinstance(value, tuple | list) and len(value) == 2:
        pair = tuple(value)
    else:
        raise TypeError(
            f"lighthouse must be (host, port), 'host:port' or 'http://host:port', "
            f"got {clip_repr(value)}"
        )
    host, port = pair
    if not isinstance(host, str) or not host:
        raise ValueError(f"lighthouse's host must be a non-empty string, got {clip_repr(host)}")
    try:
        number = -1 if isinstance(port, bool) else operator.index(port)
    except TypeError:  # (2.7 was taken as 2)
        number = -1
    if not 1 <= number <= 65535:
        raise ValueError(
            f"lighthouse's port must be an int in [1, 65535], got {clip_repr(port)} "
            f"(in {clip_repr(value)})"
        )
    return host, number


@dataclass
class Metrics:
    """What the manager measured (seconds, bytes); read by the demo and the benchmark."""

    quorums: int = 0
    quorums_with_commit: int = 0  # of which handed out with the previous commit (no round trip)
    group_builds: int = 0
    group_build_s: list[float] = field(default_factory=list)
    heals: int = 0
    heal_bytes: int = 0
    heal_s: list[float] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (wall time of notice, what)
    commits: int = 0
    vote_s: float = 0.0  # seconds spent in commit round trips (cumulative)
    aborted_steps: int = 0
    log: list[str] = field(default_factory=list)  # quorums, group builds, heals (bounded)

    def note(self, what: str) -> None:
        if len(self.log) < 1000:
            self.log.append(f"{time.time():.3f} {what}")


class _Work:
    """Handle of one manager allreduce; ``wait`` returns False if the step failed.

    ``tensor`` is what is reduced; ``target`` the caller's tensor, into which the average is
    copied on success when it is another (a non-contiguous or conj/neg view: see
    :meth:`Manager.allreduce`)."""

    def __init__(
        self, mgr: Manager, tensor: torch.Tensor, divisor: int, target: torch.Tensor
    ) -> None:
        self.mgr, self.tensor, self.divisor, self.target = mgr, tensor, divisor, target
        self.event = threading.Event()
        self.work: Any = None
        self.done = False
        self.ok = False

    def wait(self, timeout: float | None = None) -> bool:
        if self.done:
            return self.ok
        limit = self.mgr.timeout if timeout is None else timeout
        if self.work is not None and not self.event.wait(limit):
            self.mgr.report_error(CommError(f"allreduce did not finish within {limit} s"))
        self.done = True
        if self.mgr.errored() is not None or self.work is None:
            return False
        try:
            self.work.get_future().value()
        except Exception as e:  # gloo reports peer loss as RuntimeError
            self.mgr.report_error(CommError(f"allreduce failed: {e}"))
            return False
        if self.divisor > 1:
            self.tensor.div_(self.divisor)
        if self.target is not self.tensor:
            self.target.copy_(self.tensor)
        self.ok = True
        return True


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded or self-overlapping view)."""
    span = 0  # elements covered by the smaller strides so far, less one
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            break
        span += stride * (size - 1)
    else:  # every stride steps past the others' span: no two elements meet
        return False
    # the quick test cannot tell (interleaved strides may still not meet): count the offsets
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return int(torch.unique(offsets).numel()) < t.numel()


class Manager:
    """Fault-tolerance manager of one replica.

    Args:
        lighthouse: the :class:`~torchport.distributed.ft.Lighthouse`'s address: a
            ``(host, port)`` pair, or ``"host:port"`` / ``"http://host:port"`` (torchft's form).
        replica_id: stable name of this replica, a non-empty string (a restarted process
            reuses it). The lighthouse serves the latest process of an id only: once another
            process registers with this id, this manager's ``start_quorum`` and
            ``should_commit`` raise :class:`ReplicaSupersededError` (torchft instead suffixes
            each process's id with a uuid, so two processes given one id train as two
            replicas).
        state_dict: returns the replica's full training state (tensors, dicts, lists, numbers).
        load_state_dict: loads such a state (received from a healthy replica when healing).
        timeout: limit (s) for any single wait (allreduce, commit vote) and for a heal's
            progress: the heal fails when its source does not connect, or the next MiB of the
            state (:data:`~torchport.distributed.ft.transfer.PROGRESS_BYTES`) does not arrive,
            within it; a steady transfer may take longer in total, whatever the state's size.
        quorum_timeout: limit (s) to form a quorum.
        heartbeat: heartbeat period (s); default ``config.ft_heartbeat``. It is sent to the
            lighthouse, which evicts this replica after three periods without a beat (three of
            its own period where that is longer).
        secret: job secret (default from ``TORCHPORT_SECRET``).
        recorder: optional Flight Recorder for the manager's collectives.
        init_sync: (a bool) in every quorum before the first commit (the quorum's step is 0) a replica
            other than member 0 copies member 0's state (the first member whose state is not
            torn), so replicas need not be initialised identically.
        backend: ``"torchport"`` (default) or ``"gloo"``: what carries the gradient allreduce.
    """

    def __init__(
        self,
        *,
        lighthouse: tuple[str, int],
        replica_id: str,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
        heartbeat: float | None = None,
        secret: bytes | None = None,
        recorder: FlightRecorder | None = None,
        init_sync: bool = True,
        backend: str = "torchport",
    ) -> None:
        if backend not in ("torchport", "gloo"):
            raise ValueError(f"backend must be 'torchport' or 'gloo', got {backend!r}")
        # None became the id "None" (two replicas both given None were one member: split brain)
        if not isinstance(replica_id, str):
            raise TypeError(f"replica_id must be a string, got {clip_repr(replica_id)}")
        if not replica_id:
            raise ValueError("replica_id must be a non-empty string, got ''")
        for name, fn in (("state_dict", state_dict), ("load_state_dict", load_state_dict)):
            if not callable(fn):  # (it failed at the first heal, deep in a quorum)
                raise TypeError(f"{name} must be callable, got {clip_repr(fn)}")
        if not isinstance(init_sync, bool):
            raise TypeError(f"init_sync must be a bool, got {clip_repr(init_sync)}")
        # a zero heartbeat spun the beat thread flat out; a negative timeout failed deep in
        # socket code with "Timeout value out of range"; None or True passed for a timeout, and
        # a heartbeat of 1e308 s killed the beat thread with an OverflowError
        self.timeout = check_number("timeout", timeout)
        self.quorum_timeout = check_number("quorum_timeout", quorum_timeout)
        self.heartbeat = check_number(
            "heartbeat", config.get("ft_heartbeat") if heartbeat is None else heartbeat
        )
        self.backend = backend
        self.lighthouse = lighthouse_address(lighthouse)
        self.replica_id = replica_id
        # this process's life: the lighthouse serves requests of the latest life of a replica
        # id only (a restarted replica, or a second process given the same id, supersedes it)
        self._life = uuid.uuid4().hex
        self._superseded: ReplicaSupersededError | None = None
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._secret = job_secret(secret)
        self.recorder = recorder
        self.metrics = Metrics()
        self.init_sync = init_sync
        # a heal that wrote into this replica's own tensors broke off (or its load failed): the
        # state is no step's at all, so it must heal from a member at the quorum's step before
        # training, and must not serve it to others
        self._torn = False
        # a heal is receiving into this replica's own tensors: serving them now would hand out
        # a mix of two states. Set before the first byte lands, so no later serve starts; none
        # is under way then either, as a quorum never names a replica it heals as a source
        self._receiving = False
        self._step = 0
        self._qid = -1
        self._members: list[str] = []
        self._rank = 0
        self._pg: Any = None
        self._store: dist.Store | None = None
        self._error: BaseException | None = None
        self._works: list[_Work] = []
        self._heal_sock: socket.socket | None = None  # the open state transfer, if healing
        self._next: dict[str, Any] | None = None  # next quorum, handed out with the last commit
        # start_quorum succeeded and should_commit has not voted on its step yet: a vote without
        # a quorum committed alone (the lighthouse took its empty member list as unanimous), and
        # a second vote in one quorum-step applied a step nobody else trained
        self._may_vote = False
        self._lock = threading.Lock()
        self._hb: socket.socket | None = None
        self._hb_lock = threading.Lock()  # beats and the leave share the heartbeat connection
        self._rpc: socket.socket | None = None
        self._listener: threading.Thread | None = None
        self._left = threading.Event()  # the lighthouse acknowledged the leave (or is gone)
        self._closed = threading.Event()
        self._heal_slots = threading.BoundedSemaphore(MAX_HEAL_CONNECTIONS)
        # the heal server listens where the job's TCP mesh does (TORCHPORT_DIST_ADDR): it bound
        # 127.0.0.1 always, so a replica on another host could never heal from this one
        bind = str(config.get("dist_addr"))
        self._heal_server = Server(self._serve_heal, secret=self._secret, role="heal", host=bind)
        host, port = self._heal_server.address
        if host in ("0.0.0.0", ""):  # listening on every interface: peers dial the host's address
            host = socket.gethostbyname(socket.gethostname())
        self.heal_address: tuple[str, int] = (host, port)
        self._mesh = ElasticMesh(self._secret) if backend == "torchport" else None
        try:
            self._connect()
        except BaseException:  # an unreachable lighthouse: leave no listener or thread behind
            self._heal_server.close()
            if self._mesh is not None:
                self._mesh.close()
            raise
        threading.Thread(target=self._beat, name="tp-ft-beat", daemon=True).start()

    # -- connections and heartbeats --------------------------------------------------------
    def _connect(self) -> None:
        hb = connect(self.lighthouse, self._secret, "lighthouse", timeout=self.timeout)
        try:
            # the period: a lighthouse that evicted after three of its own shorter periods
            # evicted this replica at every step (an older lighthouse ignores the field)
            hello = {"rid": self.replica_id, "life": self._life}
            send_msg(hb, {"t": "hb", **hello, "period": self.heartbeat})
            rpc = connect(self.lighthouse, self._secret, "lighthouse", timeout=self.timeout)
            send_msg(rpc, {"t": "rpc", **hello})
        except BaseException:
            hb.close()
            raise
        self._hb, self._rpc = hb, rpc
        # checked after the sockets are set: shutdown() sets _closed before it closes them, so
        # either it sees these, or this sees its mark (a shutdown during the connect closed
        # nothing, and the new sockets and listener thread outlived the manager: readL)
        if self._closed.is_set():
            self._inject_close()
            raise CommError(f"replica {self.replica_id}: the manager was shut down")
        listener = threading.Thread(
            target=self._listen, args=(hb,), name="tp-ft-listen", daemon=True
        )
        self._listener = listener
        self._left.clear()  # (a previous connection's end set it)
        listener.start()

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat):
            hb = self._hb
            if hb is None:
                continue
            with self._hb_lock, contextlib.suppress(OSError):
                send_msg(hb, {"t": "b"})

    def _listen(self, hb: socket.socket) -> None:
        try:
            while True:
                msg = recv_msg(hb)
                if msg.get("t") == "dead":
                    ids = [str(i) for i in msg.get("ids", [])]
                    self.metrics.failures.append((time.time(), f"{ids} ({msg.get('why')})"))
                    if any(i in self._members for i in ids):
                        self.report_error(PeerFailure(f"replica(s) {ids} failed: {msg.get('why')}"))
                elif msg.get("t") == "left":
                    self._peer_left([str(i) for i in msg.get("ids", [])])
                elif msg.get("t") == "leave_ok":
                    self._left.set()
                elif msg.get("t") == "evicted":
                    self.report_error(PeerFailure("this replica was evicted (missed heartbeats)"))
                elif msg.get("t") == "superseded" or msg.get("superseded"):
                    self._mark_superseded(str(msg.get("error")))
        except (OSError, CommError) as e:
            if self._hb is hb and not self._closed.is_set():
                self._hb = None
                self.report_error(CommError(f"lost the lighthouse connection: {e}"))
        finally:
            if self._hb is None or self._hb is hb:  # no acknowledgement can come any more
                self._left.set()

    def _peer_left(self, ids: list[str]) -> None:
        """Other replicas shut down cleanly: a next quorum naming one is dropped (the next
        ``start_quorum`` asks for one without it), and a step in progress with one fails (it
        cannot commit: the lighthouse fails that vote). Between steps nothing fails, so a peer
        that ended normally writes no failure dump here."""
        self.metrics.note(f"replica(s) {ids} left")
        with self._lock:
            nxt = self._next
            if nxt is not None and any(i in nxt.get("members", ()) for i in ids):
                self._next = None
            in_step = self._may_vote or any(not w.event.is_set() for w in self._works)
            mine = any(i in self._members for i in ids)
        if in_step and mine:
            self.report_error(PeerFailure(f"replica(s) {ids} left during the step"))

    def _leave(self) -> None:
        """Tell the lighthouse this replica is leaving, and wait (at most
        :data:`LEAVE_WAIT` s) for its acknowledgement, so that closing the connections after
        it is not taken for a crash (announced as ``dead`` to every peer, which then aborted
        and wrote a failure dump). A lighthouse without the message takes it for a beat and
        never answers: the wait runs out, and it sees a lost connection as before."""
        hb = self._hb
        if hb is None:
            return
        try:
            with self._hb_lock:
                send_msg(hb, {"t": "leave"})
        except (OSError, CommError):
            return
        self._left.wait(min(self.timeout, LEAVE_WAIT))

    def _inject_close(self) -> None:
        """Fault injection: close this replica's lighthouse sockets abruptly."""
        for s in (self._hb, self._rpc):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        self._hb = self._rpc = None

    # -- errors ----------------------------------------------------------------------------
    def report_error(self, e: BaseException) -> None:
        """Fail the current step (its vote will be "no"); wakes every waiting allreduce."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = e
            works = list(self._works)
            pg = self._pg
            self._next = None
            heal = self._heal_sock
        if first and heal is not None:
            # a heal from a source that hung (SIGSTOP) waited out the whole timeout while the
            # lighthouse knew within 3 heartbeats, and the quorum waited for this replica
            with contextlib.suppress(OSError):
                heal.shutdown(socket.SHUT_RDWR)
        if first and self._mesh is not None and pg is not None:
            pg.abort()  # the step failed: end its in-flight ops here and on every member
        for w in works:
            w.event.set()
        if first and self.recorder is not None:
            self.recorder.abort_hook(f"abort: {e}")

    def _mark_superseded(self, why: str) -> ReplicaSupersededError:
        """Record that a newer process took this replica id (fails the step too)."""
        with self._lock:
            if self._superseded is None:
                self._superseded = ReplicaSupersededError(why)
            err = self._superseded
        self.report_error(err)
        return err

    def _check_superseded(self) -> None:
        err = self._superseded
        if err is not None:
            raise ReplicaSupersededError(str(err))  # (the lighthouse's words name the replica)

    def errored(self) -> BaseException | None:
        """The error that failed the current step, if any."""
        return self._error

    # -- quorum ----------------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Join this step's quorum (blocking); retries until ``quorum_timeout`` on failures.

        Raises :class:`ReplicaSupersededError` at once, and from then on, once a newer process
        took this replica id at the lighthouse.
        """
        self._check_superseded()
        with self._lock:  # steady state: the quorum came with the last commit
            q, self._next = self._next, None
            self._may_vote = False  # until this step's quorum is held
            fast = (
                q is not None
                and self._error is None
                and self._pg is not None
                and q["quorum_id"] == self._qid
            )
            if fast:
                self._works = []
                self._may_vote = True
        if fast:
            self.metrics.quorums += 1
            self.metrics.quorums_with_commit += 1
            return
        deadline = time.monotonic() + self.quorum_timeout
        last: BaseException | None = None
        # a shut-down manager stops here: a retry reconnected to the lighthouse (sockets and a
        # listener thread left open) and started a gloo build per quorum it was offered
        while time.monotonic() < deadline and not self._closed.is_set():
            with self._lock:
                self._error = None
                self._works = []
            try:
                self._quorum_once(deadline)
                self.metrics.quorums += 1
                with self._lock:
                    self._may_vote = True
                return
            except ReplicaSupersededError:  # (no retry can succeed)
                self._drop_group()
                raise
            except TorchportDistError as e:  # CommError, a timeout, a peer's failure
                last = e
                self.metrics.note(f"quorum attempt failed: {e}")
                self._drop_group()
                time.sleep(0.005)
        if self._closed.is_set():
            raise QuorumError(f"replica {self.replica_id}: the manager was shut down ({last})")
        raise QuorumError(
            f"replica {self.replica_id}: no quorum within {self.quorum_timeout} s: {last}"
        ) from last

    def _quorum_once(self, deadline: float) -> None:
        if self._hb is None or self._rpc is None:
            self._inject_close()
            self._connect()
        rpc = self._rpc
        assert rpc is not None
        left = max(0.1, deadline - time.monotonic())
        rpc.settimeout(min(left + 5, _MAX_WAIT))
        try:
            send_msg(rpc, self._request(self._step, left))
            q = recv_msg(rpc)
        except OSError as e:
            self._inject_close()
            raise CommError(f"quorum request failed: {e}") from None
        if q.get("t") != "quorum":
            if q.get("superseded"):
                raise self._mark_superseded(str(q.get("error")))
            raise QuorumError(str(q.get("error")))
        members = list(q["members"])
        rank = members.index(self.replica_id)
        self.metrics.note(f"quorum {q['quorum_id']} {members} step {self._step}/{q['max_step']}")
        self._members, self._rank = members, rank
        if q["quorum_id"] != self._qid or self._pg is None:
            self._build_group(int(q["quorum_id"]), rank, len(members), q)
        sources = self._sources(q, rank)
        if self.init_sync and int(q["max_step"]) == 0:
            # nothing committed yet: every replica, torn or not, starts from the first valid
            # member's initial state (member 0 unless it is torn). Not only on this replica's
            # first quorum: a member 0 that crashed before the first commit comes back with a
            # fresh init, and replicas synced to its previous life would silently diverge
            if sources[0] != rank:
                self._heal(q, rank, sources[0])
        elif self._torn or self._step < int(q["max_step"]):
            self._heal(q, rank, sources[rank % len(sources)])
        if self._error is not None:
            raise CommError(f"failure during quorum: {self._error}")

    def _request(self, step: int, timeout: float) -> dict[str, Any]:
        """A quorum request for ``step`` (sent alone, or inside a commit vote as ``next``)."""
        # a torn replica holds no step's state: it asks at the lowest step, marked torn, so the
        # quorum's step comes from members with a valid state and it heals from one of them
        return {
            "t": "quorum",
            "rid": self.replica_id,
            "step": 0 if self._torn else step,
            "torn": self._torn,
            "heal_addr": list(self.heal_address),
            "group": self._qid if self._pg is not None else -1,
            "mesh": self._mesh.me.to_json() if self._mesh is not None else None,
            "timeout": timeout,
        }

    def _valid_next(self, q: dict[str, Any]) -> bool:
        """A next quorum handed out with a commit: this group, these members, this step."""
        return (
            q.get("t") == "quorum"
            and q.get("quorum_id") == self._qid
            and q.get("members") == self._members
            and q.get("max_step") == self._step
        )

    def _build_group(self, qid: int, rank: int, size: int, q: dict[str, Any]) -> None:
        self._drop_group()
        t0 = time.perf_counter()
        if self._mesh is not None:
            self._form_torchport(qid, q, t0)
            return
        store_port = int(q["store_port"])
        native_timeout = min(self.timeout, _NATIVE_MAX_WAIT)
        # a local: shutdown() from another thread drops self._store at any time
        store = self._store
        if store is None or getattr(store, "port", None) != store_port:
            try:
                store = dist.TCPStore(
                    self.lighthouse[0],
                    store_port,
                    is_master=False,
                    timeout=timedelta(seconds=native_timeout),
                )
            except RuntimeError as e:  # (torch's DistNetworkError, DistStoreError)
                # they escaped start_quorum untyped (its retries catch this package's errors
                # only): a CommError retries the quorum
                raise CommError(
                    f"replica {self.replica_id}: building the gloo group for quorum {qid} needs "
                    f"the lighthouse's store at {self.lighthouse[0]}:{store_port} reachable "
                    f"within timeout={self.timeout} s: {type(e).__name__}: {e}"
                ) from e
            if not self._closed.is_set():  # (a shut-down manager keeps no connection)
                self._store = store
        prefix = dist.PrefixStore(f"tp-ft/q{qid}", store)
        box: dict[str, Any] = {}
        done = threading.Event()
        box_lock = threading.Lock()

        def build() -> None:
            try:
                pg = gloo_group(prefix, rank, size, native_timeout)
            except Exception as e:
                box["err"] = e
            else:
                with box_lock:
                    abandoned = box.get("abandoned", False)
                    if not abandoned:
                        box["pg"] = pg
                if abandoned:  # completed after the manager gave up: nobody will use it
                    retire(pg)
            done.set()

        # gloo's rendezvous cannot be cancelled: an abandoned build runs on (up to ``timeout``)
        threading.Thread(target=build, name="tp-ft-gloo-build", daemon=True).start()
        while True:
            # a shutdown() while this waits ends the build too: a group set after it dropped
            # the manager's kept gloo's threads and sockets alive on a shut-down manager
            finished, closed = done.wait(0.002), self._closed.is_set()
            if finished and not closed:
                break
            late = time.perf_counter() - t0 > self.timeout
            if self._error is not None or late or closed:
                # A group the build completes later was left in ``box``, alive for as long as
                # anything held this frame (the CommError's traceback: a caller keeping the
                # errors kept one gloo group, 3 threads and 4 sockets, per abandoned build).
                # It is retired as soon as it exists now, whoever holds what.
                with box_lock:
                    box["abandoned"] = True
                    pg = box.pop("pg", None)
                retire(pg)
                # and this frame keeps no reference either: the CommError's traceback holds it,
                # so a local ``pg`` kept the retired group alive while the caller kept the error
                del pg
                why = (
                    "abandoned: the manager was shut down"
                    if closed
                    else f"not built within {self.timeout} s"
                    if late
                    else f"failed: {self._error}"
                )
                raise CommError(f"building the group for quorum {qid} {why}")
        if "err" in box:
            raise CommError(f"building the group for quorum {qid} failed: {box['err']}")
        self._pg, self._qid = box["pg"], qid
        self.metrics.group_builds += 1
        self.metrics.group_build_s.append(time.perf_counter() - t0)

    def _form_torchport(self, qid: int, q: dict[str, Any], t0: float) -> None:
        assert self._mesh is not None
        records = q.get("meshes") or []
        if len(records) != len(q["members"]) or any(r is None for r in records):
            raise CommError(f"quorum {qid} has members without a torchport mesh (mixed backends?)")

        def check() -> None:
            if self._error is not None:
                raise CommError(f"forming the group for quorum {qid} abandoned: {self._error}")

        try:
            pg = form_group(
                self._mesh,
                [Member.from_json(r) for r in records],
                f"tp-ft/q{qid}",
                self.timeout,
                check,
            )
        except TorchportDistError as e:  # a timeout or a peer's failure too: retry the quorum
            raise CommError(f"building the group for quorum {qid} failed: {e}") from None
        self._pg, self._qid = pg, qid
        self.metrics.group_builds += 1
        self.metrics.group_build_s.append(time.perf_counter() - t0)
        self._mesh.refill()  # warm threads for the next formation (started without waiting)

    def _drop_group(self) -> None:
        if self._mesh is not None:
            retire_group(self._pg)
        else:
            retire(self._pg)
        self._pg, self._qid = None, -1

    def _sources(self, q: dict[str, Any], rank: int) -> list[int]:
        """The members holding a valid state at the quorum's step, in member order."""
        torn = list(q.get("torn") or [False] * len(q["members"]))
        torn[rank] = torn[rank] or self._torn  # never its own source, whatever the quorum says
        valid = [i for i, s in enumerate(q["steps"]) if s == q["max_step"] and not torn[i]]
        if not valid:  # every member is torn: no state to train on anywhere
            raise CommError(
                f"replica {self.replica_id}: its state was torn by an interrupted heal and no "
                f"other member of quorum {q['quorum_id']} holds a valid state to heal from"
            )
        return valid

    def _heal(self, q: dict[str, Any], rank: int, src: int) -> None:
        host, port = q["heal_addrs"][src]
        self.metrics.note(f"heal from member {src} at step {q['steps'][src]}")
        with self._lock:
            self._receiving = True  # _serve_heal refuses from here on: our tensors change
        try:
            with torch.no_grad():  # receive straight into this replica's own (warm) tensors
                state, hdr, secs = fetch_state(
                    (host, int(port)),
                    self._secret,
                    timeout=self.timeout,
                    into={"user": self._state_dict(), "step": self._step},
                    on_connect=self._set_heal_sock,
                )
        except StateTransferError as e:
            # a break-off after bytes landed in our own tensors leaves half of each state
            self._torn = self._torn or e.partial
            raise
        finally:
            with self._lock:
                self._receiving = False
        self._torn = True  # until the load completes: a failing load_state_dict tears it too
        got = state.get("step") if isinstance(state, dict) else None
        if not is_int(got) or got != q["max_step"]:
            # (loaded as it came: a source at another step made this replica train and vote
            # at that step.) Its bytes may be in our tensors already: torn, healed next quorum
            raise StateTransferError(
                f"replica {self.replica_id}: member {src} of quorum {q['quorum_id']} served a "
                f"state at step {clip_repr(got)}, not the quorum's step {q['max_step']}: "
                f"not loaded",
                partial=True,
            )
        self._load_state_dict(state["user"])
        self._step = got
        self._torn = False
        self.metrics.heals += 1
        self.metrics.heal_bytes += int(hdr["total"])
        self.metrics.heal_s.append(secs)

    def _set_heal_sock(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._heal_sock = sock
        if sock is not None and self._error is not None:  # failed before it was registered
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _serve_heal(self, conn: socket.socket) -> None:
        # every wait here is bounded by ``timeout`` (a progress limit while sending the state,
        # as the healer's receive has): an authenticated healer that sent nothing, or stopped
        # reading, kept this thread until shutdown
        if not self._heal_slots.acquire(blocking=False):
            send_msg(
                conn,
                {
                    "t": "error",
                    "error": f"replica {self.replica_id} is serving MAX_HEAL_CONNECTIONS="
                    f"{MAX_HEAL_CONNECTIONS} heal connections already",
                },
                time.monotonic() + self.timeout,
            )
            return
        try:
            msg = recv_msg(conn, deadline=time.monotonic() + self.timeout)
            if msg.get("t") != "get_state":
                why = f"unknown heal request {msg.get('t')!r}"
                send_msg(conn, {"t": "error", "error": why}, time.monotonic() + self.timeout)
                return
            with self._lock:
                busy = "torn" if self._torn else "being received" if self._receiving else None
            if busy is not None:  # the healer's quorum retries, as for any failed heal
                why = f"replica {self.replica_id}'s state is {busy}"
                send_msg(conn, {"t": "error", "error": why}, time.monotonic() + self.timeout)
                return
            send_state(conn, {"user": self._state_dict(), "step": self._step}, timeout=self.timeout)
        finally:
            self._heal_slots.release()

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor) -> _Work:
        """Average ``tensor`` in place over the quorum (async); ``wait()`` says if it succeeded.

        The average needs a floating-point or complex tensor of a dtype the reduction takes
        (:data:`AVERAGEABLE`: not float8): any other dtype is refused here with
        :class:`CollectiveArgumentError` (sum an integer counter on ``process_group``
        instead). torchft divides in a continuation of the sum, where an integer tensor fails
        the step; here ``wait()`` raised a bare RuntimeError after the sum had already landed,
        and the step still committed.

        A non-contiguous tensor (or one with a lazy conj/neg bit) is reduced as a contiguous
        copy, which a successful ``wait()`` copies back; one whose elements share memory (an
        expanded view) is refused here with :class:`CollectiveArgumentError`.
        """
        if tensor.dtype not in AVERAGEABLE:
            # refused whatever the quorum's size: a quorum of one never divides, so a late check
            # let a program pass with one replica and fail once a second joined
            raise CollectiveArgumentError(
                f"Manager.allreduce averages, which needs a floating-point or complex tensor of "
                f"a reducible dtype ({', '.join(str(d) for d in AVERAGEABLE)}), "
                f"got dtype {tensor.dtype}"
            )
        target = tensor
        if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            # reduced as a contiguous copy, copied back by ``wait``: torch's gloo reduced the
            # memory of a view as if it were contiguous (a column, or a transpose, got other
            # elements of its base averaged), and a lazy conj/neg bit was ignored
            if _overlaps(tensor):  # (copying back could not write each element once)
                raise CollectiveArgumentError(
                    f"Manager.allreduce writes the average into the tensor, whose elements "
                    f"must not share memory; got shape {tuple(tensor.shape)} with strides "
                    f"{tuple(tensor.stride())} (an expanded or overlapping view: pass a clone)"
                )
            tensor = tensor.resolve_conj().resolve_neg().contiguous()  # (a new tensor)
        n = len(self._members)
        w = _Work(self, tensor, n, target)
        with self._lock:
            self._works.append(w)
            if self._error is not None or self._pg is None:
                w.event.set()
                return w
        if n == 1:
            w.work = _Done()
            w.event.set()
            return w
        e = (
            self.recorder.record("allreduce", f"ft-q{self._qid}", [tensor])
            if self.recorder
            else None
        )
        try:
            if e is None:
                w.work = self._pg.allreduce([tensor])
            else:
                FlightRecorder.started(e)
                with already_recorded():  # (recorded above, under the quorum's name)
                    w.work = self._pg.allreduce([tensor])
        except Exception as err:
            if e is not None and self.recorder is not None:
                self.recorder.completed(e, err)
            self.report_error(CommError(f"allreduce could not start: {err}"))
            w.event.set()
            return w
        rec = self.recorder

        def finished(f: Any) -> None:
            if e is not None and rec is not None:
                try:
                    f.value()
                    rec.completed(e)
                except Exception as err:
                    rec.completed(e, err)
            w.event.set()

        w.work.get_future().add_done_callback(finished)
        return w

    def should_commit(self) -> bool:
        """Wait for this step's allreduces, vote, and return the unanimous decision.

        Called once per step, after :meth:`start_quorum` returned (as torchft's): without a
        quorum held, or a second time in one step, it raises :class:`QuorumError` and votes
        nothing. It raises :class:`ReplicaSupersededError` (after voting "no") once a newer
        process took this replica id.
        """
        with self._lock:
            may_vote, self._may_vote = self._may_vote, False
        if not may_vote or self._pg is None or self._qid == -1:
            if self._closed.is_set():
                why = "the manager was shut down"
            elif may_vote:
                why = "it holds no group"
            elif self._qid == -1:
                why = "it holds no quorum (call start_quorum() first)"
            else:
                why = (
                    f"this step of quorum {self._qid} was already voted on "
                    f"(call start_quorum() before each step's vote)"
                )
            raise QuorumError(f"replica {self.replica_id}: should_commit() cannot vote: {why}")
        for w in list(self._works):
            w.wait()
        ok = self._error is None
        rpc = self._rpc
        decision = False
        nxt: Any = None
        if rpc is not None:
            t_vote = time.perf_counter()
            try:
                rpc.settimeout(min(self.timeout + 5, _MAX_WAIT))
                send_msg(
                    rpc,
                    {
                        "t": "commit",
                        "rid": self.replica_id,
                        "quorum_id": self._qid,
                        "step": self._step,
                        "members": self._members,
                        "ok": ok,
                        "timeout": self.timeout,
                        "next": self._request(self._step + 1, 0.0) if ok else None,
                    },
                )
                reply = recv_msg(rpc)
                decision = reply.get("ok") is True
                nxt = reply.get("quorum")
                self.metrics.vote_s += time.perf_counter() - t_vote
                if reply.get("superseded"):
                    self._mark_superseded(str(reply.get("error")))
            except (OSError, CommError):
                self._inject_close()
                decision = False
        self.metrics.note(f"vote q{self._qid} step {self._step}: ok={ok} decision={decision}")
        if decision:
            self._step += 1
            self.metrics.commits += 1
            if isinstance(nxt, dict) and self._valid_next(nxt):
                with self._lock:
                    if self._error is None:
                        self._next = nxt
        else:
            self.metrics.aborted_steps += 1
            self._drop_group()
            self._check_superseded()
        return decision

    # -- queries ---------------------------------------------------------------------------
    def current_step(self) -> int:
        """Number of committed steps."""
        return self._step

    def num_participants(self) -> int:
        """Members of the current quorum."""
        return len(self._members)

    def participant_rank(self) -> int:
        """This replica's rank in the current quorum."""
        return self._rank

    @property
    def quorum_id(self) -> int:
        return self._qid

    @property
    def process_group(self) -> Any:
        """The process group of the current quorum (torchport or gloo)."""
        return self._pg

    def shutdown(self) -> None:
        """Leave the lighthouse's membership (it does not announce this replica as failed),
        then close connections and servers (the group is retired in the background). Waits at
        most about twice :data:`LEAVE_WAIT` s (capped by ``timeout``) for the lighthouse's
        acknowledgement and for the listener thread, so a failure dump it is writing is not
        cut off by a process exit right after."""
        self._closed.set()
        self._leave()
        self._inject_close()
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            listener.join(min(self.timeout, LEAVE_WAIT))
        self._heal_server.close()
        self._drop_group()
        # a TCPStore has no close(): its connection to the lighthouse's store goes with the last
        # reference (kept until the manager itself was freed)
        self._store = None
        if self._mesh is not None:
            self._mesh.close()


class _Done:
    """Stand-in Work for a quorum of one."""

    def get_future(self) -> Any:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(None)
        return fut
