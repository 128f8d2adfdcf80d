"""CPU kernels of ``torch.ops._c10d_functional`` collectives put in place of torch's own.

Two users: torchport's backend (``all_gather_into_tensor_out`` and ``batch_p2p_ops`` on a
torchport group, which c10d cannot run: see :mod:`torchport.distributed.backend`) and the Flight
Recorder (every functional collective, while installed). Both issue point-to-point ops as torch's
kernel does (:func:`p2p_issue`, :func:`p2p_batch_refused`). Each takes torch's kernel as it is before its own registration
(so a kernel registered earlier, the backend's, is what the recorder's calls) and resolves the
group argument, a name or (torch 2.13) the group itself, the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

NAMESPACE = "_c10d_functional"
CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def funcol_group(given: Any) -> Any:
    """The process group a functional collective's ``group_name`` argument names (a name or a
    group), or None for a name no group has (torch's own kernel then names what is wrong)."""
    if not isinstance(given, str):
        return given
    c10d = dist.distributed_c10d
    try:
        return c10d._resolve_process_group(c10d.GroupName(given))
    except (RuntimeError, ValueError, KeyError):
        return None


def override_cpu_kernel(
    lib: torch.library.Library, name: str, make: Callable[[Any], Callable[..., Any]]
) -> bool:
    """Register ``make(kernel)`` as the CPU kernel of ``_c10d_functional::name`` in ``lib``,
    ``kernel`` being the one it replaces (call it as ``kernel.call_boxed(CPU_KEYSET, ...)``).
    False, registering nothing, for an op this torch lacks. c10d warns that a kernel replaces
    another: ignored here (under ``-W error`` it was an error, which failed the import or
    ``install()`` part-way)."""
    full = f"{NAMESPACE}::{name}"
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(full, "CPU"):
        return False
    kernel = torch._C._dispatch_get_computed_kernel_for_dispatch_key(full, torch._C.DispatchKey.CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lib.impl(name, make(kernel), "CPU")
    return True


def bind(fn: Callable[..., Any], *args: Any) -> Callable[[Any], Callable[..., Any]]:
    """A ``make`` for :func:`override_cpu_kernel`: ``fn(kernel, *args, <op's arguments>)``."""
    return lambda kernel: functools.partial(fn, kernel, *args)


P2P_OPS = ("isend", "irecv")


def p2p_batch_refused(
    op_list: list[str], peer_list: list[int], tag_list: list[int], tensors: list[Any]
) -> bool:
    """Whether torch's ``batch_p2p_ops`` kernel refuses these lists (lengths that differ, no
    op, an op other than isend / irecv): a kernel of ours then calls torch's, which raises."""
    n = len(op_list)
    return (
        not n
        or {len(peer_list), len(tag_list), len(tensors)} != {n}
        or any(op not in P2P_OPS for op in op_list)
    )


def p2p_issue(
    group: Any, op: str, peer: int, tag: int, t: torch.Tensor
) -> tuple[Any, torch.Tensor]:
    """One functional point-to-point op (``isend`` / ``irecv``) issued as torch's kernel issues
    it, through the group's ``send`` / ``recv`` (``peer`` as given): its Work and the op's
    result, an empty tensor for a send, the tensor itself for a receive. The caller registers
    the Work on ``t`` and on the result for ``wait_tensor``."""
    if op == "isend":
        return group.send([t], peer, tag), torch.empty(0, dtype=t.dtype, device=t.device)
    return group.recv([t], peer, tag), t
