"""fla's variable-length kernels (GPU): ``chunk_gated_delta_rule`` and the causal short convolution,
both given the packed batch's ``cu_seqlens`` (and their CPU copy, so no launch waits on the device).
"""

from __future__ import annotations

import functools
import importlib

import torch

from miles_core.patches.packing import PackedSequences


@functools.cache
def fla_available() -> bool:
    """Whether fla's kernels import here (they need triton and a GPU driver)."""
    try:
        importlib.import_module("fla.modules.convolution")
        importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return False
    return True


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    ctx: PackedSequences,
) -> torch.Tensor:
    """``x`` ``[B, D, T]`` (transformers' layout) -> ``[B, D, T]``, each segment convolved alone."""
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d

    batch, dim, seq_len = x.shape
    y, _ = fla_causal_conv1d(
        x.transpose(1, 2).reshape(1, batch * seq_len, dim),
        weight=weight,
        bias=bias,
        activation=activation,
        cu_seqlens=ctx.cu_seqlens,
        cu_seqlens_cpu=ctx.cu_seqlens_cpu,
    )
    return y.view(batch, seq_len, dim).transpose(1, 2)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: PackedSequences,
    *,
    use_qk_l2norm_in_kernel: bool,
) -> torch.Tensor:
    """Same shapes as :func:`miles_qwen35.torch_varlen.chunk_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    batch, seq_len = query.shape[:2]

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, batch * seq_len, *t.shape[2:])

    out, _ = fla_chunk(
        flat(query),
        flat(key),
        flat(value),
        g=flat(g),
        beta=flat(beta),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=ctx.cu_seqlens,
        cu_seqlens_cpu=ctx.cu_seqlens_cpu,
    )
    return out.view(batch, seq_len, *out.shape[2:])
