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

register_cpu_ci(est_time=1, suite="stage-a-cpu")

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
