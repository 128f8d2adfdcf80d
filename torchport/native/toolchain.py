"""C source → system compiler → content-addressed shared-object cache → ctypes.

``build(source, name=...)`` returns a loaded :class:`ctypes.CDLL`. The cache key is a SHA-256 of
the source, the compiler's identity (path and ``--version``), the flags, the CPU features and the
toolchain's own ABI version, so a change to any of them builds anew. Entries live under
``<cache_dir>/native/<key[:2]>/<name>-<key[:24]>.so`` next to a ``.json`` record of the object's
digest. Writes go to a private temporary directory, then ``os.replace`` into place, so several
processes may build the same kernel at once; an entry whose digest does not match (truncated,
overwritten, corrupt) is rebuilt with a warning. The directories (:func:`check_private`) and each
file of an entry (:func:`read_private`) must be changeable by this user (and root) only: an entry
another user owns or can write, or a symbolic link, is removed and rebuilt (refused where it
cannot be removed), never loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import grp
import hashlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchport import config
from torchport.native import pch
from torchport.native.cpu import ISA_LEVELS, cpu_info, isa_flags

ABI_VERSION = "1"
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-w")
COMPILE_TIMEOUT_S = 120.0


class NativeError(RuntimeError):
    """Base class for failures of the native toolchain."""


class CompilerNotFoundError(NativeError):
    """No usable C compiler was found."""


class CompileError(NativeError):
    """The C compiler rejected a generated kernel; the message carries its output."""


class CacheUnavailableError(NativeError):
    """The cache directory cannot be created or written (read-only, no permission, a file)."""


class DiskFullError(CacheUnavailableError):
    """No space (or quota) was left where a build writes (the cache, the compiler's TMPDIR): a
    passing condition, so the build is not remembered as failed and a later call tries again."""


class UnsafeCacheError(NativeError):
    """The cache directory could be changed by another user: no object is loaded from it."""


class CorruptCacheWarning(UserWarning):
    """A cache entry failed verification and was rebuilt."""


class NativeFallbackWarning(UserWarning):
    """A native kernel was unavailable and an ATen path ran instead."""


@dataclass
class Stats:
    """Counters readable from Python: ``torchport.native.stats()``."""

    compiles: int = 0
    disk_hits: int = 0
    memory_hits: int = 0
    corrupt_rebuilds: int = 0
    fallbacks: int = 0
    pch_builds: int = 0


_stats = Stats()
_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
_loaded: dict[str, ctypes.CDLL] = {}
_warned_fallback: set[str] = set()
_private_dirs: set[str] = set()  # directories this process found safe to load code from
# key -> message of the CompileError its build raised: a source the compiler rejects (or hangs
# on) is not compiled again on every call of its op (each call paid a whole failing compile,
# ~0.1-0.5 s, or the whole timeout)
_failed: dict[str, str] = {}
fallback_counts: dict[str, int] = {}


def stats() -> Stats:
    """Current toolchain counters (a snapshot)."""
    with _lock:
        return Stats(**vars(_stats))


def reset_stats() -> None:
    """Zero all counters (for tests and benchmarks)."""
    global _stats
    with _lock:
        _stats = Stats()
        fallback_counts.clear()


def find_compiler() -> str:
    """Path of the C compiler to use, or raise :class:`CompilerNotFoundError`."""
    names = [config.get("cc")] if config.get("cc") else []
    names += [os.environ.get("CC", ""), "gcc", "cc"]
    tried: list[str] = []
    for name in names:
        if not name:
            continue
        tried.append(name)
        path = shutil.which(name)
        if path:
            return path
        if config.get("cc"):  # an explicit choice that is missing is an error, not a fallback
            break
    raise CompilerNotFoundError(
        f"no C compiler found (tried {tried}); install gcc or set TORCHPORT_CC to a compiler path"
    )


IDENTITY_TIMEOUT_S = 30.0


def compiler_identity(cc: str) -> str:
    """First line of ``cc --version`` plus the resolved path (part of every cache key)."""
    ident, error = _identity(cc)
    if ident is None:
        raise CompilerNotFoundError(error)
    return ident


# Variables through which gcc (its driver, cc1, the assembler, the linker) takes include
# directories, tool paths, libraries or extra options from the environment. None of them is part
# of a kernel's cache key: an omp.h injected through CPATH was compiled in, and the object then
# served from the cache to every later process, whatever its environment.
_COMPILER_ENV = (
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "LIBRARY_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "GCC_COMPARE_DEBUG",
    "DEPENDENCIES_OUTPUT",
    "SUNPRO_DEPENDENCIES",
    "SOURCE_DATE_EPOCH",
    "LD_RUN_PATH",
    "GCC_ROOT",
)


def compiler_env() -> dict[str, str]:
    """This process's environment without the variables that change what gcc compiles or links
    (:data:`_COMPILER_ENV`), for every compiler run whose output is cached."""
    return {k: v for k, v in os.environ.items() if k not in _COMPILER_ENV}


def run_compiler(
    cmd: Sequence[str], *, timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (a compiler) with :func:`compiler_env`, capturing its text output.

    It runs in a session of its own, and on a timeout (or an interrupt) the whole process group
    is killed and reaped before :class:`subprocess.TimeoutExpired` is raised: killing the driver
    alone left its cc1, as or ld running (and holding our pipes) after a hang."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=compiler_env(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


# how long a timed-out or interrupted compiler gets between SIGTERM and SIGKILL: gcc's driver
# removes its temporaries (cc*.s, cc*.o, cc*.res in $TMPDIR) on SIGTERM, and SIGKILL at once left
# them behind, one set per killed build
KILL_GRACE_S = 1.0


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM ``proc``'s process group, wait up to :data:`KILL_GRACE_S` for ``proc`` to exit
    (gcc cleans up its temporaries), then SIGKILL the group (a member ignoring SIGTERM) and reap
    ``proc``. The leader is not reaped before the SIGKILL, so the group's id (the leader's pid)
    is not reused meanwhile; a member that left the group may keep the pipes open: bounded wait."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while proc.returncode is None and time.monotonic() < deadline:
        try:  # (WNOWAIT: exited, left unreaped)
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
        except ChildProcessError:
            break
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5.0)
    proc.wait()


@functools.cache
def _identity(cc: str) -> tuple[str | None, str]:
    """``(identity, "")``, or ``(None, why)`` for a compiler that cannot run: remembered too, or a
    compiler hanging on ``--version`` cost every build() of the process, each call of every op
    falling back to ATen, the whole timeout again."""
    try:
        out = run_compiler([cc, "--version"], timeout=IDENTITY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"C compiler {cc!r} cannot run: {e}"
    first = (out.stdout or out.stderr).splitlines()[:1]
    return f"{os.path.realpath(cc)}|{first[0] if first else 'unknown'}", ""


def native_dir() -> Path:
    """Directory holding compiled objects."""
    return config.cache_path("native")


def cache_key(source: str, flags: Sequence[str], cc: str) -> str:
    """Content hash identifying one compiled object."""
    h = hashlib.sha256()
    for part in (
        ABI_VERSION,
        compiler_identity(cc),
        " ".join(flags),
        ",".join(sorted(cpu_info().flags)),
        cpu_info().arch,
        source,
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def _own_group(gid: int) -> bool:
    """True for this user's private group (same name, no other members, the primary group of no
    other user): a directory writable by it, as ``umask 002`` makes them on user-private-group
    systems, is writable by this user only. (``gr_mem`` lists supplementary members only: a user
    whose primary group it is was not counted. Users that the password database does not list,
    as some directory services, are not seen.)"""
    try:
        me = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    user = me.pw_name
    if gid != os.getegid() or group.gr_name != user or not set(group.gr_mem) <= {user}:
        return False
    return all(u.pw_gid != gid or u.pw_uid == me.pw_uid for u in pwd.getpwall())


def unsafe_reason(st: os.stat_result, euid: int, *, leaf: bool) -> str | None:
    """Why a path with stat ``st`` may hold what another user planted, or None if it is safe for
    user ``euid`` to trust: the policy :func:`check_private` applies to every directory up to
    ``/`` and the autotuner applies to its choice file (a pure function of the stat result).

    The owner must be ``euid`` or root (root can change anything anyway, so a root-owned
    directory or file that no one else can write, as a system-wide read-only cache or a
    bind-mounted folder, is as safe as our own). Writable by group (unless it is this user's
    private group) or by others is refused for a ``leaf`` (the directory holding the entries,
    or the file itself: anyone could add or rewrite one) and for an ancestor without the sticky
    bit (anyone could rename our entries away and put theirs in place), not for a sticky one
    (``/tmp``)."""
    if st.st_uid not in (euid, 0):
        return f"must be owned by this user (uid {euid}) or root, got uid {st.st_uid}"
    mode = stat.S_IMODE(st.st_mode)
    shared = mode & 0o002 or (mode & 0o020 and not _own_group(st.st_gid))
    if shared and (leaf or not mode & stat.S_ISVTX):
        return f"must not be writable by other users, got mode {oct(mode)} (group {st.st_gid})"
    return None


def check_private(d: Path) -> None:
    """Raise :class:`UnsafeCacheError` unless only this user (and root) can change what directory
    ``d`` holds, so that an object found there was written by this user.

    Every directory from ``d`` up to ``/`` (along the path as given and along its resolved one)
    must pass :func:`unsafe_reason` (``d`` itself as the leaf). Checked once per directory per
    process."""
    given = Path(os.path.abspath(d))  # (a relative cache directory moves with os.chdir)
    if str(given) in _private_dirs:
        return
    try:
        found = first_unsafe_dir(d)
    except OSError as e:
        raise UnsafeCacheError(f"cannot check native cache directory {e.filename}: {e}") from e
    if found is not None:
        p, st, why = found
        # (chmod alone does not vouch for what others put there meanwhile: read_private then
        # refuses each entry another user owns or can write, and it is rebuilt)
        fix = (
            f"run `chmod go-w {p}` (entries that another user owns or can write are then "
            "removed and rebuilt, never loaded) or point"
            if st.st_uid in (os.geteuid(), 0)
            else "point"
        )
        raise UnsafeCacheError(
            f"native cache directory {p} {why}: no kernel is loaded from it; {fix} "
            "TORCHPORT_CACHE_DIR at a directory of your own"
        )
    _private_dirs.add(str(given))


def first_unsafe_dir(d: Path | str) -> tuple[Path, os.stat_result, str] | None:
    """The first directory from ``d`` up to ``/`` (along the path as given and along its
    resolved one) that :func:`unsafe_reason` refuses (``d`` itself as the leaf), with its stat
    and the reason; None if every one passes. ``OSError`` (its ``filename`` the directory)
    where one cannot be examined."""
    euid = os.geteuid()
    for top in {Path(os.path.abspath(d)), Path(os.path.realpath(d))}:
        for p in (top, *top.parents):
            st = os.stat(p)
            why = unsafe_reason(st, euid, leaf=p == top)
            if why is not None:
                return p, st, why
    return None


class _UnsafeEntryError(UnsafeCacheError):
    """A file of a cache entry that another user may have planted (``path``)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"native cache file {path} {why}")
        self.path = path


