"""The AMX-INT8 FP4 GEMV (:func:`torchport.gemv.fp4_kernel.gemv_fp4_amx_kernel`).

Per 16 weight rows and 64 weights one ``tdpbssd`` multiplies the decoded weights (``2·e2m1``,
signed) by block-diagonal activation tiles (one int32 column per activation row and block), so
every block's dot product is exact; the activations are quantized as in the other int8 kernels
(per 32 elements, ``amax/127``, round half to even). So: within the int8-activation error bound
of the float64 reference, exactly equal to it where every product and partial sum is a small
integer, equal to the whole-block kernel up to float32 rounding, and a row's bits do not depend
on the batch, the row groups, the claims, the prefetch hint or the thread count. K must be a
multiple of 128 (status 2), the rows 1 to 4 (NVFP4) or 8 (MXFP4) (status 7); the kernel needs
AVX-512 VBMI and AMX-INT8 granted by the OS, and the tuner offers it for MXFP4 from five
activation rows. The kernel tests run only where it can (``needs_amx``); the last test, of what
happens where it cannot, runs everywhere. (The compiler barriers around the tile loads and
stores are not something a test here can catch going missing.)
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import check_tiny_groups, int8_bound, only_native_kernel, pack, run
from torchport import autotune, config, native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import (
    AMX_MAX_ROWS,
    amx_int8_ready,
    gemv_fp4_amx_kernel,
    gemv_fp4_wblock_kernel,
)

needs_amx = pytest.mark.skipif(
    not amx_int8_ready(), reason="the AMX kernel needs AVX-512 VBMI and AMX-INT8"
)

_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def _codes_pack(fmt: str, codes: torch.Tensor, scales: torch.Tensor) -> gops.PackedWeight:
    """FP4 codes [N, K] (element 2i in the low nibble) with block scale codes, no tensor scale."""
    n, k = codes.shape
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return gops.PackedWeight(
        fmt, data, scales.to(torch.uint8).contiguous(), torch.empty(0), 1.0, n, k, True
    )


def _scaled_pack(fmt: str, codes: torch.Tensor, span: int, g: torch.Generator):
    """FP4 codes with power-of-two block scales 2^-span..2^span (negative E4M3 ones too), and the
    dequantized weights; span 0: unit scales."""
    n, k = codes.shape
    block = _BLOCK[fmt]
    e = torch.randint(-span, span + 1, (n, k // block), generator=g)
    if fmt == "nvfp4":
        neg = torch.randint(0, 2, e.shape, generator=g).bool() & (span > 0)
        scales = (0x38 + 8 * e) | (neg.long() << 7)
        value = torch.where(neg, -1.0, 1.0).double() * 2.0 ** e.double()
    else:
        scales, value = 127 + e, 2.0 ** e.double()
    return _codes_pack(fmt, codes, scales), _E2M1[codes].double() * value.repeat_interleave(
        block, 1
    )


def _integer_x(rows: int, k: int, g: torch.Generator, span: int = 0) -> torch.Tensor:
    """Integer activations with a 127 in every 32-group (they quantize to themselves), each group
    times 2^-span..2^span."""
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x.view(rows, k // 32, 32)[:, :, 5] = 127.0
    gs = 2.0 ** torch.randint(-span, span + 1, (rows, k // 32, 1), generator=g).float()
    return (x.view(rows, k // 32, 32) * gs).reshape(rows, k)


def _rows(fmt: str) -> list[int]:
    return [1, 2, 3, 4] if fmt == "nvfp4" else [1, 3, 5, 8]


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(
    ("n", "k", "span"),
    [(1, 128, 0), (17, 384, 0), (130, 4096, 0), (21, 11008, 1), (40, 640, 2)],
    ids=str,
)
def test_exact_where_every_sum_is_an_integer(fmt: str, n: int, k: int, span: int) -> None:
    """Unit or power-of-two block scales (negative E4M3 ones too) and integer activation groups
    scaled by powers of two keep every product and partial sum exact: the kernel must equal the
    float64 reference, at every row count, on one and two threads, with both prefetch hints. A
    mix-up of the tiles' k-quads, blocks or columns, of the block scales' or the group scales'
    lanes breaks the equality; N = 17, 21, 40 leave a partial group of 16 rows."""
    g = torch.Generator().manual_seed(n * 7 + k + span)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
    pw, wd = _scaled_pack(fmt, codes, span, g)
    for rows in _rows(fmt):
        x = _integer_x(rows, k, g, span)
        ref = x.double() @ wd.T
        for threads, hint in ((1, "T1"), (2, "T0")):
            out = run(gemv_fp4_amx_kernel(fmt, hint=hint, chunk=1), x, pw, threads=threads)
            assert torch.equal(out.double(), ref), (rows, threads, hint)


@needs_amx
def test_mx_scale_code_zero_is_two_to_the_minus_127() -> None:
    """E8M0 code 0 is the subnormal 2^-127 (not zero): products stay exact multiples of it."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (9, 768), generator=g, dtype=torch.int64)
    pw = _codes_pack("mxfp4", codes, torch.zeros(9, 24, dtype=torch.int64))
    x = _integer_x(6, 768, g)
    ref = x.double() @ (_E2M1[codes].double() * 2.0**-127).T
    out = run(gemv_fp4_amx_kernel("mxfp4"), x, pw)
    assert torch.equal(out.double(), ref) and bool((ref != 0).all())


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rounds_half_to_even_as_the_scalar_quantizer(fmt: str) -> None:
    """Activations at exact halves (amax 127 per group: the scale is 1) round to even."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (7, 512), generator=g, dtype=torch.int64)
    pw, wd = _scaled_pack(fmt, codes, 0, g)
    x = torch.randint(-126, 126, (2, 512), generator=g).float() + 0.5
    x.view(2, 16, 32)[:, :, 0] = -127.0
    out = run(gemv_fp4_amx_kernel(fmt), x, pw)
    assert torch.equal(out.double(), torch.round(x).double() @ wd.T)


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(1, 256), (7, 768), (130, 4096), (33, 11008)], ids=str)
def test_matches_whole_block_kernel_and_bound(fmt: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    wd = gops.dequantize_packed(pw)
    bias = torch.randn(n, generator=g)
    for rows in _rows(fmt):
        x = torch.randn(rows, k, generator=g) * 2
        out = run(gemv_fp4_amx_kernel(fmt), x, pw, bias)
        other = run(gemv_fp4_wblock_kernel(fmt, "avx512"), x, pw, bias)
        assert torch.allclose(out, other, rtol=1e-5, atol=1e-5), rows
        ref = gops.gemv_reference(x.double(), wd, bias)
        assert bool(((out.double() - ref).abs() <= int8_bound(x, wd) * 1.001 + 1e-5).all()), rows


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_tiny_groups_stay_within_the_bound(fmt: str) -> None:
    """Groups with amax below 2^-64 (subnormal ones included) take the scalar quantizer."""
    check_tiny_groups(gemv_fp4_amx_kernel(fmt), fmt)


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(37, 512), (50, 11008), (300, 4096)], ids=str)
def test_bits_do_not_depend_on_batch_groups_claims_hint_or_threads(
    fmt: str, n: int, k: int
) -> None:
    """Each output row keeps its bits: alone or in a batch, with the weight's first row dropped
    (every group of 16 rows shifts), claims of 16 rows, the default or one static split (ranges
    aligned to 8 rows, not 16), either prefetch hint, one thread or two (N = 300 at K = 4096 is
    large enough for two; the smaller calls run on one whatever is asked)."""
    g = torch.Generator().manual_seed(n + k)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    most = AMX_MAX_ROWS[fmt]
    x = torch.randn(most, k, generator=g)
    bias = torch.randn(n, generator=g)
    base = gemv_fp4_amx_kernel(fmt)
    alone = torch.cat([run(base, x[i : i + 1], pw, bias, 1) for i in range(most)])
    pw1 = gops.PackedWeight(
        pw.fmt, pw.data[1:], pw.scales[1:], pw.rowscale, pw.pts, n - 1, k, pw.int8
    )
    for hint, chunk, threads in (("T1", None, 2), ("T0", 1, 2), ("T1", 1, 1), ("T1", 0, 2)):
        kern = gemv_fp4_amx_kernel(fmt, hint=hint, chunk=chunk)
        for b in sorted({2, most - 1, most}):
            assert torch.equal(run(kern, x[:b], pw, bias, threads), alone[:b]), (hint, b)
        assert torch.equal(run(kern, x, pw1, bias[1:], threads), alone[:, 1:])


@needs_amx
def test_non_finite_activations_go_to_the_float_kernel() -> None:
    """NaN and infinities are handed back (status 5) and run by the format's float kernel."""
    pw = pack("mxfp4", torch.randn(20, 256))
    x = torch.randn(6, 256)
    x[1, 3], x[4, 100] = float("nan"), float("inf")
    out = run(gemv_fp4_amx_kernel("mxfp4"), x, pw)
    ref = gops.gemv_reference(x.double(), gops.dequantize_packed(pw))
    assert bool(out[1].isnan().all()) and bool(out[4].isnan().logical_or(out[4].isinf()).all())
    keep = [0, 2, 3, 5]
    assert torch.allclose(out[keep].double(), ref[keep], rtol=1e-4, atol=1e-4)


