"""GEMM fusion inside torch.compile / torchport.compile, and torch.export of rewritten graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchport
from torchport import config
from torchport.compiler import TorchportBackend, last_report, verify_graph
from torchport.compiler.gemm_fusion import GEMM_FUSION, fused_linear, fused_matmul
from torchport.gemm.epilogue import EpilogueSpec


@pytest.fixture(autouse=True)
def _no_tuning():
    with config.override(autotune=False):
        torch._dynamo.reset()
        yield


class MLP(nn.Module):
    def __init__(self, d: int = 32, h: int = 64, act: str = "gelu") -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, h), nn.Linear(h, d), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else getattr(F, self.act)(h)
        return x + self.fc2(h) * 0.5


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
def test_mlp_eager_inner_matches(act):
    torch.manual_seed(0)
    m, x = MLP(act=act), torch.randn(3, 7, 32)
    c = torchport.compile(m, inner="eager", verify=True)
    torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.rule_counts == {"linear+epilogue -> torchport::gemm": 2}


def test_attention_block_matches():
    torch.manual_seed(0)
    m, x = Attention(), torch.randn(2, 9, 32)
    c = torchport.compile(m, inner="eager", verify=True)
    torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert last_report().rule_counts["linear+epilogue -> torchport::gemm"] == 2  # type: ignore[union-attr]


def test_matmul_addmm_and_unfusable_tail():
    torch.manual_seed(0)
    w, b = torch.randn(16, 12), torch.randn(12)

    def f(x, r):
        y = torch.relu(torch.addmm(b, x, w))
        z = torch.tanh(x @ w) + r  # tanh is not fusable: matmul fused alone, rest stays
        return y, z

    x, r = torch.randn(5, 16), torch.randn(5, 12)
    c = torchport.compile(f, inner="eager", verify=True)
    for got, want in zip(c(x, r), f(x, r)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    counts = last_report().rule_counts  # type: ignore[union-attr]
    assert counts == {
        "addmm+epilogue -> torchport::gemm": 1,
        "matmul+epilogue -> torchport::gemm": 1,
    }


def test_bf16_model_matches():
    torch.manual_seed(0)
    m, x = MLP().to(torch.bfloat16), torch.randn(4, 32).to(torch.bfloat16)
    c = torchport.compile(m, inner="eager")
    torch.testing.assert_close(c(x).float(), m(x).float(), rtol=3e-2, atol=3e-2)


def test_inductor_training_step_matches_eager():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(2, 5, 32)
    c = torchport.compile(m)  # inner="inductor"
    c(x).square().sum().backward()
    got = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
    m.zero_grad()
    m(x).square().sum().backward()
    for g, p in zip(got, m.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    assert last_report().rewrites["gemm_fusion"] == 2  # type: ignore[union-attr]


def test_backend_name_registered():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(3, 32)
    c = torch.compile(m, backend="torchport")
    torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


def test_export_of_rewritten_graph():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    captured = {}

    def capture(gm, example_inputs):
        GEMM_FUSION(gm)
        verify_graph(gm)
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch.compile(m, backend=capture)(x)
    gm = captured["gm"]
    assert any(n.target in (fused_linear, fused_matmul) for n in gm.graph.nodes)
    inputs = captured["inputs"]
    ep = torch.export.export(gm, tuple(t.detach() for t in inputs))
    assert any("torchport.gemm" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(*inputs)[0], m(x), rtol=1e-5, atol=1e-5)


def test_export_of_model_using_linear():
    from torchport.nn.functional import linear

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 8))

        def forward(self, x):
            return linear(x, self.w, epilogue=["relu"])

    m, x = M(), torch.randn(3, 8)
    ep = torch.export.export(m, (x,))
    torch.testing.assert_close(ep.module()(x), torch.relu(x @ m.w.t()), rtol=1e-5, atol=1e-5)


def test_eager_backend_runs_without_rewrites_for_other_dtypes():
    m, x = MLP().double(), torch.randn(3, 32).double()
    c = TorchportBackend(inner="eager")
    out = torch.compile(m, backend=c)(x)
    torch.testing.assert_close(out, m(x))
    assert last_report().rewrites["gemm_fusion"] == 0  # type: ignore[union-attr]


class _Stateful(nn.Module):
    """A layer that updates buffers in forward through calls whose results are unused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 12)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(64, 12))
        self.register_buffer("total", torch.zeros(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = F.gelu(self.fc(x))
        self.cache[: x.shape[0]] = h.detach()
        torch.add(self.total, 1.0, out=self.total)
        return h


@pytest.mark.parametrize("how", ["eager", "inductor", "torch.compile"])
def test_buffer_updates_survive_the_rewrite(how):
    torch.manual_seed(0)
    m, x = _Stateful(), torch.randn(64, 16)
    c = (
        torch.compile(m, backend="torchport")
        if how == "torch.compile"
        else torchport.compile(m, inner=how)
    )
    for _ in range(2):
        h = c(x)
    assert last_report().rewrites["gemm_fusion"] == 1  # type: ignore[union-attr]
    assert int(m.calls) == 2 and m.total.tolist() == [2.0] * 12
    torch.testing.assert_close(m.cache, h.detach())


def _mutates_input(x, w):
    y = F.linear(x, w)
    s = x.mul_(2.0).sum()  # the GEMM reads x before this update
    return torch.relu(y), s


def _mutates_residual(x, w, r):
    z = F.linear(x, w) + r
    s = r.zero_().sum()  # the add reads r before this update
    return F.gelu(z), s


def _pure_between(x, w, r):
    y = F.linear(x, w)
    r2 = torch.tanh(r) * 2  # pure nodes between the GEMM and its steps: still fused
    return F.gelu(y + r2), r2


@pytest.mark.parametrize(
    "fn, fused_ops",
    [(_mutates_input, []), (_mutates_residual, ["add"]), (_pure_between, ["add", "gelu"])],
    ids=["input", "residual", "pure"],
)
def test_chain_stops_before_a_side_effect(fn, fused_ops):
    torch.manual_seed(0)
    w, x, r = torch.randn(12, 16), torch.randn(40, 16), torch.randn(40, 12)
    args = (x, w) if fn is _mutates_input else (x, w, r)
    want = fn(*[a.clone() for a in args])
    got = torchport.compile(fn, inner="eager", verify=True)(*[a.clone() for a in args])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    captured = []

    def capture(gm, example_inputs):
        GEMM_FUSION(gm)
        captured.extend(n for n in gm.graph.nodes if n.target is fused_linear)
        return gm.forward

    torch.compile(fn, backend=capture)(*[a.clone() for a in args])
    assert [[op.kind for op in EpilogueSpec.decode(n.args[3]).ops] for n in captured] == [fused_ops]


class _FrozenBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.head = nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.frozen(x)
        return self.head(F.gelu(h) + r)


def test_gemm_under_no_grad_stays_there():
    torch.manual_seed(0)
    m, x, r = _FrozenBase(), torch.randn(64, 16), torch.randn(64, 12, requires_grad=True)
    m(x, r).sum().backward()
    want = [m.head.weight.grad.clone(), r.grad.clone()]  # type: ignore[union-attr]
    m.zero_grad()
    r.grad = None
    torchport.compile(m, inner="eager", verify=True)(x, r).sum().backward()
    assert last_report().rewrites["gemm_fusion"] == 2  # type: ignore[union-attr]
    assert m.frozen.weight.grad is None and m.frozen.bias.grad is None
    torch.testing.assert_close([m.head.weight.grad, r.grad], want, rtol=1e-5, atol=1e-5)


def test_linear_with_broadcast_bias_is_left_alone():
    torch.manual_seed(0)
    w, b1, x = torch.randn(12, 16), torch.full((1,), 3.0), torch.randn(40, 16)

    def f(x):
        return torch.relu(F.linear(x, w, b1))  # a [1] bias broadcasts over N = 12

    torch.testing.assert_close(torchport.compile(f, inner="eager")(x), f(x))
    assert last_report().rewrites["gemm_fusion"] == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("k, n", [(0, 6), (5, 0)], ids=["K=0", "N=0"])
def test_fused_linear_nd_empty_inner_or_output_dim(k, n):
    w, b = torch.randn(n, k), torch.randn(n)

    def f(x, r):
        return torch.relu(F.linear(x, w, b) + r)

    x, r = torch.randn(4, 3, k), torch.randn(4, 3, n)
    torch.testing.assert_close(torchport.compile(f, inner="eager")(x, r), f(x, r))
    assert last_report().rewrites["gemm_fusion"] == 1  # type: ignore[union-attr]


def _bf16_linear_widened(x, w, b):
    return F.gelu(F.linear(x, w, b)).to(torch.float32)


def _f32_linear_narrowed(x, w, b):
    return F.gelu(F.linear(x, w, b)).to(torch.bfloat16)


@pytest.mark.parametrize("how", ["torchport.compile", "torch.compile"])
@pytest.mark.parametrize(
    "fn, dtype", [(_bf16_linear_widened, torch.bfloat16), (_f32_linear_narrowed, torch.float32)]
)
def test_final_cast_rounds_as_eager(how, fn, dtype):
    # eager rounds a bf16 linear's result to bf16 and then widens it: a fused cast to float32
    # stored the unrounded float32 sums (up to 0.05 off at K = 256); a narrowing cast (one
    # rounding of the float32 result) is still fused
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s).to(dtype) for s in ((24, 256), (40, 256), (40,)))
    c = (
        torch.compile(fn, backend="torchport")
        if how == "torch.compile"
        else torchport.compile(fn, inner="eager")
    )
    got, want = c(x, w, b), fn(x, w, b)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    if fn is _bf16_linear_widened:  # every value a bf16 one, as eager's
        assert torch.equal(got, got.to(torch.bfloat16).float())
    captured = []

    def capture(gm, example_inputs):
        GEMM_FUSION(gm)
        captured.extend(n for n in gm.graph.nodes if n.target is fused_linear)
        return gm.forward

    torch.compile(fn, backend=capture)(x, w, b)
    assert [EpilogueSpec.decode(n.args[3]).out for n in captured] == (
        [""] if fn is _bf16_linear_widened else ["bf16"]
    )


@pytest.mark.parametrize(
    "scale",
    [0.5, 3, torch.tensor(0.75), torch.tensor(2.0, dtype=torch.float64)],
    ids=["float", "int", "tensor", "f64_tensor"],
)
def test_mm_with_a_constant_scale_compiles_fullgraph(scale):
    # the scale's finiteness test was a tensor (torch.isfinite(torch.tensor(v))) and a 0-d
    # tensor's value was read with float(): both data-dependent branches under dynamo, so
    # torch.compile(fullgraph=True) and strict torch.export of mm(..., [Scale(c)]) raised
    import torchport.gemm as G

    torch.manual_seed(0)
    a, b = torch.randn(6, 16), torch.randn(16, 8)

    def f(a):
        return G.mm(a, b, epilogue=[G.Scale(scale), "relu"])

    want = torch.relu((a @ b) * float(scale))
    got = torch.compile(f, backend="torchport", fullgraph=True)(a)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
