"""Declarative dynamic shapes: the spec types of PyTorch 2.14's ``torch.fx.experimental.dynamic_spec``.

A spec says, per argument of a function, which sizes may vary and how they relate::

    B = ShapeVar("B", max=64)
    T = ShapeVar("T", min=1, max=512)

    @dynamic_spec(ShapesSpec({"x": TensorSpec([B, T, STATIC]), "y": TensorSpec([2 * B + 1])},
                             assumptions=[T % 8 == 0]))
    def fn(x, y): ...

Leaves of a :class:`TensorSpec` (one per dimension) and scalar-int parameters are:

- an :class:`IntVar` / :class:`ShapeVar` — the size is dynamic within ``[min, max]``; every slot that
  names the same variable must have the same size;
- a derived expression built from variables with ``+ - * // %`` (``2 * B + 1``) — the size must equal
  the expression once its variables are bound by bare slots;
- an ``int`` — the size is static and must equal it; ``STATIC`` (``None``) — static, taken from the
  example input.

``torchport.compile`` / ``export`` / ``make_fx`` read the spec from their ``dynamic_shapes=`` argument
or from the decorator (both → ``ValueError``), translate it into torch 2.13's mechanisms
(:mod:`torchport.frontend.apply`) and check every call with :func:`check_call`, whose
:class:`DynamicSpecViolation` names the argument, the dimension, the expected relation and the
actual value.

Differences from 2.14: variables here are plain expression objects, not ``torch.SymInt`` subclasses
backed by a private ShapeEnv; ``ObjectSpec`` (attributes of arbitrary objects) is honoured by
``torchport.compile`` only (export and make_fx take pytrees of tensors).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

STATIC = None  # a static slot (its size is taken from the example input)

_IDENT = "  "


class DynamicSpecViolation(ValueError):
    """A call's argument sizes break the declared spec (names argument, dim, relation, value)."""


# ---------------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------------

_BINOPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
}
_CMPS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _lift(v: object) -> Expr:
    if isinstance(v, Expr):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return _Const(v)
    raise TypeError(f"spec expressions combine IntVar/ShapeVar and ints, got {type(v).__name__}")


class Expr:
    """An integer expression over spec variables (``2 * B + 1``); comparisons give :class:`Cond`."""

    def evaluate(self, env: dict[IntVar, int]) -> int:
        """Value with every variable taken from ``env``."""
        raise TypeError(f"{type(self).__name__} cannot be evaluated")

    def free_vars(self) -> set[IntVar]:
        """The variables this expression mentions."""
        return set()

    def _bin(self, op: str, other: object, *, swap: bool = False) -> Expr:
        a, b = self, _lift(other)
        return _BinOp(op, b, a) if swap else _BinOp(op, a, b)

    def __add__(self, o: object) -> Expr:
        return self._bin("+", o)

    def __radd__(self, o: object) -> Expr:
        return self._bin("+", o, swap=True)

    def __sub__(self, o: object) -> Expr:
        return self._bin("-", o)

    def __rsub__(self, o: object) -> Expr:
        return self._bin("-", o, swap=True)

    def __mul__(self, o: object) -> Expr:
        return self._bin("*", o)

    def __rmul__(self, o: object) -> Expr:
        return self._bin("*", o, swap=True)

    def __floordiv__(self, o: object) -> Expr:
        return self._bin("//", o)

    def __mod__(self, o: object) -> Expr:
        return self._bin("%", o)

    def __neg__(self) -> Expr:
        return _BinOp("*", _Const(-1), self)

    def _cmp(self, op: str, o: object) -> Cond:
        return Cond(op, self, _lift(o))

    def __eq__(self, o: object) -> Cond:  # type: ignore[override]
        return self._cmp("==", o)

    def __ne__(self, o: object) -> Cond:  # type: ignore[override]
        return self._cmp("!=", o)

    def __lt__(self, o: object) -> Cond:
        return self._cmp("<", o)

    def __le__(self, o: object) -> Cond:
        return self._cmp("<=", o)

    def __gt__(self, o: object) -> Cond:
        return self._cmp(">", o)

    def __ge__(self, o: object) -> Cond:
        return self._cmp(">=", o)

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        raise TypeError("a spec expression has no truth value; use it inside a spec")

    def linear(self) -> tuple[IntVar, int, int] | None:
        """``(v, a, b)`` if this is ``a * v + b`` for a single variable, else None."""
        return None


