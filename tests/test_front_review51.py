"""Review 51: front end, control flow and linear algebra leftovers.

- ``make_fx`` of a function that calls a ``torchport.compile``d ``@dynamic_spec`` function
  raised torch's "using FX to symbolically trace a dynamo-optimized function": the wrapper ran
  its compiled function under the trace. It is inlined now, as under an outer compile or export.
- ``switch``: while one thread exported, a ``torch.compile`` on another thread handed the
  switch node to its backend ("torchport_switch is not an OpOverload" from Inductor; the test
  read the process-wide ``is_exporting()``), and an eager switch on another thread took the
  export's pre-dispatch mode (a process-wide slot) for its own tracing ("switch_op traced
  branch0").
- The lane Cholesky reported "not positive definite" for SPD matrices whose largest entry is
  subnormal: it multiplies by the reciprocal of a pivot, which overflows to inf for a subnormal
  one. Such a lane is factored again, scaled by a power of two.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport import DynamicSpecViolation, ShapeVar, TensorSpec, dynamic_spec
from torchport.control import switch_op
from torchport.linalg import kernels

WAIT = 60.0  # seconds: every wait of the two-thread tests is bounded


# -- make_fx through a spec'd compiled function ---------------------------------------------------

_B = ShapeVar("B", max=64)


@dynamic_spec({"x": TensorSpec([_B, None])})
def _inner(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


@pytest.mark.parametrize(
    "how", ["real", "symbolic", "pre_dispatch", "torchport_spec"], ids=lambda s: s
)
def test_make_fx_traces_through_a_spec_compiled_function(how: str) -> None:
    """The spec'd wrapper is inlined into the trace: the graph holds its ops and computes the
    function at other sizes too (symbolic)."""
    compiled = torchport.compile(_inner, inner="eager")

    def outer(x: torch.Tensor) -> torch.Tensor:
        return compiled(x) + 1

    x = torch.randn(4, 3)
    if how == "torchport_spec":
        gm = torchport.make_fx(outer, dynamic_shapes={"x": TensorSpec([_B, None])})(x)
    elif how == "pre_dispatch":
        gm = make_fx(outer, pre_dispatch=True)(x)
    else:
        gm = make_fx(outer, tracing_mode=how)(x)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"aten.sin.default", "aten.add.Tensor"} <= targets, targets
    torch.testing.assert_close(gm(x), x.sin() * 2 + 1)
    if how in ("symbolic", "torchport_spec"):
        y = torch.randn(7, 3)
        torch.testing.assert_close(gm(y), y.sin() * 2 + 1)


def test_an_eager_spec_call_on_another_thread_during_make_fx_is_still_checked() -> None:
    """The trace is recognised per thread: while one thread traces, another thread's eager call
    of the same wrapper still checks its spec."""
    compiled = torchport.compile(_inner, inner="eager")
    inside, release = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def traced(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(WAIT)
        return compiled(x) + 1

    def tracer() -> None:
        try:
            result["gm"] = make_fx(traced)(torch.randn(4, 3))
        except BaseException as e:  # (reported below)
            result["error"] = e

    t = threading.Thread(target=tracer, daemon=True)
    t.start()
    try:
        assert inside.wait(WAIT)
        with pytest.raises(DynamicSpecViolation, match=r"expected 0 <= B <= 64, got B = 65"):
            compiled(torch.randn(65, 3))
    finally:
        release.set()
        t.join(WAIT)
    assert not t.is_alive() and "error" not in result, result


# -- switch while another thread exports ----------------------------------------------------------

_BRANCHES = [lambda x: x + 1, lambda x: x * 2, lambda x: x - 3]


class _HeldExport(torch.nn.Module):
    """A module whose forward, traced by export, waits (once) until ``release`` is set."""

    def __init__(self, inside: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.inside, self.release = inside, release

    def forward(self, i: torch.Tensor, x: torch.Tensor) -> Any:
        if not self.release.is_set():
            self.inside.set()
            self.release.wait(WAIT)
        return torchport.switch(i, _BRANCHES, (x,))


def test_switch_on_one_thread_while_another_exports() -> None:
    """While a non-strict export runs on another thread: an eager switch runs its branch, and an
    Inductor compile gets the switch lowered to the cond tree Inductor lowers (it was handed the
    switch node: "torchport_switch is not an OpOverload"); the export holds one switch node.
    (Inductor, not a backend that runs the FX graph as a module: a module called while another
    thread traces goes through the tracer's process-wide patch of ``Module.__call__``.)"""
    # made before the export starts: torch.compile() called while any thread exports returns
    # the function uncompiled (torch's own process-wide test)
    compiled = torch.compile(lambda i, x: torchport.switch(i, _BRANCHES, (x,)), fullgraph=True)
    i, x = torch.tensor(1), torch.randn(3)
    inside, release = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def exporter() -> None:
        try:
            result["ep"] = torch.export.export(_HeldExport(inside, release), (i, x), strict=False)
        except BaseException as e:  # (reported below)
            result["error"] = e

    t = threading.Thread(target=exporter, daemon=True)
    t.start()
    try:
        assert inside.wait(WAIT)
        assert torch.compiler.is_exporting()  # (the process-wide flag the tests read)
        torch.testing.assert_close(torchport.switch(i, _BRANCHES, (x,)), x * 2)
        with torch.no_grad():
            torch.testing.assert_close(compiled(i, x), x * 2)
            torch.testing.assert_close(compiled(torch.tensor(7), x), x - 3)
    finally:
        release.set()
        t.join(WAIT)
    assert not t.is_alive() and "error" not in result, result
    exported = [n.target for n in result["ep"].graph.nodes if n.op == "call_function"]
    assert exported.count(switch_op) == 1, exported


# -- lane Cholesky of subnormal-scale matrices ----------------------------------------------------


def _spd(b: int, n: int, seed: int) -> torch.Tensor:
    """b SPD float64 matrices of order n, largest entry 1."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(b, n, n, generator=g, dtype=torch.float64)
    a = m @ m.mT + n * torch.eye(n, dtype=torch.float64)
    return a / a.abs().amax((-2, -1), keepdim=True)


_TINY = {torch.float32: (1e-40, 2.0**-140), torch.float64: (1e-310, 2.0**-1040)}


def _rel_err(fac: torch.Tensor, want: torch.Tensor) -> float:
    return float((fac.double() - want).abs().amax() / want.abs().amax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("b", [24, 21])  # (21: a group that does not fill the lanes)
def test_lane_cholesky_of_subnormal_scale_spd_matrices(dtype, n, b) -> None:
    """Every matrix factors (info 0; every full lane group failed before), as close to float64
    LAPACK's factor of the same matrix as the per-matrix kernel comes (a lane that factors
    unscaled computes in subnormal arithmetic as that kernel does; a retried one is scaled)."""
    base = _spd(b, n, seed=n)
    k = 520 if dtype == torch.float64 else 80
    for upper in (False, True):
        for scale in _TINY[dtype]:
            a = (base * scale).to(dtype).contiguous()
            assert a.abs().amax() < torch.finfo(dtype).tiny  # (largest entry subnormal)
            fac, info, bad = kernels.cholesky(a, upper, lanes=True)
            assert bad == 0 and int(info.abs().sum()) == 0, (scale, info.tolist())
            # the reference factors the matrix scaled up by 4^k (exact), scaled back by 2^k
            want = torch.linalg.cholesky(a.double() * 2.0**k * 2.0**k, upper=upper) * 2.0**-k
            one, info1, _ = kernels.cholesky(a, upper, lanes=False, blocked=False)
            assert int(info1.abs().sum()) == 0
            tol = 2e-6 if dtype == torch.float32 else 1e-14
            assert _rel_err(fac, want) <= max(2 * _rel_err(one, want), tol), (upper, scale)
    routed = torchport.linalg.cholesky((base * _TINY[dtype][0]).to(dtype), method="jacobi")
    assert bool(torch.isfinite(routed).all()) and bool((routed.diagonal(0, -2, -1) > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale", ["normal", "subnormal"])
def test_lane_cholesky_still_reports_matrices_that_are_not_positive_definite(dtype, scale):
    """A matrix with a negative pivot at order 3 reports info 3 and a zero factor at either
    scale; its lane neighbours factor."""
    b, n = 24, 5
    a = _spd(b, n, seed=5)
    a[7, 2, 2] = -0.5  # (the leading minor of order 3 is indefinite)
    if scale == "subnormal":
        a = a * _TINY[dtype][0]
    fac, info, bad = kernels.cholesky(a.to(dtype).contiguous(), False, lanes=True)
    want = torch.zeros(b, dtype=torch.int32)
    want[7] = 3
    assert info.tolist() == want.tolist() and bad == 8
    assert int(fac[7].count_nonzero()) == 0 and bool((fac[6].diagonal() > 0).all())
