"""torchport.linalg under autograd of the values alone (repeated values), ``torch.func``
transforms (vmap, grad, jvp) and forward AD, on every method: against torch.linalg's results and
gradients. Routes are seeded through a stubbed tuner, nothing is timed."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwad

import torchport.linalg as tl
from torchport.native import NativeFallbackWarning

METHODS = ["auto", "jacobi"]


@pytest.fixture
def native_routes(monkeypatch):
    """method="auto" routes every problem to the native kernels, from empty route tables, and
    records each tuning request instead of timing anything."""
    calls: list = []
    monkeypatch.setattr(tl, "_memo", {})
    monkeypatch.setattr(tl, "_fast", {})
    monkeypatch.setattr(tl, "_chol_native", {})
    monkeypatch.setattr(tl, "_qr_native", {})
    tl._drop_routes()  # the LAPACK fast-path sets and one-matrix tables are aliased: in place
    monkeypatch.setattr(tl, "_tune", lambda op, key, b: calls.append(key) or True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeFallbackWarning)
        yield calls
    tl._drop_routes()


def _spd(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    x = torch.randn(n, n, dtype=dtype, generator=torch.Generator().manual_seed(2))
    return x @ x.mH + n * torch.eye(n, dtype=dtype)


def _summed(f):
    return lambda x: f(x).sum()


def _grad(f, a: torch.Tensor) -> torch.Tensor:
    x = a.clone().requires_grad_()
    f(x).backward()
    assert x.grad is not None
    return x.grad


# --- gradients of the values alone ----------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_values_only_gradients_with_repeated_values(native_routes, method, dtype):
    """svdvals / eigvalsh (and S-only, L-only losses through svd / eigh) gave all-NaN gradients
    for repeated values (torch.eye(3): 0/0): the autograd wrapper materialised the unused
    outputs' grads as zeros, so the backward never took its values-only formula. Now torch's
    gradients: identity for sum(S) at I, 2A for sum(S²) of a rank-one 4 x 3."""
    eye = torch.eye(3, dtype=dtype)
    ones = torch.ones(4, 3, dtype=dtype)
    zeros = torch.zeros(3, 3, dtype=dtype)
    q = torch.linalg.qr(torch.randn(4, 4, dtype=dtype, generator=torch.Generator().manual_seed(1)))[
        0
    ]
    cases = [
        (eye, lambda lib, x: lib.svdvals(x).sum()),
        (eye, lambda lib, x: lib.svd(x).S.sum()),
        (eye, lambda lib, x: lib.svd(x, full_matrices=False).S.sum()),
        (zeros, lambda lib, x: lib.svdvals(x).sum()),
        (q, lambda lib, x: lib.svdvals(x).sum()),
        (ones, lambda lib, x: (lib.svdvals(x) ** 2).sum()),
        (ones.mT, lambda lib, x: (lib.svd(x).S ** 2).sum()),
        (eye, lambda lib, x: lib.eigvalsh(x).sum()),
        (eye, lambda lib, x: (lib.eigh(x).eigenvalues ** 2).sum()),
        (zeros, lambda lib, x: lib.eigvalsh(x, "U").sum()),
    ]
    for a, loss in cases:
        got = _grad(functools.partial(loss, _Method(method)), a)
        want = _grad(functools.partial(loss, torch.linalg), a)
        assert torch.isfinite(got).all(), (a, got)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # sum(S) of a rank-one matrix: any subgradient, but a finite one
    assert torch.isfinite(_grad(lambda x: tl.svdvals(x, method=method).sum(), ones)).all()


class _Method:
    """torchport.linalg's functions with ``method`` bound, spelled as torch.linalg's."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __getattr__(self, name: str):
        fn = getattr(tl, name)
        return lambda *args, **kw: fn(*args, **kw, method=self.method)


# --- torch.func and forward AD --------------------------------------------------------------------


def _ops(method: str):
    """(name, torchport function of one matrix, torch.linalg's, input) for every public op."""
    a = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = _spd(3)
    m = _Method(method)
    return [
        ("svdvals", m.svdvals, torch.linalg.svdvals, a),
        ("svd_S", lambda x: m.svd(x).S, lambda x: torch.linalg.svd(x).S, a),
        ("eigvalsh", m.eigvalsh, torch.linalg.eigvalsh, s),
        ("eigh_L", lambda x: m.eigh(x).eigenvalues, lambda x: torch.linalg.eigh(x).eigenvalues, s),
        ("qr_R", lambda x: m.qr(x).R, lambda x: torch.linalg.qr(x).R, a),
        ("cholesky", m.cholesky, torch.linalg.cholesky, s),
        ("cholesky_ex", lambda x: m.cholesky_ex(x).L, lambda x: torch.linalg.cholesky_ex(x).L, s),
    ]


@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "after_warm_up"])
@pytest.mark.parametrize("method", METHODS)
def test_vmap_matches_torch_linalg(native_routes, method, warm):
    """torch.vmap failed on every op: on a first call method="auto" tuned inside vmap ("called
    random operation while in randomness error mode"); after a warm-up call the learned native
    launchers read data_ptr() of a BatchedTensor ("Cannot access data pointer"), as did
    method="jacobi" (and its Cholesky error check ran torch.nonzero). Now torch.linalg's results,
    with no tuning under the transform."""
    for name, ours, theirs, x in _ops(method):
        batch = torch.stack([x, 2 * x, x + x.mT])
        if name.startswith(("eig", "chol")):
            batch = torch.stack([x, 2 * x, x + torch.eye(3, dtype=x.dtype)])
        if warm:  # learn the route and launcher of the per-sample problem first
            ours(x)
            ours(x)
        tuned = len(native_routes)
        got = torch.vmap(ours)(batch)
        assert len(native_routes) == tuned, f"{name}: tuned under vmap"
        torch.testing.assert_close(got, torch.vmap(theirs)(batch), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_func_grad_and_jvp_match_torch_linalg(native_routes, method):
    """torch.func.grad through method="jacobi" (and a native "auto" route) raised "autograd.Function
    ... must override the setup_context staticmethod" (the custom ops under functorch), and a
    forward-AD tangent was dropped by the kernels. Now torch.linalg's derivatives."""
    for name, ours, theirs, x in _ops(method):
        ours(x)  # learn the native route first
        got = torch.func.grad(_summed(ours))(x)
        torch.testing.assert_close(got, torch.func.grad(_summed(theirs))(x))
        t = torch.randn(3, 3, dtype=x.dtype, generator=torch.Generator().manual_seed(5))
        t = t + t.mT
        got_t = torch.func.jvp(ours, (x,), (t,))[1]
        torch.testing.assert_close(got_t, torch.func.jvp(theirs, (x,), (t,))[1])
        with fwad.dual_level():
            out = fwad.unpack_dual(ours(fwad.make_dual(x, t))).tangent
            want = fwad.unpack_dual(theirs(fwad.make_dual(x, t))).tangent
        assert out is not None, f"{name}: tangent dropped"
        torch.testing.assert_close(out, want)


def test_jacobi_under_a_transform_falls_back_visibly(native_routes):
    """method="jacobi" under torch.func runs torch.linalg, and says so (a counted fallback)."""
    from torchport.native import toolchain

    before = sum(v for k, v in toolchain.fallback_counts.items() if "torch.func" in k)
    torch.vmap(lambda x: tl.svdvals(x, method="jacobi"))(torch.randn(2, 3, 3))
    after = sum(v for k, v in toolchain.fallback_counts.items() if "torch.func" in k)
    assert after == before + 1
