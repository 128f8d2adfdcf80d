"""torchport.graphs.MemPool: size classes, placement, reuse, accounting, bounded reserve."""

from __future__ import annotations

import gc

import pytest
import torch

from torchport.graphs import MemPool, MemPoolError, round_size


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, 512),
        (1, 512),
        (512, 512),
        (513, 1024),
        ((1 << 20) - 1, 1 << 20),
        (1 << 20, 1 << 20),
        ((1 << 20) + 1, (1 << 20) + (1 << 18)),
        (3 << 20, 3 << 20),
        ((7 << 20) + 5, 8 << 20),
    ],
)
def test_round_size_table(n: int, want: int) -> None:
    assert round_size(n) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (1,), (13, 7), (3, 1 << 18)], ids=str)
def test_empty_gives_usable_tensors(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    pool = MemPool()
    t = pool.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    t.fill_(3)
    u = pool.empty(shape, dtype)
    u.fill_(5)
    assert bool((t == 3).all()) and bool((u == 5).all())
    if t.numel():
        assert t.data_ptr() != u.data_ptr()


def test_blocks_return_when_last_view_dies_and_are_reused() -> None:
    pool = MemPool()
    t = pool.empty((256,), torch.float32)
    v = t[10:]
    addr = t.data_ptr()
    del t
    gc.collect()
    assert pool.stats().allocated == 1024  # the view keeps the block
    del v
    gc.collect()
    s = pool.stats()
    assert s.allocated == 0 and s.reserved == 2 << 20 and s.peak_allocated == 1024
    assert pool.empty((256,), torch.float32).data_ptr() == addr


def test_free_blocks_coalesce() -> None:
    pool = MemPool()
    a, b, c = (pool.empty((1 << 16,), torch.uint8) for _ in range(3))
    base = a.data_ptr()
    del a, b
    gc.collect()
    big = pool.empty((1 << 17,), torch.uint8)
    assert big.data_ptr() == base
    assert pool.stats().heaps == 1
    del c


def test_varying_sizes_keep_reserved_bounded() -> None:
    pool = MemPool()
    peak_live = 0
    for step in range(40):
        n = 1 + (step * 37) % 29
        ts = [pool.empty((n * 4096 + 17 * k,), torch.float32) for k in range(6)]
        peak_live = max(peak_live, pool.stats().allocated)
        del ts
    s = pool.stats()
    assert s.allocated == 0
    assert s.peak_reserved <= 2 * peak_live + (2 << 20)
    pool.empty_cache()
    assert pool.stats().reserved == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((-1, 3), torch.float32), r"sizes must be >= 0, got \(-1, 3\)"),
        (((3,), "float"), "dtype must be a torch.dtype"),
    ],
)
def test_bad_requests(args, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MemPoolError, match=match):
        MemPool().empty(*args)


def test_bad_construction_and_negative_round() -> None:
    with pytest.raises(
        MemPoolError, match="heap_bytes must be a positive multiple of 512, got 100"
    ):
        MemPool(heap_bytes=100)
    with pytest.raises(MemPoolError, match="got -5"):
        round_size(-5)
