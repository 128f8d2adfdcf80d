"""Regression tests for fault-tolerance bugs found by a review: commit votes without a quorum,
malformed mesh records, connections served after a server closed, the lighthouse's store after
close, hostile state headers, and heal connections that wait without bound."""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
import traceback
from typing import Any

import pytest
import torch

from tests.test_ft import _refused, _wait_for
from torchport.distributed import CommError
from torchport.distributed._control import (
    HELLO,
    NONCE,
    Server,
    client_answer,
    connect,
    recv_exact,
    recv_msg,
    send_msg,
)
from torchport.distributed.elastic import Member
from torchport.distributed.ft import (
    Lighthouse,
    Manager,
    QuorumError,
    StateTransferError,
    StateTransferTimeoutError,
    recv_state,
    send_state,
)
from torchport.distributed.ft.manager import MAX_HEAL_CONNECTIONS


def _replica(lh: Lighthouse, secret: bytes, rid: str, socks: list) -> socket.socket:
    """Connect replica ``rid`` to ``lh`` by hand (heartbeat + rpc, kept in ``socks``); return the
    rpc connection once the lighthouse has seen it."""
    hb = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(hb, {"t": "hb", "rid": rid})
    rpc = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(rpc, {"t": "rpc", "rid": rid})
    socks.extend([hb, rpc])
    rpc.settimeout(10)
    _wait_for(lambda: any(f"replica {rid} connected" in e for _, e in lh.events), 5, rid)
    return rpc


def _manager(lh: Lighthouse, secret: bytes, rid: str, **kw: Any) -> Manager:
    """A gloo manager whose state is one tensor (gloo: no native kernels to build)."""
    w = torch.zeros(2)
    return Manager(
        lighthouse=lh.address,
        replica_id=rid,
        state_dict=lambda: {"w": w},
        load_state_dict=lambda s: w.copy_(s["w"]),
        secret=secret,
        backend="gloo",
        **{"timeout": 5.0, "quorum_timeout": 5.0, **kw},
    )


# -- C1: commit votes ---------------------------------------------------------------------------


def test_should_commit_needs_a_quorum_and_votes_once_per_step():
    """should_commit() without start_quorum() committed alone (the vote's empty member list was
    unanimous at the lighthouse, which advanced its committed step), and a second should_commit()
    in one quorum-step committed again, applying a step nobody trained. Both raise QuorumError
    now and vote nothing; the normal start_quorum / should_commit cycle still commits."""
    secret = b"c" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    mgr = _manager(lh, secret, "r0")
    try:
        with pytest.raises(QuorumError, match=r"holds no quorum \(call start_quorum\(\) first\)"):
            mgr.should_commit()
        assert mgr.current_step() == 0 and lh._top == 0
        mgr.start_quorum()
        assert mgr.should_commit() is True and mgr.current_step() == 1
        with pytest.raises(QuorumError, match=r"already voted on"):
            mgr.should_commit()
        assert mgr.current_step() == 1 and lh._top == 1
        mgr.start_quorum()  # the next step: one vote again
        assert mgr.should_commit() is True and mgr.current_step() == 2
    finally:
        mgr.shutdown()
        lh.close()


