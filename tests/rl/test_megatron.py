"""The same loop with the megatron trainer backend (megatron-core GPTModel on the cpu backend),
with and without multi-token prediction."""

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.config import load_config
from miles_core.rl.loop import train

register_cpu_ci(est_time=14, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

pytest.importorskip("megatron.core")
pytest.importorskip("miles_core.hardware.megatron_state")


@pytest.fixture(autouse=True)
def cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron on the host needs the cpu backend's fixes: on a GPU host it is chosen explicitly
    (with that host's own backend, preflight refuses megatron on a cpu trainer)."""
    from miles_core.hardware.base import ENV_OVERRIDE

    monkeypatch.setenv(ENV_OVERRIDE, "cpu")


def test_weight_conversion_round_trips(char_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles_core.rl.trainers.megatron import hf_to_megatron, megatron_to_hf

    hf = AutoConfig.from_pretrained(char_model_dir)
    state = load_file(char_model_dir / "model.safetensors")
    back = megatron_to_hf(hf_to_megatron(state, hf), hf)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("mtp_layers", [0, 1])
def test_megatron_backend_trains_token_exactly(miles_pm_factory, direct_overrides, tmp_path, mtp_layers):
    config = load_config(overrides=[direct_overrides, {
        "trainer": {"backend": "megatron", "mtp_num_layers": mtp_layers},
        "run": {"steps": 3, "checkpoint_every": 2, "out_dir": str(tmp_path / f"run{mtp_layers}")},
    }])
    import miles_mtp.plugin

    pm = miles_pm_factory(builtins=True, plugins=[("miles-mtp", miles_mtp.plugin)])
    result = train(config, pm)
    assert result.report["backend"] == "megatron" and result.report["mtp_num_layers"] == mtp_layers
    # the MTP loss is each row's own: with it every sample is laid out, repeats included
    assert result.report["merge_duplicates"] is (mtp_layers == 0)
    if mtp_layers:  # the label adapter was installed and verified on this GPTModel
        assert result.report["patches"]["mtp-labels"], result.report["patches"]
    for record in result.records:
        # the engine serves the Hugging Face model: converted weights give the same log-probs
        assert record["logprob_mismatch_max"] <= 1e-4
    assert [r["rollout_weight_versions"] for r in result.records] == [["0"], ["step-1"], ["step-2"]]
    if mtp_layers:
        losses = [r["mtp_loss_depth1"] for r in result.records]
        assert all(v > 0 for v in losses)
    checkpoint = tmp_path / f"run{mtp_layers}" / "checkpoints" / "step_000002" / "model"
    assert {"config.json", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}


def test_mtp_needs_the_label_contract(miles_pm_factory, direct_overrides, tmp_path):
    from miles_core.errors import ConfigError

    config = load_config(overrides=[direct_overrides, {"trainer": {"backend": "megatron", "mtp_num_layers": 1}}])
    with pytest.raises(ConfigError, match="needs the MTP label contract: install miles-mtp"):
        train(config, miles_pm_factory(builtins=True))  # miles-mtp not registered
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_megatron_backend_refuses_other_architectures(tmp_path):
    from miles_core.errors import ConfigError
    from miles_core.rl.algorithms.builtin import GRPO
    from miles_core.rl.trainers.megatron import MegatronTrainer

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    config = load_config(overrides=[{"trainer": {"backend": "megatron"}}])
    with pytest.raises(ConfigError, match=r"supports llama models.*'gpt2'"):
        MegatronTrainer(tmp_path, config, torch.device("cpu"), GRPO())
