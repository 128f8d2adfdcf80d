"""Regression tests for a review of fault tolerance: a replica beating more slowly than the
lighthouse was evicted at every step, per-call reconfigure timeouts were not checked, and the
constructors of Lighthouse, Manager and DistributedDataParallel took wrong types and odd values
(or failed with untyped errors)."""

from __future__ import annotations

import math
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.test_ft import _wait_for
from tests.test_ft_review import _manager
from torchport.distributed import (
    ReconfigureError,
    _get_reconfigure_handle,
    _reconfigure,
)
from torchport.distributed._control import connect, recv_msg, send_msg
from torchport.distributed.ft import DistributedDataParallel, Lighthouse, Manager
from torchport.distributed.reconfigure import ReconfigurableGroup

SECRET = b"h" * 32


def _hello(lh: Lighthouse, rid: str, socks: list, **fields: Any) -> socket.socket:
    """Open a heartbeat connection for ``rid`` with a hand-made hello (kept in ``socks``)."""
    hb = connect(lh.address, SECRET, "lighthouse", timeout=2)
    socks.append(hb)
    hb.settimeout(3)
    send_msg(hb, {"t": "hb", "rid": rid, **fields})
    return hb


def _dead(lh: Lighthouse, rid: str) -> list[str]:
    return [e for _, e in lh.events if e.startswith(f"replica {rid} dead")]


# -- 4: heartbeat periods ------------------------------------------------------------------------


def test_replica_beating_slower_than_the_lighthouse_commits_every_step():
    """A Manager beating every 0.3 s against a lighthouse whose period is 0.05 s was evicted
    after 0.15 s without a beat, at every step: no step ever committed, and nothing said why.
    The replica now sends its period in its hello and is evicted after three of the longer."""
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=0.05, secret=SECRET)
    mgr = _manager(lh, SECRET, "slow", heartbeat=0.3)
    committed = []
    try:
        for _ in range(3):
            mgr.start_quorum()
            time.sleep(0.4)  # one step's compute: longer than one beat period
            g = torch.ones(2)
            assert mgr.allreduce(g).wait(5.0)
            committed.append(mgr.should_commit())
        assert committed == [True, True, True], (committed, [e for _, e in lh.events])
        assert mgr.current_step() == 3 and not _dead(lh, "slow")
    finally:
        mgr.shutdown()
        lh.close()


def test_lighthouse_evicts_after_three_of_the_longer_period():
    """A replica's hello names its period; the lighthouse evicts it after three of the longer of
    its own and that one. An older replica's hello names none: its lighthouse's period holds."""
    lh = Lighthouse(min_replicas=1, heartbeat=0.05, secret=SECRET)
    socks: list = []
    try:
        t0 = time.monotonic()
        _hello(lh, "slow", socks, period=0.4)
        _hello(lh, "fast", socks, period=0.01)  # faster than the lighthouse: its period holds
        _hello(lh, "old", socks)  # an older replica's hello
        _wait_for(lambda: _dead(lh, "old") and _dead(lh, "fast"), 5, "old and fast evicted")
        assert _dead(lh, "old") == ["replica old dead (no heartbeat for 0.15 s)"]
        assert _dead(lh, "fast") == ["replica fast dead (no heartbeat for 0.15 s)"]
        if time.monotonic() - t0 < 1.0:  # (on a loaded host the check may come too late)
            assert not _dead(lh, "slow"), lh.events
        _wait_for(lambda: _dead(lh, "slow"), 5, "slow evicted")
        assert time.monotonic() - t0 >= 1.2
        assert _dead(lh, "slow") == ["replica slow dead (no heartbeat for 1.20 s)"]
    finally:
        for s in socks:
            s.close()
        lh.close()


@pytest.mark.parametrize(
    "period", [0, -1.0, "1", True, None, [1], 1e308], ids=lambda p: f"period={p!r}"
)
def test_heartbeat_hello_with_a_bad_period_is_refused(period):
    """A period that is no positive number of seconds a timer takes is refused with an error
    naming it, and the replica is not registered (it was ignored: the replica was taken to
    beat at the lighthouse's period)."""
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=SECRET)
    socks: list = []
    try:
        hb = _hello(lh, "bad", socks, period=period)
        reply = recv_msg(hb)
        assert reply["t"] == "error"
        assert reply["error"].startswith("heartbeat hello: period must be a finite number of")
        assert reply["error"].endswith(f"got {period!r}")
        assert not any("replica bad connected" in e for _, e in lh.events)
    finally:
        for s in socks:
            s.close()
        lh.close()


# -- 7: constructor arguments --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"min_replicas": 1.5}, "min_replicas must be an int >= 1, got 1.5"),
        ({"min_replicas": math.nan}, "min_replicas must be an int >= 1, got nan"),
        ({"min_replicas": "2"}, "min_replicas must be an int >= 1, got '2'"),
        ({"min_replicas": True}, "min_replicas must be an int >= 1, got True"),
        ({"join_timeout": "1"}, "join_timeout must be a finite number of seconds >= 0 .*got '1'"),
        ({"heartbeat": 1e308}, r"heartbeat must be .* at most 9.22337e\+09, got 1e\+308"),
    ],
    ids=repr,
)
def test_lighthouse_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        Lighthouse(secret=SECRET, **kw).close()


