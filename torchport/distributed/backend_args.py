"""Argument checks and staging shared by the ``torchport`` c10d backend's collectives.

Reduce ops are validated against the dtype here (typed :class:`CollectiveArgumentError` naming
the requirement and the offending value); non-contiguous tensors, and conjugate or negative
views (whose memory holds the conjugate / negation of their values), are staged through plain
contiguous copies (:class:`_Staged`), taken as the operation runs and written back after it.
"""

from __future__ import annotations

import datetime
import operator
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from torchport.distributed.engine import (
    NATIVE_CODES,
    RED_AVG,
    RED_PREMUL,
    dtype_code,
    plain_contiguous,
)
from torchport.distributed.errors import CollectiveArgumentError

ReduceOp = dist.ReduceOp
_NATIVE_RED = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BAND": 4, "BOR": 5, "BXOR": 6}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
# the dtypes ReduceOp.AVG / PREMUL_SUM take (a quotient / a scaled sum: no integers, no float8)
AVG_DTYPES = _FLOATS + _COMPLEX


def _red_name(op: Any) -> tuple[str, float]:
    """(name, premul factor) of a ReduceOp / RedOpType / options object."""
    inner = getattr(op, "op", op)
    name = getattr(inner, "name", str(inner).split(".")[-1])
    factor = 1.0
    if name == "PREMUL_SUM":
        f = getattr(op, "factor", None)
        value = f.item() if isinstance(f, torch.Tensor) else f
        if isinstance(value, complex):
            # (a complex tensor reaches the backend as its view_as_real pairs, which a complex
            # factor cannot scale; float() raised an untyped TypeError)
            raise CollectiveArgumentError(
                f"ReduceOp.PREMUL_SUM requires a real factor, got {value!r}"
            )
        factor = float(value) if value is not None else 1.0
    return name, factor


# ReduceOp.AVG on these dtypes premultiplies by 1 / world_size, as NCCL averages floating-point
# types, instead of dividing the sum: a float16 sum overflowed to inf where the mean fits (40000.0
# on two ranks gave inf). The others keep sum-then-divide (one rounding fewer; no such overflow
# short of float32's range).
PREMUL_AVG_DTYPES = (torch.float16,)


def _avg_premul(name: str, factor: float, dtype: torch.dtype, world: int) -> tuple[str, float]:
    """(name, factor) to run ``name`` with: AVG on :data:`PREMUL_AVG_DTYPES` as PREMUL_SUM by
    1 / ``world`` (every rank alike: the wire's op code stays AVG's)."""
    if name == "AVG" and dtype in PREMUL_AVG_DTYPES:
        return "PREMUL_SUM", 1.0 / world
    return name, factor


def _check_red(name: str, dtype: torch.dtype, where: str) -> int:
    """Native op code for ``name`` on ``dtype`` or a typed error."""
    if dtype_code(dtype) >= NATIVE_CODES:
        raise CollectiveArgumentError(f"{where}: reductions do not support dtype {dtype}")
    if name in ("AVG", "PREMUL_SUM"):
        if dtype not in AVG_DTYPES:
            raise CollectiveArgumentError(
                f"{where}: ReduceOp.{name} requires a floating-point or complex dtype, got {dtype}"
            )
        return RED_AVG if name == "AVG" else RED_PREMUL  # (folded as SUM: engine.FOLD_MASK)
    if name not in _NATIVE_RED:
        raise CollectiveArgumentError(f"{where}: unsupported reduce op {name}")
    if name in ("BAND", "BOR", "BXOR") and (dtype in _FLOATS or dtype in _COMPLEX):
        raise CollectiveArgumentError(
            f"{where}: ReduceOp.{name} requires an integer or bool dtype, got {dtype}"
        )
    if name in ("MIN", "MAX") and dtype in _COMPLEX:
        raise CollectiveArgumentError(
            f"{where}: ReduceOp.{name} is undefined for complex dtype {dtype}"
        )
    return _NATIVE_RED[name]


