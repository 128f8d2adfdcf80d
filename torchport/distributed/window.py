"""One-sided (RMA) windows: ``_new_window`` with put / get / accumulate / signal / fence.

A window gives every rank of a group direct access to a tensor registered by each other rank.

* **Same host (``transport="shm"``, the default when all ranks share a host):** each rank's
  registered tensor lives in a ``/dev/shm`` file that every rank of the group maps. ``put``,
  ``get`` and ``accumulate`` are plain memory copies/additions into the peer's mapping — true
  one-sided access, the target does nothing. ``map_remote_tensor(rank)`` returns a tensor that *is*
  the peer's memory. Files are unlinked as soon as every rank has mapped them, so nothing is left in
  ``/dev/shm`` even if a process crashes.
* **Across hosts (``transport="tcp"``):** each rank runs a server thread that applies put / get /
  accumulate / signal to its registered tensor, so the target's Python code does not participate.
  The server binds to ``TORCHPORT_DIST_ADDR`` (127.0.0.1 by default; ``0.0.0.0`` or an interface
  address across hosts) and publishes the address peers should dial (IPv4). Every connection is
  authenticated (HMAC challenge) with a random per-window secret that rank 0 draws and hands to the
  group over the group's own collectives, so no guessable default secret guards a public port.
  ``async_op=True`` puts / accumulates / signals go to an ordered queue per target (requests to one
  target keep their order; the source tensor is snapshotted) and return a ``Work``; ``fence()``
  waits for all of this rank's outstanding ones. ``map_remote_tensor`` needs shared memory and
  raises on this transport. Every request is bounded by the window's timeout (``timeout=``, else
  the group's): a peer that stopped answering (or trickles bytes) raises :class:`CommTimeoutError` naming the
  peer and the request once the whole request (connect included) took longer (it blocked ``get``
  forever before), and the connection is reopened next time. A timeout past
  ``threading.TIMEOUT_MAX`` (``timedelta(days=365000)``) means no limit. The ``Work``'s
  ``wait(timeout)`` follows the backend's Work: None, zero or past ``TIMEOUT_MAX`` waits without
  limit, a negative one does not wait, and one that expires raises :class:`CommTimeoutError`.

Semantics (and the reference, :class:`ReferenceWindow`): a put of ``n`` elements at
``target_offset_nelems`` overwrites those elements of the target's flat tensor; accumulate adds
(sum) atomically with respect to other accumulates on the same target; get reads; a put/accumulate
is complete (visible at the target) when the call returns or its Work completes. ``signal(dst)``
increments a counter at ``dst`` (one slot per source, written only by that source, ordered after
the source's preceding puts on x86's total store order); ``wait_signal(src)`` consumes one.
``fence()`` is a barrier over the group: every RMA issued before it is visible after it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import math
import mmap
import numbers
import operator
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn, cast

import numpy as np
import torch
import torch.distributed as dist

from torchport import config
from torchport.distributed import reconfigure
from torchport.distributed._control import (
    CommError,
    Server,
    connect,
    default_secret,
    recv_into_exact,
    recv_msg,
    send_msg,
)
from torchport.distributed.errors import CommTimeoutError, clip_repr, is_int
from torchport.distributed.ft.transfer import DTYPES, _bytes_view
from torchport.distributed.groups import host_id
from torchport.distributed.reconfigure import ReconfigurableGroup, Work

_DTYPE_LIST = list(DTYPES.values())
_META = 12  # dtype code, numel, ndim, up to 8 dims, host id
_counter = 0


class WindowError(CommError):
    """A window operation was given invalid arguments or could not be carried out."""


def _supports_window(group: Any = None) -> bool:
    """Whether ``group`` supports RMA windows (any gloo group or reconfigurable group does)."""
    return group is None or isinstance(group, ReconfigurableGroup | dist.ProcessGroup)


class _Coll:
    """Tiny collectives over either a torch.distributed group or a ReconfigurableGroup."""

    def __init__(self, group: Any) -> None:
        self.g = group
        if isinstance(group, ReconfigurableGroup):
            self.rank, self.size = group.rank(), group.size()
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        if isinstance(self.g, ReconfigurableGroup):
            self.g.allgather(out, t)
        else:
            dist.all_gather(out, t, group=self.g)
        return out

    def barrier(self) -> None:
        if isinstance(self.g, ReconfigurableGroup):
            self.g.barrier()
        else:
            dist.all_reduce(torch.zeros(1), group=self.g)


def _group_timeout(group: Any) -> float:
    """Seconds: ``group``'s operation timeout (a torchport or gloo group, or a
    ReconfigurableGroup), else c10d's default for CPU groups (30 min)."""
    if isinstance(group, ReconfigurableGroup):
        return group.timeout.total_seconds()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    comm = getattr(pg, "comm", None)
    if comm is not None:  # a torchport group (the c10d group is the backend itself)
        return float(comm.timeout_s)
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        backend = None
    t = getattr(getattr(backend, "options", None), "_timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return dist.default_pg_timeout.total_seconds()


def _shm_create(name: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """A new ``/dev/shm`` file of ``nbytes`` (at least 8), mapped: ``(mapping, fd)``.

    The pages are reserved up front (``posix_fallocate``): a file only truncated to size faulted
    with SIGBUS on the first write once ``/dev/shm`` was full. Any failure after the file was
    made closes it and unlinks it (the file stayed in ``/dev/shm`` and the fd leaked) and raises
    :class:`WindowError` naming the size and the errno."""
    size = max(nbytes, 8)
    path = f"/dev/shm/{name}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        raise WindowError(
            f"could not create the window file {path} ({size} bytes): {e.strerror} "
            f"(errno {e.errno})"
        ) from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (not tmpfs: size it only)
                raise
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size), fd
    except OSError as e:
        os.close(fd)
        _unlink_quietly(path)
        raise WindowError(
            f"could not allocate and map {size} bytes of shared memory for {path}: "
            f"{e.strerror} (errno {e.errno})"
        ) from None


