"""The rule-list pass machinery, the verifier and the torchport backend."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import torchport
from torchport.compiler import Pass, PassVerificationError, Rule, is_call, verify_graph


def _drop_double_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if is_call(node, torch.relu) and is_call(node.args[0], torch.relu):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        return True
    return False


DOUBLE_RELU = Pass("simplify", [Rule("relu(relu(x)) -> relu(x)", _drop_double_relu)])


def f(x):
    return torch.relu(torch.relu(torch.relu(x))) + 1


def test_pass_rewrites_to_fixed_point():
    gm = fx.symbolic_trace(f)
    n = DOUBLE_RELU(gm, verify=True)
    assert n == 2
    assert sum(1 for node in gm.graph.nodes if node.target is torch.relu) == 1
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), f(x))


def test_verifier_names_the_bad_node():
    gm = fx.symbolic_trace(f)
    nodes = list(gm.graph.nodes)
    relu1, relu2 = nodes[1], nodes[2]
    relu1.args = (relu2,)  # use before definition
    with pytest.raises(
        PassVerificationError, match=r"of Node 'relu' was used before it has been defined"
    ):
        verify_graph(gm, where="test")


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_backend_runs_passes_and_reports(inner):
    compiled = torchport.compile(f, inner=inner, passes=[DOUBLE_RELU], verify=True)
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), f(x))
    rep = torchport.compiler.last_report()
    assert rep is not None and rep.inner == inner
    assert rep.rule_counts == {"relu(relu(x)) -> relu(x)": 2}


def test_registered_backend_name():
    out = torch.compile(f, backend="torchport")(torch.randn(3))
    assert out.shape == (3,)


def test_bad_inner():
    with pytest.raises(
        torchport.compiler.CompileOptionError, match=r"inner must be one of .* got 'tvm'"
    ):
        torchport.compile(f, inner="tvm")


def _mutating(x, b, out):
    b.add_(1)  # a call_method whose result nothing reads
    torch.add(b, 1.0, out=out)  # an out= call
    torch.relu_(out)  # an in-place function
    return torch.relu(torch.relu(x)) + 1


def test_pass_clean_up_keeps_unused_mutations():
    gm = fx.symbolic_trace(_mutating)
    assert DOUBLE_RELU(gm, verify=True) == 1
    assert [n.target for n in gm.graph.nodes if n.op != "placeholder"][:3] == [
        "add_",
        torch.add,
        torch.relu_,
    ]
    b, out = torch.zeros(3), torch.full((3,), -5.0)
    gm(torch.randn(3), b, out)
    assert b.tolist() == [1.0] * 3 and out.tolist() == [2.0] * 3


def test_pass_clean_up_removes_what_the_rewrite_left_unused():
    def g(x):
        y = torch.relu(torch.relu(x))
        return torch.relu(x.sin()) + y

    def _drop_relu_of_sin(gm: fx.GraphModule, node: fx.Node) -> bool:
        if is_call(node, torch.relu) and is_call(node.args[0], torch.sin):
            node.args = (node.args[0].args[0],)  # relu(sin(x)) -> relu(x): sin is now unused
            return True
        return False

    gm = fx.symbolic_trace(g)
    Pass("p", [Rule("relu(sin(x)) -> relu(x)", _drop_relu_of_sin)])(gm)
    assert not any(n.target is torch.sin for n in gm.graph.nodes)


def test_compile_reports_are_bounded_and_counted(monkeypatch):
    """Only the last MAX_REPORTS reports are kept (every compile used to keep its report for the
    process's life); report_count() counts them all and reports(n0) still selects the new ones."""
    from torchport.compiler import backend

    monkeypatch.setattr(backend, "_reports", backend.deque(maxlen=3))
    n0 = backend.report_count()
    made = [backend.CompileReport(nodes_before=i) for i in range(5)]
    for rep in made:
        backend._record(rep)
    assert backend.report_count() == n0 + 5
    assert backend.reports() == made[2:] and backend.last_report() is made[4]
    assert backend.reports(n0 + 3) == made[3:] and backend.reports(n0) == made[2:]
