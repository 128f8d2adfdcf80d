"""The ``torchport`` command and its caches after review 52: a bad setting is a usage error
before any command runs; the autotune choice file and its lock refuse what is not a regular
file (a FIFO hung every lookup); a group that is another user's primary group is not private;
TORCHPORT_NATIVE_PCH's missing parents are made private; a relative XDG_CACHE_HOME is ignored;
``bench all --json`` needs a folder; the demo's size options are bounded and its report is
strict JSON. All in-process: no worker, benchmark or demo stage runs."""

from __future__ import annotations

import grp
import json
import math
import os
import pwd
import stat
import threading
import warnings
from pathlib import Path

import pytest

from torchport import cli, config, demo
from torchport.autotune.cache import (
    ChoiceCache,
    ChoiceCacheWriteWarning,
    CorruptChoiceCacheWarning,
)
from torchport.demo.report import Section, write_report
from torchport.native import pch, toolchain

# --- 1: every setting is resolved before a command runs ---------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["bench", "list"], ["demo", "--stages", "ft", "--out", "OUT"]],
    ids=["bench-list", "demo-ft"],
)
def test_a_bad_setting_only_workers_read_is_a_usage_error_before_anything_runs(
    argv, tmp_path, monkeypatch, capsys
):
    """TORCHPORT_DIST_TRANSPORT is read by the ft stage's replicas only: a bad value was a
    traceback per replica and exit 1 (~30 s, after every earlier stage of a full demo)."""
    ran: list[str] = []
    monkeypatch.setattr(demo, "execute", lambda ctx, stages: ran.append("demo"))
    monkeypatch.setattr("torchport.benchmarks.list_benchmarks", lambda: ran.append("bench") or [])
    monkeypatch.setenv("TORCHPORT_DIST_TRANSPORT", "bogus")
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "torchport: error: dist_transport (TORCHPORT_DIST_TRANSPORT): must be auto" in err
    assert "'bogus'" in err
    assert ran == []
    assert not (tmp_path / "out").exists()


# --- 2: the choice file and its lock are regular files -----------------------------------------


def _cache(tmp_path: Path) -> ChoiceCache:
    d = tmp_path / "autotune"
    d.mkdir(mode=0o700)
    return ChoiceCache(d / "choices-v1.json")


