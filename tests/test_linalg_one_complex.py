"""Complex one-matrix launchers (torchport.linalg.one on complex64/complex128: tp_csvd1,
tp_ceigh1, tp_cqr1, tp_cchol1): bit for bit the batched complex kernels' results for one matrix
(the same non-inlined workers; eigh: its Jacobi worker, the tridiagonal QL one is tested in
test_linalg_ceigh_tridiag.py), close to the plain-torch references and torch.linalg, the same
errors, batch shapes whose product is 1, and the method="auto" route to them (conjugate and
negative views read as their values). Deterministic: routes are seeded, nothing is timed."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import torchport.linalg as tl
from torchport.linalg import complex_factor, complex_jacobi, one
from torchport.linalg.reference import (
    cholesky_reference,
    complex_eigh_reference,
    complex_svd_reference,
    qr_reference,
)

CDTYPES = [torch.complex64, torch.complex128]
NS = [1, 2, 3, 5, 8, 16, one.ONE_MAX_N]
RECT = [(3, 7), (7, 3), (1, 5), (5, 1), (one.ONE_MAX_N, 4), (2, one.ONE_MAX_N)]
TOL = {torch.complex64: 2e-4, torch.complex128: 1e-10}


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _hpd(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = _rand(shape, torch.complex128)
    n = shape[-1]
    return (x @ x.mH + n * torch.eye(n, dtype=torch.complex128)).to(dtype)


def _flat(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(1, *a.shape[-2:]).contiguous()


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype] * max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(got.reshape(ref.shape).to(ref.dtype), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("mn", [(n, n) for n in NS] + RECT, ids=str)
@pytest.mark.parametrize("full", [False, True])
def test_svd_equals_batched_kernel(mn: tuple[int, int], dtype: torch.dtype, full: bool) -> None:
    a = _rand((1, *mn), dtype)
    got = one.svd_plan(a.shape, dtype, full, True)(a)
    assert type(got) is type(torch.linalg.svd(a))
    u, s, vh, bad = complex_jacobi.svd(a, full, True)
    assert bad == 0 and got.S.dtype == dtype.to_real()
    assert torch.equal(got.U, u) and torch.equal(got.S, s) and torch.equal(got.Vh, vh)
    assert torch.equal(one.svd_plan(a.shape, dtype, False, False)(a), s)
    ref = torch.linalg.svd(a, full_matrices=full)
    assert got.U.shape == ref.U.shape and got.Vh.shape == ref.Vh.shape
    _close(got.S, ref.S, dtype)
    k = min(mn)
    rec = (got.U[..., :k] * got.S[..., None, :].to(dtype)) @ got.Vh[..., :k, :]
    _close(rec, a, dtype)
    if max(mn) <= 8:  # the plain-torch reference of the algorithm (Python-level sweeps)
        _close(got.S, complex_svd_reference(a.to(torch.complex128), full)[1], dtype)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("upper", [False, True])
def test_eigh_equals_batched_kernel(n: int, dtype: torch.dtype, upper: bool) -> None:
    a = _rand((1, n, n), dtype)  # not Hermitian: only the UPLO triangle may be read
    # the Jacobi worker (the default from one.EIGH_TRIDIAGONAL_FROM is tridiagonal QL, tested in
    # test_linalg_ceigh_tridiag.py)
    got = one.eigh_plan(a.shape, dtype, upper, True, tridiagonal=False)(a)
    assert type(got) is type(torch.linalg.eigh(a))
    lam, q, bad = complex_jacobi.eigh(a, upper, True)
    assert bad == 0 and got.eigenvalues.dtype == dtype.to_real()
    assert torch.equal(got.eigenvalues, lam) and torch.equal(got.eigenvectors, q)
    assert torch.equal(one.eigh_plan(a.shape, dtype, upper, False, tridiagonal=False)(a), lam)
    uplo = "U" if upper else "L"
    _close(got.eigenvalues, torch.linalg.eigvalsh(a, UPLO=uplo), dtype)
    if n <= 8:
        ref = complex_eigh_reference(a.to(torch.complex128), upper, compute_v=False)[0]
        _close(got.eigenvalues, ref, dtype)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("mn", [(n, n) for n in NS] + RECT, ids=str)
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr_equals_batched_kernel(mn: tuple[int, int], dtype: torch.dtype, mode: str) -> None:
    a = _rand((1, *mn), dtype)
    got = one.qr_plan(a.shape, dtype, mode)(a)
    assert type(got) is type(torch.linalg.qr(a))
    q, r = complex_factor.qr(a, mode)
    assert torch.equal(got.Q, q) and torch.equal(got.R, r)
    ref = torch.linalg.qr(a, mode=mode)
    assert got.Q.shape == ref.Q.shape and got.R.shape == ref.R.shape
    _close(got.R, ref.R, dtype)  # the same (LAPACK) sign convention: R itself agrees
    _close(got.R, qr_reference(a.to(torch.complex128), mode)[1], dtype)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_equals_batched_kernel(n: int, dtype: torch.dtype, upper: bool) -> None:
    a = _hpd((1, n, n), dtype)
    fac = one.cholesky_plan(a.shape, dtype, upper, tl._raise_not_pd)(a)
    ref_fac, info, bad = complex_factor.cholesky(a, upper)
    assert bad == 0 and not info.any() and torch.equal(fac, ref_fac)
    _close(fac, torch.linalg.cholesky(a, upper=upper), dtype)
    _close(fac, cholesky_reference(a.to(torch.complex128), upper)[0], dtype)
    ex = one.cholesky_ex_plan(a.shape, dtype, upper, tl._raise_not_pd)(a, True)
    assert type(ex) is type(torch.linalg.cholesky_ex(a))
    assert torch.equal(ex.L, fac) and ex.info.dtype == torch.int32 and not ex.info.any()


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("batch", [(), (1,), (1, 1)], ids=str)
def test_batch_shapes_of_one_matrix(batch: tuple[int, ...], dtype: torch.dtype) -> None:
    a, h = _rand((*batch, 5, 3), dtype), _hpd((*batch, 4, 4), dtype)
    for got, ref in (
        (one.svd_plan(a.shape, dtype, True, True)(a), torch.linalg.svd(a)),
        (one.svd_plan(a.shape, dtype, False, False)(a), torch.linalg.svdvals(a)),
        (one.eigh_plan(h.shape, dtype, True, True)(h), torch.linalg.eigh(h, UPLO="U")),
        (one.eigh_plan(h.shape, dtype, False, False)(h), torch.linalg.eigvalsh(h)),
        (one.qr_plan(a.shape, dtype, "complete")(a), torch.linalg.qr(a, mode="complete")),
        (one.cholesky_plan(h.shape, dtype, True, tl._raise_not_pd)(h), torch.linalg.cholesky(h)),
        (one.cholesky_ex_plan(h.shape, dtype, False, tl._raise_not_pd)(h, True), None),
    ):
        outs = got if isinstance(got, tuple) else (got,)
        refs = torch.linalg.cholesky_ex(h) if ref is None else ref
        for o, r in zip(outs, refs if isinstance(refs, tuple) else (refs,), strict=True):
            assert o.shape == r.shape and o.dtype == r.dtype


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_strided_input(dtype: torch.dtype) -> None:
    a = _rand((1, 6, 6), dtype)
    t = a.mT  # not contiguous: the launcher copies it first
    qr = one.qr_plan(t.shape, dtype, "reduced")
    assert torch.equal(qr(t).R, qr(t.contiguous()).R)
    s = one.svd_plan(t.shape, dtype, False, False)
    assert torch.equal(s(t), s(t.contiguous()))


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 3), (4, 4), (1, 1, 9, 9)], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_errors_match_the_op_layer(shape: tuple[int, ...], dtype: torch.dtype, bad: float) -> None:
    where = r"\(Batch element 0\): " if len(shape) > 2 else ""
    for value in (complex(bad, 0), complex(0, bad)):
        a = _rand(shape, dtype)
        a[..., 1, 0] = value  # lower triangle
        for plan, op in (
            (one.svd_plan(a.shape, dtype, False, True), "svd"),
            (one.svd_plan(a.shape, dtype, True, False), "svd"),
            (one.eigh_plan(a.shape, dtype, False, True), "eigh"),
            (one.eigh_plan(a.shape, dtype, False, False), "eigh"),
        ):
            try:  # torch.linalg's answer: LinAlgError where LAPACK fails, else its NaNs
                want = getattr(torch.linalg, op)(a)[0 if op == "eigh" else 1].isnan()
            except torch.linalg.LinAlgError:
                want = None
            layer = functools.partial(getattr(tl, op), method="jacobi")  # says the same
            for call in (plan, layer):
                if want is None:
                    with pytest.raises(
                        torch.linalg.LinAlgError, match=rf"linalg\.{op}: {where}The alg"
                    ):
                        call(a)
                else:
                    got = call(a)
                    got = got if isinstance(got, torch.Tensor) else got[0 if op == "eigh" else 1]
                    assert torch.equal(got.isnan(), want)
        # a non-finite value only in the triangle eigh does not read: solved, as torch.linalg
        got = one.eigh_plan(a.shape, dtype, True, True)(a)
        ref = torch.linalg.eigvalsh(a, UPLO="U")
        _close(got.eigenvalues, ref, dtype)
        _close(one.eigh_plan(a.shape, dtype, True, False)(a), ref, dtype)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 3), (6, 6), (1, 1, 17, 17)], ids=str)
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_failing_minor(shape: tuple[int, ...], dtype: torch.dtype, upper: bool) -> None:
    where = r"\(Batch element 0\): " if len(shape) > 2 else ""
    n = shape[-1]
    for row, value in ((n - 1, -100.0), (1, float("nan"))):
        a = _hpd(shape, dtype)
        a[..., row, row] = value
        chol = one.cholesky_plan(a.shape, dtype, upper, tl._raise_not_pd)
        with pytest.raises(torch.linalg.LinAlgError, match=rf"cholesky: {where}.*order {row + 1} "):
            chol(a)
        ex = one.cholesky_ex_plan(a.shape, dtype, upper, tl._raise_not_pd)
        fac, info = ex(a, False)
        assert info.shape == shape[:-2] and info.reshape(-1).tolist() == [row + 1]
        assert not fac.any()
        assert torch.equal(info, torch.linalg.cholesky_ex(a, upper=upper).info)
        assert torch.equal(info, complex_factor.cholesky(_flat(a), upper)[1].reshape(info.shape))
        with pytest.raises(
            torch.linalg.LinAlgError, match=rf"cholesky_ex: {where}.*order {row + 1}"
        ):
            ex(a, True)


def test_sizes_beyond_the_launchers_are_refused() -> None:
    with pytest.raises(AssertionError):
        one.qr_plan(torch.Size((2, 3, 3)), torch.complex64, "r")  # two matrices
    big = one.ONE_MAX_N + 1
    for dtype in CDTYPES:  # the C guards: refused without touching memory
        for name, nargs in (("svd1", 4), ("eigh1", 3), ("qr1", 3), ("chol1", 3)):
            call = one._call(dtype, name)
            assert call(*[0] * nargs, one._code(big, big, False)) == -1, name
            assert call(*[0] * nargs, one._code(0, 0, False)) == -1, name


def _cases(dtype: torch.dtype) -> tuple[Any, ...]:
    a, h = _rand((1, 5, 4), dtype), _hpd((1, 5, 5), dtype)
    return (
        ("svd", "svd", a, (False, True), lambda x: tl.svd(x, full_matrices=False)),
        ("svdvals", "svd", a, (False, False), tl.svdvals),
        ("eigh", "eigh", h, (True, True), lambda x: tl.eigh(x, UPLO="U")),
        ("eigvalsh", "eigh", h, (False, False), tl.eigvalsh),
        ("qr", "qr", a, ("complete",), lambda x: tl.qr(x, mode="complete")),
        ("cholesky", "cholesky", h, (False,), tl.cholesky),
        ("cholesky_ex", "cholesky", h, (True,), lambda x: tl.cholesky_ex(x, upper=True)),
    )


# _cases' options as keywords, for the same call with method="jacobi"
_JACOBI_OPTIONS: dict[str, dict[str, Any]] = {
    "svd": {"full_matrices": False},
    "eigh": {"UPLO": "U"},
    "qr": {"mode": "complete"},
    "cholesky_ex": {"upper": True},
}


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_auto_learns_complex_launchers(dtype: torch.dtype) -> None:
    """A complex call that "auto" routes native at B = 1 learns the launcher; repeats return
    equal results through it, equal to method="jacobi" (the batched kernels; eigh, whose
    launcher runs tridiagonal QL from order one.EIGH_TRIDIAGONAL_FROM: the same eigenvalues and
    vectors up to rounding and a phase per vector)."""
    tl._drop_routes()
    for fn, op, x, extra, call in _cases(dtype):
        tl._sync_routes()
        tl._fast[(op, x.shape, x.dtype, x.device, extra)] = "native"
        first = call(x)
        assert len(tl._one[fn]) == 1, fn
        again = call(x)
        for f, g in zip(_tensors(first), _tensors(again), strict=True):
            assert torch.equal(f, g), fn
        kw = _JACOBI_OPTIONS.get(fn, {})
        batched = getattr(tl, fn)(x, method="jacobi", **kw)
        if op == "eigh" and x.shape[-1] >= one.EIGH_TRIDIAGONAL_FROM[dtype]:
            f, g = _tensors(first), _tensors(batched)
            _close(f[0], g[0], dtype)
            if fn == "eigh":  # |QᴴQ'| = I for separated eigenvalues
                ov = (f[1].mH @ g[1]).abs()
                _close(ov, torch.eye(x.shape[-1], dtype=ov.dtype).expand_as(ov), dtype)
            continue
        for f, g in zip(_tensors(first), _tensors(batched), strict=True):
            assert torch.equal(f, g), fn
    tl._drop_routes()


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("view", ["conj", "neg"])
def test_auto_reads_conjugate_and_negative_views(dtype: torch.dtype, view: str) -> None:
    """A lazy ``A.conj()`` (or negative) view shares A's memory unresolved: the learned launcher
    must not read it raw, on the first call nor on repeats."""
    tl._drop_routes()
    for fn, op, x, extra, call in _cases(dtype):
        if op == "cholesky" and view == "neg":  # -A is not positive-definite
            continue
        v = x.conj() if view == "conj" else torch._neg_view(x)
        assert v.is_conj() if view == "conj" else v.is_neg()
        want = call(v.resolve_conj().resolve_neg().clone())
        tl._sync_routes()
        tl._fast[(op, v.shape, v.dtype, v.device, extra)] = "native"
        for _ in range(2):  # learns, then the learned table
            for f, g in zip(_tensors(call(v)), _tensors(want), strict=True):
                assert torch.equal(f, g), (fn, view)
        x_plain = x.clone()
        for f, g in zip(_tensors(call(x_plain)), _tensors(call(x)), strict=True):
            assert torch.equal(f, g), fn  # the view did not disturb the plain route
    tl._drop_routes()


def test_complex_one_matrix_is_a_tuning_candidate() -> None:
    """The tuner times the one-matrix launcher for a complex single matrix (as for real)."""
    x = _rand((1, 3, 3), torch.complex64)
    fn = tl._candidate_fn("qr", ("reduced",), 1, 3, 3, torch.complex64)
    got = fn(x)
    assert type(got) is type(torch.linalg.qr(x))
    assert torch.equal(got.R, complex_factor.qr(x, "reduced")[1])
