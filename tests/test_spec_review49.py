"""Dynamic specs, review 49: the strict fallback runs a call once, size-1 broadcasting, make_fx
guards on ints, scalar types on every call, export at sizes 0/1 and derived specs, Parameter
arguments, Inductor view strides, division by a zero size, ``max=1`` variables, module API."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchport
from torchport import (
    DynamicSpecViolation,
    IntVar,
    ShapesSpec,
    ShapeVar,
    TensorSpec,
    UnsupportedSpecError,
    dynamic_spec,
)

_FALLBACK = r"specialises a dynamic dim of its spec"


# --- the strict -> relaxed fallback runs the user's code once -----------------------------------


def _side_effect_then_specialise(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    buf.add_(1)  # (the first graph)
    torch._dynamo.graph_break()
    return x * 2 if x.shape[0] != 1 else x  # a guard on the spec'd dim: strict compile fails


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_break", "fullgraph"])
def test_strict_fallback_after_a_graph_break_runs_earlier_frames_once(fullgraph: bool) -> None:
    # the fallback caught the error of the frame after the break and called the whole function
    # again: the in-place update before the break ran twice (buf 2.0, eager 1.0)
    f = _side_effect_then_specialise
    if fullgraph:

        def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            buf.add_(1)
            return x * 2 if x.shape[0] != 1 else x

    torch._dynamo.reset()
    fn = torchport.compile(
        f,
        inner="eager",
        batching=False,
        fullgraph=fullgraph,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B")])},
    )
    buf = torch.zeros(1)
    with pytest.warns(UserWarning, match=_FALLBACK):
        out = fn(torch.ones(3), buf)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert buf.item() == 1.0
    for n, want in ((1, torch.ones(1)), (4, torch.full((4,), 2.0))):
        assert torch.equal(fn(torch.ones(n), buf), want)
    assert buf.item() == 3.0


def test_strict_fallback_keeps_dropout_and_buffer_updates_as_eager() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        @dynamic_spec({"x": TensorSpec([ShapeVar("B"), 4])})
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps.add_(1)
            h = torch.nn.functional.dropout(x, 0.5, training=True)
            torch._dynamo.graph_break()
            return h / 2 if x.shape[0] != 1 else h

    torch._dynamo.reset()
    m_c, m_e = M(), M()
    fn = torchport.compile(m_c, inner="eager", batching=False)
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=_FALLBACK):
        out_c = fn(x)
    torch.manual_seed(0)
    out_e = m_e(x)
    assert torch.equal(out_c, out_e)  # (dropout drew its mask once)
    assert m_c.steps.item() == m_e.steps.item() == 1


# --- a size 1 that broadcasts --------------------------------------------------------------------


def test_size_one_that_broadcasts_falls_back_instead_of_failing() -> None:
    # x + w (w of size 4) at T = 1: the size-oblivious trace takes T as "not 1", so T must be
    # 4, and failed with TorchRuntimeError on every call at T = 1
    w = torch.randn(4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + w

    torch._dynamo.reset()
    fn = torchport.compile(
        f,
        inner="eager",
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), ShapeVar("T")])},
    )
    x1 = torch.randn(2, 1)
    with pytest.warns(UserWarning, match=r"size-oblivious trace fails at a size 0 or 1"):
        torch.testing.assert_close(fn(x1), f(x1))
    for shape in [(2, 1), (3, 4), (5, 1), (0, 4)]:
        x = torch.randn(shape)
        torch.testing.assert_close(fn(x), f(x))


def test_genuine_error_at_size_one_is_the_eager_error() -> None:
    w = torch.randn(4)
    fn = torchport.compile(
        lambda x: x @ w,
        inner="eager",
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("T")])},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"size mismatch|inconsistent|mat"):
            fn(torch.randn(1))


# --- make_fx: guards on int arguments ------------------------------------------------------------


def _branch_on_int(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * 10 if n > 4 else x + 1


@pytest.mark.parametrize("n_spec", [IntVar("n", min=0, max=100), None], ids=["IntVar", "unspecd"])
def test_make_fx_checks_guards_on_int_arguments(n_spec: IntVar | None) -> None:
    # the branch taken on n (traced with n = 6) was not checked: n = 2 computed x * 10
    spec = {"x": TensorSpec([ShapeVar("B")])} | ({"n": n_spec} if n_spec is not None else {})
    gm = torchport.make_fx(_branch_on_int, dynamic_shapes=spec)(torch.ones(4), 6)
    x = torch.ones(3)
    assert torch.equal(gm(x, 7), _branch_on_int(x, 7))
    with pytest.raises(
        DynamicSpecViolation, match=r"guards hold \(.*5 <= L\['t1'\].*\[\(3,\), 2\]"
    ):
        gm(x, 2)


# --- scalar IntVar types on every call -----------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [10.5, -0.5, True, torch.tensor(10.9)],
    ids=["float_above_max", "float_below_min", "bool", "tensor"],
)
def test_scalar_intvar_type_is_checked_on_every_call(bad: object) -> None:
    # after a first call with an int, a float/bool/tensor was truncated with int() and accepted
    spec = {"x": TensorSpec([ShapeVar("B")]), "n": IntVar("n", min=0, max=10)}

    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    fn = torchport.compile(f, inner="eager", batching=False, dynamic_shapes=spec)
    gm = torchport.make_fx(f, dynamic_shapes=spec)(torch.ones(2), 3)
    x = torch.ones(2)
    assert torch.equal(fn(x, 3), x * 3)
    msg = rf"argument 'n': its spec n describes a Python int, got {type(bad).__name__}"
    with pytest.raises(DynamicSpecViolation, match=msg):
        fn(x, bad)
    with pytest.raises(DynamicSpecViolation, match=msg):
        gm(x, bad)


# --- export: example sizes 0/1, derived specs ----------------------------------------------------


@pytest.mark.parametrize("example", [0, 1])
def test_export_takes_an_example_size_0_or_1(example: int) -> None:
    spec = {"x": TensorSpec([ShapeVar("B", max=64), 4])}
    ep = torchport.export(lambda x: x * 2, (torch.randn(example, 4),), dynamic_shapes=spec)
    for n in (0, 1, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(ep.module()(x), x * 2)


def test_export_derived_specs_hold_for_every_size_the_spec_allows() -> None:
    b_, t_ = ShapeVar("B", max=64), ShapeVar("T", max=64)
    ep = torchport.export(
        lambda x, y: x.reshape(-1) + y,
        (torch.ones(3, 4), torch.ones(12)),
        dynamic_shapes={"x": TensorSpec([b_, t_]), "y": TensorSpec([b_ * t_])},
    )
    for b, t in [(1, 3), (0, 5), (2, 7)]:  # (exported at B = 3: guarded B * T >= 4)
        assert ep.module()(torch.ones(b, t), torch.ones(b * t)).shape == (b * t,)

    def g(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.sum() + y.sum()

    ep = torchport.export(
        g,
        (torch.ones(4), torch.ones(66)),
        dynamic_shapes={"x": TensorSpec([b_]), "y": TensorSpec([70 - b_])},
    )
    assert ep.module()(torch.ones(1), torch.ones(69)).item() == 70.0
    # 2B - 1: export wanted B's Dim to start where 2B - 1 >= 0
    ep = torchport.export(
        g,
        (torch.ones(4), torch.ones(7)),
        dynamic_shapes={"x": TensorSpec([b_]), "y": TensorSpec([2 * b_ - 1])},
    )
    for b in (1, 4, 9):
        assert ep.module()(torch.ones(b), torch.ones(2 * b - 1)).item() == 3 * b - 1


# --- a spec'd dim of an nn.Parameter argument ----------------------------------------------------


def test_spec_dim_of_a_parameter_argument_shares_one_graph() -> None:
    # torch 2.13's dynamo forced Parameters static: one graph per size
    torch._dynamo.reset()
    fn = torchport.compile(
        lambda p: p * 2 + 1,
        inner="eager",
        batching=False,
        dynamic_shapes={"p": TensorSpec([ShapeVar("B", max=64), None])},
    )
    n0 = torchport.compiler.report_count()
    for n in (4, 5, 6, 9):
        p = torch.nn.Parameter(torch.randn(n, 3))
        torch.testing.assert_close(fn(p), p * 2 + 1)
    assert torchport.compiler.report_count() - n0 == 1


# --- Inductor: view strides of a spec'd dim ------------------------------------------------------


def test_inductor_indexing_a_spec_dim_keeps_one_graph() -> None:
    # Inductor's view-stride computation guarded T != 1 (x[:, -1]): the strict compile failed,
    # warned that the function specialises the dim, and recompiled per size class
    torch._dynamo.reset()
    fn = torchport.compile(
        lambda x: x[:, -1] * 2,
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), ShapeVar("T"), 8])},
    )
    n0 = torchport.compiler.report_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with torch.no_grad():
            for b, t in [(3, 5), (6, 1), (1, 7)]:
                x = torch.randn(b, t, 8)
                torch.testing.assert_close(fn(x), x[:, -1] * 2)
    assert fn.relaxed is None
    assert torchport.compiler.report_count() - n0 == 1


# --- division by a zero size ---------------------------------------------------------------------


def test_division_by_a_zero_size_is_a_spec_violation() -> None:
    h, d = ShapeVar("H"), ShapeVar("D")
    spec = ShapesSpec({"x": TensorSpec([h, d])}, assumptions=[d % h == 0])
    fn = torchport.compile(lambda x: x * 2, inner="eager", batching=False, dynamic_shapes=spec)
    assert fn(torch.ones(2, 4)).shape == (2, 4)
    with pytest.raises(DynamicSpecViolation, match=r"assumption D%H == 0 divides by zero with H=0"):
        fn(torch.ones(0, 0))
    spec2 = {"x": TensorSpec([h, d]), "y": TensorSpec([d // h])}
    fn2 = torchport.compile(
        lambda x, y: x.sum() + y.sum(), inner="eager", batching=False, dynamic_shapes=spec2
    )
    with pytest.raises(
        DynamicSpecViolation,
        match=r"argument 'y' dim 0: expected D//H, which divides by zero .*H=0",
    ):
        fn2(torch.ones(0, 3), torch.ones(1))


# --- a variable of max 1 -------------------------------------------------------------------------


def test_variable_of_max_one_compiles_and_export_refuses_it_typed() -> None:
    # compile raised an untyped InternalTorchDynamoError (ValueRangeError [2:1]), export a
    # UserError
    spec = {"x": TensorSpec([ShapeVar("V", max=1), 3])}
    torch._dynamo.reset()
    fn = torchport.compile(lambda x: x + 1, inner="eager", batching=False, dynamic_shapes=spec)
    for n in (1, 0, 1):
        x = torch.ones(n, 3)
        assert torch.equal(fn(x), x + 1)
    gm = torchport.make_fx(lambda x: x + 1, dynamic_shapes=spec)(torch.ones(1, 3))
    assert gm(torch.ones(0, 3)).shape == (0, 3)
    with pytest.raises(UnsupportedSpecError, match=r"variable V has max=1; .*max >= 2"):
        torchport.export(lambda x: x + 1, (torch.ones(1, 3),), dynamic_shapes=spec)


# --- the module API of a compiled module with a spec ---------------------------------------------


def test_compiled_module_with_a_spec_keeps_the_module_api() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        @dynamic_spec({"x": TensorSpec([ShapeVar("B"), 4])})
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    m = M()
    cm = torchport.compile(m, inner="eager", batching=False)
    assert cm.eval() is cm and not m.training
    assert cm.lin is m.lin
    assert set(cm.state_dict()) == {"lin.weight", "lin.bias"}
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(cm(x), m(x))
    with pytest.raises(AttributeError, match=r"no_such"):
        _ = cm.no_such


# --- review of the frame fallback: other compiles' frames, genuine errors ------------------------


def _record_compile(seen: list[tuple[bool, bool]]) -> object:
    """A backend that records (size-oblivious config on, some input size symbolic)."""
    import torch.fx.experimental._config as fx_config

    def backend(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        symbolic = any(
            isinstance(v, torch.SymInt)
            or (isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape))
            for v in values
        )
        seen.append((bool(fx_config.backed_size_oblivious), symbolic))  # type: ignore[attr-defined]
        return gm.forward

    return backend


@pytest.mark.parametrize("graph_break", [False, True], ids=["inlined", "after_break"])
@pytest.mark.parametrize("eager_caller", [False, True], ids=["traced_call", "disabled_caller"])
def test_nested_fullgraph_compile_does_not_run_the_call_twice(
    graph_break: bool, eager_caller: bool
) -> None:
    # a plain torch.compile(fullgraph=True) function called by the spec'd one compiled its own
    # frame under the spec's size-oblivious config and marks, failed at T = 1 (x + w, w of size
    # 4), and its failure re-ran the whole spec'd call: buf.add_ ran twice (2.0, eager 1.0)
    w = torch.randn(4)

    @torch.compile(fullgraph=True, backend="eager")
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x + w

    @torch._dynamo.disable
    def disabled(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(1)
        if graph_break:
            torch._dynamo.graph_break()
        return (disabled(x) if eager_caller else inner(x)) * 2

    torch._dynamo.reset()
    fn = torchport.compile(
        f,
        inner="eager",
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), ShapeVar("T")])},
    )
    buf = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (inlined, the spec'd frame itself fails at T = 1)
        for shape in [(2, 1), (3, 4), (5, 1), (0, 4)]:
            x = torch.randn(shape)
            before = buf.item()
            torch.testing.assert_close(fn(x, buf), (x + w) * 2)
            assert buf.item() == before + 1, shape
    if eager_caller:  # (the spec'd frames themselves hold for every size)
        assert fn.relaxed is None


def test_nested_compile_compiles_as_without_the_spec() -> None:
    # the spec's marks (on the caller's tensor) and config reached another torch.compile's frame
    seen: list[tuple[bool, bool]] = []
    inner = torch.compile(lambda x: x.cos(), backend=_record_compile(seen))

    @torch._dynamo.disable
    def disabled(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    torch._dynamo.reset()
    fn = torchport.compile(
        lambda x: disabled(x) + 1,
        inner="eager",
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), 4])},
    )
    x = torch.randn(3, 4)
    torch.testing.assert_close(fn(x), x.cos() + 1)
    assert seen == [(False, False)]  # as a plain call of inner(x) compiles it
    assert not hasattr(x, "_dynamo_dynamic_indices")


def test_nested_compile_error_is_its_own_and_the_call_runs_once() -> None:
    w = torch.randn(5)

    @torch.compile(fullgraph=True, backend="eager")
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x @ w  # (2, 1) @ (5,): a genuine error

    @torch._dynamo.disable
    def disabled(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(1)
        return disabled(x)

    torch._dynamo.reset()
    fn = torchport.compile(
        f,
        inner="eager",
        batching=False,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), ShapeVar("T")])},
    )
    buf = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no fallback warning either)
        with pytest.raises(Exception, match=r"fake tensor|size mismatch|inconsistent|mat"):
            fn(torch.randn(2, 1), buf)
    assert buf.item() == 1.0
    assert fn.relaxed is None


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_break", "fullgraph"])
def test_genuine_error_at_size_one_does_not_relax_the_wrapper(fullgraph: bool) -> None:
    # x @ w at a wrong size 1 (the size-oblivious trace fails, then eager fails too): the error
    # reached the user but the wrapper also warned that the function specialises and stayed
    # relaxed for good
    w = torch.randn(4, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x @ w

    torch._dynamo.reset()
    fn = torchport.compile(
        f,
        inner="eager",
        batching=False,
        fullgraph=fullgraph,
        dynamic_shapes={"x": TensorSpec([ShapeVar("B"), ShapeVar("T")])},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=r"mat1 and mat2|a and b must have same reduction"):
            fn(torch.randn(1, 5))
    assert fn.relaxed is None
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=_FALLBACK) as rec:  # (T == 4: a real specialisation)
        torch.testing.assert_close(fn(x), f(x))
    assert rec[0].filename == __file__  # (the caller's line, past torch's disable wrapper)


# --- export / make_fx at an example size 0 in an inner dim ----------------------------------------

_INNER_ZERO = {
    "squeeze": lambda x: x.squeeze(1) * 2,
    "softmax": lambda x: x.softmax(1),
    "sort": lambda x: x.sort(1).values,
    "expand": lambda x: x[:, :1].expand(3, x.shape[1]) + x,
}


@pytest.mark.parametrize("api", ["export", "make_fx"])
@pytest.mark.parametrize("name", list(_INNER_ZERO))
def test_export_and_make_fx_take_an_example_size_0_in_an_inner_dim(api: str, name: str) -> None:
    # torch gives an empty [3, 0] tensor strides (1, 1); traced with a symbolic T, the stride
    # logic divided by the example's 0: an untyped ZeroDivisionError
    f = _INNER_ZERO[name]
    spec = {"x": TensorSpec([3, ShapeVar("T")])}
    example = torch.randn(3, 0)
    if api == "export":
        run = torchport.export(f, (example,), dynamic_shapes=spec).module()
    else:
        run = torchport.make_fx(f, dynamic_shapes=spec)(example)
    for t in (0, 1, 2, 5):
        x = torch.randn(3, t)
        torch.testing.assert_close(run(x), f(x))


# --- an outer torch.compile around the spec'd wrapper -----------------------------------------------


def test_outer_torch_compile_around_a_spec_wrapper_inlines_the_function() -> None:
    # dynamo traced into SpecCompiled.__call__: InternalTorchDynamoError ('dict' object has no
    # attribute 'node'). (Review 50: the outer compile now inlines the wrapped function and owns
    # the graph, instead of a graph break around the spec'd compile; a fullgraph outer compile
    # failed at that break: tests/test_spec_review50.py)
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    torch._dynamo.reset()
    sf = torchport.compile(
        f, inner="eager", batching=False, dynamic_shapes={"x": TensorSpec([ShapeVar("B"), 4])}
    )
    g = torch.compile(lambda x: sf(x) + 1, backend="eager")
    for n in (3, 5, 1, 0):
        x = torch.randn(n, 4)
        torch.testing.assert_close(g(x), f(x) + 1)
    # f is part of the outer graph (no frame of its own); an eager call still checks the spec
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    assert len(_debug_get_cache_entry_list(f.__code__)) == 0
    with pytest.raises(DynamicSpecViolation, match=r"expected static size 4, got 5"):
        sf(torch.randn(3, 5))
