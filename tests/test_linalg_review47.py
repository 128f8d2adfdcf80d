"""Regression tests from the forty-seventh session's review of torchport.linalg."""

from __future__ import annotations

import pytest
import torch

import torchport.linalg as tl


@pytest.mark.parametrize("batch", [(), (2,)], ids=["one", "batched"])
def test_fullgraph_compile_of_cholesky_after_an_eager_call_routed_it_to_lapack(batch):
    """An eager call that routed a shape to torch.linalg made the next fullgraph=True compile of
    the same shape fail: the LAPACK path's info check (``.item()``, a ctypes read of info's
    bytes) is not traceable. While dynamo traces, that path is torch.linalg.cholesky itself."""
    n = tl.NATIVE_MAX_N["cholesky"] + 1  # past the native kernels: LAPACK, without tuning
    x = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = (x @ x.mT + n * torch.eye(n, dtype=torch.float64)).expand(*batch, n, n).contiguous()
    tl.cholesky(a)  # the route is learned here
    assert (a.shape, a.dtype, False) in tl._lk_chol

    def f(t: torch.Tensor) -> torch.Tensor:
        return tl.cholesky(t) * 2

    torch._dynamo.reset()
    try:
        out = torch.compile(f, fullgraph=True, backend="eager")(a)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, 2 * torch.linalg.cholesky(a))
