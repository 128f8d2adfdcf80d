"""Small-kernel batching: a pre-grad pass that merges independent, same-kind small operations.

Rules (each rewrites one group found from its first member):

- ``parallel linears → one GEMM``: ``linear(x, W_i, b_i)`` for several ``i`` on the same ``x`` become
  ``linear(x, cat(W_i), cat(b_i))`` and a ``split_with_sizes_copy`` of the result.
- ``per-head projections → bmm``: ``linear(x_h, W_h, b_h)`` on different inputs of one shape with
  weights of one shape become ``baddbmm(stack(b_h), stack(x_h), stack(W_h)ᵀ)`` and an
  ``unbind`` whose pieces are cloned.
- ``small elementwise → foreach``: the same unary op (exp, sigmoid, tanh, ...) on several small
  tensors becomes one ``torch._foreach_<op>`` call.

The two linear rules hand each member a fresh contiguous tensor, as the linear it replaced
returned. Views of the batched result would differ from it: a column slice of the GEMM is not
contiguous (a later ``view`` of it fails), and ``split``/``unbind`` pieces are views from a
multi-output op, which autograd forbids to modify in place (``q.mul_(scale)`` in the graph, or a
caller's in-place write to a returned piece, raised with grad enabled). Inductor removes the copies
where they are no-ops (a same-layout ``clone``, in its post-grad pass), so the compiled batched
graph pays for them only where a piece is a column slice, which the contiguous copy needed anyway.

A group qualifies only if every input of every member is defined before its first member and no
node between its members may have side effects (so the members are independent and the batched op
can sit where the first one was), and no in-place update in the graph reaches a weight it
concatenates before its last member. Concatenated or
stacked *weights* are not computed in the graph: the rule adds a graph input for them, and
:class:`BatchedCallable` computes it from the original weights on each call, reusing the last result
while the weights are unchanged (same storage and version counter) and autograd does not need it.

Whether a graph is batched is measured, not assumed: the backend compiles the graph both ways with
the inner compiler (Inductor by default) and :func:`choose_batched` times the two compiled forms
against each other on copies of the call's inputs (the unbatched form is the anchor); the batched
form is kept only on a win beyond noise, and the choice is cached per graph and input layout.
Timing the compiled forms matters: Inductor fuses the split/stack/unbind glue of a batched graph
that eager mode pays for, so eager timings reject batching that the compiled graph profits from.
``reference`` semantics: the rewritten graph computes exactly what the original does; results may
differ only by GEMM summation order (tested to fp32 rounding).
"""

from __future__ import annotations

import hashlib
import operator
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree as pytree

from torchport import config
from torchport.autotune import choice_cache, median, stats
from torchport.compiler.passes import Pass, Rule, has_side_effects, node_tensor_meta

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
OP = "small_kernel_batching"  # the choice-cache op name of the batching decision
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
    """``first`` and every later node with ``same(node)`` whose inputs precede ``first``.

    The group ends at the first node after ``first`` that may have side effects (an in-place
    update, a random op): the batched op computes every member where ``first`` was, so a member
    past an update of its input (``exp(b); b.mul_(2); exp(b)``) would read the old value.
    """
    pos = _positions(gm)
    p0 = pos[first]
    out = [first]
    for n in gm.graph.nodes:
        if pos[n] <= p0:
            continue
        if has_side_effects(n):
            break
        if same(n) and all(pos[i] < p0 for i in n.all_input_nodes):
            out.append(n)
    return out


def _updated_before(gm: fx.GraphModule, sources: Sequence[fx.Node], end: fx.Node) -> bool:
    """True if a node before ``end`` that may have side effects reads one of ``sources`` or a
    value computed from them (a view): derived inputs are computed from the sources' values at
    the call's start, so an in-graph update of a weight before its linear would be missed."""
    reach = set(sources)
    for n in gm.graph.nodes:
        if n is end:
            return False
        if any(i in reach for i in n.all_input_nodes):
            if has_side_effects(n):
                return True
            reach.add(n)
    return False


# --- the decision: compiled graph against compiled graph ------------------------------------------


def graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> dict[str, Any]:
    """The choice-cache key of one captured graph: its code, its inputs' layout, grad mode."""
    inputs: list[Any] = []
    for a in example_inputs:
        if isinstance(a, torch.Tensor):
            shape, stride = [str(s) for s in a.shape], [str(s) for s in a.stride()]
            inputs.append([shape, stride, str(a.dtype), a.requires_grad])
        else:
            inputs.append(type(a).__name__)  # a SymInt/int input: its value varies per call
    digest = hashlib.sha256(gm.code.encode()).hexdigest()[:20]
    return {
        "graph": digest,
        "inputs": inputs,
        "grad": torch.is_grad_enabled(),
        "inner": inner,
        "threads": torch.get_num_threads(),
        # how the choice was measured: older entries timed otherwise, a batched form without
        # the copies that make the split pieces contiguous ("real-calls"), or one whose pieces
        # were views ("real-calls-contiguous")
        "decider": "real-calls-fresh-pieces",
    }


def timeable(example_inputs: Sequence[Any]) -> bool:
    """True if every input can be copied for timing: plain tensors and Python scalars."""
    plain = (torch.Tensor, torch.nn.Parameter)
    scalars = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, type(None))
    return all(
        type(a) in plain or (isinstance(a, scalars) and not isinstance(a, torch.Tensor))
        for a in example_inputs
    )


def _scratch_copy(a: Any) -> Any:
    """A private copy of one example input (timing must not touch the caller's tensors)."""
    if isinstance(a, torch.Tensor):
        c = a.detach().clone()
        return c.requires_grad_(a.requires_grad)
    return a


def _outputs_close(out: Any, ref: Any) -> bool:
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            low = g.dtype in (torch.float16, torch.bfloat16)
            tol = 2e-2 if low else 1e-4
            if g.shape != w.shape or not torch.allclose(g.detach(), w.detach(), tol, tol):
                return False
        elif g != w:
            return False
    return True


Decided = Callable[[bool, dict[str, float]], None]


