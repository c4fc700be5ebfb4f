"""Prompt token ids from a Hugging Face tokenizer directory and its chat template.

* The first turn of a trajectory is rendered whole (``add_generation_prompt=True``) and encoded.
* Later turns never re-render history: the appended messages are rendered after a fixed dummy
  conversation, the text the template adds for them (the rendering *diff*) is encoded, and the
  family's boundary rule (:mod:`miles_core.session.families`) joins it to the tokens the model
  actually generated.

Loading checks the declared family against the real template (an assistant message must render
closed by ``assistant_close``; appending a message must not re-render earlier ones), so a
mismatch fails at start-up instead of drifting tokens silently.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.session.errors import InvalidRequest
from miles_core.session.families import TemplateFamily, detect_family, family_named
from miles_core.session.messages import Message

#: the conversation appended messages are rendered after (its assistant message is closed)
DUMMY_HISTORY: tuple[Message, ...] = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
)


DUMMY_CACHE_SIZE = 256


@dataclass(frozen=True)
class Appended:
    """Tokens that follow a generated turn: drop ``trim`` trailing completion tokens, add ``ids``."""

    trim: int
    ids: tuple[int, ...]


class ChatTokenizer:
    """Renders and encodes prompts for one tokenizer + chat template + template family."""

    def __init__(self, tokenizer: Any, family: TemplateFamily, *, source: str) -> None:
        self._tok = tokenizer
        self._backend = _private_backend(tokenizer)
        self.family = family
        self.source = source
        self._reserved = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        self.stop_id = self._single_token(family.stop_token) if family.stop_token else None
        self.reopening_ids = frozenset(self._single_token(t) for t in family.reopening_stops)
        self._close_after_stop = family.assistant_close[len(family.stop_token or "") :]
        self._dummy_cache: dict[str, str] = {}
        self._check_family()

    @classmethod
    def from_dir(
        cls, path: str | Path, *, chat_template: str | Path | None = None, family: str | None = None
    ) -> ChatTokenizer:
        """Load ``path`` with ``AutoTokenizer``; ``chat_template`` (a file) replaces its template."""
        directory = Path(path)
        if not directory.is_dir():
            raise ConfigError(f"tokenizer directory {directory} does not exist")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory))
        except Exception as exc:  # transformers raises many types for a bad directory
            raise ConfigError(f"cannot load a tokenizer from {directory}: {type(exc).__name__}: {exc}") from exc
        if chat_template is not None:
            template_file = Path(chat_template)
            if not template_file.is_file():
                raise ConfigError(f"chat template file {template_file} does not exist")
            tok.chat_template = template_file.read_text()
        template = tok.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise ConfigError(f"tokenizer {directory} has no chat template; pass one (--chat-template FILE)")
        tok.chat_template = template
        chosen = family_named(family) if family else detect_family(template)
        return cls(tok, chosen, source=str(directory))

    # -- the two operations stores use -------------------------------------------------------

    def render_prompt(
        self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]
    ) -> tuple[int, ...]:
        """Token ids of a whole conversation followed by the generation prompt."""
        return self.encode(self._render(messages, tools, template_kwargs, generation_prompt=True))

    def render_append(
        self,
        completion_ids: Sequence[int],
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
    ) -> Appended:
        """Tokens to append after a generated turn ending in ``completion_ids``."""
        before = self._dummy_history(tools, template_kwargs)
        after = self._render((*DUMMY_HISTORY, *messages), tools, template_kwargs, generation_prompt=True)
        if not after.startswith(before):
            raise InvalidRequest(
                "the chat template re-renders earlier messages when these messages are appended, "
                "so they cannot be tokenized incrementally"
            )
        diff = after[len(before) :]
        last = completion_ids[-1] if completion_ids else None
        if last is not None and last in self.reopening_ids:
            return Appended(trim=1, ids=self.encode(diff))
        close = self._close_after_stop if last is not None and last == self.stop_id else self.family.assistant_close
        return Appended(trim=0, ids=self.encode(close + diff))

    # -- helpers ------------------------------------------------------------------------------

    def _dummy_history(self, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]) -> str:
        """The rendering of :data:`DUMMY_HISTORY`, cached per tools + kwargs (one per agent setup)."""
        key = json.dumps([tools, template_kwargs], sort_keys=True, default=repr)
        cached = self._dummy_cache.get(key)
        if cached is None:
            cached = self._render(DUMMY_HISTORY, tools, template_kwargs, generation_prompt=False)
            if len(self._dummy_cache) >= DUMMY_CACHE_SIZE:
                self._dummy_cache.pop(next(iter(self._dummy_cache)))
            self._dummy_cache[key] = cached
        return cached

    def encode(self, text: str) -> tuple[int, ...]:
        if self._backend is not None:
            return tuple(self._backend.encode(text, add_special_tokens=False).ids)
        return tuple(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def _render(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        *,
        generation_prompt: bool,
    ) -> str:
        clash = self._reserved.intersection(template_kwargs)
        if clash:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
        from jinja2 import TemplateError

        try:
            return self._tok.apply_chat_template(
                list(messages),
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **template_kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequest(f"the chat template cannot render this request: {type(exc).__name__}: {exc}") from exc

    def _single_token(self, text: str) -> int:
        ids = self._tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"template family {self.family.name!r} needs {text!r} to be one token, "
                f"but tokenizer {self.source} encodes it as {ids}"
            )
        return ids[0]

    def _check_family(self) -> None:
        """The declared boundary rule holds for this template (see module docstring)."""
        name, close = self.family.name, self.family.assistant_close
        try:
            rendered = self._render(DUMMY_HISTORY, None, {}, generation_prompt=False)
            extended = self._render(
                (*DUMMY_HISTORY, {"role": "user", "content": "V"}), None, {}, generation_prompt=True
            )
        except InvalidRequest as exc:
            raise ConfigError(f"chat template of {self.source} cannot render a plain conversation: {exc}") from exc
        if not rendered.endswith("A" + close):
            raise ConfigError(
                f"chat template of {self.source} does not follow template family {name!r}: an assistant "
                f"message renders as ...{rendered[-40:]!r}, expected it to end with {'A' + close!r}"
            )
        if not extended.startswith(rendered):
            raise ConfigError(
                f"chat template of {self.source} is not append-only: appending a user message re-renders "
                "the assistant message before it (common with templates that strip reasoning from "
                "earlier turns); pass an append-only template with --chat-template FILE"
            )


def _private_backend(tokenizer: Any) -> Any:
    """A private copy of a fast tokenizer's Rust backend, set up as ``tokenizer.encode(text,
    add_special_tokens=False)`` sets up the shared one (no truncation or padding, special tokens
    split as configured), or ``None`` for a tokenizer without one. Calling it directly skips
    ~25 us of Python per call and the batch path's thread pool; a copy, so nothing that changes
    the caller's tokenizer settings later can change what this one encodes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    private = Tokenizer.from_str(backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return private
