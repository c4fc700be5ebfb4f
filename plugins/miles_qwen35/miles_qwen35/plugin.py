"""Registration module of miles-qwen35 (entry point ``miles-qwen35`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from miles_core.hookspecs import hookimpl  # noqa: F401
