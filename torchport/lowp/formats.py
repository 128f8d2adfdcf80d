"""Element formats: FP8 (E4M3FN, E5M2), FP4 (E2M1, two per byte) and E8M0 scales — references.

Plain-torch references that every native kernel in :mod:`torchport.lowp` must match bit for bit.

- **FP8** casts follow torchao's recipe: clamp to ``±max`` (448 for E4M3FN, 57344 for E5M2), then
  ``Tensor.to(float8_*)`` (round to nearest, ties to even). Saturating, so no Inf is ever produced.
- **E2M1** (``f32_to_e2m1``) rounds to nearest, ties to even, saturates at ±6 and keeps the sign of
  zero (``-0.1`` → code ``0x8``), exactly as torchao's ``f32_to_f4_unpacked``. Codes: bit 3 sign,
  bits 2..1 exponent (bias 1), bit 0 mantissa; values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- **Packing**: two E2M1 codes per byte, element ``2i`` in the low nibble, ``2i+1`` in the high one.
- **E8M0**: unsigned exponent byte ``e`` meaning ``2**(e - 127)``; ``0xFF`` is NaN.

Non-finite inputs: quantizers in this package reject NaN/Inf with :class:`NonFiniteInputError`
(documented policy; torchao instead propagates NaN into a block's scale).
"""

from __future__ import annotations

import torch

F8E4M3_MAX = 448.0
F8E5M2_MAX = 57344.0
F4_E2M1_MAX = 6.0
E4M3_TINY = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny: the NVFP4 block-scale floor
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: F8E4M3_MAX, torch.float8_e5m2: F8E5M2_MAX}
# The 16 E2M1 values by code (bit 3 = sign).
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


class LowPrecisionError(ValueError):
    """An input to a low-precision format routine does not meet its requirements."""


class NonFiniteInputError(LowPrecisionError):
    """A tensor to quantize holds NaN or Inf (rejected: no format here encodes them faithfully)."""


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteInputError` if ``x`` holds NaN or Inf.

    While traced (``torch.export``: the values are unknown, and asking for them failed the
    export) the check becomes a runtime assertion in the graph (``torch._assert_async``)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if not x.numel():
        return
    try:
        finite = bool(torch.isfinite(x).all())
    except GuardOnDataDependentSymNode:
        torch._assert_async(torch.isfinite(x).all(), f"{what}: input must be finite")
        return
    if not finite:
        bad = x[~torch.isfinite(x)].flatten()[0].item()
        raise NonFiniteInputError(f"{what}: input must be finite, found {bad}")


def to_fp8_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast to an FP8 dtype: clamp to ±max, then round to nearest even."""
    if dtype not in FP8_DTYPES:
        raise LowPrecisionError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    m = FP8_MAX[dtype]
    return torch.clamp(x.float(), -m, m).to(dtype)


def f32_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in 0..15) of float values: RNE, saturating at ±6, sign of zero kept."""
    a = x.float().abs()
    # Thresholds between neighbouring magnitudes; ">" at a tie keeps the even code, ">=" rounds up
    # to it: 0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0, 5→4.0.
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = (x.float().view(torch.int32) < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """Float values of E2M1 codes (uint8 in 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return table[codes.long() & 15]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes (last dim even) two per byte: element ``2i`` low nibble, ``2i+1`` high nibble."""
    if codes.shape[-1] % 2:
        raise LowPrecisionError(f"pack_fp4: last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 ``[..., n]`` → codes ``[..., 2n]``."""
    lo, hi = packed & 15, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def e8m0_to_f32(e: torch.Tensor) -> torch.Tensor:
    """Float value ``2**(e - 127)`` of E8M0 bytes (``0`` → 2**-127, ``255`` → NaN)."""
    return e.view(torch.uint8).view(torch.float8_e8m0fnu).float()


def e4m3_to_f32(b: torch.Tensor) -> torch.Tensor:
    """Float value of E4M3FN bytes (uint8 or float8_e4m3fn)."""
    return b.view(torch.float8_e4m3fn).float()


def fp8_code_values(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of every code 0..255 of the FP8 ``dtype``, as torch's cast gives it (NaN
    codes and their payloads included): the decode tables of the native kernels."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()