@needs_amx
def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"must be one of .*got 'mxfp8_e4m3'"):
        gemv_fp4_amx_kernel("mxfp8_e4m3")
    with pytest.raises(ValueError, match=r"hint must be one of .*got 'T2'"):
        gemv_fp4_amx_kernel("nvfp4", hint="T2")


@needs_amx
@pytest.mark.parametrize(("fmt", "k", "rows", "status", "why"), [
    ("nvfp4", 192, 1, 2, r"K=192 is not a multiple"),
    ("nvfp4", 256, 5, 7, r"takes 1 to 4 activation rows of nvfp4 weights, got 5"),
    ("mxfp4", 256, 9, 7, r"takes 1 to 8 activation rows of mxfp4 weights, got 9"),
])  # fmt: skip
def test_bad_k_or_rows_is_a_status_and_an_error(
    fmt: str, k: int, rows: int, status: int, why: str
) -> None:
    pw = pack(fmt, torch.randn(4, k))
    x, out = torch.randn(rows, k), torch.empty(rows, 4)
    kern = gemv_fp4_amx_kernel(fmt)
    args = (x.data_ptr(), rows, k, pw.data.data_ptr(), pw.scales.data_ptr())
    assert kern.call_unchecked(*args, 0, pw.pts, 0, 0, out.data_ptr(), 4, 1) == status
    with pytest.raises(native.NativeError, match=why):
        run(kern, x, pw)


