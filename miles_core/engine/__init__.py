"""Inference engines behind one upstream contract: the embedded engine, the SGLang adapter, and
the HTTP client that speaks to either.

The contract is SGLang-compatible: ``POST /v1/chat/completions`` accepting ``input_ids`` and
answering ``choices[0].meta_info.output_token_logprobs`` (``[logprob, token_id]`` pairs),
``completion_tokens`` and ``weight_version``; ``GET /health``; ``POST /update_weights_from_disk``.
See ``docs/engine.md``. Importing this package is cheap; :mod:`miles_core.engine.engine` and
:mod:`miles_core.engine.server` import torch/transformers or Starlette when imported themselves,
and :mod:`miles_core.engine.client` is the async client of the contract.
"""
