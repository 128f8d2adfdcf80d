"""Precompiled prelude headers (GCC): the headers every generated kernel starts with, parsed once
per compiler, flag set and cache instead of once per compile.

Reading them was about 0.1 s of user CPU in each compile at ``-mavx512*`` even with only the
enabled extensions' intrinsics (measured, gcc 12 on Zen 4: a tile library 0.41-0.51 s with the
headers parsed, 0.32-0.43 s with the PCH; the weight-pack kernel 0.15-0.18 s vs 0.06-0.08 s), and a
new GEMM shape compiles 5-8 libraries. Building the PCH takes about 0.5 s, once.

How it stays exact and safe:

- Only a source that begins with :data:`~torchport.native.prelude.HEADERS` takes the PCH, passed as
  ``-include <dir>/tp_headers.h`` with ``tp_headers.h.gch`` beside it. GCC reads the PCH when it
  was built with matching options and parses the header text otherwise; the source's own
  ``#include`` lines are then no-ops (include guards), so the object is the same either way.
- The PCH is content-addressed like the objects (compiler identity, flags, CPU features, header
  text), built by one process at a time (a file lock: PCH bytes differ from build to build; a
  compile that finds it being built parses the headers rather than wait), written through a
  private temporary directory and ``os.replace``, and its SHA-256 is checked against its record
  once per process before first use: GCC stops with an internal error on a damaged PCH instead
  of ignoring it. A damaged one is rebuilt with a
  :class:`~torchport.native.toolchain.CorruptCacheWarning`, and so is one whose header, PCH or
  record another user owns or can write, or is a symbolic link
  (:func:`~torchport.native.toolchain.read_private`: GCC trusts both files as input).
- A compile that fails with the PCH is retried without it (:func:`discard`, in
  ``toolchain.build``), and a PCH that cannot be built leaves compiles as they were.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from torchport import config
from torchport.native import toolchain
from torchport.native.prelude import HEADERS

PCH_VERSION = "1"
HEADER_NAME = "tp_headers.h"

_lock = threading.Lock()
_dir_locks: dict[str, threading.Lock] = {}
# PCH directory -> the header path to -include, or None where this process has no usable PCH
_ready: dict[str, Path | None] = {}


def _is_gcc(cc: str) -> bool:
    ident = toolchain.compiler_identity(cc).lower()
    return "gcc" in ident and "clang" not in ident


def _key(flags: Sequence[str], cc: str) -> str:
    return toolchain.cache_key(f"pch {PCH_VERSION}\n{HEADERS}", flags, cc)


def header_for(source: str, flags: Sequence[str], cc: str) -> Path | None:
    """The header to pass as ``-include`` for compiling ``source`` with ``flags`` (its PCH beside
    it), building the PCH on first use; None when the source does not start with the prelude's
    headers, the compiler is not GCC, no PCH could be made (also where another user could write
    its directory), or another thread or process is building it right now."""
    where = config.get("native_pch")
    if where == "off" or not source.startswith(HEADERS) or not _is_gcc(cc):
        return None
    pflags = [f for f in flags if f != "-shared"]
    key = _key(pflags, cc)
    # absolute: the compiler runs in a temporary directory
    base = Path(where).expanduser() if where else toolchain.native_dir() / "pch"
    d = base.absolute() / key[:24]
    memo = str(d)  # the cache directory may change within a process (config.override)
    with _lock:
        if memo in _ready:
            return _ready[memo]
        dir_lock = _dir_locks.setdefault(memo, threading.Lock())
    # A compile that finds the PCH being built (by another thread or process) parses the headers
    # instead of waiting: a new shape's first libraries compile while the PCH builds.
    if not dir_lock.acquire(blocking=False):
        return None
    try:
        with _lock:
            if memo in _ready:
                return _ready[memo]
        header: Path | None = d / HEADER_NAME
        try:
            # each level private, the missing parents of TORCHPORT_NATIVE_PCH too (mkdir with
            # parents=True makes them by the umask, which under umask 000 is writable by all:
            # check_private then refused every PCH)
            config.make_private_dirs(base.absolute())
            d.mkdir(mode=0o700, exist_ok=True)
            toolchain.check_private(d)  # GCC reads the PCH as trusted input: ours only
            # one builder at a time across processes (PCH bytes differ from build to build)
            with _open_lock(d) as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # builders hold the lock: any build folder here was left by a killed one
                toolchain.sweep_stale_builds(d, 0.0)
                if not _verified(d, key):
                    _build(d, pflags, cc, key)
        except BlockingIOError:
            return None  # another process holds it: not remembered, the next compile asks again
        except (OSError, subprocess.SubprocessError, toolchain.NativeError) as e:
            if toolchain.disk_full(e):
                return None  # a full disk passes: not remembered either
            # (once per folder and process: the None is remembered) compiles still work, each
            # parsing the headers itself, a few times slower; this said nothing of why
            warnings.warn(
                f"torchport: precompiled headers off for this process ({e}); set "
                "TORCHPORT_NATIVE_PCH to a private folder, or to 'off' to silence this",
                toolchain.NativeFallbackWarning,
                stacklevel=2,
            )
            header = None
        with _lock:
            _ready[memo] = header
        return header
    finally:
        dir_lock.release()


def discard(header: Path) -> None:
    """Stop using ``header``'s PCH in this process (a source failed to compile with it and
    compiled without it) and drop its record, so that the next process builds it anew."""
    with _lock:
        _ready[str(header.parent)] = None
    try:
        with _open_lock(header.parent) as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            (header.parent / "record.json").unlink(missing_ok=True)
    except OSError:
        pass


def _open_lock(d: Path) -> IO[bytes]:
    """``d``'s lock file, made if missing (:func:`~torchport.native.toolchain.open_regular`: a
    symbolic link there is not followed, a FIFO not waited on; either is an OSError)."""
    fd, _ = toolchain.open_regular(d / "lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return open(fd, "ab")


def _verified(d: Path, key: str) -> bool:
    """True if the PCH, its header and its record exist, are private (see
    :func:`~torchport.native.toolchain.read_private`; one that is not is removed, or
    UnsafeCacheError raised where it cannot be) and match the key and the prelude's headers."""
    gch, meta = d / f"{HEADER_NAME}.gch", d / "record.json"
    if not os.path.lexists(gch) or not os.path.lexists(meta):  # never built (record placed last)
        return False
    why = "failed verification"
    try:
        record = json.loads(toolchain.read_private(meta)[0])
        data = toolchain.read_private(gch)[0]
        ok = record.get("key") == key and record.get("sha256") == hashlib.sha256(data).hexdigest()
        ok = ok and toolchain.read_private(d / HEADER_NAME)[0] == HEADERS.encode()
    except toolchain.UnsafeCacheError as e:
        toolchain.remove_unsafe(e)
        ok, why = False, f"is not used: {e}; removed it"
    except (OSError, ValueError, AttributeError, RecursionError):  # (deeply nested JSON)
        ok = False
    if not ok:
        warnings.warn(
            f"torchport: precompiled header {d.name} {why}; rebuilding it",
            toolchain.CorruptCacheWarning,
            stacklevel=4,
        )
        with toolchain._lock:
            toolchain._stats.corrupt_rebuilds += 1
    return ok


