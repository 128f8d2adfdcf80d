"""Review 50: ``destroy_process_group()`` closes the root mesh with a goodbye its peers tell
from a crash.

The default group's TCP mesh (listener, a reader thread and a socket per peer) outlived
``destroy_process_group()`` until the next ``init_process_group`` or the process's exit; closing
it at the destroy (session 47) made a peer still finishing its last collective take the end of
the connection for a crash. Now a leaving rank sends a GOODBYE frame on every connection after
everything it sent there, then ends its side of the stream and drains until the peer ends its
side; the peer marks that link as left: its end is no loss, and only an operation that still
needs the leaver fails, at once, with :class:`PeerLeftError`.

Mesh-level cases run two meshes in this process; the job-level ones run real processes
(``run_world``: forkserver, loopback, a hard timeout, every child killed at the end).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport import config
from torchport.distributed import CollectiveArgumentError, PeerLeftError
from torchport.distributed.transport_tcp import GOODBYE_GROUP, Mesh
from torchport.distributed.wire import Kind

SECRET = b"g" * 32
TIMEOUT = datetime.timedelta(seconds=20)
START_TIMEOUT = datetime.timedelta(seconds=60)  # a group one side of which starts an interpreter


# -- two meshes in this process ------------------------------------------------------------
class _Handler:
    """A group's handler that records what the mesh tells it."""

    def __init__(self) -> None:
        self.lost: list[int] = []
        self.left: list[int] = []

    def on_remote_abort(self, src: int, reason: int) -> None:
        pass

    def on_peer_lost(self, src: int, error: BaseException) -> None:
        self.lost.append(src)

    def on_peer_left(self, src: int) -> None:
        self.left.append(src)


def _mesh(store: Any, rank: int) -> Mesh:
    return Mesh(
        store,
        rank,
        2,
        secret=SECRET,
        addr="127.0.0.1",
        timeout_s=20.0,
        max_frame=1 << 20,
        host_id="h",
    )


@pytest.fixture
def pair() -> Iterator[tuple[Mesh, Mesh]]:
    store = dist.HashStore()
    made: dict[int, Mesh] = {}
    first = threading.Thread(target=lambda: made.setdefault(0, _mesh(store, 0)))
    first.start()
    made[1] = _mesh(store, 1)
    first.join(30)
    try:
        yield made[0], made[1]
    finally:
        for m in made.values():
            m.close()


def _warm(a: Mesh, b: Mesh) -> None:
    """A frame each way: both reader threads run (the first builds the native library)."""
    a.send(1, Kind.CTRL, 1, 0)
    b.send(0, Kind.CTRL, 1, 0)
    b.mailbox.get((1, int(Kind.CTRL), 0, 0), time.monotonic() + 60, lambda: None)
    a.mailbox.get((1, int(Kind.CTRL), 1, 0), time.monotonic() + 60, lambda: None)


def test_a_leaving_mesh_says_goodbye_after_its_frames_and_the_peer_sees_no_loss(pair):
    """Frames sent before the leave are delivered; a wait for one more fails at once with
    PeerLeftError (a wait already blocked too); the group is told ``on_peer_left``, never
    ``on_peer_lost``; both sides' reader threads end and the leaver's sockets close."""
    a, b = pair
    handler = _Handler()
    b.register(7, handler)
    _warm(a, b)
    for seq in range(3):
        a.send(1, Kind.CTRL, 7, seq, bytes([seq]) * 1000)
    blocked: list[BaseException] = []

    def wait_for_more() -> None:
        try:
            b.mailbox.get((7, int(Kind.CTRL), 0, 99), time.monotonic() + 15, lambda: None)
        except BaseException as e:
            blocked.append(e)

    waiter = threading.Thread(target=wait_for_more)
    waiter.start()
    time.sleep(0.1)  # (blocked in get before the goodbye comes)
    start = time.monotonic()
    a.leave()
    assert time.monotonic() - start < 1.0  # (b's reader ends its side at once)
    waiter.join(5)
    assert len(blocked) == 1 and isinstance(blocked[0], PeerLeftError)
    assert "left the job" in str(blocked[0])
    for seq in range(3):
        _, body = b.mailbox.get((7, int(Kind.CTRL), 0, seq), time.monotonic() + 5, lambda: None)
        assert bytes(body) == bytes([seq]) * 1000
    with pytest.raises(PeerLeftError, match=r"waiting for a frame .* from rank 0, which left"):
        b.mailbox.get((7, int(Kind.CTRL), 0, 3), time.monotonic() + 5, lambda: None)
    with pytest.raises(PeerLeftError, match="sending to rank 0, which left the job"):
        b.send(0, Kind.CTRL, 7, 0, b"late")
    assert handler.left == [0] and handler.lost == []
    assert a.closed and a.peers[1].ended.is_set() and a.peers[1].sock.fileno() == -1
    assert b.peers[0].ended.wait(2)
    assert not any(t.name.startswith("tp-read") and t.is_alive() for t in threading.enumerate())


