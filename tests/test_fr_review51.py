"""Flight Recorder review 51: the functional point-to-point ops on a C++ group.

torch 2.13 has ``torch.ops._c10d_functional.isend``, ``irecv`` and ``batch_p2p_ops`` (what
``torch.distributed._functional_collectives.isend_inplace`` & co. and traced point-to-point code
issue). Their kernels take a group name only and call the group from C++, so on gloo no entry
was made; the collectives' kernels were recorded through a relay object, which a name cannot be.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed import flight_recorder as fr
from torchport.distributed.flight_recorder import COMPLETED, FlightRecorder
from torchport.distributed.fr_analyze import analyze, load_dumps

TIMEOUT = datetime.timedelta(seconds=20)


def _p2p_job(rank: int, world: int, init: str, d: str) -> Any:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    rec = fr.install(FlightRecorder(dump_dir=d), signal_dump=False)
    ops = torch.ops._c10d_functional
    try:
        g = dist.group.WORLD
        assert g is not None
        name, peer = g.group_name, 1 - rank
        x = torch.arange(3.0) + 10 * rank
        got: dict[str, Any] = {}
        received = torch.zeros(3)
        for step in ("send", "recv") if rank == 0 else ("recv", "send"):
            if step == "send":
                placeholder = ops.isend(x, peer, 0, name)
                ops.wait_tensor(placeholder)
                got["placeholder"] = (list(placeholder.shape), placeholder.dtype == x.dtype)
            else:
                out = ops.wait_tensor(ops.irecv(received, peer, 0, name))
                got["irecv"] = (out.tolist(), out.data_ptr() == received.data_ptr())
        buf = torch.zeros(2)
        outs = ops.batch_p2p_ops(["isend", "irecv"], [peer, peer], [5, 5], [x[:2] + 1, buf], name)
        got["batch"] = [list(o.shape) for o in outs] + [ops.wait_tensor(outs[1]).tolist()]
        ops.wait_tensor(outs[0])
        got["buf"] = buf.tolist()
        dist.all_reduce(x)  # (a collective after them: its own counter)
        rec.dump("test: end")
        entries = [
            (e["op"], e["seq_id"], e["state"], e["sizes"]) for e in rec.snapshot()["entries"]
        ]
        return got, entries
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(90)
def test_functional_point_to_point_ops_are_recorded_on_gloo(tmp_path):
    """isend / irecv are one send / recv entry each, a batch two entries sharing one sequence
    id, all completed by ``wait_tensor``; the results are torch's kernel's (isend: an empty
    tensor of the input's dtype; irecv: the given tensor, received into). None was recorded."""
    dumps = tmp_path / "dumps"
    (got0, e0), (got1, e1) = run_world(_p2p_job, 2, str(dumps), timeout=75)
    x0, x1 = [0.0, 1.0, 2.0], [10.0, 11.0, 12.0]
    for got, theirs in ((got0, x1), (got1, x0)):
        batch = [v + 1 for v in theirs[:2]]
        assert got == {
            "placeholder": ([0], True),
            "irecv": (theirs, True),
            "batch": [[0], [2], batch],
            "buf": batch,
        }, got
    first = {0: ("send", "recv"), 1: ("recv", "send")}
    for rank, entries in ((0, e0), (1, e1)):
        a, b = first[rank]
        assert entries == [
            (a, 0, COMPLETED, [[3]]),
            (b, 1, COMPLETED, [[3]]),
            ("send", 2, COMPLETED, [[2]]),
            ("recv", 2, COMPLETED, [[2]]),
            ("all_reduce", 0, COMPLETED, [[3]]),
        ], (rank, entries)
    text = analyze(load_dumps(dumps)).text()
    assert text.startswith("no problem found"), text
