"""The ``torchport`` command after review 49: a stopped demo kills its workers, a failed stage
still reports, ``bench all --json`` keeps every benchmark's results, ``--json`` and the
benchmarks' options are checked before anything runs, and a run without a C compiler says so.
Nothing here is timed: the benchmarks' parsers run, their benchmarks do not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torchport import benchmarks, cli, demo
from torchport.demo.report import Section

ROOT = Path(__file__).resolve().parent.parent


# --- SIGTERM: a stopped demo runs its stages' cleanup (stop_signals) -------------------------

_DEMO_STOPPED = r"""
import os, signal, sys, time
from torchport import cli, demo
from torchport.demo.report import Section
out, marker = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (as a shell starts it)

def stage(ctx):
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # (as `kill PID` or `timeout` mid-stage)
        time.sleep(60)
    finally:  # (stage_ft kills its replicas and closes its lighthouse here)
        open(marker, "w").close()
    return Section("never")

demo.STAGES[:] = [("data", stage)]
cli.main(["demo", "--stages", "data", "--out", out])
print("not reached", flush=True)
"""


def test_a_sigterm_demo_runs_its_stages_cleanup_and_reports(tmp_path):
    """SIGTERM's default action ended ``torchport demo`` at once: the ft stage's ``finally``
    (which kills the replicas) never ran and they trained on ~80 s. It unwinds now, writes the
    report of what ran, and the process still ends by SIGTERM."""
    marker = tmp_path / "cleaned-up"
    res = subprocess.run(
        [sys.executable, "-c", _DEMO_STOPPED, str(tmp_path / "out"), str(marker)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -signal.SIGTERM, res.stderr
    assert marker.exists() and "not reached" not in res.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report[-1]["data"]["failed_stage"] == "data"
    assert "stopped by SIGTERM" in report[-1]["rows"]["error"]


def test_stop_signals_restores_the_handlers_and_passes_exceptions():
    before = {s: signal.getsignal(s) for s in benchmarks.STOP_SIGNALS}
    with pytest.raises(RuntimeError, match="stage failed"), benchmarks.stop_signals():
        assert all(
            signal.getsignal(s) is not signal.SIG_DFL
            for s, h in before.items()
            if h is signal.SIG_DFL
        )
        raise RuntimeError("stage failed")
    assert {s: signal.getsignal(s) for s in before} == before


# --- a failing stage still writes the report; an old report is gone ---------------------------


def _fake_stages(monkeypatch, seen: dict[str, bool]) -> None:
    def data(ctx):
        seen["old report during the run"] = (ctx.out_dir / "report.json").exists()
        s = Section("fake data")
        s.add("files", 3)
        return s

    def train(ctx):
        raise RuntimeError("train exploded")

    def sample(ctx):
        raise AssertionError("a stage after the failed one ran")

    monkeypatch.setattr(demo, "STAGES", [("data", data), ("train", train), ("sample", sample)])


def test_a_failing_stage_writes_the_report_of_the_stages_before_it(tmp_path, monkeypatch, capsys):
    """One failing stage ended the demo with no report.json for the stages that had completed,
    and an earlier run's report stayed in --out as if it were this run's."""
    (tmp_path / "report.json").write_text('[{"title": "an earlier run"}]')
    seen: dict[str, bool] = {}
    _fake_stages(monkeypatch, seen)
    with pytest.raises(RuntimeError, match="train exploded"):
        cli.main(["demo", "--stages", "data,train,sample", "--out", str(tmp_path)])
    assert seen == {"old report during the run": False}
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["title"] for s in report] == ["fake data", "stage 'train' failed"]
    assert report[0]["rows"] == {"files": "3"}
    assert report[1]["rows"] == {"error": "RuntimeError: train exploded", "not run": "sample"}
    assert report[1]["data"] == {"failed_stage": "train", "not_run": ["sample"]}
    assert "stage 'train' failed" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # (no temporary file left)


@pytest.mark.parametrize("value", ["abc", "4", "-1", "2.5"])
def test_a_bad_ft_steps_variable_is_an_error_naming_it(monkeypatch, value):
    """TORCHPORT_DEMO_FT_STEPS=abc was a bare ``int()`` traceback once the stages before ft had
    run; it is checked with the options now, before anything runs."""
    monkeypatch.setenv("TORCHPORT_DEMO_FT_STEPS", value)
    args = cli.build_parser().parse_args(["demo", "--stages", "data,ft"])
    with pytest.raises(
        ValueError,
        match=rf"TORCHPORT_DEMO_FT_STEPS must be an integer >= 8 \(training steps per run of the "
        rf"ft stage\), got '{value}'",
    ):
        demo.prepare(args)
    monkeypatch.setenv("TORCHPORT_DEMO_FT_STEPS", "8")
    demo.prepare(args)


def test_a_bad_ft_steps_variable_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHPORT_DEMO_FT_STEPS", "abc")
    out = tmp_path / "never"
    assert cli.main(["demo", "--stages", "ft", "--out", str(out)]) == 2
    assert "torchport demo: error: TORCHPORT_DEMO_FT_STEPS must be" in capsys.readouterr().err
    assert not out.exists()


def test_ft_steps_default_and_override(monkeypatch):
    from torchport.demo.stage_ft import ft_steps

    args = cli.build_parser().parse_args(["demo", "--steps", "12"])
    monkeypatch.delenv("TORCHPORT_DEMO_FT_STEPS", raising=False)
    assert ft_steps(args) == 8
    monkeypatch.setenv("TORCHPORT_DEMO_FT_STEPS", " 9 ")
    assert ft_steps(args) == 9


# --- demo --seed ---------------------------------------------------------------------------------


def test_demo_seed_is_checked_against_torchs_range(capsys):
    """``--seed 2**64`` was accepted and failed after the data stage (Overflow when unpacking long
    long, from torch.manual_seed)."""
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["demo", "--seed", str(1 << 64)])
    assert e.value.code == 2
    assert f"argument --seed: must be <= {(1 << 64) - 1}, got {1 << 64}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--seed", str(-(1 << 63) - 1)])
    for ok in ((1 << 64) - 1, -(1 << 63), 0):
        seed = parser.parse_args(["demo", "--seed", str(ok)]).seed
        torch.Generator().manual_seed(seed)  # (what the stages do with it)


# --- bench all --json DIR ------------------------------------------------------------------------


def test_bench_all_json_names_a_folder(tmp_path, monkeypatch, capsys):
    """``bench all --json FILE`` handed every benchmark the one file: each overwrote the last
    one's results. With ``all`` it names a folder, DIR/NAME.json per benchmark."""
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(
        benchmarks, "run_benchmark", lambda name, argv=(): seen.append((name, list(argv))) or 0
    )
    out = tmp_path / "results"
    assert cli.main(["bench", "all", "--quick", "--json", str(out), "--reps", "3"]) == 0
    names = [n for n in benchmarks.list_benchmarks() if n not in benchmarks.TOOLS]
    assert [n for n, _ in seen] == names
    for name, argv in seen:
        assert argv == ["--quick", "--reps", "3", "--json", str(out / f"{name}.json")]
    seen.clear()
    assert cli.main(["bench", "all", f"--json={out}"]) == 0  # (and argparse's other spellings)
    assert {a[-1] for _, a in seen} == {str(out / f"{n}.json") for n in names}
    seen.clear()
    assert cli.main(["bench", "gemm", "--json", str(tmp_path / "g.json")]) == 0  # (one: a file)
    assert seen == [("gemm", ["--json", str(tmp_path / "g.json")])]
    seen.clear()
    (tmp_path / "file.json").write_text("{}")
    assert cli.main(["bench", "all", "--json", str(tmp_path / "file.json")]) == 2
    assert "with 'all', --json names a folder" in capsys.readouterr().err and seen == []


