"""`miles train` without a terminal prints one line per step; a first Ctrl-C (SIGINT) stops it after
the step in flight with a checkpoint of that step, summary.json (``interrupted: true``) and the plot,
exit status 130, and ``--resume`` continues that run (``<runs_dir>/latest``); a second Ctrl-C aborts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=70, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

STEPS = 1000  # far more than the test waits for: only a Ctrl-C ends the run


def _config(path: Path, model_dir: Path, runs_dir: Path, steps: int = STEPS) -> Path:
    path.write_text(f"""
[model]
path = "{model_dir}"
[task]
reward = "miles_core.rl.builtin:first_token_reward"
[rollout]
path = "direct"
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 2
[trainer]
device = "cpu"
[run]
steps = {steps}
eval_every = 2
runs_dir = "{runs_dir}"
""")
    return path


def _start(config: Path, tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(tmp_path / "cache")}
    # stderr is a pipe, not a terminal: progress comes as one line per step
    return subprocess.Popen([sys.executable, "-m", "miles_core", "train", "--config", str(config)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_records(runs_dir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = runs_dir / "latest" / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"miles train exited early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} records within {timeout}s")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ctrl_c_checkpoints_summarises_plots_and_resumes(char_model_dir, tmp_path):
    runs = tmp_path / "runs"
    proc = _start(_config(tmp_path / "run.toml", char_model_dir, runs), tmp_path)
    _wait_for_records(runs, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    run = (runs / "latest").resolve()
    records = _records(run)
    steps = len(records)
    assert [r["step"] for r in records] == list(range(steps)) and 2 <= steps < STEPS
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] == steps
    assert summary["final_accuracy"] is None  # the stop skips the final evaluation
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == f"step_{steps - 1:06d}"
    assert (run / "plot.png").stat().st_size > 10_000
    assert "Traceback" not in err and "interrupted: finishing the step in flight" in err
    assert out.startswith(f"interrupted: {steps} steps in ")
    # one line per step, in order, each with the clock and the step's numbers
    lines = [line for line in err.splitlines() if line.startswith("train ")]
    assert [line.split()[1] for line in lines] == [f"{i}/{STEPS}" for i in range(1, steps + 1)]
    assert all(" reward " in line and " tok/s" in line for line in lines)

    # --resume continues the run latest points at, in the same directory
    longer = _config(tmp_path / "longer.toml", char_model_dir, runs, steps=steps + 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "miles_core", "train", "--config", str(longer), "--resume",
                           "--no-progress", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["out_dir"] == str(run)
    assert [r["step"] for r in _records(run)] == list(range(steps + 1))
    assert sorted(p.name for p in runs.iterdir()) == sorted([run.name, "latest"])


def test_a_second_ctrl_c_aborts(char_model_dir, tmp_path):
    runs = tmp_path / "runs"
    proc = _start(_config(tmp_path / "run.toml", char_model_dir, runs), tmp_path)
    _wait_for_records(runs, 1, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "aborted (Ctrl-C)" in err and "Traceback" not in err
    assert not ((runs / "latest").resolve() / "summary.json").exists()


def test_ctrl_c_while_the_stopped_run_exits_never_prints_a_traceback(char_model_dir, tmp_path):
    """A second Ctrl-C once the stopped run has written its summary: no traceback. During the
    interpreter's own teardown, when Python no longer handles signals, the process ends by the
    signal as any program does (a shell reports 130 for both)."""
    runs = tmp_path / "runs"
    proc = _start(_config(tmp_path / "run.toml", char_model_dir, runs), tmp_path)
    _wait_for_records(runs, 1, proc)
    proc.send_signal(signal.SIGINT)
    summary = (runs / "latest").resolve() / "summary.json"
    deadline = time.monotonic() + 120
    while not summary.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), err[-3000:]
    assert summary.exists() and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


#: `miles train` whose runtime holds an object that sends this process a Ctrl-C when it is freed:
#: after the run, while the run's objects are torn down, where a KeyboardInterrupt could only be
#: printed ("Exception ignored in ...")
_CTRL_C_IN_TEARDOWN = """
import os, signal
import miles_core.rl.runtime as runtime_module

