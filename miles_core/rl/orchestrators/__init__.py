"""Where a run's parts live: :mod:`.base` (the protocol), :mod:`.builtin` (``inprocess``, ``ray``),
:mod:`.ray` (the Ray actors) and :mod:`.fingerprint` (the plugin check every worker runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.loop import RunResult, SignalHandler


def run_training(
    config: TrainConfig,
    pm: MilesPluginManager,
    *,
    resume: bool = False,
    started: float | None = None,
    after_summary: SignalHandler | None = None,
) -> RunResult:
    """Train with the orchestrator ``orchestrator.kind`` selects (the loop resolves it);
    ``started`` and ``after_summary``: see :func:`miles_core.rl.loop.train`."""
    from miles_core.gc_pause import gc_paused

    with gc_paused():  # the loop's modules import torch and transformers: long-lived objects only
        from miles_core.rl.loop import train

    return train(config, pm, resume=resume, started=started, after_summary=after_summary)
