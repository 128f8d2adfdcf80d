"""Low-precision fixes from the review of session 51.

- NaN codes in MX and NVFP4 weights packed per call: ``torch.compile`` traces a quantized
  weight's GEMV pack without scanning it (traced tensors have no bytes to read), and the
  ``torchport::gemv_packed`` custom op scanned only FP8 (E4M3) packs when it ran. So a compiled
  ``F.linear`` with an MXFP8 E4M3 weight holding an E4M3 NaN code (0x7F/0xFF) gave finite
  outputs (the float kernel's register decode reads the codes as ±480; eager and torch give NaN),
  a compiled MXFP4 one with an E8M0 NaN scale (0xFF) lost NaNs on some activation rows (the
  int8-activation kernel reads the scale as an infinite exponent shift), and a compiled
  ``torchport.gemv.gemv`` with an NVFP4 weight holding an E4M3 NaN block scale gave finite
  outputs (the int8 kernel reads 0x7F as 480). The op now gives an MXFP8 E4M3 pack's blocks with
  a NaN code the E8M0 NaN scale, and keeps the float kernel for NaN block scales
  (:mod:`torchport.gemv.nancodes`, the scans remembered per weight memory while they find none).
  E2M1 has no NaN code; E5M2's NaN codes are decoded as NaN by the kernels already.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport import config
from torchport.gemv.nancodes import (
    e4m3_nan_blocks,
    e4m3_nan_blocks_reference,
    e8m0_nan_reference,
    mx_nan_scales,
    nan_block_scales,
)
from torchport.lowp import MXTensor, NVFP4Tensor, mx, nvfp4

N, K = 8, 64


def _same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit for bit, NaN where the other has NaN."""
    return bool(((out == ref) | (out.isnan() & ref.isnan())).all())


def _mx_weight(elem: str, codes: dict[tuple[int, int], int], scales: dict[tuple[int, int], int]):
    """A fresh MX weight ``[N, K]`` with the given element bytes and E8M0 scale bytes set."""
    g = torch.Generator().manual_seed(3)
    w = MXTensor.from_float(torch.randn(N, K, generator=g), elem)
    q = w.qdata.view(torch.uint8).clone()
    s = w.scale.clone()
    for (r, c), v in codes.items():
        q[r, c] = v
    for (r, b), v in scales.items():
        s[r, b] = v
    q = q if elem == "fp4_e2m1" else q.view(mx._FP8[elem])
    return MXTensor(q, s, elem, torch.float32)


def _nvfp4_weight(scales: dict[tuple[int, int], int]) -> NVFP4Tensor:
    g = torch.Generator().manual_seed(4)
    w = NVFP4Tensor.from_float(torch.randn(N, K, generator=g))
    s = w.scale.view(torch.uint8).clone()
    for (r, b), v in scales.items():
        s[r, b] = v
    return NVFP4Tensor(w.qdata.clone(), s.view(w.scale.dtype), w.per_tensor_scale, torch.float32)


def _reference(x: torch.Tensor, w: MXTensor | NVFP4Tensor) -> torch.Tensor:
    """torch's semantics: the weight dequantized by torch's casts, then ``F.linear``."""
    if isinstance(w, NVFP4Tensor):
        return F.linear(x, nvfp4.nvfp4_dequantize_reference(w.qdata, w.scale, w.per_tensor_scale))
    return F.linear(x, mx.mx_dequantize_reference(w.qdata, w.scale, w.elem))


# (id, weight maker, output columns NaN for every activation row)
CASES = [
    (
        "mxfp8_e4m3-code-7f-ff",
        lambda: _mx_weight("fp8_e4m3", {(2, 5): 0x7F, (5, 40): 0xFF}, {}),
        [2, 5],
    ),
    ("mxfp8_e4m3-scale-ff", lambda: _mx_weight("fp8_e4m3", {}, {(3, 1): 0xFF}), [3]),
    ("mxfp4-scale-ff", lambda: _mx_weight("fp4_e2m1", {}, {(3, 1): 0xFF}), [3]),
    ("mxfp8_e5m2-code-7d", lambda: _mx_weight("fp8_e5m2", {(6, 9): 0x7D}, {}), [6]),
    ("nvfp4-scale-7f", lambda: _nvfp4_weight({(1, 2): 0x7F}), [1]),
]


