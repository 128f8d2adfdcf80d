"""One exchange step of a group that is not all on one host: each peer by its own transport.

``exchange(comm, sig, out, deadline)`` sends ``out[q]`` (a list of ``(pointer, bytes)``
segments) to every peer q and returns what each peer sent to this rank, as :class:`Blob`
(address + size). Remote peers (other hosts) get one TCP frame each, carrying the step
signature. Peers on this host -- when the group has a shared-memory arena for its local
members (a *hybrid* group) -- get theirs through that arena in one native step: this rank
publishes a table of ``(offset, length)`` per local peer followed by the distinct segments
(a segment sent to several local peers is copied once), and every local peer reads its entry
straight from the publisher's slot. Every rank sends to every peer every step (possibly
nothing), so each step is checked against every peer's signature: a mismatched call fails
on every rank, never hangs.

A local blob stays valid until this rank's next exchange (double-buffered slots: a peer
rewrites a half only after every local rank arrived at the following step).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchport.distributed.errors import CommError
from torchport.distributed.transport_shm import GONE, MISMATCH, StepError
from torchport.distributed.transport_tcp import RECEIVED, PostedTargets, Target, XRecv, XSend
from torchport.distributed.wire import Kind

Seg = tuple[int, int]  # (pointer, bytes)


@dataclass
class Blob:
    """Bytes a peer sent in one exchange: ``size`` bytes at ``addr`` (kept alive by ``keep``)."""

    addr: int
    size: int
    keep: Any = None

    def __len__(self) -> int:
        return self.size


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0


def _view(ptr: int, n: int) -> memoryview | bytes:
    """Zero-copy bytes view of ``n`` bytes at ``ptr``."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if n else b""


def _payload(segs: Sequence[Seg]) -> memoryview | bytes | bytearray:
    segs = [s for s in segs if s[1]]
    if len(segs) == 1:
        return _view(*segs[0])
    buf = bytearray(sum(n for _, n in segs))
    off = 0
    for ptr, n in segs:
        ctypes.memmove(_addr(buf) + off, ptr, n)
        off += n
    return buf


def _payload_ptr(segs: Sequence[Seg]) -> tuple[int, int, Any]:
    """``(pointer, bytes, keep-alive)`` of the segments as one contiguous payload."""
    segs = [s for s in segs if s[1]]
    if len(segs) <= 1:
        return (segs[0][0], segs[0][1], None) if segs else (0, 0, None)
    buf = _payload(segs)
    assert isinstance(buf, bytearray)
    return _addr(buf), len(buf), buf


def check_sig(q: int, got: Sequence[int], want: Sequence[int]) -> None:
    """Raise ``StepError(MISMATCH, (q, word, value))`` naming the first word of peer ``q``'s
    frame signature that differs from this rank's (a mismatched call); nothing if equal."""
    if tuple(got) != tuple(want):
        word = next(i for i in range(len(want)) if got[i] != want[i])
        raise StepError(MISMATCH, (q, word, got[word]))


def _direct(
    comm: Any,
    sig: tuple[int, int, int, int],
    epoch: int,
    out: Sequence[Sequence[Seg]],
    into: Sequence[Seg | None],
    deadline: float,
) -> list[Blob] | None:
    """The exchange of a TCP-only group as one native transfer on this thread
    (:meth:`~torchport.distributed.transport_tcp.Mesh.transfer`); None when the connections
    cannot be owned now (the caller takes the mailbox path)."""
    w, r, gid = comm.world, comm.rank, comm.group_id
    keep = []
    sends = []
    for q in ((r + k) % w for k in range(1, w)):
        ptr, n, buf = _payload_ptr(out[q])
        keep.append(buf)
        sends.append(XSend(comm.ranks[q], Kind.COLL, gid, epoch, ptr, n, sig))
    peers = [(r - k) % w for k in range(1, w)]
    recvs = []
    for q in peers:
        seg = into[q]
        assert seg is not None
        recvs.append(XRecv(comm.ranks[q], gid, epoch, sig, seg[0], seg[1]))
    frames = comm.mesh.transfer(sends, recvs, deadline, comm.check, on_cut=comm.cut_short)
    if frames is None:
        return None
    blobs = [Blob(0, 0) for _ in range(w)]
    for q, x, frame in zip(peers, recvs, frames, strict=True):
        if frame is None:
            continue
        hdr, body = frame
        check_sig(q, hdr.sig, sig)
        blobs[q] = (
            Blob(x.ptr, hdr.length) if body is RECEIVED else Blob(_addr(body), len(body), body)
        )
    if any(f is None for f in frames):
        raise CommError(f"rank {r}: an exchange ended with receives missing")
    return blobs


