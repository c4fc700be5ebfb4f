"""The embedded engine on a CUDA GPU: the tiny preset in fp32 and the small-gpu preset in bf16.

Skips without CUDA. The 1e-5 log-prob contract is checked on CPU (test_engine.py); here the fp32
bound is the engine self-check's CUDA tolerance (5e-4): fla's Triton kernels run tf32 dot products
whatever torch's tf32 switches say (the reason the gdn-packing probe allows 2e-3 relative on CUDA),
and its recurrent decode kernel sums in another order than its chunked prefill. Measured on an H200
(2026-11-30): max 1.2e-4 over 384 tokens of log-probs around -5.5.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cuda_ci
from miles_core.engine.base import GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.presets import preset_dir
from miles_core.engine.selfcheck import logprob_tolerance

register_cuda_ci(est_time=120, suite="stage-b-1-gpu-h200", labels=["gpu"])

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _requests(n: int, max_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest([(7 * i + j) % 256 for j in range(5 + i % 17)], SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True))
        for i in range(n)
    ]


def test_tiny_fp32_on_gpu_matches_a_teacher_forced_forward(tmp_path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    requests = _requests(16, 24)
    with Engine.from_pretrained(preset_dir("tiny", tmp_path), EngineConfig(device="cuda", dtype="float32", max_batch_size=16)) as engine:
        together = engine.generate(requests)
        alone = [engine.generate([r])[0] for r in requests[:4]]
        for request, completion in zip(requests, together):
            ids = torch.tensor([[*request.input_ids, *completion.token_ids]], device="cuda")
            with torch.inference_mode():
                logprobs = engine.model(ids).logits[0, len(request.input_ids) - 1 : -1].float().log_softmax(-1)
            expected = logprobs.gather(-1, torch.tensor(completion.token_ids, device="cuda")[:, None]).squeeze(-1).cpu()
            assert (expected - torch.tensor(completion.logprobs)).abs().max() <= logprob_tolerance("cuda")
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[:4]]


def test_small_gpu_preset_serves_64_concurrent_requests(tmp_path) -> None:
    with Engine.from_pretrained(preset_dir("small-gpu", tmp_path), EngineConfig(device="cuda", max_batch_size=64)) as engine:
        assert engine.dtype == torch.bfloat16
        completions = engine.generate(_requests(64, 32))
        assert engine.stats()["decode_steps"] < 64 * 32 // 4
    assert all(c.completion_tokens == 32 and all(-1e9 < lp <= 0 for lp in c.logprobs) for c in completions)
