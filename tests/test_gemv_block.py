"""The lane-block FP4 GEMV (:func:`torchport.gemv.fp4_kernel.gemv_fp4_block_kernel`).

Its integer dot products are exact and its activation quantization is the pair-split kernel's
(per 32 elements, ``amax/127``, round half to even), so the two kernels agree to float32
summation order; both stay within the int8-activation error bound of the float64 reference
(``|err| ≤ Σ_k |w_k| · amax_g(k) / 254``). Block scales at the edges of their formats (E8M0
codes 0 = 2⁻¹²⁷, 1, 127, 200; E4M3 subnormal and largest codes) decode exactly. K must be a
multiple of 128 (status 2 otherwise; the tuner then skips the candidate).
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import int8_bound, pack, run
from torchport import autotune, native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel, gemv_fp4_pair_kernel

pytestmark = pytest.mark.skipif(
    native.cpu_info().isa == "scalar", reason="the lane-block kernel needs AVX2"
)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_int8_kernels_quantize_tiny_groups(fmt: str) -> None:
    """Activation groups whose amax is below 127 / FLT_MAX (3.7e-37), subnormal ones included,
    stay within the int8 bound in every int8-activation kernel: 127 / amax was infinite there
    (its products' conversion to int8 undefined) and such a group gave 0."""
    from torchport.gemv.kernels import gemv_i8_kernel

    g = torch.Generator().manual_seed(11)
    pw = pack(fmt, torch.randn(5, 256, generator=g))
    x = torch.randn(2, 256, generator=g)
    x[0] *= 1e-38
    x[1] *= 1e-39
    x[1, 32:64] *= 1e-2  # a subnormal group
    wd = gops.dequantize_packed(pw)
    ref = gops.gemv_reference(x.double(), wd)
    # a subnormal group scale amax / 127 is rounded to a multiple of 2^-149
    tol = int8_bound(x, wd) * 1.001 + wd.double().abs().sum(1) * 127 * 2.0**-149
    isa = native.cpu_info().isa
    for kern in (gemv_i8_kernel, gemv_fp4_pair_kernel, gemv_fp4_block_kernel):
        out = run(kern(fmt, isa), x, pw, threads=1)
        assert bool(((out.double() - ref).abs() <= tol).all()), kern.__name__
        assert bool((out != 0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(1, 128), (7, 384), (130, 4096)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])  # from 4 rows: two weight rows at once
def test_block_kernel_matches_pair_kernel_and_bound(fmt: str, n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k + rows)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g) * 2
    bias = torch.randn(n, generator=g)
    isa = native.cpu_info().isa
    out = run(gemv_fp4_block_kernel(fmt, isa), x, pw, bias)
    pair = run(gemv_fp4_pair_kernel(fmt, isa), x, pw, bias)
    assert torch.allclose(out, pair, rtol=1e-5, atol=1e-5)
    wd = gops.dequantize_packed(pw)
    ref = gops.gemv_reference(x.double(), wd, bias)
    assert bool(((out.double() - ref).abs() <= int8_bound(x, wd) * 1.001 + 1e-5).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [4, 5, 8])
