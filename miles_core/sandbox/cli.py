"""``miles sandbox providers|run|sweep``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from miles_core.cli._output import console, emit_json, plain, styled
from miles_core.errors import ConfigError, MilesError

PROVIDER_HELP = "Sandbox provider name (see `miles sandbox providers`)."


def _provider_options(func: Any) -> Any:
    func = click.option(
        "--option",
        "-o",
        "options",
        multiple=True,
        metavar="KEY=VALUE",
        help="Provider option; repeatable, overrides --config. Secrets are references: env:NAME or file:PATH.",
    )(func)
    func = click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="TOML or JSON file holding a table of provider options.",
    )(func)
    return click.option("--provider", "-p", default="local", show_default=True, help=PROVIDER_HELP)(func)


@click.group()
def sandbox() -> None:
    """Sandbox providers: list them, run a command in a sandbox, destroy orphans, probe their isolation."""


@sandbox.command("providers")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
@click.option(
    "--no-verify", is_flag=True, help="Skip each provider's verify() (faster; status is 'unverified')."
)
def providers(as_json: bool, no_verify: bool) -> None:
    """List installed providers with their plugin, options and verification status.

    Verification runs each provider's verify(): the local provider runs a probe sandbox and
    checks its limits and isolation from inside; SDK-backed providers check the SDK calls they
    make exist with the signatures they use. Always exits 0; a failure is reported per provider.
    """
    from miles_core.plugins import get_plugin_manager
    from miles_core.sandbox.activation import verify_contribution

    pm = get_plugin_manager()
    rows: list[dict[str, Any]] = []
    for contribution in pm.contributions("sandbox"):
        spec = contribution.obj
        row: dict[str, Any] = {
            "name": spec.name,
            "plugin": contribution.plugin.name,
            "distribution": contribution.plugin.distribution,
            "version": contribution.plugin.version,
            "description": spec.description,
            "default_base": spec.default_base,
            "options": dict(spec.options),
            "status": "unverified",
            "detail": "",
            "facts": {},
        }
        if not no_verify:
            try:
                row["facts"] = verify_contribution(contribution, pm)
                row["status"] = "ok"
            except MilesError as exc:
                row["status"], row["detail"] = "fail", str(exc)
        rows.append(row)
    broken = [
        {"plugin": record.name, "reason": "; ".join(p.message for p in problems)}
        for record, problems in pm.broken_for("sandbox")
    ]
    if as_json:
        emit_json({"providers": rows, "broken_plugins": broken})
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title="sandbox providers", title_justify="left")
    for column in ("provider", "plugin", "status", "isolation / capabilities / detail"):
        table.add_column(column, overflow="fold")
    for row in rows:
        caps = row["facts"].get("capabilities", {})
        limits_by = row["facts"].get("limits_by")
        lines = [
            _isolation_line(row["facts"]),
            f"limits: {limits_by}" if limits_by else "",
            ", ".join(f"{k}={v}" for k, v in caps.items()) if caps else row["detail"] or row["description"],
        ]
        table.add_row(
            plain(row["name"]),
            plain(f"{row['plugin']} ({row['distribution']} {row['version']})"),
            styled(row["status"]),
            # one sanitized Text per line: plain() shows a newline inside its value as "\n"
            Text("\n").join(plain(line) for line in lines if line),
        )
    out = console()
    out.print(table)
    for item in broken:
        out.print(plain("broken plugin ", "red") + plain(f"{item['plugin']}: {item['reason']}"))


def _isolation_line(facts: dict[str, Any]) -> str:
    """``isolation: namespaces (bwrap: bubblewrap 0.8.0); python: /usr/bin/python3 3.11.2 (host)``."""
    isolation = facts.get("isolation")
    if not isolation:
        return ""
    text = f"isolation: {isolation}"
    if facts.get("tool"):
        text += f" ({facts['tool']}: {facts.get('tool_detail')})"
    elif isolation == "process" and facts.get("namespaces"):
        text += f" (namespaces unavailable: {facts['namespaces'].get('detail')})"
    python = facts.get("interpreters")
    text += f"; python: {python['python']} {python['version']} ({python['origin']})" if python else "; python: none"
    return text


@sandbox.command("probe")
@_provider_options
@click.option(
    "--probe", "names", multiple=True, metavar="NAME", help="Run only this probe (repeatable; default: all)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def probe_cmd(
    provider: str, config_path: Path | None, options: tuple[str, ...], names: tuple[str, ...], as_json: bool
) -> None:
    """Run the hostile probes -- what model-written code tries to do -- against a provider.

    Each probe runs in a fresh sandbox and is judged from evidence: reading another process's
    environment, signalling a host process, reading another sandbox's files, escaping destroy,
    leaving files in /tmp, /dev/shm or /var/tmp, a bounded fork loop, reaching the host's
    network, seeing host processes or reading host files. Exits 1 if a probe the provider
    claims to stop (its capabilities' isolates) got through.
    """
    from miles_core.sandbox.activation import open_provider
    from miles_core.sandbox.aio import run_sync
    from miles_core.sandbox.config import load_config
    from miles_core.testing.sandbox_probes import PROBES, hostile_probes

    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        raise ConfigError(f"--probe: unknown probe(s) {', '.join(unknown)}; known: {', '.join(PROBES)}")
    sandbox_provider = open_provider(provider, load_config(config_path, options))

    async def go() -> Any:
        try:
            return await hostile_probes(sandbox_provider, names=list(names) or None, local=provider == "local")
        finally:
            await sandbox_provider.aclose()

    results = run_sync(go())
    described = getattr(sandbox_provider, "describe", None)
    failed = [r for r in results if r.claimed and r.escaped]
    if as_json:
        emit_json(
            {
                "provider": provider,
                "user": os.geteuid(),
                "setup": described() if callable(described) else {},
                "claims": sorted(sandbox_provider.capabilities.isolates),
                "probes": [r.to_dict() for r in results],
                "escaped": sum(r.escaped for r in results),
                "claimed_escaped": len(failed),
            }
        )
    else:
        from rich.table import Table

        table = Table(title=f"hostile probes: {provider} (uid {os.geteuid()})", title_justify="left")
        for column in ("probe", "result", "claimed", "evidence"):
            table.add_column(column, overflow="fold")
        colours = {"escaped": "red", "blocked": "green", "not observable": "yellow"}
        for r in results:
            verdict = "escaped" if r.escaped else ("blocked" if r.observed else "not observable")
            claimed = "yes" if r.claimed else "no"
            table.add_row(r.name, f"[{colours[verdict]}]{verdict}[/]", claimed, r.evidence)
        console().print(table)
    if failed:
        sys.exit(1)


@sandbox.command("run")
@_provider_options
@click.option("--base", help="Base image for --step recipes (default: the provider's).")
@click.option(
    "--build-user", help="User the --step commands run as (default: the provider's; local: this user)."
)
@click.option(
    "--step",
    "steps",
    multiple=True,
    metavar="CMD",
    help="Image build step, in order (repeatable); the image is cached by digest.",
)
@click.option(
    "--file",
    "files",
    multiple=True,
    metavar="SRC:DEST",
    help="Copy local file SRC to DEST (relative to the workdir) before running; repeatable.",
)
@click.option(
    "--env",
    "-e",
    "env",
    multiple=True,
    metavar="KEY=VALUE",
    help="Environment variable for the command; repeatable.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Kill the command this many seconds after it started (exit 124); set-up is not counted.",
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Sandbox TTL in seconds: reclaimed this long after its owner stops renewing it.",
)
@click.option(
    "--network/--no-network",
    default=False,
    show_default=True,
    help="Allow network access (default: isolated where the provider can).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the result as one JSON document instead of the command's output.",
)
@click.argument("command", nargs=-1, required=True)
def run(
    provider: str,
    config_path: Path | None,
    options: tuple[str, ...],
    base: str | None,
    build_user: str | None,
    steps: tuple[str, ...],
    files: tuple[str, ...],
    env: tuple[str, ...],
    timeout: float | None,
    ttl: float,
    network: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Create a sandbox, run COMMAND in it, destroy it; exit with COMMAND's exit code.

    Put `--` before COMMAND when it has options: `miles sandbox run -- python3 -c 'print(1)'`.
    A single COMMAND word containing spaces runs through /bin/sh -c. Exit codes: the command's
    own; 124 when it timed out; 128+N when it died of signal N.
    """
    from miles_core.sandbox.aio import run_sync
    from miles_core.sandbox.config import load_config

    config = load_config(config_path, options)
    payloads = [_read_file_arg(item) for item in files]
    variables = dict(_key_value(item, "--env") for item in env)
    argv: str | list[str] = command[0] if len(command) == 1 and " " in command[0] else list(command)
    result, sandbox_id, image = run_sync(
        _run(provider, config, base, build_user, steps, payloads, variables, argv, timeout, ttl, network)
    )
    code = 124 if result.timed_out else (128 - result.exit_code if result.exit_code < 0 else result.exit_code)
    if as_json:
        emit_json(
            {
                "provider": provider,
                "sandbox": sandbox_id,
                "image": image,
                "exit_code": result.exit_code,
                "timed_out": result.timed_out,
                "truncated": result.truncated,
                "duration_s": round(result.duration_s, 4),
                "stdout": result.stdout,
                "stderr": result.stderr,
            }
        )
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    sys.exit(code)


async def _run(
    provider: str,
    config: dict[str, Any],
    base: str | None,
    build_user: str | None,
    steps: tuple[str, ...],
    payloads: list[tuple[str, bytes]],
    env: dict[str, str],
    argv: str | list[str],
    timeout: float | None,
    ttl: float,
    network: bool,
) -> tuple[Any, str, str | None]:
    from miles_core.sandbox.activation import open_manager, verified_spec
    from miles_core.sandbox.base import ImageSpec, Run, SandboxSpec

    descriptor, _ = verified_spec(provider)
    async with open_manager(provider, config) as manager:
        image = None
        if steps or base:
            recipe = ImageSpec(
                base or descriptor.default_base,
                tuple(Run(step) for step in steps),
                user=build_user or descriptor.default_build_user,
            )
            image = await manager.prepare_image(recipe)
        async with await manager.create(SandboxSpec(image=image, ttl_s=ttl, network=network)) as box:
            for dest, data in payloads:
                await box.write_file(dest, data)
            result = await box.exec(argv, env=env, timeout=timeout)
            return result, box.id, image.name if image else None


def _key_value(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
    return key, value


def _read_file_arg(item: str) -> tuple[str, bytes]:
    src, sep, dest = item.rpartition(":")
    if not sep or not src or not dest:
        raise ConfigError(f"--file {item!r}: expected SRC:DEST")
    try:
        return dest, Path(src).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--file {item!r}: cannot read {src} ({exc.strerror})") from None


@sandbox.command("sweep")
@_provider_options
@click.option(
    "--owner", help="Destroy every managed sandbox of this run id (label miles.owner), live owner or not."
)
@click.option("--dry-run", is_flag=True, help="Only report what would be destroyed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def sweep_cmd(
    provider: str,
    config_path: Path | None,
    options: tuple[str, ...],
    owner: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Destroy orphaned sandboxes: managed ones whose TTL passed or whose owner process on this
    host is gone, or every one of the run named by --owner. Sandboxes of live owners, or owners
    on other hosts, are kept (and listed)."""
    from miles_core.sandbox.activation import open_provider
    from miles_core.sandbox.aio import run_sync
    from miles_core.sandbox.config import load_config
    from miles_core.sandbox.ownership import sweep

    sandbox_provider = open_provider(provider, load_config(config_path, options))

    async def go() -> Any:
        try:
            return await sweep(sandbox_provider, owner=owner, dry_run=dry_run)
        finally:
            await sandbox_provider.aclose()

    report = run_sync(go())
    if as_json:
        emit_json({"provider": provider, **report.to_dict()})
        return
    out = console()
    verb = "would destroy" if dry_run else "destroyed"
    for row in report.destroyed:
        out.print(plain(f"{verb} {row['id']} (owner {row['owner']}@{row['host']}): {row['reason']}"))
    for row in report.kept:
        out.print(plain(f"kept {row['id']} (owner {row['owner']}@{row['host']}): {row['reason']}", "dim"))
    out.print(f"{len(report.destroyed)} {verb}, {len(report.kept)} kept")
