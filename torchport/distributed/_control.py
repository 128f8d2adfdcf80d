"""Authenticated control connections: length-prefixed JSON frames over TCP, HMAC handshake.

Everything torchport's fault-tolerance layer says over a socket (lighthouse quorum and commit votes,
reconfigure validation, heal requests, RMA window requests) travels as frames::

    magic "TPC1" | u32 length | JSON body (UTF-8)            -- control frames
    raw bytes of a known, announced length                    -- tensor payloads

No pickle anywhere; every length is bounded by ``MAX_FRAME`` (or by the announced payload size the
receiver already validated). A connection starts with a mutual challenge-response (each side
proves it knows the job secret; nonces fresh per connection, so no recorded exchange replays)::

    client -> HELLO "TPH2" | nonce_c (32 bytes)
    server -> HELLO | nonce_s | mac("srv", role, nonce_c, nonce_s)
    client -> mac("cli", role, nonce_c, nonce_s)   (sent only once the server's proof checked out)
    server -> "OK"

``mac`` is HMAC-SHA256 under the secret (:func:`_mac`); each side compares in constant time and
closes the socket on a mismatch. (The server used to prove nothing: a process without the secret
listening on a stale address was accepted as the server, and a healing replica would have loaded
whatever state it sent.) What the handshake does not stop: the frames after it are
neither encrypted nor signed, so a process that forwards every byte between a client and a real
server (on the path, or listening where the client dials and dialing the server itself) passes
both proofs and can read and alter what follows; only signed or encrypted frames would stop that.
Servers bind to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchport import config
from torchport.distributed._threads import WarmPool
from torchport.distributed.errors import AuthError, CommError, ConnectTimeoutError, WireError

MAGIC = b"TPC1"
MAX_FRAME = 16 << 20
_HDR = struct.Struct("!4sI")


class PeerFailure(CommError):
    """A peer of the group failed (crash: connection lost; hang: missed heartbeats)."""


def default_secret() -> bytes:
    """The job secret: ``TORCHPORT_SECRET`` if set, else this user's secret file (one host).

    The file (``<cache_dir>/control-secret``, 32 random bytes, mode 0600, made on first use) is
    shared by every process of the user on the host; a job across hosts sets
    ``TORCHPORT_SECRET``. It replaces a value derived from the user id, which anyone could
    compute: a stranger with it authenticated to a lighthouse, reconfigure or heal server."""
    env = os.environ.get("TORCHPORT_SECRET")
    if env:
        return env.encode()
    cache = os.path.expanduser(str(config.get("cache_dir")))
    return _user_secret(os.path.join(cache, "control-secret"))


def job_secret(secret: object) -> bytes:
    """The secret a server or client authenticates with: ``secret`` when given (non-empty
    bytes), else :func:`default_secret`. An empty secret was taken as "not given" and quietly
    replaced by the default; it is refused (:class:`ValueError`), as is anything but bytes
    (:class:`TypeError`), since a MAC keyed by it would authenticate anyone who guessed it."""
    if secret is None:
        return default_secret()
    if not isinstance(secret, bytes):
        raise TypeError(
            f"secret must be bytes (the job secret) or None for the default, "
            f"got {type(secret).__name__}"
        )
    if not secret:
        raise ValueError(
            "secret must be non-empty bytes (None takes TORCHPORT_SECRET or this user's "
            "secret file), got b''"
        )
    return secret


def _user_secret(path: str) -> bytes:
    """Read (or atomically create) the secret file at ``path``; it must be a regular file owned
    by this user and unreadable by others, in a directory only this user (and root) can change
    (:func:`_check_secret_dir`), else :class:`AuthError`.

    The file is opened without blocking and checked (``fstat``) before anything is read: a FIFO
    planted at ``path`` made the open wait forever for a writer, before any check ran."""
    d = os.path.dirname(path)
    config.make_private_dirs(Path(d))
    _check_secret_dir(d, path)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            fd = -1
        except OSError as e:  # a symbolic link (ELOOP) or unreadable
            raise AuthError(f"secret file {path} cannot be opened safely: {e}") from e
        if fd < 0:
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(wfd, secrets.token_bytes(32))
            finally:
                os.close(wfd)
            try:
                os.link(tmp, path)  # fails if another process made it first: read theirs
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise AuthError(
                    f"secret file {path} must be a regular file owned by uid {os.getuid()} with "
                    f"no group/other permissions (a {_kind(st.st_mode)}, mode "
                    f"{oct(st.st_mode & 0o777)}, uid {st.st_uid}); set TORCHPORT_SECRET or "
                    "remove it"
                )
            os.set_blocking(fd, True)  # (a regular file: O_NONBLOCK changes nothing; cleared)
            data = os.read(fd, 64)
        finally:
            os.close(fd)
        if len(data) < 16:
            raise AuthError(f"secret file {path} holds {len(data)} bytes (at least 16 needed)")
        return data
    raise AuthError(f"could not create or read the secret file {path}")


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (for messages)."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device or other special file"


def _check_secret_dir(d: str, path: str) -> None:
    """Raise :class:`AuthError` unless only this user (and root) can change what directory ``d``
    holds: every directory from ``d`` up to ``/`` (along the path as given and the resolved one)
    must pass the native cache's policy (:func:`torchport.native.toolchain.first_unsafe_dir`,
    ``d`` the leaf). In a directory others could write, they could plant the secret file (or a
    FIFO in its place) before this user made it, or swap it."""
    from torchport.native.toolchain import first_unsafe_dir

    try:
        found = first_unsafe_dir(d)
    except OSError as e:
        raise AuthError(
            f"cannot check the directory {e.filename} of secret file {path}: {e}"
        ) from e
    if found is not None:
        p, _, why = found
        raise AuthError(
            f"secret file {path}: its directory {p} {why}; set TORCHPORT_SECRET or point "
            "TORCHPORT_CACHE_DIR at a directory of your own"
        )


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Receive exactly ``n`` bytes or raise :class:`CommError` on EOF (``deadline``: see
    :func:`recv_into_exact`)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def _until(sock: socket.socket, deadline: float | None, what: str) -> None:
    """Bound the socket's next blocking call by ``deadline`` (``time.monotonic()``); raise
    ``TimeoutError`` once it passed."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"timed out {what}")
    sock.settimeout(left)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the socket or raise :class:`CommError` on EOF. With ``deadline``
    (``time.monotonic()``) the whole receive ends by then (``TimeoutError``): the socket's own
    timeout bounds each ``recv`` only, so a peer trickling bytes stretched it without bound."""
    got, n = 0, len(view)
    while got < n:
        _until(sock, deadline, f"after {got} of {n} bytes")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise CommError(f"connection closed by peer after {got} of {n} bytes")
        got += k


def send_msg(sock: socket.socket, obj: dict[str, Any], deadline: float | None = None) -> None:
    """Send one JSON control frame (by ``deadline``, ``time.monotonic()``, if given)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise CommError(f"control frame of {len(body)} bytes exceeds the limit {MAX_FRAME}")
    _until(sock, deadline, "sending a control frame")
    sock.sendall(_HDR.pack(MAGIC, len(body)) + body)  # (sendall: the timeout bounds it whole)


