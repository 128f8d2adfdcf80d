"""Outputs of eager ``switch``/``while_loop`` that never alias what existed before the call.

Traced by dynamo, a tensor a branch reads from outside its operands (a closure's, a global's, a
module's parameter) becomes an input of the branch graph, like the operands, and under grad mode
an output aliasing a graph input is refused (``torch.cond``'s rule; without grad, torch 2.13
passes it through). Eager calls run the branch directly; :func:`call_unaliased` makes them
return outputs that never alias an operand or a tensor that existed before the call: it copies
each such output and leaves the tensors the branch created alone (no copy, no cost beyond a few
reference counts).

How an output is known to be fresh, without tracking the branch's ops:

1. it shares no storage with an operand (compared by storage address);
2. no Python reference to it exists besides those of the output itself: a tensor read from a
   closure, a global or a module is held by that too. The reference a ``TensorImpl`` takes to
   its Python object while C++ shares it (a view's base, an input saved for backward) is not a
   Python holder and is discounted via ``Tensor._use_count()``;
3. a view's base (``_base``) passes test 2: a slice of a parameter has the parameter as base;
4. a tensor without ``grad_fn`` shares its storage with no tensor outside the output and its
   bases (``detach()``/``.data`` of a closure tensor shares storage without being a view).
   With a ``grad_fn`` the count is skipped: autograd keeps a second ``TensorImpl`` on the
   storage of a result it saved (``exp``, ``sigmoid``), which is fresh.

Tests 2 and 4 count references, so no one may hold the output but the output itself:
:func:`call_unaliased` calls the branch itself and flattens its result at once (a fresh container
dies then; one held elsewhere, such as a tuple stored on an object, keeps its tensors referenced,
and they are copied). A tensor held only from C++ (no Python object, no view relation, its own
storage) cannot be told from a fresh one.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["call_unaliased", "call_unaliased_reference"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What two tensors sharing memory have in common: their storage's address (the tensor's
    identity when it has no storage to read, e.g. a sparse tensor)."""
    try:
        return ("storage", t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("tensor", id(t))


def _scan(leaves: list[Any]) -> list[tuple[int, int, tuple[str, int], int, int] | None]:
    """For each tensor leaf, raw counts beyond those of ``leaves`` itself: (Python references
    to it, Python references to its base, its storage key, ``TensorImpl``s on that storage,
    ``id`` of its base or 0); ``None`` for other leaves. :data:`_OWN` holds what a fresh tensor
    shows. The counts are taken inline (no Python call between a tensor and
    ``sys.getrefcount``): a frame-evaluation hook such as dynamo's stops CPython from inlining
    calls, and a call not inlined holds its arguments twice."""
    uses = Counter(map(id, leaves))  # (no loop variable left holding a leaf)
    rows: list[tuple[int, int, tuple[str, int], int, int] | None] = []
    for i in range(len(leaves)):  # (not enumerate: its reused tuple would hold the leaf)
        t = leaves[i]
        if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_nested:
            rows.append(None)
            continue
        # A TensorImpl that C++ shares (a view's base, a saved input) holds its Python object.
        refs = sys.getrefcount(t) - uses[id(t)] - (_impl_use_count(t) > 1)
        base = t._base
        base_refs = 0
        if base is not None:
            base_refs = sys.getrefcount(base) - uses[id(base)] - (_impl_use_count(base) > 1)
        storage = None
        try:
            storage = t.untyped_storage()
            key, impls = ("storage", storage.data_ptr()), _storage_use_count(storage._cdata)
        except (RuntimeError, NotImplementedError):  # no storage to read (a wrapper subclass)
            key, impls = ("tensor", id(t)), 0
        rows.append((refs, base_refs, key, impls, 0 if base is None else id(base)))
        del t, base, storage
    return rows


_storage_use_count = torch._C._storage_Use_Count
_impl_use_count: Callable[[torch.Tensor], int] = torch.Tensor._use_count  # type: ignore[attr-defined]


def _calibrate() -> tuple[int, int, int]:
    """What :func:`_scan` counts for a fresh tensor that is a view, less its one
    ``TensorImpl`` and its base's (the interpreter's own references)."""
    row = _scan([torch.empty(2)[1:]])[0]
    assert row is not None
    return row[0], row[1], row[3] - 2


_OWN = _calibrate()


def call_unaliased(fn: Callable[..., Any], args: Sequence[Any], inputs: Sequence[Any]) -> Any:
    """``fn(*args)`` with each output tensor that may alias an operand (``inputs``) or a
    tensor that existed before the call (a closure's, a global's, a module's) replaced by a
    clone; the tensors the call created are returned as they are.

    Eager ``switch``/``while_loop`` outputs never alias, as in a captured call: a branch
    returning its operand, a module's parameter or a slice of a global returned that tensor
    itself, so an in-place op on the result changed it in eager mode only. ``fn`` runs here
    so that no caller holds its result while references are counted (tests 2-4 of the module
    docstring).
    """
    leaves = [fn(*args)]
    spec = None
    if not isinstance(leaves[0], torch.Tensor):
        leaves, spec = pytree.tree_flatten(leaves.pop())  # a fresh container dies here
    own_refs, own_base_refs, own_impls = _OWN
    rows = _scan(leaves)
    inputs_at = {storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
    copy = [
        row is not None
        and (row[0] > own_refs or (row[4] != 0 and row[1] > own_base_refs) or row[2] in inputs_at)
        for row in rows
    ]
    # Test 4: the output's own TensorImpls (and their bases) on each storage, against the count.
    known: dict[tuple[str, int], set[int]] = {}
    for t, row, c in zip(leaves, rows, copy):
        if row is not None and not c:
            known.setdefault(row[2], set()).update((id(t), row[4]) if row[4] else (id(t),))
    for i in range(len(leaves)):
        row = rows[i]
        if row is not None and not copy[i] and row[3] and leaves[i].grad_fn is None:
            copy[i] = row[3] - own_impls > len(known[row[2]])
    for i in range(len(leaves)):
        if copy[i]:
            leaves[i] = leaves[i].clone()
    return leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)


def call_unaliased_reference(
    fn: Callable[..., Any], args: Sequence[Any], inputs: Sequence[Any]
) -> Any:
    """Plain meaning of :func:`call_unaliased` (for tests): clone every output tensor. Equal
    in value to it; it skips the copy for the tensors the call created."""
    del inputs
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, fn(*args))
