"""Review 52 of the fault-tolerance package: one process per replica id at the lighthouse, a
bounded vote table, Manager.allreduce on views, constructor validation, conj/neg state tensors,
sparse gradients in the DDP wrapper, and a heal that checks the served step."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.ft_actors import small_manager
from torchport.distributed._control import connect, recv_msg, send_msg
from torchport.distributed.errors import CollectiveArgumentError
from torchport.distributed.ft import (
    DistributedDataParallel,
    Lighthouse,
    Manager,
    StateTransferError,
    recv_state,
    send_state,
)


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _connected(lh: Lighthouse, rid: str) -> int:
    return sum(e == f"replica {rid} connected" for _, e in lh.events)


def _raw(
    lh: Lighthouse, secret: bytes, rid: str, socks: list, life: str | None
) -> tuple[socket.socket, socket.socket]:
    """Replica ``rid`` by hand (heartbeat + rpc hellos naming ``life``, if any); returns both
    connections once the lighthouse registered the heartbeat."""
    seen = _connected(lh, rid)
    extra = {} if life is None else {"life": life}
    hb = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(hb, {"t": "hb", "rid": rid, **extra})
    rpc = connect(lh.address, secret, "lighthouse", timeout=2)
    send_msg(rpc, {"t": "rpc", "rid": rid, **extra})
    rpc.settimeout(10)
    socks.extend([hb, rpc])
    _wait_for(lambda: _connected(lh, rid) > seen, 5, f"{rid} registered")
    return hb, rpc


def _ask(rid: str, step: int, **kw: Any) -> dict[str, Any]:
    return {"t": "quorum", "rid": rid, "step": step, "heal_addr": ["x", 1], "timeout": 2, **kw}


def _vote(rid: str, qid: int, step: int, members: list[str], ok: bool) -> dict[str, Any]:
    return {"t": "commit", "rid": rid, "quorum_id": qid, "step": step, "members": members,
            "ok": ok, "timeout": 5}  # fmt: skip


# -- 1: one process per replica id ----------------------------------------------------------


@pytest.mark.parametrize("with_life", [True, False], ids=["life", "no-life-hello"])
def test_a_superseded_process_never_counts_again(with_life):
    """A second process registered under a live replica's id (a restart while the first was
    hung) left the first one accepted: it got the next quorum as the same member, a beat
    revived it, its "yes" counted for the replica, and the new process's "no" was answered
    "commit". Now the first is refused (marked "superseded") on every request, and the step
    fails on the new process's "no"."""
    secret = b"z" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list[socket.socket] = []
    life = (lambda name: name) if with_life else (lambda name: None)
    try:
        hb_old, old = _raw(lh, secret, "r0", socks, life("L1"))
        _, r1 = _raw(lh, secret, "r1", socks, life("M1"))
        send_msg(old, _ask("r0", 0))
        send_msg(r1, _ask("r1", 0))
        assert recv_msg(old)["members"] == ["r0", "r1"]
        recv_msg(r1)
        _, new = _raw(lh, secret, "r0", socks, life("L2"))  # r0 restarted, the first resumes
        with contextlib.suppress(OSError):  # (its heartbeat connection was closed)
            send_msg(hb_old, {"t": "b"})
        time.sleep(0.1)
        assert not any("beating again" in e for _, e in lh.events), lh.events
        send_msg(old, _ask("r0", 0))
        got = recv_msg(old)
        assert got["t"] == "error" and got.get("superseded") is True, got
        assert "superseded this one" in got["error"]
        send_msg(new, _ask("r0", 0))
        send_msg(r1, _ask("r1", 0))
        q = recv_msg(new)
        assert q["members"] == ["r0", "r1"], q
        assert recv_msg(r1)["quorum_id"] == q["quorum_id"]
        qid = q["quorum_id"]
        send_msg(old, _vote("r0", qid, 0, ["r0", "r1"], True))
        got = recv_msg(old)
        assert got["ok"] is False and got.get("superseded") is True, got
        send_msg(r1, _vote("r1", qid, 0, ["r0", "r1"], True))
        send_msg(new, _vote("r0", qid, 0, ["r0", "r1"], False))  # the live process says no
        assert recv_msg(new)["ok"] is False
        assert recv_msg(r1)["ok"] is False
        assert lh._top == 0
        if with_life:  # the superseded life cannot register again either
            hb = connect(lh.address, secret, "lighthouse", timeout=2)
            socks.append(hb)
            send_msg(hb, {"t": "hb", "rid": "r0", "life": "L1"})
            hb.settimeout(5)
            got = recv_msg(hb)
            assert got["t"] == "error" and got.get("superseded") is True, got
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_an_rpc_connection_speaks_for_its_hellos_replica_only():
    """Each request could name any replica id: r0's connection voted (and asked) as r1."""
    secret = b"i" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list[socket.socket] = []
    try:
        _, r0 = _raw(lh, secret, "r0", socks, "A")
        _raw(lh, secret, "r1", socks, "B")
        r0.settimeout(5)
        send_msg(r0, _ask("r1", 0))
        got = recv_msg(r0)
        assert got["t"] == "error", got
        assert "speaks for replica 'r0', the request names 'r1'" in got["error"]
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_a_second_vote_after_a_commit_is_answered_no():
    """A vote after the decision overwrote the first and was answered with the decision: a
    "no" from a member that had voted "yes" was answered "commit"."""
    secret = b"w" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5, heartbeat=5.0, secret=secret)
    socks: list[socket.socket] = []
    try:
        _, r0 = _raw(lh, secret, "r0", socks, "A")
        _, r1 = _raw(lh, secret, "r1", socks, "B")
        send_msg(r0, _ask("r0", 0))
        send_msg(r1, _ask("r1", 0))
        qid = recv_msg(r0)["quorum_id"]
        recv_msg(r1)
        send_msg(r0, _vote("r0", qid, 0, ["r0", "r1"], True))
        send_msg(r1, _vote("r1", qid, 0, ["r0", "r1"], True))
        assert recv_msg(r0)["ok"] is True and recv_msg(r1)["ok"] is True
        send_msg(r1, _vote("r1", qid, 0, ["r0", "r1"], False))
        got = recv_msg(r1)
        assert got["ok"] is False and "r1 already voted on step 0" in got["error"], got
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_a_manager_superseded_by_a_second_process_raises_a_typed_error():
    """Two managers given one replica id both trained, each committing alone. The later one
    supersedes the first, whose next vote and quorum raise ReplicaSupersededError."""
    from torchport.distributed.ft import ReplicaSupersededError

    secret = b"d" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=0.5, secret=secret)
    first = small_manager(lh, secret, "dup")
    second = None
    try:
        first.start_quorum()
        second = small_manager(lh, secret, "dup")
        _wait_for(lambda: isinstance(first.errored(), ReplicaSupersededError), 5, "notice")
        with pytest.raises(ReplicaSupersededError, match=r"replica dup: a newer process"):
            first.should_commit()
        with pytest.raises(ReplicaSupersededError, match=r"superseded this one"):
            first.start_quorum()
        second.start_quorum()
        assert second.should_commit() is True and second.current_step() == 1
    finally:
        first.shutdown()
        if second is not None:
            second.shutdown()
        lh.close()


