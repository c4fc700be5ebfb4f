"""Where miles keeps what it builds once and reuses: model presets, the tiny tokenizer and the
entry-point scan (one root for all of them, so one setting moves or clears them together)."""

from __future__ import annotations

import os

ENV_CACHE_DIR = "MILES_CACHE_DIR"


def cache_root() -> str:
    """``$MILES_CACHE_DIR``, else ``$XDG_CACHE_HOME/miles``, else ``~/.cache/miles``."""
    configured = os.environ.get(ENV_CACHE_DIR)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "miles")
