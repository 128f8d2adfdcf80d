"""Native GEMM kernels vs the float64 reference: shapes, dtypes, layouts, tiles, epilogues."""

from __future__ import annotations

import math

import pytest
import torch

from torchport import config, native
from torchport.gemm import kernels, templates
from torchport.gemm.epilogue import EpilogueSpec, Op, apply_torch
from torchport.gemm.kernels import Config, mm_reference, run_native
from torchport.gemm.pack import (
    pack_b,
    pack_b_pairs,
    pack_b_reference,
    pack_pairs_reference,
    pair_words,
)
from torchport.native.cpu import ISA_LEVELS

ISA = native.cpu_info().isa
TILES = kernels.TILES[ISA]


def _make(m: int, n: int, k: int, dtype: torch.dtype, a_layout: str, b_layout: str):
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    if a_layout == "t":
        a = torch.randn(k, m, generator=g).to(dtype).t()
    elif a_layout == "strided":
        a = torch.randn(m, 2 * k + 1, generator=g).to(dtype)[:, 1 : 2 * k + 1 : 2]
    else:
        a = torch.randn(m, k, generator=g).to(dtype)
    if b_layout == "weight_t":  # nn.Linear weight [N, K] read as [K, N]
        b = torch.randn(n, k, generator=g).to(dtype).t()
    elif b_layout == "strided":
        b = torch.randn(k, 2 * n, generator=g).to(dtype)[:, ::2]
    else:
        b = torch.randn(k, n, generator=g).to(dtype)
    return a, b


def _operands(spec: EpilogueSpec, m: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = {
        "bias_col": (n,),
        "scale_col": (n,),
        "bias_row": (m,),
        "scale_row": (m,),
        "add": (m, n),
    }
    out = []
    for op in spec.ops:
        if op.kind in shapes:
            dt = torch.float32 if op.dtype == "f32" else torch.bfloat16
            out.append(torch.randn(shapes[op.kind], generator=g).to(dt))
    return out


def _assert_close(out: torch.Tensor, a, b, spec, ops) -> None:
    ref = mm_reference(a, b, spec, ops)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.numel() == 0:
        return
    k = a.shape[1]
    mag = (a.double().abs() @ b.double().abs()).max().item() if k else 0.0
    op_mag = max([float(t.double().abs().max()) for t in ops] + [1.0])
    if out.dtype == torch.bfloat16 or a.dtype == torch.bfloat16:
        atol = 2e-2 * (mag * op_mag + op_mag) + 1e-3
        rtol = 1.6e-2
    else:
        atol = 2e-6 * math.sqrt(k + 1) * (mag * op_mag + op_mag) + 1e-6
        rtol = 1e-5
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)


SHAPES = [
    (0, 5, 3),
    (1, 1, 1),
    (1, 67, 13),
    (5, 0, 7),
    (4, 9, 0),
    (7, 31, 17),
    (13, 70, 29),
    (37, 53, 61),
]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("a_layout", ["c", "t", "strided"])
@pytest.mark.parametrize("b_layout", ["c", "weight_t", "strided"])
def test_plain_grid(m, n, k, dtype, a_layout, b_layout):
    a, b = _make(m, n, k, dtype, a_layout, b_layout)
    spec = EpilogueSpec()
    for mr, nr in TILES[:2]:
        out = run_native(a, b, spec, [], Config(mr, nr, max(1, m)), packed=pack_b(b, nr))
        _assert_close(out, a, b, spec, [])


@pytest.mark.parametrize("mr,nr", TILES, ids=[f"{mr}x{nr}" for mr, nr in TILES])
@pytest.mark.parametrize("mc", [1, 5, 64])
@pytest.mark.parametrize("pf", [0, 8])
def test_every_tile_and_block(mr, nr, mc, pf):
    a, b = _make(23, 101, 37, torch.float32, "c", "weight_t")
    out = run_native(a, b, EpilogueSpec(), [], Config(mr, nr, mc, pf))
    _assert_close(out, a, b, EpilogueSpec(), [])


