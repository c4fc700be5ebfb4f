"""Refuse to train packed rows on a model whose recurrent layers leak across documents.

Gated DeltaNet (``linear_attention``) layers carry a recurrent state and a causal-conv window; in
a packed row they leak document A into document B unless a model patch (miles-qwen35) resets them
at each boundary. The guard checks the *effect* on the model about to be trained: two documents
packed in one row must give the same logits as each run alone. Any model whose config declares
``linear_attention`` layers is probed; a leak stops the run with the fix named.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_core.errors import MilesError

#: max abs logit difference tolerated between packed and per-document forwards, by dtype
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 0.1, torch.float16: 0.05}

FIX = (
    "install and enable the Gated DeltaNet packing patch (pip install 'miles[qwen35]'; "
    "make sure MILES_DISABLE_PLUGINS does not name miles-qwen35), or train unpacked with "
    "trainer.packing=false"
)


class PackingLeakError(MilesError):
    """Packed training rows would mix documents on this model."""


def recurrent_layer_types(model: Any) -> list[str]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return sorted({t for t in (getattr(config, "layer_types", None) or []) if t == "linear_attention"})


@torch.no_grad()
def packing_leak(model: Any, lengths: tuple[int, int] = (11, 7), seed: int = 0) -> float:
    """Max abs logit difference of the second document, packed after the first vs alone."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    device = next(model.parameters()).device
    packed_ids = torch.cat(docs)[None].to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0, lengths[0]:]
        alone = model(input_ids=docs[1][None].to(device), use_cache=False).logits[0]
    finally:
        model.train(was_training)
    return float((packed.float() - alone.float()).abs().max())


def check_packing_safe(model: Any, *, packing: bool) -> float | None:
    """Probe models with recurrent layers when packing; raise :class:`PackingLeakError` on a leak.

    Returns the measured leak (``None`` when nothing needed probing).
    """
    if not packing or not recurrent_layer_types(model):
        return None
    dtype = next(model.parameters()).dtype
    leak = packing_leak(model)
    if leak > TOLERANCE.get(dtype, 1e-4):
        raise PackingLeakError(
            f"refusing to train: {type(model).__name__} has Gated DeltaNet (linear_attention) layers and "
            f"packed rows leak across documents (max logit difference {leak:.3g}, tolerance "
            f"{TOLERANCE.get(dtype, 1e-4):g} for {dtype}); {FIX}"
        )
    return leak
