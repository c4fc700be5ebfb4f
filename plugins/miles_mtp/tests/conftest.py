"""Shared fixtures: model classes implementing each MTP label convention.

The installed megatron-core (0.16.1) ships only the upstream convention (``GPTModel`` with
``labels=``). The other two live in the radixark Megatron fork, which is not installable here, so
these test doubles reproduce their label handling as documented
(``shared/reference/upstream-patches.md`` section B), with megatron-core's own ``roll_tensor``
and ``MTPLossAutoScaler``. They are real subclasses of the installed classes, so the plugin
resolves them to their paths exactly as it would the fork's. They are defined on first use, so
test files that need neither torch nor megatron do not pay for importing them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest


def _define_doubles() -> SimpleNamespace:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.mamba import MambaModel
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    def _roll(x: Any, cp_group: Any, packed_seq_params: Any) -> Any:
        return roll_tensor(x, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)

    def _mtp_losses(model, hidden, labels, loss_mask, packed_seq_params) -> Any:
        """Per depth: roll labels and mask once, weight the loss, inject it (megatron's recipe)."""
        depths = model.config.mtp_num_layers
        chunks = torch.chunk(hidden, 1 + depths, dim=0)
        hidden = chunks[0]
        for depth in range(depths):
            logits, _ = model.output_layer(chunks[depth + 1])
            labels, _ = _roll(labels, model.cp_group, packed_seq_params)
            loss_mask, num_tokens = _roll(loss_mask, model.cp_group, packed_seq_params)
            loss = model.compute_language_model_loss(labels, logits) * loss_mask
            scale = model.config.mtp_loss_scaling_factor / depths
            hidden = MTPLossAutoScaler.apply(hidden, scale * loss / num_tokens)
        return hidden

    def _trunk(model, input_ids, position_ids, attention_mask, packed_seq_params) -> Any:
        decoder_input = model._preprocess(input_ids=input_ids, position_ids=position_ids)[0]
        return model.decoder(
            hidden_states=decoder_input, attention_mask=attention_mask, packed_seq_params=packed_seq_params
        )

    def _head(model, hidden, labels) -> Any:
        logits, _ = model.output_layer(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return model.compute_language_model_loss(labels, logits)

    class ForkGPTModel(GPTModel):
        """The fork's GPT path: raw tokens as ``mtp_kwargs["mtp_labels"]``, MTP only when present;
        labels rolled once (raw -> next-token) and the loss mask rolled once extra before the
        per-depth rolls (the suspected off-by-one)."""

        def forward(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=None,
            labels=None,
            packed_seq_params=None,
            *,
            loss_mask=None,
            mtp_kwargs=None,
        ):
            hidden = _trunk(self, input_ids, position_ids, attention_mask, packed_seq_params)
            mtp_labels = (mtp_kwargs or {}).get("mtp_labels")
            if mtp_labels is not None:
                hidden = self.mtp(
                    hidden_states=hidden, input_ids=input_ids, packed_seq_params=packed_seq_params
                )
                mtp_labels, _ = _roll(mtp_labels.clone(), self.cp_group, packed_seq_params)
                loss_mask, _ = _roll(
                    loss_mask, self.cp_group, packed_seq_params
                )  # "to keep up with the labels"
                hidden = _mtp_losses(self, hidden, mtp_labels, loss_mask, packed_seq_params)
            return _head(self, hidden, labels)

    class ForkMambaModel(MambaModel):
        """The Mamba/hybrid path: ``mtp_labels=`` goes straight to ``process_mtp_loss``, which rolls
        per depth only (so it wants next-token labels)."""

        def forward(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=None,
            labels=None,
            *,
            packed_seq_params=None,
            mtp_labels=None,
            loss_mask=None,
        ):
            hidden = self.decoder(
                hidden_states=self.embedding(input_ids=input_ids, position_ids=position_ids),
                attention_mask=attention_mask,
                packed_seq_params=packed_seq_params,
            )
            if mtp_labels is not None:
                hidden = self.mtp(
                    hidden_states=hidden, input_ids=input_ids, packed_seq_params=packed_seq_params
                )
                hidden = _mtp_losses(self, hidden, mtp_labels.clone(), loss_mask, packed_seq_params)
            return _head(self, hidden, labels)

    class PlainRollGPTModel(GPTModel):
        """A GPT path that shifts with a plain ``torch.roll``: labels leak across documents."""

        def forward(
            self,
            input_ids,
            position_ids,
            attention_mask,
            labels=None,
            packed_seq_params=None,
            *,
            loss_mask=None,
        ):
            hidden = _trunk(self, input_ids, position_ids, attention_mask, packed_seq_params)
            hidden = self.mtp(hidden_states=hidden)
            chunks = torch.chunk(hidden, 1 + self.config.mtp_num_layers, dim=0)
            hidden = chunks[0]
            for depth in range(self.config.mtp_num_layers):
                logits, _ = self.output_layer(chunks[depth + 1])
                labels, loss_mask = torch.roll(labels, -1, -1), torch.roll(loss_mask, -1, -1)
                loss = self.compute_language_model_loss(labels, logits) * loss_mask
                hidden = MTPLossAutoScaler.apply(hidden, loss / loss_mask.sum())
            return _head(self, hidden, None)

    class DoubleShiftGPTModel(ForkGPTModel):
        """A fork whose raw-token path shifts twice before depth 1: no adapter can undo it."""

        def forward(self, input_ids, position_ids, attention_mask, *args, mtp_kwargs=None, **kwargs):
            if mtp_kwargs:
                params = kwargs.get("packed_seq_params")
                shifted, _ = _roll(mtp_kwargs["mtp_labels"], self.cp_group, params)
                mtp_kwargs = {"mtp_labels": shifted}
            return super().forward(
                input_ids, position_ids, attention_mask, *args, mtp_kwargs=mtp_kwargs, **kwargs
            )

    #: convention name -> (model class, expected (interface, label_pre_shifts, mask_pre_shifts))
    conventions = {
        "upstream-gpt": (GPTModel, ("labels", 0, 0)),
        "fork-gpt": (ForkGPTModel, ("mtp_kwargs", 1, 1)),
        "mamba": (ForkMambaModel, ("mtp_labels", 0, 0)),
    }
    return SimpleNamespace(
        conventions=conventions,
        ForkGPTModel=ForkGPTModel,
        ForkMambaModel=ForkMambaModel,
        PlainRollGPTModel=PlainRollGPTModel,
        DoubleShiftGPTModel=DoubleShiftGPTModel,
    )


@pytest.fixture(scope="session")
def doubles() -> SimpleNamespace:
    import torch

    torch.set_num_threads(1)
    return _define_doubles()


def bare_model(cls: type, depths: int) -> Any:
    """An instance of ``cls`` carrying only a config with ``depths`` MTP layers: enough for the
    patch to find it, install an adapter on it and verify that adapter against its class."""
    import torch
    from miles_mtp.probe import probe_config

    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config = probe_config(depths)
    return model


@pytest.fixture(scope="session")
def make_bare_model():
    return bare_model


@pytest.fixture
def megatron_state(miles_pm_factory):
    """megatron's parallel state at world size 1 on the cpu backend, with a plugin manager holding
    the core's built-ins and miles-mtp (so prepare_model applies the ``mtp-labels`` patch)."""
    import torch
    from miles_mtp import plugin

    from miles_core.hardware.megatron_state import single_rank_parallel_state

    torch.set_num_threads(1)
    pm = miles_pm_factory(builtins=True, plugins=[("miles-mtp", plugin)])
    with single_rank_parallel_state(seed=0) as hw:
        yield pm, hw


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core 0.16.1 announces future API changes on every layer it builds
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:megatron.*")
    config.addinivalue_line("filterwarnings", "ignore::UserWarning:megatron.*")
