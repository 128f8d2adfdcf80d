"""Group construction regressions: c10d's rank order, the root mesh at destroy, a reconfigure that
fails while forming, and ``split_group``'s signature.

Multi-rank cases run on real processes (``run_world``: forkserver, file:// rendezvous, loopback,
a hard timeout, every child killed at the end); the reconfigure cases run their groups in this
process, as ``tests/test_reconfigure.py`` does.
"""

from __future__ import annotations

import datetime
import inspect
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed import (
    CollectiveArgumentError,
    PeerFailure,
    ReconfigurableGroup,
    ReconfigureError,
    _reconfigure,
)

TIMEOUT = datetime.timedelta(seconds=20)


# -- new_group(sort_ranks=False) and splits of such a group ---------------------------------
def _order_job(rank: int, world: int, init: str) -> dict[str, Any]:
    import torchport.distributed as tpd

    dist.init_process_group("torchport", init_method=init, rank=rank, world_size=world)
    short = datetime.timedelta(seconds=5)  # a frame sent astray fails the op by then
    g = dist.new_group([2, 0], sort_ranks=False, timeout=short)
    out: dict[str, Any] = {}
    if rank != 1:
        out["rank"] = dist.get_rank(g)
        got = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(got, torch.tensor([float(rank)]), group=g)
        out["all_gather"] = [int(t) for t in got]
        t = torch.tensor([float(rank)])
        dist.broadcast(t, group_src=0, group=g)
        out["broadcast"] = float(t)
        t = torch.tensor([42.0 if dist.get_rank(g) == 0 else 0.0])
        if dist.get_rank(g) == 0:
            dist.send(t, group_dst=1, group=g)
        else:
            dist.recv(t, group_src=0, group=g)
        out["p2p"] = float(t)
        # torch orders a split's members by their rank in the parent: global 2 first
        sp = tpd.split_group(g, [[1, 0]], timeout=short)
        assert sp is not None
        out["split_ranks"] = dist.get_process_group_ranks(sp)
        got = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(got, torch.tensor([float(rank)]), group=sp)
        out["split_all_gather"] = [int(t) for t in got]
    dist.barrier()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_group_of_unsorted_ranks_keeps_c10ds_rank_order(transport):
    """new_group([2, 0], sort_ranks=False): c10d's group rank 0 is global rank 2. The
    communicator sorted the ranks while c10d did not: on shm the send reached the wrong rank
    (a timeout), on tcp every collective failed ("rank 2 has no connection to rank 2")."""
    res = run_world(_order_job, 3, timeout=60, env={"TORCHPORT_DIST_TRANSPORT": transport})
    assert res[1] == {}
    for q in (0, 2):
        assert res[q] == {
            "rank": {2: 0, 0: 1}[q],
            "all_gather": [2, 0],
            "broadcast": 2.0,
            "p2p": 42.0,
            "split_ranks": [2, 0],
            "split_all_gather": [2, 0],
        }, (q, res[q])


# -- a reconfigure that fails while forming keeps watching the old members ------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_a_reconfigure_failed_while_forming_keeps_watching_the_members(backend):
    """Rank 0 reconfigures to [0, 1] and rank 1 never joins: the formation times out and the old
    group stays. A crash of rank 2 after that was noticed late on rank 0 (torchport: 1.6 s, by
    the abort of the messenger, rank 1; gloo: never): the watch stopped for the formation was
    not resumed."""
    gs = [ReconfigurableGroup(heartbeat=0.1, backend=backend) for _ in range(3)]
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        for w in [_reconfigure(1, hs, g) for g in gs]:
            w.wait(timeout=30)
        hs = [g.get_reconfigure_handle() for g in gs]
        t0 = time.perf_counter()
        with pytest.raises(ReconfigureError, match="forming the group for uuid 2 failed"):
            _reconfigure(2, hs[:2], gs[0], timeout=datetime.timedelta(seconds=1)).wait(30)
        assert time.perf_counter() - t0 < 10
        assert gs[0].rank() == 0 and gs[0].size() == 3  # the old group is kept
        time.sleep(0.3)  # (gloo: the watch connections are opened again)
        assert gs[0].get_error() is None
        t0 = time.perf_counter()
        gs[2].close()  # rank 2 is gone: its connections close
        end = time.monotonic() + 5
        while gs[0].get_error() is None and time.monotonic() < end:
            time.sleep(0.002)
        assert time.perf_counter() - t0 < 0.5
        err = gs[0].get_error()
        assert isinstance(err, PeerFailure), err
        # rank 2 named as the culprit (not the messenger, "rank 1 failed"); rank 0's own watch
        # or rank 1's notice, whichever comes first, may tell it ("reported by rank 1")
        assert "rank 2 crashed" in str(err), err
    finally:
        for g in gs:
            g.close()


# -- split_group's signature ----------------------------------------------------------------
@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    import torchport.distributed  # noqa: F401

    path = tmp_path_factory.mktemp("store") / "f"
    dist.init_process_group(
        "torchport", rank=0, world_size=1, init_method=f"file://{path}", timeout=TIMEOUT
    )
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


def test_split_group_takes_torchs_parameters_in_torchs_order():
    from torchport.distributed import split_group

    ours = inspect.signature(split_group).parameters
    theirs = inspect.signature(dist.split_group).parameters
    assert list(ours) == list(theirs)
    assert all(p.default is None for p in ours.values())


def test_split_group_called_as_torchs(world1):
    from torchport.distributed import split_group

    g = split_group(None, [[0]], None, None, "described")  # torch's positional order
    assert g is not None and g.group_desc == "described"
    for name in ("torchport", dist.Backend("torchport"), "cpu:torchport"):
        g = split_group(split_ranks=[[0]], pg_options=None, backend=name)
        assert g is not None and g.size() == 1


@pytest.mark.parametrize(
    "kw, why",
    [
        (
            {"pg_options": "described"},
            r"takes no pg_options .* so pg_options must be None; got 'described'",
        ),
        (
            {"backend": "gloo"},
            r"backend must be the parent group's, 'torchport' \(or 'cpu:torchport'\), or "
            r"None; got 'gloo'",
        ),
        ({"backend": "cuda:torchport"}, r"got 'cuda:torchport'"),
    ],
)
def test_split_group_refuses_options_it_cannot_honour(world1, kw, why):
    from torchport.distributed import split_group

    with pytest.raises(CollectiveArgumentError, match=why):
        split_group(None, [[0]], **kw)
