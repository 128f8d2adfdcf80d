"""``while_loop``: ``torch.while_loop``'s semantics, also capturable in a :class:`~torchport.graphs.Graph`.

``while_loop(cond_fn, body_fn, carried_inputs)`` runs ``carried = body_fn(*carried)`` while
``cond_fn(*carried)`` is true and returns the final carried values as a tuple.

- carried values are tensors or ints (possibly nested in tuples/lists/dicts); ``body_fn`` returns
  the same structure, with tensors of the same shape, dtype and device and ints that stay ints
  (not floats, not bools; checked each iteration in eager, naming the leaf), or a bare value
  when one value is carried (torch accepts that too);
- the result is always a tuple (torch returns whatever ``body_fn`` returns, so a bare tensor for
  a body returning one: here the same in every mode, whatever the trip count);
- ``cond_fn`` returns a Python bool or a one-element bool tensor;
- returned tensors never alias the carried inputs: a loop whose condition is false at once
  returns **copies** of the tensors, and so does a body that passes a value through unchanged;
- ``cond_fn`` and ``body_fn`` must not write to the carried tensors in place: traced or
  captured, torch refuses it; eager raises :class:`WhileLoopError` naming the carried leaf, after
  the call that wrote (:mod:`~torchport.control.mutation`: the tensor has been written).

Eager runs a plain Python loop (2.13's ``torch.while_loop`` would compile the loop with dynamo on
every eager call); under ``torch.compile``/``torch.export`` it is torch's ``while_loop`` HOP; inside a
graph capture it becomes a loop of the replayed program with a data-dependent trip count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchport.control.mutation import first_modified, versions

__all__ = ["WhileLoopError", "while_loop", "while_loop_reference"]


class WhileLoopError(RuntimeError):
    """Invalid arguments to :func:`while_loop` or a body that changes the carried structure."""


def while_loop_reference(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried_inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The plain-Python meaning of :func:`while_loop` (for tests)."""
    vals = tuple(carried_inputs)
    ran = False
    while bool(cond_fn(*vals)):
        vals = tuple(body_fn(*vals))
        ran = True
    if not ran:
        vals = pytree.tree_map_only(torch.Tensor, torch.clone, vals)
    return vals


def _validate(cond_fn: Any, body_fn: Any, carried: Any) -> list[Any]:
    if not callable(cond_fn):
        raise WhileLoopError(f"while_loop: cond_fn must be callable, got {cond_fn!r}")
    if not callable(body_fn):
        raise WhileLoopError(f"while_loop: body_fn must be callable, got {body_fn!r}")
    if not isinstance(carried, (tuple, list)):
        raise WhileLoopError(
            f"while_loop: carried_inputs must be a tuple or list, got {type(carried).__name__}"
        )
    leaves = pytree.tree_leaves(carried)
    for x in leaves:
        if not isinstance(x, torch.Tensor) and not _is_int(x):
            raise WhileLoopError(
                f"while_loop: carried values must be tensors or ints, got {type(x).__name__} {x!r}"
            )
    return leaves


def check_pred(pred: Any) -> bool:
    """The loop condition as a bool; raise unless it is a bool or one-element bool tensor."""
    if isinstance(pred, bool):
        return pred
    if isinstance(pred, torch.Tensor) and pred.numel() == 1 and pred.dtype == torch.bool:
        return bool(pred.item())
    raise WhileLoopError(
        f"while_loop: cond_fn must return a bool or a one-element bool tensor, got {pred!r}"
    )