def test_lighthouse_refuses_votes_outside_the_quorum_it_handed_out():
    """The lighthouse took a vote's member list as given: a vote naming no members was
    unanimous at once (and advanced the committed step) before any quorum existed. A vote counts
    now only from a member of the quorum handed out last, naming its id and members; a member's
    malformed vote is a "no" for the whole step."""
    secret = b"d" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list = []

    def vote(rpc: socket.socket, **kw: Any) -> dict:
        send_msg(rpc, {"t": "commit", "ok": True, "timeout": 2, **kw})
        return recv_msg(rpc)

    try:
        r0 = _replica(lh, secret, "r0", socks)
        r1 = _replica(lh, secret, "r1", socks)
        got = vote(r0, rid="r0", quorum_id=0, step=0, members=[])
        assert got["ok"] is False and "never handed out" in got["error"] and lh._top == 0
        send_msg(r0, {"t": "quorum", "rid": "r0", "step": 0, "heal_addr": ["x", 1], "timeout": 5})
        q = recv_msg(r0)
        assert q["members"] == ["r0"]
        qid = q["quorum_id"]
        got = vote(r1, rid="r1", quorum_id=qid, step=0, members=["r0"])
        assert got["ok"] is False and "not a member" in got["error"]
        got = vote(r0, rid="r0", quorum_id=qid + 1, step=0, members=["r0"])
        assert got["ok"] is False and "not the current quorum" in got["error"]
        got = vote(r0, rid="r0", quorum_id=qid, step=0, members=["r0", "r1"])
        assert got["ok"] is False and "are not quorum" in got["error"]
        assert lh._top == 0
        # a member's malformed vote failed its step: the well-formed vote after it is a "no"
        assert vote(r0, rid="r0", quorum_id=qid, step=0, members=["r0"])["ok"] is False
        send_msg(r0, {"t": "quorum", "rid": "r0", "step": 0, "heal_addr": ["x", 1], "timeout": 5})
        qid = recv_msg(r0)["quorum_id"]
        assert vote(r0, rid="r0", quorum_id=qid, step=0, members=["r0"])["ok"] is True
        assert lh._top == 1
    finally:
        for s in socks:
            s.close()
        lh.close()


# -- C2: mesh records ---------------------------------------------------------------------------

_BAD_MESHES = [
    ["not-an-id", "127.0.0.1", 5, "h"],
    [1, "127.0.0.1", "x", "h"],
    [True, "127.0.0.1", 5, "h"],
    [1.5, "127.0.0.1", 5, "h"],
    [-1, "127.0.0.1", 5, "h"],
    [1 << 40, "127.0.0.1", 5, "h"],
    [1, "", 5, "h"],
    [1, 7, 5, "h"],
    [1, "127.0.0.1", 70000, "h"],
    [1, "127.0.0.1", 0, "h"],
    [1, "127.0.0.1", 5, None],
]


@pytest.mark.parametrize("record", _BAD_MESHES, ids=repr)
def test_member_from_json_refuses_a_malformed_record_with_comm_error(record):
    """Member.from_json called int() on a peer's values: ["not-an-id", ...] raised a bare
    ValueError, which escaped the manager's start_quorum (it retries on CommError only) and
    ended the replica. Each element's type and range is checked now, as a CommError."""
    with pytest.raises(CommError, match=r"member record"):
        Member.from_json(record)


def test_member_from_json_round_trips_a_well_formed_record():
    """The checks keep every record to_json writes."""
    m = Member(12345, "127.0.0.1", 40000, "host-a")
    assert Member.from_json(m.to_json()) == m


@pytest.mark.parametrize("mesh", _BAD_MESHES[:6], ids=repr)
def test_lighthouse_refuses_a_quorum_request_with_a_malformed_mesh(mesh):
    """The lighthouse checked only that a mesh record was a list of 4, so an authenticated
    replica's ["not-an-id", "127.0.0.1", "x", "h"] went out in the quorum and every other
    member's start_quorum raised ValueError. The request is refused now, its sender told why."""
    secret = b"e" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list = []
    try:
        rpc = _replica(lh, secret, "r1", socks)
        ask = {"t": "quorum", "rid": "r1", "step": 0, "heal_addr": ["x", 1], "timeout": 2}
        send_msg(rpc, {**ask, "mesh": mesh})
        got = recv_msg(rpc)
        assert got["t"] == "error" and "malformed quorum request: mesh" in got["error"], got
    finally:
        for s in socks:
            s.close()
        lh.close()


# -- C3, C4: closing servers --------------------------------------------------------------------


def _start_handshake(s: socket.socket, secret: bytes, role: str) -> bytes:
    """Open the handshake by hand up to the client's answer (returned, not sent): the server then
    waits inside its handshake for it."""
    nonce = secrets.token_bytes(NONCE)
    s.sendall(HELLO + nonce)
    challenge = recv_exact(s, len(HELLO) + NONCE + 32)
    return client_answer(secret, role, nonce, challenge, "test")


