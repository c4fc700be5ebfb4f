"""The ``hf`` trainer backend: a transformers causal LM trained with torch (AdamW).

The model is loaded from the same Hugging Face directory the engine serves, prepared with
:func:`miles_core.patches.prepare_model` (every matching patch applied and verified on this
model), then checked by the packing guard before the first step.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_core.hardware.devices import rank_device, to_host
from miles_core.patches.packing import PACKING_KWARG, packed_sequences
from miles_core.rl.algorithms.base import Algorithm
from miles_core.rl.algorithms.batch import PackedRow, TrainDocument
from miles_core.rl.config import TrainConfig
from miles_core.rl.policy_update import DataParallel, UpdateSettings, policy_update
from miles_core.rl.tensor_tree import load_tree, save_tree
from miles_core.rl.trainers.compile import compile_regions
from miles_core.rl.trainers.fsdp import RankGroup, init_rank, shard_model
from miles_core.rl.trainers.packing_guard import branches_supported, check_packing_safe

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "miles_asset.json")


def load_causal_lm(model_dir: Path, dtype: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    # transformers decorates to() with functools.wraps(Module.to), which types it as the unbound method
    return model.to(device)  # type: ignore[arg-type]


def gathered_tensors(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict as the tensors it holds; anything else is an error naming it."""
    others = sorted(name for name, value in state.items() if not isinstance(value, torch.Tensor))
    if others:
        raise TypeError(f"the gathered model state holds non-tensor values at {others[:5]} ({len(others)} in all)")
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def row_inputs(row: PackedRow, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of ``row``'s forward on ``device`` (its packing context included)."""
    position_ids = row.position_ids[None].to(device)
    inputs: dict[str, Any] = {
        "input_ids": row.input_ids[None].to(device),
        "position_ids": position_ids,
        "use_cache": False,
        "logits_to_keep": row.positions.to(device),
    }
    if row.branches is not None:
        inputs[PACKING_KWARG] = packed_sequences(position_ids, branches=row.branches)
    return inputs


def target_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``model``'s logits at a row's trained targets only, ``[K, vocab]`` (``logits_to_keep``: the
    LM head and the log-softmax skip every other position), given its :func:`row_inputs`."""
    return model(**inputs).logits[0]


class HFPolicy:
    """One process's part of the hf trainer: the model, its optimizer and the KL reference.

    With ``dp`` (``trainer.world_size > 1``) the model is sharded with FSDP2 across the ranks and
    every method is a collective that all ranks call in the same order (:mod:`.fsdp`); the KL
    reference stays a whole copy on each rank (forward only, no collectives).
    """

    def __init__(self, model_dir: Path, config: TrainConfig, device: torch.device, dp: DataParallel | None,
                 algorithm: Algorithm) -> None:
        from miles_core.patches import prepare_model

        self.model_dir = Path(model_dir)
        self.device = device
        self.dp = dp
        self.model = load_causal_lm(self.model_dir, config.model.dtype, device)
        patch_report = prepare_model(self.model, packed=config.trainer.packing)
        applied = getattr(patch_report, "applied", None)
        leak = check_packing_safe(self.model, packing=config.trainer.packing, applied=applied)
        if config.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        algo = config.algorithm
        self.reference = None
        if algo.kl_coef:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        sharded = shard_model(self.model, device) if dp else []
        compiled = []
        if config.trainer.compile:
            compiled = compile_regions(self.model)
            if self.reference is not None:
                compile_regions(self.reference)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        # a shared prompt copy needs attention that reads the row's branches (the packed attention
        # prepare_model installed) and recurrent layers that fork their state after the prompt
        share = (config.trainer.share_prompts and config.trainer.packing and patch_report.packed_attention
                 and branches_supported(self.model))
        self.settings = UpdateSettings.from_config(config, algorithm, share_prompts=share)
        self.report = {
            "backend": "hf",
            "algorithm": algorithm.name,
            "patches": _describe_report(patch_report),
            "packing_leak": leak,
            "compiled": compiled,
            "world_size": dp.world_size if dp else 1,
            "fsdp_sharded": sharded,
            "shared_prompts": share,
            "merge_duplicates": self.settings.merge_duplicates,
        }

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        # the policy's and the reference's forwards of a row follow each other: they share its
        # inputs, and through its packing context the attention's plan (built once, not twice)
        last: list[Any] = [None, None]  # [row, its inputs]

        def inputs(row: PackedRow) -> dict[str, Any]:
            if last[0] is not row:
                last[:] = [row, row_inputs(row, self.device)]
            return last[1]

        def forward(row: PackedRow) -> torch.Tensor:
            return target_logits(self.model, inputs(row))

        reference = self.reference
        reference_forward = (lambda row: target_logits(reference, inputs(row))) if reference is not None else None
        return policy_update(
            docs, forward, self.optimizer, self.model.parameters(), self.settings, reference=reference_forward, dp=self.dp
        )

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (under FSDP: gathered to rank 0, in CPU memory; empty elsewhere)."""
        if self.dp is None:
            return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return gathered_tensors(state)

    def save(self, directory: Path) -> None:
        state = self.full_state()
        optimizer_state = self._optimizer_state()
        if self.dp is not None and self.dp.rank != 0:
            return
        directory.mkdir(parents=True, exist_ok=True)
        state = to_host(state)  # the hardware backend's checkpoint_io says how
        self.model.save_pretrained(directory / "model", state_dict=state, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, directory / "model" / name)
        save_tree(directory / "optimizer", optimizer_state)

    def _optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name, so any world size can load it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.dp is not None)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state: dict[str, ValueType] = {}
        for shard in sorted((directory / "model").glob("*.safetensors")):
            state.update(load_file(shard))
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        expected = set(self.model.state_dict())
        missing, unexpected = expected - set(state) - tied, set(state) - expected
        if unexpected or missing:
            raise RuntimeError(f"checkpoint {directory}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        optimizer_state = load_tree(directory / "optimizer")
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, state, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)


