"""torchport.linalg: native kernels vs float64 LAPACK (gauge-invariant), vs the torch references,
errors, autograd (gradcheck and torch.linalg's gradients) and the autotuned method="auto"."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import torchport.linalg as tl
from tests.linalg_inputs import basis, make
from torchport.linalg import blocked, kernels, ops

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def sym(kind: str, b: int, n: int, seed: int = 0) -> torch.Tensor:
    """Symmetric test matrices (repeated or clustered eigenvalues, diagonal, zero, random,
    ill-conditioned)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(b, n, n, generator=g, dtype=torch.float64)
        return x + x.mT
    if kind == "zero":
        return torch.zeros(b, n, n, dtype=torch.float64)
    if kind == "diagonal":
        return torch.diag_embed(torch.randn(b, n, generator=g, dtype=torch.float64))
    q = basis(b, n, g)
    if kind == "repeated":
        lam = torch.where(torch.arange(n) < n // 2, -1.0, 3.0).to(torch.float64).expand(b, n)
    elif kind == "clustered":  # three clusters of width 1e-9
        lam = torch.tensor([(-2.0, 1.0, 5.0)[i % 3] + 1e-9 * i for i in range(n)])
        lam = lam.to(torch.float64).expand(b, n)
    elif kind == "ill_conditioned":
        lam = torch.logspace(0, -6, n, dtype=torch.float64).expand(b, n)
    else:
        raise ValueError(kind)
    return (q * lam.unsqueeze(-2)) @ q.mT


def eye_err(x: torch.Tensor) -> float:
    """max |XᵀX − I| for a batch of matrices with orthonormal columns."""
    if x.numel() == 0:
        return 0.0
    i = torch.eye(x.shape[-1], dtype=torch.float64)
    return float((x.double().mT @ x.double() - i).abs().max())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    scale = max(float(b.double().abs().max()), 1e-300)
    return float((a.double() - b.double()).abs().max()) / scale if scale > 0 else 0.0


# --- SVD ------------------------------------------------------------------------------------------

SVD_SHAPES = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (7, 3), (3, 7), (17, 17), (33, 12), (1, 6)]
SVD_KINDS = ["random", "rank_deficient", "diagonal", "zero", "repeated"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", SVD_KINDS)
@pytest.mark.parametrize("m,n", SVD_SHAPES, ids=lambda s: str(s))
def test_svd_vs_lapack(dtype, kind, m, n):
    for full in (False, True):
        _check_svd(dtype, kind, m, n, full)


def _check_svd(dtype, kind, m, n, full):
    a64 = make(kind, 6, m, n, seed=m * 31 + n)
    a = a64.to(dtype)
    u, s, vh = tl.svd(a, full_matrices=full, method="jacobi")
    k = min(m, n)
    assert u.shape == (6, m, m if full else k) and vh.shape == (6, n if full else k, n)
    assert s.shape == (6, k) and u.dtype == dtype
    assert bool((s[:, :-1] >= s[:, 1:]).all()), "singular values must be descending"
    tol = TOL[dtype]
    s_ref = torch.linalg.svdvals(a64)
    assert rel(s, s_ref) <= tol
    rec = (u[..., :k] * s.unsqueeze(-2)) @ vh[..., :k, :]
    assert rel(rec, a64) <= tol or float((rec.double() - a64).abs().max()) <= tol
    assert eye_err(u) <= tol and eye_err(vh.mT) <= tol


def test_svd_ill_conditioned_fp64_relative_accuracy():
    a = make("ill_conditioned", 8, 12, 12, seed=3)
    u, s, vh = tl.svd(a, full_matrices=False, method="jacobi")
    assert torch.allclose(
        s, torch.logspace(0, -6, 12, dtype=torch.float64).expand(8, 12), rtol=1e-8
    )
    assert rel((u * s.unsqueeze(-2)) @ vh, a) <= 1e-12
    assert eye_err(u) <= 1e-12 and eye_err(vh.mT) <= 1e-12


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m,n",
    [(2, 2), (3, 3), (4, 4), (6, 6), (7, 3), (3, 7), (1, 5), (12, 12), (16, 16), (32, 32)],
    ids=str,
)
def test_svd_lanes_kernel(dtype, m, n):
    """The SIMD-lane SVD kernel against the scalar one: a partial group of lanes, zero and
    rank-one matrices in the batch, both orderings, full and reduced, and a NaN's batch index."""
    a = make("random", 37, m, n, seed=m * n).to(dtype)
    a[5:9] = 0
    a[10] = a[10, :, :1] * torch.ones(1, n, dtype=dtype)
    tol, k = TOL[dtype] * 10, min(m, n)
    for full, order in ((False, 0), (True, 1)):
        u, s, vh, bad = kernels.svd(a, full, True, order, lanes=True)
        s0 = kernels.svd(a, full, True, order, lanes=False)[1]
        assert bad == 0 and rel(s, s0) <= tol
        rec = (u[..., :k] * s.unsqueeze(-2)) @ vh[..., :k, :]
        assert float((rec.double() - a.double()).abs().max()) <= tol * float(a.abs().max())
        assert eye_err(u) <= tol and eye_err(vh.mT) <= tol
    assert rel(kernels.svd(a, False, False, lanes=True)[1], s0) <= tol
    a[20, 0, 0] = float("inf")
    assert kernels.svd(a, False, True, lanes=True)[3] == 21


@pytest.mark.parametrize("batch", [(), (0,), (2, 3), (4, 0, 2)], ids=str)
def test_svd_batch_shapes(batch):
    a = torch.randn((*batch, 5, 3), dtype=torch.float64)
    u, s, vh = tl.svd(a, full_matrices=True, method="jacobi")
    ur, sr, vhr = torch.linalg.svd(a, full_matrices=True)
    assert u.shape == ur.shape and s.shape == sr.shape and vh.shape == vhr.shape
    assert torch.allclose(s, sr, atol=1e-12)
    assert torch.allclose(tl.svdvals(a, method="jacobi"), sr, atol=1e-12)


def test_svd_degenerate_sizes():
    a = torch.randn(3, 0, 4)
    u, s, vh = tl.svd(a, method="jacobi")
    assert s.shape == (3, 0) and u.shape == (3, 0, 0)
    assert torch.equal(vh, torch.eye(4).expand(3, 4, 4))


# --- eigh ---------------------------------------------------------------------------------------

EIGH_KINDS = ["random", "repeated", "diagonal", "zero", "ill_conditioned"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 32])
def test_eigh_vs_lapack(dtype, kind, n):
    for uplo in ("L", "U"):
        _check_eigh(dtype, kind, n, uplo)


def _check_eigh(dtype, kind, n, uplo):
    a64 = sym(kind, 5, n, seed=n)
    # poison the triangle that must not be read
    junk = torch.triu(torch.full((n, n), 7.0, dtype=torch.float64), 1)
    junk = junk if uplo == "L" else junk.mT
    a = (a64 + junk).to(dtype)
    lam, q = tl.eigh(a, UPLO=uplo, method="jacobi")
    assert bool((lam[:, :-1] <= lam[:, 1:]).all()), "eigenvalues must be ascending"
    tol = TOL[dtype]
    scale = max(1.0, float(a64.abs().max()))
    assert float((lam.double() - torch.linalg.eigvalsh(a64)).abs().max()) <= tol * scale * n
    resid = a64 @ q.double() - q.double() * lam.double().unsqueeze(-2)
    assert float(resid.abs().max()) <= tol * scale * n
    assert eye_err(q) <= tol * n
    assert torch.allclose(tl.eigvalsh(a, UPLO=uplo, method="jacobi"), lam, atol=tol * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13, 16])
