"""Complex64/complex128 QR and Cholesky (torchport.linalg.complex_factor): accuracy against
complex128 LAPACK, R's and info's conventions, native vs the plain-torch references, errors,
routing (method="jacobi" / "auto") and autograd (gradcheck, torch.linalg's gradients)."""

from __future__ import annotations

import math

import pytest
import torch

import torchport.linalg as tl
from tests import linalg_inputs
from tests.linalg_inputs import basis
from torchport.linalg import complex_factor, kernels, one
from torchport.linalg.reference import cholesky_reference, qr_reference

CDTYPES = [torch.complex64, torch.complex128]
TOL = {torch.complex64: 1e-4, torch.complex128: 1e-10}
QR_SHAPES = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (8, 8), (16, 16), (6, 3), (3, 6), (1, 4),
             (4, 1), (17, 9), (9, 17)]  # fmt: skip


def cmake(kind: str, b: int, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """Complex128 test matrices (:func:`linalg_inputs.make`)."""
    return linalg_inputs.make(kind, b, m, n, seed, torch.complex128)


def hpd(b: int, n: int, seed: int = 0, cond: float | None = None) -> torch.Tensor:
    """Hermitian positive-definite complex128 matrices (eigenvalues spread over ``cond``)."""
    g = torch.Generator().manual_seed(seed)
    if cond is None:
        x = torch.randn(b, n, n, generator=g, dtype=torch.complex128)
        return x @ x.mH + n * torch.eye(n, dtype=torch.complex128)
    u = basis(b, n, g, torch.complex128)
    lam = torch.logspace(0, -float(torch.log10(torch.tensor(cond))), n, dtype=torch.float64)
    return (u * lam.to(u.dtype)) @ u.mH


def eye_err(x: torch.Tensor) -> float:
    """max |XᴴX − I| for a batch of matrices with orthonormal columns."""
    if x.numel() == 0:
        return 0.0
    x = x.to(torch.complex128)
    return float((x.mH @ x - torch.eye(x.shape[-1], dtype=x.dtype)).abs().max())


def rel_res(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / max(‖b‖, 1), entrywise max norms, in complex128."""
    if b.numel() == 0:
        return 0.0
    a, b = a.to(torch.complex128), b.to(torch.complex128)
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


# --- QR -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
@pytest.mark.parametrize("m,n", QR_SHAPES, ids=str)
def test_qr_vs_lapack(dtype, mode, m, n):
    for kind in ("random", "rank_deficient", "ill_conditioned", "diagonal", "zero"):
        a64 = cmake(kind, 3, m, n, seed=m + 7 * n)
        a = a64.to(dtype)
        q, r = tl.qr(a, mode=mode, method="jacobi")
        qt, rt = torch.linalg.qr(a, mode=mode)
        assert q.shape == qt.shape and r.shape == rt.shape
        assert q.dtype == r.dtype == dtype
        assert torch.equal(r, r.triu())
        assert float(r.diagonal(0, -2, -1).imag.abs().max()) == 0.0  # real, as zgeqrf's
        tol = TOL[dtype]
        if mode != "r":
            assert eye_err(q) <= tol
            assert rel_res(q.to(torch.complex128) @ r.to(torch.complex128), a64) <= tol
        if kind == "random":  # the same reflectors as LAPACK: R itself matches
            assert rel_res(r, torch.linalg.qr(a64, mode=mode).R) <= tol * 10


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("batch", [(0,), (2, 0), (2, 3), (1,), ()], ids=str)
def test_qr_batch_shapes_and_empty(dtype, batch):
    for m, n in ((3, 2), (2, 3), (0, 3), (3, 0)):
        a = torch.randn((*batch, m, n), dtype=dtype)
        for mode in ("reduced", "complete", "r"):
            q, r = tl.qr(a, mode=mode, method="jacobi")
            qt, rt = torch.linalg.qr(a, mode=mode)
            assert q.shape == qt.shape and r.shape == rt.shape
            assert torch.allclose(r, rt, atol=1e-5) and torch.allclose(q, qt, atol=1e-5)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_qr_non_real_last_pivot(dtype):
    """A column whose tail is zero still gets a reflector when its pivot is not real (zlarfg):
    R's diagonal is real, the 1 x 1 and last-row cases included."""
    neg0 = complex(-0.0, 2.0)
    for a in (
        torch.tensor([[[2 - 3j]]], dtype=dtype),
        torch.tensor([[[1j, 2.0], [0.0, -1 + 1j]]], dtype=dtype),
        # a pivot whose real part is -0.0 (LAPACK's sign counts it positive, as +0)
        torch.tensor([[[neg0]]], dtype=dtype),
        1j * torch.tensor([[[-2.0, 1.0], [0.5, 3.0]]], dtype=dtype),
        torch.tensor([[[complex(-0.0, 0.0)], [1.0]]], dtype=dtype),
    ):
        assert a.is_complex()
        q, r = tl.qr(a, method="jacobi")
        qt, rt = torch.linalg.qr(a)
        assert torch.allclose(r, rt, atol=1e-6) and torch.allclose(q, qt, atol=1e-6)


@pytest.mark.parametrize("dtype,big", [(torch.complex64, 1e25), (torch.complex128, 1e170)], ids=str)
def test_qr_widely_scaled_columns_stay_finite(dtype, big):
    """A column far below the matrix's largest entry gave NaN in Q and R: after the matrix-wide
    scaling its squares underflowed to 0, and a non-real pivot then got beta = 0 and 0/0 in tau
    ([[1e25, 0], [0, 1j]] complex64: Q[1, 1] NaN, R[1, 1] 0 instead of LAPACK's -1). Now: Q, R
    finite, Qᴴ Q = I, Q R = A, R's diagonal real, and as LAPACK's where the convention fixes it;
    on the batched kernel and the one-matrix launcher alike."""
    cases = [
        torch.tensor([[big, 0], [0, 1j]], dtype=dtype),
        torch.tensor([[big, 0, 0], [0, 1j, 1], [0, 1, 1]], dtype=dtype),
    ]
    x = torch.randn(4, 4, dtype=dtype, generator=torch.Generator().manual_seed(0))
    x[0] *= big
    cases.append(x)
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    for a in cases:
        for mode in ("reduced", "complete"):
            for q, r in (
                tl.qr(a, mode, method="jacobi"),  # one matrix: the batched kernel
                tl.qr(a.expand(3, *a.shape), mode, method="jacobi"),
                one.qr_plan(a.shape, dtype, mode)(a),
            ):
                assert torch.isfinite(q).all() and torch.isfinite(r).all(), (a, q, r)
                eye = torch.eye(q.shape[-1], dtype=dtype)
                assert (q.mH @ q - eye).abs().max() < tol
                rel = ((q @ r - a).abs().amax((-2, -1)) / a.abs().max()).max()
                assert rel < tol
                assert (r.diagonal(0, -2, -1).imag == 0).all()
    q, r = tl.qr(cases[0], method="jacobi")
    qt, rt = torch.linalg.qr(cases[0])
    assert torch.allclose(r, rt, rtol=1e-6) and torch.allclose(q, qt, atol=1e-6)


# --- Cholesky -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 33])
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_vs_lapack(dtype, n, upper):
    for cond in (None, 1e3 if dtype == torch.complex64 else 1e6):
        a64 = hpd(4, n, seed=n, cond=cond)
        a = a64.to(dtype)
        # only one triangle is read and only the real part of the diagonal
        junk = a.clone()
        other = junk.tril(-1) if upper else junk.triu(1)
        other.add_(torch.full_like(other, 7 - 5j) * (other != 0))
        junk = (junk.triu() if upper else junk.tril()) + other
        junk.diagonal(0, -2, -1).imag.fill_(3.0)
        fac = tl.cholesky(junk, upper=upper, method="jacobi")
        assert fac.dtype == dtype
        ref = torch.linalg.cholesky(a64, upper=upper)
        assert rel_res(fac, ref) <= TOL[dtype] * (1 if cond is None else 1e3)
        assert torch.equal(fac, fac.triu() if upper else fac.tril())
        f = fac.to(torch.complex128)
        rec = f.mH @ f if upper else f @ f.mH
        assert rel_res(rec, a64) <= TOL[dtype]
        assert float(fac.diagonal(0, -2, -1).imag.abs().max()) == 0.0
        assert bool((fac.diagonal(0, -2, -1).real > 0).all())
        fac2, info = tl.cholesky_ex(junk, upper=upper, method="jacobi")
        assert torch.equal(fac2, fac) and info.dtype == torch.int32 and not bool(info.any())


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", [4, 9])  # the row-wise (n <= 4) and right-looking workers
def test_cholesky_info_names_failing_minor(dtype, n):
    a = hpd(5, n).to(dtype)
    a[1, 2, 2] = -100.0 * n  # leading minor of order 3 fails
    a[3, 0, 0] = complex(float("nan"), 0.0)  # NaN is not positive-definite: order 1
    a[4, 3, 1] = complex(0.0, float("inf"))  # non-finite below the diagonal: order 4
    for upper in (False, True):
        x = a.mH.contiguous() if upper else a
        fac, info = tl.cholesky_ex(x, upper=upper, method="jacobi")
        assert (
            info.tolist()
            == [0, 3, 0, 1, 4]
            == torch.linalg.cholesky_ex(x, upper=upper).info.tolist()
        )
        assert not bool(fac[1].any()) and not bool(fac[4].any())
        with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*minor of order 3"):
            tl.cholesky(x, upper=upper, method="jacobi")
        with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*minor of order 3"):
            tl.cholesky_ex(x, upper=upper, check_errors=True, method="jacobi")
    with pytest.raises(
        torch.linalg.LinAlgError, match=r"^torchport.linalg.cholesky: The fact.*order 1"
    ):
        tl.cholesky(-torch.eye(2, dtype=dtype), method="jacobi")


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("batch", [(0,), (2, 0), (2, 3), ()], ids=str)
def test_cholesky_batch_shapes_and_empty(dtype, batch):
    for n in (0, 1, 3):
        a = hpd(math.prod(batch), n).reshape((*batch, n, n)).to(dtype)
        fac, info = tl.cholesky_ex(a, method="jacobi")
        ft, it = torch.linalg.cholesky_ex(a)
        assert fac.shape == ft.shape and info.shape == it.shape and info.dtype == it.dtype
        assert torch.allclose(fac, ft, atol=1e-5)


# --- native vs the plain-torch references (same algorithms) ---------------------------------------


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(1, 1), (2, 2), (3, 3), (5, 5), (6, 3), (3, 6), (7, 6)], ids=str)
def test_native_matches_reference(dtype, m, n):
    tol = 1e-5 if dtype == torch.complex64 else 1e-12
    a = cmake("random", 4, m, n, seed=3).to(dtype)
    a[0, :, 0] = 0
    a[0, 0, 0] = 2j  # a zero tail under a non-real pivot
    for mode in ("reduced", "complete", "r"):
        q, r = complex_factor.qr(a, mode)
        qr_, rr = qr_reference(a, mode)
        assert rel_res(r, rr) <= tol and (mode == "r" or rel_res(q, qr_) <= tol)
    if m == n:
        h = hpd(4, n, seed=4).to(dtype)
        h[2, n - 1, n - 1] = -1.0
        for upper in (False, True):
            fac, info, bad = complex_factor.cholesky(h.contiguous(), upper)
            fr, ir = cholesky_reference(h, upper)
            assert torch.equal(info, ir) and bad == 3
            assert rel_res(fac, fr) <= tol


