"""``torchport.nn.functional``: :func:`linear` on the GEMM engine and 2.14's recipe-based
:func:`scaled_mm` on the CPU.

``linear`` has the same contract as torch's (``input [..., K]``, ``weight [N, K]`` or ``[K]``, a
``bias`` that broadcasts to the output: ``[N]`` as a fused bias, any other shape as a fused
residual), plus an optional fused ``epilogue`` (see :mod:`torchport.gemm.epilogue`); residual operands may
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
from torchport.gemm.mm import _GemmTypeError, mm
from torchport.lowp.scaled_recipes import ScalingType, SwizzleType, scaled_mm


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    epilogue: Sequence[Step] | Step | None = None,
) -> torch.Tensor:
    """``epilogue(input @ weight.T + bias)`` through the autotuned GEMM (float32/bfloat16, CPU).

    Beyond ``F.linear`` (which refuses it), a bias of the other fusable dtype is taken as the
    kernels take it: added to the float32 accumulator (a float32 bias of a bfloat16 layer is not
    rounded to bfloat16 first, and its gradient is summed in float32); the output has the
    input's dtype."""
    if (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and input.dim() == 2
        and weight.dim() == 2
        and input.shape[1] == weight.shape[1]
        and (
            bias is None
            or (
                isinstance(bias, torch.Tensor)
                and bias.dim() == 1
                and bias.shape[0] == weight.shape[0]
            )
        )
    ):  # a batch of rows, fused epilogue or not: no reshapes, and mm checks the rest
        return mm(input, weight.t(), bias=bias, epilogue=epilogue)
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise _GemmTypeError(  # (a TypeError, as F.linear's)
            f"linear: input and weight must be tensors, got {type(input).__name__} "
            f"and {type(weight).__name__}"
        )
    if bias is not None and not isinstance(bias, torch.Tensor):  # (before any GEMM runs)
        raise _GemmTypeError(f"linear: bias must be a tensor or None, got {type(bias).__name__}")
    if weight.dim() == 1:  # torch's [K] weight: one output feature, dropped from the shape
        if input.dim() < 1 or input.shape[-1] != weight.shape[0]:
            raise GemmInputError(
                f"linear: input's last dimension must equal the 1-D weight's length "
                f"{weight.shape[0]}, got shape {tuple(input.shape)}"
            )
        y = linear(input, weight[None]).squeeze(-1)
        y = y if bias is None else y + _broadcast_bias(bias, y.shape)
        if epilogue is None:
            return y
        if y.dim() == 0:  # a 1-D input too: the steps run on the one value as a vector
            return apply_tail(y.reshape(1), as_steps(epilogue)).reshape(())
        return apply_tail(y, as_steps(epilogue))
    if weight.dim() != 2:
        raise GemmInputError(
            f"linear: weight must be 2-D [out_features, in_features] (or 1-D [in_features]), "
            f"got shape {tuple(weight.shape)}"
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
    if input.dim() == 1 and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (1, n):
        bias = bias.reshape(n)  # as torch: a 1-D input's row takes a [1, N] bias, output [N]
    if bias is not None and not (
        isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] == n
    ):  # () or [1]: a column bias of N copies; any other shape: a residual of the output's
        full = (*input.shape[:-1], n)
        b = _broadcast_bias(bias, full)
        if b.dim() <= 1:
            bias = b.reshape(-1).expand(n)
        else:
            bias, epilogue = None, [Add(b.expand(full)), *as_steps(epilogue)]
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
        if (  # (a non-tensor residual goes on to mm's typed error)
            isinstance(s, Add)
            and isinstance(s.t, torch.Tensor)
            and s.t.dim() != 2
            and tuple(s.t.shape) == (*lead, n)
        ):
            s = Add(s.t.reshape(rows, n))
        steps.append(s)
    y = mm(x2, weight.t(), bias=bias, epilogue=steps).reshape(*lead, n)
    return apply_tail(y, rest) if rest else y


def _broadcast_bias(bias: object, shape: tuple[int, ...]) -> torch.Tensor:
    """``bias`` when it broadcasts to ``shape`` (as torch's linear adds it), else a typed error."""
    assert isinstance(bias, torch.Tensor), type(bias)  # (linear checked it)
    try:
        both = torch.broadcast_shapes(tuple(bias.shape), tuple(shape))
    except RuntimeError:
        raise GemmInputError(
            f"linear: bias of shape {tuple(bias.shape)} does not broadcast to the output's "
            f"shape {tuple(shape)}"
        ) from None
    if both != tuple(shape):
        raise GemmInputError(
            f"linear: bias of shape {tuple(bias.shape)} would broadcast the output's shape "
            f"{tuple(shape)} to a larger one"
        )
    return bias


__all__ = ["ScalingType", "SwizzleType", "linear", "scaled_mm"]
