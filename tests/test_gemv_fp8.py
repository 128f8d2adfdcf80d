"""The integer-shift E4M3 GEMV (torchport.gemv.fp8_kernel) vs the float64 reference.

Every E4M3 code (subnormals included) is decoded exactly, for activations of any magnitude (the
per-row power-of-two rescaling), with denormals-are-zero set by the caller, with one to eight
rows.
"""

from __future__ import annotations

import pytest
import torch

from torchport import native
from torchport.gemv import gemv, gemv_reference
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.lowp import Float8Tensor

pytestmark = pytest.mark.skipif(
    native.cpu_info().isa == "scalar", reason="the shift-decode kernel is AVX2 only"
)


def _all_codes_weight(n: int, k: int, seed: int) -> Float8Tensor:
    """An E4M3 weight whose bytes cycle through every finite code (NaN codes 0x7F/0xFF never
    occur in quantized data), with random per-row scales."""
    g = torch.Generator().manual_seed(seed)
    w = Float8Tensor.from_float(torch.randn(n, k, generator=g), torch.float8_e4m3fn, "row")
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    perm = torch.randint(0, codes.numel(), (n, k), generator=g)
    w.qdata.view(torch.uint8).copy_(codes[perm])
    return w


def _run(x: torch.Tensor, w: Float8Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kern = gemv_fp8_shift_kernel(native.cpu_info().isa, 2048)
    pw = w.gemv_pack()
    out = torch.empty(x.shape[0], pw.n)
    b = bias if bias is not None else torch.empty(0)
    status = kern(x, x.shape[0], pw.k, pw.data, pw.scales, pw.rowscale, pw.pts, b, int(bias is not None), out, pw.n, 2)  # fmt: skip
    assert status == 0
    return out


def _check(out: torch.Tensor, x: torch.Tensor, w: Float8Tensor, bias: torch.Tensor | None):
    wd = w.dequantize()
    ref = gemv_reference(x, wd, bias).double()
    mag = x.double().abs() @ wd.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    err = (out.double() - ref).abs()
    # float32 summation of exact products; tiny absolute term for rows that cancel to ~0
    assert bool((err <= 1e-5 * mag + 1e-30).all()), float((err / (mag + 1e-300)).max())


@pytest.mark.parametrize("shape", [(1, 32), (17, 96), (131, 1061), (64, 4096)], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30, 3e-39], ids=["1", "1e-30", "1e30", "denormal"])
def test_shift_kernel_every_code_any_magnitude(shape, rows, scale) -> None:
    n, k = shape
    w = _all_codes_weight(n, k, seed=n + k)
    torch.manual_seed(rows)
    x = torch.randn(rows, k) * scale
    bias = torch.randn(n) * scale if rows % 2 else None
    _check(_run(x, w, bias), x, w, bias)


def test_shift_kernel_rows_of_different_magnitudes() -> None:
    """Each activation row gets its own power-of-two scale: a tiny row beside a huge one keeps
    its precision."""
    w = _all_codes_weight(40, 256, seed=1)
    mags = torch.tensor([1e30, 1e-30, 1.0, 3e-39, 1e-5, 7.0, 1e20, 0.5]).reshape(8, 1)
    x = torch.randn(8, 256) * mags  # eight rows: two groups of four in the kernel
    _check(_run(x, w, None), x, w, None)


def test_shift_kernel_ignores_caller_denormals_are_zero() -> None:
    """Subnormal codes are float32 subnormals inside the kernel; it clears DAZ/FTZ for the call."""
    w = Float8Tensor.from_float(torch.ones(8, 64), torch.float8_e4m3fn, "row")
    w.qdata.view(torch.uint8).copy_(torch.randint(1, 8, (8, 64), dtype=torch.uint8))  # subnormal
    x = torch.randn(1, 64)
    old = torch.set_flush_denormal(True)
    try:
        out = _run(x, w, None)
    finally:
        torch.set_flush_denormal(False)
    assert old  # the CPU supports flushing, so the case was exercised
    _check(out, x, w, None)
    assert bool((out != 0).all())


