"""Collective algorithms over TCP and hybrid groups: direct per-peer exchanges, O(n) bytes per rank.

A shared-memory step publishes bytes every peer may read; over TCP that would mean sending
them to every peer, ``(W - 1) x`` the data. Here each step is an *exchange*: rank r sends each
peer q exactly the bytes q needs (possibly none: an empty frame still carries the step
signature, so a mismatched call is detected on every rank, never a hang or wrong data).

Per rank and ``n`` payload bytes (``W`` ranks):

- allreduce (above ``small`` bytes per chunk): reduce-scatter then all-gather, both direct: rank
  q owns part q, receives every rank's copy of it, folds them in rank order 0..W-1 (bitwise
  equal to the reference, like the shared-memory path) and sends the result to every rank.
  Sent: ``2 n (W - 1) / W`` -- the same bytes as a ring, in 2 rounds instead of ``2 (W - 1)``.
  In a TCP-only group both rounds are one pipelined transfer in pieces (:class:`_Pieces`): a
  piece is folded as soon as it is in and its result sent while later pieces stream.
- broadcast (TCP-only groups, any size): a pipelined chain with acknowledgements back up it
  (:func:`_chain_broadcast`): each rank receives and sends ``n`` bytes once, ``2 (W - 1)``
  frames for a one-piece tensor instead of an exchange's ``W (W - 1)``. Hybrid groups: scatter of the root's parts, then
  all-gather of the parts (van de Geijn): the root sends ``2 n (W - 1) / W``, every other
  rank ``n (W - 2) / W`` (a flat send would cost the root ``n (W - 1)``).
- reduce: the reduce-scatter above, then every owner sends its part to the root.
- reduce_scatter / scatter / gather / alltoall: each block travels once, to its destination.

Every exchange reaches remote peers by TCP and, in a hybrid group, same-host peers through
the group's local shared-memory arena (:mod:`~torchport.distributed.exchange`); there a step's
payloads to all local peers share one slot, so ops sending a different block to each peer cut
their chunks to ``peer_chunk`` (``chunk / W``).

Small chunks (at most ``small`` bytes) of allreduce and of a hybrid group's broadcast keep
the one-round publish-to-all step: at that size latency, not bandwidth, decides.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence

import torch

from torchport.distributed.engine import (
    OP_ALLGATHER,
    OP_ALLREDUCE,
    OP_ALLTOALL,
    OP_ALLTOALL_SIZES,
    OP_BROADCAST,
    OP_GATHER,
    OP_REDUCE,
    OP_REDUCE_SCATTER,
    OP_SCATTER,
    Communicator,
    make_sig,
)
from torchport.distributed.engine import chunk_ranges as _chunks
from torchport.distributed.engine import split_even as _parts
from torchport.distributed.errors import CollectiveMismatchError, CommError
from torchport.distributed.exchange import Blob, _addr, _view, check_sig, exchange
from torchport.distributed.transport_shm import COPY, FOLD
from torchport.distributed.transport_tcp import (
    RECEIVED,
    Frame,
    PostedTargets,
    Target,
    XRecv,
    XSend,
)
from torchport.distributed.wire import Kind


def _expect(blob: Blob, n: int, q: int) -> int:
    if blob.size != n:
        raise CommError(f"rank {q} sent {blob.size} bytes where {n} were expected")
    return blob.addr


def _copy(dst: int, src: int, n: int) -> None:
    """memmove unless the bytes were already received in place (``src == dst``)."""
    if n and src != dst:
        ctypes.memmove(dst, src, n)


def _scratch(comm: Communicator, nbytes: int) -> int:
    """Address of a per-communicator receive buffer of at least ``nbytes`` (reused, so its
    pages are faulted in once, not per frame). Valid until the next call on ``comm``."""
    buf: torch.Tensor | None = getattr(comm, "_tcp_scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        comm._tcp_scratch = buf  # type: ignore[attr-defined]
    return buf.data_ptr()


def _slots(base: int, nb: int, w: int) -> list[tuple[int, int]]:
    """``w`` receive slots of ``nb`` bytes each from ``base`` (one per peer)."""
    return [(base + q * nb, nb) for q in range(w)]


EMPTY = (0, 0)  # an exchange's receive slot for a peer that sends nothing in the step


def _fold_part(
    comm: Communicator,
    blobs: list[Blob],
    dst: int,
    n: int,
    dtype: int,
    red: int,
    keep_at: int = 0,
) -> None:
    """dst = fold over ranks in order of (rank q's copy of my part); dst holds mine on entry.

    A rank r > 0 first copies its own part aside (to ``keep_at``, or a new buffer)."""
    w, r = comm.world, comm.rank
    if not n or w == 1:
        return
    keep = bytearray(n) if r and not keep_at else bytearray()
    mine = keep_at or _addr(keep)
    if r:
        ctypes.memmove(mine, dst, n)
    bases = [_expect(blobs[q], n, q) if q != r else (mine if r else dst) for q in range(w)]
    reads = [(q, 0, dst, n, COPY if q == 0 else FOLD) for q in range(w) if q or r]
    comm.apply(bases, reads, dtype, red)


def _scatter_reduce(
    comm: Communicator, sig: tuple, ptr: int, m: int, es: int, dtype: int, red: int, deadline: float
) -> list[tuple[int, int]]:
    """Direct reduce-scatter of ``m`` elements at ``ptr``: my part ends up folded in place."""
    w, r = comm.world, comm.rank
    parts = _parts(m, w)
    lo, k = parts[r]
    nb = k * es
    base = _scratch(comm, nb * w)  # peers' copies of my part; slot r keeps my own copy
    into = _slots(base, nb, w)
    out = [[(ptr + plo * es, pk * es)] for plo, pk in parts]
    blobs = exchange(comm, sig, out, deadline, into)
    _fold_part(comm, blobs, ptr + lo * es, nb, dtype, red, keep_at=base + r * nb)
    return parts


def allreduce(
    comm: Communicator, t: torch.Tensor, dtype: int, red: int, small: int, deadline: float
) -> None:
    """In-place allreduce over TCP (see the module docstring)."""
    seq, w, r, es = comm.next_op(), comm.world, comm.rank, t.element_size()
    nbytes, base = t.numel() * es, t.data_ptr() if t.numel() else 0
    if comm.local is None and w > 1 and nbytes > small:
        _Pieces(comm, seq, base, t.numel(), es, dtype, red).run(deadline)
        return
    step = 0
    for lo, m in _chunks(t.numel(), max(1, comm.chunk // es)):
        ptr, nb = base + lo * es, m * es
        sig = make_sig(seq, OP_ALLREDUCE, dtype, red, -1, nbytes, step)
        if nb <= small or w == 1:
            sc = _scratch(comm, nb * w)
            blobs = exchange(comm, sig, [[(ptr, nb)]] * w, deadline, _slots(sc, nb, w))
            _fold_part(comm, blobs, ptr, nb, dtype, red)
            step += 1
            continue
        parts = _scatter_reduce(comm, sig, ptr, m, es, dtype, red, deadline)
        mine = (ptr + parts[r][0] * es, parts[r][1] * es)
        sig = make_sig(seq, OP_ALLREDUCE, dtype, red, -1, nbytes, step + 1)
        into = [(ptr + plo * es, k * es) for plo, k in parts]
        blobs = exchange(comm, sig, [[mine]] * w, deadline, into)
        for q, (plo, k) in enumerate(parts):
            if q != r and k:
                _copy(ptr + plo * es, _expect(blobs[q], k * es, q), k * es)
        step += 2


PIECE_BYTES = 1 << 20  # piece of a part in the pipelined allreduce (at most chunk / 4)
RING = 2  # receive slots per peer of the pipelined allreduce (pieces received ahead of folds)
LAG = 1  # the pipelined allreduce sends piece j's result after piece j + LAG of its input
# input piece j waits for result j - RING, which comes after input j + LAG - RING on its socket
assert RING > LAG, "the pipelined allreduce's flow control would wait on a later frame"


class _Pieces:
    """Pipelined allreduce of a TCP-only group: reduce-scatter and all-gather in one transfer.

    Rank q owns part q of the tensor, cut into pieces. Every rank sends piece j of part q to
    q, which folds it in rank order as soon as every peer's piece j is in (``on_notify`` of
    the transfer) and sends the folded piece j to every peer -- while the pieces after j are
    still streaming in. Per socket the frames go in one fixed order, ``RS0 .. RS(LAG-1)``,
    then ``RS(j + LAG), AG j`` for each j (``RS``: reduce-scatter input, ``AG``: folded
    result), on both paths below. A piece's receive slot is reused ``RING`` pieces later;
    the flow control that keeps a slot from being overwritten before its fold read it is
    the sender's: rank r sends q input piece j only once it received q's result piece
    ``j - RING`` (q folds piece ``j - RING`` before it sends that result). No receive waits
    on anything but its socket, so every socket is read in order all through the call and
    a peer's ABORT frame (or a mismatched frame) is read and routed as soon as it is next
    on its socket. (Before the twelfth session a receive waited behind a gate until that
    fold: with three or more ranks its socket stayed unread, a peer's ABORT behind it, while
    the rank that should have fed the fold had given up.) The results are received straight
    into the tensor. Every frame carries the call's signature
    with its own step (``2 j`` / ``2 j + 1``), every rank sends every peer an input frame
    for every piece, so a mismatched call is detected as in an exchange.
    """

    def __init__(
        self, comm: Communicator, seq: int, base: int, numel: int, es: int, dtype: int, red: int
    ) -> None:
        w = comm.world
        self.comm, self.seq, self.base, self.es, self.dtype, self.red = (
            comm,
            seq,
            base,
            es,
            dtype,
            red,
        )
        self.nbytes = numel * es
        self.parts = _parts(numel, w)
        self.pe = max(1, min(PIECE_BYTES, comm.chunk // 4) // es)  # elements per piece
        self.n = max(1, math.ceil(max(k for _, k in self.parts) / self.pe))
        self.epoch = comm.epoch
        comm.epoch += 2 * self.n
        self.peers = [(comm.rank + k) % w for k in range(1, w)]
        order = [(j, 0) for j in range(min(LAG, self.n))]
        for j in range(self.n):
            order += [(j + LAG, 0)] if j + LAG < self.n else []
            order.append((j, 1))
        self.order = order  # (piece, 0: input / 1: result) in the order of every socket
        self.got = [0] * self.n  # peers' input pieces in, per piece

    def piece(self, q: int, j: int) -> tuple[int, int]:
        """(address, bytes) of piece j of part q in the tensor."""
        lo, k = self.parts[q]
        a = min(k, j * self.pe)
        return self.base + (lo + a) * self.es, (min(k, a + self.pe) - a) * self.es

    def sig(self, j: int, result: int) -> tuple[int, int, int, int]:
        return make_sig(
            self.seq, OP_ALLREDUCE, self.dtype, self.red, -1, self.nbytes, 2 * j + result
        )

    def fold(self, j: int, slot: Callable[[int, int], int]) -> None:
        """Piece j of my part = the fold of every rank's piece j (received into ``slot``)."""
        comm, w, r = self.comm, self.comm.world, self.comm.rank
        dst, nb = self.piece(r, j)
        blobs = [Blob(slot(j, q), nb) for q in range(w)]
        _fold_part(comm, blobs, dst, nb, self.dtype, self.red, keep_at=slot(j, r))

    def frames(self, slot: Callable[[int, int], int]) -> tuple[list[XSend], list[XRecv]]:
        """Every frame of the call, in socket order; input receives go to ``slot(j, q)``."""
        comm, r, gid = self.comm, self.comm.rank, self.comm.group_id
        sends, recvs = list[XSend](), list[XRecv]()
        result_in: dict[tuple[int, int], int] = {}  # (piece, peer) -> its result's receive
        for j, res in self.order:
            e, sig = self.epoch + 2 * j + res, self.sig(j, res)
            for q in self.peers:
                g = comm.ranks[q]
                if res:
                    mine = self.piece(r, j)
                    sends.append(XSend(g, Kind.COLL, gid, e, *mine, sig, gate=j + 1))
                    result_in[j, q] = len(recvs)
                    recvs.append(XRecv(g, gid, e, sig, *self.piece(q, j)))
                else:
                    # q's slot for piece j is free once q sent the result of piece j - RING
                    k = result_in[j - RING, q] if j >= RING else -1
                    sends.append(XSend(g, Kind.COLL, gid, e, *self.piece(q, j), sig, k, max(k, 0)))
                    nb = self.piece(r, j)[1]
                    recvs.append(XRecv(g, gid, e, sig, slot(j, q), nb, notify=True))
        return sends, recvs

    def run(self, deadline: float) -> None:
        comm, w = self.comm, self.comm.world
        size = self.pe * self.es
        ring = _scratch(comm, RING * w * size)

        def slot(j: int, q: int) -> int:
            return ring + ((j % RING) * w + q) * size

        sends, recvs = self.frames(slot)

        def on_notify(i: int) -> list[int]:
            j = (recvs[i].seq - self.epoch) >> 1
            self.got[j] += 1
            if self.got[j] < w - 1:
                return []
            self.fold(j, slot)
            return [j + 1]  # its result may go

        comm._last_sig = self.sig(0, 0)
        frames = comm.mesh.transfer(sends, recvs, deadline, comm.check, on_notify, comm.cut_short)
        if frames is None:
            self.mailbox_path(deadline)
            return
        _check_frames(comm, frames, [(x.peer, x.sig) for x in recvs])
        comm._last_sig = self.sig(self.n - 1, 1)

    def mailbox_path(self, deadline: float) -> None:
        """The same frames in the same order when the connections cannot be owned now
        (another collective holds one): received by the reader threads into posted targets,
        with a slot per piece here (no reuse), and the same flow control (input piece j goes
        to a peer once its result piece ``j - RING`` is in: the peer's slots are reused)."""
        comm, w = self.comm, self.comm.world
        size = self.pe * self.es
        buf = torch.empty(max(1, self.n * w * size), dtype=torch.uint8)

        def slot(j: int, q: int) -> int:
            return buf.data_ptr() + (j * w + q) * size

        sends, recvs = self.frames(slot)
        with PostedTargets(comm.mesh, deadline) as posted:
            for x in recvs:
                if x.size:
                    posted.post(x.key, Target(x.ptr, x.size, x.sig), x.peer)
            i, done = 0, set[int]()
            for j, res in self.order:
                # the input pieces of j, or (before input piece j goes) the results of j - RING
                want = self.epoch + 2 * j if res else self.epoch + 2 * (j - RING) + 1
                if res or j >= RING:
                    for k, x in enumerate(recvs):
                        if x.seq == want:
                            self.receive(x, deadline)
                            done.add(k)
                if res:
                    self.fold(j, slot)
                batch = sends[i : i + len(self.peers)]
                comm.mesh.send_all(
                    [(x.peer, x.kind, x.group, x.seq, _view(x.ptr, x.size), x.sig) for x in batch],
                    deadline,
                    comm.check,
                )
                i += len(self.peers)
            for k, x in enumerate(recvs):
                if (x.seq - self.epoch) & 1 and k not in done:
                    self.receive(x, deadline)
        comm._last_sig = self.sig(self.n - 1, 1)

    def receive(self, x: XRecv, deadline: float) -> None:
        """One frame through the mailbox, checked, in place at ``x.ptr``."""
        comm = self.comm
        comm._last_sig = x.sig
        hdr, body = comm.mesh.mailbox.get(x.key, deadline, comm.check)
        q = comm.ranks.index(x.peer)
        check_sig(q, hdr.sig, x.sig)
        if body is not RECEIVED:
            _copy(x.ptr, _expect(Blob(_addr(body), len(body), body), x.size, q), x.size)


