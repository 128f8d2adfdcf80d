"""Regression tests from the fiftieth session's review of torchport.linalg.

- The plain-torch references ``svd_reference`` and ``eigh_tridiagonal_reference`` skipped the
  kernels' first step, the scaling of each matrix by a power of two: the SVD's squared column
  norms underflowed (float32 entries ~1e-30 gave S = 0) or overflowed, and the tridiagonal QL's
  relative test never held for the subnormal noise eigenvalues of a rank-deficient matrix scaled
  by 1e-35 / 1e-300 (eigenvalues off by 0.1-0.4 ‖A‖ after the sweep cap).
- The kernels at the same scalings (tiny, huge; every route: one matrix, per-matrix batched,
  lanes) stay within 10 n eps of LAPACK in the matrix's norm: they scale first.
- The round-robin Jacobi SVD's running-norm recompute (session 49) moved out of the rotation loop
  (a pass of its own when a round needs one): still taken for a matrix of ones at n = 32.

Metrics are formed on A scaled by a power of two (exact), so that huge input does not overflow
them in float64: eigenvalues / singular values against torch.linalg, residual and
orthogonality, each <= 10 n eps (relative to ‖A‖_F).
"""

from __future__ import annotations

import pytest
import torch

from torchport.linalg import eigh_tridiag, kernels, one, reference

C = 10  # tolerance factor: <= C n eps

SCALES = {
    torch.float32: [1e-30, 1e-35, 1e30, 1e36],
    torch.float64: [1e-300, 1e-305, 1e300, 1e305],
}
CASES = [(dt, s) for dt, ss in SCALES.items() for s in ss]


def _ids(case: tuple[torch.dtype, float]) -> str:
    return f"{str(case[0]).removeprefix('torch.')}-{case[1]:g}"


def _pow2(a: torch.Tensor) -> torch.Tensor:
    """(B,) float64 2^-e / 2, with 2^e <= max |a_b| < 2^(e + 1), applied twice (so it does not
    overflow for subnormal maxima): a * f * f has its largest entry in [0.5, 1)."""
    mx = a.double().abs().flatten(1).amax(-1)
    e = torch.frexp(mx)[1].double()
    return torch.pow(2.0, -e / 2)