def test_two_meshes_leaving_at_once_both_end_cleanly(pair):
    a, b = pair
    ha, hb = _Handler(), _Handler()
    a.register(3, ha)
    b.register(3, hb)
    t = threading.Thread(target=a.leave)
    t.start()
    b.leave()
    t.join(5)
    assert a.closed and b.closed
    assert ha.lost == [] and hb.lost == []


def test_the_goodbye_id_is_no_groups():
    """Sub-group ids are ``crc32 & 0x7FFFFFFF | 1``: never the goodbye's."""
    from torchport.distributed.groups import group_id_for

    assert GOODBYE_GROUP >= 1 << 31
    assert all(group_id_for(f"g{i}", i % 3) < 1 << 31 for i in range(200))


# -- real processes ------------------------------------------------------------------------
def _tp_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tp-"))


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (one closed meanwhile)
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def _cycle_job(rank: int, world: int, init: str, default: str) -> list[tuple[list[str], int, int]]:
    """``default``: the default group's backend ("gloo": a torchport group on a mesh of its own)."""
    base = _sockets()
    seen = []
    for i in range(3):
        dist.init_process_group(
            default, rank=rank, world_size=world, init_method=f"{init}.{i}", timeout=TIMEOUT
        )
        group = None if default == "torchport" else dist.new_group([0, 1], backend="torchport")
        t = torch.ones(8)
        dist.all_reduce(t, group=group)
        dist.barrier(group=group)
        dist.destroy_process_group()
        time.sleep(0.05)  # (a reader thread returning after its last read)
        seen.append((_tp_threads(), _sockets() - base, int(t[0])))
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "transport,default", [("tcp", "torchport"), ("shm", "torchport"), ("tcp", "gloo")]
)
def test_destroy_process_group_closes_the_root_mesh(transport, default):
    """After each destroy no mesh thread (acceptor, readers) and no socket is left (before:
    tp-accept and a tp-read per peer, and their sockets, until the next init; a torchport group
    on its own mesh closed it, now with a goodbye too)."""
    env = {"TORCHPORT_DIST_TRANSPORT": transport}
    res = run_world(_cycle_job, 2, default, timeout=75, env=env)
    for rank in range(2):
        assert res[rank] == [([], 0, 2)] * 3, (rank, res[rank])


def _wait_file(path: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)


def _leaver_job(rank: int, world: int, init: str) -> dict[str, Any]:
    """Rank 0 sends rank 1 a message and leaves at once; rank 2 sends rank 1 one later. Rank 1
    receives both (the leaver's after it left), then a receive from rank 0 and an all_reduce
    needing it fail at once with PeerLeftError."""
    done = init.removeprefix("file://") + ".done"
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    out: dict[str, Any] = {}
    dist.barrier()
    if rank == 0:
        dist.isend(torch.arange(300_000, dtype=torch.float32), dst=1).wait()
        start = time.monotonic()
        dist.destroy_process_group()
        out["destroy_s"] = time.monotonic() - start
        _wait_file(done, 40)  # (alive meanwhile: an exit would close the sockets anyway)
        return out
    if rank == 2:
        time.sleep(0.5)
        dist.send(torch.full((8,), 2.0), dst=1)
        _wait_file(done, 40)
        dist.destroy_process_group()
        return out
    from2 = torch.zeros(8)
    w = dist.irecv(from2, src=2)  # (posted while rank 0 leaves: must not fail)
    time.sleep(0.3)
    got = torch.zeros(300_000)
    dist.recv(got, src=0)  # (sent before the goodbye)
    out["from0"] = bool(torch.equal(got, torch.arange(300_000, dtype=torch.float32)))
    w.wait()
    out["from2"] = from2.tolist()
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=0)
    except Exception as e:
        out["recv"] = (type(e).__name__, str(e), time.monotonic() - start)
    open(done, "w").close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_leaver_fails_only_what_still_needs_it(transport):
    res = run_world(_leaver_job, 3, timeout=75, env={"TORCHPORT_DIST_TRANSPORT": transport})
    assert res[0]["destroy_s"] < 2.0
    r1 = res[1]
    assert r1["from0"] is True and r1["from2"] == [2.0] * 8
    name, msg, took = r1["recv"]
    assert name == "PeerLeftError" and "recv from rank 0, which left the job" in msg
    assert took < 2.0  # (before: it waited for the group timeout, 20 s)


def _collective_job(rank: int, world: int, init: str) -> dict[str, Any]:
    """Rank 0 leaves; ranks 1 and 2 then all_reduce on the default group, which needs it."""
    done = init.removeprefix("file://") + ".done"
    dist.init_process_group(
        "torchport", rank=rank, world_size=world, init_method=init, timeout=TIMEOUT
    )
    dist.barrier()
    if rank == 0:
        dist.destroy_process_group()
        _wait_file(done, 40)
        return {}
    time.sleep(0.3)
    start = time.monotonic()
    out: dict[str, Any] = {}
    try:
        dist.all_reduce(torch.ones(1000))
    except Exception as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        out["err"] = (type(e).__name__, type(cause).__name__, str(e), time.monotonic() - start)
    if rank == 1:
        open(done, "w").close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
