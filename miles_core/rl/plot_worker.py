"""``plot.png`` rendered by a child process that imports matplotlib while the run works.

The plot is the last thing a run does, and matplotlib's import (~0.3 s of the ~0.6 s the plot
costs on the tiny preset) would sit on the run's critical path. The run starts this worker first
thing; it imports matplotlib on another core while the run starts and trains (start-up and the
tiny preset's loop keep one core busy, not two), then waits on its stdin. At the end the run
sends the records and waits for the PNG; the worker renders it with
:func:`~miles_core.rl.metrics.plot_run`, exactly what the run would have called itself.

The worker runs in its own session, so a Ctrl-C at the terminal (which stops the run after the
step in flight and still writes the plot) does not reach it. A run that ends without a plot
stops it; one that dies leaves it reading the end of its stdin, and it exits. A worker that
fails (matplotlib missing, a render error) makes :meth:`PlotWorker.render` raise with its
stderr, as ``plot_run`` in the run would have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: seconds to wait for the rendering once the records are sent
RENDER_TIMEOUT_S = 300.0


class PlotWorkerError(RuntimeError):
    pass


class PlotWorker:
    """A started worker; :meth:`render` once, or :meth:`close` to let it go unused."""

    def __init__(self) -> None:
        import miles_core

        root = str(Path(miles_core.__file__).resolve().parent.parent)  # where the parent found miles_core
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "miles_core.rl.plot_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    def render(self, records: Sequence[Mapping[str, Any]], path: Path, title: str,
               final_accuracy: tuple[int, float] | None = None) -> Path:
        """Write ``plot.png`` at ``path`` (as :func:`~miles_core.rl.metrics.plot_run` does)."""
        proc, self._proc = self._proc, None
        if proc is None:
            raise PlotWorkerError("the plot worker was already used or closed")
        payload = json.dumps({"records": list(records), "path": str(path), "title": title,
                              "final_accuracy": final_accuracy}).encode()
        try:
            _, stderr = proc.communicate(payload, timeout=RENDER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise PlotWorkerError(f"the plot worker did not write {path} within {RENDER_TIMEOUT_S:g} s") from None
        if proc.returncode != 0:
            raise PlotWorkerError(
                f"the plot worker failed to write {path} (exit {proc.returncode}): "
                f"{stderr.decode(errors='replace')[-2000:]}"
            )
        return path

    def close(self) -> None:
        """Stop a worker that was not used (it has nothing to finish: at most an import)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.communicate()


def main() -> int:
    from miles_core.rl.metrics import plot_run, warm_plotting

    warm_plotting()
    data = sys.stdin.buffer.read()
    if not data:  # the run ended without a plot
        return 0
    job = json.loads(data)
    final = job["final_accuracy"]
    plot_run(job["records"], Path(job["path"]), job["title"], None if final is None else (int(final[0]), float(final[1])))
    # written and closed: exit without tearing matplotlib and numpy down (~0.1 s the run waits for)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