def _nan_columns(out: torch.Tensor) -> list[int]:
    return sorted({int(c) for c in out.isnan().nonzero()[:, -1]})


# --- the scans ------------------------------------------------------------------------------------


def test_e4m3_nan_blocks_matches_its_reference_for_every_code() -> None:
    """Each of the 256 E4M3 bytes alone in a block of 32 (K = 96, three blocks per row)."""
    codes = torch.zeros(256, 96, dtype=torch.uint8)
    codes[:, 45] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # block 1
    want = e4m3_nan_blocks_reference(codes, 32)
    assert want.shape == (256, 3) and int(want.sum()) == 2 and bool(want[[0x7F, 0xFF], 1].all())
    assert torch.equal(e4m3_nan_blocks(codes, 32), want)


def test_nan_block_scales_finds_exactly_the_nan_codes() -> None:
    """E8M0 scales: only 0xFF (torch's cast); E4M3 scales: only 0x7F and 0xFF."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(e8m0_nan_reference(every).nonzero().flatten(), torch.tensor([0xFF]))
    for code in range(256):
        s = torch.full((2, 4), 0x7E, dtype=torch.uint8)  # (fresh storage: no remembered scan)
        s[1, 3] = code
        assert nan_block_scales(s, "mxfp4") is (code == 0xFF)
        assert nan_block_scales(s, "nvfp4") is (code in (0x7F, 0xFF))


def test_mx_nan_scales_leaves_the_callers_scales_alone() -> None:
    """The NaN scales are a new tensor; clean codes give the scales themselves."""
    codes = torch.zeros(2, 64, dtype=torch.uint8)
    scales = torch.full((2, 2), 127, dtype=torch.uint8)
    assert mx_nan_scales(codes, scales, 32) is scales
    codes[1, 33] = 0xFF
    out = mx_nan_scales(codes, scales, 32)
    assert out is not scales and bool((scales == 127).all())
    assert out.tolist() == [[127, 127], [127, 255]]


# --- the custom op and compiled calls --------------------------------------------------------------


@pytest.mark.parametrize("make, cols", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gemv_packed_op_scans_an_unscanned_pack(make, cols) -> None:
    """The op called with a weight's raw parts (what a traced pack passes it): NaN outputs
    where torch's are, the same bits as eager ``F.linear`` with the weight."""
    w = make()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    ref = _reference(x, w)
    assert _nan_columns(ref) == cols
    pts, fmt = 1.0, {"fp8_e4m3": "mxfp8_e4m3", "fp4_e2m1": "mxfp4", "fp8_e5m2": "mxfp8_e5m2"}
    if isinstance(w, NVFP4Tensor):
        pts, f = float(w.per_tensor_scale or 1.0), "nvfp4"
    else:
        f = fmt[w.elem]
    empty = torch.empty(0)
    with torch.no_grad(), config.override(gemv_fp4_int8=True):
        out = torch.ops.torchport.gemv_packed(
            x, w.qdata.view(torch.uint8), w.scale.view(torch.uint8), empty, pts, f, N, K, None, True
        )
        eager = F.linear(x, w)
    assert _nan_columns(out) == cols and bool(out.isnan()[:, cols].all())
    assert _same(out, eager)


COMPILED = [c for c in CASES if c[0] != "mxfp8_e5m2-code-7d"]


@pytest.mark.parametrize("make, cols", [c[1:] for c in COMPILED], ids=[c[0] for c in COMPILED])
def test_compiled_quantized_linear_gives_eagers_nans(make, cols) -> None:
    """``torch.compile`` of ``F.linear`` with MX weights (a traced pack: the op) and of
    ``torchport.gemv.gemv`` with an NVFP4 weight (F.linear's NVFP4 path is its own op, which
    scans a cached pack): the bits of the eager call."""
    torch._dynamo.reset()
    w = make()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))

    def fn(x: torch.Tensor) -> torch.Tensor:
        if isinstance(w, NVFP4Tensor):
            return torchport.gemv.gemv(x, w)
        return F.linear(x, w)

    with torch.no_grad(), config.override(gemv_fp4_int8=True):
        eager = fn(x)
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert _nan_columns(eager) == cols
    assert _same(out, eager)
    torch._dynamo.reset()
