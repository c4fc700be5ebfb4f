"""Checkpoints: trainer state (weights in Hugging Face layout, optimizer), RNG, data cursor.

Layout of ``<out_dir>/checkpoints/step_000010/``::

    model/            config.json, model.safetensors, tokenizer files (loads with from_pretrained)
    optimizer.pt      optimizer state
    rng.pt            python, torch (and CUDA) generator states
    state.json        step, data cursor, weight version, config -- written last: its presence
                      marks the checkpoint complete

A checkpoint is written into a temporary directory and renamed into place, so a kill during
the write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import ConfigError

STATE = "state.json"


@dataclass(frozen=True)
class LoopState:
    """What the loop needs to continue exactly where it stopped."""

    step: int  # the last completed step
    cursor: dict[str, int]  # the prompt sampler's position
    weight_version: str
    config: dict[str, Any]


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and (p / STATE).is_file())


def save_checkpoint(out_dir: Path, trainer: Any, state: LoopState, keep: int) -> Path:
    root = checkpoint_root(out_dir)
    target = root / f"step_{state.step:06d}"
    staging = root / f".staging_{state.step:06d}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    trainer.save(staging)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, staging / "rng.pt")
    (staging / STATE).write_text(json.dumps(asdict(state), indent=1, sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old)
    return target


def read_state(checkpoint: Path) -> LoopState:
    try:
        return LoopState(**json.loads((checkpoint / STATE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"checkpoint {checkpoint}: unreadable {STATE} ({exc})") from None


def restore_rng(checkpoint: Path) -> None:
    rng = torch.load(checkpoint / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume under settings that change what the steps compute (run length may grow)."""
    ignored = {("run", "steps"), ("run", "progress"), ("run", "plot"), ("orchestrator", "kind"),
               ("orchestrator", "address"), ("run", "checkpoint_every"), ("run", "keep_checkpoints")}
    diffs = []
    for section, values in current.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key)
            if (section, key) not in ignored and old != value:
                diffs.append(f"{section}.{key}: checkpoint has {old!r}, now {value!r}")
    if diffs:
        raise ConfigError("cannot resume with a different configuration: " + "; ".join(diffs))
