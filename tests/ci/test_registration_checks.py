"""Registration errors caught before a runner is spent, and stages that would take runners for
nothing: compile errors at discovery, GPU counts, partitions, disabled entries without a tracking
issue, shards beyond the files, empty stages, and `plan` without `--hw`."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.mark.parametrize(
    ("body", "line", "rule"),
    [
        ("def test_x():\n    x = (\n", 7, "cannot compile"),  # the parser's error, past the registration
        ("def test_x():\n    pass\n\nreturn 3\n", 9, "cannot compile: 'return' outside function"),
        ("nonlocal y\n", 6, "cannot compile: nonlocal declaration not allowed at module level"),
    ],
)
def test_a_file_that_does_not_compile_fails_list_and_plan(tree, cli, body, line, rule) -> None:
    tree.test_file("tests/test_ok.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_bad.py", 'register_cpu_ci(5, "unit")', body)
    for command in (("list",), ("plan", "--suite", "unit")):
        result = cli("ci", *command, "--root", str(tree.root))
        assert result.code == 2, result.out
        assert f"tests/test_bad.py:{line}: {rule}" in result.err


def test_a_gpu_count_in_the_file_must_fit_the_suite(tree) -> None:
    eight = 'register_cuda_ci(60, "gpu-4", labels=["gpu"])'
    tree.test_file("tests/test_big.py", eight, "NUM_GPUS = 8\n\ndef test_x():\n    pass\n")
    with pytest.raises(ConfigError) as info:
        tree.catalog()
    assert (
        "tests/test_big.py:3: the file declares NUM_GPUS = 8 (line 6) but suite gpu-4 has 4 GPUs per runner"
        in str(info.value)
    )
    # a declared count that fits, or an explicit num_gpus for a reduced variant, is accepted
    tree.test_file("tests/test_big.py", eight, "NUM_GPUS: int = 4\n\ndef test_x():\n    pass\n")
    assert tree.catalog().registrations[0].declared_gpus == (4, 6)
    reduced = 'register_cuda_ci(60, "gpu-4", labels=["gpu"], num_gpus=4, layout={"tp": 2, "pp": 2})'
    tree.test_file("tests/test_big.py", reduced, "NUM_GPUS = 8\n\ndef test_x():\n    pass\n")
    assert tree.catalog().registrations[0].num_gpus == 4


def test_a_suite_name_that_states_a_gpu_count_must_mean_it(tree) -> None:
    text = (tree.root / "pyproject.toml").read_text()
    tree.write(
        "pyproject.toml",
        text + '\n[tool.miles.ci.suites.stage-c-8-gpu-h200]\nhardware = "cuda"\n'
        'runs-on = ["self-hosted", "h200", "8gpu"]\ngpus = 4\nlabels = ["gpu"]\n',
    )
    with pytest.raises(
        ConfigError, match="suite stage-c-8-gpu-h200: the name says 8 GPUs per runner but gpus = 4"
    ):
        tree.catalog()


def test_partition_count_must_be_the_stages_shards(tree, cli) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_b.py", 'register_cpu_ci(5, "unit")')
    base = ("ci", "run", "--root", str(tree.root), "--suite", "unit", "--list-only")
    refused = cli(*base, "--partition", "0/3")
    assert refused.code == 2
    assert "--partition 0/3: suite unit runs 2 shard(s) (min(shards = 2, 2 file(s))): use I/2" in refused.err
    assert cli(*base, "--partition", "1/2").code == 0 and cli(*base, "--partition", "0/1").code == 0
    tree.test_file("tests/test_b.py", 'register_cpu_ci(5, "unit", disabled="broken")')
    shrunk = cli(*base, "--partition", "1/2")  # one enabled file: the stage runs one shard
    assert shrunk.code == 2 and "suite unit runs 1 shard(s)" in shrunk.err


def test_shards_beyond_the_files_and_empty_stages_are_warned_about(tree, cli) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')  # unit: shards = 2, one file
    root = ("--root", str(tree.root))
    listed = cli("ci", "list", *root, "--json").json()
    unit = next(s for s in listed["suites"] if s["name"] == "unit")
    assert (unit["shards"], unit["shards_run"], unit["runnable_files"]) == (2, 1, 1)
    expected = {
        "suite unit declares shards = 2 but has 1 enabled file(s): 1 shard(s) run (set shards = 1 in pyproject.toml:12)",
        "suite integration has no enabled test files: no job is generated for it",
        "suite gpu-1 has no enabled test files: no job is generated for it",
        "suite gpu-4 has no enabled test files: no job is generated for it",
    }
    assert expected <= set(listed["warnings"])
    assert not any("gpu-old" in w for w in listed["warnings"])  # a disabled stage runs nothing anyway
    text = cli("ci", "list", *root)
    assert "warning: suite integration has no enabled test files" in " ".join(text.out.split())
    plan = cli("ci", "plan", *root, "--suite", "unit", "--json").json()
    assert plan["shards"] == {"configured": 2, "run": 1} and len(plan["partitions"]) == 1
    assert plan["warnings"] == [w for w in listed["warnings"] if w.startswith("suite unit ")]
    assert "warning: suite unit declares shards = 2" in cli("ci", "plan", *root, "--suite", "unit").err


def test_disabled_entries_without_a_tracking_issue(tree, cli) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit", disabled="flaky")')
    tree.test_file("tests/test_b.py", 'register_cpu_ci(5, "unit", disabled="slow", issue="#9")')
    root = ("--root", str(tree.root))
    listed = cli("ci", "list", *root, "--json").json()
    assert "1 disabled entry has no tracking issue (add issue=...): tests/test_a.py:3" in listed["warnings"]
    config = tree.root / "pyproject.toml"
    config.write_text(
        config.read_text().replace("timeout-base = 30\n", "timeout-base = 30\ndisabled-needs-issue = true\n")
    )
    strict = cli("ci", "list", *root)
    assert strict.code == 2
    assert "tests/test_a.py:3: disabled without issue= (disabled-needs-issue = true" in strict.err
    assert "test_b.py" not in strict.err


def test_list_marks_registrations_in_a_disabled_stage(tree, cli) -> None:
    tree.test_file("tests/test_old.py", 'register_cuda_ci(50, "gpu-old", labels=["gpu"])')
    tree.test_file("tests/test_new.py", 'register_cuda_ci(50, "gpu-1", labels=["gpu"])')
    data = cli("ci", "list", "--root", str(tree.root), "--json").json()
    flags = {r["path"]: r["stage_disabled"] for r in data["registrations"]}
    assert flags == {"tests/test_old.py": "A100 runners were retired", "tests/test_new.py": None}
    text = " ".join(cli("ci", "list", "--root", str(tree.root)).out.split())
    assert "stage disabled" in text


def test_plan_and_run_infer_the_hardware_and_name_what_is_missing(tree, cli) -> None:
    tree.test_file("tests/test_gpu.py", 'register_cuda_ci(50, "gpu-1", labels=["gpu"])')
    root = ("--root", str(tree.root))
    inferred = cli("ci", "plan", *root, "--suite", "gpu-1", "--labels", "gpu", "--json")
    assert inferred.code == 0 and inferred.json()["hardware"] == "cuda"
    for command in ("plan", "run"):
        missing = cli("ci", command, *root)
        assert missing.code == 2
        assert (
            "missing option --suite (the suite fixes --hw); suites: unit (cpu), integration (cpu)"
            in missing.err
        )
        assert missing.err.count("Error") <= 1 and "--hw" not in missing.err.split("suites:")[1]
    only_cuda = cli("ci", "plan", *root, "--hw", "cuda")
    assert "suites: gpu-1 (cuda), gpu-4 (cuda), gpu-old (cuda)" in only_cuda.err
    mismatch = cli("ci", "plan", *root, "--hw", "cpu", "--suite", "gpu-1")
    assert mismatch.code == 2 and "suite 'gpu-1' runs on cuda, not cpu" in mismatch.err
