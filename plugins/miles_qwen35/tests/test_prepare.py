"""prepare_model with miles-qwen35: the report, escaped classes, rebound kernels, coverage errors."""

from __future__ import annotations

import types

import pytest
import torch
from miles_qwen35 import coverage
from miles_qwen35.coverage import Architecture, gdn_architectures
from miles_qwen35.patch import GatedDeltaNetPackingPatch, is_gated_deltanet
from miles_qwen35.tiny import TINY_CONFIG, tiny_config, tiny_model

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError, PluginLoadError
from miles_core.patches import PatchVerificationError, prepare_model
from miles_core.patches.hf_functions import defined_function
from miles_core.patches.packing import PACKING_KWARG, PackedSequences, PackingError

register_cpu_ci(est_time=9, suite="stage-a-cpu")


def gdn_of(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if is_gated_deltanet(m))


def test_the_report_names_the_classes_per_architecture(qwen_pm, arch: str) -> None:
    model = tiny_model(arch)
    report = prepare_model(model)
    entry = report["gdn-packing"]
    gdn_class = type(gdn_of(model))
    expected = f"{gdn_class.__module__}.{gdn_class.__qualname__}"
    assert entry.groups == {arch: (expected,)} and entry.classes == (expected,)
    assert (entry.plugin, entry.distribution) == ("miles-qwen35", "miles-qwen35")
    assert entry.probe.passed and entry.probe.max_abs_diff <= entry.probe.tolerance
    assert entry.kernels == {"fla.ops.gated_delta_rule": "not used on cpu"}
    assert qwen_pm.fingerprint()["applied_patches"]["gdn-packing"] == [expected]


def test_a_dense_attention_only_model_is_not_matched(qwen_pm) -> None:
    model = tiny_model("qwen3_5", layer_types=["full_attention", "full_attention"])
    report = prepare_model(model)
    assert report.patches == () and report.not_matched == ("gdn-packing",)


def test_the_multimodal_config_matches_through_its_text_config() -> None:
    from transformers import Qwen3_5Config

    patch = GatedDeltaNetPackingPatch()
    assert patch.matches(Qwen3_5Config(text_config=tiny_config("qwen3_5").to_dict()))
    assert not patch.matches(None)


def test_a_subclass_that_escaped_patching_is_named(qwen_pm) -> None:
    model = tiny_model("qwen3_5")
    layer = gdn_of(model)

    class EscapedGatedDeltaNet(type(layer)):
        def forward(self, hidden_states, **kwargs):  # a copy that calls the kernels its own way
            return self.out_proj(torch.zeros(*hidden_states.shape[:2], self.value_dim))

    layer.__class__ = EscapedGatedDeltaNet
    with pytest.raises(ActivationError) as info:
        prepare_model(model)
    message = str(info.value)
    assert "'miles-qwen35' (miles-qwen35" in message and "'gdn-packing'" in message
    assert "EscapedGatedDeltaNet escaped patching" in message and "model.layers.0.linear_attn" in message
    assert qwen_pm.get("miles-qwen35").status == "ok"  # only this model is refused


def test_a_kernel_rebound_after_patching_fails_verification(qwen_pm, monkeypatch) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    prepare_model(tiny_model("qwen3_5"))
    dispatcher = modeling_qwen3_5.causal_conv1d_fn
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", dispatcher.__miles_gdn_kernel__)
    with pytest.raises(ActivationError, match="causal_conv1d_fn is no longer the packing dispatcher"):
        prepare_model(tiny_model("qwen3_5"))


def test_a_packed_forward_that_skips_the_kernels_fails_loudly(qwen_pm, monkeypatch) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    model = tiny_model("qwen3_5")
    prepare_model(model)
    dispatcher = modeling_qwen3_5.torch_chunk_gated_delta_rule
    # a kernel that is not the dispatcher: transformers' torch implementation (the name's own
    # binding may be fla's Triton kernel, which would fail on these CPU tensors first)
    torch_kernel = defined_function(dispatcher.__miles_gdn_kernel__, "torch_chunk_gated_delta_rule")
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", torch_kernel)
    ctx = PackedSequences.from_lengths([3, 5])
    with pytest.raises(PackingError, match="without calling torch_chunk_gated_delta_rule"):
        gdn_of(model)(torch.randn(1, 8, 32), **{PACKING_KWARG: ctx})


def test_a_packed_layer_refuses_a_mismatched_batch(qwen_pm) -> None:
    model = tiny_model("qwen3_5")
    prepare_model(model)
    with pytest.raises(PackingError, match=r"shape \(1, 6, 32\) but the packed batch is 1 x 8"):
        gdn_of(model)(torch.randn(1, 6, 32), **{PACKING_KWARG: PackedSequences.from_lengths([3, 5])})


@pytest.mark.skipif(
    "qwen4_exp" not in {a.name for a in gdn_architectures()}, reason="transformers has no qwen4_exp"
)
def test_an_unsupported_architecture_is_refused_with_the_reason(qwen_pm) -> None:
    from miles_qwen35.tiny import TINY_CONFIG
    from transformers.models.qwen4_exp import configuration_qwen4_exp, modeling_qwen4_exp

    config = configuration_qwen4_exp.Qwen4ExpTextConfig(**TINY_CONFIG)
    model = torch.nn.Module()
    model.config = config
    model.linear_attn = modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet(config, 0)
    with pytest.raises(ActivationError, match=r"qwen4_exp architecture is unsupported: .*PLELayer"):
        prepare_model(model)


