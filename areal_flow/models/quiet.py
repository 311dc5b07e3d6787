"""``transformers``' own progress bars off for one call: loading or saving a model inside a run.

A run's console has one bar, its own (``runtime.metrics``); the bars ``transformers`` draws
for a load ("Loading weights") or a save ("Writing model shards") would appear inside it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """``transformers``' progress bars disabled inside (``transformers.utils.logging``'s own
    switch), left as they were on exit."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
