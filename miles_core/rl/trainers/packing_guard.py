"""Refuse to train packed rows on a model whose recurrent layers leak across documents.

Gated DeltaNet (``linear_attention``) layers carry a recurrent state and a causal-conv window; in
a packed row they leak document A into document B unless a model patch (miles-qwen35) resets them
at each boundary. For a model whose config declares ``linear_attention`` layers the guard checks
that (1) the class of every recurrent module (``*.linear_attn``) is among the classes a model patch
applied and verified (``prepare_model``'s report), and (2) the *effect*: two documents packed in
one row give the logits they give alone, within the dtype's tolerance. Either failure stops the
run with the fix named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_core.errors import MilesError

#: max abs logit difference tolerated between packed and per-document forwards, by dtype. A leak
#: is ~3e-2 on a tiny fp32 CPU model and ~4 on a 0.5B bf16 GPU model; patched kernels differ by
#: < 1e-6 (fp32 CPU), ~6e-3 (fp32 with tf32 GPU kernels) and ~0.25 (bf16 GPU, long documents).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-8, torch.bfloat16: 1.0, torch.float16: 1.0}

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


def recurrent_module_classes(model: Any) -> set[str]:
    return {f"{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()
            if name.endswith("linear_attn")}


def branches_supported(model: Any) -> bool:
    """Whether every recurrent layer of ``model`` can run rows with shared prompts
    (``PackedSequences.branches``): it must say so itself (``supports_branches()``, which a model
    patch installs); attention layers always can (the packed attention reads the branches)."""
    layers = [m for name, m in model.named_modules() if name.endswith("linear_attn")]
    return all(callable(getattr(m, "supports_branches", None)) and m.supports_branches() for m in layers)


def check_packing_safe(model: Any, *, packing: bool, applied: Mapping[str, Sequence[str]] | None = None) -> float | None:
    """Check models with recurrent layers when packing; raise :class:`PackingLeakError` if unsafe.

    ``applied`` is ``{patch: [patched classes]}`` from ``prepare_model``'s report (``None``: skip
    the class check). Returns the measured leak (``None`` when nothing needed checking).
    """
    if not packing or not recurrent_layer_types(model):
        return None
    if applied is not None:
        covered = {cls for classes in applied.values() for cls in classes}
        missing = sorted(recurrent_module_classes(model) - covered)
        if missing:
            raise PackingLeakError(
                f"refusing to train: {type(model).__name__} has Gated DeltaNet (linear_attention) layers "
                f"({', '.join(missing)}) that no model patch applied and verified; {FIX}"
            )
    dtype = next(model.parameters()).dtype
    leak = packing_leak(model)
    if leak > TOLERANCE.get(dtype, 1e-4):
        raise PackingLeakError(
            f"refusing to train: {type(model).__name__} has Gated DeltaNet (linear_attention) layers and "
            f"packed rows leak across documents (max logit difference {leak:.3g}, tolerance "
            f"{TOLERANCE.get(dtype, 1e-4):g} for {dtype}); {FIX}"
        )
    return leak
