"""Regression tests from the forty-ninth session's review of torchport.linalg: exactly
rank-deficient input (matrices of ones, block-constant, duplicated columns, integer v vᵀ).

- The one-sided Jacobi SVD's running column norms cancelled to <= 0 for identical columns: S = 0
  or NaN, NaN in Vh (per-matrix worker ``svd_one``).
- The Householder reflectors of QR and of the tridiagonal reductions formed their norms in the
  matrix's one scale: trailing columns far below the largest entry had subnormal squares and Q
  was far from orthonormal (``qr_one``, ``tp_qr_vec``, ``eigh_tri_one``, ``ceigh_tri_one``, the
  lane kernel of ``eigh_tridiag``); the one-matrix QL's rotations divided by a subnormal r.

Each route is called directly (no tuning picks another): B = 1 through :mod:`torchport.linalg.one`
(or the batched per-matrix kernel where n > 32), small batches through the per-matrix kernels,
B = 16 through the lane kernels. Orthogonality |QᴴQ - I| <= 10 n eps, reconstruction <= 10 n eps
‖A‖, values against torch.linalg in float64 <= 10 n eps ‖A‖.
"""

from __future__ import annotations

import pytest
import torch

from torchport.linalg import eigh_tridiag, kernels, one, reference

C = 10  # the tolerance factor: |QᴴQ - I| <= C n eps


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype.to_real()).eps


def _orth(q: torch.Tensor) -> float:
    """max |QᴴQ - I| over the batch (in double precision); inf for a non-finite Q."""
    if not bool(torch.isfinite(torch.view_as_real(q) if q.is_complex() else q).all()):
        return float("inf")
    q = q.to(torch.complex128 if q.is_complex() else torch.float64)
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return (q.mH @ q - eye).abs().amax().item()


