"""``miles session serve|versions``: documented options, bad input exits 2 naming the field, and a
real server process answers."""

import json
import os
import subprocess
import sys

import httpx
import pytest
from click.testing import CliRunner

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import cli, main
from miles_core.testing.engine_stub import ScriptedChat, StubEngine

register_cpu_ci(est_time=10, suite="stage-a-cpu")

SERVE_OPTIONS = (
    "--upstream", "--upstream-url", "--tokenizer", "--tokenizer-dir", "--version", "--chat-template", "--template-family", "--host", "--port",
    "--upstream-timeout", "--connect-timeout", "--connect-retries", "--max-sessions", "--max-turns", "--workers", "--log-level",
)


def test_serve_help_documents_every_option() -> None:
    result = CliRunner().invoke(cli, ["session", "serve", "--help"])
    assert result.exit_code == 0
    for option in SERVE_OPTIONS:
        assert option in result.output


def test_versions_json_is_one_document() -> None:
    result = CliRunner().invoke(cli, ["session", "versions", "--json"])
    assert result.exit_code == 0
    names = [v["name"] for v in json.loads(result.output)["versions"]]
    assert {"v1", "v2"} <= set(names)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--upstream", "ftp://x"], "upstream_url must be an http(s) URL"),
        (["--upstream", "http://127.0.0.1:1/v1"], "without /v1"),
        (["--upstream-timeout", "0"], "upstream_timeout must be > 0"),
        (["--max-turns", "0"], "max_turns must be >= 1"),
        (["--version", "v9"], "no session named 'v9'"),
    ],
)
def test_bad_options_exit_2_naming_the_field(args, expected, tokenizer_dir, capsys) -> None:
    base = {"--upstream": "http://127.0.0.1:1", "--tokenizer": str(tokenizer_dir)}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["session", "serve", *[x for pair in base.items() for x in pair]]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


def test_missing_tokenizer_dir_exits_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["session", "serve", "--upstream", "http://127.0.0.1:1", "--tokenizer", str(tmp_path / "none")])
    assert info.value.code == 2
    assert "tokenizer directory" in capsys.readouterr().err


def test_serve_process_answers(tokenizer_dir, chat_tokenizer) -> None:
    with StubEngine(ScriptedChat(chat_tokenizer)) as stub:
        argv = [sys.executable, "-m", "miles_core", "session", "serve", "--upstream", stub.url,
                "--tokenizer", str(tokenizer_dir), "--version", "v2", "--port", "0", "--log-level", "warning"]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
        try:
            line = process.stdout.readline()
            assert "listening on http://127.0.0.1:" in line, (line, process.stderr.read() if process.poll() else "")
            url = line.split("listening on ")[1].split(",")[0]
            assert httpx.get(f"{url}/health", timeout=10).json()["version"] == "v2"
            sid = httpx.post(f"{url}/sessions").json()["session_id"]
            reply = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].startswith("#1 ")
        finally:
            process.terminate()
            assert process.wait(timeout=20) == 0  # stopped gracefully (miles_core.uvicorn_signals)
            assert "Traceback" not in process.stderr.read()