def test_shift_kernel_zero_and_nonfinite_activations() -> None:
    w = _all_codes_weight(9, 64, seed=2)
    zero = _run(torch.zeros(1, 64), w, None)
    assert bool((zero == 0).all())
    x = torch.randn(1, 64)
    x[0, 5] = float("inf")
    out = _run(x, w, None)
    ref = gemv_reference(x, w.dequantize(), None)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_gemv_uses_shift_kernel_results_for_e4m3() -> None:
    """The public gemv on an E4M3 weight agrees with the shift kernel's tolerance (the tuner's
    default for small problems is the shift kernel)."""
    w = _all_codes_weight(33, 160, seed=3)
    x = torch.randn(2, 160)
    _check(gemv(x, w), x, w, None)


def test_several_rows_take_the_avx2_build_on_avx512() -> None:
    """The shift candidates run the AVX-512 build for one activation row; two or more rows take
    the AVX2 build (measured faster there in one piece), which the caller's plan then holds (the
    shift512 candidate offers the AVX-512 build's paired K blocks beside it)."""
    from torchport.gemv import ops as gops

    cand = next(c for c in gops.candidates("fp8_e4m3") if c.param("kernel") == "shift")
    pf = cand.param("prefetch")
    kern = gops._native_kernel("fp8_e4m3", False, 256, "avx512", cand, rows=4)
    assert kern is gemv_fp8_shift_kernel("avx2", pf, hint=cand.param("hint"))
    assert gops._native_kernel("fp8_e4m3", False, 256, "avx2", cand, rows=1) is kern


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(37, 4096), (19, 1061), (300, 2048)], ids=str)
@pytest.mark.parametrize("scale", [1.0, 3e-39], ids=["1", "denormal"])
@pytest.mark.parametrize("build", ["native", "avx2"])  # avx2: what several rows run on AVX-512
def test_k_blocks_keep_bits(rows: int, n: int, k: int, scale: float, build: str) -> None:
    """From two activation rows K runs in blocks (the rows' activations beyond 8 KB, or 1 KB
    here): every group of two to four rows keeps the bits of K in one piece, a lone fifth row
    meets the reference, on one and two threads; K not a multiple of the 32/64-weight step."""
    w = _all_codes_weight(n, k, seed=n + k + rows)
    pw = w.gemv_pack()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * scale
    bias = torch.randn(n, generator=g) * scale
    isa = native.cpu_info().isa if build == "native" else "avx2"

    def run(xblock: int, threads: int = 2) -> torch.Tensor:
        kern = gemv_fp8_shift_kernel(isa, 2048, hint="NTA", xblock=xblock)
        out = torch.empty(rows, n)
        st = kern(x, rows, k, pw.data, pw.scales, pw.rowscale, pw.pts, bias, 1, out, n, threads)
        assert st == 0
        return out

    whole = run(0, threads=1)
    for xblock, threads in ((1024, 1), (1024, 2), (16384, 2)):
        out = run(xblock, threads)
        _check(out, x, w, bias)
        if rows % 4 != 1:
            assert torch.equal(out, whole), (xblock, threads)
        else:
            assert torch.equal(out[:-1], whole[:-1]), (xblock, threads)
    if rows <= 4:  # the AVX-512 blocks pair weight rows: without the first row every pair changes
        kern = gemv_fp8_shift_kernel(isa, 2048, hint="NTA", xblock=1024)
        out = torch.empty(rows, n - 1)
        st = kern(
            x, rows, k, pw.data[1:], pw.scales, pw.rowscale[1:], pw.pts, bias[1:], 1, out, n - 1, 1
        )
        assert st == 0
        assert torch.equal(out, whole[:, 1:])


@pytest.mark.skipif(native.cpu_info().isa != "avx512", reason="one-row blocks: AVX-512 build")
@pytest.mark.parametrize(("n", "k"), [(37, 4096), (19, 1061), (21, 11008)], ids=str)
@pytest.mark.parametrize("scale", [1.0, 3e-39], ids=["1", "denormal"])
def test_one_row_k_blocks_keep_bits(n: int, k: int, scale: float) -> None:
    """The AVX-512 one-row build runs K in blocks from one activation row (its prescaled row
    beyond 8 KB: K > 2048, or 1 KB here) with the one-row loop's four chains: the bits of K in
    one piece, on one and two threads."""
    w = _all_codes_weight(n, k, seed=n + k)
    pw = w.gemv_pack()
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g) * scale
    bias = torch.randn(n, generator=g) * scale
    isa = native.cpu_info().isa

    def run(xblock: int | None, threads: int = 2) -> torch.Tensor:
        kern = gemv_fp8_shift_kernel(isa, 2048, hint="NTA", xblock=xblock)
        out = torch.empty(1, n)
        st = kern(x, 1, k, pw.data, pw.scales, pw.rowscale, pw.pts, bias, 1, out, n, threads)
        assert st == 0
        return out

    whole = run(0, threads=1)
    _check(whole, x, w, bias)
    for xblock, threads in ((1024, 1), (1024, 2), (None, 2)):
        assert torch.equal(run(xblock, threads), whole), (xblock, threads)


