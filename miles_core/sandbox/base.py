"""The sandbox provider protocol: what every provider implements and the data it exchanges.

A provider (the built-in ``local`` one, ``e2b`` from miles-e2b, ...) implements
:class:`SandboxProvider`: plain async operations on one sandbox at a time, with typed errors
(:mod:`miles_core.sandbox.errors`). Everything that must hold for *every* provider -- ownership
labels, cancellation-safe creation, the concurrency limit, keepalive, retries, single-flight
image builds, sweeping orphans -- lives once in :mod:`miles_core.sandbox.lifecycle`; callers use
that layer (or :class:`~miles_core.sandbox.pool.SandboxPool`), not providers directly.

Plugins contribute providers through ``miles_sandbox_providers()``, returning
:class:`~miles_core.sandbox.spec.SandboxProviderSpec` descriptors (re-exported here): cheap to
build, heavy imports only in ``create``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol, runtime_checkable

from miles_core.errors import ConfigError
from miles_core.sandbox.spec import SandboxProviderSpec, check_options

__all__ = ["SandboxProviderSpec", "check_options"]  # re-exported: the hookspec names them here

#: the resource limits a provider may enforce per exec (``Capabilities.limits``)
LIMIT_NAMES = ("cpu_seconds", "memory_mb", "file_size_mb", "processes", "open_files")
#: label keys the lifecycle layer sets on every sandbox it creates
LABEL_MANAGED = "miles.managed"
LABEL_OWNER = "miles.owner"
LABEL_HOST = "miles.host"
LABEL_PID = "miles.pid"
LABEL_PID_START = "miles.pid-start"
LABEL_CREATE = "miles.create"
DIGEST_SCHEMA = 1
#: hex characters of the image digest used in names (96 bits)
DIGEST_NAME_CHARS = 24


def _mapping(value: Mapping[str, str] | None, what: str) -> dict[str, str]:
    out = dict(value or {})
    for key, item in out.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ConfigError(f"{what}: keys and values must be strings, got {key!r}: {type(item).__name__}")
    return out


# -- images ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A build step: run ``cmd`` with ``/bin/sh -c`` as the image's build user."""

    cmd: str

    def canonical(self) -> dict[str, Any]:
        return {"run": self.cmd}


@dataclass(frozen=True, init=False)
class Copy:
    """A build step: place ``content`` at ``dest`` (relative paths: under the image's workdir).
    A ``str`` content is stored UTF-8 encoded, as
    :meth:`miles_core.sandbox.lifecycle.Sandbox.write_file` writes one."""

    dest: str
    content: bytes = field(repr=False)
    mode: int = 0o644

    def __init__(self, dest: str, content: bytes | str, mode: int = 0o644) -> None:
        if isinstance(content, str):
            content = content.encode()
        elif not isinstance(content, (bytes, bytearray, memoryview)):
            raise ConfigError(f"Copy.content must be bytes or str, got {type(content).__name__}")
        object.__setattr__(self, "dest", dest)
        object.__setattr__(self, "content", bytes(content))
        object.__setattr__(self, "mode", mode)
        if not self.dest or self.dest.endswith("/"):
            raise ConfigError(f"Copy.dest must name a file, got {self.dest!r}")
        if ".." in self.dest.split("/"):
            raise ConfigError(f"Copy.dest must not contain '..', got {self.dest!r}")

    @classmethod
    def from_path(cls, src: str | os.PathLike[str], dest: str, mode: int | None = None) -> Copy:
        with open(src, "rb") as fh:
            content = fh.read()
        return cls(dest, content, mode if mode is not None else (os.stat(src).st_mode & 0o777))

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    def canonical(self) -> dict[str, Any]:
        return {"copy": self.dest, "sha256": self.sha256, "mode": self.mode}


BuildStep = Run | Copy


@dataclass(frozen=True)
class Resources:
    """What a sandbox built from an image gets (remote providers size the VM with it)."""

    cpus: int = 1
    memory_mb: int = 1024
    disk_mb: int | None = None

    def __post_init__(self) -> None:
        if self.cpus < 1 or self.memory_mb < 64 or (self.disk_mb is not None and self.disk_mb < 1):
            raise ConfigError(f"Resources need cpus >= 1, memory_mb >= 64, disk_mb >= 1; got {self}")


