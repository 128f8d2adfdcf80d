"""Edges of the low-precision API a user reaches: packed NVFP4 data whose K is off the block,
block scales given in the wrong orientation, a last dimension of 0, float16/float64 activations
on dynamic-activation layers, ``output_dtype=None``, swizzles where no block scale is, lazy
linears, ``linear_quantize``'s per-tensor scale and autograd inputs, non-tensor arguments, and an
infinite NVFP4 global scale on either operand: each a typed error naming the requirement and the
value, or the result torch (or the float64 reference) gives."""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport.gemv import GemvInputError, gemv
from torchport.lowp import (
    LowPrecisionError,
    MXDynamicActivationMXWeightConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4Tensor,
    NVFP4WeightOnlyConfig,
    fp8_quantize,
    linear_quantize,
    linear_quantize_reference,
    mx_dequantize,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from torchport.lowp.fp8 import fp8_quantize_reference
from torchport.lowp.mx import mx_quantize_reference
from torchport.lowp.nvfp4 import nvfp4_dequantize_reference, nvfp4_quantize_reference
from torchport.lowp.scaled_recipes import scaled_mm_reference
from torchport.nn import functional as TPF

FP4 = torch.float4_e2m1fn_x2
S, Z = TPF.ScalingType, TPF.SwizzleType


@pytest.mark.parametrize("k", [8, 24, 40])
def test_nvfp4_packed_k_off_the_block_is_refused(k: int) -> None:
    q = torch.full((2, k // 2), 0x22, dtype=torch.uint8)
    s = torch.ones(2, k // 16).to(torch.float8_e4m3fn)
    for make in (
        lambda: nvfp4_dequantize(q, s),
        lambda: nvfp4_dequantize_reference(q, s),
        lambda: NVFP4Tensor(q, s, None, torch.float32),
    ):
        with pytest.raises(LowPrecisionError, match=f"multiple of the block size 16.*got {k}"):
            make()


def test_nvfp4_checkpoint_with_k_off_the_block_is_refused_on_load() -> None:
    """``__setstate__`` (what ``torch.load`` runs) with inner tensors for K = 24."""
    w = NVFP4Tensor.from_float(torch.randn(2, 32))
    q = torch.full((2, 12), 0x22, dtype=torch.uint8)
    state = {**w.__getstate__(), "qdata": q, "scale": w.scale[:, :1].clone()}
    with pytest.raises(LowPrecisionError, match=r"multiple of the block size 16.*got 24"):
        w.__setstate__(state)


def _nvfp4_operands() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    xq, xs = nvfp4_quantize(torch.randn(4, 64), None)
    wq, ws = nvfp4_quantize(torch.randn(48, 64), None)  # ws: [N=48, K/16=4]
    return xq.view(FP4), wq.view(FP4).t(), xs, ws


def test_block_scales_in_another_orientation_are_refused() -> None:
    a, b, xs, ws = _nvfp4_operands()
    args = (a, b, xs, S.BlockWise1x16)
    want = TPF.scaled_mm(*args, ws, S.BlockWise1x16, output_dtype=torch.float32)
    for other in (ws.t(), ws.t().contiguous(), ws.reshape(8, 24)):
        with pytest.raises(LowPrecisionError, match=r"must be \[48, 4\].*got \(\d+, \d+\)"):
            TPF.scaled_mm(*args, other, S.BlockWise1x16, output_dtype=torch.float32)
    padded = torch.zeros(128, 4, dtype=ws.dtype)
    padded[:48] = ws
    for same in (ws.reshape(-1), padded, padded.reshape(-1)):
        got = TPF.scaled_mm(*args, same, S.BlockWise1x16, output_dtype=torch.float32)
        assert torch.equal(got, want)


def test_a_last_dimension_of_zero() -> None:
    x = torch.empty(3, 0)
    for f in (nvfp4_quantize, nvfp4_quantize_reference, mx_quantize, mx_quantize_reference):
        q, s = f(x)
        assert q.shape == (3, 0) and s.shape == (3, 0)
    for f in (fp8_quantize, fp8_quantize_reference):
        q, s = f(x)
        assert q.shape == (3, 0) and s.shape == (3, 1)
    q, s = nvfp4_quantize(torch.empty(2, 5, 0))
    assert nvfp4_dequantize(q, s).shape == (2, 5, 0)
    q, s = mx_quantize(torch.empty(2, 0), "fp8_e4m3")
    assert mx_dequantize(q, s, "fp8_e4m3").shape == (2, 0)
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        q, s = linear_quantize(torch.randn(3, 32), torch.empty(0, 32), fmt=fmt)
        q2, s2 = linear_quantize_reference(torch.randn(3, 32), torch.empty(0, 32), fmt=fmt)
        assert q.shape == q2.shape and s.shape == s2.shape and q.shape[0] == 3


@pytest.mark.parametrize(
    "config", [NVFP4DynamicActivationNVFP4WeightConfig(), MXDynamicActivationMXWeightConfig()]
)
def test_dynamic_activation_layers_take_float16_and_float64(config) -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32)
    torchport.quantize_(lin, config)
    x = torch.randn(12, 64).half()
    with torch.no_grad():
        want = lin(x.float())
        for dt in (torch.float16, torch.float64):
            out = lin(x.to(dt))
            assert out.dtype == dt
            assert torch.equal(out, want.to(dt))  # quantized from the same float32 values
        lin.half()
        assert lin(x).dtype == torch.float16


def test_output_dtype_none_is_mat_as_dtype_and_swizzles_need_block_scales() -> None:
    torch.manual_seed(2)
    a = torch.randn(4, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    got = TPF.scaled_mm(a, b, one, S.TensorWise, one, S.TensorWise, output_dtype=None)
    assert got.dtype == torch.float8_e4m3fn
    xa, bb, xs, ws = _nvfp4_operands()
    with pytest.raises(
        LowPrecisionError, match=r"None means mat_a's dtype, torch\.float4_e2m1fn_x2"
    ):
        TPF.scaled_mm(xa, bb, xs, S.BlockWise1x16, ws, S.BlockWise1x16, output_dtype=None)
    with pytest.raises(LowPrecisionError, match=r"swizzle applies to .* got SWIZZLE_32_4_4 for "):
        TPF.scaled_mm(a, b, one, S.TensorWise, one, S.TensorWise, Z.SWIZZLE_32_4_4)


def test_quantize_skips_a_lazy_linear() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LazyLinear(32))
    report = torchport.quantize_(m, NVFP4WeightOnlyConfig())
    assert report.quantized == ["0"]
    assert "uninitialized (lazy)" in report.skipped["1"]


def test_linear_quantize_per_tensor_scale_and_autograd_inputs() -> None:
    torch.manual_seed(3)
    x, w = torch.randn(4, 32), torch.randn(32, 32)
    for fmt in ("mxfp4", "mxfp8", "fp8"):
        with pytest.raises(LowPrecisionError, match=f"nvfp4' only, got 2.0 with fmt '{fmt}'"):
            linear_quantize(x, w, fmt=fmt, per_tensor_scale=2.0)
    for bad in (float("nan"), -5.0, 0.0):
        with pytest.raises(LowPrecisionError, match="positive finite"):
            linear_quantize(x, w, per_tensor_scale=bad)
    want = linear_quantize(x, w, per_tensor_scale=2.0)
    got = linear_quantize(
        x.clone().requires_grad_(), w.clone().requires_grad_(), per_tensor_scale=2.0
    )
    assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))
    with pytest.raises(LowPrecisionError, match="bias must be a tensor, got list"):
        linear_quantize(x, w, [0.0] * 32)


def test_arguments_that_are_no_tensors_or_not_on_cpu() -> None:
    e4 = torch.float8_e4m3fn
    a, b = torch.randn(4, 64).to(e4), torch.randn(48, 64).to(e4).t()
    one = torch.tensor(1.0)
    with pytest.raises(LowPrecisionError, match="bias must be a tensor or None, got list"):
        torchport.scaled_mm(a, b, one, one, bias=[0.0] * 48)
    with pytest.raises(LowPrecisionError, match="scale_a must be on cpu, got meta"):
        torchport.scaled_mm(a, b, torch.tensor(1.0, device="meta"), one)
    with pytest.raises(LowPrecisionError, match="bias must be on cpu, got meta"):
        torchport.scaled_mm(a, b, one, one, bias=torch.zeros(48, device="meta"))
    for bad in (torch.float8_e4m3fn, torch.complex64):  # (torch refuses both too)
        with pytest.raises(LowPrecisionError, match="bias must be a real, non-float8 tensor"):
            torchport.scaled_mm(a, b, one, one, bias=torch.zeros(48).to(bad))
    with pytest.raises(GemvInputError, match="bias must be a tensor or None, got list"):
        gemv(torch.randn(1, 64), torch.randn(48, 64), [0.0] * 48)


@pytest.mark.parametrize("m", [4, 16])  # the decode GEMV (M <= 8) and the engine panels
def test_operands_off_the_cpu_are_refused(m: int) -> None:
    """An FP8 operand on another device had its data pointer read as host memory (a meta ``b``
    crashed the process); a bias on another device was dropped without a word (``y += meta``
    leaves ``y`` as it was); ``linear_quantize`` with a meta weight quantized whatever its
    output buffer held."""
    e4, one = torch.float8_e4m3fn, torch.tensor(1.0)
    a, b = torch.randn(m, 64).to(e4), torch.randn(48, 64).to(e4).t()
    with pytest.raises(LowPrecisionError, match="scaled_mm: a must be on cpu, got meta"):
        torchport.scaled_mm(a.to("meta"), b, one, one)
    with pytest.raises(LowPrecisionError, match="scaled_mm: b must be on cpu, got meta"):
        torchport.scaled_mm(a, b.to("meta"), one, one)
    lin = torch.nn.Linear(64, 32)
    torchport.quantize_(lin, NVFP4WeightOnlyConfig())
    x, meta_bias = torch.randn(m, 64), torch.ones(32, device="meta")
    err = (GemvInputError, "gemv") if m <= 8 else (LowPrecisionError, "block_scaled_mm")
    with torch.no_grad():
        for _ in range(2):  # (the second call would meet a settled decode route)
            with pytest.raises(err[0], match=f"{err[1]}: bias must be on cpu, got meta"):
                torch.nn.functional.linear(x, lin.weight, meta_bias)
        with pytest.raises(err[0], match=f"{err[1]}: x must be on cpu, got meta"):
            lin(x.to("meta"))
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    w = torch.randn(32, 64)
    for name, args in (
        ("x", (x.to("meta"), w, None)),
        ("w", (x, w.to("meta"), None)),
        ("bias", (x, w, meta_bias)),
    ):
        with pytest.raises(LowPrecisionError, match=f"linear_quantize: {name} must be on cpu"):
            linear_quantize(*args)


@pytest.mark.parametrize("m", [4, 12])
def test_scaled_mm_fp8_outputs_cast_as_torch(m: int) -> None:
    """Past the format's range an E5M2 output is infinite, as ``torch._scaled_mm`` gives (the
    cast saturated at 57344); an E4M3FN output saturates at 448 in both."""
    e4, one = torch.float8_e4m3fn, torch.tensor(1.0)
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(m, 32, generator=g) * 400).to(e4)
    b = (torch.randn(16, 32, generator=g) * 400).to(e4).t()
    for od in (torch.float8_e5m2, e4):
        got = torchport.scaled_mm(a, b, one, one, out_dtype=od)
        want = torch._scaled_mm(a, b, one, one, out_dtype=od)
        assert torch.equal(got.float().isinf(), want.float().isinf())
        assert got.float().isinf().any() == (od == torch.float8_e5m2)
        fin = want.float().isfinite()
        assert torch.equal(got.float()[fin].abs() == 448, want.float()[fin].abs() == 448)


