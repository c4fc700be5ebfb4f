"""The RL task protocol (what the ``miles_tasks`` hook returns) and reward resolution.

A task is a fixed set of prompts plus a reward. A reward is one of:

* :class:`SandboxReward` -- a program that checks a batch of completions; it *executes model
  output*, so it runs in the configured sandbox provider, once per batch, in a sandbox kept warm
  for the whole run;
* a plain callable ``reward(inputs: list[RewardInput]) -> list[float]`` run in-process (for
  rewards that only compare strings).

``task.reward = "module:attr"`` in the config replaces a task's reward with either kind.

What training needs from a task is ``name``, ``prompts()`` and ``reward``; ``description``,
``has_accuracy`` and ``tools`` have defaults (:func:`trainable`), and ``miles train`` refuses a
task that lacks what it needs before it builds anything, naming what is missing.
Importing this module is cheap (no torch).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from miles_core.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat messages (agentic path, chat-template models) and its plain text.

    ``text`` is what a model without a chat template is fed (the direct path renders ``messages``
    with the tokenizer's chat template when it has one). ``answer`` is whatever the reward needs.
    """

    id: str
    text: str
    answer: str
    messages: tuple[Mapping[str, Any], ...] = ()

    def chat(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.messages] or [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees for one completion (JSON-serialisable: it crosses into sandboxes)."""

    prompt_id: str
    prompt: str
    answer: str
    completion: str  # decoded generated text of the final turn, special tokens removed
    first_token: str  # the first generated token, decoded
    turns: int = 1

    def to_json(self) -> dict[str, Any]:
        # the fields are strings and an int: a copy of the instance's dict is the document, without
        # asdict's recursive deep copy (~5 us a sample against ~0.2 us, every sample of every step)
        return dict(vars(self))


RewardFn = Callable[[Sequence[RewardInput]], Sequence[float]]


@dataclass(frozen=True)
class SandboxReward:
    """A checker program run in a sandbox: ``python3 PROGRAM INPUT_JSON`` prints a JSON list of
    floats, one per input, in order. The program only sees the batch file; it has no access to
    the trainer's memory.
    """

    name: str
    program: str
    files: Mapping[str, str] = field(default_factory=dict)  # extra files next to the program

    def decode(self, stdout: str, expected: int) -> list[float]:
        """Parse the program's output; anything but ``expected`` finite numbers is an error."""
        try:
            values = json.loads(stdout)
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"reward {self.name!r}: output is not JSON ({exc}): {stdout[:200]!r}") from None
        if not isinstance(values, list) or len(values) != expected:
            raise RuntimeError(f"reward {self.name!r}: expected a list of {expected} numbers, got {stdout[:200]!r}")
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise RuntimeError(f"reward {self.name!r}: {v!r} is not a finite number")
            out.append(float(v))
        return out