def test_eigh_lanes_kernel(dtype, n):
    """The SIMD-lane kernel (one matrix per lane, cyclic, round-robin and fused round-robin
    order) against the scalar one and the reference in the same order (the fused rounds apply
    the round-robin rotations; odd n pads an index), with a batch that leaves a partial group
    of lanes, a poisoned upper triangle and a NaN."""
    a64 = torch.cat([sym("random", 20, n, seed=n), sym("repeated", 17, n, seed=1)])
    a = a64.to(dtype).contiguous()
    tol = TOL[dtype] * 10 * n
    for upper, order in ((False, 0), (True, 0), (False, 1), (True, 1), (False, 2), (True, 2)):
        lam, q, bad = kernels.eigh(a, upper, True, order, lanes=True)
        lam0, _, _ = kernels.eigh(a, upper, True, lanes=False)
        assert bad == 0 and rel(lam, lam0) <= tol
        resid = a64 @ q.double() - q.double() * lam.double().unsqueeze(-2)
        assert float(resid.abs().max()) <= tol * float(a64.abs().max()) and eye_err(q) <= tol
        lr, qr_ = tl.eigh_reference(a[:5], upper, order=order)
        assert rel(lam[:5], lr) <= tol
        if dtype == torch.float64 and n > 1:  # same order, same rotations: same vectors
            assert rel(q[:5], qr_) <= 1e-8
    vals, _, _ = kernels.eigh(a, False, False, lanes=True)
    assert rel(vals, lam0) <= tol
    a[29, 0, 0] = float("nan")
    assert kernels.eigh(a, False, True, lanes=True)[2] == 30  # 1 + first bad batch index


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eigh_fused_scaling(dtype):
    """The fused lane kernel scales each lane by a power of two (its squared threshold test
    must not over- or underflow): lanes of very different magnitudes in one group, at the ends
    of the dtype's range, still match LAPACK relative to their own norm."""
    big = 1e150 if dtype == torch.float64 else 1e18
    a64 = sym("random", 9, 11, seed=3)
    for i, f in enumerate((big, 1 / big, 1.0, big, 1 / big, 3.0, 1e-3, 7.0, big)):
        a64[i] *= f
    a = a64.to(dtype).contiguous()
    lam, q, bad = kernels.eigh(a, False, True, 2, lanes=True)
    ref = torch.linalg.eigvalsh(a.double())
    tol = TOL[dtype] * 10
    for i in range(9):
        scale = float(a[i].double().abs().max())
        assert bad == 0 and float((lam[i].double() - ref[i]).abs().max()) <= tol * scale
        resid = a[i].double() @ q[i].double() - q[i].double() * lam[i].double()
        assert float(resid.abs().max()) <= tol * scale and eye_err(q[i : i + 1]) <= tol


@pytest.mark.parametrize("batch", [(), (0,), (3, 2)], ids=str)
def test_eigh_batch_shapes(batch):
    x = torch.randn((*batch, 4, 4), dtype=torch.float64)
    a = x + x.mT
    lam, q = tl.eigh(a, method="jacobi")
    assert lam.shape == (*batch, 4) and q.shape == (*batch, 4, 4)
    assert torch.allclose(lam, torch.linalg.eigvalsh(a), atol=1e-12)


# --- QR -------------------------------------------------------------------------------------------

QR_SHAPES = [
    (1, 1),
    (2, 2),
    (3, 3),
    (4, 4),
    (6, 6),
    (9, 4),
    (4, 9),
    (16, 16),
    (31, 17),
    (1, 5),
    (5, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
@pytest.mark.parametrize("m,n", QR_SHAPES, ids=lambda s: str(s))
def test_qr_vs_lapack(dtype, mode, m, n):
    for kind in ("random", "rank_deficient", "zero"):
        _check_qr(dtype, mode, m, n, kind)


def _check_qr(dtype, mode, m, n, kind):
    a64 = make(kind, 4, m, n, seed=m + 7 * n)
    a = a64.to(dtype)
    q, r = tl.qr(a, mode=mode, method="jacobi")
    qr_, rr = torch.linalg.qr(a, mode=mode)
    assert q.shape == qr_.shape and r.shape == rr.shape
    tol = TOL[dtype]
    assert torch.equal(r, r.triu())
    if mode != "r":
        assert eye_err(q) <= tol
        rec = q.double() @ r.double()
        assert float((rec - a64).abs().max()) <= tol * max(1.0, float(a64.abs().max()))
    if kind == "random":  # same Householder sign convention as LAPACK: R itself matches
        assert rel(r, torch.linalg.qr(a64, mode=mode).R) <= tol * 10


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m,n", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (8, 8), (16, 16), (9, 4), (4, 9), (1, 5),
            (5, 1), (16, 7), (7, 16), (31, 17), (17, 31), (40, 40)], ids=str,
)  # fmt: skip
def test_qr_lanes_kernel(dtype, m, n):
    """One matrix per SIMD lane vs the per-matrix kernel: full and partial lane groups (37
    matrices), random, rank-deficient and zero matrices in one batch, every mode. Q and R match
    the per-matrix kernel's for the random matrices (the same reflectors); for the others, whose
    trailing reflectors are rounding noise, Q is orthonormal and Q R = A."""
    kinds = ("random", "rank_deficient", "zero")
    a64 = torch.cat(
        [make(kind, 13 if kind == "random" else 12, m, n, seed=m + 3 * n) for kind in kinds]
    )
    a, tol = a64.to(dtype), TOL[dtype]
    for mode in ("reduced", "complete", "r"):
        q, r = kernels.qr(a, mode, lanes=True)
        q0, r0 = kernels.qr(a, mode, lanes=False)
        assert q.shape == q0.shape and r.shape == r0.shape and torch.equal(r, r.triu())
        assert float((r - r0)[:13].abs().max()) <= tol * 10
        if mode != "r":
            assert float((q - q0)[:13].abs().max()) <= tol * 10
            assert eye_err(q) <= tol
            rec = q.double() @ r.double()
            assert float((rec - a64).abs().max()) <= tol * max(1.0, float(a64.abs().max()))


# --- Cholesky -----------------------------------------------------------------------------------


def spd(b: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, n, generator=g, dtype=torch.float64)
    return x @ x.mT + n * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 37])
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_vs_lapack(dtype, n, upper):
    a = spd(6, n, seed=n).to(dtype)
    fac = tl.cholesky(a, upper=upper, method="jacobi")
    ref = torch.linalg.cholesky(a.double(), upper=upper)
    assert rel(fac, ref) <= TOL[dtype]
    assert torch.equal(fac, fac.triu() if upper else fac.tril())
    fac2, info = tl.cholesky_ex(a, upper=upper, method="jacobi")
    assert torch.equal(fac2, fac) and info.dtype == torch.int32 and not bool(info.any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 17, 24, 32, 33, 40])
def test_cholesky_lanes_kernel(dtype, n):
    """One matrix per SIMD lane vs the scalar kernel: partial lane group, failures in two lanes."""
    a = spd(37, n, seed=n).to(dtype)
    a[3, -1, -1] = -100.0
    a[30, 0, 0] = float("nan")
    for upper in (False, True):
        fac, info, _ = kernels.cholesky(a, upper, lanes=True)
        fac0, info0, bad0 = kernels.cholesky(a, upper, lanes=False)
        assert torch.equal(info, info0) and bad0 == 4
        assert info[30] == 1 and info[3] == (n if n > 1 else 1)
        assert rel(fac, fac0) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 24])
def test_cholesky_lanes_streamed(dtype, n):
    """The streamed output (non-temporal stores, next group prefetched) is the plain kernel's,
    bit for bit: partial last group, failing lanes, upper and lower; an output not aligned to the
    vector width falls back to plain stores."""
    a = spd(45, n, seed=n).to(dtype)
    a[5, -1, -1] = -1.0
    a[9, 0, 0] = float("nan")
    for upper in (False, True):
        fac0, info0, bad0 = kernels.cholesky(a, upper, lanes=True, stream=False)
        fac, info, bad = kernels.cholesky(a, upper, lanes=True, stream=True)
        assert torch.equal(fac, fac0) and torch.equal(info, info0) and bad == bad0 == 6
        assert info[9] == 1 and float(fac[5].abs().sum()) == 0.0
    buf = torch.full((45 * n * n + 1,), 7.0, dtype=dtype)
    info = torch.empty((45,), dtype=torch.int32)
    kernels._ks(dtype)["cholesky_vec"].call_unchecked(
        a.data_ptr(), buf.data_ptr() + buf.element_size(), info.data_ptr(), 45, n, 0, 1, 0, 1
    )
    assert torch.equal(buf[1:].view(45, n, n), kernels.cholesky(a, False, stream=False)[0])
    assert buf[0] == 7.0
    # the launcher streams from CHOLESKY_STREAM_FROM output bytes
    b = kernels.CHOLESKY_STREAM_FROM // (n * n * a.element_size()) + 5
    big = spd(b, n, seed=1).to(dtype)
    got = kernels.cholesky_plan(b, n, dtype, False)(big)
    assert torch.equal(got[0], kernels.cholesky(big, False, lanes=True, stream=False)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["cholesky", "qr", "qr_complete", "qr_wide"])
