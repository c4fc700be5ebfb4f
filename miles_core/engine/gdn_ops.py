"""Gated DeltaNet kernels of the lean forward: batched decode step and chunked prefill (packed or padded).

Decode (one token per row) updates the rows' causal-conv windows and recurrent states *in place*
(``conv`` ``[n, kernel, channels]``, ``state`` ``[n, v_heads, k_dim, v_dim]``, views of the
engine's slot tensors), so a step needs no gather and no scatter. The state is fp32 unless the
engine stores it in bf16 (``gdn_state_dtype``); every update computes in fp32 and rounds once to
the stored dtype. On CUDA with fla importable the
recurrent update is fla's fused kernel; elsewhere it is written out in torch with the arithmetic
of transformers' ``torch_recurrent_gated_delta_rule`` (the reference the engine is tested
against).

Prefill runs a batch of segments. With fla on CUDA they stay packed: the conv gathers each
token's inputs (:func:`conv_prefill_taps`), the recurrence runs through fla's variable-length
kernels (:func:`chunk_prefill_packed`, or for short segments :func:`fla_recurrent_step` with
``cu_seqlens``), one initial state per segment; otherwise they are right-padded to a common
length. Padding positions get ``g = 0`` (no decay) and ``beta = 0`` (no write), so the recurrent
state a segment ends with is exactly the state after its last real token, whatever the padding;
the causal convolution cannot see padding to the right of a token. Each segment starts from its row's state (zero for a fresh
prompt, the previous chunk's for a continuation), which is what makes chunked prefill exact.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from miles_core.patches.hf_functions import defined_function

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported Gated DeltaNet activation {name!r} (supported: {', '.join(_ACTIVATIONS)})") from None


@functools.cache
def fla_ops() -> ModuleType | None:
    """fla's gated-delta-rule module when it imports (it needs triton and a GPU driver), else ``None``."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None


def require_fla_ops() -> ModuleType:
    """fla's gated-delta-rule module, for a caller that chose fla (:func:`use_fla`)."""
    ops = fla_ops()
    if ops is None:
        raise RuntimeError("fla.ops.gated_delta_rule does not import (fla needs triton and a GPU driver)")
    return ops


def use_fla(t: torch.Tensor) -> bool:
    """Whether ``t``'s kernels go to fla (CUDA tensors, fla importable)."""
    return t.is_cuda and fla_ops() is not None


@functools.cache
def torch_chunk_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """transformers' pure-torch chunked gated delta rule (the function beneath its kernel-hub wrappers,
    which bind fla's Triton kernel whenever fla imports, whatever the device)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    name = "torch_chunk_gated_delta_rule"
    function = defined_function(getattr(modeling_qwen3_5, name), name)
    if function is None:
        raise RuntimeError(f"transformers' modeling_qwen3_5.{name} hides no function of that name")
    return function


def l2norm(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (``eps`` a 0-dim tensor: 1e-6 as transformers and fla)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_decode(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One causal-conv step for every row: ``x`` ``[n, C]``, ``conv`` ``[n, K, C]`` (channels last,
    updated in place: the window now ends with ``x``), ``weight`` ``[C, K]``. Returns the
    pre-activation output ``[n, C]`` in fp32."""
    window = torch.cat([conv[:, 1:], x[:, None, :].to(conv.dtype)], dim=1)
    conv.copy_(window)
    out = (window.float() * weight.t().float()).sum(1)
    return out if bias is None else out + bias.float()