# --- routing --------------------------------------------------------------------------------------


def test_complex_routing():
    for dtype in CDTYPES:
        assert not kernels.runs_lanes("qr", 10_000, 4, 4, dtype)
        assert not kernels.runs_lanes("cholesky", 10_000, 4, 4, dtype)
    a = torch.randn(4, 3, 3, dtype=torch.complex64)
    assert tl._route("qr", a, "jacobi", ("reduced",)) == "native"
    assert tl._route("cholesky", a, "jacobi", (False,)) == "native"
    assert tl._route("qr", a, "lapack", ("reduced",)) == "lapack"
    # meta: torch.linalg's meta kernels (shapes only; the references would read values)
    meta = torch.empty(4, 3, 3, dtype=torch.complex64, device="meta")
    assert tl._route("qr", meta, "jacobi", ("reduced",)) == "lapack"
    assert tl._route("cholesky", meta, "jacobi", (False,)) == "lapack"
    for op in ("svd", "eigh"):
        assert tl._route(op, a, "jacobi", (False, True)) == "native"


def test_complex_auto_tunes_and_is_correct(fresh_cache, monkeypatch):
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "2")
    tl._drop_routes()
    try:
        for dtype in CDTYPES:
            for b in (1, 40):  # one matrix: never the real-only one-matrix launcher
                a = torch.randn(b, 5, 4, dtype=dtype)
                q, r = tl.qr(a)
                assert torch.allclose(q @ r, a, atol=1e-5)
                h = hpd(b, 4).to(dtype)
                fac = tl.cholesky(h)
                assert torch.allclose(fac, torch.linalg.cholesky(h), atol=1e-5)
                fac2, info = tl.cholesky_ex(h, upper=True)
                assert not bool(info.any())
                assert torch.allclose(fac2, torch.linalg.cholesky(h, upper=True), atol=1e-5)
            with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 0\).*order 1"):
                tl.cholesky(-hpd(40, 4).to(dtype))
    finally:
        tl._drop_routes()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex_bad_inputs():
    with pytest.raises(tl.LinalgInputError, match="mode must be one of"):
        tl.qr(torch.randn(2, 2, dtype=torch.complex64), mode="full", method="jacobi")
    with pytest.raises(tl.LinalgInputError, match="square matrices, got 2 by 3"):
        tl.cholesky(torch.randn(2, 3, dtype=torch.complex128), method="jacobi")
    with pytest.raises(tl.LinalgInputError, match=r"complex64 or complex128, got torch\.complex32"):
        tl.qr(torch.zeros(2, 2, dtype=torch.complex32), method="jacobi")
    with pytest.raises(tl.LinalgInputError, match="method must be one of"):
        tl.cholesky(torch.eye(2, dtype=torch.complex64), method="magma")


