"""Registration module of miles-rocm (entry point ``miles-rocm`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from miles_core.hookspecs import hookimpl  # noqa: F401
