"""Worker functions for the distributed tests (run in spawned processes)."""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchport.distributed import allreduce_reference

REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)


def init(rank: int, world: int, init_method: str, timeout_s: float = 60.0) -> None:
    dist.init_process_group(
        "torchport",
        rank=rank,
        world_size=world,
        init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def allowed(op: str, dt: torch.dtype) -> bool:
    if op in ("BAND", "BOR", "BXOR"):
        return dt not in FLOATS + COMPLEX
    if op in ("MIN", "MAX"):
        return dt not in COMPLEX
    if op in ("AVG", "PREMUL_SUM"):
        return dt in FLOATS + COMPLEX
    return True


def make(q: int, case: int, n: int, dt: torch.dtype, op: str = "SUM") -> torch.Tensor:
    """Deterministic input of rank ``q`` for case ``case`` (every rank can rebuild all)."""
    g = torch.Generator().manual_seed(1000 * case + q)
    if dt == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dt in COMPLEX:
        x = torch.randn(n, 2, generator=g, dtype=torch.float64)
        if op == "PRODUCT":
            x = x * 0.1 + torch.tensor([1.0, 0.0], dtype=torch.float64)
        return torch.view_as_complex(x).to(dt)
    if dt in FLOATS:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        return (1 + 0.1 * x).to(dt) if op == "PRODUCT" else x.to(dt)
    hi = 3 if op == "PRODUCT" else 100
    lo = 0 if dt == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dt)


def _op(name: str) -> Any:
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(0.5)
    return getattr(dist.ReduceOp, name)


