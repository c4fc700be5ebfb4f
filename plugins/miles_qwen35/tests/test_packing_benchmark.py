"""``benchmarks/gdn_packing.py``'s training step: its padded side runs rows in micro-batches (an
80 GB card cannot hold all padded rows in one forward), and must still compute the whole batch's
gradient, so the packed/padded ratio compares the same training. Float32, a tiny model, CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-cpu")

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gdn_packing.py"
LENGTHS = [9, 4, 12, 6, 3]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gdn_packing_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing resolve the module by name
    spec.loader.exec_module(module)
    return module


def gradients(model: torch.nn.Module, step: object) -> dict[str, torch.Tensor]:
    assert callable(step)
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_micro_batched_padded_rows_give_the_whole_batchs_gradient(bench: ModuleType) -> None:
    torch.manual_seed(0)
    model = bench.build_model(bench.SMOKE_MODEL)
    packed = bench.packed_batch(LENGTHS, bench.SMOKE_MODEL["vocab_size"], "cpu", torch.Generator().manual_seed(1))
    padded = bench.padded_batch(packed, LENGTHS)
    whole = gradients(model, bench.train_step(model, padded))
    assert whole and all(g.abs().sum() > 0 for g in whole.values())
    for rows in (1, 2, 3):  # 3: an uneven last micro-batch
        parts = gradients(model, bench.train_step(model, padded, rows))
        assert parts.keys() == whole.keys()
        # fp32, the same per-token terms summed in another order: agreement to float rounding
        for name, g in whole.items():
            torch.testing.assert_close(parts[name], g, rtol=1e-5, atol=1e-6, msg=name)

    # negative control: each micro-batch's own mean, accumulated, is another gradient
    def naive() -> None:
        model.zero_grad(set_to_none=True)
        for i in range(0, len(LENGTHS), 2):
            model(**{k: v[i:i + 2] if isinstance(v, torch.Tensor) else v for k, v in padded.items()}).loss.backward()

    wrong = gradients(model, naive)
    assert max((wrong[n] - g).abs().max().item() for n, g in whole.items()) > 1e-3