def test_huge_page_outputs(dtype, op, monkeypatch):
    """Outputs from HUGE_OUTPUT_FROM bytes, their pages advised huge before the kernel writes
    them (fresh mmapped blocks above 32 MiB too), equal the same launchers' unadvised ones bit
    for bit."""
    n = 16
    b = 2 * kernels.HUGE_OUTPUT_FROM // (n * n * torch.finfo(dtype).bits // 8) + 7
    if op == "cholesky":
        a = spd(b, n, seed=3).to(dtype)
        a[b - 2, 3, 3] = -1.0
        plan = functools.partial(kernels.cholesky_plan, b, n, dtype, False)
    else:
        m, k = (n, n // 2) if op == "qr_wide" else (n, n)
        a = torch.randn((b, m, k), generator=torch.Generator().manual_seed(5), dtype=dtype)
        mode = "complete" if op == "qr_complete" else "reduced"
        plan = functools.partial(kernels.qr_plan, b, m, k, dtype, mode)
    huge = plan()(a)
    monkeypatch.setattr(kernels, "HUGE_OUTPUT_FROM", 1 << 62)
    plain = plan()(a)
    for x, y in zip(huge, plain, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    if op == "cholesky":
        assert plain[2] == b - 1
    elif op == "qr":
        got = kernels.qr(a, "reduced")
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "n,nb", [(17, 1), (24, None), (31, 5), (33, 8), (47, None), (64, 16), (97, 64), (130, None)]
)
def test_cholesky_blocked_kernel(dtype, n, nb):
    """Blocked kernel (panel widths that do and do not divide n) vs float64 LAPACK, the blocked
    torch reference and the unblocked kernel; upper and lower; ill-conditioned input."""
    g = torch.Generator().manual_seed(n)
    q = basis(3, n, g)
    ill = (q * torch.logspace(0, -5, n, dtype=torch.float64)) @ q.mT
    a = torch.cat([spd(3, n, seed=n), (ill + ill.mT) / 2]).to(dtype)
    for upper in (False, True):
        fac, info, bad = blocked.cholesky_blocked(a, upper, nb)
        assert bad == 0 and not bool(info.any())
        assert torch.equal(fac, fac.triu() if upper else fac.tril())
        ref = torch.linalg.cholesky(a.double(), upper=upper)
        err = (fac.double() - ref).abs().amax((-2, -1)) / ref.abs().amax((-2, -1))
        assert float(err[:3].max()) <= TOL[dtype]
        if dtype == torch.float64:  # cond 1e5: the factor is still accurate to ~1e-11
            assert float(err.max()) <= 1e-9
        fr, ir = tl.cholesky_blocked_reference(a, upper, nb or blocked.panel_width(n))
        assert rel(fac, fr) <= TOL[dtype] and not bool(ir.any())
        fac0, _, _ = kernels.cholesky(a, upper, lanes=False)
        assert rel(fac, fac0) <= TOL[dtype]
    assert torch.equal(kernels.cholesky(a, False)[0], blocked.cholesky_blocked(a, False)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", [0, 7, 8, 15, 16, 17, 40, 49])
def test_cholesky_blocked_info(dtype, where):
    """A failing pivot in the first/last column of a panel, in the diagonal block or the trailing
    part, and NaN: info names the same leading minor as LAPACK, the factor is zero, others fine."""
    n = 50
    a = spd(4, n, seed=where).to(dtype)
    a[1, where, where] = -1e4
    a[3, where, 0] = float("nan")
    a[3, 0, where] = float("nan")
    for nb in (8, 16, 32):
        fac, info, bad = blocked.cholesky_blocked(a, False, nb)
        ref = torch.linalg.cholesky_ex(a.double()).info
        assert info.tolist() == ref.tolist() == [0, where + 1, 0, where + 1]
        assert bad == 2 and not bool(fac[1].any()) and not bool(fac[3].any())
        assert tl.cholesky_blocked_reference(a, False, nb)[1].tolist() == info.tolist()
        assert rel(fac[0], torch.linalg.cholesky(a[0].double())) <= TOL[dtype]


def test_cholesky_blocked_degenerate_sizes():
    for b, n in ((0, 40), (3, 0), (1, 1), (2, 40)):
        a = spd(b, n).to(torch.float32) if b * n else torch.zeros(b, n, n)
        fac, info, bad = blocked.cholesky_blocked(a, False)
        assert fac.shape == (b, n, n) and info.shape == (b,) and bad == 0
        if b * n:
            assert rel(fac, torch.linalg.cholesky(a.double())) <= TOL[torch.float32]
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 2\).*minor of order 40"):
        bad_in = spd(3, 40)
        bad_in[2, 39, 39] = -1e6
        tl.cholesky(bad_in, method="jacobi")


@pytest.mark.parametrize("n", [3, 20, 60])
def test_cholesky_eager_launcher_matches_op_path(n):
    """Plain eager calls run the resolved launcher; grad-recording calls the custom op: same
    factor and info for batch shapes, strided input, lanes/blocked/unblocked kernels."""
    a = spd(24, n, seed=n).reshape(2, 3, 4, n, n)
    a[1, 2, 3, n - 1, n - 1] = -1e6
    strided = a.mT  # symmetric input: the same matrices, not contiguous
    for x in (a, strided, a[:, :1, :1]):
        fac, info = tl.cholesky_ex(x, method="jacobi")
        fac_op, info_op = ops.cholesky_ex(x.contiguous(), False)
        assert torch.equal(info, info_op) and info.shape == x.shape[:-2]
        assert torch.allclose(fac, fac_op, rtol=1e-12, atol=1e-12)
        assert info.tolist() == torch.linalg.cholesky_ex(x).info.tolist()
    g = a[0].clone().requires_grad_()
    fac_g = tl.cholesky(g, method="jacobi")
    assert fac_g.requires_grad and torch.allclose(fac_g, tl.cholesky(a[0], method="jacobi"))
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 23\).*order " + str(n)):
        tl.cholesky(a, method="jacobi")