def _shm_open(name: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """A peer's ``/dev/shm`` file mapped: ``(mapping, fd)``; WindowError if it cannot be (the fd
    leaked when the mapping failed)."""
    size = max(nbytes, 8)
    path = f"/dev/shm/{name}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise WindowError(
            f"could not open the window file {path}: {e.strerror} (errno {e.errno})"
        ) from None
    try:
        return mmap.mmap(fd, size), fd
    except OSError as e:
        os.close(fd)
        raise WindowError(
            f"could not map {size} bytes of the window file {path}: {e.strerror} (errno {e.errno})"
        ) from None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FIXED = 0x10  # Linux (the mmap module does not export it)


def _replace_with_anonymous(m: mmap.mmap) -> None:
    """Map fresh zero pages over ``m``'s range: its file's pages are no longer referenced by
    this mapping, while the addresses stay valid for tensors that still view them."""
    anchor = ctypes.c_char.from_buffer(m)
    try:
        addr = ctypes.addressof(anchor)
    finally:
        del anchor  # (a live export would make the mmap refuse to close later)
    got = _libc.mmap(
        addr,
        len(m),
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED,
        -1,
        0,
    )
    if got != addr:
        err = ctypes.get_errno()
        raise WindowError(f"could not release a window mapping: {os.strerror(err)}")


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _host_id() -> int:
    """This host's :func:`~torchport.distributed.groups.host_id` (hostname, boot id and the
    ``/dev/shm`` device) as a 62-bit int for the creation allgather: it was the hostname's
    first 7 bytes, so hosts named ``worker-1`` and ``worker-2`` counted as one and the window
    took the shared-memory transport across hosts."""
    digest = hashlib.blake2b(host_id().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Window:
    """An RMA window over ``group``; create it with :func:`_new_window` (collective)."""

    def __init__(
        self,
        group: Any = None,
        tensor: torch.Tensor | None = None,
        *,
        transport: str = "auto",
        timeout: timedelta | None = None,
    ) -> None:
        global _counter
        if transport not in ("auto", "shm", "tcp"):
            raise WindowError(f"transport must be 'auto', 'shm' or 'tcp', got {transport!r}")
        if timeout is not None and (
            not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0
        ):
            raise WindowError(f"timeout must be a positive timedelta, got {timeout!r}")
        # (tcp) the bound of every request to a peer's window server
        self.timeout_s = timeout.total_seconds() if timeout is not None else _group_timeout(group)
        self._c = _Coll(group)
        self.rank, self.size = self._c.rank, self._c.size
        # a reconfigurable group's communicator when the window was made: a reconfigure
        # replaces it, and the window's ranks, mappings and servers are then the old members'
        self._pg = group.pg if isinstance(group, ReconfigurableGroup) else None
        _counter += 1
        tok = torch.tensor([secrets.randbits(62), _host_id(), _counter], dtype=torch.int64)
        toks = self._c.allgather(tok)
        # every part of the name from rank 0: each process counts only the windows it joined,
        # so after a window on a subgroup the ranks' own counters differed and each opened
        # files no peer had created (FileNotFoundError on every rank, files left in /dev/shm)
        self._name = f"tpwin-{int(toks[0][0]):x}-{int(toks[0][2])}"
        same_host = all(int(t[1]) == int(toks[0][1]) for t in toks)
        self.transport = ("shm" if same_host else "tcp") if transport == "auto" else transport
        if self.transport == "shm" and not same_host:
            raise WindowError("transport 'shm' needs every rank on one host")
        self._secret = default_secret()
        self._regs = 0
        self._local: torch.Tensor | None = None
        self._remote: list[torch.Tensor | None] = []
        self._meta: list[tuple[torch.dtype, list[int]]] = []
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self._data: list[tuple[mmap.mmap, int]] = []  # the registered tensors' (mapping, fd)
        self._retired: list[mmap.mmap] = []  # deregistered mappings, now anonymous memory
        self._lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}
        self._queues: dict[int, cf.ThreadPoolExecutor] = {}  # tcp: one ordered queue per target
        self._pending: list[cf.Future[Any]] = []
        self._plock = threading.Lock()
        # per target: this process's shm accumulates (see _write)
        self._acc_locks = [threading.Lock() for _ in range(self.size)]
        self._failed: list[BaseException] = []  # async errors dropped from _pending, for fence()
        self._sock_locks = [threading.Lock() for _ in range(self.size)]
        # tcp: requests to rank r that timed out; a request issued before the latest of them
        # fails at once when its turn comes (see _issue)
        self._timeouts = [0] * self.size
        # signal counters: slot [src] of rank r's array, written only by src
        self._consumed = [0] * self.size
        self._sig_remote: list[Any] = [None] * self.size
        self._server: Server | None = None
        self._closed = False
        self._sig_local = np.zeros(0, dtype=np.int64)
        sig_name = f"{self._name}-s{self.rank}"
        made = False
        try:
            failure: BaseException | None = None
            try:
                m, fd = _shm_create(sig_name, 8 * self.size)
                made = True
                self._maps.append(m)
                self._fds.append(fd)
                self._sig_local = np.frombuffer(m, dtype=np.int64, count=self.size)
            except Exception as e:
                failure = e
            # every rank's file exists after this (a rank that could not make its own raised
            # alone, and the others waited in the next collective for the group's timeout)
            self._agree(failure, "window creation")
            self._addrs: list[tuple[str, int]] = []
            if self.transport == "tcp":
                self._start_server()
            if self.transport == "shm":
                try:
                    for r in range(self.size):
                        if r == self.rank:
                            self._sig_remote[r] = self._sig_local
                            continue
                        m, fd = _shm_open(f"{self._name}-s{r}", 8 * self.size)
                        self._maps.append(m)
                        self._fds.append(fd)
                        self._sig_remote[r] = np.frombuffer(m, dtype=np.int64, count=self.size)
                except Exception as e:
                    failure = e
            self._agree(failure, "window creation")
        except BaseException:
            # a peer failed or vanished before every rank had mapped the file: nothing
            # unlinks it later (it stayed in /dev/shm, a tensor's size of RAM, for good); the
            # server, its thread and the fds of the window (never returned) stayed too
            if made:
                _unlink_quietly(f"/dev/shm/{sig_name}")
            self._abandon()
            raise
        os.unlink(f"/dev/shm/{sig_name}")  # everyone has mapped it: nothing can leak
        if tensor is not None:
            try:
                self.tensor_register(tensor)
            except BaseException:
                self._abandon()  # (a refused tensor left the window's server and fds behind)
                raise

    def _start_server(self) -> None:
        """(tcp) Draw the group's secret, start this rank's window server and exchange the
        servers' addresses; a rank whose server could not start makes every rank raise."""
        self._secret = self._group_secret()
        problem = None
        me = torch.tensor([-1, 0], dtype=torch.int64)
        try:
            bind = str(config.get("dist_addr"))
            self._server = Server(self._serve, secret=self._secret, role="window", host=bind)
            host = self._server.address[0]
            if host in ("0.0.0.0", ""):
                host = socket.gethostbyname(socket.gethostname())
            try:
                ip = int.from_bytes(socket.inet_aton(host), "big")
            except OSError:
                raise WindowError(
                    f"the window server needs an IPv4 address, got {host!r} (TORCHPORT_DIST_ADDR)"
                ) from None
            me = torch.tensor([ip, self._server.address[1]], dtype=torch.int64)
        except Exception as e:
            problem = e
        got = self._c.allgather(me)
        if problem is not None:
            raise problem
        refused = [r for r, a in enumerate(got) if int(a[0]) < 0]
        if refused:
            raise WindowError(
                f"window creation: rank(s) {refused} could not start their window server "
                "(their error says why)"
            )
        self._addrs = [(socket.inet_ntoa(int(a[0]).to_bytes(4, "big")), int(a[1])) for a in got]

    def _agree(self, failure: BaseException | None, what: str) -> None:
        """Collective (an allgather where a barrier stood): ``failure`` on any rank raises on
        every rank at once, the failing rank its own error, the others WindowError naming it.
        A rank that raised alone left the others in the next collective for the group's
        timeout (30 minutes on gloo), and they then disagreed on the window's state."""
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        failed = [r for r, f in enumerate(self._c.allgather(flag)) if int(f[0])]
        if failure is not None:
            raise failure
        if failed:
            raise WindowError(f"{what} failed on rank(s) {failed} (their error says why)")

    def _abandon(self) -> None:
        """Release everything a window that failed to come up holds (``close()``; local, no
        collective): it is never returned, so nobody closes it."""
        self.close()

    def _group_secret(self) -> bytes:
        """32 random bytes drawn by rank 0, shared over the group's collectives."""
        mine = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)
        return bytes(self._c.allgather(mine)[0].tolist())

    # -- registration ----------------------------------------------------------------------
    def tensor_register(self, tensor: torch.Tensor) -> None:
        """Collective: register this rank's tensor (copied into window memory; see ``local``).

        A tensor the window cannot take raises :class:`WindowError` on every rank (the others
        name the rank), after the exchange of the tensors' shapes: raised before it, the other
        ranks waited in that exchange for the group's timeout (30 minutes on gloo). The tensor
        is copied into this rank's file before the exchange, so a copy or an allocation that
        fails is such a refusal too; a peer's file that cannot be mapped afterwards fails every
        rank alike, and any failure leaves the window with nothing registered (a later
        registration works)."""
        self._check_members("tensor_register")
        if self._local is not None:
            raise WindowError("a tensor is already registered; call tensor_deregister first")
        # (a sparse or mkldnn tensor passed, and copy_ into the window failed after the
        # exchange on that rank alone: the others waited in a barrier for the timeout)
        problem = self._not_dense_cpu(tensor, "tensor_register")
        if problem is None and tensor.dtype not in _DTYPE_LIST:
            problem = f"unsupported window dtype {tensor.dtype}"
        elif problem is None and tensor.dim() > 8:
            problem = f"window tensors may have at most 8 dims, got {tensor.dim()}"
        name = f"{self._name}-d{self._regs + 1}-{self.rank}"
        own: tuple[mmap.mmap, int] | None = None
        local: torch.Tensor | None = None
        if problem is None:
            try:
                own = _shm_create(name, tensor.numel() * tensor.element_size())
                local = self._view_of(own[0], tensor.dtype, list(tensor.shape))
                local.copy_(tensor.detach())  # (window memory never joins an autograd graph)
            except Exception as e:
                problem = f"tensor_register could not place the tensor in window memory: {e}"
                local = None
                if own is not None:
                    self._release_data([own], name)
                    own = None
        meta = torch.zeros(_META, dtype=torch.int64)
        if problem is None:
            meta[0], meta[1], meta[2] = (
                _DTYPE_LIST.index(tensor.dtype),
                tensor.numel(),
                tensor.dim(),
            )
            meta[3 : 3 + tensor.dim()] = torch.tensor(list(tensor.shape), dtype=torch.int64)
        else:
            meta[0] = -1  # tells the peers
        try:
            # every rank's file exists once this returns: the peers may open it
            metas = self._c.allgather(meta)
            refused = [r for r, m in enumerate(metas) if int(m[0]) < 0]
            if refused:
                if problem is not None:
                    raise WindowError(problem)
                raise WindowError(
                    f"tensor_register: rank(s) {refused} gave a tensor the window cannot take "
                    "(their error says why); nothing was registered"
                )
            # (decoded here: a peer's corrupt meta raised after the count and left this
            # rank's file in /dev/shm)
            bad = [r for r, m in enumerate(metas) if not 0 <= int(m[0]) < len(_DTYPE_LIST)]
            if bad:
                raise WindowError(
                    f"tensor_register: rank(s) {bad} sent dtype index(es) "
                    f"{[int(metas[r][0]) for r in bad]}, not among this build's "
                    f"{len(_DTYPE_LIST)} (every rank must run the same torchport)"
                )
            decoded = [
                (_DTYPE_LIST[int(m[0])], [int(x) for x in m[3 : 3 + int(m[2])]]) for m in metas
            ]
        except BaseException:
            local = None  # (a view of own's mapping, which cannot close while one is held)
            if own is not None:
                self._release_data([own], name)
            raise
        assert own is not None and local is not None
        self._regs += 1
        self._meta = decoded
        # this registration's mappings (own first), released by deregister; set before the
        # last exchange: a peer's tcp put may arrive as soon as that returns on the peer
        self._data = [own]
        self._data_fd = own[1]
        self._local = local
        self._remote = [None] * self.size
        self._remote_fds = [-1] * self.size
        del local
        try:
            failure: BaseException | None = None
            if self.transport == "shm":
                try:
                    for r in range(self.size):
                        if r == self.rank:
                            self._remote[r], self._remote_fds[r] = self._local, own[1]
                            continue
                        dt, shape = self._meta[r]
                        n = int(np.prod(shape)) if shape else 1
                        m2, fd2 = _shm_open(f"{self._name}-d{self._regs}-{r}", n * dt.itemsize)
                        self._data.append((m2, fd2))
                        self._remote[r], self._remote_fds[r] = self._view(m2, r), fd2
                except Exception as e:
                    failure = e
            self._agree(failure, "tensor_register")
        except BaseException:
            # a peer failed or vanished before every rank had mapped the file: nothing
            # unlinks it later (it stayed in /dev/shm, a tensor's size of RAM, for good); and
            # the registration is dropped on every rank (it stayed on the failing ones, which
            # then refused every later registration as "already registered")
            self._local = None
            self._remote, self._remote_fds, self._meta = [], [], []
            data, self._data = self._data, []
            self._release_data(data, name)
            raise
        os.unlink(f"/dev/shm/{name}")

    @staticmethod
    def _release_data(data: list[tuple[mmap.mmap, int]], own_name: str) -> None:
        """Undo a registration that failed: unlink this rank's file, close the fds and the
        mappings (no view of them is left)."""
        _unlink_quietly(f"/dev/shm/{own_name}")
        for m, fd in data:
            os.close(fd)
            with contextlib.suppress(BufferError):  # (a view still held: freed with it)
                m.close()

    @staticmethod
    def _not_dense_cpu(tensor: Any, what: str) -> str | None:
        """Why ``tensor`` cannot be window data for ``what`` (a registration, a put's source),
        or None for a dense (strided) CPU tensor."""
        if not isinstance(tensor, torch.Tensor):
            return f"{what} needs a CPU tensor, got {type(tensor).__name__}"
        if tensor.device.type != "cpu":
            return f"{what} needs a CPU tensor, got a tensor on device {tensor.device}"
        if tensor.layout != torch.strided or tensor.is_nested:
            kind = "nested" if tensor.is_nested else str(tensor.layout)
            return f"{what} needs a dense (strided) tensor, got layout {kind}"
        return None

    @staticmethod
    def _view_of(m: mmap.mmap, dt: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The first ``prod(shape)`` elements of ``m`` as a ``dt`` tensor of ``shape``.

        Through a memoryview, which holds an export of ``m`` for as long as any tensor viewing
        it lives: ``m.close()`` then raises BufferError rather than unmapping memory a tensor
        still reads (``torch.frombuffer(m)`` holds none, so closing ``m`` under a held view
        made the view fault)."""
        n = int(np.prod(shape)) if shape else 1
        if n == 0:
            return torch.empty(shape, dtype=dt)
        flat = torch.frombuffer(memoryview(m), dtype=torch.uint8, count=n * dt.itemsize)
        return flat.view(dt).view(shape)

    def _view(self, m: mmap.mmap, r: int) -> torch.Tensor:
        dt, shape = self._meta[r]
        return self._view_of(m, dt, shape)

    def tensor_deregister(self) -> None:
        """Collective: drop the registered tensors and release their memory (after a fence).

        The mappings of every rank's tensor were kept until ``close()``. Now each is replaced
        in place by fresh anonymous memory (a tensor the caller still holds -- ``local``, a
        ``map_remote_tensor`` view -- reads zeros and never faults), and once every rank has
        done so each truncates its own file, which frees the shared pages. Window operations
        afterwards raise :class:`WindowError` until a tensor is registered again.
        """
        if self._local is None:  # (after close(): said "no tensor is registered")
            raise WindowError(f"tensor_deregister: {self._unregistered()}")
        self._check_members("tensor_deregister")
        # this rank's async requests first (as fence() does; their errors kept for the next
        # fence): queued behind the barrier, they landed in the next registration's tensor
        self._settle()
        self._c.barrier()  # every rank's RMA on the old tensors has ended
        self._local = None
        self._remote, self._remote_fds = [], []
        self._meta = []
        self._deregistered = True
        for m, _ in self._data:
            _replace_with_anonymous(m)
        self._c.barrier()  # nobody maps the old files any more: they may shrink
        os.ftruncate(self._data_fd, 0)
        for m, fd in self._data:
            os.close(fd)
            self._retired.append(m)  # unmapped with the window (a caller may hold a view)
        self._data = []

    @property
    def local(self) -> torch.Tensor:
        """This rank's registered tensor as it lives in the window (puts land here)."""
        if self._local is None:
            raise WindowError(f"local: {self._unregistered()}")
        return self._local

    def _check_members(self, what: str) -> None:
        """WindowError once the window was closed, or once its reconfigurable group was
        reconfigured: rank ``r`` then named another process than the window maps, so a put to a
        rank that had left the group landed in that process's memory and the new rank ``r``
        never saw it (no error)."""
        if self._closed:
            raise WindowError(f"{what}: the window was closed (close)")
        if self._pg is None:
            return
        if self._c.g.pg is None:
            # (the group's own close() also drops its communicator: it said "reconfigured")
            raise WindowError(f"{what}: the window's group was closed (ReconfigurableGroup.close)")
        if self._c.g.pg is not self._pg:
            raise WindowError(
                f"{what}: the window's group was reconfigured after the window was created "
                "(its ranks are other processes now); create a new window on the group"
            )

    def _unregistered(self) -> str:
        if self._closed:
            return "the window was closed (close)"
        if getattr(self, "_deregistered", False):
            return "the window's tensor was deregistered (tensor_deregister); register one first"
        return "no tensor is registered with this window"

    # -- validation ------------------------------------------------------------------------
    @staticmethod
    def _int(value: Any, name: str, what: str) -> int:
        """``value`` as an int: anything ``operator.index`` takes (np.int64, a 0-dim integer
        tensor), never a bool or a float (a Python int only was accepted, so np.int64 was
        refused)."""
        if isinstance(value, bool | np.bool_):
            raise WindowError(f"{what}: {name} must be an integer, got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise WindowError(f"{what}: {name} must be an integer, got {value!r}") from None

    def _rank(self, rank: Any, what: str) -> int:
        # (closed: signal / wait_signal raised IndexError on the released counters)
        self._check_members(what)
        r = self._int(rank, "rank", what)
        if not 0 <= r < self.size:
            raise WindowError(f"{what}: rank must be in [0, {self.size}), got {r}")
        return r

    def _target(
        self, rank: Any, dtype: torch.dtype | None, offset: Any, n: Any, what: str
    ) -> tuple[int, int, int]:
        """Validated ``(rank, offset, count)`` of a request; ``n`` None: to the end, ``dtype``
        None: the target's."""
        if self._local is None:
            raise WindowError(f"{what}: {self._unregistered()}")
        rank = self._rank(rank, what)
        tdt, shape = self._meta[rank]
        total = int(np.prod(shape)) if shape else 1
        if dtype is not None and dtype != tdt:
            raise WindowError(f"{what}: dtype must match rank {rank}'s tensor ({tdt}), got {dtype}")
        offset = self._int(offset, "the offset", what)
        # (to the end from an offset past it: the range error, not "count must be >= 0, got -3")
        n = max(total - offset, 0) if n is None else self._int(n, "the element count", what)
        if n < 0:  # (get(peer, 3, -1) returned [] on shm and raised untyped over tcp)
            raise WindowError(f"{what}: the element count must be >= 0, got {n}")
        if offset < 0 or offset + n > total:
            raise WindowError(
                f"{what}: elements [{offset}, {offset + n}) must lie within rank {rank}'s "
                f"{total} elements"
            )
        return rank, offset, n

    @property
    def _wait_s(self) -> float:
        """Seconds the socket and lock waits take: a timeout past ``threading.TIMEOUT_MAX`` (a
        group's ``timedelta(days=365000)``, README's finite "forever") means no limit, as for the
        backend's Work (every tcp request raised OverflowError from the socket's timeout)."""
        return min(self.timeout_s, threading.TIMEOUT_MAX)

    @staticmethod
    def _done(value: Any = None) -> Work:
        f: cf.Future[Any] = cf.Future()
        f.set_result(value)
        return Work(f)

    # -- RMA -------------------------------------------------------------------------------
    def put(
        self,
        tensor: torch.Tensor,
        dst_rank: int,
        target_offset_nelems: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Write ``tensor`` into ``dst_rank``'s tensor at the given flat element offset."""
        return self._write("put", "put", tensor, dst_rank, target_offset_nelems, async_op)

    def accumulate(
        self,
        tensor: torch.Tensor,
        dst_rank: int,
        target_offset_nelems: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Add ``tensor`` into ``dst_rank``'s tensor (sum), atomically w.r.t. other accumulates."""
        return self._write("accumulate", "acc", tensor, dst_rank, target_offset_nelems, async_op)

    def _write(
        self, op: str, wire: str, tensor: torch.Tensor, dst: int, off: int, async_op: bool
    ) -> Work | None:
        """One-sided write of ``tensor`` at element ``off`` of ``dst``'s tensor: a copy (put) or
        a sum under the target's file lock (accumulate) through shared memory, else one request
        ``wire`` to the target's window server."""
        # the data only: a source that requires grad made the shared-memory copy_/add_ record
        # into window memory (``local`` then required grad, and each put grew its graph), and a
        # forward-mode dual (requires_grad False) gave it a tangent: always detached (1-2 us)
        problem = self._not_dense_cpu(tensor, op)
        if problem is not None:  # (a sparse, meta or nested tensor, a list: untyped errors)
            raise WindowError(problem)
        src = tensor.detach().reshape(-1)
        dst, off, _ = self._target(dst, tensor.dtype, off, src.numel(), op)
        if self.transport != "shm":
            # the values as plain contiguous memory before any byte is sent: a conjugate or
            # negative view (contiguous() and clone() keep the bit) could not be viewed as
            # bytes, and failed after the request's header had gone out. Written conjugated
            # (negated), as shared memory's copy_/add_ do
            data = src.resolve_conj().resolve_neg().contiguous()
            if (
                async_op
                and data.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            ):
                data = data.clone()  # the caller may reuse its tensor before the request runs
            nb = data.numel() * data.element_size()  # (a refused request's payload is skipped)
            msg = {"t": wire, "off": off, "n": src.numel(), "reg": self._regs, "nb": nb}
            return self._issue(dst, lambda: self._rpc(dst, msg, data), async_op)
        tgt = self._remote[dst]
        assert tgt is not None
        view = tgt.view(-1)[off : off + src.numel()]
        if src.numel() and src.untyped_storage().data_ptr() == tgt.untyped_storage().data_ptr():
            # the source is window memory (``local`` or a mapped peer's) that may overlap the
            # target range: read it first, as the tcp server does (copy_ raised untyped here)
            src = src.clone()
        if op == "put":
            view.copy_(src)
        else:
            fd = self._remote_fds[dst]
            # the file lock excludes other processes only (POSIX record locks belong to the
            # process: a second thread took it at once, and either thread's unlock released it):
            # this process's threads queue on the window's own lock first (two threads of one
            # rank lost 1-4 of 180 accumulates). Both waits end at the window's timeout: a
            # rank stopped (SIGSTOP, a debugger) inside its own add keeps its file lock, and
            # the blocking lockf waited for as long as it stayed stopped
            deadline = time.monotonic() + self._wait_s
            lock = self._acc_locks[dst]  # (per target: one stopped target holds up no other)
            if not lock.acquire(timeout=self._wait_s):
                raise self._acc_timeout(dst)
            try:
                self._lock_file(fd, deadline, dst)
                try:
                    view.add_(src)
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                lock.release()
        return self._done() if async_op else None

    def _acc_timeout(self, dst: int) -> CommTimeoutError:
        return CommTimeoutError(
            f"window accumulate on rank {dst}: the target's lock was not free within the "
            f"window's timeout ({self.timeout_s:g} s; a rank stopped inside its own accumulate "
            "keeps it)"
        )

    def _lock_file(self, fd: int, deadline: float, dst: int) -> None:
        """Take the target file's write lock by non-blocking tries until ``deadline``
        (:class:`CommTimeoutError`), sleeping 20 us doubling to 1 ms between them."""
        pause = 20e-6
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise self._acc_timeout(dst)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def get(self, src_rank: int, offset_nelems: int = 0, nelems: int | None = None) -> torch.Tensor:
        """Read ``nelems`` elements of ``src_rank``'s tensor from ``offset_nelems`` (a copy)."""
        src_rank, off, n = self._target(src_rank, None, offset_nelems, nelems, "get")
        if self.transport == "shm":
            tgt = self._remote[src_rank]
            assert tgt is not None
            return tgt.view(-1)[off : off + n].clone()
        out = torch.empty(n, dtype=self._meta[src_rank][0])
        msg = {"t": "get", "off": off, "n": n, "reg": self._regs}
        self._issue(src_rank, lambda: self._rpc(src_rank, msg, None, out), False)
        return out

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """A tensor that *is* ``rank``'s registered memory (shared-memory transport only)."""
        if self._local is None:
            raise WindowError(f"map_remote_tensor: {self._unregistered()}")
        rank = self._rank(rank, "map_remote_tensor")
        if self.transport != "shm":
            raise WindowError(
                f"map_remote_tensor needs the shared-memory transport; this window uses {self.transport!r}"
            )
        t = self._remote[rank]
        assert t is not None
        return t

    def signal(self, dst_rank: int, async_op: bool = False) -> Work | None:
        """Increment ``dst_rank``'s signal counter for this rank (after this rank's prior puts)."""
        dst_rank = self._rank(dst_rank, "signal")
        if self.transport == "shm":
            arr = self._sig_remote[dst_rank]
            arr[self.rank] = arr[self.rank] + 1
        else:
            return self._issue(dst_rank, lambda: self._rpc(dst_rank, {"t": "sig"}, None), async_op)
        return self._done() if async_op else None

    def wait_signal(self, src_rank: int, timeout: float = 30.0) -> None:
        """Wait for (and consume) one signal from ``src_rank``; ``timeout``: seconds, a finite
        number >= 0 (:class:`WindowError` when it passes)."""
        src_rank = self._rank(src_rank, "wait_signal")
        # (NaN waited forever: no time is past a NaN deadline; None or a string raised TypeError)
        if (
            not isinstance(timeout, numbers.Real)
            or isinstance(timeout, bool | np.bool_)
            or not math.isfinite(timeout)
            or timeout < 0
        ):
            raise WindowError(
                f"wait_signal: timeout must be a finite number of seconds >= 0, got {timeout!r}"
            )
        want = self._consumed[src_rank] + 1
        deadline = time.monotonic() + timeout
        spins = 0
        sig = self._sig_local  # (this view keeps the mapping while it is read)
        while int(sig[src_rank]) < want:
            spins += 1
            if self._closed:  # (another thread's close(): an IndexError on the counters)
                raise WindowError(
                    f"wait_signal: the window was closed (close) while waiting for a signal "
                    f"from rank {src_rank}"
                )
            if spins > 200:
                if time.monotonic() > deadline:
                    raise WindowError(
                        f"wait_signal: no signal from rank {src_rank} within {timeout} s"
                    )
                time.sleep(0.0001 if spins < 2000 else 0.001)
        self._consumed[src_rank] = want

    def fence(self) -> None:
        """Collective: all RMA issued before the fence is visible to everyone after it.

        Waits for this rank's outstanding ``async_op`` operations first; the first of their
        errors is raised after the barrier (so no peer is left waiting in it).
        """
        # (closed: it ran a barrier over the group after close())
        self._check_members("fence")  # (on every member alike: none waits in the barrier)
        self._settle()
        with self._plock:
            failed, self._failed = self._failed, []
        self._c.barrier()
        if failed:
            raise failed[0]

    def _settle(self) -> None:
        """Wait for this rank's outstanding async requests (each is bounded by the window's
        timeout); the errors of failed ones are kept for the next :meth:`fence`."""
        with self._plock:
            pending, self._pending = self._pending, []
        cf.wait(pending)
        with self._plock:
            self._failed.extend(
                cast(BaseException, f.exception()) for f in pending if f.exception() is not None
            )

    def _issue(self, r: int, fn: Any, async_op: bool) -> Work | None:
        """Run a tcp request on ``r``'s ordered queue (requests to one target keep their order)."""
        q = self._queues.get(r)
        if q is None:
            q = self._queues[r] = cf.ThreadPoolExecutor(1, thread_name_prefix=f"tp-win-{r}")
        seen = self._timeouts[r]

        def run() -> Any:
            # queued behind a request to r that timed out (a peer stopped or gone): fail at
            # once rather than dial it again and wait a whole timeout per queued request
            # (fence() after N async puts to a stopped peer took N timeouts)
            if self._timeouts[r] != seen:
                raise CommTimeoutError(
                    f"window request to rank {r}: a request to it issued earlier timed out "
                    f"(the window's timeout, {self.timeout_s:g} s)"
                )
            return fn()

        fut = q.submit(run)
        if not async_op:  # its error is raised here, not again by fence()
            fut.result()
            return None
        with self._plock:
            # finished futures leave the list, a failed one's error kept for fence(): it was
            # dropped, and fence() returned normally after a failed async put
            for f in self._pending:
                if f.done() and f.exception() is not None:
                    self._failed.append(cast(BaseException, f.exception()))
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(fut)
        return Work(fut, f"window request to rank {r}")

    # -- tcp transport ---------------------------------------------------------------------
    def _rpc(
        self,
        r: int,
        msg: dict[str, Any],
        payload: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> None:
        # the payload's bytes before anything is sent (a source that cannot be viewed as bytes
        # raised between the header and the payload: see the last except clause)
        body = (
            _bytes_view(payload.contiguous()) if payload is not None and payload.numel() else None
        )
        with self._sock_locks[r]:
            # one deadline for the whole request (connect, send, reply): a timeout on each
            # send/recv let a peer trickling bytes stretch a request without bound
            deadline = time.monotonic() + self._wait_s
            sock = self._socks.get(r)
            try:
                if sock is None:
                    # (a peer stopped before it answered the handshake: ConnectTimeoutError, a
                    # TimeoutError, typed below like a later request's timeout)
                    sock = connect(self._addrs[r], self._secret, "window", self._wait_s)
                    self._socks[r] = sock
                    send_msg(sock, {"t": "hello", "src": self.rank}, deadline)
                send_msg(sock, msg, deadline)
                if body is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("timed out before sending the payload")
                    sock.settimeout(left)  # (sendall: bounds the whole send)
                    sock.sendall(body)
                reply = recv_msg(sock, deadline=deadline)
                if reply.get("t") != "ok":
                    raise WindowError(f"rank {r} refused {msg['t']}: {reply.get('error')}")
                if out is not None and out.numel():
                    recv_into_exact(sock, _bytes_view(out), deadline)
            except TimeoutError:
                # the reply may still come: the stream's position is unknown, so the next
                # request opens a new connection
                self._timeouts[r] += 1
                self._socks.pop(r, None)
                if sock is not None:
                    sock.close()
                raise CommTimeoutError(
                    f"window {msg['t']} on rank {r}: no answer within the window's timeout "
                    f"({self.timeout_s:g} s)"
                ) from None
            except (OSError, CommError) as e:
                # the peer closed or reset the connection (it died, or refused a request): the
                # stream is unusable, so it is dropped and the next request dials again. A raw
                # BrokenPipeError escaped here, and every later request to that peer failed on
                # the dead socket even once it listened again
                self._socks.pop(r, None)
                if sock is not None:
                    sock.close()
                if isinstance(e, WindowError):
                    raise
                raise CommError(f"window {msg['t']} on rank {r} failed: {e}") from None
            except BaseException:
                # anything else (an interrupt inside sendall, an error of this process) may
                # have left a request half sent: the connection was kept, and the target read
                # the next request's header as this one's payload (garbage written, and the
                # next put took the stale "ok" for its own). Dropped: the server, seeing the
                # stream end inside a request, writes nothing
                self._socks.pop(r, None)
                if sock is not None:
                    sock.close()
                raise

    def _serve(self, conn: socket.socket) -> None:
        hello = recv_msg(conn)
        src = hello.get("src", -1)
        if not is_int(src) or not 0 <= src < self.size:
            raise CommError(f"window peer announced bad rank {clip_repr(src)}")
        while True:
            msg = recv_msg(conn, limit=4096)
            kind = msg.get("t")
            if kind == "sig":
                self._sig_local[src] += 1
                send_msg(conn, {"t": "ok"})
                continue
            local = self._local
            # the registration the request was issued against (read after ``local``: a new
            # registration counts before it installs its tensor). A request that outlived it
            # (one that timed out at its source, then arrived) wrote into the next one. (Every
            # put/acc/get of _write and get carries it; one without it is refused too.)
            reg: Any = msg.get("reg")
            if local is not None and reg != self._regs:
                why = (
                    f"{kind} was issued for registration {clip_repr(reg)} of this window, but "
                    f"registration {self._regs} is current (the tensor was deregistered since)"
                )
                # (a put without a valid length: its payload cannot be skipped, the connection
                # is closed)
                nb: Any = msg.get("nb") if kind in ("put", "acc") else 0
                if not (is_int(nb) and 0 <= nb < 1 << 48):
                    _refuse(conn, why)
                _skip(conn, nb)  # the payload, unread: the stream stays in step
                send_msg(conn, {"t": "error", "error": why})
                continue
            # integers only: a string, list or infinity made int() raise in this thread, which
            # died with a traceback and no reply; 1.7 was taken as 1
            off: Any = msg.get("off")
            n: Any = msg.get("n")
            if not (is_int(off) and is_int(n)):
                _refuse(
                    conn, f"off and n must be integers, got off={clip_repr(off)}, n={clip_repr(n)}"
                )
            if local is None or off < 0 or n < 0 or off + n > local.numel():
                _refuse(conn, f"elements [{off}, {off + n}) out of range")
            flat = local.view(-1)
            if kind in ("put", "acc"):
                buf = torch.empty(n, dtype=local.dtype)
                if n:
                    recv_into_exact(conn, _bytes_view(buf))
                if kind == "put":
                    flat[off : off + n].copy_(buf)
                else:
                    with self._lock:
                        flat[off : off + n].add_(buf)
                send_msg(conn, {"t": "ok"})
            elif kind == "get":
                send_msg(conn, {"t": "ok"})
                if n:
                    conn.sendall(_bytes_view(flat[off : off + n].contiguous()))
            else:
                send_msg(conn, {"t": "error", "error": f"unknown request {kind!r}"})

    def close(self) -> None:
        """Release the mappings, descriptors and the server (call after a fence); later window
        operations raise :class:`WindowError`.

        A mapping that a tensor the caller still holds views (``local``, a
        ``map_remote_tensor`` view) stays until the last such tensor is freed, and keeps its
        values (every mapping and descriptor stayed until the window was collected)."""
        self._closed = True
        for q in self._queues.values():
            q.shutdown(wait=True)
        self._queues.clear()
        if self._server is not None:
            self._server.close()
        for s in self._socks.values():
            s.close()
        self._socks.clear()
        self._local = None
        self._remote = []
        self._sig_local = np.zeros(0, dtype=np.int64)
        self._sig_remote = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for m, fd in self._data:
            self._maps.append(m)
            os.close(fd)
        self._data = []
        for m in [*self._maps, *self._retired]:
            # (BufferError: a tensor or array still views it; unmapped when the last one goes,
            # see _view_of; it closes its own descriptor then)
            with contextlib.suppress(BufferError):
                m.close()
        self._maps, self._retired = [], []


def _skip(conn: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` bytes of a request's payload."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        k = min(nbytes, len(scratch))
        recv_into_exact(conn, scratch[:k])
        nbytes -= k


def _refuse(conn: socket.socket, why: str) -> NoReturn:
    """Answer a malformed or out-of-range window request with an error and close the connection
    (a put's payload follows its header: the stream is out of step; the client drops a connection
    whose request was refused anyway)."""
    send_msg(conn, {"t": "error", "error": why})
    raise CommError(f"bad window request: {why}")


def _new_window(
    tensor: torch.Tensor | None = None,
    group: Any = None,
    *,
    transport: str = "auto",
    timeout: timedelta | None = None,
) -> Window:
    """Collective: a new RMA window on ``group`` (default: the default group, the
    reconfigurable one of ``init_process_group(..., enable_reconfigure=True)`` first, as for
    ``_reconfigure``); ``timeout`` bounds each tcp request (default: the group's timeout)."""
    if group is None:
        # (a ValueError "Default process group has not been initialized" with only the
        # reconfigurable group, which _reconfigure and the handles took as the default)
        group = reconfigure._default
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # (said "group -100 does not support windows")
        raise WindowError(
            "this rank is not a member of the group (new_group gave it "
            "GroupMember.NON_GROUP_MEMBER): only the group's members create its window"
        )
    if not _supports_window(group):
        raise WindowError(f"group {group!r} does not support windows")
    if isinstance(group, ReconfigurableGroup):  # (said "no communicator yet")
        group._check_open("_new_window")
    return Window(group, tensor, transport=transport, timeout=timeout)


class ReferenceWindow:
    """Single-process reference of window semantics: one flat tensor per rank."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.t = [x.clone().reshape(-1) for x in tensors]

    def put(self, src: int, tensor: torch.Tensor, dst: int, off: int) -> None:
        self.t[dst][off : off + tensor.numel()] = tensor.reshape(-1)

    def accumulate(self, src: int, tensor: torch.Tensor, dst: int, off: int) -> None:
        self.t[dst][off : off + tensor.numel()] += tensor.reshape(-1)

    def get(self, rank: int, off: int, n: int) -> torch.Tensor:
        return self.t[rank][off : off + n].clone()
