"""Backend review 50: ``_c10d_functional.all_gather_into_tensor_out`` on a torchport group.

c10d runs that op on the group's C++ Backend for the device, which a torchport group (a Python
``ProcessGroup`` that is its own backend) does not have: it failed with "Could not retrieve or
create the backend for device type cpu", with or without the Flight Recorder. torchport's CPU
kernel runs it through the group's ``_allgather_base`` and hands other groups to torch's kernel.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

import torchport.distributed  # noqa: F401 (the backend and its kernel)

TIMEOUT = datetime.timedelta(seconds=20)


def _gather_out_job(rank: int, world: int, init: str, backend: str) -> Any:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    ops = torch.ops._c10d_functional
    try:
        g = dist.group.WORLD
        assert g is not None
        x = torch.arange(3.0) + 10 * rank
        got = []
        for group in (g.group_name, g):  # (a compiled graph passes the name; eager the group)
            out = torch.full((3 * world,), -1.0)
            ret = ops.wait_tensor(ops.all_gather_into_tensor_out(x, world, group, out=out))
            got.append((out.tolist(), ret.data_ptr() == out.data_ptr()))
        try:
            bad = (torch.arange(6.0) + rank).view(3, 2)[:, 0]  # not contiguous: gloo takes it
            o = torch.empty(3 * world)
            ops.wait_tensor(ops.all_gather_into_tensor_out(bad, world, g.group_name, out=o))
            strided = o.tolist()
        except RuntimeError as e:
            strided = repr(e)
        dist.barrier()
        return got, strided
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_functional_all_gather_into_a_given_tensor(backend):
    results = run_world(_gather_out_job, 2, backend, timeout=75)
    want = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    for got, strided in results:
        assert got == [(want, True), (want, True)], got
        assert strided == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0], strided  # (a strided input, as gloo)
