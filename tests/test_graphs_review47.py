"""torchport.graphs: regressions from review 47 (constants made in a capture, float32 sums,
views returned by switch/while, addmm into a strided out=, keep_graph outputs, tolist, replay
during another thread's capture)."""

from __future__ import annotations

import threading

import pytest
import torch

import torchport
from torchport import config
from torchport.graphs import CaptureError, Graph

TIERS = [pytest.param(True, id="native"), pytest.param(False, id="torchscript")]


@pytest.mark.parametrize("native", TIERS)
def test_tensor_made_in_capture_starts_from_its_value_every_replay(native: bool) -> None:
    # torch.tensor(0.0) was read by reference as a static input: its += piled up, 12, 24, 36.
    xs = torch.ones(3, 4)

    def step(xs: torch.Tensor) -> torch.Tensor:
        total = torch.tensor(0.0)
        for row in xs:
            total += row.sum()
        c = torch.tensor([1.0, 2.0, 3.0])
        c.add_(xs[0, :3])
        return total * 1 + c

    g = Graph()
    with config.override(native=native), torch.no_grad(), g:
        out = step(xs)
    assert g.tier == ("native" if native else "torchscript")
    for _ in range(3):
        g.replay()
        torch.testing.assert_close(out, step(xs))
    xs.fill_(2.0)
    g.replay()
    torch.testing.assert_close(out, step(xs))


def test_native_float32_sum_and_mean_of_many_elements() -> None:
    # A float32 running total stops growing at 2**24: sum of 2**25 ones gave 2**24, mean 0.5.
    x = torch.ones(1 << 25)
    r = torch.rand(1 << 22, generator=torch.Generator().manual_seed(0))
    g = Graph()
    with torch.no_grad(), g:
        s, m, sr, mr = x.sum(), x.mean(), r.sum(), r.mean(dim=0)
    assert g.tier == "native"
    x.fill_(0.5)
    g.replay()
    assert s.item() == float(1 << 24) and m.item() == 0.5
    # the float64 sum rounded once: within ATen's float32 rounding of it
    torch.testing.assert_close(sr, r.double().sum().float(), rtol=1e-7, atol=0)
    torch.testing.assert_close(sr, r.sum(), rtol=2e-7, atol=0)
    torch.testing.assert_close(mr, r.mean(), rtol=2e-7, atol=0)


def test_torchscript_switch_returning_a_view_of_its_operand_copies_it() -> None:
    # The branch's a[0:2] stayed a view of x at replay: x.mul_(10) reached the output.
    def f(k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = torchport.switch(k, [lambda a: a[0:2], lambda a: a[1:3]], (x,))
        x.mul_(10)
        return s + 1

    k, x = torch.tensor(0), torch.tensor([1.0, 2.0, 3.0])
    g = Graph()
    with config.override(native=False), torch.no_grad(), g:
        y = f(k, x)
    assert g.tier == "torchscript"
    for idx in (0, 1):
        k.fill_(idx)
        x.copy_(torch.tensor([1.0, 2.0, 3.0]))
        g.replay()
        torch.testing.assert_close(y, f(torch.tensor(idx), torch.tensor([1.0, 2.0, 3.0])))


def test_torchscript_while_body_returning_a_view_of_an_outer_tensor_copies_it() -> None:
    def f(n: torch.Tensor, cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _, y = torchport.while_loop(
            lambda i, y: i < n, lambda i, y: (i + 1, cache[1:3]), (torch.tensor(0), x)
        )
        cache.mul_(10)
        return y + 1

    n, cache, x = torch.tensor(2), torch.tensor([1.0, 2.0, 3.0]), torch.zeros(2)
    g = Graph()
    with config.override(native=False), torch.no_grad(), g:
        out = f(n, cache, x)
    assert g.tier == "torchscript"
    cache.copy_(torch.tensor([1.0, 2.0, 3.0]))
    g.replay()
    torch.testing.assert_close(out, torch.tensor([3.0, 4.0]))


def test_native_addmm_into_a_strided_out_adds_the_bias_once() -> None:
    # The product went to scratch with the bias added by the GEMM epilogue, then again.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(3, 5, generator=gen)
    bias = torch.full((5,), 100.0)
    out = torch.empty(5, 4).t()
    g = Graph()
    with torch.no_grad(), g:
        torch.addmm(bias, a, b, out=out)
    assert g.tier == "native"
    a.copy_(torch.randn(4, 3, generator=gen))
    g.replay()
    torch.testing.assert_close(out, torch.addmm(bias, a, b))


def test_keep_graph_outputs_stay_where_views_taken_before_the_first_replay_look() -> None:
    # The first replay moved the output into the pool with set_: y's view and array kept zeros.
    x = torch.zeros(4)
    g = Graph(keep_graph=True)
    with config.override(native=False), torch.no_grad(), g:
        y = torch.log1p(x)
    yv, arr = y.view(2, 2), y.numpy()
    x.copy_(torch.arange(4.0))
    g.replay()
    assert g.tier == "torchscript"
    want = torch.arange(4.0).log1p()
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(yv.reshape(-1), want)
    torch.testing.assert_close(torch.from_numpy(arr.copy()), want)


@pytest.mark.parametrize("mode", ["default", "global", "thread_local"])
def test_tolist_is_refused_while_capturing(mode: str) -> None:
    x = torch.tensor([1.0, -1.0])
    g = Graph(capture_error_mode=mode)  # type: ignore[arg-type]
    with (
        pytest.raises(CaptureError, match=r"Tensor.tolist\(\) returns Python values"),
        torch.no_grad(),
        g,
    ):
        _ = x.tolist()
    assert x.tolist() == [1.0, -1.0]  # outside a capture: untouched
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist


def test_tolist_in_relaxed_mode_freezes_the_value() -> None:
    x = torch.tensor([1.0, -1.0])
    g = Graph(capture_error_mode="relaxed")
    with torch.no_grad(), g:
        y = x * 2 if x.tolist()[0] > 0 else x * 3
    x.copy_(torch.tensor([-1.0, 5.0]))
    g.replay()
    torch.testing.assert_close(y, torch.tensor([-2.0, 10.0]))


def test_torchscript_replay_with_switch_during_another_threads_global_capture() -> None:
    # The program's int(index) hit the global ban meant for Python reads: untyped RuntimeError.
    k, x = torch.tensor(1), torch.randn(4)
    gb = Graph()
    with config.override(native=False), torch.no_grad(), gb:
        y = torchport.switch(k, [torch.sin, torch.cos], (x,))
    assert gb.tier == "torchscript"
    started, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def capture() -> None:
        try:
            ga = Graph()  # capture_error_mode "default": "global"
            with torch.no_grad(), ga:
                _ = torch.relu(torch.ones(3))
                started.set()
                done.wait(30)
        except BaseException as e:  # reported below
            errors.append(e)
            started.set()

    t = threading.Thread(target=capture, daemon=True)
    t.start()
    try:
        assert started.wait(30)
        x.copy_(torch.randn(4))
        gb.replay()
    finally:
        done.set()
        t.join(30)
    assert not t.is_alive() and not errors
    torch.testing.assert_close(y, x.cos())  # (reading values here was banned during the capture)
