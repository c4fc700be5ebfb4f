"""The cpu backend makes megatron-core run on CPU: a tiny GPTModel trains through it."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError, MilesError
from miles_core.hardware import activate, reset
from miles_core.hardware.base import ENV_OVERRIDE, FixReport
from miles_core.hardware.cpu import CpuBackend
from miles_core.hardware.megatron_cpu import MegatronCpuFixes
from miles_core.hardware.megatron_state import causal_attention_mask, single_rank_parallel_state
from miles_core.testing.hardware import cpu_only_torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer

register_cpu_ci(est_time=12, suite="stage-a-cpu")

SEQ, BATCH, VOCAB = 8, 2, 64


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu backend on any host: a GPU host's detection selects its GPU's backend."""
    monkeypatch.setenv(ENV_OVERRIDE, "cpu")


def train_step(seed: int, mtp_num_layers: int | None = None) -> tuple[float, GPTModel]:
    """One forward+backward of a tiny GPTModel with dropout (so the RNG tracker forks)."""
    with single_rank_parallel_state(seed=seed) as hw:
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            use_cpu_initialization=True,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            mtp_num_layers=mtp_num_layers,
        )
        layer_spec = get_gpt_layer_local_spec()
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            mtp_block_spec=(
                get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
                if mtp_num_layers
                else None
            ),
        ).to(hw.device)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        loss = model(tokens, positions, causal_attention_mask(SEQ, hw.device), labels=tokens.roll(-1, 1))
        loss.mean().backward()
        return loss.mean().item(), model


@pytest.mark.parametrize("mtp_num_layers", [None, 1], ids=["gpt", "gpt+mtp"])
def test_tiny_gpt_model_trains_on_cpu_through_the_backend(miles_pm_factory, mtp_num_layers) -> None:
    hardware = activate(miles_pm_factory(builtins=True))
    assert hardware.name == "cpu"
    with pytest.raises(KeyError):  # activation alone leaves megatron alone: a job must prepare it
        hardware.fix("megatron-cpu")
    hardware.prepare("megatron")
    assert hardware.fix("megatron-cpu").status == "applied"

    loss, model = train_step(seed=3, mtp_num_layers=mtp_num_layers)
    params = list(model.parameters())
    assert all(p.device.type == "cpu" for p in params)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)
    assert torch.isfinite(torch.tensor(loss))
    assert train_step(seed=3, mtp_num_layers=mtp_num_layers)[0] == loss, "the helper seeds every generator"
    assert train_step(seed=4, mtp_num_layers=mtp_num_layers)[0] != loss
    assert not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()


@cpu_only_torch  # the failures asserted are a CPU-only build's
def test_without_the_fixes_megatron_cannot_run_on_cpu(miles_pm_factory) -> None:
    activate(miles_pm_factory(builtins=True)).prepare("megatron")
    reset()  # reverts the fixes: the negative control
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        GlobalMemoryBuffer().get_tensor((2,), torch.float32, "probe")
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        megatron_random.CudaRNGStatesTracker().add("probe", 1)
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        torch.cuda.synchronize()
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        MegatronCpuFixes().verify()


@cpu_only_torch  # the failures asserted are a CPU-only build's
def test_verification_notices_a_fix_undone_behind_its_back(miles_pm_factory, monkeypatch) -> None:
    megatrons_fork = megatron_random.CudaRNGStatesTracker.__dict__["fork"]
    activate(miles_pm_factory(builtins=True)).prepare("megatron")
    MegatronCpuFixes().verify()  # verification observes behaviour, whoever applied the fixes
    with monkeypatch.context() as patch:
        patch.setattr(megatron_random.CudaRNGStatesTracker, "fork", megatrons_fork)
        with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
            MegatronCpuFixes().verify()


@cpu_only_torch  # the failures asserted are a CPU-only build's
def test_a_fix_that_does_not_take_fails_preparation_naming_the_plugin(miles_pm_factory, monkeypatch) -> None:
    monkeypatch.setattr(MegatronCpuFixes, "apply", lambda self: FixReport("megatron-cpu", "applied", "did nothing"))
    hardware = activate(miles_pm_factory(builtins=True))
    with pytest.raises(
        ActivationError,
        match=r"'core-hardware' \(miles .*\): hardware 'cpu' failed verification: AssertionError: Torch not compiled with CUDA",
    ):
        hardware.prepare("megatron")
    assert "megatron" not in hardware.prepared


@cpu_only_torch  # the failures asserted are a CPU-only build's
def test_fixes_are_not_needed_without_megatron(monkeypatch) -> None:
    monkeypatch.setattr("miles_core.hardware.megatron_cpu.megatron_installed", lambda: False)
    backend = CpuBackend()
    assert [(r.name, r.status) for r in backend.prepare("megatron")] == [("megatron-cpu", "not-needed")]
    with pytest.raises(AssertionError):
        torch.cuda.current_device()


def test_the_parallel_state_helper_refuses_to_nest(miles_pm_factory) -> None:
    activate(miles_pm_factory(builtins=True))
    with (
        single_rank_parallel_state(),
        pytest.raises(MilesError, match="already initialised"),
        single_rank_parallel_state(),
    ):
        pass
    assert not parallel_state.model_parallel_is_initialized()


def test_mtp_losses_are_read_where_this_megatron_core_records_them(miles_pm_factory) -> None:
    from miles_core.hardware.megatron_state import clear_mtp_loss_records, mtp_loss_sums

    activate(miles_pm_factory(builtins=True))
    clear_mtp_loss_records()
    assert mtp_loss_sums() is None
    train_step(seed=3, mtp_num_layers=2)
    first = mtp_loss_sums()
    assert first is not None and tuple(first.shape) == (2,) and bool((first > 0).all()), first
    first = first.clone()
    train_step(seed=3, mtp_num_layers=2)  # the same forward again: its losses add up
    assert torch.allclose(mtp_loss_sums(), 2 * first)
    clear_mtp_loss_records()
    assert mtp_loss_sums() is None


@pytest.mark.parametrize("api, key", [("save_loss_to_tracker", "values"), ("save_metrics_to_tracker", "loss_values")])
def test_each_release_layout_of_the_mtp_records_is_read(monkeypatch, api: str, key: str) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from miles_core.hardware.megatron_state import clear_mtp_loss_records, mtp_loss_sums

    for name in ("save_loss_to_tracker", "save_metrics_to_tracker"):
        monkeypatch.delattr(MTPLossLoggingHelper, name, raising=False)
    monkeypatch.setattr(MTPLossLoggingHelper, api, staticmethod(lambda *args, **kwargs: None), raising=False)
    monkeypatch.setattr(MTPLossLoggingHelper, "tracker", {key: torch.tensor([0.5, 0.25])})
    assert mtp_loss_sums().tolist() == [0.5, 0.25]
    clear_mtp_loss_records()
    assert MTPLossLoggingHelper.tracker == {}


def test_an_unknown_mtp_records_layout_is_an_error(monkeypatch) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from miles_core.hardware.megatron_state import mtp_loss_sums

    for name in ("save_loss_to_tracker", "save_metrics_to_tracker"):
        monkeypatch.delattr(MTPLossLoggingHelper, name, raising=False)
    with pytest.raises(MilesError, match="where it records MTP losses is unknown"):
        mtp_loss_sums()
