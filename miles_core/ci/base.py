"""The CI concern's protocol: hardware kinds, suites, per-hardware settings and registrations.

A *hardware kind* (:class:`CIHardware`) is what a plugin contributes through ``miles_ci_hardware``:
the registration marker test files call (``register_rocm_ci``), how a runner of that kind is set
up in GitHub Actions, which failure classes may be retried, and default suites for projects that
declare none. A *suite* (:class:`Suite`) is one CI stage: the hardware it runs on, its runners,
how many shards it is split into and whether it is enabled. A *registration*
(:class:`miles_core.ci.discovery.Registration`, kept with the parser that finds them) is one
marker call found in a test file.

Importing this module is cheap (standard library only): descriptors are built at plugin
discovery time.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: how a test file run can end badly; hardware kinds declare which of these they retry
FAILURE_CLASSES: tuple[str, ...] = ("failed", "error", "no-tests", "timeout", "crash")

#: when a stage runs: ``regular`` (pull requests, pushes, manual runs) and ``nightly`` (schedule)
CADENCES: tuple[str, ...] = ("regular", "nightly")

#: third-party actions the generated workflows use, pinned to a commit (the tag is for humans)
PINNED_ACTIONS: dict[str, tuple[str, str]] = {
    "actions/checkout": ("11bd71901bbe5b1630ceea73d27597364c9af683", "v4.2.2"),
    "actions/setup-python": ("a26af69be951a213d495a4c3e4e4022e16d87065", "v5.6.0"),
    "actions/upload-artifact": ("ea165f8d65b6e75b540449e92b4886f43607fa02", "v4.6.2"),
}


def pinned(action: str) -> str:
    """``owner/repo@<commit>`` for an action in :data:`PINNED_ACTIONS`."""
    return f"{action}@{PINNED_ACTIONS[action][0]}"


#: every parameter a marker may declare, in the order the parser reports them
MARKER_PARAMETERS: tuple[str, ...] = (
    "est_time",
    "suite",
    "labels",
    "nightly",
    "disabled",
    "issue",
    "num_gpus",
    "layout",
)
#: the only parameters that may be passed positionally, in this order
POSITIONAL_PARAMETERS: tuple[str, ...] = ("est_time", "suite")
GPU_PARAMETERS: frozenset[str] = frozenset({"num_gpus", "layout"})


@dataclass(frozen=True)
class Suite:
    """One CI stage. ``gpus`` is per runner; ``host_gpus`` is set when one host is split into
    several runners (8 GPUs as two 4-GPU runners), each runner owning its devices through the
    hardware's visible-devices variable."""

    name: str
    hardware: str
    runs_on: tuple[str, ...]
    gpus: int = 0
    host_gpus: int | None = None
    shards: int = 1
    cadence: tuple[str, ...] = CADENCES
    labels: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    timeout_minutes: int = 60
    disabled: str | None = None
    issue: str | None = None
    source: str = ""

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    @property
    def runners_per_host(self) -> int:
        return (self.host_gpus // self.gpus) if self.host_gpus and self.gpus else 1


@dataclass(frozen=True)
class HardwareSettings:
    """How a project installs and runs on one hardware kind (``[tool.miles.ci.hardware.<kind>]``)."""

    install: tuple[str, ...] = ()
    image: str | None = None
    python: str = "3.11"


@dataclass(frozen=True)
class CIHardware:
    """A CI hardware kind. Subclass it when runner setup needs steps (see :class:`GPUHardware`).

    ``marker`` is ``"package.module:function"``; the function must be a runtime no-op taking
    ``est_time`` and ``suite`` (positional or keyword) and only keyword-only parameters from
    :data:`MARKER_PARAMETERS` after them, every one with a default. ``miles ci`` derives what a
    call may pass from that signature, so the parser and the runtime cannot disagree.
    """

    name: str
    marker: str
    description: str
    self_hosted: bool = False
    retriable: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=dict)
    default_settings: HardwareSettings = HardwareSettings()
    default_suites: tuple[Suite, ...] = ()

    #: registrations on this hardware must carry a label, so they never take runners unasked
    label_gated = False
    uses_gpus = False

    @property
    def marker_name(self) -> str:
        return self.marker.rpartition(":")[2]

    @property
    def reusable_workflow(self) -> str:
        return f"_run-{self.name}-ci.yml"

    @property
    def job_id(self) -> str:
        return f"run-{self.name}"

    def marker_function(self) -> Callable[..., Any]:
        from miles_core.plugins import import_object

        return import_object(self.marker)

    def marker_parameters(self) -> tuple[str, ...]:
        """The parameter names the marker accepts (validated by :meth:`verify`)."""
        return tuple(inspect.signature(self.marker_function()).parameters)

    def check_suite(self, suite: Suite) -> list[str]:
        """Problems that make ``suite`` unable to run on this hardware (empty when it fits)."""
        problems = []
        if suite.gpus != 0:
            problems.append(f"gpus = {suite.gpus}, but {self.name} runners have no GPUs (use 0)")
        if suite.host_gpus is not None:
            problems.append(f"host-gpus is only meaningful for GPU hardware, not {self.name}")
        return problems

    def setup_steps(self, settings: HardwareSettings) -> list[dict[str, Any]]:
        """GitHub Actions steps run after checkout and before install; each carries an ``id``."""
        return []

    def container(self, settings: HardwareSettings) -> dict[str, Any] | None:
        """The job container for this hardware, or None to run on the runner itself."""
        return None

    def workflow_inputs(self) -> dict[str, dict[str, Any]]:
        """Extra ``workflow_call`` inputs the reusable workflow needs for this hardware."""
        return {}

    def suite_inputs(self, suite: Suite) -> dict[str, Any]:
        """Values a stage job passes for :meth:`workflow_inputs`."""
        return {}

    def verify(self) -> None:
        """Prove the kind works: its marker resolves to a runtime no-op whose parameters
        ``miles ci`` can parse, its retry classes exist and its default suites fit it."""
        problems = _marker_problems(self)
        unknown = sorted(set(self.retriable) - set(FAILURE_CLASSES))
        if unknown:
            problems.append(f"unknown retriable failure class(es) {unknown}; known: {list(FAILURE_CLASSES)}")
        for suite in self.default_suites:
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", suite.name):
                problems.append(f"default suite name {suite.name!r} is not lowercase letters, digits and '-'")
            if suite.hardware != self.name:
                problems.append(f"default suite {suite.name!r} names hardware {suite.hardware!r}")
            problems.extend(f"default suite {suite.name!r}: {p}" for p in self.check_suite(suite))
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class GPUHardware(CIHardware):
    """A GPU hardware kind running jobs in a container on (usually self-hosted) GPU runners.

    Each runner owns its GPUs through ``visible_devices_env`` (set in the runner service's
    environment and forwarded into the container), which is how one host serves as several
    runners. The generated device check fails the job unless the tests will see exactly the
    suite's GPU count.
    """

    visible_devices_env: str = "CUDA_VISIBLE_DEVICES"
    driver_probe: str = "nvidia-smi"
    device_options: tuple[str, ...] = ()
    #: Python expression (torch imported) counting the GPUs tests will see
    device_count: str = "torch.cuda.device_count()"

    label_gated = True
    uses_gpus = True

    def check_suite(self, suite: Suite) -> list[str]:
        problems = []
        if suite.gpus < 1:
            problems.append(f"gpus = {suite.gpus}, but {self.name} suites need at least 1 GPU per runner")
        if (
            suite.host_gpus is not None
            and suite.gpus >= 1
            and (suite.host_gpus < suite.gpus or suite.host_gpus % suite.gpus)
        ):
            problems.append(
                f"host-gpus = {suite.host_gpus} cannot be split into runners of {suite.gpus} GPUs"
            )
        if not suite.labels:
            problems.append(
                f"{self.name} suites must declare labels: a pull request runs the stage only when "
                "it carries one of them as run-ci-<label>"
            )
        return problems

    def container(self, settings: HardwareSettings) -> dict[str, Any] | None:
        if settings.image is None:
            return None
        options = [*self.device_options, "--env", self.visible_devices_env]
        return {"image": settings.image, "options": " ".join(options)}

    def workflow_inputs(self) -> dict[str, dict[str, Any]]:
        return {
            "gpus": {"type": "number", "required": True, "description": "GPUs each runner must expose"},
            "split_host": {
                "type": "boolean",
                "required": True,
                "description": f"the host is split into several runners through {self.visible_devices_env}",
            },
        }

    def suite_inputs(self, suite: Suite) -> dict[str, Any]:
        return {"gpus": suite.gpus, "split_host": suite.runners_per_host > 1}

    def setup_steps(self, settings: HardwareSettings) -> list[dict[str, Any]]:
        env_var = self.visible_devices_env
        wait = (
            "set -euo pipefail\n"
            "for _ in $(seq 1 24); do\n"
            f"  if {self.driver_probe} >/dev/null 2>&1; then {self.driver_probe}; exit 0; fi\n"
            "  sleep 5\n"
            "done\n"
            f'echo "::error::{self.driver_probe} did not answer within 120 s"\n'
            "exit 1\n"
        )
        check = (
            "set -euo pipefail\n"
            f'if [ "$SPLIT_HOST" = "true" ] && [ -z "${{{env_var}:-}}" ]; then\n'
            f'  echo "::error::this runner is part of a split host but its service environment does not set {env_var}"\n'
            "  exit 1\n"
            "fi\n"
            "python3 - \"$GPUS\" <<'PY'\n"
            "import os, sys, torch\n"
            f"want, have = int(sys.argv[1]), {self.device_count}\n"
            f"print(f'{{have}} GPUs visible; {env_var}={{os.environ.get(\"{env_var}\")!r}}')\n"
            "sys.exit(0 if have == want else f'the runner exposes {have} GPUs, the suite needs {want}')\n"
            "PY\n"
        )
        return [
            {"name": f"Wait for {self.driver_probe}", "id": "wait-driver", "run": wait},
            {
                "name": "Check visible GPUs",
                "id": "device-check",
                "env": {"GPUS": "${{ inputs.gpus }}", "SPLIT_HOST": "${{ inputs.split_host }}"},
                "run": check,
            },
        ]


