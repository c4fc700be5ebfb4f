"""Observe what labels and loss mask each MTP depth of a model class actually trains on.

The probe runs the class's own ``forward`` (and with it the label and mask handling of its
post-processing: ``roll_tensor``, ``process_mtp_loss``, whatever the installed version does) on a
*stand-in* instance: a real instance of the class whose heavy parts are replaced by recorders.

* the decoder and the MTP block return constant hidden states tagged with their depth;
* the output layer passes them through, so every loss call knows which depth it belongs to;
* ``compute_language_model_loss`` records the labels it receives and returns a zero per-token
  loss that is a leaf of the autograd graph. After a backward pass, the gradient on that leaf is
  the weight the model gave each position: proportional to the loss mask it applied.

No weights, no process groups, no device: the probe costs milliseconds and runs the same on a
laptop and inside a 1000-GPU job. It never sees tensor-parallel or context-parallel behaviour
(``cp_group`` is None); the context-parallel roll of the adapters is checked separately.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_mtp.contract import LabelContractError, Observation, expected_depth
from miles_mtp.conventions import (
    SUPPORTED_PRE_SHIFTS,
    Convention,
    Interface,
    ModelPath,
    path_for,
    qualified_name,
)

if TYPE_CHECKING:
    import torch

#: document lengths of the detection probe: three packed documents, longer than its depths + 2
PROBE_DOCUMENTS = (7, 9, 6)
PROBE_DEPTHS = 2


class _LossRecorder:
    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        import torch

        depth = round(float(logits.detach().reshape(-1)[0]))
        leaf = torch.zeros(labels.shape, requires_grad=True)
        self.calls.setdefault(depth, []).append((labels.detach().clone(), leaf))
        return leaf + 0 * logits[..., 0].transpose(0, 1)


def _stand_in(model_cls: type[torch.nn.Module], config: Any, seq_len: int, batch: int, recorder: _LossRecorder) -> Any:
    import torch

    depths = config.mtp_num_layers
    base = torch.zeros(seq_len, batch, 1, requires_grad=True)

    def preprocess(**_: Any) -> tuple[Any, ...]:
        return (base, None, None, None, None, None)

    def decoder(**_: Any) -> torch.Tensor:
        return base

    def embedding(**_: Any) -> torch.Tensor:
        return base

    def mtp_block(*, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.cat([hidden_states + depth for depth in range(depths + 1)], dim=0)

    def output_layer(
        hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return hidden_states, None

    model = model_cls.__new__(model_cls)
    torch.nn.Module.__init__(model)
    attributes = {
        "config": config,
        "pre_process": True,
        "post_process": True,
        "mtp_process": True,
        "share_embeddings_and_output_weights": False,
        "position_embedding_type": "none",
        "cp_group": None,
        "tp_group": None,
        "pg_collection": _Groups(),
        "_preprocess": preprocess,
        "embedding": embedding,
        "decoder": decoder,
        "mtp": mtp_block,
        "output_layer": output_layer,
        "compute_language_model_loss": recorder,
    }
    for name, value in attributes.items():
        object.__setattr__(model, name, value)
    model.eval()  # training mode would log MTP losses through megatron's parallel state
    return model


class _Groups:
    cp = None
    tp = None


def probe_config(depths: int, template: Any = None) -> Any:
    """A megatron ``TransformerConfig`` for the stand-in: ``template``'s (a model's own config),
    or a tiny fresh one, with ``depths`` MTP layers and an observable MTP loss weight."""
    if template is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        with warnings.catch_warnings():  # deprecation notes about defaults of a throwaway config
            warnings.simplefilter("ignore")
            return TransformerConfig(
                num_layers=1, hidden_size=8, num_attention_heads=1, mtp_num_layers=depths
            )
    config = copy.copy(template)
    config.mtp_num_layers = depths
    config.mtp_loss_scaling_factor = 1.0
    return config


def observe(
    model_cls: type,
    config: Any,
    input_ids: torch.Tensor,
    forward_kwargs: dict[str, Any],
    install: Callable[[Any], None] | None = None,
) -> dict[int, Observation]:
    """Run ``model_cls.forward`` on a stand-in and return what each depth's loss received.

    ``install`` may wrap the stand-in's forward (an adapter) before the call. Depth 0 is the main
    head (observed only when the model computes its loss itself).
    """
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    batch, seq_len = input_ids.shape
    recorder = _LossRecorder()
    model = _stand_in(model_cls, config, seq_len, batch, recorder)
    if install is not None:
        install(model)
    position_ids = torch.arange(seq_len).expand(batch, seq_len)
    previous_scale = MTPLossAutoScaler.main_loss_backward_scale
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, **forward_kwargs)
        output.sum().backward()
    finally:
        MTPLossAutoScaler.set_loss_scale(previous_scale)
    observed = {}
    for depth, calls in recorder.calls.items():
        if len(calls) != 1:
            raise LabelContractError(
                f"{qualified_name(model_cls)} computed the depth-{depth} loss {len(calls)} times"
            )
        labels, leaf = calls[0]
        weight = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        observed[depth] = Observation(labels, weight.detach())
    return observed


def accepts(model_cls: type[torch.nn.Module], interface: Interface) -> bool:
    """Whether ``model_cls.forward`` takes the interface's keyword arguments at all."""
    kwargs = interface.kwargs(None, None)
    try:
        inspect.signature(model_cls.forward).bind(
            None, input_ids=None, position_ids=None, attention_mask=None, packed_seq_params=None, **kwargs
        )
    except TypeError:
        return False
    return True


