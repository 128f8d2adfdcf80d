"""Helpers for the distributed tests: actor processes forked from a preloaded forkserver.

Each actor runs commands sent by the test (through a pipe) and answers with plain tuples, so a
test can drive several real processes step by step, kill or stop any of them, and every wait has a
hard timeout. :class:`Actors` kills every child in ``close()`` (use it as a context manager).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    ["tests.ft_actors", "torchport.distributed", "torchport.demo.ft_worker"]
)


def small_manager(lh: Any, secret: bytes, rid: str, **kw: Any) -> Any:
    """An in-process ft ``Manager`` of replica ``rid`` at lighthouse ``lh``, with a 2-float state
    and 5 s timeouts on gloo; ``kw`` overrides any of those (``backend=``, ``lighthouse=``...)."""
    from torchport.distributed.ft import Manager

    w = torch.zeros(2)

    def load(state: Any) -> None:
        w.copy_(state["w"])

    return Manager(
        replica_id=rid,
        state_dict=lambda: {"w": w},
        load_state_dict=load,
        secret=secret,
        **{"lighthouse": lh.address, "backend": "gloo", "timeout": 5.0, "quorum_timeout": 5.0} | kw,
    )


def _actor(conn: Any, idx: int) -> None:
    torch.set_num_threads(1)
    state: dict[str, Any] = {"idx": idx}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd == "exit":
            conn.send(("ok", None))
            os._exit(0)
        try:
            conn.send(("ok", COMMANDS[cmd](state, *args)))
        except Exception as e:
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))


class Actors:
    """``n`` actor processes; ``call(i, cmd, *args)`` / ``call_all`` with hard timeouts."""

    def __init__(self, n: int) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for i in range(n):
            self.add(i)

    def add(self, idx: int) -> int:
        a, b = _CTX.Pipe()
        p = _CTX.Process(target=_actor, args=(b, idx), daemon=True)
        p.start()
        if idx < len(self.procs):
            self.procs[idx], self.conns[idx] = p, a
        else:
            self.procs.append(p)
            self.conns.append(a)
        return idx

    def send(self, i: int, cmd: str, *args: Any) -> None:
        self.conns[i].send((cmd, args))

    def recv(self, i: int, timeout: float = 30.0) -> Any:
        if not self.conns[i].poll(timeout):
            raise TimeoutError(f"actor {i} did not answer within {timeout} s")
        status, value = self.conns[i].recv()
        return status, value

    def call(self, i: int, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self.send(i, cmd, *args)
        status, value = self.recv(i, timeout)
        if status != "ok":
            raise RuntimeError(f"actor {i} {cmd} failed: {value[0]}: {value[1]}\n{value[2]}")
        return value

    def call_all(
        self,
        ranks: list[int],
        cmd: str,
        args: list[tuple[Any, ...]] | None = None,
        timeout: float = 30.0,
    ) -> list[Any]:
        for k, i in enumerate(ranks):
            self.send(i, cmd, *(args[k] if args else ()))
        return [self.recv(i, timeout) for i in ranks]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to actor ``i``; for SIGSTOP, return once the process shows as stopped
        (at most 5 s), so what the test does next meets a stopped peer."""
        pid = self.procs[i].pid
        assert pid is not None
        os.kill(pid, sig)
        if sig != signal.SIGSTOP:
            return
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            with open(f"/proc/{pid}/stat") as f:  # state: the field after "(comm)"
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def __enter__(self) -> Actors:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- commands -------------------------------------------------------------------------------
def c_init_reconf(st: dict[str, Any], heartbeat: float = 0.05, backend: str = "torchport") -> str:
    from torchport.distributed.reconfigure import ReconfigurableGroup

    if "g" in st:
        st["g"].close()
    st["g"] = ReconfigurableGroup(heartbeat=heartbeat, backend=backend)
    return st["g"].get_reconfigure_handle()


def c_group_info(st: dict[str, Any]) -> Any:
    g = st["g"]
    mesh = getattr(g, "_mesh", None)
    return (
        type(g.pg).__name__,
        getattr(g.pg, "transport", None),
        len(mesh.peers) if mesh is not None else None,
        g.phases.get("new_connections"),
    )


def c_handle(st: dict[str, Any]) -> str:
    from torchport.distributed import _get_reconfigure_handle

    return _get_reconfigure_handle(st["g"])


