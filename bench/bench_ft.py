"""Fault tolerance: detection, reconfigure, heal bandwidth, manager / Flight Recorder overhead, and
training throughput with a fault — each next to a gloo anchor measured in the same run.

Run: ``torchport bench ft`` (or ``--quick``). Real processes on loopback (forked from a preloaded
forkserver, see ``tests/ft_actors.py``). Times are medians; the machine is shared, expect noise.

Rows (anchor → ours):
* ``detect crash`` / ``detect hang``: kill (SIGKILL / SIGSTOP) a rank while its peers sit in an
  allreduce; ours = kill → typed PeerFailure on the survivors. Anchor: the op timeout gloo would
  otherwise wait for (2.14's gloo: 10 s; set as the anchor value, not measured).
* ``reconfigure shrink/grow N``: ours = ``_reconfigure`` on ``--backend`` (torchport: validation
  round trip + communicator formed in place on live connections; gloo: + new gloo group); anchor =
  building a plain gloo group over a store prefix (no validation), same ranks.
* ``heal W MB``: ours = state transfer from another process; anchor = gloo broadcast of the same bytes.
* ``step overhead``: anchor = plain gloo allreduce per step; ours = manager step (quorum +
  allreduce + commit vote) and allreduce with the Flight Recorder installed.
* ``DDP step``: the manager's overhead on a real training step (MLP and the demo GPT, 2 replicas):
  the same loop with plain allreduce on the same torchport communicator vs through the manager.
* ``training throughput``: fault-free vs one SIGKILL + restart + heal (demo model, 3 replicas).
  With ``--fault-period P``: one job alternates fault-free and faulty windows of P seconds (one
  SIGKILL each, ABBA order, ``--pairs`` pairs); a row per adjacent pair and the median ratio.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.ft_actors import Actors
from torchport.benchmarks import BenchTable, arg_parser, scratch_dir, stop_signals
from torchport.cli import int_at_least, positive_float
from torchport.demo.stage_ft import MIN_FT_STEPS
from torchport.distributed._control import default_secret
from torchport.distributed.flight_recorder import FlightRecorder
from torchport.distributed.ft import Lighthouse, fetch_state

GLOO_HANG_TIMEOUT_S = 10.0  # what 2.14's gloo leaves a peer waiting (issue text)
# the options' upper bounds: a run_scenario times out after 300 s (~4500 steps here), a timed
# job lasts 2 x --pairs x --fault-period seconds
MAX_TRAIN_STEPS = 100_000
MAX_RANKS = 64
MAX_WINDOW_S = 3600.0
MAX_PAIRS = 100


def seconds_between(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse ``type=``: a number of seconds in [lo, hi]."""

    def parse(text: str) -> float:
        v = positive_float(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g} s, got {v:g}")
        return v

    return parse


def _ok(res: list) -> list:
    bad = [v for s, v in res if s != "ok"]
    if bad:
        raise RuntimeError(f"actor failed: {bad[0][0]}: {bad[0][1]}")
    return [v for _, v in res]


