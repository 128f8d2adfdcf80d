"""Flight Recorder for any process group (gloo, torchport, or a raw ``ProcessGroup`` object).

Every collective is recorded in a per-process ring buffer (``TORCHPORT_FR_BUFFER_SIZE`` entries,
default 2000) with its per-group sequence id, op name, group, tensor sizes and dtypes, and its state
``scheduled`` → ``started`` → ``completed`` (or ``errored``) with wall-clock timestamps and duration,
plus the Python stack when ``TORCHPORT_FR_STACK=1``. A point-to-point op whose Work has no future
(gloo's, complete only inside ``wait()``) ends when its ``wait()`` returns or raises; dropped
without ``wait()``, its state is ``unknown`` (duration null). Recording costs about a
microsecond: an entry is one Python list written into a preallocated ring slot, holding the
tensors' ``torch.Size`` and dtype objects as they are (names and lists are made only when
dumping), ids come from lock-free ``itertools.count`` counters (atomic under the GIL), and
timestamps are ``time.time_ns()``; an async op's Work is attached under the recorder's lock.

Dumps are JSON, one file per rank (``rank_<r>.json`` in ``TORCHPORT_FR_DUMP_DIR``), written

* on request: :meth:`FlightRecorder.dump`;
* on a signal: ``SIGUSR1`` (a helper thread performs the dump, so it works even while the main
  thread is blocked inside a C++ collective);
* on timeout: a watchdog dumps when an op stays incomplete longer than ``TORCHPORT_FR_TIMEOUT``;
* on error or abort: when a recorded op raises, or :meth:`FlightRecorder.abort_hook` is called.

Use :func:`install` to record every ``torch.distributed`` collective and point-to-point op of this
process (any backend; ops are recorded in the process group's own methods, so also those torch
issues itself -- object collectives, FSDP2's, the functional collectives'
(``torch.distributed._functional_collectives``, ``torch.ops._c10d_functional``) -- and those
called on a ``ProcessGroup`` directly, one sequence id per op the group received), or call
:meth:`FlightRecorder.record` / :meth:`FlightRecorder.attach` around collectives issued on a raw
``ProcessGroup``. ``torchport fr analyze DIR`` (see :mod:`torchport.distributed.fr_analyze`) turns the
dumps into a plain-words verdict; ``torchport fr export SRC --to DIR`` or ``dump(format="torch")``
writes them in torch's format, for torch's own analyzer (:mod:`torchport.distributed.fr_torch`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import inspect
import itertools
import json
import logging
import math
import operator
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchport import config
from torchport.distributed.funcol_kernels import (
    CPU_KEYSET,
    NAMESPACE,
    bind,
    funcol_group,
    override_cpu_kernel,
    p2p_batch_refused,
    p2p_issue,
)

SCHEDULED, STARTED, COMPLETED, ERRORED = "scheduled", "started", "completed", "errored"
# a point-to-point op whose Work was dropped without wait(): gloo's send / recv Works complete
# only inside wait(), so whether the op finished is not known (not a hang: nobody waits)
UNKNOWN = "unknown"
# _T_END of an op whose end was never seen (UNKNOWN): no duration
_END_UNKNOWN = -1
FORMAT_VERSION = 1
_log = logging.getLogger(__name__)
_OLD_GROUPS = 256  # destroyed groups whose members a dump keeps (see FlightRecorder.retire)

# entry slots (a list per op keeps recording cheap); _PEER: a point-to-point op's peer (global
# rank, -1 for a receive from any source, None for a collective); _INC: the incarnation of the
# group's name the op ran on (see FlightRecorder.adopt); _TAG: a point-to-point op's tag (torch
# pairs a send with a recv per peer and tag)
(
    _SEQ,
    _OP,
    _GROUP,
    _SIZES,
    _DTYPES,
    _STATE,
    _T_SCHED,
    _T_START,
    _T_END,
    _STACK,
    _ERR,
    _ID,
    _PEER,
    _INC,
    _TAG,
) = range(15)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(d: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(d)
    if name is None:
        name = _DTYPE_NAMES[d] = str(d).removeprefix("torch.")
    return name


def _describe(tensors: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Sizes (``torch.Size``) and dtypes (``torch.dtype``) of tensors, lists of tensors and
    lists of those."""
    sizes: list[Any] = []
    dtypes: list[Any] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sizes.append(t.shape)  # torch.Size / dtype: converted only when dumping
            dtypes.append(t.dtype)
        elif isinstance(t, list | tuple):
            for u in t:
                if isinstance(u, torch.Tensor):
                    sizes.append(u.shape)
                    dtypes.append(u.dtype)
                elif isinstance(u, list | tuple):  # (a group's allgather: [[outputs]])
                    for v in u:
                        if isinstance(v, torch.Tensor):
                            sizes.append(v.shape)
                            dtypes.append(v.dtype)
    return sizes, dtypes


