"""scaled_mm / block_scaled_mm for M > MAX_ROWS on the GEMM engine (epilogue scaling, bias, cast)."""

from __future__ import annotations

import sys

import pytest
import torch

import torchport
from torchport import autotune, gemm
from torchport.gemm.pack import pack_cache
from torchport.lowp import (
    Float8Tensor,
    LowPrecisionError,
    MXTensor,
    NVFP4Tensor,
    block_scaled_mm,
    scaled_mm,
    scaled_mm_reference,
)
from torchport.lowp.formats import FP8_DTYPES
from torchport.lowp.panel import (
    decode_rows_bf16,
    decode_rows_bf16_reference,
    pack_rows,
    pack_rows_reference,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
K, N = 100, 37  # K not a multiple of any tile or K block, N prime
OUT = [torch.float32, torch.bfloat16, torch.float16, torch.float64, E4, E5]


@pytest.fixture(autouse=True)
def _untimed():
    """No timing: the engine takes its first native config (tests/test_lowp_gemm.py runs the
    tuned choice), so the grid exercises the native kernels and panel packing."""
    with torchport.config.override(autotune=False):
        yield


def _fp8(shape, seed, dtype=E4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul(4).to(dtype)


def _scales(m, n, rowwise, seed):
    g = torch.Generator().manual_seed(seed)
    if rowwise:
        return torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    return torch.tensor(0.7), torch.tensor([1.3])


def _engine_labels(spec: str) -> list[str]:
    return [label for (op, label) in gemm.decisions if op == "gemm" and f"[{spec}]" in label]


@pytest.mark.parametrize("m", [9, 17, 128, 130])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_scaled_mm_engine_matches_reference(m, rowwise, with_bias):
    a, b = _fp8((m, K), m), _fp8((N, K), m + 1, E5).t()
    sa, sb = _scales(m, N, rowwise, m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)) if with_bias else None
    ref64 = scaled_mm_reference(a, b, sa, sb, bias=bias, out_dtype=torch.float64)
    mag = (a.double().abs() @ b.double().abs()) * sa.double().reshape(-1, 1)
    mag = mag * sb.double().reshape(1, -1)
    for od in OUT:
        out = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=od)
        assert out.dtype == od and out.shape == (m, N)
        if od in (torch.float32, torch.float64):
            # float32 accumulation and scaling: a few float32 ulps of the magnitude sum
            assert bool(((out.double() - ref64).abs() <= 1e-6 * mag + 1e-5).all()), od
        else:  # rounded once more: within one ulp of the reference rounded to od
            ref = scaled_mm_reference(a, b, sa, sb, bias=bias, out_dtype=od).double()
            ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, E4: 2.0**-3, E5: 2.0**-2}[od]
            assert torch.allclose(out.double(), ref, rtol=ulp, atol=1e-2), od
    spec = "scale_row:f32;scale_col:f32" + (";bias_col:f32" if with_bias else "")
    assert _engine_labels(spec), "the GEMM engine did not serve the M > 8 call"
    assert _engine_labels(spec + ";out=bf16"), "bfloat16 output is not the engine's Cast step"


def test_scaled_mm_engine_saturates_fp8_and_bias_dtypes():
    m = 16
    a, b = _fp8((m, K), 1), _fp8((N, K), 2).t()
    big = torch.tensor(1e4)  # products far beyond e4m3's 448: the FP8 cast saturates
    out = scaled_mm(a, b, big, torch.tensor(1.0), out_dtype=E4)
    ref = scaled_mm_reference(a, b, big, torch.tensor(1.0), out_dtype=E4)
    assert torch.equal(out.float().abs().max(), torch.tensor(448.0))
    assert torch.allclose(out.double(), ref.double(), rtol=2.0**-3, atol=1e-2)
    assert not torch.isnan(out.float()).any()
    for bdt in (torch.bfloat16, torch.float16, torch.float64):
        bias = torch.randn(N).to(bdt)
        one = torch.tensor(1.0)
        got = scaled_mm(a, b, one, one, bias=bias, out_dtype=torch.float32)
        want = scaled_mm_reference(a, b, one, one, bias=bias, out_dtype=torch.float64)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-3), bdt


def test_scaled_mm_engine_keeps_no_decoded_panels():
    a, b = _fp8((64, K), 5), _fp8((N, K), 6).t()
    one = torch.tensor(1.0)
    scaled_mm(a, b, one, one, out_dtype=torch.float32)  # settle
    before = (len(pack_cache), pack_cache.nbytes)
    for _ in range(3):
        scaled_mm(a, b, one, one, out_dtype=torch.float32)
    assert (len(pack_cache), pack_cache.nbytes) == before