def bench_detection_and_reconfigure(table: BenchTable, n: int, reps: int, backend: str) -> None:
    tag = f"{backend}, n={n}"
    with Actors(n) as A:
        ranks = list(range(n))
        hs = [A.call(i, "init_reconf", 0.1, backend, timeout=180) for i in ranks]
        res = _ok(A.call_all(ranks, "reconf", [(1, hs)] * n, timeout=60))
        uuid = 2
        for kind, sig in (("crash", signal.SIGKILL), ("hang", signal.SIGSTOP)):
            victim = n - 1
            survivors = ranks[:-1]
            for i in survivors:
                A.send(i, "allreduce", 1.0)
            time.sleep(0.2)  # survivors are inside the allreduce, waiting for the victim
            t_kill = time.time()
            A.kill(victim, sig)
            out = _ok([A.recv(i, 30) for i in survivors])
            assert all(o[0] == "error" for o in out), out
            detect = max(o[4] for o in out) - t_kill
            # negative: a heartbeat was missed under load before the real fault (a false alarm)
            table.add(
                f"detect {kind} ({tag})",
                "gloo timeout (2.14)",
                GLOO_HANG_TIMEOUT_S,
                detect,
                0,
                false_alarm=detect < 0,
            )
            if sig == signal.SIGSTOP:
                A.kill(victim, signal.SIGCONT)
            A.procs[victim].kill()
            A.procs[victim].join(timeout=5)
            # shrink to the survivors
            hs_s = [A.call(i, "handle") for i in survivors]
            res = _ok(A.call_all(survivors, "reconf", [(uuid, hs_s)] * len(survivors)))
            shrink = max(r[3] for r in res)
            print(f"# shrink phases (ms) of the slowest rank: {_phases(res)}")
            if shrink > 1.0:
                print(f"# slow shrink, phases per rank: {[r[4] for r in res]}")
            uuid += 1
            anchor = _gloo_rebuild(A, survivors, f"anchor-shrink-{uuid}")
            table.add(
                f"reconfigure shrink {n}->{n - 1} ({backend})", "new gloo group", anchor, shrink, 0
            )
            # grow back with a fresh process
            A.add(victim)
            A.call(victim, "init_reconf", 0.1, backend, timeout=60)
            hs_g = [A.call(i, "handle") for i in ranks]
            res = _ok(A.call_all(ranks, "reconf", [(uuid, hs_g)] * n))
            grow = max(r[3] for r in res)
            print(f"# grow phases (ms) of the slowest rank: {_phases(res)}")
            uuid += 1
            anchor = _gloo_rebuild(A, ranks, f"anchor-grow-{uuid}")
            table.add(
                f"reconfigure grow {n - 1}->{n} ({backend})", "new gloo group", anchor, grow, 0
            )
        # steady reconfigure timing (same members, fresh uuid), median of reps
        times = []
        for _ in range(reps):
            hs_g = [A.call(i, "handle") for i in ranks]
            res = _ok(A.call_all(ranks, "reconf", [(uuid, hs_g)] * n))
            uuid += 1
            times.append(max(r[3] for r in res))
        times.sort()
        anchors = sorted(_gloo_rebuild(A, ranks, f"anchor-re-{uuid}-{k}") for k in range(reps))
        table.add(
            f"reconfigure same {n} ({backend}, median)",
            "new gloo group",
            anchors[reps // 2],
            times[reps // 2],
            0,
        )


def _phases(res: list) -> dict[str, float]:
    slow = max(res, key=lambda r: r[3])
    return {k: round(v * 1e3, 1) if k.endswith("_s") else v for k, v in slow[4].items()}


def _gloo_rebuild(A: Actors, ranks: list[int], tag: str) -> float:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    res = _ok(
        A.call_all(
            ranks, "gloo_rebuild", [(store.port, k, len(ranks), tag) for k in range(len(ranks))]
        )
    )
    return max(res)


def bench_heal_and_steps(table: BenchTable, mb: int, steps: int) -> None:
    with scratch_dir("tp-ft-") as d, Actors(2) as A:  # (mkdtemp: the store stayed in /tmp)
        _ok(A.call_all([0, 1], "init_dist", [(f"{d}/s", i, 2) for i in range(2)], timeout=180))
        nbytes = mb << 20
        addr = A.call(0, "serve_state", nbytes, 16)
        # the healing replica receives into its own (already touched) tensors, as Manager does
        per = nbytes // 16 // 4
        mine = {"user": {f"t{i}": torch.zeros(per) for i in range(16)}, "step": 0}
        best = fresh = float("inf")
        for _ in range(3):
            _, hdr, secs = fetch_state((addr[0], addr[1]), default_secret(), into=mine)
            best = min(best, secs)
            _, _, secs = fetch_state((addr[0], addr[1]), default_secret())
            fresh = min(fresh, secs)
        bcast = min(_ok(A.call_all([0, 1], "bcast_bench", [(nbytes, 3)] * 2)))
        table.add(f"heal {mb} MB (16 tensors)", "gloo broadcast", bcast, best, hdr["total"])
        table.add(f"heal {mb} MB into fresh memory", "gloo broadcast", bcast, fresh, hdr["total"])
        src = torch.randn(nbytes // 4)
        dst = torch.zeros(nbytes // 4)
        t0 = time.perf_counter()
        dst.copy_(src)
        warm = time.perf_counter() - t0
        table.add(f"heal {mb} MB vs in-process memcpy", "memcpy (warm)", warm, best, hdr["total"])
        lh = Lighthouse(min_replicas=2, join_timeout=5.0)
        for nb in (4096, 1 << 20):
            plain = max(_ok(A.call_all([0, 1], "step_bench", [("plain", None, nb, steps)] * 2)))
            frd = max(_ok(A.call_all([0, 1], "step_bench", [("fr", None, nb, steps)] * 2)))
            mgr = max(
                _ok(
                    A.call_all(
                        [0, 1],
                        "step_bench",
                        [("manager", list(lh.address), nb, steps)] * 2,
                        timeout=120,
                    )
                )
            )
            table.add(f"allreduce {nb} B + Flight Recorder", "gloo allreduce", plain, frd, nb)
            table.add(f"allreduce {nb} B + FT manager step", "gloo allreduce", plain, mgr, nb)
        lh.close()


def bench_manager_overhead(table: BenchTable, model: str, replicas: int, steps: int) -> None:
    """The FT manager's cost on a real DDP training step: the same loop (zero_grad, forward,
    backward with bucketed allreduce overlapped, optimizer step) on the same torchport
    communicator, with plain allreduce (anchor) and through the manager (ours: quorum + commit
    vote, one lighthouse round trip per step in steady state), in alternating blocks."""
    lh = Lighthouse(min_replicas=replicas, join_timeout=5.0)
    blocks = 4
    try:
        with Actors(replicas) as A:
            res = _ok(
                A.call_all(
                    list(range(replicas)),
                    "step_overhead",
                    [(list(lh.address), f"r{i}", model, blocks, steps) for i in range(replicas)],
                    timeout=600,
                )
            )
    finally:
        lh.close()

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    # a step ends when the slowest replica's does: per step, the max over replicas
    per = {m: [max(r[0][m][k] for r in res) for k in range(blocks * steps)] for m in res[0][0]}
    plain, mgr = med(per["plain"]), med(per["manager"])
    table.add(
        f"DDP {model} step, {replicas} replicas: FT manager vs plain allreduce",
        "plain allreduce",
        plain,
        mgr,
        0,
        overhead_pct=round(100 * (mgr / plain - 1), 1),
        group_builds=res[0][2],
        quorums_with_commit=f"{res[0][3]}/{res[0][1]}",
        vote_ms=round(1e3 * max(r[4] for r in res), 2),
    )


def bench_fr(table: BenchTable) -> None:
    """Recording cost per op: the public record/started/completed API and the install() wrapper."""
    from torchport.distributed import flight_recorder as fr

    rec = FlightRecorder(buffer_size=2000, rank=0, world_size=1)
    t = [torch.zeros(16)]
    x = torch.zeros(16)
    n = 20000

    def noop(tensor: torch.Tensor, op: object = None, group: object = None) -> None:
        return None

    # the default group's cache entry: name, ranks, and what the group's weak reference returns
    fr._group_names.setdefault(id(None), ("default", [0], lambda: None))
    wrapped = fr._wrap("all_reduce", noop, rec)

    def api(_x: torch.Tensor) -> None:
        e = rec.record("all_reduce", "default", t)
        rec.started(e)
        rec.completed(e)

    for name, fn, base in (("record API", api, None), ("install() wrapper", wrapped, noop)):
        per, bare = [], []
        for _ in range(5):  # interleaved repeats, best of each (the machine is shared)
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            per.append((time.perf_counter() - t0) / n)
            if base is not None:
                t0 = time.perf_counter()
                for _ in range(n):
                    base(x)
                bare.append((time.perf_counter() - t0) / n)
        cost = min(per) - (min(bare) if bare else 0.0)
        table.add(
            f"Flight Recorder cost per op ({name})",
            "(none)",
            cost,
            cost,
            0,
            us_per_op=round(cost * 1e6, 2),
        )


def bench_training_timed(table: BenchTable, segment: float, pairs: int) -> None:
    """Throughput with one SIGKILL (+ immediate restart, heal, rejoin) every ``segment`` seconds
    against fault-free throughput, in one job of alternating windows (demo GPT, 3 replicas on
    2 cores): one row per (fault-free, faulty) pair of adjacent windows, then the median."""
    from torchport.demo.stage_ft import run_alternating

    with scratch_dir("tp-ft-") as d:
        r = run_alternating(Path(d) / "alt", segment=segment, pairs=pairs)
    windows = r["windows"]
    for i, ratio in enumerate(r["ratios"]):
        a, b = windows[2 * i], windows[2 * i + 1]
        clean, fault = (a, b) if a["kind"] == "clean" else (b, a)
        table.add(
            f"training, pair {i} ({a['kind']} then {b['kind']}), {segment:.0f} s windows, "
            f"1 SIGKILL per faulty window (s/step)",
            "fault-free window",
            1 / clean["steps_per_s"],
            1 / fault["steps_per_s"],
            0,
            throughput_pct=round(100 * ratio, 1),
            steps=f"{fault['steps']}/{clean['steps']}",
            fault_contained=fault["started_steady"]
            and clean["started_steady"]
            and fault.get("recovered", False),
            restart_to_commit_s=fault.get("stand_in_s"),
        )
    table.add(
        f"training, median of {pairs} pairs: 1 SIGKILL every {segment:.0f} s (s/step)",
        "fault-free windows",
        1 / r["clean_steps_per_s"],
        1 / r["fault_steps_per_s"],
        0,
        throughput_pct=round(100 * r["median_ratio"], 1),
        pooled_pct=round(100 * r["fault_steps_per_s"] / r["clean_steps_per_s"], 1),
        identical=r["identical"],
        aborted=r["summaries"][0]["aborted_steps"],
        heals=sum(s["heals"] for s in r["summaries"]),
    )


def bench_training(table: BenchTable, steps: int) -> None:
    from torchport.demo.stage_ft import run_scenario

    with scratch_dir("tp-ft-") as d:
        clean = run_scenario(Path(d) / "clean", steps=steps, kill_at=None)
        faulty = run_scenario(Path(d) / "kill", steps=steps, kill_at=steps // 4)

    def secs_per_step(f: dict) -> float:
        s = f["summaries"][0]
        return s["seconds"] / s["steps"]

    table.add(
        f"training, 1 SIGKILL in {steps} steps",
        "fault-free run",
        secs_per_step(clean),
        secs_per_step(faulty),
        0,
        identical=faulty["identical"],
        run_s=round(faulty["summaries"][0]["seconds"], 1),
    )


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--backend", choices=("torchport", "gloo"), default="torchport")
    p.add_argument(
        "--ranks",
        # (0 or 1 ended in an IndexError: a reconfigure needs a peer; each rank is a process)
        type=int_at_least(2, at_most=MAX_RANKS),
        nargs="*",
        help=f"reconfigure sizes, each 2 to {MAX_RANKS} (default 4, or 4 8)",
    )
    # (unchecked, a negative --train-steps, or one below MIN_FT_STEPS, waited out the run's 300 s
    # timeout; --fault-period NaN or inf never ended; 0 stood for the default)
    p.add_argument(
        "--train-steps",
        type=int_at_least(MIN_FT_STEPS, at_most=MAX_TRAIN_STEPS),
        default=None,
        help=f"training steps per run, {MIN_FT_STEPS} to {MAX_TRAIN_STEPS} (default 30, or 120); "
        "~450 makes a ~30 s run with one fault",
    )
    p.add_argument(
        "--fault-period",
        type=seconds_between(1.0, MAX_WINDOW_S),
        default=None,
        help="timed training: window length = seconds between faults (e.g. 30; 1 to "
        f"{MAX_WINDOW_S:.0f}); one job alternates fault-free and faulty windows (ABBA), --pairs pairs",
    )
    p.add_argument(
        "--pairs",
        type=int_at_least(1, at_most=MAX_PAIRS),
        default=None,
        help=f"timed training: window pairs, at most {MAX_PAIRS} (default 3, or 5)",
    )
    p.add_argument(
        "--only",
        nargs="*",
        choices=("reconf", "heal", "fr", "step", "train"),
        help="run only these parts",
    )
    args = p.parse_args()
    parts = set(args.only or ("reconf", "heal", "fr", "step", "train"))
    table = BenchTable("ft", unit="GB/s")
    table.start()
    if "reconf" in parts:
        for n in args.ranks or ([4] if args.quick else [4, 8]):
            bench_detection_and_reconfigure(table, n, 3 if args.quick else 7, args.backend)
    if "heal" in parts:
        bench_heal_and_steps(table, 64 if args.quick else 256, 20 if args.quick else 100)
    if "fr" in parts:
        bench_fr(table)
    if "step" in parts:
        bench_manager_overhead(table, "mlp", 2, 50 if args.quick else 200)
        bench_manager_overhead(table, "gpt", 2, 8 if args.quick else 30)
    if "train" in parts:
        if args.fault_period:
            pairs = args.pairs or (3 if args.quick else 5)
            bench_training_timed(table, args.fault_period, pairs)
        else:
            bench_training(table, args.train_steps or (30 if args.quick else 120))
    table.save(args.json)


if __name__ == "__main__":
    # SIGTERM / SIGHUP unwind the run: its actors are killed and multiprocessing's pymp-* folder
    # (the forkserver's socket) removed, which their default action left in $TMPDIR
    with stop_signals():
        main()
