"""The lane SVD kernel of torchport.linalg.svd_lanes: against its reference, LAPACK and the
accumulated-V path; both V paths forced; groups mixing well and ill-conditioned, zero and
rank-deficient lanes; lanes of very different magnitude; non-finite input; the routing."""

from __future__ import annotations

import pytest
import torch

from torchport import native
from torchport.linalg import kernels, svd_lanes
from torchport.linalg.reference import svd_lanes_reference

DTYPES = (torch.float32, torch.float64)
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
# lane vector widths this machine builds (ymm; zmm on avx512)
WIDTHS = (32, 64) if native.cpu_info().isa == "avx512" else (32,)


@pytest.fixture(params=WIDTHS, ids=lambda w: f"v{w}")
def vbytes(request):
    return request.param


def _run(
    a: torch.Tensor,
    full: bool,
    uv: bool = True,
    kappa_c: float = svd_lanes.KAPPA_C,
    vbytes: int | None = None,
    reorder: bool = True,
    order: int | None = None,
):
    """tp_svd_lanes on contiguous (B, m, n) ``a``; ``vbytes``: lane width (None: the default);
    ``reorder``: the build that reorders the pairs within each round (the default) or not;
    ``order``: the pair order (None: svd_lanes.pair_order's, as the public path)."""
    b, m, n = a.shape
    k = min(m, n)
    order = svd_lanes.pair_order(k) if order is None else order
    s = a.new_empty((b, k))
    u = a.new_empty((b, m, m if full else k)) if uv else a.new_empty(0)
    vh = a.new_empty((b, n if full else k, n)) if uv else a.new_empty(0)
    kern = svd_lanes.library(a.dtype, native.cpu_info().isa, vbytes=vbytes, reorder=reorder)
    bad = kern.call_unchecked(
        a.data_ptr(), s.data_ptr(), u.data_ptr(), vh.data_ptr(), b, m, n, int(uv), int(full), order,
        kappa_c, 1,
    )  # fmt: skip
    return u, s, vh, bad


