"""Conformance suite for session versions (``miles_session_versions`` contributions).

Every version's stores must satisfy these invariants; the built-in versions run them in
``verify()`` (at activation and in ``miles doctor``) and the test suite runs them one by one::

    from miles_core.testing.session import CHECKS, run_check

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_my_version(check):
        run_check(MyVersion(), check)

The checks drive a store directly through ``plan`` / ``commit`` / ``describe`` / ``samples`` with
a small pure-Python ChatML tokenizer (:class:`ConformanceTokenizer`), so they need no model files
and no network. They hold for any topology policy: where versions may legitimately differ (a deep
rollback rejected by v1, branched by v2), a check accepts either a 4xx rejection that changes
nothing or an accepted turn that is fully recorded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from miles_core.session.base import SessionVersion, TrajectoryStore
from miles_core.session.completion import Completion
from miles_core.session.errors import Conflict, SessionError
from miles_core.session.families import CHATML
from miles_core.session.messages import Message
from miles_core.session.normalize import ChatRequest, normalize_chat_request
from miles_core.session.tokenizer import Appended
from miles_core.session.tokens import TokenInvariantError, check_extends
from miles_core.session.trajectory import Plan, SampleOptions, TurnRecord
from miles_core.strict_json import dumps


class ConformanceError(AssertionError):
    """A session version broke an invariant; the message names the check."""


class ConformanceTokenizer:
    """ChatML over UTF-8 bytes: ids 0-255 are bytes, 256/257 are ``<|im_start|>``/``<|im_end|>``."""

    family = CHATML
    SPECIAL: ClassVar[dict[str, int]] = {"<|im_start|>": 256, "<|im_end|>": 257}
    STOP_ID = 257
    vocab_size = 258

    def encode(self, text: str) -> tuple[int, ...]:
        ids: list[int] = []
        for part in text.replace("<|im_end|>", "\0<|im_end|>\0").replace("<|im_start|>", "\0<|im_start|>\0").split("\0"):
            ids.extend([self.SPECIAL[part]] if part in self.SPECIAL else part.encode())
        return tuple(ids)

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}{_calls_text(m)}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if generation_prompt else "")

    def render_prompt(self, messages: Sequence[Message], *, tools: Any, template_kwargs: Mapping[str, Any]) -> tuple[int, ...]:
        return self.encode(self.render(messages, generation_prompt=True))

    def render_append(
        self, completion_ids: Sequence[int], messages: Sequence[Message], *, tools: Any, template_kwargs: Mapping[str, Any]
    ) -> Appended:
        close = "\n" if completion_ids and completion_ids[-1] == self.STOP_ID else "<|im_end|>\n"
        return Appended(0, self.encode(close + self.render(messages, generation_prompt=True)))


def _calls_text(message: Message) -> str:
    return "".join(json.dumps(c["function"], sort_keys=True) for c in message.get("tool_calls") or ())


TOKENIZER = ConformanceTokenizer()
MAX_TURNS = 64


def request(*messages: Message, **fields: Any) -> ChatRequest:
    return normalize_chat_request(json.dumps({"messages": list(messages), **fields}).encode())


def completion(text: str, *, finish_reason: str = "stop") -> Completion:
    """A completion of ``text``; ``finish_reason="length"`` leaves out the stop token."""
    ids = TOKENIZER.encode(text) + ((TOKENIZER.STOP_ID,) if finish_reason != "length" else ())
    return Completion(
        message={"role": "assistant", "content": text},
        token_ids=ids,
        logprobs=tuple(-((i % 5) + 1) / 8 for i in range(len(ids))),
        finish_reason=finish_reason,
        weight_version="w0",
    )


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


class Driver:
    """Drives one store the way the server does: plan, (upstream), commit."""

    def __init__(self, version: SessionVersion, *, max_turns: int = MAX_TURNS) -> None:
        self.store: TrajectoryStore = version.create_store(max_turns=max_turns)

    def turn(self, chat: ChatRequest, reply: str, *, finish_reason: str = "stop") -> Message:
        plan = self.store.plan(chat, TOKENIZER)
        self.commit(plan, completion(reply, finish_reason=finish_reason))
        return assistant(reply)

    def commit(self, plan: Plan, done: Completion) -> None:
        body = {"input_ids": list(plan.prompt_ids)}
        record = TurnRecord(dumps(body), dumps({"reply": done.message}), started_at=0.0, finished_at=0.0)
        self.store.commit(plan, done, record)

    def state(self) -> str:
        """Everything observable, canonically serialized (equal strings = identical state)."""
        return json.dumps([self.store.describe(), self.store.samples(SampleOptions()).to_dict()], sort_keys=True)

    def samples(self) -> list[dict[str, Any]]:
        return self.store.samples(SampleOptions()).to_dict()["samples"]

    def accumulated(self) -> list[int]:
        return self.store.describe()["metadata"]["accumulated_token_ids"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def _rejected_without_change(driver: Driver, action: Callable[[], object], status: int | None = None) -> SessionError:
    before = driver.state()
    try:
        action()
    except SessionError as exc:
        _require(status is None or exc.status == status, f"expected HTTP {status}, got {exc.status}: {exc}")
        _require(driver.state() == before, f"a rejected request ({exc}) changed the session state")
        return exc
    raise ConformanceError("the request was accepted but must be rejected")


def _only_sample(driver: Driver) -> dict[str, Any]:
    samples = driver.samples()
    _require(len(samples) == 1, f"expected exactly one sample, got {len(samples)}")
    return samples[0]


def _check_sample_shape(sample: Mapping[str, Any]) -> None:
    n = sample["response_length"]
    _require(len(sample["tokens"]) - sample["prompt_length"] == n, "response_length != len(tokens) - prompt_length")
    _require(len(sample["loss_mask"]) == n, "len(loss_mask) != response_length")
    _require(len(sample["rollout_log_probs"]) == n, "len(rollout_log_probs) != response_length")
    for m, lp in zip(sample["loss_mask"], sample["rollout_log_probs"]):
        _require(m in (0, 1), "loss_mask entries must be 0 or 1")
        _require(m == 0 or lp < 0, "a trained token must carry its sampling log-prob")


# -- the checks -------------------------------------------------------------------------------


def check_fresh_store_is_empty(version: SessionVersion) -> None:
    d = Driver(version)
    described = d.store.describe()
    _require(described["records"] == [], "a fresh store has records")
    _require(described["metadata"]["accumulated_token_ids"] == [], "a fresh store has accumulated tokens")
    batch = d.store.samples(SampleOptions()).to_dict()
    _require(batch == {"samples": [], "empty_reason": "no_records"}, f"fresh store samples: {batch}")


def check_first_turn_records_exact_tokens(version: SessionVersion) -> None:
    d = Driver(version)
    chat = request(user("hi"))
    plan = d.store.plan(chat, TOKENIZER)
    _require(tuple(plan.prompt_ids) == TOKENIZER.render_prompt(chat.messages, tools=None, template_kwargs={}), "first-turn prompt is not the template rendering")
    done = completion("hello")
    d.commit(plan, done)
    _require(d.accumulated() == list(plan.prompt_ids) + list(done.token_ids), "accumulated != prompt + completion")
    records = d.store.describe()["records"]
    _require(len(records) == 1 and records[0]["request"]["input_ids"] == list(plan.prompt_ids), "record does not hold the upstream request")
    sample = _only_sample(d)
    _check_sample_shape(sample)
    _require(sample["tokens"] == d.accumulated(), "sample tokens != accumulated tokens")
    _require(sample["prompt_length"] == len(plan.prompt_ids), "prompt_length != first prompt length")
    _require(sample["loss_mask"] == [1] * len(done.token_ids), "the completion is not fully trained")
    _require(sample["rollout_log_probs"] == list(done.logprobs), "log-probs are not the sampled ones")


def check_extension_appends_observation(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    first = d.accumulated()
    chat = request(user("q1"), a1, {"role": "tool", "content": "t", "tool_call_id": "c1"}, user("q2"))
    plan = d.store.plan(chat, TOKENIZER)
    check_extends(first, plan.prompt_ids)
    _require(plan.parent is not None, "an extension did not attach to the generated turn")
    d.commit(plan, completion("a2"))
    sample = _only_sample(d)
    _check_sample_shape(sample)
    observation = len(plan.prompt_ids) - len(first)
    expected_mask = [1] * (len(first) - sample["prompt_length"]) + [0] * observation + [1] * len(completion("a2").token_ids)
    _require(sample["loss_mask"] == expected_mask, "observation tokens must be masked, completions trained")
    _require(sample["tokens"] == d.accumulated(), "sample tokens != accumulated tokens")


def check_plan_is_pure(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    before = d.state()
    d.store.plan(request(user("q1"), a1, user("q2")), TOKENIZER)
    d.store.plan(request(user("other opening")), TOKENIZER)
    _require(d.state() == before, "plan() changed the session state")
    _rejected_without_change(d, lambda: d.store.plan(request(user("q1"), a1, {"role": "developer", "content": "x"}), TOKENIZER), 400)


def check_retry_replaces_last_turn(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    d.turn(request(user("q1"), a1, user("q2")), "a2")
    retry = request(user("q1"), a1, user("q2"))
    plan = d.store.plan(retry, TOKENIZER)
    d.commit(plan, completion("a2-retry"))
    sample = _only_sample(d)
    _require(sample["tokens"] == list(plan.prompt_ids) + list(completion("a2-retry").token_ids), "the retried turn is not the sample's last turn")
    _require(sum(sample["loss_mask"]) == len(completion("a1").token_ids) + len(completion("a2-retry").token_ids), "superseded turn still trained")


def check_first_turn_retry_yields_one_sample(version: SessionVersion) -> None:
    d = Driver(version)
    d.turn(request(user("q1")), "first")
    d.turn(request(user("q1")), "second")
    samples = d.samples()
    _require(len(samples) == 1, f"a retried first turn produced {len(samples)} samples")
    _require(samples[0]["tokens"] == d.accumulated(), "the kept sample is not the retry")


def check_carried_assistant_is_not_a_checkpoint(version: SessionVersion) -> None:
    d = Driver(version)
    few_shot = (user("example q"), assistant("example a"))
    d.turn(request(*few_shot, user("q1")), "a1")
    plan = d.store.plan(request(*few_shot, user("different q1")), TOKENIZER)
    _require(plan.parent is None, "a client-carried assistant message was used as an attach point")


def check_commit_never_drops(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    chat = request(user("q1"), a1, user("q2"))
    first, second = d.store.plan(chat, TOKENIZER), d.store.plan(chat, TOKENIZER)
    d.commit(first, completion("x"))
    after_first = d.state()
    records = len(d.store.describe()["records"])
    try:
        d.commit(second, completion("y"))
    except Conflict:
        _require(d.state() == after_first, "a refused commit changed the session state")
        return
    _require(len(d.store.describe()["records"]) == records + 1, "a concurrent commit was accepted but not recorded")


def check_truncated_turn_cannot_be_extended(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "cut", finish_reason="length")
    _rejected_without_change(d, lambda: d.store.plan(request(user("q1"), a1, user("q2")), TOKENIZER), 409)
    sample = _only_sample(d)
    _require(sample["status"] == "truncated", "a length-limited turn's sample is not marked truncated")
    d.store.plan(request(user("q1")), TOKENIZER)  # retrying it is fine


def check_forged_plan_is_refused(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    plan = d.store.plan(request(user("q1"), a1, user("q2")), TOKENIZER)
    forged = replace(plan, prompt_ids=(1, *plan.prompt_ids[1:]))
    error = _rejected_without_change(d, lambda: d.commit(forged, completion("a2")))
    _require(isinstance(error, TokenInvariantError), "a plan whose prompt does not extend its parent was not refused")
    misaligned = replace(completion("a2"), logprobs=(-0.5,))
    error = _rejected_without_change(d, lambda: d.commit(plan, misaligned))
    _require(isinstance(error, TokenInvariantError), "a completion with misaligned log-probs was not refused")


def check_each_completion_trained_once(version: SessionVersion) -> None:
    d = Driver(version)
    a1 = d.turn(request(user("q1")), "a1")
    a2 = d.turn(request(user("q1"), a1, user("q2")), "a2")
    d.turn(request(user("q1"), a1, user("q2"), a2, user("q3")), "a3")
    try:  # a branch two turns up: v1 refuses it, v2 keeps both branches
        a4 = d.turn(request(user("q1"), a1, user("q2 again")), "a4")
        d.turn(request(user("q1"), a1, user("q2 again"), a4, user("q3")), "a5")
    except SessionError as exc:
        _require(400 <= exc.status < 500, f"a branch was refused with HTTP {exc.status}")
    samples = d.samples()
    _require(bool(samples), "no samples")
    for sample in samples:
        _check_sample_shape(sample)
    in_samples = {seq for sample in samples for seq in sample["metadata"]["turns"]}
    total = sum(sum(sample["loss_mask"]) for sample in samples)
    distinct = sum(len(completion(f"a{seq}").token_ids) for seq in in_samples)
    _require(total == distinct, f"{total} trained tokens for {distinct} distinct completion tokens: a completion is trained twice or not at all")


def check_max_turns_is_enforced(version: SessionVersion) -> None:
    d = Driver(version, max_turns=2)
    a1 = d.turn(request(user("q1")), "a1")
    a2 = d.turn(request(user("q1"), a1, user("q2")), "a2")
    _rejected_without_change(d, lambda: d.store.plan(request(user("q1"), a1, user("q2"), a2, user("q3")), TOKENIZER), 409)


CHECKS: dict[str, Callable[[SessionVersion], None]] = {
    fn.__name__.removeprefix("check_"): fn
    for fn in (
        check_fresh_store_is_empty,
        check_first_turn_records_exact_tokens,
        check_extension_appends_observation,
        check_plan_is_pure,
        check_retry_replaces_last_turn,
        check_first_turn_retry_yields_one_sample,
        check_carried_assistant_is_not_a_checkpoint,
        check_commit_never_drops,
        check_truncated_turn_cannot_be_extended,
        check_forged_plan_is_refused,
        check_each_completion_trained_once,
        check_max_turns_is_enforced,
    )
}


def run_check(version: SessionVersion, name: str) -> None:
    try:
        CHECKS[name](version)
    except Exception as exc:  # a broken store may fail in any way; report it as the check's failure
        cause = str(exc) if isinstance(exc, ConformanceError) else f"{type(exc).__name__}: {exc}"
        raise ConformanceError(f"session version {version.name!r} fails conformance check {name!r}: {cause}") from exc


def run_conformance(version: SessionVersion) -> list[str]:
    """Run every check; return their names, or raise :class:`ConformanceError` on the first failure."""
    for name in CHECKS:
        run_check(version, name)
    return list(CHECKS)
