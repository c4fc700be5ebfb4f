"""The one prompt renderer (miles_core.chat_template): its direct render is apply_chat_template's
render exactly, it turns itself off when they differ, and every path renders prompts with it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-cpu")

pytest.importorskip("transformers")

from miles_core.chat_template import ChatTemplate  # noqa: E402

_text = st.text(alphabet="ab <>|\n{}\"'", max_size=6)
_call = st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({
        "name": st.sampled_from(["f", "lookup"]),
        "arguments": st.one_of(_text, st.dictionaries(st.sampled_from("xy"), st.one_of(st.integers(-2, 2), _text), max_size=2)),
    }),
})
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": _text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _text}, optional={"tool_calls": st.lists(_call, min_size=1, max_size=2)}),
)
_tools = st.one_of(st.none(), st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}), min_size=1, max_size=2))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@settings(max_examples=80, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=5), tools=_tools, generation_prompt=st.booleans())
def test_direct_render_is_apply_chat_template(hf_tokenizer, messages, tools, generation_prompt) -> None:
    renderer = ChatTemplate.of(hf_tokenizer)
    assert renderer._direct  # the probes agreed: the shortcut is on for this template
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    assert renderer.render(messages, tools=tools, add_generation_prompt=generation_prompt) == expected
    if generation_prompt:
        ids = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(renderer.prompt_ids(messages, tools=tools)) == list(ids)


def test_messages_with_null_fields_or_objects_go_through_apply_chat_template(hf_tokenizer, monkeypatch) -> None:
    renderer = ChatTemplate(hf_tokenizer)
    calls = []
    original = hf_tokenizer.apply_chat_template
    monkeypatch.setattr(hf_tokenizer, "apply_chat_template", lambda *a, **k: calls.append(a) or original(*a, **k))
    renderer.render([{"role": "user", "content": "x"}])
    assert calls == []
    with_null = [{"role": "assistant", "content": "x", "tool_calls": None}]
    assert renderer.render(with_null) == original(with_null, tokenize=False, add_generation_prompt=True)
    assert len(calls) == 1


def test_the_shortcut_turns_itself_off_when_apply_chat_template_renders_otherwise(tokenizer_dir) -> None:
    """Negative control: a tokenizer whose apply_chat_template does more than the template (as a
    later transformers might) is rendered through apply_chat_template, so nothing drifts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    original = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: original(*a, **k).replace("user", "USER")
    renderer = ChatTemplate(tok)
    assert not renderer._direct
    assert "USER" in renderer.render([{"role": "user", "content": "x"}])


def test_every_path_renders_the_same_prompt(hf_tokenizer) -> None:
    """The direct rollout, the engine's HTTP front (messages without input_ids) and the session
    server's first turn give one conversation the same ids."""
    from miles_core.engine.protocol import ChatCompletionRequest, render_messages
    from miles_core.rl.rollout.direct import render_prompt
    from miles_core.rl.tasks import Prompt
    from miles_core.session.tokenizer import ChatTokenizer

    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="})
    direct = render_prompt(hf_tokenizer, Prompt(id="p", text="2+2=", answer="4", messages=messages))
    engine = render_messages(ChatCompletionRequest(messages=[dict(m) for m in messages]), hf_tokenizer)
    session = ChatTokenizer(hf_tokenizer, __import__("miles_core.session.families", fromlist=["CHATML"]).CHATML,
                            source="t").render_prompt(messages, tools=None, template_kwargs={})
    reference = hf_tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert direct == engine == list(session) == list(reference)


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(["a", " ", "\n", "\u00e9", "\U0001f600", "<|im_start|>", "<|im_end|>", "<think>", "<|im_", "|>"]), max_size=30).map("".join))
def test_encoding_without_the_thread_pool_gives_the_tokenizers_ids(hf_tokenizer, text) -> None:
    """With the tokenizers library's parallelism off (how ``miles session serve`` runs), a text is
    encoded as a batch of one without offsets: the very ids ``tokenizer(text)`` gives, special
    tokens and multi-byte characters included; with it on, the plain encode (same ids)."""
    import os

    renderer = ChatTemplate(hf_tokenizer)
    expected = tuple(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        for value in ("false", "0", "true"):
            os.environ["TOKENIZERS_PARALLELISM"] = value
            assert renderer.encode(text) == expected, value
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def test_encoding_takes_the_batch_path_only_with_parallelism_off(hf_tokenizer, monkeypatch) -> None:
    """The batch-of-one path runs only where the library's thread pool is off: started, the pool
    would make every later fork of the process (the local sandbox's) print a warning."""
    from miles_core import chat_template

    renderer = ChatTemplate(hf_tokenizer)
    calls: list[str] = []

    class Spy:
        def __init__(self, backend) -> None:
            self._backend = backend

        def encode(self, *args, **kwargs):
            calls.append("encode")
            return self._backend.encode(*args, **kwargs)

        def encode_batch_fast(self, *args, **kwargs):
            calls.append("batch")
            return self._backend.encode_batch_fast(*args, **kwargs)

    renderer._backend = Spy(renderer._backend)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    assert not chat_template.parallelism_off()
    renderer.encode("hi")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "Off")
    assert chat_template.parallelism_off()
    renderer.encode("hi")
    assert calls == ["encode", "batch"]
