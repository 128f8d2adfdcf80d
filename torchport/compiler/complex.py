"""Complex-number compilation: rewrite complex graphs into real ones, forward and backward.

torch 2.13's Inductor has no code generation for complex operators (it warns and falls back to
ATen per op), and ``torch._functorch.config.enable_complex_wrapper`` fails on CPU. Here every
complex tensor of an aten graph (as produced by AOTAutograd, so both the forward and the backward
graph) becomes a pair ``(real, imag)`` of real tensors (``imag`` may be known zero), and every op on
complex values becomes real ops, one rule per op in :data:`RULES`:

    (a+bi)(c+di) = (ac - bd) + (ad + bc)i          exp(x+iy) = e^x cos y + i e^x sin y
    (a+bi)/(c+di) = ((ac+bd) + (bc-ad)i)/(c²+d²)    log z = log|z| + i atan2(y, x)
    A@B = (Ar@Br - Ai@Bi) + (Ar@Bi + Ai@Br)i        sqrt z = t + i y/(2t), t = sqrt((|z|+x)/2) (x ≥ 0)
    Π z_k = Π|z_k| · e^(i Σ arg z_k)                asin, acos, acosh: Kahan's √(1±z) formulas

Shape ops (view, permute, slice, select, index, cat, stack, ...) and linear reductions (sum, mean)
apply to both parts. At the boundary a complex input enters as its ``real`` and ``imag`` views (two
strided inputs, no copy) and a complex output leaves as ``view_as_complex`` of a [..., 2] real result. An op with
complex inputs or outputs and no rule raises :class:`ComplexDecompositionError` naming the op —
never a silent fallback.

Numerics: the real graph computes the same formulas as ATen's complex kernels in the parts' real
dtype (float32 for complex64, float64 for complex128); results match eager to rounding (the tests
compare with ``rtol=1e-4`` in complex64 and run ``gradcheck`` in complex128).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from torchport.compiler.complex_rules import (
    RULES,
    ComplexDecompositionError,
    Pair,
    _Emitter,
    _is_complex_val,
    _node_val,
    _pair,
    fold_select_of_stack,
)
from torchport.compiler.passes import eliminate_dead_code

__all__ = [
    "RULES",
    "ComplexAutogradError",
    "ComplexCompiled",
    "ComplexDecompositionError",
    "complex_aot_backend",
    "graph_has_complex",
    "join_outputs",
    "lower_complex",
    "split_inputs",
]


def graph_has_complex(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> bool:
    """True if any input or node value of the graph is a complex tensor."""
    if any(_is_complex_val(x) for x in example_inputs):
        return True
    for n in gm.graph.nodes:
        v = _node_val(n)
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(_is_complex_val(x) for x in vals):
            return True
    return False


# --- the lowering driver --------------------------------------------------------------------------


class _Lowering:
    """Walks a complex aten graph in order and emits the real graph."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.src = gm
        self.graph = fx.Graph()
        self.e = _Emitter(self.graph)
        self.env: dict[fx.Node, Any] = {}
        self.in_layout: list[bool] = []  # per original input: complex?
        self.out_layout: list[bool] = []  # per original output: complex?

    def lookup(self, x: Any) -> Any:
        if isinstance(x, fx.Node):
            return self.env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.lookup(y) for y in x)
        if isinstance(x, dict):
            return {k: self.lookup(v) for k, v in x.items()}
        if isinstance(x, complex):
            return _pair(x)  # a zero imaginary part as known, with its sign
        return x

    def run(self) -> fx.GraphModule:
        for n in self.src.graph.nodes:
            if n.op == "placeholder":
                self._placeholder(n)
            elif n.op == "output":
                self._output(n)
            elif n.op == "get_attr":
                self.env[n] = self._get_attr(n)
            else:
                self.env[n] = self._call(n)
        gm = fx.GraphModule(self.src, self.graph)
        # rules may emit a part that nothing reads; unused nodes with side effects (a copied-over
        # in-place update) stay
        eliminate_dead_code(gm.graph)
        gm.recompile()
        return gm

    def _get_attr(self, n: fx.Node) -> Any:
        """A complex tensor constant (``x * torch.tensor([1j, 2j])``) becomes two real constants
        on the module, its real and imaginary parts; other attributes are read as they are."""
        assert isinstance(n.target, str)
        value: Any = self.src
        for atom in n.target.split("."):
            value = getattr(value, atom)
        if not (isinstance(value, torch.Tensor) and value.is_complex()):
            return self.graph.get_attr(n.target)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        names = []
        with unset_fake_temporarily():  # the compiler may run under AOTAutograd's fake mode
            parts = (("re", value.real.detach().clone()), ("im", value.imag.detach().clone()))
        for part, data in parts:
            name = f"{n.target.replace('.', '_')}_{part}"
            while hasattr(self.src, name):
                name += "_"
            setattr(self.src, name, data)
            names.append(name)
        return Pair(self.graph.get_attr(names[0]), self.graph.get_attr(names[1]))

    def _placeholder(self, n: fx.Node) -> None:
        val = _node_val(n)
        if _is_complex_val(val):
            # x.real and x.imag enter as two strided inputs (views, no copy). Selecting them
            # from a view_as_real input in the graph would make Inductor lower the select to a
            # squeeze view whose stride computation guards a symbolic batch size != 1, i.e. a
            # graph that recompiles (and is re-specialised) at size 1 under dynamic shapes.
            re = self.graph.placeholder(f"{n.name}_re")
            im = self.graph.placeholder(f"{n.name}_im")
            self.env[n] = Pair(re, im)
            self.in_layout.append(True)
        else:
            self.env[n] = self.graph.placeholder(n.name)
            self.in_layout.append(False)

    def _output(self, n: fx.Node) -> None:
        outs = []
        results = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        for o in results:
            v = self.lookup(o)
            if isinstance(v, Pair):
                ref = v.re if isinstance(v.re, fx.Node) else None
                assert ref is not None, "complex output with a constant real part"
                outs.append(self._stacked(o, v.re, self.e.dense_im(v, ref)))
                self.out_layout.append(True)
            else:
                outs.append(v)
                self.out_layout.append(False)
        self.graph.output(tuple(outs))

    def _stacked(self, o: Any, re: Any, im: Any) -> Any:
        """``[..., 2]`` (real, imag) of a complex output, laid out as traced where that layout is
        dense but not row-major (``exp(t.t())``, an inverse): the parts are stacked in stride
        order and permuted back, so a compiler writes that layout directly and the joined
        output needs no restriding copy (``ComplexCompiled`` still copies if it differs)."""
        v = _node_val(o) if isinstance(o, fx.Node) else None
        if (
            v is None
            or not all(isinstance(s, int) for s in (*v.shape, *v.stride()))
            or v.is_contiguous()
            or v.numel() <= 1
            or not is_non_overlapping_and_dense_or_false(v)
        ):
            return self.e.call(torch.stack, [re, im], -1)
        order = sorted(range(v.dim()), key=lambda d: -v.stride(d))  # outermost first
        back = [order.index(d) for d in range(v.dim())] + [v.dim()]
        parts = [self.e.call(torch.permute, x, order) for x in (re, im)]
        return self.e.call(torch.permute, self.e.call(torch.stack, parts, -1), back)

    def _call(self, n: fx.Node) -> Any:
        args, kwargs = self.lookup(n.args), self.lookup(n.kwargs)
        val = _node_val(n)
        touches = _is_complex_val(val) or any(
            isinstance(x, Pair) for x in _flat(args) + _flat(list(kwargs.values()))
        )
        if isinstance(val, (list, tuple)) and any(_is_complex_val(v) for v in val):
            touches = True
        if not touches:
            if n.target is torch.ops.aten.select.int and len(args) == 3 and not kwargs:
                src = _node_val(n.args[0]) if isinstance(n.args[0], fx.Node) else None
                ndim = src.dim() if isinstance(src, torch.Tensor) else None
                part = fold_select_of_stack(args[0], args[1], args[2], ndim)
                if part is not None:
                    return part
            return self.graph.create_node(n.op, n.target, args, kwargs, name=n.name)
        rule = RULES.get(n.target)
        if rule is None:
            raise ComplexDecompositionError(
                f"torchport complex compilation has no real decomposition for {n.target} "
                f"(node {n.name!r}: {n.format_node()}); compile with complex=False to run complex "
                "graphs through Inductor's ATen fallback instead"
            )
        out = rule(self, n, args, kwargs)
        if _is_complex_val(val) and not isinstance(out, Pair):
            out = Pair(out, None)
        return out


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [z for y in x for z in _flat(y)]
    return [x]


