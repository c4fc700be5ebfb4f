"""Rollout paths: ``direct`` (batched token-in generation) and ``agentic`` (session server)."""
