"""The ``torchport`` torch.compile backend: rule-list FX passes, then Inductor or eager.

``torch.compile(model, backend="torchport")`` and :func:`torchport.compile` route the captured graph
through the passes registered in :data:`PRE_GRAD_PASSES` (on the dynamo graph of torch-level ops,
before autograd) and hand the result to Inductor (``inner="inductor"``, the default) or run it as
is (``inner="eager"``). Capabilities register their passes with :func:`register_pre_grad_pass`;
each call's rewrite counts are kept in :func:`last_report`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from torchport.compiler.passes import Pass, run_passes

INNERS = ("inductor", "eager")


class CompileOptionError(ValueError):
    """An option passed to torchport.compile is not valid."""


@dataclass
class CompileReport:
    """What the backend did to one captured graph."""

    rewrites: dict[str, int] = field(default_factory=dict)
    rule_counts: dict[str, int] = field(default_factory=dict)
    inner: str = "inductor"
    nodes_before: int = 0
    nodes_after: int = 0
    complex: bool = False  # the graph went through complex decomposition
    # small-kernel batching: "batched"/"unbatched" (measured), or why it was not considered
    batching: str = "off"
    batching_timings_s: dict[str, float] = field(default_factory=dict)


PRE_GRAD_PASSES: list[tuple[int, Pass]] = []  # (order, pass); lower order runs first
# the reports of the most recent graphs only: a long-running process (recompiling per shape, or
# compiling many functions) would otherwise keep every report it ever made
MAX_REPORTS = 256
_reports: deque[CompileReport] = deque(maxlen=MAX_REPORTS)
_count = 0  # reports ever recorded, the evicted ones included
_lock = threading.Lock()


def register_pre_grad_pass(p: Pass, *, order: int = 100) -> Pass:
    """Add a pass to every torchport compilation (idempotent per pass name)."""
    with _lock:
        PRE_GRAD_PASSES[:] = [(o, q) for o, q in PRE_GRAD_PASSES if q.name != p.name]
        PRE_GRAD_PASSES.append((order, p))
        PRE_GRAD_PASSES.sort(key=lambda t: t[0])
    return p


def last_report() -> CompileReport | None:
    """Report of the most recent graph compiled by the torchport backend."""
    return _reports[-1] if _reports else None


def reports(since: int = 0) -> list[CompileReport]:
    """Reports of the graphs compiled in this process (the last :data:`MAX_REPORTS` of them),
    from the ``since``-th on: ``n0 = report_count()`` before compiling, ``reports(n0)`` after."""
    with _lock:
        first = _count - len(_reports)  # the number of the oldest report still kept
        return list(_reports)[max(0, since - first) :]


def report_count() -> int:
    """How many graphs the torchport backend has compiled in this process (evicted ones too)."""
    return _count


def _record(report: CompileReport) -> None:
    global _count
    with _lock:
        _reports.append(report)
        _count += 1


@dataclass(frozen=True)
class TorchportBackend:
    """A torch.compile backend callable with torchport's options."""

    inner: str = "inductor"
    passes: Sequence[Pass] | None = None  # None → the registered pre-grad passes
    verify: bool = False
    inductor_options: tuple[tuple[str, Any], ...] = ()
    complex: bool = True  # decompose complex graphs into real ones (forward and backward)
    # small-kernel batching where the autotuner measures a gain (torchport.compile turns it on;
    # off for plain backend="torchport" so other passes see the graph dynamo captured)
    batching: bool = False

    def __post_init__(self) -> None:
        if self.inner not in INNERS:
            raise CompileOptionError(f"inner must be one of {INNERS}, got {self.inner!r}")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        passes = list(self.passes if self.passes is not None else [p for _, p in PRE_GRAD_PASSES])
        if self.batching:
            return self._maybe_batched(gm, example_inputs, passes)
        compiled, report = self._variant(gm, example_inputs, passes)
        _record(report)
        return compiled

    def _maybe_batched(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], passes: list[Pass]
    ) -> Callable[..., Any]:
        """Batch small kernels where the compiled batched graph measures faster than the plain one."""
        from torchport.compiler import batching

        key = batching.graph_key(gm, example_inputs, self.inner)
        batched_gm = _copy_graph_module(gm)  # batching adds inputs; dynamo's own graph keeps its
        before = dict(batching.BATCHING.counts)
        n = batching.BATCHING(batched_gm, verify=self.verify)
        counts = {r: c - before.get(r, 0) for r, c in batching.BATCHING.counts.items()}
        counts = {r: c for r, c in counts.items() if c}
        if not n or not batching.timeable(example_inputs):
            compiled, report = self._variant(gm, example_inputs, passes)
            report.batching = "no batchable group" if not n else "inputs cannot be timed"
            _record(report)
            return compiled
        built: dict[bool, tuple[Callable[..., Any], CompileReport]] = {}

        def build(batched: bool) -> Callable[..., Any]:
            if batched not in built:
                src = batched_gm if batched else _copy_graph_module(gm)
                compiled, rep = self._variant(src, example_inputs, passes)
                if batched:
                    rep.rewrites = {batching.BATCHING.name: n, **rep.rewrites}
                    rep.rule_counts = {**counts, **rep.rule_counts}
                built[batched] = (compiled, rep)
            return built[batched][0]

        report = CompileReport(inner=self.inner, nodes_before=len(gm.graph.nodes))
        report.batching = "measuring"

        def decided(use: bool, timings: dict[str, float]) -> None:
            chosen = built[use][1] if use in built else build_report(use)
            report.rewrites, report.rule_counts = chosen.rewrites, chosen.rule_counts
            report.nodes_after, report.complex = chosen.nodes_after, chosen.complex
            report.batching = "batched" if use else "unbatched"
            report.batching_timings_s = timings

        def build_report(use: bool) -> CompileReport:
            build(use)
            return built[use][1]

        _record(report)
        return batching.batching_runner(key, build, example_inputs, decided)

    def _variant(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], passes: list[Pass]
    ) -> tuple[Callable[..., Any], CompileReport]:
        """Run ``passes`` on ``gm`` (in place) and compile it; derived inputs are computed per call."""
        from torchport.compiler.batching import META_KEY, BatchedCallable, derived_example_inputs

        report = CompileReport(inner=self.inner, nodes_before=len(gm.graph.nodes))
        before = {p.name: dict(p.counts) for p in passes}
        report.rewrites = run_passes(gm, passes, verify=self.verify)
        for p in passes:
            for rule, c in p.counts.items():
                delta = c - before[p.name].get(rule, 0)
                if delta:
                    report.rule_counts[rule] = delta
        report.nodes_after = len(gm.graph.nodes)
        derived = gm.meta.get(META_KEY, [])
        inputs = list(example_inputs) + derived_example_inputs(derived, example_inputs)
        compiled = self._compile_graph(gm, inputs, report)
        return (BatchedCallable(compiled, derived) if derived else compiled), report

    def _compile_graph(
        self, gm: fx.GraphModule, example_inputs: list[Any], report: CompileReport
    ) -> Callable[..., Any]:
        if self.complex:
            from torchport.compiler.complex import complex_aot_backend, graph_has_complex

            if graph_has_complex(gm, example_inputs):
                report.complex = True
                return complex_aot_backend(self.inner)(gm, example_inputs)
        if self.inner == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        from torchport.compiler.complex import has_symbolic_sizes, oblivious_view_strides

        # (size-oblivious view strides only under a dynamic spec: backed_size_oblivious)
        dynamic = has_symbolic_sizes(example_inputs)
        with _symbolic_output_strides(), oblivious_view_strides(dynamic):
            compiled = compile_fx(gm, example_inputs, config_patches=dict(self.inductor_options))
        assert callable(compiled)
        return compiled