# -- 2: bounded vote table and events -------------------------------------------------------


def test_the_vote_table_and_events_stay_bounded_in_steady_state():
    """One vote entry per step was kept as long as the quorum id lasted (30000 steps: 30000
    entries, +82 MiB, each vote scanning them all); events grew forever."""
    secret = b"v" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    socks: list[socket.socket] = []
    try:
        _, rpc = _raw(lh, secret, "r0", socks, "A")
        send_msg(rpc, _ask("r0", 0, group=1))
        qid = recv_msg(rpc)["quorum_id"]
        for step in range(60):
            send_msg(rpc, {**_vote("r0", qid, step, ["r0"], True), "next": _ask("r0", step + 1)})
            got = recv_msg(rpc)
            assert got["ok"] is True and got["quorum"]["quorum_id"] == qid, got
        assert lh._quorum_id == qid  # steady state: one quorum throughout
        assert len(lh._votes) <= 5, sorted(lh._votes)
        for i in range(3000):
            lh._log(f"event {i}")
        assert 1000 <= len(lh.events) < 2000
        assert lh.events[-1][1] == "event 2999"
    finally:
        for s in socks:
            s.close()
        lh.close()


# -- 3: Manager.allreduce on views -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_allreduce_averages_views_in_place_and_refuses_overlapping_ones(backend):
    """torch's gloo reduced a view's memory as if it were contiguous: a column or a transpose
    of a base got other elements of the base averaged (torchport's backend was right). An
    expanded tensor failed the step; it is refused at the call now."""
    secret = b"n" * 32
    lh = Lighthouse(min_replicas=2, join_timeout=5, heartbeat=0.5, secret=secret)
    results: dict[int, Any] = {}

    def views(v: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for name, make in {
            "column": lambda b: b[:, 1],
            "transpose": lambda b: b.t(),
            "left half": lambda b: b[:, :2],
            "offset": lambda b: b.view(-1)[3:9],
        }.items():
            base = torch.full((4, 4), v)
            out[name] = (base, make(base))
        zb = torch.full((3,), complex(v, v), dtype=torch.complex64)
        out["conj"] = (zb, zb.conj())
        return out

    def run(i: int) -> None:
        m = small_manager(lh, secret, f"r{i}", backend=backend, quorum_timeout=20.0)
        try:
            m.start_quorum()
            v = 2.0 * (i + 1)  # 2 and 4: the average is 3
            out: dict[str, Any] = {}
            for name, (base, view) in views(v).items():
                ok = m.allreduce(view).wait()
                out[name] = (ok, view.clone(), base.clone())
            try:
                m.allreduce(torch.full((1,), v).expand(3))
            except CollectiveArgumentError as e:
                out["expanded"] = str(e)
            out["commit"] = m.should_commit()
            results[i] = out
        finally:
            m.shutdown()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        lh.close()
    assert sorted(results) == [0, 1]
    for i, out in results.items():
        v = 2.0 * (i + 1)
        for name in ("column", "transpose", "left half", "offset"):
            ok, view, base = out[name]
            assert ok, name
            assert torch.equal(view, torch.full_like(view, 3.0)), (i, name, view)
            untouched = base.clone()
            {"column": lambda b: b[:, 1], "transpose": lambda b: b.t(),
             "left half": lambda b: b[:, :2],
             "offset": lambda b: b.view(-1)[3:9]}[name](untouched).fill_(v)  # fmt: skip
            assert torch.equal(untouched, torch.full_like(base, v)), (i, name, base)
        ok, view, _ = out["conj"]
        assert ok and torch.equal(view, torch.full((3,), complex(3.0, -3.0))), (i, view)
        assert "must not share memory; got shape (3,) with strides (0,)" in out["expanded"]
        assert out["commit"] is True


def test_overlap_check_tells_interleaved_strides_from_shared_memory():
    from torchport.distributed.ft.manager import _overlaps

    base = torch.zeros(16)
    assert not _overlaps(base.as_strided((3, 2), (2, 3)))  # offsets 0 2 4 3 5 7: all distinct
    assert _overlaps(base.as_strided((2, 2), (1, 1)))  # offsets 0 1 1 2
    assert _overlaps(torch.zeros(1).expand(4))
    assert not _overlaps(torch.zeros(4, 4)[:, 1])


# -- 4: constructor validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"lighthouse": None}, TypeError, r"lighthouse must be \(host, port\).*got None"),
        ({"lighthouse": "http://h:12/x"}, ValueError, r"lighthouse must be .*'http://h:12/x'"),
        ({"lighthouse": "https://h:12"}, ValueError, r"lighthouse must be .*'https://h:12'"),
        ({"lighthouse": "h"}, ValueError, r"lighthouse must be .*got 'h'"),
        (
            {"lighthouse": ("h", 70000)},
            ValueError,
            r"port must be an int in \[1, 65535\], got 70000",
        ),
        ({"lighthouse": ("h", -1)}, ValueError, r"port must be an int in \[1, 65535\], got -1"),
        ({"lighthouse": ("h", 2.7)}, ValueError, r"port must be an int in \[1, 65535\], got 2.7"),
        ({"lighthouse": ("h", True)}, ValueError, r"port must be an int .*got True"),
        ({"lighthouse": ("", 5)}, ValueError, r"host must be a non-empty string, got ''"),
        ({"replica_id": None}, TypeError, r"replica_id must be a string, got None"),
        ({"replica_id": 3}, TypeError, r"replica_id must be a string, got 3"),
        ({"replica_id": ""}, ValueError, r"replica_id must be a non-empty string, got ''"),
        ({"state_dict": None}, TypeError, r"state_dict must be callable, got None"),
        ({"load_state_dict": "x"}, TypeError, r"load_state_dict must be callable, got 'x'"),
        ({"init_sync": "no"}, TypeError, r"init_sync must be a bool, got 'no'"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else "",
)
def test_manager_validates_its_arguments(kw, error, match):
    args: dict[str, Any] = {
        "lighthouse": ("127.0.0.1", 1),
        "replica_id": "r0",
        "state_dict": dict,
        "load_state_dict": lambda s: None,
        "timeout": 1.0,
        **kw,
    }
    before = threading.active_count()
    with pytest.raises(error, match=match):
        Manager(**args)
    assert threading.active_count() == before  # (refused before any listener or thread)


@pytest.mark.parametrize("form", ["host:port", "http://host:port/", "[host]:port", "list"])
def test_manager_takes_the_lighthouse_as_a_string_or_pair(form):
    """ "127.0.0.1:40775" was dialled as host "1", port 2; "http://..." a bare ValueError."""
    secret = b"a" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    host, port = lh.address
    value: Any = {
        "host:port": f"{host}:{port}",
        "http://host:port/": f"http://{host}:{port}/",
        "[host]:port": f"[{host}]:{port}",
        "list": [host, port],
    }[form]
    try:
        m = small_manager(lh, secret, "r0", lighthouse=value)
        try:
            assert m.lighthouse == (host, port)
        finally:
            m.shutdown()
    finally:
        lh.close()


# -- 5: conj / neg state tensors -------------------------------------------------------------


def _roundtrip(state: Any, into: Any = None) -> tuple[Any, list[BaseException]]:
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_state(a, state, timeout=5)
        except BaseException as e:  # (reported by the test)
            errors.append(e)
        finally:
            a.close()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        got, _ = recv_state(b, into=into, timeout=5)
    finally:
        t.join(10)
        b.close()
    return got, errors


def test_state_tensors_with_conj_or_neg_bits_travel_by_value():
    """send_state raised a bare RuntimeError (after the header went out) for a tensor with a
    lazy conj/neg bit, and receiving into such a tensor raised one too."""
    n = torch.tensor([1.0, -2.0])
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    got, errors = _roundtrip({"neg": torch._neg_view(n), "conj": z.conj()})
    assert not errors, errors
    assert torch.equal(got["neg"], -n) and not got["neg"].is_neg()
    assert torch.equal(got["conj"], z.conj().resolve_conj()) and not got["conj"].is_conj()
    into = {"neg": torch._neg_view(torch.zeros(2)), "conj": torch.zeros(2, dtype=z.dtype).conj()}
    got, errors = _roundtrip({"neg": n.clone(), "conj": z.clone()}, into=into)
    assert not errors, errors
    assert torch.equal(got["neg"], n) and torch.equal(got["conj"], z)
    assert got["neg"] is not into["neg"] and got["conj"] is not into["conj"]


# -- 6: sparse gradients in the DDP wrapper --------------------------------------------------


@pytest.mark.parametrize("cls", [torch.nn.Embedding, torch.nn.EmbeddingBag])
def test_ddp_refuses_a_module_with_sparse_gradients(cls):
    """nn.Embedding(sparse=True) failed inside backward with a bare "reshape is not
    implemented for sparse tensors"."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), cls(10, 4, sparse=True))
    with pytest.raises(CollectiveArgumentError, match=r"parameter 1\.weight gets a sparse"):
        DistributedDataParallel(model, manager=None)  # type: ignore[arg-type]
    frozen = torch.nn.Sequential(cls(10, 4, sparse=True))
    frozen[0].weight.requires_grad_(False)  # (no gradient at all: accepted)
    DistributedDataParallel(frozen, manager=None)  # type: ignore[arg-type]


def test_ddp_names_a_parameter_whose_gradient_came_out_sparse():
    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return F.embedding(i, self.table, sparse=True)

    secret = b"s" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    mgr = small_manager(lh, secret, "r0")
    try:
        model = Table()
        ddp = DistributedDataParallel(model, mgr)
        mgr.start_quorum()
        with pytest.raises(CollectiveArgumentError, match=r"parameter table got a gradient"):
            ddp(torch.tensor([1, 2])).sum().backward()
    finally:
        mgr.shutdown()
        lh.close()


# -- 7: a heal checks the step it was served ------------------------------------------------


def test_a_heal_refuses_a_state_at_another_step_than_the_quorums():
    """The served state's step was loaded as it came, whatever the quorum's step."""
    secret = b"h" * 32
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=secret)
    source = small_manager(lh, secret, "src")
    loaded: list[Any] = []
    healer = Manager(
        lighthouse=lh.address,
        replica_id="healer",
        state_dict=lambda: {"w": torch.ones(2)},
        load_state_dict=loaded.append,
        secret=secret,
        backend="gloo",
        timeout=5.0,
    )
    try:
        source._step = 3
        q = {"quorum_id": 1, "max_step": 5, "steps": [3, 0], "heal_addrs": [source.heal_address]}
        with pytest.raises(StateTransferError, match=r"served a state at step 3, not the quorum"):
            healer._heal(q, 1, 0)
        assert loaded == [] and healer.current_step() == 0
        assert healer._torn  # (its own tensors may hold the source's bytes)
    finally:
        source.shutdown()
        healer.shutdown()
        lh.close()