def reduce(
    comm: Communicator, t: torch.Tensor, root: int, dtype: int, red: int, deadline: float
) -> None:
    """In-place reduce into ``root``'s tensor (``t`` is scratch on the other ranks)."""
    seq, w, r, es = comm.next_op(), comm.world, comm.rank, t.element_size()
    nbytes, base = t.numel() * es, t.data_ptr() if t.numel() else 0
    for i, (lo, m) in enumerate(_chunks(t.numel(), max(1, comm.chunk // es))):
        ptr = base + lo * es
        sig = make_sig(seq, OP_REDUCE, dtype, red, root, nbytes, 2 * i)
        parts = _scatter_reduce(comm, sig, ptr, m, es, dtype, red, deadline)
        mine = (ptr + parts[r][0] * es, parts[r][1] * es)
        out = [[mine] if q == root else [] for q in range(w)]
        into = [(ptr + plo * es, k * es) if r == root else EMPTY for plo, k in parts]
        blobs = exchange(
            comm,
            make_sig(seq, OP_REDUCE, dtype, red, root, nbytes, 2 * i + 1),
            out,
            deadline,
            into,
        )
        if r == root:
            for q, (plo, k) in enumerate(parts):
                if q != r and k:
                    _copy(ptr + plo * es, _expect(blobs[q], k * es, q), k * es)


def broadcast(
    comm: Communicator, t: torch.Tensor, root: int, dtype: int, small: int, deadline: float
) -> None:
    """Broadcast: a pipelined chain in TCP-only groups (at every size: at 4 KB over four
    ranks its ``2 (W - 1)`` frames beat the one-round exchange's ``W (W - 1)``); in hybrid
    groups one round for a small chunk, else scatter + all-gather of its parts."""
    seq, w, r = comm.next_op(), comm.world, comm.rank
    nbytes, base = t.numel() * t.element_size(), t.data_ptr() if t.numel() else 0
    if w > 1 and comm.local is None:
        _chain_broadcast(comm, seq, base, nbytes, root, dtype, deadline)
        return
    step = 0
    for lo, nb in _chunks(nbytes, comm.chunk):
        ptr = base + lo
        sig = make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, step)
        if nb <= small or w <= 2:
            out = [[(ptr, nb)] if r == root else [] for _ in range(w)]
            into: list[tuple[int, int] | None]
            into = [(ptr, nb) if q == root and r != root else EMPTY for q in range(w)]
            blobs = exchange(comm, sig, out, deadline, into)
            if r != root and nb:
                _copy(ptr, _expect(blobs[root], nb, root), nb)
            step += 1
            continue
        parts = _parts(nb, w)
        out = [[(ptr + parts[q][0], parts[q][1])] if r == root else [] for q in range(w)]
        mine = (ptr + parts[r][0], parts[r][1])  # the root's own part travels in round 2
        into = [mine if q == root else None for q in range(w)]
        blobs = exchange(comm, sig, out, deadline, into)
        if r != root and parts[r][1]:
            _copy(ptr + parts[r][0], _expect(blobs[root], parts[r][1], root), parts[r][1])
        out = [[mine] if q != root else [] for q in range(w)]
        sig = make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, step + 1)
        into = [
            (ptr + plo, k) if r != root and q != root else None for q, (plo, k) in enumerate(parts)
        ]
        blobs = exchange(comm, sig, out, deadline, into)
        if r != root:
            for q, (plo, k) in enumerate(parts):
                if q != r and k:
                    _copy(ptr + plo, _expect(blobs[q], k, q), k)
        step += 2


PIPELINE_BYTES = 1 << 20  # piece size of the pipelined chain broadcast (at most the chunk)


def _chain_broadcast(
    comm: Communicator, seq: int, base: int, nbytes: int, root: int, dtype: int, deadline: float
) -> None:
    """Pipelined chain root -> root+1 -> ... -> root-1 in pieces of ``PIPELINE_BYTES``.

    Each rank posts every piece's frame from its parent as a receive target in the tensor
    itself (the connection's reader thread receives piece k + 1 while this thread forwards
    piece k to the child), so every link of the chain is busy at once and each rank sends
    and receives ``n`` bytes once -- the root too (a tree's root sends ``n log2 W``). Then an
    empty acknowledgement travels back up the chain: each rank waits for its child's
    (checking its signature) before sending its own to its parent, so the root -- which
    receives nothing else -- and every rank above a mismatched one fail in the call itself,
    and every rank below it receives from or through it and detects the mismatch too (the
    detecting rank's error reaches the rest as an ABORT frame while they wait). A tree would
    let a leaf whose parent agrees with it complete beside a mismatched sibling.
    ``2 (W - 1)`` frames for a one-piece tensor instead of an all-to-all exchange's
    ``W (W - 1)``. (This is the mailbox path; the native transfer, :func:`_chain_direct`,
    sends the acknowledgements before the payload is in.)
    """
    w, r = comm.world, comm.rank
    pos = (r - root) % w
    pieces = _chunks(nbytes, min(comm.chunk, PIPELINE_BYTES))
    up, downs = pos - 1, [pos + 1] if pos < w - 1 else []
    prev = comm.ranks[(up + root) % w] if pos else -1
    kids = [comm.ranks[(d + root) % w] for d in downs]
    sigs = [make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, k) for k in range(len(pieces))]
    sigs.append(make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, len(pieces)))  # the ack
    epoch0 = comm.epoch
    comm.epoch += len(pieces) + 1
    mailbox, gid = comm.mesh.mailbox, comm.group_id
    keys = [(gid, int(Kind.COLL), prev, epoch0 + k) for k in range(len(pieces))]

    def receive(src: int, k: int) -> bytearray:
        hdr, body = mailbox.get((gid, int(Kind.COLL), src, epoch0 + k), deadline, comm.check)
        check_sig(comm.ranks.index(src), hdr.sig, sigs[k])
        return body

    if _chain_direct(comm, epoch0, base, pieces, sigs, prev, kids, deadline):
        return
    with PostedTargets(comm.mesh, deadline) as posted:
        if prev >= 0:
            for k, (lo, nb) in enumerate(pieces):
                posted.post(keys[k], Target(base + lo, nb, sigs[k]), prev)
        for k, (lo, nb) in enumerate(pieces):
            comm._last_sig = sigs[k]
            if prev >= 0:
                body = receive(prev, k)
                if body is not RECEIVED:
                    _copy(base + lo, _expect(Blob(_addr(body), len(body), body), nb, prev), nb)
            comm.mesh.send_all(
                [(kid, Kind.COLL, gid, epoch0 + k, _view(base + lo, nb), sigs[k]) for kid in kids],
                deadline,
                comm.check,
            )
    comm._last_sig = sigs[-1]
    for kid in kids:
        receive(kid, len(pieces))
    if prev >= 0:
        comm.mesh.send_all(
            [(prev, Kind.COLL, gid, epoch0 + len(pieces), b"", sigs[-1])], deadline, comm.check
        )


