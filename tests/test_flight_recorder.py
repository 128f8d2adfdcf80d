"""Flight Recorder: ring buffer, states, dumps (request, signal, timeout, error) and the analyzer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch

from tests.ft_actors import Actors
from torchport import cli, config
from torchport.distributed import flight_recorder as fr
from torchport.distributed.flight_recorder import (
    COMPLETED,
    ERRORED,
    STARTED,
    FlightRecorder,
    enable_signal_dump,
)
from torchport.distributed.fr_analyze import DumpError, analyze, load_dumps
from torchport.distributed.fr_torch import ExportError, export, to_torch


def test_ring_buffer_keeps_newest_and_counts_seq_per_group():
    rec = FlightRecorder(buffer_size=5, rank=0, world_size=1)
    for i in range(8):
        e = rec.record(
            "all_reduce", "g" if i % 2 else "h", [torch.zeros(i + 1, dtype=torch.bfloat16)]
        )
        rec.started(e)
        rec.completed(e)
    got = rec.entries()
    assert len(got) == 5
    assert [x[0] for x in got] == [1, 2, 2, 3, 3]  # seq ids of records 3..7, per group
    snap = rec.snapshot()
    assert snap["entries"][-1]["sizes"] == [[8]] and snap["entries"][-1]["dtypes"] == ["bfloat16"]
    assert all(e["state"] == COMPLETED and e["duration_ms"] >= 0 for e in snap["entries"])
    assert FlightRecorder(buffer_size=0).entries() == []
    with pytest.raises(ValueError, match="buffer_size must be an int >= 0, got -1"):
        FlightRecorder(buffer_size=-1)


class _LateFuture:
    """A finished future whose done-callbacks have not run yet (they run on the thread that
    finished the work, which may be after ``wait()`` returned in the caller)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.callbacks = error, []

    def done(self) -> bool:
        return True

    def value(self) -> None:
        if self.error is not None:
            raise self.error

    def add_done_callback(self, cb) -> None:
        self.callbacks.append(cb)


class _Work:
    def __init__(self, fut: _LateFuture) -> None:
        self.fut = fut

    def get_future(self) -> _LateFuture:
        return self.fut


def test_attached_work_is_settled_when_entries_are_read(tmp_path):
    rec = FlightRecorder(buffer_size=8, rank=0, world_size=1, dump_dir=tmp_path)
    ok, bad = _LateFuture(), _LateFuture(RuntimeError("peer lost"))
    for fut in (ok, bad):
        e = rec.record("all_reduce", "g", [torch.zeros(4)])
        rec.started(e)
        rec.attach(_Work(fut), e)
    # the works finished (wait() returned) but their callbacks have not run: a dump now must
    # not report the ops as still started
    states = [e["state"] for e in rec.snapshot()["entries"]]
    assert states == [COMPLETED, ERRORED], states
    # the late callbacks change nothing and complete nothing twice
    for fut in (ok, bad):
        fut.callbacks[0](fut)
    assert [e["state"] for e in rec.snapshot()["entries"]] == [COMPLETED, ERRORED]
    assert rec.entries()[1][10].startswith("RuntimeError: peer lost")


class _Group:
    __slots__ = ("__weakref__", "group_name")

    def __init__(self, name: str) -> None:
        self.group_name = name


def test_a_group_reusing_a_destroyed_groups_id_is_recorded_under_its_own_name():
    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=1)
    wrapped = fr._wrap("all_reduce", all_reduce, rec)
    g = _Group("old")
    old_id = id(g)
    wrapped(torch.ones(1), group=g)
    del g
    new = None
    for i in range(100):  # the allocator hands the freed object's memory out again
        new = _Group(f"new{i}")
        if id(new) == old_id:
            break
        new = None
    if new is None:
        pytest.skip("no id was reused")
    wrapped(torch.ones(1), group=new)
    got = [(e[fr._GROUP], e[fr._SEQ]) for e in rec.entries()]
    assert got == [("old", 0), (new.group_name, 0)]


def test_the_default_groups_members_are_refreshed_after_a_reinit(monkeypatch):
    """The default group destroyed and re-initialised with another world: its entries and the
    dump's membership name the new world (they kept the first world's ranks)."""
    world = [2]
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world[0])
    monkeypatch.setattr(fr, "_group_names", {})

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    wrapped = fr._wrap("all_reduce", all_reduce, rec)
    destroy = fr._wrap_destroy(lambda group=None: None, rec)
    wrapped(torch.ones(1))
    assert rec.groups["default"] == [0, 1]
    destroy()
    world[0] = 3
    wrapped(torch.ones(1))
    assert rec.groups["default"] == [0, 1, 2]


def test_the_record_does_not_depend_on_how_tensors_are_passed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(fr, "_group_names", {})  # forget this test's default group afterwards

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        return None

    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    wrapped = fr._wrap("all_gather_into_tensor", all_gather_into_tensor, rec)
    g = _Group("g")
    out, inp = torch.ones(4), torch.ones(2, dtype=torch.half)
    wrapped(output_tensor=out, input_tensor=inp, group=g)
    wrapped(out, input_tensor=inp, group=g)
    wrapped(out, inp)
    wrapped(out, inp, g)
    got = [(e["sizes"], e["dtypes"]) for e in rec.snapshot()["entries"]]
    assert got == [([[4], [2]], ["float32", "float16"])] * 4


def test_the_recorded_stack_ends_at_the_ops_call_site(monkeypatch):
    """With TORCHPORT_FR_STACK the stack ended one frame early: the function that issued the
    collective (through an install() wrapper or record()) was never in it."""
    monkeypatch.setattr(fr, "_group_names", {})

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1, record_stack=True)
    wrapped = fr._wrap("all_reduce", all_reduce, rec)

    def train_step() -> None:
        wrapped(torch.ones(1), group=_Group("g"))
        rec.record("broadcast", "g", [torch.ones(1)])

    train_step()
    for e in rec.snapshot()["entries"]:
        assert ", in train_step\n" in e["stack"][-1], e["stack"][-2:]


def test_a_scheduled_op_has_no_start_time_until_started():
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    e = rec.record("all_reduce", "g", [torch.ones(2)])
    (entry,) = rec.snapshot()["entries"]
    assert entry["state"] == "scheduled" and entry["time_started_ns"] is None
    rec.started(e)
    (entry,) = rec.snapshot()["entries"]
    assert entry["time_started_ns"] >= entry["time_scheduled_ns"] > 0


def test_the_watchdog_dumps_for_a_stuck_op_after_clear(tmp_path):
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1, dump_dir=tmp_path)
    rec.start_watchdog(timeout_s=0.05, period_s=0.01)
    try:
        for want in (1, 2):  # the entry after clear() has the same id as the first
            rec.started(rec.record("all_reduce", "g", [torch.ones(1)]))
            assert _await_dumps(rec, want) == want
            rec.clear()
    finally:
        rec.stop()


def test_buffer_size_from_environment(monkeypatch):
    monkeypatch.setenv("TORCHPORT_FR_BUFFER_SIZE", "7")
    assert FlightRecorder().capacity == 7
    monkeypatch.setenv("TORCHPORT_FR_BUFFER_SIZE", "-2")
    with pytest.raises(config.ConfigError, match=r"TORCHPORT_FR_BUFFER_SIZE.*must be >= 0"):
        FlightRecorder()


