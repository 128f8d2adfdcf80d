"""Fault-tolerant data-parallel training in the manner of torchft.

* :class:`Lighthouse` — membership, failure detection, per-step quorum and commit votes.
* :class:`Manager` — one per replica: joins quorums, forms a new torchport (or gloo) group when membership
  changes, heals a lagging replica from a healthy one, averages gradients, votes on commits.
* :class:`DistributedDataParallel` — bucketed gradient allreduce overlapped with backward.
* :class:`OptimizerWrapper` — ``zero_grad`` starts the quorum, ``step`` applies only committed steps.

Example (one replica; start one per process, all with the lighthouse's address)::

    lh = Lighthouse(min_replicas=1)                     # somewhere, once
    mgr = Manager(lighthouse=lh.address, replica_id="r0",
                  state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                  load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                             opt.load_state_dict(s["optim"])))
    ddp, optim = DistributedDataParallel(model, mgr), OptimizerWrapper(mgr, opt)
    while mgr.current_step() < steps:
        optim.zero_grad()
        loss_fn(ddp(batch(mgr.current_step()))).backward()
        optim.step()
"""

from torchport.distributed.ft.ddp import DistributedDataParallel, OptimizerWrapper
from torchport.distributed.ft.lighthouse import Lighthouse
from torchport.distributed.ft.manager import (
    Manager,
    Metrics,
    QuorumError,
    ReplicaSupersededError,
)
from torchport.distributed.ft.transfer import (
    StateTransferError,
    StateTransferTimeoutError,
    fetch_state,
    recv_state,
    send_state,
)

__all__ = [
    "DistributedDataParallel",
    "Lighthouse",
    "Manager",
    "Metrics",
    "OptimizerWrapper",
    "QuorumError",
    "ReplicaSupersededError",
    "StateTransferError",
    "StateTransferTimeoutError",
    "fetch_state",
    "recv_state",
    "send_state",
]
