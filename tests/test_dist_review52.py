"""Distributed review 52.

1. Destroying a sub-group on one rank told its peers nothing: a collective they then issued on
  it (or one they were in) waited for the group timeout. The group's close now sends each
  member a goodbye for that group (``Mesh.send_group_goodbye``) after its last frame and step
  there: their waits for that rank in the group fail at once with :class:`PeerLeftError`, on
  TCP and on shared memory, while the other groups the ranks share go on.
2. ``wait(timeout)``: one rule for the backend's and the reconfigure / window Work
   (``progress.wait_limit_s``): a timedelta or seconds; None, zero, ``TIMEOUT_MAX`` or more
   (``inf``): no limit; negative: :class:`CommTimeoutError` at once unless done; NaN, a bool or
   a string: :class:`CollectiveArgumentError` naming it (the backend's Work ignored seconds,
   NaN and strings alike, waiting without limit).
3. A group's timeout of ``timedelta(days=365000)`` reaches the backend as 31535997952 s: torch
   rounds it (``_DistributedBackendOptions.timeout`` is a float duration). The mesh printed its
   timeout with ``:.0f`` (0.25 s: "0 s"); now ``:g`` as every other message.
4. The Flight Recorder gave each op of a functional ``batch_p2p_ops`` on a torchport group its
   own point-to-point sequence id; the ops of one batch now share one, as on gloo.

The job-level cases run real processes (``run_world``: forkserver, loopback, a hard timeout,
every child killed at the end); the rest runs in this process.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import raised as _error  # (what a call raised, and when)
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed import transport_tcp
from torchport.distributed.errors import PeerLeftError

TIMEOUT = datetime.timedelta(seconds=30)
SUB_TIMEOUT = datetime.timedelta(seconds=5)  # the sub-groups': what the old code waited for


# -- 1. a sub-group's destroy tells its peers ----------------------------------------------
@pytest.mark.timeout(30)
def test_a_wait_for_a_frame_of_a_group_the_peer_left_fails_at_once():
    """``Mailbox.get`` for a frame of group 7 from rank 0, whose goodbye for group 7 was read,
    raises at once; one for another group of rank 0 still waits (to its deadline here)."""
    box = transport_tcp.Mailbox()
    box.rank = 1
    box.left_groups.add((7, 0))
    start = time.monotonic()
    with pytest.raises(PeerLeftError, match=r"rank 1: .* rank 0, which left the group \(id 0x7"):
        box.get((7, 5, 0, 1), time.monotonic() + 10, lambda: None)
    assert time.monotonic() - start < 1.0
    with pytest.raises(Exception, match="timed out waiting for a frame"):
        box.get((8, 5, 0, 1), time.monotonic() + 0.05, lambda: None)
    assert box.has_left(7, 0) and not box.has_left(8, 0) and not box.has_left(7, 2)
    assert transport_tcp.GROUP_GOODBYE_SEQ > 3  # (the elastic groups' CTRL seqs are 1 to 3)


def _subgroup_leaver_job(rank: int, world: int, init: str) -> dict[str, Any]:
    """Rank 0 destroys sub-group ``after`` before rank 1 issues an all_reduce on it, and
    sub-group ``during`` while rank 1 is in an all_reduce (and has a recv from rank 0 posted)
    on it; then both ranks use a third sub-group of the same ranks and the default group."""
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    after = dist.new_group([0, 1], timeout=SUB_TIMEOUT)
    during = dist.new_group([0, 1], timeout=SUB_TIMEOUT)
    kept = dist.new_group([0, 1], timeout=SUB_TIMEOUT)
    for g in (after, during, kept):
        dist.all_reduce(torch.ones(4), group=g)
    out: dict[str, Any] = {}
    if rank == 0:
        dist.destroy_process_group(after)
        dist.barrier()
        dist.barrier()  # (rank 1 is in its all_reduce on ``during`` once this returns + 0.3 s)
        time.sleep(0.3)
        dist.destroy_process_group(during)
    else:
        dist.barrier()
        out["after"] = _error(lambda: dist.all_reduce(torch.ones(4), group=after))
        recv = dist.irecv(torch.zeros(4), src=0, group=during)
        dist.barrier()
        out["during"] = _error(lambda: dist.all_reduce(torch.ones(4), group=during))
        out["recv"] = _error(recv.wait)
        out["later"] = _error(lambda: dist.all_reduce(torch.ones(4), group=during))
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, group=kept)
    out["kept"] = x.tolist()
    dist.barrier()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_destroying_a_subgroup_fails_its_peers_waits_for_it_at_once(transport):
    """Before: rank 1's all_reduce on either group ran to the sub-group's 5 s timeout
    (CommTimeoutError), and its recv stayed posted."""
    res = run_world(
        _subgroup_leaver_job, 2, timeout=60, env={"TORCHPORT_DIST_TRANSPORT": transport}
    )
    r1 = res[1]
    for case in ("after", "during", "recv", "later"):
        name, _, took = r1[case]
        assert name == "PeerLeftError", (case, r1)
        # (0.0-0.3 s quiet; before: the 5 s group timeout; room for a loaded machine)
        assert took < 4.0, (case, r1)
    assert "rank 0" in r1["after"][1] and "left the group" in r1["after"][1], r1
    assert "a recv from rank 0, which left the group (it destroyed it)" in r1["recv"][1], r1
    assert "is in error state" in r1["later"][1], r1
    assert res[0]["kept"] == res[1]["kept"] == [3.0] * 4


# -- 2. wait(timeout): one rule for every torchport Work -----------------------------------
def _pending_works() -> list[tuple[str, Any, Callable[[], None]]]:
    """(kind, a Work not done yet, a call that finishes it) of each torchport Work class."""
    import concurrent.futures as cf

    from torchport.distributed.progress import TorchportWork
    from torchport.distributed.reconfigure import Work

    backend = TorchportWork("allreduce", None)
    fut: cf.Future[Any] = cf.Future()
    return [
        ("backend", backend, backend._finish),
        ("reconfigure", Work(fut, "reconfigure"), lambda: fut.set_result(None)),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["backend", "reconfigure"])
@pytest.mark.parametrize(
    ("timeout", "match"),
    [
        (float("nan"), r"wait\(\) takes no NaN timeout .* got nan"),
        (-float("nan"), r"wait\(\) takes no NaN timeout .* got nan"),
        ("1", r"wait\(\) takes its timeout as a datetime.timedelta, .* got '1'"),
        (True, r"wait\(\) takes its timeout as .* got True"),
    ],
    ids=["nan", "-nan", "str", "bool"],
)
def test_wait_refuses_what_is_no_timeout_naming_it(kind, timeout, match):
    """At once, whether the operation is done or not. Before: the backend's Work ignored any
    non-timedelta (NaN, '1', True: it waited without limit, here until the operation finished
    1 s later); the reconfigure Work timed out at once on NaN ("after nan s"), raised an
    untyped TypeError on a string and took True for 1 s."""
    from torchport.distributed.errors import CollectiveArgumentError

    (work, finish) = next((w, f) for k, w, f in _pending_works() if k == kind)
    timer = threading.Timer(1.0, finish)  # (ends the old code's wait)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(CollectiveArgumentError, match=match):
            work.wait(timeout)
        assert time.monotonic() - start < 0.5
    finally:
        timer.cancel()
        timer.join(10)
    if not work.is_completed():
        finish()
    with pytest.raises(CollectiveArgumentError, match=match):
        work.wait(timeout)
    assert work.wait() is True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["backend", "reconfigure"])
def test_wait_takes_seconds_inf_and_negative_by_the_documented_rule(kind):
    """Seconds bound the wait (the backend's Work ignored them: it waited until the operation
    finished, 0.6 s later); ``inf`` and ``timedelta.max`` wait without limit; ``-inf`` raises
    CommTimeoutError at once unless done."""
    from torchport.distributed.errors import CommTimeoutError

    (work, finish) = next((w, f) for k, w, f in _pending_works() if k == kind)
    timer = threading.Timer(0.6, finish)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(CommTimeoutError, match=r"wait\(\) timed out after 0.05"):
            work.wait(0.05)
        with pytest.raises(
            CommTimeoutError, match=r"negative timeout \(-inf s\) timed out at once"
        ):
            work.wait(-math.inf)
        assert time.monotonic() - start < 0.5
        assert work.wait(math.inf) is True
    finally:
        timer.join(10)
    assert work.wait(-math.inf) is True and work.wait(datetime.timedelta.max) is True
    assert work.wait(10**400) is True  # (an int too large for a float: no limit)


# -- 3. timeouts in messages ---------------------------------------------------------------
def test_the_group_timeout_c10d_hands_the_backend_is_rounded_by_torch():
    """c10d hands a custom backend its group timeout through ``_DistributedBackendOptions``,
    whose timeout is a float duration: 365000 days arrive as 31535997952 s, 5.1 s as
    5.099999 s. Not ours to fix; our messages print it with ``:g`` (3.1536e+10, 5.1)."""
    from torch._C._distributed_c10d import _DistributedBackendOptions

    opts = _DistributedBackendOptions()
    opts.timeout = datetime.timedelta(days=365000)
    assert opts.timeout.total_seconds() == 31535997952.0
    assert f"{opts.timeout.total_seconds():g}" == "3.1536e+10"


@pytest.mark.timeout(30)
def test_a_mesh_that_times_out_forming_names_its_timeout_as_given():
    """The mesh printed its timeout with ``:.0f``: 0.25 s read "within 0 s" (and a group's
    365000 days, as torch rounds them, "31535997952 s"); now ``:g``."""
    from torchport.distributed.errors import CommTimeoutError

    store = dist.HashStore()
    store.set("tp/host/1", "h")  # (rank 1 never comes)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"peers \[1\] did not connect within 0.25 s$"):
        transport_tcp.Mesh(
            store,
            0,
            2,
            secret=b"s" * 32,
            addr="127.0.0.1",
            timeout_s=0.25,
            max_frame=1 << 20,
            host_id="h",
        )
    assert time.monotonic() - start < 5.0


# -- 4. the Flight Recorder numbers a functional p2p batch once ----------------------------
def _fr_batch_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    from torchport.distributed import flight_recorder as fr

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    rec = fr.install(fr.FlightRecorder(dump_dir=d), signal_dump=False)
    ops = torch.ops._c10d_functional
    try:
        g = dist.group.WORLD
        assert g is not None
        name, peer = g.group_name, 1 - rank
        x, bufs = torch.arange(3.0) + rank, [torch.zeros(3) for _ in range(3)]
        outs = ops.batch_p2p_ops(["isend", "irecv"], [peer, peer], [5, 5], [x, bufs[0]], name)
        for o in outs:
            ops.wait_tensor(o)
        outs = ops.batch_p2p_ops(
            ["isend", "irecv", "isend", "irecv"], [peer] * 4, [6, 6, 7, 7],
            [x + 1, bufs[1], x + 2, bufs[2]], name,
        )  # fmt: skip
        for o in outs:
            ops.wait_tensor(o)
        dist.all_reduce(x)
        got = [b.tolist() for b in bufs]
        return got, [(e["op"], e["seq_id"], e["state"]) for e in rec.snapshot()["entries"]]
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_a_functional_p2p_batch_shares_one_sequence_id_on_every_backend(tmp_path, backend):
    """Before, on a torchport group each op of a ``batch_p2p_ops`` took its own point-to-point
    sequence id (0 1, then 2 3 4 5), while gloo's batches took one each (0 0, then 1 1 1 1)."""
    from torchport.distributed.flight_recorder import COMPLETED

    res = run_world(_fr_batch_job, 2, backend, str(tmp_path), timeout=75)
    for rank, (got, entries) in enumerate(res):
        theirs = torch.arange(3.0) + (1 - rank)
        assert got == [theirs.tolist(), (theirs + 1).tolist(), (theirs + 2).tolist()]
        c = COMPLETED
        assert entries == [
            ("send", 0, c), ("recv", 0, c),
            ("send", 1, c), ("recv", 1, c), ("send", 1, c), ("recv", 1, c),
            ("all_reduce", 0, c),
        ], (rank, entries)  # fmt: skip


