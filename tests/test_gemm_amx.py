"""The AMX-BF16 GEMM kernel (``Config.dp`` 2) against the float64 reference: row and column
remainders around its 16- and 32-row blocks, K tails below one tile, layouts, epilogues, threads;
its configuration checks and its place among the autotuner's candidates."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.test_gemm_kernels import _assert_close, _make, _operands
from torchport import config, native
from torchport.autotune import InvalidCandidate
from torchport.gemm import kernels
from torchport.gemm.epilogue import EpilogueSpec
from torchport.gemm.kernels import AMX, AMX_TILE, Config, mm_reference, run_native

needs_amx = pytest.mark.skipif(
    not kernels.amx_ready(), reason="needs AMX-BF16 (and the OS's leave)"
)

# M around the 16-row tiles and 32-row blocks, K below / at / past one 32-wide k tile (odd too),
# N around the 32-column panels; zero sizes
SHAPES = [
    (0, 5, 32),
    (1, 1, 1),
    (1, 67, 64),
    (5, 0, 40),
    (4, 9, 0),
    (15, 31, 17),
    (16, 32, 32),
    (17, 33, 33),
    (31, 64, 96),
    (32, 70, 100),
    (33, 95, 130),
    (47, 130, 64),
    (70, 97, 301),
    (20, 1000, 96),  # one M block, 32 panels: runs of two panels per chunk with two threads
]


@needs_amx
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("a_layout", ["c", "t", "strided"])
@pytest.mark.parametrize("b_layout", ["c", "weight_t"])
@pytest.mark.parametrize(
    "mc,kc,pf",
    [(32, 0, 0), (40, 0, 4), (64, 32, 0), (96, 64, 2)],
    ids=["mc32", "mc40_pf4", "mc64_kc32", "mc96_kc64_pf2"],
)
def test_amx_grid(m, n, k, a_layout, b_layout, mc, kc, pf):
    """Whole and partial blocks, the K tail (kp % 16 pairs on vdpbf16ps; all of K below 32),
    M blocks (mc rounded up to 32 rows) and K blocks (sums carried between them through the
    chunk's fp32 buffer), runs of panels per chunk (one M block), the B prefetch, A read in place
    or copied into pairs, two threads."""
    a, b = _make(m, n, k, torch.bfloat16, a_layout, b_layout)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = run_native(a, b, EpilogueSpec(), [], Config(*AMX_TILE, mc, pf, kc=kc, dp=AMX))
    finally:
        torch.set_num_threads(before)
    _assert_close(out, a, b, EpilogueSpec(), [])


CHAINS = [
    "bias_col:bf16;gelu;add:bf16",
    "gelu_tanh;add:bf16;bias_col:bf16",
    "scale_row:f32;silu",
    "bias_row:f32;relu;out=f32",
    "scale_col:f32;out=f32",
]


@needs_amx
@pytest.mark.parametrize("text", CHAINS)
@pytest.mark.parametrize("m,n,k", [(45, 75, 64), (3, 40, 70), (96, 64, 32)], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_epilogue_chains(text, m, n, k, threads):
    """Row and column operands, residuals, activations and fp32 output on the full-width store
    and on the remainder columns' scalar store."""
    spec = EpilogueSpec.decode(text)
    a, b = _make(m, n, k, torch.bfloat16, "c", "weight_t")
    ops = _operands(spec, m, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_native(a, b, spec, ops, Config(*AMX_TILE, 64, kc=32, dp=AMX))
    finally:
        torch.set_num_threads(before)
    _assert_close(out, a, b, spec, ops)


@needs_amx
def test_amx_exact_sums_bit_for_bit():
    """Small integers: every product and partial sum is exact in fp32, so the tiles (and the
    K tail) give exactly the reference's rounding, as the vdpbf16ps tiles do."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-4, 5, (45, 103), generator=g).to(torch.bfloat16)
    b = torch.randint(-4, 5, (103, 77), generator=g).to(torch.bfloat16)
    ref = (a.double() @ b.double()).to(torch.bfloat16)
    out = run_native(a, b, EpilogueSpec(), [], Config(*AMX_TILE, 64, dp=AMX))
    assert torch.equal(out, ref)
    dp = run_native(a, b, EpilogueSpec(), [], Config(6, 64, 8, dp=1))
    assert torch.equal(out, dp)


@needs_amx
def test_amx_non_finite_values_stay_where_they_are():
    """A NaN or inf in A or B reaches only its own row or column of C (the zero rows that pad
    the last 16-row tile and the zero pairs that pad B multiply finite values only)."""
    a, b = _make(20, 40, 40, torch.bfloat16, "c", "weight_t")
    a, b = a.clone(), b.contiguous().clone()
    a[3, 5] = float("nan")
    b[7, 33] = float("inf")
    out = run_native(a, b, EpilogueSpec.decode("out=f32"), [], Config(*AMX_TILE, 32, dp=AMX))
    ref = a.double() @ b.double()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf())
    fin = ref.isfinite()
    torch.testing.assert_close(out.double()[fin], ref[fin], atol=1e-2, rtol=1e-2)


def test_amx_config_is_invalid_where_it_does_not_apply():
    a, b = _make(3, 3, 4, torch.float32, "c", "c")
    if kernels.amx_ready():
        with pytest.raises(InvalidCandidate, match="need bf16 operands"):
            run_native(a, b, EpilogueSpec(), [], Config(*AMX_TILE, 32, dp=AMX))
        bad_cfgs = (
            Config(*AMX_TILE, 32, kc=48, dp=AMX),
            Config(*AMX_TILE, 32, pf=65, dp=AMX),
            Config(*AMX_TILE, 32, ks=2, dp=AMX),
        )
        for bad in bad_cfgs:
            with pytest.raises(InvalidCandidate, match="kc a multiple of 32"):
                kernels.check_config(bad, "avx512")
        with pytest.raises(InvalidCandidate, match="AMX tile 16x32"):
            kernels.check_config(Config(16, 32, 32, dp=AMX), "avx512")
    with (
        config.override(isa="avx2"),
        pytest.raises(InvalidCandidate, match="AMX tile 32x32 needs AMX-BF16"),
    ):
        run_native(a.bfloat16(), b.bfloat16(), EpilogueSpec(), [], Config(*AMX_TILE, 32, dp=AMX))


def test_amx_candidates_only_where_amx_runs():
    from torchport.gemm.mm import candidates

    for m in (16, 512):
        names = [c.name for c in candidates(m, 4096, 1024, "avx512", 2)]
        assert len(names) <= 10
        if kernels.amx_ready():
            assert names[1].startswith("amx32x32_")
        else:
            assert not any(n.startswith("amx") for n in names)
    for m in (4, 512):  # fp32, and bf16 below 8 rows: none
        assert not any(c.name.startswith("amx") for c in candidates(m, 4096, 1024, "avx512", 4))
    assert not any(c.name.startswith("amx") for c in candidates(4, 4096, 1024, "avx512", 2))
    with config.override(isa="avx2"):
        assert not any(c.name.startswith("amx") for c in candidates(512, 4096, 1024, "avx2", 2))


def test_amx_ready_needs_the_cpu_flags():
    info = native.cpu_info()
    if not (info.has_amx and info.has_avx512_bf16):
        assert not kernels.amx_ready()


def test_amx_and_pair_dot_tiles_share_one_packing_in_tuning():
    """The AMX kernel reads the vdpbf16ps tiles' pair packing (32-wide panels): the tuner's
    rotation packs it once per copy for both, and groups them as one layout."""
    mm = importlib.import_module("torchport.gemm.mm")  # (torchport.gemm.mm is also a function)

    cands = [c for c in mm.candidates(8, 4096, 1024, "avx512", 2) if not c.is_anchor]
    assert all(mm._pack_layout(c)[1] in (0, 1) for c in cands)
    amx = [c for c in cands if int(c.param("dp", 0)) == AMX]
    dp = [c for c in cands if int(c.param("dp", 0)) == 1 and int(c.param("nr")) == 32]
    if amx and dp:
        assert mm._pack_layout(amx[0]) == mm._pack_layout(dp[0])
    a, b = _make(8, 96, 64, torch.bfloat16, "c", "weight_t")
    rot = mm._Rotation([(a, b, [])])
    first = rot.packed(0, 32, AMX)
    assert rot.packed(0, 32, 1) is first and rot.packed(0, 32, AMX) is first


@needs_amx
@pytest.mark.parametrize("n", [8192, 8200], ids=["aligned_rows", "mixed_rows"])
@pytest.mark.parametrize("chain", ["", "bias_col:bf16;out=f32"], ids=["bf16", "f32_out"])
def test_amx_streamed_outputs(n, chain):
    """Outputs of at least templates.AMX_STREAM_MIN_BYTES go out with non-temporal stores where a
    row's 32-column line is 64-byte aligned (every row for N = 8192; for N = 8200 the row stride
    is 16400 bytes in bf16, so every fourth row is streamed, 32800 in fp32, every other row)."""
    from torchport.gemm import templates

    spec = EpilogueSpec.decode(chain)
    m = -(-templates.AMX_STREAM_MIN_BYTES // (n * (4 if spec.out else 2))) + 3
    a, b = _make(m, n, 40, torch.bfloat16, "c", "weight_t")
    ops = _operands(spec, m, n)
    out = run_native(a, b, spec, ops, Config(*AMX_TILE, 128, dp=AMX))
    assert out.numel() * out.element_size() >= templates.AMX_STREAM_MIN_BYTES
    _assert_close(out, a, b, spec, ops)


def _exact_case(m: int, n: int, k: int, seed: int) -> tuple:
    """Operands whose results are exact: small integers (exact sums), a distinct integer bias and
    residual per column and row, power-of-two row scales, ReLU (exact) in place of GELU, so a
    residual, bias or scale landing on another row or column is an error of at least 1. Returns
    (a, b, a heavy spec (a residual: panel epilogues, TP_AMX_PANEL_EPI), its operands, a plain
    spec (block epilogues), its operands)."""
    g = torch.Generator().manual_seed(seed)
    ai = torch.randint(-3, 4, (m, k), generator=g).to(torch.bfloat16)
    bi = torch.randint(-3, 4, (k, n), generator=g).to(torch.bfloat16)
    heavy = EpilogueSpec.decode("bias_col:bf16;relu;add:f32;scale_row:f32;out=f32")
    heavy_ops = [
        torch.arange(n, dtype=torch.float32).remainder(7).to(torch.bfloat16),
        torch.arange(m * n, dtype=torch.float32).reshape(m, n).remainder(97),
        torch.pow(2.0, torch.arange(m).remainder(5).float() - 2),
    ]
    plain = EpilogueSpec.decode("bias_col:bf16;relu;scale_row:f32;out=f32")
    return ai, bi, heavy, heavy_ops, plain, [heavy_ops[0], heavy_ops[2]]


@needs_amx
@pytest.mark.parametrize("mc,kc,pf", [(96, 64, 0), (64, 0, 0), (32, 0, 4), (128, 32, 0)], ids=str)
@pytest.mark.parametrize("m,n,k", [(100, 130, 200), (33, 300, 64), (64, 97, 31)], ids=str)
def test_amx_epilogue_overlapped_with_the_next_block(mc, kc, pf, m, n, k):
    """A block's epilogue runs spread over the next block's K loop (the next row block, or the
    next panel's first block, whose sums go to the other half of the buffer), a heavy epilogue's
    (residual, activation) a whole panel's over the next panel's, the last one at the end of the
    chunk; with K blocks, several row blocks and a K tail, every row's residual, scale and bias
    land on their own outputs."""
    spec = EpilogueSpec.decode("bias_col:bf16;gelu;add:bf16;scale_row:f32")
    a, b = _make(m, n, k, torch.bfloat16, "c", "weight_t")
    ops = _operands(spec, m, n)
    # and exactly
    ai, bi, exact, ex_ops, plain, plain_ops = _exact_case(m, n, k, m + n + k)
    want = mm_reference(ai, bi, exact, ex_ops)
    want_plain = mm_reference(ai, bi, plain, plain_ops)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cfg = Config(*AMX_TILE, mc, pf, kc=kc, dp=AMX)
            _assert_close(run_native(a, b, spec, ops, cfg), a, b, spec, ops)
            assert torch.equal(run_native(ai, bi, exact, ex_ops, cfg), want)
            assert torch.equal(run_native(ai, bi, plain, plain_ops, cfg), want_plain)
    finally:
        torch.set_num_threads(before)


def test_amx_large_m_candidates_for_any_k():
    """K = 0 (no division by it), K <= 256 (the M-block candidate without K blocks rather than
    dropped) and K >= 16384 (no candidate twice) on the large-M list; M blocks of 128 rows or
    more at any K, and of 512 rows at M = 512 whatever K (K pieces keep A in L2)."""
    mm = importlib.import_module("torchport.gemm.mm")
    for m in (64, 512):
        for k in (0, 1, 100, 256, 257, 768, 4096, 16384, 65536):
            cands = mm.candidates(m, 48, k, "avx512", 2)
            names = [c.name for c in cands]
            assert len(names) == len(set(names)) and len(names) <= 10
            amx = [c for c in cands if int(c.param("dp", 0)) == AMX]
            if kernels.amx_ready() and k > 0:
                # (at M <= 128 every M block of 128 rows or more is the same one block)
                assert len(amx) >= (2 if k > 256 or m > 128 else 1), (m, k, names)
                assert all(int(c.param("kc")) < max(k, 2) for c in amx)
                assert all(int(c.param("mc")) >= 128 for c in amx)  # (fewer passes over B)
                if m == 512 and k > 256:
                    assert int(amx[0].param("mc")) == 512, (k, names)


@needs_amx
@pytest.mark.parametrize(
    "m,n,k,mc", [(40, 300, 33000, 32), (130, 300, 4200, 128)], ids=["three_pieces", "two_pieces"]
)
def test_amx_k_pieces(m, n, k, mc):
    """An M block's A beyond templates.AMX_A_PIECE_BYTES runs in K pieces, the sums of up to
    AMX_SUM_SLOTS panels kept between them (one thread: one run of every panel, sub-runs of 8 and
    2; two threads: runs of one panel): exact integer sums through a plain and a heavy epilogue,
    the K tail after the last piece, a partial last M block; and random bf16 operands against the
    float64 reference."""
    from torchport.gemm import templates

    assert mc * 64 * (k // 32) > templates.AMX_A_PIECE_BYTES  # (the shape does run in pieces)
    ai, bi, heavy, heavy_ops, plain, plain_ops = _exact_case(m, n, k, k)
    a, b = _make(m, n, k, torch.bfloat16, "c", "weight_t")
    spec = EpilogueSpec.decode("bias_col:bf16;gelu;add:bf16")
    ops = _operands(spec, m, n)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cfg = Config(*AMX_TILE, mc, kc=256, dp=AMX)
            for sp, sp_ops in ((heavy, heavy_ops), (plain, plain_ops)):
                got = run_native(ai, bi, sp, sp_ops, cfg)
                assert torch.equal(got, mm_reference(ai, bi, sp, sp_ops)), (threads, sp)
            _assert_close(run_native(a, b, spec, ops, cfg), a, b, spec, ops)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_amx_zero_k_through_the_api():
    import torchport.gemm as G

    a, b = torch.zeros(64, 0, dtype=torch.bfloat16), torch.zeros(0, 48, dtype=torch.bfloat16)
    out = G.mm(a, b, bias=torch.ones(48, dtype=torch.bfloat16))
    assert torch.equal(out, torch.ones(64, 48, dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("n", [2048, 2056], ids=["aligned_rows", "mixed_rows"])
def test_amx_bf16_rows_round_as_torch(n):
    """A row's 32 bf16 outputs go out as one 64-byte vector, streamed or stored: every value
    (ties, infinities, subnormals; NaN as 0x7fc0) is the kernel's own fp32 sum rounded as torch rounds
    it, on streamed and cached rows alike (the output is past AMX_STREAM_MIN_BYTES; with N = 2056
    only some rows start on a 64-byte line)."""
    from torchport.gemm import templates

    m = -(-templates.AMX_STREAM_MIN_BYTES // (n * 2)) + 5
    g = torch.Generator().manual_seed(n)
    a = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(64, n, generator=g).to(torch.bfloat16)
    a[2, 0] = float("inf")
    a[3, 7] = float("nan")
    a[4] = torch.ldexp(torch.ones(64), torch.arange(64) % 9 - 4).to(torch.bfloat16)
    b[:, 5] = torch.ldexp(torch.ones(64), -(torch.arange(64) % 9)).to(torch.bfloat16)  # ties
    cfg = Config(*AMX_TILE, 128, dp=AMX)
    out = run_native(a, b, EpilogueSpec(), [], cfg)
    sums = run_native(a, b, EpilogueSpec.decode("out=f32"), [], cfg)
    assert out.numel() * 2 >= templates.AMX_STREAM_MIN_BYTES
    want = sums.to(torch.bfloat16)
    nan = want.isnan()  # (torch's NaN bits differ by build; ours is always 0x7fc0)
    assert torch.equal(out.isnan(), nan) and nan[3].all()
    assert torch.equal(
        out.view(torch.int16)[nan], torch.full_like(out.view(torch.int16)[nan], 0x7FC0)
    )
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert out[2].isinf().any()
    # a NaN with its sign and payload set (a residual's 0xffc00001) comes out as 0x7fc0 on both
    # store paths, not with its payload (what vcvtne2ps2bf16 alone would keep)
    resid = torch.zeros(m, n)
    resid.view(torch.int32)[:, 5] = -4194303  # 0xffc00001
    nanout = run_native(a, b, EpilogueSpec.decode("add:f32"), [resid], cfg)
    assert (nanout.view(torch.int16)[:, 5] == 0x7FC0).all()
    # subnormal outputs (a row scale of 2^-130 on normal sums) round as torch rounds them too
    tiny = EpilogueSpec.decode("scale_row:f32")
    scale = torch.full((m,), 2.0**-130)
    scale[0] = 1.0
    sub = run_native(a, b, tiny, [scale], cfg)
    want = (sums * scale[:, None]).to(torch.bfloat16)
    fin = ~want.isnan()
    assert torch.equal(sub.view(torch.int16)[fin], want.view(torch.int16)[fin])
    assert ((sub[5:] != 0) & (sub[5:].abs() < 2.0**-126)).any()


@needs_amx
def test_an_amx_library_that_does_not_compile_turns_amx_off_and_tunes_the_rest(
    fresh_cache, monkeypatch
):
    """AMX permission is asked of the OS, not of the compiler: where the AMX library does not
    compile, the shape being tuned moves to its other candidates under their own key (it
    tuned ATen alone under the AMX key before, and kept it there for every later process), and
    AMX is off for the rest of the process. A rejection of one epilogue's library alone, or a
    compile timeout, leaves AMX on."""
    import subprocess

    import torchport.gemm as G

    mm = importlib.import_module("torchport.gemm.mm")
    real_build = native.build
    rejected: set[str] = set()

    def build(src, name="kernel", **kw):
        if name.startswith("gemm_amx") and name in rejected:
            raise native.CompileError(f"{name}: no AMX in this compiler")
        return real_build(src, name=name, **kw)

    monkeypatch.setattr(native, "build", build)
    monkeypatch.setattr(kernels, "_amx_unbuildable", [])
    kernels._amx_library.cache_clear()
    try:
        # one epilogue's library rejected: AMX stays on
        spec = EpilogueSpec.decode("scale_col:f32")
        rejected.add(f"gemm_amx_bf16_bf16_e{len(spec.ops)}")
        with pytest.raises(native.CompileError):
            kernels._amx_library(spec, "bf16")
        assert kernels.amx_ready()

        def timeout(src, name="kernel", **kw):
            try:
                raise subprocess.TimeoutExpired("gcc", 1.0)
            except subprocess.TimeoutExpired as e:
                raise native.CompileError("compiler timed out") from e

        monkeypatch.setattr(native, "build", timeout)
        kernels._amx_library.cache_clear()
        with pytest.raises(native.CompileError):
            kernels._amx_library(kernels.NO_EPILOGUE, "f32")
        assert kernels.amx_ready()
        monkeypatch.setattr(native, "build", build)
        # every AMX library rejected: the tuning in progress falls back to the vdpbf16ps tiles
        rejected.update({"gemm_amx_bf16_f32_e0", "gemm_amx_bf16_bf16_e0"})
        kernels._amx_library.cache_clear()
        g = torch.Generator().manual_seed(0)
        a = torch.randn(64, 512, generator=g).to(torch.bfloat16)
        b = torch.randn(512, 256, generator=g).to(torch.bfloat16)
        y = G.mm(a, b)
        assert not kernels.amx_ready()
        torch.testing.assert_close(y.float(), mm_reference(a, b).float(), atol=3e-2, rtol=3e-2)
        entries = [
            e for e in autotune_entries() if e["key"].get("m") == 64 and e["key"]["k"] == 512
        ]
        assert [e["key"].get("tiles") for e in entries] == ["dp"]
        timed = entries[0]["timings_s"]
        assert any(not n.startswith(("aten", "amx", "confirm:", "final:")) for n in timed), timed
        assert mm.candidates(512, 4096, 1024, "avx512", 2)  # (no AMX ones now)
        assert not any(
            c.name.startswith("amx") for c in mm.candidates(512, 4096, 1024, "avx512", 2)
        )
    finally:
        kernels._amx_library.cache_clear()


def autotune_entries() -> list[dict]:
    """Every entry of the autotuner's choice file in the current cache directory."""
    import json

    from torchport.autotune import choice_cache

    path = choice_cache.path
    return list(json.loads(path.read_text())["entries"].values()) if path.exists() else []
