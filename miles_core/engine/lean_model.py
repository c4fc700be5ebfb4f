"""The engine's own forward (decode step and chunked prefill) for the architectures it knows.

It reads the Hugging Face model's own parameter tensors at every call (nothing is copied:
projections that read the same input become row slices of one buffer, see :class:`_Fused`), so
a weight update copied into the model is seen at once, and a CUDA graph captured over it keeps
reading the same memory. The arithmetic is that of the Hugging Face modules; the engine's tests
compare every generated log-prob with a teacher-forced forward of the Hugging Face model.

Supported: ``Qwen3_5ForCausalLM`` (Gated DeltaNet + gated full attention, Qwen3.5 text models),
``Qwen3ForCausalLM`` (dense attention with per-head q/k norms) and ``LlamaForCausalLM`` (dense
attention), with SiLU MLPs and a position-independent RoPE.
:func:`unsupported_reason` says why any other model takes the Hugging Face path
(:class:`~miles_core.engine.runner.HFRunner`).

Shapes: a decode step runs rows ``[0, n)`` of :class:`~miles_core.engine.state.SlotState`, one token
each. A prefill runs ``S`` segments (row, first position, tokens), packed ``[T, hidden]`` for the
token-wise layers and right-padded ``[S, L, ...]`` for the sequence mixers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from miles_core.engine import gdn_ops
from miles_core.engine.state import SlotState, StateShapes
from miles_core.hardware.devices import device_supports

#: a packed prefill runs the GDN recurrence through fla's recurrent kernel when its segments are at
#: most this long and it has at most RECURRENT_PREFILL_TOKENS tokens (see
#: :attr:`LeanModel.recurrent_prefill_width`). H100, one layer, 64 segments
#: (``benchmarks/gdn_prefill_kernels.py``): the recurrent kernel, launched in place, wins at 16-48
#: tokens (0.38 vs 0.73 ms wall: one launch against the chunked form's seven, whose host time bounds
#: it) and loses from ~100 tokens on (2.0 vs 0.91 ms at 100-300, 9.9 vs 2.6 ms at 500-1500; measured
#: with [K, 32] value tiles, the engine's [K, 16] takes ~20 % less GPU time: gdn_ops.PREFILL_TILE).
RECURRENT_PREFILL_WIDTH = 64
#: its GPU time grows with the tokens ([K, 16] tiles: 0.26 ms at 2,110, 0.89 ms at 7,854 in 256
#: segments) past the chunked form's (0.20 / 0.67 ms): where a prefill is big enough to keep the GPU
#: busy, the chunked kernel's lower GPU time wins
RECURRENT_PREFILL_TOKENS = 4096
_STATIC_ROPE = frozenset({"default", "linear", "yarn", "llama3"})
_ARCHITECTURES = {
    # class name -> (decoder layer class, attention class, GDN class, MLP class, zero-centred norms, gated attention)
    "Qwen3_5ForCausalLM": ("Qwen3_5DecoderLayer", "Qwen3_5Attention", "Qwen3_5GatedDeltaNet", "Qwen3_5MLP", True, True),
    "Qwen3ForCausalLM": ("Qwen3DecoderLayer", "Qwen3Attention", None, "Qwen3MLP", False, False),
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", None, "LlamaMLP", False, False),
}


def unsupported_reason(model: Any) -> str | None:
    """Why the lean forward cannot run ``model`` (``None`` when it can)."""
    name = type(model).__name__
    if name not in _ARCHITECTURES:
        return f"{name} has no lean forward (supported: {', '.join(_ARCHITECTURES)})"
    layer_cls, attn_cls, gdn_cls, mlp_cls, _, _ = _ARCHITECTURES[name]
    config = model.config
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {config.hidden_act!r} (the lean forward has SiLU MLPs)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    for index, layer in enumerate(model.model.layers):
        if type(layer).__name__ != layer_cls:
            return f"layer {index} is a {type(layer).__name__}, not a {layer_cls}"
        mixer = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
        if type(mixer).__name__ not in (attn_cls, gdn_cls) or type(layer.mlp).__name__ != mlp_cls:
            return f"layer {index} has a {type(mixer).__name__} / {type(layer.mlp).__name__}"
        if getattr(mixer, "sliding_window", None):
            return f"layer {index} uses sliding-window attention"
        if hasattr(layer, "linear_attn") and getattr(mixer, "activation", "silu") not in ("silu", "swish"):
            return f"layer {index}'s Gated DeltaNet uses activation {getattr(mixer, 'activation', None)!r}"
    return None


@dataclass
class _Norm:
    weight: torch.Tensor
    zero_centred: bool  # Qwen3.5: x * (1 + w) in fp32; Qwen3: w * x in the input dtype
    eps: torch.Tensor  # 0-dim fp32 (tensor operands: a Python scalar costs a conversion per op)
    inv_dim: torch.Tensor
    eps_value: float
    #: through ``F.rms_norm`` (CUDA: one fused kernel instead of six elementwise ones)
    fused: bool = False


def _norm(module: Any, zero_centred: bool) -> _Norm:
    eps = module.eps if hasattr(module, "eps") else module.variance_epsilon
    weight = module.weight
    return _Norm(weight, zero_centred, _const(eps, weight.device), _const(1.0 / weight.shape[-1], weight.device), float(eps))


def _const(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """HF's RMSNorm in fp32: ``x * rsqrt(mean(x^2) + eps)``, then ``* (1 + w)`` or ``w *``."""
    xf = _fp32(x)
    if norm.fused:
        d = (xf.shape[-1],)
        if not norm.zero_centred:
            return norm.weight * F.rms_norm(xf, d, eps=norm.eps_value).to(x.dtype)
        scale = 1.0 + _fp32(norm.weight)
        if scale.dim() == 1:
            return F.rms_norm(xf, d, weight=scale, eps=norm.eps_value).to(x.dtype)
        return (F.rms_norm(xf, d, eps=norm.eps_value) * scale).to(x.dtype)  # per-head weights (q/k norms)
    y = xf * torch.rsqrt(torch.addcmul(norm.eps, (xf * xf).sum(-1, keepdim=True), norm.inv_dim))
    if norm.zero_centred:
        y = torch.addcmul(y, y, _fp32(norm.weight))  # y * (1 + w)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return norm.weight * (y if y.dtype == x.dtype else y.to(x.dtype))


