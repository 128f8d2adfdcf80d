"""Quantized tensor types: ``Float8Tensor``, ``NVFP4Tensor``, ``MXTensor``.

Each is a wrapper tensor subclass with the logical shape and dtype of the high-precision tensor it
stands for, carrying its quantized ``qdata`` and scales. They are used as ``nn.Linear`` weights
(``torchport.quantize_``): ``F.linear`` with such a weight runs

- the native decode GEMV (:mod:`torchport.gemv`) for ≤ 8 activation rows, reading the quantized
  bytes directly;
- otherwise a prefill path: :func:`torchport.scaled_mm` for FP8 with dynamic activation scaling, or
  :func:`torchport.lowp.block_scaled_mm` (native panel dequantize + GEMM) for the others.

Weight + activation quantization (NVFP4 ``act_per_tensor_scale`` set, MX ``act_elem`` set, FP8
``act_dtype`` set): the activation is quantized at run time, at every batch size, with the same
recipe as weights — NVFP4 per token per 16-element block (E4M3 scales, optional dynamic per-tensor
scale from the activation's amax), MX per token per 32-element block (E8M0), FP8 per token or per
tensor as the weight's scale — and the product runs on the quantized operands:
``out = dequantize(quantize(x)) @ dequantize(W).T`` with float32 accumulation. The dequantized
values are exact in float32 (an FP8 activation's ``code * scale`` at decode is rounded once; the
FP8 prefill multiplies the codes and scales after), so only the summation order differs from a
float64 reference. FP4
weights × FP4 activations at decode (K % 64 == 0, AVX2) use integer products (``2·e2m1`` pairs
summed exactly in int32, :func:`torchport.gemv.fp4_kernel.gemv_fp4_prepped_kernel`); other
combinations and prefill multiply the dequantized values (the GEMV decodes in registers, the
prefill GEMM in panels).

Autograd: ``F.linear`` with such a weight is differentiable with respect to the input (and bias):
``grad_x = grad_out @ dequantize(W)``; activation quantization is treated as the identity
(straight-through). Weights are frozen: a weight with ``requires_grad`` raises
:class:`~torchport.lowp.formats.LowPrecisionError`.

Any other op sees the dequantized tensor (``dequantize()``), so the types compose with ordinary
code; ``detach``/``clone`` keep the quantized form, and so does ``to`` in every signature
(``to(dtype)``, ``to("cpu", dtype)``, ``to(other)``, ``dtype=``, ``non_blocking=``, ``bfloat16()``)
to a floating dtype of at least 16 bits on the CPU: the same codes standing for that dtype,
sharing the inner tensors, or with inner tensors of its own for ``copy=True``. ``to`` another
dtype (integer, FP8) or device gives the dequantized value converted. ``__tensor_flatten__`` lets
``torch.compile`` trace through them.

Quantized weights are immutable except through ``copy_`` (what ``Module.load_state_dict`` calls):
a source of the same type and quantized layout is copied bit for bit, any other source (a float
tensor, another recipe) is quantized with this tensor's recipe, in place either way. Every other
op that would write into one (``add_``, ``zero_``, ``out=`` variants, ``w[i] = v``, ...) raises
:class:`~torchport.lowp.formats.LowPrecisionError`: run on the dequantized value, it would
otherwise change a temporary and leave the weight as it was. ``w.data = v`` takes the inner
tensors and settings of a ``v`` of the same type, shape and dtype (any other ``v`` raises), and
``share_memory_`` moves the inner tensors to shared memory. ``copy_`` drops the packed weight and
settled route of every tensor sharing the bytes (``w.data``, ``state_dict()`` entries); a graph
captured with :mod:`torchport.graphs` keeps reading the packed weight of its capture, which
``copy_`` updates only in part (the NVFP4 and per-tensor FP8 scales are frozen there): capture
again after loading new weights.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import sys
import weakref
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from torchport import config, native
from torchport.gemv import MAX_ROWS, GemvInputError, PackedWeight
from torchport.gemv.hugepages import hugepage_copy
from torchport.gemv.ops import (
    SettledRoute,
    gemv_packed,
    linear_decode,
    note_written,
    overflow_rows,
    settle_route,
)
from torchport.lowp import fp8, mx, nvfp4
from torchport.lowp._common import HP_DTYPES, check_input
from torchport.lowp.formats import FP8_DTYPES, LowPrecisionError, e8m0_to_f32, unpack_fp4
from torchport.native.launch import is_compiling_here

aten = torch.ops.aten
_ABSTRACT = "LowPrecisionTensor is abstract: use Float8Tensor, NVFP4Tensor or MXTensor"
# inference inner tensors of at most this many elements are compared by value before each use of
# a cached pack (an FP8 tensor-wise scale: the pack holds it expanded to rows, a copy)
_SNAPSHOT_NUMEL = 16
# Packed weights at least this large move to huge-page memory (see LowPrecisionTensor.gemv_pack).
HUGEPAGE_MIN_BYTES = 4 << 20


def pack_on_huge_pages(data_nbytes: int, scales_nbytes: int) -> tuple[bool, bool]:
    """Whether a GEMV pack of this size moves to huge-page memory: (its data, its scales). The
    data from :data:`HUGEPAGE_MIN_BYTES` when ``config.gemv_hugepages`` is on, the scales with it
    from a quarter of that. The rule of :meth:`LowPrecisionTensor._on_huge_pages`, and of the GEMV
    tuner's weight copies (``torchport.gemv.ops._memory_sets``)."""
    data = bool(config.get("gemv_hugepages")) and data_nbytes >= HUGEPAGE_MIN_BYTES
    return data, data and scales_nbytes >= HUGEPAGE_MIN_BYTES // 4


def _users(inner: dict[str, Any], name: str) -> tuple[int, int, int]:
    """What holds the tensor ``inner[name]``: Python references to it, holders of its
    ``TensorImpl`` (from C++: a view's base, a tensor autograd saved) and of its storage (every
    tensor on it: views, ``detach()``, ``.data``). Counted in this one function so that
    :data:`_ALONE`, measured here for a tensor that ``inner`` alone holds, counts the same
    interpreter references (the entry, ``t``, ``getrefcount``'s argument, ``storage``)."""
    t = inner[name]
    storage = t.untyped_storage()
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(storage._cdata)


_ALONE = _users({"t": torch.empty(1)}, "t")


def _alone(inner: dict[str, Any], name: str) -> bool:
    """Whether ``inner[name]`` (an inner tensor in a quantized tensor's ``__dict__``) is that
    tensor's alone: held by nothing else (the caller's variable it was built from, another
    quantized tensor sharing it as ``to(dtype)`` does, a view or ``detach()`` of it, as
    ``state_dict()`` entries and ``w.data`` are), the whole of its storage (not a slice of a
    larger buffer, whose other bytes someone may hold) and in this process's private memory
    (not shared memory, which another process may map). Memory that a NumPy array or a buffer
    lent to ``torch.from_numpy``/``torch.frombuffer`` is not seen: torch keeps no count of it."""
    if _users(inner, name) != _ALONE:
        return False
    t = inner[name]
    return (
        t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes and not t.is_shared()
    )


_KEEP = {aten.detach.default, aten.alias.default, aten.clone.default}
_linear = F.linear
_setitem = torch.Tensor.__setitem__
_to = torch.Tensor.to
_share_memory = torch.Tensor.share_memory_
_dlpack = torch.Tensor.__dlpack__
# ``w.data = v`` reaches __torch_function__ as this descriptor's (fresh, bound) ``__set__``
_DATA = torch._C.TensorBase.__dict__["data"]
_is_shared = torch.Tensor.is_shared
_autocast_on = torch._C._is_any_autocast_enabled
_FWAD = torch.autograd.forward_ad  # its dual level's global (see native.forward_ad_active)
# the dtypes a quantized tensor may stand for (to(dtype) keeps it quantized for these)
_WRAPPER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_IMMUTABLE = "quantized weights are immutable except through copy_ (which re-quantizes the source)"


# The caches of real quantized tensors by the address of their qdata's storage. detach()
# (state_dict() entries, ``w.data``) and to(dtype) give tensors sharing the inner tensors, so
# copy_ into one writes the others' bytes too: they take its metadata (NVFP4's per-tensor scale)
# and drop their caches. The table refers weakly to each tensor's _Cache, never to the tensor:
# torch.utils.swap_tensors, which Module._apply uses for wrapper subclasses (model.to(dtype),
# model.cpu(), model.half()), refuses a tensor with a weak reference.
_SHARING: dict[int, dict[int, weakref.ref[_Cache]]] = {}
_PRUNE_AT = [1024]  # drop dead entries when the table grows past this


# aten._to_copy's keywords (every Tensor.to signature passes what it was given of these) and the
# memory formats of a dense copy: with a CPU device and a floating dtype, the copy is the same
# codes standing for that dtype (a device or layout keyword made it dequantize, so
# w.to("cpu", torch.bfloat16) and w.to(other) did where w.to(torch.bfloat16) did not)
_TO_KEYWORDS = frozenset(
    ("dtype", "device", "layout", "non_blocking", "memory_format", "pin_memory")
)
_DENSE_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _to_keeps_quantized(kwargs: dict[str, Any]) -> bool:
    """Whether ``aten._to_copy(w, **kwargs)`` of a quantized ``w`` only relabels its dtype."""
    if not kwargs.keys() <= _TO_KEYWORDS:
        return False
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    return (
        (dtype is None or (dtype.is_floating_point and dtype.itemsize >= 2))
        and (device is None or torch.device(device).type == "cpu")
        and kwargs.get("layout") in (None, torch.strided)
        and kwargs.get("memory_format") in _DENSE_FORMATS
        and not kwargs.get("pin_memory")
    )