def body_values(out: Any, n: int) -> tuple[Any, ...]:
    """``body_fn``'s result as a tuple of ``n`` carried values, never unpacking a tensor.

    A tuple or list is taken as is; a single value stands for one carried value, as torch's
    ``while_loop`` accepts. (``tuple(tensor)`` would split a tensor along its first dimension
    into that many "carried values".)
    """
    if isinstance(out, (tuple, list)):
        return tuple(out)
    if n != 1:
        raise WhileLoopError(
            f"while_loop: body_fn must return a tuple of the {n} carried values, got a single "
            f"{_kind(out)}"
        )
    return (out,)


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _is_int(x: Any) -> bool:
    """True for a carried non-tensor value: an int or SymInt, not a bool."""
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def check_body_output(before: Any, after: Any) -> list[Any]:
    """Raise unless ``after`` has ``before``'s structure and tensor metadata; return the
    leaves of ``after``."""
    lb, sb = pytree.tree_flatten(before)
    la, sa = pytree.tree_flatten(after)
    if sa != sb:
        raise WhileLoopError(
            f"while_loop: body_fn must return the carried structure {sb}, but returned {sa}"
        )
    for i, (b, a) in enumerate(zip(lb, la)):
        if isinstance(b, torch.Tensor) != isinstance(a, torch.Tensor):
            raise WhileLoopError(
                f"while_loop: carried value {i} changed kind from {type(b).__name__} to "
                f"{type(a).__name__}"
            )
        if not isinstance(b, torch.Tensor) and not _is_int(a):
            # traced, torch refuses a float, and a bool computed from a carried int (traced as
            # a symbolic int, so the bool is symbolic too; it lets a literal True through).
            # Eager cannot tell the two bools apart and refuses both, as it does a carried bool
            raise WhileLoopError(
                f"while_loop: carried value {i} must stay an int, but body_fn turned "
                f"{type(b).__name__} {b!r} into {type(a).__name__} {a!r}"
            )
        if isinstance(b, torch.Tensor) and (
            a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
        ):
            raise WhileLoopError(
                f"while_loop: carried tensor {i} must keep shape/dtype/device "
                f"{tuple(b.shape)}/{b.dtype}/{b.device}, body_fn returned "
                f"{tuple(a.shape)}/{a.dtype}/{a.device}"
            )
    return la


def while_loop(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried_inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Run ``body_fn`` while ``cond_fn`` holds; return the carried values (a tuple).

    Args:
        cond_fn: ``(*carried) -> bool`` or one-element bool tensor.
        body_fn: ``(*carried) -> tuple`` of the same structure as ``carried_inputs``.
        carried_inputs: tuple/list of tensors and ints.

    Raises:
        WhileLoopError: bad arguments, a non-boolean condition, a body that changes the
            carried structure, shapes or dtypes or turns an int into a float or bool, or a
            ``cond_fn``/``body_fn`` that writes to a carried tensor in place (eager: raised
            after that call, naming the leaf).
    """
    _validate(cond_fn, body_fn, carried_inputs)
    carried = tuple(carried_inputs)
    from torchport.graphs.capture import current_recorder

    rec = current_recorder()
    if rec is not None:
        return rec.record_while(cond_fn, body_fn, carried)
    from torchport.control.aliasing import call_unaliased
    from torchport.control.switch import _is_tracing

    leaves = pytree.tree_leaves(carried)
    if _is_tracing(leaves, None):  # (its first test: compiling in this thread)
        # torch's op returns what body_fn returns: a bare tensor for a body returning one.
        out = torch._higher_order_ops.while_loop(cond_fn, body_fn, carried)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    state = [carried]  # the only holder of the carried values, so state.pop hands them over
    _run(cond_fn, body_fn, state, leaves)
    # Copies of the inputs a zero-trip loop returns, and of the tensors a body passed through
    # or read from outside (returned as they were, an in-place op on the result changed them;
    # traced, the loop's outputs never alias its inputs).
    return call_unaliased(state.pop, (), leaves)


def _run(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], state: list[Any], leaves: list[Any]
) -> None:
    """Run the loop on ``state[0]`` (whose leaves are ``leaves``), raising if ``cond_fn`` or
    ``body_fn`` writes to a carried tensor. (A frame of its own: no reference to the final
    carried values outlives it.)"""
    while True:
        vals = state[0]
        seen = versions(leaves)
        go = check_pred(cond_fn(*vals))
        _check_unmodified("cond_fn", leaves, seen)
        if not go:
            return
        out = body_values(body_fn(*vals), len(vals))
        _check_unmodified("body_fn", leaves, seen)
        leaves = check_body_output(vals, out)
        state[0] = out


def _check_unmodified(name: str, leaves: list[Any], seen: list[int | None]) -> None:
    """Raise if ``cond_fn``/``body_fn`` wrote to a carried tensor (its version counter moved)."""
    k = first_modified(leaves, seen)
    if k is not None:
        raise WhileLoopError(
            f"while_loop: {name} modifies carried value {k} ({_kind(leaves[k])}) in place; "
            "cond_fn and body_fn must not write to the carried values (torch.while_loop refuses "
            "input mutation when traced): return a new tensor instead. The tensor has been "
            "written: eager while_loop checks after the call"
        )
