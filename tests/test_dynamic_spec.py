"""@dynamic_spec semantics, 2.14's error messages, run-time checks, and compile/export/make_fx."""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport import (
    STATIC,
    DictSpec,
    DynamicSpecViolation,
    IntVar,
    ParamsSpec,
    SeqSpec,
    ShapesSpec,
    ShapeVar,
    TensorSpec,
    dynamic_spec,
)
from torchport.frontend import bind, check_call

# --- spec construction and 2.14's errors -----------------------------------------------------------


def test_shapevar_negative_min_raises() -> None:
    with pytest.raises(ValueError, match=r"ShapeVar requires min >= 0 .* got min=-1"):
        ShapeVar("B", min=-1)


def test_intvar_min_above_max_raises() -> None:
    with pytest.raises(ValueError, match=r"min <= max, got 5 > 2"):
        IntVar("n", min=5, max=2)


def test_tensorspec_rejects_bad_leaf() -> None:
    with pytest.raises(TypeError, match=r"TensorSpec dim 1: expected LeafIntSpec, got str"):
        TensorSpec([ShapeVar("B"), "x"])


def test_paramsspec_sentinels() -> None:
    with pytest.raises(ValueError, match=r"Unknown sentinel key '\*foo'"):
        ParamsSpec({"*foo": []})
    with pytest.raises(ValueError, match=r"'\*args' value must be a list"):
        ParamsSpec({"*args": TensorSpec([1])})
    with pytest.raises(ValueError, match=r"'\*\*kwargs' value must be a dict"):
        ParamsSpec({"**kwargs": [1]})


def test_shapesspec_assumption_type() -> None:
    with pytest.raises(TypeError, match=r"assumptions\[0\]: expected a relation"):
        ShapesSpec({}, assumptions=[True])  # type: ignore[list-item]


def test_stacking_decorators_raises() -> None:
    with pytest.raises(ValueError, match=r"Stacking multiple @dynamic_spec decorators"):

        @dynamic_spec({"x": TensorSpec([ShapeVar("A")])})
        @dynamic_spec({"x": TensorSpec([ShapeVar("B")])})
        def f(x: torch.Tensor) -> torch.Tensor:
            return x


def test_decorator_and_argument_raises() -> None:
    @dynamic_spec({"x": TensorSpec([ShapeVar("B")])})
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    spec = {"x": TensorSpec([ShapeVar("C")])}
    for api in (
        lambda: torchport.compile(f, inner="eager", dynamic_shapes=spec),
        lambda: torchport.export(f, (torch.ones(3),), dynamic_shapes=spec),
        lambda: torchport.make_fx(f, dynamic_shapes=spec),
    ):
        with pytest.raises(ValueError, match=r"Both `@dynamic_spec\(...\)` is attached"):
            api()


def test_unknown_parameter_name_raises() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    spec = ShapesSpec({"y": TensorSpec([ShapeVar("B")])})
    with pytest.raises(ValueError, match=r"ParamsSpec has entries \['y'\] that do not match"):
        bind(f, spec, (torch.ones(2),), {}, "export")


def test_variable_only_in_expression_raises() -> None:
    A, B = ShapeVar("A"), ShapeVar("B")

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x

    spec = ShapesSpec({"x": TensorSpec([A]), "y": TensorSpec([2 * B + 1])})
    with pytest.raises(ValueError, match=r"reference unbound IntVar\(s\) \['B'\]"):
        bind(f, spec, (torch.ones(2), torch.ones(5)), {}, "export")
    spec2 = ShapesSpec({"x": TensorSpec([A])}, assumptions=[B > A])
    with pytest.raises(ValueError, match=r"unbound IntVar\(s\) \['B'\]"):
        bind(f, spec2, (torch.ones(2), torch.ones(5)), {}, "export")


def test_tensorspec_rank_mismatch_and_type_errors() -> None:
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match=r"TensorSpec has 2 dims but the tensor has 1"):
        bind(f, ShapesSpec({"x": TensorSpec([1, 2])}), (torch.ones(2), 1), {}, "export")
    with pytest.raises(ValueError, match=r"spec is TensorSpec but the actual arg is int"):
        bind(f, ShapesSpec({"n": TensorSpec([1])}), (torch.ones(2), 1), {}, "export")


