"""The hardware-backend protocol: what a backend declares, fixes and proves.

A backend is contributed through the ``miles_hardware_backends`` hook. Exactly one is active per
process (see :mod:`miles_core.hardware.selection`); model and trainer code then ask the active
backend about *capabilities* (:meth:`HardwareBackend.supports`) instead of branching on the
platform.

Subclasses declare the class attributes below and implement :meth:`HardwareBackend.detect`.
A backend that must change its environment (patch a library, install a guard) does it in
:meth:`~HardwareBackend.apply`, undoes it in :meth:`~HardwareBackend.revert`, and proves the
effect in :meth:`~HardwareBackend.verify` (called after ``apply``; it raises on failure).

Nothing here imports torch: descriptors are built at plugin discovery, which must stay cheap.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal

from miles_core.errors import ConfigError

#: environment variable that overrides detection (``MILES_HARDWARE=rocm``)
ENV_OVERRIDE = "MILES_HARDWARE"

#: kinds of Ray worker a backend prepares an environment for
WORKER_ROLES: tuple[str, ...] = ("train", "rollout")

#: libraries a backend may have to fix before their first use (:meth:`HardwareBackend.prepare`).
#: They are prepared by the code about to use them, not at activation: a job that never uses one
#: never imports it (megatron-core alone takes seconds to import).
LIBRARIES: tuple[str, ...] = ("megatron",)

#: every capability a backend may claim, with what claiming it promises
CAPABILITIES: Mapping[str, str] = MappingProxyType(
    {
        "pinned_memory_async_copy": (
            "device-to-host copies may stage through pinned host memory (non_blocking=True), "
            "also right before a process forks"
        ),
        "mm_out_dtype_fp32": "torch.mm accepts bf16 inputs with out_dtype=torch.float32",
        "nvml": "the NVIDIA Management Library serves telemetry and CPU affinity",
        "triton": "Triton kernels run on the device",
        "device_graphs": "device graph capture (CUDA graphs, HIP graphs)",
        "varlen_flash_attention": (
            "torch.nn.attention.varlen's variable-length flash kernel may be tried on the device in half "
            "precision (packed attention probes it once and falls back per document if it does not run)"
        ),
    }
)

CopyMode = Literal["pinned-non-blocking", "pageable-blocking", "host-only"]

_DEVICE_TOKEN = re.compile(r"^(-?\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")


@dataclass(frozen=True)
class Detection:
    """Whether a backend claims this machine, and why (shown by ``miles doctor``)."""

    claimed: bool
    reason: str


@dataclass(frozen=True)
class FixReport:
    """One environment fix or guard a backend applied (or found unnecessary)."""

    name: str
    status: Literal["applied", "upstream", "fallback", "not-needed"]
    detail: str


@dataclass(frozen=True)
class CheckpointIOPolicy:
    """How checkpoint writers may move device tensors to the host before writing them."""

    d2h_copy: CopyMode
    reason: str


class HardwareBackend(abc.ABC):
    """A hardware platform miles can run on. Subclass it and set every class attribute."""

    #: unique backend name; ``MILES_HARDWARE=<name>`` selects it
    name: ClassVar[str]
    #: ``torch.device`` type the backend computes on (ROCm builds of torch also use ``"cuda"``)
    device_type: ClassVar[str]
    #: ``torch.distributed`` backend name for collectives between its devices
    distributed_backend: ClassVar[str]
    #: the variable that restricts which devices a process sees (``None``: no devices)
    visible_devices_env: ClassVar[str | None]
    #: Ray variables that stop Ray from rewriting the visible-devices variables of workers:
    #: miles places workers on devices itself (training and rollout share devices)
    ray_noset_envs: ClassVar[tuple[str, ...]]
    #: a subset of :data:`CAPABILITIES`
    capabilities: ClassVar[frozenset[str]]
    #: name of the CI hardware kind (``miles_ci_hardware``) whose runners test this backend; the
    #: kind owns the registration marker and the suites
    ci_hardware: ClassVar[str]
    checkpoint_io: ClassVar[CheckpointIOPolicy]

    @abc.abstractmethod
    def detect(self) -> Detection:
        """Whether this process can use the platform (imports torch; called at activation)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this platform the process sees."""

    def apply(self) -> list[FixReport]:
        """Apply the backend's environment fixes (idempotent). The default has none."""
        return []

    def prepare(self, library: str) -> list[FixReport]:
        """Make ``library`` (one of :data:`LIBRARIES`) work on this platform before its first use.

        Applies the library's fixes (idempotent) and proves them in effect, raising if they are
        not. Called through :meth:`miles_core.hardware.ActiveHardware.prepare` by the code about
        to use the library, never at activation. The default needs none.
        """
        check_library(library)
        return []

    def revert(self) -> None:  # noqa: B027 (optional: a backend without fixes has nothing to undo)
        """Undo :meth:`apply` and every :meth:`prepare` (used when another backend is activated, and by tests)."""

    def verify(self) -> None:
        """Raise if the backend's declarations or its environment are inconsistent.

        Subclasses extend this (call ``super().verify()``) to prove their fixes are in effect.
        """
        unknown = sorted(self.capabilities - CAPABILITIES.keys())
        if unknown:
            raise ValueError(f"claims unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
        if self.visible_devices_env is not None:
            parse_visible_devices(self.visible_devices_env, os.environ)

    def worker_env(self, role: str) -> dict[str, str]:
        """Environment variables a Ray worker of ``role`` (one of :data:`WORKER_ROLES`) needs.

        Always names this backend in ``MILES_HARDWARE`` so every worker selects the same one.
        """
        if role not in WORKER_ROLES:
            raise ConfigError(f"worker role must be one of {', '.join(WORKER_ROLES)}; got {role!r}")
        env = {ENV_OVERRIDE: self.name}
        env.update(dict.fromkeys(self.ray_noset_envs, "1"))
        env.update(self.role_env(role))
        return env

    def role_env(self, role: str) -> dict[str, str]:
        """Backend-specific additions to :meth:`worker_env` (none by default)."""
        return {}

    def supports(self, capability: str) -> bool:
        """Whether the platform offers ``capability`` (a key of :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise ConfigError(
                f"unknown hardware capability {capability!r}; known: {', '.join(sorted(CAPABILITIES))}"
            )
        return capability in self.capabilities


def check_library(library: str) -> None:
    if library not in LIBRARIES:
        raise ConfigError(f"unknown library {library!r} to prepare; known: {', '.join(LIBRARIES)}")


def torch_build() -> str:
    """``torch <version> (<CPU-only|CUDA x|HIP y> build)``, for detection reasons."""
    import torch

    if torch.version.hip:
        kind = f"HIP {torch.version.hip}"
    elif torch.version.cuda:
        kind = f"CUDA {torch.version.cuda}"
    else:
        kind = "CPU-only"
    return f"torch {torch.__version__} ({kind} build)"


def parse_visible_devices(var: str, environ: Mapping[str, str]) -> list[str] | None:
    """The device tokens listed in ``environ[var]`` (``None`` when unset).

    Tokens are device indices or ``GPU-``/``MIG-`` UUIDs, separated by commas; anything else is
    a :class:`ConfigError` naming the variable, because runtimes silently truncate the list at
    the first token they cannot parse.
    """
    value = environ.get(var)
    if value is None:
        return None
    if not value.strip():
        return []
    tokens = [token.strip() for token in value.split(",")]
    bad = [token for token in tokens if not _DEVICE_TOKEN.match(token)]
    if bad:
        raise ConfigError(
            f"{var}={value!r}: {bad[0]!r} is not a device index or GPU-/MIG- UUID "
            "(use a comma-separated list such as 0,1,2)"
        )
    return tokens
