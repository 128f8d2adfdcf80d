"""The ``torchport`` command after review 50: a run stopped by SIGTERM or SIGHUP leaves no
``pymp-*`` folder of multiprocessing's behind, and the single-cell tools' and A/B tools' numeric
options are usage errors (exit 2, naming the option and the value) when out of range. Nothing
here is timed: the benchmarks' parsers run, their benchmarks do not."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from torchport import benchmarks

ROOT = Path(__file__).resolve().parent.parent


# --- a stopped run removes multiprocessing's temporary folder ---------------------------------

# starts a forkserver child, which makes multiprocessing's pymp-* folder (the server's socket)
# in $TMPDIR, then waits to be stopped: inside stop_signals, or in a `torchport demo` stage
_STOPPED = r"""
import multiprocessing as mp, signal, sys, time
from torchport import benchmarks
mode = sys.argv[1]
for s in benchmarks.STOP_SIGNALS:
    signal.signal(s, signal.SIG_DFL)  # (as a shell starts it)

def run():
    child = mp.get_context("forkserver").Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    print(child.pid, flush=True)
    if mode != "normal":
        time.sleep(60)

if mode == "demo":
    from torchport import cli, demo
    from torchport.demo.report import Section

    def stage(ctx):
        run()
        return Section("done")

    demo.STAGES[:] = [("data", stage)]
    cli.main(["demo", "--stages", "data", "--out", sys.argv[2]])
else:
    with benchmarks.stop_signals():
        run()
