"""Pure request normalizer: an OpenAI chat body (bytes) -> a typed :class:`ChatRequest`.

It validates the body against a schema (pydantic, strict: no coercion), rejects what the session
server owns (``input_ids``) or cannot record (``n`` > 1), and splits the body into what the
chat template needs (messages, tools, template kwargs), what the transport needs (``stream``)
and what is forwarded upstream. :func:`upstream_body` then adds the server-owned prompt ids and
the flags the recording depends on, which a client cannot override.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from miles_core import strict_json
from miles_core.caching import BoundedCache, exact_json_key
from miles_core.frozen import quick_init
from miles_core.session.errors import InvalidRequest
from miles_core.session.messages import Message, MessageKey, canonical_message, message_key
from miles_core.session.trajectory import SERVER_METADATA_KEYS, SampleOptions

#: set on every upstream request: the recording needs the sampled ids and their log-probs
FORCED_UPSTREAM_FLAGS: dict[str, Any] = {"logprobs": True, "return_meta_info": True, "no_stop_trim": False}
#: client fields consumed by the session server and not forwarded upstream
TRANSPORT_FIELDS = ("stream", "stream_options")
#: conversations of at most this many messages are remembered once validated (see
#: :data:`_CONVERSATIONS`): prompts that open episodes, not the long histories :class:`History` covers
FIRST_TURN_CACHE_MESSAGES = 8


ModelT = TypeVar("ModelT", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _StreamOptions(_Strict):
    include_usage: bool = False


class _ChatBody(_Strict):
    messages: list[_Message] = Field(min_length=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    n: Literal[1] | None = None
    input_ids: None = None  # owned by the session server; any value is rejected


class _ChatTail(_ChatBody):
    """:class:`_ChatBody` for a request whose leading messages repeat a :class:`History`:
    ``messages`` holds only the new ones (none when the history is resent unchanged)."""

    messages: list[_Message] = Field(default_factory=list)


class _SamplesBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_seq_len: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None


@quick_init
@dataclass(frozen=True)
class ChatRequest:
    """A validated chat request, split by who consumes each part."""

    messages: tuple[Message, ...]  # canonical, for the chat template
    keys: tuple[MessageKey, ...]  # one per message, for history matching
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    stream: bool
    include_usage: bool
    forward: dict[str, Any]  # the client body minus transport fields, as sent
    #: leading messages that repeated the session's :class:`History` (not validated again)
    repeated: int = field(default=0, compare=False)
    #: the request of the same :func:`normalize_chat_objects` call whose body this one's repeats
    #: but for its ``seed`` (the very same objects under every other field), or ``None``
    variant_of: ChatRequest | None = field(default=None, compare=False, repr=False)

    def variant(self, forward: dict[str, Any]) -> ChatRequest:
        """This request with ``forward`` instead, naming this one as its :attr:`variant_of` (for a
        body that repeats this one's but for its seed: everything else is this one's)."""
        copy = object.__new__(ChatRequest)  # what __init__ would set, without its per-field work
        fields = copy.__dict__
        fields.update(self.__dict__)
        fields["forward"] = forward
        fields["variant_of"] = self
        return copy


@quick_init
@dataclass(frozen=True)
class History:
    """The conversation a session last saw, validated: the messages of its last committed request
    and the assistant message generated for it, canonical, with their match keys.

    Agents resend the whole conversation each turn. A request whose leading messages repeat these
    has only the messages after them validated and canonicalised (:func:`normalize_chat_object`),
    so a turn costs what its new messages cost, not what the history does. A leading message
    repeats an entry when it equals it, or equals it once its ``null`` fields are dropped (how
    SDKs echo a reply); entries hold only strings, lists, objects and nulls (:func:`_plain`), so
    equality there means the same JSON -- no ``1`` matching ``1.0`` or ``true`` -- and the
    message is valid, canonicalises to the entry and has its key.
    """

    messages: tuple[Message, ...]
    keys: tuple[MessageKey, ...]

    @classmethod
    def after(
        cls, messages: tuple[Message, ...], keys: tuple[MessageKey, ...], assistant: Message, *, repeated: int
    ) -> History:
        """The history once ``assistant`` answered a request of ``messages`` (its first
        ``repeated`` from the previous history); entries end at the first one that cannot be
        matched by equality."""
        try:
            _MESSAGE.validate_python(assistant)  # engine output, held to the rules client messages are
            reply: tuple[Message, ...] = (canonical_message(assistant),)
        except (ValidationError, RecursionError):
            reply = ()
        messages = (*messages, *reply)
        keys = (*keys, *map(message_key, reply))
        end = next((i for i in range(repeated, len(messages)) if not _plain(messages[i])), len(messages))
        return cls(messages[:end], keys[:end])

    def repeated(self, messages: list[Any]) -> int:
        """How many leading ``messages`` repeat entries of this history."""
        known = self.messages
        count = min(len(messages), len(known))
        for i in range(count):
            message, entry = messages[i], known[i]
            if message != entry and not (
                type(message) is dict and {k: v for k, v in message.items() if v is not None} == entry
            ):
                return i
        return count


def _str_keys(raw: dict[Any, Any]) -> bool:
    for key in raw:  # noqa: SIM110  (a loop: all() over a generator costs twice as much here)
        if type(key) is not str:
            return False
    return True


def _plain(value: Any) -> bool:
    """Whether ``value`` is made only of strings, lists, dicts and ``None`` (no numbers, no booleans)."""
    if value is None or type(value) is str:
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list:
        return all(map(_plain, value))
    return False


_MESSAGE: TypeAdapter[_Message] = TypeAdapter(_Message)
_MESSAGES: TypeAdapter[list[_Message]] = TypeAdapter(list[_Message])
#: the fields of a chat body the schema declares, messages aside: a body without any of them
#: validates as its messages do, with every other field at its default (:data:`_BARE_TAIL`)
_BODY_FIELDS = frozenset(_ChatBody.model_fields) - {"messages"}
_BARE_TAIL = _ChatTail()


#: validated conversations by their exact JSON (GRPO opens many sessions on the same prompt):
#: canonical messages and keys, bounded by the JSON's total size
_CONVERSATIONS: BoundedCache[tuple[bytes, tuple[Message, ...], tuple[MessageKey, ...]]] = BoundedCache(
    1 << 24, size=lambda entry: len(entry[0])
)


def parse_json_object(body: bytes, *, what: str = "request body") -> dict[str, Any]:
    """Parse ``body`` as a JSON object (strictly: :mod:`miles_core.strict_json`); empty is ``{}``."""
    if not body.strip():
        return {}
    try:
        data = strict_json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {_json_type(data)}")
    return data


def normalize_chat_request(body: bytes, history: History | None = None) -> ChatRequest:
    return normalize_chat_object(parse_json_object(body), history)


def normalize_chat_object(raw: dict[str, Any], history: History | None = None) -> ChatRequest:
    """A chat body (parsed JSON) as a :class:`ChatRequest`; with the session's ``history``, only
    the messages after those that repeat it are validated and canonicalised (:class:`History`).
    The result, and the error for a bad request, are the same with or without ``history``."""
    messages: Any = raw.get("messages")  # JSON as received: validated below
    repeated = history.repeated(messages) if history is not None and type(messages) is list else 0
    known: tuple[tuple[Message, ...], tuple[MessageKey, ...]] | None = None
    if repeated:
        assert history is not None
        known = history.messages[:repeated], history.keys[:repeated]
    elif type(messages) is list and messages:
        seen = _CONVERSATIONS.get(exact_json_key(messages))
        if seen is not None:
            repeated, known = len(messages), seen[1:]
    parsed: _ChatBody | None = None
    if repeated:
        try:
            if _BODY_FIELDS.isdisjoint(raw) and _str_keys(raw):  # only messages to validate (the rest is extra)
                if len(messages) > repeated:
                    _MESSAGES.validate_python(messages[repeated:])
                parsed = _BARE_TAIL
            else:
                parsed = _ChatTail.model_validate({**raw, "messages": messages[repeated:]})
        except (ValidationError, RecursionError):
            repeated, known = 0, None  # validated whole below: the error a request gets without a history
    if parsed is None:
        parsed = _validate(_ChatBody, raw)
    tail = messages[repeated:]
    try:
        keys = tuple(map(message_key, tail))
    except RecursionError:
        raise InvalidRequest("messages: tool-call arguments are nested too deeply") from None
    canonical = tuple(map(canonical_message, tail))
    if known is not None:
        keys, canonical = known[1] + keys, known[0] + canonical
    elif len(canonical) <= FIRST_TURN_CACHE_MESSAGES:
        key = exact_json_key(messages)
        if key is not None:
            _CONVERSATIONS.put(key, (key, canonical, keys))
    return ChatRequest(
        messages=canonical,
        keys=keys,
        tools=raw.get("tools"),
        template_kwargs=dict(raw.get("chat_template_kwargs") or {}),
        stream=parsed.stream,
        include_usage=parsed.stream_options is not None and parsed.stream_options.include_usage,
        forward={k: v for k, v in raw.items() if k not in TRANSPORT_FIELDS},
        repeated=repeated,
    )


#: a turn of :func:`normalize_chat_batch` sent as its own request says (its forward as it is)
OWN = object()


def normalize_chat_objects(
    raws: Sequence[dict[str, Any]], histories: Sequence[History | None], seeds: Sequence[int | None] | None = None
) -> list[ChatRequest | InvalidRequest]:
    """:func:`normalize_chat_object` of each body with its session's history, each result or
    error in its place; ``seeds[i]``, when given, is body ``i``'s ``seed`` (set in the body's
    own place for it, or added last, as ``{**body, "seed": seeds[i]}``): one body object sent
    with a seed per session.

    A body that repeats the one before it but for its ``seed`` -- the very same body object, or
    the very same objects under every other field, and the same history: the sessions of a GRPO
    group, sent one after another -- reuses that one's validation (nothing here reads the seed:
    it is forwarded as sent, for the engine to check) and names its request as
    :attr:`ChatRequest.variant_of`."""
    requests, sent = normalize_chat_batch(raws, histories, seeds)
    out: list[ChatRequest | InvalidRequest] = []
    for index, (request, seed) in enumerate(zip(requests, sent)):
        if index and request is requests[index - 1]:  # the request of the body before, shared
            assert isinstance(request, ChatRequest)
            forward = request.forward.copy() if seed is OWN else forward_with(request.forward, seed)
            request = (request.variant_of or request).variant(forward)
        out.append(request)
    return out


def normalize_chat_batch(
    raws: Sequence[dict[str, Any]], histories: Sequence[History | None], seeds: Sequence[int | None] | None = None
) -> tuple[list[ChatRequest | InvalidRequest], list[Any]]:
    """:func:`normalize_chat_objects` for a caller that sends each turn as ``(request, seed)``
    (:func:`forward_with`): a body that is the very object of the one before it (and has the
    same history) is answered with the request that one was answered with, itself -- no request
    made, nor a forward copied, per turn of a group that shares one body -- and with its
    ``seeds`` entry in ``sent``; every other ``sent`` entry is :data:`OWN`."""
    if seeds is not None and len(seeds) != len(raws):
        raise ValueError(f"{len(seeds)} seeds for {len(raws)} bodies")
    out: list[ChatRequest | InvalidRequest] = []
    sent: list[Any] = []
    first: ChatRequest | None = None  # the request the last body validated was validated into
    previous: dict[str, Any] = {}  # that body (its seed set)
    previous_history: History | None = None  # and its history
    previous_raw: Any = None  # the body before, as it was passed
    last: ChatRequest | None = None  # and the request it was answered with
    transport = False  # whether the previous body has transport fields (its variants have the same)
    for index, (raw, history) in enumerate(zip(raws, histories, strict=True)):
        if last is not None and raw is previous_raw and history is previous_history:
            out.append(last)
            sent.append(OWN if seeds is None else seeds[index])
            continue
        previous_raw = raw
        body = raw if seeds is None or type(raw) is not dict else {**raw, "seed": seeds[index]}
        sent.append(OWN)
        if first is not None and history is previous_history and _varies_only_in_seed(body, previous):
            forward = body.copy()
            if transport:
                for name in TRANSPORT_FIELDS:
                    forward.pop(name, None)
            last = first.variant(forward)
            out.append(last)
            continue
        try:
            request = normalize_chat_object(body, history)
        except InvalidRequest as exc:
            out.append(exc)
            first = last = None
            continue
        out.append(request)
        first = last = request
        previous, previous_history = body, history
        transport = any(name in body for name in TRANSPORT_FIELDS)
    return out, sent


def forward_with(forward: dict[str, Any], seed: Any) -> dict[str, Any]:
    """What a request forwarding ``forward`` forwards when sent with ``seed`` (:data:`OWN`: ``forward``
    as it is)."""
    return forward if seed is OWN else {**forward, "seed": seed}


def _varies_only_in_seed(raw: Any, previous: dict[str, Any]) -> bool:
    """Whether ``raw`` holds the very objects ``previous`` holds under every field but ``seed``."""
    if type(raw) is not dict or len(raw) != len(previous) or ("seed" in raw) != ("seed" in previous):
        return False
    get = previous.get
    for name, value in raw.items():  # noqa: SIM110  (a loop: all() over a generator costs twice as much here)
        if value is not get(name, _ABSENT) and name != "seed":
            return False
    return True


_ABSENT = object()


def normalize_samples_request(body: bytes) -> SampleOptions:
    """``{"max_seq_len"?: int >= 1, "metadata"?: object}``; metadata may not use server-owned keys."""
    raw = parse_json_object(body)
    parsed = _validate(_SamplesBody, raw)
    metadata = parsed.metadata or {}
    clash = SERVER_METADATA_KEYS.intersection(metadata)
    if clash:
        raise InvalidRequest(f"metadata.{sorted(clash)[0]} is set by the session server and must not be sent")
    return SampleOptions(max_seq_len=parsed.max_seq_len, metadata=metadata)


def upstream_body(request: ChatRequest, prompt_ids: Sequence[int], seed: Any = OWN) -> dict[str, Any]:
    """The body sent upstream: the client's fields (``seed``: sent with that seed,
    :func:`forward_with`), the server-owned prompt ids, forced flags."""
    return {**forward_with(request.forward, seed), "input_ids": list(prompt_ids), **FORCED_UPSTREAM_FLAGS}


def _validate(model: type[ModelT], raw: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None


def describe_validation_error(exc: ValidationError) -> str:
    """``messages[2].role: Input should be ...`` for the most specific error, with a count of
    the rest (for a union, the branch that got deepest into the input explains it best)."""
    errors = exc.errors(include_url=False)
    first = max(errors, key=lambda error: len(error["loc"]))
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    # Union errors name the branch tried ("content.str"); the field path is what a user needs.
    where = where.replace(".str", "").replace(".list[_TextPart]", "").replace(".dict[str,any]", "")
    message = first["msg"]
    if first["type"] == "none_required":
        message = "is set by the session server and must not be sent"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"{where or 'body'}: {message}{more}"


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