# --- run-time checks --------------------------------------------------------------------------------


def _bound(spec: ShapesSpec, args: tuple[object, ...]) -> object:
    def f(x: torch.Tensor, y: torch.Tensor, n: int = 0) -> torch.Tensor:
        return x

    return bind(f, spec, args, {}, "torchport.compile")


def test_runtime_checks_name_argument_dim_relation_value() -> None:
    B = ShapeVar("B", min=2, max=8)
    spec = ShapesSpec({"x": TensorSpec([B, STATIC]), "y": TensorSpec([2 * B + 1])})
    b = _bound(spec, (torch.ones(3, 4), torch.ones(7)))
    assert check_call(b, (torch.ones(3, 4), torch.ones(7)), {}) == {B: 3}  # type: ignore[arg-type]
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'x' dim 0: expected 2 <= B <= 8, got B = 1"
    ):
        check_call(b, (torch.ones(1, 4), torch.ones(3)), {})  # type: ignore[arg-type]
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'x' dim 0: expected 2 <= B <= 8, got B = 9"
    ):
        check_call(b, (torch.ones(9, 4), torch.ones(19)), {})  # type: ignore[arg-type]
    with pytest.raises(
        DynamicSpecViolation,
        match=r"argument 'y' dim 0: expected \(2\*B \+ 1\) = 7 \(with B=3\), got 6",
    ):
        check_call(b, (torch.ones(3, 4), torch.ones(6)), {})  # type: ignore[arg-type]


def test_runtime_repeated_variable_and_static_and_assumption() -> None:
    B, T = ShapeVar("B"), ShapeVar("T")
    spec = ShapesSpec({"x": TensorSpec([B, T]), "y": TensorSpec([B, 5])}, assumptions=[T % 4 == 0])
    b = _bound(spec, (torch.ones(2, 8), torch.ones(2, 5)))
    with pytest.raises(
        DynamicSpecViolation,
        match=r"argument 'y' dim 0: expected B == 2 \(the size of argument 'x' dim 0, which is also B\), got 3",
    ):
        check_call(b, (torch.ones(2, 8), torch.ones(3, 5)), {})  # type: ignore[arg-type]
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'y' dim 1: expected static size 5, got 6"
    ):
        check_call(b, (torch.ones(2, 8), torch.ones(2, 6)), {})  # type: ignore[arg-type]
    with pytest.raises(DynamicSpecViolation, match=r"assumption T%4 == 0 does not hold with T=6"):
        check_call(b, (torch.ones(2, 6), torch.ones(2, 5)), {})  # type: ignore[arg-type]


def test_nested_specs_and_scalars() -> None:
    B, N = ShapeVar("B"), IntVar("n", min=0, max=10)

    def f(batch: dict[str, torch.Tensor], seq: list[torch.Tensor], n: int) -> torch.Tensor:
        return batch["a"]

    spec = ShapesSpec(
        {
            "batch": DictSpec({"a": TensorSpec([B])}),
            "seq": SeqSpec([TensorSpec([B + 1])]),
            "n": N,
        }
    )
    args = ({"a": torch.ones(3), "b": torch.ones(2)}, [torch.ones(4), torch.ones(9)], 4)
    b = bind(f, spec, args, {}, "make_fx")
    assert check_call(b, args, {}) == {B: 3, N: 4}
    with pytest.raises(
        DynamicSpecViolation, match=r"argument \"seq\[0\]\" dim 0|argument 'seq\[0\]' dim 0"
    ):
        check_call(
            b, ({"a": torch.ones(3), "b": torch.ones(2)}, [torch.ones(5), torch.ones(9)], 4), {}
        )
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'n': expected 0 <= n <= 10, got n = 11"
    ):
        check_call(b, (args[0], args[1], 11), {})
    with pytest.raises(ValueError, match=r"DictSpec has entries \['zz'\]"):
        bind(f, ShapesSpec({"batch": DictSpec({"zz": TensorSpec([B])})}), args, {}, "make_fx")


# --- compile: one graph for every size of the spec -----------------------------------------------------


