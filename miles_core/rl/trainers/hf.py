"""The ``hf`` trainer backend: a transformers causal LM trained with torch (AdamW).

The model is loaded from the same Hugging Face directory the engine serves, prepared with
:func:`miles_core.patches.prepare_model` (every matching patch applied and verified on this
model), then checked by the packing guard before the first step.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles_core.rl.algorithms import PackedRow, TrainDocument
from miles_core.rl.config import TrainConfig
from miles_core.rl.policy_update import UpdateSettings, policy_update
from miles_core.rl.trainers.packing_guard import check_packing_safe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "miles_asset.json")


def load_causal_lm(model_dir: Path, dtype: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device)


class HFTrainer:
    def __init__(self, model_dir: Path, config: TrainConfig, device: torch.device) -> None:
        from miles_core.patches import prepare_model

        self.model_dir = Path(model_dir)
        self.config = config
        self.device = device
        self.model = load_causal_lm(self.model_dir, config.model.dtype, device)
        patch_report = prepare_model(self.model)
        applied = getattr(patch_report, "applied", None)
        leak = check_packing_safe(self.model, packing=config.trainer.packing, applied=applied)
        if config.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        algo = config.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        self.reference = None
        if algo.kl_coef:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.settings = UpdateSettings(
            algorithm=algo,
            temperature=config.rollout.temperature,
            max_tokens_per_row=config.trainer.max_tokens_per_row,
            packing=config.trainer.packing,
        )
        self.report = {"backend": "hf", "patches": _describe_report(patch_report), "packing_leak": leak}

    def _forward(self, row: PackedRow, model: Any | None = None) -> torch.Tensor:
        model = model or self.model
        out = model(
            input_ids=row.input_ids[None].to(self.device),
            position_ids=row.position_ids[None].to(self.device),
            use_cache=False,
        )
        return out.logits[0]

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        reference = (lambda row: self._forward(row, self.reference)) if self.reference is not None else None
        return policy_update(
            docs, self._forward, self.optimizer, self.model.parameters(), self.settings, reference=reference
        )

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory / "model", safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, directory / "model" / name)
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for shard in sorted((directory / "model").glob("*.safetensors")):
            state.update(load_file(shard))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"checkpoint {directory}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))


def _describe_report(report: Any) -> Any:
    """The patch report as plain data for the run summary."""
    if hasattr(report, "to_dict"):
        return report.to_dict()
    return report if isinstance(report, (dict, list, str)) else repr(report)