def _check_frames(
    comm: Communicator, frames: Sequence[Frame | None], want: Sequence[tuple]
) -> None:
    """Raise for the first frame whose signature is not the expected one (a mismatched call);
    every frame must be present."""
    for frame, (src, sig) in zip(frames, want, strict=True):
        if frame is not None:
            check_sig(comm.ranks.index(src), frame[0].sig, sig)
    if any(f is None for f in frames):
        raise CommError(f"rank {comm.rank}: a transfer ended with receives missing")


def _chain_direct(
    comm: Communicator,
    epoch0: int,
    base: int,
    pieces: Sequence[tuple[int, int]],
    sigs: Sequence[tuple[int, int, int, int]],
    prev: int,
    kids: Sequence[int],
    deadline: float,
) -> bool:
    """The chain broadcast of :func:`_chain_broadcast` as one native transfer: receive
    every piece from the parent into the tensor, forward piece k to the children as soon as
    it is in -- no return to Python per piece.

    The acknowledgements do not wait for the payload: a leaf sends its own as it enters the
    call, any other rank once every child's arrived. An acknowledgement's header carries the
    sender's signature of the whole call (op, dtype, root, byte count), which the parent
    compares with its own, so the root completes only when every rank issued the same call
    -- every rank above a mismatched one still fails in the call -- while the acks travel
    up as the payload streams down (the root no longer waits for the last byte to reach the
    last rank and an ack to come back). The payload's frames are checked the same way by
    their receivers. False (nothing sent) when the connections cannot be owned now."""
    gid, n = comm.group_id, len(pieces)
    recvs = []
    if prev >= 0:
        recvs = [
            XRecv(prev, gid, epoch0 + k, sigs[k], base + lo, nb)
            for k, (lo, nb) in enumerate(pieces)
        ]
    recvs += [XRecv(kid, gid, epoch0 + n, sigs[n], 0, 0) for kid in kids]
    sends = []
    for k, (lo, nb) in enumerate(pieces):
        after = k if prev >= 0 else -1
        sends += [
            XSend(kid, Kind.COLL, gid, epoch0 + k, base + lo, nb, sigs[k], after) for kid in kids
        ]
    if prev >= 0:  # the acknowledgement: a leaf's at once, another's after its children's
        after = len(recvs) - 1 if kids else -1
        sends.append(XSend(prev, Kind.COLL, gid, epoch0 + n, 0, 0, sigs[n], after, n))
    comm._last_sig = sigs[0]
    frames = comm.mesh.transfer(sends, recvs, deadline, comm.check, on_cut=comm.cut_short)
    if frames is None:
        return False
    want = [(x.peer, x.sig) for x in recvs]
    _check_frames(comm, frames, want)
    comm._last_sig = sigs[-1]
    return True


