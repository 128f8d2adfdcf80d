"""Shared inputs of the GEMV tests: a weight packed in any GEMV format."""

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
