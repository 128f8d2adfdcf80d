"""The shared-memory kernels, one process: a read's modes against plain byte copies, and
alltoall's one-call size exchange driven from one thread per rank against the expected bytes."""

from __future__ import annotations

import ctypes

import pytest
import torch

from torchport.distributed.shm_kernels import shm_lib
from torchport.distributed.transport_shm import COPY, FOLD, STREAM

GUARD = 256  # bytes around the destination that no copy may touch


def _apply(src: torch.Tensor, dst: torch.Tensor, at: int, n: int, mode: int) -> int:
    """One read of ``n`` bytes from ``src`` into ``dst`` at byte ``at``; the kernel's status."""
    bases = (ctypes.c_int64 * 1)(src.data_ptr())
    reads = (ctypes.c_int64 * 5)(0, 0, dst.data_ptr() + at, n, mode)
    return int(shm_lib().apply(bases, reads, 1, 0, 0))


@pytest.mark.parametrize("mode", [COPY, STREAM])
@pytest.mark.parametrize("n", [1, 63, 4095, 4096, 4097, 4096 + 127, 4096 + 128, 65536 + 33])
@pytest.mark.parametrize("at", [0, 1, 31, 32, 63])
def test_a_copy_writes_exactly_its_bytes(mode: int, n: int, at: int) -> None:
    # the streaming copy aligns its destination to 64 bytes with a head, streams whole 128-byte
    # blocks and copies the tail: every split of head, body and tail, against a plain copy
    g = torch.Generator().manual_seed(n * 64 + at)
    src = torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=g)[1:]  # unaligned too
    dst = torch.full((GUARD + n + GUARD + 64,), 0xA5, dtype=torch.uint8)
    base = GUARD + (-(dst.data_ptr() + GUARD) % 64) + at  # ``at`` bytes past a 64-byte line
    assert _apply(src, dst, base, n, mode) == 0
    assert torch.equal(dst[base : base + n], src)
    assert bool((dst[:base] == 0xA5).all()) and bool((dst[base + n :] == 0xA5).all())


def test_a_fold_and_an_unknown_mode() -> None:
    x = torch.arange(2048, dtype=torch.float32)
    y = torch.ones(2048, dtype=torch.float32)
    assert _apply(x, y, 0, x.nbytes, FOLD) == 0
    assert torch.equal(y, torch.arange(2048, dtype=torch.float32) + 1)
    before = y.clone()
    assert _apply(x, y, 0, x.nbytes, 3) == -1  # neither a copy nor a fold: refused
    assert torch.equal(y, before)


def test_a_step_under_a_timeout_of_centuries_waits_for_its_peer() -> None:
    """A group timeout past int64 nanoseconds (317 years) is a long wait, not a struct.error
    from the packed argument block (nor an instant timeout, as the wrapped ctypes value was)."""
    import os
    import threading
    import time

    from torchport.distributed.transport_shm import SHM_DIR, ShmArena

    path = os.path.join(SHM_DIR, f"torchport-test-{os.getpid()}-centuries")
    a = ShmArena(path, 2, 0, 8192, create=True)
    b = ShmArena(path, 2, 1, 8192, create=False)
    os.unlink(path)
    errors: list[BaseException] = []

    def late() -> None:
        time.sleep(0.2)
        try:
            b.step(1, (1, 1, 0, 0), [], [], 0, 0, 5.0)
        except BaseException as e:  # (reported below)
            errors.append(e)

    t = threading.Thread(target=late)
    t.start()
    t0 = time.monotonic()
    try:
        a.step(1, (1, 1, 0, 0), [], [], 0, 0, 1.0e10)
    finally:
        t.join(10)
        a.close()
        b.close()
    assert not errors
    assert time.monotonic() - t0 >= 0.15