def _eq(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if exact:
        return torch.equal(
            got.view(torch.uint8) if got.dtype == torch.bool else got,
            want.view(torch.uint8) if want.dtype == torch.bool else want,
        )
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def grid(rank: int, world: int, sizes: list[int]) -> list[str]:
    """Every collective x reduce op x dtype against the single-process reference.

    Reductions run every op at the largest size (several chunks, both allreduce paths) and SUM
    at every size; data movement runs every size.
    """
    bad: list[str] = []
    case = 0
    for dt in DTYPES:
        for n in sizes:
            for op in REDUCE_OPS:
                if not allowed(op, dt) or (op != "SUM" and n != max(sizes)):
                    continue
                case += 1
                ins = [make(q, case, n, dt, op) for q in range(world)]
                want = allreduce_reference(ins, op, 0.5)
                # complex PRODUCT is checked with a tolerance (the FMA-free formula may differ from
                # torch's vectorised one), and so is complex AVG: torch's own complex division
                # rounds differently in its vector body and scalar tail (alignment-dependent).
                exact = not (dt in COMPLEX and op in ("PRODUCT", "AVG"))
                t = ins[rank].clone()
                if exact or op == "AVG":
                    dist.all_reduce(t, op=_op(op))
                else:  # torch's front end refuses complex PRODUCT; the backend supports it
                    pg = dist.distributed_c10d._get_default_group()
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = dist.ReduceOp.PRODUCT
                    pg.allreduce([t], opts).wait()
                if not _eq(t, want, exact):
                    bad.append(f"all_reduce {op} {dt} n={n}")
                if dt in COMPLEX and op == "PRODUCT":
                    continue
                # reduce to the last rank
                t = ins[rank].clone()
                dist.reduce(t, dst=world - 1, op=_op(op))
                if rank == world - 1 and not _eq(t, want, exact):
                    bad.append(f"reduce {op} {dt} n={n}")
                # reduce_scatter_tensor: rank r's output = fold of ins[q][r-th block]
                blocks = [make(q, case + 5000, n * world, dt, op) for q in range(world)]
                out = torch.empty(n, dtype=dt)
                dist.reduce_scatter_tensor(out, blocks[rank].clone(), op=_op(op))
                want_rs = allreduce_reference(
                    [b[rank * n : (rank + 1) * n] for b in blocks], op, 0.5
                )
                if not _eq(out, want_rs, exact):
                    bad.append(f"reduce_scatter_tensor {op} {dt} n={n}")
                if op == "SUM":
                    outs = [torch.empty(n, dtype=dt) for _ in range(world)]
                    dist.reduce_scatter(
                        outs[0],
                        [
                            b[q * n : (q + 1) * n].clone()
                            for q, b in [(q, blocks[rank]) for q in range(world)]
                        ],
                    )
                    if not _eq(outs[0], want_rs):
                        bad.append(f"reduce_scatter(list) {dt} n={n}")
            # data movement, once per dtype and size
            case += 1
            ins = [make(q, case, n, dt) for q in range(world)]
            t = ins[rank].clone()
            dist.broadcast(t, src=world // 2)
            if not _eq(t, ins[world // 2]):
                bad.append(f"broadcast {dt} n={n}")
            out = torch.empty(world * n, dtype=dt)
            dist.all_gather_into_tensor(out, ins[rank])
            if not _eq(out, torch.cat(ins)):
                bad.append(f"all_gather_into_tensor {dt} n={n}")
            outs = [torch.empty(n, dtype=dt) for _ in range(world)]
            dist.all_gather(outs, ins[rank])
            if not all(_eq(o, i) for o, i in zip(outs, ins)):
                bad.append(f"all_gather {dt} n={n}")
            outs = [torch.empty(n, dtype=dt) for _ in range(world)] if rank == 0 else None
            dist.gather(ins[rank], outs, dst=0)
            if rank == 0 and not all(_eq(o, i) for o, i in zip(outs or [], ins)):
                bad.append(f"gather {dt} n={n}")
            src_list = [make(0, case + 7000 + d, n, dt) for d in range(world)]
            o = torch.empty(n, dtype=dt)
            dist.scatter(o, src_list if rank == 0 else None, src=0)
            if not _eq(o, src_list[rank]):
                bad.append(f"scatter {dt} n={n}")
            # all_to_all_single with uneven splits: rank q sends (q + d) % 3 + n rows to d
            sends = [(rank + d) % 3 + n for d in range(world)]
            recvs = [(q + rank) % 3 + n for q in range(world)]
            inp = make(rank, case + 9000, sum(sends), dt)
            out = torch.empty(sum(recvs), dtype=dt)
            dist.all_to_all_single(out, inp, recvs, sends)
            want_parts = []
            for q in range(world):
                qs = [(q + d) % 3 + n for d in range(world)]
                full = make(q, case + 9000, sum(qs), dt)
                want_parts.append(full[sum(qs[:rank]) : sum(qs[: rank + 1])])
            if not _eq(out, torch.cat(want_parts)):
                bad.append(f"all_to_all_single(splits) {dt} n={n}")
            outs = [torch.empty(n, dtype=dt) for _ in range(world)]
            dist.all_to_all(outs, [make(rank, case + 11000 + d, n, dt) for d in range(world)])
            if not all(_eq(outs[q], make(q, case + 11000 + rank, n, dt)) for q in range(world)):
                bad.append(f"all_to_all(list) {dt} n={n}")
    # non-contiguous tensors: a transposed view and a strided slice
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    view = base.t()
    dist.all_reduce(view)
    want = torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world + 1))
    if not torch.equal(view, want):
        bad.append("all_reduce non-contiguous")
    strided = torch.zeros(10)[::2]
    if rank == 0:
        strided.copy_(torch.arange(5.0))
    dist.broadcast(strided, src=0)
    if not torch.equal(strided, torch.arange(5.0)):
        bad.append("broadcast strided")
    # coalesced variants (DDP / FSDP): all_reduce_coalesced and async_op works
    ts = [torch.full((k + 1,), float(rank + k)) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
        if not w.is_completed() or w.exception() is not None:
            bad.append("async work state")
    fut_val = dist.all_reduce(torch.ones(3), async_op=True).get_future().wait()
    if not torch.equal(fut_val[0], torch.full((3,), float(world))):
        bad.append("future value")
    for k, t in enumerate(ts):
        if not torch.equal(t, torch.full((k + 1,), float(sum(q + k for q in range(world))))):
            bad.append(f"async all_reduce {k}")
    dist.barrier()
    return bad


def ddp_losses(rank: int, world: int) -> dict[str, list[float]]:
    """The same DDP training on a gloo group and on the torchport group of this job."""
    groups = {"gloo": dist.new_group(backend="gloo"), "torchport": None}
    return {name: _ddp(rank, g) for name, g in groups.items()}


def _ddp(
    rank: int, group: Any, bucket_cap_mb: float = 0.001, hook: Callable[[Any], None] | None = None
) -> list[float]:
    """Six steps of DDP training on ``group`` (``hook(ddp)``: registers a comm hook first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=bucket_cap_mb, process_group=group
    )
    if hook is not None:
        hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def nested_in_callback_case(rank: int, world: int) -> dict[str, Any]:
    """A future callback of an allreduce issues another allreduce on the same group and waits on
    it: by its future (PowerSGD's DDP hook does this), by ``wait()``, with a timeout, or polling
    ``is_completed()``. The callback runs on the thread that ran the first operation (the
    engine's, or a waiter's running the queue inline), which held the engine's runner: the
    nested operation stayed queued and the wait never ended (gloo runs it). Each mode: the
    nested sum and the seconds it took (bounded by the harness's timeout if it hangs)."""
    out: dict[str, Any] = {}
    t = torch.ones(1 << 20)  # (still running when the callback is attached)
    for mode in ("future", "wait", "wait_timeout", "poll"):
        fut = dist.all_reduce(t, async_op=True).get_future()

        def nested(_f: Any, mode: str = mode) -> torch.Tensor:
            t2 = torch.full((3,), float(rank + 1))
            work = dist.all_reduce(t2, async_op=True)
            if mode == "future":
                return work.get_future().wait()[0]
            if mode == "wait":
                work.wait()
            elif mode == "wait_timeout":
                work.wait(datetime.timedelta(seconds=20))
            else:
                end = time.monotonic() + 20
                while not work.is_completed() and time.monotonic() < end:
                    time.sleep(0.001)
            return t2

        t0 = time.monotonic()
        got = fut.then(nested).wait()
        out[mode] = {"sum": got.tolist(), "took": time.monotonic() - t0}
    dist.barrier()
    return out


def close_racing_submit_case(rank: int, world: int) -> dict[str, Any]:
    """One thread issues an operation on a group while another destroys it: the issuing thread
    passed the group's "not closed" check, then the close ran to its end (flush, stop, the
    drain of the queues) before the operation was queued. Nothing ran or finished it: a future
    waiter or an ``is_completed()`` poller waited for good. Here the close runs inside
    ``Engine.submit``, right before the queueing, for an allreduce and for a send."""
    from torchport.distributed.progress import Engine

    out: dict[str, Any] = {}
    for what in ("allreduce", "send"):
        g = dist.new_group(list(range(world)), backend="torchport")
        dist.barrier(group=g)
        comm = g.comm
        orig = Engine.submit

        def racing(self: Any, work: Any, fn: Any, orig: Any = orig, comm: Any = comm) -> None:
            Engine.submit = orig  # type: ignore[method-assign]
            comm.close()  # the other thread's destroy, to its end
            orig(self, work, fn)

        Engine.submit = racing  # type: ignore[method-assign]
        try:
            if what == "allreduce":
                work = g.allreduce([torch.ones(2)])
            else:
                work = g.send([torch.ones(2)], (rank + 1) % world, 3)
        finally:
            Engine.submit = orig  # type: ignore[method-assign]
        end = time.monotonic() + 5
        while not work.is_completed() and time.monotonic() < end:
            time.sleep(0.01)
        done = work.is_completed()
        out[what] = {"done": done, "error": type(work.exception()).__name__ if done else None}
        dist.barrier()
    return out


def ddp_powersgd_losses(rank: int, world: int) -> dict[str, list[float]]:
    """DDP with torch's PowerSGD comm hook (its callbacks issue allreduces and wait on their
    futures) on a gloo group and on the torchport group of this job. One bucket (the default
    cap): with several, the callbacks and the next bucket's hook issue allreduces from two
    threads in an order that differs between ranks (torchport raises a mismatch on every rank,
    gloo aborts the process)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def hook(ddp: Any, group: Any) -> None:
        state = psgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)

    groups = {"gloo": dist.new_group(backend="gloo"), "torchport": None}
    return {
        name: _ddp(rank, g, bucket_cap_mb=25, hook=lambda ddp, g=g: hook(ddp, g))
        for name, g in groups.items()
    }


def gc_inherited_case(rank: int, world: int) -> dict[str, Any]:
    """What a full garbage collection costs this rank: the objects it inherited from the fork
    server (torch and torchport.distributed preloaded) frozen, and the seconds one full
    collection holds the GIL (a collection that fell in abort() delayed every peer's failure
    by that much)."""
    import gc

    frozen = gc.get_freeze_count()
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    return {"frozen": frozen, "tracked": tracked, "collect_s": time.perf_counter() - t0}


def abort_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 aborts while the other ranks wait in an allreduce rank 0 never joins."""
    from torchport.distributed import CommAbortedError, RemoteError, get_error

    sub = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub)
    if rank == 0:
        time.sleep(0.5)
        t_abort = time.time()
        sub.abort()
        err = get_error(sub)
        return {
            "t_abort": t_abort,
            "error": type(err).__name__,
            "is_aborted": isinstance(err, CommAbortedError),
        }
    work = dist.all_reduce(torch.ones(1000), group=sub, async_op=True)
    try:
        work.wait()
        return {"error": None}
    except RemoteError as e:
        return {
            "t_fail": time.time(),
            "error": type(e).__name__,
            "msg": str(e),
            "completed": work.is_completed(),
        }


def abort_streaming_case(rank: int, world: int) -> dict[str, Any]:
    """The last rank aborts while a large allreduce that every rank issued streams (over TCP
    the pipelined allreduce, in 4 KB pieces under SMALL_CHUNK): once every peer's first
    result piece is in its tensor (every peer is in its transfer loop) and before the last
    one is. Every rank's call must fail, the others' within the abort bound of the abort."""
    from torchport.distributed import CommAbortedError, RemoteError, TorchportDistError
    from torchport.distributed.engine import split_even

    sub = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub)
    t = torch.ones(4 << 20)
    work = dist.all_reduce(t, group=sub, async_op=True)
    rec: dict[str, Any] = {}
    if rank == world - 1:
        parts = split_even(t.numel(), world)
        firsts = torch.tensor([lo for lo, _ in parts[:-1]])  # the peers' parts
        lasts = torch.tensor([lo + k - 1 for lo, k in parts[:-1]])
        end = time.monotonic() + 20
        while not bool((t[firsts] == world).all()) and time.monotonic() < end:
            time.sleep(0.001)  # reads the tensor the allreduce writes: only to see progress
        started = bool((t[firsts] == world).all())
        rec["mid_stream"] = started and bool((t[lasts] == 1).all())
        rec["t_abort"] = time.time()
        sub.abort()
    try:
        work.wait()
        rec["error"] = None
    except TorchportDistError as e:
        rec["t_fail"] = time.time()
        rec["error"] = type(e).__name__
        rec["msg"] = str(e)
        rec["typed"] = isinstance(e, (CommAbortedError, RemoteError))
        # the call reported its failure before the frames part-way on the wire completed:
        # those land in scratch, never in the tensor once wait() returned
        seen = t.clone()
        time.sleep(0.1)
        rec["untouched"] = torch.equal(seen, t)
    return rec


def stuck_peer_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 is stopped (SIGSTOP) in the middle of a large shm allreduce, once its first
    folded block reached the last rank; the last rank, then stuck waiting on rank 1's blocks,
    aborts. Every other rank must fail within the abort bound, rank 1 as soon as it runs again
    (SIGCONT), and none may hang."""
    import signal

    from torchport.distributed import CommAbortedError, RemoteError, TorchportDistError
    from torchport.distributed.engine import split_even

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    sub = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub)
    t = torch.ones(16 << 20)
    work = dist.all_reduce(t, group=sub, async_op=True)
    rec: dict[str, Any] = {}
    if rank == world - 1:
        lo = split_even(t.numel(), world)[1][0]
        end = time.monotonic() + 20
        while float(t[lo]) != world and time.monotonic() < end:
            pass  # reads the tensor the allreduce writes: only to see rank 1's progress
        os.kill(pids[1], signal.SIGSTOP)
        try:
            time.sleep(0.2)
            rec["stuck"] = float(t[lo]) == world and not work.is_completed()
            rec["t_abort"] = time.time()
            sub.abort()
            try:
                work.wait()
                rec["error"] = None
            except TorchportDistError as e:
                rec["t_fail"] = time.time()
                rec["error"] = type(e).__name__
            time.sleep(0.2)
        finally:
            rec["t_cont"] = time.time()
            os.kill(pids[1], signal.SIGCONT)
        return rec
    try:
        work.wait()
        rec["error"] = None
    except TorchportDistError as e:
        rec["t_fail"] = time.time()
        rec["error"] = type(e).__name__
        rec["msg"] = str(e)
        rec["typed"] = isinstance(e, (CommAbortedError, RemoteError))
    return rec


def destroy_in_flight_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 issues an allreduce rank 0 never joins, then destroys the group: the Work fails
    with a typed error at once, destroy returns promptly and the group's threads end."""
    import threading

    sub = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub)
    name = sub.comm.name
    if rank != 1:
        # (after rank 1's destroy: this rank's destroy tells rank 1 that it left the group,
        # which would end rank 1's allreduce with PeerLeftError if it came first)
        dist.barrier()
        dist.destroy_process_group(sub)
        return {}
    from torchport.distributed import engine

    work = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
    time.sleep(0.2)  # the engine thread has started it
    t0 = time.monotonic()
    flush, engine.SHUTDOWN_FLUSH_S = engine.SHUTDOWN_FLUSH_S, 0.3  # (5 s by default)
    try:
        dist.destroy_process_group(sub)
    finally:
        engine.SHUTDOWN_FLUSH_S = flush
    out: dict[str, Any] = {"destroy_s": time.monotonic() - t0, "completed": work.is_completed()}
    try:
        work.wait()
        out["error"] = None
    except Exception as e:
        out["error"], out["msg"] = type(e).__name__, str(e)
    time.sleep(0.1)
    out["threads"] = [t.name for t in threading.enumerate() if t.name.endswith(f"-{name}")]
    dist.barrier()
    return out


def destroy_flushes_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 issues an allreduce and destroys the group without waiting; the other ranks join
    the allreduce 0.4 s later: destroy lets it finish (gloo's destructor and NCCL's graceful
    shutdown flush pending work too), so every rank gets the sum."""
    sub = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub)
    t = torch.full((4,), float(rank + 1))
    if rank != 1:
        time.sleep(0.4)
        dist.all_reduce(t, group=sub)
        dist.destroy_process_group(sub)
        return {"sum": t.tolist()}
    work = dist.all_reduce(t, group=sub, async_op=True)
    t0 = time.monotonic()
    dist.destroy_process_group(sub)
    out: dict[str, Any] = {"destroy_s": time.monotonic() - t0, "completed": work.is_completed()}
    try:
        work.wait()
        out["error"] = None
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["sum"] = t.tolist()
    return out


def stale_incarnation_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 destroys a group and re-creates it under the same name (use_local_synchronization
    names a group by its ranks) while rank 0 still runs an allreduce on the old one: no frame of
    the old incarnation may complete an op of the new one."""
    from torchport.distributed import TorchportDistError

    ranks = list(range(world))
    g = dist.new_group(ranks, backend="torchport", use_local_synchronization=True)
    dist.barrier()  # (on the default group: the op counts of g stay in step)
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(seconds=0.5)
    if rank == 1:
        dist.destroy_process_group(g)
        g = dist.new_group(ranks, backend="torchport", use_local_synchronization=True)
        t = torch.full((4,), 1.0)
    else:
        time.sleep(0.3)  # rank 1 has re-created the group
        t = torch.full((4,), 100.0)
    try:
        g.allreduce([t], opts).wait()
        out: dict[str, Any] = {"error": None, "value": t[0].item()}
    except TorchportDistError as e:
        out = {"error": type(e).__name__}
    dist.destroy_process_group(g)
    return out


def recreate_case(rank: int, world: int) -> list[float]:
    """Every rank destroys a group and re-creates it under the same name (use_local_synchronization
    names a group by its ranks), twice: each incarnation works."""
    ranks, sums = list(range(world)), []
    for i in range(3):
        g = dist.new_group(ranks, backend="torchport", use_local_synchronization=True)
        t = torch.full((4,), float(rank + i))
        dist.all_reduce(t, group=g)
        sums.append(t[0].item())
        dist.destroy_process_group(g)
    return sums


def after_close_case(rank: int, world: int) -> list[str]:
    """Ops issued on a torchport group object after destroy_process_group(g): each fails at once
    (they queued on the stopped engine and never completed, or ran inline on the unmapped arena)."""
    g = dist.new_group(list(range(world)), backend="torchport")
    dist.destroy_process_group(g)
    out = []
    for make_op in (
        lambda: g.allreduce([torch.ones(2)]),
        lambda: g.send([torch.ones(2)], (rank + 1) % world, 0),
        lambda: g.recv([torch.ones(2)], (rank + 1) % world, 0),
    ):
        t0 = time.monotonic()
        try:
            make_op().wait(datetime.timedelta(seconds=2))
            out.append("completed")
        except Exception as e:
            out.append(type(e).__name__ if time.monotonic() - t0 < 0.5 else "slow")
    return out


def destroy_in_callback_case(rank: int, world: int) -> dict[str, Any]:
    """A Work future callback (run on the engine thread) destroys the group: the close must not
    wait for its own thread (it aborted the group after the 5 s flush, waited 5 s more for its
    own join and left the arenas mapped)."""
    g = dist.new_group(list(range(world)), backend="torchport")
    comm = g.comm
    dist.barrier(group=g)
    t = torch.full((4,), float(rank + 1))
    t0 = time.monotonic()
    work = dist.all_reduce(t, group=g, async_op=True)
    issued: list[Any] = []

    def destroy(_f: Any) -> None:
        dist.destroy_process_group(g)
        # destroy returned: an op issued now fails at once (it was queued and ran while the
        # close, handed off to a thread of its own, flushed)
        issued.append(g.allreduce([torch.ones(2)]))

    fut = work.get_future().then(destroy)
    fut.wait()
    s = time.monotonic() - t0
    try:
        issued[0].wait(datetime.timedelta(seconds=2))
        after = "completed"
    except Exception as e:
        after = type(e).__name__
    end = time.monotonic() + 2.0
    while comm.arena is not None and comm.arena._mm is not None and time.monotonic() < end:
        time.sleep(0.01)
    # an op the engine's queue still held once the close stopped it (a wait() running the
    # queue inline) is refused, not run on the unmapped arena
    from torchport.distributed.progress import TorchportWork

    ran: list[bool] = []
    late = TorchportWork("late")
    comm.run(late, lambda: ran.append(True))
    return {
        "s": s,
        "after": after,
        "late": (bool(ran), type(late._error).__name__),
        "sum": t.tolist(),
        "error": None if comm.error is None else type(comm.error).__name__,
        "unmapped": comm.arena is None or comm.arena._mm is None,
    }


def destroy_in_recv_callback_case(rank: int, world: int) -> dict[str, Any]:
    """A receive's future callback (run on the mesh reader thread) destroys the group while
    another receive is pending: the close flushes it (run inline on the reader thread, it
    waited 5 s for a receive only that thread could deliver, then aborted the group)."""
    g = dist.new_group(list(range(world)), backend="torchport")
    comm = g.comm
    dist.barrier(group=g)
    t0 = time.monotonic()
    if rank == 0:
        g.send([torch.ones(4)], 1, 1).wait()
        time.sleep(0.2)
        g.send([torch.full((4,), 2.0)], 1, 2).wait()
        time.sleep(0.2)
        dist.destroy_process_group(g)
        return {}
    second = torch.zeros(4)
    pending = g.recv([second], 0, 2)  # posted first: the callback below flushes it
    first = g.recv([torch.zeros(4)], 0, 1)
    first.get_future().then(lambda _f: dist.destroy_process_group(g))
    try:
        pending.wait(datetime.timedelta(seconds=10))
        error = None
    except Exception as e:
        error = type(e).__name__
    return {
        "s": time.monotonic() - t0,
        "second": second.tolist(),
        "error": error,
        "group_error": None if comm.error is None else type(comm.error).__name__,
    }


def overlap_delivered_case(rank: int, world: int) -> str | None:
    """A receive posted while the one it overlaps is delivered during the overlap test is
    accepted (it was refused for a receive no longer in flight); the error name if refused."""
    import threading

    from torchport.distributed import engine

    g = dist.new_group(list(range(world)), backend="torchport")
    comm, peer = g.comm, (rank + 1) % world
    buf = torch.zeros(8)
    real = engine.tensors_overlap
    first = g.recv([buf[0:4]], peer, 1)
    out: list[str | None] = []
    sent: list[bool] = []

    def send_first() -> None:
        if not sent:
            sent.append(True)
            g.send([torch.ones(4)], peer, 1)  # the peer's first receive

    def slow(a: torch.Tensor, b: torch.Tensor) -> bool:
        send_first()
        first.wait(datetime.timedelta(seconds=5))  # ours is delivered during the test
        return real(a, b)

    def post() -> None:
        try:
            work = g.recv([buf[2:6]], peer, 2)
            # A peer whose own first receive was in before its test skips the test (nothing
            # left in flight to overlap), so its send is made here: else this rank's wait in
            # the test above timed out (a load-dependent failure).
            send_first()
            g.send([torch.ones(4)], peer, 2).wait()
            work.wait(datetime.timedelta(seconds=5))
            out.append(None)
        except Exception as e:
            out.append(type(e).__name__)

    engine.tensors_overlap = slow
    try:
        poster = threading.Thread(target=post)
        poster.start()
        poster.join(8.0)
        dist.barrier()  # (the abort below fails the peer's receives)
        assert not poster.is_alive(), "the posting thread hangs"
    finally:
        engine.tensors_overlap = real
        comm.abort()
        dist.destroy_process_group(g)
    return out[0]


def overlap_unlocked_case(rank: int, world: int) -> float:
    """Posting a receive tests it for overlap against the pending ones (a walk of up to ~0.4 s
    for large strided views): seconds the group's lock was held meanwhile (the mailbox reader
    needs it to deliver). The test is made slow (0.3 s) on purpose here."""
    import threading

    from torchport.distributed import engine

    g = dist.new_group(list(range(world)), backend="torchport")
    comm, peer = g.comm, (rank + 1) % world
    entered = threading.Event()
    real = engine.tensors_overlap

    def slow(a: torch.Tensor, b: torch.Tensor) -> bool:
        entered.set()
        time.sleep(0.3)
        return real(a, b)

    engine.tensors_overlap = slow
    try:
        g.recv([torch.zeros(4)], peer, 1)
        poster = threading.Thread(target=lambda: g.recv([torch.zeros(4)], peer, 2))
        poster.start()
        ran = entered.wait(5.0)
        t0 = time.monotonic()
        with comm._lock:
            held = time.monotonic() - t0
        poster.join(5.0)
        dist.barrier()  # the abort below fails the peer's receives: its test ran first
        assert ran, "the overlap test never ran"
        assert not poster.is_alive(), "the posting thread is still inside the overlap test"
    finally:
        engine.tensors_overlap = real
        comm.abort()
        dist.destroy_process_group(g)
    return held


def timeout_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 runs an allreduce with a 0.3 s per-op timeout that rank 0 never joins."""
    from torchport.distributed import CommTimeoutError, get_error

    pg = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=pg)
    if rank == 1:
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=0.3)
        t0 = time.time()
        work = pg.allreduce([torch.ones(4)], opts)
        try:
            work.wait()
        except CommTimeoutError as e:
            return {"error": "timeout", "elapsed": time.time() - t0, "msg": str(e)}
        return {"error": None}
    end = time.time() + 5
    while get_error(pg) is None and time.time() < end:
        time.sleep(0.01)
    return {"error": type(get_error(pg)).__name__, "msg": str(get_error(pg))}


def mismatch_case(rank: int, world: int) -> list[str]:
    """Mismatched sizes, dtypes, ops, collective kinds: a clear error on every rank."""
    from torchport.distributed import CollectiveMismatchError, CommunicatorErrorState

    msgs = []
    cases = [
        lambda: dist.all_reduce(torch.ones(10 + rank)),
        lambda: dist.all_reduce(
            torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64)
        ),
        lambda: dist.all_reduce(
            torch.ones(10), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
        ),
        lambda: (
            dist.all_reduce(torch.ones(10)) if rank == 0 else dist.broadcast(torch.ones(10), src=0)
        ),
        lambda: dist.broadcast(torch.ones(10), src=rank),
        # rank 0 sends one row more to the last rank than it expects (its block to itself
        # agrees: one that does not is refused at the call, on that rank only)
        lambda: dist.all_to_all_single(
            torch.empty(3 * world),
            torch.ones(3 * world + (rank == 0)),
            [3] * world,
            [*[3] * (world - 1), 3 + (rank == 0)],
        ),
    ]
    for i, fn in enumerate(cases):
        pg = dist.new_group(list(range(world)), backend="torchport")
        with _default(pg):
            try:
                fn()
                msgs.append(f"case {i}: no error")
            except CollectiveMismatchError as e:
                msgs.append(f"case {i}: mismatch: {e}")
            try:
                dist.all_reduce(torch.ones(1), group=pg)
                msgs.append(f"case {i}: group still usable")
            except CommunicatorErrorState:
                pass
    # the world group is untouched by the failures of the sub-groups
    t = torch.ones(2)
    dist.all_reduce(t)
    msgs.append(f"world ok {t.tolist()}")
    return msgs


def same_size_dtypes_case(rank: int, world: int) -> list[str]:
    """Ranks calling with different dtypes of one element size that the kernels do not fold
    (moved as bytes): a mismatch naming both dtypes, never the bytes reinterpreted. The rank
    that detects it fails with CollectiveMismatchError; the other may learn of it from that
    rank's abort first (RemoteError "detected mismatched collectives"), as it did under load
    (uncaught there, it ended this rank's job and its peer saw the connection close)."""
    from torchport.distributed import CollectiveMismatchError, RemoteError

    msgs = []
    pairs = [(torch.float8_e4m3fn, torch.float8_e5m2), (torch.uint16, torch.bits16)]
    for i, pair in enumerate(pairs):
        pg = dist.new_group(list(range(world)), backend="torchport")
        t = torch.empty(6, dtype=pair[rank % 2])
        try:
            dist.broadcast(t, src=0, group=pg)
            msgs.append(f"case {i}: no error")
        except CollectiveMismatchError as e:
            msgs.append(f"case {i}: mismatch: {e}")
        except RemoteError as e:
            msgs.append(f"case {i}: remote: {e}")
    return msgs


def mismatch_one_rank_case(rank: int, world: int) -> list[dict[str, Any]]:
    """One rank (the last) issues a different size / dtype / collective; per-source waits.

    Ranks that read only from agreeing peers (broadcast receivers, gather senders) may finish
    the mismatched call itself; they must then fail at their next collective on the group. For
    each case: the outcome of the call and of one follow-up all_reduce, and the time both took.
    """
    from torchport.distributed import TorchportDistError

    odd = rank == world - 1
    n = 4099  # above the one-step bound under SMALL_CHUNK: the two-step allreduce path
    cases = [
        lambda: dist.all_reduce(torch.ones(10 + odd)),
        lambda: dist.all_reduce(torch.ones(n, dtype=torch.float64 if odd else torch.float32)),
        lambda: dist.broadcast(torch.ones(n + odd), src=0),
        lambda: (
            dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
            if odd
            else dist.broadcast(torch.ones(4 * world), src=0)
        ),
        lambda: dist.gather(
            torch.ones(5 + odd), [torch.empty(5) for _ in range(world)] if rank == 0 else None
        ),
        lambda: dist.reduce_scatter_tensor(
            torch.empty(3),
            torch.ones(3 * world),
            op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM,
        ),
        # over TCP: a pipelined chain of two pieces, then the acknowledgement back up
        lambda: dist.broadcast(torch.ones(300_000 + odd), src=0),
        # a barrier (nothing published: over TCP every peer's frame is expected empty) against
        # an allreduce whose frames are not
        lambda: dist.barrier() if odd else dist.all_reduce(torch.ones(n)),
        # AVG folds as SUM: it went unnoticed, and each rank got its own answer
        lambda: dist.all_reduce(torch.ones(n), op=dist.ReduceOp.AVG if odd else dist.ReduceOp.SUM),
        # the odd rank expects one row more from rank 0 and one fewer from rank 1 (its block to
        # itself agrees: one that does not is refused at the call and fails no group)
        lambda: dist.all_to_all_single(
            torch.empty(3 * world),
            torch.ones(3 * world),
            [3 + odd, 3 - odd, *[3] * (world - 2)],
            [3] * world,
        ),
    ]
    out = []
    for fn in cases:
        pg = dist.new_group(
            list(range(world)), backend="torchport", timeout=datetime.timedelta(seconds=20)
        )
        rec: dict[str, Any] = {}
        t0 = time.monotonic()
        with _default(pg):
            for what, call in (("call", fn), ("next", lambda: dist.all_reduce(torch.ones(1)))):
                try:
                    call()
                    rec[what] = "ok"
                except TorchportDistError as e:
                    rec[what] = f"{type(e).__name__}: {e}"
        rec["elapsed"] = time.monotonic() - t0
        out.append(rec)
    return out


def late_peer_case(rank: int, world: int) -> dict[str, Any]:
    """The last rank issues a mismatched alltoall; rank 1 issues it only after the last rank
    failed (and told it: rank 1 then fails at once, sending nothing). Rank 0 got the last
    rank's block and waits for rank 1's, so it can learn of the failure only from the last
    rank's ABORT frame, on a socket whose receives are all done: it must still fail within
    seconds, not at the group's timeout. (The last rank's block to itself agrees: one that
    does not is refused at the call, before anything is sent, and fails no group.)"""
    from torchport.distributed import TorchportDistError, get_error

    odd = rank == world - 1
    pg = dist.new_group(
        list(range(world)), backend="torchport", timeout=datetime.timedelta(seconds=20)
    )
    dist.barrier(group=pg)
    # every rank's barrier on pg is done before the last rank can fail: its failure notice
    # travels on another socket than rank 0's last barrier frame to rank 1 and could overtake
    # it, and rank 1's barrier then failed (1 run in 5-7). A rank leaves this barrier on the
    # default group only once every rank entered it, so after its pg barrier (a sleep of
    # 0.2 s here only made the overtaking rarer)
    dist.barrier()
    if rank == 1:
        # issue only once the last rank's failure has reached this rank (a 0.5 s sleep did
        # not make sure of it); the case's deadline stays well under the test's
        end = time.monotonic() + 10
        while get_error(pg) is None and time.monotonic() < end:
            time.sleep(0.01)
    told = get_error(pg) is not None
    t0 = time.monotonic()
    try:
        dist.all_to_all_single(
            torch.empty(3 * world),
            torch.ones(3 * world),
            [3 + odd, 3 - odd, *[3] * (world - 2)],
            [3] * world,
            group=pg,
        )
        call = "ok"
    except TorchportDistError as e:
        call = f"{type(e).__name__}: {e}"
    return {"call": call, "elapsed": time.monotonic() - t0, "told": told}


class _default:
    """Temporarily make ``pg`` the default group (so the case lambdas stay short)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def __enter__(self) -> None:
        self.old = dist.distributed_c10d.GroupMember.WORLD
        dist.distributed_c10d.GroupMember.WORLD = self.pg

    def __exit__(self, *exc: Any) -> None:
        dist.distributed_c10d.GroupMember.WORLD = self.old


def split_case(rank: int, world: int) -> dict[str, Any]:
    from torchport.distributed import CollectiveArgumentError, split_group
    from torchport.distributed.groups import root_mesh

    mesh = root_mesh()
    sub = split_group(split_ranks=[[0, 1], [2, 3]])
    assert sub is not None
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=sub)
    odd = dist.new_group([1, 3], backend="torchport")
    u = torch.tensor([float(rank)])
    if rank in (1, 3):
        dist.all_reduce(u, group=odd)
    # split ranks are ranks of the parent: its rank 1 is global rank 1 in one half, 3 in the other
    nested = split_group(sub, split_ranks=[[1]])
    try:
        split_group(sub, split_ranks=[[0, 2]])
        beyond = "no error"
    except CollectiveArgumentError as e:
        beyond = str(e)
    return {
        "nested_size": None if nested is None else nested.size(),
        "beyond_parent": beyond,
        "sub_rank": sub.rank(),
        "sub_size": sub.size(),
        "sum": t.item(),
        "odd_sum": u.item(),
        "same_mesh": sub.comm.mesh is mesh,
        "odd_rank": odd.rank() if rank in (1, 3) else None,
        "transport": sub.transport,
    }


def split_again_case(rank: int, world: int) -> dict[str, Any]:
    """A split after one that left a rank without a group, and after a ``new_group`` its
    non-members did not join: torch named the next split's group after the count of groups each
    process held, so its members disagreed on the name and never met (a hang up to the group
    timeout). Every rank calls each split and ``new_group`` alike."""
    from torchport.distributed import split_group

    t0 = time.monotonic()
    first = split_group(split_ranks=[[0, 1]])  # the others: None
    dist.new_group([0, world - 1], backend="torchport")
    g = split_group(split_ranks=[[0, 2], [1]], timeout=datetime.timedelta(seconds=20))
    t = torch.tensor([float(rank)])
    if g is not None:
        dist.all_reduce(t, group=g)
    return {
        "first": None if first is None else first.size(),
        "size": None if g is None else g.size(),
        "sum": t.item(),
        "elapsed": time.monotonic() - t0,
    }


def p2p_case(rank: int, world: int) -> list[str]:
    bad = []
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    send = torch.arange(5.0) + rank
    recv = torch.empty(5)
    reqs = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
    )
    for r in reqs:
        r.wait()
    if not torch.equal(recv, torch.arange(5.0) + prv):
        bad.append(f"ring got {recv.tolist()}")
    # tags: receive in the opposite order of sending
    if rank == 0:
        dist.send(torch.tensor([1.0]), 1, tag=7)
        dist.send(torch.tensor([2.0]), 1, tag=9)
    elif rank == 1:
        a, b = torch.empty(1), torch.empty(1)
        wb = dist.irecv(b, 0, tag=9)
        wa = dist.irecv(a, 0, tag=7)
        wb.wait()
        wa.wait()
        if (a.item(), b.item()) != (1.0, 2.0):
            bad.append(f"tags got {a.item()}, {b.item()}")
    # irecv posted before the send, non-contiguous destination, int dtype
    if rank == 0:
        dist.send(torch.arange(6, dtype=torch.int32), 1)
    elif rank == 1:
        dst = torch.zeros(12, dtype=torch.int32)[::2]
        dist.recv(dst, 0)
        if not torch.equal(dst, torch.arange(6, dtype=torch.int32)):
            bad.append(f"strided recv {dst.tolist()}")
    # any source: the last rank receives one message from every other rank with src=None
    last = world - 1
    if rank != last:
        dist.send(torch.full((3,), float(rank)), last, tag=42)
    else:
        got = {}
        for _ in range(world - 1):
            buf = torch.empty(3)
            src = dist.recv(buf, tag=42)
            got[src] = buf[0].item()
            if not torch.equal(buf, torch.full((3,), float(src))):
                bad.append(f"anysource from {src} got {buf.tolist()}")
        if got != {q: float(q) for q in range(world - 1)}:
            bad.append(f"anysource senders {got}")
    # a receive into memory an in-flight receive writes is refused when issued (which frame
    # landed last was a race); disjoint strided views of one buffer are fine
    if rank == 0:
        dist.recv(torch.zeros(1), 1, tag=50)  # rank 1's receives are issued: send
        dist.send(torch.full((3,), 1.0), 1, tag=51)
        dist.send(torch.full((3,), 2.0), 1, tag=52)
    elif rank == 1:
        from torchport.distributed import CollectiveArgumentError

        buf = torch.zeros(3, 2)
        first = dist.irecv(buf[:, 0], 0, tag=51)
        for op in (
            lambda: dist.irecv(buf[1:, 0], 0, tag=53),
            lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf.view(-1)[:2], 0, tag=54)]),
        ):
            try:
                op()
                bad.append("a receive overlapping an in-flight receive was issued")
            except CollectiveArgumentError as e:
                if "overlaps the output of recv(src=0, tag=51)" not in str(e):
                    bad.append(f"overlap refused with {e}")
        second = dist.irecv(buf[:, 1], 0, tag=52)
        dist.send(torch.zeros(1), 0, tag=50)
        second.wait()
        first.wait()
        if buf.tolist() != [[1.0, 2.0]] * 3:
            bad.append(f"disjoint column receives got {buf.tolist()}")
    bad += _p2p_big(rank, world)
    dist.barrier()
    bad += _ring_use({0: world - 1, world - 1: 0}.get(rank))
    return bad


def _ring_use(partner: int | None) -> list[str]:
    """After the large messages of ``_p2p_big`` between ranks 0 and the last (``partner``:
    the other one, for them; all received: a barrier passed), rings were made with peers of
    this host only, none over the tcp transport, one with the partner when it is on this host,
    and every ring this rank offered was mapped by its peer and its name removed."""
    from torchport.distributed.groups import root_mesh

    mesh = root_mesh()
    assert mesh is not None
    conns = list(mesh.peers.values())
    used = {c.peer for c in conns if c.ring_out is not None or c.ring_in is not None}
    here = {q for q, h in mesh.hosts.items() if h == mesh.host_id}
    bad = []
    if os.environ.get("TORCHPORT_DIST_TRANSPORT") == "tcp":
        here = set()
    if used - here:
        bad.append(f"rings with ranks {sorted(used - here)} (other hosts, or the tcp transport)")
    if partner in here and partner not in used:
        bad.append(f"no ring with rank {partner} after messages of hundreds of KB")
    left = [c.ring_out.path for c in conns if c.ring_out and os.path.exists(c.ring_out.path)]
    if left:
        bad.append(f"offered rings still named in /dev/shm: {left}")
    return bad


def _p2p_big(rank: int, world: int) -> list[str]:
    """Messages above the frame bound go as several frames, back to back (``p2p_frames``): two
    on one tag (received in order, one posted before the frames arrive and one after), into
    a strided destination, from any source, and one of the wrong size (refused, and the next
    message on the same tag is still whole)."""
    from torchport.distributed import CollectiveMismatchError
    from torchport.distributed.groups import root_mesh

    mesh = root_mesh()
    assert mesh is not None
    bad: list[str] = []
    if mesh.max_frame > (4 << 20):  # (a plan without a small frame bound: messages of GBs)
        return bad
    n = (5 * mesh.max_frame) // 8 + 3  # float64: five frames and a partial one
    last = world - 1

    def msg(k: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float64) * (k + 1) + 0.25

    if rank == 0:
        for k in range(4):
            dist.send(msg(k), last, tag=60)
        dist.send(msg(4).to(torch.complex128), last, tag=61)
    elif rank == last:
        first = torch.empty(n, dtype=torch.float64)
        w = dist.irecv(first, 0, tag=60)  # posted before the frames arrive (likely)
        w.wait()
        time.sleep(0.2)  # the second message queues before its receive is posted
        second = torch.zeros(2 * n, dtype=torch.float64)[::2]
        dist.recv(second, 0, tag=60)
        try:
            dist.recv(torch.empty(n - 1, dtype=torch.float64), 0, tag=60)
            bad.append("a receive of the wrong size took a message in frames")
        except CollectiveMismatchError as e:
            if f"expected {n - 1} elements" not in str(e):
                bad.append(f"wrong-size receive refused with {e}")
        fourth = torch.empty(n, dtype=torch.float64)
        src = dist.recv(fourth, tag=60)
        fifth = torch.empty(n, dtype=torch.complex128)
        dist.recv(fifth, 0, tag=61)
        for k, (got, want) in enumerate(
            [(first, msg(0)), (second, msg(1)), (fourth, msg(3)), (fifth, msg(4))]
        ):
            if not torch.equal(got, want.to(got.dtype)):
                bad.append(f"message {k} in frames differs at {(got != want).nonzero()[:3]}")
        if src != 0:
            bad.append(f"any-source receive of a message in frames named rank {src}")
    bad += _p2p_direct(rank, world)
    return bad


def _p2p_direct(rank: int, world: int) -> list[str]:
    """A receive posted before its frame arrives is read straight into its tensor (its own
    ``Target``; a contiguous slice at an offset too, and a message in frames frame by frame);
    a second receive on the same key, a strided one and one of the wrong size take theirs
    buffered, each its own message."""
    from torchport.distributed import CollectiveMismatchError
    from torchport.distributed import transport_tcp as tt
    from torchport.distributed.groups import root_mesh

    mesh = root_mesh()
    assert mesh is not None
    bad: list[str] = []
    n, last = 1536, world - 1  # float64: 12 KiB, one frame
    frames = 0 if mesh.max_frame > (4 << 20) else 4  # (a plan with a small frame bound)
    big = (frames * mesh.max_frame - mesh.max_frame // 2) // 8  # float64: 3.5 frames

    def msg(k: int, size: int = n) -> torch.Tensor:
        return torch.arange(size, dtype=torch.float64) - k

    if rank == 0:
        dist.recv(torch.zeros(1), last, tag=63)  # the receives are posted
        for k in range(3):
            dist.send(msg(k), last, tag=62)
        dist.send(msg(3), last, tag=64)
        dist.send(msg(4), last, tag=65)
        if frames:
            dist.send(msg(5, big), last, tag=66)
    elif rank == last:
        owned: list[bool] = []
        real = tt.Mailbox.finish

        def spy(self: Any, target: Any, ok: bool, key: Any = None, hdr: Any = None) -> None:
            if target.owner is not None:
                owned.append(ok)
            real(self, target, ok, key, hdr)

        tt.Mailbox.finish = spy  # type: ignore[method-assign]
        try:
            buf = torch.zeros(3 * n + 5, dtype=torch.float64)
            one, two = buf[5 : 5 + n], buf[5 + n : 5 + 2 * n]
            works = [dist.irecv(one, 0, tag=62), dist.irecv(two, 0, tag=62)]
            strided = torch.zeros(2 * n, dtype=torch.float64)[::2]
            works.append(dist.irecv(strided, 0, tag=64))
            short = torch.zeros(n - 1, dtype=torch.float64)
            works.append(dist.irecv(short, 0, tag=65))
            framed = torch.zeros(big + 2, dtype=torch.float64)[1:-1]  # (inside a buffer)
            if frames:
                works.append(dist.irecv(framed, 0, tag=66))
            dist.send(torch.zeros(1), 0, tag=63)
            for w in [*works[:3], *works[4:]]:
                w.wait()
            try:
                works[3].wait()
                bad.append("a direct receive of the wrong size succeeded")
            except CollectiveMismatchError:
                pass
            third = torch.empty(n, dtype=torch.float64)
            dist.recv(third, 0, tag=62)
        finally:
            tt.Mailbox.finish = real  # type: ignore[method-assign]
        for k, got in enumerate([one, two, third, strided]):
            if not torch.equal(got, msg(k)):
                bad.append(f"direct/buffered receive {k} got {got[:4].tolist()}")
        if frames and not torch.equal(framed, msg(5, big)):
            bad.append(f"a message in frames read straight in got {framed[:4].tolist()}")
        if buf[:5].any() or buf[5 + 2 * n :].any() or framed._base[[0, -1]].any():  # type: ignore[index]
            bad.append("a direct receive wrote outside its slice")
        if owned != [True] * (1 + frames):  # one frame, then each frame of the big message
            bad.append(f"frames read straight into their tensor: {owned}, want {1 + frames}")
    return bad


def p2p_late_case(rank: int, world: int) -> list[str]:
    """Large messages that arrive before their receive is posted (the buffered path: an
    uninitialised buffer from 1 MiB), one frame and several (16 MiB frames), then one posted
    first (read straight in), on a torchport group with the default frame bound."""
    g = dist.new_group(list(range(world)), backend="torchport")
    bad: list[str] = []
    sizes = [(3 << 20) // 4 + 5, (40 << 20) // 4 + 1]  # float32: one frame, three frames
    if rank == 0:
        for k, n in enumerate(sizes):
            dist.send(torch.arange(n, dtype=torch.float32) + k, 1, group=g)
        dist.barrier()
        dist.send(torch.arange(sizes[1], dtype=torch.float32) - 1, 1, group=g)
    elif rank == 1:
        time.sleep(0.5)  # both messages are in by now (queued)
        for k, n in enumerate(sizes):
            t = torch.empty(n)
            dist.recv(t, 0, group=g)
            if not torch.equal(t, torch.arange(n, dtype=torch.float32) + k):
                bad.append(f"late message {k} differs")
        t = torch.empty(sizes[1])
        work = dist.irecv(t, 0, group=g)
        dist.barrier()
        work.wait()
        if not torch.equal(t, torch.arange(sizes[1], dtype=torch.float32) - 1):
            bad.append("posted receive differs")
    else:
        dist.barrier()
    # the messages went through rank 0's ring to rank 1 (same host, default settings)
    conn = g.comm.mesh.peers[1 - rank] if rank < 2 else None
    if conn is not None and (conn.ring_out, conn.ring_in)[rank] is None:
        bad.append(f"rank {rank} has no ring {('to', 'from')[rank]} rank {1 - rank}")
    dist.destroy_process_group(g)
    return bad


def _stopped(pid: int, limit_s: float = 5.0) -> None:
    """Return once every thread of process ``pid`` shows state T (stopped) in /proc, at most
    ``limit_s`` s: ``kill(SIGSTOP)`` returns before the target's threads have stopped (on a
    loaded host one may still run a while, e.g. drain a ring the test means to find full)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            states = [
                Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                for tid in os.listdir(f"/proc/{pid}/task")
            ]
        except (OSError, IndexError):
            states = []  # (a thread ended between the listing and the read: look again)
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)


def _abort_a_stuck_isend(
    pid: int, group: Any, buf: torch.Tensor, then: Callable[[], Any]
) -> dict[str, Any]:
    """Rank 0's part of the stuck-send cases: stop rank 1 (``pid``, SIGSTOP), isend ``buf``
    to it on ``group``, abort the group and time ``abort()`` and the send's ``wait()`` (with
    its error's type), run ``then()`` while rank 1 is still stopped (its dict, if any, joins
    the record), and resume rank 1 whatever happened."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    try:
        _stopped(pid)
        w = dist.isend(buf, 1, group=group)
        time.sleep(0.3)
        t0 = time.monotonic()
        group.abort()
        rec: dict[str, Any] = {"abort": time.monotonic() - t0}
        try:
            w.wait()
            rec["error"] = "no error"
        except Exception as e:
            rec["error"] = type(e).__name__
        rec["wait"] = time.monotonic() - t0
        more = then()
        if isinstance(more, dict):
            rec.update(more)
        return rec
    finally:
        os.kill(pid, signal.SIGCONT)


def send_cut_case(rank: int, world: int) -> dict[str, Any]:
    """An isend of one frame (8 MiB) whose receiver has stopped (SIGSTOP) with its receive
    posted, the ring or the socket's buffers full, when rank 0 aborts its group: ``abort()``
    returns and the send's ``wait()`` raises within the abort bound; rank 0 then reuses the
    tensor (fills it with 2). The frame in flight goes on once the receiver resumes, from a
    private copy: rank 1's receive gets the ones the tensor held at the abort, whole (a
    review saw half ones and half twos, as a success), or fails. Through a shared-memory ring
    and by TCP, on a gloo default group (each torchport group its own mesh)."""
    import torchport

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out: dict[str, Any] = {}
    n = (8 << 20) // 4
    for ring in (1 << 20, 0):
        how = "ring" if ring else "tcp"
        with torchport.config.override(dist_p2p_ring_bytes=ring):
            g = dist.new_group(list(range(world)), backend="torchport")
        t = torch.zeros(n)
        w = dist.irecv(t, 0, group=g) if rank == 1 else None
        dist.barrier()
        if rank == 0:
            buf = torch.ones(n)
            out[how] = _abort_a_stuck_isend(pids[1], g, buf, lambda buf=buf: buf.fill_(2.0))
            out[how]["ring"] = g.comm.mesh.peers[1].ring_out is not None
        dist.barrier()
        if rank == 1 and w is not None:
            try:
                w.wait()
                got = "received"
            except Exception as e:
                got = type(e).__name__
            out[how] = {"recv": got, "ones": int((t == 1).sum()), "twos": int((t == 2).sum())}
        dist.destroy_process_group(g)
    return out


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn()``: the type name of its error ("no error") and the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
        err = "no error"
    except Exception as e:
        err = type(e).__name__
    return {"error": err, "took": time.monotonic() - t0}


def _timed_while_stopped(
    pids: list[Any],
    stopped: list[int],
    call: Callable[[], Any],
    abort: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """:func:`_timed` ``call()`` while the processes of ranks ``stopped`` are stopped
    (SIGSTOP), with ``abort()`` run from another thread 0.3 s in when given; they are resumed
    (SIGCONT) whatever happens."""
    import signal
    import threading

    for q in stopped:
        os.kill(pids[q], signal.SIGSTOP)
    try:
        for q in stopped:
            _stopped(pids[q])
        timer = threading.Timer(0.3, abort) if abort is not None else None
        if timer is not None:
            timer.start()
        res = _timed(call)
        if timer is not None:
            timer.join(5)
    finally:
        for q in stopped:
            os.kill(pids[q], signal.SIGCONT)
    return res


def _against_stopped_rank_1(
    rank: int,
    world: int,
    pids: list[Any],
    call: Callable[[Any], Any],
    abort: bool = False,
    **overrides: Any,
) -> dict[str, Any] | None:
    """A fresh torchport group with a 1.5 s timeout (config ``overrides`` while it forms), on
    which rank 0 runs ``call(group)`` while rank 1 is stopped (:func:`_timed_while_stopped`;
    ``abort``: the group's ``abort()`` 0.3 s in); then every rank meets and destroys it. Rank
    0's result, None on the others."""
    import torchport

    with torchport.config.override(**overrides):
        g = dist.new_group(
            list(range(world)), backend="torchport", timeout=datetime.timedelta(seconds=1.5)
        )
    dist.barrier()
    res = None
    if rank == 0:
        res = _timed_while_stopped(pids, [1], lambda: call(g), g.abort if abort else None)
    dist.barrier()
    dist.destroy_process_group(g)
    return res


def blocking_send_case(rank: int, world: int) -> dict[str, Any]:
    """A blocking ``dist.send`` (its ``wait()`` runs the send in the caller's thread) to rank 1,
    stopped (SIGSTOP): an ``abort()`` from another thread 0.3 s in makes it raise within the
    abort bound, and a group timeout of 1.5 s makes it raise ``CommTimeoutError`` then. Before,
    the caller stayed in the send's copy loop through both for as long as the receiver was
    stopped. Through a shared-memory ring and by TCP, on a gloo default group. A TCP broadcast
    and allgather of 64 MB to it end at the group timeout too (within TIMEOUT_FINISH_S). Then a
    blocking ``dist.recv`` from the stopped rank 1 ends at the group timeout (it waited for
    good; gloo raises then too)."""
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out: dict[str, Any] = {}
    big = torch.ones((64 << 20) // 4) if rank == 0 else torch.empty(0)
    for ring in (1 << 20, 0):
        for how in ("abort", "timeout"):
            out[f"{'ring' if ring else 'tcp'} {how}"] = _against_stopped_rank_1(
                rank,
                world,
                pids,
                lambda g: dist.send(big, 1, group=g),
                abort=how == "abort",
                dist_p2p_ring_bytes=ring,
            )
    # TCP collectives whose frames to it are part-way when the timeout passes: they raised
    # FINISH_S (1 s) late, the time a frame part-way got to complete before the cut
    outs = torch.empty(world * big.numel())
    calls: dict[str, Callable[[Any], Any]] = {
        "broadcast": lambda g: dist.broadcast(big, 0, group=g),
        "allgather": lambda g: dist.all_gather_into_tensor(outs, big, group=g),
    }
    for op, call in calls.items():
        out[f"tcp {op} timeout"] = _against_stopped_rank_1(
            rank, world, pids, call, dist_transport="tcp"
        )
    # a blocking receive from it: the group timeout too (it waited for good)
    out["recv timeout"] = _against_stopped_rank_1(
        rank, world, pids, lambda g: dist.recv(torch.zeros(4), 1, group=g)
    )
    # a group timeout past threading.TIMEOUT_MAX (centuries) is no limit: the receive waits
    g = dist.new_group(
        list(range(world)), backend="torchport", timeout=datetime.timedelta(seconds=1e10)
    )
    if rank == 0:
        time.sleep(0.2)
        dist.send(torch.ones(4), 1, group=g)
    else:
        t = torch.zeros(4)
        try:
            dist.recv(t, 0, group=g)
            out["centuries"] = t.tolist()
        except Exception as e:
            out["centuries"] = type(e).__name__
    dist.barrier()
    dist.destroy_process_group(g)
    return out


def abort_send_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's isend on a subgroup waits for rank 1, stopped (SIGSTOP) with the ring full;
    rank 0 aborts the subgroup: ``abort()`` returns and the send's ``wait()`` raises within
    the abort bound, destroying the subgroup does not wait for the frame still owed, and once
    rank 1 resumes the default group, on the same connections, still works on both ranks
    while rank 1 sees the subgroup failed (its ABORT frame went after the frame in flight)."""
    sub = dist.new_group(list(range(world)))
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    rec: dict[str, Any] = {}
    dist.barrier()
    if rank == 0:

        def destroy() -> dict[str, float]:
            time.sleep(0.3)  # (stopped for longer than any cut would wait)
            t0 = time.monotonic()  # its sender thread still owes rank 1 the frame's rest
            dist.destroy_process_group(sub)
            return {"destroy": time.monotonic() - t0}

        rec = _abort_a_stuck_isend(pids[1], sub, torch.ones((64 << 20) // 4), destroy)
    t = torch.ones(3)
    dist.all_reduce(t)
    rec["sum"] = t.tolist()
    if rank == 1:
        end = time.monotonic() + 5
        while sub.comm.error is None and time.monotonic() < end:
            time.sleep(0.01)
        rec["sub"] = type(sub.comm.error).__name__
    dist.barrier()
    if rank != 0:
        dist.destroy_process_group(sub)
    return rec


def abort_word_case(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 posts a receive on a subgroup, then enters an allreduce there that rank 0 never
    joins; rank 0 aborts the subgroup. Rank 1's allreduce sees the abort through the arena's
    abort word or through rank 0's ABORT frame, whichever comes first: either way its posted
    receive fails at once with the remote error (through the abort word it stayed pending for
    good, and the ABORT frame after it found the group failed and did nothing)."""
    sub = dist.new_group(list(range(world)))
    dist.barrier(group=sub)
    rec: dict[str, Any] = {}
    if rank == 0:
        time.sleep(0.3)
        sub.abort()
    else:
        r = dist.irecv(torch.zeros(4), 0, group=sub)  # rank 0 never sends
        work = dist.all_reduce(torch.ones(1000), group=sub, async_op=True)
        try:
            work.wait()
            rec["allreduce"] = "no error"
        except Exception as e:
            rec["allreduce"] = type(e).__name__
        t0 = time.monotonic()
        try:
            r.wait(datetime.timedelta(seconds=3))
            rec["recv"] = "no error"
        except Exception as e:
            rec["recv"] = type(e).__name__
        rec["recv_wait"] = time.monotonic() - t0
        rec["pending"] = len(sub.comm._pending)
    dist.barrier()
    dist.destroy_process_group(sub)
    return rec


def recv_cut_case(rank: int, world: int) -> dict[str, Any]:
    """A receive whose message is part-way into its tensor when its group is aborted (the
    sender stopped by SIGSTOP mid-message): once ``wait()`` raised, nothing more lands in the
    tensor (the reader sinks the rest of its slice, or the stalled connection is shut). Run on a
    gloo default group: the torchport group's mesh is its own, and the cut ends it. Up to three
    tries: on a busy host the whole message could land before the stop took effect (a CI run
    saw it whole, received without error), which tests nothing."""
    import signal

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    n = (64 << 20) // 4  # float32: four 16 MiB frames
    rec: dict[str, Any] = {}
    for _ in range(3):
        g = dist.new_group(list(range(world)), backend="torchport")
        if rank == 0:
            err = "no error"
            dist.barrier()
            try:
                dist.send(torch.ones(n), 1, group=g)
            except Exception as e:
                err = type(e).__name__
            dist.barrier()
            rec = {"send": err}
        else:
            t = torch.zeros(n)
            work = dist.irecv(t, 0, group=g)
            dist.barrier()
            deadline = time.monotonic() + 10
            while t[0].item() == 0 and time.monotonic() < deadline:
                pass
            os.kill(pids[0], signal.SIGSTOP)
            try:
                time.sleep(0.2)
                t0 = time.monotonic()
                g.abort()
                got = _timed(work.wait)["error"]
                took = time.monotonic() - t0
                before = int(t.count_nonzero())
                t.zero_()  # the user reuses the buffer
            finally:
                os.kill(pids[0], signal.SIGCONT)
            time.sleep(1.0)
            after = int(t.count_nonzero())
            dist.barrier()
            rec = {"wait": got, "took": took, "partial": 0 < before < n, "after": after}
        cut = [None] * world
        dist.all_gather_object(cut, rec.get("partial"))
        if cut[1]:
            break
    return rec


def auth_case(rank: int, world: int) -> dict[str, Any]:
    """A stranger without the secret is rejected; the group keeps working."""
    import socket

    from torchport.distributed import auth
    from torchport.distributed.groups import root_mesh
    from torchport.distributed.wire import Kind, encode_header

    mesh = root_mesh()
    assert mesh is not None
    host, port = mesh.address.rsplit(":", 1)
    before = mesh.rejected
    outcomes = []
    # 1: a client that claims rank 1 with a wrong secret
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(encode_header(Kind.HELLO, 0, world - 1, 0, 32) + auth.new_nonce())
    s.recv(64 + 64)
    s.sendall(encode_header(Kind.PROOF, 0, world - 1, 0, 32) + bytes(32))
    outcomes.append(s.recv(64))  # b"" = closed without ACCEPT
    s.close()
    # 2: garbage bytes
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"GET / HTTP/1.1\r\n" * 4)
    outcomes.append(s.recv(64))
    s.close()
    time.sleep(0.2)
    t = torch.ones(3)
    dist.all_reduce(t)
    return {"rejected": mesh.rejected - before, "outcomes": outcomes, "sum": t.tolist()}


def fsdp2_losses(rank: int, world: int) -> dict[str, list[float]]:
    """FSDP2 (fully_shard) training on the gloo group and on the torchport group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, group in (
        ("gloo", dist.new_group(backend="gloo")),
        ("torchport", dist.distributed_c10d._get_default_group()),
    ):
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = losses
    return out


def grid_mailbox(rank: int, world: int, sizes: list[int]) -> list[str]:
    """The grid with the last rank's native TCP transfers refused (``Mesh.transfer`` returns
    None, as when another collective owns a connection): that rank takes every collective's
    mailbox path while the others take the native one, so both paths must put the same
    frames on the wire in the same order."""
    from torchport.distributed.transport_tcp import Mesh

    if rank != world - 1:
        return grid(rank, world, sizes)
    native = Mesh.transfer
    Mesh.transfer = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        return grid(rank, world, sizes)
    finally:
        Mesh.transfer = native  # type: ignore[method-assign]


def contract_case(rank: int, world: int) -> list[str]:
    """Regressions from a review of the collective contract (each was a silent wrong answer, a
    lost connection or an untyped error): PREMUL_SUM reduce-scatter of a transposed input,
    in-place reduce-scatter (output = the rank's own block, as NCCL allows), a recv into a leaf
    that requires grad (the connection's reader thread died on it) followed by another recv, a
    0-dim send, ``wait(timeout)`` on a collective whose peer is late, in-place all_to_all_single /
    all_to_all and all_gather_coalesced's output layout (one list per rank)."""
    bad = []
    base = torch.arange(2 * 3 * world, dtype=torch.float32).reshape(2, 3 * world)
    inp = base.t()  # [3 world, 2], non-contiguous
    out = torch.zeros(3, 2)
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(2.0))
    want = 2.0 * world * inp.contiguous()[rank * 3 : (rank + 1) * 3]
    if not torch.equal(out, want):
        bad.append(f"premul reduce_scatter of a transposed input got {out.flatten().tolist()}")
    for n in (4, 5000):  # one piece, and several under SMALL_CHUNK
        flat = torch.full((world * n,), float(10**rank), dtype=torch.float64)
        own = flat[rank * n : (rank + 1) * n]
        dist.reduce_scatter_tensor(own, flat)
        ins = [torch.full((n,), float(10**rank), dtype=torch.float64) for _ in range(world)]
        dist.reduce_scatter(ins[rank], ins)
        total = float(sum(10**q for q in range(world)))
        if not (bool((own == total).all()) and bool((ins[rank] == total).all())):
            bad.append(f"in-place reduce_scatter n={n} got {own[0].item()}, {ins[rank][0].item()}")
    if rank == 0:
        dist.send(torch.ones(3), 1, tag=11)
        dist.send(torch.full((2,), 5.0), 1, tag=12)
        dist.send(torch.tensor(3.5), 1, tag=13)
    elif rank == 1:
        leaf = torch.zeros(3, requires_grad=True)
        later, scalar = torch.zeros(2), torch.zeros(())
        for t, tag in ((leaf, 11), (later, 12), (scalar, 13)):
            dist.irecv(t, 0, tag=tag).wait(datetime.timedelta(seconds=20))
        got = (leaf.detach().tolist(), later.tolist(), scalar.item())
        if got != ([1.0] * 3, [5.0, 5.0], 3.5):
            bad.append(f"recv into a grad leaf / after it / 0-dim got {got}")
    # in-place all_to_all_single: over TCP a received block overwrote rows not yet sent
    t = torch.arange(2.0 * world) + 100 * rank
    dist.all_to_all_single(t, t)
    want = [100.0 * q + 2 * rank + k for q in range(world) for k in range(2)]
    if t.tolist() != want:
        bad.append(f"in-place all_to_all_single got {t.tolist()}")
    ts = [torch.full((2,), 10.0 * rank + d) for d in range(world)]
    dist.all_to_all(ts, ts)  # (the list form too)
    if [t[0].item() for t in ts] != [10.0 * q + rank for q in range(world)]:
        bad.append(f"in-place all_to_all got {[t.tolist() for t in ts]}")
    # an all_gather / all_gather_into_tensor / gather input in the next rank's output slot:
    # over TCP from three ranks a peer's block landed on it before it was sent
    q, n = (rank + 1) % world, 4
    want = [100.0 * p + k for p in range(world) for k in range(n)]
    flat = torch.zeros(world * n)
    flat[q * n : (q + 1) * n] = 100.0 * rank + torch.arange(n, dtype=torch.float32)
    dist.all_gather_into_tensor(flat, flat[q * n : (q + 1) * n])
    rows = torch.zeros(world, n)
    rows[q] = 100.0 * rank + torch.arange(n, dtype=torch.float32)
    dist.all_gather(list(rows.unbind(0)), rows[q])
    rows2 = torch.zeros(world, n)
    rows2[q] = 100.0 * rank + torch.arange(n, dtype=torch.float32)
    dist.gather(rows2[q], list(rows2.unbind(0)) if rank == 0 else None, dst=0)
    mine = rows2[q].tolist() == [100.0 * rank + k for k in range(n)]
    for what, got in (("all_gather_into_tensor", flat), ("all_gather", rows)):
        if got.flatten().tolist() != want:
            bad.append(f"{what} of an input in another rank's slot got {got.flatten().tolist()}")
    if (rank == 0 and rows2.flatten().tolist() != want) or (rank and not mine):
        bad.append(f"gather of an input in another rank's slot got {rows2.flatten().tolist()}")
    # all_gather_coalesced: output_lists[q][i] is rank q's input i (it came back transposed)
    outs = [[torch.zeros(1) for _ in range(world)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [torch.full((1,), 10.0 * rank + i) for i in range(world)])
    got = [[o.item() for o in row] for row in outs]
    if got != [[10.0 * q + i for i in range(world)] for q in range(world)]:
        bad.append(f"all_gather_coalesced got {got}")
    dist.barrier()
    t = torch.ones(2)
    if rank == 1:
        time.sleep(1.0)
        dist.all_reduce(t)
    elif rank == 0:
        work = dist.all_reduce(t, async_op=True)
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=0.2))
            bad.append("wait(0.2 s) on a late peer returned")
        except Exception as e:
            if "timed out" not in str(e) or time.monotonic() - t0 > 0.8:
                bad.append(f"wait(0.2 s): {type(e).__name__} after {time.monotonic() - t0:.2f} s")
        work.wait()
        if t.tolist() != [float(world)] * 2:
            bad.append(f"late all_reduce got {t.tolist()}")
    else:
        dist.all_reduce(t)
    return bad