def test_cholesky_ex_info_names_failing_minor():
    a = spd(5, 4).reshape(5, 4, 4).clone()
    a[1, 2, 2] = -100.0  # leading minor of order 3 fails
    a[3, 0, 0] = float("nan")  # NaN is not positive-definite: order 1
    l_, info = tl.cholesky_ex(a, method="jacobi")
    ref_info = torch.linalg.cholesky_ex(a).info
    assert info.tolist() == [0, 3, 0, 1, 0] == ref_info.tolist()
    assert torch.equal(l_[1], torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*minor of order 3"):
        tl.cholesky(a, method="jacobi")
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*minor of order 3"):
        tl.cholesky_ex(a, check_errors=True, method="jacobi")
    with pytest.raises(
        torch.linalg.LinAlgError, match=r"^torchport.linalg.cholesky: The fact.*order 1"
    ):
        tl.cholesky(-torch.eye(2), method="jacobi")


# --- native vs the torch references (same algorithm) --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(1, 1), (2, 2), (3, 3), (5, 5), (6, 3), (3, 6), (7, 6)], ids=str)
def test_native_matches_reference(dtype, m, n):
    a = make("random", 4, m, n, seed=11).to(dtype)
    tol = TOL[dtype] * 10
    u, s, vh, _ = kernels.svd(a, True, True)
    ur, sr, vhr = tl.svd_reference(a, full_matrices=True)
    for order in (0, 1):  # both orderings of the kernel against the reference's
        s_o = kernels.svd(a, False, False, order)[1]
        assert rel(s_o, tl.svd_reference(a, compute_uv=False, order=order)[1]) <= tol
    assert rel(s, sr) <= tol
    k = min(m, n)
    assert rel(u[..., :k].abs(), ur[..., :k].abs()) <= tol * 10  # same vectors up to sign
    assert rel(vh[..., :k, :].abs(), vhr[..., :k, :].abs()) <= tol * 10
    assert eye_err(ur) <= tol and eye_err(vhr.mT) <= tol
    rk = tl.svd_reference(make("rank_deficient", 3, m, n, seed=2).to(dtype), full_matrices=True)
    assert eye_err(rk[0]) <= tol and eye_err(rk[2].mT) <= tol
    q, r = kernels.qr(a, "complete")
    qr_, rr = tl.qr_reference(a, "complete")
    assert rel(q, qr_) <= tol and rel(r, rr) <= tol
    if m == n:
        x = a + a.mT
        lam, vec, _ = kernels.eigh(x.contiguous(), False, True)
        lr, vr = tl.eigh_reference(x)
        assert rel(lam, lr) <= tol and rel(vec.abs(), vr.abs()) <= tol * 10
        p = spd(4, n, seed=5).to(dtype)
        p[2, -1, -1] = -50.0
        fac, info, _ = kernels.cholesky(p, False)
        fr, ir = tl.cholesky_reference(p)
        assert torch.equal(info, ir) and rel(fac, fr) <= tol


def _sym_kind(kind: str, bsz: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Symmetric test matrices for the eigh references: random, repeated (two eigenvalues of
    multiplicity ~n/2), diagonal (with repeats), zero, identity, graded (entries scaled by
    g_i g_j, g spanning 12 (f64) / 5 (f32) decades)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, n, n, dtype=torch.float64, generator=gen)
    x = x + x.mT
    if kind == "repeated":
        q = torch.linalg.qr(torch.randn(bsz, n, n, dtype=torch.float64, generator=gen))[0]
        ev = torch.tensor([1.0] * (n // 2) + [3.0] * (n - n // 2), dtype=torch.float64)
        x = (q * ev) @ q.mT
    elif kind == "diagonal":
        x = torch.diag_embed(torch.tensor([2.0, -1.0, 2.0, 0.5] * n, dtype=torch.float64)[:n])
        x = x.expand(bsz, n, n)
    elif kind == "zero":
        x = torch.zeros(bsz, n, n, dtype=torch.float64)
    elif kind == "identity":
        x = torch.eye(n, dtype=torch.float64).expand(bsz, n, n)
    elif kind == "graded":
        g = torch.logspace(0, -12 if dtype == torch.float64 else -5, n, dtype=torch.float64)
        x = x * g[:, None] * g[None, :]
    return x.to(dtype).contiguous()


EIGH_KINDS = ["random", "repeated", "diagonal", "zero", "identity", "graded"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 24, 32])
def test_eigh_tridiagonal_reference_vs_torch(dtype, kind, n):
    a = _sym_kind(kind, 3, n, dtype, seed=n)
    eps = torch.finfo(dtype).eps
    nrm = a.flatten(1).norm(dim=-1).clamp_min(torch.finfo(dtype).tiny)[:, None]
    lam, q = tl.eigh_tridiagonal_reference(a)
    ref = torch.linalg.eigvalsh(a)
    assert float(((lam - ref).abs() / nrm).max()) <= 8 * n * eps
    res = (a @ q - q * lam[:, None, :]).flatten(1).norm(dim=-1) / nrm[:, 0]
    assert float(res.max()) <= 8 * n * eps
    assert eye_err(q) <= 8 * n * eps
    assert torch.equal(lam, lam.sort(-1).values)
    vals, empty = tl.eigh_tridiagonal_reference(a, compute_v=False)
    assert empty.numel() == 0 and torch.equal(vals, lam)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eigh_tridiagonal_reference_reads_one_triangle(dtype):
    a = torch.randn(2, 7, 7, dtype=dtype, generator=torch.Generator().manual_seed(3))
    for upper in (False, True):
        lam, q = tl.eigh_tridiagonal_reference(a, upper)
        ref_l, _ = torch.linalg.eigh(a, UPLO="U" if upper else "L")
        torch.testing.assert_close(lam, ref_l, atol=TOL[dtype], rtol=TOL[dtype])
        x = a.triu() if upper else a.tril()
        x = x + x.mT - torch.diag_embed(x.diagonal(0, -2, -1))
        torch.testing.assert_close(
            q @ torch.diag_embed(lam) @ q.mT, x, atol=TOL[dtype] * 10, rtol=0
        )


def test_reference_reconstructs():
    a = torch.randn(2, 3, 3)
    u, s, vh = tl.svd_reference(a)
    assert torch.allclose((u * s.unsqueeze(-2)) @ vh, a, atol=1e-5)


# --- errors -------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(tl.LinalgInputError, match=r"must have at least 2 dimensions, got 1-D"):
        tl.svd(torch.randn(3))
    with pytest.raises(tl.LinalgInputError, match=r"must be float32, float64.*got torch.int32"):
        tl.svd(torch.ones(3, 3, dtype=torch.int32))
    with pytest.raises(tl.LinalgInputError, match=r"square matrices, got 2 by 3"):
        tl.eigh(torch.randn(2, 3))
    with pytest.raises(tl.LinalgInputError, match=r"square matrices, got 2 by 3"):
        tl.cholesky(torch.randn(4, 2, 3))
    with pytest.raises(tl.LinalgInputError, match=r"method must be one of .* got 'magma'"):
        tl.qr(torch.randn(3, 3), method="magma")
    with pytest.raises(tl.LinalgInputError, match=r"mode must be one of .* got 'full'"):
        tl.qr(torch.randn(3, 3), mode="full")
    with pytest.raises(tl.LinalgInputError, match=r"UPLO must be 'L' or 'U', got 'X'"):
        tl.eigh(torch.eye(3), UPLO="X")
    with pytest.raises(tl.LinalgInputError, match=r"A must be a torch.Tensor, got list"):
        tl.svdvals([[1.0]])
    a = torch.randn(3, 4, 4)
    a[2, 1, 1] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match=r"svd: \(Batch element 2\).*non-finite"):
        tl.svd(a, method="jacobi")
    with pytest.raises(torch.linalg.LinAlgError, match=r"eigh: \(Batch element 2\).*non-finite"):
        tl.eigh(a, method="jacobi")
    with pytest.raises(torch.linalg.LinAlgError, match=r"svd: The algorithm.*non-finite"):
        tl.svdvals(torch.full((2, 2), float("nan")), method="jacobi")


@pytest.mark.parametrize("method", ["auto", "jacobi", "lapack"])
@pytest.mark.parametrize("bad", ["False", 0, 1, None], ids=repr)
def test_boolean_options_must_be_bools(method, bad):
    """``upper``, ``full_matrices`` and ``check_errors`` were passed through ``bool()``:
    ``cholesky(P, upper="False")`` returned the upper factor and ``svd(A, full_matrices="False")``
    a full U, where torch.linalg raises TypeError (it takes Python bools only, not even 0/1).
    Also, a bad ``method`` of cholesky_ex, svdvals and eigvalsh named cholesky, svd and eigh."""
    p = torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64)
    a = torch.randn(4, 2, dtype=torch.float64)
    for key in ((), (False,), (True,)):  # also once a route for the bool's value is learned
        if key:
            tl.cholesky(p, upper=key[0], method=method)
            tl.cholesky_ex(p, upper=key[0], method=method)
            tl.svd(a, full_matrices=key[0], method=method)
        with pytest.raises(
            tl.LinalgInputError, match=rf"cholesky: upper must be a bool, got .*{bad!r}"
        ):
            tl.cholesky(p, upper=bad, method=method)
        with pytest.raises(tl.LinalgInputError, match=r"cholesky_ex: upper must be a bool"):
            tl.cholesky_ex(p, upper=bad, method=method)
        with pytest.raises(tl.LinalgInputError, match=r"cholesky_ex: check_errors must be a bool"):
            tl.cholesky_ex(p, check_errors=bad, method=method)
        with pytest.raises(tl.LinalgInputError, match=r"svd: full_matrices must be a bool"):
            tl.svd(a, full_matrices=bad, method=method)
        with pytest.raises(TypeError):  # (also a TypeError, as torch.linalg raises)
            tl.svd(a, full_matrices=bad, method=method)
    x = p.clone().requires_grad_()
    for fn, call in (
        ("cholesky_ex", lambda: tl.cholesky_ex(p, method="foo")),
        ("svdvals", lambda: tl.svdvals(p, method="foo")),
        ("svdvals", lambda: tl.svdvals(x, method="foo")),
        ("eigvalsh", lambda: tl.eigvalsh(p, method="foo")),
        ("eigvalsh", lambda: tl.eigvalsh(x, method="foo")),
    ):
        with pytest.raises(tl.LinalgInputError, match=rf"linalg\.{fn}: method must be one of"):
            call()


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
@pytest.mark.parametrize("b", [1, 16])
@pytest.mark.parametrize("where", [(1, 1), (0, 2)], ids=["diagonal", "off_diagonal"])
def test_infinite_input_gets_torch_linalgs_answer_on_every_route(dtype, b, where):
    """An inf made the native routes raise while LAPACK (torch.linalg, and "auto" wherever it
    routes there) returns NaNs for some inputs and fails on others: now every route gives
    torch.linalg's answer, NaNs where it returns them, LinAlgError where it raises."""
    x = torch.randn(b, 4, 4, dtype=dtype)
    a = x + x.mH
    a[-1, where[0], where[1]] = a[-1, where[1], where[0]] = float("inf")
    calls = {
        "svd": lambda m: tl.svd(a, method=m).S,
        "svdvals": lambda m: tl.svdvals(a, method=m),
        "eigh": lambda m: tl.eigh(a, method=m).eigenvalues,
        "eigvalsh": lambda m: tl.eigvalsh(a, method=m),
    }

    def outcome(call, method):  # the NaN pattern, or "raises"
        try:
            return call(method).isnan().tolist()
        except torch.linalg.LinAlgError:
            return "raises"

    for name, call in calls.items():
        want = outcome(call, "lapack")
        for method in ("jacobi", "auto"):
            assert outcome(call, method) == want, (name, method, want)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_reference_route_gets_torch_linalgs_answer_for_non_finite_input(monkeypatch, bad):
    """The reference route ("jacobi" off the CPU) returned its algorithms' NaNs where the other
    routes raise (NaN): it now answers as they do, with torch.linalg's result."""
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    a = x + x.mT
    a[1, 0, 2] = a[1, 2, 0] = bad

    def outcome(call):
        try:
            return call().isnan().tolist()
        except torch.linalg.LinAlgError as e:
            assert "(Batch element 1)" in str(e)
            return "raises"

    calls = {
        "svd": lambda m: tl.svd(a, method=m).S,
        "svdvals": lambda m: tl.svdvals(a, method=m),
        "eigh": lambda m: tl.eigh(a, method=m).eigenvalues,
        "eigvalsh": lambda m: tl.eigvalsh(a, method=m),
    }
    wants = {name: outcome(lambda c=call: c("lapack")) for name, call in calls.items()}
    monkeypatch.setattr(tl, "_route", lambda *args, **kwargs: "reference")
    for name, call in calls.items():
        assert outcome(lambda c=call: c("jacobi")) == wants[name], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.complex128])