def c_reconf(
    st: dict[str, Any], uuid: int, handles: Any, timeout: float = 10.0, hints: Any = None
) -> Any:
    from datetime import timedelta

    from torchport.distributed import ReconfigureError, _reconfigure

    t0 = time.perf_counter()
    try:
        _reconfigure(uuid, handles, st["g"], timeout=timedelta(seconds=timeout), hints=hints).wait()
    except ReconfigureError as e:
        return ("error", str(e), time.perf_counter() - t0)
    g = st["g"]
    return ("ok", g.rank(), g.size(), time.perf_counter() - t0, g.phases, t0)


def c_allreduce(st: dict[str, Any], value: float) -> Any:
    from torchport.distributed import CommError

    t = torch.full((5,), float(value))
    t0 = time.perf_counter()
    try:
        st["g"].allreduce(t)
    except CommError as e:
        return ("error", type(e).__name__, str(e), time.perf_counter() - t0, time.time())
    return ("ok", t.tolist())


def c_allreduce_late(
    st: dict[str, Any], value: float, timeout: float, delay: float, linger: float
) -> Any:
    """Allreduce after ``delay`` s under a ``timeout`` s group limit; on failure, the tensor
    ``linger`` s later (a timed-out op must never write it afterwards)."""
    from datetime import timedelta

    from torchport.distributed import CommError

    time.sleep(delay)
    st["g"].timeout = timedelta(seconds=timeout)
    t = torch.full((5,), float(value))
    try:
        st["g"].allreduce(t)
    except CommError as e:
        time.sleep(linger)
        return ("error", type(e).__name__, t.tolist())
    return ("ok", t.tolist())


def c_init_dist(st: dict[str, Any], path: str, rank: int, world: int, backend: str = "gloo") -> int:
    import torch.distributed as dist

    import torchport.distributed  # noqa: F401  (registers the torchport backend)

    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    return dist.get_rank()


def c_window_script(
    st: dict[str, Any], ops: list[tuple[Any, ...]], init: list[float], transport: str
) -> Any:
    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank = dist.get_rank()
    win = _new_window(torch.tensor(init, dtype=torch.float64) + rank, transport=transport)
    got = []
    works: list[Any] = []
    for op in ops:
        kind, src = op[0], op[1]
        if kind == "fence":
            win.fence()
            continue
        if src != rank:
            continue
        if kind == "put":  # async: completed by the next fence (a Work on tcp)
            works.append(win.put(torch.tensor(op[2], dtype=torch.float64), op[3], op[4], True))
        elif kind == "acc":
            win.accumulate(torch.tensor(op[2], dtype=torch.float64), op[3], op[4])
        elif kind == "get":
            got.append(win.get(op[2], op[3], op[4]).tolist())
    win.fence()
    assert all(w.is_completed() and w.wait() for w in works)
    final = win.local.reshape(-1).tolist()
    mapped = (
        win.map_remote_tensor((rank + 1) % win.size).tolist() if win.transport == "shm" else None
    )
    win.fence()
    win.close()
    return final, got, mapped


def c_window_signal(st: dict[str, Any], rounds: int, transport: str) -> Any:
    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    win = _new_window(torch.zeros(rounds, dtype=torch.int64), transport=transport)
    seen = []
    for i in range(rounds):
        if rank == 0:
            for r in range(1, world):
                win.put(torch.tensor([i + 1]), r, i)
                win.signal(r)
        else:
            win.wait_signal(0, timeout=10)
            seen.append(int(win.local[i]))
    win.fence()
    win.close()
    return seen


def c_window_errors(st: dict[str, Any]) -> list[str]:
    import torch.distributed as dist

    from torchport.distributed import WindowError, _new_window

    win = _new_window(torch.zeros(6))
    msgs = []
    for fn in (
        lambda: win.put(torch.zeros(4), dst_rank=1, target_offset_nelems=4),
        lambda: win.put(torch.zeros(2, dtype=torch.int32), dst_rank=1),
        lambda: win.get(src_rank=9),
        lambda: win.wait_signal((dist.get_rank() + 1) % dist.get_world_size(), timeout=0.05),
        lambda: win.tensor_register(torch.zeros(2)),
        lambda: win.get(src_rank=1, offset_nelems=3, nelems=-1),
    ):
        try:
            fn()
            msgs.append("no error")
        except WindowError as e:
            msgs.append(str(e))

    def fail() -> None:
        raise WindowError("an async request failed")

    peer = (dist.get_rank() + 1) % dist.get_world_size()
    win._issue(peer, fail, True)  # a failed async request, then a later one: fence() raises it
    win._issue(peer, lambda: None, False)
    try:
        win.fence()
        msgs.append("no error")
    except WindowError as e:
        msgs.append(str(e))
    try:  # an offset past the end, to the end of the tensor
        win.get(src_rank=1, offset_nelems=9)
        msgs.append("no error")
    except WindowError as e:
        msgs.append(str(e))
    win.fence()
    win.close()
    return msgs


