"""torchport.graphs: regressions from review 53 (native replays bump the version counters of the
static inputs they write, ops lowered with their tensors' layouts at the time of the op, one
replay of a native program at a time, keep_graph layout changes before the first replay,
TorchScript replays inside autocast, static input dtype changes, ops reading values internally
under capture_error_mode "global", one_hot's message)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from graph_harness import native_graph

import torchport
from torchport import config
from torchport.graphs import CaptureError, Graph, GraphError

# -- 1. native replays bump the version counters of the static inputs they write --------------


def test_native_replay_bumps_versions_of_written_static_inputs() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    cache = torch.zeros(4, 8)
    x = torch.randn(8)

    def step() -> None:
        opt.step()  # p.add_(grad, alpha=-lr): written in place
        cache[1].copy_(x * 2)  # a view of a static input made in the capture: written
        _ = x + 1  # x is only read

    g, _ = native_graph(step)
    before = [t._version for t in (lin.weight, lin.bias, cache, x)]
    g.replay()
    after = [t._version for t in (lin.weight, lin.bias, cache, x)]
    assert [a > b for a, b in zip(after, before)] == [True, True, True, False]


def test_native_replayed_step_invalidates_a_version_keyed_cache() -> None:
    # What the version counter is for: a value derived from a weight, cached by
    # (data_ptr, _version), is recomputed after a replayed in-place update.
    w = torch.ones(4)
    cached: dict[tuple[int, int], torch.Tensor] = {}

    def doubled() -> torch.Tensor:
        key = (w.data_ptr(), w._version)
        if key not in cached:
            cached[key] = w * 2
        return cached[key]

    g, _ = native_graph(lambda: w.add_(1.0))
    assert doubled().tolist() == [4.0] * 4  # w: 1 -> 2 (the capture ran the op)
    g.replay()
    assert doubled().tolist() == [6.0] * 4  # w: 2 -> 3


# -- 2. each op is lowered with its tensors' layouts at the time of the op --------------------


def _out_resize_grow() -> tuple[torch.Tensor, ...]:
    big = torch.tensor([1.0, 2.0, 100.0, 1000.0])
    x2, a4 = big[:2], torch.tensor([10.0, 20.0, 30.0, 40.0])

    def f() -> tuple[torch.Tensor, ...]:
        y = x2.clone()
        s = y.sum()  # 3: y has 2 elements here
        torch.mul(a4, 2, out=y)  # resizes y to 4 elements (a new storage)
        return y, s

    return f()


def _out_resize_empty() -> tuple[torch.Tensor, ...]:
    a4 = torch.tensor([10.0, 20.0, 30.0, 40.0])
    y = torch.empty(0)
    n = y.sum()  # 0: y is empty here
    torch.mul(a4, 2, out=y)
    return y, n


_ONE = torch.tensor([1.0])
_BIG = torch.ones(1 << 16)


def _out_resize_past_storage() -> tuple[torch.Tensor, ...]:
    y = _ONE.clone()
    s = y.sum()  # 1; lowered at y's final size it read 65536 floats from a 1-float storage
    torch.mul(_BIG, 2, out=y)
    return y, s


@pytest.mark.parametrize(
    "fn",
    [_out_resize_grow, _out_resize_empty, _out_resize_past_storage],
    ids=["grow", "from-empty", "past-storage"],
)
def test_out_resize_inside_the_capture_replays_as_eager(
    fn: Callable[[], tuple[torch.Tensor, ...]],
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
        want = [t.clone() for t in fn()]
        g = Graph()
        with config.override(native=True), g:
            got = fn()
    assert g.tier == "torchscript"  # the native tier saw a layout change and fell back
    for t in got:
        t.fill_(-7.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.replay()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_native_tier_kept_without_layout_changes() -> None:
    x = torch.randn(4, 3)
    g, y = native_graph(lambda: torch.mul(x, 2, out=torch.empty(4, 3)) + 1)
    x.copy_(torch.randn(4, 3))
    g.replay()
    torch.testing.assert_close(y, x * 2 + 1)


# -- 3. one replay of a native program at a time ------------------------------------------------


def test_native_replays_from_two_threads_match_eager() -> None:
    n, x = torch.tensor(200), torch.ones(1024)

    def f() -> tuple[torch.Tensor, ...]:
        return torchport.while_loop(
            lambda i, y: i < n, lambda i, y: (i + 1, y * 0.999 + i), (torch.tensor(0), x)
        )

    with torch.no_grad():
        ref_i, ref_y = f()
    g, (i, y) = native_graph(f)
    # Every replay computes the same values and writes the outputs only once its loop is done,
    # so the outputs hold them whenever a replay returns, whatever another thread replays.
    bad: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def replays() -> None:
        try:
            start.wait(timeout=30)
            for _ in range(1000):
                g.replay()
                bad.append(not (torch.equal(y, ref_y) and int(i) == int(ref_i)))
        except BaseException as e:  # (reported below)
            errors.append(e)

    ts = [threading.Thread(target=replays) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
        assert not t.is_alive()
    assert not errors
    assert len(bad) == 2000 and sum(bad) == 0  # (10-20 bad without the lock)


# -- 4. keep_graph: layout changes between capture_end and the first replay are refused ------


@pytest.mark.parametrize("change", ["t_", "resize_"])
@pytest.mark.parametrize(
    "op",
    [pytest.param(lambda x: x * 2, id="mul"), pytest.param(lambda x: x.cumsum(1), id="cumsum")],
)
def test_keep_graph_refuses_layout_change_before_first_replay(
    change: str, op: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    g = Graph(keep_graph=True)
    with g:
        y = op(x)
    want = y.clone()
    if change == "t_":
        x.t_()
    else:
        x.resize_(1, 3)  # shrinks in place: same address
    with pytest.raises(GraphError, match=r"static input e0 has shape \(\d, \d\).* captured with"):
        g.replay()
    # Restoring the layout makes the graph usable again, as without keep_graph.
    if change == "t_":
        x.t_()
    else:
        x.resize_(2, 3)
    g.replay()
    torch.testing.assert_close(y, want)


# -- 5. TorchScript replays inside autocast replay what was captured ------------------------


def test_torchscript_replay_inside_autocast_is_unchanged() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.nn.functional.linear(x, w).cumsum(-1)  # cumsum: TorchScript tier
    assert g.tier == "torchscript" and y.dtype == torch.float32
    g.replay()
    ref = y.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g.replay()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_torchscript_replay_of_an_autocast_capture_outside_autocast() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    g = Graph()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), g:
        y = torch.nn.functional.linear(x, w).cumsum(-1)
    assert y.dtype == torch.bfloat16
    ref = y.clone()
    g.replay()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


# -- 6. TorchScript tier: a static input whose dtype changed is refused ---------------------


def test_torchscript_refuses_static_input_dtype_change() -> None:
    x = torch.tensor([1.5, 2.5, 3.5])
    g = Graph()
    with config.override(native=False), g:
        z = x * 1e-8 + 1
    assert g.tier == "torchscript" and z.dtype == torch.float32
    x.data = torch.tensor([7, 8, 9])
    with pytest.raises(
        GraphError,
        match=r"static input e0 has dtype torch\.int64 but was captured with torch\.float32",
    ):
        g.replay()


# -- 7. ops reading a value inside their kernel under capture_error_mode "global" ------------


@pytest.mark.parametrize("mode", ["default", "global", "thread_local"])
def test_ops_reading_values_internally_capture_in_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1, 50), -1)
    v = torch.randn(100)
    g = Graph(capture_error_mode=mode)  # type: ignore[arg-type]
    with torch.no_grad(), g:
        tok = torch.multinomial(probs, 1)
        h = torch.histc(v, bins=4)
    v.copy_(torch.randn(100))
    g.replay()
    assert 0 <= int(tok) < 50
    torch.testing.assert_close(h, torch.histc(v, bins=4))


def test_item_still_refused_in_default_mode() -> None:
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(CaptureError, match="returns a Python value"), Graph():
        x.sum().item()


# -- 8. one_hot: the message says why ----------------------------------------------------------


def test_one_hot_refusal_names_one_hot() -> None:
    with pytest.raises(CaptureError, match="one_hot"), Graph():
        torch.nn.functional.one_hot(torch.tensor([1, 0, 3]), 5)
