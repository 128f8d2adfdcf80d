"""Reconfigure API: form, shrink, grow; errors on every rank; failure detection (real processes)."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest

from tests.ft_actors import Actors
from torchport.distributed import (
    ReconfigurableGroup,
    ReconfigureError,
    _get_reconfigure_handle,
    _reconfigure,
    _supports_reconfigure,
)
from torchport.distributed.reconfigure import parse_handle


@pytest.fixture(scope="module")
def actors():
    with Actors(4) as a:
        yield a


def _ok(results):
    assert all(s == "ok" for s, _ in results), results
    return [v for _, v in results]


@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_form_shrink_grow_and_errors_everywhere(actors, backend):
    A = actors
    hs = [A.call(i, "init_reconf", 0.2, backend, timeout=120) for i in range(4)]
    res = _ok(A.call_all([0, 1, 2, 3], "reconf", [(1, hs)] * 4))
    assert [r[:3] for r in res] == [("ok", i, 4) for i in range(4)]
    res = _ok(A.call_all([0, 1, 2, 3], "allreduce", [(i,) for i in range(4)]))
    assert all(r == ("ok", [6.0] * 5) for r in res)
    if backend == "torchport":  # a torchport communicator on shared memory, 3 connections each
        infos = [A.call(i, "group_info") for i in range(4)]
        assert all(inf[:3] == ("TorchportProcessGroup", "shm", 3) for inf in infos), infos
        assert sum(inf[3] for inf in infos) == 6  # each pair dialled once

    hs2 = [A.call(i, "handle") for i in range(4)]
    assert set(hs2).isdisjoint(hs)  # handles rotate after a reconfigure
    # a reused uuid fails on every rank, promptly
    res = _ok(A.call_all([0, 1, 2, 3], "reconf", [(1, hs2)] * 4))
    for r in res:
        assert r[0] == "error" and "uuid 1 was already used" in r[1] and r[2] < 5
    # a stale handle fails on every rank, promptly
    stale = [*hs2[:3], hs[3]]
    res = _ok(A.call_all([0, 1, 2, 3], "reconf", [(2, stale)] * 4))
    for r in res:
        assert r[0] == "error" and "stale" in r[1] and r[2] < 5

    # crash: survivors' in-flight op fails with a typed error, then they shrink
    A.kill(3)
    res = _ok(A.call_all([0, 1, 2], "allreduce", [(1,)] * 3))
    for r in res:
        assert r[0] == "error" and r[1] == "PeerFailure", r
    res = _ok(A.call_all([0, 1, 2], "reconf", [(3, hs2[:3])] * 3))
    assert [r[:3] for r in res] == [("ok", i, 3) for i in range(3)]
    res = _ok(A.call_all([0, 1, 2], "allreduce", [(1,)] * 3))
    assert all(r == ("ok", [3.0] * 5) for r in res), res
    if backend == "torchport":  # the shrink reused the live connections; the dead one is gone
        infos = [A.call(i, "group_info") for i in range(3)]
        assert all(inf[2:] == (2, 0) for inf in infos), infos

    # grow: a fresh process joins; a set lets the backend order ranks (sorted handles)
    A.add(3)
    h3 = A.call(3, "init_reconf", 0.2, backend, timeout=60)
    hs3 = [A.call(i, "handle") for i in range(3)] + [h3]
    res = _ok(A.call_all([0, 1, 2, 3], "reconf", [(4, set(hs3))] * 4))
    assert all(r[0] == "ok" for r in res), res
    assert sorted(r[1] for r in res) == [0, 1, 2, 3]
    assert [r[1] for r in res] == [sorted(hs3).index(h) for h in hs3]
    assert all(
        r == ("ok", [4.0] * 5) for r in _ok(A.call_all([0, 1, 2, 3], "allreduce", [(1,)] * 4))
    )
    if backend == "torchport":  # the grow dialled only the newcomer's connections
        infos = [A.call(i, "group_info") for i in range(4)]
        assert [inf[2] for inf in infos] == [3] * 4 and sum(inf[3] for inf in infos) == 3, infos

    # hang: a stopped rank is detected within a few heartbeats, independent of op timeouts
    A.kill(2, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        res = _ok(A.call_all([0, 1, 3], "allreduce", [(1,)] * 3, timeout=20))
        assert time.perf_counter() - t0 < 10
        for r in res:
            assert r[0] == "error" and r[1] == "PeerFailure" and "hung" in r[2], res
        # every survivor names the same rank: the stopped process's rank in the sorted handles
        stopped = sorted(hs3).index(hs3[2])
        assert all(f"rank {stopped} hung" in r[2] for r in res), res
    finally:
        A.kill(2, signal.SIGCONT)
    # the stopped rank resumes; the group is reformed without it (every survivor agrees)
    hs4 = [A.call(i, "handle") for i in (0, 1, 3)]
    res = _ok(A.call_all([0, 1, 3], "reconf", [(5, hs4)] * 3))
    assert [r[:3] for r in res] == [("ok", i, 3) for i in range(3)]
    assert all(r == ("ok", [3.0] * 5) for r in _ok(A.call_all([0, 1, 3], "allreduce", [(1,)] * 3)))
    if backend == "torchport":  # a transport hint: the same members, now over TCP
        hs5 = [A.call(i, "handle") for i in (0, 1, 3)]
        res = _ok(A.call_all([0, 1, 3], "reconf", [(6, hs5, 10.0, {"transport": "tcp"})] * 3))
        assert all(r[0] == "ok" for r in res), res
        assert all(A.call(i, "group_info")[1] == "tcp" for i in (0, 1, 3))
        res = _ok(A.call_all([0, 1, 3], "allreduce", [(2,)] * 3))
        assert all(r == ("ok", [6.0] * 5) for r in res), res


@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_bad_arguments_are_typed_errors(backend):
    g = ReconfigurableGroup(backend=backend)
    try:
        assert _supports_reconfigure(g)
        h = _get_reconfigure_handle(g)
        assert parse_handle(h)[0] == "127.0.0.1"
        with pytest.raises(ReconfigureError, match="uuid must be a non-negative int, got -3"):
            _reconfigure(-3, [h], g).wait()
        # a uuid past 64 bits had peers' JSON decoders fail (> 4300 digits) or shared fault
        # notices with the uuid 2**64 below it; 2**64 - 1 itself is taken
        with pytest.raises(ReconfigureError, match=rf"at most 2\*\*64 - 1 .*got {1 << 64}$"):
            _reconfigure(1 << 64, [h], g).wait()
        with pytest.raises(
            ReconfigureError, match=r"non-negative int, got a negative int of 16610"
        ):
            _reconfigure(-(10**5000), [h], g).wait()
        with pytest.raises(ReconfigureError, match=r"at most 2\*\*64 - 1 .*of 16610 bits"):
            _reconfigure(10**5000, [h], g).wait()
        with pytest.raises(ReconfigureError, match="at least one rank"):
            _reconfigure(1, [], g).wait()
        with pytest.raises(ReconfigureError, match="must be distinct"):
            _reconfigure(1, [h, h], g).wait()
        with pytest.raises(ReconfigureError, match="must look like 'tp1:host:port"):
            _reconfigure(1, [h, "garbage"], g).wait()
        with pytest.raises(ReconfigureError, match="is not among the handles"):
            _reconfigure(1, ["tp1:127.0.0.1:1:2:abc"], g).wait()
        with pytest.raises(ReconfigureError, match="unknown reconfigure hint 'colour'"):
            _reconfigure(1, [h], g, hints={"colour": "red"}).wait()
        with pytest.raises(ReconfigureError, match=r"hint 'transport' must be one of .* got 'ib'"):
            _reconfigure(1, [h], g, hints={"transport": "ib"}).wait()
        with pytest.raises(ReconfigureError, match="list or a set"):
            _reconfigure(1, h, g).wait()  # type: ignore[arg-type]
        with pytest.raises(ReconfigureError, match="no communicator yet"):
            g.barrier()
        # a dead peer's handle is stale at once
        t0 = time.perf_counter()
        with pytest.raises(ReconfigureError, match="stale: no process answers"):
            _reconfigure(5, [h, "tp1:127.0.0.1:1:1:dead"], g, timeout=timedelta(seconds=5)).wait()
        assert time.perf_counter() - t0 < 2
        # a group of one forms and works
        _reconfigure(7, [h], g).wait()
        assert (g.rank(), g.size()) == (0, 1)
    finally:
        g.close()
    with pytest.raises(ReconfigureError, match="backend 'torchport' or 'gloo', got 'nccl'"):
        ReconfigurableGroup(backend="nccl")


def test_elastic_mesh_errors_and_group_of_one():
    import torch

    from torchport.distributed import CommError, TorchportProcessGroup
    from torchport.distributed._control import default_secret
    from torchport.distributed.elastic import ElasticMesh, Member, form_group

    mesh = ElasticMesh(default_secret())
    try:
        with pytest.raises(CommError, match=r"member record must be \[id, host, port, host_id\]"):
            Member.from_json([1, "127.0.0.1"])
        other = Member(mesh.rank + 1, "127.0.0.1", 1, mesh.me.host_id)
        with pytest.raises(CommError, match=f"member {mesh.rank}\\) is not among the members"):
            form_group(mesh, [other], "t/none", 1.0)
        pg = form_group(mesh, [mesh.me], "t/one", 5.0)
        assert isinstance(pg, TorchportProcessGroup) and (pg.rank(), pg.size()) == (0, 1)
        t = torch.arange(5.0)
        pg.allreduce([t]).wait()
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        pg.shutdown()
    finally:
        mesh.close()


def test_a_beat_cut_short_goes_on_from_a_thread_of_its_own():
    """A beat whose header the socket took only in part (a full buffer) had its rest sent with
    ``sendall`` on the beating thread: a peer that stopped reading held that thread, so the
    beats to every other peer stopped and they found this member hung. Now a thread of its own
    sends the rest, holding the connection's send lock until it is out (the stream stays
    framed), and ``beat()`` returns at once. The socket here takes 3 bytes of the header, then
    holds ``sendall`` until released (a receiver that resumes reading)."""
    import threading

    from torchport.distributed._control import default_secret
    from torchport.distributed.elastic import ElasticMesh

    a, b = ElasticMesh(default_secret()), ElasticMesh(default_secret())
    try:
        lo, hi = sorted((a, b), key=lambda m: m.rank)  # (the higher id dials)
        hi.ensure([lo.me], time.monotonic() + 10, lambda: None)
        end = time.monotonic() + 10
        while hi.rank not in lo.peers and time.monotonic() < end:
            time.sleep(0.01)
        conn = hi.peers[lo.rank]
        real, resume = conn.sock, threading.Event()

        class _Full:
            def send(self, data: bytes, flags: int = 0) -> int:
                return real.send(bytes(data[:3]), flags)

            def sendall(self, data: bytes) -> None:
                resume.wait(10)
                real.sendall(data)

        conn.sock = _Full()  # type: ignore[assignment]
        try:
            t0 = time.monotonic()
            hi.beat()
            assert time.monotonic() - t0 < 0.5
            assert conn.lock.locked()  # the rest's thread holds it
            resume.set()
            end = time.monotonic() + 5
            while conn.lock.locked() and time.monotonic() < end:
                time.sleep(0.01)
            assert not conn.lock.locked()
        finally:
            resume.set()
            conn.sock = real
        notices: list[tuple[int, int, bytes]] = []
        lo.on_notice = lambda peer, seq, text: notices.append((peer, seq, text))
        hi.notify(lo.rank, 7, "still framed", time.monotonic() + 5)
        end = time.monotonic() + 5
        while not notices and time.monotonic() < end:
            time.sleep(0.01)
        assert notices == [(hi.rank, 7, b"still framed")]
    finally:
        a.close()
        b.close()


def test_a_survivor_that_aborts_tells_the_others_the_culprit_gloo():
    """gloo (control-connection watchers): rank 0 finds "rank 2" hung (a silent listener: it never
    answers the watch handshake, like a process stopped before its watcher connected); rank 1
    must learn that cause from rank 0's fault notice instead of blaming rank 0."""
    import socket

    import torch

    from torchport.distributed import PeerFailure

    gs = [ReconfigurableGroup(heartbeat=0.2, backend="gloo") for _ in range(2)]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never answers
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        for w in [_reconfigure(1, hs, g) for g in gs]:
            w.wait(timeout=30)
        assert [g.rank() for g in gs] == [0, 1]
        fake = f"tp1:127.0.0.1:{silent.getsockname()[1]}:0:feed"
        with gs[0]._lock:  # the membership as rank 0 sees it: a third member, rank 2
            gs[0]._members = [*hs, fake]
        t0 = time.perf_counter()
        gs[0]._watch_one(fake, 2, 1)
        assert time.perf_counter() - t0 < 2.0
        err0 = gs[0].get_error()
        assert isinstance(err0, PeerFailure)
        assert "rank 2 hung: no answer to the watch request within 0.60 s" in str(err0)
        end = time.monotonic() + 5
        while gs[1].get_error() is None and time.monotonic() < end:
            time.sleep(0.01)
        err1 = gs[1].get_error()
        assert isinstance(err1, PeerFailure) and "rank 2 hung" in str(err1), err1
        assert "(reported by rank 0)" in str(err1)
        with pytest.raises(PeerFailure, match="allreduce: group failed earlier: rank 2 hung"):
            gs[1].allreduce(torch.ones(3))
    finally:
        silent.close()
        for g in gs:
            g.close()


