"""Translate a :class:`ShapesSpec` into torch 2.13's dynamic-shape mechanisms.

- ``torch.compile`` (:class:`SpecCompiled`): every call is checked against the spec in Python (so a
  violation is a :class:`DynamicSpecViolation`, not a guard failure or a recompile); then each spec'd
  dim is marked with ``torch._dynamo.mark_dynamic`` (bare variables carry their ``min``/``max``),
  top-level scalar ``IntVar`` parameters are listed in ``torch.compiler.config.dynamic_sources``, and
  the compile runs with size-oblivious backed symbols and no duck shaping, so sizes 0 and 1 and
  unequal-but-same-sized dims share one graph.
- ``torch.export`` (:func:`export`): bare variables become ``torch.export.Dim`` (shared by every slot
  naming the variable, so equality is part of the program), linear derived expressions become
  derived ``Dim``s, other expressions and the assumptions become ``torch._check`` calls in a prologue;
  every spec'd export is traced with ``prefer_deferred_runtime_asserts_over_guards=True`` (guards
  and checks become runtime asserts in the graph).
- ``make_fx`` (:func:`make_fx`): inputs are fakified with a ShapeEnv without 0/1 specialization or
  duck shaping, dynamic only where the spec says so, with ``[min, max]`` constraints; the returned
  GraphModule checks each call against the spec in a forward pre-hook.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree

from torchport.frontend.dynamic_spec import (
    DynamicSpecViolation,
    Expr,
    IntVar,
    ShapesSpec,
    UnsupportedSpecError,
    resolve_spec,
)
from torchport.frontend.spec_binding import Binding, bind, check_call, check_values
from torchport.native.launch import is_compiling_here


class SpecCompiled:
    """A ``torch.compile``d callable whose calls are checked against (and compiled for) a spec."""

    def __init__(
        self, fn: Callable[..., Any], spec: ShapesSpec, compile_fn: Callable[..., Any]
    ) -> None:
        self.fn = fn
        self.spec = spec
        self._compile_fn = compile_fn
        self.compiled: Callable[..., Any] | None = None
        self._bindings: dict[tuple[Any, ...], Binding] = {}
        self.relaxed: str | None = None  # why strict marking was dropped (the code specialises)
        self.traced = False  # a call went through the compiled function (a graph exists)

    def __getattr__(self, name: str) -> Any:
        """The compiled module's (or function's) attributes, as ``OptimizedModule`` gives them:
        ``.lin``, ``.state_dict()``; a method that returns the module (``.eval()``, ``.to()``)
        returns this wrapper, so ``torchport.compile(m).eval()`` stays compiled."""
        fn = self.__dict__.get("fn")  # (absent while unpickling or before __init__)
        if fn is None:
            raise AttributeError(name)
        attr = getattr(fn, name)
        if not (inspect.ismethod(attr) and attr.__self__ is fn):
            return attr

        @functools.wraps(attr)
        def method(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            return self if out is fn else out

        return method

    def binding(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Binding:
        """The spec bound to this call structure (cached per arity and keyword names)."""
        key = (len(args), tuple(kwargs), pytree.tree_structure((tuple(args), kwargs)))
        b = self._bindings.get(key)
        if b is None:
            b = self._bindings[key] = bind(self.fn, self.spec, args, kwargs, "torchport.compile")
        return b

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_compiling_here() or _make_fx_tracing_here():
            # traced by an outer torch.compile (``torch.compile(lambda x: spec_fn(x) + 1)``,
            # fullgraph too), export or make_fx: the function is inlined, and the outer trace
            # owns the graph (its sizes are dynamic as it decides; the spec's checks are for
            # calls). Not torch.compiler.is_compiling(): true in every thread while any thread
            # compiles, it let an eager call skip its checks (and its compile) then.
            return self.fn(*args, **kwargs)
        return self._call(*args, **kwargs)

    # Opaque to dynamo: traced, this Python (the spec checks, the marks) failed with an internal
    # error. (Reached only when not compiling; an outer compile's frame callback, active while a
    # frame of it runs eagerly after a graph break, would otherwise compile each frame of it.)
    @torch._dynamo.disable
    def _call(self, *args: Any, **kwargs: Any) -> Any:
        b = self.binding(args, kwargs)
        flat, tree = pytree.tree_flatten((args, kwargs))
        empty = any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in flat)
        if empty:
            flat = [_canonical_empty(t) for t in flat]
            args, kwargs = pytree.tree_unflatten(flat, tree)
        check_values(b, flat)
        if empty and not self.traced:
            # Tracing at an empty size would bake its degenerate strides into the graph (every
            # non-empty call would then recompile): run it eagerly (no elements, negligible work)
            # and trace at the first non-empty call, whose graph then serves empty calls too.
            return self.fn(*args, **kwargs)
        # the tensors _mark_dims may mark: the flat inputs and attributes an ObjectSpec reaches
        marks = _DimMarks([*flat, *(s.target(flat) for s in b.slots if s.dim is not None)])
        try:
            return self._call_marked(b, flat, args, kwargs, marks)
        finally:
            marks.restore()

    def _call_marked(
        self,
        b: Binding,
        flat: list[Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        marks: _DimMarks,
    ) -> Any:
        strict = self.relaxed is None
        scalars = _mark_dims(b, flat, strict=strict)
        if self.compiled is None:
            self.compiled = self._compile_fn(self.fn)
        # A frame whose strict compile fails (the code specialises a spec'd dim: a guard
        # ``T != 1``; or its size-oblivious trace fails at a size 0 or 1 that eager handles by
        # broadcasting) runs eagerly in this call (_spec_frames): the frames before it already
        # ran, so the call cannot be started again (their side effects would run twice).
        zero_one = strict and any(
            s.dim is not None and isinstance(s.spec, Expr) and s.target(flat).shape[s.dim] < 2
            for s in b.slots
        )
        config = _compile_config(scalars, size_oblivious=strict)
        call = _SpecCall(_frame_converters(self.compiled), strict, zero_one, config, marks)
        try:
            with config, _spec_frames(call):
                out = self.compiled(*args, **kwargs)
        except Exception:
            if call.escaped is None:
                raise
            # a fullgraph compile failed so (dynamo raises there) before any frame of the call
            # ran: the call runs again, relaxed (the ObjectSpec attributes' strict marks too);
            # relaxed for good only if it then completes (else the error is the user's)
            self.relaxed = call.escaped
            for t in [*flat, *(s.target(flat) for s in b.slots if s.dim is not None)]:
                for attr in ("_dynamo_dynamic_indices", "_dynamo_dynamic_range"):
                    if isinstance(t, torch.Tensor) and hasattr(t, attr):
                        delattr(t, attr)
            try:
                out = self._call_marked(b, flat, args, kwargs, marks)
            except BaseException:
                self.relaxed = None
                raise
            self._relax(call.escaped)
            return out
        # (only after the call completed: a frame run eagerly that raised is the user's error,
        # e.g. ``x @ w`` at a wrong size 1, not a specialisation)
        if call.reason is not None and self.relaxed is None:
            self._relax(call.reason)
        self.traced = True
        return out

    def _relax(self, reason: str) -> None:
        """From the next call on, compile with unenforced marks and without size-oblivious sizes.

        Sizes the code specialises on then get their own graph. Not size-oblivious: those decide
        ``numel == 0`` and ``size == 1`` without a guard, which the strict graph may (the spec
        says it holds for every size), but a graph that guards some sizes would then be served at
        0 and 1 without having been traced for them (the complex prod backward's ``numel == 0``
        branch: a [2, 1] gradient at size 0). Dynamo's own 0/1 specialisation guards them.
        """
        self.relaxed = reason
        warnings.warn(
            f"torchport.compile: the function specialises a dynamic dim of its spec "
            f"({reason}); sizes it specialises on will recompile",
            stacklevel=6,  # (_relax, _call_marked, _call, its dynamo.disable wrapper, __call__)
        )


_PROXY_KEY = torch._C._TorchDispatchModeKey.PROXY


def _make_fx_tracing_here() -> bool:
    """True while ``make_fx`` traces this thread's code.

    Its proxy mode is on this thread's dispatch-mode stack or, with ``pre_dispatch=True``, in
    torch's process-wide pre-dispatch slot with the PreDispatch key on for this thread (the
    thread that set it). Called eagerly, a ``torch.compile``d function refuses that trace ("using
    FX to symbolically trace a dynamo-optimized function"). Not ``torch.fx``'s tracing flag,
    which is process-wide.
    """
    if torch._C._get_dispatch_mode(_PROXY_KEY) is not None:
        return True
    return (
        torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch)
        and torch._ops._get_dispatch_mode_pre_dispatch(_PROXY_KEY) is not None
    )


class _SpecCall:
    """A spec'd call running on this thread: which frame compiles are its own, and (strict) why a
    frame of it fell back to eager."""

    def __init__(
        self,
        converters: tuple[Any, ...] | None,
        strict: bool,
        zero_one: bool,
        config: _compile_config,
        marks: _DimMarks,
    ) -> None:
        self.converters = converters  # the spec'd compile's ConvertFrameAsserts (None: unknown)
        self.strict = strict
        self.zero_one = zero_one  # a spec'd dim of this call has size 0 or 1
        self._config = config
        self._marks = marks
        self.reason: str | None = None  # a frame ran eagerly for this reason
        self.escaped: str | None = None  # a fullgraph frame raised for this reason
        self.ran = False  # a frame of this call was compiled (or run eagerly): it has run
        self._outer: _SpecCall | None = None  # the spec'd call this one runs inside

    def __enter__(self) -> None:
        self._outer = getattr(_FRAMES, "call", None)
        _FRAMES.call = self

    def __exit__(self, *exc: object) -> None:
        _FRAMES.call = self._outer

    def owns(self, converter: Any) -> bool:
        """True if ``converter`` compiles the spec'd function's frames (not another compile's)."""
        return self.converters is None or any(converter is c for c in self.converters)

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Another ``torch.compile``'s frame compiles as it would without the spec: without its
        config patches and without its marks on the caller's tensors."""
        with self._config.outside(), self._marks.hidden():
            yield

    def fallback_reason(self, e: BaseException) -> str | None:
        """Why the strict compile of a frame failed with ``e`` (None: ``e`` is not such a case)."""
        from torch._dynamo.exc import TorchRuntimeError
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        if not self.strict:
            return None
        if isinstance(e, ConstraintViolationError):
            lines = [ln.strip(" -") for ln in str(e).splitlines() if "Not all values" in ln]
            return lines[0] if lines else str(e).strip()
        if isinstance(e, TorchRuntimeError) and self.zero_one:
            # (x + w, w of size 4: a size-oblivious T = 1 is "not 1", so T must be 4)
            first = (str(e).strip().splitlines() or [""])[0]
            return f"its size-oblivious trace fails at a size 0 or 1: {type(e).__name__}: {first}"
        return None


def _frame_converters(compiled: Any) -> tuple[Any, ...] | None:
    """The ``ConvertFrameAssert`` objects that compile the frames of a ``torch.compile`` result.

    Each ``torch.compile`` makes its own: its ``OptimizeContext`` holds a ``CatchErrorsWrapper``
    around a ``ConvertFrame`` (whose ``_inner_convert`` is one) or, under ``fullgraph``, around
    one directly. A function's context is a cell of its ``compile_wrapper`` closure; a module's
    is ``dynamo_ctx``. None if they cannot be found (every frame is then taken as the spec's).
    Kept on ``compiled`` itself (found once, not per call): a deep copy of a wrapper shares its
    compiled function, or copies its compiled module with the converters that module then holds.
    """
    d = getattr(compiled, "__dict__", None)
    if d is None:  # (not a torch.compile result)
        return _find_frame_converters(compiled)
    found = d.get("_torchport_converters", _UNKNOWN)
    if found is _UNKNOWN:
        found = d["_torchport_converters"] = _find_frame_converters(compiled)
    return found


_UNKNOWN = object()


def _find_frame_converters(compiled: Any) -> tuple[Any, ...] | None:
    from torch._dynamo.convert_frame import ConvertFrameAssert

    ctx = getattr(compiled, "dynamo_ctx", None)
    callback = getattr(ctx, "callback", None)
    code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
    if callback is None and code is not None and cells:
        cell = dict(zip(code.co_freevars, cells)).get("callback")
        callback = None if cell is None else cell.cell_contents
    obj, found = callback, []
    for _ in range(4):  # CatchErrorsWrapper -> ConvertFrame -> ConvertFrameAssert
        if obj is None:
            break
        if isinstance(obj, ConvertFrameAssert):
            found.append(obj)
            break
        obj = getattr(obj, "_inner_convert", None) or getattr(
            obj, "_torchdynamo_orig_backend", None
        )
    return tuple(found) or None


_FRAMES = threading.local()  # .call: the _SpecCall running on this thread (or None)
_FRAMES_LOCK = threading.Lock()
_FRAMES_HOOKED = False  # dynamo's frame compile is patched (_hook_frames)


def _spec_frames(call: _SpecCall) -> _SpecCall:
    """``call`` as a context manager: inside, each frame compile on this thread is taken as
    ``call`` says.

    - A frame of another ``torch.compile`` (a compiled function the spec'd one calls) compiles
      as without the spec (:meth:`_SpecCall.outside`); its errors are its own.
    - A frame of the spec'd compile whose strict compile fails as
      :meth:`_SpecCall.fallback_reason` says runs eagerly this time (its callees are still
      compiled), and ``call.reason`` records why; under ``fullgraph`` the error propagates with
      ``call.escaped`` recording why, if no frame of the call has run yet.

    Dynamo raises such an error out of the whole call (only ``suppress_errors``, which hides every
    compile error, would run the frame eagerly instead); when it comes from a frame after a graph
    break, the frames before it have run. The patch is on dynamo's ``ConvertFrameAssert.__call__``
    (each frame's compile, with or without ``fullgraph``), active only while this thread runs a
    spec'd call.
    """
    if not _FRAMES_HOOKED:
        _hook_frames()
    return call


def _hook_frames() -> None:
    """Patch dynamo's ``ConvertFrameAssert.__call__`` as :func:`_spec_frames` says (once)."""
    global _FRAMES_HOOKED
    from torch._dynamo import convert_frame
    from torch._dynamo.types import ConvertFrameReturn

    with _FRAMES_LOCK:
        cls = convert_frame.ConvertFrameAssert  # (what ConvertFrame and fullgraph call)
        if not getattr(cls.__call__, "_torchport", False):
            original = cls.__call__

            def convert(self: Any, *args: Any, **kwargs: Any) -> Any:
                active: _SpecCall | None = getattr(_FRAMES, "call", None)
                if active is None:
                    return original(self, *args, **kwargs)
                if not active.owns(self):
                    _FRAMES.call = None
                    try:
                        with active.outside():
                            return original(self, *args, **kwargs)
                    finally:
                        _FRAMES.call = active
                try:
                    out = original(self, *args, **kwargs)
                except Exception as e:
                    reason = active.fallback_reason(e)
                    if reason is None:
                        raise
                    if self._one_graph:
                        # fullgraph: running the frame eagerly fails the call ("found no
                        # compiled frames"); this frame is the whole call: if none of it has
                        # run, the call can run again
                        if not active.ran:
                            active.escaped = reason
                        raise
                    active.ran = True
                    if active.reason is None:
                        active.reason = reason
                    # this frame, this time (apply_to_code=False: compiled again next call)
                    return ConvertFrameReturn(
                        apply_to_code=False, skip_reason=f"torchport dynamic spec: {reason}"
                    )
                active.ran = True
                return out

            convert._torchport = True  # type: ignore[attr-defined]
            cls.__call__ = convert  # type: ignore[method-assign]
        _FRAMES_HOOKED = True


_MARK_ATTRS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_hint_overrides",
    "_specialize_on",
    "_has_dynamo_dim_marking",
)


class _DimMarks:
    """The dynamo dim marks of the caller's tensors, restored after a spec'd call.

    ``mark_dynamic`` stores its marks on the tensor itself; left there, they would follow the
    caller's tensor into any other ``torch.compile`` (where a function that specialises the dim
    then fails with ``ConstraintViolationError``). The spec's marks are for this call only.
    """

    def __init__(self, flat: Sequence[Any]) -> None:
        # (the tensor's attribute dict, the marks it held); the marks are plain attributes, in
        # the instance dict (read directly: this runs on every call)
        self._saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
        seen: set[int] = set()
        for t in flat:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                d = t.__dict__
                # mark_dynamic adds to these sets and dicts in place: keep copies
                old = {a: copy.copy(d[a]) for a in _MARK_ATTRS if a in d} if d else {}
                self._saved.append((d, old))

    def restore(self) -> None:
        for d, old in self._saved:
            for a in _MARK_ATTRS:
                if a in old:
                    d[a] = copy.copy(old[a])  # (kept pristine for hidden())
                else:
                    d.pop(a, None)

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Inside: the caller's own marks (the spec's are put back after)."""
        current = [(d, {a: d[a] for a in _MARK_ATTRS if a in d}) for d, _ in self._saved]
        self.restore()
        try:
            yield
        finally:
            for d, marks in current:
                for a in _MARK_ATTRS:
                    if a in marks:
                        d[a] = marks[a]
                    else:
                        d.pop(a, None)


def _canonical_empty(t: Any) -> Any:
    """An empty tensor restrided as its sizes give without clamping: a 0 dim zeroes outer strides.

    torch gives an empty contiguous ``[2, 0, 4]`` tensor strides ``(4, 4, 1)`` (sizes clamped to 1),
    while the graph compiled for ``[2, T, 4]`` guards ``stride(0) == 4*T``: a size-0 inner dim would
    fail that guard and recompile (and dynamo's recompile then divides by the zero size). An empty
    tensor has no elements to address, so any strides are valid: keep the dim order of the strides
    and recompute them from the sizes, which satisfies the symbolic strides at ``T = 0``.
    """
    if not isinstance(t, torch.Tensor) or t.numel() != 0 or t.dim() < 2 or t.is_sparse:
        return t
    # outermost first; a tie comes from clamping (stride(outer) = stride(inner) * max(size, 1)),
    # so of two dims with equal strides the one of size <= 1 is the inner one
    given = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-given[d], t.shape[d] <= 1, d))
    strides = [0] * t.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= t.shape[d]
    if tuple(strides) == tuple(given):
        return t
    return t.as_strided(t.shape, strides)


def _pytree_only(b: Binding, api: str) -> None:
    """export/make_fx trace pytrees of tensors: an ObjectSpec (attributes) cannot reach them."""
    for s in b.slots:
        if s.attrs:
            raise ValueError(
                f"{api}: argument {s.where!r} is described by an ObjectSpec; {api} takes tensors "
                "in pytrees (tuples, lists, dicts), not object attributes. Pass the tensor as an "
                "argument (or use torchport.compile, which honours ObjectSpec)"
            )


def _mark_dims(b: Binding, flat: Sequence[Any], *, strict: bool = True) -> list[str]:
    seen: set[IntVar] = set()
    scalars: list[str] = []
    for s in b.slots:
        if not isinstance(s.spec, Expr):
            continue
        if s.dim is None:
            if s.source is not None:  # (an int in *args, **kwargs or a dict too)
                scalars.append(s.source)
            continue
        t = s.target(flat)
        # (a variable of max <= 1 is not marked strictly: dynamo's symbols for a size start at
        # 2 unless the size is 0 or 1, so [0, max] made an empty range, ValueRangeError; each
        # of its sizes gets a graph instead, as 0/1 specialisation gives)
        small = isinstance(s.spec, IntVar) and s.spec.max is not None and s.spec.max <= 1
        if strict and isinstance(s.spec, IntVar) and s.spec not in seen and not small:
            seen.add(s.spec)
            lo, hi = s.spec.min, s.spec.max
            if lo is None and hi is None:
                torch._dynamo.mark_dynamic(t, s.dim)
            else:  # dynamo wants both ends of a range
                torch._dynamo.mark_dynamic(
                    t, s.dim, min=0 if lo is None else lo, max=_INT_OO if hi is None else hi
                )
        else:
            torch._dynamo.maybe_mark_dynamic(t, s.dim)
    return scalars


_INT_OO = sys.maxsize - 1  # "no upper bound" for a dim range (dynamo's ranges are closed)


class _compile_config:
    """Config patches for a spec'd compile: size-oblivious backed sizes (unless
    ``size_oblivious=False``: the relaxed fallback), no duck shaping, Parameters as marked.

    Applied with torch's closure patchers (the low-overhead form of ``config.patch``, for calls
    on a hot path: this runs on every call), which restore each value as it was.
    """

    def __init__(self, scalars: list[str], *, size_oblivious: bool = True) -> None:
        self._patchers = _config_patchers(size_oblivious, ",".join(scalars))
        self._reverts: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        self._reverts = [patch() for patch in self._patchers]

    def __exit__(self, *exc: object) -> None:
        reverts, self._reverts = self._reverts, []
        for revert in reversed(reverts):
            revert()

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside (while entered): the values from before the patches."""
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()


