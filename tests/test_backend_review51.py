"""Backend review 51: ``_c10d_functional.batch_p2p_ops`` on a torchport group.

torch's kernel asks the group's C++ Backend whether it coalesces before it issues anything; a
torchport group (a Python ``ProcessGroup`` that is its own backend) has none, so the op failed
with "Could not retrieve or create the backend for device type cpu" (``isend`` / ``irecv`` alone
worked). torchport's CPU kernel runs the batch through the group's ``send`` / ``recv`` and hands
other groups, and lists torch refuses, to torch's kernel.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

import torchport.distributed  # noqa: F401 (the backend and its kernels)

TIMEOUT = datetime.timedelta(seconds=20)


def _batch_job(rank: int, world: int, init: str, backend: str) -> Any:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    ops = torch.ops._c10d_functional
    try:
        name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        peer = 1 - rank
        x = torch.arange(3.0) + 10 * rank
        buf = torch.full((3,), -1.0)
        outs = ops.batch_p2p_ops(["isend", "irecv"], [peer, peer], [7, 7], [x, buf], name)
        shapes = [list(o.shape) for o in outs]
        got = ops.wait_tensor(outs[1])
        ops.wait_tensor(outs[0])
        same = got.data_ptr() == buf.data_ptr()
        try:  # a list torch refuses: its kernel's error, not ours
            ops.batch_p2p_ops(["isend"], [peer, peer], [7], [x], name)
            refused = ""
        except RuntimeError as e:
            refused = type(e).__name__
        return shapes, buf.tolist(), same, refused
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_batch_p2p_ops_runs_on_a_torchport_group_as_on_gloo(backend: str) -> None:
    res = run_world(_batch_job, 2, backend, timeout=90)
    for rank, (shapes, got, same, refused) in enumerate(res):
        assert shapes == [[0], [3]]
        assert got == (torch.arange(3.0) + 10 * (1 - rank)).tolist()
        assert same and refused == "RuntimeError"
