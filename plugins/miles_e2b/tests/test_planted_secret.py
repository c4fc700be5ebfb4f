"""A planted API key appears nowhere: not in logs, argv, worker env dumps, sandbox envs,
reprs or errors -- including an error whose SDK message echoes the key back."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from pathlib import Path

import pytest
from miles_e2b.config import E2BConfig
from miles_e2b.fake import FakeE2B, FakeE2BServer
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import main
from miles_core.sandbox.base import ImageSpec, Run, SandboxSpec
from miles_core.sandbox.errors import SandboxFatalError
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.retry import RetryPolicy

register_cpu_ci(est_time=3, suite="stage-a-cpu")

PLANTED = "e2b_5ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7"
WRONG = "e2b_badbadbadbadbadbadbadbadbadbadbadbadbad0"


def _key_file(tmp_path: Path, name: str, value: str) -> Path:
    path = tmp_path / name
    path.write_text(value + "\n")
    return path


def test_planted_key_never_leaks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = FakeE2BServer(api_key=PLANTED)
    server.echo_key_in_auth_errors = True  # a hostile SDK error message that repeats the key
    good = E2BConfig.from_options({"api_key": f"file:{_key_file(tmp_path, 'key', PLANTED)}"})
    bad = E2BConfig.from_options({"api_key": f"file:{_key_file(tmp_path, 'wrong', WRONG)}"})
    seen: list[str] = []

    async def scenario() -> None:
        provider = E2BProvider(good, sdk=FakeE2B(server))  # resolves the key from the file
        seen.extend([repr(provider), repr(good), json.dumps(good.worker_env())])
        async with SandboxManager(provider) as manager:
            image = await manager.prepare_image(ImageSpec("e2bdev/base", (Run("true"),)))
            box = await manager.create(SandboxSpec(image=image, env={"TASK": "t"}))
            inside = await box.exec("env; cat /proc/self/cmdline | tr '\\0' ' '")
            seen.append(inside.stdout + inside.stderr)
        intruder = E2BProvider(bad, sdk=FakeE2B(server))
        with pytest.raises(SandboxFatalError) as raised:
            await SandboxManager(intruder, retry=RetryPolicy(attempts=1)).create()
        error = raised.value
        seen.extend([str(error), repr(error), "".join(traceback.format_exception(error))])
        assert "Unauthorized" in str(error) and "***" in str(error)  # the echo happened, redacted

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    seen.append(caplog.text)
    seen.extend(json.dumps([name, list(map(repr, args)), {k: repr(v) for k, v in kw.items() if k != "api_key"}])
                for name, args, kw in server.calls)  # fmt: skip
    for text in seen:
        assert PLANTED not in text and WRONG not in text
    assert any(kw.get("api_key") == PLANTED for _, _, kw in server.calls)  # it was used, by the SDK only
    server.close()


def test_the_cli_refuses_a_key_value_on_argv_without_echoing_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sandbox", "run", "--provider", "e2b", "-o", f"api_key={PLANTED}", "--", "true"])
    _, err = capsys.readouterr()
    assert info.value.code == 2 and "api_key" in err and PLANTED not in err


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    stack = [error]
    while stack:
        item = stack.pop()
        if item not in seen:
            seen.append(item)
            stack += [e for e in (item.__cause__, item.__context__) if e is not None]
    return seen


def _assert_clean(error: BaseException, *secrets: str) -> None:
    """No secret in the error, nor in anything its ``__cause__``/``__context__`` chain holds."""
    for item in _chain(error):
        text = "".join(traceback.format_exception(item)) + repr(item) + repr(item.args)
        for secret in secrets:
            assert secret not in text, f"{type(item).__name__} in the chain of {type(error).__name__} holds it"


def test_sdk_errors_leave_no_key_in_the_exception_chain(tmp_path: Path) -> None:
    server = FakeE2BServer(api_key=PLANTED)
    server.echo_key_in_auth_errors = True
    bad = E2BConfig.from_options({"api_key": f"file:{_key_file(tmp_path, 'wrong', WRONG)}"})

    async def scenario() -> None:
        provider = E2BProvider(bad, sdk=FakeE2B(server))
        for call in (
            lambda: provider.create(SandboxSpec()),
            lambda: provider.extend("i0", 30),
            lambda: provider.destroy("i0"),
            lambda: provider.list({}),
            lambda: provider.prepare_image(ImageSpec("e2bdev/base", (Run("true"),))),
        ):
            with pytest.raises(SandboxFatalError) as raised:
                await call()
            assert "***" in str(raised.value)  # the SDK's message echoed the key; it was redacted
            assert raised.value.__context__ is None and raised.value.__cause__ is None
            _assert_clean(raised.value, WRONG, PLANTED)

    asyncio.run(scenario())
    server.close()


def test_the_rl_paths_take_e2b_options_by_reference_and_leak_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``[reward]`` options (the reward's sandbox and the tool sandboxes) reach the provider's
    create; a refused create surfaces through the RL layer with no key in text, chain or logs."""
    from miles_e2b import plugin

    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.aio import BackgroundLoop
    from miles_core.rl.config import load_config
    from miles_core.rl.sandboxes import WarmSandbox, tool_sandbox_settings

    server = FakeE2BServer(api_key=PLANTED)
    server.echo_key_in_auth_errors = True

    def create(self, config=None):  # type: ignore[no-untyped-def]
        return E2BProvider(E2BConfig.from_options(config), sdk=FakeE2B(server))

    monkeypatch.setattr(plugin.E2BProviderSpec, "create", create)
    good, wrong = _key_file(tmp_path, "key", PLANTED), _key_file(tmp_path, "wrong", WRONG)
    config = load_config(
        "tiny",
        overrides=[
            'reward.sandbox_provider="e2b"',
            f'reward.sandbox_options.api_key="file:{good}"',
            'reward.tool_sandbox_options.preset="agentenv"',
            'reward.tool_sandbox_options.api_url="http://10.1.1.1:8000"',
            'reward.tool_sandbox_options.domain="10.1.1.1.sslip.io"',
            f'reward.tool_sandbox_options.api_key="file:{good}"',
        ],
    )
    assert PLANTED not in json.dumps(config.to_dict())  # the config holds references only
    provider, options = tool_sandbox_settings(config.reward)
    assert (provider, options["api_url"]) == ("e2b", "http://10.1.1.1:8000")
    pm, aio = get_plugin_manager(), BackgroundLoop()
    try:
        with caplog.at_level(logging.DEBUG):
            tools = aio.run(WarmSandbox(pm, provider, "tools", aio, 30, options).start())
            tools.close()
            reward = aio.run(WarmSandbox(pm, "e2b", "reward", aio, 30, config.reward.sandbox_options).start())
            reward.close()
            with pytest.raises(SandboxFatalError) as raised:
                aio.run(WarmSandbox(pm, "e2b", "reward", aio, 30, {"api_key": f"file:{wrong}"}).start())
    finally:
        aio.close()
    creates = [kw for name, _, kw in server.calls if name == "AsyncSandbox.create"]
    assert [kw["metadata"]["miles.role"] for kw in creates] == ["tools", "reward", "reward"]
    assert creates[0]["api_url"] == "http://10.1.1.1:8000" and creates[0]["domain"] == "10.1.1.1.sslip.io"
    assert "api_url" not in creates[1] and creates[1]["domain"] == "e2b.app" and creates[1]["retries"] == 0
    assert "Unauthorized" in str(raised.value) and "***" in str(raised.value)
    _assert_clean(raised.value, PLANTED, WRONG)
    assert PLANTED not in caplog.text and WRONG not in caplog.text
    server.close()