class _Fused:
    """Linear layers that read the same input, computed as one matmul split into their outputs.

    Their Hugging Face parameters are re-pointed at consecutive row slices of one buffer (same
    values, same ``Parameter`` objects): a weight update copied into a parameter lands in the
    buffer, and nothing is duplicated. ``save_pretrained`` clones such disjoint slices when saving.
    Layers that cannot share a buffer (different dtypes, some with a bias and some without) stay
    separate matmuls. Holds tensors only (no modules), so a compiled region reading it sees inputs.
    """

    def __init__(self, modules: list[Any]) -> None:
        self.sizes = [m.weight.shape[0] for m in modules]
        weights = [m.weight for m in modules]
        biases = [m.bias for m in modules]
        same_kind = all(w.dtype == weights[0].dtype and w.device == weights[0].device and w.dim() == 2
                        and w.shape[1] == weights[0].shape[1] and w.is_contiguous() for w in weights)
        self.fused = same_kind and all(b is None for b in biases) == any(b is None for b in biases)
        if self.fused:
            self.weights: list[torch.Tensor] = [_shared_rows(weights)]
            self.biases: list[torch.Tensor | None] = [None if biases[0] is None else _shared_rows(biases)]
        else:
            self.weights, self.biases = weights, biases

    @property
    def weight(self) -> torch.Tensor | None:
        """The shared buffer (``None`` when the layers stay separate)."""
        return self.weights[0] if self.fused else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused:
            return list(F.linear(x, self.weights[0], self.biases[0]).split(self.sizes, dim=-1))
        return [F.linear(x, w, b) for w, b in zip(self.weights, self.biases)]


