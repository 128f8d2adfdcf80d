"""Review 53 of the Flight Recorder: a wrapped ring is no proof of a hang, uneven all-to-alls,
dumps of two jobs, clear() keeps the sequence ids, reduce_scatter's spellings, install() /
uninstall() cycles, the signal dump's process-wide state, and bounded analyzer memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchport import config
from torchport.distributed import flight_recorder as fr
from torchport.distributed import fr_analyze
from torchport.distributed.flight_recorder import FlightRecorder
from torchport.distributed.fr_analyze import DumpError, analyze, load_dumps
from torchport.distributed.fr_torch import ExportError, export

T = torch.zeros(4)


def _coll(rec: FlightRecorder, op: str = "all_reduce", tensors: Any = (T,), ranks: Any = None):
    e = rec.record(op, "default", list(tensors), ranks=ranks)
    rec.started(e)
    rec.completed(e)


def _dumps(tmp_path: Path, recs: list[FlightRecorder]) -> dict[int, dict[str, Any]]:
    for rec in recs:
        rec.dump()
    return load_dumps(tmp_path)


# -- 1. a rank whose ring wrapped is not blamed --------------------------------------------------
def test_a_wrapped_ring_without_the_groups_ops_is_not_a_hang(tmp_path):
    """The ring is the process's: rank 0's 10 sends evicted its 3 all_reduces. It was reported
    as never having entered collective #0, which every rank completed."""
    recs = [FlightRecorder(8, rank=r, world_size=3, dump_dir=tmp_path) for r in range(3)]
    for rec in recs:
        for _ in range(3):
            _coll(rec, ranks=[0, 1, 2])
    for _ in range(10):
        e = recs[0]._new("send", "default", [T.shape], [T.dtype], "started", "p2p", 2, None, 0)
        recs[0].completed(e)
        e = recs[2]._new("recv", "default", [T.shape], [T.dtype], "started", "p2p", 0, None, 0)
        recs[2].completed(e)
    v = analyze(_dumps(tmp_path, recs))
    assert v.never_entered == []
    assert v.cannot_tell == [(0, "default"), (2, "default")]
    assert "rank 0: cannot tell which collectives of group 'default' it entered" in v.text()
    assert v.findings[0].startswith("no problem found in the ops the dumps hold")


def test_a_wrapped_ring_holding_the_groups_ops_still_names_the_hang(tmp_path):
    """A wrapped rank that holds an op of the group holds its newest one there: a rank behind
    is still named."""
    recs = [FlightRecorder(4, rank=r, world_size=2, dump_dir=tmp_path) for r in range(2)]
    for _ in range(6):
        _coll(recs[0], ranks=[0, 1])
    for _ in range(5):
        _coll(recs[1], ranks=[0, 1])
    v = analyze(_dumps(tmp_path, recs))
    assert v.never_entered == [(1, "default", 5, "all_reduce")]
    assert v.cannot_tell == []


def test_an_unwrapped_rank_without_the_groups_ops_never_entered(tmp_path):
    recs = [FlightRecorder(8, rank=r, world_size=2, dump_dir=tmp_path) for r in range(2)]
    _coll(recs[0], ranks=[0, 1])
    recs[1].groups["default"] = [0, 1]
    v = analyze(_dumps(tmp_path, recs))
    assert v.never_entered == [(1, "default", 0, "all_reduce")]


def test_the_buffer_size_setting_says_the_ring_is_per_process():
    doc = config.SETTINGS["fr_buffer_size"].doc
    assert "per process," in doc and "per process group" not in doc


# -- 2. uneven all-to-alls --------------------------------------------------------------------------
def _a2a(tmp_path: Path, shapes: list[tuple[list[int], list[int]]], dtypes: Any = None):
    """One all_to_all_single per rank with (output numel, input numel) ``shapes``, as the
    recorder records it (output, input)."""
    n = len(shapes)
    recs = [FlightRecorder(8, rank=r, world_size=n, dump_dir=tmp_path) for r in range(n)]
    for r, (out, inp) in enumerate(shapes):
        dt = dtypes[r] if dtypes else torch.float32
        _coll(
            recs[r], "all_to_all_single", [torch.empty(out, dtype=dt), torch.empty(inp)], range(n)
        )
        _coll(recs[r], ranks=range(n))
    return recs