def gather(
    comm: Communicator,
    inp: int,
    nbytes: int,
    outs: Sequence[int] | None,
    root: int,
    dtype: int,
    deadline: float,
) -> None:
    """Every rank sends ``nbytes`` at ``inp`` to ``root`` only."""
    seq, w, r = comm.next_op(), comm.world, comm.rank
    for step, (lo, nb) in enumerate(_chunks(nbytes, comm.chunk)):
        out = [[(inp + lo, nb)] if q == root else [] for q in range(w)]
        if r == root and outs is not None:
            into = [(o + lo, nb) for o in outs]
        else:
            into = [EMPTY] * w
        blobs = exchange(
            comm, make_sig(seq, OP_GATHER, dtype, 0, root, nbytes, step), out, deadline, into
        )
        if r == root and outs is not None and nb:
            for q in range(w):
                src = inp + lo if q == r else _expect(blobs[q], nb, q)
                _copy(outs[q] + lo, src, nb)


def allgather(
    comm: Communicator, inp: int, nbytes: int, outs: Sequence[int], dtype: int, deadline: float
) -> None:
    """Every rank sends its ``nbytes`` at ``inp`` to every peer, received straight into
    ``outs[q]`` (no staging buffer); its own block is copied into ``outs[rank]`` once."""
    seq, w, r = comm.next_op(), comm.world, comm.rank
    if nbytes:
        _copy(outs[r], inp, nbytes)
    for step, (lo, nb) in enumerate(_chunks(nbytes, comm.chunk)):
        sig = make_sig(seq, OP_ALLGATHER, dtype, 0, -1, nbytes, step)
        into = [(o + lo, nb) for o in outs]
        blobs = exchange(comm, sig, [[(inp + lo, nb)]] * w, deadline, into)
        for q in range(w):
            if q != r and nb:
                _copy(outs[q] + lo, _expect(blobs[q], nb, q), nb)


