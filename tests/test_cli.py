"""The torchport command: info, bench discovery, and a short real demo run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchport import benchmarks, cli, demo


def test_info_prints_cpu_features(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "features" in out and "AVX2:" in out and "AVX512-BF16:" in out and "AMX-TILE:" in out
    assert "compiler" in out and "cache" in out


def test_info_reports_an_unusable_cache(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")  # as a read-only or forbidden cache directory
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "unusable: [Errno 20] Not a directory" in out and "settings:" in out


def test_bad_setting_is_reported_without_a_traceback(capsys, monkeypatch):
    monkeypatch.setenv("TORCHPORT_ISA", "sse9")
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchport: error: isa (TORCHPORT_ISA): must be one of")
    assert "'sse9'" in err


def test_bench_list_and_unknown(capsys):
    assert cli.main(["bench", "list"]) == 0
    assert "elementwise" in capsys.readouterr().out.split()
    assert cli.main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err


def test_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "el.json"
    assert cli.main(["bench", "elementwise", "--quick", "--reps", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["torch"] and data["rows"]
    assert all(r["anchor_s"] > 0 and r["ours_s"] > 0 for r in data["rows"])
    assert "ratio" in capsys.readouterr().out


def test_compare_flips_the_call_order_every_round():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "ab"}
    t = benchmarks.compare(fns, [()], reps=4, warmup=1, max_time_s=60.0)
    assert set(t) == {"a", "b"}
    # warm-up calls first, then a b | b a | a b | b a: each follows the other equally often
    assert "".join(calls[-8:]) == "abbaabba" and len(calls) > 8


def test_compare_rotates_own_sets_apart_from_the_shared_ones():
    """``own_sets``: a function given sets of its own rotates over them alone, and every
    function steps through its sets with a counter of its own (a shared counter handed the
    others only some of the shared sets, by the order's period)."""
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    fns = {k: (lambda i, k=k: seen[k].append(i)) for k in seen}
    shared = [(0,), (1,), (2,)]
    benchmarks.compare(fns, shared, reps=4, warmup=0, own_sets={"c": [(10,), (11,)]})
    # (each function's one warm-up call first, then four timed rounds)
    assert seen["c"] == [10, 10, 11, 10, 11]
    assert seen["a"] == seen["b"] == [0, 0, 1, 2, 0]
    seen = {"a": [], "b": [], "c": []}
    benchmarks.compare(fns, shared, reps=4, warmup=0)  # one shared rotation
    assert sorted(seen["a"][1:] + seen["b"][1:] + seen["c"][1:]) == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        1,
        2,
        2,
        2,
        2,
    ]
    assert seen["a"][1:3] == [0, 2]  # rounds a b c, then c b a: a's second call is call 5, set 2


def test_python_dash_m_entry_point():
    res = subprocess.run(
        [sys.executable, "-m", "torchport", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "demo" in res.stdout


def test_demo_trains_samples_and_reports(tmp_path):
    argv = [
        "demo",
        "--out",
        str(tmp_path),
        "--steps",
        "12",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--eval-every",
        "6",
        "--corpus-mb",
        "0.5",
        "--sample-tokens",
        "40",
    ]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    titles = [s["title"] for s in report]
    assert any(t.startswith("training") for t in titles)
    train = next(s for s in report if s["title"].startswith("training"))
    curve = train["data"]["val_curve"]
    assert curve[-1][1] < curve[0][1]  # learning happened
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "sample.txt").read_bytes()) >= 40


def test_demo_rejects_unknown_stage(tmp_path):
    args = cli.build_parser().parse_args(["demo", "--out", str(tmp_path), "--stages", "warp"])
    with pytest.raises(ValueError, match=r"unknown demo stage\(s\) \['warp'\]"):
        demo.run(args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
        (["--sample-tokens", "-5"], "argument --sample-tokens: must be >= 0, got -5"),
        (["--seq-len", "3"], "argument --seq-len: must be >= 8, got 3"),
        (["--time-limit", "0"], "argument --time-limit: must be a positive finite number"),
        (["--stages", "bogus"], r"unknown demo stage\(s\) \['bogus'\]"),
        (["--stages", ""], r"unknown demo stage\(s\)"),
        (["--heads", "3", "--d-model", "16"], r"--d-model \(16\) must be divisible by --heads"),
    ],
)
def test_bad_demo_options_are_usage_errors(tmp_path, capsys, argv, message):
    """Bad demo options ended in Python tracebacks (exit 1), --eval-every 0 only mid-training
    (ZeroDivisionError) and a negative --sample-tokens printed negative tokens/s; an unknown
    stage was refused after --out had been created. Each is an error message, exit 2, before
    anything runs or is written."""
    import re

    out = tmp_path / "never"
    try:
        rc = cli.main(["demo", "--out", str(out), *argv])
    except SystemExit as e:  # (argparse's usage error)
        rc = e.code
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_a_stage_named_alone_brings_its_prerequisites():
    """``--stages train`` or ``--stages sample`` without ``data`` failed on a bare assert."""
    assert demo.selected_stages("sample") == ["data", "train", "sample"]
    assert demo.selected_stages("train,quant") == ["data", "train", "quant"]
    assert demo.selected_stages("ft") == ["ft"]


def test_ft_stage_starts_from_a_clean_folder(tmp_path):
    """A second ft run read the first run's progress files as its own: it killed replica 1
    before it had joined and reported another run's steps."""
    from torchport.demo.stage_ft import _fresh

    for name in ("r0.bin", "r1.bin.progress", "r0.bin.json", "corpus.bin", "notes.txt"):
        (tmp_path / name).write_text("8")
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "rank_0.json").write_text("{}")
    _fresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "notes.txt"]


def test_bench_runner_reports_a_benchmarks_exit_text_and_restores_threads(
    tmp_path, capsys, monkeypatch
):
    """``torchport bench NAME`` dropped a benchmark's SystemExit('why') without a word, and a
    benchmark that set the thread count (bench_graphs) left it for the next ones of ``bench all``."""
    import torch

    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_fake.py").write_text(
        "import torch\ntorch.set_num_threads(1)\nraise SystemExit('bench fake: no such hardware')\n"
    )
    monkeypatch.setattr(benchmarks, "bench_dir", lambda: tmp_path / "bench")
    threads = torch.get_num_threads()
    assert benchmarks.run_benchmark("fake", []) == 1
    assert "bench fake: no such hardware" in capsys.readouterr().err
    assert torch.get_num_threads() == threads
