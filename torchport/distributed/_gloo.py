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
# What cut_rendezvous publishes for a rank that never did: not a gloo address list (9 bytes, no
# whole number of 8-byte pair ids), so a rendezvous that reads it fails at once.
ABANDONED = "abandoned"


def gloo_group(
    store: dist.Store, rank: int, size: int, timeout_s: float, host: str = "127.0.0.1"
) -> Any:
    """A ``ProcessGroupGloo`` over ``store`` bound to ``host`` (loopback by default)."""
    gloo: Any = dist.ProcessGroupGloo  # _Options is missing from torch's stubs
    opts = gloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def cut_rendezvous(host: str, port: int, prefix: str, size: int, timeout_s: float = 2.0) -> None:
    """End, within milliseconds, every gloo build still in its rendezvous under ``prefix`` (a
    group nobody will use: its builder gave up on it).

    gloo's rendezvous cannot be cancelled: each rank publishes its addresses under
    ``<prefix>/0/<rank>`` (torch's per-device prefix ``0``, gloo's key for the rank) and waits up
    to the group's timeout for every other rank's. Every key still missing gets
    :data:`ABANDONED` (``compare_set`` with an empty expected value writes only absent keys), so
    each waiting build reads it and fails. Runs in the background on a connection of its own
    (the builder's store client is busy with the build's wait); if torch ever lays the keys out
    differently, the builds just run to their timeout as before.
    """

    def cut() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            for r in range(size):
                store.compare_set(f"{prefix}/0/{r}", "", ABANDONED)
        except Exception:  # the store is gone: so is every build that waited on it
            pass

    in_background(cut, name="tp-cut-gloo-rendezvous")


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
