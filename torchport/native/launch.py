"""Calling compiled kernels: typed argument specs, validation before the call, ctypes launch.

A :class:`Kernel` binds one exported C function to a list of argument specs. Tensor arguments are
checked (device, dtype, dimensionality, contiguity) and passed as data pointers; sizes and strides
travel as explicit ``int64_t`` arguments chosen by each template. Validation failures raise
:class:`KernelArgumentError` naming the argument, the requirement and the value.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

C_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float64: "double",
    torch.bfloat16: "uint16_t",
    torch.float16: "uint16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.bool: "uint8_t",
    torch.float8_e4m3fn: "uint8_t",
    torch.float8_e5m2: "uint8_t",
}


class KernelArgumentError(TypeError, ValueError):
    """An argument passed to a native kernel does not meet the kernel's requirement."""


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: passed as its data pointer after validation."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    ndim: int | None = None
    contiguous: bool = True


@dataclass(frozen=True)
class IntArg:
    """A 64-bit signed integer argument."""

    name: str


@dataclass(frozen=True)
class FloatArg:
    """A floating-point argument (``double`` in C, or ``float`` when ``single``)."""

    name: str
    single: bool = False


ArgSpec = TensorArg | IntArg | FloatArg

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _ctype(spec: ArgSpec) -> type:
    if isinstance(spec, TensorArg):
        return ctypes.c_void_p
    if isinstance(spec, IntArg):
        return ctypes.c_int64
    return ctypes.c_float if spec.single else ctypes.c_double


def check_tensor(spec: TensorArg, value: object, kernel: str) -> torch.Tensor:
    """Validate one tensor argument against its spec; return it."""
    where = f"{kernel}: argument {spec.name!r}"
    if not isinstance(value, torch.Tensor):
        raise KernelArgumentError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_cpu:
        raise KernelArgumentError(f"{where} must be on device 'cpu', got {value.device}")
    if value.dtype not in spec.dtypes:
        allowed = ", ".join(str(d) for d in spec.dtypes)
        raise KernelArgumentError(f"{where} must have dtype in ({allowed}), got {value.dtype}")
    if spec.ndim is not None and value.dim() != spec.ndim:
        raise KernelArgumentError(
            f"{where} must be {spec.ndim}-D, got {value.dim()}-D shape {tuple(value.shape)}"
        )
    if spec.contiguous and not value.is_contiguous():
        raise KernelArgumentError(
            f"{where} must be contiguous, got strides {value.stride()} for shape {tuple(value.shape)}"
        )
    if value.is_neg() or value.is_conj():  # its memory holds the values before the lazy op
        raise KernelArgumentError(
            f"{where} must not carry a lazy {'negation' if value.is_neg() else 'conjugation'} "
            "bit (its memory holds the values before it); pass .resolve_neg() / "
            ".resolve_conj()"
        )
    return value


_tracing_context = torch._guards.TracingContext.try_get


def is_compiling_here() -> bool:
    """``torch.compiler.is_compiling()`` for the calling thread: True while ``torch.compile`` or
    ``torch.export`` traces this thread's code (Dynamo's trace, AOTAutograd's, non-strict export,
    a compile backend's work). torch 2.13 sets the flag ``is_compiling`` reads once for the whole
    process during a compile, so while one thread compiled, every eager call on any other thread
    took its traced branch (a spec's checks and the FP8 NaN-code scans were skipped: silent wrong
    answers). The flag counts here only with a tracing context, which torch keeps per thread.
    Dynamo's trace folds the first test to True, never reaching the others. (The flag read
    directly: ``is_compiling()`` costs a call more, on every eager kernel call.)"""
    return torch.compiler.is_dynamo_compiling() or (
        torch.compiler._is_compiling_flag and _tracing_context() is not None
    )


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (in-place writes bump it), or -1 for an inference tensor, which
    keeps none (reading it raises). What the caches keyed on a tensor's contents compare."""
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter."
        return -1


def eager_fast_path(*tensors: torch.Tensor) -> bool:
    """True if plain eager tensors may skip the custom-op dispatcher and call a kernel directly.

    False while tracing (torch.compile, export, make_fx, any dispatch or function mode), for
    tensor subclasses (fake, functional, proxies), when autograd must record the call and for a
    tensor with the lazy negation bit (``z.conj().imag``, ``torch._neg_view``): its data pointer
    holds the un-negated values, which a kernel read as they are (``mm(a, z.conj().imag)``
    returned ``a @ z.imag``); the custom op's dispatcher materialises the negation first.
    Then the ``torch.library`` custom op (with its fake implementation) is used.
    """
    if is_compiling_here() or _dispatch_depth() > 0 or functorch_active():
        return False  # (torch.func's wrapped tensors are plain Tensors without a data pointer)
    if _function_modes_on() and torch.overrides._get_current_function_mode():
        return False
    grad = _grad_enabled()
    for t in tensors:  # a loop, not all(<generator>): runs on every eager call
        # (an nn.Parameter too: a layer's bias, as linear(x, lin.weight, lin.bias) passes it,
        # took the dispatcher, 38 against 12 us a call)
        ty = type(t)
        if (ty is not _Tensor and ty is not _Parameter) or (grad and t.requires_grad) or _is_neg(t):
            return False
    return True


