"""Value tables and reference-vs-native bit-exactness for FP8, E2M1, E8M0, NVFP4 and MX."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchport.lowp import NVFP4Tensor, formats, fp8, mx, nvfp4
from torchport.lowp.formats import LowPrecisionError, NonFiniteInputError

E2M1_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# --- E2M1 ------------------------------------------------------------------------------------------


def test_e2m1_every_value_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = formats.e2m1_to_f32(codes)
    assert vals[:8].tolist() == E2M1_MAG and vals[8:].abs().tolist() == E2M1_MAG
    assert torch.equal(formats.f32_to_e2m1(vals), codes)  # including -0.0 -> 0x8


@pytest.mark.parametrize(
    "x,code",
    [
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
        (0.2500001, 1),
        (5.0001, 7),
        (6.0, 7),
        (7.0, 7),
        (1e30, 7),
        (-0.75, 10),
        (-1e-30, 8),
        (0.1, 0),
    ],
    ids=lambda v: str(v),
)
def test_e2m1_ties_to_even_and_saturation(x, code):
    assert int(formats.f32_to_e2m1(torch.tensor([x]))[0]) == code


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = formats.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(formats.unpack_fp4(packed), codes)
    with pytest.raises(LowPrecisionError, match=r"must be even, got 3"):
        formats.pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))


def test_e8m0_table():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = formats.e8m0_to_f32(e)
    assert v[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(v[6])


# --- FP8 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_every_finite_value_is_fixed_point(dtype):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = b.view(dtype).float()
    v = v[torch.isfinite(v)]
    q, s = fp8.fp8_quantize(v.reshape(1, -1), dtype, "tensor")  # amax = max -> scale 1.0
    q2, _ = fp8.fp8_quantize_reference(v.reshape(1, -1), dtype, "tensor")
    assert float(s) == 1.0 and torch.equal(_u8(q), _u8(q2))
    assert torch.equal(fp8.fp8_dequantize(q, s).reshape(-1), v)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_fp8_native_matches_reference_on_bit_patterns(dtype, bits):
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).reshape(1, -1)
    for g in ("row", "tensor"):
        a, sa = fp8.fp8_quantize_reference(x, dtype, g)
        b, sb = fp8.fp8_quantize(x, dtype, g)
        assert torch.equal(_u8(a), _u8(b)) and torch.equal(sa, sb)


def test_fp8_saturates():
    x = torch.tensor([[1.0, 1e6, -1e6]])
    q, _ = fp8.fp8_quantize(x, torch.float8_e4m3fn, "tensor")
    assert q.float().abs().max() == 448.0 and torch.isfinite(q.float()).all()


# --- block formats: reference vs native over shapes -------------------------------------------


SHAPES = [(0, 64), (1, 32), (3, 96), (7, 160), (13, 1024)]


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[0] or 1)[: shape[0], None]
    if shape[0] > 2:
        x[1] = 0.0  # all-zero blocks
        x[2, :16] = 1e-40  # subnormal inputs
    return x.to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pts", [None, 1e-3], ids=["nopts", "pts"])
def test_nvfp4_native_bit_exact(shape, dtype, pts):
    x = _data(shape, dtype)
    qa, sa = nvfp4.nvfp4_quantize_reference(x, pts)
    qb, sb = nvfp4.nvfp4_quantize(x, pts)
    assert qa.shape == (shape[0], shape[1] // 2) and sa.shape == (shape[0], shape[1] // 16)
    assert torch.equal(qa, qb) and torch.equal(_u8(sa), _u8(sb))
    da = nvfp4.nvfp4_dequantize_reference(qa, sa, pts)
    assert torch.equal(da, nvfp4.nvfp4_dequantize(qa, sa, pts))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("elem", mx.ELEMS)
def test_mx_native_bit_exact(shape, dtype, elem):
    x = _data(shape, dtype, seed=1)
    qa, sa = mx.mx_quantize_reference(x, elem)
    qb, sb = mx.mx_quantize(x, elem)
    assert torch.equal(_u8(qa), _u8(qb)) and torch.equal(sa, sb)
    da = mx.mx_dequantize_reference(qa, sa, elem)
    assert torch.equal(da, mx.mx_dequantize(qa, sa, elem))


# odd block counts (NVFP4 pairs blocks in the vector path), FP8 rows not a multiple of 8 or 32
ISA_SHAPES = [(1, 16), (5, 48), (3, 96), (4, 1056)]


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_vector_and_scalar_paths_bit_exact(isa, dtype):
    from torchport import config

    with config.override(isa=isa):
        for i, shape in enumerate(ISA_SHAPES):
            x = _data(shape, dtype, seed=10 + i)
            for pts in (None, 1e-3):
                qa, sa = nvfp4.nvfp4_quantize_reference(x, pts)
                qb, sb = nvfp4.nvfp4_quantize(x, pts)
                assert torch.equal(qa, qb) and torch.equal(_u8(sa), _u8(sb)), (shape, pts)
            if shape[1] % 32 == 0:
                for elem in mx.ELEMS:
                    qa, sa = mx.mx_quantize_reference(x, elem)
                    qb, sb = mx.mx_quantize(x, elem)
                    assert torch.equal(_u8(qa), _u8(qb)) and torch.equal(sa, sb), (shape, elem)
        for k in (1, 7, 37, 100):
            x = (torch.randn(3, k) * torch.logspace(-8, 8, k)).to(dtype)
            for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
                for g in ("row", "tensor"):
                    qa, sa = fp8.fp8_quantize_reference(x, dt, g)
                    qb, sb = fp8.fp8_quantize(x, dt, g)
                    assert torch.equal(_u8(qa), _u8(qb)) and torch.equal(sa, sb), (k, dt, g)
        x = torch.ones(3, 64, dtype=dtype)
        x[2, 63] = float("inf")
        with pytest.raises(NonFiniteInputError, match=r"must be finite, found inf"):
            nvfp4.nvfp4_quantize(x)
        with pytest.raises(NonFiniteInputError, match=r"must be finite, found inf"):
            mx.mx_quantize(x, "fp4_e2m1")


@settings(max_examples=30, deadline=None)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=32))
def test_block_formats_on_random_bit_patterns(bits):
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x)).reshape(1, 32)
    for pts in (None, 0.5):
        qa, sa = nvfp4.nvfp4_quantize_reference(x, pts)
        qb, sb = nvfp4.nvfp4_quantize(x, pts)
        assert torch.equal(qa, qb) and torch.equal(_u8(sa), _u8(sb))
    for elem in mx.ELEMS:
        qa, sa = mx.mx_quantize_reference(x, elem)
        qb, sb = mx.mx_quantize(x, elem)
        assert torch.equal(_u8(qa), _u8(qb)) and torch.equal(sa, sb)


def test_nvfp4_recipe_values():
    # block amax 6 -> scale 1.0 exactly; the block's values are E2M1-representable -> exact
    row = torch.tensor([E2M1_MAG + [-v for v in E2M1_MAG]])
    q, s = nvfp4.nvfp4_quantize(row)
    assert s.float().tolist() == [[1.0]]
    assert torch.equal(nvfp4.nvfp4_dequantize(q, s), row)
    # all-zero block: scale clamps to 2**-6 (E4M3 tiny), data zero
    q, s = nvfp4.nvfp4_quantize(torch.zeros(1, 16))
    assert s.float().item() == 2.0**-6 and int(q.sum()) == 0


def test_mx_recipe_values():
    # amax 6 = 1.5 * 2**2 -> e8m0 scale exponent 2 - 2 = 0 -> biased 127; exact values
    row = torch.tensor([E2M1_MAG * 4])
    q, s = mx.mx_quantize(row, "fp4_e2m1")
    assert s.tolist() == [[127]] and torch.equal(mx.mx_dequantize(q, s), row)
    # amax 7 has the same floor exponent: 7 saturates to 6 (FLOOR mode)
    q, s = mx.mx_quantize(torch.full((1, 32), 7.0), "fp4_e2m1")
    assert mx.mx_dequantize(q, s).unique().tolist() == [6.0]
    q, s = mx.mx_quantize(torch.zeros(1, 32), "fp8_e4m3")
    assert s.tolist() == [[0]] and q.float().abs().sum() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("native_kernel", [False, True], ids=["ref", "native"])
def test_non_finite_inputs_raise(bad, native_kernel):
    x = torch.ones(2, 32)
    x[1, 5] = bad
    with pytest.raises(NonFiniteInputError, match=r"must be finite"):
        nvfp4.nvfp4_quantize(x, native_kernel=native_kernel)
    with pytest.raises(NonFiniteInputError, match=r"must be finite"):
        mx.mx_quantize(x, "fp8_e4m3", native_kernel=native_kernel)
    with pytest.raises(NonFiniteInputError, match=r"must be finite"):
        fp8.fp8_quantize(x, native_kernel=native_kernel)


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(LowPrecisionError, match=r"multiple of the block size 16.*got 24"):
        nvfp4.nvfp4_quantize(torch.ones(2, 24))
    with pytest.raises(LowPrecisionError, match=r"multiple of the block size 32.*got 48"):
        mx.mx_quantize(torch.ones(2, 48))
    with pytest.raises(LowPrecisionError, match=r"float32 or bfloat16, got torch.float64"):
        nvfp4.nvfp4_quantize(torch.ones(2, 16, dtype=torch.float64))
    with pytest.raises(LowPrecisionError, match=r"elem must be one of"):
        mx.mx_quantize(torch.ones(2, 32), "fp6")
    with pytest.raises(
        LowPrecisionError, match=r"per_tensor_scale must be a positive finite number .*, got -1"
    ):
        nvfp4.nvfp4_quantize(torch.ones(2, 16), -1.0)
    with pytest.raises(LowPrecisionError, match=r"granularity must be one of"):
        fp8.fp8_quantize(torch.ones(2, 16), torch.float8_e4m3fn, "block")
    with pytest.raises(LowPrecisionError, match=r"scales must have shape"):
        nvfp4.nvfp4_dequantize(
            torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
        )
    with pytest.raises(LowPrecisionError, match=r"input must be a torch.Tensor, got list"):
        nvfp4.nvfp4_quantize([1.0] * 16)  # type: ignore[arg-type]


@pytest.mark.parametrize("native_kernel", [False, True], ids=["ref", "native"])
def test_dequantize_checks_the_scale_dtype(native_kernel):
    # the native kernels read one byte per scale: float32/int32 scales were misread, not rejected
    x = torch.randn(4, 64)
    q, s = nvfp4.nvfp4_quantize(x)
    qm, sm = mx.mx_quantize(x)
    kw = {"native_kernel": native_kernel}
    for bad in (s.float(), s.float().bfloat16()):
        with pytest.raises(LowPrecisionError, match=rf"float8_e4m3fn .*got {bad.dtype}"):
            nvfp4.nvfp4_dequantize(q, bad, **kw)
    for bad in (torch.exp2(sm.float() - 127), sm.to(torch.int32)):
        with pytest.raises(LowPrecisionError, match=rf"E8M0 bytes .*got {bad.dtype}"):
            mx.mx_dequantize(qm, bad, **kw)
    ref = nvfp4.nvfp4_dequantize(q, s, **kw)  # the stored dtype and its raw bytes both serve
    assert torch.equal(nvfp4.nvfp4_dequantize(q, s.view(torch.uint8), **kw), ref)
    ref = mx.mx_dequantize(qm, sm, **kw)
    assert torch.equal(mx.mx_dequantize(qm, sm.view(torch.float8_e8m0fnu), **kw), ref)


@pytest.mark.parametrize("native_kernel", [False, True], ids=["ref", "native"])
def test_dequantize_reads_nan_and_inf_codes_as_torch(native_kernel):
    # the native kernel read an E4M3 scale 0x7F as 480 and E5M2 infinity/NaN codes as finite
    kw = {"native_kernel": native_kernel}
    q, s = nvfp4.nvfp4_quantize(torch.randn(2, 32))
    s = s.clone()
    s.view(torch.uint8)[1, 0] = 0x7F
    out = nvfp4.nvfp4_dequantize(q, s, **kw)
    assert bool(out[1, :16].isnan().all()) and bool(out[1, 16:].isfinite().all())
    for elem, codes, want in (
        ("fp8_e4m3", (0x7F, 0xFF), (math.nan, math.nan)),
        ("fp8_e5m2", (0x7C, 0xFC, 0x7E), (math.inf, -math.inf, math.nan)),
    ):
        qm, sm = mx.mx_quantize(torch.ones(1, 32), elem)
        qm = qm.clone()
        qm.view(torch.uint8)[0, : len(codes)] = torch.tensor(codes, dtype=torch.uint8)
        got = mx.mx_dequantize(qm, sm, elem, **kw)[0, : len(codes)]
        torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("isa", ["native", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_dequantize_is_bit_exact_for_every_code_nan_included(isa, dtype):
    """Every element code against every scale code (MX: E8M0 0xFF NaN; NVFP4: E4M3 0x7F/0xFF
    NaN, with a per-tensor scale, NaN too): the native kernel's bits are the reference's, NaN
    payloads and signs included. It returned C's NAN (0x7fc00000) for E4M3 and E8M0 NaN codes
    where torch's casts give 0x7ff00000 / 0xfff00000 (E4M3, the code's sign) and 0x7fc00001
    (E8M0), and a multiply of two NaNs kept the element's where torch keeps the scale's."""
    from torchport import config

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    nib = torch.arange(16, dtype=torch.uint8)
    fp4 = nib | (nib.flip(0) << 4)  # both nibbles through every E2M1 code
    view = torch.int32 if dtype == torch.float32 else torch.int16
    with config.override(**({} if isa == "native" else {"isa": isa})):
        for elem in mx.ELEMS:  # row r: scale code r; the row's elements hold every code
            fp4_elem = elem == "fp4_e2m1"  # (uint8 FP8 data: the codes as they are)
            q = (fp4.repeat(2) if fp4_elem else codes).expand(256, -1).contiguous()
            s = codes.reshape(256, 1).expand(256, 2 if fp4_elem else 8).contiguous()
            s = s.view(mx.mx_quantize(torch.ones(1, 32), elem)[1].dtype)
            ref = mx.mx_dequantize_reference(q, s, elem, dtype)
            got = mx.mx_dequantize(q, s, elem, dtype, native_kernel=True)
            assert torch.equal(got.view(view), ref.view(view)), elem
        s = codes.reshape(256, 1).expand(256, 2).contiguous().view(torch.float8_e4m3fn)
        q = fp4.expand(256, 16).contiguous()
        for pts in (None, 1e-3, float("nan")):
            ref = nvfp4.nvfp4_dequantize_reference(q, s, pts, dtype)
            got = nvfp4.nvfp4_dequantize(q, s, pts, dtype, native_kernel=True)
            assert torch.equal(got.view(view), ref.view(view)), pts


def test_missing_compiler_falls_back_to_reference(monkeypatch):
    from torchport import native
    from torchport.lowp import kernels
    from torchport.native import NativeFallbackWarning

    def broken(dtype):
        raise native.CompilerNotFoundError("no C compiler found (test)")

    monkeypatch.setattr(kernels, "library", broken)
    x = torch.randn(3, 32)
    with pytest.warns(NativeFallbackWarning, match="no C compiler found"):
        q, s = nvfp4.nvfp4_quantize(x)
    qr, sr = nvfp4.nvfp4_quantize_reference(x)
    assert torch.equal(q, qr) and torch.equal(_u8(s), _u8(sr))
    with pytest.raises(native.CompilerNotFoundError, match="no C compiler"):
        mx.mx_quantize(x, native_kernel=True)


def test_per_tensor_scale_types():
    import numpy as np

    x = torch.randn(2, 32)
    want = nvfp4.nvfp4_quantize(x, 0.5)
    for pts in (np.float32(0.5), np.float64(0.5), 0.5):  # any real number
        got = nvfp4.nvfp4_quantize(x, pts)  # type: ignore[arg-type]
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    for bad in (True, torch.tensor(0.5), "0.5"):  # True was taken as a scale of 1.0
        with pytest.raises(LowPrecisionError, match=r"per_tensor_scale must be a positive finite"):
            nvfp4.nvfp4_quantize(x, bad)  # type: ignore[arg-type]
    # finite as a Python float but not as the float32 the kernels use (inf or 0 there: every
    # weight came back NaN or zero)
    for bad in (1e39, 1e-50, 10**400, float("nan")):
        with pytest.raises(LowPrecisionError, match=r"per_tensor_scale must be a positive finite"):
            nvfp4.nvfp4_quantize(x, bad)  # type: ignore[arg-type]
        with pytest.raises(LowPrecisionError, match=r"nonzero and finite as float32"):
            NVFP4Tensor.from_float(x, per_tensor_scale=bad)
