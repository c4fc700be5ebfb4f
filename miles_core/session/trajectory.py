"""The turn model every session version shares: turns, plans, attach points, sample assembly.

A **turn** is one generated assistant message with the request messages that preceded it since
its parent turn. Turns are immutable and link to their parent, so a trajectory is a path in a
tree: v1 keeps one path, v2 keeps the tree. Each turn holds the full root-to-turn token snapshot
(``token_ids``), built only from the parent's snapshot, the observation tokens (the rendering of
the new messages) and the sampled completion -- never by re-tokenizing history.

A request **attaches** to the deepest turn whose whole path of messages (history and generated
assistants, compared with :func:`~miles_core.session.messages.message_key`) is a prefix of the
request's messages; the remaining request messages are new. Carried (few-shot) assistant messages
are never attach points: only generated turns are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.session.completion import Completion
from miles_core.session.errors import Conflict, InvalidRequest
from miles_core.session.messages import Message, MessageKey, message_key
from miles_core.session.tokens import TokenInvariantError, check_aligned, check_extends

if TYPE_CHECKING:
    from miles_core.session.base import PromptTokenizer
    from miles_core.session.normalize import ChatRequest

#: sample metadata keys the server sets; client metadata may not use them
SERVER_METADATA_KEYS = frozenset({"leaf", "turns", "finish_reason", "dropped_turns"})


@dataclass(frozen=True)
class TurnRecord:
    """What went over the wire for one turn, as the exact bytes.

    Bytes rather than parsed JSON: a server holds thousands of records, and parsed, each is
    dozens of objects (one per message and log-prob pair) that every full garbage collection
    rescans, at several times the memory. They are parsed when the session is described.
    """

    request_body: bytes  # the JSON body sent upstream (input_ids and forced flags included)
    response_body: bytes  # the upstream reply, as received
    started_at: float
    finished_at: float

    @property
    def request(self) -> dict[str, Any]:
        return json.loads(self.request_body)

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self.response_body)


@dataclass(frozen=True, eq=False)
class Turn:
    seq: int  # commit order within the session, from 1
    parent: Turn | None
    messages: tuple[Message, ...]  # request messages new in this turn
    keys: tuple[MessageKey, ...]  # match keys of ``messages`` and then of the assistant message
    trim: int  # trailing parent-completion tokens the observation replaced
    observation_ids: tuple[int, ...]  # the whole prompt for a root turn
    completion: Completion
    token_ids: tuple[int, ...]  # root-to-turn snapshot: prompt + completion
    record: TurnRecord
    depth: int = field(init=False)
    path_messages: int = field(init=False)  # messages from the root through this assistant

    def __post_init__(self) -> None:
        parent_depth, parent_messages = (self.parent.depth, self.parent.path_messages) if self.parent else (0, 0)
        object.__setattr__(self, "depth", parent_depth + 1)
        object.__setattr__(self, "path_messages", parent_messages + len(self.keys))

    def chain(self) -> list[Turn]:
        """The turns from the root to this one."""
        out: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            out.append(turn)
            turn = turn.parent
        out.reverse()
        return out

    def record_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "parent": self.parent.seq if self.parent else None,
            "request": self.record.request,
            "response": self.record.response,
            "status_code": 200,
            "started_at": self.record.started_at,
            "finished_at": self.record.finished_at,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "parent": self.parent.seq if self.parent else None,
            "depth": self.depth,
            "num_tokens": len(self.token_ids),
            "completion_tokens": len(self.completion.token_ids),
            "finish_reason": self.completion.finish_reason,
        }


@dataclass(frozen=True)
class Plan:
    """Where a request attaches and the prompt it will be generated from (no state changed)."""

    parent: Turn | None
    messages: tuple[Message, ...]
    keys: tuple[MessageKey, ...]
    prompt_ids: tuple[int, ...]
    trim: int
    revision: int  # the store revision the plan was made against


def deepest_match(
    keys: Sequence[MessageKey], roots: Iterable[Turn], children_of: Callable[[Turn], Iterable[Turn]]
) -> Turn | None:
    """The deepest turn whose path messages prefix ``keys``; ties go to the latest ``seq``."""
    best: Turn | None = None
    stack: list[tuple[Iterable[Turn], int]] = [(roots, 0)]
    while stack:
        candidates, offset = stack.pop()
        for turn in candidates:
            end = offset + len(turn.keys)
            if end <= len(keys) and tuple(keys[offset:end]) == turn.keys:
                if best is None or (turn.depth, turn.seq) > (best.depth, best.seq):
                    best = turn
                stack.append((children_of(turn), end))
    return best


def plan_turn(
    request: ChatRequest, parent: Turn | None, tokenizer: PromptTokenizer, *, revision: int
) -> Plan:
    """Plan a turn under ``parent`` (``None``: a new root) for ``request``."""
    if parent is None:
        prompt = tokenizer.render_prompt(request.messages, tools=request.tools, template_kwargs=request.template_kwargs)
        return Plan(None, request.messages, request.keys, prompt, 0, revision)
    if parent.completion.truncated:
        raise Conflict(
            f"turn {parent.seq} was cut off at its token limit (finish_reason=length) and cannot be "
            "continued; retry it instead"
        )
    start = parent.path_messages
    messages, keys = request.messages[start:], request.keys[start:]
    allowed = tokenizer.family.append_roles
    for i, message in enumerate(messages, start):
        if message["role"] not in allowed:
            raise InvalidRequest(
                f"messages[{i}].role is {message['role']!r}, which template family {tokenizer.family.name!r} "
                f"cannot append after a generated turn (allowed: {', '.join(sorted(allowed))})"
            )
    appended = tokenizer.render_append(
        parent.completion.token_ids, messages, tools=request.tools, template_kwargs=request.template_kwargs
    )
    keep = len(parent.token_ids) - appended.trim
    return Plan(parent, messages, keys, parent.token_ids[:keep] + appended.ids, appended.trim, revision)


def build_turn(seq: int, plan: Plan, completion: Completion, record: TurnRecord) -> Turn:
    """The turn ``plan`` + ``completion`` make, after checking the token invariants."""
    check_aligned(completion.token_ids, completion.logprobs)
    prompt = tuple(plan.prompt_ids)
    if plan.parent is None:
        observation = prompt
    else:
        check_extends(plan.parent.token_ids, prompt, trim=plan.trim)
        if plan.trim > len(plan.parent.completion.token_ids):
            raise TokenInvariantError(f"trim={plan.trim} exceeds turn {plan.parent.seq}'s completion")
        observation = prompt[len(plan.parent.token_ids) - plan.trim :]
    return Turn(
        seq=seq,
        parent=plan.parent,
        messages=plan.messages,
        keys=(*plan.keys, message_key(completion.message)),
        trim=plan.trim,
        observation_ids=observation,
        completion=completion,
        token_ids=prompt + completion.token_ids,
        record=record,
    )


# -- samples ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleOptions:
    max_seq_len: int | None = None  # drop trailing turns until the sample fits
    metadata: Mapping[str, Any] = field(default_factory=dict)  # copied into every sample


@dataclass(frozen=True)
class Sample:
    """One training sample: a root-to-leaf trajectory, prompt then response."""

    tokens: list[int]
    prompt_length: int
    response_length: int
    loss_mask: list[int]  # per response token: 1 = sampled and trained here
    rollout_log_probs: list[float]  # per response token: the sampling log-prob, 0.0 for observations
    status: str  # "completed" | "truncated"
    weight_versions: list[str | None]  # per turn
    metadata: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "prompt_length": self.prompt_length,
            "response_length": self.response_length,
            "loss_mask": self.loss_mask,
            "rollout_log_probs": self.rollout_log_probs,
            "status": self.status,
            "weight_versions": self.weight_versions,
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class SampleBatch:
    samples: list[Sample]
    empty_reason: str | None  # None, "no_records" or "all_truncated"

    def to_dict(self) -> dict[str, Any]:
        return {"samples": [s.to_dict() for s in self.samples], "empty_reason": self.empty_reason}


def assemble_samples(leaves: Sequence[Turn], options: SampleOptions) -> SampleBatch:
    """One sample per leaf, in the given order. A turn shared by several leaves is trained
    (loss mask 1) only in the first sample that contains it."""
    if not leaves:
        return SampleBatch([], "no_records")
    trained: set[int] = set()
    samples = [s for s in (assemble_sample(leaf.chain(), options, trained) for leaf in leaves) if s is not None]
    return SampleBatch(samples, None if samples else "all_truncated")


def assemble_sample(chain: Sequence[Turn], options: SampleOptions, trained: set[int]) -> Sample | None:
    kept = list(chain)
    if options.max_seq_len is not None:
        while kept and len(kept[-1].token_ids) > options.max_seq_len:
            kept.pop()
        if not kept:
            return None
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in kept:
        if turn.parent is not None:
            if turn.trim:
                del mask[-turn.trim :], logprobs[-turn.trim :]
            mask += [0] * len(turn.observation_ids)
            logprobs += [0.0] * len(turn.observation_ids)
        mask += [0 if turn.seq in trained else 1] * len(turn.completion.token_ids)
        logprobs += turn.completion.logprobs
    root, leaf = kept[0], kept[-1]
    prompt_length = len(root.observation_ids)
    response_length = len(leaf.token_ids) - prompt_length
    if len(mask) != response_length:
        raise TokenInvariantError(
            f"sample for turn {leaf.seq}: loss mask has {len(mask)} entries for {response_length} response tokens"
        )
    trained.update(turn.seq for turn in kept)
    dropped = len(chain) - len(kept)
    return Sample(
        tokens=list(leaf.token_ids),
        prompt_length=prompt_length,
        response_length=response_length,
        loss_mask=mask,
        rollout_log_probs=logprobs,
        status="truncated" if dropped or leaf.completion.truncated else "completed",
        weight_versions=[turn.completion.weight_version for turn in kept],
        metadata={
            **options.metadata,
            "leaf": leaf.seq,
            "turns": [turn.seq for turn in kept],
            "finish_reason": leaf.completion.finish_reason,
            "dropped_turns": dropped,
        },
    )
