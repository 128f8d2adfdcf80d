"""Review 48: the TCP mesh listeners bound the connections in their authentication handshake.

The backend's root mesh (``init_process_group("torchport")``) and the elastic mesh of
reconfigurable groups and the fault-tolerance manager started a thread for every accepted
connection, without bound (1000 silent strangers: 1000 threads), timed its handshake out per
``recv`` only (a stranger sending a byte every few seconds held its thread without end), and let
a failed thread start kill the acceptor (no later rank got in). Now at most ``MAX_HANDSHAKES``
connections are in the handshake, each ``HANDSHAKE_TIMEOUT_S`` at most; a connection past the
bound is closed at once, a legitimate dialler tries again, and the acceptor outlives a failed
thread start and a transient ``accept`` error.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from torchport.distributed import CommError, auth
from torchport.distributed import transport_tcp as tt
from torchport.distributed.elastic import ElasticMesh
from torchport.distributed.transport_tcp import Mesh
from torchport.distributed.wire import Kind, encode_header

SECRET = b"r" * 32
STRANGERS = 300
CAP = 8  # MAX_HANDSHAKES in these tests
SLACK = 3  # threads a test may see start besides the handshakes (a reader per legitimate peer)


def _threads() -> int:
    """This process's threads (those started with ``_thread`` too, as the elastic mesh does)."""
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("Threads:")).split()[1])


def _fixed(store: Any, rank: int, world: int) -> Mesh:
    return Mesh(
        store,
        rank,
        world,
        secret=SECRET,
        addr="127.0.0.1",
        timeout_s=20.0,
        max_frame=1 << 20,
        host_id="h",
    )


def _port(mesh: Mesh) -> int:
    return int(mesh.address.rsplit(":", 1)[1])


def _flood(port: int, n: int, socks: list[socket.socket]) -> None:
    """``n`` silent connections, paced so that the listen backlog does not overflow."""
    for i in range(n):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        if i % 10 == 9:
            time.sleep(0.005)


