"""Bind a :class:`ShapesSpec` to one call's arguments, and check calls against it.

:func:`bind` pairs every spec leaf with the flat (pytree) position of the argument it describes and
rejects unknown parameter names and variables that no bare slot binds (2.14's errors).
:func:`check_values` evaluates a call: the first bare slot of each variable binds it (checked against
``min``/``max``), later slots must repeat its value, derived expressions and assumptions must hold.
A :class:`DynamicSpecViolation` names the argument, the dimension, the expected relation and the
actual value.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchport.frontend.dynamic_spec import (
    Cond,
    DictSpec,
    DynamicSpecViolation,
    Expr,
    IntVar,
    ObjectSpec,
    SeqSpec,
    ShapesSpec,
    TensorSpec,
)

# ---------------------------------------------------------------------------------------------
# Binding a spec to a call, and checking a call
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One spec'd integer of a call: dim ``dim`` of flat leaf ``leaf`` (``dim`` None: a scalar)."""

    where: str  # argument path, e.g. "x" or "batch['ids']" or "cfg.weight"
    leaf: int  # index into pytree.tree_flatten((args, kwargs))
    dim: int | None
    spec: Expr | int
    attrs: tuple[str, ...] = ()  # attribute path from the leaf (ObjectSpec)
    ndim: int | None = None  # the rank its TensorSpec gives (None: a scalar)
    # the value's name in the compiled frame, as dynamo's sources spell it (``L['d']['n']``,
    # ``L['args'][0]``, ``L['cfg'].n``); None where the parameter is unknown
    source: str | None = None

    def target(self, flat: Sequence[Any]) -> Any:
        """The tensor or int this slot describes, in one call's flat arguments."""
        v = flat[self.leaf]
        for a in self.attrs:
            v = getattr(v, a)
        return v


@dataclass(frozen=True)
class Binding:
    """A spec bound to one call structure: the slots, their flat positions and the assumptions."""

    slots: tuple[Slot, ...]
    assumptions: tuple[Cond, ...]
    n_leaves: int

    def variables(self) -> list[IntVar]:
        """The variables bound by bare slots, in first-appearance order."""
        seen: dict[IntVar, None] = {}
        for s in self.slots:
            if isinstance(s.spec, IntVar):
                seen.setdefault(s.spec)
        return list(seen)


def _walk(
    spec: Any, value: Any, where: str, start: int, out: list[Slot], src: str | None = None
) -> int:
    """Append the slots of ``value`` (dynamo source name ``src``) under ``spec``; return how many
    flat leaves it spans."""
    n = len(pytree.tree_leaves(value))
    if spec is None:
        return n
    if isinstance(spec, SeqSpec):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: SeqSpec expected list/tuple, got {type(value).__name__}")
        if len(spec) > len(value):
            raise ValueError(
                f"{where}: SeqSpec has {len(spec)} entries beyond runtime sequence length "
                f"{len(value)}"
            )
        pos = start
        for i, v in enumerate(value):
            sub = spec._entries[i] if i < len(spec) else None
            pos += _walk(sub, v, f"{where}[{i}]", pos, out, _item(src, i))
        return pos - start
    if isinstance(spec, DictSpec):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: DictSpec expected dict, got {type(value).__name__}")
        unmatched = set(spec) - set(value)
        if unmatched:
            raise ValueError(
                f"{where}: DictSpec has entries {sorted(unmatched, key=repr)!r} that do not match "
                f"any key in the runtime dict. Runtime keys: {sorted(value, key=repr)!r}"
            )
        pos = start
        for key, v in _dict_items_in_pytree_order(value):
            pos += _walk(spec._entries.get(key), v, f"{where}[{key!r}]", pos, out, _item(src, key))
        return pos - start
    if isinstance(spec, ObjectSpec):
        leaves = pytree.tree_leaves(value)
        if len(leaves) != 1 or leaves[0] is not value:
            raise ValueError(
                f"{where}: ObjectSpec describes the attributes of a plain object, got a "
                f"{type(value).__name__} container (use SeqSpec/DictSpec for pytree containers)"
            )
        _walk_object(spec, value, where, start, (), out, src)
        return 1
    if isinstance(spec, TensorSpec):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where}: spec is TensorSpec but the actual arg is {type(value).__name__}, "
                "not a Tensor."
            )
        if len(spec) != value.dim():
            raise ValueError(
                f"{where}: TensorSpec has {len(spec)} dims but the tensor has {value.dim()} "
                f"(shape {tuple(value.shape)})"
            )
        for d, leaf in enumerate(spec):
            if leaf is not None:
                out.append(Slot(where, start, d, leaf, ndim=len(spec)))
        return 1
    if isinstance(spec, (Expr, int)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"{where}: spec is {type(spec).__name__} (scalar spec) but the actual arg is "
                f"{type(value).__name__}, not int."
            )
        out.append(Slot(where, start, None, spec, source=src))
        return 1
    raise TypeError(f"{where}: unexpected spec type {type(spec).__name__}: {spec!r}")


