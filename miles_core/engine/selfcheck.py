"""Prove the embedded engine works here: batched generation equals a teacher-forced forward."""

from __future__ import annotations

from typing import Any

#: max |engine - teacher-forced| fp32 log-prob, per device type. On CUDA fla's Triton kernels run
#: tf32 dot products whatever torch's tf32 switches say, and its recurrent decode kernel sums in
#: another order than its chunked prefill (measured on an H200: 4e-5 here, 1.2e-4 over 384 tokens).
TOLERANCE = {"cpu": 1e-5, "cuda": 5e-4}


def logprob_tolerance(device: str) -> float:
    """The fp32 log-prob agreement the embedded engine must reach on ``device``."""
    return TOLERANCE.get(device.split(":")[0], TOLERANCE["cpu"])


def check_embedded(model_path: str | None = None) -> dict[str, Any]:
    """Generate with the tiny preset (or ``model_path``), two requests batched, and compare every
    returned log-prob with one full forward of the same model over the same tokens (fp32).

    Raises ``AssertionError`` naming the worst difference when the engine's cache disagrees with
    the model (for example a transformers release whose cache interface changed).

    The decode step runs eagerly (replayed from CUDA graphs on a GPU), not through
    ``torch.compile``: compiling it was most of a GPU doctor's warm engine time (H100: 9.7 s with
    it, 0.4-0.5 s without) and proves the compiler, not the engine; the GPU tests hold the
    compiled step to the same teacher-forced forward.
    """
    import torch

    from miles_core.engine.base import GenerationRequest, SamplingParams
    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.presets import preset_dir
    from miles_core.hardware.gdn import gdn_model_device

    path = model_path or preset_dir("tiny")
    requests = [
        GenerationRequest([72, 105, 33, 10] * (i + 1), SamplingParams(max_tokens=8, seed=i, ignore_eos=True)) for i in range(2)
    ]
    device = gdn_model_device()
    with Engine.from_pretrained(path, EngineConfig(max_batch_size=2, dtype="float32", device=device, compile_decode=False)) as engine:
        completions = engine.generate(requests)
        runner = engine.runner_info()
        worst = 0.0
        for request, completion in zip(requests, completions):
            ids = torch.tensor([[*request.input_ids, *completion.token_ids]], device=device)
            with torch.inference_mode():
                logprobs = engine.model(ids).logits[0, len(request.input_ids) - 1 : -1].float().log_softmax(-1)
            reference = logprobs.gather(-1, torch.tensor(completion.token_ids, device=device)[:, None]).squeeze(-1).cpu()
            worst = max(worst, float((reference - torch.tensor(completion.logprobs)).abs().max()))
    tolerance = logprob_tolerance(device)
    if worst > tolerance:
        raise AssertionError(
            f"engine log-probs differ from a teacher-forced forward by {worst:.2e} (> {tolerance:g} on {device})"
        )
    return {"model": str(path), "device": device, "runner": runner["runner"], "cuda_graphs": runner["cuda_graphs"],
            "compiled_decode": runner.get("compiled_decode", False),
            "max_abs_logprob_diff": worst, "tolerance": tolerance, "patches": engine.patch_report.applied}