@pytest.mark.parametrize(
    "kw",
    [
        {"timeout": "5"},
        {"timeout": True},
        {"timeout": 1e308},
        {"timeout": None},
        {"quorum_timeout": None},
        {"quorum_timeout": threading.TIMEOUT_MAX * 2},
        {"heartbeat": 1e308},
        {"heartbeat": False},
    ],
    ids=repr,
)
def test_manager_rejects_bad_timeouts(kw):
    """A string failed with a bare TypeError, 1e308 with an OverflowError (or, as a heartbeat,
    killed the beat thread); True and None were accepted (None failed later in start_quorum)."""
    ((name, value),) = kw.items()
    why = rf"^{name} must be a finite number of seconds > 0 .*got {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=why):
        Manager(
            lighthouse=("127.0.0.1", 1),
            replica_id="a",
            state_dict=dict,
            load_state_dict=lambda s: None,
            **kw,
        ).shutdown()


@pytest.mark.parametrize("cap", [math.nan, math.inf, "25", 0, True], ids=repr)
def test_ddp_rejects_a_bad_bucket_cap(cap):
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a finite number of MiB > 0, got "):
        DistributedDataParallel(torch.nn.Linear(2, 2), object(), bucket_cap_mb=cap)  # type: ignore[arg-type]


def test_manager_takes_the_longest_timeout_a_wait_takes():
    """threading.TIMEOUT_MAX is accepted, and a step commits with it: the commit vote's socket
    timeout (timeout + 5 s) overflowed, and torch's store and gloo, handed it, timed out at
    once (their clocks count nanoseconds)."""
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=SECRET)
    big = threading.TIMEOUT_MAX
    mgr = _manager(lh, SECRET, "patient", timeout=big, quorum_timeout=big)
    out: list = []

    def step() -> None:
        try:
            mgr.start_quorum()
            out.append(mgr.should_commit())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=step, daemon=True)
    try:
        t.start()
        t.join(30)
        assert out == [True], out
    finally:
        mgr.shutdown()
        lh.close()
        t.join(10)


# -- 6: a reconfigure's timeout ------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeout",
    [5.0, timedelta(seconds=-1), timedelta(0), timedelta(days=10**6)],
    ids=repr,
)
def test_reconfigure_refuses_a_bad_timeout(timeout):
    """A float failed in Work.wait() with an AttributeError; a negative timedelta was taken; a
    zero one meant the group's 30 s. Each is a ReconfigureError naming the value now, as the
    group's own timeout is; None still means the group's."""
    g = ReconfigurableGroup(backend="gloo")
    try:
        h = _get_reconfigure_handle(g)
        why = rf"timeout must be a datetime.timedelta > 0 .*got {re.escape(repr(timeout))}$"
        with pytest.raises(ReconfigureError, match=why):
            _reconfigure(1, [h], g, timeout=timeout).wait(10)
        assert g.pg is None  # nothing was formed
        assert _reconfigure(2, [h], g, timeout=None).wait(10)
        h = _get_reconfigure_handle(g)  # (rotated by the reconfigure)
        assert _reconfigure(3, [h], g, timeout=timedelta(seconds=5)).wait(10)
    finally:
        g.close()
    with pytest.raises(ReconfigureError, match=r"timeout must be .* got 5.0"):
        ReconfigurableGroup(backend="gloo", timeout=5.0)  # type: ignore[arg-type]


def test_gloo_reconfigure_takes_the_longest_timeout():
    """A timeout of threading.TIMEOUT_MAX (the most a reconfigure takes) reached torch's store
    and gloo as it was: their nanosecond clocks wrapped around and the new member's store
    timed out at once. They are handed at most half of it now."""
    gs = [ReconfigurableGroup(backend="gloo") for _ in range(2)]
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        big = timedelta(seconds=threading.TIMEOUT_MAX)
        works = [_reconfigure(1, hs, g, timeout=big) for g in gs]
        assert [w.wait(30) for w in works] == [True, True]
        assert [(g.rank(), g.size()) for g in gs] == [(0, 2), (1, 2)]
    finally:
        for g in gs:
            g.close()


@pytest.mark.timeout(60)
def test_manager_allreduce_is_recorded_once_with_the_recorder_installed(tmp_path):
    """With ``flight_recorder.install(rec)`` in force, a ``Manager(recorder=rec).allreduce`` was
    recorded twice: under the quorum's name by the manager, and again by the installed hook of
    the torchport group's ``allreduce`` (under a group with no known members)."""
    from tests.test_ft import _ft_replicas, _quorum
    from torchport.distributed import flight_recorder as fr
    from torchport.distributed.flight_recorder import FlightRecorder

    rec = FlightRecorder(dump_dir=str(tmp_path), rank=0, world_size=1)
    fr.install(rec, signal_dump=False)
    secret = b"q" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=5.0, secret=secret)
    managers: list[Manager] = []
    try:
        replica = _ft_replicas(lh, secret, managers, quorum_timeout=5.0, recorder=rec)
        a, b = replica("a", torch.zeros(4)), replica("b", torch.ones(4))
        assert _quorum(a, b) == []
        ta, tb = torch.ones(3), torch.full((3,), 3.0)
        commits: dict[str, bool] = {}

        def step(m: Manager, t: torch.Tensor, k: str) -> None:
            m.allreduce(t).wait()
            commits[k] = m.should_commit()

        threads = [
            threading.Thread(target=step, args=(a, ta, "a")),
            threading.Thread(target=step, args=(b, tb, "b")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert commits == {"a": True, "b": True}
        assert ta.tolist() == tb.tolist() == [2.0, 2.0, 2.0]
        entries = [(e["op"], e["group"], e["state"]) for e in rec.snapshot()["entries"]]
        assert entries == [("allreduce", "ft-q1", "completed")] * 2, entries  # one per replica
    finally:
        for m in managers:
            m.shutdown()
        lh.close()
        fr.uninstall()
        rec.stop()
