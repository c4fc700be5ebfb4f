"""The numeric probe: one GDN layer of the built model, two documents packed vs run alone."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from miles_core.patches.base import ProbeResult, qualname
from miles_core.patches.packing import PACKING_KWARG, PackedSequences


@torch.no_grad()
def probe_layer(layer: torch.nn.Module, lengths: Sequence[int], rtol: Mapping[str, float]) -> ProbeResult:
    """Run a float32 copy of ``layer`` on random documents of ``lengths``, packed and alone.

    Passes if the packed outputs equal the per-document ones within ``rtol[device type]`` of their
    magnitude. The detail also reports how far the packed row drifts without the context (the
    leak the patch removes). Uses its own random generator: the caller's RNG state is untouched.
    """
    device = next(layer.parameters()).device
    probe = copy.deepcopy(layer).float().eval()
    hidden_size = probe.hidden_size
    if not isinstance(hidden_size, int):
        raise TypeError(f"{type(layer).__name__}.hidden_size is {hidden_size!r}, not a width")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, sum(lengths), hidden_size, generator=generator, device=device)
    ctx = PackedSequences.from_lengths(lengths, device=device)

    alone = torch.cat([probe(chunk) for chunk in x.split(list(lengths), dim=1)], dim=1)
    packed = probe(x, **{PACKING_KWARG: ctx})
    leaked = probe(x)
    diff = (packed - alone).abs().max().item()
    leak = (leaked - alone).abs().max().item()
    tolerance = rtol.get(device.type, max(rtol.values())) * max(1.0, alone.abs().max().item())
    return ProbeResult(
        passed=diff <= tolerance,
        max_abs_diff=diff,
        tolerance=tolerance,
        detail=f"{qualname(type(layer))} on documents of {list(lengths)} tokens ({device.type}); "
        f"without the packing context the same row differs by {leak:.3g}",
    )
