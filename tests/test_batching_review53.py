"""Review 53: the derived-weights cache of small-kernel batching drops an entry when a source
tensor dies and never holds the batching check's scratch copies; eager ``while_loop`` keeps a
carried int an int."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchport
from torchport import config
from torchport.compiler import batching
from torchport.compiler.batching import BatchedCallable, DerivedInput, batching_runner, derive
from torchport.control import WhileLoopError, while_loop


def _holding(out: torch.Tensor) -> list[tuple[Any, ...]]:
    """The cache keys whose entry holds ``out``."""
    return [k for k, (_, v) in list(batching._CACHE.items()) if v is out]


def test_derived_weights_entry_goes_when_a_source_dies() -> None:
    # the entry held a cat of the weights after the model was deleted (up to 64 entries)
    w1, w2 = torch.randn(2, 3), torch.randn(4, 3)
    d = DerivedInput("w", "cat", (0, 1))
    with torch.no_grad():
        first = derive(d, [w1, w2])
        assert derive(d, [w1, w2]) is first and _holding(first)
    del w1
    assert _holding(first) == []


def test_derived_weights_entry_lives_while_its_sources_do() -> None:
    ws = [torch.randn(3, 5) for _ in range(3)]
    d = DerivedInput("w", "stack", (0, 1, 2))
    with torch.no_grad():
        first = derive(d, ws)
        gc.collect()
        assert derive(d, ws) is first and len(_holding(first)) == 1


def test_batching_check_does_not_cache_its_scratch_copies(fresh_cache, monkeypatch) -> None:
    # the check's copies die when it returns: their cat was never reusable, yet was kept
    monkeypatch.setattr(batching, "_CACHE", {})
    sizes: list[int] = []
    cats: list[torch.Tensor] = []

    def compiled(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wcat: Any) -> Any:
        sizes.append(len(batching._CACHE))
        cats.append(wcat)
        return x @ wcat.t()

    def build(batched: bool) -> Callable[..., Any]:
        if batched:
            return BatchedCallable(compiled, [DerivedInput("w", "cat", (1, 2))])
        return lambda x, w1, w2: torch.cat([x @ w1.t(), x @ w2.t()], -1)

    x, w1, w2 = torch.randn(4, 3), torch.randn(2, 3), torch.randn(5, 3)
    with config.override(autotune=True, autotune_reps=3):
        fn = batching_runner({"graph": "review53-scratch"}, build, [x, w1, w2], lambda *a: None)
    assert sizes == [0] and batching._CACHE == {}  # the check ran, caching nothing
    with torch.no_grad():
        for _ in range(2 * len(batching.ORDER) + 2):
            torch.testing.assert_close(fn(x, w1, w2), x @ torch.cat([w1, w2]).t())
    assert len(batching._CACHE) == 1 and len(cats) >= 2 and cats[-1] is cats[1]  # reused


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q(x), self.k(x), self.v(x)


def _dead_entries() -> int:
    return sum(any(r() is None for r in refs) for refs, _ in list(batching._CACHE.values()))


def test_compiled_model_leaves_no_derived_weights_behind(fresh_cache) -> None:
    torch._dynamo.reset()
    m = QKV()
    fn = torchport.compile(m, inner="eager")
    with torch.no_grad():
        for _ in range(12):  # past the measured decision
            fn(torch.randn(2, 16))
    gc.collect()
    params = {id(p) for p in m.parameters()}
    mine = [k for k, (refs, _) in list(batching._CACHE.items()) if id(refs[0]()) in params]
    assert mine and _dead_entries() == 0  # the live weights' entries, no scratch ones
    del m, fn, params
    torch._dynamo.reset()
    gc.collect()
    assert _dead_entries() == 0 and not any(k in batching._CACHE for k in mine)


# --- while_loop: a carried int stays an int ------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "after"),
    [
        pytest.param(lambda k: k + 0.5, "float 0.5", id="float"),
        pytest.param(lambda k: k >= 0, "bool True", id="computed-bool"),
        pytest.param(lambda k: True, "bool True", id="literal-bool"),
    ],
)
def test_while_loop_refuses_a_carried_int_turned_into(step: Callable[[int], Any], after: str):
    # torch.compile of the call and torch's eager while_loop raise for a float and a bool
    # computed from the carried int; eager torchport returned the float/bool (the tensor
    # counter bounds the loop where a bool k would keep ``k < 3`` true)
    x = torch.zeros(3)
    with pytest.raises(
        WhileLoopError, match=f"carried value 0 must stay an int.*int 0 into {after}"
    ):
        while_loop(lambda k, a: a[0] < 3, lambda k, a: (step(k), a + 1), (0, x))


def test_while_loop_names_the_nested_int_leaf_that_changed_type_on_a_later_trip() -> None:
    def body(a: torch.Tensor, d: dict[str, int]) -> tuple[torch.Tensor, dict[str, int]]:
        n = d["n"]
        return a + 1, {"n": n + 1 if n < 2 else float(n + 1)}

    with pytest.raises(
        WhileLoopError, match=r"carried value 1 must stay an int.*int 2 into float 3.0"
    ):
        while_loop(lambda a, d: d["n"] < 5, body, (torch.zeros(2), {"n": 0}))


def test_while_loop_int_that_stays_an_int() -> None:
    k, a = while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, a + 1), (0, torch.zeros(2)))
    assert type(k) is int and k == 3
    torch.testing.assert_close(a, torch.full((2,), 3.0))
