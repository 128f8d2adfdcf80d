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

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

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
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return total


def _erased(node: fx.Node) -> bool:
    return getattr(node, "_erased", False)


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