def test_mesh_watch_hang_notice_and_crash():
    """torchport (watching over the elastic mesh, no watch connections): a member that stops
    beating is found hung by rank 0 within three heartbeats; rank 1 (which watches nobody here)
    learns the cause from rank 0's notice on the mesh, not from the abort. Then a closed member
    is a crash, noticed at once, and the watcher threads end with their groups."""
    import threading

    import torch

    from torchport.distributed import PeerFailure

    gs = [ReconfigurableGroup(heartbeat=0.1) for _ in range(3)]
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        for w in [_reconfigure(1, hs, g) for g in gs]:
            w.wait(timeout=30)
        assert [g.rank() for g in gs] == [0, 1, 2]
        assert all(len(g._watched) == 2 for g in gs)
        assert gs[0]._watched == {gs[1]._mesh.me.id: 1, gs[2]._mesh.me.id: 2}
        time.sleep(0.5)  # beats flow: nobody is reported while everyone beats
        assert all(g.get_error() is None for g in gs)
        with gs[1]._lock:
            gs[1]._watched.clear()
        gs[2]._mesh.beat = lambda: None  # rank 2 goes silent (as if stopped)
        t0 = time.perf_counter()
        end = time.monotonic() + 5
        while gs[0].get_error() is None and time.monotonic() < end:
            time.sleep(0.005)
        assert time.perf_counter() - t0 < 0.3 * 3 + 0.3
        err0 = gs[0].get_error()
        assert isinstance(err0, PeerFailure) and "rank 2 hung: no heartbeat for 0.30 s" in str(err0)
        while gs[1].get_error() is None and time.monotonic() < end:
            time.sleep(0.005)
        err1 = gs[1].get_error()
        assert isinstance(err1, PeerFailure) and "rank 2 hung" in str(err1), err1
        assert "(reported by rank 0)" in str(err1)
        with pytest.raises(PeerFailure, match="allreduce: group failed earlier: rank 2 hung"):
            gs[1].allreduce(torch.ones(3))
        # re-form the two healthy members (the mesh connection between them is kept) ...
        hs2 = [g.get_reconfigure_handle() for g in gs[:2]]
        for w in [_reconfigure(2, hs2, g) for g in gs[:2]]:
            w.wait(timeout=30)
        assert all(g.phases["new_connections"] == 0 for g in gs[:2])
        assert gs[0]._watched == {gs[1]._mesh.me.id: 1}
        t = torch.ones(2)
        done = threading.Thread(target=lambda: gs[1].allreduce(torch.ones(2)))
        done.start()
        gs[0].allreduce(t)
        done.join(10)
        assert t.tolist() == [2.0, 2.0]
        # ... and a crash (connection lost) is noticed at once
        t0 = time.perf_counter()
        gs[1].close()
        while gs[0].get_error() is None and time.monotonic() < end + 5:
            time.sleep(0.002)
        assert time.perf_counter() - t0 < 0.25
        assert "rank 1 crashed: its connection was lost" in str(gs[0].get_error())
    finally:
        for g in gs:
            g.close()
    for g in gs:
        assert g._watcher is not None
        g._watcher.join(2)
        assert not g._watcher.is_alive()