def two_groups_case(rank: int, world: int) -> dict[str, Any]:
    """Two groups sharing the default group's connections, each driven by its own thread with
    collectives that move several frames per peer (the pipelined allreduce, the broadcast chain,
    allgather and alltoall in 16 KiB chunks). Over TCP each rank's transfer of one group held its
    send locks while it waited for a frame, which the peer's transfer of the other group could
    not send for the same reason: 0 of 200 small allreduces, then the group timeout."""
    gs = [
        dist.new_group(backend="torchport", timeout=datetime.timedelta(seconds=20))
        for _ in range(2)
    ]
    out: dict[str, Any] = {}

    def run(k: int) -> None:
        g, done = gs[k], 0
        try:
            for i in range(6):
                n = (1000, 30_001, 110_000)[(i + k) % 3]
                t = torch.full((n,), float(rank + i))
                dist.all_reduce(t, group=g)
                assert t.eq(sum(q + i for q in range(world))).all(), ("all_reduce", i)
                b = torch.full((n,), float(10 * rank + i))
                dist.broadcast(b, src=i % world, group=g)
                assert b.eq(10 * (i % world) + i).all(), ("broadcast", i)
                got = torch.empty(n * world)
                dist.all_gather_into_tensor(got, torch.full((n,), float(rank)), group=g)
                assert got.eq(torch.arange(world).repeat_interleave(n)).all(), ("allgather", i)
                a = torch.arange(n * world, dtype=torch.float32) + 1e6 * rank
                o = torch.empty_like(a)
                dist.all_to_all_single(o, a, group=g)
                want = torch.cat([torch.arange(n) + n * rank + 1e6 * q for q in range(world)])
                assert o.eq(want).all(), ("alltoall", i)
                done += 1
            out[f"g{k}"] = "ok"
        except Exception as e:
            out[f"g{k}"] = f"{type(e).__name__} after {done}: {str(e)[:200]}"

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.1, 40.0 - (time.monotonic() - t0)))
    out["elapsed"] = time.monotonic() - t0
    out["alive"] = sum(th.is_alive() for th in threads)
    return out


