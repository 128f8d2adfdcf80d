"""Persistent JSON cache of autotuning choices, safe for concurrent writers.

One file, ``<cache_dir>/autotune/choices-v1.json``, maps a content hash of (op, problem key,
machine identity, torch and torchport versions) to the chosen candidate and its timings. Reads are
served from memory (a hit is a dict lookup); a miss re-reads the file once in case another process
added the entry. Writes take an ``flock`` on a side lock file, merge with what is on disk, write a
temporary file and ``os.replace`` it, so no writer loses another's entries and no reader sees a
partial file. A corrupt or foreign file is ignored with a warning and rewritten.

A choice steers which kernel runs, so the file is trusted only as the native ``.so`` cache is
(:func:`torchport.native.toolchain.check_private`): in a directory only this user (or root) can
change, owned by this user or root and writable by no one else. Otherwise it is not read (one
:class:`UnsafeChoiceCacheWarning`); a file in a private directory is replaced by this user's own
on the next write, and with an unsafe directory choices last this process only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchport import config
from torchport.native.cpu import cpu_info
from torchport.native.toolchain import (
    NotRegularFileError,
    UnsafeCacheError,
    check_private,
    open_regular,
    unsafe_reason,
)
from torchport.version import __version__

FORMAT = "torchport-autotune-v1"
_CACHE_DIR = config.Snapshot("cache_dir")
# what a lookup reads, in one snapshot (a hit is on hot paths: reading them one by one cost more
# than the memo key's ISA and thread count added)
_LOOKUP = config.Snapshot("autotune_cache", "cache_dir")


class CorruptChoiceCacheWarning(UserWarning):
    """The choice cache file was unreadable and is being rewritten."""


class ChoiceCacheWriteWarning(UserWarning):
    """The choice cache could not be written: a choice is kept by this process only."""


class UnsafeChoiceCacheWarning(UserWarning):
    """The choice cache file or its directory could have been written by another user: its
    choices are not used."""


def machine_identity() -> dict[str, Any]:
    """What a timing depends on beyond the problem itself."""
    return {
        **cpu_info().identity(),
        "isa": cpu_info().isa,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchport": __version__,
    }


def entry_key(op: str, key: Mapping[str, Any]) -> str:
    """Stable hash of an op's problem key plus machine identity and versions."""
    blob = json.dumps(
        {"op": op, "key": key, "machine": machine_identity()}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _memo_key(op: str, key: Mapping[str, Any]) -> tuple[Any, ...]:
    """The in-memory memo's key for (op, key): beside the problem, what :func:`entry_key` hashes
    that can change within a process, the ISA level (``cpu_info().isa``: the ``isa`` setting
    capped by the fixed hardware) and the thread count; the rest of :func:`machine_identity` is
    fixed per process. Keyed on the problem alone, a hit after ``torch.set_num_threads`` served
    the choice tuned for the other thread count; keyed on the raw setting, "auto" and the level
    it resolves to (one entry in the file) had a memo each, and a choice replaced under one was
    still served from the other's."""
    return (
        op,
        json.dumps(key, sort_keys=True, default=str),
        cpu_info().isa,
        torch.get_num_threads(),
    )


def _timing(t: object) -> bool:
    """True for a time a measurement can give: a finite number of seconds >= 0 (JSON's NaN,
    Infinity, a negative or an int past float's range is none, and steered decisions as one)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return False
    try:
        return 0.0 <= float(t) < math.inf  # (False for NaN)
    except OverflowError:
        return False


def _well_formed(entry: object) -> bool:
    """True for an entry :func:`select` and the ops can use: a string choice and, if present,
    timings mapping names to :func:`_timing` values (a damaged entry with a list choice or
    string timings raised TypeError in every lookup of its problem)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("choice"), str):
        return False
    timings = entry.get("timings_s", {})
    return isinstance(timings, dict) and all(map(_timing, timings.values()))