def _test_engine():
    """A bare progress engine whose operations are plain callables (each finishes its Work)."""
    from torchport.distributed.progress import Engine, TorchportWork

    def run(work: TorchportWork, fn) -> None:
        fn()
        work._finish()

    return Engine("tp-test-engine", run)


def test_wait_returns_after_the_futures_callbacks_ran():
    """As on gloo, the future is settled (its callbacks run) before ``wait()`` returns: the
    Flight Recorder completes an async op's entry in such a callback, and a dump taken right
    after ``wait()`` showed the op as still running."""
    import threading

    from torchport.distributed.progress import TorchportWork

    work = TorchportWork("async")
    seen: list[str] = []

    def callback(_fut) -> None:
        time.sleep(0.2)  # a slow callback: wait() must not return before it ended
        seen.append("callback")

    work.get_future().add_done_callback(callback)
    # a callback that waits on the Work itself returns at once (the gate opens after it)
    work.get_future().add_done_callback(lambda _f: seen.append(f"waited {work.wait()}"))
    finisher = threading.Thread(target=work._finish, daemon=True)
    finisher.start()
    try:
        end = time.monotonic() + 5.0
        while not work.is_completed() and time.monotonic() < end:
            time.sleep(0.001)
        assert work.is_completed(), "a callback waiting on its own Work deadlocked"
        assert work.wait()
        assert seen == ["callback", "waited True"]
    finally:
        finisher.join(5.0)
        assert not finisher.is_alive()


