"""Review 52 of the low-precision linears and the FP8 scaled GEMM.

1. ``torchport.scaled_mm`` (and ``torchport.nn.functional.scaled_mm``'s tensor-wise / row-wise
   recipes, and an FP8 weight's prefill) multiplied the float32 sum by ``scale_a`` and then
   ``scale_b`` (the GEMV: ``scale_b``, then ``scale_a``): a first product past float32's range
   gave inf, and one below it 0, where the scaled value fits float32, as ``torch._scaled_mm`` on
   the CPU and :func:`scaled_mm_reference` give it (448² times 1e34, then times 1e-10).
2. Float8 activations were taken by the quantized linears and the product came back in float8
   (saturated or infinite); ``F.linear`` with the dequantized weight refuses them.
3. A 1-D bias of the wrong length with K = 0 reached torch's untyped broadcasting error.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import torchport
import torchport.nn.functional as TF
from torchport import config
from torchport.lowp import (
    Float8Tensor,
    LowPrecisionError,
    MXTensor,
    NVFP4Tensor,
    fp8_quantize_activation,
    scaled_mm,
    scaled_mm_reference,
)

SM = sys.modules["torchport.lowp.scaled_mm"]


@pytest.fixture(autouse=True)
def _untuned():
    """The tuner's defaults (timing the candidates of every new shape cost most of the file's
    time); the scaling is the same in every candidate."""
    with config.override(autotune=False):
        yield


E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ROWS = [1, 4, 16]  # the GEMV (M <= 8) and the panel GEMM
ROW_IDS = ["gemv1", "gemv4", "gemm16"]


def _operands(m: int, k: int, n: int, value: float, dtype: torch.dtype = E4):
    """``a [M, K]`` and a column-major ``b [K, N]`` of one FP8 value."""
    a = torch.full((m, k), value).to(dtype)
    b = torch.full((n, k), value).to(dtype).t()
    return a, b


def _scales(m: int, n: int, sa: float, sb: float, rowwise: bool):
    if rowwise:
        return torch.full((m, 1), sa), torch.full((1, n), sb)
    return torch.tensor(sa), torch.tensor(sb)


# --- 1. the two scales of scaled_mm ---------------------------------------------------------------


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("pair", [(1e34, 1e-10), (1e-10, 1e34)], ids=["sa_big", "sb_big"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_mm_extreme_scale_pair_is_finite_as_torch(m, rowwise, pair, out_dtype) -> None:
    """A row of 448s (K = 2) with scales 1e34 and 1e-10: about 4.01e29, as torch._scaled_mm
    (whose CPU kernel scales the operands in float32) and the reference; it was inf."""
    a, b = _operands(m, 2, 3, 448.0)
    sa, sb = _scales(m, 3, *pair, rowwise)
    got = scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
    assert bool(want.float().isfinite().all())
    torch.testing.assert_close(got, want, rtol=1e-6 if out_dtype == torch.float32 else 0, atol=0)
    ref = scaled_mm_reference(a, b, sa, sb, out_dtype=out_dtype)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_functional_scaled_mm_extreme_scale_pair(m, rowwise) -> None:
    """The same through 2.14's recipe API (``torchport.nn.functional.scaled_mm``)."""
    st = F.ScalingType
    recipe = st.RowWise if rowwise else st.TensorWise
    a, b = _operands(m, 2, 3, 448.0)
    sa, sb = _scales(m, 3, 1e34, 1e-10, rowwise)
    got = TF.scaled_mm(a, b, sa, recipe, sb, recipe, output_dtype=torch.float32)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("pair", [(1e-40, 1e30), (1e30, 1e-40)], ids=["sa_tiny", "sb_tiny"])
def test_scaled_mm_first_product_below_float32_is_not_flushed(m, pair) -> None:
    """Sums of 2**-18 times a subnormal scale (1e-40), then 1e30: about 3.8e-16 (torch's CPU
    kernel, scaling subnormal operands, within 1%); the first product underflowed to 0."""
    a, b = _operands(m, 4, 5, 2.0**-9)
    sa, sb = torch.tensor(pair[0]), torch.tensor(pair[1])
    got = scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    ref = scaled_mm_reference(a, b, sa, sb, out_dtype=torch.float32)
    assert bool((ref != 0).all())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