# --- autograd -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,n,mode", [(5, 3, "reduced"), (3, 3, "complete"), (3, 5, "reduced"), (3, 5, "complete")]
)
def test_qr_gradcheck_complex(m, n, mode):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, m, n, generator=g, dtype=torch.complex128).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: tuple(tl.qr(a, mode=mode, method="jacobi")), (x,))

    def loss(q, r):
        return (
            q.sin().abs().sum()
            + (r * r.conj()).real.cos().sum()
            + (q.real * r[..., :1, :1].imag).sum()
        )

    (g1,) = torch.autograd.grad(loss(*tl.qr(x, mode=mode, method="jacobi")), x)
    (g2,) = torch.autograd.grad(loss(*torch.linalg.qr(x, mode=mode)), x)
    assert torch.allclose(g1, g2, atol=1e-9)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_gradcheck_complex(upper):
    x = hpd(2, 4, seed=6).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a: tl.cholesky(0.5 * (a + a.mH), upper=upper, method="jacobi"), (x,)
    )

    def loss(fac):
        return fac.sin().abs().sum() + fac.imag.sum()

    (g1,) = torch.autograd.grad(loss(tl.cholesky(x, upper=upper, method="jacobi")), x)
    (g2,) = torch.autograd.grad(loss(torch.linalg.cholesky(x, upper=upper)), x)
    assert torch.allclose(g1, g2, atol=1e-10)
    (g3,) = torch.autograd.grad(loss(tl.cholesky_ex(x, upper=upper, method="jacobi")[0]), x)
    assert torch.allclose(g3, g2, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_launcher_tensor_dtypes_follow_the_c_signatures(dtype):
    """The checked call of each complex entry point takes the C types: the Cholesky factor and
    the QR factors complex, the eigenvalues and singular values real, ``info`` int32."""
    from torchport.linalg import complex_factor, complex_jacobi

    real = dtype.to_real()
    want = {
        (complex_factor, "cholesky"): {"A": dtype, "L": dtype, "info": torch.int32},
        (complex_factor, "chol1"): {"A": dtype, "L": dtype, "info": torch.int32},
        (complex_factor, "qr"): {"A": dtype, "Q": dtype, "R": dtype},
        (complex_jacobi, "eigh"): {"A": dtype, "L": real, "Q": dtype},
        (complex_jacobi, "svd1"): {"A": dtype, "S": real, "U": dtype, "Vh": dtype},
    }
    for (mod, name), types in want.items():
        args = mod._ks(dtype)[name].args
        got = {a.name: a.dtypes for a in args if hasattr(a, "dtypes")}
        assert got == {k: (v,) for k, v in types.items()}, (name, got)
