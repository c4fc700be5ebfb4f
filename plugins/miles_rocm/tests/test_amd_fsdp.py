"""ROCm variant of the FSDP2 GPU differential of ``tests/rl/test_fsdp.py``, for the 4-GPU MI350 runners.

The CUDA case (``stage-c-2-gpu-h200``) trains one step with the trainer sharded over two GPUs and
compares it with one GPU: tensor and pipeline parallel 1, data parallel 2. The smaller-runner rule
(:func:`miles_core.ci.layout.derive_layout`) keeps the axes that fix each rank's shard -- tp and
pp -- drops the others (context parallel) and lets data parallel follow the runner, here its 4
GPUs. The ROCm registration carries the derived layout literally, so ``miles ci`` validates it
against the suite's GPUs per runner when it discovers this file (an impossible one fails
``miles ci list`` at its line); ``test_the_registration_is_the_derived_layout`` checks it is exactly
what ``derive_layout`` gives, so the two cannot drift apart. It also runs in the CPU suite; the GPU
test is collected and skipped where there is no HIP build with 4 GPUs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from miles_rocm.ci import ROCM, register_rocm_ci

from miles_core.ci.discovery import Marker, parse_source
from miles_core.ci.layout import ParallelLayout, derive_layout
from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=4, suite="stage-a-cpu")
register_rocm_ci(
    est_time=300, suite="stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4, layout={"tp": 1, "pp": 1}
)

NUM_GPUS = 4
#: the CUDA case: FSDP2 over 2 GPUs, nothing but data parallel
CUDA_LAYOUT, CUDA_GPUS = ParallelLayout(), 2
FSDP_TEST = Path(__file__).resolve().parents[3] / "tests" / "rl" / "test_fsdp.py"


def test_the_registration_is_the_derived_layout() -> None:
    marker = Marker(ROCM.marker_name, ROCM.name, ROCM.marker_parameters())
    (registration,), problems = parse_source(
        Path(__file__).read_text(), "test_amd_fsdp.py", {marker.name: marker}
    )
    assert problems == []
    derived = derive_layout(CUDA_LAYOUT.validate(CUDA_GPUS), NUM_GPUS, keep=("tp", "pp"))
    assert registration.num_gpus == NUM_GPUS
    assert ParallelLayout.from_mapping(registration.layout) == derived
    assert (derived.tp, derived.pp, derived.cp, derived.dp(NUM_GPUS)) == (1, 1, 1, 4)


def _rocm_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.version.hip and torch.cuda.is_available() else 0


@pytest.mark.skipif(_rocm_gpus() < NUM_GPUS, reason=f"needs a HIP build of torch and {NUM_GPUS} AMD GPUs")
def test_four_rocm_ranks_update_like_one() -> None:
    """The CUDA case's differential with data parallel 4 over RCCL; tolerances as on CUDA (the
    kernels run reduced-precision matmuls: rel 1e-3)."""
    import torch

    if not FSDP_TEST.is_file():
        pytest.skip(f"{FSDP_TEST} is not in this checkout")
    spec = importlib.util.spec_from_file_location("miles_test_fsdp_case", FSDP_TEST)
    assert spec is not None and spec.loader is not None
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    one = case._trainer(1, "cuda")
    stats_1 = one.train(case._docs())
    weights_1 = {k: v.detach().float().cpu() for k, v in one.engine_weights().items()}
    del one
    torch.cuda.empty_cache()
    ranks = case._trainer(derive_layout(CUDA_LAYOUT, NUM_GPUS, keep=("tp", "pp")).dp(NUM_GPUS), "cuda")
    try:
        assert ranks.report["world_size"] == NUM_GPUS
        stats_n = ranks.train(case._docs())
        weights_n = {k: v.float().cpu() for k, v in ranks.engine_weights().items()}
    finally:
        ranks.close()
    for key in case.STATS:
        assert stats_n[key] == pytest.approx(stats_1[key], rel=1e-3, abs=1e-5), key
    diff = torch.cat([(weights_n[k] - weights_1[k]).abs().flatten() for k in weights_1])
    assert diff.mean().item() <= 1e-5, diff.max()
