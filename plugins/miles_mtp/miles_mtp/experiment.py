"""The learning experiment: MTP on a learnable synthetic sequence, with a double-shift control.

Every document is an arithmetic sequence modulo the vocabulary (random start, random stride in
{1, 2, 3}): a 4-token prompt, then a trained response. Depth 1 must predict ``tokens[i + 2]``
from the trunk's state at ``i`` and the embedding of ``tokens[i + 1]``, which the context fixes.

The negative control trains through :class:`ExtraShiftAdapter`, which reproduces upstream's
call-site bug (one shift too many), and is then evaluated through the correct adapter. Its own
reported MTP loss falls too, since ``tokens[i + 3]`` is just as learnable: only the contract's
targets expose the bug, which is why upstream trained the wrong token for weeks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.errors import MilesError
from miles_mtp.adapter import LabelAdapter, install, installed_adapter
from miles_mtp.batching import Sample, pack
from miles_mtp.harness import MTPLosses, TinyGPTConfig, build_tiny_gpt, evaluate, train_step
from miles_mtp.roll import LEFT

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager

PROMPT_TOKENS = 4
VOCAB_SIZE = 32


class ExtraShiftAdapter(LabelAdapter):
    """Negative control only: shifts the labels once more than the model's convention asks for."""

    def path_inputs(self, tokens: Any, loss_mask: Any, shift: Any) -> tuple[Any, Any]:
        labels, mask = super().path_inputs(tokens, loss_mask, shift)
        return shift(labels, LEFT), mask


def arithmetic_sample(rng: random.Random, vocab_size: int = VOCAB_SIZE) -> Sample:
    length = rng.randint(12, 24)
    start, stride = rng.randrange(vocab_size - 1), rng.choice((1, 2, 3))
    ids = [1 + (start + j * stride) % (vocab_size - 1) for j in range(length)]
    return ids, [0] * PROMPT_TOKENS + [1] * (length - PROMPT_TOKENS)


@dataclass(frozen=True)
class LearningRun:
    """Depth losses on a held-out batch (contract targets) before and after training, and the
    losses the model reported for its last training step (through whichever adapter trained it)."""

    steps: int
    initial: MTPLosses
    final: MTPLosses
    last_step: MTPLosses
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "initial": self.initial.to_dict(),
            "final": self.final.to_dict(),
            "last_step_reported": self.last_step.to_dict(),
            "depth1_final_over_initial": self.final.mtp_losses[0] / self.initial.mtp_losses[0],
            "seconds": round(self.seconds, 2),
        }


def learning_run(
    steps: int,
    *,
    extra_shift: bool = False,
    seed: int = 0,
    mtp_num_layers: int = 1,
    documents_per_step: int = 8,
    lr: float = 3e-3,
    device: Any = "cpu",
    pm: MilesPluginManager | None = None,
) -> LearningRun:
    """Train a tiny GPTModel for ``steps`` steps; megatron's parallel state must be initialised."""
    import torch

    torch.manual_seed(seed)
    model, report = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB_SIZE, mtp_num_layers=mtp_num_layers), device, pm)
    correct = installed_adapter(model)
    if correct is None:
        raise MilesError(
            f"no MTP label adapter on the tiny GPTModel: the mtp-labels patch of miles-mtp was not applied "
            f"(patches applied: {list(report.applied) or 'none'}); pass a plugin manager with miles-mtp active"
        )
    held_out = pack([arithmetic_sample(random.Random(10_000 + i)) for i in range(16)])
    initial = evaluate(model, held_out)
    if extra_shift:
        install(model, ExtraShiftAdapter(correct.convention))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    started = time.perf_counter()
    last = initial
    for _ in range(steps):
        last = train_step(model, optimizer, pack([arithmetic_sample(rng) for _ in range(documents_per_step)]))
    seconds = time.perf_counter() - started
    install(model, correct)
    return LearningRun(steps, initial, evaluate(model, held_out), last, seconds)
