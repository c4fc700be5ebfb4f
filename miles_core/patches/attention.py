"""Packed attention: in a packed forward, full-attention layers attend within each document only.

transformers' ``sdpa`` path turns packed ``position_ids`` into a dense ``[T, T]`` block-diagonal
mask and runs a masked kernel over all ``T^2`` query/key pairs: no causal skipping, and no skipping
of the pairs that cross documents. For a row of 8 documents of 64-4096 tokens that is ~8x the
work of attending per document (and the largest share of a GDN model's backward on an H200).

:func:`use_packed_attention` switches a model from ``sdpa`` to :data:`ATTENTION_NAME`, registered
with transformers' attention and mask interfaces. Outside a packed forward it *is* ``sdpa`` (the
same function, the same mask). Inside one (a :class:`~miles_core.patches.packing.PackedSequences`
is current and describes this layer's ``[B, T]``) the mask is skipped and each document runs causal
attention alone: one variable-length flash kernel on CUDA in half precision where torch has one
(``torch.nn.attention.varlen``), otherwise causal ``scaled_dot_product_attention`` per document
(one call per distinct document length; shared-prompt groups whose responses have one length, one
masked call per group shape).
The document boundaries are the packing context's, which follow transformers' own rule for packed
masks, so the result equals the masked path up to kernel rounding.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles_core.hardware.devices import device_supports
from miles_core.patches.packing import PACKING_KWARG, PackedSequences, current_packed_sequences

log = logging.getLogger(__name__)

#: the attention implementation name registered with transformers
ATTENTION_NAME = "miles_packed_sdpa"


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, packed_sdpa_mask)


def use_packed_attention(model: Any) -> bool:
    """Switch ``model``'s text attention from ``sdpa`` to :data:`ATTENTION_NAME`; returns whether it uses it.

    Models on another implementation (eager, flash-attention, a custom kernel) keep it: flash
    attention already runs packed rows variable-length, and eager is asked for on purpose.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    current = getattr(text, "_attn_implementation", None)
    if current == ATTENTION_NAME:
        return True
    if current != "sdpa":
        return False
    _register()
    if text is config:
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        key = next((k for k in config.sub_configs if getattr(config, k, None) is text), None)
        if key is None:
            return False
        model.set_attn_implementation({key: ATTENTION_NAME})
    return getattr(text, "_attn_implementation", None) == ATTENTION_NAME


def _context_for(batch_size: int, seq_len: int, ctx: PackedSequences | None) -> PackedSequences | None:
    if ctx is None or (ctx.batch_size, ctx.seq_len) != (batch_size, seq_len):
        return None
    return ctx


