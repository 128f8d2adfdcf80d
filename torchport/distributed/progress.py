"""Work handles and the progress engine of a communicator.

:class:`TorchportWork` is what every operation returns (``wait``, ``is_completed``,
``exception``, ``get_future``); :class:`Engine` runs a communicator's operations in issue order
on its own thread, or inline in the thread that waits on one (see
:mod:`~torchport.distributed.engine` for the communicator and its error model).
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import math
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from torchport.distributed.errors import CollectiveArgumentError, CommTimeoutError, clip_repr
from torchport.distributed.shm_kernels import BACKGROUND_YIELD_NS, shm_lib

_DONE_LOCK = threading.Lock()  # orders a Work's completion against a lazily created future


def wait_limit_s(timeout: Any, name: str) -> float | None:
    """The seconds a ``wait(timeout)`` of the Work of ``name`` may block, by the rule every
    torchport Work follows: None for no limit (``None``, zero, or ``threading.TIMEOUT_MAX`` or
    more: ``timedelta.max``, ``inf``), a negative number for no wait at all (done, or
    :class:`CommTimeoutError` at once), else the seconds. ``timeout`` is a ``timedelta`` or a
    real number of seconds; anything else -- NaN (no time is past it: it either waited without
    limit or timed out at once), a bool, a string -- is refused with
    :class:`CollectiveArgumentError` naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        t = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        value = cast(float, timeout)  # (an int, a float, a numpy scalar)
        if not isinstance(timeout, numbers.Integral) and math.isnan(value):
            raise CollectiveArgumentError(
                f"{name}: wait() takes no NaN timeout (None, zero or threading.TIMEOUT_MAX "
                f"s or more: no limit; negative: no wait), got {timeout!r}"
            )
        # (an int too large for a float is past TIMEOUT_MAX: no limit, or no wait)
        big = abs(value) >= threading.TIMEOUT_MAX
        t = (math.inf if value > 0 else -math.inf) if big else float(value)
    else:
        raise CollectiveArgumentError(
            f"{name}: wait() takes its timeout as a datetime.timedelta, a number of seconds or "
            f"None, got {clip_repr(timeout)}"
        )
    return None if t == 0 or t >= threading.TIMEOUT_MAX else t


