"""The SGLang adapter: launch an SGLang server from config (or attach to one), wait until it is
healthy, update its weights through its HTTP API, and shut it down cleanly.

SGLang speaks the same contract as the embedded engine (with the miles SGLang build:
``input_ids`` on chat, ``choices[0].meta_info.output_token_logprobs``); this module only manages
its lifecycle. Launching runs ``python -m sglang.launch_server ...`` in its own process group,
so shutdown reaches every process SGLang spawned (SIGTERM, then SIGKILL after a grace period).
Attaching never kills anything.

What was run: the adapter is tested against a stub that speaks SGLang's documented shapes
(``/health``, ``/update_weights_from_disk``, ``/get_weight_version``, ``/v1/chat/completions``).
SGLang itself cannot serve on the CPU development machines and has not been run by these tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from miles_core.errors import ConfigError, MilesError

T = TypeVar("T")


class SGLangError(MilesError):
    """SGLang failed to start, stayed unhealthy, or refused a request."""


@dataclass(frozen=True)
class SGLangConfig:
    """How to reach SGLang: ``url`` attaches to a running server, ``model_path`` launches one."""

    model_path: str | None = None
    url: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    context_length: int | None = None
    served_model_name: str | None = None
    random_seed: int | None = None
    weight_version: str | None = None
    log_level: str = "warning"
    #: appended verbatim (any ``sglang.launch_server`` flag this config does not name)
    extra_args: tuple[str, ...] = ()
    #: the command that starts the server, before its flags
    launcher: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
    env: dict[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 900.0
    request_timeout: float = 600.0
    shutdown_grace: float = 30.0

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.url is None):
            raise ConfigError("sglang: give exactly one of model_path (launch) or url (attach)")
        if not 0 < self.port < 65536:
            raise ConfigError(f"sglang.port must be in 1..65535, got {self.port}")
        if self.tp_size < 1:
            raise ConfigError(f"sglang.tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"sglang.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    def command(self) -> list[str]:
        """The ``sglang.launch_server`` command line this config describes."""
        if self.model_path is None:
            raise ConfigError("sglang: attach mode (url) launches nothing")
        cmd = [*self.launcher, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port)]
        cmd += ["--tp-size", str(self.tp_size), "--dtype", self.dtype, "--log-level", self.log_level]
        optional = {
            "--mem-fraction-static": self.mem_fraction_static,
            "--context-length": self.context_length,
            "--served-model-name": self.served_model_name,
            "--random-seed": self.random_seed,
            "--weight-version": self.weight_version,
        }
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        return [*cmd, *self.extra_args]


class SGLangServer:
    """A launched or attached SGLang server (an :class:`~miles_core.engine.base.EngineServer`)."""

    def __init__(self, config: SGLangConfig, process: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        self.config = config
        self.process = process
        self.log_path = log_path
        self._base_url = config.url.rstrip("/") if config.url else f"http://{config.host}:{config.port}"

    @classmethod
    def launch(cls, config: SGLangConfig) -> SGLangServer:
        """Start the server and wait until ``/health`` answers 200 (or raise, leaving nothing running)."""
        log = tempfile.NamedTemporaryFile(prefix="miles-sglang-", suffix=".log", delete=False)  # noqa: SIM115
        try:
            process = subprocess.Popen(
                config.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **config.env},
                start_new_session=True,  # its own process group: shutdown reaches its workers
            )
        except OSError as exc:
            raise SGLangError(f"sglang: cannot start {config.command()[0]!r}: {exc}") from exc
        finally:
            log.close()
        server = cls(config, process, Path(log.name))
        try:
            server.wait_until_healthy(config.startup_timeout)
        except BaseException:
            server.shutdown()
            raise
        return server

    @classmethod
    def attach(cls, config: SGLangConfig) -> SGLangServer:
        server = cls(config)
        server.wait_until_healthy(config.startup_timeout)
        return server

    @property
    def base_url(self) -> str:
        return self._base_url

    def wait_until_healthy(self, timeout: float) -> None:
        from miles_core.engine.client import EngineConnectionError, EngineHTTPError, EngineTimeoutError

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangError(
                    f"sglang exited with code {self.process.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                self._call(lambda client: client.health(), timeout=5.0, connect_retries=0)
                return
            except EngineHTTPError as exc:
                last = f"HTTP {exc.status_code}"
            except (EngineConnectionError, EngineTimeoutError) as exc:
                last = exc.detail
            if time.monotonic() > deadline:
                raise SGLangError(f"sglang at {self._base_url} not healthy after {timeout:.0f}s (last: {last})")
            time.sleep(0.2)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """POST ``/update_weights_from_disk``; return the server's weight version afterwards."""
        from miles_core.engine.client import EngineHTTPError

        try:
            self._call(lambda client: client.update_weights_from_disk(str(model_path), weight_version))
        except EngineHTTPError as exc:
            raise SGLangError(f"sglang refused the weight update from {model_path}: {exc.body_snippet}") from exc
        return self.weight_version()

    def weight_version(self) -> str:
        return self._call(lambda client: client.weight_version())

    def _call(self, request: Callable[[Any], Awaitable[T]], *, timeout: float | None = None, connect_retries: int = 2) -> T:
        """Run one :class:`~miles_core.engine.client.EngineClient` call to completion.

        These methods are synchronous (launch scripts, the trainer's step loop); do not call them
        from a running event loop.
        """
        from miles_core.engine.client import EngineClient

        async def run() -> T:
            async with EngineClient(
                self._base_url, timeout=timeout or self.config.request_timeout, connect_retries=connect_retries
            ) as client:
                return await request(client)

        return asyncio.run(run())

    def shutdown(self) -> None:
        """Stop a launched server and every process it spawned; attached servers are left alone."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session made it the group leader
        if self.process.poll() is None:
            _signal_group(group, signal.SIGTERM)
            try:
                self.process.wait(self.config.shutdown_grace)
            except subprocess.TimeoutExpired:
                _signal_group(group, signal.SIGKILL)
                self.process.wait()
        _signal_group(group, signal.SIGKILL)  # workers the server left behind, if any

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass  # the group is empty: nothing left to stop


def launch_sglang(**options: Any) -> SGLangServer:
    """Launcher of the ``sglang`` engine kind: attach when ``url`` is given, else launch."""
    config = SGLangConfig(**options)
    return SGLangServer.attach(config) if config.url else SGLangServer.launch(config)


def check_sglang() -> dict[str, Any]:
    """The adapter works in attach mode everywhere; launching needs the ``sglang`` package."""
    import importlib.util

    installed = importlib.util.find_spec("sglang") is not None
    return {"sglang_installed": installed, "modes": "launch, attach" if installed else "attach"}
