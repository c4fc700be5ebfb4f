import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.trainers.packing_guard import PackingLeakError, check_packing_safe, packing_leak

register_cpu_ci(est_time=11, suite="stage-a-cpu")


def _tiny_qwen35():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=128,
    )
    return Qwen3_5ForCausalLM(config)


def test_unpatched_gdn_model_is_refused_naming_the_fix():
    model = _tiny_qwen35()  # built without prepare_model: the packing patch is not applied
    assert packing_leak(model) > 1e-3
    with pytest.raises(PackingLeakError) as info:
        check_packing_safe(model, packing=True)
    message = str(info.value)
    assert "Gated DeltaNet" in message and "miles[qwen35]" in message and "trainer.packing=false" in message
    assert check_packing_safe(model, packing=False) is None  # unpacked rows cannot leak
    with pytest.raises(PackingLeakError, match=r"Qwen3_5GatedDeltaNet.*no model patch applied"):
        check_packing_safe(model, packing=True, applied={"other-patch": ["some.OtherClass"]})


def test_attention_only_models_are_not_probed():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert check_packing_safe(model, packing=True) is None


def test_patched_gdn_model_passes():
    from miles_core.plugins import get_plugin_manager

    if not get_plugin_manager().contributions("patches"):
        pytest.skip("no model patch installed (miles-qwen35 provides the GDN packing patch)")
    from miles_core.patches import prepare_model

    model = _tiny_qwen35()
    report = prepare_model(model)
    leak = check_packing_safe(model, packing=True, applied=report.applied)
    assert leak is not None and leak <= 1e-4