def _copy_requested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to`` call passes ``copy=True``: as a keyword, or positionally after
    ``dtype``/``other`` and ``non_blocking``, or after ``device, dtype, non_blocking``."""
    if "copy" in kwargs:
        return bool(kwargs["copy"])
    at = 4 if len(args) > 1 and isinstance(args[1], (str, torch.device, int, type(None))) else 3
    return len(args) > at and bool(args[at])


def _storage_key(t: Any) -> int | None:
    """The address of a real inner tensor's storage (None for traced/fake ones, and for a
    storage at address 0: every meta tensor and empty storage has it, so keying on it would
    make them all share one per-tensor scale)."""
    if type(t) is not torch.Tensor:
        return None
    return t.untyped_storage().data_ptr() or None


def _view_of(t: LowPrecisionTensor) -> tuple[Any, ...]:
    """Offset, shape and strides of each inner tensor (which bytes of its storage it reads)."""
    return tuple(
        (x.storage_offset(), tuple(x.shape), x.stride())
        for x in (getattr(t, n) for n in t.__tensor_flatten__()[0])
    )


def _written_lowp(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The LowPrecisionTensor argument that ``func`` writes into (schema ``alias_info.is_write``:
    in-place ops, ``out=`` variants, ``set_``, ``resize_``, ...), or None."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        val = kwargs.get(arg.name, args[i] if i < len(args) else None)
        for v in val if isinstance(val, list | tuple) else (val,):
            if isinstance(v, LowPrecisionTensor):
                return v
    return None


def _hp_activation(x: torch.Tensor) -> torch.Tensor:
    """An activation as the quantizers take it: float32 and bfloat16 as they are, float16 and
    float64 (which the weight-only path takes too) as float32 (every float16 value exactly)."""
    return x if x.dtype in HP_DTYPES else x.float()


class _Cache:
    """A quantized tensor's state that a ``copy_`` into a tensor sharing its bytes replaces:
    the packed weight, the settled route and the :attr:`LowPrecisionTensor._copied_meta`
    attributes (set here by name), and ``key``, the storage of qdata it is entered under in
    :data:`_SHARING`."""

    def __init__(self) -> None:
        self.pack: PackedWeight | None = None
        # the last settled decode route (eager weight-only GEMV; torchport.gemv.ops.settle_route)
        self.route: SettledRoute | None = None
        self.key: int | None = None
        # the inner tensors' views of their storages (see _view_of) when entered: a copy_ passes
        # its _copied_meta only to tensors with the very same views (two weights sliced from one
        # buffer share the storage, not the bytes each one's scale applies to)
        self.view: tuple[Any, ...] = ()
        # copy_ calls that wrote the bytes (a backward of F.linear that kept this tensor checks
        # it did not move since the forward, as torch checks a saved tensor's version)
        self.writes = 0
        # (settings, weight): the weight :func:`_rebuilt` made from this one's inner tensors for
        # a traced call's op, kept so that later calls take it as it is
        self.rebuilt: tuple[tuple[Any, ...], LowPrecisionTensor] | None = None


class LowPrecisionTensor(torch.Tensor):
    """Base of the quantized tensor types (not used directly)."""

    qdata: torch.Tensor
    _orig_dtype: torch.dtype
    _cache: _Cache
    # attributes besides the inner tensors that a bit-exact copy_ takes from its source (kept in
    # the _Cache: properties in the subclass)
    _copied_meta: tuple[str, ...] = ()

    # the non-tensor entries of the pickled state besides the _copied_meta ones (each checked on
    # load as the constructor checks its argument: see _check_settings)
    _settings: tuple[str, ...] = ("_orig_dtype",)

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        *_: Any,
        device: torch.device | None = None,
        **__: Any,
    ):
        # on its inner tensors' device (the CPU, or meta: shapes only), checked in __init__
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device or torch.device("cpu"), requires_grad=False
        )
        t._cache = _Cache()
        return t

    @property
    def _pack(self) -> PackedWeight | None:
        return self._cache.pack

    @_pack.setter
    def _pack(self, value: PackedWeight | None) -> None:
        self._cache.pack = value

    @property
    def _route(self) -> SettledRoute | None:
        return self._cache.route

    @_route.setter
    def _route(self, value: SettledRoute | None) -> None:
        self._cache.route = value

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor this stands for (native dequantize kernel)."""
        raise TypeError(_ABSTRACT)

    def gemv_pack(self) -> PackedWeight:
        """This weight in the GEMV's layout (built once and cached for eager tensors; built
        again after an inner tensor was written in place, e.g. ``w.scale.mul_(3)``)."""
        pw = self._pack
        if pw is not None:
            if not pw.written(self):
                return pw
            # (the pack copied what was written: stale; not held here while _alone counts)
            self._pack = self._route = pw = None
        if self.dim() != 2:
            raise LowPrecisionError(
                f"{type(self).__name__} GEMV needs a 2-D weight, got shape {tuple(self.shape)}"
            )
        if self.qdata.is_meta:
            raise LowPrecisionError(f"{type(self).__name__} GEMV needs a CPU weight, got meta")
        if type(self.qdata) is torch.Tensor and not is_compiling_here():
            # Real storage (possibly under a dispatch mode, e.g. a graph capture): pack outside
            # any mode, once, so that a capture records only the GEMV, not the packing. And
            # outside any torch.func transform: under jvp every op's result is wrapped for the
            # transform's level, so a pack first made there held wrappers without storage, and
            # every later call with the weight (plain eager included) raised reading their data
            # pointers.
            from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
            from torch.utils._python_dispatch import _disable_current_modes

            with (
                temporarily_clear_interpreter_stack(),
                _disable_current_modes(),
                torch.no_grad(),
            ):
                # (counted before the pack, whose parts are views of the inner tensors)
                alone = all(_alone(self.__dict__, n) for n in self.__tensor_flatten__()[0])
                pw = self._on_huge_pages(self._make_pack(), alone)
                # (after the move to huge pages, which rebinds qdata and scale)
                source, values = self._inner_versions()
                self._pack = dataclasses.replace(pw, source=source, values=values)
            return self._pack
        return self._make_pack()  # fake/traced tensors: never cached

    def _make_pack(self) -> PackedWeight:
        raise TypeError(_ABSTRACT)

    def _inner_versions(
        self,
    ) -> tuple[tuple[tuple[str, torch.Tensor, int], ...], tuple[tuple[Any, bytes], ...]]:
        """:attr:`PackedWeight.source` and :attr:`PackedWeight.values` of the cached pack: the
        inner tensors by name with their version counters (-1 for an inference tensor: it
        keeps none), and a NumPy view of the bytes of each tiny inference tensor with the
        bytes now (a large one's in-place writes are not seen)."""
        source, values = [], []
        for name in self.__tensor_flatten__()[0]:
            t = getattr(self, name)
            if not t.is_inference():
                source.append((name, t, t._version))
                continue
            source.append((name, t, -1))
            if t.numel() <= _SNAPSHOT_NUMEL and t.is_contiguous():
                view = t.detach().reshape(-1).view(torch.uint8).numpy()
                values.append((view, view.tobytes()))
        return tuple(source), tuple(values)

    def _on_huge_pages(self, pw: PackedWeight, alone: bool) -> PackedWeight:
        """``pw`` with its data (and scales) moved to huge-page memory when at least
        :data:`HUGEPAGE_MIN_BYTES` (``config.gemv_hugepages``); ``qdata``/``scale`` are rebound to
        the moved buffers (same values, one copy kept). Only where the inner tensors are all
        this tensor's ``alone`` (:func:`_alone`, counted before the pack): moving one that
        something else holds would part them -- the buffers the caller built the weight from
        (a weight-sync loader writing new codes and scales into them in place: the weight read
        the old codes beside the new scales), a ``state_dict()`` entry or ``w.data`` taken
        before this first pack (a ``copy_`` into either then left the other reading its old
        codes beside the new scales), a slice of a larger buffer. All or nothing: a weight never
        has one inner tensor moved while another is held elsewhere (scales below a quarter of
        the threshold stay where they are, then held by nothing else). Only here, at the pack:
        such a weight stays where it is after the other holders go, until a ``copy_`` drops the
        pack."""
        huge, huge_scales = pack_on_huge_pages(pw.data.nbytes, pw.scales.nbytes)
        if not huge or not alone:
            return pw
        if len(self._sharing_caches()) > 1:
            return pw
        data, scales = hugepage_copy(pw.data), pw.scales
        if huge_scales:
            scales = hugepage_copy(scales)
        for name, new, packed in (("qdata", data, pw.data), ("scale", scales, pw.scales)):
            old = getattr(self, name)
            if (
                new is not packed  # (moved)
                and old.is_contiguous()
                and old.element_size() == 1
                and old.numel() == new.numel()
                and packed.data_ptr() == old.data_ptr()  # the pack's are its own, not a copy
            ):  # (MX scales with NaN folded in are a copy: the tensor keeps its own)
                setattr(self, name, new.view(old.dtype).view(old.shape))
        self._share()  # under the moved storage (aliases made from now on share it)
        return dataclasses.replace(pw, data=data, scales=scales)

    def _share(self) -> None:
        """Enter this tensor in :data:`_SHARING` under its qdata's storage."""
        key = _storage_key(self.qdata)
        if key is None:
            return
        self._cache.key = key
        self._cache.view = _view_of(self)
        _SHARING.setdefault(key, {})[id(self._cache)] = weakref.ref(self._cache)
        if len(_SHARING) > _PRUNE_AT[0]:
            for k in list(_SHARING):
                live = {i: r for i, r in _SHARING[k].items() if r() is not None}
                if live:
                    _SHARING[k] = live
                else:
                    del _SHARING[k]
            _PRUNE_AT[0] = max(1024, 2 * len(_SHARING))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (``torch.load``): the state of :meth:`__getstate__` (or of one saved
        before the caches moved to a :class:`_Cache`: ``_pack``/``_route`` keys, ignored)."""
        self._cache = _Cache()
        for name, value in state.items():
            if name in self._copied_meta:
                setattr(self, name, value)
            elif name in ("_pack", "_route", "_cache"):
                continue
            elif hasattr(type(self), name):  # would shadow a method or class setting
                raise LowPrecisionError(f"{type(self).__name__}: unexpected state entry {name!r}")
            else:
                self.__dict__[name] = value
        # torch.load(weights_only=True) may build these (registered safe globals below) from a
        # file: inner tensors that do not make up the wrapper's shape would be read past their
        # ends by the kernels, so they must agree (LowPrecisionError otherwise), and every setting
        # is checked as the constructor checks it (_check_settings)
        for n in (*self._settings, *self._copied_meta):
            if n not in state:
                raise LowPrecisionError(f"{type(self).__name__}: the state has no entry {n!r}")
        for n in self.__tensor_flatten__()[0]:
            if not isinstance(self.__dict__.get(n), torch.Tensor):
                raise LowPrecisionError(f"{type(self).__name__}: the state has no tensor {n!r}")
        self._check_settings()
        got = self._inner_shape()
        if got != tuple(self.shape):
            raise LowPrecisionError(
                f"{type(self).__name__} of shape {tuple(self.shape)}: its inner tensors stand "
                f"for shape {got}"
            )
        self._share()

    def _inner_shape(self) -> tuple[int, ...]:
        """The logical shape the inner tensors stand for (checking their dtypes and shapes)."""
        raise TypeError(_ABSTRACT)

    def _check_settings(self) -> None:
        """Raise :class:`LowPrecisionError` unless the wrapper's dtype is a float dtype these
        types stand for (the one of ``_orig_dtype``), the device is the CPU or meta with every
        inner tensor on it, and the subclass's settings are valid (:meth:`_check_own`). The
        constructor and ``__setstate__`` (a file's state) both call it: a meta inner tensor
        under a CPU wrapper handed the kernels a null pointer (a crash), an integer wrapper
        dtype or a bad setting loaded and failed later with untyped errors."""
        name = type(self).__name__
        od = self._orig_dtype
        if not (isinstance(od, torch.dtype) and od in _WRAPPER_DTYPES and od == self.dtype):
            raise LowPrecisionError(
                f"{name}: _orig_dtype must be the tensor's dtype, one of {_WRAPPER_DTYPES}, got "
                f"_orig_dtype={od!r} for a {self.dtype} tensor"
            )
        if self.device.type not in ("cpu", "meta"):
            raise LowPrecisionError(f"{name}: must be on the CPU or meta device, got {self.device}")
        for n in self.__tensor_flatten__()[0]:
            t = getattr(self, n)
            if t.device != self.device:
                raise LowPrecisionError(
                    f"{name}: {n} must be on the tensor's device {self.device}, got {t.device}"
                )
        self._check_own()

    def _check_own(self) -> None:
        """The subclass's settings check (raises :class:`LowPrecisionError`)."""

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state (``torch.save``): the :attr:`_copied_meta` attributes, not the
        caches (the settled route holds local functions, the packed weight is rebuilt on first
        use), and each inner tensor saved alone (a tensor viewing a larger storage, e.g. the
        padded huge-page copy, is cloned: pickling saves whole storages)."""
        state = {n: v for n, v in self.__dict__.items() if n != "_cache"}
        state.update((n, getattr(self, n)) for n in self._copied_meta)
        for n in self.__tensor_flatten__()[0]:
            t = state[n]
            if type(t) is torch.Tensor and t.untyped_storage().nbytes() != t.nbytes:
                state[n] = t.clone(memory_format=torch.contiguous_format)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> LowPrecisionTensor:
        """A copy with its own inner tensors and no caches (torch's default would copy the
        settled route, whose kernel call keeps reading the original's packed bytes)."""
        if id(self) in memo:
            return memo[id(self)]
        new = torch.Tensor._make_wrapper_subclass(
            type(self),
            self.shape,
            dtype=self.dtype,
            device=self.device,
            requires_grad=self.requires_grad,
        )
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def _stable_hash_for_caching(self) -> str:
        """Content hash for torch.compile's AOT-autograd cache (data, scales and metadata)."""
        names, ctx = self.__tensor_flatten__()
        h = hashlib.sha256(f"{type(self).__name__}|{tuple(self.shape)}|{self.dtype}|{ctx}".encode())
        for n in names:
            t = getattr(self, n)
            # the inner tensors' layout always (traced inputs have no data to hash: without it,
            # an e4m3 and an e5m2 weight of one shape, or a row- and a tensor-wise scale, would
            # share a compiled graph), their bytes where they are real
            h.update(f"|{n}:{t.dtype}:{tuple(t.shape)}:{tuple(t.stride())}".encode())
            if native.eager_fast_path(t) and not t.is_meta:
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        raise TypeError(_ABSTRACT)

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: Any, size: Any = None, stride: Any = None
    ) -> LowPrecisionTensor:
        raise TypeError(_ABSTRACT)

    def _with_dtype(self, dtype: torch.dtype) -> LowPrecisionTensor:
        raise TypeError(_ABSTRACT)

    def _quantize_like(self, x: torch.Tensor) -> LowPrecisionTensor:
        """``x`` (float32/bfloat16, this tensor's shape) quantized with this tensor's recipe."""
        raise TypeError(_ABSTRACT)

    def _copy_from(self, src: Any) -> None:
        """``self.copy_(src)``: load ``src`` into the inner tensors in place.

        A source of this type whose inner tensors have the same shapes and dtypes (the same
        quantized layout) is copied bit for bit, with its :attr:`_copied_meta` (NVFP4's
        per-tensor scale); any other tensor is quantized with this tensor's recipe, from its
        value in this tensor's dtype (what a float parameter's ``copy_`` would hold). The
        activation settings and dtype stay; the packed weight and settled route are dropped.
        """
        name = type(self).__name__
        if not isinstance(src, torch.Tensor):
            raise LowPrecisionError(
                f"copy_ into {name}: the source must be a tensor, got {type(src).__name__}"
            )
        if tuple(src.shape) != tuple(self.shape):
            raise LowPrecisionError(
                f"copy_ into {name} of shape {tuple(self.shape)}: the source must have the same "
                f"shape, got {tuple(src.shape)}"
            )
        names, _ = self.__tensor_flatten__()
        if isinstance(src, type(self)) and all(  # the same quantized layout: bit-exact
            getattr(src, n).shape == getattr(self, n).shape
            and getattr(src, n).dtype == getattr(self, n).dtype
            for n in names
        ):
            new = src
        else:
            if isinstance(src, LowPrecisionTensor):
                x = src.dequantize(self.dtype)
            else:
                x = src.detach().to(self.dtype)
            new = self._quantize_like(x if x.dtype in HP_DTYPES else x.float())
        with torch.no_grad():
            for n in names:
                getattr(self, n).copy_(getattr(new, n))
        # under __torch_dispatch__ the copies bump no version counter: a backward that kept the
        # inner tensors (gemv's, sharing them through the pack) gave the gradient of the new
        # codes with the old per-tensor scale
        note_written(tuple(getattr(self, n) for n in names))
        self._bytes_changed({attr: getattr(new, attr) for attr in self._copied_meta})

    def _bytes_changed(self, meta: dict[str, Any]) -> None:
        """Tell every tensor standing for this one's bytes that they (or ``meta``, the
        :attr:`_copied_meta` values they go with) changed: packed copies and settled routes
        dropped, write counts raised, ``meta`` set."""
        view = _view_of(self)
        for c in self._sharing_caches():
            # every tensor on this storage may read the written bytes (caches dropped), but only
            # one with these very views stands for them (a slice of one buffer beside this one
            # kept its own per-tensor scale: it took this one's)
            if c is self._cache or c.view == view:
                for attr, value in meta.items():
                    setattr(c, attr, value)
            c.pack = None  # repacked (and the route settled again) on the next call
            c.route = None
            c.writes += 1

    def _sharing_caches(self) -> list[_Cache]:
        """The :class:`_Cache` of this tensor and of every live tensor sharing its bytes
        (``w.data``, ``state_dict()`` entries, ``to(dtype)``), by qdata's storage."""
        key = _storage_key(self.qdata)
        refs = list(_SHARING.get(key, {}).values()) if key is not None else []
        mine = self._cache
        others = (c for c in (r() for r in refs) if c is not None and c is not mine)
        # (not one whose qdata moved to huge pages since it was entered under this storage)
        return [mine, *(c for c in others if c.key == key)]

    def _set_data(self, new: Any) -> None:
        """``self.data = new``: this tensor takes ``new``'s inner tensors and settings (a
        tensor of its type, shape and dtype; its packed weight and route are dropped), as a
        plain tensor takes ``new``'s storage. torch's own ``set_data`` changed only the wrapper,
        which has no data: the weight silently stayed as it was."""
        name = type(self).__name__
        if not (
            isinstance(new, type(self)) and new.shape == self.shape and new.dtype == self.dtype
        ):
            got = (
                f"{type(new).__name__} {tuple(new.shape)} {new.dtype}"
                if isinstance(new, torch.Tensor)
                else type(new).__name__
            )
            raise LowPrecisionError(
                f".data = on a {name} {tuple(self.shape)} {self.dtype}: assign a {name} of that "
                f"shape and dtype, or load other values with w.copy_(new), got {got}"
            )
        for k, v in new.__dict__.items():
            if k != "_cache":
                self.__dict__[k] = v
        for attr in self._copied_meta:
            setattr(self, attr, getattr(new, attr))
        self._pack = self._route = None
        # a backward whose forward read the old weight would take the new one (F.linear's
        # autograd holds this very tensor): counted as a write, it raises as after copy_
        self._cache.writes += 1
        self._share()

    def _share_memory(self) -> None:
        """``share_memory_()``: the inner tensors' storages moved to shared memory in place.

        torch's own ``share_memory_`` reads the storage of the wrapper, which has none: it
        crashed the process (``model.share_memory()`` on a quantized model). Moving a storage
        frees its old memory, which the packed weight and the settled route of every tensor
        sharing it point into: their caches are dropped and entered under the new storage."""
        caches = self._sharing_caches()
        names = self.__tensor_flatten__()[0]
        before = [_storage_key(getattr(self, n)) for n in names]
        with torch.no_grad():
            for n in names:
                getattr(self, n).share_memory_()
        key = _storage_key(self.qdata)
        # every inner tensor's storage, not qdata's alone: with qdata already shared and the
        # scale not, the scale moved and the route kept reading its freed memory
        if key is None or before == [_storage_key(getattr(self, n)) for n in names]:
            return  # already shared: nothing moved
        for c in caches:
            c.pack = c.route = None
            c.key = key
            _SHARING.setdefault(key, {})[id(c)] = weakref.ref(c)

    def prefill_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear`` for many activation rows: the activation quantized as
        :meth:`quantize_activation` says, the weight dequantized, then GEMM (overridden for
        FP8)."""
        from torchport.lowp.scaled_mm import block_scaled_mm

        xq = self.quantize_activation(x)
        return block_scaled_mm(x if xq is None else xq, self, bias=bias)

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        """The run-time quantized activation (dequantized, float32), or None for weight-only."""
        return None

    def fp4_activation(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP4 codes ``[B, K]`` and per-8-lane scales of the run-time quantized activation when
        weight and activation are both FP4 (the integer-product GEMV applies), else None."""
        return None

    def _fp4_x_fp4(self) -> bool:
        """Cheap pre-check: FP4 weights with FP4 run-time activations."""
        return False

    def _decode_fp4_act(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Decode with FP4 weights × FP4 activations: exact int8 products (pair-split kernel).

        Raises :class:`~torchport.gemv.GemvInputError` for an activation whose last dimension is
        not K or a bias that is not ``[N]``, as the weight-only GEMV does (the kernel reads
        ``N`` bias values and the activation as rows of K)."""
        n, k = self.shape
        if x.dim() < 1 or x.shape[-1] != k:
            raise GemvInputError(
                f"gemv: x's last dimension must equal the weight's K={k}, got shape {tuple(x.shape)}"
            )
        if isinstance(bias, torch.Tensor) and (bias.dim() != 1 or bias.shape[0] != n):
            raise GemvInputError(f"gemv: bias must have shape ({n},), got {tuple(bias.shape)}")
        if k % 64 or not native.enabled() or native.cpu_info().isa == "scalar":
            return None
        b_ok = bias is None or (  # (a lazily negated bias's memory holds the un-negated values)
            type(bias) in (torch.Tensor, torch.nn.Parameter)
            and bias.dim() == 1
            and not bias.is_neg()
        )
        if not (b_ok and native.eager_fast_path(x)):
            return None
        pw = self.gemv_pack()
        if not pw.int8:  # a NaN block scale: the pair-split kernel's register decode reads it
            return None  # finite (E4M3 0x7F as 480), the float kernel's table NaN, as torch
        x2 = x.reshape(-1, k)
        act = self.fp4_activation(x2)
        if act is None:
            return None
        from torchport.gemv.fp4_kernel import gemv_fp4_prepped_kernel, prepare_fp4_activations

        fold = 0.5 * 256.0 * pw.pts if pw.fmt == "nvfp4" else 0.5
        xr, corr, xsv = prepare_fp4_activations(act[0], act[1], fold)
        rows = x2.shape[0]
        out = torch.empty(rows, n)
        bf = bias.detach().float().contiguous() if bias is not None else torch.empty(0)
        kern = gemv_fp4_prepped_kernel(pw.fmt, native.cpu_info().isa)
        status = kern(
            xr,
            corr,
            xsv,
            rows,
            k,
            pw.data,
            pw.scales,
            bf,
            int(bias is not None),
            out,
            n,
            native.num_threads(),
        )
        if status:
            raise native.NativeError(f"fp4 x fp4 gemv failed with status {status}")
        return out.reshape(*x.shape[:-1], n)

    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:func:`torchport.gemv.gemv` with this weight: the weight-only decode GEMV (activations
        never quantized). A method so that a compiled caller records the call itself: Dynamo
        refuses ``gemv_pack()`` (its result is no tensor), and the dense fallback it took
        instead dequantized the whole weight on every call. A weight that requires grad is
        refused as ``F.linear`` refuses it (it has no gradient: the call gave None silently)."""
        if torch.is_grad_enabled():
            _check_frozen(self)
        return gemv_packed(x, self.gemv_pack(), bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, self, bias)``: decode GEMV for ≤ 8 rows, else the prefill GEMM.

        A weight-only decode call on plain eager tensors settles a route (plan, pointers, bias)
        the first time; later calls with the same activation dtype/shape, bias and settings call
        the kernel directly (a few µs of Python instead of the general path's checks). While
        ``torch.compile``, ``torch.export`` or ``make_fx`` trace a weight whose activations are
        quantized at run time (NVFP4 and MX activation configs) or an NVFP4 weight, the whole
        call is one custom op, ``torchport::lowp_act_linear``, which
        runs this eager path (see :func:`_act_linear_op`).
        """
        if self._traced_as_op() and _traced(x):
            return _act_linear_traced(cast("NVFP4Tensor | MXTensor", self), x, bias)
        return self._linear(x, bias)

    def _traced_as_op(self) -> bool:
        """True if a traced :meth:`linear` is one custom op (:func:`_act_linear_op`): run-time
        activation quantization (native kernels and data-dependent checks a tracer cannot
        follow), or NVFP4's per-tensor scale (a Python float or none, which the trace would keep
        as a constant). False here and for FP8, whose traced path is torch ops throughout."""
        return False

    def _act_settings(self) -> tuple[float | None, bool | None, str | None, str | None]:
        """``(per_tensor_scale, act_per_tensor_scale, elem, act_elem)`` as
        :func:`_act_linear_op` takes them (NVFP4 fills the first two, MX the last two)."""
        raise TypeError(_ABSTRACT)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`linear` without the traced custom-op route."""
        c = self._cache
        route = c.route
        if route is not None:
            pw = c.pack
            if pw is None or pw.written(self):  # an inner tensor written or replaced: repacked
                c.pack = c.route = None
            else:
                out = route.serve(x, bias)
                if out is not None:
                    return out
        self._check_activation(x)
        if self.qdata.is_meta:  # shapes only (the kernels must never see its null pointer)
            return self._meta_linear(x, bias)
        if self.dim() == 2 and self.shape[1] == 0 and x.dim() and x.shape[-1] == 0:
            # an empty sum: zeros (the paths below reshaped x to rows of 0: untyped errors)
            n = self.shape[0]
            if bias is not None and tuple(bias.shape) != (n,):  # (the kernels' rule for K > 0)
                raise LowPrecisionError(
                    f"F.linear with a {type(self).__name__} of shape {tuple(self.shape)}: the "
                    f"bias must have shape ({n},), got {tuple(bias.shape)}"
                )
            out = x.new_zeros((*x.shape[:-1], n))
            return out if bias is None else out + bias.to(out.dtype)
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        decode = 0 < rows <= MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16)
        if decode and self._fp4_x_fp4():
            fast = self._decode_fp4_act(x, bias)
            if fast is not None:
                return fast if fast.dtype == x.dtype else fast.to(x.dtype)
        if decode:
            xq = self.quantize_activation(x)
            pw = self.gemv_pack()
            # weight-only, eager weight: settle the route; not inside a forward-AD dual level,
            # whose every call the route refuses (settled anew per call: 23 -> 51 us), and whose
            # end leaves the route settled before it valid
            if xq is None and self._pack is pw and not native.forward_ad_active():
                self._route = settle_route(x, pw, bias)
            out = linear_decode(x if xq is None else xq, pw, bias, allow_int8=xq is None)
        else:  # (quantizes the activation itself: FP8's scaled_mm takes the codes)
            out = self.prefill_linear(x, bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _meta_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear`` with a meta weight: the output's shape and dtype on the meta device
        (the input's and bias's shapes checked as ``F.linear`` does)."""
        self._check_activation(x)
        n, k = self.shape
        if x.dim() < 1 or x.shape[-1] != k:
            raise LowPrecisionError(
                f"F.linear with a {type(self).__name__} of shape {(n, k)}: the input's last "
                f"dimension must be {k}, got shape {tuple(x.shape)}"
            )
        shape = (*x.shape[:-1], n)
        if bias is not None:
            self._check_bias_broadcasts(shape, bias)
        return torch.empty(shape, dtype=x.dtype, device="meta")

    def _check_activation(self, x: object) -> None:
        """Raise unless ``x`` is a floating-point tensor of at least one dimension, as
        ``F.linear`` requires: the paths below quantized an integer activation as its float
        values and returned the product truncated to integers, and a complex one's real part
        (torch refuses both), and a scalar one raised an IndexError in the FP8 activation
        quantization. Nor one of the one-byte float dtypes (float8, float4, E8M0), which
        ``F.linear`` with the dequantized weight refuses: the product came out in float8, past
        ±448 saturated (E4M3) or infinite (E5M2)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise LowPrecisionError(
                f"F.linear with a {type(self).__name__}: x must be a floating-point tensor, "
                f"got {got}"
            )
        if x.dtype.itemsize == 1:
            raise LowPrecisionError(
                f"F.linear with a {type(self).__name__}: x must be a float16, bfloat16, float32 "
                f"or float64 tensor (a quantized activation is the weight's to make), got "
                f"{x.dtype}"
            )
        if x.dim() == 0:
            raise LowPrecisionError(
                f"F.linear with a {type(self).__name__}: x must have at least 1 dimension (the "
                f"last one of the weight's K={self.shape[-1]}), got a scalar (0-d)"
            )

    def _check_bias_broadcasts(self, shape: tuple[int, ...], bias: torch.Tensor) -> None:
        """``F.linear``'s rule: the bias broadcasts to the output's ``shape``."""
        if not _broadcasts_to(bias, shape):
            raise LowPrecisionError(
                f"F.linear with a {type(self).__name__} of shape {tuple(self.shape)}: the bias "
                f"must broadcast to the output's shape {tuple(shape)}, got shape "
                f"{tuple(bias.shape)}"
            )

    def _meta_value(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The dequantized value of a meta tensor (shape and dtype only)."""
        return torch.empty(self.shape, dtype=dtype or self.dtype, device="meta")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, {self._describe()})"

    def _describe(self) -> str:
        return ""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _linear and len(args) >= 2:  # a settled decode route first (see linear)
            # (the _Cache attribute directly: the _route property took 0.2 µs more per call)
            cache = getattr(args[1], "_cache", None)
            route = None
            if isinstance(cache, _Cache):
                route = cache.route
                pw = cache.pack
                # (not once an inner tensor was written or replaced: _linear packs again)
                if route is not None and (pw is None or pw.written(args[1])):
                    route = None
            if route is not None and not args[1].requires_grad and not _autocast_on():
                if len(args) > 2:
                    bias = args[2]
                else:
                    bias = kwargs.get("bias") if kwargs else None
                out = route.serve(args[0], bias)
                if out is not None:
                    return out
        if func is _setitem and args and isinstance(args[0], LowPrecisionTensor):
            # caught here: below, indexing yields a dequantized temporary that takes the write
            raise LowPrecisionError(
                f"__setitem__ on a {type(args[0]).__name__}: {_IMMUTABLE}, e.g. "
                "w.copy_(new_float_weight)"
            )
        kwargs = kwargs or {}
        if (
            getattr(func, "__self__", None) is _DATA
            and func.__name__ == "__set__"
            and isinstance(args[0], LowPrecisionTensor)
        ):
            args[0]._set_data(args[1])
            return None
        if func is _dlpack and isinstance(args[0], LowPrecisionTensor):
            # torch's own exported the wrapper, whose data pointer is null: a consumer
            # (torch.from_dlpack, NumPy) crashed reading it; the dequantized value is exported
            return args[0].dequantize().__dlpack__(*args[1:], **kwargs)
        if func is _share_memory and isinstance(args[0], LowPrecisionTensor):
            args[0]._share_memory()
            return args[0]
        if func is _is_shared and isinstance(args[0], LowPrecisionTensor):
            # every inner tensor (qdata shared and the scale not is not a shared tensor)
            t = args[0]
            return all(getattr(t, n).is_shared() for n in t.__tensor_flatten__()[0])
        if func is _to and _copy_requested(args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            # a quantized result shares the inner tensors (see _to_keeps_quantized): copy=True
            # promises storage of its own (a later copy_ into the source must not reach it)
            return out.clone() if isinstance(out, LowPrecisionTensor) else out
        if func is F.linear and len(args) >= 2 and isinstance(args[1], LowPrecisionTensor):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _autocast_on() and torch.is_autocast_enabled("cpu") and isinstance(x, torch.Tensor):
                # as autocast's F.linear (which this path bypasses): activations and bias in the
                # autocast dtype, so the result comes out in it (it came out float32)
                adt = torch.get_autocast_dtype("cpu")
                if x.is_floating_point() and x.dtype != adt:
                    x = x.to(adt)
                if isinstance(bias, torch.Tensor) and bias.dtype != adt:
                    bias = bias.to(adt)
            if (
                isinstance(bias, torch.Tensor)
                and isinstance(x, torch.Tensor)
                and not isinstance(x, LowPrecisionTensor)
                and bias.shape != w.shape[:1]
                and x.dim() > 0
            ):
                # the kernels add an [N] bias; F.linear takes others (a scalar, [1, N], [M, N]),
                # and refuses some of them (by its own rule, not broadcasting to the output's
                # shape alone); a 1-D one of another length falls through to the kernels',
                # which refuse it (GemvInputError at decode, LowPrecisionError at prefill)
                target = _linear_bias_target(tuple(x.shape), x.is_contiguous(), w.shape[0], bias)
                if _broadcasts_to(bias, target):
                    return _linear_other_bias(x, w, bias, target)
                if bias.dim() != 1:
                    _refuse_bias(x, w, bias, target)
            if not isinstance(x, LowPrecisionTensor):
                # always the function under torch.func (jvp's dual inputs do not require grad,
                # and forward mode ignores the grad mode; the kernels and the activation
                # quantization, a zero derivative, gave a zero tangent or none at all) and at an
                # eager forward-AD level (a dual input or bias need not require grad: the
                # Function's jvp, where the kernel dropped the tangent)
                fn: type[torch.autograd.Function] | None = (
                    _FrozenWeightLinear
                    if native.functorch_active()
                    # (native.forward_ad_active inline: ~15 ns less)
                    else _FrozenWeightLinearEager
                    if _FWAD._current_level >= 0
                    else None
                )
                if fn is not None:
                    if torch.is_grad_enabled():
                        _check_frozen(w)
                    return fn.apply(x, bias, (w,))
                if not torch.is_grad_enabled():
                    return w.linear(x, bias)
                _check_frozen(w)
                if x.requires_grad or (bias is not None and bias.requires_grad):
                    return _FrozenWeightLinearEager.apply(x, bias, (w,))
                return w.linear(x, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _KEEP:
            return args[0]._apply(lambda t: func(t))
        if func is aten.copy_.default and isinstance(args[0], LowPrecisionTensor):
            args[0]._copy_from(args[1])
            return args[0]
        written = _written_lowp(func, args, kwargs)
        if written is not None:
            raise LowPrecisionError(
                f"{func} would write into a {type(written).__name__}: {_IMMUTABLE}, e.g. "
                "w.copy_(new_float_weight)"
            )
        if (
            func is aten._to_copy.default
            and isinstance(args[0], LowPrecisionTensor)
            and _to_keeps_quantized(kwargs)
        ):
            return args[0]._with_dtype(kwargs.get("dtype") or args[0].dtype)

        def unwrap(t: Any) -> Any:
            return t.dequantize() if isinstance(t, LowPrecisionTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def _apply(self, fn: Any) -> LowPrecisionTensor:
        names, ctx = self.__tensor_flatten__()
        return type(self).__tensor_unflatten__(
            {n: fn(getattr(self, n)) for n in names}, ctx, self.shape, self.stride()
        )


def _linear_other_bias(
    x: torch.Tensor, w: LowPrecisionTensor, bias: torch.Tensor, target: tuple[int, ...]
) -> Any:
    """``F.linear(x, w, bias)`` for a bias whose shape is not ``[N]`` but broadcasts to
    ``target`` (:func:`_linear_bias_target`): added after the product, as torch 2.13's
    ``F.linear`` adds it."""
    out = F.linear(x, w)
    return (out.reshape(target) + bias.to(out.dtype)).reshape(out.shape)


def _refuse_bias(
    x: torch.Tensor, w: LowPrecisionTensor, bias: torch.Tensor, target: tuple[int, ...]
) -> None:
    """Raise for a bias that does not broadcast to ``target`` (:func:`_linear_bias_target`)."""
    where = "the product as rows" if len(target) != x.dim() else "the output's shape"
    raise LowPrecisionError(
        f"F.linear with a {type(w).__name__} of shape {tuple(w.shape)} and an input of shape "
        f"{tuple(x.shape)}: the bias must broadcast to {where} {target} without growing it "
        f"(torch's rule: see torchport.lowp.tensors._linear_bias_target), got shape "
        f"{tuple(bias.shape)}"
    )


def _linear_bias_target(
    x_shape: tuple[int, ...], x_contiguous: bool, n: int, bias: torch.Tensor
) -> tuple[int, ...]:
    """The shape torch 2.13's ``F.linear`` adds ``bias`` to the product at, for an input of
    ``x_shape`` (at least 1-D) and a weight of N = ``n`` rows: it refuses a bias that does not
    broadcast to it without growing it.

    Torch adds it as ``addmm`` does, to the product as rows ``[M, N]`` (M: the product of the
    input's leading sizes, 1 for a 1-D input), for a 2-D input, or a contiguous one with a
    contiguous bias that has exactly one size other than 1; then the result takes the output's
    shape ``(*x_shape[:-1], N)``: a 1-D input with a ``[1, N]`` bias gives ``[N]``, and an input
    ``[2, 3, K]`` refuses a ``[3, 1]`` bias (the rows are ``[6, N]``). Else, as an in-place add, to
    the output's shape. (Measured against torch on inputs of 1-4 dimensions, contiguous or not,
    and biases of 0-4 dimensions, contiguous, strided or expanded.)"""
    as_rows = len(x_shape) == 2 or (
        x_contiguous and bias.is_contiguous() and sum(s != 1 for s in bias.shape) == 1
    )
    return (math.prod(x_shape[:-1]), n) if as_rows else (*x_shape[:-1], n)


def _broadcasts_to(t: torch.Tensor, shape: tuple[Any, ...]) -> bool:
    """True if ``t`` broadcasts to ``shape`` without growing it (F.linear's rule for a bias)."""
    try:
        return torch.broadcast_shapes(shape, t.shape) == torch.Size(shape)
    except RuntimeError:
        return False


def _check_frozen(w: LowPrecisionTensor) -> None:
    """Raise for a quantized weight that requires grad (it has no gradient)."""
    if w.requires_grad:
        raise LowPrecisionError(
            f"{type(w).__name__} weights are frozen (no weight gradient): set "
            "requires_grad=False on the quantized weight, got requires_grad=True"
        )


class _FrozenWeightLinear(torch.autograd.Function):
    """``F.linear`` with a frozen quantized weight: gradients for the input and the bias only.

    Forward and ``setup_context`` apart (and a generated vmap rule: the forward runs on torch
    ops under a transform) so that ``torch.func`` transforms (``grad``, ``jacrev``, ``vmap`` of
    them) accept it: with a ``ctx`` in ``forward`` they raised "it must override the
    setup_context staticmethod"."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bias: torch.Tensor | None, wbox: tuple[Any]) -> Any:
        return wbox[0].linear(x, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, bias, wbox = inputs
        w = wbox[0]
        # under a transform every tensor input arrives wrapped, the weight in its tuple too (the
        # backward needs the quantized tensor itself: its dequantize)
        while torch._C._functorch.is_functorch_wrapped_tensor(w):
            w = torch._C._functorch.get_unwrapped(w)
        _FrozenWeightLinear._save_ctx(ctx, x, bias, w)

    @staticmethod
    def _save_ctx(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, w: Any) -> None:
        """What the backward and ``jvp`` read (both Functions): the weight, the input's shape
        and dtype, whether there is a bias, and the weight's write count now."""
        ctx.w, ctx.x_shape, ctx.has_bias = w, x.shape, bias is not None
        ctx.x_dtype, ctx.writes = x.dtype, w._cache.writes

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        w = ctx.w
        if w._cache.writes != ctx.writes:  # (as torch's check of a saved tensor's version)
            raise RuntimeError(
                "F.linear backward: one of the variables needed for gradient computation has "
                f"been modified by an inplace operation: the {type(w).__name__} weight was "
                "written (copy_ or .data =) after the forward"
            )
        g2 = grad.reshape(-1, w.shape[0])
        gx = (g2 @ w.dequantize(grad.dtype)).reshape(ctx.x_shape)
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return (gx if ctx.needs_input_grad[0] else None), gb, None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor | None, bias_t: torch.Tensor | None, _: Any) -> Any:
        """Forward mode, the transpose of :meth:`backward`: ``x_t @ dequantize(W).T + bias_t``
        (activation quantization straight-through), in the output's dtype."""
        w, dtype = ctx.w, ctx.x_dtype
        shape = (*ctx.x_shape[:-1], w.shape[0])
        if x_t is not None:
            out = (x_t.reshape(-1, w.shape[1]) @ w.dequantize(x_t.dtype).T).reshape(shape)
        else:
            out = torch.zeros(shape, dtype=dtype)
        if bias_t is not None:
            out = out + bias_t
        return out.to(dtype)


class _FrozenWeightLinearEager(torch.autograd.Function):
    """:class:`_FrozenWeightLinear` with its ``ctx`` in ``forward``, for calls outside
    ``torch.func`` transforms. A function with a separate ``setup_context`` makes every
    ``apply`` bind its arguments to ``forward``'s signature (``inspect.signature(...).bind``):
    about 17 µs on each ``F.linear`` call with a quantized weight and an input or bias that
    requires grad (a quantized ``nn.Linear``'s bias requires grad), 40 µs a decode call where
    the kernel takes 23. The transforms need that form; eager and ``torch.compile`` take this."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, wbox: tuple[Any]) -> Any:
        w = wbox[0]  # no transform: no wrapper to take off
        _FrozenWeightLinear._save_ctx(ctx, x, bias, w)
        return w.linear(x, bias)

    backward = _FrozenWeightLinear.backward
    jvp = _FrozenWeightLinear.jvp


def _scannable(codes: torch.Tensor) -> bool:
    """Whether a pack may scan its codes for NaN: real, non-empty storage outside tracing (a
    traced pack is built on every call, where the scan would read the weight again each time;
    traced in this thread: another thread's compile skipped the scan, and NaN codes read as
    finite values)."""
    return type(codes) is torch.Tensor and not is_compiling_here() and codes.numel() > 0


def _true(flag: torch.Tensor) -> bool:
    """A one-element bool tensor's value, read through NumPy: a pack made while a graph captures
    (``capture_error_mode="global"``) may not call ``bool(tensor)`` (aten.is_nonzero)."""
    return bool(flag.numpy())


def _e4m3_nan(codes: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Whether E4M3 bytes hold a NaN code (0x7F/0xFF), along ``dim`` (``None``: any). They are
    the largest codes as int8 (127) and as uint8 (255): two max reductions, 30 ms for 11008x4096
    here where ``((codes & 0x7F) == 0x7F).any(1)`` took 330."""
    u8 = codes.view(torch.uint8)
    if dim is None:
        return (u8.view(torch.int8).amax() == 127) | (u8.amax() == 255)
    return (u8.view(torch.int8).amax(dim) == 127) | (u8.amax(dim) == 255)


# --- FP8 -----------------------------------------------------------------------------------------


class Float8Tensor(LowPrecisionTensor):
    """FP8 weight ``[N, K]`` with a per-tensor (``[]``; ``[1]`` is taken as ``[]``) or per-row
    (``[N, 1]``) float32 scale; any other scale shape raises.

    ``act_dtype`` set → activations are quantized dynamically with the weight's granularity (per
    row for a per-row weight scale, per tensor for a per-tensor one: ``scaled_mm`` takes both
    scales one way or the other) at every batch size, as torchao's
    ``Float8DynamicActivationFloat8WeightConfig``: the prefill path runs
    :func:`torchport.scaled_mm` on the FP8 codes, the decode GEMV (≤ 8 rows) on the
    dequantized activation (``code * scale``, one float32 rounding per element: the same
    numbers within float32 rounding); None → weight-only. NaN and infinities in the activation
    are quantized as torchao quantizes them (:func:`torchport.lowp.fp8.fp8_quantize_activation`,
    no error): every output of a row holding one (per-row scaling), or of the whole input
    (per-tensor scaling), is NaN, at every batch size.
    """

    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        act_dtype: torch.dtype | None = None,
    ):
        return super().__new__(cls, qdata.shape, orig_dtype, device=qdata.device)

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        act_dtype: torch.dtype | None = None,
    ) -> None:
        scale = self._checked_scale(qdata, scale, act_dtype)
        self.qdata, self.scale = qdata, scale
        self._orig_dtype, self.act_dtype = orig_dtype, act_dtype
        self._check_settings()
        self._pack = None
        self._share()

    _settings = ("_orig_dtype", "act_dtype")

    @staticmethod
    def _checked_scale(
        qdata: torch.Tensor, scale: torch.Tensor, act_dtype: torch.dtype | None
    ) -> torch.Tensor:
        """``scale`` in its one form (``[]`` tensor-wise, ``[..., 1]`` row-wise), after checking
        the qdata dtype, the scale shape and ``act_dtype``."""
        if qdata.dtype not in FP8_DTYPES:
            raise LowPrecisionError(f"Float8Tensor: qdata must be float8, got {qdata.dtype}")
        if act_dtype is not None and act_dtype not in FP8_DTYPES:
            raise LowPrecisionError(
                f"Float8Tensor: act_dtype must be float8_e4m3fn, float8_e5m2 or None, got {act_dtype}"
            )
        rowwise = (*qdata.shape[:-1], 1)
        if tuple(scale.shape) == ():  # (itself: a view would hold it, see _alone)
            return scale
        if tuple(scale.shape) == (1,):
            return scale.reshape(())  # one form for tensor-wise (code tests scale.dim())
        if tuple(scale.shape) != rowwise:
            raise LowPrecisionError(
                "Float8Tensor: scale must have shape () or (1,) (tensor-wise) or "
                f"{rowwise} (row-wise), got {tuple(scale.shape)}"
            )
        return scale

    @classmethod
    def from_float(
        cls,
        w: torch.Tensor,
        dtype: torch.dtype = torch.float8_e4m3fn,
        granularity: str = "row",
        act_dtype: torch.dtype | None = None,
    ) -> Float8Tensor:
        """Quantize a float32/bfloat16 tensor (torchao float8 recipe, see :mod:`torchport.lowp.fp8`)."""
        q, s = fp8.fp8_quantize(w, dtype, granularity)
        # (detached: views of the quantizer's temporaries, whose bases would count as other
        # holders of their memory and keep a large weight off huge pages, see _alone)
        return cls(q.detach(), s.detach(), w.dtype, act_dtype)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], (self._orig_dtype, self.act_dtype)

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: Any, size: Any = None, stride: Any = None
    ) -> Float8Tensor:
        return cls(inner["qdata"], inner["scale"], *ctx)

    def _inner_shape(self) -> tuple[int, ...]:
        self.scale = self._checked_scale(self.qdata, self.scale, self.act_dtype)
        return tuple(self.qdata.shape)

    def _with_dtype(self, dtype: torch.dtype) -> Float8Tensor:
        return Float8Tensor(self.qdata, self.scale, dtype, self.act_dtype)

    def _quantize_like(self, x: torch.Tensor) -> Float8Tensor:
        gran = "row" if self.scale.dim() else "tensor"
        return Float8Tensor.from_float(x, self.qdata.dtype, gran, self.act_dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.qdata.is_meta:
            return self._meta_value(dtype)
        return fp8.fp8_dequantize(self.qdata, self.scale, dtype or self.dtype)

    def _describe(self) -> str:
        return f"fp8={self.qdata.dtype}, scale={'row' if self.scale.dim() else 'tensor'}"

    def _make_pack(self) -> PackedWeight:
        n, k = self.shape
        rs = self.scale.float().reshape(-1).expand(n).contiguous()
        fmt = "fp8_e4m3" if self.qdata.dtype == torch.float8_e4m3fn else "fp8_e5m2"
        empty = self.qdata.new_empty(0, dtype=torch.uint8)
        data = self.qdata.view(torch.uint8).contiguous()
        if fmt == "fp8_e4m3" and _scannable(data):
            # The register decodes (half-precision and integer-shift) read E4M3's NaN codes
            # 0x7F/0xFF as 480 (a per-element check would cost vector instructions in the loops
            # tuned per instruction); torch's cast reads NaN, which makes the row's every
            # product NaN. So a scan, once for this cached pack, gives such rows a NaN row
            # scale: the same NaN outputs, at no cost per call.
            nan_rows = _e4m3_nan(data, 1)
            if _true(nan_rows.any()):  # out of place: rs may be the tensor's own (N, 1) scale
                rs = rs.masked_fill(nan_rows, math.nan)
        # Rows whose scale times a code overflows (an infinite scale): the kernel's scale times
        # its sum is ±inf where torch's dequantized weight makes inf · 0 and inf - inf NaN. Found
        # once here; every call computes those outputs with torch ops (torchport.gemv.ops._run)
        over = overflow_rows(fmt, rs)
        return PackedWeight(fmt, data, empty, rs, 1.0, n, k, False, overflow_rows=over)

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.act_dtype is None:
            return None
        gran = "row" if self.scale.dim() else "tensor"
        q, s = fp8.fp8_quantize_activation(_hp_activation(x), self.act_dtype, gran)
        return fp8.fp8_dequantize(q, s)

    def prefill_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from torchport.lowp.scaled_mm import scaled_mm

        if self.act_dtype is None:
            return super().prefill_linear(x, bias)
        lead, k = x.shape[:-1], x.shape[-1]
        # scaled_mm (as torch._scaled_mm) takes both scales row-wise or both tensor-wise
        rowwise = self.scale.dim() != 0
        x2 = x.reshape(-1, k)
        x2 = _hp_activation(x2)
        xq, xs = fp8.fp8_quantize_activation(x2, self.act_dtype, "row" if rowwise else "tensor")
        ws = self.scale.float().reshape(1, -1) if rowwise else self.scale.float()
        out = scaled_mm(xq, self.qdata.t(), xs.float(), ws, bias=bias, out_dtype=x.dtype)
        return out.reshape(*lead, self.shape[0])


# --- NVFP4 ---------------------------------------------------------------------------------------


def _nvfp4_pts(x: torch.Tensor, per_tensor_scale: bool | float) -> float | None:
    """The per-tensor scale for ``x``: from its amax (True), none (False) or as given."""
    if per_tensor_scale is True:
        # (checked before the amax is read: a meta tensor's .item() raised torch's untyped error)
        check_input(x, nvfp4.BLOCK, "nvfp4_quantize")
        pts = nvfp4.per_tensor_amax_to_scale(x.detach().abs().max()) if x.numel() else None
        return None if pts == 0.0 or (pts is not None and not math.isfinite(pts)) else pts
    if per_tensor_scale is False:
        return None
    nvfp4.check_per_tensor_scale(per_tensor_scale)  # typed error for a non-number
    return float(per_tensor_scale)


def _nvfp4_traced_act_pts(x: torch.Tensor) -> torch.Tensor:
    """A traced activation's per-tensor scale from its amax, a 0-d float32 tensor (a float read
    the traced value: torch.export failed on it, torch.compile recompiled for each new one).
    1.0 where :func:`_nvfp4_pts` has none (amax zero or not finite): the same bits."""
    pts = nvfp4.per_tensor_amax_to_scale_tensor(x.detach().abs().max())
    return torch.where((pts > 0) & torch.isfinite(pts), pts, 1.0)


class NVFP4Tensor(LowPrecisionTensor):
    """NVFP4 ``[N, K]``: packed E2M1 ``qdata [N, K/2]``, E4M3 ``scale [N, K/16]``, optional FP32
    ``per_tensor_scale`` (torchao recipe, see :mod:`torchport.lowp.nvfp4`).

    ``act_per_tensor_scale`` None → weight-only; True/False → activations are quantized to NVFP4 at
    run time, with/without a dynamic per-tensor scale from each activation's amax.
    """

    _copied_meta = ("per_tensor_scale",)
    _settings = ("_orig_dtype", "act_per_tensor_scale")

    def _check_own(self) -> None:
        # (a NaN, negative or zero per-tensor scale gave NaN, sign-flipped or zero outputs)
        nvfp4.check_per_tensor_scale(self.per_tensor_scale)
        act = self.act_per_tensor_scale
        if not (act is None or isinstance(act, bool)):
            raise LowPrecisionError(
                f"NVFP4Tensor: act_per_tensor_scale must be None, True or False, got {act!r}"
            )

    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        per_tensor_scale: float | None,
        orig_dtype: torch.dtype,
        act_per_tensor_scale: bool | None = None,
    ):
        shape = (*qdata.shape[:-1], qdata.shape[-1] * 2)
        return super().__new__(cls, shape, orig_dtype, device=qdata.device)

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        per_tensor_scale: float | None,
        orig_dtype: torch.dtype,
        act_per_tensor_scale: bool | None = None,
    ) -> None:
        # the kernels read K/16 one-byte scales per row: another shape or dtype was read past
        # its end or misread (silently wrong results)
        nvfp4._check_packed(qdata, scale, nvfp4.BLOCK, "NVFP4Tensor")
        self.qdata, self.scale = qdata, scale
        self.per_tensor_scale, self._orig_dtype = per_tensor_scale, orig_dtype
        self.act_per_tensor_scale = act_per_tensor_scale
        self._check_settings()
        self._pack = None
        self._share()

    @property
    def per_tensor_scale(self) -> float | None:
        """The FP32 per-tensor scale (None: one-level scaling); a ``copy_`` into this tensor or
        one sharing its bytes sets it (kept in the :class:`_Cache` for that)."""
        return self._cache.per_tensor_scale  # type: ignore[attr-defined]

    @per_tensor_scale.setter
    def per_tensor_scale(self, value: float | None) -> None:
        """Checked as the constructor checks it. Set on a weight in use (``w.per_tensor_scale
        = v``), it reaches every tensor standing for the same bytes and drops their packed
        weights and settled routes, as a ``copy_`` does: the packed copy kept the old scale,
        so ``F.linear`` went on returning the old weight's results."""
        nvfp4.check_per_tensor_scale(value)
        if self._cache.key is None:  # (being built, or no real storage: nothing shares it)
            self._cache.per_tensor_scale = value  # type: ignore[attr-defined]
            return
        self._bytes_changed({"per_tensor_scale": value})

    @classmethod
    def from_float(
        cls,
        w: torch.Tensor,
        per_tensor_scale: bool | float = True,
        act_per_tensor_scale: bool | None = None,
    ) -> NVFP4Tensor:
        """Quantize; ``per_tensor_scale=True`` derives it from ``amax`` (torchao's two-level scaling)."""
        if act_per_tensor_scale is not None and not isinstance(act_per_tensor_scale, bool):
            raise LowPrecisionError(
                f"act_per_tensor_scale must be None, True or False, got {act_per_tensor_scale!r}"
            )
        pts = _nvfp4_pts(w, per_tensor_scale)
        if per_tensor_scale is True and pts is None:
            # amax 0 (or a scale that underflows): 1.0 gives the same bits as no scale and keeps
            # the two-level recipe, which copy_ re-derives from a loaded source's amax
            pts = 1.0
        q, s = nvfp4.nvfp4_quantize(w, pts)
        return cls(q.detach(), s.detach(), pts, w.dtype, act_per_tensor_scale)  # (see Float8's)

    def _fp4_x_fp4(self) -> bool:
        return self.act_per_tensor_scale is not None

    def _traced_as_op(self) -> bool:
        # always: the per-tensor scale (or its absence, 1.0) was traced as a constant, so an
        # exported module kept it after load_state_dict; the op reads the live weight's
        return True

    def _act_settings(self) -> tuple[float | None, bool | None, str | None, str | None]:
        return self.per_tensor_scale, self.act_per_tensor_scale, None, None

    def fp4_activation(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.act_per_tensor_scale is None:
            return None
        pts = _nvfp4_pts(x2, self.act_per_tensor_scale)
        q, s = nvfp4.nvfp4_quantize(x2, pts)
        total = s.float() * (1.0 if pts is None else torch.tensor(pts, dtype=torch.float32))
        return unpack_fp4(q), total.repeat_interleave(2, dim=1)

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.act_per_tensor_scale is None:
            return None
        x = _hp_activation(x)
        if self.act_per_tensor_scale and x.numel() and not native.eager_fast_path(x.detach()):
            # traced (where the reference runs anyway): the scale stays in the graph
            pts_t = _nvfp4_traced_act_pts(x)
            q, s = nvfp4.nvfp4_quantize_traced(x, pts_t)
            return nvfp4.nvfp4_dequantize_reference(q, s, pts_t)
        pts = _nvfp4_pts(x, self.act_per_tensor_scale)
        q, s = nvfp4.nvfp4_quantize(x, pts)
        return nvfp4.nvfp4_dequantize(q, s, pts)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], (
            self.per_tensor_scale,
            self._orig_dtype,
            self.act_per_tensor_scale,
        )

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: Any, size: Any = None, stride: Any = None
    ) -> NVFP4Tensor:
        return cls(inner["qdata"], inner["scale"], *ctx)

    def _inner_shape(self) -> tuple[int, ...]:
        k = nvfp4._check_packed(self.qdata, self.scale, nvfp4.BLOCK, "NVFP4Tensor")
        return (*self.qdata.shape[:-1], k)

    def _with_dtype(self, dtype: torch.dtype) -> NVFP4Tensor:
        return NVFP4Tensor(
            self.qdata, self.scale, self.per_tensor_scale, dtype, self.act_per_tensor_scale
        )

    def _quantize_like(self, x: torch.Tensor) -> NVFP4Tensor:
        # a per-tensor scale (from x's amax) exactly when this tensor has one
        return NVFP4Tensor.from_float(
            x, self.per_tensor_scale is not None, self.act_per_tensor_scale
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.qdata.is_meta:
            return self._meta_value(dtype)
        return nvfp4.nvfp4_dequantize(
            self.qdata, self.scale, self.per_tensor_scale, dtype or self.dtype
        )

    def _describe(self) -> str:
        act = "" if self.act_per_tensor_scale is None else ", activations=nvfp4"
        return f"block=16, per_tensor_scale={self.per_tensor_scale}{act}"

    def _make_pack(self) -> PackedWeight:
        n, k = self.shape
        pts = self.per_tensor_scale if self.per_tensor_scale is not None else 1.0
        empty = self.qdata.new_empty(0, dtype=torch.float32)
        scales = self.scale.view(torch.uint8).contiguous()
        # a NaN block scale: the float kernel (its E4M3 table reads NaN, the int8 kernels' bit
        # decode 480), found once for this cached pack
        int8 = not (_scannable(scales) and _true(_e4m3_nan(scales, None)))
        return PackedWeight("nvfp4", self.qdata.contiguous(), scales, empty, pts, n, k, int8)


# --- MX ------------------------------------------------------------------------------------------


class MXTensor(LowPrecisionTensor):
    """MX ``[N, K]`` (OCP MX v1.0, torchao FLOOR recipe; see :mod:`torchport.lowp.mx`): ``qdata``
    (packed uint8 for ``fp4_e2m1``, float8 otherwise) and E8M0 ``scale [N, K/32]`` (uint8)."""

    _settings = ("elem", "_orig_dtype", "act_elem")

    def _check_own(self) -> None:
        if self.elem not in mx.ELEMS:
            raise LowPrecisionError(f"MXTensor: elem must be one of {mx.ELEMS}, got {self.elem!r}")
        if self.act_elem is not None and self.act_elem not in mx.ELEMS:
            raise LowPrecisionError(
                f"MXTensor: act_elem must be one of {mx.ELEMS} or None, got {self.act_elem!r}"
            )

    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        elem: str,
        orig_dtype: torch.dtype,
        act_elem: str | None = None,
    ):
        k = qdata.shape[-1] * (2 if elem == "fp4_e2m1" else 1)
        return super().__new__(cls, (*qdata.shape[:-1], k), orig_dtype, device=qdata.device)

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        elem: str,
        orig_dtype: torch.dtype,
        act_elem: str | None = None,
    ) -> None:
        try:  # (as NVFP4Tensor: the kernels read K/32 one-byte scales per row)
            mx._k_of(qdata, scale, elem)
        except LowPrecisionError as e:
            raise LowPrecisionError(f"MXTensor: {e}") from e
        self.qdata, self.scale, self.elem, self._orig_dtype = qdata, scale, elem, orig_dtype
        self.act_elem = act_elem
        self._check_settings()
        self._pack = None
        self._share()

    @classmethod
    def from_float(
        cls, w: torch.Tensor, elem: str = "fp4_e2m1", act_elem: str | None = None
    ) -> MXTensor:
        """Quantize a float32/bfloat16 tensor to MX with element type ``elem``; ``act_elem`` set
        → activations are quantized to MX with that element type at run time."""
        if act_elem is not None and act_elem not in mx.ELEMS:
            raise LowPrecisionError(f"act_elem must be one of {mx.ELEMS} or None, got {act_elem!r}")
        q, s = mx.mx_quantize(w, elem)
        return cls(q.detach(), s.detach(), elem, w.dtype, act_elem)  # (see Float8's)

    def _fp4_x_fp4(self) -> bool:
        return self.elem == "fp4_e2m1" and self.act_elem == "fp4_e2m1"

    def _traced_as_op(self) -> bool:
        return self.act_elem is not None

    def _act_settings(self) -> tuple[float | None, bool | None, str | None, str | None]:
        return None, None, self.elem, self.act_elem

    def fp4_activation(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._fp4_x_fp4():
            return None
        q, s = mx.mx_quantize(x2, "fp4_e2m1")
        return unpack_fp4(q), e8m0_to_f32(s).repeat_interleave(4, dim=1)

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.act_elem is None:
            return None
        x = _hp_activation(x)
        q, s = mx.mx_quantize(x, self.act_elem)
        return mx.mx_dequantize(q, s, self.act_elem)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], (self.elem, self._orig_dtype, self.act_elem)

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: Any, size: Any = None, stride: Any = None
    ) -> MXTensor:
        return cls(inner["qdata"], inner["scale"], *ctx)

    def _inner_shape(self) -> tuple[int, ...]:
        k = mx._k_of(self.qdata, self.scale, self.elem)
        return (*self.qdata.shape[:-1], k)

    def _with_dtype(self, dtype: torch.dtype) -> MXTensor:
        return MXTensor(self.qdata, self.scale, self.elem, dtype, self.act_elem)

    def _quantize_like(self, x: torch.Tensor) -> MXTensor:
        return MXTensor.from_float(x, self.elem, self.act_elem)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.qdata.is_meta:
            return self._meta_value(dtype)
        return mx.mx_dequantize(self.qdata, self.scale, self.elem, dtype or self.dtype)

    def _describe(self) -> str:
        act = "" if self.act_elem is None else f", activations={self.act_elem}"
        return f"elem={self.elem}, block=32{act}"

    def _make_pack(self) -> PackedWeight:
        n, k = self.shape
        fmt = {"fp4_e2m1": "mxfp4", "fp8_e4m3": "mxfp8_e4m3", "fp8_e5m2": "mxfp8_e5m2"}[self.elem]
        empty = self.qdata.new_empty(0, dtype=torch.float32)
        data = self.qdata.view(torch.uint8).contiguous()
        scales = self.scale.contiguous()
        if self.elem == "fp8_e4m3" and _scannable(data):
            # E4M3 elements' NaN codes: the float kernel's register decode reads them as 480
            # (see Float8Tensor._make_pack); torch's cast as NaN, which makes the row's every
            # product NaN. The pack's copy of the scales gets the E8M0 NaN code for the blocks
            # that hold one (the kernel's E8M0 table reads NaN): NaN rows, nothing per call.
            nan_blocks = _e4m3_nan(data.reshape(n, -1, mx.BLOCK), 2)
            if _true(nan_blocks.any()):
                u8 = scales.view(torch.uint8).masked_fill(nan_blocks, 255)
                scales = u8.view(scales.dtype)
        # an E8M0 NaN scale (0xFF): the float kernel (its table reads NaN, the int8 kernels'
        # exponent shift infinity), found once for this cached pack
        int8 = not (_scannable(scales) and _true(scales.view(torch.uint8).amax() == 255))
        return PackedWeight(fmt, data, scales, empty, 1.0, n, k, int8)