class HFTrainer:
    """The ``hf`` backend: one :class:`HFPolicy` here, plus ranks 1..N-1 when ``trainer.world_size > 1``."""

    def __init__(self, model_dir: Path, config: TrainConfig, device: torch.device, algorithm: Algorithm) -> None:
        world_size = config.trainer.world_size
        self.group: RankGroup | None = None
        dp = None
        if world_size > 1:
            self.group = RankGroup(world_size, model_dir, config, device)
            try:
                self.group.replies()  # every rank checked the plugin fingerprint and has its device
                device = rank_device(device, 0)
                init_rank(0, world_size, self.group.store, device)
                dp = DataParallel(0, world_size, device)
                self.policy = HFPolicy(model_dir, config, device, dp, algorithm)
                self.group.replies()  # every rank built its shard
            except BaseException:
                self.group.kill()  # they may be waiting for this rank inside a collective
                self.group = None
                _leave_process_group()
                raise
        else:
            self.policy = HFPolicy(model_dir, config, device, None, algorithm)
        self.report = self.policy.report

    def _everywhere(self, command: str, *args: Any) -> Any:
        """``self.policy.<command>(*args)``, on every rank when there are several."""
        if self.group is None:
            return getattr(self.policy, command)(*args)
        return self.group.run(self.policy, command, *args)

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        return self._everywhere("train", docs)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self._everywhere("full_state")

    def save(self, directory: Path) -> None:
        self._everywhere("save", directory)

    def load(self, directory: Path) -> None:
        self._everywhere("load", directory)

    def close(self) -> None:
        if self.group is None:
            return
        self.group.close()
        self.group = None
        _leave_process_group()


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _describe_report(report: Any) -> Any:
    """The patch report as plain data for the run summary."""
    if hasattr(report, "to_dict"):
        return report.to_dict()
    return report if isinstance(report, (dict, list, str)) else repr(report)
