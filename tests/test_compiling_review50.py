"""Traced-or-eager decisions and cached packs, review of session 50.

- torch 2.13's ``torch.compiler.is_compiling()`` reads one process-wide flag that a compile sets
  for its whole duration: while one thread compiled, eager calls on every other thread took
  their traced branch. A spec'd wrapper (``torchport.compile(..., dynamic_shapes=...)``) then
  accepted calls its spec refuses, uncompiled; ``torchport.scaled_mm`` and a fresh FP8 weight's
  ``F.linear`` skipped the E4M3 NaN-code scan (finite outputs where torch gives NaN); an eager
  ``switch`` with a tensor index failed an internal assertion. Those decisions now ask whether
  the calling thread traces (:func:`torchport.native.launch.is_compiling_here`). The tests run
  a real compile on a second thread whose backend waits on an event until the main thread's
  eager checks are done.
- A cached pack of a quantized weight went stale when an inner tensor was replaced rather than
  written in place (``w.scale = w.scale * 2``, ``w.qdata = codes``): it checked the version
  counters of the tensors it was made from only. It now also checks that they are still the
  weight's. A tiny inference-tensor scale (an FP8 tensor-wise scale under
  ``torch.inference_mode()``, which keeps no version counter) is compared by value.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport import DynamicSpecViolation, ShapeVar, TensorSpec
from torchport.control.switch import switch
from torchport.control.while_loop import while_loop
from torchport.gemv.nancodes import nan_rowscale
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor
from torchport.lowp.scaled_mm import scaled_mm_reference
from torchport.native.launch import is_compiling_here

E4M3 = torch.float8_e4m3fn
WAIT_S = 60.0  # bound of every wait on the other thread


@contextmanager
def _another_thread_compiling() -> Iterator[None]:
    """While the body runs, a second thread is inside a real ``torch.compile``: its backend
    holds the compile open until the body is done (bounded waits; the thread is joined)."""
    entered, release = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        entered.set()
        release.wait(WAIT_S)
        return gm.forward

    def compile_there() -> None:
        try:
            torch.compile(lambda y: y * 3 - 1, backend=backend)(torch.randn(3))
        except BaseException as e:  # (reported to the main thread)
            failure.append(e)
            entered.set()

    t = threading.Thread(target=compile_there, name="other-compile", daemon=True)
    t.start()
    try:
        assert entered.wait(WAIT_S), "the other thread's compile never reached its backend"
        assert not failure, failure
        # the premise: torch's flag is set for this thread too, though it traces nothing
        assert torch.compiler.is_compiling()
        assert not is_compiling_here()
        yield
    finally:
        release.set()
        t.join(WAIT_S)
    assert not t.is_alive(), "the other thread's compile did not finish"
    assert not failure, failure


# --- eager calls while another thread compiles -----------------------------------------------------


def test_a_spec_wrapper_checks_calls_while_another_thread_compiles() -> None:
    # the wrapper took its "traced by an outer compile" branch: B = 100 against max 8 ran,
    # uncompiled, without an error
    fn = torchport.compile(
        lambda x: x * 2,
        inner="eager",
        dynamic_shapes={"x": TensorSpec([ShapeVar("B", min=2, max=8)])},
    )
    fn(torch.randn(4))  # (compiled here, before the other thread holds dynamo's compile lock)
    with (
        _another_thread_compiling(),
        pytest.raises(DynamicSpecViolation, match=r"expected 2 <= B <= 8, got B = 100"),
    ):
        fn(torch.randn(100))


def _e4m3_with_nan(n: int, k: int, row: int, col: int) -> torch.Tensor:
    q = torch.randn(n, k).to(E4M3)
    q.view(torch.uint8)[row, col] = 0x7F  # a NaN code
    return q


def test_fp8_nan_codes_are_scanned_while_another_thread_compiles() -> None:
    # the scans were skipped as if traced: scaled_mm's column gave 227.97 and a fresh
    # Float8Tensor's F.linear 960.63 where torch gives NaN
    torch.manual_seed(0)
    k, n = 64, 16
    b = _e4m3_with_nan(n, k, 5, 7).t()
    a = torch.randn(1, k).to(E4M3)
    one = torch.tensor(1.0)
    x = torch.randn(1, k)
    with _another_thread_compiling():
        got = torchport.scaled_mm(a, b, one, one, out_dtype=torch.float32)
        scaled = nan_rowscale(b.t(), torch.ones(n))
        w = Float8Tensor(_e4m3_with_nan(n, k, 5, 7), torch.tensor(1.0), torch.float32)
        lin = F.linear(x, w)
    ref = scaled_mm_reference(a, b, one, one, out_dtype=torch.float32)
    assert ref[0, 5].isnan() and torch.equal(got.isnan(), ref.isnan())
    assert scaled[5].isnan() and scaled.isnan().sum() == 1
    assert lin[0, 5].isnan() and lin.isnan().sum() == 1


def test_an_eager_switch_and_while_loop_run_while_another_thread_compiles() -> None:
    # switch with a tensor index took the traced route eagerly: AssertionError "switch_op
    # traced branch0"
    x = torch.randn(3)
    with _another_thread_compiling():
        out = switch(torch.tensor(1), [lambda t: t + 1, lambda t: t * 2], (x,))
        conds: list[int] = []

        def cond(i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            conds.append(1)
            return i < 3

        loop = while_loop(cond, lambda i, t: (i + 1, t * 2), (torch.tensor(0), x))
    torch.testing.assert_close(out, x * 2)
    assert loop[0].item() == 3 and len(conds) == 4  # (eager: cond run on each trip and the last)
    torch.testing.assert_close(loop[1], x * 8)


# --- the thread-local check still sees this thread's tracing ---------------------------------------


def test_is_compiling_here_is_true_when_this_thread_traces() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if is_compiling_here() else x - 1

    x = torch.zeros(2)
    torch.testing.assert_close(f(x), x - 1)
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(x), x + 1)
    seen: list[bool] = []

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_compiling_here())
            return x + 1

    torch.export.export(M(), (x,), strict=False)  # (non-strict: traced outside dynamo)
    assert seen and all(seen)


def test_non_strict_export_still_inlines_a_spec_wrapper() -> None:
    sf = torchport.compile(
        lambda x: x.sin() * 2,
        inner="eager",
        dynamic_shapes={"x": TensorSpec([ShapeVar("B", min=2, max=8), 4])},
    )

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sf(x) + 1

    x = torch.randn(3, 4)
    ep = torch.export.export(M(), (x,), strict=False)
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert ops == ["aten.sin.default", "aten.mul.Tensor", "aten.add.Tensor"], ops
    torch.testing.assert_close(ep.module()(x), x.sin() * 2 + 1)


# --- cached packs and replaced inner tensors -------------------------------------------------------

_WEIGHTS = {
    "fp8-tensor": lambda w: Float8Tensor.from_float(w, granularity="tensor"),
    "fp8-row": lambda w: Float8Tensor.from_float(w, granularity="row"),
    "nvfp4": lambda w: NVFP4Tensor.from_float(w),
    "mxfp4": lambda w: MXTensor.from_float(w),
}


def _fresh(w: Any) -> Any:
    """A new weight of ``w``'s type from copies of its inner tensors (no pack yet)."""
    names, ctx = w.__tensor_flatten__()
    inner = {n: getattr(w, n).clone() for n in names}
    return type(w).__tensor_unflatten__(inner, ctx, w.shape, w.stride())


