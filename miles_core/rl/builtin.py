"""Built-in RL tasks (plugin ``core-tasks``).

``arith-add``: the 55 prompts ``"a+b="`` with single digits ``a``, ``b`` and ``a + b <= 9``;
reward 1 when the first generated token is the digit of the sum. The answer is checked by a
program run in the sandbox (it executes nothing the model wrote, but it is the pattern every
code-executing reward follows, and it keeps the check out of the trainer's memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_core.hookspecs import hookimpl
from miles_core.rl.tasks import Prompt, RewardFn, RewardInput, SandboxReward, check_prompts

FIRST_TOKEN_CHECKER = """\
import json, sys

with open(sys.argv[1]) as f:
    batch = json.load(f)
print(json.dumps([1.0 if item["first_token"] == item["answer"] else 0.0 for item in batch]))
"""


def first_token_reward(inputs: Sequence[RewardInput]) -> list[float]:
    """In-process twin of the sandboxed checker (for runs that opt out of the sandbox)."""
    return [1.0 if item.first_token == item.answer else 0.0 for item in inputs]


def addition_prompts() -> list[Prompt]:
    return [
        Prompt(
            id=f"{a}+{b}",
            text=f"{a}+{b}=",
            answer=str(a + b),
            messages=({"role": "user", "content": f"{a}+{b}="},),
        )
        for a in range(10)
        for b in range(10)
        if a + b <= 9
    ]


@dataclass(frozen=True)
class AdditionTask:
    name: str = "arith-add"
    description: str = "55 prompts 'a+b=' (single digits, a+b <= 9); reward 1 if the first token is the sum"
    reward: SandboxReward | RewardFn = field(
        default_factory=lambda: SandboxReward(name="first-token-digit", program=FIRST_TOKEN_CHECKER)
    )
    has_accuracy: bool = True
    tools: tuple = ()

    def prompts(self) -> list[Prompt]:
        return addition_prompts()

    def verify(self) -> None:
        prompts = self.prompts()
        check_prompts(self.name, prompts)
        if len(prompts) != 55:
            raise ValueError(f"expected 55 prompts, built {len(prompts)}")
        if isinstance(self.reward, SandboxReward):
            compile(self.reward.program, f"<{self.reward.name}>", "exec")


@hookimpl
def miles_tasks() -> list[AdditionTask]:
    return [AdditionTask()]