def test_error_timeout_and_signal_dumps(tmp_path):
    rec = FlightRecorder(rank=3, world_size=4, dump_dir=tmp_path, record_stack=True)
    with pytest.raises(RuntimeError, match="boom"), rec.op("broadcast", "default", [torch.ones(2)]):
        raise RuntimeError("boom")
    d = json.loads((tmp_path / "rank_3.json").read_text())
    assert d["entries"][-1]["state"] == ERRORED and "boom" in d["entries"][-1]["error"]
    assert d["entries"][-1]["stack"] and "error in broadcast #0" in d["reason"]
    # timeout: an op left incomplete is dumped by the watchdog
    rec.record("all_gather", "default", [torch.ones(3)])
    rec.start_watchdog(timeout_s=0.1, period_s=0.02)
    deadline = time.monotonic() + 5
    while "timeout" not in json.loads((tmp_path / "rank_3.json").read_text())["reason"]:
        assert time.monotonic() < deadline, "watchdog did not dump"
        time.sleep(0.02)
    rec.stop()
    # signal: SIGUSR1 dumps within 1 s, from a helper thread
    os.remove(tmp_path / "rank_3.json")
    enable_signal_dump(recorder=rec)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGUSR1)
    while not (tmp_path / "rank_3.json").exists():
        assert time.monotonic() - t0 < 1.0, "signal dump took more than 1 s"
        time.sleep(0.005)
    time.sleep(0.05)
    assert json.loads((tmp_path / "rank_3.json").read_text())["reason"] == "signal SIGUSR1"


def test_signal_dump_closes_its_sockets_at_exit(tmp_path):
    """enable_signal_dump's socket pair lived until interpreter teardown, which reported it
    ('ResourceWarning: unclosed <socket.socket ... family=1>' at the end of every test run);
    the exit hook it registers ends the helper thread and closes both, and a later enable
    works again."""
    rec = FlightRecorder(rank=3, world_size=4, dump_dir=tmp_path)
    enable_signal_dump(recorder=rec)
    r, w = fr._sig_state["sock"]
    thread = fr._sig_state["thread"]
    fr._close_signal_dump()
    assert r.fileno() == -1 and w.fileno() == -1 and not thread.is_alive()
    assert signal.set_wakeup_fd(-1) == -1  # no longer ours
    enable_signal_dump(recorder=rec)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGUSR1)
    while not (tmp_path / "rank_3.json").exists():
        assert time.monotonic() - t0 < 1.0, "signal dump took more than 1 s"
        time.sleep(0.005)


@pytest.fixture(params=["gloo", "torchport"])
def pair(request):
    with Actors(2) as a:
        d = tempfile.mkdtemp()
        args = [(f"{d}/s", i, 2, request.param) for i in range(2)]
        a.call_all([0, 1], "init_dist", args, timeout=120)
        a.backend = request.param
        yield a


@pytest.mark.parametrize("plan", ["hang", "mismatch", "clean"])
def test_analyzer_on_real_dumps(pair, tmp_path, plan, capsys):
    """``install()`` records torch.distributed collectives on gloo and on torchport groups."""
    res = pair.call_all([0, 1], "fr_collectives", [(str(tmp_path), plan)] * 2, timeout=30)
    assert all(s == "ok" for s, _ in res), res
    if plan == "mismatch" and pair.backend == "torchport":  # a real mismatch, typed on both ranks
        assert all(v.startswith("mismatch: mismatched collectives") for _, v in res), res
    v = analyze(load_dumps(tmp_path))
    text = v.text()
    if plan == "hang":
        assert (
            v.never_entered and v.never_entered[0][0] == 1 and v.never_entered[0][3] == "all_reduce"
        )
        assert "rank 1 never entered collective" in text
        assert any(r == 0 for r, *_ in v.stuck)
    elif plan == "mismatch":
        assert v.mismatches and v.mismatches[0][2] == "size"
        assert (
            "size mismatch" in text
            and "all_reduce[4](float32)" in text
            and "all_reduce[8](float32)" in text
        )
    else:
        assert text.startswith("no problem found"), text
        for _, entries in res:  # the group passed by position is the sub-group's, not default
            ops = [(op, group) for op, group, _ in entries]
            assert ops[2][0] == "all_reduce" and ops[2][1] != "default", ops
            assert entries[-1][0] == "all_reduce" and entries[-1][2] == "completed", entries
    assert set(v.last_completed) == {0, 1}
    assert cli.main(["fr", "analyze", str(tmp_path)]) == 0
    assert "last completed op" in capsys.readouterr().out


def test_analyzer_bad_input(tmp_path, capsys):
    with pytest.raises(DumpError, match="must be an existing directory"):
        load_dumps(tmp_path / "nope")
    with pytest.raises(DumpError, match="no Flight Recorder dumps"):
        load_dumps(tmp_path)
    (tmp_path / "rank_0.json").write_text("{not json")
    with pytest.raises(DumpError, match="cannot read Flight Recorder dump"):
        load_dumps(tmp_path)
    (tmp_path / "rank_0.json").write_text('{"a": 1}')
    with pytest.raises(DumpError, match="is not a Flight Recorder dump"):
        load_dumps(tmp_path)
    assert cli.main(["fr", "analyze", str(tmp_path)]) == 2
    # a missing rank is named
    rec = FlightRecorder(rank=0, world_size=2, dump_dir=tmp_path)
    rec.completed(rec.record("all_reduce", "default", [torch.ones(1)]))
    rec.dump()
    v = analyze(load_dumps(tmp_path))
    assert v.missing_ranks == [1] and "rank 1: no dump" in v.text()


def test_analyzer_rejects_dumps_it_cannot_line_up(tmp_path, capsys):
    def dump(name: str, obj: dict) -> None:
        (tmp_path / name).write_text(json.dumps(obj))

    entry = {"seq_id": 0, "op": "all_reduce", "group": "default", "state": "started"}
    dump("rank_0.json", {"rank": "zero", "world_size": 1, "entries": []})
    with pytest.raises(DumpError, match="rank must be an int >= 0, got 'zero'"):
        load_dumps(tmp_path)
    dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [{"op": "all_reduce"}]})
    with pytest.raises(DumpError, match=r"entry 0 needs keys \('seq_id', 'op', 'group', 'state'\)"):
        load_dumps(tmp_path)
    # a field analyze computes with, of the wrong type: the file, entry and field are named
    # (a string or null seq_id ended in a traceback)
    for field, value in (
        ("seq_id", "7"),
        ("seq_id", None),
        ("seq_id", True),
        ("seq_id", 7.5),
        ("seq_id", -1.0),
        ("seq_id", float("nan")),
        ("group", [1]),
    ):
        dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [{**entry, field: value}]})
        with pytest.raises(DumpError, match=rf"rank_0\.json: entry 0: {field} must be"):
            load_dumps(tmp_path)
    assert cli.main(["fr", "analyze", str(tmp_path)]) == 2
    assert "entry 0: group must be a string" in capsys.readouterr().err
    # the other fields analyze reads ended in a traceback (TypeError, ValueError from the
    # format, AttributeError) instead of naming the file and the field
    for fix, what in (
        ({"world_size": None}, "world_size must be an int >= 1, got None"),
        ({"world_size": "2"}, "world_size must be an int >= 1, got '2'"),
        ({"groups": [1]}, "groups must map group names to lists of ranks, got [1]"),
        ({"entries": [{**entry, "sizes": 4}]}, "entry 0: sizes must be a list of lists"),
        ({"entries": [{**entry, "dtypes": [1]}]}, "entry 0: dtypes must be a list of strings"),
        ({"entries": [{**entry, "duration_ms": "5"}]}, "entry 0: duration_ms must be a number"),
        ({"entries": [{**entry, "peer": "1"}]}, "entry 0: peer must be an int >= -1, got '1'"),
        ({"entries": [{**entry, "incarnation": -1}]}, "entry 0: incarnation must be an int >= 0"),
        ({"entries": [{**entry, "tag": "a"}]}, "entry 0: tag must be an int, got 'a'"),
    ):
        dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [], **fix})
        with pytest.raises(DumpError, match=re.escape(what)):
            load_dumps(tmp_path)
        assert cli.main(["fr", "analyze", str(tmp_path)]) == 2
    # a foreign dump without durations is still analysed
    dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [entry]})
    assert "was still started after 0 ms" in analyze(load_dumps(tmp_path)).text()
    # an integral float seq_id, as other JSON writers may write it, was refused
    dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [{**entry, "seq_id": 7.0}]})
    dumps = load_dumps(tmp_path)
    assert dumps[0]["entries"][0]["seq_id"] == 7 and "#7 " in analyze(dumps).text()
    # ... but an integral float rank, world_size, group rank or size was refused (older code
    # took int(world_size)): every integer field takes them, and refuses non-integral ones
    floats = {"rank": 0.0, "world_size": 1.0, "groups": {"0": [0.0]}}
    sized = {**entry, "seq_id": 7.0, "sizes": [[2.0, 3.0]], "dtypes": ["float32"]}
    dump("rank_0.json", {**floats, "entries": [sized]})
    dumps = load_dumps(tmp_path)
    assert (dumps[0]["rank"], dumps[0]["world_size"], dumps[0]["groups"]) == (0, 1, {"0": [0]})
    assert dumps[0]["entries"][0]["sizes"] == [[2, 3]] and "#7 " in analyze(dumps).text()
    for fix, what in (
        ({"rank": 0.5}, "rank must be an int >= 0, got 0.5"),
        ({"world_size": 1.5}, "world_size must be an int >= 1, got 1.5"),
        ({"groups": {"0": [0.5]}}, "groups must map group names to lists of ranks"),
        ({"entries": [{**sized, "sizes": [[2.5]]}]}, "entry 0: sizes must be a list of lists"),
    ):
        dump("rank_0.json", {**floats, "entries": [sized], **fix})
        with pytest.raises(DumpError, match=re.escape(what)):
            load_dumps(tmp_path)
    dump("rank_0.json", {"rank": 0, "world_size": 1, "entries": [entry]})
    # a stale second dump of rank 0 (sorted after the real one) replaced it: "no problem found"
    dump(
        "rank_0_old.json",
        {"rank": 0, "world_size": 1, "entries": [{**entry, "state": "completed"}]},
    )
    with pytest.raises(
        DumpError, match=r"two dumps of rank 0: .*rank_0\.json and .*rank_0_old\.json"
    ):
        load_dumps(tmp_path)