def test_an_uneven_all_to_all_single_is_no_mismatch(tmp_path):
    """splits [1, 2] / [3, 4] (rank 0 sends 3 and receives 4, rank 1 sends 7 and receives 6):
    legal, and torch's analyzer compares totals only. It was a size mismatch."""
    v = analyze(_dumps(tmp_path, _a2a(tmp_path, [([4], [3]), ([6], [7])])))
    assert v.mismatches == []
    assert v.findings[0].startswith("no problem found: every rank")


def test_an_all_to_all_whose_totals_differ_is_a_size_mismatch(tmp_path):
    v = analyze(_dumps(tmp_path, _a2a(tmp_path, [([4], [3]), ([6], [8])])))
    assert v.mismatches == [("default", 0, "size")]
    assert "inputs of ranks [0, 1] hold 11 elements in all but their outputs 10" in v.text()


def test_an_all_to_all_of_other_dtypes_is_a_dtype_mismatch(tmp_path):
    recs = _a2a(tmp_path, [([4], [3]), ([6], [7])], dtypes=[torch.float32, torch.float64])
    v = analyze(_dumps(tmp_path, recs))
    assert v.mismatches == [("default", 0, "dtype")]


def test_an_all_to_all_with_a_member_missing_compares_no_totals(tmp_path):
    recs = _a2a(tmp_path, [([4], [3]), ([6], [8]), ([1], [1])])
    recs[0].dump()
    recs[1].dump()
    v = analyze(load_dumps(tmp_path))
    assert v.mismatches == [] and v.missing_ranks == [2]


# -- 3. dumps of two jobs ---------------------------------------------------------------------------
def test_analyze_refuses_dumps_of_two_jobs_as_export_does(tmp_path, capsys):
    """A reused folder: an earlier 4-rank job's rank_2/3.json beside today's 2-rank dumps.
    Analysed together, today's healthy ranks were blamed for never entering #5."""
    for world, ranks, n in ((4, range(4), 50), (2, range(2), 5)):
        for r in ranks:
            rec = FlightRecorder(100, rank=r, world_size=world, dump_dir=tmp_path)
            for _ in range(n):
                _coll(rec, ranks=list(range(world)))
            rec.dump()
    with pytest.raises(DumpError, match=r"different jobs: world_size 2 in .* but 4 in"):
        load_dumps(tmp_path)
    with pytest.raises(ExportError, match=r"different jobs: world_size 2 in .* but 4 in"):
        export(tmp_path, tmp_path / "torch")
    args = fr_analyze.argparse.Namespace(fr_command="analyze", dir=str(tmp_path), json=False)
    assert fr_analyze.cmd_fr(args) == 2
    assert "different jobs" in capsys.readouterr().err


def test_analyze_refuses_one_group_name_with_other_members(tmp_path):
    for r, members in ((0, [0, 1]), (1, [1, 0]), (2, [0, 2])):
        rec = FlightRecorder(8, rank=r, world_size=3, dump_dir=tmp_path)
        rec.groups["sub"] = members
        rec.dump()
    with pytest.raises(DumpError, match=r"group 'sub' has ranks \[0, 1\] in .* but \[0, 2\]"):
        load_dumps(tmp_path)


# -- 4. clear() ------------------------------------------------------------------------------------
def test_clear_keeps_the_sequence_ids_and_analysis_sees_no_hang(tmp_path):
    """clear() restarted the group's sequence ids: rank 0's next ops were #0, #1 while rank 1's
    were #3, #4, and the analyzer reported a hang that never happened."""
    recs = [FlightRecorder(100, rank=r, world_size=2, dump_dir=tmp_path) for r in range(2)]
    for rec in recs:
        for _ in range(3):
            _coll(rec, ranks=[0, 1])
    recs[0].clear()
    assert recs[0].snapshot()["entries"] == []
    for rec in recs:
        for _ in range(2):
            _coll(rec, ranks=[0, 1])
    ids = [(e["seq_id"], e["record_id"]) for e in recs[0].snapshot()["entries"]]
    assert ids == [(3, 3), (4, 4)]  # record ids go on too: the dump shows entries were dropped
    v = analyze(_dumps(tmp_path, recs))
    assert v.never_entered == [] and v.mismatches == []


