"""Control connections and their servers: review findings, each pinned by a test that failed
before its fix.

* the gloo ``TCPStore`` of a lighthouse or a reconfigurable group listened on every interface
  although the group was told 127.0.0.1;
* a FIFO planted as the secret file hung ``default_secret()``, and a secret directory others could
  write was used;
* the control handshake authenticated the client only: a server without the secret was accepted;
* an RMA window server's handler thread died on a request with non-integer fields.

Everything runs in this process on 127.0.0.1 (one child process, with a hard timeout, for the
FIFO); each socket, server and store is closed by the test that opened it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchport import config
from torchport.distributed import AuthError, CommError
from torchport.distributed import _control as control
from torchport.distributed._control import (
    HELLO,
    NONCE,
    Server,
    connect,
    master_store,
    recv_exact,
    recv_msg,
    send_msg,
)
from torchport.distributed.ft import Lighthouse

# -- 1: the gloo store listens on the configured host only ---------------------------------------


def _listening_on(port: int) -> set[str]:
    """The local addresses of this host's listening TCP sockets on ``port`` (IPv4 and IPv6), as
    ``/proc/net/tcp*`` shows them (hex, e.g. ``0100007F`` for 127.0.0.1, all zeros for any)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(name) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.add(addr)
    return found


LOOPBACK = "0100007F"  # 127.0.0.1 in /proc/net/tcp's byte order