def _walk_object(
    spec: ObjectSpec,
    obj: Any,
    where: str,
    leaf: int,
    attrs: tuple[str, ...],
    out: list[Slot],
    src: str | None,
) -> None:
    """Slots for the attributes of ``obj`` (flat leaf ``leaf``) that ``spec`` describes."""
    missing = [name for name in spec if not hasattr(obj, name)]
    if missing:
        raise ValueError(
            f"{where}: ObjectSpec has fields {missing!r} that the runtime "
            f"{type(obj).__name__} object does not have"
        )
    for name, sub in spec.items():
        path, value = (*attrs, name), getattr(obj, name)
        at, at_src = f"{where}.{name}", None if src is None else f"{src}.{name}"
        if sub is None:
            continue
        if isinstance(sub, ObjectSpec):
            _walk_object(sub, value, at, leaf, path, out, at_src)
            continue
        tmp: list[Slot] = []
        if isinstance(sub, (SeqSpec, DictSpec)):
            raise ValueError(f"{at}: ObjectSpec fields hold TensorSpec, IntVar, int or ObjectSpec")
        _walk(sub, value, at, leaf, tmp, at_src)
        out.extend(Slot(t.where, leaf, t.dim, t.spec, path, t.ndim, t.source) for t in tmp)


def _item(src: str | None, key: object) -> str | None:
    """The source name of ``src[key]`` (dynamo writes a key by its ``repr``)."""
    return None if src is None else f"{src}[{key!r}]"


def _local(name: str) -> str:
    """The source name of the compiled frame's local ``name``."""
    return f"L[{name!r}]"


def _dict_items_in_pytree_order(d: dict[Any, Any]) -> list[tuple[Any, Any]]:
    return list(d.items())


