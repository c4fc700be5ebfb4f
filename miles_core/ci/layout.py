"""Parallel layouts of multi-GPU tests, and smaller-runner variants of them.

A test written for 8 GPUs can often run on a 4-GPU runner by keeping the parallel axes it tests
(the tensor and pipeline split that fix each rank's shard) and dropping the others (context and
data parallel). :func:`derive_layout` does that and validates the result with Megatron's rules,
so an impossible layout (``pp=2, ep=4`` on 4 GPUs) is rejected where it is written, not on the
runner. Registrations carry the layout as a literal (``layout={"tp": 2, "pp": 2}``) and
``miles ci`` validates it against the suite's GPU count when it discovers them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace

from miles_core.errors import ConfigError

#: axes a layout may name; ``etp`` (expert tensor parallel) defaults to ``tp`` as in Megatron
AXES: tuple[str, ...] = ("tp", "pp", "cp", "ep", "etp")


class LayoutError(ConfigError):
    """A parallel layout that Megatron would reject on the given number of GPUs."""


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron-style parallel sizes. ``dp`` is derived from the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    num_experts: int | None = None
    num_layers: int | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, int]) -> ParallelLayout:
        known = {*AXES, "num_experts", "num_layers"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LayoutError(f"unknown layout key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def problems(self, world_size: int) -> list[str]:
        """Every rule this layout breaks on ``world_size`` GPUs (empty when valid)."""
        out = []
        for axis, value in asdict(self).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                out.append(f"{axis} must be a positive integer, got {value!r}")
        if out:
            return out
        model = self.tp * self.pp * self.cp
        if world_size % model:
            out.append(
                f"world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {model}"
            )
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            out.append(
                f"world size {world_size} is not divisible by etp*ep*pp = "
                f"{self.expert_tp}*{self.ep}*{self.pp} = {expert} (Megatron's expert-parallel grid)"
            )
        if self.ep > 1 and self.num_experts is not None and self.num_experts % self.ep:
            out.append(f"num_experts {self.num_experts} is not divisible by ep {self.ep}")
        if self.num_layers is not None and self.num_layers % self.pp:
            out.append(f"num_layers {self.num_layers} is not divisible by pp {self.pp}")
        return out

    def validate(self, world_size: int) -> ParallelLayout:
        problems = self.problems(world_size)
        if problems:
            raise LayoutError(
                f"invalid parallel layout {self.describe()} on {world_size} GPUs: " + "; ".join(problems)
            )
        return self

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def describe(self) -> str:
        parts = [f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) not in (None, 1)]
        return "(" + (", ".join(parts) or "tp=1") + ")"


def derive_layout(layout: ParallelLayout, num_gpus: int, *, keep: Iterable[str]) -> ParallelLayout:
    """The variant of ``layout`` for ``num_gpus`` GPUs: axes in ``keep`` stay, the others drop to 1.

    Data parallel shrinks by itself (it is derived from the world size). Raises
    :class:`LayoutError` naming the broken constraint when the kept axes do not fit.
    """
    keep = set(keep)
    unknown = sorted(keep - set(AXES))
    if unknown:
        raise LayoutError(f"cannot keep unknown axis/axes {unknown}; axes: {list(AXES)}")
    variant = replace(layout, **{axis: 1 for axis in AXES if axis not in keep and axis != "etp"})
    if "etp" not in keep:
        variant = replace(variant, etp=None)
    return variant.validate(num_gpus)