class FlightRecorder:
    """A ring buffer of op records with JSON dumps.

    Args:
        buffer_size: entries kept (oldest overwritten); default ``config.fr_buffer_size``.
        rank, world_size: identity written into dumps; default from ``torch.distributed``.
        dump_dir: folder for dumps; default ``config.fr_dump_dir`` or ``./torchport-fr``.
        record_stack: keep the Python stack of each op; default ``config.fr_stack``.
    """

    def __init__(
        self,
        buffer_size: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
        record_stack: bool | None = None,
    ) -> None:
        n = config.get("fr_buffer_size") if buffer_size is None else buffer_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:  # (True was a 1-entry ring)
            raise ValueError(f"buffer_size must be an int >= 0, got {n!r}")
        if n > config.FR_BUFFER_SIZE_MAX:  # (its slots are made here: 1e13 was a MemoryError)
            raise ValueError(
                f"buffer_size must be at most {config.FR_BUFFER_SIZE_MAX} entries "
                f"(TORCHPORT_FR_BUFFER_SIZE's bound), got {n!r}"
            )
        self.capacity = n
        self._buf: list[list[Any] | None] = [None] * n
        self._ids = itertools.count()
        self._count = 0  # entries recorded so far (== next id)
        # counter key (group, or group + NUL + p2p) -> (itertools.count, the name's incarnation)
        self._seq: dict[str, tuple[Any, int]] = {}
        # group name -> how many group objects of that name came before the current one, and
        # a callable returning the current one (see adopt)
        self._incs: dict[str, int] = {}
        self._owners: dict[str, Callable[[], Any]] = {}
        # (group name, incarnation) -> members of a destroyed group, the newest _OLD_GROUPS
        # (its ops stay in the buffer: the torch export needs their members)
        self._old_groups: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()
        # attached async ops not yet completed: id(entry) -> (entry, future) (see attach)
        self._pending: dict[int, tuple[list[Any], Any]] = {}
        # attached ops whose Work has no future (gloo's send / recv): id(work) -> (entry, a
        # weak reference to the work), settled by the work's wait() (see _waited) or as unknown
        # when the work is dropped: polled and held by entries(), a Work and its tensor outlived
        # the op until the next dump (for ever without the watchdog), the duration was the
        # polling time, and telling a failure needs Work.exception() / is_success(), which
        # torch 2.13 deprecates with a warning printed by every rank
        self._no_future: dict[int, tuple[list[Any], Any]] = {}
        # ids of the entries in _no_future whose work's wait() is running -> when it began:
        # only those can hang, counted from then (a gloo isend nobody waits on stays started
        # and is not late; one waited for only after a long computation is not late either)
        self._waiting: dict[int, int] = {}
        self._rank, self._world = rank, world_size
        d = dump_dir if dump_dir is not None else (config.get("fr_dump_dir") or "torchport-fr")
        self.dump_dir = Path(d)
        self.record_stack = config.get("fr_stack") if record_stack is None else record_stack
        self.groups: dict[str, list[int]] = {}
        self.dumps = 0
        # the running watchdog thread and the event that stops it (one per thread: stop()
        # followed by start_watchdog() starts a new one, see stop)
        self._watchdog: threading.Thread | None = None
        self._dumped: set[int] = set()  # ids of the overdue ops a dump was taken for
        self._stop = threading.Event()

    # -- identity --------------------------------------------------------------------------
    def set_identity(self, rank: int, world_size: int) -> None:
        """Rank and world size written into dumps (e.g. a replica's id in fault-tolerant training)."""
        self._rank, self._world = rank, world_size

    def identity(self) -> tuple[int, int]:
        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    # -- recording -------------------------------------------------------------------------
    def record(
        self, op: str, group: str, tensors: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """Record a scheduled op; returns the entry to pass to :meth:`started` / :meth:`completed`."""
        sizes, dtypes = _describe(tensors)
        e = self._new(op, group, sizes, dtypes, SCHEDULED)
        if ranks is not None and group not in self.groups:
            # under the lock: snapshot() copies the dict under it (json.dumps of the live dict
            # raced this insert: "dictionary changed size during iteration"); only a group's
            # first op takes it
            with self._lock:
                self.groups.setdefault(group, list(ranks))
        return e

    def _new(
        self,
        op: str,
        group: str,
        sizes: Any,
        dtypes: Any,
        state: str,
        seq_key: str | None = None,
        peer: int | None = None,
        seq: int | None = None,
        tag: int | None = None,
    ) -> list[Any]:
        """The recording hot path: one list into the ring, no lock (counters are atomic).
        ``seq_key``: number the entry on the group's counter of that name (point-to-point ops'
        own, :data:`P2P_OPS`) instead of its collectives' counter; ``seq``: use this number
        instead (the ops of one ``batch_isend_irecv`` share one, see :meth:`next_seq`)."""
        key = group if seq_key is None else f"{group}\0{seq_key}"
        hit = self._seq.get(key)
        if hit is None:
            hit = self._counter(group, key)
        counter, inc = hit
        now = time.time_ns()
        idx = next(self._ids)
        # without this frame and its caller (record() or an install() wrapper): the stack ends
        # at the op's call site for those ([:-3] dropped the call site itself); through op()
        # it ends with contextlib's __enter__ and op, and an op recorded in a process group's
        # method with torch's own frame that called it (the program's call site above it)
        stack = traceback.format_stack(limit=12)[:-2] if self.record_stack else None
        # an op recorded as scheduled has no start time until started() (its dump showed the
        # scheduling time as time_started_ns, an op never handed to the backend as started)
        start = now if state is STARTED else 0
        n = next(counter) if seq is None else seq
        e = [n, op, group, sizes, dtypes, state, now, start, 0, stack, None, idx, peer, inc, tag]
        self._count = idx + 1
        if self.capacity:
            self._buf[idx % self.capacity] = e
        return e

    def next_seq(self, group: str, seq_key: str | None = None) -> int:
        """Take the next sequence id of ``group``'s counter ``seq_key`` (as :meth:`_new` would)."""
        key = group if seq_key is None else f"{group}\0{seq_key}"
        hit = self._seq.get(key)
        if hit is None:
            hit = self._counter(group, key)
        return int(next(hit[0]))

    def _counter(self, group: str, key: str) -> tuple[Any, int]:
        """The sequence counter ``key`` of ``group``, made on its first use under the lock:
        retire() iterates ``_seq`` under it (an insert without it raced that iteration:
        "dictionary changed size during iteration"). A retired group's counters are dropped
        there, so ``_seq`` holds the live groups' only."""
        with self._lock:
            return self._seq.setdefault(key, (itertools.count(), self._incs.get(group, 0)))

    def adopt(self, name: str, group: Any) -> None:
        """Make ``group`` the current process group of the name ``name``.

        A group destroyed and re-created under the same name (the default group after a
        re-init, a ``new_group`` of the same ranks) is a new incarnation: its sequence ids
        restart at 0, as they do in a process that joined only now (a restarted rank), and its
        entries carry the incarnation so that ``fr analyze`` lines up only each rank's newest
        one (the ids kept counting on the surviving ranks: a false "never entered")."""
        with self._lock:
            ref = self._owners.get(name)
            if ref is not None and ref() is group:
                return
            try:
                self._owners[name] = weakref.ref(group)
            except TypeError:  # a group without weak references: keep it (no id reuse)
                self._owners[name] = functools.partial(_identity, group)
            if ref is None or ref is _retired:
                # the first group of that name here: incarnation 0 (or as recorded); or the
                # one after a destroyed group, whose incarnation retire() has counted already
                return
            self._next_incarnation(name)

    def retire(self, name: str | None = None) -> None:
        """The group of the name ``name`` (every group: None) was destroyed: the next group of
        that name is a new incarnation, counted now so that a dump taken before this rank
        records an op on it says so (the rank still showed the old incarnation, and fr analyze
        compared a peer's new ops with this rank's old ones: the wrong rank blamed)."""
        with self._lock:
            for n in list(self._owners) if name is None else [name]:
                ref = self._owners.get(n)
                if ref is None or ref is _retired:
                    continue
                self._owners[n] = _retired
                inc = self._incs.get(n, 0)
                self._next_incarnation(n)
                # its members are the new group's, known when it is seen (kept, a rank left
                # out of a re-created group was expected in it: a false "never entered");
                # the old ones are kept apart for the old incarnation's ops
                members = self.groups.pop(n, None)
                if members is not None:
                    self._old_groups[(n, inc)] = list(members)
                    while len(self._old_groups) > _OLD_GROUPS:
                        del self._old_groups[next(iter(self._old_groups))]

    def _next_incarnation(self, name: str) -> None:
        """(under ``_lock``) Start the next incarnation of ``name``: its sequence ids
        (collective and point-to-point) restart at 0."""
        self._incs[name] = self._incs.get(name, 0) + 1
        mine = f"{name}\0"
        for key in [k for k in self._seq if k == name or k.startswith(mine)]:
            del self._seq[key]

    def incarnations(self) -> dict[str, int]:
        """The current incarnation of every group name this recorder has seen a group of."""
        with self._lock:
            return {n: self._incs.get(n, 0) for n in sorted(set(self._owners) | set(self._incs))}

    @staticmethod
    def started(e: list[Any]) -> None:
        """Mark an entry as started (handed to the backend)."""
        e[_T_START] = time.time_ns()
        e[_STATE] = STARTED

    def completed(self, e: list[Any], error: BaseException | None = None) -> None:
        """Mark an entry completed, or errored (which also dumps)."""
        e[_T_END] = time.time_ns()
        if error is None:
            e[_STATE] = COMPLETED
        else:
            e[_STATE] = ERRORED
            e[_ERR] = f"{type(error).__name__}: {error}"
            self._dump_quietly(f"error in {e[_OP]} #{e[_SEQ]} on {e[_GROUP]}: {e[_ERR]}")

    def attach(self, work: Any, e: list[Any]) -> Any:
        """Complete ``e`` when ``work`` (a ``torch.distributed`` Work) finishes; returns ``work``.

        The future's callback may run after ``work.wait()`` has returned (on the thread that
        finished the work), so :meth:`entries` also settles every attached entry whose future is
        done: a dump taken after ``wait()`` shows the op completed, not still started. A work
        without a future (gloo's send and recv) is held weakly and settled by its ``wait()``.
        ``work`` may be a future itself (what ``all_reduce_coalesced`` and
        ``all_gather_coalesced`` return with ``async_op=True``)."""
        try:
            # (torchport's Work: a watch that never runs the operation inline, as get_future()
            # does inside a future callback on the engine's thread)
            watch = getattr(work, "_watch_future", None)
            if watch is not None:
                fut = watch()
            elif isinstance(work, torch._C.Future):  # (it has no get_future: AttributeError)
                fut = work
            else:
                fut = work.get_future()
        except (RuntimeError, AttributeError):  # "Work::getFuture not implemented": see
            # _no_future (AttributeError: a Python group's own work object, which has none: it
            # failed the op a group called directly returned, after the group had run it)
            return self._attach_without_future(work, e)
        key = id(e)  # (held in _pending until settled: not reused meanwhile)
        with self._lock:
            self._pending[key] = (e, fut)
        fut.add_done_callback(lambda f: self._settle(key, f))
        return work

    def _attach_without_future(self, work: Any, e: list[Any]) -> Any:
        """:meth:`attach` for a work known to have no future; returns ``work``."""
        key = id(work)
        try:
            ref: Callable[[], Any] = weakref.ref(work, lambda r: self._dropped(key, r))
        except TypeError:  # a work without weak references: held until its wait()
            ref = functools.partial(_identity, work)
        self._no_future[key] = (e, ref)
        return work

    def _waited(self, work: Any, error: BaseException | None) -> None:
        """``work.wait()`` returned (or raised ``error``): complete its entry, if it has one,
        with the time it was seen to end (a gloo send / recv completes inside wait())."""
        hit = self._no_future.pop(id(work), None)  # (atomic: no lock, see _dropped)
        if hit is None:
            return
        if hit[1]() is not work:  # a dropped work's id, reused before its callback ran
            self._dropped(id(work), hit[1], hit)
            return
        if hit[0][_STATE] is STARTED:
            self.completed(hit[0], error)

    def _dropped(self, key: int, ref: Any, hit: Any = None) -> None:
        """The work of an entry without future was freed without wait(): whether its op finished is
        unknown. Runs wherever the work is freed, maybe under this recorder's lock: takes none."""
        if hit is None:
            hit = self._no_future.get(key)
            if hit is None or hit[1] is not ref:
                return
            self._no_future.pop(key, None)
        e = hit[0]
        if e[_STATE] is STARTED:
            e[_T_END] = _END_UNKNOWN
            e[_STATE] = UNKNOWN

    def _settle(self, key: int, fut: Any) -> None:
        """Complete the attached entry ``key`` from its finished future, once (the callback and
        :meth:`entries` may both try)."""
        with self._lock:
            hit = self._pending.get(key)
            if hit is None or hit[1] is not fut:  # settled, or a later entry at a reused id
                return  # (clear() emptied _pending and the old entry's list was freed)
            del self._pending[key]
        try:
            fut.value()
        except Exception as err:
            self.completed(hit[0], err)
        else:
            self.completed(hit[0])

    @contextlib.contextmanager
    def op(self, name: str, group: str, tensors: Sequence[Any] = ()) -> Iterator[list[Any]]:
        """Record a blocking op around a ``with`` block."""
        e = self.record(name, group, tensors)
        self.started(e)
        try:
            yield e
        except BaseException as err:
            self.completed(e, err)
            raise
        self.completed(e)

    def entries(self) -> list[list[Any]]:
        """Recorded entries, oldest first (attached ops whose work has finished settled first)."""
        with self._lock:
            finished = [(k, f) for k, (_, f) in self._pending.items() if f.done()]
        for key, fut in finished:
            self._settle(key, fut)
        with self._lock:
            cap = self.capacity
            if cap == 0:
                return []
            live = [e for e in list(self._buf) if e is not None]
            live.sort(key=lambda e: e[_ID])
            return live

    def clear(self) -> None:
        """Drop the recorded entries. The groups' sequence ids keep counting (they are the
        groups' ops, as torch's ``reset_all`` leaves a process group's own ids: restarted here,
        ``fr analyze`` took the peers' later ops for ones this rank never entered), and so do
        the record ids: a later dump shows that its earlier entries are gone, as a wrapped
        buffer's does (restarted at 0, a rank that had dropped its sends looked complete and
        its later sends were paired with the peer's earlier receives)."""
        with self._lock:
            self._buf = [None] * self.capacity
            self._pending = {}
            self._no_future.clear()  # (the wait() hook holds this dict)
            self._waiting.clear()
            self._dumped = set()  # (the dumped ops are gone: bounded)

    # -- dumps -----------------------------------------------------------------------------
    def snapshot(self, reason: str = "request") -> dict[str, Any]:
        """The dump as a JSON-ready dict."""
        rank, world = self.identity()
        # copies, made under the lock its writers take (the live dict, serialised later while
        # a new group was recorded, failed the dump: "dictionary changed size during iteration")
        with self._lock:
            groups = {g: list(m) for g, m in self.groups.items()}
            retired = [[n, i, list(m)] for (n, i), m in self._old_groups.items()]
        now = time.time_ns()
        out = []
        for e in self.entries():
            end = e[_T_END] or now
            took = None if end == _END_UNKNOWN else (end - (e[_T_START] or e[_T_SCHED])) / 1e6
            out.append(
                {
                    "record_id": e[_ID],
                    "seq_id": e[_SEQ],
                    "op": e[_OP],
                    "group": e[_GROUP],
                    "sizes": [list(x) for x in e[_SIZES]],
                    "dtypes": [d if isinstance(d, str) else _dtype_name(d) for d in e[_DTYPES]],
                    "state": e[_STATE],
                    "time_scheduled_ns": e[_T_SCHED],
                    "time_started_ns": e[_T_START] or None,
                    "time_completed_ns": e[_T_END] if e[_T_END] > 0 else None,
                    # null: an op whose end was never seen (a gloo p2p work never waited on)
                    "duration_ms": took,
                    "error": e[_ERR],
                    "stack": e[_STACK],
                    "peer": e[_PEER],
                    "incarnation": e[_INC],
                    "tag": e[_TAG],
                }
            )
        return {
            "version": FORMAT_VERSION,
            "rank": rank,
            "world_size": world,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "reason": reason,
            "time_ns": now,
            "buffer_size": self.capacity,
            "groups": groups,
            # each group name's current incarnation (bumped at destroy, before any op of the
            # new group is recorded): fr analyze lines up this one, even when it has no entries
            "incarnations": self.incarnations(),
            # [name, incarnation, members] of the newest destroyed groups (their ops' members)
            "retired_groups": retired,
            "entries": out,
        }

    def dump(
        self,
        reason: str = "request",
        path: str | os.PathLike[str] | None = None,
        *,
        format: str = "json",
    ) -> Path:
        """Write this rank's dump atomically; returns its path.

        ``format="json"``: ours, ``rank_<r>.json``; ``"torch"``: the pickle torch's analyzer
        reads (``torchfrtrace DIR``), ``nccl_trace_rank_<r>`` (see
        :mod:`torchport.distributed.fr_torch`)."""
        if format not in ("json", "torch"):
            raise ValueError(f"format must be 'json' or 'torch', got {format!r}")
        snap = self.snapshot(reason)
        if format == "torch":
            from torchport.distributed import fr_torch

            name = f"{fr_torch.DEFAULT_PREFIX}{snap['rank']}"
            out = fr_torch.write_torch_dump(
                fr_torch.to_torch(snap), Path(path) if path is not None else self.dump_dir / name
            )
            self.dumps += 1
            return out
        p = Path(path) if path is not None else self.dump_dir / f"rank_{snap['rank']}.json"
        write_atomic(p, json.dumps(snap, indent=1).encode())
        self.dumps += 1
        return p

    def _dump_quietly(self, reason: str) -> None:
        """Dump, logging a failure in one line: called from the watchdog and signal threads
        (which an exception ended) and from completed() (where it replaced the op's error)."""
        try:
            self.dump(reason)
        except Exception as err:
            _log.warning(
                "flight recorder dump (%s) failed: %s: %s", reason, type(err).__name__, err
            )

    def abort_hook(self, reason: str = "abort") -> None:
        """Call when a group is aborted: dumps with the given reason."""
        self._dump_quietly(reason)

    # -- watchdog --------------------------------------------------------------------------
    def start_watchdog(self, timeout_s: float | None = None, period_s: float = 0.1) -> None:
        """Dump once when an op stays incomplete for more than ``timeout_s`` seconds (a
        finite number >= 0; 0: no watchdog), looking every ``period_s`` seconds (a finite
        number > 0). Does nothing while a watchdog runs; after :meth:`stop`, or after the
        watchdog thread died, starts a new one."""
        t = config.get("fr_timeout") if timeout_s is None else timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t < math.inf:
            # (nan and inf ended in a ValueError / OverflowError from int() below)
            raise ValueError(f"timeout_s must be a finite number >= 0 (0: none), got {t!r}")
        p = period_s
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p < math.inf:
            # (0, a negative or nan period spun a core; "0.1" killed the thread in its first
            # wait, and the dead thread, still recorded, kept any later start from running)
            raise ValueError(f"period_s must be a finite number > 0, got {p!r}")
        if t == 0:
            return
        # (capped: beyond ~31,000 years t * 1e9 could overflow, and nothing is ever that late)
        limit_ns = int(min(t, 1e12) * 1e9)
        # (a wait longer than the platform's limit raises OverflowError in the thread)
        period = min(float(p), threading.TIMEOUT_MAX)
        with self._lock:  # (two concurrent starts: one watchdog)
            if self._watchdog is not None and self._watchdog.is_alive():
                return
            stop = self._stop = threading.Event()
            self._watchdog = threading.Thread(
                target=self._watch,
                args=(stop, limit_ns, period),
                name="tp-fr-watchdog",
                daemon=True,
            )
            self._watchdog.start()

    def _watch(self, stop: threading.Event, limit_ns: int, period_s: float) -> None:
        """The watchdog thread's loop, until ``stop`` is set."""
        while not stop.wait(period_s):
            now = time.time_ns()
            # dump once per newly overdue op: keyed on the first overdue entry alone, an
            # op that stays incomplete (a gloo isend never waited on) hid every later hang
            no_future = {e[_ID] for e, _ in list(self._no_future.values())}
            waiting = self._waiting.copy()
            overdue = [
                e
                for e in self.entries()
                if e[_STATE] in (SCHEDULED, STARTED)
                and now - (waiting.get(e[_ID], now) if e[_ID] in no_future else e[_T_SCHED])
                > limit_ns
            ]
            # a set of the dumped ids, not the highest: a future-less p2p op becomes overdue
            # only once its wait() runs, after later ops may have been dumped for, and its
            # hang was then never dumped; only ids still overdue are kept (bounded)
            late = [e for e in overdue if e[_ID] not in self._dumped]
            self._dumped = {e[_ID] for e in overdue}
            if late:
                e = late[0]
                self._dump_quietly(
                    f"timeout: {e[_OP]} #{e[_SEQ]} on {e[_GROUP]} incomplete "
                    f"after {(now - e[_T_SCHED]) / 1e9:.2f} s"
                )

    def stop(self) -> None:
        """Stop the watchdog (waiting up to 5 s for a dump it is writing); a later
        :meth:`start_watchdog` starts a new one (the stopped thread stayed recorded as
        running, and an overdue op was then never dumped)."""
        with self._lock:
            thread, self._watchdog = self._watchdog, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


_recorder: FlightRecorder | None = None


def get_recorder() -> FlightRecorder:
    """The process-wide recorder (created on first use)."""
    global _recorder
    if _recorder is None:
        _recorder = FlightRecorder()
    return _recorder


# -- signal-triggered dumps ----------------------------------------------------------------
# sock: the socket pair whose write end is the wakeup fd; recorder; sigs: each signal dumped ->
# the handler it had before (called after ours); forward: (a duplicate of, the number of) the
# wakeup fd found at the first enable (asyncio's), which gets every signal byte too; thread
_sig_state: dict[str, Any] = {}


def enable_signal_dump(sig: int = signal.SIGUSR1, recorder: FlightRecorder | None = None) -> None:
    """Dump on ``sig`` from a helper thread (works while the main thread is inside C++).

    Must be called from the main thread (``ValueError`` otherwise). Uses
    ``signal.set_wakeup_fd``, so the dump does not wait for the interpreter to run a
    Python-level handler. Each call adds its signal (the dumps go to the latest ``recorder``).
    What the process had is kept: a Python handler the signal had runs after the dump's (in
    the main thread, as before), and a wakeup fd set before (asyncio's) gets every signal byte
    still; another taking the wakeup fd later (an asyncio loop started since) delays the dump
    until the main thread runs Python, where the wakeup fd is taken back once free.
    :func:`disable_signal_dump` restores it all."""
    rec = recorder or get_recorder()
    state = _sig_state
    if sig in state.get("sigs", ()):
        state["recorder"] = rec
        return
    prev = signal.signal(sig, _on_signal)  # (first: a bad signal, or not the main thread, raises)
    state.setdefault("sigs", {})[sig] = prev
    state["recorder"] = rec
    if "sock" in state:
        return
    r, w = socket.socketpair()
    r.setblocking(True)
    w.setblocking(False)
    old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    # a duplicate: the owner may close its fd and the number be reused by an unrelated file
    state.update(sock=(r, w), forward=(os.dup(old), old) if old >= 0 else None)
    if not state.get("atexit"):
        # the pair lives as long as the process; left to interpreter teardown it was reported
        # as 'ResourceWarning: unclosed <socket.socket ... family=1>' at every exit
        atexit.register(_close_signal_dump)
        state["atexit"] = True
    fwd = state["forward"]

    def loop() -> None:
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            if fwd is not None:
                with contextlib.suppress(OSError):  # (its reader gone, or its buffer full)
                    os.write(fwd[0], data)
            for b in sorted(set(data)):
                if b in state.get("sigs", ()):
                    state["recorder"]._dump_quietly(f"signal {signal.Signals(b).name}")

    thread = threading.Thread(target=loop, name="tp-fr-signal", daemon=True)
    state["thread"] = thread
    thread.start()


def _on_signal(signum: int, frame: Any) -> None:
    """The Python handler of a dumped signal (in the main thread): takes the wakeup fd back if
    it was freed (an asyncio loop closed), asks for the dump itself if the signal's byte went to
    another's wakeup fd, and calls the handler the signal had before."""
    state = _sig_state
    sock = state.get("sock")
    if sock is not None:
        mine = sock[1].fileno()
        with contextlib.suppress(ValueError, OSError):
            cur = signal.set_wakeup_fd(mine, warn_on_full_buffer=False)
            if cur != mine:
                if cur != -1:  # another's (an asyncio loop running): left to it
                    signal.set_wakeup_fd(cur)
                sock[1].send(bytes([signum]))
    prev = state.get("sigs", {}).get(signum)
    if callable(prev) and prev is not _on_signal:
        prev(signum, frame)


def disable_signal_dump() -> bool:
    """Undo :func:`enable_signal_dump`: each signal's earlier handler and the earlier wakeup fd
    are restored (where they are still ours), the helper thread ends (closing the write end
    gives its ``recv`` end-of-file) and both sockets are closed. From the main thread only:
    elsewhere nothing is changed and False is returned."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _close_signal_dump()
    return True


def _close_signal_dump() -> None:
    """:func:`disable_signal_dump` (also at exit)."""
    state = _sig_state
    for sig, prev in state.pop("sigs", {}).items():
        with contextlib.suppress(ValueError, OSError, TypeError):  # (not the main thread)
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    sock = state.pop("sock", None)
    fwd = state.pop("forward", None)
    if sock is not None:
        r, w = sock
        with contextlib.suppress(ValueError):  # not the main thread: leave the wakeup fd alone
            old = signal.set_wakeup_fd(-1)
            if old != w.fileno():  # someone else's since: put it back
                signal.set_wakeup_fd(old)
            elif fwd is not None and _same_file(*fwd):  # the one we found, still open
                signal.set_wakeup_fd(fwd[1])
        w.close()
        thread = state.pop("thread", None)
        if thread is not None:
            thread.join(1.0)
            if thread.is_alive():  # (still dumping: it may forward once more, so the
                fwd = None  # duplicate stays open rather than its number reused meanwhile)
        r.close()
    if fwd is not None:
        os.close(fwd[0])


def _same_file(a: int, b: int) -> bool:
    """Whether fds ``a`` and ``b`` are open on one file."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


# -- recording every torch.distributed collective -----------------------------------------
# The torch.distributed functions install() wraps. An op is recorded (and numbered) where it
# reaches the process group, in the group's methods (_COLL_METHODS); these wrappers only
# complete a synchronous op's entry when the function returns (no future callback needed) and
# record calls on a group object that is no ProcessGroup (see _wrap).
_PATCHED = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)