@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("g", [float("inf"), float("nan")])
def test_a_non_finite_global_scale_on_either_operand_is_the_references(m: int, g: float) -> None:
    torch.manual_seed(4)
    xq, xs = nvfp4_quantize(torch.randn(m, 64), None)
    wq, ws = nvfp4_quantize(torch.randn(40, 64), None)
    recipes = [S.BlockWise1x16, S.TensorWise]
    for ga, gb in ((1.0, g), (g, 1.0)):
        args = (xq.view(FP4), wq.view(FP4).t(), [xs, torch.tensor(ga)], recipes)
        args += ([ws, torch.tensor(gb)], recipes)
        out = TPF.scaled_mm(*args, output_dtype=torch.float32)
        ref = scaled_mm_reference(*args, output_dtype=torch.float32)
        assert torch.equal(out.isnan(), ref.isnan()) and bool(ref.isnan().any())
        assert torch.equal(out[~out.isnan()], ref[~ref.isnan()].float())


def test_export_of_a_dynamic_fp8_activation_layer_keeps_nan_rows_at_run_time() -> None:
    """At prefill shapes the activation quantizer's finiteness check asked for the traced
    values (GuardOnDataDependentSymNode): torch.export of the layer failed. The activation
    quantization has no data-dependent check now (torchao's arithmetic, which turns a row
    holding a NaN into NaN outputs, as eager does at every batch size): the exported graph
    gives eager's results, the NaN row included (it raised "input must be finite" there)."""
    from torchport.lowp import Float8DynamicActivationFloat8WeightConfig

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    torchport.quantize_(lin, Float8DynamicActivationFloat8WeightConfig())
    x = torch.randn(12, 64)
    mod = torch.export.export(lin, (x,)).module()
    with torch.no_grad():
        torch.testing.assert_close(mod(x), lin(x), rtol=1e-5, atol=1e-5)
        x[3, 5] = float("nan")
        out, want = mod(x), lin(x)
    assert bool(out[3].isnan().all()) and not bool(out[torch.arange(12) != 3].isnan().any())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
