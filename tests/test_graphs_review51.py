"""torchport.graphs: regressions from review 51 (TorchScript-tier addmm decomposed by the
optimising executor, native-tier layout changes after the capture, concurrent first replays of a
keep_graph graph, optimizer steps and record_function blocks, foreach in-place ops, native addmm
at alpha 0, native layer_norm accuracy)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from graph_harness import TIERS, native_graph

from torchport import config
from torchport.graphs import Graph, GraphError

# -- TorchScript tier: replay runs the recorded ops, not the optimiser's rewrite --------------


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("op", ["addmm", "linear"])
def test_torchscript_replay_of_addmm_equals_eager_bit_for_bit(op: str, dtype: torch.dtype) -> None:
    # The optimising executor decomposed addmm into mm + add: bf16 replays were 0.5 off eager.
    torch.manual_seed(0)
    x = torch.randn(16, 64).to(dtype)
    m = torch.randn(64, 32).to(dtype)
    bias = torch.randn(32).to(dtype)

    def f() -> torch.Tensor:
        if op == "addmm":
            return torch.addmm(bias, x, m)
        return F.linear(x, m.t(), bias)

    g = Graph()
    with config.override(native=False), torch.no_grad(), g:
        y = f()
    assert g.tier == "torchscript"
    for _ in range(3):
        x.copy_((torch.randn(16, 64) * 3 + 1).to(dtype))
        g.replay()
        with torch.no_grad():
            assert torch.equal(y, f())


def test_torchscript_replay_restores_this_threads_optimisation_flag() -> None:
    x = torch.randn(3)
    g = Graph()
    with config.override(native=False), g:
        y = x * 2
    assert torch._C._get_graph_executor_optimize()
    g.replay()
    assert torch._C._get_graph_executor_optimize()
    assert torch.equal(y, x * 2)
    with torch.jit.optimized_execution(False):
        g.replay()
        assert not torch._C._get_graph_executor_optimize()
    assert torch._C._get_graph_executor_optimize()


# -- native tier: a layout changed in place since the capture is refused ----------------------

_LAYOUT_CHANGES: dict[str, Callable[[torch.Tensor], Any]] = {
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "resize_shrink": lambda t: t.resize_(2, 2),
    "as_strided_": lambda t: t.as_strided_((4, 4), (1, 4)),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
}


@pytest.mark.parametrize("change", list(_LAYOUT_CHANGES))
def test_native_replay_refuses_a_static_input_whose_layout_changed(change: str) -> None:
    # Only data_ptr() was compared: after w.t_() the replay multiplied by the captured layout
    # (2.9 off eager), after x.resize_ it wrote the old shape, silently.
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    g, _ = native_graph(lambda: x @ w)
    ptr = w.data_ptr()
    _LAYOUT_CHANGES[change](w)
    assert w.data_ptr() == ptr  # same address: only the layout tells
    with pytest.raises(GraphError, match=r"static input e1 has shape .* and strides .* but was "):
        g.replay()


def test_native_replay_refuses_a_transposed_static_output_and_resumes_once_undone() -> None:
    x = torch.randn(2, 3)
    g, y = native_graph(lambda: x.sum(0) + 0 * x[0])
    y.unsqueeze_(1)
    with pytest.raises(GraphError, match=r"static output v\d+ has shape \(3, 1\) .* \(3,\)"):
        g.replay()
    y.squeeze_(1)
    x.copy_(torch.randn(2, 3))
    g.replay()
    torch.testing.assert_close(y, x.sum(0))


def test_native_replay_refuses_a_shrunk_1d_static_input() -> None:
    x = torch.randn(6)
    g, _ = native_graph(lambda: x * 2)
    x.resize_(3)  # same address and strides, 3 elements
    with pytest.raises(GraphError, match=r"static input e0 has shape \(3,\) .* shape \(6,\)"):
        g.replay()


# -- keep_graph: the first replays from two threads -------------------------------------------


def test_keep_graph_first_replays_from_two_threads_compile_once() -> None:
    # _pending was cleared before _program was set: the second thread's first replay raised
    # "nothing captured" while the first was compiling.
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    g = Graph(keep_graph=True)
    with g:
        y = torch.relu(x @ w) * 3 + 1
    rec = g._pending
    assert rec is not None
    finish, compiling, calls = rec.finish, threading.Event(), []

    def slow_finish() -> Any:
        calls.append(1)
        compiling.set()
        time.sleep(0.2)  # the other thread replays meanwhile
        return finish()

    rec.finish = slow_finish  # type: ignore[method-assign]
    results: list[str] = []

    def replay() -> None:
        try:
            g.replay()
            results.append("ok")
        except Exception as e:  # reported below
            results.append(f"{type(e).__name__}: {e}")

    first = threading.Thread(target=replay)
    first.start()
    assert compiling.wait(30)
    second = threading.Thread(target=replay)
    second.start()
    first.join(60)
    second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert results == ["ok", "ok"]
    assert len(calls) == 1
    torch.testing.assert_close(y, torch.relu(x @ w) * 3 + 1)


# -- optimizer steps, record_function, foreach in-place ops ------------------------------------


_OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False
    ),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("native_tier", TIERS)
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_captured_optimizer_step_replays_like_eager_steps(name: str, native_tier: bool) -> None:
    # step() opens a record_function (profiler::_record_function_enter_new): refused as a
    # non-ATen op, so no optimizer step could be captured.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.randn(5, 3)
    q.grad = p.grad.clone()
    opt_p, opt_q = _OPTIMIZERS[name]([p]), _OPTIMIZERS[name]([q])
    opt_p.step()  # warm-up: state made outside the capture
    opt_q.step()
    g = Graph()
    with config.override(native=native_tier), g:
        opt_p.step()
    opt_q.step()
    for _ in range(4):
        grad = torch.randn(5, 3)
        p.grad.copy_(grad)
        q.grad.copy_(grad)
        g.replay()
        opt_q.step()
        assert torch.equal(p, q)


@pytest.mark.parametrize("native_tier", TIERS)
def test_record_function_block_is_captured_and_replayed(native_tier: bool) -> None:
    x = torch.randn(4)
    g = Graph()
    with config.override(native=native_tier), g, torch.profiler.record_function("block"):
        y = x * 2
    x.copy_(torch.randn(4))
    g.replay()
    assert torch.equal(y, x * 2)


def test_torchscript_replay_runs_foreach_in_place_ops() -> None:
    # TorchScript's dead-code elimination dropped _foreach_mul_/_foreach_add_ on a list
    # literal: replays left the tensors unchanged.
    a, b = torch.randn(3), torch.randn(3)
    g = Graph()
    with config.override(native=False), g:
        torch._foreach_mul_([a], 0.5)
        torch._foreach_add_([a, b], [b, a], alpha=2.0)
    assert g.tier == "torchscript"
    a0, b0 = a.clone(), b.clone()
    g.replay()
    want_a = a0 * 0.5 + 2.0 * b0
    assert torch.equal(a, want_a)
    assert torch.equal(b, b0 + 2.0 * want_a)


# -- native addmm at alpha 0 --------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("bias_shape", [(3,), (2, 3)], ids=["row", "full"])
def test_native_addmm_alpha_zero_ignores_the_product(
    beta: float, bias_shape: tuple[int, ...]
) -> None:
    # The GEMM ran: an inf in mat1 made NaN rows where ATen (BLAS) ignores the product.
    c, a, b = torch.randn(bias_shape), torch.randn(2, 4), torch.randn(4, 3)
    g, y = native_graph(lambda: torch.addmm(c, a, b, alpha=0, beta=beta))
    a[0, 0] = float("inf")
    b[1, 2] = float("nan")
    if beta == 0.0:
        c.view(-1)[0] = float("nan")  # ignored at beta 0 as well
    g.replay()
    torch.testing.assert_close(
        y, torch.addmm(c, a, b, alpha=0, beta=beta), rtol=0, atol=0, equal_nan=True
    )
    assert not y.isnan().any()


# -- native layer_norm accuracy -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 64, 768, 4099])
@pytest.mark.parametrize("mean", [0.0, 1e3, 3e4])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_native_layer_norm_is_accurate_for_rows_with_a_large_mean(
    n: int, mean: float, affine: bool
) -> None:
    # A float32 running sum: 0.016 off the float64 result at mean 3e4 (eager: 0.002).
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=gen) + mean
    w = torch.randn(n, generator=gen) if affine else None
    b = torch.randn(n, generator=gen) if affine else None
    g, (y, mu, rstd) = native_graph(lambda: torch.native_layer_norm(x, (n,), w, b, 1e-5))
    x.copy_(torch.randn(4, n, generator=gen) + mean)
    g.replay()
    w64 = w.double() if w is not None else None
    b64 = b.double() if b is not None else None
    y64, mu64, rstd64 = torch.native_layer_norm(x.double(), (n,), w64, b64, 1e-5)
    # one rounding of a result computed in double, plus the affine's float32 multiply-add
    bound = 4 * torch.finfo(torch.float32).eps * max(1.0, y64.abs().max().item())
    assert (y.double() - y64).abs().max().item() <= bound
    torch.testing.assert_close(mu, mu64.float(), rtol=2e-7, atol=0)
    torch.testing.assert_close(rstd, rstd64.float(), rtol=2e-7, atol=0)