def recv_msg(
    sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None
) -> dict[str, Any]:
    """Receive one JSON control frame (validated magic, bounded length, object body), by
    ``deadline`` (``time.monotonic()``) if given. A frame that breaks these rules is a
    :class:`WireError` (a :class:`CommError`), which a server can tell from a lost connection."""
    n = frame_length(recv_exact(sock, _HDR.size, deadline), limit)
    return decode_frame(recv_exact(sock, n, deadline))


def frame_length(head: bytes | bytearray, limit: int, what: str = "control frame") -> int:
    """The body length a frame's header announces; :class:`WireError` for a bad magic or a
    length over ``limit`` (``what`` names the frame in the message)."""
    magic, n = _HDR.unpack(head)
    if magic != MAGIC:
        raise WireError(f"bad frame magic {magic!r}; expected {MAGIC!r}")
    if n > limit:
        raise WireError(f"{what} of {n} bytes exceeds the limit {limit}")
    return int(n)


def decode_frame(body: bytes | bytearray, what: str = "control frame") -> dict[str, Any]:
    """A frame's JSON object body; :class:`WireError` if it is no JSON object."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON; an integer of more than 4300
        # digits (ValueError from int()); deep nesting: each escaped the handlers (which stop on
        # CommError) and killed the server thread with a traceback
        raise WireError(f"malformed {what}: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


HELLO = b"TPH2"  # the handshake's version, first in each side's opening message
NONCE = 32  # bytes of each side's nonce
_MAC = 32  # bytes of an HMAC-SHA256


def _mac(secret: bytes, side: bytes, role: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 over the protocol label, the side that proves (``b"srv"``: the server,
    ``b"cli"``: the client), the role and both nonces (fixed length, last: unambiguous). The
    side label keeps one side's proof from passing for the other's."""
    msg = b"torchport-control|" + HELLO + b"|" + side + b"|" + role.encode() + b"|"
    return hmac.new(secret, msg + client_nonce + server_nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, role: str, timeout: float = 5.0) -> None:
    """Authenticate the client and prove this server to it; raise :class:`AuthError` if the
    client does not know the secret (or speaks another handshake). The whole exchange ends
    within ``timeout`` s (``TimeoutError`` otherwise): a per-``recv`` timeout let a client
    trickling its answer a byte at a time hold the server's slot 32 times as long."""
    deadline = time.monotonic() + timeout
    hello = recv_exact(sock, len(HELLO) + NONCE, deadline)
    if hello[: len(HELLO)] != HELLO:
        raise AuthError(
            f"peer opened the {role!r} handshake with {hello[: len(HELLO)]!r}, expected "
            f"{HELLO!r} (not a torchport client, or one of another version)"
        )
    client_nonce, nonce = hello[len(HELLO) :], secrets.token_bytes(NONCE)
    _until(sock, deadline, "sending the authentication challenge")
    sock.sendall(HELLO + nonce + _mac(secret, b"srv", role, client_nonce, nonce))
    answer = recv_exact(sock, _MAC, deadline)
    if not hmac.compare_digest(answer, _mac(secret, b"cli", role, client_nonce, nonce)):
        raise AuthError(f"peer failed authentication for {role!r}")
    _until(sock, deadline, "confirming the authentication")
    sock.sendall(b"OK")
    sock.settimeout(None)


