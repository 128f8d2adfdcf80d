"""The row-streaming small-M GEMM driver (torchport.gemm.rows) vs the float64 reference."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.test_gemm_kernels import _assert_close, _make, _operands
from torchport import native
from torchport.autotune import InvalidCandidate
from torchport.gemm import kernels, rows
from torchport.gemm.epilogue import EpilogueSpec
from torchport.gemm.kernels import Config, run_native
from torchport.gemm.pack import pack_b, pack_b_reference

ISA = native.cpu_info().isa
pytestmark = pytest.mark.skipif(ISA not in ("avx2", "avx512"), reason="AVX2/AVX-512 driver")

# K around the driver's steps (two vectors, one vector, scalar tail) and N around its groups of
# four weight rows and blocks of rows.BLOCK (primes, 1, and a multi-block N for the threads)
SHAPES = [
    (1, 1, 1),
    (1, 13, 5),
    (2, 67, 16),
    (3, 64, 17),
    (5, 259, 1031),
    (8, 131, 33),
    (1, 1000, 97),
    (4, 4099, 40),
]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("a_layout", ["c", "t", "strided"])
@pytest.mark.parametrize("b_layout", ["weight_t", "c"])
@pytest.mark.parametrize("mr", rows.ROW_TILES)
def test_rows_grid(m, n, k, dtype, a_layout, b_layout, mr):
    a, b = _make(m, n, k, dtype, a_layout, b_layout)
    spec = EpilogueSpec()
    for pf in (0, 512):
        out = run_native(a, b, spec, [], Config(mr, 1, m, pf), packed=pack_b(b, 1))
        _assert_close(out, a, b, spec, [])


CHAINS = [
    ("bias_col:f32;gelu;add:f32;scale=0.5", torch.float32),
    ("scale_row:f32;silu;out=bf16", torch.float32),
    ("gelu_tanh;add:bf16;bias_col:bf16", torch.bfloat16),
    ("bias_row:f32;relu;scale_col:f32;out=f32", torch.bfloat16),
]


@pytest.mark.parametrize("text,dtype", CHAINS, ids=[c[0] for c in CHAINS])
@pytest.mark.parametrize("m,n,k", [(1, 19, 5), (3, 70, 33), (8, 131, 64)], ids=str)
def test_rows_epilogue_chains(text, dtype, m, n, k):
    """The fused epilogue runs over each block's sums (vector part and scalar tail)."""
    spec = EpilogueSpec.decode(text)
    a, b = _make(m, n, k, dtype, "c", "weight_t")
    ops = _operands(spec, m, n)
    out = run_native(a, b, spec, ops, Config(2, 1, m))  # packed through the cache
    _assert_close(out, a, b, spec, ops)


def test_rows_threads_agree_bitwise():
    """Each output is summed by one thread in a fixed order: one thread, two threads and the
    thread cap ``nt=1`` give the same bits."""
    a, b = _make(3, 4099, 300, torch.float32, "c", "weight_t")
    spec = EpilogueSpec.decode("bias_col:f32;gelu")
    ops = _operands(spec, 3, 4099)
    ref = run_native(a, b, spec, ops, Config(2, 1, 3))
    assert torch.equal(run_native(a, b, spec, ops, Config(2, 1, 3, nt=1)), ref)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(run_native(a, b, spec, ops, Config(2, 1, 3)), ref)
    finally:
        torch.set_num_threads(before)


def test_rows_empty_and_row_packing():
    a, b = _make(2, 0, 7, torch.float32, "c", "weight_t")
    assert run_native(a, b, EpilogueSpec(), [], Config(1, 1, 2)).shape == (2, 0)
    a, b = _make(0, 5, 7, torch.float32, "c", "weight_t")
    assert run_native(a, b, EpilogueSpec(), [], Config(1, 1, 1)).shape == (0, 5)
    # the row layout is pack_b with one-column panels: B^T contiguous
    _, b = _make(1, 9, 11, torch.float32, "c", "c")
    assert torch.equal(pack_b(b, 1), pack_b_reference(b, 1))
    assert torch.equal(pack_b(b, 1).view(9, 11), b.t())


