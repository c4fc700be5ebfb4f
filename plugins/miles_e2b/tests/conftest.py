"""Fixtures: an in-process fake E2B service and providers bound to it (no network)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from miles_e2b.config import E2BConfig
from miles_e2b.fake import FakeE2B, FakeE2BServer
from miles_e2b.provider import E2BProvider

from miles_core.sandbox.secrets import Secret, SecretRef

KEY = "e2b_" + "ab" * 20


@pytest.fixture
def server() -> Iterator[FakeE2BServer]:
    fake = FakeE2BServer(api_key=KEY)
    yield fake
    fake.close()


@pytest.fixture
def make_provider(server: FakeE2BServer) -> Callable[..., E2BProvider]:
    """``make_provider(**options)``: an E2BProvider on the fake, configured like the CLI would."""

    def make(**options: object) -> E2BProvider:
        config = E2BConfig.from_options({"api_key": "env:FAKE_E2B_KEY", **options})
        return E2BProvider(config, sdk=FakeE2B(server), key=Secret(KEY, str(SecretRef.env("FAKE_E2B_KEY"))))

    return make