@needs_amx
def test_offered_to_the_tuner_for_mx_from_five_rows() -> None:
    """Candidates ``amx_*`` for MXFP4 at 5 to 8 rows and K a multiple of 128, nowhere else; an
    AMX candidate asked for an unfit K or row count is an invalid candidate, not a crash."""

    def amx(*args: object, **kw: object) -> list[str]:
        return [c.name for c in gops.candidates(*args, **kw) if c.param("kernel") == "amx"]  # type: ignore[arg-type]

    assert amx("mxfp4", True, 4096, rows=8) == [
        "amx_p0l2_t0",
        "amx_p0_t0",
        "amx_p0l2_t1",
        "amx_p0_t1",
    ]
    assert amx("mxfp4", True, 4096, rows=5) and not amx("mxfp4", True, 4096, rows=4)
    assert not amx("mxfp4", True, 192, rows=8) and not amx("nvfp4", True, 4096, rows=4)
    assert not amx("mxfp4", True, 4096) and not amx("mxfp4", False, 4096, rows=8)
    cand = next(
        c for c in gops.candidates("mxfp4", True, 4096, rows=8) if c.param("kernel") == "amx"
    )
    with pytest.raises(autotune.InvalidCandidate, match=r"K % 128 == 0 and 1 to 8 .*K=192"):
        gops._native_kernel("mxfp4", True, 192, "avx512", cand, 8)
    with pytest.raises(
        autotune.InvalidCandidate, match=r"1 to 4 activation rows \(nvfp4, K=4096, 5 rows\)"
    ):
        gops._native_kernel("nvfp4", True, 4096, "avx512", cand, 5)


