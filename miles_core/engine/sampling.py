"""Batched sampling on the device, with per-request parameters and per-request random streams.

Each row has its own temperature, top-k and top-p. Filtering happens in this order: scale by the
temperature, keep the ``top_k`` highest-ranked tokens (ties broken by token id), then keep the
smallest prefix of that renormalised distribution whose mass reaches ``top_p`` (the token that
crosses the threshold is kept). The returned log-probs are those of this final distribution.
Greedy rows (temperature 0) take the argmax and report the unmodified model distribution.

A token is drawn by inverting the distribution's CDF at a uniform number: the ``i``-th token of a
request uses the ``i``-th number of the SplitMix64 stream seeded with the request's seed
(:func:`uniform`), so a request produces the same tokens alone or batched with others. The
numbers of a whole step are computed at once (:func:`uniforms`, vectorised on the host: no
generator object per request).

The parameters live in per-row device tensors (:class:`RowParams`, set once when a request takes
a row, moved with it), so a step builds no per-request tensors: :func:`sample_rows` is a fixed
sequence of batched kernels, with the sort for top-k/top-p only when some row filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from miles_core.engine.base import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def uniform(seed: int, draw: int) -> float:
    """Number ``draw`` (0-based) of the SplitMix64 stream seeded with ``seed``, in ``[0, 1)``: the
    reference :func:`uniforms` computes in bulk."""
    z = (seed + (draw + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def uniforms(seeds: np.ndarray, draws: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`uniform` of ``(seeds[i], draws[i])`` for every ``i`` (uint64 arrays in, float64 out;
    numpy's unsigned arithmetic wraps modulo 2**64 as SplitMix64 needs)."""
    z = seeds + (draws + np.uint64(1)) * np.uint64(_GAMMA)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    z >>= np.uint64(11)
    return np.multiply(z, 2.0**-53, out=out, dtype=np.float64, casting="unsafe")


class RowParams:
    """Sampling parameters of every row, on the device."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.full((rows,), vocab_size, dtype=torch.long, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=device)

    def set(self, rows: Sequence[int], params: Sequence[SamplingParams]) -> None:
        self.set_values(rows, [row_values(q, self.vocab_size) for q in params])

    def set_values(self, rows: Sequence[int], values: Sequence[tuple[float, int, float, bool]]) -> None:
        """Rows ``rows`` take ``values`` (:func:`row_values` tuples); a ``range`` of rows is written
        as a slice."""
        if not rows:
            return
        device = self.temperature.device
        if isinstance(rows, range) and rows.step == 1:
            index: slice | torch.Tensor = slice(rows.start, rows.stop)
        else:
            index = torch.tensor(list(rows), device=device)
        first = values[0]
        if all(v == first for v in values):  # the usual case: one set of parameters (a GRPO batch)
            t, k, p, g = first
            self.temperature[index] = t
            self.top_k[index] = k
            self.top_p[index] = p
            self.greedy[index] = g
            return
        table = torch.tensor(values, dtype=torch.float64).to(device)
        self.temperature[index] = table[:, 0].float()
        self.top_k[index] = table[:, 1].long()
        self.top_p[index] = table[:, 2].float()
        self.greedy[index] = table[:, 3].bool()

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        for t in (self.temperature, self.top_k, self.top_p, self.greedy):
            t[targets] = t[sources]


def filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether ``params`` needs the top-k / top-p filter (the sort) at this vocabulary size."""
    _, k, p, _ = row_values(params, vocab_size)
    return k < vocab_size or p < 1.0


def row_values(params: SamplingParams, vocab: int) -> tuple[float, int, float, bool]:
    """``(temperature, top_k, top_p, greedy)`` of a row sampling with ``params``."""
    if params.greedy:
        return 1.0, vocab, 1.0, True
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    return float(params.temperature), top_k, float(params.top_p), False


def filtered_logprobs_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, filtering: bool
) -> torch.Tensor:
    """Log-probs ``[n, vocab]`` (fp32) of the distribution each row samples from (filtered: ``-inf``)."""
    scaled = logits.float() / temperature[:, None]
    if filtering:
        vocab = scaled.shape[-1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=scaled.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        threshold = top_p[:, None]
        drop |= (mass_before >= threshold) & (threshold < 1.0)
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scaled.log_softmax(dim=-1)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    filtering: bool,
    any_greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return the tokens ``[n]`` (long) and their log-probs ``[n]`` (fp32).

    ``uniforms`` ``[n]`` (float64) are the rows' random numbers for this step; ``filtering`` and
    ``any_greedy`` say whether any row filters / decodes greedily (known on the host, so no sync).
    """
    logprobs = filtered_logprobs_rows(logits, temperature, top_k, top_p, filtering=filtering)
    cdf = logprobs.exp().double().cumsum(dim=-1)
    u = uniforms[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    if any_greedy:
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen


def filtered_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """:func:`filtered_logprobs_rows` with parameters given per row as :class:`SamplingParams`."""
    rows = RowParams(len(params), logits.shape[-1], logits.device)
    rows.set(range(len(params)), params)
    filtering = any(filters(p, logits.shape[-1]) for p in params)
    return filtered_logprobs_rows(logits, rows.temperature, rows.top_k, rows.top_p, filtering=filtering)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[list[int], list[float]]:
    """:func:`sample_rows` with parameters given per row as :class:`SamplingParams` (lists out)."""
    vocab = logits.shape[-1]
    rows = RowParams(len(params), vocab, logits.device)
    rows.set(range(len(params)), params)
    tokens, chosen = sample_rows(
        logits, rows.temperature, rows.top_k, rows.top_p, rows.greedy,
        torch.tensor(list(uniforms), dtype=torch.float64, device=logits.device),
        filtering=any(filters(p, vocab) for p in params), any_greedy=any(p.greedy for p in params),
    )
    return tokens.tolist(), chosen.tolist()
