"""Opt-in live test against E2B Cloud: runs the conformance suite when E2B_API_KEY is set.

It creates real sandboxes (billed to that key); everything it creates carries a per-test label
and is destroyed, and the suite fails if anything with that label survives.
"""

from __future__ import annotations

import os

import pytest
from miles_e2b.plugin import E2BProviderSpec

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.sandbox import ProviderConformance, ProviderFactory

register_cpu_ci(est_time=2, suite="stage-a-cpu")

pytestmark = pytest.mark.skipif(
    not os.environ.get("E2B_API_KEY"), reason="set E2B_API_KEY to run live E2B tests"
)


class TestLiveE2B(ProviderConformance):
    base_image = "e2bdev/base"
    ttl_test_s = 5.0
    runs_on_this_host = False  # microVMs elsewhere: the probes cannot watch their processes

    @pytest.fixture
    def provider_factory(self) -> ProviderFactory:
        spec = E2BProviderSpec()
        spec.verify()
        options = {
            k[len("MILES_E2B_") :].lower(): v for k, v in os.environ.items() if k.startswith("MILES_E2B_")
        }
        return lambda: spec.create(options)
