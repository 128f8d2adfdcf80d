"""``torchport.distributed``: the ``torchport`` collective backend for ``torch.distributed``.

Importing this package registers the c10d backend ``"torchport"`` (CPU tensors)::

    import torch.distributed as dist
    import torchport.distributed  # registers "torchport"

    dist.init_process_group("torchport", rank=rank, world_size=world, init_method="tcp://127.0.0.1:29500")

Same-host groups move data through a shared-memory arena with native copy/reduce kernels; other
groups use authenticated TCP. Operations are nonblocking (a progress engine per group),
``abort()`` fails in-flight operations on every rank with a typed error, mismatched collectives
are detected, and :func:`split_group` / ``new_group`` build sub-communicators eagerly on the
parent's connections.

Fault tolerance lives beside it: :mod:`~torchport.distributed.flight_recorder` (per-op ring buffer
and dumps, any backend), :mod:`~torchport.distributed.fr_analyze` (``torchport fr analyze``),
:mod:`~torchport.distributed.fr_torch` (``torchport fr export``: dumps for torch's own analyzer),
:mod:`~torchport.distributed.reconfigure` (2.14's ``_reconfigure`` API),
:mod:`~torchport.distributed.window` (one-sided RMA windows) and :mod:`~torchport.distributed.ft`
(fault-tolerant data-parallel training).
"""

from __future__ import annotations

import datetime
import gc
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# PeerFailure comes from the fault-tolerance control plane (reconfigure, windows, ft).
from torchport.distributed._control import PeerFailure
from torchport.distributed.algorithms import allreduce_reference, fold_reference
from torchport.distributed.backend import TorchportProcessGroup
from torchport.distributed.engine import Communicator
from torchport.distributed.errors import (
    AuthError,
    CollectiveArgumentError,
    CollectiveMismatchError,
    CommAbortedError,
    CommError,
    CommTimeoutError,
    CommunicatorErrorState,
    PeerLeftError,
    RemoteError,
    TorchportDistError,
    WireError,
)
from torchport.distributed.groups import build_communicator, next_split, root_mesh
from torchport.distributed.progress import TorchportWork
from torchport.distributed.reconfigure import (
    ReconfigurableGroup,
    ReconfigureError,
    ReconfigureOptions,
    _get_reconfigure_handle,
    _reconfigure,
    _supports_reconfigure,
    init_process_group,
)
from torchport.distributed.window import (
    Window,
    WindowError,
    _new_window,
    _supports_window,
)

BACKEND_NAME = "torchport"


# The group split_group is creating on this thread: its name, the same on every member, its
# global ranks and the job's store (see split_group)
_SPLIT = threading.local()


def _create(common: Any, _backend_opts: Any) -> TorchportProcessGroup:
    store, name = common.store, str(common.group_id)
    split = getattr(_SPLIT, "pending", None)
    if split is not None and list(common.global_ranks_in_group) == split[1]:
        # torch names a group made with use_local_synchronization after the count of groups
        # its process holds, which differs between members once a split left a rank without a
        # group; the group's store prefix is that name, so the members never met (a hang up to
        # the group timeout). Its own name and a prefix of it on the job's store instead.
        name = split[0]
        store = dist.PrefixStore(f"torchport_split/{name}/", split[2])
        _SPLIT.pending = None
    comm = build_communicator(
        store,
        common.group_rank,
        common.group_size,
        common.timeout,
        list(common.global_ranks_in_group),
        name,
    )
    return TorchportProcessGroup(comm)


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


_register()

# A process forked from one that imported torch and torchport (a fork server's preloaded ranks,
# the FT demo's replicas) inherits some 300 000 objects, and every full (generation-2) garbage
# collection in it walks them all: 0.3-0.6 s on a 2-core VM, holding the GIL, so no engine or
# mesh thread of the rank runs meanwhile. One that fell in abort() delayed its ABORT frames by
# that much (peers failed 0.2-0.6 s after the abort, bound 0.1 s). Freezing moves what the child
# inherited into the permanent generation, which collections skip (20 us for the whole heap);
# the cost is that a reference cycle among those inherited objects, dropped in the child, is
# not reclaimed there (gc.unfreeze() undoes it). The fork server itself is exec'd, not forked.
os.register_at_fork(after_in_child=gc.freeze)


def _pg(group: Any) -> TorchportProcessGroup:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, TorchportProcessGroup):
        raise CollectiveArgumentError(
            f"expected a process group of the 'torchport' backend, got {type(pg).__name__}"
        )
    return pg


def _split_rank(value: Any, given: Any) -> int:
    """A split rank as an int: anything ``operator.index`` takes (NumPy integers, an integer
    tensor of one element, of any shape; a NumPy integer was refused) except a bool or a bool
    tensor (torch takes True as rank 1 unchecked; a flag is no rank)."""
    if isinstance(value, bool | np.bool_) or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool
    ):
        raise CollectiveArgumentError(
            f"split_group: a split rank must be an integer, got {value!r} in {list(given)}"
        )
    try:
        return operator.index(value)
    except TypeError:
        raise CollectiveArgumentError(
            f"split_group: a split rank must be an integer, got {value!r} in {list(given)}"
        ) from None


