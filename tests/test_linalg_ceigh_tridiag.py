"""Complex eigh of one matrix by Householder tridiagonalisation + the real implicit QL (flag 2 of
tp_ceigh1, torchport.linalg.one from EIGH_TRIDIAGONAL_FROM): the plain-torch reference
(complex_eigh_tridiagonal_reference) against torch.linalg, and the kernel against both, on
random, repeated-eigenvalue, diagonal, zero, ill-conditioned and already tridiagonal Hermitian
matrices read from either triangle; non-finite input rejected as the Jacobi worker does."""

from __future__ import annotations

import pytest
import torch

from torchport.linalg import one
from torchport.linalg.reference import complex_eigh_tridiagonal_reference

CDTYPES = [torch.complex64, torch.complex128]
NS = [1, 2, 3, 8, 16, 17, one.ONE_MAX_N]
KINDS = ["random", "repeated", "diagonal", "zero", "illcond", "tridiagonal"]
TOL = {torch.complex64: 2e-4, torch.complex128: 1e-10}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _unitary(n: int, seed: int) -> torch.Tensor:
    x = torch.randn((n, n), dtype=torch.complex128, generator=_gen(seed))
    return torch.linalg.qr(x).Q


def _herm(kind: str, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A Hermitian (1, n, n) matrix of ``kind`` (built in complex128)."""
    c = torch.complex128
    if kind == "random":
        x = torch.randn((n, n), dtype=c, generator=_gen(seed))
        h = x + x.mH
    elif kind in ("repeated", "illcond"):
        if kind == "repeated":  # two clusters of equal eigenvalues
            lam = torch.tensor([1.0 if i % 2 else -2.0 for i in range(n)], dtype=torch.float64)
        else:
            cond = 1e6 if dtype == torch.complex128 else 1e3
            lam = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
        u = _unitary(n, seed)
        h = (u * lam.to(c)) @ u.mH
    elif kind == "diagonal":
        h = torch.diag(torch.randn(n, dtype=torch.float64, generator=_gen(seed)).to(c))
    elif kind == "zero":
        h = torch.zeros((n, n), dtype=c)
    else:  # tridiagonal with complex couplings: no reflection runs, only the phases
        d = torch.randn(n, dtype=torch.float64, generator=_gen(seed)).to(c)
        e = torch.randn(max(n - 1, 0), dtype=c, generator=_gen(seed + 1))
        h = torch.diag(d) + torch.diag(e, -1) + torch.diag(e.conj(), 1)
    return ((h + h.mH) / 2).to(dtype)[None]


def _uplo_only(h: torch.Tensor, upper: bool, seed: int = 7) -> torch.Tensor:
    """``h`` with the unread triangle replaced by noise and an imaginary part on the diagonal
    (both ignored by eigh)."""
    n = h.shape[-1]
    noise = torch.randn(h.shape, dtype=h.dtype, generator=_gen(seed))
    keep = h.triu(1) if upper else h.tril(-1)
    other = noise.tril(-1) if upper else noise.triu(1)
    diag = torch.diag_embed(
        h.diagonal(0, -2, -1).real.to(h.dtype) + 1j * noise.diagonal(0, -2, -1).imag
    )
    return (keep + other + diag).contiguous() if n else h


def _check_pairs(h: torch.Tensor, lam: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
    """Eigenvalues against torch.linalg (float64), residual ‖HV − VΛ‖ and ‖VᴴV − I‖."""
    n = h.shape[-1]
    hc = h.to(torch.complex128)
    scale = max(1.0, float(hc.abs().max()))
    tol = TOL[dtype] * scale * max(1, n) ** 0.5
    want = torch.linalg.eigvalsh(hc)
    assert lam.dtype == dtype.to_real()
    torch.testing.assert_close(lam.reshape(want.shape).double(), want, atol=tol, rtol=0)
    if v is None:
        return
    vc = v.reshape(hc.shape).to(torch.complex128)
    res = (hc @ vc - vc * lam.reshape(1, 1, n).to(torch.complex128)).abs().max()
    orth = (vc.mH @ vc - torch.eye(n, dtype=torch.complex128)).abs().max()
    assert float(res) <= tol and float(orth) <= TOL[dtype] * max(1, n) ** 0.5, (res, orth)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("upper", [False, True])
def test_reference_matches_torch(n: int, kind: str, upper: bool) -> None:
    h = _herm(kind, n, torch.complex128)
    lam, v = complex_eigh_tridiagonal_reference(_uplo_only(h, upper), upper)
    _check_pairs(h, lam, v, torch.complex128)
    vals, empty = complex_eigh_tridiagonal_reference(_uplo_only(h, upper), upper, compute_v=False)
    assert empty.numel() == 0
    torch.testing.assert_close(vals, lam, atol=1e-12 * max(1, n), rtol=0)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("upper", [False, True])
def test_kernel_matches_reference_and_torch(
    n: int, kind: str, upper: bool, dtype: torch.dtype
) -> None:
    h = _herm(kind, n, dtype)
    a = _uplo_only(h, upper)
    got = one.eigh_plan(a.shape, dtype, upper, True, tridiagonal=True)(a)
    assert type(got) is type(torch.linalg.eigh(a))
    _check_pairs(h, got.eigenvalues, got.eigenvectors, dtype)
    vals = one.eigh_plan(a.shape, dtype, upper, False, tridiagonal=True)(a)
    _check_pairs(h, vals, None, dtype)
    ref_lam, ref_v = complex_eigh_tridiagonal_reference(a.to(torch.complex128), upper)
    tol = TOL[dtype] * max(1.0, float(h.abs().max())) * max(1, n) ** 0.5
    torch.testing.assert_close(got.eigenvalues.double(), ref_lam, atol=tol, rtol=0)
    if dtype == torch.complex128 and kind in ("random", "tridiagonal"):
        # separated eigenvalues: the same vectors as the reference up to a phase per column
        gv = got.eigenvectors[0]
        ph = (ref_v[0].conj() * gv).sum(0)
        torch.testing.assert_close(gv, ref_v[0] * (ph / ph.abs()), atol=1e-9, rtol=0)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", [3, 16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite(n: int, dtype: torch.dtype, bad: float) -> None:
    for value in (complex(bad, 0), complex(0, bad)):
        h = _herm("random", n, dtype)
        a = h.clone()
        a[0, n - 1, 0] = value  # lower triangle
        for wantv in (True, False):
            with pytest.raises(torch.linalg.LinAlgError, match=r"linalg\.eigh: \(Batch element 0"):
                one.eigh_plan(a.shape, dtype, False, wantv, tridiagonal=True)(a)
        # only in the triangle eigh does not read: solved, as torch.linalg
        got = one.eigh_plan(a.shape, dtype, True, True, tridiagonal=True)(a)
        _check_pairs(h, got.eigenvalues, got.eigenvectors, dtype)
        _check_pairs(
            h, one.eigh_plan(a.shape, dtype, True, False, tridiagonal=True)(a), None, dtype
        )


def test_eigh_plan_default_algorithm() -> None:
    """Jacobi below EIGH_TRIDIAGONAL_FROM, the tridiagonal worker from it on."""
    for dtype in CDTYPES:
        lo, hi = one.EIGH_TRIDIAGONAL_FROM[dtype] - 1, one.EIGH_TRIDIAGONAL_FROM[dtype]
        for n, tri in ((lo, False), (hi, True), (one.ONE_MAX_N, True)):
            if n < 1:
                continue
            a = _herm("random", n, dtype, seed=n)
            got = one.eigh_plan(a.shape, dtype, False, True)(a)
            want = one.eigh_plan(a.shape, dtype, False, True, tridiagonal=tri)(a)
            assert torch.equal(got.eigenvalues, want.eigenvalues)
            assert torch.equal(got.eigenvectors, want.eigenvectors)
