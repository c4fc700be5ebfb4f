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


def _sum_prompt(a: int, b: int) -> Prompt:
    text = f"{a}+{b}="
    return Prompt(id=f"{a}+{b}", text=text, answer=str(a + b), messages=({"role": "user", "content": text},))


def addition_prompts() -> list[Prompt]:
    """The 55 prompts "a+b=" with single digits and a + b <= 9."""
    return [_sum_prompt(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def successor_prompts() -> list[Prompt]:
    """The 9 prompts "n+1=" for n = 0..8: every answer digit 1..9 exactly once."""
    return [_sum_prompt(n, 1) for n in range(9)]


@dataclass(frozen=True)
class ArithmeticTask:
    """Prompts whose answer is one digit; reward 1 if the first generated token is that digit."""

    name: str
    description: str
    size: int
    reward: SandboxReward | RewardFn = field(
        default_factory=lambda: SandboxReward(name="first-token-digit", program=FIRST_TOKEN_CHECKER)
    )
    has_accuracy: bool = True
    tools: tuple = ()
    cheap_verify: bool = True  # pure Python: `miles plugins list` runs verify()

    def prompts(self) -> list[Prompt]:
        return addition_prompts() if self.name == "arith-add" else successor_prompts()

    def verify(self) -> None:
        prompts = self.prompts()
        check_prompts(self.name, prompts)
        if len(prompts) != self.size:
            raise ValueError(f"expected {self.size} prompts, built {len(prompts)}")
        if isinstance(self.reward, SandboxReward):
            compile(self.reward.program, f"<{self.reward.name}>", "exec")


@hookimpl
def miles_tasks() -> list[ArithmeticTask]:
    return [
        ArithmeticTask("arith-add", "55 prompts 'a+b=' (single digits, a+b <= 9); reward 1 if the first token is the sum", 55),
        ArithmeticTask("arith-next", "9 prompts 'n+1=' (n = 0..8); reward 1 if the first token is n+1", 9),
    ]
