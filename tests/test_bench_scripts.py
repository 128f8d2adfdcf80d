"""The scripts in ``bench/``: their temp folders, their options, what ``bench all`` passes them,
and their tables' columns (no timing is checked: the machine is shared)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchport import benchmarks

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _procs_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:  # (gone meanwhile)
                pass
    return pids


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


_SCRATCH = r"""
import os, signal, sys, time
from torchport.benchmarks import scratch_dir
sig = getattr(signal, sys.argv[1])
signal.signal(sig, signal.SIG_DFL)  # (as in a shell; under nohup SIGHUP comes ignored)
with scratch_dir("tp-test-") as d:
    open(os.path.join(d, "f"), "w").close()
    print(d, flush=True)
    os.kill(os.getpid(), sig)
    time.sleep(60)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_scratch_dir_is_removed_when_the_process_is_signalled(tmp_path, sig):
    """SIGTERM's and SIGHUP's default action ended a benchmark without running its cleanup: the
    temp folder stayed. The folder goes, and the process still ends by the signal."""
    res = subprocess.run(
        [sys.executable, "-c", _SCRATCH, sig],
        env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -getattr(signal, sig), res.stderr
    made = Path(res.stdout.split()[0])
    assert made.parent == tmp_path and made.name.startswith("tp-test-")
    assert not made.exists() and "not reached" not in res.stdout
    assert list(tmp_path.iterdir()) == []


def test_scratch_dir_restores_the_handlers_and_passes_exceptions(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # (tempfile caches the folder it chose)
    before = {s: signal.getsignal(s) for s in benchmarks.STOP_SIGNALS}
    defaults = [s for s, h in before.items() if h is signal.SIG_DFL]
    with pytest.raises(RuntimeError, match="benchmark failed"), benchmarks.scratch_dir("tp-") as d:
        assert Path(d).parent == tmp_path
        assert all(signal.getsignal(s) is not signal.SIG_DFL for s in defaults)
        raise RuntimeError("benchmark failed")
    assert not Path(d).exists()
    assert {s: signal.getsignal(s) for s in before} == before


def test_bench_scripts_make_temp_folders_with_scratch_dir(bench=BENCH):
    """bench_ft's heal cell made its store folder with ``tempfile.mkdtemp`` and never removed it
    (a ``/tmp/tmpXXXXXXXX/s`` per run), and TemporaryDirectory stays on SIGTERM: every scratch
    folder of a benchmark comes from :func:`benchmarks.scratch_dir`."""
    direct = [p.name for p in sorted(bench.glob("bench_*.py")) if "tempfile." in p.read_text()]
    assert direct == []


@pytest.mark.parametrize(
    "script, argv, prefix",
    [
        (
            "bench_collectives_cell.py",
            ["--op", "broadcast", "--size", "4096", "--samples", "100000", "--calls", "1"],
            "tp-cell-",
        ),
        (
            "bench_collectives.py",
            ["--worlds", "2", "--sizes", "4096", "--ops", "allreduce", "--reps", "1"],
            "tp-bench-",
        ),
    ],
)
def test_a_stopped_collectives_benchmark_leaves_no_folder_and_no_workers(
    tmp_path, script, argv, prefix, bench=BENCH
):
    """``kill`` (SIGTERM) of a collectives benchmark left its ``tp-bench-*``/``tp-cell-*`` folder
    in /tmp and its workers running on (their parent gone). Now both go before it exits."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(bench.parent)}
    proc = subprocess.Popen(
        [sys.executable, str(bench / script), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        # the workers are started (they name the folder on their command lines)
        while len(_procs_naming(str(tmp_path))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        made = list(tmp_path.glob(prefix + "*"))
        assert len(made) == 1 and len(_procs_naming(str(tmp_path))) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert not made[0].exists()
        deadline = time.monotonic() + 10  # (wait_all killed and reaped them before the exit)
        while _procs_naming(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _procs_naming(str(tmp_path)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        _kill_all(_procs_naming(str(tmp_path)))
        if proc.stderr:
            proc.stderr.close()


A_B_TOOLS = ("gemm_activation", "gemm_amx_ab", "gemm_eo_ab", "gemm_epilogue_ab")


def test_every_script_that_takes_json_writes_it(bench=BENCH):
    """Four A/B tools took the harness's --json and wrote nothing. A script that takes it saves
    a table; the A/B tools, which print lines of their own, refuse it."""
    quiet = []
    for path in sorted(bench.glob("bench_*.py")):
        text = path.read_text()
        if "arg_parser(" in text and "writes_json=False" not in text and ".save(" not in text:
            quiet.append(path.stem)
    assert quiet == []


@pytest.mark.parametrize("name", A_B_TOOLS)
def test_a_b_tools_refuse_json_and_keep_quick_and_reps(name, capsys):
    assert name in benchmarks.TOOLS
    assert benchmarks.run_benchmark(name, ["--quick", "--reps", "2", "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --json x.json" in err


def _load(name: str, bench: Path = BENCH):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tp_test_{name}", bench / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_graphs_pool_ratios_are_notes_not_times(tmp_path, capsys, bench=BENCH):
    """bench_graphs put the pool's reserved/peak ratios in a row: the "anchor ms" and "ours ms"
    columns (and the JSON's anchor_s / ours_s) held ratios, the GFLOP/s columns 0.00. They are a
    note now, printed and saved under ``notes``; the table keeps times only."""
    graphs = _load("bench_graphs", bench)
    table = benchmarks.BenchTable("graphs-test", unit="GFLOP/s")
    graphs.bench_pool(table, 3)
    assert table.rows == []
    pool = table.notes["pool"]
    assert pool["re_captures"] == 3 and pool["anchor"] == "exact-size-cache"
    assert pool["ours_reserved_per_peak"] >= 1.0 and pool["anchor_reserved_per_peak"] >= 1.0
    assert pool["ours_reserved_mib"] >= pool["ours_peak_mib"] > 0
    assert "# pool: re_captures=3 ours_reserved_mib=" in capsys.readouterr().out
    saved = json.loads(table.save(tmp_path / "g.json").read_text())
    assert saved["rows"] == [] and saved["notes"] == {"pool": pool}


def test_a_row_without_work_prints_no_throughput():
    """Rows timed without a work count (work 0: a while_loop, a reconfigure) printed 0.00 in the
    GB/s or GFLOP/s columns, which read as a measured throughput."""
    table = benchmarks.BenchTable("t", unit="GFLOP/s")
    cells = table.format_row(benchmarks.Row("loop", "eager", 2e-3, 1e-3, 0.0)).split()
    assert cells[-2:] == ["-", "-"] and cells[-5:-3] == ["2.0000", "1.0000"]
    cells = table.format_row(benchmarks.Row("mm", "aten", 2e-3, 1e-3, 4e9)).split()
    assert cells[-2:] == ["2000.00", "4000.00"]


class _Parsed(Exception):
    """Raised in place of parsing: the script's parser was built, nothing ran."""


def test_every_script_of_bench_all_takes_quick(monkeypatch):
    """``torchport bench all --quick`` passes --quick to every script it runs (all but
    :data:`benchmarks.TOOLS`); one without it stopped with a usage error. Each one's parser,
    built by the script's own main and caught before it parses, has --quick (and --json)."""
    import argparse

    options: dict[str, set[str]] = {}
    current = [""]

    def capture(self, args=None, namespace=None):
        options[current[0]] = {o for a in self._actions for o in a.option_strings}
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    grids = [n for n in benchmarks.list_benchmarks() if n not in benchmarks.TOOLS]
    assert "graphs" in grids and "gemm" in grids
    for name in grids:
        current[0] = name
        with pytest.raises(_Parsed):
            benchmarks.run_benchmark(name, ["--quick"])
    missing = {n: sorted({"--quick", "--json"} - o) for n, o in options.items()}
    assert missing == {n: [] for n in grids}
