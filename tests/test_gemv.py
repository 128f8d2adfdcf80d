"""Decode GEMV vs the float64 reference over formats, shapes and batch sizes; routing; errors."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from torchport import config, native
from torchport.gemv import GemvInputError, gemv, gemv_reference
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor


def _weight(fmt: str, w: torch.Tensor):
    if fmt == "f32":
        return w, w
    if fmt == "bf16":
        return w.bfloat16(), w.bfloat16().float()
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        t = Float8Tensor.from_float(w, dt, "row")
    elif fmt == "fp8_tensor":
        t = Float8Tensor.from_float(w, torch.float8_e4m3fn, "tensor")
    elif fmt == "nvfp4":
        t = NVFP4Tensor.from_float(w)
    elif fmt == "nvfp4_nopts":
        t = NVFP4Tensor.from_float(w, per_tensor_scale=False)
    else:
        t = MXTensor.from_float(
            w, {"mxfp4": "fp4_e2m1", "mxfp8": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2"}[fmt]
        )
    return t, t.dequantize()


FMTS = [
    "f32",
    "bf16",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_tensor",
    "nvfp4",
    "nvfp4_nopts",
    "mxfp4",
    "mxfp8",
    "mxfp8_e5m2",
]
SHAPES = [(1, 32), (17, 96), (131, 1056)]  # (N, K): N = 1, primes; several 32-groups


def _check(out: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, bias, tol: float):
    ref = gemv_reference(x.float(), wd, bias).double()
    mag = x.double().abs().reshape(-1, x.shape[-1]) @ wd.double().abs().T
    err = (out.double().reshape(mag.shape) - ref.reshape(mag.shape)).abs()
    assert bool((err <= tol * mag + 1e-6).all()), float((err / (mag + 1e-12)).max())


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [(1,), (3, 1), (2, 4, 1)], ids=str)
def test_gemv_matches_reference_exact_activations(fmt, shape, rows):
    n, k = shape
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    wq, wd = _weight(fmt, w)
    x = torch.randn(*rows, k, generator=g)
    bias = torch.randn(n, generator=g) if n % 2 else None
    with config.override(gemv_fp4_int8=False):
        out = gemv(x, wq, bias)
    assert out.shape == (*rows, n) and out.dtype == x.dtype
    _check(out, x, wd, bias, 2e-6)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(3, 32), (29, 1024), (5, 192)], ids=str)  # 192: odd 64-chunks
@pytest.mark.parametrize("b", [1, 3, 7])
def test_gemv_int8_activation_error_bound(fmt, shape, b):
    n, k = shape
    g = torch.Generator().manual_seed(b + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(b, k, generator=g) * 3
    wq, wd = _weight(fmt, w)
    with config.override(gemv_fp4_int8=True):
        out = gemv(x, wq)
    ref = gemv_reference(x, wd).double()
    # |x - dequant(q(x))| <= amax_g / 254 per element: the error is bounded by sum |w| * that
    xs = (
        x.reshape(b, k // 32, 32).abs().amax(-1, keepdim=True).expand(b, k // 32, 32).reshape(b, k)
        / 254
    )
    bound = xs.double() @ wd.double().abs().T
    assert bool(((out.double() - ref).abs() <= bound * 1.001 + 1e-5).all())


def test_gemv_bf16_activations_and_odd_k():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 77, generator=g)  # K not a multiple of 32: scalar tail
    x = torch.randn(2, 1, 77, generator=g).bfloat16()
    out = gemv(x, w.bfloat16())
    assert out.dtype == torch.bfloat16
    ref = gemv_reference(x, w.bfloat16().float())
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    out = gemv(x.float(), w)
    _check(out, x.float(), w, None, 2e-6)


def test_gemv_nvfp4_k_multiple_of_16_only():
    w = torch.randn(8, 48)  # 48 = 3 blocks of 16: tail half-group handled
    wq, wd = _weight("nvfp4", w)
    x = torch.randn(1, 48)
    _check(gemv(x, wq), x, wd, None, 2e-6)


def test_gemv_empty_shapes():
    assert gemv(torch.randn(1, 0), torch.randn(5, 0)).tolist() == [[0.0] * 5]
    assert gemv(torch.randn(1, 8), torch.randn(0, 8)).shape == (1, 0)
    assert gemv(torch.randn(0, 8), torch.randn(3, 8)).shape == (0, 3)


def test_gemv_bad_inputs():
    w = torch.randn(4, 32)
    with pytest.raises(GemvInputError, match=r"at most 8 rows.*got 9"):
        gemv(torch.randn(9, 32), w)
    with pytest.raises(
        GemvInputError, match=r"last dimension must equal the weight's K=32, got shape \(1, 31\)"
    ):
        gemv(torch.randn(1, 31), w)
    with pytest.raises(GemvInputError, match=r"float32 or bfloat16 tensor, got torch.float64"):
        gemv(torch.randn(1, 32, dtype=torch.float64), w)
    with pytest.raises(GemvInputError, match=r"bias must have shape \(4,\), got \(3,\)"):
        gemv(torch.randn(1, 32), w, torch.randn(3))
    with pytest.raises(GemvInputError, match=r"2-D float32 or bfloat16 tensor, got torch.int32"):
        gemv(torch.randn(1, 32), torch.ones(4, 32, dtype=torch.int32))


def test_linear_module_uses_gemv_and_prefill_paths():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 48)
    w = lin.weight.detach().clone()
    lin.weight = torch.nn.Parameter(NVFP4Tensor.from_float(w), requires_grad=False)
    wd = lin.weight.dequantize()
    for shape in [(1, 64), (2, 1, 64), (40, 64)]:
        x = torch.randn(*shape, generator=g)
        with torch.no_grad(), config.override(gemv_fp4_int8=False):
            out = lin(x)
        ref = F.linear(x.double(), wd.double(), lin.bias.double())
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


RULE = "linear(decode x, W) -> torchport::gemv_dense"


def test_compile_leaves_tiny_dense_linears_to_inductor(monkeypatch):
    import torchport
    from torchport.compiler import last_report
    from torchport.gemv import routing

    def no_tuning(*a, **k):
        raise AssertionError("a tiny dense linear must not be tuned")

    monkeypatch.setattr(routing, "plan_for", no_tuning)  # below TUNE_MIN_WEIGHTS: no tuner at all
    torch._dynamo.reset()  # static shapes (a recompile would make them dynamic)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
    ).eval()
    x = torch.randn(2, 1, 32)
    with torch.no_grad():
        out = torchport.compile(m, inner="eager")(x)
        ref = m(x)
    # neither the GEMV nor the GEMM fusion pass takes them: Inductor/ATen keep the graph
    assert last_report().rule_counts == {}  # type: ignore[union-attr]
    assert torch.allclose(out, ref, atol=1e-5)


def test_compile_routes_large_decode_linear_by_tuner_decision(fresh_cache, monkeypatch):
    import torchport
    from torchport.compiler import last_report
    from torchport.gemv import ops

    full = ops.candidates
    monkeypatch.setattr(
        ops,
        "candidates",
        lambda fmt, int8=False, k=None, bx=False, rows=None: full(fmt, int8, k, bx)[:2],
    )
    ops._PLANS.clear()
    torch._dynamo.reset()  # static shapes (a recompile would make them dynamic)
    m = torch.nn.Sequential(torch.nn.Linear(448, 640), torch.nn.GELU()).eval()  # 286720 weights
    x = torch.randn(1, 448)
    try:
        with torch.no_grad(), config.override(autotune_reps=2):
            ref = m(x)
            # the tuner measured the native kernel as the winner: routed
            with config.override(max_autotune_gemm_backends="NATIVE"):
                out = torchport.compile(m, inner="eager")(x)
            assert last_report().rule_counts.get(RULE) == 1  # type: ignore[union-attr]
            assert torch.allclose(out, ref, atol=1e-4)
            # F.linear won (the only allowed choice): left alone
            ops._PLANS.clear()
            torch._dynamo.reset()  # compile afresh (same module code)
            with config.override(max_autotune_gemm_backends="ATEN"):
                torchport.compile(m, inner="eager")(x)
            assert RULE not in last_report().rule_counts  # type: ignore[union-attr]
            ops._PLANS.clear()
            torch._dynamo.reset()
            # prefill shapes are not routed to the GEMV (the GEMM engine may take them)
            with config.override(max_autotune_gemm_backends="NATIVE"):
                torchport.compile(m, inner="eager")(torch.randn(16, 448))
            assert RULE not in last_report().rule_counts  # type: ignore[union-attr]
        # grad enabled: not routed
        torch._dynamo.reset()
        torchport.compile(m, inner="eager")(x)
        assert RULE not in last_report().rule_counts  # type: ignore[union-attr]
    finally:
        ops._PLANS.clear()


@pytest.mark.skipif(native.cpu_info().isa == "scalar", reason="K blocks are in the AVX2 kernel")
@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8_e5m2", "nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("rows", [2, 4, 5, 8])
def test_float_kernel_k_blocks_keep_bits(fmt: str, rows: int) -> None:
    """From two activation rows the float kernel runs K in blocks (where the rows' activations
    exceed the block: 512 bytes here): every group of two to four rows keeps the bits of K in one
    piece, on one and two threads; a lone fifth row meets the reference; K not a multiple of 32."""
    from torchport.gemv import pack_dense
    from torchport.gemv.kernels import gemv_kernel

    g = torch.Generator().manual_seed(rows)
    k = 1056 if fmt in ("nvfp4", "mxfp4", "mxfp8") else 1000  # the block formats: whole blocks
    wq, wd = _weight(fmt, torch.randn(67, k, generator=g))
    pw = pack_dense(wq) if fmt in ("f32", "bf16") else wq.gemv_pack()
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(67, generator=g)
    isa = native.cpu_info().isa

    def run(xblock: int, threads: int) -> torch.Tensor:
        kern = gemv_kernel(pw.fmt, isa, 512, 0, xblock=xblock)
        out = torch.empty(rows, 67)
        st = kern(x, rows, k, pw.data, pw.scales, pw.rowscale, pw.pts, bias, 1, out, 67, threads)
        assert st == 0
        return out

    whole = run(0, 1)
    for xblock, threads in ((512, 1), (512, 2), (16384, 2)):
        out = run(xblock, threads)
        _check(out, x, wd.float(), bias, 1e-5)
        keep = rows - 1 if rows % 4 == 1 else rows
        assert torch.equal(out[:keep], whole[:keep]), (xblock, threads)


def test_float_kernel_rejects_negative_xblock() -> None:
    from torchport.gemv.kernels import gemv_kernel

    with pytest.raises(ValueError, match=r"xblock must be >= 0 bytes, got -1"):
        gemv_kernel("f32", native.cpu_info().isa, xblock=-1)


@pytest.mark.parametrize("fmt,rows4", [("nvfp4", 1), ("mxfp4", 0)])  # non-default variants
def test_kernel_variants_agree(fmt, rows4):
    from torchport.gemv import pack_dense
    from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel, gemv_fp4_pair_kernel
    from torchport.gemv.kernels import gemv_i8_kernel, gemv_kernel
    from torchport.native import cpu_info

    g = torch.Generator().manual_seed(5)
    w = torch.randn(23, 128, generator=g)
    wq, _ = _weight(fmt, w)
    pw = pack_dense(wq) if fmt == "bf16" else wq.gemv_pack()
    x = torch.randn(1, 128, generator=g)
    variants = [(gemv_kernel(pw.fmt, cpu_info().isa, 512, rows4), False)]
    if fmt in ("nvfp4", "mxfp4"):
        variants.append((gemv_i8_kernel(pw.fmt, cpu_info().isa, 512, rows4), True))
        if cpu_info().isa != "scalar":  # the pair-split int8 kernel (K % 64 == 0)
            variants.append((gemv_fp4_pair_kernel(pw.fmt, cpu_info().isa, 0), True))
            variants.append((gemv_fp4_block_kernel(pw.fmt, cpu_info().isa), True))
    for kern, int8 in variants:
        out = torch.empty(1, 23)
        kern(x, 1, 128, pw.data, pw.scales, pw.rowscale, pw.pts, torch.empty(0), 0, out, 23, 2)
        with config.override(gemv_fp4_int8=int8):
            ref = gemv(x, wq)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "nvfp4", "mxfp4", "mxfp8"])
def test_gemv_falls_back_visibly_without_native(fmt):
    from torchport import native
    from torchport.native import NativeFallbackWarning

    g = torch.Generator().manual_seed(9)
    w = torch.randn(9, 64, generator=g)
    wq, wd = _weight(fmt, w)
    x = torch.randn(2, 64, generator=g)
    native.reset_stats()
    with config.override(native=False, gemv_fp4_int8=False):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NativeFallbackWarning)
            out = gemv(x, wq)
    assert native.stats().fallbacks >= 1
    _check(out, x, wd, None, 2e-6)


# --- autotuned launch parameters ------------------------------------------------------------------


def test_gemv_launch_parameters_are_autotuned(fresh_cache, monkeypatch):
    from torchport import autotune
    from torchport.gemv import ops

    full = ops.candidates
    names = [c.name for c in full("f32")]
    assert names[0] == "aten_linear" and names[1] == "native_p512_r1_t0" and len(set(names)) == 9
    assert [c.name for c in full("nvfp4", int8=True)][1] == "block_p3072l2_t0"
    # the pair-split kernel only where the lane-block kernel cannot serve (K % 128 != 0)
    for k, pair in ((4096, False), (192, True), (None, True)):
        kernels = {c.param("kernel") for c in full("nvfp4", int8=True, k=k)}
        assert "block" in kernels and ("pair" in kernels) == pair, k
    # a reduced space keeps the test short (every candidate is a compiled kernel)
    monkeypatch.setattr(
        ops,
        "candidates",
        lambda fmt, int8=False, k=None, bx=False, rows=None: (
            full(fmt, int8, k)[:2] + full(fmt, int8, k)[-1:]
        ),
    )
    ops._PLANS.clear()
    torch.manual_seed(0)
    w = torch.randn(640, 448)  # 286720 weights: above TUNE_MIN_WEIGHTS
    t = NVFP4Tensor.from_float(w)
    x = torch.randn(1, 448)
    before = autotune.stats.tuned
    with config.override(autotune_reps=2):
        out = gemv(x, t)
    assert autotune.stats.tuned == before + 1
    plan = next(p for k, p in ops._PLANS.items() if k[0] == "nvfp4" and k[3:5] == (640, 448))
    assert plan.kernel is not None and not plan.candidate.is_anchor  # never ATen for quantized
    assert plan.candidate in ops.candidates("nvfp4", int8=True)
    _check(out, x, t.dequantize(), None, 2e-2)
    # the choice is persistent: a new process-level plan table hits the cache, no re-tuning
    ops._PLANS.clear()
    gemv(x, t)
    assert autotune.stats.tuned == before + 1


def test_gemv_dense_weight_may_route_to_f_linear(fresh_cache):
    from torchport.gemv import ops

    ops._PLANS.clear()
    w, b = torch.randn(600, 512), torch.randn(600)
    x = torch.randn(2, 512)
    try:
        with config.override(max_autotune_gemm_backends="ATEN"):
            out = gemv(x, w, b)
            plan = next(p for k, p in ops._PLANS.items() if k[3:5] == (600, 512))
            assert plan.kernel is None and plan.candidate.is_anchor
        assert torch.allclose(out, F.linear(x, w, b), atol=1e-4)
    finally:
        ops._PLANS.clear()


@pytest.mark.parametrize(
    ("xdt", "wdt"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_gemv_aten_plan_with_mixed_dtypes_keeps_the_weight_exact(fresh_cache, xdt, wdt):
    """A dense weight on the ATen plan whose dtype is not the activations': F.linear (which
    refuses mixed dtypes) ran on the weight cast to x's dtype, so a float32 weight was rounded to
    bf16. It now computes as the kernels do: float32 products of the exact values, bias added in
    float32, the result in x's dtype."""
    from torchport.gemv import ops

    ops._PLANS.clear()
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(600, 512, generator=g) * (1 + 2.0**-12)).to(wdt)  # not bf16 values
    b = torch.randn(600, generator=g)
    x = torch.randn(2, 512, generator=g).to(xdt)
    try:
        with config.override(max_autotune_gemm_backends="ATEN"):
            out = gemv(x, w, b)
            plan = next(p for k, p in ops._PLANS.items() if k[3:5] == (600, 512))
            assert plan.kernel is None
        want = F.linear(x.float(), w.float(), b).to(xdt)
        assert out.dtype == xdt
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    finally:
        ops._PLANS.clear()