# Collectives are recorded where every path to them meets: the process group's methods, as
# torch's own recorder does (which sits in the group). Recording the torch.distributed
# functions alone missed what calls torch's module functions or the group directly -- FSDP2's
# all_gather_single / reduce_scatter_single (new names the list lacked), the object
# collectives (all_gather_object's two all_gathers), the coalescing manager -- and numbered
# an op torch refused in its argument checks on one rank (a complex all_reduce with MAX),
# which the group never received: every later id of that rank was one ahead of its peers'.
# Method -> our op name: one name per op of the group, however it was called
# (all_gather_single and all_gather_into_tensor are one op, so are their coalesced forms).
_COLL_METHODS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
}
# (owner, name) -> the attribute as install() first found it, for every function (owner: the
# torch.distributed module) and method (owner: Work, a ProcessGroup class) it replaced
_originals: dict[tuple[Any, str], Any] = {}
_wrappers: dict[tuple[Any, str], Any] = {}  # what install() set, per (owner, name)
# id(group) -> (name, ranks, a callable returning the group): the third item (a weak reference,
# or a closure holding a group that takes none) tells a live group from a destroyed one whose id
# a new group reuses -- keyed by id alone, the new group's ops were recorded under the old one's
# name and sequence counter
_group_names: dict[int, tuple[str, list[int], Callable[[], Any]]] = {}


