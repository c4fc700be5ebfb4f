"""Registration markers a test file calls at module level to say where it runs in CI.

They are runtime no-ops: ``miles ci`` finds them by parsing source (test files are never
imported), so every argument must be a literal and the call must sit at module level. Hardware
plugins contribute their own marker (``register_rocm_ci`` comes from miles-rocm) through the
``miles_ci_hardware`` hook; ``miles ci`` derives what a marker accepts from its signature.

Example (top of a test file)::

    from miles_core.ci.register import register_cpu_ci

    register_cpu_ci(est_time=12, suite="stage-a-cpu")

Parameters common to every marker:

* ``est_time`` -- measured wall time of the whole file in seconds (``miles ci est-times``
  proposes fresh values from JUnit reports); drives sharding and the per-file timeout.
* ``suite`` -- the CI stage (a suite declared in ``[tool.miles.ci.suites]``).
* ``labels`` -- known labels; a labelled file runs only when the run selects one of them
  (``--labels``, a ``run-ci-<label>`` pull-request label, or the nightly cadence). GPU
  registrations must carry one, so they never take runners unasked.
* ``nightly`` -- run only in the nightly cadence.
* ``disabled`` -- a reason string; the file is listed with the reason in every report, never run.
* ``issue`` -- tracking link or reference for a disabled entry, so re-enabling is planned.
"""

from __future__ import annotations

from collections.abc import Mapping


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
    num_gpus: int | None = None,
    layout: Mapping[str, int] | None = None,
) -> None:
    """Run this file on CUDA runners in ``suite``.

    ``num_gpus`` (default: the suite's GPUs per runner) must equal the suite's count. ``layout``
    (``{"tp": 2, "pp": 2, "ep": 2}``, see :mod:`miles_core.ci.layout`) is validated against it
    when the registration is discovered, so an impossible parallel layout fails before a runner
    is taken.
    """
