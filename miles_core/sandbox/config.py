"""Provider configuration from a TOML/JSON file plus ``KEY=VALUE`` overrides (the CLI's input)."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError


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
