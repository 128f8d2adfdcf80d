"""Review 53: reconfigure, elastic formation and windows (in-process groups, each its own mesh)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchport.distributed import (
    CommTimeoutError,
    ReconfigurableGroup,
    ReconfigureError,
    _get_reconfigure_handle,
    _new_window,
    _reconfigure,
)
from torchport.distributed.window import WindowError


def _each(fns: list[Callable[[], Any]], timeout: float = 20.0) -> list[Any]:
    """Run ``fns`` concurrently (one thread each, as the ranks of a collective); each one's
    result or the exception it raised."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    return out


def _form(gs: list[ReconfigurableGroup], uuid: int, order: list[list[str]] | None = None) -> list:
    hs = [g.get_reconfigure_handle() for g in gs]
    orders = order or [hs] * len(gs)
    return _each([lambda g=g, o=o: _reconfigure(uuid, o, g).wait(15) for g, o in zip(gs, orders)])


def _close(gs: list[ReconfigurableGroup]) -> None:
    for g in gs:
        g.close()


@pytest.mark.parametrize("backend", ["torchport", "gloo"])
def test_an_op_in_flight_across_a_reconfigure_leaves_the_new_group_healthy(backend):
    """Rank 0's allreduce on the old communicator (rank 1 never joins it) was still in flight
    when both reconfigured: its failure was recorded on the new membership and aborted the new
    communicator on every rank. It now fails alone, typed, and the new group works."""
    gs = [
        ReconfigurableGroup(backend=backend, heartbeat=0.2, timeout=timedelta(seconds=4))
        for _ in range(2)
    ]
    try:
        assert _form(gs, 1) == [True, True]
        box: dict[str, Any] = {}

        def alone() -> None:
            try:
                gs[0].allreduce(torch.ones(4))
                box["r"] = "returned"
            except BaseException as e:
                box["r"] = e

        th = threading.Thread(target=alone, daemon=True)
        th.start()
        time.sleep(0.2)
        assert _form(gs, 2) == [True, True]
        th.join(15)
        assert not th.is_alive()
        err = box["r"]
        assert isinstance(err, ReconfigureError), err
        assert "allreduce: the group was reconfigured while allreduce was in flight" in str(err)
        time.sleep(0.3)
        assert [g.get_error() for g in gs] == [None, None]
        ts = [torch.full((4,), float(r + 1)) for r in range(2)]
        lone = _each([lambda g=g, t=t: g.allreduce(t) for g, t in zip(gs, ts)])
        assert lone == [None, None] and all(t.tolist() == [3.0] * 4 for t in ts), (lone, ts)
    finally:
        _close(gs)


def test_a_retry_under_the_same_name_ignores_the_failed_attempts_frames():
    """A formation that timed out (member 1 absent) left its OFFER queued at member 1; the
    retry under the same name (a reconfigure retried with its uuid) took it for its own:
    member 1 mapped the old, removed arena and failed, member 0 waited out its timeout. The
    attempt's token tells them apart now."""
    from torchport.distributed._control import default_secret
    from torchport.distributed.elastic import ElasticMesh, form_group

    a, b = ElasticMesh(default_secret()), ElasticMesh(default_secret())
    try:
        lo, hi = sorted((a, b), key=lambda m: m.rank)
        hi.ensure([lo.me], time.monotonic() + 10, lambda: None)
        end = time.monotonic() + 10
        while hi.rank not in lo.peers and time.monotonic() < end:
            time.sleep(0.01)
        members = [a.me, b.me]  # a is member 0 and offers an arena (one host)
        with pytest.raises(CommTimeoutError, match="timed out waiting for a frame"):
            form_group(a, members, "t/retry", 0.3)
        t0 = time.monotonic()
        pgs = _each([lambda m=m: form_group(m, members, "t/retry", 5.0) for m in (a, b)])
        assert all(not isinstance(p, BaseException) for p in pgs), pgs
        assert time.monotonic() - t0 < 4.0
        ts = [torch.full((3,), float(r + 1)) for r in range(2)]
        _each([lambda p=p, t=t: p.allreduce([t]).wait() for p, t in zip(pgs, ts)])
        assert all(t.tolist() == [3.0] * 3 for t in ts), ts
        for p in pgs:
            p.shutdown()
    finally:
        a.close()
        b.close()


def test_handles_in_different_orders_fail_on_every_rank():
    """Rank 2 passed the handles as [h0, h2, h1]: every rank "succeeded", ranks 1 and 2 both
    as rank 1, and the first collective hung for the timeout. Member 0's offer carries a digest
    of its order now: every rank raises ReconfigureError naming the mismatch, at once."""
    gs = [ReconfigurableGroup(heartbeat=0.2, timeout=timedelta(seconds=5)) for _ in range(3)]
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        t0 = time.monotonic()
        res = _form(gs, 1, [hs, hs, [hs[0], hs[2], hs[1]]])
        assert time.monotonic() - t0 < 3.0
        for r in res:
            assert isinstance(r, ReconfigureError), res
            assert "forming the group for uuid 1 failed" in str(r)
            assert "not member" in str(r) and "same order" in str(r), r
        ids = [g._mesh.me.id for g in gs]
        assert f"member {ids[2]} was given the member order {[ids[0], ids[2], ids[1]]}" in str(
            res[0]
        )
        assert f"member {ids[0]} abandoned the formation" in str(res[1])
        # the same handles in one order then form the group
        assert _form(gs, 2) == [True, True, True]
        assert [g.rank() for g in gs] == [0, 1, 2]
    finally:
        _close(gs)


