"""The GEMM engine's contract with torch beyond plain eager calls: autocast, meta tensors,
linear's bias and weight shapes, recompiles and symbolic sizes under torch.compile, non-finite
scale operands, the unfused tail's dtypes (regressions from a review of the engine)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import torchport
import torchport.gemm as G
from torchport import config
from torchport.compiler import report_count, reports
from torchport.gemm.epilogue import EpilogueError, EpilogueSpec
from torchport.gemm.kernels import GemmInputError
from torchport.nn.functional import linear


def _bf16_ref(x, w, b=None, act=None):
    """``act(x @ w.T + b)`` of the bf16-rounded x and w, in float64."""
    z = x.bfloat16().double() @ w.bfloat16().double().t()
    z = z if b is None else z + b.double()
    return z if act is None else act(z)


@pytest.mark.parametrize("backends", ["NATIVE,ATEN", "ATEN"])
def test_autotuner_under_bf16_autocast_computes_bf16_as_f_linear(fresh_cache, backends):
    """Inside a bf16 autocast region linear and mm run in bf16 and return bf16, whichever
    backend the tuner chose, on every call (from the fourth call, an adaptive runner's ATen arm
    handed a bf16 product to an epilogue pass built for float32, and raised)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 512), torch.randn(1024, 512), torch.randn(1024)  # M=1: adaptive
    with config.override(max_autotune_gemm_backends=backends):
        linear(x, w, b)  # tuned outside the region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.linear(x, w, b).dtype == torch.bfloat16
            for _ in range(8):
                y = linear(x, w, b)
                z = G.mm(x, w.t(), epilogue=["relu"])
                assert y.dtype == z.dtype == torch.bfloat16
                torch.testing.assert_close(y.double(), _bf16_ref(x, w, b), atol=0.2, rtol=0.02)
                torch.testing.assert_close(
                    z.double(), _bf16_ref(x, w, act=torch.relu), atol=0.2, rtol=0.02
                )


def test_tuning_under_autocast_tunes_the_bf16_problem(fresh_cache):
    """The tuner's anchor ran under the caller's autocast: every float32 candidate failed the
    check against a bf16 product and "ATen" was cached for the float32 problem."""
    decisions = sys.modules["torchport.gemm.mm"].decisions
    torch.manual_seed(1)
    a, w = torch.randn(2, 384), torch.randn(768, 384)  # (a shape of its own in this file)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        G.mm(a, w.t(), epilogue=["relu"])
    keys = {k[1]: v for k, v in decisions.items() if k[1].startswith("M=2 N=768 K=384 ")}
    assert "M=2 N=768 K=384 bfloat16 [relu]" in keys, keys
    assert not [k for k in keys if "float32" in k], keys


def test_raw_op_and_float16_autocast_compute_in_the_inputs_dtype(fresh_cache):
    """The raw op computes in its inputs' dtypes (as its fake says) inside any autocast region,
    eager and compiled; mm under a float16 region (no float16 kernels) does too."""
    torch.manual_seed(2)
    a, w = torch.randn(8, 64), torch.randn(32, 64)
    want = a.double() @ w.double().t()
    f = torch.compile(lambda x: torch.ops.torchport.gemm(x, w.t(), [], ""), backend="aot_eager")
    for dt in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dt):
            for y in (torch.ops.torchport.gemm(a, w.t(), [], ""), f(a)):
                assert y.dtype == torch.float32
                torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.float16):
        y = G.mm(a, w.t(), epilogue=["gelu"])
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), F.gelu(want), atol=1e-4, rtol=1e-4)


def test_compiled_autocast_matches_eager_autocast(fresh_cache):
    torch.manual_seed(3)
    x, w, b = torch.randn(4, 64), torch.randn(48, 64), torch.randn(48)
    f = torch.compile(lambda t: linear(t, w, b, epilogue=["gelu"]), backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, compiled = linear(x, w, b, epilogue=["gelu"]), f(x)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=1e-2)


def test_a_compiled_epilogue_compiles_once(fresh_cache):
    """Tracing mm read and filled module-level caches (_FAST_SPECS, the compiled-in scale
    constants), and dynamo guarded on them: a second identical call recompiled, and each new
    scale constant used anywhere in the process recompiled again, up to the recompile limit."""
    torch.manual_seed(4)
    a, b = torch.randn(24, 32), torch.randn(32, 48)
    c1, c2 = CompileCounter(), CompileCounter()
    f = torch.compile(lambda x: G.mm(x, b, epilogue=["gelu"]), backend=c1)
    g = torch.compile(lambda x: G.mm(x, b, epilogue=[G.Scale(0.5), "relu"]), backend=c2)
    for _ in range(3):
        f(a)
    g(a)
    for i in range(4):
        G.mm(a, b, epilogue=[G.Scale(0.1 + 0.01 * i)])  # new constants elsewhere
        torch.testing.assert_close(g(a), torch.relu(0.5 * (a @ b)), atol=1e-4, rtol=1e-4)
    assert (c1.frame_count, c2.frame_count) == (1, 1)