def test_a_late_callback_after_clear_does_not_complete_a_new_op_at_a_reused_id(tmp_path):
    class W:
        def __init__(self) -> None:
            self.f: torch.futures.Future[None] = torch.futures.Future()

        def get_future(self) -> torch.futures.Future[None]:
            return self.f

    rec = FlightRecorder(16, rank=0, world_size=1, dump_dir=tmp_path)
    for _ in range(50):
        e1 = rec._new("all_reduce", "default", (), (), "started")
        w1 = W()
        rec.attach(w1, e1)
        k1 = id(e1)
        rec.clear()
        del e1
        e2 = rec._new("all_reduce", "default", (), (), "started")
        w2 = W()
        rec.attach(w2, e2)
        if id(e2) == k1:
            w1.f.set_result(None)  # the old op finishes after clear()
            assert e2[5] == "started"  # the new one is not marked completed by it
            w2.f.set_result(None)
            assert e2[5] == COMPLETED
            return
        w1.f.set_result(None)
        w2.f.set_result(None)
        rec.clear()
    pytest.skip("no id was reused")


@pytest.mark.parametrize("plan", ["clean", "hang"])
def test_point_to_point_ops_are_recorded_once_and_a_recv_never_sent_is_named(pair, tmp_path, plan):
    """isend / irecv / batch_isend_irecv left no entry (a job hung in irecv got "no problem
    found"); each p2p op is now one entry, P2POps made before install or used after uninstall
    still work, and the analyzer names the rank waiting for a send that never came."""
    res = pair.call_all([0, 1], "fr_p2p", [(str(tmp_path), plan)] * 2, timeout=30)
    assert all(s == "ok" for s, _ in res), res
    if plan == "clean":
        (_, r0), (_, r1) = res
        # isend #0, the batch's three ops sharing #1 (as torch 2.14 numbers a coalesced
        # batch), send #2, then the all_reduce on its own counter
        assert r0 == [
            ("send", 0, COMPLETED, 1),
            ("send", 1, COMPLETED, 1),
            ("recv", 1, COMPLETED, 1),
            ("send", 1, COMPLETED, 1),
            ("send", 2, COMPLETED, 1),
            ("all_reduce", 0, COMPLETED, None),
        ], r0
        assert [(op, seq) for op, seq, _, _ in r1] == [
            ("recv", 0),
            ("recv", 1),
            ("send", 1),
            ("recv", 1),
            ("recv", 2),
            ("all_reduce", 0),
        ], r1
        assert analyze(load_dumps(tmp_path)).text().startswith("no problem found")
        return
    v = analyze(load_dumps(tmp_path))
    assert v.unmatched_p2p == [(1, "default", 3, "recv", 0)], v.text()
    assert (
        "rank 1 is waiting in recv #3 from rank 0 on group 'default', which rank 0 never sent"
        in (v.text())
    )


def test_a_re_created_group_restarts_its_sequence_ids_on_every_rank(pair, tmp_path):
    """The default group destroyed and re-created while rank 1 restarted: rank 0's ids kept
    counting (3, 4) while rank 1 began at 0, and the analyzer reported rank 1 as never having
    entered collective #1."""
    path = tempfile.mkdtemp() + "/s2"
    res = pair.call_all([0, 1], "fr_restart", [(str(tmp_path), path, pair.backend)] * 2, timeout=30)
    assert all(s == "ok" for s, _ in res), res
    (_, r0), (_, r1) = res
    assert r0[-2:] == [("all_reduce", 0, 1), ("broadcast", 1, 1)], r0
    assert r1 == [("all_reduce", 0, 0), ("broadcast", 1, 0)], r1
    text = analyze(load_dumps(tmp_path)).text()
    assert text.startswith("no problem found"), text


def test_a_subclass_send_calling_its_base_records_the_op_once(monkeypatch):
    """install() wraps the p2p methods of ProcessGroup and of each subclass defining its own;
    a subclass's send that calls its base's is one entry, not two."""
    monkeypatch.setattr(fr, "_group_names", {})

    class Work:
        def get_future(self) -> torch.futures.Future[None]:
            f: torch.futures.Future[None] = torch.futures.Future()
            f.set_result(None)
            return f

    class Base:
        __slots__ = ("__weakref__", "group_name")

        def send(self, tensors, dstRank, tag=0):
            return Work()

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2)
    base_send = fr._wrap_p2p("send", Base.send, rec)

    class Sub(Base):
        __slots__ = ()

        def send(self, tensors, dstRank, tag=0):
            return base_send(self, tensors, dstRank, tag)

    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: [3, 5])
    pg = Sub()
    pg.group_name = "pp"
    fr._wrap_p2p("send", Sub.send, rec)(pg, [torch.ones(2)], 1)
    got = [(e["op"], e["seq_id"], e["peer"], e["state"]) for e in rec.snapshot()["entries"]]
    assert got == [("send", 0, 5, COMPLETED)]  # the peer as a global rank


