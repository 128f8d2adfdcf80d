"""Settings, review 49: bounded heartbeat and Flight Recorder sizes, misspelt assignments refused,
white space around text values ignored."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from torchport import config
from torchport.config import ConfigError
from torchport.distributed.flight_recorder import FlightRecorder
from torchport.distributed.reconfigure import ReconfigurableGroup, ReconfigureError

_HB_MAX = threading.TIMEOUT_MAX / 3  # a reconfigurable group waits three periods in one timeout


@pytest.mark.parametrize("raw", ["1e10", "1e300", repr(_HB_MAX * 1.000001)])
def test_ft_heartbeat_env_is_at_most_a_third_of_the_longest_wait(monkeypatch, raw):
    """TORCHPORT_FT_HEARTBEAT=1e10 (finite, > 0) passed, and the reconfigurable group's watcher
    thread died with OverflowError: timestamp out of range for platform time_t."""
    monkeypatch.setenv("TORCHPORT_FT_HEARTBEAT", raw)
    with pytest.raises(
        ConfigError,
        match=r"^ft_heartbeat \(TORCHPORT_FT_HEARTBEAT\): must be a finite number > 0 and at most "
        r"3\.07446e\+09 \(threading\.TIMEOUT_MAX / 3: hang detection waits three periods\), got",
    ):
        config.get("ft_heartbeat")
    with pytest.raises(ConfigError, match=r"at most 3\.07446e\+09"):
        config.ft_heartbeat = float(raw)


def test_ft_heartbeat_bound_itself_is_accepted(monkeypatch):
    monkeypatch.setenv("TORCHPORT_FT_HEARTBEAT", repr(_HB_MAX))
    assert config.get("ft_heartbeat") == _HB_MAX
    assert 3 * config.get("ft_heartbeat") <= threading.TIMEOUT_MAX


@pytest.mark.parametrize("bad", ["1", 1e308, 1e10, _HB_MAX * 1.000001, math.nan, True, 0, -1.0])
def test_reconfigurable_group_heartbeat_is_a_number_a_wait_can_take(bad):
    """ReconfigurableGroup(heartbeat=...) checked only isfinite and > 0: a string failed with a
    bare TypeError, and 1e308 (or 1e10) passed, and its watcher thread then died."""
    with pytest.raises(
        ReconfigureError,
        match=r"^heartbeat must be a finite number of seconds > 0 and at most 3\.07446e\+09, got",
    ):
        ReconfigurableGroup(heartbeat=bad)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("max_autotune_gemm_backend", "'max_autotune_gemm_backends'"),
        ("autotun", "'autotune'"),
        ("ISA", "'isa'"),
        ("fr_buffersize", "'fr_buffer_size'"),
    ],
)
def test_assigning_a_misspelt_setting_raises(name, hint):
    """``config.autotun = False`` made a new module attribute that nothing read (torch's config
    modules raise AttributeError for the same mistake, as config.override(autotun=...) did)."""
    with pytest.raises(
        AttributeError, match=rf"^torchport\.config has no setting '{name}'; did you mean {hint}"
    ):
        setattr(config, name, "ATEN")
    assert name not in vars(config)


def test_assigning_a_name_far_from_every_setting_lists_them():
    with pytest.raises(AttributeError, match=r"no setting 'zzz'; known: autotune, autotune_cache"):
        config.zzz = 1  # type: ignore[attr-defined]


def test_existing_module_attributes_stay_assignable(monkeypatch):
    """The module's own functions and private state can still be patched (tests do)."""
    monkeypatch.setattr(config, "cache_path", lambda *parts: Path("/nowhere"))
    assert config.cache_path("x") == Path("/nowhere")
    monkeypatch.setattr(config, "_explicit", {"autotune_reps": 4})
    assert config.get("autotune_reps") == 4
    monkeypatch.setattr(config, "__doc__", "patched")
    assert config.__doc__ == "patched"


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("cache_dir", " /tmp/tp-ws-cache\n", "/tmp/tp-ws-cache"),
        ("fr_dump_dir", "\t/tmp/tp-ws-fr ", "/tmp/tp-ws-fr"),
        ("native_pch", " /tmp/tp-ws-pch", "/tmp/tp-ws-pch"),
        ("cc", " gcc ", "gcc"),
        ("dist_addr", " 127.0.0.1 ", "127.0.0.1"),
        ("dist_transport", " shm\n", "shm"),
        ("isa", " scalar ", "scalar"),
    ],
)
def test_white_space_around_a_text_value_is_ignored(monkeypatch, name, raw, value):
    """TORCHPORT_CACHE_DIR=" /tmp/x" was the relative path " /tmp/x": the cache went under the
    current directory (numbers and booleans were stripped, text values were not)."""
    monkeypatch.setenv(config.SETTINGS[name].env, raw)
    assert config.get(name) == value
    monkeypatch.delenv(config.SETTINGS[name].env)
    try:
        config.set(name, raw)
        assert config.get(name) == value
        with config.override(**{name: raw}):
            assert config.get(name) == value
    finally:
        config.set(name, None)


def test_cache_dir_with_white_space_stays_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", f" {tmp_path / 'cache'} ")
    p = config.cache_path("native")
    assert p == tmp_path / "cache" / "native" and p.is_dir()
    assert [q.name for q in tmp_path.iterdir()] == ["cache"]  # nothing named " /tmp/..." here


@pytest.mark.parametrize("raw", ["1000001", "10000000000000", "100000000000000000000"])
def test_fr_buffer_size_env_is_bounded(monkeypatch, raw):
    """TORCHPORT_FR_BUFFER_SIZE had no upper bound: 1e8 made a ~1 GB ring up front, 1e13 a
    MemoryError, 1e20 an OverflowError, none naming the variable."""
    monkeypatch.setenv("TORCHPORT_FR_BUFFER_SIZE", raw)
    with pytest.raises(
        ConfigError,
        match=rf"^fr_buffer_size \(TORCHPORT_FR_BUFFER_SIZE\): must be >= 0 and at most "
        rf"1000000, got {raw}$",
    ):
        config.get("fr_buffer_size")
    with pytest.raises(ConfigError, match=r"TORCHPORT_FR_BUFFER_SIZE"):
        FlightRecorder(rank=0, world_size=1)


def test_fr_buffer_size_bound_itself_is_accepted(monkeypatch):
    monkeypatch.setenv("TORCHPORT_FR_BUFFER_SIZE", "1000000")
    assert config.get("fr_buffer_size") == 1_000_000
    assert FlightRecorder(rank=0, world_size=1).capacity == 1_000_000


@pytest.mark.parametrize("n", [1_000_001, 10**20])
def test_flight_recorder_buffer_size_argument_is_bounded(n):
    with pytest.raises(
        ValueError,
        match=rf"^buffer_size must be at most 1000000 entries \(TORCHPORT_FR_BUFFER_SIZE's "
        rf"bound\), got {n}$",
    ):
        FlightRecorder(buffer_size=n)