def test_non_finite_scales_raise_typed_errors_eager_and_compiled(fresh_cache):
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    for text, what in (("scale=nan", "finite"), ("scale=inf", "finite"), ("scale=abc", "number")):
        with pytest.raises(EpilogueError, match=f"scale must be (a )?{what}"):
            EpilogueSpec.decode(text)
    col = torch.ones(6)
    col[3] = float("inf")
    learnable = torch.tensor(float("nan"), requires_grad=True)
    for step, bad in ((G.Scale(col), "inf at index 3"), (G.Scale(learnable), "nan at index 0")):
        with pytest.raises(EpilogueError, match=f"must be finite, got {bad}"):
            G.mm(a, b, epilogue=[step])
    f = torch.compile(lambda x, s: G.mm(x, b, epilogue=[G.Scale(s)]), backend="aot_eager")
    with pytest.raises(EpilogueError, match="must be finite, got nan"):
        f(a, torch.tensor(float("nan")))
    torch.testing.assert_close(f(a, torch.tensor(2.0)), 2 * (a @ b), atol=1e-4, rtol=1e-4)


def test_meta_tensors_give_f_linears_shapes():
    x, w, b = (torch.empty(s, device="meta") for s in ((8, 16), (32, 16), (32,)))
    want = F.linear(x, w, b)
    for y in (
        linear(x, w, b),
        G.mm(x, w.t(), bias=b),
        torch.ops.torchport.gemm(x, w.t(), [b], "bias_col:f32"),
    ):
        assert (y.device.type, y.shape, y.dtype) == ("meta", want.shape, want.dtype)
    r = torch.empty(8, 32, device="meta")
    y = G.mm(x, w.t(), epilogue=["gelu", G.Add(r), G.Scale(0.5), G.Cast(torch.bfloat16)])
    assert (y.device.type, y.shape, y.dtype) == ("meta", (8, 32), torch.bfloat16)
    y = linear(torch.empty(2, 3, 16, device="meta"), w, b, epilogue=["silu"])
    assert (y.device.type, y.shape) == ("meta", (2, 3, 32))
    with pytest.raises(GemmInputError, match="inner dimensions must match"):
        G.mm(x, w)
    with pytest.raises(GemmInputError, match="must be on device 'cpu', got meta"):
        G.mm(torch.randn(8, 16), w.t())  # one meta, one cpu


@pytest.mark.parametrize(
    "x_shape, bias_shape",
    [((4, 8), ()), ((4, 8), (1,)), ((4, 8), (4, 6)), ((4, 8), (4, 1)), ((2, 3, 8), (3, 6))],
)
def test_linear_takes_every_bias_f_linear_broadcasts(x_shape, bias_shape):
    torch.manual_seed(5)
    x, w, b = torch.randn(x_shape), torch.randn(6, 8), torch.randn(bias_shape)
    with config.override(autotune=False):
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        y = linear(x, w, b, epilogue=["relu"])
    torch.testing.assert_close(y, torch.relu(F.linear(x, w, b)), atol=1e-5, rtol=1e-5)


def test_linear_takes_a_1d_weight():
    torch.manual_seed(6)
    w = torch.randn(8)
    with config.override(autotune=False):
        for shape in ((4, 8), (2, 3, 8), (8,)):
            x = torch.randn(shape)
            torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
            # an epilogue on the result, a 0-D one too (a 1-D input)
            y = linear(x, w, epilogue=["relu", G.Scale(2.0)])
            want = 2.0 * torch.relu(F.linear(x, w))
            assert y.shape == want.shape
            torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias_shape", [(), (1,), (6,), (1, 6), (1, 1), (6, 1), (2, 6)])
