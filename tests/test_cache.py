"""The cache root: $AREAL_FLOW_CACHE, else $XDG_CACHE_HOME/areal_flow, else ~/.cache/areal_flow."""

from __future__ import annotations

import os

from areal_flow.cache import cache_root
from areal_flow.models.hf import cache_dir
from runtime.engines import sft


def test_env_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_FLOW_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    assert cache_root() == tmp_path / "c"
    # the model converter and the warm start use the same root
    assert cache_dir() == sft.cache_root() == tmp_path / "c"


def test_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("AREAL_FLOW_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "areal_flow"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty = unset (XDG Base Directory spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "areal_flow"


def test_suite_sets_its_own_cache():
    # conftest.py points the session at <repo>/.cache/areal_flow unless the variable was set
    assert os.environ.get("AREAL_FLOW_CACHE")