class ChoiceCache:
    """In-memory view of the persistent choice file."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._entries: dict[str, dict[str, Any]] = {}
        self._loaded_from: tuple[str, float] | None = None
        self._lock = threading.Lock()
        # _memo_key(op, key) → entry, for hits without hashing the machine identity again
        self._memo: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._dir: tuple[Any, ...] | None = None  # the cache_dir the views above belong to
        # (cache_dir, memo) as one object, read once by the lock-free hit path: a memo taken
        # from it is the one of that directory even while another thread switches directories
        self._view: tuple[tuple[Any, ...] | None, dict[tuple[Any, ...], dict[str, Any]]] = (
            None,
            self._memo,
        )
        self._warned_unsafe: set[str] = set()  # paths whose refusal was reported

    @property
    def path(self) -> Path:
        if self._path is not None:
            return self._path
        return config.cache_path("autotune") / "choices-v1.json"

    def _unsafe(self, p: Path, why: str) -> None:
        """Report once per path that ``p`` is not trusted (see the module docstring)."""
        if str(p) in self._warned_unsafe:
            return
        self._warned_unsafe.add(str(p))
        warnings.warn(
            f"torchport: not using the autotune cache {p}: {why}; choices are re-tuned",
            UnsafeChoiceCacheWarning,
            stacklevel=4,
        )

    def _private_dir(self, p: Path, create: bool = False) -> bool:
        """True if only this user (or root) can change ``p``'s directory (else reported).
        A missing directory is made (mode 0700, as the default one) when ``create``, else it
        holds nothing to read: False, unreported. (``ChoiceCache(path)`` in a directory not made
        yet reported "cannot check ... No such file or directory" and never wrote the file.)"""
        if not p.parent.is_dir():
            if not create:
                return False
            try:
                config.make_private_dirs(p.parent)
            except OSError as e:
                self._unsafe(p, f"cannot create its directory: {e}")
                return False
        try:
            check_private(p.parent)
        except UnsafeCacheError as e:
            self._unsafe(p, str(e))
            return False
        return True

    def _read_disk(self) -> dict[str, dict[str, Any]]:
        p = self.path
        if not self._private_dir(p):
            return {}
        try:
            with open(open_regular(p, os.O_RDONLY)[0], "rb") as f:
                # the stat of what was opened: a file swapped in after a check is not read
                why = unsafe_reason(os.fstat(f.fileno()), os.geteuid(), leaf=True)
                if why is not None:
                    self._unsafe(p, f"the file {why}")
                    return {}
                raw = f.read()
        except FileNotFoundError:
            return {}
        except NotRegularFileError as e:  # (in a private directory: this user's; os.replace'd)
            warnings.warn(
                f"torchport: ignoring the autotune cache: {e}; it will be rewritten",
                CorruptChoiceCacheWarning,
                stacklevel=3,
            )
            return {}
        except OSError as e:
            warnings.warn(f"torchport: cannot read {p}: {e}", CorruptChoiceCacheWarning, 2)
            return {}
        try:
            # bytes, not read_text(): a damaged file that is not UTF-8 is corrupt like any other
            # (UnicodeDecodeError is a ValueError), where read_text() raised it from every lookup
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("unexpected format")
            entries = data["entries"]
            if not isinstance(entries, dict):
                raise ValueError("entries is not an object")
            kept = {k: v for k, v in entries.items() if _well_formed(v)}
        except (ValueError, KeyError, RecursionError) as e:  # (deep nesting: RecursionError)
            warnings.warn(
                f"torchport: ignoring corrupt autotune cache {p} ({e}); it will be rewritten",
                CorruptChoiceCacheWarning,
                stacklevel=3,
            )
            return {}
        if len(kept) < len(entries):
            warnings.warn(
                f"torchport: ignoring {len(entries) - len(kept)} malformed entries of the autotune "
                f"cache {p}; they will be re-tuned",
                CorruptChoiceCacheWarning,
                stacklevel=3,
            )
        return kept

    def _refresh(self) -> None:
        try:
            p = self.path
        except OSError as e:  # the cache directory cannot be made: the memory view serves alone
            warnings.warn(
                f"torchport: autotune cache unusable ({e}); choices last this process only",
                ChoiceCacheWriteWarning,
                stacklevel=3,
            )
            return
        try:
            stamp = (str(p), p.stat().st_mtime)
        except OSError:
            stamp = (str(p), -1.0)
        if stamp != self._loaded_from:
            self._entries = self._read_disk()
            self._loaded_from = stamp

    def get(self, op: str, key: Mapping[str, Any]) -> dict[str, Any] | None:
        """The cached entry for (op, key) on this machine, or None."""
        use, cache_dir = _LOOKUP()
        if not use:
            return None
        where = None if self._path is not None else (cache_dir,)  # (as _where)
        memo_key = _memo_key(op, key)
        view_dir, memo = self._view
        if view_dir == where:
            hit = memo.get(memo_key)
            if hit is not None:
                return hit
        k = entry_key(op, key)
        with self._lock:
            self._switch_dir(where)
            hit = self._entries.get(k)
            if hit is None:
                self._refresh()
                hit = self._entries.get(k)
            if hit is not None:
                self._memo[memo_key] = hit
            return hit

    def _where(self) -> tuple[Any, ...] | None:
        """The cache directory setting this call serves (None for a cache with its own path):
        read once per call, as ``config.override`` may give each thread its own."""
        return None if self._path is not None else _CACHE_DIR()

    def _switch_dir(self, where: tuple[Any, ...] | None) -> None:
        """Make the views serve cache directory ``where``, dropping another one's (the caller
        holds ``self._lock``, so no lookup reads or fills them half switched; under a lock
        taken after the directory check, two threads with their own ``config.override`` of
        ``cache_dir`` were served each other's choices)."""
        if where == self._dir:
            return
        self._entries = {}
        self._memo = {}  # a new object: the GEMM engine drops what it settled from the old
        self._loaded_from = None
        self._dir = where
        self._view = (where, self._memo)

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        lock_path = self.path.with_suffix(".lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_regular(lock_path, os.O_RDWR | os.O_CREAT)[0]
        except NotRegularFileError as e:
            # (open(lock_path, "a+") followed a symbolic link, and failed on a FIFO, "not
            # seekable", in every write from then on.) The directory is private (checked by
            # the caller): what is there is this user's own; it is replaced by a new lock file.
            # Two writers replacing it at once may each lock a file of its own, that once: the
            # choice file stays whole (os.replace), an entry may be lost and is tuned again.
            warnings.warn(
                f"torchport: replacing the autotune cache's lock file: {e}",
                CorruptChoiceCacheWarning,
                stacklevel=5,
            )
            lock_path.unlink(missing_ok=True)
            fd = open_regular(lock_path, os.O_RDWR | os.O_CREAT)[0]
        with open(fd, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def put(
        self, op: str, key: Mapping[str, Any], choice: str, timings: Mapping[str, float]
    ) -> None:
        """Record a choice (merged atomically with the entries other processes wrote).

        Raises ValueError for a timing that is not a finite number >= 0: every later read would
        drop the entry as malformed, and its problem be tuned again in every process."""
        bad = {name: t for name, t in timings.items() if not _timing(t)}
        if bad:
            raise ValueError(f"timings must be finite numbers of seconds >= 0, got {bad}")
        k = entry_key(op, key)
        entry = {
            "op": op,
            "key": json.loads(json.dumps(key, default=str)),
            "choice": choice,
            "timings_s": dict(timings),
            "time": time.time(),
        }
        where = self._where()
        with self._lock:
            self._switch_dir(where)
            self._entries[k] = entry
            # a replaced choice must not be served from the lookup memo
            self._memo.pop(_memo_key(op, key), None)
            if not config.get("autotune_cache"):
                return
            try:
                self._write(k, entry)
            except OSError as e:  # read-only or forbidden cache: the tuning result still counts
                warnings.warn(
                    f"torchport: cannot write the autotune cache ({e}); the choice for {op} "
                    "lasts this process only",
                    ChoiceCacheWriteWarning,
                    stacklevel=2,
                )

    def _write(self, k: str, entry: dict[str, Any]) -> None:
        """Merge ``entry`` into the file under its lock (the caller holds ``self._lock``)."""
        p = self.path
        if not self._private_dir(p, create=True):  # (reported): lasts this process only
            return
        with self._file_lock():
            merged = self._read_disk()
            merged[k] = entry
            fd, tmp = tempfile.mkstemp(prefix=".choices-", dir=p.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._entries = merged
            self._loaded_from = (str(p), p.stat().st_mtime)

    def entries(self) -> dict[str, dict[str, Any]]:
        """All entries currently on disk (for `torchport info` and reports)."""
        where = self._where()
        with self._lock:
            self._switch_dir(where)
            self._refresh()
            return dict(self._entries)

    def clear_memory(self) -> None:
        """Forget the in-memory view (next lookup re-reads the file)."""
        with self._lock:
            self._entries = {}
            self._memo = {}
            self._loaded_from = None
            self._dir = None
            self._view = (None, self._memo)


choice_cache = ChoiceCache()
