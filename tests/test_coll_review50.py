"""Values of the ``torchport`` c10d collectives: review findings, each pinned by a test that
failed before its fix.

* a conjugate or negative view (``x.conj()``, ``torch._neg_view(x)``, ``x.conj().imag``) was
  moved and folded as its raw memory, which holds the conjugate / negation of its values:
  reduce, reduce_scatter(_tensor) and gather gave wrong values (all_reduce MAX of a negative
  view the minimum), and a send of a negative view raised an untyped RuntimeError;
* two async ops issued back to back on one non-contiguous tensor lost the first one's result:
  the second op's contiguous copy was taken when it was issued, before the first op ran;
* a reduce_scatter_tensor output, or a scatter root's output, overlapping the input(s) other
  than as its own block was corrupted on shared memory (chunks written over input bytes still
  to be published);
* an all_gather / gather / all_to_all output list whose tensors overlap one another
  (``[o] * world_size``) ended with different values on different ranks (arrival order);
* the mismatch error described the peer's call as ``collective #0 ...(bytes=0 ...) step 0``;
* ReduceOp.PREMUL_SUM with a complex factor raised an untyped TypeError.

Multi-rank cases run on real processes (``run_world``: forkserver, file:// rendezvous, a hard
timeout, every child killed at the end), on shared memory and over TCP.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

TIMEOUT = datetime.timedelta(seconds=20)
TRANSPORTS = ("shm", "tcp")
W = 3


def _init(rank: int, world: int, init: str) -> Any:
    dist.init_process_group(
        "torchport", init_method=init, rank=rank, world_size=world, timeout=TIMEOUT
    )
    return dist.distributed_c10d._get_default_group()


def _c(rank: int, n: int = 4) -> torch.Tensor:
    """Rank ``rank``'s complex data (distinct real and imaginary parts)."""
    k = torch.arange(n, dtype=torch.float32)
    return torch.complex(k + 1, k + 10) * (rank + 1)


