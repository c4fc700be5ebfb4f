"""Train a megatron-core ``GPTModel`` with MTP through the label contract: the CPU harness.

This is what the megatron trainer backend of ``miles train`` reuses::

    from miles_core.hardware.megatron_state import single_rank_parallel_state
    from miles_mtp.batching import pack
    from miles_mtp.harness import TinyGPTConfig, build_tiny_gpt, train_step

    with single_rank_parallel_state(seed=0) as hw:          # cpu backend: megatron on the CPU
        model, report = build_tiny_gpt(TinyGPTConfig(mtp_num_layers=2), hw.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batch = pack([(token_ids, trained_flags), ...])      # raw tokens + token-aligned mask
        result = train_step(model, optimizer, batch)
        result.main_loss, result.mtp_losses                   # mtp_losses[0] is depth 1

``build_tiny_gpt`` prepares the model through :func:`miles_core.patches.prepare_model`, which
installs and verifies the MTP label adapter (the ``mtp-labels`` patch). :func:`train_step`,
:func:`evaluate` and, for other objectives (RL), :func:`forward_token_losses` (per-token negative
log-likelihoods plus the MTP losses) work on any prepared megatron model with MTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_mtp.batching import rows, samples_of
from miles_mtp.contract import LabelContractError, MTPBatch, expected_depth

if TYPE_CHECKING:
    import torch

    from miles_core.patches import PrepareReport
    from miles_core.plugins import MilesPluginManager


@dataclass(frozen=True)
class TinyGPTConfig:
    """A small GPTModel: local (non Transformer-Engine) layers, rotary positions, no dropout."""

    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    mtp_num_layers: int = 1
    mtp_loss_scaling_factor: float = 0.1
    max_sequence_length: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.mtp_num_layers <= 8:
            raise LabelContractError(f"mtp_num_layers must be in [1, 8], got {self.mtp_num_layers}")
        if self.hidden_size % self.num_attention_heads:
            raise LabelContractError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )


@dataclass(frozen=True)
class MTPLosses:
    """Losses of one forward: the main next-token loss and the MTP loss of each depth (depth 1
    first), every one the mean over the positions its mask trains."""

    main_loss: float
    mtp_losses: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"main_loss": self.main_loss, "mtp_losses": list(self.mtp_losses)}


def build_tiny_gpt(
    config: TinyGPTConfig, device: torch.device | str = "cpu", pm: MilesPluginManager | None = None
) -> tuple[Any, PrepareReport]:
    """Build a tiny ``GPTModel`` with ``config.mtp_num_layers`` MTP layers and prepare it.

    megatron's ``parallel_state`` must be initialised (on CPU: ``single_rank_parallel_state``
    of :mod:`miles_core.hardware.megatron_state`, which activates the cpu backend). Seeding is
    the caller's: the parallel-state helper seeds torch and megatron.
    """
    import warnings

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles_core.patches import prepare_model

    with warnings.catch_warnings():  # megatron's deprecation notes about its own defaults
        warnings.simplefilter("ignore")
        transformer = TransformerConfig(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            mtp_num_layers=config.mtp_num_layers,
            mtp_loss_scaling_factor=config.mtp_loss_scaling_factor,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
        )
    layer_spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=layer_spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(transformer, layer_spec, use_transformer_engine=False),
    ).to(device)
    return model, prepare_model(model, pm=pm)


def execution_batch(model: Any, batch: MTPBatch) -> MTPBatch:
    """``batch`` laid out for the model's attention: megatron's local attention (CPU) takes no
    packed-sequence parameters, so packed documents run as padded rows, one document each."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if batch.layout.cu_seqlens is None:
        return batch
    if batch.layout.cp_size != 1:
        raise LabelContractError("the harness runs whole sequences (cp_size 1), not CP shards")
    if any(isinstance(m, DotProductAttention) for m in model.modules()):
        return rows(samples_of(batch))
    return batch


@dataclass(frozen=True)
class TokenLosses:
    """One forward's per-token main loss and per-depth MTP losses.

    ``nll[r, i]`` is ``-log p(tokens[r, i + 1] | tokens[r, :i + 1])`` for the batch *as executed*
    (``batch``: packed documents run as padded rows on megatron's local attention, in sample
    order), so ``-nll`` gives the log-probabilities an RL objective needs. It is differentiable,
    and a backward through it also carries every MTP depth's gradient (megatron injects it with
    ``MTPLossAutoScaler``). ``mtp_losses[k - 1]`` is depth k's loss over the positions it trains.
    """

    batch: MTPBatch
    nll: torch.Tensor
    mtp_losses: tuple[float, ...]

    def mean_nll(self) -> torch.Tensor:
        """The main next-token loss: ``nll`` averaged over the positions ``loss_mask`` trains."""
        mask = self.batch.float_mask().to(self.nll.device)
        return (self.nll * mask).sum() / mask.sum().clamp(min=1)


def forward_token_losses(model: Any, batch: MTPBatch) -> TokenLosses:
    """One training-mode forward of a prepared megatron model with MTP, through its adapter."""
    import torch

    from miles_core.hardware.megatron_state import (
        causal_attention_mask,
        clear_mtp_loss_records,
        mtp_loss_sums,
    )

    batch = execution_batch(model, batch)
    device = next(model.parameters()).device
    tokens, mask = batch.tokens.to(device), batch.float_mask().to(device)
    rows_, seq_len = tokens.shape
    kwargs: dict[str, Any] = {}
    if batch.layout.cu_seqlens is not None:
        from miles_mtp.probe import packed_seq_params

        kwargs["packed_seq_params"] = packed_seq_params(batch.layout.cu_seqlens)
    clear_mtp_loss_records()
    model.train()
    output = model(
        input_ids=tokens,
        position_ids=torch.arange(seq_len, device=device).expand(rows_, seq_len),
        attention_mask=causal_attention_mask(seq_len, device),
        loss_mask=mask,
        **kwargs,
    )
    if output.dim() == 3:  # a path that returns logits computes no main loss: do it here
        targets, _, _ = expected_depth(tokens.cpu(), mask.cpu(), batch.layout.cu_seqlens, 0)
        output = torch.nn.functional.cross_entropy(
            output.float().transpose(1, 2), targets.to(device), reduction="none"
        )
    values = mtp_loss_sums()
    if values is None:
        raise RuntimeError("megatron-core recorded no MTP losses for a training-mode forward")
    mtp = tuple(float(v) for v in values)
    return TokenLosses(batch, output, mtp)


def forward_losses(model: Any, batch: MTPBatch) -> tuple[torch.Tensor, tuple[float, ...]]:
    """The main loss (differentiable; its backward carries the MTP gradients too) and each depth's
    MTP loss, from one training-mode forward."""
    losses = forward_token_losses(model, batch)
    return losses.mean_nll(), losses.mtp_losses


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: MTPBatch) -> MTPLosses:
    """Zero the gradients, forward, backward (main + MTP), step; return the step's losses."""
    optimizer.zero_grad(set_to_none=True)
    main, mtp = forward_losses(model, batch)
    main.backward()
    optimizer.step()
    return MTPLosses(float(main.detach()), mtp)


def evaluate(model: Any, batch: MTPBatch) -> MTPLosses:
    """The losses of ``batch`` without a gradient (training-mode forward: megatron reports MTP
    losses only in training mode; the tiny model has no dropout)."""
    import torch

    with torch.no_grad():
        main, mtp = forward_losses(model, batch)
    return MTPLosses(float(main), mtp)