_STRIDES = threading.local()  # .on: inside a torchport Inductor compile on this thread


@contextlib.contextmanager
def _symbolic_output_strides() -> Iterator[None]:
    """Inside: Inductor reports a compiled forward's output strides to AOTAutograd as symbolic
    expressions of the graph's sizes, for torchport's compiles only.

    torch 2.13's ``set_tracing_context_output_strides`` reports them as the first call's numbers
    (``evaluate_symexpr``), and AOTAutograd restrides the backward's saved activations to them:
    a graph with a dynamic size traced at one size then failed at every other one
    (``z.sin().sum()`` on ``[2, B]`` with B dynamic, backward at B = 3 after B = 5: "expected
    size 2==2, stride 3==5 at dim=0"; plain ``torch.compile`` fails alike). Later torch keeps
    them symbolic (``deserialize_symexpr``), as this does; a static graph's are numbers either
    way. The report runs on a fresh compile and on a cache hit alike (``post_compile``), so the
    patch is on Inductor's function, active only while this thread compiles for torchport.
    """
    import torch._inductor.output_code as oc

    with _STRIDES_LOCK:
        if not getattr(oc.set_tracing_context_output_strides, "_torchport", False):
            original = oc.set_tracing_context_output_strides

            def report(example_inputs: Sequence[Any], compiled_graph: Any) -> None:
                if not getattr(_STRIDES, "on", False):
                    return original(example_inputs, compiled_graph)
                _report_symbolic_strides(example_inputs, compiled_graph, original)

            report._torchport = True  # type: ignore[attr-defined]
            oc.set_tracing_context_output_strides = report
    outer = getattr(_STRIDES, "on", False)
    _STRIDES.on = True
    try:
        yield
    finally:
        _STRIDES.on = outer