class NotRegularFileError(OSError):
    """:func:`open_regular` found something other than a regular file at a path: ``st`` is what
    is there (None: a symbolic link, not followed)."""

    def __init__(self, path: Path, st: os.stat_result | None) -> None:
        got = "a symbolic link" if st is None else stat.filemode(st.st_mode)
        super().__init__(f"{path} must be a regular file, got {got}")
        self.path, self.st = path, st


def open_regular(path: Path, flags: int, mode: int = 0o600) -> tuple[int, os.stat_result]:
    """``os.open(path, flags)`` of a regular file only, with the stat of what was opened, else
    :class:`NotRegularFileError`: a symbolic link is not followed (``O_NOFOLLOW``) and a FIFO is
    not waited on (``O_NONBLOCK``: opening one blocked until some process wrote to it). A file
    made here (``O_CREAT``) gets ``mode``. What the caches open where another user might have
    planted something (:func:`read_private`, the autotuner's choice file and its lock)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFileError(path, None) from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(path, st)
    os.set_blocking(fd, True)  # (no effect on a regular file; cleared all the same)
    return fd, st


def read_private(path: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of the cache file ``path`` and the stat of the file they were read from.

    Raises FileNotFoundError where it does not exist, and :class:`UnsafeCacheError` where it may
    hold what another user planted: a symbolic link (not followed), not a regular file, or a file
    :func:`unsafe_reason` refuses (owned by another user, writable by others). The checks are of
    the opened file (``fstat``), so a file swapped in after them is not what is read; a directory
    that passed :func:`check_private` lets no one else swap the path before it is loaded."""
    try:
        fd, st = open_regular(path, os.O_RDONLY)
    except NotRegularFileError as e:
        if e.st is None:
            raise _UnsafeEntryError(path, "must not be a symbolic link, got one") from e
        raise _UnsafeEntryError(
            path, f"must be a regular file, got {stat.filemode(e.st.st_mode)} (uid {e.st.st_uid})"
        ) from e
    with open(fd, "rb") as f:
        euid = os.geteuid()
        why = unsafe_reason(st, euid, leaf=True)
        if why is not None:  # (it names the owner or the mode at fault; the message names both)
            foreign = st.st_uid not in (euid, 0)
            other = f"mode {oct(stat.S_IMODE(st.st_mode))}" if foreign else f"uid {st.st_uid}"
            raise _UnsafeEntryError(path, f"{why} ({other})")
        return f.read(), st


