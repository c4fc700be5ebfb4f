"""Image digests: canonical JSON of every recipe input, files by content hash."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.sandbox.base import Copy, ImageSpec, Resources, Run

register_cpu_ci(est_time=2, suite="stage-a-cpu")

SECRET_FILE = b"file body that must not be inlined"
BASE = ImageSpec("python:3.12-slim", (Run("pip install x"), Copy("app/main.py", SECRET_FILE), Run("make")))


def test_digest_is_stable_and_long() -> None:
    again = ImageSpec(
        "python:3.12-slim", (Run("pip install x"), Copy("app/main.py", bytes(SECRET_FILE)), Run("make"))
    )
    assert again.digest == BASE.digest and len(BASE.digest) == 64
    assert BASE.name.startswith("miles-") and len(BASE.name) - len("miles-") >= 16


@pytest.mark.parametrize(
    "changed",
    [
        replace(BASE, base="python:3.13-slim"),
        replace(BASE, user="user"),
        replace(BASE, steps=(BASE.steps[2], BASE.steps[1], BASE.steps[0])),
        replace(BASE, steps=(BASE.steps[0], Copy("app/main.py", SECRET_FILE + b"!"), BASE.steps[2])),
        replace(BASE, steps=(BASE.steps[0], Copy("app/main.py", SECRET_FILE, mode=0o755), BASE.steps[2])),
        replace(BASE, steps=(BASE.steps[0], Copy("app/other.py", SECRET_FILE), BASE.steps[2])),
        replace(BASE, resources=Resources(cpus=2)),
        replace(BASE, resources=Resources(memory_mb=4096)),
        replace(BASE, recipe_version="2"),
    ],
    ids=["base", "user", "order", "content", "mode", "dest", "cpus", "memory", "version"],
)
def test_every_input_changes_the_digest(changed: ImageSpec) -> None:
    assert changed.digest != BASE.digest


def test_canonical_form_hashes_files_instead_of_inlining_them() -> None:
    text = json.dumps(BASE.canonical())
    assert SECRET_FILE.decode() not in text
    assert BASE.steps[1].sha256 in text  # type: ignore[union-attr]


def test_bad_recipes_are_rejected_with_the_field() -> None:
    with pytest.raises(ConfigError, match=r"ImageSpec\.base"):
        ImageSpec("")
    with pytest.raises(ConfigError, match=r"ImageSpec.steps\[0\]"):
        ImageSpec("x", ("echo hi",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Copy\.dest"):
        Copy("../escape", b"")
    with pytest.raises(ConfigError, match="Resources"):
        Resources(cpus=0)


def test_copy_from_path_reads_the_file_and_its_mode(tmp_path) -> None:
    src = tmp_path / "run.sh"
    src.write_bytes(SECRET_FILE)
    src.chmod(0o750)
    copied = Copy.from_path(src, "bin/run.sh")
    assert (copied.dest, copied.content, copied.mode) == ("bin/run.sh", SECRET_FILE, 0o750)
    assert copied.sha256 == Copy("bin/run.sh", SECRET_FILE, 0o750).sha256
    assert Copy.from_path(src, "bin/run.sh", mode=0o644).mode == 0o644


def test_copy_takes_text_as_its_utf8_bytes() -> None:
    text = "print('häh')\n"
    copied = Copy("tests.py", text)
    assert copied.content == text.encode() and isinstance(copied.content, bytes)
    assert copied.sha256 == Copy("tests.py", text.encode()).sha256
    assert replace(copied, mode=0o755).content == text.encode()
    with pytest.raises(ConfigError, match=r"Copy\.content must be bytes or str, got int"):
        Copy("tests.py", 3)  # type: ignore[arg-type]
