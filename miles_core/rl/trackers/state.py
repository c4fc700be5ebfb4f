"""``<out_dir>/trackers.json``: what trackers need to continue a run on ``--resume`` (run ids)."""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.fileio import write_json_atomic

STATE_FILE = "trackers.json"


def load_state(out_dir: Path, tracker: str) -> dict[str, str]:
    path = out_dir / STATE_FILE
    if not path.is_file():
        return {}
    return dict(json.loads(path.read_text()).get(tracker, {}))


def save_state(out_dir: Path, tracker: str, state: dict[str, str]) -> None:
    path = out_dir / STATE_FILE
    everything = json.loads(path.read_text()) if path.is_file() else {}
    everything[tracker] = state
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, everything)
