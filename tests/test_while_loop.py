"""torchport.while_loop: torch semantics in eager and compile, zero-trip copies, errors."""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport.control import WhileLoopError, while_loop_reference


def _cond(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return i < 5


def _body(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return i + 1, x * 1.5 + i


@pytest.mark.parametrize("start", [-3, 0, 4, 5, 9])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5)], ids=str)
def test_matches_reference(start: int, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    got = torchport.while_loop(_cond, _body, (torch.tensor(start), x))
    want = while_loop_reference(_cond, _body, (torch.tensor(start), x))
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_zero_iterations_returns_copies_not_aliases() -> None:
    i, x = torch.tensor(10), torch.randn(4)
    out = torchport.while_loop(_cond, _body, (i, x))
    assert out[0] is not i and out[1] is not x
    assert out[1].data_ptr() != x.data_ptr()
    torch.testing.assert_close(out[1], x)


def test_int_carried_values_in_eager() -> None:
    out = torchport.while_loop(lambda n, x: n < 4, lambda n, x: (n + 1, x + n), (0, torch.zeros(2)))
    assert out[0] == 4
    torch.testing.assert_close(out[1], torch.full((2,), 6.0))


def test_compile_fullgraph() -> None:
    f = torch.compile(
        lambda i, x: torchport.while_loop(_cond, _body, (i, x)), fullgraph=True, backend="eager"
    )
    for s in (0, 3, 7):
        x = torch.randn(3)
        got = f(torch.tensor(s), x)
        want = while_loop_reference(_cond, _body, (torch.tensor(s), x))
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("mode", ["eager", "compile", "make_fx"])
def test_body_returning_a_bare_tensor_for_one_carried_value(mode: str) -> None:
    # torch accepts it; tuple() of the result split the tensor into its rows under compile.
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torchport.while_loop(lambda t: t.sum() < 6, lambda t: t + 1, (x,))

    if mode == "compile":
        f = torch.compile(f, fullgraph=True, backend="eager")
    elif mode == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        f = make_fx(f)(torch.zeros(3))
    out = f(torch.zeros(3))
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], torch.full((3,), 2.0))


def test_body_returning_a_bare_tensor_for_two_carried_values_is_refused() -> None:
    # tuple() of a (2, 3) tensor made two carried (3,) rows: accepted, silently wrong.
    with pytest.raises(WhileLoopError, match=r"tuple of the 2 carried values.*Tensor\(2, 3\)"):
        torchport.while_loop(
            lambda a, b: a.sum() < 6, lambda a, b: torch.stack([a + 1, b]), (torch.zeros(3),) * 2
        )


@pytest.mark.parametrize(
    ("cond", "body", "carried", "match"),
    [
        (3, _body, (torch.tensor(0), torch.ones(1)), "cond_fn must be callable"),
        (_cond, None, (torch.tensor(0), torch.ones(1)), "body_fn must be callable"),
        (_cond, _body, torch.ones(1), "carried_inputs must be a tuple or list"),
        (_cond, _body, (torch.tensor(0), 1.5), "tensors or ints, got float 1.5"),
        (lambda i, x: 1, _body, (torch.tensor(0), torch.ones(1)), "bool or a one-element bool"),
        (
            _cond,
            lambda i, x: (i + 1, torch.cat([x, x])),
            (torch.tensor(0), torch.ones(2)),
            r"carried tensor 1 must keep shape.*\(2,\).*\(4,\)",
        ),
        (_cond, lambda i, x: (i + 1,), (torch.tensor(0), torch.ones(2)), "carried structure"),
    ],
)
def test_bad_inputs(cond, body, carried, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WhileLoopError, match=match):
        torchport.while_loop(cond, body, carried)
