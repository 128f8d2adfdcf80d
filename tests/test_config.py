"""Settings: env parsing, validation with clear errors, scoped overrides."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("raw", ["off", "OFF", " Off ", "0", "false", "no"])
def test_native_pch_off_spellings(monkeypatch, raw):
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", raw)  # was a directory named OFF, 0, ...
    assert config.get("native_pch") == "off"


def test_bad_env_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "many")
    with pytest.raises(
        ConfigError, match=r"TORCHPORT_AUTOTUNE_REPS must be an integer, got 'many'"
    ):
        config.get("autotune_reps")
    monkeypatch.setenv("TORCHPORT_NATIVE", "maybe")
    with pytest.raises(ConfigError, match=r"TORCHPORT_NATIVE must be a boolean"):
        config.get("native")
    with pytest.raises(ConfigError, match=r"must be a directory path"):
        config.cache_dir = " "
    monkeypatch.setenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", "NATIVE,CUTLASS")
    with pytest.raises(ConfigError, match=r"unknown backend\(s\) \['CUTLASS'\]"):
        config.get("max_autotune_gemm_backends")
    # (inf passed, and the fault-tolerance heartbeat's Event.wait(inf) raised OverflowError)
    for bad in ("inf", "nan", "0", "-1"):
        monkeypatch.setenv("TORCHPORT_FT_HEARTBEAT", bad)
        with pytest.raises(ConfigError, match=r"FT_HEARTBEAT\): must be a finite number > 0"):
            config.get("ft_heartbeat")


_INTS = sorted(n for n, s in config.SETTINGS.items() if s.kind is int)
_FLOATS = sorted(n for n, s in config.SETTINGS.items() if s.kind is float)
# forms int() or float() take that are no ASCII decimal: each was read as some number
_NOT_DECIMAL = {
    "underscore": "1_000",
    "fullwidth": "\uff11\uff12",
    "arabic-indic": "\u0663",
    "em-space": "\u20037",
    "ideographic-space": "7\u3000",
    "hex": "0x10",
    "signs": "+-7",
    "empty-sign": "-",
}


@pytest.mark.parametrize("raw", list(_NOT_DECIMAL.values()), ids=list(_NOT_DECIMAL))
@pytest.mark.parametrize("name", _INTS + _FLOATS)
def test_env_numbers_are_ascii_decimal_only(monkeypatch, name, raw):
    s = config.SETTINGS[name]
    what = "an integer" if s.kind is int else "a number"
    monkeypatch.setenv(s.env, raw)
    with pytest.raises(ConfigError, match=rf"^{s.env} must be {what}, got {re.escape(repr(raw))}$"):
        config.get(name)


@pytest.mark.parametrize(
    "raw", ["1_0.5", "\uff11.\uff15", "1.5e\uff13", "1e", ".", "1.5.2", "0x1p3"]
)
@pytest.mark.parametrize("name", _FLOATS)
def test_env_floats_are_ascii_decimal_only(monkeypatch, name, raw):
    s = config.SETTINGS[name]
    monkeypatch.setenv(s.env, raw)
    with pytest.raises(
        ConfigError, match=rf"^{s.env} must be a number, got {re.escape(repr(raw))}$"
    ):
        config.get(name)


def test_env_numbers_in_decimal_forms_parse():
    for name in _INTS:
        s = config.SETTINGS[name]
        assert [s.parse(r) for r in ("7", "+007", " -7\n", "10" * 10)] == [7, 7, -7, int("10" * 10)]
        with pytest.raises(ConfigError, match=r"must be an integer, got '7.0'"):
            s.parse("7.0")  # (as before)
    for name in _FLOATS:
        s = config.SETTINGS[name]
        good = ("1.5", "-.5", "5.", "+2", "1E-3", " 2e+1 \t")
        assert [s.parse(r) for r in good] == [1.5, -0.5, 5.0, 2.0, 1e-3, 20.0]


def test_a_float_setting_must_be_finite_where_its_check_says_nothing(monkeypatch):
    # every float setting's own check refuses NaN and the infinities (test above, with its
    # message); one without a check refused none
    s = config.Setting(name="t", env="TORCHPORT_T", kind=float, default=1.0, doc="")
    for raw in ("nan", "-Infinity", "1e400"):
        with pytest.raises(ConfigError, match=r"^t \(TORCHPORT_T\): must be a finite number, got"):
            s.validate(s.parse(raw))
    monkeypatch.setenv("TORCHPORT_FR_TIMEOUT", "inf")
    with pytest.raises(ConfigError, match=r"FR_TIMEOUT\): must be a finite number >= 0, got inf"):
        config.get("fr_timeout")


@pytest.mark.parametrize("name", sorted(config.SETTINGS))
def test_empty_env_value_means_unset(monkeypatch, name):
    # TORCHPORT_CACHE_DIR= raised ConfigError, TORCHPORT_NATIVE= turned the kernels off,
    # TORCHPORT_AUTOTUNE_REPS= and TORCHPORT_ISA= raised: each now resolves as if unset
    env = config.SETTINGS[name].env
    monkeypatch.delenv(env, raising=False)
    unset = config.get(name)
    monkeypatch.setenv(env, "")
    assert config.get(name) == unset


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


def test_stamp_reader_sees_what_stamp_sees(monkeypatch):
    """stamp_reader's pieces, compared inline as the settled GEMV route does, flag every change
    the stamp flags: an environment edit (even to an equal string), an assignment, an override."""
    names = ("autotune", "native")
    monkeypatch.delenv("TORCHPORT_AUTOTUNE", raising=False)
    overrides, generation, env_get, keys = config.stamp_reader(names)
    s0 = config.stamp(names)
    assert len(keys) == len(names) and s0 is not None

    def same() -> bool:
        if overrides() or generation[0] != s0[0]:
            return False
        return all(env_get(k) is v for k, v in zip(keys, s0[1]))

    assert same()
    monkeypatch.setenv("TORCHPORT_AUTOTUNE", "0")
    assert not same()
    monkeypatch.delenv("TORCHPORT_AUTOTUNE")
    assert same()
    with config.override(native=False):
        assert not same()
    try:
        config.autotune = True
        assert not same()
    finally:
        config.autotune = None


def test_snapshot_follows_assignment_env_and_override(monkeypatch):
    """A Snapshot caches resolved values, yet sees every way a setting can change: an
    assignment, an environment edit, an override (and its end)."""
    monkeypatch.delenv("TORCHPORT_AUTOTUNE_REPS", raising=False)
    monkeypatch.delenv("TORCHPORT_NATIVE", raising=False)
    snap = config.Snapshot("autotune_reps", "native")
    assert snap() == (15, True) and snap() is snap()  # cached while nothing changed
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "9")
    assert snap() == (9, True)
    try:
        config.native = False
        assert snap() == (9, False)
        with config.override(autotune_reps=3):
            assert snap() == (3, False)
            with config.override(native=True):
                assert snap() == (3, True)
        assert snap() == (9, False)
    finally:
        config.native = None
    assert snap() == (9, True)
    monkeypatch.setenv("TORCHPORT_AUTOTUNE_REPS", "nope")
    with pytest.raises(ConfigError, match=r"TORCHPORT_AUTOTUNE_REPS must be an integer"):
        snap()
    monkeypatch.delenv("TORCHPORT_AUTOTUNE_REPS")
    assert snap() == (15, True)
    with pytest.raises(AttributeError, match=r"no setting 'nope'"):
        config.Snapshot("nope")
    with pytest.raises(ConfigError, match=r"at least one setting name"):
        config.Snapshot()


def test_native_enabled_and_isa_follow_changes(monkeypatch):
    """The hot-path readers built on Snapshot (native.enabled, cpu_info().isa) see changes."""
    from torchport import native

    monkeypatch.delenv("TORCHPORT_NATIVE", raising=False)
    monkeypatch.delenv("TORCHPORT_ISA", raising=False)
    info = native.cpu_info()
    assert native.enabled() and info.isa == info.max_isa
    monkeypatch.setenv("TORCHPORT_NATIVE", "0")
    assert not native.enabled()
    with config.override(native=True):
        assert native.enabled()
    monkeypatch.delenv("TORCHPORT_NATIVE")
    assert native.enabled()
    monkeypatch.setenv("TORCHPORT_ISA", "scalar")
    assert info.isa == "scalar"
    monkeypatch.delenv("TORCHPORT_ISA")
    assert info.isa == info.max_isa
    with config.override(isa="scalar"):
        assert info.isa == "scalar"
    try:
        config.isa = "scalar"
        assert info.isa == "scalar"
    finally:
        config.isa = None
    assert info.isa == info.max_isa
