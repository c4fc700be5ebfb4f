"""The loop's start-up runs with automatic garbage collection paused; the steps run with it on,
and a start-up that fails leaves the collector as it found it."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl import registry
from miles_core.rl.config import load_config
from miles_core.rl.loop import train

register_cpu_ci(est_time=12, suite="stage-a-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")


class RecordingRollout:
    """The built rollout, noting whether the collector is on each time a step calls it."""

    def __init__(self, inner: Any, seen: list[bool]) -> None:
        self.inner, self.seen = inner, seen
        self.label = inner.label

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(gc.isenabled())
        return self.inner.run(*args, **kwargs)

    def close(self) -> None:
        self.inner.close()


def test_build_runs_paused_and_steps_run_collected(miles_pm_factory, direct_overrides) -> None:
    config = load_config(overrides=[direct_overrides, {"run": {"steps": 2}}])
    pm = miles_pm_factory(builtins=True)
    during_build: list[bool] = []
    during_steps: list[bool] = []

    def build(config, pm, parts):
        during_build.append(gc.isenabled())
        runtime = registry.orchestrator(pm, config).build(config, pm, parts)
        runtime.rollout = RecordingRollout(runtime.rollout, during_steps)
        return runtime

    assert gc.isenabled()
    result = train(config, pm, build=build)
    assert result.steps_done == 2
    assert during_build == [False]
    assert during_steps == [True, True]
    assert gc.isenabled()


def test_a_failed_build_restores_the_collector(miles_pm_factory, direct_overrides) -> None:
    config = load_config(overrides=[direct_overrides, {"run": {"steps": 1}}])

    def build(config, pm, parts):
        assert not gc.isenabled()
        raise RuntimeError("the build broke")

    with pytest.raises(RuntimeError, match="the build broke"):
        train(config, miles_pm_factory(builtins=True), build=build)
    assert gc.isenabled()