def _shared_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose consecutive row blocks are ``params`` (re-pointing them at it, unless they
    already are such blocks: a second engine on the same model reuses the first one's buffer)."""
    first = params[0].data
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    row_size = first[0].numel() if first.dim() > 1 else 1
    offset = first.storage_offset()
    consecutive = True
    for p in params:
        data = p.data
        if data.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or data.storage_offset() != offset:
            consecutive = False
            break
        offset += data.numel()
    if consecutive and offset - first.storage_offset() == rows * row_size:
        return first.as_strided(shape, torch.empty(shape, device="meta").stride())
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = fused[start : start + p.shape[0]]
            start += p.shape[0]
    return fused


@dataclass
class _Attention:
    index: int  # among attention layers
    qkv: _Fused
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: _Norm | None  # per-head norms (Qwen3, Qwen3.5); Llama has none
    k_norm: _Norm | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # head_dim ** -0.5 (SDPA's argument)
    gated: bool
    scaling: torch.Tensor  # the same, 0-dim fp32 (an operand of the CPU matmul path)

    def qk_norm(self) -> _Norm:
        """``q_norm`` for the query heads and ``k_norm`` for the key heads, as one per-head norm."""
        q, k = self.q_norm, self.k_norm
        assert q is not None and k is not None
        weight = torch.cat([q.weight.expand(self.heads, -1), k.weight.expand(self.kv_heads, -1)])
        return _Norm(weight, q.zero_centred, q.eps, q.inv_dim, q.eps_value, q.fused)


@dataclass
class _GDN:
    index: int  # among GDN layers
    projections: _Fused  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    conv_weight: torch.Tensor  # [channels, kernel] (a view of the depthwise conv's weight)
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: _Norm
    out_weight: torch.Tensor
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    act: Any
    sqrt_dk: torch.Tensor  # 0-dim: decode queries are divided by sqrt(k_dim), as in transformers


@dataclass
class _Layer:
    input_norm: _Norm
    post_norm: _Norm
    mixer: _Attention | _GDN
    gate_up: _Fused
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


# -- token-wise arithmetic, shared by decode and prefill -------------------------------------
# Functions of the layer records (tensors and Python scalars, no modules and no layer index):
# a compiled decode region built from them is traced once and serves every layer of its kind.


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., heads, head_dim]``, ``cos``/``sin`` ``[..., 1, head_dim]``."""
    return x * cos + x[..., rotate] * sin


def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    gate, up = layer.gate_up(x)
    return F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)


def _qkv(
    m: _Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rotated queries ``[T, H, D]``, keys and values ``[T, kvH, D]``, and the output gate."""
    t = x.shape[0]
    q, k, v = m.qkv(x)
    gate = None
    if m.gated:
        q, gate = q.reshape(t, m.heads, 2 * m.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(t, m.heads * m.head_dim)
    q, k = q.reshape(t, m.heads, m.head_dim), k.reshape(t, m.kv_heads, m.head_dim)
    if m.q_norm is None or m.k_norm is None:
        qk = torch.cat([q, k], dim=1)
    elif m.q_norm.eps_value == m.k_norm.eps_value:  # per-head norms of all heads at once
        qk = rms_norm(torch.cat([q, k], dim=1), m.qk_norm())
    else:
        qk = torch.cat([rms_norm(q, m.q_norm), rms_norm(k, m.k_norm)], dim=1)
    qk = _rope(qk, cos[:, None], sin[:, None], rotate)
    return qk[:, : m.heads], qk[:, m.heads :], v.reshape(t, m.kv_heads, m.head_dim), gate


def _attention_out(m: _Attention, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return F.linear(out, m.o_weight, m.o_bias)


def _residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``h + x`` as the Hugging Face layer adds them: in half precision one rounding of the fp32 sum
    of the two rounded terms. Spelled in fp32 so that a compiler cannot fold the add into the
    matmul that produced ``x`` (a cuBLAS ``addmm``: one rounding fewer than the Hugging Face layer,
    and a copy of ``h`` into its output first): it fuses into the kernel that reads the sum next."""
    if h.dtype == torch.float32:
        return h + x
    return (h.float() + x.float()).to(h.dtype)


def _gdn_projections(m: _GDN, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv, z, b, a = m.projections(x)
    beta = torch.sigmoid(b)
    g = -_fp32(m.A_log).exp() * F.softplus(_fp32(a) + m.dt_bias)
    return qkv, z, beta, g


def _gdn_out(m: _GDN, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gated RMSNorm of ``core`` ``[T, Hv, Dv]`` with gate ``z`` ``[T, Hv * Dv]``, then the output projection."""
    t = core.shape[0]
    normed = rms_norm(core if core.dtype == dtype else core.to(dtype), m.norm)
    y = normed * F.silu(_fp32(z.view(t, m.v_heads, m.v_dim)))
    return F.linear((y if y.dtype == dtype else y.to(dtype)).view(t, m.v_heads * m.v_dim), m.out_weight)


def _conv_qkv(m: _GDN, conv_out: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal conv's output (fp32) activated, rounded once to ``dtype`` and split into queries
    ``[..., Hk, Dk]``, keys and values ``[..., Hv, Dv]`` (views)."""
    mixed = m.act(conv_out)
    mixed = mixed if mixed.dtype == dtype else mixed.to(dtype)
    key = m.k_heads * m.k_dim
    lead = mixed.shape[:-1]
    q = mixed[..., :key].reshape(*lead, m.k_heads, m.k_dim)
    k = mixed[..., key : 2 * key].reshape(*lead, m.k_heads, m.k_dim)
    v = mixed[..., 2 * key :].reshape(*lead, m.v_heads, m.v_dim)
    return q, k, v


def _finish(layer: _Layer | None, h: torch.Tensor, mixed: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """The rest of ``layer`` after its sequence mixer, whose output is ``mixed`` (GDN: the
    recurrence's ``[T, Hv, Dv]``, attention: ``[T, H * D]``) with output gate ``gate`` (GDN: ``z``,
    gated attention: its gate, else ``None``): output projection, residual, MLP, residual. ``h`` as
    it is when ``layer`` is ``None`` (before the first layer)."""
    if layer is None:
        return h
    m = layer.mixer
    if isinstance(m, _GDN):
        assert mixed is not None and gate is not None
        h = _residual(h, _gdn_out(m, mixed, gate, h.dtype))
    else:
        assert mixed is not None
        h = _residual(h, _attention_out(m, mixed, gate))
    return _residual(h, _mlp(layer, rms_norm(h, layer.post_norm)))


# -- regions: the token-wise work between two sequence mixers ------------------------------------
# A region finishes the previous layer (``prev``, see _finish) and starts the next one (norm,
# projections and, where it is token-wise, the GDN conv), so that a compiler fuses the residual
# adds into the next norm and a step makes one region call per layer. fla's recurrence, attention
# over the KV cache and the cache writes stay outside (a compiler must not functionalise the slot
# tensors into copies). Functions of the layer records (tensors and Python scalars, no modules and
# no layer index): a compiled region is traced once per kind of (previous, next) layer and serves
# every layer of that kind.

def _gdn_in(prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None, gate: torch.Tensor | None,
            conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Into a GDN layer's decode step: ``h``, then queries ``[n, Hk, Dk]``, keys, values ``[n, Hv,
    Dv]``, ``g``, ``beta`` ``[n, Hv]`` and the gate ``z``, the causal-conv window ``conv`` updated
    in place (on CUDA :func:`_gdn_project_raw` and a Triton kernel instead)."""
    h = _finish(prev, h, mixed, gate)
    m = layer.mixer
    assert isinstance(m, _GDN)
    qkv, z, beta, g = _gdn_projections(m, rms_norm(h, layer.input_norm))
    q, k, v = _conv_qkv(m, gdn_ops.conv_decode(qkv, conv, m.conv_weight, m.conv_bias), h.dtype)
    return h, q, k, v, g, beta, z


def _gdn_project(prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None,
                 gate: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Into a GDN layer's padded prefill: ``h``, ``qkv``, ``z``, ``beta``, ``g``."""
    h = _finish(prev, h, mixed, gate)
    m = layer.mixer
    assert isinstance(m, _GDN)
    return h, *_gdn_projections(m, rms_norm(h, layer.input_norm))


def _gdn_project_raw(prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None,
                     gate: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Into a GDN layer's decode step when the conv and gates are a Triton kernel: ``h`` and the
    projections ``qkv``, ``z``, ``b``, ``a`` (views of one matmul's output)."""
    h = _finish(prev, h, mixed, gate)
    m = layer.mixer
    assert isinstance(m, _GDN)
    return h, *m.projections(rms_norm(h, layer.input_norm))


def _gdn_prefill_in(prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None,
                    gate: torch.Tensor | None, windows: torch.Tensor, taps: torch.Tensor,
                    window_taps: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Into a GDN layer's packed prefill: ``h``, ``q``, ``k``, ``v`` (contiguous), ``g``, ``beta``,
    ``z`` and the segments' new conv windows (``windows`` the ones they continue, ``taps`` and
    ``window_taps`` from :func:`gdn_ops.conv_taps`)."""
    h = _finish(prev, h, mixed, gate)
    m = layer.mixer
    assert isinstance(m, _GDN)
    qkv, z, beta, g = _gdn_projections(m, rms_norm(h, layer.input_norm))
    out, new_windows = gdn_ops.conv_prefill_taps(qkv, windows, taps, window_taps, m.conv_weight, m.conv_bias)
    q, k, v = _conv_qkv(m, out, h.dtype)
    return h, q.contiguous(), k.contiguous(), v.contiguous(), g, beta, z, new_windows


def _attention_in(prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None,
                  gate: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  rotate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Into an attention layer: ``h``, rotated queries, keys, values and the output gate (:func:`_qkv`)."""
    h = _finish(prev, h, mixed, gate)
    m = layer.mixer
    assert isinstance(m, _Attention)
    return h, *_qkv(m, rms_norm(h, layer.input_norm), cos, sin, rotate)


def _logits(prev: _Layer | None, final_norm: _Norm, lm_head: torch.Tensor, h: torch.Tensor,
            mixed: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """The last layer finished, the final norm and the LM head: fp32 logits."""
    return _fp32(F.linear(rms_norm(_finish(prev, h, mixed, gate), final_norm), lm_head))


@dataclass(frozen=True)
class _Regions:
    """The forward's regions, plain or compiled (:meth:`LeanModel.compile_decode`)."""

    gdn_in: Any = _gdn_in
    gdn_project: Any = _gdn_project
    gdn_project_raw: Any = _gdn_project_raw
    gdn_prefill_in: Any = _gdn_prefill_in
    attention_in: Any = _attention_in
    logits: Any = _logits
    compiled: bool = False


_PLAIN = _Regions()


@dataclass
class Prefill:
    """One prefill batch on the device (built by :meth:`LeanModel.prefill_batch`)."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    rows: torch.Tensor  # [S]
    starts: torch.Tensor  # [S]
    lengths: torch.Tensor  # [S] tokens of this chunk
    packed_index: torch.Tensor  # [T]: flat position in [S * L]
    last: torch.Tensor  # [S]: packed index of each segment's last token
    cu_seqlens: torch.Tensor  # [S + 1]
    cu_seqlens_cpu: torch.Tensor  # the same on the host
    width: int  # L
    keys: int  # attention span: max(start + length)
    token_rows: torch.Tensor  # [T]: each token's row
    #: ``(first, end)`` when the rows are ``first, first + 1, ..., end - 1``: their states are then
    #: slices of the slot tensors, read and written in place instead of gathered and scattered
    row_span: tuple[int, int] | None
    #: the packed conv's input indices ``[T, K]`` and those of the new windows ``[S, K]``
    #: (:func:`gdn_ops.conv_taps`; packed GDN prefill only)
    taps: torch.Tensor | None
    window_taps: torch.Tensor | None
    #: every segment starts at position 0: the recurrence starts from zero states and never reads
    #: the rows' stored ones (a fresh row's stored state is whatever its last sequence left)
    fresh: bool
    #: the rows that start at position 0 beside rows that continue (their stored recurrent states
    #: are zeroed before the first layer), else ``None``
    restarts: torch.Tensor | None
    #: causal masks built by the first attention layer, for the others (see ``_prefill_mask``)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


class LeanModel:
    """Decode step and prefill of a supported model over a :class:`SlotState` (see the module doc)."""

    def __init__(self, model: Any, *, max_model_len: int, max_rows: int = 1) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        name = type(model).__name__
        zero_centred, gated = _ARCHITECTURES[name][4], _ARCHITECTURES[name][5]
        self.model = model
        core = model.model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.embed = core.embed_tokens
        self.lm_head = model.lm_head
        self.final_norm = _norm(core.norm, zero_centred)
        self.layers: list[_Layer] = []
        attention = gdn = 0
        for layer in core.layers:
            if hasattr(layer, "linear_attn"):
                m = layer.linear_attn
                mixer: _Attention | _GDN = _GDN(
                    gdn, _Fused([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]), m.conv1d.weight[:, 0],
                    m.conv1d.bias, m.A_log, m.dt_bias, _norm(m.norm, False), m.out_proj.weight, m.num_k_heads,
                    m.num_v_heads, m.head_k_dim, m.head_v_dim, gdn_ops.activation(m.activation),
                    _const(m.head_k_dim**0.5, self.device),
                )
                gdn += 1
            else:
                m = layer.self_attn
                config = model.config
                mixer = _Attention(
                    attention, _Fused([m.q_proj, m.k_proj, m.v_proj]), m.o_proj.weight, m.o_proj.bias,
                    _norm(m.q_norm, zero_centred) if hasattr(m, "q_norm") else None,
                    _norm(m.k_norm, zero_centred) if hasattr(m, "k_norm") else None,
                    config.num_attention_heads, config.num_key_value_heads,
                    m.head_dim, float(m.scaling), gated, _const(m.scaling, self.device),
                )
                attention += 1
            self.layers.append(_Layer(_norm(layer.input_layernorm, zero_centred),
                                      _norm(layer.post_attention_layernorm, zero_centred),
                                      mixer, _Fused([layer.mlp.gate_proj, layer.mlp.up_proj]),
                                      layer.mlp.down_proj.weight, layer.mlp.down_proj.bias))
        self.max_model_len = max_model_len
        #: taps of the GDN layers' causal conv (0 without GDN layers)
        self.conv_kernel = next((y.mixer.conv_weight.shape[-1] for y in self.layers if isinstance(y.mixer, _GDN)), 0)
        self.vocab_size = model.config.vocab_size
        self.l2_eps = _const(1e-6, self.device)  # transformers' and fla's l2norm epsilon
        with torch.no_grad():
            positions = torch.arange(max_model_len, device=self.device)[None]
            if hasattr(core.rotary_emb, "mrope_section"):
                # multimodal rope (Qwen3.5): one position grid per section; text uses the same
                # positions in all three (older transformers releases do not broadcast them)
                positions = positions[None].expand(3, 1, -1)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = core.rotary_emb(probe, positions)
        # HF rotates the first `rot` dims of each head: q*cos + rotate_half(q)*sin, rotate_half(q) =
        # [-q2, q1]. Here q*C + q[..., perm]*S with C = [cos, 1], S = [-sin1, sin2, 0]: the same
        # products and sum (exact), for the queries and keys of all heads in four ops.
        head_dim = next((y.mixer.head_dim for y in self.layers if isinstance(y.mixer, _Attention)), cos.shape[-1])
        rot, half = cos.shape[-1], cos.shape[-1] // 2
        cos, sin = cos[0], sin[0]
        self.cos = torch.cat([cos, cos.new_ones(max_model_len, head_dim - rot)], -1).contiguous()
        self.sin = torch.cat([-sin[:, :half], sin[:, half:], sin.new_zeros(max_model_len, head_dim - rot)], -1).contiguous()
        self.rotate = torch.cat([torch.arange(half, rot), torch.arange(half), torch.arange(rot, head_dim)]).to(self.device)
        # indexes positions and decode rows alike (a batch may hold more rows than max_model_len)
        self.arange = torch.arange(max(max_model_len, max_rows, 1), device=self.device)
        #: attention through SDPA (CUDA: fp32 softmax and accumulation) or batched matmuls (CPU)
        on_accelerator = self.device.type != "cpu"
        self.sdpa = on_accelerator
        self.pinned_copies = device_supports(self.device, "pinned_memory_async_copy")
        self.fla_step = gdn_ops.fla_recurrent_step() if gdn_ops.use_fla(param) else None
        #: Triton kernels for GPU tensors (:mod:`miles_core.engine.triton_kernels`: the decode step's GDN
        #: conv and gates, the KV cache writes), else ``None`` (torch)
        self.kernels = _triton_kernels(param)
        #: GDN prefill over the packed tokens (the conv a gather per tap inside the projections'
        #: region, the recurrence through fla's variable-length kernels); otherwise right-padded segments
        self.packed_gdn_prefill = self.fla_step is not None
        #: packed prefills whose segments are all at most this long (and that have at most
        #: ``recurrent_prefill_tokens`` tokens) run the GDN recurrence through fla's recurrent kernel
        #: (one launch a layer) instead of its chunked one
        self.recurrent_prefill_width = RECURRENT_PREFILL_WIDTH
        self.recurrent_prefill_tokens = RECURRENT_PREFILL_TOKENS
        self.fuse_norms(on_accelerator)
        self.regions = _PLAIN

    def compile_decode(self, backend: str = "inductor") -> None:
        """Run the forward's regions through ``torch.compile`` (fused kernels: a small-gpu step
        launches ~1,100 kernels eagerly, most of them elementwise). Each region is traced once for
        every kind of (previous, next) layer, with the batch dimension dynamic (decode batches must
        have >= 2 rows: size 1 would be specialised into a second trace); fla's step, attention over
        the cache and the cache writes stay eager."""
        def compiled(fn: Any) -> Any:
            return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

        self.regions = _Regions(compiled(_gdn_in), compiled(_gdn_project), compiled(_gdn_project_raw),
                                compiled(_gdn_prefill_in), compiled(_attention_in), compiled(_logits), compiled=True)

    def norms(self) -> list[_Norm]:
        out = [self.final_norm]
        for layer in self.layers:
            out += [layer.input_norm, layer.post_norm]
            if isinstance(layer.mixer, _GDN):
                out.append(layer.mixer.norm)
            elif layer.mixer.q_norm is not None and layer.mixer.k_norm is not None:
                out += [layer.mixer.q_norm, layer.mixer.k_norm]
        return out

    def fuse_norms(self, fused: bool) -> None:
        """RMSNorms through ``F.rms_norm`` (the CUDA default) or written out (CPU: cheaper per call)."""
        for norm in self.norms():
            norm.fused = fused

    def state_shapes(self) -> StateShapes:
        attn = [layer.mixer for layer in self.layers if isinstance(layer.mixer, _Attention)]
        gdn = [layer.mixer for layer in self.layers if isinstance(layer.mixer, _GDN)]
        a = attn[0] if attn else None
        g = gdn[0] if gdn else None
        return StateShapes(
            attention_layers=len(attn), kv_heads=a.kv_heads if a else 0, head_dim=a.head_dim if a else 0,
            gdn_layers=len(gdn), conv_channels=g.conv_weight.shape[0] if g else 0,
            conv_kernel=g.conv_weight.shape[-1] if g else 0, v_heads=g.v_heads if g else 0,
            k_dim=g.k_dim if g else 0, v_dim=g.v_dim if g else 0,
        )

    # -- decode -----------------------------------------------------------------------------

    def decode(self, state: SlotState, ids: torch.Tensor, span: int) -> torch.Tensor:
        """One token for each of rows ``[0, n)`` (``n = len(ids)``): logits ``[n, vocab]`` (fp32).

        Positions are ``state.lengths[:n]``; attention reads ``span`` positions per row (at least
        the longest row's length + 1). Advances ``state.lengths[:n]`` on the device only. No host
        synchronisation: the step can be captured in a CUDA graph.
        """
        n = ids.shape[0]
        regions = self.regions
        positions = state.lengths[:n]
        rows = self.arange[:n]
        cos, sin = self.cos[positions], self.sin[positions]
        allowed = self.arange[:span] <= positions[:, None]  # [n, span]
        # additive, once for all layers: SDPA's in the model's dtype (it converts a boolean mask in every
        # call), the batched-matmul attention's in fp32
        mask = _additive_mask(allowed, self.dtype)[:, None, None, :] if self.sdpa else _additive_mask(allowed, torch.float32)
        h = F.embedding(ids, self.embed.weight)
        mark = _batch_dynamic if regions.compiled else _no_mark
        mark(h, cos, sin)
        kernels = self.kernels
        prev: _Layer | None = None  # the layer whose rest the next region runs first
        mixed: torch.Tensor | None = None
        gate: torch.Tensor | None = None
        for layer in self.layers:
            m = layer.mixer
            if isinstance(m, _GDN):
                conv = state.conv[m.index, :n]
                if kernels is not None:
                    h, qkv, gate, b, a = regions.gdn_project_raw(prev, layer, h, mixed, gate)
                    q, k, v, g, beta = kernels.conv_step(qkv, b, a, conv, m.conv_weight, m.conv_bias, m.A_log, m.dt_bias,
                                                         m.k_heads * m.k_dim)
                    q, k = q.view(n, m.k_heads, m.k_dim), k.view(n, m.k_heads, m.k_dim)
                    v = v.view(n, m.v_heads, m.v_dim)
                else:
                    mark(conv)
                    h, q, k, v, g, beta, gate = regions.gdn_in(prev, layer, h, mixed, gate, conv)
                mixed = gdn_ops.recurrent_decode(q, k, v, g, beta, state.recurrent[m.index, :n], self.l2_eps,
                                                 m.sqrt_dk, self.fla_step)
            else:
                h, q, k, v, gate = regions.attention_in(prev, layer, h, mixed, gate, cos, sin, self.rotate)
                keys, values = state.keys[m.index], state.values[m.index]
                self._write_kv(keys, values, k, v, rows, positions, state.keys_transposed)
                span_keys = keys[:n, :, :, :span] if state.keys_transposed else keys[:n, :, :span]
                mixed = self._decode_attention(m, q, span_keys, values[:n, :, :span], mask, state.keys_transposed)
            mark(h, mixed, *(() if gate is None else (gate,)))
            prev = layer
        positions.add_(1)
        return regions.logits(prev, self.final_norm, self.lm_head.weight, h, mixed, gate)

    def _write_kv(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor, positions: torch.Tensor, keys_transposed: bool) -> None:
        """Keys and values ``[T, kvH, D]`` of tokens ``t`` into position ``positions[t]`` of row
        ``rows[t]`` of the caches (keys ``[rows, kvH, D, capacity]`` when transposed): one Triton
        kernel on a GPU, two indexed assignments elsewhere."""
        if self.kernels is not None and not keys_transposed:
            self.kernels.kv_write(keys, values, k, v, rows, positions)
            return
        if keys_transposed:
            keys[rows, :, :, positions] = k
        else:
            keys[rows, :, positions] = k
        values[rows, :, positions] = v

    def _decode_attention(self, m: _Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor, keys_transposed: bool) -> torch.Tensor:
        """``q`` ``[n, H, D]`` against ``values`` ``[n, kvH, span, D]`` and ``keys`` of the same shape,
        or transposed ``[n, kvH, D, span]`` (how the CPU stores them) -> ``[n, H * D]``.

        The ``H / kvH`` query heads that share a KV head are that head's queries (a query axis of
        length ``H / kvH``), so attention never repeats K and V. On CUDA through SDPA (fp32 softmax
        and accumulation whatever the dtype); on CPU as two batched matmuls with an additive mask,
        which one thread runs faster than SDPA's CPU kernel for one query.
        """
        n, rep = q.shape[0], m.heads // m.kv_heads
        grouped = q.reshape(n, m.kv_heads, rep, m.head_dim)
        if self.sdpa:
            keys = keys.transpose(2, 3) if keys_transposed else keys
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=m.scale)
            return out.reshape(n, m.heads * m.head_dim)
        span = values.shape[2]
        k_t = keys.flatten(0, 1) if keys_transposed else keys.flatten(0, 1).transpose(1, 2)
        scores = torch.bmm((grouped * m.scaling).view(n * m.kv_heads, rep, m.head_dim), k_t)
        probs = (_fp32(scores).view(n, m.heads, span) + mask[:, None, :]).softmax(-1)
        out = torch.bmm(probs.to(q.dtype).view(n * m.kv_heads, rep, span), values.flatten(0, 1))
        return out.view(n, m.heads * m.head_dim)

    # -- prefill ----------------------------------------------------------------------------

    def prefill_batch(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> Prefill:
        """Device tensors for a prefill of ``chunks[i]`` into row ``rows[i]`` from position ``starts[i]``."""
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        ids: list[int] = []
        positions: list[int] = []
        packed_index: list[int] = []
        token_rows: list[int] = []
        last: list[int] = []
        cu = [0]
        for s, (row, start, chunk) in enumerate(zip(rows, starts, chunks)):
            ids.extend(chunk)
            token_rows.extend([row] * len(chunk))
            positions.extend(range(start, start + len(chunk)))
            packed_index.extend(range(s * width, s * width + len(chunk)))
            cu.append(cu[-1] + len(chunk))
            last.append(cu[-1] - 1)
        new_rows = [row for row, start in zip(rows, starts) if start == 0]
        fresh = len(new_rows) == len(rows)
        restarts = [] if fresh else new_rows  # new rows beside continuing ones
        (ids_t, positions_t, rows_t, starts_t, lengths_t, packed_index_t, last_t, cu_seqlens, token_rows_t,
         restarts_t) = self._on_device(ids, positions, rows, starts, lengths, packed_index, last, cu, token_rows, restarts)
        taps = window_taps = None
        if self.packed_gdn_prefill and self.conv_kernel:
            taps = gdn_ops.conv_taps(cu_seqlens, cu[-1], self.conv_kernel)
            window_taps = taps[last_t]
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        return Prefill(
            ids=ids_t, positions=positions_t, rows=rows_t, starts=starts_t, lengths=lengths_t,
            packed_index=packed_index_t, last=last_t, cu_seqlens=cu_seqlens, cu_seqlens_cpu=torch.tensor(cu),
            width=width, keys=max(s + n for s, n in zip(starts, lengths)), token_rows=token_rows_t,
            row_span=(rows[0], rows[0] + len(rows)) if consecutive else None, taps=taps, window_taps=window_taps,
            fresh=fresh, restarts=restarts_t if restarts else None,
        )

    def _on_device(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """``lists`` as int64 tensors on the model's device, through one copy (from pinned memory,
        asynchronous, where the device does that: a copy from pageable memory waits for the queued kernels)."""
        flat = torch.tensor([x for values in lists for x in values], dtype=torch.long)
        if self.pinned_copies:
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        else:
            flat = flat.to(self.device)
        return flat.split([len(values) for values in lists])

    def prefill(self, state: SlotState, batch: Prefill) -> torch.Tensor:
        """Run the batch's chunks into their rows; logits ``[S, vocab]`` (fp32) at each segment's last token.

        The rows' state before the chunk is their state after ``starts[i]`` tokens; a chunk from
        position 0 starts from a zero recurrent state whatever its row holds (its conv window must
        have been reset: :meth:`SlotState.reset_rows`). ``state.lengths`` of the rows become
        ``start + length``. The token-wise work goes through the decode step's regions (compiled
        ones too, the token axis dynamic), except for a single token, which a compiled region would
        trace again for size 1.
        """
        if batch.restarts is not None:
            state.recurrent.index_fill_(1, batch.restarts, 0)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        h = F.embedding(batch.ids, self.embed.weight)
        regions = self.regions if h.shape[0] > 1 else _PLAIN
        mark = _batch_dynamic if regions.compiled else _no_mark
        mark(h, cos, sin)
        prev: _Layer | None = None  # as in decode
        mixed: torch.Tensor | None = None
        gate: torch.Tensor | None = None
        for layer in self.layers:
            m = layer.mixer
            if isinstance(m, _GDN):
                h, mixed, gate = self._gdn_prefill(prev, layer, h, mixed, gate, state, batch, regions)
            else:
                h, q, k, v, gate = regions.attention_in(prev, layer, h, mixed, gate, cos, sin, self.rotate)
                keys, values = state.keys[m.index], state.values[m.index]
                self._write_kv(keys, values, k, v, batch.token_rows, batch.positions, state.keys_transposed)
                mixed = self._prefill_attention(m, self._pad(q, batch), keys, values, batch, state.keys_transposed)
            mark(h, mixed, *(() if gate is None else (gate,)))
            prev = layer
        state.lengths[batch.rows] = batch.starts + batch.lengths
        # only each segment's last token needs the last layer's rest (token-wise) and the logits
        last = batch.last
        assert mixed is not None
        return _logits(prev, self.final_norm, self.lm_head.weight, h[last], mixed[last], None if gate is None else gate[last])

    def _prefill_attention(self, m: _Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           batch: Prefill, keys_transposed: bool) -> torch.Tensor:
        """Padded queries ``[S, L, H, D]`` against their rows' cached keys ``[0, start + L)``: the packed
        output ``[T, H * D]``. Causal within each segment; padding queries attend to whatever is there
        (their outputs are dropped). Query heads sharing a KV head are stacked on the query axis."""
        segments, width, span = batch.rows.shape[0], batch.width, batch.keys
        rep = m.heads // m.kv_heads
        v = values[batch.rows, :, :span]  # [S, kvH, span, D]
        k = keys[batch.rows, :, :, :span] if keys_transposed else keys[batch.rows, :, :span]  # [S, kvH, D, span] or as v
        grouped = q.view(segments, width, m.kv_heads, rep, m.head_dim).permute(0, 2, 3, 1, 4)  # [S, kvH, rep, L, D]
        grouped = grouped.reshape(segments, m.kv_heads, rep * width, m.head_dim)
        if self.sdpa:
            k = k.transpose(2, 3) if keys_transposed else k
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=self._prefill_mask(batch, rep), scale=m.scale)
        else:
            bias = self._prefill_mask(batch, 0)
            k_t = k.flatten(0, 1) if keys_transposed else k.flatten(0, 1).transpose(1, 2)
            scores = torch.bmm((grouped * m.scaling).flatten(0, 1), k_t)
            probs = (_fp32(scores).view(segments, m.kv_heads, rep, width, span) + bias[:, None, None]).softmax(-1)
            out = torch.bmm(probs.to(q.dtype).view(segments * m.kv_heads, rep * width, span), v.flatten(0, 1))
        out = out.view(segments, m.kv_heads, rep, width, m.head_dim).permute(0, 3, 1, 2, 4)
        return self._unpad(out.reshape(segments, width, m.heads * m.head_dim), batch)

    def _prefill_mask(self, batch: Prefill, rep: int) -> torch.Tensor:
        """The causal mask of the batch's segments against their rows' keys, built once per batch:
        SDPA's additive ``[S, 1, rep * L, span]`` (the model's dtype) for ``rep`` stacked query heads, or (``rep = 0``)
        the matmul path's additive fp32 bias ``[S, L, span]``."""
        mask = batch.masks.get(rep)
        if mask is None:
            segments, width, span = batch.rows.shape[0], batch.width, batch.keys
            q_pos = batch.starts[:, None] + self.arange[:width][None, :]
            allowed = self.arange[:span][None, None, :] <= q_pos[:, :, None]  # [S, L, span]
            if rep:  # additive: SDPA converts a boolean mask in every call
                mask = _additive_mask(allowed, self.dtype)
                mask = mask[:, None].expand(segments, rep, width, span).reshape(segments, 1, rep * width, span)
            else:
                mask = _additive_mask(allowed, torch.float32)
            batch.masks[rep] = mask
        return mask

    def _pad(self, x: torch.Tensor, batch: Prefill) -> torch.Tensor:
        """Packed ``[T, ...]`` -> right-padded ``[S, L, ...]`` (zeros in the padding)."""
        out = x.new_zeros((batch.rows.shape[0] * batch.width, *x.shape[1:]))
        out[batch.packed_index] = x
        return out.view(batch.rows.shape[0], batch.width, *x.shape[1:])

    def _unpad(self, x: torch.Tensor, batch: Prefill) -> torch.Tensor:
        return x.reshape(-1, *x.shape[2:])[batch.packed_index]

    def _gdn_prefill(self, prev: _Layer | None, layer: _Layer, h: torch.Tensor, mixed: torch.Tensor | None,
                     gate: torch.Tensor | None, state: SlotState, batch: Prefill,
                     regions: _Regions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``prev`` finished, then projections, causal conv and recurrence of a GDN layer over the
        batch's segments (their rows' conv windows and recurrent states updated): ``h``, the
        recurrence's output ``[T, Hv, Dv]`` and the output gate ``z``. Packed through fla's
        variable-length kernels (:attr:`packed_gdn_prefill`), else right-padded."""
        m = layer.mixer
        assert isinstance(m, _GDN)
        conv_rows, recurrent = state.conv[m.index], state.recurrent[m.index]
        # consecutive rows are a slice (a view, written in place), others an index (a gathered copy)
        rows: slice | torch.Tensor = slice(*batch.row_span) if batch.row_span else batch.rows
        if not self.packed_gdn_prefill:
            h, qkv, z, beta, g = regions.gdn_project(prev, layer, h, mixed, gate)
            out, windows = gdn_ops.conv_prefill(
                self._pad(qkv, batch), conv_rows[rows], batch.lengths, m.conv_weight, m.conv_bias
            )
            conv_rows[rows] = windows
            q, k, v = _conv_qkv(m, out, self.dtype)  # [S, L, ...]
            core, final = gdn_ops.chunk_prefill(
                q, k, v, self._pad(g, batch), self._pad(beta, batch), None if batch.fresh else recurrent[rows].float(),
                batch.packed_index, batch.cu_seqlens, batch.cu_seqlens_cpu,
            )
            recurrent[rows] = final.to(recurrent.dtype)
            return h, core, z
        assert batch.taps is not None and batch.window_taps is not None and self.fla_step is not None
        windows = conv_rows[rows]
        if regions.compiled:
            _batch_dynamic(windows, batch.taps, batch.window_taps)
        h, q, k, v, g, beta, z, windows = regions.gdn_prefill_in(prev, layer, h, mixed, gate, windows, batch.taps,
                                                                 batch.window_taps)
        conv_rows[rows] = windows
        if batch.width <= self.recurrent_prefill_width and batch.ids.shape[0] <= self.recurrent_prefill_tokens:
            if batch.row_span or not batch.fresh:  # a slice is updated in place, gathered rows are a copy
                states = recurrent[rows]
            else:  # written by the kernel, never read: no gather of stale states
                states = recurrent.new_empty((batch.rows.shape[0], *recurrent.shape[1:]))
            core = self.fla_step(q, k, v, g, beta, states, batch.cu_seqlens, fresh=batch.fresh)
            if batch.row_span is None:
                recurrent[rows] = states
        else:
            initial = None if batch.fresh else recurrent[rows].float()
            core, final = gdn_ops.chunk_prefill_packed(q, k, v, g, beta, initial, batch.cu_seqlens, batch.cu_seqlens_cpu)
            recurrent[rows] = final.to(recurrent.dtype)
        return h, core, z


def _triton_kernels(t: torch.Tensor) -> ModuleType | None:
    """:mod:`miles_core.engine.triton_kernels` for tensors like ``t`` (GPU tensors, triton importable), else ``None``."""
    if not t.is_cuda:
        return None
    try:
        return importlib.import_module("miles_core.engine.triton_kernels")
    except ImportError:
        return None


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``-inf`` elsewhere, in ``dtype``."""
    return torch.where(allowed, 0.0, float("-inf")).to(dtype)


def _no_mark(*tensors: torch.Tensor) -> None:
    """What the plain regions need instead of :func:`_batch_dynamic`: nothing."""


def _batch_dynamic(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (decode rows, prefill tokens) dynamic for the compiled regions, so that one trace
    serves every graph bucket and prefill length (of two or more: a size of 1 is specialised)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