def client_answer(
    secret: bytes, role: str, client_nonce: bytes, challenge: bytes, peer: str
) -> bytes:
    """The client's proof for the server's ``challenge`` (``HELLO``, its nonce, its proof), once
    the server's proof checked out; :class:`AuthError` (naming ``peer``) if it does not: a
    server that does not know the secret learns nothing else from this client."""
    if challenge[: len(HELLO)] != HELLO:
        raise AuthError(
            f"server at {peer} ({role}) answered the handshake with {challenge[: len(HELLO)]!r}, "
            f"expected {HELLO!r} (not a torchport control server, or one of another version)"
        )
    nonce = challenge[len(HELLO) : len(HELLO) + NONCE]
    proof = challenge[len(HELLO) + NONCE :]
    if not hmac.compare_digest(proof, _mac(secret, b"srv", role, client_nonce, nonce)):
        raise AuthError(
            f"server at {peer} failed authentication for {role!r}: it does not know the job "
            "secret (a stale address another process took, or a different job)"
        )
    return _mac(secret, b"cli", role, client_nonce, nonce)


def connect(
    addr: tuple[str, int],
    secret: bytes,
    role: str,
    timeout: float = 5.0,
    first: dict[str, Any] | None = None,
) -> socket.socket:
    """Open an authenticated connection to a torchport control server.

    ``first`` (optional) is a request sent right behind the authentication answer, without
    waiting for the server's "OK": the server reads it only once the answer has checked out, so
    the connection stays authenticated and the request saves a round trip.
    """
    deadline = time.monotonic() + timeout  # the whole connect: dial and handshake
    try:
        sock = socket.create_connection(addr, timeout=timeout)
    except TimeoutError as e:
        raise ConnectTimeoutError(
            f"cannot connect to {addr[0]}:{addr[1]} ({role}) within {timeout:g} s: {e}"
        ) from None
    except OSError as e:
        raise CommError(f"cannot connect to {addr[0]}:{addr[1]} ({role}): {e}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_nonce = secrets.token_bytes(NONCE)
        _until(sock, deadline, "sending the authentication hello")
        sock.sendall(HELLO + client_nonce)
        challenge = recv_exact(sock, len(HELLO) + NONCE + _MAC, deadline)
        peer = f"{addr[0]}:{addr[1]}"
        answer = client_answer(secret, role, client_nonce, challenge, peer)
        if first is not None:
            body = json.dumps(first, separators=(",", ":")).encode()
            if len(body) > MAX_FRAME:
                raise CommError(f"control frame of {len(body)} bytes exceeds the limit {MAX_FRAME}")
            answer += _HDR.pack(MAGIC, len(body)) + body
        _until(sock, deadline, "sending the authentication answer")
        sock.sendall(answer)
        if recv_exact(sock, 2, deadline) != b"OK":
            raise AuthError(f"server at {addr} rejected authentication")
        sock.settimeout(None)
    except (OSError, CommError) as e:
        sock.close()
        if isinstance(e, CommError):
            raise
        if isinstance(e, TimeoutError):  # a stopped peer: the kernel accepted, nobody answers
            raise ConnectTimeoutError(
                f"handshake with {addr[0]}:{addr[1]} ({role}) timed out after {timeout:g} s"
            ) from None
        raise CommError(f"handshake with {addr[0]}:{addr[1]} failed: {e}") from None
    return sock


def master_store(host: str) -> Any:
    """A master ``torch.distributed.TCPStore`` (unauthenticated: gloo groups rendezvous through
    it) that listens on ``host`` only, on a port the kernel picks.

    ``TCPStore(host, 0, is_master=True)`` binds every interface whatever ``host`` says (its
    server ignores the name): a lighthouse or reconfigurable group told 127.0.0.1 listened on
    ``*:port``, reachable from other hosts. The socket is bound and listening here, and the store
    takes its descriptor (``master_listen_fd``); the store closes it when it goes, or when it
    fails to start (checked on torch 2.13, both backends), so this process no longer owns it."""
    import torch.distributed as dist

    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, 0))
        ls.listen(socket.SOMAXCONN)
        port = int(ls.getsockname()[1])
    except OSError as e:
        ls.close()
        raise CommError(f"cannot listen on {host!r} for the gloo TCPStore: {e}") from None
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=ls.detach()
    )


