"""Fault-tolerant training: faults injected at (replica, step) in real processes; bit-identical replicas."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tests.ft_actors  # noqa: F401  (configures the forkserver preload)
from torchport.demo.ft_worker import spawn
from torchport.distributed import AuthError, CommError
from torchport.distributed._control import connect, recv_msg, send_msg
from torchport.distributed.fr_analyze import analyze, load_dumps
from torchport.distributed.ft import Lighthouse, StateTransferError, recv_state, send_state
from torchport.distributed.ft.transfer import decode, encode

WORLD, STEPS, FAULT_STEP = 3, 12, 4


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return -1


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _refused(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a connection is refused)."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _wait_listener_gone(port: int) -> None:
    """Wait until nothing listens on ``port``. A TCPStore has no close(): its listener goes with
    the last reference, and a CommError the test keeps holds one in a cycle (its traceback
    holds the test's frame), so the caller first drops its own and a collection frees the rest."""
    import gc

    def gone() -> bool:
        gc.collect()
        return _refused(port)

    _wait_for(gone, 3, f"the test's TCPStore to stop listening on port {port}")


@pytest.mark.parametrize(
    "fault,backend",
    [
        ("kill", "torchport"),
        ("stop", "torchport"),
        ("close", "torchport"),
        ("slow", "torchport"),
        ("kill", "gloo"),
        ("stop", "gloo"),
    ],
)
def test_fault_at_rank_step(tmp_path, fault, backend):
    lh = Lighthouse(min_replicas=1, join_timeout=0.3, heartbeat=0.1)
    addr = f"{lh.address[0]}:{lh.address[1]}"
    procs: dict[int, object] = {}

    def start(i: int, f: str) -> None:
        procs[i] = spawn(
            [
                "--lighthouse",
                addr,
                "--rid",
                f"r{i}",
                "--steps",
                str(STEPS),
                "--world",
                str(WORLD),
                "--fault",
                f,
                "--fault-step",
                str(FAULT_STEP),
                "--out",
                str(tmp_path / f"r{i}.bin"),
                "--fr-dir",
                str(tmp_path / "fr"),
                "--step-sleep",
                "0.01",
                "--timeout",
                "10",
                "--backend",
                backend,
            ]
        )

    try:
        # the faulty replica starts once the others are in, so (however slow the machine) it
        # never trains alone and its fault always hits a quorum with survivors
        for i in (0, 2):
            start(i, "none")
        _wait_for(lambda: sum("connected" in e for _, e in lh.events) >= 2, 60, "replicas 0 and 2")
        start(1, fault)
        p0 = tmp_path / "r0.bin.progress"
        if fault == "kill":
            procs[1].join(timeout=60)  # type: ignore[attr-defined]
            assert procs[1].exitcode == -signal.SIGKILL  # type: ignore[attr-defined]
            killed_at = _progress(p0)
            _wait_for(lambda: _progress(p0) >= killed_at + 3, 60, "survivors to progress")
            start(1, "none")
        elif fault == "stop":
            _wait_for(lambda: _stopped(procs[1].pid), 60, "replica 1 to stop")  # type: ignore[attr-defined]
            stopped_at = _progress(p0)
            _wait_for(lambda: _progress(p0) >= stopped_at + 3, 60, "survivors to progress")
            os.kill(procs[1].pid, signal.SIGCONT)  # type: ignore[attr-defined]
        for i in range(WORLD):
            procs[i].join(timeout=60)  # type: ignore[attr-defined]
            assert procs[i].exitcode == 0, f"replica {i} exit code {procs[i].exitcode}"  # type: ignore[attr-defined]
    finally:
        for p in procs.values():
            if p.is_alive():  # type: ignore[attr-defined]
                os.kill(p.pid, signal.SIGCONT)  # type: ignore[attr-defined]
                p.kill()  # type: ignore[attr-defined]
                p.join(timeout=5)  # type: ignore[attr-defined]
        lh.close()
    params = [(tmp_path / f"r{i}.bin").read_bytes() for i in range(WORLD)]
    summ = [(tmp_path / f"r{i}.bin.json").read_text() for i in range(WORLD)]
    assert params[0] == params[1] == params[2], (
        f"replicas diverged: {[p == params[0] for p in params]} {summ}"
    )
    summaries = [json.loads((tmp_path / f"r{i}.bin.json").read_text()) for i in range(WORLD)]
    assert len({s["steps"] for s in summaries}) == 1 and summaries[0]["steps"] >= STEPS
    events = [e for _, e in lh.events]
    # a torchport-only job never starts the lighthouse's (unauthenticated) TCPStore (close()
    # releases it, so its start is read from the events)
    assert any("gloo store started" in e for e in events) == (backend == "gloo")
    if fault in ("kill", "close"):
        assert any("r1 dead (connection lost)" in e for e in events), events
    if fault == "stop":
        assert any("r1 dead (no heartbeat" in e for e in events), events
    if fault in ("kill", "stop"):
        # the survivors went on without r1; r1 healed when it came back
        assert any("quorum" in e and "'r1'" not in e for e in events)
        assert summaries[1]["heals"] >= 1 and summaries[1]["heal_bytes"] > 0
        # the step r1 failed in was not committed, by the survivor(s) in its quorum: with
        # min_replicas=1 a quorum may form without one of them (quorum ['r1', 'r2'] while r0
        # waited: r0 then had no aborted step, 10 of 10 runs on a quiet machine)
        assert summaries[0]["aborted_steps"] + summaries[2]["aborted_steps"] >= 1, summaries
    if fault == "slow":
        assert all(s["aborted_steps"] == 0 for s in summaries)
        # steady state: quorums came with the previous commit (one lighthouse round trip a step)
        assert summaries[0]["quorums_with_commit"] > 0, summaries
    # Flight Recorder: every replica's end-of-run dump is readable; survivors dumped on the abort
    verdict = analyze(load_dumps(tmp_path / "fr" / "end"))
    assert set(verdict.last_completed) == {0, 1, 2}
    if fault in ("kill", "stop", "close"):
        failure = load_dumps(tmp_path / "fr")
        assert any(d["reason"].startswith("abort") for r, d in failure.items() if r != 1)


def test_state_roundtrip_and_bad_input():
    a, b = socket.socketpair()
    state = {
        "model": {
            "w": torch.randn(3, 5),
            "b": torch.arange(7, dtype=torch.int64),
            "e": torch.zeros(0),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "m": torch.randn(4).bfloat16()}},
            "lr": 0.1,
        },
        "tags": ("x", None, True, 3),
        "t": torch.randn(4, 4).t(),  # non-contiguous
    }
    n = send_state(a, state)
    got, hdr = recv_state(b)
    assert hdr["total"] == n
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(got["optim"]["state"][0]["m"], state["optim"]["state"][0]["m"])
    assert got["optim"]["state"][0]["step"].item() == 3.0 and got["tags"] == ("x", None, True, 3)
    assert torch.equal(got["t"], state["t"]) and got["model"]["e"].shape == (0,)
    with pytest.raises(StateTransferError, match="state values must be tensors"):
        encode({"f": object()}, [])
    with pytest.raises(StateTransferError, match="malformed state structure"):
        decode({"bogus": 1}, [])
    send_msg(
        a, {"t": "state", "structure": None, "tensors": [["float32", [4], 16]], "total": 1 << 50}
    )
    with pytest.raises(StateTransferError, match="exceeds the limit"):
        recv_state(b)
    send_msg(a, {"t": "state", "structure": None, "tensors": [["object", [1], 8]], "total": 8})
    with pytest.raises(StateTransferError, match="unsupported dtype 'object'"):
        recv_state(b)
    a.close()
    b.close()


