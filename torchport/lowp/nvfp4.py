"""NVFP4: FP4 E2M1 values in 16-element blocks along K with an E4M3 block scale (4.5 bits/weight).

Recipe: torchao ``prototype/mx_formats/nvfp4_tensor.py`` (``nvfp4_quantize``), bit-exact:

1. rows are viewed as 16-element blocks; ``amax`` per block in float32;
2. ``block_scale = amax / 6``; without a per-tensor scale it is clamped to
   ``[2**-6, 448]`` (``finfo(e4m3fn).tiny``, max) and cast to E4M3 (RNE); with a per-tensor
   float32 scale ``pts`` the clamp/cast applies to ``block_scale / pts`` and the total scale is
   ``pts * e4m3_value``;
3. data = ``x / total_scale`` (IEEE division), clamped to ±6, rounded RNE to E2M1 and packed two per
   byte (element ``2i`` in the low nibble).

Dequantize: ``e2m1_value * (pts *) e4m3_value`` in float32. K must be a multiple of 16 (not padded);
NaN/Inf inputs raise :class:`~torchport.lowp.formats.NonFiniteInputError`.
:func:`per_tensor_amax_to_scale` is torchao's ``amax / (448 * 6)``.
"""

from __future__ import annotations

import math
import numbers

import torch

from torchport import native
from torchport.lowp import kernels
from torchport.lowp._common import as_rows, raise_nonfinite, use_native
from torchport.lowp.formats import (
    E4M3_TINY,
    F4_E2M1_MAX,
    F8E4M3_MAX,
    LowPrecisionError,
    check_finite,
    e2m1_to_f32,
    f32_to_e2m1,
    pack_fp4,
    unpack_fp4,
)

BLOCK = 16


def per_tensor_amax_to_scale(amax: torch.Tensor | float) -> float:
    """Per-tensor scale for two-level NVFP4 scaling: ``amax / (448 * 6)`` in float32."""
    return float(per_tensor_amax_to_scale_tensor(amax))


def per_tensor_amax_to_scale_tensor(amax: torch.Tensor | float) -> torch.Tensor:
    """:func:`per_tensor_amax_to_scale` as a 0-d float32 tensor: nothing reads its value, so a
    traced graph computes it at run time (as a float it became a graph constant)."""
    return torch.as_tensor(amax, dtype=torch.float32) / (F8E4M3_MAX * F4_E2M1_MAX)


def check_per_tensor_scale(pts: float | None) -> None:
    """Raise unless ``pts`` is None or a positive finite real number (not a bool)."""
    # any real number (NumPy's included) but a bool (True would be read as a scale of 1.0)
    ok = isinstance(pts, numbers.Real) and not isinstance(pts, bool)
    # checked as the float32 the kernels use: 1e39 would be inf there, 1e-50 zero
    if ok and pts is not None:
        try:
            f32 = float(torch.tensor(float(pts), dtype=torch.float32))
        except OverflowError:  # (an int past float's range)
            f32 = math.inf
        ok = 0 < f32 < math.inf
    if pts is not None and not ok:
        raise LowPrecisionError(
            "per_tensor_scale must be a positive finite number (nonzero and finite as "
            f"float32), got {pts!r}"
        )


