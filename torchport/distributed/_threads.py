"""Warm threads: run a task on an idle, already started thread instead of starting a new one.

Starting a thread costs little CPU, but on a busy host the new thread waits for its first time
slice (the scheduler places new tasks behind the running ones): 1.5–3 ms measured on the 2-core
development machine at load 2–3, against ≈ 0.2 ms to wake a sleeping thread. Forming a group in
a reconfigure chains several such starts (control-server handler, mesh dial, handshake, reader,
engine threads), so they are taken from a :class:`WarmPool` started with the process.

A pool keeps ``spare`` idle threads blocked on a queue. :meth:`WarmPool.run` hands a task to one of
them (a wake-up), or starts a thread for it when none is idle. Long tasks (a connection's reader)
keep their thread, so the owner calls :meth:`WarmPool.refill` once a burst is over (after a group
formed), off the critical path: a top-up inside the burst would compete with it for the CPU.
Threads are started with :func:`_thread.start_new_thread`, which, unlike
``threading.Thread.start``, does not wait for the new thread to be scheduled. A thread whose task
ends rejoins the pool while it holds fewer than ``spare`` idle threads and exits otherwise. Tasks are expected to handle their own errors; anything that escapes is printed (as
``threading`` does for a thread's uncaught exception) and the thread goes on serving.

:func:`in_background` runs a group's teardown on a daemon thread that interpreter exit waits for
(bounded), for callers that must not block on it.
"""

from __future__ import annotations

import _thread
import atexit
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

_Task = tuple[Callable[..., Any], tuple[Any, ...]] | None


class WarmPool:
    """``spare`` idle threads that run tasks handed to :meth:`run` (see module docstring).

    Args:
        spare: idle threads kept ready (0: every task starts a thread of its own).
    """

    def __init__(self, spare: int) -> None:
        if spare < 0:
            raise ValueError(f"spare must be >= 0, got {spare}")
        self._spare = spare
        self._q: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting on the queue (or started to do so)
        self._closed = False
        for _ in range(spare):
            self._start()

    def _start(self) -> None:
        with self._lock:
            self._idle += 1
        _thread.start_new_thread(self._worker, (None,))

    def _worker(self, first: _Task) -> None:
        task = first
        while True:
            if task is not None:
                fn, args = task
                try:
                    fn(*args)
                except Exception:
                    traceback.print_exc()
                with self._lock:
                    if self._closed or self._idle >= self._spare:
                        return  # enough idle threads already
                    self._idle += 1
            task = self._q.get()
            if task is None:
                return

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread (or a new one if none is idle); never waits."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WarmPool.run after close()")
            warm = self._idle > 0
            if warm:
                self._idle -= 1
        if warm:
            self._q.put((fn, args))
        else:
            _thread.start_new_thread(self._worker, ((fn, args),))

    def refill(self) -> None:
        """Start threads until ``spare`` are idle again (returns at once)."""
        with self._lock:
            n = 0 if self._closed else max(0, self._spare - self._idle)
        for _ in range(n):
            self._start()

    def idle(self) -> int:
        """Threads now waiting for a task."""
        return self._idle

    def close(self) -> None:
        """Let the idle threads exit; running tasks finish on their own."""
        with self._lock:
            self._closed = True
            n, self._idle = self._idle, 0
        for _ in range(n):
            self._q.put(None)


# How long interpreter exit waits, in all, for groups still being retired (see in_background)
EXIT_WAIT_S = 5.0
_retiring: list[threading.Thread] = []
_retiring_lock = threading.Lock()
_exit_hook = False


def in_background(fn: Callable[..., Any], *args: Any, name: str = "tp-retire") -> None:
    """Run ``fn(*args)`` (a group's teardown) on a daemon thread that interpreter exit waits for,
    up to :data:`EXIT_WAIT_S` in all: a process that ended while a gloo group's destructor ran on
    a daemon thread could abort in C++ ("terminate called without an active exception": its
    worker threads destroyed while still joinable), seen once for the README's fault-tolerance
    example under load."""
    global _exit_hook
    t = threading.Thread(target=fn, args=args, daemon=True, name=name)
    with _retiring_lock:
        _retiring[:] = [x for x in _retiring if x.is_alive()]
        _retiring.append(t)
        if not _exit_hook:
            atexit.register(_wait_retiring)
            _exit_hook = True
    t.start()


def _wait_retiring() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with _retiring_lock:
        threads = list(_retiring)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
