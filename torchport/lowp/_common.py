"""Input validation shared by the quantizers."""

from __future__ import annotations

import torch

from torchport import native
from torchport.lowp.formats import LowPrecisionError, NonFiniteInputError

HP_DTYPES = (torch.float32, torch.bfloat16)


def as_rows(x: object, block: int, what: str) -> torch.Tensor:
    """Validate a high-precision input and view it as contiguous rows ``[R, K]`` (K % block == 0)."""
    if not isinstance(x, torch.Tensor):
        raise LowPrecisionError(f"{what}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HP_DTYPES:
        raise LowPrecisionError(f"{what}: input dtype must be float32 or bfloat16, got {x.dtype}")
    if x.device.type != "cpu":
        raise LowPrecisionError(f"{what}: input must be on cpu, got {x.device}")
    if x.dim() < 1:
        raise LowPrecisionError(f"{what}: input must have at least 1 dimension, got a scalar")
    k = x.shape[-1]
    if k % block:
        raise LowPrecisionError(
            f"{what}: the last dimension must be a multiple of the block size {block} "
            f"(no padding is done), got {k}"
        )
    return x.detach().reshape(-1, k).contiguous()


def use_native(flag: bool | None) -> bool:
    """Resolve a ``use_native`` argument: None → native kernels if enabled."""
    return native.enabled() if flag is None else flag


def raise_nonfinite(what: str, x: torch.Tensor) -> None:
    """A kernel reported a non-finite input: raise with the first offending value."""
    bad = x[~torch.isfinite(x)].flatten()
    val = bad[0].item() if bad.numel() else float("nan")
    raise NonFiniteInputError(f"{what}: input must be finite, found {val}")