def scatter(
    comm: Communicator,
    ins: Sequence[int] | None,
    out: int,
    nbytes: int,
    root: int,
    dtype: int,
    deadline: float,
) -> None:
    """``root`` sends piece q (``nbytes`` at ``ins[q]``) to rank q only."""
    seq, w, r = comm.next_op(), comm.world, comm.rank
    for step, (lo, nb) in enumerate(_chunks(nbytes, comm.peer_chunk)):
        segs = [[(ins[q] + lo, nb)] if ins is not None else [] for q in range(w)]
        into = [(out + lo, nb) if q == root else EMPTY for q in range(w)]
        blobs = exchange(
            comm, make_sig(seq, OP_SCATTER, dtype, 0, root, nbytes, step), segs, deadline, into
        )
        if nb:
            src = ins[r] + lo if r == root and ins is not None else _expect(blobs[root], nb, root)
            _copy(out + lo, src, nb)


def reduce_scatter(
    comm: Communicator,
    ins: Sequence[int],
    out: int,
    numel: int,
    es: int,
    dtype: int,
    red: int,
    deadline: float,
) -> None:
    """Rank q receives only block q of every rank and folds them in rank order into ``out``."""
    seq, w, r = comm.next_op(), comm.world, comm.rank
    for step, (lo, m) in enumerate(_chunks(numel, max(1, comm.peer_chunk // es))):
        nb = m * es
        segs = [[(ins[q] + lo * es, nb)] for q in range(w)]
        sig = make_sig(seq, OP_REDUCE_SCATTER, dtype, red, -1, numel * es, step)
        scratch = _scratch(comm, nb * w)
        blobs = exchange(comm, sig, segs, deadline, _slots(scratch, nb, w))
        if nb:
            own, dst = ins[r] + lo * es, out + lo * es
            if r and own < dst + nb and dst < own + nb:
                # in place (``out`` is this rank's own block, as NCCL allows): rank 0's block is
                # copied into ``out`` first, so the own one is folded from its copy in the
                # scratch's unused own slot (it was read after being overwritten: rank 1 of two
                # got 2 instead of 11)
                ctypes.memmove(scratch + r * nb, own, nb)
                own = scratch + r * nb
            bases = [_expect(blobs[q], nb, q) if q != r else own for q in range(w)]
            reads = [(q, 0, out + lo * es, nb, COPY if q == 0 else FOLD) for q in range(w)]
            comm.apply(bases, reads, dtype, red)


def alltoall(
    comm: Communicator,
    ins: Sequence[int],
    in_lens: Sequence[int],
    outs: Sequence[int],
    out_lens: Sequence[int],
    dtype: int,
    deadline: float,
) -> None:
    """Rank r sends ``in_lens[d]`` bytes at ``ins[d]`` to rank d only.

    In a TCP-only group: one round (:func:`_direct_alltoall`). In a hybrid group the sizes are
    agreed first (every rank checks the whole matrix), then the blocks travel in exchange
    steps of ``peer_chunk`` bytes, the local ones through the arena.
    """
    if comm.local is None:
        _direct_alltoall(comm, ins, in_lens, outs, out_lens, dtype, deadline)
        return
    seq, w, r = comm.next_op(), comm.world, comm.rank
    mine = torch.tensor([*in_lens, *out_lens], dtype=torch.int64)
    sig = make_sig(seq, OP_ALLTOALL_SIZES, dtype, 0, -1, 16 * w, 0)
    blobs = exchange(comm, sig, [[(mine.data_ptr(), 16 * w)]] * w, deadline)
    rows = [
        mine.tolist()
        if q == r
        else list((ctypes.c_int64 * (2 * w)).from_address(_expect(blobs[q], 16 * w, q)))
        for q in range(w)
    ]
    for q in range(w):
        for d in range(w):
            if rows[q][d] != rows[d][w + q]:
                raise CollectiveMismatchError(
                    f"mismatched collectives on communicator {comm.name!r}: alltoall split sizes "
                    f"disagree: rank {q} sends {rows[q][d]} bytes to rank "
                    f"{d}, which expects {rows[d][w + q]} bytes from rank {q}"
                )
    if in_lens[r]:
        ctypes.memmove(outs[r], ins[r], in_lens[r])
    per = comm.peer_chunk
    longest = max(max(row[:w]) for row in rows)
    for k in range(max(1, math.ceil(longest / per))):
        lo = k * per
        segs = [
            [(ins[d] + lo, max(0, min(per, in_lens[d] - lo)))] if d != r else [] for d in range(w)
        ]
        into = [(outs[q] + lo, max(0, min(per, out_lens[q] - lo))) for q in range(w)]
        blobs = exchange(
            comm, make_sig(seq, OP_ALLTOALL, dtype, 0, -1, longest, k + 1), segs, deadline, into
        )
        for q in range(w):
            n = max(0, min(per, out_lens[q] - lo))
            if q != r and n:
                _copy(outs[q] + lo, _expect(blobs[q], n, q), n)


def _direct_alltoall(
    comm: Communicator,
    ins: Sequence[int],
    in_lens: Sequence[int],
    outs: Sequence[int],
    out_lens: Sequence[int],
    dtype: int,
    deadline: float,
) -> None:
    """One round: rank r sends its block for d to d as one frame (frames of at most
    ``max_frame`` bytes above that) whose signature carries the block's length; d receives it
    straight into ``outs[r]``.

    No separate size-agreement round: a frame's signature names the sender's op, dtype and
    block length, so the receiver itself detects a different collective or a split size it
    does not expect (:class:`CollectiveMismatchError` naming both sizes) and fails the group;
    a rank whose own blocks all agree may complete the call and then fails at its next
    collective, as a shared-memory broadcast receiver does.
    """
    seq, w, r = comm.next_op(), comm.world, comm.rank
    epoch, gid, mailbox = comm.epoch, comm.group_id, comm.mesh.mailbox
    comm.epoch += 1
    per = comm.mesh.max_frame

    def sig(n: int, k: int) -> tuple[int, int, int, int]:
        return make_sig(seq, OP_ALLTOALL, dtype, 0, -1, n, k)

    comm._last_sig = sig(in_lens[(r + 1) % w], 0)
    if in_lens[r] != out_lens[r]:
        # no peer checks a rank's block to itself (the shared-memory and hybrid paths check
        # the whole matrix): the copy below wrote in_lens[r] bytes into an out_lens[r]-byte
        # block -- past the end of the output when it is the last block, else stale rows.
        # (The c10d backend refuses this at the call; this guards direct callers.)
        raise CollectiveMismatchError(
            f"mismatched collectives on communicator {comm.name!r}: alltoall split sizes "
            f"disagree: rank {r} sends {in_lens[r]} bytes to rank {r}, which expects "
            f"{out_lens[r]} bytes from rank {r}"
        )
    if in_lens[r]:
        ctypes.memmove(outs[r], ins[r], in_lens[r])
    sends, recvs, expect = list[XSend](), list[XRecv](), list[tuple[int, int]]()
    for d in ((r + k) % w for k in range(1, w)):  # every pair: at least one (empty) frame
        n = in_lens[d]
        for k, lo in enumerate(range(0, max(n, 1), per)):
            m = min(per, n - lo) if n else 0
            sends.append(XSend(comm.ranks[d], Kind.COLL, gid, epoch, ins[d] + lo, m, sig(n, k)))
    for q in ((r - k) % w for k in range(1, w)):
        n = out_lens[q]
        for k, lo in enumerate(range(0, max(n, 1), per)):
            m = min(per, n - lo) if n else 0
            recvs.append(XRecv(comm.ranks[q], gid, epoch, sig(n, k), outs[q] + lo, m))
            expect.append((q, n))
    got = comm.mesh.transfer(sends, recvs, deadline, comm.check, on_cut=comm.cut_short)
    if got is not None:
        for frame, x, (q, n) in zip(got, recvs, expect, strict=True):
            if frame is not None and frame[0].sig[1] == x.sig[1] and frame[0].sig[2] != n:
                raise CollectiveMismatchError(
                    f"mismatched collectives on communicator {comm.name!r}: alltoall split "
                    f"sizes disagree: rank {q} sends {frame[0].sig[2]} bytes to "
                    f"rank {r}, which expects {n} bytes from rank {q}"
                )
        _check_frames(comm, got, [(x.peer, x.sig) for x in recvs])
        return
    key = [(gid, int(Kind.COLL), comm.ranks[q], epoch) for q in range(w)]
    with PostedTargets(comm.mesh, deadline) as posted:
        for q in range(w):
            if q != r and out_lens[q]:
                target = Target(outs[q], min(per, out_lens[q]), sig(out_lens[q], 0))
                posted.post(key[q], target, key[q][2])
        frames: list[tuple[int, Kind, int, int, bytes | bytearray | memoryview, tuple]] = []
        for d in ((r + k) % w for k in range(1, w)):  # every pair: at least one (empty) frame
            n = in_lens[d]
            for k, lo in enumerate(range(0, max(n, 1), per)):
                payload = _view(ins[d] + lo, min(per, n - lo)) if n else b""
                frames.append((comm.ranks[d], Kind.COLL, gid, epoch, payload, sig(n, k)))
        comm.mesh.send_all(frames, deadline, comm.check)
        for q in ((r - k) % w for k in range(1, w)):
            n = out_lens[q]
            for k, lo in enumerate(range(0, max(n, 1), per)):
                want = sig(n, k)
                hdr, body = mailbox.get(key[q], deadline, comm.check)
                if hdr.sig[1] == want[1] and hdr.sig[2] != want[2]:
                    raise CollectiveMismatchError(
                        f"mismatched collectives on communicator {comm.name!r}: alltoall split "
                        f"sizes disagree: rank {q} sends {hdr.sig[2]} bytes to "
                        f"rank {r}, which expects {n} bytes from rank {q}"
                    )
                check_sig(q, hdr.sig, want)
                m = min(per, n - lo)
                if body is not RECEIVED and m:
                    _copy(outs[q] + lo, _expect(Blob(_addr(body), len(body), body), m, q), m)