class _Counting:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, gm: torch.fx.GraphModule, ex: object) -> object:
        self.n += 1
        return gm.forward


B = ShapeVar("B", max=64)
T = ShapeVar("T", min=1, max=128)


@dynamic_spec(
    ShapesSpec({"x": TensorSpec([B, T, 4]), "y": TensorSpec([2 * B + 1])}, assumptions=[T % 2 == 0])
)
def _spec_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.sum(-1).mean(1) * 2 + y[: x.shape[0]].sum() + x.shape[1]


def _eager(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.sum(-1).mean(1) * 2 + y[: x.shape[0]].sum() + x.shape[1]


def test_compile_once_for_all_sizes_in_spec() -> None:
    from torchport.frontend import SpecCompiled, resolve_spec

    counter = _Counting()
    spec = resolve_spec(_spec_fn, None)
    assert spec is not None
    fn = SpecCompiled(_spec_fn, spec, lambda f: torch.compile(f, backend=counter))
    for b, t in [(3, 8), (1, 2), (0, 4), (64, 128), (5, 6), (2, 126)]:
        x, y = torch.randn(b, t, 4), torch.randn(2 * b + 1)
        torch.testing.assert_close(fn(x, y), _eager(x, y))
    assert counter.n == 1
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'x' dim 1: expected 1 <= T <= 128, got T = 130"
    ):
        fn(torch.randn(2, 130, 4), torch.randn(5))
    with pytest.raises(DynamicSpecViolation, match=r"assumption T%2 == 0 does not hold with T=7"):
        fn(torch.randn(2, 7, 4), torch.randn(5))
    assert counter.n == 1