# --- settled eager routes (quantized nn.Linear decode) ---------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4", "mxfp4", "mxfp8"])
def test_settled_route_matches_general_path_and_invalidates(fmt):
    g = torch.Generator().manual_seed(13)
    w = torch.randn(40, 128, generator=g)
    wq, wd = _weight(fmt, w)
    bias = torch.randn(40, generator=g)
    x = torch.randn(1, 128, generator=g)
    with torch.no_grad():
        first = F.linear(x, wq, bias)  # general path; settles the route
        route = wq._route
        assert route is not None and torch.equal(route.serve(x, bias), first)
        again = F.linear(x, wq, bias)  # the settled route
        assert wq._route is route and torch.equal(again, first)
        with config.override(gemv_fp4_int8=False):  # settings overridden: general path
            assert route.serve(x, bias) is None
            _check(F.linear(x, wq, bias), x, wd, bias, 2e-6)
        # another shape, dtype or bias (object, in-place update) re-settles
        x2 = torch.randn(3, 1, 128, generator=g)
        _check(F.linear(x2, wq, bias), x2, wd, bias, 3e-2)
        assert wq._route is not route and wq._route.shape == x2.shape
        bias.add_(1.0)
        assert wq._route.serve(x2, bias) is None
        _check(F.linear(x2, wq, bias), x2, wd, bias, 3e-2)
        out_nb = F.linear(x2, wq)
        _check(out_nb, x2, wd, None, 3e-2)
        xb = x2.bfloat16()
        outb = F.linear(xb, wq, bias.bfloat16())
        assert outb.dtype == torch.bfloat16 and wq._route.dtype == torch.bfloat16
        _check(outb.float(), xb.float(), wd, bias.bfloat16().float(), 3e-2)
        # non-contiguous activations go through the same route correctly
        xs = torch.randn(1, 256, generator=g)[:, ::2]
        _check(F.linear(xs, wq, bias), xs, wd, bias, 3e-2)
        _check(F.linear(xs, wq, bias), xs, wd, bias, 3e-2)


