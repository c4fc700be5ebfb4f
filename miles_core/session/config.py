"""Configuration of one session server (what ``miles session serve`` options fill in)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from miles_core.errors import ConfigError


@dataclass(frozen=True)
class ServiceLimits:
    max_sessions: int = 10_000
    max_turns: int = 1024  # generated turns kept per session


@dataclass(frozen=True)
class SessionServerConfig:
    upstream_url: str  # engine base URL, e.g. http://127.0.0.1:30000 (without /v1)
    tokenizer_dir: str | Path  # a Hugging Face tokenizer directory with a chat template
    version: str = "v1"
    chat_template: str | Path | None = None  # a Jinja file replacing the tokenizer's template
    template_family: str | None = None  # default: detected from the template
    upstream_timeout: float = 600.0  # seconds an upstream call may take as a whole
    connect_timeout: float = 10.0
    connect_retries: int = 2
    upstream_headers: Mapping[str, str] = field(default_factory=dict)
    max_sessions: int = 10_000
    max_turns: int = 1024
    max_body_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        url = urlsplit(self.upstream_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"upstream_url must be an http(s) URL like http://127.0.0.1:30000, got {self.upstream_url!r}")
        if url.path.rstrip("/").endswith("/v1"):
            raise ConfigError(f"upstream_url is the engine's base URL, without /v1: got {self.upstream_url!r}")
        for name in ("upstream_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name, minimum in (("connect_retries", 0), ("max_sessions", 1), ("max_turns", 1), ("max_body_bytes", 1)):
            if getattr(self, name) < minimum:
                raise ConfigError(f"{name} must be >= {minimum}, got {getattr(self, name)!r}")

    @property
    def limits(self) -> ServiceLimits:
        return ServiceLimits(max_sessions=self.max_sessions, max_turns=self.max_turns)
