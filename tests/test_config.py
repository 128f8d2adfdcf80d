"""Settings: env parsing, validation with clear errors, scoped overrides."""

from __future__ import annotations

import pytest

import torchport
from torchport import config
from torchport.config import ConfigError


def test_defaults_and_env(monkeypatch):
    monkeypatch.delenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", raising=False)
    assert torchport.config.max_autotune_gemm_backends == "NATIVE,ATEN"
    monkeypatch.setenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", " aten ")
    assert torchport.config.max_autotune_gemm_backends == "ATEN"
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "7")
    assert config.get("autotune_reps") == 7


def test_bad_env_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "many")
    with pytest.raises(
        ConfigError, match=r"TORCHPORT_AUTOTUNE_REPS must be an integer, got 'many'"
    ):
        config.get("autotune_reps")
    monkeypatch.setenv("TORCHPORT_NATIVE", "maybe")
    with pytest.raises(ConfigError, match=r"TORCHPORT_NATIVE must be a boolean"):
        config.get("native")
    monkeypatch.setenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", "NATIVE,CUTLASS")
    with pytest.raises(ConfigError, match=r"unknown backend\(s\) \['CUTLASS'\]"):
        config.get("max_autotune_gemm_backends")


def test_assignment_validates_and_resets():
    with pytest.raises(ConfigError, match=r"must be one of"):
        torchport.config.isa = "sse9"
    with pytest.raises(ConfigError, match=r"autotune_reps must be int, got str"):
        torchport.config.autotune_reps = "3"
    torchport.config.autotune_reps = 3
    try:
        assert torchport.config.autotune_reps == 3
    finally:
        config.set("autotune_reps", None)
    assert torchport.config.autotune_reps == 15


def test_override_is_scoped_and_nested():
    before = config.get("autotune")
    with config.override(autotune=not before):
        assert config.get("autotune") is (not before)
        with config.override(autotune=before):
            assert config.get("autotune") is before
        assert config.get("autotune") is (not before)
    assert config.get("autotune") is before
    with pytest.raises(ConfigError), config.override(autotune_noise=2.0):
        pass


def test_unknown_setting():
    with pytest.raises(AttributeError, match=r"no setting 'nope'"):
        config.get("nope")
    with pytest.raises(AttributeError):
        _ = torchport.config.nope  # type: ignore[attr-defined]


def test_describe_lists_every_setting():
    names = {name for name, *_ in config.describe()}
    assert names == set(config.SETTINGS)
    assert all(env.startswith("TORCHPORT_") for _, env, _, _ in config.describe())


def test_stamp_tracks_assignment_env_and_override(monkeypatch):
    """The hot-path token changes with every way a setting can change, and is None (resolve
    with get) while an override is active."""
    names = ("autotune", "native")
    monkeypatch.delenv("TORCHPORT_AUTOTUNE", raising=False)
    s0 = config.stamp(names)
    assert s0 is not None and config.stamp(names) == s0
    monkeypatch.setenv("TORCHPORT_AUTOTUNE", "0")
    s1 = config.stamp(names)
    assert s1 != s0
    try:
        config.autotune = True
        s2 = config.stamp(names)
        assert s2 not in (s0, s1)
    finally:
        config.autotune = None
    assert config.stamp(names) not in (s0, s1, s2)
    with config.override(native=False):
        assert config.stamp(names) is None
    monkeypatch.delenv("TORCHPORT_AUTOTUNE")
    assert config.stamp(names)[1] == s0[1]  # same environment strings as at the start