def test_after_clear_a_rank_without_the_groups_ops_is_not_blamed(tmp_path):
    recs = [FlightRecorder(100, rank=r, world_size=2, dump_dir=tmp_path) for r in range(2)]
    for rec in recs:
        _coll(rec, ranks=[0, 1])
    recs[0].clear()
    e = recs[0]._new("send", "default", [T.shape], [T.dtype], "started", "p2p", 1, None, 0)
    recs[0].completed(e)
    v = analyze(_dumps(tmp_path, recs))
    assert v.never_entered == [] and v.cannot_tell == [(0, "default")]


# -- processes of one rank (gloo world of 1) ---------------------------------------------------------
@pytest.fixture
def world1(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rec = fr.install(FlightRecorder(16, dump_dir=tmp_path), signal_dump=False)
    try:
        yield rec
    finally:
        rec.stop()
        fr.uninstall()
        dist.destroy_process_group()


# -- 5. reduce_scatter's spellings -------------------------------------------------------------------
def test_reduce_scatter_is_recorded_alike_however_it_is_called(world1):
    """pg.reduce_scatter([out], [inputs]) without opts took the one-tensor hot path and was
    recorded without its inputs ([[4]] against dist.reduce_scatter's [[4], [4]])."""
    out, ins = torch.empty(4), [torch.ones(4)]
    pg = dist.group.WORLD
    got = []
    for call in (
        lambda: dist.reduce_scatter(out, ins),
        lambda: pg.reduce_scatter([out], [ins]),
        lambda: pg.reduce_scatter([out], [ins], dist.ReduceScatterOptions()),
    ):
        w = call()
        if w is not None:
            w.wait()
        got.append(world1.snapshot()["entries"][-1]["sizes"])
    assert got == [[[4], [4]]] * 3
    pg.allreduce([out]).wait()  # (the hot path still records the one tensor)
    assert world1.snapshot()["entries"][-1]["sizes"] == [[4]]


# -- 6. / 7. install(), uninstall() and the signal dump ------------------------------------------------
def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (signal handlers and the wakeup fd are the
    process's); returns its stdout."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _await(pred: Any, what: str, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_uninstall_stops_the_watchdog_and_the_signal_dump_install_started(tmp_path):
    """Each install() / uninstall() cycle left a watchdog thread running, and the signal dump
    with the program's SIGUSR1 handler replaced."""
    assert threading.current_thread() is threading.main_thread()
    # (an earlier test in this process may have left the signal dump on: install() then did not
    # enable it and uninstall() rightly leaves it; start from none)
    fr.disable_signal_dump()
    hits: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: hits.append(s))
    mine = signal.getsignal(signal.SIGUSR1)
    try:
        for _ in range(3):
            rec = fr.install(FlightRecorder(16, rank=0, world_size=1, dump_dir=tmp_path))
            fr.uninstall()
        names = [t.name for t in threading.enumerate()]
        assert "tp-fr-watchdog" not in names and "tp-fr-signal" not in names
        assert signal.getsignal(signal.SIGUSR1) is mine
        os.kill(os.getpid(), signal.SIGUSR1)
        _await(lambda: hits, "the program's handler did not run")
        time.sleep(0.1)
        assert not (tmp_path / "rank_0.json").exists() and rec.dumps == 0
        # a watchdog the program started itself is left running
        rec.start_watchdog(timeout_s=60)
        fr.install(rec, signal_dump=False)
        fr.uninstall()
        assert rec._watchdog is not None and rec._watchdog.is_alive()
        rec.stop()
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_signal_dump_keeps_the_programs_handler_and_a_second_signal(tmp_path):
    """A second enable_signal_dump(SIGUSR2) returned but installed nothing (SIGUSR2 then
    killed the process); the program's SIGUSR1 handler was replaced by a no-op."""
    out = _run(
        f"""
        import os, signal, time
        from torchport.distributed import flight_recorder as fr
        hits = []
        signal.signal(signal.SIGUSR1, lambda s, f: hits.append(s))
        rec = fr.FlightRecorder(16, rank=0, world_size=1, dump_dir={str(tmp_path)!r})
        fr.enable_signal_dump(signal.SIGUSR1, recorder=rec)
        fr.enable_signal_dump(signal.SIGUSR2, recorder=rec)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            n = rec.dumps
            os.kill(os.getpid(), sig)
            deadline = time.monotonic() + 5
            while rec.dumps == n and time.monotonic() < deadline:
                time.sleep(0.01)
            print(signal.Signals(sig).name, rec.dumps - n)
        print("hits", hits)
        fr.disable_signal_dump()
        print("restored", signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL)
        """
    )
    assert out.split("\n")[:4] == ["SIGUSR1 1", "SIGUSR2 1", "hits [10]", "restored True"]


def test_signal_dump_keeps_asyncios_wakeup_fd_and_survives_a_loop_after_it(tmp_path):
    """enable_signal_dump replaced asyncio's wakeup fd (its signal handlers never ran); and an
    asyncio loop run after it took the wakeup fd and, closing, set none: SIGUSR1 no longer
    dumped."""
    out = _run(
        f"""
        import asyncio, os, signal, time
        from torchport.distributed import flight_recorder as fr
        rec = fr.FlightRecorder(16, rank=0, world_size=1, dump_dir={str(tmp_path)!r})
        async def main():
            loop = asyncio.get_running_loop()
            got = asyncio.Event()
            loop.add_signal_handler(signal.SIGUSR2, got.set)
            fr.enable_signal_dump(recorder=rec)
            os.kill(os.getpid(), signal.SIGUSR2)
            await asyncio.wait_for(got.wait(), 5)
            print("asyncio handler ran")
        asyncio.run(main())
        fr.disable_signal_dump()
        fr.enable_signal_dump(recorder=rec)
        async def other():
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
        asyncio.run(other())
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while rec.dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        print("dumps", rec.dumps)
        """
    )
    assert out.split("\n")[:2] == ["asyncio handler ran", "dumps 1"]


# -- 8. the analyzer's memory is bounded ---------------------------------------------------------------
def _write(p: Path, entries_json: str) -> None:
    p.write_text('{"rank":0,"world_size":1,"entries":' + entries_json + "}")


def test_a_dump_of_too_many_lists_is_refused_before_parsing(tmp_path):
    """A 64 MiB dump whose one entry's sizes was 22 million empty lists took 3.5 GB; a dump
    with more lists and objects than a real one has is refused before json.loads."""
    n = fr_analyze.MAX_JSON_CONTAINERS
    sizes = "[]," * n + "[]"
    _write(
        tmp_path / "rank_0.json",
        '[{"seq_id":0,"op":"all_reduce","group":"g","state":"completed","sizes":[' + sizes + "]}]",
    )
    with pytest.raises(DumpError, match=r"rank_0.json holds more than the 2097152 lists"):
        load_dumps(tmp_path)


def test_a_dump_of_too_many_strings_is_refused_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(fr_analyze, "MAX_JSON_STRINGS", 100)
    dtypes = json.dumps(["ab"] * 100)
    _write(
        tmp_path / "rank_0.json",
        f'[{{"seq_id":0,"op":"x","group":"g","state":"completed","dtypes":{dtypes}}}]',
    )
    with pytest.raises(DumpError, match=r"or 100 strings \(fr_analyze.MAX_JSON_STRINGS\)"):
        load_dumps(tmp_path)


def test_a_real_dump_is_far_inside_the_bounds(tmp_path):
    rec = FlightRecorder(2000, rank=0, world_size=1, dump_dir=tmp_path, record_stack=True)
    for _ in range(2000):
        _coll(rec, ranks=[0])
    data = rec.dump().read_bytes()
    assert len(data) * 10 < fr_analyze.MAX_DUMP_BYTES
    assert (data.count(b"[") + data.count(b"{")) * 10 < fr_analyze.MAX_JSON_CONTAINERS
    assert data.count(b'"') // 2 * 10 < fr_analyze.MAX_JSON_STRINGS
    assert analyze(load_dumps(tmp_path)).findings[0].startswith("no problem found")
