"""The README's worked plugin example runs as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_worked_example_plugin_and_its_test(miles_pm, monkeypatch) -> None:
    plugin_src, test_src = python_blocks()[:2]
    package = types.ModuleType("miles_arith")
    plugin = types.ModuleType("miles_arith.plugin")
    package.plugin = plugin
    monkeypatch.setitem(sys.modules, "miles_arith", package)
    monkeypatch.setitem(sys.modules, "miles_arith.plugin", plugin)
    exec(compile(plugin_src, "README:plugin", "exec"), plugin.__dict__)

    task = plugin.miles_tasks()[0]
    task.verify()
    assert task.reward("4+4=", "8") == 1.0 and task.reward("4+4=", "9") == 0.0

    test_ns: dict[str, object] = {}
    exec(compile(test_src, "README:test", "exec"), test_ns)
    test_ns["test_task_is_contributed"](miles_pm)