@pytest.mark.parametrize("b", [1, 16])
@pytest.mark.parametrize("n", [3, 24])
def test_eigh_ignores_non_finite_in_the_unread_triangle(dtype, b, n):
    """torch.linalg.eigh reads one triangle: NaN/inf in the other does not fail it, nor ours
    (every native route: one matrix, lanes, block and per-thread kernels, Jacobi and QL);
    a non-finite value in the read triangle still fails, naming its batch element."""
    g = torch.Generator().manual_seed(n + b)
    x = torch.randn(b, n, n, generator=g, dtype=torch.float64).to(dtype)
    for upper in (False, True):
        a = (x + x.mH) / 2
        junk = a.clone()
        idx = (0, n - 1) if not upper else (n - 1, 0)  # an entry of the unread triangle
        junk[..., idx[0], idx[1]] = float("nan")
        junk[b - 1, idx[0], idx[1]] = float("inf")
        uplo = "U" if upper else "L"
        want = torch.linalg.eigvalsh(a.to(torch.complex128 if dtype.is_complex else torch.float64))
        tol = 1e-4 if dtype in (torch.float32, torch.complex64) else 1e-9
        for method in ("jacobi", "auto"):
            lam, v = tl.eigh(junk, UPLO=uplo, method=method)
            assert torch.allclose(lam.double(), want, atol=tol * n)
            resid = a @ v - v * lam.unsqueeze(-2).to(v.dtype)
            assert float(resid.abs().max()) < tol * 10 * n
            lam2 = tl.eigvalsh(junk, UPLO=uplo, method=method)
            assert torch.allclose(lam2.double(), want, atol=tol * n)
        bad = junk.clone()
        bad[b - 1, idx[1], idx[0]] = float("nan")  # now in the read triangle too
        where = rf"\(Batch element {b - 1}\)"
        with pytest.raises(torch.linalg.LinAlgError, match=rf"eigh: {where}.*non-finite"):
            tl.eigh(bad, UPLO=uplo, method="jacobi")


def test_complex_runs_lapack_visibly():
    a = torch.randn(2, 3, 3, dtype=torch.complex128)
    s = tl.svdvals(a, method="lapack")
    assert torch.allclose(s, torch.linalg.svdvals(a))


# --- autograd -------------------------------------------------------------------------------------


def _g(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("m,n", [(4, 3), (3, 4), (3, 3)], ids=str)
def test_svd_gradcheck(m, n):
    x = _g((2, m, n))

    def f(a):  # gauge-invariant: S and U Vh (sign flips cancel)
        u, s, vh = tl.svd(a, full_matrices=False, method="jacobi")
        return s, u @ vh, (u * s.unsqueeze(-2)) @ vh

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradcheck(lambda a: tl.svdvals(a, method="jacobi"), (x,))
    # same gradient as torch.linalg, also with full_matrices=True (only leading k columns count)
    for full in (False, True):
        u, s, vh = tl.svd(x, full_matrices=full, method="jacobi")
        k = min(m, n)
        loss = (u[..., :k] @ vh[..., :k, :]).sin().sum() + s.square().sum()
        (g1,) = torch.autograd.grad(loss, x)
        ur, sr, vhr = torch.linalg.svd(x, full_matrices=full)
        lr = (ur[..., :k] @ vhr[..., :k, :]).sin().sum() + sr.square().sum()
        (g2,) = torch.autograd.grad(lr, x)
        assert torch.allclose(g1, g2, atol=1e-9)


def test_eigh_gradcheck_and_matches_torch():
    x = _g((2, 4, 4), seed=1)

    def f(a):
        lam, q = tl.eigh(a + a.mT, method="jacobi")
        return lam, q * q[..., :1, :].sign()  # fix the sign gauge

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradcheck(lambda a: tl.eigvalsh(a + a.mT, method="jacobi"), (x,))
    lam, q = tl.eigh(x, method="jacobi")
    (g1,) = torch.autograd.grad(lam.pow(3).sum() + (q * q).pow(2).sum(), x)
    lr, qr_ = torch.linalg.eigh(x)
    (g2,) = torch.autograd.grad(lr.pow(3).sum() + (qr_ * qr_).pow(2).sum(), x)
    assert torch.allclose(g1, g2, atol=1e-10)


@pytest.mark.parametrize(
    "m,n,mode", [(5, 3, "reduced"), (3, 3, "complete"), (3, 5, "reduced"), (3, 5, "complete")]
)
def test_qr_gradcheck(m, n, mode):
    x = _g((2, m, n), seed=2)
    assert torch.autograd.gradcheck(lambda a: tuple(tl.qr(a, mode=mode, method="jacobi")), (x,))
    q, r = tl.qr(x, mode=mode, method="jacobi")
    (g1,) = torch.autograd.grad(q.sin().sum() + r.cos().sum(), x)
    qr_, rr = torch.linalg.qr(x, mode=mode)
    (g2,) = torch.autograd.grad(qr_.sin().sum() + rr.cos().sum(), x)
    assert torch.allclose(g1, g2, atol=1e-9)


def test_qr_backward_errors():
    x = _g((4, 3))
    with pytest.raises(RuntimeError, match=r"mode='complete' and nrows > ncols"):
        q, r = tl.qr(x, mode="complete", method="jacobi")
        (q.sum() + r.sum()).backward()
    with pytest.raises(RuntimeError, match=r"not computed when mode='r'"):
        tl.qr(x, mode="r", method="jacobi").R.sum().backward()


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_gradcheck(upper):
    base = spd(2, 4, seed=3)
    x = base.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a: tl.cholesky(0.5 * (a + a.mT), upper=upper, method="jacobi"), (x,)
    )
    (g1,) = torch.autograd.grad(tl.cholesky(x, upper=upper, method="jacobi").sin().sum(), x)
    (g2,) = torch.autograd.grad(torch.linalg.cholesky(x, upper=upper).sin().sum(), x)
    assert torch.allclose(g1, g2, atol=1e-10)


def test_custom_ops_opcheck():
    a = torch.randn(2, 4, 3, dtype=torch.float64)
    from torchport.linalg import ops

    torch.library.opcheck(
        ops._svd_op, (a, False, True), test_utils=("test_schema", "test_faketensor")
    )
    torch.library.opcheck(ops._qr_op, (a, "reduced"), test_utils=("test_schema", "test_faketensor"))
    s = spd(2, 3)
    torch.library.opcheck(ops._chol_op, (s, False), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        ops._eigh_op, (s, False, True), test_utils=("test_schema", "test_faketensor")
    )


# --- method="auto" --------------------------------------------------------------------------------


def test_auto_tunes_once_and_is_correct(fresh_cache, monkeypatch):
    from torchport import autotune

    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "2")
    before = autotune.stats.tuned
    a = torch.randn(300, 3, 3)
    s = tl.svdvals(a)
    assert autotune.stats.tuned == before + 1
    tl.svdvals(torch.randn(290, 3, 3))  # same bucket: no new tuning
    assert autotune.stats.tuned == before + 1
    assert torch.allclose(s, torch.linalg.svdvals(a), atol=1e-5)
    hit = autotune.choice_cache.get(
        "linalg.svd",
        {
            "batch": 512,
            "lanes": True,
            "m": 3,
            "n": 3,
            "dtype": "torch.float32",
            "options": [False, False],
            "kernels": kernels.SOURCE_TAG,
            "tuned_on": tl.TUNED_ON,
        },
    )
    assert hit is not None and set(hit["timings_s"]) == {"torch.linalg", "native"}
    big = torch.randn(1, 200, 200, dtype=torch.float64)  # beyond NATIVE_MAX_N: LAPACK, no kernel
    assert tl._route("svd", big, "auto", (False, True)) == "lapack"