@functools.lru_cache(maxsize=64)
def _config_patchers(
    size_oblivious: bool, dynamic_sources: str
) -> tuple[Callable[[], Callable[[], None]], ...]:
    """The closure patchers of :class:`_compile_config` (each call of one patches; it returns
    the function that reverts)."""
    patchers = [
        fx_config._make_closure_patcher(  # type: ignore[attr-defined]
            backed_size_oblivious=size_oblivious, use_duck_shape=False
        ),
        # torch 2.13's dynamo makes every nn.Parameter static (ignoring its dim marks): a
        # spec'd dim of a Parameter argument recompiled for every size. Unmarked Parameters
        # (a module's weights) stay static either way: their sizes do not change.
        torch._dynamo.config._make_closure_patcher(force_parameter_static_shapes=False),
    ]
    if dynamic_sources:
        patchers.append(
            torch.compiler.config._make_closure_patcher(  # type: ignore[attr-defined]
                dynamic_sources=dynamic_sources
            )
        )
    return tuple(patchers)


def _dim_name(v: IntVar) -> str:
    base = re.sub(r"\W", "_", v.name) or "d"
    if not re.match(r"[A-Za-z_]", base):
        base = "d" + base
    return f"{base}_{v.uid}"


def _unnamed_variables(b: Binding) -> set[IntVar]:
    """Variables that cannot be named Dims in torch.export: those a scalar int takes (ints take
    only ``Dim.DYNAMIC``) and those of a one-variable linear expression with a coefficient
    below 1 (derived Dims are increasing). Named, the in-graph check that ties such a variable
    to the int or the expression's size failed export's constraint check ("N_0 and
    L['args'][0] must always be equal", "... must always be related to the values of B_1 ...
    by ... = 70 - B_1"): every size of such a variable is ``Dim.DYNAMIC`` instead, and the
    prologue (:func:`_spec_checks`) checks its range and relations as runtime asserts."""
    out: set[IntVar] = set()
    for s in b.slots:
        if not isinstance(s.spec, Expr) or (isinstance(s.spec, IntVar) and s.dim is not None):
            continue
        lin = s.spec.linear()
        if s.dim is None or (lin is not None and lin[1] <= 0):
            out |= s.spec.free_vars()
    return out


