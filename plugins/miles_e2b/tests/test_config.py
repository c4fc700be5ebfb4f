"""Explicit endpoints for E2B Cloud and AgentENV; ambient variables refused; worker forwarding."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from miles_e2b import sdk
from miles_e2b.config import E2BConfig
from miles_e2b.fake import FakeE2BServer
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.sandbox.base import SandboxSpec
from miles_core.sandbox.secrets import Secret, SecretRef

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_cloud_is_the_default() -> None:
    config = E2BConfig.from_options({})
    assert (config.domain, config.scheme, config.api_url, config.api_key) == (
        "e2b.app",
        "https",
        None,
        SecretRef.env("E2B_API_KEY"),
    )
    params = config.api_params(Secret("k" * 10, "test"))
    assert params == {"api_key": "k" * 10, "domain": "e2b.app", "retries": 0}  # one retry budget: miles'


def test_agentenv_preset_fills_sandbox_url_and_http() -> None:
    config = E2BConfig.from_options(
        {"preset": "agentenv", "api_url": "http://10.0.0.5:8000/", "domain": "10.0.0.5.sslip.io"}
    )
    assert config.api_url == config.sandbox_url == "http://10.0.0.5:8000" and config.scheme == "http"
    params = config.api_params(Secret("k" * 10, "test"))
    assert params["api_url"] == params["sandbox_url"] == "http://10.0.0.5:8000"
    assert params["domain"] == "10.0.0.5.sslip.io"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"preset": "agentenv", "api_url": "http://h:8000"}, "needs api_url"),
        ({"preset": "onprem"}, "expected cloud or agentenv"),
        ({"api_url": "ftp://h"}, "api_url: expected an http(s) URL"),
        ({"api_url": "http://user:pw@h:8000"}, "credentials in the URL are refused"),
        ({"sandbox_url": "http://h:8000/?x=1"}, "no query or fragment"),
        ({"domain": "bad domain"}, "is not a DNS name"),
        ({"scheme": "ws"}, "expected http or https"),
        ({"workdir": "rel/dir"}, "absolute path"),
        ({"public_traffic": "maybe"}, "expected true or false"),
        ({"request_timeout_s": "-1"}, "positive number"),
        ({"apikey": "env:X"}, "unknown option(s) apikey"),
        ({"api_key": "e2b_" + "0" * 40}, "never accepted inline"),
    ],
)
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        E2BConfig.from_options(options)
    assert message in str(raised.value)
    assert "0" * 40 not in str(raised.value)


@pytest.mark.parametrize("variable", ["E2B_API_URL", "E2B_SANDBOX_URL"])
def test_ambient_endpoints_are_refused_when_the_config_leaves_them_unset(variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        E2BConfig.from_options({}).check_environment({variable: "http://elsewhere:8000"})
    explicit = E2BConfig.from_options({"api_url": "http://h:8000", "sandbox_url": "http://h:8000"})
    explicit.check_environment({variable: "http://elsewhere:8000"})  # explicit fields win: fine
    with pytest.raises(ConfigError, match="E2B_DEBUG"):
        explicit.check_environment({"E2B_DEBUG": "true"})


def test_worker_env_forwards_endpoints_and_the_key_reference_only() -> None:
    config = E2BConfig.from_options(
        {
            "preset": "agentenv",
            "api_url": "http://h:8000",
            "domain": "h.sslip.io",
            "api_key": "file:/etc/e2b/key",
        }
    )
    env = config.worker_env()
    assert env["MILES_E2B_API_KEY"] == "file:/etc/e2b/key"
    assert E2BConfig.from_worker_env(env) == config


def test_every_sdk_call_carries_the_configured_endpoints(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    async def main() -> None:
        provider = make_provider(
            preset="agentenv", api_url="http://10.1.2.3:8000", domain="10.1.2.3.sslip.io"
        )
        ref = await provider.create(SandboxSpec())
        endpoint = await provider.expose(ref, 8000)
        assert endpoint.url == f"http://8000-{ref.id}.10.1.2.3.sslip.io"
        assert set(endpoint.headers) == {"e2b-traffic-access-token"}
        await provider.extend(ref.id, 30)
        await provider.list({})
        await provider.destroy(ref.id)

    asyncio.run(main())
    api_calls = [(n, kw) for n, _, kw in server.calls if n in sdk.WITH_API_PARAMS]
    assert {n for n, _ in api_calls} == {
        "AsyncSandbox.create",
        "AsyncSandbox.set_timeout",
        "AsyncSandbox.list",
        "AsyncSandbox.kill",
    }
    for _, kwargs in api_calls:
        assert kwargs["api_url"] == kwargs["sandbox_url"] == "http://10.1.2.3:8000"
        assert kwargs["domain"] == "10.1.2.3.sslip.io"
