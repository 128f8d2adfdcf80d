"""Elementwise kernels vs their references over shapes × dtypes × layouts × ISA levels."""

from __future__ import annotations

import pytest
import torch

from torchport import config
from torchport.ops import elementwise as E

SIZES = [0, 1, 7, 16, 17, 255, 1023, 65537, 300_001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
ISAS = ["auto", "scalar"]


def _ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float64:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    elif out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2.4e-7, atol=1e-30)
    else:  # one bf16 ulp
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_axpy_matches_reference(n, dtype, isa):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    y = torch.randn(n, generator=g).to(dtype)
    with config.override(isa=isa):
        out = E.axpy(-1.75, x, y)
    _ulp_close(out, E.axpy_reference(-1.75, x, y))


@pytest.mark.parametrize("layout", ["transposed", "strided", "3d"])
def test_axpy_layouts(layout):
    base_x, base_y = torch.randn(64, 48), torch.randn(64, 48)
    if layout == "transposed":
        x, y = base_x.t(), base_y.t()
    elif layout == "strided":
        x, y = base_x[:, ::3], base_y[:, 1::3]
    else:
        x, y = base_x.view(4, 16, 48), base_y.view(4, 16, 48)
    out = E.axpy(0.5, x, y)
    assert out.shape == x.shape
    _ulp_close(out, E.axpy_reference(0.5, x, y))


def test_axpy_special_values():
    x = torch.tensor([float("inf"), float("nan"), 0.0, -0.0, 3.0e38], dtype=torch.float32)
    y = torch.tensor([1.0, 1.0, -0.0, -0.0, 3.0e38], dtype=torch.float32)
    out = E.axpy(1.0, x, y)
    ref = torch.add(y, x)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~out.isnan()], ref[~ref.isnan()])
    xb = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    outb = E.axpy(1.0, xb, torch.zeros(2, dtype=torch.bfloat16))
    assert outb.view(torch.int16)[0].item() == 0x7FC0  # canonical bf16 NaN, as torch rounds


ROW_SHAPES = [(0, 5), (3, 0), (1, 1), (1, 70_001), (5, 17), (37, 1001), (129, 64), (2, 200_000)]


@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rowsum_matches_reference(shape, dtype, isa, unroll):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    with config.override(isa=isa):
        out = E.rowsum(x, unroll=unroll)
    ref = E.rowsum_reference(x)
    n = max(1, shape[1])
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6 * n)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * n**0.5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12 * n**0.5)


@pytest.mark.parametrize("layout", ["row-sliced", "transposed", "column-sliced"])
def test_rowsum_layouts(layout):
    base = torch.randn(96, 80)
    x = {"row-sliced": base[:, 3:70], "transposed": base.t(), "column-sliced": base[::2, ::2]}[
        layout
    ]
    torch.testing.assert_close(E.rowsum(x, unroll=2), E.rowsum_reference(x), rtol=1e-5, atol=1e-5)


def test_rowsum_autotuned_choice_is_correct(fresh_cache):
    x = torch.randn(512, 300)
    out = E.rowsum(x)
    torch.testing.assert_close(out, E.rowsum_reference(x), rtol=1e-5, atol=1e-4)
    assert E.rowsum_choice(x).from_cache