def conv_prefill(
    x: torch.Tensor, conv: torch.Tensor, lengths: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over right-padded segments: ``x`` ``[S, L, C]``, ``conv`` ``[S, K, C]`` the window
    each segment continues from (zeros for a fresh one), ``lengths`` ``[S]`` real tokens per segment.

    Returns the pre-activation output ``[S, L, C]`` (fp32) and each segment's new window ``[S, K, C]``:
    its last ``K`` real inputs, preceded by the old window where the segment is shorter than ``K``.
    Written as ``K`` shifted multiply-adds (channels last, no transposes), which one CPU thread runs
    several times faster than a depthwise ``conv1d``.
    """
    width, kernel = x.shape[1], weight.shape[-1]
    full = torch.cat([conv.to(x.dtype), x], dim=1)  # [S, K + L, C]
    full32, w = full.float(), weight.float()
    out = full32[:, 1 : 1 + width] * w[:, 0]
    for j in range(1, kernel):
        out = torch.addcmul(out, full32[:, 1 + j : 1 + j + width], w[:, j])
    if bias is not None:
        out = out + bias.float()
    index = (lengths[:, None, None] + torch.arange(kernel, device=x.device)[:, None]).expand(-1, -1, x.shape[2])
    return out, full.gather(1, index).to(conv.dtype)


#: ``(q, k, v, g, beta, state, cu_seqlens=None, fresh=False) -> out``: the recurrence over one token
#: per row (decode) or over packed segments (``cu_seqlens``), ``state`` (one per row or segment)
#: updated in place; ``fresh``: every segment starts from a zero state (``state`` is not read)
FlaStep = Callable[..., torch.Tensor]


def recurrent_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    eps: torch.Tensor, sqrt_dk: torch.Tensor, fla_step: FlaStep | None = None,
) -> torch.Tensor:
    """One gated-delta-rule step per row, ``state`` ``[n, Hv, Dk, Dv]`` updated in place: computed in
    fp32 and stored in the state's dtype (one rounding per step where that is not fp32).

    ``q``/``k`` ``[n, Hk, Dk]``, not yet normalised; ``v`` ``[n, Hv, Dv]``, ``g``/``beta``
    ``[n, Hv]``; ``eps`` the l2norm epsilon and ``sqrt_dk`` the query scale's inverse (0-dim
    tensors). Value head ``j`` reads key head ``j // (Hv // Hk)`` (transformers'
    ``repeat_interleave``). Returns ``[n, Hv, Dv]``: fp32 in torch, ``v``'s dtype from fla's kernel
    (``fla_step``, :func:`fla_recurrent_step`), which computes in fp32 and rounds its output.
    """
    if fla_step is not None:
        return fla_step(q, k, v, g, beta, state)
    n, hk, dk = k.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    q = l2norm(q.float(), eps) / sqrt_dk
    k = l2norm(k.float(), eps)
    stored = state.view(n, hk, rep, dk, dv)
    s = stored if stored.dtype == torch.float32 else stored.float()
    s.mul_(g.exp().view(n, hk, rep, 1, 1))
    memory = (s * k.reshape(n, hk, 1, dk, 1)).sum(-2)  # [n, hk, rep, dv]
    delta = (v.float().view(n, hk, rep, dv) - memory) * beta.float().view(n, hk, rep, 1)
    s.addcmul_(k.reshape(n, hk, 1, dk, 1), delta[:, :, :, None, :])
    if s is not stored:
        stored.copy_(s)
    return (s * q.reshape(n, hk, 1, dk, 1)).sum(-2).view(n, hv, dv)


def fla_recurrent_step() -> FlaStep:
    """fla's recurrent kernel as the engine calls it, resolved once (the engine's forward calls the
    result inside a CUDA graph or a compiled region, where no lookup should run): in place when
    fla's kernel takes the parameters this module passes, else through fla's public entry point."""
    require_fla_ops()
    kernel = _fla_recurrent_kernel()
    return _fla_entry_point if kernel is None else functools.partial(_fla_in_place, kernel, _ZeroStates())


class _ZeroStates:
    """Zero initial states for segments that start over, read by fla's kernel and never written.

    Given no initial state, fla's kernel starts from a zero tile in registers, and Triton compiles
    that variant into a slower loop: a prefill of 64 segments (16-48 tokens, small-gpu shapes, this
    module's tile) took 495 us a layer without an initial state and 266 us loading one of zeros
    (fp32 states; bf16 476 / 270 us; 100-300 tokens 3.0 / 1.5 ms; H100, 2026-12-07). Loading zeros
    costs one read of a buffer that every layer shares; clearing the rows' own states first would
    also write them. ``benchmarks/gdn_prefill_kernels.py --fresh`` times the step against fla's
    entry point given no initial state."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def like(self, states: torch.Tensor) -> torch.Tensor:
        """Zeros of ``states``' shape and dtype: a view of one buffer, grown to the largest batch seen
        (a model's states keep one dtype and row shape; another one replaces the buffer)."""
        buffer = self._buffer
        if (buffer is None or buffer.shape[0] < states.shape[0] or buffer.shape[1:] != states.shape[1:]
                or buffer.dtype != states.dtype or buffer.device != states.device):
            buffer = self._buffer = torch.zeros_like(states, memory_format=torch.contiguous_format)
        return buffer[: states.shape[0]]


#: value-axis tile and warps of fla's recurrent kernel: ``(block_v, num_warps)``, for a decode step
#: (one token per row) and for a packed prefill. Each program keeps one ``[Dk, block_v]`` tile of one
#: row's state in registers. H100, small-gpu shape, fp32 state (2026-12-06, tiles 8-128 x 1-8 warps):
#: decode at batch 64 [K, 32] with two warps 52 us a layer (128-byte rows of state per load), fla's
#: own [K, 8] with one warp 61 us, an in-place multiply of the same state 48 us; a prefill of 64
#: segments of 16-48 tokens [K, 16] with one warp 0.26 ms, [K, 32] x 2 0.32 ms, fla's 0.36 ms (the
#: same order at 256 segments, at 100-300 tokens and with bf16 states): a program walks its segment
#: token by token, and narrower tiles put more programs on the machine for that serial walk.
DECODE_TILE = (32, 2)
PREFILL_TILE = (16, 1)


def _fla_in_place(
    kernel: Any, zeros: _ZeroStates, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor | None = None, fresh: bool = False,
) -> torch.Tensor:
    if not state.is_contiguous():
        return _fla_entry_point(q, k, v, g, beta, state, cu_seqlens, fresh)
    # fla's kernel with the state as both its initial and its final state: each program loads one
    # [K, BV] tile of one row's (or segment's) state, runs its tokens and stores the tile where it
    # read it, and no two programs share a tile, so updating in place is exact and moves the state
    # once (the state is most of a decode step's memory traffic: 18 MB per row in small-gpu)
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    sequences = tokens if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_v, warps = DECODE_TILE if cu_seqlens is None else PREFILL_TILE
    block_v = min(block_v, 1 << (dv - 1).bit_length())
    out = torch.empty((tokens, hv, dv), dtype=v.dtype, device=v.device)
    kernel[(-(-dv // block_v) * sequences * hv,)](
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), gk=None, gv=None,
        beta=beta.contiguous(), A_log=None, dt_bias=None, o=out, h0=zeros.like(state) if fresh else state, ht=state, cu_seqlens=cu_seqlens,
        scale=dk**-0.5, T=1 if cu_seqlens is None else tokens, H=hk, HV=hv, K=dk, V=dv,
        BK=1 << (dk - 1).bit_length(), BV=block_v, IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True,
        APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False, num_warps=warps, num_stages=1,
    )
    return out


def _fla_entry_point(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, fresh: bool = False,
) -> torch.Tensor:
    """The same recurrence through fla's public entry point, which returns a new final state (one
    more read and write of every state); the arguments transformers' GDN layer passes it. Decode
    runs a batch of one-token sequences, a prefill one packed sequence of segments."""
    unsqueeze = (lambda t: t[:, None]) if cu_seqlens is None else (lambda t: t[None])
    out, final = require_fla_ops().fused_recurrent_gated_delta_rule(
        q=unsqueeze(q), k=unsqueeze(k), v=unsqueeze(v), g=unsqueeze(g), beta=unsqueeze(beta),
        scale=k.shape[-1] ** -0.5, initial_state=None if fresh else state.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}),
    )
    state.copy_(final)
    return out[:, 0] if cu_seqlens is None else out[0]