def c_window_threads(st: dict[str, Any], threads: int, rounds: int) -> Any:
    """Ranks 0 and 1 accumulate from ``threads`` threads each into the last rank's tensor over
    shared memory; the last rank returns the smallest element after the fence."""
    import threading

    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 19
    win = _new_window(torch.zeros(n), transport="shm")
    if rank < 2:

        def work() -> None:
            for _ in range(rounds):
                win.accumulate(torch.ones(n), world - 1)

        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    win.fence()
    low = float(win.local.min()) if rank == world - 1 else None
    win.fence()
    win.close()
    return low


def c_window_tcp_addr(st: dict[str, Any], addr: str) -> Any:
    """A tcp window bound to ``addr``: its published addresses, a stranger's fate, a put."""
    import torch.distributed as dist

    from torchport import config
    from torchport.distributed import AuthError, CommError, _new_window
    from torchport.distributed._control import connect, default_secret

    rank = dist.get_rank()
    with config.override(dist_addr=addr):
        win = _new_window(torch.zeros(4), transport="tcp")
    stranger = "accepted"
    try:  # the job-wide default secret does not open a window server
        connect(win._addrs[rank], default_secret(), "window", timeout=5).close()
    except (AuthError, CommError) as e:
        stranger = f"rejected: {type(e).__name__}"
    win.put(torch.full((2,), float(rank + 1)), (rank + 1) % win.size, 1)
    win.fence()
    out = (list(win._addrs), stranger, win.local.tolist())
    win.fence()
    win.close()
    return out


def c_window_edges(st: dict[str, Any], transport: str) -> Any:
    """NumPy / tensor integers as ranks, offsets and counts; a float or bool offset; a put and
    an accumulate to this rank from window memory overlapping the target range."""
    import numpy as np
    import torch.distributed as dist

    from torchport.distributed import WindowError, _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    # Any: the calls below pass NumPy integers (accepted) and floats (refused) on purpose
    win: Any = _new_window(torch.arange(6.0) + 10 * rank, transport=transport)
    win.put(torch.tensor([-1.0, -2.0]), np.int64(peer), np.int32(1))
    win.fence()
    got = win.get(np.int64(peer), torch.tensor(1), np.uint8(3)).tolist()
    errors = []
    for fn in (
        lambda: win.put(torch.ones(1), peer, 1.0),
        lambda: win.get(peer, 1.5),
        lambda: win.accumulate(torch.ones(1), peer, True),
        lambda: win.get(np.float64(1.0)),
    ):
        try:
            fn()
            errors.append("no error")
        except WindowError as e:
            errors.append(str(e))
    win.fence()
    win.put(win.local[0:4], rank, 2)  # memmove: the source is read before the target is written
    win.accumulate(win.local[1:3], rank, 2)
    win.fence()
    out = (got, errors, win.local.tolist())
    win.fence()
    win.close()
    return out


def c_window_dereg(st: dict[str, Any], transport: str) -> Any:
    """Deregister with views still held: what the views read, whether this process still maps
    the tensors' files, the errors of later operations, and a second registration's get."""
    import torch.distributed as dist

    from torchport.distributed import WindowError, _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    win = _new_window(torch.arange(4.0) + 1 + rank, transport=transport)
    held = [win.local[1:]] + ([win.map_remote_tensor(peer)] if transport == "shm" else [])

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(f"{win._name}-d" in line for line in f)

    before = mapped()
    win.fence()
    win.tensor_deregister()
    after = mapped()
    errors = []
    for fn in (lambda: win.get(peer), lambda: win.put(torch.ones(1), peer), lambda: win.local):
        try:
            fn()
            errors.append("no error")
        except WindowError as e:
            errors.append(str(e))
    views = [v.tolist() for v in held]
    win.tensor_register(torch.full((2,), 10.0 + rank))
    again = win.get(peer).tolist()
    win.fence()
    win.close()
    return before, after, errors, views, again