def _build(d: Path, flags: Sequence[str], cc: str, key: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=d))
    try:
        (tmp / HEADER_NAME).write_text(HEADERS)
        cmd = [cc, *flags, "-x", "c-header", HEADER_NAME, "-o", f"{HEADER_NAME}.gch"]
        # (the environment of every cached build; its process group is killed on a timeout)
        res = toolchain.run_compiler(cmd, cwd=tmp, timeout=toolchain.COMPILE_TIMEOUT_S)
        if res.returncode != 0:
            full = toolchain._says_disk_full(res.stderr)  # (not remembered: see header_for)
            kind = toolchain.DiskFullError if full else toolchain.CompileError
            raise kind(f"precompiling the prelude headers failed: {res.stderr}")
        with toolchain._lock:
            toolchain._stats.pch_builds += 1
        record = {"key": key, "sha256": toolchain._digest(tmp / f"{HEADER_NAME}.gch"), "cmd": cmd}
        (tmp / "record.json").write_text(json.dumps(record))
        for name in (HEADER_NAME, f"{HEADER_NAME}.gch", "record.json"):
            toolchain.seal(tmp / name)
        os.replace(tmp / HEADER_NAME, d / HEADER_NAME)
        os.replace(tmp / f"{HEADER_NAME}.gch", d / f"{HEADER_NAME}.gch")
        os.replace(tmp / "record.json", d / "record.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
