"""The task protocol: what `miles train` needs, its defaults, and the refusal -- before anything is
built -- of a task that lacks what training needs (the README's old example, as a new user wrote it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.tasks import Prompt, SandboxReward, trainable

register_cpu_ci(est_time=16, suite="stage-a-cpu")

OLD_README_TASK = '''
from dataclasses import dataclass, field

from miles_core.hookspecs import hookimpl


@dataclass(frozen=True)
class AddTask:
    name: str = "add-demo"

    def verify(self) -> None:
        assert self.reward("2+3=", "5") == 1.0

    def reward(self, prompt: str, completion: str) -> float:
        a, b = prompt.rstrip("=").split("+")
        return float(completion.strip()[:1] == str(int(a) + int(b)))


@hookimpl
def miles_tasks():
    return [AddTask()]
'''


def test_defaults_fill_the_optional_attributes() -> None:
    @dataclass(frozen=True)
    class Minimal:
        name: str = "minimal"
        reward: SandboxReward = field(default_factory=lambda: SandboxReward(name="r", program="print('[]')"))

        def prompts(self) -> list[Prompt]:
            return [Prompt(id="a", text="a", answer="b")]

    ready = trainable(Minimal())
    assert (ready.description, ready.has_accuracy, ready.tools, len(ready.prompts)) == ("minimal", True, (), 1)


def test_a_task_lacking_what_training_needs_is_named() -> None:
    namespace: dict[str, object] = {}
    exec(OLD_README_TASK, namespace)
    task = namespace["AddTask"]()  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        trainable(task)
    message = str(info.value)
    assert "task 'add-demo' cannot be trained" in message
    assert "prompts(): the method returning its Prompt list is missing" in message
    assert "reward must take one argument, the batch" in message and "it takes (prompt, completion)" in message


def test_miles_train_refuses_the_old_readme_task_before_building_anything(tmp_path) -> None:
    """As a new user ran it: the plugin installed (on sys.path, by entry point), `miles train --task
    add-demo`. It used to die after 33 s building the model with AttributeError 'prompts'."""
    package = tmp_path / "site" / "miles_arith"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text(textwrap.dedent(OLD_README_TASK))
    dist = tmp_path / "site" / "miles_arith-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-arith\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text('[miles.plugins]\nmiles-arith = miles_arith.plugin\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env.update(PYTHONPATH=str(tmp_path / "site"), MILES_NO_ENTRY_POINT_CACHE="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "miles_core", "train", "--task", "add-demo", "--out",
                           str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "task 'add-demo' cannot be trained" in proc.stderr and "prompts()" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert elapsed < 30, f"refused after {elapsed:.1f} s: something was built first"


def test_the_readme_task_trains_as_written(miles_pm_factory, monkeypatch, tmp_path) -> None:
    """The README's task, on the default config (`miles train --task add-demo`), one step. The
    default model (the tiny Qwen3.5) trains packed, which needs the Gated DeltaNet patch."""
    pytest.importorskip("miles_core.engine.engine")
    qwen35 = pytest.importorskip("miles_qwen35.plugin")
    from miles_core.rl.config import load_config
    from miles_core.rl.loop import train
    from miles_core.testing import plugin_module
    plugin = _readme_plugin(monkeypatch)
    pm = miles_pm_factory(builtins=True)
    pm.register(qwen35, name="miles-qwen35")
    pm.register(plugin_module("arith", miles_tasks=plugin.miles_tasks), name="miles-arith")
    config = load_config(overrides=["task.name=add-demo", "run.steps=1", f'run.out_dir="{tmp_path / "run"}"',
                                    "run.progress=false", "run.plot=false"], pm=pm)
    result = train(config, pm)
    assert result.steps_done == 1 and result.records[0]["train_tokens"] > 0
    assert result.initial_accuracy is not None and result.final_accuracy is not None


def _readme_plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The README's ``miles_arith.plugin`` (its first Python block), importable by name."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    source = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)[0]
    package, plugin = types.ModuleType("miles_arith"), types.ModuleType("miles_arith.plugin")
    monkeypatch.setitem(sys.modules, "miles_arith", package)
    monkeypatch.setitem(sys.modules, "miles_arith.plugin", plugin)
    exec(compile(source, "README:plugin", "exec"), plugin.__dict__)
    return plugin