def test_auto_batch_buckets_are_powers_of_two():
    assert [tl._bucket(b) for b in (0, 1, 2, 3, 100, 128, 129, 10_000)] == [
        1,
        1,
        2,
        4,
        128,
        128,
        256,
        16_384,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_tune_batch_stays_on_the_calls_kernel(dtype):
    """The tuner's batch is capped for large matrices, but a call whose batch fills the SIMD
    lanes is never tuned on a batch that does not (another kernel runs there)."""
    lanes = kernels.lane_batch(dtype)
    assert lanes == 64 // dtype.itemsize
    tops = {"svd": 64, "eigh": 64, "qr": 64, "cholesky": 48}
    for op, top in tops.items():
        for n in (2, 3, 8, 16, 32, 48, 49, 64, 65, 96, 128, 512):
            cap = (1 << 21) // n**3
            for b in (1, 2, lanes - 1, lanes, lanes + 1, 100, 10_000, 100_000):
                tb = tl._tune_batch(op, b, n, n, dtype)
                assert 1 <= tb <= b
                fills = b >= lanes and n <= top
                assert kernels.runs_lanes(op, b, n, n, dtype) == fills
                assert kernels.runs_lanes(op, tb, n, n, dtype) == fills  # the call's kernel
                if not fills:  # beyond the lane sizes the cap alone (no dearer first calls)
                    assert tb == min(b, cap) or tb == 1
    # the case that kept LAPACK: 100 float32 matrices of 64 x 64 were tuned on 8
    assert tl._tune_batch("eigh", 100, 64, 64, torch.float32) == 16
    assert tl._tune_batch("eigh", 100_000, 8, 8, dtype) == 4096  # small matrices: the cap
    assert tl._tune_batch("qr", 3, 40, 30, dtype) == 3  # a batch under the lanes stays
    # beyond Cholesky's lane sizes: 100 matrices of 1024 x 1024 are tuned on one, not 16
    assert tl._tune_batch("cholesky", 100, 1024, 1024, dtype) == 1
    # the kernels choose their lane form by the same number
    assert not kernels.runs_lanes("qr", lanes - 1, 4, 4, dtype)
    assert kernels.runs_lanes("qr", lanes, 4, 4, dtype)


def test_auto_tunes_on_the_lane_batch(monkeypatch):
    """_route hands the tuner the capped batch of _tune_batch (here the lane batch, not 8)."""
    from torchport import autotune

    seen: list = []
    monkeypatch.setattr(autotune, "select", _fake_select(False, seen))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    a = torch.randn(100, 64, 64, dtype=torch.float32)
    assert tl._route("eigh", a, "auto", (False, True)) == "lapack"
    assert seen[-1][1]["batch"] == 128 and seen[-1][2] == (16, 64, 64)
    tl._drop_routes()  # not a measured route: leave none behind


def test_auto_lane_sides_of_a_bucket_tune_apart(monkeypatch):
    """Batches 12 and 16 share the power-of-two bucket 16, but float32 16 runs the lane kernel
    and 12 the per-thread one: the first call's choice must not decide the other's."""
    from torchport import autotune

    seen: list = []
    monkeypatch.setattr(autotune, "select", _fake_select(False, seen))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()
    for b in (16, 12, 16, 12, 9):
        a = torch.randn(b, 64, 64, dtype=torch.float32)
        assert tl._route("eigh", a, "auto", (False, True)) == "lapack"
    assert [(k["batch"], k["lanes"], shape[0]) for _, k, shape in seen] == [
        (16, True, 16),
        (16, False, 8),  # capped (n = 64: 2**21 / 64**3), the per-thread kernel either way
    ]
    tl._drop_routes()


def _fake_select(native_wins: bool, seen: list):
    from torchport.autotune import Choice

    def select(op, key, candidates, factory, make_args, **kw):
        seen.append((op, dict(key), make_args()[0].shape))
        pick = candidates[1] if native_wins else candidates[0]
        return Choice(op, pick)

    return select


def test_auto_confirms_native_win_against_lapack(monkeypatch):
    """A native win from the tuner (fresh or cached) is kept only if the alternating timing on
    the call's own batch agrees; fake timings make the decision deterministic."""
    from torchport import autotune

    seen: list = []
    monkeypatch.setattr(autotune, "select", _fake_select(True, seen))
    a = torch.randn(100, 3, 3, generator=torch.Generator().manual_seed(0))
    for t_lapack, t_native, want in (
        (1.0, 2.0, "lapack"),
        (1.0, 0.99, "lapack"),
        (1.0, 0.5, "native"),
    ):
        monkeypatch.setattr(tl, "_memo", {})
        monkeypatch.setattr(tl, "_fast", {})
        monkeypatch.setattr(tl, "_chol_native", {})
        tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
        monkeypatch.setattr(tl, "_time_pair", lambda fa, fb, x, r=(t_lapack, t_native): r)
        assert tl._route("qr", a, "auto", ("reduced",)) == want
    # tuned in the bucket of 100 (128), on the call's batch of 100, not the bucket's top
    assert seen[-1][1]["batch"] == 128 and seen[-1][2] == (100, 3, 3)
    assert torch.allclose(tl.qr(a)[1].abs(), torch.linalg.qr(a)[1].abs(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [33, 64, 128])
def test_auto_one_matrix_beyond_the_launcher_runs_the_batched_route(monkeypatch, n):
    """A single matrix larger than the one-matrix launchers takes is no longer LAPACK's by
    fiat: the tuner times the batched native route (what the public functions then run), and a
    native win routes there, with the same results."""
    from torchport import autotune

    assert not tl._one_candidate("cholesky", n, n)
    a = spd(1, n)
    fn = tl._candidate_fn("cholesky", (False,), 1, n, n, torch.float64)
    assert torch.allclose(fn(a)[0], torch.linalg.cholesky(a), rtol=1e-10, atol=1e-10)
    small = tl._candidate_fn("cholesky", (False,), 1, 8, 8, torch.float64)  # the launcher
    assert torch.allclose(small(spd(1, 8))[0], torch.linalg.cholesky(spd(1, 8)), atol=1e-10)
    seen: list = []
    monkeypatch.setattr(autotune, "select", _fake_select(True, seen))
    monkeypatch.setattr(tl, "_time_pair", lambda fa, fb, x: (1.0, 0.5))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    assert tl._route("cholesky", a, "auto", (False,)) == "native"
    assert seen[-1][1]["batch"] == 1 and seen[-1][2] == (1, n, n)
    for x in (a, a[0]):  # batch of one and a bare matrix, twice each (learned launchers)
        for _ in range(2):
            got = tl.cholesky(x)
            assert got.shape == x.shape
            assert torch.allclose(got, torch.linalg.cholesky(x), rtol=1e-10, atol=1e-10)
    s = spd(1, n, seed=1)
    lam, q = tl.eigh(s)
    assert torch.allclose(lam, torch.linalg.eigvalsh(s), rtol=1e-9, atol=1e-9)
    assert torch.allclose(q @ torch.diag_embed(lam) @ q.mT, s, rtol=1e-9, atol=1e-8)
    tl._drop_routes()  # fake timings: leave no route behind


def test_auto_lapack_choice_skips_confirmation(monkeypatch):
    from torchport import autotune

    monkeypatch.setattr(autotune, "select", _fake_select(False, []))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place

    def boom(*args):
        raise AssertionError("confirmation timed although the tuner chose torch.linalg")

    monkeypatch.setattr(tl, "_time_pair", boom)
    assert tl._route("cholesky", spd(100, 8), "auto", (False,)) == "lapack"


def _timed_select(native_wins: bool, timings: dict):
    """A tuner answer with the timings of its search (as fresh or cached choices carry them)."""
    from torchport.autotune import Choice

    def select(op, key, candidates, factory, make_args, **kw):
        return Choice(op, candidates[1] if native_wins else candidates[0], dict(timings))

    return select


@pytest.mark.parametrize("native_wins", [False, True])
@pytest.mark.parametrize(
    ("t_lapack", "t_native", "want"),
    [(20e-6, 12e-6, "native"), (20e-6, 19.8e-6, "lapack"), (20e-6, 30e-6, "lapack")],
)
def test_auto_short_call_verdict_is_rechecked(monkeypatch, native_wins, t_lapack, t_native, want):
    """A call under SHORT_CALL_S is decided by the alternated minima of _time_short whichever
    side the tuner's search chose (a LAPACK verdict of a loaded search is re-checked too), with
    the same noise margin; the median confirmation (_time_pair) is not used there."""
    from torchport import autotune

    search = {"torch.linalg": 21e-6, "native": 20e-6 if native_wins else 23e-6}
    monkeypatch.setattr(autotune, "select", _timed_select(native_wins, search))
    seen: list = []

    def short(fa, fb, x):
        seen.append(x.shape)
        return t_lapack, t_native

    def boom(*args):
        raise AssertionError("median confirmation on a short call")

    monkeypatch.setattr(tl, "_time_short", short)
    monkeypatch.setattr(tl, "_time_pair", boom)
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    a = spd(100, 3)
    assert tl._route("cholesky", a, "auto", (False,)) == want
    assert seen == [(100, 3, 3)]  # once, on the call's batch
    assert tl._route("cholesky", a, "auto", (False,)) == want  # remembered: no second re-check
    assert seen == [(100, 3, 3)]
    tl._drop_routes()  # fake timings: leave no route behind


@pytest.mark.parametrize(
    "search",
    [
        {"torch.linalg": 200e-6, "native": 300e-6},  # not a short call: the search's verdict
        {"torch.linalg": 20e-6},  # native failed the check against torch.linalg: never chosen
        {},
    ],
)
def test_auto_lapack_verdict_kept_without_recheck(monkeypatch, search):
    from torchport import autotune

    monkeypatch.setattr(autotune, "select", _timed_select(False, search))

    def boom(*args):
        raise AssertionError("re-check of a LAPACK verdict that must stand")

    monkeypatch.setattr(tl, "_time_short", boom)
    monkeypatch.setattr(tl, "_time_pair", boom)
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    assert tl._route("qr", torch.randn(100, 3, 3), "auto", ("reduced",)) == "lapack"
    tl._drop_routes()


def test_auto_long_native_win_keeps_median_confirmation(monkeypatch):
    from torchport import autotune

    search = {"torch.linalg": 400e-6, "native": 100e-6}
    monkeypatch.setattr(autotune, "select", _timed_select(True, search))

    def boom(*args):
        raise AssertionError("alternated minima on a long call")

    monkeypatch.setattr(tl, "_time_short", boom)
    monkeypatch.setattr(tl, "_time_pair", lambda fa, fb, x: (400e-6, 100e-6))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    assert tl._route("qr", torch.randn(100, 3, 3), "auto", ("reduced",)) == "native"
    tl._drop_routes()


def test_time_short_groups_calls_and_returns_minima(monkeypatch):
    """_time_short sizes its groups from one timed call (about SHORT_GROUP_S a group) and returns
    the least per-call time of each side (fake clock: exact)."""
    from torchport.autotune import timing

    clock = {"t": 0.0}
    monkeypatch.setattr(timing, "clock", lambda: clock["t"])
    calls = {"a": 0, "b": 0}

    def side(name, cost):
        def f(x):
            calls[name] += 1
            clock["t"] += cost
            return x

        return f

    fa, fb = side("a", 10e-6), side("b", 8e-6)
    ta, tb = tl._time_short(fa, fb, torch.ones(1))
    assert (ta, tb) == pytest.approx((10e-6, 8e-6))
    group = round(tl.SHORT_GROUP_S / 10e-6)
    # two sizing calls of a, one warm-up each, then SHORT_ROUNDS groups each
    assert calls == {"a": 3 + tl.SHORT_ROUNDS * group, "b": 1 + tl.SHORT_ROUNDS * group}


def test_auto_cached_decision_does_no_extra_work(monkeypatch):
    """The second call of the same problem is one dict lookup: no bucketing, no tuner, no
    config of the tuner; and cholesky routes once per call, not twice."""
    calls: list = []
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    monkeypatch.setattr(tl, "_tune", lambda op, key, b: calls.append(key) or False)
    a = spd(100, 8)
    assert torch.equal(tl.cholesky(a), torch.linalg.cholesky(a))
    assert len(calls) == 1

    def no_bucket(b):
        raise AssertionError("bucketing on a cached call")

    def no_check(*args, **kw):
        raise AssertionError("validation or routing on a call already routed to torch.linalg")

    monkeypatch.setattr(tl, "_bucket", no_bucket)
    monkeypatch.setattr(tl, "_check", no_check)
    monkeypatch.setattr(tl, "_route", no_check)
    for _ in range(3):
        tl.cholesky(a)
        tl.cholesky_ex(a)
    assert len(calls) == 1
    # a native decision is honoured from the fast path too, and cholesky routes only once
    monkeypatch.undo()
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets are aliased: clear in place
    monkeypatch.setattr(tl, "_bucket", lambda b: 128)
    monkeypatch.setattr(tl, "_tune", lambda op, key, b: calls.append(key) or True)
    monkeypatch.setattr(tl, "_memo", {})
    routes: list = []
    real_route = tl._route
    monkeypatch.setattr(tl, "_route", lambda *args: routes.append(args[0]) or real_route(*args))
    fac = tl.cholesky(a)
    assert routes == ["cholesky"] and len(calls) == 2
    # the cached native decision runs the resolved launcher: no routing, no tuning
    assert torch.equal(tl.cholesky(a), fac) and torch.equal(tl.cholesky_ex(a).L, fac)
    assert routes == ["cholesky"] and len(calls) == 2
    assert torch.allclose(fac, torch.linalg.cholesky(a), atol=1e-4)
    bad = a.clone()
    bad[7, 5, 5] = -1e3  # errors and info from the launcher path too
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 7\).*minor of order 6"):
        tl.cholesky(bad)
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 7\).*minor of order 6"):
        tl.cholesky_ex(bad, check_errors=True)
    fac2, info = tl.cholesky_ex(bad)
    assert info.tolist() == torch.linalg.cholesky_ex(bad).info.tolist()
    assert not bool(fac2[7].any()) and torch.equal(fac2[:7], fac[:7])
    assert tl.cholesky(a.mT.contiguous().mT).shape == a.shape  # strided input, same shape
    assert routes == ["cholesky"]
    # with native kernels switched off a cached native decision is not used
    from torchport import config

    with config.override(native=False):
        assert tl._route("cholesky", a, "auto", (False,)) == "lapack"
        assert torch.equal(tl.cholesky(a), torch.linalg.cholesky(a))
    assert routes[-2:] == ["cholesky", "cholesky"]


