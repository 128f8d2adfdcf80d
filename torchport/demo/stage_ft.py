"""Demo stage ``ft``: fault-tolerant data-parallel training survives a SIGKILL and heals a rejoiner.

Three replicas (separate processes forked from a preloaded forkserver) train the byte-level GPT
(small config) through :mod:`torchport.distributed.ft`. A fault-free run gives the baseline
throughput; in the second run the stage SIGKILLs replica 1 mid-run, the survivors keep training,
replica 1 is restarted, heals from a healthy replica and rejoins. The stage reports detection,
reconfiguration and healing times, throughput against the fault-free run, bit-identical final
parameters, and the Flight Recorder's account of the failure (``torchport fr analyze``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from torchport.demo.report import Section


def _fresh(out: Path) -> None:
    """``out`` made, without what an earlier run left there: the replicas' progress files were
    read as this run's (a second run killed replica 1 before it joined and reported another
    run's steps), their summaries and parameters compared, old Flight Recorder dumps analysed."""
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("r*.bin", "r*.bin.progress", "r*.bin.json"):
        for f in out.glob(pattern):
            f.unlink(missing_ok=True)
    shutil.rmtree(out / "fr", ignore_errors=True)


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return -1


def run_scenario(
    out: Path,
    *,
    steps: int,
    kill_at: int | None,
    world: int = 3,
    model: str = "gpt",
    heartbeat: float = 0.1,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Train ``world`` replicas for ``steps``; SIGKILL replica 1 at step ``kill_at`` and restart it.

    Returns measured facts: wall time, per-replica summaries, kill and detection times, lighthouse
    events and whether the final parameters are bit-identical.
    """
    from torchport.demo.ft_worker import spawn, stage_corpus
    from torchport.distributed.ft import Lighthouse

    _fresh(out)
    corpus = out / "corpus.bin"
    if model == "gpt":
        stage_corpus(corpus)  # a restarted replica reads it instead of scanning sources
    fr_dir = out / "fr"
    lh = Lighthouse(min_replicas=1, join_timeout=1.0, heartbeat=heartbeat)
    addr = f"{lh.address[0]}:{lh.address[1]}"
    procs: dict[int, Any] = {}
    facts: dict[str, Any] = {}

    def start(i: int) -> None:
        procs[i] = spawn(
            [
                "--lighthouse",
                addr,
                "--rid",
                f"r{i}",
                "--steps",
                str(steps),
                "--world",
                str(world),
                "--model",
                model,
                "--out",
                str(out / f"r{i}.bin"),
                "--fr-dir",
                str(fr_dir),
                "--timeout",
                "20",
                *(("--corpus", str(corpus)) if model == "gpt" else ()),
            ]
        )

    deadline = time.monotonic() + timeout
    try:
        for i in range(world):
            start(i)
        if kill_at is not None:
            p1 = out / "r1.bin.progress"
            while _progress(p1) < kill_at:
                if time.monotonic() > deadline:
                    raise TimeoutError("replica 1 did not reach the kill step")
                time.sleep(0.005)
            facts["kill_time"] = time.time()
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].join(timeout=10)
            p0 = out / "r0.bin.progress"
            at = _progress(p0)
            while _progress(p0) < at + 3:  # survivors keep training without replica 1
                if time.monotonic() > deadline:
                    raise TimeoutError("survivors did not progress after the kill")
                time.sleep(0.01)
            facts["survivor_steps_while_down"] = _progress(p0) - at
            facts["restart_time"] = time.time()
            start(1)
        for i in range(world):
            procs[i].join(timeout=max(1.0, deadline - time.monotonic()))
            if procs[i].exitcode != 0:
                raise RuntimeError(f"replica {i} ended with exit code {procs[i].exitcode}")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        lh.close()
    facts["summaries"] = [json.loads((out / f"r{i}.bin.json").read_text()) for i in range(world)]
    blobs = [(out / f"r{i}.bin").read_bytes() for i in range(world)]
    facts["identical"] = all(b == blobs[0] for b in blobs)
    facts["events"] = list(lh.events)
    facts["fr_dir"] = str(fr_dir)
    return facts


def run_alternating(
    out: Path,
    *,
    segment: float,
    pairs: int,
    world: int = 3,
    model: str = "gpt",
    heartbeat: float = 0.1,
    kill_at: float = 0.25,
    warmup: float = 3.0,
) -> dict[str, Any]:
    """Throughput with one fault per ``segment`` seconds against fault-free throughput, measured
    inside ONE training job so that both arms see the same machine: ``world`` replicas train
    through ``2 * pairs`` back-to-back windows of ``segment`` seconds, half of them fault-free and
    half with one SIGKILL of replica 1 at ``kill_at * segment`` (restarted at once; it heals and
    rejoins). Pair ``i`` is (clean, faulty) for even ``i`` and (faulty, clean) for odd ``i``
    (ABBA order: a linear drift of the machine's speed cancels over two pairs).

    Throughput of a window is the number of steps the job committed in it (replica 0's counter,
    never killed) per second. A faulty window has the fault's whole cost inside it only if the
    restarted replica committed again before the window ended: ``recovered`` says so per window.
    ``started_steady`` is False for a window that began before an earlier fault had recovered.
    The same number of processes stays busy: from a kill until the restarted replica has
    committed, a busy-loop process stands in for it (3 replicas share 2 cores here, and the
    survivors would otherwise train faster while one is down). At the end every replica stops at
    one common step and the final parameters are compared (``identical``).
    """
    from torchport.demo.ft_worker import spawn, stage_corpus
    from torchport.distributed.ft import Lighthouse

    if not 0 < segment < float("inf") or pairs < 1 or not 0.0 < kill_at < 1.0:  # (NaN too)
        raise ValueError(
            f"run_alternating needs a finite segment > 0, pairs >= 1 and 0 < kill_at < 1, "
            f"got segment={segment}, pairs={pairs}, kill_at={kill_at}"
        )
    _fresh(out)
    lh = Lighthouse(min_replicas=1, join_timeout=1.0, heartbeat=heartbeat)
    addr = f"{lh.address[0]}:{lh.address[1]}"
    procs: dict[int, Any] = {}
    stop = out / "steps"
    stop.unlink(missing_ok=True)
    corpus = out / "corpus.bin"
    if model == "gpt":
        stage_corpus(corpus)

    def start(i: int) -> None:
        procs[i] = spawn(
            [
                *("--lighthouse", addr, "--rid", f"r{i}", "--steps", str(10**9)),
                *("--world", str(world), "--model", model, "--out", str(out / f"r{i}.bin")),
                *("--timeout", "20", "--steps-file", str(stop), "--corpus", str(corpus)),
            ]
        )

    p0, p1 = out / "r0.bin.progress", out / "r1.bin.progress"
    kinds = [
        k for i in range(pairs) for k in (("clean", "fault") if i % 2 == 0 else ("fault", "clean"))
    ]
    windows: list[dict[str, Any]] = []
    burner: Any = None
    killed_at = 0.0
    limit = time.monotonic() + warmup + segment * len(kinds) + 300
    try:
        for i in range(world):
            start(i)
        while _progress(p0) < 2:  # everyone joined (a replica waits for the full world to end)
            if time.monotonic() > limit:
                raise TimeoutError("replicas did not start training")
            time.sleep(0.01)
        time.sleep(warmup)
        for kind in kinds:
            w0, s0 = time.monotonic(), _progress(p0)
            win: dict[str, Any] = {"kind": kind, "started_steady": burner is None}
            kill_time = w0 + kill_at * segment if kind == "fault" else float("inf")
            while time.monotonic() - w0 < segment:
                now = time.monotonic()
                if now >= kill_time:
                    kill_time = float("inf")
                    killed_at = now
                    os.kill(procs[1].pid, signal.SIGKILL)
                    burner = _burner() if burner is None else burner
                    procs[1].join(timeout=10)
                    p1.unlink(missing_ok=True)
                    start(1)
                    win["recovered"] = False
                    win["restart_s"] = round(time.monotonic() - killed_at, 3)
                if burner is not None and p1.exists():  # the restarted replica trains again
                    burner.kill()
                    burner.join(timeout=5)
                    burner = None
                    win["recovered"] = kind == "fault"
                    win["stand_in_s"] = round(time.monotonic() - killed_at, 3)
                time.sleep(0.005)
            w1, s1 = time.monotonic(), _progress(p0)
            if s0 < 0 or s1 < s0:
                raise RuntimeError(f"replica 0's step counter read {s0} then {s1}")
            win.update(steps=s1 - s0, seconds=w1 - w0, steps_per_s=(s1 - s0) / (w1 - w0))
            windows.append(win)
        final = _progress(p0)
        tmp = out / "steps.tmp"
        tmp.write_text(str(final + 5))
        os.replace(tmp, stop)  # every replica ends at this step
        for i in range(world):
            procs[i].join(timeout=max(1.0, limit - time.monotonic()))
            if procs[i].exitcode != 0:
                raise RuntimeError(f"replica {i} ended with exit code {procs[i].exitcode}")
    finally:
        for p in [*procs.values(), *([burner] if burner is not None else [])]:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        lh.close()
    ratios = []
    for i in range(pairs):
        a, b = windows[2 * i], windows[2 * i + 1]
        clean, fault = (a, b) if a["kind"] == "clean" else (b, a)
        ratios.append(fault["steps_per_s"] / clean["steps_per_s"])
    summaries = [json.loads((out / f"r{i}.bin.json").read_text()) for i in range(world)]
    blobs = [(out / f"r{i}.bin").read_bytes() for i in range(world)]
    return {
        "windows": windows,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "clean_steps_per_s": sum(w["steps"] for w in windows if w["kind"] == "clean")
        / sum(w["seconds"] for w in windows if w["kind"] == "clean"),
        "fault_steps_per_s": sum(w["steps"] for w in windows if w["kind"] == "fault")
        / sum(w["seconds"] for w in windows if w["kind"] == "fault"),
        "summaries": summaries,
        "identical": all(b == blobs[0] for b in blobs),
    }


def _spin() -> None:
    while True:
        pass


def _burner() -> Any:
    """A process that keeps one core busy (stands in for a replica that is down)."""
    import multiprocessing as mp

    proc = mp.get_context("fork").Process(target=_spin, daemon=True)
    proc.start()
    return proc


def _dead_event(events: list[tuple[float, str]], rid: str) -> float | None:
    for t, e in events:
        if e.startswith(f"replica {rid} dead"):
            return t
    return None


# the fewest training steps per run: replica 1 is killed at a quarter of them and the survivors
# must train 3 more without it
MIN_FT_STEPS = 8


def ft_steps(args: Any) -> int:
    """Training steps per run: ``TORCHPORT_DEMO_FT_STEPS``, else 40 with the default demo
    (``--steps 600``), fewer for short demo runs. A bad value is a ``ValueError`` naming the
    variable (it was a bare ``int()`` traceback after the other stages had run)."""
    default = min(40, max(MIN_FT_STEPS, int(getattr(args, "steps", 600)) // 15))
    text = os.environ.get("TORCHPORT_DEMO_FT_STEPS", "").strip()
    if not text:
        return default
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < MIN_FT_STEPS:
        raise ValueError(
            f"TORCHPORT_DEMO_FT_STEPS must be an integer >= {MIN_FT_STEPS} (training steps per "
            f"run of the ft stage), got {text!r}"
        )
    return steps


def stage_ft(ctx: Any) -> Section:
    """Fault-tolerant training: kill a replica, survivors continue, it heals and rejoins."""
    from torchport.distributed.fr_analyze import analyze, load_dumps

    steps = ft_steps(ctx.args)
    base = ctx.out_dir / "ft"
    clean = run_scenario(base / "fault-free", steps=steps, kill_at=None)
    faulty = run_scenario(base / "with-kill", steps=steps, kill_at=steps // 4)
    s = Section(
        "fault-tolerant data-parallel training (3 replicas, torchport backend, SIGKILL one mid-run)"
    )

    def rate(f: dict[str, Any]) -> float:
        return sum(x["steps"] / x["seconds"] for x in f["summaries"][::2]) / len(
            f["summaries"][::2]
        )

    s.add("committed steps per replica", faulty["summaries"][0]["steps"])
    s.add("survivor steps while replica 1 was down", faulty["survivor_steps_while_down"])
    dead = _dead_event(faulty["events"], "r1")
    if dead is not None:
        s.add("detection: kill -> lighthouse (ms)", 1e3 * (dead - faulty["kill_time"]))
    notices = [t for x in faulty["summaries"][::2] for t, what in x["failures"] if "'r1'" in what]
    if notices:
        s.add(
            "detection: kill -> survivors notified (ms)", 1e3 * (min(notices) - faulty["kill_time"])
        )
    rebuilds = [b for x in faulty["summaries"][::2] for b in x["group_build_s"][1:]]
    if rebuilds:
        s.add(
            "reconfiguration: new torchport group (ms, median)",
            1e3 * sorted(rebuilds)[len(rebuilds) // 2],
        )
    r1 = faulty["summaries"][1]
    if r1["heal_s"]:
        s.add("healing: state transfer (ms)", 1e3 * r1["heal_s"][-1])
        s.add("healing: bytes", r1["heal_bytes"] // max(1, len(r1["heal_s"])))
        s.add("healing: bandwidth (MB/s)", r1["heal_bytes"] / max(1e-9, sum(r1["heal_s"])) / 1e6)
    s.add("aborted (retried) steps on survivors", faulty["summaries"][0]["aborted_steps"])
    s.add("throughput fault-free (steps/s per replica)", rate(clean))
    s.add("throughput with the kill (steps/s per survivor)", rate(faulty))
    s.add("throughput ratio", rate(faulty) / rate(clean))
    s.add(
        "final parameters bit-identical across replicas", faulty["identical"] and clean["identical"]
    )
    try:
        verdict = analyze(load_dumps(faulty["fr_dir"]))
        s.text = "Flight Recorder's account of the failure:\n" + verdict.text()
    except ValueError as e:
        s.text = f"Flight Recorder: {e}"
    return s
