"""Cold tuning of a new GEMM shape: compiler calls per tune and the argument copies made while the
compilers run (``torchport.gemm.mm._choose``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import torchport.gemm as G
from torchport import autotune, native
from torchport.gemm.epilogue import Scale
from torchport.gemm.kernels import mm_reference

mm_mod = sys.modules["torchport.gemm.mm"]


def _native_tiles(m: int, n: int, k: int, elem_size: int = 4) -> set[tuple[int, int, int]]:
    cands = G.candidates(m, n, k, native.cpu_info().isa, elem_size)
    return {
        (int(c.param("mr")), int(c.param("nr")), int(c.param("dp", 0)))
        for c in cands
        if not c.is_anchor
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cold_tune_compiles_at_most_one_library_per_tile(fresh_cache, monkeypatch, dtype):
    """A new shape with a new epilogue compiles one library per distinct tile of its native
    candidates plus at most the pack kernels (B's width and, for bf16 pair-dot tiles, the
    32-bit one) and the epilogue pass, and no more on its next calls; every candidate is timed
    against ATen. (The bound was one pack kernel, and counted bf16's candidates as fp32 ones:
    run alone, as in a fresh process, bf16 built both pack kernels and failed; in the suite an
    earlier test had built the 32-bit one.)"""
    if native.cpu_info().isa == "scalar":
        pytest.skip("needs an x86 vector ISA")
    made: list[str] = []
    rotation = mm_mod._Rotation

    class Counted(rotation):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(mm_mod, "_Rotation", Counted)
    m, n, k = 1, 72, 40  # a shape and scale no other test builds
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    step = Scale(1.0 + 1.0 / 977.0)  # the scale's value is part of the source: a new library
    native.reset_stats()
    tuned = autotune.stats.tuned
    y = G.mm(a, b, epilogue=[step])
    compiles = native.stats().compiles
    tiles = _native_tiles(m, n, k, a.element_size())
    packs = 1 + (a.element_size() == 2 and any(dp for _, _, dp in tiles))
    assert autotune.stats.tuned == tuned + 1
    assert 1 <= compiles <= len(tiles) + packs + 1, (compiles, tiles)
    # the tuner's one argument rotation was made off the main thread, during the compilation
    assert len(made) == 1 and made[0] != threading.main_thread().name
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    ref = mm_reference(a, b) * step.value
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    G.mm(a, b, epilogue=[step])
    assert native.stats().compiles == compiles


def test_second_shape_of_an_epilogue_compiles_nothing(fresh_cache):
    """Tile libraries take the sizes at run time: a second new shape of the same epilogue and
    dtypes (a new tuning) reuses the first shape's libraries."""
    if native.cpu_info().isa == "scalar":
        pytest.skip("needs an x86 vector ISA")
    step = Scale(1.0 + 1.0 / 983.0)
    G.mm(torch.randn(1, 40), torch.randn(40, 72), epilogue=[step])
    native.reset_stats()
    tuned = autotune.stats.tuned
    a, b = torch.randn(1, 56), torch.randn(56, 88)
    y = G.mm(a, b, epilogue=[step])
    assert autotune.stats.tuned == tuned + 1
    assert native.stats().compiles == 0
    torch.testing.assert_close(y, (a.double() @ b.double() * step.value).float())


def test_tuning_arguments_fail_like_before(fresh_cache, monkeypatch):
    """An error while making the argument copies during compilation surfaces from the call (as
    when the tuner made them itself) and leaves no choice cached."""
    if native.cpu_info().isa == "scalar":
        pytest.skip("needs an x86 vector ISA")

    class Broken(mm_mod._Rotation):  # type: ignore[misc,name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise MemoryError("no room for the copies")

    monkeypatch.setattr(mm_mod, "_Rotation", Broken)
    with pytest.raises(MemoryError, match="no room"):
        G.mm(torch.randn(1, 24), torch.randn(24, 104), epilogue=[Scale(1.0 + 1.0 / 991.0)])
    assert not autotune.choice_cache.entries()


def test_a_cold_tune_leaves_the_global_random_stream_alone(fresh_cache) -> None:
    """The tuner's random inputs come from a private generator: after a first call that tunes a
    new shape, ``torch.randn`` continues exactly where the caller's seed left it."""
    if native.cpu_info().isa == "scalar":
        pytest.skip("needs an x86 vector ISA")
    a, b = torch.randn(3, 56), torch.randn(56, 88)  # a shape no other test builds
    torch.manual_seed(123)
    expected = torch.randn(5)
    torch.manual_seed(123)
    tuned = autotune.stats.tuned
    G.mm(a, b)
    assert autotune.stats.tuned == tuned + 1  # it did tune
    assert torch.equal(torch.randn(5), expected)


_FIRST_GEMM = """
import torch
import torchport.gemm as G
from torchport import native
g = torch.Generator().manual_seed(0)
x, w = torch.randn(3, 200, generator=g), torch.randn(300, 200, generator=g)
out = G.mm(x, w.t(), bias=torch.zeros(300))
torch.testing.assert_close(out, x @ w.t())
print(native.stats().pch_builds)
"""


def test_a_fresh_caches_first_gemm_builds_one_precompiled_header(tmp_path):
    """The tile libraries, the epilogue pass and the pack kernel share one set of compiler flags
    (-O2), so a new process's first GEMM in a fresh cache builds one precompiled header, not one
    per flag set (the pack kernel at -O3 cost a second: ~0.4 s of compiler CPU there)."""
    if native.cpu_info().isa == "scalar":
        pytest.skip("needs an x86 vector ISA")
    try:
        if not native.pch._is_gcc(native.toolchain.find_compiler()):
            pytest.skip("precompiled headers are built for GCC only")
    except native.NativeError:
        pytest.skip("no C compiler")
    env = {**os.environ, "TORCHPORT_CACHE_DIR": str(tmp_path / "cache"), "TORCHPORT_PROGRESS": "0"}
    env["TORCHPORT_NATIVE_PCH"] = ""
    res = subprocess.run(
        [sys.executable, "-c", _FIRST_GEMM], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "1", res.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tuning_check_compares_every_row_block(monkeypatch, dtype) -> None:
    """The tuner's check of a candidate against ATen (``_close``) runs in row blocks: a wrong
    value or a NaN in any block fails it, values within the tolerance pass, and the anchor's
    output is left as it was (a float32 block is a view of it)."""
    monkeypatch.setattr(mm_mod, "CLOSE_BLOCK_ELEMS", 3 * 7)  # blocks of three rows of 7
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(10, 7, generator=g).to(dtype)
    before = ref.clone()
    assert mm_mod._close(ref.clone(), ref)
    for r, c in [(0, 0), (4, 6), (9, 3)]:  # first, a middle and the last (partial) block
        bad = ref.clone()
        bad[r, c] += 1.0
        assert not mm_mod._close(bad, ref), (r, c)
        nan = ref.clone()
        nan[r, c] = float("nan")
        assert not mm_mod._close(nan, ref) and not mm_mod._close(ref.clone(), nan), (r, c)
    near = ref.float() + 1e-4  # within both tolerances (scaled by max |ref| + 1)
    assert mm_mod._close(near.to(dtype), ref)
    assert torch.equal(ref, before)
    assert not mm_mod._close(ref[:, :6].clone(), ref)  # shape
    assert mm_mod._close(ref[:0], ref[:0])