class ComplexAutogradError(RuntimeError):
    """The real graph of :func:`lower_complex` was run where autograd would differentiate it."""


def _refuse_autograd(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a lowered graph: refuse inputs that require grad (with grad enabled).

    The rules compute ATen's values, not differentiable formulas: they select special values with
    masks (``exp`` keeps y where y = 0, logcumsumexp splits the terms by the sign of sin y), and
    the derivative of such a mask is 0, so autograd through the real graph gave wrong gradients
    at those points (logcumsumexp and exp at zero imaginary parts). AOTAutograd lowers the forward
    and the backward graph separately and runs neither under autograd.
    """
    if not torch.is_grad_enabled():
        return
    from torch._subclasses.fake_tensor import FakeTensor

    for i, a in enumerate(args):
        # a fake input is a trace (Inductor's re-trace of the graph), not a differentiation
        if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, FakeTensor):
            raise ComplexAutogradError(
                "the real graph of a complex lowering must not be differentiated (its rules "
                "select ATen's values with masks, whose derivatives are wrong at those points); "
                f"input {i} requires grad. Compile with torchport.compile (complex=True lowers "
                "the forward and the backward graph separately) or run it under torch.no_grad()"
            )


def lower_complex(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[bool], list[bool]]:
    """Rewrite a complex aten graph into a real one.

    Returns ``(real_gm, in_layout, out_layout)``: a complex input becomes two inputs, its ``real``
    and ``imag`` views, a complex output is returned as ``[..., 2]`` (real, imag); the layouts say which
    inputs and outputs were complex. Calling ``real_gm`` with an input that requires grad, grad
    enabled, raises :class:`ComplexAutogradError`: the real graph is not differentiable.
    """
    lw = _Lowering(gm)
    real = lw.run()
    real.register_forward_pre_hook(_refuse_autograd)
    return real, lw.in_layout, lw.out_layout


def split_inputs(
    args: Sequence[Any],
    in_layout: Sequence[bool],
    *,
    contiguous: bool | Sequence[bool] = False,
) -> list[Any]:
    """Complex tensors → their ``real`` and ``imag`` parts, two inputs each; other inputs unchanged.

    The parts are strided views (no copy unless a conj/neg bit is set), or contiguous copies with
    ``contiguous=True`` (or, per input, where ``contiguous[i]`` is true). Graphs with symbolic
    sizes need them: Inductor computes the strides of a view of a non-contiguous input by
    guarding each symbolic size != 1, which would specialise the graph away from size 1 (a
    recompile there, inside a dynamic spec). So does a backward input whose traced layout is not
    dense (see :class:`ComplexCompiled`).
    """
    flags = [contiguous] * len(args) if isinstance(contiguous, bool) else list(contiguous)
    out: list[Any] = []
    for x, is_c, contig in zip(args, in_layout, flags, strict=True):
        if is_c:
            z = x.resolve_conj().resolve_neg()
            re, im = z.real, z.imag
            out += [re.contiguous(), im.contiguous()] if contig else [re, im]
        else:
            out.append(x)
    return out


@contextlib.contextmanager
def oblivious_view_strides(dynamic: bool) -> Iterator[None]:
    """Inductor's view lowering computes the strides of a view of a non-contiguous buffer (an
    expanded gradient, a sliced part) by *guarding* each backed symbolic size != 1; only unbacked
    sizes get the size-oblivious computation. Under a dynamic spec (``backed_size_oblivious``) a
    graph would thereby be specialised away from size 1 and recompile there: a real graph from
    complex decomposition, and a spec'd Inductor compile of ordinary indexing (``x[:, -1]``; the
    backend compiles those inside this too). While compiling such a graph, the stride
    computation is made size-oblivious for backed sizes too: the view strides it derives hold
    for every size, as torch relies on for unbacked sizes (a view it cannot prove valid becomes
    a copy)."""
    import torch.fx.experimental._config as fx_config
    from torch._subclasses import fake_impls

    if not dynamic or not getattr(fx_config, "backed_size_oblivious", False):
        yield
        return
    from torch._inductor import config as inductor_config

    original = fake_impls._compute_stride

    def oblivious(
        old_shape: Any, old_stride: Any, new_shape: Any, size_oblivious: bool = False
    ) -> Any:
        return original(old_shape, old_stride, new_shape, size_oblivious=True)

    fake_impls._compute_stride = oblivious
    try:
        # the FX graph cache keys on the graph, not on this patch: never reuse (or store) an
        # artifact compiled with the guarding stride computation for such a graph
        with inductor_config.patch(fx_graph_cache=False):
            yield
    finally:
        fake_impls._compute_stride = original


def has_symbolic_sizes(example_inputs: Sequence[Any]) -> bool:
    """True if any example input is a SymInt or a tensor with a symbolic size."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape):
            return True
    return False


