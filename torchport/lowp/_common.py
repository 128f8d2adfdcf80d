"""Input validation shared by the quantizers."""

from __future__ import annotations

import math

import torch

from torchport import native
from torchport.lowp import kernels
from torchport.lowp.formats import LowPrecisionError, NonFiniteInputError

HP_DTYPES = (torch.float32, torch.bfloat16)


def as_rows(x: object, block: int, what: str) -> torch.Tensor:
    """Validate a high-precision input and view it as contiguous rows ``[R, K]`` (K % block == 0)."""
    x = check_input(x, block, what)
    # (the row count spelled out: with K = 0, -1 would be ambiguous)
    return x.detach().reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()


def check_input(x: object, block: int, what: str) -> torch.Tensor:
    """Raise unless ``x`` is a float32 or bfloat16 CPU tensor of at least one dimension whose
    last is a multiple of ``block``; return it. (Before anything reads its values: a meta
    tensor's ``.item()`` raised torch's untyped error.)"""
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
    return x


def use_native(flag: bool | None, x: object = None) -> bool:
    """Resolve a ``native_kernel`` argument: None → native kernels if enabled and buildable.

    Under tracing (``torch.compile``, export, dispatch modes) ``None`` means the plain-torch
    reference, which gives the same bits and is traceable; ``True`` still forces the kernel.

    A toolchain failure (no compiler, compile error) falls back, visibly (one warning, a counter),
    to the plain-torch reference, which gives the same bits.
    """
    want = native.enabled() if flag is None else flag
    if not want:
        return False
    if flag is None and isinstance(x, torch.Tensor) and not native.eager_fast_path(x.detach()):
        return False
    try:
        kernels.library(torch.float32)
        kernels.library(torch.bfloat16)
    except native.NativeError as e:
        if flag:  # explicitly requested: the failure is the caller's answer
            raise
        native.note_fallback("lowp quantize", e)
        return False
    return True


def raise_nonfinite(what: str, x: torch.Tensor) -> None:
    """A kernel reported a non-finite input: raise with the first offending value."""
    bad = x[~torch.isfinite(x)].flatten()
    val = bad[0].item() if bad.numel() else float("nan")
    raise NonFiniteInputError(f"{what}: input must be finite, found {val}")