def test_bench_help_says_what_json_means_with_all(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "with 'all', --json DIR names a folder, each benchmark writing DIR/NAME.json" in text


# --- --json: checked before the run, written whole -----------------------------------------------


@pytest.mark.parametrize("case", ["a folder", "under a file", "empty"])
def test_json_that_cannot_be_written_is_a_usage_error(tmp_path, capsys, case):
    """``--json`` naming a folder (or a path under a file) failed with IsADirectoryError /
    NotADirectoryError when the results were saved, after the whole run: they were lost."""
    (tmp_path / "f").write_text("")
    target = {
        "a folder": str(tmp_path),
        "under a file": str(tmp_path / "f" / "x.json"),
        "empty": "",
    }
    with pytest.raises(SystemExit) as e:
        benchmarks.arg_parser("t").parse_args(["--json", target[case]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --json: " in err
    assert (
        "must name a file, not a folder" if case != "under a file" else "cannot write into"
    ) in err


def test_json_in_a_new_folder_is_accepted(tmp_path):
    path = tmp_path / "new" / "deeper" / "r.json"
    assert benchmarks.arg_parser("t").parse_args(["--json", str(path)]).json == path
    assert not (tmp_path / "new").exists()  # (save() makes it)


def test_save_replaces_the_file_whole(tmp_path, monkeypatch):
    """save() wrote the JSON in place: a write that failed half-way (disk full) left a truncated
    file where the previous results were."""
    target = tmp_path / "r.json"
    target.write_text('{"previous": true}')
    table = benchmarks.BenchTable("t")
    real = os.fdopen

    class HalfThenFull:  # the file the JSON is written to: half of it, then a full disk
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> HalfThenFull:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    def fdopen(fd: int, mode: str = "r", *a: Any, **k: Any) -> Any:
        f = real(fd, mode, *a, **k)
        return HalfThenFull(f) if mode == "wb" else f

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OSError, match="No space left"):
        table.save(target)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"previous": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert json.loads(table.save(target).read_text())["name"] == "t"


# --- benchmark options: usage errors before anything runs ---------------------------------------


@pytest.mark.parametrize(
    "name, argv, message",
    [
        (
            "gemm",
            ["--dtypes", "float99"],
            "--dtypes: must be one of float32, bfloat16, got 'float99'",
        ),
        ("gemm", ["--dtypes", "float32,"], "--dtypes: expected a comma-separated list"),
        ("gemm", ["--grid", "linear:8"], "--grid: expected KIND:M:D:H"),
        (
            "gemm",
            ["--grid", "linear:x:8:8"],
            "--grid: expected an integer, got 'x' in 'linear:x:8:8'",
        ),
        ("gemm", ["--grid", "conv:1:8:8"], "--grid: must be one of linear, mlp, got 'conv'"),
        ("gemm", ["--cells", "linear,bogus"], "--cells: must be one of linear, mlp, got 'bogus'"),
        ("linalg", ["--sizes", "abc"], "--sizes: expected an integer, got 'abc'"),
        ("linalg", ["--dtypes", "float99"], "--dtypes: must be one of float32, float64,"),
        ("linalg", ["--batches", "100,0"], "--batches: must be >= 1, got 0 (in '100,0')"),
        ("linalg", ["--ops", "svd,lu"], "--ops: must be one of svd, eigh, qr, cholesky, got 'lu'"),
        ("linalg", ["--threads", "0"], "--threads: must be >= 1, got 0"),
        ("gemv", ["--batches", "abc"], "--batches: expected an integer, got 'abc'"),
        ("gemv", ["--batches", "1,99"], "--batches: must be <= "),
        ("ft", ["--ranks", "0"], "--ranks: must be >= 2, got 0"),
        ("ft", ["--ranks", "4", "1"], "--ranks: must be >= 2, got 1"),
        ("frontend", ["--parts", "bogus"], "--parts: must be one of dynamic, complex, batching"),
    ],
)
def test_bad_benchmark_options_are_usage_errors(tmp_path, capsys, parse_only, name, argv, message):
    """Each ended in a traceback (AttributeError, ValueError, IndexError) or, for an unknown
    frontend part or --batches 0, in an empty or degenerate table with exit 0 that overwrote the
    results. Now: exit 2 naming the option and the value, before anything runs."""
    rc = benchmarks.run_benchmark(name, [*argv, "--json", str(tmp_path / "r.json")])
    assert rc == 2
    assert f"error: argument {message}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "name", [n for n in benchmarks.list_benchmarks() if n not in benchmarks.TOOLS]
)
def test_every_benchmarks_defaults_parse(parse_only, name):
    """argparse runs a string default through the option's type: every default must pass."""
    with pytest.raises(parse_only) as e:
        benchmarks.run_benchmark(name, ["--quick"])
    args = e.value.args[0]
    if name in ("gemm", "linalg"):
        assert all(isinstance(d, torch.dtype) for d in args.dtypes)
    if name == "frontend":
        assert args.parts == ["dynamic", "complex", "batching"]


# --- no C compiler: the results say so ------------------------------------------------------------


def test_results_record_the_compiler_and_native_fallbacks(tmp_path, monkeypatch, capsys):
    """With no C compiler every native kernel fell back to ATen, and the JSON recorded ATen's
    times as "ours" with nothing to tell. The machine info names the compiler (or why there is
    none) and counts the calls that fell back while the table ran; the table flags both."""
    from torchport import native

    calls = [5]  # (fallbacks before the table started are not its own)
    monkeypatch.setattr(native, "stats", lambda: native.Stats(fallbacks=calls[0]))
    monkeypatch.setenv("TORCHPORT_CC", str(tmp_path / "no-such-cc"))
    table = benchmarks.BenchTable("t")
    table.start()
    calls[0] += 2  # (two calls of ours ran ATen)
    saved = json.loads(table.save(tmp_path / "r.json").read_text())["machine"]
    assert saved["compiler"].startswith("unavailable: ") and "no-such-cc" in saved["compiler"]
    assert saved["native_fallbacks"] == 2
    out = capsys.readouterr().out
    assert "# WARNING: C compiler unavailable: " in out.splitlines()[1]
    assert "# WARNING: 2 calls of ours ran ATen (native fallbacks)" in out
    monkeypatch.delenv("TORCHPORT_CC")
    table = benchmarks.BenchTable("t")
    table.start()
    saved = json.loads(table.save(tmp_path / "r.json").read_text())["machine"]
    assert saved["native_fallbacks"] == 0
    if not saved["compiler"].startswith("unavailable"):  # (a compiler here: nothing to flag)
        assert "WARNING" not in capsys.readouterr().out