def test_bad_inputs():
    with pytest.raises(E.ElementwiseInputError, match=r"same shape, got \(3,\) and \(4,\)"):
        E.axpy(1.0, torch.zeros(3), torch.zeros(4))
    with pytest.raises(
        E.ElementwiseInputError, match=r"same dtype, got torch.float32 and torch.float64"
    ):
        E.axpy(1.0, torch.zeros(3), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        E.ElementwiseInputError, match=r"x must be float32, float64 or bfloat16, got torch.int32"
    ):
        E.axpy(1.0, torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(E.ElementwiseInputError, match=r"alpha must be a real number, got 'a'"):
        E.axpy("a", torch.zeros(3), torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(E.ElementwiseInputError, match=r"x must be 2-D, got 3-D shape \(2, 2, 2\)"):
        E.rowsum(torch.zeros(2, 2, 2))
    with pytest.raises(
        E.ElementwiseInputError, match=r"unroll must be 0 or one of \(1, 2, 4\), got 3"
    ):
        E.rowsum(torch.zeros(2, 2), unroll=3)
    with pytest.raises(E.ElementwiseInputError, match=r"x must be a tensor, got list"):
        E.rowsum([[1.0]])  # type: ignore[arg-type]


def test_bad_inputs_found_by_review():
    """unroll=True / 2.0 passed the membership test (True == 1, 2.0 == 2) and reached the C
    source; an alpha past the double range raised a bare OverflowError; sparse and mkldnn inputs
    failed further on with unrelated errors."""
    x = torch.ones(3, 8)
    for bad in (True, 2.0):
        with pytest.raises(E.ElementwiseInputError, match=r"rowsum: unroll must be 0 or one of"):
            E.rowsum(x, unroll=bad)  # type: ignore[arg-type]
    with pytest.raises(E.ElementwiseInputError, match=r"alpha must fit in a double, got an int"):
        E.axpy(10**400, torch.ones(4), torch.ones(4))
    with pytest.raises(
        E.ElementwiseInputError, match=r"x must be a strided tensor, got torch.sparse"
    ):
        E.rowsum(x.to_sparse())


def test_rowsum_of_long_rows_with_fewer_threads_than_asked(tmp_path):
    """The split-row path summed a part per requested thread; with fewer threads granted
    (OMP_THREAD_LIMIT, OMP_DYNAMIC) the others were uninitialised stack: 1.7e32 for a row of
    100000 ones. (A subprocess: OpenMP reads the variable once.)"""
    import os
    import subprocess
    import sys

    code = (
        "import torch\nfrom torchport.ops import elementwise as E\ntorch.set_num_threads(4)\n"
        "for u in (1, 2, 4):\n"
        "    assert E.rowsum(torch.ones(1, 100000), unroll=u).item() == 100000.0, u\n"
        "print('ok')\n"
    )
    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "TORCHPORT_CACHE_DIR": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_custom_ops_compile_and_export():
    def f(x, y):
        return E.rowsum(E.axpy(2.0, x, y), unroll=2) + 1

    x, y = torch.randn(8, 33), torch.randn(8, 33)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), f(x, y))

    class M(torch.nn.Module):
        def forward(self, x, y):
            return f(x, y)

    ep = torch.export.export(M(), (x, y))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "torchport.axpy.default" in targets and "torchport.rowsum.default" in targets
    torch.testing.assert_close(ep.module()(x, y), f(x, y))


def test_custom_op_opcheck():
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    torch.library.opcheck(E._axpy_op, (x, y, 1.5), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(E._rowsum_op, (x, 2), test_utils=("test_schema", "test_faketensor"))


def test_gradients_through_the_custom_ops():
    # the ops had no autograd formula: backward raised "no autograd formula was registered"
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: E.axpy(-1.5, a, b), (x, y))
    assert torch.autograd.gradcheck(lambda a: E.rowsum(a, unroll=2), (x,))
    assert torch.autograd.gradcheck(lambda a: E.rowsum(a[:, ::2], unroll=1), (x,))
    compiled = torch.compile(
        lambda a, b: E.rowsum(E.axpy(2.0, a, b), unroll=2), backend="aot_eager"
    )
    gx, gy = torch.autograd.grad(compiled(x, y).square().sum(), (x, y))
    want = torch.autograd.grad((2.0 * x + y).sum(1).square().sum(), (x, y))
    torch.testing.assert_close((gx, gy), want)
    torch.library.opcheck(E._axpy_op, (x, y, 1.5), test_utils=("test_autograd_registration",))
