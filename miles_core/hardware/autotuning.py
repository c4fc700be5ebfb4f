"""Self-checks on Triton kernels without autotuning.

An autotuned Triton kernel (fla's Gated DeltaNet kernels, for one) compiles and benchmarks every
config of its list the first time it meets a new shape: on a fresh GPU machine that is most of a
``miles doctor`` run (minutes), spent finding the *fastest* config, while a self-check needs a
*correct* kernel. :func:`first_config_autotuning` makes every autotuner in the process keep only
the first config that survives its own pruning and skip timing it, so each kernel compiles once
and runs only when called. The on-disk autotune results of real runs are untouched: Triton keys
them by the list of configs it benchmarked.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def first_config_autotuning() -> Iterator[bool]:
    """While active, Triton autotuners take their first remaining config without benchmarking
    anything. Yields whether Triton is installed (without it there is nothing to change)."""
    try:
        autotuner = importlib.import_module("triton.runtime.autotuner").Autotuner
    except ImportError:
        yield False
        return
    prune = autotuner.prune_configs
    bench = getattr(autotuner, "_bench", None)  # Triton's private timing call (3.x); left alone if absent

    def first_config(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        return list(prune(self, kwargs))[:1]

    def untimed(self: Any, *args: Any, config: Any, **meta: Any) -> list[float]:
        # the only candidate wins whatever it measures: timing it would launch it ~100 times
        return [0.0, 0.0, 0.0]

    autotuner.prune_configs = first_config
    if bench is not None:
        autotuner._bench = untimed
    try:
        yield True
    finally:
        autotuner.prune_configs = prune
        if bench is not None:
            autotuner._bench = bench
