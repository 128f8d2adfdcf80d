"""Low-precision fixes from the review of session 50.

- ``torchport.scaled_mm`` with an E4M3 NaN code (0x7F/0xFF) in ``b`` gave finite columns at
  M <= 8 (the decode GEMV's per-call pack skipped the NaN scan, and its register decodes read the
  codes as ±480) and NaN columns at M > 8; torch gives NaN at every M. So did a compiled call
  and a compiled ``F.linear`` with a ``Float8Tensor`` weight (the custom op's per-call pack).
  Now such columns get a NaN scale (:func:`torchport.gemv.nancodes.nan_rowscale`, the scan
  remembered per weight memory and version counter while it finds none).
- An inner tensor of a quantized weight written in place (``w.scale.mul_(3)``,
  ``w.qdata.view(torch.uint8)[r, c] = 0x7F``) was not seen by the cached pack: a tensor-wise FP8
  scale is copied into it (outputs kept the old scale), and so are NaN-scan results. The pack
  records its source tensors' version counters and is rebuilt when one moved.
- Under ``torch.inference_mode()`` a settled decode route returned ordinary tensors (its
  outputs were all made outside inference mode), so only the first call's output was an
  inference tensor; torch's ``F.linear`` gives inference tensors there on every call, and
  ordinary ones outside.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport import config
from torchport.gemv import gemv
from torchport.gemv.nancodes import e4m3_nan_rows, e4m3_nan_rows_reference, nan_rowscale
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same_pattern(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN and infinities where the reference has them, finite values close."""
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isposinf(), ref.isposinf())
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-4, atol=1e-4)


def _b_with_code(dtype: torch.dtype, code: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """``b [K=70, N=12]`` (K not a multiple of the vector width) with ``code`` at (k=5, n=3),
    column-major (``w.t()``, as torch._scaled_mm wants it) or row-major."""
    w = torch.randn(12, 70, generator=g).to(dtype)
    w.view(torch.uint8)[3, 5] = code
    return w.t() if layout == "colmajor" else w.t().contiguous()


# --- 1. NaN and infinity codes in scaled_mm's b at every M ---------------------------------------


def test_e4m3_nan_rows_matches_its_reference_for_every_code() -> None:
    """Each of the 256 E4M3 bytes alone in a row: NaN rows exactly where torch's cast gives NaN."""
    codes = torch.zeros(256, 33, dtype=torch.uint8)
    codes[:, 17] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = e4m3_nan_rows_reference(codes)
    assert int(want.sum()) == 2 and bool(want[[0x7F, 0xFF]].all())
    assert torch.equal(e4m3_nan_rows(codes), want)
    assert torch.equal(e4m3_nan_rows(codes.t().contiguous().t()), want)  # strided rows


@pytest.mark.parametrize("m", [1, 8, 9])
@pytest.mark.parametrize("layout", ["colmajor", "rowmajor"])
@pytest.mark.parametrize(
    ("dtype", "code"),
    [(E4M3, 0x7F), (E4M3, 0xFF), (E5M2, 0x7C), (E5M2, 0xFC), (E5M2, 0x7E), (E5M2, 0xFF)],
    ids=["e4m3-7f", "e4m3-ff", "e5m2-inf", "e5m2-neginf", "e5m2-nan", "e5m2-nan-ff"],
)
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_scaled_mm_nan_and_inf_codes_in_b_as_torch(m, layout, dtype, code, scaling) -> None:
    """torch._scaled_mm's NaN and infinities for a NaN/inf code in ``b`` at every M (E4M3's NaN
    codes gave finite columns at M <= 8 before), on the first call and the repeated one (the
    remembered scan), with bias and a bf16 output too. (Untuned: the first native candidate of
    each plan, which reads E4M3's NaN codes as the others do; tuning every M took most of this
    file's time.)"""
    with config.override(autotune=False):
        _scaled_mm_case(m, layout, dtype, code, scaling)


def _scaled_mm_case(m: int, layout: str, dtype: torch.dtype, code: int, scaling: str) -> None:
    g = torch.Generator().manual_seed(m * 7 + code)
    b = _b_with_code(dtype, code, layout, g)
    a = (torch.randn(m, 70, generator=g).abs() + 0.1).to(dtype)  # one sign: an inf stays one
    if scaling == "tensor":
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    else:
        sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, 12, generator=g) + 0.5
    bias = torch.randn(12, generator=g)
    ref = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    assert not bool(ref[:, 3].isfinite().any()) and bool(ref[:, [0, 1, 2, 4]].isfinite().all())
    for _ in range(2):
        out = torchport.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
        _same_pattern(out, ref)
    ref16 = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    out16 = torchport.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    assert torch.equal(out16.isnan(), ref16.isnan()) and torch.equal(out16.isinf(), ref16.isinf())


