"""The provider conformance suite -- hostile probes included -- run against the built-in local
provider in each isolation mode (namespaces with unshare, namespaces with bwrap, process)."""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.testing.sandbox import ProviderConformance, ProviderFactory

register_cpu_ci(est_time=45, suite="stage-a-cpu")


class TestLocalConformance(ProviderConformance):
    base_image = "host"
    build_user = getpass.getuser()

    @pytest.fixture
    def provider_factory(self, local_options: dict[str, Any], sandbox_root: Path) -> ProviderFactory:
        return lambda: LocalProvider(sandbox_root, **local_options)
