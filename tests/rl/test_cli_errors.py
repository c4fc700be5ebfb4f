"""`miles train` refuses bad settings in one line naming the setting, before it imports what the
work needs, within seconds, and without writing anything (no run directory, no model cache)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=14, suite="stage-a-cpu")

#: the promise of docs/train.md: a bad setting fails before anything starts, in this many seconds
LIMIT_S = 3.0


def _miles(args: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float, set[str]]:
    """Run ``miles train ARGS`` in an empty directory with an empty cache; the result, its wall
    time and the top-level modules it imported (``-X importtime``)."""
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir(exist_ok=True)
    environ = {
        **os.environ,
        "MILES_CACHE_DIR": str(cache),
        "MILES_NO_ENTRY_POINT_CACHE": "1",  # the entry-point cache would be the one write
        "OMP_NUM_THREADS": "1",
        **env,
    }
    if "MILES_HARDWARE" not in env:
        environ.pop("MILES_HARDWARE", None)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "miles_core", "train", *args],
        cwd=cwd, env=environ, capture_output=True, text=True, timeout=300,
    )
    elapsed = time.perf_counter() - started
    imported = {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s+(\S+)$", proc.stderr, re.M)}
    return proc, elapsed, imported


def _error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if not line.startswith("import time:") and line.strip()]


def _assert_nothing_written(tmp_path: Path) -> None:
    assert list((tmp_path / "cwd").iterdir()) == []
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


@functools.cache
def _torch_import_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "trainer.device=tpu"], "trainer.device: 'tpu' is neither auto nor"),
        (["--task", "nope"], "task.name: unknown task 'nope'"),
        (["--set", "trainer.lr=0.1"], "trainer.lr: unknown setting in trainer; did you mean algorithm.lr?"),
        (["--set", "out_dir=x"], "out_dir: unknown setting; did you mean run.out_dir?"),
        (["--set", "model.preset=tiny-rll"], "did you mean 'tiny-rl'?"),
        (["--out", "{file}"], "run.out_dir: {file} exists and is not a directory"),
        (["--out", "{file}/run"], "run.out_dir: cannot create {file}/run: {file} is not a directory"),
        (["--config", "{yaml}"], "config files are TOML"),
    ],
    ids=["device", "task", "key-in-other-section", "key-without-section", "model-preset", "out-is-a-file",
         "out-under-a-file", "yaml-config"],
)
def test_bad_settings_fail_in_one_line_before_torch(tmp_path, args, needle):
    file = tmp_path / "a-file"
    file.write_text("keep me\n")
    yaml = tmp_path / "run.yaml"
    yaml.write_text("run:\n  steps: 3\n")
    args = [a.format(file=file, yaml=yaml) for a in args]
    proc, elapsed, imported = _miles(["--preset", "tiny", *args], tmp_path)
    lines = _error_lines(proc)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle.format(file=file) in lines[0]
    assert "torch" not in imported and "transformers" not in imported
    assert elapsed < LIMIT_S, f"{elapsed:.2f}s"
    assert file.read_text() == "keep me\n"
    _assert_nothing_written(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_out_dir_fails_in_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        proc, elapsed, imported = _miles(["--preset", "tiny", "--out", str(locked / "run")], tmp_path)
    finally:
        locked.chmod(0o700)
    assert proc.returncode == 2
    assert _error_lines(proc) == [f"error: run.out_dir: {locked / 'run'} cannot be created: {locked} is not writable"]
    assert "torch" not in imported and elapsed < LIMIT_S
    assert list(locked.iterdir()) == []


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not _cpu_only(), reason="a GPU is visible: these settings are valid here")
@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--preset", "small-gpu"], {}, "error: trainer.device: 'cuda' requested but CUDA is not available"),
        (["--preset", "small-gpu", "--set", "trainer.device=auto"], {},
         "error: model.preset: 'small-gpu' is built for cuda"),
        (["--preset", "tiny"], {"MILES_HARDWARE": "cuda"}, "CUDA is not usable here (MILES_HARDWARE=cuda)"),
    ],
    ids=["gpu-preset-on-cpu", "gpu-preset-auto-device", "cuda-override-without-cuda"],
)
def test_settings_this_machine_cannot_run_fail_before_the_model_is_built(tmp_path, args, env, needle):
    proc, elapsed, imported = _miles(args, tmp_path, **env)
    lines = _error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-3000:]
    # torch is needed to ask the hardware; nothing that builds or loads a model is imported
    assert "transformers" not in imported and "safetensors" not in imported
    # the promise is 3 s on an idle machine; under load importing torch alone can take longer
    assert elapsed < max(LIMIT_S, 1.0 + 1.5 * _torch_import_s()), f"{elapsed:.2f}s"
    _assert_nothing_written(tmp_path)
