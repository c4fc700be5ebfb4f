"""Registration module of miles-e2b (entry point ``miles-e2b`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from miles_core.hookspecs import hookimpl  # noqa: F401
