"""A job for ``torchrun`` (``torch.distributed.run``) on the ``torchport`` backend.

Run by ``test_distributed_torchrun.py`` as ``torchrun --nproc-per-node 2 torchrun_job.py OUT``:
initialises from the environment torchrun sets (``env://``: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), runs collectives and one DDP step, and writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchport.distributed  # noqa: F401  (registers "torchport")


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("torchport", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    t = torch.full((4099,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.arange(7.0) * (rank == 0)
    dist.broadcast(b, src=0)
    gathered = torch.empty(2 * world)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 3)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(q)) for q in range(world)]
    want = []  # every rank's local gradient, computed here without communication
    for x in xs:
        ref = torch.nn.Linear(8, 3)
        ref.load_state_dict(lin.state_dict())
        ref(x).square().sum().backward()
        assert ref.weight.grad is not None
        want.append(ref.weight.grad)
    model = DDP(lin)
    model(xs[rank]).square().sum().backward()
    grad = model.module.weight.grad
    assert grad is not None
    result = {
        "rank": rank,
        "world": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "backend": dist.get_backend(),
        "transport": pg.transport,
        "allreduce": sorted(set(t.tolist())),
        "broadcast": b.tolist(),
        "allgather": gathered.tolist(),
        "grad_matches_mean": bool(torch.allclose(grad, sum(want) / world, rtol=1e-5, atol=1e-6)),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
