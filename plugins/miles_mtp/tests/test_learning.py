"""The CPU training harness: a tiny megatron GPTModel with MTP learns depth 1 through the
contract within a few dozen steps, and does not when trained through a double-shifting adapter.
The long version (300 steps, numbers in benchmarks/README.md) is benchmarks/mtp_learning.py."""

from __future__ import annotations

import pytest
from miles_mtp.experiment import learning_run

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import MilesError

register_cpu_ci(est_time=16, suite="stage-a-cpu")

STEPS = 60


def test_depth_one_loss_falls_well_below_its_initial_value(megatron_state):
    pm, hw = megatron_state
    run = learning_run(STEPS, device=hw.device, pm=pm)
    initial, final = run.initial.mtp_losses[0], run.final.mtp_losses[0]
    assert initial > 3.0  # ~ln(32): the untrained head is uniform over the vocabulary
    assert final < 0.25 * initial, run.to_dict()


def test_a_double_shifted_adapter_does_not_learn_depth_one(megatron_state):
    pm, hw = megatron_state
    run = learning_run(STEPS, extra_shift=True, device=hw.device, pm=pm)
    assert run.final.mtp_losses[0] > 0.9 * run.initial.mtp_losses[0], run.to_dict()
    # what the model reports about itself looks healthy: only the contract's targets tell
    assert run.last_step.mtp_losses[0] < 0.5 * run.initial.mtp_losses[0], run.to_dict()


def test_without_the_patch_the_run_names_what_is_missing(miles_pm_factory):
    from miles_core.hardware.megatron_state import single_rank_parallel_state

    pm = miles_pm_factory(builtins=True)  # the core's built-ins only: no miles-mtp
    with single_rank_parallel_state(seed=0) as hw, pytest.raises(MilesError, match="mtp-labels patch of miles-mtp"):
        learning_run(1, device=hw.device, pm=pm)