def packed_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' sdpa mask, or none in a packed forward (the attention splits documents itself)."""
    from transformers.masking_utils import sdpa_mask

    batch_size = kwargs.get("batch_size", args[0] if args else None)
    kv_length = kwargs.get("kv_length", args[2] if len(args) > 2 else None)
    if (
        batch_size is not None
        and kv_length is not None
        and _context_for(batch_size, kv_length, current_packed_sequences()) is not None
    ):
        return None
    return sdpa_mask(*args, **kwargs)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]`` -> ``([B, T, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch_size, heads, seq_len, head_dim = query.shape
    # From the keyword arguments, not the context variable: an activation-checkpoint replay runs
    # after the forward's scope closed, with the keyword arguments it captured.
    ctx = _context_for(batch_size, seq_len, kwargs.get(PACKING_KWARG))
    if ctx is None or key.shape[2] != seq_len or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = head_dim**-0.5 if scaling is None else scaling

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B * T, H, D]
        return t.transpose(1, 2).reshape(batch_size * seq_len, t.shape[1], head_dim)

    q, k, v = tokens(query), tokens(key), tokens(value)
    # the varlen kernel attends within segments only: a branch (shared prompt) needs its root's keys
    varlen = _varlen_kernel(q) if dropout == 0.0 and ctx.branches is None else None
    if varlen is not None:
        out = varlen(q, k, v, ctx, scale)
    else:
        out = _per_document(q, k, v, ctx, scale, dropout if module.training else 0.0)
    return out.view(batch_size, seq_len, heads, head_dim), None


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[N, Hkv, D]`` -> ``[N, heads, D]`` (each key/value head serves a group of query heads)."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


@dataclass(frozen=True)
class _Job:
    """One ``scaled_dot_product_attention`` call over ``count`` equal spans of tokens."""

    count: int
    query_index: torch.Tensor  # [count * length] flat token positions
    key_index: torch.Tensor | None  # [count * (prefix + length)]; None: the keys are the queries
    allowed: torch.Tensor | None  # [length, keys] boolean mask; None: causal
    #: ``(start, stop)`` when ``query_index`` is that range (a view instead of a gather)
    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Plan:
    jobs: tuple[_Job, ...]
    inverse: torch.Tensor | None  # puts the jobs' outputs back in token order; None: already in order
    slices: tuple[tuple[int, int], ...] = ()  # instead of jobs: one call per segment, in order


#: one plan per packed forward and device: every attention layer, the reference forward and the
#: activation-checkpoint replay of a row read the same boundaries
_PLANS: weakref.WeakKeyDictionary[PackedSequences, dict[torch.device, _Plan]] = weakref.WeakKeyDictionary()


def _plan(ctx: PackedSequences, device: torch.device) -> _Plan:
    by_device = _PLANS.setdefault(ctx, {})
    plan = by_device.get(device)
    if plan is None:
        plan = by_device[device] = _make_plan(ctx, device)
    return plan


#: the longest group attended as one masked block. A block computes every query/key pair of the
#: group, those across its responses too, so it pays only where per-call costs dominate
#: (``benchmarks/group_attention.py``, forward and backward, one CPU thread, 8 responses: the block
#: takes 0.60-0.67x the per-segment time at 12-64 tokens, 0.72-0.80x at 96, 1.03-3.6x from 144)
GROUP_BLOCK_MAX_TOKENS = 64


def _whole_groups(ctx: PackedSequences, length_at: dict[int, int]) -> dict[tuple[int, int, int], list[int]]:
    """Shared-prompt groups laid out as one span of at most :data:`GROUP_BLOCK_MAX_TOKENS`: a root of
    ``prefix + L`` tokens (the prompt and the first response) followed directly by its other
    responses, all of ``L`` tokens. Keyed by ``(prefix, responses, L)``, the roots of each shape:
    such a group is one query block under one mask, so groups of a shape share a call, with no
    per-response gather of the prompt's keys."""
    members: dict[int, list[tuple[int, int]]] = {}
    for start, root, prefix in ctx.branches or ():
        members.setdefault(root, []).append((start, prefix))
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for root, branches in members.items():
        prefix = branches[0][1]
        length = length_at[root] - prefix
        starts = sorted(start for start, _ in branches)
        in_line = [root + prefix + length * (i + 1) for i in range(len(starts))]
        if (length < 1 or prefix + length * (len(starts) + 1) > GROUP_BLOCK_MAX_TOKENS or starts != in_line
                or any(p != prefix for _, p in branches) or any(length_at[start] != length for start in starts)):
            continue
        shapes.setdefault((prefix, len(starts) + 1, length), []).append(root)
    return shapes


def _group_mask(prefix: int, responses: int, length: int) -> torch.Tensor:
    """``[T, T]`` for a prompt of ``prefix`` tokens and ``responses`` of ``length`` after it: the
    prompt is causal; a response token sees the prompt and its own response up to itself."""
    total = prefix + responses * length
    pos = torch.arange(total)
    response = torch.where(pos < prefix, -1, (pos - prefix) // length)
    causal = pos[None, :] <= pos[:, None]
    return causal & ((pos[None, :] < prefix) | (response[None, :] == response[:, None]))


def _make_plan(ctx: PackedSequences, device: torch.device) -> _Plan:
    bounds = ctx.cu_seqlens_cpu.tolist()
    segments = list(itertools.pairwise(bounds))
    length_at = {start: end - start for start, end in segments}
    whole = _whole_groups(ctx, length_at)
    jobs, positions = [], []
    covered: set[int] = set()
    for (prefix, responses, length), group_roots in whole.items():
        total = prefix + responses * length
        query_index = (torch.tensor(group_roots)[:, None] + torch.arange(total)[None, :]).view(-1)
        in_order = all(b - a == total for a, b in itertools.pairwise(group_roots))
        span = (group_roots[0], group_roots[0] + len(group_roots) * total) if in_order else None
        mask = _group_mask(prefix, responses, length).to(device)
        jobs.append(_Job(len(group_roots), query_index.to(device), None, mask, span))
        positions.append(query_index)
        for root in group_roots:  # the root segment and its responses' segments
            covered.update([root, *range(root + prefix + length, root + total, length)])
    branch_of = {start: (root, prefix) for start, root, prefix in ctx.branches or ()}
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (length, prefix) -> [(start, root)]
    for start, end in segments:
        if start in covered:
            continue
        root, prefix = branch_of.get(start, (start, 0))
        groups.setdefault((end - start, prefix), []).append((start, root))
    if not branch_of and len(groups) == len(segments):  # every length distinct: plain slices, no gather
        return _Plan((), None, tuple(segments))
    for (length, prefix), members in groups.items():
        starts = torch.tensor([start for start, _ in members])
        query_index = (starts[:, None] + torch.arange(length)[None, :]).view(-1)
        key_index = allowed = None
        if prefix:
            roots = torch.tensor([root for _, root in members])
            key_index = torch.cat(
                [roots[:, None] + torch.arange(prefix)[None, :], starts[:, None] + torch.arange(length)[None, :]], dim=1
            ).view(-1).to(device)
            allowed = _group_mask(prefix, 1, length)[prefix:].to(device)  # the response's rows
        jobs.append(_Job(len(members), query_index.to(device), key_index, allowed))
        positions.append(query_index)
    order = torch.cat(positions)
    if torch.equal(order, torch.arange(order.numel())):
        return _Plan(tuple(jobs), None)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return _Plan(tuple(jobs), inverse.to(device))


def _per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedSequences, scale: float, dropout: float
) -> torch.Tensor:
    """Causal attention within each document, one ``scaled_dot_product_attention`` call per distinct
    document length: documents of equal length are gathered into one batch (an RL step packs
    hundreds of same-length completions into a row, which would otherwise be as many calls).

    A branch segment (``ctx.branches``: a response laid out after its group's shared prompt) attends
    to its root's prompt tokens and then causally to itself; branches of equal prompt and own length
    share a call too. A group whose responses all have one length and follow their prompt directly
    is one query block under a mask instead (:func:`_whole_groups`), groups of a shape one call. The
    gather indices are planned once per packed forward (:func:`_plan`).
    """
    heads, head_dim = q.shape[1], q.shape[2]
    k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
    plan = _plan(ctx, q.device)
    if plan.slices:
        outs = []
        for start, end in plan.slices:
            qd, kd, vd = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D]
            out = torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, dropout_p=dropout, is_causal=True, scale=scale
            )
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def gathered(t: torch.Tensor, index: torch.Tensor, count: int, span: tuple[int, int] | None = None) -> torch.Tensor:
        # [count * n, H, D] -> [count, H, n, D]
        picked = t[span[0] : span[1]] if span else t.index_select(0, index)
        return picked.view(count, -1, heads, head_dim).transpose(1, 2)

    pieces = []
    for job in plan.jobs:
        qd = gathered(q, job.query_index, job.count, job.span)
        if job.key_index is None:
            kd, vd = gathered(k, job.query_index, job.count, job.span), gathered(v, job.query_index, job.count, job.span)
        else:
            kd, vd = gathered(k, job.key_index, job.count), gathered(v, job.key_index, job.count)
        out = torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=job.allowed, dropout_p=dropout, is_causal=job.allowed is None, scale=scale
        )
        pieces.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedSequences, float], torch.Tensor]