# (dtype, RedOpType value) -> (name, native code) of validated combinations; PREMUL_SUM is never
# cached (its factor travels with each call).
_RED_CACHE: dict[tuple[torch.dtype, int], tuple[str, int]] = {}


def _red_for(op: Any, dtype: torch.dtype, where: str) -> tuple[str, float, int]:
    """(name, premul factor, native code) of reduce op ``op`` on ``dtype``, validated once per
    combination (a repeated allreduce skips the name lookup and the dtype checks)."""
    inner = getattr(op, "op", op)
    try:
        key: tuple[torch.dtype, int] | None = (dtype, int(inner))
    except (TypeError, ValueError):
        key = None
    hit = _RED_CACHE.get(key) if key is not None else None
    if hit is not None:
        return hit[0], 1.0, hit[1]
    name, factor = _red_name(op)
    code = _check_red(name, dtype, where)
    if key is not None and name != "PREMUL_SUM":
        _RED_CACHE[key] = (name, code)
    return name, factor, code


def _one(tensors: Sequence[torch.Tensor] | torch.Tensor, where: str) -> torch.Tensor:
    """The one tensor of a call: ``[t]``, or a bare ``t`` (torch's single-tensor overloads,
    ``pg.allreduce(t)``, which DDP's join hook uses). A bare tensor was read as a list: one of
    n > 1 elements was refused ("got n"), one of a single element passed its view ``t[0]``."""
    if type(tensors) is not list and isinstance(tensors, torch.Tensor):  # (the list form: ~15 ns)
        return _cpu(tensors, where)
    if len(tensors) != 1:
        raise CollectiveArgumentError(
            f"{where}: expects exactly one tensor per call, got {len(tensors)}"
        )
    return _cpu(tensors[0], where)


def _positional(opts: Any, where: str, timeout: Any = None, **values: Any) -> Any:
    """``opts`` (a new options object) holding the values that torch's positional overloads pass
    in its place, as its ProcessGroup bindings build it: ``pg.reduce(t, 0, ReduceOp.MAX)``,
    ``pg.broadcast(t, 1)``, ``pg.barrier(timedelta(...))``. ``values`` maps option fields
    (``rootRank``, ``reduceOp``) to what was passed; None keeps a field's default."""
    for field, value in values.items():
        if value is None:
            continue
        if field == "reduceOp":
            if not isinstance(value, ReduceOp):
                raise CollectiveArgumentError(
                    f"{where}: expects its options object or a ReduceOp, got {value!r}"
                )
        else:
            try:
                value = operator.index(value)
            except TypeError:
                raise CollectiveArgumentError(
                    f"{where}: expects its options object or an integer root rank, got {value!r}"
                ) from None
        setattr(opts, field, value)
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            raise CollectiveArgumentError(
                f"{where}: a timeout must be a datetime.timedelta, got {timeout!r}"
            )
        opts.timeout = timeout
    return opts


def _timed(opts: Any, timeout: Any, make: Callable[[], Any], where: str) -> Any:
    """``opts``, or for torch's ``(..., timeout=None)`` overloads (a timedelta in the options'
    place, or ``timeout=``) a new ``make()`` holding that timeout (it was silently ignored)."""
    if isinstance(opts, datetime.timedelta):
        opts, timeout = None, opts
    return opts if timeout is None else _positional(make(), where, timeout)


