"""torchport.nn.functional.scaled_mm (2.14's recipe-based scaled GEMM) against its float64
reference, torch's own CPU kernel where torch has one (tensor-wise, row-wise), and the cuBLAS
blocked scale layout written out element by element."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from torchport.lowp import LowPrecisionError, mx_quantize, nvfp4_quantize
from torchport.lowp.nvfp4 import per_tensor_amax_to_scale
from torchport.lowp.scaled_recipes import (
    from_blocked_scales,
    scaled_mm_reference,
    to_blocked_scales,
)
from torchport.nn import functional as F

S, W = F.ScalingType, F.SwizzleType
FP4 = torch.float4_e2m1fn_x2


def _nvfp4(x: torch.Tensor, two_level: bool, swizzle: bool) -> tuple:
    g = per_tensor_amax_to_scale(x.abs().max()) if two_level else None
    q, s = nvfp4_quantize(x, g)
    scale = to_blocked_scales(s) if swizzle else s
    swz = W.SWIZZLE_32_4_4 if swizzle else W.NO_SWIZZLE
    if two_level:
        return (
            q.view(FP4),
            [scale, torch.tensor(g)],
            [S.BlockWise1x16, S.TensorWise],
            [swz, W.NO_SWIZZLE],
        )
    return q.view(FP4), scale, S.BlockWise1x16, swz


def _mx(x: torch.Tensor, elem: str, swizzle: bool) -> tuple:
    q, s = mx_quantize(x, elem)
    s = s.view(torch.float8_e8m0fnu)
    data = q.view(FP4) if elem == "fp4_e2m1" else q
    return (
        data,
        to_blocked_scales(s) if swizzle else s,
        S.BlockWise1x32,
        (W.SWIZZLE_32_4_4 if swizzle else W.NO_SWIZZLE),
    )


def _fp8_blocks(x: torch.Tensor, recipe, side: str) -> tuple:
    """float8 data and DeepSeek-style float32 block scales (a: [rows, K]; b: given as [K, N])."""
    rows, k = x.shape
    q = x.to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    if recipe == S.BlockWise1x128:
        s = torch.rand(rows, kb) + 0.5
    else:
        s = torch.rand(-(-rows // 128), kb) + 0.5
    return q, (s if side == "a" else s.t().contiguous()), recipe


def _operands(kind: str, x: torch.Tensor, w: torch.Tensor) -> tuple:
    """(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a, swizzle_b)."""
    if kind.startswith("nvfp4"):
        two, swz = "global" in kind, "swz" in kind
        qa, sa, ra, wa = _nvfp4(x, two, swz)
        qb, sb, rb, wb = _nvfp4(w, two, swz)
        return qa, qb.t(), sa, ra, sb, rb, wa, wb
    if kind.startswith("mx"):
        elem = {"mxfp4": "fp4_e2m1", "mxfp8": "fp8_e4m3", "mxfp8e5": "fp8_e5m2"}[kind.split("-")[0]]
        swz = kind.endswith("swz")
        qa, sa, ra, wa = _mx(x, elem, swz)
        qb, sb, rb, wb = _mx(w, elem, swz)
        return qa, qb.t(), sa, ra, sb, rb, wa, wb
    a8, b8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()
    if kind == "tensorwise":
        return a8, b8, torch.tensor(0.5), S.TensorWise, torch.tensor(3.0), S.TensorWise, None, None
    if kind == "rowwise":
        m, n = x.shape[0], w.shape[0]
        sa, sb = torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
        return a8, b8, sa, S.RowWise, sb, S.RowWise, None, None
    ra, rb = {"1x128": (S.BlockWise1x128, S.BlockWise1x128),
              "1x128-128x128": (S.BlockWise1x128, S.BlockWise128x128),
              "128x128-1x128": (S.BlockWise128x128, S.BlockWise1x128)}[kind]  # fmt: skip
    qa, sa, _ = _fp8_blocks(x, ra, "a")
    qb, sb, _ = _fp8_blocks(w, rb, "b")
    return qa, qb.t(), sa, ra, sb, rb, None, None


KINDS = [
    "nvfp4", "nvfp4-swz", "nvfp4-global", "nvfp4-global-swz", "mxfp4", "mxfp4-swz", "mxfp8",
    "mxfp8-swz", "mxfp8e5", "tensorwise", "rowwise", "1x128", "1x128-128x128", "128x128-1x128",
]  # fmt: skip
# (M, N, K, output dtype, bias): decode, odd sizes (rows past one 128-row scale tile), long K
CASES = [
    (1, 16, 32, torch.bfloat16, True),
    (9, 130, 96, torch.float32, False),
    (33, 7, 256, torch.bfloat16, False),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,k,od,with_bias", CASES)
def test_scaled_mm_matches_reference(kind, m, n, k, od, with_bias):
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    ops = _operands(kind, x, w)
    bias = torch.randn(n).to(od) if with_bias else None
    out = F.scaled_mm(*ops, bias=bias, output_dtype=od)
    ref = scaled_mm_reference(*ops, bias=bias, output_dtype=od)
    assert out.dtype == od and out.shape == (m, n)
    tol = 1e-5 if od == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * k**0.5)
    # the reference really is the product of the decoded operands (not a copy of the kernel's)
    full = scaled_mm_reference(*ops, output_dtype=torch.float64)
    assert torch.isfinite(full).all()


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise"])
def test_matches_torch_cpu_kernel(kind):
    torch.manual_seed(1)
    x, w = torch.randn(12, 64), torch.randn(24, 64)
    ops = _operands(kind, x, w)
    ours = F.scaled_mm(*ops[:6])
    theirs = TF.scaled_mm(*ops[:6])
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2, atol=1e-2)


def test_nvfp4_two_level_is_the_dequantized_product():
    torch.manual_seed(2)
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    ops = _operands("nvfp4-global-swz", x, w)
    out = F.scaled_mm(*ops, output_dtype=torch.float32)
    # the quantized product is close to the float one (a recipe mix-up is not)
    rel = (out - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < 0.2, rel


@pytest.mark.parametrize("m", [1, 32])  # the decode GEMV and the block-scaled GEMM
@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("g", [0.0, -0.5, float("nan")])
def test_nvfp4_global_scale_takes_any_value_on_either_side(m, side, g):
    """torch applies a zero, negative or NaN global scale to the product; b's was refused
    (NVFP4Tensor takes positive finite per-tensor scales only) while a's was taken."""
    torch.manual_seed(5)
    qa, sa, ra, wa = _nvfp4(torch.randn(m, 64), True, False)
    qb, sb, rb, wb = _nvfp4(torch.randn(48, 64), True, False)
    if side == "a":
        sa = [sa[0], torch.tensor(g)]
    else:
        sb = [sb[0], torch.tensor(g)]
    args = (qa, qb.t(), sa, ra, sb, rb, wa, wb)
    bias = torch.randn(48)
    out = F.scaled_mm(*args, bias=bias, output_dtype=torch.float32)
    ref = scaled_mm_reference(*args, bias=bias, output_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-3, equal_nan=True)