#: the parameters of fla's recurrent forward kernel the in-place step passes (fla 0.6)
_KERNEL_PARAMETERS = frozenset({
    "q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens", "scale", "T", "H",
    "HV", "K", "V", "BK", "BV", "IS_BETA_HEADWISE", "USE_QK_L2NORM_IN_KERNEL", "APPLY_BETA_SIGMOID",
    "ALLOW_NEG_EIGVAL", "STATE_V_FIRST",
})


@functools.cache
def _fla_recurrent_kernel() -> Any | None:
    """fla's fused recurrent forward kernel when its parameters are the ones this module passes
    (another fla release takes the public entry point instead)."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule.fused_recurrent")
        kernel = module.fused_recurrent_gated_delta_rule_fwd_kernel
        names = set(kernel.arg_names)
    except (ImportError, AttributeError):
        return None
    return kernel if names >= _KERNEL_PARAMETERS else None


def _cpu_seqlens(cu_seqlens_cpu: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """``cu_seqlens_cpu`` for fla releases that take it (it spares them a device-to-host copy)."""
    if cu_seqlens_cpu is None:
        return {}
    return {"cu_seqlens_cpu": cu_seqlens_cpu} if "cu_seqlens_cpu" in _chunk_parameters() else {}


@functools.cache
def _chunk_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(require_fla_ops().chunk_gated_delta_rule).parameters)


def torch_chunk_size(width: int) -> int:
    """Chunk length of the torch prefill for segments ``width`` long. Work inside a chunk is
    quadratic in its length, padding fills the last chunk, and chunks run one after another: short
    prompts (GRPO's, chat turns) are cheapest in chunks of 16, long ones in transformers' 64."""
    return 16 if width <= 128 else 32 if width <= 512 else 64


def conv_taps(cu_seqlens: torch.Tensor, tokens: int, kernel: int) -> torch.Tensor:
    """Where each packed token's ``kernel`` conv inputs (oldest first) sit in ``cat([windows.flatten(0,
    1), x])``: ``[T, kernel]`` indices, for segments ``cu_seqlens`` ``[S + 1]`` of ``tokens`` (``T``)
    new inputs ``x`` ``[T, C]`` continuing the rows' stored windows ``[S, kernel, C]``. Input ``p``
    of segment ``s`` is ``x[cu[s] + p]``, or ``windows[s, kernel + p]`` before the segment (``p < 0``).
    A segment's new window is its last token's taps."""
    device = cu_seqlens.device
    segments = cu_seqlens.shape[0] - 1
    segment = torch.repeat_interleave(torch.arange(segments, device=device), cu_seqlens.diff(), output_size=tokens)
    first = cu_seqlens[segment][:, None]  # [T, 1]: each token's segment start
    p = torch.arange(tokens, device=device)[:, None] - first - (kernel - 1) + torch.arange(kernel, device=device)
    return torch.where(p >= 0, segments * kernel + first + p, segment[:, None] * kernel + kernel + p)


def conv_prefill_taps(
    x: torch.Tensor, windows: torch.Tensor, taps: torch.Tensor, window_taps: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv_prefill` on packed segments: ``x`` ``[T, C]``, ``windows`` ``[S, K, C]`` the
    windows the segments continue from, ``taps`` ``[T, K]`` (:func:`conv_taps`) and ``window_taps``
    ``[S, K]`` (the taps of each segment's last token). Returns the pre-activation output ``[T, C]``
    (fp32: the ``K`` products summed oldest first, then the bias) and the new windows ``[S, K, C]``.
    A gather per tap and no padding: a compiled region fuses it into one kernel."""
    source = torch.cat([windows.flatten(0, 1).to(x.dtype), x])
    w = weight.float()
    out = source[taps[:, 0]].float() * w[:, 0]
    for j in range(1, weight.shape[-1]):
        out = torch.addcmul(out, source[taps[:, j]].float(), w[:, j])
    if bias is not None:
        out = out + bias.float()
    return out, source[window_taps].to(windows.dtype)


