"""Small-kernel batching under ``torchport.compile``'s defaults (batching on, the decision measured
from an empty choice cache): parallel linears called with grad enabled, and the layout of the
parallel-linear rule's outputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchport
from torchport import config
from torchport.compiler import last_report
from torchport.compiler.batching import batching_runner

CALLS = 12  # autotune_reps=3: 2 untimed + 3 timed calls of each form settle after 10 calls


class QK(nn.Module):
    """Two parallel linears on one input, multiplied (an attention score's q * k)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8, dtype=dtype)
        self.k = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(x) * self.k(x)).abs()


class Views(nn.Module):
    """Parallel linears whose outputs are viewed across the feature dim and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ya, yb = self.a(x), self.b(x)
        b = x.shape[0]
        return ya.view(b, -1) + yb.view(b, -1), ya, yb


@pytest.mark.parametrize(
    ("inner", "dtype"),
    [("inductor", torch.float32), ("eager", torch.complex64)],
    ids=["inductor-float32", "eager-complex64"],
)
def test_parallel_linears_with_grad_match_eager_on_every_call(
    fresh_cache, inner: str, dtype: torch.dtype
) -> None:
    """Both graphs go through AOTAutograd (Inductor; a complex graph under any inner compiler).
    The agreement check ran a backward inside dynamo's backend call, whose lazy backward compile
    raised "Metric(s) {'is_forward'} have already been set" on every call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = QK(dtype)
    x = torch.randn(4, 8, dtype=dtype)
    params = list(m.parameters())
    want = m(x)
    want_g = torch.autograd.grad(want.square().sum(), params)
    fn = torchport.compile(m, inner=inner)
    with config.override(autotune=True, autotune_reps=3):
        for _ in range(CALLS):  # measuring serves the calls from both forms, then the winner
            got = fn(x)
            got_g = torch.autograd.grad(got.square().sum(), params)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for g, w in zip(got_g, want_g, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.batching in ("batched", "unbatched")
    assert set(rep.batching_timings_s) == {"batched", "unbatched"}


def test_batching_runner_check_runs_no_backward() -> None:
    """The check compares forwards only: a backward there runs inside dynamo's compile context
    (here: a backward that raises, as AOTAutograd's lazy backward compile did)."""

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
            return t * 2

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("backward inside the backend call")

    def build(batched: bool) -> Callable[..., torch.Tensor]:
        return NoBackward.apply  # type: ignore[no-any-return]

    x = torch.ones(3, requires_grad=True)
    with config.override(autotune=True, autotune_reps=3), torch.enable_grad():
        fn = batching_runner({"graph": "no-backward"}, build, [x], lambda *a: None)
        torch.testing.assert_close(fn(x), torch.full((3,), 2.0))


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_parallel_linear_outputs_are_contiguous_as_in_eager(fresh_cache, inner: str) -> None:
    """A linear's output is contiguous; the rule's outputs were column slices of one GEMM
    (strides (48, 16, 1) for [2, 3, 8]), so a ``view`` in the graph failed to compile and one on
    a returned output failed on the calls the batched form served."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Views()
    x = torch.randn(2, 3, 8)
    fn = torchport.compile(m, inner=inner, verify=True)
    with config.override(autotune=True, autotune_reps=3), torch.no_grad():
        want = m(x)
        for _ in range(CALLS):
            got = fn(x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                assert g.stride() == w.stride()
                torch.testing.assert_close(g.view(-1), w.view(-1), rtol=1e-5, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.batching in ("batched", "unbatched")