def test_lighthouse_rejects_strangers():
    lh = Lighthouse(secret=b"right")
    try:
        with pytest.raises(AuthError, match=r"rejected authentication|failed"):
            connect(lh.address, b"wrong", "lighthouse", timeout=2)
    except CommError as e:  # the server closes the socket instead of answering
        assert "closed" in str(e)
    finally:
        lh.close()
    lh = Lighthouse(secret=b"right")
    try:
        s = connect(lh.address, b"right", "lighthouse", timeout=2)
        send_msg(s, {"t": "rpc", "rid": "ghost"})
        send_msg(s, {"t": "quorum", "rid": "ghost", "step": 0, "heal_addr": ["x", 1], "timeout": 1})
        assert "no live heartbeat" in recv_msg(s)["error"]
        s.close()
    finally:
        lh.close()


def test_control_frame_nested_too_deep_is_a_comm_error():
    a, b = socket.socketpair()
    try:
        body = b"[" * 20_000  # valid JSON so far, but deeper than the parser recurses
        a.sendall(b"TPC1" + len(body).to_bytes(4, "big") + body)
        with pytest.raises(CommError, match=r"malformed control frame: RecursionError"):
            recv_msg(b)
    finally:
        a.close()
        b.close()


def _lighthouse_replica(lh: Lighthouse, secret: bytes, rid: str, socks: list) -> socket.socket:
    """Connect replica ``rid`` to ``lh`` (heartbeat + rpc connections, kept in ``socks``) and wait
    until the lighthouse has seen it; return the rpc connection."""
    hb = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(hb, {"t": "hb", "rid": rid})
    rpc = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(rpc, {"t": "rpc", "rid": rid})
    socks.extend([hb, rpc])
    _wait_for(lambda: any(f"replica {rid} connected" in e for _, e in lh.events), 5, rid)
    return rpc


def test_lighthouse_refuses_split_brain_quorums():
    """A late replica never forms a quorum of its own while a member of the last quorum has not
    voted, nor while a live holder of the latest committed step has not asked."""
    secret = b"s" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks = []

    def replica(rid: str):
        return _lighthouse_replica(lh, secret, rid, socks)

    def ask(rpc, rid: str, step: int) -> None:
        send_msg(
            rpc, {"t": "quorum", "rid": rid, "step": step, "heal_addr": ["x", 1], "timeout": 5}
        )

    try:
        r0 = replica("r0")
        ask(r0, "r0", 0)
        q = recv_msg(r0)
        assert q["members"] == ["r0"]
        r1 = replica("r1")
        ask(r1, "r1", 0)
        r1.settimeout(0.4)
        with pytest.raises(TimeoutError):  # r0 is still in its step: no quorum [r1] at step 0
            recv_msg(r1)
        vote = {"t": "commit", "rid": "r0", "quorum_id": q["quorum_id"], "step": 0}
        send_msg(r0, {**vote, "members": ["r0"], "ok": True, "timeout": 5})
        assert recv_msg(r0)["ok"] is True
        with pytest.raises(TimeoutError):  # r0 holds step 1; r1 (step 0) waits for it
            recv_msg(r1)
        ask(r0, "r0", 1)
        r1.settimeout(5)
        got = recv_msg(r1)
        assert got["members"] == ["r0", "r1"] and got["max_step"] == 1 and got["steps"] == [1, 0]
        assert recv_msg(r0)["quorum_id"] == got["quorum_id"]
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_commit_hands_out_the_next_quorum_in_steady_state_only():
    """One lighthouse round trip per step: a unanimous commit whose votes carry the next quorum
    request answers with that quorum; a replica waiting to join (or a "no") stops it, and the
    joiner is in the next quorum."""
    secret = b"t" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=5.0, heartbeat=5.0, secret=secret)
    socks = []

    def replica(rid: str):
        return _lighthouse_replica(lh, secret, rid, socks)

    def req(rid: str, step: int) -> dict:
        return {"t": "quorum", "rid": rid, "step": step, "heal_addr": ["x", 1], "timeout": 5}

    def vote(rpcs, qid: int, step: int, ok=(True, True), nxt=True):
        for (rid, s), yes in zip(rpcs, ok, strict=True):
            send_msg(
                s,
                {
                    "t": "commit",
                    "rid": rid,
                    "quorum_id": qid,
                    "step": step,
                    "members": ["r0", "r1"],
                    "ok": yes,
                    "timeout": 5,
                    "next": req(rid, step + 1) if nxt else None,
                },
            )
        return [recv_msg(s) for _, s in rpcs]

    try:
        r = [("r0", replica("r0")), ("r1", replica("r1"))]
        for rid, s in r:
            send_msg(s, req(rid, 0))
        q = [recv_msg(s) for _, s in r]
        assert q[0]["members"] == ["r0", "r1"] and q[0] == q[1]
        qid = q[0]["quorum_id"]
        rounds = sum("quorum" in e for _, e in lh.events)
        got = vote(r, qid, 0)
        assert all(g["ok"] is True for g in got)
        nq = [g["quorum"] for g in got]
        assert nq[0] == nq[1] and nq[0]["quorum_id"] == qid
        assert nq[0]["steps"] == [1, 1] and nq[0]["max_step"] == 1
        assert sum("quorum" in e for _, e in lh.events) == rounds  # no extra round was formed
        # a vote without the next request (or a "no") gets no quorum
        assert all(g["quorum"] is None for g in vote(r, qid, 1, nxt=False))
        got = vote(r, qid, 2, ok=(True, False))
        assert all(g["ok"] is False and g["quorum"] is None for g in got)
        # r0, r1 ask again (a new quorum after the failed commit), then commit step 2
        for rid, s in r:
            send_msg(s, req(rid, 2))
        qs = [recv_msg(s) for _, s in r]  # both replies must be read
        qid = qs[0]["quorum_id"]
        assert vote(r, qid, 2)[0]["quorum"] is not None
        # a joiner waits (r0, r1 are in a step); their next commit hands out no quorum
        j = replica("r2")
        send_msg(j, req("r2", 0))
        got = vote(r, qid, 3)
        assert all(g["ok"] is True and g["quorum"] is None for g in got)
        for rid, s in r:
            send_msg(s, req(rid, 4))
        q = [recv_msg(s) for _, s in r] + [recv_msg(j)]
        assert q[0]["members"] == ["r0", "r1", "r2"] and q[0]["steps"] == [4, 4, 0]
        assert q[0]["quorum_id"] != qid and q[0] == q[1] == q[2]
    finally:
        for s in socks:
            s.close()
        lh.close()


