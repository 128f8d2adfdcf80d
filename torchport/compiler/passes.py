"""FX passes as lists of rules, plus a verifier that names the failing node.

A :class:`Rule` looks at one node and, if its pattern matches, rewrites the graph around it and
returns True. A :class:`Pass` applies its rules to every node until nothing changes (bounded), and
counts rewrites per rule. Passes compose by concatenation (``Pass("a", r1 + r2)``).

Example rule::

    def _relu_of_relu(gm, node):
        if node.target is torch.relu and is_call(node.args[0], torch.relu):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            return True
        return False

    SIMPLIFY = Pass("simplify", [Rule("relu(relu(x)) -> relu(x)", _relu_of_relu)])
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx


class PassVerificationError(RuntimeError):
    """A pass left the graph malformed; the message names the pass, rule and node."""


@dataclass(frozen=True)
class Rule:
    """One (pattern → replacement) rewrite; ``apply(gm, node)`` returns True if it rewrote."""

    name: str
    apply: Callable[[fx.GraphModule, fx.Node], bool]


@dataclass
class Pass:
    """An ordered list of rules applied to a fixed point (at most ``max_rounds`` sweeps)."""

    name: str
    rules: Sequence[Rule]
    max_rounds: int = 8
    counts: Counter[str] = field(default_factory=Counter)

    def __call__(self, gm: fx.GraphModule, *, verify: bool = False) -> int:
        """Apply the rules; return the number of rewrites made."""
        # Nodes that are unused before any rewrite are there for their effect (a buffer's
        # ``add_``, an ``out=`` call, a grad-mode switch): the clean-up below removes only what
        # the rewrites left unused, and never a node that may have side effects.
        unused_before = {node for node in gm.graph.nodes if not node.users}
        total = 0
        for _ in range(self.max_rounds):
            changed = 0
            for node in list(gm.graph.nodes):
                if node.graph is not gm.graph or _erased(node):
                    continue
                for rule in self.rules:
                    if rule.apply(gm, node):
                        self.counts[rule.name] += 1
                        changed += 1
                        if verify:
                            verify_graph(gm, where=f"pass {self.name!r}, rule {rule.name!r}")
                        break
            total += changed
            if not changed:
                break
        if total:
            eliminate_dead_code(gm.graph, keep=unused_before)
            gm.recompile()
        return total


def _erased(node: fx.Node) -> bool:
    return getattr(node, "_erased", False)


def eliminate_dead_code(graph: fx.Graph, *, keep: Collection[fx.Node] = ()) -> bool:
    """Remove the unused nodes that have no side effects; return True if any was removed.

    fx's own ``eliminate_dead_code`` removes every unused node its purity check passes, and that
    check passes in-place methods (``buf.add_(1)``) and ``out=`` calls. Here a node stays if it
    is a placeholder (the graph's signature), is in ``keep``, or :func:`has_side_effects`.
    """
    return graph.eliminate_dead_code(
        is_impure_node=lambda node: (
            node.op == "placeholder" or node in keep or has_side_effects(node)
        )
    )


# In-place operators (``x[i] = v``, ``x += y`` on a tensor that dynamo keeps as a call), whose
# result may well be unused: their effect is the mutation.
_INPLACE_OPERATORS = (
    operator.setitem,
    operator.delitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.imatmul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
)
_INPLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _INPLACE_OPERATORS)


def has_side_effects(node: fx.Node) -> bool:
    """True if running ``node`` may do more than compute its value, so that it can be neither
    removed when unused nor moved across another node.

    Conservative: in-place methods and functions (a name ending in one ``_``: ``add_``,
    ``copy_``, ``torch.relu_``), ``out=`` or ``inplace=True`` calls, in-place operators and
    ``setitem``, module calls (a module may update its state, e.g. BatchNorm's running
    statistics), the graph's output, and whatever fx's :meth:`torch.fx.Node.is_impure` reports
    (mutable schemas, random ops, grad-mode and autocast switches, asserts). Placeholders and
    attribute reads have none.
    """
    if node.op in ("placeholder", "get_attr"):
        return False
    if node.op in ("output", "call_module"):
        return True
    if node.is_impure():
        return True
    if "out" in node.kwargs or _inplace_flag(node):
        return True
    target = node.target
    if node.op == "call_method":
        name = str(target)
        return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
    if target in _INPLACE_OPERATORS:
        return True
    name = getattr(target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _inplace_flag(node: fx.Node) -> bool:
    """True unless an ``inplace`` argument of ``node`` is absent or literally False (a traced
    value counts as possibly True): ``F.relu(x, True)`` as well as ``F.relu(x, inplace=True)``."""
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is not False
    index = _inplace_index(node.target)
    return index is not None and index < len(node.args) and node.args[index] is not False


def _inplace_index(target: Any) -> int | None:
    try:
        return _inplace_index_cached(target)
    except TypeError:  # an unhashable target: look it up uncached
        return _inplace_index_cached.__wrapped__(target)


@functools.cache
def _inplace_index_cached(target: Any) -> int | None:
    """Position of ``target``'s ``inplace`` parameter, or None (no such parameter, or no
    signature, as for most builtins)."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def is_call(node: object, *targets: object) -> bool:
    """True if ``node`` is a call_function/call_method node whose target is one of ``targets``."""
    return (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and (node.target in targets)
    )


def single_user(node: fx.Node) -> bool:
    """True if exactly one node uses ``node`` (so it can be fused into that user)."""
    return len(node.users) == 1


def verify_graph(gm: fx.GraphModule, *, where: str = "") -> None:
    """Check the graph is well formed; raise :class:`PassVerificationError` naming the node."""
    prefix = f"after {where}: " if where else ""
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises RuntimeError with the node in the message
        raise PassVerificationError(f"{prefix}graph lint failed: {e}") from e
    seen: set[fx.Node] = set()
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            if inp not in seen:
                raise PassVerificationError(
                    f"{prefix}node {node.name!r} ({node.format_node()}) uses {inp.name!r} "
                    "before it is defined"
                )
        if node.op == "call_function" and not callable(node.target):
            raise PassVerificationError(f"{prefix}node {node.name!r} has a non-callable target")
        seen.add(node)


def run_passes(
    gm: fx.GraphModule, passes: Iterable[Pass], *, verify: bool = False
) -> dict[str, int]:
    """Run passes in order; return rewrites per pass."""
    done: dict[str, int] = {}
    for p in passes:
        done[p.name] = p(gm, verify=verify)
        if verify:
            verify_graph(gm, where=f"pass {p.name!r}")
    return done


def is_plain_tensor(t: object) -> bool:
    """True for a plain (possibly fake) tensor: not a tensor subclass such as a quantized weight."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is torch.Tensor or type(t) is FakeTensor


def has_static_shape(t: torch.Tensor) -> bool:
    """True if every size of ``t`` is a plain int (no SymInt), so shape tests add no guards."""
    return all(type(s) is int for s in t.shape)


def node_tensor_meta(node: fx.Node) -> torch.Tensor | None:
    """The fake tensor dynamo/export recorded for ``node`` (``meta['example_value']``/``['val']``)."""
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None