_MAKERS = {
    "nvfp4": NVFP4Tensor.from_float,
    "mxfp4": lambda w: MXTensor.from_float(w, "fp4_e2m1"),
    "mxfp8": lambda w: MXTensor.from_float(w, "fp8_e4m3"),
    "fp8": Float8Tensor.from_float,
}


@pytest.mark.parametrize("fmt", list(_MAKERS))
@pytest.mark.parametrize("m", [9, 17, 128, 130])
def test_block_scaled_mm_engine_matches_float64(fmt, m, monkeypatch):
    g = torch.Generator().manual_seed(m)
    k = 96  # block formats need K % 32 == 0; 96 is not a multiple of the 256/384 K blocks
    w = _MAKERS[fmt](torch.randn(N, k, generator=g))
    x = torch.randn(2, m // 2 + 1, k, generator=g)[:, : m // 2 + (m % 2)]
    bias = torch.randn(N, generator=g)
    wd = w.dequantize().double()
    # several panels: 16 rows each, N = 37 leaves a 5-row tail panel
    monkeypatch.setattr(sys.modules["torchport.lowp.scaled_mm"], "PANEL_BYTES", 16 * 4 * k)
    for od, b in ((torch.float32, bias), (torch.float32, None), (torch.bfloat16, bias)):
        out = block_scaled_mm(x, w, bias=b, out_dtype=od)
        ref = x.double() @ wd.T + (0 if b is None else b.double())
        assert out.dtype == od and out.shape == (*x.shape[:-1], N)
        tol = 1e-5 if od == torch.float32 else 2.0**-7
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol), (od, b is None)
    assert _engine_labels("bias_col:f32") and _engine_labels("bias_col:f32;out=bf16")
    bx = x.bfloat16()  # bfloat16 activations: result in bfloat16 through the engine's Cast
    got = block_scaled_mm(bx, w)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), bx.double() @ wd.T, rtol=2.0**-7, atol=2.0**-7)


