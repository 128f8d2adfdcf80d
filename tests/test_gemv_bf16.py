"""The ``vdpbf16ps`` bf16 GEMV (torchport.gemv.bf16_kernel) vs the float64 reference.

bf16-valued activations take the pair-dot path, other float32 activations the float kernel
compiled into the same library (bit for bit :func:`gemv_kernel`'s one-row loop); both
meet the float kernel's tolerance (``1e-5 · Σ|x·w|`` plus a tiny absolute term, which also covers
the pair dot's flushing of values below ``2⁻¹²⁶``), for K of any size (masked and scalar tails),
one to eight activation rows, with and without bias, on one and two threads (the same bits: each
row is one thread's). Which path ran is told apart by that flushing.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchport import autotune, native
from torchport.gemv import gemv_reference
from torchport.gemv import ops as gops
from torchport.gemv.bf16_kernel import gemv_bf16_dp_kernel
from torchport.gemv.ops import pack_dense

pytestmark = pytest.mark.skipif(
    not native.cpu_info().has_avx512_bf16, reason="the vdpbf16ps GEMV needs AVX512-BF16"
)


def _run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, threads: int = 2, **kw):
    kern = gemv_bf16_dp_kernel("avx512", **kw)
    pw = pack_dense(w)
    out = torch.empty(x.shape[0], pw.n)
    gops._launch(kern, x.float().contiguous(), pw, bias, out, threads)
    return out


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = gemv_reference(x.float(), w.float(), bias).double()
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    err = (out.double() - ref).abs()
    assert bool((err <= 1e-5 * mag + 1e-30).all()), float((err / (mag + 1e-300)).max())


@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 31), (5, 33), (17, 64), (40, 100), (131, 1061), (64, 4096)], ids=str
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
def test_dp_kernel_matches_reference(shape, rows, xdtype) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * 31 + k + rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).to(xdtype)
    bias = torch.randn(n, generator=g) if rows % 2 else None
    out = _run(x, w, bias)
    _check(out, x, w, bias)
    assert torch.equal(out, _run(x, w, bias, threads=1))


@pytest.mark.parametrize("scale", [1e-30, 1e30, 3e-39], ids=["1e-30", "1e30", "subnormal"])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
def test_dp_kernel_any_magnitude(scale: float, xdtype) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 300, generator=g).bfloat16()
    x = (torch.randn(3, 300, generator=g) * scale).to(xdtype)
    _check(_run(x, w, None), x, w, None)


def test_one_float_row_sends_every_row_to_the_float_kernel() -> None:
    """A bf16-valued row beside a float32 one: both rows go to the float kernel."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 257, generator=g).bfloat16()
    x = torch.randn(4, 257, generator=g).bfloat16().float()
    x[2] += 1e-3 * torch.randn(257, generator=g)
    _check(_run(x, w, None), x, w, None)


