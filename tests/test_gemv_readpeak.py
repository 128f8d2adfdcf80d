"""The native read-bandwidth probe: its checksum equals the plain-torch byte sum, bit for bit."""

from __future__ import annotations

import pytest
import torch

from torchport import native
from torchport.gemv.hugepages import hugepage_empty
from torchport.gemv.readpeak import (
    READ_CONFIGS,
    ReadConfig,
    read_checksum,
    read_checksum_reference,
    read_launcher,
    read_peak_kernel,
)

CONFIGS = [*READ_CONFIGS, ReadConfig(prefetch=64, hint="T1", streams=3)]
SIZES = [0, 1, 31, 32, 33, 255, 256, 257, 4095, 4096 * 3 + 17, (1 << 20) + 5]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_checksum_matches_reference(cfg: ReadConfig, n: int, nthreads: int) -> None:
    buf = _bytes(n, n)
    assert read_checksum(buf, nthreads, cfg) == read_checksum_reference(buf)


@pytest.mark.parametrize("offset", [1, 7, 31, 33])
def test_unaligned_start(offset: int) -> None:
    base = _bytes(70000 + offset, offset)
    buf = base[offset:]  # a view starting off any 32-byte boundary
    for cfg in CONFIGS:
        assert read_checksum(buf, 2, cfg) == read_checksum_reference(buf)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn], ids=str
)
def test_other_dtypes_and_shapes(dtype: torch.dtype) -> None:
    t = torch.randn(37, 129).to(dtype)
    assert read_checksum(t) == read_checksum_reference(t)


def test_all_ones_sum_is_length() -> None:
    buf = torch.full((3 << 20,), 255, dtype=torch.uint8)
    assert read_checksum(buf, 2, READ_CONFIGS[-1]) == 255 * (3 << 20)


def test_hugepage_buffer_and_launcher() -> None:
    buf = hugepage_empty((5 << 20,), torch.uint8)
    buf.copy_(_bytes(5 << 20, 3))
    ref = read_checksum_reference(buf)
    for cfg in CONFIGS:
        go = read_launcher(buf, 0, cfg)
        assert go() == ref and go() == ref


def test_scalar_isa_and_avx512_compile() -> None:
    buf = _bytes(10007, 9)
    kern = read_peak_kernel("scalar", READ_CONFIGS[-1])
    out = torch.zeros(1, dtype=torch.int64)
    kern(buf, buf.numel(), out, 2)
    assert int(out) == read_checksum_reference(buf)
    read_peak_kernel("avx512", READ_CONFIGS[-1])  # builds (cannot run on every machine)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        read_checksum(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        read_checksum([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nthreads must be >= 0, got -1"):
        read_checksum(torch.zeros(8), -1)
    with pytest.raises(ValueError, match="multiple of 64, got 100"):
        ReadConfig(prefetch=100)
    with pytest.raises(ValueError, match="hint must be one of"):
        ReadConfig(hint="T3")
    with pytest.raises(ValueError, match=r"streams must be in \[1, 16\], got 0"):
        ReadConfig(streams=0)


@pytest.mark.skipif(native.cpu_info().isa == "scalar", reason="needs AVX2")
def test_forced_avx2_matches() -> None:
    buf = _bytes(123457, 5)
    kern = read_peak_kernel("avx2", READ_CONFIGS[1])
    out = torch.zeros(1, dtype=torch.int64)
    kern(buf, buf.numel(), out, 2)
    assert int(out) == read_checksum_reference(buf)