def test_a_collective_needing_a_leaver_fails_at_once():
    res = run_world(_collective_job, 3, timeout=75, env={"TORCHPORT_DIST_TRANSPORT": "tcp"})
    for rank in (1, 2):
        name, cause, _msg, took = res[rank]["err"]
        assert took < 3.0, res[rank]  # (before: the group timeout, 20 s)
        # the rank that read the goodbye first fails with it; the other may learn it from that
        # rank's ABORT first
        assert "PeerLeftError" in (name, cause) or "RemoteError" in (name, cause), res[rank]
    assert any("left the job" in res[r]["err"][2] for r in (1, 2)), res


def _race_job(rank: int, world: int, init: str, rounds: int) -> list[float]:
    """Rank 0 destroys right after the barrier; the others finish a last all_reduce and barrier
    on a subgroup without it, then destroy (session 47's close failed them as a crash)."""
    got = []
    for i in range(rounds):
        dist.init_process_group(
            "torchport", rank=rank, world_size=world, init_method=f"{init}.{i}", timeout=TIMEOUT
        )
        sub = dist.new_group([1, 2, 3])
        t = torch.full((4096,), float(rank))
        dist.all_reduce(t)
        dist.barrier()
        if rank != 0:
            u = torch.full((1 << 15,), float(rank))
            dist.all_reduce(u, group=sub)
            dist.barrier(group=sub)
            got.append(float(u[0]))
        got.append(float(t[0]))
        dist.destroy_process_group()
    return got


@pytest.mark.timeout(120)
def test_a_rank_destroying_right_after_the_last_barrier_fails_no_peer():
    res = run_world(_race_job, 4, 6, timeout=100, env={"TORCHPORT_DIST_TRANSPORT": "tcp"})
    assert res[0] == [6.0] * 6
    for rank in (1, 2, 3):
        assert res[rank] == [6.0, 6.0] * 6


# -- torch's _set_pg_timeout on a torchport group ------------------------------------------
@pytest.fixture
def world1(tmp_path) -> Iterator[Any]:
    dist.init_process_group(
        "torchport", rank=0, world_size=1, init_method=f"file://{tmp_path}/s", timeout=TIMEOUT
    )
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


def test_set_pg_timeout_sets_a_torchport_groups_timeout(world1, recwarn):
    """torch 2.13's ``_set_pg_timeout`` set only gloo and NCCL backends' timeouts and warned
    ("only supported for either nccl or gloo") for a torchport group, whose timeout stayed."""
    c10d = dist.distributed_c10d
    sub = dist.new_group([0])
    gloo = dist.new_group([0], backend="gloo")
    c10d._set_pg_timeout(datetime.timedelta(seconds=7))
    c10d._set_pg_timeout(datetime.timedelta(seconds=9), sub)
    c10d._set_pg_timeout(datetime.timedelta(seconds=11), gloo)  # (torch's own path)
    assert not [w for w in recwarn if "only supported" in str(w.message)]
    assert world1.comm.timeout_s == 7.0 and sub.comm.timeout_s == 9.0
    with pytest.raises(CollectiveArgumentError, match="timeout must be a positive"):
        c10d._set_pg_timeout(datetime.timedelta(seconds=-1), sub)
    assert sub.comm.timeout_s == 9.0


# -- the process's exit --------------------------------------------------------------------
_EXIT_SCRIPT = """
import datetime, sys
import torch, torch.distributed as dist
import torchport.distributed
dist.init_process_group("torchport", rank=0, world_size=2, init_method=sys.argv[1],
                        timeout=datetime.timedelta(seconds=60))
dist.barrier()
dist.send(torch.arange(1000, dtype=torch.float32), dst=1)
sys.exit(0)  # no destroy_process_group: the mesh leaves at exit
"""


@pytest.mark.timeout(180)
def test_a_rank_exiting_without_destroy_says_goodbye_too(tmp_path):
    """At exit the root mesh leaves as at destroy_process_group (before: the process's end closed
    the sockets and the peer failed the group as on a crash, losing the message it had not
    taken yet). Rank 0 is a fresh interpreter that exits; rank 1 is this process."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_EXIT_SCRIPT)
    init = f"file://{tmp_path}/store"
    env = {**os.environ, "TORCHPORT_DIST_TRANSPORT": "tcp", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), init],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with config.override(dist_transport="tcp"):  # (the subprocess's)
            # (a fresh interpreter importing torch took over 20 s on a loaded CI machine)
            dist.init_process_group(
                "torchport", rank=1, world_size=2, init_method=init, timeout=START_TIMEOUT
            )
        try:
            dist.barrier()
            out = proc.communicate(timeout=60)[0]  # (rank 0 has exited)
            assert proc.returncode == 0, out
            got = torch.zeros(1000)
            dist.recv(got, src=0)  # (sent before it exited)
            assert torch.equal(got, torch.arange(1000, dtype=torch.float32))
            start = time.monotonic()
            with pytest.raises(PeerLeftError, match="recv from rank 0, which left the job"):
                dist.recv(torch.zeros(4), src=0)
            assert time.monotonic() - start < 2.0  # (before: the group timeout)
        finally:
            dist.destroy_process_group()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
