"""RL post-training, ``miles train``: config, tasks, rollouts, algorithms, trainers, the loop.

See ``docs/train.md``. Importing this package is cheap; ``miles_core.rl.loop.train`` and the
trainer backends import torch and transformers when they run.
"""
