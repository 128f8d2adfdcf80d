"""torchport.switch / while_loop: review findings (non-tracing dispatch modes, aliasing outputs,
unsigned index dtypes), each pinned by a test that failed before its fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import torchport
from torchport.control import switch_reference, while_loop_reference


class _OpLog(TorchDispatchMode):
    """A dispatch mode that traces nothing: it records the names of the ATen ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_switch_under_flop_counter_runs_the_branch_and_counts_its_flops() -> None:
    """Bug: under FlopCounterMode the switch was served as a HOP by the dense kernel, which never
    traced branch0 (AssertionError "switch_op traced branch0"); now it runs eagerly, as
    torch.cond does, and the chosen branch's matmul is counted."""
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    branches = [lambda a, b: a.sum() + b.sum(), lambda a, b: a @ b]
    with FlopCounterMode(display=False) as counter:
        out = torchport.switch(torch.tensor(1), branches, (a, b))
    torch.testing.assert_close(out, a @ b)
    assert counter.get_total_flops() == 2 * 4 * 5 * 6


def test_switch_under_a_logging_mode_shows_only_the_chosen_branch() -> None:
    """Bug: any active dispatch mode counted as tracing, so a custom mode broke switch; a
    non-tracing mode now sees the ops of the chosen branch, not those of the others."""
    x = torch.randn(4)
    with _OpLog() as log:
        out = torchport.switch(torch.tensor(1), [torch.sin, torch.cos], (x,))
    torch.testing.assert_close(out, torch.cos(x))
    assert "aten::cos" in log.ops and "aten::sin" not in log.ops


@pytest.mark.parametrize("mode", [FlopCounterMode, _OpLog], ids=["flop_counter", "op_log"])
def test_while_loop_under_a_non_tracing_mode_runs_the_loop(mode: Callable[..., Any]) -> None:
    """Bug: under a non-tracing dispatch mode while_loop went to torch's HOP, which the mode
    answered with NotImplemented: the result was silently ``(NotImplemented,)``."""
    kwargs = {"display": False} if mode is FlopCounterMode else {}
    w, x = torch.randn(3, 3), torch.randn(3, 3)

    def cond(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return i < 3

    def body(i: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, y @ w

    with mode(**kwargs) as m:
        got = torchport.while_loop(cond, body, (torch.tensor(0), x))
    want = while_loop_reference(cond, body, (torch.tensor(0), x))
    assert len(got) == 2
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    if mode is FlopCounterMode:
        assert m.get_total_flops() == 3 * 2 * 3 * 3 * 3  # three trips of a 3x3x3 matmul


PASS_THROUGH = {
    "identity": lambda x: x,
    "view": lambda x: x.view(-1),
    "slice": lambda x: x[1:],
    "transpose": lambda x: x.t(),
}


@pytest.mark.parametrize("kind", ["tensor", "int"])
@pytest.mark.parametrize("name", list(PASS_THROUGH))
def test_eager_switch_output_never_aliases_an_operand(kind: str, name: str) -> None:
    """Bug: eager switch returned the operand itself (or a view of it) when the chosen branch
    passed it through, so an in-place op on the result changed the operand; a captured switch
    returns a copy, and torch.cond forbids aliasing outputs."""
    x = torch.ones(2, 3)
    branch = PASS_THROUGH[name]
    index = torch.tensor(0) if kind == "tensor" else 0
    out = torchport.switch(index, [branch, lambda x: x * 3], (x,))
    torch.testing.assert_close(out, branch(torch.ones(2, 3)))
    out.add_(1)
    assert torch.equal(x, torch.ones(2, 3)), "the operand followed an in-place op on the output"


def test_eager_switch_copy_keeps_gradients_and_leaves_fresh_outputs_alone() -> None:
    """Bug guard for the copy of an aliasing output: gradients still reach the operand through
    it, and an output the branch computed is returned as is (no second copy)."""
    x = torch.randn(3, requires_grad=True)
    out = torchport.switch(torch.tensor(0), [lambda x: x, lambda x: x * 2], (x,))
    out.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(3))
    made_at: list[int] = []  # (the address, not the tensor: a tensor kept here is not fresh)

    def make(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        made_at.append(y.data_ptr())
        return y

    assert torchport.switch(torch.tensor(0), [make], (x.detach(),)).data_ptr() == made_at[0]


@pytest.mark.parametrize(
    "body",
    [
        lambda i, y: (i + 1, y),
        lambda i, y: (i + 1, y.view_as(y)),
        lambda i, y: (i + 1, y[:]),
    ],
    ids=["identity", "view_as", "full_slice"],
)
def test_eager_while_loop_output_never_aliases_a_carried_input(
    body: Callable[..., Any],
) -> None:
    """Bug: a body passing a carried tensor through made the eager while_loop return the
    input itself (``y2 is y``; only zero-trip loops were copied), while a captured loop
    returns copies."""
    y = torch.randn(3)
    before = y.clone()
    i, y2 = torchport.while_loop(lambda i, y: i < 2, body, (torch.tensor(0), y))
    assert int(i) == 2
    assert y2 is not y and y2.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    torch.testing.assert_close(y2, before)
    y2.add_(1)
    assert torch.equal(y, before)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64], ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_unsigned_index_dtypes_clamp_like_the_reference(dtype: torch.dtype, n: int) -> None:
    """Bug: a uint16/uint32/uint64 index raised NotImplementedError ("clamp_scalar_cpu" not
    implemented) because clamp has no CPU kernel for them; values past the last branch
    (uint64's above int64's range included) must pick the last branch, as the reference does."""
    branches = [lambda x, k=k: x + k for k in range(n)]
    top = torch.iinfo(dtype).max
    for value in sorted({0, 1, n - 1, n, 200, top, top - 1, 2**31, 2**63}):
        if value > top:
            continue
        index = torch.tensor(value, dtype=dtype)
        x = torch.zeros(2)
        got = torchport.switch(index, branches, (x,))
        torch.testing.assert_close(got, switch_reference(index, branches, (x,)))


def test_exported_switch_reads_the_modules_parameters_and_buffers() -> None:
    """Under non-strict export a branch reading a module's parameter was traced with the fake
    parameter baked into its graph as a constant: the program returned a FakeTensor, ignored
    the module's weights, and ``torch.export.save`` refused it. The switch now goes through
    dynamo there (as ``torch.cond`` does), which lifts them into the node's operands."""
    import io

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((4,), 3.0))
            self.register_buffer("b", torch.full((4,), 0.5))

        def forward(self, i: torch.Tensor, x: torch.Tensor) -> Any:
            branches = [lambda x: x * self.w, lambda x: x - self.b, torch.sin]
            return torchport.switch(i, branches, (x,))

    m, x = M(), torch.randn(4)
    ep = torch.export.export(m, (torch.tensor(0), x))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for i in range(3):
        want = m(torch.tensor(i), x)
        for prog in (ep, loaded):
            got = prog.module()(torch.tensor(i), x)
            assert type(got) is torch.Tensor and torch.equal(got, want), (i, got, want)
    mod = ep.module()
    with torch.no_grad():
        mod.w.fill_(-2.0)  # the program reads the weight it holds, not a traced constant
    assert torch.equal(mod(torch.tensor(0), x), x * -2.0)