def test_odd_k_blocks_padded_by_ceil():
    torch.manual_seed(3)
    x, w = torch.randn(3, 40), torch.randn(5, 40)  # K=40: the third NVFP4 block is partial
    q, s = nvfp4_quantize(torch.nn.functional.pad(x, (0, 8)))
    qa = q[:, :20].contiguous().view(FP4)
    qw, sw = nvfp4_quantize(torch.nn.functional.pad(w, (0, 8)))
    qb = qw[:, :20].contiguous().view(FP4).t()
    out = F.scaled_mm(qa, qb, s, S.BlockWise1x16, sw, S.BlockWise1x16, output_dtype=torch.float32)
    full = F.scaled_mm(
        q.view(FP4), qw.view(FP4).t(), s, S.BlockWise1x16, sw, S.BlockWise1x16,
        output_dtype=torch.float32,
    )  # fmt: skip
    # the padding columns were zeros, so the product over K=40 equals the one over K=48
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


def test_blocked_layout_element_by_element():
    s = torch.randint(0, 255, (130, 7), dtype=torch.uint8)
    bl = to_blocked_scales(s)
    rp, cp = 256, 8
    assert bl.numel() == rp * cp
    for r in range(130):
        for c in range(7):
            off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
            assert bl[off + c % 4] == s[r, c]
    assert torch.equal(from_blocked_scales(bl, 130, 7), s)
    e4 = s.view(torch.float8_e4m3fn)
    assert from_blocked_scales(to_blocked_scales(e4), 130, 7).view(torch.uint8).equal(s)


