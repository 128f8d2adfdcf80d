"""The AMX-BF16 build of the pair-dot GEMV (``gemv_bf16_dp_kernel(..., amx=True)``).

Per 16 weight rows and 64 weights the two bf16 weight vectors of the pair-dot kernel's decode
(E4M3 by table, bf16 as loaded) become two A tiles, the narrowed bf16 activations B tiles of 16
k-pairs by one column per activation row, and ``tdpbf16ps`` accumulates one C tile over all of
K. The products are exact and the sums float32 (subnormal inputs and results flushed, as
``vdpbf16ps`` does), so the results meet the float64 reference within the float kernel's
tolerance, as the ``vdpbf16ps`` kernel's do (the order of the float32 sums differs); the same
bits on one and two threads and alone or in a batch, for K of any size (zero-padded tail steps),
one to eight rows (the tile takes sixteen: status 7 beyond), with and without bias. E4M3 weights
meeting float32 activations split each into three bf16 parts that add up to it exactly (one to
ten rows, a second C tile from six; status 4 beyond), within the same bound; activations that are
not finite or reach 2^119 go to the float kernel (its bits); bf16 weights hand float32
activations to the float kernel. The tuner offers the build for E4M3 weights from four
bf16-valued activation rows or three float32 ones, and bf16 weights from five.
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import check_float_bound, only_native_kernel
from torchport import autotune, native
from torchport.gemv import bf16_kernel
from torchport.gemv import ops as gops
from torchport.gemv.bf16_kernel import amx_dp_ready, gemv_bf16_dp_kernel
from torchport.gemv.kernels import NONFINITE_STATUS, gemv_kernel
from torchport.lowp import Float8Tensor

needs_amx = pytest.mark.skipif(not amx_dp_ready(), reason="needs AMX-BF16 granted by the OS")


def _pack(weights: str, w: torch.Tensor) -> gops.PackedWeight:
    if weights == "fp8_e4m3":
        return Float8Tensor.from_float(w).gemv_pack()
    return gops.pack_dense(w.bfloat16())


def _run(kern, x: torch.Tensor, pw: gops.PackedWeight, bias=None, threads: int = 2):
    out = torch.empty(x.shape[0], pw.n)
    gops._launch(kern, x.float().contiguous(), pw, bias, out, threads)
    return out


_check = check_float_bound


@needs_amx
@pytest.mark.parametrize("weights", ["fp8_e4m3", "bf16"])
@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 31), (17, 64), (40, 100), (131, 1061), (300, 4096), (20, 11008)], ids=str
)
def test_matches_reference_and_the_pair_dot_kernel(weights: str, shape) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, ::7] *= 1e-4  # subnormal E4M3 codes among the normal ones
    pw = _pack(weights, w)
    amx = gemv_bf16_dp_kernel("avx512", hint="T1", weights=weights, amx=True)
    dp = gemv_bf16_dp_kernel("avx512", 2048, hint="T1", weights=weights)
    for rows in (1, 2, 4, 5, 8):
        x = torch.randn(rows, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g) if rows % 2 else None
        out = _run(amx, x, pw, bias)
        _check(out, x, pw, bias)
        _check(_run(dp, x, pw, bias), x, pw, bias)  # the two within the same float32 bound
        assert torch.equal(out, _run(amx, x, pw, bias, threads=1)), rows
        one = torch.cat([_run(amx, x[i : i + 1], pw, bias) for i in range(rows)])
        assert torch.equal(out, one), rows  # a row's bits do not depend on the batch


@needs_amx
def test_every_e4m3_code_decodes_exactly() -> None:
    """Every column of the weight holds all 256 codes (NaN codes replaced): a one-hot activation
    reads column j back exactly (times the row scale), in whole steps and the tail of K = 100;
    one NaN code gives its row NaN."""
    k = 100
    idx = (torch.arange(256)[:, None] + 37 * torch.arange(k)[None, :]) % 256
    idx = idx.masked_fill((idx & 0x7F) == 0x7F, 0)
    data = idx.to(torch.int32).to(torch.uint8).contiguous()
    empty = torch.empty(0, dtype=torch.uint8)
    pw = gops.PackedWeight("fp8_e4m3", data, empty, torch.full((256,), 0.5), 1.0, 256, k, False)
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True)
    for j in (0, 7, 8, 15, 16, 31, 33, 47, 56, 63, 64, 70, 99):
        x = torch.zeros(4, k)
        x[2, j] = 1.0
        assert torch.equal(_run(kern, x, pw)[2], table[idx[:, j]] * 0.5), j
    data[3, 40] = 0x7F
    out = _run(kern, torch.ones(4, k), pw)
    assert bool(out[:, 3].isnan().all()) and int(out.isnan().sum()) == 4


@needs_amx
@pytest.mark.parametrize("shape", [(3, 31), (40, 100), (131, 1061), (20, 11008)], ids=str)
def test_float_activations_split_into_three_parts_for_e4m3(shape) -> None:
    """Float32 activations (not bf16 values) on E4M3 weights: within the float bound for one to
    ten rows (six and up: the second C tile), the same bits on one and two threads and alone or
    in a batch."""
    n, k = shape
    g = torch.Generator().manual_seed(n + 7 * k)
    pw = _pack("fp8_e4m3", torch.randn(n, k, generator=g) * 0.05)
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True)
    for rows in (1, 2, 5, 6, 10):
        x = torch.randn(rows, k, generator=g)
        x[:, ::5] *= 1e-20  # parts far below their activation's leading one
        bias = torch.randn(n, generator=g) if rows % 2 else None
        out = _run(kern, x, pw, bias)
        _check(out, x, pw, bias)
        assert torch.equal(out, _run(kern, x, pw, bias, threads=1)), rows
        one = torch.cat([_run(kern, x[i : i + 1], pw, bias) for i in range(rows)])
        assert torch.equal(out, one), rows


@needs_amx
def test_a_split_activation_times_a_weight_is_the_float_kernels_product() -> None:
    """One-hot activation rows whose value is no bf16 number: each result is that value times
    one weight, which the three exact parts give rounded once, as the float kernel does."""
    k, n = 200, 24
    g = torch.Generator().manual_seed(3)
    pw = _pack("fp8_e4m3", torch.randn(n, k, generator=g))
    x = torch.zeros(8, k)
    for i in range(8):
        x[i, 25 * i + 3] = float(torch.randn(1, generator=g)) * 10.0 ** (i - 4)
    assert not torch.equal(x, x.bfloat16().float())
    got = _run(gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True), x, pw)
    assert torch.equal(got, _run(gemv_kernel("fp8_e4m3", "avx512"), x, pw))


@needs_amx
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 2.0**119, -3e38])
def test_float_activations_it_cannot_split_go_to_the_float_kernel(bad: float) -> None:
    """A non-finite activation, or one of 2^119 or more (a bf16 part times a weight could overflow): the
    kernel hands the call back (nothing written) and the float kernel's bits come out."""
    pw = _pack("fp8_e4m3", torch.randn(16, 128))
    x = torch.randn(3, 128)
    x[1, 9] = bad
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True)
    out = torch.full((3, 16), 7.0)
    raw = (x.data_ptr(), 3, 128, pw.data.data_ptr(), pw.scales.data_ptr(), pw.rowscale.data_ptr(),
           pw.pts, 0, 0, out.data_ptr(), 16, 2)  # fmt: skip
    assert kern.call_unchecked(*raw) == NONFINITE_STATUS
    assert bool((out == 7.0).all())
    assert kern.float_twin() is gemv_kernel("fp8_e4m3", "avx512")
    want = _run(gemv_kernel("fp8_e4m3", "avx512"), x, pw)
    assert torch.equal(_run(kern, x, pw).view(torch.int32), want.view(torch.int32))


