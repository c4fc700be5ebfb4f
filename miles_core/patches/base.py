"""The model-patch protocol: what a plugin's ``miles_model_patches()`` objects provide.

A patch is resolved against the model that was actually built, never against a list of classes
it hopes to meet:

* ``matches(config)`` -- a cheap predicate on the model's config. The core also asks every patch
  for its ``targets(model)``: a patch that declines a model containing its targets is a bug the
  core refuses (this is how a dense architecture once went unpatched while a log said "applied").
* ``targets(model)`` -- the classes of the instantiated modules this patch must cover.
* ``apply(model)`` -- patch them; return :class:`AppliedPatch` naming every class it patched.
* ``verify(model)`` -- walk the instantiated modules; raise :class:`PatchVerificationError` naming
  every target whose class does not carry the patch (a subclass that overrides the patched method,
  a class swapped in by another library, a kernel entry point rebound by someone else).
* ``probe(model)`` -- a cheap numeric check of the patched behaviour on the model's own modules.
* ``requires`` -- the kernels the patch uses, checked loudly before ``apply``.
* ``check_environment()`` -- registration-level problems in the installed libraries (an
  architecture the patch should cover but cannot); any problem makes the plugin broken.
* ``uses_packing_context`` -- whether the patched layers read the per-forward packing context;
  ``prepare_model`` installs the model-level packing scope only when an applied patch does (a
  model whose forward takes no ``**kwargs``, such as megatron's ``GPTModel``, could not carry it).

Importing this module must stay cheap: no torch, no transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from miles_core.errors import MilesError

KernelState = Literal["available", "missing", "broken"]


class PatchError(MilesError):
    """A patch cannot be applied to this model (an unsupported architecture, an unpatchable class)."""


class PatchVerificationError(MilesError):
    """``verify(model)`` found targets of the built model that do not carry the patch."""

    def __init__(self, patch: str, problems: Sequence[str]) -> None:
        self.patch = patch
        self.problems = list(problems)
        super().__init__(f"{patch}: " + "; ".join(self.problems))


@dataclass(frozen=True)
class KernelRequirement:
    """A kernel package a patch uses on some device types.

    ``required=False`` means the patch has a correct fallback: a missing kernel is reported as a
    warning (on stderr and in the report), never silently.
    """

    module: str
    distribution: str
    device_types: tuple[str, ...]
    purpose: str
    required: bool = False

    def state(self) -> tuple[KernelState, str]:
        """Import the kernel module; ``("broken", error)`` if importing it raises something else."""
        try:
            importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and self.module.split(".")[0] != exc.name.split(".")[0]:
                return "broken", f"{type(exc).__name__}: {exc}"
            return "missing", f"{self.distribution} is not installed"
        except Exception as exc:
            return "broken", f"{type(exc).__name__}: {exc}"
        return "available", f"{self.module} imports"


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of a patch's numeric probe: ``max_abs_diff`` must stay within ``tolerance``."""

    passed: bool
    max_abs_diff: float
    tolerance: float
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AppliedPatch:
    """What ``apply(model)`` did: the classes it patched (qualified names), optionally grouped
    (the GDN patch groups them per architecture)."""

    classes: tuple[str, ...]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@runtime_checkable
class ModelPatch(Protocol):
    """One model patch (see the module docstring for the contract of each member)."""

    name: str
    requires: Sequence[KernelRequirement]
    uses_packing_context: bool

    def matches(self, config: Any) -> bool: ...

    def check_environment(self) -> list[str]: ...

    def targets(self, model: Any) -> list[type]: ...

    def apply(self, model: Any) -> AppliedPatch: ...

    def verify(self, model: Any) -> None: ...

    def probe(self, model: Any) -> ProbeResult: ...


def qualname(cls: type) -> str:
    """``module.Class``: how reports and errors name a class."""
    return f"{cls.__module__}.{cls.__qualname__}"
