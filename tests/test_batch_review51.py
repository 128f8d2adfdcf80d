"""Small-kernel batching with grad enabled where a batched linear's result is modified in place:
in the graph (attention's ``q.mul_(scale)``) or by the caller on a returned output.

The rules handed members ``split``/``unbind`` pieces of the batched result: views from a
multi-output op, which autograd forbids to modify in place ("Output 0 of Unbind is a view and is
being modified inplace"). A linear returns a fresh tensor, and so must every member now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import torchport
from torchport import config
from torchport.compiler import TorchportBackend, last_report

SHARED = "parallel linears on one input -> one concatenated GEMM + split"
HEADS = "per-head linears of one shape -> bmm + unbind"
RULE = {"shared": SHARED, "heads": HEADS}


class Attn(nn.Module):
    """Three projections (on one input: ``shared``; on three: ``heads``), q scaled in place."""

    def __init__(self, d: int, rule: str, write: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rule = rule
        self.write = write

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor) -> torch.Tensor:
        if self.rule == "shared":
            xk = xv = xq
        q, k, v = self.q(xq), self.k(xk), self.v(xv)
        self.write(q)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def _scale(q: torch.Tensor) -> None:
    q.mul_(0.5)


def _scale_view(q: torch.Tensor) -> None:
    q[..., :2].mul_(3.0)  # an in-place write on a view of the member's result


def _grads(out: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.square().sum(), list(params))


def _check_against_eager(
    m: nn.Module, fn: Callable[..., torch.Tensor], xs: Sequence[torch.Tensor], rule: str
) -> None:
    want = m(*xs)
    want_g = _grads(want, list(m.parameters()))
    got = fn(*xs)
    got_g = _grads(got, list(m.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.rule_counts.get(RULE[rule]) == 1, rep


@pytest.mark.parametrize("write", [_scale, _scale_view], ids=["member", "view-of-member"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("rule", ["shared", "heads"])
def test_in_graph_inplace_write_on_batched_member_eager_inner(
    rule: str, rows: int, write: Callable[[torch.Tensor], object]
) -> None:
    """With one row the parallel-linear piece was already contiguous, so ``.contiguous()`` kept
    the split view; every per-head piece was an ``unbind`` view."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Attn(8, rule, write)
    xs = [torch.randn(rows, 8) for _ in range(3)]
    backend = TorchportBackend(inner="eager", passes=[], batching=True)
    with config.override(autotune=False):  # the batched form, untimed
        _check_against_eager(m, torch.compile(m, backend=backend, dynamic=False), xs, rule)


@pytest.mark.parametrize(("rule", "rows"), [("heads", 5), ("shared", 1)])
def test_torchport_compile_defaults_attention_with_inplace_scale(
    fresh_cache, rule: str, rows: int
) -> None:
    """``torchport.compile``'s defaults (Inductor, batching): AOTAutograd traced the batched
    graph with autograd on and raised BackendCompilerFailed at the in-place scale."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Attn(8, rule, _scale)
    xs = [torch.randn(rows, 8) for _ in range(3)]
    with config.override(autotune=False):  # the batched form, untimed
        _check_against_eager(m, torchport.compile(m), xs, rule)
    rep = last_report()
    assert rep is not None and rep.inner == "inductor" and rep.batching == "batched"


@pytest.mark.parametrize(("rule", "rows"), [("heads", 3), ("shared", 1), ("shared", 3)])
def test_caller_writes_in_place_to_batched_outputs(rule: str, rows: int) -> None:
    """The eager inner compiler returned the pieces themselves, so the caller's in-place write
    to one raised; each returned output is now a tensor of its own, as a linear's is."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    x, y = torch.randn(rows, 8), torch.randn(rows, 8)

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a(x), b(y if rule == "heads" else x)

    def run(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        p, q = fn(x, y)
        p.mul_(2)
        loss = p.square().sum() + q.square().sum()
        grads = torch.autograd.grad(loss, [a.weight, a.bias, b.weight, b.bias])
        return [p, q, *grads]

    backend = TorchportBackend(inner="eager", passes=[], batching=True)
    with config.override(autotune=False):
        got = run(torch.compile(f, backend=backend, dynamic=False))
    rep = last_report()
    assert rep is not None and rep.rule_counts.get(RULE[rule]) == 1, rep
    for g, w in zip(got, run(f), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got[0]._base is None and got[1]._base is None