def avg_half_case(rank: int, world: int) -> list[str]:
    """ReduceOp.AVG of float16 values whose sum overflows float16 but whose mean fits: the sum
    was taken first (inf); it premultiplies by 1 / world_size now, as NCCL does."""
    bad = []
    x = torch.full((5,), 40000.0, dtype=torch.float16)
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if not t.eq(40000.0).all():
        bad.append(f"all_reduce {t.tolist()}")
    t = x.clone()
    dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
    if rank == 0 and not t.eq(40000.0).all():
        bad.append(f"reduce {t.tolist()}")
    out = torch.empty(5, dtype=torch.float16)
    dist.reduce_scatter_tensor(out, x.repeat(world), op=dist.ReduceOp.AVG)
    if not out.eq(40000.0).all():
        bad.append(f"reduce_scatter_tensor {out.tolist()}")
    return bad


SCENARIOS = {
    "avg_half": avg_half_case,
    "contract": contract_case,
    "two_groups": two_groups_case,
    "fsdp2": fsdp2_losses,
    "grid": grid,
    "grid_mailbox": grid_mailbox,
    "p2p": p2p_case,
    "recv_cut": recv_cut_case,
    "send_cut": send_cut_case,
    "blocking_send": blocking_send_case,
    "abort_send": abort_send_case,
    "abort_word": abort_word_case,
    "p2p_late": p2p_late_case,
    "split": split_case,
    "split_again": split_again_case,
    "mismatch": mismatch_case,
    "mismatch_one": mismatch_one_rank_case,
    "same_size_dtypes": same_size_dtypes_case,
    "late_peer": late_peer_case,
    "auth": auth_case,
    "timeout": timeout_case,
    "destroy_in_flight": destroy_in_flight_case,
    "destroy_flushes": destroy_flushes_case,
    "stale_incarnation": stale_incarnation_case,
    "recreate": recreate_case,
    "after_close": after_close_case,
    "overlap_unlocked": overlap_unlocked_case,
    "destroy_in_recv_callback": destroy_in_recv_callback_case,
    "overlap_delivered": overlap_delivered_case,
    "destroy_in_callback": destroy_in_callback_case,
    "abort": abort_case,
    "gc_inherited": gc_inherited_case,
    "abort_streaming": abort_streaming_case,
    "stuck_peer": stuck_peer_case,
    "ddp": ddp_losses,
    "ddp_powersgd": ddp_powersgd_losses,
    "nested_in_callback": nested_in_callback_case,
    "close_racing_submit": close_racing_submit_case,
}


