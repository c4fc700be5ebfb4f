"""Pure-torch variable-length kernels for Gated DeltaNet: the CPU path (and wherever fla is absent).

Both take the segment index of every token (``seq_idx``, ``[B, T]``) and keep segments apart
exactly: the causal convolution never reads across a boundary, and the recurrent state restarts
from zero at every segment start. They cost about what the boundary-blind reference kernels cost
on the same packed row (``benchmarks/gdn_packing.py``): the chunked delta rule below is
transformers' chunked algorithm with segment masks in place of the causal mask, so no work grows
with the number of segments.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from miles_core.patches.packing import PackedSequences

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


# -- rows with shared prompts (PackedSequences.branches) ---------------------------------------
#
# A branch segment continues the first ``prefix`` tokens of its root: the causal convolution of
# its first tokens reads the prompt's last inputs, and its recurrent state starts from the state
# the prompt ends in. Both are computed from the prompt once, however many branches share it.


def _segment_table(ctx: PackedSequences) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
    bounds = ctx.cu_seqlens_cpu.tolist()
    segments = list(itertools.pairwise(bounds))
    branches = {start: (root, prefix) for start, root, prefix in ctx.branches or ()}
    return segments, branches


def causal_conv1d_branched(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    ctx: PackedSequences,
) -> torch.Tensor:
    """:func:`causal_conv1d` over a row whose branch segments read their root's prompt before them
    (``x`` ``[1, D, T]``)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r} (supported: silu, swish, None)")
    if x.shape[0] != 1:
        raise ValueError("rows with shared prompts are flattened into one row")
    total, width = x.shape[-1], weight.shape[-1]
    segments, branches = _segment_table(ctx)
    start = torch.empty(total, dtype=torch.long)
    root = torch.full((total,), -1, dtype=torch.long)
    prefix = torch.zeros(total, dtype=torch.long)
    for s, e in segments:
        start[s:e] = s
        if s in branches:
            root[s:e], prefix[s:e] = branches[s]
    t = torch.arange(total)
    offset = t - start
    dtype = x.dtype
    padded = F.pad(x.to(weight.dtype), (0, 1))  # index ``total`` reads a zero
    out = padded[..., :total] * weight[:, -1:]
    for shift in range(1, width):
        back = prefix - (shift - offset)  # the prompt position a branch token reads at this shift
        source = torch.where(offset >= shift, t - shift,
                             torch.where((root >= 0) & (back >= 0), root + back, torch.full_like(t, total)))
        out = out + padded[..., source.to(x.device)] * weight[:, width - 1 - shift : width - shift]
    if bias is not None:
        out = out + bias[:, None]
    act = _ACTIVATIONS[activation]
    return (act(out) if act is not None else out).to(dtype)


def _buckets(lengths: list[int]) -> dict[int, list[int]]:
    """Sequence indices by power-of-two length class (a padded batch wastes at most half)."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        out.setdefault(1 << max(n - 1, 0).bit_length(), []).append(i)
    return out


def chunk_gated_delta_rule_branched(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: PackedSequences,
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    *,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The gated delta rule over a row with shared prompts, through transformers' own chunked
    kernel (``reference``) on padded batches: first every prompt and every segment without branches
    (prompts keep their final state), then every response from its prompt's final state.

    Padding is appended with ``beta = 0`` and ``g = 0``, a step that leaves the state unchanged, so a
    padded prompt ends in its own final state."""
    if query.shape[0] != 1:
        raise ValueError("rows with shared prompts are flattened into one row")
    segments, branches = _segment_table(ctx)
    roots = {root: prefix for root, prefix in branches.values()}
    heads: list[tuple[int, int]] = []  # (start, end): prompts of shared groups, and whole segments
    prompt_of: dict[int, int] = {}  # root start -> index in heads
    tails: list[tuple[int, int, int]] = []  # (start, end, index of its prompt in heads)
    for s, e in segments:
        if s in branches:
            root, _ = branches[s]
            tails.append((s, e, prompt_of[root]))
        elif s in roots:
            prompt_of[s] = len(heads)
            heads.append((s, s + roots[s]))
            tails.append((s + roots[s], e, prompt_of[s]))
        else:
            heads.append((s, e))
    tensors = (query[0], key[0], value[0], g[0], beta[0])

    def run(
        spans: list[tuple[int, int]], initial: torch.Tensor | None, final: bool
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Outputs (and final states) of ``spans``, each as its own sequence, in bucketed batches."""
        outputs: list[torch.Tensor | None] = [None] * len(spans)
        states: list[torch.Tensor | None] = [None] * len(spans)
        for width, members in _buckets([e - s for s, e in spans]).items():
            index = torch.cat([torch.arange(s, e) for s, e in (spans[i] for i in members)])
            lengths = torch.tensor([spans[i][1] - spans[i][0] for i in members])
            rows = torch.repeat_interleave(torch.arange(len(members)), lengths)
            cols = torch.cat([torch.arange(n) for n in lengths.tolist()])
            batch = []
            for tensor in tensors:
                padded = tensor.new_zeros((len(members), width, *tensor.shape[1:]))
                batch.append(padded.index_put((rows, cols), tensor.index_select(0, index.to(tensor.device))))
            q, k, v, decay, b = batch
            init = None if initial is None else initial.index_select(0, torch.tensor(members, device=initial.device))
            # a batch of short sequences takes short chunks: the kernel pads every sequence to a chunk
            out, state = reference(q, k, v, g=decay, beta=b, chunk_size=min(chunk_size, width), initial_state=init,
                                   output_final_state=final, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            for j, i in enumerate(members):
                outputs[i] = out[j, : spans[i][1] - spans[i][0]]
                if final:
                    if state is None:
                        raise RuntimeError("the chunked gated delta rule returned no final state, though asked for it")
                    states[i] = state[j]
        return outputs, states

    head_out, head_states = run(heads, None, True)
    finals = torch.stack([s for s in head_states if s is not None]) if heads else None
    tail_out, _ = run([(s, e) for s, e, _ in tails], None if finals is None else finals[[p for _, _, p in tails]], False)
    spans = heads + [(s, e) for s, e, _ in tails]
    order = torch.cat([torch.arange(s, e) for s, e in spans]).to(query.device)
    flat = torch.cat([o for o in (*head_out, *tail_out) if o is not None])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return flat.index_select(0, inverse)[None]
