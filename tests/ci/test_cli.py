"""`miles ci list` and `miles ci plan`: output, disabled reporting, --root/--config placement."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.fixture
def populated(tree):
    for i, est in enumerate((40, 30, 20, 20, 10, 5)):
        tree.test_file(f"tests/test_u{i}.py", f'register_cpu_ci({est}, "unit")')
    tree.test_file(
        "tests/test_flaky.py",
        'register_cpu_ci(9, "unit", disabled="flaky on 2 cores", issue="example/project#3")',
    )
    tree.test_file("tests/test_nolink.py", 'register_cpu_ci(9, "unit", disabled="needs a bigger runner")')
    tree.test_file("tests/test_old.py", 'register_cuda_ci(50, "gpu-old", labels=["gpu"])')
    return tree


def test_list_shows_every_disabled_stage_and_file_with_reason_and_link(populated, cli) -> None:
    text = cli("ci", "list", "--root", str(populated.root))
    assert text.code == 0
    for fragment in (
        "stage gpu-old (cuda): A100 runners were retired  tracking: https://github.com/example/project/issues/7",
        "tests/test_flaky.py:3 [unit]: flaky on 2 cores  tracking: example/project#3",
        "tests/test_nolink.py:3 [unit]: needs a bigger runner  no tracking issue",
        "tests/test_old.py:3 [gpu-old]: stage gpu-old is disabled: A100 runners were retired",
    ):
        assert " ".join(fragment.split()) in " ".join(text.out.split())
    data = cli("ci", "list", "--root", str(populated.root), "--json").json()
    assert {d.get("stage") or d["path"]: d["issue"] for d in data["disabled"]} == {
        "gpu-old": "https://github.com/example/project/issues/7",
        "tests/test_flaky.py": "example/project#3",
        "tests/test_nolink.py": None,
        "tests/test_old.py": "https://github.com/example/project/issues/7",
    }
    unit = next(s for s in data["suites"] if s["name"] == "unit")
    assert (unit["files"], unit["est_total"], unit["shards"]) == (8, 125, 2)
    assert [h["name"] for h in data["hardware"]] == ["cpu", "cuda"] and data["hardware"][1][
        "plugin"
    ] == "core-ci"
    only = cli("ci", "list", "--root", str(populated.root), "--disabled", "--hw", "cuda", "--json").json()
    assert [s["name"] for s in only["suites"]] == ["gpu-old"] and [
        r["path"] for r in only["registrations"]
    ] == ["tests/test_old.py"]
    assert cli("ci", "list", "--root", str(populated.root), "--suite", "nope").code == 2


def test_plan_json_is_deterministic_and_complete(populated, cli) -> None:
    root = ("--root", str(populated.root))
    args = ("ci", "plan", *root, "--hw", "cpu", "--suite", "unit", "--partitions", "3", "--json")
    first = cli(*args)
    assert first.code == 0
    data = first.json()
    assert data == cli(*args).json()
    assigned = sorted(f["path"] for p in data["partitions"] for f in p["files"])
    assert assigned == [f"tests/test_u{i}.py" for i in range(6)]
    assert sorted(p["load"] for p in data["partitions"]) == [40, 40, 45]
    assert (
        data["makespan"] == 45
        and data["lower_bound"] == 42  # 125 / 3 rounded up: est_times are whole seconds
        and data["ratio"] == pytest.approx(45 / 42)
        and data["optimal"] is True
    )
    assert data["greedy"]["makespan"] >= data["makespan"]
    assert data["disabled"] == [
        {"path": "tests/test_flaky.py", "line": 3, "reason": "flaky on 2 cores", "issue": "example/project#3"},
        {"path": "tests/test_nolink.py", "line": 3, "reason": "needs a bigger runner", "issue": None},
    ]
    text = cli(*args[:-1])
    assert "makespan 45 s, lower bound 42 s, ratio 1.071 (optimal)" in text.out
    assert "longest-first greedy" in text.out


def test_run_partitions_split_the_selection(populated, cli) -> None:
    root = ("--root", str(populated.root))
    base = ("ci", "run", *root, "--hw", "cpu", "--suite", "unit", "--list-only", "--json")
    parts = [cli(*base, "--partition", f"{i}/2").json() for i in range(2)]
    files = [f["path"] for part in parts for f in part["files"]]
    assert sorted(files) == [f"tests/test_u{i}.py" for i in range(6)]
    assert [sum(f["est_time"] for f in part["files"]) for part in parts] == list(parts[0]["plan"]["loads"])


def test_root_and_config_on_the_group_or_the_subcommand(populated, cli, tmp_path, monkeypatch) -> None:
    config = tmp_path / "ci.toml"
    config.write_text(
        'paths = ["tests"]\n[suites.unit]\nhardware = "cpu"\nruns-on = ["x"]\n[suites.gpu-old]\nhardware = "cpu"\nruns-on = ["x"]\n'
    )
    for args in (
        ("ci", "--root", str(populated.root), "--config", str(config), "list", "--json"),
        ("ci", "list", "--root", str(populated.root), "--config", str(config), "--json"),
    ):
        result = cli(*args)
        assert result.code == 2  # the registrations of gpu-old use register_cuda_ci on a cpu suite
        assert "suite 'gpu-old' runs on cpu, but register_cuda_ci registers for cuda" in result.err
    # the root is found upwards from the working directory, skipping projects without suites
    populated.write("tests/sub/pyproject.toml", '[project]\nname = "nested"\n')
    monkeypatch.chdir(populated.root / "tests" / "sub")
    assert cli("ci", "list", "--json").json()["root"] == str(populated.root)


def test_help_documents_every_subcommand(cli) -> None:
    top = cli("--help")
    assert "ci" in top.out and "CI: test registrations" in top.out
    for sub, options in {
        "list": ("--hw", "--suite", "--disabled", "--json", "--root", "--config"),
        "plan": ("--hw", "--suite", "--partitions", "--labels", "--cadence", "--json"),
        "run": (
            "--partition",
            "--labels",
            "--pr-labels",
            "--cadence",
            "--list-only",
            "--junit",
            "--summary",
            "--timeout-base",
            "--max-attempts",
        ),
        "est-times": ("--from", "--hw", "--tolerance", "--write", "--json"),
        "workflows": ("--out", "--check"),
    }.items():
        result = cli("ci", sub, "--help")
        assert result.code == 0
        for option in options:
            assert option in result.out, (sub, option)
