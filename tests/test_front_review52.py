"""Review 52: complex compilation of in-place writes through views, and captured ``switch``
branches that write to tensors they did not create.

- A compiled complex function that writes in place through a view (a slice, a transpose, the
  diagonal, a select, a chain of views, ``unfold``, ``as_strided``) matches eager, forward and
  backward, complex64 and complex128 (the backward of such a write allocates its gradient buffer
  with ``new_empty_strided``, which had no rule; ``unfold`` and ``as_strided_scatter`` had none;
  ``as_strided`` of a view of an intermediate read the wrong elements under Inductor).
- ``switch`` traced by ``make_fx`` with grad enabled refuses a branch that writes to an operand or
  to a tensor from outside it, as ``torch.cond`` (and ``switch`` under ``torch.compile`` and
  ``torch.export``) refuse it, and before the write: no user tensor is changed by the capture.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchport
from torchport.compiler.complex import join_outputs, lower_complex, split_inputs
from torchport.compiler.complex_base import ComplexDecompositionError
from torchport.control import SwitchError, switch


def _slice(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[1:].mul_(2j)
    return y


def _transpose(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.t().copy_(x * 3 + z)
    return y


def _diagonal(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.diagonal().add_(z)
    return y


def _select(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[2].mul_(z)
    return y


def _view_chain(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.view(2, 8)[0].add_(z.repeat(2))
    return y


def _unfold(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.unfold(1, 2, 2).mul_(1 - 2j)
    return y


def _as_strided(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.as_strided((2, 2), (5, 1), 1).add_(1j)
    return y


def _input_slice(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    x[1:].mul_(2j)  # a graph input written through a view (an input mutation)
    return x * 1


_WRITES = [_slice, _transpose, _diagonal, _select, _view_chain, _unfold, _as_strided]
_DTYPES = [torch.complex64, torch.complex128]


def _inputs(dtype: torch.dtype, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, dtype=dtype, generator=g).requires_grad_(grad)
    return x, torch.randn(4, dtype=dtype, generator=g)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("fn", _WRITES, ids=lambda f: f.__name__.strip("_"))
def test_in_place_write_through_a_view_forward_backward_matches_eager(
    fn: Callable[..., torch.Tensor], dtype: torch.dtype
) -> None:
    # the backward graph copies the gradient into new_empty_strided (no rule before: an error)
    x, z = _inputs(dtype, grad=True)
    w = torch.randn(4, 4, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = torchport.compile(fn, inner="eager", batching=False)(x, z)
    torch._dynamo.reset()
    want_out = fn(x, z)
    torch.testing.assert_close(out, want_out)
    (got,) = torch.autograd.grad((out * w).real.sum(), x)
    (want,) = torch.autograd.grad((want_out * w).real.sum(), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [*_WRITES, _input_slice], ids=lambda f: f.__name__.strip("_"))
def test_in_place_write_through_a_view_with_batching_matches_eager(
    fn: Callable[..., torch.Tensor],
) -> None:
    x, z = _inputs(torch.complex64)
    xe = x.clone()
    got = torchport.compile(fn, inner="eager", batching=True)(x, z)
    torch._dynamo.reset()
    torch.testing.assert_close(got, fn(xe, z))
    torch.testing.assert_close(x, xe)  # an input written as eager writes it


@pytest.mark.parametrize("fn", [_slice, _diagonal, _as_strided], ids=lambda f: f.__name__[1:])
def test_in_place_write_through_a_view_inductor_forward_backward(
    fn: Callable[..., torch.Tensor],
) -> None:
    x, z = _inputs(torch.complex64, grad=True)
    out = torch.compile(fn, backend="torchport")(x, z)
    torch._dynamo.reset()
    (got,) = torch.autograd.grad(out.abs().sum(), x)
    want_out = fn(x, z)
    (want,) = torch.autograd.grad(want_out.abs().sum(), x)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(got, want)


def _lowered(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    gm = make_fx(fn)(*args)
    real, in_l, out_l = lower_complex(gm)
    outs = real(*split_inputs(list(args), in_l))
    return join_outputs(list(outs if isinstance(outs, (list, tuple)) else [outs]), out_l)[0]


def test_as_strided_addresses_the_storage_of_the_viewed_intermediate() -> None:
    # as_strided of a slice counts from the start of the storage, not of the slice; Inductor
    # took the slice's offset as a base (the second row of the result's was the third's)
    x, _ = _inputs(torch.complex64)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * 2)[1:].as_strided((2, 2), (4, 1), 2) * 1

    def col(t: torch.Tensor) -> torch.Tensor:  # a column-major intermediate, default offset
        return t.t().exp().as_strided((2, 3), (1, 4)) + 0

    for f in (fn, col):
        torch.testing.assert_close(torchport.compile(f, batching=False)(x), f(x))
        torch._dynamo.reset()
        torch.testing.assert_close(_lowered(f, x), f(x))


def test_as_strided_may_read_the_storage_past_the_view() -> None:
    # the first rows of a fresh tensor: as_strided reads the rest of the storage, which the
    # flattened parts of the root hold
    x, _ = _inputs(torch.complex64)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * 2)[:2].as_strided((2, 2), (4, 1), 8) * 1

    torch.testing.assert_close(_lowered(fn, x), fn(x))


def test_as_strided_of_a_complex_view_of_a_real_storage_is_refused() -> None:
    # its offsets count complex elements of a real storage, which no complex value holds
    r = torch.randn(4, 4, 2)
    with pytest.raises(ComplexDecompositionError, match=r"densely from offset 0.*torch\.float32"):
        _lowered(lambda t: torch.view_as_complex(t * 2).as_strided((2, 2), (4, 1), 2) * 1, r)


# -- switch branches that write, traced ------------------------------------------------------------

_MODES = ["real", "fake", "symbolic", "pre_dispatch"]


def _trace(f: Callable[..., torch.Tensor], mode: str, *args: torch.Tensor) -> object:
    if mode == "pre_dispatch":
        return make_fx(f, pre_dispatch=True)(*args)
    return make_fx(f, tracing_mode=mode)(*args)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("chosen", [0, 1])
def test_make_fx_refuses_a_branch_writing_its_operand_and_writes_nothing(
    mode: str, chosen: int
) -> None:
    def f(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return switch(i, [lambda t: t + 1, lambda t: t[1:].add_(1).sum() + t], (x,))

    x = torch.zeros(3)
    with pytest.raises(SwitchError, match=r"branch1 writes in place .* to operand leaf 0"):
        _trace(f, mode, torch.tensor(chosen), x)
    assert x.eq(0).all(), "the capture wrote the user's operand"


@pytest.mark.parametrize("mode", _MODES)
def test_make_fx_refuses_a_branch_writing_an_outer_tensor_and_writes_nothing(mode: str) -> None:
    outer = torch.zeros(3)

    def write(t: torch.Tensor) -> torch.Tensor:
        torch.add(t, 1, out=outer)
        return t * 2

    def f(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return switch(i, [write, lambda t: t + 1], (x,))

    with pytest.raises(SwitchError, match=r"branch0 writes .* to a tensor from outside"):
        _trace(f, mode, torch.tensor(1), torch.ones(3))
    assert outer.eq(0).all(), "the capture wrote the closed-over tensor"


@pytest.mark.parametrize("mode", _MODES)
def test_make_fx_branches_may_write_what_they_create(mode: str) -> None:
    def fresh(t: torch.Tensor) -> torch.Tensor:
        y = t.clone()
        y[0] = 5.0
        y.mul_(2)
        z = torch.zeros(3)
        torch.add(y, 1, out=z)
        return z

    def f(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return switch(i, [fresh, lambda t: t + 1], (x,))

    x = torch.arange(3.0)
    gm = _trace(f, mode, torch.tensor(0), x)
    for k in (0, 1):
        torch.testing.assert_close(gm(torch.tensor(k), x), [fresh, lambda t: t + 1][k](x))  # type: ignore[operator]
    assert x.tolist() == [0.0, 1.0, 2.0]


def test_capture_under_compile_and_export_refuses_with_grad_and_writes_nothing() -> None:
    # (dynamo speculates the branches on fake tensors, as for torch.cond)
    outer = torch.zeros(3)

    def f(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return switch(i, [lambda t: t + 1, lambda t: outer.add_(1) + t.add_(1)], (x,))

    class M(torch.nn.Module):
        def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return f(i, x)

    x = torch.zeros(3)
    with pytest.raises(torch._dynamo.exc.UncapturedHigherOrderOpError):
        torch.compile(f, fullgraph=True, backend="eager")(torch.tensor(0), x)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.UncapturedHigherOrderOpError):
        torch.export.export(M(), (torch.tensor(0), x))
    torch._dynamo.reset()
    assert x.eq(0).all() and outer.eq(0).all()


def test_make_fx_without_grad_follows_torch_cond() -> None:
    # torch.cond allows branches to write their inputs when grad is disabled (inference), in
    # every capture; so does switch (both trace every branch, so make_fx in real mode runs each
    # branch's write on the real tensor, as torch.cond's does)
    def f(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return switch(i, [lambda t: t + 1, lambda t: t.add_(1) * 2], (x,))

    with torch.no_grad():
        gm = make_fx(f, tracing_mode="fake")(torch.tensor(1), torch.zeros(3))
        x = torch.zeros(3)
        torch.testing.assert_close(gm(torch.tensor(1), x), torch.full((3,), 2.0))
    assert x.eq(1).all()
