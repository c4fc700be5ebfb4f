"""Inference engines behind one upstream contract: the embedded engine and an SGLang adapter.

See ``docs/engine.md``. Importing this package is cheap; the heavy modules
(:mod:`miles_core.engine.engine`, :mod:`miles_core.engine.server`) import torch/transformers or
Starlette when imported themselves.
"""