def _varlen_kernel(q: torch.Tensor) -> VarlenKernel | None:
    if q.dtype not in (torch.float16, torch.bfloat16) or not device_supports(q.device, "varlen_flash_attention"):
        return None
    return _cuda_varlen()


@functools.cache
def _cuda_varlen() -> VarlenKernel | None:
    """torch's variable-length flash kernel, adapted to the signature of this torch, if it runs here."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal: dict[str, Any] = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        log.info(
            "torch.nn.attention.varlen_attn has no causal switch here; packed attention runs per document"
        )
        return None
    if "scale" not in params:
        log.info("torch.nn.attention.varlen_attn takes no scale here; packed attention runs per document")
        return None
    gqa = "enable_gqa" in params

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedSequences, scale: float
    ) -> torch.Tensor:
        extra: dict[str, Any] = {}
        if gqa:
            extra["enable_gqa"] = True
        else:
            k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        out = varlen_attn(
            q,
            k,
            v,
            ctx.cu_seqlens,
            ctx.cu_seqlens,
            ctx.max_seqlen,
            ctx.max_seqlen,
            scale=scale,
            **causal,
            **extra,
        )
        return out[0] if isinstance(out, tuple) else out  # (output, aux) only when aux outputs are requested

    # One tiny call decides whether this build has the kernel (CPU-only or flash-less builds do not).
    probe = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        run(probe, probe[:, :1], probe[:, :1], PackedSequences.from_lengths([1, 3], device="cuda"), 0.125)
    except RuntimeError as exc:
        log.warning(
            "torch's varlen flash attention does not run here (%s); packed attention runs per document", exc
        )
        return None
    return run
