"""The one prompt renderer: a tokenizer's chat template, rendered and encoded.

The direct rollout (prompt ids for ``generate``), the embedded engine's HTTP front (``messages``
without ``input_ids``) and the session server (the first turn of a trajectory, and the text a
turn appends) all render prompts here, so the same conversation gets the same ids on every path.

Rendering is what ``tokenizer.apply_chat_template(..., tokenize=False)`` does, and encoding what
``tokenizer(text, add_special_tokens=False)`` does -- ``apply_chat_template(tokenize=True)`` is
exactly the two. Two shortcuts keep it cheap on the session server's per-turn path, each used
only where it provably changes nothing:

* **Rendering** calls transformers' own ``render_jinja_template`` (what ``apply_chat_template``
  calls) directly when the messages are plain JSON dicts without ``null`` fields -- for those,
  the normalisation ``apply_chat_template`` runs first (message objects to dicts, ``null`` fields
  dropped) is the identity; it walks every value of every message, half of a short render's
  cost. At construction both ways render probe conversations, and any difference (a transformers
  version whose ``apply_chat_template`` does more) turns the shortcut off.
* **Encoding** uses a private copy of a fast tokenizer's Rust backend set up as the tokenizer's
  ``encode`` sets up the shared one (no truncation or padding, special tokens split as
  configured): ~25 us of Python less per call, and nothing that changes the caller's tokenizer
  settings later can change what this one encodes. Where the process has turned the Rust
  library's parallelism off (``TOKENIZERS_PARALLELISM=false``, as ``miles session serve`` does)
  a text is encoded as a batch of one without character offsets (``encode_batch_fast``): the
  same ids at less cost (28 -> 12 us for a 100-character turn in a tight loop). With
  parallelism on, that call would start the library's thread pool, and a process that forks
  afterwards (the local sandbox does) would have each child print a warning; there the plain
  ``encode`` is used.
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from miles_core.caching import BoundedCache, exact_json_key, is_exact_json

#: token ids of rendered prompts kept for reuse (GRPO sends each prompt many times)
PROMPT_CACHE_TOKENS = 1 << 18

Message = Mapping[str, Any]

_PROBES: tuple[tuple[tuple[dict[str, Any], ...], Any, bool], ...] = (
    (({"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}), None, False),
    (({"role": "user", "content": "U"},), None, True),
    (
        (
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "R", "tool_call_id": "c"},
        ),
        [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
        True,
    ),
)


class ChatTemplate:
    """Renders and encodes conversations with ``tokenizer``'s chat template (see the module doc).
    ``ChatTemplate.of(tokenizer)`` shares one per tokenizer object."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        self.template: str | None = template if isinstance(template, str) and template else None
        #: ``apply_chat_template``'s own parameters: not settable through template kwargs
        self.reserved = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        self._backend = _private_backend(tokenizer)
        # a template that reads the clock (strftime_now) renders differently over time
        self._prompts: BoundedCache[tuple[int, ...]] | None = (
            None if "strftime_now" in (self.template or "") else BoundedCache(PROMPT_CACHE_TOKENS, size=len)
        )
        self._special = dict(tokenizer.special_tokens_map)
        self._direct = self.template is not None and self._direct_agrees()

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, ChatTemplate]] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer: Any) -> ChatTemplate:
        """The renderer of ``tokenizer`` (one per tokenizer object, made on first use)."""
        try:
            renderer = cls._shared.get(tokenizer)
        except TypeError:  # not weakly referenceable
            return cls(tokenizer)
        if renderer is None or renderer.template != tokenizer.chat_template:
            renderer = cls._shared[tokenizer] = cls(tokenizer)
        return renderer

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the template renders it (``apply_chat_template(tokenize=False)``)."""
        kwargs = dict(template_kwargs or {})
        if self._direct and not continue_final_message and _plain_messages(messages) and (tools is None or is_exact_json(tools)):
            render_jinja_template = _render_jinja_template()
            rendered, _ = render_jinja_template(
                conversations=[list(messages)],
                tools=tools,
                documents=None,
                chat_template=self.template,
                return_assistant_tokens_mask=False,
                continue_final_message=False,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **kwargs},
            )
            return rendered[0]
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )

    def encode(self, text: str) -> tuple[int, ...]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]``."""
        backend = self._backend
        if backend is not None:
            if parallelism_off():
                return tuple(backend.encode_batch_fast((text,), add_special_tokens=False)[0].ids)
            return tuple(backend.encode(text, add_special_tokens=False).ids)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """Token ids of the conversation followed by the generation prompt, cached by the exact
        JSON of what the rendering depends on."""

        def compute() -> tuple[int, ...]:
            return self.encode(self.render(messages, tools=tools, template_kwargs=template_kwargs))

        key = exact_json_key([list(messages), tools, dict(template_kwargs or {})]) if self._prompts is not None else None
        if key is None or self._prompts is None:
            return compute()
        return self._prompts.get_or_compute(key, compute)

    def _direct_agrees(self) -> bool:
        """Whether the direct render gives what ``apply_chat_template`` gives on the probes."""
        render_jinja_template = _render_jinja_template()
        for messages, tools, generation_prompt in _PROBES:
            try:
                expected = self.tokenizer.apply_chat_template(
                    list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
                )
            except Exception:  # a template these probes do not fit: leave it to apply_chat_template
                return False
            try:
                rendered, _ = render_jinja_template(
                    conversations=[list(messages)], tools=tools, documents=None, chat_template=self.template,
                    return_assistant_tokens_mask=False, continue_final_message=False,
                    add_generation_prompt=generation_prompt, **self._special,
                )
            except Exception:
                return False
            if rendered[0] != expected:
                return False
        return True


def _plain_messages(messages: Sequence[Message]) -> bool:
    """Dicts of exact JSON types without ``null`` fields: what ``apply_chat_template``'s
    normalisation leaves as they are."""
    for message in messages:
        if type(message) is not dict or not is_exact_json(message):
            return False
        for value in message.values():
            if value is None:
                return False
    return True


#: how the ``tokenizers`` library reads ``TOKENIZERS_PARALLELISM`` as "off" (lower-cased)
_PARALLELISM_OFF = frozenset({"", "off", "false", "f", "no", "n", "0"})


def parallelism_off() -> bool:
    """Whether ``TOKENIZERS_PARALLELISM`` turns the Rust library's thread pool off (read, as the
    library reads it, at each call)."""
    value = os.environ.get("TOKENIZERS_PARALLELISM")
    return value is not None and value.lower() in _PARALLELISM_OFF


def _private_backend(tokenizer: Any) -> Any:
    """A private copy of a fast tokenizer's Rust backend, set up as ``tokenizer.encode(text,
    add_special_tokens=False)`` sets up the shared one, or ``None`` for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    private = Tokenizer.from_str(backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return private


def _render_jinja_template() -> Callable[..., tuple[str, Any]]:
    """transformers' ``render_jinja_template``, typed as it behaves."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # annotated ``-> str``, it returns the rendered text and the generation indices
    return render_jinja_template  # type: ignore[return-value]
