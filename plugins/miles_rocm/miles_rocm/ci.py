"""ROCm CI registration marker (contributed to ``miles ci`` through ``miles_ci_hardware``).

A runtime no-op like the core markers: ``miles ci`` finds calls by parsing source.

    from miles_rocm.ci import register_rocm_ci

    register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)
"""

from __future__ import annotations


def register_rocm_ci(
    est_time: float,
    suite: str,
    *,
    labels: list[str] | None = None,
    nightly: bool = False,
    disabled: str | None = None,
    issue: str | None = None,
    num_gpus: int = 1,
) -> None:
    """Run this file on ROCm runners in ``suite`` (``num_gpus`` is checked against the suite)."""
