"""Packed forwards that start below the prepared model: the decoder stack and one decoder layer.

RL trainers run the backbone (``model.model``) and apply ``lm_head`` in chunks; tests and tools
call single layers. ``prepare_model`` puts the packing scope on those modules too, so a packed row
through any of them equals each document run alone: hidden states and the gradients of a
chunked-``lm_head`` loss for the stack, outputs for the Gated DeltaNet and the attention decoder
layer. Negative control: the same calls on the same weights, unprepared, mix the documents.

Tolerance: float32 on one CPU thread; the packed and per-document paths run the same operations
on the same rows (variable-length kernels split at the boundaries), so their differences are
summation-order rounding of O(1) activations, far below 1e-5 -- while a leak moves them by ~0.1.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from miles_qwen35.patch import is_gated_deltanet
from miles_qwen35.tiny import tiny_model

from miles_core.ci.register import register_cpu_ci
from miles_core.patches import prepare_model

register_cpu_ci(est_time=10, suite="stage-a-cpu")

TOL = 1e-5
LEAK = 100 * TOL


def _model(arch: str, prepared: bool) -> torch.nn.Module:
    model = tiny_model(arch).train()
    if prepared:
        prepare_model(model)
    return model


def _chunked_head_loss(model: torch.nn.Module, hidden: torch.Tensor, docs: SimpleNamespace, part: slice, chunk: int = 16) -> torch.Tensor:
    """A trainer's token-mean cross entropy, with ``lm_head`` applied ``chunk`` tokens at a time."""
    labels = docs.labels[0, part]
    total = hidden.new_zeros(())
    for start in range(0, hidden.shape[1], chunk):
        logits = model.lm_head(hidden[:, start : start + chunk])
        total = total + torch.nn.functional.cross_entropy(logits[0], labels[start : start + chunk], reduction="sum")
    return total / docs.num_real_tokens


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _stack_packed(model, docs):
    model.zero_grad(set_to_none=True)
    hidden = model.model(docs.ids, position_ids=docs.position_ids, use_cache=False).last_hidden_state
    sum(_chunked_head_loss(model, hidden[:, s], docs, s) for s in docs.slices).backward()
    return [hidden[:, s].detach() for s in docs.slices], _grads(model)


def _stack_alone(model, docs):
    model.zero_grad(set_to_none=True)
    out = []
    for ids, s in zip(docs.alone, docs.slices):
        hidden = model.model(ids, use_cache=False).last_hidden_state
        _chunked_head_loss(model, hidden, docs, s).backward()
        out.append(hidden.detach())
    return out, _grads(model)


def _diffs(a, b) -> tuple[float, float]:
    hidden = max((x - y).abs().max().item() for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    return hidden, max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared-control"])
def test_a_packed_call_of_the_decoder_stack(qwen_pm, docs, arch: str, prepared: bool) -> None:
    model = _model(arch, prepared)
    hidden_diff, grad_diff = _diffs(_stack_packed(model, docs), _stack_alone(model, docs))
    if prepared:
        assert hidden_diff <= TOL and grad_diff <= TOL, (hidden_diff, grad_diff)
    else:
        assert hidden_diff > LEAK and grad_diff > LEAK, (hidden_diff, grad_diff)


def _layer_inputs(model: torch.nn.Module, docs: SimpleNamespace) -> dict[int, dict]:
    """What each decoder layer receives in an unpacked forward of the whole row: its hidden
    states and position embeddings (position-wise, so a document's slice of them is what it gets
    alone once its positions restart at 0 -- the packed position ids make sure of that)."""
    seen: dict[int, dict] = {}

    def record(index: int):
        def hook(module, args, kwargs) -> None:
            seen[index] = {"hidden": args[0], **kwargs}

        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model.model(docs.ids, position_ids=docs.position_ids, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


def _slice_embeddings(embeddings, part: slice):
    return None if embeddings is None else tuple(e[..., part, :] for e in embeddings)  # None: no rotary (NoPE)


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared-control"])
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_a_packed_call_of_one_decoder_layer(qwen_pm, docs, arch: str, kind: str, prepared: bool) -> None:
    model = _model(arch, prepared).eval()
    index = model.config.layer_types.index(kind)
    layer = model.model.layers[index]
    assert any(is_gated_deltanet(m) for m in layer.modules()) == (kind == "linear_attention")
    inputs = _layer_inputs(model, docs)[index]
    hidden, embeddings = inputs["hidden"], inputs.get("position_embeddings")
    with torch.no_grad():
        packed = layer(hidden, position_embeddings=embeddings, position_ids=docs.position_ids, use_cache=False)
        alone = [
            layer(
                hidden[:, s],
                position_embeddings=_slice_embeddings(embeddings, s),
                position_ids=torch.arange(s.stop - s.start).view(1, -1),
                use_cache=False,
            )
            for s in docs.slices
        ]
    diff = max((packed[:, s] - a).abs().max().item() for s, a in zip(docs.slices, alone))
    if prepared:
        assert diff <= TOL, diff
    else:
        assert diff > LEAK, diff
