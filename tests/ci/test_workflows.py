"""Generated workflows: structure locks on the parsed YAML, job gating evaluated for real events,
actionlint and zizmor, and --check."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from miles_core.ci.register import register_cpu_ci
from miles_core.ci.workflows import PR_WORKFLOW, generate, hardware_step_ids

register_cpu_ci(est_time=5, suite="stage-a-cpu")

INPUT_REF = re.compile(r"inputs\.([A-Za-z_][A-Za-z0-9_-]*)")


@pytest.fixture
def catalog(tree):
    text = (tree.root / "pyproject.toml").read_text()
    text = text.replace("timeout-base = 30\n", 'timeout-base = 30\nsecrets = ["HF_TOKEN"]\n')
    text += '\n[tool.miles.ci.suites.nightly-gpu]\nhardware = "cuda"\nruns-on = ["self-hosted", "h200"]\ngpus = 1\nlabels = ["gpu"]\ncadence = ["nightly"]\n'
    tree.write("pyproject.toml", text)
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    return tree.catalog()


@pytest.fixture
def docs(catalog) -> dict[str, dict]:
    return {name: yaml.safe_load(text) for name, text in generate(catalog).items()}


def _strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def test_one_job_per_reusable_workflow_and_one_caller_job_per_enabled_stage(docs, catalog) -> None:
    assert set(docs) == {"_run-cpu-ci.yml", "_run-cuda-ci.yml", PR_WORKFLOW}
    for kind in ("cpu", "cuda"):
        jobs = docs[f"_run-{kind}-ci.yml"]["jobs"]
        assert list(jobs) == [f"run-{kind}"]
        assert "if" not in jobs[f"run-{kind}"]  # a job-level if would show skipped siblings
    stages = docs[PR_WORKFLOW]["jobs"]
    assert list(stages) == ["unit", "integration", "gpu-1", "gpu-4", "nightly-gpu"]  # gpu-old is disabled
    callers = {}
    for name, job in stages.items():
        callers.setdefault(job["uses"], []).append(name)
        suite = catalog.suites[name]
        assert job["strategy"]["matrix"]["partition"] == list(range(suite.shards))
        assert job["with"]["partitions"] == suite.shards and job["strategy"]["fail-fast"] is False
    assert callers == {
        "./.github/workflows/_run-cpu-ci.yml": ["unit", "integration"],
        "./.github/workflows/_run-cuda-ci.yml": ["gpu-1", "gpu-4", "nightly-gpu"],
    }
    assert stages["gpu-1"]["needs"] == ["unit"]
    assert stages["gpu-4"]["with"]["split_host"] is True and stages["gpu-1"]["with"]["split_host"] is False


def test_disabled_stage_has_no_job_but_is_named_with_reason_and_link(catalog) -> None:
    text = generate(catalog)[PR_WORKFLOW]
    assert "gpu-old" not in yaml.safe_load(text)["jobs"]
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert (
        "#   gpu-old (cuda): A100 runners were retired -- tracking: https://github.com/example/project/issues/7"
        in header
    )


def test_inputs_declared_passed_and_used_match(docs) -> None:
    for name in ("_run-cpu-ci.yml", "_run-cuda-ci.yml"):
        declared = set(docs[name]["on"]["workflow_call"]["inputs"])
        used = {m for s in _strings(docs[name]["jobs"]) for m in INPUT_REF.findall(s)}
        assert used == declared, f"{name}: unused {declared - used}, undeclared {used - declared}"
        for stage in docs[PR_WORKFLOW]["jobs"].values():
            if stage["uses"].endswith(name):
                assert set(stage["with"]) == declared


def test_reusable_workflows_share_one_step_list_apart_from_hardware_setup(docs, catalog) -> None:
    shared = {}
    for kind in catalog.kinds.values():
        steps = docs[kind.reusable_workflow]["jobs"][kind.job_id]["steps"]
        setup = hardware_step_ids(kind, catalog)
        assert {s["id"] for s in steps} >= setup
        shared[kind.name] = [s for s in steps if s["id"] not in setup]
    assert shared["cpu"] == shared["cuda"]
    assert [s["id"] for s in shared["cpu"]] == ["checkout", "plan", "run", "upload"]
    assert hardware_step_ids(catalog.kinds["cpu"], catalog) != hardware_step_ids(
        catalog.kinds["cuda"], catalog
    )


def test_security_properties(docs) -> None:
    for name, doc in docs.items():
        assert doc["permissions"] == {"contents": "read"}, name
        assert "pull_request_target" not in doc["on"]
        for job in doc["jobs"].values():
            assert job.get("secrets") != "inherit"
            for step in job.get("steps", []):
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert step["with"]["persist-credentials"] is False
                assert re.fullmatch(r"[\w-]+/[\w-]+@[0-9a-f]{40}", step.get("uses", "a/b@" + "0" * 40))
    cuda_steps = docs["_run-cuda-ci.yml"]["jobs"]["run-cuda"]["steps"]
    assert [s["id"] for s in cuda_steps if "HF_TOKEN" in str(s.get("env", {}))] == ["run"]  # not install
    assert (
        "--env CUDA_VISIBLE_DEVICES" in docs["_run-cuda-ci.yml"]["jobs"]["run-cuda"]["container"]["options"]
    )


def _pr(labels, *, fork=False, action="synchronize", label=None) -> dict:
    event = {
        "action": action,
        "pull_request": {
            "number": 5,
            "labels": [{"name": n} for n in labels],
            "head": {"repo": {"full_name": "someone/fork" if fork else "org/repo"}},
        },
    }
    if label is not None:
        event["label"] = {"name": label}
    return {
        "event_name": "pull_request",
        "repository": "org/repo",
        "event": event,
        "workflow": "pr-test",
        "ref": "refs/pull/5/merge",
    }


PUSH = {"event_name": "push", "repository": "org/repo", "event": {}, "ref": "refs/heads/main"}
SCHEDULE = {"event_name": "schedule", "repository": "org/repo", "event": {}, "ref": "refs/heads/main"}


@pytest.mark.parametrize(
    ("github", "unit", "gpu", "nightly_gpu"),
    [
        (_pr([]), True, False, False),
        (_pr(["run-ci-gpu"]), True, True, False),
        (_pr(["run-ci-all", "bug"]), True, True, False),
        (
            _pr(["run-ci-gpu"], fork=True),
            True,
            False,
            False,
        ),  # a fork's push never reaches self-hosted runners
        (_pr(["run-ci-gpu"], fork=True, action="labeled", label="run-ci-gpu"), True, True, False),
        (_pr(["run-ci-gpu", "bug"], fork=True, action="labeled", label="bug"), False, False, False),
        (_pr(["bug"], action="labeled", label="bug"), False, False, False),  # irrelevant label: no rerun
        (PUSH, True, True, False),
        (SCHEDULE, True, True, True),
    ],
)
def test_stage_gating_for_real_events(docs, gh_eval, github, unit, gpu, nightly_gpu) -> None:
    jobs = docs[PR_WORKFLOW]["jobs"]
    assert bool(gh_eval(jobs["unit"]["if"], github)) is unit
    assert bool(gh_eval(jobs["gpu-4"]["if"], github)) is gpu
    assert bool(gh_eval(jobs["nightly-gpu"]["if"], github)) is nightly_gpu


def test_inputs_and_secrets_for_real_events(docs, gh_eval) -> None:
    job = docs[PR_WORKFLOW]["jobs"]["gpu-4"]
    secret = job["secrets"]["HF_TOKEN"]
    with_secret = lambda github: gh_eval(secret.replace("secrets.HF_TOKEN", "'s3cret'"), github)  # noqa: E731
    assert with_secret(_pr([], fork=True, action="labeled", label="run-ci-gpu")) == ""
    assert with_secret(_pr([])) == "s3cret" and with_secret(PUSH) == "s3cret"
    assert gh_eval(job["with"]["pr_labels"], _pr([])) == ","  # no labels must not mean every label
    assert gh_eval(job["with"]["pr_labels"], _pr(["run-ci-gpu", "bug"])) == ",run-ci-gpu,bug"
    assert gh_eval(job["with"]["pr_labels"], PUSH) == "run-ci-all"
    assert gh_eval(job["with"]["cadence"], SCHEDULE) == "nightly"
    assert (
        gh_eval(job["with"]["cadence"], {"event_name": "workflow_dispatch"}, {"cadence": "nightly"})
        == "nightly"
    )
    assert gh_eval(job["with"]["cadence"], _pr([])) == "regular"


def test_generated_workflows_pass_actionlint_and_zizmor(catalog, tmp_path, lint_workflows) -> None:
    workflows = tmp_path / "repo" / ".github" / "workflows"
    workflows.mkdir(parents=True)
    for name, text in generate(catalog).items():
        (workflows / name).write_text(text)
    assert lint_workflows(workflows) == []
    # negative control: both tools run for real and catch what the generator avoids
    cpu = workflows / "_run-cpu-ci.yml"
    cpu.write_text(
        re.sub(r"actions/checkout@[0-9a-f]{40}", "actions/checkout@v4", cpu.read_text()).replace(
            "        with:\n          persist-credentials: false\n", ""
        )
    )
    (workflows / "broken.yml").write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ github.nope( }}\n"
    )
    complaints = lint_workflows(workflows)
    assert [c.split(":")[0] for c in complaints] == ["actionlint", "zizmor"]
    assert "unpinned-uses" in complaints[1] and "artipacked" in complaints[1]


def test_check_write_stale_and_hand_written_files(tree, cli, catalog, tmp_path) -> None:
    out = tmp_path / "wf"
    root = ("--root", str(tree.root))
    assert cli("ci", "workflows", *root, "--check", "--out", str(out)).code == 1  # nothing written yet
    written = cli("ci", "workflows", *root, "--out", str(out))
    assert written.code == 0 and written.out.count("wrote ") == 3
    (out / "lint.yml").write_text("name: lint\n")  # hand-written: never touched
    assert cli("ci", "workflows", *root, "--check", "--out", str(out)).code == 0

    pr = out / PR_WORKFLOW
    pr.write_text(pr.read_text().replace("partitions: 2", "partitions: 3", 1))
    edited = cli("ci", "workflows", *root, "--check", "--out", str(out))
    assert edited.code == 1 and "-      partitions: 3" in edited.out and "+      partitions: 2" in edited.out
    cli("ci", "workflows", *root, "--out", str(out))

    shutil.copy(out / "_run-cpu-ci.yml", out / "_run-tpu-ci.yml")  # generated earlier, no longer produced
    stale = cli("ci", "workflows", *root, "--check", "--out", str(out))
    assert stale.code == 1 and "_run-tpu-ci.yml: generated earlier but no longer produced" in stale.out
    assert "removed" in cli("ci", "workflows", *root, "--out", str(out)).out
    assert sorted(p.name for p in out.iterdir()) == [
        "_run-cpu-ci.yml",
        "_run-cuda-ci.yml",
        "lint.yml",
        PR_WORKFLOW,
    ]

    config = tree.root / "pyproject.toml"
    config.write_text(config.read_text().replace("shards = 2\n", "shards = 3\n", 1))
    assert cli("ci", "workflows", *root, "--check", "--out", str(out)).code == 1
