"""Inference engine: the embedded engine, the SGLang adapter and the HTTP client both speak to.

The upstream contract is SGLang-compatible: ``POST /v1/chat/completions`` accepting ``input_ids``
and answering ``choices[0].meta_info.output_token_logprobs`` (``[logprob, token_id]`` pairs),
``completion_tokens`` and ``weight_version``; ``GET /health``; a weight-update endpoint.
:mod:`miles_core.engine.client` is the async client of that contract.
"""