def test_a_subclass_wrapping_ours_with_functools_wraps_is_patched_again(monkeypatch):
    """install() knows its own wrappers by identity: a ProcessGroup subclass defined while
    installed, whose send carries functools.wraps of our wrapper (and so any attribute ours
    has), is wrapped as any other method (it raised KeyError, leaving a half-install)."""
    import functools

    import torch.distributed as dist

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2)
    monkeypatch.setattr(rec, "start_watchdog", lambda *a, **k: None)
    torch_send = vars(dist.ProcessGroup)["send"]
    try:
        fr.install(rec, signal_dump=False)

        @functools.wraps(dist.ProcessGroup.send)
        def mine(self, tensors, dstRank, tag=0):
            return super(MyPG, self).send(tensors, dstRank, tag)

        class MyPG(dist.ProcessGroup):
            send = mine

        # wrapped at its definition (a class defined while installed), and again by install()
        assert vars(MyPG)["send"] is not mine
        fr.install(rec, signal_dump=False)
        assert vars(MyPG)["send"] is not mine  # wrapped, its own original kept
    finally:
        fr.uninstall()
    assert vars(MyPG)["send"] is mine
    assert vars(dist.ProcessGroup)["send"] is torch_send


def test_sends_and_recvs_are_paired_per_tag(tmp_path):
    """torch pairs a send with a recv per peer and tag: rank 0 sending tag 1 then tag 2 and
    rank 1 receiving tag 2 then tag 1 is correct (paired by order alone it was a size
    mismatch), and a recv of a tag never sent is named."""

    def p2p(seq: int, op: str, peer: int, tag: int, n: int, state: str = "completed") -> dict:
        return {"seq_id": seq, "op": op, "group": "default", "state": state, "peer": peer,
                "tag": tag, "sizes": [[n]], "dtypes": ["float32"]}  # fmt: skip

    for rank, entries in (
        (0, [p2p(0, "send", 1, 1, 4), p2p(1, "send", 1, 2, 8)]),
        (1, [p2p(0, "recv", 0, 2, 8), p2p(1, "recv", 0, 1, 4), p2p(2, "recv", 0, 3, 2, "started")]),
    ):
        (tmp_path / f"rank_{rank}.json").write_text(
            json.dumps({"rank": rank, "world_size": 2, "entries": entries})
        )
    v = analyze(load_dumps(tmp_path))
    assert v.mismatches == [], v.text()
    assert v.unmatched_p2p == [(1, "default", 2, "recv", 0)], v.text()


def test_a_rank_late_to_a_re_created_group_is_named_not_its_peer(monkeypatch, tmp_path):
    """Both ranks destroy and re-create the default group; rank 0 enters its first all_reduce,
    rank 1 has recorded nothing on the new group yet. Rank 1's dump showed only the old
    incarnation, which the analyzer compared with rank 0's new one (rank 0 blamed); the
    destroy now starts the new incarnation, dumped as the rank's current one."""
    monkeypatch.setattr(fr, "_group_names", {})
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: [0, 1])

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    old = _Group("default")
    recs = [FlightRecorder(buffer_size=16, rank=r, world_size=2, dump_dir=tmp_path) for r in (0, 1)]
    for rec in recs:
        fr._group_names.clear()  # (one process plays both ranks)
        for _ in range(3):
            fr._wrap("all_reduce", all_reduce, rec)(torch.ones(2), group=old)
        fr._wrap_destroy(lambda group=None: None, rec)()  # the default: every group
    new = _Group("default")
    fr._seen(new, recs[0])  # rank 0's first op on the new group
    assert "default" not in recs[1].groups  # (the new group's members are not known there)
    e = recs[0]._new("all_reduce", "default", [], [], fr.STARTED)  # rank 0 waits in #0
    assert e[fr._INC] == 1 and recs[0].incarnations() == recs[1].incarnations() == {"default": 1}
    for rec in recs:
        rec.dump()
    v = analyze(load_dumps(tmp_path))
    assert v.never_entered == [(1, "default", 0, "all_reduce")], v.text()
    # a dump without the field (older) is still read: each rank's newest entries
    snap = json.loads((tmp_path / "rank_1.json").read_text())
    del snap["incarnations"]
    (tmp_path / "rank_1.json").write_text(json.dumps(snap))
    assert analyze(load_dumps(tmp_path)).never_entered[0][:2] == (0, "default")
    snap["incarnations"] = {"default": "1"}  # of another type: refused, naming the field
    (tmp_path / "rank_1.json").write_text(json.dumps(snap))
    with pytest.raises(DumpError, match="incarnations must map group names to ints"):
        load_dumps(tmp_path)


def test_a_receive_from_any_source_does_not_shift_the_pairs(tmp_path):
    """Rank 1 receives rank 0's first message (4 floats) from any source and its second (8) by
    source: correct. Dropping the any-source receive paired the 8-float receive with the
    4-float send (a false size mismatch); receives after one from any source are not paired."""

    def p2p(seq: int, op: str, peer: int, n: int) -> dict:
        return {"seq_id": seq, "op": op, "group": "default", "state": "completed", "peer": peer,
                "tag": 0, "sizes": [[n]], "dtypes": ["float32"]}  # fmt: skip

    for rank, entries in (
        (0, [p2p(0, "send", 1, 4), p2p(1, "send", 1, 8)]),
        (1, [p2p(0, "recv", -1, 4), p2p(1, "recv", 0, 8)]),
    ):
        (tmp_path / f"rank_{rank}.json").write_text(
            json.dumps({"rank": rank, "world_size": 2, "entries": entries})
        )
    v = analyze(load_dumps(tmp_path))
    assert v.mismatches == [] and v.unmatched_p2p == [], v.text()
    assert v.text().startswith("no problem found"), v.text()


class _GlooP2PWork:
    """A gloo send / recv Work: no future, completed only inside wait()."""

    def __init__(self, fail: bool = False) -> None:
        self.done, self.fail = False, fail

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented")

    def wait(self, timeout=None):
        self.done = True
        if self.fail:
            raise RuntimeError("Timed out waiting for recv")
        return True

    def is_completed(self) -> bool:
        return self.done


class _BlockingP2PWork(_GlooP2PWork):
    """A gloo send / recv Work whose wait() blocks until ``release`` is set (a hung p2p op)."""

    def __init__(self, release: Any) -> None:
        super().__init__()
        self.release = release

    def wait(self, timeout=None):
        self.release.wait(5)
        return super().wait(timeout)


def _await_dumps(rec: FlightRecorder, want: int, within: float = 1.5) -> int:
    """The recorder's dump count once it reaches ``want`` or ``within`` seconds pass."""
    end = time.monotonic() + within
    while rec.dumps < want and time.monotonic() < end:
        time.sleep(0.01)
    return rec.dumps


def test_a_work_without_future_is_held_weakly_and_settled_by_wait(tmp_path):
    """A gloo send / recv entry stayed in the recorder with its Work (and tensor) until a dump
    (never without the watchdog: 500 x 1 MiB alive), and its duration was the polling time.
    wait() now completes it at the time it returns (or errors it), a work dropped unwaited
    leaves it 'unknown' (no duration), and no deprecated exception() / is_success() is asked."""
    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2, dump_dir=tmp_path)
    wait = fr._wrap_wait(_GlooP2PWork.wait, rec)
    works = [_GlooP2PWork(), _GlooP2PWork(fail=True), _GlooP2PWork(), _GlooP2PWork()]
    es = [rec._new("send", "g", [], [], fr.STARTED, "p2p", 1) for _ in works]
    for w, e in zip(works, es, strict=True):
        assert rec.attach(w, e) is w
    assert wait(works[0]) is True
    with pytest.raises(RuntimeError, match="Timed out"):
        wait(works[1])
    held = works[2]  # held, never waited: started
    del w
    works.clear()  # works[3] dropped, never waited: unknown
    assert list(rec._no_future) == [id(held)]
    got = [(e["state"], e["duration_ms"] is None) for e in rec.snapshot()["entries"]]
    assert got == [(COMPLETED, False), (ERRORED, False), (STARTED, False), (fr.UNKNOWN, True)]
    assert wait(held) and rec.entries()[2][fr._STATE] == COMPLETED and rec._no_future == {}


