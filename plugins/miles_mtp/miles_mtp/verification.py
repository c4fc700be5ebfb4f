"""End-to-end checks of an adapter on a model class: the invariant of :mod:`miles_mtp.contract`.

* :func:`check_adapter` feeds canonical batches (packed documents and padded rows, prompt and
  response spans) through the installed adapter into the class's real ``forward`` (on a
  :mod:`probe` stand-in) and compares what every depth trains on with the reference.
* :func:`check_context_parallel` runs the same adapter on a simulated 2-way context-parallel
  split and requires every rank's inputs to be exactly its shard of the unsplit inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_mtp.adapter import LabelAdapter, install
from miles_mtp.batching import pack, rows
from miles_mtp.contract import LabelContractError, MTPBatch, Observation, contract_violations
from miles_mtp.conventions import Convention
from miles_mtp.probe import observe, packed_seq_params, probe_config
from miles_mtp.roll import LEFT, SequenceLayout, roll_shards, shard, unshard

if TYPE_CHECKING:
    import torch


def verification_batches(depths: int, pad_to_multiple: int = 1, vocab_size: int = 256) -> list[MTPBatch]:
    """Deterministic canonical batches in which every depth up to ``depths`` trains something:
    three packed documents of prompt and response spans, and the same documents as padded rows."""
    samples = []
    for doc, (prompt, response) in enumerate(((3, depths + 4), (2, depths + 6), (1, depths + 2))):
        ids = [(7 * doc + 3 * j) % (vocab_size - 1) + 1 for j in range(prompt + response)]
        samples.append((ids, [0] * prompt + [1] * response))
    return [pack(samples, pad_to_multiple), rows(samples)]


def check_adapter(
    model_cls: type,
    adapter: LabelAdapter,
    depths: int,
    config: Any = None,
    batches: list[MTPBatch] | None = None,
) -> list[str]:
    """Problems found feeding canonical batches through ``adapter`` into ``model_cls``."""
    problems = []
    for batch in batches or verification_batches(depths):
        cu = batch.layout.cu_seqlens
        kwargs: dict[str, Any] = {"loss_mask": batch.loss_mask}
        if cu is not None:
            kwargs["packed_seq_params"] = packed_seq_params(cu)
        observed = observe(
            model_cls, probe_config(depths, config), batch.tokens, kwargs, lambda m: install(m, adapter)
        )
        layout = "packed" if cu is not None else "rows"
        problems += [
            f"{layout}: {p}" for p in contract_violations(observed, batch.tokens, batch.loss_mask, cu, depths)
        ]
    return problems


def emulate(
    convention: Convention, labels: Any, mask: Any, depths: int, shift: Callable[[Any, int], Any]
) -> dict[int, tuple[Any, Any]]:
    """What a model of ``convention`` trains depth ``1..depths`` on, given its label and mask inputs."""
    c = convention
    for _ in range(c.label_pre_shifts):
        labels = shift(labels, LEFT)
    for _ in range(c.mask_pre_shifts):
        mask = shift(mask, LEFT)
    out = {}
    for depth in range(1, depths + 1):
        labels, mask = shift(labels, LEFT), shift(mask, LEFT)
        out[depth] = (labels, mask)
    return out


def simulate_context_parallel(
    adapter: LabelAdapter, model: Convention, batch: MTPBatch, depths: int, cp_size: int = 2
) -> tuple[list[dict[str, Any]], dict[int, Observation]]:
    """Run the adapter on every rank's shard of ``batch`` (a whole, unsharded batch) and emulate
    the rolls of a model of convention ``model`` there too. Returns each rank's model kwargs and,
    unsharded, what every depth trains on."""
    cu = batch.layout.cu_seqlens
    layouts = [SequenceLayout(cu, cp_size, r) for r in range(cp_size)]
    tokens = [shard(batch.tokens, lay) for lay in layouts]
    masks = [shard(batch.float_mask(), lay) for lay in layouts]
    for lay, t, m in zip(layouts, tokens, masks):
        MTPBatch(t, m, lay)  # every rank's shard must itself be a valid canonical batch

    def shift(pieces: list[torch.Tensor], direction: int) -> list[torch.Tensor]:
        return roll_shards(pieces, direction, cu)

    labels, mask = adapter.path_inputs(tokens, masks, shift)
    kwargs = [adapter.convention.interface.kwargs(lab, msk) for lab, msk in zip(labels, mask)]
    observed = {
        depth: Observation(unshard(lab, cu), unshard(msk, cu))
        for depth, (lab, msk) in emulate(model, labels, mask, depths, shift).items()
    }
    return kwargs, observed


def context_parallel_violations(
    adapter: LabelAdapter, model: Convention, batch: MTPBatch, depths: int, cp_size: int = 2
) -> list[str]:
    """Problems of the adapter feeding a model of convention ``model`` when ``batch`` (whole) is
    split ``cp_size`` ways: every rank's inputs must be its shard of the unsplit inputs, and what
    each depth trains on must meet the invariant."""
    import torch

    problems = []
    cu = batch.layout.cu_seqlens
    sharded, observed = simulate_context_parallel(adapter, model, batch, depths, cp_size)
    whole = adapter.model_kwargs(batch)
    for name, value in _tensors(whole).items():
        pieces = [_tensors(kw)[name] for kw in sharded]
        if not torch.equal(unshard(pieces, cu), value):
            problems.append(
                f"cp={cp_size}: the adapter's {name} on the CP shards differ from its {name} unsplit"
            )
    problems += [
        f"cp={cp_size}: {p}" for p in contract_violations(observed, batch.tokens, batch.loss_mask, cu, depths)
    ]
    return problems


def check_context_parallel(
    adapter: LabelAdapter, model: Convention, depths: int, cp_size: int = 2
) -> list[str]:
    """:func:`context_parallel_violations` on the packed verification batch."""
    batch = verification_batches(depths, pad_to_multiple=2 * cp_size)[0]
    return context_parallel_violations(adapter, model, batch, depths, cp_size)


def verify_adapter(
    model_cls: type, model: Convention, adapter: LabelAdapter, depths: int, config: Any = None
) -> None:
    """Raise :class:`LabelContractError` naming every violation of the invariant by ``adapter``
    feeding ``model_cls`` (whose detected convention is ``model``), if any."""
    problems = check_adapter(model_cls, adapter, depths, config) + check_context_parallel(
        adapter, model, depths
    )
    if problems:
        raise LabelContractError(
            f"MTP labels of {adapter.convention.model_class} through the adapter for "
            f"{adapter.convention.expects} break the contract: " + "; ".join(problems)
        )


def _tensors(kwargs: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    import torch

    out = {}
    for key, value in kwargs.items():
        if isinstance(value, dict):
            out.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def observe_model(module: Any, batch: MTPBatch) -> dict[int, Observation]:
    """Run a real forward of ``module`` (adapter installed) on a row batch and return what each
    depth's loss received. Depths are identified by call order: megatron computes the MTP
    losses, depth 1 first, before the main head's. Parameters' ``.grad`` are left untouched."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from miles_core.hardware.megatron_state import causal_attention_mask

    if batch.layout.cu_seqlens is not None or batch.layout.cp_size != 1:
        raise LabelContractError("observe_model runs padded rows (one document per row) only")
    device = next(module.parameters()).device
    tokens, mask = batch.tokens.to(device), batch.loss_mask.to(device)
    batch_size, seq_len = tokens.shape
    own = module.__dict__.get("compute_language_model_loss")  # an instance override to restore
    original = module.compute_language_model_loss
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss = original(labels, logits)
        calls.append((labels.detach().clone(), loss))
        return loss

    was_training = module.training
    previous_scale = MTPLossAutoScaler.main_loss_backward_scale
    module.compute_language_model_loss = spy
    module.eval()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        output = module(
            input_ids=tokens,
            position_ids=torch.arange(seq_len, device=device).expand(batch_size, seq_len),
            attention_mask=causal_attention_mask(seq_len, device),
            loss_mask=mask,
        )
        depths = module.config.mtp_num_layers
        losses = [loss for _, loss in calls[:depths]]
        weights = torch.autograd.grad(output.float().sum(), losses, allow_unused=True)
    finally:
        MTPLossAutoScaler.set_loss_scale(previous_scale)
        if own is None:
            del module.compute_language_model_loss
        else:
            module.compute_language_model_loss = own
        module.train(was_training)
    observed = {
        depth + 1: Observation(labels.cpu(), (w if w is not None else torch.zeros_like(loss)).detach().cpu())
        for depth, ((labels, loss), w) in enumerate(zip(calls[:depths], weights))
    }
    if len(calls) > depths:
        observed[0] = Observation(
            calls[depths][0].cpu(), torch.ones_like(calls[depths][0], dtype=torch.float32)
        )
    return observed


def check_model(module: Any, vocab_size: int) -> list[str]:
    """Problems of a real forward of ``module`` on the padded-row verification batch."""
    depths = module.config.mtp_num_layers
    batch = verification_batches(depths, vocab_size=vocab_size)[1]
    observed = observe_model(module, batch)
    return contract_violations(observed, batch.tokens, batch.loss_mask, None, depths)