_tmp_ids = itertools.count()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: into a new temporary file beside it, then renamed.

    The temporary file is created exclusively (``O_EXCL``: a file or link planted at its name
    is never written through; the next name is tried) and named ``.~<digits>~``, without any
    dump's name in it and not ending in a digit: torch's analyzer reads every file of a folder
    whose name holds its prefix and takes the digits at the end of a name for a rank, so a
    leftover of a killed writer (``.nccl_trace_rank_1.<pid>....tmp``) broke its reading of the
    whole folder. One file per writer: the watchdog, signal and error dumps may overlap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = path.with_name(f".~{os.getpid()}.{time.time_ns()}.{next(_tmp_ids)}~")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary file name beside {str(path)!r}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _identity(x: Any) -> Any:
    return x


def _as_int(x: Any) -> int | None:
    """``x`` as an int if it is an integer of any kind, else None (torch refuses it)."""
    try:
        return operator.index(x)
    except TypeError:
        return None


def _retired() -> None:
    """The owner of a group name whose group was destroyed (see FlightRecorder.retire)."""
    return None


def _group_key(group: Any) -> tuple[str, list[int], Callable[[], Any]]:
    key = id(group)
    hit = _group_names.get(key)
    if hit is not None and hit[2]() is group:
        return hit
    if group is None or group is dist.group.WORLD:
        name, ranks = "default", list(range(dist.get_world_size()))
    else:
        try:
            given = getattr(group, "group_name", None)
        except RuntimeError:  # a ProcessGroup never named ("ProcessGroup name not set")
            given = None
        name = str(given or f"pg{key:x}")
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError, KeyError):  # KeyError: a group c10d never registered
            ranks = []
    try:
        ref: Callable[[], Any] = weakref.ref(group)
    except TypeError:  # None, or a group without weak references: keep it (its id stays unique)
        ref = functools.partial(_identity, group)
    hit = _group_names[key] = (name, ranks, ref)
    return hit


