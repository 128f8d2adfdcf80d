"""Compiled and exported layers whose activations are quantized at run time (NVFP4 and MX activation
configs): one graph, eager's bits and errors.

Traced, such a layer reached native kernels, the activation's finiteness check and its amax as
Python values: a two-layer model made 17-23 graphs under ``torch.compile`` (graph breaks at
``Tensor.item()``, data-dependent operators and the ctypes calls), and ``torch.export`` took the
reference quantization (decode results only close to eager's). Traced, the call is now one custom
op (``torchport::lowp_act_linear``) running the eager path.
"""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport.lowp import config as C
from torchport.lowp import tensors as T
from torchport.lowp.formats import NonFiniteInputError

CONFIGS = {
    "nvfp4-dynamic": lambda: C.NVFP4DynamicActivationNVFP4WeightConfig(),
    "nvfp4-static": lambda: C.NVFP4DynamicActivationNVFP4WeightConfig(
        use_dynamic_per_tensor_scale=False
    ),
    "nvfp4-no-pts": lambda: C.NVFP4DynamicActivationNVFP4WeightConfig(use_per_tensor_scale=False),
    "mxfp4": lambda: C.MXDynamicActivationMXWeightConfig(),
    "mxfp8": lambda: C.MXDynamicActivationMXWeightConfig(elem="fp8_e4m3"),
    "mxfp4-fp8-act": lambda: C.MXDynamicActivationMXWeightConfig(activation_elem="fp8_e5m2"),
}


def _model(cfg: str, dtype: torch.dtype = torch.float32, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(128, 64, bias=bias), torch.nn.ReLU(), torch.nn.Linear(64, 32, bias=bias)
    ).to(dtype)
    torchport.quantize_(m, CONFIGS[cfg]())
    return m


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("rows", [1, 24], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_compiled_activation_quantized_model_is_one_graph(cfg: str, rows: int) -> None:
    m = _model(cfg)
    x = torch.randn(rows, 128)
    with torch.no_grad():
        e = torch._dynamo.explain(m)(x)
    assert (e.graph_count, e.graph_break_count) == (1, 0), [str(b.reason) for b in e.break_reasons]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_compiled_results_are_eagers_bits(cfg: str, dtype: torch.dtype) -> None:
    m = _model(cfg, dtype, bias=cfg != "mxfp8")
    c = torch.compile(m, backend="eager")
    torch.manual_seed(1)
    with torch.no_grad():
        for shape in [(1, 128), (3, 128), (2, 1, 128), (40, 128), (2, 9, 128), (0, 128)]:
            x = torch.randn(shape, dtype=dtype) * 3
            want, got = m(x), c(x)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), shape


def test_inductor_compiled_results_are_eagers_bits() -> None:
    m = _model("nvfp4-dynamic")
    c = torch.compile(m)
    with torch.no_grad():
        for rows in (1, 33):
            x = torch.randn(rows, 128)
            assert torch.equal(c(x), m(x))