@needs_amx
def test_more_float_rows_than_two_tiles_refused_and_bf16_weights_floated() -> None:
    x = torch.randn(11, 64)  # three parts of eleven rows: 33 columns
    pw8 = _pack("fp8_e4m3", torch.randn(8, 64))
    with pytest.raises(native.NativeError, match="not bf16 values"):
        _run(gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True), x, pw8)
    pw = _pack("bf16", torch.randn(40, 300))
    x = torch.randn(5, 300)
    want = _run(gemv_kernel("bf16", "avx512", 512, 0), x, pw)
    assert torch.equal(_run(gemv_bf16_dp_kernel("avx512", weights="bf16", amx=True), x, pw), want)


@needs_amx
@pytest.mark.parametrize("weights", ["fp8_e4m3", "bf16"])
def test_bf16io_entry_is_the_float_entry_then_a_cast(weights: str) -> None:
    if not gops._cast_nan_is_ffff():
        pytest.skip("torch's CPU cast writes NaN as 0x7fc0 here (ATEN_CPU_CAPABILITY=default)")
    g = torch.Generator().manual_seed(9)
    pw = _pack(weights, torch.randn(37, 1000, generator=g) * 0.1)
    kern = gemv_bf16_dp_kernel("avx512", weights=weights, amx=True)
    bias = torch.randn(37, generator=g)
    for rows in (1, 4, 8):
        x = torch.randn(rows, 1000, generator=g).bfloat16()
        x[0, 3] = float("nan")
        full = _run(kern, x, pw, bias)
        out = torch.empty(rows, 37, dtype=torch.bfloat16)
        st = kern.bf16io(
            x, rows, 1000, pw.data, pw.scales, pw.rowscale, pw.pts, bias, 1, out, 37, 2
        )
        assert st == 0
        assert torch.equal(out.view(torch.int16), full.bfloat16().view(torch.int16)), rows


