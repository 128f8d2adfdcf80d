"""Compiler pass: route decode-shaped ``linear`` calls to the native GEMV custom op.

Registered with :func:`torchport.compiler.register_pre_grad_pass` when :mod:`torchport.gemv` is
imported, so ``torchport.compile(model)`` sends ``F.linear(x, W, b)`` with at most
:data:`~torchport.gemv.MAX_ROWS` activation rows (``[B, 1, K]``, ``[1, K]``), a float32/bfloat16
2-D weight of the same dtype, no bias or a ``[N]`` one (not another shape F.linear broadcasts),
and no autograd (the output does not require grad) to ``torchport::gemv_dense`` -- but only where it wins: a weight with fewer than
:data:`~torchport.gemv.ops.TUNE_MIN_WEIGHTS` elements stays with Inductor/ATen (a few µs of work,
where an opaque custom op costs more than it saves and blocks fusion), and a larger one is routed
only if the autotuner (``F.linear`` anchor, cold weights, :func:`~torchport.gemv.ops.plan_for`)
chose a native kernel for its (dtype, N, K, rows). Quantized weights are not seen here: their
tensor subclass dispatches to ``torchport::gemv_packed`` itself (there is no ATen alternative).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx

from torchport import autotune, native
from torchport.compiler import (
    Pass,
    Rule,
    is_call,
    is_plain_tensor,
    node_tensor_meta,
    register_pre_grad_pass,
)
from torchport.gemv.ops import MAX_ROWS, TUNE_MIN_WEIGHTS, PackedWeight, gemv_dense_op, plan_for

_DTYPES = (torch.float32, torch.bfloat16)
# node.meta flag on a decode-shaped dense ``linear`` the GEMV pass left to F.linear
KEEP_ATEN = "torchport_decode_aten"


def _static_rows(shape: torch.Size) -> int | None:
    # int() of a SymInt would specialise it (a guard): leave symbolic sizes alone
    if not all(type(s) is int for s in shape):
        return None
    return math.prod(shape[:-1])


def native_wins(dtype: torch.dtype, n: int, k: int, rows: int) -> bool:
    """True if the native GEMV should serve a dense ``[n, k]`` weight with ``rows`` rows.

    Small problems (``n * k < TUNE_MIN_WEIGHTS``) never do; larger ones ask the tuner, which
    times the native variants against ``F.linear`` on a random weight of this shape and dtype
    (the decision depends on the shape, not the values, and is cached persistently).
    """
    if n * k < TUNE_MIN_WEIGHTS or not native.enabled():
        return False
    fmt = "f32" if dtype == torch.float32 else "bf16"
    w = torch.randn(n, k, dtype=dtype, generator=autotune.sample_generator())
    empty_u8, empty_f32 = torch.empty(0, dtype=torch.uint8), torch.empty(0)
    try:
        plan = plan_for(PackedWeight(fmt, w, empty_u8, empty_f32, 1.0, n, k, False), rows, False)
    except native.NativeError:
        return False
    return plan.kernel is not None


def _linear_to_gemv(gm: fx.GraphModule, node: fx.Node) -> bool:
    # linear(x: ≤8 rows, W: [N, K] fp32/bf16, b) without autograd -> torchport::gemv_dense(x, W, b)
    # when the tuner measured the native kernel faster than F.linear for this problem
    if not is_call(node, F.linear, torch.ops.aten.linear.default):
        return False
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w = args[0], args[1]
    bias = node.kwargs.get("bias", args[2])
    out, xm, wm = node_tensor_meta(node), node_tensor_meta(x), node_tensor_meta(w)  # type: ignore[arg-type]
    if out is None or xm is None or wm is None or out.requires_grad:
        return False
    if xm.dtype not in _DTYPES or wm.dtype != xm.dtype or wm.dim() != 2 or xm.dim() < 1:
        return False
    if not is_plain_tensor(wm) or wm.layout != torch.strided:
        return False
    rows = _static_rows(xm.shape)
    if rows is None or not 0 < rows <= MAX_ROWS:
        return False
    bm = node_tensor_meta(bias) if isinstance(bias, fx.Node) else None
    # the kernel reads N bias values: F.linear broadcasts any bias shape ([rows, N] per row, a
    # scalar), which routed gave row 0's bias on every row or a read past a scalar's element
    if bias is not None and (
        bm is None or bm.dtype != xm.dtype or tuple(bm.shape) != (wm.shape[0],)
    ):
        return False
    if not all(type(s) is int for s in wm.shape):
        return False
    if not native_wins(wm.dtype, wm.shape[0], wm.shape[1], rows):
        # decode-shaped and decided: F.linear serves it best; the GEMM fusion pass (order 50)
        # leaves it alone too, so Inductor/ATen keep it (an opaque op costs more than it saves)
        node.meta[KEEP_ATEN] = True
        return False
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.torchport.gemv_dense.default, (x, w, bias))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


GEMV_ROUTING = Pass(
    "gemv_routing", [Rule("linear(decode x, W) -> torchport::gemv_dense", _linear_to_gemv)]
)
# Before the GEMM engine's fusion (order 50): decode-shaped linears belong to the GEMV.
register_pre_grad_pass(GEMV_ROUTING, order=40)

__all__ = ["GEMV_ROUTING", "KEEP_ATEN", "gemv_dense_op", "native_wins"]