def remove_unsafe(e: UnsafeCacheError) -> None:
    """Remove the file that :func:`read_private` refused with ``e`` (the entry is then rebuilt),
    or raise :class:`UnsafeCacheError` naming it where it cannot be removed."""
    assert isinstance(e, _UnsafeEntryError), e
    try:
        e.path.unlink(missing_ok=True)
    except OSError as err:
        raise UnsafeCacheError(
            f"{e}: nothing is loaded from it, and it cannot be removed ({err}); remove it or "
            "point TORCHPORT_CACHE_DIR at a directory of your own"
        ) from err


def seal(path: Path) -> None:
    """Clear group and other write permission on a file about to enter the cache: one written
    under ``umask 000`` would be refused by :func:`read_private` (and rebuilt) in every process."""
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~0o022)


# A build's temporary folder (``.build-*``) lives at most COMPILE_TIMEOUT_S; one much older was
# left by a killed process and is removed when its cache directory is first opened
STALE_BUILD_S = 3600.0
_swept: set[str] = set()  # directories swept by this process


def sweep_stale_builds(d: Path, max_age_s: float = STALE_BUILD_S) -> int:
    """Remove ``d``'s ``.build-*`` folders last modified more than ``max_age_s`` ago (once per
    directory per process); returns how many went. Errors are ignored: another process may be
    sweeping the same folder."""
    memo = f"{os.path.abspath(d)}\0{max_age_s}"
    with _lock:
        if memo in _swept:
            return 0
        _swept.add(memo)
    cutoff = time.time() - max_age_s
    removed = 0
    try:
        stale = [p for p in d.glob(".build-*") if p.is_dir() and p.stat().st_mtime < cutoff]
    except OSError:
        return 0
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
        removed += not p.exists()
    return removed


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how cc1, as and ld report those errnos (strerror; the C locale's words too, should this
# process's differ)
_DISK_FULL_TEXTS = {
    *map(os.strerror, _DISK_FULL_ERRNOS),
    "No space left on device",
    "Disk quota exceeded",
}


def disk_full(e: BaseException) -> bool:
    """True if ``e`` says no space or quota was left: not a fault of what was being built."""
    if isinstance(e, DiskFullError):
        return True
    return isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS


def _says_disk_full(output: str) -> bool:
    """True if a failed compiler's ``output`` reports no space or quota left."""
    return any(text in output for text in _DISK_FULL_TEXTS)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_paths(name: str, key: str) -> tuple[Path, Path]:
    try:
        d = native_dir() / key[:2]
        d.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:  # callers fall back on NativeError, not on a bare OSError
        raise CacheUnavailableError(
            f"native cache directory under {config.get('cache_dir')!r} is unusable: {e}; "
            "set TORCHPORT_CACHE_DIR to a writable directory"
        ) from e
    check_private(d)
    sweep_stale_builds(d)
    stem = f"{name}-{key[:24]}"
    return d / f"{stem}.so", d / f"{stem}.json"


def _verified(so: Path, meta: Path, key: str) -> os.stat_result | None:
    """The stat of the object read if both files exist, are private (:func:`read_private`) and
    the object's digest matches its record; else None.

    A file that is not private is removed (or :class:`UnsafeCacheError` raised where it cannot
    be) and the entry rebuilt, with a warning, like a corrupt one."""
    if not os.path.lexists(so):  # never built (the record is placed before the object)
        return None
    st: os.stat_result | None = None
    why = "failed verification"
    try:
        obj, st = read_private(so)
        record = json.loads(read_private(meta)[0])
        if record.get("key") != key or record.get("sha256") != hashlib.sha256(obj).hexdigest():
            st = None
    except UnsafeCacheError as e:
        remove_unsafe(e)
        st, why = None, f"is not loaded: {e}; removed it"
    except (OSError, ValueError, AttributeError, RecursionError):  # (deeply nested JSON)
        st = None
    if st is None:
        warnings.warn(
            f"torchport: cache entry {so.name} {why}; rebuilding it",
            CorruptCacheWarning,
            stacklevel=5,
        )
        with _lock:
            _stats.corrupt_rebuilds += 1
    return st


def _loadable(so: Path, meta: Path, key: str) -> bool:
    """True if the entry verifies and ``so`` still names the very file verified, right before
    it is loaded by path (``dlopen`` of ``/proc/self/fd/N`` is no way round: glibc matches an
    already-loaded object by that name, so a later kernel opened under a reused descriptor
    number got the first one's library). Only this user or root can rename in the entry's
    directory (:func:`check_private`) or write a verified file, so the path cannot change
    between this check and the load but by them. A concurrent builder's replacement of the
    entry is verified anew (a few times, then the caller builds it itself)."""
    for _ in range(3):
        st = _verified(so, meta, key)
        if st is None:
            return False
        with contextlib.suppress(OSError):
            now = os.lstat(so)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False


def _compile(
    source: str,
    flags: Sequence[str],
    cc: str,
    so: Path,
    meta: Path,
    key: str,
    header: Path | None = None,
) -> None:
    try:
        _compile_in(source, flags, cc, so, meta, key, header)
    except OSError as e:  # the cache, not the compiler (whose OSErrors are typed below)
        kind = DiskFullError if disk_full(e) else CacheUnavailableError
        raise kind(f"cannot write kernel {so.stem} into the native cache {so.parent}: {e}") from e


def _compile_in(
    source: str,
    flags: Sequence[str],
    cc: str,
    so: Path,
    meta: Path,
    key: str,
    header: Path | None,
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=so.parent))
    try:
        # A fixed relative file name keeps the object bytes independent of the temp directory,
        # so concurrent builders produce identical files.
        (tmp / "kernel.c").write_text(source)
        pre = ["-include", str(header)] if header is not None else []
        cmd = [cc, *flags, *pre, "kernel.c", "-o", "kernel.so", "-lm"]
        try:
            res = run_compiler(cmd, cwd=tmp, timeout=COMPILE_TIMEOUT_S)
        except OSError as e:  # missing, or not executable
            raise CompilerNotFoundError(f"C compiler {cc!r} cannot run: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"compiler timed out after {COMPILE_TIMEOUT_S:g} s: {cmd}") from e
        with _lock:
            _stats.compiles += 1
        if res.returncode != 0:
            lines = (res.stderr or res.stdout).strip().splitlines()
            said = "\n".join(lines[-40:])
            if _says_disk_full(said):  # (not remembered: see build)
                raise DiskFullError(
                    f"{cc} needs free disk space to build kernel {so.stem} (in {so.parent} and "
                    f"the compiler's TMPDIR), got exit {res.returncode}:\n{said}"
                )
            raise CompileError(f"{cc} failed (exit {res.returncode}) on kernel {so.stem}:\n{said}")
        record = {"key": key, "sha256": _digest(tmp / "kernel.so"), "cmd": cmd}
        (tmp / "kernel.json").write_text(json.dumps(record))
        seal(tmp / "kernel.so")
        seal(tmp / "kernel.json")
        os.replace(tmp / "kernel.json", meta)  # record first: an object never lacks one
        os.replace(tmp / "kernel.so", so)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compile_flags(isa: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """Full flag list for an ISA level (default: the CPU's level under ``config.isa``).

    A level above the hardware's is allowed (objects for another x86 machine build and load;
    their kernels must not run here); an unknown name is a ValueError, where "AVX512" or "avx-512"
    used to compile silently at the avx2 level."""
    if isa is not None and isa not in ISA_LEVELS:
        raise ValueError(f"isa must be one of {ISA_LEVELS}, got {isa!r}")
    return [*BASE_FLAGS, *isa_flags(isa or cpu_info().isa), *extra]


def build(
    source: str, *, name: str, isa: str | None = None, extra_flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """Compile ``source`` (or take it from the cache) and load it.

    Raises :class:`CompilerNotFoundError` or :class:`CompileError`, :class:`UnsafeCacheError`
    where another user could write the cache directory (or the entry's files, where they cannot
    be removed) and :class:`CacheUnavailableError` where it cannot be written
    (:class:`DiskFullError` where a disk is full); never returns a stale object. A CompileError (a rejection or a timeout) is remembered for the process: later calls
    raise it again at once. The other errors are not: a later call tries again.
    """
    if not name.replace("_", "").isalnum():
        raise ValueError(f"kernel name must be alphanumeric/underscore, got {name!r}")
    cc = find_compiler()
    flags = compile_flags(isa, extra_flags)
    key = cache_key(source, flags, cc)
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            _stats.memory_hits += 1
            return lib
        failed = _failed.get(key)
        key_lock = _key_locks.setdefault(key, threading.Lock())
    if failed is not None:  # a new exception each time: re-raising one would grow its traceback
        raise CompileError(f"{failed}\n(failed before in this process; not compiled again)")
    with key_lock:
        with _lock:
            if key in _loaded:
                _stats.memory_hits += 1
                return _loaded[key]
        so, meta = _entry_paths(name, key)
        if _loadable(so, meta, key):
            try:
                lib = ctypes.CDLL(str(so))
                with _lock:
                    _stats.disk_hits += 1
            except OSError as e:
                warnings.warn(
                    f"torchport: cached {so.name} does not load ({e}); rebuilding it",
                    CorruptCacheWarning,
                    stacklevel=2,
                )
                with _lock:
                    _stats.corrupt_rebuilds += 1
                lib = None
        else:
            lib = None
        if lib is None:
            try:
                lib = _compile_and_load(source, flags, cc, so, meta, key)
            except CompileError as e:
                # remembered, a timeout too: a hanging compiler cost every later call of the op
                # the whole COMPILE_TIMEOUT_S again, each one falling back to ATen at the end
                with _lock:
                    _failed[key] = str(e)
                raise
        with _lock:
            _loaded[key] = lib
        return lib


def _compile_and_load(
    source: str, flags: Sequence[str], cc: str, so: Path, meta: Path, key: str
) -> ctypes.CDLL:
    """Build the entry (with the precompiled headers if any, retried without them) and load it."""
    header = pch.header_for(source, flags, cc)
    failed_with: Path | None = None
    try:
        _compile(source, flags, cc, so, meta, key, header)
    except CompileError as e:
        if header is None or isinstance(e.__cause__, subprocess.TimeoutExpired):
            raise
        failed_with = header
    if failed_with is not None:  # outside the handler: a faulty source's error alone
        _compile(source, flags, cc, so, meta, key)
        pch.discard(failed_with)  # it compiles without the precompiled headers only
    try:
        return ctypes.CDLL(str(so))
    except OSError as e:  # e.g. an undeclared function, left undefined by the compiler
        raise CompileError(f"kernel {so.stem} was compiled but does not load: {e}") from e


def note_fallback(op: str, reason: BaseException | str) -> None:
    """Record that ``op`` ran its ATen path; warn once per op (visible, counted fallback)."""
    with _lock:
        _stats.fallbacks += 1
        fallback_counts[op] = fallback_counts.get(op, 0) + 1
        first = op not in _warned_fallback
        _warned_fallback.add(op)
    if first:
        warnings.warn(
            f"torchport: native kernel for {op} unavailable, using ATen ({reason})",
            NativeFallbackWarning,
            stacklevel=3,
        )


def cache_size() -> tuple[int, int]:
    """(number of objects, total bytes) in the native cache (builds in progress, or left by a
    killed process, in ``.build-*`` folders, do not count)."""
    d = native_dir()
    files = [
        p
        for p in d.rglob("*.so")
        if p.is_file() and not any(q.startswith(".build-") for q in p.relative_to(d).parts)
    ]
    return len(files), sum(p.stat().st_size for p in files)
