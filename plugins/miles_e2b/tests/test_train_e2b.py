"""`miles train` with `reward.sandbox_provider = "e2b"` and AgentENV options: the reward's sandbox
is created on the in-repo fake E2B server with exactly those options (endpoints, domain,
template, the key read from its file, the SDK's retries off), rewards are computed in it, and
the key appears nowhere in the run's output, files or errors -- the planted-secret check on the
new path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=15, suite="stage-b-cpu")

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("miles_core.session.embed")
pytest.importorskip("miles_qwen35")

PLANTED = "e2b_" + "a9e27e" * 6 + "a9e2"
API = "http://10.9.8.7:8000"
DOMAIN = "10.9.8.7.sslip.io"
TEMPLATE = "reward-tpl"
#: runs `miles train` with the provider's SDK replaced by the in-repo fake (in the same process;
#: verify() still checks the installed SDK's surface)
DRIVER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from miles_e2b import plugin
    from miles_e2b.config import E2BConfig
    from miles_e2b.fake import FakeE2B, FakeE2BServer
    from miles_e2b.provider import E2BProvider

    key_file, calls_file, template, *argv = sys.argv[1:]
    server = FakeE2BServer(api_key=Path(key_file).read_text().strip())
    (server.root / "templates" / template / "home" / "user").mkdir(parents=True)
    server.templates[template] = server.root / "templates" / template

    def create(self, config=None):
        options = E2BConfig.from_options(config)
        options.check_environment()
        return E2BProvider(options, sdk=FakeE2B(server))

    plugin.E2BProviderSpec.create = create
    from miles_core.cli import main
    try:
        main(argv)
    finally:
        calls = [(name, {k: v if isinstance(v, (str, int, float, bool, type(None), dict)) else repr(v)
                         for k, v in kwargs.items()}) for name, _, kwargs in server.calls]
        Path(calls_file).write_text(json.dumps(calls, default=repr))
        server.close()
    """
)


def _train(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], list, Path]:
    key_file = tmp_path / "e2b-key"
    key_file.write_text(PLANTED + "\n")
    calls_file = tmp_path / "calls.json"
    out = tmp_path / "run"
    argv = [
        "train", "--preset", "tiny", "--steps", "1", "--out", str(out), "--no-progress", "--json",
        "--set", 'reward.sandbox_provider="e2b"',
        "--set", 'reward.sandbox_options.preset="agentenv"',
        "--set", f'reward.sandbox_options.api_url="{API}"',
        "--set", f'reward.sandbox_options.domain="{DOMAIN}"',
        "--set", f'reward.sandbox_options.template="{TEMPLATE}"',
        "--set", f'reward.sandbox_options.api_key="file:{key_file}"',
        *overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(key_file), str(calls_file), TEMPLATE, *argv],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    calls = json.loads(calls_file.read_text()) if calls_file.exists() else []
    return proc, calls, out


def test_train_reaches_the_e2b_create_with_the_agentenv_options(tmp_path: Path) -> None:
    proc, calls, out = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    creates = [kwargs for name, kwargs in calls if name == "AsyncSandbox.create"]
    assert len(creates) == 1, [name for name, _ in calls]
    create = creates[0]
    assert (create["api_url"], create["sandbox_url"], create["domain"]) == (API, API, DOMAIN)
    assert create["template"] == TEMPLATE and create["retries"] == 0
    assert create["api_key"] == PLANTED  # the SDK got the key, read from the file on this side
    assert create["metadata"]["miles.role"] == "reward" and create["metadata"]["miles.managed"] == "1"
    assert create["allow_internet_access"] is False
    assert any(name == "AsyncSandbox.kill" for name, _ in calls), "the reward sandbox was not destroyed"
    summary = json.loads(proc.stdout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 1 and records[0]["time_reward_sandbox_e2b"] > 0
    for path in out.rglob("*"):  # the planted key is nowhere in what the run wrote or printed
        if path.is_file() and path.stat().st_size < 10 << 20:
            assert PLANTED.encode() not in path.read_bytes(), path
    assert PLANTED not in proc.stdout + proc.stderr


def test_bad_agentenv_options_fail_before_the_run_starts(tmp_path: Path) -> None:
    proc, calls, out = _train(tmp_path, "--set", 'reward.sandbox_options.domain="not a domain"')
    assert proc.returncode != 0 and calls == []
    assert "reward.sandbox_options" in proc.stderr and "is not a DNS name" in proc.stderr
    assert not (out / "metrics.jsonl").exists()
    proc, calls, _ = _train(tmp_path, "--set", f'reward.sandbox_options.api_key="{PLANTED}"')
    assert proc.returncode != 0 and calls == [] and "never accepted inline" in proc.stderr
    assert PLANTED not in proc.stdout + proc.stderr
