"""The suites file: every validation rule with file:line, --config files, kind default suites."""

from __future__ import annotations

import pytest

from miles_core.ci.builtin import CUDA
from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError

register_cpu_ci(est_time=3, suite="stage-a-cpu")

HEAD = (
    '[project]\nname = "demo"\n\n[tool.miles.ci]\npaths = ["tests"]\n\n[tool.miles.ci.labels]\ngpu = "g"\n\n'
)
CPU_SUITE = '[tool.miles.ci.suites.unit]\nhardware = "cpu"\nruns-on = ["ubuntu-latest"]\n'


def load_error(tree, text: str) -> str:
    tree.write("pyproject.toml", text)
    with pytest.raises(ConfigError) as info:
        tree.catalog()
    return str(info.value)


@pytest.mark.parametrize(
    ("suite_lines", "line", "fragment"),
    [
        ("shards = 0", 13, "[tool.miles.ci.suites.unit] shards: must be an integer >= 1, got 0"),
        ('shards = "2"', 13, "shards: must be an integer >= 1, got '2'"),
        ("shrads = 2", 13, "[tool.miles.ci.suites.unit] shrads: unknown key (did you mean 'shards'?)"),
        ('cadence = ["weekly"]', 13, "cadence: unknown cadence 'weekly'"),
        ('issue = "https://x.org/1"', 13, "issue: a tracking issue is only meaningful with disabled"),
        ('disabled = ""', 13, "disabled: must be a non-empty string"),
        ('labels = "gpu"', 13, "labels: must be a list of non-empty strings"),
        ("timeout-minutes = 0", 13, "timeout-minutes: must be an integer >= 1"),
    ],
)
def test_suite_fields_are_validated_with_line(tree, suite_lines: str, line: int, fragment: str) -> None:
    message = load_error(tree, HEAD + CPU_SUITE + suite_lines + "\n")
    assert message.startswith(f"pyproject.toml:{line}: "), message
    assert fragment in message


def test_disabled_issue_must_be_a_link_or_reference(tree) -> None:
    message = load_error(tree, HEAD + CPU_SUITE + 'disabled = "broken"\nissue = "later"\n')
    assert (
        "pyproject.toml:14: [tool.miles.ci.suites.unit] issue: must be a URL or an issue reference" in message
    )


def test_missing_required_keys_and_unknown_top_level_key(tree) -> None:
    message = load_error(
        tree,
        HEAD.replace('paths = ["tests"]', 'pathz = ["tests"]') + "[tool.miles.ci.suites.bare]\nshards = 1\n",
    )
    assert message.startswith("3 problems:")
    assert "pyproject.toml:5: [tool.miles.ci] pathz: unknown key (did you mean 'paths'?)" in message
    assert "pyproject.toml:10: [tool.miles.ci.suites.bare]: missing required key 'hardware'" in message
    assert "missing required key 'runs-on'" in message


def test_cross_references_are_checked(tree) -> None:
    text = (
        HEAD
        + CPU_SUITE
        + 'labels = ["gpx"]\nneeds = ["unti"]\n\n'
        + '[tool.miles.ci.suites.gpu]\nhardware = "cdua"\nruns-on = ["self-hosted"]\ngpus = 1\n\n'
        + '[tool.miles.ci.suites.a]\nhardware = "cpu"\nruns-on = ["x"]\nneeds = ["b"]\n\n'
        + '[tool.miles.ci.suites.b]\nhardware = "cpu"\nruns-on = ["x"]\nneeds = ["a"]\n\n'
        + '[tool.miles.ci.hardware.rocm]\nimage = "x"\n'
    )
    message = load_error(tree, text)
    assert "pyproject.toml:10: suite unit: unknown label 'gpx' (did you mean 'gpu'?)" in message
    assert "pyproject.toml:10: suite unit: needs unknown suite 'unti'" in message
    assert "suite gpu: unknown hardware 'cdua' (did you mean 'cuda'?)" in message
    assert "suites depend on each other in a cycle: " in message
    assert (
        "pyproject.toml:31: [tool.miles.ci.hardware.rocm]: unknown hardware 'rocm' (known: cpu, cuda)"
        in message
    )


@pytest.mark.parametrize(
    ("suite", "fragment"),
    [
        (
            'hardware = "cuda"\nruns-on = ["self-hosted"]\ngpus = 0\nlabels = ["gpu"]',
            "gpus = 0, but cuda suites need at least 1 GPU",
        ),
        ('hardware = "cuda"\nruns-on = ["self-hosted"]\ngpus = 1', "cuda suites must declare labels"),
        (
            'hardware = "cuda"\nruns-on = ["h200"]\ngpus = 1\nlabels = ["gpu"]',
            "cuda runners are self-hosted; runs-on must include 'self-hosted'",
        ),
        (
            'hardware = "cuda"\nruns-on = ["self-hosted"]\ngpus = 4\nhost-gpus = 6\nlabels = ["gpu"]',
            "host-gpus = 6 cannot be split into runners of 4 GPUs",
        ),
        ('hardware = "cpu"\nruns-on = ["x"]\ngpus = 2', "gpus = 2, but cpu runners have no GPUs"),
        ('hardware = "cpu"\nruns-on = []', "runs-on must name at least one runner label"),
    ],
)
def test_suites_must_fit_their_hardware(tree, suite: str, fragment: str) -> None:
    message = load_error(tree, HEAD + "[tool.miles.ci.suites.s]\n" + suite + "\n")
    assert "pyproject.toml:10: suite s: " + fragment in message


