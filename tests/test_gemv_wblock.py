"""The whole-block FP4 GEMV (:func:`torchport.gemv.fp4_kernel.gemv_fp4_wblock_kernel`).

Every int32 lane of its ``vpdpbusd`` sums holds one 16-element block, so its integer dot products
are exact and its activation quantization is the other int8 kernels' (per 32 elements,
``amax/127``, round half to even; vectorized here, the rare ``amax < 2^-64`` group through the
shared scalar routine): within the int8-activation error bound of the float64 reference, and
exactly equal to it where every product and partial sum is a small integer (unit block scales,
activation groups of amax 127). A row's bits do not depend on the batch, the row pairing, the K
blocks or the thread count. K must be a multiple of 256 (status 2; the tuner skips the
candidate); the kernel needs AVX-512 VNNI.
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import check_tiny_groups, int8_bound, pack, run
from torchport import autotune, native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel, gemv_fp4_wblock_kernel

_INFO = native.cpu_info()
pytestmark = pytest.mark.skipif(
    _INFO.isa != "avx512" or not _INFO.has("avx512_vnni"),
    reason="the whole-block kernel needs AVX-512 VNNI",
)

_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _codes_pack(fmt: str, codes: torch.Tensor, scales: torch.Tensor) -> gops.PackedWeight:
    """FP4 codes [N, K] (two a byte, element 2i in the low nibble) with block scale codes
    [N, K / block] and no tensor scale."""
    n, k = codes.shape
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()
    sc = scales.to(torch.uint8).contiguous()
    return gops.PackedWeight(fmt, data, sc, torch.empty(0), 1.0, n, k, True)


def _unit_scale_pack(fmt: str, codes: torch.Tensor) -> gops.PackedWeight:
    """FP4 codes [N, K] with every block scale 1 (E4M3 0x38, E8M0 127) and no tensor scale."""
    n, k = codes.shape
    block, one = (16, 0x38) if fmt == "nvfp4" else (32, 127)
    return _codes_pack(fmt, codes, torch.full((n, k // block), one))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(1, 256), (9, 768), (130, 4096), (21, 11008)], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_exact_where_every_sum_is_an_integer(fmt: str, n: int, k: int, rows: int) -> None:
    """Integer activations with one 127 in every 32-group quantize to themselves, and with unit
    block scales each product is a multiple of 0.5 and every partial sum exact in float32: the
    kernel must equal the float64 reference exactly. A mix-up of the activations' order or the
    corrections breaks the equality (the scales' lanes: the next test)."""
    g = torch.Generator().manual_seed(n * 7 + k + rows)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
    pw = _unit_scale_pack(fmt, codes)
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x.view(rows, k // 32, 32)[:, :, 5] = 127.0
    ref = x.double() @ _E2M1[codes].double().T
    for threads, load in ((1, 512), (2, 512), (2, 256)):
        out = run(gemv_fp4_wblock_kernel(fmt, "avx512", load=load), x, pw, threads=threads)
        assert torch.equal(out.double(), ref), (threads, load)


def _scaled_pack(fmt: str, codes: torch.Tensor, span: int, g: torch.Generator):
    """FP4 codes with power-of-two block scales 2^-span..2^span (E4M3 codes 0x38 + 8e, negative
    ones too for NVFP4; E8M0 127 + e) and the dequantized weights."""
    n, k = codes.shape
    block = 16 if fmt == "nvfp4" else 32
    e = torch.randint(-span, span + 1, (n, k // block), generator=g)
    if fmt == "nvfp4":
        neg = torch.randint(0, 2, e.shape, generator=g).bool()
        scales = (0x38 + 8 * e) | (neg.long() << 7)
        value = torch.where(neg, -1.0, 1.0).double() * 2.0 ** e.double()
    else:
        scales, value = 127 + e, 2.0 ** e.double()
    pw = _codes_pack(fmt, codes, scales)
    return pw, _E2M1[codes].double() * value.repeat_interleave(block, 1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k", "span"), [(9, 768, 2), (21, 11008, 1)], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_exact_with_power_of_two_scales(fmt: str, n: int, k: int, span: int, rows: int) -> None:
    """Power-of-two block scales (negative E4M3 ones too) and activation groups scaled by
    2^-span..2^span keep every product and partial sum exact: a mix-up of the block scales' or
    the group scales' lanes, or a wrong sign, breaks the equality."""
    g = torch.Generator().manual_seed(n + k + rows)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
    pw, wd = _scaled_pack(fmt, codes, span, g)
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x.view(rows, k // 32, 32)[:, :, 5] = 127.0
    gs = 2.0 ** torch.randint(-span, span + 1, (rows, k // 32, 1), generator=g).float()
    x = (x.view(rows, k // 32, 32) * gs).reshape(rows, k)
    ref = x.double() @ wd.T
    for threads in (1, 2):
        out = run(gemv_fp4_wblock_kernel(fmt, "avx512", chunk=1), x, pw, threads=threads)
        assert torch.equal(out.double(), ref), threads


def test_mx_scale_code_zero_is_two_to_the_minus_127() -> None:
    """E8M0 code 0 is the subnormal 2^-127 (not zero): products stay exact multiples of it."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (9, 768), generator=g, dtype=torch.int64)
    pw = _unit_scale_pack("mxfp4", codes)
    pw.scales.zero_()
    x = torch.randint(-127, 128, (3, 768), generator=g).float()
    x.view(3, 24, 32)[:, :, 5] = 127.0
    ref = x.double() @ (_E2M1[codes].double() * 2.0**-127).T
    out = run(gemv_fp4_wblock_kernel("mxfp4", "avx512"), x, pw)
    assert torch.equal(out.double(), ref) and bool((ref != 0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rounds_half_to_even_as_the_scalar_quantizer(fmt: str) -> None:
    """Activations at exact halves (amax 127 per group: the scale is 1) round to even, as
    ``tp_quant32``'s ``nearbyintf``: the result is the reference on ``torch.round`` codes."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (7, 512), generator=g, dtype=torch.int64)
    pw = _unit_scale_pack(fmt, codes)
    x = torch.randint(-126, 126, (2, 512), generator=g).float() + 0.5
    x.view(2, 16, 32)[:, :, 0] = -127.0
    ref = torch.round(x).double() @ _E2M1[codes].double().T
    out = run(gemv_fp4_wblock_kernel(fmt, "avx512"), x, pw)
    assert torch.equal(out.double(), ref)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(1, 256), (7, 768), (130, 4096)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_matches_lane_block_kernel_and_bound(fmt: str, n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k + rows)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g) * 2
    bias = torch.randn(n, generator=g)
    out = run(gemv_fp4_wblock_kernel(fmt, "avx512"), x, pw, bias)
    blk = run(gemv_fp4_block_kernel(fmt, "avx512"), x, pw, bias)
    assert torch.allclose(out, blk, rtol=1e-5, atol=1e-5)
    wd = gops.dequantize_packed(pw)
    ref = gops.gemv_reference(x.double(), wd, bias)
    assert bool(((out.double() - ref).abs() <= int8_bound(x, wd) * 1.001 + 1e-5).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_tiny_groups_stay_within_the_bound(fmt: str) -> None:
    """Groups with amax below 2^-64 (subnormal ones included) take the scalar quantizer."""
    check_tiny_groups(gemv_fp4_wblock_kernel(fmt, "avx512"), fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(37, 512), (21, 11008), (9, 4096)], ids=str)
def test_bits_do_not_depend_on_batch_pairs_blocks_or_threads(fmt: str, n: int, k: int) -> None:
    """Each output row keeps its bits: alone or in a batch of 2-8 (pairs of weight rows in passes
    of three or four activation rows, K blocks where up to four rows' prepared activations exceed
    ``xmin``), with the weight's first row dropped (every pair changes), for blocks of one unit,
    three (at four rows and more) or none, on one thread or on two claiming eight rows at a time
    (where the call is large enough for two), with 512-bit or 256-bit weight loads and each
    prefetch hint (T0, T1, NTA) at 2048-4096 bytes ahead."""
    g = torch.Generator().manual_seed(n + k)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(8, k, generator=g)
    bias = torch.randn(n, generator=g)
    base = gemv_fp4_wblock_kernel(fmt, "avx512", xblock=0, rows=1)
    alone = torch.cat([run(base, x[i : i + 1], pw, bias, 1) for i in range(8)])
    pw1 = gops.PackedWeight(
        pw.fmt, pw.data[1:], pw.scales[1:], pw.rowscale, pw.pts, n - 1, k, pw.int8
    )
    unit = (k + k // 4 + k // 8) // (k // 256)  # prepared activation bytes per unit and row
    cases = (
        (None, 2, 2, 512, "T0", 4096),
        (0, 2, 1, 256, "T1", 3072),
        (unit, 2, 2, 256, "T1", 2048),
        (12 * unit, 1, 2, 512, "NTA", 2048),
    )
    for xblock, rows, threads, load, hint, pf in cases:
        kern = gemv_fp4_wblock_kernel(
            fmt, "avx512", pf, chunk=1, xblock=xblock, rows=rows, xmin=0, load=load, hint=hint
        )
        for b in (2, 3, 4, 8):
            assert torch.equal(run(kern, x[:b], pw, bias, threads), alone[:b]), (xblock, b)
        assert torch.equal(run(kern, x[:5], pw1, bias[1:], threads), alone[:5, 1:])


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"must be one of .*got 'mxfp8_e4m3'"):
        gemv_fp4_wblock_kernel("mxfp8_e4m3", "avx512")
    with pytest.raises(ValueError, match=r"rows must be 1 or 2, got 3"):
        gemv_fp4_wblock_kernel("nvfp4", "avx512", rows=3)
    with pytest.raises(ValueError, match=r"load must be 256 or 512 bits, got 128"):
        gemv_fp4_wblock_kernel("nvfp4", "avx512", load=128)
    with pytest.raises(ValueError, match=r"xblock must be >= 0 bytes, got -1"):
        gemv_fp4_wblock_kernel("nvfp4", "avx512", xblock=-1)
    with pytest.raises(native.NativeError, match=r"needs AVX-512 VNNI \(isa is 'avx2'\)"):
        gemv_fp4_wblock_kernel("nvfp4", "avx2")


def test_k_not_multiple_of_256_is_status_2_and_an_invalid_candidate() -> None:
    pw = pack("nvfp4", torch.randn(4, 384))
    x, out = torch.randn(1, 384), torch.empty(1, 4)
    kern = gemv_fp4_wblock_kernel("nvfp4", "avx512")
    args = (x.data_ptr(), 1, 384, pw.data.data_ptr(), pw.scales.data_ptr())
    status = kern.call_unchecked(*args, 0, pw.pts, 0, 0, out.data_ptr(), 4, 1)
    assert status == 2
    cand = next(c for c in gops.candidates("nvfp4", True) if c.param("kernel") == "wblock")
    with pytest.raises(autotune.InvalidCandidate, match=r"K % 256 == 0 \(K=384, isa avx512\)"):
        gops._native_kernel("nvfp4", True, 384, "avx512", cand)
    assert all(c.param("kernel") != "wblock" for c in gops.candidates("nvfp4", True, 384))