# -- 5. a gather input that overlaps its own output slot only in part ----------------------
def _own_overlap_job(rank: int, world: int, init: str) -> dict[str, bool]:
    """Each rank's input overlaps its own output slot shifted by ``shift`` elements (0: the
    in-place form); every rank must get every rank's input as issued."""
    import torchport.distributed  # noqa: F401

    dist.init_process_group(
        "torchport", init_method=init, rank=rank, world_size=world, timeout=TIMEOUT
    )
    n, base = 5, 8
    want = torch.cat([torch.arange(n, dtype=torch.float64) + 100 * q for q in range(world)])
    out: dict[str, bool] = {}
    for op in ("list", "into"):
        for shift in (-1, 0, 1, 3):
            buf = torch.zeros(n * world + 2 * base, dtype=torch.float64)
            start = base + rank * n + shift
            inp = buf[start : start + n]
            inp.copy_(torch.arange(n, dtype=torch.float64) + 100 * rank)
            block = buf[base : base + n * world]
            if op == "list":
                dist.all_gather(list(block.split(n)), inp)
            else:
                dist.all_gather_into_tensor(block, inp)
            out[f"{op} {shift}"] = torch.equal(block, want)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_gather_input_overlapping_its_own_slot_in_part_is_read_as_issued(transport: str):
    """Over TCP the list all_gather copied the input into its own slot before sending it: an
    input overlapping that slot in part went out shifted (peers got [0, 0, 1, 2, 3] for
    [0, 1, 2, 3, 4]); it is now read from a copy, as one overlapping another rank's slot was."""
    res = run_world(_own_overlap_job, 2, timeout=60, env={"TORCHPORT_DIST_TRANSPORT": transport})
    for rank, got in enumerate(res):
        assert all(got.values()), (rank, got)
