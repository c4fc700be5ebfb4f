"""The SGLang adapter against a stub that speaks SGLang's HTTP shapes (SGLang needs a GPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.sglang import SGLangConfig, SGLangError, SGLangServer, launch_sglang
from miles_core.errors import ConfigError

register_cpu_ci(est_time=6, suite="stage-a-cpu")

STUB = (sys.executable, str(Path(__file__).with_name("sglang_stub.py")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, **overrides) -> SGLangConfig:
    env = {"STUB_ARGV_FILE": str(tmp_path / "argv.json"), **overrides.pop("env", {})}
    options = {"model_path": str(tmp_path), "port": _free_port(), "launcher": STUB, "env": env, "startup_timeout": 20.0, "shutdown_grace": 2.0}
    return SGLangConfig(**{**options, **overrides})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_command_line_is_built_from_config(tmp_path: Path) -> None:
    config = SGLangConfig(
        model_path="/models/m", port=31000, tp_size=2, dtype="bfloat16", mem_fraction_static=0.7,
        context_length=8192, random_seed=3, weight_version="7", extra_args=("--disable-radix-cache",),
    )
    cmd = config.command()
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {
        "--model-path": "/models/m", "--host": "127.0.0.1", "--port": "31000", "--tp-size": "2", "--dtype": "bfloat16",
        "--log-level": "warning", "--mem-fraction-static": "0.7", "--context-length": "8192", "--random-seed": "3",
        "--weight-version": "7",
    }
    assert cmd[-1] == "--disable-radix-cache"


@pytest.mark.parametrize(
    "options, field",
    [({}, "exactly one"), ({"model_path": "m", "url": "http://x"}, "exactly one"), ({"model_path": "m", "port": 0}, "port"),
     ({"model_path": "m", "tp_size": 0}, "tp_size"), ({"model_path": "m", "mem_fraction_static": 1.5}, "mem_fraction_static")],
)
def test_bad_config_is_rejected(options: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SGLangConfig(**options)


def test_launch_health_chat_weight_update_and_shutdown(tmp_path: Path) -> None:
    config = _config(tmp_path, weight_version="0", env={"STUB_STARTUP_DELAY": "0.5"})
    server = launch_sglang(**config.__dict__)
    try:
        assert json.loads((tmp_path / "argv.json").read_text())["argv"] == config.command()[2:]
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": [], "input_ids": [1, 2, 3]}).json()
        meta = reply["choices"][0]["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
        new_weights = tmp_path / "step-1"
        new_weights.mkdir()
        assert server.update_weights_from_disk(str(new_weights), "1") == "1"
        with pytest.raises(SGLangError, match="refused the weight update"):
            server.update_weights_from_disk(str(tmp_path / "missing"), "2")
        assert server.weight_version() == "1"
    finally:
        server.shutdown()
    assert server.process.poll() is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=1.0)


def test_shutdown_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    server = SGLangServer.launch(_config(tmp_path, env={"STUB_IGNORE_SIGTERM": "1"}))
    pid = server.process.pid
    server.shutdown()
    assert not _alive(pid)


def test_a_server_that_dies_at_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(SGLangError, match=r"exited with code 3(.|\n)*failing on purpose"):
        SGLangServer.launch(_config(tmp_path, env={"STUB_EXIT_CODE": "3"}))


def test_health_timeout_leaves_nothing_running(tmp_path: Path) -> None:
    config = _config(tmp_path, env={"STUB_STARTUP_DELAY": "60"}, startup_timeout=1.0)
    with pytest.raises(SGLangError, match="not healthy after"):
        SGLangServer.launch(config)
    assert not _alive(json.loads((tmp_path / "argv.json").read_text())["pid"])


def test_attach_never_kills_the_server(tmp_path: Path) -> None:
    port = _free_port()
    process = subprocess.Popen([*STUB, "--model-path", str(tmp_path), "--port", str(port)])
    try:
        server = launch_sglang(url=f"http://127.0.0.1:{port}/", startup_timeout=20.0)
        assert server.base_url == f"http://127.0.0.1:{port}"
        assert server.weight_version() == "default"
        server.shutdown()
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait()
