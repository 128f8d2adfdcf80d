"""The lighthouse: membership, per-step quorum and commit votes for fault-tolerant training.

Each replica (one data-parallel copy of the model) keeps two authenticated connections to the
lighthouse: a *heartbeat* channel, on which it sends a beat every period and receives pushed
failure notices, and an *rpc* channel for quorum requests and commit votes.

* **Failure detection.** A replica whose heartbeat connection closes (process crashed, socket
  closed) is dead at once; one whose beats stop for three periods (hung, SIGSTOP) is evicted: three
  of the longer of the lighthouse's period and the replica's own, which its heartbeat hello names
  (``"period"``; a hello without one, from an older replica, is taken to beat at the
  lighthouse's). The lighthouse then pushes ``{"t": "dead"}`` to every replica of the current
  quorum, so their in-flight collectives are abandoned within milliseconds of a crash. An evicted
  replica that starts beating again is told ``{"t": "evicted"}`` and rejoins through the next
  quorum (healing first).
* **Leaving.** A replica that shuts down cleanly sends ``{"t": "leave"}`` on its heartbeat
  connection first and is answered ``{"t": "leave_ok"}``: it is removed from membership and is
  not declared dead (its connection closing afterwards is no failure). The others are told
  ``{"t": "left"}``; the next quorum simply lacks it. An undecided vote it is a member of fails,
  as for a death (it will not apply that step).
* **Quorum.** A quorum forms when every live replica has asked for one, or when at least
  ``min_replicas`` have asked and ``join_timeout`` has passed since the first request. Members are
  ordered by replica id; the quorum id changes whenever membership changes, a commit failed, or a
  member lost its group, which tells the replicas to form a new process group. The reply names the
  highest step among members, so replicas behind it heal from one that is at it (a replica whose
  state a broken-off heal tore asks at step 0, marked torn, and heals from a valid member).
  Two rules prevent a split brain (two disjoint quorums committing the same step from different
  states): a round never forms while a live member of the previous quorum has neither voted nor
  asked again (however slow it is), and while a live replica that committed the highest step
  has not asked, a round of replicas that are all behind it waits for it.
* **Commit vote.** After the gradient allreduce every member votes; the step commits only if every
  member of the quorum voted yes. A member that dies before voting turns the vote into "no" for
  everyone, so a step is applied by all survivors or by none, and never twice. A vote counts only
  from a member of the quorum handed out last, naming that quorum's id and members; any other is
  answered "no" (and a member's malformed one is a "no" for everyone). A member votes once
  per step: a second vote is answered "no" (and fails the step if it is still undecided); a
  vote after the decision never changes it. The lighthouse keeps the votes of the last
  :data:`VOTES_KEPT` steps of the current quorum (and any still undecided), not one per step.
* **One process per replica id.** Each replica process names its *life* (a random token, new
  per :class:`~torchport.distributed.ft.Manager`) in both hellos, and an rpc connection serves
  the replica id and life of its hello only. A second process with a live replica's id (a
  restart, or a mistaken duplicate) supersedes the first: the first is dead at once (its
  quorum's step fails), is told ``{"t": "superseded"}``, and every later hello or request of
  its life is refused with an error marked ``"superseded"`` (its manager raises
  ``ReplicaSupersededError``), so it never counts again. Two processes with one id both
  accepted were two quorum members in one slot: each committed alone, a "no" vote of one
  was answered "commit" on the other's "yes", and the committed step went backwards. (A hello
  without a life, from an older client, is a life of its own per heartbeat connection; an rpc
  hello without a replica id serves the id of its first request.)
* **One round trip per step.** A vote may carry the member's request for the next step's quorum
  (``"next"``). When the step commits unanimously, every member's vote carried one, every live
  replica is a member, nobody else is waiting for a quorum and no new quorum is forced, the reply
  to the vote already holds the next quorum: same members and quorum id, everyone at the step
  just committed. In any other case the reply holds none and the members ask as usual, so a
  joining or restarted replica is never kept out, and the split-brain rules above are untouched
  (the members of the quorum handed out count as busy until they vote or ask again).

The lighthouse also hosts the ``TCPStore`` that gloo replicas build their groups through (started
only when a gloo replica asks); torchport replicas instead send their mesh address with each quorum
request and receive every member's, over the authenticated connection.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import numbers
import operator
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchport import config
from torchport.distributed._control import (
    Server,
    job_secret,
    master_store,
    recv_msg,
    send_msg,
)
from torchport.distributed.elastic import Member
from torchport.distributed.errors import CommError, WireError, clip_repr, is_int

_log = logging.getLogger(__name__)

# votes kept per quorum: the steps before the newest are read only by a late or duplicate vote
# (answered from the record). One entry per step was kept for as long as the quorum id lasted,
# and every new vote scanned them all: 30000 steps held 30000 entries (+82 MiB)
VOTES_KEPT = 4
# lives superseded by a newer process of their replica id, remembered so that they are refused
# (the oldest forgotten first; a forgotten one is refused as having no heartbeat connection)
MAX_SUPERSEDED = 4096
# ``Lighthouse.events`` keeps at least the last MAX_EVENTS entries (trimmed in halves)
MAX_EVENTS = 1000


def check_number(
    name: str,
    value: Any,
    *,
    zero_ok: bool = False,
    unit: str = "seconds",
    most: float | None = None,
) -> float:
    """``value`` as a float, checked: a real number that is no bool, finite, > 0 (>= 0 with
    ``zero_ok``) and at most ``most`` (default ``threading.TIMEOUT_MAX``, the longest wait a
    timer or socket takes); else ``ValueError`` naming ``name`` and the value. A string failed
    with a bare TypeError, and 1e308 s with an OverflowError in a thread that then died."""
    limit = threading.TIMEOUT_MAX if most is None else most
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # (numpy's too)
        with contextlib.suppress(OverflowError):  # (an int past a float's range)
            number = float(value)
    if math.isfinite(number) and (number >= 0 if zero_ok else number > 0) and number <= limit:
        return number
    bound = f" and at most {limit:g}" if math.isfinite(limit) else ""
    raise ValueError(
        f"{name} must be a finite number of {unit} {'>=' if zero_ok else '>'} 0{bound}, "
        f"got {clip_repr(value)}"
    )


@dataclass
class _Replica:
    rid: str
    hb_conn: socket.socket
    last_beat: float
    period: float  # its heartbeat period (s), from its hello
    life: str  # its process life, from its hello (a token per connection if the hello has none)
    alive: bool = True
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Caller:
    """Who an rpc connection speaks for: its hello's replica id and life (a hello without an
    id takes its first request's; one without a life, the replica's life at its first
    accepted request)."""

    rid: str | None
    life: str | None


class _Superseded(Exception):
    """An rpc request from a life a newer process of its replica id replaced."""


@dataclass
class _Vote:
    members: list[str]
    lives: dict[str, str]  # the member lives that joined the quorum
    votes: dict[str, bool] = field(default_factory=dict)
    decision: bool | None = None
    nexts: dict[str, dict[str, Any]] = field(default_factory=dict)  # next-quorum requests
    quorum: dict[str, Any] | None = None  # the next quorum, when handed out with the decision


class Lighthouse:
    """Quorum and failure-detection service (runs as threads inside any process).

    Args:
        min_replicas: smallest quorum allowed to train.
        join_timeout: seconds to wait for live replicas that have not asked for the quorum yet.
        heartbeat: heartbeat period (s); a replica is evicted after 3 missed periods (of this
            period or the replica's own, whichever is longer).
        host, port: where to listen (127.0.0.1 and a free port by default).
        secret: shared job secret (default :func:`default_secret`).
    """

    def __init__(
        self,
        *,
        min_replicas: int = 1,
        join_timeout: float = 1.0,
        heartbeat: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
    ) -> None:
        # (1.5 or NaN replicas were accepted; a string failed with a bare TypeError)
        try:
            count = -1 if isinstance(min_replicas, bool) else operator.index(min_replicas)
        except TypeError:  # (no float: 1.5 or NaN)
            count = -1
        if count < 1:
            raise ValueError(f"min_replicas must be an int >= 1, got {clip_repr(min_replicas)}")
        # a zero heartbeat: the monitor thread spun flat out and every replica was evicted at once
        self.heartbeat = check_number(
            "heartbeat", config.get("ft_heartbeat") if heartbeat is None else heartbeat
        )
        self.join_timeout = check_number("join_timeout", join_timeout, zero_ok=True)
        self.min_replicas = count
        self._secret = job_secret(secret)
        self._cv = threading.Condition()
        self._replicas: dict[str, _Replica] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._first_request = 0.0
        self._quorum_id = 0
        self._members: list[str] = []
        self._force_new = False
        self._busy: set[str] = set()  # members of the last quorum that have not voted or asked
        self._top = 0  # highest committed step (the step number after the commit)
        self._holders: set[str] = set()  # the replicas that committed it
        self._round = 0
        self._result: dict[int, dict[str, Any]] = {}
        self._last: dict[str, Any] | None = None  # the last quorum handed out
        self._votes: dict[tuple[int, int], _Vote] = {}
        self._member_lives: dict[str, str] = {}  # the lives that joined the last quorum
        self._superseded: dict[str, str] = {}  # life -> replica id, oldest first
        self._conn_ids = itertools.count()  # tokens for the lives of hellos that name none
        self.events: list[tuple[float, str]] = []
        self._host = host
        self.store: Any = None  # a TCPStore, started when the first gloo replica asks
        self._server = Server(
            self._handle, secret=self._secret, role="lighthouse", host=host, port=port
        )
        self.address = self._server.address
        self._stop = threading.Event()
        self._mon = threading.Thread(target=self._monitor, name="tp-lighthouse-mon", daemon=True)
        self._mon.start()

    # -- connections -------------------------------------------------------------------------
    def _handle(self, conn: socket.socket) -> None:
        # A malformed frame or request from an authenticated peer is answered (where a reply
        # can be framed) and logged in one line, and only this connection closes: a heartbeat
        # hello without "rid" raised KeyError out of the handler thread (a traceback, no reply)
        try:
            hello = recv_msg(conn)
            kind = hello.get("t")
            if kind not in ("hb", "rpc"):
                self._refuse(conn, f"unknown lighthouse hello {clip_repr(kind)}")
                return
            rid, life = hello.get("rid"), hello.get("life")
            what = "heartbeat hello" if kind == "hb" else "rpc hello"
            # (an rpc hello may name no replica id: it serves its first request's)
            if not isinstance(rid, str) and (kind == "hb" or rid is not None):
                self._refuse(conn, f"{what}: rid must be a string, got {clip_repr(rid)}")
                return
            if life is not None and not isinstance(life, str):
                self._refuse(conn, f"{what}: life must be a string, got {clip_repr(life)}")
                return
            if kind == "hb":
                # the replica's own period: evicted after three of this lighthouse's, a replica
                # beating more slowly was evicted at every step and never committed
                try:
                    period = check_number("period", hello.get("period", self.heartbeat))
                except ValueError as e:
                    self._refuse(conn, f"heartbeat hello: {e}")
                    return
                self._heartbeats(conn, str(rid), period, life)  # (a str: checked above)
                return
            # each request is checked against the hello's replica id and life: a request may
            # not speak for another replica, nor for a process a newer one superseded
            caller = _Caller(rid, life)
            while True:
                msg = recv_msg(conn)
                if msg.get("t") == "quorum":
                    send_msg(conn, self._quorum(msg, caller))
                elif msg.get("t") == "commit":
                    send_msg(conn, self._commit(msg, caller))
                else:
                    self._refuse(conn, f"unknown lighthouse request {clip_repr(msg.get('t'))}")
                    return
        except WireError as e:
            _log.warning("lighthouse: %s; closing the connection", e)

    @staticmethod
    def _refuse(conn: socket.socket, why: str, superseded: bool = False) -> None:
        """Answer a malformed request with an error, log it in one line (the caller closes)."""
        _log.warning("lighthouse: refused %s; closing the connection", why)
        reply: dict[str, Any] = {"t": "error", "error": why}
        if superseded:
            reply["superseded"] = True
        send_msg(conn, reply)

    def _heartbeats(self, conn: socket.socket, rid: str, period: float, life: str | None) -> None:
        # a hello without a life (an older client): a life of its own per connection
        token = life if life is not None else f"#{next(self._conn_ids)}"
        rep = _Replica(rid, conn, time.monotonic(), period, token)
        notice = None
        with self._cv:
            refused = token in self._superseded
            old = None if refused else self._replicas.get(rid)
            if not refused:
                self._replicas[rid] = rep
                self._log(f"replica {rid} connected")
                if old is not None:
                    # the old connection's death and the new one's registration are one step
                    # under the lock: a request of the new life in between had its pending
                    # quorum request dropped as the old one's
                    if old.life != token:
                        self._supersede(old)
                    why = "superseded by a new process" if old.life != token else "reconnected"
                    notice = self._mark_dead([old], why)
            self._cv.notify_all()
        if refused:
            self._refuse(conn, _superseded_why(rid), superseded=True)
            return
        if notice is not None:
            self._send_notice(*notice)
        if old is not None and old.life != token:
            # told, and its heartbeat connection closed: a superseded process that resumed
            # (SIGCONT) was revived by its next beat and counted as the replica again
            self._push(old, {"t": "superseded", "error": _superseded_why(rid)})
            with contextlib.suppress(OSError):
                old.hb_conn.shutdown(socket.SHUT_RDWR)
        conn.settimeout(None)
        try:
            while True:
                msg = recv_msg(conn, limit=1024)
                if msg.get("t") == "leave":  # a clean shutdown: gone, but not dead
                    self._leave(rep)
                    return
                with self._cv:
                    if self._replicas.get(rid) is not rep:  # replaced: a newer connection speaks
                        return
                    if not rep.alive:  # came back after an eviction (e.g. SIGCONT)
                        self._push(rep, {"t": "evicted"})
                        rep.alive = True
                        self._log(f"replica {rid} is beating again after eviction")
                        self._cv.notify_all()
                    rep.last_beat = time.monotonic()
        except (OSError, CommError):
            pass
        with self._cv:
            current = self._replicas.get(rid) is rep
        if current:
            self._declare_dead([rep], "connection lost")

    def _leave(self, rep: _Replica) -> None:
        """``rep``'s replica shuts down cleanly (its manager sent ``{"t": "leave"}``): removed
        from membership without being declared dead, and told ``{"t": "leave_ok"}``.

        Announced as ``dead``, a replica that ended normally made every peer still running
        abort its step and write a Flight Recorder failure dump. Now the others get
        ``{"t": "left"}`` (they drop a next quorum naming it; one in a step with it fails that
        step, which cannot commit without it) and the next round simply lacks it. An
        undecided vote it is a member of still fails, as for a death: it will not apply it."""
        rid = rep.rid
        notice: dict[str, Any] | None = None
        targets: list[_Replica] = []
        with self._cv:
            if self._replicas.get(rid) is rep:  # (a replaced life's leave changes nothing)
                del self._replicas[rid]
                self._pending.pop(rid, None)
                self._busy.discard(rid)
                for v in self._votes.values():
                    if v.decision is None and rid in v.members:
                        v.decision = False
                        self._force_new = True
                self._log(f"replica {rid} left")
                self._cv.notify_all()
                notice = {"t": "left", "ids": [rid]}
                targets = [r for r in self._replicas.values() if r.alive]
        self._push(rep, {"t": "leave_ok"})
        if notice is not None:
            self._send_notice(notice, targets)

    def _supersede(self, old: _Replica) -> None:
        """Remember ``old``'s life as superseded (refused from now on). Lock held."""
        self._superseded[old.life] = old.rid
        while len(self._superseded) > MAX_SUPERSEDED:  # (oldest first)
            del self._superseded[next(iter(self._superseded))]
        self._log(f"replica {old.rid}: a new process superseded the previous one")

    def _check_caller(self, caller: _Caller, rid: str) -> str | None:
        """Why the rpc connection ``caller`` may not speak for replica ``rid`` now, or None;
        raises :class:`_Superseded` for a superseded life. Lock held. A caller whose hello
        named no id (or no life) is bound to its first request's (to the replica's life then).
        """
        if caller.rid is None:
            caller.rid = rid
        elif rid != caller.rid:
            return (
                f"this connection speaks for replica {clip_repr(caller.rid)}, "
                f"the request names {clip_repr(rid)}"
            )
        if caller.life is not None and caller.life in self._superseded:
            raise _Superseded(_superseded_why(rid))
        rep = self._replicas.get(rid)
        if rep is None or not rep.alive:
            return f"replica {rid} has no live heartbeat connection"
        if caller.life is None:
            caller.life = rep.life
        elif caller.life != rep.life:  # (its heartbeat hello is not registered yet)
            return f"replica {rid} has no live heartbeat connection from this process"
        return None

    def _push(self, rep: _Replica, msg: dict[str, Any]) -> None:
        try:
            with rep.send_lock:
                send_msg(rep.hb_conn, msg)
        except OSError:
            pass

    def _mark_dead(
        self, reps: list[_Replica], why: str
    ) -> tuple[dict[str, Any], list[_Replica]] | None:
        """Mark ``reps`` dead and fail the undecided votes they are members of; the notice to
        push and to whom (None if none was alive). Lock held."""
        newly = [r for r in reps if r.alive]
        for r in newly:
            r.alive = False
            self._pending.pop(r.rid, None)
            self._busy.discard(r.rid)
            self._log(f"replica {r.rid} dead ({why})")
        if not newly:
            return None
        ids = [r.rid for r in newly]
        for v in self._votes.values():
            if v.decision is None and any(i in v.members for i in ids):
                v.decision = False
                self._force_new = True
        self._cv.notify_all()
        targets = [r for r in self._replicas.values() if r.alive]
        return {"t": "dead", "ids": ids, "why": why}, targets

    def _send_notice(self, notice: dict[str, Any], targets: list[_Replica]) -> None:
        for r in targets:
            self._push(r, notice)

    def _declare_dead(self, reps: list[_Replica], why: str) -> None:
        with self._cv:
            notice = self._mark_dead(reps, why)
        if notice is not None:
            self._send_notice(*notice)

    def _monitor(self) -> None:
        while not self._stop.wait(min(self.heartbeat / 4, 0.02)):
            now = time.monotonic()
            with self._cv:
                late = [
                    r
                    for r in self._replicas.values()
                    if r.alive and now - r.last_beat > self._patience(r)
                ]
                self._cv.notify_all()  # lets waiting quorums re-check their timeouts
            by_patience: dict[float, list[_Replica]] = {}
            for r in late:  # (one notice for all that were late by the same bound)
                by_patience.setdefault(self._patience(r), []).append(r)
            for patience, reps in by_patience.items():
                self._declare_dead(reps, f"no heartbeat for {patience:.2f} s")

    def _patience(self, rep: _Replica) -> float:
        """Seconds without a beat after which ``rep`` is evicted: three periods, of the longer
        of the lighthouse's and the replica's own."""
        return 3 * max(self.heartbeat, rep.period)

    def _log(self, what: str) -> None:
        self.events.append((time.time(), what))
        if len(self.events) >= 2 * MAX_EVENTS:  # (a list, trimmed in halves: it grew forever)
            del self.events[:MAX_EVENTS]

    # -- quorum ----------------------------------------------------------------------------
    def _ready(self) -> bool:
        alive = {r.rid for r in self._replicas.values() if r.alive}
        asked = set(self._pending) & alive
        if len(asked) < self.min_replicas or (self._busy & alive) - asked:
            return False
        if max(int(self._pending[r]["step"]) for r in asked) < self._top and (
            (self._holders & alive) - asked
        ):
            # nobody asking holds the latest committed state: wait for a holder who has not
            # asked yet. A holder that asks at a lower step never applied it (its vote's reply
            # was lost): waiting for it waited for itself, and the round never formed.
            return False
        if alive <= asked:
            return True
        return time.monotonic() - self._first_request > self.join_timeout

    def _gloo_store(self, infos: list[dict[str, Any]]) -> int:
        """Port of the store gloo replicas rendezvous through (torchport replicas need none, so
        a torchport-only job never opens this unauthenticated port)."""
        if (
            self.store is None
            and not self._stop.is_set()
            and any(i.get("mesh") is None for i in infos)
        ):
            self.store = master_store(self._host)  # (on host only, not on *)
            self._log(f"gloo store started on port {self.store.port}")
        return int(self.store.port) if self.store is not None else 0

    def _form(self) -> None:
        members = sorted(self._pending)
        stale = any(int(self._pending[m].get("group", -1)) != self._quorum_id for m in members)
        if members != self._members or self._force_new or stale:
            self._quorum_id += 1
            self._members = members
            self._force_new = False
        self._busy = set(members)
        # (a pending request is always its replica's current life's: a superseded or dead
        # life's is dropped, and only the current life's requests are taken)
        self._member_lives = {m: self._replicas[m].life for m in members}
        infos = [self._pending[m] for m in members]
        max_step = max(int(i["step"]) for i in infos)
        self._result[self._round] = {
            "t": "quorum",
            "quorum_id": self._quorum_id,
            "members": members,
            "steps": [int(i["step"]) for i in infos],
            "torn": [bool(i.get("torn")) for i in infos],  # at step 0, no valid state to serve
            "heal_addrs": [i["heal_addr"] for i in infos],
            "meshes": [i.get("mesh") for i in infos],  # torchport members' mesh listeners
            "max_step": max_step,
            "store_port": self._gloo_store(infos),
        }
        self._result.pop(self._round - 4, None)
        self._last = self._result[self._round]
        self._pending.clear()
        self._round += 1
        self._log(f"quorum {self._quorum_id}: {members} at step {max_step}")
        self._cv.notify_all()

    def _quorum(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        # a malformed request is refused here: stored as pending, it made every other replica's
        # quorum request fail (each handler evaluates all pending steps) until its sender died
        bad = _bad_request(msg)
        if bad is not None:
            return {"t": "error", "error": f"malformed quorum request: {bad}"}
        rid = str(msg["rid"])
        deadline = time.monotonic() + float(msg.get("timeout", 60.0))
        superseded = {"t": "error", "error": _superseded_why(rid), "superseded": True}
        with self._cv:
            try:
                why = self._check_caller(caller, rid)
            except _Superseded:
                return superseded
            if why is not None:
                return {"t": "error", "error": why}
            if not self._pending:
                self._first_request = time.monotonic()
            self._pending[rid] = msg
            self._busy.discard(rid)
            my_round = self._round
            while self._round == my_round:
                if self._stop.is_set():  # closed: no quorum (nor store) after close
                    self._pending.pop(rid, None)
                    return {"t": "error", "error": "the lighthouse was closed"}
                if caller.life in self._superseded:  # (its request was dropped then)
                    return superseded
                if self._ready():
                    self._form()
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._pending.pop(rid, None)
                    return {
                        "t": "error",
                        "error": f"quorum not reached within {msg.get('timeout')} s",
                    }
                self._cv.wait(min(left, 0.01))
            res = self._result[my_round]
            if caller.life in self._superseded:  # the round took the newer process's request
                return superseded
            if rid not in res["members"]:
                return {"t": "error", "error": f"replica {rid} was evicted while waiting"}
            return res

    # -- commit ----------------------------------------------------------------------------
    def _commit(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        bad = _bad_vote(msg)
        if bad is not None:
            return {"t": "commit", "ok": False, "quorum": None, "error": f"malformed vote: {bad}"}
        rid, qid, step = str(msg["rid"]), int(msg["quorum_id"]), int(msg["step"])
        deadline = time.monotonic() + float(msg.get("timeout", 60.0))
        with self._cv:
            try:
                stranger = self._check_caller(caller, rid)
            except _Superseded as e:
                # never counted: a superseded process's "yes" was taken as its replica's, and
                # the new process's "no" after it was answered "commit"
                _log.warning("lighthouse: refused a vote from %s: %s", clip_repr(rid), e)
                reply = {"t": "commit", "ok": False, "quorum": None, "error": str(e)}
                return {**reply, "superseded": True}
            if stranger is not None:  # another replica's connection, or no heartbeat
                _log.warning("lighthouse: refused a vote from %s: %s", clip_repr(rid), stranger)
                return {"t": "commit", "ok": False, "quorum": None, "error": stranger}
            foreign = self._foreign_vote(rid, caller.life, qid, msg["members"])
            if foreign is not None:
                _log.warning("lighthouse: refused a vote from %s: %s", clip_repr(rid), foreign)
                if self._last is not None and qid == self._quorum_id and rid in self._members:
                    # a member that will not apply the step: the others must not either (they
                    # waited out their timeout for a vote that never came)
                    failed = self._votes.setdefault(
                        (qid, step), _Vote(list(self._members), dict(self._member_lives))
                    )
                    if failed.decision is None:
                        failed.decision = False
                        self._force_new = True
                    self._busy.discard(rid)
                    self._cv.notify_all()
                return {"t": "commit", "ok": False, "quorum": None, "error": foreign}
            key = (qid, step)
            vote = self._votes.get(key)
            if vote is None:
                vote = self._votes[key] = _Vote(list(msg["members"]), dict(self._member_lives))
                self._prune_votes(qid, step)
            if rid in vote.votes:
                # one vote per member and step: a second one overwrote the first, and a "no"
                # after a decided "yes" was answered "commit"
                again = f"replica {rid} already voted on step {step} of quorum {qid}"
                _log.warning("lighthouse: refused a vote: %s", again)
                if vote.decision is None:
                    vote.decision = False
                    self._force_new = True
                    self._cv.notify_all()
                return {"t": "commit", "ok": False, "quorum": None, "error": again}
            vote.votes[rid] = bool(msg["ok"])
            nxt = msg.get("next")
            if isinstance(nxt, dict):
                vote.nexts[rid] = nxt
            self._busy.discard(rid)
            if not msg["ok"] and vote.decision is None:
                vote.decision = False
                self._force_new = True
            dead = [m for m in vote.members if not self._member_alive(vote, m)]
            if dead and vote.decision is None:
                vote.decision = False
                self._force_new = True
            if vote.decision is None and set(vote.votes) >= set(vote.members):
                vote.decision = all(vote.votes.values())
                if vote.decision and step + 1 >= self._top:
                    self._top, self._holders = step + 1, set(vote.members)
                if vote.decision:
                    vote.quorum = self._next_quorum(vote, qid, step)
            self._cv.notify_all()
            while vote.decision is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    vote.decision = False
                    self._force_new = True
                    break
                self._cv.wait(min(left, 0.01))
            quorum = vote.quorum if vote.decision and rid in vote.nexts else None
            return {"t": "commit", "ok": vote.decision, "quorum": quorum}

    def _prune_votes(self, qid: int, step: int) -> None:
        """Drop the decided votes of other quorums and of steps before the last
        :data:`VOTES_KEPT` (undecided ones are kept: voters wait on them, and a death fails
        them). Lock held."""
        for key in [
            k
            for k, v in self._votes.items()
            if v.decision is not None and (k[0] != qid or k[1] <= step - VOTES_KEPT)
        ]:
            del self._votes[key]

    def _foreign_vote(self, rid: str, life: str | None, qid: int, members: list[str]) -> str | None:
        """Why a vote is not one on the current quorum by one of its members, or None. Called
        with the lock held.

        The vote's member list was taken as given: an empty one (a replica voting before it
        held any quorum) was unanimous at once and advanced the committed step, so a commit
        must name the quorum handed out last, with its members, by one of them. An older
        quorum's vote cannot commit either: a newer round forms only once each live member of
        the last one has voted or asked again, or died (which fails its vote)."""
        if self._last is None:
            return f"quorum {qid} was never handed out (no quorum has formed yet)"
        if qid != self._quorum_id:
            return f"quorum {qid} is not the current quorum {self._quorum_id}"
        if members != self._members:
            return f"members {clip_repr(members)} are not quorum {qid}'s {clip_repr(self._members)}"
        if rid not in members:
            return f"replica {clip_repr(rid)} is not a member of quorum {qid}"
        if self._member_lives.get(rid) != life:
            return f"replica {clip_repr(rid)}'s process is not the one that joined quorum {qid}"
        return None

    def _next_quorum(self, vote: _Vote, qid: int, step: int) -> dict[str, Any] | None:
        """The next step's quorum handed out with a unanimous commit, or None (see the module
        docstring for when). Called with the lock held."""
        members = vote.members
        alive = {r.rid for r in self._replicas.values() if r.alive}
        last = self._last
        if (
            last is None
            or qid != self._quorum_id
            or members != self._members
            or set(vote.nexts) != set(members)
            or alive != set(members)
            or self._pending
            or self._force_new
            or any(int(vote.nexts[m].get("step", -1)) != step + 1 for m in members)
        ):
            return None
        res = {
            **last,
            "steps": [step + 1] * len(members),
            "max_step": step + 1,
            "torn": [False] * len(members),  # every one of them just trained and committed
            "heal_addrs": [vote.nexts[m].get("heal_addr") for m in members],
            "meshes": [vote.nexts[m].get("mesh") for m in members],
        }
        self._last = res
        self._busy = set(members)  # they are in the next step now
        return res

    def _member_alive(self, vote: _Vote, rid: str) -> bool:
        """Whether the life of ``rid`` that joined ``vote``'s quorum is alive."""
        r = self._replicas.get(rid)
        return r is not None and r.alive and r.life == vote.lives.get(rid)

    def close(self) -> None:
        """Stop serving (replicas see their connections close) and release the gloo store."""
        with self._cv:
            self._stop.set()
            # the store's server goes with its last reference: kept here, it went on listening
            # (and accepting anyone, unauthenticated) after close
            store, self.store = self.store, None
            self._cv.notify_all()
        self._server.close()
        del store


def _superseded_why(rid: str) -> str:
    return (
        f"replica {rid}: a newer process with the same replica id superseded this one (a "
        f"restarted replica, or two processes given one replica_id); it may not join a quorum "
        f"or vote again"
    )


def _is_seconds(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _bad_request(msg: Any) -> str | None:
    """What is wrong with a quorum request (alone or as a vote's ``next``), or None."""
    if not isinstance(msg, dict):
        return f"a request must be an object, got {type(msg).__name__}"
    if not isinstance(msg.get("rid"), str):
        return f"rid must be a string, got {msg.get('rid')!r}"
    if not is_int(msg.get("step")) or msg["step"] < 0:
        return f"step must be an int >= 0, got {msg.get('step')!r}"
    addr = msg.get("heal_addr")
    if not (isinstance(addr, list) and len(addr) == 2 and isinstance(addr[0], str)):
        return f"heal_addr must be [host, port], got {addr!r}"
    if not is_int(addr[1]):
        return f"heal_addr's port must be an int, got {addr[1]!r}"
    if "torn" in msg and not isinstance(msg["torn"], bool):
        return f"torn must be a bool, got {msg['torn']!r}"
    if "group" in msg and not is_int(msg["group"]):
        return f"group must be an int, got {msg['group']!r}"
    if "timeout" in msg and not _is_seconds(msg["timeout"]):
        return f"timeout must be a finite number of seconds >= 0, got {msg['timeout']!r}"
    mesh = msg.get("mesh")
    if mesh is not None:
        # its elements too: a list of any 4 values was handed to every member, whose
        # start_quorum then failed on it with a bare ValueError, not retried
        try:
            Member.from_json(mesh)
        except CommError as e:
            return f"mesh must be [id, host, port, host_id] or null: {e}"
    return None


def _bad_vote(msg: dict[str, Any]) -> str | None:
    """What is wrong with a commit vote, or None."""
    if not isinstance(msg.get("rid"), str):
        return f"rid must be a string, got {msg.get('rid')!r}"
    for key in ("quorum_id", "step"):
        if not is_int(msg.get(key)):
            return f"{key} must be an int, got {msg.get(key)!r}"
    members = msg.get("members")
    if not (isinstance(members, list) and all(isinstance(m, str) for m in members)):
        return f"members must be a list of replica ids, got {members!r}"
    if not isinstance(msg.get("ok"), bool):
        return f"ok must be a bool, got {msg.get('ok')!r}"
    if "timeout" in msg and not _is_seconds(msg["timeout"]):
        return f"timeout must be a finite number of seconds >= 0, got {msg['timeout']!r}"
    nxt = msg.get("next")
    if nxt is not None and _bad_request(nxt) is not None:
        return f"next: {_bad_request(nxt)}"
    return None


def _seconds_arg(*, zero_ok: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a duration flag, checked as the constructor checks it: a bad
    value is a usage error naming the flag (argparse does), the requirement and the value."""

    def parse(text: str) -> float:
        try:
            value: Any = float(text)
        except ValueError:  # (not a number at all: named as given)
            value = text
        try:
            return check_number("the value", value, zero_ok=zero_ok)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def main(argv: list[str] | None = None) -> None:
    """``python -m torchport.distributed.ft.lighthouse --port P --min-replicas N
    [--join-timeout S] [--heartbeat S]``."""
    from torchport.cli import int_at_least  # (the CLI's option types; not at import)

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_at_least(0, at_most=65535), default=29510)  # (0: any)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout", type=_seconds_arg(zero_ok=True), default=1.0)
    # the period the constructor takes: the CLI had no flag for it, so a lighthouse started
    # from the command line evicted after three of TORCHPORT_FT_HEARTBEAT's periods, always
    p.add_argument(
        "--heartbeat",
        type=_seconds_arg(),
        default=None,
        help="heartbeat period (s): a replica silent for three periods (of this or its own, "
        "whichever is longer) is evicted; default TORCHPORT_FT_HEARTBEAT",
    )
    a = p.parse_args(argv)
    try:
        lh = Lighthouse(
            min_replicas=a.min_replicas,
            join_timeout=a.join_timeout,
            heartbeat=a.heartbeat,
            host=a.host,
            port=a.port,
        )
    except ValueError as e:  # (--min-replicas 0, or TORCHPORT_FT_HEARTBEAT out of range)
        p.error(str(e))
    except OSError as e:  # (a --host that does not resolve or is not this machine's, a port
        # in use: a traceback before)
        p.error(f"cannot listen on --host {a.host!r} --port {a.port}: {e}")
    print(f"lighthouse on {lh.address[0]}:{lh.address[1]}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        lh.close()


if __name__ == "__main__":
    main()
