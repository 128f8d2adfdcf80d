"""Review 53 of the fault-tolerance package: a replica that shuts down cleanly leaves the
lighthouse's membership without being announced dead (peers neither fail a step nor write a
Flight Recorder failure dump), a crash is still announced, and ``Manager.shutdown`` waits for a
failure dump its listener thread is writing."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.ft_actors import small_manager
from torchport.distributed._control import PeerFailure
from torchport.distributed.ft import Lighthouse, Manager


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class _Recorder:
    """Stands in for a FlightRecorder: notes each abort dump, which takes ``slow`` seconds."""

    def __init__(self, slow: float = 0.0) -> None:
        self.slow = slow
        self.aborts: list[str] = []
        self.started = threading.Event()
        self.finished = threading.Event()

    def abort_hook(self, reason: str = "abort") -> None:
        self.started.set()
        time.sleep(self.slow)
        self.aborts.append(reason)
        self.finished.set()


def _both_in_quorum(a: Manager, b: Manager) -> None:
    t = threading.Thread(target=a.start_quorum, daemon=True)
    t.start()
    b.start_quorum()
    t.join(10)
    assert not t.is_alive()


def test_a_replica_that_shuts_down_leaves_without_being_announced_dead():
    """Manager.shutdown closed its sockets without a word: the lighthouse announced the replica
    ``dead (connection lost)`` and every peer still running failed its step and wrote a Flight
    Recorder failure dump, at the end of every normal run."""
    secret = b"l" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=0.5, secret=secret)
    rec = _Recorder()
    a = small_manager(lh, secret, "a", backend="torchport")
    b = small_manager(lh, secret, "b", backend="torchport", recorder=rec)
    try:
        _both_in_quorum(a, b)
        done = threading.Thread(target=a.should_commit, daemon=True)
        done.start()
        assert b.should_commit() is True  # (the next quorum, both, came with the commit)
        done.join(10)
        a.shutdown()
        _wait_for(lambda: any(e == "replica a left" for _, e in lh.events), 5, "a's leave")
        _wait_for(lambda: any("left" in w for w in b.metrics.log), 5, "b told of the leave")
        assert not [e for _, e in lh.events if "dead" in e], lh.events
        assert b.metrics.failures == [] and b.errored() is None and rec.aborts == []
        # the next quorum simply lacks it (the one handed out with the commit was dropped)
        lh.min_replicas = 1
        b.start_quorum()
        assert b.num_participants() == 1 and b.quorum_id > 0
        assert b.should_commit() is True and b.current_step() == 2
        assert rec.aborts == []
    finally:
        a.shutdown()
        b.shutdown()
        lh.close()


def test_a_crash_is_still_announced_and_shutdown_waits_for_the_failure_dump():
    """A replica whose connection drops without a leave is dead at once and fails its peers'
    step; the peer's failure dump, written on its listener thread, was cut off when the
    process exited right after ``shutdown`` returned (the demo's worker left an empty
    temporary file in its dump folder)."""
    secret = b"c" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=0.5, secret=secret)
    rec = _Recorder(slow=0.5)
    a = small_manager(lh, secret, "a", backend="torchport")
    b = small_manager(lh, secret, "b", backend="torchport", recorder=rec)
    try:
        _both_in_quorum(a, b)
        a._inject_close()  # a crash as the lighthouse sees it: no leave
        assert rec.started.wait(5), lh.events
        b.shutdown()  # while the dump is being written
        assert rec.finished.is_set(), "shutdown returned before the listener's dump ended"
        assert any(e == "replica a dead (connection lost)" for _, e in lh.events), lh.events
        assert isinstance(b.errored(), PeerFailure), b.errored()
        assert rec.aborts == ["abort: replica(s) ['a'] failed: connection lost"]
    finally:
        a.shutdown()
        b.shutdown()
        lh.close()
