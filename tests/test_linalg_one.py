"""The one-matrix launchers (torchport.linalg.one) and the method="auto" route to them: the same
results as the batched kernels (to a few ulps: the same workers, compiled at another inlining site)
and torch.linalg (to rounding), the same errors, and
the route table dropped or bypassed when it must be. Deterministic: routes are seeded directly,
nothing is timed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchport.linalg as tl
from torchport import config
from torchport.linalg import kernels, one

DTYPES = [torch.float32, torch.float64]
SHAPES = [(1, 2, 2), (3, 3), (1, 4, 4), (1, 1, 5, 5), (8, 8), (1, 16, 16), (32, 32)]
RECT = [(1, 3, 5), (5, 3), (1, 7, 2), (32, 1)]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _spd(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = _rand(shape, torch.float64)
    n = shape[-1]
    return (x @ x.mT + n * torch.eye(n, dtype=torch.float64)).to(dtype)


def _tol(dtype: torch.dtype) -> float:
    return 2e-4 if dtype == torch.float32 else 1e-10


def _same(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to a few ulps of the largest entry (the batched kernel's result ``ref``)."""
    got = got.reshape(ref.shape)
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    assert err <= 64 * torch.finfo(ref.dtype).eps * scale, err


def _flat(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(1, *a.shape[-2:]).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + RECT, ids=str)
@pytest.mark.parametrize("full", [False, True])
def test_svd_matches_batched_kernel_and_torch(
    shape: tuple[int, ...], dtype: torch.dtype, full: bool
) -> None:
    a = _rand(shape, dtype)
    got = one.svd_plan(a.shape, dtype, full, True)(a)
    assert type(got) is type(torch.linalg.svd(a))
    u, s, vh, bad = kernels.svd(_flat(a), full, True, lanes=False)
    assert bad == 0
    _same(got.S, s)
    _same(got.U, u)
    _same(got.Vh, vh)
    ref = torch.linalg.svd(a, full_matrices=full)
    assert got.U.shape == ref.U.shape and got.Vh.shape == ref.Vh.shape
    torch.testing.assert_close(got.S, ref.S, atol=_tol(dtype), rtol=_tol(dtype))
    vals = one.svd_plan(a.shape, dtype, False, False)(a)
    assert torch.equal(vals, got.S)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("upper", [False, True])
def test_eigh_matches_batched_kernel_and_torch(
    shape: tuple[int, ...], dtype: torch.dtype, upper: bool
) -> None:
    a = _rand(shape, dtype)  # not symmetric: only the UPLO triangle may be read
    got = one.eigh_plan(a.shape, dtype, upper, True, tridiagonal=False)(a)
    assert type(got) is type(torch.linalg.eigh(a))
    lam, q, bad = kernels.eigh(_flat(a), upper, True, lanes=False)
    assert bad == 0
    _same(got.eigenvalues, lam)
    _same(got.eigenvectors, q)
    ref = torch.linalg.eigvalsh(a, UPLO="U" if upper else "L")
    torch.testing.assert_close(got.eigenvalues, ref, atol=10 * _tol(dtype), rtol=_tol(dtype))
    vals = one.eigh_plan(a.shape, dtype, upper, False, tridiagonal=False)(a)
    assert torch.equal(vals, got.eigenvalues)


TRI_N = [1, 2, 3, 5, 8, 13, 16, 24, 32]
TRI_KINDS = ["random", "repeated", "clustered", "diagonal", "zero", "identity", "graded", "tiny"]


