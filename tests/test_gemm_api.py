"""torchport.gemm.mm / torchport.nn.functional.linear: API, autotuning, autograd, bad inputs."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchport.gemm as G
from torchport import autotune, config, native
from torchport.gemm import epilogue as epilogue_mod
from torchport.gemm import kernels, mm, templates
from torchport.gemm.epilogue import EpilogueError, EpilogueSpec, split
from torchport.gemm.kernels import GemmInputError
from torchport.gemm.pack import PackCache
from torchport.nn.functional import linear


@pytest.fixture(autouse=True)
def _first_valid_candidate(request):
    """Most tests check numerics, not tuning: take the first native candidate (one compile)."""
    if "autotuner" in request.node.name:
        yield
        return
    with config.override(autotune=False):
        yield


def _ref_linear(x, w, b=None):
    return (x.double() @ w.double().t() + (0 if b is None else b.double())).float()


def test_mm_matches_reference_with_bias_and_chain():
    a, w, bias, r = torch.randn(9, 40), torch.randn(24, 40), torch.randn(24), torch.randn(9, 24)
    y = mm(a, w.t(), bias=bias, epilogue=["gelu", G.Add(r), G.Scale(2.0)])
    ref = (F.gelu(a.double() @ w.double().t() + bias.double()) + r.double()) * 2
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_unsupported_step_runs_unfused_never_crashes():
    a, b = torch.randn(5, 8), torch.randn(8, 6)
    y = mm(a, b, epilogue=["relu", torch.tanh, "silu"])
    ref = F.silu(torch.tanh(torch.relu(a @ b)))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    sp = split(["relu", torch.tanh, "silu"], 5, 6)
    assert sp.spec.encode() == "relu" and len(sp.tail) == 2


def test_autotuner_retunes_a_saved_choice_that_left_the_candidates(fresh_cache, monkeypatch):
    """A choice saved before its candidate left the list (an 8-row tile for 4 rows, offered
    before the forty-second session) is not used: the shape is tuned again, its libraries
    built first as for a new shape, and the new choice saved over it."""
    a, b = torch.randn(4, 96), torch.randn(96, 80)
    G.mm(a, b)
    (entry,) = [e for e in autotune.choice_cache.entries().values() if e["op"] == "gemm"]
    autotune.choice_cache.put("gemm", entry["key"], "t8x8_mc4_pf64", entry["timings_s"])
    autotune.choice_cache.clear_memory()
    built: list = []
    prebuild = kernels.prebuild
    monkeypatch.setattr(kernels, "prebuild", lambda *a, **kw: built.append(a) or prebuild(*a, **kw))
    before = autotune.stats.tuned
    torch.testing.assert_close(G.mm(a, b), a @ b, rtol=1e-5, atol=1e-4)
    assert autotune.stats.tuned == before + 1 and len(built) == 1  # built first, in parallel
    again = autotune.choice_cache.get("gemm", entry["key"])
    assert again is not None and again["choice"] != "t8x8_mc4_pf64"
    assert again["choice"] in {c.name for c in G.candidates(4, 80, 96, native.cpu_info().isa)}


def test_cast_to_bf16():
    a, b = torch.randn(7, 16), torch.randn(16, 10)
    y = mm(a, b, epilogue=[G.Cast(torch.bfloat16)])
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (a @ b), rtol=1e-2, atol=1e-2)


def test_autotuner_candidates_bounded_and_cached(fresh_cache):
    for m in (1, 8, 32, 512, 2048):
        for n, k in ((3072, 768), (11008, 4096)):
            cands = G.candidates(m, n, k, "avx2")
            assert 2 <= len(cands) <= 10
            assert sum(c.is_anchor for c in cands) == 1
    # K-split for small M with large K, K cache blocks for larger M, both offered to the tuner
    assert any(c.param("ks") == 2 for c in G.candidates(1, 3072, 4096, "avx2"))
    assert any(c.param("kc") == 256 for c in G.candidates(32, 3072, 1024, "avx2"))
    assert any(c.param("kc") == 256 for c in G.candidates(512, 3072, 768, "avx2"))
    assert not any(c.param("kc") for c in G.candidates(512, 3072, 128, "avx2"))  # kc >= K
    # below 8 rows no 8-row tile (only its one-row fallback would run); bf16 weights on the
    # AVX2 tiles up to 8 rows get the 4x24 tile with the panel prefetched 64 rows ahead
    for m in (1, 4, 7):
        assert not any(c.param("mr") == 8 for c in G.candidates(m, 11008, 4096, "avx2", 2))
    assert any(c.param("mr") == 8 for c in G.candidates(8, 11008, 4096, "avx2", 2))
    for m, size, pf in ((4, 2, 64), (8, 2, 64), (16, 2, 0), (8, 4, 0)):
        tiles = [c for c in G.candidates(m, 11008, 4096, "avx2", size) if c.param("nr") == 24]
        assert tiles[0].param("pf") == pf, (m, size)
    before = autotune.stats.tuned
    a, b = torch.randn(12, 64), torch.randn(64, 48)
    mm(a, b)
    mm(a, b)
    assert autotune.stats.tuned == before + 1
    assert any("M=12 N=48 K=64" in k[1] for k in G.decisions)


def test_aten_only_backend_disables_native(monkeypatch):
    calls = []
    mm_mod = sys.modules["torchport.gemm.mm"]

    monkeypatch.setattr(mm_mod, "run_native", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(mm_mod.kernels, "launcher", lambda *a, **k: calls.append(1))
    with config.override(max_autotune_gemm_backends="ATEN"):
        a, b = torch.randn(6, 32), torch.randn(32, 16)
        y = mm(a, b)
    assert not calls
    torch.testing.assert_close(y, a @ b)


def test_native_off_uses_aten():
    with config.override(native=False):
        a, b = torch.randn(3, 5), torch.randn(5, 4)
        torch.testing.assert_close(mm(a, b, epilogue="relu"), torch.relu(a @ b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_linear_nd_and_residual(dtype):
    x, w, b = torch.randn(2, 5, 32), torch.randn(20, 32), torch.randn(20)
    r = torch.randn(2, 5, 20)
    x, w, b, r = (t.to(dtype) for t in (x, w, b, r))
    y = linear(x, w, b, epilogue=["silu", G.Add(r)])
    ref = F.silu(_ref_linear(x, w, b)) + r.float()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert y.shape == (2, 5, 20) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    assert linear(x[0, 0], w).shape == (20,)


def test_linear_nd_callable_tail_sees_the_nd_output():
    # a callable tail step got the flattened [B*S, N] rows; it now gets [B, S, N], and fused
    # steps after it (a residual of the output's shape, a relu) apply to what it returns
    torch.manual_seed(0)
    x, w, b, r = torch.randn(2, 5, 32), torch.randn(20, 32), torch.randn(20), torch.randn(2, 5, 20)
    seen = []

    def per_sequence_softmax(y):
        seen.append(tuple(y.shape))
        return y.softmax(dim=1)  # over S: only right on [B, S, N]

    y = linear(x, w, b, epilogue=["gelu", per_sequence_softmax, G.Add(r), "relu"])
    ref = torch.relu(F.gelu(F.linear(x, w, b)).softmax(dim=1) + r)
    assert seen == [(2, 5, 20)] and y.shape == (2, 5, 20)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # a tail that changes the shape returns its own shape
    assert linear(x, w, epilogue=[lambda t: t.sum(1)]).shape == (2, 20)


@pytest.mark.parametrize("k, n", [(0, 6), (5, 0)], ids=["K=0", "N=0"])
def test_linear_nd_empty_inner_or_output_dim(k, n):
    # reshape(-1, 0) of an empty tensor is ambiguous: the row count must be spelled out
    x, w, b, r = torch.randn(4, 3, k), torch.randn(n, k), torch.randn(n), torch.randn(4, 3, n)
    y = linear(x, w, b, epilogue=[G.Add(r), "relu"])
    assert y.shape == (4, 3, n)
    torch.testing.assert_close(y, torch.relu(F.linear(x, w, b) + r))


def test_autograd_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(6, 12, requires_grad=True)
    w = torch.randn(10, 12, requires_grad=True)
    b = torch.randn(10, requires_grad=True)
    s = torch.randn(10, requires_grad=True)
    r = torch.randn(6, 10, requires_grad=True)
    y = linear(x, w, b, epilogue=[G.Gelu("tanh"), G.Scale(s), G.Add(r), "relu", G.Scale(0.5)])
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b, s, r), g)
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b, s, r)]
    y2 = torch.relu(F.gelu(F.linear(xs[0], xs[1], xs[2]), approximate="tanh") * xs[3] + xs[4]) * 0.5
    ref = torch.autograd.grad(y2, xs, g)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
def test_double_backward_matches_torch(act: str) -> None:
    """Second-order gradients (a gradient penalty, a Hessian-vector product) through a fused
    activation: SiLU's went through ``aten::silu_backward``, which has no derivative
    (RuntimeError where eager's F.silu gives the product)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3)
    x2 = x.detach().clone().requires_grad_()
    eager = {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu}[act]
    hv = []
    for y, inp in ((linear(x, w, epilogue=[act]), x), (eager(F.linear(x2, w)), x2)):
        (g,) = torch.autograd.grad(y.pow(2).sum(), inp, create_graph=True)
        hv.append(torch.autograd.grad(g.pow(2).sum(), inp)[0])
    torch.testing.assert_close(hv[0], hv[1], rtol=1e-4, atol=1e-4)


def test_fake_tensor_and_opcheck():
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    bias = torch.randn(5)
    torch.library.opcheck(
        torch.ops.torchport.gemm.default,
        (a, b, [bias], "bias_col:f32;relu"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_relu_backward_passes_the_gradient_at_nan_as_eager():
    # eager's relu backward zeroes the gradient where the input is <= 0 only: at a NaN it
    # passes it; the fused op's where(x > 0, g, 0) zeroed it (a NaN row's grad_a was 0)
    torch.manual_seed(0)
    a, b, g = torch.randn(4, 8), torch.randn(8, 6), torch.randn(4, 6)
    a[1, 2] = float("nan")
    a1, a2 = a.clone().requires_grad_(), a.clone().requires_grad_()
    mm(a1, b, epilogue=["relu"]).backward(g)
    torch.relu(a2 @ b).backward(g)
    torch.testing.assert_close(a1.grad, a2.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_pack_cache_repacks_after_inplace_update():
    cache = PackCache()
    w = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)  # kept from its first use
    p1 = cache.get(w.t(), 8)
    assert cache.get(w.t(), 8) is p1 and cache.hits == 1
    w.add_(1.0)
    p2 = cache.get(w.t(), 8)
    assert p2 is not p1 and torch.equal(p2[0, :, :8], w.t()[:, :8])
    w.data[15, 7] = 123.0  # a write that bypasses the version counter, caught by the probe
    p3 = cache.get(w.t(), 8)
    assert p3 is not p2 and float(p3[1, 7, 7]) == 123.0
    alias = torch.as_strided(w, (8, 16), (1, 8))  # a fresh alias object (as Inductor passes)
    assert cache.get(alias, 8) is p3
    w.data[0, 0] = float("nan")  # the probe compares bits: a NaN weight stays cached
    p4 = cache.get(w.t(), 8)
    assert p4 is not p3 and cache.get(w.t(), 8) is p4
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_pack_cache_keeps_parameters_at_once_and_other_operands_from_their_second_use():
    """One-off operands (activations) are packed without being kept: every packing was kept
    before, each entry holding its tensor, 60 calls on fresh 1 MiB operands held 120 MiB."""
    cache = PackCache()
    for _ in range(20):  # fresh operands (addresses reused, other values): none kept
        cache.get(torch.randn(64, 64), 16)
    assert len(cache) == 0 and cache.nbytes == 0
    w = torch.randn(64, 48)
    p1 = cache.get(w, 16)
    assert len(cache) == 0  # first use: packed, remembered by key and sampled values only
    p2 = cache.get(w, 16)
    assert len(cache) == 1 and p2 is not p1 and torch.equal(p2, p1)
    assert cache.get(w, 16) is p2 and cache.hits == 1
    lin = torch.nn.Linear(64, 40)
    p3 = cache.get(lin.weight.t(), 16)  # a parameter's view (nn.Linear's weight.t()): at once
    assert len(cache) == 2 and cache.get(lin.weight.t(), 16) is p3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and len(cache._seen) == 0


def test_mm_after_weight_update_uses_new_values():
    a, w = torch.randn(4, 16), torch.randn(24, 16)
    y1 = mm(a, w.t())
    w.mul_(2)
    torch.testing.assert_close(mm(a, w.t()), 2 * y1, rtol=1e-5, atol=1e-5)


def test_training_packs_each_weight_version_once(fresh_cache):
    """Forward/backward passes between optimizer steps reuse the packed weight (keyed on its
    version counter); each step's in-place update causes exactly one repack, and the results
    follow the updated weights."""
    from torchport.gemm.pack import pack_cache

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(8, 64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with config.override(autotune=False):  # the first native candidate serves every call
        for _ in range(3):
            before = pack_cache.misses
            for _ in range(3):
                y = linear(x, lin.weight, lin.bias)
                y.square().sum().backward()
            assert pack_cache.misses - before == 1
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            opt.step()
            opt.zero_grad()


class _DataSGD(torch.optim.Optimizer):
    """A step written the old way, through ``.data`` (no version counter bump)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize(
    "make_opt",
    [lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), lambda ps: _DataSGD(ps, lr=0.1)],
    ids=["fused_adam", "data_sgd"],
)
def test_optimizer_step_that_keeps_the_version_repacks(make_opt):
    """Fused optimisers (and ``.data`` writes) update a weight without bumping its version
    counter: a step that changed only rows outside the 16-element probe (a gradient in one
    output row) kept the old packing, and the next GEMM used the weights from before the step."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    with config.override(autotune=False):  # the first native candidate serves every call
        for row in range(4):  # some of these rows hold no probed element
            w = torch.nn.Parameter(torch.randn(48, 64))
            opt = make_opt([w])
            linear(x, w)  # packed and cached
            grad = torch.zeros_like(w)
            grad[row] = 1.0
            w.grad = grad
            version = w._version
            opt.step()
            assert w._version == version  # the step bypassed the version counter
            torch.testing.assert_close(linear(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-5)


def test_optimizer_step_keeps_the_packing_of_a_frozen_weight():
    """The step hook marked every listed parameter stale: a frozen weight (no gradient, left
    alone by the optimiser, listed through model.parameters()) was repacked after every step."""
    from torchport.gemm.pack import pack_cache

    torch.manual_seed(0)
    frozen = torch.nn.Parameter(torch.randn(48, 64), requires_grad=False)
    head = torch.nn.Parameter(torch.randn(8, 48))
    opt = torch.optim.AdamW([frozen, head], lr=0.1)
    x = torch.randn(4, 64)
    with config.override(autotune=False):
        linear(x, frozen)
        before = pack_cache.misses
        for _ in range(3):
            linear(x, frozen)
            head.grad = torch.ones_like(head)
            opt.step()
        assert pack_cache.misses == before
        torch.testing.assert_close(linear(x, frozen), x @ frozen.t(), rtol=1e-5, atol=1e-5)


def test_optimizer_step_over_a_storageless_parameter_with_a_cached_packing():
    # the step hook looks up the parameters' storages: a sparse one has none
    lin = torch.nn.Linear(8, 4)
    with config.override(autotune=False):
        linear(torch.randn(2, 8), lin.weight, lin.bias)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    p = torch.nn.Parameter(sparse.clone())
    opt = torch.optim.SGD([p, lin.weight], lr=0.1)
    p.grad, lin.weight.grad = sparse.clone(), torch.ones_like(lin.weight)
    opt.step()
    assert float(p.to_dense()[0]) == pytest.approx(0.9)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((torch.randn(3, 4), torch.randn(5, 2)), {}, r"inner dimensions must match.*K=4 vs 5"),
        ((torch.randn(4), torch.randn(4, 2)), {}, r"a must be 2-D, got 1-D"),
        ((torch.randn(2, 3), torch.randn(2, 3, 4)), {}, r"b must be 2-D, got 3-D"),
        (
            (torch.randn(2, 3).double(), torch.randn(3, 2).double()),
            {},
            r"float32 or bfloat16, got torch.float64",
        ),
        ((torch.randn(2, 3), torch.randn(3, 2).bfloat16()), {}, r"same dtype"),
        ((torch.randn(2, 3, device="meta"), torch.randn(3, 2)), {}, r"device 'cpu', got meta"),
        (([[1.0]], torch.randn(1, 1)), {}, r"a must be a torch.Tensor, got list"),
        ((torch.randn(2, 3).to_sparse(), torch.randn(3, 2)), {}, r"a must be a dense .*sparse_coo"),
    ],
    ids=["mismatched-K", "1d", "3d", "float64", "mixed", "device", "not-tensor", "sparse"],
)
def test_bad_inputs(args, kwargs, match):
    with pytest.raises(GemmInputError, match=match):
        mm(*args, **kwargs)


@pytest.mark.parametrize(
    "steps,match",
    [
        ([G.Scale(float("inf"))], r"scale must be finite, got inf"),
        ([G.Scale(float("nan"))], r"scale must be finite, got nan"),
        ([G.Bias(torch.randn(7))], r"bias must have shape \(4,\), got \(7,\)"),
        ([G.Add(torch.randn(3, 3))], r"residual must have shape \(3, 4\)"),
        ([G.Gelu("fast")], r"approximate must be 'none' or 'tanh', got 'fast'"),
        (["swish"], r"unknown epilogue step 'swish'"),
        ([G.Cast(torch.float16)], r"Cast dtype must be float32 or bfloat16"),
        ([G.Bias(torch.randn(4).double())], r"float32 or bfloat16, got torch.float64"),
        ([G.Scale("2")], r"scale must be a number or tensor"),
    ],
    ids=[
        "inf-scale",
        "nan-scale",
        "bias-shape",
        "residual-shape",
        "gelu-mode",
        "name",
        "cast",
        "bias-dtype",
        "scale-type",
    ],
)
def test_bad_epilogues(steps, match):
    with pytest.raises(EpilogueError, match=match):
        mm(torch.randn(3, 5), torch.randn(5, 4), epilogue=steps)


def test_fast_split_matches_full_split():
    """An epilogue of activations and residuals seen once takes the cached spec (fast_split):
    the same spec and operands as the full split, and its operands still checked per call."""
    m, n = 3, 4
    b, r, rb = torch.randn(n), torch.randn(m, n), torch.randn(m, n).bfloat16()
    cases = [
        (["gelu", G.Add(r)], b),
        ((G.Silu(), G.Add(rb), "relu"), None),
        ("gelu_tanh", b.bfloat16()),
        (G.Add(r), None),
        (None, b),
        ("silu", torch.nn.Parameter(torch.randn(n))),  # a linear layer's bias
    ]
    for steps, bias in cases:
        full = epilogue_mod._split(steps, m, n, bias)
        split(steps, m, n, bias=bias)  # fills the cache
        hit = epilogue_mod.fast_split(steps, m, n, bias)
        assert hit is not None and hit[0] == full.spec.encode()
        assert all(x is y for x, y in zip(hit[1], full.operands, strict=True))
        again = split(steps, m, n, bias=bias)
        assert again.spec == full.spec and not again.tail
    # operands that fail the checks after the spec is cached: the full split's errors
    a, w = torch.randn(m, 5), torch.randn(5, n)
    mm(a, w, bias=b, epilogue=["gelu", G.Add(r)])
    with pytest.raises(EpilogueError, match=r"residual must have shape \(3, 4\)"):
        mm(a, w, bias=b, epilogue=["gelu", G.Add(torch.randn(3, 3))])
    with pytest.raises(EpilogueError, match=r"float32 or bfloat16, got torch.float64"):
        mm(a, w, bias=b, epilogue=["gelu", G.Add(r.double())])
    with pytest.raises(EpilogueError, match=r"bias must have shape \(4,\), got \(7,\)"):
        mm(a, w, bias=torch.randn(7), epilogue=["gelu", G.Add(r)])
    with pytest.raises(EpilogueError, match=r"must be a tensor, got list"):
        mm(a, w, bias=b, epilogue=["gelu", G.Add([1.0])])  # type: ignore[arg-type]
    # a callable after cached steps is an unfused tail, not a cache hit
    y = mm(a, w, bias=b, epilogue=["gelu", G.Add(r), torch.tanh])
    ref = torch.tanh(F.gelu(a @ w + b) + r)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_linear_bad_inputs():
    with pytest.raises(GemmInputError, match=r"in_features=4, got shape \(2, 3\)"):
        linear(torch.randn(2, 3), torch.randn(5, 4))
    with pytest.raises(GemmInputError, match=r"weight must be 2-D .*got shape \(2, 2, 4\)"):
        linear(torch.randn(2, 4), torch.randn(2, 2, 4))
    with pytest.raises(GemmInputError, match=r"1-D weight's length 5, got shape \(2, 4\)"):
        linear(torch.randn(2, 4), torch.randn(5))
    with pytest.raises(GemmInputError, match=r"bias of shape \(5,\) does not broadcast"):
        linear(torch.randn(2, 4), torch.randn(6, 4), torch.randn(5))
    with pytest.raises(GemmInputError, match=r"bias must be a tensor or None, got float"):
        linear(torch.randn(2, 4), torch.randn(6, 4), 1.0)


def test_spec_roundtrip_and_malformed():
    s = "bias_col:bf16;gelu_tanh;add:f32;scale=0.25;scale_row:f32;silu;out=bf16"
    assert EpilogueSpec.decode(s).encode() == s
    with pytest.raises(EpilogueError, match="unknown epilogue step 'softmax'"):
        EpilogueSpec.decode("softmax")
    with pytest.raises(EpilogueError, match="output dtype must be f32 or bf16, got 'f16'"):
        EpilogueSpec.decode("out=f16")


def test_aten_choice_is_one_addmm_on_the_inputs(monkeypatch):
    """When ATen serves the call, linear is F.linear's addmm(bias, x, w.t()): no copies."""
    calls = []
    real = torch.addmm

    def spy(bias, a, b, *args, **kwargs):
        calls.append((bias, a, b))
        return real(bias, a, b, *args, **kwargs)

    x, w, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    with config.override(max_autotune_gemm_backends="ATEN"), torch.no_grad():
        linear(x, w, bias)  # settle the choice
        monkeypatch.setattr(torch, "addmm", spy)
        y = linear(x, w, bias)
    assert len(calls) == 1
    b_in, a_in, w_in = calls[0]
    assert b_in is bias and a_in is x
    assert w_in.data_ptr() == w.data_ptr() and w_in.stride() == (1, 16)  # w.t(), in place
    torch.testing.assert_close(y, F.linear(x, w, bias))


def test_settled_choice_follows_settings():
    """The per-process memo of choices is keyed on the settings that steer the choice."""
    a, b = torch.randn(7, 40), torch.randn(40, 24)
    spec = EpilogueSpec.decode("")
    with config.override(max_autotune_gemm_backends="ATEN"):
        assert G.choose(a, b, spec, []).is_anchor
    assert not G.choose(a, b, spec, []).is_anchor  # autotune off: first native candidate
    with config.override(native=False):
        assert G.choose(a, b, spec, []).is_anchor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bias_fast_path_matches_split(dtype):
    mm_mod = sys.modules["torchport.gemm.mm"]
    bias = torch.randn(5).to(dtype)
    assert mm_mod._BIAS_SPECS[dtype] == split([G.Bias(bias)], 3, 5).spec.encode()
    with pytest.raises(EpilogueError, match=r"shape \(5,\)"):
        mm(torch.randn(3, 4), torch.randn(4, 5), bias=torch.randn(6))


def _count_native_launches(monkeypatch) -> list[int]:
    """Untimed tuning (first valid native candidate) and a list that grows by one per native
    GEMM launch, for the tests of settled routes below."""
    mm_mod = sys.modules["torchport.gemm.mm"]
    monkeypatch.setenv("TORCHPORT_AUTOTUNE", "0")  # first valid native candidate, no timing
    calls: list[int] = []
    real = mm_mod.kernels.launcher

    def counting(*args):
        launch = real(*args)
        return lambda *a, **k: calls.append(1) or launch(*a, **k)

    monkeypatch.setattr(mm_mod.kernels, "launcher", counting)
    return calls


def test_autotuner_settled_route_follows_env_and_assignment(monkeypatch, fresh_cache):
    """Settled problems skip every config read on the eager path, yet an environment change
    or an assignment still re-routes the next call (no override active: the stamp path)."""
    calls = _count_native_launches(monkeypatch)
    a, b = torch.randn(7, 40), torch.randn(40, 24)
    ref = a @ b
    for want_native in (True, True):
        n = len(calls)
        torch.testing.assert_close(mm(a, b), ref, rtol=1e-5, atol=1e-5)
        assert len(calls) == n + int(want_native)
    monkeypatch.setenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")
    n = len(calls)
    torch.testing.assert_close(mm(a, b), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == n
    monkeypatch.delenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS")
    mm(a, b)
    assert len(calls) == n + 1
    try:
        config.native = False
        mm(a, b)
        assert len(calls) == n + 1
    finally:
        config.native = None
    mm(a, b)
    assert len(calls) == n + 2


def test_autotuner_settled_fused_call_follows_env_override_and_assignment(monkeypatch, fresh_cache):
    """A settled fused call (bias + GELU + residual: the eager path that splits the epilogue)
    still re-routes on an environment edit, an override and an assignment, and comes back."""
    calls = _count_native_launches(monkeypatch)
    x, w, b, r = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24), torch.randn(3, 24)
    ref = (F.gelu(x.double() @ w.double().t() + b.double()) + r.double()).float()

    def fused(native: bool) -> None:
        n = len(calls)
        y = linear(x, w, b, epilogue=["gelu", G.Add(r)])
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert len(calls) == n + int(native)

    fused(True)
    fused(True)
    monkeypatch.setenv("TORCHPORT_NATIVE", "0")
    fused(False)
    monkeypatch.delenv("TORCHPORT_NATIVE")
    fused(True)
    with config.override(max_autotune_gemm_backends="ATEN"):
        fused(False)
    fused(True)
    try:
        config.max_autotune_gemm_backends = "ATEN"
        fused(False)
    finally:
        config.max_autotune_gemm_backends = None
    fused(True)


def test_split_bias_argument_equals_a_leading_bias_step():
    """``split(..., bias=t)`` is ``split([Bias(t), *steps])``, error messages included."""
    bias, r = torch.randn(5), torch.randn(3, 5)
    one = split(["gelu", G.Add(r)], 3, 5, bias=bias)
    two = split([G.Bias(bias), "gelu", G.Add(r)], 3, 5)
    assert one.spec is two.spec and one.spec.encode() == two.spec.encode()
    assert all(p is q for p, q in zip(one.operands, two.operands, strict=True))
    with pytest.raises(EpilogueError, match=r"epilogue step 2 residual must have shape \(3, 5\)"):
        split(["gelu", G.Add(torch.randn(2, 5))], 3, 5, bias=bias)
    with pytest.raises(EpilogueError, match=r"epilogue step 0 bias must have shape \(5,\)"):
        split(["gelu"], 3, 5, bias=torch.randn(4))


@pytest.mark.parametrize(
    "steps",
    [["gelu"], ("silu",), "relu", [G.Gelu("tanh"), "relu"], [], [G.Silu(), G.Relu()]],
    ids=str,
)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_split_of_plain_steps_is_cached_and_still_validates(steps, bias_dtype):
    """Epilogues of parameter-free steps reuse their spec from the second call on (the same
    interned spec as the full walk) and still check the bias on every call."""
    bias = None if bias_dtype is None else torch.randn(5).to(bias_dtype)
    first, again = split(steps, 3, 5, bias=bias), split(steps, 3, 5, bias=bias)
    walked = epilogue_mod._split(steps, 3, 5, bias)
    assert first.spec is again.spec is walked.spec
    assert len(again.operands) == (bias is not None) and again.tail == []
    if bias is not None:
        assert again.operands[0] is bias
        with pytest.raises(EpilogueError, match=r"epilogue step 0 bias must have shape \(5,\)"):
            split(steps, 3, 5, bias=torch.randn(4).to(bias_dtype))
        with pytest.raises(EpilogueError, match="bias must be on cpu, got meta"):
            split(steps, 3, 5, bias=torch.empty(5, device="meta", dtype=bias_dtype))
    with pytest.raises(EpilogueError, match=r"bias must be float32 or bfloat16, got torch\.int32"):
        split(steps, 3, 5, bias=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(EpilogueError, match="unknown epilogue step 'gelu2'"):
        split([*epilogue_mod.as_steps(steps), "gelu2"], 3, 5, bias=bias)
    with pytest.raises(EpilogueError):  # not a tensor: the typed error, not AttributeError
        split(steps, 3, 5, bias=[1.0] * 5)  # type: ignore[arg-type]


class _FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def arm(self, name: str, cost: dict[str, float], used: list[str]):
        """A launch that advances this clock by ``cost[name]`` (read at call time), logs ``name``
        in ``used`` and returns its first argument."""

        def run(*args):
            self.t += cost[name]
            used.append(name)
            return args[0] if args else None

        return run


def test_thread_adaptive_follows_load(monkeypatch):
    """Deterministic (fake clock): both launches are learned, the faster is used, a load change
    is noticed by the periodic probe or by the current launch's own slowdown."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    cost = {"multi": 0.6e-3, "single": 1.2e-3}  # quiet machine: two threads win
    used: list[str] = []

    def arm(name):
        return clock.arm(name, cost, used)

    ad = ThreadAdaptive(arm("multi"), arm("single"), probe_every=16, sample_every=1)
    for _ in range(20):
        ad(0)
    assert used[:6] == ["multi", "single"] * 3  # learning both, alternating
    assert ad.current == 0 and used[6:].count("single") == 1  # one probe in 14 later calls
    cost["multi"] = 8e-3  # a neighbour is busy: the two-thread launch stalls at its barrier
    used.clear()
    for _ in range(6):
        ad(0)
    assert ad.current == 1 and used[-1] == "single"  # its own median gave it away
    cost["multi"] = 0.6e-3  # quiet again: the next probe of the two-thread launch...
    for _ in range(40):
        ad(0)
    assert ad.current == 0 and ad.switches == 2  # ... brings it back


def _record_launches(monkeypatch):
    """(mm module, launch log, the first tile config with 4 threads, a [4, 300], b [300, 70]):
    every native launch appends its thread count to the log; ``b`` is packed beforehand (a call
    that packs is not a timing). Skips on a one-thread machine."""
    from torchport import native

    mm_mod = sys.modules["torchport.gemm.mm"]
    if native.num_threads() < 2:
        pytest.skip("needs two intra-op threads")
    real = mm_mod.kernels.launcher
    seen: list[object] = []

    def recording(spec, cfg, *rest):
        launch = real(spec, cfg, *rest)
        return lambda *a: seen.append(cfg.nt) or launch(*a)

    monkeypatch.setattr(mm_mod.kernels, "launcher", recording)
    cfg = G.Config(*G.kernels.TILES[native.cpu_info().isa][0], 4)
    a, b = torch.randn(4, 300), torch.randn(300, 70)
    for _ in range(2):  # packed and kept from the second use: the runners then time kernels only
        mm_mod.pack_cache.get(b, cfg.nr)
    return mm_mod, seen, cfg, a, b


def test_small_m_native_runner_adapts_threads(monkeypatch):
    """A small-M native runner launches the config, its one-thread twin and ATen (while it
    learns), all with the reference result; a large-M runner launches only the config."""
    mm_mod, seen, cfg, a, b = _record_launches(monkeypatch)
    run = mm_mod._native_runner(EpilogueSpec(), cfg, adapt=True)
    outs = [run(a, b, []) for _ in range(9)]
    assert seen == [0, 1, 0, 1, 0, 1]  # kernel launches; every third call went to ATen
    for o in outs:
        torch.testing.assert_close(o, a @ b, rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0], outs[1])  # the one-thread twin: bitwise the same
    seen.clear()
    fixed = mm_mod._native_runner(EpilogueSpec(), cfg, adapt=False)
    for _ in range(4):
        fixed(a, b, [])
    assert seen == [0, 0, 0, 0]


def test_aten_choice_keeps_native_alternatives(monkeypatch):
    """When the tuner chose ATen for a small-M problem, the runner starts on ATen and keeps the
    best native config (all threads, one thread) as measured alternatives; every launch gives
    the reference result."""
    mm_mod, seen, cfg, a, b = _record_launches(monkeypatch)

    def aten(x, y, ops):
        seen.append("aten")
        return x @ y

    run = mm_mod._native_runner(EpilogueSpec(), cfg, True, aten=aten)
    outs = [run(a, b, []) for _ in range(9)]
    assert seen == ["aten", 0, 1] * 3  # learning round robin, ATen first
    for o in outs:
        torch.testing.assert_close(o, a @ b, rtol=1e-4, atol=1e-4)
    seen.clear()  # a one-thread runner-up: ATen, that config and its all-threads twin
    single = mm_mod._native_runner(EpilogueSpec(), G.Config(cfg.mr, cfg.nr, 4, nt=1), True, aten)
    for _ in range(9):
        torch.testing.assert_close(single(a, b, []), a @ b, rtol=1e-4, atol=1e-4)
    assert seen == ["aten", 1, 0] * 3


def test_one_thread_winner_keeps_its_all_threads_twin(monkeypatch):
    """A one-thread config the tuner chose (under load, say) is not the small-M runner's only
    launch: its all-threads twin and ATen are learned too, so the runner can move to two
    threads once they are faster; the twin's result is bitwise the same."""
    mm_mod, seen, cfg, a, b = _record_launches(monkeypatch)
    run = mm_mod._native_runner(EpilogueSpec(), G.Config(cfg.mr, cfg.nr, 4, nt=1), adapt=True)
    outs = [run(a, b, []) for _ in range(9)]
    assert seen == [1, 0, 1, 0, 1, 0]  # the tuned one-thread launch first; every third: ATen
    for o in outs:
        torch.testing.assert_close(o, a @ b, rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_fused_runner_shares_the_aten_launch_as_product_plus_pass(monkeypatch):
    """A small-M fused runner's ATen launch is ATen's bare product plus one native epilogue pass
    (not one ATen op per step), so the bare and fused runners of a problem share all their
    launches, ATen's included, in one group; every launch gives the reference result."""
    from torchport.gemm.kernels import mm_reference

    mm_mod, seen, cfg, a, b = _record_launches(monkeypatch)
    real_pass = mm_mod.kernels.epilogue_pass

    def recording_pass(*args):
        apply = real_pass(*args)
        return lambda s, ops: seen.append("pass") or apply(s, ops)

    monkeypatch.setattr(mm_mod.kernels, "epilogue_pass", recording_pass)
    monkeypatch.setattr(mm_mod, "_groups", {})
    spec = EpilogueSpec.decode("bias_col:f32;gelu;add:f32")
    bias, r = torch.randn(70), torch.randn(4, 70)

    def aten(x, y, ops):  # the separate-ops ATen path: a bare runner's ATen launch only
        seen.append("aten")
        return x @ y

    bare = mm_mod._native_runner(EpilogueSpec(), cfg, True, aten=aten, group_key=("p",))
    fused = mm_mod._native_runner(spec, cfg, True, aten=aten, group_key=("p",))
    ref = mm_reference(a, b, spec, [bias, r])
    for _ in range(3):
        torch.testing.assert_close(bare(a, b, []), a @ b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fused(a, b, [bias, r]), ref, rtol=1e-4, atol=1e-4)
    assert seen == ["aten", 0, 1, "pass", 0, 1]  # each launch learned once, by either runner
    (g,) = mm_mod._groups.values()
    assert g.arms == (0, 1, 2) and g.current == 0  # ATen shared, and the runners' home


def test_adaptive_falls_back_to_aten_arm_under_load(monkeypatch):
    """With ATen as a third arm, a native choice that becomes slower than ATen under a load it
    was not tuned for is replaced by ATen after the learning round (fake clock)."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    cost = {"multi": 6e-3, "single": 1.4e-3, "aten": 1.0e-3}
    used: list[str] = []

    def arm(name):
        return clock.arm(name, cost, used)

    ad = ThreadAdaptive(arm("multi"), arm("single"), arm("aten"), probe_every=8)
    for _ in range(9):
        ad()
    assert used == ["multi", "single", "aten"] * 3 and ad.current == 2
    used.clear()
    for _ in range(16):
        ad()
    assert used.count("aten") == 14 and sorted(set(used)) == ["aten", "multi", "single"]


def test_adaptive_returns_to_its_home_arm(monkeypatch):
    """A runner that left its home arm (the tuner's ATen choice) on noisy learning samples
    returns to it once it is ahead by the small home margin; without ``home`` the 20 % switching
    margin keeps it on the 5 % slower launch (fake clock)."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    for home, expect in ((0, 0), (None, 1)):
        cost = {"aten": 2.0e-3, "native": 1.05e-3}
        used: list[str] = []
        ad = ThreadAdaptive(
            clock.arm("aten", cost, used),
            clock.arm("native", cost, used),
            probe_every=4,
            sample_every=1,
            home=home,
        )
        for _ in range(6):
            ad()
        assert ad.current == 1  # learning: ATen looked slow
        cost["aten"] = 1.0e-3
        for _ in range(40):
            ad()
        assert ad.current == expect, home
    with pytest.raises(AssertionError):
        ThreadAdaptive(lambda: None, lambda: None, home=2)


def test_grouped_runners_share_their_native_launch(monkeypatch):
    """Bare and fused runners of one problem (an ArmGroup over their native arms) learn the
    native launches once between them and always sit on the same one, even where the two
    launches are within the switching margin; each keeps its own ATen arm (fake clock)."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ArmGroup, ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    cost = {"multi": 1.0e-3, "single": 1.1e-3, "aten": 5e-3, "multi+": 1.04e-3}
    cost |= {"single+": 1.14e-3, "aten+": 9e-3}
    used: list[str] = []

    def arms(tag):
        return [clock.arm(n + tag, cost, used) for n in ("multi", "single", "aten")]

    g = ArmGroup((0, 1))
    bare = ThreadAdaptive(*arms(""), group=g, sample_every=1, probe_every=8)
    fused = ThreadAdaptive(*arms("+"), group=g, sample_every=1, probe_every=8)
    for _ in range(9):
        bare()
    used.clear()
    for _ in range(3):
        fused()
    assert used == ["aten+"] * 3  # the native launches were learned by the bare runner
    assert bare.current == fused.current == 0
    cost["multi"] = cost["multi+"] = 1.6e-3  # load: the one-thread launch wins by the margin
    for _ in range(24):
        bare()
        fused()
    assert g.current == 1 and bare.current == fused.current == 1
    cost["multi"], cost["multi+"] = 1.0e-3, 1.04e-3  # back within the margin: nobody moves
    for _ in range(40):
        bare()
        fused()
    assert bare.current == fused.current == g.current
    private = ThreadAdaptive(*arms("+"), group=ArmGroup((0, 1)), sample_every=1)
    cost["aten+"] = 0.2e-3  # a private arm faster by the margin is still taken
    for _ in range(12):
        private()
    assert private.current == 2


def test_grouped_runner_takes_a_switch_at_its_next_call(monkeypatch):
    """Runners that share every arm with their group (bare and fused, as the GEMM builds them)
    run the launch the group last settled on from their very next call, sampled or not: before,
    the fused runner stayed on the old launch until its own next timed call (up to
    ``sample_every - 1`` calls), so interleaved bare/fused timings compared different launches."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ArmGroup, ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    cost = {"multi": 1.0e-3, "single": 1.5e-3, "multi+": 1.02e-3, "single+": 1.52e-3}
    used: list[str] = []

    def arms(tag):
        return [clock.arm(n + tag, cost, used) for n in ("multi", "single")]

    g = ArmGroup((0, 1))
    bare = ThreadAdaptive(*arms(""), group=g, sample_every=8, probe_every=64)
    fused = ThreadAdaptive(*arms("+"), group=g, sample_every=8, probe_every=64)
    for _ in range(16):
        bare()
        fused()
    assert bare.current == fused.current == 0
    cost["multi"] = cost["multi+"] = 4e-3  # load: the one-thread launch now wins
    switched = -1
    for call in range(64):
        bare()
        if bare.current == 1 and switched < 0:
            switched = call
            used.clear()
            fused()
            assert used == ["single+"]  # the very next fused call, though not a sampled one
            break
        fused()
    assert switched >= 0 and fused.current == 1
    private = ThreadAdaptive(*arms("+"), lambda: None, group=ArmGroup((0, 1)))
    assert private._follow is None  # a runner with a private arm keeps its own choice


def test_thread_adaptive_times_only_sampled_calls(monkeypatch):
    """After learning, only every ``sample_every``-th call reads the clock (probes included);
    the calls between go straight to the current launch."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    clock = _FakeClock()
    reads = [0]

    def counting_clock():
        reads[0] += 1
        return clock()

    monkeypatch.setattr(timing, "clock", counting_clock)
    cost = {"multi": 0.6e-3, "single": 1.2e-3}
    used: list[str] = []

    def arm(name):
        return clock.arm(name, cost, used)

    ad = ThreadAdaptive(arm("multi"), arm("single"), probe_every=64, sample_every=8)
    for _ in range(64):
        ad()
    # 6 learning calls, then calls 8, 16, ..., 64 timed (64 is the probe of "single")
    assert reads[0] == 2 * (6 + 8)
    assert used[6:].count("single") == 1 and used[-1] == "single" and ad.current == 0


def test_adaptive_ignores_calls_that_packed(monkeypatch):
    """A call during which the event counter moves (a weight was packed) is not a timing of the
    launch: packing inside the two-thread launch's learning calls must not make the runner
    settle on the one-thread launch (fake clock)."""
    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    clock = _FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    events = {"misses": 0}
    cost = {"multi": 0.6e-3, "single": 1.2e-3}
    used: list[str] = []

    def arm(name):
        def run():
            if name == "multi" and used.count("multi") < 2:  # packs two new weights
                events["misses"] += 1
                clock.t += 20e-3
            clock.t += cost[name]
            used.append(name)

        return run

    ad = ThreadAdaptive(arm("multi"), arm("single"), events=lambda: events["misses"])
    for _ in range(8):
        ad()
    assert [len(h) for h in ad.history] == [3, 3]  # two packing calls were not recorded
    assert ad.current == 0 and ad.switches == 0
    plain = ThreadAdaptive(arm("multi"), arm("single"))  # without the counter: misled
    used.clear()
    for _ in range(8):
        plain()
    assert plain.current == 1


def test_pack_probe_never_reads_moved_memory():
    """A weight whose storage is reallocated in place (resize_) invalidates its probe without
    reading the old, freed address."""
    from torchport.gemm.pack import _Probe

    w = torch.randn(64, 32)
    probe = _Probe(w)
    assert probe.unchanged()
    w.resize_(1 << 20, 32)  # grows the storage: new memory
    assert not probe.unchanged()


def test_pack_cache_repacks_new_version_in_place_unless_held():
    """A new version of a cached weight is packed into the old buffer when nothing else holds
    it (no fresh pages to fault in), into a fresh one when something does; both equal the
    reference packing."""
    from torchport.gemm.pack import pack_b_reference

    cache = PackCache()
    w = torch.nn.Parameter(torch.randn(50, 40), requires_grad=False)  # kept from its first use
    first = cache.get(w.t(), 24)
    ptr = first.data_ptr()
    del first
    w.add_(1.0)
    second = cache.get(w.t(), 24)
    assert second.data_ptr() == ptr and torch.equal(second, pack_b_reference(w.t(), 24))
    w.mul_(2.0)  # `second` is still held here: its buffer must not change under it
    kept = second.clone()
    third = cache.get(w.t(), 24)
    assert third.data_ptr() != second.data_ptr() and torch.equal(second, kept)
    assert torch.equal(third, pack_b_reference(w.t(), 24))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["t", "n", "strided"])
@pytest.mark.parametrize("kn,nr", [((1, 1), 8), ((7, 13), 8), ((67, 100), 24), ((5, 3), 64)])
def test_pack_b_matches_reference(native_on, dtype, layout, kn, nr):
    from torchport.gemm.pack import pack_b, pack_b_reference

    k, n = kn
    w = torch.randn(n, 2 * k).to(dtype)
    b = {"t": w[:, :k].t(), "n": w[:, :k].t().contiguous(), "strided": w.t()[::2]}[layout]
    with config.override(native=native_on):
        assert torch.equal(pack_b(b, nr), pack_b_reference(b, nr))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_large_pack_lands_in_huge_page_memory(native_on, monkeypatch):
    """A packed operand from HUGEPAGE_MIN_BYTES up starts on a 2 MiB boundary (its pages advised
    as transparent huge pages) and equals the reference; a smaller one is plain memory."""
    from torchport.gemm import pack as P
    from torchport.gemv.hugepages import HUGE

    monkeypatch.setattr(P, "HUGEPAGE_MIN_BYTES", 64 << 10)
    w = torch.randn(260, 67)  # packed at nr=8: 33 panels x 67 x 8 x 4 B = 70 KiB
    with config.override(native=native_on):
        big = P.pack_b(w.t(), 8)
        small = P.pack_b(w[:16].t(), 8)
    assert big.data_ptr() % HUGE == 0 and big.is_contiguous()
    assert torch.equal(big, P.pack_b_reference(w.t(), 8))
    assert torch.equal(small, P.pack_b_reference(w[:16].t(), 8))
    assert P.packed_empty((2, 3), torch.bfloat16).shape == (2, 3)


def test_small_m_fused_problem_takes_the_bare_choice(fresh_cache):
    """At small M a fused epilogue is not tuned on its own: the problem is tuned once (bare)
    and every epilogue of that shape runs the bare winner; results match the reference."""
    from torchport.autotune import tuner
    from torchport.gemm.epilogue import EpilogueSpec as Spec
    from torchport.gemm.kernels import mm_reference

    torch.manual_seed(3)
    a, b = torch.randn(3, 256), torch.randn(256, 1030)
    r, bias = torch.randn(3, 1030), torch.randn(1030)
    before = tuner.stats.tuned
    with config.override(autotune=True, autotune_reps=3):
        y = G.mm(a, b, bias=bias, epilogue=["gelu", G.Add(r)])
        G.mm(a, b, bias=bias, epilogue=["silu"])
    assert tuner.stats.tuned - before == 1
    won = {k: v for (_, k), v in G.decisions.items() if k.startswith("M=3 N=1030 K=256 ")}
    assert len(won) == 3 and len(set(won.values())) == 1, won
    spec = Spec.decode("bias_col:f32;gelu;add:f32")
    ref = mm_reference(a, b, spec, [bias, r])
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_tuning_rotation_reuses_one_buffer_per_copy_across_widths():
    from torchport.gemm.pack import pack_b_reference

    mm = sys.modules["torchport.gemm.mm"]

    torch.manual_seed(0)
    copies = [(torch.randn(1, 37), torch.randn(37, 53), []) for _ in range(2)]
    rot = mm._Rotation(copies)
    for nr in (8, 24, 16, 8):
        for idx, (_, b, _) in enumerate(copies):
            got = rot.packed(idx, nr)
            assert torch.equal(got, pack_b_reference(b, nr))
        assert {w for (_, w, _) in rot.packs} == {nr}
    assert len(rot.buffers) == 2


def test_tuning_rotation_pair_packs_share_the_copy_buffer():
    """A pair-packed (vdpbf16ps) width and the plain pack of the same width are different
    bytes: the rotation refills the copy's one buffer between them, never mixing them."""
    from torchport.gemm.pack import pack_b_reference, pack_pairs_reference

    mm = sys.modules["torchport.gemm.mm"]

    torch.manual_seed(0)
    copies = [(torch.randn(1, 38), torch.randn(53, 38).bfloat16().t(), []) for _ in range(2)]
    rot = mm._Rotation(copies)
    for nr, dp in ((32, 1), (32, 0), (64, 1), (32, 1)):
        for idx, (_, b, _) in enumerate(copies):
            got = rot.packed(idx, nr, dp)
            if dp:
                ref = pack_pairs_reference(b, nr)
                assert torch.equal(got.view(torch.bfloat16).view(ref.shape), ref)
            else:
                assert torch.equal(got, pack_b_reference(b, nr))
        assert {(w, d) for (_, w, d) in rot.packs} == {(nr, dp)}
    assert len(rot.buffers) == 2


def test_tuning_order_groups_candidates_by_width():
    mm = sys.modules["torchport.gemm.mm"]
    cands = mm.candidates(1, 4096, 1024, "avx2")
    order = mm._tuning_order(cands)
    assert order[0].is_anchor and sorted(c.name for c in order) == sorted(c.name for c in cands)
    widths = [int(c.param("nr")) for c in order[1:]]
    assert all(widths.index(w) == i or widths[i - 1] == w for i, w in enumerate(widths))


def test_bf16_small_m_offers_pair_dot_tiles_only_where_they_run():
    from torchport import native

    has_dot = native.cpu_info().has_avx512_bf16
    mm_mod = sys.modules["torchport.gemm.mm"]
    for m in (1, 3, 8, 32):
        cands = G.candidates(m, 4096, 1024, "avx512", 2)
        assert 2 <= len(cands) <= 10
        assert any(c.param("dp", 0) for c in cands) == has_dot
        assert not any(c.param("dp", 0) for c in G.candidates(m, 4096, 1024, "avx512", 4))
        assert not any(c.param("dp", 0) for c in G.candidates(m, 4096, 1024, "avx2", 2))
    # beyond SMALL_M: the large-M vdpbf16ps tiles (the blocked drivers), not the small-M ones
    # (dp 2: the AMX kernel where the machine has it, tests/test_gemm_amx.py)
    large = [c for c in G.candidates(64, 4096, 1024, "avx512", 2) if c.param("dp", 0) == 1]
    assert bool(large) == (has_dot and not kernels.amx_ready())  # AMX replaces them there
    assert all((c.param("mr"), c.param("nr")) in templates.DP_TILES["large"] for c in large)
    for c in G.candidates(8, 4096, 1024, "avx512", 2):
        if c.param("dp", 0) == 1:
            assert mm_mod._config(c).dp == 1
            assert (c.param("mr"), c.param("nr")) in templates.DP_TILES["small"]


@pytest.mark.skipif(not native.cpu_info().has_avx512_bf16, reason="needs AVX512-BF16")
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32])
def test_bf16_small_m_pair_dot_candidates_prefetch_8kb_ahead(m):
    """The small-M pair-dot candidates prefetch at least 8 KB of the panel stream ahead (``pf``
    k pairs of ``nr`` 32-bit words), and from 8 rows none runs without prefetch (slower and
    bimodal there, so tuning noise could pick it)."""
    for n, k in ((4096, 1024), (11008, 4096)):
        dps = [c for c in G.candidates(m, n, k, "avx512", 2) if c.param("dp", 0) == 1]
        assert dps
        for c in dps:
            pf, nr = int(c.param("pf")), int(c.param("nr"))
            assert pf * nr * 4 >= 8192 or (pf == 0 and m < 8), c.name


@pytest.mark.parametrize(
    "k,layout", [(64, "t"), (63, "t"), (64, "n")], ids=["even", "odd", "rowmajor"]
)
def test_bf16_small_m_through_the_tuner_any_layout(k, layout):
    """Pair-dot candidates run on every B layout and odd K (pair packing pads K with a zero
    pair); every layout tunes and matches the reference."""
    from torchport.gemm.kernels import mm_reference

    torch.manual_seed(1)
    x = torch.randn(5, k).bfloat16()
    w = torch.randn(300, k).bfloat16()
    b = w.t() if layout == "t" else w.t().contiguous()
    bias = torch.randn(300).bfloat16()
    with config.override(autotune=True, autotune_reps=2):
        y = G.mm(x, b, bias=bias, epilogue=["gelu"])
    ref = mm_reference(x, b, EpilogueSpec.decode("bias_col:bf16;gelu"), [bias])
    torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "spec,operands,match",
    [
        ("bias_col:f32", [torch.randn(1)], r"operand 0 .* shape \(17,\), got torch.float32 \(1,\)"),
        ("add:f32", [torch.randn(1, 1)], r"shape \(5, 17\), got torch.float32 \(1, 1\)"),
        ("bias_col:f32", [torch.randn(17).bfloat16()], r"float32 tensor .* got torch.bfloat16"),
        ("bias_row:f32", [torch.randn(17)], r"shape \(5,\), got torch.float32 \(17,\)"),
        ("bias_col:f32", [], r"takes 1 operand tensors, got 0"),
        ("relu", [torch.randn(17)], r"takes 0 operand tensors, got 1"),
    ],
)
def test_raw_op_checks_operands_against_its_spec(spec, operands, match) -> None:
    """``torch.ops.torchport.gemm`` is public: operands that do not fit the spec raise before any
    kernel reads them (a ``[1]`` bias for N = 17 was read past its end, a missing operand crashed
    the process), in eager calls and under the fake implementation alike."""
    a, b = torch.randn(5, 3), torch.randn(3, 17)
    with pytest.raises(GemmInputError, match=match):
        torch.ops.torchport.gemm(a, b, operands, spec)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(GemmInputError, match=match):
        fake = [mode.from_tensor(t) for t in operands]
        torch.ops.torchport.gemm(mode.from_tensor(a), mode.from_tensor(b), fake, spec)
    # a and b: mm()'s checks and messages, naming the raw op
    with pytest.raises(GemmInputError, match=r"gemm: inner dimensions must match.*K=3 vs 4"):
        torch.ops.torchport.gemm(a, torch.randn(4, 17), [], "")
    with pytest.raises(GemmInputError, match=r"gemm: a and b must have the same dtype"):
        torch.ops.torchport.gemm(a, b.bfloat16(), [], "")
    with pytest.raises(GemmInputError, match=r"gemm: b must be 2-D, got 1-D"):
        torch.ops.torchport.gemm(a, torch.randn(3), [], "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scalar_tensor_scale_gets_its_gradient(dtype) -> None:
    """A 0-dim ``Scale`` tensor with ``requires_grad`` (a learnable temperature) is fused as a
    broadcast column, so autograd reaches it; it was turned into a Python float and its gradient
    stayed None. Without ``requires_grad`` (or under no_grad) it is still a constant."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(5, 3, generator=g).to(dtype).requires_grad_(True)
    b = torch.randn(3, 17, generator=g).to(dtype)
    s = torch.tensor(1.5, dtype=dtype, requires_grad=True)
    with config.override(autotune=False):
        G.mm(a, b, epilogue=[G.Scale(s), "relu"]).sum().backward()
        a2, s2 = a.detach().clone().requires_grad_(True), s.detach().clone().requires_grad_(True)
        torch.relu((a2 @ b) * s2).sum().backward()
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(s.grad, s2.grad, **tol)
        torch.testing.assert_close(a.grad, a2.grad, **tol)
        with torch.no_grad():
            assert split([G.Scale(s)], 5, 17).spec.encode() == "scale=1.5"


@pytest.mark.parametrize("step", [G.Gelu, G.Relu, G.Silu, G.Bias])
def test_a_step_class_instead_of_an_instance_is_an_error(step) -> None:
    """``epilogue=[Gelu]`` (the class) was taken for a callable tail step: the call returned a
    ``Gelu`` object instead of a tensor (Relu/Silu raised a TypeError from ``__init__``)."""
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    with pytest.raises(
        EpilogueError, match=rf"class {step.__name__}, not a step.*{step.__name__}\(\)"
    ):
        G.mm(a, b, epilogue=[step])
    with pytest.raises(EpilogueError, match="not a step"):
        G.mm(a, b, epilogue=["relu", step])


def test_torch_func_transforms_run_torch_ops() -> None:
    """Under torch.func transforms ``mm`` (and ``gemv``) compute with torch ops, which every
    transform supports: the wrapped tensors took the eager fast path and failed ("Cannot access
    data pointer"), and through the custom op, which has no forward-mode formula, jvp gave a
    zero tangent."""
    from torchport.gemv import gemv
    from torchport.lowp import NVFP4Tensor

    a, b = torch.randn(5, 3), torch.randn(3, 17)

    def ref(x):
        return F.gelu(x @ b)

    with config.override(autotune=False):
        ours = lambda x: G.mm(x, b, epilogue=["gelu"])  # noqa: E731
        t1 = torch.func.jvp(ours, (a,), (torch.ones_like(a),))[1]
        t2 = torch.func.jvp(ref, (a,), (torch.ones_like(a),))[1]
        torch.testing.assert_close(t1, t2)
        g1 = torch.func.grad(lambda x: ours(x).sum())(a)
        torch.testing.assert_close(g1, torch.func.grad(lambda x: ref(x).sum())(a))
        xs = torch.randn(2, 5, 3)
        torch.testing.assert_close(torch.func.vmap(ours)(xs), ref(xs))
    w, x = torch.randn(16, 64), torch.randn(1, 64)
    for wt, wd in ((w, w), (NVFP4Tensor.from_float(w), NVFP4Tensor.from_float(w).dequantize())):
        tangent = torch.func.jvp(lambda v, wt=wt: gemv(v, wt), (x,), (torch.ones_like(x),))[1]
        torch.testing.assert_close(tangent, torch.ones_like(x) @ wd.t(), rtol=1e-5, atol=1e-5)


def test_scale_by_negative_zero_is_not_interned_with_positive_zero() -> None:
    """``Op("scale", 0.0) == Op("scale", -0.0)`` made ``Scale(-0.0)`` reuse the interned spec of an
    earlier ``Scale(0.0)``: the product times -0.0 came out +0.0 (torch: -0.0)."""
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    with config.override(autotune=False):
        pos = G.mm(a, b, epilogue=[G.Scale(0.0)])
        neg = G.mm(a, b, epilogue=[G.Scale(-0.0)])
    assert not bool(torch.signbit(pos).any()) and bool(torch.signbit(neg).all())


def test_bf16_cast_to_float32_keeps_float32_sums_on_every_backend() -> None:
    """With bf16 inputs and a ``Cast(float32)`` epilogue ATen rounded the product to bf16
    before the cast while the kernels keep float32 sums: the result's precision (relative error
    ~2e-3 against ~1e-7) depended on the tuner's pick, and could change between calls of one
    shape as an adaptive runner's arm moved. The ATen path multiplies in float32 now."""
    g = torch.Generator().manual_seed(9)
    for m in (8, 64):  # (M=8: an adaptive runner's ATen arm; 64: the tuned ATen candidate)
        a = torch.randn(m, 1024, generator=g).bfloat16()
        b = torch.randn(512, 1024, generator=g).bfloat16().t()
        ref = a.double() @ b.double()
        sp = split([G.Cast(torch.float32)], m, 512)
        aten_out = G.kernels.mm_aten(a, b, sp.spec, [])
        assert aten_out.dtype == torch.float32
        assert torch.allclose(aten_out.double(), ref, rtol=1e-5, atol=1e-4)
        for backends, tune in (("ATEN", True), ("NATIVE,ATEN", False), ("NATIVE,ATEN", True)):
            with config.override(max_autotune_gemm_backends=backends, autotune=tune):
                for _ in range(3):  # (an adaptive runner's arms both run in its first calls)
                    out = G.mm(a, b, epilogue=[G.Cast(torch.float32)])
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    assert out.dtype == torch.float32 and err < 1e-5, (m, backends, err)


def test_changing_scale_values_stop_compiling_new_kernels(monkeypatch):
    """A constant scale is compiled into the kernel: a value that changed on every call (a
    schedule) compiled a library per call (0.5-2.7 s each, every one kept loaded). Past
    SCALE_CONSTANTS values a new one is a column operand, and results stay exact."""
    monkeypatch.setattr(epilogue_mod, "SCALE_CONSTANTS", 2, raising=False)
    monkeypatch.setattr(epilogue_mod, "_scale_constants", set(), raising=False)
    torch.manual_seed(0)
    a, b = torch.randn(5, 16), torch.randn(16, 12)
    values = [0.5, -1.25, 3.0, 0.1, -0.0, 7.5]
    specs = set()
    for v in values:
        sp = split([G.Scale(v), "relu"], 5, 12)
        specs.add(sp.spec.encode())
        want = torch.relu((a @ b) * v)
        got = mm(a, b, epilogue=[G.Scale(v), "relu"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.signbit(), want.signbit())
    assert specs == {"scale=0.5;relu", "scale=-1.25;relu", "scale_col:f32;relu"}
    again = split([G.Scale(0.5)], 5, 12)  # a value compiled in stays compiled in
    assert again.spec.encode() == "scale=0.5" and not again.operands


@pytest.mark.parametrize("use_native", [False, True])
def test_scale_column_of_a_scalar_is_not_rounded_to_bf16(monkeypatch, use_native):
    """A scalar Scale past SCALE_CONSTANTS is a float32 column; the ATen route and the
    recomputing backward cast it to bf16 first (0.1 -> 0.10009765625), so a bf16 mm(...,
    [Scale(0.1)]) and its grad_a differed from eager's (a @ b) * 0.1 and from the value
    compiled in."""
    monkeypatch.setattr(epilogue_mod, "SCALE_CONSTANTS", 0, raising=False)
    monkeypatch.setattr(epilogue_mod, "_scale_constants", set(), raising=False)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).bfloat16()
    b = torch.randn(64, 48, generator=g).bfloat16()
    up = torch.randn(32, 48, generator=g).bfloat16()
    assert split([G.Scale(0.1)], 32, 48).spec.encode() == "scale_col:f32"
    with config.override(native=use_native):
        a1 = a.clone().requires_grad_()
        got = mm(a1, b, epilogue=[G.Scale(0.1)])
        got.backward(up)
        monkeypatch.setattr(epilogue_mod, "SCALE_CONSTANTS", 1, raising=False)
        a2 = a.clone().requires_grad_()
        compiled_in = mm(a2, b, epilogue=[G.Scale(0.1)])  # the value compiled in
        compiled_in.backward(up)
    assert split([G.Scale(0.1)], 32, 48).spec.encode() == "scale=0.1"
    a3 = a.clone().requires_grad_()
    eager = (a3 @ b) * 0.1
    eager.backward(up)
    assert torch.equal(got, compiled_in)
    if not use_native:  # the kernels round the float32 sums once; ATen rounds a @ b first
        assert torch.equal(got, eager)
    assert torch.equal(a1.grad, a3.grad) and torch.equal(a2.grad, a3.grad)


def test_scale_takes_numpy_scalars_and_rejects_a_huge_int_typed():
    np = pytest.importorskip("numpy")
    a, b = torch.randn(3, 8), torch.randn(8, 5)
    got = mm(a, b, epilogue=[G.Scale(np.float32(0.5))])
    torch.testing.assert_close(got, (a @ b) * 0.5, rtol=1e-5, atol=1e-5)
    with pytest.raises(EpilogueError, match="finite"):  # was an untyped OverflowError
        split([G.Scale(10**400)], 3, 5)
    with pytest.raises(EpilogueError, match="number or tensor"):
        split([G.Scale(np.bool_(True))], 3, 5)


def test_bf16_gemm_sums_float32_bias_and_scale_gradients_in_float32():
    # a float32 bias/scale of a bf16 GEMM had its gradient summed in bf16 and rounded there
    # (0.03 off on a bias gradient of ~8: 1 bf16 ulp); eager's float32 autograd sums in float32
    # from exact products. A bf16 bias stays F.linear's: one bf16 rounding of the sum.
    torch.manual_seed(0)
    x, w = torch.randn(64, 48).bfloat16(), torch.randn(40, 48).bfloat16()
    g = torch.randn(64, 40).bfloat16()
    for bdt in (torch.float32, torch.bfloat16):
        b = torch.randn(40, dtype=bdt)
        b1, b2 = (b.clone().requires_grad_() for _ in range(2))
        linear(x, w, b1).backward(g)
        y = F.linear(x, w, b2) if bdt == torch.bfloat16 else ((x @ w.t()).float() + b2).bfloat16()
        y.backward(g)
        assert b1.grad is not None and torch.equal(b1.grad, b2.grad), bdt
    s = torch.randn(40)
    s1, s2 = (s.clone().requires_grad_() for _ in range(2))
    linear(x, w, epilogue=[G.Scale(s1)]).backward(g)
    # the scaled product is the kernels' float32 one (the backward recomputes it in float32)
    ((x.float() @ w.float().t()) * s2).bfloat16().backward(g)
    assert s1.grad is not None and torch.equal(s1.grad, s2.grad)


def test_bf16_gemm_backward_recomputes_in_the_forwards_float32():
    # the kernels add a float32 bias to the float32 accumulator and scale that; the backward
    # recomputed a @ b and the bias in bf16, so a float32 Scale's gradient multiplied g by
    # values rounded twice to bf16 (bias 1000.3 as 1000: off by 0.3 * sum(g), not rounding)
    torch.manual_seed(0)
    a, b = torch.randn(32, 48).bfloat16(), torch.randn(48, 24).bfloat16()
    g = torch.randn(32, 24).bfloat16()
    bias = 1000.3 + torch.randn(24)
    scale = torch.randn(24)
    for tail in ([], ["gelu"]):
        s = scale.clone().requires_grad_()
        a1 = a.clone().requires_grad_()
        mm(a1, b, epilogue=[G.Bias(bias), G.Scale(s), *tail]).backward(g)
        a64 = a.double().requires_grad_()
        s64 = scale.double().requires_grad_()
        y = (a64 @ b.double() + bias.double()) * s64
        (F.gelu(y) if tail else y).backward(g.double())
        assert s.grad is not None and a1.grad is not None
        torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-5, atol=1e-3)
        # grad_a is bf16 (one rounding of g @ b.T, and of g where the chain rounds it)
        torch.testing.assert_close(a1.grad.double(), a64.grad, rtol=3e-2, atol=5e-2)


class _MatmulLog(TorchDispatchMode):
    """Records the input dtypes of every aten.mm a block runs (backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.mms: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.mm.default:
            self.mms.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_gemm_backward_recomputes_only_what_a_step_reads():
    # 6a6a976's float32 recompute of a @ b ran on every backward, though only a scale operand's
    # gradient and an activation's derivative read it: a plain bf16 mm/linear (bias, add, a
    # constant scale) spent a float32 GEMM and float32 copies of a and b on nothing (1.6-2.8x
    # the backward's time, readD)
    torch.manual_seed(0)
    a, b = torch.randn(16, 32).bfloat16(), torch.randn(32, 8).bfloat16()
    bias, res, g = torch.randn(8).bfloat16(), torch.randn(16, 8).bfloat16(), torch.randn(16, 8)
    g = g.bfloat16()
    for ep, n_f32 in (
        ([G.Bias(bias)], 0),
        ([G.Bias(bias), G.Add(res), G.Scale(0.5)], 0),
        ([G.Bias(bias), "relu"], 1),
        ([G.Scale(torch.randn(8)), G.Bias(bias)], 1),
    ):
        a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = mm(a1, b1, epilogue=ep)
        with _MatmulLog() as log:
            y.backward(g)
        # grad_a and grad_b in bf16, and the float32 recompute only where a step reads it
        assert log.mms.count((torch.bfloat16, torch.bfloat16)) == 2, (ep, log.mms)
        assert log.mms.count((torch.float32, torch.float32)) == n_f32, (ep, log.mms)
    # the gradients are those of eager's ops (bias and add: g itself; grad_a, grad_b bf16 GEMMs)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    bias1, res1 = bias.clone().requires_grad_(), res.clone().requires_grad_()
    mm(a1, b1, epilogue=[G.Bias(bias1), G.Add(res1), G.Scale(0.5)]).backward(g)
    g2 = g * 0.5
    assert a1.grad is not None and torch.equal(a1.grad, g2 @ b.t())
    assert b1.grad is not None and torch.equal(b1.grad, a.t() @ g2)
    assert bias1.grad is not None and torch.equal(bias1.grad, g2.sum(0))
    assert res1.grad is not None and torch.equal(res1.grad, g2)


def test_float32_gemm_sums_bf16_bias_and_scale_gradients_in_float32():
    # a bf16 bias/scale of a float32 GEMM had its gradient summed in bf16, each element rounded
    # to bf16 first (0.0625 off on the bias, 0.5 on the scale); eager adds/multiplies in float32
    # (promotion) and rounds the float32 sum once
    torch.manual_seed(0)
    x, w, g = torch.randn(64, 48), torch.randn(40, 48), torch.randn(64, 40)
    b = torch.randn(40).bfloat16()
    b1, b2 = (b.clone().requires_grad_() for _ in range(2))
    linear(x, w, b1).backward(g)
    ((x @ w.t()) + b2).backward(g)
    assert b1.grad is not None and b1.grad.dtype == torch.bfloat16
    assert torch.equal(b1.grad, b2.grad)
    s = torch.randn(40).bfloat16()
    s1, s2 = (s.clone().requires_grad_() for _ in range(2))
    linear(x, w, epilogue=[G.Scale(s1)]).backward(g)
    ((x @ w.t()) * s2).backward(g)
    assert s1.grad is not None and s1.grad.dtype == torch.bfloat16
    assert torch.equal(s1.grad, s2.grad)
