"""torchport.linalg on complex64/complex128: the native Jacobi eigh and SVD
(:mod:`torchport.linalg.complex_jacobi`) against complex128 LAPACK (gauge-invariant), against
their plain-torch references, UPLO, errors, autograd (gradcheck, torch's gradients and its error
for phase-dependent losses) and the routing of method="auto"."""

from __future__ import annotations

import pytest
import torch

import torchport.linalg as tl
from tests import linalg_inputs
from tests.linalg_inputs import basis
from torchport.linalg import complex_jacobi, one, ops
from torchport.linalg.reference import complex_eigh_reference, complex_svd_reference

CDTYPES = [torch.complex64, torch.complex128]
TOL = {torch.complex64: 1e-4, torch.complex128: 1e-11}


def make(kind: str, b: int, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """Complex128 test matrices (:func:`linalg_inputs.make`)."""
    return linalg_inputs.make(kind, b, m, n, seed, torch.complex128)


def herm(kind: str, b: int, n: int, seed: int = 0) -> torch.Tensor:
    """Hermitian complex128 test matrices: random, repeated eigenvalues, diagonal, zero,
    ill-conditioned (eigenvalues 1 … 1e-6)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(b, n, n, generator=g, dtype=torch.complex128)
        return x + x.mH
    if kind == "zero":
        return torch.zeros(b, n, n, dtype=torch.complex128)
    if kind == "diagonal":
        return torch.diag_embed(torch.randn(b, n, generator=g, dtype=torch.float64)).to(
            torch.complex128
        )
    u = basis(b, n, g, torch.complex128)
    if kind == "repeated":
        lam = torch.ones(b, n, dtype=torch.float64)
        lam[:, n // 2 :] = -3.0
    elif kind == "ill_conditioned":
        lam = torch.logspace(0, -6, n, dtype=torch.float64).expand(b, n)
    else:
        raise ValueError(kind)
    return (u * lam.to(torch.complex128).unsqueeze(-2)) @ u.mH


def _eye(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.eye(n, dtype=dtype)


def check_svd(a64: torch.Tensor, dtype: torch.dtype, full: bool, method: str = "jacobi") -> None:
    a = a64.to(dtype)
    u, s, vh = tl.svd(a, full_matrices=full, method=method)
    m, n = a.shape[-2:]
    k = min(m, n)
    assert s.dtype == dtype.to_real() and u.dtype == vh.dtype == dtype
    assert u.shape == (*a.shape[:-2], m, m if full else k)
    assert vh.shape == (*a.shape[:-2], n if full else k, n)
    tol = TOL[dtype] * max(1, k)
    scale = max(1.0, float(a64.abs().max())) if a64.numel() else 1.0
    s_ref = torch.linalg.svdvals(a64)
    assert torch.allclose(s.double(), s_ref, rtol=tol, atol=tol * scale)
    rec = (u[..., :k] * s.to(dtype).unsqueeze(-2)) @ vh[..., :k, :]
    err = torch.linalg.matrix_norm((rec - a).to(torch.complex128))
    assert float(err.max()) <= tol * max(1.0, float(torch.linalg.matrix_norm(a64).max()))
    assert float((u.mH @ u - _eye(u.shape[-1], dtype)).abs().max()) <= tol
    assert float((vh @ vh.mH - _eye(vh.shape[-2], dtype)).abs().max()) <= tol
    assert bool((s[..., :-1] >= s[..., 1:]).all())
    assert torch.equal(tl.svdvals(a, method=method), s) or torch.allclose(
        tl.svdvals(a, method=method), s, rtol=tol, atol=tol * scale
    )


SVD_SHAPES = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (8, 8), (16, 16), (7, 3), (3, 7), (1, 5)]


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "rank_deficient", "ill_conditioned", "repeated"])
@pytest.mark.parametrize("m,n", SVD_SHAPES, ids=str)
def test_svd_accuracy(dtype, kind, m, n):
    if kind == "ill_conditioned" and dtype == torch.complex64:
        kind = "random"  # cond 1e6 is beyond float32-class accuracy in U, V (as for float32)
    check_svd(make(kind, 5, m, n), dtype, full=False)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("kind", ["zero", "diagonal", "rank_deficient"])
@pytest.mark.parametrize("m,n", [(4, 4), (6, 3), (3, 6), (1, 1)], ids=str)
def test_svd_full_matrices_complete_the_basis(dtype, kind, m, n):
    check_svd(make(kind, 4, m, n, seed=1), dtype, full=True)


def test_svd_ill_conditioned_complex128_relative_accuracy():
    a = make("ill_conditioned", 4, 8, 8, seed=2)
    s = tl.svdvals(a, method="jacobi")
    assert torch.allclose(s, torch.logspace(0, -6, 8, dtype=torch.float64), rtol=1e-9)


def check_eigh(a64: torch.Tensor, dtype: torch.dtype, uplo: str, method: str = "jacobi") -> None:
    a = a64.to(dtype)
    lam, q = tl.eigh(a, UPLO=uplo, method=method)
    n = a.shape[-1]
    assert lam.dtype == dtype.to_real() and q.dtype == dtype
    tol = TOL[dtype] * max(1, n)
    scale = max(1.0, float(a64.abs().max())) if a64.numel() else 1.0
    ref = torch.linalg.eigvalsh(a64, UPLO=uplo)
    assert torch.allclose(lam.double(), ref, rtol=tol, atol=tol * scale)
    full = torch.linalg.eigh(a64, UPLO=uplo)  # the Hermitian matrix the triangle stands for
    h = (full.eigenvectors * full.eigenvalues.to(a64.dtype).unsqueeze(-2)) @ full.eigenvectors.mH
    res = h.to(dtype) @ q - q * lam.to(dtype).unsqueeze(-2)
    assert float(res.abs().max()) <= tol * scale
    assert float((q.mH @ q - _eye(n, dtype)).abs().max()) <= tol
    assert bool((lam[..., :-1] <= lam[..., 1:]).all())
    vals = tl.eigvalsh(a, UPLO=uplo, method=method)
    assert torch.allclose(vals, lam, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "repeated", "diagonal", "zero", "ill_conditioned"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_eigh_accuracy(dtype, kind, n):
    check_eigh(herm(kind, 4, n, seed=n), dtype, "L")


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("uplo", ["L", "U"])
@pytest.mark.parametrize("n", [1, 3, 6])
def test_eigh_reads_only_the_uplo_triangle_and_the_real_diagonal(dtype, uplo, n):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(3, n, n, generator=g, dtype=torch.complex128)  # not Hermitian at all
    check_eigh(a, dtype, uplo)
    lam, q = tl.eigh(a.to(dtype), UPLO=uplo, method="jacobi")
    other = a.clone()
    junk = torch.randn(3, n, n, generator=g, dtype=torch.complex128)
    if uplo == "L":
        other = other.tril(-1) + junk.triu(1)
    else:
        other = other.triu(1) + junk.tril(-1)
    other = other + torch.diag_embed(a.diagonal(0, -2, -1).real + 5j)  # imaginary diagonal
    lam2, q2 = tl.eigh(other.to(dtype), UPLO=uplo, method="jacobi")
    assert torch.equal(lam, lam2) and torch.equal(q, q2)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (0, 4, 4), (2, 0, 3, 3), (4, 0, 0), (3, 0, 2)])
def test_batch_shapes_and_empty(dtype, shape):
    a = torch.randn(shape, dtype=dtype)
    u, s, vh = tl.svd(a, method="jacobi")
    ru, rs, rvh = torch.linalg.svd(a)
    assert u.shape == ru.shape and s.shape == rs.shape and vh.shape == rvh.shape
    assert s.dtype == rs.dtype
    if shape[-1] == shape[-2]:
        lam, q = tl.eigh(a, method="jacobi")
        rl, rq = torch.linalg.eigh(a)
        assert lam.shape == rl.shape and q.shape == rq.shape and lam.dtype == rl.dtype
        assert torch.allclose(lam, rl, rtol=TOL[dtype] * 8, atol=TOL[dtype] * 8)
    assert torch.allclose(s, rs, rtol=TOL[dtype] * 8, atol=TOL[dtype] * 8)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(1, 1), (4, 4), (6, 3), (3, 6), (9, 9)], ids=str)
@pytest.mark.parametrize("full", [False, True])
def test_svd_native_matches_reference(dtype, m, n, full):
    a = make("random", 6, m, n, seed=3).to(dtype)
    a[1] = 0
    if min(m, n) >= 2:
        a[2, :, 1] = a[2, :, 0]  # rank-deficient: the completed vectors agree too
    u, s, vh, bad = complex_jacobi.svd(a.contiguous(), full, True)
    ur, sr, vhr = complex_svd_reference(a, full)
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    assert bad == 0
    for x, y in ((u, ur), (s, sr), (vh, vhr)):
        assert torch.allclose(x, y, rtol=tol, atol=tol), (x - y).abs().max()
    vals = complex_jacobi.svd(a.contiguous(), full, False)[1]
    assert torch.allclose(vals, sr, rtol=tol, atol=tol)


# one row far above the others (the 3 x 3 case of the review, then random rows scaled alike)
_BIG_ROW = [
    [1.03915930908105075e100 - 5.33811496564956018e99j, 3.22370730678574381e99 + 4.85916204549055151e99j,
     -7.00460049364187903e98 + 3.63357859065896070e99j],
    [9.36946290736872522e-01 - 5.18376099244768408e-04j, -3.95336295576612651e-02 - 6.26763157042462882e-01j,
     -3.87318989129877389e-01 - 5.58631072221994929e-01j],
    [4.02505116376755567e-01 - 3.98922930145421267e-02j, -1.70795125290424649e-01 - 1.31150422383820603e-01j,
     1.37776162982575334e-01 - 8.65437895601981200e-02j],
]  # fmt: skip


@pytest.mark.parametrize(
    "dtype,scale", [(torch.complex64, 1e15), (torch.complex128, 1e100)], ids=str
)
def test_svd_one_large_row_is_finite(dtype, scale):
    """A finite matrix with one row far above the others gave all-NaN singular values (33 of 100
    random complex64 3 x 3 with a row x 1e15, 40 of 100 complex128 with 1e100): |g| underflowed
    to 0 while Re g did not, a running norm cancelled below 0, the threshold became NaN,
    ``g <= NaN`` did not skip the pair and the rotation's phase was 0/0. Now: finite, the
    largest singular value as LAPACK's (the small ones only to eps relative to it: the matrix is
    scaled by its largest entry), A = U S Vh, and the reference agrees."""
    a = torch.randn(100, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
    a[:, 0] *= scale
    if dtype == torch.complex128:
        a[0] = torch.tensor(_BIG_ROW, dtype=dtype)
    want = torch.linalg.svdvals(a.to(torch.complex128))
    eps = torch.finfo(dtype.to_real()).eps
    for run in (
        lambda: tl.svd(a, full_matrices=False, method="jacobi"),
        lambda: complex_svd_reference(a, False),
    ):
        u, s, vh = run()
        assert torch.isfinite(s).all() and torch.isfinite(u).all() and torch.isfinite(vh).all()
        big = want[:, :1]
        assert ((s.double() - want).abs() / big).max() < 20 * eps
        rec = (u * s.to(dtype).unsqueeze(-2)) @ vh
        assert ((rec - a).abs().amax((-2, -1)) / big[:, 0]).max() < 20 * eps
    for x in (a[:1], a[:3]):  # one matrix (the one-matrix launcher's worker) and a batch
        assert torch.isfinite(tl.svdvals(x, method="jacobi")).all()
    s1 = one.svd_plan(a[:1].shape, dtype, False, False)(a[:1].contiguous())
    assert torch.isfinite(s1).all()


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize("upper", [False, True])
def test_eigh_native_matches_reference(dtype, n, upper):
    a = torch.randn(5, n, n, dtype=dtype, generator=torch.Generator().manual_seed(n))
    lam, q, bad = complex_jacobi.eigh(a, upper, True)
    lr, qr_ = complex_eigh_reference(a, upper)
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    assert bad == 0
    assert torch.allclose(lam, lr, rtol=tol, atol=tol)
    assert torch.allclose(q, qr_, rtol=tol, atol=tol), (q - qr_).abs().max()


def test_references_match_lapack():
    a = make("random", 3, 5, 4, seed=4)
    u, s, vh = complex_svd_reference(a, full_matrices=True)
    assert torch.allclose(s, torch.linalg.svdvals(a), atol=1e-12)
    assert torch.allclose((u[..., :4] * s.to(a.dtype).unsqueeze(-2)) @ vh, a, atol=1e-12)
    h = herm("random", 3, 5, seed=4)
    lam, q = complex_eigh_reference(h, upper=True)
    assert torch.allclose(lam, torch.linalg.eigvalsh(h), atol=1e-12)
    assert torch.allclose(q @ torch.diag_embed(lam.to(h.dtype)) @ q.mH, h, atol=1e-12)


def test_errors():
    a = torch.randn(3, 4, 4, dtype=torch.complex64)
    a[1, 2, 0] = complex(float("nan"), 0.0)
    with pytest.raises(torch.linalg.LinAlgError, match=r"svd: \(Batch element 1\).*non-finite"):
        tl.svd(a, method="jacobi")
    with pytest.raises(torch.linalg.LinAlgError, match=r"eigh: \(Batch element 1\).*non-finite"):
        tl.eigh(a, method="jacobi")
    b = torch.zeros(2, 2, dtype=torch.complex128)
    b[0, 1] = complex(0.0, float("nan"))  # (an inf gets torch.linalg's NaNs, not an error)
    with pytest.raises(torch.linalg.LinAlgError, match=r"svd: The algorithm.*non-finite"):
        tl.svdvals(b, method="jacobi")
    with pytest.raises(tl.LinalgInputError, match=r"UPLO must be 'L' or 'U', got 'X'"):
        tl.eigh(torch.eye(3, dtype=torch.complex64), UPLO="X", method="jacobi")
    with pytest.raises(tl.LinalgInputError, match=r"square matrices, got 2 by 3"):
        tl.eigvalsh(torch.zeros(2, 3, dtype=torch.complex64), method="jacobi")
    with pytest.raises(tl.LinalgInputError, match=r"method must be one of .* got 'x'"):
        tl.svd(torch.eye(2, dtype=torch.complex64), method="x")


# --- autograd -------------------------------------------------------------------------------------


def _gc(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.complex128).requires_grad_()


@pytest.mark.parametrize("m,n", [(4, 3), (3, 4), (3, 3)], ids=str)
def test_svd_gradcheck_complex(m, n):
    x = _gc((2, m, n))

    def f(a):  # gauge-invariant: S and U Vh (a phase e^{iφ} on u_j and v_j cancels)
        u, s, vh = tl.svd(a, full_matrices=False, method="jacobi")
        return s, u @ vh

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradcheck(lambda a: tl.svdvals(a, method="jacobi"), (x,))
    u, s, vh = tl.svd(x, full_matrices=False, method="jacobi")
    (g1,) = torch.autograd.grad(s.pow(3).sum() + (u @ vh).abs().pow(3).sum(), x)
    ru, rs, rvh = torch.linalg.svd(x, full_matrices=False)
    (g2,) = torch.autograd.grad(rs.pow(3).sum() + (ru @ rvh).abs().pow(3).sum(), x)
    assert torch.allclose(g1, g2, atol=1e-10)


def test_eigh_gradcheck_complex():
    x = _gc((2, 4, 4), seed=1)

    def f(a):  # gauge-invariant: eigenvalues and |v|²
        lam, q = tl.eigh(a + a.mH, method="jacobi")
        return lam, q.abs() ** 2

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradcheck(lambda a: tl.eigvalsh(a + a.mH, method="jacobi"), (x,))
    lam, q = tl.eigh(x, method="jacobi")
    (g1,) = torch.autograd.grad(lam.pow(3).sum() + q.abs().pow(4).sum(), x)
    rl, rq = torch.linalg.eigh(x)
    (g2,) = torch.autograd.grad(rl.pow(3).sum() + rq.abs().pow(4).sum(), x)
    assert torch.allclose(g1, g2, atol=1e-10)


def test_phase_dependent_loss_raises_like_torch():
    x = _gc((2, 4, 3), seed=2)
    u, _, _ = tl.svd(x, full_matrices=False, method="jacobi")
    with pytest.raises(RuntimeError, match=r"svd backward: The singular vectors .* e\^\{i phi\}"):
        u.sum().real.backward()
    ru = torch.linalg.svd(x, full_matrices=False)[0]
    with pytest.raises(RuntimeError, match=r"e\^\{i phi\}"):  # torch's own, for comparison
        ru.sum().real.backward()
    h = _gc((2, 4, 4), seed=3)
    _, q = tl.eigh(h, method="jacobi")
    with pytest.raises(RuntimeError, match=r"eigh backward: The eigenvectors .* e\^\{i phi\}"):
        q[..., 0, :].sum().real.backward()


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(2, 5, 3, dtype=torch.complex64)
        u, s, vh = ops._svd_op(a, True, True)
        lam, q = ops._eigh_op(torch.empty(2, 4, 4, dtype=torch.complex128), False, True)
    assert (u.shape, s.shape, vh.shape) == ((2, 5, 5), (2, 3), (2, 3, 3))
    assert s.dtype == torch.float32 and u.dtype == torch.complex64
    assert lam.dtype == torch.float64 and q.dtype == torch.complex128


# --- routing --------------------------------------------------------------------------------------


def _fake_select(native_wins: bool, seen: list):
    from torchport.autotune import Choice

    def select(op, key, candidates, factory, make_args, **kw):
        seen.append((op, dict(key), make_args()[0]))
        pick = candidates[1] if native_wins else candidates[0]
        return Choice(op, pick)

    return select


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("b", [1, 100])
def test_auto_tunes_complex_like_real(monkeypatch, dtype, b):
    """method="auto" asks the tuner for complex svd/eigh (key: the complex kernels' tag, no
    lanes, a complex tuning input, Hermitian for eigh) and runs the native kernel when it wins."""
    from torchport import autotune

    seen: list = []
    monkeypatch.setattr(autotune, "select", _fake_select(True, seen))
    monkeypatch.setattr(tl, "_time_pair", lambda fa, fb, x: (1.0, 0.5))
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()
    try:
        a = make("random", b, 6, 6, seed=5).to(dtype)
        assert tl._route("svd", a, "auto", (True, True)) == "native"
        assert tl._route("eigh", a, "auto", (False, True)) == "native"
        for _op, key, x in seen:
            assert key["lanes"] is False and key["kernels"] == complex_jacobi.SOURCE_TAG
            assert key["dtype"] == str(dtype) and x.dtype == dtype
        x = seen[-1][2]
        assert torch.allclose(x, x.mH)
        assert not kernels_runs_lanes(dtype)
        check_svd(make("random", b, 6, 6, seed=5), dtype, full=True, method="auto")
        check_eigh(herm("random", b, 6, seed=5), dtype, "U", method="auto")
        cand = tl._candidate_fn("svd", (True, True), 1, 6, 6, dtype)  # no one-matrix launcher
        u, s, _ = cand(a[:1])
        assert s.dtype == dtype.to_real() and u.shape == (1, 6, 6)
    finally:
        tl._drop_routes()  # fake timings: leave no route behind


def kernels_runs_lanes(dtype: torch.dtype) -> bool:
    from torchport.linalg import kernels

    return any(kernels.runs_lanes(op, 10_000, 4, 4, dtype) for op in ("svd", "eigh"))


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_auto_real_tuning_is_correct(fresh_cache, monkeypatch, dtype):
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "2")
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()
    try:
        check_svd(make("random", 40, 5, 5, seed=6), dtype, full=False, method="auto")
        check_eigh(herm("random", 40, 5, seed=6), dtype, "L", method="auto")
        check_svd(make("random", 40, 5, 5, seed=6), dtype, full=False, method="auto")  # routed
    finally:
        tl._drop_routes()


@pytest.mark.parametrize("method", ["jacobi", "auto"])
def test_conjugate_views_are_read_conjugated(monkeypatch, method):
    """A lazy conjugate (``A.conj()``: A's memory, unconjugated, with the conj bit; contiguous)
    is factored as conj(A) by every op, also on the second call, which takes the launchers
    learned by the first (for ``"auto"`` the tuner is faked to pick native)."""
    if method == "auto":
        from torchport import autotune

        monkeypatch.setattr(autotune, "select", _fake_select(True, []))
        monkeypatch.setattr(tl, "_time_pair", lambda fa, fb, x: (1.0, 0.5))
        monkeypatch.setattr(tl, "_memo", {})
        monkeypatch.setattr(tl, "_fast", {})
    tl._drop_routes()
    try:
        for b in (1, 3):
            x = make("random", b, 4, 4, seed=11).to(torch.complex128)
            h = x @ x.mH + 4 * torch.eye(4, dtype=x.dtype)
            xc, hc = x.conj(), h.conj()
            assert xc.is_conj() and xc.is_contiguous()
            xw, hw = xc.resolve_conj(), hc.resolve_conj()
            if method == "auto":
                assert tl._route("cholesky", hw, "auto", (False,)) == "native"
                assert tl._route("qr", xw, "auto", ("reduced",)) == "native"
            for _ in range(2):
                fac = tl.cholesky(hc, method=method)
                assert torch.allclose(fac, torch.linalg.cholesky(hw), atol=1e-10)
                fac2, info = tl.cholesky_ex(hc, method=method)
                assert torch.allclose(fac2, fac) and not bool(info.any())
                q, r = tl.qr(xc, method=method)
                assert torch.allclose(r, torch.linalg.qr(xw).R, atol=1e-10)
                assert torch.allclose(q @ r, xw, atol=1e-10)
                lam, v = tl.eigh(hc, method=method)
                assert torch.allclose(lam, torch.linalg.eigvalsh(hw), atol=1e-10)
                assert torch.allclose(hw @ v, v * lam.unsqueeze(-2).to(v.dtype), atol=1e-9)
                u, s, vh = tl.svd(xc, full_matrices=False, method=method)
                assert torch.allclose(s, torch.linalg.svdvals(xw), atol=1e-10)
                assert torch.allclose((u * s.unsqueeze(-2).to(u.dtype)) @ vh, xw, atol=1e-10)
    finally:
        tl._drop_routes()
