"""The model-level scope prepare_model installs: context per forward, cache rules, always reset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.patches import prepare_model
from miles_core.patches.packing import (
    PACKING_KWARG,
    PackingError,
    current_packed_sequences,
    model_scope_open,
    packed_position_ids,
)
from miles_core.plugins import MilesPluginManager
from miles_core.testing import plugin_module

register_cpu_ci(est_time=3, suite="stage-a-cpu")

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
PACKED = packed_position_ids([4, 2])


@pytest.fixture
def model(miles_pm: MilesPluginManager, toy: SimpleNamespace) -> torch.nn.Module:
    # the scope comes with a patch that reads the packing context (the toy patch does)
    miles_pm.register(
        plugin_module("toy", miles_model_patches=lambda: [toy.Patch(toy.layer)]), name="toy-plugin"
    )
    model = toy.Model(toy.layer)
    prepare_model(model)
    return model


def test_a_packed_forward_gets_its_context_down_to_the_layers(model) -> None:
    model(IDS, position_ids=PACKED)
    call = model.calls[-1]
    ctx = call["kwargs"][PACKING_KWARG]
    assert ctx.lengths() == [4, 2]
    assert call["current"] is ctx  # published for the forward's duration
    assert model.layer.seen[-1] is ctx  # and passed down through **kwargs
    assert call["use_cache"] is False
    assert current_packed_sequences() is None and not model_scope_open()


def test_positional_position_ids_are_found(model) -> None:
    model(IDS, None, PACKED)
    assert model.calls[-1]["kwargs"][PACKING_KWARG].lengths() == [4, 2]


def test_an_unpacked_inference_forward_is_left_alone(model) -> None:
    model.eval()
    with torch.no_grad():
        model(IDS, position_ids=torch.arange(6).view(1, -1), use_cache=True)
        model(IDS)
    assert [c["use_cache"] for c in model.calls] == [True, None]
    assert all(PACKING_KWARG not in c["kwargs"] and c["current"] is None for c in model.calls)
    assert model.layer.seen == [None, None]


def test_training_forwards_never_use_the_cache(model) -> None:
    model.train()
    model(IDS)
    assert model.calls[-1]["use_cache"] is False
    with pytest.raises(PackingError, match="a training forward of ToyModel was called with use_cache=True"):
        model(IDS, use_cache=True)
    with torch.no_grad():  # generating from a model left in training mode: no backward, cache allowed
        model(IDS, use_cache=True)
    assert model.calls[-1]["use_cache"] is True


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"use_cache": True}, "a packed forward of ToyModel was called with use_cache=True"),
        ({"cache": object()}, "was given a cache"),
        ({"past_key_values": object()}, "was given a cache"),
        ({"attention_mask": torch.ones(1, 6)}, "attention_mask=None"),
    ],
    ids=["use_cache", "cache", "past_key_values", "attention_mask"],
)
def test_packed_forwards_that_would_mix_documents_are_refused(model, extra, match) -> None:
    model.eval()
    with torch.no_grad(), pytest.raises(PackingError, match=match):
        model(IDS, position_ids=PACKED, **extra)
    assert model.calls == []  # refused before the forward ran
    assert not model_scope_open()


def test_flash_attention_varlen_kwargs_are_refused(model) -> None:
    with pytest.raises(PackingError, match="cu_seq_lens_q: describe packed rows with position_ids"):
        model(IDS, cu_seq_lens_q=torch.tensor([0, 4, 6]))


def test_the_scope_closes_when_the_forward_raises(model) -> None:
    with pytest.raises(RuntimeError, match="forward exploded"):
        model(IDS, position_ids=PACKED, explode=True)
    assert model.calls[-1]["current"] is not None
    assert current_packed_sequences() is None and not model_scope_open()
    model(IDS)  # and the next forward starts clean
    assert model.calls[-1]["current"] is None


def test_nested_models_each_see_their_own_context(miles_pm, toy) -> None:
    miles_pm.register(
        plugin_module("toy", miles_model_patches=lambda: [toy.Patch(toy.layer)]), name="toy-plugin"
    )
    inner = toy.Model(toy.layer)
    prepare_model(inner)

    class Outer(toy.Model):
        def forward(self, input_ids, position_ids=None, **kwargs):
            kwargs.pop(PACKING_KWARG, None)
            outer_ctx = current_packed_sequences()
            inner(input_ids)  # an unpacked forward inside resets the context to None ...
            assert current_packed_sequences() is outer_ctx  # ... and restores it afterwards
            return outer_ctx

    outer = Outer(toy.layer)
    prepare_model(outer)
    assert outer(IDS, position_ids=PACKED).lengths() == [4, 2]
    assert inner.calls[-1]["current"] is None


class _Stack(torch.nn.Module):
    """A decoder stack: ``position_ids`` by name, ``**kwargs`` passed down to its layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.currents: list = []

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        self.currents.append(current_packed_sequences())
        return self.layer(hidden, **kwargs)