@pytest.mark.parametrize("bias_kind", ["bf16", "strided", "f32"])
def test_settled_route_sees_bias_writes_through_data(bias_kind):
    """A write through ``bias.data`` (its own version counter: the route's checks cannot see it)
    reaches the next settled call: a bias the route must convert is converted on every call, a
    float32 contiguous one is read where it lives. (A copy made when the route settled kept the
    old values.)"""
    g = torch.Generator().manual_seed(15)
    wq, wd = _weight("nvfp4", torch.randn(32, 64, generator=g))
    base = torch.randn(64, generator=g)
    bias = {"bf16": base[:32].bfloat16(), "strided": base[::2], "f32": base[:32].clone()}[bias_kind]
    x = torch.randn(1, 64, generator=g)
    with torch.no_grad():
        F.linear(x, wq, bias)
        first = F.linear(x, wq, bias)  # the settled route
        assert wq._route is not None and torch.equal(wq._route.serve(x, bias), first)
        bias.data.add_(100.0)
        route = wq._route
        after = route.serve(x, bias)
        assert after is not None  # still served: the route's checks saw nothing
        _check(after, x, wd, bias.float(), 3e-2)
        assert float((after - first).mean()) == pytest.approx(100.0, rel=1e-3)


def test_settled_route_leaves_autograd_calls_to_the_general_path():
    g = torch.Generator().manual_seed(14)
    wq, wd = _weight("nvfp4", torch.randn(24, 64, generator=g))
    x = torch.randn(1, 64, generator=g)
    with torch.no_grad():
        F.linear(x, wq)
    assert wq._route is not None
    xg = x.clone().requires_grad_(True)
    out = F.linear(xg, wq)  # autograd: the frozen-weight function, gradient flows to x
    out.sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape
    _check(out.detach(), x, wd, None, 3e-2)