def test_scaled_mm_sees_nan_codes_written_after_a_clean_call() -> None:
    """The remembered clean scan is keyed by ``b``'s version counter: a NaN code written into the
    weight in place afterwards gives its column NaN on the next call; cleared again, the column
    is finite (a weight with NaN codes is never remembered)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 64, generator=g).to(E4M3)
    a = torch.randn(1, 64, generator=g).to(E4M3)
    one = torch.tensor(1.0)
    assert bool(torchport.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32).isfinite().all())
    saved = w.view(torch.uint8)[7, 9].clone()
    w.view(torch.uint8)[7, 9] = 0xFF
    out = torchport.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32)
    assert bool(out[0, 7].isnan()) and int(out.isnan().sum()) == 1
    w.view(torch.uint8)[7, 9] = saved
    assert bool(torchport.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32).isfinite().all())


def test_nan_rowscale_leaves_the_callers_scale_alone() -> None:
    """The NaN scale is a new tensor (a row-wise ``scale_b`` is the pack's row scale itself)."""
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    codes[2, 31] = 0x7F
    rs = torch.ones(4)
    out = nan_rowscale(codes, rs)
    assert out is not rs and bool(rs.isfinite().all())
    assert torch.equal(out.isnan(), torch.tensor([False, False, True, False]))
    assert nan_rowscale(codes[:0], rs) is rs  # (empty: nothing to scan)


def test_compiled_scaled_mm_and_float8_linear_give_nan_columns() -> None:
    """Traced calls reach the ``gemv_packed`` custom op with a per-call pack: it scans when it
    runs (compiled ``scaled_mm`` at M = 1 and a compiled ``F.linear`` with a ``Float8Tensor``
    gave finite columns)."""
    g = torch.Generator().manual_seed(5)
    b = _b_with_code(E4M3, 0x7F, "colmajor", g)
    one = torch.tensor(1.0)
    a = torch.randn(1, 70, generator=g).to(E4M3)
    ref = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    f = torch.compile(
        lambda a, b: torchport.scaled_mm(a, b, one, one, out_dtype=torch.float32), fullgraph=True
    )
    _same_pattern(f(a, b), ref)
    w = Float8Tensor(b.t().clone(), torch.tensor(0.5), torch.float32)
    x = torch.randn(2, 70, generator=g)
    lin = torch.compile(lambda x: F.linear(x, w))
    _same_pattern(lin(x), F.linear(x, w.dequantize()))


# --- 2. inner tensors written in place reach the cached pack ---------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("entry", ["linear", "gemv"])
def test_float8_scale_written_in_place_reaches_the_decode(granularity, entry) -> None:
    """``w.scale.mul_(3)`` after the pack was made and the route settled: the next decode uses
    the new scale (a tensor-wise scale is copied into the pack: it kept the old one)."""
    g = torch.Generator().manual_seed(11)
    w = Float8Tensor.from_float(torch.randn(40, 128, generator=g), granularity=granularity)
    x = torch.randn(1, 128, generator=g)

    def call() -> torch.Tensor:
        return F.linear(x, w) if entry == "linear" else gemv(x, w)

    for _ in range(3):  # packed, then a settled route
        call()
    w.scale.mul_(3)
    torch.testing.assert_close(call(), F.linear(x, w.dequantize()), rtol=1e-4, atol=1e-4)
    w.qdata.copy_(torch.randn(40, 128, generator=g).to(E4M3))
    torch.testing.assert_close(call(), F.linear(x, w.dequantize()), rtol=1e-4, atol=1e-4)


def test_float8_nan_code_written_after_the_pack_gives_its_row_nan() -> None:
    """The pack's NaN scan ran on the clean codes; a NaN code written in place afterwards (and
    cleared again) is scanned anew: NaN in its row, then finite again, as torch's dequantized
    F.linear."""
    g = torch.Generator().manual_seed(12)
    w = Float8Tensor.from_float(torch.randn(8, 64, generator=g), granularity="row")
    x = torch.randn(1, 64, generator=g)
    for _ in range(3):
        assert bool(F.linear(x, w).isfinite().all())
    w.qdata.view(torch.uint8)[2, 40] = 0x7F
    out = F.linear(x, w)
    assert torch.equal(out.isnan(), F.linear(x, w.dequantize()).isnan())
    assert bool(out[0, 2].isnan()) and int(out.isnan().sum()) == 1
    w.qdata.view(torch.uint8)[2, 40] = 0x10
    assert bool(F.linear(x, w).isfinite().all())


def test_mx_scale_written_in_place_reaches_a_pack_with_its_own_scales() -> None:
    """An MX E4M3 weight with a NaN element: its pack holds its own copy of the block scales
    (the NaN folded in); a block scale written in place afterwards reaches the decode."""
    g = torch.Generator().manual_seed(13)
    w = MXTensor.from_float(torch.randn(6, 128, generator=g), "fp8_e4m3")
    w.qdata.view(torch.uint8)[1, 3] = 0x7F
    x = torch.randn(1, 128, generator=g)
    for _ in range(3):
        F.linear(x, w)
    w.scale.view(torch.uint8)[4].add_(1)  # row 4's blocks doubled
    out, ref = F.linear(x, w), F.linear(x, w.dequantize())
    assert bool(out[0, 1].isnan()) and int(out.isnan().sum()) == 1
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-4, atol=1e-4)