@dataclass(frozen=True)
class SandboxTool:
    """A tool an agentic episode may call; it runs in the sandbox: ``python3 PROGRAM ARGS_JSON``
    prints the tool's result (the text the model sees as the tool message)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    program: str

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@runtime_checkable
class Task(Protocol):
    """An RL task contributed through ``miles_tasks``.

    Optional attributes (:func:`trainable` fills them in): ``description: str`` (default: the
    name), ``has_accuracy: bool`` -- whether "greedy accuracy", the share of prompts whose greedy
    completion scores 1, is meaningful (default ``True``) -- and ``tools:
    tuple[SandboxTool, ...]``, the tools agentic episodes may call (default: none).
    """

    name: str
    #: the reward: a :class:`SandboxReward` or an in-process :data:`RewardFn`
    reward: SandboxReward | RewardFn

    def prompts(self) -> Sequence[Prompt]: ...

    def verify(self) -> None:
        """Check the task is usable: prompts exist, ids unique, the reward scores a known answer."""


@dataclass(frozen=True)
class TrainableTask:
    """A task as a run uses it: prompts built once, the reward (or its replacement), defaults filled."""

    name: str
    description: str
    prompts: tuple[Prompt, ...]
    reward: SandboxReward | RewardFn
    has_accuracy: bool
    tools: tuple[SandboxTool, ...]


def trainable(task: object, reward: SandboxReward | RewardFn | None = None) -> TrainableTask:
    """``task`` with its defaults, or a ConfigError naming everything training would miss.

    ``reward`` replaces the task's own (``task.reward`` in the config). Checked: ``prompts()``
    returns at least one :class:`Prompt`; the reward is a :class:`SandboxReward` or a callable
    taking the batch (``reward(inputs: list[RewardInput]) -> list[float]``); ``has_accuracy`` is a
    bool and ``tools`` holds :class:`SandboxTool` objects, when present.
    """
    name = str(getattr(task, "name", "?"))
    problems: list[str] = []
    prompts: tuple[Prompt, ...] = ()
    make_prompts = getattr(task, "prompts", None)
    if not callable(make_prompts):
        problems.append("prompts(): the method returning its Prompt list is missing")
    else:
        built = tuple(make_prompts())
        wrong = [type(p).__name__ for p in built if not isinstance(p, Prompt)]
        if not built:
            problems.append("prompts() returned no prompts")
        elif wrong:
            problems.append(f"prompts() must return miles_core.rl.tasks.Prompt objects, got {wrong[0]}")
        prompts = built
    chosen = reward if reward is not None else getattr(task, "reward", None)
    if chosen is None:
        problems.append("reward: missing (a SandboxReward, or a callable reward(inputs) -> list[float])")
    elif not isinstance(chosen, SandboxReward):
        problem = _reward_signature_problem(chosen)
        if problem:
            problems.append(problem)
    has_accuracy = getattr(task, "has_accuracy", True)
    if not isinstance(has_accuracy, bool):
        problems.append(f"has_accuracy must be a bool, got {type(has_accuracy).__name__}")
    tools = tuple(getattr(task, "tools", ()) or ())
    if any(not isinstance(t, SandboxTool) for t in tools):
        problems.append("tools must hold miles_core.rl.tasks.SandboxTool objects")
    if problems or chosen is None:
        raise ConfigError(
            f"task {name!r} cannot be trained: " + "; ".join(problems)
            + " (the task protocol is miles_core.rl.tasks.Task; see docs/train.md, 'Writing a task')"
        )
    return TrainableTask(name, str(getattr(task, "description", name)), prompts, chosen, has_accuracy, tools)


def _reward_signature_problem(reward: object) -> str | None:
    """Why ``reward`` is not a batch reward ``reward(inputs)`` (None if it is one)."""
    if not callable(reward):
        return f"reward must be a SandboxReward or a callable reward(inputs) -> list[float], got {type(reward).__name__}"
    try:
        parameters = list(inspect.signature(reward).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in parameters) or (len(required) <= 1 <= len(positional)):
        return None
    shown = ", ".join(p.name for p in positional) or "nothing"
    return (
        f"reward must take one argument, the batch (reward(inputs: list[RewardInput]) -> list[float]); "
        f"it takes ({shown})"
    )


def resolve_reward(spec: str) -> SandboxReward | RewardFn:
    """Import a ``module:attr`` reward (a :class:`SandboxReward` or a callable)."""
    from miles_core.plugins import import_object

    if ":" not in spec:
        raise ConfigError(f"task.reward: expected 'module:attr', got {spec!r}")
    try:
        obj = import_object(spec)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"task.reward: cannot import {spec!r}: {exc}") from None
    if not isinstance(obj, SandboxReward) and not callable(obj):
        raise ConfigError(f"task.reward: {spec!r} is neither a SandboxReward nor callable")
    return obj


def check_prompts(task_name: str, prompts: Sequence[Prompt]) -> None:
    """Shared part of ``Task.verify``: at least one prompt, unique ids."""
    if not prompts:
        raise ValueError(f"task {task_name!r} has no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"task {task_name!r} has duplicate prompt ids")
