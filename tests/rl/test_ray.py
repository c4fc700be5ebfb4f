"""The same loop under Ray: placement group, actors, fingerprint checks; compared with in-process.

What holds (docs/train.md, Orchestration): a Ray run draws the same prompts, seeds and samples as
the in-process run, and its metrics are equal to the bit wherever the engine gets a step's requests
in the same batches: with one rollout worker, on the direct path (one ``generate`` a step) and on
the agentic path (the worker calls the engine actor's session service with Ray, one batch a phase,
as in-process). Several workers each send their own slice, one batch at a time (the actor runs one
call at a time); a CPU matmul rounds a row differently with the number of rows beside it, so the
rollout log-probs, and the float metrics after them, differ from the in-process run's in their last
bits -- but not from another run's with the same workers.
"""

import math

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.config import load_config
from miles_core.rl.loop import train
from miles_core.rl.metrics import deterministic_view

register_cpu_ci(est_time=65, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

ray = pytest.importorskip("ray")

#: what a step sampled and scored (exact whenever the samples are the same)
SAMPLE_KEYS = ("step", "weight_version", "rollout_weight_versions", "reward_mean", "greedy_accuracy",
               "response_length_mean", "turns_mean")
#: counts of samples merged because their tokens *and log-probs* are equal to the bit
MERGE_KEYS = ("merged_samples", "train_tokens")


def _tiny(out_dir, **sections):
    """The tiny preset (the runs docs/train.md describes), quiet, in ``out_dir``."""
    run = {"out_dir": str(out_dir), "progress": False, "plot": False, **sections.pop("run", {})}
    return load_config("tiny", overrides=[{**sections, "run": run}])


def _ray_train(config, pm):
    from miles_core.rl.orchestrators.ray import build_ray

    try:
        return train(config, pm, build=build_ray)
    finally:
        ray.shutdown()


def first_difference(got, want):
    """``(step, key, got, want)`` of the first non-timing value that is not the same to the bit; ``None``."""
    if len(got) != len(want):
        return (min(len(got), len(want)), "<steps>", len(got), len(want))
    for g, w in zip(got, want):
        g, w = deterministic_view(g), deterministic_view(w)
        for key in sorted(g.keys() | w.keys()):
            a, b = g.get(key, "<missing>"), w.get(key, "<missing>")
            if type(a) is not type(b) or a != b:
                return (w["step"], key, a, b)
    return None


@pytest.mark.parametrize("path", ["direct", "agentic"])
def test_ray_run_equals_inprocess_run_exactly(tmp_path, path):
    """A whole tiny run, one rollout worker: every non-timing metric of every step equal to the bit
    (over HTTP, the agentic path's turns batched by arrival diverged at step 19)."""
    from miles_core.plugins import get_plugin_manager

    pm = get_plugin_manager()  # the actors discover plugins from entry points: so does the driver
    local = train(_tiny(tmp_path / "local", rollout={"path": path}), pm)
    remote = _ray_train(_tiny(tmp_path / "ray", rollout={"path": path}, orchestrator={"kind": "ray"}), pm)
    assert remote.report["orchestrator"] == "ray" and remote.report["actors"]["rollout"] == 1
    assert remote.report["fingerprint"] == pm.fingerprint()["digest"]
    assert local.stopped_early and local.steps_done >= 20, "the run no longer covers the steps where drift showed"
    assert first_difference(remote.records, local.records) is None
    assert (remote.steps_done, remote.final_accuracy) == (local.steps_done, local.final_accuracy)
    # control: the comparison sees one ulp of one metric at the last step
    bumped = [dict(r) for r in local.records]
    bumped[-1]["loss"] = math.nextafter(bumped[-1]["loss"], math.inf)
    assert first_difference(bumped, local.records)[:2] == (local.records[-1]["step"], "loss")


def test_ray_agentic_run_with_two_workers_samples_as_inprocess(tmp_path):
    """The tiny preset as `miles train --preset tiny --orchestrator ray` runs it (agentic, through
    the engine actor's session service), split over two rollout workers: the first steps sample and
    score exactly the same; the float metrics agree to their last bits only (see the module doc),
    and a second Ray run with two workers repeats the first to the bit."""
    from miles_core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    steps = {"run": {"steps": 3}}
    local = train(_tiny(tmp_path / "local", **steps), pm)
    orchestrator = {"kind": "ray", "rollout_workers": 2}
    remote = _ray_train(_tiny(tmp_path / "ray", orchestrator=orchestrator, **steps), pm)
    again = _ray_train(_tiny(tmp_path / "ray-again", orchestrator=orchestrator, **steps), pm)
    assert first_difference(again.records, remote.records) is None
    assert remote.report["actors"]["rollout"] == 2
    assert len(remote.records) == len(local.records) == 3
    for got, want in zip(remote.records, local.records):
        got, want = deterministic_view(got), deterministic_view(want)
        assert got.keys() == want.keys()
        for key in SAMPLE_KEYS:
            assert got[key] == want[key], (want["step"], key)
        for key, value in want.items():
            if key not in SAMPLE_KEYS and key not in MERGE_KEYS:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (want["step"], key)


def test_fingerprint_mismatch_is_refused(miles_pm_factory):
    from miles_core.rl.orchestrators.fingerprint import FingerprintMismatch, check_fingerprint

    pm = miles_pm_factory(builtins=True)
    expected = pm.fingerprint()
    assert check_fingerprint(expected, "trainer")["plugins"] == expected["plugins"]
    tampered = {**expected, "digest": "0" * 64, "plugins": [*expected["plugins"], ["miles-extra", "x", "1", "ok"]]}
    with pytest.raises(FingerprintMismatch, match=r"trainer worker loaded different plugins.*miles-extra"):
        check_fingerprint(tampered, "trainer")
