"""Provider configuration: a TOML/JSON file plus ``KEY=VALUE`` overrides (the CLI's input), and
the validation of provider options held in other configs (``miles train``'s ``[reward]``)."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """``path`` (``.toml`` or ``.json``, a table of provider options) updated by ``KEY=VALUE`` items."""
    config: dict[str, Any] = {}
    if path is not None:
        config = _read(Path(path))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"option {item!r}: expected KEY=VALUE")
        config[key.strip()] = value
    return config


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}, line {exc.lineno}: invalid JSON ({exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a table of provider options, got {type(data).__name__}"
        )
    return data


#: provider options as a config file holds them (what ``[reward.sandbox_options]`` takes)
ProviderOptions = dict[str, str | int | float | bool]


def check_provider_options(
    provider: str, options: Mapping[str, Any], *, where: str, pm: MilesPluginManager | None = None
) -> None:
    """Validate ``options`` against the installed provider named ``provider`` without creating
    it (no SDK import, no network): unknown keys, malformed values, secrets given by value.
    Raises :class:`ConfigError` prefixed with ``where`` (the config field)."""
    from miles_core.plugins import get_plugin_manager

    try:
        spec = (pm or get_plugin_manager()).contribution("sandbox", provider).obj
        spec.check_config(dict(options))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