def test_shift_kernel_rejects_negative_xblock() -> None:
    with pytest.raises(ValueError, match=r"xblock must be >= 0 bytes, got -1"):
        gemv_fp8_shift_kernel(native.cpu_info().isa, 2048, xblock=-1)


@pytest.mark.parametrize(("n", "k", "rows"), [(1, 32, 1), (300, 4096, 1), (37, 1061, 3)], ids=str)
def test_shift_kernel_prefetch_hint_keeps_bits(n: int, k: int, rows: int) -> None:
    """The prefetch hint and distance change only how the weights stream in, never the result."""
    pw = _all_codes_weight(n, k, seed=n + k).gemv_pack()
    x = torch.randn(rows, k)
    isa = native.cpu_info().isa

    def run(kern) -> torch.Tensor:
        out = torch.empty(rows, n)
        st = kern(x, rows, k, pw.data, pw.scales, pw.rowscale, pw.pts, torch.empty(0), 0, out, n, 2)
        assert st == 0
        return out

    t0 = run(gemv_fp8_shift_kernel(isa, 8192, hint="T0"))
    for pf in (1024, 2048):
        assert torch.equal(run(gemv_fp8_shift_kernel(isa, pf, hint="NTA")), t0)


@pytest.mark.parametrize("hint", ["T0", "NTA"])
def test_shift_kernel_hint_reaches_the_prefetch(monkeypatch, hint: str) -> None:
    """The hint is the weight prefetch's locality in the built source (results cannot show it)."""
    seen: list[str] = []
    build = native.build
    monkeypatch.setattr(native, "build", lambda src, **kw: seen.append(src) or build(src, **kw))
    gemv_fp8_shift_kernel(native.cpu_info().isa, 1536, hint=hint)  # 1536: not cached yet
    src = seen[0]  # the kernel's own library (the argument list may build another)
    other = "NTA" if hint == "T0" else "T0"
    assert f"_MM_HINT_{hint});" in src and f"_MM_HINT_{other});" not in src


def test_shift_kernel_rejects_unknown_hint() -> None:
    with pytest.raises(ValueError, match=r"hint must be one of \('T0', 'NTA', 'T1'\), got 'nta'"):
        gemv_fp8_shift_kernel(native.cpu_info().isa, hint="nta")


@pytest.mark.parametrize("hint", ["T0", "NTA", "T1"])
def test_shift_kernel_avx512_builds(hint: str) -> None:
    """The AVX-512 build compiles with either prefetch hint (cannot run on every machine)."""
    gemv_fp8_shift_kernel("avx512", 2048, hint=hint)


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("shape", [(1, 32), (3, 100), (5, 1061), (17, 96), (131, 4096)], ids=str)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 3e-39], ids=["1", "1e-30", "denormal"])
def test_row_unrolled_shift_kernel_matches_reference(rows, shape, batch, scale) -> None:
    """Two or four weight rows per step (one activation row; more rows take the one-row loop):
    every code decoded exactly, N and K not multiples of the unroll, the 64-byte step or 32."""
    n, k = shape
    w = _all_codes_weight(n, k, seed=n * k + rows)
    torch.manual_seed(batch + rows)
    x = torch.randn(batch, k) * scale
    bias = torch.randn(n) * scale
    kern = gemv_fp8_shift_kernel(native.cpu_info().isa, 2048, hint="NTA", rows=rows)
    pw = w.gemv_pack()
    out = torch.empty(batch, n)
    st = kern(x, batch, k, pw.data, pw.scales, pw.rowscale, pw.pts, bias, 1, out, n, 2)
    assert st == 0
    _check(out, x, w, bias)


