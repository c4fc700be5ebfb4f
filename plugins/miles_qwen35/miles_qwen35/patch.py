"""The ``gdn-packing`` model patch: packed documents stay independent in Gated DeltaNet layers.

This module is imported at plugin discovery, so it imports neither torch nor transformers at the
top; :mod:`miles_qwen35.dispatch` and friends are imported when a model is prepared.
"""

from __future__ import annotations

from typing import Any

from miles_core.patches.base import (
    AppliedPatch,
    KernelRequirement,
    PatchError,
    PatchVerificationError,
    ProbeResult,
    qualname,
)

#: the two documents of the probe: longer than the convolution window, shorter than a chunk
PROBE_LENGTHS = (7, 13)
#: fp32 probe tolerance, relative to the output's magnitude (fla's GPU kernels run tf32 matmuls)
PROBE_RTOL = {"cpu": 1e-5, "cuda": 2e-3}


def is_gated_deltanet(module: Any) -> bool:
    """A module of the built model is a GDN layer if any class it derives from is named so."""
    return any(c.__name__.endswith("GatedDeltaNet") for c in type(module).__mro__)


class GatedDeltaNetPackingPatch:
    """Makes packed forwards of Gated DeltaNet models equal to per-document forwards."""

    name = "gdn-packing"
    uses_packing_context = True
    requires = (
        KernelRequirement(
            module="fla.ops.gated_delta_rule",
            distribution="flash-linear-attention",
            device_types=("cuda",),
            purpose="variable-length gated delta rule and causal convolution on GPU",
        ),
    )

    def matches(self, config: Any) -> bool:
        if config is None:
            return False
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return any(
            "linear_attention" in (getattr(c, "layer_types", None) or ()) for c in (config, text)
        )

    def check_environment(self) -> list[str]:
        from miles_qwen35.coverage import environment_problems

        return environment_problems()

    def targets(self, model: Any) -> list[type]:
        return list(dict.fromkeys(type(m) for m in model.modules() if is_gated_deltanet(m)))

    def apply(self, model: Any) -> AppliedPatch:
        from miles_qwen35.coverage import architecture_of
        from miles_qwen35.dispatch import enable_layer, forward_owner, is_patched, patch_class

        groups: dict[str, list[str]] = {}
        for cls in self.targets(model):
            owner = forward_owner(cls)
            arch = architecture_of(owner)
            if arch is None:
                continue  # a forward defined outside transformers' GDN modules: verify() names it
            if arch.status != "supported":
                raise PatchError(
                    f"{qualname(cls)}: the {arch.name} architecture is {arch.status}: {arch.reason}"
                )
            patch_class(owner)
            groups.setdefault(arch.name, [])
            if qualname(owner) not in groups[arch.name]:
                groups[arch.name].append(qualname(owner))
        for module in model.modules():
            if is_gated_deltanet(module) and is_patched(forward_owner(type(module))):
                enable_layer(module)
        classes = tuple(c for names in groups.values() for c in names)
        return AppliedPatch(classes=classes, groups={k: tuple(v) for k, v in groups.items()})

    def verify(self, model: Any) -> None:
        from miles_qwen35.dispatch import layer_enabled, patch_problems

        class_problems: dict[type, list[str]] = {}
        failures: list[str] = []
        for path, module in model.named_modules():
            if not is_gated_deltanet(module):
                continue
            cls = type(module)
            if cls not in class_problems:
                class_problems[cls] = patch_problems(cls)
                failures += [f"{p} (first at {path or '<root>'})" for p in class_problems[cls]]
            if not class_problems[cls] and not layer_enabled(module):
                failures.append(f"the {qualname(cls)} at {path} was not enabled for packed forwards")
        if failures:
            raise PatchVerificationError(self.name, failures)

    def probe(self, model: Any) -> ProbeResult:
        from miles_qwen35.probe import probe_layer

        layer = next((m for m in model.modules() if is_gated_deltanet(m)), None)
        if layer is None:
            raise PatchError(f"{type(model).__name__} has no Gated DeltaNet layer to probe")
        return probe_layer(layer, PROBE_LENGTHS, PROBE_RTOL)

    def example_models(self) -> dict[str, Any]:
        """A tiny model factory per supported architecture (``miles doctor`` prepares each), on
        the device Gated DeltaNet kernels run on here (the GPU when fla is installed)."""
        from functools import partial

        from miles_core.hardware.gdn import gdn_model_device
        from miles_qwen35.coverage import gdn_architectures
        from miles_qwen35.tiny import tiny_model

        device = gdn_model_device()
        return {
            a.name: partial(tiny_model, a.name, device=device) for a in gdn_architectures() if a.status == "supported"
        }