@pytest.mark.parametrize("entry", ["F.linear", "gemv"])
def test_settled_route_leaves_torch_func_transforms_to_torch_ops(entry):
    """vmap over a quantized linear whose decode route had settled: the route served the
    transform's wrapped activation and failed ("Cannot access data pointer of Tensor that
    doesn't have storage"); it now declines, and the transform runs on torch ops."""
    g = torch.Generator().manual_seed(16)
    wq, wd = _weight("nvfp4", torch.randn(24, 64, generator=g))
    x, xs = torch.randn(1, 64, generator=g), torch.randn(3, 1, 64, generator=g)

    def f(v):
        return F.linear(v, wq) if entry == "F.linear" else gemv(v, wq)

    with torch.no_grad():
        for _ in range(3):  # the second call settles the route, the third takes it
            f(x)
        routes = [wq._route] if entry == "F.linear" else list(wq.gemv_pack().routes.values())
        assert any(r is not None for r in routes)
        out = torch.func.vmap(f)(xs)
    _check(out, xs, wd, None, 3e-2)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_torch_func_grad_of_gemv_with_a_bf16_bias(fmt):
    """``torch.func.grad`` over ``gemv`` with bf16 activations and a bf16 bias: the transform's
    torch-ops path added the bf16 bias to a float32 product and raised "self and mat2 must have
    the same dtype"; it now matches F.linear's gradient on the dequantized weight."""
    g = torch.Generator().manual_seed(19)
    wq, wd = _weight(fmt, torch.randn(8, 64, generator=g))
    x = torch.randn(1, 64, generator=g).bfloat16()
    b = torch.randn(8, generator=g).bfloat16()

    got = torch.func.grad(lambda v: gemv(v, wq, b).float().pow(2).sum())(x)
    want = torch.func.grad(lambda v: F.linear(v, wd, b.float()).pow(2).sum())(x.float())
    assert got.dtype == torch.bfloat16  # (bf16 rounding of the output and the gradient apart)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gemv_packed_route_follows_setting_env_and_override(fmt, monkeypatch):
    """``gemv_packed`` settles a route per (weight, activation dtype and shape) from the second
    call with a weight on; a later call still honours an assignment, an environment edit and an
    override of the settings that decide the launch. FP4 weights tell the launches apart: int8 activations (the default) err
    by ~1e-3 relative, float32 activations by ~1e-7."""
    from torchport import native
    from torchport.gemv import gemv_packed

    monkeypatch.delenv("TORCHPORT_GEMV_FP4_INT8", raising=False)
    monkeypatch.delenv("TORCHPORT_NATIVE", raising=False)
    g = torch.Generator().manual_seed(21)
    wq, wd = _weight(fmt, torch.randn(40, 128, generator=g))
    pw = wq.gemv_pack()
    x = torch.randn(1, 128, generator=g)

    def exact(out: torch.Tensor) -> bool:
        ref = gemv_reference(x, wd).double()
        mag = x.double().abs() @ wd.double().abs().T
        return bool(((out.double() - ref).abs() <= 2e-6 * mag + 1e-6).all())

    first = gemv_packed(x, pw)
    assert (x.dtype, x.shape, True) not in pw.routes  # one call may be a one-off pack
    assert torch.equal(gemv_packed(x, pw), first)  # used again: settles a route
    route = pw.routes[(x.dtype, x.shape, True)]
    assert torch.equal(route.serve(x, None), first) and not exact(first)  # int8 activations
    assert torch.equal(gemv_packed(x, pw), first)  # the settled route: same launch, same bits
    with config.override(gemv_fp4_int8=False):
        assert route.serve(x, None) is None and exact(gemv_packed(x, pw))
    monkeypatch.setenv("TORCHPORT_GEMV_FP4_INT8", "0")
    assert exact(gemv_packed(x, pw))
    monkeypatch.delenv("TORCHPORT_GEMV_FP4_INT8")
    assert torch.equal(gemv_packed(x, pw), first)
    try:
        config.gemv_fp4_int8 = False
        assert exact(gemv_packed(x, pw))
    finally:
        config.gemv_fp4_int8 = None
    assert torch.equal(gemv_packed(x, pw), first)
    # native kernels switched off: the visible ATen fallback, never the settled kernel
    warnings.simplefilter("ignore", native.NativeFallbackWarning)
    before = native.stats().fallbacks
    monkeypatch.setenv("TORCHPORT_NATIVE", "0")
    out = gemv_packed(x, pw)
    assert native.stats().fallbacks == before + 1 and exact(out)
    monkeypatch.delenv("TORCHPORT_NATIVE")
    with config.override(native=False):
        assert exact(gemv_packed(x, pw)) and native.stats().fallbacks == before + 2
    assert torch.equal(gemv_packed(x, pw), first) and native.stats().fallbacks == before + 2
    # a new activation shape or dtype settles its own route beside the first
    x3 = torch.randn(3, 128, generator=g)
    gemv_packed(x3, pw)
    assert (x3.dtype, x3.shape, True) in pw.routes and (x.dtype, x.shape, True) in pw.routes


