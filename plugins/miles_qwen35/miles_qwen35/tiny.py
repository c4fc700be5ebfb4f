"""Tiny random models of every supported architecture: one GDN layer, one attention layer.

Used by this plugin's tests and by ``miles doctor`` to prove the patch on each architecture.
"""

from __future__ import annotations

from typing import Any

#: supported architecture -> the model_type of its text-only causal LM
TEXT_MODEL_TYPES = {
    "lara_mini": "lara_mini",
    "olmo_hybrid": "olmo_hybrid",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_next": "qwen3_next",
}

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    # the Gated DeltaNet shapes of the engine's tiny preset: `miles doctor` on a GPU runs both, and
    # fla compiles its Triton kernels once per shape (most of a fresh machine's first doctor run)
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[TEXT_MODEL_TYPES[arch]](**{**TINY_CONFIG, **overrides})


def tiny_model(arch: str, *, seed: int = 0, device: str = "cpu", **overrides: Any) -> Any:
    """A float32 ``AutoModelForCausalLM`` of ``arch`` with random weights from ``seed``, on ``device``.

    On a machine with fla installed, an unprepared model's Gated DeltaNet layers run fla's Triton
    kernels, which take CUDA tensors only; ``miles doctor`` builds its examples on
    :func:`~miles_core.hardware.gdn.gdn_model_device` for that reason.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).float()
    return model.to(device)