class CtrlCWhenFreed:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):  # the handler runs between bytecodes of this thread
            pass
        open(os.environ["FREED_MARKER"], "w").close()

build = runtime_module.build_inprocess
def build_holding_the_probe(*args):
    runtime = build(*args)
    runtime.probe = CtrlCWhenFreed()
    return runtime
runtime_module.build_inprocess = build_holding_the_probe

from miles_core.cli import main
main()
"""


def test_ctrl_c_while_the_finished_run_is_torn_down_exits_at_once(char_model_dir, tmp_path):
    """The run ended and wrote its summary; a Ctrl-C while its runtime is freed ends the command
    (130, "aborted") instead of a KeyboardInterrupt raised into a finalizer."""
    runs, marker = tmp_path / "runs", tmp_path / "freed"
    config = _config(tmp_path / "run.toml", char_model_dir, runs, steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(tmp_path / "cache"),
           "FREED_MARKER": str(marker)}
    done = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TEARDOWN, "train", "--config", str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert ((runs / "latest").resolve() / "summary.json").exists(), done.stderr[-3000:]
    assert not marker.exists()  # the Ctrl-C ended the process inside the finalizer, as it should
    assert done.returncode == 130 and "aborted (Ctrl-C)" in done.stderr, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


#: `miles train` with a non-daemon thread that never ends (as a library's may): Python's shutdown
#: waits for it, and the thread marks when that wait has begun
_LINGERING = """
import os, pathlib, threading, time

def linger():
    while not threading._SHUTTING_DOWN:
        time.sleep(0.01)
    pathlib.Path(os.environ["SHUTDOWN_MARKER"]).touch()
    threading.Event().wait()

threading.Thread(target=linger).start()
from miles_core.cli import main
main()
"""


def test_ctrl_c_during_pythons_shutdown_exits_without_a_traceback(char_model_dir, tmp_path):
    """After the run has ended, Python's shutdown still runs code (threading's wait for other
    threads, then atexit callbacks): a Ctrl-C there ends the process with status 130, never with a
    KeyboardInterrupt traceback from inside the interpreter's shutdown."""
    import threading

    if not hasattr(threading, "_SHUTTING_DOWN"):
        pytest.skip("this Python's threading has no _SHUTTING_DOWN flag to tell when its shutdown began")
    runs, marker = tmp_path / "runs", tmp_path / "shutting-down"
    config = _config(tmp_path / "run.toml", char_model_dir, runs, steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(tmp_path / "cache"),
           "SHUTDOWN_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-c", _LINGERING, "train", "--config", str(config)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run never reached Python's shutdown: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the Ctrl-C did not end the process") from None
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert out.startswith("done: 2 steps in ")


def test_on_an_80_column_terminal_the_bar_keeps_its_clock(char_model_dir, tmp_path):
    """stderr on a pseudo-terminal 80 columns wide: the live bar, its count and an h:mm:ss clock
    that counts from the command's start (never cut to `0:00:…`)."""
    import pty
    import re

    runs = tmp_path / "runs"
    config = _config(tmp_path / "run.toml", char_model_dir, runs, steps=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80",
           "LINES": "24", "TERM": "xterm"}
    master, slave = pty.openpty()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "miles_core", "train", "--config", str(config)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed: the process has exited
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    wall = time.monotonic() - started
    os.close(master)
    assert proc.returncode == 0, out
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    final = [line for line in re.split(r"[\r\n]", screen) if "3/3" in line][-1]
    clock = re.search(r" (\d+):(\d\d):(\d\d) ", final)
    assert clock and "…" not in final.split("3/3")[1][:12], final
    shown = int(clock[1]) * 3600 + int(clock[2]) * 60 + int(clock[3])
    run = (runs / "latest").resolve()
    summary, records = json.loads((run / "summary.json").read_text()), _records(run)
    # one clock from the command's start: the bar's last frame (after the last step, before the plot),
    # the records' elapsed_s and the summary agree, and start-up (imports, model load) is counted
    assert records[-1]["elapsed_s"] - 1 <= shown <= summary["seconds"] <= wall, (final, summary["seconds"], wall)
    assert records[0]["elapsed_s"] > records[0]["time_step"] + 1.0