def test_an_op_whose_completion_is_polled_starts_at_once(monkeypatch):
    """An op nobody waits on is started by the engine thread at its next idle check; polling
    ``is_completed()``, like asking for a future, starts it at once. Idle sleeps of 30 s here:
    the op completes only if the poll woke the engine."""
    import threading

    from torchport.distributed import progress
    from torchport.distributed.progress import TorchportWork

    monkeypatch.setattr(progress, "POLL_S", 30.0)

    eng = _test_engine()
    try:
        time.sleep(0.05)  # the engine thread is in its first idle sleep
        ran = threading.Event()
        work = TorchportWork("polled")
        eng.submit(work, ran.set)
        end = time.monotonic() + 5.0
        while not work.is_completed() and time.monotonic() < end:
            time.sleep(0.01)
        assert work.is_completed() and ran.is_set()
    finally:
        eng.stop()
        assert eng.join(5.0)


def test_an_idle_engine_sleeps_deep_and_an_unwaited_post_still_wakes_it(monkeypatch):
    """Idle past QUIET_S, the engine thread sleeps without polling (no wake-ups while the
    process computes); an op posted then, which nobody waits on or polls, still starts at
    once: the post rings a deep sleeper. Deep sleeps of 30 s here: the op completes only if
    the post woke the engine."""
    import threading

    from torchport.distributed import progress
    from torchport.distributed.progress import TorchportWork

    monkeypatch.setattr(progress, "DEEP_S", 30.0)

    eng = _test_engine()
    try:
        deadline = time.monotonic() + 5.0  # the thread may start late on a loaded machine
        while eng._cells[3] != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng._cells[3] == 2, "the idle engine never went to a deep sleep"
        woke = eng._cells[6]
        time.sleep(0.3)  # idle: at POLL_S it would wake ~150 times
        assert eng._cells[6] - woke <= 1
        for k in range(3):  # again after each op: it goes back to sleeping deep
            ran = threading.Event()
            eng.submit(TorchportWork(f"unwaited {k}"), ran.set)
            assert ran.wait(5.0)
            time.sleep(0.05)
    finally:
        eng.stop()
        assert eng.join(5.0)