@pytest.mark.parametrize("addr", [None, "127.0.0.1", "127.0.0.2", "0.0.0.0"])
def test_heal_server_binds_the_configured_address(addr):
    """The heal server bound 127.0.0.1 whatever TORCHPORT_DIST_ADDR said, so a replica on
    another host could not heal: it listens where the TCP mesh does and the quorum request
    carries the address peers should dial (the host's own for 0.0.0.0)."""
    import contextlib

    from torchport import config
    from torchport.distributed.ft import Manager

    secret = b"h" * 32
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    with config.override(dist_addr=addr) if addr else contextlib.nullcontext():
        mgr = Manager(
            lighthouse=lh.address,
            replica_id="r0",
            state_dict=dict,
            load_state_dict=lambda s: None,
            secret=secret,
            backend="gloo",
        )
    try:
        bound = mgr._heal_server.address[0]
        assert bound == (addr or "127.0.0.1")
        want = socket.gethostbyname(socket.gethostname()) if addr == "0.0.0.0" else bound
        assert mgr.heal_address[0] == want
        assert mgr._request(0, 1.0)["heal_addr"] == [want, mgr._heal_server.address[1]]
    finally:
        mgr.shutdown()
        lh.close()


def test_heal_broken_off_midway_never_trains_on_torn_state():
    """A heal source killed mid-transfer left the healing replica's own tensors (received into
    in place) half overwritten; with no other member at the quorum's step it then trained on that
    mix at its old step. It now refuses the quorum (and to serve its state) until it has healed."""
    from torchport.distributed._control import Server
    from torchport.distributed.ft import Manager, QuorumError

    secret = b"t" * 32
    w = torch.zeros(1000)

    def dying_source(conn: socket.socket) -> None:  # sends 400 of 4000 bytes, then "dies"
        recv_msg(conn)
        user = {"__dict__": [["w", {"__tensor__": 0}]]}
        structure = {"__dict__": [["user", user], ["step", 5]]}
        send_msg(
            conn,
            {
                "t": "state",
                "structure": structure,
                "tensors": [["float32", [1000], 4000]],
                "total": 4000,
            },
        )
        conn.sendall(torch.ones(100).numpy().tobytes())
        conn.close()

    src = Server(dying_source, secret=secret, role="heal")
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    mgr = Manager(
        lighthouse=lh.address,
        replica_id="b",
        state_dict=lambda: {"w": w},
        load_state_dict=lambda s: w.copy_(s["w"]),
        secret=secret,
        timeout=2.0,
        quorum_timeout=0.5,
    )
    try:
        q = {"quorum_id": 1, "heal_addrs": [list(src.address)], "steps": [5], "max_step": 5}
        with pytest.raises(StateTransferError, match="broke off") as info:
            mgr._heal(q, 0, 0)
        assert info.value.partial and w.sum().item() == 100.0  # torn: the fix cannot undo that
        with pytest.raises(QuorumError, match="torn by an interrupted heal"):
            mgr.start_quorum()  # alone, so no valid state anywhere: it used to train on the torn one
        unmarked = {"quorum_id": 2, "members": ["b"], "steps": [0], "max_step": 0}
        with pytest.raises(CommError, match="torn by an interrupted heal"):
            mgr._sources(unmarked, 0)  # a quorum not marking it torn: still not its own source
        healer = connect(mgr.heal_address, secret, "heal", timeout=2)
        send_msg(healer, {"t": "get_state", "step": 0})
        with pytest.raises(StateTransferError, match="state is torn"):
            recv_state(healer)
        healer.close()
    finally:
        mgr.shutdown()
        lh.close()
        src.close()


def _ft_replicas(lh: Lighthouse, secret: bytes, managers: list, timeout: float = 5.0, **kw):
    """A factory of in-process managers whose state is one tensor ``w`` (shut down by the caller)."""
    from torchport.distributed.ft import Manager

    def replica(rid: str, w: torch.Tensor):
        m = Manager(
            lighthouse=lh.address,
            replica_id=rid,
            state_dict=lambda: {"w": w},
            load_state_dict=lambda s: w.copy_(s["w"]),
            secret=secret,
            timeout=timeout,
            **kw,
        )
        managers.append(m)
        return m

    return replica


def _quorum(*ms) -> list:
    """Every manager's start_quorum at once; the errors they raised."""
    import threading

    errors: list = []

    def run(m) -> None:
        try:
            m.start_quorum()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return errors


def test_torn_replica_heals_from_a_valid_member_at_an_older_step():
    """A replica torn by a broken-off heal kept asking for quorums at its pre-heal step; when that
    was the highest step, the quorum named it the source of a valid member at an older step, it
    refused (torn), and every attempt failed until QuorumError. It now asks at step 0 marked torn,
    and heals from the valid member (taking that member's step)."""
    secret = b"o" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=5.0, secret=secret)
    managers: list = []
    replica = _ft_replicas(lh, secret, managers, quorum_timeout=3.0)
    try:
        wa, wb = torch.full((4,), 2.0), torch.full((4,), 9.0)
        a, b = replica("a", wa), replica("b", wb)
        a._step, b._step, b._torn = 2, 3, True  # b's heal to some step 3 broke off midway
        assert _quorum(a, b) == []
        assert torch.equal(wb, wa) and b.current_step() == 2 and not b._torn
    finally:
        for m in managers:
            m.shutdown()
        lh.close()