def test_server_does_not_serve_a_connection_that_authenticates_after_close():
    """close() listed the open connections while one was still in its handshake; that one was
    then added and served after close (a closed lighthouse answered a quorum request). It is
    closed unserved now."""
    secret = b"f" * 32
    served = threading.Event()
    srv = Server(lambda c: served.set(), secret=secret, role="heal")
    s = socket.create_connection(srv.address, timeout=5)
    try:
        answer = _start_handshake(s, secret, "heal")  # the server is inside its handshake now
        srv.close()
        s.sendall(answer)
        with pytest.raises((OSError, CommError)):
            recv_exact(s, 2)  # "OK" may arrive: the close follows it
            recv_exact(s, 1)
        assert not served.wait(0.3)
    finally:
        s.close()


def test_closed_lighthouse_answers_no_quorum_and_starts_no_store():
    """A lighthouse closed while a replica's connections were in their handshake served them
    afterwards: it formed a quorum for the replica and started the gloo TCPStore."""
    secret = b"g" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks = [socket.create_connection(lh.address, timeout=5) for _ in range(2)]
    try:
        answers = [_start_handshake(s, secret, "lighthouse") for s in socks]
        lh.close()
        with pytest.raises((OSError, CommError)):
            for s, a in zip(socks, answers):
                s.sendall(a)
                recv_exact(s, 2)
            send_msg(socks[0], {"t": "hb", "rid": "ghost"})
            send_msg(socks[1], {"t": "rpc"})
            ask = {"t": "quorum", "rid": "ghost", "step": 0, "heal_addr": ["x", 1], "timeout": 2}
            send_msg(socks[1], ask)
            recv_msg(socks[1])
        time.sleep(0.2)
        assert lh.store is None
        assert not any("quorum" in e or "ghost" in e for _, e in lh.events), lh.events
    finally:
        for s in socks:
            s.close()


def test_lighthouse_close_releases_the_gloo_store():
    """Lighthouse.close() kept its TCPStore, which went on listening (unauthenticated) for as
    long as the Lighthouse object lived. close() drops it now."""
    secret = b"h" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list = []
    try:
        rpc = _replica(lh, secret, "r0", socks)
        send_msg(rpc, {"t": "quorum", "rid": "r0", "step": 0, "heal_addr": ["x", 1], "timeout": 2})
        port = recv_msg(rpc)["store_port"]
        assert port > 0
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for s in socks:
            s.close()
        lh.close()
    assert lh.store is None

    _wait_for(lambda: _refused(port), 3, f"the store on port {port} to stop listening")


# -- C5: state headers --------------------------------------------------------------------------

_T = {"__tensor__": 0}


@pytest.mark.parametrize(
    "header",
    [
        {"structure": _T, "tensors": [["float32", [0, 2**70], 0]], "total": 0},
        {"structure": _T, "tensors": [["float32", [1] * 65, 4]], "total": 4},
        {"structure": _T, "tensors": [["float32", "22", 16]], "total": 16},
        {"structure": _T, "tensors": [["float32", [2.9], 8]], "total": 8},
        {"structure": _T, "tensors": [["float32", [True], 4]], "total": 4},
        {"structure": _T, "tensors": [["float32", [1], 4.0]], "total": 4},
        {"structure": _T, "tensors": [["float32", [1], 4]], "total": "4"},
        {"structure": {"__tensor__": 0.7}, "tensors": [["float32", [1], 4]], "total": 4},
        {"structure": {"__tensor__": "0"}, "tensors": [["float32", [1], 4]], "total": 4},
    ],
    ids=[
        "dim-past-int64",
        "65-dims",
        "shape-string",
        "float-dim",
        "bool-dim",
        "float-nbytes",
        "string-total",
        "float-index",
        "string-index",
    ],
)
def test_hostile_state_header_is_a_state_transfer_error(header):
    """A dim of 2**70 reached torch.empty, whose TypeError escaped recv_state, fetch_state and
    the manager's heal (they catch StateTransferError); a shape "22" was read as [2, 2], [2.9]
    as [2], an index 0.7 as tensor 0. Dims, byte counts, the total and tensor indices must be
    ints (dims in [0, 2**63), at most 64 of them); anything else is a StateTransferError."""
    a, b = socket.socketpair()
    try:
        send_msg(a, {"t": "state", **header})
        a.sendall(b"\0" * 16)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(StateTransferError):
            recv_state(b, timeout=3)
    finally:
        a.close()
        b.close()


