"""README.md, `miles train --help` and docs/train.md state the same measured numbers for the tiny
preset (steps to greedy accuracy 1.00 and wall time, seeds 0-4)."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.cli import train

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
STEPS = re.compile(r"0\.11 -> 1\.00 in (\d+-\d+)\s+steps")
WALL = re.compile(r"(\d+(?:\.\d+)?-\d+(?:\.\d+)?) s\s+(?:wall\s+)?including\s+start-up")


def _claims(text: str) -> tuple[list[str], list[str]]:
    text = " ".join(text.split())
    return STEPS.findall(text), WALL.findall(text)


def test_the_tiny_preset_claims_agree():
    help_text = CliRunner().invoke(train, ["--help"], terminal_width=200).output
    sources = {
        "miles train --help": help_text,
        "README.md": (ROOT / "README.md").read_text(),
        "docs/train.md": (ROOT / "docs" / "train.md").read_text(),
    }
    claims = {name: _claims(text) for name, text in sources.items()}
    for name, (steps, wall) in claims.items():
        assert len(set(steps)) == 1 and len(set(wall)) == 1, (name, steps, wall)
    assert len({(s[0], w[0]) for s, w in claims.values()}) == 1, claims
    for name, text in sources.items():
        assert "well under a minute" not in text, name