def _local_step(
    comm: Any, sig: tuple[int, int, int, int], out: Sequence[Sequence[Seg]], deadline: float
) -> dict[int, Blob]:
    """The shared-memory half of an exchange among this host's members of a hybrid group."""
    arena, members = comm.local, comm.local_ranks
    me = members.index(comm.rank)
    wl = len(members)
    table = (ctypes.c_int64 * (2 * wl))()
    uniq: dict[tuple[tuple[int, int], ...], int] = {}
    pubs: list[Seg] = [(ctypes.addressof(table), 16 * wl)]
    off = 0
    for lq, q in enumerate(members):
        segs = tuple((p, n) for p, n in out[q] if n) if q != comm.rank else ()
        size = sum(n for _, n in segs)
        if segs and segs not in uniq:
            uniq[segs] = off
            pubs += list(segs)
            off += size
        table[2 * lq], table[2 * lq + 1] = uniq.get(segs, 0), size
    if 16 * wl + off > arena.slot:
        raise CommError(
            f"an exchange step publishes {16 * wl + off} bytes to local peers, more than the "
            f"{arena.slot}-byte slot"
        )
    epoch = comm.local_epoch
    comm.local_epoch += 1
    try:
        arena.step(epoch, sig, pubs, [], 0, 0, deadline - time.monotonic())
    except StepError as e:
        if e.status in (MISMATCH, GONE):  # the group rank, not the index among local members
            e.detail = (members[e.detail[0]], e.detail[1], e.detail[2])
        raise
    base = arena.base + arena.data_off
    got: dict[int, Blob] = {}
    for lq, q in enumerate(members):
        if lq == me:
            continue
        slot = base + (lq * 2 + (epoch & 1)) * arena.slot
        entry = (ctypes.c_int64 * 2).from_address(slot + 16 * me)
        o, n = int(entry[0]), int(entry[1])
        if o < 0 or n < 0 or 16 * wl + o + n > arena.slot:
            raise CommError(f"rank {q} published a bad table entry ({o}, {n})")
        got[q] = Blob(slot + 16 * wl + o if n else 0, n)
    return got


def exchange(
    comm: Any,
    sig: tuple[int, int, int, int],
    out: Sequence[Sequence[Seg]],
    deadline: float,
    into: Sequence[Seg | None] | None = None,
) -> list[Blob]:
    """Send ``out[q]`` to every peer q; return what each peer sent (see the module docstring).

    ``into[q] = (pointer, bytes)``: where remote peer q's bytes belong. A frame of exactly
    that size and this step's signature is received straight there (its blob then points
    at it); anything else arrives in a buffer as usual, for the caller's size check. In a
    TCP-only group where ``into`` names every peer's bytes (``(0, 0)``: an empty frame), the
    whole exchange is one native transfer on this thread (:func:`_direct`).
    """
    epoch, w, r = comm.epoch, comm.world, comm.rank
    comm.epoch += 1
    comm._last_sig = sig
    known = into is not None and all(into[q] is not None for q in range(w) if q != r)
    if comm.local is None and known and w > 1:
        assert into is not None
        blobs = _direct(comm, sig, epoch, out, into, deadline)
        if blobs is not None:
            return blobs
    local = set(comm.local_ranks) if comm.local is not None else set()
    mailbox = comm.mesh.mailbox
    with PostedTargets(comm.mesh, deadline) as posted:
        if into is not None:
            for q in range(w):
                seg = into[q]
                if q != r and q not in local and seg is not None and seg[1] > 0:
                    key = (comm.group_id, int(Kind.COLL), comm.ranks[q], epoch)
                    target = Target(seg[0], seg[1], (sig[0], sig[1], sig[2], sig[3]))
                    posted.post(key, target, comm.ranks[q])
        comm.mesh.send_all(
            [
                (comm.ranks[q], Kind.COLL, comm.group_id, epoch, _payload(out[q]), sig)
                for q in ((r + k) % w for k in range(1, w))
                if q not in local
            ],
            deadline,
            comm.check,
        )
        blobs = [Blob(0, 0) for _ in range(w)]
        if len(local) > 1:
            for q, b in _local_step(comm, sig, out, deadline).items():
                blobs[q] = b
        for k in range(1, w):
            q = (r - k) % w
            if q in local:
                continue
            hdr, body = mailbox.get(
                (comm.group_id, int(Kind.COLL), comm.ranks[q], epoch), deadline, comm.check
            )
            check_sig(q, hdr.sig, sig)
            if body is RECEIVED:
                seg = into[q] if into is not None else None
                assert seg is not None, "a frame was received into a target never posted"
                blobs[q] = Blob(seg[0], hdr.length)
            else:
                blobs[q] = Blob(_addr(body), len(body), body)
        return blobs