@dataclass(frozen=True)
class ImageSpec:
    """A recipe: base image, build user, ordered steps, resources.

    :attr:`digest` is the SHA-256 of its canonical JSON (files enter by content hash), so an
    image is rebuilt exactly when one of its inputs changes. ``base="host"`` is the local
    provider's base: the host's own userland.
    """

    base: str
    steps: tuple[BuildStep, ...] = ()
    user: str = "root"
    resources: Resources = Resources()
    recipe_version: str = "1"

    def __post_init__(self) -> None:
        if not self.base:
            raise ConfigError("ImageSpec.base must name a base image")
        object.__setattr__(self, "steps", tuple(self.steps))
        for index, step in enumerate(self.steps):
            if not isinstance(step, (Run, Copy)):
                raise ConfigError(f"ImageSpec.steps[{index}] must be Run or Copy, got {type(step).__name__}")

    def canonical(self) -> dict[str, Any]:
        return {
            "schema": DIGEST_SCHEMA,
            "base": self.base,
            "user": self.user,
            "steps": [step.canonical() for step in self.steps],
            "resources": {
                "cpus": self.resources.cpus,
                "memory_mb": self.resources.memory_mb,
                "disk_mb": self.resources.disk_mb,
            },
            "recipe_version": self.recipe_version,
        }

    @cached_property
    def digest(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def name(self) -> str:
        """The digest-derived name images are stored under (``miles-<24 hex>``)."""
        return f"miles-{self.digest[:DIGEST_NAME_CHARS]}"


@dataclass(frozen=True)
class ImageRef:
    """A prepared image: the provider that holds it, its name there, and the recipe digest."""

    provider: str
    name: str
    digest: str


# -- sandboxes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Per-exec resource limits (each provider enforces those in its ``capabilities.limits``)."""

    cpu_seconds: int = 60
    memory_mb: int = 2048
    file_size_mb: int = 256
    processes: int = 128
    open_files: int = 1024
    output_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in (*LIMIT_NAMES, "output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Limits.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. ``ttl_s`` is the dead-man switch: without keepalive beats the provider
    reclaims the sandbox that long after the last one. ``network=False`` isolates it where the
    provider can (``capabilities.network_isolation``)."""

    image: ImageRef | None = None
    ttl_s: float = 300.0
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    user: str | None = None
    limits: Limits = Limits()
    network: bool = False

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ConfigError(f"SandboxSpec.ttl_s must be > 0, got {self.ttl_s!r}")
        object.__setattr__(self, "labels", _mapping(self.labels, "SandboxSpec.labels"))
        object.__setattr__(self, "env", _mapping(self.env, "SandboxSpec.env"))


@dataclass(frozen=True)
class SandboxRef:
    """A live sandbox as its provider returned it; ``native`` is the provider's own object."""

    id: str
    provider: str
    labels: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    native: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class SandboxInfo:
    """One sandbox as listed by the provider (enough to decide whether it is an orphan)."""

    id: str
    labels: Mapping[str, str]
    expires_at: float | None = None
    state: str = "running"


@dataclass(frozen=True)
class ExecResult:
    """A finished command. ``exit_code`` is ``None`` only for a background start."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Endpoint:
    """How to reach a port of a sandbox: a URL plus headers to send (an access token, say)."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Capabilities:
    """What a provider can do, declared so callers (and the conformance kit) can rely on it.

    ``ttl``: ``rearmable`` if ``extend`` pushes the deadline out again, ``hard`` if fixed.
    ``limits``: the :data:`LIMIT_NAMES` enforced per exec. ``users``: accepted ``user=`` names
    (``None``: any user the image has). ``isolates``: the hostile probes of the conformance kit
    (:data:`miles_core.testing.sandbox.PROBES`) the provider claims to stop -- the kit fails a
    claimed probe that gets through.
    """

    ttl: Literal["rearmable", "hard"]
    network_isolation: bool
    expose: bool
    custom_base_images: bool
    background_exec: bool
    limits: frozenset[str]
    users: tuple[str, ...] | None = None
    isolates: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttl": self.ttl,
            "network_isolation": self.network_isolation,
            "expose": self.expose,
            "custom_base_images": self.custom_base_images,
            "background_exec": self.background_exec,
            "limits": sorted(self.limits),
            "users": list(self.users) if self.users is not None else None,
            "isolates": sorted(self.isolates),
        }


Command = str | Sequence[str]
"""A shell command line (run with ``/bin/sh -c``) or an argv list."""


@runtime_checkable
class SandboxProvider(Protocol):
    """The operations of one provider. All are coroutines; failures raise
    :class:`~miles_core.sandbox.errors.SandboxError` subclasses mapped *by exception type*.

    Relative paths (``cwd``, ``write_file``, ``read_file``) are relative to the sandbox's
    working directory. ``destroy`` and ``extend`` take a sandbox id so orphans found by ``list``
    can be handled without a live reference; ``destroy`` is idempotent and returns whether the
    sandbox existed.
    """

    name: str
    capabilities: Capabilities

    async def prepare_image(self, spec: ImageSpec) -> ImageRef: ...

    async def create(self, spec: SandboxSpec) -> SandboxRef: ...

    async def exec(
        self,
        ref: SandboxRef,
        cmd: Command,
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        background: bool = False,
    ) -> ExecResult: ...

    async def write_file(
        self, ref: SandboxRef, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None: ...

    async def read_file(self, ref: SandboxRef, path: str) -> bytes: ...

    async def expose(self, ref: SandboxRef, port: int) -> Endpoint: ...

    async def extend(self, sandbox_id: str, ttl_s: float) -> None: ...

    async def destroy(self, sandbox_id: str) -> bool: ...

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]: ...

    async def aclose(self) -> None: ...