@needs_amx
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bf16io_entry_is_the_float_entry_then_torchs_cast(fmt: str) -> None:
    """The bf16-in, bf16-out entry at every row count, finite activations (the shared bf16io test
    puts a NaN in every row past the first, which the float kernel takes)."""
    if not gops._cast_nan_is_ffff():
        pytest.skip("torch's CPU cast writes NaN as 0x7fc0 here (ATEN_CPU_CAPABILITY=default)")
    g = torch.Generator().manual_seed(5)
    n, k = 37, 1152
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.1)
    kern = gemv_fp4_amx_kernel(fmt)
    bias = torch.randn(n, generator=g)
    for rows in range(1, AMX_MAX_ROWS[fmt] + 1):
        x = torch.randn(rows, k, generator=g).bfloat16()
        full = run(kern, x.float(), pw, bias)
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        raw = (x.data_ptr(), rows, k, pw.data.data_ptr(), pw.scales.data_ptr(),
               pw.rowscale.data_ptr(), pw.pts, bias.data_ptr(), 1, out.data_ptr(), n, 2)  # fmt: skip
        assert kern.bf16io.raw_call(*raw) == 0
        assert torch.equal(out.view(torch.int16), full.bfloat16().view(torch.int16)), rows


@needs_amx
def test_gemv_packed_runs_the_tuned_amx_plan(fresh_cache, monkeypatch) -> None:
    """With the AMX kernel the one native candidate, ``gemv_packed`` plans it (at 5-8 MXFP4
    rows), its results stay within the int8 bound for float32 and bf16 activations, and the
    settled second call gives the same bits."""
    only_native_kernel(monkeypatch, "amx")
    try:
        g = torch.Generator().manual_seed(2)
        pw = pack("mxfp4", torch.randn(300, 1024, generator=g) * 0.05)
        wd = gops.dequantize_packed(pw)
        for rows in (5, 8):
            x = torch.randn(rows, 1024, generator=g)
            first = gops.gemv_packed(x, pw)
            assert gops.plan_for(pw, rows, True).candidate.param("kernel") == "amx"
            ref = gops.gemv_reference(x.double(), wd)
            assert bool(((first.double() - ref).abs() <= int8_bound(x, wd) * 1.001 + 1e-5).all())
            assert torch.equal(gops.gemv_packed(x, pw), first)
            xb = x.bfloat16()
            yb = gops.gemv_packed(xb, pw)
            assert yb.dtype == torch.bfloat16
            refb = gops.gemv_reference(xb.double(), wd)
            assert torch.allclose(yb.double(), refb, rtol=2e-2, atol=5e-2)
    finally:
        gops._PLANS.clear()


def test_not_offered_nor_built_where_it_cannot_run(monkeypatch) -> None:
    """Without AMX-INT8 (or after an AMX library failed to compile): no ``amx_*`` candidate, an
    AMX candidate asked for anyway is an invalid candidate, and the builder raises naming what is
    missing. Runs on every machine (the readiness is patched)."""
    from torchport.gemv import fp4_kernel

    monkeypatch.setattr(fp4_kernel, "_amx_unbuildable", [True])
    assert not amx_int8_ready()
    assert all(c.param("kernel") != "amx" for c in gops.candidates("mxfp4", True, 4096, rows=8))
    cand = autotune.Candidate("amx_p0l2_t0", params=(("kernel", "amx"), ("hint", "T1")))
    with pytest.raises(autotune.InvalidCandidate, match=r"cannot run here"):
        gops._native_kernel("mxfp4", True, 4096, "avx512", cand, 8)
    with pytest.raises(native.NativeError, match=r"AMX FP4 GEMV needs "):
        gemv_fp4_amx_kernel.__wrapped__("mxfp4")
    with config.override(isa="avx2"):
        monkeypatch.setattr(fp4_kernel, "_amx_unbuildable", [])
        with pytest.raises(
            native.NativeError,
            match=r"needs the avx512 ISA level \(isa is 'avx2', in force 'avx2'\)",
        ):
            gemv_fp4_amx_kernel.__wrapped__("mxfp4")
