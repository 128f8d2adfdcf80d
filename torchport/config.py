"""Typed, validated settings for torchport, each backed by one documented environment variable.

Every setting is declared once in ``SETTINGS``. A value is resolved, in order, from the innermost
active :func:`override` block, an explicit assignment (``torchport.config.NAME = value``), the
environment variable, then the default. An environment variable set to the empty string counts
as unset (``TORCHPORT_CACHE_DIR= cmd`` uses the default), as most tools treat one. White space
around a value is ignored, for text settings (paths, names) as for numbers and booleans.
Assignments and overrides are validated on the spot; a bad environment value raises
:class:`ConfigError` naming the variable when it is first read. Assigning a name that is no
setting (a misspelling) raises :class:`AttributeError` naming the closest settings.

Example::

    import torchport
    torchport.config.max_autotune_gemm_backends = "NATIVE,ATEN"
    with torchport.config.override(autotune=False):
        ...
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


class ConfigError(ValueError):
    """A setting was given a value that does not meet its requirement."""


# The forms a number may take in an environment variable: ASCII decimal, ASCII white space around
# it. int() and float() take more (1_000, full-width or other Unicode digits and spaces): a typo or
# a pasted value was read as some number. NaN and the infinities reach the checks of the setting
# (each says what it requires; a float must be finite in any case: Setting.validate).
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_FLOAT_RE = re.compile(
    r"\s*[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?|nan|inf|infinity)\s*",
    re.ASCII | re.IGNORECASE,
)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One setting: its name, environment variable, type, default and validation."""

    name: str
    env: str
    kind: type
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None  # returns an error message or None

    def parse(self, raw: str) -> Any:
        """Parse an environment string into this setting's type."""
        if self.kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{self.env} must be a boolean (1/0/true/false), got {raw!r}")
        if self.kind is int:
            try:
                if not _INT_RE.fullmatch(raw):
                    raise ValueError(raw)
                return int(raw)
            except ValueError:  # (also past int()'s limit of digits)
                raise ConfigError(f"{self.env} must be an integer, got {raw!r}") from None
        if self.kind is float:
            if not _FLOAT_RE.fullmatch(raw):
                raise ConfigError(f"{self.env} must be a number, got {raw!r}")
            return float(raw)
        return raw

    def validate(self, value: Any) -> Any:
        """Check type and constraint; return the (possibly normalised) value."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.kind is str and isinstance(value, str):
            # stripped as numbers and booleans are: TORCHPORT_CACHE_DIR=" /tmp/x" was the
            # relative path " /tmp/x", a cache under the current directory
            value = value.strip()
        if self.kind is not bool and isinstance(value, bool):
            raise ConfigError(f"{self.name} must be {self.kind.__name__}, got bool {value!r}")
        if not isinstance(value, self.kind):
            raise ConfigError(
                f"{self.name} must be {self.kind.__name__}, got {type(value).__name__} {value!r}"
            )
        if self.name in _NORMALISE:
            value = _NORMALISE[self.name](value)
        if self.check is not None:
            msg = self.check(value)
            if msg is not None:
                raise ConfigError(f"{self.name} ({self.env}): {msg}, got {value!r}")
        if self.kind is float and not math.isfinite(value):  # (where the check says nothing)
            raise ConfigError(f"{self.name} ({self.env}): must be a finite number, got {value!r}")
        return value


def _default_cache_dir() -> str:
    # a relative XDG_CACHE_HOME is invalid (XDG Base Directory spec: ignored) and made a cache
    # under whatever the current directory was, one that moved with os.chdir
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else str(Path.home() / ".cache")
    return str(Path(base) / "torchport")


_GEMM_BACKENDS = ("NATIVE", "ATEN")
_ISAS = ("auto", "avx512", "avx2", "scalar")


def _norm_backends(value: str) -> str:
    parts = [p.strip().upper() for p in value.split(",") if p.strip()]
    return ",".join(parts)


def _check_backends(value: str) -> str | None:
    parts = value.split(",") if value else []
    if not parts:
        return "must name at least one of NATIVE, ATEN"
    bad = [p for p in parts if p not in _GEMM_BACKENDS]
    if bad:
        return f"unknown backend(s) {bad}; allowed: {', '.join(_GEMM_BACKENDS)}"
    return None


# The longest heartbeat period (s), ~97 years: a reconfigurable group waits three periods in one
# socket timeout, and a wait takes at most threading.TIMEOUT_MAX (~292 years on 64-bit Linux).
FT_HEARTBEAT_MAX = threading.TIMEOUT_MAX / 3
# The most Flight Recorder entries per process (one ring for all its groups): 500 times the
# default. The ring's slots are made up front (8 bytes each); a recorded entry holds ~650 bytes,
# and a dump writes ~370 bytes of JSON per entry (~20 s for a million): a full ring of this size
# holds ~0.65 GB.
FR_BUFFER_SIZE_MAX = 1_000_000


def _heartbeat(value: float) -> str | None:
    # finite too: inf passed, and the heartbeat's Event.wait(inf) then raised OverflowError; so
    # did any period past the bound, in the group's watcher thread, which then died
    if 0 < value <= FT_HEARTBEAT_MAX:
        return None
    return (
        f"must be a finite number > 0 and at most {FT_HEARTBEAT_MAX:.6g} "
        "(threading.TIMEOUT_MAX / 3: hang detection waits three periods)"
    )


def _norm_pch(value: str) -> str:
    # "OFF" or "0" was taken for a directory of that name in the current directory
    return "off" if value.strip().lower() in ("off", "0", "false", "no") else value


_NORMALISE: dict[str, Callable[[Any], Any]] = {
    "max_autotune_gemm_backends": _norm_backends,
    "isa": lambda v: v.strip().lower(),
    "native_pch": _norm_pch,
}

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            name="cache_dir",
            env="TORCHPORT_CACHE_DIR",
            kind=str,
            default=None,  # resolved lazily from XDG_CACHE_HOME / ~/.cache
            doc="Directory for compiled kernels and the autotuner's choice cache; unset means "
            "$XDG_CACHE_HOME/torchport where XDG_CACHE_HOME is an absolute path, else "
            "~/.cache/torchport.",
            # an empty assignment would be the relative path '', i.e. a cache in whatever the
            # current directory is (an empty environment value means unset: the default)
            check=lambda v: None if v.strip() else "must be a directory path (unset: default)",
        ),
        Setting(
            name="cc",
            env="TORCHPORT_CC",
            kind=str,
            default="",
            doc="C compiler for native kernels; empty means $CC, then gcc, then cc.",
        ),
        Setting(
            name="native_pch",
            env="TORCHPORT_NATIVE_PCH",
            kind=str,
            default="",
            doc="Where GCC's precompiled kernel-prelude headers are kept: empty means "
            "<cache_dir>/native/pch, 'off' (or 0, false, no; any case) parses the headers in "
            "every compile.",
        ),
        Setting(
            name="native",
            env="TORCHPORT_NATIVE",
            kind=bool,
            default=True,
            doc="Use native (generated C) kernels; off means ATen paths everywhere.",
        ),
        Setting(
            name="isa",
            env="TORCHPORT_ISA",
            kind=str,
            default="auto",
            doc="Highest instruction set templates may use: auto, avx512, avx2 or scalar. "
            "Can only lower what the CPU has.",
            check=lambda v: None if v in _ISAS else f"must be one of {_ISAS}",
        ),
        Setting(
            name="max_autotune_gemm_backends",
            env="TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS",
            kind=str,
            default="NATIVE,ATEN",
            doc="Comma-separated GEMM backends the autotuner may choose from (NATIVE, ATEN).",
            check=_check_backends,
        ),
        Setting(
            name="autotune",
            env="TORCHPORT_AUTOTUNE",
            kind=bool,
            default=True,
            doc="Profile candidates per operation; off means the first valid native candidate.",
        ),
        Setting(
            name="autotune_cache",
            env="TORCHPORT_AUTOTUNE_CACHE",
            kind=bool,
            default=True,
            doc="Keep autotuning choices in a persistent JSON cache under cache_dir.",
        ),
        Setting(
            name="autotune_reps",
            env="TORCHPORT_AUTOTUNE_REPS",
            kind=int,
            default=15,
            doc="Timed repetitions per candidate when autotuning (median is kept).",
            check=lambda v: None if 1 <= v <= 10_000 else "must be in [1, 10000]",
        ),
        Setting(
            name="autotune_noise",
            env="TORCHPORT_AUTOTUNE_NOISE",
            kind=float,
            default=0.03,
            doc="A non-ATen candidate must beat ATen by this fraction to be chosen.",
            check=lambda v: None if 0.0 <= v < 1.0 else "must be in [0, 1)",
        ),
        Setting(
            name="cold_cache_bytes",
            env="TORCHPORT_COLD_CACHE_BYTES",
            kind=int,
            default=64 << 20,
            doc=(
                "Bytes of rotated input copies used for cold-cache timing (> L3); the decode GEMV"
                " tunes on the larger of this and twice the largest cache the OS reports"
                " (autotune.cold_bytes); 0 switches cold timing off."
            ),
            check=lambda v: None if v >= 0 else "must be >= 0",
        ),
        Setting(
            name="fr_buffer_size",
            env="TORCHPORT_FR_BUFFER_SIZE",
            kind=int,
            default=2000,
            doc=f"Flight Recorder ring-buffer entries per process, shared by all its "
            f"process groups and point-to-point ops (at most {FR_BUFFER_SIZE_MAX:,}: "
            f"~0.65 GB when full).",
            check=lambda v: (
                None
                if 0 <= v <= FR_BUFFER_SIZE_MAX
                else f"must be >= 0 and at most {FR_BUFFER_SIZE_MAX}"
            ),
        ),
        Setting(
            name="fr_dump_dir",
            env="TORCHPORT_FR_DUMP_DIR",
            kind=str,
            default="",
            doc="Folder for Flight Recorder dumps (rank_<r>.json); empty means ./torchport-fr.",
        ),
        Setting(
            name="fr_timeout",
            env="TORCHPORT_FR_TIMEOUT",
            kind=float,
            default=30.0,
            doc="Seconds an op may stay incomplete before the Flight Recorder dumps (0: never).",
            # finite: inf passed, and install() then failed in the watchdog's int(t * 1e9)
            check=lambda v: None if 0 <= v < float("inf") else "must be a finite number >= 0",
        ),
        Setting(
            name="fr_stack",
            env="TORCHPORT_FR_STACK",
            kind=bool,
            default=False,
            doc="Record the Python stack of every op in the Flight Recorder (slower).",
        ),
        Setting(
            name="ft_heartbeat",
            env="TORCHPORT_FT_HEARTBEAT",
            kind=float,
            default=0.1,
            doc="Heartbeat period (s) of fault-tolerance failure detection; hang = 3 periods "
            f"(at most {FT_HEARTBEAT_MAX:.6g} s).",
            check=_heartbeat,
        ),
        Setting(
            name="progress",
            env="TORCHPORT_PROGRESS",
            kind=bool,
            default=True,
            doc="Show progress bars for long work (autotuning, demo training).",
        ),
        Setting(
            name="dist_addr",
            env="TORCHPORT_DIST_ADDR",
            kind=str,
            default="127.0.0.1",
            doc="Address the torchport collective backend listens on (0.0.0.0 for multi-host).",
        ),
        Setting(
            name="dist_transport",
            env="TORCHPORT_DIST_TRANSPORT",
            kind=str,
            default="auto",
            doc="Collective transport: auto (shm when every rank is on this host, else tcp), "
            "shm or tcp.",
            check=lambda v: None if v in ("auto", "shm", "tcp") else "must be auto, shm or tcp",
        ),
        Setting(
            name="dist_chunk_bytes",
            env="TORCHPORT_DIST_CHUNK_BYTES",
            kind=int,
            default=1 << 20,
            doc="Bytes each rank publishes per collective step (shm slot half / TCP frame).",
            check=lambda v: None if 4096 <= v <= (1 << 30) else "must be in [4096, 2**30]",
        ),
        Setting(
            name="dist_tcp_chunk_bytes",
            env="TORCHPORT_DIST_TCP_CHUNK_BYTES",
            kind=int,
            default=8 << 20,
            doc="Bytes per collective step in groups that reach some peers by TCP (tcp, hybrid): "
            "larger than the shm chunk, since every step costs frames and Python per peer.",
            check=lambda v: None if 4096 <= v <= (1 << 30) else "must be in [4096, 2**30]",
        ),
        Setting(
            name="dist_stream_bytes",
            env="TORCHPORT_DIST_STREAM_BYTES",
            kind=int,
            default=32 << 20,
            doc="Shared-memory broadcast, allgather, gather, scatter and alltoall copy into an "
            "output of at least this many bytes (by default the size of a large last-level "
            "cache) with streaming (non-temporal) stores, which skip reading each line before "
            "writing it; 0 never do. Reductions keep cached stores.",
            check=lambda v: None if v >= 0 else "must be >= 0",
        ),
        Setting(
            name="dist_max_frame_bytes",
            env="TORCHPORT_DIST_MAX_FRAME_BYTES",
            kind=int,
            default=256 << 20,
            doc="Largest TCP frame payload accepted or sent (bounds every receive buffer).",
            check=lambda v: None if 4096 <= v <= (1 << 32) else "must be in [4096, 2**32]",
        ),
        Setting(
            name="dist_p2p_ring_bytes",
            env="TORCHPORT_DIST_P2P_RING_BYTES",
            kind=int,
            default=4 << 20,
            doc="Bytes of the shared-memory ring that carries large send/recv payloads to a rank "
            "of the same host (one per direction, made at the first such message); 0 sends "
            "them by TCP, as does the tcp transport.",
            check=lambda v: (
                None if v == 0 or (1 << 16) <= v <= (1 << 30) else "must be 0 or in [2**16, 2**30]"
            ),
        ),
        Setting(
            name="gemv_fp4_int8",
            env="TORCHPORT_GEMV_FP4_INT8",
            kind=bool,
            default=True,
            doc="NVFP4/MXFP4 decode GEMV quantizes activations to int8 per 32 elements and uses "
            "integer dot products (faster); off means exact float32 activations.",
        ),
        Setting(
            name="gemv_hugepages",
            env="TORCHPORT_GEMV_HUGEPAGES",
            kind=bool,
            default=True,
            doc="Quantized weights of at least 4 MiB move, when first packed for the decode GEMV, "
            "into 2 MiB-aligned memory advised to use transparent huge pages (fewer TLB misses "
            "on the weight stream; Linux, best effort).",
        ),
    )
}

_explicit: dict[str, Any] = {}
_generation = [0]  # bumped by every assignment (see :func:`stamp`)
_stamp_keys: dict[tuple[str, ...], tuple[Any, ...]] = {}
_env_cache: dict[str, tuple[str | None, Any]] = {}
_overrides: contextvars.ContextVar[tuple[dict[str, Any], ...]] = contextvars.ContextVar(
    "torchport_config_overrides", default=()
)


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise AttributeError(
            f"torchport.config has no setting {name!r}; known: {', '.join(sorted(SETTINGS))}"
        ) from None


def get(name: str) -> Any:
    """Current value of setting ``name``."""
    s = _setting(name)
    for layer in reversed(_overrides.get()):
        if name in layer:
            return layer[name]
    if name in _explicit:
        return _explicit[name]
    raw = os.environ.get(s.env)
    cached = _env_cache.get(name)
    if cached is not None and cached[0] == raw:
        return cached[1]
    if not raw:  # unset, or set to "" (TORCHPORT_NATIVE= was False, TORCHPORT_ISA= an error)
        value = _default_cache_dir() if name == "cache_dir" else s.default
    else:
        value = s.validate(s.parse(raw))
    _env_cache[name] = (raw, value)
    return value


def set(name: str, value: Any) -> None:
    """Set ``name`` for this process (validated); ``None`` restores env/default resolution."""
    s = _setting(name)
    if value is None:
        _explicit.pop(name, None)
    else:
        _explicit[name] = s.validate(value)
    _generation[0] += 1


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Scoped override of one or more settings (validated), undone on exit."""
    layer = {name: _setting(name).validate(v) for name, v in values.items()}
    token = _overrides.set((*_overrides.get(), layer))
    try:
        yield
    finally:
        _overrides.reset(token)