@dataclass(eq=False, frozen=True)
class _Const(Expr):
    value: int

    def evaluate(self, env: dict[IntVar, int]) -> int:
        return self.value

    def __str__(self) -> str:
        return str(self.value)

    __repr__ = __str__
    __hash__ = Expr.__hash__


@dataclass(eq=False, frozen=True)
class _BinOp(Expr):
    op: str
    a: Expr
    b: Expr

    def evaluate(self, env: dict[IntVar, int]) -> int:
        return _BINOPS[self.op](self.a.evaluate(env), self.b.evaluate(env))

    def free_vars(self) -> set[IntVar]:
        return self.a.free_vars() | self.b.free_vars()

    def __str__(self) -> str:
        return f"({self.a} {self.op} {self.b})" if self.op in "+-" else f"{self.a}{self.op}{self.b}"

    __repr__ = __str__
    __hash__ = Expr.__hash__

    def linear(self) -> tuple[IntVar, int, int] | None:
        la, lb = _as_linear(self.a), _as_linear(self.b)
        if la is None or lb is None:
            return None
        (va, a1, a0), (vb, b1, b0) = la, lb
        if va is not None and vb is not None:
            return None
        v = va if va is not None else vb
        if self.op == "+":
            res = (v, a1 + b1, a0 + b0)
        elif self.op == "-":
            res = (v, a1 - b1, a0 - b0)
        elif self.op == "*" and (va is None or vb is None):
            res = (v, a1 * b0 + b1 * a0, a0 * b0)
        else:
            return None
        return (res[0], res[1], res[2]) if res[0] is not None else None


def _as_linear(e: Expr) -> tuple[IntVar | None, int, int] | None:
    if isinstance(e, IntVar):
        return (e, 1, 0)
    if isinstance(e, _Const):
        return (None, 0, e.value)
    lin = e.linear()
    return lin