# largest entry across the range: sums of squares overflow (fp32 from ~1e19) or underflow (fp32
# below ~1e-19, subnormal-only input) unless the kernels scale each matrix by a power of two
_SCALES = {
    torch.float32: (1e-37, 3e-39, 1e-25, 1e25, 1e37),
    torch.float64: (1e-300, 1e-310, 1e300),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("b", [1, 3, 20])
def test_extreme_scale_input(b, dtype):
    """svd/eigh/qr of matrices scaled to the ends of the range, on every native path
    (per-matrix workers, lanes, one-matrix launchers), against float64 LAPACK, relative to
    max|A| (the rounding of subnormal outputs allows 1e-5 for fp32, 1e-11 for fp64)."""
    rtol = 1e-5 if dtype == torch.float32 else 1e-11
    g = torch.Generator().manual_seed(11)
    base = torch.randn((b, 8, 6), generator=g, dtype=torch.float64)
    base = base / base.abs().amax(dim=(-2, -1), keepdim=True)
    sq = base[..., :6, :] + base[..., :6, :].mT
    for t in _SCALES[dtype]:
        a, s = (base * t).to(dtype), (sq * t).to(dtype)
        amax = a.double().abs().amax(dim=(-2, -1))
        smax = s.double().abs().amax(dim=(-2, -1))
        sv = tl.svdvals(a, method="jacobi")
        err = (sv.double() - torch.linalg.svdvals(a.double())).abs().amax(-1) / amax
        assert float(err.max()) <= rtol, ("svdvals", t)
        lam = tl.eigvalsh(s, method="jacobi")
        err = (lam.double() - torch.linalg.eigvalsh(s.double())).abs().amax(-1) / smax
        assert float(err.max()) <= rtol, ("eigvalsh", t)
        for mode in ("reduced", "complete"):
            q, r = tl.qr(a, mode=mode, method="jacobi")
            err = (q.double() @ r.double() - a.double()).abs().amax(dim=(-2, -1)) / amax
            assert float(err.max()) <= rtol, ("qr", mode, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(2, 2), (3, 3), (4, 4), (5, 5), (4, 2), (2, 4), (6, 3)], ids=str)
