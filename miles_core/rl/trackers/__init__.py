"""Experiment trackers: where each step's metrics go (``run.trackers``).

The protocol is :mod:`.base`; the built-ins are ``jsonl`` (:mod:`.jsonl`, the run's own
``metrics.jsonl``), ``tensorboard`` (:mod:`.tensorboard_tracker`), ``wandb`` (:mod:`.wandb_tracker`) and
``mlflow`` (:mod:`.mlflow_tracker`); each tracker's SDK is imported only when a run selects it.
"""
