"""Generated workflows: structure locks on the parsed YAML, job gating evaluated for real events,
actionlint and zizmor, and --check."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from miles_core.ci.register import register_cpu_ci
from miles_core.ci.workflows import GATED_WORKFLOW, PR_WORKFLOW, generate, hardware_step_ids

register_cpu_ci(est_time=3, suite="stage-a-cpu")

INPUT_REF = re.compile(r"inputs\.([A-Za-z_][A-Za-z0-9_-]*)")


@pytest.fixture
def catalog(tree):
    text = (tree.root / "pyproject.toml").read_text()
    text = text.replace("timeout-base = 30\n", 'timeout-base = 30\nsecrets = ["HF_TOKEN"]\n')
    text += '\n[tool.miles.ci.suites.nightly-gpu]\nhardware = "cuda"\nruns-on = ["self-hosted", "h200"]\ngpus = 1\nlabels = ["gpu"]\ncadence = ["nightly"]\n'
    tree.write("pyproject.toml", text)
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_b.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_i.py", 'register_cpu_ci(5, "integration")')
    tree.test_file("tests/test_g1.py", 'register_cuda_ci(5, "gpu-1", labels=["gpu"])')
    tree.test_file("tests/test_g4a.py", 'register_cuda_ci(5, "gpu-4", labels=["gpu"])')
    tree.test_file("tests/test_g4b.py", 'register_cuda_ci(5, "gpu-4", labels=["gpu"])')
    tree.test_file("tests/test_gn.py", 'register_cuda_ci(5, "nightly-gpu", labels=["gpu"])')
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
    assert set(docs) == {"_run-cpu-ci.yml", "_run-cuda-ci.yml", PR_WORKFLOW, GATED_WORKFLOW}
    for kind in ("cpu", "cuda"):
        jobs = docs[f"_run-{kind}-ci.yml"]["jobs"]
        assert list(jobs) == [f"run-{kind}"]  # one job: a caller never shows a skipped sibling
    assert "if" not in docs["_run-cpu-ci.yml"]["jobs"]["run-cpu"]
    # the self-hosted job checks its caller; for the generated callers on main it is always true
    assert "github.workflow_ref" in docs["_run-cuda-ci.yml"]["jobs"]["run-cuda"]["if"]
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
    gated = docs[GATED_WORKFLOW]["jobs"]
    assert set(gated) == {"unit", "gpu-1", "gpu-4"}  # no nightly-only stage; unit because gpu-1 needs it
    assert gated["gpu-1"]["needs"] == ["unit"] and "needs" not in gated["gpu-4"]


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
        for caller in (PR_WORKFLOW, GATED_WORKFLOW):
            for stage in docs[caller]["jobs"].values():
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
        # only the gated workflow runs on pull_request_target, and it checks out what was approved
        assert ("pull_request_target" in doc["on"]) == (name == GATED_WORKFLOW)
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


def test_generated_workflows_pass_actionlint_and_zizmor(catalog, tmp_path, lint_workflows) -> None:
    workflows = tmp_path / "repo" / ".github" / "workflows"
    workflows.mkdir(parents=True)
    for name, text in generate(catalog).items():
        (workflows / name).write_text(text)
    assert lint_workflows(workflows) == []
    assert lint_workflows(workflows, persona="auditor") == []  # the images are pinned by digest
    # negative control: both tools run for real and catch what the generator avoids
    cpu = workflows / "_run-cpu-ci.yml"
    cpu.write_text(
        re.sub(r"actions/checkout@[0-9a-f]{40}", "actions/checkout@v4", cpu.read_text()).replace(
            "          persist-credentials: false\n", ""
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
    assert written.code == 0 and written.out.count("wrote ") == 4
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
        GATED_WORKFLOW,
        PR_WORKFLOW,
    ]

    config = tree.root / "pyproject.toml"
    config.write_text(config.read_text().replace("shards = 2\n", "shards = 3\n", 1))
    # unit has two files: a third shard would run nothing, so the workflows do not change
    assert cli("ci", "workflows", *root, "--check", "--out", str(out)).code == 0
    config.write_text(config.read_text().replace('"ubuntu-latest"', '"ubuntu-24.04"', 1))
    assert cli("ci", "workflows", *root, "--check", "--out", str(out)).code == 1