def test_waiting_on_another_work_leaves_a_pending_p2p_op_alone(monkeypatch, tmp_path):
    """While a gloo send / recv was pending, every other Work's wait() (a collective's) also
    went through the settling step, looked up again and found nothing to settle: only the
    pending ops' works take it now."""
    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2, dump_dir=tmp_path)
    wait = fr._wrap_wait(_GlooP2PWork.wait, rec)
    pending, other = _GlooP2PWork(), _GlooP2PWork()
    rec.attach(pending, rec._new("send", "g", [], [], fr.STARTED, "p2p", 1))
    settled: list[Any] = []
    real = rec._waited
    monkeypatch.setattr(rec, "_waited", lambda w, err: settled.append(w) or real(w, err))
    assert wait(other) is True and settled == []
    assert rec.entries()[0][fr._STATE] == STARTED and rec._waiting == {}
    assert wait(pending) is True and settled == [pending]
    assert rec.entries()[0][fr._STATE] == COMPLETED and rec._no_future == {}


def test_an_op_that_never_settles_does_not_hide_a_later_hang_from_the_watchdog(tmp_path):
    """The watchdog dumped for the first overdue entry only: after a never-waited gloo isend
    was dumped for, a later all_reduce hung for seconds without a dump."""
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1, dump_dir=tmp_path)
    rec.start_watchdog(timeout_s=0.05, period_s=0.01)
    try:
        for want in (1, 2):
            rec.started(rec.record("send" if want == 1 else "all_reduce", "g"))
            assert _await_dumps(rec, want) == want
        assert "all_reduce" in json.loads((tmp_path / "rank_0.json").read_text())["reason"]
    finally:
        rec.stop()


def test_a_numpy_integer_peer_and_tag_are_dumped_as_ints(monkeypatch, tmp_path, caplog):
    """torch takes dist.send(t, numpy.int64(1)); the entry kept the numpy int as its peer and
    every later dump of the process failed in json (TypeError). A dump that fails for another
    reason no longer replaces the op's error in completed(): it is logged."""
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(fr, "_group_names", {})
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: [3, 5])

    class Pg:
        __slots__ = ("__weakref__", "group_name")

        def send(self, tensors, dstRank, tag=0):
            return None

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2, dump_dir=tmp_path)
    pg = Pg()
    pg.group_name = "pp"
    fr._wrap_p2p("send", Pg.send, rec)(pg, [torch.ones(2)], np.int64(1), np.int32(7))
    (entry,) = json.loads(rec.dump().read_text())["entries"]
    assert (entry["peer"], entry["tag"]) == (5, 7)

    def broken(reason="request", path=None):
        raise TypeError("not JSON serializable")

    monkeypatch.setattr(rec, "dump", broken)
    e = rec.record("all_reduce", "g")
    rec.completed(e, RuntimeError("the op's own error"))  # no TypeError
    assert e[fr._STATE] == ERRORED and "the op's own error" in e[fr._ERR]
    assert "dump (error in all_reduce #0 on g" in caplog.text and "TypeError" in caplog.text


def test_a_groups_works_without_future_are_asked_for_one_once(monkeypatch):
    """Every gloo send / recv asked its Work for a future, which raised a C++ exception (~8 us
    an op); a group (and device) whose works have none is now asked once."""
    monkeypatch.setattr(fr, "_group_names", {})
    monkeypatch.setattr(fr, "_futureless", {})
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: [0, 1])
    asked = []

    class Work(_GlooP2PWork):
        def get_future(self):
            asked.append(self)
            return super().get_future()

    class Pg:
        __slots__ = ("__weakref__", "group_name")

        def send(self, tensors, dstRank, tag=0):
            return Work()

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2)
    pg = Pg()
    pg.group_name = "pp"
    send, wait = fr._wrap_p2p("send", Pg.send, rec), fr._wrap_wait(Work.wait, rec)
    for _ in range(3):
        wait(send(pg, [torch.ones(2)], 1))
    assert len(asked) == 1
    assert [e[fr._STATE] for e in rec.entries()] == [COMPLETED] * 3


def test_a_rank_left_out_of_a_re_created_group_is_not_expected_in_it(monkeypatch, tmp_path):
    """Group 'sub' of ranks 0-2 destroyed and re-created with ranks 0-1: rank 2's dump kept
    the old members, and the analyzer expected rank 2 in the new group's ops."""
    monkeypatch.setattr(fr, "_group_names", {})
    old, new = _Group("sub"), _Group("sub")
    members = {id(old): [0, 1, 2], id(new): [0, 1]}
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: members[id(g)])
    recs = [
        FlightRecorder(buffer_size=8, rank=r, world_size=3, dump_dir=tmp_path) for r in range(3)
    ]
    for rec in recs:
        fr._group_names.clear()  # (one process plays every rank)
        fr._seen(old, rec)
        rec.completed(rec._new("all_reduce", "sub", [], [], fr.STARTED))
        fr._wrap_destroy(lambda group=None: None, rec)(old)
    for rec in recs[:2]:
        fr._group_names.clear()
        fr._seen(new, rec)
        rec.completed(rec._new("all_reduce", "sub", [], [], fr.STARTED))
    for rec in recs:
        rec.dump()
    v = analyze(load_dumps(tmp_path))
    assert v.text().startswith("no problem found"), v.text()


def test_a_delivered_send_never_waited_on_is_not_reported_stuck(tmp_path):
    """A gloo isend never waited on stays 'started' (its Work completes only inside wait()),
    but rank 1 received it: the analyzer reported it as a stuck send."""
    for rank, op, peer, state in ((0, "send", 1, "started"), (1, "recv", 0, "completed")):
        entry = {"seq_id": 0, "op": op, "group": "default", "state": state, "peer": peer,
                 "tag": 0, "sizes": [[4]], "dtypes": ["float32"]}  # fmt: skip
        (tmp_path / f"rank_{rank}.json").write_text(
            json.dumps({"rank": rank, "world_size": 2, "entries": [entry]})
        )
    v = analyze(load_dumps(tmp_path))
    assert v.stuck == [] and v.text().startswith("no problem found"), v.text()


def test_the_watchdog_ignores_a_gloo_p2p_op_nobody_waits_for(tmp_path):
    """A gloo isend never waited on stays 'started' (its Work completes only inside wait()):
    the watchdog dumped a timeout for it. It now counts such an op only while its wait()
    runs, from the time it began (a send or recv that really hangs)."""
    import threading

    release = threading.Event()

    rec = FlightRecorder(buffer_size=4, rank=0, world_size=2, dump_dir=tmp_path)
    wait = fr._wrap_wait(_BlockingP2PWork.wait, rec)
    rec.start_watchdog(timeout_s=0.2, period_s=0.01)
    try:
        work = _BlockingP2PWork(release)
        rec.attach(work, rec._new("send", "g", [], [], fr.STARTED, "p2p", 1))
        quick = _GlooP2PWork()
        rec.attach(quick, rec._new("send", "g", [], [], fr.STARTED, "p2p", 1))
        time.sleep(0.4)
        assert rec.dumps == 0  # nobody waits: not late
        quick_wait = fr._wrap_wait(lambda w: time.sleep(0.03) or w.wait(), rec)
        quick_wait(quick)
        assert rec.dumps == 0  # waited for 30 ms (< 200) only: not late, though issued 400 ago
        waiter = threading.Thread(target=wait, args=(work,))
        waiter.start()
        assert _await_dumps(rec, 1) == 1  # waited for and incomplete: late
        release.set()
        waiter.join(5)
        assert [e[fr._STATE] for e in rec.entries()] == [COMPLETED, COMPLETED]
    finally:
        release.set()
        rec.stop()


