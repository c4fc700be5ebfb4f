"""Shared fixtures for the sandbox tests: a private state root, the local provider's isolation
modes (each skipped, with the host's reason, where it cannot work), an unprivileged user."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_core.sandbox.local import namespaces
from miles_core.sandbox.local.store import remove_tree
from miles_core.testing.sandbox_probes import UnprivilegedPython, unprivileged_python

#: local provider options per isolation mode under test
MODES: dict[str, dict[str, Any]] = {
    "namespaces-unshare": {"isolation": "namespaces", "namespace_tool": "unshare"},
    "namespaces-bwrap": {"isolation": "namespaces", "namespace_tool": "bwrap"},
    "process": {"isolation": "process"},
}


def mode_options(mode: str) -> dict[str, Any]:
    """The options of ``mode``; skips the test where the host cannot provide it."""
    options = MODES[mode]
    tool = options.get("namespace_tool")
    if tool is not None:
        support = namespaces.support(tool)
        if not support.available:
            pytest.skip(f"{mode} is not available here: {support.detail}")
    return options


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    """A state root the per-sandbox uids can traverse (pytest's tmp_path is 0700 when root)."""
    root = Path(tempfile.mkdtemp(prefix="miles-sandbox-test-"))
    os.chmod(root, 0o711)
    yield root / "state"
    remove_tree(root)


@pytest.fixture(params=list(MODES))
def local_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The local provider's options, once per isolation mode (skipped where unavailable)."""
    return mode_options(request.param)


@pytest.fixture(params=[m for m in MODES if m.startswith("namespaces")])
def namespace_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The local provider's options, once per namespace tool (skipped where unavailable)."""
    return mode_options(request.param)


@pytest.fixture(scope="session")
def unprivileged() -> UnprivilegedPython:
    """Python as uid 65534 with this miles importable (skips where that is impossible)."""
    found = unprivileged_python()
    if found is None:
        pytest.skip("cannot run an unprivileged user here (needs root, setpriv and an interpreter it may run)")
    return found