def chunk_prefill_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None,
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_prefill` on packed segments through fla's chunked kernel: ``q``/``k`` ``[T, Hk,
    Dk]``, ``v`` ``[T, Hv, Dv]``, ``g``/``beta`` ``[T, Hv]``, ``state`` ``[S, Hv, Dk, Dv]`` fp32 (``None``: zeros).
    Returns the output ``[T, Hv, Dv]`` and the final states ``[S, Hv, Dk, Dv]`` (fp32). (Short
    segments take fla's recurrent kernel instead: :func:`fla_recurrent_step` with ``cu_seqlens``.)"""
    out, final = require_fla_ops().chunk_gated_delta_rule(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=k.shape[-1] ** -0.5,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
        **_cpu_seqlens(cu_seqlens_cpu),
    )
    return out[0], final.float()


def chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    packed_index: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over right-padded segments.

    ``q``/``k`` ``[S, L, Hk, Dk]``, ``v`` ``[S, L, Hv, Dv]``, ``g``/``beta`` ``[S, L, Hv]``, ``state``
    ``[S, Hv, Dk, Dv]`` fp32 (each segment's initial state; ``None``: zeros), zero ``g`` and ``beta`` in the padding;
    ``packed_index`` ``[T]`` the flat positions of the real tokens in ``S * L``. Returns the output of the real tokens,
    packed ``[T, Hv, Dv]``, and the final states ``[S, Hv, Dk, Dv]`` (fp32).

    On CUDA with fla the segments run packed through fla's variable-length kernel (``cu_seqlens``);
    otherwise through transformers' torch implementation on the padded batch.
    """
    if use_fla(q):
        def packed(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])[packed_index]

        return chunk_prefill_packed(packed(q), packed(k), packed(v), packed(g), packed(beta), state, cu_seqlens,
                                    cu_seqlens_cpu)
    rep = v.shape[-2] // k.shape[-2]
    if rep > 1:  # value heads share key heads: expanded as transformers' layer does (its 5.17 rule needs it)
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    out, final = torch_chunk_rule()(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        chunk_size=torch_chunk_size(q.shape[1]),
    )
    if final is None:
        raise RuntimeError("transformers' torch_chunk_gated_delta_rule returned no final state")
    return out.reshape(-1, *out.shape[2:])[packed_index], final