def test_scaled_mm_scale_product_past_float32_with_a_tiny_sum(m) -> None:
    """1e20 · 1e20 overflows float32, the scaled sum (2**-18 · 4 · 1e40) does not: finite, as
    torch's (a product of the scales computed first would give inf)."""
    a, b = _operands(m, 4, 5, 2.0**-9)
    s = torch.tensor(1e20)
    got = scaled_mm(a, b, s, s, out_dtype=torch.float32)
    want = torch._scaled_mm(a, b, s, s, out_dtype=torch.float32)
    assert bool(want.isfinite().all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
def test_scaled_mm_rows_of_different_scales_with_bias(m) -> None:
    """Row-wise scales spanning 1e-30..1e34 against column scales 1e-10..1e20 (E5M2 operands):
    every entry as the float64 reference, bias included."""
    g = torch.Generator().manual_seed(m)
    a = (torch.randn(m, 40, generator=g) * 1e4).to(E5)
    b = (torch.randn(6, 40, generator=g) * 1e4).to(E5).t()
    sa = torch.tensor([1e34, 1e-30, 1.0, 1e20, 3e-5, 1e-20, 7.0, 1e30] * 2)[:m].reshape(m, 1)
    sb = torch.tensor([[1e-10, 1.0, 1e20, 1e-20, 5e-3, 1e-30]])
    bias = torch.randn(6, generator=g)
    got = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    ref = scaled_mm_reference(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    assert torch.equal(got.isfinite(), ref.isfinite())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
def test_scaled_mm_traced_route_scales_in_float64(m) -> None:
    """A call autograd records (a scale that requires grad) cannot read the scales: its sum is
    always scaled as :func:`_scale_sum` does, finite for the extreme pair too."""
    a, b = _operands(m, 2, 3, 448.0)
    sa = torch.tensor(1e34, requires_grad=True)
    got = scaled_mm(a, b, sa, torch.tensor(1e-10), out_dtype=torch.float32)
    torch.testing.assert_close(
        got.detach(), torch.full((m, 3), 2 * 448.0**2 * 1e24), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_ordinary_scales_keep_the_fused_scaling(m, rowwise, monkeypatch) -> None:
    """Scales of ordinary size are applied by the routes as before (no float64 pass)."""

    def boom(*args: object) -> None:
        raise AssertionError("float64 scaling for ordinary scales")

    monkeypatch.setattr(SM, "_scale_sum", boom)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(m, 64, generator=g).to(E4)
    b = torch.randn(8, 64, generator=g).to(E4).t()
    sa, sb = _scales(m, 8, 0.02, 3e-3, rowwise)
    got = scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    torch.testing.assert_close(got, scaled_mm_reference(a, b, sa, sb, out_dtype=torch.float32))


@pytest.mark.parametrize("rows", [2, 12], ids=["decode", "prefill"])
def test_float8_dynamic_linear_with_huge_activations(rows) -> None:
    """An FP8 weight quantizing its activations: activations near float32's maximum against a
    small weight give the F.linear value (the prefill's scaled_mm overflowed its first product)."""
    g = torch.Generator().manual_seed(7)
    w = Float8Tensor.from_float(torch.randn(8, 64, generator=g) * 1e-6, act_dtype=E4)
    x = torch.randn(rows, 64, generator=g)
    x = x / x.abs().amax() * 3e38
    with torch.no_grad():
        got = F.linear(x, w)
    q, s = fp8_quantize_activation(x, E4, "row")  # the activations the linear multiplies
    xq, wd = q.double() * s.double(), w.dequantize().double()
    err = (got.double() - xq @ wd.T).abs()
    assert bool(got.isfinite().all())
    assert bool((err <= 1e-5 * (xq.abs() @ wd.abs().T)).all())


# --- 2. float8 activations ------------------------------------------------------------------------


def _weights() -> dict[str, torch.Tensor]:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    return {
        "fp8": Float8Tensor.from_float(w),
        "fp8_act": Float8Tensor.from_float(w, act_dtype=E4),
        "fp8_tensor_act": Float8Tensor.from_float(w, granularity="tensor", act_dtype=E5),
        "nvfp4": NVFP4Tensor.from_float(w),
        "nvfp4_act": NVFP4Tensor.from_float(w, act_per_tensor_scale=True),
        "mx": MXTensor.from_float(w),
        "mx_act": MXTensor.from_float(w, act_elem="fp4_e2m1"),
        "mx_act_fp8": MXTensor.from_float(w, act_elem="fp8_e4m3"),
    }


WEIGHTS = list(_weights())


@pytest.mark.parametrize("dtype", [E4, E5, torch.float8_e4m3fnuz], ids=str)
@pytest.mark.parametrize("rows", [1, 12], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_float8_activation_is_refused(kind: str, rows: int, dtype: torch.dtype) -> None:
    w = _weights()[kind]
    x = torch.randn(rows, 64).to(dtype)
    msg = (
        rf"F.linear with a {type(w).__name__}: x must be a float16, bfloat16, float32 or "
        rf"float64 tensor .*got {dtype}"
    )
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(LowPrecisionError, match=msg):
            F.linear(x, w)
    with pytest.raises(LowPrecisionError, match=msg):
        w.linear(x, None)


@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_float8_activation_is_refused_after_a_settled_route(kind: str) -> None:
    """The decode route a float32 call settled does not serve a float8 call of the same shape."""
    w = _weights()[kind]
    x = torch.randn(2, 64)
    with torch.no_grad():
        for _ in range(3):
            F.linear(x, w)
        with pytest.raises(LowPrecisionError, match=r"got torch.float8_e4m3fn"):
            F.linear(x.to(E4), w)


def test_a_float8_activation_is_refused_by_a_meta_weight() -> None:
    w = Float8Tensor(
        torch.empty(32, 64, dtype=E4, device="meta"), torch.ones((), device="meta"), torch.float32
    )
    with pytest.raises(LowPrecisionError, match=r"x must be a float16, .*got torch.float8_e5m2"):
        F.linear(torch.randn(2, 64, device="meta").to(E5), w)


# --- 3. a bias of the wrong length with K = 0 ----------------------------------------------------


def _empty_weights() -> dict[str, torch.Tensor]:
    w = torch.randn(16, 0)
    return {
        "fp8": Float8Tensor.from_float(w),
        "fp8_act": Float8Tensor.from_float(w, act_dtype=E4),
        "nvfp4": NVFP4Tensor.from_float(w),
        "nvfp4_act": NVFP4Tensor.from_float(w, act_per_tensor_scale=True),
        "mx": MXTensor.from_float(w),
        "mx_act": MXTensor.from_float(w, act_elem="fp4_e2m1"),
    }


@pytest.mark.parametrize("shape", [(0,), (1, 0), (12, 0), (2, 3, 0)], ids=str)
@pytest.mark.parametrize("kind", list(_empty_weights()))
def test_k0_bias_of_the_wrong_length_is_refused(kind: str, shape: tuple[int, ...]) -> None:
    w = _empty_weights()[kind]
    x = torch.randn(shape)
    msg = rf"{type(w).__name__} of shape \(16, 0\): the bias must have shape \(16,\), got \(5,\)"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(LowPrecisionError, match=msg):
            F.linear(x, w, torch.randn(5))
    with pytest.raises(LowPrecisionError, match=msg):
        w.linear(x, torch.randn(5))
    bias = torch.randn(16)
    with torch.no_grad():
        out = F.linear(x, w, bias)
    torch.testing.assert_close(out, bias.expand(*shape[:-1], 16))


def test_k0_gemv_bias_of_the_wrong_length_is_refused() -> None:
    from torchport.gemv import GemvInputError, gemv

    for w in (torch.randn(16, 0), Float8Tensor.from_float(torch.randn(16, 0))):
        with pytest.raises(GemvInputError, match=r"bias must have shape \(16,\), got \(5,\)"):
            gemv(torch.randn(1, 0), w, torch.randn(5))


def test_torchport_scaled_mm_is_the_module_function() -> None:
    assert torchport.scaled_mm is scaled_mm


@pytest.mark.parametrize("m", ROWS, ids=ROW_IDS)
def test_scaled_mm_nan_row_scale_beside_extreme_ones(m) -> None:
    """A NaN row scale gives its row NaN (torch's order, redone) while the other rows, scaled
    by 1e34 and 1e-10, keep their finite values, as torch._scaled_mm."""
    a, b = _operands(m, 2, 3, 448.0)
    sa = torch.full((m, 1), 1e34)
    sa[0] = float("nan")
    sb = torch.full((1, 3), 1e-10)
    got = scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert bool(got[0].isnan().all()) and bool(got[1:].isfinite().all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
