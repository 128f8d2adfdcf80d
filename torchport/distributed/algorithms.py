"""Collective algorithms written as sequences of communicator steps.

Every function here runs on the communicator's engine thread and is deterministic: all ranks
compute the same step sequence and signatures from agreed inputs, so a disagreement (different
op, dtype, size or root) is caught at the first step by the signature check. Tensors arrive
contiguous (the backend makes contiguous copies and writes them back); sizes are in bytes for
pure data movement and in elements where a reduction needs them.

Algorithms (``W`` ranks, ``C`` = chunk bytes per step):

- allreduce: on shared memory the whole chunk loop is one native call
  (``tp_shm_allreduce``): a tensor up to ``min(SMALL_BYTES, chunk / 4)`` is reduced by every
  rank from every rank's published copy (one step); a larger one uses reduce-scatter then
  all-gather inside the arena: rank q owns the q-th contiguous 1/W of the tensor and folds it
  block by block with three-operand folds straight from the peers' slots, the ranks waiting on
  one another's per-block counters between a first barrier and a closing arrival. Either way
  every element is folded in rank order 0, 1, ..., W-1, so every rank
  gets bitwise identical results, equal to the reference :func:`allreduce_reference`.
- groups without an arena of their own (TCP, hybrid) run the per-peer exchange algorithms of
  :mod:`~torchport.distributed.algorithms_tcp`, except allgather and barrier, whose publish-to-all
  step is already what every peer needs.
- broadcast / reduce / gather / allgather / scatter / reduce_scatter / alltoall: one publish and
  direct reads per chunk; alltoall first exchanges the full split matrix, so mismatched splits
  are reported on every rank; past one slot a rank's own piece goes straight from its input
  to its output.
- copies into an output of at least ``dist_stream_bytes`` (32 MiB) use streaming stores (read
  mode ``STREAM``): at 64 MB, world 2, broadcast took 24 %, allgather 11 % and alltoall 32 %
  less time (medians of A/B runs on a Zen 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchport.distributed import algorithms_tcp as tcp
from torchport.distributed.engine import (
    OP_ALLGATHER,
    OP_ALLREDUCE,
    OP_ALLTOALL,
    OP_ALLTOALL_SIZES,
    OP_BARRIER,
    OP_BROADCAST,
    OP_GATHER,
    OP_REDUCE,
    OP_REDUCE_SCATTER,
    OP_SCATTER,
    Communicator,
    make_sig,
)
from torchport.distributed.engine import chunk_ranges as _chunks
from torchport.distributed.errors import CollectiveMismatchError
from torchport.distributed.transport_shm import COPY, FOLD, STREAM

SMALL_BYTES = 256 << 10


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr() if t.numel() else 0


def barrier(comm: Communicator, deadline: float) -> None:
    comm.step(make_sig(comm.next_op(), OP_BARRIER, 0, 0, -1, 0, 0), [], [], 0, 0, deadline)


def allreduce(comm: Communicator, t: torch.Tensor, dtype: int, red: int, deadline: float) -> None:
    """In-place allreduce of a contiguous tensor (SUM/PRODUCT/MIN/MAX/BAND/BOR/BXOR codes)."""
    if comm.arena is None:
        tcp.allreduce(comm, t, dtype, red, _small(comm), deadline)
        return
    es = t.element_size()
    nbytes = t.numel() * es
    sig = make_sig(comm.next_op(), OP_ALLREDUCE, dtype, red, -1, nbytes, 0)
    # the whole chunk loop in one native call
    comm.shm_allreduce(sig, _ptr(t), nbytes, es, _small(comm), dtype, red, deadline)


def _copy(comm: Communicator, out_bytes: int) -> int:
    """The read mode that copies into an op's output of ``out_bytes`` in all: streaming stores
    for a large one (``dist_stream_bytes``; such an output is out of the caches by the time it
    is read anyway, and a cached store reads every line before writing it)."""
    return STREAM if 0 < comm.stream_bytes <= out_bytes else COPY


def _small(comm: Communicator) -> int:
    """Chunks up to this many bytes take the one-step (latency) path."""
    return min(SMALL_BYTES, comm.chunk // 4)


def reduce(
    comm: Communicator, t: torch.Tensor, root: int, dtype: int, red: int, deadline: float
) -> None:
    """In-place reduce into ``root``'s tensor (others keep their input)."""
    if comm.arena is None:
        tcp.reduce(comm, t, root, dtype, red, deadline)
        return
    seq, w, es = comm.next_op(), comm.world, t.element_size()
    nbytes, base = t.numel() * es, _ptr(t)
    for step, (lo, m) in enumerate(_chunks(t.numel(), max(1, comm.chunk // es))):
        ptr, nb = base + lo * es, m * es
        reads = (
            [(q, 0, ptr, nb, COPY if q == 0 else FOLD) for q in range(w)]
            if comm.rank == root
            else []
        )
        sig = make_sig(seq, OP_REDUCE, dtype, red, root, nbytes, step)
        comm.step(sig, [(ptr, nb)], reads, dtype, red, deadline)


def broadcast(comm: Communicator, t: torch.Tensor, root: int, dtype: int, deadline: float) -> None:
    if comm.arena is None:
        tcp.broadcast(comm, t, root, dtype, _small(comm), deadline)
        return
    seq, nbytes, base = comm.next_op(), t.numel() * t.element_size(), _ptr(t)
    mine = comm.rank == root
    if nbytes <= comm.chunk:  # one step, no chunk loop (4 KB world 2: 26.5 -> 24.6 us a call)
        sig = make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, 0)
        if mine:
            comm.step(sig, ((base, nbytes),), (), dtype, 0, deadline)
        else:
            comm.step(sig, (), ((root, 0, base, nbytes, _copy(comm, nbytes)),), dtype, 0, deadline)
        return
    mode = _copy(comm, nbytes)
    for step, (lo, nb) in enumerate(_chunks(nbytes, comm.chunk)):
        pubs = [(base + lo, nb)] if mine else []
        reads = [] if mine else [(root, 0, base + lo, nb, mode)]
        sig = make_sig(seq, OP_BROADCAST, dtype, 0, root, nbytes, step)
        comm.step(sig, pubs, reads, dtype, 0, deadline)


def allgather(
    comm: Communicator,
    inp: int,
    nbytes: int,
    outs: Sequence[int] | None,
    dtype: int,
    deadline: float,
    *,
    root: int = -1,
) -> None:
    """Every rank publishes ``nbytes`` at ``inp``; ranks with ``outs`` copy rank q's into outs[q].

    ``root >= 0`` makes it a gather (only the root passes ``outs``).
    """
    if comm.arena is None and root >= 0:
        tcp.gather(comm, inp, nbytes, outs, root, dtype, deadline)
        return
    if comm.arena is None and outs is not None:
        tcp.allgather(comm, inp, nbytes, outs, dtype, deadline)
        return
    seq = comm.next_op()
    op = OP_GATHER if root >= 0 else OP_ALLGATHER
    mode = _copy(comm, nbytes * len(outs)) if outs is not None else COPY
    for step, (lo, nb) in enumerate(_chunks(nbytes, comm.chunk)):
        reads = [(q, 0, o + lo, nb, mode) for q, o in enumerate(outs)] if outs is not None else []
        sig = make_sig(seq, op, dtype, 0, root, nbytes, step)
        comm.step(sig, [(inp + lo, nb)], reads, dtype, 0, deadline)


def scatter(
    comm: Communicator,
    ins: Sequence[int] | None,
    out: int,
    nbytes: int,
    root: int,
    dtype: int,
    deadline: float,
) -> None:
    """Root publishes ``nbytes`` for every rank; rank q copies its piece into ``out``."""
    if comm.arena is None:
        tcp.scatter(comm, ins, out, nbytes, root, dtype, deadline)
        return
    seq, w, r = comm.next_op(), comm.world, comm.rank
    per, mode = max(1, comm.chunk // w), _copy(comm, nbytes)
    for step, (lo, nb) in enumerate(_chunks(nbytes, per)):
        pubs = [(p + lo, nb) for p in ins] if ins is not None else []
        sig = make_sig(seq, OP_SCATTER, dtype, 0, root, nbytes, step)
        comm.step(sig, pubs, [(root, r * nb, out + lo, nb, mode)], dtype, 0, deadline)


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
    """Rank r gets the fold over ranks of everyone's ``ins[r]`` (``numel`` elements each)."""
    if comm.arena is None:
        tcp.reduce_scatter(comm, ins, out, numel, es, dtype, red, deadline)
        return
    seq, w, r = comm.next_op(), comm.world, comm.rank
    per = max(1, comm.chunk // (w * es))
    for step, (lo, m) in enumerate(_chunks(numel, per)):
        nb = m * es
        pubs = [(p + lo * es, nb) for p in ins]
        reads = [(q, r * nb, out + lo * es, nb, COPY if q == 0 else FOLD) for q in range(w)]
        sig = make_sig(seq, OP_REDUCE_SCATTER, dtype, red, -1, numel * es, step)
        comm.step(sig, pubs, reads, dtype, red, deadline)


def alltoall(
    comm: Communicator,
    ins: Sequence[int],
    in_lens: Sequence[int],
    outs: Sequence[int],
    out_lens: Sequence[int],
    dtype: int,
    deadline: float,
) -> None:
    """Rank r sends ``in_lens[d]`` bytes at ``ins[d]`` to rank d, receiving into ``outs``."""
    if comm.arena is None:
        tcp.alltoall(comm, ins, in_lens, outs, out_lens, dtype, deadline)
        return
    seq, w, r = comm.next_op(), comm.world, comm.rank
    # one native call exchanges every rank's sizes, and the pieces too when every rank's fit
    # beside its sizes in one slot
    mode = _copy(comm, sum(out_lens))
    sig = make_sig(seq, OP_ALLTOALL_SIZES, dtype, 0, -1, 16 * w, 0)
    flat = comm.shm_alltoall_sizes(sig, in_lens, out_lens, ins, outs, dtype, mode, deadline)
    if flat is None:
        return
    rows = [flat[2 * w * q : 2 * w * (q + 1)] for q in range(w)]
    sends = [row[:w] for row in rows]  # sends[q][d]: bytes rank q sends to rank d
    for q in range(w):
        for d in range(w):
            if sends[q][d] != rows[d][w + q]:
                raise CollectiveMismatchError(
                    f"mismatched collectives on communicator {comm.name!r}: alltoall split sizes "
                    f"disagree: rank {q} sends {sends[q][d]} bytes to rank "
                    f"{d}, which expects {rows[d][w + q]} bytes from rank {q}"
                )
    # Rank q publishes its pieces for the other ranks in rank order, as many steps as the
    # longest of those takes; its own piece goes straight from its input to its output once
    # the exchange is done (one copy, not two through its slot, and no step for it alone).
    per = max(1, comm.chunk // w)
    longest = max((sends[q][d] for q in range(w) for d in range(w) if q != d), default=0)
    nsteps = max(1, math.ceil(longest / per))
    for k in range(nsteps):
        lo = k * per
        pubs = [(ins[d] + lo, max(0, min(per, in_lens[d] - lo))) for d in range(w) if d != r]
        reads = []
        for q in range(w):
            offs = [max(0, min(per, n - lo)) for n in sends[q]]
            if offs[r] and q != r:
                at_q = sum(offs[d] for d in range(r) if d != q)
                reads.append((q, at_q, outs[q] + lo, offs[r], mode))
        sig = make_sig(seq, OP_ALLTOALL, dtype, 0, -1, longest, k + 1)
        comm.step(sig, pubs, reads, dtype, 0, deadline)
    if in_lens[r]:
        comm.apply([ins[r]], [(0, 0, outs[r], in_lens[r], mode)], dtype, 0)


# -- references: single-process semantics the fast paths must match ------------------------
def fold_reference(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Fold rank 0, 1, ... in order with torch ops in the tensors' dtype (the exact contract)."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op == "SUM":
            acc = acc | t if acc.dtype == torch.bool else acc + t
        elif op == "PRODUCT":
            acc = acc & t if acc.dtype == torch.bool else acc * t
        elif op == "MIN":
            acc = acc & t if acc.dtype == torch.bool else torch.minimum(acc, t)
        elif op == "MAX":
            acc = acc | t if acc.dtype == torch.bool else torch.maximum(acc, t)
        elif op == "BAND":
            acc = acc & t
        elif op == "BOR":
            acc = acc | t
        elif op == "BXOR":
            acc = acc ^ t
        else:
            raise ValueError(f"unknown reduce op {op!r}")
    return acc


def allreduce_reference(
    tensors: Sequence[torch.Tensor], op: str, factor: float = 1.0
) -> torch.Tensor:
    """What every rank holds after ``all_reduce`` of ``tensors[q]`` on rank q."""
    if op == "AVG" and tensors and tensors[0].dtype == torch.float16:  # (PREMUL_AVG_DTYPES)
        return fold_reference([t * (1.0 / len(tensors)) for t in tensors], "SUM")
    if op == "AVG":
        return fold_reference(tensors, "SUM").div_(len(tensors))
    if op == "PREMUL_SUM":
        return fold_reference([t * factor for t in tensors], "SUM")
    return fold_reference(tensors, op)
