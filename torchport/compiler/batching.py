"""Small-kernel batching: a pre-grad pass that merges independent, same-kind small operations.

Rules (each rewrites one group found from its first member):

- ``parallel linears → one GEMM``: ``linear(x, W_i, b_i)`` for several ``i`` on the same ``x`` become
  ``linear(x, cat(W_i), cat(b_i))`` and a ``split`` of the result.
- ``per-head projections → bmm``: ``linear(x_h, W_h, b_h)`` on different inputs of one shape with
  weights of one shape become ``baddbmm(stack(b_h), stack(x_h), stack(W_h)ᵀ)`` and an ``unbind``.
- ``small elementwise → foreach``: the same unary op (exp, sigmoid, tanh, ...) on several small
  tensors becomes one ``torch._foreach_<op>`` call.

A group qualifies only if every input of every member is defined before its first member (so the
members are independent and the batched op can sit where the first one was). Concatenated or
stacked *weights* are not computed in the graph: the rule adds a graph input for them, and
:class:`BatchedCallable` computes it from the original weights on each call, reusing the last result
while the weights are unchanged (same storage and version counter) and autograd does not need it.

Whether a group is batched is measured, not assumed: :func:`decide` times the group's separate ops
(the ATen anchor) against the batched form on random inputs of the group's shapes with
:func:`torchport.autotune.select`, and batches only on a win beyond noise (the choice is cached
per shape). ``reference`` semantics: the rewritten graph computes exactly what the original does;
results may differ only by GEMM summation order (tested to fp32 rounding).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from torchport.autotune import ATEN, NATIVE, Candidate, select
from torchport.compiler.passes import Pass, Rule, node_tensor_meta

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
FOREACH = {
    torch.exp: torch._foreach_exp,
    torch.sigmoid: torch._foreach_sigmoid,
    torch.tanh: torch._foreach_tanh,
    torch.sin: torch._foreach_sin,
    torch.cos: torch._foreach_cos,
    torch.neg: torch._foreach_neg,
    torch.abs: torch._foreach_abs,
    torch.sqrt: torch._foreach_sqrt,
    torch.log: torch._foreach_log,
    torch.reciprocal: torch._foreach_reciprocal,
}
SMALL_NUMEL = 1 << 16  # elementwise ops on tensors larger than this are not "small"
MIN_GROUP = 2


@dataclass(frozen=True)
class DerivedInput:
    """A graph input computed from other inputs: ``how`` ∈ {"cat", "stack"} of ``sources``."""

    name: str
    how: str
    sources: tuple[int, ...]  # placeholder positions


META_KEY = "torchport_derived_inputs"
DERIVED_FLAG = "torchport_derived"


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _add_derived(gm: fx.GraphModule, how: str, sources: Sequence[fx.Node]) -> fx.Node:
    phs = _placeholders(gm)
    index = {n: i for i, n in enumerate(phs)}
    derived: list[DerivedInput] = gm.meta.setdefault(META_KEY, [])
    name = f"batched_{how}_{len(derived)}"
    metas = [node_tensor_meta(s) for s in sources]
    with gm.graph.inserting_after(phs[-1]):
        p = gm.graph.placeholder(name)
    # shape/dtype for later passes (a meta tensor); marked so batching never re-batches it
    if all(m is not None for m in metas):
        ms = [
            torch.empty(tuple(m.shape), dtype=m.dtype, device="meta")
            for m in metas
            if m is not None
        ]
        p.meta["example_value"] = torch.cat(ms) if how == "cat" else torch.stack(ms)
    p.meta[DERIVED_FLAG] = True
    derived.append(DerivedInput(p.name, how, tuple(index[s] for s in sources)))
    return p


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _concrete(t: torch.Tensor | None) -> bool:
    return t is not None and all(isinstance(s, int) for s in t.shape)


def _linear_parts(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(x, W, b) of a linear node whose weight/bias are graph inputs with known 2-D/1-D shapes."""
    if n.op != "call_function" or n.target not in LINEAR_TARGETS or n.kwargs:
        return None
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else None
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or w.op != "placeholder":
        return None
    if b is not None and (not isinstance(b, fx.Node) or b.op != "placeholder"):
        return None
    if w.meta.get(DERIVED_FLAG) or (b is not None and b.meta.get(DERIVED_FLAG)):
        return None
    wt = node_tensor_meta(w)
    if not _concrete(wt) or wt is None or wt.dim() != 2 or not _concrete(node_tensor_meta(x)):
        return None
    return x, w, b