def test_two_row_path_keeps_every_rows_bits(fmt: str, rows: int) -> None:
    """From four activation rows the AVX-512 kernel streams two weight rows at once, pairing rows
    by position: the weight without its first row pairs every row differently (and the odd last
    row runs alone), yet each output row keeps its bits, on one and two threads."""
    g = torch.Generator().manual_seed(rows)
    pw = pack(fmt, torch.randn(37, 512, generator=g))
    x = torch.randn(rows, 512, generator=g)
    bias = torch.randn(37, generator=g)
    shifted = gops.PackedWeight(
        pw.fmt,
        pw.data[1:],
        pw.scales.reshape(37, -1)[1:].reshape(-1),
        pw.rowscale,
        pw.pts,
        36,
        pw.k,
        pw.int8,
    )
    kern = gemv_fp4_block_kernel(fmt, native.cpu_info().isa)
    full = run(kern, x, pw, bias)
    assert torch.equal(full, run(kern, x, pw, bias, threads=1))
    assert torch.equal(full[:, 1:], run(kern, x, shifted, bias[1:]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [3, 4, 5, 6, 7])
def test_shared_corrections_keep_every_rows_bits(fmt: str, rows: int) -> None:
    """From three activation rows (AVX-512) the offset correction comes from the weights, shared
    by the rows (activations ``q + 128``), instead of each row's own ``-12 * sum q``: the int32
    lanes are the same, so every row's output keeps the bits it has when run alone. Rows with a
    zero 128-chunk, a single outlier (``q = +-127`` next to zeros) and all-negative values."""
    g = torch.Generator().manual_seed(rows + 17)
    k = 512
    pw = pack(fmt, torch.randn(45, k, generator=g))  # N * K * min(B, 4) >= 65536: two threads
    x = torch.randn(rows, k, generator=g)
    x[0, 128:256] = 0.0
    x[1, :] = 0.0
    x[1, 5], x[1, 300] = 1e3, -1e3
    x[2] = -x[2].abs()
    bias = torch.randn(45, generator=g)
    kern = gemv_fp4_block_kernel(fmt, native.cpu_info().isa)
    together = run(kern, x, pw, bias)
    assert torch.equal(together, run(kern, x, pw, bias, threads=1))
    for i in range(rows):
        assert torch.equal(together[i], run(kern, x[i : i + 1], pw, bias)[0]), i


@pytest.mark.parametrize(
    ("fmt", "codes"),
    [
        ("mxfp4", [0, 1, 2, 100, 127, 130, 200]),  # E8M0: 2^-127 (subnormal float32) ... 2^73
        ("nvfp4", [0x01, 0x05, 0x07, 0x08, 0x38, 0x70, 0x7E]),  # E4M3 subnormals ... 448
    ],
)
def test_block_kernel_decodes_edge_scales(fmt: str, codes: list[int]) -> None:
    n, k = 9, 256
    g = torch.Generator().manual_seed(3)
    pw0 = pack(fmt, torch.randn(n, k, generator=g))
    pick = torch.randint(0, len(codes), pw0.scales.shape, generator=g)
    scales = torch.tensor(codes, dtype=torch.uint8)[pick].contiguous()
    pw = gops.PackedWeight(fmt, pw0.data, scales, pw0.rowscale, 1.0, n, k, pw0.int8)
    x = torch.randn(3, k, generator=g)
    isa = native.cpu_info().isa
    out = run(gemv_fp4_block_kernel(fmt, isa), x, pw)
    pair = run(gemv_fp4_pair_kernel(fmt, isa), x, pw)
    wd = gops.dequantize_packed(pw)
    ref = gops.gemv_reference(x.double(), wd)
    tiny = 1e-30 * (x.double().abs() @ wd.double().abs().T) + 1e-37  # 2^-127-scaled blocks
    assert bool(((out.double() - ref).abs() <= int8_bound(x, wd) * 1.001 + tiny).all())
    assert torch.allclose(out, pair, rtol=1e-5, atol=1e-30)


@pytest.mark.skipif(
    native.cpu_info().isa != "avx512" or not native.cpu_info().has_vnni,
    reason="K blocks: the AVX-512 VNNI build",
)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k"), [(21, 11008), (9, 10880)], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_k_blocks_keep_bits(fmt: str, n: int, k: int, rows: int) -> None:
    """With per-row corrections (one or two rows) K runs in blocks where the prepared
    activations exceed 20 KB (2 K bytes a row: K > 10240): the bits of K in one piece, on one and
    two threads, for blocks of 32, 2 or 3 (rounded to 2) 128-chunks, and an odd number of chunks
    per row (K = 10880). Three and five rows (shared corrections) keep one piece. The blocks run
    weight rows in pairs: without the first row every pair changes (and the last of an odd count
    runs alone), the bits do not."""
    g = torch.Generator().manual_seed(n + k + rows)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    whole = run(gemv_fp4_block_kernel(fmt, "avx512", 2048, hint="NTA", xblock=0), x, pw, bias, 1)
    for xblock, threads in ((None, 2), (512, 1), (768, 2)):
        kern = gemv_fp4_block_kernel(fmt, "avx512", 2048, hint="NTA", xblock=xblock)
        assert torch.equal(run(kern, x, pw, bias, threads), whole), (xblock, threads)
    pw1 = gops.PackedWeight(
        pw.fmt, pw.data[1:], pw.scales[1:], pw.rowscale, pw.pts, n - 1, k, pw.int8
    )
    kern = gemv_fp4_block_kernel(fmt, "avx512", 2048, hint="NTA", xblock=512)
    assert torch.equal(run(kern, x, pw1, bias[1:], 1), whole[:, 1:])


def test_block_kernel_rejects_negative_xblock() -> None:
    with pytest.raises(ValueError, match=r"xblock must be >= 0 bytes, got -3"):
        gemv_fp4_block_kernel("nvfp4", "avx2", xblock=-3)


def test_block_kernel_rejects_k_not_multiple_of_128() -> None:
    pw = pack("nvfp4", torch.randn(4, 192))
    out = torch.empty(1, 4)
    kern = gemv_fp4_block_kernel("nvfp4", native.cpu_info().isa)
    status = kern.call_unchecked(
        torch.randn(1, 192).data_ptr(),
        1,
        192,
        pw.data.data_ptr(),
        pw.scales.data_ptr(),
        0,
        pw.pts,
        0,
        0,
        out.data_ptr(),
        4,
        1,
    )
    assert status == 2
    with pytest.raises(autotune.InvalidCandidate, match="K % 128 == 0 \\(K=192\\)"):
        gops._native_kernel(
            "nvfp4", True, 192, native.cpu_info().isa, gops.candidates("nvfp4", True)[1]
        )


def test_block_kernel_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match=r"must be one of .*got 'mxfp8_e4m3'"):
        gemv_fp4_block_kernel("mxfp8_e4m3", native.cpu_info().isa)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k", "rows"), [(1, 128, 1), (300, 4096, 1), (37, 640, 5)], ids=str)
