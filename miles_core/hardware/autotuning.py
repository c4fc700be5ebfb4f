"""Self-checks on Triton kernels without autotuning.

An autotuned Triton kernel (fla's Gated DeltaNet kernels, for one) compiles and benchmarks every
config of its list the first time it meets a new shape: on a fresh GPU machine that is most of a
``miles doctor`` run (minutes), spent finding the *fastest* config, while a self-check needs a
*correct* kernel. :func:`first_config_autotuning` makes every autotuner in the process keep only
the first config that survives its own pruning, so each kernel compiles once. The on-disk autotune
results of real runs are untouched: Triton keys them by the list of configs it benchmarked.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def first_config_autotuning() -> Iterator[bool]:
    """While active, Triton autotuners benchmark (and so compile) only their first remaining
    config. Yields whether Triton is installed (without it there is nothing to change)."""
    try:
        autotuner = importlib.import_module("triton.runtime.autotuner").Autotuner
    except ImportError:
        yield False
        return
    original = autotuner.prune_configs

    def first_config(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        return list(original(self, kwargs))[:1]

    autotuner.prune_configs = first_config
    try:
        yield True
    finally:
        autotuner.prune_configs = original