def _closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the listener closes ``s`` within ``timeout`` s (end of stream or a reset)."""
    if not select.select([s], [], [], timeout)[0]:
        return False
    try:
        return s.recv(64) == b""
    except ConnectionError:
        return True


def _exchange(sender: Mesh, receiver: Mesh) -> bytes:
    """One frame from ``sender`` to ``receiver`` over their connection."""
    deadline = time.monotonic() + 10
    sender.send(receiver.rank, Kind.CTRL, 48, 1, b"still works", deadline=deadline)
    _, body = receiver.mailbox.get((48, int(Kind.CTRL), sender.rank, 1), deadline, lambda: None)
    return bytes(body)


@pytest.fixture
def socks() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def meshes() -> Iterator[list[Mesh]]:
    made: list[Mesh] = []
    yield made
    for m in made:
        m.close()


@contextlib.contextmanager
def _rank0_of_two(
    meshes: list[Mesh],
) -> Iterator[tuple[dist.Store, dict[int, Mesh], int]]:
    """Rank 0 of a world-2 root mesh forming on a thread: yields the store, the meshes made
    (rank 0's once formed; the body adds rank 1's) and rank 0's listening port; at exit waits
    for rank 0 and hands every mesh made to ``meshes`` (closed by its fixture)."""
    store = dist.HashStore()
    made: dict[int, Mesh] = {}
    first = threading.Thread(target=lambda: made.setdefault(0, _fixed(store, 0, 2)))
    first.start()
    try:
        store.wait(["tp/addr/0"])
        yield store, made, int(store.get("tp/addr/0").decode().rsplit(":", 1)[1])
    finally:
        first.join(30)
        meshes += made.values()


def _lone(kind: str, meshes: list[Mesh]) -> Mesh:
    """A listening mesh that expects no peer: a root mesh of world 1 or an elastic mesh."""
    m = _fixed(dist.HashStore(), 0, 1) if kind == "fixed" else ElasticMesh(SECRET, "127.0.0.1")
    meshes.append(m)
    return m


def _elastic_pair(meshes: list[Mesh]) -> tuple[ElasticMesh, ElasticMesh]:
    """Two elastic meshes, the one that accepts (lower member id) first."""
    a, b = ElasticMesh(SECRET, "127.0.0.1"), ElasticMesh(SECRET, "127.0.0.1")
    meshes += [a, b]
    return (a, b) if a.rank < b.rank else (b, a)


def _join(lo: ElasticMesh, hi: ElasticMesh) -> None:
    """``hi`` dials ``lo`` (as a group formation does); both see the connection."""
    deadline = time.monotonic() + 20
    members = [lo.me, hi.me]
    assert hi.ensure(members, deadline, lambda: None) == 1
    lo.ensure(members, deadline, lambda: None)


@pytest.mark.timeout(90)
def test_silent_strangers_take_bounded_threads_and_a_later_rank_still_joins(
    monkeypatch, socks, meshes
):
    """1000 silent connections to a root mesh held 1000 handshake threads."""
    monkeypatch.setattr(tt, "MAX_HANDSHAKES", CAP)
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 2.0)
    with _rank0_of_two(meshes) as (store, made, port):
        before = _threads()
        _flood(port, STRANGERS, socks)
        time.sleep(0.2)
        assert _threads() <= before + CAP + SLACK
        # rank 1 dials while the first strangers still hold every slot: it is closed before
        # its challenge, dials again and gets in once their handshakes time out
        made[1] = _fixed(store, 1, 2)
    m0, m1 = made[0], made[1]
    assert set(m0.peers) == {1} and set(m1.peers) == {0}
    assert m0.rejected >= STRANGERS - CAP
    assert _exchange(m1, m0) == b"still works"
    assert _exchange(m0, m1) == b"still works"


@pytest.mark.timeout(90)
def test_elastic_mesh_strangers_take_bounded_threads_and_a_member_still_joins(
    monkeypatch, socks, meshes
):
    """500 silent connections to an elastic mesh held 500 threads (the warm pool started one
    whenever none was idle)."""
    monkeypatch.setattr(tt, "MAX_HANDSHAKES", CAP)
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 2.0)
    lo, hi = _elastic_pair(meshes)
    before = _threads()
    _flood(lo.me.port, STRANGERS, socks)
    time.sleep(0.2)
    assert _threads() <= before + CAP + SLACK
    _join(lo, hi)
    assert lo.rejected >= STRANGERS - CAP
    assert _exchange(hi, lo) == b"still works"


@pytest.mark.timeout(60)
def test_a_rank_dialling_while_every_slot_is_taken_gets_in_once_one_frees(
    monkeypatch, socks, meshes
):
    """Past the bound a connection is closed at once; a legitimate dialler tries again."""
    monkeypatch.setattr(tt, "MAX_HANDSHAKES", 1)
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 1.0)
    with _rank0_of_two(meshes) as (store, made, port):
        _flood(port, 1, socks)  # holds the only slot for 1 s
        time.sleep(0.1)
        t0 = time.monotonic()
        made[1] = _fixed(store, 1, 2)
        took = time.monotonic() - t0
    assert made[0].rejected >= 2, "the stranger and at least one refused dial of rank 1"
    assert 0.5 < took < 5.0, took
    assert _exchange(made[1], made[0]) == b"still works"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fixed", "elastic"])
def test_a_trickling_stranger_is_cut_at_the_handshake_deadline(monkeypatch, socks, meshes, kind):
    """The handshake timed out per recv only: a HELLO sent a byte every 50 ms (the timeout
    0.5 s) kept its thread for as long as the bytes came. One deadline bounds it now."""
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 0.5)
    mesh = _lone(kind, meshes)
    before = mesh.rejected
    s = socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5)
    socks.append(s)
    hello = encode_header(Kind.HELLO, 0, 1, 0, auth.NONCE_BYTES) + auth.new_nonce()
    t0 = time.monotonic()
    cut = None
    for i in range(len(hello)):  # 96 bytes: 4.8 s at most
        try:
            s.sendall(hello[i : i + 1])
        except ConnectionError:
            cut = time.monotonic() - t0
            break
        if _closed_within(s, 0.05):
            cut = time.monotonic() - t0
            break
    assert cut is not None, "the trickling stranger was never cut"
    assert cut < 2.0, cut
    deadline = time.monotonic() + 5
    while mesh.rejected == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mesh.rejected == before + 1


def _fail_first_spawn(mesh: Mesh, monkeypatch) -> list[str]:
    """Make the mesh's first thread start for a handshake raise as a thread limit does."""
    failed: list[str] = []
    spawn = mesh._spawn

    def flaky(fn: Callable[..., None], *args: Any, name: str) -> None:
        if name == "tp-handshake" and not failed:
            failed.append(name)
            raise RuntimeError("can't start new thread")
        spawn(fn, *args, name=name)

    monkeypatch.setattr(mesh, "_spawn", flaky)
    return failed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fixed", "elastic"])
