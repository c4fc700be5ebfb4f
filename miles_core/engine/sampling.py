"""Batched sampling with per-request parameters and per-request random streams.

Each row has its own temperature, top-k and top-p. Filtering happens in this order: scale by the
temperature, keep the ``top_k`` highest-ranked tokens (ties broken by token id), then keep the
smallest prefix of that renormalised distribution whose mass reaches ``top_p`` (the token that
crosses the threshold is kept). The returned log-probs are those of this final distribution.

A token is drawn by inverting the distribution's CDF at a uniform number taken from the
request's own ``random.Random(seed)``: one number per step, whatever the batch, so a request
produces the same tokens alone or batched with others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_core.engine.base import SamplingParams


def filtered_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Log-probs ``[n, vocab]`` (fp32) of the distribution each row samples from.

    Filtered tokens are ``-inf``. Greedy rows get the unmodified model distribution.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    device = logits.device
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temperature[:, None]
    top_k = [p.top_k if (not p.greedy and 0 < p.top_k < vocab) else vocab for p in params]
    top_p = [p.top_p if not p.greedy else 1.0 for p in params]
    if any(k < vocab for k in top_k) or any(q < 1.0 for q in top_p):
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=device)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        threshold = torch.tensor(top_p, device=device)[:, None]
        drop |= (mass_before >= threshold) & (threshold < 1.0)
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scaled.log_softmax(dim=-1)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[list[int], list[float]]:
    """Draw one token per row; return the tokens and their log-probs (see module doc)."""
    logprobs = filtered_logprobs(logits, params)
    cdf = logprobs.exp().double().cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
