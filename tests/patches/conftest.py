"""A toy model and a toy patch (no transformers) for the core's patch tests."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles_core.patches import AppliedPatch, KernelRequirement, PatchVerificationError, ProbeResult
from miles_core.patches.base import qualname
from miles_core.patches.packing import PACKING_KWARG, current_packed_sequences


class ToyConfig:
    def __init__(self, model_type: str = "toy") -> None:
        self.model_type = model_type


def make_layer_class(name: str = "ToyMixer") -> type[torch.nn.Module]:
    """A fresh class per test, so class-level patches never leak between tests."""

    def forward(self: torch.nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.seen.append(kwargs.get(PACKING_KWARG))
        return self.proj(hidden)

    def init(self: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        self.proj = torch.nn.Linear(4, 4)
        self.seen = []

    return type(name, (torch.nn.Module,), {"__init__": init, "forward": forward})


class ToyModel(torch.nn.Module):
    """``forward`` looks like a transformers causal LM's and records what it was called with."""

    def __init__(self, layer_cls: type[torch.nn.Module], config: ToyConfig | None = None) -> None:
        super().__init__()
        self.config = config or ToyConfig()
        self.layer = layer_cls()
        self.calls: list[dict[str, Any]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.calls.append(
            {"use_cache": use_cache, "kwargs": dict(kwargs), "current": current_packed_sequences()}
        )
        if kwargs.get("explode"):
            raise RuntimeError("forward exploded")
        hidden = torch.nn.functional.one_hot(input_ids % 4, 4).float()
        return self.layer(hidden, **kwargs)


class ToyPatch:
    """Marks the toy layer class; every behaviour a test needs to flip is a constructor argument."""

    uses_packing_context = True

    def __init__(
        self,
        layer_cls: type[torch.nn.Module],
        *,
        name: str = "toy-patch",
        match: bool = True,
        probe_diff: float = 0.0,
        environment: Sequence[str] = (),
        requires: Sequence[KernelRequirement] = (),
    ) -> None:
        self.layer_cls = layer_cls
        self.name = name
        self.match = match
        self.probe_diff = probe_diff
        self.environment = list(environment)
        self.requires = tuple(requires)
        self.environment_checks = 0

    def matches(self, config: Any) -> bool:
        return self.match

    def check_environment(self) -> list[str]:
        self.environment_checks += 1
        return self.environment

    def targets(self, model: torch.nn.Module) -> list[type]:
        return list(dict.fromkeys(type(m) for m in model.modules() if isinstance(m, self.layer_cls)))

    def apply(self, model: torch.nn.Module) -> AppliedPatch:
        self.layer_cls.toy_marker = True
        return AppliedPatch(classes=(qualname(self.layer_cls),), groups={"toy": (qualname(self.layer_cls),)})

    def verify(self, model: torch.nn.Module) -> None:
        unmarked = [qualname(t) for t in self.targets(model) if not t.__dict__.get("toy_marker")]
        if unmarked:
            raise PatchVerificationError(self.name, [f"{c} lacks the marker" for c in unmarked])

    def probe(self, model: torch.nn.Module) -> ProbeResult:
        return ProbeResult(self.probe_diff <= 1e-6, self.probe_diff, 1e-6, "toy probe")


@pytest.fixture
def toy() -> SimpleNamespace:
    """``toy.Model``, ``toy.Patch``, ``toy.Config``, a fresh layer class ``toy.layer`` and
    ``toy.make_layer(name)`` for more."""
    return SimpleNamespace(
        Model=ToyModel,
        Patch=ToyPatch,
        Config=ToyConfig,
        layer=make_layer_class(),
        make_layer=make_layer_class,
    )