def test_a_p2p_wait_that_hangs_after_a_later_op_was_dumped_for_is_dumped(tmp_path):
    """An irecv, then an all_reduce that runs past the timeout (dumped for), then the irecv's
    wait() hangs: keyed on the highest id dumped for, the recv (a lower id, late only once its
    wait() runs) was never dumped (/tmp/s26/readJ/waitmask.py)."""
    import threading

    release = threading.Event()

    rec = FlightRecorder(buffer_size=8, rank=0, world_size=2, dump_dir=tmp_path)
    wait = fr._wrap_wait(_BlockingP2PWork.wait, rec)
    rec.start_watchdog(timeout_s=0.1, period_s=0.01)
    try:
        work = _BlockingP2PWork(release)
        rec.attach(work, rec._new("recv", "g", [], [], fr.STARTED, "p2p", 1))
        rec.started(rec.record("all_reduce", "g", [torch.ones(1)]))  # never completes
        assert _await_dumps(rec, 1) == 1
        waiter = threading.Thread(target=wait, args=(work,))
        waiter.start()
        assert _await_dumps(rec, 2) == 2, "the hung recv's wait was not dumped"
        assert "recv #" in json.loads((tmp_path / "rank_0.json").read_text())["reason"]
        release.set()
        waiter.join(5)
    finally:
        release.set()
        rec.stop()


def test_destroying_the_world_group_by_name_starts_a_new_incarnation(monkeypatch, tmp_path):
    """destroy_process_group(dist.group.WORLD): torch sets group.WORLD to None as it destroys
    it, and the wrapper, deciding after the call, took it for a subgroup: no new incarnation,
    so a rank late to the re-created group had its peer blamed (/tmp/s26/readJ/lr_world.py)."""
    import types

    world = _Group("default")
    fake = types.SimpleNamespace(group=types.SimpleNamespace(WORLD=world))
    monkeypatch.setattr(fr, "dist", fake)
    monkeypatch.setattr(fr, "_group_names", {})
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=2, dump_dir=tmp_path)
    rec.adopt("default", world)  # seen through group=None calls (cached under id(None))

    def destroy(group=None):
        fake.group.WORLD = None  # as torch does

    fr._wrap_destroy(destroy, rec)(world)
    assert rec.incarnations() == {"default": 1}


# -- dumps in torch's format, read by torch's own analyzer ---------------------------------------


def _torch_fr_trace(folder: Any, *args: str) -> str:
    """torch's Flight Recorder analyzer (``fr_trace``) on ``folder``: its log (it writes to
    stderr), after checking that it ended without a traceback."""
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out
    return out


@pytest.mark.parametrize("plan", ["clean", "mismatch", "hang"])
def test_torchs_analyzer_reads_exported_dumps(pair, tmp_path, plan):
    """A 2-rank run recorded by install(), exported with ``torchport fr export``: torch 2.13's
    analyzer matches every collective of the clean run, names the culprit rank of the size
    mismatch (on torchport both ranks' calls errored) and the rank missing from the hang's
    collective (it could read none of our JSON)."""
    ours, theirs = tmp_path / "ours", tmp_path / "torch"
    res = pair.call_all([0, 1], "fr_collectives", [(str(ours), plan)] * 2, timeout=30)
    assert all(s == "ok" and v != "no error" for s, v in res), res
    assert cli.main(["fr", "export", str(ours), "--to", str(theirs)]) == 0
    assert sorted(p.name for p in theirs.iterdir()) == ["nccl_trace_rank_0", "nccl_trace_rank_1"]
    log = _torch_fr_trace(theirs, "-v")
    if plan == "clean":  # all_reduce, broadcast, all_reduce (sub-group), send, gather, all_reduce
        # (pass_check of each collective: "pass_check=True" without the tabulate package, a
        # table's third column with it)
        checks = re.findall(r"pass_check=(True|False)|^ *\d+ +\S+ +(True|False) ", log, re.M)
        assert [a or b for a, b in checks] == ["True"] * 6, log
        assert "has errors" not in log and "Not all ranks" not in log, log
    elif plan == "mismatch":
        # the culprit is the rank whose file os.walk lists second (the folder's order): either
        assert "Collective sequence number: 3 has errors" in log, log
        m = re.search(
            r"Culprit rank (\d); Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input "
            r"sizes: '(\[\[\d\]\])' does not match found input sizes: '(\[\[\d\]\])'",
            log,
        )
        assert m is not None, log
        assert (m[1], m[2], m[3]) in (("1", "[[4]]", "[[8]]"), ("0", "[[8]]", "[[4]]")), log
    else:
        assert "Not all ranks joining collective, sequence number: 3" in log, log
        assert "missing ranks: {1}" in log, log


@pytest.mark.parametrize("pair", ["gloo"], indirect=True)
def test_torchs_analyzer_matches_a_re_created_groups_ops_across_a_restart(pair, tmp_path):
    """The default group re-created while rank 1 restarted: torch's analyzer matches the new
    group's all_reduce and broadcast on both ranks and reports only the old incarnation's ops,
    which the restarted rank no longer has."""
    path = str(tmp_path / "s2")  # (the file store; a mkdtemp() folder was left behind)
    ours, theirs = tmp_path / "ours", tmp_path / "torch"
    res = pair.call_all([0, 1], "fr_restart", [(str(ours), path, "gloo")] * 2, timeout=30)
    assert all(s == "ok" for s, _ in res), res
    export(ours, theirs)
    log = _torch_fr_trace(theirs)
    assert "group info: 0.0:default_pg" in log and "missing ranks: {1}" in log, log
    assert "group info: 0:default_pg" not in log, log  # (printed for a failed match only)


def test_to_torch_maps_ops_sizes_dtypes_and_states(tmp_path, caplog):
    """Entry by entry: torch's op names, inputs and outputs split as its recorder splits them,
    c10 dtype names, ids from 1, send / recv in group ranks, and states torch knows."""
    rec = FlightRecorder(rank=1, world_size=2, dump_dir=tmp_path, record_stack=True)
    x, b = torch.ones(3, 2), torch.ones(4, dtype=torch.bfloat16)
    rec.groups["default"] = [0, 1]

    def done(op: str, tensors: Any, err: BaseException | None = None) -> None:
        rec.completed(rec.record(op, "default", tensors), err)

    done("all_gather", [[x, x], x])
    done("all_gather_into_tensor", [torch.ones(6, 2), x])
    done("reduce_scatter", [b[:2], [b[:2], b[:2]]])
    done("gather", [x])
    done("barrier", [])
    rec.completed(rec._new("recv", "default", [x.shape], [x.dtype], STARTED, "p2p", 0))
    rec._new("recv", "default", [x.shape], [x.dtype], STARTED, "p2p", -1)  # any source
    done("my_op", [x])  # torch has no such op
    done("my_op", [x])
    done("all_reduce", [x], RuntimeError("peer gone"))
    rec.record("broadcast", "default", [x])  # never started
    snap = rec.snapshot()
    with caplog.at_level("WARNING"):
        d = to_torch(snap, backend="gloo")
    assert "1 entry left out of the torch dump (record ids 6): its peer is not recorded" in (
        caplog.text
    )
    assert "2 entries left out of the torch dump (record ids 7, 8): torch has no op 'my_op'" in (
        caplog.text
    )
    assert d["version"] == "2.10" and d["pg_config"] == {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}
    }
    got = [
        (
            e["profiling_name"],
            e["collective_seq_id"],
            e["p2p_seq_id"],
            e["input_sizes"],
            e["input_dtypes"],
            e["output_sizes"],
            e["state"],
        )
        for e in d["entries"]
    ]
    assert got == [
        ("gloo:all_gather", 1, 0, [[3, 2]], ["Float"], [[2, 3, 2]], "completed"),
        ("gloo:_all_gather_base", 2, 0, [[3, 2]], ["Float"], [[6, 2]], "completed"),
        ("gloo:reduce_scatter", 3, 0, [[2, 2]], ["BFloat16"], [[2]], "completed"),
        ("gloo:gather", 4, 0, [[3, 2]], ["Float"], [], "completed"),
        ("gloo:barrier", 5, 0, [], [], [], "completed"),
        ("gloo:recv 1<-0", 5, 1, [[3, 2]], ["Float"], [[3, 2]], "completed"),
        # (my_op twice, left out, took #6, #7 on the group's counter) errored: torch retires it
        ("gloo:all_reduce", 8, 1, [[3, 2]], ["Float"], [[3, 2]], "completed"),
        ("gloo:broadcast", 9, 1, [[3, 2]], ["Float"], [[3, 2]], "scheduled"),
    ], got
    last = d["entries"][-1]
    assert last["time_discovered_started_ns"] is None and "duration_ms" not in last
    # frames innermost first, as torch captures them (ours are outermost first)
    ours = [re.search(r", in (\S+)", line)[1] for line in snap["entries"][-1]["stack"]]
    names = [f["name"] for f in last["frames"]]
    assert len(ours) > 2 and names == ours[::-1], (names, ours)
    assert isinstance(last["frames"][0]["line"], int)  # (as torch's; it was a string)
    assert [e["op_id"] for e in d["entries"]] == list(range(1, 9))
    assert d["entries"][5]["is_p2p"] and d["entries"][0]["retired"]
    assert d["pg_status"] == {
        "0": {
            "last_enqueued_collective": 9,
            "last_started_collective": 8,
            "last_completed_collective": 8,
        }
    }


