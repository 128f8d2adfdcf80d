"""The native toolchain: compile, content-addressed cache, concurrency, corruption, no compiler."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from torchport import config, native
from torchport.native import (
    CompileError,
    CompilerNotFoundError,
    CorruptCacheWarning,
    IntArg,
    Kernel,
    KernelArgumentError,
    TensorArg,
)

SRC = """
TP_EXPORT int tp_fill(float *out, int64_t n, double value, int64_t nthreads) {
    #pragma omp parallel for num_threads(nthreads)
    for (int64_t i = 0; i < n; ++i) out[i] = (float)value + (float)i;
    return 0;
}
"""


def _source(tag: str) -> str:
    return native.render(SRC + "/* ${tag} */\n", tag=tag)


def _fill(tag: str, n: int = 1000) -> torch.Tensor:
    lib = native.build(_source(tag), name="fill")
    k = Kernel(
        lib,
        "tp_fill",
        (TensorArg("out", (torch.float32,)), IntArg("n"), native.FloatArg("v"), IntArg("nt")),
    )
    out = torch.empty(n)
    k(out, n, 2.5, 2)
    return out


def test_build_and_run(fresh_cache):
    out = _fill("basic")
    assert torch.equal(out, 2.5 + torch.arange(1000, dtype=torch.float32))
    assert list(Path(fresh_cache, "native").rglob("*.so"))


def test_stale_build_folders_are_swept_and_not_counted(fresh_cache):
    """A ``.build-*`` folder left by a killed build was never removed and cache_size() counted
    its kernel.so; now opening the cache directory removes one over an hour old (a live build
    lasts at most the compile timeout) and cache_size() counts only entries."""
    from torchport.native import toolchain

    shard = Path(fresh_cache, "native", "ab")
    shard.mkdir(parents=True, mode=0o700)
    for d in ("old", "live"):
        (shard / f".build-{d}").mkdir(mode=0o700)
        (shard / f".build-{d}" / "kernel.so").write_bytes(b"x" * 10)
    hours_ago = time.time() - 2 * toolchain.STALE_BUILD_S
    os.utime(shard / ".build-old", (hours_ago, hours_ago))
    (shard / "entry.so").write_bytes(b"y" * 7)
    assert native.cache_size() == (1, 7)
    toolchain._entry_paths("fill", "ab" + "0" * 62)
    assert not (shard / ".build-old").exists() and (shard / ".build-live" / "kernel.so").exists()


def test_second_process_hits_cache_without_compiler(fresh_cache):
    code = textwrap.dedent(
        """
        import sys, json
        sys.path.insert(0, %r)
        from tests.test_native_toolchain import _fill
        from torchport import native
        out = _fill("xproc")
        print(json.dumps(vars(native.stats())))
        """
    ) % str(Path(__file__).parent.parent)
    env = {**os.environ, "TORCHPORT_CACHE_DIR": str(fresh_cache)}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0]["compiles"] == 1 and runs[0]["disk_hits"] == 0
    assert runs[1]["compiles"] == 0 and runs[1]["disk_hits"] == 1


def _build_in_child(args: tuple[str, str]) -> list[float]:
    cache, tag = args
    os.environ["TORCHPORT_CACHE_DIR"] = cache
    return _fill(tag, 64).tolist()


def test_concurrent_builds_of_one_kernel(fresh_cache):
    ctx = multiprocessing.get_context("spawn")  # fork after OpenMP is unsafe
    with ProcessPoolExecutor(max_workers=4, mp_context=ctx) as ex:
        results = list(ex.map(_build_in_child, [(str(fresh_cache), "race")] * 8, timeout=180))
    expect = (2.5 + torch.arange(64, dtype=torch.float32)).tolist()
    assert all(r == expect for r in results)
    sos = list(Path(fresh_cache, "native").rglob("fill-*.so"))
    assert len(sos) == 1
    assert not list(Path(fresh_cache, "native").rglob(".build-*"))  # no temp dirs left


def test_corrupt_entry_is_rebuilt_with_warning(fresh_cache, monkeypatch):
    src = _source("corrupt")
    lib = native.build(src, name="fill")
    del lib
    (so,) = Path(fresh_cache, "native").rglob("fill-*.so")
    # New inode: this process still maps the old object, which must stay intact.
    bad = so.with_name("bad.tmp")
    bad.write_bytes(b"\x7fELF garbage")
    os.replace(bad, so)
    # a fresh in-process view, as a new process would have
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    before = native.stats().corrupt_rebuilds
    with pytest.warns(CorruptCacheWarning, match="failed verification"):
        out = _fill("corrupt")
    assert native.stats().corrupt_rebuilds == before + 1
    assert out[3].item() == 5.5
    record = json.loads(so.with_suffix(".json").read_text())
    assert record["sha256"] == native.toolchain._digest(so)


def test_missing_record_counts_as_corrupt(fresh_cache, monkeypatch):
    native.build(_source("norecord"), name="fill")
    (meta,) = Path(fresh_cache, "native").rglob("fill-*.json")
    meta.write_text("{not json")
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    with pytest.warns(CorruptCacheWarning):
        assert _fill("norecord")[0].item() == 2.5


def test_deeply_nested_record_counts_as_corrupt(fresh_cache, monkeypatch):
    """json.loads of a deeply nested record raised RecursionError, which the corrupt-entry
    handler did not catch: the op raised instead of rebuilding (or falling back)."""
    native.build(_source("nested"), name="fill")
    (meta,) = Path(fresh_cache, "native").rglob("fill-*.json")
    meta.write_text("[" * 100000)
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    with pytest.warns(CorruptCacheWarning):
        assert _fill("nested")[0].item() == 2.5


def test_compiler_environment_cannot_change_a_cached_kernel(fresh_cache, tmp_path, monkeypatch):
    """gcc takes include directories (CPATH, C_INCLUDE_PATH, ...) and tool paths from the
    environment, none of which is in the cache key: a header injected that way was compiled
    into the kernel, and the object was then served to every later process."""
    (tmp_path / "omp.h").write_text('#error "an injected header was compiled"\n')
    for var in ("CPATH", "C_INCLUDE_PATH"):
        monkeypatch.setenv(var, str(tmp_path))
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    assert "CPATH" not in native.toolchain.compiler_env()
    assert _fill("env")[7].item() == 9.5  # built without the injected header


def test_missing_compiler_is_typed_error(fresh_cache):
    with (
        config.override(cc="/nonexistent/bin/cc-404"),
        pytest.raises(
            CompilerNotFoundError,
            match=r"no C compiler found \(tried \['/nonexistent/bin/cc-404'\]\)",
        ),
    ):
        native.build(_source("nocc"), name="fill")


def test_compile_error_carries_compiler_message(fresh_cache):
    bad = native.render("TP_EXPORT int broken(void) { return undefined_symbol_xyz; }\n")
    with pytest.raises(CompileError, match=r"undefined_symbol_xyz"):
        native.build(bad, name="broken")


def test_a_rejected_source_is_not_compiled_again(fresh_cache, tmp_path):
    cc = tmp_path / "cc-no-openmp"  # runs, but rejects every kernel (clang without omp.h)
    cc.write_text(
        '#!/bin/sh\ncase "$1" in --version) echo "fakecc 1"; exit 0;; esac\n'
        "echo \"fatal error: 'omp.h' file not found\" >&2; exit 1\n"
    )
    cc.chmod(0o755)
    before = native.stats().compiles
    with config.override(cc=str(cc), native_pch="off"):
        with pytest.raises(CompileError, match=r"'omp.h' file not found"):
            native.build(_source("rejected"), name="fill")
        for _ in range(3):  # each call of an op that falls back asks again
            with pytest.raises(CompileError, match=r"(?s)omp.h.*failed before in this process"):
                native.build(_source("rejected"), name="fill")
    assert native.stats().compiles == before + 1


def test_a_compiler_hanging_on_version_costs_its_timeout_once(fresh_cache, tmp_path, monkeypatch):
    cc = tmp_path / "cc-hangs"
    cc.write_text("#!/bin/sh\nexec sleep 30\n")
    cc.chmod(0o755)
    monkeypatch.setattr(native.toolchain, "IDENTITY_TIMEOUT_S", 0.3)
    with config.override(cc=str(cc)):
        for i in range(3):  # every call of an op that falls back asks again
            t0 = time.perf_counter()
            with pytest.raises(CompilerNotFoundError, match=r"cc-hangs' cannot run: .*timed out"):
                native.build(_source("hangs"), name="fill")
            if i > 0:
                assert time.perf_counter() - t0 < 0.2


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_hanging_compile_costs_its_timeout_once_and_leaves_no_process(
    fresh_cache, tmp_path, monkeypatch
):
    """A compiler hanging on a kernel cost every call of its op the whole compile timeout (a
    timeout was not remembered), and only the driver was killed: its children (cc1, as, ld) went
    on. Now the build's process group is killed and the timeout is remembered for the process."""
    pids = tmp_path / "pids"
    cc = tmp_path / "cc-hangs-compiling"
    cc.write_text(
        '#!/bin/sh\ncase "$1" in --version) echo "fakecc 1"; exit 0;; esac\n'
        f'sleep 30 &\necho $! >> "{pids}"\nwait\n'
    )
    cc.chmod(0o755)
    monkeypatch.setattr(native.toolchain, "COMPILE_TIMEOUT_S", 0.5)
    try:
        with config.override(cc=str(cc), native_pch="off"):
            with pytest.raises(CompileError, match=r"compiler timed out after 0.5 s"):
                native.build(_source("hangs_compiling"), name="fill")
            for _ in range(3):  # each call of an op that falls back asks again
                t0 = time.perf_counter()
                with pytest.raises(CompileError, match=r"(?s)timed out.*failed before in this"):
                    native.build(_source("hangs_compiling"), name="fill")
                assert time.perf_counter() - t0 < 0.2
        (child,) = map(int, pids.read_text().split())  # started once
        deadline = time.monotonic() + 5.0
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), f"the compiler's child {child} outlived the timeout"
    finally:  # (the old code left it running)
        for pid in map(int, pids.read_text().split() if pids.exists() else ()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_ops_fall_back_visibly_without_compiler(fresh_cache, monkeypatch):
    from torchport.ops import elementwise

    elementwise._kernel.cache_clear()
    monkeypatch.setattr(native.toolchain, "_warned_fallback", set())
    before = native.stats().fallbacks
    x, y = torch.randn(100), torch.randn(100)
    with config.override(cc="/nonexistent/cc"):
        with pytest.warns(native.NativeFallbackWarning, match="axpy unavailable, using ATen"):
            out = elementwise.axpy(2.0, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            elementwise.axpy(2.0, x, y)
    elementwise._kernel.cache_clear()
    assert torch.allclose(out, 2.0 * x + y)
    assert native.stats().fallbacks == before + 2
    assert native.toolchain.fallback_counts["axpy"] >= 2


def _fresh_view(monkeypatch) -> None:
    """A new process's view: nothing loaded, no directory checked yet."""
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    monkeypatch.setattr(native.toolchain, "_private_dirs", set())


def test_cache_others_can_write_loads_and_builds_nothing(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename our directories and plant theirs
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(shared / "cache"))
    _fresh_view(monkeypatch)
    before = native.stats().compiles
    with pytest.raises(native.UnsafeCacheError, match=r"shared must not be writable by other"):
        native.build(_source("unsafe"), name="fill")
    assert native.stats().compiles == before
    # under a sticky directory (as /tmp), a cache of our own is fine
    shared.chmod(0o1777)
    assert _fill("unsafe")[1].item() == 3.5


def test_cache_entry_directory_others_can_write_is_refused(fresh_cache, monkeypatch):
    _fill("leaf")
    (leaf,) = {p.parent for p in Path(fresh_cache, "native").rglob("fill-*.so")}
    leaf.chmod(0o1777)  # sticky does not help here: a stranger could add the next kernel's .so
    _fresh_view(monkeypatch)
    with pytest.raises(native.UnsafeCacheError, match=r"must not be writable by other users"):
        _fill("leaf")


def test_relative_cache_dir_is_checked_again_after_chdir(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path / "mine")
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", "relcache")
    _fresh_view(monkeypatch)
    assert _fill("rel_a")[1].item() == 3.5
    (tmp_path / "theirs").mkdir(mode=0o777)
    (tmp_path / "theirs").chmod(0o777)  # a directory anyone may fill
    monkeypatch.chdir(tmp_path / "theirs")

    def key(tag: str) -> str:
        cc, flags = native.toolchain.find_compiler(), native.compile_flags()
        return native.toolchain.cache_key(_source(tag), flags, cc)

    # a kernel whose entry directory relcache/native/<xx> has the same relative name as rel_a's
    tag = next(t for t in (f"rel_b{i}" for i in range(100_000)) if key(t)[:2] == key("rel_a")[:2])
    with pytest.raises(native.UnsafeCacheError, match=r"theirs must not be writable by other"):
        _fill(tag)


def test_cache_directory_of_another_user_is_refused(fresh_cache, monkeypatch):
    from torchport.ops import elementwise

    _fill("owner")
    if os.geteuid() == 0:
        os.chown(Path(fresh_cache, "native"), 65534, 65534)
    else:  # the same as seen by another (non-root) user
        monkeypatch.setattr(os, "geteuid", lambda: 65534)
    _fresh_view(monkeypatch)
    with pytest.raises(native.UnsafeCacheError, match=r"must be owned by this user \(uid"):
        _fill("owner")
    # ops take their ATen path, visibly
    elementwise._kernel.cache_clear()
    monkeypatch.setattr(native.toolchain, "_warned_fallback", set())
    x, y = torch.randn(100), torch.randn(100)
    with pytest.warns(native.NativeFallbackWarning, match="axpy unavailable, using ATen"):
        assert torch.allclose(elementwise.axpy(2.0, x, y), 2.0 * x + y)
    elementwise._kernel.cache_clear()


@pytest.mark.parametrize(
    ("uid", "mode", "leaf", "refused"),
    [
        (1000, 0o700, True, None),  # our own
        (0, 0o755, True, None),  # root's, read-only to others: a system-wide or bind-mounted cache
        (0, 0o755, False, None),
        (0, 0o1777, False, None),  # /tmp
        (0, 0o1777, True, "writable"),  # sticky does not stop others adding entries to a leaf
        (0, 0o777, False, "writable"),  # not sticky: our entries could be renamed away
        (0, 0o775, True, "writable"),  # a group that is not ours
        (1000, 0o770, False, "writable"),
        (1001, 0o700, True, "owned"),  # another non-root user's, however private
        (1001, 0o755, False, "owned"),
    ],
)
def test_cache_trust_policy_on_stat_results(uid, mode, leaf, refused):
    # the decision check_private (and the autotuner's choice file) applies, for user 1000
    st = os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, uid, 54321, 0, 0, 0, 0))
    why = native.toolchain.unsafe_reason(st, 1000, leaf=leaf)
    assert (why is None) if refused is None else (why is not None and refused in why), why


