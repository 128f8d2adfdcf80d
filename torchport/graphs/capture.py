"""Recording a capture: ATen ops seen by a dispatch mode become one replayable program.

While a :class:`~torchport.graphs.Graph` captures, :class:`Recorder` (a ``TorchDispatchMode``)
runs every ATen op for real and appends one statement per op to TorchScript source:
``v12 = torch.ops.aten.addmm(e3, v11, e4)``. Tensors created before the capture (weights,
static inputs, caches) are read by reference at replay, exactly like CUDA graphs read their
static buffers; in-place ops on them are replayed in place. :func:`~torchport.switch` and
:func:`~torchport.while_loop` called during a capture record every branch / the loop body as
nested blocks (``if``/``elif`` chains and ``while`` loops), so the replayed program takes
data-dependent branches and trip counts with no Python involved.

Alongside the source, each block keeps a structured trace (ops with their real tensors, and
``switch`` / ``while`` items holding their branch and body traces) that
:mod:`torchport.graphs.native` lowers to one C function when every op is supported; otherwise
the TorchScript source is compiled with ``torch.jit.CompilationUnit`` (milliseconds, no C++
compiler) and its C++ interpreter executes the ops. Either way replay costs one Python call.

Operations whose result Python would consume (``Tensor.item()``, ``bool(tensor)``, ops returning
Python numbers) are governed by the graph's ``capture_error_mode`` (see
:class:`~torchport.graphs.Graph`); ops taking an explicit ``torch.Generator``, non-ATen ops and
ops whose output shape depends on the data (``nonzero``, ``x[mask]``...) cannot be captured in
any mode: they raise :class:`CaptureError` naming the op, at capture time.
The exceptions are torchport's decode GEMV ops (:data:`CAPTURABLE_CUSTOM_OPS`): a quantized
``nn.Linear`` (NVFP4/MX/FP8 weights) inside a capture records one such op on plain tensors; and
``torch.profiler.record_function``'s enter/exit ops (an optimizer step opens one), which run at
capture time and record nothing: a replay has no profiler range of its own.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

from torchport.control.aliasing import storage_key

__all__ = ["CaptureError", "GraphError", "Program", "Recorder", "current_recorder"]


class _Active(threading.local):
    def __init__(self) -> None:
        self.stack: list[Recorder] = []
        self.bypass = 0  # > 0 while this thread's capture runs real work (_paused)


_TLS = _Active()


def active_stack() -> list[Recorder]:
    """This thread's capturing recorders (innermost last)."""
    return _TLS.stack


class CaptureError(RuntimeError):
    """An operation or value that a graph capture cannot record."""


class GraphError(RuntimeError):
    """A ``Graph`` method called in the wrong state (replay before capture, nested capture...),
    or a replay whose captured buffers were replaced since the capture."""


def current_recorder() -> Recorder | None:
    """The recorder of the innermost active (not paused) capture, or ``None``."""
    stack = _TLS.stack
    if stack and not stack[-1].paused:
        return stack[-1]
    return None


@contextlib.contextmanager
def _paused(rec: Recorder) -> Iterator[None]:
    """Run real (unrecorded) work during a capture."""
    old = rec.paused
    rec.paused = True
    _TLS.bypass += 1
    try:
        with _pop_mode_temporarily():
            yield
    finally:
        _TLS.bypass -= 1
        rec.paused = old


ERROR_MODES = ("default", "global", "thread_local", "relaxed")


