"""miles: reinforcement-learning post-training for LLMs, as a minimal core plus plugins.

The core must stay importable without torch, transformers, ray, megatron or e2b; heavy imports
happen only when a concern is activated.
"""

__version__ = "0.1.0"
