"""In-place writes to the operands of eager ``switch``/``while_loop``, seen by version counters.

Traced (``torch.compile``, ``torch.export``), a branch or loop body that writes in place to an
operand or a carried tensor is refused: torch's ``cond`` and ``while_loop`` raise "Encountered
input mutation during higher order op tracing" before anything runs (so does a
:class:`~torchport.graphs.Graph` capture of a ``while_loop``). Eager calls run the function directly; these helpers let them refuse the same
functions, by reading each tensor leaf's version counter (``Tensor._version``, bumped by every
in-place op on the tensor or a view of it) before and after the call (~0.1 us a tensor).

The check runs after the function, so the caller's tensor **has been written** when the error
is raised (torch's traced check leaves it unchanged). Leaving it unchanged would take a copy of
every operand on every call (or a dispatch mode seeing every op of every branch); the error is
for a program bug that torch refuses in every mode, so eager pays only the counter reads.

Not seen: writes through ``Tensor.data`` (a tensor with its own version counter) and writes to
an inference tensor (it keeps no version counter; made under ``torch.inference_mode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["first_modified", "versions"]


def versions(leaves: Sequence[Any]) -> list[int | None]:
    """Each leaf's version counter; ``None`` for a leaf that is not a tensor or keeps no counter
    (an inference tensor)."""
    try:
        return [x._version if isinstance(x, torch.Tensor) else None for x in leaves]
    except RuntimeError:  # "Inference tensors do not track version counter."
        return [
            x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None
            for x in leaves
        ]


def first_modified(leaves: Sequence[Any], before: Sequence[int | None]) -> int | None:
    """Index of the first leaf whose version counter moved since ``before`` (from
    :func:`versions` on the same leaves), or ``None``."""
    for i, v in enumerate(before):
        if v is not None and leaves[i]._version != v:
            return i
    return None
