"""The lane tridiagonalisation + QL eigh kernel (torchport.linalg.eigh_tridiag): against float64
LAPACK and the plain-torch reference (eigh_tridiagonal_reference), gauge-invariant (eigenvalues,
residual, orthogonality), over orders, batch sizes that leave partial lane groups, both
triangles, values only and special inputs; its routing (auto picks it, method="jacobi" does
not) and non-finite input."""

from __future__ import annotations

import math

import pytest
import torch

import torchport.linalg as tl
from tests.test_linalg import _sym_kind
from torchport import native
from torchport.linalg import eigh_block, eigh_tridiag, kernels, one

DTYPES = [torch.float32, torch.float64]
KINDS = ["random", "repeated", "diagonal", "zero", "identity", "graded"]
WIDTHS = (32, 64) if native.cpu_info().isa == "avx512" else (32,)


def _tol(dtype: torch.dtype, n: int) -> float:
    return 8 * max(n, 2) * torch.finfo(dtype).eps


def _check(a: torch.Tensor, lam: torch.Tensor, q: torch.Tensor) -> None:
    """Eigenvalues against LAPACK in float64 and the residual and orthogonality of q, each
    relative to ||A||_F (the accuracy a backward-stable eigh has)."""
    n, dtype = a.shape[-1], a.dtype
    a64 = a.double()
    nrm = a64.flatten(1).norm(dim=-1).clamp_min(1e-300)[:, None]
    tol = _tol(dtype, n)
    assert bool((lam[:, :-1] <= lam[:, 1:]).all()), "eigenvalues must be ascending"
    assert float(((lam.double() - torch.linalg.eigvalsh(a64)).abs() / nrm).max()) <= tol
    q64 = q.double()
    res = (a64 @ q64 - q64 * lam.double()[:, None, :]).flatten(1).norm(dim=-1) / nrm[:, 0]
    assert float(res.max()) <= tol
    eye = torch.eye(n, dtype=torch.float64)
    assert float((q64.mT @ q64 - eye).abs().max()) <= tol


@pytest.mark.parametrize("vbytes", WIDTHS, ids=lambda w: f"v{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 16, 24, 32])
@pytest.mark.parametrize("b", [1, 3, 4, 5, 17])
def test_kernel_vs_lapack_and_reference(b, n, dtype, vbytes):
    """Random input, both triangles (the other one poisoned), values only equal to the values of
    the vectors run, and the plain-torch reference."""
    a = _sym_kind("random", b, n, dtype, seed=17 * n + b)
    for upper in (False, True):
        junk = torch.triu(torch.full((n, n), 7.0, dtype=dtype), 1)
        poisoned = (a + (junk.mT if upper else junk)).contiguous()
        lam, q, bad = eigh_tridiag.eigh(poisoned, upper, True, vbytes)
        assert bad == 0
        _check(a, lam, q)
        vals, empty, bad = eigh_tridiag.eigh(poisoned, upper, False, vbytes)
        assert bad == 0 and empty.numel() == 0
        assert torch.equal(vals, lam)
    lr, _ = tl.eigh_tridiagonal_reference(a)
    nrm = a.double().flatten(1).norm(dim=-1)[:, None].clamp_min(1e-300)
    assert float(((lam.double() - lr.double()).abs() / nrm).max()) <= _tol(dtype, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 16, 24, 32])