def test_a_fifo_for_the_choice_file_is_corrupt_not_a_hang(tmp_path):
    """open() of a FIFO waited for a writer: every lookup hung."""
    c = _cache(tmp_path)
    os.mkfifo(c.path)
    out: list[object] = []
    caught: list[warnings.WarningMessage] = []

    def lookup() -> None:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out.append(c.get("op", {"a": 1}))
        caught.extend(w)

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # (the old code: unblock its open() with a writer, then fail)
        os.close(os.open(c.path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
        pytest.fail("a lookup hung in open() on a FIFO at the choice file's path")
    assert out == [None]
    msgs = [str(w.message) for w in caught if issubclass(w.category, CorruptChoiceCacheWarning)]
    assert any("must be a regular file, got prw" in m for m in msgs), msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", CorruptChoiceCacheWarning)  # (its merge reads it again)
        c.put("op", {"a": 1}, "ATEN", {"ATEN": 1.0})  # (replaces it)
    assert stat.S_ISREG(os.lstat(c.path).st_mode)
    c.clear_memory()
    assert c.get("op", {"a": 1})["choice"] == "ATEN"


def test_a_symbolic_link_for_the_choice_file_is_not_followed(tmp_path):
    c = _cache(tmp_path)
    real = ChoiceCache(tmp_path / "autotune" / "elsewhere.json")
    real.put("op", {"a": 1}, "NATIVE", {"NATIVE": 1.0})
    os.symlink(real.path, c.path)
    with pytest.warns(CorruptChoiceCacheWarning, match="must be a regular file, got a symbolic"):
        assert c.get("op", {"a": 1}) is None
    with pytest.warns(CorruptChoiceCacheWarning):  # (its merge reads it again)
        c.put("op", {"a": 2}, "ATEN", {"ATEN": 1.0})
    assert not os.path.islink(c.path)  # replaced, its target untouched
    assert "NATIVE" in real.path.read_text() and "ATEN" not in real.path.read_text()


def test_a_fifo_for_the_lock_file_is_replaced(tmp_path):
    """open(lock, "a+") failed on a FIFO ("not seekable") in every write: choices lasted the
    process only, for good."""
    c = _cache(tmp_path)
    lock = c.path.with_suffix(".lock")
    os.mkfifo(lock)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c.put("op", {"a": 1}, "ATEN", {"ATEN": 1.0})
    assert not [x for x in w if issubclass(x.category, ChoiceCacheWriteWarning)]
    assert any(
        issubclass(x.category, CorruptChoiceCacheWarning)
        and "lock" in str(x.message)
        and "must be a regular file, got prw" in str(x.message)
        for x in w
    ), [str(x.message) for x in w]
    assert stat.S_ISREG(os.lstat(lock).st_mode)
    assert c.path.is_file()


def test_a_symbolic_link_for_the_lock_file_is_not_followed(tmp_path):
    c = _cache(tmp_path)
    lock = c.path.with_suffix(".lock")
    target = tmp_path / "planted-lock"
    os.symlink(target, lock)
    with pytest.warns(CorruptChoiceCacheWarning, match="lock.*got a symbolic link"):
        c.put("op", {"a": 1}, "ATEN", {"ATEN": 1.0})
    assert not target.exists()  # (it was made by open(..., "a+"))
    assert stat.S_ISREG(os.lstat(lock).st_mode)


# --- 3: a group that is another user's primary group is not private -----------------------------


@pytest.mark.parametrize("other_gid", [1000, 1001], ids=["other-primary", "other-elsewhere"])
def test_own_group_counts_users_whose_primary_group_it_is(other_gid, monkeypatch):
    """gr_mem lists supplementary members only: mallory, whose primary group is alice's, could
    write a group-writable cache directory that counted as alice's alone."""
    me = pwd.struct_passwd(("alice", "x", 1000, 1000, "", "/home/alice", "/bin/sh"))
    other = pwd.struct_passwd(("mallory", "x", 1001, other_gid, "", "/home/m", "/bin/sh"))
    alias = pwd.struct_passwd(("alice2", "x", 1000, 1000, "", "/home/alice", "/bin/sh"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: me)
    monkeypatch.setattr(pwd, "getpwall", lambda: [me, other, alias])
    monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("alice", "x", gid, [])))
    toolchain._own_group.cache_clear()
    try:
        private = other_gid != 1000
        assert toolchain._own_group(1000) is private
        st = os.stat_result((stat.S_IFDIR | 0o770, 0, 0, 2, 1000, 1000, 0, 0, 0, 0))
        why = toolchain.unsafe_reason(st, 1000, leaf=True)
        assert (why is None) is private
        if not private:
            assert why is not None and "must not be writable by other users" in why
    finally:
        toolchain._own_group.cache_clear()


# --- 4: the missing parents of TORCHPORT_NATIVE_PCH are made private -----------------------------


def test_pch_folder_parents_are_made_private_under_umask_000(tmp_path, monkeypatch):
    """Made by the umask (0777 under umask 000), check_private refused the folder: no PCH was
    ever used, silently. (The build itself is stubbed: the folder check is what is tested.)"""
    where = tmp_path / "a" / "b" / "pch"
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", str(where))
    monkeypatch.setattr(pch, "_is_gcc", lambda cc: True)
    monkeypatch.setattr(pch, "_verified", lambda d, key: False)
    monkeypatch.setattr(pch, "_build", lambda d, flags, cc, key: None)
    old = os.umask(0)
    try:
        header = pch.header_for(pch.HEADERS + "int f(void);\n", ["-O2"], "gcc")
    finally:
        os.umask(old)
    assert header is not None and header.parent.parent == where
    for p in (tmp_path / "a", tmp_path / "a" / "b", where):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p


# --- 5: a relative XDG_CACHE_HOME is ignored ----------------------------------------------------


@pytest.mark.parametrize("xdg", ["relcache", "./c", " /abs-with-space"])
def test_a_relative_xdg_cache_home_is_ignored(xdg, tmp_path, monkeypatch):
    """The XDG Base Directory spec: a relative value is invalid and must be ignored (it made a
    cache under the current directory, which moved with os.chdir)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert config._default_cache_dir() == str(tmp_path / ".cache" / "torchport")


def test_an_absolute_xdg_cache_home_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config._default_cache_dir() == str(tmp_path / "xdg" / "torchport")


# --- 6: bench all --json needs a folder --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--json", ""], r"--json needs a folder, got ''$"),
        (["--json="], r"--json needs a folder, got ''$"),
        (
            ["--quick", "--json", "--reps", "3"],
            r"got '--reps' \(a folder named so: --json ./--reps",
        ),
        (["--json=-odd"], r"got '-odd' \(a folder named so: --json ./-odd\)"),
    ],
    ids=["empty", "empty-eq", "option", "dash"],
)
def test_bench_all_json_refuses_an_empty_or_option_like_folder(argv, match):
    with pytest.raises(ValueError, match=match):
        cli._json_per_benchmark(argv)


def test_bench_all_json_keeps_the_folder_as_given():
    """("./-odd" as a Path is "-odd": the benchmark's parser then read "-odd/NAME.json" as an
    option)"""
    assert cli._json_per_benchmark(["--json", "./-odd", "--quick"])("gemm") == [
        "--quick",
        "--json",
        "./-odd/gemm.json",
    ]


def test_bench_all_json_empty_is_a_usage_error_and_runs_nothing(monkeypatch, capsys):
    ran: list[str] = []
    monkeypatch.setattr("torchport.benchmarks.run_benchmark", lambda n, a: ran.append(n) or 0)
    assert cli.main(["bench", "all", "--json", ""]) == 2
    assert "torchport bench: error: with 'all', --json needs a folder, got ''" in (
        capsys.readouterr().err
    )
    assert ran == []


# --- 7a: the demo's size options are bounded -------------------------------------------------


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ("--batch-size", "MAX_BATCH_SIZE"),
        ("--seq-len", "MAX_SEQ_LEN"),
        ("--d-model", "MAX_D_MODEL"),
        ("--layers", "MAX_LAYERS"),
        ("--heads", "MAX_D_MODEL"),
        ("--sample-tokens", "MAX_SAMPLE_TOKENS"),
    ],
)
def test_demo_size_options_are_bounded(option, name, capsys):
    """A typo (12800 for 128) allocated until an untyped RuntimeError."""
    bound = getattr(demo, name)
    parser = cli.build_parser()
    assert getattr(parser.parse_args(["demo", option, str(bound)]), option[2:].replace("-", "_"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["demo", option, str(bound * 10)])
    assert e.value.code == 2
    assert f"argument {option}: must be <= {bound}, got {bound * 10}" in capsys.readouterr().err


# --- 7b: report.json is strict JSON ----------------------------------------------------------


def test_report_writes_null_for_non_finite_numbers(tmp_path):
    """A diverged run's NaN losses were written as NaN tokens, which strict parsers refuse."""
    s = Section("training")
    s.add("final validation loss", math.nan)
    s.data = {"val_curve": [(0, 5.5), (50, math.nan)], "x": {"y": (math.inf, -math.inf, 1.0)}}

    def strict(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    report = json.loads(write_report(tmp_path, [s]).read_text(), parse_constant=strict)
    assert report[0]["data"] == {"val_curve": [[0, 5.5], [50, None]], "x": {"y": [None, None, 1.0]}}
    assert report[0]["rows"] == {"final validation loss": "nan"}
