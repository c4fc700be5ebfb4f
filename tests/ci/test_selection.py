"""Which files a run selects (labels, cadence) and that disabled entries are always reported."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.ci.selection import resolve_labels, select
from miles_core.errors import ConfigError

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.fixture
def catalog(tree):
    tree.test_file("tests/test_plain.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_slow.py", 'register_cpu_ci(50, "unit", labels=["slow"])')
    tree.test_file("tests/test_nightly.py", 'register_cpu_ci(9, "unit", nightly=True)')
    tree.test_file(
        "tests/test_off.py", 'register_cpu_ci(9, "unit", labels=["slow"], disabled="hangs", issue="#12")'
    )
    tree.test_file("tests/test_gpu.py", 'register_cuda_ci(20, "gpu-1", labels=["gpu"])')
    tree.test_file("tests/test_old.py", 'register_cuda_ci(20, "gpu-old", labels=["gpu"], num_gpus=4)')
    return tree.catalog()


def paths(regs) -> list[str]:
    return sorted(r.path for r in regs)


def test_unlabelled_files_always_run_and_labels_select_with_or(catalog) -> None:
    none = select(catalog, "cpu", "unit", resolve_labels(catalog), "regular")
    assert paths(none.selected) == ["tests/test_plain.py"]
    assert dict((r.path, why) for r, why in none.not_selected) == {
        "tests/test_slow.py": "needs label slow",
        "tests/test_nightly.py": "nightly only",
    }
    slow = select(catalog, "cpu", "unit", resolve_labels(catalog, ["gpu,slow"]), "regular")
    assert paths(slow.selected) == ["tests/test_plain.py", "tests/test_slow.py"]


def test_nightly_cadence_admits_nightly_files_and_every_label(catalog) -> None:
    nightly = select(catalog, "cpu", "unit", resolve_labels(catalog), "nightly")
    assert paths(nightly.selected) == ["tests/test_nightly.py", "tests/test_plain.py", "tests/test_slow.py"]


def test_disabled_entries_are_reported_whatever_the_labels(catalog) -> None:
    for labels in ([], ["all"]):
        selection = select(catalog, "cpu", "unit", resolve_labels(catalog, labels), "regular")
        assert paths(selection.disabled) == ["tests/test_off.py"]
        assert "tests/test_off.py" not in paths(selection.selected)
    stage = select(catalog, "cuda", "gpu-old", resolve_labels(catalog, ["gpu"]), "regular")
    assert stage.selected == () and paths(stage.disabled) == ["tests/test_old.py"]


def test_pull_request_labels(catalog) -> None:
    chosen = resolve_labels(catalog, pr_labels=",bug,run-ci-slow,run-ci-gpx,documentation")
    assert chosen.labels == {"slow"}
    assert chosen.warnings == ("pull-request label 'run-ci-gpx' names no known label (did you mean 'gpu'?)",)
    assert resolve_labels(catalog, pr_labels="run-ci-all").labels == {"gpu", "slow"}
    assert resolve_labels(catalog, ["run-ci-gpu"]).labels == {"gpu"}


def test_strict_labels_cadence_suite_and_hardware(catalog) -> None:
    with pytest.raises(ConfigError, match=r"--labels: unknown label 'slwo' \(did you mean 'slow'\?\)"):
        resolve_labels(catalog, ["slwo"])
    with pytest.raises(ConfigError, match="unknown cadence 'weekly'"):
        select(catalog, "cpu", "unit", resolve_labels(catalog), "weekly")
    with pytest.raises(ConfigError, match=r"unknown suite 'unti' \(did you mean 'unit'\?\)"):
        select(catalog, "cpu", "unti", resolve_labels(catalog), "regular")
    with pytest.raises(ConfigError, match="suite 'gpu-1' runs on cuda, not cpu"):
        select(catalog, "cpu", "gpu-1", resolve_labels(catalog), "regular")
    with pytest.raises(ConfigError, match=r"unknown hardware 'cdua' \(did you mean 'cuda'\?\)"):
        select(catalog, "cdua", "gpu-1", resolve_labels(catalog), "regular")