def test_a_re_created_groups_newest_incarnation_keeps_torchs_name(tmp_path):
    """The default group re-created: a surviving rank exported its new ops on "0.1" while a
    restarted rank (incarnation 0 there) exported them on "0", so torch's analyzer saw each
    rank missing from the other's group. The newest incarnation is "0" on every rank; older
    ones are "0.<n>"."""
    rec = FlightRecorder(rank=0, world_size=2, dump_dir=tmp_path)
    rec.groups["default"] = [0, 1]
    rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
    world = _Group("0")
    rec.adopt("default", world)
    rec.retire("default")
    rec.groups["default"] = [0, 1]
    rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
    snap = rec.snapshot()
    assert [e["incarnation"] for e in snap["entries"]] == [0, 1]
    d = to_torch(snap)
    assert [e["process_group"] for e in d["entries"]] == [
        ("0.0", "default_pg"),
        ("0", "default_pg"),
    ]
    assert [e["collective_seq_id"] for e in d["entries"]] == [1, 1]
    assert sorted(d["pg_config"]) == ["0", "0.0"]
    del snap["incarnations"]  # (an older dump: the newest among the entries)
    assert [e["process_group"][0] for e in to_torch(snap)["entries"]] == ["0.0", "0"]


def test_a_dump_after_destroying_a_group_keeps_its_name_for_the_last_ops(tmp_path):
    """A rank dumped after destroy_process_group() (which counts the next incarnation) and
    before any op of a new group: its ops were exported on "0.0" while a peer that had not
    destroyed the group exported them on "0", and torch's analyzer reported every op as
    missing a rank (/tmp/s27/readE/destroyed.py). They keep "0" on both."""
    names = []
    for rank in (0, 1):
        rec = FlightRecorder(rank=rank, world_size=2, dump_dir=tmp_path)
        rec.groups["default"] = [0, 1]
        rec.adopt("default", _Group("0"))
        rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
        if rank == 0:
            rec.retire()
            assert rec.incarnations() == {"default": 1}
        d = to_torch(rec.snapshot())
        names.append(([e["process_group"][0] for e in d["entries"]], sorted(d["pg_config"])))
    assert names == [(["0"], ["0"])] * 2


def test_entries_left_out_at_the_start_do_not_misalign_torchs_analyzer(tmp_path):
    """Rank 0 ran two ops on a group whose members were not recorded (left out), then two
    all_reduces with rank 1: its first exported record id was 2, and torch's analyzer, which
    starts every rank at the highest first record id, dropped rank 1's two all_reduces (a
    false "missing ranks": /tmp/s27/readE/align.py). The exported record ids are dense."""
    ids = []
    for rank in (0, 1):
        rec = FlightRecorder(rank=rank, world_size=2, dump_dir=tmp_path)
        rec.groups["default"] = [0, 1]
        if rank == 0:
            for _ in range(2):
                rec.completed(rec.record("all_reduce", "q", [torch.ones(2)]))
        for _ in range(2):
            rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
        ids.append([e["record_id"] for e in to_torch(rec.snapshot())["entries"]])
    assert ids == [[0, 1], [0, 1]]


def test_a_destroyed_groups_ops_are_exported_with_its_members(tmp_path, caplog):
    """A group destroyed before the dump: retire() dropped its members, and its ops were left
    out of the torch dump as of "a group whose members are not recorded" (readE misc.py b).
    The recorder keeps the members of destroyed groups (the newest 256), by incarnation."""
    rec = FlightRecorder(rank=0, world_size=4, dump_dir=tmp_path)
    rec.groups["default"] = [0, 1, 2, 3]
    rec.groups["7"] = [0, 1]
    rec.adopt("7", _Group("7"))
    rec.completed(rec.record("all_reduce", "7", [torch.ones(2)]))
    rec.retire("7")
    rec.groups["7"] = [0, 2]
    rec.adopt("7", _Group("7"))
    rec.completed(rec.record("all_reduce", "7", [torch.ones(2)]))
    snap = rec.snapshot()
    assert snap["retired_groups"] == [["7", 0, [0, 1]]] and snap["groups"]["7"] == [0, 2]
    path = rec.dump()
    with caplog.at_level("WARNING"):
        export(path, tmp_path / "t")
        d = to_torch(json.loads(path.read_text()))
    assert "left out" not in caplog.text
    assert [e["process_group"][0] for e in d["entries"]] == ["7.0", "7"]
    assert d["pg_config"]["7.0"]["ranks"] == "[0, 1]" and d["pg_config"]["7"]["ranks"] == "[0, 2]"
    for i in range(300):  # (bounded)
        rec.groups[f"g{i}"] = [0]
        rec.adopt(f"g{i}", _Group(f"g{i}"))
        rec.retire(f"g{i}")
    old = rec.snapshot()["retired_groups"]
    assert len(old) == 256 and old[-1] == ["g299", 0, [0]]
    from torchport.distributed.fr_analyze import _check_dump

    bad = {"rank": 0, "world_size": 1, "entries": [], "retired_groups": [["g", -1, [0]]]}
    with pytest.raises(DumpError, match=r"retired_groups must be \[name, incarnation, ranks\]"):
        _check_dump(tmp_path, bad)


