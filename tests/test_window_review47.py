"""RMA windows: a tcp request that failed half sent, conjugate and negative sources, close()
releasing the mappings, and the typed errors of bad sources and wait_signal timeouts.

The two-rank cases run as ONE job (``run_world``: forkserver, file:// rendezvous, loopback, a
hard timeout, every process killed on failure); the tests assert on its cached result. The
rest drive a window's tcp client and server, or its checks, in this process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading

import numpy as np
import pytest
import torch
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed.window import Window, WindowError

Z = [1 + 2j, 3 + 4j]


def _held_by_this_process(name: str) -> tuple[int, int]:
    """(mappings, descriptors) of this process that belong to the window named ``name``."""
    with open("/proc/self/maps") as f:
        maps = sum(name in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (gone since the listing)
            fds += name in os.readlink(f"/proc/self/fd/{fd}")
    return maps, fds


def _job(rank: int, world: int, init: str) -> dict:
    import torch.distributed as dist

    from torchport.distributed import _new_window

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out: dict = {}
    z = torch.tensor(Z, dtype=torch.complex64)
    for transport in ("shm", "tcp"):
        # conjugate and negative views as sources, sync and async, put and accumulate; then a
        # plain put, which over tcp followed a request that had failed half sent
        w = _new_window(torch.zeros(14, dtype=torch.complex64), transport=transport)
        errors = []
        if rank == 0:
            calls = [
                (w.put, z.conj(), 0, False),
                (w.put, torch._neg_view(z), 2, False),
                (w.accumulate, z.conj(), 4, False),
                (w.put, z.conj(), 6, True),
                (w.accumulate, torch._neg_view(z), 8, True),
            ]
            for call, src, off, async_op in calls:
                try:  # (each error kept: the ranks stay in step for what follows)
                    work = call(src, 1, off, async_op=async_op)
                    if work is not None:
                        work.wait()
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
            reused = z.clone()
            work = w.put(reused, 1, 10, async_op=True)
            reused.zero_()  # (an async put sends what the source held when it was issued)
            work.wait()
            w.put(z, 1, 12)
        with contextlib.suppress(Exception):
            w.fence()  # (the old code's async failures were raised here)
        out[f"{transport} values"] = (w.local.tolist() if rank == 1 else None, errors)
        w.fence()
        w.close()
        # close() releases every mapping and descriptor at once, except the mapping of a view
        # still held, which keeps its values until it is freed
        w = _new_window(torch.arange(4.0) + rank, transport=transport)
        name = w._name
        out[f"{transport} open"] = _held_by_this_process(name)
        w.fence()
        w.close()
        out[f"{transport} closed"] = _held_by_this_process(name)
        w = _new_window(torch.arange(4.0) + rank, transport=transport)
        name, held = w._name, w.local
        w.fence()
        w.close()
        out[f"{transport} closed, local held"] = (_held_by_this_process(name), held.tolist())
        del held
        out[f"{transport} view freed"] = _held_by_this_process(name)
        dist.barrier()
    return out


@functools.cache
def _results() -> list[dict]:
    return run_world(_job, 2, timeout=60)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_conjugate_and_negative_sources_write_their_values_on_both_transports(transport):
    """Over tcp a conjugate (or negative) view raised an untyped RuntimeError after the put's
    header had gone out; the connection was kept, the target read the next request as that
    put's payload (garbage written at offset 0) and the next put returned None on the stale
    "ok". Both transports now write the conjugated (negated) values, and every later request
    lands where it should."""
    assert _results()[0][f"{transport} values"] == (None, [])
    got, _ = _results()[1][f"{transport} values"]
    conj = [complex(v).conjugate() for v in Z]
    neg = [-complex(v) for v in Z]
    assert got == [*conj, *neg, *conj, *conj, *neg, *Z, *Z]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_releases_the_mappings_and_descriptors_at_once(transport):
    """close() moved the registered tensors' mappings aside and kept them, and their
    descriptors, until the window was collected (4 mappings of 32 MiB ranks' tensors stayed).
    They go at close(); a view the caller still holds keeps its own mapping, with its values,
    until it is freed."""
    for rank, res in enumerate(_results()):
        maps = 2 if transport == "shm" else 1  # the signal counters, the tensor(s)
        assert res[f"{transport} open"][0] == 2 * maps
        assert res[f"{transport} closed"] == (0, 0)
        # (one mapping and the mmap's own duplicate of the file's descriptor)
        assert res[f"{transport} closed, local held"] == (
            (1, 1),
            [rank + 0.0, rank + 1.0, rank + 2.0, rank + 3.0],
        )
        assert res[f"{transport} view freed"] == (0, 0)


def _tcp_pair(secret: bytes) -> tuple[Window, object]:
    """A window that is both a tcp client (rank 0) and rank 1's server over 6 zeros: only
    what the server and a request use."""
    from torchport.distributed._control import Server

    win = Window.__new__(Window)
    win.rank, win.size, win.timeout_s, win._secret = 0, 2, 5.0, secret
    win._local, win._regs = torch.zeros(6), 1  # (requests name the registration)
    win._sig_local = np.zeros(2, dtype=np.int64)
    win._lock = threading.Lock()
    srv = Server(win._serve, secret=secret, role="window")
    win._addrs, win._socks = [("", 0), srv.address], {}
    win._sock_locks = [threading.Lock(), threading.Lock()]
    win._timeouts = [0, 0]
    return win, srv


def test_a_request_interrupted_after_its_header_drops_the_connection(monkeypatch):
    """Any exception between a put's header and its payload (here a KeyboardInterrupt) kept
    the connection: the server took the next request's header as the payload, wrote it into
    the target and answered "ok", which the next put took for its own. The connection is
    dropped now, and the server, seeing the stream end inside the put, writes nothing."""
    from torchport.distributed import window

    win, srv = _tcp_pair(b"k" * 32)
    real = window.send_msg
    interrupted = []

    def send_then_interrupt(sock, obj, deadline=None):
        real(sock, obj, deadline)
        if obj.get("t") == "put" and not interrupted:
            interrupted.append(obj)
            raise KeyboardInterrupt

    monkeypatch.setattr(window, "send_msg", send_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            win._rpc(1, {"t": "put", "off": 0, "n": 2, "reg": win._regs}, torch.tensor([1.0, 2.0]))
        win._rpc(1, {"t": "put", "off": 4, "n": 2, "reg": win._regs}, torch.tensor([5.0, 6.0]))
        assert win._local.tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 6.0]
        got = torch.empty(6)
        win._rpc(1, {"t": "get", "off": 0, "n": 6, "reg": win._regs}, None, got)
        assert got.tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 6.0]
    finally:
        srv.close()


def test_the_server_writes_nothing_of_a_put_whose_connection_ends_inside_its_payload():
    """A client gone after half a put's payload: the target's memory is untouched and the
    next connection is served."""
    from torchport.distributed._control import connect, send_msg

    win, srv = _tcp_pair(b"k" * 32)
    try:
        sock = connect(srv.address, b"k" * 32, "window", 5.0)
        send_msg(sock, {"t": "hello", "src": 0})
        send_msg(sock, {"t": "put", "off": 0, "n": 4, "reg": win._regs})
        sock.sendall(np.ones(2, dtype=np.float32).tobytes())  # 8 of its 16 bytes
        sock.close()
        win._rpc(1, {"t": "put", "off": 4, "n": 2, "reg": win._regs}, torch.tensor([5.0, 6.0]))
        assert win._local.tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 6.0]
    finally:
        srv.close()


def _checks_only() -> Window:
    """A window with nothing but what the source and argument checks and wait_signal read (2
    ranks, no tensor registered, no signal yet)."""
    win = Window.__new__(Window)
    win.rank, win.size, win._closed, win._pg = 0, 2, False, None
    win._local = None
    win._consumed, win._sig_local = [0, 0], np.zeros(2, dtype=np.int64)
    return win


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("op", ["put", "accumulate"])
@pytest.mark.parametrize(
    ("source", "why"),
    [
        (
            lambda: torch.ones(2).to_sparse(),
            "needs a dense (strided) tensor, got layout torch.sparse_coo",
        ),
        (lambda: torch.ones(2, device="meta"), "needs a CPU tensor, got a tensor on device meta"),
        (
            lambda: torch.nested.as_nested_tensor([torch.ones(2)]),
            "needs a dense (strided) tensor, got layout nested",
        ),
        (lambda: [1.0, 2.0], "needs a CPU tensor, got list"),
    ],
    ids=["sparse", "meta", "nested", "list"],
)
def test_a_source_the_window_cannot_take_raises_window_error(op, source, why):
    """A sparse, meta or nested source, or a list, raised RuntimeError, NotImplementedError
    (shm) or TypeError (tcp), or AttributeError: WindowError naming the requirement and the
    value, as tensor_register says for the same tensors (checked before either transport)."""
    with pytest.raises(WindowError, match=f"^{op} {re.escape(why)}$"):
        getattr(_checks_only(), op)(source(), 1)


@pytest.mark.parametrize("timeout", [None, "1", float("nan"), float("inf"), -1.0, True], ids=repr)
def test_wait_signal_needs_a_finite_timeout_of_zero_or_more(timeout):
    """None and "1" raised TypeError; NaN waited forever (no time is past a NaN deadline).
    Refused before a signal is consumed (one is pending here: the old code took it)."""
    win = _checks_only()
    win._sig_local[1] = 1
    with pytest.raises(
        WindowError,
        match=f"^wait_signal: timeout must be a finite number of seconds >= 0, got {re.escape(repr(timeout))}$",
    ):
        win.wait_signal(1, timeout=timeout)
    assert win._consumed == [0, 0]


def test_wait_signal_with_a_zero_timeout_and_no_signal_says_so():
    win = _checks_only()
    with pytest.raises(WindowError, match="no signal from rank 1 within 0 s"):
        win.wait_signal(1, timeout=0)
    win._sig_local[1] = 1
    win.wait_signal(1, timeout=np.float64(0.5))  # (NumPy numbers too)
    assert win._consumed == [0, 1]