class MeasuredBatching:
    """Serves the first real calls alternately from the unbatched and the batched compiled forms,
    timing each call, then settles on the faster form (batched only on a win beyond
    ``autotune_noise``), caches the choice and calls ``decided(use_batched, timings)``.

    Timing real calls in the running program (after ``WARMUP_CALLS`` untimed calls of each form)
    measures what the program will see: timing right after compilation was dominated by the
    machine's state at that moment (Inductor's compile workers starting, other processes).
    Each call runs one form only, so it is as correct (and as side-effecting) as an ordinary call.
    Only the forward is timed.
    """

    def __init__(
        self,
        forms: dict[str, Callable[..., Any]],
        key: dict[str, Any],
        reps: int,
        decided: Decided,
    ) -> None:
        self.forms = forms
        self.key = key
        self.reps = reps
        self.decided = decided
        self.samples: dict[str, list[float]] = {k: [] for k in forms}
        self.calls = 0
        self.chosen: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.chosen is not None:
            return self.chosen(*args)
        name = ORDER[self.calls % 2] if (self.calls // 2) % 2 == 0 else ORDER[1 - self.calls % 2]
        self.calls += 1
        t0 = time.perf_counter()
        out = self.forms[name](*args)
        if self.calls > 2 * WARMUP_CALLS:
            self.samples[name].append(time.perf_counter() - t0)
        if all(len(v) >= self.reps for v in self.samples.values()):
            self._settle()
        return out

    def _settle(self) -> None:
        timings = {k: median(v) for k, v in self.samples.items()}
        noise = float(config.get("autotune_noise"))
        use = timings["batched"] < timings["unbatched"] * (1.0 - noise)
        self.chosen = self.forms["batched" if use else "unbatched"]
        self.forms = {}  # drop the other compiled form
        stats.tuned += 1
        choice_cache.put(OP, self.key, "batched" if use else "unbatched", timings)
        self.decided(use, timings)


ORDER = ("unbatched", "batched")  # call order A B, then B A, ... (each leads half the rounds)
WARMUP_CALLS = 2  # untimed calls of each form before timing


def _snapshot_generators() -> Callable[[], None]:
    """Snapshot the default generators a graph's random ops can draw from; returns the restore.

    The CPU generator, and every CUDA device's when CUDA is initialised: a graph on CUDA
    tensors was compiled (so CUDA initialised) before its check runs, and a process that never
    used CUDA must not initialise it here (``torch.cuda.get_rng_state_all`` would, and fails
    without a GPU). Other accelerators' generators are not covered: torchport's compiler targets
    CPU and CUDA."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    return restore


def batching_runner(
    key: dict[str, Any],
    build: Callable[[bool], Callable[..., Any]],
    example_inputs: Sequence[Any],
    decided: Decided,
) -> Callable[..., Any]:
    """The callable to return for a graph with batchable groups.

    A cached choice (per :func:`graph_key`) compiles only the chosen form. Otherwise both forms
    are compiled (``build(batched)``, with the inner compiler: Inductor by default), checked to
    agree on copies of the example inputs, and served by :class:`MeasuredBatching`, which times
    them on the program's own first calls. With ``autotune`` off the batched form is taken
    untimed (as the autotuner takes its first non-anchor candidate).

    The check's derived inputs are not cached: the copies it runs on die when it returns, so
    their cat/stack could never be reused (and would evict the live weights' entries).

    The check runs the forwards only, under ``no_grad``: this runs inside dynamo's backend call,
    and a backward here made AOTAutograd compile the backward graph (lazily compiled on first
    use) inside dynamo's compile-metrics context, which raised on every call of a graph that
    goes through AOTAutograd (Inductor, complex graphs) with grad enabled.
    """
    hit = choice_cache.get(OP, key)
    if hit is not None and hit.get("choice") in ORDER:
        stats.cache_hits += 1
        use = hit["choice"] == "batched"
        decided(use, dict(hit.get("timings_s", {})))
        return build(use)
    if not config.get("autotune"):
        decided(True, {})
        return build(True)
    forms = {"unbatched": build(False), "batched": build(True)}
    if timeable(example_inputs):
        args = tuple(_scratch_copy(a) for a in example_inputs)
        # the check must not consume random numbers (a graph with dropout or randn would
        # otherwise see a different stream than eager from then on), and both forms draw the
        # same stream, so that random ops agree between them
        restore = _snapshot_generators()
        try:
            with torch.no_grad():
                batched = _call_uncached(forms["batched"], args)
                restore()
                unbatched = _call_uncached(forms["unbatched"], args)
        finally:
            restore()
        if not _outputs_close(batched, unbatched):
            # never expected: the rules are exact up to summation order
            stats.candidates_failed += 1
            choice_cache.put(OP, key, "unbatched", {})
            decided(False, {})
            return forms["unbatched"]
    reps = max(3, int(config.get("autotune_reps")))
    return MeasuredBatching(forms, key, reps, decided)


def _call_uncached(form: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Call one compiled form, computing its derived inputs (if any) without the cache."""
    if isinstance(form, BatchedCallable):
        return form.call_uncached(*args)
    return form(*args)


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
    if _updated_before(gm, ws + bs, group[-1]):
        return False
    outs = [int(node_tensor_meta(w).shape[0]) for w in ws]  # type: ignore[union-attr]
    wcat = _add_derived(gm, "cat", ws)
    bcat = _add_derived(gm, "cat", bs) if bs else None
    with gm.graph.inserting_before(node):
        y = gm.graph.call_function(torch._C._nn.linear, (x, wcat, bcat))
        # fresh contiguous pieces, as the linears returned (not column-slice views of y)
        pieces = gm.graph.call_function(torch.split_with_sizes_copy, (y, outs, -1))
    for i, n in enumerate(group):
        with gm.graph.inserting_before(node):
            piece = gm.graph.call_function(operator.getitem, (pieces, i))
        n.replace_all_uses_with(piece)
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
    if _updated_before(gm, ws + bs, heads[-1]):
        return False
    out_f, in_f = int(wt0.shape[0]), int(wt0.shape[1])
    lead = tuple(int(s) for s in xt0.shape[:-1])
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
    """[H, *lead, in] @ [H, out, in]ᵀ (+ [H, out]) → H fresh tensors [*lead, out] (copies, not
    ``unbind`` views, which autograd forbids to modify in place: see the module docstring)."""
    h = x.shape[0]
    x3 = x.reshape(h, -1, in_f)
    wt = w.transpose(1, 2)
    y = torch.baddbmm(b.unsqueeze(1), x3, wt) if b is not None else torch.bmm(x3, wt)
    # a clone per piece, not ``unbind_copy``: the complex decomposition has no rule for that
    return tuple(piece.clone() for piece in y.reshape(h, *lead, out_f).unbind(0))


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
    if t0.is_complex():
        # the complex decomposition has rules for the ops, not for their _foreach_ forms
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
    fe = FOREACH[node.target]
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

# key -> (weak references to the source tensors, their cat/stack). An entry goes when any of its
# source tensors dies (the weak references' callback): it could never be hit again (a hit needs
# the very tensors), and it held a copy of the weights of a deleted model.
_CACHE: dict[tuple[Any, ...], tuple[tuple[weakref.ref[torch.Tensor], ...], torch.Tensor]] = {}
_CACHE_MAX = 64


def _cache_key(how: str, ts: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return (
        how,
        *[(t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype) for t in ts],
    )


def _combine(how: str, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(ts)) if how == "cat" else torch.stack(list(ts))


def _dropper(key: tuple[Any, ...]) -> Callable[[weakref.ref[torch.Tensor]], None]:
    """The callback of an entry's weak references: drop the entry when a source dies (unless
    the key holds a newer entry by then, whose references are other objects)."""

    def drop(dead: weakref.ref[torch.Tensor]) -> None:
        entry = _CACHE.get(key)
        if entry is not None and any(r is dead for r in entry[0]):
            _CACHE.pop(key, None)

    return drop


def _cached(how: str, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """cat/stack of ``ts``, reused while the same tensors (not only the same addresses) are
    passed and no input's storage or version counter changes.

    The key alone is not enough: a tensor freed after one call and a new one allocated at its
    address for the next (fresh weights per call) have equal addresses and version counters
    (both 0), so a hit also requires each cached source to still be the very tensor passed.
    """
    key = _cache_key(how, ts)
    entry = _CACHE.get(key)
    if entry is not None and all(r() is t for r, t in zip(entry[0], ts, strict=True)):
        return entry[1]
    with torch.no_grad():
        out = _combine(how, ts)
    _CACHE.pop(key, None)
    if len(_CACHE) >= _CACHE_MAX:
        # (tolerates entries a callback removed meanwhile: a source may die in any thread)
        oldest = next(iter(_CACHE), None)
        if oldest is not None:
            _CACHE.pop(oldest, None)
    drop = _dropper(key)
    _CACHE[key] = (tuple(weakref.ref(t, drop) for t in ts), out)
    return out


def _storage_of(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, a wrapper subclass)
        return None


def _after_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimiser step hook: forget the derived weights built from stepped parameters.
    Fused optimisers (``Adam(fused=True)``) and ``.data``-style steps update parameters without
    bumping their version counters, so the key above still matched after such a step and a
    batched graph run under ``no_grad`` (evaluation between training steps) read the weights
    from before it. A parameter without a gradient is skipped, as torch's optimisers skip it:
    clearing everything rebuilt the cat of frozen weights after every step."""
    if not _CACHE:
        return
    stepped = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if not stepped:
        return
    storages = {_storage_of(p) for p in stepped}
    if None in storages:  # a stepped parameter without a storage: no way to match, drop all
        _CACHE.clear()
        return
    for key, (refs, _) in list(_CACHE.items()):
        if any(_storage_of(r()) in (None, *storages) for r in refs):
            _CACHE.pop(key, None)


register_optimizer_step_post_hook(_after_optimizer_step)


def _cached_cat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return _cached("cat", ts)


def _cached_stack(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return _cached("stack", ts)


def derive(d: DerivedInput, args: Sequence[Any]) -> torch.Tensor:
    """The value of a derived input for one call (cached unless autograd needs the op)."""
    ts = [args[i] for i in d.sources]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return _combine(d.how, ts)
    if any(t.is_inference() for t in ts):
        # inference tensors (weights made under inference_mode) have no version counter to
        # validate a cached result with, and may be updated in place inside inference_mode
        return _combine(d.how, ts)
    return _cached(d.how, ts)


class BatchedCallable:
    """Calls a compiled graph that has derived inputs, computing them from the original inputs."""

    def __init__(self, compiled: Callable[..., Any], derived: Sequence[DerivedInput]) -> None:
        self.compiled = compiled
        self.derived = list(derived)

    def __call__(self, *args: Any) -> Any:
        extra = [derive(d, args) for d in self.derived]
        return self.compiled(*args, *extra)

    def call_uncached(self, *args: Any) -> Any:
        """One call whose derived inputs are computed afresh and not cached (for inputs that
        die right after it, as the batching check's copies do)."""
        extra = [_combine(d.how, [args[i] for i in d.sources]) for d in self.derived]
        return self.compiled(*args, *extra)


def derived_example_inputs(
    derived: Sequence[DerivedInput], example_inputs: Sequence[Any]
) -> list[Any]:
    """The example values of the derived inputs (for compiling the rewritten graph)."""
    return [derive(d, example_inputs) for d in derived]
