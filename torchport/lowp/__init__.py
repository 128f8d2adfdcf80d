"""Low-precision formats and GEMMs: FP8, NVFP4, MX; tensor types; ``quantize_``; scaled GEMM.

Formats (each with a plain-torch reference and a bit-exact native kernel): :mod:`.fp8`,
:mod:`.nvfp4`, :mod:`.mx`, element helpers in :mod:`.formats`. Tensor types in :mod:`.tensors`,
configs and ``quantize_`` in :mod:`.config`, ``scaled_mm``/``block_scaled_mm`` in
:mod:`.scaled_mm`, the grouped-reduction epilogue in :mod:`.epilogue`.
"""

from torchport.lowp.config import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    MXDynamicActivationMXWeightConfig,
    MXWeightOnlyConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4WeightOnlyConfig,
    QuantizeReport,
    quantize_,
)
from torchport.lowp.epilogue import linear_quantize, linear_quantize_reference
from torchport.lowp.formats import LowPrecisionError, NonFiniteInputError
from torchport.lowp.fp8 import (
    fp8_dequantize,
    fp8_quantize,
    fp8_quantize_activation,
    fp8_quantize_reference,
)
from torchport.lowp.mx import (
    mx_dequantize,
    mx_dequantize_reference,
    mx_quantize,
    mx_quantize_reference,
)
from torchport.lowp.nvfp4 import (
    nvfp4_dequantize,
    nvfp4_dequantize_reference,
    nvfp4_quantize,
    nvfp4_quantize_reference,
    per_tensor_amax_to_scale,
)
from torchport.lowp.scaled_mm import block_scaled_mm, scaled_mm, scaled_mm_reference
from torchport.lowp.tensors import Float8Tensor, LowPrecisionTensor, MXTensor, NVFP4Tensor

__all__ = [
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8Tensor",
    "Float8WeightOnlyConfig",
    "LowPrecisionError",
    "LowPrecisionTensor",
    "MXDynamicActivationMXWeightConfig",
    "MXTensor",
    "MXWeightOnlyConfig",
    "NVFP4DynamicActivationNVFP4WeightConfig",
    "NVFP4Tensor",
    "NVFP4WeightOnlyConfig",
    "NonFiniteInputError",
    "QuantizeReport",
    "block_scaled_mm",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_quantize_activation",
    "fp8_quantize_reference",
    "linear_quantize",
    "linear_quantize_reference",
    "mx_dequantize",
    "mx_dequantize_reference",
    "mx_quantize",
    "mx_quantize_reference",
    "nvfp4_dequantize",
    "nvfp4_dequantize_reference",
    "nvfp4_quantize",
    "nvfp4_quantize_reference",
    "per_tensor_amax_to_scale",
    "quantize_",
    "scaled_mm",
    "scaled_mm_reference",
]
