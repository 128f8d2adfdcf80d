"""State transfer for healing: a state dict as one JSON header plus raw tensor bytes.

A (nested) state dict is split into a JSON *structure* (dicts as ``[key, value]`` pairs so integer
keys survive, lists, numbers, strings, ``None``) in which each tensor is replaced by
``{"__tensor__": i}``, and the tensors themselves, sent back to back as raw bytes. The header lists
each tensor's dtype (from a fixed allow-list), shape and byte count, so the receiver allocates every
tensor once and ``recv_into``s it directly: no pickle, no intermediate copies, a few dozen bytes of
header per tensor. Header size and total payload are bounded.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchport.distributed._control import (
    _HDR,
    CommError,
    _until,
    connect,
    decode_frame,
    frame_length,
    send_msg,
)
from torchport.distributed.errors import (
    CommTimeoutError,
    ConnectTimeoutError,
    clip_repr,
    is_int,
)

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    )
}
MAX_HEADER = 64 << 20
MAX_PAYLOAD = 1 << 40
MAX_NDIM = 64  # dims of one state tensor (torch's own limit for most ops)
# a receive with a timeout fails when this many bytes (or the rest, if fewer) have not arrived
# within the timeout of the previous such chunk: a stalled or trickling source fails within about
# the timeout, while a steady one may take any time in total, whatever the state's size
PROGRESS_BYTES = 1 << 20


class StateTransferError(CommError):
    """The state could not be encoded, sent or received.

    ``partial``: the receive broke off after bytes had been written into tensors of ``into``
    (the receiver's own state), which now holds neither its old state nor the sender's.
    """

    def __init__(self, message: str, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class StateTransferTimeoutError(StateTransferError, CommTimeoutError):
    """The transfer stalled: the source did not answer, or the next :data:`PROGRESS_BYTES` of
    the state did not arrive, within the timeout (``partial`` as for the base class)."""


def encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able structure of ``obj`` with tensors replaced by indices into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.device.type != "cpu":
            raise StateTransferError(
                f"state tensors must be dense CPU tensors, got {obj.layout} on {obj.device}"
            )
        if str(obj.dtype).removeprefix("torch.") not in DTYPES:
            raise StateTransferError(f"unsupported state dtype {obj.dtype}")
        tensors.append(obj.detach())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, Mapping):
        return {"__dict__": [[k, encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return {"__list__": [encode(v, tensors) for v in obj], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise StateTransferError(
        f"state values must be tensors, dicts, lists, numbers, strings or None; got "
        f"{type(obj).__name__}"
    )


def decode(obj: Any, tensors: list[Any]) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            i = obj["__tensor__"]
            if not is_int(i):  # int() took 0.7 as tensor 0, and "1" as tensor 1
                raise StateTransferError(
                    f"state structure's tensor index must be an int, got {clip_repr(i)}"
                )
            if not 0 <= i < len(tensors):
                raise StateTransferError(f"state structure names tensor {i} of {len(tensors)}")
            return tensors[i]
        if "__dict__" in obj:
            return {k: decode(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [decode(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
        raise StateTransferError(f"malformed state structure with keys {sorted(obj)}")
    return obj


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr)


def send_state(
    sock: socket.socket,
    state: Any,
    extra: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> int:
    """Send ``state`` on ``sock``; returns the payload bytes sent.

    ``timeout`` (s): a progress limit, as :func:`recv_state`'s: the header, then each
    :data:`PROGRESS_BYTES` of the payload, must be sent within it, else
    :class:`StateTransferTimeoutError`. Without it a healer that stopped reading blocked the
    sender (a heal server thread) until shutdown.
    """
    tensors: list[torch.Tensor] = []
    structure = encode(state, tensors)
    # a lazy conj/neg bit resolved (its raw bytes are not its values: the byte view raised a
    # bare RuntimeError after the header had gone out), and every tensor contiguous
    flat = [t.resolve_conj().resolve_neg().contiguous() for t in tensors]
    metas: list[tuple[str, list[int], int]] = [
        (str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
        for t in flat
    ]
    total = sum(m[2] for m in metas)
    if total > (1 << 20):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    header = {"t": "state", "structure": structure, "tensors": metas, "total": total}
    sent = 0
    try:
        send_msg(sock, {**header, **(extra or {})}, _deadline(timeout))
        for t, m in zip(flat, metas):
            view = _bytes_view(t) if m[2] else memoryview(b"")
            for off in range(0, len(view), PROGRESS_BYTES):
                if timeout is not None:  # sendall's timeout bounds the whole call: one chunk
                    sock.settimeout(timeout)
                sock.sendall(view[off : off + PROGRESS_BYTES])
                sent += min(PROGRESS_BYTES, len(view) - off)
    except TimeoutError:  # (with no ``timeout``, the socket's own one ran out)
        limit = "the socket's timeout" if timeout is None else f"{timeout:g} s"
        raise StateTransferTimeoutError(
            f"state send stalled: the peer took no {PROGRESS_BYTES} bytes within {limit} "
            f"({sent} of {total} payload bytes sent)"
        ) from None
    return total


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _paths(obj: Any, prefix: str, out: dict[int, str]) -> None:
    """Map tensor index -> path in an encoded structure."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            out[int(obj["__tensor__"])] = prefix
        elif "__dict__" in obj:
            for k, v in obj["__dict__"]:
                _paths(v, f"{prefix}/{type(k).__name__}:{k}", out)
        elif "__list__" in obj:
            for i, v in enumerate(obj["__list__"]):
                _paths(v, f"{prefix}/{i}", out)


def tensor_paths(state: Any) -> dict[str, torch.Tensor]:
    """Path -> tensor for every tensor in ``state`` (same paths as the wire structure)."""
    tensors: list[torch.Tensor] = []
    idx: dict[int, str] = {}
    _paths(encode(state, tensors), "", idx)
    return {idx[i]: t for i, t in enumerate(tensors)}


class _Progress:
    """Receives with a progress deadline: each :data:`PROGRESS_BYTES` must arrive within
    ``timeout`` s of the previous ones (none: the socket's own timeout applies).

    One deadline for the whole receive (8eb0b27) failed every heal of a state larger than the
    timeout times the link's bandwidth; a deadline per ``recv`` let a source trickling a few
    bytes at a time stretch a transfer without bound. This one caps no state's size and still
    ends a stall within about the timeout."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.t0 = time.monotonic()
        self.received = 0  # bytes so far
        self._mark = 0  # ``received`` when the deadline was last moved
        self._deadline = None if timeout is None else self.t0 + timeout

    def recv_into(self, sock: socket.socket, view: memoryview) -> None:
        """Fill ``view``: ``TimeoutError`` on a stall, :class:`CommError` on EOF."""
        got, n = 0, len(view)
        while got < n:
            _until(sock, self._deadline, f"after {got} of {n} bytes")
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise CommError(f"connection closed by peer after {got} of {n} bytes")
            got += k
            self.received += k
            if self.timeout is not None and self.received - self._mark >= PROGRESS_BYTES:
                self._mark = self.received
                self._deadline = time.monotonic() + self.timeout

    def recv_header(self, sock: socket.socket) -> dict[str, Any]:
        """One control frame of up to :data:`MAX_HEADER` bytes (checked as ``recv_msg`` does)."""
        head = bytearray(_HDR.size)
        self.recv_into(sock, memoryview(head))
        body = bytearray(frame_length(head, MAX_HEADER, "state header"))
        self.recv_into(sock, memoryview(body))
        return decode_frame(body, "state header")

    def stalled(self) -> str:
        """What a timeout message says: the limit, the bytes received and the time taken."""
        return (
            f"no {PROGRESS_BYTES} bytes arrived within {self.timeout:g} s "
            f"({self.received} bytes received in {time.monotonic() - self.t0:.2f} s)"
        )


def recv_state(
    sock: socket.socket,
    max_payload: int = MAX_PAYLOAD,
    into: Any = None,
    timeout: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Receive a state sent by :func:`send_state`; returns (state, header).

    ``into``: an existing state of the same layout (e.g. the receiver's own); tensors whose path,
    dtype and shape match are received directly into it, which avoids allocating (and
    page-faulting) fresh memory. Others are allocated.

    ``timeout`` (s): a progress limit: each :data:`PROGRESS_BYTES` of the receive (header and
    payload) must arrive within it of the previous ones, else
    :class:`StateTransferTimeoutError`. The total time is not bounded: a steady source may send
    a state of any size, a stalled or trickling one fails within about ``timeout``.
    """
    progress = _Progress(timeout)
    try:
        hdr = progress.recv_header(sock)
    except TimeoutError:
        raise StateTransferTimeoutError(f"state header: {progress.stalled()}") from None
    if hdr.get("t") != "state":
        raise StateTransferError(
            f"expected a state header, got {hdr.get('t')!r}: {hdr.get('error')}"
        )
    targets = tensor_paths(into) if into is not None else {}
    paths: dict[int, str] = {}
    # the whole header is checked before any byte lands in ``into``: a malformed one (a buggy or
    # mismatched peer) is a StateTransferError that leaves the receiver's own state intact
    try:
        total = hdr["total"]
        if not is_int(total):
            raise StateTransferError(f"malformed state header: total {clip_repr(total)} is no int")
        metas = [_meta(entry) for entry in hdr["tensors"]]
        decode(hdr["structure"], [None] * len(metas))  # tensor indices and keys (hashable)
        if targets:
            _paths(hdr["structure"], "", paths)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise StateTransferError(f"malformed state header: {type(e).__name__}: {e}") from None
    if total > max_payload:
        raise StateTransferError(f"state of {total} bytes exceeds the limit {max_payload}")
    if sum(m[2] for m in metas) > total:
        raise StateTransferError("tensor sizes exceed the announced total")
    tensors: list[torch.Tensor] = []
    written = False  # bytes went into a tensor of ``into``: a failure from here on tears it
    for i, (dtype, dims, nbytes) in enumerate(metas):
        t = targets.get(paths.get(i, ""), None) if targets else None
        # (a conj/neg view's raw bytes are not its values: received into, it raised a bare
        # RuntimeError, so it is not taken as the receiver's own)
        own = (
            t is not None
            and t.dtype == dtype
            and list(t.shape) == dims
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
        )
        try:
            if not own:
                t = torch.empty(dims, dtype=dtype)
        except (RuntimeError, TypeError, ValueError) as e:  # more memory than the host has, say
            raise StateTransferError(f"cannot allocate a state tensor: {e}", written) from None
        assert t is not None
        if nbytes:
            written = written or own
            try:
                progress.recv_into(sock, _bytes_view(t))
            except TimeoutError:
                raise StateTransferTimeoutError(
                    f"state payload, tensor {i} of {len(metas)}: {progress.stalled()}", written
                ) from None
            except (OSError, CommError) as e:
                raise StateTransferError(f"state transfer broke off: {e}", written) from None
        tensors.append(t)
    return decode(hdr["structure"], tensors), hdr


def _meta(entry: Any) -> tuple[torch.dtype, list[int], int]:
    """A header's ``[dtype, shape, nbytes]`` entry, checked: known dtype, a list of at most
    :data:`MAX_NDIM` int dims in ``[0, 2**63)``, an int byte count equal to the shape's.

    ``int(d) for d in shape`` took the string "22" as the shape [2, 2] and 2.9 as 2, and a dim
    past int64 reached ``torch.empty``, whose TypeError escaped every caller (they catch
    :class:`StateTransferError`)."""
    dtype_name, shape, nbytes = entry
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise StateTransferError(f"peer sent unsupported dtype {dtype_name!r}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(map(is_int, shape))):
        raise StateTransferError(
            f"peer sent shape {clip_repr(shape)}; a shape is a list of at most {MAX_NDIM} ints"
        )
    if any(not 0 <= d < 1 << 63 for d in shape):
        raise StateTransferError(f"peer sent a dimension outside [0, 2**63) in shape {shape}")
    want = math.prod(shape) * dtype.itemsize
    if not is_int(nbytes) or nbytes != want:
        raise StateTransferError(
            f"byte count {clip_repr(nbytes)} does not match {dtype_name}{shape}"
        )
    return dtype, list(shape), want


def fetch_state(
    addr: tuple[str, int],
    secret: bytes,
    *,
    timeout: float = 60.0,
    step: int | None = None,
    into: Any = None,
    on_connect: Callable[[socket.socket | None], None] | None = None,
) -> tuple[Any, dict[str, Any], float]:
    """Ask a heal server for its state; returns (state, header, seconds). See :func:`recv_state`.

    ``timeout`` (s) bounds each part of the transfer that can stall: the connection (dial and
    handshake), the request, and each :data:`PROGRESS_BYTES` of the answer (counted from the
    previous ones; see :func:`recv_state`). Any of them running past it is a
    :class:`StateTransferTimeoutError` (a connection's ``ConnectTimeoutError`` is its cause), so
    a stopped or trickling source fails within about ``timeout``, while a steady one may send a
    state of any size. Other connection failures raise as :func:`connect` does (``CommError``,
    ``AuthError``).

    ``on_connect`` is called with the connection once it is open and with None when it is
    closed: shutting it down from another thread ends the transfer at once.
    """
    t0 = time.perf_counter()
    try:
        sock = connect(addr, secret, "heal", timeout=timeout)
    except ConnectTimeoutError as e:  # a stopped source: the transfer's timeout, as any stall
        raise StateTransferTimeoutError(
            f"state source {addr} did not complete the connection within its {timeout:g} s "
            f"limit (gave up after {time.perf_counter() - t0:.2f} s): {e}"
        ) from e
    if on_connect is not None:
        on_connect(sock)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        send_msg(sock, {"t": "get_state", "step": step}, time.monotonic() + timeout)
        state, hdr = recv_state(sock, into=into, timeout=timeout)
    except StateTransferTimeoutError as e:
        raise StateTransferTimeoutError(
            f"state transfer from {addr} stalled beyond its {timeout:g} s limit "
            f"(gave up after {time.perf_counter() - t0:.2f} s): {e}",
            e.partial,
        ) from None
    except StateTransferError:
        raise
    except TimeoutError:  # sending the request
        raise StateTransferTimeoutError(
            f"state request to {addr} not sent within its {timeout:g} s limit "
            f"(gave up after {time.perf_counter() - t0:.2f} s)"
        ) from None
    except (OSError, CommError) as e:
        raise StateTransferError(f"state transfer from {addr} failed: {e}") from None
    finally:
        if on_connect is not None:
            on_connect(None)
        sock.close()
    return state, hdr, time.perf_counter() - t0
