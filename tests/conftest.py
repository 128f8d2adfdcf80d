"""Shared test set-up: an isolated torchport cache for the whole session (inherited by children)."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile

import pytest

# Set before torchport is imported anywhere so every process of the run shares one cache (the
# xdist workers and the tests' subprocesses inherit it). The process that made it removes it at
# exit: each run left one (130 MB with its kernels and headers) in the temporary directory.
_SESSION_CACHE = os.environ.get("TORCHPORT_CACHE_DIR") or ""
if not _SESSION_CACHE:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="torchport-test-cache-")
    os.environ["TORCHPORT_CACHE_DIR"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, True)
# one set of precompiled kernel headers for the run (~20 MB each), also under fresh_cache
os.environ.setdefault("TORCHPORT_NATIVE_PCH", os.path.join(_SESSION_CACHE, "pch"))
os.environ.setdefault("TORCHPORT_PROGRESS", "0")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A private, empty cache directory for one test."""
    from torchport.autotune import choice_cache
    from torchport.gemm import epilogue

    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "cache"))
    # constant scales compile in as in a fresh process (past epilogue.SCALE_CONSTANTS distinct
    # values a process passes new ones as operands: tests of a new value's compilation use this)
    monkeypatch.setattr(epilogue, "_scale_constants", set())
    choice_cache.clear_memory()
    yield tmp_path / "cache"
    choice_cache.clear_memory()


class ParsedArgs(Exception):
    """Raised by :func:`parse_only` after a parser accepted its arguments (``args[0]``: the
    namespace): nothing else of the script runs."""


@pytest.fixture
def parse_only(monkeypatch):
    """Make every ``ArgumentParser.parse_args`` raise :class:`ParsedArgs` once it has parsed, so
    a tool's ``main`` only checks its options; yields that exception class."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise ParsedArgs(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    return ParsedArgs


class FakeClock:
    """The tuner's clock in tests: it moves only when a fake kernel adds its cost to ``t``
    (exact, load-free timings)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    """A :class:`FakeClock` in place of the tuner's timing clock, with an empty confirmation
    memo."""
    from torchport.autotune import timing, tuner

    c = FakeClock()
    monkeypatch.setattr(timing, "clock", c)
    monkeypatch.setattr(tuner, "_confirmed", {})
    return c