def nvfp4_quantize_reference(
    x: torch.Tensor, per_tensor_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch NVFP4 quantization → (packed uint8 ``[..., K/2]``, float8_e4m3fn ``[..., K/16]``)."""
    rows = as_rows(x, BLOCK, "nvfp4_quantize")
    check_per_tensor_scale(per_tensor_scale)
    return _quantize_rows(rows, tuple(x.shape[:-1]), per_tensor_scale)


def nvfp4_quantize_traced(
    x: torch.Tensor, per_tensor_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_quantize_reference` with the per-tensor scale a 0-d float32 tensor, for an
    activation traced by ``torch.compile`` / ``torch.export``, whose scale the graph computes
    from its amax at run time. The scale is not checked (its value is unknown): the caller
    makes it positive and finite."""
    rows = as_rows(x, BLOCK, "nvfp4_quantize")
    return _quantize_rows(rows, tuple(x.shape[:-1]), per_tensor_scale)


def _quantize_rows(
    rows: torch.Tensor, lead: tuple[int, ...], per_tensor_scale: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_finite(rows, "nvfp4_quantize")
    k = rows.shape[1]
    blocks = rows.float().reshape(rows.shape[0], k // BLOCK, BLOCK)
    block_scale = blocks.abs().amax(dim=-1) / F4_E2M1_MAX
    if per_tensor_scale is None:
        s8 = torch.clamp(block_scale, min=E4M3_TINY, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
        total = s8.float()
    else:
        pts = torch.as_tensor(per_tensor_scale, dtype=torch.float32)
        s8 = torch.clamp(block_scale / pts, min=E4M3_TINY, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
        total = pts * s8.float()
    data = torch.clamp(blocks / total.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    q = pack_fp4(f32_to_e2m1(data.reshape(rows.shape[0], k)))
    return q.reshape(*lead, k // 2), s8.reshape(*lead, k // BLOCK)


def nvfp4_quantize(
    x: torch.Tensor, per_tensor_scale: float | None = None, *, native_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization (native kernel, bit-exact with :func:`nvfp4_quantize_reference`)."""
    if not use_native(native_kernel, x):
        return nvfp4_quantize_reference(x, per_tensor_scale)
    rows = as_rows(x, BLOCK, "nvfp4_quantize")
    check_per_tensor_scale(per_tensor_scale)
    r, k = rows.shape
    q = torch.empty(r, k // 2, dtype=torch.uint8)
    s = torch.empty(r, k // BLOCK, dtype=torch.uint8)
    pts = float(per_tensor_scale) if per_tensor_scale is not None else 1.0
    status = kernels.run(
        "tp_nvfp4_quant",
        rows.dtype,
        rows,
        q,
        s,
        r,
        k,
        pts,
        int(per_tensor_scale is not None),
        native.num_threads(),
    )
    if status:
        raise_nonfinite("nvfp4_quantize", rows)
    lead = tuple(x.shape[:-1])
    return q.reshape(*lead, k // 2), s.view(torch.float8_e4m3fn).reshape(*lead, k // BLOCK)


def _check_packed(q: torch.Tensor, scales: torch.Tensor, block: int, what: str) -> int:
    if q.dtype != torch.uint8 or q.dim() < 1:
        raise LowPrecisionError(f"{what}: packed data must be uint8 with ≥ 1 dim, got {q.dtype}")
    k = q.shape[-1] * 2
    if k % block:  # (the kernels would read or write past the rows' last block)
        raise LowPrecisionError(
            f"{what}: K (twice the packed last dimension) must be a multiple of the block size "
            f"{block} (no padding is done), got {k}"
        )
    want = (*q.shape[:-1], k // block)
    if tuple(scales.shape) != want:
        raise LowPrecisionError(f"{what}: scales must have shape {want}, got {tuple(scales.shape)}")
    if scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
        # the kernel reads one byte per scale: other dtypes' values would be misread
        raise LowPrecisionError(
            f"{what}: scales must be float8_e4m3fn (or its uint8 bytes), got {scales.dtype}"
        )
    return k


def nvfp4_dequantize_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    per_tensor_scale: float | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch NVFP4 dequantization to ``dtype`` (computed in float32; ``per_tensor_scale``
    may be a 0-d float32 tensor, as :func:`nvfp4_quantize_traced` takes)."""
    k = _check_packed(q, scales, BLOCK, "nvfp4_dequantize")
    vals = e2m1_to_f32(unpack_fp4(q)).reshape(*q.shape[:-1], k // BLOCK, BLOCK)
    s = scales.view(torch.float8_e4m3fn).float()
    if per_tensor_scale is not None:
        s = torch.as_tensor(per_tensor_scale, dtype=torch.float32) * s
    return (vals * s.unsqueeze(-1)).reshape(*q.shape[:-1], k).to(dtype)


def nvfp4_dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    per_tensor_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    native_kernel: bool | None = None,
) -> torch.Tensor:
    """NVFP4 dequantization (native kernel, bit-exact with the reference)."""
    if not use_native(native_kernel, q):
        return nvfp4_dequantize_reference(q, scales, per_tensor_scale, dtype)
    k = _check_packed(q, scales, BLOCK, "nvfp4_dequantize")
    r = math.prod(q.shape[:-1])  # (not -1: ambiguous where K = 0)
    q2 = q.reshape(r, k // 2).contiguous()
    s2 = scales.view(torch.uint8).reshape(r, k // BLOCK).contiguous()
    out = torch.empty(q2.shape[0], k, dtype=torch.float32)
    pts = float(per_tensor_scale) if per_tensor_scale is not None else 1.0
    kernels.run(
        "tp_block_dequant", torch.float32, q2, s2, out, q2.shape[0], k, 0, pts, native.num_threads()
    )
    return out.reshape(*q.shape[:-1], k).to(dtype)
