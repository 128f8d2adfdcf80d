"""``torchport.nn.functional``: :func:`linear` on the GEMM engine and 2.14's recipe-based
:func:`scaled_mm` on the CPU.

``linear`` has the same contract as torch's (``input [..., K]``, ``weight [N, K]``, ``bias [N]``),
plus an optional fused ``epilogue`` (see :mod:`torchport.gemm.epilogue`); residual operands may
have the output's full shape ``[..., N]``, and a callable step (with every step after it) runs on
the ``[..., N]`` output, not on its flattened rows. ``scaled_mm``, ``ScalingType`` and
``SwizzleType`` are :mod:`torchport.lowp.scaled_recipes`'s (torch's own enums).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchport.gemm.epilogue import Add, Step, apply_tail, as_steps, is_user_callable
from torchport.gemm.kernels import GemmInputError
from torchport.gemm.mm import mm
from torchport.lowp.scaled_recipes import ScalingType, SwizzleType, scaled_mm


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    epilogue: Sequence[Step] | Step | None = None,
) -> torch.Tensor:
    """``epilogue(input @ weight.T + bias)`` through the autotuned GEMM (float32/bfloat16, CPU)."""
    if (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and input.dim() == 2
        and weight.dim() == 2
        and input.shape[1] == weight.shape[1]
    ):  # a batch of rows, fused epilogue or not: no reshapes, and mm checks the rest
        return mm(input, weight.t(), bias=bias, epilogue=epilogue)
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise GemmInputError(
            f"linear: input and weight must be tensors, got {type(input).__name__} "
            f"and {type(weight).__name__}"
        )
    if weight.dim() != 2:
        raise GemmInputError(
            f"linear: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}"
        )
    if input.dim() < 1:
        raise GemmInputError("linear: input must have at least 1 dimension, got a scalar")
    k = weight.shape[1]
    if input.shape[-1] != k:
        raise GemmInputError(
            f"linear: input's last dimension must equal in_features={k}, got shape "
            f"{tuple(input.shape)}"
        )
    n = weight.shape[0]
    if input.dim() == 2:  # rows already: the residual has the output's shape, no reshapes
        return mm(input, weight.t(), bias=bias, epilogue=epilogue)
    lead = tuple(input.shape[:-1])
    # the row count spelled out: reshape(-1, 0) of an empty tensor (K = 0 or N = 0) is ambiguous
    rows = math.prod(lead)
    x2 = input.reshape(rows, k)
    steps: list[Step] = []
    rest: list[Step] = []  # from the first callable on: run on the [..., N] output, as written
    for s in as_steps(epilogue):
        if rest or is_user_callable(s):
            rest.append(s)
            continue
        if isinstance(s, Add) and s.t.dim() != 2 and tuple(s.t.shape) == (*lead, n):
            s = Add(s.t.reshape(rows, n))
        steps.append(s)
    y = mm(x2, weight.t(), bias=bias, epilogue=steps).reshape(*lead, n)
    return apply_tail(y, rest) if rest else y


__all__ = ["ScalingType", "SwizzleType", "linear", "scaled_mm"]
