"""Prompt ids from the template diff equal the canonical rendering of the whole conversation,
per template family (differential), and a template that breaks its family's rules is refused
at load time."""

from pathlib import Path

import pytest

from miles_core.assets.tiny_tokenizer import build_tokenizer
from miles_core.caching import BoundedCache
from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.session.errors import InvalidRequest
from miles_core.session.families import detect_family
from miles_core.session.tokenizer import DUMMY_HISTORY, ChatTokenizer

register_cpu_ci(est_time=7, suite="stage-a-cpu")

GLM_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{% elif m.role == 'tool' %}<|observation|>\n{{ m.content }}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen3-style: reasoning is rendered only for assistant turns after the last user message.
REFLOWING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_dir(tmp_path: Path, template: str, specials: list[str] = ()) -> Path:
    from tokenizers import AddedToken

    tok = build_tokenizer()
    if specials:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.chat_template = template
    tok.save_pretrained(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> ChatTokenizer:
    return ChatTokenizer.from_dir(_tokenizer_dir(tmp_path_factory.mktemp("glm"), GLM_TEMPLATE, GLM_SPECIALS))


def _generated(tok: ChatTokenizer, history, message, stop: str | None) -> tuple[int, ...]:
    """What a model that follows the template exactly generates for ``message``."""
    before = tok._render(history, None, {}, generation_prompt=True)
    after = tok._render([*history, message], None, {}, generation_prompt=False)
    assert after.startswith(before)
    text = after[len(before) :]
    close = tok.family.assistant_close
    text = text[: len(text) - len(close)] if close else text
    return tok.encode(text) + (tok.encode(stop) if stop else ())


def _tito(tok: ChatTokenizer, turns) -> tuple[int, ...]:
    """Token ids built turn by turn, the way the session server builds them."""
    history, ids, completion = [], (), ()
    for appended, assistant, stop in turns:
        if not history:
            ids = tok.render_prompt(appended, tools=None, template_kwargs={})
        else:
            tail = tok.render_append(completion, appended, tools=None, template_kwargs={})
            ids = ids[: len(ids) - tail.trim] + tail.ids
        history += appended
        completion = _generated(tok, history, assistant, stop)
        ids += completion
        history.append(assistant)
    return ids


def _canonical(tok: ChatTokenizer, turns, final) -> tuple[int, ...]:
    messages = [m for appended, assistant, _ in turns for m in (*appended, assistant)]
    return tok.render_prompt([*messages, *final], tools=None, template_kwargs={})


CALL = {"type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}


def test_chatml_incremental_equals_canonical(chat_tokenizer) -> None:
    tok = chat_tokenizer
    turns = [
        ([{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}], {"role": "assistant", "content": "a1"}, "<|im_end|>"),
        ([{"role": "user", "content": "use a tool"}], {"role": "assistant", "content": "", "tool_calls": [CALL]}, "<|im_end|>"),
        ([{"role": "tool", "content": "result"}], {"role": "assistant", "content": "a3"}, "<|im_end|>"),
        ([{"role": "system", "content": "mid"}, {"role": "user", "content": "q4"}, {"role": "assistant", "content": "shot"}], {"role": "assistant", "content": "a4"}, "<|im_end|>"),
        # stopped by a stop string, not the stop token: the template's close becomes observation
        ([{"role": "user", "content": "q5"}], {"role": "assistant", "content": "a5"}, None),
    ]
    final = [{"role": "user", "content": "bye"}]
    ids = _tito(tok, [*turns, (final, {"role": "assistant", "content": ""}, None)])
    assert ids[: len(_canonical(tok, turns, final))] == _canonical(tok, turns, final)


@pytest.mark.parametrize("stop", ["<|user|>", "<|observation|>"])
def test_glm_incremental_equals_canonical(glm, stop) -> None:
    """GLM ends a turn by generating the next role's opener; whichever it generated, the
    incremental ids are the template's."""
    assert glm.family.name == "glm4"
    turns = [
        ([{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}], {"role": "assistant", "content": "a1"}, stop),
        ([{"role": "tool", "content": "r"}], {"role": "assistant", "content": "a2"}, stop),
        ([{"role": "user", "content": "q3"}], {"role": "assistant", "content": "a3"}, stop),
    ]
    final = [{"role": "user", "content": "bye"}]
    ids = _tito(glm, [*turns, (final, {"role": "assistant", "content": ""}, None)])
    expected = _canonical(glm, turns, final)
    assert ids[: len(expected)] == expected


def test_without_the_boundary_rule_chatml_drifts(chat_tokenizer) -> None:
    """Negative control: encoding the diff alone (no family rule) loses the newline after
    <|im_end|>, so the ids differ from the template's."""
    tok = chat_tokenizer
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    prompt = tok.render_prompt(history[:1], tools=None, template_kwargs={})
    completion = _generated(tok, history[:1], history[1], "<|im_end|>")
    appended = [{"role": "user", "content": "q2"}]
    with_rule = prompt + completion + tok.render_append(completion, appended, tools=None, template_kwargs={}).ids
    before = tok._render(DUMMY_HISTORY, None, {}, generation_prompt=False)
    after = tok._render((*DUMMY_HISTORY, *appended), None, {}, generation_prompt=True)
    without_rule = prompt + completion + tok.encode(after[len(before) :])
    canonical = tok.render_prompt([*history, *appended], tools=None, template_kwargs={})
    assert with_rule == canonical
    assert without_rule != canonical


def test_non_append_only_template_is_refused(tmp_path) -> None:
    directory = _tokenizer_dir(tmp_path, REFLOWING_TEMPLATE)
    with pytest.raises(ConfigError, match="not append-only"):
        ChatTokenizer.from_dir(directory)


def test_family_rules_are_checked_against_the_template(tmp_path, tokenizer_dir) -> None:
    unclosed = REFLOWING_TEMPLATE.replace("<think>\n\n</think>\n\n", "").replace("<|im_end|>\n{% endfor %}", "<|im_end|>{% endfor %}")
    with pytest.raises(ConfigError, match="does not follow template family 'chatml'"):
        ChatTokenizer.from_dir(_tokenizer_dir(tmp_path / "a", unclosed))
    with pytest.raises(ConfigError, match="needs '<\\|user\\|>' to be one token"):
        ChatTokenizer.from_dir(tokenizer_dir, family="glm4")
    with pytest.raises(ConfigError, match="unknown template family 'nope'"):
        ChatTokenizer.from_dir(tokenizer_dir, family="nope")
    with pytest.raises(ConfigError, match="matches none"):
        ChatTokenizer.from_dir(_tokenizer_dir(tmp_path / "b", "{{ messages[0].content }}"))
    with pytest.raises(ConfigError, match="does not exist"):
        ChatTokenizer.from_dir(tmp_path / "missing")
    assert detect_family("<|im_start|><|im_end|>").name == "chatml"


def test_chat_template_file_replaces_the_tokenizers(tmp_path, tokenizer_dir) -> None:
    template = tmp_path / "fixed.jinja"
    template.write_text(GLM_TEMPLATE)
    with pytest.raises(ConfigError, match="needs '<\\|user\\|>' to be one token"):
        ChatTokenizer.from_dir(tokenizer_dir, chat_template=template)
    with pytest.raises(ConfigError, match="chat template file"):
        ChatTokenizer.from_dir(tokenizer_dir, chat_template=tmp_path / "absent.jinja")


def test_request_errors_are_400(chat_tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="chat_template_kwargs may not set tokenize"):
        chat_tokenizer.render_prompt([{"role": "user", "content": "x"}], tools=None, template_kwargs={"tokenize": True})



ENCODE_PIECES = ["<|im_start|>", "<|im_end|>", "<|user|>", "[gMASK]", "\n", " ", "  x", "é", "日本", "🙂", "a", "tool"]


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_encode_equals_the_hugging_face_tokenizer(tmp_path, split_special_tokens) -> None:
    """The direct backend call encodes exactly as ``tokenizer.encode(add_special_tokens=False)``,
    special tokens split or not as the tokenizer is configured, and a caller that sets up the
    shared tokenizer for truncation afterwards does not change it."""
    import random

    from transformers import AutoTokenizer

    from miles_core.chat_template import _private_backend

    directory = _tokenizer_dir(tmp_path, GLM_TEMPLATE, GLM_SPECIALS)
    hf = AutoTokenizer.from_pretrained(str(directory), split_special_tokens=split_special_tokens)
    backend = _private_backend(hf)
    rng = random.Random(0)
    texts = ["".join(rng.choices(ENCODE_PIECES, k=rng.randint(0, 12))) for _ in range(300)]
    for text in texts:
        assert backend.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False), text
    assert (len(backend.encode("[gMASK]", add_special_tokens=False).ids) == 1) is not split_special_tokens
    text = "a" * 10
    full = hf.encode(text, add_special_tokens=False)
    hf(text, truncation=True, max_length=2)  # leaves the tokenizer's own backend truncating
    assert len(hf.backend_tokenizer.encode(text, add_special_tokens=False).ids) == 2
    assert backend.encode(text, add_special_tokens=False).ids == full
    if not split_special_tokens:  # a family's stop token must be one token: only this setting loads
        tok = ChatTokenizer(hf, detect_family(GLM_TEMPLATE), source=str(directory))
        assert all(list(tok.encode(text)) == hf.encode(text, add_special_tokens=False) for text in texts)


def test_first_turn_prompts_are_cached_by_exact_content(tokenizer_dir, monkeypatch) -> None:
    """A cached prompt equals a fresh rendering; tools whose keys come in another order (which
    ``tojson`` renders differently) and 1 vs 1.0 are different prompts, never a cache hit."""
    tok, fresh = ChatTokenizer.from_dir(tokenizer_dir), ChatTokenizer.from_dir(tokenizer_dir)
    renders = []
    render = tok._template.render
    monkeypatch.setattr(tok._template, "render", lambda *a, **k: renders.append(a) or render(*a, **k))
    messages = ({"role": "user", "content": "2+2="},)
    tool = {"type": "function", "function": {"name": "add", "parameters": {"a": 1}}}
    reordered = {"function": {"parameters": {"a": 1}, "name": "add"}, "type": "function"}
    as_float = {"type": "function", "function": {"name": "add", "parameters": {"a": 1.0}}}
    for tools in (None, [tool], [reordered], [as_float]) * 2:
        got = tok.render_prompt(messages, tools=tools, template_kwargs={})
        assert got == fresh.render_prompt(messages, tools=tools, template_kwargs={})
    assert len(renders) == 4  # the second round was served from the cache
    assert len({fresh.render_prompt(messages, tools=t, template_kwargs={}) for t in ([tool], [reordered], [as_float])}) == 3


def test_prompt_cache_is_bounded_and_off_for_clock_reading_templates(tmp_path) -> None:
    cache = BoundedCache(5, size=len)
    for key in "abc":
        cache.get_or_compute(key, lambda: (1, 2))
    assert list(cache._entries) == ["b", "c"] and cache._total == 4
    assert cache.get_or_compute("huge", lambda: tuple(range(9))) == tuple(range(9)) and cache._total <= 5
    template = "{% set year = strftime_now('%Y') %}" + GLM_TEMPLATE
    clock = ChatTokenizer.from_dir(_tokenizer_dir(tmp_path, template, GLM_SPECIALS))
    assert clock._template._prompts is None
