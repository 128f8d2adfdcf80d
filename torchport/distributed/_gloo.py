"""Building gloo process groups on loopback from a store prefix, and retiring broken ones.

A group whose peer crashed or hung cannot be aborted in gloo, and destroying it blocks until its
in-flight op times out. Fault-tolerant code therefore replaces the group (a fresh store prefix per
membership) and hands the old one to :func:`retire`, which drops it on a background thread.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

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


# How long interpreter exit waits, in all, for groups still being retired (see in_background)
EXIT_WAIT_S = 5.0
_retiring: list[threading.Thread] = []
_exit_hook = False


def in_background(fn: Callable[..., Any], *args: Any, name: str = "tp-retire") -> None:
    """Run ``fn(*args)`` (a group's teardown) on a daemon thread that interpreter exit waits for,
    up to :data:`EXIT_WAIT_S` in all: a process that ended while a gloo group's destructor ran on
    a daemon thread could abort in C++ ("terminate called without an active exception": its
    worker threads destroyed while still joinable), seen once for the README's fault-tolerance
    example under load."""
    global _exit_hook
    t = threading.Thread(target=fn, args=args, daemon=True, name=name)
    with _grave_lock:
        _retiring[:] = [x for x in _retiring if x.is_alive()]
        _retiring.append(t)
        if not _exit_hook:
            atexit.register(_wait_retiring)
            _exit_hook = True
    t.start()


def _wait_retiring() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with _grave_lock:
        threads = list(_retiring)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
