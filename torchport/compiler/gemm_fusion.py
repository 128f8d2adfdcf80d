"""Pre-grad FX pass: GEMM + epilogue chains → the autotuned fused ``torchport::gemm`` op.

Rules (one per anchor pattern) run on dynamo's graph of torch-level ops. Each finds a GEMM
(``F.linear``; ``torch.matmul``/``@``/``torch.mm`` with a 2-D right operand; ``torch.addmm`` with
unit ``alpha``/``beta``), then absorbs the single-user chain that follows while each step is one
the kernel can fuse and keeps the GEMM's dtype, and no node between the GEMM and the step may
have side effects (an in-place update, a grad-mode or autocast switch: the fused op runs where
the chain's last step was):

- ``+ t`` with ``t`` of shape ``[N]`` (bias) or of the output's shape (residual);
- ``* c`` with a finite Python number, or ``* t`` with ``t`` of shape ``[N]``;
- ``relu``, ``gelu`` (erf or tanh), ``silu``; a final ``.to(torch.bfloat16/float32)`` that
  keeps the dtype or narrows float32 to bfloat16 (a widening ``.to(torch.float32)`` of a bf16
  GEMM stays in the graph: eager rounds to bf16 before widening, the fused store would not).

The chain is replaced by one call of :func:`fused_linear`/:func:`fused_matmul`, which flatten
leading dimensions and call ``torch.ops.torchport.gemm`` (a custom op with a fake implementation
and autograd, so Inductor, AOTAutograd and ``torch.export`` all see through it). Anything else
stays in the graph for Inductor (or eager).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torchport.compiler.backend import register_pre_grad_pass
from torchport.compiler.passes import (
    Pass,
    Rule,
    has_side_effects,
    is_call,
    is_plain_tensor,
    node_tensor_meta,
)
from torchport.gemm.epilogue import EpilogueSpec, Op
from torchport.gemm.mm import gemm_op

_TAG = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _flat_operands(
    operands: list[torch.Tensor], spec: str, rows: int, n: int
) -> list[torch.Tensor]:
    sp = EpilogueSpec.decode(spec)
    kinds = [op.kind for op in sp.ops if op.dtype]
    return [
        t.reshape(rows, n) if k == "add" and t.dim() != 2 else t for k, t in zip(kinds, operands)
    ]


def fused_linear(
    x: torch.Tensor, weight: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    """``epilogue(linear(x, weight))`` over the last dimension (the pass's replacement)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    # the row count spelled out: reshape(-1, 0) of an empty tensor (K = 0 or N = 0) is
    # ambiguous and raises, where F.linear returns the bias broadcast
    rows = math.prod(lead)
    y = gemm_op(x.reshape(rows, k), weight.t(), _flat_operands(operands, spec, rows, n), spec)
    return y.reshape(*lead, n)


def fused_matmul(
    x: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    """``epilogue(x @ b)`` for 2-D ``b`` (the pass's replacement)."""
    k, n = b.shape
    lead = x.shape[:-1]
    rows = math.prod(lead)  # spelled out, as in fused_linear
    y = gemm_op(x.reshape(rows, k), b, _flat_operands(operands, spec, rows, n), spec)
    return y.reshape(*lead, n)


def _meta(node: Any) -> torch.Tensor | None:
    return node_tensor_meta(node) if isinstance(node, fx.Node) else None


def _fusable(t: torch.Tensor | None, rows: bool = False) -> bool:
    """A plain CPU tensor (a quantized weight subclass is not ours to fuse) of a fusable dtype
    with static sizes; with ``rows``, only its last size need be static: the leading ones (the
    rows: batch, sequence) may be symbolic, since the fused op takes any row count (dynamic=True
    or the automatic dynamic shapes after a new sequence length fused nothing). Sizes are never
    compared in a way that adds a guard (that would break a declared dynamic spec)."""
    return (
        t is not None
        and is_plain_tensor(t)
        and (
            _static(t.shape[-1]) is not None
            if rows and t.dim()
            else all(_static(d) is not None for d in t.shape)
        )
        and t.dtype in _TAG
        and t.device.type == "cpu"
    )


def _static(d: Any) -> int | None:
    """A size's value when it is known without a guard: an int, or a SymInt whose expression
    is a constant (K of an input that the weight's shape pinned to its value), else None."""
    if type(d) is int:
        return d
    return d.node.maybe_as_int() if isinstance(d, torch.SymInt) else None


def _same_shape(t: torch.Tensor, u: torch.Tensor) -> bool:
    """``t`` and ``u`` have one shape, provably without a guard (symbolic sizes included)."""
    return t.dim() == u.dim() and all(
        statically_known_true(x == y) for x, y in zip(t.shape, u.shape)
    )


def _is_vector(t: torch.Tensor, n: Any) -> bool:
    """``t`` is ``[n]``, both sizes static."""
    return t.dim() == 1 and _static(n) is not None and _static(t.shape[0]) == _static(n)


_RELU = (torch.relu, F.relu, torch.nn.functional.relu)
_GELU = (F.gelu, torch._C._nn.gelu)
_SILU = (F.silu,)
_ADD = (operator.add, torch.add)
_MUL = (operator.mul, torch.mul)


def _epilogue_step(
    node: fx.Node, cur: fx.Node, out: torch.Tensor
) -> tuple[Op, fx.Node | None] | None:
    """The fused op ``node`` applies to ``cur`` (and its tensor operand), or None."""
    meta = _meta(node)
    if meta is None:
        return None
    n = out.shape[-1]
    if node.op == "call_method" and node.target in ("relu", "to") and node.args[0] is cur:
        if node.target == "relu" and len(node.args) == 1 and not node.kwargs:
            return Op("relu"), None
        if node.target == "to" and len(node.args) == 2 and not node.kwargs:
            dt = node.args[1]
            # bf16 -> float32 is not fused: the kernel would store the float32 sums unrounded
            widens = out.dtype == torch.bfloat16 and dt == torch.float32
            if isinstance(dt, torch.dtype) and dt in _TAG and meta.dtype == dt and not widens:
                return Op("cast", _TAG[dt]), None
        return None
    if meta.dtype != out.dtype or not _same_shape(meta, out):
        return None
    unary = node.args[0] is cur and not node.kwargs.get("inplace", False)
    if is_call(node, *_RELU) and unary and (len(node.args) == 1 or node.args[1] is False):
        return Op("relu"), None
    if is_call(node, *_GELU) and node.args[0] is cur and len(node.args) == 1:
        approx = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approx in ("none", "tanh"):
            return Op("gelu" if approx == "none" else "gelu_tanh"), None
    if is_call(node, *_SILU) and unary and len(node.args) == 1:
        return Op("silu"), None
    if (is_call(node, *_ADD) or is_call(node, *_MUL)) and len(node.args) == 2 and not node.kwargs:
        other = (
            node.args[1] if node.args[0] is cur else node.args[0] if node.args[1] is cur else None
        )
        if other is None or other is cur:
            return None
        is_add = is_call(node, *_ADD)
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            if not is_add and math.isfinite(float(other)):
                return Op("scale", value=float(other)), None
            return None
        t = _meta(other)
        if not _fusable(t, rows=True) or t is None or t.dtype != out.dtype:
            return None
        assert isinstance(other, fx.Node)
        if _is_vector(t, n):
            return Op("bias_col" if is_add else "scale_col", _TAG[t.dtype]), other
        if is_add and _same_shape(t, out):
            return Op("add", _TAG[t.dtype]), other
    return None


def _side_effect_between(first: fx.Node, last: fx.Node) -> bool:
    """True if a node after ``first`` and before ``last`` (graph order) may have side effects.

    The fused op replaces the chain at its *last* step, so every node between the GEMM and that
    step then runs before the GEMM. That is harmless for pure nodes (the residual's own
    computation) but not for an update of the GEMM's input or of an operand (the GEMM would read
    the new value), nor for a grad-mode or autocast switch (a GEMM under ``torch.no_grad()``
    would record gradients). A ``last`` not found after ``first`` counts as True.
    """
    node = first.next
    while node is not last:
        if node.op == "root" or has_side_effects(node):
            return True
        node = node.next
    return False


def _absorb(
    gm: fx.GraphModule, anchor: fx.Node, a: fx.Node, b: fx.Node, fn: Any, first: list[Any]
) -> bool:
    """Grow the epilogue chain after ``anchor`` and replace it with one fused call."""
    out = _meta(anchor)
    if not _fusable(out, rows=True) or out is None or out.dim() < 1:
        return False
    for inp, rows in ((a, True), (b, False)):  # (b: the weight, static)
        im = _meta(inp)
        if not _fusable(im, rows) or im is None or im.dtype != out.dtype:
            return False
    ops: list[Op] = [op for op, _ in first]
    operands: list[fx.Node] = [t for _, t in first if t is not None]
    cur, out_dtype = anchor, ""
    chain = [anchor]
    while len(cur.users) == 1 and not out_dtype:
        user = next(iter(cur.users))
        if _side_effect_between(cur, user):
            break  # the fused op would run after it (see _side_effect_between)
        step = _epilogue_step(user, cur, out)
        if step is None:
            break
        op, t = step
        if op.kind == "cast":
            if op.dtype != _TAG[out.dtype]:
                out_dtype = op.dtype
        else:
            ops.append(op)
            if t is not None:
                operands.append(t)
        cur = user
        chain.append(cur)
    spec = EpilogueSpec(tuple(ops), out_dtype).encode()
    with gm.graph.inserting_before(cur):
        new = gm.graph.call_function(fn, (a, b, operands, spec))
    new.meta.update(cur.meta)
    cur.replace_all_uses_with(new)
    for old in reversed(chain):
        if not old.users:
            gm.graph.erase_node(old)
    return True


_GEMM_TARGETS = (
    F.linear,
    torch._C._nn.linear,
    torch.matmul,
    operator.matmul,
    torch.mm,
    torch.addmm,
)


def _mixed_dtypes(gm: fx.GraphModule) -> bool:
    """Whether a GEMM of the graph takes operands of different dtypes (a bf16 input into a
    float32 layer), which eager refuses when it runs. The traced values past it are not what
    runs (the fake ``F.linear`` of a bf16 input and a float32 weight is float32, the lowered
    one bf16), so nothing of such a graph is fused: it runs as traced and fails as eager does
    (a fused GEMM downstream failed at compile time instead, naming the wrong layer). Found
    once per graph."""
    found = gm.meta.get("torchport_mixed_gemm")
    if found is None:
        found = False
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in _GEMM_TARGETS:
                dts = {t.dtype for a in n.args if (t := _meta(a)) is not None}
                if len(dts) > 1:
                    found = True
                    break
        gm.meta["torchport_mixed_gemm"] = found
    return bool(found)


def _linear_rule(gm: fx.GraphModule, node: fx.Node) -> bool:
    if not is_call(node, F.linear, torch._C._nn.linear) or node.kwargs or _mixed_dtypes(gm):
        return False
    if node.meta.get("torchport_decode_aten"):  # the GEMV pass chose F.linear (decode shape)
        return False
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        return False
    wt = _meta(w)
    if wt is None or wt.dim() != 2:
        return False
    first: list[Any] = []
    if bias is not None:
        bt = _meta(bias)
        # the kernel reads N bias values: a bias F.linear would broadcast (shape [1]) stays
        # with F.linear (a symbolic N would need a guard to compare: also left alone)
        if not _fusable(bt) or bt is None or bt.dtype != wt.dtype:
            return False
        if not _is_vector(bt, wt.shape[0]):
            return False
        first.append((Op("bias_col", _TAG[bt.dtype]), bias))
    return _absorb(gm, node, x, w, fused_linear, first)


def _matmul_rule(gm: fx.GraphModule, node: fx.Node) -> bool:
    if not is_call(node, torch.matmul, operator.matmul, torch.mm) or node.kwargs:
        return False
    if _mixed_dtypes(gm):
        return False
    x, b = node.args[0], node.args[1]
    xt, bt = _meta(x), _meta(b)
    if xt is None or bt is None or bt.dim() != 2 or xt.dim() < 2:
        return False
    if node.target is torch.mm and xt.dim() != 2:
        return False
    assert isinstance(x, fx.Node) and isinstance(b, fx.Node)
    return _absorb(gm, node, x, b, fused_matmul, [])


def _addmm_rule(gm: fx.GraphModule, node: fx.Node) -> bool:
    if not is_call(node, torch.addmm) or node.kwargs or len(node.args) != 3 or _mixed_dtypes(gm):
        return False
    bias, x, b = node.args
    out, bt = _meta(node), _meta(bias)
    if out is None or bt is None or not _fusable(bt, rows=True) or bt.dtype != out.dtype:
        return False
    if _is_vector(bt, out.shape[1]):
        first = [(Op("bias_col", _TAG[bt.dtype]), bias)]
    elif _same_shape(bt, out):
        first = [(Op("add", _TAG[bt.dtype]), bias)]
    else:
        return False
    assert isinstance(x, fx.Node) and isinstance(b, fx.Node)
    return _absorb(gm, node, x, b, fused_matmul, first)


GEMM_FUSION = Pass(
    "gemm_fusion",
    [
        # F.linear(x, W, b) + epilogue chain → fused_linear
        Rule("linear+epilogue -> torchport::gemm", _linear_rule),
        # x @ B / torch.matmul / torch.mm (2-D B) + epilogue chain → fused_matmul
        Rule("matmul+epilogue -> torchport::gemm", _matmul_rule),
        # torch.addmm(bias, x, B) + epilogue chain → fused_matmul with a bias or residual
        Rule("addmm+epilogue -> torchport::gemm", _addmm_rule),
    ],
)


def register() -> Pass:
    """Register :data:`GEMM_FUSION` with every torchport compilation (idempotent)."""
    return register_pre_grad_pass(GEMM_FUSION, order=50)


register()
