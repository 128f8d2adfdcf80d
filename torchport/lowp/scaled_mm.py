"""Scaled GEMM: ``torchport.scaled_mm`` (FP8, mirroring ``torch._scaled_mm``) and block-scaled GEMM.

``scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype=None)`` computes
``(a * scale_a) @ (b * scale_b) + bias`` for FP8 ``a [M, K]`` and ``b [K, N]`` with

- tensor-wise scaling: ``scale_a`` and ``scale_b`` float32 with one element each;
- row-wise scaling: ``scale_a [M, 1]`` and ``scale_b [1, N]`` float32.

Accumulation is float32; the epilogue applies ``scale_a · scale_b``, then ``bias``, then the cast
to ``out_dtype`` (default: ``a.dtype``; torch's FP8 cast, as ``torch._scaled_mm``: E4M3FN
saturates, E5M2 overflows to infinity). Decode shapes (M ≤ 8) run the native FP8 GEMV reading
``b``'s bytes directly (an E4M3 NaN code gives its column NaN, as torch's cast:
:func:`torchport.gemv.nancodes.nan_rowscale`). Larger M runs on the GEMM engine
(:func:`torchport.gemm.mm`: generated kernels autotuned against ATen, which it falls back to):
``b`` is decoded to float32 one panel of columns at a time (FP8 values are exact in float32) and
each panel is one engine GEMM whose epilogue does the scaling (``Scale`` by ``scale_a`` per row and
``scale_b`` per column, in that order), the ``Bias`` and, for bfloat16, the ``Cast``; other output
dtypes are cast from the float32 result. Only the summation order and the float32 rounding of the
scaling differ from :func:`scaled_mm_reference` (float64). The routes multiply the float32 sum by
the two scales one after the other (the GEMM: ``scale_a``, then ``scale_b``; the GEMV:
``scale_b``, then ``scale_a``) only where the first product is a normal float32 for every sum
the operands can give (:func:`_fits`: scales of ordinary size); otherwise (a sum of 448² times
1e34, then times 1e-10, overflowed) the sum comes out unscaled and is multiplied by
``scale_a · scale_b`` in float64 (:func:`_scale_sum`), as traced and autograd calls always do.
Either way the result is finite exactly where the scaled value fits float32, as the reference's.

Scales whose product overflows float32 (``1e20 · 1e20``) give ±inf (0 for a zero sum), as the
reference does: :func:`scaled_mm_reference` states where that differs from ``torch._scaled_mm``
on the CPU (NaN).

``block_scaled_mm(x, w)`` multiplies activations by an NVFP4/MX (or FP8) weight ``[N, K]``:
``x @ dequantize(w).T + bias``, dequantizing ``w`` natively one row panel at a time (a panel stays
in L3) and multiplying each panel on the GEMM engine with ``Bias``/``Cast`` as its epilogue;
quantized activations (NVFP4/MX tensors) are dequantized first.

Both engine paths serve plain eager calls. Under autograd (an input that requires grad) or while
tracing (``torch.compile``, export) the panels go through ``torch.mm`` and torch epilogue ops, which
record gradients and trace as ordinary ATen ops (the decoded panels are temporaries: handing them
to the engine there would let its packed-weight cache hold every one of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from torchport import autotune, gemm, native
from torchport.gemm import Config
from torchport.gemm.epilogue import FUSABLE_DTYPES, Split, Step, split
from torchport.gemm.kernels import run_native
from torchport.gemm.mm import agree, bucket
from torchport.gemv import MAX_ROWS, PackedWeight, gemv_packed
from torchport.gemv.nancodes import nan_rowscale
from torchport.lowp.formats import FP8_DTYPES, LowPrecisionError
from torchport.lowp.panel import decode_rows_bf16, pack_rows, panel_workspace

OUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, *FP8_DTYPES)
_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)


def _validate(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[bool, torch.dtype]:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FP8_DTYPES or t.dim() != 2:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise LowPrecisionError(f"scaled_mm: {name} must be a 2-D float8 tensor, got {got}")
        if t.device.type != "cpu":  # (the kernels read its data pointer as host memory)
            raise LowPrecisionError(f"scaled_mm: {name} must be on cpu, got {t.device}")
    m, k = a.shape
    if b.shape[0] != k:
        raise LowPrecisionError(
            f"scaled_mm: a's K ({k}) must equal b's K ({b.shape[0]}); shapes {tuple(a.shape)}, {tuple(b.shape)}"
        )
    n = b.shape[1]
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise LowPrecisionError(
                f"scaled_mm: {name} must be a float32 tensor, got {getattr(s, 'dtype', s)}"
            )
        if s.device.type != "cpu":
            raise LowPrecisionError(f"scaled_mm: {name} must be on cpu, got {s.device}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        raise LowPrecisionError(
            "scaled_mm: scales must be tensor-wise (one element each) or row-wise "
            f"(scale_a ({m}, 1), scale_b (1, {n})), got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise LowPrecisionError(
            f"scaled_mm: bias must be a tensor or None, got {type(bias).__name__}"
        )
    if bias is not None and bias.device.type != "cpu":
        raise LowPrecisionError(f"scaled_mm: bias must be on cpu, got {bias.device}")
    if bias is not None and (bias.dtype in FP8_DTYPES or bias.is_complex()):
        # (torch refuses both: FP8 has no promotion, a complex sum no real output; the complex
        # bias lost its imaginary part here with a warning, the FP8 one was taken as its value)
        raise LowPrecisionError(
            f"scaled_mm: bias must be a real, non-float8 tensor, got {bias.dtype}"
        )
    if bias is not None and tuple(bias.shape) not in ((n,), (1, n)):
        raise LowPrecisionError(
            f"scaled_mm: bias must have shape ({n},) or (1, {n}), got {tuple(bias.shape)}"
        )
    od = a.dtype if out_dtype is None else out_dtype
    if od not in OUT_DTYPES:
        raise LowPrecisionError(f"scaled_mm: out_dtype must be one of {OUT_DTYPES}, got {od}")
    return rowwise and not tensorwise, od


def _check_scale_result(scale_result: torch.Tensor | None) -> None:
    if scale_result is not None and not (
        isinstance(scale_result, torch.Tensor)
        and scale_result.dtype == torch.float32
        and scale_result.numel() == 1
    ):
        got = (
            f"{scale_result.dtype} {tuple(scale_result.shape)}"
            if isinstance(scale_result, torch.Tensor)
            else type(scale_result).__name__
        )
        raise LowPrecisionError(
            f"scaled_mm: scale_result must be a one-element float32 tensor, got {got}"
        )


def _finish(
    acc: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    div: torch.Tensor | None = None,
) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    if div is not None:  # scale_result (FP8 output only)
        acc = acc / div.float()
    return acc.to(out_dtype)  # (torch's FP8 cast, as torch._scaled_mm: see _cast_out)


def scaled_mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    scale_result: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` in float64, divided by ``scale_result`` for an FP8
    output, then cast as torch does (E4M3FN saturates, E5M2 overflows to inf). The operands are
    scaled before the product, as ``torch._scaled_mm`` scales them on the CPU (an FP8 value times
    a float32 scale is exact in float64).

    Finite scales: the same values as ``torch._scaled_mm`` on the CPU wherever its float32
    products ``a[i, k]·scale_a · b[k, j]·scale_b`` and their sums stay within float32's range.
    Where they do not (``scale_a · scale_b`` of 1e40, or 1e34 with ``|a·b| = 448²``), torch
    gives ±inf, or NaN where infinities of both signs meet (``inf - inf``), while this gives the
    exact value rounded to ``out_dtype``: finite if it fits, else ±inf with the sign of the
    unscaled sum (0 for a zero sum); so does :func:`scaled_mm`, which scales the float32 sum as
    cuBLASLt applies ``scale_a · scale_b`` to its accumulator on the GPU.

    An infinite scale: NaN where a scaled row or column holds a zero (inf · 0) or infinities of
    both signs meet, as torch."""
    _, od = _validate(a, b, scale_a, scale_b, bias, out_dtype)
    _check_scale_result(scale_result)
    acc = (a.double() * scale_a.double().reshape(-1, 1)) @ (
        b.double() * scale_b.double().reshape(1, -1)
    )
    if bias is not None:
        acc = acc + bias.double().reshape(-1)
    if scale_result is not None and od in FP8_DTYPES:
        acc = acc / scale_result.double()
    return acc.to(od)  # (torch's FP8 cast, as torch._scaled_mm: see _cast_out)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    scale_result: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """FP8 scaled GEMM mirroring ``torch._scaled_mm`` (tensor-wise and row-wise scaling).

    As torch's CPU implementation: ``bias`` is ``[N]`` or ``[1, N]``; ``scale_result`` (a
    one-element float32 tensor) divides the result, bias included, before an FP8 ``out_dtype``'s
    cast (torch's: E4M3FN saturates, E5M2 overflows to inf) and is ignored for other output
    dtypes; ``use_fast_accum`` is accepted and changes nothing (the accumulation is float32
    either way).

    Finite scales whose float32 products overflow (``scale_a = scale_b = 1e20``): ±inf with the
    sign of the unscaled sum, as :func:`scaled_mm_reference`, where torch's CPU kernel, scaling
    the operands before a float32 product, gives NaN wherever infinities of both signs meet."""
    _, od = _validate(a, b, scale_a, scale_b, bias, out_dtype)
    _check_scale_result(scale_result)
    if bias is not None:
        bias = bias.reshape(-1)
    div = scale_result if scale_result is not None and od in FP8_DTYPES else None
    extra = () if bias is None else (bias,)
    eager = native.eager_fast_path(a, b, scale_a, scale_b, *extra)
    # eager only: a traced call cannot read the scales (its torch ops give NaN for a NaN scale
    # too, and ±inf for an inf one, as the routes do)
    ranges = (_magnitudes(scale_a), _magnitudes(scale_b)) if eager else None
    out = _routes(a, b, scale_a, scale_b, bias, od, div, eager, ranges)
    if ranges is not None and not (ranges[0][2] and ranges[1][2]):
        _torch_order(out, a, b, scale_a, scale_b, bias, od, div)
    return out


_F32 = torch.finfo(torch.float32)


def _magnitudes(s: torch.Tensor) -> tuple[float, float, bool]:
    """The smallest nonzero and the largest magnitude of a scale's finite elements (inf as the
    smallest where all are zero or there are none), and whether all its elements are finite
    (a NaN or infinite one's rows or columns are :func:`_torch_order`'s). On every eager call:
    one ``.item()`` read for a tensor-wise scale, about 1 us; NumPy on a row-wise one (both
    scales of M = 8, N = 4096 with :func:`_fits`: 45 us against the 8 of a sum of each, where
    torch's reductions took twice as long; 2-core VM, loaded)."""
    if s.numel() <= 1:
        v = abs(s.item()) if s.numel() else 0.0
        if not math.isfinite(v):
            return math.inf, 0.0, False
        return (v if v else math.inf), v, True
    mag = np.abs(s.detach().numpy())
    finite = math.isfinite(mag.max())  # (NaN for a NaN scale)
    if not finite:
        mag = mag[np.isfinite(mag)]
    nz = mag[mag > 0]
    if not nz.size:
        return math.inf, 0.0, finite
    return float(nz.min()), float(nz.max()), finite


def _fits(rng: tuple[float, float, bool], a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the float32 sum of ``a @ b`` times each scale of magnitudes ``rng``
    (:func:`_magnitudes`) is a normal float32 or zero for every sum the operands can give, so
    that the second scale's product rounds the exact value once more (finite exactly where it
    fits float32). A nonzero sum lies between the products' smallest nonzero magnitude (FP8
    products are exact and every float32 sum of them is a multiple of it) and K times their
    largest. (A NaN or infinite scale's entries are :func:`_torch_order`'s to redo.)"""
    fa, fb = torch.finfo(a.dtype), torch.finfo(b.dtype)
    lo, hi, _ = rng
    top = a.shape[1] * fa.max * fb.max
    bottom = fa.tiny * fa.eps * fb.tiny * fb.eps  # (the smallest subnormals)
    return hi * top <= _F32.max and lo * bottom >= _F32.tiny


def _scale_sum(acc: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """The float32 sum ``acc [M, N]`` times ``scale_a`` (per row) and ``scale_b`` (per column)
    in float64, rounded to float32 once: finite wherever the scaled value fits float32 (the
    product of the two scales may not: 1e20 · 1e20 times a sum of 2**-18)."""
    sa = scale_a.double().reshape(-1, 1)
    sb = scale_b.double().reshape(1, -1)
    return (acc.double() * sa * sb).float()


def _torch_order(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    od: torch.dtype,
    div: torch.Tensor | None,
) -> None:
    """Recompute in ``out`` the rows and columns that a NaN or inf scale reaches, the operands
    scaled before the product as ``torch._scaled_mm`` and the reference scale them: there
    inf · 0 and inf − inf are NaN, where the routes' scaled float32 product gives ±inf. The other
    entries stay as the routes gave them (a dynamic activation's NaN row leaves the other rows
    as they are without it, bit for bit)."""
    m, n = out.shape
    sa = scale_a.reshape(-1).expand(m)
    sb = scale_b.reshape(-1).expand(n)
    rows = (~torch.isfinite(sa)).nonzero().flatten()
    cols = (~torch.isfinite(sb)).nonzero().flatten()
    bs = b.float() * sb
    if rows.numel():
        out[rows] = _finish((a.float()[rows] * sa[rows, None]) @ bs, bias, od, div)
    if cols.numel():
        cb = None if bias is None else bias[cols]
        out[:, cols] = _finish((a.float() * sa[:, None]) @ bs[:, cols], cb, od, div)


def _routes(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    od: torch.dtype,
    div: torch.Tensor | None,
    eager: bool,
    ranges: tuple[tuple[float, float, bool], tuple[float, float, bool]] | None,
) -> torch.Tensor:
    """:func:`scaled_mm` of validated arguments: the FP8 GEMV up to MAX_ROWS rows, else the
    panel GEMM (``eager``: :func:`torchport.native.eager_fast_path` of the inputs). ``ranges``:
    the scales' :func:`_magnitudes` (None: unread, traced), which decide whether the routes may
    apply the scales one after the other in float32 (:func:`_fits` of the first one) or leave
    them to :func:`_scale_sum`."""
    m, k = a.shape
    n = b.shape[1]
    if 0 < m <= MAX_ROWS and k > 0 and n > 0:
        fmt = "fp8_e4m3" if b.dtype == torch.float8_e4m3fn else "fp8_e5m2"
        fused = ranges is not None and _fits(ranges[1], a, b)  # (the kernel applies scale_b)
        rs = (scale_b.reshape(-1).expand(n) if fused else torch.ones(n)).contiguous()
        if fmt == "fp8_e4m3" and eager:  # (a traced call's op scans when it runs)
            # the GEMV reads E4M3's NaN codes as ±480, torch's cast as NaN: their columns get a
            # NaN scale (the scan remembered per weight memory and version: see nancodes)
            rs = nan_rowscale(b.t(), rs)
        pw = PackedWeight(
            fmt, b.t().contiguous().view(torch.uint8), _EMPTY_U8, rs, 1.0, n, k, False
        )
        acc = gemv_packed(a.float(), pw)
        acc = acc * scale_a.reshape(-1, 1) if fused else _scale_sum(acc, scale_a, scale_b)
        return _finish(acc, bias, od, div)
    if not (ranges is not None and _fits(ranges[0], a, b)):  # (the steps apply scale_a first)
        acc = _panel_gemm(
            a.float(), lambda lo, hi: b.t()[lo:hi].float(), n, k, lambda lo, hi: [], None,
            torch.float32, eager, f"scaled:{str(b.dtype).removeprefix('torch.')}",
        )  # fmt: skip
        return _finish(_scale_sum(acc, scale_a, scale_b), bias, od, div)
    # scale_a per row, scale_b per column (a tensor-wise scale broadcast: a scalar Scale step
    # would be compiled into the kernel, one kernel per scale value)
    sa = scale_a.reshape(-1).expand(m)
    sb = scale_b.reshape(-1).expand(n)
    bt = b.t()  # [N, K]: its rows are b's columns (contiguous for the usual column-major b)

    def decode(lo: int, hi: int) -> torch.Tensor:
        return bt[lo:hi].float()

    def steps(lo: int, hi: int) -> list[Step]:
        return [gemm.Scale(sa, "row"), gemm.Scale(sb[lo:hi], "col")]

    fmt = "fp8_e4m3" if b.dtype == torch.float8_e4m3fn else "fp8_e5m2"

    def decode16(lo: int, hi: int) -> tuple[torch.Tensor, list[Step]]:
        return decode_rows_bf16(bt[lo:hi], None, fmt, out=panel_workspace(hi - lo, k)), []

    tag = f"scaled:{str(b.dtype).removeprefix('torch.')}"
    # FP8 values are exact in bfloat16: both operands can go to the bf16 panels as they are
    # (the bf16 copy of ``a`` is made only where that candidate can be offered)
    bf16 = _Bf16(a.bfloat16(), decode16) if _bf16_offered(od) else None
    acc = _panel_gemm(a.float(), decode, n, k, steps, bias, od, eager, tag, bf16)
    return _cast_out(acc if div is None else acc / div.float(), od)


def _cast_out(acc: torch.Tensor, od: torch.dtype) -> torch.Tensor:
    """The engine's float32 (or already bfloat16) result in ``od`` by torch's own cast, as
    ``torch._scaled_mm`` casts: float8_e4m3fn saturates at ±448 (it has no infinity), float8_e5m2
    rounds a value past 57344 to ±inf (saturating it had given 57344 where torch gives inf)."""
    return acc if acc.dtype == od else acc.to(od)


PANEL_BYTES = 8 << 20  # one decoded float32 weight panel (stays in L3)
# one decoded bfloat16 panel: fewer, larger panels (each decode and GEMM call is a threaded call;
# on the shared 2-core machine a call can wait a scheduler tick for its second thread). Measured
# M=128 4096x4096 NVFP4, bf16 panels vs dequant+bf16 F.linear (loaded machine, medians of 9):
# 8 MiB panels 129 vs 96 ms, 16 MiB 71 vs 128 ms, 32 MiB 49 vs 91 ms
BF16_PANEL_BYTES = 16 << 20


class _Bf16(NamedTuple):
    """The bf16 form of a prefill problem, for the "bf16_panels" candidate: the activation
    ``x16`` (bfloat16, the same values as the float32 ``x``) and ``decode16(lo, hi)``, which
    gives rows ``lo:hi`` of the weight decoded to bfloat16 *exactly* and the per-panel steps
    that complete the dequantization after the GEMM (per-tensor or per-row float32 scales)."""

    x16: torch.Tensor
    decode16: Callable[[int, int], tuple[torch.Tensor, list[Step]]]


def _bf16_offered(od: torch.dtype) -> bool:
    """Whether the "bf16_panels" prefill candidate exists: a bfloat16 result, on a CPU with
    AVX512-BF16 (the engine's ``vdpbf16ps`` tiles)."""
    return od == torch.bfloat16 and native.cpu_info().has_avx512_bf16


def _panel_gemm(
    x: torch.Tensor,
    decode: Callable[[int, int], torch.Tensor],
    n: int,
    k: int,
    steps: Callable[[int, int], list[Step]],
    bias: torch.Tensor | None,
    od: torch.dtype,
    eager: bool,
    tag: str = "",
    bf16: _Bf16 | None = None,
) -> torch.Tensor:
    """``epilogue(x @ W.T)`` with ``W [N, K]`` produced in float32 row panels by ``decode(lo, hi)``.

    Plain eager calls (``eager``: :func:`torchport.native.eager_fast_path` of the inputs) run
    either each panel on the GEMM engine, the per-panel ``steps`` (scales), the bias and a
    bfloat16 cast fused into its store, or each panel through ``torch.mm`` (MKL) into the output
    with the steps as in-place torch ops: which one is autotuned per problem ("lowp_prefill",
    the MKL panel loop as the ATen anchor; ``tag`` names the weight format in the key). Panels
    are decoded as inference tensors, which the engine's packed-weight cache never keeps.
    A third candidate, "bf16_panels", exists when ``bf16`` is given and ``od`` is bfloat16:
    the panels decoded straight to bfloat16 and multiplied with bf16 operands and float32
    accumulation (the GEMM engine's ``vdpbf16ps`` tiles or oneDNN through ``torch.mm``, chosen
    per panel), the remaining scales, the bias and the bf16 rounding after. It is exact up to
    summation order and the final bf16 rounding only because the caller hands it bf16 values
    that equal the float32 ones (``x`` bf16, the decoded products exact); a float32 result is
    never produced this way (torch's bf16 GEMM rounds its result to bf16).
    Autograd and tracing take torch ops. The result is float32, or bfloat16 when ``od`` is.
    """
    m = x.shape[0]
    b32 = None if bias is None else bias if bias.dtype in FUSABLE_DTYPES else bias.float()
    if eager and m and n:
        prob = _Prefill(x, decode, n, k, steps, b32, od, bf16 if _bf16_offered(od) else None)
        choice = _prefill_choice(prob, tag)
        if choice.is_anchor:
            return _mkl_panels(prob)
        return _bf16_panels(prob) if choice.name == "bf16_panels" else _engine_panels(prob)
    out = torch.empty(m, n, dtype=torch.float32)
    for lo, hi in _panels(n, k):
        y = torch.mm(x, decode(lo, hi).t())
        for s in steps(lo, hi):
            y = y * _factor(s)
        out[:, lo:hi] = y if b32 is None else y + b32[lo:hi].float()
    return out


def _panels(n: int, k: int, elem_bytes: int = 4) -> Iterator[tuple[int, int]]:
    """The ``[lo, hi)`` row ranges of ``W [N, K]`` decoded one panel at a time: float32
    (``elem_bytes`` 4, :data:`PANEL_BYTES`) or bfloat16 (2, :data:`BF16_PANEL_BYTES`)."""
    size = PANEL_BYTES if elem_bytes == 4 else BF16_PANEL_BYTES
    step = max(16, size // max(1, elem_bytes * k))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def _factor(s: Step) -> torch.Tensor:
    """A per-panel scale step as a factor broadcasting over the panel's ``[M, cols]`` result."""
    assert isinstance(s, gemm.Scale) and isinstance(s.value, torch.Tensor)
    return s.value[:, None] if s.dim == "row" else s.value


class _Prefill(NamedTuple):
    """One eager prefill problem of :func:`_panel_gemm`: ``x [M, K]`` times the ``[N, K]`` weight
    that ``decode(lo, hi)`` produces in float32 row panels, per-panel scale ``steps``, the bias
    (float32 or bfloat16) and the output dtype."""

    x: torch.Tensor
    decode: Callable[[int, int], torch.Tensor]
    n: int
    k: int
    steps: Callable[[int, int], list[Step]]
    b32: torch.Tensor | None
    od: torch.dtype
    bf16: _Bf16 | None = None


def _mkl_panels(p: _Prefill) -> torch.Tensor:
    """The panel loop through ``torch.mm`` (MKL) into the float32 output, the scales and the
    bias applied in place per panel (eager, no autograd)."""
    x, decode, n, k, steps, b32, *_ = p
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    with torch.inference_mode():
        for lo, hi in _panels(n, k):
            y = out[:, lo:hi]
            torch.mm(x, decode(lo, hi).t(), out=y)
            for s in steps(lo, hi):
                y.mul_(_factor(s))
            if b32 is not None:
                y.add_(b32[lo:hi])
    return out


def _prefill_choice(p: _Prefill, tag: str) -> autotune.Candidate:
    """Engine panels or MKL panels for this problem, timed on whole calls (autotuned, cached;
    a native winner is confirmed against the anchor in alternation)."""
    x, _, n, k, steps, b32, od, bf16 = p
    kinds = ",".join(f"{type(s).__name__}:{getattr(s, 'dim', '')}" for s in steps(0, min(n, 16)))
    key = {
        "m": bucket(x.shape[0]),
        "n": n,
        "k": k,
        "fmt": tag,
        "steps": kinds,
        "bias": b32 is not None,
        "od": str(od),
        "isa": native.cpu_info().isa,
        "bf16": bf16 is not None,
    }
    cands = [
        autotune.Candidate("mkl_panels", autotune.ATEN),
        autotune.Candidate("engine_panels", autotune.NATIVE),
    ]
    if bf16 is not None:
        cands.append(autotune.Candidate("bf16_panels", autotune.NATIVE))
    runs = {"mkl_panels": _mkl_panels, "engine_panels": _engine_panels, "bf16_panels": _bf16_panels}

    def factory(c: autotune.Candidate) -> Callable[..., torch.Tensor]:
        run = runs[c.name]
        return lambda x: run(p._replace(x=x))

    choice = autotune.select(
        "lowp_prefill",
        key,
        cands,
        factory,
        lambda: (x,),
        cold=False,
        check=_close_values,
        confirm=True,
        budget_s=2.0,
    )
    label = (
        f"M={key['m']} N={n} K={k} {tag} [{kinds or 'none'}{' bias' if b32 is not None else ''}]"
    )
    gemm.decisions[("lowp_prefill", label)] = choice.candidate.name  # for reports (bench, demo)
    return choice.candidate


def _close_values(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Values agree (either result may be bfloat16 or float32; NaN and inf as the anchor's:
    :func:`~torchport.gemm.mm.agree`)."""
    if out.shape != ref.shape:
        return False
    return agree(out, ref, 3e-2 if torch.bfloat16 in (out.dtype, ref.dtype) else 1e-3)


def _engine_panels(p: _Prefill) -> torch.Tensor:
    """Each panel on the GEMM engine with the steps, bias and bf16 cast fused into its store."""
    x, decode, n, k, steps, b32, od, _ = p
    m = x.shape[0]
    cast = [gemm.Cast(torch.bfloat16)] if od == torch.bfloat16 else []
    out = torch.empty(m, n, dtype=torch.bfloat16 if cast else torch.float32)
    for lo, hi in _panels(n, k):
        with torch.inference_mode():
            panel = decode(lo, hi)
        epi = steps(lo, hi) + ([] if b32 is None else [gemm.Bias(b32[lo:hi])]) + cast
        out[:, lo:hi] = _engine_panel(x, panel, epi)
    return out


def _bf16_panels(p: _Prefill) -> torch.Tensor:
    """Each panel decoded to bfloat16 and multiplied with the bf16 activation on the GEMM engine
    (its ``vdpbf16ps`` tiles or ATen's bf16 ``torch.mm``), float32 accumulation; the decode's
    remaining scales, the steps and the bias in the epilogue; the result bfloat16."""
    _, _, n, k, steps, b32, od, bf16 = p
    assert bf16 is not None and od == torch.bfloat16
    x16 = bf16.x16
    out = torch.empty(x16.shape[0], n, dtype=torch.bfloat16)
    for lo, hi in _panels(n, k, 2):
        with torch.inference_mode():
            panel, post = bf16.decode16(lo, hi)
        epi = steps(lo, hi) + post + ([] if b32 is None else [gemm.Bias(b32[lo:hi])])
        out[:, lo:hi] = _engine_panel(x16, panel, epi)
    return out


def _engine_panel(x: torch.Tensor, panel: torch.Tensor, epi: list[Step]) -> torch.Tensor:
    """``epilogue(x @ panel.T)`` on the GEMM engine.

    The engine's autotuner picks ATen or a native config for the problem, timing native kernels
    on B operands packed beforehand (right for weights its pack cache keeps). A decoded panel is
    packed on every call, so a native pick is timed once more, pack included
    (:func:`~torchport.lowp.panel.pack_rows`), against the ATen anchor ("lowp_panel" in the
    choice cache); the faster serves. ATen serves as that tuning timed it (``gemm.mm_aten``):
    the public ``gemm.mm`` ran the engine's native choice again where the panel's tuning chose
    ATen, and it refuses a NaN or inf Scale operand, which the native route multiplies in (a
    NaN result, as ``torch._scaled_mm``'s), so the result depended on the tuner's choice."""
    pt = panel.t()
    sp = split(epi, x.shape[0], pt.shape[1])
    assert not sp.tail  # (scales, bias and cast: all fused)
    cand = gemm.choose(x, pt, sp.spec, sp.operands)
    if not cand.is_anchor:
        cfg = Config(*(int(cand.param(f, d)) for f, d in _CONFIG_FIELDS))
        run = _native_panel(cfg, sp.spec)
        if not _panel_choice(x, panel, sp, cfg, run).is_anchor:
            try:
                return run(x, panel, sp.operands)
            except native.NativeError as e:
                native.note_fallback("block_scaled_mm", e)
    return gemm.mm_aten(x, pt, sp.spec, sp.operands)


def _native_panel(
    cfg: Config, spec: gemm.EpilogueSpec
) -> Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor]:
    def run(x: torch.Tensor, panel: torch.Tensor, ops: list[torch.Tensor]) -> torch.Tensor:
        # a bf16 panel (an inference tensor) is packed by the engine on each call, never cached
        packed = pack_rows(panel, cfg.nr) if panel.dtype == torch.float32 else None
        return run_native(x, panel.t(), spec, ops, cfg, packed=packed)

    return run


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    return agree(out, ref, 3e-2 if out.dtype == torch.bfloat16 else 1e-3)


def _panel_choice(
    x: torch.Tensor,
    panel: torch.Tensor,
    sp: Split,
    cfg: Config,
    run: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor],
) -> autotune.Candidate:
    m, k = x.shape
    key = {
        "m": bucket(m),
        "n": panel.shape[0],
        "k": k,
        "epilogue": sp.spec.encode(),
        "isa": native.cpu_info().isa,
        "cfg": cfg.name,
        "dtype": str(panel.dtype),
    }
    cands = [
        autotune.Candidate("aten", autotune.ATEN),
        autotune.Candidate(cfg.name, autotune.NATIVE),
    ]

    def factory(c: autotune.Candidate) -> Callable[..., torch.Tensor]:
        if c.is_anchor:
            return lambda x, p, ops: gemm.mm_aten(x, p.t(), sp.spec, ops)
        return run

    choice = autotune.select(
        "lowp_panel",
        key,
        cands,
        factory,
        lambda: (x, panel, sp.operands),
        cold=False,
        check=_close,
        confirm=True,
        budget_s=1.0,
    )
    label = f"M={key['m']} N={key['n']} K={k} [{key['epilogue'] or 'none'}] {cfg.name}"
    gemm.decisions[("lowp_panel", label)] = choice.candidate.name  # for reports (bench, demo)
    return choice.candidate


_CONFIG_FIELDS = (
    ("mr", 0),
    ("nr", 0),
    ("mc", 0),
    ("pf", 0),
    ("kc", 0),
    ("ks", 1),
    ("nt", 0),
    ("dp", 0),
)


def _dequant_rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a quantized weight, dequantized to float32 (native kernels)."""
    from torchport.lowp import fp8, mx, nvfp4
    from torchport.lowp.tensors import Float8Tensor, MXTensor, NVFP4Tensor

    if isinstance(w, NVFP4Tensor):
        return nvfp4.nvfp4_dequantize(w.qdata[lo:hi], w.scale[lo:hi], w.per_tensor_scale)
    if isinstance(w, MXTensor):
        return mx.mx_dequantize(w.qdata[lo:hi], w.scale[lo:hi], w.elem)
    if isinstance(w, Float8Tensor):
        s = w.scale[lo:hi] if w.scale.dim() else w.scale
        return fp8.fp8_dequantize(w.qdata[lo:hi], s)
    raise LowPrecisionError(
        f"block_scaled_mm: weight must be a torchport.lowp tensor, got {type(w).__name__}"
    )


# smallest E8M0 scale byte whose products with every element value of the format are normal
# (so exact) in bfloat16: the smallest nonzero magnitude times 2**(e - 127) >= 2**-126
_MX_MIN_SCALE = {"fp4_e2m1": 2, "fp8_e4m3": 10, "fp8_e5m2": 17}


def _bf16_decoder(w: torch.Tensor) -> Callable[[int, int], tuple[torch.Tensor, list[Step]]] | None:
    """``decode16(lo, hi)`` for :class:`_Bf16`: rows ``lo:hi`` of ``w`` as exact bf16 values
    and the scale steps that finish them after the GEMM, or None where bf16 cannot hold them.

    NVFP4: E2M1 × E4M3 block scale (at most 2 + 4 significant bits, magnitudes from 2**-10 to
    2688), the per-tensor float32 scale after. MX: E2M1/E4M3/E5M2 × E8M0 (a power of two) is
    exact unless a scale is so small that a product falls below bf16's normal range (checked on
    the scale bytes). FP8: the raw E4M3/E5M2 values, the float32 scale after (per row of ``w``:
    a column scale of the result)."""
    from torchport.lowp.tensors import Float8Tensor, MXTensor, NVFP4Tensor

    n, k = w.shape
    if isinstance(w, NVFP4Tensor):
        pts = w.per_tensor_scale
        col = None if pts is None else torch.full((n,), float(pts))

        def nv(lo: int, hi: int) -> tuple[torch.Tensor, list[Step]]:
            ws = panel_workspace(hi - lo, k)
            panel = decode_rows_bf16(w.qdata[lo:hi], w.scale[lo:hi], "fp4_e2m1", "e4m3", 16, out=ws)
            return panel, [] if col is None else [gemm.Scale(col[lo:hi], "col")]

        return nv
    if isinstance(w, MXTensor):
        elem = w.elem
        if elem not in _MX_MIN_SCALE or w.scale.numel() == 0:
            return None
        if int(w.scale.view(torch.uint8).min()) < _MX_MIN_SCALE[elem]:
            return None

        def mx(lo: int, hi: int) -> tuple[torch.Tensor, list[Step]]:
            ws = panel_workspace(hi - lo, k)
            return decode_rows_bf16(w.qdata[lo:hi], w.scale[lo:hi], elem, "e8m0", 32, out=ws), []

        return mx
    if isinstance(w, Float8Tensor):
        fmt = "fp8_e4m3" if w.qdata.dtype == torch.float8_e4m3fn else "fp8_e5m2"
        scale = w.scale.float().reshape(-1).expand(n)

        def f8(lo: int, hi: int) -> tuple[torch.Tensor, list[Step]]:
            ws = panel_workspace(hi - lo, k)
            panel = decode_rows_bf16(w.qdata[lo:hi], None, fmt, out=ws)
            return panel, [gemm.Scale(scale[lo:hi], "col")]

        return f8
    return None


def block_scaled_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` for a quantized weight ``w [N, K]`` (NVFP4, MX or FP8).

    ``x``: a floating-point ``[..., K]`` tensor (float32/bfloat16; others are taken in float32) or
    a quantized activation tensor (dequantized first). Float32 accumulation; result in
    ``out_dtype`` (default ``x``'s dtype), one of :data:`OUT_DTYPES`.
    """
    from torchport.lowp.tensors import LowPrecisionTensor

    if isinstance(x, LowPrecisionTensor):
        x = x.dequantize()
    if not isinstance(w, LowPrecisionTensor) or w.dim() != 2:
        raise LowPrecisionError(
            f"block_scaled_mm: w must be a 2-D torchport.lowp tensor, got {type(w).__name__}"
        )
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        # an integer x would give an integer result: the float32 product truncated
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise LowPrecisionError(f"block_scaled_mm: x must be a floating-point tensor, got {got}")
    n, k = w.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise LowPrecisionError(
            f"block_scaled_mm: x's last dimension must be K={k}, got {tuple(x.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise LowPrecisionError(
            f"block_scaled_mm: bias must have shape ({n},), got {tuple(bias.shape)}"
        )
    # (a meta bias's in-place add left the output as it was: the bias silently dropped)
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if t is not None and t.device.type != "cpu":
            raise LowPrecisionError(f"block_scaled_mm: {name} must be on cpu, got {t.device}")
    od = out_dtype or x.dtype
    if od not in OUT_DTYPES:
        raise LowPrecisionError(f"block_scaled_mm: out_dtype must be one of {OUT_DTYPES}, got {od}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()

    def decode(lo: int, hi: int) -> torch.Tensor:
        return _dequant_rows(w, lo, hi)

    eager = native.eager_fast_path(x2, *(() if bias is None else (bias,)))
    tag = f"{type(w).__name__}:{getattr(w, 'elem', '')}:{str(w.qdata.dtype).removeprefix('torch.')}"
    # the bf16 panels only for bf16 activations: a float32 x is never rounded to bf16
    dec16 = _bf16_decoder(w) if x.dtype == torch.bfloat16 and eager else None
    bf16 = None if dec16 is None else _Bf16(x.reshape(-1, k), dec16)
    out = _panel_gemm(x2, decode, n, k, lambda lo, hi: [], bias, od, eager, tag, bf16)
    return out.reshape(*lead, n).to(od)
