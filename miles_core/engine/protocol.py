"""The engine's HTTP request/response shapes (OpenAI chat + SGLang extensions).

Requests are validated with pydantic (unknown fields are rejected) and turned into a
:class:`~miles_core.engine.base.GenerationRequest`; completions are rendered the way SGLang
renders them for miles: ``choices[0].meta_info`` always carries ``output_token_logprobs`` as
``[logprob, token_id]`` pairs, ``completion_tokens`` and ``weight_version``.

Fields that OpenAI or SGLang define but the embedded engine does not implement are accepted only
with their neutral value (``n=1``, ``frequency_penalty=0``...); anything else is a 400 naming
the field, never a silently ignored setting.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from miles_core.engine.base import Completion, GenerationRequest, InvalidRequestError, SamplingParams

#: ``max_tokens`` of a request that sets neither it nor ``max_completion_tokens`` (the HTTP
#: server's default unless it is given another; the in-process session upstream's too)
DEFAULT_MAX_TOKENS = 256
#: accepted only with these values (the engine does not implement anything else)
NEUTRAL_VALUES: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "top_logprobs": 0,
    "return_routed_experts": False,
    "return_indexer_topk": False,
}


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    return_meta_info: bool = True
    return_prompt_token_ids: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    rid: str | None = None
    user: str | None = None
    routed_experts_start_len: int | None = None
    lora_path: None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    top_logprobs: int | None = None
    return_routed_experts: bool = False
    return_indexer_topk: bool = False

    @field_validator(*NEUTRAL_VALUES)
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        if value is not None and value != NEUTRAL_VALUES[info.field_name]:
            raise ValueError(f"only {NEUTRAL_VALUES[info.field_name]!r} is supported by the embedded engine")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by the embedded engine")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise ValueError("only {'type': 'text'} is supported by the embedded engine")
        return value

    @field_validator("messages")
    @classmethod
    def _roles(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, message in enumerate(value or ()):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"message {i} has no string 'role'")
        return value

    @field_validator("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        # strict mode would reject an integer like 1 for a float field
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's ``/update_weights_from_disk`` body (the fields the embedded engine honours)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_path: str = Field(min_length=1)
    weight_version: str | None = None
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: bool = True
    abort_all_requests: Literal[False] = False


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; raise :class:`InvalidRequestError` naming the first bad field."""
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise InvalidRequestError("body", f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    return validate(model, data)


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """Validate a parsed body (a caller in this process); errors as :func:`parse` raises them."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "body"
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        raise InvalidRequestError(field, message) from None


def to_generation_request(req: ChatCompletionRequest, tokenizer: Any, *, default_max_tokens: int, room: int) -> GenerationRequest:
    """Token ids (``input_ids`` wins over ``messages``) and sampling parameters of a request."""
    if req.input_ids is not None:
        prompt = req.input_ids
    elif req.messages:
        prompt = render_messages(req, tokenizer)
    else:
        raise InvalidRequestError("messages", "give 'messages' or 'input_ids'")
    sampling = sampling_params(req, prompt_tokens=len(prompt), default_max_tokens=default_max_tokens, room=room)
    return GenerationRequest(input_ids=prompt, sampling=sampling, request_id=req.rid)


def sampling_params(req: ChatCompletionRequest, *, prompt_tokens: int, default_max_tokens: int, room: int) -> SamplingParams:
    """How a request of ``prompt_tokens`` tokens is sampled (``room``: the engine's max_model_len)."""
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, room - prompt_tokens))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def render_messages(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    from miles_core.chat_template import ChatTemplate

    renderer = ChatTemplate.of(tokenizer)
    try:
        text = renderer.render(
            req.messages or [],
            tools=req.tools,
            template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=not req.continue_final_message,
            continue_final_message=req.continue_final_message,
        )
    except Exception as exc:  # jinja errors, bad message shapes: the client's input
        raise InvalidRequestError("messages", f"cannot be rendered by the chat template: {exc}") from None
    return list(renderer.encode(text))


# -- responses -------------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split Qwen/Hermes-style ``<tool_call>{json}</tool_call>`` blocks out of ``text``.

    Returns ``(content, tool_calls)``; if any block is not a JSON object with a string ``name``,
    nothing is parsed and the text stays content.
    """
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    if not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip(), calls


def completion_text(completion: Completion, tokenizer: Any, *, trim_stop: bool) -> str:
    """The completion's text, cut before its stop token or stop string unless ``trim_stop`` is off."""
    ids = list(completion.token_ids)
    if trim_stop and completion.finish_reason == "stop" and isinstance(completion.matched_stop, int):
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if trim_stop and isinstance(completion.matched_stop, str):
        text = text[: text.find(completion.matched_stop)]
    return text


def assistant_message(req: ChatCompletionRequest, completion: Completion, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """The reply's assistant message (text, tool calls parsed when the request offers tools) and
    its finish reason."""
    text = completion_text(completion, tokenizer, trim_stop=not req.no_stop_trim)
    content, tool_calls = text, list[dict[str, Any]]()
    if req.tools and req.tool_choice != "none":
        content, tool_calls = parse_tool_calls(text)
    if req.skip_special_tokens:
        for special in tokenizer.all_special_tokens:
            content = content.replace(special, "")
    finish_reason = "tool_calls" if tool_calls and completion.finish_reason == "stop" else completion.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": tool_calls or None}, finish_reason


def chat_response(
    req: ChatCompletionRequest,
    completion: Completion,
    tokenizer: Any,
    *,
    model: str,
    assistant: tuple[dict[str, Any], str] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The reply to ``req``; ``assistant``: its :func:`assistant_message`, when already made."""
    message, finish_reason = assistant or assistant_message(req, completion, tokenizer)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": _openai_logprobs(completion, tokenizer) if req.logprobs else None,
        "finish_reason": finish_reason,
        "matched_stop": completion.matched_stop,
        "meta_info": meta_info(completion),
    }
    if req.return_prompt_token_ids:
        choice["prompt_token_ids"] = list(completion.prompt_ids)
    return {
        "id": f"chatcmpl-{completion.request_id}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": req.model or model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(completion.prompt_ids),
            "completion_tokens": completion.completion_tokens,
            "total_tokens": len(completion.prompt_ids) + completion.completion_tokens,
        },
        "weight_version": completion.weight_version,
    }


def meta_info(completion: Completion) -> dict[str, Any]:
    return {
        "id": completion.request_id,
        "finish_reason": {"type": completion.finish_reason, "matched": completion.matched_stop},
        "prompt_tokens": len(completion.prompt_ids),
        "completion_tokens": completion.completion_tokens,
        "cached_tokens": 0,
        "output_token_logprobs": [[lp, tok] for lp, tok in zip(completion.logprobs, completion.token_ids)],
        "weight_version": completion.weight_version,
        "seed": completion.seed,
    }


def stream_chunk(response: dict[str, Any]) -> dict[str, Any]:
    """The response as one ``chat.completion.chunk`` (the whole completion in one delta)."""
    choice = dict(response["choices"][0])
    message = choice.pop("message")
    choice["delta"] = {k: v for k, v in message.items() if v is not None}
    return {**response, "object": "chat.completion.chunk", "choices": [choice]}


def _openai_logprobs(completion: Completion, tokenizer: Any) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(completion.token_ids, completion.logprobs):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def error_body(kind: str, message: str, field: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if field is not None:
        error["param"] = field
    return {"error": error}
