"""The ``vdpbf16ps`` GEMV on E4M3 weights (torchport.gemv.bf16_kernel, ``weights="fp8_e4m3"``).

Each 64-byte line of E4M3 codes is decoded to bf16 by table (every E4M3 value is a normal bf16
number, subnormal codes included) and meets bf16-valued activations in ``vdpbf16ps``. Checked
against the float64 product of the activations with the dequantized weight (row scale
included) within the float kernel's tolerance (``1e-5 · Σ|x·w|``), for K of any size (the masked
tail), one to eight activation rows, with and without bias, on one and two threads (the same
bits); every one of the 256 codes exactly; the same bits whether K runs in blocks or in one piece
and whether two weight rows share the activation loads; float32 activations refused (status 4,
the caller's routing never sends them); and the tuner's offer for bf16 activations.
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import check_float_bound
from torchport import autotune, native
from torchport.gemv import ops as gops
from torchport.gemv.bf16_kernel import gemv_bf16_dp_kernel
from torchport.lowp import Float8Tensor

pytestmark = pytest.mark.skipif(
    not native.cpu_info().has_avx512_bf16, reason="the vdpbf16ps GEMV needs AVX512-BF16"
)


def _pack(w: torch.Tensor) -> gops.PackedWeight:
    return Float8Tensor.from_float(w).gemv_pack()


def _run(x: torch.Tensor, pw: gops.PackedWeight, bias=None, threads: int = 2, **kw):
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3", **kw)
    out = torch.empty(x.shape[0], pw.n)
    gops._launch(kern, x.float().contiguous(), pw, bias, out, threads)
    return out


_check = check_float_bound


@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 31), (5, 33), (17, 64), (40, 100), (131, 1061), (64, 4096)], ids=str
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_fp8_dp_kernel_matches_reference(shape, rows) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * 31 + k + rows)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, ::7] *= 1e-4  # subnormal codes among the normal ones
    pw = _pack(w)
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if rows % 2 else None
    out = _run(x, pw, bias)
    _check(out, x, pw, bias)
    assert torch.equal(out, _run(x, pw, bias, threads=1))


def test_every_e4m3_code_decodes_exactly() -> None:
    """Weight (n, j) holds code (n + 37 j) mod 256, so every column holds all 256 codes in a
    different order: a one-hot activation at K position j reads back column j's codes decoded
    (times the row scale) exactly, which checks the tables, the sign and where each weight meets
    its activation (positions in all four 128-bit lanes, both halves of a line, the masked tail
    of K = 100). The NaN codes 0x7F/0xFF, which make a row's every product NaN (as in torch: NaN
    times 0 is NaN), stand in for code 0 there; then one of each, in the lines and in the tail,
    gives its row NaN."""
    k = 100
    idx = (torch.arange(256)[:, None] + 37 * torch.arange(k)[None, :]) % 256
    idx = idx.masked_fill((idx & 0x7F) == 0x7F, 0)
    data = idx.to(torch.int32).to(torch.uint8).contiguous()
    rowscale = torch.full((256,), 0.5)
    empty = torch.empty(0, dtype=torch.uint8)
    pw = gops.PackedWeight("fp8_e4m3", data, empty, rowscale, 1.0, 256, k, False)
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    for j in (0, 7, 8, 15, 16, 31, 33, 47, 56, 63, 64, 70, 99):
        x = torch.zeros(1, k)
        x[0, j] = 1.0
        assert torch.equal(_run(x, pw)[0], table[idx[:, j]] * 0.5), j
    data[3, 40], data[9, 97] = 0x7F, 0xFF
    out = _run(torch.ones(1, k), pw)[0]
    assert bool(out[[3, 9]].isnan().all()) and int(out.isnan().sum()) == 2


def test_float_activations_are_refused() -> None:
    pw = _pack(torch.randn(8, 64))
    x = torch.randn(1, 64)  # not bf16 values
    kern = gemv_bf16_dp_kernel("avx512", weights="fp8_e4m3")
    with pytest.raises(native.NativeError, match="not bf16 values"):
        gops._launch(kern, x, pw, None, torch.empty(1, 8), 1)


@pytest.mark.parametrize("rows", [4, 5, 8])
def test_two_weight_rows_keep_every_rows_bits(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 1000, generator=g)  # K % 64 != 0: the masked tail too
    x = torch.randn(rows, 1000, generator=g).bfloat16()
    bias = torch.randn(37, generator=g)
    pw = _pack(w)
    pw1 = gops.PackedWeight(
        pw.fmt, pw.data[1:], pw.scales, pw.rowscale[1:], pw.pts, 36, 1000, False
    )
    full = _run(x, pw, bias)
    assert torch.equal(full, _run(x, pw, bias, threads=1))
    assert torch.equal(full[:, 1:], _run(x, pw1, bias[1:]))
    for i in range(rows):
        assert torch.equal(full[i], _run(x[i : i + 1], pw, bias)[0]), i


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [11008, 4096, 1000, 1088, 192], ids=str)
def test_k_blocks_keep_bits(rows: int, k: int) -> None:
    """K in blocks (from one activation row with E4M3 weights) against K in one piece; the
    blocks run weight rows in pairs, so without the first row every pair changes (and the last
    of 41 rows runs alone): the bits do not."""
    g = torch.Generator().manual_seed(rows * k)
    pw = _pack(torch.randn(41, k, generator=g))
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(41, generator=g)
    whole = _run(x, pw, bias, threads=1, xblock=0)
    _check(whole, x, pw, bias)
    for xblock, threads in ((256, 1), (256, 2), (None, 2), (16384, 2)):
        assert torch.equal(_run(x, pw, bias, threads=threads, xblock=xblock), whole)
    pw1 = gops.PackedWeight(pw.fmt, pw.data[1:], pw.scales, pw.rowscale[1:], pw.pts, 40, k, False)
    assert torch.equal(_run(x, pw1, bias[1:], threads=1, xblock=256), whole[:, 1:])


@pytest.mark.parametrize("hint,pf", [("NTA", 2048), ("T0", 4096), ("T1", 2048)])
def test_prefetch_settings_keep_bits(hint: str, pf: int) -> None:
    g = torch.Generator().manual_seed(11)
    pw = _pack(torch.randn(70, 1000, generator=g))
    x = torch.randn(1, 1000, generator=g).bfloat16()
    assert torch.equal(_run(x, pw, hint=hint, prefetch=pf), _run(x, pw))


def test_rejects_other_weight_formats() -> None:
    with pytest.raises(ValueError, match=r"weights must be one of .* got 'nvfp4'"):
        gemv_bf16_dp_kernel("avx512", weights="nvfp4")


def test_tuner_offers_the_pair_dot_for_bf16_activations_only() -> None:
    names = [c.name for c in gops.candidates("fp8_e4m3", bx=True)]
    assert names[0] == "aten_linear"
    assert names[1:5] == ["dp_p2048l2_t0", "dp_p2048nta_t0", "dp_p2048l2_t1", "dp_p2048nta_t1"]
    assert len(names) <= 10
    assert not any(n.startswith("dp") for n in (c.name for c in gops.candidates("fp8_e4m3")))
    cand = gops.candidates("fp8_e4m3", bx=True)[1]
    got = gops._native_kernel("fp8_e4m3", False, 64, "avx512", cand)
    assert got is gemv_bf16_dp_kernel("avx512", 2048, hint="T1", weights="fp8_e4m3")
    with pytest.raises(autotune.InvalidCandidate, match="E4M3"):
        gops._native_kernel("nvfp4", False, 64, "avx512", cand)


@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_packed_with_bf16_activations(rows: int) -> None:
    """Through the public entry: bf16 activations plan with the pair dot on offer (the tuner
    picks by time), float32 ones without it (its AMX-BF16 build, which splits them, on offer
    from three rows); both meet the reference, and each call's plan is the one for its
    activation dtype."""
    g = torch.Generator().manual_seed(rows + 40)
    w = torch.randn(700, 640, generator=g) * 0.1  # 448 K weights: tuned, not the default
    pw = _pack(w)
    xb = torch.randn(rows, 640, generator=g).bfloat16()
    out = gops.gemv_packed(xb, pw)
    assert out.dtype == torch.bfloat16  # the float32 result rounded once
    full = torch.empty(rows, pw.n)
    plan = gops.plan_for(pw, rows, False, True)
    gops._launch(plan.kernel, xb.float(), pw, None, full, plan.threads)
    _check(full, xb, pw)
    assert torch.equal(out, full.bfloat16())
    plan_b = gops.plan_for(pw, rows, False, True)
    plan_f = gops.plan_for(pw, rows, False, False)
    # (the vdpbf16ps kernel refuses float32 activations; its AMX-BF16 build splits them, from
    # three rows: DPAMX_F32_ROWS)
    assert not plan_f.candidate.name.startswith("dp_")
    assert rows >= 3 or not plan_f.candidate.name.startswith("dpamx")
    assert plan_b is not plan_f
    _check(gops.gemv_packed(xb.float(), pw), xb, pw)


@pytest.mark.parametrize("weights", ["fp8_e4m3", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize("k", [64, 1000, 4096, 5000], ids=str)
def test_bf16io_entry_is_the_float_entry_then_a_cast(weights: str, rows: int, k: int) -> None:
    """``tp_gemv_bf16io`` (bf16 activations and results) gives the bits of ``tp_gemv`` on the
    widened activations followed by torch's cast: K tails, K blocks (K = 5000 at four rows),
    bias, one and two threads, NaN and infinities among the activations and a huge result
    (overflow to inf in the cast). NaN is written 0xffff, as torch's vectorized cast writes it
    (where its cast writes another NaN, routes do not take this entry: checked below)."""
    if not gops._cast_nan_is_ffff():
        pytest.skip("torch's CPU cast writes NaN as 0x7fc0 here (ATEN_CPU_CAPABILITY=default)")
    g = torch.Generator().manual_seed(rows * k + len(weights))
    w = torch.randn(37, k, generator=g) * 0.1
    pw = _pack(w) if weights == "fp8_e4m3" else gops.pack_dense(w.bfloat16())
    x = torch.randn(rows, k, generator=g).bfloat16()
    x[0, 3] = float("nan")
    if rows > 1:
        x[1, 5] = float("inf")
    if rows > 2:
        x[2, :] = 3e38  # sums beyond bf16's range
    bias = torch.randn(37, generator=g)
    kern = gemv_bf16_dp_kernel("avx512", weights=weights)
    for threads in (1, 2):
        for b in (None, bias):
            full = torch.empty(rows, 37)
            gops._launch(kern, x.float(), pw, b, full, threads)
            out = torch.empty(rows, 37, dtype=torch.bfloat16)
            bb = b if b is not None else torch.zeros(1)
            st = kern.bf16io(x, rows, k, pw.data, pw.scales, pw.rowscale, pw.pts, bb,
                             int(b is not None), out, 37, threads)  # fmt: skip
            assert st == 0
            assert torch.equal(out.view(torch.int16), full.bfloat16().view(torch.int16))


def test_settled_route_with_bf16_activations_takes_the_bf16_entry() -> None:
    """A settled route for bf16 activations on a ``vdpbf16ps`` plan returns bf16 results equal
    to the first (unsettled) call's float32 result cast, and a non-contiguous activation is
    served the same."""
    g = torch.Generator().manual_seed(77)
    pw = _pack(torch.randn(700, 640, generator=g) * 0.1)
    x = torch.randn(4, 640, generator=g).bfloat16()
    first = gops.gemv_packed(x, pw)  # the general path: float32 kernel call, then a cast
    plan = gops.plan_for(pw, 4, False, True)
    if not plan.candidate.name.startswith("dp"):
        pytest.skip(f"the tuner chose {plan.candidate.name}, not the pair dot")
    for _ in range(3):  # settles the route, then serves it
        assert torch.equal(gops.gemv_packed(x, pw), first)
    assert pw.routes[True] is not None
    xt = torch.randn(640, 4, generator=g).bfloat16().t()  # non-contiguous
    assert torch.equal(gops.gemv_packed(xt, pw), gops.gemv_packed(xt.contiguous(), pw))


@pytest.mark.parametrize("same_nan", [True, False])
def test_routes_take_the_bf16_entry_only_where_torchs_cast_agrees(monkeypatch, same_nan) -> None:
    """A settled route with bf16 activations on a pair-dot plan calls the bf16 entry only where
    torch's cast writes NaN as it does (0xffff); otherwise (torch's scalar cast) it keeps the
    float32 entry and the cast, and NaN outputs keep torch's bits either way."""
    monkeypatch.setattr(gops, "_cast_nan_is_ffff", lambda: same_nan)
    g = torch.Generator().manual_seed(78)
    pw = _pack(torch.randn(700, 640, generator=g) * 0.1)
    x = torch.randn(2, 640, generator=g).bfloat16()
    x[0, 7] = float("nan")
    first = gops.gemv_packed(x, pw)
    plan = gops.plan_for(pw, 2, False, True)
    if not plan.candidate.name.startswith("dp"):
        pytest.skip(f"the tuner chose {plan.candidate.name}, not the pair dot")
    for _ in range(3):
        out = gops.gemv_packed(x, pw)
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    assert pw.routes[True].run.bf16io is same_nan
