"""torchport.switch: 2.14 semantics in eager, export (one node), compile, autograd, errors."""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import torchport
from torchport.control import SwitchError, switch_op, switch_reference

BRANCHES = (
    lambda t: t + 1,
    lambda t: t * 2,
    lambda t: t.sin(),
    lambda t: t - 5,
    lambda t: t.abs(),
    lambda t: t.exp(),
    lambda t: -t,
    lambda t: t * t,
)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("index", [-3, -1, 0, 1, 2, 7, 8, 100])
@pytest.mark.parametrize("kind", ["int", "tensor", "tensor1d"])
def test_eager_matches_reference_with_clamping(n: int, index: int, kind: str) -> None:
    x = torch.randn(3, 5)
    idx: int | torch.Tensor = index
    if kind == "tensor":
        idx = torch.tensor(index)
    elif kind == "tensor1d":
        idx = torch.tensor([index], dtype=torch.int32)
    got = torchport.switch(idx, BRANCHES[:n], (x,))
    want = BRANCHES[max(0, min(index, n - 1))](x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(switch_reference(idx, BRANCHES[:n], (x,)), want)


@pytest.mark.parametrize("value", [-128, 5, 127])
def test_int8_index_with_more_branches_than_it_can_count(value: int) -> None:
    # clamp(0, 199) on an int8 index raised "value cannot be converted to type int8_t".
    branches = [functools.partial(torch.add, other=k) for k in range(200)]
    out = torchport.switch(torch.tensor(value, dtype=torch.int8), branches, (torch.zeros(()),))
    assert out.item() == max(value, 0)


@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (2, 0, 5)], ids=str)
def test_nested_operands_and_structured_outputs(shape: tuple[int, ...]) -> None:
    a, b = torch.randn(shape), torch.randn(shape)
    branches = [
        lambda d, s: {"sum": d["a"] + d["b"], "n": 2, "none": None, "s": s * 2},
        lambda d, s: {"sum": d["a"] - d["b"], "n": 2, "none": None, "s": s * 3},
    ]
    s = torch.randn(())
    for i in (0, 1):
        out = torchport.switch(torch.tensor(i), branches, ({"a": a, "b": b}, s))
        want = branches[i]({"a": a, "b": b}, s)
        torch.testing.assert_close(out["sum"], want["sum"])
        assert out["n"] == 2 and out["none"] is None


@pytest.mark.parametrize(
    ("index", "branches", "operands", "match"),
    [
        (1.5, BRANCHES[:2], (torch.ones(2),), "index must be an int"),
        (True, BRANCHES[:2], (torch.ones(2),), "index must be an int"),
        (torch.tensor([0, 1]), BRANCHES[:2], (torch.ones(2),), r"exactly one element.*\(2,\)"),
        (torch.tensor(0.0), BRANCHES[:2], (torch.ones(2),), "integer dtype, got torch.float32"),
        (0, [], (torch.ones(2),), "non-empty tuple or list"),
        (0, [BRANCHES[0], 3], (torch.ones(2),), "branch1 is not callable"),
        (0, BRANCHES[:2], (torch.ones(2), 2.0), "operand leaf must be a Tensor, got 2.0"),
        (0, BRANCHES[:2], torch.ones(2), "operands must be a tuple or list"),
    ],
)
def test_bad_inputs(index, branches, operands, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SwitchError, match=match):
        torchport.switch(index, branches, operands)


def test_autograd_flows_through_chosen_branch_only() -> None:
    for i in range(3):
        w = torch.randn(4, 3, requires_grad=True)
        branches = [lambda t: (t * 3).sum(), lambda t: (t * t).sum(), lambda t: t.sin().sum()]
        torchport.switch(torch.tensor(i), branches, (w,)).backward()
        w2 = w.detach().clone().requires_grad_()
        branches[i](w2).backward()
        torch.testing.assert_close(w.grad, w2.grad)


def test_autograd_through_traced_switch_op() -> None:
    # The HOP's own autograd (used when traced) differentiates the selected branch.
    w = torch.randn(5, requires_grad=True)
    (out,) = switch_op(torch.tensor(1), (w,), lambda t: (t * 2,), lambda t: (t.sin(),))
    out.sum().backward()
    torch.testing.assert_close(w.grad, w.detach().cos())


class _Mod(torch.nn.Module):
    def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torchport.switch(i, BRANCHES, (x,))


