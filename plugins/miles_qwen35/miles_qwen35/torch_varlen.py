"""Pure-torch variable-length kernels for Gated DeltaNet: the CPU path (and wherever fla is absent).

Both take the segment index of every token (``seq_idx``, ``[B, T]``) and keep segments apart
exactly: the causal convolution never reads across a boundary, and the recurrent state restarts
from zero at every segment start. They cost about what the boundary-blind reference kernels cost
on the same packed row (``benchmarks/gdn_packing.py``): the chunked delta rule below is
transformers' chunked algorithm with segment masks in place of the causal mask, so no work grows
with the number of segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    seq_idx: torch.Tensor,
) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` (``[B, D, T]``) with ``weight`` (``[D, K]``) per segment.

    Output ``t`` sums ``weight[:, K - 1 - s] * x[t - s]`` over the shifts ``s`` whose source token
    lies in the same segment as ``t``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r} (supported: silu, swish, None)")
    dtype = x.dtype
    x = x.to(weight.dtype)
    seq_len, width = x.shape[-1], weight.shape[-1]
    out = x * weight[:, -1:]
    for shift in range(1, min(width, seq_len)):
        same = (seq_idx[:, shift:] == seq_idx[:, :-shift]).unsqueeze(1)
        shifted = F.pad(x[..., :-shift] * same, (shift, 0))
        out = out + shifted * weight[:, width - 1 - shift : width - shift]
    if bias is not None:
        out = out + bias[:, None]
    act = _ACTIVATIONS[activation]
    return (act(out) if act is not None else out).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seq_idx: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The gated delta rule over every segment of a packed batch, each from a zero state.

    Shapes as transformers' kernels: ``query``/``key`` ``[B, T, Hk, Dk]``, ``value``
    ``[B, T, Hv, Dv]``, ``g``/``beta`` ``[B, T, Hv]``; returns ``[B, T, Hv, Dv]`` in the input
    dtype. Rows are flattened into one sequence (every row start is a segment start).
    """
    batch, seq_len, num_k_heads, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    if num_v_heads != num_k_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [H, B*T, ...] in fp32
        return x.reshape(batch * seq_len, num_v_heads, -1).transpose(0, 1).float()

    q, k, v = heads_first(query), heads_first(key), heads_first(value)
    b, decay = heads_first(beta).squeeze(-1), heads_first(g).squeeze(-1)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * k_dim**-0.5

    total = batch * seq_len
    pad = (chunk_size - total % chunk_size) % chunk_size
    seg = seq_idx.reshape(-1)
    seg = torch.cat([seg, seg[-1:].expand(pad)]).view(-1, chunk_size)  # padding joins the last segment
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(num_v_heads, -1, chunk_size, x.shape[-1]) for x in (q, k, v))
    b, decay = (F.pad(x, (0, pad)).view(num_v_heads, -1, chunk_size) for x in (b, decay))
    num_chunks = seg.shape[0]

    # Which pairs (i, j) of a chunk interact: j <= i within one segment.
    same = seg.unsqueeze(2) == seg.unsqueeze(1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=seg.device).tril()
    pair_mask = same & causal
    # Positions that read the state carried into the chunk: the chunk continues the segment of the
    # previous chunk's last token, and the position belongs to that first segment.
    continues = torch.zeros(num_chunks, dtype=torch.bool, device=seg.device)
    continues[1:] = seg[1:, 0] == seg[:-1, -1]
    reads_state = (seg == seg[:, :1]) & continues[:, None]
    # Positions that write the state carried out of the chunk: those in its last segment.
    writes_state = seg == seg[:, -1:]
    carries_state = continues & (seg[:, 0] == seg[:, -1])

    cum = decay.cumsum(-1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~pair_mask, float("-inf")).exp()
    k_beta, v_beta = k * b.unsqueeze(-1), v * b.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_state_decay = torch.linalg.solve_triangular(
        system, k_beta * (cum.exp() * reads_state).unsqueeze(-1), upper=False, unitriangular=True
    )
    q_state = q * (cum.exp() * reads_state).unsqueeze(-1)
    k_carry = k * ((cum[..., -1:] - cum).exp() * writes_state).unsqueeze(-1)
    chunk_decay = (cum[..., -1].exp() * carries_state).unsqueeze(-1).unsqueeze(-1)
    intra = (q @ k.transpose(-1, -2)) * pair_decay

    state = q.new_zeros(num_v_heads, k_dim, v_dim)
    out = []
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_state_decay[:, i] @ state
        out.append(q_state[:, i] @ state + intra[:, i] @ v_new)
        state = state * chunk_decay[:, i] + k_carry[:, i].transpose(-1, -2) @ v_new
    core = torch.stack(out, dim=1).reshape(num_v_heads, -1, v_dim)[:, :total]
    return core.transpose(0, 1).reshape(batch, seq_len, num_v_heads, v_dim).to(value.dtype)
