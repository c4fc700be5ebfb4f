"""On an NVIDIA GPU: the cuda backend is detected and a tiny GPTModel trains through it."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cuda_ci

register_cuda_ci(est_time=40, suite="stage-b-1-gpu-h200", labels=["gpu"])

pytestmark = pytest.mark.skipif(
    not (torch.version.cuda and torch.cuda.is_available()), reason="needs a CUDA build of torch and a GPU"
)


def test_cuda_is_selected_and_megatron_trains_on_it(miles_pm_factory) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles_core.hardware import activate
    from miles_core.hardware.megatron_state import causal_attention_mask, single_rank_parallel_state

    hardware = activate(miles_pm_factory(builtins=True))
    assert (hardware.name, hardware.distributed_backend) == ("cuda", "nccl")
    assert hardware.fixes == ()
    assert hardware.supports("mm_out_dtype_fp32")
    a = torch.ones(4, 4, dtype=torch.bfloat16, device=hardware.device)
    assert torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32

    torch.cuda.set_device(0)
    with single_rank_parallel_state(seed=0) as hw:
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=0.1)
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=128,
            max_sequence_length=16,
        ).to(hw.device)
        tokens = torch.randint(0, 128, (2, 16), device=hw.device)
        positions = torch.arange(16, device=hw.device).expand(2, 16)
        loss = model(tokens, positions, causal_attention_mask(16, hw.device), labels=tokens.roll(-1, 1))
        loss.mean().backward()
        assert all(p.grad is not None and p.device.type == "cuda" for p in model.parameters())
