"""FP8 (E4M3FN / E5M2) quantization with a per-tensor or per-row float32 scale.

Recipe: torchao's float8 inference recipe (``_choose_scale_float8`` + ``_quantize_affine_float8``)
with the amax computed in float32: ``scale = max(amax, 1e-12) / fp8_max``; data =
``clamp(x / scale, ±fp8_max)`` cast with round-to-nearest-even. Dequantize: ``fp8_value * scale``.
(torchao computes a bfloat16 input's ``amax / 448`` in bfloat16; here inputs are widened to float32
first.) NaN/Inf inputs raise :class:`~torchport.lowp.formats.NonFiniteInputError`, except in
:func:`fp8_quantize_activation` (run-time activations), which keeps torchao's arithmetic for them.
"""

from __future__ import annotations

import torch

from torchport import native
from torchport.lowp import kernels
from torchport.lowp._common import as_rows, raise_nonfinite, use_native
from torchport.lowp.formats import (
    FP8_DTYPES,
    FP8_MAX,
    LowPrecisionError,
    NonFiniteInputError,
    check_finite,
)

GRANULARITIES = ("tensor", "row")
AMAX_FLOOR = 1e-12


def _check(dtype: torch.dtype, granularity: str) -> None:
    if dtype not in FP8_DTYPES:
        raise LowPrecisionError(f"fp8 dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if granularity not in GRANULARITIES:
        raise LowPrecisionError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def fp8_quantize_reference(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch FP8 quantization → (fp8 data like ``x``, float32 scale: ``[]`` or ``[..., 1]``)."""
    _check(dtype, granularity)
    rows = as_rows(x, 1, "fp8_quantize").float()
    check_finite(rows, "fp8_quantize")
    return _scale_and_cast(rows, x.shape, dtype, granularity)


def _scale_and_cast(
    rows: torch.Tensor, shape: torch.Size, dtype: torch.dtype, granularity: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's arithmetic on float32 ``rows`` ``[R, K]`` (of an input of ``shape``)."""
    m = FP8_MAX[dtype]
    if granularity == "row":
        amax = (
            rows.abs().amax(dim=1, keepdim=True)
            if rows.shape[1]
            else rows.new_zeros(rows.shape[0], 1)
        )
        scale = torch.clamp(amax, min=AMAX_FLOOR) / m
    else:
        amax = rows.abs().max() if rows.numel() else rows.new_zeros(())
        scale = torch.clamp(amax, min=AMAX_FLOOR) / m
    q = torch.clamp(rows / scale, -m, m).to(dtype).reshape(shape)
    if granularity == "row":
        return q, scale.reshape(*shape[:-1], 1)
    return q, scale.reshape(())


def fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "row",
    *,
    native_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization (native kernel, bit-exact with :func:`fp8_quantize_reference`)."""
    if not use_native(native_kernel, x):
        return fp8_quantize_reference(x, dtype, granularity)
    _check(dtype, granularity)
    rows = as_rows(x, 1, "fp8_quantize")
    r, k = rows.shape
    q = torch.empty(r, k, dtype=torch.uint8)
    if granularity == "row":
        scale = torch.empty(r, dtype=torch.float32)
    else:
        check_finite(rows, "fp8_quantize")
        amax = rows.abs().max().float() if rows.numel() else torch.zeros((), dtype=torch.float32)
        scale = (torch.clamp(amax, min=AMAX_FLOOR) / FP8_MAX[dtype]).reshape(1)
    e5 = int(dtype == torch.float8_e5m2)
    if kernels.run(
        "tp_fp8_quant",
        rows.dtype,
        rows,
        q,
        scale,
        r,
        k,
        e5,
        int(granularity == "row"),
        native.num_threads(),
    ):
        raise_nonfinite("fp8_quantize", rows)
    q8 = q.view(dtype).reshape(x.shape)
    if granularity == "row":
        return q8, scale.reshape(*x.shape[:-1], 1)
    return q8, scale.reshape(())


def fp8_quantize_activation(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization of a run-time activation, as torchao's dynamic-activation recipe does it.

    Finite input: :func:`fp8_quantize`'s result (its native kernel where it applies). NaN or
    infinite input is not rejected: the recipe's arithmetic runs on it, as torchao's
    (``_choose_scale_float8`` then ``_quantize_affine_float8``, no finiteness check): a row
    (``"row"``) or the tensor (``"tensor"``) holding a NaN gets a NaN scale, one holding an
    infinity an infinite scale and a NaN code there (``inf / inf``), so its dequantized values,
    and every product of them that ``torch._scaled_mm`` or a GEMV forms, are NaN. Other rows
    are quantized as they would be alone. Traceable (``torch.compile``, export, ``vmap``): no
    data-dependent check."""
    if use_native(None, x):
        try:
            return fp8_quantize(x, dtype, granularity, native_kernel=True)
        except NonFiniteInputError:
            pass  # the recipe's arithmetic below, which keeps the NaN and infinities
    _check(dtype, granularity)
    rows = as_rows(x, 1, "fp8_quantize").float()
    return _scale_and_cast(rows, x.shape, dtype, granularity)


def fp8_dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``fp8_value * scale`` (scale broadcastable: ``[]`` or ``[..., 1]``) in float32, then ``dtype``."""
    if q.dtype not in FP8_DTYPES:
        raise LowPrecisionError(f"fp8_dequantize: data must be float8, got {q.dtype}")
    rowwise = (*q.shape[:-1], 1)
    if tuple(scale.shape) not in ((), (1,), rowwise):
        # a [N] scale would broadcast along K, scaling columns instead of rows
        raise LowPrecisionError(
            "fp8_dequantize: scale must have shape () or (1,) (tensor-wise) or "
            f"{rowwise} (row-wise), got {tuple(scale.shape)}"
        )
    return (q.float() * scale.float()).to(dtype)
