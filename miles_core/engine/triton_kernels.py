"""Triton kernels of the lean forward's decode step (GPU tensors only: imported where triton imports).

* :func:`conv_step`: a Gated DeltaNet layer's causal-conv step with its SiLU and its gates. Compiled
  from torch, the conv was six kernels a layer (the output, the shifted window built in a buffer
  and copied back into the slot, one copy each for q, k and v: the slot is read and written, so the
  compiler cannot shift it in place) and the gates two more (``beta = sigmoid(b)``, ``g`` from
  ``a``): ~14 us of a small-gpu step's 2.5 ms per GDN layer on an H100 (2026-12-06 profile).
  Here each program owns one row's block of channels: it loads the window's taps and the new
  input, shifts the window in place (every element it writes, it has read), sums the products
  oldest first in fp32 as :func:`gdn_ops.conv_decode` does, adds the bias, applies SiLU, rounds
  once and stores each channel into its own contiguous q, k or v; the row's first program also
  computes the row's gates in fp32 (softplus as torch's: ``x`` above 20, else ``log1p(exp(x))``).
* :func:`kv_write`: the attention keys and values of a step (or a prefill) written into their rows'
  cache positions, one program per token and KV head. As two indexed assignments it was two
  generic index kernels of ~4 us each per attention layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: channels per program (small-gpu: 4,096 channels, 8 programs per row)
BLOCK = 512


@triton.jit
def _conv_step_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are tl.constexpr markers
    x, b, a, conv, weight, bias, a_log, dt_bias, q, k, v, g, beta,
    stride_x, stride_b, stride_a, stride_row, stride_tap, stride_wc, stride_wk,
    CHANNELS: tl.constexpr, KEY: tl.constexpr, VALUE: tl.constexpr, TAPS: tl.constexpr, HEADS: tl.constexpr,
    HEADS_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    channels = block * BLOCK + tl.arange(0, BLOCK)
    mask = channels < CHANNELS
    window = conv + row * stride_row + channels
    w = weight + channels * stride_wc
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TAPS - 1):
        tap = tl.load(window + (j + 1) * stride_tap, mask=mask, other=0)
        acc += tap.to(tl.float32) * tl.load(w + j * stride_wk, mask=mask, other=0).to(tl.float32)
        tl.store(window + j * stride_tap, tap, mask=mask)
    new = tl.load(x + row * stride_x + channels, mask=mask, other=0).to(conv.dtype.element_ty)
    acc += new.to(tl.float32) * tl.load(w + (TAPS - 1) * stride_wk, mask=mask, other=0).to(tl.float32)
    tl.store(window + (TAPS - 1) * stride_tap, new, mask=mask)
    if HAS_BIAS:
        acc += tl.load(bias + channels, mask=mask, other=0).to(tl.float32)
    out = (acc * tl.sigmoid(acc)).to(q.dtype.element_ty)
    target = tl.where(
        channels < KEY, q + row * KEY + channels,
        tl.where(channels < 2 * KEY, k + row * KEY + (channels - KEY), v + row * VALUE + (channels - 2 * KEY)),
    )
    tl.store(target, out, mask=mask)
    if block == 0:
        # beta = sigmoid(b) rounded to b's dtype; g = -exp(A_log) * softplus(a + dt_bias) in fp32
        heads = tl.arange(0, HEADS_BLOCK)
        live = heads < HEADS
        b_row = tl.load(b + row * stride_b + heads, mask=live, other=0).to(tl.float32)
        tl.store(beta + row * HEADS + heads, tl.sigmoid(b_row).to(beta.dtype.element_ty), mask=live)
        shifted = tl.load(a + row * stride_a + heads, mask=live, other=0).to(tl.float32)
        shifted += tl.load(dt_bias + heads, mask=live, other=0).to(tl.float32)
        grown = tl.exp(shifted)
        sum_ = 1.0 + grown  # log1p(grown) = log(sum_) * grown / (sum_ - 1): exact to a few ulps (Goldberg)
        log1p = tl.where(sum_ == 1.0, grown, tl.log(sum_) * (grown / (sum_ - 1.0)))
        softplus = tl.where(shifted > 20.0, shifted, log1p)
        decay = -tl.exp(tl.load(a_log + heads, mask=live, other=0).to(tl.float32))
        tl.store(g + row * HEADS + heads, decay * softplus, mask=live)


def conv_step(
    x: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, a_log: torch.Tensor, dt_bias: torch.Tensor, key_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal-conv step, SiLU and the gates for every row: ``x`` ``[n, C]`` and the gate inputs
    ``b``, ``a`` ``[n, Hv]`` (rows may be strided: slices of the fused projection), ``conv``
    ``[n, K, C]`` (updated in place), ``weight`` ``[C, K]``, ``a_log`` and ``dt_bias`` ``[Hv]``.
    Returns q ``[n, key_width]``, k ``[n, key_width]``, v ``[n, C - 2 * key_width]`` in ``x``'s
    dtype, ``g`` ``[n, Hv]`` fp32 and ``beta`` ``[n, Hv]`` in ``b``'s dtype, all contiguous."""
    n, channels = x.shape
    taps, heads = conv.shape[1], b.shape[1]
    if (x.stride(-1) != 1 or conv.stride(-1) != 1 or conv.shape[2] != channels or weight.shape != (channels, taps)
            or b.stride(-1) != 1 or a.stride(-1) != 1 or a.shape != b.shape or a_log.shape != (heads,)
            or dt_bias.shape != (heads,)):
        raise ValueError(f"conv_step: x {tuple(x.shape)}/{x.stride()}, conv {tuple(conv.shape)}/{conv.stride()}, "
                         f"weight {tuple(weight.shape)}, b/a {tuple(b.shape)}/{tuple(a.shape)}, "
                         f"A_log/dt_bias {tuple(a_log.shape)}/{tuple(dt_bias.shape)} do not fit")
    value_width = channels - 2 * key_width
    q = torch.empty((n, key_width), dtype=x.dtype, device=x.device)
    k = torch.empty((n, key_width), dtype=x.dtype, device=x.device)
    v = torch.empty((n, value_width), dtype=x.dtype, device=x.device)
    g = torch.empty((n, heads), dtype=torch.float32, device=x.device)
    beta = torch.empty((n, heads), dtype=b.dtype, device=x.device)
    _conv_step_kernel[(n, triton.cdiv(channels, BLOCK))](
        x, b, a, conv, weight, bias if bias is not None else weight, a_log, dt_bias, q, k, v, g, beta,
        x.stride(0), b.stride(0), a.stride(0), conv.stride(0), conv.stride(1), weight.stride(0), weight.stride(1),
        CHANNELS=channels, KEY=key_width, VALUE=value_width, TAPS=taps, HEADS=heads,
        HEADS_BLOCK=triton.next_power_of_2(heads), HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4,
    )
    return q, k, v, g, beta


