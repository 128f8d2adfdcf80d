"""Non-finite activations meeting FP4 weights: the int8-activation kernels hand them back.

Quantizing a NaN or an infinity to int8 would give finite values (a silent wrong answer), so the
lane-block, pair-split and group-32 kernels return ``NONFINITE_STATUS`` for such activations
without writing their output, and every caller (``_launch``, settled routes with float32 or bf16
activations, graph capture's native tier) runs the format's float kernel instead, whose IEEE
products give NaN and infinities where ``F.linear`` on the dequantized weight gives them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchport import native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import (
    gemv_fp4_block_kernel,
    gemv_fp4_pair_kernel,
    gemv_fp4_wblock_kernel,
)
from torchport.gemv.kernels import NONFINITE_STATUS, gemv_i8_kernel, gemv_kernel
from torchport.graphs import Graph
from torchport.lowp import MXTensor, NVFP4Tensor

ISA = native.cpu_info().isa
pytestmark = pytest.mark.skipif(ISA == "scalar", reason="the int8-activation kernels need AVX2")


def _pack(fmt: str, w: torch.Tensor) -> gops.PackedWeight:
    return (NVFP4Tensor if fmt == "nvfp4" else MXTensor).from_float(w).gemv_pack()


def _activations(rows: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=g)
    x[rows - 1, 7] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[kind]
    return x


def _same_pattern(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN where the reference has NaN, the same infinities, finite values close."""
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isposinf(), ref.isposinf())
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    assert torch.allclose(out[fin].double(), ref[fin].double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("family", "fmt", "k"),
    [
        ("block", "nvfp4", 256),
        ("block", "mxfp4", 10368),
        ("wblock", "nvfp4", 11008),
        ("wblock", "mxfp4", 256),
        ("pair", "nvfp4", 192),
        ("i8", "mxfp4", 96),
    ],
)
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_int8_kernels_hand_back_nonfinite_activations(family, fmt, k, kind) -> None:
    if family == "wblock" and (ISA != "avx512" or not native.cpu_info().has("avx512_vnni")):
        pytest.skip("the whole-block kernel needs AVX-512 VNNI")
    kern = {
        "block": lambda: gemv_fp4_block_kernel(fmt, ISA, 4096),
        "wblock": lambda: gemv_fp4_wblock_kernel(fmt, ISA),
        "pair": lambda: gemv_fp4_pair_kernel(fmt, ISA),
        "i8": lambda: gemv_i8_kernel(fmt, ISA),
    }[family]()
    g = torch.Generator().manual_seed(k)
    pw = _pack(fmt, torch.randn(37, k, generator=g) * 0.1)
    for rows in (1, 3):
        x = _activations(rows, k, kind, g)
        out = torch.full((rows, 37), 7.0)
        raw = (x.data_ptr(), rows, k, pw.data.data_ptr(), pw.scales.data_ptr(),
               pw.rowscale.data_ptr(), pw.pts, 0, 0, out.data_ptr(), 37, 2)  # fmt: skip
        assert kern.raw_call(*raw) == NONFINITE_STATUS
        assert bool((out == 7.0).all())  # nothing written
        assert kern.float_twin() is gemv_kernel(fmt, ISA)
        gops._launch(kern, x, pw, None, out, 2)  # runs the float kernel
        want = torch.empty(rows, 37)
        gops._launch(gemv_kernel(fmt, ISA), x, pw, None, want, 2)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
        _same_pattern(out, F.linear(x.double(), gops.dequantize_packed(pw).double()).float())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_packed_propagates_nan_and_inf_like_f_linear(fmt, dtype) -> None:
    """The general path and the settled route (float32 and bf16 activations, bias, one and three
    rows) give NaN and infinities where F.linear on the dequantized weight does."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 512, generator=g) * 0.1
    pw = _pack(fmt, w)
    bias = torch.randn(300, generator=g)
    wd = gops.dequantize_packed(pw).double()
    for rows in (1, 3):
        good = torch.randn(rows, 512, generator=g).to(dtype)
        for _ in range(3):  # settle a route for this shape
            gops.gemv_packed(good, pw, bias)
        assert pw.routes.get(True) is not None
        for kind in ("nan", "inf", "-inf"):
            x = _activations(rows, 512, kind, g).to(dtype)
            out = gops.gemv_packed(x, pw, bias)
            ref = F.linear(x.double(), wd, bias.double()).to(dtype)
            _same_pattern(out.float(), ref.float())
            assert not bool(out[: rows - 1].isnan().any())  # other rows untouched by it


def test_captured_quantized_linear_propagates_nan() -> None:
    """Graph capture's native tier runs the float kernel for a replay whose activations hold NaN."""
    g = torch.Generator().manual_seed(5)
    w = NVFP4Tensor.from_float(torch.randn(64, 256, generator=g) * 0.1)
    x = torch.randn(1, 256, generator=g)
    gr = Graph()
    with torch.no_grad(), gr:
        y = F.linear(x, w)
    assert gr.tier == "native"
    assert f"s_ == {NONFINITE_STATUS}" in gr.source  # (an int8-activation plan: the twin call)
    finite = y.clone()
    x[0, 5] = float("nan")
    gr.replay()
    assert bool(y.isnan().all())
    x[0, 5] = 0.5
    gr.replay()
    assert bool(y.isfinite().all()) and not torch.equal(y, finite)


