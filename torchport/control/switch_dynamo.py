"""Dynamo support for ``switch``: one ``torchport_switch`` node holding all N branch graphs.

torch 2.13's dynamo maps a ``HigherOrderOperator`` to the variable class that traces it through
the table ``torch._dynamo.variables.higher_order_ops._hop_name_to_variable_class`` (looked up by
``TorchHigherOrderOperatorVariable.make`` on the operator's name); a HOP without an entry is a
graph break ("unsupported HigherOrderOperator"). :func:`register` adds :class:`SwitchVariable`
under ``"torchport_switch"``, the same way 2.13 registers ``cond``'s ``CondHigherOrderVariable``.

Tracing follows ``cond``: every branch is speculated as a subgraph with the operands (dynamo lifts
the tensors and symbols each one reads as placeholders); the branch graphs are then given one
common signature (the union of what any branch reads, in a deterministic order: a branch ignores
inputs it does not use), installed as submodules, and the call becomes one FX node
``switch_op(index, (inputs...), branch0, ..., branchN-1)``. Side effects inside branches are not
allowed (as for ``cond``); branch outputs must have the same structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo import graph_break_hints
from torch._dynamo.exc import unimplemented
from torch._dynamo.utils import _make_inlined
from torch._dynamo.variables import higher_order_ops as hops
from torch._dynamo.variables.constant import ConstantVariable
from torch._dynamo.variables.lazy import LazyVariableTracker
from torch._dynamo.variables.lists import ListVariable, TupleVariable
from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable
from torch.fx.graph_module import GraphModule
from torch.fx.proxy import Proxy
from torch.utils import _pytree as pytree

__all__ = ["SwitchVariable", "merge_branch_inputs", "register"]


def _key(outer: Proxy) -> Any:
    # Two branches that read the same module attribute lift two get_attr proxies with one target.
    node = outer.node
    return ("attr", node.target) if node.op == "get_attr" else ("node", node)


def merge_branch_inputs(
    graphs: Sequence[torch.fx.Graph], lifted: Sequence[dict[Proxy, Proxy]]
) -> list[Proxy]:
    """Give every branch graph the same placeholders: the union of the outer values they read.

    ``lifted[i]`` maps an outer proxy to the placeholder branch ``i`` created for it. Returns the
    outer proxies in placeholder order (sorted by node name, so the order is deterministic).
    """
    union: dict[Any, Proxy] = {}
    for lf in lifted:
        for outer in lf:
            union.setdefault(_key(outer), outer)
    order = sorted(union.items(), key=lambda kv: kv[1].node.name)
    for g, lf in zip(graphs, lifted):
        inner_by_key = {_key(o): inner for o, inner in lf.items()}
        old = [n for n in g.nodes if n.op == "placeholder"]
        assert len(old) == len(lf), "every branch placeholder is a lifted outer value"
        first = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first):
            for k, outer in order:
                ph = g.placeholder(outer.node.name)
                ph.meta = dict(outer.node.meta)
                prev = inner_by_key.get(k)
                if prev is not None:
                    prev.node.replace_all_uses_with(ph)
        for n in old:
            g.erase_node(n)
    return [outer for _, outer in order]


def _fail(kind: str, context: Any, explanation: str) -> Any:
    unimplemented(
        gb_type=f"torchport.switch: {kind}",
        context=str(context),
        explanation=explanation,
        hints=[*graph_break_hints.USER_ERROR],
    )


class SwitchVariable(hops.TorchHigherOrderOperatorVariable):
    """Traces ``switch_op(index, operands, *branches)`` into one node (see module docstring)."""

    _HOP_NAME = "torchport.switch"
    _ALLOW_FALLBACK_TO_EAGER = False

    def _call_function(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        args, kwargs = LazyVariableTracker.realize_all((args, kwargs))
        if kwargs or len(args) < 3:
            _fail(
                "improper arguments",
                (args, kwargs),
                "switch_op takes (index, operands, *branches) positionally",
            )
        index, operands, branches = args[0], args[1], list(args[2:])
        if type(index) is ConstantVariable:
            i = int(index.as_python_constant())
            i = max(0, min(i, len(branches) - 1))
            return branches[i].call_function(tx, operands.unpack_var_sequence(tx), {})
        if type(index) not in (TensorVariable, SymNodeVariable):
            _fail("improper index", index, "the index must be a tensor, SymInt or int")
        if not isinstance(operands, (ListVariable, TupleVariable)):
            _fail("improper operands", operands, "operands must be a tuple or list")
        ops = operands.unpack_var_sequence(tx)
        if not hops.only_consist_of(operands, (TensorVariable, ConstantVariable, SymNodeVariable)):
            _fail("improper operands", operands, "operand leaves must be tensors")
        for i, b in enumerate(branches):
            hops._check_supported_callable_arg(tx, b, f"branch{i}")

        grad = torch.is_grad_enabled()
        results = []
        modules = []
        for i, b in enumerate(branches):
            (ret, spec), graph, lifted = hops.speculate_subgraph(
                tx,
                b,
                ops,
                {},
                self._HOP_NAME,
                source_target=self.value,
                should_flatten_outputs=True,
                remove_consts_from_outputs=False,
                supports_input_mutation=not grad,
                supports_aliasing=not grad,
            )
            tx.fake_mode.epoch += 1  # no memoised unbacked bindings across branches
            if not hops.only_consist_of(ret, (TensorVariable, ConstantVariable)):
                _fail(
                    "unsupported branch output",
                    ret,
                    f"branch{i} must return a pytree of tensors and ints",
                )
            results.append((ret, spec, graph, lifted))
            modules.append(dict(tx.output.nn_modules))
        spec0 = results[0][1]
        for i, (_, spec, _, _) in enumerate(results[1:], start=1):
            same = _make_inlined(tx, pytree.TreeSpec.__eq__)(
                spec0.treespec, spec.treespec
            ).as_python_constant()
            if same is not NotImplemented and not same:
                _fail(
                    "branches return different structures",
                    f"branch0: {spec0.treespec}, branch{i}: {spec.treespec}",
                    "switch: branches must return the same output structure; branch0 returns "
                    f"{spec0.treespec} but branch{i} returns {spec.treespec}",
                )
        inputs = merge_branch_inputs([r[2] for r in results], [r[3] for r in results])
        nodes = [
            hops.make_attr(
                tx,
                tx.output.install_subgraph(f"switch_branch{i}", GraphModule(modules[i], r[2])),
            )
            for i, r in enumerate(results)
        ]
        p_args = (index.as_proxy(), tuple(inputs), *nodes)
        return hops._call_function_and_unflatten_output(
            tx, self.value, p_args, {}, None, spec0, results[0][0]
        )


def register() -> None:
    """Make dynamo trace ``torchport_switch`` with :class:`SwitchVariable` (idempotent)."""
    hops._hop_name_to_variable_class.setdefault("torchport_switch", SwitchVariable)