def _r(rank: int, n: int = 4) -> torch.Tensor:
    """Rank ``rank``'s real data (distinct per rank and element, of mixed sign)."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) - 2.0


# -- 1: conjugate and negative views ---------------------------------------------------------
def _views_job(rank: int, world: int, init: str) -> dict[str, Any]:
    pg = _init(rank, world, init)
    got: dict[str, Any] = {}

    def check(name: str, value: torch.Tensor, want: torch.Tensor) -> None:
        got[name] = bool(torch.equal(value.resolve_conj().resolve_neg(), want))

    conj = [_c(q).conj() for q in range(world)]  # every rank's conjugate view, as values
    want_sum = sum(t.resolve_conj() for t in conj)
    # reduce of a conjugate view (the root's memory was folded raw, the others' resolved)
    t = _c(rank).conj()
    dist.reduce(t, dst=1)
    if rank == 1:
        check("reduce conj in", t, want_sum)
    # reduce_scatter_tensor: a conjugate input, a conjugate output
    inp = torch.cat([_c(rank + q) for q in range(world)]).conj()
    out = torch.zeros(4, dtype=torch.complex64)
    dist.reduce_scatter_tensor(out, inp)
    check("rst conj in", out, sum(_c(q + rank).conj() for q in range(world)).resolve_conj())
    out = torch.zeros(4, dtype=torch.complex64).conj()
    dist.reduce_scatter_tensor(out, torch.cat([_c(rank + q) for q in range(world)]))
    check("rst conj out", out, sum(_c(q + rank) for q in range(world)))
    # reduce_scatter (list) of conjugate inputs
    out = torch.zeros(4, dtype=torch.complex64)
    dist.reduce_scatter(out, [_c(rank + q).conj() for q in range(world)])
    check("rs list conj in", out, sum(_c(q + rank).conj() for q in range(world)).resolve_conj())
    # gather: a conjugate input; conjugate outputs
    outs = [torch.zeros(4, dtype=torch.complex64) for _ in range(world)] if rank == 0 else None
    dist.gather(_c(rank).conj(), outs, dst=0)
    if outs is not None:
        check("gather conj in", torch.stack(outs), torch.stack([t.resolve_conj() for t in conj]))
    outs = [torch.zeros(4, dtype=torch.complex64).conj() for _ in range(world)]
    dist.gather(_c(rank), outs if rank == 0 else None, dst=0)
    if rank == 0:
        check("gather conj out", torch.stack(outs), torch.stack([_c(q) for q in range(world)]))
    # the ops torch's Python layer refuses for a conjugate view (view_as_real), called on the
    # group as c10d's other callers do
    t = _c(rank).conj()
    pg.allreduce([t]).wait()
    check("allreduce conj (pg)", t, want_sum)
    t = _c(rank).conj() if rank == 2 else torch.zeros(4, dtype=torch.complex64).conj()
    pg.broadcast(t, 2).wait()
    check("broadcast conj (pg)", t, conj[2].resolve_conj())
    outs = [torch.zeros(4, dtype=torch.complex64) for _ in range(world)]
    pg.allgather([outs], [_c(rank).conj()]).wait()
    check(
        "allgather conj in (pg)", torch.stack(outs), torch.stack([t.resolve_conj() for t in conj])
    )
    big = torch.zeros(4 * world, dtype=torch.complex64).conj()
    pg._allgather_base(big, _c(rank)).wait()
    check("allgather_base conj out (pg)", big, torch.cat([_c(q) for q in range(world)]))
    out = torch.zeros(4, dtype=torch.complex64).conj()
    ins = [_c(q) for q in range(world)] if rank == 0 else []
    pg.scatter([out], [ins] if rank == 0 else [], 0).wait()
    check("scatter conj out (pg)", out, _c(rank))
    outs = [torch.zeros(4, dtype=torch.complex64) for _ in range(world)]
    pg.alltoall(outs, [_c(rank * 10 + d).conj() for d in range(world)]).wait()
    check(
        "alltoall conj in (pg)",
        torch.stack(outs),
        torch.stack([_c(q * 10 + rank).conj().resolve_conj() for q in range(world)]),
    )
    ts = [_c(rank).conj(), _c(rank + 5)]
    pg.allreduce_coalesced(ts).wait()
    check("allreduce_coalesced conj (pg)", ts[0], want_sum)
    # negative views of real tensors pass torch's Python layer
    t = torch._neg_view(-_r(rank))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check("all_reduce MAX neg", t, torch.stack([_r(q) for q in range(world)]).amax(0))
    t = torch._neg_view(-_r(rank))
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    check("all_reduce PRODUCT neg", t, torch.stack([_r(q) for q in range(world)]).prod(0))
    t = _c(rank, 8).conj().imag  # (a strided view with the negative bit)
    dist.broadcast(t, src=1)
    check("broadcast conj().imag", t, -_c(1, 8).imag)
    out = torch.zeros(4 * world)
    dist.all_gather_into_tensor(out, torch._neg_view(-_r(rank)))
    check("all_gather_into_tensor neg in", out, torch.cat([_r(q) for q in range(world)]))
    out = torch._neg_view(torch.zeros(world))
    dist.all_to_all_single(out, torch._neg_view(-_r(rank, world)))
    check("all_to_all_single neg", out, torch.stack([_r(q, world)[rank] for q in range(world)]))
    # point to point: a negative view sent (its byte view raised an untyped RuntimeError)
    if rank == 0:
        try:
            dist.send(torch._neg_view(-_r(7)), dst=1)
        except RuntimeError as e:  # (recorded: the values above are reported too)
            got["send neg"] = f"{type(e).__name__}: {e}"
            dist.send(_r(7), dst=1)
    elif rank == 1:
        t = torch.zeros(4)
        dist.recv(t, src=0)
        check("send neg", t, _r(7))
    dist.barrier()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_conjugate_and_negative_views_give_their_values(transport):
    res = run_world(_views_job, W, timeout=90, env={"TORCHPORT_DIST_TRANSPORT": transport})
    for rank, got in enumerate(res):
        assert got and all(v is True for v in got.values()), (
            rank,
            {k: v for k, v in got.items() if v is not True},
        )
    assert "reduce conj in" in res[1] and "send neg" in res[1]


# -- 2: chained async ops on a non-contiguous tensor -----------------------------------------
def _chain_job(rank: int, world: int, init: str) -> dict[str, Any]:
    _init(rank, world, init)
    s = sum(range(1, world + 1))
    got: dict[str, Any] = {}
    b = torch.full((2, 3), float(rank + 1))
    v = b.t()
    w1 = dist.all_reduce(v, async_op=True)
    w2 = dist.all_reduce(v, async_op=True)
    w1.wait()
    w2.wait()
    got["all_reduce x2"] = (b.unique().tolist(), [float(s * world)])
    big = torch.zeros(2, 3)
    w1 = dist.reduce_scatter_tensor(big.t(), torch.ones(world * 3, 2), async_op=True)
    w2 = dist.all_reduce(big.t(), async_op=True)
    w1.wait()
    w2.wait()
    got["reduce_scatter -> all_reduce"] = (big.unique().tolist(), [float(world * world)])
    big = torch.zeros(2, 3)
    ins = [torch.full((3, 2), float(q + 1)) for q in range(world)] if rank == 0 else None
    w1 = dist.scatter(big.t(), ins, src=0, async_op=True)
    w2 = dist.all_reduce(big.t(), async_op=True)
    w1.wait()
    w2.wait()
    got["scatter -> all_reduce"] = (big.unique().tolist(), [float(s)])
    b = torch.full((2, 3), float(rank + 1))
    w1 = dist.broadcast(b.t(), src=1, async_op=True)
    w2 = dist.reduce(b.t(), dst=0, async_op=True)
    w1.wait()
    w2.wait()
    if rank == 0:
        got["broadcast -> reduce"] = (b.unique().tolist(), [2.0 * world])
    dist.barrier()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chained_async_ops_on_a_strided_tensor_see_each_others_results(transport):
    res = run_world(_chain_job, W, timeout=90, env={"TORCHPORT_DIST_TRANSPORT": transport})
    for rank, got in enumerate(res):
        for name, (value, want) in got.items():
            assert value == want, (rank, name, value, want)
    assert "broadcast -> reduce" in res[0]


# -- 3 and 4: outputs overlapping inputs / one another ---------------------------------------
def _alias_job(rank: int, world: int, init: str, m: int) -> dict[str, Any]:
    _init(rank, world, init)
    got: dict[str, Any] = {}

    def data(q: int) -> torch.Tensor:
        return torch.randint(-50, 50, (world * m,), generator=torch.Generator().manual_seed(q))

    ref = sum(data(q) for q in range(world))
    # reduce_scatter_tensor into an unaligned window of its input (half a block off its own)
    inp = data(rank).float()
    off = rank * m + m // 2 if rank < world - 1 else rank * m - m // 2
    out = inp[off : off + m]
    dist.reduce_scatter_tensor(out, inp)
    got["rst unaligned"] = int((out != ref[rank * m : (rank + 1) * m]).sum())
    # ... and into its own block (the in-place form: no copy, still right)
    inp = data(rank).float()
    out = inp[rank * m : (rank + 1) * m]
    dist.reduce_scatter_tensor(out, inp)
    got["rst own block"] = int((out != ref[rank * m : (rank + 1) * m]).sum())
    # reduce_scatter (list) whose output is another input of the list, unaligned
    buf = data(rank).float()
    ins = [buf[q * m : (q + 1) * m] for q in range(world)]
    lo = (rank + 1) % world * m
    out = buf[lo + m // 2 : lo + m // 2 + m] if lo + m // 2 + m <= world * m else buf[:m]
    dist.reduce_scatter(out, ins)
    got["rs list aliased"] = int((out != ref[rank * m : (rank + 1) * m]).sum())
    # scatter whose root output overlaps its inputs, unaligned
    buf = torch.arange(float(world * m))
    want = buf[rank * m : (rank + 1) * m].clone()
    out = buf[m // 2 : m // 2 + m] if rank == 0 else torch.zeros(m)
    dist.scatter(out, list(buf.chunk(world)) if rank == 0 else None, src=0)
    got["scatter unaligned"] = int((out != want).sum())
    # output lists holding one tensor world_size times: the last rank's block on every rank
    o = torch.zeros(3)
    dist.all_gather([o] * world, torch.full((3,), float(rank)))
    got["all_gather [o]*w"] = o.tolist()
    o = torch.zeros(3)
    dist.gather(torch.full((3,), float(rank)), [o] * world if rank == 0 else None, dst=0)
    got["gather [o]*w"] = o.tolist() if rank == 0 else [float(world - 1)] * 3
    o = torch.zeros(3)
    dist.all_to_all([o] * world, [torch.full((3,), float(rank * 10 + d)) for d in range(world)])
    got["all_to_all [o]*w"] = o.tolist()
    # interleaved outputs that share no element (columns): still right
    cols = torch.zeros(3, world)
    dist.all_gather(list(cols.unbind(1)), torch.full((3,), float(rank)))
    got["all_gather columns"] = cols.tolist()
    dist.barrier()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_outputs_overlapping_inputs_or_each_other(transport):
    m = 300_000  # several shared-memory chunks: a write lands before a later chunk is read
    res = run_world(_alias_job, W, m, timeout=90, env={"TORCHPORT_DIST_TRANSPORT": transport})
    for rank, got in enumerate(res):
        for name in ("rst unaligned", "rst own block", "rs list aliased", "scatter unaligned"):
            assert got[name] == 0, (rank, name, got[name])
        last = [float(W - 1)] * 3
        assert got["all_gather [o]*w"] == got["gather [o]*w"] == last, (rank, got)
        assert got["all_to_all [o]*w"] == [float((W - 1) * 10 + rank)] * 3, (rank, got)
        assert got["all_gather columns"] == [[float(q) for q in range(W)]] * 3, (rank, got)


# -- 5 and 6: the mismatch error; PREMUL_SUM with a complex factor ----------------------------
def _mismatch_job(rank: int, world: int, init: str) -> dict[str, Any]:
    from torchport.distributed import CollectiveArgumentError

    _init(rank, world, init)
    got: dict[str, Any] = {}
    t = torch.ones(2, dtype=torch.complex64)
    try:
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(2.0 + 1j)))
    except CollectiveArgumentError as e:
        got["premul"] = str(e)
    dist.all_reduce(t)  # (the group goes on)
    got["after premul"] = t.tolist()
    # (a receive's dtype mismatch names the sender's dtype through the same code table)
    if rank == 0:
        dist.send(torch.ones(4, dtype=torch.float64), dst=1)
    else:
        try:
            dist.recv(torch.zeros(4), src=0)
        except Exception as e:
            got["recv"] = f"{type(e).__name__}: {e}"
    cases = {
        "dtype": lambda g: dist.all_reduce(
            torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32), group=g
        ),
        "op": lambda g: dist.all_reduce(
            torch.ones(4), op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM, group=g
        ),
        "root": lambda g: dist.reduce(torch.ones(3), dst=rank, group=g),
        "collective": lambda g: (
            dist.all_reduce(torch.ones(4), group=g)
            if rank == 0
            else dist.broadcast(torch.ones(4), src=1, group=g)
        ),
    }
    for name, call in cases.items():
        g = dist.new_group(list(range(world)), backend="torchport")
        try:
            call(g)
            got[name] = "no error"
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_mismatch_names_the_differing_field_and_the_peers_call(transport):
    res = run_world(_mismatch_job, 2, timeout=90, env={"TORCHPORT_DIST_TRANSPORT": transport})
    r0 = res[0]
    assert r0["premul"] == "ReduceOp.PREMUL_SUM requires a real factor, got (2+1j)", r0
    assert r0["after premul"] == [2 + 0j, 2 + 0j]
    assert res[1]["recv"] == (
        "CollectiveMismatchError: recv from rank 0 tag 0: expected 4 elements of torch.float32, "
        "the sender sent 4 elements of float64"
    ), res[1]
    theirs = {  # each rank's call, as its peer describes it
        "dtype": ("allreduce(dtype=float32, op=SUM)", "allreduce(dtype=int32, op=SUM)"),
        "op": ("allreduce(dtype=float32, op=MAX)", "allreduce(dtype=float32, op=SUM)"),
        "root": ("reduce(dtype=float32, op=SUM, root=0)", "reduce(dtype=float32, op=SUM, root=1)"),
        "collective": ("allreduce(dtype=float32, op=SUM)", "broadcast(dtype=float32, root=1)"),
    }
    for name, calls in theirs.items():
        # the rank that finds the mismatch raises it; its peer may learn it as a RemoteError
        found = [r for r in (0, 1) if res[r][name].startswith("CollectiveMismatchError: ")]
        assert found, (name, res[0][name], res[1][name])
        for r in found:
            want = (
                f"rank {1 - r} differs in op/dtype/reduce-op/root: its {name} "
                f"(theirs: {calls[1 - r]})"
            )
            assert res[r][name].endswith(want), (name, res[r][name], want)


def test_premul_sum_refuses_a_complex_factor_by_value():
    from torchport.distributed import CollectiveArgumentError
    from torchport.distributed.backend_args import _red_name

    with pytest.raises(CollectiveArgumentError, match=r"requires a real factor, got \(1-2j\)"):
        _red_name(dist._make_nccl_premul_sum(torch.tensor(1 - 2j, dtype=torch.complex128)))
    assert _red_name(dist._make_nccl_premul_sum(torch.tensor(0.5))) == ("PREMUL_SUM", 0.5)
    assert _red_name(dist._make_nccl_premul_sum(3.0)) == ("PREMUL_SUM", 3.0)


# -- in-process: the helpers the fixes use ---------------------------------------------------
_BUF = torch.zeros(100)
_MEET = {
    "one tensor twice": ([_BUF[:10]] * 2, True),
    "overlapping windows": ([_BUF[:10], _BUF[5:15]], True),
    "chunks": (list(_BUF.chunk(4)), False),
    "adjacent, an empty one between": ([_BUF[:10], _BUF[10:10], _BUF[10:20]], False),
    "an empty one inside a span": ([_BUF, _BUF[50:50], _BUF[60:70]], True),
    "separate tensors": ([torch.zeros(3), torch.zeros(3)], False),
}


@pytest.mark.parametrize("case", list(_MEET), ids=list(_MEET))
def test_outputs_meet_when_two_share_a_byte(case):
    from torchport.distributed.backend_args import _outputs_meet

    ts, want = _MEET[case]
    assert _outputs_meet(ts) is want


def test_apart_from_keeps_only_the_own_block_that_is_the_output():
    from torchport.distributed.backend_args import _apart_from

    buf = torch.arange(12.0)
    srcs = list(buf.chunk(3))
    kept = _apart_from(srcs, [srcs[1]], own=1)  # the in-place form: nothing copied
    assert [t.data_ptr() for t in kept] == [t.data_ptr() for t in srcs]
    out = buf[2:6]  # straddles blocks 0 and 1: both copied, with their values
    moved = _apart_from(srcs, [out], own=1)
    assert [moved[i].data_ptr() != srcs[i].data_ptr() for i in range(3)] == [True, True, False]
    assert all(torch.equal(a, b) for a, b in zip(moved, srcs))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),
        lambda: torch._neg_view(torch.arange(4.0)),
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj().imag,
        lambda: torch.arange(6.0).reshape(2, 3).t(),
    ],
    ids=["conj", "neg", "conj-imag", "transposed"],
)
def test_plain_contiguous_holds_the_values_in_memory(make):
    from torchport.distributed.engine import plain_contiguous

    t = make()
    p = plain_contiguous(t)
    assert p.is_contiguous() and not p.is_conj() and not p.is_neg()
    assert torch.equal(p, t.resolve_conj().resolve_neg())
    plain = torch.arange(4.0)
    assert plain_contiguous(plain) is plain  # (no copy on the common path)
