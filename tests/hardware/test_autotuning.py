"""``miles doctor`` runs autotuned Triton kernels on one config each (no benchmarking).

CI has no Triton (CPU), so the autotuner here is a stand-in with Triton 3.6's control flow: ``run``
times (``_bench``: compiles and launches) every config ``prune_configs`` returns when a kernel has
several, and takes the fastest.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware.autotuning import first_config_autotuning

register_cpu_ci(est_time=5, suite="stage-a-cpu")


class _Autotuner:
    def __init__(self, configs: list[str], early_config_prune: Any = None) -> None:
        self.configs = configs
        self.early_config_prune = early_config_prune
        self.benchmarked: list[str] = []
        self.launched: list[str] = []

    def prune_configs(self, kwargs: dict[str, Any]) -> list[str]:
        if self.early_config_prune:
            return self.early_config_prune(self.configs, kwargs)
        return self.configs

    def _bench(self, *args: Any, config: str, **meta: Any) -> list[float]:
        self.launched.append(config)
        return [float(ord(config[0]))] * 3

    def run(self, **kwargs: Any) -> str:
        if len(self.configs) > 1:
            pruned = self.prune_configs(kwargs)
            self.benchmarked += pruned
            timings = {config: self._bench(config=config) for config in pruned}
            return min(timings, key=timings.__getitem__)
        return self.configs[0]


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> type[_Autotuner]:
    module = types.ModuleType("triton.runtime.autotuner")
    module.Autotuner = _Autotuner  # type: ignore[attr-defined]
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", module)
    return _Autotuner


def test_inside_the_context_each_kernel_benchmarks_one_config_and_after_it_all(fake_triton: type[_Autotuner]) -> None:
    with first_config_autotuning() as active:
        assert active
        tuner = fake_triton(["c", "b", "a"])
        assert tuner.run() == "c"
        assert tuner.benchmarked == ["c"]
        assert tuner.launched == []  # chosen without timing it
        # the kernel's own pruning still decides which configs may run at all
        pruned = fake_triton(["c", "b", "a"], early_config_prune=lambda configs, kw: configs[1:])
        pruned.run()
        assert pruned.benchmarked == ["b"]
    after = fake_triton(["c", "b", "a"])
    assert after.run() == "a"
    assert after.benchmarked == after.launched == ["c", "b", "a"]


def test_the_autotuner_is_restored_when_a_check_raises(fake_triton: type[_Autotuner]) -> None:
    prune, bench = fake_triton.prune_configs, fake_triton._bench
    with pytest.raises(RuntimeError), first_config_autotuning():
        raise RuntimeError("a failing self-check")
    assert (fake_triton.prune_configs, fake_triton._bench) == (prune, bench)


def test_without_triton_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    # importing any of it raises ImportError, also where this process had imported Triton (a GPU
    # host's torch does): a cached submodule would be found without its package
    for name in ["triton", *(n for n in sys.modules if n.startswith("triton."))]:
        monkeypatch.setitem(sys.modules, name, None)
    with first_config_autotuning() as active:
        assert not active


SEEN: list[list[str]] = []


def _check_running_a_kernel(pm: Any) -> list[Any]:
    tuner = sys.modules["triton.runtime.autotuner"].Autotuner(["c", "b", "a"])
    tuner.run()
    SEEN.append(tuner.benchmarked)
    return []


def test_the_doctor_runs_its_checks_without_autotuning(fake_triton: type[_Autotuner], monkeypatch: pytest.MonkeyPatch) -> None:
    import miles_core.doctor as doctor
    from miles_core.plugins import get_plugin_manager

    monkeypatch.setattr(doctor, "CONCERN_CHECKS", [("kernels", f"{__name__}:_check_running_a_kernel")])
    SEEN.clear()
    doctor.run_doctor(get_plugin_manager())
    assert SEEN == [["c"]]
