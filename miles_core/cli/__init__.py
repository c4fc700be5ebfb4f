"""The ``miles`` command line.

Core commands are imported lazily (``LAZY_COMMANDS``) so ``miles --help`` and
``miles plugins list`` never pay for torch, transformers, ray or e2b. Plugins add commands through
the ``miles_commands`` hook.
"""

from __future__ import annotations

import sys

import click

from miles_core import __version__
from miles_core.errors import MilesError

#: command name -> ("module:attribute", one-line help shown by ``miles --help``)
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("miles_core.cli.plugins_cmd:plugins", "List and inspect installed plugins."),
    "doctor": ("miles_core.cli.doctor_cmd:doctor", "Activate every concern and report what was verified."),
    "sandbox": ("miles_core.sandbox.cli:sandbox", "Sandbox providers: list, run a command, sweep orphans, probe isolation."),
    "ci": ("miles_core.ci.cli:ci", "CI: test registrations, suites, sharding, runner, workflows."),
    "session": ("miles_core.session.cli:session", "Serve the token-in-token-out session server."),
    "engine": ("miles_core.engine.cli:engine", "Serve the embedded inference engine; list and build model presets."),
    "train": ("miles_core.rl.cli:train", "Train a policy with RL (GRPO/PPO) end to end; --preset tiny runs on a CPU."),
}


class MilesGroup(click.Group):
    """A click group whose core commands load on demand and whose plugins add the rest."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._add_plugin_commands()
        return sorted(set(LAZY_COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS:
            if cmd_name not in self.commands:
                from miles_core.plugins import import_object

                self.commands[cmd_name] = import_object(LAZY_COMMANDS[cmd_name][0])
            return self.commands[cmd_name]
        if cmd_name not in self.commands:
            self._add_plugin_commands()
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in LAZY_COMMANDS:
                rows.append((name, LAZY_COMMANDS[name][1]))
            else:
                cmd = self.commands[name]
                rows.append((name, cmd.get_short_help_str(limit=70)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def _add_plugin_commands(self) -> None:
        from miles_core.plugins import get_plugin_manager

        for name in LAZY_COMMANDS:  # plugins may not shadow core commands
            self.get_command(click.Context(self), name)
        get_plugin_manager().add_commands(self)


@click.group(cls=MilesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="miles", message="%(prog)s %(version)s")
def cli() -> None:
    """miles: RL post-training for LLMs, a minimal core plus installable plugins.

    \b
    Environment:
      MILES_PLUGINS=a,b            only these third-party plugins load (allow list)
      MILES_DISABLE_PLUGINS=a,b    these plugins never load, built-ins included (deny list);
                                   in both lists an item is a plugin name, a distribution
                                   name, or DIST:NAME (one of two same-named plugins)
      MILES_PLUGIN_ERRORS=raise    fail on the first plugin import, hook or verification error
                                   (`miles plugins list|show` still list, with the verdict)
      MILES_PLUGIN_SLOW_MS=ms      flag plugins slower than this to load (default 200)
      MILES_HARDWARE=name          select this hardware backend instead of detecting one
      MILES_CACHE_DIR=dir          cache of built model presets and the entry-point scan
                                   (default $XDG_CACHE_HOME/miles or ~/.cache/miles)
      MILES_NO_ENTRY_POINT_CACHE=1 rescan installed distributions on every start
    """


_command_process = False


def is_command_process() -> bool:
    """Whether this process is a ``miles`` command's own: it ends when the command does (see
    :func:`main`). Commands may then leave process-wide settings (signal handlers) in place."""
    return _command_process


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: MilesError becomes a one-line message and its exit code.

    ``argv=None`` (the console script, ``python -m miles_core``) means this process's own command
    line: the process ends with the command, so its exit skips the collector's teardown of the
    imported modules (:func:`miles_core.gc_pause.freeze_at_exit`). Callers passing ``argv`` (tests,
    embedding code) keep their process's collector and signal handlers as they are.
    """
    if argv is None:
        global _command_process
        _command_process = True
        import atexit

        from miles_core.gc_pause import freeze_at_exit

        atexit.register(freeze_at_exit)
    try:
        cli.main(args=argv, prog_name="miles", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except MilesError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        from miles_core.extras import MissingExtraError, missing_module_message

        advice = missing_module_message(exc)
        if advice is None:
            raise
        click.echo(f"error: {advice}", err=True)
        sys.exit(MissingExtraError.exit_code)
    sys.exit(0)
