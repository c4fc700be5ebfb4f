"""Checkpoints: trainer state (weights in Hugging Face layout, optimizer), RNG, data cursor.

Layout of ``<out_dir>/checkpoints/step_000010/``::

    model/                config.json, model.safetensors, tokenizer files (loads with from_pretrained)
    optimizer.safetensors optimizer state (tensors) + optimizer.json (its structure)
    rng.safetensors       torch (and the accelerator's) generator states + rng.json (python's state, structure)
    state.json            step, data cursor, weight version, config, and the size and sha256 of
                          every other file -- written last: its presence marks the checkpoint complete

Nothing is loaded with pickle (:mod:`miles_core.rl.tensor_tree`): a tampered checkpoint is at worst
refused. A checkpoint is written into a staging directory, every file and directory fsynced, then
renamed into place, so a kill or a full disk leaves the previous checkpoint as the latest (and no
staging directory behind). Before a run resumes, before anything is built, the newest checkpoint
whose files match their recorded sizes and hashes is chosen; a damaged newer one is skipped with
a warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_core.errors import ConfigError, MilesError
from miles_core.hardware.devices import device_rng_state, restore_device_rng_state
from miles_core.rl.tensor_tree import TreeError, load_tree, save_tree

if TYPE_CHECKING:
    from miles_core.rl.trainers.base import Trainer

STATE = "state.json"
RNG = "rng"
#: files of checkpoints written before manifests and tensor trees (pickles): never loaded
PICKLES = ("rng.pt", "optimizer.pt")


class CheckpointError(MilesError):
    """A checkpoint that cannot be written (full disk) or read back."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


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
    """Complete checkpoints (a ``state.json`` was written), oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and (p / STATE).is_file())


def save_checkpoint(out_dir: Path, trainer: Trainer, state: LoopState, keep: int) -> Path:
    """Write the checkpoint of ``state`` (see the module doc); returns its directory.

    A full disk raises :class:`CheckpointError` in one line naming the directory and the bytes
    needed, with the staging directory removed. When an earlier checkpoint shows how much a
    checkpoint takes, too little free space is refused before anything is written.
    """
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{state.step:06d}"
    staging = root / f".staging_{state.step:06d}"
    shutil.rmtree(staging, ignore_errors=True)
    previous = list_checkpoints(out_dir)
    needed = _size(previous[-1]) if previous else None
    free = shutil.disk_usage(root).free
    if needed is not None and free < needed:
        raise CheckpointError(
            f"checkpoint {target}: {free} bytes free on its disk, a checkpoint of this run takes {needed}; "
            "free space or lower run.keep_checkpoints"
        )
    try:
        staging.mkdir()
        trainer.save(staging)
        save_tree(staging / RNG, rng_state())
        files = _seal(staging)
        _write_synced(staging / STATE, json.dumps({**asdict(state), "files": files}, indent=1, sort_keys=True))
        _fsync_directory(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        _fsync_directory(root)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(exc):
            previous_size = f", the previous one took {needed}" if needed is not None else ""
            raise CheckpointError(
                f"checkpoint {target}: the disk is full (this checkpoint needs more than the {free} bytes "
                f"that were free{previous_size}); nothing was kept of it, the previous checkpoint is intact"
            ) from None
        raise
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old)
    return target


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    device = device_rng_state()  # the active hardware backend's devices (None on the host)
    if device is not None:
        state["cuda"] = device  # the key checkpoints have always used for the device generators
    return state


def read_state(checkpoint: Path) -> LoopState:
    try:
        data = json.loads((checkpoint / STATE).read_text())
        data.pop("files", None)
        return LoopState(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"checkpoint {checkpoint}: unreadable {STATE} ({exc})") from None


def problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed (``None`` if its files match their manifest)."""
    try:
        data = json.loads((checkpoint / STATE).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable {STATE} ({exc})"
    pickles = [name for name in PICKLES if (checkpoint / name).exists()]
    files = data.get("files") if isinstance(data, dict) else None
    if pickles or not isinstance(files, dict):
        return (f"written by an older miles ({', '.join(pickles) or 'no file manifest'}): miles no longer "
                "loads pickled checkpoints; start a new run")
    for name, expected in sorted(files.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{name} has {size} bytes, {expected.get('bytes')} were written"
        if _sha256(path) != expected.get("sha256"):
            return f"{name} does not match the hash recorded when it was written"
    return None


def latest_valid(out_dir: Path) -> Path | None:
    """The newest checkpoint whose files are intact; each damaged newer one is skipped with a
    :class:`CheckpointWarning`. Raises :class:`ConfigError` when checkpoints exist but none is intact."""
    checkpoints = list_checkpoints(out_dir)
    damaged: list[str] = []
    for checkpoint in reversed(checkpoints):
        why = problem(checkpoint)
        if why is None:
            if damaged:
                warnings.warn(
                    f"skipped damaged checkpoint(s) {'; '.join(damaged)}; resuming from {checkpoint.name}",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return checkpoint
        damaged.append(f"{checkpoint.name}: {why}")
    if damaged:
        raise ConfigError(f"--resume: no intact checkpoint in {checkpoint_root(out_dir)} ({'; '.join(damaged)})")
    return None


def restore_rng(checkpoint: Path) -> None:
    try:
        state = load_tree(checkpoint / RNG)
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
    except (TreeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: unusable RNG state ({exc})") from None
    if "cuda" in state and device_rng_state() is not None:
        restore_device_rng_state(state["cuda"])


def _seal(directory: Path) -> dict[str, dict[str, Any]]:
    """fsync every file under ``directory`` (and its subdirectories); their sizes and hashes."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            os.fsync(fh.fileno())
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": digest}
    for sub in sorted(p for p in directory.rglob("*") if p.is_dir()):
        _fsync_directory(sub)
    return files


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


#: what libraries that write through their own I/O layers say when the disk is full
_FULL_DISK_TEXT = ("No space left on device", "StorageFull", "unexpected pos", "Disk quota exceeded")


def _disk_full(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in _FULL_DISK_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_resumable(saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse to resume under settings that change what the steps compute (run length may grow).

    A setting the checkpoint does not record (added to miles after it was written) is the same
    run when it has its default value now: that is what the run computed before the setting
    existed."""
    # run.out_dir and run.runs_dir are where the run lives, not what it computes: a moved run, or
    # one named by a relative path, is the same run
    ignored = {("run", "steps"), ("run", "progress"), ("run", "plot"), ("run", "out_dir"), ("run", "runs_dir"),
               ("orchestrator", "kind"),
               ("orchestrator", "address"), ("run", "checkpoint_every"), ("run", "keep_checkpoints"),
               ("run", "trackers"), ("run", "tracker_options")}
    diffs = []
    for section, values in current.items():
        for key, value in values.items():
            saved_section = saved.get(section, {})
            if key not in saved_section and value == defaults.get(section, {}).get(key):
                continue
            old = saved_section.get(key)
            if (section, key) not in ignored and old != value:
                diffs.append(f"{section}.{key}: checkpoint has {old!r}, now {value!r}")
    if diffs:
        raise ConfigError("cannot resume with a different configuration: " + "; ".join(diffs))
