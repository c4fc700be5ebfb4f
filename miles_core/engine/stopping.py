"""When a sequence stops: stop token ids, stop strings, max tokens and the context length.

A :class:`StopRule` is what requests with equal sampling parameters share (built once per
distinct parameters, not per request); a :class:`StopChecker` adds the per-sequence state that
stop strings need. Sequences without stop strings need no checker: :meth:`StopRule.check_token`
decides from the newest token and the length alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from miles_core.engine.base import FinishReason, SamplingParams


@dataclass(frozen=True)
class Stop:
    reason: FinishReason
    matched: int | str | None = None


LENGTH = Stop("length")


class StopRule:
    """The stop conditions of one set of sampling parameters (stateless, shared by sequences)."""

    __slots__ = ("limit", "longest_stop", "stop", "stop_ids")

    def __init__(self, params: SamplingParams, *, eos_token_ids: Iterable[int], room: int) -> None:
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.limit = min(params.max_tokens, room)
        self.stop = params.stop
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    def check_token(self, token: int, length: int) -> Stop | None:
        """The stop after ``token`` made the completion ``length`` long, stop strings aside."""
        if token in self.stop_ids:
            return Stop("stop", token)
        if length >= self.limit:
            return LENGTH
        return None


class StopChecker:
    """Checks one sequence after each generated token.

    Stop strings are searched in the decoded completion (special tokens kept), only in the part
    that the newest token could have completed, so the cost per step stays small.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int],
        room: int,
        decode: Callable[[Sequence[int]], str],
        rule: StopRule | None = None,
    ) -> None:
        self.params = params
        self.rule = rule or StopRule(params, eos_token_ids=eos_token_ids, room=room)
        self.stop_ids = self.rule.stop_ids
        self.limit = self.rule.limit
        self.decode = decode
        self._scanned = 0

    def may_stop(self, token: int, length: int) -> bool:
        """A cheap pre-test after ``token`` made the completion ``length`` long: ``False`` means
        :meth:`check` would return ``None`` (the engine skips it for most sequences of most steps)."""
        return token in self.stop_ids or length >= self.limit or bool(self.params.stop)

    def check(self, tokens: Sequence[int]) -> Stop | None:
        last = tokens[-1]
        if last in self.stop_ids:
            return Stop("stop", last)
        if self.params.stop:
            text = self.decode(tokens)
            start = max(0, self._scanned - self.rule.longest_stop + 1)
            found = [(text.find(stop, start), stop) for stop in self.params.stop]
            found = [(at, stop) for at, stop in found if at >= 0]
            if found:
                return Stop("stop", min(found)[1])  # the earliest in the text
            self._scanned = len(text)
        if len(tokens) >= self.limit:
            return LENGTH
        return None