def test_block_kernel_prefetch_hint_keeps_bits(fmt: str, n: int, k: int, rows: int) -> None:
    """The prefetch hint and distance change only how the weights stream in, never the result."""
    g = torch.Generator().manual_seed(n + k + rows)
    pw = pack(fmt, torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g)
    isa = native.cpu_info().isa
    t0 = run(gemv_fp4_block_kernel(fmt, isa, 4096, hint="T0"), x, pw)
    for pf, hint in ((1024, "NTA"), (2048, "NTA"), (2048, "T1"), (3072, "T1")):
        assert torch.equal(run(gemv_fp4_block_kernel(fmt, isa, pf, hint=hint), x, pw), t0)


@pytest.mark.parametrize("hint", ["T0", "NTA", "T1"])
def test_block_kernel_hint_reaches_the_prefetch(monkeypatch, hint: str) -> None:
    """The hint is the weight prefetch's locality in the built source (results cannot show it)."""
    seen: list[str] = []
    build = native.build
    monkeypatch.setattr(native, "build", lambda src, **kw: seen.append(src) or build(src, **kw))
    gemv_fp4_block_kernel("mxfp4", native.cpu_info().isa, 1536, hint=hint)  # 1536: uncached
    src = seen[0]  # the kernel's own library (the argument list may build another)
    # the row's own stream ahead (the next row group's L2 prefetches are T1 whatever the hint)
    own = "_mm_prefetch(pfa + r * WR + (c) * 64, _MM_HINT_"
    assert f"{own}{hint});" in src
    assert not any(f"{own}{o});" in src for o in {"T0", "NTA", "T1"} - {hint})


def test_block_kernel_rejects_unknown_hint() -> None:
    with pytest.raises(ValueError, match=r"hint must be one of \('T0', 'NTA', 'T1'\), got 'T2'"):
        gemv_fp4_block_kernel("nvfp4", native.cpu_info().isa, hint="T2")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("hint", ["T0", "NTA", "T1"])
def test_block_kernel_avx512_builds(fmt: str, hint: str) -> None:
    """The AVX-512 + VNNI build compiles with either prefetch hint (cannot run on every machine)."""
    gemv_fp4_block_kernel(fmt, "avx512", 2048, hint=hint)
