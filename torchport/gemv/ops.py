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

Reference: :func:`gemv_reference` (float64 product with the dequantized weight). Custom ops
``torchport::gemv_dense`` and ``torchport::gemv_packed`` (with fake implementations) serve
``torch.compile``/export; plain eager tensors call the kernel directly with pre-validated pointers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchport import config, native
from torchport.gemv.kernels import FORMATS, I8_FORMATS, gemv_i8_kernel, gemv_kernel

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

    def __post_init__(self) -> None:
        assert self.fmt in FORMATS, self.fmt
        assert self.data.is_contiguous() and self.scales.is_contiguous()


def pack_dense(w: torch.Tensor) -> PackedWeight:
    """Pack a plain float32/bfloat16 ``[N, K]`` weight (no copy when already contiguous)."""
    if w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
        raise GemvInputError(
            f"gemv: a dense weight must be a 2-D float32 or bfloat16 tensor, got {w.dtype} "
            f"shape {tuple(w.shape)}"
        )
    fmt = "f32" if w.dtype == torch.float32 else "bf16"
    return PackedWeight(fmt, w.detach().contiguous(), _EMPTY_U8, _EMPTY_F32, 1.0, *w.shape)


def gemv_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` in float64 with a dequantized ``w``, cast to ``x.dtype``."""
    out = x.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def check_activation(x: torch.Tensor, k: int) -> int:
    """Validate a decode activation; return its number of rows."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise GemvInputError(f"gemv: x must be a float32 or bfloat16 tensor, got {got}")
    if x.device.type != "cpu":
        raise GemvInputError(f"gemv: x must be on cpu, got {x.device}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise GemvInputError(
            f"gemv: x's last dimension must equal the weight's K={k}, got shape {tuple(x.shape)}"
        )
    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS:
        raise GemvInputError(
            f"gemv: x may have at most {MAX_ROWS} rows (decode shapes), got {rows} "
            f"(shape {tuple(x.shape)})"
        )
    return rows


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise GemvInputError(f"gemv: bias must have shape ({n},), got {tuple(bias.shape)}")


_KERNEL_CACHE: dict[tuple[str, bool, str], object] = {}


def _kernel_for(pw: PackedWeight) -> object:
    """The kernel serving ``pw`` under the current settings (memoised per format/mode/ISA)."""
    isa = native.cpu_info().isa
    int8 = pw.fmt in I8_FORMATS and pw.k % 32 == 0 and bool(config.get("gemv_fp4_int8"))
    key = (pw.fmt, int8, isa)
    kern = _KERNEL_CACHE.get(key)
    if kern is None:
        kern = gemv_i8_kernel(pw.fmt, isa) if int8 else gemv_kernel(pw.fmt, isa)
        _KERNEL_CACHE[key] = kern
    return kern


def _run(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call (inputs validated)."""
    rows = x.numel() // pw.k if pw.k else math.prod(x.shape[:-1])
    out_shape = (*x.shape[:-1], pw.n)
    if rows == 0 or pw.n == 0:
        return torch.zeros(out_shape, dtype=x.dtype)
    if pw.k == 0:
        out0 = torch.zeros(out_shape, dtype=torch.float32)
        return (out0 + bias.float() if bias is not None else out0).to(x.dtype)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    out = torch.empty(out_shape, dtype=torch.float32)
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
        kern = _kernel_for(pw)
    except native.NativeError as e:
        native.note_fallback("gemv", e)
        return _aten_fallback(xf, pw, b).reshape(out_shape).to(x.dtype)
    status = kern.call_unchecked(  # type: ignore[attr-defined]
        xf.data_ptr(),
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
        native.num_threads(),
    )
    if status:
        raise native.NativeError(f"gemv kernel {pw.fmt} failed with status {status}")
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


def _eager(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True if the kernel may be called directly (plain tensors or parameters, no autograd)."""
    if not native.eager_fast_path(x):
        return False
    if bias is None:
        return True
    return type(bias) in (torch.Tensor, torch.nn.Parameter) and not (
        bias.requires_grad and torch.is_grad_enabled()
    )


# --- custom ops (compile/export path) ------------------------------------------------------------


@torch.library.custom_op("torchport::gemv_dense", mutates_args=())
def gemv_dense_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Decode GEMV with a dense float32/bfloat16 weight."""
    return _run(x, pack_dense(w), bias)


@gemv_dense_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
) -> torch.Tensor:
    """Decode GEMV with a packed low-precision weight."""
    return _run(x, PackedWeight(fmt, data, scales, rowscale, pts, n, k), bias)


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
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def gemv_packed(
    x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode GEMV with a packed weight (validates x and bias, then calls the kernel)."""
    check_activation(x, pw.k)
    _check_bias(bias, pw.n)
    if _eager(x, bias):
        return _run(x, pw, bias)
    if pw.fmt in ("f32", "bf16"):
        return gemv_dense_op(x, pw.data, bias)
    return gemv_packed_op(x, pw.data, pw.scales, pw.rowscale, pw.pts, pw.fmt, pw.n, pw.k, bias)


def linear_decode(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Lean eager entry for quantized ``nn.Linear`` weights (the caller checked rows ≤ MAX_ROWS
    and the dtype); falls back to :func:`gemv_packed` for anything unusual."""
    if x.shape[-1] == pw.k and (bias is None or bias.shape == (pw.n,)) and _eager(x, bias):
        return _run(x, pw, bias)
    return gemv_packed(x, pw, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for decode shapes (≤ 8 rows) through the native GEMV.

    ``weight``: float32/bfloat16 ``[N, K]`` or a ``torchport.lowp`` quantized tensor.
    """
    pack = getattr(weight, "gemv_pack", None)
    pw = pack() if callable(pack) else pack_dense(weight)
    return gemv_packed(x, pw, bias)