def test_a_1d_inputs_bias_is_taken_or_refused_as_f_linear_does(bias_shape):
    """A 1-D input is one row: F.linear takes a [1, N] bias too (output [N]), and refuses
    [1, 1], [N, 1] and [2, N]; a refusal here is typed."""
    torch.manual_seed(7)
    x, w, b = torch.randn(8), torch.randn(6, 8), torch.randn(bias_shape)
    try:
        want = F.linear(x, w, b)
    except RuntimeError:
        with pytest.raises(GemmInputError, match="bias of shape"):
            linear(x, w, b)
        return
    with config.override(autotune=False):
        y = linear(x, w, b)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_fusion_keeps_working_with_symbolic_row_counts(fresh_cache):
    """Only N and K need be static: with dynamic=True, or after the automatic dynamic shapes
    made the sequence length symbolic, the pass rewrote nothing."""
    torch.manual_seed(7)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.l2(F.gelu(self.l1(x))) * 0.5

    m = Block()
    for dynamic in (None, True):
        torch._dynamo.reset()
        n0 = report_count()
        c = torchport.compile(m, inner="eager", dynamic=dynamic)
        with torch.no_grad():
            for t in (16, 17, 5):
                x = torch.randn(2, t, 32)
                torch.testing.assert_close(c(x), m(x), atol=1e-5, rtol=1e-5)
        counts = [sum(r.rule_counts.values()) for r in reports(n0)]
        assert counts and all(n == 2 for n in counts), (dynamic, counts)


def test_unfused_tail_follows_torch_promotion_and_shapes():
    torch.manual_seed(8)
    a, b, r = torch.randn(7, 4), torch.randn(4, 13), torch.randn(7, 13) * 1e-3
    with config.override(autotune=False):
        y = G.mm(a, b, epilogue=[G.Cast(torch.bfloat16), G.Add(r)])
        want = (a @ b).bfloat16() + r
        assert y.dtype == want.dtype == torch.float32
        torch.testing.assert_close(y, want, atol=1e-6, rtol=0)
        y = G.mm(a, b, epilogue=[lambda z: z[:, :5], G.Add(torch.ones(7, 5))])
    torch.testing.assert_close(y, (a @ b)[:, :5] + 1, atol=1e-5, rtol=1e-5)


def test_a_layers_parameters_take_the_eager_fast_path():
    """``linear(x, lin.weight, lin.bias)``: the bias is an nn.Parameter, which took the custom
    op's dispatcher on every call (38 against 12 us for a small layer)."""
    from torchport import native

    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert native.eager_fast_path(x, lin.weight.t(), lin.bias)
    assert not native.eager_fast_path(x, lin.weight.t(), lin.bias)  # autograd records it
    assert native.eager_fast_path(x, lin.weight.t().detach(), lin.bias.detach())


def test_meta_results_have_the_real_calls_dtype_and_errors():
    """The meta path ran torch's promotion (float32 for bf16 inputs with a float32 bias) and
    none of the operand checks; it now runs the real call under a fake-tensor mode."""
    a, b = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(16, 12, dtype=torch.bfloat16)
    meta = [t.to("meta") for t in (a, b)]
    f32 = {"device": "meta", "dtype": torch.float32}
    for kw in (
        {"bias": torch.empty(12, **f32)},
        {"epilogue": [G.Add(torch.empty(8, 12, **f32))]},
        {"epilogue": [G.Scale(torch.empty(12, **f32))]},
    ):
        y = G.mm(*meta, **kw)
        assert (y.device.type, y.dtype) == ("meta", torch.bfloat16), kw
    x, w = torch.empty(8, 16, device="meta"), torch.empty(16, 12, device="meta")
    with pytest.raises(EpilogueError, match="residual must have shape"):
        G.mm(x, w, epilogue=[G.Add(torch.empty(12, device="meta"))])
    with pytest.raises(EpilogueError, match="bias must be float32 or bfloat16"):
        G.mm(x, w, bias=torch.empty(12, dtype=torch.float64, device="meta"))


def test_a_non_cpu_autocast_region_leaves_the_op_alone(fresh_cache):
    """_gemm_impl turned autocast off for the CPU only, then tested for any autocast again:
    inside an xpu (or hpu, xla...) region it recursed until RecursionError."""
    a, w = torch.randn(5, 16), torch.randn(7, 16)
    with torch.autocast("xpu"):
        y = linear(a, w)
        z = torch.ops.torchport.gemm(a, w.t(), [], "")
    assert y.dtype == z.dtype == torch.float32
    torch.testing.assert_close(y, a @ w.t(), atol=1e-5, rtol=1e-5)


def test_torch_func_checks_scale_operands_too():
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    s = torch.rand(6)
    s[2] = float("nan")
    with pytest.raises(EpilogueError, match="must be finite, got nan at index 2"):
        torch.func.grad(lambda x: G.mm(x, b, epilogue=[G.Scale(s)]).sum())(a)
    ok = torch.rand(6)
    g = torch.func.grad(lambda x: G.mm(x, b, epilogue=[G.Scale(ok)]).sum())(a)
    torch.testing.assert_close(g, (b * ok).sum(1).expand(4, 8), atol=1e-5, rtol=1e-5)