def _check_store(store: Any) -> None:
    """The store listens on 127.0.0.1 only and serves a client there."""
    assert _listening_on(store.port) == {LOOPBACK}
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_master_store_listens_on_its_host_only_and_releases_its_port() -> None:
    """``TCPStore(host, 0, is_master=True)`` bound every interface whatever ``host`` said;
    master_store binds the socket itself and hands it over. Dropping the store closes it."""
    store = master_store("127.0.0.1")
    port = store.port
    _check_store(store)
    del store
    deadline = time.monotonic() + 5
    while _listening_on(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _listening_on(port)


def test_lighthouse_gloo_store_listens_on_the_lighthouse_host_only() -> None:
    """A lighthouse on 127.0.0.1 started its gloo replicas' store on ``*:port`` (reachable from
    other hosts, unauthenticated) once a gloo replica asked for a quorum."""
    secret = secrets.token_bytes(32)
    lh = Lighthouse(secret=secret, host="127.0.0.1", min_replicas=1, join_timeout=0.0)
    socks: list[socket.socket] = []
    try:
        socks.append(connect(lh.address, secret, "lighthouse", first={"t": "hb", "rid": "r0"}))
        rpc = connect(lh.address, secret, "lighthouse", first={"t": "rpc"})
        socks.append(rpc)
        ask = {"t": "quorum", "rid": "r0", "step": 0, "heal_addr": ["127.0.0.1", 1]}
        deadline = time.monotonic() + 10
        while True:  # (the heartbeat connection may not be registered yet)
            send_msg(rpc, {**ask, "mesh": None, "timeout": 5})
            reply = recv_msg(rpc, deadline=time.monotonic() + 10)
            if reply["t"] != "error" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert reply.get("store_port", 0) > 0, reply
        assert lh.store is not None and lh.store.port == reply["store_port"]
        _check_store(lh.store)
    finally:
        for s in socks:
            s.close()
        lh.close()


def test_reconfigurable_group_gloo_store_listens_on_its_host_only() -> None:
    """ReconfigurableGroup(backend="gloo", host="127.0.0.1") listened on ``*:port`` for its
    store (its control server was on 127.0.0.1 already)."""
    from torchport.distributed.reconfigure import ReconfigurableGroup

    g = ReconfigurableGroup(backend="gloo", host="127.0.0.1", secret=secrets.token_bytes(32))
    try:
        _check_store(g.store)
        assert _listening_on(g._server.address[1]) == {LOOPBACK}
    finally:
        g.close()


# -- 2: the secret file --------------------------------------------------------------------------


def test_a_fifo_as_the_secret_file_is_refused_without_blocking(tmp_path: Any) -> None:
    """A FIFO at ``<cache_dir>/control-secret`` made default_secret() wait forever in open(),
    before its check that the file is a regular one. It is opened without blocking and refused
    (run in a child process with a hard timeout: the old code never returned)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.mkfifo(cache / "control-secret", 0o600)
    env = {k: v for k, v in os.environ.items() if k != "TORCHPORT_SECRET"}
    env["TORCHPORT_CACHE_DIR"] = str(cache)
    code = (
        "from torchport.distributed._control import default_secret\n"
        "try:\n    default_secret()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:  # (run() has killed the child)
        pytest.fail("default_secret() blocked opening a FIFO planted as the secret file")
    assert r.stdout.startswith("AuthError"), (r.stdout, r.stderr[-2000:])
    assert "must be a regular file" in r.stdout and "(a FIFO" in r.stdout, r.stdout


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=["world", "sticky", "group"])
def test_a_secret_directory_others_can_write_is_refused(
    tmp_path: Any, monkeypatch: Any, mode: int
) -> None:
    """The secret was made and read in a cache directory anyone could write (another user could
    have planted it, or a FIFO in its place). Refused now, naming the directory (0770: a group
    other than this user's private one)."""
    from torchport.native import toolchain

    monkeypatch.delenv("TORCHPORT_SECRET", raising=False)
    monkeypatch.setattr(toolchain, "_own_group", lambda gid: False)
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    unsafe = pytest.raises(AuthError, match=r"its directory .*shared must not be writable")
    with config.override(cache_dir=str(d)), unsafe:
        control.default_secret()
    assert not (d / "control-secret").exists()
    os.chmod(d, 0o700)
    with config.override(cache_dir=str(d)):  # the same directory, private: fine
        assert len(control.default_secret()) == 32


# -- 3: the handshake is mutual ------------------------------------------------------------------


@contextlib.contextmanager
def _fake_server(script: Any) -> Iterator[tuple[tuple[str, int], dict[str, Any]]]:
    """A listening socket on 127.0.0.1 whose first connection runs ``script(conn, seen)`` on a
    thread (joined, bounded, on exit); ``seen`` collects what the script reports."""
    ls = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, Any] = {}

    def serve() -> None:
        ls.settimeout(10)
        with contextlib.suppress(OSError):
            conn, _ = ls.accept()
            conn.settimeout(5)
            with conn, contextlib.suppress(OSError, CommError):
                script(conn, seen)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield ls.getsockname()[:2], seen
    finally:
        t.join(10)
        ls.close()
    assert not t.is_alive()


def _read_rest(conn: socket.socket, seen: dict[str, Any]) -> None:
    """Record everything the client sends until it closes (bounded by the socket timeout)."""
    got = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(4096):
            got += chunk
    seen["rest"] = got


def test_connect_refuses_a_server_that_proves_nothing() -> None:
    """The client answered any 32-byte nonce and took "OK" for acceptance: a process without the
    secret, listening on an address a replica dials, was accepted as its lighthouse or heal
    server. A server that does not prove itself is refused, and learns no request."""

    def old_style(conn: socket.socket, seen: dict[str, Any]) -> None:
        conn.sendall(secrets.token_bytes(32))  # the old challenge, no proof of the secret
        seen["answer"] = recv_exact(conn, 32)
        conn.sendall(b"OK")
        _read_rest(conn, seen)

    with _fake_server(old_style) as (addr, seen), pytest.raises(CommError):
        connect(addr, b"s" * 32, "heal", timeout=1.0, first={"t": "fetch", "secret": 1})
    assert b"TPC1" not in seen.get("answer", b"") + seen.get("rest", b"")


def test_connect_refuses_a_wrong_server_proof_before_sending_anything_else() -> None:
    """A server speaking the handshake without the secret (a random proof) fails it with
    AuthError, and the client sends it nothing after its hello (no answer, no request)."""

    def no_secret(conn: socket.socket, seen: dict[str, Any]) -> None:
        seen["hello"] = recv_exact(conn, len(HELLO) + NONCE)
        conn.sendall(HELLO + secrets.token_bytes(NONCE + 32))
        _read_rest(conn, seen)

    refused = pytest.raises(AuthError, match=r"failed authentication for 'heal': it does not know")
    with _fake_server(no_secret) as (addr, seen), refused:
        connect(addr, b"s" * 32, "heal", timeout=5.0, first={"t": "fetch"})
    assert seen["hello"].startswith(HELLO) and seen["rest"] == b""


def test_server_refuses_its_own_proof_reflected_and_an_old_client() -> None:
    """The client's proof is labelled apart from the server's: a client echoing the server's
    proof back is refused. A client of the old handshake (no hello) is refused too."""
    secret = b"t" * 32
    served = threading.Event()
    srv = Server(lambda c: served.set(), secret=secret, role="heal")
    try:
        s = socket.create_connection(srv.address, timeout=5)
        with s:
            s.sendall(HELLO + secrets.token_bytes(NONCE))
            challenge = recv_exact(s, len(HELLO) + NONCE + 32)
            s.sendall(challenge[len(HELLO) + NONCE :])  # the server's own proof
            assert s.recv(2) == b""  # closed, no "OK"
        s = socket.create_connection(srv.address, timeout=5)
        with s:
            s.sendall(secrets.token_bytes(36))  # no HELLO
            assert s.recv(68) == b""
        assert not served.is_set()
        with connect(srv.address, secret, "heal", timeout=5):  # the real client passes
            assert served.wait(5)
        with pytest.raises(AuthError, match="failed authentication for 'heal'"):
            connect(srv.address, b"u" * 32, "heal", timeout=5)  # another job's secret
    finally:
        srv.close()


def test_client_proof_binds_both_nonces_the_role_and_the_side() -> None:
    """The MAC over (side, role, client nonce, server nonce): changing any input changes it."""
    a, b = secrets.token_bytes(NONCE), secrets.token_bytes(NONCE)
    mac = control._mac(b"k" * 32, b"cli", "heal", a, b)
    assert mac != control._mac(b"k" * 32, b"srv", "heal", a, b)
    assert mac != control._mac(b"k" * 32, b"cli", "window", a, b)
    assert mac != control._mac(b"k" * 32, b"cli", "heal", b, a)
    assert mac != control._mac(b"j" * 32, b"cli", "heal", a, b)


# -- 4: the RMA window server and malformed requests ---------------------------------------------


@pytest.fixture
def window() -> Iterator[Any]:
    """A one-rank tcp window over a gloo group in this process (made and destroyed here)."""
    from torchport.distributed.window import Window

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    w = None
    try:
        w = Window(tensor=torch.arange(8, dtype=torch.float32), transport="tcp")
        yield w
    finally:
        if w is not None:
            w.close()
        dist.destroy_process_group()


BAD = [
    {"t": "put", "off": "x", "n": 1},
    {"t": "get", "off": [0], "n": 1},
    {"t": "get", "off": 0, "n": float("inf")},
    {"t": "get", "off": 1.7, "n": 1},
    {"t": "acc", "off": 0, "n": True},
    {"t": "get", "n": 1},
]


def test_window_server_answers_malformed_requests_and_keeps_serving(
    window: Any, monkeypatch: Any
) -> None:
    """Requests whose offset or count were no integers killed the handler thread (ValueError,
    TypeError, OverflowError tracebacks) with no reply; 1.7 was read as 1. Each is answered with
    an error naming the values, no thread dies, and the server goes on serving."""
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(repr(a.exc_value)))
    addr = window._server.address
    for bad in BAD:
        with connect(addr, window._secret, "window", timeout=5, first={"src": 0}) as s:
            send_msg(s, {**bad, "reg": window._regs})  # (of the current registration)
            reply = recv_msg(s, deadline=time.monotonic() + 5)
            assert reply["t"] == "error", (bad, reply)
            assert "off and n must be integers" in reply["error"], (bad, reply)
    with connect(addr, window._secret, "window", timeout=5, first={"src": "0"}) as s:
        s.settimeout(5)
        assert s.recv(16) == b""  # a bad rank in the hello: closed
    with connect(addr, window._secret, "window", timeout=5, first={"src": 0}) as s:
        send_msg(s, {"t": "get", "off": 2, "n": 3, "reg": window._regs})
        assert recv_msg(s, deadline=time.monotonic() + 5) == {"t": "ok"}
        got = torch.empty(3)
        control.recv_into_exact(s, memoryview(got.numpy()).cast("B"), deadline=time.monotonic() + 5)
        assert got.tolist() == [2.0, 3.0, 4.0]
    time.sleep(0.2)  # (a dying handler thread reports after its connection closed)
    assert died == []
    assert window.get(0, 1, 2).tolist() == [1.0, 2.0]


class _FailingOnce:
    """A listening socket whose next accept() fails once with ``err`` (EMFILE: the process out
    of descriptors for a moment), then accepts as the real one does."""

    def __init__(self, sock: socket.socket, err: int) -> None:
        self._sock, self._err = sock, err

    def accept(self) -> Any:
        if self._err:
            err, self._err = self._err, 0
            raise OSError(err, os.strerror(err))
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.timeout(60)
def test_server_keeps_accepting_after_a_transient_accept_error() -> None:
    """One EMFILE from accept() ended the control server's acceptor for good: the lighthouse,
    heal, reconfigure and window servers accepted nothing more."""
    import errno

    secret = secrets.token_bytes(32)
    srv = Server(lambda c: send_msg(c, {"t": "hi"}), secret=secret, role="demo")
    try:
        real = srv._sock
        srv._sock = _FailingOnce(real, errno.EMFILE)  # (the blocked accept takes the next one)
        assert recv_msg(connect(srv.address, secret, "demo", timeout=5.0)) == {"t": "hi"}
        assert recv_msg(connect(srv.address, secret, "demo", timeout=5.0)) == {"t": "hi"}
        assert srv._thread.is_alive()
    finally:
        srv.close()
