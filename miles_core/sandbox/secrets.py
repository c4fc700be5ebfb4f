"""Secret references, resolved on the worker, and redaction of every resolved value.

A :class:`SecretRef` names where a secret lives (``env:NAME`` or ``file:/path``); only the
reference ever travels (argv, Ray runtime environments, configs). The value is read where it is
used, wrapped in a :class:`Secret` whose ``repr`` hides it and which refuses to be pickled, and
registered for redaction: :func:`redact` (applied by :class:`~miles_core.sandbox.errors.SandboxError`
and by :class:`RedactingFilter` on the sandbox loggers) replaces it with ``***``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

from miles_core.errors import ConfigError

MASK = "***"
#: values shorter than this are not registered: masking "1" everywhere would garble logs
MIN_REDACT_LENGTH = 6

_registry: set[str] = set()
_registry_lock = threading.Lock()


def register_secret(value: str) -> None:
    """Redact ``value`` from every message :func:`redact` sees from now on."""
    if len(value) >= MIN_REDACT_LENGTH:
        with _registry_lock:
            _registry.add(value)


def redact(text: str) -> str:
    """``text`` with every registered secret value replaced by ``***``."""
    with _registry_lock:
        values = sorted(_registry, key=len, reverse=True)
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


class Secret:
    """A resolved secret value: hidden in ``repr``/``str``, never pickled."""

    __slots__ = ("_source", "_value")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        self._source = source
        register_secret(value)

    def reveal(self) -> str:
        """The value, for the one call that needs it (an SDK's ``api_key=`` argument)."""
        return self._value

    @property
    def source(self) -> str:
        return self._source

    def __repr__(self) -> str:
        return f"Secret({self._source}, {MASK})"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"a resolved secret ({self._source}) cannot be serialized; pass its SecretRef and "
            "resolve it on the worker"
        )


@dataclass(frozen=True)
class SecretRef:
    """Where a secret lives: ``env:NAME`` (a variable on the worker) or ``file:/path``.

    The string form (``str(ref)``) is what may be forwarded to workers; :meth:`parse` reads it.
    """

    kind: Literal["env", "file"]
    target: str

    def __post_init__(self) -> None:
        if self.kind not in ("env", "file"):
            raise ConfigError(f"secret reference kind must be 'env' or 'file', got {self.kind!r}")
        if not self.target:
            raise ConfigError(f"secret reference {self.kind}: needs a target")
        if self.kind == "env" and not self.target.replace("_", "").isalnum():
            raise ConfigError(f"secret reference env:{self.target} is not a variable name")

    @classmethod
    def env(cls, name: str) -> SecretRef:
        return cls("env", name)

    @classmethod
    def file(cls, path: str | os.PathLike[str]) -> SecretRef:
        return cls("file", os.fspath(path))

    @classmethod
    def parse(cls, text: str, *, field: str = "secret") -> SecretRef:
        """``env:NAME``, ``file:PATH`` or a bare path (absolute, ``~`` or ``./``)."""
        kind, sep, target = text.partition(":")
        if sep and kind == "env":
            return cls("env", target)
        if sep and kind == "file":
            return cls("file", target)
        if text.startswith(("/", "~", "./")):
            return cls("file", text)
        raise ConfigError(
            f"{field}: expected a secret reference 'env:NAME' or 'file:/path', got a value of "
            f"{len(text)} characters (secret values are never accepted inline)"
        )

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}"

    def resolve(self, environ: Mapping[str, str] | None = None) -> Secret:
        """Read the value where this runs (the worker). Errors name the reference, never a value."""
        if self.kind == "env":
            value = (os.environ if environ is None else environ).get(self.target, "")
            if not value.strip():
                raise ConfigError(f"secret {self}: variable {self.target} is unset or empty")
            return Secret(value.strip(), str(self))
        path = Path(self.target).expanduser()
        try:
            value = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ConfigError(f"secret {self}: file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"secret {self}: cannot read {path} ({exc.strerror})") from None
        if not value:
            raise ConfigError(f"secret {self}: file {path} is empty")
        return Secret(value, str(self))


class RedactingFilter(logging.Filter):
    """Rewrites each record's message with :func:`redact` (attach to handlers or loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = RedactingFilter()


def get_logger(name: str) -> logging.Logger:
    """A logger whose records are redacted before any handler sees them."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
