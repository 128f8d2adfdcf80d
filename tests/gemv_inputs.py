"""Shared inputs and checks of the GEMV tests: a weight packed in any GEMV format, a kernel call,
the int8-activation error bound."""

from __future__ import annotations

import torch

from torchport.gemv import ops as gops
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor


def pack(fmt: str, w: torch.Tensor) -> gops.PackedWeight:
    """``w`` quantized to ``fmt`` (nvfp4, mxfp4, fp8_e4m3) or kept dense (bf16, f32), packed."""
    if fmt == "nvfp4":
        return NVFP4Tensor.from_float(w).gemv_pack()
    if fmt == "mxfp4":
        return MXTensor.from_float(w).gemv_pack()
    if fmt == "fp8_e4m3":
        return Float8Tensor.from_float(w).gemv_pack()
    return gops.pack_dense(w.to(torch.bfloat16 if fmt == "bf16" else torch.float32))


def run(kern, x: torch.Tensor, pw: gops.PackedWeight, bias=None, threads: int = 2) -> torch.Tensor:
    """``kern`` on activations ``x`` [B, K] and packed weight ``pw``: the [B, N] result."""
    out = torch.empty(x.shape[0], pw.n)
    gops._launch(kern, x, pw, bias, out, threads)
    return out


def int8_bound(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """The error bound of int8-quantized activations (per 32 elements, amax/127, round to
    nearest) against dequantized weights ``wd``: ``Σ_k |w_k| · amax_g(k) / 254``."""
    b, k = x.shape
    g = x.reshape(b, k // 32, 32).abs().amax(-1, keepdim=True).expand(b, k // 32, 32)
    return (g.reshape(b, k) / 254).double() @ wd.double().abs().T


def check_tiny_groups(kern, fmt: str) -> None:
    """An int8-activation FP4 kernel on activation groups with amax below 2^-64 (subnormal ones
    included), which take the scalar quantizer: within the int8 bound (plus the subnormal scale's
    rounding) of the float64 reference, and no group flushed to zero."""
    g = torch.Generator().manual_seed(11)
    pw = pack(fmt, torch.randn(5, 256, generator=g))
    x = torch.randn(2, 256, generator=g)
    x[0] *= 1e-38
    x[1, 32:64] *= 1e-41
    wd = gops.dequantize_packed(pw)
    ref = gops.gemv_reference(x.double(), wd)
    tol = int8_bound(x, wd) * 1.001 + wd.double().abs().sum(1) * 127 * 2.0**-149
    out = run(kern, x, pw, threads=1)
    assert bool(((out.double() - ref).abs() <= tol).all())
    assert bool((out != 0).all())


def check_float_bound(out: torch.Tensor, x: torch.Tensor, pw: gops.PackedWeight, bias=None) -> None:
    """``out`` against the float64 product of ``x`` with ``pw``'s weight (dequantized; dense as
    it is), within the float kernels' tolerance ``1e-5 · Σ|x·w|`` (plus 1e-30: the pair dot's
    flushing of values below 2⁻¹²⁶)."""
    w = pw.data.double() if pw.fmt in ("f32", "bf16") else gops.dequantize_packed(pw).double()
    ref = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    err = (out.double() - ref).abs()
    assert bool((err <= 1e-5 * mag + 1e-30).all()), float((err / (mag + 1e-300)).max())


def only_native_kernel(monkeypatch, kernel: str) -> None:
    """Make the GEMV tuner's candidate lists the ATen anchor and the first candidate of native
    kernel ``kernel`` (plans cleared): a test then gets that kernel's plan deterministically."""
    full = gops.candidates

    def only(fmt, int8=False, k=None, bx=False, rows=None):
        cands = full(fmt, int8, k, bx, rows)
        return [cands[0], *[c for c in cands if c.param("kernel") == kernel][:1]]

    monkeypatch.setattr(gops, "candidates", only)
    gops._PLANS.clear()
