"""Typed completion extractor: an upstream chat reply -> :class:`Completion`.

Every reply that breaks the SGLang-compatible contract -- no choices, no message, no
``meta_info``, malformed ``[logprob, token_id]`` pairs, a token id outside the tokenizer's
vocabulary, a token count that disagrees with ``completion_tokens``, a message with neither
content nor tool calls, an empty completion that its token limit did not cut off -- raises
:class:`~miles_core.session.errors.UpstreamFailure` (HTTP 502) with a bounded message, before
anything is recorded.

**Token ids** must lie in ``[0, vocab_size)``, ``vocab_size`` being the session tokenizer's
whole vocabulary (added tokens included): an id the tokenizer cannot decode would be sent back
upstream in the next turn's prompt and trained on.

**An empty completion** (no tokens) is a turn only when its token limit ended it
(``finish_reason == "length"``, e.g. ``max_tokens: 0``) and its message is empty (content ``""``,
no tool calls): it is then recorded like any truncated turn (response length 0; extending it is
409). Any other empty completion claims to have stopped without sampling anything -- not even
the stop token, which the engine returns as part of the completion -- or carries text without
the tokens it came from, and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

from miles_core.frozen import quick_init
from miles_core.session.errors import UpstreamFailure
from miles_core.session.messages import Message

#: replay data some engines attach to ``meta_info``; recorded, never returned to the agent
REPLAY_META_FIELDS = ("routed_experts", "indexer_topk")


@quick_init
@dataclass(frozen=True)
class Completion:
    """One generated assistant turn, as sampled."""

    message: Message  # the assistant message returned to the agent
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    weight_version: str | None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@quick_init
@dataclass(frozen=True)
class ChatTurn:
    """What an agent needs from a chat reply."""

    message: dict[str, Any]  # the assistant message, as an agent appends it to its history
    finish_reason: str | None


def extract_completion(reply: Mapping[str, Any], *, vocab_size: int) -> Completion:
    """The completion carried by ``reply``; ``vocab_size`` bounds its token ids (module docstring)."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _bad("reply has no choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _bad("choices[0] is not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _bad("choices[0].message is missing or not an object")
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        raise _bad("choices[0].meta_info is missing (the engine must return token ids and log-probs)")
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise _bad("choices[0].meta_info.output_token_logprobs is missing or not a list")
    token_ids, logprobs = _split_pairs(pairs, vocab_size)
    expected = meta.get("completion_tokens", (reply.get("usage") or {}).get("completion_tokens"))
    if not _is_int(expected):
        raise _bad("completion_tokens is missing (neither meta_info.completion_tokens nor usage.completion_tokens)")
    if expected != len(token_ids):
        raise _bad(f"completion_tokens={expected} but output_token_logprobs has {len(token_ids)} entries")
    finish_reason = choice.get("finish_reason")
    if isinstance(finish_reason, dict):  # SGLang reports {"type": "stop", ...} in meta_info style
        finish_reason = finish_reason.get("type")
    weight_version = meta.get("weight_version", reply.get("weight_version"))
    return make_completion(message, token_ids, logprobs, finish_reason, weight_version)


def make_completion(
    message: Mapping[str, Any],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: Any,
    weight_version: Any,
) -> Completion:
    """A :class:`Completion` from an engine's answer, after the rules every upstream is held to
    (module docstring; token ids and log-probs already checked: :func:`check_sampled`)."""
    return Completion(
        checked_message(message, bool(token_ids), finish_reason),
        tuple(token_ids),
        tuple(logprobs),
        finish_reason,
        None if weight_version is None else str(weight_version),
    )


def checked_message(message: Mapping[str, Any], sampled: bool, finish_reason: Any) -> Message:
    """The assistant message of a completion (``sampled``: it has tokens), checked against the
    module docstring's rules: what :func:`make_completion` records, which depends on nothing
    else."""
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and not tool_calls:
        raise _bad("choices[0].message has neither content nor tool_calls (did the tool-call parser fail?)")
    if content is not None and not isinstance(content, str):
        raise _bad("choices[0].message.content is not a string")
    if tool_calls is not None and not _valid_tool_calls(tool_calls):
        raise _bad("choices[0].message.tool_calls is not a list of {function: {name, arguments}} objects")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise _bad("choices[0].finish_reason is not a string")
    if not sampled and (finish_reason != "length" or content or tool_calls):
        raise _bad(
            "empty completion: no tokens, but "
            + (
                "a message with text or tool calls"
                if content or tool_calls
                else f"finish_reason={finish_reason!r} (only a completion its token limit ended may be empty)"
            )
        )
    assistant: Message = {"role": "assistant", "content": content}
    for name in ("tool_calls", "reasoning_content"):
        if message.get(name) is not None:
            assistant[name] = message[name]
    return assistant


def check_sampled(token_ids: Sequence[int], logprobs: Sequence[float], vocab_size: int) -> None:
    """The checks :func:`extract_completion` applies to ``[logprob, token_id]`` pairs, for an
    engine called in-process (typed ids and log-probs, no pairs)."""
    if len(token_ids) != len(logprobs):
        raise _bad(f"the engine returned {len(token_ids)} token ids but {len(logprobs)} log-probs")
    if token_ids and not _plausible(token_ids, logprobs, vocab_size):
        _split_pairs([[logprob, token_id] for logprob, token_id in zip(logprobs, token_ids)], vocab_size)


def sampled_plausibly(token_ids: Sequence[Sequence[Any]], logprobs: Sequence[Sequence[Any]], vocab_size: int) -> bool:
    """Whether every completion of a batch (``token_ids[i]``, ``logprobs[i]``) passes
    :func:`check_sampled`, in a few passes over all of them: ``False`` leaves it to
    :func:`check_sampled` to name what fails."""
    if list(map(len, token_ids)) != list(map(len, logprobs)):
        return False
    ids, values = list(chain.from_iterable(token_ids)), list(chain.from_iterable(logprobs))
    return not ids or _plausible(ids, values, vocab_size)


def _plausible(token_ids: Sequence[Any], logprobs: Sequence[Any], vocab_size: int) -> bool:
    """The bulk check of the common case: plain ints in the vocabulary, finite log-probs <= 0."""
    return (
        set(map(type, token_ids)) == {int}
        and min(token_ids) >= 0
        and max(token_ids) < vocab_size
        and set(map(type, logprobs)) <= {float, int}
        and max(logprobs) <= 0
        and math.isfinite(sum(logprobs))  # no -inf or NaN among them
    )


def _split_pairs(pairs: list[Any], vocab_size: int) -> tuple[list[int], list[float]]:
    """Token ids (in ``[0, vocab_size)``) and log-probs of ``[logprob, token_id]`` pairs: a bulk
    check for the common case (completions run to thousands of tokens), then a per-entry pass
    that names the first bad entry or accepts unusual but valid spellings (tuples, int
    subclasses)."""
    if pairs and set(map(type, pairs)) == {list} and min(map(len, pairs)) >= 2:
        token_ids = list(map(itemgetter(1), pairs))
        logprobs = list(map(itemgetter(0), pairs))
        if _plausible(token_ids, logprobs, vocab_size):
            return token_ids, logprobs if set(map(type, logprobs)) == {float} else list(map(float, logprobs))
    token_ids, logprobs = [], []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) < 2:
            raise _bad(f"output_token_logprobs[{i}] is not a [logprob, token_id] pair")
        logprob, token_id = pair[0], pair[1]
        if not _is_int(token_id) or token_id < 0:
            raise _bad(f"output_token_logprobs[{i}] token id {token_id!r} is not a non-negative integer")
        if token_id >= vocab_size:
            raise _bad(
                f"output_token_logprobs[{i}] token id {token_id} is outside the tokenizer's vocabulary "
                f"({vocab_size} ids: 0..{vocab_size - 1})"
            )
        if not _is_number(logprob) or not math.isfinite(logprob) or logprob > 0:
            raise _bad(f"output_token_logprobs[{i}] log-prob {logprob!r} is not a finite number <= 0")
        token_ids.append(int(token_id))
        logprobs.append(float(logprob))
    return token_ids, logprobs


def client_reply(reply: Mapping[str, Any], *, logprobs: bool = True) -> dict[str, Any]:
    """The reply returned to the agent: the upstream reply without replay data in ``meta_info``,
    and without OpenAI ``logprobs`` unless the agent asked for them (``logprobs=False``: the
    session server asks the engine for them on its own account)."""
    choices = []
    for choice in reply.get("choices") or ():
        if isinstance(choice, dict):
            meta = choice.get("meta_info")
            if isinstance(meta, dict) and any(k in meta for k in REPLAY_META_FIELDS):
                choice = {**choice, "meta_info": {k: v for k, v in meta.items() if k not in REPLAY_META_FIELDS}}
            if not logprobs and choice.get("logprobs") is not None:
                choice = {**choice, "logprobs": None}
        choices.append(choice)
    return {**reply, "choices": choices}


def _valid_tool_calls(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict))
        for c in calls
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad(what: str) -> UpstreamFailure:
    return UpstreamFailure(f"malformed upstream reply: {what}")
