"""Trainer backends (``trainer.backend``): ``hf`` and ``megatron``; see :mod:`.base`."""