def test_rows_bad_configs_are_invalid_candidates():
    a, b = _make(rows.MAX_M + 1, 8, 8, torch.float32, "c", "weight_t")
    with pytest.raises(InvalidCandidate, match=f"M <= {rows.MAX_M}, got M={rows.MAX_M + 1}"):
        run_native(a, b, EpilogueSpec(), [], Config(1, 1, 9))
    with pytest.raises(InvalidCandidate, match="mr in"):
        kernels.check_config(Config(3, 1, 4), ISA)
    with pytest.raises(InvalidCandidate, match="isa avx2/avx512"):
        kernels.check_config(Config(1, 1, 4), "scalar")
    with pytest.raises(InvalidCandidate, match="no kc or ks"):
        kernels.check_config(Config(1, 1, 4, ks=2), ISA)
    with pytest.raises(ValueError, match="MR must be one of"):
        rows.render_source(EpilogueSpec(), "f32", "f32", "avx2", 3)


def test_rows_driver_builds_for_avx512():
    """The AVX-512 build compiles (it cannot run on AVX2 machines): its exported entries."""
    for btag in ("f32", "bf16"):
        lib = kernels.library(EpilogueSpec.decode("bias_col:f32;gelu"), btag, btag, "avx512", 2, 1)
        assert hasattr(lib, "tp_gemm_rows_2")


def test_rows_candidate_offered_for_few_rows():
    G = sys.modules["torchport.gemm.mm"]
    for m in range(1, G.ROWS_M + 1):
        for n, k in ((4096, 1024), (11008, 4096)):  # 16 MB and, beyond L3, 180 MB
            names = [c.name for c in G.candidates(m, n, k, "avx2")]
            assert names[1] == f"r{2 if m >= 2 else 1}_pf0", names
            assert 2 <= len(names) <= 10
    assert not any(c.param("nr") == 1 for c in G.candidates(G.ROWS_M + 1, 4096, 1024, "avx2"))
    assert not any(c.param("nr") == 1 for c in G.candidates(1, 4096, 1024, "scalar"))


def test_rows_candidate_through_tuning_and_adaptive_runner():
    """The tuner's rotation packs the row layout per copy, and the small-M adaptive runner (the
    config, its one-thread twin and ATen) serves a fused epilogue with it."""
    mm = sys.modules["torchport.gemm.mm"]
    spec = EpilogueSpec.decode("bias_col:f32;gelu")
    copies = []
    for seed in range(2):
        a, b = _make(1, 300 + seed, 64, torch.float32, "c", "weight_t")
        copies.append((a[:, :], b[:, :300], _operands(spec, 1, 300)))
    cand = next(c for c in mm.candidates(1, 300, 64, ISA) if c.param("nr") == 1)
    fn = mm._tuning_fn(cand, spec)
    rot = mm._Rotation(copies)
    for i in range(3):
        a, b, ops = copies[i % 2]
        _assert_close(fn(rot), a, b, spec, ops)
    run = mm._native_runner(spec, mm._config(cand), adapt=True)
    a, b, ops = copies[0]
    for _ in range(12):  # through the adaptive runner's learning round
        _assert_close(run(a, b, ops), a, b, spec, ops)


def test_final_round_fns_split_the_copies_between_layouts(monkeypatch):
    """The autotuner's final round alternates the row driver and a 4x24 tile on one rotation:
    each layout reads its own share of the copies (packed on its first call, never repacked
    during the round), with the right results; too few copies for the layouts is refused."""
    mm = sys.modules["torchport.gemm.mm"]
    spec = EpilogueSpec.decode("bias_col:f32")
    copies = []
    for seed in range(4):
        a, b = _make(1, 200 + seed, 64, torch.float32, "c", "weight_t")
        copies.append((a[:, :], b[:, :200], _operands(spec, 1, 200)))
    cands = mm.candidates(1, 200, 64, ISA)
    pick = [
        next(c for c in cands if c.param("nr") == 1),
        next(c for c in cands if c.param("nr") not in (None, 1)),
    ]
    packs: list[int] = []
    real_pack = mm.pack_b

    def counting_pack(b, nr, out=None):
        packs.append(nr)
        return real_pack(b, nr, out=out)

    monkeypatch.setattr(mm, "pack_b", counting_pack)
    fns = mm._round_fns(pick, spec)
    rot = mm._Rotation(copies)
    for r in range(3):
        for lane, fn in enumerate(fns):
            out = fn(rot)
            idx = [i for i in range(4) if i % 2 == lane][r % 2]
            a, b, ops = copies[idx]
            _assert_close(out, a, b, spec, ops)
        if r == 0:
            assert sorted(packs) == sorted([1, 1, pick[1].param("nr"), pick[1].param("nr")])
    assert len(packs) == 4  # no repacking after the first calls
    with pytest.raises(InvalidCandidate):
        mm._round_fns(pick, spec)[0](mm._Rotation(copies[:1]))
