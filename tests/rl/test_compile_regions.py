"""trainer.compile: regional torch.compile of norms and MLPs (miles_core.rl.trainers.compile).

The fused kernels themselves are inductor's and are measured on a GPU (benchmarks/gdn_packing.py
--compile); here dynamo traces the same regions with the aot_eager backend (no C++ toolchain, same
numerics). It must leave the state dict's names alone, keep packed forwards and their gradients
equal to eager, and refuse a backend it does not apply to.
"""

from __future__ import annotations

import pytest
import torch
from miles_qwen35.tiny import tiny_model

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.patches.packing import packed_position_ids
from miles_core.rl.config import load_config
from miles_core.rl.trainers.compile import compile_regions
from miles_core.testing import isolated_plugin_manager

register_cpu_ci(est_time=12, suite="stage-a-cpu")


def _packed_loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lengths = [9, 30, 5]
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 128, (1, sum(lengths)), generator=generator)
    model.zero_grad(set_to_none=True)
    out = model(ids, position_ids=packed_position_ids(lengths), labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_regions_train_like_eager() -> None:
    import miles_qwen35.plugin

    from miles_core.patches import prepare_model

    torch._dynamo.reset()
    with isolated_plugin_manager([("miles-qwen35", miles_qwen35.plugin)]):
        eager, compiled = tiny_model("qwen3_5").train(), tiny_model("qwen3_5").train()
        prepare_model(eager)
        prepare_model(compiled)
        keys = list(compiled.state_dict())
        names = compile_regions(compiled, backend="aot_eager")
        assert {n.rsplit(".", 1)[1] for n in names} == {"Qwen3_5MLP", "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"}
        assert list(compiled.state_dict()) == keys
        assert all(
            m._compiled_call_impl is not None for m in compiled.modules() if type(m).__name__.endswith("MLP")
        )
        logits, grads = _packed_loss_and_grads(eager)
        c_logits, c_grads = _packed_loss_and_grads(compiled)
    assert (logits - c_logits).abs().max().item() <= 1e-6
    assert grads.keys() == c_grads.keys()
    assert max((grads[n] - c_grads[n]).abs().max().item() for n in grads) <= 1e-6


def test_compile_is_an_hf_setting() -> None:
    assert load_config("tiny", overrides=["trainer.compile=true"]).trainer.compile
    with pytest.raises(ConfigError, match=r"trainer\.compile needs trainer\.backend = 'hf'"):
        load_config("tiny", overrides=['trainer.backend="megatron"', "trainer.compile=true"])