def test_a_stage_cannot_need_a_disabled_stage(tree) -> None:
    text = (
        HEAD
        + CPU_SUITE
        + 'disabled = "off"\n\n[tool.miles.ci.suites.later]\nhardware = "cpu"\nruns-on = ["x"]\nneeds = ["unit"]\n'
    )
    assert "needs 'unit', which is disabled, so this stage would never run" in load_error(tree, text)


def test_invalid_toml_names_the_file(tree) -> None:
    assert load_error(tree, HEAD + "[tool.miles.ci.suites.x\n").startswith(
        f"{tree.root / 'pyproject.toml'}: invalid TOML"
    )


def test_config_file_at_top_level_or_under_tool_table(tree, tmp_path) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "fast")')
    top = tmp_path / "ci.toml"
    top.write_text(
        'paths = ["tests"]\n[suites.fast]\nhardware = "cpu"\nruns-on = ["ubuntu-latest"]\nshards = 3\n'
    )
    catalog = tree.catalog(top)
    assert list(catalog.suites) == ["fast"] and catalog.suites["fast"].shards == 3
    nested = tmp_path / "other.toml"
    nested.write_text(
        '[tool.miles.ci]\npaths = ["tests"]\n[tool.miles.ci.suites.fast]\nhardware = "cpu"\nruns-on = ["x"]\nshards = 5\n'
    )
    assert tree.catalog(nested).suites["fast"].shards == 5
    top.write_text('[suites.fast]\nhardware = "cpu"\nruns-on = ["x"]\nshards = -1\n')
    with pytest.raises(ConfigError, match=r"ci\.toml:4: \[suites\.fast\] shards: must be an integer >= 1"):
        tree.catalog(top)
    with pytest.raises(ConfigError, match="suites file not found"):
        tree.catalog(tmp_path / "missing.toml")


def test_without_suites_the_kinds_default_suites_apply(tree) -> None:
    tree.write("pyproject.toml", '[project]\nname = "demo"\n')
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "stage-a-cpu")')
    catalog = tree.catalog()
    assert {name: s.hardware for name, s in catalog.suites.items()} == {
        "stage-a-cpu": "cpu",
        "stage-b-1-gpu-h200": "cuda",
    }
    assert catalog.suites["stage-a-cpu"].source == "core-ci default"
    assert catalog.settings("cuda").image  # the kind's default image applies
    assert catalog.labels == {"gpu": "needs a CUDA GPU runner"}


def test_hardware_settings_override_kind_defaults_per_key(tree) -> None:
    tree.write(
        "pyproject.toml", HEAD + CPU_SUITE + '\n[tool.miles.ci.hardware.cuda]\ninstall = ["make gpu"]\n'
    )
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    settings = tree.catalog().settings("cuda")
    assert settings.install == ("make gpu",)
    assert settings.image == CUDA.default_settings.image and "@sha256:" in settings.image


@pytest.mark.parametrize(
    ("top", "extra", "fragment"),
    [
        ("timeout-base = 0", "", "[tool.miles.ci] timeout-base: must be a positive number of seconds, got 0"),
        ('nightly-cron = "daily"', "", "[tool.miles.ci] nightly-cron: must be a 5-field cron expression"),
        (
            'secrets = ["hf_token", "GITHUB_TOKEN"]',
            "",
            "secret names are UPPER_SNAKE_CASE and not GITHUB_*, got ['hf_token', 'GITHUB_TOKEN']",
        ),
        ('paths = "tests"', "", "[tool.miles.ci] paths: must be a list of non-empty strings"),
        ("", '[tool.miles.ci.labels]\nall = "every"\n', "[tool.miles.ci.labels] all: 'all' is reserved"),
        ("", '[tool.miles.ci.labels]\nGPU = "g"\n', "label names are lowercase letters, digits and '-'"),
        (
            "",
            '[tool.miles.ci.labels]\nfast = ""\n',
            "[tool.miles.ci.labels] fast: must be a non-empty description string",
        ),
        (
            "",
            '[tool.miles.ci.hardware.cpu]\nimage = 3\ninstal = ["x"]\n',
            "[tool.miles.ci.hardware.cpu] instal: unknown key (did you mean 'install'?)",
        ),
        (
            "",
            '[tool.miles.ci.suites.Stage_A]\nhardware = "cpu"\nruns-on = ["x"]\n',
            "suite names are lowercase letters, digits and '-'",
        ),
    ],
)
def test_top_level_labels_hardware_and_suite_names(tree, top: str, extra: str, fragment: str) -> None:
    text = '[project]\nname = "demo"\n\n[tool.miles.ci]\n' + top + "\n\n" + extra + "\n" + CPU_SUITE
    assert fragment in load_error(tree, text)