def test_engine_join_reports_an_operation_still_running():
    """A communicator unmaps its arena only after ``Engine.join`` says nothing runs any more:
    join is False while an operation is still in flight (on the thread or inline in a waiter)."""
    import threading

    from torchport.distributed.progress import TorchportWork

    release = threading.Event()

    eng = _test_engine()
    work = TorchportWork("slow")
    eng.submit(work, lambda: release.wait(10))
    eng.urge()
    time.sleep(0.05)
    eng.stop()
    assert eng.join(0.2) is False  # the op blocks: the engine has not ended
    release.set()
    assert eng.join(5.0) is True
    assert work.is_completed()


def test_reconfigure_runs_in_the_callers_config_context():
    """reconfigure() forms the group on a pool thread, which did not see the caller's
    config.override (dist_transport, chunk sizes): it now runs in a copy of the caller's context."""
    import concurrent.futures as cf

    from torchport import config
    from torchport.distributed.reconfigure import ReconfigurableGroup, ReconfigureOptions

    seen: list[str] = []
    g = ReconfigurableGroup.__new__(ReconfigurableGroup)  # only the pool and the step matter
    g._pool = cf.ThreadPoolExecutor(1)
    g._reconfigure_flagged = lambda opts: seen.append(config.get("dist_transport"))
    try:
        with config.override(dist_transport="tcp"):
            g.reconfigure(ReconfigureOptions()).wait(timeout=10.0)
    finally:
        g._pool.shutdown(wait=True)
    assert seen == ["tcp"]


