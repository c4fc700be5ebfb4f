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
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import orjson

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


#: token ids of rendered first-turn prompts kept for reuse (GRPO sends each prompt many times)
PROMPT_CACHE_TOKENS = 1 << 18
#: renderings of the dummy history kept, one per tools + template kwargs (one per agent setup)
DUMMY_CACHE_ENTRIES = 256


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
        self.vocab_size = len(tokenizer)  # the base vocabulary and every added token
        self._reserved = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        self.stop_id = self._single_token(family.stop_token) if family.stop_token else None
        self.reopening_ids = frozenset(self._single_token(t) for t in family.reopening_stops)
        self._close_after_stop = family.assistant_close[len(family.stop_token or "") :]
        self._dummy_cache: BoundedCache[str] = BoundedCache(DUMMY_CACHE_ENTRIES, size=lambda _: 1)
        # a template that reads the clock (strftime_now) renders differently over time
        self._prompt_cache: BoundedCache[tuple[int, ...]] | None = (
            None if "strftime_now" in (tokenizer.chat_template or "") else BoundedCache(PROMPT_CACHE_TOKENS, size=len)
        )
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

        def render() -> tuple[int, ...]:
            return self.encode(self._render(messages, tools, template_kwargs, generation_prompt=True))

        key = _render_key(messages, tools, template_kwargs)
        if self._prompt_cache is None or key is None:
            return render()
        return self._prompt_cache.get_or_compute(key, render)

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

        key = _render_key((), tools, template_kwargs)
        return render() if key is None else self._dummy_cache.get_or_compute(key, render)

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


def _render_key(
    messages: Sequence[Message], tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]
) -> bytes | None:
    """What a rendering depends on, as exact bytes: key order kept (``tojson`` in a template
    keeps it too), ``1`` and ``1.0`` and ``true`` apart. ``None`` if orjson cannot encode it."""
    try:
        return orjson.dumps([messages, tools, template_kwargs])
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, deep nesting, a non-JSON value
        return None


V = TypeVar("V")


class BoundedCache(Generic[V]):
    """Values by key, the oldest evicted once their total ``size`` exceeds ``limit``."""

    def __init__(self, limit: int, *, size: Callable[[V], int]) -> None:
        self._limit = limit
        self._size = size
        self._total = 0
        self._entries: dict[Hashable, V] = {}

    def get_or_compute(self, key: Hashable, compute: Callable[[], V]) -> V:
        value = self._entries.get(key)
        if value is None:
            value = compute()
            self.put(key, value)
        return value

    def get(self, key: Hashable) -> V | None:
        return self._entries.get(key)

    def put(self, key: Hashable, value: V) -> None:
        if key in self._entries:
            return
        self._entries[key] = value
        self._total += self._size(value)
        while self._total > self._limit:
            self._total -= self._size(self._entries.pop(next(iter(self._entries))))


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