def _err(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| in double precision; inf where x is not finite."""
    wide = torch.complex128 if x.is_complex() else torch.float64
    d = (x.to(wide) - y.to(wide)).abs()
    return float("inf") if not bool(torch.isfinite(d).all()) else d.amax().item()


def _rank_deficient(kind: str, m: int, n: int, dtype: torch.dtype, b: int) -> torch.Tensor:
    """(b, m, n) exactly rank-deficient matrices of ``kind`` (deterministic)."""
    g = torch.Generator().manual_seed(1000 * m + n)
    if kind == "ones":
        a = torch.ones(b, m, n)
    elif kind == "block":  # two constant blocks, values 1 and 2
        a = torch.zeros(b, m, n)
        a[:, : m // 2, : n // 2] = 1
        a[:, m // 2 :, n // 2 :] = 2
    elif kind == "dupcols":  # columns copied from 3 random ones
        base = torch.randn(b, m, 3, generator=g)
        a = base[:, :, torch.randint(0, 3, (n,), generator=g)]
    else:  # "rank1": integer u vᵀ
        u = torch.randint(1, 4, (b, m, 1), generator=g).float()
        v = torch.randint(1, 4, (b, 1, n), generator=g).float()
        a = u @ v
    return a.to(dtype).contiguous()


def _hermitian(kind: str, n: int, dtype: torch.dtype, b: int, s: int = 0) -> torch.Tensor:
    """(b, n, n) Hermitian rank-deficient matrices: "rank1" v vᵀ with the integer vector
    v_i = 1 + (i² (s + 1) + s + i) mod 3, "rank1r" v vᵀ with v_i in {1, 2, 3} drawn from seed s,
    or the matrices of ones / two constant blocks."""
    if kind == "rank1":
        v = torch.tensor([1 + (i * i * (s + 1) + s + i) % 3 for i in range(n)], dtype=torch.float64)
    elif kind == "rank1r":
        v = torch.randint(1, 4, (n,), generator=torch.Generator().manual_seed(s)).double()
    else:
        return _rank_deficient(kind, n, n, dtype, b)
    return torch.outer(v, v).to(dtype).expand(b, n, n).contiguous()


# --- SVD -----------------------------------------------------------------------------------------


def _check_svd(a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> None:
    m, n = a.shape[-2:]
    eps, p = _eps(a.dtype), max(m, n)
    ref = torch.linalg.svdvals(a.double())
    scale = ref[..., 0].amax().item()
    assert _err(s, ref) <= C * p * eps * scale, (s[0, :3], ref[0, :3])
    assert _orth(vh.mT) <= C * p * eps
    assert _err(u @ torch.diag_embed(s) @ vh, a) <= C * p * eps * scale


SVD_CASES = [
    pytest.param("ones", 32, 32, torch.float32, id="ones32-f32"),
    pytest.param("ones", 20, 20, torch.float64, id="ones20-f64"),
    pytest.param("block", 20, 10, torch.float64, id="block20x10-f64"),
    pytest.param("block", 24, 24, torch.float32, id="block24-f32"),
    pytest.param("dupcols", 12, 9, torch.float32, id="dupcols12x9-f32"),
]


@pytest.mark.parametrize("kind,m,n,dtype", SVD_CASES)
def test_svd_of_repeated_columns_one_matrix(kind, m, n, dtype):
    """Identical columns: the running norm al - t g is pure rounding, often negative; the pair
    was then rotated by 0/0 (S = 0 or NaN, NaN in Vh)."""
    a = _rank_deficient(kind, m, n, dtype, 1)[0]
    u, s, vh = one.svd_plan(a.shape, dtype, False, True)(a)
    _check_svd(a[None], u[None], s[None], vh[None])


@pytest.mark.parametrize("kind,m,n,dtype", SVD_CASES)
@pytest.mark.parametrize("b,lanes", [(3, False), (16, True)], ids=["per-matrix", "lanes"])
def test_svd_of_repeated_columns_batched(kind, m, n, dtype, b, lanes):
    a = _rank_deficient(kind, m, n, dtype, b)
    u, s, vh, bad = kernels.svd(a, False, True, lanes=lanes)
    assert bad == 0
    _check_svd(a, u, s, vh)


def test_svd_of_ones_past_the_one_matrix_sizes():
    """n = 37 > ONE_MAX_N: the batched per-matrix kernel (was S = 0, 0, ...)."""
    a = torch.ones(1, 37, 37, dtype=torch.float64)
    u, s, vh, bad = kernels.svd(a, False, True, lanes=False)
    assert bad == 0
    _check_svd(a, u, s, vh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_svd_reference_of_ones(dtype):
    """The reference recomputes cancelled running norms as the kernel now does (its NaN-skipping
    test already kept it right on this input)."""
    a = torch.ones(1, 16, 16, dtype=dtype)
    u, s, vh = reference.svd_reference(a)
    _check_svd(a, u, s, vh)


# --- QR ------------------------------------------------------------------------------------------


def _check_qr(a: torch.Tensor, q: torch.Tensor, r: torch.Tensor) -> None:
    m, n = a.shape[-2:]
    eps, p = _eps(a.dtype), max(m, n)
    scale = a.abs().amax().item() * p
    assert _orth(q) <= C * p * eps
    assert _err(q @ r, a) <= C * p * eps * scale
    assert bool((r.tril(-1) == 0).all())


QR_CASES = [
    pytest.param("ones", 17, 11, torch.float32, id="ones17x11-f32"),
    pytest.param("ones", 13, 13, torch.float64, id="ones13-f64"),
    pytest.param("dupcols", 12, 8, torch.float32, id="dupcols12x8-f32"),
    pytest.param("dupcols", 20, 16, torch.float64, id="dupcols20x16-f64"),
    pytest.param("rank1", 9, 7, torch.float32, id="rank1-9x7-f32"),
    pytest.param("rank1", 24, 24, torch.float64, id="rank1-24-f64"),
    pytest.param("block", 16, 16, torch.float32, id="block16-f32"),
]


@pytest.mark.parametrize("kind,m,n,dtype", QR_CASES)
def test_qr_of_rank_deficient_one_matrix(kind, m, n, dtype):
    a = _rank_deficient(kind, m, n, dtype, 1)[0]
    q, r = one.qr_plan(a.shape, dtype, "reduced")(a)
    _check_qr(a, q, r)


@pytest.mark.parametrize("kind,m,n,dtype", QR_CASES)
@pytest.mark.parametrize("b,lanes", [(3, False), (16, True)], ids=["per-matrix", "lanes"])
def test_qr_of_rank_deficient_batched(kind, m, n, dtype, b, lanes):
    a = _rank_deficient(kind, m, n, dtype, b)
    q, r = kernels.qr(a, "complete", lanes=lanes)
    _check_qr(a, q, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qr_of_tiny_trailing_columns(dtype):
    """Columns 1e-22 (float32) / 1e-160 (float64) below the first: their squares are subnormal
    in the matrix's scale."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 6, 3, generator=g, dtype=dtype)
    a[:, :, 1:] *= 1e-22 if dtype == torch.float32 else 1e-160
    for lanes in (False, True):
        q, r = kernels.qr(a.expand(16, 6, 3).contiguous(), "reduced", lanes=lanes)
        assert _orth(q) <= C * 6 * _eps(dtype)
        torch.testing.assert_close(r[0, :, 0].abs(), torch.linalg.qr(a)[1][0, :, 0].abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_qr_reference_of_tiny_trailing_columns(dtype):
    """The reference's reflectors as the kernels': |QᴴQ - I| was 1.9e-2 / 4.5e-5 / 7.3e-3."""
    a = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    a[:, :, 1:] *= 1e-22 if dtype != torch.float64 else 1e-160
    q, r = reference.qr_reference(a)
    assert _orth(q) <= C * 6 * _eps(dtype)
    assert _err(q @ r, a) <= C * 6 * _eps(dtype) * a.abs().amax().item()


# --- eigh ----------------------------------------------------------------------------------------


def _check_eigh(a: torch.Tensor, lam: torch.Tensor, q: torch.Tensor) -> None:
    n = a.shape[-1]
    eps = _eps(a.dtype)
    ref = torch.linalg.eigvalsh(a.to(torch.complex128 if a.is_complex() else torch.float64))
    scale = ref.abs().amax().item()
    assert _orth(q) <= C * n * eps
    assert _err(lam, ref) <= C * n * eps * scale
    assert _err(a @ q, q * lam.to(q.dtype)[..., None, :]) <= C * n * eps * scale


EIGH_CASES = [  # (kind, n, s): the first three failed on the old kernels (see the tests)
    pytest.param("rank1", 25, 0, id="rank1-25-0"),
    pytest.param("rank1", 20, 0, id="rank1-20-0"),
    pytest.param("rank1", 11, 2, id="rank1-11-2"),
    pytest.param("ones", 16, 0, id="ones16"),
    pytest.param("block", 17, 0, id="block17"),
]
EIGH_DTYPES = [torch.float32, torch.float64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("kind,n,s", EIGH_CASES)
@pytest.mark.parametrize("dtype", EIGH_DTYPES, ids=lambda d: str(d)[6:])
def test_eigh_tridiagonal_of_rank_deficient_one_matrix(kind, n, s, dtype):
    """The one-matrix tridiagonal QL worker (flag 3 of tp_eigh1, 2 of tp_ceigh1): |QᴴQ - I| was
    1.54 for a float32 v vᵀ (n = 11), 0.83 for a complex64 one (n = 25); here 0.04 (float32,
    rank1-25-0) and 0.7 (complex64, rank1-25-0)."""
    a = _hermitian(kind, n, dtype, 1, s)[0]
    lam, q = one.eigh_plan(a.shape, dtype, False, True, tridiagonal=True)(a)
    _check_eigh(a, lam, q)


@pytest.mark.parametrize("kind,n,s", [*EIGH_CASES, pytest.param("rank1r", 29, 2, id="rank1r-29-2")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_tridiagonal_of_rank_deficient_lanes(kind, n, s, dtype):
    """The lane kernel of eigh_tridiag (B = 16): |QᵀQ - I| was 1.4e-3 (float32, rank1-20-0)
    and 1.2e-7 (float64, rank1r-29-2) for integer v vᵀ."""
    a = _hermitian(kind, n, dtype, 16, s)
    lam, q, bad = eigh_tridiag.eigh(a, False, True)
    assert bad == 0
    _check_eigh(a, lam, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["float32", "complex64"])
def test_eigh_tridiagonal_reference_of_rank_one(dtype):
    """float32: |QᵀQ - I| was 2.2e-3 (the reference's reflectors as the kernel's)."""
    a = _hermitian("rank1", 11, dtype, 1, 2)
    ref = (
        reference.complex_eigh_tridiagonal_reference
        if dtype.is_complex
        else reference.eigh_tridiagonal_reference
    )
    lam, q = ref(a)
    _check_eigh(a, lam, q)
