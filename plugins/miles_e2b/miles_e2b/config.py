"""Explicit endpoint configuration for E2B Cloud and self-hosted AgentENV.

Every endpoint is a field, passed to each SDK call -- never left to ambient ``E2B_*`` variables,
which would give one endpoint per process and silently override a config that omits them
(:meth:`E2BConfig.check_environment` refuses that). The API key is a
:class:`~miles_core.sandbox.secrets.SecretRef`, resolved on the worker; :meth:`worker_env` is what
a launcher forwards to workers: endpoints by value, the key by reference.

Presets:

* ``cloud`` (default): ``domain`` ``e2b.app``, HTTPS, the SDK's default API URL.
* ``agentenv``: a self-hosted AgentENV server, whose native API is E2B's. Needs ``api_url``
  (its control plane, e.g. ``http://10.0.0.5:8000``; ``sandbox_url`` defaults to it) and
  ``domain`` (the wildcard domain its proxy answers, e.g. ``10.0.0.5.sslip.io``), plain HTTP.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal
from urllib.parse import urlsplit

from miles_core.errors import ConfigError
from miles_core.sandbox.secrets import Secret, SecretRef
from miles_e2b.options import OPTIONS

CLOUD_DOMAIN = "e2b.app"
DEFAULT_KEY = SecretRef.env("E2B_API_KEY")
#: the variables the SDK reads when a call does not pass the value
AMBIENT = {"api_url": "E2B_API_URL", "sandbox_url": "E2B_SANDBOX_URL"}
#: prefix of the variables :meth:`E2BConfig.worker_env` forwards
WORKER_PREFIX = "MILES_E2B_"
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$"
)


def _url(value: Any, key: str) -> str:
    text = str(value).strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"miles-e2b option {key}: expected an http(s) URL, got {text!r}")
    if "@" in parts.netloc:
        raise ConfigError(f"miles-e2b option {key}: credentials in the URL are refused; use api_key")
    if parts.query or parts.fragment:
        raise ConfigError(f"miles-e2b option {key}: no query or fragment allowed, got {text!r}")
    return text


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text in ("1", "true", "yes", "on")
    raise ConfigError(f"miles-e2b option {key}: expected true or false, got {value!r}")


@dataclass(frozen=True)
class E2BConfig:
    api_key: SecretRef = DEFAULT_KEY
    domain: str = CLOUD_DOMAIN
    api_url: str | None = None
    sandbox_url: str | None = None
    scheme: Literal["http", "https"] = "https"
    workdir: str = "/home/user"
    template: str | None = None
    public_traffic: bool = False
    request_timeout_s: float | None = None
    preset: Literal["cloud", "agentenv"] = field(default="cloud")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> E2BConfig:
        """Validate provider options (``miles sandbox ... -o key=value`` or a config file)."""
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"miles-e2b: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}"
            )
        preset = str(opts.pop("preset", "cloud"))
        if preset not in ("cloud", "agentenv"):
            raise ConfigError(f"miles-e2b option preset: expected cloud or agentenv, got {preset!r}")
        values: dict[str, Any] = {"preset": preset}
        if "api_key" in opts:
            values["api_key"] = SecretRef.parse(str(opts.pop("api_key")), field="miles-e2b option api_key")
        for key in ("api_url", "sandbox_url"):
            if key in opts:
                values[key] = _url(opts.pop(key), key)
        if "domain" in opts:
            domain = str(opts.pop("domain")).strip()
            if not _HOST.match(domain):
                raise ConfigError(f"miles-e2b option domain: {domain!r} is not a DNS name")
            values["domain"] = domain
        if "scheme" in opts:
            scheme = str(opts.pop("scheme"))
            if scheme not in ("http", "https"):
                raise ConfigError(f"miles-e2b option scheme: expected http or https, got {scheme!r}")
            values["scheme"] = scheme
        if "workdir" in opts:
            workdir = str(opts.pop("workdir"))
            if not workdir.startswith("/"):
                raise ConfigError(f"miles-e2b option workdir: expected an absolute path, got {workdir!r}")
            values["workdir"] = workdir.rstrip("/") or "/"
        if "template" in opts:
            values["template"] = str(opts.pop("template"))
        if "public_traffic" in opts:
            values["public_traffic"] = _bool(opts.pop("public_traffic"), "public_traffic")
        if "request_timeout_s" in opts:
            try:
                timeout = float(opts.pop("request_timeout_s"))
            except (TypeError, ValueError):
                timeout = -1.0
            if not timeout > 0:
                raise ConfigError("miles-e2b option request_timeout_s: expected a positive number of seconds")
            values["request_timeout_s"] = timeout
        if preset == "agentenv":
            if "api_url" not in values or "domain" not in values:
                raise ConfigError("miles-e2b preset agentenv needs api_url (http://<server>:8000) and domain")
            values.setdefault("sandbox_url", values["api_url"])
            values.setdefault("scheme", "http")
        return cls(**values)

    def api_params(self, key: Secret) -> dict[str, Any]:
        """Keyword arguments for every SDK call: the endpoints, explicitly, and the key.

        ``retries=0``: the SDK's own retries of 429/502/503/504 are off, so the lifecycle
        layer's retry policy is the one budget (with the SDK's three inside each of miles' six
        attempts, one throttled create made 24 requests)."""
        params: dict[str, Any] = {"api_key": key.reveal(), "domain": self.domain, "retries": 0}
        if self.api_url is not None:
            params["api_url"] = self.api_url
        if self.sandbox_url is not None:
            params["sandbox_url"] = self.sandbox_url
        if self.request_timeout_s is not None:
            params["request_timeout"] = self.request_timeout_s
        return params

    def check_environment(self, environ: Mapping[str, str] | None = None) -> None:
        """Refuse ambient endpoint variables the SDK would use in place of an unset field."""
        env = os.environ if environ is None else environ
        for key, variable in AMBIENT.items():
            if getattr(self, key) is None and env.get(variable):
                raise ConfigError(
                    f"{variable} is set in this process's environment but the miles-e2b config has no "
                    f"{key}: the SDK would silently use the variable. Set {key} explicitly (or unset {variable})"
                )
        if env.get("E2B_DEBUG", "").lower() == "true":
            raise ConfigError("E2B_DEBUG=true makes the SDK talk to localhost and skip kills; unset it")

    def worker_env(self) -> dict[str, str]:
        """What a launcher forwards to workers (Ray runtime env): values, and the key's reference."""
        env = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None:
                env[WORKER_PREFIX + item.name.upper()] = str(value)
        return env

    @classmethod
    def from_worker_env(cls, environ: Mapping[str, str] | None = None) -> E2BConfig:
        """Rebuild the config on a worker from :meth:`worker_env`'s variables."""
        env = os.environ if environ is None else environ
        options = {
            name[len(WORKER_PREFIX) :].lower(): value
            for name, value in env.items()
            if name.startswith(WORKER_PREFIX)
        }
        return cls.from_options(options)
