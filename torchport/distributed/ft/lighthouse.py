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
  answered "no" (and a member's malformed one is a "no" for everyone).
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
    default_secret,
    master_store,
    recv_msg,
    send_msg,
)
from torchport.distributed.elastic import Member
from torchport.distributed.errors import CommError, WireError, clip_repr, is_int

_log = logging.getLogger(__name__)


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
    alive: bool = True
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Vote:
    members: list[str]
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
        self._secret = secret or default_secret()
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
            if hello.get("t") == "hb":
                rid = hello.get("rid")
                if not isinstance(rid, str):
                    self._refuse(
                        conn, f"heartbeat hello: rid must be a string, got {clip_repr(rid)}"
                    )
                    return
                # the replica's own period: evicted after three of this lighthouse's, a replica
                # beating more slowly was evicted at every step and never committed
                try:
                    period = check_number("period", hello.get("period", self.heartbeat))
                except ValueError as e:
                    self._refuse(conn, f"heartbeat hello: {e}")
                    return
                self._heartbeats(conn, rid, period)
            elif hello.get("t") == "rpc":
                while True:
                    msg = recv_msg(conn)
                    if msg.get("t") == "quorum":
                        send_msg(conn, self._quorum(msg))
                    elif msg.get("t") == "commit":
                        send_msg(conn, self._commit(msg))
                    else:
                        self._refuse(conn, f"unknown lighthouse request {clip_repr(msg.get('t'))}")
                        return
            else:
                self._refuse(conn, f"unknown lighthouse hello {clip_repr(hello.get('t'))}")
        except WireError as e:
            _log.warning("lighthouse: %s; closing the connection", e)

    @staticmethod
    def _refuse(conn: socket.socket, why: str) -> None:
        """Answer a malformed request with an error, log it in one line (the caller closes)."""
        _log.warning("lighthouse: refused %s; closing the connection", why)
        send_msg(conn, {"t": "error", "error": why})

    def _heartbeats(self, conn: socket.socket, rid: str, period: float) -> None:
        rep = _Replica(rid, conn, time.monotonic(), period)
        with self._cv:
            old = self._replicas.get(rid)
            self._replicas[rid] = rep
            self._log(f"replica {rid} connected")
            self._cv.notify_all()
        if old is not None and old.alive:
            self._declare_dead([old], "reconnected")
        conn.settimeout(None)
        try:
            while True:
                recv_msg(conn, limit=1024)
                with self._cv:
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

    def _push(self, rep: _Replica, msg: dict[str, Any]) -> None:
        try:
            with rep.send_lock:
                send_msg(rep.hb_conn, msg)
        except OSError:
            pass

    def _declare_dead(self, reps: list[_Replica], why: str) -> None:
        with self._cv:
            newly = [r for r in reps if r.alive]
            for r in newly:
                r.alive = False
                self._pending.pop(r.rid, None)
                self._busy.discard(r.rid)
                self._log(f"replica {r.rid} dead ({why})")
            if not newly:
                return
            ids = [r.rid for r in newly]
            for v in self._votes.values():
                if v.decision is None and any(i in v.members for i in ids):
                    v.decision = False
                    self._force_new = True
            targets = [r for r in self._replicas.values() if r.alive]
            self._cv.notify_all()
        notice = {"t": "dead", "ids": ids, "why": why}
        for r in targets:
            self._push(r, notice)

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

    def _quorum(self, msg: dict[str, Any]) -> dict[str, Any]:
        # a malformed request is refused here: stored as pending, it made every other replica's
        # quorum request fail (each handler evaluates all pending steps) until its sender died
        bad = _bad_request(msg)
        if bad is not None:
            return {"t": "error", "error": f"malformed quorum request: {bad}"}
        rid = str(msg["rid"])
        deadline = time.monotonic() + float(msg.get("timeout", 60.0))
        with self._cv:
            rep = self._replicas.get(rid)
            if rep is None or not rep.alive:
                return {"t": "error", "error": f"replica {rid} has no live heartbeat connection"}
            if not self._pending:
                self._first_request = time.monotonic()
            self._pending[rid] = msg
            self._busy.discard(rid)
            my_round = self._round
            while self._round == my_round:
                if self._stop.is_set():  # closed: no quorum (nor store) after close
                    self._pending.pop(rid, None)
                    return {"t": "error", "error": "the lighthouse was closed"}
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
            if rid not in res["members"]:
                return {"t": "error", "error": f"replica {rid} was evicted while waiting"}
            return res

    # -- commit ----------------------------------------------------------------------------
    def _commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        bad = _bad_vote(msg)
        if bad is not None:
            return {"t": "commit", "ok": False, "quorum": None, "error": f"malformed vote: {bad}"}
        rid, qid, step = str(msg["rid"]), int(msg["quorum_id"]), int(msg["step"])
        deadline = time.monotonic() + float(msg.get("timeout", 60.0))
        with self._cv:
            foreign = self._foreign_vote(rid, qid, msg["members"])
            if foreign is not None:
                _log.warning("lighthouse: refused a vote from %s: %s", clip_repr(rid), foreign)
                if self._last is not None and qid == self._quorum_id and rid in self._members:
                    # a member that will not apply the step: the others must not either (they
                    # waited out their timeout for a vote that never came)
                    failed = self._votes.setdefault((qid, step), _Vote(list(self._members)))
                    if failed.decision is None:
                        failed.decision = False
                        self._force_new = True
                    self._busy.discard(rid)
                    self._cv.notify_all()
                return {"t": "commit", "ok": False, "quorum": None, "error": foreign}
            key = (qid, step)
            vote = self._votes.get(key)
            if vote is None:
                vote = self._votes[key] = _Vote(list(msg["members"]))
                for old in [k for k in self._votes if k[0] < qid - 4]:
                    del self._votes[old]
            vote.votes[rid] = bool(msg["ok"])
            nxt = msg.get("next")
            if isinstance(nxt, dict):
                vote.nexts[rid] = nxt
            self._busy.discard(rid)
            if not msg["ok"] and vote.decision is None:
                vote.decision = False
                self._force_new = True
            dead = [m for m in vote.members if not self._is_alive(m)]
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

    def _foreign_vote(self, rid: str, qid: int, members: list[str]) -> str | None:
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

    def _is_alive(self, rid: str) -> bool:
        r = self._replicas.get(rid)
        return r is not None and r.alive

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
