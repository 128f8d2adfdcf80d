"""The shared-memory kernels' copies, one process: a read's modes against plain byte copies."""

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