@needs_amx
@pytest.mark.parametrize("weights", ["fp8_e4m3", "bf16"])
def test_up_to_sixteen_rows_odd_k_and_a_static_split(weights: str) -> None:
    """9 to 16 activation rows (16: the tile's full 64-byte rows), K with a partial last step
    (bf16: the activation tiles' zero padding past the narrowed rows), one static split over
    two threads (claims aligned to 8 rows, so 16-row groups end part-way)."""
    g = torch.Generator().manual_seed(21)
    n, k = 70, 1050
    pw = _pack(weights, torch.randn(n, k, generator=g) * 0.1)
    for rows in (9, 12, 16):
        x = torch.randn(rows, k, generator=g).bfloat16()
        out = _run(gemv_bf16_dp_kernel("avx512", weights=weights, amx=True), x, pw)
        _check(out, x, pw)
        static = gemv_bf16_dp_kernel("avx512", chunk=0, weights=weights, amx=True)
        assert torch.equal(_run(static, x, pw), out), rows


@needs_amx
@pytest.mark.parametrize("rows", [0, 17])
def test_rows_outside_the_tile_are_status_7(rows: int) -> None:
    pw = _pack("fp8_e4m3", torch.randn(8, 64))
    x, out = torch.randn(max(rows, 1), 64).bfloat16().float(), torch.empty(max(rows, 1), 8)
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", amx=True)
    args = (
        x.data_ptr(),
        rows,
        64,
        pw.data.data_ptr(),
        pw.scales.data_ptr(),
        pw.rowscale.data_ptr(),
    )
    assert kern.call_unchecked(*args, pw.pts, 0, 0, out.data_ptr(), 8, 1) == 7
    if rows:
        with pytest.raises(native.NativeError, match=r"takes 1 to 16 activation rows .* got 17"):
            _run(kern, x, pw)


@needs_amx
def test_gemv_packed_runs_the_tuned_amx_plan_on_float_activations(fresh_cache, monkeypatch) -> None:
    """E4M3 weights, float32 activations, the AMX build the one native candidate: three and
    eight rows plan it (eight: two C tiles), the results meet the reference and the settled call
    gives the same bits."""
    only_native_kernel(monkeypatch, "dpamx")
    try:
        g = torch.Generator().manual_seed(5)
        pw = _pack("fp8_e4m3", torch.randn(700, 640, generator=g) * 0.1)
        for rows in (3, 8):
            x = torch.randn(rows, 640, generator=g)
            out = gops.gemv_packed(x, pw)
            assert gops.plan_for(pw, rows, False).candidate.param("kernel") == "dpamx"
            _check(out, x, pw)
            assert torch.equal(gops.gemv_packed(x, pw), out)
    finally:
        gops._PLANS.clear()


@needs_amx
def test_gemv_packed_runs_the_tuned_amx_plan(fresh_cache, monkeypatch) -> None:
    """With the AMX build the one native candidate, a bfloat16 activation tensor at four and
    eight rows plans it, meets the reference and gives the same bits on the settled call."""
    only_native_kernel(monkeypatch, "dpamx")
    try:
        g = torch.Generator().manual_seed(4)
        pw = _pack("fp8_e4m3", torch.randn(700, 640, generator=g) * 0.1)
        for rows in (4, 8):
            xb = torch.randn(rows, 640, generator=g).bfloat16()
            out = gops.gemv_packed(xb, pw)
            assert gops.plan_for(pw, rows, False, True).candidate.param("kernel") == "dpamx"
            full_out = torch.empty(rows, pw.n)
            plan = gops.plan_for(pw, rows, False, True)
            gops._launch(plan.kernel, xb.float(), pw, None, full_out, plan.threads)
            _check(full_out, xb, pw)
            assert torch.equal(out, full_out.bfloat16())
            assert torch.equal(gops.gemv_packed(xb, pw), out)
    finally:
        gops._PLANS.clear()


