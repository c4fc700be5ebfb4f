"""When a sequence stops: stop token ids, stop strings, max tokens and the context length."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from miles_core.engine.base import FinishReason, SamplingParams


@dataclass(frozen=True)
class Stop:
    reason: FinishReason
    matched: int | str | None = None


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
    ) -> None:
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.limit = min(params.max_tokens, room)
        self.decode = decode
        self._longest_stop = max((len(s) for s in params.stop), default=0)
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
            start = max(0, self._scanned - self._longest_stop + 1)
            found = [(text.find(stop, start), stop) for stop in self.params.stop]
            found = [(at, stop) for at, stop in found if at >= 0]
            if found:
                return Stop("stop", min(found)[1])  # the earliest in the text
            self._scanned = len(text)
        if len(tokens) >= self.limit:
            return Stop("length")
        return None