def export_dynamic_shapes(b: Binding, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """torch.export ``dynamic_shapes`` (a flat-leaf-shaped pytree of Dims) and prologue checks."""
    from torch.export import Dim

    unnamed = _unnamed_variables(b)
    # a size a * V + b with b < 0 is a size only for V >= ceil(-b / a): export wants a derived
    # Dim's range non-negative, so the named V starts there (the spec allows no smaller V)
    lows: dict[IntVar, int] = {}
    for s in b.slots:
        lin = s.spec.linear() if s.dim is not None and isinstance(s.spec, Expr) else None
        if lin is not None and lin[1] > 0 and lin[2] < 0:
            lows[lin[0]] = max(lows.get(lin[0], 0), -(lin[2] // lin[1]))
    sizes = {s.spec for s in b.slots if s.dim is not None and isinstance(s.spec, IntVar)}
    dims: dict[IntVar, Any] = {}
    for v in b.variables():
        if v.max is not None and v.max <= 1 and v in sizes:
            raise UnsupportedSpecError(
                f"torchport.export: variable {v.name} has max={v.max}; torch 2.13's export "
                "cannot make a size of range [0, 1] dynamic (its size symbols start at 2). "
                "Give it max >= 2, or export the size as static"
            )
        lo = max(v.min if v.min is not None else 0, lows.get(v, 0))
        dims[v] = (
            Dim.DYNAMIC
            if v in unnamed
            else Dim(_dim_name(v), min=lo, max=v.max if v.max is not None else None)
        )
    per_leaf: dict[int, dict[int, Any]] = {}
    for s in b.slots:
        if s.dim is None or not isinstance(s.spec, Expr):
            continue
        spec = s.spec
        lin = spec.linear()
        if isinstance(spec, IntVar):
            d: Any = dims[spec]
        elif lin is None or lin[1] <= 0 or lin[0] in unnamed:
            d = Dim.DYNAMIC
        else:
            d = dims[lin[0]] * lin[1] + lin[2]
        per_leaf.setdefault(s.leaf, {})[s.dim] = d
    # a scalar the spec makes dynamic: export takes ints as dynamic only through Dim.DYNAMIC
    # (named Dims are for sizes); its range and relations are prologue checks
    scalars = {s.leaf for s in b.slots if s.dim is None and isinstance(s.spec, Expr)}
    flat, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    leaves = [
        per_leaf.get(i)
        if isinstance(x, torch.Tensor)
        else Dim.DYNAMIC
        if i in scalars and isinstance(x, int)
        else None
        for i, x in enumerate(flat)
    ]
    out_args, out_kwargs = pytree.tree_unflatten(leaves, tree)
    return out_args, out_kwargs


def _spec_checks(b: Binding, flat: Sequence[Any]) -> None:
    """Inside tracing: ``torch._check`` every relation of the spec on the symbolic sizes."""
    env: dict[IntVar, Any] = {}
    unnamed = _unnamed_variables(b)
    for s in b.slots:
        if isinstance(s.spec, IntVar):
            x = s.target(flat)
            val = x.shape[s.dim] if s.dim is not None else x
            if s.spec in env:
                torch._check(val == env[s.spec])
            else:
                env[s.spec] = val
                if s.dim is None or s.spec in unnamed:  # a named Dim's range is the Dim's
                    if s.spec.min is not None:
                        torch._check(val >= s.spec.min)
                    if s.spec.max is not None:
                        torch._check(val <= s.spec.max)
    for s in b.slots:
        if isinstance(s.spec, Expr) and not isinstance(s.spec, IntVar):
            x = s.target(flat)
            val = x.shape[s.dim] if s.dim is not None else x
            torch._check(val == s.spec.evaluate(env))
    for a in b.assumptions:
        torch._check(a.evaluate(env))


class _SpecModule(torch.nn.Module):
    """Wraps a function so that tracing it first asserts the spec's relations."""

    def __init__(self, fn: Callable[..., Any], b: Binding) -> None:
        super().__init__()
        self._fn = fn
        self._b = b

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = pytree.tree_leaves((args, kwargs))
        _spec_checks(self._b, flat)
        return self._fn(*args, **kwargs)


def export(
    mod: torch.nn.Module | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` that also accepts a :class:`ShapesSpec` (or ``@dynamic_spec``).

    A plain torch.export ``dynamic_shapes`` value (dict/tuple of Dims) is passed through. With a
    spec, each variable becomes a named Dim (unless export cannot name it: see
    :func:`_unnamed_variables`), and the assumptions and the relations Dims cannot state become
    runtime asserts in the graph. A module is exported itself (its parameters, buffers and
    constants keep the names plain ``torch.export.export`` gives them).
    """
    kwargs = dict(kwargs or {})
    raw = dynamic_shapes
    if isinstance(raw, (dict, tuple, list)) and not _looks_like_spec_dict(raw):
        if resolve_spec(mod, None) is not None:
            resolve_spec(mod, raw)  # raises: both given
        target = mod if isinstance(mod, torch.nn.Module) else _FnModule(mod)
        return torch.export.export(target, args, kwargs, dynamic_shapes=raw, strict=strict)
    spec = resolve_spec(mod, raw)
    if spec is None:
        target = mod if isinstance(mod, torch.nn.Module) else _FnModule(mod)
        return torch.export.export(target, args, kwargs, strict=strict)
    # size-oblivious backed sizes, as for compile and make_fx: an example size 0 or 1 is then
    # not specialised, and a derived size's range is not narrowed to the example's side of 1
    # (``B * T`` exported at B = 3 guarded B * T >= 4 and refused B = 1)
    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        return _export_spec(mod, spec, args, kwargs, strict)


def _export_spec(
    mod: torch.nn.Module | Callable[..., Any],
    spec: ShapesSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strict: bool,
) -> torch.export.ExportedProgram:
    # an empty example's clamped strides (torch gives [3, 0] strides (1, 1)) do not follow from
    # its sizes: traced with a symbolic size they divided by the example's 0 (ZeroDivisionError)
    args, kwargs = pytree.tree_map(_canonical_empty, (tuple(args), kwargs))
    b = bind(mod, spec, args, kwargs, "export")
    _pytree_only(b, "torchport.export")
    check_call(b, args, kwargs)
    ds_args, ds_kwargs = export_dynamic_shapes(b, args, kwargs)
    prologue = _needs_prologue(b)
    # under backed_size_oblivious a guard that holds over the whole range may not be provable
    # (``m[: x.shape[0]]`` with m [2*B+1] guarded B == min(B, 2*B + 1)): as a guard export
    # refused the spec ("Constraints violated"), so guards are deferred to runtime asserts on
    # every path (plain torch.export, without the oblivious sizes, proves it)
    if not kwargs and not prologue:
        # Dims express everything: export the module itself (parameter names unchanged)
        if isinstance(mod, torch.nn.Module):
            return torch.export.export(
                mod,
                args,
                dynamic_shapes=tuple(ds_args),
                strict=strict,
                prefer_deferred_runtime_asserts_over_guards=True,
            )
        # _FnModule.forward(*args): the Dims go under its variadic parameter's name
        ds = {"args": tuple(ds_args)}
        return torch.export.export(
            _FnModule(mod),
            args,
            dynamic_shapes=ds,
            strict=strict,
            prefer_deferred_runtime_asserts_over_guards=True,
        )
    module = isinstance(mod, torch.nn.Module)
    target = mod if isinstance(mod, torch.nn.Module) else _SpecModule(mod, b)
    shapes: Any = tuple(ds_args) if module else {"args": ds_args}
    if kwargs:
        # torch 2.13's export cannot match dynamic_shapes to a forward(*args, **kwargs) called
        # with keywords (AssertionError "Must provide a tree_name ..."): a function's wrapper
        # gets the user's signature, and the Dims go by parameter name
        signed = _signature(mod)
        if signed is None:
            raise ValueError(
                "torchport.export: keyword arguments with a spec need a function or forward "
                "with an inspectable signature; pass the arguments positionally"
            )
        named = {
            n
            for n, p in signed.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        extra = sorted(set(kwargs) - named)
        if extra:  # collected by **kwargs: the same torch failure
            raise ValueError(
                f"torchport.export: keyword arguments {extra} go to **kwargs, for which torch "
                "2.13's export cannot take dynamic shapes; name them as parameters or pass them "
                "positionally"
            )
        if not module:
            target = _signed_spec_module(mod, b, signed)
        shapes = dict(signed.bind(*ds_args, **ds_kwargs).arguments)
    hook = None
    if module and prologue:
        # the relations go in as a root pre-hook (export traces it) for this export only, not
        # as a wrapper module, whose own name would prefix every parameter and constant
        def checks(_m: Any, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> None:
            _spec_checks(b, pytree.tree_leaves((call_args, call_kwargs)))

        hook = target.register_forward_pre_hook(checks, prepend=True, with_kwargs=True)
    try:
        return torch.export.export(
            target,
            args,
            kwargs,
            dynamic_shapes=shapes,
            strict=strict,
            prefer_deferred_runtime_asserts_over_guards=True,
        )
    finally:
        if hook is not None:
            hook.remove()


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """The signature of ``fn`` (a module's ``forward``, without ``self``), or None."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return None if "self" in sig.parameters else sig


def _signed_spec_module(
    fn: Callable[..., Any], b: Binding, sig: inspect.Signature
) -> torch.nn.Module:
    """A :class:`_SpecModule` whose ``forward`` reports ``sig``, ``fn``'s signature."""

    def forward(self: _SpecModule, *args: Any, **kwargs: Any) -> Any:
        return _SpecModule.forward(self, *args, **kwargs)

    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[me, *sig.parameters.values()]
    )
    cls = type("_SignedSpecModule", (_SpecModule,), {"forward": forward})
    return cls(fn, b)


def _needs_prologue(b: Binding) -> bool:
    """True if the spec has relations Dims cannot state (assumptions, non-linear expressions)."""
    if b.assumptions:
        return True
    for s in b.slots:
        if s.dim is None and isinstance(s.spec, Expr):
            return True  # scalar variables: export specialises ints, so check them in-graph
        if isinstance(s.spec, Expr) and not isinstance(s.spec, IntVar):
            lin = s.spec.linear()
            if lin is None or lin[1] <= 0:
                return True
    return False


def _looks_like_spec_dict(x: object) -> bool:
    """True for a dict mapping parameter names to spec leaves/containers (not to Dims)."""
    from torchport.frontend.dynamic_spec import DictSpec, ObjectSpec, SeqSpec, TensorSpec

    if not isinstance(x, dict):
        return False
    kinds = (TensorSpec, SeqSpec, DictSpec, ObjectSpec, Expr)
    return any(isinstance(v, kinds) for v in x.values()) or any(
        isinstance(k, str) and k.startswith("*") for k in x
    )


class _FnModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self._fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


def make_fx(
    fn: Callable[..., Any],
    *,
    dynamic_shapes: Any = None,
    **make_fx_kwargs: Any,
) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx`` that traces with the spec's dynamic dims (``tracing_mode="symbolic"``).

    Returns ``trace(*args) -> GraphModule``. Without a spec it is ``make_fx(fn, **kwargs)``. With a
    spec, only spec'd dims are symbolic (with their ranges), the graph holds for sizes 0 and 1, and
    the GraphModule checks each call against the spec before running.
    """
    from torch.fx.experimental.proxy_tensor import make_fx as _make_fx

    spec = resolve_spec(fn, dynamic_shapes)
    if spec is None:
        return _make_fx(fn, **make_fx_kwargs)

    def trace(*args: Any) -> torch.fx.GraphModule:
        args = pytree.tree_map(_canonical_empty, args)  # (as export: an empty one's strides)
        b = bind(fn, spec, args, {}, "make_fx")
        _pytree_only(b, "torchport.make_fx")
        check_call(b, args, {})
        # size-oblivious: torch's own layout checks (is_contiguous) guard a dim >= 2 otherwise,
        # which the graph need not hold for (it holds for 0 and 1); the function's own guards
        # on a size remain, and every call is checked against them (_traced_guards)
        with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            fake_args = _fakify(b, args)
            flat_fake = pytree.tree_leaves(fake_args)

            def prologue_then_fn(*a: Any) -> Any:
                _spec_checks(b, flat_fake)
                return fn(*a)

            gm = _make_fx(prologue_then_fn, tracing_mode="symbolic", **make_fx_kwargs)(*fake_args)
            guards = _traced_guards(flat_fake)
        static = _static_sizes(fn, b, args)

        def check(_m: Any, call_args: tuple[Any, ...]) -> None:
            check_call(b, call_args, {})
            _check_static(static, call_args)
            if guards is not None:
                guards(call_args)

        gm.register_forward_pre_hook(check)
        return gm

    return trace


def _traced_guards(flat_fake: Sequence[Any]) -> Callable[[tuple[Any, ...]], None] | None:
    """A check of the guards the trace added on the spec's symbols, or None if it added none.

    A function that branches on a dynamic size (``x * 10 if x.shape[0] > 4 else x + 1``) is
    traced down one branch: the graph holds only where that branch's condition does, and a call
    past it computed the other branch's formula silently. The check raises
    :class:`DynamicSpecViolation` there instead (``torch.compile`` would recompile; a traced
    GraphModule cannot)."""
    idx = [i for i, x in enumerate(flat_fake) if isinstance(x, (torch.Tensor, torch.SymInt))]
    fakes = [flat_fake[i] for i in idx]
    env = next((t.fake_mode.shape_env for t in fakes if hasattr(t, "fake_mode")), None)
    if env is None:
        env = next((x.node.shape_env for x in fakes if isinstance(x, torch.SymInt)), None)
    if env is None or not env.guards:  # (the spec's ranges alone: check_call has them)
        return None
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    names = [f"t{j}" for j in range(len(idx))]
    # the sizes' and ints' guards (ranges as the trace narrowed them, relations); not the traced
    # layout's (stride and storage offset): a transposed input runs the graph correctly
    parts = [
        p
        for p in env.produce_guards(fakes, [LocalSource(n) for n in names])
        if ".stride()" not in p and ".storage_offset()" not in p
    ]
    if not parts:
        return None
    code = " and ".join(parts)
    compiled = compile(code, "<torchport.make_fx guards>", "eval")  # (once, not per call)

    def check(call_args: tuple[Any, ...]) -> None:
        flat = pytree.tree_leaves((tuple(call_args), {}))
        if not eval(compiled, SYMPY_INTERP, {"L": dict(zip(names, (flat[i] for i in idx)))}):
            got = [
                tuple(flat[i].shape) if isinstance(flat[i], torch.Tensor) else flat[i] for i in idx
            ]
            raise DynamicSpecViolation(
                "torchport.make_fx: the traced graph holds only where its guards hold "
                f"({code}); the call's tensor shapes and ints {got} fail them (the function "
                "specialised on a dynamic size or int while tracing: trace again for these)"
            )

    return check


def _static_sizes(
    fn: Callable[..., Any], b: Binding, args: Sequence[Any]
) -> list[tuple[str, int, int | None, int]]:
    """``(argument path, flat leaf, dim, size)`` of every tensor dim the spec leaves static (an
    ``int`` or ``STATIC`` slot, or a tensor the spec does not mention; ``dim`` None: the rank).

    The traced graph holds these sizes as constants (``x.shape[1]`` is a number in it), so a
    call with another size would compute with the traced one.
    """
    dynamic = {(s.leaf, s.dim) for s in b.slots if s.dim is not None and isinstance(s.spec, Expr)}
    paths, _ = pytree.tree_flatten_with_path((tuple(args), {}))
    names = _param_names(fn, len(args))
    out: list[tuple[str, int, int | None, int]] = []
    for i, (path, x) in enumerate(paths):
        if not isinstance(x, torch.Tensor):
            continue
        where = _arg_path(path, names)
        out.append((where, i, None, x.dim()))
        out.extend((where, i, d, int(x.shape[d])) for d in range(x.dim()) if (i, d) not in dynamic)
    return out


def _param_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of the first ``n`` positional arguments of ``fn`` (``*args[j]`` past them)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return [f"args[{k}]" for k in range(n)]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    pos = [p.name for p in params if p.kind in kinds]
    return [pos[k] if k < len(pos) else f"*args[{k - len(pos)}]" for k in range(n)]


def _arg_path(path: Sequence[Any], names: Sequence[str]) -> str:
    """``args[0]['ids']`` for the key path of a flat leaf of ``(args, {})``."""
    rest = pytree.keystr(tuple(path[2:])) if len(path) > 2 else ""
    k = getattr(path[1], "idx", None)
    head = names[k] if isinstance(k, int) and k < len(names) else pytree.keystr(tuple(path[:2]))
    return head + rest


def _check_static(static: Sequence[tuple[str, int, int | None, int]], call_args: Any) -> None:
    """Raise :class:`DynamicSpecViolation` if a static size differs from the traced one."""
    flat = pytree.tree_leaves((tuple(call_args), {}))
    for where, i, d, size in static:
        x = flat[i]
        if not isinstance(x, torch.Tensor):
            raise DynamicSpecViolation(
                f"argument {where!r}: traced as a tensor, got {type(x).__name__}"
            )
        if d is None and x.dim() != size:
            raise DynamicSpecViolation(
                f"argument {where!r}: expected a {size}-D tensor (as traced), got {x.dim()}-D"
            )
        if d is not None and int(x.shape[d]) != size:
            raise DynamicSpecViolation(
                f"argument {where!r} dim {d}: expected static size {size} (as traced; the spec "
                f"does not make this dim dynamic), got {int(x.shape[d])}"
            )


def _fakify(b: Binding, args: Sequence[Any]) -> Any:
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
        StrictMinMaxConstraint,
    )
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv(specialize_zero_one=False, duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    flat, tree = pytree.tree_flatten((tuple(args), {}))
    dyn: dict[int, dict[int, IntVar | Expr]] = {}
    for s in b.slots:
        if s.dim is not None and isinstance(s.spec, Expr):
            dyn.setdefault(s.leaf, {})[s.dim] = s.spec
    out: list[Any] = []
    for i, x in enumerate(flat):
        if type(x) is int:
            # a symbol, as make_fx would make it, but here: _traced_guards then sees the
            # guards the trace takes on it (``x * 10 if n > 4 else x + 1``)
            src = ConstantSource(f"int{i}")
            sym = env.create_symbol(x, src, positive=None)
            out.append(env.create_symintnode(sym, hint=x, source=src))
            continue
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        d = dyn.get(i, {})
        sizes = [DimDynamic.DYNAMIC if k in d else DimDynamic.STATIC for k in range(x.dim())]
        cons: list[Any] = []
        for k in range(x.dim()):
            v = d.get(k)
            if isinstance(v, IntVar) and (v.min is not None or v.max is not None):
                lo = 0 if v.min is None else max(v.min, 0)
                hi = v.max if v.max is not None else int(1e18)
                cons.append(StrictMinMaxConstraint(vr=ValueRanges(lo, hi), warn_only=False))
            else:
                cons.append(None)
        ctx: Any = StatelessSymbolicContext(dynamic_sizes=sizes, constraint_sizes=cons)
        out.append(mode.from_tensor(x, symbolic_context=ctx))
    fake_args, _ = pytree.tree_unflatten(out, tree)
    return fake_args
