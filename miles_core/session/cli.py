"""``miles session serve|versions``: run the session server, list session versions."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def session() -> None:
    """Token-in-token-out session server for agentic rollouts."""


@session.command()
@click.option("--upstream", "--upstream-url", "upstream_url", required=True, metavar="URL",
              help="Base URL of the SGLang-compatible engine, e.g. http://127.0.0.1:30000 (without /v1).")
@click.option("--tokenizer", "--tokenizer-dir", "tokenizer_dir", required=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path),
              help="Hugging Face tokenizer directory whose chat template renders prompts.")
@click.option("--version", "version", default="v1", show_default=True, metavar="NAME",
              help="Session version: v1 (linear), v2 (tree) or one a plugin registers (see `miles session versions`).")
@click.option("--chat-template", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Jinja chat template replacing the tokenizer's own (it must be append-only).")
@click.option("--template-family", default=None, metavar="NAME",
              help="Boundary rules between turns (chatml, glm4); detected from the template by default.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 picks a free one; the URL is printed).")
@click.option("--upstream-timeout", default=600.0, show_default=True, type=float,
              help="Seconds an engine call may take as a whole (connecting, sending, the complete reply) before answering 502.")
@click.option("--connect-timeout", default=10.0, show_default=True, type=float,
              help="Seconds to wait for a connection to the engine.")
@click.option("--connect-retries", default=2, show_default=True, type=int,
              help="Retries when the engine refuses a connection (requests that reached it are never retried).")
@click.option("--max-sessions", default=10_000, show_default=True, type=int,
              help="Open sessions the server holds before POST /sessions answers 409.")
@click.option("--max-turns", default=1024, show_default=True, type=int,
              help="Generated turns one session keeps before its chat requests answer 409.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Processes serving the sessions, each owning a share of them (one core each; "
              "see docs/session.md). Limits such as --max-sessions are then split between them.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn log level.")
def serve(
    upstream_url: str,
    tokenizer_dir: Path,
    version: str,
    chat_template: Path | None,
    template_family: str | None,
    host: str,
    port: int,
    upstream_timeout: float,
    connect_timeout: float,
    connect_retries: int,
    max_sessions: int,
    max_turns: int,
    workers: int,
    log_level: str,
) -> None:
    """Serve the session HTTP API in front of an engine until interrupted.

    Agents create a session (POST /sessions), talk OpenAI chat to
    /sessions/{id}/v1/chat/completions, and the trainer collects token-exact samples from
    POST /sessions/{id}/samples. Bad options exit 2 before anything listens.
    """
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import base_url, bind_socket, serve_forever
    from miles_core.session.server import build_app

    config = SessionServerConfig(
        upstream_url=upstream_url,
        tokenizer_dir=tokenizer_dir,
        version=version,
        chat_template=chat_template,
        template_family=template_family,
        upstream_timeout=upstream_timeout,
        connect_timeout=connect_timeout,
        connect_retries=connect_retries,
        max_sessions=max_sessions,
        max_turns=max_turns,
    )
    app = build_app(config)
    sock = bind_socket(host, port)
    served_by = "" if workers == 1 else f", {workers} workers"
    click.echo(f"miles session server (version {version}) listening on {base_url(sock)}, upstream {upstream_url}{served_by}")
    sys.stdout.flush()
    if workers == 1:
        serve_forever(app, sock, log_level=log_level, access_log=True)
        return
    from miles_core.session.workers import serve_workers

    del app  # each worker builds its own; this one only checked that it can be built
    sys.exit(serve_workers(config, sock, workers, log_level=log_level, access_log=True))


@session.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def versions(as_json: bool) -> None:
    """List registered session versions and the plugin that provides each."""
    from miles_core.cli._output import console, emit_json, plain
    from miles_core.plugins import get_plugin_manager

    rows = [
        {
            "name": c.name,
            "plugin": c.plugin.name,
            "distribution": c.plugin.distribution,
            "description": getattr(c.obj, "description", ""),
            "max_in_flight": getattr(c.obj, "max_in_flight", None),
        }
        for c in get_plugin_manager().contributions("session")
    ]
    if as_json:
        emit_json({"versions": rows})
        return
    out = console()
    for row in rows:
        out.print(plain(row["name"], "bold") + plain(f" ({row['plugin']}): {row['description']}"))