def test_extreme_scale_small_matrices_in_lanes(shape, dtype):
    """Batches of small matrices run one matrix per vector lane (Jacobi eigh below n = 6, SVD
    below min(m, n) = 5): those kernels did not scale each matrix, so large entries gave inf
    singular values and the sorted diagonal as eigenvalues, small ones lost every digit."""
    rtol = 1e-5 if dtype == torch.float32 else 1e-11
    m, n = shape
    g = torch.Generator().manual_seed(m * 10 + n)
    base = torch.randn((64, m, n), generator=g, dtype=torch.float64)
    base = base / base.abs().amax(dim=(-2, -1), keepdim=True)
    for t in _SCALES[dtype]:
        a = (base * t).to(dtype)
        amax = a.double().abs().amax(dim=(-2, -1))
        sv = tl.svdvals(a, method="jacobi")
        err = (sv.double() - torch.linalg.svdvals(a.double())).abs().amax(-1) / amax
        assert float(err.max()) <= rtol, ("svdvals", t)
        if m == n:
            s = ((base + base.mT) * t).to(dtype)
            smax = s.double().abs().amax(dim=(-2, -1))
            lam = tl.eigvalsh(s, method="jacobi")
            err = (lam.double() - torch.linalg.eigvalsh(s.double())).abs().amax(-1) / smax
            assert float(err.max()) <= rtol, ("eigvalsh", t)


def test_torch_signature_details_and_float8() -> None:
    """Lower-case ``UPLO`` and ``driver=None`` are accepted as torch accepts them (both raised);
    a cuSOLVER driver name and float8 input raise LinalgInputError (float8 passed the dtype check
    and failed with a KeyError under method="jacobi")."""
    from torchport.linalg import LinalgInputError

    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 5, 5, generator=g, dtype=torch.float64)
    s = a + a.mT
    for method in ("auto", "jacobi"):
        for up, lo in (("U", "u"), ("L", "l")):
            assert torch.equal(
                tl.eigvalsh(s, UPLO=lo, method=method), tl.eigvalsh(s, UPLO=up, method=method)
            )
        torch.testing.assert_close(
            tl.svdvals(a, driver=None, method=method), torch.linalg.svdvals(a)
        )
        assert tl.svd(a, driver=None, method=method)[1].shape == (4, 5)
        with pytest.raises(LinalgInputError, match="driver= is only supported on CUDA"):
            tl.svd(a, driver="gesvd", method=method)
        for fn in (tl.svdvals, tl.eigvalsh, tl.cholesky, tl.qr):
            with pytest.raises(LinalgInputError, match=r"got torch\.float8_e4m3fn"):
                fn(a.float().to(torch.float8_e4m3fn), method=method)


@pytest.mark.parametrize(
    "op", ["svd", "svdvals", "eigh", "eigvalsh", "qr", "cholesky", "cholesky_ex"]
)
def test_meta_tensors_get_shapes_on_every_method(op):
    """method="jacobi" ran the reference algorithms on meta tensors, which read values
    (Tensor.item() on meta raised); every method now propagates shapes as "auto" did."""
    a = torch.empty(2, 4, 4, device="meta", dtype=torch.float64)
    want = getattr(torch.linalg, op)(a)
    want = want if isinstance(want, tuple) else (want,)
    for method in tl.METHODS:
        got = getattr(tl, op)(a, method=method)
        got = got if isinstance(got, tuple) else (got,)
        assert [(t.shape, t.dtype, t.device) for t in got] == [
            (t.shape, t.dtype, t.device) for t in want
        ], method


@pytest.mark.parametrize("method", ["auto", "jacobi"])
def test_compile_fullgraph_traces_the_public_functions(method):
    """torch.compile(fullgraph=True) broke on _check's is_conj(), then on the route tables and
    settings: "auto" traces as torch.linalg, "jacobi" as the native kernels' custom ops."""
    x = torch.randn(2, 4, 4, dtype=torch.float64)
    a = x @ x.mT + 4 * torch.eye(4, dtype=torch.float64)

    def f(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            tl.svdvals(a, method=method),
            tl.eigvalsh(a, method=method),
            tl.cholesky(a, method=method),
        )

    g = torch.compile(f, fullgraph=True, backend="eager")
    for got, want in zip(
        g(a), (torch.linalg.svdvals(a), torch.linalg.eigvalsh(a), torch.linalg.cholesky(a))
    ):
        torch.testing.assert_close(got, want)
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        g(-a)


def test_compiled_jacobi_follows_the_native_switch_per_call():
    # a graph traced with the kernels on kept calling them under TORCHPORT_NATIVE=0 (eager
    # falls back to torch.linalg on every call that finds them off)
    from torchport import config
    from torchport.native import toolchain

    x = torch.randn(2, 4, 4, dtype=torch.float64)
    a = x @ x.mT + 4 * torch.eye(4, dtype=torch.float64)

    def f(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            tl.svdvals(a, method="jacobi"),
            tl.eigh(a, method="jacobi")[0],
            tl.cholesky(a, method="jacobi"),
            tl.qr(a, method="jacobi")[1].abs(),
        )

    want = (
        torch.linalg.svdvals(a),
        torch.linalg.eigvalsh(a),
        torch.linalg.cholesky(a),
        torch.linalg.qr(a)[1].abs(),
    )
    g = torch.compile(f, fullgraph=True, backend="eager")
    g(a)
    for off in (True, False):
        toolchain.fallback_counts.clear()
        with config.override(native=not off), warnings.catch_warnings():
            warnings.simplefilter("ignore", toolchain.NativeFallbackWarning)
            got = g(a)
        ops_off = {"linalg.svd", "linalg.eigh", "linalg.cholesky", "linalg.qr"} if off else set()
        assert set(toolchain.fallback_counts) == ops_off
        for t, w in zip(got, want):
            torch.testing.assert_close(t, w)


def test_svd_op_without_uv_on_non_finite_input_has_distinct_placeholders():
    # the non-finite route returned one placeholder tensor as both U and Vh: the custom op's
    # outputs may not alias, so the op (and svdvals(method="jacobi") under torch.compile) raised
    a = torch.randn(2, 4, 4, dtype=torch.float64)
    a[0, 1, 1] = float("inf")
    u, s, vh = torch.ops.torchport.linalg_svd(a, False, False)
    assert u.numel() == 0 and vh.numel() == 0 and u is not vh
    torch.testing.assert_close(s, torch.linalg.svdvals(a), equal_nan=True)


def test_linalg_ops_return_the_fakes_row_major_layout_off_the_native_route():
    # with the kernels off (and on the non-finite route) the custom ops returned torch.linalg's
    # column-major U, Vh, Q, R and L while their fakes are row-major: a graph compiled by
    # Inductor raised "expected size 4==4, stride 1==4" at run time
    from torchport import config
    from torchport.native import toolchain

    x = torch.randn(2, 4, 4, dtype=torch.float64)
    a = x @ x.mT + 4 * torch.eye(4, dtype=torch.float64)

    def f(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            *torch.ops.torchport.linalg_svd(a, False, True),
            torch.ops.torchport.linalg_eigh(a, False, True, True)[1],
            *torch.ops.torchport.linalg_qr(a, "reduced"),
            torch.ops.torchport.linalg_cholesky_ex(a, False)[0],
        )

    g = torch.compile(f, fullgraph=True, backend="inductor")
    g(a)
    with config.override(native=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", toolchain.NativeFallbackWarning)
        got = g(a)
        assert all(t.is_contiguous() for t in f(a))
    torch.testing.assert_close(got[3].abs(), torch.linalg.eigh(a)[1].abs())
    torch.testing.assert_close(got[6], torch.linalg.cholesky(a))
    bad = a.clone()
    bad[0, 1, 1] = float("inf")  # the kernels report it; torch.linalg answers
    assert all(t.is_contiguous() for t in torch.ops.torchport.linalg_svd(bad, False, True))
    assert all(t.is_contiguous() for t in torch.ops.torchport.linalg_eigh(bad, False, True, True))


def test_auto_tuning_inside_a_graph_capture_names_the_op(fresh_cache, monkeypatch):
    # the tuner's random probe input made the capture refuse "aten.randn.generator" (an explicit
    # torch.Generator), naming neither the linalg op nor the warm-up
    from torchport.graphs import CaptureError, Graph

    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()
    a = torch.randn(4, 6, 6)
    a = a @ a.mT + 6 * torch.eye(6)
    msg = r"torchport\.linalg\.eigh: the first call .* 6x6"
    with pytest.raises(CaptureError, match=msg), Graph():
        tl.eigh(a)
