"""``miles engine`` commands, and that discovering the engine concern stays cheap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import cli

register_cpu_ci(est_time=47, suite="stage-a-cpu")

HEAVY = ("torch", "transformers", "ray", "megatron", "e2b", "fastapi", "uvicorn", "httpx", "starlette", "pydantic")


def test_discovery_and_cli_import_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "import miles_core.engine.builtin as b, miles_core.engine.cli\n"
        "kinds = b.miles_inference_engines()\n"
        "assert [k.name for k in kinds] == ['embedded', 'sglang']\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_serve_help_documents_every_option() -> None:
    result = CliRunner().invoke(cli, ["engine", "serve", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--preset", "--host", "--port", "--max-batch-size", "--max-model-len", "--max-tokens",
                   "--dtype", "--device", "--seed", "--weight-version", "--served-model-name", "--cpu-threads"):
        assert option in result.output


def test_serve_needs_exactly_one_model_source(tmp_path) -> None:
    for args in ([], ["--preset", "tiny", "--model", str(tmp_path)]):
        result = CliRunner().invoke(cli, ["engine", "serve", *args], standalone_mode=False)
        assert "exactly one of --model DIR or --preset NAME" in str(result.exception)
    result = subprocess.run([sys.executable, "-m", "miles_core", "engine", "serve", "--model", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "config.json is missing" in result.stderr


def test_launch_names_an_empty_preset_as_unknown() -> None:
    from miles_core.engine.server import launch_embedded
    from miles_core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown preset ''"):
        launch_embedded(preset="")


def test_presets_json() -> None:
    result = CliRunner().invoke(cli, ["engine", "presets", "--json"])
    assert result.exit_code == 0
    assert [p["name"] for p in json.loads(result.output)["presets"]] == ["tiny", "tiny-rl", "small-gpu"]


def test_serve_a_preset_end_to_end(tiny_dir) -> None:
    """The real command: prints its URL, answers a chat completion, stops on SIGTERM."""
    import httpx

    env = {**os.environ, "MILES_CACHE_DIR": str(tiny_dir.parent)}
    process = subprocess.Popen(
        [sys.executable, "-m", "miles_core", "engine", "serve", "--preset", "tiny", "--port", "0", "--max-tokens", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("miles engine: serving tiny at http://"), line
        url = line.split(" at ")[1].split(" ")[0]
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+1="}], "seed": 0}, timeout=60).json()
        meta = reply["choices"][0]["meta_info"]
        assert 1 <= meta["completion_tokens"] == len(meta["output_token_logprobs"]) <= 5
    finally:
        process.terminate()
        assert process.wait(30) == 0  # stopped gracefully (miles_core.uvicorn_signals)


def test_engine_kinds_come_from_the_hook_and_launch(miles_pm_factory, tiny_dir) -> None:
    import httpx

    pm = miles_pm_factory(builtins=True)
    kinds = {c.name: c for c in pm.active_contributions("engine")}
    assert {"embedded", "sglang"} <= set(kinds)
    assert pm.verify(kinds["sglang"], kinds["sglang"].obj.verify)["modes"] in ("attach", "launch, attach")
    server = kinds["embedded"].obj.launch(model_path=str(tiny_dir), max_batch_size=2)
    try:
        assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
    finally:
        server.shutdown()
