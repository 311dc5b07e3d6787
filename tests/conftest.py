"""Fixtures shared by the tests, and the test cache.

The suite never writes into the user's cache (``~/.cache/areal_flow``): unless
``$AREAL_FLOW_CACHE`` is set explicitly, it is pointed at ``<repo>/.cache/areal_flow``
(git-ignored) for the whole session, workers included, so the run tests share one
warm-start cache (SFT once per clone) and GGUF conversion.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_CACHE = REPO / ".cache" / "areal_flow"


def pytest_configure(config):
    os.environ.setdefault("AREAL_FLOW_CACHE", str(TEST_CACHE))


@pytest.fixture
def warm_cache() -> Path:
    """The session's cache root (see the module doc); run tests name it to say they use it."""
    return Path(os.environ["AREAL_FLOW_CACHE"])


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Path:
    """The k = 0 parity run (``test_resume``'s :data:`~test_resume.RUN`) the interrupted
    ones must reproduce bit for bit: trained once per session for ``test_resume`` and
    ``test_kill_at`` (a module's own ``uninterrupted`` fixture overrides it there)."""
    from test_resume import _cli, _finish

    tmp = tmp_path_factory.mktemp("resume")
    _finish(_cli(tmp, "whole", "async.max_staleness=0"))
    return tmp / "whole"


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """Every test starts with Python's own SIGINT handler: a library that replaced it in an
    earlier test (for SIG_IGN / SIG_DFL, ``_thread.interrupt_main`` does nothing) must not
    turn the Ctrl-C tests into runs that never see their KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