def _param_index(fn: Callable[..., Any], param: str) -> int | None:
    """Position of ``fn``'s parameter ``param`` (None if it has none or no signature)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(param) if param in names else None


# point-to-point ops: numbered on their own counter per group, so that a send on one rank and
# the recv on another do not shift the collectives' sequence ids (fr analyze matched a correct
# send/recv pair as a mismatched collective)
P2P_OPS = ("send", "recv")

# Point-to-point ops are recorded where every torch.distributed path to them meets: the process
# group's send / recv / recv_anysource methods (dist.send calls dist.isend, batch_isend_irecv
# calls each P2POp's isend / irecv, and those call these). Wrapping dist.isend / dist.irecv
# instead broke dist.P2POp, which accepts torch's own two functions only and picks the peer
# keyword by identity with them, and torch's send went through its unwrapped isend.
_P2P_METHODS = {"send": "send", "recv": "recv", "recv_anysource": "recv"}


class _OpState(threading.local):
    # inside a recorded process group method: a subclass's calling its base's, or torch's
    # C++ method calling a Python group's own (all_gather_single -> _allgather_base): one op
    busy = False
    seq: int | None = None  # the shared sequence id of the batch_isend_irecv being issued
    # inside a wrapped torch.distributed function (see _wrap), and the entry of the first op
    # it issued, which the function completes (a nested wrapped function leaves it alone)
    public = False
    entry: list[Any] | None = None


_op_state = _OpState()
# ProcessGroup classes whose methods install() wrapped (a subclass defined later is wrapped
# when _wrap first meets a group of it)
_hooked: set[type] = set()


def _seen(group: Any, rec: FlightRecorder) -> tuple[str, list[int], Callable[[], Any]]:
    """Cache a group object not seen before: its name and members, and (a group re-created
    under an old name) a new incarnation of the name's sequence ids."""
    hit = _group_key(group)
    # a group of that name re-created (the default group after a re-init with another world)
    # names its own members, not the old ones (under the lock: see FlightRecorder.record)
    with rec._lock:
        rec.groups[hit[0]] = list(hit[1])
    rec.adopt(hit[0], dist.group.WORLD if group is None else group)
    return hit


# parameters of the patched functions that never hold tensors (some are not annotated)
_NOT_TENSORS = frozenset(
    ("op", "group", "async_op", "src", "dst", "tag", "group_src", "group_dst", "device_ids")
)


def _wrap(name: str, fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    names, tensor, kinds = _group_names, torch.Tensor, (torch.Tensor, list, tuple)
    # group and async_op may come by position too (all_reduce(t, op, group, True) was recorded
    # on the default group and as completed on return)
    gi, ai = _param_index(fn, "group"), _param_index(fn, "async_op")
    own_only = name in ("gather", "scatter")  # the list exists on the root only
    # the first parameter, and the later ones that may hold tensors (annotated so, or not
    # annotated): a call passing one of those by keyword takes the full path
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    first = params[0].name if params else ""
    empty = inspect.Parameter.empty
    more = tuple(
        p.name
        for p in params[1:]
        if p.name not in _NOT_TENSORS and (p.annotation is empty or "Tensor" in str(p.annotation))
    )

    state, hooked, pg_class = _op_state, _hooked, dist.ProcessGroup

    def issue(args: Any, kwargs: Any) -> Any:
        """Call ``fn`` on a group whose methods record: complete the entry its op made."""
        if state.public:  # (called by another wrapped function: that one completes it)
            return fn(*args, **kwargs)
        state.public, state.entry = True, None
        try:
            out = fn(*args, **kwargs)
        except BaseException as err:
            if state.entry is not None:  # the group took the op; its wait failed
                rec.completed(state.entry, err)
            raise  # (else refused before the group got it: no entry, no sequence id)
        finally:
            e, state.entry, state.public = state.entry, None, False
        if e is None:  # no op issued (deferred by the coalescing manager to its end)
            return out
        return settle(e, out, args, kwargs)

    def settle(e: list[Any], out: Any, args: Any, kwargs: Any) -> Any:
        """Complete ``e`` now (a synchronous call returned), or when the returned Work does."""
        async_op = kwargs.get("async_op", args[ai] if ai is not None and ai < len(args) else False)
        if out is not None and async_op:
            return rec.attach(out, e)
        e[_T_END] = time.time_ns()
        e[_STATE] = COMPLETED
        return out

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[gi] if gi is not None and gi < len(args) else None)
        g = dist.group.WORLD if group is None else group
        if type(g) in hooked or (hooked and isinstance(g, pg_class) and _hook_late(g, rec)):
            return issue(args, kwargs)
        # a group that is no ProcessGroup (or install() not in force): recorded here, around
        # the call
        hit = names.get(id(group))
        if hit is None or hit[2]() is not group:
            hit = _seen(group, rec)
        # Every tensor argument, by position or keyword, so that the record does not depend on
        # the call's spelling: all_reduce(tensor=t) was recorded without sizes, and
        # all_gather_into_tensor(out, inp) without inp's while (out, inp, g) had it -- fr
        # analyze saw a size mismatch between two ranks that called it either way.
        a0, n = (args[0] if args else None), len(args)
        if (
            type(a0) is tensor
            and (own_only or n == 1 or (n == 2 and not isinstance(args[1], kinds)))
            and not (more and kwargs and any(k in kwargs for k in more))
        ):  # one tensor (+ op / src): the hot path
            e = rec._new(name, hit[0], (a0.shape,), (a0.dtype,), STARTED)
        else:
            if own_only:  # the list exists on the root only: this rank's own tensor
                given: Sequence[Any] = (a0 if args else kwargs.get(first),)
            else:
                given = (*args, *kwargs.values()) if kwargs else args
            sizes, dtypes = _describe(given)
            e = rec._new(name, hit[0], sizes, dtypes, STARTED)
        try:
            out = fn(*args, **kwargs)
        except BaseException as err:
            rec.completed(e, err)
            raise
        return settle(e, out, args, kwargs)

    return wrapper


