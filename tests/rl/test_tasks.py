import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.builtin import first_token_reward, miles_tasks
from miles_core.rl.tasks import RewardInput, SandboxReward, resolve_reward

register_cpu_ci(est_time=4, suite="stage-a-cpu")


def _input(answer, first):
    return RewardInput(prompt_id="x", prompt="?", answer=answer, completion=first, first_token=first)


def _task(name):
    return next(t for t in miles_tasks() if t.name == name)


def test_arithmetic_task_prompts():
    task = _task("arith-add")
    task.verify()
    prompts = task.prompts()
    assert len(prompts) == 55 and prompts[0].text == "0+0=" and prompts[-1].text == "9+0="
    assert all(int(p.answer) == int(p.text[0]) + int(p.text[2]) <= 9 for p in prompts)
    assert prompts[3].chat() == [{"role": "user", "content": "0+3="}]
    successor = _task("arith-next")
    successor.verify()
    assert [p.answer for p in successor.prompts()] == [str(n) for n in range(1, 10)]


def test_builtin_plugin_contributes_the_task(miles_pm_factory):
    pm = miles_pm_factory(builtins=True)
    names = [c.name for c in pm.active_contributions("tasks")]
    assert {"arith-add", "arith-next"} <= set(names)


def test_sandboxed_checker_program_matches_in_process_twin(tmp_path):
    import json
    import subprocess
    import sys

    inputs = [_input("7", "7"), _input("7", "1"), _input("0", "0"), _input("3", " ")]
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps([i.to_json() for i in inputs]))
    program = tmp_path / "check.py"
    reward = _task("arith-add").reward
    program.write_text(reward.program)
    out = subprocess.run([sys.executable, str(program), str(batch)], capture_output=True, text=True, check=True)
    assert reward.decode(out.stdout, len(inputs)) == first_token_reward(inputs) == [1.0, 0.0, 1.0, 0.0]


def test_a_reward_input_document_has_every_field_in_order():
    from dataclasses import asdict

    item = _input("7", "1")
    document = item.to_json()
    assert document == asdict(item) and list(document) == list(asdict(item))
    document["completion"] = "changed"  # a copy: the frozen input stays as it was
    assert item.completion == "1" and item.to_json() == asdict(item)


@pytest.mark.parametrize("stdout", ["not json", "[1.0]", '[1.0, "x"]', "[1.0, NaN]", '{"a": 1}'])
def test_sandbox_reward_rejects_malformed_output(stdout):
    with pytest.raises(RuntimeError, match="reward 'r'"):
        SandboxReward(name="r", program="").decode(stdout, 2)


def test_resolve_reward():
    assert resolve_reward("miles_core.rl.builtin:first_token_reward") is first_token_reward
    for bad, needle in [("nocolon", "expected 'module:attr'"), ("miles_core.rl.builtin:nope", "cannot import"),
                        ("miles_core.rl.builtin:FIRST_TOKEN_CHECKER", "neither")]:
        with pytest.raises(ConfigError, match=needle):
            resolve_reward(bad)


def test_doctor_reports_tasks_presets_and_dependencies(miles_pm_factory):
    from miles_core.rl.doctor import check

    results = {r.item: r for r in check(miles_pm_factory(builtins=True))}
    assert results["task arith-add"].status == "ok" and "55 prompts" in results["task arith-add"].detail
    assert {"preset tiny", "preset small-gpu", "module transformers", "module ray"} <= results.keys()
    assert not results["module ray"].required


def test_reward_sandbox_starts_in_the_background_and_reports_its_failure(miles_pm_factory):
    from miles_core.rl.aio import BackgroundLoop
    from miles_core.rl.config import RewardSection
    from miles_core.rl.rewards import RewardRunner

    class NoProviders:
        def contribution(self, kind, name):
            raise ConfigError(f"no {kind} provider {name!r} here")

    reward = _task("arith-add").reward
    inputs = [_input("7", "7"), _input("7", "1")]
    aio = BackgroundLoop()
    try:
        failing = RewardRunner(reward, RewardSection(), NoProviders(), aio)  # returns before the start fails
        with pytest.raises(ConfigError, match="no sandbox provider 'local' here"):
            failing.ready()
        failing.close()
        runner = RewardRunner(reward, RewardSection(), miles_pm_factory(builtins=True), aio)
        try:
            assert runner.score(inputs) == [1.0, 0.0]  # the first score waits for the sandbox
        finally:
            runner.close()
    finally:
        aio.close()