def _sym(kind: str, b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(b, n, n, dtype=torch.float64, generator=g)
        return x + x.mT
    r = 1 if kind == "rank1" else 2
    v = torch.randn(b, n, r, dtype=torch.float64, generator=g)
    return v @ v.mT


def _eigh_errors(a: torch.Tensor, lam: torch.Tensor, q: torch.Tensor) -> tuple[float, ...]:
    f = _pow2(a)
    a64 = a.double() * f[:, None, None] * f[:, None, None]
    lam64 = lam.double() * f[:, None] * f[:, None]
    nrm = a64.flatten(1).norm(dim=-1)
    ref = torch.linalg.eigvalsh(a64)
    err = ((lam64 - ref).abs().amax(-1) / nrm).max()
    q64 = q.double()
    res = ((a64 @ q64 - q64 * lam64[:, None, :]).flatten(1).norm(dim=-1) / nrm).max()
    orth = (q64.mT @ q64 - torch.eye(a.shape[-1], dtype=torch.float64)).abs().max()
    return tuple(float(x.nan_to_num(float("inf"))) for x in (err, res, orth))


def _svd_errors(
    a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor
) -> tuple[float, ...]:
    f = _pow2(a)
    a64 = a.double() * f[:, None, None] * f[:, None, None]
    s64 = s.double() * f[:, None] * f[:, None]
    nrm = a64.flatten(1).norm(dim=-1)
    err = ((s64 - torch.linalg.svdvals(a64)).abs().amax(-1) / nrm).max()
    res = (((u.double() * s64[:, None, :]) @ vh.double() - a64).flatten(1).norm(dim=-1) / nrm).max()
    k = s.shape[-1]
    eye = torch.eye(k, dtype=torch.float64)
    orth = max(
        (u.double().mT @ u.double() - eye).abs().max(),
        (vh.double() @ vh.double().mT - eye).abs().max(),
    )
    return tuple(float(torch.as_tensor(x).nan_to_num(float("inf"))) for x in (err, res, orth))


@pytest.mark.parametrize("kind", ["random", "rank1", "rank2"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_eigh_tridiagonal_reference_scaled(case, kind):
    dtype, s = case
    n = 16
    a = (_sym(kind, 3, n, seed=n) * s).to(dtype)
    assert bool(torch.isfinite(a).all())
    lam, q = reference.eigh_tridiagonal_reference(a)
    tol = C * n * torch.finfo(dtype).eps
    err, res, orth = _eigh_errors(a, lam, q)
    assert err <= tol and res <= tol and orth <= tol, (err, res, orth)


@pytest.mark.parametrize("shape", [(8, 8), (11, 8), (8, 11)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_svd_reference_scaled(case, shape):
    dtype, s = case
    m, n = shape
    g = torch.Generator().manual_seed(m + n)
    a = (torch.randn(3, m, n, dtype=torch.float64, generator=g) * s).to(dtype)
    assert bool(torch.isfinite(a).all())
    u, sv, vh = reference.svd_reference(a)
    tol = C * max(m, n) * torch.finfo(dtype).eps
    err, res, orth = _svd_errors(a, u, sv, vh)
    assert err <= tol and res <= tol and orth <= tol, (err, res, orth)
    _, sv_only, _ = reference.svd_reference(a, compute_uv=False)
    assert torch.equal(sv_only, sv)


def _eigh_routes(a: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    n, dtype = a.shape[-1], a.dtype

    def one_matrix(tridiagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        run = one.eigh_plan(a[0].shape, dtype, False, True, tridiagonal)
        outs = [run(x.contiguous()) for x in a]
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])

    lanes_tri = eigh_tridiag.eigh(a, False, True)
    assert lanes_tri[2] == 0
    return {
        "lanes-tridiagonal": lanes_tri[:2],
        "lanes-jacobi": kernels.eigh(a, False, True, lanes=True, jacobi=True)[:2],
        "per-matrix": kernels.eigh(a, False, True, lanes=False)[:2],
        "one-tridiagonal": one_matrix(True),
        "one-jacobi": one_matrix(False) if n <= 32 else lanes_tri[:2],
    }


@pytest.mark.parametrize("kind", ["random", "rank1"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_eigh_kernels_scaled(case, kind):
    dtype, s = case
    n = 16
    a = (_sym(kind, 16, n, seed=3 * n) * s).to(dtype).contiguous()
    assert bool(torch.isfinite(a).all())
    tol = C * n * torch.finfo(dtype).eps
    for route, (lam, q) in _eigh_routes(a).items():
        err, res, orth = _eigh_errors(a, lam, q)
        assert err <= tol and res <= tol and orth <= tol, (route, err, res, orth)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_svd_kernels_scaled(case):
    dtype, s = case
    m, n = 19, 16
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(16, m, n, dtype=torch.float64, generator=g) * s).to(dtype).contiguous()
    assert bool(torch.isfinite(a).all())
    tol = C * m * torch.finfo(dtype).eps
    run = one.svd_plan(a[0].shape, dtype, False, True)
    outs = [run(x.contiguous()) for x in a]
    routes = {
        "lanes": kernels.svd(a, False, True, lanes=True)[:3],
        "per-matrix": kernels.svd(a, False, True, lanes=False)[:3],
        "per-matrix-cyclic": kernels.svd(a, False, True, order=0, lanes=False)[:3],
        "one": tuple(torch.stack([o[i] for o in outs]) for i in range(3)),
    }
    for route, (u, sv, vh) in routes.items():
        err, res, orth = _svd_errors(a, u, sv, vh)
        assert err <= tol and res <= tol and orth <= tol, (route, err, res, orth)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_qr_and_cholesky_kernels_scaled(case):
    dtype, s = case
    m, n = 19, 16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, m, n, dtype=torch.float64, generator=g)
    a = (x * s).to(dtype).contiguous()
    tol = C * m * torch.finfo(dtype).eps
    eye = torch.eye(n, dtype=torch.float64)
    for lanes in (True, False):
        q, r = kernels.qr(a, "reduced", lanes=lanes)
        f = _pow2(a)[:, None, None]
        a64, r64 = a.double() * f * f, r.double() * f * f
        res = ((q.double() @ r64 - a64).flatten(1).norm(dim=-1) / a64.flatten(1).norm(dim=-1)).max()
        orth = (q.double().mT @ q.double() - eye).abs().max()
        assert float(res) <= tol and float(orth) <= tol, (lanes, float(res), float(orth))
    spd = x.mT @ x + n * torch.eye(n, dtype=torch.float64)
    a = (spd * s / spd.abs().amax()).to(dtype).contiguous()
    for lanes in (True, False):
        fac, info, bad = kernels.cholesky(a, False, lanes=lanes)
        assert bad == 0 and not bool(info.any())
        f = _pow2(a)[:, None, None]
        a64, l64 = a.double() * f * f, fac.double() * f
        res = ((l64 @ l64.mT - a64).flatten(1).norm(dim=-1) / a64.flatten(1).norm(dim=-1)).max()
        assert float(res) <= tol, (lanes, float(res))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [8, 32])
def test_svd_round_robin_recompute_of_ones(dtype, n):
    """A matrix of ones (and one with two repeated columns) through the round-robin order (the
    pass that recomputes a running norm): S = (n, 0, ...), finite orthonormal U and Vh."""
    assert n >= kernels.SVD_ROUND_ROBIN_FROM
    ones = torch.ones(n, n, dtype=dtype)
    g = torch.Generator().manual_seed(n)
    rep = torch.randn(n, n, generator=g).to(dtype)
    rep[:, 1] = rep[:, 0]
    tol = C * n * torch.finfo(dtype).eps
    for a in (ones, rep):
        u, s, vh = one.svd_plan(a.shape, dtype, False, True)(a)
        ub, sb, vhb, bad = kernels.svd(a.expand(3, n, n).contiguous(), False, True, lanes=False)
        assert bad == 0
        for uu, ss, vv in ((u[None], s[None], vh[None]), (ub, sb, vhb)):
            err, res, orth = _svd_errors(a.expand(uu.shape[0], n, n), uu, ss, vv)
            assert err <= tol and res <= tol and orth <= tol, (err, res, orth)
