"""The core provider conformance suite, run against miles-e2b on the in-process fake SDK."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.sandbox import ProviderConformance, ProviderFactory

register_cpu_ci(est_time=6, suite="stage-a-cpu")


class TestE2BConformance(ProviderConformance):
    base_image = "e2bdev/base"
    hostile_probes_skip = (
        "the in-process fake runs its commands on this host, unisolated; the hostile probes run "
        "against live E2B (test_live.py, with E2B_API_KEY)"
    )

    @pytest.fixture
    def provider_factory(self, make_provider: Callable[..., E2BProvider]) -> ProviderFactory:
        return make_provider