def _windows(gs: list[ReconfigurableGroup], n: int) -> list[Any]:
    ws = _each([lambda g=g: _new_window(torch.zeros(n), group=g, transport="tcp") for g in gs])
    assert all(not isinstance(w, BaseException) for w in ws), ws
    return ws


def test_tensor_deregister_waits_for_this_ranks_async_puts():
    """An async tcp put still queued when ``tensor_deregister`` ran landed in the NEXT
    registration (silently wrong data). Deregister now waits for this rank's async requests
    (their errors are kept for the next fence)."""
    gs = [ReconfigurableGroup(heartbeat=0.2, timeout=timedelta(seconds=5)) for _ in range(2)]
    try:
        _form(gs, 1)
        ws = _windows(gs, 16)
        ws[0].put(torch.ones(1), 1, 0)  # (the queue and connection to rank 1 exist)
        ws[0]._queues[1].submit(time.sleep, 0.5)  # a slow request ahead in the queue
        work = ws[0].put(torch.full((4,), 7.0), 1, 0, async_op=True)
        res = _each([w.tensor_deregister for w in ws])
        assert res == [None, None]
        assert work.is_completed() and work.is_success()  # (it was still queued)
        assert _each([lambda w=w: w.tensor_register(torch.zeros(8)) for w in ws]) == [None] * 2
        assert ws[1].local.tolist() == [0.0] * 8
        assert _each([w.fence for w in ws]) == [None, None]
        _each([w.close for w in ws])
    finally:
        _close(gs)


def test_a_request_that_outlives_its_registration_is_refused():
    """A tcp request carries the registration it was issued for (one that timed out at its
    source and then arrived wrote into the next registration's tensor): refused, typed."""
    gs = [ReconfigurableGroup(heartbeat=0.2, timeout=timedelta(seconds=5)) for _ in range(2)]
    try:
        _form(gs, 1)
        ws = _windows(gs, 16)
        assert _each([w.tensor_deregister for w in ws]) == [None, None]
        assert _each([lambda w=w: w.tensor_register(torch.zeros(8)) for w in ws]) == [None] * 2
        # a request issued for registration 1 reaching registration 2
        with pytest.raises(WindowError, match="issued for registration 1 of this window, but"):
            ws[0]._rpc(1, {"t": "put", "off": 0, "n": 2, "reg": 1, "nb": 8}, torch.full((2,), 5.0))
        assert ws[1].local.tolist() == [0.0] * 8
        ws[0].put(torch.full((2,), 3.0), 1, 6)  # (the connection is dialled again)
        assert _each([w.fence for w in ws]) == [None, None]
        assert ws[1].local.tolist() == [0.0] * 6 + [3.0] * 2
        _each([w.close for w in ws])
    finally:
        _close(gs)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_wait_signal_while_another_thread_closes_the_window(transport):
    """wait_signal raised IndexError (the released counters) when close() ran meanwhile."""
    g = ReconfigurableGroup(timeout=timedelta(seconds=5))
    try:
        _form([g], 1)
        w = _new_window(torch.zeros(4), group=g, transport=transport)
        box: dict[str, Any] = {}

        def waiter() -> None:
            try:
                w.wait_signal(0, timeout=5.0)
            except BaseException as e:
                box["e"] = e

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        time.sleep(0.1)
        w.close()
        th.join(5)
        assert not th.is_alive()
        assert isinstance(box["e"], WindowError), box
        assert "wait_signal: the window was closed (close) while waiting" in str(box["e"])
    finally:
        g.close()


def test_a_closed_group_and_an_unhashable_handle_raise_reconfigure_error():
    """After close(): _reconfigure raised the pool's bare RuntimeError, a collective and
    _new_window said "no communicator yet; call _reconfigure first", and the handle was still
    given out. A list among the handles raised a bare TypeError (unhashable)."""
    g = ReconfigurableGroup(timeout=timedelta(seconds=5))
    h = _get_reconfigure_handle(g)
    with pytest.raises(ReconfigureError, match=r"reconfigure handle must look like .* got \['tp1"):
        _reconfigure(1, [[h]], g).wait(10)  # type: ignore[list-item]
    _form([g], 1)
    g.close()
    with pytest.raises(ReconfigureError, match="_reconfigure: the group was closed"):
        _reconfigure(2, [h], g).wait(10)
    with pytest.raises(ReconfigureError, match="_get_reconfigure_handle: the group was closed"):
        _get_reconfigure_handle(g)
    with pytest.raises(ReconfigureError, match="allreduce: the group was closed"):
        g.allreduce(torch.ones(2))
    with pytest.raises(ReconfigureError, match="_new_window: the group was closed"):
        _new_window(torch.zeros(2), group=g)


def test_split_group_of_a_group_c10d_does_not_know_is_a_typed_error():
    """A ReconfigurableGroup's communicator as the parent: a bare KeyError from c10d's rank
    table (session 53)."""
    from torchport.distributed import CollectiveArgumentError, split_group

    g = ReconfigurableGroup(timeout=timedelta(seconds=5))
    try:
        _form([g], 1)
        with pytest.raises(CollectiveArgumentError, match="parent group must be one c10d knows"):
            split_group(g.pg, [[0]])
    finally:
        g.close()
