"""Native toolchain findings of session 53."""

from __future__ import annotations

import warnings

import pytest

from torchport.native import pch, toolchain


def test_a_refused_pch_folder_warns_once_instead_of_falling_back_silently(tmp_path, monkeypatch):
    """A PCH folder that check_private refuses (another user can write it) turned precompiled
    headers off for the process without a word: every compile then parsed the headers itself."""
    where = tmp_path / "pch"
    where.mkdir()
    where.chmod(0o777)
    monkeypatch.setenv("TORCHPORT_NATIVE_PCH", str(where))
    monkeypatch.setattr(pch, "_ready", {})
    monkeypatch.setattr(pch, "_is_gcc", lambda cc: True)
    src = pch.HEADERS + "int f(void);\n"
    with pytest.warns(toolchain.NativeFallbackWarning, match=r"precompiled headers off .*writable"):
        assert pch.header_for(src, ["-O2"], "gcc") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning, no second check
        assert pch.header_for(src, ["-O2"], "gcc") is None
