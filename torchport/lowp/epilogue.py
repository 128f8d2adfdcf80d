"""GEMM with a grouped-reduction epilogue: ``y = x @ W.T + bias`` emitted directly as the next
layer's quantized activations (NVFP4, MXFP4, MXFP8 or FP8 per row) plus their scales.

The epilogue runs per row panel of ``y``: each panel (``panel_rows × N`` float32, sized to stay in
L2) is produced by the float32 GEMM into a reused buffer and immediately reduced — per-group amax
along N (16 for NVFP4, 32 for MX, the whole row for FP8), scale, quantize, pack — by the native
quantize kernel while it is still in cache. The full-precision ``y`` is never written to memory,
and no separate pass over it is made. Results match
:func:`linear_quantize_reference` (the whole float32 output, then the plain-torch quantizer) up to
the GEMM's own row-panel rounding: tests require ≥ 99% identical codes and dequantized outputs
within one quantization step.
"""

from __future__ import annotations

import torch

from torchport.lowp import fp8, mx, nvfp4
from torchport.lowp.formats import LowPrecisionError

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8")
GROUP = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32, "fp8": 1}
PANEL_BYTES = 512 << 10


def _quantize(y: torch.Tensor, fmt: str, pts: float | None, native_kernel: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "nvfp4":
        return nvfp4.nvfp4_quantize(y, pts, native_kernel=native_kernel)
    if fmt == "mxfp4":
        return mx.mx_quantize(y, "fp4_e2m1", native_kernel=native_kernel)
    if fmt == "mxfp8":
        return mx.mx_quantize(y, "fp8_e4m3", native_kernel=native_kernel)
    return fp8.fp8_quantize(y, torch.float8_e4m3fn, "row", native_kernel=native_kernel)


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> None:
    if fmt not in FORMATS:
        raise LowPrecisionError(f"linear_quantize: fmt must be one of {FORMATS}, got {fmt!r}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise LowPrecisionError(
            f"linear_quantize: x [M, K] and w [N, K] must agree on K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        raise LowPrecisionError(f"linear_quantize: x and w must be float32, got {x.dtype} and {w.dtype}")
    if w.shape[0] % GROUP[fmt]:
        raise LowPrecisionError(
            f"linear_quantize: N must be a multiple of the group size {GROUP[fmt]} for {fmt}, got {w.shape[0]}"
        )
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise LowPrecisionError(f"linear_quantize: bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}")


def linear_quantize_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, fmt: str = "nvfp4",
    per_tensor_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two passes: ``y = x @ w.T + bias`` (float32), then the plain-torch quantizer on ``y``."""
    _check(x, w, bias, fmt)
    y = x @ w.t()
    if bias is not None:
        y = y + bias
    return _quantize(y, fmt, per_tensor_scale, False)


def linear_quantize(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, fmt: str = "nvfp4",
    per_tensor_scale: float | None = None, panel_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM + grouped-reduction epilogue → (quantized ``y`` data, scales) in one pass over ``y``."""
    _check(x, w, bias, fmt)
    m, n = x.shape[0], w.shape[0]
    if panel_rows is None:
        panel_rows = max(8, min(256, PANEL_BYTES // max(1, 4 * n)))
    if panel_rows < 1:
        raise LowPrecisionError(f"linear_quantize: panel_rows must be ≥ 1, got {panel_rows}")
    wt = w.t()
    buf = torch.empty(min(panel_rows, max(m, 1)), n, dtype=torch.float32)
    qs: list[torch.Tensor] = []
    ss: list[torch.Tensor] = []
    for lo in range(0, m, panel_rows):
        hi = min(m, lo + panel_rows)
        y = buf[: hi - lo]
        torch.mm(x[lo:hi], wt, out=y)
        if bias is not None:
            y += bias
        q, s = _quantize(y, fmt, per_tensor_scale, None)
        qs.append(q)
        ss.append(s)
    if not qs:
        return _quantize(torch.empty(0, n), fmt, per_tensor_scale, None)
    return torch.cat(qs), torch.cat(ss)