def test_unwritable_cache_is_a_native_error_and_ops_fall_back(tmp_path, monkeypatch):
    from torchport.ops import elementwise

    (tmp_path / "file").write_text("")  # the same for a read-only or forbidden directory
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    _fresh_view(monkeypatch)
    with pytest.raises(native.CacheUnavailableError, match=r"set TORCHPORT_CACHE_DIR to a writ"):
        native.build(_source("nowrite"), name="fill")
    elementwise._kernel.cache_clear()
    monkeypatch.setattr(native.toolchain, "_warned_fallback", set())
    x, y = torch.randn(100), torch.randn(100)
    with pytest.warns(native.NativeFallbackWarning, match="axpy unavailable, using ATen"):
        assert torch.allclose(elementwise.axpy(2.0, x, y), 2.0 * x + y)
    elementwise._kernel.cache_clear()


def test_kernel_argument_validation(fresh_cache):
    lib = native.build(_source("args"), name="fill")
    k = Kernel(
        lib,
        "tp_fill",
        (
            TensorArg("out", (torch.float32,), ndim=1),
            IntArg("n"),
            native.FloatArg("v"),
            IntArg("nt"),
        ),
    )
    with pytest.raises(
        KernelArgumentError,
        match=r"argument 'out' must have dtype in \(torch.float32\), got torch.float64",
    ):
        k(torch.empty(4, dtype=torch.float64), 4, 1.0, 1)
    with pytest.raises(KernelArgumentError, match=r"'out' must be 1-D, got 2-D"):
        k(torch.empty(2, 2), 4, 1.0, 1)
    with pytest.raises(KernelArgumentError, match=r"'out' must be contiguous"):
        k(torch.empty(8)[::2], 4, 1.0, 1)
    with pytest.raises(KernelArgumentError, match=r"'n' must be an int, got 2.0"):
        k(torch.empty(4), 2.0, 1.0, 1)
    # out of int64_t range: ctypes alone would pass 2**64 + 4 as 4
    with pytest.raises(
        KernelArgumentError, match=r"'n' must fit in int64_t .*, got 18446744073709551620"
    ):
        k(torch.empty(4), 2**64 + 4, 1.0, 1)
    with pytest.raises(KernelArgumentError, match=r"'nt' must fit in int64_t"):
        k(torch.empty(4), 4, 1.0, -(2**63) - 1)
    with pytest.raises(KernelArgumentError, match=r"'v' must fit in a double, got 1000"):
        k(torch.empty(4), 4, 10**400, 1)  # was a bare OverflowError
    with pytest.raises(KernelArgumentError, match=r"takes 4 arguments"):
        k(torch.empty(4))
    with pytest.raises(KernelArgumentError, match=r"must be a torch.Tensor, got list"):
        k([1.0], 1, 1.0, 1)
    # a lazily negated view: its memory holds the values before the negation, which the
    # kernel read as they were (a contiguous one passed every other check)
    with pytest.raises(KernelArgumentError, match=r"'out' must not carry a lazy negation bit"):
        k(torch._neg_view(torch.empty(4)), 4, 1.0, 1)


