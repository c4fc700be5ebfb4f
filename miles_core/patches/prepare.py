"""``prepare_model``: apply, verify and probe every matching patch on an instantiated model.

Failures name the plugin, its distribution and version, the patch and the cause
(:class:`~miles_core.errors.ActivationError`). A patch whose environment check fails (an
architecture it should cover but cannot) is recorded against its plugin, which then fails closed
for the whole process; a failure specific to one model (an unsupported architecture, a class that
escaped patching, a failed probe) stops that model only.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from miles_core.errors import ActivationError
from miles_core.patches.base import ModelPatch, PatchError, ProbeResult, qualname
from miles_core.patches.report import PatchReport, PrepareReport
from miles_core.plugins import Contribution, MilesPluginManager, _describe, get_plugin_manager

log = logging.getLogger(__name__)
T = TypeVar("T")

#: plugin manager -> names of patches whose environment check passed in this process
_environment_ok: weakref.WeakKeyDictionary[MilesPluginManager, set[str]] = weakref.WeakKeyDictionary()


def prepare_model(
    model: Any, *, pm: MilesPluginManager | None = None, probe: bool = True, packed: bool = False
) -> PrepareReport:
    """Apply every patch whose ``matches(model.config)`` holds, verify it on ``model`` and probe it.

    When an applied patch reads the packing context (``uses_packing_context``), also installs the
    packing scope (:mod:`miles_core.patches.scope`) on the model and on every module of it where a
    packed forward can start (the decoder stack, each decoder layer, the patched layers), so packed
    rows reach every patched layer whichever module a trainer calls, and switches ``sdpa``
    attention to per-document packed attention (:mod:`miles_core.patches.attention`).
    Idempotent: preparing a model twice re-verifies it. Records each
    applied patch in the plugin fingerprint. ``probe=False`` skips the numeric probes (for models
    whose modules cannot run on their own, e.g. already sharded). ``packed=True`` (a trainer about to
    run packed rows) installs the scope and the per-document attention whatever the patches: attention
    then costs per document instead of ``T^2`` over the whole row.
    """
    from miles_core.patches.attention import use_packed_attention
    from miles_core.patches.scope import has_packing_scope, install_packing_scope

    pm = pm or get_plugin_manager()
    config = getattr(model, "config", None)
    device_types = sorted({p.device.type for p in model.parameters()}) or ["cpu"]
    reports: list[PatchReport] = []
    not_matched: list[str] = []
    needs_scope = False
    readers: list[Any] = []
    for contribution in pm.active_contributions("patches"):
        patch: ModelPatch = contribution.obj
        targets = _attributed(contribution, patch.targets, model)
        matched = patch.matches(config)
        if not matched and not targets:
            # the patch has nothing to do with this model: its environment check (which may import
            # the library it patches, e.g. megatron-core) waits for a model it acts on
            not_matched.append(contribution.name)
            continue
        _check_environment(pm, contribution)
        if not matched:
            raise contribution.error(
                f"matches() declined {type(model).__name__} (model_type "
                f"{getattr(config, 'model_type', None)!r}) but the model contains its targets "
                f"{sorted({qualname(t) for t in targets})}",
            )
        kernels, kernel_warnings = _check_kernels(contribution, device_types)
        applied = _attributed(contribution, patch.apply, model)
        if getattr(patch, "uses_packing_context", False):
            needs_scope = True
            readers += [m for m in model.modules() if type(m) in set(targets)]
        _attributed(contribution, patch.verify, model)
        result = _attributed(contribution, _run_probe, patch, model) if probe else None
        pm.record_applied_patch(contribution.name, applied.classes)
        record = contribution.plugin
        reports.append(
            PatchReport(
                name=contribution.name,
                plugin=record.name,
                distribution=record.distribution,
                version=record.version,
                classes=tuple(applied.classes),
                groups=dict(applied.groups),
                kernels=kernels,
                probe=result,
                warnings=tuple(kernel_warnings),
            )
        )
        log.info(
            "patch %s applied to %s: %s", contribution.name, qualname(type(model)), ", ".join(applied.classes)
        )
    packed_attention = False
    if needs_scope or packed:
        install_packing_scope(model, readers)
        packed_attention = use_packed_attention(model)
    return PrepareReport(
        model=qualname(type(model)),
        patches=tuple(reports),
        not_matched=tuple(not_matched),
        packing_scope=has_packing_scope(model),
        packed_attention=packed_attention,
    )


def _check_environment(pm: MilesPluginManager, contribution: Contribution) -> None:
    """Run ``check_environment()`` once per manager; a problem breaks the plugin (recorded)."""
    checked = _environment_ok.setdefault(pm, set())
    if contribution.name in checked:
        return

    def check() -> None:
        problems = contribution.obj.check_environment()
        if problems:
            raise PatchError("; ".join(problems))

    pm.verify(contribution, check)
    checked.add(contribution.name)


def _check_kernels(contribution: Contribution, device_types: list[str]) -> tuple[dict[str, str], list[str]]:
    kernels: dict[str, str] = {}
    problems: list[str] = []
    for req in contribution.obj.requires:
        needed_on = [d for d in device_types if d in req.device_types]
        if not needed_on:
            kernels[req.module] = f"not used on {', '.join(device_types)}"
            continue
        state, detail = req.state()
        kernels[req.module] = f"{state}: {detail}"
        if state == "available":
            continue
        message = f"{req.distribution} ({req.purpose}) is {state} on {', '.join(needed_on)}: {detail}"
        if req.required:
            raise contribution.error(message)
        problems.append(message)
        warnings.warn(f"patch {contribution.name!r}: {message}", RuntimeWarning, stacklevel=3)
    return kernels, problems


def _run_probe(patch: ModelPatch, model: Any) -> ProbeResult:
    result = patch.probe(model)
    if not result.passed:
        raise PatchError(
            f"numeric probe failed: max |diff| {result.max_abs_diff:.3g} > tolerance "
            f"{result.tolerance:.3g} ({result.detail})"
        )
    return result


def _attributed(contribution: Contribution, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn``; an error becomes an ActivationError naming the plugin (not recorded on it)."""
    try:
        return fn(*args)
    except ActivationError:
        raise
    except Exception as exc:
        raise contribution.error(_describe(exc)) from exc