def test_a_batch_of_p2p_ops_ends_in_torchs_coalesced_entry(tmp_path):
    """The ops of a batch_isend_irecv (sharing a p2p seq id) were exported without the
    ``coalesced`` entry torch's recorder ends a batch with, so torch's analyzer took the next
    op for part of the batch; the entry follows the batch, in its least advanced state."""
    rec = FlightRecorder(rank=0, world_size=2, dump_dir=tmp_path)
    rec.groups["default"] = [0, 1]
    x = torch.ones(2)
    seq = rec.next_seq("default", "p2p")
    rec.completed(rec._new("send", "default", [x.shape], [x.dtype], STARTED, "p2p", 1, seq))
    rec._new("recv", "default", [x.shape], [x.dtype], STARTED, "p2p", 1, seq)  # still running
    rec.completed(rec._new("send", "default", [x.shape], [x.dtype], STARTED, "p2p", 1))
    got = [
        (e["profiling_name"], e["p2p_seq_id"], e["state"], e["input_sizes"])
        for e in to_torch(rec.snapshot())["entries"]
    ]
    assert got == [
        ("nccl:send 0->1", 1, "completed", [[2]]),
        ("nccl:recv 0<-1", 1, "started", [[2]]),
        ("nccl:coalesced", 1, "started", []),
        ("nccl:send 0->1", 2, "completed", [[2]]),
    ], got


def test_overlapping_torch_dumps_of_one_rank_do_not_share_a_temporary_file(tmp_path, monkeypatch):
    """Two dumps of one process (the watchdog's and an error's) wrote the same temporary file
    (named by pid alone): the first os.replace moved both, the second failed (ExportError)."""
    from torchport.distributed import fr_torch

    real, calls = os.replace, []

    def replace(src, dst):  # the other dump runs between this one's write and its replace
        calls.append(src)
        if len(calls) == 1:
            fr_torch.write_torch_dump({"entries": [], "n": 2}, dst)
        real(src, dst)

    monkeypatch.setattr(fr_torch.os, "replace", replace)
    path = tmp_path / "nccl_trace_rank_0"
    fr_torch.write_torch_dump({"entries": [], "n": 1}, path)
    assert len(calls) == 2 and calls[0] != calls[1] and path.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nccl_trace_rank_0"]


def test_a_dumps_temporary_file_is_skipped_by_torchs_loader_and_made_exclusively(
    tmp_path, monkeypatch
):
    """A writer killed between write and rename left ``.nccl_trace_rank_1.<pid>....tmp``,
    which torch's loader read as a dump of rank "1.<pid>...." (ValueError for the whole
    folder: /tmp/s27/readE/misc.py a); and a link planted at the predictable temporary name
    was written through (readE symlink.py). Both formats' dumps share the writer."""
    import itertools
    from argparse import Namespace
    from pathlib import Path

    from torch.distributed.flight_recorder.components.loader import read_dir

    temps = []
    real = os.replace

    def replace(src, dst):
        temps.append(Path(src).name)
        real(src, dst)

    monkeypatch.setattr(fr.os, "replace", replace)
    for rank in (0, 1):
        rec = FlightRecorder(rank=rank, world_size=2, dump_dir=tmp_path)
        rec.groups["default"] = [0, 1]
        rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
        rec.dump(format="torch")
    rec.dump()  # (ours)
    for name in temps:  # as if each writer had been killed before its rename
        (tmp_path / name).write_bytes(b"x")
    details, _ = read_dir(Namespace(trace_dir=str(tmp_path), prefix=None))
    assert sorted(details) == ["nccl_trace_rank_0", "nccl_trace_rank_1"]

    monkeypatch.setattr(fr.time, "time_ns", lambda: 123)
    monkeypatch.setattr(fr, "_tmp_ids", itertools.count())
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / f".~{os.getpid()}.123.0~").symlink_to(victim)
    out = tmp_path / "out"
    fr.write_atomic(out, b"dump")
    assert victim.read_text() == "precious" and not out.is_symlink() and out.read_bytes() == b"dump"


def test_a_dump_in_torchs_format_and_export_errors(tmp_path, capsys):
    """dump(format="torch") writes nccl_trace_rank_<r>; an unknown format, a destination that
    cannot be written and dumps of two jobs are refused with typed errors naming the value."""
    rec = FlightRecorder(rank=0, world_size=2, dump_dir=tmp_path / "ours")
    rec.groups["default"] = [0, 1]
    rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
    p = rec.dump(format="torch")
    assert p == tmp_path / "ours" / "nccl_trace_rank_0" and p.stat().st_size > 0
    with pytest.raises(ValueError, match="format must be 'json' or 'torch', got 'pickle'"):
        rec.dump(format="pickle")
    src = rec.dump()
    blocker = tmp_path / "file"
    blocker.write_text("")
    # an unwritable destination: the OSError, as of our JSON dump (it was an ExportError, a
    # ValueError, of the torch format only: readE misc.py c)
    with pytest.raises(NotADirectoryError, match="export destination must be a folder"):
        export(src, blocker)
    with pytest.raises(OSError, match="file") as err:
        export(src, blocker / "sub")  # (a file where a folder must be)
    assert not isinstance(err.value, ValueError)
    for fmt in ("json", "torch"):
        with pytest.raises(OSError) as err:
            rec.dump(path=blocker / "sub" / "x", format=fmt)
        assert not isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="backend must be one of"):
        export(src, tmp_path / "t", backend="mpi")
    with pytest.raises(ValueError, match="not ending in a digit, got 'rank1'"):
        export(src, tmp_path / "t", prefix="rank1")  # torch reads the rank from the end
    with pytest.raises(DumpError, match="must be an existing file or folder"):
        export(tmp_path / "nope", tmp_path / "t")
    other = json.loads(src.read_text())
    other.update(rank=1, world_size=4)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "rank_1.json").write_text(json.dumps(other))
    with pytest.raises(ExportError, match=r"different jobs: world_size 2 in .* but 4 in"):
        export([src, tmp_path / "b"], tmp_path / "t")
    other.update(world_size=2, groups={"default": [0, 1, 2]})
    (tmp_path / "b" / "rank_1.json").write_text(json.dumps(other))
    with pytest.raises(ExportError, match=r"different jobs: group 'default' has ranks \[0, 1\]"):
        export([src, tmp_path / "b"], tmp_path / "t")
    with pytest.raises(DumpError, match="two dumps of rank 0"):
        export([src, src], tmp_path / "t")
    assert cli.main(["fr", "export", str(src), "--to", str(blocker)]) == 2
    assert "export destination must be a folder" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_export_refuses_a_folder_with_other_ranks_dumps_unless_told_to_overwrite(tmp_path, capsys):
    """An export of 2 ranks into a folder holding a 4-rank job's dumps left ranks 2 and 3
    there, and torch's analyzer read them with the new ones (readE 10). Such a folder is
    refused before anything is written; --overwrite removes them (and only them)."""
    rec = FlightRecorder(rank=0, world_size=2, dump_dir=tmp_path / "ours")
    rec.groups["default"] = [0, 1]
    rec.completed(rec.record("all_reduce", "default", [torch.ones(2)]))
    src = rec.dump()
    dest = tmp_path / "t"
    dest.mkdir()
    for name in ("nccl_trace_rank_0", "nccl_trace_rank_3", "notes.txt"):
        (dest / name).write_bytes(b"old")
    with pytest.raises(ExportError, match=r"holds dumps of other ranks \(nccl_trace_rank_3\)"):
        export(src, dest)
    assert (dest / "nccl_trace_rank_0").read_bytes() == b"old"
    assert cli.main(["fr", "export", str(src), "--to", str(dest)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["fr", "export", str(src), "--to", str(dest), "--overwrite"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["nccl_trace_rank_0", "notes.txt"]
    assert (dest / "nccl_trace_rank_0").read_bytes() != b"old"
    # torch's loader also reads sub-folders and any name containing the prefix (readJ): such
    # files are refused even with --overwrite, which removes only the folder's own <prefix><r>
    for where in ("old/nccl_trace_rank_2", "prev_nccl_trace_rank_3"):
        (dest / where).parent.mkdir(exist_ok=True)
        (dest / where).write_bytes(b"old")
        with pytest.raises(ExportError, match="torch's analyzer would read"):
            export(src, dest, overwrite=True)
        (dest / where).unlink()