def _sym(kind: str, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """One symmetric n x n matrix: random; two eigenvalues of multiplicity ~n/2 (repeated);
    eigenvalues 1 + j·1e-9 (clustered, ill-conditioned vectors); diagonal with repeats; zero;
    identity; entries scaled by g_i g_j over 12 (f64) / 5 (f32) decades (graded); random times
    1e-150 (f64) / 1e-18 (f32), where squares underflow (tiny)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n, dtype=torch.float64, generator=gen)
    x = x + x.mT
    q = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))[0]
    if kind == "repeated":
        x = (q * torch.tensor([1.0] * (n // 2) + [3.0] * (n - n // 2), dtype=torch.float64)) @ q.mT
    elif kind == "clustered":
        x = (q * (1 + 1e-9 * torch.arange(n, dtype=torch.float64))) @ q.mT
    elif kind == "diagonal":
        x = torch.diag(torch.tensor([2.0, -1.0, 2.0, 0.5] * n, dtype=torch.float64)[:n])
    elif kind == "zero":
        x = torch.zeros(n, n, dtype=torch.float64)
    elif kind == "identity":
        x = torch.eye(n, dtype=torch.float64)
    elif kind == "graded":
        g = torch.logspace(0, -12 if dtype == torch.float64 else -5, n, dtype=torch.float64)
        x = x * g[:, None] * g[None, :]
    elif kind == "tiny":
        x = x * (1e-150 if dtype == torch.float64 else 1e-18)
    return x.to(dtype).contiguous()


def _check_eigh(
    x: torch.Tensor, lam: torch.Tensor, q: torch.Tensor | None, ref_lam: torch.Tensor
) -> None:
    """Eigenvalues within 8 n eps ‖X‖ of ``ref_lam``, ascending; ‖XQ - QΛ‖ <= 8 n eps ‖X‖ and
    ‖QᵀQ - I‖_max <= 8 n eps."""
    n, eps = x.shape[-1], torch.finfo(x.dtype).eps
    nrm = max(float(x.double().norm()), 1e-300)
    assert float((lam.double() - ref_lam.double()).abs().max()) <= 8 * n * eps * nrm
    assert torch.equal(lam, lam.sort().values)
    if q is None:
        return
    xd, qd, ld = x.double(), q.double(), lam.double()
    assert float((xd @ qd - qd * ld).norm()) <= 8 * n * eps * nrm
    assert float((qd.mT @ qd - torch.eye(n, dtype=torch.float64)).abs().max()) <= 8 * n * eps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", TRI_KINDS)
@pytest.mark.parametrize("n", TRI_N)
def test_eigh_tridiagonal_matches_reference_and_torch(
    n: int, kind: str, dtype: torch.dtype
) -> None:
    a = _sym(kind, n, dtype, seed=n)
    got = one.eigh_plan(a.shape, dtype, False, True, tridiagonal=True)(a)
    assert type(got) is type(torch.linalg.eigh(a))
    ref = torch.linalg.eigh(a)
    _check_eigh(a, got.eigenvalues, got.eigenvectors, ref.eigenvalues)
    rl, rq = tl.eigh_tridiagonal_reference(a[None])
    _check_eigh(a, got.eigenvalues, None, rl[0])
    if kind == "random":  # distinct eigenvalues: the same vectors as the reference, up to sign
        sign = torch.sign((got.eigenvectors * rq[0]).sum(0))
        tol = 64 * n * torch.finfo(dtype).eps
        torch.testing.assert_close(got.eigenvectors * sign, rq[0], atol=tol, rtol=0)
    vals = one.eigh_plan(a.shape, dtype, False, False, tridiagonal=True)(a)
    _check_eigh(a, vals, None, ref.eigenvalues)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 5, 5), (13, 13), (1, 1, 24, 24)], ids=str)
@pytest.mark.parametrize("upper", [False, True])
def test_eigh_tridiagonal_reads_one_triangle(
    shape: tuple[int, ...], dtype: torch.dtype, upper: bool
) -> None:
    a = _rand(shape, dtype)  # not symmetric: only the UPLO triangle may be read
    got = one.eigh_plan(a.shape, dtype, upper, True, tridiagonal=True)(a)
    x = (a.triu() if upper else a.tril()).reshape(shape[-2:])
    x = x + x.mT - torch.diag(x.diagonal())
    ref = torch.linalg.eigvalsh(a, UPLO="U" if upper else "L").reshape(-1)
    assert got.eigenvalues.shape == shape[:-1] and got.eigenvectors.shape == shape
    _check_eigh(x, got.eigenvalues.reshape(-1), got.eigenvectors.reshape(x.shape), ref)
    vals = one.eigh_plan(a.shape, dtype, upper, False, tridiagonal=True)(a)
    assert vals.shape == shape[:-1]
    _check_eigh(x, vals.reshape(-1), None, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_eigh_tridiagonal_rejects_non_finite(dtype: torch.dtype, bad: float) -> None:
    """Non-finite input gets torch.linalg's answer: LinAlgError where LAPACK fails (NaN, an
    infinite diagonal), its NaNs where it runs through (an infinite off-diagonal entry)."""
    for n, where in ((16, 0), (4, 3)):
        a = _sym("random", n, dtype)
        a[where, 0] = bad  # lower triangle
        try:
            want = torch.linalg.eigvalsh(a).isnan()
        except torch.linalg.LinAlgError:
            want = None
        for wantv in (True, False):
            plan = one.eigh_plan(a.shape, dtype, False, wantv, tridiagonal=True)
            if want is None:
                with pytest.raises(torch.linalg.LinAlgError, match=r"linalg\.eigh: The alg"):
                    plan(a)
            else:
                got = plan(a)
                assert torch.equal((got[0] if wantv else got).isnan(), want)


def test_eigh_plan_default_algorithm() -> None:
    """Jacobi below EIGH_TRIDIAGONAL_FROM (bit-equal to the batched kernel), QL from it on."""
    for dtype in DTYPES:
        lo, hi = one.EIGH_TRIDIAGONAL_FROM[dtype] - 1, one.EIGH_TRIDIAGONAL_FROM[dtype]
        a = _rand((lo, lo), dtype)
        assert torch.equal(
            one.eigh_plan(a.shape, dtype, False, True)(a).eigenvectors,
            one.eigh_plan(a.shape, dtype, False, True, tridiagonal=False)(a).eigenvectors,
        )
        b = _rand((hi, hi), dtype)
        assert torch.equal(
            one.eigh_plan(b.shape, dtype, False, True)(b).eigenvectors,
            one.eigh_plan(b.shape, dtype, False, True, tridiagonal=True)(b).eigenvectors,
        )


@pytest.mark.parametrize("n", [5, 16, 32])
def test_auto_eigh_tridiagonal_route_and_autograd_match_torch(n: int) -> None:
    """A single matrix that "auto" routes native runs the QL launcher; with autograd to record
    it takes the general path, and values and gradients match torch.linalg.eigh."""
    tl._drop_routes()
    a = _spd((n, n), torch.float64)
    tl._sync_routes()
    tl._fast[("eigh", a.shape, a.dtype, a.device, (False, True))] = "native"
    got = tl.eigh(a)
    run = tl._one["eigh"][(a.shape, a.dtype, "L", True)]
    assert torch.equal(run(a).eigenvectors, got.eigenvectors)
    _check_eigh(a, got.eigenvalues, got.eigenvectors, torch.linalg.eigvalsh(a))
    x = a.clone().requires_grad_()
    y = a.clone().requires_grad_()
    w = _rand((n, n), torch.float64, seed=1)
    lam, q = tl.eigh(x)
    (lam.sum() + ((q * q.sum(0).sign()) * w).sum()).backward()
    lam_t, q_t = torch.linalg.eigh(y)
    (lam_t.sum() + ((q_t * q_t.sum(0).sign()) * w).sum()).backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(x.grad, y.grad, atol=1e-8, rtol=1e-8)
    tl._drop_routes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + RECT, ids=str)
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr_matches_batched_kernel_and_torch(
    shape: tuple[int, ...], dtype: torch.dtype, mode: str
) -> None:
    a = _rand(shape, dtype)
    got = one.qr_plan(a.shape, dtype, mode)(a)
    assert type(got) is type(torch.linalg.qr(a))
    q, r = kernels.qr(_flat(a), mode, lanes=False)
    _same(got.R, r)
    ref = torch.linalg.qr(a, mode=mode)
    assert got.Q.shape == ref.Q.shape and got.R.shape == ref.R.shape
    if mode != "r":
        _same(got.Q, q)
    tol = 10 * _tol(dtype)
    torch.testing.assert_close(got.R, ref.R, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_matches_batched_kernel_and_torch(
    shape: tuple[int, ...], dtype: torch.dtype, upper: bool
) -> None:
    a = _spd(shape, dtype)
    fac = one.cholesky_plan(a.shape, dtype, upper, tl._raise_not_pd)(a)
    ref_fac, _, bad = kernels.cholesky(_flat(a), upper, lanes=False, blocked=False)
    assert bad == 0
    _same(fac, ref_fac)
    torch.testing.assert_close(fac, torch.linalg.cholesky(a, upper=upper))
    ex = one.cholesky_ex_plan(a.shape, dtype, upper, tl._raise_not_pd)(a, True)
    assert type(ex) is type(torch.linalg.cholesky_ex(a))
    assert torch.equal(ex.L, fac)
    assert ex.info.shape == shape[:-2] and ex.info.dtype == torch.int32 and not ex.info.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_input(dtype: torch.dtype) -> None:
    a = _rand((1, 6, 6), dtype)
    t = a.mT  # not contiguous: the launcher copies it first
    assert torch.equal(
        one.qr_plan(t.shape, dtype, "reduced")(t).R,
        one.qr_plan(t.shape, dtype, "reduced")(t.contiguous()).R,
    )
    s = one.svd_plan(t.shape, dtype, False, False)
    assert torch.equal(s(t), s(t.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 3), (4, 4)], ids=str)
def test_errors_match_the_op_layer(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    where = r"\(Batch element 0\): " if len(shape) > 2 else ""
    a = _rand(shape, dtype)
    a[..., 1, 0] = float("nan")
    for plan, op in (
        (one.svd_plan(a.shape, dtype, False, True), "svd"),
        (one.svd_plan(a.shape, dtype, False, False), "svd"),
        (one.eigh_plan(a.shape, dtype, False, True), "eigh"),
        (one.eigh_plan(a.shape, dtype, False, False), "eigh"),
    ):
        with pytest.raises(torch.linalg.LinAlgError, match=rf"linalg\.{op}: {where}The alg"):
            plan(a)
    n = shape[-1]
    bad = _spd(shape, dtype)
    bad[..., n - 1, n - 1] = -100.0
    chol = one.cholesky_plan(bad.shape, dtype, False, tl._raise_not_pd)
    with pytest.raises(torch.linalg.LinAlgError, match=rf"cholesky: {where}.*order {n} is not"):
        chol(bad)
    ex = one.cholesky_ex_plan(bad.shape, dtype, False, tl._raise_not_pd)
    fac, info = ex(bad, False)
    assert info.reshape(-1).tolist() == [n] and not fac.any()
    with pytest.raises(torch.linalg.LinAlgError, match=rf"cholesky_ex: {where}.*order {n} is"):
        ex(bad, True)


def test_sizes_beyond_the_launchers_are_refused() -> None:
    assert one.fits(32, 32) and one.fits(1, 32) and not one.fits(33, 4) and not one.fits(0, 3)
    with pytest.raises(AssertionError):
        one.svd_plan(torch.Size((2, 3, 3)), torch.float64, False, True)  # two matrices
    with pytest.raises(AssertionError):
        one.eigh_plan(torch.Size((33, 33)), torch.float64, False, True)
    # the C guard: an order past ONE_MAX_N is refused without touching memory
    call = kernels.library(torch.float64, kernels.native.cpu_info().isa)["eigh1"].raw_call
    assert call(0, 0, 0, one._code(0, 33, False, True)) == -1


def _seed_one(fn: str, a: torch.Tensor, public: tuple[Any, ...], run: Any) -> None:
    tl._sync_routes()
    tl._one[fn][(a.shape, a.dtype, *public)] = run


def test_auto_route_runs_the_launcher_and_keeps_autograd() -> None:
    tl._drop_routes()
    a = _spd((1, 4, 4), torch.float64)
    calls: list[int] = []
    plan = one.eigh_plan(a.shape, a.dtype, False, True)

    def counted(x: torch.Tensor) -> Any:
        calls.append(1)
        return plan(x)

    _seed_one("eigh", a, ("L", True), counted)
    got = tl.eigh(a)
    assert calls == [1] and type(got) is type(torch.linalg.eigh(a))
    torch.testing.assert_close(got.eigenvalues, torch.linalg.eigvalsh(a))
    assert len(tl.eigh(a, UPLO="U").eigenvalues) == 1 and calls == [1]  # another key
    x = a.clone().requires_grad_()  # autograd to record: the general path
    tl.eigh(x).eigenvalues.sum().backward()
    assert calls == [1] and x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(tl.LinalgInputError):
        tl.eigh(a, UPLO="X")
    config.set("autotune_noise", config.get("autotune_noise"))  # a setting assignment
    try:
        tl.eigh(a)
        assert calls == [1]  # stale: the general path dropped it (and routed afresh)
        assert counted not in tl._one["eigh"].values()
    finally:
        config.set("autotune_noise", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_learns_launchers_for_native_routes(dtype: torch.dtype) -> None:
    """A call that "auto" routes native at B = 1 learns the launcher; repeats return equal
    results through it (routes forced by seeding the per-call route cache)."""
    tl._drop_routes()
    a, s = _rand((1, 5, 5), dtype), _spd((1, 5, 5), dtype)
    cases = (
        ("svd", "svd", a, (False, True), lambda: tl.svd(a, full_matrices=False)),
        ("svdvals", "svd", a, (False, False), lambda: tl.svdvals(a)),
        ("eigh", "eigh", s, (False, True), lambda: tl.eigh(s)),
        ("eigvalsh", "eigh", s, (False, False), lambda: tl.eigvalsh(s)),
        ("qr", "qr", a, ("reduced",), lambda: tl.qr(a)),
        ("cholesky", "cholesky", s, (False,), lambda: tl.cholesky(s)),
        ("cholesky_ex", "cholesky", s, (False,), lambda: tl.cholesky_ex(s)),
    )
    for fn, op, x, extra, call in cases:
        tl._sync_routes()
        tl._fast[(op, x.shape, x.dtype, x.device, extra)] = "native"
        first = call()
        assert len(tl._one[fn]) == 1, fn
        again = call()
        for f, g in zip(
            first if isinstance(first, tuple) else (first,),
            again if isinstance(again, tuple) else (again,),
            strict=True,
        ):
            assert torch.equal(f, g), fn


def test_one_matrix_candidates() -> None:
    assert tl._one_candidate("eigh", 16, 16) and tl._one_candidate("eigh", 32, 32)
    assert not tl._one_candidate("eigh", 33, 33)
    assert tl._one_candidate("svd", 32, 32) and tl._one_candidate("qr", 32, 5)
    assert not tl._one_candidate("svd", 33, 33) and not tl._one_candidate("cholesky", 0, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eigh_tridiagonal_falls_back_to_jacobi(dtype: torch.dtype) -> None:
    """An eigenvalue that needs more QL sweeps than the cap sends the matrix to the Jacobi worker:
    with the cap at one sweep (a library built with max_sweeps=1) the tridiagonal flag returns
    the (one-sweep) Jacobi result bit for bit."""
    call = kernels.library(dtype, kernels.native.cpu_info().isa, max_sweeps=1)["eigh1"].raw_call
    a = _sym("random", 16, dtype)
    outs = []
    for tri in (True, False):
        lam, q = torch.empty(16, dtype=dtype), torch.empty(16, 16, dtype=dtype)
        code = one._code(0, 16, False, True, bool(kernels.EIGH_ORDER), tri)
        assert call(a.data_ptr(), lam.data_ptr(), q.data_ptr(), code) == 0
        outs.append((lam, q))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    full = one.eigh_plan(a.shape, dtype, False, True, tridiagonal=True)(a)
    assert not torch.equal(full.eigenvectors, outs[1][1])  # the uncapped worker: QL
