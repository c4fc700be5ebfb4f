"""Registration markers a test file calls at module level to say where it runs in CI.

They are runtime no-ops: ``miles ci`` finds them by parsing source (test files are never
imported), so every argument must be a literal. Hardware plugins contribute their own marker
(``register_rocm_ci`` comes from miles-rocm) through the ``miles_ci_hardware`` hook.

Example (top of a test file)::

    from miles_core.ci.register import register_cpu_ci

    register_cpu_ci(est_time=12, suite="stage-a-cpu")
"""

from __future__ import annotations


def register_cpu_ci(
    est_time: float,
    suite: str,
    *,
    labels: list[str] | None = None,
    nightly: bool = False,
    disabled: str | None = None,
    issue: str | None = None,
) -> None:
    """Run this file on CPU runners in ``suite``; ``est_time`` is its wall time in seconds."""


def register_cuda_ci(
    est_time: float,
    suite: str,
    *,
    labels: list[str] | None = None,
    nightly: bool = False,
    disabled: str | None = None,
    issue: str | None = None,
    num_gpus: int = 1,
) -> None:
    """Run this file on CUDA runners in ``suite`` (``num_gpus`` is checked against the suite)."""