@pytest.mark.parametrize("rows", [1, 24], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("cfg", ["nvfp4-dynamic", "mxfp4"])
def test_compiled_non_finite_activation_raises_the_typed_error(cfg: str, rows: int) -> None:
    m = _model(cfg)
    c = torch.compile(m, backend="eager")
    x = torch.randn(rows, 128)
    with torch.no_grad():
        c(x)
        x[0, 3] = float("nan")
        with pytest.raises(NonFiniteInputError, match="must be finite"):
            c(x)


def test_compiled_calls_keep_the_weights_packed_copy(monkeypatch) -> None:
    """The op rebuilds the weight from its inner tensors: it takes the live weight's cache, or
    every call packed the weight again."""
    made = []
    orig = T.NVFP4Tensor._make_pack

    def counted(self):
        made.append(1)
        return orig(self)

    monkeypatch.setattr(T.NVFP4Tensor, "_make_pack", counted)
    m = _model("nvfp4-dynamic")
    c = torch.compile(m, backend="eager")
    x = torch.randn(1, 128)
    with torch.no_grad():
        c(x)
        first = len(made)
        for _ in range(5):
            c(x)
    assert first <= 2 and len(made) == first


def test_compiled_model_sees_a_weight_loaded_after_compiling() -> None:
    m = _model("nvfp4-dynamic")
    c = torch.compile(m, backend="eager")
    x = torch.randn(2, 128)
    with torch.no_grad():
        before = c(x)
        m[0].weight.copy_(torch.randn(64, 128) * 5)
        want = m(x)
        assert not torch.equal(want, before)
        assert torch.equal(c(x), want)


@pytest.mark.parametrize("rows", [1, 12], ids=lambda r: f"rows{r}")
def test_export_runs_the_op_with_eagers_bits(rows: int) -> None:
    m = _model("nvfp4-dynamic")
    ep = torch.export.export(m, (torch.randn(rows, 128),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "torchport.lowp_act_linear.default" in targets
    mod = ep.module()
    with torch.no_grad():
        for scale in (1.0, 1e-3, 50.0):
            x = torch.randn(rows, 128) * scale
            assert torch.equal(mod(x), m(x))


def test_make_fx_records_the_op() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    m = _model("mxfp4")
    x = torch.randn(2, 128)
    with torch.no_grad():
        gm = make_fx(m)(x)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.torchport.lowp_act_linear.default) == 2
        assert torch.equal(gm(x), m(x))


def test_compiled_gradient_through_a_frozen_activation_quantized_weight() -> None:
    """A differentiable activation still takes the frozen-weight Function (its backward runs
    through the dequantized weight), compiled as in eager."""
    m = _model("nvfp4-dynamic")
    c = torch.compile(m, backend="eager")
    x = torch.randn(3, 128, requires_grad=True)
    (ge,) = torch.autograd.grad(m(x).sum(), x)
    (gc,) = torch.autograd.grad(c(x).sum(), x)
    torch.testing.assert_close(gc, ge)


def test_exported_module_reads_the_per_tensor_scale_of_loaded_weights() -> None:
    """Weight-only NVFP4 with a per-tensor scale: the export kept the traced scale (a Python
    float) as a constant, so after load_state_dict the module's outputs were scaled by old / new
    scale."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 16)
    torchport.quantize_(m, C.NVFP4WeightOnlyConfig())
    for rows in (1, 12):
        em = torch.export.export(m, (torch.randn(rows, 64),)).module()
        new = torch.nn.Linear(64, 16)
        with torch.no_grad():
            new.weight.mul_(50)
        torchport.quantize_(new, C.NVFP4WeightOnlyConfig())
        em.load_state_dict(new.state_dict())
        x = torch.randn(rows, 64)
        with torch.no_grad():
            assert torch.equal(em(x), new(x))


def test_per_tensor_scale_setter_checks_and_reaches_the_packed_weight() -> None:
    torch.manual_seed(0)
    w = T.NVFP4Tensor.from_float(torch.randn(8, 64))
    x = torch.randn(1, 64)
    view = w.detach()  # another tensor standing for the same bytes
    with torch.no_grad():
        before = torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(x, view)
        w.per_tensor_scale = w.per_tensor_scale * 4
        fresh = T.NVFP4Tensor(w.qdata.clone(), w.scale.clone(), w.per_tensor_scale, torch.float32)
        want = torch.nn.functional.linear(x, fresh)
        assert torch.equal(torch.nn.functional.linear(x, w), want)
        assert not torch.equal(want, before)
        assert view.per_tensor_scale == w.per_tensor_scale
        assert torch.equal(torch.nn.functional.linear(x, view), want)
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(C.LowPrecisionError, match="per_tensor_scale must be a positive"):
            w.per_tensor_scale = bad


def test_gemv_refuses_a_quantized_weight_that_requires_grad() -> None:
    from torchport.gemv import gemv

    w = T.NVFP4Tensor.from_float(torch.randn(8, 64)).requires_grad_()
    x = torch.randn(1, 64, requires_grad=True)
    with pytest.raises(C.LowPrecisionError, match="weights are frozen"):
        gemv(x, w)
    with torch.no_grad():
        assert gemv(x, w).shape == (1, 8)


@pytest.mark.parametrize("rows", [1, 16], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
def test_a_bias_that_f_linear_broadcasts(kind: str, rows: int) -> None:
    """A scalar, [1, N] or [M, N] bias was refused (GemvInputError at decode, LowPrecisionError
    at prefill) where F.linear broadcasts it."""
    torch.manual_seed(0)
    w32 = torch.randn(8, 64)
    w = T.NVFP4Tensor.from_float(w32) if kind == "nvfp4" else T.Float8Tensor.from_float(w32)
    x = torch.randn(rows, 64)
    with torch.no_grad():
        plain = torch.nn.functional.linear(x, w)
        for bias in (torch.tensor(2.0), torch.full((1, 8), 2.0), torch.full((rows, 8), 2.0)):
            assert torch.equal(torch.nn.functional.linear(x, w, bias), plain + 2)
        with pytest.raises(ValueError, match=r"bias"):  # (GemvInputError, LowPrecisionError)
            torch.nn.functional.linear(x, w, torch.ones(3, 8))
    b = torch.zeros(1, 8, requires_grad=True)
    torch.nn.functional.linear(x, w, b).sum().backward()
    assert torch.equal(b.grad, torch.full((1, 8), float(rows)))


def test_the_ops_rebuilt_weight_goes_with_the_live_weight() -> None:
    """The op keeps the weight it rebuilt in the live weight's cache; no reference cycle: a
    dropped weight's bytes are freed at once, not at the next garbage collection."""
    import gc
    import weakref

    op = torch.ops.torchport.lowp_act_linear.default
    torch.manual_seed(0)
    w = T.NVFP4Tensor.from_float(torch.randn(32, 64), act_per_tensor_scale=True)
    x = torch.randn(2, 64)
    args = ("nvfp4", w.dtype, w.per_tensor_scale, True, None, None)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, w)
        for _ in range(3):
            assert torch.equal(op(x, w.qdata, w.scale, None, *args), want)
    rebuilt = w._cache.rebuilt
    assert rebuilt is not None and rebuilt[1]._cache is not w._cache
    assert rebuilt[1]._cache.pack is w._cache.pack is not None
    gone = weakref.ref(w.qdata)
    was = gc.isenabled()
    gc.disable()
    try:
        del w, rebuilt
        assert gone() is None
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("exported_pts", [False, True], ids=["exported-without", "exported-with"])
def test_exported_nvfp4_module_follows_a_loaded_per_tensor_scale_or_its_absence(
    exported_pts: bool,
) -> None:
    """Exported without a per-tensor scale, a weight-only NVFP4 module traced the scale 1.0 into
    the decode op as a constant: loaded with one, its decode outputs were off by that scale."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 16)
    torchport.quantize_(m, C.NVFP4WeightOnlyConfig(use_per_tensor_scale=exported_pts))
    new = torch.nn.Linear(64, 16)
    torchport.quantize_(new, C.NVFP4WeightOnlyConfig(use_per_tensor_scale=not exported_pts))
    for rows in (1, 12):
        em = torch.export.export(m, (torch.randn(rows, 64),)).module()
        em.load_state_dict(new.state_dict())
        x = torch.randn(rows, 64)
        with torch.no_grad():
            assert torch.equal(em(x), new(x))


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "fp8"])
def test_a_weight_with_k_zero_gives_zeros_plus_bias(kind: str) -> None:
    """K = 0 raised an untyped RuntimeError (a reshape to rows of 0); F.linear gives zeros."""
    w32 = torch.empty(13, 0)
    w = {
        "nvfp4": lambda: T.NVFP4Tensor.from_float(w32),
        "mxfp4": lambda: T.MXTensor.from_float(w32, "fp4_e2m1"),
        "fp8": lambda: T.Float8Tensor.from_float(w32),
    }[kind]()
    bias = torch.arange(13.0)
    with torch.no_grad():
        for rows in (1, 16):
            x = torch.empty(rows, 0)
            assert torch.equal(torch.nn.functional.linear(x, w), torch.zeros(rows, 13))
            assert torch.equal(torch.nn.functional.linear(x, w, bias), bias.expand(rows, 13))