# --- 3. inference tensors out of inference mode, as torch's F.linear --------------------------------


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    w = torch.randn(40, 128, generator=g)
    return [
        ("fp8", Float8Tensor.from_float(w)),
        ("nvfp4", NVFP4Tensor.from_float(w)),
        ("mxfp4", MXTensor.from_float(w)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("idx", [0, 1, 2], ids=["fp8", "nvfp4", "mxfp4"])
def test_decode_outputs_are_inference_tensors_exactly_in_inference_mode(dtype, idx) -> None:
    """Every call inside ``torch.inference_mode()`` gives an inference tensor and every call
    outside an ordinary one, as torch's ``F.linear`` on the dequantized weight (the settled
    route gave ordinary tensors inside from the second call on); an inside output refuses to be
    saved for backward as torch's does, an outside one differentiates."""
    _, w = _weights()[idx]
    x = torch.randn(1, 128, dtype=dtype)
    wd = w.dequantize().to(dtype)
    seq = ["in", "in", "in", "out", "out", "in", "out"]
    for where in seq:
        with torch.inference_mode(where == "in"):
            ours, theirs = F.linear(x, w), F.linear(x, wd)
        assert ours.is_inference() == theirs.is_inference() == (where == "in"), where
    with torch.inference_mode():
        inside = [F.linear(x, w) for _ in range(3)]
    p = torch.ones(40, dtype=dtype, requires_grad=True)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        inside[-1] * p
    (F.linear(x, w) * p).sum().backward()
    assert p.grad is not None
