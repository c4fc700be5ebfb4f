"""Model paths, the keyword interfaces they take MTP labels through, and the detected conventions.

Three label conventions exist in the wild for the same DeepSeek-style MTP block:

* upstream megatron-core ``GPTModel``: ``labels=`` are next-token labels, rolled once per depth;
* the radixark fork's ``GPTModel``: ``mtp_kwargs={"mtp_labels": tokens}`` takes raw tokens and
  rolls once more itself;
* the Mamba/hybrid path: ``mtp_labels=`` feeds ``process_mtp_loss``, which rolls only per depth,
  so it expects next-token ("pre-shifted") labels.

Which one an installed class implements is never read from a version string: :mod:`miles_mtp.probe`
observes it and records it as a :class:`Convention`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: shifts a model may apply to its inputs before depth 1 that an adapter can undo exactly
SUPPORTED_PRE_SHIFTS = (0, 1)


def _labels_kwargs(labels: Any, loss_mask: Any) -> dict[str, Any]:
    return {"labels": labels, "loss_mask": loss_mask}


def _mtp_kwargs_kwargs(labels: Any, loss_mask: Any) -> dict[str, Any]:
    return {"labels": None, "mtp_kwargs": {"mtp_labels": labels}, "loss_mask": loss_mask}


def _mtp_labels_kwargs(labels: Any, loss_mask: Any) -> dict[str, Any]:
    return {"mtp_labels": labels, "loss_mask": loss_mask}


@dataclass(frozen=True)
class Interface:
    """How a model's ``forward`` receives the MTP labels and the loss mask."""

    name: str
    signature: str
    build: Callable[[Any, Any], dict[str, Any]]

    def kwargs(self, labels: Any, loss_mask: Any) -> dict[str, Any]:
        return self.build(labels, loss_mask)


LABELS = Interface("labels", "labels=<labels>, loss_mask=<mask>", _labels_kwargs)
MTP_KWARGS = Interface(
    "mtp_kwargs", "labels=None, mtp_kwargs={'mtp_labels': <labels>}, loss_mask=<mask>", _mtp_kwargs_kwargs
)
MTP_LABELS = Interface("mtp_labels", "mtp_labels=<labels>, loss_mask=<mask>", _mtp_labels_kwargs)


@dataclass(frozen=True)
class ModelPath:
    """A megatron-core model family with an MTP block, and the interfaces to probe it through."""

    name: str
    module: str
    class_name: str
    interfaces: tuple[Interface, ...]

    def load(self) -> type | None:
        """The installed class, or None when this megatron-core does not ship it."""
        try:
            with warnings.catch_warnings():  # megatron's notes that TE and Apex are absent (CPU)
                warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
                module = importlib.import_module(self.module)
        except ImportError:
            return None
        return getattr(module, self.class_name, None)

    def covers(self, model_cls: type) -> bool:
        base = self.load()
        return base is not None and issubclass(model_cls, base)


GPT = ModelPath("gpt", "megatron.core.models.gpt", "GPTModel", (LABELS, MTP_KWARGS))
MAMBA = ModelPath("mamba", "megatron.core.models.mamba", "MambaModel", (MTP_LABELS, LABELS))
PATHS: tuple[ModelPath, ...] = (GPT, MAMBA)


def path_for(model_cls: type) -> ModelPath | None:
    """The path whose base class ``model_cls`` derives from."""
    return next((path for path in PATHS if path.covers(model_cls)), None)


@dataclass(frozen=True)
class Convention:
    """What a model class does with the labels and mask it receives, as observed.

    At depth ``k`` the model trains on its label input shifted ``label_pre_shifts + k`` times and
    weights the loss with its mask input shifted ``mask_pre_shifts + k`` times (per document).
    """

    path: str
    model_class: str
    interface: Interface
    label_pre_shifts: int
    mask_pre_shifts: int

    @property
    def expects(self) -> str:
        labels = {0: "next-token labels", 1: "raw token ids"}[self.label_pre_shifts]
        mask = (
            "" if self.mask_pre_shifts == 0 else f", rolls the loss mask {self.mask_pre_shifts} extra time(s)"
        )
        return f"{labels} through {self.interface.signature}{mask}"

    def describe(self) -> str:
        return f"{self.model_class} ({self.path} path) takes {self.expects}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "model_class": self.model_class,
            "interface": self.interface.name,
            "label_pre_shifts": self.label_pre_shifts,
            "mask_pre_shifts": self.mask_pre_shifts,
            "expects": self.expects,
        }


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
