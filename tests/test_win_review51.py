"""Review 51: RMA window timeouts past ``threading.TIMEOUT_MAX``, and the ``Work`` of
``_reconfigure`` and of async tcp window operations following c10d's ``Work.wait(timeout)``.

Everything runs in this process: one-rank groups (a ``HashStore``), and two reconfigurable
groups of this process for a reconfigure whose second member joins late.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from torchport.distributed.errors import CommTimeoutError
from torchport.distributed.reconfigure import ReconfigurableGroup, Work, _reconfigure
from torchport.distributed.window import Window

# README's finite "forever" for a group (timedelta.max wraps around in c10d): past TIMEOUT_MAX
LONG = datetime.timedelta(days=365000)


@pytest.fixture
def long_group(request: pytest.FixtureRequest) -> Iterator[None]:
    """A one-rank default group (backend ``request.param``) whose timeout is ``LONG``."""
    import torchport.distributed  # noqa: F401 (registers the torchport backend)

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        request.param, store=dist.HashStore(), rank=0, world_size=1, timeout=LONG
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- 1: a tcp window whose timeout is past TIMEOUT_MAX --------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("long_group", "timeout"),
    [
        ("gloo", None),
        ("torchport", None),
        ("gloo", LONG),
        ("gloo", datetime.timedelta.max),
    ],
    ids=["group-gloo", "group-torchport", "window-365000-days", "window-timedelta-max"],
    indirect=["long_group"],
)
def test_a_tcp_window_with_a_timeout_past_timeout_max_serves_requests(long_group, timeout):
    """A window was created with such a timeout (its group's, or its own), then every request
    raised an untyped ``OverflowError: timestamp out of range for platform time_t`` from the
    socket's timeout. Such a timeout means no limit, as for the backend's Work."""
    w = Window(tensor=torch.zeros(6), transport="tcp", timeout=timeout)
    try:
        assert w.timeout_s > threading.TIMEOUT_MAX
        w.put(torch.ones(2), 0, 1)
        w.accumulate(torch.full((2,), 2.0), 0, 2)
        w.signal(0)
        w.wait_signal(0, timeout=10.0)
        work = w.put(torch.full((2,), 5.0), 0, 4, async_op=True)
        assert work is not None and work.wait(LONG)
        w.fence()
        assert w.get(0).tolist() == [0.0, 1.0, 3.0, 2.0, 5.0, 5.0]
    finally:
        w.close()


# -- 2: the Work of _reconfigure and of async tcp window operations -------------------------------
def _later(fut: cf.Future, s: float, value: object = None) -> threading.Timer:
    """Complete ``fut`` with ``value`` after ``s`` seconds (from a timer thread)."""
    t = threading.Timer(s, fut.set_result, (value,))
    t.start()
    return t


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "timeout",
    [
        None,
        datetime.timedelta(0),
        0,
        0.0,
        LONG,
        datetime.timedelta.max,
        1e12,
        threading.TIMEOUT_MAX,
    ],
    ids=["None", "timedelta-0", "int-0", "float-0", "365000-days", "timedelta-max", "1e12", "max"],
)
def test_work_wait_without_limit(timeout):
    """None, zero and a timeout of ``threading.TIMEOUT_MAX`` or more wait until the operation
    is done, as the backend's (and gloo's) Work: zero raised "did not complete within 0.0 s" at
    once, and one past TIMEOUT_MAX an OverflowError from the future's lock."""
    fut: cf.Future = cf.Future()
    timer = _later(fut, 0.2)
    try:
        t0 = time.monotonic()
        assert Work(fut).wait(timeout) is True
        assert time.monotonic() - t0 >= 0.1
    finally:
        timer.cancel()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "timeout", [datetime.timedelta(seconds=-1), -1.0], ids=["timedelta", "float"]
)
def test_work_wait_with_a_negative_timeout_does_not_wait(timeout):
    """A negative timeout raises :class:`CommTimeoutError` at once unless the operation is done
    (it raised "did not complete within -1.0 s", an untyped CommError); the operation keeps
    running, and a done one gives its outcome."""
    fut: cf.Future = cf.Future()
    w = Work(fut)
    t0 = time.monotonic()
    with pytest.raises(
        CommTimeoutError,
        match=r"^operation: wait\(\) with a negative timeout \(-1 s\) timed out at once: the "
        r"operation had not finished$",
    ):
        w.wait(timeout)
    assert time.monotonic() - t0 < 1.0
    fut.set_result(None)
    assert w.wait(timeout) is True
    failed: cf.Future = cf.Future()
    failed.set_exception(ValueError("the operation's own error"))
    with pytest.raises(ValueError, match="the operation's own error"):
        Work(failed).wait(timeout)


@pytest.mark.timeout(30)
def test_work_wait_that_times_out_raises_comm_timeout_error_and_leaves_it_running():
    """A wait that expires raised a plain CommError (not a TimeoutError); now
    :class:`CommTimeoutError` naming the operation and the timeout, and a later wait succeeds."""
    fut: cf.Future = cf.Future()
    w = Work(fut)
    with pytest.raises(CommTimeoutError, match=r"^operation: wait\(\) timed out after 0\.05 s$"):
        w.wait(datetime.timedelta(milliseconds=50))
    assert not w.is_completed()
    timer = _later(fut, 0.05)
    try:
        assert w.wait(5.0) is True and w.is_success()
    finally:
        timer.cancel()
    # the operation's own timeout is raised as is (it is a TimeoutError too)
    own: cf.Future = cf.Future()
    own.set_exception(CommTimeoutError("the operation's own timeout"))
    with pytest.raises(CommTimeoutError, match=r"^the operation's own timeout$"):
        Work(own).wait(1.0)


@pytest.mark.timeout(60)
def test_reconfigure_work_wait_zero_waits_for_a_late_member():
    """``_reconfigure(...)`` while the other member joins 0.5 s later: ``wait(0.05)`` raised a
    plain CommError (now CommTimeoutError, the reconfigure still running), and
    ``wait(timedelta(0))`` raised CommError "did not complete within 0.0 s" at once (gloo's and
    the backend's Work wait without limit); a timeout past TIMEOUT_MAX raised OverflowError."""
    gs = [ReconfigurableGroup(timeout=datetime.timedelta(seconds=20)) for _ in range(2)]
    try:
        hs = [g.get_reconfigure_handle() for g in gs]
        late: list[Work] = []
        timer = threading.Timer(0.5, lambda: late.append(_reconfigure(1, hs, gs[1])))
        timer.start()
        try:
            t0 = time.monotonic()
            work = _reconfigure(1, hs, gs[0])
            with pytest.raises(
                CommTimeoutError, match=r"^reconfigure: wait\(\) timed out after 0\.05 s$"
            ):
                work.wait(0.05)
            assert work.wait(datetime.timedelta(0)) is True
            assert time.monotonic() - t0 >= 0.3
        finally:
            timer.join(10)
        assert late and late[0].wait(LONG) is True
        assert [(g.rank(), g.size()) for g in gs] == [(0, 2), (1, 2)]
    finally:
        for g in gs:
            g.close()