def test_row_unrolled_shift_kernel_threads_agree() -> None:
    """Each output row is computed by one thread in one order: any thread count, same bits."""
    pw = _all_codes_weight(261, 320, seed=5).gemv_pack()  # past the one-thread size
    x = torch.randn(1, 320)
    kern = gemv_fp8_shift_kernel(native.cpu_info().isa, 2048, hint="NTA", rows=4)
    outs = []
    for nt in (1, 2, 3):
        out = torch.empty(1, 261)
        st = kern(
            x, 1, 320, pw.data, pw.scales, pw.rowscale, pw.pts, torch.empty(0), 0, out, 261, nt
        )
        assert st == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_shift_kernel_rejects_unsupported_rows() -> None:
    with pytest.raises(ValueError, match=r"rows must be one of \(1, 2, 4\), got 3"):
        gemv_fp8_shift_kernel(native.cpu_info().isa, rows=3)


@pytest.mark.parametrize("rows", [2, 4])
def test_row_unrolled_shift_kernel_avx512_builds(rows: int) -> None:
    """The AVX-512 build of the row-unrolled loop compiles (cannot run on every machine)."""
    gemv_fp8_shift_kernel("avx512", 2048, hint="NTA", rows=rows)


def test_tuner_offers_the_row_unrolled_kernel_for_one_activation_row() -> None:
    """shift4 candidates follow the one-row shift ones; with several activation rows they are
    invalid (the kernel would run its one-row loop: the same as the shift candidate)."""
    from torchport import autotune
    from torchport.gemv import ops as gops

    names = [c.param("kernel") for c in gops.candidates("fp8_e4m3")]
    assert names.index("shift4") > max(i for i, n in enumerate(names) if n == "shift")
    cand = next(c for c in gops.candidates("fp8_e4m3") if c.param("kernel") == "shift4")
    isa = native.cpu_info().isa
    kern = gops._native_kernel("fp8_e4m3", False, 256, isa, cand, rows=1)
    assert kern is gemv_fp8_shift_kernel(
        isa, cand.param("prefetch"), hint=cand.param("hint"), rows=4
    )
    with pytest.raises(autotune.InvalidCandidate, match="one activation row"):
        gops._native_kernel("fp8_e4m3", False, 256, isa, cand, rows=2)
    assert all(c.param("kernel") != "shift4" for c in gops.candidates("fp8_e5m2"))


def test_tuner_offers_the_paired_avx512_shift_kernel_for_two_to_four_rows() -> None:
    """shift512 (the AVX-512 build, its K blocks pairing weight rows) follows the shift4
    candidates; it is valid only on AVX-512 for two to four activation rows whose activations
    run in K blocks (others take the AVX2 build through the shift candidates)."""
    from torchport import autotune
    from torchport.gemv import ops as gops

    names = [c.param("kernel") for c in gops.candidates("fp8_e4m3")]
    assert names.index("shift512") > max(i for i, n in enumerate(names) if n == "shift4")
    cand = next(c for c in gops.candidates("fp8_e4m3") if c.param("kernel") == "shift512")
    for rows in (1, 5):
        with pytest.raises(autotune.InvalidCandidate, match="two to four activation rows"):
            gops._native_kernel("fp8_e4m3", False, 4096, "avx512", cand, rows=rows)
    with pytest.raises(autotune.InvalidCandidate, match="AVX-512"):
        gops._native_kernel("fp8_e4m3", False, 4096, "avx2", cand, rows=2)
    with pytest.raises(autotune.InvalidCandidate, match="E4M3"):
        gops._native_kernel("fp8_e5m2", False, 4096, "avx512", cand, rows=2)
    with pytest.raises(autotune.InvalidCandidate, match="only in K blocks"):
        gops._native_kernel("fp8_e4m3", False, 1024, "avx512", cand, rows=2)  # 8 KB: one piece
    if native.cpu_info().isa == "avx512":
        kern = gops._native_kernel("fp8_e4m3", False, 4096, "avx512", cand, rows=4)
        assert kern is gemv_fp8_shift_kernel(
            "avx512", cand.param("prefetch"), hint=cand.param("hint")
        )