def test_export_is_one_node_and_round_trips() -> None:
    x = torch.randn(3, 4)
    ep = torch.export.export(_Mod(), (torch.tensor(2), x))
    sw = [n for n in ep.graph.nodes if n.target is switch_op]
    assert len(sw) == 1
    assert len(sw[0].args) == 2 + len(BRANCHES)  # index, operands, one graph per branch
    assert not any("cond" in str(n.target) for n in ep.graph.nodes)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for k in (-2, 0, 3, 7, 9):
        want = switch_reference(torch.tensor(k), BRANCHES, (x,))
        torch.testing.assert_close(ep.module()(torch.tensor(k), x), want)
        torch.testing.assert_close(loaded.module()(torch.tensor(k), x), want)


def test_compile_fullgraph() -> None:
    f = torch.compile(
        lambda i, x: torchport.switch(i, BRANCHES[:5], (x,)), fullgraph=True, backend="eager"
    )
    x = torch.randn(6)
    for k in (-1, 0, 2, 4, 11):
        torch.testing.assert_close(f(torch.tensor(k), x), BRANCHES[max(0, min(k, 4))](x))


def test_traced_mismatched_structure_names_branch() -> None:
    branches = [lambda t: t + 1, lambda t: t * 2, lambda t: (t, t)]
    with pytest.raises(SwitchError, match="branch2 returns"):
        torch.fx.experimental.proxy_tensor.make_fx(
            lambda i, x: torchport.switch(i, branches, (x,))
        )(torch.tensor(0), torch.randn(3))


def test_traced_mismatched_dtype_names_output() -> None:
    branches = [lambda t: t + 1, lambda t: t.to(torch.float64)]
    with pytest.raises(SwitchError, match="output 0 differs"):
        torch.fx.experimental.proxy_tensor.make_fx(
            lambda i, x: torchport.switch(i, branches, (x,)), tracing_mode="fake"
        )(torch.tensor(0), torch.randn(3))


def test_differing_int_outputs_become_bounded_symint() -> None:
    mode = torch._subclasses.fake_tensor.FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = torch.empty(3)
        i = torch.empty((), dtype=torch.int64)
        out = switch_op(i, (x,), lambda t: (t + 1, 2), lambda t: (t * 2, 5), lambda t: (t - 1, 3))
    n = out[1]
    assert isinstance(n, torch.SymInt)
    rng = mode.shape_env.var_to_range[n.node.expr]
    assert (int(rng.lower), int(rng.upper)) == (2, 5)
    with mode:
        same = switch_op(i, (x,), lambda t: (t, 4), lambda t: (t * 2, 4))
    assert same[1] == 4 and isinstance(same[1], int)


def test_compile_fullgraph_is_one_node_holding_every_branch() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    w = torch.randn(6)  # read by one branch only: a lifted input the others ignore
    branches = [*BRANCHES[:7], lambda t: t * w]
    f = torch.compile(
        lambda i, x: torchport.switch(i, branches, (x,)), fullgraph=True, backend=backend
    )
    x = torch.randn(6)
    for k in (-3, 0, 5, 7, 40):
        torch.testing.assert_close(
            f(torch.tensor(k), x), switch_reference(torch.tensor(k), branches, (x,))
        )
    (gm,) = graphs
    sw = [n for n in gm.graph.nodes if n.target is switch_op]
    assert len(sw) == 1 and len(sw[0].args) == 2 + len(branches)
    assert not any("cond" in str(n.target) for n in gm.graph.nodes)
    sigs = {
        len([n for n in getattr(gm, a.target).graph.nodes if n.op == "placeholder"])
        for a in sw[0].args[2:]
    }
    assert sigs == {len(sw[0].args[1])}, "every branch graph takes the same merged inputs"


def test_compile_inductor_runs_the_lowered_switch() -> None:
    f = torch.compile(lambda i, x: torchport.switch(i, BRANCHES[:5], (x,)), fullgraph=True)
    x = torch.randn(5)
    with torch.no_grad():
        for k in (-1, 2, 4, 9):
            torch.testing.assert_close(f(torch.tensor(k), x), BRANCHES[max(0, min(k, 4))](x))


def test_compile_gradients_through_the_chosen_branch() -> None:
    # aot_eager runs the same AOTAutograd lowering (cond tree) as Inductor, without codegen.
    f = torch.compile(
        lambda i, x: torchport.switch(i, BRANCHES[:5], (x,)), fullgraph=True, backend="aot_eager"
    )
    for k in (-1, 2, 4, 9):
        x = torch.randn(5, requires_grad=True)
        f(torch.tensor(k), x).sum().backward()
        x2 = x.detach().clone().requires_grad_()
        BRANCHES[max(0, min(k, 4))](x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)


def test_compile_mismatched_structure_names_branch() -> None:
    branches = [lambda t: t + 1, lambda t: (t + 1, t * 2)]
    f = torch.compile(
        lambda i, x: torchport.switch(i, branches, (x,)), fullgraph=True, backend="eager"
    )
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="branch1 returns"):
        f(torch.tensor(0), torch.randn(3))