def _with_code(w: torch.Tensor, row: int, col: int, code: int) -> torch.Tensor:
    w.view(torch.uint8)[row, col] = code
    return w


@pytest.mark.parametrize(
    ("dtype", "code"),
    [
        (torch.float8_e4m3fn, 0x7F),
        (torch.float8_e4m3fn, 0xFF),
        (torch.float8_e5m2, 0x7C),
        (torch.float8_e5m2, 0xFD),
    ],
)
@pytest.mark.parametrize("col", [5, 68], ids=["vector", "tail"])
def test_fp8_nan_and_inf_weight_codes_decode_as_torch(dtype, code, col) -> None:
    """E4M3's NaN codes (0x7F/0xFF) and E5M2's infinity/NaN codes in a raw float8 weight give the
    NaN and infinities torch's cast gives them, in the register decode (col 5) and in the K % 32
    tail's table decode (col 68); E4M3 0x7F read as 480 (vector) or 0 (tail) before."""
    from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
    from torchport.lowp import Float8Tensor

    g = torch.Generator().manual_seed(col + code)
    w = Float8Tensor.from_float(torch.randn(6, 70, generator=g), dtype, "row")
    _with_code(w.qdata, 2, col, code)
    pw = w.gemv_pack()
    kernels = [gemv_kernel(pw.fmt, ISA)]
    if pw.fmt == "fp8_e4m3":
        kernels.append(gemv_fp8_shift_kernel(ISA, 2048))
    x = torch.randn(2, 70, generator=g).abs()  # one sign: an infinity stays one
    ref = F.linear(x.double(), w.dequantize().double()).float()
    assert not bool(ref[:, 2].isfinite().any()) and bool(ref[:, [0, 1, 3]].isfinite().all())
    for kern in kernels:
        out = torch.empty(2, 6)
        gops._launch(kern, x, pw, None, out, 1)
        _same_pattern(out, ref)
    # the pack's NaN row scale is its own: the tensor's scale and dequantize keep their values
    assert bool(w.scale.isfinite().all())
    assert int(w.dequantize().isnan().sum()) == int(code in (0x7F, 0xFF, 0xFD))


