"""Decode GEMV entry points: packed weights, the eager fast path and the custom ops.

``gemv(x, weight, bias)`` computes ``F.linear(x, weight, bias)`` for activations with few rows
(``[B, 1, K]`` / ``[1, K]`` decode shapes, at most :data:`MAX_ROWS` rows in all). ``weight`` is a
plain float32/bfloat16 ``[N, K]`` tensor or a :mod:`torchport.lowp` tensor (``Float8Tensor``,
``NVFP4Tensor``, ``MXTensor``) whose storage the kernel reads directly. Activations are widened to
float32, accumulation is float32 and the result is cast to the activation dtype.

NVFP4/MXFP4 weights with K a multiple of 32 use, by default (``config.gemv_fp4_int8``), the
int8-activation kernel: each 32-element group of ``x`` is quantized to int8 with scale
``amax/127`` (round half to even), so ``|out - ref| ≤ Σ_k |w_k| · s_g(k) / 2`` (plus float32
rounding); with the setting off, activations stay float32 and only summation order differs.

Launch parameters (prefetch distance, four-rows-at-once streaming, thread count) are chosen per
(format, N, K, rows) by :func:`torchport.autotune.select`, with ``F.linear`` as the ATen anchor
(see :func:`plan_for`); a dense weight goes to ``F.linear`` when it wins.

Reference: :func:`gemv_reference` (float64 product with the dequantized weight). Custom ops
``torchport::gemv_dense`` and ``torchport::gemv_packed`` (with fake implementations) serve
``torch.compile``/export; plain eager tensors call the kernel directly with pre-validated pointers.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from torchport import autotune, config, native
from torchport.gemm.adaptive import ThreadAdaptive
from torchport.gemv.bf16_kernel import DP_WEIGHTS, amx_dp_ready, gemv_bf16_dp_kernel
from torchport.gemv.fp4_kernel import (
    AMX_MAX_ROWS,
    amx_int8_ready,
    gemv_fp4_amx_kernel,
    gemv_fp4_block_kernel,
    gemv_fp4_pair_kernel,
    gemv_fp4_wblock_kernel,
)
from torchport.gemv.fp8_kernel import XBLOCK_BYTES as SHIFT_XBLOCK_BYTES
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.hugepages import hugepage_copy
from torchport.gemv.kernels import (
    FORMATS,
    I8_FORMATS,
    NONFINITE_STATUS,
    GemvKernel,
    gemv_i8_kernel,
    gemv_kernel,
)
from torchport.gemv.nancodes import mx_nan_scales, nan_block_scales, nan_rowscale
from torchport.native.launch import is_compiling_here, tensor_version

MAX_ROWS = 8
_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)


class GemvInputError(ValueError):
    """Inputs to the GEMV do not meet its requirements."""


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the GEMV's storage layout: ``data`` rows of the ``[N, K]`` matrix, scales."""

    fmt: str
    data: torch.Tensor
    scales: torch.Tensor  # uint8 block scales [N, K/block] (NVFP4/MX), else empty
    rowscale: torch.Tensor  # float32 [N] (FP8), else empty
    pts: float  # NVFP4 per-tensor scale (1.0 when absent)
    n: int
    k: int
    # whether the int8-activation kernels may serve (FP4 formats): False for block scales holding
    # a NaN code, which their register decodes read as finite (E4M3 0x7F as 480, E8M0 0xFF as
    # infinity) where the float kernel's tables read NaN, as torch. No default: a pack rebuilt
    # from its parts (the custom op, a captured graph) that left it out read such scales finite
    int8: bool
    # settled eager routes of :func:`gemv_packed` for this weight, by (x dtype, x shape,
    # allow_int8) and, under the key ``allow_int8`` alone, the one the last settled call took;
    # settled from its second eager call on (see :func:`settle_route`; not part of the weight's
    # identity)
    routes: dict[object, SettledRoute | None] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # the tensors a cached pack was made from: a quantized weight's inner tensors, each with its
    # attribute name and its version counter then (-1: an inference tensor, which keeps none);
    # see :meth:`written`
    source: tuple[tuple[str, torch.Tensor, int], ...] = field(default=(), compare=False, repr=False)
    # for each tiny inference tensor among them (an FP8 tensor-wise scale): a NumPy view of its
    # bytes and the bytes then (no version counter shows its in-place writes)
    values: tuple[tuple[Any, bytes], ...] = field(default=(), compare=False, repr=False)
    # FP8: the rows whose outputs :func:`_run` computes with torch ops after the kernel (int64;
    # None: none), those whose row scale the kernel's scaled sum cannot follow (:func:`overflow_rows`)
    overflow_rows: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_parts(self.fmt, self.data, self.scales, self.rowscale, self.n, self.k)

    def written(self, owner: object) -> bool:
        """Whether ``owner``, the weight this pack was made from, changed since: an inner tensor
        was replaced (``w.scale = w.scale * 2``: the attribute is not the :attr:`source` tensor)
        or written in place (its version counter moved; a tiny inference tensor's bytes
        differ). The pack may hold copies of the old values (a tensor-wise FP8 scale expanded
        to rows, NaN-scan results) or read the old tensors: stale. An inference tensor's
        writes are seen only while it is tiny (the pack reads a large one's memory in place;
        NaN codes written into such codes are not rescanned)."""
        # (a loop: any(<generator>) took twice as long, and this runs on every decode call)
        for name, t, version in self.source:
            if getattr(owner, name) is not t or (version >= 0 and t._version != version):
                return True
        for view, before in self.values:  # noqa: SIM110
            if view.tobytes() != before:
                return True
        return False


# What the kernels read of each format's parts: the data's dtype (None: any 1-byte codes), the
# weights per data element, the elements per block scale (0: no block scales, ``scales`` unread)
# and whether a float32 row scale is read (else ``rowscale`` is unread, as empty as it is in a
# pack). A part read past its end was a crash or other memory's bytes in the output.
_LAYOUTS: dict[str, tuple[torch.dtype | None, int, int, bool]] = {
    "f32": (torch.float32, 1, 0, False),
    "bf16": (torch.bfloat16, 1, 0, False),
    "fp8_e4m3": (None, 1, 0, True),
    "fp8_e5m2": (None, 1, 0, True),
    "nvfp4": (None, 2, 16, False),
    "mxfp4": (None, 2, 32, False),
    "mxfp8_e4m3": (None, 1, 32, False),
    "mxfp8_e5m2": (None, 1, 32, False),
}


# the largest finite code of each FP8 format
_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def overflow_rows(fmt: str, rowscale: torch.Tensor) -> torch.Tensor | None:
    """The rows of an FP8 pack whose row scale times the format's largest code overflows
    float32 (an infinite scale among them), as ``int64 [R]``; None where there are none, for
    other formats, and for row scales without real storage (fake or traced: the custom op
    finds them when it runs).

    The kernels multiply each row's float32 sum by its scale, torch's dequantized weight each
    code: there an infinite product makes inf · 0 (a zero code or activation) and inf − inf
    (products of both signs) NaN, where ``scale · sum`` is ±inf (or finite). :func:`_run` gives
    these rows' outputs ``F.linear`` of the dequantized rows (:func:`_overflow_linear`). A NaN
    scale needs nothing: NaN either way. The product is taken in float32 as
    ``fp8_dequantize`` takes it, so a row holding the largest code is flagged exactly when its
    dequantized value overflows (one without it maybe needlessly: torch's result either way)."""
    top = _FP8_MAX.get(fmt)
    if top is None or type(rowscale) is not torch.Tensor or is_compiling_here():
        return None
    # (NumPy: a few us for N = 11008 where the custom op runs this on every call, and no
    # bool(tensor), which a graph capture refuses)
    with np.errstate(over="ignore", invalid="ignore"):
        big = np.isinf(rowscale.detach().numpy() * np.float32(top))
    if not big.any():
        return None
    return torch.from_numpy(np.flatnonzero(big))


def _overflow_linear(
    out: torch.Tensor, x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None
) -> None:
    """Write into the float32 kernel output ``out [..., N]`` the columns
    :attr:`PackedWeight.overflow_rows` as torch computes them: ``F.linear`` of the float32
    activation ``x [..., K]`` and those rows dequantized (code · scale in float32)."""
    rows = pw.overflow_rows
    assert rows is not None
    dt = torch.float8_e4m3fn if pw.fmt == "fp8_e4m3" else torch.float8_e5m2
    w = pw.data.reshape(pw.n, pw.k)[rows].view(dt).float() * pw.rowscale[rows].unsqueeze(1)
    b = None if bias is None else bias[rows]
    y = torch.nn.functional.linear(x.reshape(-1, pw.k), w, b)
    out.view(-1, pw.n)[:, rows] = y


