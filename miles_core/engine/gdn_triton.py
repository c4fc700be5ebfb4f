"""The GDN decode step's causal conv as one Triton kernel (CUDA only: imported where fla runs).

Compiled from torch (:func:`gdn_ops.conv_decode`, SiLU, the q/k/v split and the copies fla's kernel
needs), one decode step's conv is six kernels a layer: the output, the shifted window built in a
buffer and copied back into the slot (the slot is read and written, so the compiler cannot shift it
in place), and one copy per q, k and v. ~11 us of a small-gpu step's 2.5 ms per GDN layer on an
H100 (2026-12-06 profile). Here each program owns one row's block of channels: it loads the
window's taps and the new input, shifts the window in place (every element it writes, it has read),
sums the products oldest first in fp32 as :func:`gdn_ops.conv_decode` does, adds the bias, applies
SiLU, rounds once and stores each channel into its own contiguous q, k or v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: channels per program (small-gpu: 4,096 channels, 8 programs per row)
BLOCK = 512


@triton.jit
def _conv_step_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are tl.constexpr markers
    x, conv, weight, bias, q, k, v,
    stride_x, stride_row, stride_tap, stride_wc, stride_wk,
    CHANNELS: tl.constexpr, KEY: tl.constexpr, VALUE: tl.constexpr, TAPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
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


def conv_step(
    x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key_width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal-conv step and SiLU for every row: ``x`` ``[n, C]`` (rows may be strided: a slice of
    the fused projection), ``conv`` ``[n, K, C]`` (updated in place), ``weight`` ``[C, K]``. Returns
    q ``[n, key_width]``, k ``[n, key_width]`` and v ``[n, C - 2 * key_width]``, contiguous, in
    ``x``'s dtype."""
    n, channels = x.shape
    taps = conv.shape[1]
    if x.stride(-1) != 1 or conv.stride(-1) != 1 or conv.shape[2] != channels or weight.shape != (channels, taps):
        raise ValueError(f"conv_step: x {tuple(x.shape)}/{x.stride()}, conv {tuple(conv.shape)}/{conv.stride()}, "
                         f"weight {tuple(weight.shape)} do not fit")
    value_width = channels - 2 * key_width
    q = torch.empty((n, key_width), dtype=x.dtype, device=x.device)
    k = torch.empty((n, key_width), dtype=x.dtype, device=x.device)
    v = torch.empty((n, value_width), dtype=x.dtype, device=x.device)
    _conv_step_kernel[(n, triton.cdiv(channels, BLOCK))](
        x, conv, weight, bias if bias is not None else weight, q, k, v,
        x.stride(0), conv.stride(0), conv.stride(1), weight.stride(0), weight.stride(1),
        CHANNELS=channels, KEY=key_width, VALUE=value_width, TAPS=taps, HAS_BIAS=bias is not None, BLOCK=BLOCK,
        num_warps=4,
    )
    return q, k, v
