"""Rules of the complex decomposition: the one table, aten op → rule, that the lowering reads.

Each rule takes the lowering (whose ``e`` emits real graph nodes), the complex node and its mapped
arguments (complex values as :class:`Pair`), and returns a Pair or a real value. The formulas are
stated beside each rule; :mod:`torchport.compiler.complex` drives them over a graph. The rules are
grouped by theme, each module with its own table, collected here:

- :mod:`~torchport.compiler.complex_elementwise`: arithmetic, exp/log, trigonometric and hyperbolic
  functions and their inverses, pow, sqrt, abs/angle/sgn, isnan/isinf/isfinite, polar;
- :mod:`~torchport.compiler.complex_reductions`: prod/cumprod, logcumsumexp, vector norms;
- :mod:`~torchport.compiler.complex_shape`: views and shape ops, the linear reductions, indexing and
  scatters, cat/stack, where/eq, fills, casts;
- :mod:`~torchport.compiler.complex_linalg`: mm/bmm/addmm, ``linalg_inv_ex``, the FFTs;

with the pair type, emitter and complex arithmetic in :mod:`~torchport.compiler.complex_base`.
"""

from __future__ import annotations

from typing import Any

from torchport.compiler import (
    complex_elementwise,
    complex_linalg,
    complex_reductions,
    complex_shape,
)
from torchport.compiler.complex_base import (
    ComplexDecompositionError,
    Pair,
    Rule,
    _Emitter,
    _is_complex_val,
    _node_val,
    _pair,
    fold_select_of_stack,
)

__all__ = [
    "RULES",
    "ComplexDecompositionError",
    "Pair",
    "Rule",
    "_Emitter",
    "_is_complex_val",
    "_node_val",
    "_pair",
    "fold_select_of_stack",
]


def _collect(*tables: dict[Any, Rule]) -> dict[Any, Rule]:
    """The themed tables as one; an op in two of them would have its rule depend on the order
    of collection, so that is refused."""
    out: dict[Any, Rule] = {}
    for table in tables:
        for op, rule in table.items():
            if op in out:
                raise ComplexDecompositionError(f"two complex decomposition rules for {op}")
            out[op] = rule
    return out


RULES: dict[Any, Rule] = _collect(
    complex_elementwise.RULES, complex_reductions.RULES, complex_shape.RULES, complex_linalg.RULES
)
