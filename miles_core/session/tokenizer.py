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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.caching import BoundedCache, exact_json_key
from miles_core.chat_template import ChatTemplate
from miles_core.errors import ConfigError
from miles_core.frozen import quick_init
from miles_core.session.errors import InvalidRequest
from miles_core.session.families import TemplateFamily, detect_family, family_named
from miles_core.session.messages import Message

#: the conversation appended messages are rendered after (its assistant message is closed)
DUMMY_HISTORY: tuple[Message, ...] = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
)


#: renderings of the dummy history kept, one per tools + template kwargs (one per agent setup)
DUMMY_CACHE_ENTRIES = 256
#: the cache key of an agent setup without tools or template kwargs (most turns), made once
_NO_SETUP_KEY = exact_json_key([None, {}])


@quick_init
@dataclass(frozen=True)
class Appended:
    """Tokens that follow a generated turn: drop ``trim`` trailing completion tokens, add ``ids``."""

    trim: int
    ids: tuple[int, ...]


class ChatTokenizer:
    """Renders and encodes prompts for one tokenizer + chat template + template family."""

    def __init__(self, tokenizer: Any, family: TemplateFamily, *, source: str) -> None:
        self._tok = tokenizer
        self._template = ChatTemplate(tokenizer)
        self.family = family
        self.source = source
        self.vocab_size = len(tokenizer)  # the base vocabulary and every added token
        self.stop_id = self._single_token(family.stop_token) if family.stop_token else None
        self.reopening_ids = frozenset(self._single_token(t) for t in family.reopening_stops)
        self._close_after_stop = family.assistant_close[len(family.stop_token or "") :]
        self._dummy_cache: BoundedCache[str] = BoundedCache(DUMMY_CACHE_ENTRIES, size=lambda _: 1)
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
        """Token ids of a whole conversation followed by the generation prompt (cached)."""
        self._check_kwargs(template_kwargs)
        try:
            return self._template.prompt_ids(messages, tools=tools, template_kwargs=template_kwargs)
        except _RENDER_ERRORS as exc:
            raise _unrenderable(exc) from exc

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

        def render() -> str:
            return self._render(DUMMY_HISTORY, tools, template_kwargs, generation_prompt=False)

        key = _NO_SETUP_KEY if tools is None and not template_kwargs else exact_json_key([tools, dict(template_kwargs)])
        return render() if key is None else self._dummy_cache.get_or_compute(key, render)

    def encode(self, text: str) -> tuple[int, ...]:
        return self._template.encode(text)

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
        self._check_kwargs(template_kwargs)
        try:
            return self._template.render(
                messages, tools=tools, template_kwargs=template_kwargs, add_generation_prompt=generation_prompt
            )
        except _RENDER_ERRORS as exc:
            raise _unrenderable(exc) from exc

    def _check_kwargs(self, template_kwargs: Mapping[str, Any]) -> None:
        clash = self._template.reserved.intersection(template_kwargs)
        if clash:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")

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


def _unrenderable(exc: Exception) -> InvalidRequest:
    return InvalidRequest(f"the chat template cannot render this request: {type(exc).__name__}: {exc}")


def _render_errors() -> tuple[type[Exception], ...]:
    from jinja2 import TemplateError

    return (TemplateError, TypeError, ValueError, KeyError, AttributeError)


_RENDER_ERRORS = _render_errors()