# -- C6: heal connections -----------------------------------------------------------------------


def test_send_state_to_a_peer_that_stops_reading_ends_by_its_timeout():
    """send_state had no deadline: a healer that asked for the state and never read it blocked
    the sender for good. Each PROGRESS_BYTES must now be taken within the timeout."""
    a, b = socket.socketpair()
    try:
        t0 = time.monotonic()
        with pytest.raises(StateTransferTimeoutError, match=r"state send stalled"):
            send_state(a, {"w": torch.zeros(8 << 20)}, timeout=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        a.close()
        b.close()


def test_heal_server_closes_an_idle_authenticated_connection_by_the_timeout():
    """The heal server waited for a request without a deadline once a connection had
    authenticated: 50 silent connections held 50 threads until shutdown. The request must
    arrive within the manager's timeout, else the connection is closed."""
    secret = b"i" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    mgr = _manager(lh, secret, "r0", timeout=0.3)
    s = connect(mgr.heal_address, secret, "heal", timeout=2)
    try:
        s.settimeout(5)
        t0 = time.monotonic()
        with pytest.raises(CommError, match=r"connection closed by peer"):
            recv_msg(s)
        assert time.monotonic() - t0 < 3
    finally:
        s.close()
        mgr.shutdown()
        lh.close()


def test_heal_server_refuses_connections_past_its_cap_naming_it():
    """Each authenticated heal connection got a thread, without bound. Past
    MAX_HEAL_CONNECTIONS at once a connection is refused at once, with an error naming it."""
    secret = b"j" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    mgr = _manager(lh, secret, "r0", timeout=10.0)
    socks = []
    try:
        socks = [
            connect(mgr.heal_address, secret, "heal", timeout=5)
            for _ in range(MAX_HEAL_CONNECTIONS)
        ]
        _wait_for(lambda: mgr._heal_slots._value == 0, 5, "every heal slot to be taken")
        extra = connect(mgr.heal_address, secret, "heal", timeout=5)
        socks.append(extra)
        extra.settimeout(5)
        got = recv_msg(extra)
        assert (
            got["t"] == "error" and f"MAX_HEAL_CONNECTIONS={MAX_HEAL_CONNECTIONS}" in got["error"]
        )
    finally:
        for s in socks:
            s.close()
        mgr.shutdown()
        lh.close()


def test_heal_server_stops_sending_to_a_healer_that_does_not_read():
    """A healer that asked for the state and never read it kept the heal server's thread in
    send_state until shutdown. The send now fails once no PROGRESS_BYTES go out within the
    manager's timeout, and the thread ends."""
    secret = b"k" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    mgr = _manager(lh, secret, "r0", timeout=0.3)
    big = {"w": torch.zeros(16 << 20)}  # 64 MB: far more than the socket buffers hold
    mgr._state_dict = lambda: big

    def sending() -> int:
        frames = sys._current_frames()
        return sum(
            any(f.name == "send_state" for f in traceback.extract_stack(frame))
            for tid, frame in frames.items()
            if tid != threading.get_ident()
        )

    s = connect(mgr.heal_address, secret, "heal", timeout=2)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        send_msg(s, {"t": "get_state", "step": None})
        _wait_for(lambda: sending() == 1, 5, "the heal server to start sending")
        _wait_for(lambda: sending() == 0, 5, "the heal server to give up on the stalled healer")
    finally:
        s.close()
        mgr.shutdown()
        lh.close()