def stamp(names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """A cheap token that changes whenever one of ``names`` may resolve to a new value.

    It combines a counter bumped by every assignment with the raw environment strings of those
    settings (read without decoding), so a hot path can cache what it derived from the settings
    and re-derive only when the token changes. Returns ``None`` while an :func:`override` is
    active in this context (its values are per context: resolve them with :func:`get`); once the
    override ends, resolution is what it was before, and so is the token.
    """
    if _overrides.get():
        return None
    return (_generation[0], tuple(map(_env_data.get, _keys(names))))


def _keys(names: tuple[str, ...]) -> tuple[Any, ...]:
    """The raw environment keys of ``names`` (cached per tuple)."""
    keys = _stamp_keys.get(names)
    if keys is None:
        keys = tuple(_env_key(_setting(n).env) for n in names)
        _stamp_keys[names] = keys
    return keys


def stamp_reader(
    names: tuple[str, ...],
) -> tuple[Callable[[], Any], list[int], Callable[[Any], Any], tuple[Any, ...]]:
    """What :func:`stamp` reads, for a hot path that compares it inline (a frame less and no
    tuples built: ~15 us of a call with cold caches): ``(overrides, generation, env_get, keys)``.
    The settings may resolve differently once ``overrides()`` is non-empty, ``generation[0]``
    changed, or ``env_get(key)`` is not (identity) the object it was for one of ``keys``."""
    return _overrides.get, _generation, _env_data.get, _keys(names)


# CPython's os.environ keeps its (encoded) strings in one dict, updated in place by every
# assignment through os.environ; reading it directly skips the per-key encoding.
_env_data: Any = getattr(os.environ, "_data", os.environ)
_env_key: Callable[[str], Any] = (
    getattr(os.environ, "encodekey", None) if _env_data is not os.environ else None
) or (lambda k: k)


class Snapshot:
    """The current values of a fixed tuple of settings, for hot paths that read them per call.

    ``snap = config.Snapshot("native", "isa")`` once (module level), then ``snap()`` per call
    returns ``(get("native"), get("isa"))``, resolved the same way as :func:`get`, but
    re-resolved only when an assignment was made or one of the settings' environment variables
    changed since the last call (the :func:`stamp` test, ~0.3 µs instead of ~1 µs per
    :func:`get`). Inside an :func:`override` block the values are read with :func:`get` on each
    call (overrides are per context). Thread-safe: the cached token and values are one tuple.
    """

    __slots__ = ("_keys", "_state", "names")

    def __init__(self, *names: str) -> None:
        if not names:
            raise ConfigError("Snapshot needs at least one setting name, got none")
        self.names = names
        self._keys = tuple(_env_key(_setting(n).env) for n in names)
        self._state: tuple[Any, tuple[Any, ...]] = (None, ())

    def __call__(self) -> tuple[Any, ...]:
        if _overrides.get():
            return tuple([get(n) for n in self.names])
        token = (_generation[0], *map(_env_data.get, self._keys))
        state = self._state
        if state[0] == token:
            return state[1]
        values = tuple([get(n) for n in self.names])
        self._state = (token, values)
        return values


def describe() -> list[tuple[str, str, Any, str]]:
    """(name, env var, current value, doc) for every setting."""
    return [(s.name, s.env, get(s.name), s.doc) for s in SETTINGS.values()]


def cache_path(*parts: str) -> Path:
    """Path under the cache directory (created private to this user: it holds compiled code)."""
    p = Path(get("cache_dir")).expanduser().joinpath(*parts)
    make_private_dirs(p)
    return p


def make_private_dirs(p: Path) -> None:
    """Create directory ``p`` and its missing parents, each with mode 0700: mkdir(parents=True)
    makes the parents by the umask (0777 under umask 000), and the native toolchain loads
    nothing below a directory that others can write."""
    if p.is_dir():
        return
    missing = [p]
    while not missing[-1].parent.exists() and missing[-1].parent != missing[-1]:
        missing.append(missing[-1].parent)
    for q in reversed(missing):
        q.mkdir(mode=0o700, exist_ok=True)


class _ConfigModule(types.ModuleType):
    """Module type that exposes settings as validated attributes."""

    def __getattr__(self, name: str) -> Any:
        if name in SETTINGS:
            return get(name)
        raise AttributeError(f"module 'torchport.config' has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTINGS:
            set(name, value)
        elif name in self.__dict__ or (name.startswith("__") and name.endswith("__")):
            super().__setattr__(name, value)  # the module's own attributes (monkeypatch)
        else:
            # a misspelt setting (autotun, ISA) made a new attribute that nothing read
            close = difflib.get_close_matches(name.lower(), SETTINGS, n=3, cutoff=0.6)
            hint = (
                f"did you mean {' or '.join(map(repr, close))}?"
                if close
                else f"known: {', '.join(sorted(SETTINGS))}"
            )
            raise AttributeError(f"torchport.config has no setting {name!r}; {hint}")


sys.modules[__name__].__class__ = _ConfigModule

if TYPE_CHECKING:  # attribute types for static checkers
    cache_dir: str
    cc: str
    native_pch: str
    native: bool
    isa: str
    max_autotune_gemm_backends: str
    autotune: bool
    autotune_cache: bool
    autotune_reps: int
    autotune_noise: float
    cold_cache_bytes: int
    fr_buffer_size: int
    fr_dump_dir: str
    fr_timeout: float
    fr_stack: bool
    ft_heartbeat: float
    progress: bool
    dist_addr: str
    dist_transport: str
    dist_chunk_bytes: int
    dist_tcp_chunk_bytes: int
    dist_stream_bytes: int
    dist_max_frame_bytes: int
    dist_p2p_ring_bytes: int
    gemv_fp4_int8: bool
    gemv_hugepages: bool
