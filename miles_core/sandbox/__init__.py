"""Sandboxes: the provider protocol (``base``), the shared lifecycle layer (``lifecycle``),
warm pools for rewards (``pool``), activation by name (``activation``), the built-in ``local``
provider (``local``) and ``miles sandbox`` (``cli``). See docs/sandbox.md.

Nothing is imported here: registering the built-in provider must stay cheap.
"""