class TorchportWork(dist.Work):
    """Handle of one issued operation: ``wait``, ``is_completed``, ``exception``, ``get_future``.

    Completion is a flag plus a lock held from creation until the operation finishes (waiters
    acquire and release it); the future is created on first ``get_future`` only. Both keep a
    synchronous collective's bookkeeping to a few hundred nanoseconds.
    """

    # Defaults read from the class until an instance sets its own (issuing a 4 KB collective
    # costs its Work's construction on every call: nine attribute stores fewer)
    _done = False
    _ended = False  # _finish began (the error is final); _done follows the future
    _finisher = 0  # the thread running _finish (and the future's callbacks)
    _error: BaseException | None = None
    _future: torch.futures.Future | None = None
    _engine: Engine | None = None
    _src = -1
    # an operation finished by others (a receive): a wait() without a timeout of its own that
    # sees it unfinished for this many seconds (the group timeout, counted from the wait, as
    # gloo's) calls ``_late()``, which fails the group and so the operation
    _wait_limit_s: float | None = None
    _late: Callable[[], None] | None = None

    def __init__(self, name: str, result: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.name = name
        self._result = result if result is not None else []
        self._gate = gate = threading.Lock()
        gate.acquire()  # released by _finish

    def _finish(self, error: BaseException | None = None) -> None:
        with _DONE_LOCK:
            if self._ended:
                return
            self._error = error
            self._ended = True
            self._finisher = threading.get_ident()
            fut = self._future
        # As gloo does, settle the future (run its callbacks) before the Work reads as done:
        # the Flight Recorder completes an async op's entry in such a callback, and a dump
        # taken right after wait() returned showed that op as still running.
        if fut is not None:
            self._settle(fut)
        self._done = True
        self._gate.release()

    def _settle(self, fut: torch.futures.Future) -> None:
        if self._error is None:
            fut.set_result(self._result)
        else:
            fut.set_exception(self._error)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until done; raise the operation's error, or :class:`CommTimeoutError`.

        ``timeout`` (a ``timedelta`` or seconds, :func:`wait_limit_s`): None or zero waits
        without limit (as gloo; a receive nobody completes fails its group after the group's
        timeout), and so does one of ``threading.TIMEOUT_MAX`` or more (centuries,
        ``timedelta.max``, ``inf``). A negative one does not wait: unless the operation is done
        it raises :class:`CommTimeoutError` at once, as gloo's "Operation timed out!". NaN, or
        what is no timeout, raises :class:`CollectiveArgumentError`. A ``wait`` that times out
        leaves the operation running and the group as it is (a later ``wait`` may still
        succeed).
        """
        # (seconds were ignored, NaN and strings too: each waited without limit)
        t = wait_limit_s(timeout, self.name)
        # a callback of this Work's future waiting on it: the result is final, and the gate
        # opens only after the callbacks returned
        if not self._done and not (self._ended and self._finisher == threading.get_ident()):
            if t is not None and t < 0:  # (it waited for completion, as without a timeout)
                if not self._gate.acquire(blocking=False):
                    raise CommTimeoutError(
                        f"{self.name}: wait() with a negative timeout ({t:g} s) timed out at "
                        f"once: the operation had not finished"
                    )
                self._gate.release()
            else:  # (one past TIMEOUT_MAX raised OverflowError from the lock)
                self._block(t)
        if self._error is not None:
            raise self._error
        return True

    def _block(self, t: float | None) -> None:
        """Wait until done, at most ``t`` seconds when positive (else without limit)."""
        eng = self._engine
        if eng is not None and (not (t and t > 0) or eng.owned_here()):
            # run it here rather than wait for the engine thread; not with a timeout: the
            # inline run ends only with the operation or at its own deadline (the group's
            # timeout; a wait(0.3 s) on a peer 1.5 s late returned after 1.5 s) -- unless
            # this thread is the one running the engine's operations (a wait inside an
            # earlier operation's future callback): nobody else would run it
            eng.help(self)
        if not self._done:
            limit, own = (t if t and t > 0 else -1.0), False
            cap = self._wait_limit_s
            if cap is not None and limit < 0 and cap < threading.TIMEOUT_MAX:  # (a receive)
                limit, own = cap, True
            if not self._gate.acquire(timeout=limit):
                if not own:
                    raise CommTimeoutError(f"{self.name}: wait() timed out after {t:.3f} s")
                assert self._late is not None
                if self._ended:  # done, its future's callbacks still running
                    self._gate.acquire()
                else:
                    self._late()  # fails the group, which finishes this operation
                    if not self._gate.acquire(timeout=5.0):
                        raise CommTimeoutError(f"{self.name}: timed out")
            self._gate.release()  # let other waiters through

    def is_completed(self) -> bool:
        # Polled rather than waited on: start the operation now instead of at the engine's next
        # idle check -- the same hint get_future gives (inline on the thread running the
        # engine's operations: polled from a future callback there, nobody else would run it).
        if not self._done and self._engine is not None:
            self._engine.start(self)
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future:
        fut, done = self._make_future()
        # A future's waiter (DDP's reducer, callbacks) never runs the queue inline: start now.
        # On the thread running the engine's operations (a future callback of an earlier
        # operation issuing this one, as PowerSGD's DDP hook does, then waiting on its future)
        # run it here: the engine's thread is this one, and the wait would never end.
        if not done and self._engine is not None:
            self._engine.start(self)
        return fut

    def _watch_future(self) -> torch.futures.Future:
        """The future, for an observer that only watches it (the Flight Recorder): the engine
        is woken as by :meth:`get_future`, but the operation never runs inline here, so an
        async operation issued in a callback stays async."""
        fut, done = self._make_future()
        if not done and self._engine is not None:
            self._engine.urge()
        return fut

    def _make_future(self) -> tuple[torch.futures.Future, bool]:
        with _DONE_LOCK:
            fut, fresh = self._future, self._future is None
            if fresh:
                fut = self._future = torch.futures.Future()
            done = self._ended
        assert fut is not None
        if fresh and done:  # finished before anyone asked: settle here
            self._settle(fut)
        return fut, done

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """The sender's group rank of a completed receive (-1 for other operations)."""
        return self._src

    def _source_rank(self) -> int:
        return self._src

    def synchronize(self) -> None:
        self.wait()


GRACE_S = 0.0003  # an op nobody waits on is started by the engine thread after this long
POLL_S = 0.002  # cap on one idle futex sleep of the engine thread (no GIL held)
# ... while an op was posted within QUIET_S; after that the idle thread sleeps deep (at most
# DEEP_S, a safety net) and the next post wakes it. Polling every POLL_S while idle cost a DDP
# step of two buckets on two cores ~6-9 % (two engine threads per communicator: 1000 wake-ups
# a second per rank during the backward pass); ops that come back to back, each run inline by
# its waiter, still cost no ring.
QUIET_S = 0.004
DEEP_S = 1.0


class Engine:
    """Runs a communicator's operations in issue order, on its own thread or inline in ``wait``.

    Issuing only appends to the queue (never blocks). The engine thread drains the queue for
    operations nobody waits on; a caller that waits on a queued operation runs the queue up to
    it inline (in order) when no one else is running it, which saves two thread hand-offs per
    synchronous collective.
    """

    def __init__(
        self,
        name: str,
        run: Callable[[TorchportWork, Callable[[], None]], None],
        spawn: Callable[..., None] | None = None,
    ) -> None:
        self._run = run  # runs one item: Communicator.run (error mapping, completion)
        self._items: collections.deque[tuple[TorchportWork, Callable[[], None]]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        # Held while operations run (the engine thread's loop, or a waiter running the queue
        # inline). Reentrant: an operation's future callbacks run on that thread, and one that
        # issues and waits on another operation runs it there, nested (_acquire, owned_here).
        self._runner = threading.RLock()
        self._owner = 0  # the thread holding _runner (0: none); _depth: its nesting
        self._depth = 0
        self._current: TorchportWork | None = None  # the operation being run (under _runner)
        # Doorbell cells read by native code while the thread sleeps without the GIL:
        # [posted, taken, stop, sleeping, futex word, urgent, sleeps ended, -]. Posting wakes
        # the thread only from a deep sleep (tp_doorbell_post); a ring (stop, or a future
        # someone blocks on) wakes it at once.
        self._cells = (ctypes.c_int64 * 8)()
        self._lib = shm_lib()
        self._done = threading.Event()
        if spawn is None:
            threading.Thread(target=self._main, daemon=True, name=name).start()
        else:  # e.g. a warm thread of the elastic mesh (no thread start while a group forms)
            spawn(self._main)

    def _main(self) -> None:
        try:
            self._loop()
        finally:
            self._done.set()

    def submit(self, work: TorchportWork, fn: Callable[[], None]) -> None:
        work._engine = self
        with self._lock:
            self._items.append((work, fn))
            self._lib.doorbell_post(self._cells)

    def urge(self) -> None:
        """Start queued work now: its completion is awaited through a future, not ``wait``."""
        self._lib.doorbell_ring(self._cells, 0)

    def _pop(self) -> tuple[TorchportWork, Callable[[], None]] | None:
        with self._lock:
            if not self._items:
                return None
            self._cells[1] += 1
            return self._items.popleft()

    def _loop(self) -> None:
        grace, poll = int(GRACE_S * 1e9), int(POLL_S * 1e9)
        quiet, deep = int(QUIET_S * 1e9), int(DEEP_S * 1e9)
        self._lib.set_yield(BACKGROUND_YIELD_NS)  # this thread runs ops in the background
        while self._lib.doorbell_wait(self._cells, grace, poll, quiet, deep):
            self._acquire(True)
            try:
                item = self._pop()
                if item is not None:
                    self._current = item[0]
                    self._run(*item)
            finally:
                self._current = None
                self._release()

    def _acquire(self, blocking: bool) -> bool:
        if not self._runner.acquire(blocking):
            return False
        self._depth += 1
        self._owner = threading.get_ident()
        return True

    def _release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = 0
        self._runner.release()

    def owned_here(self) -> bool:
        """Whether this thread is the one running the engine's operations and is inside one's
        completion (its future callbacks), not in the middle of one (a signal handler or a
        finalizer there must not start another operation partway through it)."""
        if self._owner != threading.get_ident():
            return False
        cur = self._current
        return cur is None or cur._ended

    def start(self, work: TorchportWork) -> None:
        """Get ``work`` going without waiting for it: inline on the thread running the engine's
        operations, inside one's completion (nobody else would run it, see :meth:`owned_here`),
        else by waking the engine (:meth:`urge`)."""
        if self.owned_here():
            self.help(work)
        else:
            self.urge()

    def help(self, work: TorchportWork) -> None:
        """Run queued operations inline up to ``work`` unless another thread is running them
        (on the thread running them, nested in an operation's completion, it runs them too;
        not partway through one, which a signal handler or a finalizer there may be)."""
        if self._owner == threading.get_ident() and not self.owned_here():
            return
        if not self._acquire(False):
            return
        outer = self._current  # (None unless nested: an operation completing on this thread)
        try:
            # (_ended, not _done: a work whose callbacks run, here or on another thread, needs
            # nothing run; looping to _done would run every later queued operation inline)
            while not work._ended:
                item = self._pop()
                if item is None:
                    return
                self._current = item[0]
                self._run(*item)
        finally:
            self._current = outer
            self._release()

    def stop(self) -> None:
        self._lib.doorbell_ring(self._cells, 1)

    def busy(self) -> bool:
        """Whether an operation is queued or running (a stopped engine's thread may still be
        inside one)."""
        return bool(self._items) or self._owner != 0

    def in_flight(self) -> bool:
        """Whether an operation is queued, or running and not yet finishing (unlike
        :meth:`busy`, false for one whose Work is completing while the runner is still held)."""
        cur = self._current
        return bool(self._items) or (cur is not None and not cur._ended)

    def drain(self) -> list[TorchportWork]:
        """Take every queued operation off the queue (the engine stopped: none will run)."""
        with self._lock:
            items, self._items = list(self._items), collections.deque()
        return [work for work, _fn in items]

    def join(self, timeout: float) -> bool:
        """Wait until the thread ended and no caller runs an operation inline; True if so
        (then nothing of this engine touches the transport any more)."""
        end = time.monotonic() + timeout
        if not self._done.wait(timeout):
            return False
        if not self._runner.acquire(timeout=max(0.0, end - time.monotonic())):
            return False
        self._runner.release()
        return True