def c_window_close_held(st: dict[str, Any], transport: str) -> Any:
    """Close and drop a window while holding ``local`` and (shm) a peer's view; what they read
    after a barrier (every rank has closed, its window collected)."""
    import gc

    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    win = _new_window(torch.full((5,), 1.0 + rank), transport=transport)
    held = [win.local] + ([win.map_remote_tensor((rank + 1) % world)] if transport == "shm" else [])
    win.fence()
    win.close()
    del win
    gc.collect()
    dist.barrier()
    return [v.tolist() for v in held]


def c_window_after_subgroup(st: dict[str, Any], transport: str) -> Any:
    """A window on the subgroup of ranks 0 and 1 (rank 2 joins none), then one on the world:
    what each rank gets from the next rank."""
    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        first = _new_window(torch.zeros(2), group=sub, transport=transport)
        first.fence()
        first.close()
    win = _new_window(torch.zeros(3) + rank, transport=transport)
    got = win.get((rank + 1) % world).tolist()
    win.fence()
    win.close()
    return got


def c_window_hosts(st: dict[str, Any], hostname: str) -> Any:
    """The transport an ``auto`` window picks while this rank's hostname reads ``hostname``."""
    import socket
    from unittest import mock

    from torchport.distributed import _new_window

    with mock.patch.object(socket, "gethostname", return_value=hostname):
        win = _new_window(torch.zeros(2))
    picked = win.transport
    win.fence()
    win.close()
    return picked


def c_window_grad(st: dict[str, Any], transport: str) -> Any:
    """A window registered from, then put and accumulated into from, tensors that require grad:
    whether ``local`` and a ``get`` require grad, and ``local``'s values."""
    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank = dist.get_rank()
    win = _new_window(torch.zeros(4, requires_grad=True) + rank, transport=transport)
    x = torch.ones(2, requires_grad=True)
    win.put(x, rank, 0)
    win.accumulate(x, rank, 2)
    win.fence()
    out = (win.local.requires_grad, win.get(rank).requires_grad, win.local.tolist())
    win.fence()
    win.close()
    return out


def c_window_after_close(st: dict[str, Any], transport: str) -> Any:
    """The errors (type: message) of window operations after ``close()``."""
    import torch.distributed as dist

    from torchport.distributed import _new_window

    peer = (dist.get_rank() + 1) % dist.get_world_size()
    win = _new_window(torch.zeros(2), transport=transport)
    win.fence()
    win.close()
    errors = []
    for fn in (
        lambda: win.signal(peer),
        lambda: win.wait_signal(peer, 0.1),
        lambda: win.get(peer),
        lambda: win.put(torch.ones(1), peer),
        lambda: win.map_remote_tensor(peer),
        lambda: win.tensor_register(torch.zeros(2)),
        win.fence,
        win.tensor_deregister,
    ):
        try:
            fn()
            errors.append("no error")
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def c_window_on_group(st: dict[str, Any]) -> Any:
    """A window of [rank, rank] on the actor's reconfigurable group, kept as ``st["rwin"]``."""
    from torchport.distributed import _new_window

    g = st["g"]
    st["rwin"] = _new_window(torch.full((2,), float(g.rank())), group=g)
    return st["rwin"].transport


def c_window_on_group_use(st: dict[str, Any], dst: int) -> Any:
    """Put 99 into ``dst`` and fence on the kept window (or the error), then its ``local``."""
    win = st["rwin"]
    try:
        win.put(torch.full((2,), 99.0), dst)
        win.fence()
        got = "ok"
    except Exception as e:
        got = f"{type(e).__name__}: {e}"
    return got, win._local.tolist()


def c_window_peer_fails_mapping(st: dict[str, Any], which: str) -> Any:
    """Ranks 0 and 1 make a window on a group with a 4 s timeout, and rank 1 cannot map its
    peer's file of kind ``which`` ("s": the signal counters, at creation; "d": the registered
    tensor): the type of each rank's error."""
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from torchport.distributed import window

    rank = dist.get_rank()
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=4))
    if rank == 2:
        return None
    real = window._shm_open

    def failing(name: str, nbytes: int) -> Any:
        if rank == 1 and name.split("-")[3].startswith(which):  # tpwin-<id>-<n>-<kind>...
            raise OSError("injected: cannot map")
        return real(name, nbytes)

    with mock.patch.object(window, "_shm_open", failing):
        try:
            window._new_window(torch.zeros(4), group=sub, transport="shm")
        except Exception as e:
            return type(e).__name__
    return "no error"