@pytest.mark.parametrize(
    "shape", [(1, 40), (3, 1, 40), (1, 300000), (0, 5)], ids=["row", "3x1", "large", "empty"]
)
def test_route_output_source_hands_out_fresh_tensors(shape):
    """Settled routes allocate their outputs OUT_BATCH at a time (fewer for large outputs): each
    call still gets a new, separate float32 tensor of the shape, an inference tensor exactly in
    inference mode (as torch.empty's and F.linear's)."""
    from torchport.gemv.ops import _out_source

    new_out = _out_source(shape)
    outs = [new_out() for _ in range(19)]
    with torch.inference_mode():
        outs += [new_out() for _ in range(19)]
    outs += [new_out() for _ in range(3)]
    assert all(o.shape == shape and o.dtype == torch.float32 for o in outs)
    assert all(o.is_contiguous() for o in outs)
    assert [o.is_inference() for o in outs] == [False] * 19 + [True] * 19 + [False] * 3
    ptrs = {o.data_ptr() for o in outs if o.numel()}
    assert len(ptrs) == len([o for o in outs if o.numel()])  # no storage handed out twice


def test_routes_of_one_output_shape_share_an_output_source():
    """Two weights of the same N settle routes that draw from one output source (no batch of
    spare outputs per route), and every call still gets its own tensor with its own result."""
    g = torch.Generator().manual_seed(16)
    pws = [NVFP4Tensor.from_float(torch.randn(40, 128, generator=g)).gemv_pack() for _ in range(2)]
    x = torch.randn(1, 128, generator=g)
    from torchport.gemv import gemv_packed

    firsts = [gemv_packed(x, pw) for pw in pws]
    outs = [gemv_packed(x, pw) for _ in range(6) for pw in pws]  # settled from the 2nd call
    routes = [pw.routes[(x.dtype, x.shape, True)] for pw in pws]
    assert all(r is not None for r in routes)
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert all(torch.equal(o, firsts[i % 2]) for i, o in enumerate(outs))
    from torchport.gemv.ops import _OUT_SOURCES

    sources = [inspect.getclosurevars(r.run).nonlocals["new_out"] for r in routes]
    assert sources[0] is sources[1] is _OUT_SOURCES[((1, 40), torch.float32)]


def test_settled_route_outputs_are_distinct_and_usable_with_autograd():
    g = torch.Generator().manual_seed(15)
    wq, wd = _weight("nvfp4", torch.randn(48, 128, generator=g))
    x = torch.randn(1, 128, generator=g)
    with torch.inference_mode():
        first = F.linear(x, wq)
        outs = [F.linear(x, wq) for _ in range(20)]  # through the settled route
    assert wq._route is not None
    _check(first, x, wd, None, 3e-2)
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert all(torch.equal(o, first) for o in outs)
    # an output made in inference mode is an inference tensor, as F.linear's (autograd refuses
    # to save it, as torch's); one made outside it is ordinary
    assert first.is_inference() and all(o.is_inference() for o in outs)
    p = torch.ones(1, requires_grad=True)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        outs[-1] * p
    outside = [F.linear(x, wq) for _ in range(3)]
    assert not any(o.is_inference() for o in outside)
    (outside[-1] * p).sum().backward()
    assert p.grad is not None


