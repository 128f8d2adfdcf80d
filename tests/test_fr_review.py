"""Flight Recorder review fixes: malformed dumps are refused with a DumpError (exit code 2 from
``torchport fr analyze`` / ``fr export``), never a traceback, hang or memory blow-up; the
recorder's shared dicts survive racing dumps; the watchdog's timeout and restart."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchport import cli, config
from torchport.distributed import flight_recorder as fr
from torchport.distributed import fr_analyze
from torchport.distributed.flight_recorder import FlightRecorder
from torchport.distributed.fr_analyze import DumpError, analyze, load_dumps
from torchport.distributed.fr_torch import export

_ENTRY = {
    "seq_id": 0,
    "op": "all_reduce",
    "group": "default",
    "state": "completed",
    "sizes": [[4]],
    "dtypes": ["float32"],
    "duration_ms": 1.0,
}


def _write(d: Path, rank: int, entries: list[dict[str, Any]], world: int = 1, **extra: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"rank_{rank}.json"
    p.write_text(json.dumps({"rank": rank, "world_size": world, "entries": entries, **extra}))
    return p


def _refused(d: Path, what: str, capsys: Any) -> None:
    """``load_dumps(d)`` raises a DumpError containing ``what``; ``fr analyze`` and ``fr
    export`` print it and exit 2."""
    with pytest.raises(DumpError) as info:
        load_dumps(d)
    assert what in str(info.value)
    assert cli.main(["fr", "analyze", str(d)]) == 2
    assert what in capsys.readouterr().err
    assert cli.main(["fr", "export", str(d), "--to", str(d.parent / "torch")]) == 2
    assert what in capsys.readouterr().err


def test_an_errored_entry_without_error_text_is_reported(tmp_path, capsys):
    """A1: an errored entry whose error was missing, "" or null ended ``fr analyze`` in an
    IndexError (the first line of no text); a non-string error is refused."""
    for i, err in enumerate(({}, {"error": ""}, {"error": None})):
        d = tmp_path / str(i)
        _write(d, 0, [{**_ENTRY, "state": "errored", **err}])
        assert "failed: (no error text recorded)" in analyze(load_dumps(d)).text()
        assert cli.main(["fr", "analyze", str(d)]) == 0
    capsys.readouterr()
    _write(tmp_path / "z", 0, [{**_ENTRY, "state": "errored", "error": 0}])
    _refused(tmp_path / "z", "entry 0: error must be a string, got 0", capsys)


def test_a_duration_beyond_the_float_range_is_refused(tmp_path, capsys):
    """A2: an int duration_ms of 10**400 passed the check and the report's ``:.0f`` raised
    OverflowError; NaN and Infinity (which Python's JSON reads) are refused too."""
    for i, took in enumerate((10**400, "NaN", "Infinity")):
        d = tmp_path / str(i)
        e = json.dumps({**_ENTRY, "state": "started", "duration_ms": 0})
        e = e.replace('"duration_ms": 0', f'"duration_ms": {took}')
        d.mkdir()
        (d / "rank_0.json").write_text(f'{{"rank": 0, "world_size": 1, "entries": [{e}]}}')
        _refused(d, "entry 0: duration_ms must be a number (finite)", capsys)
    # an int in range is taken, as a float
    _write(tmp_path / "ok", 0, [{**_ENTRY, "state": "started", "duration_ms": 12}])
    assert "still started after 12 ms" in analyze(load_dumps(tmp_path / "ok")).text()


def test_json_nested_too_deeply_or_an_int_too_long_is_refused(tmp_path, capsys):
    """A3: deeply nested JSON raised RecursionError and a 5000-digit int ValueError (Python's
    int string limit), neither caught: a traceback instead of the exit code 2."""
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "rank_0.json").write_text("[" * 200_000 + "]" * 200_000)
    _refused(tmp_path / "deep", "nested too deeply", capsys)
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "rank_0.json").write_text(
        '{"rank": ' + "1" * 5000 + ', "world_size": 1, "entries": []}'
    )
    _refused(tmp_path / "long", "cannot read Flight Recorder dump", capsys)


def test_fields_the_export_copies_are_checked(tmp_path, capsys):
    """A4: a stack that is no list of strings, a non-int or negative record_id and a non-int
    time_*_ns passed the check, and ``fr export`` ended in a TypeError traceback (or copied
    them into torch's dump)."""
    for i, (fix, what) in enumerate(
        (
            ({"stack": 5}, "entry 0: stack must be a list of strings, got 5"),
            ({"stack": ["ok", 1]}, "entry 0: stack must be a list of strings"),
            ({"record_id": "x"}, "entry 0: record_id must be an int >= 0, got 'x'"),
            ({"record_id": -1}, "entry 0: record_id must be an int >= 0, got -1"),
            ({"time_scheduled_ns": "1"}, "entry 0: time_scheduled_ns must be an int >= 0"),
            ({"time_started_ns": 1.5}, "entry 0: time_started_ns must be an int >= 0"),
            ({"time_completed_ns": [1]}, "entry 0: time_completed_ns must be an int >= 0"),
        )
    ):
        _write(tmp_path / str(i), 0, [{**_ENTRY, **fix}])
        _refused(tmp_path / str(i), what, capsys)
    # what our recorder writes is exported (null times and stack, an integral float time)
    ok = {"record_id": 0, "stack": None, "time_started_ns": None, "time_scheduled_ns": 5.0}
    _write(tmp_path / "ok", 0, [{**_ENTRY, **ok}])
    assert len(export(tmp_path / "ok", tmp_path / "ok_torch")) == 1
    # a group named by digits int() does not take ("²", or beyond int64) gets an id of its own
    # (int(name) raised ValueError)
    odd = ["\u00b2", "9" * 30]
    _write(tmp_path / "odd", 0, [{**_ENTRY, "group": g} for g in odd], groups={g: [0] for g in odd})
    assert len(export(tmp_path / "odd", tmp_path / "odd_torch")) == 1


