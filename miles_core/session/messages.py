"""Chat messages as the session server compares and renders them.

A client sends back the history it received, but not always spelled the same way: ``content``
``null`` instead of ``""``, text parts instead of a string, tool-call ``arguments`` re-serialized,
extra ``null`` fields from an SDK. :func:`message_key` maps every such spelling of one message to
the same hashable key; two messages match iff their keys are equal. It compares role, text,
name, tool-call names and (parsed) arguments, and tool_call_id; tool-call ids and
``reasoning_content`` are transport detail the checkpointed tokens already carry, so they are not
compared.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

Message = dict[str, Any]
MessageKey = tuple[Any, ...]

#: fields kept when a message is rendered by the chat template (others are SDK decoration)
RENDERED_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


def text_of(content: Any) -> str:
    """The text of a message ``content``: a string, ``None`` or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def canonical_message(message: Mapping[str, Any]) -> Message:
    """The message as the chat template sees it: string content, no ``null`` decoration."""
    out: Message = {"role": message["role"], "content": text_of(message.get("content"))}
    if len(message) > 1 + ("content" in message):  # most history messages hold just role and content
        for name in RENDERED_FIELDS:
            value = message.get(name)
            if value is not None and value != []:
                out[name] = value
    return out


def message_key(message: Mapping[str, Any]) -> MessageKey:
    tool_calls = message.get("tool_calls")  # every turn re-keys the whole history: skip the empty loop
    calls = (
        tuple((call["function"]["name"], _arguments_key(call["function"].get("arguments"))) for call in tool_calls)
        if tool_calls
        else ()
    )
    content = message.get("content")
    return (
        message["role"],
        content if type(content) is str else text_of(content),  # str: most messages, one call less
        message.get("name"),
        message.get("tool_call_id"),
        calls,
    )


def _arguments_key(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