_scratch = threading.local()


def c_function(lib: ctypes.CDLL, symbol: str, argtypes: Sequence[Any], restype: Any) -> Any:
    """``lib``'s exported ``symbol`` with its ctypes signature set: for raw calls on hot paths
    that :class:`Kernel`'s per-call checks would slow (the collectives' loops)."""
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def thread_scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's flat scratch buffer ``name``: at least ``numel`` elements of ``dtype``,
    reused by the thread's next request of the same name (so the caller must be done with it by
    then) and grown when too small. For kernel workspaces that would otherwise cost an allocation
    and its page faults on every call. Made as an inference tensor, which autograd and the GEMM
    engine's pack cache never keep."""
    bufs: dict[str, torch.Tensor] = _scratch.__dict__
    buf = bufs.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        with torch.inference_mode():
            buf = bufs[name] = torch.empty(numel, dtype=dtype)
    return buf


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_dispatch_depth = torch._C._len_torch_dispatch_stack
# True while a torch.func transform (vmap, grad, jvp, ...) is active. Its wrapped tensors are
# plain Tensors without a data pointer, and the custom ops have no forward-mode formula: every
# entry that calls a kernel directly or through a custom op takes torch ops then. The one check
# for it (the C function itself: no Python frame on the eager paths that call it)
functorch_active = torch._C._are_functorch_transforms_active
_function_modes_on = torch._C._is_torch_function_mode_enabled
_grad_enabled = torch.is_grad_enabled
_is_neg = torch.Tensor.is_neg  # (the conjugation bit exists on complex tensors only, which the
# ops taking them resolve themselves: linalg)
_fwad = torch.autograd.forward_ad


def forward_ad_active() -> bool:
    """True inside a ``torch.autograd.forward_ad.dual_level()``. Its dual tensors are plain
    tensors that need not require grad, and a kernel call (or a custom op, which has no
    forward-mode formula) drops their tangents: the entries that would take such a route check
    this first (the level is the module's Python global: no C function reads it)."""
    return _fwad._current_level >= 0


class Kernel:
    """One exported function of a compiled library, with validated arguments."""

    def __init__(self, lib: ctypes.CDLL, symbol: str, args: Sequence[ArgSpec]) -> None:
        self.name = symbol
        self.args = tuple(args)
        self._fn = c_function(lib, symbol, [_ctype(a) for a in self.args], ctypes.c_int)
        self._lib = lib  # keep the library alive as long as the kernel

    def __call__(self, *values: object) -> int:
        if len(values) != len(self.args):
            raise KernelArgumentError(
                f"{self.name} takes {len(self.args)} arguments "
                f"({', '.join(a.name for a in self.args)}), got {len(values)}"
            )
        raw: list[object] = []
        for spec, v in zip(self.args, values):
            if isinstance(spec, TensorArg):
                raw.append(check_tensor(spec, v, self.name).data_ptr())
            elif isinstance(spec, IntArg):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise KernelArgumentError(
                        f"{self.name}: argument {spec.name!r} must be an int, got {v!r}"
                    )
                # ctypes wraps an out-of-range int modulo 2**64 without a word (2**64 + 5 -> 5)
                if not _INT64_MIN <= v <= _INT64_MAX:
                    raise KernelArgumentError(
                        f"{self.name}: argument {spec.name!r} must fit in int64_t "
                        f"[{_INT64_MIN}, {_INT64_MAX}], got {v}"
                    )
                raw.append(v)
            else:
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise KernelArgumentError(
                        f"{self.name}: argument {spec.name!r} must be a number, got {v!r}"
                    )
                try:
                    f = float(v)
                except OverflowError:  # an int past the double range (10**400)
                    raise KernelArgumentError(
                        f"{self.name}: argument {spec.name!r} must fit in a double, got {v}"
                    ) from None
                if spec.single:  # (ctypes passed 1e300 to a C float as inf)
                    try:
                        struct.pack("<f", f)  # raises where the float rounding overflows
                    except OverflowError:
                        raise KernelArgumentError(
                            f"{self.name}: argument {spec.name!r} must fit in a float, got {v}"
                        ) from None
                raw.append(f)
        status = self._fn(*raw)
        if status != 0:
            raise RuntimeError(f"{self.name} returned error status {status}")
        return status

    def call_unchecked(self, *raw: object) -> int:
        """Call with raw pointers/ints (hot paths that validated once up front)."""
        return int(self._fn(*raw))

    @property
    def raw_call(self) -> Callable[..., int]:
        """The ctypes function itself, for settled hot paths: raw pointers/ints in, the int
        status out (as :meth:`call_unchecked`, one Python frame less per call)."""
        return self._fn