def test_kernel_special_inputs(kind, n, dtype):
    """Repeated, diagonal, zero, identity and graded matrices, mixed with random ones in one
    lane group (a lane that converges at once beside lanes that iterate)."""
    a = torch.cat(
        [_sym_kind(kind, 3, n, dtype, seed=n), _sym_kind("random", 2, n, dtype, seed=n + 1)]
    )
    lam, q, bad = eigh_tridiag.eigh(a.contiguous(), False, True)
    assert bad == 0
    _check(a, lam, q)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_inputs(dtype):
    """Huge and tiny entries: the per-lane power-of-two scaling makes the results of A 2^k
    exactly those of A times 2^k (finite where the squares of the entries would not be)."""
    a = _sym_kind("random", 5, 12, dtype, seed=5)
    fi = torch.finfo(dtype)
    big = 2.0 ** (math.frexp(fi.max)[1] // 2 + 4)
    small = 2.0 ** (math.frexp(fi.tiny)[1] // 2 - 4)
    x = torch.cat([a * big, a * small, a]).contiguous()
    lam, q, bad = eigh_tridiag.eigh(x, False, True)
    assert bad == 0
    for k, f in enumerate((big, small)):
        assert torch.equal(lam[5 * k : 5 * k + 5], lam[10:] * f)
        assert torch.equal(q[5 * k : 5 * k + 5], q[10:])
    _check(a, lam[10:], q[10:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_input_is_reported(dtype):
    """1 + the first batch index with a NaN/inf entry, as the Jacobi lane kernels report it."""
    a = _sym_kind("random", 11, 8, dtype, seed=2)
    a[6, 3, 1] = float("nan")
    a[9, 0, 0] = float("inf")
    assert eigh_tridiag.eigh(a, False, True)[2] == 7
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 6"):
        tl.eigh(a, method="jacobi")


def test_empty_batch_and_order():
    lam, q, bad = eigh_tridiag.eigh(torch.zeros(0, 5, 5, dtype=torch.float64), False, True)
    assert lam.shape == (0, 5) and q.shape == (0, 5, 5) and bad == 0


def test_routing(monkeypatch):
    """kernels.eigh runs this kernel for lane batches from EIGH_TRIDIAG_FROM unless ``jacobi``;
    torchport.linalg.eigh(method="jacobi") keeps running Jacobi."""
    n = max(kernels.EIGH_TRIDIAG_FROM, 12)
    a = _sym_kind("random", 16, n, torch.float64, seed=1)
    calls: list[str] = []
    real_t, real_b = eigh_tridiag.eigh, eigh_block.eigh
    monkeypatch.setattr(eigh_tridiag, "eigh", lambda *x, **k: calls.append("ql") or real_t(*x, **k))
    monkeypatch.setattr(eigh_block, "eigh", lambda *x, **k: calls.append("jac") or real_b(*x, **k))
    kernels.eigh(a, False, True)
    kernels.eigh(a, False, True, jacobi=True)
    kernels.eigh(a, False, True, 4, lanes=True)
    assert calls == ["ql", "jac", "ql"]
    calls.clear()
    lam, q = tl.eigh(a, method="jacobi")
    tl.eigvalsh(a, method="jacobi")
    assert calls == ["jac", "jac"]
    _check(a, lam, q)


def test_eigh_op_schema_takes_jacobi():
    from torchport.linalg import ops

    a = _sym_kind("random", 2, 9, torch.float64, seed=4)
    for jac in (False, True):
        torch.library.opcheck(
            ops._eigh_op, (a, False, True, jac), test_utils=("test_schema", "test_faketensor")
        )


def test_sweep_cap_stops_with_orthogonal_vectors():
    """At the sweep cap (here 1 n sweeps) the kernel stops without an error, as the Jacobi
    kernels do at theirs: the vectors are still orthogonal (products of rotations), the
    eigenvalues finite; an uncapped build converges."""
    from torchport.native import cpu_info

    n = 24
    a = _sym_kind("random", 9, n, torch.float64, seed=8)
    lam = a.new_empty((9, n))
    q = a.new_empty((9, n, n))
    capped = eigh_tridiag.library(torch.float64, cpu_info().isa, max_iters=1)
    assert capped.call_unchecked(a.data_ptr(), lam.data_ptr(), q.data_ptr(), 9, n, 0, 1, 1) == 0
    assert bool(torch.isfinite(lam).all())
    eye = torch.eye(n, dtype=torch.float64)
    assert float((q.mT @ q - eye).abs().max()) <= _tol(torch.float64, n)
    res = (a @ q - q * lam[:, None, :]).abs().max()
    assert float(res) > 1e-6  # the cap was reached before convergence
    lam2, q2, _ = eigh_tridiag.eigh(a, False, True)
    _check(a, lam2, q2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_avx512_builds_compile(dtype):
    """The zmm (64-byte) and ymm lane builds for avx512 compile and load (they run only on an
    avx512 machine)."""
    for vbytes in (32, 64):
        assert eigh_tridiag.library(dtype, "avx512", vbytes=vbytes) is not None


# max |a| below the smallest normal number: 2^-ilogb(max|a|) alone overflows (review: the lane
# kernel's unscaled NaNs then left sort slots unset, a segfault; the one-matrix QL gave NaN)
_TINY = {torch.float32: (3e-39, 1e-4), torch.float64: (1e-310, 1e-11)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["lanes", "jacobi_lanes", "one_matrix", "one_matrix_jacobi"])
def test_subnormal_scale_input(path, dtype):
    tiny, rtol = _TINY[dtype]
    n, b = 8, 9
    base = _sym_kind("random", b, n, torch.float64, seed=5)
    base = base / base.abs().amax(dim=(-2, -1), keepdim=True)
    a = (base * tiny).to(dtype)
    assert bool((a.abs().amax(dim=(-2, -1)) < torch.finfo(dtype).tiny).all())
    for upper in (False, True):
        for wantv in (True, False):
            if path.startswith("one_matrix"):
                run = one.eigh_plan(a.shape[1:], dtype, upper, wantv, path == "one_matrix")
                outs = [run(a[i]) for i in range(b)]
                lam = torch.stack([o.eigenvalues if wantv else o for o in outs])
                q = torch.stack([o.eigenvectors for o in outs]) if wantv else None
            else:
                lam, q, bad = kernels.eigh(a, upper, wantv, jacobi=path == "jacobi_lanes")
                assert bad == 0
            assert bool(torch.isfinite(lam).all())
            ref = torch.linalg.eigvalsh(a.double())
            scale = a.double().abs().amax(dim=(-2, -1), keepdim=True)
            assert float(((lam.double() - ref) / scale[:, 0]).abs().max()) <= rtol
            if wantv:
                assert q is not None
                q64 = q.double()
                eye = torch.eye(n, dtype=torch.float64)
                assert float((q64.mT @ q64 - eye).abs().max()) <= _tol(dtype, n)
                up = a.double() / scale
                res = up @ q64 - q64 * (lam.double() / scale[:, 0])[:, None, :]
                assert float(res.abs().max()) <= rtol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [8, 24])
def test_subnormal_scale_input_jacobi_eigh(n, dtype):
    """The same for the Jacobi lane kernels' scaling (block-ordered eigh from n = 24)."""
    tiny, rtol = _TINY[dtype]
    base = _sym_kind("random", 9, n, torch.float64, seed=7)
    base = base / base.abs().amax(dim=(-2, -1), keepdim=True)
    a = (base * tiny).to(dtype)
    scale = a.double().abs().amax(dim=(-2, -1))[:, None]
    lam = tl.eigvalsh(a, method="jacobi")
    ref = torch.linalg.eigvalsh(a.double())
    assert bool(torch.isfinite(lam).all())
    assert float(((lam.double() - ref) / scale).abs().max()) <= rtol
