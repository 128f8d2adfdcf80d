"""The native cache trusts only files this user (or root) alone can change: an object, record or
precompiled header that another user owns or can write, or a symbolic link, is never loaded or
passed to the compiler; it is removed and rebuilt (refused where it cannot be removed)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.test_native_toolchain import needs_gcc
from torchport import native
from torchport.native import CorruptCacheWarning

GOOD = "int tp_f(void) { return 41; }\n"
EVIL = "int tp_f(void) { return 666; }\n"
root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="a file owned by another user is made with chown, which needs root"
)


@pytest.fixture
def cache(fresh_cache, monkeypatch):
    """A fresh cache, seen as a new process sees it (nothing loaded, no directory checked)."""
    monkeypatch.setattr(native.toolchain, "_loaded", {})
    monkeypatch.setattr(native.toolchain, "_private_dirs", set())
    return fresh_cache


def _new_process_view(monkeypatch) -> None:
    monkeypatch.setattr(native.toolchain, "_loaded", {})


def _build_elsewhere(cache: Path) -> None:
    """Build the entry in another process: this one has not loaded it, and dlopen, which returns
    an object already loaded from the same path, really loads whatever is there."""
    code = "from torchport import native; assert native.build(%r, name='probe').tp_f() == 41"
    env = dict(os.environ, TORCHPORT_CACHE_DIR=str(cache))
    subprocess.run([sys.executable, "-c", code % GOOD], env=env, check=True, timeout=120)


def _entry(cache: Path) -> tuple[Path, Path]:
    (so,) = Path(cache, "native").rglob("probe-*.so")
    return so, so.with_suffix(".json")


def _evil_object(where: Path) -> Path:
    """An object of our own making that another user could have put in the cache."""
    (where / "evil.c").write_text(EVIL)
    cc = native.toolchain.find_compiler()
    cmd = [cc, "-shared", "-fPIC", "-O2", "evil.c", "-o", "evil.so"]
    subprocess.run(cmd, cwd=where, check=True, capture_output=True, timeout=120)
    return where / "evil.so"


def _plant(so: Path, meta: Path, evil: Path) -> None:
    """Replace the entry with ``evil`` and a record that matches it (new files, new inodes)."""
    so.unlink()
    shutil.copy(evil, so)
    record = json.loads(meta.read_text())
    record["sha256"] = native.toolchain._digest(so)
    meta.unlink()
    meta.write_text(json.dumps(record))


def _sealed(p: Path) -> bool:
    st = p.lstat()
    return (
        p.is_file() and not p.is_symlink() and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    )


def test_cached_entry_loads_without_rebuild_or_warning(cache, monkeypatch):
    assert native.build(GOOD, name="probe").tp_f() == 41
    so, meta = _entry(cache)
    assert _sealed(so) and _sealed(meta)
    _new_process_view(monkeypatch)
    before = native.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.build(GOOD, name="probe").tp_f() == 41
    after = native.stats()
    assert (after.compiles, after.disk_hits) == (before.compiles, before.disk_hits + 1)


@pytest.mark.parametrize("which", ["object", "record", "both"])
def test_entry_writable_by_others_is_not_loaded(cache, tmp_path, monkeypatch, which):
    _build_elsewhere(cache)
    so, meta = _entry(cache)
    _plant(so, meta, _evil_object(tmp_path))
    shared = {"object": [so], "record": [meta], "both": [so, meta]}[which]
    for p in shared:
        p.chmod(0o666)
    _new_process_view(monkeypatch)
    before = native.stats()
    name = shared[0].name.replace(".", r"\.")
    with pytest.warns(
        CorruptCacheWarning,
        match=rf"is not loaded: native cache file .*{name} must not be writable by other users, "
        rf"got mode 0o666 .*\(uid {os.geteuid()}\); removed it; rebuilding it",
    ):
        lib = native.build(GOOD, name="probe")
    assert lib.tp_f() == 41  # not the planted 666
    after = native.stats()
    assert after.compiles == before.compiles + 1
    assert after.corrupt_rebuilds == before.corrupt_rebuilds + 1
    assert _sealed(so) and _sealed(meta)


@root_only
@pytest.mark.parametrize("which", ["object", "record"])
def test_entry_owned_by_another_user_is_not_loaded(cache, tmp_path, monkeypatch, which):
    _build_elsewhere(cache)
    so, meta = _entry(cache)
    _plant(so, meta, _evil_object(tmp_path))
    os.chown(so if which == "object" else meta, 65534, 65534)  # mode 0644/0755: read-only to all
    # (the scenario: the directory was writable by others, and then `chmod go-w`-ed)
    _new_process_view(monkeypatch)
    with pytest.warns(
        CorruptCacheWarning,
        match=r"must be owned by this user \(uid 0\) or root, got uid 65534 \(mode 0o[0-7]{3}\)",
    ):
        lib = native.build(GOOD, name="probe")
    assert lib.tp_f() == 41  # not the planted 666
    assert _sealed(so) and _sealed(meta)


@pytest.mark.parametrize("which", ["object", "record"])
def test_symlinked_entry_is_not_followed(cache, tmp_path, monkeypatch, which):
    _build_elsewhere(cache)
    so, meta = _entry(cache)
    evil = _evil_object(tmp_path)
    _plant(so, meta, evil)  # a record matching the object the link leads to
    link = so if which == "object" else meta
    target = tmp_path / f"target{link.suffix}"
    os.replace(link, target)
    link.symlink_to(target)
    _new_process_view(monkeypatch)
    with pytest.warns(
        CorruptCacheWarning, match=r"must not be a symbolic link, got one; removed it; rebuilding"
    ):
        lib = native.build(GOOD, name="probe")
    assert lib.tp_f() == 41  # not the planted 666
    assert _sealed(so) and _sealed(meta)
    assert target.is_file()  # the link went, not what it pointed at


@pytest.mark.timeout(60)  # the old code blocked for ever reading the FIFO
def test_fifo_in_place_of_an_object_is_rebuilt(cache, monkeypatch):
    native.build(GOOD, name="probe")
    so, _ = _entry(cache)
    so.unlink()
    os.mkfifo(so)
    _new_process_view(monkeypatch)
    with pytest.warns(CorruptCacheWarning, match=r"must be a regular file, got prw"):
        assert native.build(GOOD, name="probe").tp_f() == 41
    assert _sealed(so)


def test_unsafe_entry_that_cannot_be_removed_is_refused(cache, tmp_path, monkeypatch):
    native.build(GOOD, name="probe")
    so, meta = _entry(cache)
    _plant(so, meta, _evil_object(tmp_path))
    so.chmod(0o757)
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):  # (as a file in a directory of root's, for a user)
        if self == so:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    _new_process_view(monkeypatch)
    before = native.stats().compiles
    with pytest.raises(
        native.UnsafeCacheError,
        match=rf"native cache file {so} must not be writable by other users, got mode 0o757 .*"
        r"nothing is loaded from it, and it cannot be removed \(.*Permission denied",
    ):
        native.build(GOOD, name="probe")
    assert native.stats().compiles == before
    assert not native.toolchain._loaded


def test_entry_replaced_after_verification_is_verified_again(cache, monkeypatch):
    native.build(GOOD, name="probe")
    so, _ = _entry(cache)
    real = native.toolchain._verified
    calls: list[int] = []

    def verified_then_replaced(*args):
        st = real(*args)
        calls.append(1)
        if len(calls) == 1:  # a concurrent builder puts an identical object in place (new inode)
            shutil.copy2(so, so.with_name("copy.tmp"))
            os.replace(so.with_name("copy.tmp"), so)
        return st

    monkeypatch.setattr(native.toolchain, "_verified", verified_then_replaced)
    _new_process_view(monkeypatch)
    before = native.stats().compiles
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.build(GOOD, name="probe").tp_f() == 41
    assert len(calls) == 2 and native.stats().compiles == before


def test_entries_made_under_umask_000_are_reused(cache, monkeypatch):
    old = os.umask(0)
    try:
        assert native.build(GOOD, name="probe").tp_f() == 41
    finally:
        os.umask(old)
    so, meta = _entry(cache)
    assert _sealed(so) and _sealed(meta)
    _new_process_view(monkeypatch)
    before = native.stats().compiles
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.build(GOOD, name="probe").tp_f() == 41
    assert native.stats().compiles == before


def test_directory_refusal_does_not_vouch_for_existing_entries(cache, monkeypatch):
    native.build(GOOD, name="probe")
    so, _ = _entry(cache)
    so.parent.chmod(0o777)
    monkeypatch.setattr(native.toolchain, "_private_dirs", set())
    _new_process_view(monkeypatch)
    with pytest.raises(
        native.UnsafeCacheError,
        match=r"run `chmod go-w .*` \(entries that another user owns or can write are then "
        r"removed and rebuilt, never loaded\)",
    ):
        native.build(GOOD, name="probe")


# ---- precompiled headers: GCC trusts the header and its PCH as input


@pytest.fixture
def own_pch(cache, monkeypatch):
    """Precompiled headers under the fresh cache, as a new process sees them."""
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", "")
    monkeypatch.setattr(native.pch, "_ready", {})
    return cache


def _prelude(tag: str) -> str:
    return native.render(f"TP_EXPORT int tp_g(void) {{ return 7; }} /* {tag} */\n")


def _pch_dir(cache: Path) -> Path:
    (gch,) = Path(cache, "native", "pch").rglob("*.h.gch")
    return gch.parent


def _pch_files(d: Path) -> list[Path]:
    h = native.pch.HEADER_NAME
    return [d / h, d / f"{h}.gch", d / "record.json"]


def _rebuilds_pch(monkeypatch, tag: str, match: str) -> None:
    monkeypatch.setattr(native.pch, "_ready", {})  # a new process's view
    before = native.stats().pch_builds
    with pytest.warns(CorruptCacheWarning, match=match):
        assert native.build(_prelude(tag), name="probe").tp_g() == 7
    assert native.stats().pch_builds == before + 1


@needs_gcc
@pytest.mark.parametrize("which", ["tp_headers.h", "tp_headers.h.gch", "record.json"])
def test_pch_file_writable_by_others_is_not_used(own_pch, monkeypatch, which):
    native.build(_prelude("a"), name="probe")
    d = _pch_dir(own_pch)
    assert all(_sealed(p) for p in _pch_files(d))
    (d / which).chmod(0o666)
    name = which.replace(".", r"\.")
    _rebuilds_pch(
        monkeypatch,
        "b",
        rf"precompiled header {d.name} is not used: native cache file .*/{name} must not be "
        r"writable by other users, got mode 0o666 .*; removed it; rebuilding it",
    )
    assert all(_sealed(p) for p in _pch_files(d))


@root_only
@needs_gcc
def test_pch_owned_by_another_user_is_not_used(own_pch, monkeypatch):
    native.build(_prelude("a"), name="probe")
    d = _pch_dir(own_pch)
    gch = d / f"{native.pch.HEADER_NAME}.gch"
    os.chown(gch, 65534, 65534)
    _rebuilds_pch(monkeypatch, "b", r"\.gch must be owned by this user \(uid 0\) or root, got uid")
    assert all(_sealed(p) for p in _pch_files(d))


@needs_gcc
def test_symlinked_pch_is_not_followed(own_pch, tmp_path, monkeypatch):
    native.build(_prelude("a"), name="probe")
    d = _pch_dir(own_pch)
    gch = d / f"{native.pch.HEADER_NAME}.gch"
    os.replace(gch, tmp_path / "elsewhere.gch")  # (same bytes: the record still matches them)
    gch.symlink_to(tmp_path / "elsewhere.gch")
    _rebuilds_pch(monkeypatch, "b", r"\.gch must not be a symbolic link, got one; removed it")
    assert _sealed(gch) and (tmp_path / "elsewhere.gch").is_file()


@needs_gcc
def test_pch_lock_symlink_is_not_followed(own_pch, tmp_path, monkeypatch):
    native.build(_prelude("a"), name="probe")
    d = _pch_dir(own_pch)
    (d / "lock").unlink()
    (d / "lock").symlink_to(tmp_path / "victim")  # dangling: open(..., "a") made the file
    monkeypatch.setattr(native.pch, "_ready", {})
    cc, flags = native.toolchain.find_compiler(), native.compile_flags()
    with pytest.warns(native.NativeFallbackWarning, match="precompiled headers off"):
        assert native.pch.header_for(_prelude("b"), flags, cc) is None  # no PCH, compiles go on
    assert not (tmp_path / "victim").exists()
    assert native.build(_prelude("b"), name="probe").tp_g() == 7


@needs_gcc
def test_pch_made_under_umask_000_is_reused(own_pch, monkeypatch):
    old = os.umask(0)
    try:
        native.build(_prelude("a"), name="probe")
    finally:
        os.umask(old)
    assert all(_sealed(p) for p in _pch_files(_pch_dir(own_pch)))
    monkeypatch.setattr(native.pch, "_ready", {})
    before = native.stats().pch_builds
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.build(_prelude("b"), name="probe").tp_g() == 7
    assert native.stats().pch_builds == before