def test_single_float_argument_must_fit_a_float(fresh_cache):
    """ctypes handed a double past float's range to a C ``float`` parameter as inf."""
    src = "TP_EXPORT int tp_put(float *out, float v) { out[0] = v; return 0; }\n"
    k = Kernel(
        native.build(native.render(src), name="put"),
        "tp_put",
        (TensorArg("out", (torch.float32,)), native.FloatArg("v", single=True)),
    )
    out = torch.zeros(1)
    for v in (1.5, -3.4028234663852886e38, float("inf")):  # (-FLT_MAX; inf is given as inf)
        k(out, v)
        assert out.item() == v
    k(out, float("nan"))
    assert out.isnan().all()
    for v in (1e300, -3.5e38, 10**39):
        with pytest.raises(KernelArgumentError, match=r"'v' must fit in a float, got"):
            k(out, v)


def test_negated_views_take_the_dispatcher_which_resolves_them(fresh_cache):
    from torchport.ops import elementwise

    one = torch.randn(1, dtype=torch.complex64).conj().imag  # the lazy negation bit
    for x in (one, torch._neg_view(torch.randn(64))):
        assert x.is_neg() and x.is_contiguous()
        assert not native.eager_fast_path(x) and native.eager_fast_path(x.resolve_neg())
        y = torch.randn(x.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", native.NativeFallbackWarning)
            out = elementwise.axpy(2.0, x, y)  # the kernel read the un-negated values
        assert torch.allclose(out, 2.0 * x.resolve_neg() + y)


def test_template_parameters_must_match():
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        native.render("int ${a}; int ${b};", a=1)
    with pytest.raises(ValueError, match=r"unused \['c'\]"):
        native.render("int ${a};", a=1, c=2)


def test_cpu_features_and_isa_override():
    info = native.cpu_info()
    assert info.cores >= 1
    assert info.max_isa in ("scalar", "avx2", "avx512")
    with config.override(isa="scalar"):
        assert native.cpu_info().isa == "scalar"
    with config.override(isa="avx512"):  # can only lower what the hardware has
        assert native.cpu_info().isa == info.max_isa or info.max_isa == "avx512"
    assert native.compile_flags("scalar") == list(native.toolchain.BASE_FLAGS)
    assert "-mavx512f" in native.compile_flags("avx512")
    with pytest.raises(ValueError, match=r"isa must be one of .*, got 'AVX512'"):
        native.build(_source("isa"), name="fill", isa="AVX512")  # was built at avx2, silently


def test_avx512_level_needs_dq() -> None:
    """The avx512 level compiles with -mavx512dq and its kernels use DQ instructions: a CPU
    with AVX-512 F/BW/VL but no DQ stays at avx2."""
    from dataclasses import replace

    info = native.cpu_info()
    base = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    full = replace(info, arch="x86_64", flags=frozenset(base | {"avx512dq"}))
    no_dq = replace(info, arch="x86_64", flags=frozenset(base))
    assert full.max_isa == "avx512"
    assert no_dq.max_isa == "avx2"


def _records(cache: Path, stem: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in Path(cache, "native").rglob(f"{stem}-*.json")]


def _gcc() -> bool:
    try:
        return native.pch._is_gcc(native.toolchain.find_compiler())
    except native.NativeError:
        return False


needs_gcc = pytest.mark.skipif(not _gcc(), reason="precompiled headers are built for GCC only")


@pytest.fixture
def own_pch(fresh_cache, monkeypatch):
    """Precompiled headers under the fresh cache (the default place), as a new process sees them."""
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", "")
    monkeypatch.setattr(native.pch, "_ready", {})
    return fresh_cache


@needs_gcc
def test_prelude_headers_are_precompiled_once_and_used(own_pch, tmp_path):
    before = native.stats().pch_builds
    assert _fill("pch_a")[5].item() == 7.5
    assert _fill("pch_b")[5].item() == 7.5
    assert native.stats().pch_builds == before + 1
    cmds = [r["cmd"] for r in _records(own_pch, "fill")]
    assert len(cmds) == 2 and all("-include" in c for c in cmds)
    # GCC really reads the PCH with these flags (it ignores a mismatched one silently under -w)
    header = Path(cmds[0][cmds[0].index("-include") + 1])
    assert header.is_absolute() and header.with_suffix(".h.gch").exists()
    (tmp_path / "k.c").write_text(native.render("int tp_k(void) { return 1; }\n"))
    flags = [f for f in native.compile_flags() if f != "-w"]
    flags += ["-H", "-Winvalid-pch", "-include", str(header)]
    res = subprocess.run(
        [native.toolchain.find_compiler(), *flags, "k.c", "-o", "k.so"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert any(
        line.startswith("! ") and line.endswith(".gch") for line in res.stderr.splitlines()
    ), res.stderr[-2000:]
    assert "not used because" not in res.stderr
    # a new process reuses it: no build, no warning
    native.pch._ready.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fill("pch_c")[0].item() == 2.5
    assert native.stats().pch_builds == before + 1
    # a source that does not begin with the prelude's headers compiles as before
    lib = native.build("int tp_one(void) { return 1; }\n", name="plain")
    assert lib.tp_one() == 1
    assert "-include" not in _records(own_pch, "plain")[0]["cmd"]


def test_new_cache_directories_are_private_under_umask_000(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "a" / "b" / "cache"))
    _fresh_view(monkeypatch)
    old = os.umask(0)  # containers run so: mkdir(parents=True) made a/ and b/ writable by all
    try:
        assert _fill("umask")[1].item() == 3.5
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cache"):
        assert d.stat().st_mode & 0o777 == 0o700


@needs_gcc
def test_precompiled_headers_under_umask_000(own_pch, monkeypatch):
    monkeypatch.setattr(native.toolchain, "_private_dirs", set())
    old = os.umask(0)  # containers run so: directories made by the umask are writable by all
    try:
        assert _fill("pch_umask")[1].item() == 3.5
    finally:
        os.umask(old)
    assert "-include" in _records(own_pch, "fill")[0]["cmd"]


@needs_gcc
def test_precompiled_headers_with_relative_cache_dir_or_off(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", "relcache")
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", "")
    monkeypatch.setattr(native.pch, "_ready", {})
    before = native.stats().compiles
    assert _fill("pch_rel")[1].item() == 3.5
    assert native.stats().compiles == before + 1  # no failed first attempt
    assert "-include" in _records(tmp_path / "relcache", "fill")[0]["cmd"]
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", "off")
    assert _fill("pch_off")[1].item() == 3.5
    cmds = [r["cmd"] for r in _records(tmp_path / "relcache", "fill")]
    assert sum("-include" in c for c in cmds) == 1


@needs_gcc
def test_damaged_precompiled_header_is_rebuilt_with_warning(own_pch, monkeypatch):
    _fill("pch_ok")
    (gch,) = Path(own_pch, "native", "pch").rglob("*.h.gch")
    data = bytearray(gch.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = os.urandom(4096)  # GCC crashes on this
    gch.write_bytes(bytes(data))
    monkeypatch.setattr(native.pch, "_ready", {})  # a fresh process's view
    before = native.stats().pch_builds
    with pytest.warns(CorruptCacheWarning, match="precompiled header .* failed verification"):
        assert _fill("pch_damaged")[1].item() == 3.5
    assert native.stats().pch_builds == before + 1
    assert all("-include" in r["cmd"] for r in _records(own_pch, "fill"))


@needs_gcc
def test_compile_failing_with_precompiled_header_retries_without(own_pch, monkeypatch):
    _fill("pch_first")  # builds the PCH
    (header,) = Path(own_pch, "native", "pch").rglob(native.pch.HEADER_NAME)
    header.write_text("#error this header is broken\n")  # the .gch beside it is now stale
    header.with_suffix(".h.gch").unlink()
    assert _fill("pch_retry")[2].item() == 4.5
    rec = [r for r in _records(own_pch, "fill") if "-include" not in r["cmd"]]
    assert len(rec) == 1  # compiled again without it
    src = native.render("TP_EXPORT int tp_x(void) { return 0; }\n")
    assert (
        native.pch.header_for(src, native.compile_flags(), native.toolchain.find_compiler()) is None
    )
    assert not (header.parent / "record.json").exists()  # the next process builds it anew
    # a source that is itself at fault still raises its own compiler message
    monkeypatch.setattr(native.pch, "_ready", {})
    bad = native.render("TP_EXPORT int broken(void) { return undefined_symbol_pch; }\n")
    with pytest.raises(CompileError, match="undefined_symbol_pch") as info:
        native.build(bad, name="broken")
    assert info.value.__context__ is None
    good = native.pch.header_for(bad, native.compile_flags(), native.toolchain.find_compiler())
    assert good is not None  # rebuilt, and not discarded by the faulty source


@needs_gcc
def test_compiles_do_not_wait_for_a_precompiled_header_being_built(own_pch):
    src = native.render("TP_EXPORT int tp_w(void) { return 0; }\n")
    cc, flags = native.toolchain.find_compiler(), native.compile_flags()
    key = native.pch._key([f for f in flags if f != "-shared"], cc)
    d = Path(own_pch, "native", "pch", key[:24]).absolute()
    busy = native.pch._dir_locks.setdefault(str(d), threading.Lock())
    with busy:  # another thread of this process is building it
        assert native.pch.header_for(src, flags, cc) is None
    assert str(d) not in native.pch._ready  # not remembered: the next compile asks again
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "a") as held:  # another process is building it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert native.pch.header_for(src, flags, cc) is None
        fcntl.flock(held, fcntl.LOCK_UN)
    assert native.pch.header_for(src, flags, cc) == d / native.pch.HEADER_NAME


def _filling_compiler(tmp_path: Path, says: str) -> tuple[Path, Path]:
    """A compiler (the real one) that fails as on a full disk, saying ``says``, while the file
    it returns as the second item exists."""
    full, cc = tmp_path / "disk-is-full", tmp_path / "cc-disk-full"
    cc.write_text(
        f'#!/bin/sh\nif [ -e "{full}" ] && [ "$1" != --version ]; then\n'
        f'  echo "{says}" >&2; exit 1\nfi\nexec "{native.find_compiler()}" "$@"\n'
    )
    cc.chmod(0o755)
    full.touch()
    return cc, full


@pytest.mark.parametrize(
    "says",
    [
        "/usr/bin/ld: final link failed: No space left on device",
        "kernel.c:9: fatal error: error writing to /tmp/ccX.s: Disk quota exceeded",
    ],
    ids=["ENOSPC", "EDQUOT"],
)
def test_a_full_disk_while_compiling_is_not_remembered(fresh_cache, tmp_path, says):
    """The compiler's "No space left on device" was a CompileError, remembered for the process:
    the kernel never compiled again once space was freed. Now it is a DiskFullError (a
    CacheUnavailableError: the ops fall back on it) that a later call tries again."""
    cc, full = _filling_compiler(tmp_path, says)
    before = native.stats().compiles
    with config.override(cc=str(cc), native_pch="off"):
        for _ in range(2):  # tried each time while the disk is full
            with pytest.raises(native.DiskFullError, match=r"needs free disk space to build ke"):
                native.build(_source("disk_full"), name="fill")
        full.unlink()  # space freed
        lib = native.build(_source("disk_full"), name="fill")
    assert native.stats().compiles == before + 3 and hasattr(lib, "tp_fill")


@pytest.mark.parametrize(("file", "code"), [("kernel.c", "ENOSPC"), ("kernel.json", "EDQUOT")])
def test_a_full_disk_while_writing_is_not_remembered(fresh_cache, monkeypatch, file, code):
    real = Path.write_text

    def write_text(self: Path, *args, **kwargs):
        if self.name == file:
            no = getattr(errno, code)
            raise OSError(no, os.strerror(no), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with config.override(native_pch="off"):
        with pytest.raises(native.DiskFullError, match=r"cannot write kernel fill-\w+ into"):
            native.build(_source(f"write_full_{code}"), name="fill")
        monkeypatch.setattr(Path, "write_text", real)
        assert hasattr(native.build(_source(f"write_full_{code}"), name="fill"), "tp_fill")


def test_a_full_disk_falls_back_visibly_and_the_op_compiles_later(
    fresh_cache, tmp_path, monkeypatch
):
    from torchport.ops import elementwise

    cc, full = _filling_compiler(tmp_path, "as: kernel.o: No space left on device")
    elementwise._kernel.cache_clear()
    monkeypatch.setattr(native.toolchain, "_warned_fallback", set())
    x, y = torch.randn(100), torch.randn(100)
    with config.override(cc=str(cc), native_pch="off"):
        with pytest.warns(native.NativeFallbackWarning, match=r"axpy unavailable.*free disk sp"):
            torch.testing.assert_close(elementwise.axpy(2.0, x, y), 2.0 * x + y)
        full.unlink()
        fallbacks, compiles = native.stats().fallbacks, native.stats().compiles
        torch.testing.assert_close(elementwise.axpy(2.0, x, y), 2.0 * x + y)
    elementwise._kernel.cache_clear()
    assert native.stats().fallbacks == fallbacks and native.stats().compiles == compiles + 1


@needs_gcc
def test_a_full_disk_while_precompiling_headers_is_not_remembered(own_pch, tmp_path):
    cc, full = _filling_compiler(
        tmp_path, "cc1: error writing to tp_headers.h.gch: Disk quota exceeded"
    )
    src = native.render("TP_EXPORT int tp_p(void) { return 0; }\n")
    flags = native.compile_flags()
    assert native.pch.header_for(src, flags, str(cc)) is None
    full.unlink()
    header = native.pch.header_for(src, flags, str(cc))
    assert header is not None and header.with_suffix(".h.gch").exists()