@pytest.mark.timeout(60, method="signal")
def test_sequence_ids_far_apart_are_lined_up_without_walking_the_gap(tmp_path):
    """A5: the analysis walked every id from the lowest to the highest a rank holds: ids 0 and
    10**15 (or 1e300, taken as an integral float) hung it."""
    for i, far in enumerate((10**15, 1e300)):
        d = tmp_path / str(i)
        _write(d, 0, [_ENTRY, {**_ENTRY, "seq_id": far}], world=2)
        _write(d, 1, [_ENTRY], world=2)
        t0 = time.monotonic()
        v = analyze(load_dumps(d))
        assert time.monotonic() - t0 < 5
        assert v.never_entered == [(1, "default", 1, "?")] and not v.mismatches
    # a mismatch inside the window is still found
    d = tmp_path / "mismatch"
    _write(d, 0, [{**_ENTRY, "seq_id": 3}, {**_ENTRY, "seq_id": 9}], world=2)
    _write(d, 1, [{**_ENTRY, "seq_id": 3, "sizes": [[5]]}, {**_ENTRY, "seq_id": 9}], world=2)
    assert analyze(load_dumps(d)).mismatches == [("default", 3, "size")]


def test_a_world_size_beyond_the_maximum_is_refused(tmp_path, capsys, monkeypatch):
    """A6: every rank of world_size without a dump was listed: 10**15 ended in a MemoryError
    (or ran out of memory first). A world_size above MAX_WORLD_SIZE is refused."""
    top = fr_analyze.MAX_WORLD_SIZE
    for world in (top + 1, 10**15):
        _write(tmp_path / "big", 0, [_ENTRY], world=world)
        _refused(
            tmp_path / "big",
            f"world_size must be at most {top} (fr_analyze.MAX_WORLD_SIZE), got {world}",
            capsys,
        )
    # the maximum itself is taken (shown with a small one: a million missing ranks are listed)
    monkeypatch.setattr(fr_analyze, "MAX_WORLD_SIZE", 8)
    _write(tmp_path / "top", 0, [_ENTRY], world=8)
    assert analyze(load_dumps(tmp_path / "top")).missing_ranks == list(range(1, 8))
    _write(tmp_path / "top", 0, [_ENTRY], world=9)
    _refused(
        tmp_path / "top", "world_size must be at most 8 (fr_analyze.MAX_WORLD_SIZE), got 9", capsys
    )


@pytest.mark.timeout(60, method="signal")
def test_a_dump_that_is_no_regular_file_of_ours_is_refused(tmp_path, capsys, monkeypatch):
    """A7: every *.json was read whole and through links: a symbolic link was followed (to
    /dev/zero: the memory exhausted), a FIFO named rank_1.json hung the analysis, and a file of
    any size or owner was read. Each is refused by name."""
    good = _write(tmp_path / "src", 1, [_ENTRY], world=2)
    d = tmp_path / "d"
    _write(d, 0, [_ENTRY], world=2)
    (d / "rank_1.json").symlink_to(good)  # (a valid dump: before, it was read)
    _refused(d, "rank_1.json is a symbolic link: refused", capsys)
    (d / "rank_1.json").unlink()
    (d / "rank_1.json").symlink_to("/dev/zero")
    _refused(d, "rank_1.json is a symbolic link: refused", capsys)
    (d / "rank_1.json").unlink()
    os.mkfifo(d / "rank_1.json")
    _refused(d, "rank_1.json is not a regular file: refused", capsys)
    (d / "rank_1.json").unlink()
    # a file beyond the limit is refused before it is read, with the limit named
    _write(d, 1, [_ENTRY] * 10, world=2)
    monkeypatch.setattr(fr_analyze, "MAX_DUMP_BYTES", 100)
    _refused(d, "is larger than the 100 bytes a dump may have (fr_analyze.MAX_DUMP_BYTES)", capsys)
    monkeypatch.undo()
    assert sorted(load_dumps(d)) == [0, 1]
    if os.geteuid() == 0:  # (only root can make a file of another user's)
        os.chown(d / "rank_1.json", 4242, 4242)
        _refused(d, "rank_1.json is owned by another user (uid 4242): refused", capsys)