MAX_HANDSHAKES = 128  # connections of one server in the authentication handshake at once
# accept() errors a listener outlives (out of descriptors or memory for now; a connection aborted
# before it was taken): it waits ACCEPT_RETRY_S and goes on accepting
ACCEPT_RETRY_ERRNOS = frozenset(
    (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO)
)
ACCEPT_RETRY_S = 0.05
HANDSHAKE_TIMEOUT = 5.0  # s, a server's whole handshake with one connection


class Server:
    """A threaded TCP server: each authenticated connection is handled on its own daemon thread.

    ``spare`` > 0 keeps that many handler threads started and idle (a
    :class:`~torchport.distributed._threads.WarmPool`), so a burst of connections — every peer of
    a newcomer validating its handle at once — waits for no thread start.
    """

    def __init__(
        self,
        handler: Callable[[socket.socket], None],
        *,
        secret: bytes,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        spare: int = 0,
    ) -> None:
        self._handler, self._secret, self._role = handler, secret, role
        self._workers = WarmPool(spare) if spare > 0 else None
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        # connections still in the handshake hold a slot: without a bound, silent
        # unauthenticated connections got a thread each; past it, further ones wait in the
        # kernel's listen backlog until a slot frees. A slot is held HANDSHAKE_TIMEOUT at most
        # (one deadline for the whole exchange), so a flood of MAX_HANDSHAKES connections
        # delays a legitimate peer by that long, and can neither add threads nor get past
        # authentication; a client that keeps reopening them as fast as they expire can still
        # keep legitimate peers waiting (a denial of service the bound does not prevent)
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, name=f"tp-{role}-srv", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            if not self._slots.acquire(timeout=0.1):
                continue  # every slot is in a handshake: look at ``_closed`` again
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                self._slots.release()
                # out of descriptors or memory for now, a connection aborted before it was
                # taken: accepting goes on (the server accepted nothing more, for good)
                if self._closed or e.errno not in ACCEPT_RETRY_ERRNOS:
                    return
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                if self._workers is not None:
                    self._workers.run(self._serve, conn)
                else:
                    threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except (RuntimeError, OSError):  # no thread could start: this connection goes
                self._slots.release()
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                server_handshake(conn, self._secret, self._role, HANDSHAKE_TIMEOUT)
            finally:
                self._slots.release()
        except (OSError, CommError):
            conn.close()
            return
        with self._lock:
            # close() may have listed the open connections while this one was still in its
            # handshake: it was then served after close (a lighthouse answered a quorum and
            # started its store). ``_closed`` is set under this lock, so either close() sees
            # this connection or this sees the mark.
            closed = self._closed
            if not closed:
                self._conns.add(conn)
        if closed:
            conn.close()
            return
        try:
            self._handler(conn)
        except (OSError, CommError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def refill(self) -> None:
        """Top the idle handler threads up to ``spare`` again (after a burst of connections)."""
        if self._workers is not None:
            self._workers.refill()

    def close(self) -> None:
        """Stop accepting and close every open connection (and any that completes its
        handshake later)."""
        with self._lock:
            self._closed = True
        if self._workers is not None:
            self._workers.close()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        # the accept thread leaves on the shut-down socket's error: wait for it (bounded), so a
        # closed server has no thread left (a window whose creation failed was found with its
        # server thread still alive right after close: a leak check saw it in 3 of 3 runs)
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)