_STRIDES_LOCK = threading.Lock()


def _report_symbolic_strides(
    example_inputs: Sequence[Any], compiled_graph: Any, original: Callable[..., None]
) -> None:
    from torch._guards import TracingContext
    from torch._inductor.utils import shape_env_from_inputs

    tc = TracingContext.try_get()
    env = shape_env_from_inputs(example_inputs)
    exprs = compiled_graph.output_strides
    if tc is None or tc.output_strides is None or env is None or exprs is None:
        return original(example_inputs, compiled_graph)
    try:
        strides = [
            None if ex is None else tuple(env.deserialize_symexpr(e) for e in ex) for ex in exprs
        ]
    except Exception:  # (a symbol this shape env lacks: torch's own numbers, as before)
        return original(example_inputs, compiled_graph)
    assert len(tc.output_strides) == 0
    tc.output_strides.extend(strides)  # type: ignore[arg-type]  # (symbolic: torch's own later form)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing ``gm``'s submodules/attributes with a copy of its graph."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def _registered_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return TorchportBackend()(gm, example_inputs)


def register_backend() -> None:
    """Register ``backend="torchport"`` with torch._dynamo (idempotent)."""
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend as _register

    if "torchport" not in list_backends(exclude_tags=()):
        _register(name="torchport")(_registered_backend)


def compile(
    model: Callable[..., Any],
    *,
    inner: str = "inductor",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    verify: bool = False,
    passes: Sequence[Pass] | None = None,
    inductor_options: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    complex: bool = True,
    batching: bool = True,
) -> Callable[..., Any]:
    """``torch.compile`` with the torchport backend.

    ``inner`` picks what runs the rewritten graph ("inductor" or "eager"); ``verify`` checks the
    graph after every rewrite; ``passes`` replaces the registered pre-grad passes.
    ``dynamic_shapes`` (a :class:`~torchport.ShapesSpec`, :class:`~torchport.ParamsSpec` or dict),
    or a ``@dynamic_spec`` on ``model``/its ``forward``, compiles one graph for every size the spec
    allows and checks each call against it (both at once → ``ValueError``). ``complex`` decomposes
    complex tensors into real/imaginary pairs in the forward and backward graphs; ``batching``
    merges small independent ops (parallel linears, per-head projections, small elementwise ops)
    where the autotuner measures a gain.
    """
    from torchport.frontend.apply import SpecCompiled
    from torchport.frontend.dynamic_spec import resolve_spec

    backend = TorchportBackend(
        inner=inner,
        passes=passes,
        verify=verify,
        inductor_options=tuple(sorted((inductor_options or {}).items())),
        complex=complex,
        batching=batching,
    )
    spec = resolve_spec(model, dynamic_shapes)
    if spec is None:
        return torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if dynamic is True:
        raise CompileOptionError("pass either dynamic=True or a dynamic_shapes spec, not both")
    return SpecCompiled(
        model,
        spec,
        lambda fn: torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=dynamic),
    )