def test_a_failed_amx_build_ends_the_candidates(fresh_cache, monkeypatch) -> None:
    """A compiler that rejects the AMX flags: the build raises, and from then on the process
    offers no ``dpamx`` candidate and names the cause (runs where AVX512-BF16 is present)."""
    if not native.cpu_info().has_avx512_bf16 or native.cpu_info().isa != "avx512":
        pytest.skip("the pair-dot kernel needs AVX512-BF16")
    monkeypatch.setattr(bf16_kernel, "_amx_dp_unbuildable", [])
    monkeypatch.setattr(bf16_kernel, "_amx_dp_missing", lambda isa=None: None)
    monkeypatch.setattr(bf16_kernel, "AMX_FLAGS", ("-mno-such-amx-flag",))
    with pytest.raises(native.CompileError):
        gemv_bf16_dp_kernel.__wrapped__("avx512", weights="fp8_e4m3", amx=True)
    assert bf16_kernel._amx_dp_unbuildable == [True]
    monkeypatch.undo()
    monkeypatch.setattr(bf16_kernel, "_amx_dp_unbuildable", [True])
    assert not amx_dp_ready()
    assert not any(
        c.name.startswith("dpamx") for c in gops.candidates("fp8_e4m3", False, 4096, True, 8)
    )
    if native.cpu_info().has_amx:
        with pytest.raises(native.NativeError, match=r"needs a compiler that builds AMX-BF16"):
            gemv_bf16_dp_kernel.__wrapped__("avx512", weights="fp8_e4m3", amx=True)


@needs_amx
def test_offered_from_four_e4m3_or_five_bf16_rows() -> None:
    def amx(fmt: str, rows: int, bx: bool = True) -> list[str]:
        cands = gops.candidates(fmt, False, 4096, bx, rows)
        return [c.name for c in cands if c.param("kernel") == "dpamx"]

    assert amx("fp8_e4m3", 4) == ["dpamx_p0l2_t0", "dpamx_p0l2_t1"] == amx("fp8_e4m3", 8)
    assert not amx("fp8_e4m3", 3) and not amx("fp8_e4m3", 2, bx=False)
    assert amx("fp8_e4m3", 3, bx=False) == amx("fp8_e4m3", 8, bx=False) == amx("fp8_e4m3", 4)
    assert not amx("fp8_e4m3", 9, bx=False)
    assert amx("bf16", 5, bx=False) and not amx("bf16", 4, bx=False)
    assert len(gops.candidates("fp8_e4m3", False, 4096, True, 8)) <= 11
    cand = next(
        c for c in gops.candidates("bf16", False, 4096, False, 8) if c.name.startswith("dpamx")
    )
    got = gops._native_kernel("bf16", False, 4096, "avx512", cand, 8)
    assert got is gemv_bf16_dp_kernel("avx512", 0, hint="T1", weights="bf16", amx=True)


def test_not_offered_nor_built_without_amx(monkeypatch) -> None:
    """Runs everywhere: with AMX-BF16 reported unavailable no ``dpamx`` candidate is offered, one
    asked for is an invalid candidate and the builder raises."""
    monkeypatch.setattr(bf16_kernel, "_amx_dp_missing", lambda isa=None: "AMX (patched away)")
    monkeypatch.setattr(gops, "amx_dp_ready", lambda: False)
    assert not any(
        c.name.startswith("dpamx") for c in gops.candidates("fp8_e4m3", False, 4096, True, 8)
    )
    cand = autotune.Candidate("dpamx_p0l2_t0", params=(("kernel", "dpamx"), ("hint", "T1")))
    with pytest.raises(autotune.InvalidCandidate, match="AMX-BF16"):
        gops._native_kernel("fp8_e4m3", False, 4096, "avx512", cand, 8)
    if native.cpu_info().has_avx512_bf16:
        with pytest.raises(native.NativeError, match=r"needs AMX \(patched away\)"):
            gemv_bf16_dp_kernel.__wrapped__("avx512", weights="fp8_e4m3", amx=True)
