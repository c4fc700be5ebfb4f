"""Conformance kit for rollout-function authors (``miles_rollout_functions``)::

    from miles_core.testing.rollout import assert_rollout_conforms

    def test_my_rollout_conforms():
        assert_rollout_conforms(MyRolloutFunction())

By default the rollout runs against :class:`ScriptedEngine`, an in-process engine whose every
sampled token and log-prob is known, with the character-level tokenizer of
:mod:`miles_core.assets.char_model`, on a tiny task; a function that talks to the engine through
something else (the session server) gets a ``context`` built on a real engine instead
(:func:`make_context`). Checked (:func:`miles_core.rl.rollout.probe.run_tiny_rollout`): one
trajectory per prompt in order; token ids, loss mask and log-probs consistent with each other and
with what the function declares it provides; with the scripted engine, every trajectory exactly
what the engine sampled for it (token-exact, never re-tokenized); the same step gives the same
tokens; and a batch split at ``first_index`` samples exactly what the whole batch does; and
``verify()`` passes. Needs torch and transformers.
"""

from __future__ import annotations

from miles_core.rl.rollout.base import RolloutContext, RolloutFunction
from miles_core.rl.rollout.probe import PROMPTS, ScriptedEngine, make_context, run_tiny_rollout
from miles_core.rl.rollout.types import Trajectory

__all__ = ["PROMPTS", "ScriptedEngine", "assert_rollout_conforms", "make_context"]


def assert_rollout_conforms(function: RolloutFunction, context: RolloutContext | None = None) -> list[Trajectory]:
    from miles_core.rl.algorithms.base import ROLLOUT_FIELDS

    assert isinstance(function, RolloutFunction), f"{function!r} lacks attributes of the RolloutFunction protocol"
    unknown = set(function.provides) - ROLLOUT_FIELDS.keys()
    assert not unknown, f"provides unknown fields {unknown}"
    function.verify()
    return run_tiny_rollout(function, context)