print("ended", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_stopped(tmp_path: Path, mode: str, sig: signal.Signals | None) -> tuple[int, str, bool]:
    """(exit status, the pymp-* folders left in its $TMPDIR, whether its forkserver child was
    still running after it ended)."""
    # private (other processes' pymp-* folders are not ours) and short: the forkserver's
    # socket path in it must fit AF_UNIX's 108 bytes, which a pytest-xdist tmp_path
    # (/tmp/pytest-of-…/popen-gw1/test_…/) with pymp-…/listener-… did not
    tmpdir = Path(tempfile.mkdtemp(prefix="tpmp-", dir="/tmp"))
    try:
        return _run_stopped_in(tmp_path, tmpdir, mode, sig)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _run_stopped_in(
    tmp_path: Path, tmpdir: Path, mode: str, sig: signal.Signals | None
) -> tuple[int, str, bool]:
    p = subprocess.Popen(
        [sys.executable, "-c", _STOPPED, mode, str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir)},
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert p.stdout is not None
        first = p.stdout.readline()  # (bounded: the child sleeps 60 s at most, then ends)
        child = int(first)
        assert [d.name for d in tmpdir.glob("pymp-*")], "the forkserver made no pymp-* folder"
        if sig is not None:
            p.send_signal(sig)
        p.wait(timeout=60)  # (not communicate: a child left running holds the pipe)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        left_running = _alive(child)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
        if p.stdout is not None:
            p.stdout.close()
    return p.returncode, "\n".join(sorted(d.name for d in tmpdir.glob("pymp-*"))), left_running


@pytest.mark.parametrize(
    "mode, sig",
    [
        ("stopped", signal.SIGTERM),  # (SIGHUP takes the same path: STOP_SIGNALS)
        ("demo", signal.SIGTERM),
        ("normal", None),  # (a normal end: multiprocessing's exit handler removes it)
    ],
    ids=["SIGTERM", "demo-SIGTERM", "normal-end"],
)
def test_a_stopped_run_leaves_no_multiprocessing_folder(tmp_path, mode, sig):
    """stop_signals re-raised SIGTERM / SIGHUP with their default action once the block had
    unwound, which ends the process without its exit handlers: multiprocessing's pymp-* folder
    (with the forkserver's socket; `torchport demo`'s ft stage, `bench ft`) stayed in $TMPDIR.
    Its daemonic children (terminated by the same handler) ran on. The exit handlers run first
    now; the process still ends by the signal."""
    rc, left, child_running = _run_stopped(tmp_path, mode, sig)
    assert rc == (-sig if sig is not None else 0)
    assert left == ""
    assert not child_running  # (its daemonic children are terminated, as at a normal end)


def test_bench_ft_runs_inside_stop_signals(monkeypatch):
    """`python bench/bench_ft.py` had no stop_signals around its reconfigure cells (only the
    others' scratch folders had one): a SIGTERM there left the actors' pymp-* folder."""
    seen = {}

    class Parsed(Exception):
        pass

    def parse(self, args=None, namespace=None):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        raise Parsed

    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
        with pytest.raises(Parsed):
            benchmarks.run_benchmark("ft", ["--quick"])
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (restored)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen["handler"] is not signal.SIG_DFL


# --- the tools' numeric options: usage errors before anything runs ----------------------------


BAD_OPTIONS = [
    # the single-cell tools (review 50's item)
    ("gemm_cold", ["--cells", "f32:x"], "--cells: expected an integer, got 'x' in 'f32:x'"),
    ("gemm_cold", ["--cells", "bf16:0"], "--cells: must be >= 1, got 0 in 'bf16:0'"),
    ("gemm_cold", ["--cells", "f32:-8"], "--cells: must be >= 1, got -8 in 'f32:-8'"),
    ("gemm_cold", ["--cells", "bf16:8,f32:99999999999"], "--cells: must be <= 65536, got 9999"),
    ("gemm_cold", ["--cells", "f64:8"], "--cells: must be one of f32, bf16, got 'f64' in 'f64:8'"),
    ("gemm_cold", ["--cells", "bf16"], "--cells: expected DTYPE:M (e.g. bf16:8), got 'bf16'"),
    ("gemm_cold", ["--cells", "bf16:nan"], "--cells: expected an integer, got 'nan'"),
    ("collectives_cell", ["--size", "0"], "--size: must be >= 4, got 0"),
    ("collectives_cell", ["--size", "-7"], "--size: must be >= 4, got -7"),
    ("collectives_cell", ["--size", "1e6"], "--size: expected an integer, got '1e6'"),
    ("collectives_cell", ["--world", "0"], "--world: must be >= 1, got 0"),
    ("collectives_cell", ["--world", "nan"], "--world: expected an integer, got 'nan'"),
    ("collectives_cell", ["--timeout", "nan"], "--timeout: must be a positive finite number"),
    ("collectives_cell", ["--timeout", "-1"], "--timeout: must be a positive finite number"),
    ("ft", ["--train-steps", "0"], "--train-steps: must be >= 8, got 0"),
    ("ft", ["--train-steps", "-30"], "--train-steps: must be >= 8, got -30"),
    ("ft", ["--train-steps", "abc"], "--train-steps: expected an integer, got 'abc'"),
    ("ft", ["--train-steps", "10000000"], "--train-steps: must be <= 100000, got 10000000"),
    ("ft", ["--pairs", "0"], "--pairs: must be >= 1, got 0"),
    ("ft", ["--pairs", "-2"], "--pairs: must be >= 1, got -2"),
    ("ft", ["--pairs", "1000"], "--pairs: must be <= 100, got 1000"),
    ("ft", ["--fault-period", "nan"], "--fault-period: must be a positive finite number, got nan"),
    ("ft", ["--fault-period", "inf"], "--fault-period: must be a positive finite number, got inf"),
    ("ft", ["--fault-period", "-30"], "--fault-period: must be a positive finite number"),
    ("ft", ["--fault-period", "1e9"], "--fault-period: must be between 1 and 3600 s, got 1e+09"),
    ("ft", ["--fault-period", "x"], "--fault-period: expected a number, got 'x'"),
    ("ft", ["--ranks", "1000"], "--ranks: must be <= 64, got 1000"),
    # the others (checked alike while there)
    ("collectives", ["--sizes", "4096,-1"], "--sizes: must be >= 4, got -1 (in '4096,-1')"),
    ("collectives", ["--worlds", "2,0"], "--worlds: must be >= 1, got 0 (in '2,0')"),
    ("collectives", ["--worlds", "two"], "--worlds: expected an integer, got 'two'"),
    ("gemm", ["--max-autotune-cells", "-1"], "--max-autotune-cells: must be >= 0, got -1"),
    ("gemm_activation", ["--n", "0"], "--n: must be >= 1, got 0"),
    ("gemm_activation", ["--n", "1e99"], "--n: expected an integer, got '1e99'"),
    ("gemm_amx_ab", ["--shape", "8x0x8"], "--shape: must be >= 1, got 0 in '8x0x8'"),
    ("gemm_amx_ab", ["--shape", "8x8"], "--shape: expected MxNxK (e.g. 2048x3072x768), got '8x8'"),
    ("gemm_amx_ab", ["--mc", "0"], "--mc: must be >= 1, got 0"),
    ("gemm_amx_ab", ["--cold", "-1"], "--cold: must be >= 0, got -1"),
    ("gemm_eo_ab", ["--m", "0"], "--m: must be >= 1, got 0"),
    ("gemm_eo_ab", ["--copies", "-1"], "--copies: must be >= 0, got -1"),
    ("gemm_epilogue_ab", ["--h", "-4"], "--h: must be >= 1, got -4"),
    ("gemv_bound", ["--reps", "0"], "--reps: must be >= 1, got 0"),
    ("gemv_bound", ["--l2-rows", "8"], "--l2-rows: must be >= 9, got 8"),
    ("gemv_bound", ["--prefetch", "-1"], "--prefetch: must be >= 0, got -1"),
    ("gemv_bound", ["--formats", "fp9"], "--formats: invalid choice: 'fp9'"),
    ("gemv_kern", ["--variants", "fp8:shift:NTA:2048", "--reps", "0"], "--reps: must be >= 1"),
    ("gemv_kern", ["--variants", "fp8:shift:NTA:2048", "--threads", "0"], "--threads: must be"),
    ("gemv_kern", ["--variants", "fp8:shift:NTA:2048", "--copies", "0"], "--copies: must be"),
    ("gemv_kern", ["--variants", "fp8:shift:NTA:2048", "--rows", "-1"], "--rows: must be >= 1"),
]


@pytest.mark.parametrize(
    "name, argv, message", BAD_OPTIONS, ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD_OPTIONS]
)
def test_bad_tool_options_are_usage_errors(capsys, parse_only, name, argv, message):
    """Each was accepted as parsed (type=int or float, or a string split later): a ValueError
    traceback, every worker's failure, a run that waited out a timeout or never ended (a NaN
    or infinite --fault-period), or a bogus row (--size -7). Now: exit 2 naming the option and
    the value, before anything runs."""
    assert benchmarks.run_benchmark(name, argv) == 2
    assert f"error: argument {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("collectives_cell", ["--size", "99999999999999"], "--size 99999999999999 at --world 2"),
        ("collectives_cell", ["--world", "100000"], "--size 1048576 at --world 100000"),
        ("collectives", ["--sizes", "4096,99999999999999"], "--sizes 99999999999999 at --worlds"),
        ("collectives", ["--worlds", "2,100000"], "--sizes 67108864 at --worlds 100000"),
    ],
)
def test_collectives_sizes_beyond_the_memory_are_usage_errors(
    tmp_path, capsys, monkeypatch, name, argv, message
):
    """A huge --size or --world(s) spawned the workers, each failing on its allocation with a
    traceback (or spawning ranks until the memory ran out). Checked against the machine's
    memory before any worker starts."""

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(subprocess, "Popen", no_workers)
    json = ["--json", str(tmp_path / "r.json")] if name == "collectives" else []
    assert benchmarks.run_benchmark(name, [*argv, *json]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "more than this machine's" in err


@pytest.mark.parametrize(
    "name, argv, check",
    [
        ("gemm_cold", [], lambda a: a.cells[0] == ("f32", 1) and len(a.cells) == 5),
        ("gemm_cold", ["--cells", "bf16:8, f32:1"], lambda a: a.cells == [("bf16", 8), ("f32", 1)]),
        ("collectives_cell", [], lambda a: (a.size, a.world, a.timeout) == (1 << 20, 2, 170.0)),
        ("ft", [], lambda a: (a.train_steps, a.pairs, a.fault_period) == (None, None, None)),
        (
            "ft",
            ["--fault-period", "30", "--pairs", "3"],
            lambda a: (a.fault_period, a.pairs) == (30, 3),
        ),
        ("ft", ["--train-steps", "8"], lambda a: a.train_steps == 8),
        ("collectives", ["--sizes", "4096"], lambda a: (a.sizes, a.worlds) == ([4096], [2, 4])),
        ("gemm_amx_ab", [], lambda a: a.shape == (2048, 3072, 768)),
        ("gemv_bound", [], lambda a: (a.reps, a.l2_rows, a.prefetch) == (15, 96, [])),
        ("gemv_kern", ["--variants", "fp8:shift:NTA:2048"], lambda a: a.copies is None),
    ],
)
def test_defaults_and_good_values_parse(parse_only, name, argv, check):
    with pytest.raises(parse_only) as e:
        benchmarks.run_benchmark(name, argv)
    assert check(e.value.args[0])


def test_run_alternating_refuses_a_nan_or_infinite_window(tmp_path, monkeypatch):
    """``segment <= 0`` let NaN through (and inf): the job's windows never ended."""
    from torchport.demo import stage_ft
    from torchport.distributed import ft

    def no_lighthouse(*a, **k):
        raise AssertionError("the job started")

    monkeypatch.setattr(ft, "Lighthouse", no_lighthouse)
    for segment in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite segment > 0"):
            stage_ft.run_alternating(tmp_path / "alt", segment=segment, pairs=1)


_FORKED = """
import multiprocessing as mp, os, signal, sys, time
from torchport.benchmarks import stop_signals

def child():
    for _ in range(600):
        time.sleep(0.05)

with stop_signals():
    p = mp.get_context("fork").Process(target=child, daemon=True)
    p.start()
    time.sleep(0.3)
    p.terminate()
    p.join(20)
    print("child", p.exitcode, flush=True)
"""


def test_a_forked_child_ends_by_the_signal_not_by_the_parents_handler():
    """A fork-context child inherits ``stop_signals``' handler: it raised the parent's
    ``_Stopped`` out of the child's code (a traceback, exit code 1); it ends by the signal."""
    out = subprocess.run(
        [sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"child {-signal.SIGTERM}", (out.stdout, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