class _Rotary(torch.nn.Module):
    """Position-wise, no ``**kwargs``, no reader inside: not an entry point."""

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return hidden


class _Legacy(torch.nn.Module):
    """``position_ids`` by name but no ``**kwargs``, with a reader inside: cannot carry the context."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.layer(hidden)


@pytest.fixture
def stacked(miles_pm, toy) -> SimpleNamespace:
    """A toy model whose forward runs a decoder stack, the way a causal LM runs ``model.model``."""
    miles_pm.register(
        plugin_module("toy", miles_model_patches=lambda: [toy.Patch(toy.layer)]), name="toy-plugin"
    )

    class Model(toy.Model):
        def __init__(self) -> None:
            super().__init__(toy.layer)
            self.stack = _Stack(self.layer)
            self.rotary = _Rotary()
            self.legacy = _Legacy(toy.layer())

        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
            self.calls.append({"kwargs": dict(kwargs), "current": current_packed_sequences()})
            hidden = torch.nn.functional.one_hot(input_ids % 4, 4).float()
            return self.stack(self.rotary(hidden, position_ids), position_ids=position_ids, **kwargs)

    model = Model()
    prepare_model(model)
    hidden = torch.nn.functional.one_hot(IDS % 4, 4).float()
    return SimpleNamespace(model=model, hidden=hidden)


def test_entry_points_are_the_modules_a_packed_forward_can_start_at(stacked) -> None:
    from miles_core.patches.scope import has_packing_scope

    model = stacked.model
    hooked = {name for name, module in model.named_modules() if has_packing_scope(module)}
    assert hooked == {"", "stack", "layer", "legacy", "legacy.layer"}  # not the rotary embedding


def test_a_packed_call_of_an_inner_stack_carries_the_boundaries(stacked) -> None:
    model = stacked.model
    model.stack(stacked.hidden, position_ids=PACKED)
    ctx = model.stack.currents[-1]
    assert ctx is not None and ctx.lengths() == [4, 2]
    assert model.layer.seen[-1] is ctx  # passed down to the reader
    assert current_packed_sequences() is None and not model_scope_open()
    model.layer(stacked.hidden, position_ids=PACKED)  # a reader called on its own: through **kwargs
    assert model.layer.seen[-1].lengths() == [4, 2]
    model.stack(stacked.hidden, position_ids=torch.arange(6).view(1, -1))
    assert model.stack.currents[-1] is None and model.layer.seen[-1] is None


def test_inside_a_forward_of_the_model_its_context_stands(stacked) -> None:
    model = stacked.model
    model(IDS, position_ids=PACKED)
    outer = model.calls[-1]["current"]
    assert outer is not None
    assert model.stack.currents[-1] is outer and model.layer.seen[-1] is outer  # not derived again
    model(IDS)  # unpacked: the stack and its layer run in the model's scope, without a context
    assert model.stack.currents[-1] is None and model.layer.seen[-1] is None


def test_a_packed_call_that_cannot_carry_the_boundaries_fails_loudly(stacked) -> None:
    with pytest.raises(PackingError, match=r"_Legacy\.forward takes no \*\*kwargs, so the packing context cannot"):
        stacked.model.legacy(stacked.hidden, position_ids=PACKED)
    assert not model_scope_open()
    stacked.model.legacy(stacked.hidden, position_ids=torch.arange(6).view(1, -1))  # unpacked: fine
    assert stacked.model.legacy.layer.seen[-1] is None