@pytest.mark.parametrize(
    "kw", [{"heartbeat": 0.0}, {"heartbeat": -1.0}, {"timeout": timedelta(seconds=0)}]
)
def test_group_rejects_nonpositive_heartbeat_and_timeout(kw):
    """A zero heartbeat was accepted: the watch server threads then sent beats flat out."""
    with pytest.raises(ReconfigureError, match=f"{next(iter(kw))} must be"):
        ReconfigurableGroup(**kw)


def test_timed_out_collective_fails_the_group_on_every_rank():
    """A collective that timed out raised CommError but stayed in flight, the group usable: when
    the slow peer arrived the op completed, rewrote the tensor this rank had been told failed,
    and the peer reported success. A timeout now fails the group (its in-flight op ends on every
    rank), as c10d's watchdog aborts a timed-out communicator."""
    with Actors(2) as A:
        hs = [A.call(i, "init_reconf", 0.05, timeout=120) for i in range(2)]
        _ok(A.call_all([0, 1], "reconf", [(1, hs)] * 2))
        args = [(1.0, 0.3, 0.0, 1.0), (2.0, 10.0, 0.8, 0.0)]  # rank 1 arrives 0.5 s too late
        res = _ok(A.call_all([0, 1], "allreduce_late", args))
        assert res[0] == ("error", "CommError", [1.0] * 5), res  # never rewritten afterwards
        assert res[1][0] == "error", res  # the peer does not report a success either


def test_malformed_check_requests_get_an_error_reply_and_one_log_line(caplog, capfd):
    """An authenticated peer's check request with a uuid that is not a non-negative int ("abc",
    null, a list, Infinity) raised out of the control server's handler thread: a traceback, and
    the connection closed without a reply; -5, true and 1.5 (checked as 1) were answered as if
    valid. Each is answered with an error now and logged in one line, the connection stays
    usable, and a frame too malformed to answer (a 5000-digit integer) is logged and closed."""
    import logging

    from torchport.distributed._control import _HDR, MAGIC, connect, recv_msg, send_msg

    secret = b"u" * 32
    g = ReconfigurableGroup(secret=secret)
    caplog.set_level(logging.WARNING, logger="torchport.distributed.reconfigure")
    try:
        host, port, _, nonce = parse_handle(g.get_reconfigure_handle())
        conn = connect((host, port), secret, "reconf", timeout=5)
        conn.settimeout(5)
        bad = ["abc", None, [1], -5, True, 1.5]
        for uuid in bad:
            send_msg(conn, {"t": "check", "nonce": nonce, "uuid": uuid})
            reply = recv_msg(conn)
            assert reply["t"] == "error", (uuid, reply)
            assert f"uuid must be a non-negative int, got {uuid!r}" in reply["error"]
        bad.append(1 << 64)  # past the u64 of a fault notice: refused as well
        send_msg(conn, {"t": "check", "nonce": nonce, "uuid": 1 << 64})
        assert "uuid must be at most 2**64 - 1" in recv_msg(conn)["error"]
        body = b'{"t":"check","nonce":"x","uuid":Infinity}'
        conn.sendall(_HDR.pack(MAGIC, len(body)) + body)
        assert "got inf" in recv_msg(conn)["error"]
        send_msg(conn, {"t": "check", "nonce": nonce, "uuid": 3})  # the same connection serves
        assert recv_msg(conn) == {
            "t": "check",
            "current": True,
            "uuid_used": False,
            "mesh": g._mesh.me.to_json(),
        }
        conn.close()
        huge = connect((host, port), secret, "reconf", timeout=5)
        body = b'{"t":"check","nonce":"x","uuid":' + b"9" * 5000 + b"}"
        huge.sendall(_HDR.pack(MAGIC, len(body)) + body)
        huge.settimeout(5)
        assert huge.recv(1) == b""  # closed without a reply: nothing to answer
        huge.close()
        deadline = time.monotonic() + 5
        while len(caplog.records) < len(bad) + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == len(bad) + 2 and all("\n" not in m for m in lines), lines
        assert "4300 digits" in lines[-1]
    finally:
        g.close()
    assert "Traceback" not in capfd.readouterr().err
