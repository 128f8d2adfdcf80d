"""The bf16-in, bf16-out GEMV entry (``tp_gemv_bf16io``) of every kernel family, and the settled
routes that take it for bf16 activations.

Each family's entry must give the bits of its float32 entry (``tp_gemv``) on the widened
activations followed by torch's cast to bf16: K tails, bias, one and two threads, several
activation rows, NaN and infinities among the activations, sums beyond bf16's range. A route may
take the entry only where torch's cast writes NaN as the entry does (0xffff).
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import pack
from torchport import config, native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import (
    amx_int8_ready,
    gemv_fp4_amx_kernel,
    gemv_fp4_block_kernel,
    gemv_fp4_pair_kernel,
    gemv_fp4_wblock_kernel,
)
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.kernels import NONFINITE_STATUS, GemvKernel, gemv_i8_kernel, gemv_kernel

ISA = native.cpu_info().isa
N = 37


def _kernel(family: str, fmt: str) -> GemvKernel:
    if family == "block":
        return gemv_fp4_block_kernel(fmt, ISA, 4096)
    if family == "wblock":
        if ISA != "avx512" or not native.cpu_info().has("avx512_vnni"):
            pytest.skip("the whole-block kernel needs AVX-512 VNNI")
        return gemv_fp4_wblock_kernel(fmt, ISA)
    if family == "amx":
        if not amx_int8_ready():
            pytest.skip("the AMX kernel needs AVX-512 VBMI and AMX-INT8")
        return gemv_fp4_amx_kernel(fmt)
    if family == "pair":
        return gemv_fp4_pair_kernel(fmt, ISA)
    if family == "i8":
        return gemv_i8_kernel(fmt, ISA)
    if family == "shift":
        return gemv_fp8_shift_kernel(ISA)
    return gemv_kernel(fmt, ISA)


# (family, weight format, K values): the lane-block and AMX kernels need K % 128 == 0, the
# whole-block kernel K % 256 == 0, the pair-split
# kernel K % 64 == 0, the int8 kernel K % 32 == 0
CASES = [
    ("block", "nvfp4", (128, 1280)),
    ("block", "mxfp4", (256, 10368)),  # (K blocks at one or two rows on AVX-512)
    ("wblock", "nvfp4", (256, 11008)),  # (K % 256 == 0)
    ("amx", "mxfp4", (128, 4224)),  # (K % 128 == 0)
    ("pair", "nvfp4", (64, 1024)),
    ("i8", "mxfp4", (32, 992)),
    ("shift", "fp8_e4m3", (40, 1000, 4096)),
    ("plain", "f32", (7, 1000)),
    ("plain", "bf16", (64, 1000)),
    ("plain", "nvfp4", (16, 1008)),
]


@pytest.mark.skipif(ISA == "scalar", reason="the pair/block/shift kernels need AVX2")
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize(("family", "fmt", "ks"), CASES)
def test_bf16io_entry_is_the_float_entry_then_torchs_cast(
    family: str, fmt: str, ks: tuple[int, ...], rows: int
) -> None:
    if not gops._cast_nan_is_ffff():
        pytest.skip("torch's CPU cast writes NaN as 0x7fc0 here (ATEN_CPU_CAPABILITY=default)")
    kern = _kernel(family, fmt)
    for k in ks:
        g = torch.Generator().manual_seed(rows * k + len(family))
        pw = pack(fmt, torch.randn(N, k, generator=g) * 0.1)
        x = torch.randn(rows, k, generator=g).bfloat16()  # row 0 finite throughout
        if rows > 1:
            x[1, 3] = float("nan")  # (int8-activation kernels hand it to the float kernel)
        if rows > 2:
            x[2, 5] = float("inf")
        if rows > 3:
            x[3, :] = 3e38  # sums beyond bf16's range (inf after the cast)
        bias = torch.randn(N, generator=g)
        for threads in (1, 2):
            for b in (None, bias):
                full = torch.empty(rows, N)
                gops._launch(kern, x.float(), pw, b, full, threads)
                out = torch.full((rows, N), 7.0, dtype=torch.bfloat16)
                raw = (x.data_ptr(), rows, k, pw.data.data_ptr(), pw.scales.data_ptr(),
                       pw.rowscale.data_ptr(), pw.pts, b.data_ptr() if b is not None else 0,
                       int(b is not None), out.data_ptr(), N, threads)  # fmt: skip
                st = kern.bf16io.raw_call(*raw)
                if st == NONFINITE_STATUS:  # an int8-activation kernel, non-finite activations
                    assert kern.twin_isa is not None and rows > 1
                    assert bool((out.float() == 7.0).all())  # nothing written
                    twin = kern.float_twin()
                    assert twin is not None
                    st = twin.bf16io.raw_call(*raw)
                assert st == 0
                want = full.bfloat16().view(torch.int16)
                assert torch.equal(out.view(torch.int16), want), (k, threads, b is None)
                assert bool(full[0].isfinite().all())  # (a row whose rounding is compared)


@pytest.mark.skipif(ISA == "scalar", reason="the lane-block kernel needs AVX2")
def test_bf16io_entry_rejects_what_the_float_entry_rejects() -> None:
    """A K off the lane-block kernel's multiple: the bf16 entry returns the float entry's status
    (2)."""
    kern = gemv_fp4_block_kernel("nvfp4", ISA, 4096)
    pw = pack("nvfp4", torch.randn(8, 256))
    x = torch.randn(1, 256).bfloat16()
    out = torch.empty(1, 8, dtype=torch.bfloat16)
    raw = (x, 1, 192, pw.data, pw.scales, pw.rowscale, pw.pts, torch.zeros(1), 0, out, 8, 1)
    with pytest.raises(RuntimeError, match="tp_gemv_bf16io returned error status 2"):
        kern.bf16io(*raw)
    with pytest.raises(RuntimeError, match="tp_gemv returned error status 2"):
        kern(x.float(), *raw[1:9], torch.empty(1, 8), 8, 1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "f32"])
def test_settled_route_with_bf16_activations_takes_the_bf16_entry(
    fmt: str, fresh_cache: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 activations on a native plan of any family: the settled route calls the kernel's bf16
    entry (where torch's cast agrees on NaN) and returns the bits of the first, general call
    (float32 kernel call, then a cast); a non-contiguous activation is served the same."""
    g = torch.Generator().manual_seed(len(fmt))
    w = torch.randn(700, 640, generator=g) * 0.1
    x = torch.randn(1, 640, generator=g).bfloat16()
    # a native plan (f32: ATen can win), tuned into this test's own choice cache and plan memo
    # (neither key holds the allowed backends)
    monkeypatch.setattr(gops, "_PLANS", {})
    with config.override(max_autotune_gemm_backends="NATIVE"):
        pw = pack(fmt, w)
        first = gops.gemv_packed(x, pw)
    assert first.dtype == torch.bfloat16 and bool(first.isfinite().all())
    for _ in range(3):  # settles the route, then serves it
        out = gops.gemv_packed(x, pw)
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    route = pw.routes.get(True)
    if route is None:
        pytest.skip("no settled route (an ATen plan or native kernels off)")
    assert route.run.bf16io is gops._cast_nan_is_ffff()
    # other activations through the settled route against a weight that has no route (its first
    # call takes the general path: float32 kernel call, then torch's cast); one of them
    # non-contiguous, one with a NaN
    fresh = pack(fmt, w)
    xt = torch.randn(640, 1, generator=g).bfloat16().t()
    xn = torch.randn(1, 640, generator=g).bfloat16()
    xn[0, 9] = float("nan")
    for xs in (xt, xn):
        fresh.routes.clear()
        want = gops.gemv_packed(xs, fresh)
        assert not fresh.routes.get(True)
        got = gops.gemv_packed(xs, pw)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert bool(got.isnan().all())
