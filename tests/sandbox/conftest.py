"""Shared fixtures for the sandbox tests."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.sandbox.local.store import remove_tree


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    """A state root the per-sandbox uids can traverse (pytest's tmp_path is 0700 when root)."""
    root = Path(tempfile.mkdtemp(prefix="miles-sandbox-test-"))
    os.chmod(root, 0o711)
    yield root / "state"
    remove_tree(root)
