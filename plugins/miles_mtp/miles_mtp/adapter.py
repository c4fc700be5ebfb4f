"""Adapters: the one place where an MTP label or loss mask is shifted, once, per model path.

An adapter turns the canonical batch (raw tokens, token-aligned loss mask, layout) into the
keyword arguments of one model path's ``forward``, according to the :class:`Convention` the
probe observed for that class. Installed on a model (:func:`install`), it wraps the instance's
``forward`` so the trainer calls every path the same way::

    model(input_ids=tokens, position_ids=..., attention_mask=..., loss_mask=token_aligned_mask,
          packed_seq_params=...)   # never labels=, mtp_labels= or mtp_kwargs=
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from miles_mtp.contract import LabelContractError, MTPBatch
from miles_mtp.conventions import SUPPORTED_PRE_SHIFTS, Convention
from miles_mtp.roll import LEFT, RIGHT, SequenceLayout, roll

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
#: keyword arguments the adapter owns: a caller passing them would shift a second time
ADAPTER_OWNED = frozenset({"labels", "mtp_labels", "mtp_kwargs"})


@dataclass(frozen=True)
class LabelAdapter:
    """Feeds one model path: shifts labels ``1 - label_pre_shifts`` times (so that, with the
    model's own shift, labels are shifted exactly once) and pre-compensates any extra mask roll."""

    convention: Convention

    def __post_init__(self) -> None:
        c = self.convention
        if c.label_pre_shifts not in SUPPORTED_PRE_SHIFTS or c.mask_pre_shifts not in SUPPORTED_PRE_SHIFTS:
            raise LabelContractError(f"no adapter can feed {c.describe()}")

    def path_inputs(self, tokens: T, loss_mask: T, shift: Callable[[T, int], T]) -> tuple[T, T]:
        """Labels and mask for the model, with ``shift(x, direction)`` doing one per-document roll."""
        labels = tokens if self.convention.label_pre_shifts == 1 else shift(tokens, LEFT)
        # a model that rolls its mask once before the per-depth rolls gets it one position
        # behind: exact, because the canonical mask is 0 at every document's last position
        mask = loss_mask if self.convention.mask_pre_shifts == 0 else shift(loss_mask, RIGHT)
        return labels, mask

    def model_kwargs(self, batch: MTPBatch, cp_group: Any = None) -> dict[str, Any]:
        """The path's ``forward`` keyword arguments for ``batch`` (this rank's shard)."""

        def shift(x: torch.Tensor, direction: int) -> torch.Tensor:
            return roll(x, direction, batch.layout, cp_group)

        labels, mask = self.path_inputs(batch.tokens, batch.float_mask(), shift)
        return self.convention.interface.kwargs(labels, mask)


class AdaptedForward:
    """``module.forward`` behind the label adapter: an inspectable object (the module, its
    adapter, the forward it wraps) whose signature is the wrapped forward's."""

    def __init__(self, module: Any, adapter: LabelAdapter, inner: Any = None) -> None:
        self.module = module
        self.adapter = adapter
        self.inner = inner  # an instance-level forward found on the module, else None: the class's
        self.__signature__ = inspect.signature(self._target())

    def _target(self) -> Any:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, loss_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        bound = self.__signature__.bind_partial(*args, **kwargs)
        owned = sorted(ADAPTER_OWNED & bound.arguments.keys())
        if owned:
            raise LabelContractError(
                f"{', '.join(owned)} passed to a model with the MTP label adapter: pass raw input_ids and "
                "a token-aligned loss_mask only; the adapter derives the labels (passing them would "
                "shift twice)"
            )
        if loss_mask is None:
            raise LabelContractError(
                "loss_mask is required by the MTP label contract: loss_mask[i] = 1 trains the "
                "prediction of input_ids[i + 1] (all zeros when nothing is trained)"
            )
        cp_group = context_parallel_group(self.module)
        layout = sequence_layout(bound.arguments.get("packed_seq_params"), cp_group)
        batch = MTPBatch(bound.arguments["input_ids"], loss_mask, layout)
        return self._target()(*args, **kwargs, **self.adapter.model_kwargs(batch, cp_group))


def installed_adapter(model: Any) -> LabelAdapter | None:
    forward = model.__dict__.get("forward")
    return forward.adapter if isinstance(forward, AdaptedForward) else None


def install(model: Any, adapter: LabelAdapter) -> None:
    """Put ``adapter`` in front of ``model.forward`` (this instance only); re-installing replaces."""
    inner = model.__dict__.get("forward")
    if isinstance(inner, AdaptedForward):
        inner = inner.inner
    model.forward = AdaptedForward(model, adapter, inner)


def context_parallel_group(model: Any) -> Any:
    group = getattr(model, "cp_group", None)
    if group is None:
        group = getattr(getattr(model, "pg_collection", None), "cp", None)
    return group


def sequence_layout(packed_seq_params: Any, cp_group: Any) -> SequenceLayout:
    """The layout megatron's own rolls use: padded ``cu_seqlens`` when packed, the CP group's split."""
    cu = None
    if packed_seq_params is not None:
        padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
        source = padded if padded is not None else packed_seq_params.cu_seqlens_q
        cu = tuple(int(v) for v in source.tolist())
    if cp_group is None or cp_group.size() == 1:
        return SequenceLayout(cu)
    import torch.distributed as dist

    return SequenceLayout(cu, cp_group.size(), dist.get_rank(group=cp_group))