@triton.jit
def _kv_write_kernel(  # type: ignore[no-untyped-def]
    keys, values, k, v, rows, positions,
    stride_row, stride_head, stride_pos, stride_kt, stride_kh, stride_vt, stride_vh,
    DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = tl.load(rows + token).to(tl.int64)
    position = tl.load(positions + token).to(tl.int64)
    d = tl.arange(0, BLOCK)
    live = d < DIM
    at = row * stride_row + head * stride_head + position * stride_pos + d
    tl.store(keys + at, tl.load(k + token * stride_kt + head * stride_kh + d, mask=live), mask=live)
    tl.store(values + at, tl.load(v + token * stride_vt + head * stride_vh + d, mask=live), mask=live)


def kv_write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
             positions: torch.Tensor) -> None:
    """``keys[rows[t], :, positions[t]] = k[t]`` and the same for ``values``: caches ``[rows, kvH,
    capacity, D]`` (one layout for both), ``k``/``v`` ``[T, kvH, D]`` (head and token strides free,
    dims contiguous), ``rows``/``positions`` ``[T]``."""
    tokens, heads, dim = k.shape
    if (keys.stride() != values.stride() or keys.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or v.shape != k.shape or keys.shape[1] != heads or keys.shape[3] != dim or rows.shape != (tokens,)
            or positions.shape != (tokens,) or k.dtype != keys.dtype or v.dtype != values.dtype):
        raise ValueError(f"kv_write: caches {tuple(keys.shape)}/{keys.stride()} and {values.stride()}, "
                         f"k {tuple(k.shape)}/{k.stride()}, v {tuple(v.shape)}/{v.stride()}, "
                         f"rows {tuple(rows.shape)}, positions {tuple(positions.shape)} do not fit")
    if tokens == 0:
        return
    _kv_write_kernel[(tokens, heads)](
        keys, values, k, v, rows, positions, keys.stride(0), keys.stride(1), keys.stride(2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), DIM=dim, BLOCK=triton.next_power_of_2(dim), num_warps=1,
    )