def join_outputs(outs: Sequence[Any], out_layout: Sequence[bool]) -> list[Any]:
    """``[..., 2]`` (real, imag) outputs → complex tensors."""
    return [
        torch.view_as_complex(o if o.stride(-1) == 1 else o.contiguous()) if is_c else o
        for o, is_c in zip(outs, out_layout, strict=True)
    ]


class ComplexCompiled:
    """Runs a complex aten graph (from AOTAutograd) as a real graph compiled by ``inner``.

    With ``inner="inductor"`` the real graph is re-traced to aten ops on the (fake) example inputs
    and handed to Inductor's ``compile_fx_inner``, as Inductor's own forward/backward compilers do.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        inner: str,
        *,
        is_backward: bool = False,
    ) -> None:
        self.real_gm, self.in_layout, self.out_layout = lower_complex(gm)
        self.inner = inner
        self.out_strides = _traced_strides(gm) if inner != "eager" else []
        self.symbolic = symbolic = inner != "eager" and has_symbolic_sizes(example_inputs)
        # Inductor checks each input's strides against the example's on every call. A backward
        # input saved from the forward (z[::2] for z * z.conj()) arrives as the forward's joined
        # output, laid out afresh: the traced layout where that is dense (``_traced_strides``),
        # else contiguous (a stride-12 row of z[::2], an expanded z[:1].expand(6, 6) cannot be
        # rebuilt). Such an input's parts are compiled and passed contiguous.
        self.contiguous = [
            symbolic or (is_backward and inner != "eager" and _not_dense(x)) for x in example_inputs
        ]
        if inner == "eager":
            self._run: Callable[[list[Any]], Any] = lambda a: self.real_gm(*a)
        else:
            self._run = self._inductor(example_inputs, is_backward)

    def _inductor(self, example_inputs: Sequence[Any], is_backward: bool) -> Callable[..., Any]:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        fake_mode = detect_fake_mode(list(example_inputs))
        assert fake_mode is not None, "AOTAutograd hands the compiler fake example inputs"
        allowed = fake_mode.allow_non_fake_inputs
        # tensor constants of the graph (the parts of a complex constant) are real tensors:
        # the trace takes them in as constants
        fake_mode.allow_non_fake_inputs = True
        try:
            with fake_mode:
                fake_real = split_inputs(
                    list(example_inputs), self.in_layout, contiguous=self.contiguous
                )
                aten_gm = make_fx(
                    self.real_gm, decomposition_table=select_decomp_table(), tracing_mode="fake"
                )(*fake_real)
            with oblivious_view_strides(self.symbolic):
                compiled = compile_fx_inner(aten_gm, fake_real, is_backward=is_backward)
        finally:
            fake_mode.allow_non_fake_inputs = allowed
        # Inductor reported the strides of the *real* outputs ([..., 2]); AOTAutograd would apply
        # them to the complex outputs it sees, so report "unknown" for every output instead.
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        if tc is not None and tc.output_strides is not None:
            tc.output_strides[:] = [None] * len(self.out_layout)
        return compiled

    def __call__(self, *call_args: Any) -> list[Any]:
        # AOTAutograd may call boxed (one list, which we clear) or unboxed; graph inputs are
        # never lists, so the two are unambiguous.
        if len(call_args) == 1 and isinstance(call_args[0], list):
            args = call_args[0]
            real_args = split_inputs(args, self.in_layout, contiguous=self.contiguous)
            args.clear()
        else:
            real_args = split_inputs(call_args, self.in_layout, contiguous=self.contiguous)
        outs = self._run(real_args)
        joined = join_outputs(list(outs), self.out_layout)
        for i, strides in self.out_strides:
            o = joined[i]
            if o.stride() != strides:
                joined[i] = torch.empty_strided(
                    o.shape, strides, dtype=o.dtype, device=o.device
                ).copy_(o)
        return joined


def _not_dense(x: Any) -> bool:
    """True for a complex tensor whose layout is not non-overlapping and dense (or not known)."""
    return _is_complex_val(x) and not is_non_overlapping_and_dense_or_false(x)


def _traced_strides(gm: fx.GraphModule) -> list[tuple[int, tuple[int, ...]]]:
    """``(index, strides)`` of the complex outputs whose traced layout is not row-major (ATen's
    inverse is column-major, LAPACK's). A forward output saved for the backward reaches the
    backward graph with the traced strides in its example input, and Inductor's backward checks
    them on every call. The real graph stacks such an output's parts in its stride order
    (``_Lowering._stacked``), so the joined output is normally laid out as traced already; where
    it is not (a size-1 dimension's stride), a copy lays it out. Symbolic strides are left
    alone."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = (
        out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    )
    fixed = []
    for i, r in enumerate(results):
        v = _node_val(r)
        if not _is_complex_val(v) or not all(isinstance(s, int) for s in (*v.shape, *v.stride())):
            continue
        if v.is_contiguous() or v.numel() <= 1:
            continue
        if is_non_overlapping_and_dense_or_false(v):
            fixed.append((i, tuple(v.stride())))
    return fixed


def complex_aot_backend(inner: str) -> Callable[..., Any]:
    """An AOTAutograd backend whose forward and backward graphs go through :class:`ComplexCompiled`
    (graphs that hold no complex value go to Inductor's ``compile_fx_inner`` or run eagerly)."""
    from functorch.compile import make_boxed_func
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    def make(is_backward: bool) -> Callable[..., Any]:
        def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            if inner == "eager" and not graph_has_complex(gm, example_inputs):
                return make_boxed_func(gm.forward)
            cc = ComplexCompiled(gm, example_inputs, inner, is_backward=is_backward)
            boxed = make_boxed_func(cc)
            return boxed

        return compiler

    decompositions = core_aten_decompositions()
    # nansum stays an op: its decomposition (where(isnan(z), 0, z).sum()) took a complex z,
    # which eager's nansum refuses; its rule refuses it as eager does
    decompositions.pop(torch.ops.aten.nansum.default)
    return aot_autograd(
        fw_compiler=make(False),
        bw_compiler=make(True),
        decompositions=decompositions,
    )
