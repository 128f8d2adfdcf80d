"""Run a function on W real processes (forkserver) with a hard timeout; kill everything on failure.

``run_world(target, world, timeout=..., env=...)`` starts ``world`` spawned processes that each
call ``target(rank, world, init_method, *args)`` with a fresh ``file://`` rendezvous, collects
every rank's return value (or formatted exception) and raises if any rank failed, hung past the
timeout or left a ``/dev/shm/torchport-<pid>-*`` file behind.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import multiprocessing.forkserver as _mp_forkserver
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

# pid of the fork server run_world started (see run_world)
_server_pid: int | None = None


def _entry(
    target: Callable[..., Any], rank: int, world: int, init: str, args: tuple, env: dict, q: Any
) -> None:
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        import torchport.distributed  # noqa: F401  (registers the backend)

        q.put((rank, True, target(rank, world, init, *args)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:
            pass


def run_world(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Results of ``target`` on every rank, in rank order."""
    global _server_pid
    ctx = mp.get_context("forkserver")
    # The fork server imports torch once; every rank then starts in milliseconds. The server is
    # one per process: one started earlier by other code (the demo's replicas preload
    # torchport.demo.ft_worker) would fork our ranks from its own imports and settings -- the
    # pipelined-abort test then missed its bound on every run after test_cli's demo test --
    # so a server this harness did not start is stopped and ours started in its place.
    server: Any = _mp_forkserver._forkserver  # (private attributes: typeshed omits them)
    if server._forkserver_pid is not None and server._forkserver_pid != _server_pid:
        server._stop()
    ctx.set_forkserver_preload(["torch", "torchport.distributed", "dist_harness", "dist_workers"])
    q = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="tp-dist-")
    init = f"file://{tmp}/store"
    full_env = {"TORCHPORT_PROGRESS": "0", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, init, args, full_env, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    _server_pid = server._forkserver_pid
    pids = [p.pid for p in procs]
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results))} did not finish within {timeout} s"
                )
            try:
                rank, ok, val = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            results[rank] = (ok, val)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        q.close()
    leftovers = [f for pid in pids for f in glob.glob(f"/dev/shm/torchport-{pid}-*")]
    for f in leftovers:
        os.unlink(f)
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items())))
    assert not leftovers, f"shared-memory files left behind: {leftovers}"
    return [results[r][1] for r in range(world)]


@pytest.fixture(scope="module", autouse=True)
def stop_forkserver_after_module():
    """Leave no fork server behind once a test module is done (autouse in every module that
    imports it)."""
    yield
    import multiprocessing.forkserver as fs

    stop = getattr(fs._forkserver, "_stop", None)
    if stop is not None:
        stop()


def raised(fn: Callable[[], Any]) -> tuple[str, str, float]:
    """(type, message, seconds) of what ``fn`` raised, the type that of its cause where it has
    one (an error-state error's); empty strings if it returned."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        return type(cause).__name__, str(e), time.monotonic() - start
    return "", "", time.monotonic() - start
