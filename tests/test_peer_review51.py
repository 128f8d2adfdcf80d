"""Review 51: what still waited for a rank that left the job (its goodbye was read).

- A collective on a shared-memory arena that needed a rank that left waited for the group
  timeout (20 s). A peer that reads a rank's goodbye now marks it *gone* in the arena: a step
  waiting for it fails at once with :class:`PeerLeftError` naming it, on every rank in the
  step, and the group is failed.
- An any-source ``recv`` stayed pending after every rank that could send it had left; it now
  fails with :class:`PeerLeftError` then (while one sender is left it stays pending).
- ``destroy_process_group()`` and the process's exit waited ``LEAVE_S`` (2 s) for a stopped
  (SIGSTOP'd) peer to end its side of the connection; once the peer's host acknowledged the
  goodbye the wait is now ``LEAVE_SETTLED_S`` (0.2 s).
- :class:`PeerLeftError` lives in ``errors`` with the other error types.

The arena cases run in this process (one mapping per rank); the job-level ones run real
processes (``run_world``: forkserver, loopback, a hard timeout, every child killed at the end).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import raised as _error  # (what a call raised, and when)
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed.transport_shm import COPY, GONE, SHM_DIR, ShmArena, StepError

TIMEOUT = datetime.timedelta(seconds=20)


def test_peer_left_error_lives_in_errors_and_is_the_public_one():
    from torchport.distributed import PeerLeftError, RemoteError, errors, transport_tcp

    assert errors.PeerLeftError is PeerLeftError is transport_tcp.PeerLeftError
    assert issubclass(PeerLeftError, RemoteError)


# -- the arena: a step waiting for a rank marked gone --------------------------------------
@pytest.fixture
def arenas() -> Iterator[list[ShmArena]]:
    path = os.path.join(SHM_DIR, f"torchport-test-{os.getpid()}-gone")
    made = [ShmArena(path, 2, 0, 8192, create=True)]
    made.append(ShmArena(path, 2, 1, 8192, create=False))
    os.unlink(path)
    try:
        yield made
    finally:
        for a in made:
            a.close()


def _both(fns: list[Callable[[], Any]]) -> None:
    """Run rank 0's and rank 1's calls at once (rank 0 on a thread)."""
    errors: list[BaseException] = []

    def run0() -> None:
        try:
            fns[0]()
        except BaseException as e:  # (reported below)
            errors.append(e)

    t = threading.Thread(target=run0)
    t.start()
    try:
        fns[1]()
    finally:
        t.join(10)
    assert not errors and not t.is_alive()


def _step(a: ShmArena, epoch: int, timeout_s: float = 20.0) -> torch.Tensor:
    """A step: publish 8 floats of the rank's number, read the other rank's."""
    mine, theirs = torch.full((8,), float(a.rank)), torch.zeros(8)
    reads = [(1 - a.rank, 0, theirs.data_ptr(), 32, COPY)]
    a.step(epoch, (epoch, 1, 32, 0), [(mine.data_ptr(), 32)], reads, 0, 0, timeout_s)
    return theirs


def _allreduce(a: ShmArena, epoch: int, nbytes: int) -> None:
    buf = torch.ones(nbytes // 4)
    a.allreduce(epoch, (epoch, 1, nbytes), buf.data_ptr(), nbytes, 4, 8192, 0, 0, 20.0)


def _alltoall(a: ShmArena, epoch: int) -> None:
    z = (0, 0)
    a.alltoall_sizes(epoch, (epoch, 8, 0, 0), z, z, z, z, 0, COPY, 20.0)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda a, e: _step(a, e), id="step"),
        pytest.param(lambda a, e: _allreduce(a, e, 4096), id="allreduce-small"),
        pytest.param(lambda a, e: _allreduce(a, e, 1 << 16), id="allreduce-pipelined"),
        pytest.param(_alltoall, id="alltoall-sizes"),
    ],
)
def test_a_step_waiting_for_a_rank_marked_gone_fails_at_once_naming_it(arenas, call):
    """Rank 0 finished step 1 and left: rank 1's step 2 -- whose prewait for step 1 it already
    satisfied -- fails with GONE naming rank 0 at once, not at its 20 s timeout (before: no
    gone word; the wait ran to the deadline)."""
    a0, a1 = arenas
    _both([lambda: _step(a0, 1), lambda: _step(a1, 1)])
    a0.mark_gone(0)
    start = time.monotonic()
    with pytest.raises(StepError) as info:
        call(a1, 2)
    assert time.monotonic() - start < 2.0
    assert info.value.status == GONE and info.value.detail[0] == 0
    assert a1.abort_word() == 0  # (the arena only says who left; the group decides the rest)


def test_a_rank_that_finished_its_step_before_it_left_completes_it_for_the_peer(arenas):
    """Rank 0 arrives at step 2 and is marked gone before rank 1 takes step 2: rank 1 still
    reads what rank 0 published there (only a word short of its target fails)."""
    a0, a1 = arenas
    _both([lambda: _step(a0, 1), lambda: _step(a1, 1)])
    got: list[torch.Tensor] = []

    def rank1() -> None:
        time.sleep(0.05)  # (rank 0 arrives first, waiting for rank 1)
        got.append(_step(a1, 2))

    def rank0() -> None:
        _step(a0, 2)
        a0.mark_gone(0)

    _both([rank0, rank1])
    assert got[0].tolist() == [0.0] * 8
    a1.close()
    a1.mark_gone(0)  # (an unmapped arena: nothing to mark, no crash)


# -- real processes ------------------------------------------------------------------------
def _wait_file(path: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _shm_leaver_job(rank: int, world: int, init: str, how: str) -> dict[str, Any]:
    """Ranks 1 and 2 start an all_reduce while rank 0 leaves the job without it: by
    destroy_process_group (its group closes, then its mesh says goodbye), or as at its exit
    (the mesh says goodbye, the group stays open)."""
    from torchport.distributed import groups

    base = init.removeprefix("file://")
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    dist.barrier()
    if rank == 0:
        time.sleep(0.3)  # (the others are in the all_reduce by now)
        if how == "destroy":
            dist.destroy_process_group()
        else:
            groups._leave_at_exit()  # (the atexit handler: the mesh leaves, the group stays)
        _wait_file(base + ".done1", 40)
        _wait_file(base + ".done2", 40)
        return {}
    out = {"op": _error(lambda: dist.all_reduce(torch.ones(1000)))}
    out["after"] = _error(dist.barrier)  # (the group failed)
    open(f"{base}.done{rank}", "w").close()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["destroy", "exit"])
def test_a_shm_collective_needing_a_rank_that_left_fails_at_once(how):
    res = run_world(_shm_leaver_job, 3, how, timeout=75, env={"TORCHPORT_DIST_TRANSPORT": "shm"})
    for rank in (1, 2):
        name, msg, took = res[rank]["op"]
        assert name == "PeerLeftError", res[rank]
        assert "rank 0 left the job" in msg and f"(rank {rank})" in msg, msg
        assert took < 3.0, res[rank]  # (0.3 s after it started; before: the 20 s timeout)
        name, msg, _ = res[rank]["after"]
        assert name == "PeerLeftError" and "is in error state" in msg, res[rank]


def _any_source_job(rank: int, world: int, init: str) -> dict[str, Any]:
    """Rank 1 posts a receive from any rank; rank 0 leaves (the receive stays posted: rank 2
    may still send it), then rank 2 leaves (no rank can: it fails); a second one posted after
    both left fails at once."""
    from torchport.distributed.groups import root_mesh

    base = init.removeprefix("file://")
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    dist.barrier()
    if rank != 1:
        if rank == 2:
            _wait_file(base + ".go2", 40)
        dist.destroy_process_group()
        _wait_file(base + ".done", 40)
        return {}
    mesh = root_mesh()
    assert mesh is not None
    work = dist.irecv(torch.zeros(4))
    end = time.monotonic() + 20
    while 0 not in mesh.mailbox.left and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.2)  # (the goodbye was handled)
    out: dict[str, Any] = {"pending": not work.is_completed()}
    open(base + ".go2", "w").close()
    out["first"] = _error(work.wait)
    out["second"] = _error(lambda: dist.recv(torch.zeros(4)))
    open(base + ".done", "w").close()
    return out


@pytest.mark.timeout(90)
def test_an_any_source_recv_fails_once_every_sender_left():
    res = run_world(_any_source_job, 3, timeout=75, env={"TORCHPORT_DIST_TRANSPORT": "tcp"})
    r1 = res[1]
    assert r1["pending"] is True, r1
    for which in ("first", "second"):
        name, msg, took = r1[which]
        assert name == "PeerLeftError", r1
        assert "every rank that could send it (0, 2) left the job" in msg, msg
        assert took < 3.0, r1  # (before: the group timeout, 20 s)


def _stopped_peer_job(rank: int, world: int, init: str) -> dict[str, Any]:
    """Rank 0 stops rank 1 (SIGSTOP), destroys the group, then lets rank 1 go on."""
    base = init.removeprefix("file://")
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    dist.barrier()
    if rank == 1:
        with open(base + ".pid.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(base + ".pid.tmp", base + ".pid")
        _wait_file(base + ".go", 40)
        return {}
    assert _wait_file(base + ".pid", 40)
    with open(base + ".pid") as f:
        pid = int(f.read())
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)
        start = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
        open(base + ".go", "w").close()
    return {"destroy_s": took}


@pytest.mark.timeout(90)
def test_destroy_waits_briefly_for_a_stopped_peer():
    res = run_world(_stopped_peer_job, 2, timeout=75, env={"TORCHPORT_DIST_TRANSPORT": "tcp"})
    assert res[0]["destroy_s"] < 1.0, res  # (0.2 s; before: LEAVE_S, 2 s)
