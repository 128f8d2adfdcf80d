"""Graph capture and replay on the CPU (``torch.accelerator.Graph``), plus a memory pool.

- :class:`Graph`: ``capture_begin``/``capture_end`` (or ``with graph:``), ``replay``, ``reset``,
  ``pool``; replay is one call into TorchScript's interpreter, with ``switch``/``while_loop``
  inside the capture as real branches and loops;
- :class:`MemPool`: size-bucketed placement allocator shared between graphs, with ``stats()``;
- :class:`CaptureError`: an op that cannot be captured, named at capture time.
"""

from torchport.graphs.capture import CaptureError
from torchport.graphs.graph import Graph, GraphError
from torchport.graphs.pool import MemPool, MemPoolError, PoolStats, round_size

__all__ = [
    "CaptureError",
    "Graph",
    "GraphError",
    "MemPool",
    "MemPoolError",
    "PoolStats",
    "round_size",
]
