"""GEMM with a grouped-reduction epilogue: ``y = x @ W.T + bias`` emitted directly as the next
layer's quantized activations (NVFP4, MXFP4, MXFP8 or FP8 per row) plus their scales.

The epilogue runs per panel of ``y``: each panel (``M × panel`` columns for NVFP4/MX, sized to stay
in cache (≤ 4 MiB); whole-row panels for FP8's per-row amax) is produced by the float32 GEMM (MKL) into a reused
buffer and immediately reduced — per-group amax along N (16 for NVFP4, 32 for MX, the whole row for
FP8), scale, quantize, pack — by the native quantize kernel while it is still in cache. ``y`` exists only as that reused panel buffer, never as
a full tensor in memory, and no separate pass over DRAM is made for the quantization. Results match
:func:`linear_quantize_reference` (the whole float32 output, then the plain-torch quantizer) up to
the GEMM's own panel rounding: tests require ≥ 99% identical codes and dequantized outputs
within one quantization step.
"""

from __future__ import annotations

import torch

from torchport.lowp import fp8, mx, nvfp4
from torchport.lowp.formats import LowPrecisionError

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8")
GROUP = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32, "fp8": 1}
PANEL_BYTES = 4 << 20


def _quantize(
    y: torch.Tensor, fmt: str, pts: float | None, native_kernel: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "nvfp4":
        return nvfp4.nvfp4_quantize(y, pts, native_kernel=native_kernel)
    if fmt == "mxfp4":
        return mx.mx_quantize(y, "fp4_e2m1", native_kernel=native_kernel)
    if fmt == "mxfp8":
        return mx.mx_quantize(y, "fp8_e4m3", native_kernel=native_kernel)
    return fp8.fp8_quantize(y, torch.float8_e4m3fn, "row", native_kernel=native_kernel)


def _check(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, pts: float | None
) -> None:
    if fmt not in FORMATS:
        raise LowPrecisionError(f"linear_quantize: fmt must be one of {FORMATS}, got {fmt!r}")
    if pts is not None and fmt != "nvfp4":
        raise LowPrecisionError(
            f"linear_quantize: per_tensor_scale applies to fmt 'nvfp4' only, got {pts!r} with "
            f"fmt {fmt!r}"
        )
    nvfp4.check_per_tensor_scale(pts)
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise LowPrecisionError(
                f"linear_quantize: {name} must be a tensor, got {type(t).__name__}"
            )
        # (torch.mm(x, meta_w, out=y) and y += meta_bias leave y as it was on this build:
        # the codes of an uninitialised or bias-less y came back without an error)
        if t is not None and t.device.type != "cpu":
            raise LowPrecisionError(f"linear_quantize: {name} must be on cpu, got {t.device}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise LowPrecisionError(
            f"linear_quantize: x [M, K] and w [N, K] must agree on K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        raise LowPrecisionError(
            f"linear_quantize: x and w must be float32, got {x.dtype} and {w.dtype}"
        )
    if w.shape[0] % GROUP[fmt]:
        raise LowPrecisionError(
            f"linear_quantize: N must be a multiple of the group size {GROUP[fmt]} for {fmt}, got {w.shape[0]}"
        )
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise LowPrecisionError(
            f"linear_quantize: bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}"
        )


def linear_quantize_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fmt: str = "nvfp4",
    per_tensor_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two passes: ``y = x @ w.T + bias`` (float32), then the plain-torch quantizer on ``y``."""
    _check(x, w, bias, fmt, per_tensor_scale)
    y = x @ w.t()
    if bias is not None:
        y = y + bias
    return _quantize(y, fmt, per_tensor_scale, False)


def linear_quantize(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fmt: str = "nvfp4",
    per_tensor_scale: float | None = None,
    panel: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM + grouped-reduction epilogue → (quantized ``y`` data, scales) in one pass over ``y``.

    NVFP4/MX: ``y`` is produced in column panels of ``panel`` outputs (a multiple of the group
    size; default sized so an ``M × panel`` float32 panel stays in cache, ≤ 4 MiB), each quantized while hot;
    every weight row is read once. FP8 needs whole rows (per-row amax): row panels of ``panel``
    rows spanning all of N.
    """
    _check(x, w, bias, fmt, per_tensor_scale)
    # the outputs are codes, not differentiable: the operands' autograd history is not followed
    # (torch.mm's out= refuses inputs that require grad)
    x, w = x.detach(), w.detach()
    bias = None if bias is None else bias.detach()
    m, n = x.shape[0], w.shape[0]
    if panel is not None and panel < 1:
        raise LowPrecisionError(f"linear_quantize: panel must be ≥ 1, got {panel}")
    if m == 0 or n == 0:
        return _quantize(torch.empty(m, n), fmt, per_tensor_scale, None)
    wt = w.t()
    if fmt == "fp8":
        rows = panel or max(64, min(m, PANEL_BYTES * 16 // max(1, 4 * n)))
        q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, dtype=torch.float32)
        buf = torch.empty(min(rows, m), n, dtype=torch.float32)
        for lo in range(0, m, rows):
            hi = min(m, lo + rows)
            y = buf[: hi - lo]
            torch.mm(x[lo:hi], wt, out=y)
            if bias is not None:
                y += bias
            q[lo:hi], s[lo:hi] = _quantize(y, fmt, None, None)
        return q, s
    g = GROUP[fmt]
    cols = panel or max(g, (PANEL_BYTES // max(1, 4 * m)) // g * g)
    if cols % g:
        raise LowPrecisionError(
            f"linear_quantize: panel must be a multiple of the group size {g}, got {cols}"
        )
    packed = fmt in ("nvfp4", "mxfp4")
    q = torch.empty(m, n // 2 if packed else n, dtype=torch.uint8)
    s = torch.empty(m, n // g, dtype=torch.uint8)
    buf = torch.empty(m, min(cols, n), dtype=torch.float32)
    for lo in range(0, n, cols):
        hi = min(n, lo + cols)
        y = buf[:, : hi - lo] if hi - lo == buf.shape[1] else torch.empty(m, hi - lo)
        torch.mm(x, wt[:, lo:hi], out=y)
        if bias is not None:
            y += bias[lo:hi]
        qp, sp = _quantize(y, fmt, per_tensor_scale, None)
        if packed:
            q[:, lo // 2 : hi // 2] = qp
        else:
            q[:, lo:hi] = qp.view(torch.uint8)
        s[:, lo // g : hi // g] = sp.view(torch.uint8)
    if fmt == "nvfp4":
        return q, s.view(torch.float8_e4m3fn)
    if fmt == "mxfp8":
        return q.view(torch.float8_e4m3fn), s
    return q, s