def _not_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` nudged off the bf16 grid (a low mantissa bit set): float32 activations."""
    return (x.float().view(torch.int32) | 1).view(torch.float32)


def test_bf16_activations_take_the_pair_dot_path() -> None:
    """Products 2⁻¹⁰⁰ · 2⁻³⁰ are below 2⁻¹²⁶: vdpbf16ps flushes them (the pair-dot path gives 0),
    the float kernel keeps them as float32 subnormals."""
    w = torch.full((4, 64), 2.0**-30).bfloat16()
    x = torch.full((1, 64), 2.0**-100)
    assert bool((_run(x, w, None) == 0).all())
    xf = _not_bf16(x)
    out = _run(xf, w, None)
    assert bool((out > 0).all())
    _check(out, xf, w, None)
    x2 = torch.cat([x, xf])  # one float32 row sends both rows to the float kernel
    assert bool((_run(x2, w, None) > 0).all())


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
def test_dp_kernel_propagates_nonfinite_activations(xdtype) -> None:
    w = torch.ones(8, 101).bfloat16()  # 101: both paths' tails too
    x = torch.ones(2, 101)
    if xdtype == torch.float32:
        x = _not_bf16(x)
    x[0, 5] = math.nan
    x[1, 100] = math.inf
    out = _run(x, w, None)
    assert bool(out[0].isnan().all())
    assert bool((out[1] == math.inf).all())


@pytest.mark.parametrize("rows", [4, 5, 8])
def test_two_weight_rows_keep_every_rows_bits(rows: int) -> None:
    """From four activation rows two weight rows share every activation load, pairing weight rows
    by position: without its first row the weight pairs every row differently (and an odd last
    row runs alone), yet each output keeps its bits, and each equals its single-row call's."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 1000, generator=g).bfloat16()  # K % 32 != 0: the masked tail too
    x = torch.randn(rows, 1000, generator=g).bfloat16()
    bias = torch.randn(37, generator=g)
    full = _run(x, w, bias)
    assert torch.equal(full, _run(x, w, bias, threads=1))
    assert torch.equal(full[:, 1:], _run(x, w[1:], bias[1:]))
    for i in range(rows):
        assert torch.equal(full[i], _run(x[i : i + 1], w, bias)[0]), i


@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("k", [4096, 1000, 1060, 192], ids=str)
def test_k_blocks_keep_bits(rows: int, k: int) -> None:
    """Two to four activation rows run K in blocks where their narrowed activations exceed the
    block (16 KB, or 256 bytes here): the same bits as K in one piece, on one and two threads, and
    with the weight rows paired differently; K ending in a whole line, a masked tail, or both."""
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randn(41, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(41, generator=g)
    whole = _run(x, w, bias, threads=1, xblock=0)
    _check(whole, x, w, bias)
    for xblock, threads in ((256, 1), (256, 2), (16384, 2)):
        assert torch.equal(_run(x, w, bias, threads=threads, xblock=xblock), whole)
    # the blocks run weight rows in pairs: without the first row every pair changes
    assert torch.equal(_run(x, w[1:], bias[1:], threads=1, xblock=256), whole[:, 1:])


@pytest.mark.parametrize("hint,pf", [("NTA", 2048), ("T0", 4096), ("NTA", 0), ("T1", 2048)])
def test_dp_kernel_prefetch_settings_keep_bits(hint: str, pf: int) -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 1000, generator=g).bfloat16()
    x = torch.randn(1, 1000, generator=g).bfloat16()
    assert torch.equal(_run(x, w, None, hint=hint, prefetch=pf), _run(x, w, None))


def test_dp_kernel_rejects_negative_xblock() -> None:
    with pytest.raises(ValueError, match=r"xblock must be >= 0 bytes, got -5"):
        gemv_bf16_dp_kernel("avx512", xblock=-5)


def test_dp_kernel_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="hint"):
        gemv_bf16_dp_kernel("avx512", hint="T2")
    with pytest.raises(native.NativeError, match="avx512"):
        gemv_bf16_dp_kernel("avx2")


def test_tuner_offers_the_dp_kernel_first_for_bf16() -> None:
    names = [c.name for c in gops.candidates("bf16")]
    assert names[0] == "aten_linear"
    assert names[1:5] == ["dp_p2048l2_t0", "dp_p0_t0", "dp_p2048l2_t1", "dp_p0_t1"]
    assert len(names) <= 10
    assert not any(n.startswith("dp") for n in (c.name for c in gops.candidates("f32")))
    cand = gops.candidates("bf16")[1]
    assert gops._native_kernel("bf16", False, 64, "avx512", cand) is gemv_bf16_dp_kernel(
        "avx512", 2048, hint="T1"
    )
    with pytest.raises(autotune.InvalidCandidate, match="bf16"):
        gops._native_kernel("f32", False, 64, "avx512", cand)


def test_kernel_status_errors_name_the_requirement() -> None:
    assert "could not allocate" in str(gops._status_error("bf16", 3, 4, 4096))
    assert "K=100 is not a multiple" in str(gops._status_error("nvfp4", 2, 1, 100))


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_float_activations_get_the_float_kernels_bits(rows: int) -> None:
    from torchport.gemv.kernels import gemv_kernel

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(77, 1003, generator=g).bfloat16()
    x = _not_bf16(torch.randn(rows, 1003, generator=g))
    bias = torch.randn(77, generator=g)
    pw = pack_dense(w)
    ref = torch.empty(rows, 77)
    gops._launch(gemv_kernel("bf16", "avx512", 512, 0), x, pw, bias, ref, 2)
    assert torch.equal(_run(x, w, bias), ref)