def test_a_failed_thread_start_does_not_kill_the_acceptor(monkeypatch, socks, meshes, kind):
    """``RuntimeError: can't start new thread`` escaped the accept loop: the acceptor died and
    no later connection was handled (a rank joining later hung)."""
    mesh = _lone(kind, meshes)
    failed = _fail_first_spawn(mesh, monkeypatch)
    before = mesh.rejected
    first = socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5)
    socks.append(first)
    assert _closed_within(first, 5), "the connection whose thread failed to start stays open"
    assert failed == ["tp-handshake"]
    second = socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5)
    socks.append(second)
    second.sendall(b"GET / HTTP/1.1\r\n" * 4)
    assert _closed_within(second, 5), "no handshake ran for a later connection"
    assert mesh._acceptor.is_alive()
    assert mesh.rejected == before + 2


@pytest.mark.timeout(60)
def test_a_member_joins_an_elastic_mesh_after_a_failed_thread_start(monkeypatch, socks, meshes):
    lo, hi = _elastic_pair(meshes)
    failed = _fail_first_spawn(lo, monkeypatch)
    stranger = socket.create_connection(("127.0.0.1", lo.me.port), timeout=5)
    socks.append(stranger)
    assert _closed_within(stranger, 5)
    assert failed == ["tp-handshake"]
    _join(lo, hi)
    assert _exchange(hi, lo) == b"still works"


class _FlakyListener:
    """A listening socket whose first ``accept`` fails with ``EMFILE`` (out of descriptors)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.failed = sock, False

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.timeout(60)
def test_a_transient_accept_error_does_not_kill_the_acceptor(monkeypatch, socks, meshes):
    """Any ``accept`` error ended the accept loop, one that passes (out of descriptors) too."""
    mesh = _lone("fixed", meshes)
    flaky = _FlakyListener(mesh.listener)
    monkeypatch.setattr(mesh, "listener", flaky)
    time.sleep(0.3)  # the loop takes the new listener once its accept times out (0.2 s)
    s = socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5)
    socks.append(s)
    s.sendall(b"\0" * 64)
    assert _closed_within(s, 5), "no handshake ran after the accept error"
    assert flaky.failed and mesh._acceptor.is_alive()


@pytest.mark.timeout(60)
def test_a_dial_ends_by_its_deadline_against_a_trickling_listener() -> None:
    """A listener sending its challenge a byte every 0.3 s held a dial with a 1.5 s deadline for
    about a minute (the socket's timeout bounded each recv only)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    stop = threading.Event()

    def trickle() -> None:
        c, _ = ls.accept()
        with c:
            c.recv(4096)  # the dialler's HELLO
            frame = encode_header(Kind.CHALLENGE, 0, 1, 0, 64) + bytes(64)
            for b in frame:
                if stop.wait(0.3):
                    return
                try:
                    c.send(bytes([b]))
                except OSError:
                    return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    m = ElasticMesh(b"s" * 32, "127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(CommError, match="handshake with rank 1 failed"):
            m._connect(1, "127.0.0.1", ls.getsockname()[1], time.monotonic() + 1.5)
        assert time.monotonic() - t0 < 4.0
    finally:
        stop.set()
        m.close()
        ls.close()
        t.join(5)


@pytest.mark.timeout(60)
def test_a_reader_thread_that_cannot_start_loses_the_peer_on_both_sides(monkeypatch, meshes):
    """``Mesh._add`` let a failed reader-thread start leave the peer connected with nothing
    reading from it: frames to that rank sat unread until the collective timed out."""
    spawn, lost = Mesh._spawn, Mesh._lost
    seen: list[tuple[int, int]] = []  # (rank, peer) of every connection a mesh reported lost

    def failing(self: Mesh, fn: Callable[..., None], *args: Any, name: str) -> None:
        if self.rank == 1 and name.startswith("tp-read"):
            raise RuntimeError("can't start new thread")
        spawn(self, fn, *args, name=name)

    def recording(self: Mesh, conn: Any, e: BaseException) -> None:
        seen.append((self.rank, conn.peer))
        lost(self, conn, e)

    monkeypatch.setattr(Mesh, "_spawn", failing)
    monkeypatch.setattr(Mesh, "_lost", recording)
    with _rank0_of_two(meshes) as (store, made, _port):
        made[1] = _fixed(store, 1, 2)
    assert (1, 0) in seen, "rank 1 loses the peer it cannot read from"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (0, 1) not in seen:
        time.sleep(0.01)
    assert (0, 1) in seen, "rank 0's reader sees the connection end"
    assert made[1].peers[0].sock.recv(1, socket.MSG_DONTWAIT) == b"", "rank 1 shut it down"