def c_window_refused_leak(st: dict[str, Any], transport: str) -> Any:
    """Three windows whose tensor every rank refuses (9 dims): (open fds before, after, window
    server threads left)."""
    import gc
    import threading

    from torchport.distributed import WindowError, _new_window

    gc.collect()  # (earlier tests' windows: their fds go with them)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with contextlib.suppress(WindowError):
            _new_window(torch.zeros([1] * 9), transport=transport)
    gc.collect()
    threads = sum("window" in t.name for t in threading.enumerate())
    return before, len(os.listdir("/proc/self/fd")), threads


def c_track_shm(st: dict[str, Any]) -> None:
    """From now on record the names of the ``/dev/shm`` files this process's windows create
    (``shm_made``): a test then looks for leftovers among its own windows' files only (other
    windows on the host, of parallel tests, come and go)."""
    from torchport.distributed import window

    made: list[str] = st.setdefault("shm_made", [])
    real = window._shm_create
    if getattr(real, "tracked", False):
        return

    def tracking(name: str, nbytes: int) -> Any:
        made.append(name)
        return real(name, nbytes)

    tracking.tracked = True  # type: ignore[attr-defined]
    window._shm_create = tracking


def c_shm_made(st: dict[str, Any]) -> list[str]:
    """The names recorded since the last call (see :func:`c_track_shm`)."""
    made = st.setdefault("shm_made", [])
    names = list(made)
    made.clear()
    return names


def c_window_nonmember(st: dict[str, Any]) -> Any:
    """Rank 2 asks for a window on the group of ranks 0 and 1: its error."""
    import torch.distributed as dist

    from torchport.distributed import _new_window

    sub = dist.new_group([0, 1])
    if dist.get_rank() != 2:
        return None
    try:
        _new_window(torch.zeros(2), group=sub)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def c_window_bad_register(st: dict[str, Any], bad: str = "dims") -> Any:
    """Rank 1 registers a tensor the window cannot take (``bad``: "dims" 9 dims, "sparse" a
    sparse COO tensor, "nospace" one whose file cannot be allocated, ENOSPC), the others a
    valid one: each rank's error; then every rank registers [rank] and gets the next rank's."""
    import errno
    from unittest import mock

    import torch.distributed as dist

    from torchport.distributed import WindowError, _new_window, window

    rank, world = dist.get_rank(), dist.get_world_size()
    win = _new_window()
    t = torch.zeros(2)
    if rank == 1 and bad == "dims":
        t = torch.zeros([1] * 9)
    elif rank == 1 and bad == "sparse":
        t = torch.zeros(4).to_sparse()
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    nospace = (
        mock.patch.object(window.os, "posix_fallocate", side_effect=full)
        if rank == 1 and bad == "nospace"
        else contextlib.nullcontext()
    )
    with nospace:
        try:
            win.tensor_register(t)
            err = "no error"
        except WindowError as e:
            err = str(e)
    win.tensor_register(torch.full((1,), float(rank)))
    got = win.get((rank + 1) % world).tolist()
    win.fence()
    win.close()
    return err, got


def c_window_open(st: dict[str, Any], transport: str, timeout_s: float | None) -> Any:
    """A window of 4 zeros + rank kept in the actor's state (``window_get``, ``window_close``)."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchport.distributed import _new_window

    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    st["win"] = _new_window(torch.zeros(4) + rank, transport=transport, timeout=timeout)
    return st["win"].timeout_s


def c_window_get(st: dict[str, Any], src: int) -> Any:
    """``get`` from ``src``: its values, or the error's type and message; and the time taken."""
    t0 = time.monotonic()
    try:
        got: Any = st["win"].get(src).tolist()
    except Exception as e:
        got = (type(e).__name__, str(e))
    return got, time.monotonic() - t0


def c_window_file_lock(st: dict[str, Any], dst: int, take: bool) -> None:
    """Take (or release) the write lock on ``dst``'s window file, as this rank's accumulate to
    ``dst`` holds it while it adds (a rank stopped there keeps it)."""
    import fcntl

    fcntl.lockf(st["win"]._remote_fds[dst], fcntl.LOCK_EX if take else fcntl.LOCK_UN)


def c_window_accumulate(st: dict[str, Any], dst: int) -> Any:
    """``accumulate`` ones into ``dst``: None, or the error's type and message; and the time."""
    t0 = time.monotonic()
    try:
        got: Any = st["win"].accumulate(torch.ones(4), dst)
    except Exception as e:
        got = (type(e).__name__, str(e))
    return got, time.monotonic() - t0