def _graded(b: int, m: int, n: int, cond: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """U diag(σ) Vᵀ with σ log-spaced from 1 to 1/cond (built in float64)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    q1 = torch.linalg.qr(torch.randn(b, m, k, generator=g, dtype=torch.float64))[0]
    q2 = torch.linalg.qr(torch.randn(b, n, k, generator=g, dtype=torch.float64))[0]
    sig = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return ((q1 * sig) @ q2.mT).to(dtype).contiguous()


def _check(a, u, s, vh, tol: float) -> None:
    """σ against float64 LAPACK, reconstruction and orthonormality of U and Vh."""
    k = min(a.shape[-2:])
    ad = a.double()
    ref = torch.linalg.svdvals(ad)
    scale = ref[:, :1].clamp_min(1e-300)
    assert float(((s.double() - ref).abs() / scale).max()) <= tol
    rec = (u[..., :k].double() * s.double().unsqueeze(-2)) @ vh[..., :k, :].double()
    nrm = ad.flatten(1).norm(dim=1).clamp_min(1e-300)
    assert float(((rec - ad).flatten(1).norm(dim=1) / nrm).max()) <= tol
    for x in (u.double(), vh.double().mT):
        eye = torch.eye(x.shape[-1], dtype=torch.float64)
        assert float((x.mT @ x - eye).abs().max()) <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(5, 5), (9, 6), (6, 9), (8, 8), (12, 12), (12, 16)], ids=str)
@pytest.mark.parametrize("full", [False, True], ids=["reduced", "full"])
def test_kernel_matches_reference(dtype, m, n, full, vbytes):
    """Kernel vs svd_lanes_reference (same algorithm) and LAPACK; 11 matrices: a partial group."""
    g = torch.Generator().manual_seed(m * 100 + n)
    a = torch.randn(11, m, n, generator=g, dtype=dtype)
    u, s, vh, bad = _run(a, full, vbytes=vbytes)
    assert bad == 0
    _check(a, u, s, vh, TOL[dtype])
    ur, sr, vhr = svd_lanes_reference(a, full)
    assert float((s - sr).abs().max()) <= TOL[dtype] * float(sr.max())
    k = min(m, n)
    # singular vectors up to sign (random input: distinct σ)
    for x, y in ((u[..., :k], ur[..., :k]), (vh[..., :k, :].mT, vhr[..., :k, :].mT)):
        sign = torch.sign((x * y).sum(-2, keepdim=True))
        assert float((x * sign - y).abs().max()) <= TOL[dtype] * 100
    assert torch.equal(_run(a, full, uv=False, vbytes=vbytes)[1], s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(32, 32), (17, 17), (40, 33), (20, 37)], ids=str)
def test_kernel_larger_shapes(dtype, m, n, vbytes):
    """Constant-size (32) and generic builds, tall and wide, against LAPACK."""
    g = torch.Generator().manual_seed(m + n)
    a = torch.randn(9, m, n, generator=g, dtype=dtype)
    for full in (False, True):
        u, s, vh, bad = _run(a, full, vbytes=vbytes)
        assert bad == 0
        _check(a, u, s, vh, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(32, 32), (7, 7), (20, 13)], ids=str)
@pytest.mark.parametrize("kappa_c", [svd_lanes.KAPPA_C, 1e30], ids=["auto-v", "accumulated"])
def test_round_reorder_bit_identical(dtype, m, n, kappa_c, vbytes):
    """Reordering the disjoint pairs within each round (for cache reuse) changes no bit of the
    results: same rotations, odd sizes (byes) and the accumulated-V path included."""
    g = torch.Generator().manual_seed(m * 7 + n)
    a = torch.randn(11, m, n, generator=g, dtype=dtype)
    new = _run(a, True, kappa_c=kappa_c, vbytes=vbytes)
    old = _run(a, True, kappa_c=kappa_c, vbytes=vbytes, reorder=False)
    assert new[3] == old[3] == 0
    for x, y in zip(new[:3], old[:3]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kappa_c", [0.0, 1e30], ids=["always-fast-v", "always-accumulated"])
def test_both_v_paths(dtype, kappa_c, vbytes):
    """Either way of forming V meets the tolerances, up to cond 1e6 (float64) / 1e3 (float32),
    against LAPACK and against the reference run with the same switch."""
    cond = 1e6 if dtype == torch.float64 else 1e3
    a = _graded(10, 12, 12, cond, dtype, seed=3)
    u, s, vh, bad = _run(a, False, kappa_c=kappa_c, vbytes=vbytes)
    assert bad == 0
    _check(a, u, s, vh, TOL[dtype])
    ur, sr, vhr = svd_lanes_reference(a, False, kappa_c=kappa_c)
    rec = (ur * sr.unsqueeze(-2)) @ vhr
    assert float((rec - a).abs().max()) <= TOL[dtype] * float(a.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_group(dtype, vbytes):
    """One lane group holding a zero matrix, a rank-deficient one, an ill-conditioned one and
    random ones (the group falls back to accumulated V): U and V stay orthonormal."""
    lanes = vbytes // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(7)
    a = torch.randn(2 * lanes, 12, 12, generator=g, dtype=dtype)
    a[1] = 0
    a[2] = a[2, :, :3] @ torch.randn(3, 12, generator=g, dtype=dtype)  # rank 3
    a[3] = _graded(1, 12, 12, 1e12 if dtype == torch.float64 else 1e7, dtype, seed=4)[0]
    for full in (False, True):
        u, s, vh, bad = _run(a, full, vbytes=vbytes)
        assert bad == 0
        tol = TOL[dtype] * 10
        for x in (u.double(), vh.double().mT):
            eye = torch.eye(x.shape[-1], dtype=torch.float64)
            assert float((x.mT @ x - eye).abs().max()) <= tol
        rec = (u[..., :12] * s.unsqueeze(-2)) @ vh[..., :12, :]
        assert float((rec.double() - a.double()).abs().max()) <= tol * float(a.abs().max())
        assert float(s[1].abs().max()) == 0.0 and float(s[2, 3:].max()) <= tol * float(s[2, 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lane_scaling(dtype, vbytes):
    """Lanes of very different magnitude in one group: each lane is scaled by its own power of
    two, so the squared angle test neither overflows nor underflows."""
    big = 1e150 if dtype == torch.float64 else 1e18
    g = torch.Generator().manual_seed(11)
    a = torch.randn(8, 10, 10, generator=g, dtype=dtype)
    scales = torch.tensor([big, 1 / big, 1.0, big**0.5, 1 / big**0.5, 3.0, 1e-3, 7e3], dtype=dtype)
    a = a * scales.view(8, 1, 1)
    u, s, vh, bad = _run(a, False, vbytes=vbytes)
    assert bad == 0
    _check(a, u, s, vh, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_batch_index(dtype, vbytes):
    """A NaN or inf reports 1 + the first bad batch index, as tp_svd_vec does."""
    a = torch.randn(13, 6, 6, dtype=dtype)
    a[9, 2, 3] = float("nan")
    a[11, 0, 0] = float("inf")
    assert _run(a, False, vbytes=vbytes)[3] == 10


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_routing(dtype):
    """kernels.svd sends lane batches with min(m, n) >= SVD_LANES_FAST_FROM (round-robin, or the
    block order by svd_lanes.pair_order) here."""
    a = torch.randn(20, 9, 9, dtype=dtype)
    u, s, vh, bad = kernels.svd(a, False, True, 1, lanes=True)
    u2, s2, vh2, _ = _run(a, False)
    assert bad == 0 and torch.equal(s, s2) and torch.equal(u, u2) and torch.equal(vh, vh2)
    small = torch.randn(20, 4, 4, dtype=dtype)  # below the threshold: tp_svd_vec
    assert kernels.svd(small, False, True, lanes=True)[3] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [8, 12, 32], ids=str)
@pytest.mark.parametrize("order", [1, 3], ids=["round-robin", "block"])
def test_rank_one_orthonormal(dtype, n, order, vbytes):
    """Rank-one and nearly rank-one matrices: the rotations between vectors of norm ~1e-10
    (squares ~1e-40, subnormal in float32) stay orthogonal, so U and V stay orthonormal (the
    angle once formed from unscaled squares left V 1e-2 from orthonormal in float32); both
    pair orders."""
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(16, n, 1, generator=g) @ torch.randn(16, 1, n, generator=g)).to(dtype)
    a[8:] += 1e-5 * torch.randn(8, n, n, generator=g).to(dtype)
    u, s, vh, bad = _run(a.contiguous(), True, vbytes=vbytes, order=order)
    assert bad == 0
    tol = TOL[dtype] * 10
    for x in (u.double(), vh.double().mT):
        eye = torch.eye(n, dtype=torch.float64)
        assert float((x.mT @ x - eye).abs().max()) <= tol
    rec = (u * s.unsqueeze(-2)) @ vh
    assert float((rec.double() - a.double()).abs().max()) <= tol * float(a.abs().max())


def test_pair_order():
    """The block order from BLOCK_FROM for multiples of 4, round-robin otherwise."""
    assert [svd_lanes.pair_order(k) for k in (5, 8, 12, 13, 16, 30, 32)] == [1, 3, 3, 1, 3, 1, 3]