@pytest.mark.parametrize("mr,nr", TILES, ids=[f"{mr}x{nr}" for mr, nr in TILES])
@pytest.mark.parametrize("kc", [0, 16])
def test_bf16_tiles_agree_bitwise_across_k_loops(mr, nr, kc):
    """bf16 weights: the unit-stride K loops read vector pairs of B as even/odd columns on AVX2
    (templates._eo_pairs; with and without prefetch), the strided-A loop widens each vector;
    every column's products are summed in the same order either way, so the outputs are
    bitwise equal (fp32 output: no rounding hides a lane mix-up), and match the reference.
    N = 101 ends in a partial panel; kc = 16 carries partial sums across K blocks."""
    if ISA == "avx2" and nr // 8 >= 2:  # the pairs are in the source these calls build
        src = templates.render_source(EpilogueSpec(), "bf16", "f32", ISA, ((mr, nr), (1, nr)))
        assert "VPAIR_bf16(bk" in src
    a, b = _make(23, 101, 37, torch.bfloat16, "c", "weight_t")
    a_strided = torch.empty(23, 2 * 37, dtype=torch.bfloat16)[:, ::2]
    a_strided.copy_(a)
    spec = EpilogueSpec.decode("out=f32")
    outs = [
        run_native(x, b, spec, [], Config(mr, nr, mc, pf, kc=kc))
        for x, mc, pf in ((a, 64, 0), (a, 5, 0), (a, 64, 8), (a_strided, 64, 0))
    ]
    _assert_close(outs[0], a, b, spec, [])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("mr,nr", TILES[:2], ids=[f"{mr}x{nr}" for mr, nr in TILES[:2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("a_layout", ["c", "strided"])
@pytest.mark.parametrize("k", [1, 39])
def test_prefetch_groups_and_dynamic_chunks(mr, nr, dtype, a_layout, k):
    """The prefetching K loop steps whole 64-byte lines of the panel (2 or 4 rows at a time,
    then single rows up to K) and the panels go to the threads in dynamically handed-out
    chunks (more chunks than panels here, and fewer): reference results for K below one group
    and for whole groups plus a remainder, bf16 and fp32 panels, contiguous and strided A."""
    from torchport.gemm.templates import CHUNKS_PER_THREAD, prefetch_group

    assert prefetch_group(8, "f32") == (2, 1) and prefetch_group(8, "bf16") == (4, 1)
    assert prefetch_group(24, "f32") == (2, 3) and prefetch_group(24, "bf16") == (4, 3)
    assert prefetch_group(16, "f32") == (1, 1) and prefetch_group(32, "f32") == (1, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the drivers run one thread below 65536 multiply-adds
    try:
        for n in (3 * nr + 5, max(2 * CHUNKS_PER_THREAD * nr + 1, 65536 // (9 * k) + 3)):
            a, b = _make(9, n, k, dtype, a_layout, "weight_t")
            out = run_native(a, b, EpilogueSpec(), [], Config(mr, nr, 9, 64))
            _assert_close(out, a, b, EpilogueSpec(), [])
    finally:
        torch.set_num_threads(before)


# deferrable chains (a transcendental step): fp32 output (deferred), and bf16 output (per tile)
CHAINS_DEFERRED = [
    ("bias_col:f32;gelu;add:f32;scale=0.5", torch.float32),
    ("gelu_tanh;add:bf16;bias_col:bf16", torch.bfloat16),
]

# (1, 301, 300): two threads, fewer rows than threads: the reduction splits columns
KSHAPES = [(1, 67, 1), (1, 301, 300), (3, 29, 67), (7, 50, 301), (17, 130, 1000), (2, 5, 0)]


@pytest.mark.parametrize("m,n,k", KSHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in KSHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "kc,ks,mc",
    [(0, 2, 64), (0, 5, 64), (64, 1, 8), (7, 1, 5)],
    ids=["ks2", "ks5_more_splits_than_some_k", "kc64_mc8", "kc7_mc5"],
)
def test_k_split_and_k_blocks(m, n, k, dtype, kc, ks, mc):
    """K-split across threads (partial sums per split, one reduction pass with the epilogue)
    and K cache blocks (partial sums carried between blocks) give the reference result, with
    an epilogue chain, for K not a multiple of the split or block."""
    spec = EpilogueSpec.decode("bias_col:f32;gelu;add:f32" if dtype == torch.float32 else "")
    a, b = _make(m, n, k, dtype, "strided", "weight_t")
    ops = _operands(spec, m, n)
    for mr, nr in TILES[:2] if ks == 2 else TILES[:1]:
        out = run_native(a, b, spec, ops, Config(mr, nr, mc, kc=kc, ks=ks))
        _assert_close(out, a, b, spec, ops)


@pytest.mark.parametrize("defer_max", [0, 16], ids=["per_tile", "deferred"])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 16, 17])
@pytest.mark.parametrize("chain", [CHAINS_DEFERRED[0], CHAINS_DEFERRED[1]], ids=["f32", "bf16out"])
def test_deferred_epilogue_pass_small_m(m, chain, defer_max, monkeypatch):
    """A GELU/SiLU epilogue at small M in the fp32-accumulating tiles: per tile (the default,
    ``TILE_DEFER_MAX_M`` 0) and, with ``TILE_DEFER_MAX_M`` 16, deferred: for fp32 output the
    tiles store raw sums in C and one pass per chunk applies the epilogue over its columns (N
    not a multiple of the panel width, a thread with a partial last panel); bf16 output (no
    workspace from the launcher) and M = 17 take the per-tile epilogue. All match the
    reference, with two threads and with one."""
    from torchport.gemm import kernels, templates

    assert templates.TILE_DEFER_MAX_M == 0
    monkeypatch.setattr(templates, "TILE_DEFER_MAX_M", defer_max)
    caches = (kernels.library, kernels._function, kernels.launcher)
    for f in caches:  # libraries rendered with this setting (the disk cache keys on the source)
        f.cache_clear()
    spec = EpilogueSpec.decode(chain[0])
    assert spec.deferrable
    a, b = _make(m, 75, 33, chain[1], "c", "weight_t")
    ops = _operands(spec, m, 75)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for mr, nr in TILES[:2]:
                out = run_native(a, b, spec, ops, Config(mr, nr, 64))
                _assert_close(out, a, b, spec, ops)
    finally:
        torch.set_num_threads(before)
        for f in caches:
            f.cache_clear()


OPERAND_LAYOUTS = ["contiguous", "strided", "broadcast", "wide_rows", "transposed"]


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another layout: every-other element of a wider tensor, a stride-0
    broadcast (1-D only), rows of a wider tensor (2-D only), column-major (2-D only)."""
    if layout == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "broadcast" and t.dim() == 1:
        return t[:1].expand(t.shape[0])
    if layout == "wide_rows" and t.dim() == 2:
        wide = torch.zeros(t.shape[0], t.shape[1] + 5, dtype=t.dtype)
        wide[:, 2 : 2 + t.shape[1]] = t
        return wide[:, 2 : 2 + t.shape[1]]
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    return t


@pytest.mark.parametrize("layout", OPERAND_LAYOUTS)
@pytest.mark.parametrize("m", [1, 9, 20])
def test_epilogue_operand_layouts(layout, m):
    """Bias, residual and row-scale operands in any layout: read in place when the kernel can
    (unit column stride, any row stride), copied first otherwise; both match the reference."""
    spec = EpilogueSpec.decode("bias_col:f32;gelu;add:f32;scale_row:f32")
    a, b = _make(m, 70, 33, torch.float32, "c", "weight_t")
    ops = [_laid_out(t, layout) for t in _operands(spec, m, 70)]
    out = run_native(a, b, spec, ops, Config(*TILES[0], 64))
    _assert_close(out, a, b, spec, ops)


def test_bf16_out_deferrable_across_sizes():
    """bf16 output with a SiLU epilogue at growing, shrinking and growing sizes matches the
    reference (the fp32 tiles apply it per tile; the deferred epilogue's per-thread workspace
    is only taken by the vdpbf16ps launcher, on AVX512-BF16 machines)."""
    spec = EpilogueSpec.decode("bias_col:bf16;silu")
    for m, n in [(3, 40), (16, 300), (2, 17), (16, 301), (1, 1000)]:
        a, b = _make(m, n, 24, torch.bfloat16, "c", "weight_t")
        ops = _operands(spec, m, n)
        out = run_native(a, b, spec, ops, Config(*TILES[0], 64))
        _assert_close(out, a, b, spec, ops)


def test_k_split_single_thread_and_bf16_out():
    spec = EpilogueSpec.decode("silu;out=bf16")
    a, b = _make(5, 37, 900, torch.float32, "c", "c")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread runs every split, then the reduction
    try:
        out = run_native(a, b, spec, [], Config(*TILES[0], 8, ks=2))
    finally:
        torch.set_num_threads(before)
    _assert_close(out, a, b, spec, [])


def test_bad_k_config_is_invalid_candidate():
    from torchport.autotune import InvalidCandidate

    a, b = _make(3, 3, 3, torch.float32, "c", "c")
    with pytest.raises(InvalidCandidate, match="kc=64 ks=2"):
        run_native(a, b, EpilogueSpec(), [], Config(*TILES[0], 4, kc=64, ks=2))
    with pytest.raises(InvalidCandidate, match="ks >= 1"):
        run_native(a, b, EpilogueSpec(), [], Config(*TILES[0], 4, ks=0))
    with pytest.raises(InvalidCandidate, match="nt >= 0"):
        run_native(a, b, EpilogueSpec(), [], Config(*TILES[0], 4, nt=-1))


@pytest.mark.parametrize("ks", [1, 2])
def test_one_thread_variant(ks):
    """``nt=1`` caps the kernel at one thread (the loaded-machine candidates), same result."""
    spec = EpilogueSpec.decode("bias_col:f32;relu")
    a, b = _make(9, 131, 1100, torch.float32, "c", "weight_t")
    ops = _operands(spec, 9, 131)
    out = run_native(a, b, spec, ops, Config(*TILES[1], 9, ks=ks, nt=1))
    _assert_close(out, a, b, spec, ops)


CHAINS = [
    ("bias_col:f32;gelu;add:f32;scale=0.5", torch.float32),
    ("bias_row:f32;relu;scale_col:f32", torch.float32),
    ("scale_row:f32;silu;out=bf16", torch.float32),
    ("gelu_tanh;add:bf16;bias_col:bf16", torch.bfloat16),
    ("relu;out=f32", torch.bfloat16),
]


@pytest.mark.parametrize("text,dtype", CHAINS, ids=[c[0] for c in CHAINS])
@pytest.mark.parametrize("m,n,k", [(1, 19, 5), (9, 40, 33), (31, 75, 64)], ids=str)
def test_epilogue_chains(text, dtype, m, n, k):
    spec = EpilogueSpec.decode(text)
    a, b = _make(m, n, k, dtype, "c", "weight_t")
    ops = _operands(spec, m, n)
    tiles = TILES[:2] if text == CHAINS[0][0] else TILES[:1]  # one compile per extra chain
    for mr, nr in tiles:
        out = run_native(a, b, spec, ops, Config(mr, nr, 64))
        _assert_close(out, a, b, spec, ops)


# (1, 20000): split by columns for a GELU/SiLU chain only (kernels.pass_split_min)
PASS_SHAPES = [(0, 5), (1, 1), (1, 67), (3, 37), (1, 20000), (2, 33000), (40, 1700), (13, 0)]


@pytest.mark.parametrize("text,dtype", CHAINS, ids=[c[0] for c in CHAINS])
@pytest.mark.parametrize("m,n", PASS_SHAPES, ids=str)
def test_epilogue_pass_over_a_product(text, dtype, m, n):
    """The epilogue alone over a finished product (the fused problem's ATen launch): every
    chain, both dtypes, one and two threads (>= 64 Ki elements, split by rows or columns), in
    place when the dtypes agree; a strided product is read as is."""
    spec = EpilogueSpec.decode(text)
    a, b = _make(m, n, 23, dtype, "c", "weight_t")
    ops = _operands(spec, m, n)
    prod = a @ b
    apply = kernels.epilogue_pass(spec, dtype, ISA)
    s = prod.clone()
    out = apply(s, ops)
    assert out.dtype == spec.out_dtype(dtype) and out.shape == (m, n)
    assert m * n == 0 or (out.data_ptr() == s.data_ptr()) == (out.dtype == dtype)
    ref = apply_torch(prod.double(), spec, [t.double() for t in ops]).to(out.dtype)
    if m * n:
        tol = 1.6e-2 if torch.bfloat16 in (dtype, out.dtype) else 2e-6
        scale = float(ref.double().abs().max()) + 1.0
        torch.testing.assert_close(out.double(), ref.double(), atol=tol * scale, rtol=tol)
    strided = torch.empty(n, m, dtype=dtype).t()  # [m, n] with column stride m
    strided.copy_(prod)
    torch.testing.assert_close(apply(strided, ops).double(), out.double(), atol=0, rtol=0)


def test_epilogue_pass_rejects_a_product_of_another_dtype():
    apply = kernels.epilogue_pass(EpilogueSpec.decode("gelu"), torch.float32, ISA)
    with pytest.raises(
        kernels.GemmInputError, match=r"built for torch\.float32, got a torch\.bfloat16"
    ):
        apply(torch.zeros(2, 3, dtype=torch.bfloat16), [])


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_vector_activation_accuracy(act):
    """Activations on exact inputs (x @ [1]): ≤ 3e-7 relative + 1e-7 |x| absolute vs float64.

    The absolute part covers the cancellation in ``1 + erf`` (and ``x * sigmoid``) for large
    negative ``x``, which float32 torch has as well.
    """
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.tensor([0.0, -0.0, 1e-30, 3.9, 4.1])])
    a, b = x[:, None].contiguous(), torch.ones(1, 1)
    spec = EpilogueSpec.decode(act)
    out = run_native(a, b, spec, [], Config(*TILES[0], 64))[:, 0].double()
    xd = x.double()
    if act == "gelu":
        ref = torch.nn.functional.gelu(xd)
    elif act == "gelu_tanh":
        ref = torch.nn.functional.gelu(xd, approximate="tanh")
    else:
        ref = torch.nn.functional.silu(xd)
    err = (out - ref).abs()
    assert bool((err <= 3e-7 * ref.abs() + 1e-7 * xd.abs()).all()), float(
        (err / (ref.abs() + 1e-30)).max()
    )


def test_erf_inside_gelu_matches_float64():
    # every 1.2e-4 over [-12, 12] plus seeded normal draws; against the float64 GELU (torch's own
    # float32 GELU is up to 1.2e-6 off it here, ours 4.5e-7: an unseeded comparison with torch's
    # float32 at atol 1e-6 failed once at x = -3.47)
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.linspace(-12, 12, 200001), torch.randn(4096, generator=g) * 3])
    out = run_native(
        x[:, None].contiguous(),
        torch.ones(1, 1),
        EpilogueSpec.decode("gelu"),
        [],
        Config(*TILES[0], 64),
    )
    ref = torch.nn.functional.gelu(x.double())
    torch.testing.assert_close(out[:, 0].double(), ref, rtol=1e-6, atol=1e-6)


def test_nan_and_inf_propagate():
    a = torch.tensor([[float("nan")], [float("inf")], [-float("inf")], [1.0]])
    out = run_native(a, torch.ones(1, 1), EpilogueSpec.decode("relu"), [], Config(*TILES[0], 64))
    ref = torch.relu(a)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


def test_bf16_output_rounds_like_torch():
    a, b = _make(17, 33, 40, torch.float32, "c", "c")
    spec = EpilogueSpec.decode("out=bf16")
    out = run_native(a, b, spec, [], Config(*TILES[0], 64))
    f32 = run_native(a, b, EpilogueSpec(), [], Config(*TILES[0], 64))
    assert torch.equal(out, f32.to(torch.bfloat16))  # RNE from the same fp32 accumulator


@pytest.mark.parametrize("nr", [8, 24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_pack_matches_reference(nr, dtype):
    _, b = _make(1, 70, 13, dtype, "c", "weight_t")
    assert torch.equal(pack_b(b, nr), pack_b_reference(b, nr))


def test_pack_pairs_layout():
    b = torch.randn(5, 40).to(torch.bfloat16)
    p = pack_b_pairs(b, 32)
    assert p.shape == (2, 3, 32, 2)
    assert torch.equal(p[0, 1, 3, 0], b[2, 3]) and torch.equal(p[0, 1, 3, 1], b[3, 3])
    assert torch.equal(p[1, 2, 7, 0], b[4, 39]) and float(p[1, 2, 7, 1]) == 0.0


def test_scalar_isa_path():
    with config.override(isa="scalar"):
        assert native.cpu_info().isa == "scalar"
        a, b = _make(11, 13, 9, torch.float32, "t", "weight_t")
        spec = EpilogueSpec.decode("bias_col:f32;gelu")
        ops = _operands(spec, 11, 13)
        out = run_native(a, b, spec, ops, Config(4, 4, 8))
        _assert_close(out, a, b, spec, ops)


def test_avx512_variants_build():
    """The AVX-512 and AVX512-BF16 (vdpbf16ps) kernels compile (on any x86 build machine)."""
    spec = EpilogueSpec.decode("bias_col:f32;gelu;add:bf16")
    body = templates.render_source(spec, "bf16", "bf16", "avx512", kernels.TILES["avx512"][:2])
    assert "_mm512_dpbf16_ps" in body
    lib = native.build(
        native.render(body.replace("$", "$$")),
        name="gemm_avx512_buildcheck",
        isa="avx512",
        extra_flags=["-mavx512bf16", "-O1"],
    )
    assert hasattr(lib, "tp_gemm_6x32") and hasattr(lib, "tp_gemm_4x48")
    assert hasattr(lib, "tp_gemm_dpbf16_4x32")
    large, small = templates.DP_TILES["large"], templates.DP_TILES["small"]
    body = templates.render_source(spec, "bf16", "bf16", "avx512", large + small, True)
    lib = native.build(
        native.render(body.replace("$", "$$")),
        name="gemm_avx512_dp_buildcheck",
        isa="avx512",
        extra_flags=["-mavx512bf16", "-O1"],
    )
    assert all(hasattr(lib, f"tp_gemm_{mr}x{nr}") for mr, nr in large)
    assert all(hasattr(lib, f"tp_gemm_dp_{mr}x{nr}") for mr, nr in small)


def test_tile_width_must_match_isa():
    with pytest.raises(ValueError, match="multiple of the vector width 8"):
        templates.render_source(EpilogueSpec(), "f32", "f32", "avx2", ((4, 12),))


def test_unknown_tile_is_invalid_candidate():
    from torchport.autotune import InvalidCandidate

    a, b = _make(3, 3, 3, torch.float32, "c", "c")
    with pytest.raises(InvalidCandidate, match="tile 3x5 is not built"):
        run_native(a, b, EpilogueSpec(), [], Config(3, 5, 4))


# --- vdpbf16ps tiles (AVX512-BF16): bf16 A as k pairs, B pair-packed -----------------------------

needs_dp = pytest.mark.skipif(
    not native.cpu_info().has_avx512_bf16, reason="needs AVX512-BF16 (vdpbf16ps)"
)
SMALL_DP_TILES = templates.DP_TILES["small"]  # their own weight-streaming driver, whole K
LARGE_DP_TILES = templates.DP_TILES["large"]  # the blocked drivers (M and K blocks)
SMALL_DP_SHAPES = [(1, 1, 2), (1, 67, 14), (3, 129, 40), (8, 70, 2), (13, 200, 64), (32, 131, 38)]
DP_CHAINS = ["", "bias_col:bf16;gelu;add:bf16", "scale_row:f32;silu", "gelu;out=f32", "relu"]


@needs_dp
@pytest.mark.parametrize(
    "m,n,k", SMALL_DP_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SMALL_DP_SHAPES]
)
@pytest.mark.parametrize("tile", SMALL_DP_TILES, ids=[f"{t[0]}x{t[1]}" for t in SMALL_DP_TILES])
@pytest.mark.parametrize("chain", DP_CHAINS, ids=[c or "none" for c in DP_CHAINS])
@pytest.mark.parametrize("a_layout", ["c", "t", "strided"])
def test_dp_tiles_grid(m, n, k, tile, chain, a_layout):
    """Every small-M pair-dot tile over remainder rows and columns, epilogues (per tile; the
    deferred pass: test_dp_deferred_epilogue_pass), bf16 and fp32 output, A read in place or
    copied (transposed, strided), two threads."""
    a, b = _make(m, n, k, torch.bfloat16, a_layout, "weight_t")
    spec = EpilogueSpec.decode(chain)
    ops = _operands(spec, m, n)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for pf in (0, 32):
            out = run_native(a, b, spec, ops, Config(*tile, m, pf, dp=1))
            _assert_close(out, a, b, spec, ops)
    finally:
        torch.set_num_threads(before)


@needs_dp
@pytest.mark.parametrize("defer_max", [0, 16], ids=["per_tile", "deferred"])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 17])
@pytest.mark.parametrize("chain", ["bias_col:bf16;gelu;add:bf16", "silu;out=f32"])
def test_dp_deferred_epilogue_pass(m, chain, defer_max, monkeypatch):
    """The small-M pair-dot driver's GELU/SiLU epilogue per tile (the default, ``DEFER_MAX_M``
    0) and, with ``DEFER_MAX_M`` 16, deferred (raw sums in the launcher's workspace for bf16
    output, in C for fp32 output, one pass per chunk; M = 17 per tile): both match the
    reference, N not a multiple of the panel width, with two threads and with one."""
    assert templates.DEFER_MAX_M == 0
    monkeypatch.setattr(templates, "DEFER_MAX_M", defer_max)
    caches = (kernels.library, kernels._dp_function, kernels.launcher)
    for f in caches:  # libraries rendered with this setting (the disk cache keys on the source)
        f.cache_clear()
    spec = EpilogueSpec.decode(chain)
    assert spec.deferrable
    a, b = _make(m, 200, 38, torch.bfloat16, "c", "weight_t")
    ops = _operands(spec, m, 200)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for tile in SMALL_DP_TILES:
                out = run_native(a, b, spec, ops, Config(*tile, m, 32, dp=1))
                _assert_close(out, a, b, spec, ops)
    finally:
        torch.set_num_threads(before)
        for f in caches:
            f.cache_clear()


@needs_dp
@pytest.mark.parametrize("m,n,k", [(0, 5, 4), (1, 1, 1), (5, 45, 17), (32, 70, 29)], ids=str)
@pytest.mark.parametrize("tile", SMALL_DP_TILES, ids=[f"{t[0]}x{t[1]}" for t in SMALL_DP_TILES])
@pytest.mark.parametrize("b_layout", ["c", "strided"])
def test_dp_small_tiles_any_b_layout_and_odd_k(m, n, k, tile, b_layout):
    """The small-M tiles read the same pair packing as the large ones (any B layout, odd K
    padded with a zero pair)."""
    a, b = _make(m, n, k, torch.bfloat16, "c", b_layout)
    out = run_native(a, b, EpilogueSpec(), [], Config(*tile, max(m, 1), dp=1))
    _assert_close(out, a, b, EpilogueSpec(), [])


@needs_dp
def test_dp_matches_the_widening_tile_closely():
    """Both accumulate exact bf16 products in fp32: they differ by summation order only."""
    a, b = _make(8, 96, 512, torch.bfloat16, "c", "weight_t")
    spec = EpilogueSpec.decode("out=f32")
    dp = run_native(a, b, spec, [], Config(8, 32, 8, dp=1))
    wide = run_native(a, b, spec, [], Config(*TILES[0], 8))
    mag = (a.double().abs() @ b.double().abs()).max().item()
    torch.testing.assert_close(dp, wide, atol=1e-5 * mag, rtol=0)


@pytest.mark.parametrize("n,k", [(1, 2), (45, 18), (64, 6)])
def test_pair_words_pack_matches_reference(n, k):
    _, b = _make(1, n, k, torch.bfloat16, "c", "weight_t")
    words = pair_words(b)
    assert words is not None
    packed = pack_b(words, 32)
    ref = pack_pairs_reference(b, 32)
    assert torch.equal(packed.view(torch.bfloat16).view(ref.shape), ref)
    assert torch.equal(ref, pack_b_pairs(b, 32))  # the vdpbf16ps kernels' layout


@pytest.mark.parametrize(
    "dtype,k,layout",
    [(torch.bfloat16, 7, "weight_t"), (torch.bfloat16, 8, "c"), (torch.float32, 8, "weight_t")],
    ids=["odd_k", "row_major", "f32"],
)
def test_pair_words_rejects_what_it_cannot_view(dtype, k, layout):
    _, b = _make(1, 5, k, dtype, "c", layout)
    assert pair_words(b) is None
    if dtype == torch.bfloat16:  # pack_b_pairs' torch copy instead
        assert torch.equal(pack_b_pairs(b, 32), pack_pairs_reference(b, 32))


def test_dp_config_is_invalid_without_bf16_dot_or_on_other_tiles():
    from torchport.autotune import InvalidCandidate

    with pytest.raises(InvalidCandidate):
        kernels.check_config(Config(8, 32, 8, dp=1), "avx2")
    with pytest.raises(InvalidCandidate):
        kernels.check_config(Config(6, 32, 8, dp=1), "avx512")
    with pytest.raises(InvalidCandidate):  # the small-M tiles read whole K
        kernels.check_config(Config(8, 32, 8, kc=64, dp=1), "avx512")
    with pytest.raises(ValueError, match="no vdpbf16ps tile 6x32"):
        templates.render_source(EpilogueSpec(), "bf16", "bf16", "avx512", ((6, 32),), dp=True)


DP_SHAPES = [(0, 5, 4), (1, 1, 1), (7, 31, 17), (13, 70, 29), (37, 130, 64), (50, 97, 301)]


@needs_dp
@pytest.mark.parametrize("m,n,k", DP_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in DP_SHAPES])
@pytest.mark.parametrize("mr,nr", LARGE_DP_TILES, ids=[f"{r}x{c}" for r, c in LARGE_DP_TILES])
@pytest.mark.parametrize("a_layout", ["c", "t", "strided"])
@pytest.mark.parametrize("b_layout", ["c", "weight_t"])
@pytest.mark.parametrize("mc,kc", [(64, 0), (5, 16)], ids=["whole_k", "kc16_mc5"])
def test_dp_grid(m, n, k, mr, nr, a_layout, b_layout, mc, kc):
    """Every vdpbf16ps tile against the fp64 reference: odd K (a zero pair at the end), rows
    and columns not multiples of the tile, transposed/strided A (copied into pairs), K blocks."""
    a, b = _make(m, n, k, torch.bfloat16, a_layout, b_layout)
    out = run_native(a, b, EpilogueSpec(), [], Config(mr, nr, mc, kc=kc, dp=1))
    _assert_close(out, a, b, EpilogueSpec(), [])


@needs_dp
@pytest.mark.parametrize("text", ["gelu_tanh;add:bf16;bias_col:bf16", "relu;out=f32"])
def test_dp_epilogue_chains(text):
    spec = EpilogueSpec.decode(text)
    a, b = _make(31, 75, 64, torch.bfloat16, "c", "weight_t")
    ops = _operands(spec, 31, 75)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = run_native(a, b, spec, ops, Config(*LARGE_DP_TILES[0], 16, dp=1))
    finally:
        torch.set_num_threads(before)
    _assert_close(out, a, b, spec, ops)


@needs_dp
def test_dp_matches_fp32_tiles_bit_for_bit_on_exact_sums():
    """Small integers: every product and partial sum is exact in fp32, so the pairwise dot
    and the fp32 FMA tiles agree exactly with the reference."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-4, 5, (29, 67), generator=g).to(torch.bfloat16)
    b = torch.randint(-4, 5, (67, 101), generator=g).to(torch.bfloat16)
    ref = (a.double() @ b.double()).to(torch.bfloat16)
    for mr, nr in LARGE_DP_TILES + SMALL_DP_TILES:
        assert torch.equal(run_native(a, b, EpilogueSpec(), [], Config(mr, nr, 8, dp=1)), ref)


def test_dp_config_is_invalid_where_it_does_not_apply():
    from torchport.autotune import InvalidCandidate

    a, b = _make(3, 3, 4, torch.float32, "c", "c")
    if native.cpu_info().has_avx512_bf16:
        with pytest.raises(InvalidCandidate, match="need bf16 operands"):
            run_native(a, b, EpilogueSpec(), [], Config(*LARGE_DP_TILES[0], 4, dp=1))
        with pytest.raises(InvalidCandidate, match="ks=1 and an even kc"):
            run_native(a, b, EpilogueSpec(), [], Config(*LARGE_DP_TILES[0], 4, ks=2, dp=1))
        with pytest.raises(InvalidCandidate, match="ks=1 and an even kc"):
            run_native(a, b, EpilogueSpec(), [], Config(*LARGE_DP_TILES[0], 4, kc=7, dp=1))
    with (
        config.override(isa="avx2"),
        pytest.raises(InvalidCandidate, match="vdpbf16ps tile 6x64 is not built"),
    ):
        run_native(a.bfloat16(), b.bfloat16(), EpilogueSpec(), [], Config(6, 64, 4, dp=1))
    with pytest.raises(ValueError, match="vdpbf16ps tiles need isa avx512 and bf16 B"):
        templates.render_source(EpilogueSpec(), "f32", "f32", "avx512", ((6, 64),), dp=True)


@pytest.mark.parametrize("k,n", [(5, 40), (6, 64), (13, 70)], ids=str)
@pytest.mark.parametrize("b_layout", ["c", "weight_t"])
def test_pack_pairs_matches_reference(k, n, b_layout):
    _, b = _make(1, n, k, torch.bfloat16, "c", b_layout)
    ref = pack_b_reference(torch.cat([b, b.new_zeros(k % 2, n)]), 32)  # [np, K even, 32]
    ref = ref.view(ref.shape[0], -1, 2, 32).transpose(2, 3)
    assert torch.equal(pack_b_pairs(b, 32), ref)
    assert torch.equal(pack_pairs_reference(b, 32), ref)
    out = torch.full_like(ref, 7.0).contiguous()
    assert pack_b_pairs(b, 32, out=out) is out and torch.equal(out, ref)


def test_large_m_bf16_candidates_put_the_dp_tiles_first():
    from torchport.gemm.mm import candidates

    names = [c.name for c in candidates(512, 4096, 1024, "avx512", 2)]
    if kernels.amx_ready():  # the AMX kernel's instead (tests/test_gemm_amx.py)
        assert names[1].startswith("amx") and not any(n.startswith("dp") for n in names)
    elif native.cpu_info().has_avx512_bf16:
        assert names[1].startswith("dp6x64") and len(names) <= 10
    with config.override(isa="avx2"):
        names = [c.name for c in candidates(512, 4096, 1024, "avx2", 2)]
        assert not any(n.startswith("dp") for n in names)
    names = [c.name for c in candidates(512, 4096, 1024, "avx512", 4)]  # fp32: no dp tiles
    assert not any(n.startswith("dp") for n in names)
    for m, tiles in ((8, SMALL_DP_TILES), (33, LARGE_DP_TILES), (512, LARGE_DP_TILES)):
        for c in candidates(m, 4096, 1024, "avx512", 2):  # bf16: each M's own dp tiles
            if c.param("dp", 0) == 1:  # (2: the AMX kernel, tests/test_gemm_amx.py)
                assert (int(c.param("mr")), int(c.param("nr"))) in tiles
                assert c.name.startswith(f"dp{c.param('mr')}x{c.param('nr')}_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_single_panel_chunks_from_panel_chunk_m_rows(dtype):
    """From PANEL_CHUNK_M rows the two threads take one panel at a time (fp32 and, where the
    CPU has them, vdpbf16ps tiles): the same result as the reference."""
    m = templates.PANEL_CHUNK_M + 3
    cfgs = [Config(*TILES[0], 64)]
    if dtype == torch.bfloat16 and LARGE_DP_TILES and native.cpu_info().has_avx512_bf16:
        cfgs.append(Config(*LARGE_DP_TILES[0], 64, dp=1))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = _make(m, 7 * 64 + 5, 33, dtype, "c", "weight_t")
        for cfg in cfgs:
            _assert_close(run_native(a, b, EpilogueSpec(), [], cfg), a, b, EpilogueSpec(), [])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kc", [0, 96], ids=["whole_k", "kc96"])
def test_panel_and_m_block_chunks_with_epilogue(dtype, kc):
    """From PANEL_CHUNK_M rows the two threads take (panel, M block) chunks: M blocks of mc
    rows not a multiple of MR (the last one short), K blocks carried between them, and an
    epilogue whose operands depend on the row (residual) and column (bias) give the reference
    result."""
    m = templates.PANEL_CHUNK_M + 45
    spec = EpilogueSpec.decode("bias_col:f32;gelu;add:f32")
    cfgs = [Config(*TILES[0], 40, kc=kc)]
    if dtype == torch.bfloat16 and LARGE_DP_TILES and native.cpu_info().has_avx512_bf16:
        cfgs += [Config(*t, 40, kc=kc, dp=1) for t in LARGE_DP_TILES]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = _make(m, 5 * 64 + 7, 250, dtype, "c", "weight_t")
        ops = _operands(spec, m, b.shape[1])
        for cfg in cfgs:
            _assert_close(run_native(a, b, spec, ops, cfg), a, b, spec, ops)
    finally:
        torch.set_num_threads(before)


def _activation_inputs() -> torch.Tensor:
    """Dense [-12, 12] plus zeros, tiny and subnormal values, large magnitudes, the clamp and
    overflow edges of the vector maths, +-inf and NaN (a multiple of 16 long: all vector lanes)."""
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 5.5437, -5.5437, 5.6, -5.6]
    edges += [10.0, -10.0, 20.0, -20.0, 86.9, 87.1, -88.6, -88.8, -89.5, 100.0, -100.0]
    edges += [1e4, -1e4, 3e38, -3e38, math.inf, -math.inf, math.nan]
    x = torch.cat([torch.linspace(-12, 12, 24001), torch.tensor(edges)])
    return torch.cat([x, torch.zeros(-x.numel() % 16)])


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_vector_activation_against_float64_torch(act):
    """The activations alone (the native epilogue pass over float32 values, no GEMM in front):
    within 3e-7 relative + 1e-7 |x| absolute of torch in float64 on finite inputs (2e-7 |x| for
    GELU (erf): on this dense grid torch's own float32 GELU reaches 1.04x the 1e-7 bound, ours
    1.51x at x = -3.66, the previous erf with its blend 1.75x), and torch's +-inf, NaN and signed
    zeros (gelu(-inf) and silu(-inf) are NaN, as torch's -inf * 0)."""
    x = _activation_inputs()
    out = kernels.epilogue_pass(EpilogueSpec.decode(act), torch.float32, ISA)(x.clone()[None], [])
    out = out[0].double()
    xd = x.double()
    if act == "gelu":
        ref = torch.nn.functional.gelu(xd)
    elif act == "gelu_tanh":
        ref = torch.nn.functional.gelu(xd, approximate="tanh")
    else:
        ref = torch.nn.functional.silu(xd)
    fin = ref.isfinite()
    err = (out[fin] - ref[fin]).abs()
    bound = 3e-7 * ref[fin].abs() + (2e-7 if act == "gelu" else 1e-7) * xd[fin].abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (float(xd[fin][worst]), float(err[worst]))
    assert torch.equal(out[~fin].isnan(), ref[~fin].isnan())
    assert torch.equal(out[ref.isinf()], ref[ref.isinf()])
    zero = ref == 0
    assert torch.equal(out[zero].signbit(), ref[zero].signbit())


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_vector_sigmoid_near_exp_overflow(isa, dtype):
    """SiLU at x in [-88.72, -88.38] (and GELU-tanh where its sigmoid argument is there): exp(-x)
    is a finite float in [2^127.5, 2^128], but the exponent bits 2^n of n = 128 were inf, so the
    result was -0 where torch gives x exp(x) ~ -3e-37 (a normal float, in bf16 as well)."""
    if ISA_LEVELS.index(isa) > ISA_LEVELS.index(native.cpu_info().max_isa):
        pytest.skip(f"no {isa} on this CPU")
    silu_x = torch.linspace(-88.72, -88.38, 48)
    # gelu_tanh's sigmoid argument 2 sqrt(2/pi) (x + 0.044715 x^3) is -88.4 .. -88.7 here
    gelu_x = torch.linspace(-10.0605, -10.0465, 48)
    cases = [("silu", silu_x)] + ([("gelu_tanh", gelu_x)] if dtype == torch.float32 else [])
    for act, x in cases:  # (in bf16 the GELU range holds no value; the SiLU one -88.5)
        x = x.to(dtype)
        out = kernels.epilogue_pass(EpilogueSpec.decode(act), dtype, isa)(x.clone()[None], [])
        xd = x.double()
        if act == "silu":
            ref = torch.nn.functional.silu(xd)
        else:  # x sigmoid(2y), y the tanh's argument (1 + tanh(y) is 0 in float64 here)
            ref = xd * torch.sigmoid(2 * 0.7978845608028654 * (xd + 0.044715 * xd**3))
        # float32: the float log2e in the exponent adds 1.3e-8 |y| relative (1.2e-6 at 88); for
        # GELU-tanh y's own float32 roundings (a few ulps of 88) move exp(y) by up to ~1e-5
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-6 if act == "silu" else 3e-5
        assert bool((ref != 0).all())
        torch.testing.assert_close(out[0].double(), ref.to(dtype).double(), rtol=tol, atol=0)


# the vector GELU's bound per build: err <= 3e-7 |ref| + B |x| against float64 (epilogue.py's
# docstring). AVX-512's piecewise Phi reaches 0.37 of its bound on every float32 in [-10, 10], so
# its degree 4 (Phi off by 3.6e-7) or a wrong digit in a coefficient fails here
GELU_X_BOUND = {"avx2": 2e-7, "avx512": 1e-7}


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_vector_gelu_against_float64_dense(isa):
    """``tp_vgelu`` of each vector build on a dense grid (every 2^-13 over [-10, 10], so about 4000
    points in each of AVX-512's width-1/2 intervals, their edges included) plus the clamp edges,
    within the build's stated bound of torch's float64 GELU."""
    if ISA_LEVELS.index(isa) > ISA_LEVELS.index(native.cpu_info().max_isa):
        pytest.skip(f"no {isa} on this CPU")
    x = torch.arange(-10 * 2**13, 10 * 2**13 + 1, dtype=torch.float64) / 2**13
    edges = [5.75, -5.75, 5.7499995, -5.7499995, 6.0, -6.0, 5.73, -5.73]
    x = torch.cat([x, torch.tensor(edges, dtype=torch.float64)]).float()
    x = torch.cat([x, torch.zeros(-x.numel() % 16)])
    out = kernels.epilogue_pass(EpilogueSpec.decode("gelu"), torch.float32, isa)(
        x.clone()[None], []
    )
    xd = x.double()
    ref = torch.nn.functional.gelu(xd)
    err = (out[0].double() - ref).abs()
    bound = 3e-7 * ref.abs() + GELU_X_BOUND[isa] * xd.abs()
    worst = int((err / (bound + 1e-30)).argmax())
    assert bool((err <= bound).all()), (float(xd[worst]), float(err[worst]), float(bound[worst]))


# the degree-4 Phi of bf16 outputs (templates._GELU_PHI4), in bf16 ulps of the exact GELU: x in
# (-5.75, -4] (|GELU| < 1.3e-4, relative error up to 2e-3) and x > -4; degree 5 reaches 0.64 /
# 0.58 and 0.51 there (through its float32 result)
GELU_BF16_ULPS = {"tail": 1.0, "main": 0.57}


@pytest.mark.skipif(native.cpu_info().max_isa != "avx512", reason="needs AVX-512")
def test_vector_gelu_bf16_output_against_float64():
    """A bf16 output's GELU (the epilogue pass with ``out=bf16``, the vdpbf16ps tiles' vocabulary:
    degree-4 Phi) on every 2^-13 over [-10, 10], the table's interval edges and clamp, and torch's
    edges: within :data:`GELU_BF16_ULPS` of the float64 GELU; x <= -5.75 (Phi taken as 0) within
    2.6e-8 absolute; -0, -huge -> -0, -inf -> NaN, +inf -> inf, NaN -> NaN; and at most 2 % of
    the grid's values off the correctly rounded bf16 (a wrong coefficient digit shows as more)."""
    # the tables' lookups: one per coefficient (degree 4 for bf16 outputs, 5 for float32 ones)
    for otag, lookups in (("bf16", 5), ("f32", 6)):
        vocab = templates.vocabulary("avx512", otag=otag)
        assert vocab.count("_mm512_permutex2var_ps") == lookups, otag
    x = torch.arange(-10 * 2**13, 10 * 2**13 + 1, dtype=torch.float64) / 2**13
    edges = [5.75, -5.75, 5.7499995, -5.7499995, 6.0, -6.0, -5.74, 0.25, -0.25, 3e38, -3e38]
    edges += [-0.0, math.inf, -math.inf, math.nan]
    x = torch.cat([x, torch.tensor(edges, dtype=torch.float64)]).float()
    x = torch.cat([x, torch.zeros(-x.numel() % 16)])
    apply = kernels.epilogue_pass(EpilogueSpec.decode("gelu;out=bf16"), torch.float32, "avx512")
    out = apply(x.clone()[None], [])[0]
    assert out.dtype == torch.bfloat16
    out, xd = out.double(), x.double()
    ref = torch.nn.functional.gelu(xd)
    fin = ref.isfinite() & xd.isfinite() & (xd.abs() < 1e30)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    err = (out - ref).abs()
    for part, sel in (("tail", (xd > -5.75) & (xd <= -4)), ("main", xd > -4)):
        sel = sel & fin & (ref != 0)
        worst = float((err[sel] / ulp[sel]).max())
        assert worst <= GELU_BF16_ULPS[part], (part, worst)
    beyond = fin & (xd <= -5.75)
    assert float(err[beyond].max()) <= 2.6e-8
    assert bool((out[xd == 0] == 0).all())
    grid = fin & (xd > -5.75)
    off = float((out[grid] != ref[grid].to(torch.bfloat16).double()).double().mean())
    assert off <= 0.02, off
    special = {3e38: 3e38, -3e38: -0.0, -0.0: -0.0, math.inf: math.inf}
    for v, want in special.items():
        got = out[(x == v) & (x.signbit() == (math.copysign(1, v) < 0))]
        assert torch.equal(got, torch.full_like(got, want).to(torch.bfloat16).double()), (v, got)
        assert torch.equal(got.signbit(), torch.full_like(got, want).signbit()), v
    assert bool(out[x.isnan()].isnan().all()) and bool(out[x == -math.inf].isnan().all())


# --- the store's operand prefetch (epilogue.emit_prefetch) -----------------------------------------

_PF_PROBE = r"""
static const char *tp_seen[1024];
static int64_t tp_nseen;
#define VPREFETCH(p) (tp_seen[tp_nseen++] = (const char *)(p))
TP_INLINE void tp_epi_pf(int64_t i, int64_t j, int64_t nr, const void *const *ep,
        const int64_t *eld) {
    (void)i; (void)j; (void)nr; (void)ep; (void)eld;
    BODY
}
/* the addresses tp_epi_pf(i, j, nr) prefetches, into out; returns how many */
TP_EXPORT int64_t tp_pf_probe(int64_t i, int64_t j, int64_t nr, const void *const *ep,
        const int64_t *eld, int64_t *out) {
    tp_nseen = 0;
    tp_epi_pf(i, j, nr, ep, eld);
    for (int64_t q = 0; q < tp_nseen; ++q) out[q] = (int64_t)(intptr_t)tp_seen[q];
    return tp_nseen;
}
"""

PF_CHAINS = [
    "bias_col:f32;gelu;add:f32",
    "bias_col:bf16;silu",
    "gelu_tanh;add:bf16;bias_col:bf16",
    "bias_row:f32;relu;scale_col:f32",
    "scale_row:bf16;add:f32;scale_col:bf16",
    "relu",
]


@pytest.mark.parametrize("text", PF_CHAINS)
def test_store_prefetch_covers_every_operand_line(text):
    """Before a tile's K loop (or a row block's weight stream) every 64-byte line the epilogue
    will read at row i, columns [j, j + nr) is prefetched: each line of a residual's or column
    vector's span (spans up to the row driver's 64-column blocks, at any alignment) and a row
    vector's element i; nothing outside the operands' own elements."""
    import ctypes

    from torchport.gemm.epilogue import OPERAND_KINDS, emit_prefetch

    spec = EpilogueSpec.decode(text)
    src = native.render(_PF_PROBE.replace("BODY", emit_prefetch(spec)).replace("$", "$$"))
    fn = native.build(src, name=f"gemm_pf_probe_e{len(spec.ops)}", isa="scalar").tp_pf_probe
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int64
    m, n = 5, 200
    dts = {"f32": torch.float32, "bf16": torch.bfloat16}
    ops = [op for op in spec.ops if op.kind in OPERAND_KINDS]
    shapes = {"add": (m, n + 3), "bias_row": (m,), "scale_row": (m,)}  # residual rows padded
    tensors = [torch.zeros(shapes.get(op.kind, (n,)), dtype=dts[op.dtype]) for op in ops]
    ptrs = (ctypes.c_void_p * max(1, len(ops)))(*[t.data_ptr() for t in tensors])
    lds = (ctypes.c_int64 * max(1, len(ops)))(*[t.stride(0) for t in tensors])
    out = (ctypes.c_int64 * 1024)()
    for i, j, nr in [(0, 0, 1), (1, 3, 8), (4, 7, 24), (2, 17, 64), (3, 100, 64), (4, 131, 48)]:
        got = {a // 64 for a in out[: fn(i, j, nr, ptrs, lds, out)]}
        want: set[int] = set()
        allowed: set[int] = set()
        for op, t in zip(ops, tensors):
            size = t.element_size()
            if op.kind == "add":
                base = t.data_ptr() + i * t.stride(0) * size
                want |= {(base + e * size) // 64 for e in range(j, j + nr)}
            elif op.kind in ("bias_col", "scale_col"):
                want |= {(t.data_ptr() + e * size) // 64 for e in range(j, j + nr)}
            else:
                want.add((t.data_ptr() + i * size) // 64)
            allowed |= {(t.data_ptr() + e * size) // 64 for e in range(t.numel())}
        assert want <= got, f"{text} at i={i} j={j} nr={nr}: lines {sorted(want - got)} missed"
        assert got <= allowed, f"{text}: prefetches outside the operands"


def test_eo_ab_bench_times_both_builds_and_restores_the_shipped_tiles(capsys):
    """``bench gemm_eo_ab`` builds each config with and without the even/odd pairs (both checked
    against the reference inside), then leaves the engine's own tiles in place: the shipped
    ``_eo_pairs`` back and no launcher of either build cached."""
    from torchport import benchmarks

    argv = ["--m", "8", "--d", "64", "--h", "40", "--cfgs", "4:24:8:0,6:16:5:8", "--quick"]
    shipped = templates._eo_pairs
    assert benchmarks.run_benchmark("gemm_eo_ab", [*argv, "--copies", "1"]) == 0
    out = capsys.readouterr().out
    assert "t4x24_mc8_pf0: on/off" in out and "t6x16_mc5_pf8: on/off" in out
    assert templates._eo_pairs is shipped
    assert kernels.launcher.cache_info().currsize == 0


@needs_dp
def test_epilogue_ab_bench_runs_a_dp_config(capsys):
    """``bench gemm_epilogue_ab`` on a small-M ``vdpbf16ps`` config: its weights are pair-packed
    (packed as fp32-tile panels, the check against the reference failed before any timing)."""
    from torchport import benchmarks

    argv = ["--m", "8", "--d", "1024", "--h", "4096", "--dtype", "bfloat16", "--quick"]
    assert benchmarks.run_benchmark("gemm_epilogue_ab", [*argv, "--cfg", "8:32:8:0:0:1:1:1"]) == 0
    assert "cfg=8:32:8:0:0:1:1:1" in capsys.readouterr().out


def test_epilogue_ab_bench_gives_every_launcher_every_copy_at_one_reuse_distance():
    """``bench gemm_epilogue_ab``'s six launchers take copies in call order over a copy count
    coprime with six: each launcher visits every copy, and every call reads the least recently
    used copy (the same number of other copies read since its last use, for every launcher).
    Eight bf16 copies pinned each launcher to half of them; rotating by round gave fp32's bare a
    copy the previous call had just streamed (warm)."""
    import runpy

    from torchport import benchmarks

    bench_dir = benchmarks.bench_dir()
    assert bench_dir is not None
    copy_count = runpy.run_path(str(bench_dir / "bench_gemm_epilogue_ab.py"))["copy_count"]
    for nbytes in (8 << 20, 16 << 20, 2 << 20, 40 << 20, 1 << 30):  # bf16/fp32 1024->4096, ...
        copies = copy_count(nbytes, 6)
        assert copies * nbytes >= 64 << 20 and math.gcd(copies, 6) == 1
        seq = [call % copies for call in range(6 * copies * 3)]
        for slot in range(6):
            assert set(seq[slot::6]) == set(range(copies)), (nbytes, slot)
        for t in range(copies, len(seq)):  # the previous use of the copy: `copies` calls ago
            assert seq[t - copies] == seq[t] and seq[t] not in seq[t - copies + 1 : t]


def test_prebuild_jobs_see_the_callers_config_override(monkeypatch, tmp_path):
    """prebuild's pool threads build in the caller's context: under
    ``config.override(cache_dir=...)`` every job reads the override, not the environment's value
    (the threads used to see the environment's, so kernels compiled into the wrong cache)."""
    seen: list[str] = []

    def record(*args, **kwargs):
        seen.append(config.get("cache_dir"))

    monkeypatch.setattr(kernels, "library", record)
    monkeypatch.setattr(kernels, "_pack_fn", record)
    monkeypatch.setattr(kernels, "_pass_function", record)
    spec = EpilogueSpec((Op("relu"),))  # one op: the epilogue-pass job runs too
    with config.override(cache_dir=str(tmp_path)):
        kernels.prebuild(spec, "f32", "f32", ISA, TILES[:2], ())
    assert seen and set(seen) == {str(tmp_path)}