def _cpu(t: Any, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CollectiveArgumentError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise CollectiveArgumentError(f"{where}: tensors must be on device 'cpu', got {t.device}")
    if t.layout is not torch.strided:
        # a sparse input's .contiguous() / data_ptr() raised on the engine thread (an untyped
        # RuntimeError failing the group on every rank); a sparse output was refused as
        # "overlapping itself" (~60 ns per call)
        raise CollectiveArgumentError(
            f"{where}: tensors must be dense (layout torch.strided), got {t.layout}"
        )
    return t


def _check_no_self_overlap(t: torch.Tensor) -> None:
    """Refuse an output that overlaps itself where the op is issued: the copy back into such a
    tensor raised on the engine thread, which failed the whole group on every rank."""
    if not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        raise CollectiveArgumentError(
            "a collective's output tensor must not overlap itself (an expanded view writes "
            f"several elements to one place), got shape {tuple(t.shape)} strides {t.stride()}"
        )


def _writable(t: torch.Tensor) -> torch.Tensor:
    """``t`` checked as a collective's output (not self-overlapping), as the tensor the
    collective's in-place torch ops write (copy-back, AVG's divide, PREMUL_SUM's scale).

    On a leaf that requires grad (a parameter) those ops raised on the engine thread, and on a
    ``detach()``ed alias they bumped the shared version counter, so a later backward that had
    saved the tensor raised 'modified by an inplace operation'. Gloo's and the native paths'
    writes leave autograd and the version alone, and so do these through ``.data`` (same memory,
    its own version counter). A tensor that does not require grad keeps the bump (the GEMM pack
    cache reads it as "changed")."""
    _check_no_self_overlap(t)
    return t.data if t.requires_grad else t


class _Staged:
    """A contiguous stand-in for an output tensor (one whose memory holds its values: see
    :func:`plain_contiguous`), taken and copied back on the engine thread.

    A stand-in that is a copy is made where the op first reads :attr:`t`, as it runs: made as
    the op was issued, it missed what earlier ops of the group, still queued, then wrote back
    (two async all_reduces of one transposed view summed once). A tensor that is its own
    stand-in is set at once (plain attribute reads on the hot path)."""

    __slots__ = ("orig", "t")
    orig: torch.Tensor
    t: torch.Tensor  # (unset until first read where it is a copy: see __getattr__)

    def __init__(self, t: torch.Tensor) -> None:
        if t.requires_grad or not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = _writable(t)  # (a contiguous tensor never overlaps itself)
            self.orig = t
            if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                self.t = t
        else:
            self.orig = self.t = t

    def __getattr__(self, name: str) -> Any:
        # (called only for an unset attribute: the stand-in, on its first read)
        if name != "t":
            raise AttributeError(name)
        self.t = plain_contiguous(self.orig)
        return self.t

    def private(self) -> None:
        """Make the stand-in a copy where it is the tensor itself (see :func:`_outputs_meet`)."""
        if self.t is self.orig:
            self.t = self.orig.clone()

    def back(self) -> None:
        if self.t is not self.orig:
            self.orig.copy_(self.t)  # (copy_ applies a conjugate / negative bit)


def _outputs_meet(ts: Sequence[torch.Tensor]) -> bool:
    """Whether some two of the contiguous tensors ``ts`` (outputs' stand-ins) share a byte.

    Outputs that overlap one another (``all_gather([o] * world_size, t)``) were written in the
    order the blocks arrived: over TCP ranks ended with different values. Such outputs get
    private stand-ins (:meth:`_Staged.private`) copied back in rank order, so every rank ends
    with the last rank's block, as with gloo. (An output that is not plain has a private
    stand-in already: only plain ones, their own stand-ins, can meet.)"""
    spans = sorted([(p, p + n) for t in ts if (n := t.nbytes) and (p := t.data_ptr())])
    return any(b[0] < a[1] for a, b in pairwise(spans))


def _check_blocks(
    big: torch.Tensor, small: torch.Tensor, world: int, where: str, what: str
) -> None:
    """Refuse a ``big`` tensor (world_size blocks of ``small``) in neither of torch's two forms.

    torch documents ``all_gather_into_tensor``'s output and ``reduce_scatter_tensor``'s input as
    the world_size tensors concatenated along dim 0 or stacked in a new dim 0; a tensor of the
    right element count in another shape (``[3, 2]`` for blocks of ``[2, 3]``) was accepted and
    filled in memory order. Gloo refuses it too (and refuses the stacked form as well).
    """
    shape = tuple(small.shape)
    stacked = (world, *shape)
    concat = (world * shape[0], *shape[1:]) if shape else stacked
    if tuple(big.shape) not in (concat, stacked):
        raise CollectiveArgumentError(
            f"{where}: {what} must be the world_size ({world}) blocks of shape {shape} "
            f"concatenated {concat} or stacked {stacked}, got shape {tuple(big.shape)}"
        )


def _check_alltoall(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """Refuse alltoall lists whose tensors differ from input 0 in dtype or in shape past dim 0.

    Gloo wants every tensor of input 0's shape and dtype; the per-peer sizes (dim 0) may differ
    here, as NCCL allows (both ranks' byte counts are checked against each other as a
    mismatch). An output ``[2, 1]`` for ``[2]`` inputs, or ``[4]`` for ``[2, 2]``, was
    accepted and filled in memory order.
    """
    if not ins:
        return
    ref = ins[0]
    for what, ts in (("input", ins), ("output", outs)):
        for i, t in enumerate(ts):
            if t.dtype != ref.dtype or t.dim() != ref.dim() or t.shape[1:] != ref.shape[1:]:
                raise CollectiveArgumentError(
                    f"alltoall: every input and output must have input 0's dtype and shape "
                    f"past dim 0 ({ref.dtype}, shape {tuple(ref.shape)}), got {t.dtype}, "
                    f"shape {tuple(t.shape)} at {what} index {i}"
                )


def _check_self_block(where: str, rank: int, sent: int, expected: int) -> None:
    """Refuse, where the op is issued, a rank's block to itself whose two sizes differ.

    Both are this rank's own arguments; found inside the transfer (over TCP no peer checks
    that block, on shared memory the size matrix) the mismatch failed the whole group on
    every rank, where gloo raises on the caller and the group stays usable.
    """
    if sent != expected:
        raise CollectiveArgumentError(
            f"{where}: a rank's block to itself must have one size on both sides: rank {rank} "
            f"sends {sent} bytes to rank {rank}, which expects {expected} bytes"
        )


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr() if t.numel() else 0


def _spans_overlap(a: int, n: int, b: int, m: int) -> bool:
    """Whether bytes ``[a, a + n)`` and ``[b, b + m)`` share one (a 0 address: no tensor)."""
    return bool(a and b) and a < b + m and b < a + n


def _apart_from(
    srcs: list[torch.Tensor], outs: Sequence[torch.Tensor], own: int = -1
) -> list[torch.Tensor]:
    """``srcs`` with every tensor whose bytes overlap any of ``outs`` replaced by a copy, but
    ``srcs[own]`` where it is the one output itself (the same bytes: the in-place form, a rank's
    own block as its output, which the algorithms read before they write it).

    In place (an output is also an input), a block received over TCP overwrote an input not yet
    sent. Comparing every input with every output cost O(w^2) per call (3.6 ms at w=256); the
    outputs' byte ranges are sorted and merged once and each input bisects them: O(w log w),
    still exact.
    """
    if own >= 0 and len(outs) == 1:
        t, o = srcs[own], outs[0]
        if _ptr(t) == _ptr(o) and t.nbytes == o.nbytes:
            rest = _apart_from(srcs[:own] + srcs[own + 1 :], outs)
            return [*rest[:own], t, *rest[own:]]
    if len(srcs) == 1 and len(outs) == 1:  # one input, one output: no merging
        src, dst = srcs[0], outs[0]
        if _spans_overlap(_ptr(src), src.nbytes, _ptr(dst), dst.nbytes):
            return [src.clone()]
        return srcs
    spans = sorted((p, p + t.nbytes) for t in outs if (p := _ptr(t)))
    starts: list[int] = []
    ends: list[int] = []
    for a, b in spans:
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    if not starts:
        return srcs
    first, last = starts[0], ends[-1]
    out = srcs
    for i, t in enumerate(srcs):
        lo = _ptr(t)
        if not lo:
            continue
        hi = lo + t.nbytes
        if hi <= first or lo >= last:
            continue
        j = bisect_right(ends, lo)  # the first merged range ending after lo
        if j < len(starts) and starts[j] < hi:
            if out is srcs:
                out = list(srcs)
            out[i] = t.clone()
    return out