@pytest.mark.skipif(native.cpu_info().isa == "scalar", reason="AVX2 kernels")
def test_specialised_kernels_compile_only_their_own_library(monkeypatch) -> None:
    """The lane-block FP4, shift-decode FP8 and vdpbf16ps kernels take the shared argument spec
    (gemv_args) instead of building the float kernel of their format and prefetch to read it."""
    from torchport.gemv import kernels as gk
    from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel
    from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel

    def no_float_kernel(*a, **k):
        raise AssertionError("built the float kernel")

    monkeypatch.setattr(gk, "gemv_kernel", no_float_kernel)
    isa = native.cpu_info().isa
    kerns = [gemv_fp4_block_kernel("nvfp4", isa, 3008), gemv_fp8_shift_kernel(isa, 3008)]
    if native.cpu_info().has_avx512_bf16:
        from torchport.gemv.bf16_kernel import gemv_bf16_dp_kernel

        kerns.append(gemv_bf16_dp_kernel(isa, 3008))
    fmts = ("nvfp4", "fp8_e4m3", "bf16")
    assert all(k.args == tuple(gk.gemv_args(f)) for k, f in zip(kerns, fmts))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "nvfp4", "fp8_e4m3"])
def test_gemv_gradients_match_f_linear(fmt):
    """``gemv`` under autograd gives ``F.linear``'s gradients: the input's and bias's for every
    weight, a dense weight's own too (it has ``requires_grad``); a quantized weight is frozen.
    (Backward through the GEMV's ops raised "no autograd formula" before, and a dense weight with
    ``requires_grad`` meeting activations without it gave an output with no gradient.)"""
    g = torch.Generator().manual_seed(16)
    w0 = torch.randn(24, 64, generator=g) * 0.1
    wq, wd = _weight(fmt, w0)
    dense = fmt in ("f32", "bf16")
    dt = torch.bfloat16 if fmt == "bf16" else torch.float32
    x0 = torch.randn(2, 64, generator=g).to(dt)
    b0 = torch.randn(24, generator=g).to(dt)
    for x_grad in (True, False):
        x, b = x0.clone().requires_grad_(x_grad), b0.clone().requires_grad_(True)
        w = wq.clone().requires_grad_(True) if dense else wq
        out = gemv(x, w, b)
        assert out.requires_grad
        seed = torch.randn(out.shape, generator=g).to(out.dtype)
        (out * seed).sum().backward()
        xr, br = (
            x0.double().clone().requires_grad_(x_grad),
            b0.double().clone().requires_grad_(True),
        )
        wr = wd.double().clone().requires_grad_(dense)
        (F.linear(xr, wr, br) * seed.double()).sum().backward()
        tol = dict(rtol=2e-2, atol=2e-2) if fmt == "bf16" else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.grad.double(), br.grad, **tol)
        if x_grad:
            torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
        if dense:
            torch.testing.assert_close(w.grad.double(), wr.grad, **tol)