def _marker_problems(kind: CIHardware) -> list[str]:
    try:
        function = kind.marker_function()
    except Exception as exc:
        return [f"marker {kind.marker!r} cannot be imported: {type(exc).__name__}: {exc}"]
    if not callable(function):
        return [f"marker {kind.marker!r} is not callable"]
    problems = []
    params = list(inspect.signature(function).parameters.values())
    names = [p.name for p in params]
    if names[:2] != list(POSITIONAL_PARAMETERS):
        problems.append(f"marker {kind.marker_name} must start with (est_time, suite), not {names[:2]}")
    for p in params[2:]:
        if p.name not in MARKER_PARAMETERS:
            problems.append(f"marker {kind.marker_name} has parameter {p.name!r} that miles ci cannot parse")
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"marker {kind.marker_name} parameter {p.name!r} must be keyword-only")
        if p.default is inspect.Parameter.empty:
            problems.append(f"marker {kind.marker_name} parameter {p.name!r} needs a default")
    if not kind.uses_gpus and GPU_PARAMETERS & set(names):
        problems.append(
            f"marker {kind.marker_name} of non-GPU hardware accepts {sorted(GPU_PARAMETERS & set(names))}"
        )
    if not problems:
        result = function(est_time=1.0, suite="probe")
        if result is not None:
            problems.append(
                f"marker {kind.marker_name} must be a runtime no-op returning None, got {result!r}"
            )
    return problems