def split_group(
    parent_pg: Any = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: datetime.timedelta | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> TorchportProcessGroup | None:
    """Eagerly create this rank's sub-communicator among ``split_ranks``.

    torch's signature. As in torch, ``split_ranks`` holds ranks *of the parent group* (group
    ranks, not global ranks; the same thing for the default group). Called by every rank of the
    parent with the same ``split_ranks``; each rank gets the group that contains it (or None),
    built at once on the parent's connections. Ranks inside a group are ordered by their rank in
    the parent, as in torch (by global rank too unless the parent came from
    ``new_group(..., sort_ranks=False)``). The backend has no options: ``pg_options`` must be
    None (torch then copies the parent's); ``backend``, which in torch picks some of the
    parent's per-device backends, must be None or the parent's (``"torchport"`` or
    ``"cpu:torchport"``).
    """
    if pg_options is not None:
        raise CollectiveArgumentError(
            f"split_group: the torchport backend takes no pg_options (it has none to set), "
            f"so pg_options must be None; got {pg_options!r}"
        )
    if backend is not None and str(backend).lower() not in (BACKEND_NAME, f"cpu:{BACKEND_NAME}"):
        raise CollectiveArgumentError(
            f"split_group: backend must be the parent group's, {BACKEND_NAME!r} (or "
            f"'cpu:{BACKEND_NAME}'), or None; got {backend!r}"
        )
    parent = _pg(parent_pg)
    if not split_ranks:
        raise CollectiveArgumentError(
            "split_group: split_ranks must be a non-empty list of rank lists"
        )
    # the parent's global ranks in group-rank order (a nested split of [[2, 3]] named global
    # rank 3 by 1: reading split ranks as global ranks gave rank 3 no group and let [[0, 2]]
    # join members of two different parents)
    try:
        to_global = dist.get_process_group_ranks(parent)
    except KeyError:  # (a ReconfigurableGroup's communicator, a destroyed group: a bare KeyError)
        raise CollectiveArgumentError(
            f"split_group: the parent group must be one c10d knows (made by init_process_group, "
            f"new_group or split_group and not destroyed), got {parent!r}"
        ) from None
    me = parent.rank()
    seen: set[int] = set()
    groups = [[_split_rank(r, given) for r in given] for given in split_ranks]
    for ranks in groups:
        if not ranks or len(set(ranks)) != len(ranks):
            raise CollectiveArgumentError(
                f"split_group: each group must be non-empty without duplicates, got {list(ranks)}"
            )
        bad = [r for r in ranks if not 0 <= r < len(to_global)]
        if bad:
            raise CollectiveArgumentError(
                f"split_group: split ranks are ranks of the parent group, in [0, "
                f"{len(to_global)}); got {bad} in {list(ranks)}"
            )
        if seen & set(ranks):
            raise CollectiveArgumentError(
                f"split_group: groups overlap on ranks {sorted(seen & set(ranks))}"
            )
        seen |= set(ranks)
    # the members' global ranks in the order of their parent ranks (torch's order: sorted
    # global ranks made another rank the split's rank 0 under a sort_ranks=False parent)
    mine = next(([to_global[r] for r in sorted(g)] for g in groups if me in g), None)
    # this split's name: the parent's, its count of splits (groups.next_split, advanced by every
    # rank of the parent on every call) and the ranks, which every member computes alike
    pid = (parent.comm.name, parent.comm.group_id)
    seq = next_split(pid)
    del parent
    if mine is None:
        return None
    name = f"{pid[0]}#{pid[1]}/split{seq}/{'_'.join(map(str, mine))}"
    _SPLIT.pending = (name, mine, dist.distributed_c10d._get_default_store())
    try:
        pg = dist.new_group(
            mine,
            timeout=timeout,
            backend=BACKEND_NAME,
            use_local_synchronization=True,
            group_desc=group_desc,
            sort_ranks=False,  # (mine is in the order of the parent's ranks)
        )
    finally:
        _SPLIT.pending = None
    assert isinstance(pg, TorchportProcessGroup)
    return pg


def get_error(group: Any = None) -> BaseException | None:
    """The first error of ``group`` (default group if None), or None while healthy."""
    return _pg(group).get_error()


def abort(group: Any = None) -> None:
    """Abort ``group``: every in-flight op on every rank fails with a typed error."""
    _pg(group).abort()


__all__ = [
    "BACKEND_NAME",
    "AuthError",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CommAbortedError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "CommunicatorErrorState",
    "PeerFailure",
    "PeerLeftError",
    "ReconfigurableGroup",
    "ReconfigureError",
    "ReconfigureOptions",
    "RemoteError",
    "TorchportDistError",
    "TorchportProcessGroup",
    "TorchportWork",
    "Window",
    "WindowError",
    "WireError",
    "_get_reconfigure_handle",
    "_new_window",
    "_reconfigure",
    "_supports_reconfigure",
    "_supports_window",
    "abort",
    "allreduce_reference",
    "fold_reference",
    "get_error",
    "init_process_group",
    "root_mesh",
    "split_group",
]