def test_torn_replica_at_step_0_init_syncs_from_member_0():
    """With init_sync, a replica torn at step 0 re-healed from any other member at step 0 (here
    member 2, itself still copying member 0's state or holding its own init), not from member 0:
    it then trained on another model than member 0's without an error."""
    secret = b"z" * 32
    lh = Lighthouse(min_replicas=3, join_timeout=5.0, heartbeat=5.0, secret=secret)
    managers: list = []
    replica = _ft_replicas(lh, secret, managers, quorum_timeout=5.0)
    try:
        w0, w1, w2 = torch.zeros(4), torch.full((4,), 9.0), torch.full((4,), 2.0)
        r0, r1, r2 = replica("r0", w0), replica("r1", w1), replica("r2", w2)
        r1._torn = True  # r1 (member 1 of 3) was torn by a broken-off init_sync heal
        assert _quorum(r0, r1, r2) == []
        assert torch.equal(w1, w0) and torch.equal(w2, w0) and not r1._torn
    finally:
        for m in managers:
            m.shutdown()
        lh.close()


def test_replica_receiving_a_heal_does_not_serve_its_state():
    """A replica still receiving a heal into its own tensors served them to another healer (a mix
    of its old state and the bytes received so far); it now refuses, as a torn one does."""
    import threading

    from torchport.distributed._control import Server
    from torchport.distributed.ft import Manager

    secret = b"r" * 32
    release = threading.Event()

    def slow_source(conn: socket.socket) -> None:  # sends the header, then holds the transfer
        recv_msg(conn)
        user = {"__dict__": [["w", {"__tensor__": 0}]]}
        structure = {"__dict__": [["user", user], ["step", 5]]}
        send_msg(
            conn,
            {"t": "state", "structure": structure, "tensors": [["float32", [4], 16]], "total": 16},
        )
        release.wait(10)
        conn.sendall(torch.ones(4).numpy().tobytes())

    src = Server(slow_source, secret=secret, role="heal")
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    w = torch.zeros(4)
    mgr = Manager(
        lighthouse=lh.address,
        replica_id="b",
        state_dict=lambda: {"w": w},
        load_state_dict=lambda s: w.copy_(s["w"]),
        secret=secret,
        timeout=5.0,
    )
    q = {"quorum_id": 1, "heal_addrs": [list(src.address)], "steps": [5], "max_step": 5}
    t = threading.Thread(target=mgr._heal, args=(q, 0, 0))
    try:
        t.start()
        _wait_for(lambda: mgr._receiving, 5, "the heal to start")
        healer = connect(mgr.heal_address, secret, "heal", timeout=2)
        send_msg(healer, {"t": "get_state", "step": 0})
        with pytest.raises(StateTransferError, match="being received"):
            recv_state(healer)
        healer.close()
        release.set()
        t.join(5)
        assert not t.is_alive() and mgr.current_step() == 5 and w.sum().item() == 4.0
    finally:
        release.set()
        mgr.shutdown()
        lh.close()
        src.close()
        t.join(5)


@pytest.mark.parametrize(
    "header",
    [
        {"structure": None, "tensors": [["float32", [-4], 16]], "total": 16},
        {"structure": {"__tensor__": 3}, "tensors": [], "total": 0},
        {"structure": {"__tensor__": -1}, "tensors": [["float32", [1], 4]], "total": 4},
        {"structure": None, "tensors": [], "total": "x"},
        {"structure": None, "tensors": [5], "total": 0},
        {"structure": {"__dict__": [[[1], 2]]}, "tensors": [], "total": 0},
        {"structure": None, "tensors": [["float32", [2], 4]], "total": 4},
    ],
)
def test_malformed_state_header_is_a_state_transfer_error(header):
    """A malformed header from a heal peer raised RuntimeError/IndexError/ValueError/TypeError,
    which the quorum does not retry (the healing replica died), and some were found only after
    bytes had landed in the receiver's own tensors. All are StateTransferErrors now, raised before
    any byte is received."""
    a, b = socket.socketpair()
    mine = {"w": torch.zeros(1)}
    try:
        send_msg(a, {"t": "state", **header})
        a.sendall(torch.ones(2).numpy().tobytes())
        with pytest.raises(StateTransferError) as info:
            recv_state(b, into=mine)
        assert not info.value.partial and mine["w"].item() == 0.0
    finally:
        a.close()
        b.close()


def test_ddp_launches_buckets_in_index_order_whatever_the_graph():
    """Buckets were launched as their gradients completed; with a parameter unused on one replica
    (data-dependent graph) two replicas issued the allreduces in different orders, and the quorum,
    which pairs them by issue order, averaged one replica's bucket 0 with another's bucket 1 (same
    sizes: silently). Every replica now launches them in bucket order."""
    from torch import nn

    from torchport.distributed.ft.ddp import DistributedDataParallel

    class Recorder:  # stands in for the manager: records what each allreduce carries
        def __init__(self) -> None:
            self.sent: list[torch.Tensor] = []

        def allreduce(self, t: torch.Tensor):
            self.sent.append(t.clone())
            return type("W", (), {"wait": lambda self: True})()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            y = self.a(x)
            return (self.b(y) if use_b else y).sum()

    for use_b in (True, False):
        net, mgr = Net(), Recorder()
        ddp = DistributedDataParallel(net, mgr, bucket_cap_mb=64 / (1 << 20))  # type: ignore[arg-type]
        assert [len(b) for b in ddp._buckets] == [1, 1] and ddp._buckets[0][0] is net.b.weight
        ddp(torch.ones(1, 4), use_b).backward()
        assert len(mgr.sent) == 2
        assert torch.equal(mgr.sent[0], net.b.weight.grad.reshape(-1))  # bucket 0 (b) first
        assert torch.equal(mgr.sent[1], net.a.weight.grad.reshape(-1))


@pytest.mark.parametrize(
    "kw",
    [{"heartbeat": 0.0}, {"timeout": -1.0}, {"timeout": 0.0}, {"quorum_timeout": float("nan")}],
)
def test_manager_rejects_nonpositive_timeouts(kw):
    """A zero heartbeat was accepted and spun the beat thread flat out (0.8 CPU s per idle second);
    a negative timeout failed inside socket code with an untyped "Timeout value out of range"."""
    from torchport.distributed.ft import Manager

    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds > 0"):
        Manager(
            lighthouse=("127.0.0.1", 1),
            replica_id="a",
            state_dict=dict,
            load_state_dict=lambda s: None,
            **kw,
        )


