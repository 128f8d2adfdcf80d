"""Building gloo process groups on loopback from a store prefix, and retiring broken ones.

A group whose peer crashed or hung cannot be aborted in gloo, and destroying it blocks until its
in-flight op times out. Fault-tolerant code therefore replaces the group (a fresh store prefix per
membership) and hands the old one to :func:`retire`, which drops it on a background thread.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchport.distributed._threads import in_background

_graveyard: list[Any] = []
_grave_lock = threading.Lock()


def gloo_group(
    store: dist.Store, rank: int, size: int, timeout_s: float, host: str = "127.0.0.1"
) -> Any:
    """A ``ProcessGroupGloo`` over ``store`` bound to ``host`` (loopback by default)."""
    gloo: Any = dist.ProcessGroupGloo  # _Options is missing from torch's stubs
    opts = gloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def retire(pg: Any) -> None:
    """Drop ``pg`` without blocking the caller (its destructor may wait for a stuck op)."""
    if pg is None:
        return
    with _grave_lock:
        _graveyard.append(pg)
        doomed = list(_graveyard)
        _graveyard.clear()

    def drop(items: list[Any]) -> None:
        items.clear()

    in_background(drop, doomed, name="tp-retire-gloo")