def test_every_gdn_architecture_of_transformers_is_classified() -> None:
    found = {a.name: a.status for a in gdn_architectures()}
    assert {"qwen3_5", "qwen3_5_moe", "qwen3_next"} <= {n for n, s in found.items() if s == "supported"}
    assert "unknown" not in found.values()
    assert coverage.environment_problems() == []


def test_an_unknown_gdn_architecture_is_a_registration_error(qwen_pm, monkeypatch) -> None:
    new = Architecture("qwen9_gdn", "transformers.models.qwen9_gdn.modeling_qwen9_gdn", "unknown", "new")
    monkeypatch.setattr(coverage, "gdn_architectures", lambda: (*gdn_architectures(), new))
    with pytest.raises(ActivationError, match=r"'qwen9_gdn'.*neither patches nor declares unsupported"):
        prepare_model(tiny_model("qwen3_5"))
    assert qwen_pm.get("miles-qwen35").status == "broken"
    with pytest.raises(PluginLoadError, match="miles-qwen35"):
        prepare_model(tiny_model("qwen3_5", layer_types=["full_attention", "full_attention"]))


def test_a_supported_architecture_whose_layer_no_longer_calls_the_kernels_is_a_registration_error(
    monkeypatch,
) -> None:
    class Renamed(torch.nn.Module):
        def forward(self, hidden_states):
            return torch_chunk_gated_delta_rule(hidden_states)  # noqa: F821 -- never run

    monkeypatch.setattr(coverage, "gdn_classes", lambda arch: [Renamed] if arch.name == "qwen3_5" else [])
    problems = coverage.environment_problems()
    assert any("Renamed.forward does not call causal_conv1d_fn" in p for p in problems)
    assert any("modeling_qwen3_5_moe no longer defines a class that runs" in p for p in problems)


#: a modeling module whose GDN layers reach the convolution kernel through a function of the module,
#: as transformers >= 5.25's do (``causal_conv1d_forward``), or through one that convolves by itself
HELPER_MODULE = """
import torch


def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
    return x


def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
    return value, None


def conv_through_the_kernel(x, cache):
    return causal_conv1d_fn(x, None)


def conv_by_itself(x, cache):
    return x


class ThroughHelperGatedDeltaNet(torch.nn.Module):
    def forward(self, x):
        return torch_chunk_gated_delta_rule(conv_through_the_kernel(x, None), x, x, x, x)[0]


class OwnConvGatedDeltaNet(torch.nn.Module):
    def forward(self, x):
        return torch_chunk_gated_delta_rule(conv_by_itself(x, None), x, x, x, x)[0]
"""


def test_a_kernel_reached_through_a_function_of_the_layers_module_is_patchable() -> None:
    from miles_qwen35.dispatch import unpatchable_reason

    module = types.ModuleType("modeling_helper_gdn")
    exec(compile(HELPER_MODULE, "<modeling_helper_gdn>", "exec"), module.__dict__)
    assert unpatchable_reason(module.ThroughHelperGatedDeltaNet) is None
    reason = unpatchable_reason(module.OwnConvGatedDeltaNet)
    assert reason is not None and "OwnConvGatedDeltaNet.forward does not call causal_conv1d_fn" in reason


def test_a_conv_helper_that_stops_calling_the_kernel_fails_a_packed_forward_loudly(qwen_pm, monkeypatch) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    if not hasattr(modeling_qwen3_5, "causal_conv1d_forward"):
        pytest.skip("this transformers' GDN layer calls causal_conv1d_fn itself (releases before 5.25)")
    model = tiny_model("qwen3_5")
    prepare_model(model)
    ctx = PackedSequences.from_lengths([3, 5])
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    gdn_of(model)(x, **{PACKING_KWARG: ctx})  # through transformers' own helper: accepted

    def convolves_by_itself(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
        # what a replacement of the helper (kernels.kernelize may install one) can do
        return torch.nn.functional.silu(conv1d(hidden_states)[..., : hidden_states.shape[-1]])

    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_forward", convolves_by_itself)
    with pytest.raises(PackingError, match="without calling causal_conv1d_fn"):
        gdn_of(model)(x, **{PACKING_KWARG: ctx})


def test_a_model_prepared_without_the_plugin_keeps_mixing_documents(qwen_pm, miles_pm_factory, docs) -> None:
    prepare_model(tiny_model("qwen3_5"))  # the classes are patched for the whole process now
    model = tiny_model("qwen3_5").eval()
    report = prepare_model(model, pm=miles_pm_factory())  # a manager without miles-qwen35
    assert report.patches == () and not report.packing_scope
    with torch.no_grad():
        packed = model(docs.ids, position_ids=docs.position_ids).logits
        alone = model(docs.alone[1]).logits
    assert (packed[:, docs.slices[1]] - alone).abs().max().item() > 1e-3


def test_a_layer_swapped_in_after_preparing_fails_verification(qwen_pm) -> None:
    model = tiny_model("qwen3_5", num_hidden_layers=3, layer_types=["linear_attention"] * 2 + ["full_attention"])
    prepare_model(model)
    model.model.layers[1].linear_attn = type(gdn_of(model))(model.config, 1)
    with pytest.raises(PatchVerificationError, match=r"at model\.layers\.1\.linear_attn was not enabled"):
        GatedDeltaNetPackingPatch().verify(model)
    prepare_model(model)  # preparing again covers it


def test_tiny_models_share_the_engine_tiny_presets_gdn_shapes() -> None:
    """`miles doctor` runs this plugin's tiny models and the engine's tiny preset; on a GPU fla
    compiles a Triton kernel per shape: with one shape for both, each kernel compiles once."""
    from miles_core.engine.presets import get_preset

    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    engine = get_preset("tiny").text_config
    assert {k: TINY_CONFIG[k] for k in keys} == {k: engine[k] for k in keys}