class _GlobalBan:
    """Process-wide ban of Python-value ops while any capture in mode "global" runs.

    Like CUDA's ``cudaStreamCaptureModeGlobal``: a thread that is not capturing but calls
    ``Tensor.item()``, ``bool(tensor)`` or ``torch.equal`` on a CPU tensor while another thread
    captures gets a :class:`CaptureError`. Implemented by overriding those ops' CPU kernels
    (``torch.library``) for the duration of the capture, counted across concurrent captures; the
    capturing thread's own bookkeeping (``_paused``) reads the value through NumPy instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._lib: Any = None

    @staticmethod
    def _kernel(name: str) -> Callable[..., Any]:
        def blocked(*args: Any, **kwargs: Any) -> Any:
            if _TLS.bypass:
                a = args[0].detach().cpu()
                if name == "equal":
                    b = args[1].detach().cpu()
                    return bool(a.shape == b.shape and (a == b).all().float().numpy().item())
                v = a.float().numpy().item() if a.dtype == torch.bfloat16 else a.numpy().item()
                return bool(v) if name == "is_nonzero" else v
            raise CaptureError(
                f"graph capture (capture_error_mode='global'): aten.{name} (Tensor.item(), "
                "bool(tensor) or torch.equal) is prohibited on every thread while a graph "
                "captures; use capture_error_mode='thread_local' to allow it on other threads"
            )

        return blocked

    def acquire(self) -> None:
        import warnings

        with self._lock:
            self._count += 1
            if self._count == 1:
                lib = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                    for name in ("_local_scalar_dense", "is_nonzero", "equal"):
                        lib.impl(name, self._kernel(name), "CPU")
                self._lib = lib

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._lib is not None:
                self._lib._destroy()
                self._lib = None


global_ban = _GlobalBan()


class _ToListGuard:
    """``Tensor.tolist()`` refused on a capturing thread, as ``Tensor.item()`` is.

    ``tolist`` reads the values in C++ without dispatching an ATen op, so the recorder never
    saw it: ``if x.tolist()[0] > 0`` captured one branch silently. While any graph captures,
    ``torch.Tensor.tolist`` is a wrapper that raises :class:`CaptureError` on a thread whose
    capture is recording (not paused, no bypass) unless its mode is ``"relaxed"``; other threads
    and the capture's own bookkeeping are unaffected. Installed and removed by a count across
    concurrent captures.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._original: Any = None

    @staticmethod
    def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def tolist(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rec = current_recorder()
            # (only where the recorder's mode is on the stack, as for .item(): not inside an op
            # it dispatches, where a library's first build may read a table with tolist())
            if (
                rec is not None
                and not _TLS.bypass
                and rec.error_mode != "relaxed"
                and rec in _get_current_dispatch_mode_stack()
            ):
                raise CaptureError(
                    f"graph capture (capture_error_mode={rec.error_mode!r}): Tensor.tolist() "
                    "returns Python values, which a replay cannot repeat; data-dependent Python "
                    "control flow cannot be captured, use torchport.switch / "
                    "torchport.while_loop, or capture_error_mode='relaxed' to freeze the values"
                )
            return original(self, *args, **kwargs)

        return tolist

    def acquire(self) -> None:
        with self._lock:
            self._count += 1
            if self._count == 1:
                self._original = torch.Tensor.tolist
                torch.Tensor.tolist = self._wrap(self._original)  # type: ignore[method-assign]

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._original is not None:
                torch.Tensor.tolist = self._original  # type: ignore[method-assign]
                self._original = None


tolist_guard = _ToListGuard()


# torchport custom ops a capture records like ATen ops: the decode GEMVs that quantized linears
# (and torchport.compile's GEMV routing) call; the native tier calls their kernels directly
# (torchport.graphs.native_gemv), the TorchScript tier through the dispatcher.
CAPTURABLE_CUSTOM_OPS = frozenset({"torchport::gemv_packed", "torchport::gemv_dense"})

# torch.profiler.record_function's enter/exit (an optimizer's step() opens one): they mark a
# profiler range and touch no tensor data, so a capture runs them for real and records nothing;
# a replay is one call, with no range of its own (as a CUDA graph replay). They were refused as
# non-ATen ops, so no optimizer step and no record_function block could be captured.
_PROFILER_OPS = frozenset(
    {
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
    }
)

# Ops that hand a Python value back to the caller: the capture would freeze it.
_PYTHON_VALUE_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item", "is_same_size"}


def _functional_form(func: Any) -> Any:
    """The overload an ``out=`` overload (``out``, ``X_out``) or ``index.Tensor_hacked_twin``
    computes the result of (``default``, ``X``, ``index.Tensor``); any other op itself."""
    name = func._overloadname
    if name == "out":
        base = "default"
    elif name.endswith("_out"):
        base = name[: -len("_out")]
    elif name == "Tensor_hacked_twin":
        base = "Tensor"
    else:
        return func
    return getattr(func.overloadpacket, base, func)


def _data_dependent_shape(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True for an op whose output shape depends on its input values (``nonzero``,
    ``masked_select``, ``unique``, ``x[mask]``...), which torch tags ``dynamic_output_shape``.

    Some tagged ops have a fixed shape in the form called, and stay capturable: ``x[idx]``
    with integer indices (``aten.index.Tensor`` is tagged for its boolean-mask form) and
    ``repeat_interleave`` given ``output_size``. (``one_hot`` never reaches the recorder: ATen's
    is composite, and reads its indices' min and max with ``.item()`` before its ops, which
    the recorder refuses as a Python value even with ``num_classes`` given.)

    torch tags only some ``out=`` overloads (``nonzero.out`` and ``masked_select.out``, not
    ``index.Tensor_out``, ``unique_consecutive.out``, ``bincount.out``, ...), nor the TorchScript
    twin ``index.Tensor_hacked_twin``: those are judged by the functional overload they write
    out (``x[mask]`` through ``index.Tensor_out`` was recorded, its shape frozen).
    """
    func = _functional_form(func)
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    aten = torch.ops.aten
    if func is aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return repr(int(v))
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else '-float("inf")'
        return repr(v)
    if v is None:
        return "None"
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.device):
        return f'torch.device("{v}")'
    if isinstance(v, torch.layout):
        return str(v)
    if isinstance(v, torch.memory_format):
        return str(v)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise CaptureError(f"graph capture: symbolic value {v} cannot be captured")
    raise CaptureError(f"graph capture: cannot record the argument {v!r} ({type(v).__name__})")


def _list_type(jt: Any) -> str | None:
    """TorchScript annotation for a schema argument that is (optionally) a list."""
    if isinstance(jt, torch._C.OptionalType):
        jt = jt.getElementType()
    if isinstance(jt, torch._C.ListType):
        return str(jt).replace("SymInt", "int")
    return None


def layout(t: torch.Tensor) -> tuple[Any, ...]:
    """Where and how ``t`` lays out its elements now: storage address, offset, shape, strides
    and dtype (``(None, dtype)`` for a tensor without a storage)."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return (None, t.dtype)


def _seen(tensors: Any) -> tuple[tuple[torch.Tensor, tuple[Any, ...]], ...]:
    """Each tensor among ``tensors``' leaves with its :func:`layout` now, for a trace item.

    The native tier lowers an op with its tensors' layouts at lowering time; a later op of the
    capture that resizes one (``torch.mul(a, 2, out=y)`` on a smaller ``y``) or moves it to
    new memory changed them, so earlier ops on that tensor ran at its final size (reading out of
    bounds of the storage they had). The lowering compares with these and falls back to the
    TorchScript tier, which replays each op on its own tensors.
    """
    return tuple((t, layout(t)) for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor))


@dataclass
class _Scope:
    """Statements of one block and the names defined in it."""

    lines: list[str] = field(default_factory=list)
    indent: int = 1
    # For the native tier: ("op", func, args, kwargs, out, seen), ("switch", ..., seen),
    # ("while", ..., seen); ``seen`` holds the item's tensors with their layouts when recorded.
    trace: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass
class Program:
    """A compiled capture; ``run()`` replays it.

    ``tier`` is ``"native"`` (one C function over the capture's own buffers, see
    :mod:`torchport.graphs.native`) or ``"torchscript"`` (``fn(ext, outs)`` rewrites ``outs``).
    """

    source: str
    run: Callable[[], None]
    ext: list[torch.Tensor]
    outs: list[torch.Tensor]
    ops: int
    tier: str


class Recorder(TorchDispatchMode):
    """Runs ATen ops and records them as TorchScript statements (see module docstring)."""

    def __init__(self, error_mode: str = "default") -> None:
        super().__init__()
        self.error_mode = error_mode
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._keep: list[torch.Tensor] = []  # produced tensors, kept alive while capturing
        self.ext: list[torch.Tensor] = []
        self._ext_ids: dict[int, int] = {}
        self.scope = _Scope()
        self._counter = 0
        self.ops = 0
        self.produced: list[tuple[weakref.ref[torch.Tensor], str]] = []
        self.scopes_stack: list[_Scope] = []
        self.paused = False
        self._sub_out_names: dict[int, str] = {}
        self.has_control = False
        self._written_lists: list[str] = []  # list temporaries the current op writes into
        self.writes_lists = False  # the program keeps such lists in ``written`` (see finish)
        self._frozen: dict[str, tuple[Any, ...]] = {}  # layouts at capture_end (see freeze)

    # -- naming ---------------------------------------------------------------------------------
    def fresh(self, prefix: str = "v") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def bind(self, t: torch.Tensor, name: str) -> None:
        self._names[id(t)] = (weakref.ref(t), name)
        self._keep.append(t)
        if len(self.scopes_stack) == 0:
            self.produced.append((weakref.ref(t), name))

    def name_of(self, t: torch.Tensor) -> str:
        hit = self._names.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise CaptureError(
                f"graph capture: tensor subclass {type(t).__name__} cannot be captured"
            )
        k = self._ext_ids.get(id(t))
        if k is None or self.ext[k] is not t:
            k = len(self.ext)
            self.ext.append(t)
            self._ext_ids[id(t)] = k
        return f"e{k}"

    def _known(self, t: torch.Tensor) -> bool:
        hit = self._names.get(id(t))
        if hit is not None and hit[0]() is t:
            return True
        k = self._ext_ids.get(id(t))
        return k is not None and self.ext[k] is t

    def _storages(self, skip: set[str] | None = None) -> set[tuple[str, int]]:
        """Storage addresses of the static inputs and of the tensors named now (but ``skip``)."""
        found = {storage_key(t) for t in self.ext}
        for ref, name in self._names.values():
            t = ref()
            if t is not None and (skip is None or name not in skip):
                found.add(storage_key(t))
        return found

    def emit(self, line: str) -> None:
        self.scope.lines.append("    " * self.scope.indent + line)

    # -- ops ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        opname = f"aten.{func._schema.name.split('::')[-1]}.{func._overloadname}"
        base = func._schema.name.split("::")[-1]
        if func._schema.name in _PROFILER_OPS:
            return func(*args, **kwargs)
        if (
            func._schema.name.split("::")[0] not in ("aten", "prim")
            and func._schema.name not in CAPTURABLE_CUSTOM_OPS
        ):
            raise CaptureError(
                f"graph capture: {func} is not an ATen op; only ATen ops (and torchport's decode "
                "GEMV ops) can be captured"
            )
        if base in _PYTHON_VALUE_OPS:
            if self.error_mode == "relaxed":
                # Allowed, as documented for "relaxed": the value is read now and frozen into
                # the program (nothing is recorded for it).
                return func(*args, **kwargs)
            raise CaptureError(
                f"graph capture: {opname} returns a Python value (Tensor.item(), bool(tensor), "
                "or a composite op reading its input's values, as one_hot does to check its "
                "indices); data-dependent Python control flow cannot be captured, use "
                "torchport.switch / torchport.while_loop instead"
            )
        if _data_dependent_shape(func, args, kwargs):
            # A replay cannot change an output's shape: the program would run the op on new
            # data and copy its differently-sized result into the capture-time buffer, which
            # broadcasts (nonzero's 3 rows became 3 copies of the 1 row found at replay).
            raise CaptureError(
                f"graph capture: {opname} returns a tensor whose shape depends on the input "
                "values, which a replay cannot follow (shapes are frozen at capture time); use "
                "a fixed-size form instead (nonzero_static, torch.where with a mask, integer "
                "indices)"
            )
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Generator):
                raise CaptureError(
                    f"graph capture: {opname} takes an explicit torch.Generator, which cannot be "
                    "captured; use the default generator"
                )
        if base in ("lift_fresh", "lift_fresh_copy"):
            return self._lift(func, args[0])
        call = self._format_call(func, args, kwargs)
        # The op's kernel may read a value itself (multinomial's checks of its probabilities,
        # a GEMV's first call building and tuning its kernel): work a replay repeats inside the
        # op, not a value handed to Python, so it passes the ban of capture_error_mode "global"
        # (which refused torch.multinomial as if the user had called .item()). A value the
        # user's code reads reaches this method as its own op first, refused above.
        _TLS.bypass += 1
        try:
            out = func(*args, **kwargs)
        finally:
            _TLS.bypass -= 1
        self.ops += 1
        self.scope.trace.append(
            ("op", func, tuple(args), dict(kwargs), out, _seen((args, kwargs, out)))
        )
        self._bind_outputs(opname, call, out)
        for tmp in self._written_lists:
            # An op writing into the tensors of a list (``_foreach_mul_``, ``_foreach_add_``:
            # a foreach optimizer step) returns nothing, and TorchScript's dead-code elimination
            # sees it write only the list literal, which nothing read: it dropped the op, so a
            # replay left the tensors unchanged. The list kept in the program's result is live.
            self.emit(f"written.append({tmp})")
            self.writes_lists = True
        return out

    def _lift(self, func: Any, const: torch.Tensor) -> torch.Tensor:
        """``torch.tensor(...)`` made in the capture (``aten.lift_fresh[_copy]`` of a constant).

        Eager makes a fresh tensor holding the constant on every call; read by reference as a
        static input, the constant itself would keep the in-place updates of earlier replays
        (``total = torch.tensor(0.0); total += ...`` summed 12, then 24, 36...). A hidden copy
        of the constant is the static input, and every replay starts the tensor from it.
        """
        out = func(const)
        snapshot = torch.ops.aten.clone.default(const)  # the dispatcher, not this mode
        n = self.fresh()
        self.emit(f"{n} = torch.ops.aten.clone({self.name_of(snapshot)})")
        self.ops += 1
        self.scope.trace.append(
            ("op", torch.ops.aten.copy_.default, (out, snapshot), {}, out, _seen((out, snapshot)))
        )
        self.bind(out, n)
        return out

    def _format_call(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        parts = []
        self._written_lists = []
        for i, sa in enumerate(func._schema.arguments):
            if sa.kwarg_only:
                if sa.name not in kwargs:
                    continue
                v = kwargs[sa.name]
            elif i < len(args):
                v = args[i]
            elif sa.name in kwargs:
                v = kwargs[sa.name]
            else:
                continue
            text = self._arg_text(v, sa.type)
            if sa.is_write and isinstance(v, (list, tuple)):
                self._written_lists.append(text)
            parts.append(f"{sa.name}={text}" if sa.kwarg_only else text)
        name = func._schema.name.split("::")[-1]
        ns = func._schema.name.split("::")[0]
        return f"torch.ops.{ns}.{name}({', '.join(parts)})"

    def _arg_text(self, v: Any, jt: Any) -> str:
        if isinstance(v, torch.Tensor):
            return self.name_of(v)
        if isinstance(v, (list, tuple)):
            items = [self.name_of(x) if isinstance(x, torch.Tensor) else _literal(x) for x in v]
            ann = _list_type(jt) or "List[Tensor]"
            tmp = self.fresh("l")
            self.emit(f"{tmp}: {ann} = [{', '.join(items)}]")
            return tmp
        return _literal(v)

    def _bind_outputs(self, opname: str, call: str, out: Any) -> None:
        if out is None:
            self.emit(call)
            return
        if isinstance(out, torch.Tensor):
            if self._known(out):  # in-place / out= op: the result is a tensor we already name
                self.emit(call)
                return
            n = self.fresh()
            self.emit(f"{n} = {call}")
            self.bind(out, n)
            return
        if isinstance(out, (tuple, list)) and all(
            isinstance(o, torch.Tensor) or o is None for o in out
        ):
            n = self.fresh("t")
            self.emit(f"{n} = {call}")
            for i, o in enumerate(out):
                if o is not None and not self._known(o):
                    m = self.fresh()
                    self.emit(f"{m} = {n}[{i}]")
                    self.bind(o, m)
            return
        raise CaptureError(
            f"graph capture: {opname} returned {type(out).__name__} {out!r}; ops whose result "
            "is a Python value cannot be captured"
        )

    # -- blocks ---------------------------------------------------------------------------------
    def _sub(
        self, fn: Callable[..., Any], args: Sequence[Any]
    ) -> tuple[Any, list[str], list[tuple[Any, ...]]]:
        """Run ``fn(*args)`` recording into a fresh block one level deeper."""
        outer = self.scope
        self.scopes_stack.append(outer)
        saved = dict(self._names)
        self.scope = _Scope(indent=outer.indent + 1)
        try:
            out = fn(*args)
            lines, trace = self.scope.lines, self.scope.trace
        finally:
            self.scope = outer
            self.scopes_stack.pop()
        self._sub_out_names = {
            id(t): self._names[id(t)][1] for t in _tensors(out) if id(t) in self._names
        }
        self._names = saved
        return out, lines, trace

    def _value_name(self, t: torch.Tensor) -> str:
        n = self._sub_out_names.get(id(t))
        return n if n is not None else self.name_of(t)

    def record_switch(
        self, index: torch.Tensor, branches: Sequence[Callable[..., Any]], operands: Sequence[Any]
    ) -> Any:
        """Record an N-way branch; return the chosen branch's (copied) outputs."""
        self.has_control = True
        idx = self.fresh("i")
        self.emit(f"{idx} = int({self.name_of(index)})")
        with _paused(self):
            chosen = int(index.item())
        # Tensors named before the switch: a branch returning one must copy it, as the eager
        # switch output is a copy (an alias would follow later in-place ops on it).
        outer = {name for _, name in self._names.values()}
        results = []
        blocks = []
        traces = []
        for b in branches:
            out, lines, trace = self._sub(b, operands)
            leaves, spec = pytree.tree_flatten(out)
            names = [self._value_name(x) if isinstance(x, torch.Tensor) else None for x in leaves]
            results.append((leaves, spec, names))
            blocks.append(lines)
            traces.append((trace, leaves))
        spec0 = results[0][1]
        for i, (_, spec, _) in enumerate(results):
            if spec != spec0:
                from torchport.control.switch import SwitchError

                raise SwitchError(
                    "switch: branches must return the same output structure; branch0 returns "
                    f"{spec0} but branch{i} returns {spec}"
                )
        outs = [self.fresh("s") for _ in results[0][0]]
        operand_names = {self.name_of(o) for o in operands if isinstance(o, torch.Tensor)}
        # A branch's view of an operand or outer tensor (``a[0:2]``) has a name of its own but
        # the memory of a tensor named before: it must be copied too, or the output would follow
        # later in-place ops on that tensor (at replay only: the capture clones every output).
        memory = self._storages() | {
            storage_key(o) for o in operands if isinstance(o, torch.Tensor)
        }
        for j, leaf0 in enumerate(results[0][0]):
            for i, (leaves, _, _) in enumerate(results):
                x = leaves[j]
                if isinstance(leaf0, torch.Tensor) != isinstance(x, torch.Tensor) or (
                    isinstance(x, torch.Tensor)
                    and (x.shape != leaf0.shape or x.dtype != leaf0.dtype)
                ):
                    from torchport.control.switch import SwitchError

                    raise SwitchError(
                        f"switch: output {j} of branch{i} ({_describe(x)}) does not match "
                        f"branch0's ({_describe(leaf0)}); a captured switch needs equal shapes "
                        "and dtypes"
                    )
                if not isinstance(x, torch.Tensor) and x != leaf0:
                    from torchport.control.switch import SwitchError

                    raise SwitchError(
                        f"switch: output {j} is {leaf0!r} in branch0 but {x!r} in branch{i}; "
                        "a captured graph cannot return a data-dependent Python int"
                    )
        for i, (lines, (leaves, _, names)) in enumerate(zip(blocks, results)):
            kw = "if" if i == 0 else ("elif" if i < len(blocks) - 1 else "else")
            head = f"{kw} {idx} == {i}:" if kw != "else" else "else:"
            self.emit(head)
            self.scope.lines.extend(lines)
            pad = "    " * (self.scope.indent + 1)
            for j, n in enumerate(names):
                if n is not None:
                    outside = n in operand_names or n in outer or n.startswith("e")
                    outside = outside or storage_key(leaves[j]) in memory
                    src = f"{n}.clone()" if outside else n
                    self.scope.lines.append(f"{pad}{outs[j]} = {src}")
            if not any(n is not None for n in names):
                self.scope.lines.append(f"{pad}pass")
        leaves, spec, _ = results[chosen]
        final = []
        with _paused(self):
            for j, x in enumerate(leaves):
                if isinstance(x, torch.Tensor):
                    c = x.clone()
                    self.bind(c, outs[j])
                    final.append(c)
                else:
                    final.append(x)
        seen = _seen((index, final, [leaves for _, leaves in traces]))
        self.scope.trace.append(("switch", index, traces, final, seen))
        return pytree.tree_unflatten(final, spec)

    def record_while(
        self, cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Record a loop with a data-dependent trip count; return the final carried values."""
        self.has_control = True
        from torchport.control.while_loop import (
            WhileLoopError,
            body_values,
            check_body_output,
            check_pred,
        )

        leaves, spec = pytree.tree_flatten(carried)
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                raise WhileLoopError(
                    f"while_loop: inside a graph capture every carried value must be a tensor "
                    f"(use a 0-dim int64 tensor for counters), got {type(x).__name__} {x!r}"
                )
        loop_vars = [self.fresh("w") for _ in leaves]
        for n, x in zip(loop_vars, leaves):
            self.emit(f"{n} = {self.name_of(x)}.clone()")
        with _paused(self):
            probes = [x.clone() for x in leaves]
        for n, p in zip(loop_vars, probes):
            self._names[id(p)] = (weakref.ref(p), n)
            self._keep.append(p)

        def run_cond(*xs: Any) -> Any:
            return cond_fn(*pytree.tree_unflatten(list(xs), spec))

        def run_body(*xs: Any) -> Any:
            out = body_values(body_fn(*pytree.tree_unflatten(list(xs), spec)), len(carried))
            check_body_output(tuple(pytree.tree_unflatten(list(xs), spec)), out)
            return pytree.tree_leaves(out)

        versions = [p._version for p in probes]
        pred, cond_lines, cond_trace = self._sub(run_cond, probes)
        if not isinstance(pred, torch.Tensor) or pred.numel() != 1 or pred.dtype != torch.bool:
            raise WhileLoopError(
                "while_loop: inside a graph capture cond_fn must return a one-element bool "
                f"tensor, got {_describe(pred)}"  # (a tensor's repr reads its values: banned)
            )
        pred_name = self._value_name(pred)
        # Tensors named before the loop (other than its own variables): a body returning one
        # must copy it, or the loop variable would alias it and follow later in-place ops.
        outer = {name for _, name in self._names.values()} - set(loop_vars)
        body_out, body_lines, body_trace = self._sub(run_body, probes)
        for k, (p, v) in enumerate(zip(probes, versions)):
            if p._version != v:
                # The captured loop runs on copies of the carried values, so the caller's
                # tensor was silently left unchanged where eager mutates it; torch.while_loop
                # refuses input mutation when traced, and so does the capture.
                raise WhileLoopError(
                    f"while_loop: cond_fn or body_fn modifies carried value {k} "
                    f"({_describe(leaves[k])}) in place, which a graph capture cannot replay "
                    "(the captured loop works on copies); return a new tensor instead"
                )
        # A body's view of an outer tensor (``cache[1:3]``) shares its memory: copied too.
        memory = self._storages(skip=set(loop_vars))
        body_names = [
            f"{b}.clone()" if b in outer or b.startswith("e") or storage_key(t) in memory else b
            for b, t in zip(map(self._value_name, body_out), body_out)
        ]
        pad = "    " * self.scope.indent
        self.scope.lines.extend(_dedent(cond_lines, 1))
        self.emit(f"while bool({pred_name}):")
        self.scope.lines.extend(body_lines)
        tmp = [self.fresh("n") for _ in loop_vars]
        for t, b in zip(tmp, body_names):
            self.scope.lines.append(f"{pad}    {t} = {b}")
        for n, t in zip(loop_vars, tmp):
            self.scope.lines.append(f"{pad}    {n} = {t}")
        # The second copy of the condition re-declares its typed list temporaries: rename them.
        self.scope.lines.extend(re.sub(r"\b(l\d+)\b", r"\1_r", ln) for ln in cond_lines)
        # The real values: run the loop eagerly, outside the recorder.
        with _paused(self):
            vals = [x.clone() for x in leaves]
            while check_pred(cond_fn(*pytree.tree_unflatten(vals, spec))):
                out = body_values(body_fn(*pytree.tree_unflatten(vals, spec)), len(carried))
                vals = [x.clone() for x in pytree.tree_leaves(out)]
        for n, v in zip(loop_vars, vals):
            self.bind(v, n)
        seen = _seen((leaves, probes, pred, body_out, vals))
        self.scope.trace.append(
            ("while", leaves, probes, cond_trace, pred, body_trace, list(body_out), vals, seen)
        )
        return tuple(pytree.tree_unflatten(vals, spec))

    # -- finishing ------------------------------------------------------------------------------
    def _outputs(self) -> tuple[list[torch.Tensor], list[str]]:
        """The produced tensors still alive (the static outputs) and their names."""
        outs: list[torch.Tensor] = []
        out_names: list[str] = []
        seen: set[int] = set()
        for ref, name in self.produced:
            t = ref()
            if t is not None and id(t) not in seen:
                hit = self._names.get(id(t))
                if hit is not None and hit[0]() is t and hit[1] == name:
                    seen.add(id(t))
                    outs.append(t)
                    out_names.append(name)
        return outs, out_names

    def _watched(
        self, outs: list[torch.Tensor], out_names: list[str]
    ) -> tuple[list[torch.Tensor], list[str]]:
        """The static inputs and the static outputs ``outs``, with their labels."""
        labels = [f"static input e{k}" for k in range(len(self.ext))]
        return [*self.ext, *outs], labels + [f"static output {n}" for n in out_names]

    def freeze(self) -> None:
        """Note the static inputs' and outputs' layouts as the capture ends.

        ``finish`` checks replays against these, not against the layouts it finds: with
        ``keep_graph`` it runs at the first replay, and an ``x.t_()`` or a shrinking
        ``x.resize_()`` in between became the layout the replays expected (the native tier read
        out of bounds with it, the TorchScript tier broadcast into the outputs).
        """
        self._frozen = {
            label: (t.data_ptr(), t.shape, t.stride(), t.dtype)
            for t, label in zip(*self._watched(*self._outputs()))
        }

    def finish(self) -> Program:
        """Compile the recording; outputs are the produced tensors still alive now."""
        trace, self.scope.trace = self.scope.trace, []
        from torchport.graphs.native import lower

        low = lower(trace, self.ext)
        del trace  # the recorded intermediates die here, unless the caller kept them
        self._keep.clear()
        outs, out_names = self._outputs()
        watch, labels = self._watched(outs, out_names)
        now = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in watch]
        then = [self._frozen.get(label, v) for label, v in zip(labels, now)]
        if low is not None:
            run, guard, csrc = low
            guard(watch, labels, [(p, size, stride) for p, size, stride, _ in then])
            return Program(csrc, run, [], [], self.ops, "native")
        head = ["def prog(ext: List[Tensor], outs: List[Tensor]):"]
        head += [f"    e{k} = ext[{k}]" for k in range(len(self.ext))]
        tail = [_copy_out(j, n, t) for j, (n, t) in enumerate(zip(out_names, outs))]
        if self.writes_lists:
            head.append("    written: List[List[Tensor]] = []")
            tail.append("    return written")
        else:
            tail.append("    return None")
        source = "\n".join([*head, *self.scope.lines, *tail]) + "\n"
        try:
            cu = torch.jit.CompilationUnit(source)
        except RuntimeError as e:
            raise CaptureError(f"graph capture: the recorded program does not compile: {e}") from e
        fn, ext = cu.prog, list(self.ext)
        # The program follows the tensors it is given, so a static input whose shape changed
        # since the capture (set_, resize_) would run every op at the new shape and copy_ the
        # results into the capture-shape outputs, which broadcasts: x resized from 3 elements to
        # 1 gave y = x * 2 as 3 copies of one value; one whose dtype changed (x.data = ...) ran
        # every op in the new dtype and cast the results silently. Check shapes and dtypes first
        # (~0.1 us a tensor each).
        shapes = [size for _, size, _, _ in then]
        dtypes = [dtype for _, _, _, dtype in then]
        if any(t.is_inference() for t in outs):
            # Outputs made under inference_mode are inference tensors, which only inference
            # mode may write in place: replay there wherever it is called from.
            def run_ts() -> None:
                if list(map(_size, watch)) != shapes or list(map(_dtype, watch)) != dtypes:
                    _reshaped(watch, shapes, dtypes, labels)
                with torch._C._InferenceMode(True):
                    _run_program(fn, ext, outs)

        else:
            # Replay leaves autograd alone, as the native tier and CUDA graphs do: under grad
            # mode the copy_ into the outputs made an output captured under no_grad from a
            # Parameter require grad (grad_fn CopyBackwards), building a graph every replay.
            def run_ts() -> None:
                if list(map(_size, watch)) != shapes or list(map(_dtype, watch)) != dtypes:
                    _reshaped(watch, shapes, dtypes, labels)
                prev = torch.is_grad_enabled()
                torch._C._set_grad_enabled(False)
                try:
                    _run_program(fn, ext, outs)
                finally:
                    torch._C._set_grad_enabled(prev)

        return Program(source, run_ts, ext, outs, self.ops, "torchscript")


def _run_program(fn: Any, ext: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Run a TorchScript-tier program. Its ``int(index)`` / ``bool(pred)`` of a switch or loop
    are the replay's own reads, not Python consuming a value: they pass the ban of another
    thread's capture in mode "global" (which raised an untyped RuntimeError from the replay).

    The program runs with TorchScript's graph optimisations off (the flag is this thread's, and
    restored): they rewrite what was captured, so a replay ran other ops than eager did; its
    ``DecomposeOps`` turns ``addmm`` (every ``nn.Linear``) into ``mm`` + ``add``, which rounds
    the product before the bias is added: bfloat16 replays differed from eager by up to 0.5 on
    values ~30-60. The unoptimised plan runs the recorded ops, one per statement (the optimised
    one had no other gain here: no guards or fusion for tensors passed in lists); the toggle
    costs under 1.6 us a replay (a 12-op MLP replays in 55-110 us).

    Inside ``torch.autocast`` the program runs with the CPU autocast key excluded: the recorded
    ops are the ones autocast chose at capture (casts included), and a replay applying it again
    ran a float32 capture's matmul in bfloat16 (0.48 off); the native tier and CUDA graphs
    replay what was captured whatever the ambient autocast state.
    """
    _TLS.bypass += 1
    optimize = _get_optimize()
    if optimize:
        _set_optimize(False)
    try:
        if _any_autocast():
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                fn(ext, outs)
        else:
            fn(ext, outs)
    finally:
        if optimize:
            _set_optimize(True)
        _TLS.bypass -= 1


_get_optimize = torch._C._get_graph_executor_optimize
_any_autocast = torch._C._is_any_autocast_enabled
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_set_optimize = torch._C._set_graph_executor_optimize


def _copy_out(j: int, name: str, t: torch.Tensor) -> str:
    """The statement rewriting static output ``j`` (``t``) with the replay's value ``name``.

    An output with stride-0 dimensions (``expand``) has elements sharing memory, which
    ``copy_`` refuses to write ("more than one element of the written-to tensor refers to a
    single memory location": every replay of ``y = x.exp().expand(2, 3)`` failed); both sides
    are narrowed to one slice along those dimensions, which the replayed value (the same op
    at the same shapes) repeats too.
    """
    dims = [d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1]
    cut = "".join(f".narrow({d}, 0, 1)" for d in dims)
    part = t
    for d in dims:
        part = part.narrow(d, 0, 1)
    if torch._debug_has_internal_overlap(part) == 1:  # 1: MemOverlap::Yes, copy_ would raise
        raise CaptureError(
            f"graph capture: static output {name} (Tensor{tuple(t.shape)}, strides "
            f"{t.stride()}) has elements sharing memory and cannot be rewritten by a replay; "
            "return a .clone() or .contiguous() of it"
        )
    return f"    outs[{j}]{cut}.copy_({name}{cut})"


_size = torch.Tensor.size
_dtype = operator.attrgetter("dtype")


def _reshaped(
    watch: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    labels: Sequence[str],
) -> None:
    """Raise for the first watched tensor whose shape or dtype is not its capture-time one."""
    for t, shape, dtype, label in zip(watch, shapes, dtypes, labels):
        if t.shape != shape:
            raise GraphError(
                f"Graph.replay: {label} has shape {tuple(t.shape)} but was captured with "
                f"{tuple(shape)} (set_ or resize_ since the capture); shapes are frozen at "
                "capture time: write new values with copy_, or reset() and capture again"
            )
        if t.dtype != dtype:
            raise GraphError(
                f"Graph.replay: {label} has dtype {t.dtype} but was captured with {dtype} "
                "(set_ or .data = since the capture); dtypes are frozen at capture time: write "
                "new values with copy_, or reset() and capture again"
            )


def _dedent(lines: list[str], levels: int) -> list[str]:
    cut = "    " * levels
    return [ln[len(cut) :] if ln.startswith(cut) else ln for ln in lines]


def _tensors(out: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)} {x.dtype}"
    return repr(x)