def _check(w: Any, x: torch.Tensor) -> None:
    """``F.linear`` with ``w`` gives what a fresh weight of its current parts gives (the same
    kernels: bit-exact) and the dequantized weight's product (FP4 decodes may quantize x)."""
    got = F.linear(x, w)
    assert torch.equal(got, F.linear(x, _fresh(w)))
    tol = 1e-4 if isinstance(w, Float8Tensor) else 0.3
    torch.testing.assert_close(got, F.linear(x, w.dequantize(torch.float32)), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", list(_WEIGHTS))
@pytest.mark.parametrize("part", ["scale", "qdata"])
def test_a_replaced_inner_tensor_is_not_read_from_the_old_pack(kind: str, part: str) -> None:
    # the pack checked the version counters of the tensors it was made from: w.scale =
    # w.scale * 2 gave errors up to 0.64, w.qdata = new codes 1.8 (FP8)
    torch.manual_seed(0)
    n, k = 64, 128
    w = _WEIGHTS[kind](torch.randn(n, k))
    x = torch.randn(1, k)
    for _ in range(3):  # packed, route settled (the __torch_function__ fast path serves)
        _check(w, x)
    other = _WEIGHTS[kind](torch.randn(n, k) * 3)
    setattr(w, part, getattr(other, part).clone())
    _check(w, x)  # (the settled route's path)
    assert w.gemv_pack().n == n  # (gemv_pack's own check: a fresh pack, then served)
    _check(w, x)
    if kind.startswith("fp8") and part == "scale":
        w.scale = w.scale * 2  # the same expression as the finding
        _check(w, x)


def test_an_inference_tensor_scale_written_in_place_is_seen() -> None:
    # an inference tensor keeps no version counter: w.scale.mul_(3) kept the pack's expanded
    # copy of the old scale (errors up to 68.8)
    torch.manual_seed(0)
    n, k = 64, 128
    with torch.inference_mode():
        w = Float8Tensor.from_float(torch.randn(n, k), granularity="tensor")
        x = torch.randn(1, k)
        for _ in range(3):
            _check(w, x)
        w.scale.mul_(3)
        _check(w, x)
        w.scale = w.scale / 5
        _check(w, x)
