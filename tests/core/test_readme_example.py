"""The README's worked plugin example runs as written, and its task is trainable as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def readme_plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The README's ``miles_arith.plugin``, importable as in an installed distribution."""
    package = types.ModuleType("miles_arith")
    plugin = types.ModuleType("miles_arith.plugin")
    package.plugin = plugin  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "miles_arith", package)
    monkeypatch.setitem(sys.modules, "miles_arith.plugin", plugin)
    exec(compile(python_blocks()[0], "README:plugin", "exec"), plugin.__dict__)
    return plugin


def test_worked_example_plugin_and_its_test(miles_pm, monkeypatch) -> None:
    from miles_core.rl.tasks import RewardInput, trainable

    plugin = readme_plugin(monkeypatch)
    task = plugin.miles_tasks()[0]
    task.verify()
    inputs = [RewardInput("4+4", "4+4=", "8", completion=c, first_token=c[:1]) for c in ("8", "9", " 8 ")]
    assert task.reward(inputs) == [1.0, 0.0, 1.0]
    ready = trainable(task)  # everything `miles train` needs, defaults filled in
    assert len(ready.prompts) == 55 and ready.has_accuracy and ready.tools == ()

    test_ns: dict[str, object] = {}
    exec(compile(python_blocks()[1], "README:test", "exec"), test_ns)
    test_ns["test_task_is_contributed"](miles_pm)  # type: ignore[operator]