def packed_seq_params(cu_seqlens: tuple[int, ...]) -> Any:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu_seqlens))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def detect(path: ModelPath, model_cls: type | None = None) -> Convention | None:
    """Learn which convention ``model_cls`` (default: the path's installed class) implements.

    Returns None when no interface of the path makes the class train an MTP depth (this
    megatron-core has no MTP on that path). Raises :class:`LabelContractError` when a class does
    train MTP depths but in a way no adapter can make correct (the registration error).
    """
    import torch

    model_cls = model_cls or path.load()
    if model_cls is None:
        return None
    cu = tuple(int(v) for v in torch.tensor((0, *PROBE_DOCUMENTS)).cumsum(0))
    tokens = torch.arange(1, cu[-1] + 1).unsqueeze(0)  # distinct ids: every shift is recognisable
    weights = torch.arange(1, cu[-1] + 1, dtype=torch.float32).unsqueeze(0)  # distinct mask weights
    name = qualified_name(model_cls)
    for interface in path.interfaces:
        if not accepts(model_cls, interface):
            continue
        kwargs = {**interface.kwargs(tokens, weights), "packed_seq_params": packed_seq_params(cu)}
        try:
            observed = observe(model_cls, probe_config(PROBE_DEPTHS), tokens, kwargs)
        except Exception as exc:
            raise LabelContractError(
                f"cannot identify the MTP label convention of {name}: probing it through "
                f"{interface.signature} raised {type(exc).__name__}: {exc}"
            ) from exc
        mtp_depths = sorted(k for k in observed if k > 0)
        if not mtp_depths:
            continue
        label_shift = _pre_shifts(observed, tokens, cu, lambda obs: obs.labels, exact=True)
        mask_shift = _pre_shifts(observed, weights, cu, lambda obs: obs.weight, exact=False)
        problems = []
        if mtp_depths != list(range(1, PROBE_DEPTHS + 1)):
            problems.append(f"it computed MTP depths {mtp_depths} with mtp_num_layers={PROBE_DEPTHS}")
        if label_shift is None:
            problems.append(_unidentified(observed, tokens, cu, "labels"))
        if mask_shift is None:
            problems.append(_unidentified(observed, weights, cu, "loss mask"))
        if problems or label_shift is None or mask_shift is None:
            raise LabelContractError(
                f"cannot identify the MTP label convention of {name} through {interface.signature}: "
                + "; ".join(problems)
                + f". Supported: per-document rolls, {SUPPORTED_PRE_SHIFTS} extra shift(s) before depth 1"
            )
        return Convention(path.name, name, interface, label_shift, mask_shift)
    return None


def _shifted(x: torch.Tensor, cu: tuple[int, ...], shifts: int) -> torch.Tensor:
    """``x`` shifted left ``shifts`` times per document, zero where it would cross a document end."""
    return expected_depth(x, x, cu, shifts - 1)[0]


def _matches(observed: torch.Tensor, reference: torch.Tensor, exact: bool) -> bool:
    if exact:
        return bool((observed == reference).all())
    total = reference.sum()
    if not bool(total > 0):
        return bool((observed == 0).all())
    scale = observed.sum() / total
    return bool(_allclose(observed, reference * scale))


def _allclose(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def _pre_shifts(
    observed: dict[int, Observation],
    source: torch.Tensor,
    cu: tuple[int, ...],
    field: Callable[[Observation], torch.Tensor],
    exact: bool,
) -> int | None:
    """The extra shifts ``s`` such that every depth k received ``source`` shifted ``k + s`` times."""
    for extra in SUPPORTED_PRE_SHIFTS:
        if all(
            _matches(field(obs), _shifted(source, cu, depth + extra), exact)
            for depth, obs in observed.items()
            if depth > 0
        ):
            return extra
    return None


def _unidentified(
    observed: dict[int, Observation], source: torch.Tensor, cu: tuple[int, ...], what: str
) -> str:
    exact = what == "labels"
    for depth, obs in sorted(observed.items()):
        if depth == 0:
            continue
        got = obs.labels if exact else obs.weight
        for shifts in range(6):
            if _matches(got, _shifted(source, cu, shifts), exact):
                return f"depth {depth} {what}: its input shifted {shifts} time(s), not {depth} or {depth + 1}"
        head = ", ".join(f"{v:.3g}" for v in got.reshape(-1)[:12].tolist())
        return f"depth {depth} {what}: no per-document shift of its input (observed {head}, ...)"
    return f"no MTP depth reported its {what}"


@functools.cache
def convention_of(model_cls: type) -> Convention | None:
    """:func:`detect` for the path ``model_cls`` belongs to, once per class and process."""
    path = path_for(model_cls)
    if path is None:
        raise LabelContractError(f"{qualified_name(model_cls)} belongs to no known MTP model path")
    return detect(path, model_cls)


def installed_conventions() -> dict[str, tuple[Convention | None, str | None]]:
    """Per model path of the installed megatron-core: (convention or None, registration problem)."""
    from miles_mtp.conventions import PATHS

    out: dict[str, tuple[Convention | None, str | None]] = {}
    for path in PATHS:
        try:
            out[path.name] = (detect(path), None)
        except LabelContractError as exc:
            out[path.name] = (None, str(exc))
    return out
