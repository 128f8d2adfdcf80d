"""Collectives of the ``torchport`` backend vs gloo, same processes, same run (interleaved).

For world sizes 2 and 4 (spawned processes on this host), times allreduce, broadcast,
allgather (all_gather_into_tensor), reduce_scatter_tensor and all_to_all_single from 4 KB to
64 MB on a gloo group and on the torchport group of the same processes, alternating sample by
sample; a sample is the slowest rank's time (every rank times the same calls after a barrier).
Reports median latency and algorithm bandwidth (size / time, size = the larger buffer) and the
ratio. Then DDP training throughput of a small MLP on each backend (world 2). With
``--ops sendrecv`` (not in the default set): point-to-point, every even rank sends to the next
odd rank (``dist.send``/``dist.recv``, pairs at once), the receiver's time per message.

Allreduce, alltoall and broadcast cells from 16 MB also time, in the same interleaved loop,
one in-place pass over a buffer of the cell's size (``t.mul_(1.0)``: each byte read from memory
and written back; ``pass_ms``, and ``ours_per_pass`` = torchport's time over it): on every rank
at once for allreduce and alltoall, on the root alone for broadcast. Past the caches each op
has at least that memory traffic: an allreduce or alltoall reads its input once and writes its
output once on every rank (the peers' parts can come through the shared cache), a broadcast
reads the root's buffer once and writes it once per receiver (at world 2, one read and one
write of the size: the pass). So the pass is the machine's floor for the bandwidth target:
gloo's time over it (``gloo_per_pass``) is the most any backend could gain on it here.

Run: ``torchport bench collectives [--quick]`` (or ``python bench/bench_collectives.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KB, MB = 1 << 10, 1 << 20
OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
EXTRA_OPS = ("sendrecv",)  # only when named in --ops
# samples per backend for cells under 16 MB (larger cells use --reps, at most 7)
SMALL_SAMPLES = 15
# samples per backend for cells from 16 MB with --quick: before the fifteenth session 3, and the
# 64 MB allreduce cell at world 2 then read 2.73x in one run against 4.56x in a 15-sample cell
# bench right after (one slow sample of three decided the median)
QUICK_LARGE_SAMPLES = 7
# what one rank holds: Python, torch and torchport.distributed (323 MiB peak RSS here), and per
# cell both backends' buffers and the in-place pass's, at most 5 x the cell's size
RANK_BYTES = 320 << 20


def check_memory(
    p: Any, size_opt: str, sizes: list[int], world_opt: str, worlds: list[int]
) -> None:
    """A usage error (``p.error``) when the largest cell at the largest world would take more
    than this machine's memory: a huge size or world failed in every worker, each with a
    traceback, or spawned processes until the machine ran out."""
    world, size = max(worlds), max(sizes)
    need = world * (RANK_BYTES + 5 * size)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total:
        p.error(
            f"{size_opt} {size} at {world_opt} {world} takes about {need / 2**30:.1f} GiB "
            f"({RANK_BYTES >> 20} MiB + 5 x the size per rank), more than this machine's "
            f"{total / 2**30:.1f} GiB"
        )


def _op_fn(op: str, size: int, world: int, group):
    import torch
    import torch.distributed as dist

    n = max(world, size // 4 // world * world)
    if op == "sendrecv":
        rank = dist.get_rank(group)
        t, peer = torch.ones(size // 4), rank ^ 1
        if peer >= world:  # (an odd world's last rank has no partner)
            return lambda: None
        if rank % 2 == 0:
            return lambda: dist.send(t, peer, group=group)
        return lambda: dist.recv(t, peer, group=group)
    if op == "allreduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=group)
    if op == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, src=0, group=group)
    if op == "allgather":
        out, inp = torch.empty(n), torch.ones(n // world)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if op == "reduce_scatter":
        out, inp = torch.empty(n // world), torch.ones(n)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    out, inp = torch.empty(n), torch.ones(n)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _time(fn, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k


def _slowest(seconds: float, group) -> float:
    """The sample's time on the slowest rank (a MAX allreduce over gloo, outside the timing): a
    collective is done when every rank is, and a broadcast root that returns once its data is
    sent (gloo's) or once the last reader has it (ours) would otherwise be compared unlike."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def worker(
    rank: int, world: int, init: str, out: str, quick: bool, reps: int, ops: str, sizes: str
) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    import torchport.distributed  # noqa: F401

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("torchport", rank=rank, world_size=world, init_method=init)
    groups = {
        "gloo": dist.new_group(backend="gloo"),
        "torchport": dist.distributed_c10d._get_default_group(),
    }
    if sizes:
        cells = [int(s) for s in sizes.split(",")]
    else:
        cells = [4 * KB, 1 * MB, 64 * MB] if quick else [4 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB]
    chosen = ops.split(",") if ops else list(OPS)
    rows = []
    for op in (o for o in (*OPS, *EXTRA_OPS) if o in chosen):
        for size in cells:
            fns = {name: _op_fn(op, size, world, g) for name, g in groups.items()}
            if op in ("allreduce", "alltoall", "broadcast") and size >= 16 * MB:
                buf = torch.ones(max(world, size // 4 // world * world))
                if op != "broadcast" or rank == 0:
                    fns["pass"] = lambda buf=buf: buf.mul_(1.0)
                else:
                    fns["pass"] = lambda: None
            k = max(1, min(200, (2 * MB) // size))
            for fn in fns.values():
                _time(fn, max(1, k // 4))
            samples: dict[str, list[float]] = {name: [] for name in fns}
            # below 16 MB a sample takes a few ms: at least SMALL_SAMPLES of them, since the
            # median of --quick's 3 two-call samples at 1 MB swung 0.88x-1.8x between runs
            for _ in range(reps if size >= 16 * MB else max(reps, SMALL_SAMPLES)):
                for name, fn in fns.items():
                    dist.barrier(group=groups["gloo"])
                    samples[name].append(_slowest(_time(fn, k), groups["gloo"]))
            rows.append(
                {"op": op, "size": size, **{n: statistics.median(v) for n, v in samples.items()}}
            )
    if world == 2 and "ddp" in chosen:
        rows.append(_ddp(groups, quick))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _ddp(groups, quick: bool):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    models = {}
    for name, g in groups.items():
        m = torch.nn.Sequential(
            torch.nn.Linear(512, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )
        models[name] = (DDP(m, process_group=g), torch.optim.SGD(m.parameters(), lr=0.01))
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))

    def step(name: str) -> None:
        ddp, opt = models[name]
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    steps = 5 if quick else 20
    times: dict[str, list[float]] = {n: [] for n in models}
    for name in models:
        step(name)
    for _ in range(3):
        for name in models:
            dist.barrier(group=groups["gloo"])
            times[name].append(_time(lambda n=name: step(n), steps))
    params = sum(p.numel() for p in models["gloo"][0].parameters())
    return {
        "op": "ddp_mlp",
        "size": params * 4,
        **{n: statistics.median(v) for n, v in times.items()},
    }


def run_world(
    world: int, quick: bool, reps: int, timeout: float, ops: str = "", sizes: str = ""
) -> list[dict]:
    from torchport.benchmarks import scratch_dir  # (not in the workers: they need no harness)

    # (removed also on SIGTERM: the folder stayed in /tmp and the workers ran on)
    with scratch_dir("tp-bench-") as tmp:
        return _run_world_in(tmp, world, quick, reps, timeout, ops, sizes)


def _run_world_in(
    tmp: str, world: int, quick: bool, reps: int, timeout: float, ops: str, sizes: str
) -> list[dict]:
    out = os.path.join(tmp, "rows.json")
    init = f"file://{tmp}/store"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(r),
                str(world),
                init,
                out,
                str(int(quick)),
                str(reps),
                ops,
                sizes,
            ],
            env=env,
        )
        for r in range(world)
    ]
    codes = wait_all(procs, timeout)
    if any(codes):
        raise RuntimeError(f"benchmark workers failed: exit codes {codes}")
    return json.loads(Path(out).read_text())


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every worker within ``timeout`` seconds in all; kill what is left (a hung
    worker never outlives the benchmark). Returns the exit codes."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def _fmt(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:10]
        worker(int(a[0]), int(a[1]), a[2], a[3], bool(int(a[4])), int(a[5]), a[6], a[7])
        return
    from torchport.benchmarks import BenchTable, arg_parser, comma_list, positive_int
    from torchport.cli import int_at_least

    p = arg_parser(__doc__ or "")
    p.add_argument(
        "--worlds", type=comma_list(positive_int), default="2,4", help="comma-separated world sizes"
    )
    p.add_argument(
        "--ops",
        default="",
        help=f"comma-separated subset of {','.join((*OPS, *EXTRA_OPS))},ddp "
        "(default: all but sendrecv)",
    )
    p.add_argument(
        "--sizes",
        type=comma_list(int_at_least(4)),  # (under 4 bytes: no float32 element)
        default=None,
        help="comma-separated byte sizes, each >= 4 (default: the grid)",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "shm", "tcp"),
        help="TORCHPORT_DIST_TRANSPORT for the torchport group (tcp: the TCP algorithms)",
    )
    args = p.parse_args()
    # (checked here: a bad value failed in every spawned worker with a traceback each)
    check_memory(p, "--sizes", args.sizes or [64 * MB], "--worlds", args.worlds)
    sizes = ",".join(map(str, args.sizes or ()))
    known = (*OPS, *EXTRA_OPS, "ddp")
    bad = [o for o in (args.ops or "").split(",") if args.ops and o.strip() not in known]
    if bad:  # (an unknown name was skipped: an empty table, exit 0)
        p.error(f"--ops: unknown op(s) {bad}; known: {', '.join(known)}")
    reps = QUICK_LARGE_SAMPLES if args.quick else min(args.reps, 7)
    table = BenchTable("collectives", unit="GB/s")
    table.start()
    os.environ["TORCHPORT_DIST_TRANSPORT"] = args.transport
    tag = "" if args.transport == "auto" else f" {args.transport}"
    for world in args.worlds:
        ops = args.ops or ",".join((*OPS, "ddp"))
        for row in run_world(world, args.quick, reps, timeout=900, ops=ops, sizes=sizes):
            if row["op"] == "ddp_mlp":
                table.add(
                    f"DDP MLP step w{world}{tag} ({row['size'] / MB:.0f} MB grads)",
                    "gloo",
                    row["gloo"],
                    row["torchport"],
                    row["size"],
                )
            else:
                floor = {}
                if "pass" in row:
                    floor = {
                        "pass_ms": f"{row['pass'] * 1e3:.2f}",
                        "ours_per_pass": f"{row['torchport'] / row['pass']:.2f}",
                        "gloo_per_pass": f"{row['gloo'] / row['pass']:.2f}",
                    }
                table.add(
                    f"{row['op']} {_fmt(row['size'])} w{world}{tag}",
                    "gloo",
                    row["gloo"],
                    row["torchport"],
                    row["size"],
                    **floor,
                )
    table.save(args.json)


if __name__ == "__main__":
    main()