@pytest.mark.parametrize("fmt", ["f32", "nvfp4"])
def test_gemv_double_backward_and_saved_inputs_match_f_linear(fmt):
    """A gradient penalty (the input's gradient, made with ``create_graph``, differentiated
    again) through ``gemv`` gives ``F.linear``'s gradients.

    ``f32`` (the dense op; failed before): the weight and bias gradients; the backward used a
    detached weight and input, so the terms through them were missing (weight gradients off by
    up to 3946). An input written in place between forward and backward raises as with
    ``F.linear``; the backward read the new values (the weight gradient came out doubled).
    ``nvfp4`` (the packed op, frozen weight; passed before too, kept as a guard): the bias
    gradient, which needs the packed backward's input gradient to stay differentiable in the
    incoming gradient."""
    g = torch.Generator().manual_seed(17)
    wq, wd = _weight(fmt, torch.randn(6, 32, generator=g))
    dense = fmt == "f32"
    x0, b0 = torch.randn(2, 32, generator=g), torch.randn(6, generator=g)
    grads = []
    for f, w0 in ((gemv, wq), (F.linear, wd)):
        w = w0.clone().requires_grad_(True) if dense else w0
        x, b = x0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        with config.override(gemv_fp4_int8=False):  # float32 activations: rounding apart only
            out = f(x, w, b)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        grads.append(torch.autograd.grad(gx.pow(2).sum(), (w, b) if dense else (b,)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    if dense:
        w, x = wq.clone().requires_grad_(True), x0.clone()
        out = gemv(x, w)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
def test_torch_func_through_a_dense_weight_matches_f_linear(dt):
    """``torch.func`` transforms of ``gemv`` with respect to a dense weight give ``F.linear``'s
    results: ``grad`` and ``jacrev`` raised "must override the setup_context staticmethod" (the
    weight, requiring grad inside the transform, took the custom op's autograd) and ``jvp``
    gave a zero tangent (the packed copy of the weight is detached)."""
    g = torch.Generator().manual_seed(20)
    x, w, b, t = (torch.randn(*s, generator=g).to(dt) for s in ((2, 32), (6, 32), (6,), (6, 32)))

    def loss(lin):
        return lambda a, c, e: lin(a, c, e).float().pow(2).sum()

    got = torch.func.grad(loss(gemv), argnums=(0, 1, 2))(x, w, b)
    want = torch.func.grad(loss(F.linear), argnums=(0, 1, 2))(x, w, b)
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q)
    tan = torch.func.jvp(lambda c: gemv(x, c, b), (w,), (t,))[1]
    torch.testing.assert_close(tan, torch.func.jvp(lambda c: F.linear(x, c, b), (w,), (t,))[1])


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "mxfp4"])
def test_weight_packed_under_inference_mode_still_gives_gradients(fmt):
    """A quantized weight whose first use (the pack) ran under ``torch.inference_mode()`` holds
    inference tensors in its pack; ``gemv`` with such a weight and an input or bias that
    requires grad raised "Inference tensors cannot be saved for backward" (the backward saved
    the pack with ``save_for_backward``, also when only the bias needed a gradient). The
    gradients now match those of a weight packed in grad mode."""
    g = torch.Generator().manual_seed(19)
    w0 = torch.randn(16, 64, generator=g)
    x0, b0 = torch.randn(1, 64, generator=g), torch.randn(16, generator=g)
    grads = []
    for infer in (True, False):
        wq, _ = _weight(fmt, w0)
        if infer:
            with torch.inference_mode():
                gemv(x0, wq)  # the first use packs
            pw = wq.gemv_pack()
            assert any(t.is_inference() for t in (pw.data, pw.scales, pw.rowscale))
        for x_grad in (True, False):
            x, b = x0.clone().requires_grad_(x_grad), b0.clone().requires_grad_(True)
            gemv(x, wq, b).pow(2).sum().backward()
            grads += [b.grad] + ([x.grad] if x_grad else [])
    half = len(grads) // 2
    for got, want in zip(grads[:half], grads[half:]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("first", ["grad", "no_grad", "inference"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "mxfp4"])
def test_copy_into_a_quantized_weight_between_forward_and_backward_raises(fmt, first):
    """``w.copy_(new)`` into a quantized weight between ``gemv(x, w)`` and its backward raises
    as torch does for a saved tensor modified in place: the backward, which keeps the pack (the
    weight's own inner tensors), silently gave the gradient of the new codes with the old
    per-tensor scale (matching neither weight). Also for a pack first made under
    ``torch.inference_mode()`` (inference tensors: no version counter). A copy_ before the
    forward changes nothing."""
    g = torch.Generator().manual_seed(23)
    w0, w1 = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    wq, _ = _weight(fmt, w0)
    x0 = torch.randn(1, 64, generator=g)
    if first != "grad":
        with torch.inference_mode() if first == "inference" else torch.no_grad():
            gemv(x0, wq)  # the first use packs
    x = x0.clone().requires_grad_()
    out = gemv(x, wq)
    with torch.no_grad():
        wq.copy_(w1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    x = x0.clone().requires_grad_()
    gemv(x, wq).sum().backward()
    torch.testing.assert_close(x.grad, wq.dequantize().sum(0, keepdim=True))


@pytest.mark.parametrize("fmt", ["f32", "nvfp4", "nvfp4_x_nvfp4"])
def test_lazily_negated_bias_and_weight_are_read_negated(fmt):
    """A bias (or dense weight) with the lazy negation bit (``torch._neg_view``, what
    ``z.conj().imag`` makes) holds its un-negated values in memory: the kernels added ``-b``
    where ``F.linear`` adds ``b`` (and multiplied by ``-W``). They now see the negated values:
    the same results as with the negation materialised (``resolve_neg``)."""
    g = torch.Generator().manual_seed(18)
    w0 = torch.randn(6, 64, generator=g)
    if fmt == "nvfp4_x_nvfp4":  # FP4 activations too: the pair-split kernel's entry
        wq = NVFP4Tensor.from_float(w0, act_per_tensor_scale=True)
    else:
        wq, _ = _weight(fmt, w0)
    x, b = torch.randn(1, 64, generator=g), torch.randn(6, generator=g)
    bn = torch._neg_view(b)
    assert bn.is_neg() and bn.is_contiguous()
    calls = [lambda bias: gemv(x, wq, bias)]
    if fmt == "f32":
        wn = torch._neg_view(-wq)  # holds -W, reads as W
        calls.append(lambda bias: gemv(x, wn, bias))
    else:  # the quantized linear's entry; its second call settles a route, the third takes it
        calls += [lambda bias: F.linear(x, wq, bias)] * 3
    with torch.no_grad():
        for call in calls:
            torch.testing.assert_close(call(bn), call(bn.resolve_neg()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias_shape", [(2, 64), (), (1, 64)], ids=str)
def test_compile_routes_only_a_bias_of_shape_n(monkeypatch, bias_shape):
    # F.linear broadcasts any bias shape against [rows, N]; the GEMV reads N bias values, so a
    # routed per-row bias [2, N] added row 0's bias to every row and a scalar one was read past
    # its single element (NaN or garbage). Only a [N] bias is routed now.
    import torchport
    from torchport.compiler import last_report
    from torchport.gemv import routing

    monkeypatch.setattr(routing, "native_wins", lambda *a: True)  # as if the tuner chose it
    torch._dynamo.reset()
    w, b = torch.randn(64, 32), torch.randn(bias_shape)

    def f(x, w, b):
        return F.linear(x, w, b)

    xs = [torch.randn(2, 32)] + ([torch.randn(32)] if b.dim() < 2 or b.shape[0] == 1 else [])
    for x in xs:
        with torch.no_grad():
            out = torchport.compile(f, inner="eager")(x, w, b)
        ref = F.linear(x, w, b)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
        assert RULE not in last_report().rule_counts  # type: ignore[union-attr]
    torch._dynamo.reset()
    with torch.no_grad():  # a bias of shape [N] is still routed
        torchport.compile(f, inner="eager")(torch.randn(2, 32), w, torch.randn(64))
    assert last_report().rule_counts.get(RULE) == 1  # type: ignore[union-attr]
    with pytest.raises(GemvInputError, match=r"bias must have shape \(64,\)"):
        torch.ops.torchport.gemv_dense(torch.randn(2, 32), w, b)  # the op checks it too


def test_huge_page_advice_is_given_only_where_the_probe_got_huge_pages(monkeypatch):
    """On a VM that granted no huge pages, every advised fault stalled in a failed compaction
    (a 180 MB pack: 271-292 ms advised, 78-95 ms plain): hugepage_empty advises only where
    the one probe saw AnonHugePages grow, and still aligns to 2 MiB either way."""
    from torchport.gemv import hugepages as H

    kb = iter([100, 100, 100, 2148])  # the probe's before/after, twice
    monkeypatch.setattr(H, "_anon_huge_kb", lambda: next(kb))
    advised: list[int] = []

    def madvise(addr: int, n: int, how: int) -> int:
        advised.append(n)
        return 0

    monkeypatch.setattr(H, "_madvise", lambda: madvise)
    monkeypatch.setattr(H, "_thp_mode", lambda: "madvise")
    for granted in (False, True):
        H.huge_pages_granted.cache_clear()
        advised.clear()
        t = H.hugepage_empty((3, 1 << 20), torch.float32)
        assert t.shape == (3, 1 << 20) and t.data_ptr() % H.HUGE == 0 and t.is_contiguous()
        # the probe advises its own 4 MiB; the buffer's 12 MiB only when granted
        assert advised[0] == 2 * H.HUGE and len(advised) == (2 if granted else 1), advised
        assert not granted or advised[1] >= 12 << 20
    monkeypatch.setattr(H, "_anon_huge_kb", lambda: None)  # unreadable: advise, as before
    H.huge_pages_granted.cache_clear()
    assert H.huge_pages_granted()
    monkeypatch.setattr(H, "_thp_mode", lambda: "never")
    H.huge_pages_granted.cache_clear()
    assert not H.huge_pages_granted()
    H.huge_pages_granted.cache_clear()  # (the real probe for the rest of the session)


def test_tuner_streams_weight_copies_past_the_cache(monkeypatch):
    """The GEMV tuner's rotation (ops._memory_sets): the made arguments first, then copies of the
    weight (equal, separate storage) until cold_bytes() or cold_cache_bytes is passed, at most
    TUNE_MAX_COPIES, placed as the weights live: a quantized pack's data on 2 MiB pages from
    lowp's HUGEPAGE_MIN_BYTES (scales from a quarter of it) with gemv_hugepages on, plain clones
    otherwise and for dense weights; cold_cache_bytes = 0 switches cold timing off."""
    from torchport import autotune
    from torchport.gemv import ops
    from torchport.gemv.hugepages import HUGE
    from torchport.lowp import tensors

    pw = NVFP4Tensor.from_float(torch.randn(64, 256)).gemv_pack()
    args = (torch.randn(2, 256), pw.data, pw.scales, pw.rowscale)
    per = pw.data.nbytes + pw.scales.nbytes
    monkeypatch.setattr(autotune, "cold_bytes", lambda: 3 * per + 1)
    monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", 4 * pw.scales.nbytes)  # both: huge
    with config.override(cold_cache_bytes=1):
        sets = ops._memory_sets(args)
        assert len(sets) == 4 and sets[0] is args
        for x, d, sc, rs in sets[1:]:
            assert d.data_ptr() % HUGE == 0 and sc.data_ptr() % HUGE == 0
            assert (
                torch.equal(d, pw.data) and torch.equal(sc, pw.scales) and torch.equal(x, args[0])
            )
            assert d.data_ptr() != pw.data.data_ptr() and x.data_ptr() != args[0].data_ptr()
            assert rs is pw.rowscale
        monkeypatch.setattr(ops, "TUNE_MAX_COPIES", 2)
        assert len(ops._memory_sets(args)) == 2
        monkeypatch.setattr(ops, "TUNE_MAX_COPIES", 64)

        def huge(sets):  # (data, scales) on a 2 MiB boundary, per copy (heap chunks are not)
            return {
                (d.data_ptr() % HUGE == 0, sc.data_ptr() % HUGE == 0) for _, d, sc, _ in sets[1:]
            }

        # scales (an eighth of the data) below a quarter of the size a pack moves at stay put
        monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", pw.data.nbytes)
        assert huge(ops._memory_sets(args)) == {(True, False)}
        monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", 2 * pw.data.nbytes)
        assert huge(ops._memory_sets(args)) == {(False, False)}
        monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", 4 * pw.scales.nbytes)
        with config.override(gemv_hugepages=False):
            assert huge(ops._memory_sets(args)) == {(False, False)}
        # a dense weight: plain clones, empty scales copied as they are
        wd = torch.randn(64, 256)
        dargs = (args[0], wd, torch.empty(0, dtype=torch.uint8), torch.empty(0))
        dsets = ops._memory_sets(dargs, dense=True)
        assert len(dsets) == math.ceil((3 * per + 1) / wd.nbytes)
        assert all(torch.equal(d, wd) and sc.numel() == 0 for _, d, sc, _ in dsets[1:])
    with config.override(cold_cache_bytes=100 * per):  # the larger of the two budgets
        assert len(ops._memory_sets(args)) == 64
        monkeypatch.setattr(autotune, "cold_bytes", lambda: per // 2)
        with config.override(cold_cache_bytes=per // 2):  # the weight alone passes it: no copy
            assert ops._memory_sets(args) == [args]
    with config.override(cold_cache_bytes=0):
        assert ops._memory_sets(args) == [args]


def test_compiled_gemv_of_a_quantized_weight_runs_the_packed_kernel() -> None:
    """Under Dynamo ``callable(w.gemv_pack)`` read False: a compiled ``gemv(x, q, b)`` took the
    dense path, dequantizing the whole weight with torch ops on every call (and its float
    kernel differed from eager's int8 one by ~0.08). It records ``q.gemv`` now, which runs the
    packed-weight op, and gives eager's bits."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch.manual_seed(1)
    q, b, x = NVFP4Tensor.from_float(torch.randn(5, 64)), torch.randn(5), torch.randn(2, 64)
    rec = AotEagerAndRecordGraphs()
    f = torch.compile(lambda x, w, b: gemv(x, w, b), fullgraph=True, backend=rec)
    assert torch.equal(f(x, q, b), gemv(x, q, b))
    code = "\n".join(g.code for g in rec.fw_graphs)
    assert "torchport.gemv_packed" in code and "gemv_dense" not in code, code


def test_a_dense_weight_off_the_cpu_is_refused() -> None:
    """The kernel read a meta weight's null data pointer (the process crashed)."""
    for bias in (None, torch.zeros(5)):
        with pytest.raises(GemvInputError, match="a dense weight must be on cpu, got meta"):
            gemv(torch.randn(1, 64), torch.randn(5, 64, device="meta"), bias)