# --- traced linear as one op -----------------------------------------------------------------------
# NVFP4 and MX weights with run-time activation quantization reach native kernels (ctypes), the
# activation's finiteness check and amax as Python values: traced, every one of them was a graph
# break (a two-layer model made 17-23 graphs under torch.compile) and torch.export took the
# reference quantization instead of the kernels' path. An NVFP4 per-tensor scale is a Python
# float: traced, a constant, which an exported module kept after load_state_dict (its outputs
# scaled by old / new scale). Traced, the call is one custom op that runs the eager path on the
# live weight: one graph, eager's bits and errors.


def _traced(x: torch.Tensor) -> bool:
    """True while ``torch.compile`` (Dynamo), ``torch.export`` or ``make_fx`` trace ``x`` (not
    under a ``torch.func`` transform: the custom op has no batching or forward-mode rule)."""
    if native.functorch_active():  # (also inside a compiled torch.func transform)
        return False
    if is_compiling_here():  # (this thread: any thread's compile set is_compiling())
        return True
    if type(x) in _PLAIN and not torch._C._len_torch_dispatch_stack():
        return False  # (plain eager: the common case first)
    proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    return is_fake(x) or proxy is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _act_linear_traced(
    w: NVFP4Tensor | MXTensor, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    pts, act_pts, elem, act_elem = w._act_settings()
    kind = "nvfp4" if isinstance(w, NVFP4Tensor) else "mx"
    return _act_linear_op(x, w.qdata, w.scale, bias, kind, w.dtype, pts, act_pts, elem, act_elem)


def _rebuilt(
    kind: str,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    orig_dtype: torch.dtype,
    pts: float | None,
    act_pts: bool | None,
    elem: str | None,
    act_elem: str | None,
) -> LowPrecisionTensor:
    """The quantized weight :func:`_act_linear_op` was traced with, from its inner tensors and
    settings, made once per live weight over the same bytes and kept in that weight's cache
    (constructing it took ~60 us a call). It has a cache of its own, entered for the same bytes,
    so a ``copy_`` into the live weight reaches it (its packed copy is dropped, its per-tensor
    scale set); the two share their packed weight (a second pack would be a second copy of
    the weight on huge pages). The live weight's cache holds it, not the other way round: no
    reference cycle keeps a dropped model's weights alive until the garbage collector runs."""
    settings = (kind, orig_dtype, pts, act_pts, elem, act_elem)
    key = _storage_key(qdata)
    live: _Cache | None = None
    if key is not None:
        view = tuple((t.storage_offset(), tuple(t.shape), t.stride()) for t in (qdata, scale))
        for ref in list(_SHARING.get(key, {}).values()):
            c = ref()
            if c is None or c.key != key or c.view != view:
                continue
            if c.rebuilt is not None and c.rebuilt[0] == settings:
                w = c.rebuilt[1]
                own = w._cache
                if own.pack is None and c.pack is not None:
                    own.pack = c.pack
                elif c.pack is None and own.pack is not None:
                    c.pack = own.pack
                return w
            if live is None or live.pack is None:
                live = c
    if kind == "nvfp4":
        w = NVFP4Tensor(qdata, scale, pts, orig_dtype, act_pts)
    else:
        w = MXTensor(qdata, scale, elem or "", orig_dtype, act_elem)
    if live is not None:
        for attr in w._copied_meta:  # (the live weight's: a copy_ after tracing set its own)
            if hasattr(live, attr):
                setattr(w._cache, attr, getattr(live, attr))
        w._cache.pack = live.pack
        live.rebuilt = (settings, w)
    return w


@torch.library.custom_op("torchport::lowp_act_linear", mutates_args=())
def _act_linear_op(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    orig_dtype: torch.dtype,
    pts: float | None,
    act_pts: bool | None,
    elem: str | None,
    act_elem: str | None,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for an NVFP4 weight (``kind="nvfp4"``: ``pts``, ``act_pts``)
    or an MX weight with run-time activation quantization (``"mx"``: ``elem``, ``act_elem``),
    rebuilt from its inner tensors: the eager path (native kernels, typed errors) as one traced
    op."""
    w = _rebuilt(kind, qdata, scale, orig_dtype, pts, act_pts, elem, act_elem)
    out = w._linear(x, bias)
    # (a custom op's output may not alias an input: an empty x's result could be a view)
    return out.clone() if out._is_view() or out.data_ptr() == x.data_ptr() else out


@_act_linear_op.register_fake
def _(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    orig_dtype: torch.dtype,
    pts: float | None,
    act_pts: bool | None,
    elem: str | None,
    act_elem: str | None,
) -> torch.Tensor:
    # the eager path's shape checks, its output in x's dtype
    w = _rebuilt(kind, qdata, scale, orig_dtype, pts, act_pts, elem, act_elem)
    meta = w._meta_linear(x.to("meta"), None if bias is None else bias.to("meta"))
    return x.new_empty(meta.shape)


# torch.load's default weights_only unpickler may rebuild these (as torchao registers its own
# tensor subclasses): a saved quantized state_dict loads without weights_only=False
torch.serialization.add_safe_globals([Float8Tensor, NVFP4Tensor, MXTensor])