@pytest.mark.parametrize("elem", ["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"])
def test_mx_nan_scale_code_gives_nan(elem) -> None:
    """The E8M0 NaN code 0xFF gives NaN (torch's e8m0 cast), not the infinity its exponent bits
    spell, whose products with same-signed weights stayed infinite."""
    w = MXTensor.from_float(torch.full((3, 64), 0.5), elem)
    w.scale.view(torch.uint8)[1, 1] = 0xFF
    pw = w.gemv_pack()
    x = torch.ones(1, 64)
    out = torch.empty(1, 3)
    gops._launch(gemv_kernel(pw.fmt, ISA), x, pw, None, out, 1)
    assert bool(out[0, 1].isnan()) and bool(out[0, [0, 2]].isfinite().all())
    assert bool(w.dequantize()[1, 32:].isnan().all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_nan_scale_code_takes_the_float_kernel(fmt) -> None:
    """A block scale holding its NaN code (E4M3 0x7F, E8M0 0xFF) gives the row NaN as torch's
    dequantized F.linear: the int8-activation kernels' register decodes read it as 480 or as
    infinity (NVFP4's row came out finite), so such a pack leaves them to the float kernel."""
    from torchport.gemv import gemv

    g = torch.Generator().manual_seed(8)
    w = _pack(fmt, torch.randn(4, 256, generator=g))  # (a clean weight keeps the int8 kernels)
    assert w.int8
    t = (NVFP4Tensor if fmt == "nvfp4" else MXTensor).from_float(torch.randn(4, 256, generator=g))
    t.scale.view(torch.uint8)[1, 3] = 0x7F if fmt == "nvfp4" else 0xFF
    assert not t.gemv_pack().int8
    x = torch.randn(2, 256, generator=g)
    out = gemv(x, t)
    assert bool(out[:, 1].isnan().all()) and bool(out[:, [0, 2, 3]].isfinite().all())
    assert torch.equal(out.isnan(), F.linear(x, t.dequantize()).isnan())


@pytest.mark.parametrize("huge", [False, True], ids=["plain", "hugepages"])
def test_mxfp8_e4m3_nan_element_code_gives_its_row_nan(huge, monkeypatch) -> None:
    """An MX E4M3 element holding 0x7F gives its row NaN as torch's dequantized F.linear (the
    float kernel's register decode read 480): the pack's own copy of the scales gets the E8M0 NaN
    code for that block; the tensor's scales and dequantize keep theirs, also where the pack moves
    to huge pages (which rebinds qdata and scale to the moved buffers of the pack's own)."""
    from torchport.gemv import gemv
    from torchport.gemv.hugepages import HUGE
    from torchport.lowp import tensors

    if huge:
        monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", 256)

    g = torch.Generator().manual_seed(9)
    t = MXTensor.from_float(torch.randn(4, 128, generator=g), "fp8_e4m3")
    t.qdata.view(torch.uint8)[2, 70] = 0x7F
    own = t.scale.clone()
    x = torch.randn(1, 128, generator=g)
    out = gemv(x, t)
    assert bool(out[0, 2].isnan()) and bool(out[0, [0, 1, 3]].isfinite().all())
    assert torch.equal(t.scale.view(torch.uint8), own.view(torch.uint8))
    assert int(t.dequantize().isnan().sum()) == 1
    ptr = t.gemv_pack().data.data_ptr()
    assert t.qdata.data_ptr() == ptr and (ptr % HUGE == 0) is huge  # (the codes: rebound)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_nan_scale_code_survives_the_custom_op_and_capture(fmt) -> None:
    """The pack's ``int8`` flag (False for a NaN block scale) reaches the kernel choice where the
    pack is rebuilt from its parts: the custom op (an eager ``gemv`` whose x requires grad) and a
    captured graph's native tier. Both built the pack with int8 on, and NVFP4's int8 kernels read
    E4M3 0x7F as 480: a finite row where torch gives NaN."""
    from torchport.gemv import gemv

    g = torch.Generator().manual_seed(8)
    t = (NVFP4Tensor if fmt == "nvfp4" else MXTensor).from_float(torch.randn(4, 256, generator=g))
    t.scale.view(torch.uint8)[1, 3] = 0x7F if fmt == "nvfp4" else 0xFF
    x = torch.randn(2, 256, generator=g)
    nan = F.linear(x, t.dequantize()).isnan()
    assert bool(nan[:, 1].all())
    assert torch.equal(gemv(x.clone().requires_grad_(), t).isnan(), nan)
    gr = Graph()
    with torch.no_grad(), gr:
        y = F.linear(x, t)
    assert gr.tier == "native"
    gr.replay()
    assert torch.equal(y.isnan(), nan)


def test_fp4_activations_meet_a_nan_block_scale_as_torch() -> None:
    """FP4 weights with FP4 activations (the pair-split integer kernel) and a block scale holding
    E4M3's NaN code: the row is NaN as torch's dequantized F.linear; the kernel's scale decode read
    0x7F as 480 (a finite row), so such a pack takes the float path."""
    g = torch.Generator().manual_seed(8)
    t = NVFP4Tensor.from_float(torch.randn(4, 256, generator=g), act_per_tensor_scale=True)
    t.scale.view(torch.uint8)[1, 3] = 0x7F
    x = torch.randn(1, 256, generator=g)
    out = F.linear(x, t)
    assert bool(out[0, 1].isnan()) and bool(out[0, [0, 2, 3]].isfinite().all())