def _race(step: Any, main: Any, seconds: float = 1.5) -> list[str]:
    """Call ``step(0), step(1), ...`` on a thread while this one calls ``main()`` for
    ``seconds``; the RuntimeErrors ``main`` raised."""
    stop = threading.Event()

    def loop() -> None:
        i = 0
        while not stop.is_set():
            step(i)
            i += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    errors: list[str] = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                main()
            except RuntimeError as e:
                errors.append(str(e))
    finally:
        stop.set()
        t.join(10)
    return errors


def test_a_dump_racing_the_first_op_of_new_groups_does_not_fail(tmp_path):
    """B1: the snapshot held the live ``groups`` dict, which record() (and install()'s
    _seen()) extended without the lock while json.dumps iterated it: "dictionary changed size
    during iteration" in nearly every racing dump."""
    rec = FlightRecorder(buffer_size=16, rank=0, world_size=1, dump_dir=tmp_path)

    def first_op(i: int) -> None:
        rec.record("all_reduce", f"g{i}", (), ranks=[0])  # a new group's first op

    # (dump's json.dumps(indent=1) iterates the dict in Python code)
    errors = _race(first_op, rec.dump)
    assert errors == [] and rec.dumps > 0
    assert rec.snapshot()["groups"]["g0"] == [0]


def test_retiring_a_group_while_new_groups_record_their_first_op_does_not_fail():
    """B2: ``_new()`` / ``next_seq()`` added a group's counters to ``_seq`` without the lock
    while retire() iterated it under the lock: "dictionary changed size during iteration".
    A retired group's counters are dropped (the dict holds the live groups' only)."""
    rec = FlightRecorder(buffer_size=16, rank=0, world_size=1)

    def new_group(i: int) -> None:
        rec.record("all_reduce", f"g{i}")
        rec.next_seq(f"g{i}", "p2p")

    def cycle() -> None:
        rec.adopt("x", object())  # (a new group object of the name each time)
        rec.record("all_reduce", "x")
        rec.next_seq("x", "p2p")
        rec.retire("x")

    errors = _race(new_group, cycle)
    assert errors == []
    assert not [k for k in rec._seq if k.split("\0")[0] == "x"]


def test_a_non_finite_timeout_is_refused_before_install_patches_anything(monkeypatch):
    """B3: TORCHPORT_FR_TIMEOUT=inf passed the config check, and install() then failed in the
    watchdog's int(t * 1e9) after it had patched torch.distributed (half installed);
    start_watchdog(nan) raised a bare ValueError from int()."""
    monkeypatch.setattr(fr, "_recorder", None)
    for bad in ("inf", "nan", "-1"):
        monkeypatch.setenv("TORCHPORT_FR_TIMEOUT", bad)
        with pytest.raises(config.ConfigError, match="TORCHPORT_FR_TIMEOUT"):
            config.get("fr_timeout")
        all_reduce, send = dist.all_reduce, vars(dist.ProcessGroup).get("send")
        rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
        try:
            with pytest.raises(config.ConfigError, match="must be a finite number >= 0"):
                fr.install(rec, signal_dump=False)
            assert dist.all_reduce is all_reduce
            assert vars(dist.ProcessGroup).get("send") is send
            assert fr._recorder is None and rec._watchdog is None
        finally:
            fr.uninstall()
            rec.stop()
    monkeypatch.delenv("TORCHPORT_FR_TIMEOUT")
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    for bad in (math.nan, math.inf, -1.0, "5", True):
        with pytest.raises(ValueError, match=r"timeout_s must be a finite number >= 0"):
            rec.start_watchdog(bad)  # type: ignore[arg-type]
    rec.start_watchdog(10**400)  # (a huge int is finite: nothing is ever that late)
    rec.stop()


def test_the_watchdog_restarts_after_stop(tmp_path):
    """B4: stop() left the stopped thread recorded, so a later start_watchdog() returned
    without starting one and an overdue op was never dumped."""
    rec = FlightRecorder(buffer_size=8, rank=0, world_size=1, dump_dir=tmp_path)
    rec.start_watchdog(timeout_s=30, period_s=0.01)
    rec.stop()
    rec.record("all_reduce", "default", [torch.ones(1)])  # never completes
    rec.start_watchdog(timeout_s=0.05, period_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "rank_0.json").exists():
            assert time.monotonic() < deadline, "the restarted watchdog did not dump"
            time.sleep(0.01)
    finally:
        rec.stop()
    assert rec._watchdog is None
    assert "timeout" in json.loads((tmp_path / "rank_0.json").read_text())["reason"]


def test_buffer_size_must_be_an_int_not_a_bool():
    """B4: FlightRecorder(buffer_size=True) was accepted (a one-entry ring), as bool is an
    int subclass."""
    for bad in (True, False, 2.0, "3"):
        with pytest.raises(ValueError, match=r"buffer_size must be an int >= 0, got"):
            FlightRecorder(buffer_size=bad)  # type: ignore[arg-type]
    assert FlightRecorder(buffer_size=0).entries() == []
