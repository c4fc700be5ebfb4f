"""The fixed tiny batch every algorithm's ``verify()`` computes its loss on.

One group of four samples with rewards ``[1, 0, 0, 0]``, packed in one row. Each sample is one
untrained prompt position followed by its response tokens; every rollout log-prob is ``-1`` and
the trainer's log-probs differ from them by :data:`DELTAS` (so ratios are ``exp(delta)``: inside
the clip range ``[0.8, 1.2]`` except sample 2's, which is below it). The prompt positions carry a
log-prob of ``+5`` that a correct loss ignores. Aggregation counts 6 trained tokens, 4 sequences
and a generation budget of 2 tokens. Settings: ``algorithm.*`` defaults (clip 0.2, std scaling),
whatever the algorithm's own defaults are, so the documented value depends on the definition only.

:func:`check_probe` raises unless the loss equals the algorithm's documented value and its
gradient has the signs any policy-gradient method must give here: raising the rewarded sample's
log-prob lowers the loss, raising an unrewarded sample's (unclipped) log-prob raises it, and
untrained positions get no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from miles_core.rl.algorithms.base import Algorithm

REWARDS = (1.0, 0.0, 0.0, 0.0)
GROUP_SIZE = 4
#: trainer minus rollout log-prob of each response token, per sample
DELTAS: tuple[tuple[float, ...], ...] = ((0.1,), (0.3, 0.0), (-0.4,), (0.0, -0.1))
ROLLOUT_LOGPROB = -1.0
PROMPT_LOGPROB = 5.0
BUDGET = 2.0
#: relative tolerance on the documented loss: float32 sums of a dozen O(1) terms
RELATIVE_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ProbeResult:
    loss: float
    gradient: torch.Tensor  # d loss / d trainer log-prob, per position of the row
    positions: dict[str, list[int]]  # "rewarded", "unrewarded_unclipped", "untrained" -> row positions


def run_probe(algorithm: Algorithm) -> ProbeResult:
    """The probe batch's aggregated loss under ``algorithm`` and its gradient."""
    import torch

    from miles_core.rl.algorithms.base import TokenBatch
    from miles_core.rl.algorithms.losses import MinibatchTotals, aggregation_weights
    from miles_core.rl.config import AlgorithmSection

    settings = AlgorithmSection(name=algorithm.name)
    advantages = algorithm.advantages(torch.tensor(REWARDS), GROUP_SIZE, settings)
    logprobs: list[float] = []
    rollout: list[float] = []
    adv: list[float] = []
    mask: list[float] = []
    owner: list[int] = []
    positions: dict[str, list[int]] = {"rewarded": [], "unrewarded_unclipped": [], "untrained": []}
    for doc, deltas in enumerate(DELTAS):
        positions["untrained"].append(len(logprobs))
        logprobs.append(PROMPT_LOGPROB)
        rollout.append(0.0)
        adv.append(float(advantages[doc]))
        mask.append(0.0)
        owner.append(doc)
        for delta in deltas:
            if doc == 0:
                positions["rewarded"].append(len(logprobs))
            elif doc == 3:
                positions["unrewarded_unclipped"].append(len(logprobs))
            logprobs.append(ROLLOUT_LOGPROB + delta)
            rollout.append(ROLLOUT_LOGPROB)
            adv.append(float(advantages[doc]))
            mask.append(1.0)
            owner.append(doc)
    trainer_lp = torch.tensor(logprobs, requires_grad=True)
    batch = TokenBatch(
        logprobs=trainer_lp,
        rollout_logprobs=torch.tensor(rollout),
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask),
        doc_index=torch.tensor(owner),
        num_docs=len(DELTAS),
    )
    per_token = algorithm.policy_loss(batch, settings).per_token
    totals = MinibatchTotals(tokens=float(sum(mask)), sequences=float(len(DELTAS)), budget=BUDGET)
    weights = aggregation_weights(algorithm.aggregation, batch.mask, batch.doc_index, batch.num_docs, totals)
    loss = (per_token * weights).sum()
    (gradient,) = torch.autograd.grad(loss, trainer_lp)
    return ProbeResult(float(loss.detach()), gradient, positions)


def check_probe(algorithm: Algorithm, expected_loss: float | None) -> ProbeResult:
    """Raise ``AssertionError`` naming what differs unless the probe gives ``expected_loss``
    (relative tolerance :data:`RELATIVE_TOLERANCE`; None: any finite loss) and the gradient signs
    described above."""
    result = run_probe(algorithm)
    if not math.isfinite(result.loss):
        raise AssertionError(f"the probe batch's loss is {result.loss}")
    if expected_loss is not None and not math.isclose(
        result.loss, expected_loss, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-7
    ):
        raise AssertionError(
            f"the probe batch's loss is {result.loss:.7g}; {algorithm.name} documents {expected_loss:.7g}"
        )
    grad = result.gradient
    rewarded = [float(grad[i]) for i in result.positions["rewarded"]]
    unrewarded = [float(grad[i]) for i in result.positions["unrewarded_unclipped"]]
    untrained = [float(grad[i]) for i in result.positions["untrained"]]
    if not all(g < 0 for g in rewarded):
        raise AssertionError(f"raising the rewarded sample's log-prob must lower the loss; gradient {rewarded}")
    if not all(g > 0 for g in unrewarded):
        raise AssertionError(f"raising an unrewarded sample's log-prob must raise the loss; gradient {unrewarded}")
    if any(g != 0 for g in untrained):
        raise AssertionError(f"untrained (prompt) positions must get no gradient; gradient {untrained}")
    return result
