"""Smaller-runner variants of multi-GPU tests: derive a layout, validate it with Megatron's rules."""

from __future__ import annotations

import pytest

from miles_core.ci.layout import LayoutError, ParallelLayout, derive_layout
from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def test_keeps_the_axes_under_test_and_drops_the_rest() -> None:
    with_cp = derive_layout(ParallelLayout(tp=2, pp=2, cp=2).validate(8), 4, keep=("tp", "pp"))
    assert (with_cp.tp, with_cp.pp, with_cp.cp, with_cp.dp(4)) == (2, 2, 1, 1)
    with_dp = ParallelLayout(tp=2, pp=2).validate(8)
    assert with_dp.dp(8) == 2
    assert derive_layout(with_dp, 4, keep=("tp", "pp")).dp(4) == 1  # data parallel shrinks by itself


def test_upstream_pp2_ep4_on_four_gpus_is_rejected_naming_the_constraint() -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout(pp=2, ep=4).validate(4)
    assert "world size 4 is not divisible by etp*ep*pp = 1*4*2 = 8 (Megatron's expert-parallel grid)" in str(
        info.value
    )
    with pytest.raises(LayoutError, match=r"etp\*ep\*pp = 2\*4\*2 = 16"):
        derive_layout(ParallelLayout(tp=2, pp=2, cp=2, ep=4), 4, keep=("tp", "pp", "ep"))
    # dropping ep (not under test) or halving it fits: the fix upstream eventually shipped
    assert derive_layout(ParallelLayout(tp=2, pp=2, cp=2, ep=4), 4, keep=("tp", "pp")).ep == 1
    assert ParallelLayout(pp=2, ep=2).validate(4).ep == 2


def test_other_rules() -> None:
    assert ParallelLayout(tp=2, cp=3).problems(4) == ["world size 4 is not divisible by tp*pp*cp = 2*1*3 = 6"]
    assert ParallelLayout(ep=4, num_experts=6).problems(4) == ["num_experts 6 is not divisible by ep 4"]
    assert ParallelLayout(pp=2, num_layers=3).problems(4) == ["num_layers 3 is not divisible by pp 2"]
    assert ParallelLayout(tp=2, etp=1, ep=4).problems(4) == []  # explicit etp replaces tp in the expert grid
    assert ParallelLayout(tp=0).problems(4) == ["tp must be a positive integer, got 0"]
    with pytest.raises(LayoutError, match=r"unknown layout key\(s\) \['dp'\]"):
        ParallelLayout.from_mapping({"tp": 2, "dp": 2})
    with pytest.raises(LayoutError, match="cannot keep unknown axis"):
        derive_layout(ParallelLayout(), 2, keep=("zp",))