def bind(
    fn: Callable[..., Any], spec: ShapesSpec, args: Sequence[Any], kwargs: dict[str, Any], api: str
) -> Binding:
    """Pair every spec leaf with the flat position of the argument it describes.

    Raises ``ValueError`` for spec names that match no passed argument and for variables that are
    used only inside derived expressions or assumptions (never bound by a bare slot).
    """
    params = spec.params
    slots: list[Slot] = []
    n_leaves = len(pytree.tree_leaves((tuple(args), dict(kwargs))))
    if params is not None:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        sig = inspect.signature(target)
        pos_params = [
            p
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
        var_idx = next(
            (i for i, p in enumerate(pos_params) if p.kind is p.VAR_POSITIONAL), len(pos_params)
        )
        varargs = pos_params[var_idx].name if var_idx < len(pos_params) else None
        varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        matched: set[str] = set()
        matched_kw: set[str] = set()
        pos = 0
        src: str | None
        for i, value in enumerate(args):
            if i < var_idx:
                name = pos_params[i].name
                sub = params._named.get(name)
                if name in params._named:
                    matched.add(name)
                where, src = name, _local(name)
            else:
                j = i - var_idx
                va = params._varargs or []
                sub = va[j] if j < len(va) else None
                where = f"*args[{j}]"
                src = None if varargs is None else _item(_local(varargs), j)
            pos += _walk(sub, value, where, pos, slots, src)
        named = {
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        for name, value in kwargs.items():
            if name in params._named:
                sub = params._named[name]
                matched.add(name)
            elif params._varkw is not None and name in params._varkw:
                sub = params._varkw[name]
                matched_kw.add(name)
            else:
                sub = None
            # (a keyword that no parameter names is an item of the **kwargs dict)
            src = _local(name) if name in named or varkw is None else _item(_local(varkw), name)
            pos += _walk(sub, value, name, pos, slots, src)
        assert pos == n_leaves, f"spec binding walked {pos} leaves, the call has {n_leaves}"
        unmatched = set(params._named) - matched
        if params._varkw is not None:
            unmatched |= set(params._varkw) - matched_kw
        if unmatched:
            passed = [p.name for p in pos_params[: min(len(args), var_idx)]] + list(kwargs)
            raise ValueError(
                f"ParamsSpec has entries {sorted(unmatched)!r} that do not match any argument "
                f"passed to {api}(). Spec keys must be forward parameter names that were actually "
                f"passed. Inputs received: {passed!r}."
            )
    binding = Binding(tuple(slots), tuple(spec.assumptions), n_leaves)
    _check_all_bound(binding)
    return binding


def _pretty(v: object) -> str:
    return re.sub(r"#\d+", "", str(v))


def _check_all_bound(b: Binding) -> None:
    bound = set(b.variables())
    pending: list[tuple[str, set[IntVar]]] = []
    for s in b.slots:
        if isinstance(s.spec, Expr) and not isinstance(s.spec, IntVar):
            missing = s.spec.free_vars() - bound
            if missing:
                pending.append((f"{s.where} dim {s.dim} == {s.spec}", missing))
    for a in b.assumptions:
        missing = a.free_vars() - bound
        if missing:
            pending.append((str(a), missing))
    if pending:
        names = sorted({v.name for _, m in pending for v in m})
        lines = "\n".join(f"  - {t}  (unbound: {sorted(v.name for v in m)})" for t, m in pending)
        raise ValueError(
            f"shapes_spec: {len(pending)} pending check(s) reference unbound IntVar(s) {names}. "
            "Every IntVar used in a derived expression or assumption must also appear as a "
            f"bare-IntVar slot somewhere in the spec. Offending checks:\n{lines}"
        )


def _slot_value(s: Slot, flat: Sequence[Any]) -> int:
    v = s.target(flat)
    if s.dim is None:
        # the binding is cached per call structure: check the type of every call's value as
        # _walk checked the first call's (a float or bool must not be truncated into range)
        if not isinstance(v, int) or isinstance(v, bool):
            raise DynamicSpecViolation(
                f"argument {s.where!r}: its spec {_pretty(s.spec)} describes a Python int, "
                f"got {type(v).__name__} {v!r}"
            )
        return v
    # the binding is cached per call structure, not per rank: check the rank of every call
    if not isinstance(v, torch.Tensor) or v.dim() != s.ndim:
        got = f"a {v.dim()}-D tensor" if isinstance(v, torch.Tensor) else type(v).__name__
        raise DynamicSpecViolation(
            f"argument {s.where!r}: its TensorSpec has {s.ndim} dims, got {got}"
        )
    return int(v.shape[s.dim])


def _slot_name(s: Slot) -> str:
    return f"argument {s.where!r} dim {s.dim}" if s.dim is not None else f"argument {s.where!r}"


def check_values(b: Binding, flat: Sequence[Any]) -> dict[IntVar, int]:
    """Check one call's flat arguments against the binding; return the variables' values.

    Raises :class:`DynamicSpecViolation` naming the argument, dimension, relation and value.
    """
    env: dict[IntVar, int] = {}
    first: dict[IntVar, Slot] = {}
    for s in b.slots:
        val = _slot_value(s, flat)
        spec = s.spec
        if isinstance(spec, IntVar):
            if spec in env:
                if env[spec] != val:
                    f = first[spec]
                    raise DynamicSpecViolation(
                        f"{_slot_name(s)}: expected {spec.name} == {env[spec]} (the size of "
                        f"{_slot_name(f)}, which is also {spec.name}), got {val}"
                    )
                continue
            if (spec.min is not None and val < spec.min) or (
                spec.max is not None and val > spec.max
            ):
                raise DynamicSpecViolation(
                    f"{_slot_name(s)}: expected {spec.range_text()}, got {spec.name} = {val}"
                )
            env[spec] = val
            first[spec] = s
        elif isinstance(spec, int) and val != spec:
            raise DynamicSpecViolation(f"{_slot_name(s)}: expected static size {spec}, got {val}")
    zero = "divides by zero with {} (a divisor of a spec must be nonzero; give its variable min=1)"
    for s in b.slots:
        if isinstance(s.spec, Expr) and not isinstance(s.spec, IntVar):
            val = _slot_value(s, flat)
            try:
                want = s.spec.evaluate(env)
            except ZeroDivisionError:
                raise DynamicSpecViolation(
                    f"{_slot_name(s)}: expected {_pretty(s.spec)}, which "
                    + zero.format(_values(s.spec, env))
                ) from None
            if val != want:
                raise DynamicSpecViolation(
                    f"{_slot_name(s)}: expected {_pretty(s.spec)} = {want} "
                    f"(with {_values(s.spec, env)}), got {val}"
                )
    for a in b.assumptions:
        try:
            holds = a.evaluate(env)
        except ZeroDivisionError:
            raise DynamicSpecViolation(
                f"assumption {_pretty(a)} " + zero.format(_values(a, env))
            ) from None
        if not holds:
            raise DynamicSpecViolation(
                f"assumption {_pretty(a)} does not hold with {_values(a, env)}"
            )
    return env


def _values(e: Any, env: dict[IntVar, int]) -> str:
    """``B=2, T=0``: the values of ``e``'s variables, for a message (formed only on failure)."""
    return ", ".join(f"{v.name}={env[v]}" for v in sorted(e.free_vars(), key=_uid))


def _uid(v: IntVar) -> int:
    return v.uid


def check_call(b: Binding, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[IntVar, int]:
    """:func:`check_values` on ``(args, kwargs)``."""
    flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
    if len(flat) != b.n_leaves:
        raise DynamicSpecViolation(
            f"the call has {len(flat)} flat inputs but the spec was bound to {b.n_leaves}"
        )
    return check_values(b, flat)