@pytest.mark.parametrize("kw", [{"heartbeat": 0.0}, {"join_timeout": -1.0}])
def test_lighthouse_rejects_bad_periods(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        Lighthouse(secret=b"x" * 32, **kw)


def test_malformed_quorum_request_does_not_block_other_replicas():
    """A quorum request with a bad field ("step": "x") was stored as pending; every other
    replica's request then failed (its handler evaluated all pending steps and died) until the
    sender's heartbeat stopped. It is refused alone now, and so is a malformed vote."""
    secret = b"m" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list = []
    try:
        bad = _lighthouse_replica(lh, secret, "bad", socks)
        good = _lighthouse_replica(lh, secret, "good", socks)
        ask = {"t": "quorum", "heal_addr": ["x", 1], "timeout": 2}
        send_msg(bad, {**ask, "rid": "bad", "step": "x"})
        assert "step must be an int" in recv_msg(bad)["error"]
        send_msg(bad, {"t": "commit", "rid": "bad", "quorum_id": 1, "step": 0, "members": "bad"})
        reply = recv_msg(bad)
        assert reply["ok"] is False and "members must be a list" in reply["error"]
        send_msg(good, {**ask, "rid": "good", "step": 0})
        q = recv_msg(good)
        assert q["t"] == "quorum" and q["members"] == ["good"]
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_init_sync_follows_a_member_0_restarted_before_the_first_commit():
    """init_sync copied member 0's initial state only on a replica's first quorum: a member 0
    that crashed before the first commit came back with a fresh init, the others kept its
    previous life's, and the replicas trained on different parameters without any error."""
    secret = b"i" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=5.0, secret=secret)
    managers: list = []
    replica = _ft_replicas(lh, secret, managers, quorum_timeout=10.0)

    try:
        w0, w1 = torch.zeros(4), torch.ones(4)
        r0, r1 = replica("r0", w0), replica("r1", w1)
        assert _quorum(r0, r1) == []
        assert torch.equal(w1, w0)
        r0.shutdown()  # crashes before any commit and restarts with another init
        w0 = torch.full((4,), 7.0)
        assert _quorum(replica("r0", w0), r1) == []
        assert torch.equal(w1, w0) and r1.current_step() == 0
    finally:
        for m in managers:
            m.shutdown()
        lh.close()


def test_manager_with_unreachable_lighthouse_leaves_nothing_running():
    """Manager() raised when the lighthouse could not be reached but left its heal server and
    elastic mesh listening (two threads and two sockets per attempt, for the process's life)."""
    import threading

    from torchport.distributed.ft import Manager

    before = threading.active_count()
    with pytest.raises(CommError, match="cannot connect"):
        Manager(
            lighthouse=("127.0.0.1", 1),
            replica_id="a",
            state_dict=dict,
            load_state_dict=lambda s: None,
            secret=b"l" * 32,
            timeout=1.0,
        )
    _wait_for(lambda: threading.active_count() <= before, 2, "the manager's threads to end")


def test_silent_unauthenticated_connections_take_bounded_threads():
    """Every connection to a control server (heal, lighthouse, reconfigure) got a thread for its
    5 s authentication handshake, without bound (500 silent connections: 500 threads). At most
    MAX_HANDSHAKES are in the handshake now; the others wait in the listen backlog."""
    import threading

    from torchport.distributed._control import MAX_HANDSHAKES, Server

    served = threading.Event()
    srv = Server(lambda c: served.set(), secret=b"f" * 32, role="heal")
    before = threading.active_count()
    socks = [socket.create_connection(srv.address) for _ in range(MAX_HANDSHAKES + 64)]
    try:
        time.sleep(0.3)
        assert threading.active_count() <= before + MAX_HANDSHAKES
        for s in socks:
            s.close()
        ok = connect(srv.address, b"f" * 32, "heal", timeout=5)  # served once slots free up
        ok.close()
        assert served.wait(5)
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_trickling_handshake_holds_a_slot_for_the_handshake_timeout_only(monkeypatch):
    """The server's handshake timed out per recv only: a client sending its 32-byte answer a byte
    every 0.2 s held its slot 6.4 s (past a 0.5 s handshake timeout), so with every slot taken a
    legitimate connect timed out. The whole exchange now has one deadline."""
    import threading

    import torchport.distributed._control as control

    monkeypatch.setattr(control, "MAX_HANDSHAKES", 1)
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT", 0.5, raising=False)
    secret = b"k" * 32
    srv = control.Server(lambda c: None, secret=secret, role="heal")
    slow = socket.create_connection(srv.address)
    stop = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not stop.wait(0.2):  # (the client speaks first: its hello, a byte at a time)
                slow.sendall(b"x")

    t = threading.Thread(target=trickle)
    try:
        t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        connect(srv.address, secret, "heal", timeout=3).close()
        assert time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        t.join(5)
        slow.close()
        srv.close()


def test_heal_from_a_hung_source_ends_on_the_failure_notice():
    """A heal from a source that hung mid-transfer (SIGSTOP) waited out the manager's whole
    timeout, although the lighthouse reports the hang within 3 heartbeats (and the quorum waited
    for the healing replica meanwhile); the failure notice now ends the transfer at once."""
    import threading

    from torchport.distributed import PeerFailure
    from torchport.distributed._control import Server
    from torchport.distributed.ft import Manager

    secret = b"g" * 32
    release = threading.Event()

    def hung_source(conn: socket.socket) -> None:
        recv_msg(conn)
        structure = {"__dict__": [["user", {"__dict__": []}], ["step", {"__tensor__": 0}]]}
        send_msg(
            conn, {"t": "state", "structure": structure, "tensors": [["int64", [], 8]], "total": 8}
        )
        release.wait(30)  # stops sending, connection open

    src = Server(hung_source, secret=secret, role="heal")
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    mgr = Manager(
        lighthouse=lh.address,
        replica_id="b",
        state_dict=dict,
        load_state_dict=lambda s: None,
        secret=secret,
        timeout=20.0,
    )
    box: list = []
    q = {"quorum_id": 1, "heal_addrs": [list(src.address)], "steps": [5], "max_step": 5}

    def heal() -> None:
        try:
            mgr._heal(q, 0, 0)
        except StateTransferError as e:
            box.append(e)

    t = threading.Thread(target=heal)
    try:
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        mgr.report_error(PeerFailure("replica(s) ['a'] failed: no heartbeat"))
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 2 and box
    finally:
        release.set()
        mgr.shutdown()
        lh.close()
        src.close()
        t.join(5)


