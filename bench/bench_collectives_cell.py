"""One collectives cell, ``torchport`` vs gloo, many samples: the spread, not just a median.

``bench_collectives.py`` times each cell as the median of its samples, each ``2 MB / size``
calls (2 calls at 1 MB, 1 at 64 MB) after a gloo barrier, on the slowest rank (before the tenth
session: 3 samples with ``--quick``, rank 0 only; a cell then swung 2x between runs on this
shared VM). This script times one cell the same way (same processes, gloo barrier, then
``--calls`` calls, alternating backends sample by sample, each sample the slowest rank's time)
for ``--samples`` samples and prints p10 / median / p90 per backend, the ratio of the medians,
and rank 0's own medians (the root of a broadcast: gloo's returns once its data is sent).
Before the fourteenth session it timed rank 0 only. ``--calls 1`` is the first call after the
barrier (the rank skew counts); ``--calls 20`` is the steady per-call cost.

It also prints each backend's CPU time per call, summed over the ranks: every thread of the
process (the caller's, the reader threads', gloo's; ``time.process_time``) and the calling
thread alone (``time.thread_time``), both read around the timed calls. Not user and system
apart: ``getrusage`` splits the total by timer ticks (4 ms), which over a 1 ms sample is noise
(the callers' user time came out above the processes'). On this two-core VM a four-rank cell
is CPU-bound, so CPU per call decides it as much as latency does, and it is steadier than wall
time under a noisy load.

Run: ``flock /tmp/tp-bench.lock python bench/bench_collectives_cell.py --op broadcast
--size 1048576 --world 2 --samples 30 --calls 2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import (  # the grid's cells, timed alike
    OPS,
    _op_fn,
    _slowest,
    check_memory,
    wait_all,
)

from torchport.benchmarks import positive_int, scratch_dir
from torchport.cli import int_at_least, positive_float


def worker(rank: int, world: int, init: str, op: str, size: int, samples: int, calls: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    import torchport.distributed  # noqa: F401

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("torchport", rank=rank, world_size=world, init_method=init)
    gloo = dist.new_group(backend="gloo")
    fns = {"gloo": _op_fn(op, size, world, gloo), "torchport": _op_fn(op, size, world, None)}
    for fn in fns.values():
        for _ in range(3):
            fn()
    res: dict[str, list[float]] = {name: [] for name in fns}
    own: dict[str, list[float]] = {name: [] for name in fns}  # this rank's times
    # CPU seconds over the timed calls: every thread of this process, the calling thread
    cpu = {name: torch.zeros(2, dtype=torch.float64) for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            dist.barrier(group=gloo)
            c0 = time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            own[name].append((time.perf_counter() - t0) / calls)
            c1 = time.process_time(), time.thread_time()
            cpu[name] += torch.tensor([c1[0] - c0[0], c1[1] - c0[1]], dtype=torch.float64)
            res[name].append(_slowest(own[name][-1], gloo))
    for c in cpu.values():
        dist.all_reduce(c, group=gloo)  # summed over the ranks
    if rank == 0:
        parts = []
        for name, v in res.items():
            s = sorted(v)
            p10, p90 = s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]
            parts.append(
                f"{name} p10 {p10 * 1e6:.0f} med {statistics.median(s) * 1e6:.0f} "
                f"p90 {p90 * 1e6:.0f} us"
            )
        ratio = statistics.median(res["gloo"]) / statistics.median(res["torchport"])
        r0 = ", ".join(f"{name} {statistics.median(v) * 1e6:.0f}" for name, v in own.items())
        tag = os.environ.get("TP_CELL_TAG", "")
        print(
            f"{tag}{op} {size} B w{world} calls {calls}, slowest rank: {'; '.join(parts)}; "
            f"ratio {ratio:.2f}x (rank 0 med: {r0} us)",
            flush=True,
        )
        per = 1e6 / (samples * calls)
        print(
            f"{tag}  CPU per call, summed over the ranks: "
            + "; ".join(
                f"{name} {c[0] * per:.0f} us (calling threads {c[1] * per:.0f})"
                for name, c in ((name, c.tolist()) for name, c in cpu.items())
            ),
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), int(a[6]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--op", default="broadcast", choices=OPS)
    # (unchecked, --world 0 ran nothing and exited 0, --size -7 timed a bogus cell, a huge one
    # failed in every worker: checked against the memory below)
    p.add_argument("--size", type=int_at_least(4), default=1 << 20, help="bytes, >= 4")
    p.add_argument("--world", type=positive_int, default=2)
    p.add_argument("--samples", type=positive_int, default=30)
    p.add_argument(
        "--calls", type=positive_int, default=2, help="calls per sample (after a barrier)"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=170.0, help="seconds; workers are killed"
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default=None,
        help="torchport's transport (TORCHPORT_DIST_TRANSPORT for the workers; default: inherited)",
    )
    args = p.parse_args()
    check_memory(p, "--size", [args.size], "--world", [args.world])
    with scratch_dir("tp-cell-") as tmp:  # (also on SIGTERM: the folder stayed, workers ran on)
        _run(args, tmp)


def _run(args: argparse.Namespace, tmp: str) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    if args.transport is not None:
        env["TORCHPORT_DIST_TRANSPORT"] = args.transport
    cmd = [sys.executable, __file__, "--worker"]
    rest = [f"file://{tmp}/store", args.op, str(args.size), str(args.samples), str(args.calls)]
    procs = [
        subprocess.Popen([*cmd, str(r), str(args.world), *rest], env=env) for r in range(args.world)
    ]
    codes = wait_all(procs, args.timeout)
    if any(codes):
        raise SystemExit(f"workers failed: exit codes {codes}")


if __name__ == "__main__":
    main()