@dataclass(eq=False, frozen=True)
class Cond:
    """A relation between spec expressions (``T % 8 == 0``), used as an assumption."""

    op: str
    a: Expr
    b: Expr

    def evaluate(self, env: dict[IntVar, int]) -> bool:
        return _CMPS[self.op](self.a.evaluate(env), self.b.evaluate(env))

    def free_vars(self) -> set[IntVar]:
        return self.a.free_vars() | self.b.free_vars()

    def __str__(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    __repr__ = __str__

    def __bool__(self) -> bool:
        raise TypeError(f"the spec assumption {self} has no truth value; pass it to ShapesSpec")


class IntVar(Expr):
    """A dynamic integer (scalar argument or dimension) with optional ``min``/``max``.

    ``optimization_hint`` is the size the compiler should tune for. Arithmetic gives derived
    expressions (``2 * A + 1``), comparisons give assumptions (``A % 2 == 0``). Identity defines
    the variable: two ``IntVar("n")`` are different variables.
    """

    _uids = itertools.count()

    def __init__(
        self,
        name: str | None = None,
        *,
        min: int | None = None,
        max: int | None = None,
        optimization_hint: int | None = None,
    ) -> None:
        for label, v in (("min", min), ("max", max), ("optimization_hint", optimization_hint)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{type(self).__name__} {label} must be an int, got {v!r}")
        if min is not None and max is not None and min > max:
            raise ValueError(f"{type(self).__name__}({name!r}) needs min <= max, got {min} > {max}")
        self.name = name if name is not None else "anon"
        self.uid = next(IntVar._uids)
        self.min = min
        self.max = max
        self.optimization_hint = optimization_hint

    def evaluate(self, env: dict[IntVar, int]) -> int:
        return env[self]

    def free_vars(self) -> set[IntVar]:
        return {self}

    def range_text(self) -> str:
        lo = "-inf" if self.min is None else str(self.min)
        hi = "inf" if self.max is None else str(self.max)
        return f"{lo} <= {self.name} <= {hi}"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        parts = [f"{self.name}#{self.uid}"]
        for k in ("min", "max", "optimization_hint"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k}={v}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def to_jsonable(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "name": self.name,
            "min": self.min,
            "max": self.max,
            "optimization_hint": self.optimization_hint,
        }

    __hash__ = Expr.__hash__


class ShapeVar(IntVar):
    """A dynamic dimension size: an :class:`IntVar` with ``min >= 0`` (default 0)."""

    def __init__(
        self,
        name: str | None = None,
        *,
        min: int = 0,
        max: int | None = None,
        optimization_hint: int | None = None,
    ) -> None:
        if min < 0:
            raise ValueError(
                f"ShapeVar requires min >= 0 (a shape dim is non-negative); got min={min}. "
                "Use IntVar(...) for unrestricted scalars."
            )
        super().__init__(name, min=min, max=max, optimization_hint=optimization_hint)


LeafIntSpec: TypeAlias = Expr | int | None


def _check_leaf(v: object, where: str) -> None:
    if v is None or isinstance(v, Expr):
        return
    if isinstance(v, int) and not isinstance(v, bool):
        return
    raise TypeError(f"{where}: expected LeafIntSpec, got {type(v).__name__}: {v!r}")


# ---------------------------------------------------------------------------------------------
# Containers
# ---------------------------------------------------------------------------------------------


class TensorSpec:
    """Per-dimension spec of one tensor: a list of leaves (variable, expression, int or STATIC)."""

    def __init__(self, dims: Sequence[LeafIntSpec]) -> None:
        for i, d in enumerate(dims):
            _check_leaf(d, f"TensorSpec dim {i}")
        self._specs: list[LeafIntSpec] = list(dims)

    def __getitem__(self, index: int) -> LeafIntSpec:
        return self._specs[index]

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[LeafIntSpec]:
        return iter(self._specs)

    def __repr__(self) -> str:
        return "TensorSpec([" + ", ".join(repr(s) for s in self._specs) + "])"

    def to_jsonable(self) -> dict[str, Any]:
        return {"type": "TensorSpec", "dims": [_json(d) for d in self._specs]}


class DictSpec:
    """Spec for a ``dict`` argument, per key (``str`` or ``int`` keys)."""

    def __init__(self, entries: dict[str | int, IntermediateSpec] | None = None) -> None:
        self._entries: dict[str | int, IntermediateSpec] = dict(entries) if entries else {}
        for k in self._entries:
            if not isinstance(k, (str, int)):
                raise TypeError(
                    f"DictSpec entries must have str or int keys, got {type(k).__name__}: {k!r}"
                )

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str | int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Any:
        return self._entries.items()

    def __repr__(self) -> str:
        return f"DictSpec({self._entries!r})"

    def to_jsonable(self) -> dict[str, Any]:
        return {"type": "DictSpec", "entries": {str(k): _json(v) for k, v in self._entries.items()}}


class ObjectSpec:
    """Spec for an arbitrary Python object's attributes: ``ObjectSpec({name: spec, ...})``.

    Values are leaf specs (``TensorSpec``, ``IntVar``, ``int``, ``STATIC``) or another
    ``ObjectSpec`` for attributes of attributes. Only :func:`torchport.compile` reaches into
    objects (torch.export and make_fx take tensors in pytrees, not objects).
    """

    def __init__(self, fields: dict[str, IntermediateSpec] | None = None) -> None:
        self._fields: dict[str, IntermediateSpec] = dict(fields) if fields else {}
        for k in self._fields:
            if not isinstance(k, str) or not k.isidentifier():
                raise TypeError(
                    f"ObjectSpec fields must be attribute names (identifiers), got "
                    f"{type(k).__name__}: {k!r}"
                )

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def items(self) -> Any:
        return self._fields.items()

    def __repr__(self) -> str:
        return f"ObjectSpec({self._fields!r})"

    def to_jsonable(self) -> dict[str, Any]:
        return {"type": "ObjectSpec", "fields": {k: _json(v) for k, v in self._fields.items()}}


class SeqSpec:
    """Spec for a ``list``/``tuple`` argument, per position; missing tail positions are static."""

    def __init__(self, entries: Sequence[IntermediateSpec]) -> None:
        self._entries: list[IntermediateSpec] = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"SeqSpec({self._entries!r})"

    def to_jsonable(self) -> dict[str, Any]:
        return {"type": "SeqSpec", "entries": [_json(v) for v in self._entries]}


LeafSpec: TypeAlias = "LeafIntSpec | TensorSpec"
IntermediateSpec: TypeAlias = "LeafIntSpec | TensorSpec | ObjectSpec | DictSpec | SeqSpec"


def _json(v: Any) -> Any:
    """A spec value as JSON-ready data (``to_jsonable`` of specs; expressions as text)."""
    if hasattr(v, "to_jsonable"):
        return v.to_jsonable()
    if isinstance(v, list):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json(x) for k, x in v.items()}
    if isinstance(v, Expr):
        return {"type": "Expr", "expr": str(v)}
    return v


class UnsupportedSpecError(NotImplementedError):
    """A part of 2.14's spec API that 2.14 itself reserves and does not implement yet."""


class ParamsSpec:
    """Specs for a function's parameters by name; ``"*args"`` (a list) and ``"**kwargs"`` (a dict)
    describe the variadic slots. Anything not named is static."""

    VARARGS = "*args"
    VARKW = "**kwargs"

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self._named: dict[str, Any] = {}
        self._varargs: list[Any] | None = None
        self._varkw: dict[str, Any] | None = None
        for key, value in (params or {}).items():
            if key == self.VARARGS:
                if not isinstance(value, list):
                    raise ValueError(
                        f"ParamsSpec {self.VARARGS!r} value must be a list of leaf specs, "
                        f"got {type(value).__name__}"
                    )
                self._varargs = list(value)
            elif key == self.VARKW:
                if not isinstance(value, dict):
                    raise ValueError(
                        f"ParamsSpec {self.VARKW!r} value must be a dict of leaf specs, "
                        f"got {type(value).__name__}"
                    )
                self._varkw = dict(value)
            elif key.startswith("*"):
                raise ValueError(
                    f"Unknown sentinel key {key!r} in ParamsSpec; only {self.VARARGS!r} and "
                    f"{self.VARKW!r} are reserved"
                )
            else:
                self._named[key] = value

    def __repr__(self) -> str:
        parts = {**self._named}
        if self._varargs is not None:
            parts[self.VARARGS] = self._varargs
        if self._varkw is not None:
            parts[self.VARKW] = self._varkw
        return f"ParamsSpec({parts!r})"

    def to_jsonable(self) -> dict[str, Any]:
        params: dict[str, Any] = {k: _json(v) for k, v in self._named.items()}
        if self._varargs is not None:
            params[self.VARARGS] = [_json(v) for v in self._varargs]
        if self._varkw is not None:
            params[self.VARKW] = {k: _json(v) for k, v in self._varkw.items()}
        return {"type": "ParamsSpec", "params": params}


class ShapesSpec:
    """The whole spec of a call: :class:`ParamsSpec` (or a plain dict) plus ``assumptions``, a list
    of relations between variables (``[B % 2 == 0, T <= 4 * B]``) checked on every call."""

    def __init__(
        self,
        params: ParamsSpec | dict[str, Any] | None = None,
        *,
        globals: Any = None,
        assumptions: Sequence[Cond] | None = None,
    ) -> None:
        if globals is not None:  # reserved in 2.14 too
            raise UnsupportedSpecError("ShapesSpec.globals is not supported yet")
        if isinstance(params, dict):
            params = ParamsSpec(params)
        elif params is not None and not isinstance(params, ParamsSpec):
            raise TypeError(
                f"shapes_spec must be ParamsSpec, dict, or None, got {type(params).__name__}"
            )
        self._params: ParamsSpec | None = params
        self._assumptions: list[Cond] = []
        for i, a in enumerate(assumptions or ()):
            if not isinstance(a, Cond):
                raise TypeError(
                    f"ShapesSpec.assumptions[{i}]: expected a relation between spec variables "
                    f"(e.g. B % 2 == 0), got {type(a).__name__}: {a!r}"
                )
            self._assumptions.append(a)

    @property
    def params(self) -> ParamsSpec | None:
        return self._params

    @property
    def assumptions(self) -> list[Cond]:
        return list(self._assumptions)

    def __repr__(self) -> str:
        return f"ShapesSpec({self._params!r}, assumptions={self._assumptions!r})"

    def to_jsonable(self) -> dict[str, Any]:
        return {
            "type": "ShapesSpec",
            "params": None if self._params is None else self._params.to_jsonable(),
            "assumptions": [str(a) for a in self._assumptions],
        }


def coerce_spec(x: object) -> ShapesSpec | None:
    """``None``, a dict, a :class:`ParamsSpec` or a :class:`ShapesSpec` → ``ShapesSpec | None``."""
    if x is None or isinstance(x, ShapesSpec):
        return x
    if isinstance(x, (dict, ParamsSpec)):
        return ShapesSpec(x)
    raise TypeError(
        f"dynamic spec expects a dict, ShapesSpec, or ParamsSpec, got {type(x).__name__}"
    )


SPEC_ATTR = "_dynamic_spec"


def dynamic_spec(spec: ShapesSpec | ParamsSpec | dict[str, Any]) -> Callable[[Any], Any]:
    """Attach a spec to a function or to an ``nn.Module``'s ``forward``.

    ``torchport.compile``, ``torchport.export`` and ``torchport.make_fx`` use it unless the call also
    passes ``dynamic_shapes=`` (then they raise ``ValueError``). Stacking two decorators raises.
    """
    resolved = coerce_spec(spec)
    if resolved is None:
        raise TypeError(
            "dynamic_spec(): `spec` must be a dict, ParamsSpec, or ShapesSpec, got NoneType."
        )

    def decorate(fn: Any) -> Any:
        if hasattr(fn, SPEC_ATTR):
            raise ValueError(
                "@dynamic_spec(...) is already attached to "
                f"{getattr(fn, '__qualname__', repr(fn))}. Stacking multiple @dynamic_spec "
                "decorators on the same function is not allowed; merge them into a single spec."
            )
        setattr(fn, SPEC_ATTR, resolved)
        return fn

    return decorate


def resolve_spec(fn: Any, dynamic_shapes: object) -> ShapesSpec | None:
    """The spec in force for ``fn``: the decorator's or ``dynamic_shapes`` (both → ValueError)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    attached = getattr(target, SPEC_ATTR, None)
    if attached is None:
        attached = getattr(fn, SPEC_ATTR, None)
    if attached is None:
        return coerce_spec(dynamic_shapes)
    if dynamic_shapes is not None:
        raise ValueError(
            "Both `@dynamic_spec(...)` is attached to the function/forward AND a "
            "`dynamic_shapes=` argument was passed. Provide only one."
        )
    assert isinstance(attached, ShapesSpec)
    return attached