def _group(gm: fx.GraphModule, first: fx.Node, same: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """``first`` and every later node with ``same(node)`` whose inputs precede ``first``."""
    pos = _positions(gm)
    p0 = pos[first]
    out = [first]
    for n in gm.graph.nodes:
        if pos[n] <= p0 or not same(n):
            continue
        if all(pos[i] < p0 for i in n.all_input_nodes):
            out.append(n)
    return out


# --- the decision ---------------------------------------------------------------------------------


def decide(
    op: str,
    key: dict[str, Any],
    separate: Callable[..., Any],
    batched: Callable[..., Any],
    make_args: Callable[[], tuple[Any, ...]],
) -> bool:
    """True if the batched form beats the separate ops (measured, cached per ``key``)."""
    cands = [Candidate("separate", ATEN), Candidate("batched", NATIVE)]
    fns = {"separate": separate, "batched": batched}

    def check(out: Any, ref: Any) -> bool:
        return all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(out, ref, strict=True)
        )

    choice = select(op, key, cands, lambda c: fns[c.name], make_args, cold=False, check=check)
    return choice.candidate.name == "batched"


def _rand(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(tuple(t.shape), dtype=t.dtype)


def _training(ws: Sequence[fx.Node]) -> bool:
    return torch.is_grad_enabled() and any(
        bool(getattr(node_tensor_meta(w), "requires_grad", False)) for w in ws
    )


# --- rule: parallel linears on one input ----------------------------------------------------------


def _parallel_linears(gm: fx.GraphModule, node: fx.Node) -> bool:
    parts = _linear_parts(node)
    if parts is None:
        return False
    x, w0, b0 = parts
    wt0 = node_tensor_meta(w0)
    assert wt0 is not None

    def same(n: fx.Node) -> bool:
        q = _linear_parts(n)
        if q is None or q[0] is not x or (q[2] is None) != (b0 is None):
            return False
        wt = node_tensor_meta(q[1])
        return wt is not None and wt.shape[1] == wt0.shape[1] and wt.dtype == wt0.dtype

    group = _group(gm, node, same)
    if len(group) < MIN_GROUP:
        return False
    specs = [_linear_parts(n) for n in group]
    ws = [s[1] for s in specs if s]
    bs = [s[2] for s in specs if s and s[2] is not None]
    outs = [int(node_tensor_meta(w).shape[0]) for w in ws]  # type: ignore[union-attr]
    xt = node_tensor_meta(x)
    assert xt is not None
    wts = [node_tensor_meta(w) for w in ws]
    train = _training(ws)

    def make_args() -> tuple[Any, ...]:
        return (
            _rand(xt),
            *[_rand(t) for t in wts if t is not None],
            *[torch.randn(o) for o in outs][: len(bs)],
        )

    nw = len(ws)

    def separate(x_: torch.Tensor, *wb: torch.Tensor) -> list[torch.Tensor]:
        w_, b_ = wb[:nw], wb[nw:]
        return [torch.nn.functional.linear(x_, w, b_[i] if b_ else None) for i, w in enumerate(w_)]

    def batched(x_: torch.Tensor, *wb: torch.Tensor) -> list[torch.Tensor]:
        w_, b_ = wb[:nw], wb[nw:]
        wc = torch.cat(w_) if train else _cached_cat(w_)
        bc = (torch.cat(b_) if train else _cached_cat(b_)) if b_ else None
        return list(torch.nn.functional.linear(x_, wc, bc).split(outs, -1))

    key = {
        "x": list(xt.shape),
        "outs": outs,
        "bias": bool(bs),
        "dtype": str(xt.dtype),
        "train": train,
    }
    if not decide("batch_parallel_linear", key, separate, batched, make_args):
        return False
    wcat = _add_derived(gm, "cat", ws)
    bcat = _add_derived(gm, "cat", bs) if bs else None
    with gm.graph.inserting_before(node):
        y = gm.graph.call_function(torch._C._nn.linear, (x, wcat, bcat))
        pieces = gm.graph.call_function(torch.split, (y, outs, -1))
    for i, n in enumerate(group):
        with gm.graph.inserting_before(node):
            item = gm.graph.call_function(operator.getitem, (pieces, i))
        n.replace_all_uses_with(item)
    for n in group:
        gm.graph.erase_node(n)
    return True


# --- rule: per-head projections → bmm -------------------------------------------------------------


def _per_head(gm: fx.GraphModule, node: fx.Node) -> bool:
    parts = _linear_parts(node)
    if parts is None:
        return False
    x0, w0, b0 = parts
    xt0, wt0 = node_tensor_meta(x0), node_tensor_meta(w0)
    assert xt0 is not None and wt0 is not None

    def same(n: fx.Node) -> bool:
        q = _linear_parts(n)
        if q is None or q[0] is x0 or (q[2] is None) != (b0 is None):
            return False
        xt, wt = node_tensor_meta(q[0]), node_tensor_meta(q[1])
        return (
            xt is not None
            and wt is not None
            and xt.shape == xt0.shape
            and wt.shape == wt0.shape
            and xt.dtype == xt0.dtype
            and wt.dtype == wt0.dtype
        )

    group = _group(gm, node, same)
    # one input per head: a second linear on an input already in the group is the other rule's
    seen: set[fx.Node] = set()
    heads = []
    for n in group:
        p = _linear_parts(n)
        if p and p[0] not in seen:
            seen.add(p[0])
            heads.append(n)
    if len(heads) < MIN_GROUP:
        return False
    specs = [_linear_parts(n) for n in heads]
    xs = [s[0] for s in specs if s]
    ws = [s[1] for s in specs if s]
    bs = [s[2] for s in specs if s and s[2] is not None]
    h = len(heads)
    out_f, in_f = int(wt0.shape[0]), int(wt0.shape[1])
    lead = tuple(int(s) for s in xt0.shape[:-1])
    train = _training(ws)

    def make_args() -> tuple[Any, ...]:
        return (
            *[_rand(xt0) for _ in range(h)],
            *[_rand(wt0) for _ in range(h)],
            *[torch.randn(out_f) for _ in bs],
        )

    def separate(*a: torch.Tensor) -> list[torch.Tensor]:
        xs_, ws_, bs_ = a[:h], a[h : 2 * h], a[2 * h :]
        return [
            torch.nn.functional.linear(xs_[i], ws_[i], bs_[i] if bs_ else None) for i in range(h)
        ]

    def batched(*a: torch.Tensor) -> list[torch.Tensor]:
        xs_, ws_, bs_ = a[:h], a[h : 2 * h], a[2 * h :]
        w = torch.stack(ws_) if train else _cached_stack(ws_)
        b = (torch.stack(bs_) if train else _cached_stack(bs_)) if bs_ else None
        return list(_heads_bmm(torch.stack(xs_), w, b, lead, in_f, out_f))

    key = {
        "x": list(xt0.shape),
        "w": list(wt0.shape),
        "heads": h,
        "bias": bool(bs),
        "dtype": str(xt0.dtype),
        "train": train,
    }
    if not decide("batch_per_head_linear", key, separate, batched, make_args):
        return False
    wst = _add_derived(gm, "stack", ws)
    bst = _add_derived(gm, "stack", bs) if bs else None
    with gm.graph.inserting_before(node):
        xst = gm.graph.call_function(torch.stack, (xs,))
        ys = gm.graph.call_function(_heads_bmm, (xst, wst, bst, lead, in_f, out_f))
    for i, n in enumerate(heads):
        with gm.graph.inserting_before(node):
            item = gm.graph.call_function(operator.getitem, (ys, i))
        n.replace_all_uses_with(item)
    for n in heads:
        gm.graph.erase_node(n)
    return True


def _heads_bmm(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    lead: tuple[int, ...],
    in_f: int,
    out_f: int,
) -> tuple[torch.Tensor, ...]:
    """[H, *lead, in] @ [H, out, in]ᵀ (+ [H, out]) → H tensors [*lead, out]."""
    h = x.shape[0]
    x3 = x.reshape(h, -1, in_f)
    wt = w.transpose(1, 2)
    y = torch.baddbmm(b.unsqueeze(1), x3, wt) if b is not None else torch.bmm(x3, wt)
    return y.reshape(h, *lead, out_f).unbind(0)


# --- rule: small elementwise ops → foreach --------------------------------------------------------


def _foreach(gm: fx.GraphModule, node: fx.Node) -> bool:
    if (
        node.op != "call_function"
        or node.target not in FOREACH
        or len(node.args) != 1
        or node.kwargs
    ):
        return False
    x0 = node.args[0]
    t0 = node_tensor_meta(x0) if isinstance(x0, fx.Node) else None
    if t0 is None or not _concrete(t0) or t0.numel() > SMALL_NUMEL:
        return False

    def same(n: fx.Node) -> bool:
        if n.op != "call_function" or n.target is not node.target or len(n.args) != 1 or n.kwargs:
            return False
        a = n.args[0]
        t = node_tensor_meta(a) if isinstance(a, fx.Node) else None
        return t is not None and _concrete(t) and t.numel() <= SMALL_NUMEL and t.dtype == t0.dtype

    group = _group(gm, node, same)
    if len(group) < MIN_GROUP:
        return False
    ins = [n.args[0] for n in group]
    metas = [node_tensor_meta(i) for i in ins if isinstance(i, fx.Node)]
    fe = FOREACH[node.target]
    single = node.target

    def make_args() -> tuple[Any, ...]:
        return tuple(_rand(m).abs() + 0.5 for m in metas if m is not None)

    def separate(*a: torch.Tensor) -> list[torch.Tensor]:
        return [single(x) for x in a]

    def batched(*a: torch.Tensor) -> list[torch.Tensor]:
        return list(fe(list(a)))

    key = {
        "op": str(getattr(single, "__name__", single)),
        "shapes": [list(m.shape) for m in metas if m is not None],
        "dtype": str(t0.dtype),
    }
    if not decide("batch_foreach", key, separate, batched, make_args):
        return False
    with gm.graph.inserting_before(node):
        res = gm.graph.call_function(fe, (list(ins),))
    for i, n in enumerate(group):
        with gm.graph.inserting_before(node):
            item = gm.graph.call_function(operator.getitem, (res, i))
        n.replace_all_uses_with(item)
    for n in group:
        gm.graph.erase_node(n)
    return True


BATCHING = Pass(
    "small_kernel_batching",
    [
        Rule("parallel linears on one input -> one concatenated GEMM + split", _parallel_linears),
        Rule("per-head linears of one shape -> bmm + unbind", _per_head),
        Rule("same small unary op on several tensors -> torch._foreach_<op>", _foreach),
    ],
)


# --- derived weights at run time ------------------------------------------------------------------

_CACHE: dict[tuple[Any, ...], torch.Tensor] = {}
_CACHE_MAX = 64


def _cache_key(how: str, ts: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return (how, *[(t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in ts])


def _cached(how: str, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """cat/stack of ``ts``, reused while no input's storage or version counter changes."""
    key = _cache_key(how, ts)
    hit = _CACHE.get(key)
    if hit is None:
        with torch.no_grad():
            hit = torch.cat(list(ts)) if how == "cat" else torch.stack(list(ts))
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = hit
    return hit


def _cached_cat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return _cached("cat", ts)


def _cached_stack(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return _cached("stack", ts)


def derive(d: DerivedInput, args: Sequence[Any]) -> torch.Tensor:
    """The value of a derived input for one call (cached unless autograd needs the op)."""
    ts = [args[i] for i in d.sources]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return torch.cat(ts) if d.how == "cat" else torch.stack(ts)
    return _cached(d.how, ts)


class BatchedCallable:
    """Calls a compiled graph that has derived inputs, computing them from the original inputs."""

    def __init__(self, compiled: Callable[..., Any], derived: Sequence[DerivedInput]) -> None:
        self.compiled = compiled
        self.derived = list(derived)

    def __call__(self, *args: Any) -> Any:
        extra = [derive(d, args) for d in self.derived]
        return self.compiled(*args, *extra)


def derived_example_inputs(
    derived: Sequence[DerivedInput], example_inputs: Sequence[Any]
) -> list[Any]:
    """The example values of the derived inputs (for compiling the rewritten graph)."""
    return [derive(d, example_inputs) for d in derived]
