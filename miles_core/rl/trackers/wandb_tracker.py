"""The ``wandb`` tracker: Weights & Biases, offline by default (no network: the run directory
``<out_dir>/wandb/offline-run-*`` can be uploaded later with ``wandb sync``).

``mode`` (default: ``WANDB_MODE`` if set, else ``offline``) selects online logging; its API key is
an option holding a reference (``api_key = "env:WANDB_API_KEY"``), resolved here and passed to the
SDK's settings only. The run's id is kept in ``<out_dir>/trackers.json`` so ``--resume`` continues
the same W&B run.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_core.rl.trackers.base import Record, TrackerRun, numeric, secret_reference
from miles_core.rl.trackers.state import load_state, save_state


class WandbOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str = Field("miles", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user)")
    name: str | None = Field(None, description="run name (default: the run directory's name)")
    mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="offline (default unless WANDB_MODE is set), online, disabled"
    )
    api_key: str | None = Field(None, description="reference to the API key for online mode: env:NAME or file:/path")

    _reference = field_validator("api_key")(secret_reference)


class WandbSink:
    def __init__(self, run: TrackerRun, options: WandbOptions) -> None:
        import wandb

        settings: dict[str, Any] = {"silent": True, "console": "off"}
        if options.api_key is not None:
            from miles_core.sandbox.secrets import SecretRef

            settings["api_key"] = SecretRef.parse(options.api_key).resolve().reveal()
        state = load_state(run.out_dir, "wandb") if run.resume else {}
        # a WANDB_MODE of the environment is read now and passed on (wandb validates it): wandb
        # itself reads the environment once per process, when its first run starts; miles' default
        # is offline
        mode: Any = options.mode or os.environ.get("WANDB_MODE") or "offline"
        self.run: Any = wandb.init(
            project=options.project, entity=options.entity, name=options.name or run.name,
            dir=str(run.out_dir), mode=mode, config=dict(run.config), id=state.get("id"),
            resume="allow" if state else None, settings=wandb.Settings(**settings), reinit="finish_previous",
        )
        self.directory = Path(self.run.dir).parent  # .../wandb/<offline-run-...>, holds run-<id>.wandb
        save_state(run.out_dir, "wandb", {"id": self.run.id})
        self._closed = False

    def log(self, step: int, record: Record) -> None:
        self.run.log(numeric(record), step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()
            _wait_for_exit_record(self.directory)

    def read_back(self) -> dict[int, dict[str, float]]:
        """This run's history; a resumed offline run writes a directory per process, all read here."""
        out: dict[int, dict[str, float]] = {}
        name = re.compile(rf"-{re.escape(self.run.id)}(-\d+)?$")  # W&B adds -1, -2 within one second
        for directory in sorted(p for p in self.directory.parent.iterdir() if name.search(p.name)):
            for step, values in read_run_directory(directory).items():
                out.setdefault(step, {}).update(values)
        return out


#: how long close() waits for W&B's service process to write the run's exit record
FLUSH_TIMEOUT_S = 60.0


def _wait_for_exit_record(directory: Path) -> None:
    """``finish()`` can return before W&B's service process has written the transaction log out;
    the run is complete on disk once its ``exit`` record is there. The log is read while it is
    being written: a record still running past the end of the file is not there yet."""
    import time

    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while True:
        for log in directory.glob("run-*.wandb"):
            for payload in _log_records(log):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                if record.WhichOneof("record_type") == "exit":
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"W&B did not finish writing {directory} within {FLUSH_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def read_run_directory(directory: Path) -> dict[int, dict[str, float]]:
    """The history a W&B run directory's transaction log (``run-<id>.wandb``) holds."""
    import json

    from wandb.proto import wandb_internal_pb2

    logs = sorted(directory.glob("run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"{directory} holds no run-*.wandb transaction log")
    out: dict[int, dict[str, float]] = {}
    for payload in _log_records(logs[-1]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.pop("_step", record.history.step.num))
        out.setdefault(step, {}).update(
            {k: float(v) for k, v in items.items() if not k.startswith("_") and isinstance(v, (int, float))}
        )
    return out


_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class CorruptLogError(ValueError):
    """A W&B transaction log record whose checksum does not match its bytes."""


def _log_records(path: Path) -> Iterator[bytes]:
    """The complete payloads of W&B's transaction log: a 7-byte file header (``:W&B``, magic,
    version), then LevelDB-log blocks of 32 KiB holding records of ``checksum u32, length u16,
    type u8, data``, the checksum being CRC-32 of the type byte and the data.

    A record that runs past the end of the file is the one being appended while we read: it and
    anything after it are left for a later read. A checksum mismatch in a record that is all
    there is corruption, and raises naming the file and offset."""
    data = path.read_bytes()
    if len(data) < _HEADER:
        return
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:_HEADER]!r})")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        end = pos + _HEADER + length
        if end > len(data):
            return
        payload = data[pos + _HEADER : end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != checksum:
            raise CorruptLogError(f"{path}: record at byte {pos} fails its checksum")
        pos = end
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""