def check_parts(
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    rowscale: torch.Tensor,
    n: int,
    k: int,
) -> None:
    """Validate a packed weight's parts against ``(n, k)`` and ``fmt``'s layout: the dtype,
    element count, contiguity and device of every part the kernels read."""
    layout = _LAYOUTS.get(fmt) if isinstance(fmt, str) else None
    if layout is None:
        raise GemvInputError(
            f"gemv: a packed weight's format must be one of {FORMATS}, got {fmt!r}"
        )
    dtype, per, block, rows = layout
    if block and k % block:
        raise GemvInputError(f"gemv: {fmt} needs K a multiple of {block}, got K={k}")
    _check_part(fmt, "data", data, dtype, n * k // per, n, k)
    if block:
        _check_part(fmt, "scales", scales, None, n * (k // block), n, k)
    if rows:
        _check_part(fmt, "rowscale", rowscale, torch.float32, n, n, k)


def _check_part(
    fmt: str, name: str, t: torch.Tensor, want: torch.dtype | None, numel: int, n: int, k: int
) -> None:
    """One part of a packed weight: ``want`` its dtype (None: 1-byte codes), ``numel`` its
    element count. One test on the common path (a pack is rebuilt on every custom-op call)."""
    if (
        isinstance(t, torch.Tensor)
        and t.layout is torch.strided
        and not t.is_nested
        and (t.dtype is want if want is not None else t.element_size() == 1)
        and t.numel() == numel
        and t.is_contiguous()
        and t.is_cpu
    ):
        return
    _check_strided(f"a packed weight's {name}", t)
    if (t.dtype != want) if want is not None else (t.element_size() != 1):
        raise GemvInputError(f"gemv: {fmt} {name} must be {want or '1-byte codes'}, got {t.dtype}")
    if t.numel() != numel or not t.is_contiguous():
        raise GemvInputError(
            f"gemv: {fmt} {name} for N={n}, K={k} must be {numel} contiguous elements, got "
            f"shape {tuple(t.shape)} stride {t.stride()}"
        )
    raise GemvInputError(f"gemv: a packed weight's {name} must be on cpu, got {t.device}")


def _check_strided(what: str, t: torch.Tensor) -> None:
    """``t`` must be a strided tensor (sparse, mkldnn and nested ones raised torch's untyped
    errors from the GEMV's reads of their sizes and data pointers)."""
    if not isinstance(t, torch.Tensor):
        raise GemvInputError(f"gemv: {what} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise GemvInputError(f"gemv: {what} must be a strided tensor, got {got}")


def check_dense_weight(w: torch.Tensor) -> None:
    """Validate a float32/bfloat16 ``[N, K]`` weight for the dense kernels (any tensor type: the
    custom op's fake implementation checks fake weights)."""
    _check_strided("a dense weight", w)
    if w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
        raise GemvInputError(
            f"gemv: a dense weight must be a 2-D float32 or bfloat16 tensor, got {w.dtype} "
            f"shape {tuple(w.shape)}"
        )
    if not w.is_cpu:  # (the kernel read a meta weight's null pointer: a crash)
        raise GemvInputError(f"gemv: a dense weight must be on cpu, got {w.device}")


def _foreign(w: torch.Tensor) -> bool:
    """Whether ``w`` is a tensor subclass with its own semantics (a wrapper such as
    ``TwoTensor`` or a ``DTensor``, whose memory the kernel cannot read: it read one's null data
    pointer, a crash) rather than a plain tensor, parameter or a tracer's fake/functional one."""
    ty = type(w)  # (not isinstance(w, Parameter): it is True for a TwoTensor made a Parameter)
    return (
        ty is not torch.Tensor
        and ty is not torch.nn.Parameter
        and not isinstance(w, (FakeTensor, FunctionalTensor))
    )


def pack_dense(w: torch.Tensor) -> PackedWeight:
    """Pack a plain float32/bfloat16 ``[N, K]`` weight (no copy when already contiguous and
    without the lazy negation bit)."""
    check_dense_weight(w)
    if _foreign(w):
        raise GemvInputError(
            f"gemv: a dense weight must be a plain tensor for the kernel to read, got "
            f"{type(w).__name__} (gemv() runs F.linear's torch ops on it)"
        )
    fmt = "f32" if w.dtype == torch.float32 else "bf16"
    # resolve_neg: a lazily negated weight's memory holds the un-negated values the kernel read
    data = w.detach().resolve_neg().contiguous()
    n, k = w.shape
    return PackedWeight(fmt, data, _EMPTY_U8, _EMPTY_F32, 1.0, n, k, False)


def gemv_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` in float64 with a dequantized ``w``, cast to ``x.dtype``."""
    out = x.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def check_activation(x: torch.Tensor, k: int) -> int:
    """Validate a decode activation; return its number of rows (symbolic sizes, in a fake
    implementation, are not held to :data:`MAX_ROWS`: that would add a guard)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise GemvInputError(f"gemv: x must be a float32 or bfloat16 tensor, got {got}")
    _check_strided("x", x)
    if not x.is_cpu:
        raise GemvInputError(f"gemv: x must be on cpu, got {x.device}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise GemvInputError(
            f"gemv: x's last dimension must equal the weight's K={k}, got shape {tuple(x.shape)}"
        )
    rows = math.prod(x.shape[:-1])
    if type(rows) is int and rows > MAX_ROWS:
        raise GemvInputError(
            f"gemv: x may have at most {MAX_ROWS} rows (decode shapes), got {rows} "
            f"(shape {tuple(x.shape)})"
        )
    return rows


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise GemvInputError(f"gemv: bias must be a tensor or None, got {type(bias).__name__}")
    if bias is not None:
        _check_strided("bias", bias)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise GemvInputError(f"gemv: bias must have shape ({n},), got {tuple(bias.shape)}")
    if bias is not None and not bias.is_cpu:  # (a meta bias was dropped silently)
        raise GemvInputError(f"gemv: bias must be on cpu, got {bias.device}")


@dataclass(frozen=True)
class LaunchPlan:
    """How one GEMV problem runs: a native kernel and its thread count, or ATen (``kernel`` None).

    ``adaptive`` (tuned problems, two or more threads): a run-time choice between the tuned
    thread count and its alternative (all threads vs one), following recent call times
    (:class:`~torchport.gemm.adaptive.ThreadAdaptive`): on a shared machine a two-thread call
    waits at its closing barrier for a thread the scheduler descheduled, so the faster launch
    changes with the neighbours' load after tuning is over. Both launches give the same bits
    (each output row is computed by one thread in one order).
    """

    candidate: autotune.Candidate
    kernel: object | None
    threads: int  # 0: all of native.num_threads()
    adaptive: ThreadAdaptive | None = None
    arm_threads: tuple[int, ...] = ()  # with ``adaptive``: the thread count of each of its arms

    def launch(self, go: Callable[[int], None]) -> None:
        """Run ``go(nthreads)`` with the thread count this plan picks for this call."""
        if self.adaptive is not None:
            self.adaptive(go)
        else:
            go(self.threads or native.num_threads())


def _thread_arm(nt: int) -> Callable[[Callable[[int], None]], None]:
    def arm(go: Callable[[int], None]) -> None:
        go(nt)

    return arm


def _twin_name(c: autotune.Candidate) -> str:
    """Name of ``c``'s candidate with the other thread setting (names end in ``_t0``/``_t1``)."""
    base, _, t = c.name.rpartition("_t")
    return f"{base}_t{1 if t == '0' else 0}"


# Weight bytes from which every call of the thread-adaptive launch is timed (calls of ~0.2 ms and
# up, where the few microseconds of clock reads and bookkeeping are noise) and the other launch
# is re-timed every 16 calls while it could win (``probe_bound``: not while the current launch's
# median, less the margin, is below the other's best time): a load change is noticed within a
# handful of calls, and a quiet machine does not run a one-thread call in every 16. Smaller
# weights sample every 8th call and probe every 64th. The counts are of the calls the adaptive
# sees: a settled route passes it one call in ROUTE_SAMPLE_EVERY (with cold caches, a timed call
# costs ~70 us of Python more, not a few), so there every 4th call is timed and the other launch
# re-timed every 64th.
ADAPT_EVERY_CALL_BYTES = 4 << 20


def _with_adaptive(plan: LaunchPlan, timings: dict[str, float], nbytes: int) -> LaunchPlan:
    """``plan`` with a :class:`ThreadAdaptive` over its thread count and the alternative, seeded
    with the tuner's timings of the candidate and its thread twin when both were measured."""
    nt = native.num_threads()
    if plan.kernel is None or nt < 2:
        return plan
    tuned = plan.threads or nt
    other = 1 if tuned > 1 else nt
    big = nbytes >= ADAPT_EVERY_CALL_BYTES
    every, probe = (1, 16) if big else (8, 64)
    # A weight streamed from memory runs faster on all threads whenever the machine is quiet
    # (one core does not keep enough misses in flight for the read bandwidth): the all-threads
    # launch is home, probed every 4 calls while a burst of load keeps the runner on one thread.
    home = (0 if tuned > 1 else 1) if big else None
    adapt = ThreadAdaptive(
        _thread_arm(tuned),
        _thread_arm(other),
        sample_every=every,
        probe_every=probe,
        home=home,
        home_probe_every=4 if big else None,
        warm_switch=big,
        probe_bound=big,
    )
    t_tuned, t_twin = timings.get(plan.candidate.name), timings.get(_twin_name(plan.candidate))
    if t_tuned and t_twin:
        adapt.seed(0, t_tuned)
        adapt.seed(1, t_twin)
    return replace(plan, adaptive=adapt, arm_threads=(tuned, other))


_PLANS: dict[tuple[object, ...], LaunchPlan] = {}
# Smaller problems are not tuned: they take the default kernel on one thread (a few µs of work,
# less than waking a second thread costs, and immune to a busy second core).
TUNE_MIN_WEIGHTS = 1 << 18


# Weight-stream prefetches (hint, bytes ahead) of the lane-block FP4 kernel, the first the default:
# one core streams from DRAM only as fast as it keeps misses in flight; with T0, 512 bytes (8
# lines) ahead left the two-thread GEMV at 20-24 GB/s, 4096-8192 reached the read bandwidth
# ``Tensor.sum`` measures. Non-temporal prefetches 2048 bytes ahead streamed faster than T0 4096
# (11008x4096 B=1 from DRAM, huge-page weights, two threads, the kernel alone, interleaved
# medians of 25, Zen 3, load 1.5-1.8: NVFP4 1.020 -> 0.806 ms, MXFP4 0.955 -> 0.816 ms; NTA 1024
# 0.945 / 0.875, NTA 512 0.903 / 1.004).
# On the Intel Xeon VM (sessions 28-34) prefetching into L2 (T1) won instead: kernels alone,
# 11008x4096, 960 MB of huge-page copies, two threads, interleaved medians of 15 (bench_gemv_kern,
# thirty-fourth session), B=1 NVFP4 NTA 2048 1.747, T0 4096 1.202, T1 2048 0.987, T1 3072 0.936
# ms; MXFP4 1.505 / 1.282 / 0.958 / 0.927; B=4 NVFP4 1.940 / 1.443 / 1.235 / 1.389, MXFP4 2.012 /
# 1.598 / 1.144 / 1.320. Both kinds are offered (NTA 1024 left out for them).
BLOCK_PREFETCH = (("T1", 3072), ("T1", 2048), ("NTA", 2048), ("T0", 4096))
# The whole-block FP4 kernel (AVX-512 VNNI, K a multiple of 256): one ``cvt``/``mul``/``fma`` per
# 16-element block instead of two. Kernels alone, 11008x4096 NVFP4, B=4, two threads, 40 weight
# copies (1 GB: this VM's L3 held much of the 96 MB rotation used before), interleaved medians of
# 21 (Intel Xeon, AMX machine): the lane-block kernel T0 4096 1.503 ms, this one 1.358 (pairs) /
# 1.392 (no pairs); L2-resident (384 rows) one thread 0.088 -> 0.070 ms.
# T1 3072 ahead streamed it faster at B=1 (same runs as BLOCK_PREFETCH's: NVFP4 1.203 -> 0.911 ms,
# MXFP4 1.034 -> 0.871; B=4 1.302 -> 1.238, 1.250 -> 1.240).
WBLOCK_PREFETCH = (("T1", 3072), ("T0", 4096))
# Its weight loads, bits: one 512-bit load per line streamed faster here (11008x4096 B=4 NVFP4, two
# threads, 960 MB of copies, interleaved medians of 15: 1.416 -> 1.336 ms, MXFP4 1.408 -> 1.336; B=1
# 1.066 / 1.044), where on Zen 4 the lane-block kernel's streamed about 20 % slower (hence two
# 256-bit loads there): both are offered.
WBLOCK_LOADS = (512, 256)
# Activation rows (first, last) for which the AMX FP4 kernel is offered, per format. Its cost
# hardly depends on the rows (one tile of dots serves them all), the vector kernels' grows with
# them. Two threads, weights from DRAM, MXFP4 (bench_gemv_kern, medians of 9, thirty-fifth
# session; AMX T1 against the faster of the lane-block and whole-block kernels): 4096x4096 B=5
# 0.584 against 0.653 ms, B=8 0.608 against 0.813; 11008x4096 B=5 1.540 / 1.660, B=8 1.538 /
# 2.153; 4096x11008 B=5 1.516 / 1.558, B=8 1.609 / 2.179. Below five rows it lost (4096x4096
# B=2 0.544 against the lane-block kernel's 0.409, B=4 0.564 against the whole-block kernel's
# 0.521; NVFP4 B=4 0.610 against 0.512), and its tile takes four NVFP4 rows at most.
AMX_ROWS = {"mxfp4": (5, 8)}
# The same for the AMX-BF16 build of the pair-dot kernel (bf16 and E4M3 weights, bf16-valued
# activations; kernel "dpamx", hint T1 only: T0 was 1.09-1.69x slower in 7 of the 8 cells where
# both were timed, 0.87x in one, E4M3 11008x4096 B=8: 2.845 against 3.254). Two threads, weights from
# DRAM (bench_gemv_kern, medians of 7, thirty-fifth session), against the vdpbf16ps kernel T1
# 2048: E4M3 11008x4096 B=2 2.346 / 2.118 ms, B=3 2.435 / 2.495, B=4 2.601 / 3.327, B=8 3.254 /
# 6.635; 4096x4096 B=3 0.937 / 0.936, B=4 0.928 / 1.114, B=8 1.046 / 2.181; 4096x11008 B=4
# 2.589 / 2.959 (NTA 2048: 2.667); bf16 11008x4096 B=4 4.209 / 4.040, B=5 4.189 / 5.009, B=6
# 4.098 / 5.393, B=8 4.124 / 6.538; 4096x4096 B=5 1.591 / 1.696.
DPAMX_ROWS = {"fp8_e4m3": (4, 8), "bf16": (5, 8)}
# The same build for E4M3 weights meeting float32 activations: it splits each activation into
# three bf16 parts (exact; one C tile column per part and row, a second C tile from six rows).
# Two threads, weights from DRAM (bench_gemv_kern, medians of 9, thirty-sixth session, a review
# helper running beside), against the shift kernel's AVX-512 build NTA 2048 and the float kernel
# T0/0, ms: B=2 4096x4096 1.021 / 0.947 / 1.083, 11008x4096 2.655 / 2.444 / 2.801; B=3 4096x4096
# 1.044 / 1.020 / 1.188, 11008x4096 2.671 / 3.005 / 3.040, 4096x11008 2.734 / 2.460 / 3.020;
# B=4 4096x4096 1.013 / 1.111 / 1.242, 11008x4096 2.636 / 2.742 / 3.315, 4096x11008 2.777 /
# 2.953 / 3.292; B=6 4096x4096 1.267 / 2.221 / 2.028; B=8 11008x4096 2.978 / 5.508 / 6.127.
# From three rows (where it won one shape of three) to the GEMV's eight.
DPAMX_F32_ROWS = {"fp8_e4m3": (3, 8)}
# The same for the E4M3 shift-decode kernel: NTA 2048 against T0 8192 1.901 -> 1.651 ms (same
# run; NTA 1024 1.714, 768 1.641). T0 8192 stays a candidate: the AVX-512 kernel streamed from
# DRAM faster with 8192 than 4096 bytes ahead (11008x4096, interleaved medians of 21 in one
# process, load ~3: one thread 1.41 / 1.26 ms CPU time, two threads 1.09 / 1.08 ms wall; 16384
# 1.24 / 1.11; NTA not measured there).
SHIFT_PREFETCH = (("NTA", 2048), ("NTA", 1024), ("T0", 8192))
# The row-unrolled shift kernel (``kernel="shift4"``: four weight rows per activation load, one
# activation row only), tried after the one-row kernel. L2-resident 96x4096, one thread, thread
# CPU time per call (medians of 21, load 5-8): 35 -> 29 us; from DRAM (11008x4096, one thread,
# CPU time) T0 8192 ahead 3.5-4.0 ms against the one-row kernel's NTA 2048 3.6-3.9 ms in the same
# runs, NTA 2048 ahead 4.4-4.6 ms (slower: not offered). Two threads, kernels alone interleaved
# (bench_gemv_kern, medians of 21, native read peak 21.9 GB/s): one-row NTA 2048 2.623 / 2.710 ms,
# one-row T0 8192 2.710, four rows T0 8192 2.433 / 2.568 ms (two runs, load 1.6 / 3.7); the tuner's
# cold timings put it beside the one-row kernel (2.91 vs 2.89 ms) or behind it (3.48 vs 2.48).
SHIFT4_PREFETCH = (("T0", 8192),)
# The shift kernel's AVX-512 build for two to four activation rows (``kernel="shift512"``; the
# shift candidates run the AVX2 build there): its K blocks pair weight rows, every activation
# load serving two. Kernels alone from DRAM, two threads, interleaved medians of 18 (load 1.2,
# ``sum`` 49-52 GB/s), AVX2 build / AVX-512 build: B=4 4096x11008 2.92 / 2.40 ms, B=2 11008x4096
# 2.11 / 1.46; but B=4 11008x4096 3.23 / 3.35 and 4096x4096 1.02 / 1.22: a candidate beside the
# AVX2 build, not a replacement.
SHIFT512_PREFETCH = (("NTA", 2048),)
# The ``vdpbf16ps`` bf16 kernel (:mod:`torchport.gemv.bf16_kernel`, AVX512-BF16 only). Kernels
# alone, 11008x4096 bf16 from DRAM on huge pages, bf16 activations, interleaved medians of 21-27
# in one process, Zen 4, load 2-4, six runs: two threads NTA 2048 2.15-2.92 ms, T0 4096
# 2.21-2.83, the float kernel's one-stream loop 2.69-3.60, its four-row loop 2.90-3.23; one
# thread 3.05-4.49 / 3.29-4.42 / 3.28-6.54 / 4.68-6.23 ms. No software prefetch (the hardware
# prefetchers keep up with a kernel this light) in the last two runs: one thread 2.94 / 3.52 ms
# against NTA 2048's 3.37 / 3.86, two threads 2.59 / 1.99 against 2.58 / 2.15.
# On the Intel Xeon VM (thirty-fourth session; 11008x4096, 960 MB of huge-page copies, two threads,
# medians of 15) T1 2048 ahead led at B=1: T0/0 3.404, NTA 2048 8.492 (sic), T1 2048 3.043, T1 3072
# 3.371 ms; B=4 3.675 / 3.814 / 3.796 / 3.739. NTA 2048 (Zen 4's first above) is left out: the
# candidate list stays at nine (eleven with the AMX build's two, DPAMX_ROWS).
DP_PREFETCH = (("T1", 2048), ("T0", 0))
# The same kernel on E4M3 weights (half the bytes per weight, five decode instructions per line).
# Kernels alone, 11008x4096 from DRAM, bf16-valued activations, interleaved medians of 15 (load
# 3-4): B=1 two threads T0/0 1.25, NTA 2048 1.14 ms (the shift kernel 1.31), one thread 1.46 /
# 2.04 (shift 2.60); B=4 two threads 2.15 / 2.07 (shift, AVX2 build: 3.18).
# Intel Xeon VM, same runs as DP_PREFETCH's: B=1 NTA 2048 2.587, T0/0 2.774, T1 2048 1.947, T1 3072
# 2.107 ms; B=4 2.801 / 2.760 / 2.683 / 2.693. T0/0 (behind NTA 2048 on Zen 4 too) is left out.
FP8_DP_PREFETCH = (("T1", 2048), ("NTA", 2048))


def _pf_name(hint: str, pf: int) -> str:
    """``p<bytes ahead>`` and the hint: nothing for T0, ``nta``, ``l2`` (T1)."""
    return f"p{pf}" + {"T0": "", "T1": "l2"}.get(hint, hint.lower())


def _hinted(kernel: str, table: tuple[tuple[str, int], ...]) -> list[autotune.Candidate]:
    """One candidate of ``kernel`` per thread mode (0 = all threads, 1 = one) and (hint, prefetch
    distance) of ``table``, in that order."""
    return [
        autotune.Candidate(
            f"{kernel}_{_pf_name(hint, pf)}_t{threads}",
            params=(("kernel", kernel), ("prefetch", pf), ("hint", hint), ("threads", threads)),
        )
        for threads in (0, 1)
        for hint, pf in table
    ]


def _rows_in(table: dict[str, tuple[int, int]], fmt: str, rows: int | None) -> bool:
    """Whether ``rows`` is in the (first, last) window ``table`` gives ``fmt`` (none: never)."""
    lo, hi = table.get(fmt, (1, 0))
    return rows is not None and lo <= rows <= hi


def _dpamx(fmt: str, rows: int | None, bx: bool = True) -> list[autotune.Candidate]:
    """The AMX-BF16 pair-dot candidates (hint T1, each thread mode) where ``rows`` is in
    :data:`DPAMX_ROWS` of ``fmt`` (``bx``: bf16-valued activations; else
    :data:`DPAMX_F32_ROWS`) and the CPU has AMX-BF16."""
    if not _rows_in(DPAMX_ROWS if bx else DPAMX_F32_ROWS, fmt, rows) or not amx_dp_ready():
        return []
    return _hinted("dpamx", (("T1", 0),))


def candidates(
    fmt: str, int8: bool = False, k: int | None = None, bx: bool = False, rows: int | None = None
) -> list[autotune.Candidate]:
    """The search space for one format: the ATen anchor, then the default kernel, then variants.

    Parameters: ``prefetch`` distance in bytes ahead of the weight stream (0 or 512; ``hint``
    its locality, lane-block, shift and ``vdpbf16ps`` kernels only), ``rows4``
    (one activation row: stream four weight rows at once), ``threads`` (0 = all, or 1). With
    int8 activations (FP4 weights) the lane-block kernel (:mod:`torchport.gemv.fp4_kernel`,
    ``kernel="block"``, K a multiple of 128, prefetch :data:`BLOCK_PREFETCH`) comes first, then
    on AVX-512 VNNI its whole-block variant (``kernel="wblock"``, K a multiple of 256,
    :data:`WBLOCK_PREFETCH`, :data:`WBLOCK_LOADS`), then the pair-split kernel
    (``kernel="pair"``, K a multiple of 64) unless ``k`` is a multiple of 128, the group-32
    kernel after them; where the CPU has AMX-INT8 and ``rows`` is in :data:`AMX_ROWS` of the
    format, the AMX kernel (``kernel="amx"``, K a multiple of 128, prefetch hint T1 or T0) after
    the whole-block one; E4M3 weights try the integer-shift decode
    (:mod:`torchport.gemv.fp8_kernel`, ``kernel="shift"``, prefetch :data:`SHIFT_PREFETCH`) first,
    then its four-row unroll (``kernel="shift4"``, :data:`SHIFT4_PREFETCH`; one activation row)
    and its AVX-512 build for two to four rows (``kernel="shift512"``, :data:`SHIFT512_PREFETCH`).
    bf16 weights on a CPU with AVX512-BF16 try the ``vdpbf16ps`` kernel
    (:mod:`torchport.gemv.bf16_kernel`, ``kernel="dp"``, :data:`DP_PREFETCH`) first, and the float
    kernel then only with prefetch 512; the tuner times them on bf16-valued activations. E4M3
    weights meeting bf16 activations (``bx``: the caller's activations are a bfloat16 tensor)
    try the same kernel, its weights decoded to bf16 (``weights="fp8_e4m3"``), before the shift
    kernels (it refuses float32 activations: status 4). Where ``rows`` is in :data:`DPAMX_ROWS`
    and the CPU has AMX-BF16, both pair-dot kernels are followed by their AMX-BF16 build
    (``kernel="dpamx"``); E4M3 weights meeting float32 activations try that build after the
    shift kernels where ``rows`` is in :data:`DPAMX_F32_ROWS` (it splits each activation into
    three bf16 parts).

    Where the lane-block kernel serves (``k % 128 == 0``) the pair-split kernel is left out: it
    streamed slower in each of four interleaved A/B runs (11008×4096 B=1, two threads, the
    kernels alone on huge-page weights, Zen 3, load 1-2: NVFP4 81-98 % of ``sum`` vs 93-106 %,
    MXFP4 63-90 % vs 78-103 %; one thread 8.5 vs 10.6 GB/s), yet the sequential, noisy tuning
    picked it for NVFP4 (1.68 vs 2.10 ms) and the eager GEMV then ran it.
    """
    out = [autotune.Candidate("aten_linear", autotune.ATEN)]
    params: tuple[tuple[str, object], ...]
    if int8:
        out += _hinted("block", BLOCK_PREFETCH)
        info = native.cpu_info()
        if info.isa == "avx512" and info.has("avx512_vnni") and (k is None or k % 256 == 0):
            out += [
                autotune.Candidate(
                    f"wblock{load}_{_pf_name(hint, pf)}_t{threads}",
                    params=(
                        ("kernel", "wblock"),
                        ("prefetch", pf),
                        ("hint", hint),
                        ("threads", threads),
                        ("load", load),
                    ),
                )
                for threads in (0, 1)
                for load in WBLOCK_LOADS
                for hint, pf in WBLOCK_PREFETCH
            ]
        if _rows_in(AMX_ROWS, fmt, rows) and (k is None or k % 128 == 0) and amx_int8_ready():
            out += _hinted("amx", (("T1", 0), ("T0", 0)))  # (no prefetch distance: unused)
        for threads in () if k is not None and k % 128 == 0 else (0, 1):
            for pf in (512, 0):
                params = (("kernel", "pair"), ("prefetch", pf), ("threads", threads))
                out.append(autotune.Candidate(f"pair_p{pf}_t{threads}", params=params))
    if fmt == "fp8_e4m3" and bx and native.cpu_info().has_avx512_bf16:
        # bf16 activations: the pair dot first, then the shift kernel's and the float kernel's
        # defaults (nine candidates in all, eleven where the AMX build is offered; the pair dot
        # streamed 1.15-1.8x faster than the shift kernel at B=1 and B=4, see FP8_DP_PREFETCH)
        out += (
            _hinted("dp", FP8_DP_PREFETCH)
            + _dpamx(fmt, rows)
            + _hinted("shift", SHIFT_PREFETCH[:1])
        )
        for threads in (0, 1):
            params = (("prefetch", 512), ("rows4", 0), ("threads", threads))
            out.append(autotune.Candidate(f"native_p512_r0_t{threads}", params=params))
        return out
    if fmt == "fp8_e4m3":  # the integer-shift decode (torchport.gemv.fp8_kernel) first
        out += _hinted("shift", SHIFT_PREFETCH) + _hinted("shift4", SHIFT4_PREFETCH)
        out += _hinted("shift512", SHIFT512_PREFETCH) + _dpamx(fmt, rows, bx=False)
    dp = fmt == "bf16" and native.cpu_info().has_avx512_bf16
    if dp:  # the vdpbf16ps kernel first; the float kernel then only 512 bytes ahead
        out += _hinted("dp", DP_PREFETCH) + _dpamx(fmt, rows)
    r4 = int(fmt in ("f32", "bf16"))
    for threads in (0, 1):
        for rows4 in (r4, 1 - r4):
            for pf in (512,) if dp else (512, 0):
                params = (("prefetch", pf), ("rows4", rows4), ("threads", threads))
                out.append(autotune.Candidate(f"native_p{pf}_r{rows4}_t{threads}", params=params))
    return out


def _space_id(cands: list[autotune.Candidate]) -> str:
    """Short content id of a candidate list (part of the tuning-cache key)."""
    return hashlib.sha256(",".join(c.name for c in cands).encode()).hexdigest()[:12]


def _native_kernel(
    fmt: str, int8: bool, k: int, isa: str, cand: autotune.Candidate, rows: int = 1
) -> object:
    pf, r4, hint = cand.param("prefetch", 512), cand.param("rows4", 0), cand.param("hint", "T0")
    if cand.param("kernel") == "block":
        if k % 128 or isa == "scalar":
            raise autotune.InvalidCandidate(
                f"lane-block kernel needs AVX2 and K % 128 == 0 (K={k})"
            )
        return gemv_fp4_block_kernel(fmt, isa, pf, hint=hint)
    if cand.param("kernel") == "wblock":
        if k % 256 or isa != "avx512" or not native.cpu_info().has("avx512_vnni"):
            raise autotune.InvalidCandidate(
                f"whole-block kernel needs AVX-512 VNNI and K % 256 == 0 (K={k}, isa {isa})"
            )
        return gemv_fp4_wblock_kernel(fmt, isa, pf, hint=hint, load=cand.param("load", 512))
    if cand.param("kernel") == "amx":
        most = AMX_MAX_ROWS.get(fmt, 0)
        if k % 128 or not 1 <= rows <= most:
            raise autotune.InvalidCandidate(
                f"AMX FP4 kernel needs K % 128 == 0 and 1 to {most} activation rows "
                f"({fmt}, K={k}, {rows} rows)"
            )
        if not amx_int8_ready():
            raise autotune.InvalidCandidate("AMX FP4 kernel cannot run here (amx_int8_ready)")
        return gemv_fp4_amx_kernel(fmt, hint=hint)
    if cand.param("kernel") == "pair":
        if k % 64 or isa == "scalar":
            raise autotune.InvalidCandidate(f"pair-split kernel needs AVX2 and K % 64 == 0 (K={k})")
        return gemv_fp4_pair_kernel(fmt, isa, pf)
    if cand.param("kernel") == "dpamx":
        if not 1 <= rows <= 16:
            raise autotune.InvalidCandidate(
                f"AMX-BF16 pair-dot kernel takes 1 to 16 activation rows, got {rows}"
            )
        if fmt not in DP_WEIGHTS or not amx_dp_ready() or isa != "avx512":
            raise autotune.InvalidCandidate(
                f"AMX-BF16 pair-dot kernel needs bf16 or E4M3 weights and AMX-BF16 ({fmt}, "
                f"isa {isa})"
            )
        return gemv_bf16_dp_kernel(isa, pf, hint=hint, weights=fmt, amx=True)
    if cand.param("kernel") == "dp":
        if fmt not in DP_WEIGHTS or isa != "avx512" or not native.cpu_info().has_avx512_bf16:
            raise autotune.InvalidCandidate(
                f"vdpbf16ps kernel needs bf16 or E4M3 weights and AVX512-BF16 ({fmt}, isa {isa})"
            )
        if fmt == "bf16":  # the default weights (one cached kernel object per launch setting)
            return gemv_bf16_dp_kernel(isa, pf, hint=hint)
        return gemv_bf16_dp_kernel(isa, pf, hint=hint, weights=fmt)
    if cand.param("kernel") == "shift4":
        if fmt != "fp8_e4m3" or isa == "scalar" or rows != 1:
            raise autotune.InvalidCandidate(
                f"row-unrolled shift kernel needs AVX2, E4M3 and one activation row ({fmt}, {rows})"
            )
        return gemv_fp8_shift_kernel(isa, pf, hint=hint, rows=4)
    if cand.param("kernel") == "shift512":
        if fmt != "fp8_e4m3" or isa != "avx512" or not 2 <= rows <= 4:
            raise autotune.InvalidCandidate(
                "paired AVX-512 shift kernel needs AVX-512, E4M3 and two to four activation rows "
                f"({fmt}, isa {isa}, {rows} rows)"
            )
        if 4 * rows * k <= SHIFT_XBLOCK_BYTES:  # K in one piece: the unpaired loop, slower there
            raise autotune.InvalidCandidate(
                f"paired AVX-512 shift kernel pairs rows only in K blocks: {rows} rows of K={k} "
                f"are {4 * rows * k} bytes, within one {SHIFT_XBLOCK_BYTES}-byte block"
            )
        return gemv_fp8_shift_kernel(isa, pf, hint=hint)
    if cand.param("kernel") == "shift":
        if fmt != "fp8_e4m3" or isa == "scalar":
            raise autotune.InvalidCandidate(f"shift-decode kernel needs AVX2 and E4M3 ({fmt})")
        # The AVX-512 build serves one activation row; with more rows (B * K floats beyond L1)
        # it streamed slower than the AVX2 build: 11008x4096 B=4 from DRAM, one thread, CPU
        # time 7.2 vs 4.2 ms, two threads 3.8 vs 2.3 ms (one process, interleaved medians of 15;
        # before its K blocks paired weight rows: the shift512 candidate offers it there now)
        return gemv_fp8_shift_kernel("avx2" if isa == "avx512" and rows > 1 else isa, pf, hint=hint)
    return gemv_i8_kernel(fmt, isa, pf, r4) if int8 else gemv_kernel(fmt, isa, pf, r4)


def _launch(
    kern: object,
    x: torch.Tensor,
    pw: PackedWeight,
    b: torch.Tensor | None,
    out: torch.Tensor,
    threads: int,
) -> None:
    rows = x.numel() // pw.k
    raw = (
        x.data_ptr(),
        rows,
        pw.k,
        pw.data.data_ptr(),
        pw.scales.data_ptr(),
        pw.rowscale.data_ptr(),
        pw.pts,
        b.data_ptr() if b is not None else 0,
        int(b is not None),
        out.data_ptr(),
        pw.n,
        threads or native.num_threads(),
    )
    status = kern.call_unchecked(*raw)  # type: ignore[attr-defined]
    if status:
        _after_status(kern, status, False, raw, pw.fmt)


def _after_status(kern: object, status: int, io: bool, raw: tuple[Any, ...], fmt: str) -> None:
    """A kernel call's non-zero ``status`` (``raw``: its arguments): a call an int8-activation
    kernel handed back (non-finite activations, which int8 would turn finite) runs on its
    format's float kernel (``io``: its bf16 entry); any other failure, or the float kernel's,
    raises :func:`_status_error`."""
    if status == NONFINITE_STATUS and isinstance(kern, GemvKernel):
        twin = kern.float_twin()
        if twin is not None:
            status = int((twin.bf16io if io else twin).raw_call(*raw))
    if status:
        raise _status_error(fmt, status, raw[1], raw[2])


def _status_error(fmt: str, status: int, rows: int, k: int) -> native.NativeError:
    """The error for a GEMV kernel's non-zero status (2: K off the kernel's block multiple, 3: its
    activation buffers could not be allocated; the AMX kernel's 6: no tile state, 7: more
    activation rows than its tile takes)."""
    if status == 2:
        why = f"K={k} is not a multiple of the kernel's block (64, 128 or 256)"
    elif status == 3:
        why = f"could not allocate the prepared activations for {rows} rows of K={k}"
    elif status == 4:
        why = (
            "the pair-dot kernel got activations that are not bf16 values (its AMX-BF16 build "
            "splits float32 ones of E4M3 weights for 1 to 10 rows)"
        )
    elif status == NONFINITE_STATUS:
        why = "non-finite activations and no float kernel to take them"
    elif status == 6:
        why = "the OS did not grant the AMX tile state"
    elif status == 7:
        most = AMX_MAX_ROWS.get(fmt, 16)  # (the AMX-BF16 pair dot's tile: 16 columns)
        why = f"the AMX kernel takes 1 to {most} activation rows of {fmt} weights, got {rows}"
    else:
        why = f"status {status}"
    return native.NativeError(f"gemv kernel {fmt} failed: {why}")


def _anchor_weight(pw: PackedWeight) -> torch.Tensor:
    """The weight ``F.linear`` multiplies in the anchor: the dense weight itself, or the quantized
    weight dequantized to bfloat16 (what a bf16 model would run)."""
    if pw.fmt in ("f32", "bf16"):
        return pw.data
    return dequantize_packed(pw).bfloat16()


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Sanity check against the anchor (catches garbage, not rounding): 5 % relative L2."""
    out, ref = out.float(), ref.float()
    return bool((out - ref).norm() <= 0.05 * ref.norm() + 1e-6)


# Weight copies the tuner rotates at most (see _memory_sets)
TUNE_MAX_COPIES = 64


def _memory_sets(
    args: tuple[torch.Tensor, ...], dense: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """The tuner's rotated argument sets for a GEMV (``args``: x, data, scales, rowscale): the
    made arguments, then copies of the weight placed as the weights it is tuned for live (a
    quantized pack's data and scales on 2 MiB pages where ``lowp.tensors.pack_on_huge_pages``
    moves them; ``dense`` weights stay where their owner put them: plain clones) until
    :func:`torchport.autotune.cold_bytes` (twice the largest cache the OS reports, at least 96
    MB) or ``cold_cache_bytes``, whichever is larger, is passed (at most :data:`TUNE_MAX_COPIES` sets; one where the weight alone passes it), so each
    timed call streams its weight from memory as decode does. The ``cold_cache_bytes`` rotation
    alone (64 MiB of plain clones) was largely held by the cache of the Intel Xeon VM of sessions
    28-34, where the prefetch settings that decide a streamed call's speed (T1 against T0 ahead:
    0.91 against 1.20 ms) barely moved the timings."""
    from torchport.lowp import tensors  # (lowp imports this module; read at call time)

    budget = config.get("cold_cache_bytes")
    if budget == 0:  # cold timing switched off: the arguments as made
        return [args]
    x, data, scales, rowscale = args
    per = max(1, data.nbytes + scales.nbytes)
    n = min(TUNE_MAX_COPIES, max(1, math.ceil(max(budget, autotune.cold_bytes()) / per)))
    huge, huge_scales = (
        (False, False) if dense else tensors.pack_on_huge_pages(data.nbytes, scales.nbytes)
    )

    def place(t: torch.Tensor, on_huge: bool) -> torch.Tensor:
        return hugepage_copy(t) if on_huge else t.clone()

    sets = [args]
    for _ in range(n - 1):
        sets.append((x.clone(), place(data, huge), place(scales, huge_scales), rowscale))
    return sets


def plan_for(pw: PackedWeight, rows: int, int8: bool, bx: bool = False) -> LaunchPlan:
    """The launch plan for ``pw`` with ``rows`` activation rows (memoised; autotuned on first use);
    ``bx``: the activations are bf16 values (a bfloat16 tensor widened), see :func:`candidates`.

    ``torchport.autotune.select`` times the native variants against ``F.linear`` (the anchor) on
    this weight; only a dense weight may be served by ``F.linear`` (a quantized weight would need
    a dequantized copy). Problems under :data:`TUNE_MIN_WEIGHTS` weights take the default kernel
    on one thread.
    """
    isa = native.cpu_info().isa
    # only E4M3 plans on AVX512-BF16 depend on it (one tuning for both dtypes elsewhere)
    bx = bx and pw.fmt == "fp8_e4m3" and native.cpu_info().has_avx512_bf16
    key = (pw.fmt, int8, isa, pw.n, pw.k, rows, native.num_threads(), bx)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    cands = candidates(pw.fmt, int8, pw.k, bx, rows)
    if pw.n * pw.k < TUNE_MIN_WEIGHTS:  # the first candidate that can serve, on one thread
        for c in cands[1:]:
            try:
                plan = LaunchPlan(c, _native_kernel(pw.fmt, int8, pw.k, isa, c, rows), 1)
                break
            except autotune.InvalidCandidate:
                continue
        assert plan is not None  # the group-32 / float kernels serve every K
        _PLANS[key] = plan
        return plan
    dense = pw.fmt in ("f32", "bf16")
    wa = _anchor_weight(pw)

    # Timed on weights streamed from memory, as decode reads them: the tuner rotates copies of
    # (x, data, scales) past the cache, placed as the weight lives (_memory_sets); a dense
    # weight's anchor rotates the same copies, a quantized weight's reads its one dequantized
    # copy (it is timed, never chosen).
    def factory(c: autotune.Candidate):
        if c.is_anchor:
            if dense:
                return lambda x, d, sc, rs: torch.nn.functional.linear(x.to(d.dtype), d)
            return lambda x, d, sc, rs: torch.nn.functional.linear(x.to(wa.dtype), wa)
        kern = _native_kernel(pw.fmt, int8, pw.k, isa, c, rows)
        threads = c.param("threads", 0)

        def run(x: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, rs: torch.Tensor):
            out = torch.empty(rows, pw.n)
            _launch(
                kern,
                x,
                PackedWeight(pw.fmt, d, sc, rs, pw.pts, pw.n, pw.k, pw.int8),
                None,
                out,
                threads,
            )
            return out

        return run

    tune_key = {
        "fmt": pw.fmt,
        "int8": int8,
        "n": pw.n,
        "k": pw.k,
        "rows": rows,
        "isa": isa,
        "threads": native.num_threads(),
        # entries tuned on hot (L3-resident) or cache-sized rotations are not reused
        "timing": "memory",
        "space": _space_id(cands),  # entries from another candidate list are not reused
    }
    if bx:
        tune_key["activations"] = "bf16"

    def make_args() -> tuple[torch.Tensor, ...]:
        x = torch.randn(rows, pw.k, generator=autotune.sample_generator())
        if pw.fmt == "bf16" or bx:  # bf16 activations (a bf16 model's decode)
            x = x.bfloat16().float()
        return (x, pw.data, pw.scales, pw.rowscale)

    choice = autotune.select(
        "gemv",
        tune_key,
        cands,
        factory,
        make_args,
        cold=functools.partial(_memory_sets, dense=dense),
        check=_close,
        backends=None if dense else {autotune.NATIVE},
        final_round=FINAL_ROUND,
    )
    c = choice.candidate
    if c.is_anchor:
        plan = LaunchPlan(c, None, 0)
    else:
        kern = _native_kernel(pw.fmt, int8, pw.k, isa, c, rows)
        nbytes = pw.data.nbytes + pw.scales.nbytes
        plan = _with_adaptive(LaunchPlan(c, kern, c.param("threads", 0)), choice.timings_s, nbytes)
    _PLANS[key] = plan
    return plan


# A fresh native winner meets the FINAL_ROUND - 1 next fastest native candidates in the
# autotuner's final interleaved round (see torchport.autotune.tuner.FINAL_ROUND_SPREAD): a fresh
# cache picked T0 4096 over NTA 2048 prefetch for NVFP4 11008x4096 on one sequential sample each,
# where NTA 2048 streamed faster in interleaved runs.
FINAL_ROUND = 3


_FP4_INT8 = config.Snapshot("gemv_fp4_int8")


def _use_int8(pw: PackedWeight, allow_int8: bool) -> bool:
    return (
        allow_int8 and pw.int8 and pw.fmt in I8_FORMATS and pw.k % 32 == 0 and bool(_FP4_INT8()[0])
    )


def native_launch(
    pw: PackedWeight, rows: int, allow_int8: bool = True
) -> tuple[object, int] | None:
    """The native kernel and thread count :func:`gemv_packed` would run for ``rows`` activation
    rows (the same plan, so a caller reproduces its results bit for bit), or ``None`` where it
    would not call a native kernel (native kernels off, an ATen plan, an empty problem).

    Used by graph capture (:mod:`torchport.graphs.native_gemv`) to call the kernel from C.
    """
    if not native.enabled() or not 0 < rows <= MAX_ROWS or pw.k == 0 or pw.n == 0:
        return None
    if overflow_rows(pw.fmt, pw.rowscale) is not None:  # (rows the kernel alone gets wrong)
        return None
    plan = _native_plan(pw, rows, allow_int8)
    if plan is None:
        return None
    return plan.kernel, plan.threads or native.num_threads()


def _native_plan(
    pw: PackedWeight, rows: int, allow_int8: bool, bx: bool = False
) -> LaunchPlan | None:
    """The launch plan for ``rows`` if it calls a native kernel, else ``None`` (ATen plan, or
    the kernel could not be built)."""
    try:
        plan = plan_for(pw, rows, _use_int8(pw, allow_int8), bx)
    except native.NativeError:
        return None
    return None if plan.kernel is None else plan


def _run(
    x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, allow_int8: bool = True
) -> torch.Tensor:
    """The kernel call (inputs validated). ``allow_int8=False`` keeps float32 activations."""
    rows = x.numel() // pw.k if pw.k else math.prod(x.shape[:-1])
    out_shape = (*x.shape[:-1], pw.n)
    if rows == 0 or pw.n == 0:
        return torch.zeros(out_shape, dtype=x.dtype)
    if pw.k == 0:
        out0 = torch.zeros(out_shape, dtype=torch.float32)
        return (out0 + bias.float() if bias is not None else out0).to(x.dtype)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    b = None
    if bias is not None:
        b = (
            bias
            if bias.dtype == torch.float32 and bias.is_contiguous()
            else bias.float().contiguous()
        )
    try:
        if not native.enabled():
            raise native.NativeError("native kernels are disabled (TORCHPORT_NATIVE=0)")
        plan = plan_for(pw, rows, _use_int8(pw, allow_int8), x.dtype == torch.bfloat16)
    except native.NativeError as e:
        native.note_fallback("gemv", e)
        return _aten_fallback(xf, pw, b).reshape(out_shape).to(x.dtype)
    if plan.kernel is None:  # F.linear won the tuning (dense weights only)
        if x.dtype != pw.data.dtype:  # (F.linear refuses mixed dtypes) as the kernels compute:
            # float32 products of the exact values, the result in x's dtype; the weight cast to
            # x's dtype rounded a float32 weight to bf16 (and copied it on every call)
            return _aten_fallback(xf, pw, b).reshape(out_shape).to(x.dtype)
        bx = bias.to(x.dtype) if bias is not None else None
        return torch.nn.functional.linear(x, pw.data, bx)
    out = torch.empty(out_shape, dtype=torch.float32)
    kern = plan.kernel
    plan.launch(lambda nt: _launch(kern, xf, pw, b, out, nt))
    if pw.overflow_rows is not None:
        _overflow_linear(out, xf, pw, b)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def dequantize_packed(pw: PackedWeight) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix a packed weight stands for (plain-torch references)."""
    from torchport.lowp import mx, nvfp4

    if pw.fmt in ("f32", "bf16"):
        return pw.data.float()
    if pw.fmt in ("fp8_e4m3", "fp8_e5m2"):
        dt = torch.float8_e4m3fn if pw.fmt == "fp8_e4m3" else torch.float8_e5m2
        return pw.data.view(dt).float() * pw.rowscale.reshape(-1, 1)
    if pw.fmt == "nvfp4":
        return nvfp4.nvfp4_dequantize_reference(pw.data, pw.scales, pw.pts)
    elem = {"mxfp4": "fp4_e2m1", "mxfp8_e4m3": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2"}[pw.fmt]
    return mx.mx_dequantize_reference(pw.data, pw.scales, elem)


def _aten_fallback(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Visible fallback when no native kernel can run: dequantize, then ``F.linear`` (float32)."""
    return torch.nn.functional.linear(x.reshape(-1, pw.k).float(), dequantize_packed(pw), bias)


def _func_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GEMV under a ``torch.func`` transform: ``F.linear`` on torch ops in float32 (``w`` the
    float32 ``[N, K]`` weight), as the kernel computes (a bf16 bias beside the float32 product
    raised a dtype mismatch under grad), the output in ``x``'s dtype and shape."""
    bf = bias.float() if bias is not None else None
    out = torch.nn.functional.linear(x.reshape(-1, w.shape[1]).float(), w, bf)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _eager(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True if the kernel may be called directly (plain tensors or parameters, no autograd, no
    lazy negation: a bias with the bit holds its un-negated values, which the kernel added),
    on the CPU (the kernel read another device's data pointer as host memory: a meta input
    crashed the process; the general path names the device)."""
    if not native.eager_fast_path(x) or not x.is_cpu:
        return False
    if bias is None:
        return True
    return (
        type(bias) in (torch.Tensor, torch.nn.Parameter)
        and bias.is_cpu
        and not (bias.requires_grad and torch.is_grad_enabled())
        and not bias.is_neg()
    )


# --- custom ops (compile/export path) ------------------------------------------------------------


@torch.library.custom_op("torchport::gemv_dense", mutates_args=())
def gemv_dense_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Decode GEMV with a dense float32/bfloat16 weight."""
    pw = pack_dense(w)
    # the kernel reads rows * K activations and N bias values: x's last dimension a multiple of
    # K wrote its rows past the output's end (heap corruption), a scalar bias was read past its end
    check_activation(x, pw.k)
    _check_bias(bias, pw.n)
    return _run(x, pw, bias)


# The fake implementations check what the kernels will (a graph with a wrong K or dtype is
# refused when traced, with the eager error), on fake CPU tensors; a call on meta tensors only
# propagates shapes.


@gemv_dense_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not x.is_meta:
        check_dense_weight(w)
        check_activation(x, w.shape[1])
        _check_bias(bias, w.shape[0])
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("torchport::gemv_packed", mutates_args=())
def gemv_packed_op(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    rowscale: torch.Tensor,
    pts: float,
    fmt: str,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    allow_int8: bool = True,
) -> torch.Tensor:
    """Decode GEMV with a packed low-precision weight. ``allow_int8``: the caller's choice and
    the pack's own ``int8`` (False for NaN block scales), which the op's arguments carry only
    folded into this one."""
    pw = PackedWeight(fmt, data, scales, rowscale, pts, n, k, allow_int8)  # (checks the parts)
    # A per-call pack (a traced weight's is never scanned): the NaN codes' rows get a NaN scale,
    # an MXFP8 E4M3 weight's blocks the E8M0 NaN code, and NaN block scales keep the float
    # kernel (the scans remembered per weight memory and version: see nancodes)
    if fmt == "fp8_e4m3":
        rs = nan_rowscale(data.view(n, k), rowscale)
        if rs is not rowscale:
            pw = replace(pw, rowscale=rs)
    elif fmt == "mxfp8_e4m3":
        sc = mx_nan_scales(data.view(n, k), scales, 32)
        if sc is not scales:
            pw = replace(pw, scales=sc)
    # and the rows whose scale overflows get torch's outputs, as a cached pack's (see _run)
    over = overflow_rows(fmt, pw.rowscale)
    if over is not None:
        pw = replace(pw, overflow_rows=over)
    if _use_int8(pw, allow_int8) and nan_block_scales(scales, fmt):
        allow_int8 = False
    check_activation(x, k)  # (as gemv_dense)
    _check_bias(bias, n)
    return _run(x, pw, bias, allow_int8)


@gemv_packed_op.register_fake
def _(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    rowscale: torch.Tensor,
    pts: float,
    fmt: str,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    allow_int8: bool = True,
) -> torch.Tensor:
    if not x.is_meta:
        check_parts(fmt, data, scales, rowscale, n, k)
        check_activation(x, k)
        _check_bias(bias, n)
    return x.new_empty((*x.shape[:-1], n))


# Autograd of the two ops, as F.linear's: the input's gradient through the (dequantized) weight,
# the bias's the summed rows; a dense weight's gradient too (a packed one is frozen: its codes and
# scales have none). Before these, backward through either op raised torch's "no autograd formula".
# The backward is made of differentiable torch ops on the saved input and weight, so a gradient
# taken with ``create_graph`` differentiates again (a detached weight dropped the penalty's
# terms through it), and the tensors are saved as F.linear saves them, the input only for the
# weight's gradient and the weight only for the input's, version-checked (one written in place
# between forward and backward raises instead of giving the gradient of the new values).


def _gemv_dense_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, w, bias = inputs
    ctx.save_for_backward(x if w.requires_grad else None, w if x.requires_grad else None)
    ctx.meta = (x.shape, x.dtype, w.dtype, bias.dtype if bias is not None else None)


def _gemv_dense_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w = ctx.saved_tensors
    x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
    need_x, need_w, need_b = ctx.needs_input_grad
    g2 = grad.reshape(-1, grad.shape[-1]).float()
    gx = (g2 @ w.float()).reshape(x_shape).to(x_dtype) if need_x else None
    gw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(w_dtype) if need_w else None
    gb = g2.sum(0).to(b_dtype) if need_b else None
    return gx, gw, gb


# Writes into inference tensors' storages, which have no version counter: ``note_written``
# counts them (a quantized weight's ``copy_`` calls it), and a backward that kept such a tensor
# compares the count with the one at its forward. Keyed by the storage object (torch keeps one
# per storage, views included, as long as the storage lives), held weakly: an entry goes with its
# storage (every weight ever written kept one, a model reloaded in a loop a growing map). Keyed by
# address, a storage moved in place (``share_memory_()``) left its count at the old address,
# where a new storage inherited it, and the moved one's death later dropped the live one's entry:
# a backward with no write raised "modified by an inplace operation".
_INFERENCE_WRITES: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = (
    weakref.WeakKeyDictionary()
)


def note_written(tensors: tuple[torch.Tensor, ...]) -> None:
    """Record that ``tensors`` (plain CPU tensors) were written in place where autograd does not
    see it (inside a ``__torch_dispatch__``): their version counters are bumped, and the write
    counts of the inference tensors' storages, so that a backward that kept any of them raises
    as torch's does for a tensor modified in place after it was saved."""
    torch.autograd.graph.increment_version([t for t in tensors if not t.is_inference()])
    for t in tensors:
        if t.is_inference():
            storage = t.untyped_storage()
            _INFERENCE_WRITES[storage] = _INFERENCE_WRITES.get(storage, 0) + 1


def _writes_of(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    return _INFERENCE_WRITES.get(t.untyped_storage(), 0)


def _gemv_packed_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, data, scales, rowscale, pts, fmt, n, k, bias, _ = inputs
    # The pack is needed only for the input's gradient (a bias-only backward kept it for
    # nothing). Its tensors share the weight's inner tensors (qdata itself, or views of it), which
    # a copy_ into the weight rewrites in place (it bumps their versions: see note_written), so
    # they are saved with version checks. A weight first packed under torch.inference_mode()
    # holds inference tensors, which save_for_backward refuses ("Inference tensors cannot be
    # saved for backward"); they stay ctx attributes with their storages' write counts, checked
    # in the backward instead.
    pack = (data, scales, rowscale) if x.requires_grad else ()
    ctx.frozen = tuple(t if t.is_inference() else None for t in pack)
    ctx.writes = tuple(_writes_of(t) for t in ctx.frozen)
    ctx.save_for_backward(*(None if t.is_inference() else t for t in pack))
    ctx.meta = (x.shape, x.dtype, pts, fmt, n, k, bias.dtype if bias is not None else None)


def _gemv_packed_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_shape, x_dtype, pts, fmt, n, k, b_dtype = ctx.meta
    g2 = grad.reshape(-1, n).float()
    gx = None
    if ctx.needs_input_grad[0]:
        if ctx.writes != tuple(_writes_of(t) for t in ctx.frozen):
            raise RuntimeError(
                "gemv backward: one of the variables needed for gradient computation has been "
                "modified by an inplace operation: the quantized weight (an inference tensor) "
                "was written by copy_ after the forward"
            )
        saved = ctx.saved_tensors
        data, scales, rowscale = (f if f is not None else s for f, s in zip(ctx.frozen, saved))
        w = dequantize_packed(PackedWeight(fmt, data, scales, rowscale, pts, n, k, False))
        gx = (g2 @ w).reshape(x_shape).to(x_dtype)
    gb = g2.sum(0).to(b_dtype) if ctx.needs_input_grad[8] else None
    return gx, None, None, None, None, None, None, None, gb, None


gemv_dense_op.register_autograd(_gemv_dense_backward, setup_context=_gemv_dense_setup)
gemv_packed_op.register_autograd(_gemv_packed_backward, setup_context=_gemv_packed_setup)


def gemv_packed(
    x: torch.Tensor,
    pw: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    allow_int8: bool = True,
) -> torch.Tensor:
    """Decode GEMV with a packed weight (validates x and bias, then calls the kernel).

    ``allow_int8=False``: FP4 weights keep float32 activations even when ``config.gemv_fp4_int8``
    is on (used when the activations are already quantized values that must stay exact).
    """
    routes = pw.routes
    route = routes.get(allow_int8)  # the route the last settled call took
    if route is not None:
        out = route.serve(x, bias)
        if out is not None:
            return out
    if type(x) is torch.Tensor and not x.is_nested:  # another route settled by an earlier call
        route = routes.get((x.dtype, x.shape, allow_int8))
        if route is not None:
            out = route.serve(x, bias)
            if out is not None:
                routes[allow_int8] = route
                return out
    return _gemv_checked(x, pw, bias, allow_int8, settle=True)


_SEEN = ("seen",)  # key in PackedWeight.routes: the weight served an eager call before


def _gemv_checked(
    x: torch.Tensor,
    pw: PackedWeight,
    bias: torch.Tensor | None,
    allow_int8: bool,
    settle: bool,
) -> torch.Tensor:
    """:func:`gemv_packed` without its settled-route lookup; ``settle``: remember a route for
    the next call with this weight (only for weights the caller keeps, not per-call packs)."""
    check_activation(x, pw.k)
    _check_bias(bias, pw.n)
    if native.functorch_active() or native.forward_ad_active():  # torch.func or forward-mode
        # AD: torch ops (the custom ops have no forward-mode formula: jvp gave a zero tangent, and
        # a dual input that does not require grad reached the kernel, which dropped it)
        return _func_linear(x, dequantize_packed(pw), bias)
    if _eager(x, bias):
        routes = pw.routes
        if settle and _SEEN in routes:  # a weight used again: worth a route
            route = settle_route(x, pw, bias, allow_int8)
            if route is not None:
                if len(routes) >= 16:
                    routes.clear()
                    routes[_SEEN] = None
                routes[(x.dtype, x.shape, allow_int8)] = routes[allow_int8] = route
        elif settle:  # first use (maybe a one-off pack, as scaled_mm makes per call)
            routes[_SEEN] = None
        return _run(x, pw, bias, allow_int8)
    if pw.fmt in ("f32", "bf16"):
        return gemv_dense_op(x, pw.data, bias)
    # the pack's int8 flag travels folded into allow_int8 (the op rebuilds the pack from its
    # parts; without it, NaN block scales read finite when x requires grad or in a captured graph)
    return gemv_packed_op(
        x, pw.data, pw.scales, pw.rowscale, pw.pts, pw.fmt, pw.n, pw.k, bias, allow_int8 and pw.int8
    )


def linear_decode(
    x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, allow_int8: bool = True
) -> torch.Tensor:
    """Lean eager entry for quantized ``nn.Linear`` weights (the caller checked rows ≤ MAX_ROWS
    and the dtype); falls back to :func:`gemv_packed` for anything unusual."""
    if x.shape[-1] == pw.k and (bias is None or bias.shape == (pw.n,)) and _eager(x, bias):
        return _run(x, pw, bias, allow_int8)
    return gemv_packed(x, pw, bias, allow_int8=allow_int8)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for decode shapes (≤ 8 rows) through the native GEMV.

    ``weight``: float32/bfloat16 ``[N, K]`` or a ``torchport.lowp`` quantized tensor; another
    tensor subclass (``TwoTensor``, ``DTensor``, ...) is served by ``F.linear``'s torch ops in
    float32, as the subclass dispatches them (a counted fallback, warned once). NaN and
    infinities in ``x`` give NaN and infinities where ``F.linear`` on the dequantized weight
    does: FP4 weights' int8-activation kernels hand such calls to the format's float kernel.
    """
    from torchport.lowp.tensors import LowPrecisionTensor  # (lowp imports this module)

    if isinstance(weight, LowPrecisionTensor):  # packs once and keeps its settled routes
        return weight.gemv(x, bias)
    if isinstance(weight, torch.Tensor) and _foreign(weight):
        return _subclass_linear(x, weight, bias)
    pw = pack_dense(weight)
    if native.functorch_active() or native.forward_ad_active():  # torch.func or forward AD:
        # torch ops on the weight itself, which may be what is transformed or dual (the packed
        # copy is detached: grad w.r.t. the weight raised "must override the setup_context
        # staticmethod" through the op's autograd, and a dual weight's tangent was dropped)
        check_activation(x, pw.k)
        _check_bias(bias, pw.n)
        return _func_linear(x, weight.float(), bias)
    if weight.requires_grad and torch.is_grad_enabled():  # the op's autograd: weight grads too
        check_activation(x, pw.k)
        _check_bias(bias, pw.n)
        return gemv_dense_op(x, weight, bias)
    return _gemv_checked(x, pw, bias, True, settle=False)


def _subclass_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gemv` with a tensor-subclass weight (``TwoTensor``, ``DTensor``, ...): the same
    checks, then F.linear's torch ops in float32 (as the kernels compute, the output in x's dtype),
    which the subclass dispatches as it defines. A visible fallback: the kernel reads memory, and
    a wrapper subclass has none of its own (its null data pointer crashed the process)."""
    check_dense_weight(w)
    check_activation(x, w.shape[1])
    _check_bias(bias, w.shape[0])
    if not is_compiling_here():
        native.note_fallback("gemv", f"the weight is a {type(w).__name__}, not a plain tensor")
    return _func_linear(x, w.float(), bias)


# --- settled eager routes ------------------------------------------------------------------------

# Settings a settled route depends on (see :func:`torchport.config.stamp`); the thread count is
# checked separately (``torch.get_num_threads()``).
ROUTE_SETTINGS = ("native", "isa", "gemv_fp4_int8", "autotune", "max_autotune_gemm_backends")


@dataclass(frozen=True)
class SettledRoute:
    """A direct kernel call for one (weight, activation dtype and shape, bias) combination.

    Built once the launch plan is settled; valid while :func:`torchport.config.stamp` of
    :data:`ROUTE_SETTINGS`, the thread count and the bias (object, version, storage) are unchanged.
    ``run(x)`` skips validation, planning and setting reads: the weight's pointers, sizes, thread
    count and the float32 bias are captured (weights are immutable once packed).
    """

    stamp: tuple[object, ...]
    nthreads: int
    dtype: torch.dtype
    shape: torch.Size
    bias: torch.Tensor | None
    bias_version: int  # (-1: an inference tensor, which keeps no version counter)
    bias_ptr: int
    run: object  # Callable[[torch.Tensor], torch.Tensor]
    # ``serve(x, bias)``: ``run(x)`` if the route serves this call now -- same settings, thread
    # count, dtype, shape and bias (object, version, storage), and
    # :func:`~torchport.native.eager_fast_path`'s conditions -- all checked in one frame; else None
    serve: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]


# Outputs a settled route allocates at a time (at most OUT_BATCH_BYTES of them). A decode call
# runs its Python with cold caches: the previous call's weight stream (tens of MB) evicted the
# interpreter's and libtorch's code and data from L1-L3, and one ``torch.empty`` then took 62-76
# µs instead of 3-5 (11008 floats, medians after a 64 MiB read, load 4-5). Eight allocated in a
# row cost 110 µs cold: the route hands them out one per call and allocates the next eight when
# they are gone.
OUT_BATCH = 8
OUT_BATCH_BYTES = 1 << 20


def _out_source(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Callable[[], torch.Tensor]:
    """A function returning a new uninitialised tensor of ``shape`` and ``dtype`` per call, as
    ``torch.empty`` would, allocating :data:`OUT_BATCH` at a time (fewer for large outputs).

    Every tensor is a separate allocation handed out once. As ``torch.empty``'s (and
    ``F.linear``'s) results, one handed out under ``torch.inference_mode`` is an inference
    tensor and any other is not: two batches, one made in each mode (a single batch made
    outside inference mode gave ordinary tensors inside it from a route's second call on,
    where torch gives inference tensors; made inside, autograd refuses them outside).
    ``new_out.pops`` are the two batches' ``pop`` (ordinary, inference) for hot callers, which
    call ``new_out()`` when theirs is empty.
    """
    size = dtype.itemsize * math.prod(shape)
    count = max(1, min(OUT_BATCH, OUT_BATCH_BYTES // max(1, size)))
    empty = torch.empty
    ready: list[torch.Tensor] = []
    ready_inf: list[torch.Tensor] = []
    inference = torch.is_inference_mode_enabled

    def new_out() -> torch.Tensor:
        mode = inference()
        batch = ready_inf if mode else ready
        try:
            return batch.pop()
        except IndexError:  # used up (another thread may have taken the last one meanwhile)
            with torch.inference_mode(mode):
                made = [empty(shape, dtype=dtype) for _ in range(count)]
            out = made.pop()
            batch.extend(made)
            return out

    new_out.pops = (ready.pop, ready_inf.pop)  # type: ignore[attr-defined]
    return new_out


# One output source per output shape, shared by the settled routes of that shape. With one per
# route, each route held up to OUT_BATCH - 1 unused outputs (200 decode weights of N = 11008 in
# a model: up to 60 MB), and a route called only a few times (a benchmark rotating copies of one
# weight) paid a cold batch allocation for each few calls.
_OUT_SOURCES: dict[tuple[tuple[int, ...], torch.dtype], Callable[[], torch.Tensor]] = {}


def _shared_out_source(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Callable[[], torch.Tensor]:
    src = _OUT_SOURCES.get((shape, dtype))
    if src is None:
        if len(_OUT_SOURCES) >= 64:
            _OUT_SOURCES.clear()
        src = _OUT_SOURCES[(shape, dtype)] = _out_source(shape, dtype)
    return src


# A settled route with a thread-adaptive plan times one call in ROUTE_SAMPLE_EVERY through the
# plan's ThreadAdaptive (its call counts, probe intervals included, are then in sampled calls); the
# calls between run the adaptive's current launch directly. A timed call cost 70 us of cold Python
# more than a direct one (lock, clock reads, median bookkeeping; kernel stubbed, caches evicted by
# a 64 MiB read before each call, medians of 41, load 6-8), a tenth of an NVFP4 11008x4096 call.
ROUTE_SAMPLE_EVERY = 4


@functools.cache
def _cast_nan_is_ffff() -> bool:
    """Whether torch's CPU cast to bf16 writes NaN as 0xffff, as the ``vdpbf16ps`` kernel's bf16
    entry does (its vectorized cast does; with ``ATEN_CPU_CAPABILITY=default`` the scalar one
    writes 0x7fc0, and settled routes then keep the float32 entry and torch's cast)."""
    for n in (1, 37):
        codes = torch.full((n,), math.nan).bfloat16().view(torch.int16)
        if not bool((codes == -1).all()):
            return False
    return True


def settle_route(
    x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, allow_int8: bool = True
) -> SettledRoute | None:
    """A :class:`SettledRoute` for ``gemv_packed(x, pw, bias)`` on plain eager tensors, or None
    where the general path must run (settings overridden in this context, empty problems, native
    kernels off, an ATen plan, unusual inputs, FP8 rows whose scale overflows: see
    :func:`overflow_rows`)."""
    stamp = config.stamp(ROUTE_SETTINGS)
    if stamp is None or pw.k == 0 or pw.n == 0 or x.dim() < 1 or x.shape[-1] != pw.k:
        return None
    if not (_eager(x, bias) and native.enabled()):
        return None
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != pw.n):
        return None
    rows = x.numel() // pw.k
    if not 0 < rows <= MAX_ROWS or pw.overflow_rows is not None:  # (those rows: _run's)
        return None
    plan = _native_plan(pw, rows, allow_int8, x.dtype == torch.bfloat16)
    if plan is None:
        return None
    # bf16 activations: the kernel's bf16-in, bf16-out entry (no float32 copy of x, no cast of
    # the result: two torch calls fewer, ~75 us of cold Python per call; the vdpbf16ps kernel
    # reads the bf16 values as they are, the others widen them in C), where torch's cast writes
    # NaN as the entry does
    io = x.dtype == torch.bfloat16 and isinstance(plan.kernel, GemvKernel) and _cast_nan_is_ffff()
    kern = plan.kernel
    call = (kern.bf16io if io else kern).raw_call  # type: ignore[union-attr]
    ad, arm_threads = plan.adaptive, plan.arm_threads
    nt_fixed = plan.threads or native.num_threads()  # the route is dropped if the count changes
    k, n, pts, fmt = pw.k, pw.n, pw.pts, pw.fmt
    dptr, sptr, rptr = pw.data.data_ptr(), pw.scales.data_ptr(), pw.rowscale.data_ptr()
    # A float32 contiguous bias is read where it lives (a write through ``bias.data``, which has
    # its own version counter, is seen); any other is converted on every call: a float32 copy
    # made once here missed such writes (bf16 model, ``m.bias.data.add_(100)``: output unmoved)
    bf = bias.detach() if bias is not None else None
    convert = bf is not None and (bf.dtype != torch.float32 or not bf.is_contiguous())
    bptr, has_bias = (bf.data_ptr(), 1) if bf is not None and not convert else (0, int(convert))
    shape, out_shape = x.shape, (*x.shape[:-1], n)
    dtype, f32 = x.dtype, torch.float32
    cast = dtype is not f32 and not io  # float32 activations in, the result cast back
    new_out = _shared_out_source(out_shape, dtype if io else f32)
    pop, pop_inf = new_out.pops  # type: ignore[attr-defined]
    inference = torch.is_inference_mode_enabled
    every = ROUTE_SAMPLE_EVERY
    calls = 0

    def run(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        if cast:
            xf = x.float().contiguous()
        else:
            xf = x if x.is_contiguous() else x.contiguous()
        try:  # (an inference tensor in inference mode, as torch.empty's)
            out = pop_inf() if inference() else pop()
        except IndexError:  # used up: the next batch
            out = new_out()
        xp, op = xf.data_ptr(), out.data_ptr()
        bp = bptr
        if convert:  # (``bc`` keeps the copy alive through the call)
            bc = bf.float().contiguous()  # type: ignore[union-attr]
            bp = bc.data_ptr()
        nt = nt_fixed
        if ad is not None:
            calls += 1  # (a lost update under threads only shifts the sampling)
            if calls % every == 0 or ad.pending >= 0:  # a sampled call: the adaptive times it

                def go(threads: int) -> None:
                    raw = (xp, rows, k, dptr, sptr, rptr, pts, bp, has_bias, op, n, threads)
                    status = call(*raw)
                    if status:
                        _after_status(kern, status, io, raw, fmt)

                ad(go)
                return out.to(dtype) if cast else out
            nt = arm_threads[ad.current]
        raw = (xp, rows, k, dptr, sptr, rptr, pts, bp, has_bias, op, n, nt)
        status = call(*raw)
        if status:
            _after_status(kern, status, io, raw, fmt)
        return out.to(dtype) if cast else out

    nthreads = torch.get_num_threads()
    bias0 = bias
    # an inference tensor keeps no version counter (reading it raised on every call): -1, and
    # its shape checked instead (its in-place writes are read where it lives, or converted on
    # every call; a shrinking resize_ keeps the storage, and a version counter saw it)
    bver, bptr0 = (tensor_version(bias), bias.data_ptr()) if bias is not None else (0, 0)
    bshape = bias.shape if bias is not None else None
    tensor, strided = torch.Tensor, torch.strided
    overrides, generation, env_get, env_keys = config.stamp_reader(ROUTE_SETTINGS)
    gen0, env = stamp[0], tuple(zip(env_keys, stamp[1]))
    compiling, grad_enabled, get_threads = (
        is_compiling_here,
        torch.is_grad_enabled,
        torch.get_num_threads,
    )
    depth, fmodes = torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled
    functorch = native.functorch_active
    fmode = torch.overrides._get_current_function_mode
    fwad = torch.autograd.forward_ad  # its dual_level's global, read inline (see forward_ad_active)

    def serve(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        # the route's checks and native.eager_fast_path in one frame (each getter read once)
        if type(x) is not tensor or bias is not bias0 or x.dtype is not dtype:
            return None
        # (a sparse, mkldnn or nested x of the route's shape raised torch's untyped errors in
        # run; the general path refuses it with a GemvInputError)
        if x.layout is not strided or x.is_nested or x.shape != shape:
            return None
        if not x.is_cpu or compiling() or depth() or functorch() or (fmodes() and fmode()):
            return None  # (under torch.func the wrapped x has no data pointer)
        if x.is_neg():  # a lazily negated view: its memory holds the un-negated values
            return None
        if fwad._current_level >= 0:  # forward AD: x may carry a tangent the kernel drops
            return None
        if grad_enabled() and (x.requires_grad or (bias0 is not None and bias0.requires_grad)):
            return None
        if bias0 is not None and (
            bias0.data_ptr() != bptr0
            or (bias0._version != bver if bver >= 0 else bias0.shape != bshape)
        ):
            return None
        if get_threads() != nthreads or overrides() or generation[0] != gen0:
            return None
        for key, val in env:  # config.stamp(ROUTE_SETTINGS) == stamp, inline
            if env_get(key) is not val:
                return None
        return run(x)

    # the captured pointers' storage (the tensors, not ``pw``: ``pw.routes`` holds the route)
    run.keep_alive = (pw.data, pw.scales, pw.rowscale, bf)  # type: ignore[attr-defined]
    run.bf16io = io  # type: ignore[attr-defined]  # which entry the route calls (tests)
    return SettledRoute(stamp, nthreads, dtype, shape, bias, bver, bptr0, run, serve)
