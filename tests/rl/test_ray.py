"""The same loop under Ray: placement group, actors, fingerprint checks; equal to in-process."""

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.config import load_config
from miles_core.rl.loop import train
from miles_core.rl.metrics import deterministic_view

register_cpu_ci(est_time=48, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

ray = pytest.importorskip("ray")


def test_ray_run_equals_inprocess_run(direct_overrides, tmp_path):
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.orchestrators.ray import build_ray

    pm = get_plugin_manager()  # the actors discover plugins from entry points: so does the driver
    base = load_config(overrides=[direct_overrides, {"run": {"steps": 2, "out_dir": str(tmp_path / "local")}}])
    local = train(base, pm)
    remote_config = load_config(overrides=[
        direct_overrides,
        {"run": {"steps": 2, "out_dir": str(tmp_path / "ray")}, "orchestrator": {"kind": "ray", "rollout_workers": 2}},
    ])
    try:
        remote = train(remote_config, pm, build=build_ray)
    finally:
        ray.shutdown()
    assert remote.report["orchestrator"] == "ray" and remote.report["actors"]["rollout"] == 2
    assert remote.report["fingerprint"] == pm.fingerprint()["digest"]
    assert len(remote.records) == len(local.records) == 2
    for got, want in zip(remote.records, local.records):
        got, want = deterministic_view(got), deterministic_view(want)
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
            else:
                assert got[key] == value, key


def test_fingerprint_mismatch_is_refused(miles_pm_factory):
    from miles_core.rl.orchestrators.fingerprint import FingerprintMismatch, check_fingerprint

    pm = miles_pm_factory(builtins=True)
    expected = pm.fingerprint()
    assert check_fingerprint(expected, "trainer")["plugins"] == expected["plugins"]
    tampered = {**expected, "digest": "0" * 64, "plugins": [*expected["plugins"], ["miles-extra", "x", "1", "ok"]]}
    with pytest.raises(FingerprintMismatch, match=r"trainer worker loaded different plugins.*miles-extra"):
        check_fingerprint(tampered, "trainer")