def _alltoall_first_step(
    world: int,
    slot: int,
    sizes: list[list[int]],
    mode: int = COPY,
    expect: list[list[int]] | None = None,
) -> tuple[list[tuple[int, ...] | None], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Every rank's ``ShmArena.alltoall_sizes`` (one thread and mapping per rank; ``sizes[q][d]``
    bytes from rank q to rank d, which expects ``expect[q][d]``, by default the same), then a
    barrier step. Returns each rank's result (None: done; else the size matrix), inputs and
    outputs."""
    import os
    import threading

    from torchport.distributed.transport_shm import SHM_DIR, ShmArena

    path = os.path.join(SHM_DIR, f"torchport-test-{os.getpid()}-a2a{world}")
    arenas = [ShmArena(path, world, 0, slot, create=True)]
    arenas += [ShmArena(path, world, r, slot, create=False) for r in range(1, world)]
    os.unlink(path)
    g = torch.Generator().manual_seed(world * 1000 + slot)
    ins = [
        [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in row] for row in sizes
    ]
    want = sizes if expect is None else expect
    outs = [
        [torch.zeros(want[q][d], dtype=torch.uint8) for q in range(world)] for d in range(world)
    ]
    got: list[tuple[int, ...] | None] = [() for _ in range(world)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            got[r] = arenas[r].alltoall_sizes(
                1,
                (7, 9, 16 * world, 0),
                sizes[r],
                [want[q][r] for q in range(world)],
                [t.data_ptr() if t.numel() else 0 for t in ins[r]],
                [t.data_ptr() if t.numel() else 0 for t in outs[r]],
                0,
                mode,
                30.0,
            )
            arenas[r].step(2, (8, 1, 0, 0), [], [], 0, 0, 30.0)
        except BaseException as e:  # (reported by the caller)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        for a in arenas:
            a.close()
    return got, ins, outs


@pytest.mark.parametrize(
    "world,pattern",
    [(1, "even"), (1, "zero"), (2, "even"), (3, "uneven"), (4, "uneven"), (3, "stream")],
)
def test_alltoall_size_exchange_moves_every_piece_that_fits_one_step(
    world: int, pattern: str
) -> None:
    sizes = [
        [
            {"even": 100, "zero": 0, "uneven": ((q + 2 * d) % 3) * 37, "stream": 5000 + 64 * q + d}[
                pattern
            ]
            for d in range(world)
        ]
        for q in range(world)
    ]
    got, ins, outs = _alltoall_first_step(
        world, 1 << 16, sizes, STREAM if pattern == "stream" else COPY
    )
    assert got == [None] * world
    for d in range(world):
        for q in range(world):
            assert torch.equal(outs[d][q], ins[q][d]), (q, d)


def test_alltoall_size_exchange_leaves_long_pieces_and_mismatches_to_the_caller() -> None:
    # rank 0's pieces do not fit its slot beside its sizes: every rank gets the same matrix
    long = [[3000 if q == 0 else 10 for _ in range(3)] for q in range(3)]
    got, _ins, outs = _alltoall_first_step(3, 4096, long)
    assert all(m is not None for m in got) and len(set(got)) == 1
    assert list(got[0] or ())[:3] == [3000, 3000, 3000]  # rank 0's sends, then its receives
    assert all(int(o.sum()) == 0 for row in outs for o in row)  # nothing copied yet


def test_alltoall_size_exchange_shows_every_rank_the_same_disagreeing_matrix() -> None:
    sizes = [[10] * 3 for _ in range(3)]
    expect = [[11 if (q, d) == (0, 2) else 10 for d in range(3)] for q in range(3)]
    got, _ins, outs = _alltoall_first_step(3, 4096, sizes, expect=expect)
    assert all(m is not None for m in got) and len(set(got)) == 1
    m = list(got[0] or ())
    assert m[2] == 10 and m[2 * 3 * 2 + 3 + 0] == 11  # rank 0 sends 10 to 2, which expects 11
    assert all(int(o.sum()) == 0 for row in outs for o in row)
