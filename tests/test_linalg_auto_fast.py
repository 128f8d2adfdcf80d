"""The method="auto" LAPACK fast path: same results and errors as the general path, and its
route cache dropped when a routing setting changes. Deterministic: routes are seeded directly,
nothing is timed."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchport.linalg as tl
from torchport import config


def _spd(b: int, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.randn(b, n, n, dtype=dtype, generator=torch.Generator().manual_seed(1))
    return g @ g.mT + n * torch.eye(n, dtype=dtype)


def _seed_lapack(op: str, a: torch.Tensor, *public: object) -> None:
    tl._sync_routes()
    tl._lapack_fast[op].add((a.shape, a.dtype, *public))


def test_fast_hits_return_torch_results_unchanged() -> None:
    a = _spd(5, 4)
    _seed_lapack("cholesky", a, False)
    _seed_lapack("qr", a, "reduced")
    _seed_lapack("eigh", a, "L", True)
    _seed_lapack("eigh", a, "L", False)
    _seed_lapack("svd", a, True, True)
    assert torch.equal(tl.cholesky(a), torch.linalg.cholesky(a))
    assert type(tl.qr(a)) is type(torch.linalg.qr(a))
    assert torch.equal(tl.qr(a).R, torch.linalg.qr(a).R)
    assert torch.equal(tl.eigh(a).eigenvalues, torch.linalg.eigh(a).eigenvalues)
    assert torch.equal(tl.eigvalsh(a), torch.linalg.eigvalsh(a))
    assert torch.equal(tl.svd(a).S, torch.linalg.svd(a).S)


def test_fast_hit_keeps_errors_and_autograd() -> None:
    a = _spd(3, 4)
    _seed_lapack("cholesky", a, False)
    bad = a.clone()
    bad[1] = -bad[1]
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*minor of order 1"):
        tl.cholesky(bad)  # the fast path runs cholesky_ex and reads info itself
    one = a[0].clone()
    one[2, 2] = -50.0
    _seed_lapack("cholesky", one, False)
    with pytest.raises(torch.linalg.LinAlgError, match=r"cholesky: The fact.*minor of order 3"):
        tl.cholesky(one)
    assert torch.equal(tl.cholesky(a[0]), torch.linalg.cholesky(a[0]))
    x = a.clone().requires_grad_()
    tl.cholesky(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # an invalid UPLO never matches the fast key: the general path raises torchport's error
    _seed_lapack("eigh", a, "L", True)
    with pytest.raises(tl.LinalgInputError):
        tl.eigh(a, UPLO="X")


def test_config_assignment_drops_routes() -> None:
    a = _spd(2, 3)
    tl.cholesky(a)  # routes (tunes or reads the cache) and records the route
    _seed_lapack("cholesky", a, False)
    assert tl._lapack_known("cholesky", a, (False,))
    noise = config.get("autotune_noise")
    config.set("autotune_noise", noise)  # an assignment, even to the same value, re-routes
    try:
        assert not tl._lapack_known("cholesky", a, (False,))
        tl._sync_routes()
        assert not tl._lk_chol and not tl._fast and not tl._memo
    finally:
        config.set("autotune_noise", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("upper", [False, True])
def test_jacobi_repeat_fast_path_matches_general_path(dtype: torch.dtype, upper: bool) -> None:
    tl._drop_routes()
    a = _spd(13, 3, dtype).reshape(13, 1, 3, 3)  # a batch that does not fill the last lane group
    first = tl.cholesky(a, upper=upper, method="jacobi")
    assert (
        "jacobi",
        a.shape,
        a.dtype,
        upper,
    ) in tl._chol_native  # learned by the first (general) call
    again = tl.cholesky(a, upper=upper, method="jacobi")  # the resolved launcher
    assert torch.equal(first, again)
    torch.testing.assert_close(again, torch.linalg.cholesky(a, upper=upper))
    fac, info = tl.cholesky_ex(a, upper=upper, method="jacobi")
    assert type(tl.cholesky_ex(a, method="jacobi")) is type(torch.linalg.cholesky_ex(a))
    assert info.shape == (13, 1) and info.dtype == torch.int32 and not info.any()
    assert torch.equal(fac, first)
    bad = a.clone()
    bad[4, 0, 1, 1] = -100.0
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 4\).*minor of order 2"):
        tl.cholesky(bad, upper=upper, method="jacobi")
    with pytest.raises(torch.linalg.LinAlgError, match=r"cholesky_ex: \(Batch element 4\)"):
        tl.cholesky_ex(bad, upper=upper, check_errors=True, method="jacobi")
    fac, info = tl.cholesky_ex(bad, upper=upper, method="jacobi")
    assert info.flatten().tolist() == [0, 0, 0, 0, 2] + [0] * 8
    assert not fac[4].any() and torch.equal(fac[:4], first[:4])
    # autograd takes the general path (the op layer records the backward)
    x = a.clone().requires_grad_()
    tl.cholesky(x, upper=upper, method="jacobi").sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # a setting change forgets the learned launcher; switched-off native kernels are honoured
    with config.override(native=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the visible fallback note for switched-off kernels
        torch.testing.assert_close(tl.cholesky(a, upper=upper, method="jacobi"), first)
    config.set("autotune_noise", config.get("autotune_noise"))
    try:
        assert tl._chol_routed_native(a, upper, "jacobi") is None  # stale: general path
        tl._sync_routes()
        assert not tl._chol_native
    finally:
        config.set("autotune_noise", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("shape", "mode"), [((7, 1, 3, 3), "reduced"), ((5, 6, 4), "complete"), ((9, 3, 5), "r")]
)
def test_qr_repeat_fast_path_matches_general_path(
    dtype: torch.dtype, shape: tuple[int, ...], mode: str
) -> None:
    tl._drop_routes()
    a = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    first = tl.qr(a, mode=mode, method="jacobi")  # general path: learns the launcher
    assert ("jacobi", a.shape, a.dtype, mode) in tl._qr_native
    again = tl.qr(a, mode=mode, method="jacobi")  # the resolved launcher
    assert type(again) is type(torch.linalg.qr(a, mode=mode))
    ref = torch.linalg.qr(a, mode=mode)
    assert again.Q.shape == ref.Q.shape and again.R.shape == ref.R.shape
    assert torch.equal(again.Q, first.Q) and torch.equal(again.R, first.R)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(again.R, ref.R, atol=tol, rtol=tol)
    # a strided input takes the launcher too (it makes the batch contiguous first)
    t = a.mT.contiguous().mT
    tl.qr(t, mode=mode, method="jacobi")
    torch.testing.assert_close(tl.qr(t, mode=mode, method="jacobi").R, ref.R, atol=tol, rtol=tol)
    # autograd takes the general path (the op layer records the backward)
    if mode == "reduced":
        x = a.clone().requires_grad_()
        q, r = tl.qr(x, mode=mode, method="jacobi")
        (q.sum() + r.sum()).backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    # switched-off native kernels are honoured, a setting assignment forgets the launcher
    with config.override(native=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the visible fallback note for switched-off kernels
        assert tl._native_ok(a) is False
        torch.testing.assert_close(
            tl.qr(a, mode=mode, method="jacobi").R, ref.R, atol=tol, rtol=tol
        )
    config.set("autotune_noise", config.get("autotune_noise"))
    try:
        assert not tl._native_ok(a)  # stale: general path
        tl._sync_routes()
        assert not tl._qr_native
    finally:
        config.set("autotune_noise", None)


def test_native_fast_path_sees_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    tl._drop_routes()
    a = _spd(9, 3)
    tl.cholesky(a, method="jacobi")
    tl.qr(a, method="jacobi")
    assert tl._native_ok(a)
    monkeypatch.setenv("TORCHPORT_NATIVE", "0")
    assert not tl._native_ok(a)  # the fast paths step aside; the general path re-reads settings
    assert tl._chol_routed_native(a, False, "jacobi") is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(tl.cholesky(a, method="jacobi"), torch.linalg.cholesky(a))
    assert not tl._chol_native and not tl._qr_native


def test_native_fast_path_kept_under_unrelated_override() -> None:
    tl._drop_routes()
    a = _spd(9, 3)
    tl.cholesky(a, method="jacobi")
    with config.override(progress=False):  # not a routing setting: launchers stay valid
        assert tl._native_ok(a)
        assert tl._chol_routed_native(a, False, "jacobi") is not None
        with config.override(isa="scalar"):  # a routing setting: the general path decides
            assert not tl._native_ok(a)
        assert tl._native_ok(a)


@pytest.mark.parametrize("shape", [(), (1,), (2,), (100,), (7, 3), (10_000,)], ids=str)
def test_info_bad_flags_any_nonzero_entry(shape: tuple[int, ...]) -> None:
    """The LAPACK route's info test (bytes against as many zero bytes) agrees with
    ``info.any()`` wherever the flag sits, including the last entry and negative values."""
    info = torch.zeros(shape, dtype=torch.int32)
    assert not tl._info_bad(info)
    flat = info.view(-1)
    for at in sorted({0, flat.numel() // 2, flat.numel() - 1}):
        for value in (1, 3, -2, 1 << 24):
            flat.zero_()
            flat[at] = value
            assert tl._info_bad(info), (at, value)
    flat.zero_()
    assert not tl._info_bad(info)  # a cached zero pattern is never written to


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("b", [1, 100])
def test_fast_hit_cholesky_upper_and_errors(upper: bool, b: int) -> None:
    """The LAPACK fast path of cholesky (upper or not, one matrix or a batch) gives torch's
    factor and torchport's error naming the batch element and minor."""
    a = _spd(b, 3) if b > 1 else _spd(1, 3)[0]
    _seed_lapack("cholesky", a, upper)
    assert torch.equal(tl.cholesky(a, upper=upper), torch.linalg.cholesky(a, upper=upper))
    assert torch.equal(tl.cholesky_ex(a, upper=upper).L, torch.linalg.cholesky_ex(a, upper=upper).L)
    bad = a.clone()
    bad.view(-1, 3, 3)[-1, 1, 1] = -100.0  # the last matrix
    where = rf"cholesky: \(Batch element {b - 1}\): " if b > 1 else "cholesky: "
    with pytest.raises(torch.linalg.LinAlgError, match=where + r"The fact.*minor of order 2"):
        tl.cholesky(bad, upper=upper)
    assert tl.cholesky_ex(bad, upper=upper).info.tolist() == (
        torch.linalg.cholesky_ex(bad, upper=upper).info.tolist()
    )
