"""A tiny rollout whose every sampled token is known: what ``direct``'s ``verify()`` runs and the
conformance kit (:mod:`miles_core.testing.rollout`) builds on.

:class:`ScriptedEngine` is an in-process engine whose samples are a function of (prompt ids,
seed) and which records every completion; :func:`run_tiny_rollout` runs a rollout function on the
three-prompt task :data:`PROMPTS` against it (or against the engine of a given context) and
raises ``AssertionError`` unless the trajectories are consistent, deterministic per step,
independent of where the batch is split (``first_index``), and -- with the scripted engine --
exactly what the engine sampled (token-exact, never re-tokenized). Needs torch and transformers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_core.engine.base import Completion, GenerationRequest
from miles_core.rl.rollout.base import (
    GenerationEngine,
    RolloutContext,
    RolloutFunction,
    Tokenizer,
    rollout_tokenizer,
)
from miles_core.rl.rollout.types import Trajectory
from miles_core.rl.tasks import Prompt, TrainableTask

PROMPTS = (
    Prompt(id="1+2", text="1+2=", answer="3"),
    Prompt(id="4+4", text="4+4=", answer="8"),
    Prompt(id="2+5", text="2+5=", answer="7"),
)


@dataclass
class ScriptedEngine:
    """An engine whose samples are a function of (prompt ids, seed): it records every completion."""

    vocab: Sequence[int] = tuple(range(2, 14))  # the char tokenizer's digits and '+', '='
    weight_version: str = "0"
    completions: list[Completion] = field(default_factory=list)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        out = []
        for request in requests:
            seed = request.sampling.seed if request.sampling.seed is not None else 0
            digest = hashlib.blake2b(f"{list(request.input_ids)}/{seed}".encode(), digest_size=16).digest()
            n = 1 + digest[0] % max(1, request.sampling.max_tokens)
            tokens = tuple(self.vocab[b % len(self.vocab)] for b in digest[1 : 1 + n])
            logprobs = tuple(-((b % 7) + 1) / 8 for b in digest[1 : 1 + n])
            completion = Completion(
                request_id=str(len(self.completions)), prompt_ids=tuple(request.input_ids), token_ids=tokens,
                logprobs=logprobs, finish_reason="length", matched_stop=None, weight_version=self.weight_version,
                seed=seed,
            )
            self.completions.append(completion)
            out.append(completion)
        return out

    def update_weights(self, weights: object, version: str) -> str:
        self.weight_version = version
        return version


def make_context(engine: GenerationEngine | None = None, tokenizer: Tokenizer | None = None, model_dir: Path | None = None,
                 session_url: str | None = None, **rollout: object) -> RolloutContext:
    """A context on ``engine`` (default :class:`ScriptedEngine`) and ``tokenizer`` (default the
    char tokenizer), for the tiny task of :data:`PROMPTS`; ``session_url`` names a session server
    already running in front of an engine; ``rollout`` overrides ``rollout.*``."""
    from miles_core.assets.char_model import build_char_tokenizer
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.aio import BackgroundLoop
    from miles_core.rl.config import TrainConfig

    config = TrainConfig.model_validate({
        "model": {"path": str(model_dir or ".")},
        "rollout": {"prompts_per_step": len(PROMPTS), "samples_per_prompt": 2, "max_new_tokens": 3, **rollout},
    })
    task = TrainableTask("conformance", "three sums", PROMPTS, lambda inputs: [0.0] * len(inputs), True, ())
    return RolloutContext(config, task, engine or ScriptedEngine(), tokenizer or rollout_tokenizer(build_char_tokenizer()),
                          Path(model_dir or "."), BackgroundLoop("miles-rollout-conformance"), get_plugin_manager(),
                          session_url)


def run_tiny_rollout(function: RolloutFunction, context: RolloutContext | None = None) -> list[Trajectory]:
    """Run ``function`` on the tiny task and check its trajectories (see the module doc)."""
    own_context = context is None
    if context is None:
        assert not function.session_server, "a session-server rollout needs a context on a real engine (make_context)"
        context = make_context()
    batch = [p for p in PROMPTS for _ in range(context.config.rollout.samples_per_prompt)]
    rollout = function.start(context)
    try:
        assert isinstance(rollout.label, str) and rollout.label, "the rollout needs a label for the time split"
        trajectories = rollout.run(batch, 0)
        again = rollout.run(batch, 0)
        tail = rollout.run(batch[1:], 0, first_index=1)
    finally:
        rollout.close()
        if own_context:
            context.aio.close()
    assert len(trajectories) == len(batch), f"{len(trajectories)} trajectories for {len(batch)} prompts"
    for prompt, trajectory in zip(batch, trajectories, strict=True):
        _check_trajectory(prompt, trajectory, function)
    assert [_tokens(t) for t in again] == [_tokens(t) for t in trajectories], "the same step sampled other tokens"
    assert [_tokens(t) for t in tail] == [_tokens(t) for t in trajectories[1:]], (
        "a batch split at first_index=1 sampled other tokens than the whole batch (seed samples by "
        "sample_seed(run seed, step, first_index + i))"
    )
    if isinstance(context.engine, ScriptedEngine) and context.session_url is None:  # it sampled them
        _check_token_exact(trajectories, context.engine.completions[: len(batch)])
    return trajectories


def _tokens(t: Trajectory) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return t.token_ids, t.rollout_logprobs


def _check_trajectory(prompt: Prompt, t: Trajectory, function: RolloutFunction) -> None:
    assert t.prompt == prompt, f"trajectory for {t.prompt.id!r} where {prompt.id!r} was asked (order)"
    n = t.response_length
    assert 0 < n < len(t.token_ids), f"response_length {n} of {len(t.token_ids)} tokens"
    assert len(t.loss_mask) == n and set(t.loss_mask) <= {0, 1} and any(t.loss_mask), f"loss_mask {t.loss_mask}"
    assert len(t.rollout_logprobs) == n, f"{len(t.rollout_logprobs)} log-probs for {n} response tokens"
    if "rollout_logprobs" in function.provides:
        generated = [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
        assert all(math.isfinite(lp) and lp <= 0 for lp in generated), f"log-probs {generated}"
    assert t.turns >= 1 and t.weight_version, "turns and weight_version are recorded"
    t.document(0.0)


def _check_token_exact(trajectories: Sequence[Trajectory], completions: Sequence[Completion]) -> None:
    for t, c in zip(trajectories, completions, strict=True):
        assert t.token_ids == c.prompt_ids + c.token_ids, (
            f"trajectory tokens {t.token_ids} are not the prompt + sample the engine produced "
            f"{c.prompt_ids + c.token_ids} (re-tokenized?)"
        )
        assert t.rollout_logprobs == c.logprobs, f"log-probs {t.rollout_logprobs} are not the engine's {c.logprobs}"
        assert t.response_length == len(c.token_ids) and t.weight_version == c.weight_version