def test_zero_sizes():
    a = torch.zeros(0, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(32, 4, dtype=torch.float8_e4m3fn)
    out = F.scaled_mm(a, b, torch.tensor(1.0), S.TensorWise, torch.tensor(1.0), S.TensorWise)
    assert out.shape == (0, 4) and out.dtype == torch.bfloat16


def _good():
    torch.manual_seed(4)
    return list(_operands("nvfp4-swz", torch.randn(4, 32), torch.randn(8, 32)))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda o: o.__setitem__(5, S.BlockWise1x32), "not a supported pair"),
        (lambda o: o.__setitem__(3, S.RowWise), "not a supported pair"),
        (lambda o: o.__setitem__(2, o[2].view(torch.uint8)[:-1]), "must have"),
        (lambda o: o.__setitem__(4, o[4].float()), "scales must be"),
        (lambda o: o.__setitem__(6, [W.SWIZZLE_32_4_4, W.NO_SWIZZLE]), "swizzle_a must have 1"),
        (lambda o: o.__setitem__(0, o[0].view(torch.uint8)), "float8 or float4"),
        (lambda o: o.__setitem__(0, o[0][:, :8]), "cannot be multiplied"),
        (lambda o: o.__setitem__(1, torch.zeros(16, 8, dtype=torch.float8_e4m3fn)), "both be FP4"),
        (lambda o: o.__setitem__(0, o[0].reshape(-1)), "2-D"),
        (lambda o: o.__setitem__(3, "BlockWise1x16"), "not a supported pair"),
        (lambda o: o.__setitem__(2, [o[2], torch.tensor(1.0)]), "one scale per recipe"),
    ],
)
def test_bad_inputs(mutate, match):
    ops = _good()
    mutate(ops)
    with pytest.raises(LowPrecisionError, match=match):
        F.scaled_mm(*ops)


def test_bad_keyword_arguments():
    ops = _good()
    with pytest.raises(LowPrecisionError, match="bias must be"):
        F.scaled_mm(*ops, bias=torch.zeros(7))
    with pytest.raises(LowPrecisionError, match="output_dtype"):
        F.scaled_mm(*ops, output_dtype=torch.int32)
    with pytest.raises(LowPrecisionError, match="contraction_dim"):
        F.scaled_mm(*ops, contraction_dim=(0, 1))
    two = list(_operands("nvfp4-global-swz", torch.randn(4, 32), torch.randn(8, 32)))
    two[4], two[5], two[7] = two[4][0], S.BlockWise1x16, W.SWIZZLE_32_4_4  # b without a global
    with pytest.raises(LowPrecisionError, match="both operands or neither"):
        F.scaled_mm(*two)
    two = list(_operands("nvfp4-global-swz", torch.randn(4, 32), torch.randn(8, 32)))
    two[3] = [S.TensorWise, S.BlockWise1x16]
    with pytest.raises(LowPrecisionError, match="not a supported pair"):
        F.scaled_mm(*two)
    rw = list(_operands("rowwise", torch.randn(4, 32), torch.randn(8, 32)))
    rw[4] = rw[4].t()  # (N, 1) instead of (1, N)
    with pytest.raises(LowPrecisionError, match=r"shape \(1, 8\)"):
        F.scaled_mm(*rw)
