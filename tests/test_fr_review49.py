"""Flight Recorder review 49: ops are recorded where they reach the process group.

``install()`` recorded the ``torch.distributed`` functions it knew, as attributes of the package:
FSDP2's ``all_gather_single`` / ``reduce_scatter_single`` were not among them (a training step
recorded nothing), the object collectives call torch's module functions directly (no entry, and
a rank stuck in ``all_gather_object`` was reported as crashed), and an op torch refused in its
argument checks on one rank took a sequence id there (every later collective a false mismatch).
Also: the watchdog's ``period_s`` is validated, and a dead watchdog thread does not block a
restart.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed import flight_recorder as fr
from torchport.distributed.flight_recorder import COMPLETED, FlightRecorder
from torchport.distributed.fr_analyze import analyze, load_dumps

TIMEOUT = datetime.timedelta(seconds=20)


def _init(rank: int, world: int, init: str, backend: str, dump_dir: str) -> FlightRecorder:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    return fr.install(FlightRecorder(dump_dir=dump_dir), signal_dump=False)


def _ops(rec: FlightRecorder) -> list[tuple[str, int, str, list[list[int]]]]:
    return [(e["op"], e["seq_id"], e["state"], e["sizes"]) for e in rec.snapshot()["entries"]]


def _verdict(d: Path) -> str:
    return analyze(load_dumps(d)).text()


# -- 1: FSDP2 and torch's newer collective names ---------------------------------------------
def _fsdp2_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rec = _init(rank, world, init, backend, d)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 8)).sum().backward()
        rec.dump("test: end")
        return [(op, state) for op, _, state, _ in _ops(rec)]
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(60)
def test_fsdp2_forward_and_backward_record_their_all_gathers_and_reduce_scatters(tmp_path):
    """FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (async): nothing
    was recorded on either rank. (On gloo: the torchport group takes the same path, see the
    next test.)"""
    r0, r1 = run_world(_fsdp2_job, 2, "gloo", str(tmp_path), timeout=45)
    assert r0 == r1, (r0, r1)
    ops = [op for op, _ in r0]
    assert "all_gather_into_tensor" in ops and "reduce_scatter_tensor" in ops, r0
    assert all(state == COMPLETED for _, state in r0), r0
    text = _verdict(tmp_path)
    assert text.startswith("no problem found"), text


def _single_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    rec = _init(rank, world, init, backend, d)
    try:
        t, big = torch.ones(4), torch.empty(4 * world)
        dist.all_gather_single(big, t)
        work = dist.all_gather_single(big, t, async_op=True)
        assert work is not None
        work.wait()
        dist.reduce_scatter_single(t, big)
        work = dist.reduce_scatter_single(t, big, async_op=True)
        assert work is not None
        work.wait()
        dist.all_gather_into_tensor(big, t)  # (torch 2.13 issues the same op of the group)
        with dist._coalescing_manager():  # two all_reduces, issued as one op at its end
            dist.all_reduce(t)
            dist.all_reduce(big)
        dist.all_reduce(t)
        rec.dump("test: end")
        return _ops(rec)
    finally:
        fr.uninstall()
        rec.stop()


def _coalesced_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    rec = _init(rank, world, init, backend, d)
    try:
        t, outs = torch.ones(4), [[torch.empty(4)] for _ in range(world)]  # (rank, input)
        got = []
        for call in (
            lambda: dist.all_reduce_coalesced([t], async_op=True),
            lambda: dist.all_gather_coalesced(outs, [t], async_op=True),
        ):
            fut = call()  # (a future, not a Work: attach() called its get_future())
            got.append(type(fut).__name__)
            fut.wait()
        dist.all_reduce_coalesced([t])
        got.append(t.tolist())
        return got, [(op, state) for op, _, state, _ in _ops(rec)]
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_async_coalesced_collectives_return_their_future_and_complete(tmp_path, backend):
    """``all_reduce_coalesced`` / ``all_gather_coalesced`` with ``async_op=True`` return a
    future; once they were recorded, attach() asked it for ``get_future`` (AttributeError,
    after the op had been issued) and the entries stayed started."""
    for got, ops in run_world(_coalesced_job, 2, backend, str(tmp_path), timeout=45):
        assert got == ["Future", "Future", [4.0] * 4], got
        assert ops == [
            ("all_reduce_coalesced", COMPLETED),
            ("all_gather_coalesced", COMPLETED),
            ("all_reduce_coalesced", COMPLETED),
        ], ops


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_all_gather_single_and_reduce_scatter_single_are_recorded_once(tmp_path, backend):
    r0, r1 = run_world(_single_job, 2, backend, str(tmp_path), timeout=45)
    ag, rs = ("all_gather_into_tensor", [[8], [4]]), ("reduce_scatter_tensor", [[4], [8]])
    want = [
        (ag[0], 0, COMPLETED, ag[1]),
        (ag[0], 1, COMPLETED, ag[1]),
        (rs[0], 2, COMPLETED, rs[1]),
        (rs[0], 3, COMPLETED, rs[1]),
        (ag[0], 4, COMPLETED, ag[1]),
        ("all_reduce_coalesced", 5, COMPLETED, [[4], [8]]),
        ("all_reduce", 6, COMPLETED, [[4]]),
    ]
    assert r0 == want and r1 == want, (r0, r1)
    text = _verdict(tmp_path)
    assert text.startswith("no problem found"), text


def test_uninstall_restores_the_process_group_methods_and_the_functions():
    names = ("allreduce", "all_gather_single", "reduce_scatter_single", "send", "barrier")
    before = {n: vars(dist.ProcessGroup)[n] for n in names}
    funcs = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    try:
        fr.install(rec, signal_dump=False)
        assert all(vars(dist.ProcessGroup)[n] is not before[n] for n in names)
        assert all(getattr(dist, n) is not f for n, f in funcs.items())
    finally:
        fr.uninstall()
        rec.stop()
    assert all(vars(dist.ProcessGroup)[n] is before[n] for n in names)
    assert all(getattr(dist, n) is f for n, f in funcs.items())


def test_a_process_group_class_defined_after_install_is_recorded_and_restored():
    """A subclass defining its own collective, defined while installed, is wrapped (at its
    definition since review 50; before, when a wrapped function first met one of its groups);
    a group never named is recorded under a name of its own (its ``group_name`` raised
    "ProcessGroup name not set" inside the call)."""

    class Done:
        def wait(self, timeout: Any = None) -> bool:
            return True

    def mine(self: Any, tensors: Any, opts: Any = None) -> Done:
        return Done()

    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    try:
        fr.install(rec, signal_dump=False)

        class LatePG(dist.ProcessGroup):
            allreduce = mine

        dist.all_reduce(torch.ones(3), group=LatePG(0, 1))
        got = [(e["op"], e["seq_id"], e["state"], e["sizes"]) for e in rec.snapshot()["entries"]]
        assert got == [("all_reduce", 0, COMPLETED, [[3]])], got
        assert vars(LatePG)["allreduce"] is not mine
    finally:
        fr.uninstall()
        rec.stop()
    assert vars(LatePG)["allreduce"] is mine


# -- 2: object collectives -------------------------------------------------------------------
def _objects_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    rec = _init(rank, world, init, backend, d)
    try:
        got: list[Any] = [None] * world
        dist.broadcast_object_list([{"a": 1}] if rank == 0 else [None], src=0)
        dist.all_gather_object(got, rank)
        dist.gather_object(rank, got if rank == 0 else None, dst=0)
        dist.scatter_object_list([None], [1, 2] if rank == 0 else None, src=0)
        rec.dump("test: end")
        return [(op, seq, state) for op, seq, state, _ in _ops(rec)]
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_object_collectives_record_the_ops_they_issue_once(tmp_path, backend):
    """They call torch's module functions (all_gather_object: two all_gathers) or the group:
    nothing was recorded."""
    r0, r1 = run_world(_objects_job, 2, backend, str(tmp_path), timeout=45)
    ops = [
        "broadcast",  # broadcast_object_list: sizes, then the bytes
        "broadcast",
        "all_gather",  # all_gather_object: sizes, then the bytes
        "all_gather",
        "all_gather",  # gather_object: sizes to all, then a gather
        "gather",
        "broadcast",  # scatter_object_list: the largest size, the bytes, the sizes
        "scatter",
        "scatter",
    ]
    want = [(op, i, COMPLETED) for i, op in enumerate(ops)]
    assert r0 == want and r1 == want, (r0, r1)
    text = _verdict(tmp_path)
    assert text.startswith("no problem found"), text


def _stuck_job(rank: int, world: int, init: str, d: str) -> Any:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=5)
    )
    rec = FlightRecorder(dump_dir=d)
    fr.install(rec, signal_dump=False)
    rec.stop()
    rec.start_watchdog(timeout_s=0.2, period_s=0.02)
    try:
        dist.all_reduce(torch.ones(4))
        mine = Path(d) / "rank_0.json"
        if rank == 0:
            try:
                dist.all_gather_object([None] * world, rank)  # rank 1 never calls it
            except RuntimeError as e:  # (the gloo timeout, or rank 1 leaving)
                return f"error: {type(e).__name__}"
            return "no error"
        rec.dump("test: rank 1 elsewhere")
        deadline = time.monotonic() + 10
        while not mine.exists():  # rank 0's watchdog dump
            assert time.monotonic() < deadline, "rank 0's watchdog did not dump"
            time.sleep(0.02)
        return "dumped"
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(60)
def test_a_rank_stuck_in_all_gather_object_is_named_by_the_analyzer(tmp_path):
    """Rank 0 waits in all_gather_object, which rank 1 never calls: rank 0 had no entry, so its
    watchdog never dumped and the analyzer reported it as crashed ("no dump")."""
    r0, r1 = run_world(_stuck_job, 2, str(tmp_path), timeout=45)
    assert r0.startswith("error") and r1 == "dumped", (r0, r1)
    v = analyze(load_dumps(tmp_path))
    assert v.missing_ranks == [], v.text()
    assert v.never_entered == [(1, "default", 1, "all_gather")], v.text()
    assert "rank 1 never entered collective #1 (all_gather)" in v.text()


# -- 3: an op torch refuses before the group gets it -----------------------------------------
def _refused_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    rec = _init(rank, world, init, backend, d)
    try:
        if rank == 0:
            with pytest.raises(ValueError, match=r"does not support .*MAX on complex tensors"):
                dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        rec.dump("test: end")
        return [(op, seq, state) for op, seq, state, _ in _ops(rec)]
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_an_op_refused_before_the_group_got_it_takes_no_sequence_id(tmp_path, backend):
    """A complex all_reduce with MAX, refused by torch on rank 0 only, took id 0 there: the
    analyzer then found a mismatch at every later id and blamed rank 1."""
    r0, r1 = run_world(_refused_job, 2, backend, str(tmp_path), timeout=45)
    want = [("all_reduce", 0, COMPLETED), ("broadcast", 1, COMPLETED)]
    assert r0 == want and r1 == want, (r0, r1)
    text = _verdict(tmp_path)
    assert text.startswith("no problem found"), text


# -- 5: the watchdog's period ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "0.1", True, None])
def test_a_bad_watchdog_period_is_refused(tmp_path, bad):
    """0, a negative or nan period spun a core; "0.1" killed the watchdog thread."""
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1, dump_dir=tmp_path)
    with pytest.raises(ValueError, match=r"period_s must be a finite number > 0, got "):
        rec.start_watchdog(5.0, period_s=bad)
    assert rec._watchdog is None


def test_a_dead_watchdog_thread_does_not_block_a_restart(tmp_path):
    """The thread of a watchdog that died stayed recorded as running: no later start ran."""
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1, dump_dir=tmp_path)
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join(5)
    rec._watchdog = dead  # (as a watchdog thread ended by an exception leaves it)
    rec.record("all_reduce", "default", [torch.ones(1)])  # never completes
    rec.start_watchdog(timeout_s=0.05, period_s=1e300)  # (a huge period: capped, no overflow)
    try:
        assert rec._watchdog is not dead and rec._watchdog.is_alive()
    finally:
        rec.stop()
    rec.start_watchdog(timeout_s=0.05, period_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "rank_0.json").exists():
            assert time.monotonic() < deadline, "the restarted watchdog did not dump"
            time.sleep(0.01)
    finally:
        rec.stop()