def c_window_async_puts(st: dict[str, Any], dst: int, n: int) -> Any:
    """``n`` async puts to ``dst``, then a wait on each: their errors' types (None: done) and
    the seconds from the first put until the last one ended."""
    t0 = time.monotonic()
    works = [st["win"].put(torch.ones(4), dst, async_op=True) for _ in range(n)]
    errors: list[str | None] = []
    for w in works:
        try:
            w.wait()
            errors.append(None)
        except Exception as e:
            errors.append(type(e).__name__)
    return errors, time.monotonic() - t0


def c_window_fence_close(st: dict[str, Any]) -> str | None:
    """``fence()`` (the type of the error it raises, or None), then ``close()``."""
    try:
        st["win"].fence()
        error = None
    except Exception as e:
        error = type(e).__name__
    st["win"].close()
    return error


def c_window_close(st: dict[str, Any]) -> None:
    st["win"].fence()
    st["win"].close()


def c_fr_collectives(st: dict[str, Any], dump_dir: str, plan: str) -> Any:
    import torch.distributed as dist

    from torchport.distributed import flight_recorder as fr

    rank = dist.get_rank()
    rec = fr.FlightRecorder(dump_dir=dump_dir)
    fr.install(rec, signal_dump=False)
    rec.start_watchdog(timeout_s=0.5)
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    if plan == "hang" and rank == 1:
        time.sleep(2.0)  # never enters the next collective before the others' watchdogs dump
        rec.dump("test: rank 1 skipped")
        return "skipped"
    if plan == "mismatch" and dist.get_backend() == "torchport":
        # torchport detects the mismatch itself: both ranks' calls fail with a typed error and
        # the recorder dumps the errored entries
        from torchport.distributed import CollectiveMismatchError

        try:
            dist.all_reduce(torch.ones(8 if rank == 1 else 4))
        except CollectiveMismatchError as err:
            return f"mismatch: {err}"
        return "no error"
    if plan == "mismatch":
        # gloo terminates the process on a size mismatch, so record the mismatched call (as the
        # wrapper does) and dump instead of handing it to gloo
        e = rec.record("all_reduce", "default", [torch.ones(8 if rank == 1 else 4)], [0, 1])
        rec.started(e)
        rec.dump("test: staged mismatch")
        return "staged"
    # a group and async_op passed by position, point-to-point ops and a gather whose list only
    # the root has: recorded where they belong, and no false mismatch for the analyzer
    if plan != "clean":  # (rank 1 of "hang" has left: no more collectives for rank 0)
        work = dist.all_reduce(torch.ones(4), async_op=True)
        deadline = time.monotonic() + 1.5
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        rec.dump("test: end")
        return "done"
    sub = dist.new_group([0, 1])
    dist.all_reduce(x, dist.ReduceOp.SUM, sub)
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    dist.gather(x, [torch.empty(4) for _ in range(2)] if rank == 0 else None, 0)
    work = dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM, None, True)
    work.wait()
    rec.dump("test: end")
    return [(e["op"], e["group"], e["state"]) for e in rec.snapshot()["entries"]]


def c_fr_p2p(st: dict[str, Any], dump_dir: str, plan: str) -> Any:
    """Point-to-point ops under ``install()``: isend / irecv, batch_isend_irecv (with a P2POp
    made before install, and the batch reused after uninstall), send / recv; ``plan="hang"``:
    rank 1 waits in an irecv that rank 0 never sends. Returns (op, seq, state, peer) per entry."""
    import torch.distributed as dist

    from torchport.distributed import flight_recorder as fr

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    early = dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.zeros(2), peer)
    rec = fr.FlightRecorder(64, dump_dir=dump_dir)
    fr.install(rec, signal_dump=False)
    try:
        t = torch.zeros(3)
        work = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)
        assert work is not None
        work.wait()
        ops = [
            dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer),
            dist.P2POp(dist.irecv if rank == 0 else dist.isend, torch.zeros(5), peer),
            early,
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dist.all_reduce(t)
        if plan == "hang":
            if rank == 1:
                # rank 0 never sends it (the actor is killed with it pending)
                st["stuck"] = dist.irecv(torch.zeros(4), 0)
                time.sleep(0.2)
                rec.dump("test: waiting in irecv")
            else:
                rec.dump("test: rank 0 done")
            return "dumped"
        rec.dump("test: end")
        got = [(e[fr._OP], e[fr._SEQ], e[fr._STATE], e[fr._PEER]) for e in rec.entries()]
    finally:
        fr.uninstall()
        rec.stop()
    for w in dist.batch_isend_irecv(ops):  # P2POps made under install, used after it
        w.wait()
    return got


