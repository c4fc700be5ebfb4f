"""RL algorithms: the protocol (:mod:`.base`), the built-ins (:mod:`.builtin`), their shared math
(:mod:`.losses`), training documents and packed rows (:mod:`.batch`), and the fixed tiny batch
every algorithm's ``verify()`` is checked on (:mod:`.probe`).

Importing this package does not import torch: the names below load their module on first use,
so plugin discovery (which imports the protocol and the built-in descriptors) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TrainDocument": "batch",
    "PackedRow": "batch",
    "pack_documents": "batch",
    "group_advantages": "losses",
    "token_logprobs": "losses",
    "entropy_from_logits": "losses",
    "kl_k3": "losses",
    "clipped_policy_loss": "losses",
    "sequence_ratio": "losses",
    "aggregation_weights": "losses",
    "MinibatchTotals": "losses",
    "Algorithm": "base",
    "TokenBatch": "base",
    "PolicyLoss": "base",
    "ROLLOUT_FIELDS": "base",
}

__all__ = [
    "ROLLOUT_FIELDS",
    "Algorithm",
    "MinibatchTotals",
    "PackedRow",
    "PolicyLoss",
    "TokenBatch",
    "TrainDocument",
    "aggregation_weights",
    "clipped_policy_loss",
    "entropy_from_logits",
    "group_advantages",
    "kl_k3",
    "pack_documents",
    "sequence_ratio",
    "token_logprobs",
]

if TYPE_CHECKING:
    from miles_core.rl.algorithms.base import ROLLOUT_FIELDS, Algorithm, PolicyLoss, TokenBatch
    from miles_core.rl.algorithms.batch import PackedRow, TrainDocument, pack_documents
    from miles_core.rl.algorithms.losses import (
        MinibatchTotals,
        aggregation_weights,
        clipped_policy_loss,
        entropy_from_logits,
        group_advantages,
        kl_k3,
        sequence_ratio,
        token_logprobs,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
