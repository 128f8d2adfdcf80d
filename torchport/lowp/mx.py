"""MX formats (OCP Microscaling v1.0): 32-element blocks along K sharing one E8M0 scale.

Element types: MXFP4 (E2M1, packed two per byte, element ``2i`` in the low nibble), MXFP8 E4M3FN
and MXFP8 E5M2. Recipe: torchao ``prototype/mx_formats/mx_tensor.py`` ``to_mx`` with its default
``ScaleCalculationMode.FLOOR``, bit-exact:

1. ``amax`` of each block in float32;
2. ``e = clamp(floor_log2(amax) - emax_elem, -127, 128) + 127`` where ``floor_log2`` is the
   unbiased float32 exponent field (zero/subnormal amax → -127) and ``emax_elem`` is 2 (E2M1),
   8 (E4M3) or 15 (E5M2);
3. data = ``x * 2**(127 - e)`` (exact power-of-two multiply, ``2**-127`` when ``e = 254``), then
   E2M1 RNE with saturation, or clamp to ±max and RNE cast to FP8.

Dequantize: ``element_value * 2**(e - 127)`` in float32. K must be a multiple of 32 (not padded);
NaN/Inf inputs raise :class:`~torchport.lowp.formats.NonFiniteInputError` (torchao would emit the
NaN scale 0xFF instead).
"""

from __future__ import annotations

import math

import torch

from torchport import native
from torchport.lowp import kernels
from torchport.lowp._common import as_rows, raise_nonfinite, use_native
from torchport.lowp.formats import (
    FP8_MAX,
    LowPrecisionError,
    check_finite,
    e2m1_to_f32,
    e8m0_to_f32,
    f32_to_e2m1,
    pack_fp4,
    unpack_fp4,
)

BLOCK = 32
ELEMS = ("fp4_e2m1", "fp8_e4m3", "fp8_e5m2")
_CODE = {"fp4_e2m1": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
_EMAX = {"fp4_e2m1": 2, "fp8_e4m3": 8, "fp8_e5m2": 15}
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _check_elem(elem: str) -> None:
    if elem not in ELEMS:
        raise LowPrecisionError(f"elem must be one of {ELEMS}, got {elem!r}")


def mx_quantize_reference(
    x: torch.Tensor, elem: str = "fp4_e2m1"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch MX quantization → (data, E8M0 scales ``[..., K/32]`` as uint8).

    Data is packed uint8 ``[..., K/2]`` for FP4, float8 ``[..., K]`` for FP8.
    """
    _check_elem(elem)
    rows = as_rows(x, BLOCK, "mx_quantize")
    check_finite(rows, "mx_quantize")
    lead, k = tuple(x.shape[:-1]), rows.shape[1]
    blocks = rows.float().reshape(rows.shape[0], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - _EMAX[elem]
    e = (torch.clamp(exp, -127, 128) + 127).to(torch.uint8)
    rb = (254 - e.to(torch.int32)).to(torch.uint8)
    inv = torch.where(
        rb == 0, torch.tensor(0x00400000, dtype=torch.int32), rb.to(torch.int32) << 23
    )
    data = blocks * inv.view(torch.float32).unsqueeze(-1)
    if elem == "fp4_e2m1":
        q = pack_fp4(f32_to_e2m1(data.reshape(rows.shape[0], k))).reshape(*lead, k // 2)
    else:
        m = FP8_MAX[_FP8[elem]]
        q = torch.clamp(data, -m, m).to(_FP8[elem]).reshape(*lead, k)
    return q, e.reshape(*lead, k // BLOCK)


def mx_quantize(
    x: torch.Tensor, elem: str = "fp4_e2m1", *, native_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantization (native kernel, bit-exact with :func:`mx_quantize_reference`)."""
    if not use_native(native_kernel, x):
        return mx_quantize_reference(x, elem)
    _check_elem(elem)
    rows = as_rows(x, BLOCK, "mx_quantize")
    r, k = rows.shape
    fp4 = elem == "fp4_e2m1"
    q = torch.empty(r, k // 2 if fp4 else k, dtype=torch.uint8)
    s = torch.empty(r, k // BLOCK, dtype=torch.uint8)
    if kernels.run("tp_mx_quant", rows.dtype, rows, q, s, r, k, _CODE[elem], native.num_threads()):
        raise_nonfinite("mx_quantize", rows)
    lead = tuple(x.shape[:-1])
    if fp4:
        return q.reshape(*lead, k // 2), s.reshape(*lead, k // BLOCK)
    return q.view(_FP8[elem]).reshape(*lead, k), s.reshape(*lead, k // BLOCK)


def _k_of(q: torch.Tensor, scales: torch.Tensor, elem: str) -> int:
    _check_elem(elem)
    if q.dim() < 1:
        raise LowPrecisionError("mx_dequantize: data must have at least 1 dimension")
    if elem == "fp4_e2m1" and q.dtype != torch.uint8:
        raise LowPrecisionError(f"mx_dequantize: fp4 data must be packed uint8, got {q.dtype}")
    if elem != "fp4_e2m1" and q.dtype not in (_FP8[elem], torch.uint8):
        raise LowPrecisionError(f"mx_dequantize: {elem} data must be {_FP8[elem]}, got {q.dtype}")
    k = q.shape[-1] * (2 if elem == "fp4_e2m1" else 1)
    want = (*q.shape[:-1], k // BLOCK)
    if k % BLOCK or tuple(scales.shape) != want:
        raise LowPrecisionError(
            f"mx_dequantize: scales must have shape {want}, got {tuple(scales.shape)}"
        )
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        # the kernel reads one byte per scale: other dtypes' values would be misread
        raise LowPrecisionError(
            f"mx_dequantize: scales must be E8M0 bytes (uint8 or float8_e8m0fnu), got {scales.dtype}"
        )
    return k


def mx_dequantize_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    elem: str = "fp4_e2m1",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch MX dequantization to ``dtype`` (computed in float32)."""
    k = _k_of(q, scales, elem)
    if elem == "fp4_e2m1":
        vals = e2m1_to_f32(unpack_fp4(q))
    else:
        vals = q.view(_FP8[elem]).float()
    vals = vals.reshape(*q.shape[:-1], k // BLOCK, BLOCK)
    return (vals * e8m0_to_f32(scales).unsqueeze(-1)).reshape(*q.shape[:-1], k).to(dtype)


def mx_dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    elem: str = "fp4_e2m1",
    dtype: torch.dtype = torch.float32,
    *,
    native_kernel: bool | None = None,
) -> torch.Tensor:
    """MX dequantization (native kernel, bit-exact with the reference)."""
    if not use_native(native_kernel, q):
        return mx_dequantize_reference(q, scales, elem, dtype)
    k = _k_of(q, scales, elem)
    r = math.prod(q.shape[:-1])  # (not -1: ambiguous where K = 0)
    q2 = q.view(torch.uint8).reshape(r, q.shape[-1]).contiguous()
    s2 = scales.view(torch.uint8).reshape(r, k // BLOCK).contiguous()
    out = torch.empty(q2.shape[0], k, dtype=torch.float32)
    fmt = {"fp4_e2m1": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}[elem]
    kernels.run(
        "tp_block_dequant",
        torch.float32,
        q2,
        s2,
        out,
        q2.shape[0],
        k,
        fmt,
        1.0,
        native.num_threads(),
    )
    return out.reshape(*q.shape[:-1], k).to(dtype)
