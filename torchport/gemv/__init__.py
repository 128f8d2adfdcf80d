"""Decode GEMV: ``[B, 1, K]`` / ``[1, K]`` activations against fp32, bf16, FP8, NVFP4 and MX weights.

Weights are read in their storage format and decoded in registers (see
:mod:`torchport.gemv.kernels`); ``torchport.compile`` routes decode-shaped ``linear`` calls here
(:mod:`torchport.gemv.routing`) and quantized ``nn.Linear`` weights use it in eager mode.
"""

from torchport.gemv.kernels import FORMATS
from torchport.gemv.ops import (
    MAX_ROWS,
    GemvInputError,
    PackedWeight,
    gemv,
    gemv_packed,
    gemv_reference,
    pack_dense,
)

__all__ = [
    "FORMATS",
    "MAX_ROWS",
    "GemvInputError",
    "PackedWeight",
    "gemv",
    "gemv_packed",
    "gemv_reference",
    "pack_dense",
]

from torchport.gemv.routing import GEMV_ROUTING  # registers the compiler pass

__all__ += ["GEMV_ROUTING"]