def c_fr_restart(st: dict[str, Any], dump_dir: str, path: str, backend: str) -> Any:
    """The default group destroyed and re-created; rank 1 meanwhile "restarted" (a fresh
    recorder and caches, as a new process has), rank 0 survived with its recorder."""
    import torch.distributed as dist

    from torchport.distributed import flight_recorder as fr

    rank = dist.get_rank()
    rec = fr.FlightRecorder(64, dump_dir=dump_dir)
    fr.install(rec, signal_dump=False)
    try:
        x = torch.ones(2)
        for _ in range(3):
            dist.all_reduce(x)
        dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=2)
        if rank == 1:
            fr.uninstall()
            rec = fr.FlightRecorder(64, dump_dir=dump_dir)
            fr.install(rec, signal_dump=False)
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        rec.dump("test: end")
        return [(e[fr._OP], e[fr._SEQ], e[fr._INC]) for e in rec.entries()]
    finally:
        fr.uninstall()
        rec.stop()


def c_gloo_rebuild(st: dict[str, Any], port: int, rank: int, size: int, tag: str) -> float:
    """Anchor for reconfigure: build a plain gloo group over a TCPStore prefix (no validation)."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchport.distributed._gloo import gloo_group

    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    st.setdefault("old", []).append(gloo_group(dist.PrefixStore(tag, store), rank, size, 30.0))
    return time.perf_counter() - t0


def c_serve_state(st: dict[str, Any], nbytes: int, ntensors: int) -> Any:
    from torchport.distributed._control import Server, default_secret, recv_msg
    from torchport.distributed.ft.transfer import send_state

    per = nbytes // ntensors // 4
    state = {f"t{i}": torch.randn(per) for i in range(ntensors)}

    def handle(conn: Any) -> None:
        recv_msg(conn)
        send_state(conn, {"user": state, "step": 0})

    st["srv"] = Server(handle, secret=default_secret(), role="heal")
    return list(st["srv"].address)


def c_bcast_bench(st: dict[str, Any], nbytes: int, reps: int) -> float:
    import torch.distributed as dist

    t = torch.zeros(nbytes // 4)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def c_step_bench(st: dict[str, Any], mode: str, lighthouse: Any, nbytes: int, steps: int) -> float:
    """Seconds per step: plain gloo allreduce, FR-recorded, or the FT manager's full step."""
    import torch.distributed as dist

    from torchport.distributed import flight_recorder as fr

    t = torch.ones(max(1, nbytes // 4))
    if mode == "manager":
        from torchport.distributed.ft import Manager

        if "mgr" not in st:
            st["mgr"] = Manager(
                lighthouse=tuple(lighthouse),
                replica_id=f"b{dist.get_rank()}",
                state_dict=lambda: {},
                load_state_dict=lambda s: None,
                init_sync=False,
            )
        mgr = st["mgr"]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            mgr.start_quorum()
            mgr.allreduce(t).wait()
            mgr.should_commit()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    if mode == "fr":
        fr.install(fr.FlightRecorder(), signal_dump=False)
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    finally:
        if mode == "fr":
            fr.uninstall()


class _PlainManager:
    """The manager's allreduce interface over a fixed group, and nothing else: the baseline of
    the manager-overhead benchmark (no quorum, no vote; every step commits)."""

    def __init__(self, pg: Any, n: int) -> None:
        self.pg, self.n = pg, n

    def start_quorum(self) -> None:
        return None

    def allreduce(self, tensor: torch.Tensor) -> Any:
        work = self.pg.allreduce([tensor])
        n = self.n

        class _W:
            def wait(self, timeout: float | None = None) -> bool:
                work.wait()
                tensor.div_(n)
                return True

        return _W()

    def should_commit(self) -> bool:
        return True


def c_step_overhead(
    st: dict[str, Any], lighthouse: Any, rid: str, model: str, blocks: int, per_block: int
) -> Any:
    """Seconds per DDP training step, plain allreduce vs the FT manager, in alternating blocks.

    Both loops are the same (``zero_grad`` → forward → backward with bucketed allreduce →
    ``step``) on the same torchport communicator; only the manager (quorum + commit vote) differs.
    """
    from torchport.demo.ft_worker import build_model, loss_of, make_batch
    from torchport.distributed.ft import DistributedDataParallel, Manager, OptimizerWrapper

    net = build_model(model, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    corpus = None
    if model == "gpt":
        from torchport.demo.data import load_corpus

        corpus = load_corpus(max_bytes=1 << 20).train

    def state() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    def load(s: dict[str, Any]) -> None:
        net.load_state_dict(s["model"])
        opt.load_state_dict(s["optim"])

    mgr = Manager(
        lighthouse=tuple(lighthouse),
        replica_id=rid,
        state_dict=state,
        load_state_dict=load,
        init_sync=True,
    )
    ddp = DistributedDataParallel(net, mgr, bucket_cap_mb=0.05 if model == "mlp" else 25.0)
    optim = OptimizerWrapper(mgr, opt)
    times: dict[str, list[float]] = {"plain": [], "manager": []}
    plain = None
    step = 0
    try:
        for b in range(2 * blocks + 1):
            mode = "manager" if b % 2 == 0 else "plain"
            if mode == "plain" and plain is None:
                plain = _PlainManager(mgr.process_group, mgr.num_participants())
            use: Any = mgr if mode == "manager" else plain
            ddp.manager = optim.manager = use
            for _ in range(per_block):
                t0 = time.perf_counter()
                optim.zero_grad()
                loss_of(model, ddp, make_batch(model, step, rid, corpus)).backward()
                optim.step()
                if b > 0:  # the first block warms up (and forms the group)
                    times[mode].append(time.perf_counter() - t0)
                step += 1
        m = mgr.metrics
        return times, m.quorums, m.group_builds, m.quorums_with_commit, m.vote_s / max(1, m.commits)
    finally:
        mgr.shutdown()


def c_cpu(st: dict[str, Any]) -> tuple[float, int, dict[str, int]]:
    """(CPU seconds of this process, all threads; live threads; threads per name prefix)."""
    import collections
    import threading

    names = collections.Counter(
        t.name.split("-")[0 if "Thread" in t.name else 1][:12] for t in threading.enumerate()
    )
    return time.process_time(), threading.active_count(), dict(names)


def c_threads(st: dict[str, Any]) -> dict[int, str]:
    """{native thread id: thread name} of this process (profiling per-thread CPU from outside)."""
    import threading

    return {t.native_id or 0: t.name for t in threading.enumerate()}


COMMANDS: dict[str, Callable[..., Any]] = {
    "allreduce_late": c_allreduce_late,
    "step_overhead": c_step_overhead,
    "cpu": c_cpu,
    "threads": c_threads,
    "gloo_rebuild": c_gloo_rebuild,
    "serve_state": c_serve_state,
    "bcast_bench": c_bcast_bench,
    "step_bench": c_step_bench,
    "init_reconf": c_init_reconf,
    "handle": c_handle,
    "group_info": c_group_info,
    "reconf": c_reconf,
    "allreduce": c_allreduce,
    "init_dist": c_init_dist,
    "window_script": c_window_script,
    "window_signal": c_window_signal,
    "window_errors": c_window_errors,
    "window_threads": c_window_threads,
    "window_tcp_addr": c_window_tcp_addr,
    "window_open": c_window_open,
    "window_dereg": c_window_dereg,
    "window_close_held": c_window_close_held,
    "window_after_subgroup": c_window_after_subgroup,
    "window_hosts": c_window_hosts,
    "window_grad": c_window_grad,
    "window_after_close": c_window_after_close,
    "window_on_group": c_window_on_group,
    "window_on_group_use": c_window_on_group_use,
    "window_peer_fails_mapping": c_window_peer_fails_mapping,
    "window_nonmember": c_window_nonmember,
    "window_bad_register": c_window_bad_register,
    "window_refused_leak": c_window_refused_leak,
    "track_shm": c_track_shm,
    "shm_made": c_shm_made,
    "window_edges": c_window_edges,
    "window_get": c_window_get,
    "window_file_lock": c_window_file_lock,
    "window_accumulate": c_window_accumulate,
    "window_async_puts": c_window_async_puts,
    "window_fence_close": c_window_fence_close,
    "window_close": c_window_close,
    "fr_collectives": c_fr_collectives,
    "fr_p2p": c_fr_p2p,
    "fr_restart": c_fr_restart,
}
