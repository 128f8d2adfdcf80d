"""The block-ordered lane eigh kernel (torchport.linalg.eigh_block): against float64 LAPACK
(gauge-invariant), the plain-torch reference in the same pair order, the fused lane kernel, and
through the public eigh routes (jacobi, auto, autograd)."""

from __future__ import annotations

import pytest
import torch

import torchport.linalg as tl
from tests.test_linalg import sym
from torchport import native
from torchport.linalg import eigh_block, kernels

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
KINDS = ["random", "repeated", "clustered", "diagonal", "zero", "ill_conditioned"]
# lane vector widths this machine builds (ymm; zmm on avx512)
WIDTHS = (32, 64) if native.cpu_info().isa == "avx512" else (32,)


@pytest.fixture(params=WIDTHS, ids=lambda w: f"v{w}")
def vbytes(request):
    return request.param


def _check(a64: torch.Tensor, lam: torch.Tensor, q: torch.Tensor, tol: float) -> None:
    n = a64.shape[-1]
    scale = max(1.0, float(a64.abs().max()))
    assert bool((lam[:, :-1] <= lam[:, 1:]).all()), "eigenvalues must be ascending"
    assert float((lam.double() - torch.linalg.eigvalsh(a64)).abs().max()) <= tol * scale * n
    resid = a64 @ q.double() - q.double() * lam.double().unsqueeze(-2)
    assert float(resid.abs().max()) <= tol * scale * n
    eye = torch.eye(n, dtype=torch.float64)
    assert float((q.double().mT @ q.double() - eye).abs().max()) <= tol * n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 32])
def test_block_kernel_vs_lapack(dtype, n, vbytes):
    """Every kind of input, both triangles (the other one poisoned), a batch that leaves a
    partial group of lanes; eigenvalues-only agree with the vectors run."""
    kinds = KINDS if n in (5, 16, 32) else ["random", "repeated"]
    a64 = torch.cat([sym(k, 3, n, seed=n + i) for i, k in enumerate(kinds)])
    for upper in (False, True):
        junk = torch.triu(torch.full((n, n), 7.0, dtype=torch.float64), 1)
        a = (a64 + (junk.mT if upper else junk)).to(dtype).contiguous()
        lam, q, bad = eigh_block.eigh(a, upper, True, vbytes)
        assert bad == 0
        _check(a64, lam, q, TOL[dtype])
        vals, empty, bad = eigh_block.eigh(a, upper, False, vbytes)
        assert bad == 0 and empty.numel() == 0
        assert torch.allclose(vals, lam, rtol=0, atol=TOL[dtype] * max(1.0, float(a64.abs().max())))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [6, 13])
def test_block_kernel_vs_reference(dtype, n):
    """The plain-torch reference in the same pair order (order=3) and the fused lane kernel."""
    a64 = torch.cat([sym("random", 9, n, seed=n), sym("repeated", 4, n, seed=1)])
    a = a64.to(dtype).contiguous()
    lam, q, bad = kernels.eigh(a, False, True, 3, lanes=True)
    lr, qr_ = tl.eigh_reference(a, False, order=3)
    lf, _, _ = kernels.eigh(a, False, True, 2, lanes=True)
    tol = TOL[dtype] * 10 * n
    assert bad == 0
    assert float((lam - lr).abs().max()) <= tol * float(a.abs().max())
    assert float((lam - lf).abs().max()) <= tol * float(a.abs().max())
    if dtype == torch.float64:  # same rotations (scaled form in the kernel): same vectors
        assert float((q[:9] - qr_[:9]).abs().max()) <= 1e-8


def test_block_pairs_cover_every_pair_once():
    from torchport.linalg.reference import pairs_for

    for q in (1, 2, 3, 4, 5, 8, 13, 16, 32):
        pairs = pairs_for(q, 3)
        assert sorted(pairs) == [(j, k) for j in range(q) for k in range(j + 1, q)]


def test_xor_rounds_are_a_permutation_in_closed_groups():
    """The XOR tournament's round order: every s in 1..m-1 once; for m = 16 five triples
    (a, b, a ^ b), each closing groups of four blocks (one pass over V for three rounds)."""
    from torchport.linalg.reference import _xor_rounds

    for m in (4, 8, 16, 32, 64, 128):
        assert sorted(_xor_rounds(m)) == list(range(1, m))
    xs = _xor_rounds(16)
    assert all(xs[i] ^ xs[i + 1] == xs[i + 2] for i in range(0, 15, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_kernel_scaling_and_errors(dtype, vbytes):
    """Lanes of very different magnitudes in one group (per-lane power-of-two scaling), empty
    batch and n = 0, and 1 + the first batch index with a non-finite entry."""
    big = 1e150 if dtype == torch.float64 else 1e18
    a64 = sym("random", 9, 32, seed=3)
    for i, f in enumerate((big, 1 / big, 1.0, big, 1 / big, 3.0, 1e-3, 7.0, big)):
        a64[i] *= f
    a = a64.to(dtype).contiguous()
    lam, q, bad = eigh_block.eigh(a, False, True, vbytes)
    ref = torch.linalg.eigvalsh(a.double())
    tol = TOL[dtype] * 10 * 32
    assert bad == 0
    for i in range(9):
        scale = float(a[i].double().abs().max())
        assert float((lam[i].double() - ref[i]).abs().max()) <= tol * scale
        resid = a[i].double() @ q[i].double() - q[i].double() * lam[i].double()
        assert float(resid.abs().max()) <= tol * scale
    for shape in ((0, 5, 5), (3, 0, 0)):
        lam, q, bad = eigh_block.eigh(torch.zeros(shape, dtype=dtype), False, True, vbytes)
        assert bad == 0 and lam.shape == shape[:2] and q.shape == shape
    a = a.clone()
    a[6, 3, 1] = float("inf")
    assert eigh_block.eigh(a, False, True, vbytes)[2] == 7
    assert eigh_block.eigh(a, True, False, vbytes)[2] == 7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_eigh_routes_to_block_kernel(dtype, monkeypatch):
    """method="jacobi" at n >= EIGH_BLOCK_FROM runs the block kernel; the results, the error for
    non-finite input and autograd (torch.linalg's gradient) go through it."""
    n = kernels.EIGH_BLOCK_FROM
    calls = []
    real = eigh_block.eigh
    monkeypatch.setattr(eigh_block, "eigh", lambda *a: calls.append(a[0].shape) or real(*a))
    a64 = sym("random", 16, n, seed=5)
    lam, q = tl.eigh(a64.to(dtype), method="jacobi")
    assert calls and calls[-1] == (16, n, n)
    _check(a64, lam, q, TOL[dtype])
    bad = a64.to(dtype).clone()
    bad[11, 2, 2] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
        tl.eigh(bad, method="jacobi")
    if dtype == torch.float64:
        x = a64.clone().requires_grad_()
        lam, q = tl.eigh(x, method="jacobi")
        (lam.sum() + (q.abs() ** 2).sum()).backward()
        y = a64.clone().requires_grad_()
        lr, qr_ = torch.linalg.eigh(y)
        (lr.sum() + (qr_.abs() ** 2).sum()).backward()
        assert torch.allclose(x.grad, y.grad, atol=1e-8)