@contextlib.contextmanager
def already_recorded() -> Iterator[None]:
    """Inside: the process group methods :func:`install` wrapped record nothing on this thread,
    for a caller that recorded the op itself (the fault-tolerance manager records its
    ``allreduce`` under its quorum's name: with ``install()`` in force each was recorded twice,
    the second time under a group the recorder knew no members of)."""
    state = _op_state
    outer, state.busy = state.busy, True
    try:
        yield
    finally:
        state.busy = outer


def _wrap_coll(method: str, fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    """A process group's collective method ``method`` that records the op (one sequence id per
    op the group receives) and settles the entry: the wrapped torch.distributed function that
    issued it completes it (see _wrap), else the returned Work's completion does."""
    names, state, op, tensor = _group_names, _op_state, _COLL_METHODS[method], torch.Tensor
    # a gather's list exists on the root only, a scatter's too: this rank's own tensor (gather:
    # the inputs, second; scatter: the outputs, first), as torch's recorder keeps them
    own = {"gather": 1, "scatter": 0}.get(method)

    @functools.wraps(fn)
    def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
        if state.busy:
            return fn(pg, *args, **kwargs)
        hit = names.get(id(pg))
        if hit is None or hit[2]() is not pg:
            hit = _seen(pg, rec)
        a0, n = (args[0] if args else None), len(args)
        if (
            type(a0) is list
            and len(a0) == 1
            and type(a0[0]) is tensor
            and (n == 1 or (n == 2 and not isinstance(args[1], list | tuple)))
            and not kwargs
        ):
            # ([tensor], opts): all_reduce, broadcast, reduce -- the hot path (not a second
            # list: reduce_scatter([out], [inputs]) without opts was recorded without inputs)
            e = rec._new(op, hit[0], (a0[0].shape,), (a0[0].dtype,), STARTED)
        else:
            if own is not None:
                given: Sequence[Any] = args[own : own + 1]
            else:
                given = (*args, *kwargs.values()) if kwargs else args
            sizes, dtypes = _describe(given)
            e = rec._new(op, hit[0], sizes, dtypes, STARTED)
        state.busy = True
        try:
            work = fn(pg, *args, **kwargs)
        except BaseException as err:
            rec.completed(e, err)
            raise
        finally:
            state.busy = False
        if state.public and state.entry is None:
            state.entry = e  # (the function that called this completes it)
            return work
        if work is None:  # (monitored_barrier: done on return)
            rec.completed(e)
            return work
        return rec.attach(work, e)

    return wrapper


def _wrap_p2p(method: str, fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    """A process group's ``send`` / ``recv`` / ``recv_anysource`` that records the op (peer as a
    global rank) and settles the entry when the returned Work completes."""
    names, state, op = _group_names, _op_state, _P2P_METHODS[method]
    futureless = _futureless
    anysource = method == "recv_anysource"

    @functools.wraps(fn)
    def wrapper(pg: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if state.busy:
            return fn(pg, tensors, *args, **kwargs)
        hit = names.get(id(pg))
        if hit is None or hit[2]() is not pg:
            hit = _seen(pg, rec)
        # peer and tag as ints: torch takes any integer (numpy.int64(1)), which kept as is
        # made every later dump of the process fail in json
        peer: int | None
        if anysource:
            peer, tag = -1, _as_int(args[0] if args else kwargs.get("tag", 0))
        else:
            p = _as_int(args[0] if args else kwargs.get("dstRank" if op == "send" else "srcRank"))
            ranks = hit[1]
            peer = ranks[p] if p is not None and 0 <= p < len(ranks) else p
            tag = _as_int(args[1] if len(args) > 1 else kwargs.get("tag", 0))
        sizes, dtypes = _describe((tensors,))
        e = rec._new(op, hit[0], sizes, dtypes, STARTED, "p2p", peer, state.seq, tag)
        state.busy = True
        try:
            work = fn(pg, tensors, *args, **kwargs)
        except BaseException as err:
            rec.completed(e, err)
            raise
        finally:
            state.busy = False
        if work is None:
            rec.completed(e)
            return work
        # a group whose p2p works on this device have no future (gloo): asking each one cost a
        # C++ exception, ~8 us an op (the works of one group and device are of one backend)
        dev = _device_type(tensors)
        if futureless.get((id(pg), dev)) is hit[2]:
            return rec._attach_without_future(work, e)
        rec.attach(work, e)
        if id(work) in rec._no_future:
            futureless[(id(pg), dev)] = hit[2]
        return work

    return wrapper


def _batch_seq(group: Any, rec: FlightRecorder | None) -> int | None:
    """Begin a batch of ``group``'s point-to-point ops on this thread: they share one sequence
    id (taken here), as torch 2.14's recorder numbers a coalesced batch (each op is still its
    own entry); inside a batch already begun, the ops keep that one's. Returns the value the
    caller restores ``_op_state.seq`` to when the batch is issued."""
    state = _op_state
    outer = state.seq
    if rec is not None and outer is None:
        hit = _group_names.get(id(group))
        if hit is None or hit[2]() is not group:
            hit = _seen(group, rec)
        state.seq = rec.next_seq(hit[0], "p2p")
    return outer


def _wrap_batch(fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    """``batch_isend_irecv`` whose ops share one point-to-point sequence id (:func:`_batch_seq`)."""
    state = _op_state

    @functools.wraps(fn)
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        if state.seq is not None or not isinstance(p2p_op_list, list) or not p2p_op_list:
            return fn(p2p_op_list)  # (torch names what is wrong with the list)
        group = getattr(p2p_op_list[0], "group", None)
        outer = _batch_seq(dist.group.WORLD if group is None else group, rec)
        try:
            return fn(p2p_op_list)
        finally:
            state.seq = outer

    return batch_isend_irecv


def _wrap_wait(fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    """``Work.wait`` that completes the entry of a point-to-point op whose work has no future
    (gloo's send / recv: done only inside wait()) when the wait returns, or errors it when the
    wait raises; one dict test for any other work (two while such an op is pending)."""
    no_future, waiting = rec._no_future, rec._waiting

    @functools.wraps(fn)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        if not no_future:
            return fn(work, *args, **kwargs)
        hit = no_future.get(id(work))
        if hit is None:  # (not one of them: nothing to settle)
            return fn(work, *args, **kwargs)
        key = hit[0][_ID]
        waiting[key] = time.time_ns()  # (for the watchdog: waited for since)
        try:
            out = fn(work, *args, **kwargs)
        except BaseException as err:
            rec._waited(work, err)
            raise
        finally:
            waiting.pop(key, None)
        if out is not False:  # (False: not completed within the timeout)
            rec._waited(work, None)
        return out

    return wait


# (id(group), device type) -> the group's _group_names reference, for groups whose p2p works
# on that device have no future (a group id reused by a new group has a new reference)
_futureless: dict[tuple[int, str], Callable[[], Any]] = {}


def _device_type(tensors: Any) -> str:
    """The device type of the first tensor of a p2p op's tensor list ("" if none)."""
    t = tensors[0] if isinstance(tensors, list | tuple) and tensors else tensors
    return t.device.type if isinstance(t, torch.Tensor) else ""


# -- functional collectives ---------------------------------------------------------------------
# torch.distributed._functional_collectives (FSDP2, tensor parallel, torch.compile'd code) issue
# their ops as torch.ops._c10d_functional kernels, which call the group from C++: on a group c10d
# made in C++ (gloo's, a ProcessGroup proper) no Python method runs, so they were not recorded
# (torch 2.14's recorder, inside the C++ group, records them). A torchport group is a Python
# subclass: c10d calls its own methods, which record. While installed, a CPU kernel of each
# collective below calls torch's own kernel with a _Relay in place of such a group: c10d calls
# the relay's methods (a Python group's), which call the group's recorded ones. The op is
# recorded as any other op the group receives -- its name, counter and sizes -- and completes
# with its Work. The point-to-point kernels (isend, irecv, batch_p2p_ops) take a group name
# only ("str group_name": no relay can stand in), so on such a group their kernel runs the op
# here as torch's does, through the group's recorded send / recv (see _FUNCOL_OWN).
_FUNCOL_OPS = (
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "all_gather_into_tensor",
    "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_out",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
    "broadcast_",
    "isend",
    "irecv",
    "batch_p2p_ops",
)
_NO_TIMEOUT = datetime.timedelta(0)  # (Work.wait's default: the group's own timeout)
_funcol_lib: Any = None  # the torch.library.Library holding our kernels while installed
# id(group) -> (a weak reference to the group, its relay)
_relays: dict[int, tuple[Callable[[], Any], Any]] = {}


class _Relay(dist.ProcessGroup):
    """Stands in for a C++ process group in a functional collective's kernel: each collective
    and point-to-point method calls the group's own (recorded) method with the same arguments."""

    def __init__(self, group: Any) -> None:
        super().__init__(group.rank(), group.size())  # type: ignore[call-arg]
        self._group = weakref.ref(group)  # (a relay never keeps a destroyed group alive)


class _RelayedWork(dist.Work):
    """A Work without a future (gloo's reduce_scatter_tensor_coalesced, as its send / recv) is
    complete only inside its ``wait()``, which ``wait_tensor`` calls from C++: its entry was
    settled as unknown. This one, handed back to c10d in its place, waits through Python, where
    the wait completes (or errors) the entry."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        return bool(self._work.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _relay_method(name: str) -> Callable[..., Any]:
    def method(self: _Relay, *args: Any, **kwargs: Any) -> Any:
        group = self._group()
        assert group is not None, "a relay outlived its group (the kernel holds the group)"
        return _for_c10d(getattr(group, name)(*args, **kwargs))

    method.__name__ = method.__qualname__ = name
    return method


def _for_c10d(work: Any) -> Any:
    """``work`` as handed back to a functional collective's kernel (see _RelayedWork)."""
    rec = _recorder
    if rec is not None and id(work) in rec._no_future:
        return _RelayedWork(work)
    return work


for _name in (*_COLL_METHODS, *_P2P_METHODS):
    setattr(_Relay, _name, _relay_method(_name))


def _relay(group: Any) -> Any:
    """The relay of ``group`` (one per live group)."""
    hit = _relays.get(id(group))
    if hit is None or hit[0]() is not group:
        hit = _relays[id(group)] = (weakref.ref(group), _Relay(group))
    return hit[1]


def _funcol_kernel(kernel: Any, gi: int, own: Any, *args: Any, **kwargs: Any) -> Any:
    """A functional collective's CPU kernel: torch's own ``kernel``, given a relay in place of a
    C++ group (argument ``gi``: a group name, or, in torch 2.13, the group itself); ``own``:
    the op run here instead on such a group (see _FUNCOL_OWN), or None."""
    group = funcol_group(args[gi] if gi < len(args) else kwargs.get("group_name"))
    if type(group) is dist.ProcessGroup and not _op_state.busy:
        if own is not None:
            kw = {k: v for k, v in kwargs.items() if k != "group_name"}
            return own(kernel, group, *args[:gi], *args[gi + 1 :], **kw)
        if gi < len(args):
            args = (*args[:gi], _relay(group), *args[gi + 1 :])
        else:
            kwargs = {**kwargs, "group_name": _relay(group)}
    elif (
        own is _batch_p2p
        and isinstance(group, dist.ProcessGroup)
        and gi < len(args)
        and not p2p_batch_refused(*args[:gi])  # (op_list, peer_list, tag_list, tensors)
    ):
        # a Python group's batch (a torchport group's: its backend's kernel issues the ops one
        # by one through the recorded send / recv): one sequence id, as on a C++ group (each op
        # took its own); none for a list torch's kernel refuses
        outer = _batch_seq(group, _recorder)
        try:
            return kernel.call_boxed(CPU_KEYSET, *args, **kwargs)
        finally:
            _op_state.seq = outer
    return kernel.call_boxed(CPU_KEYSET, *args, **kwargs)


def _all_gather_out(
    _kernel: Any, group: Any, input: torch.Tensor, group_size: int, *, out: Any
) -> Any:
    """``all_gather_into_tensor_out`` on a C++ group, as torch's kernel runs it (no check of
    the input's layout: gloo gathers a strided input as it is): its kernel calls
    the group's ``_allgather_base``, which c10d does not forward to a Python group's method (a
    relay failed with "No backend type associated with device type cpu"), so it is run here,
    through the group's recorded method (``group_size`` unused, as in torch's kernel)."""
    work = group._allgather_base(out, input)
    _register_work(out, _for_c10d(work))
    return out


_register_work = torch._C._distributed_c10d._register_work


def _isend(_kernel: Any, group: Any, tensor: torch.Tensor, dst: int, tag: int) -> torch.Tensor:
    """``isend`` on a C++ group, as torch's kernel runs it: the group's (recorded) ``send``;
    the result is an empty tensor that, as the sent one, carries the Work for ``wait_tensor``
    (``dst`` goes to ``send`` as given, as there)."""
    work, placeholder = p2p_issue(group, "isend", dst, tag, tensor)
    work = _for_c10d(work)
    _register_work(tensor, work)
    _register_work(placeholder, work)
    return placeholder


def _irecv(_kernel: Any, group: Any, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    """``irecv`` on a C++ group, as torch's kernel runs it: the group's (recorded) ``recv``
    into ``tensor``, which is the result and carries the Work."""
    work, _ = p2p_issue(group, "irecv", src, tag, tensor)
    _register_work(tensor, _for_c10d(work))
    return tensor


def _batch_p2p(
    kernel: Any,
    group: Any,
    op_list: list[str],
    peer_list: list[int],
    tag_list: list[int],
    tensors: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``batch_p2p_ops`` on a C++ group, as torch's kernel runs it (coalesced where the backend
    coalesces; each send's result an empty tensor, each receive's its tensor), its ops sharing
    one point-to-point sequence id as ``batch_isend_irecv``'s do. A list torch refuses (lengths
    that differ, no op, an op other than isend / irecv) goes to torch's kernel, which raises."""
    if p2p_batch_refused(op_list, peer_list, tag_list, tensors):
        return kernel.call_boxed(
            CPU_KEYSET, op_list, peer_list, tag_list, tensors, group.group_name
        )
    device = tensors[0].device
    coalesce = group._get_backend(device).supports_coalescing
    state = _op_state
    outer = _batch_seq(group, _recorder)
    outs: list[torch.Tensor] = []
    try:
        if coalesce:
            group._start_coalescing(device)
        for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors, strict=True):
            work, out = p2p_issue(group, op, peer, tag, t)
            if work is not None:
                work = _for_c10d(work)
                _register_work(t, work)
                if out is not t:
                    _register_work(out, work)
            outs.append(out)
    finally:
        state.seq = outer
    if coalesce:
        work = group._end_coalescing(device)
        if work is None:
            raise RuntimeError(
                "batch_p2p_ops: the group's end of coalescing returned no Work (torch's kernel "
                "requires one)"
            )
        for out in outs:
            _register_work(out, work)
    return outs


# the functional ops run here on a C++ group, not by torch's kernel given a relay
_FUNCOL_OWN: dict[str, Callable[..., Any]] = {
    "all_gather_into_tensor_out": _all_gather_out,
    "isend": _isend,
    "irecv": _irecv,
    "batch_p2p_ops": _batch_p2p,
}


def _hook_functional() -> None:
    """Register :func:`_funcol_kernel` for every functional collective torch has (once)."""
    global _funcol_lib
    if _funcol_lib is not None:
        return
    lib = torch.library.Library(NAMESPACE, "IMPL")
    try:
        for name in _FUNCOL_OPS:
            op = getattr(torch.ops._c10d_functional, name, None)
            if op is None:  # (an op this torch lacks)
                continue
            gi = [a.name for a in op.default._schema.arguments].index("group_name")
            override_cpu_kernel(lib, name, bind(_funcol_kernel, gi, _FUNCOL_OWN.get(name)))
    except BaseException:
        lib._destroy()
        raise
    _funcol_lib = lib


def _unhook_functional() -> None:
    """Remove the kernels :func:`_hook_functional` registered (torch's own serve again)."""
    global _funcol_lib
    lib, _funcol_lib = _funcol_lib, None
    if lib is not None:
        lib._destroy()
    _relays.clear()


def _process_group_classes() -> list[type]:
    """``ProcessGroup`` and its subclasses (a backend's own group may define its own send),
    but not :class:`_Relay` (its calls reach the group it stands for, which records them)."""
    out: list[type] = []
    todo: list[type] = [dist.ProcessGroup]
    while todo:
        c = todo.pop()
        if c not in out and c is not _Relay:
            out.append(c)
            todo.extend(c.__subclasses__())
    return out


def _hook_process_groups(rec: FlightRecorder, *, again: bool = False) -> None:
    """Wrap the collective and point-to-point methods of ``ProcessGroup`` and of each subclass
    defining its own (inherited: recorded by the class that defines it); ``again``: also the
    classes wrapped before (a new install() records into its own recorder)."""
    for cls in _process_group_classes():
        if cls in _hooked and not again:
            continue
        _hook_class(cls, rec)


def _hook_class(cls: type, rec: FlightRecorder) -> None:
    """Wrap the collective and point-to-point methods ``cls`` itself defines."""
    for method in _COLL_METHODS:
        if method in vars(cls):
            _patch(cls, method, functools.partial(_wrap_coll, method, rec=rec))
    for method in _P2P_METHODS:
        if method in vars(cls):
            _patch(cls, method, functools.partial(_wrap_p2p, method, rec=rec))
    _hooked.add(cls)


def _on_subclass(cls: type, rec: FlightRecorder, **kwargs: Any) -> None:
    """``ProcessGroup.__init_subclass__`` while installed: a subclass defined after install()
    records its own methods from its definition on. They were wrapped only once a
    torch.distributed function met one of its groups (see _hook_late): ops called on such a
    group directly were not recorded until then, or at all."""
    super(dist.ProcessGroup, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    if issubclass(cls, _Relay):
        return
    try:
        _hook_class(cls, rec)
    except Exception:  # (never fail a class definition: _hook_late tries again)
        _log.exception("flight recorder: could not wrap the methods of %s", cls.__qualname__)


# the ProcessGroup.__init_subclass__ install() set (None when not installed)
_subclass_hook: list[Any] = [None]


def _hook_subclasses(rec: FlightRecorder) -> None:
    """Make a ProcessGroup subclass defined from now on record from its definition on (see
    _on_subclass); not where torch's class has a hook of its own (torch 2.13's has none): there
    _hook_late wraps its methods."""
    current = vars(dist.ProcessGroup).get("__init_subclass__")
    if current is not None and current is not _subclass_hook[0]:
        return
    hook = classmethod(functools.partial(_on_subclass, rec=rec))
    dist.ProcessGroup.__init_subclass__ = hook  # type: ignore[assignment]
    _subclass_hook[0] = hook


def _hook_late(group: Any, rec: FlightRecorder) -> bool:
    """Wrap the methods of ``group``'s class, a ProcessGroup subclass defined after install()
    (its own collectives were not recorded); True once they record."""
    _hook_process_groups(rec)
    return type(group) in _hooked


def _wrap_destroy(fn: Callable[..., Any], rec: FlightRecorder) -> Callable[..., Any]:
    """``destroy_process_group`` that also forgets the default group's cached membership
    (``group=None`` is cached under one key for the life of the process, so after a re-init
    with another world the entries still named the old world's ranks) and starts the next
    incarnation of the destroyed groups' names (all of them for the default group)."""

    @functools.wraps(fn)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[0] if args else None)
        # decided before the call: torch sets group.WORLD to None as it destroys it, so an
        # explicit destroy_process_group(dist.group.WORLD) was taken for a subgroup's (no
        # incarnation started: the analyzer then blamed the rank not yet late)
        default = group is None or group is dist.group.WORLD
        try:
            return fn(*args, **kwargs)
        finally:
            _group_names.pop(id(None), None)
            if default:
                rec.retire()  # torch destroys every group with the default one
            else:
                hit = _group_names.get(id(group))
                if hit is not None and hit[2]() is group:
                    rec.retire(hit[0])

    return destroy_process_group


def _patch(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Set ``owner.name`` to ``make(original)``, ``original`` being the attribute ``owner``
    itself holds (not one it inherits), or the one install() replaced if that is its own
    wrapper (a second install() wraps the original again, not the first wrapper)."""
    key = (owner, name)
    fn = vars(owner)[name]
    # recognised by identity: functools.wraps would copy a marker attribute onto another
    # library's wrapper of ours (a ProcessGroup subclass defined while installed)
    if key in _wrappers and _wrappers[key] is fn:
        fn = _originals[key]
    _originals[key] = fn
    _wrappers[key] = make(fn)
    setattr(owner, name, _wrappers[key])


def install(recorder: FlightRecorder | None = None, *, signal_dump: bool = True) -> FlightRecorder:
    """Record every ``torch.distributed`` collective and point-to-point op of this process, on
    any backend.

    Every op is recorded where it reaches the process group, in the methods of
    ``ProcessGroup`` and of its subclasses (those defined later from their definition on),
    with one sequence id per op the group received: so also what torch issues itself (the
    object collectives, FSDP2's all-gathers and reduce-scatters, the coalescing manager's one
    op, the functional collectives' and functional point-to-point ops, also on a group c10d
    calls from C++ such as gloo's: see _FUNCOL_OPS) and what a program calls on a group
    directly, and never an op torch refused in its argument checks. ``all_gather_single``
    and ``all_gather_into_tensor`` are one op (``all_gather_into_tensor``), and so are
    ``reduce_scatter_single`` and ``reduce_scatter_tensor`` (``reduce_scatter_tensor``).
    Point-to-point ops (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) are
    recorded in the group's ``send`` / ``recv`` / ``recv_anysource``; ``dist.isend`` and
    ``dist.irecv`` stay torch's own, so ``dist.P2POp`` works with ops made at any time. The
    ``torch.distributed`` collective functions are wrapped too, to complete a synchronous
    op's entry on return. Also starts the timeout watchdog and (from the main thread) the
    ``SIGUSR1`` dump. Idempotent; undo with :func:`uninstall`.
    """
    global _recorder
    rec = recorder or get_recorder()
    # first: a bad timeout (TORCHPORT_FR_TIMEOUT) raises before anything is patched (raised
    # after the patching, it left the functions recorded but no watchdog and no signal dump)
    running = rec._watchdog is not None and rec._watchdog.is_alive()
    rec.start_watchdog()
    if not running and rec._watchdog is not None:  # (started here: uninstall() stops it)
        _started["watchdogs"].append(rec)
    _recorder = rec
    try:
        _hook_process_groups(rec, again=True)
        _hook_subclasses(rec)
        _hook_functional()
        for name in _PATCHED:
            if name in vars(dist):  # (all of them in torch 2.13)
                _patch(dist, name, functools.partial(_wrap, name, rec=rec))
        _patch(dist, "destroy_process_group", functools.partial(_wrap_destroy, rec=rec))
        _patch(dist, "batch_isend_irecv", functools.partial(_wrap_batch, rec=rec))
        _patch(dist.Work, "wait", functools.partial(_wrap_wait, rec=rec))
    except BaseException:  # (nothing left half-patched)
        uninstall()
        raise
    if signal_dump and threading.current_thread() is threading.main_thread():
        if "sock" not in _sig_state:  # (enabled here: uninstall() disables it)
            _started["signal"] = True
        enable_signal_dump(recorder=rec)
    return rec


# what install() started, which uninstall() stops: the recorders whose watchdog it started,
# and whether it enabled the signal dump (each install() / uninstall() cycle left a watchdog
# thread running, and the signal still dumped with the program's own handler replaced)
_started: dict[str, Any] = {"watchdogs": [], "signal": False}


def uninstall() -> None:
    """Restore the ``torch.distributed`` functions and methods :func:`install` replaced, stop
    the watchdogs it started and disable the signal dump it enabled (the signal's earlier
    handler back; see :func:`disable_signal_dump`, from the main thread only)."""
    for rec in _started["watchdogs"]:
        rec.stop()
    _started["watchdogs"] = []
    if _started["signal"] and disable_signal_dump():
        _started["signal"] = False
    for (owner, name), fn in _originals.items():
        setattr(owner, name, fn)
    hook = _subclass_hook[0]
    if hook is not None and vars(dist.ProcessGroup).get("__init_subclass__") is hook:
        del dist.ProcessGroup.__init_subclass__
    _subclass_hook[0] = None
    _unhook_functional()
    _originals.clear()
    _wrappers.clear()
    _hooked.clear()
    _futureless.clear()
    _group_names.clear()