def _zero_fn_contig(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(1) @ w + x.shape[1]


def _zero_fn_strided(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(1) @ w + x.shape[1]


_ZERO_SIZES = [(3, 5), (2, 0), (0, 3), (1, 1), (0, 0), (1, 0), (64, 256), (7, 1), (13, 97)]


@pytest.mark.parametrize("first", ["nonempty", "empty"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_sizes_0_1_and_large_share_one_graph(first: str, layout: str) -> None:
    """Size 0 in an inner dim (whose contiguous strides torch clamps) must not recompile."""
    from torchport.frontend import SpecCompiled

    fn_ = _zero_fn_contig if layout == "contiguous" else _zero_fn_strided
    torch._dynamo.reset()
    counter = _Counting()
    b, t = ShapeVar("B", max=64), ShapeVar("T", max=256)
    spec = ShapesSpec({"x": TensorSpec([b, t, STATIC]), "w": TensorSpec([STATIC, STATIC])})
    fn = SpecCompiled(fn_, spec, lambda f: torch.compile(f, backend=counter))
    sizes = _ZERO_SIZES if first == "nonempty" else [(2, 0), *_ZERO_SIZES]
    w = torch.randn(4, 3)
    for bs, ts in sizes:
        x = torch.randn(bs, ts, 4) if layout == "contiguous" else torch.randn(bs, 4, ts).mT
        torch.testing.assert_close(fn(x, w), fn_(x, w))
    assert counter.n == 1


def test_sizes_0_1_and_large_share_one_inductor_graph() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).sum(1) * 2

    spec = {"x": TensorSpec([ShapeVar("B", max=64), ShapeVar("T", max=256), STATIC])}
    fn = torchport.compile(f, dynamic_shapes=spec, batching=False)
    n0 = torchport.compiler.report_count()
    for bs, ts in _ZERO_SIZES:
        x = torch.randn(bs, ts, 4)
        torch.testing.assert_close(fn(x), f(x), rtol=1e-4, atol=1e-4)
    assert torchport.compiler.report_count() - n0 == 1


@dynamic_spec({"x": TensorSpec([ShapeVar("B", max=64), ShapeVar("T", max=256), STATIC])})
def _zero_decorated(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(1) + x.shape[1]


def test_export_and_make_fx_serve_sizes_0_1_and_large() -> None:
    ep = torchport.export(_zero_decorated, (torch.randn(3, 5, 4),))
    gm = torchport.make_fx(_zero_decorated)(torch.randn(3, 5, 4))
    m = ep.module()
    for bs, ts in _ZERO_SIZES:
        x = torch.randn(bs, ts, 4)
        torch.testing.assert_close(m(x), _zero_decorated(x))
        torch.testing.assert_close(gm(x), _zero_decorated(x))


def test_torchport_compile_reads_decorator_on_module_forward() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        # min=2: a 3-D linear guards T != 1 (matmul folding), which a range from 2 implies
        @dynamic_spec({"x": TensorSpec([STATIC, ShapeVar("T", min=2, max=100), STATIC])})
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)).mean(1)

    m = M()
    fn = torchport.compile(m, inner="eager", batching=False)
    n0 = torchport.compiler.report_count()
    with torch.no_grad():
        for t in (5, 2, 17, 3, 100):
            x = torch.randn(2, t, 8)
            torch.testing.assert_close(fn(x), m(x))
    assert torchport.compiler.report_count() - n0 == 1


def test_code_that_specialises_a_spec_dim_warns_and_stays_correct() -> None:
    from torchport.frontend import SpecCompiled

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] == 5 else x.cumsum(0)  # a guard on the dynamic size

    fn = SpecCompiled(
        f,
        ShapesSpec({"x": TensorSpec([ShapeVar("N")])}),
        lambda g: torch.compile(g, backend="eager"),
    )
    with pytest.warns(UserWarning, match=r"specialises a dynamic dim of its spec"):
        out = fn(torch.arange(5.0))
    torch.testing.assert_close(out, torch.arange(5.0) * 2)
    for n in (1, 0, 9):
        torch.testing.assert_close(fn(torch.ones(n)), torch.ones(n).cumsum(0))
    assert fn.relaxed is not None and "5" in fn.relaxed


def test_specialised_dim_of_an_object_attribute_falls_back_too() -> None:
    """The relaxed retry removed the strict marks from the flat inputs only: an ObjectSpec's
    attribute tensor kept them, and the retry raised the same ConstraintViolationError."""
    from torchport import ObjectSpec

    class C:
        w: torch.Tensor

    def g(c: C) -> torch.Tensor:
        return c.w * 10 if c.w.shape[0] > 4 else c.w + 1

    cg = torchport.compile(
        g, inner="eager", dynamic_shapes={"c": ObjectSpec({"w": TensorSpec([ShapeVar("T")])})}
    )
    c = C()
    for n in (6, 2, 9):
        c.w = torch.ones(n)
        if n == 6:
            with pytest.warns(UserWarning, match=r"specialises a dynamic dim of its spec"):
                out = cg(c)
        else:
            out = cg(c)
        assert torch.equal(out, g(c))


# --- export and make_fx -----------------------------------------------------------------------------------


def test_export_with_spec_runs_all_sizes_and_asserts() -> None:
    ep = torchport.export(_spec_fn, (torch.randn(3, 8, 4), torch.randn(7)))
    m = ep.module()
    for b, t in [(1, 2), (0, 4), (64, 128)]:
        x, y = torch.randn(b, t, 4), torch.randn(2 * b + 1)
        torch.testing.assert_close(m(x, y), _eager(x, y))
    with pytest.raises(Exception, match=r"Mod\(s\d+, 2\)|Eq\(Mod"):
        m(torch.randn(1, 3, 4), torch.randn(3))
    with pytest.raises(Exception, match=r"args\[1\]|2\*s\d+ \+ 1|Expected input"):
        m(torch.randn(2, 4, 4), torch.randn(6))


def test_export_with_a_spec_and_keyword_arguments() -> None:
    # torch 2.13's export failed (AssertionError "Must provide a tree_name") on the wrapper's
    # forward(*args, **kwargs) called with keywords
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y.sum()

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
            return f(x, y)

    spec = ShapesSpec({"x": TensorSpec([B]), "y": TensorSpec([B])}, assumptions=[B % 2 == 1])
    for mod in (f, M()):
        m = torchport.export(mod, (torch.ones(3),), {"y": torch.ones(3)}, dynamic_shapes=spec)
        m = m.module()
        torch.testing.assert_close(
            m(torch.ones(5), y=torch.ones(5)), f(torch.ones(5), torch.ones(5))
        )
        with pytest.raises(Exception, match=r"y.size\(\)\[0\] == x.size\(\)\[0\]|Mod"):
            m(torch.ones(5), y=torch.ones(4))

    def g(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return args[0] + kwargs["y"].sum()

    with pytest.raises(ValueError, match=r"keyword arguments \['y'\] go to \*\*kwargs"):
        torchport.export(
            g,
            (torch.ones(3),),
            {"y": torch.ones(3)},
            dynamic_shapes=ParamsSpec(
                {"*args": [TensorSpec([B])], "**kwargs": {"y": TensorSpec([B])}}
            ),
        )


def test_export_keeps_a_scalar_intvar_dynamic() -> None:
    # export specialised the int (the program ran only for the example's n: "Guard failed:
    # args_1 == 2"); it is now a dynamic int, its range and relations checked in the graph
    n_var = IntVar("n", min=1, max=10)

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return x * n + x[:n].sum()

    ep = torchport.export(
        M(), (torch.ones(5), 2), dynamic_shapes={"x": TensorSpec([B]), "n": n_var}
    )
    m = ep.module()
    for n in (1, 4, 10):
        torch.testing.assert_close(m(torch.ones(12), n), M()(torch.ones(12), n))
    for n in (0, 11):
        with pytest.raises(Exception, match=r"<= 10|1 <= "):
            m(torch.ones(12), n)


def test_make_fx_with_spec_is_symbolic_and_checks() -> None:
    gm = torchport.make_fx(_spec_fn)(torch.randn(3, 8, 4), torch.randn(7))
    for b, t in [(1, 2), (0, 4), (64, 128)]:
        x, y = torch.randn(b, t, 4), torch.randn(2 * b + 1)
        torch.testing.assert_close(gm(x, y), _eager(x, y))
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'y' dim 0: expected \(2\*B \+ 1\) = 3"
    ):
        gm(torch.randn(1, 2, 4), torch.randn(4))
    static_dims = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert "s" in str(static_dims[0].meta["val"].shape[0])  # B is symbolic
    assert static_dims[0].meta["val"].shape[2] == 4  # the static dim stays static


def test_make_fx_checks_the_dims_the_spec_leaves_static() -> None:
    # the graph holds static sizes as constants (x.shape[1] is 4 in it): another size would be
    # computed with the traced one
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.sum(-1) / x.shape[1] + y.sum() / y.shape[0]

    gm = torchport.make_fx(f, dynamic_shapes={"x": TensorSpec([B, STATIC])})(
        torch.ones(3, 4), torch.ones(2)
    )
    torch.testing.assert_close(
        gm(torch.ones(5, 4), torch.ones(2)), f(torch.ones(5, 4), torch.ones(2))
    )
    with pytest.raises(DynamicSpecViolation, match=r"argument 'x' dim 1: expected static size 4"):
        gm(torch.ones(3, 5), torch.ones(2))
    with pytest.raises(DynamicSpecViolation, match=r"argument 'y' dim 0: expected static size 2"):
        gm(torch.ones(3, 4), torch.ones(6))


@pytest.mark.parametrize("var", [ShapeVar("N"), ShapeVar("N", max=100), IntVar("N")])
def test_make_fx_checks_the_guards_its_trace_took(var: ShapeVar) -> None:
    """A function that branches on a dynamic size is traced down one branch: the graph held
    only where that branch's condition does, and a call past it computed the traced branch's
    formula (``x * 10`` for a size-2 x, where eager gives ``x + 1``) without a word."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 10 if x.shape[0] > 4 else x + 1

    gm = torchport.make_fx(f, dynamic_shapes={"x": TensorSpec([var])})(torch.ones(6))
    assert torch.equal(gm(torch.ones(9)), f(torch.ones(9)))
    for n in (0, 1, 2, 4):
        with pytest.raises(DynamicSpecViolation, match=r"holds only where its guards hold"):
            gm(torch.ones(n))
    # (a guard that splits 1 from larger sizes is kept too: size-oblivious tracing drops
    # torch's own layout guards, not the function's)
    g = torchport.make_fx(
        lambda x: x * 10 if x.shape[0] > 1 else x + 1, dynamic_shapes={"x": TensorSpec([var])}
    )(torch.ones(6))
    with pytest.raises(DynamicSpecViolation, match=r"holds only where its guards hold"):
        g(torch.ones(1))
    # the traced layout is not a guard: a transposed input of allowed sizes runs
    h = torchport.make_fx(f, dynamic_shapes={"x": TensorSpec([var, 3])})(torch.ones(6, 3))
    xt = torch.randn(3, 7).t()
    assert torch.equal(h(xt), f(xt))


def test_compile_leaves_no_dim_marks_on_the_callers_tensors() -> None:
    # mark_dynamic's marks live on the tensor: left there, another torch.compile that
    # specialises the dim fails with ConstraintViolationError
    fn = torchport.compile(
        lambda x: x * 2, inner="eager", batching=False, dynamic_shapes={"x": TensorSpec([B, 8])}
    )
    x = torch.randn(4, 8)
    torch.testing.assert_close(fn(x), x * 2)
    assert not hasattr(x, "_dynamo_dynamic_indices")

    def specialises(t: torch.Tensor) -> torch.Tensor:
        return t + 1 if t.shape[0] == 4 else t - 1

    torch.testing.assert_close(torch.compile(specialises, backend="eager")(x), x + 1)
    torch.testing.assert_close(fn(torch.randn(5, 8)).shape, torch.Size([5, 8]))


def test_compile_checks_the_rank_of_every_call() -> None:
    # the binding is cached per call structure, which does not include the rank
    fn = torchport.compile(
        lambda x: x * 2, inner="eager", batching=False, dynamic_shapes={"x": TensorSpec([B, 4])}
    )
    fn(torch.ones(3, 4))
    for bad, got in ((torch.ones(3), "1-D"), (torch.ones(3, 4, 5), "3-D")):
        with pytest.raises(
            DynamicSpecViolation, match=rf"'x': its TensorSpec has 2 dims, got a {got}"
        ):
            fn(bad)


def test_scalar_intvar_compiles_once() -> None:
    from torchport.frontend import SpecCompiled

    counter = _Counting()
    N = IntVar("n", min=0, max=100)

    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + 1

    fn = SpecCompiled(f, ShapesSpec({"n": N}), lambda g: torch.compile(g, backend=counter))
    for n in (3, 7, 0, 100, 42):
        torch.testing.assert_close(fn(torch.ones(4), n), torch.ones(4) * n + 1)
    assert counter.n == 1
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'n': expected 0 <= n <= 100, got n = 101"
    ):
        fn(torch.ones(4), 101)


def test_export_module_spec_keeps_parameter_names() -> None:
    Bv = ShapeVar("B", max=32)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        @dynamic_spec({"x": TensorSpec([Bv, 4]), "y": TensorSpec([Bv])})
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum(1) + y

    m = M()
    ep = torchport.export(m, (torch.randn(5, 4), torch.randn(5)))
    assert "lin.weight" in ep.state_dict
    x = torch.randn(9, 4)
    torch.testing.assert_close(ep.module()(x, torch.zeros(9)), m(x, torch.zeros(9)))


# --- 2.14 API parity: ObjectSpec, globals, to_jsonable, items -------------------------------------


class _Cfg:
    def __init__(self, x: torch.Tensor, n: int) -> None:
        self.x = x
        self.n = n
        self.inner = _Inner(torch.ones(x.shape[0]))


class _Inner:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


def _obj_fn(cfg: _Cfg) -> torch.Tensor:
    return cfg.x.sum(1) * cfg.inner.w + cfg.n


def test_object_spec_binds_attributes_and_compiles_once() -> None:
    from torchport import ObjectSpec
    from torchport.frontend import SpecCompiled

    b = ShapeVar("B", min=1, max=64)
    spec = ShapesSpec(
        {
            "cfg": ObjectSpec(
                {"x": TensorSpec([b, STATIC]), "inner": ObjectSpec({"w": TensorSpec([b])})}
            )
        }
    )
    counter = _Counting()
    fn = SpecCompiled(_obj_fn, spec, lambda f: torch.compile(f, backend=counter))
    for rows in (3, 1, 17, 64):
        cfg = _Cfg(torch.randn(rows, 4), 2)
        torch.testing.assert_close(fn(cfg), _obj_fn(cfg))
    assert counter.n == 1
    bad = _Cfg(torch.randn(5, 4), 2)
    bad.inner.w = torch.ones(6)
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'cfg.inner.w' dim 0: expected B == 5 .*got 6"
    ):
        fn(bad)
    with pytest.raises(
        DynamicSpecViolation, match=r"argument 'cfg.x' dim 0: expected 1 <= B <= 64, got B = 65"
    ):
        fn(_Cfg(torch.randn(65, 4), 2))


def test_object_spec_errors() -> None:
    from torchport import ObjectSpec

    with pytest.raises(TypeError, match=r"ObjectSpec fields must be attribute names .*'a b'"):
        ObjectSpec({"a b": None})
    spec = ShapesSpec({"cfg": ObjectSpec({"y": TensorSpec([ShapeVar("B")])})})
    with pytest.raises(ValueError, match=r"cfg: ObjectSpec has fields \['y'\] that the runtime"):
        bind(_obj_fn, spec, (_Cfg(torch.randn(2, 3), 1),), {}, "torchport.compile")
    spec2 = ShapesSpec({"cfg": ObjectSpec({"x": TensorSpec([ShapeVar("B"), STATIC])})})
    with pytest.raises(ValueError, match=r"torchport.export: argument 'cfg.x' is described by"):
        torchport.export(_obj_fn, (_Cfg(torch.randn(2, 3), 1),), dynamic_shapes=spec2)
    # the same spec as a plain dict is a spec too (not a torch.export dynamic_shapes dict)
    plain = {"cfg": ObjectSpec({"x": TensorSpec([ShapeVar("B"), STATIC])})}
    with pytest.raises(ValueError, match=r"torchport.export: argument 'cfg.x' is described by"):
        torchport.export(_obj_fn, (_Cfg(torch.randn(2, 3), 1),), dynamic_shapes=plain)
    with pytest.raises(ValueError, match=r"cfg: ObjectSpec describes the attributes of a plain"):
        bind(
            _obj_fn,
            ShapesSpec({"cfg": ObjectSpec({"x": None})}),
            ([torch.ones(1), torch.ones(1)],),
            {},
            "torchport.compile",
        )


def test_shapes_spec_globals_is_reserved_as_in_2_14() -> None:
    from torchport import UnsupportedSpecError

    with pytest.raises(UnsupportedSpecError, match=r"ShapesSpec.globals is not supported yet"):
        ShapesSpec({}, globals={"g": 1})
    assert issubclass(UnsupportedSpecError, NotImplementedError)


def test_to_jsonable_and_items() -> None:
    from torchport import ObjectSpec

    b = ShapeVar("B", max=8, optimization_hint=4)
    spec = ShapesSpec(
        {
            "x": TensorSpec([b, 2 * b + 1, STATIC, 3]),
            "d": DictSpec({"k": TensorSpec([b])}),
            "s": SeqSpec([IntVar("n")]),
            "o": ObjectSpec({"w": TensorSpec([b])}),
            "*args": [TensorSpec([b])],
        },
        assumptions=[b % 2 == 0],
    )
    j = spec.to_jsonable()
    assert j["type"] == "ShapesSpec" and j["assumptions"] == ["B%2 == 0"]
    x = j["params"]["params"]["x"]
    assert x["dims"][0] == {
        "type": "ShapeVar",
        "name": "B",
        "min": 0,
        "max": 8,
        "optimization_hint": 4,
    }
    assert x["dims"][1] == {"type": "Expr", "expr": "(2*B + 1)"} and x["dims"][2:] == [None, 3]
    assert j["params"]["params"]["o"]["type"] == "ObjectSpec"
    assert j["params"]["params"]["*args"][0]["type"] == "TensorSpec"
    assert list(DictSpec({"a": None, 1: 2}).items()) == [("a", None), (1, 2)]
    assert dict(ObjectSpec({"w": 3}).items()) == {"w": 3}
