"""DDP-style gradient averaging through the fault-tolerance manager, overlapped with backward.

Parameters are grouped into buckets (about ``bucket_cap_mb`` each) in reverse registration order,
which approximates the order in which backward produces their gradients. A
``register_post_accumulate_grad_hook`` on every parameter counts ready gradients; when a bucket is
complete (and every bucket before it has been launched: all replicas issue them in one order) its gradients are flattened into one fresh buffer and its allreduce is launched at once,
so communication runs on gloo's thread while autograd computes the remaining gradients. A callback
queued on the autograd engine waits for all buckets at the end of backward and writes the averaged
gradients back. Buckets are fresh buffers per step, so a stale op of an abandoned group can never
write into live gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from torchport.distributed.errors import CollectiveArgumentError
from torchport.distributed.ft.lighthouse import check_number
from torchport.distributed.ft.manager import Manager, _Work


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` averages its gradients over the quorum.

    One backward per step (no gradient accumulation across backward calls). Gradients must
    be dense: a module with a sparse gradient (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``) is refused here with :class:`CollectiveArgumentError`
    naming the parameter, and a sparse gradient met in backward (a functional sparse
    embedding) raises the same from ``backward()``.
    """

    def __init__(self, module: nn.Module, manager: Manager, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        # (NaN, inf or a string failed in int() or the comparison with a bare error)
        bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb, unit="MiB", most=math.inf)
        self.module = module
        self.manager = manager
        # (a sparse gradient failed inside backward with torch's bare "reshape is not
        # implemented for sparse tensors")
        for name, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            if (
                isinstance(sub, nn.Embedding | nn.EmbeddingBag)
                and sub.sparse
                and isinstance(weight, torch.Tensor)
                and weight.requires_grad
            ):
                raise CollectiveArgumentError(
                    f"DistributedDataParallel averages dense gradients only; parameter "
                    f"{name + '.' if name else ''}weight gets a sparse gradient "
                    f"({type(sub).__name__}(sparse=True)): use sparse=False"
                )
        self._names = {id(p): name for name, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int(bucket_cap_mb * (1 << 20))
        self._buckets: list[list[nn.Parameter]] = []
        cur: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._buckets.append(cur)
                cur, size = [], 0
        if cur:
            self._buckets.append(cur)
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
        self._ready = [0] * len(self._buckets)
        self._pending: list[tuple[_Work, torch.Tensor] | None] = [None] * len(self._buckets)
        self._queued = False
        # buckets launch in index order on every replica, whatever order their gradients arrive
        # in: the quorum pairs allreduces by issue order, and a data-dependent graph (a parameter
        # unused on one replica) completed them in different orders on different replicas
        self._launched = 0
        self.overlapped = 0  # buckets launched before backward finished (last step)
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ready = [0] * len(self._buckets)
        self._pending = [None] * len(self._buckets)
        self._queued = False
        self._launched = 0
        return self.module(*args, **kwargs)

    def _hook(self, p: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            self.overlapped = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        while self._launched < len(self._buckets) and self._ready[self._launched] == len(
            self._buckets[self._launched]
        ):
            self._launch(self._launched)
            self.overlapped += 1

    def _launch(self, b: int) -> None:
        grads = []
        for p in self._buckets[b]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.layout != torch.strided:
                raise CollectiveArgumentError(
                    f"DistributedDataParallel averages dense gradients only; parameter "
                    f"{self._names.get(id(p), '?')} got a gradient of layout {p.grad.layout}"
                )
            grads.append(p.grad.reshape(-1))
        flat = torch.cat(grads)
        self._pending[b] = (self.manager.allreduce(flat), flat)
        self._launched = b + 1

    def _finish(self) -> None:
        for b in range(self._launched, len(self._buckets)):
            self._launch(b)
        for b, item in enumerate(self._pending):
            assert item is not None
            work, flat = item
            if not work.wait():
                continue
            off = 0
            for p in self._buckets[b]:
                assert p.grad is not None
                n = p.numel()
                p.grad.copy_(flat[off : off + n].view_as(p.grad))
                off += n


class OptimizerWrapper:
    """``zero_grad`` joins the step's quorum; ``step`` applies the update only on a commit."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer) -> None:
        self.manager, self.optimizer = manager, optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> bool:
        """Returns whether the step was committed (and applied)."""
        if self.manager.should_commit():
            self.optimizer.step()
            return True
        return False