def test_block_scaled_mm_autograd_takes_torch_ops():
    g = torch.Generator().manual_seed(0)
    w = NVFP4Tensor.from_float(torch.randn(N, 64, generator=g))
    x = torch.randn(20, 64, generator=g, requires_grad=True)
    bias = torch.randn(N, generator=g, requires_grad=True)
    y = block_scaled_mm(x, w, bias=bias)
    y.square().sum().backward()
    xr = x.detach().double().requires_grad_()
    br = bias.detach().double().requires_grad_()
    (xr @ w.dequantize().double().T + br).square().sum().backward()
    assert torch.allclose(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(bias.grad.double(), br.grad, rtol=1e-4, atol=1e-4)
    before = len(pack_cache)
    with torch.no_grad():
        block_scaled_mm(x, w, bias=bias)
    assert len(pack_cache) == before


def test_fp8_dtypes_cover_outputs():
    assert set(FP8_DTYPES) >= {E4, E5}


@pytest.mark.parametrize("n,k,nr", [(37, 100, 24), (48, 64, 16), (5, 3, 8), (1, 1, 32), (0, 4, 8)])
def test_pack_rows_matches_reference(n, k, nr):
    w = torch.randn(n, k)
    got = pack_rows(w, nr)
    assert torch.equal(got, pack_rows_reference(w, nr))
    assert torch.equal(got, gemm.pack_b(w.t(), nr))


def test_pack_rows_errors():
    with pytest.raises(
        LowPrecisionError, match=r"w must be a 2-D float32 tensor, got torch.float64"
    ):
        pack_rows(torch.zeros(2, 2, dtype=torch.float64), 8)
    with pytest.raises(LowPrecisionError, match=r"nr must be a positive int, got 0"):
        pack_rows(torch.zeros(2, 2), 0)


@pytest.mark.parametrize("backends", ["NATIVE", "ATEN"])
def test_engine_paths_native_and_aten_choices(backends, monkeypatch, fresh_cache):
    mod = sys.modules["torchport.lowp.scaled_mm"]
    packed: list[int] = []
    real = mod.pack_rows

    def spy(w, nr):
        packed.append(nr)
        return real(w, nr)

    monkeypatch.setattr(mod, "pack_rows", spy)
    monkeypatch.setattr(mod, "PANEL_BYTES", 16 * 4 * 64)
    g = torch.Generator().manual_seed(1)
    w = NVFP4Tensor.from_float(torch.randn(N, 64, generator=g))
    x = torch.randn(33, 64, generator=g)
    a, b = _fp8((33, K), 7), _fp8((N, K), 8).t()
    sa, sb = _scales(33, N, True, 2)
    with torchport.config.override(max_autotune_gemm_backends=backends):
        out = block_scaled_mm(x, w, bias=torch.ones(N))
        got = scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    ref = x.double() @ w.dequantize().double().T + 1.0
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    want = scaled_mm_reference(a, b, sa, sb, out_dtype=torch.float64)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    # 3 panels (16 + 16 + 5 rows) of the weight and of b: packed natively unless ATen serves
    assert (len(packed) >= 6) if backends == "NATIVE" else not packed


# --- the bf16 prefill panels -------------------------------------------------------------------

_DECODES = [  # (elem, scale format, block, bytes per row for K = 96)
    ("fp4_e2m1", "e4m3", 16, 48),
    ("fp4_e2m1", "e8m0", 32, 48),
    ("fp8_e4m3", "e8m0", 32, 96),
    ("fp8_e5m2", "e8m0", 32, 96),
    ("fp8_e4m3", None, 0, 96),
    ("fp8_e5m2", None, 0, 96),
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]
    )


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("elem,sfmt,block,nbytes", _DECODES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_decode_rows_bf16_matches_reference(isa, elem, sfmt, block, nbytes, rows):
    """Every byte pattern of elements and scales (NaN and subnormal scales included)."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
    sc = (
        None
        if sfmt is None
        else torch.randint(0, 256, (rows, 96 // block), dtype=torch.uint8, generator=g)
    )
    with torchport.config.override(**({} if isa == "native" else {"isa": isa})):
        got = decode_rows_bf16(q, sc, elem, sfmt, block)
        into = decode_rows_bf16(
            q, sc, elem, sfmt, block, out=torch.empty(rows, 96, dtype=torch.bfloat16)
        )
    ref = decode_rows_bf16_reference(q, sc, elem, sfmt, block)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert _same_bits(got, ref) and _same_bits(into, ref)


def test_decode_rows_bf16_errors():
    q = torch.zeros(2, 48, dtype=torch.uint8)
    with pytest.raises(LowPrecisionError, match="elem must be one of"):
        decode_rows_bf16(q, None, "fp6")
    with pytest.raises(LowPrecisionError, match="scales must be"):
        decode_rows_bf16(q, torch.zeros(2, 5, dtype=torch.uint8), "fp4_e2m1", "e4m3", 16)
    with pytest.raises(LowPrecisionError, match="out must be"):
        decode_rows_bf16(q, None, "fp8_e4m3", out=torch.empty(2, 48))


_BF16_MAKERS = {
    "nvfp4": NVFP4Tensor.from_float,
    "nvfp4_nopts": lambda w: NVFP4Tensor.from_float(w, per_tensor_scale=False),
    "mxfp4": lambda w: MXTensor.from_float(w, "fp4_e2m1"),
    "mxfp8": lambda w: MXTensor.from_float(w, "fp8_e4m3"),
    "mxfp8_e5m2": lambda w: MXTensor.from_float(w, "fp8_e5m2"),
    "fp8_row": Float8Tensor.from_float,
    "fp8_tensor": lambda w: Float8Tensor.from_float(w, granularity="tensor"),
}


@pytest.mark.parametrize("fmt", list(_BF16_MAKERS))
@pytest.mark.parametrize("m", [9, 130])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_bf16_panels_match_float64(fmt, m, with_bias, monkeypatch):
    """The bf16_panels candidate: N = 37 in 16-row panels (a 5-row tail), K = 96 (not a multiple
    of the tiles' K blocks), against the float64 product of the same bf16 activations."""
    mod = sys.modules["torchport.lowp.scaled_mm"]
    g = torch.Generator().manual_seed(m)
    k = 96
    w = _BF16_MAKERS[fmt](torch.randn(N, k, generator=g) * 3)
    x16 = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(N, generator=g) if with_bias else None
    monkeypatch.setattr(mod, "BF16_PANEL_BYTES", 16 * 2 * k)
    dec = mod._bf16_decoder(w)
    assert dec is not None
    prob = mod._Prefill(
        x16.float(), None, N, k, lambda lo, hi: [], bias, torch.bfloat16, mod._Bf16(x16, dec)
    )
    out = mod._bf16_panels(prob)
    ref = x16.double() @ w.dequantize().double().T + (0 if bias is None else bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == (m, N)
    # fp32 accumulation, then one bf16 rounding (two on the ATen path: its bf16 mm, then scale)
    assert torch.allclose(
        out.double(), ref, rtol=2.0**-7, atol=2.0**-7 * float(ref.abs().max()) * 0.05
    )


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_bf16_panels_scaled_mm_match_reference(rowwise, monkeypatch):
    mod = sys.modules["torchport.lowp.scaled_mm"]
    a, b = _fp8((130, K), 3), _fp8((N, K), 4, E5).t()
    sa, sb = _scales(130, N, rowwise, 5)
    bias = torch.randn(N)
    picked: list[str] = []
    real = mod._bf16_panels

    def spy(p):
        picked.append("bf16")
        return real(p)

    monkeypatch.setattr(mod, "_bf16_panels", spy)
    # the bf16 form exists only with AVX512-BF16; elsewhere the forced pick is the fp32 panels
    monkeypatch.setattr(
        mod,
        "_prefill_choice",
        lambda p, tag: autotune.Candidate(
            "bf16_panels" if p.bf16 is not None else "engine_panels", autotune.NATIVE
        ),
    )
    monkeypatch.setattr(mod, "BF16_PANEL_BYTES", 16 * 2 * K)
    got = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    want = scaled_mm_reference(a, b, sa, sb, bias=bias, out_dtype=torch.float64)
    if torchport.native.cpu_info().has_avx512_bf16:
        assert picked
    assert got.dtype == torch.bfloat16
    assert torch.allclose(
        got.double(), want, rtol=2.0**-7, atol=2.0**-7 * float(want.abs().max()) * 0.05
    )


def test_bf16_panels_offered_only_where_exact(monkeypatch):
    """bf16 activations and a bf16 result only: a float32 x is never rounded to bf16 and a
    float32 result never comes from a bf16 GEMM; MX scales too small for bf16's normal range
    (a product would lose bits) keep the float32 panels; no AVX512-BF16, no candidate."""
    mod = sys.modules["torchport.lowp.scaled_mm"]
    seen: list[list[str]] = []
    real = mod.autotune.select

    def spy(op, key, cands, *args, **kw):
        if op == "lowp_prefill":
            seen.append([c.name for c in cands])
        return real(op, key, cands, *args, **kw)

    monkeypatch.setattr(mod.autotune, "select", spy)
    g = torch.Generator().manual_seed(0)
    w = NVFP4Tensor.from_float(torch.randn(N, 64, generator=g))
    x = torch.randn(20, 64, generator=g)
    has = torchport.native.cpu_info().has_avx512_bf16
    cases = [
        (x.bfloat16(), None, has),
        (x.bfloat16(), torch.float32, False),
        (x, torch.bfloat16, False),
        (x, None, False),
    ]
    for xi, od, offered in cases:
        seen.clear()
        out = block_scaled_mm(xi, w, out_dtype=od)
        assert seen and ("bf16_panels" in seen[0]) == offered, (xi.dtype, od)
        ref = xi.double() @ w.dequantize().double().T
        tol = 1e-5 if out.dtype == torch.float32 else 2.0**-7
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)
    with torchport.config.override(isa="avx2"):
        seen.clear()
        block_scaled_mm(x.bfloat16(), w)
        assert seen and "bf16_panels" not in seen[0]
    tiny = MXTensor.from_float(torch.randn(N, 64, generator=g) * 2.0**-126, "fp4_e2m1")
    assert mod._bf16_decoder(tiny) is None
    assert mod._bf16_decoder(MXTensor.from_float(torch.randn(N, 64, generator=g))) is not None


@pytest.mark.parametrize("m", [4, 16])  # the decode path and the engine
@pytest.mark.parametrize("od", [torch.float32, torch.bfloat16, E4, E5], ids=str)
def test_scaled_mm_scale_result_bias_shape_and_fast_accum_as_torch(m, od):
    """torch._scaled_mm's keywords: ``scale_result`` divides the result (bias included) before an
    FP8 output's cast and is ignored for other outputs; ``use_fast_accum`` changes nothing on
    the CPU; a ``[1, N]`` bias is accepted. (They raised TypeError / a bias-shape error.)"""
    a, b = _fp8((m, K), m + 5), _fp8((N, K), m + 6).t()
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    bias = torch.randn(1, N, generator=torch.Generator().manual_seed(m)).to(
        torch.bfloat16 if od == torch.bfloat16 else torch.float32
    )
    for sr in (None, torch.tensor(4.0), torch.tensor([0.5])):
        kw = dict(bias=bias, out_dtype=od, scale_result=sr)
        got = scaled_mm(a, b, sa, sb, use_fast_accum=True, **kw)
        ref = scaled_mm_reference(a, b, sa, sb, **kw).double()
        want = torch._scaled_mm(a, b, sa, sb, use_fast_accum=True, **kw).double()
        ulp = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, E4: 2.0**-3, E5: 2.0**-2}[od]
        assert torch.allclose(got.double(), want, rtol=ulp, atol=1e-2), sr
        assert torch.allclose(got.double(), ref, rtol=ulp, atol=1e-2), sr
    for bad in (torch.tensor(2.0, dtype=torch.float64), torch.tensor([1.0, 2.0]), 2.0):
        with pytest.raises(LowPrecisionError, match="scale_result must be a one-element float32"):
            scaled_mm(a, b, sa, sb, out_dtype=od, scale_result=bad)
