"""Fixtures shared by the run tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def warm_cache(monkeypatch):
    """Point ``$AREAL_FLOW_CACHE`` at ``<repo>/.cache/areal_flow`` unless it is set, so the
    run tests share one warm-start cache (SFT once per machine)."""
    if "AREAL_FLOW_CACHE" not in os.environ:
        monkeypatch.setenv("AREAL_FLOW_CACHE", str(REPO / ".cache" / "areal_flow"))
