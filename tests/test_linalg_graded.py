"""Graded matrices through every native SVD route: singular values to high relative accuracy.

The kernels scale a matrix by one power of two and form squared norms in that scale, so a column
far below the largest one underflowed (``svdvals(diag(1e170, 1))`` gave ``[1e170, 0]``); such
input now runs the per-vector scaled sweeps (``svd_graded`` in :mod:`torchport.linalg.kernels`,
the ``ve`` path of :mod:`torchport.linalg.complex_jacobi`). The matrices here have known singular
values: a signed, permuted graded diagonal, Q·D (orthonormal columns times a graded diagonal) and
D·Qᴴ for wide matrices (one-sided Jacobi's vectors are then rows), D spanning 1e-150..1e150
(float64) or 1e-30..1e30 (float32), where one-sided Jacobi is relatively accurate
(Demmel-Veselić). ``torch.linalg.svdvals`` itself loses the small values of most Q·D cases here
(relative errors up to 1e186 at n = 33, float64, measured), so the reference is the exact values.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchport.linalg as tl
from torchport.linalg import complex_jacobi, kernels, one

SPAN = {torch.float32: 30, torch.float64: 150, torch.complex64: 30, torch.complex128: 150}
DTYPES = list(SPAN)
SIZES = [2, 8, 33]


def graded(
    kind: str, n: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, its singular values descending, float64) for ``kind`` diag / col / row; A is n x n
    (diag), (n + 3) x n (col) or n x (n + 3) (row)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    e = torch.linspace(-SPAN[dtype], SPAN[dtype], n, dtype=torch.float64)
    d = 10.0 ** e[torch.randperm(n, generator=g)]
    if kind == "diag":
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        a = torch.diag(d * sign)[torch.randperm(n, generator=g)]
    else:
        q, _ = torch.linalg.qr(torch.randn(n + 3, n, dtype=wide, generator=g))
        a = q * d if kind == "col" else (q * d).mH
    return a.to(dtype), d.sort(descending=True).values


def rel_err(s: torch.Tensor, truth: torch.Tensor) -> float:
    return float(((s.double() - truth).abs() / truth).max())


def tol(dtype: torch.dtype, n: int) -> float:
    return 4 * n * torch.finfo(dtype).eps


def routes(dtype: torch.dtype, m: int, n: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """svdvals of a batch of 16 copies of one matrix (the first result) on each native route."""
    b = 16

    def batched(**kw: int | bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(a: torch.Tensor) -> torch.Tensor:
            x = a.expand(b, *a.shape).contiguous()
            if dtype.is_complex:
                return complex_jacobi.svd(x, False, False)[1][0]
            return kernels.svd(x, False, False, **kw)[1][0]

        return run

    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "public": lambda a: tl.svdvals(a, method="jacobi"),
        "public_batch": lambda a: tl.svdvals(a.expand(b, *a.shape), method="jacobi")[3],
    }
    if not dtype.is_complex:
        for order in (0, 1):
            out[f"thread_o{order}"] = batched(order=order, lanes=False)
            out[f"lanes_o{order}"] = batched(order=order, lanes=True)
    if one.fits(m, n):
        out["one"] = one.svd_plan(torch.Size((m, n)), dtype, False, False)
    return out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["diag", "col", "row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graded_singular_values_relative_accuracy(dtype, kind, n):
    a, truth = graded(kind, n, dtype)
    for name, run in routes(dtype, *a.shape).items():
        err = rel_err(run(a), truth)
        assert err <= tol(dtype, n), (name, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_diag_1e170_keeps_its_small_value(dtype):
    big = 1e170 if dtype in (torch.float64, torch.complex128) else 1e30
    a = torch.diag(torch.tensor([big, 1.0], dtype=torch.float64)).to(dtype)
    want = torch.tensor([big, 1.0], dtype=torch.float64)
    assert rel_err(torch.linalg.svdvals(a), want) <= tol(dtype, 2)  # torch.linalg's answer
    for name, run in routes(dtype, 2, 2).items():
        assert rel_err(run(a), want) <= tol(dtype, 2), name


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["col", "row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graded_singular_vectors(dtype, kind, n, lanes):
    """U, Vh orthonormal, A V = U S column by column to the rounding of the largest column, and
    the batch's graded and ordinary matrices solved side by side (lane kernels)."""
    a, truth = graded(kind, n, dtype)
    plain = torch.randn(a.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    x = torch.stack([a, plain] * 8)
    if dtype.is_complex:
        u, s, vh, bad = complex_jacobi.svd(x, False, True)
    else:
        u, s, vh, bad = kernels.svd(x, False, True, lanes=lanes)
    assert bad == 0
    eps = torch.finfo(dtype).eps
    for i in (0, 1):
        ui, si, vi = u[i].to(torch.complex128), s[i].double(), vh[i].to(torch.complex128).mH
        ai = x[i].to(torch.complex128)
        k = si.shape[0]
        assert float((ui.mH @ ui - torch.eye(k)).abs().max()) <= 8 * n * eps
        assert float((vi.mH @ vi - torch.eye(k)).abs().max()) <= 8 * n * eps
        resid = (ai @ vi - ui * si).abs().max()
        assert float(resid) <= 8 * n * eps * float(si[0])
    assert rel_err(s[0], truth) <= tol(dtype, n)
    ref = torch.linalg.svdvals(plain.to(torch.complex128 if dtype.is_complex else torch.float64))
    assert rel_err(s[1], ref) <= 8 * n * eps * float(ref[0] / ref.min())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graded_detection_leaves_non_finite_input_to_lapack(dtype):
    """Non-finite input is still reported before any grading test (torch.linalg's answer)."""
    a = torch.diag(torch.tensor([1e30, 1.0], dtype=torch.float64)).to(dtype)
    a[1, 0] = float("inf")
    got = tl.svdvals(a, method="jacobi")
    want = torch.linalg.svdvals(a)
    assert torch.equal(got.isnan(), want.isnan())