def test_survivor_that_missed_the_commit_reply_still_gets_a_quorum():
    """A replica whose vote reply was lost (connection broke after the lighthouse decided) did not
    apply the step but still counted as holding it; once the other holders died, its own request
    (at the old step) waited for a holder "that has not asked yet" - itself - and the job ended
    in QuorumError. A live holder that asks at a lower step no longer blocks the round."""
    secret = b"v" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list = []
    try:
        rpcs = {rid: _lighthouse_replica(lh, secret, rid, socks) for rid in ("r0", "r1")}

        def ask(rid: str, step: int) -> None:
            msg = {"t": "quorum", "rid": rid, "step": step, "heal_addr": ["x", 1], "timeout": 1.5}
            send_msg(rpcs[rid], msg)

        ask("r0", 0)
        ask("r1", 0)
        q = recv_msg(rpcs["r0"])
        assert recv_msg(rpcs["r1"])["members"] == q["members"] == ["r0", "r1"]
        vote = {"t": "commit", "quorum_id": q["quorum_id"], "step": 0, "members": q["members"]}
        for rid in ("r0", "r1"):
            send_msg(rpcs[rid], {**vote, "rid": rid, "ok": True, "timeout": 5})
        assert all(recv_msg(rpcs[rid])["ok"] for rid in ("r0", "r1"))
        for s in socks[:2]:  # r0 dies; r1 never saw its "ok" and asks at step 0 again
            s.close()
        _wait_for(lambda: any("replica r0 dead" in e for _, e in lh.events), 5, "r0 dead")
        ask("r1", 0)
        rpcs["r1"].settimeout(5)
        q = recv_msg(rpcs["r1"])
        assert q["t"] == "quorum" and q["members"] == ["r1"], q
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_manager_allreduce_refuses_an_integer_tensor_at_the_call():
    """An int64 tensor (a step counter) was summed over the quorum, then wait() raised a bare
    RuntimeError from the in-place division, leaving the sum in the tensor, and should_commit
    still committed the step. The average needs a floating-point tensor of a reducible dtype
    (not float8): the call refuses any other dtype now, naming it, before anything is sent (in a
    quorum of one as well)."""
    import threading

    from torchport.distributed import CollectiveArgumentError

    secret = b"n" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5.0, heartbeat=5.0, secret=secret)
    managers: list = []
    replica = _ft_replicas(lh, secret, managers, quorum_timeout=5.0)
    try:
        a, b = replica("a", torch.zeros(2)), replica("b", torch.zeros(2))
        assert _quorum(a, b) == []
        out: dict = {}

        def step(m, name: str) -> None:
            counter = torch.tensor([3], dtype=torch.int64)
            with pytest.raises(CollectiveArgumentError, match=r"got dtype torch\.int64"):
                m.allreduce(counter)
            grad = torch.full((2,), 1.0 if name == "a" else 3.0)
            out[name] = (counter.item(), m.allreduce(grad).wait(), grad, m.should_commit())

        threads = [threading.Thread(target=step, args=(m, n)) for m, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        for name in ("a", "b"):
            counter, ok, grad, committed = out[name]
            assert counter == 3 and ok and committed and torch.equal(grad, torch.full((2,), 2.0))
        alone = replica("c", torch.zeros(2))
        with pytest.raises(CollectiveArgumentError, match=r"dtype torch\.bool"):
            alone.allreduce(torch.ones(1, dtype=torch.bool))
        # float8 is floating-point, but no backend reduces it: with two replicas it failed the
        # step in wait(), with one it passed; refused at the call now
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            with pytest.raises(CollectiveArgumentError, match=rf"got dtype {dt}"):
                alone.allreduce(torch.ones(1, dtype=dt))
    finally:
        for m in managers:
            m.shutdown()
        lh.close()


def _paced_state_source(
    w: torch.Tensor, piece: int, pause: float, stop: threading.Event, *, pause_first: bool
) -> Callable[[socket.socket], None]:
    """A heal-server handler answering a state request with ``{"w": w}`` (a float32 tensor),
    its bytes sent ``piece`` at a time, ``pause`` s apart (also before the first piece if
    ``pause_first``), until ``stop`` is set."""
    raw = memoryview(w.numpy()).cast("B")

    def source(conn: socket.socket) -> None:
        recv_msg(conn)
        structure = {"__dict__": [["w", {"__tensor__": 0}]]}
        header = {"t": "state", "structure": structure, "total": len(raw)}
        send_msg(conn, {**header, "tensors": [["float32", [w.numel()], len(raw)]]})
        with contextlib.suppress(OSError):
            for i in range(0, len(raw), piece):
                if (i or pause_first) and stop.wait(pause):
                    return
                conn.sendall(raw[i : i + piece])

    return source


def test_fetch_state_from_a_trickling_source_ends_by_its_timeout():
    """fetch_state's timeout bounded each receive: a source sending its 4000-byte tensor 100
    bytes every 0.2 s (always inside a 0.5 s timeout) stretched the transfer to 8 s. Each
    PROGRESS_BYTES (here: the whole 4000) must now arrive within the timeout; the typed timeout
    names the limit, the bytes received and the time it took."""
    from torchport.distributed._control import Server
    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.ft import StateTransferTimeoutError, fetch_state

    secret = b"d" * 32
    stop = threading.Event()
    trickling_source = _paced_state_source(torch.zeros(1000), 100, 0.2, stop, pause_first=True)
    src = Server(trickling_source, secret=secret, role="heal")
    mine = {"w": torch.ones(1000)}
    try:
        t0 = time.monotonic()
        with pytest.raises(StateTransferTimeoutError, match=r"beyond its 0\.5 s limit") as info:
            fetch_state(src.address, secret, timeout=0.5, into=mine)
        # (bounds wide enough for a loaded machine: the trickle alone would take 8 s)
        assert time.monotonic() - t0 < 4.0
        assert isinstance(info.value, CommTimeoutError) and info.value.partial
        took = re.search(r"gave up after (\d+\.\d+) s", str(info.value))
        assert took and 0.45 <= float(took[1]) < 4.0, str(info.value)
        assert "bytes received in" in str(info.value)
    finally:
        stop.set()
        src.close()


def test_fetch_state_from_a_source_that_never_answers_the_handshake_is_a_transfer_timeout():
    """fetch_state's timeout covers the connection, but a source whose kernel accepted and that
    never answered the handshake raised ConnectTimeoutError, not the StateTransferTimeoutError
    the docstring promised (nor any StateTransferError). It is wrapped now, the cause kept."""
    from torchport.distributed.errors import ConnectTimeoutError
    from torchport.distributed.ft import StateTransferTimeoutError, fetch_state

    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # the kernel accepts; nobody answers
        with pytest.raises(StateTransferTimeoutError, match=r"within its 0\.2 s limit") as info:
            fetch_state(listener.getsockname(), b"c" * 32, timeout=0.2)
        assert isinstance(info.value.__cause__, ConnectTimeoutError) and not info.value.partial
    finally:
        listener.close()


def test_fetch_state_from_a_steady_source_may_take_longer_than_its_timeout():
    """fetch_state's timeout bounded the whole transfer (8eb0b27), so a state that needed longer
    than the timeout over the link failed every heal (40 MB at 100 MB/s with a 0.25 s timeout).
    The timeout bounds each PROGRESS_BYTES now: a source sending 1 MiB every 0.2 s takes 1.4 s,
    over twice a 0.6 s timeout, in total and is received whole."""
    from torchport.distributed._control import Server
    from torchport.distributed.ft import fetch_state
    from torchport.distributed.ft.transfer import PROGRESS_BYTES

    secret = b"e" * 32
    chunks = 8
    n = chunks * PROGRESS_BYTES // 4
    payload = torch.arange(n, dtype=torch.float32)
    stop = threading.Event()
    steady_source = _paced_state_source(payload, PROGRESS_BYTES, 0.2, stop, pause_first=False)
    src = Server(steady_source, secret=secret, role="heal")
    try:
        state, hdr, secs = fetch_state(src.address, secret, timeout=0.6)
        assert secs > 0.6 * 2 and hdr["total"] == 4 * n
        assert torch.equal(state["w"], payload)
    finally:
        stop.set()
        src.close()


def test_abandoned_gloo_group_build_is_torn_down_when_it_completes_late():
    """A gloo replica that gave up building its group (a failure noticed mid-build, or the
    timeout) left the build running; the group it completed later stayed in the failed frame,
    alive while anything held the CommError (here: the caller keeps its errors), so every
    abandoned quorum kept a gloo group (3 threads, 4 sockets). It is retired once it exists."""
    import threading

    import torch.distributed as dist

    from torchport.distributed._control import PeerFailure
    from torchport.distributed._gloo import gloo_group
    from torchport.distributed.ft import Manager

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

    secret = b"b" * 32
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mgr = Manager(
        lighthouse=lh.address,
        replica_id="a",
        state_dict=dict,
        load_state_dict=lambda s: None,
        secret=secret,
        timeout=3.0,
        backend="gloo",
    )
    kept: list = []
    after: list = []
    try:
        for qid in (1, 2, 3):
            # the failure is noticed while the build waits for its peer (the build thread starts
            # first, the manager sees the error at its first look), and the other member joins
            # only after this one gave up: in this order, with no timer racing another
            mgr.report_error(PeerFailure("x"))
            with pytest.raises(CommError, match="failed: x") as info:
                mgr._build_group(qid, 0, 2, {"store_port": store.port})
            kept.append(info.value)
            peer: list = []
            joins = threading.Thread(
                target=lambda q=qid, out=peer: out.append(
                    gloo_group(dist.PrefixStore(f"tp-ft/q{q}", store), 1, 2, 3.0)
                ),
            )
            joins.start()
            joins.join(5)
            assert peer and peer[0].size() == 2  # so this member's build completed too
            mgr._error = None
            peer.clear()  # the peer's own group goes; this member's must go too
            time.sleep(0.1)
            after.append(held())
        _wait_for(
            lambda: all(n <= first for n, first in zip(held(), after[0])),
            3,
            f"no growth per abandoned build (threads, fds): {after} -> {held()}",
        )
    finally:
        mgr.shutdown()
        assert mgr._store is None  # (its client connection lasted as long as the manager)
        lh.close()
        # (it listened until some later test's collection)
        port, store, info = store.port, None, None
        kept.clear()
        _wait_listener_gone(port)


def test_shutdown_while_a_gloo_build_waits_ends_the_build_and_keeps_nothing(monkeypatch):
    """shutdown() from another thread while _build_group waited for a peer: the build went on
    to its timeout, then set a group (gloo's threads and sockets) and a store connection on the
    shut-down manager. It is abandoned at the shutdown now, with a CommError saying so."""
    import threading

    import torch.distributed as dist

    import torchport.distributed.ft.manager as M

    gate = threading.Event()
    built: list = []

    def slow_gloo_group(store: object, rank: int, size: int, timeout: float) -> object:
        gate.wait(5)  # the peer comes only after the shutdown
        built.append(pg := object())
        return pg

    retired: list = []
    monkeypatch.setattr(M, "gloo_group", slow_gloo_group)
    monkeypatch.setattr(M, "retire", lambda pg: retired.append(pg))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mgr = object.__new__(M.Manager)
    mgr._mesh, mgr._pg, mgr._qid, mgr.timeout = None, None, -1, 30.0
    mgr._store, mgr._error, mgr._closed = None, None, threading.Event()
    mgr.lighthouse = ("127.0.0.1", 0)

    def shutdown() -> None:  # the part of Manager.shutdown() the build sees
        mgr._closed.set()
        mgr._store = None

    threading.Timer(0.2, shutdown).start()
    t0 = time.monotonic()
    with pytest.raises(CommError, match="abandoned: the manager was shut down"):
        mgr._build_group(1, 0, 2, {"store_port": store.port})
    assert time.monotonic() - t0 < 5  # not the 30 s timeout
    assert mgr._pg is None and mgr._store is None
    gate.set()
    _wait_for(lambda: bool(built) and retired[-1] is built[0], 5, "the late group's retirement")
    port = store.port
    del store
    _wait_listener_gone(port)


def test_a_shut_down_manager_stops_asking_for_quorums(monkeypatch):
    """shutdown() while start_quorum's gloo build waited: the abandoned build's CommError was
    retried until quorum_timeout, each retry reconnecting the shut-down manager to the
    lighthouse (sockets and a listener thread left open) and starting another gloo build for
    each quorum offered (34 in 2 s: readK). start_quorum now stops at the shutdown."""
    import threading

    import torchport.distributed.ft.manager as M
    from torchport.distributed.ft import QuorumError

    gate = threading.Event()
    builds: list = []

    def slow_gloo_group(store: object, rank: int, size: int, timeout: float) -> object:
        builds.append(1)
        gate.wait(timeout)
        return object()

    monkeypatch.setattr(M, "gloo_group", slow_gloo_group)
    monkeypatch.setattr(M, "retire", lambda pg: None)
    secret = b"k" * 32
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    make = _ft_replicas(lh, secret, [], backend="gloo", timeout=3.0, quorum_timeout=2.0)
    mgr = make("r0", torch.zeros(1))
    try:
        threading.Timer(0.3, mgr.shutdown).start()
        with pytest.raises(QuorumError, match="the manager was shut down"):
            mgr.start_quorum()
        assert len(builds) == 1 and mgr._hb is None and mgr._rpc is None
        assert not [t for t in threading.enumerate() if t.name == "tp-ft-listen"]
    finally:
        gate.set()
        mgr._inject_close()
        lh.close()


def test_a_shutdown_during_a_reconnect_leaves_no_connection(monkeypatch):
    """shutdown() while start_quorum reconnected to the lighthouse closed nothing (the sockets
    were not set yet): the shut-down manager kept fresh sockets and a listener thread (readL)."""
    import threading

    import torchport.distributed.ft.manager as M
    from torchport.distributed.ft import QuorumError

    secret = b"k" * 32
    lh = Lighthouse(min_replicas=1, heartbeat=5.0, secret=secret)
    make = _ft_replicas(lh, secret, [], backend="gloo", timeout=3.0, quorum_timeout=2.0)
    mgr = make("r0", torch.zeros(1))
    real = M.connect

    def slow_connect(*a: object, **k: object) -> object:
        time.sleep(0.3)  # a slow handshake: the shutdown lands inside it
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(M, "connect", slow_connect)
    monkeypatch.setattr(M, "gloo_group", lambda store, rank, size, timeout: object())
    try:
        mgr._inject_close()  # the connection dropped: the next quorum reconnects
        threading.Timer(0.1, mgr.shutdown).start()
        with pytest.raises(QuorumError, match="the manager was shut down"):
            mgr.start_quorum()
        assert mgr._hb is None and mgr._rpc is None
        assert not [t for t in threading.enumerate() if t.name == "tp-ft-listen"]
    finally:
        mgr._inject_close()
        lh.close()


def test_abandoned_gloo_build_keeps_no_reference_in_the_raised_error(monkeypatch):
    """A gloo group the build completed just as the manager gave up was retired, but the
    abandoning frame's local still held it: the raised CommError's traceback kept it alive
    while the caller kept the error. The build here completes while the manager's first wait is
    still asleep, so the manager finds the group in its box when it gives up."""
    import gc
    import threading
    import types
    import weakref

    import torch.distributed as dist

    import torchport.distributed.ft.manager as M
    from torchport.distributed._control import PeerFailure

    class FakeGroup:
        pass

    made: list = []

    def fake_gloo_group(store: object, rank: int, size: int, timeout: float) -> FakeGroup:
        made.append(weakref.ref(pg := FakeGroup()))
        return pg

    class LateEvent(threading.Event):
        """Its first wait returns False after the build has finished (and set it)."""

        first = True

        def wait(self, timeout: float | None = None) -> bool:
            if LateEvent.first:
                LateEvent.first = False
                super().wait(5)
                return False
            return super().wait(timeout)

    monkeypatch.setattr(M, "gloo_group", fake_gloo_group)
    monkeypatch.setattr(M, "retire", lambda pg: None)  # keeps nothing itself
    monkeypatch.setattr(
        M,
        "threading",
        types.SimpleNamespace(Event=LateEvent, Lock=threading.Lock, Thread=threading.Thread),
    )
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mgr = object.__new__(M.Manager)
    mgr._mesh, mgr._pg, mgr._qid, mgr.timeout = None, None, -1, 3.0
    mgr._store, mgr._error, mgr._closed = store, PeerFailure("x"), threading.Event()
    with pytest.raises(CommError, match="failed: x") as info:
        mgr._build_group(1, 0, 2, {"store_port": store.port})
    kept = info.value
    assert made
    # (the build thread drops its own reference as it returns, just after setting the event)
    _wait_for(
        lambda: gc.collect() >= 0 and made[0]() is None,
        2,
        "the retired group to be freed while the caller keeps the error",
    )
    assert kept.__traceback__ is not None
    # (its listener was left to some later test's collection)
    port, store, mgr._store, info, kept = store.port, None, None, None, None
    _wait_listener_gone(port)


def test_malformed_lighthouse_hello_gets_an_error_reply_and_one_log_line(caplog, capfd):
    """A heartbeat hello without "rid" raised KeyError out of the lighthouse's handler thread (a
    traceback, the connection closed without a reply); one with a list for rid registered a
    replica named "[1]"; an unknown hello or rpc request closed without a word. Each is answered
    with an error and logged in one line now, and the lighthouse goes on serving."""
    import logging

    secret = b"h" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    caplog.set_level(logging.WARNING, logger="torchport.distributed.ft.lighthouse")
    socks: list = []
    try:
        cases = [
            ({"t": "hb"}, "rid must be a string, got None"),
            ({"t": "hb", "rid": [1]}, "rid must be a string, got [1]"),
            ({"t": "what"}, "unknown lighthouse hello 'what'"),
        ]
        for hello, why in cases:
            s = connect(lh.address, secret, "lighthouse", timeout=5)
            socks.append(s)
            s.settimeout(5)
            send_msg(s, hello)
            reply = recv_msg(s)
            assert reply["t"] == "error" and why in reply["error"], reply
        rpc = _lighthouse_replica(lh, secret, "good", socks)
        send_msg(rpc, {"t": "bogus"})
        assert recv_msg(rpc)["error"] == "unknown lighthouse request 'bogus'"
        rpc = _lighthouse_replica(lh, secret, "good", socks)  # still serving
        send_msg(rpc, {"t": "quorum", "rid": "good", "step": 0, "heal_addr": ["x", 1]})
        assert recv_msg(rpc)["members"] == ["good"]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 4 and all("\n" not in m for m in lines), lines
        assert not any("replica [1]" in e for _, e in lh.events)
    finally:
        for s in socks:
            s.close()
        lh.close()
    assert "Traceback" not in capfd.readouterr().err