def job(rank: int, world: int, init_method: str, plan: list[tuple[str, tuple]]) -> dict[str, Any]:
    """Initialise once, then run the named scenarios in order (one spawn per world size)."""
    init(rank, world, init_method)
    out = {}
    for name, args in plan:
        out[name] = SCENARIOS[name](rank, world, *args)
        dist.barrier()
    return out


def gloo_job(
    rank: int, world: int, init_method: str, plan: list[tuple[str, tuple]]
) -> dict[str, Any]:
    """Like :func:`job` with a gloo default group: torchport groups then build their own mesh."""
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=init_method,
        timeout=datetime.timedelta(seconds=30),
    )
    out = {}
    for name, args in plan:
        out[name] = SCENARIOS[name](rank, world, *args)
        dist.barrier()
    return out


def enter_host(ns: str, hostname: str) -> None:
    """Move this process into network namespace ``ns`` with its own hostname (a fake host)."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet, clone_newuts = 0x40000000, 0x04000000
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")
    finally:
        os.close(fd)
    if libc.unshare(clone_newuts) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
    name = hostname.encode()
    if libc.sethostname(name, len(name)) != 0:
        raise OSError(ctypes.get_errno(), "sethostname")


def cross_host_stop_job(
    rank: int, world: int, init_method: str, hosts: list[tuple[str, str, str]], how: str
) -> dict[str, Any]:
    """Rank 0 stops host B's ranks (2 and 3, SIGSTOP) and all-reduces 64 MB on a hybrid group
    with a 1.5 s timeout: its frames to host B fill the sockets, and its sends wait there.
    ``how`` "abort": an ``abort()`` 0.3 s in ends the call within the abort bound; "timeout":
    the group timeout ends it. Before, those sends blocked in ``sendall`` through both, for
    as long as the receivers stayed stopped. Rank 0's result: the error and the time taken."""
    ns, ip, hostname = hosts[rank]
    enter_host(ns, hostname)
    os.environ["TORCHPORT_DIST_ADDR"] = ip
    init(rank, world, init_method)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    g = dist.new_group(
        list(range(world)), backend="torchport", timeout=datetime.timedelta(seconds=1.5)
    )
    dist.barrier(group=g)
    big = torch.ones((64 << 20) // 4)
    if rank != 0:
        # later than rank 0 (whose own timeout is what ends its call, not rank 1's); host B's
        # ranks are stopped before or in the call
        time.sleep(0.3)
        _timed(lambda: dist.all_reduce(big, group=g))  # (it fails: how is not tested here)
        return {}
    abort = g.abort if how == "abort" else None
    return _timed_while_stopped(pids, [2, 3], lambda: dist.all_reduce(big, group=g), abort)


def cross_host_job(
    rank: int, world: int, init_method: str, hosts: list[tuple[str, str, str]]
) -> dict[str, Any]:
    """Ranks spread over network namespaces (fake hosts); collectives vs the reference."""
    import os

    from torchport.distributed.groups import root_mesh

    ns, ip, hostname = hosts[rank]
    enter_host(ns, hostname)
    os.environ["TORCHPORT_DIST_ADDR"] = ip
    init(rank, world, init_method)
    pg = dist.distributed_c10d._get_default_group()
    bad: list[str] = []
    for case, n in enumerate([7, 70_001, 300_001]):
        for dt, op in [(torch.float32, "SUM"), (torch.bfloat16, "AVG"), (torch.int32, "MAX")]:
            ins = [make(q, 100 * case + q, n, dt, op) for q in range(world)]
            t = ins[rank].clone()
            dist.all_reduce(t, op=_op(op))
            if not _eq(t, allreduce_reference(ins, op)):
                bad.append(f"all_reduce {op} {dt} n={n}")
        ins = [make(q, 7 * case + 3, n, torch.float32) for q in range(world)]
        t = ins[rank].clone()
        dist.broadcast(t, src=world - 1)
        if not _eq(t, ins[world - 1]):
            bad.append(f"broadcast n={n}")
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, ins[rank])
        if not _eq(out, torch.cat(ins)):
            bad.append(f"all_gather_into_tensor n={n}")
        blocks = [make(q, 11 * case + 5, n * world, torch.float64) for q in range(world)]
        rs = torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter_tensor(rs, blocks[rank].clone())
        if not _eq(rs, allreduce_reference([b[rank * n : (rank + 1) * n] for b in blocks], "SUM")):
            bad.append(f"reduce_scatter_tensor n={n}")
        sends = [(rank + d) % 3 + n // world for d in range(world)]
        recvs = [(q + rank) % 3 + n // world for q in range(world)]
        inp = make(rank, 13 * case, sum(sends), torch.int64)
        a2a = torch.empty(sum(recvs), dtype=torch.int64)
        dist.all_to_all_single(a2a, inp, recvs, sends)
        want = []
        for q in range(world):
            qs = [(q + d) % 3 + n // world for d in range(world)]
            want.append(
                make(q, 13 * case, sum(qs), torch.int64)[sum(qs[:rank]) : sum(qs[: rank + 1])]
            )
        if not _eq(a2a, torch.cat(want)):
            bad.append(f"all_to_all_single n={n}")
        red_in = [make(q, 17 * case + 1, n, torch.float32) for q in range(world)]
        t = red_in[rank].clone()
        dist.reduce(t, dst=1)
        if rank == 1 and not _eq(t, allreduce_reference(red_in, "SUM")):
            bad.append(f"reduce n={n}")
        outs = [torch.empty(n) for _ in range(world)] if rank == 2 else None
        dist.gather(red_in[rank], outs, dst=2)
        if rank == 2 and not all(_eq(o, i) for o, i in zip(outs or [], red_in)):
            bad.append(f"gather n={n}")
        pieces = [make(9, 19 * case + d, n, torch.float32) for d in range(world)]
        o = torch.empty(n)
        dist.scatter(o, pieces if rank == 3 else None, src=3)
        if not _eq(o, pieces[rank]):
            bad.append(f"scatter n={n}")
    bad += p2p_case(rank, world)
    # a group of the ranks on my host is a shared-memory group; one spanning hosts is not
    same = [q for q in range(world) if hosts[q][2] == hostname]
    local = None
    for h in sorted({hh for _, _, hh in hosts}):
        g = dist.new_group([q for q in range(world) if hosts[q][2] == h], backend="torchport")
        if h == hostname:
            local = g
    t = torch.ones(5)
    dist.all_reduce(t, group=local)
    if not torch.equal(t, torch.full((5,), float(len(same)))):
        bad.append(f"local group sum {t.tolist()}")
    # a mismatched call on a hybrid group fails on every rank (local and remote peers)
    from torchport.distributed import CollectiveMismatchError, CommunicatorErrorState, RemoteError

    sub = dist.new_group(list(range(world)), backend="torchport")
    mismatch = "no error"
    try:
        dist.all_reduce(torch.ones(5 if rank == 0 else 6), group=sub)
    except (CollectiveMismatchError, RemoteError, CommunicatorErrorState) as e:
        mismatch = type(e).__name__
    # abort on a hybrid group reaches every rank quickly
    sub2 = dist.new_group(list(range(world)), backend="torchport")
    dist.barrier(group=sub2)
    abort = {}
    if rank == 0:
        time.sleep(0.5)
        abort["t_abort"] = time.time()
        sub2.abort()
    else:
        work = dist.all_reduce(torch.ones(1000), group=sub2, async_op=True)
        try:
            work.wait()
        except RemoteError as e:
            abort = {"t_fail": time.time(), "msg": str(e)}
    mesh = root_mesh()
    assert mesh is not None
    return {
        "bad": bad,
        "mismatch": mismatch,
        "abort": abort,
        "sub_transport": sub.transport,
        "transport": pg.transport,
        "local_transport": local.transport if local is not None else None,
        "address": mesh.address,
        "peer_hosts": sorted(set(mesh.hosts.values())),
    }
