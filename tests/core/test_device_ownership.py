"""The hardware backend is the one place that knows the device: no device-runtime call outside
miles_core/hardware/, and the decisions that depend on the device ask the active backend."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=4, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2] / "miles_core"
#: files that may name torch.cuda: the backends, and a CI template string run on GPU runners
ALLOWED = {"hardware", "ci/base.py"}


def test_no_torch_cuda_outside_the_hardware_backends() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in ALLOWED or rel in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\.cuda\b|\bdevice\.type\s*[!=]=\s*[\"']cuda[\"']", line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


@contextlib.contextmanager
def _active_backend(miles_pm, monkeypatch, name: str, device_type: str, collectives: str) -> Iterator[None]:
    """Backend ``name`` active for the block: the cpu backend (detected and verified as it is)
    computing on ``device_type`` over ``collectives``."""
    from miles_core.hardware import reset
    from miles_core.hardware.cpu import CpuBackend
    from miles_core.testing import plugin_module

    backend = type("Backend", (CpuBackend,), {"name": name, "device_type": device_type,
                                              "distributed_backend": collectives})
    miles_pm.register(plugin_module(f"hw-{name}", miles_hardware_backends=lambda: [backend()]), name=f"hw-{name}")
    monkeypatch.setenv("MILES_HARDWARE", name)
    reset()
    try:
        yield
    finally:
        reset()


def _rank_joins_over(miles_pm, monkeypatch, name: str, device_type: str, collectives: str,
                     devices: tuple[str, ...]) -> list[str]:
    """The process-group backend a rank on each of ``devices`` joins over, with that backend active."""
    import torch
    import torch.distributed as dist

    from miles_core.rl.trainers.fsdp import init_rank

    joined: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr("miles_core.rl.trainers.fsdp.bind_device", lambda device: None)  # no such device here
    with _active_backend(miles_pm, monkeypatch, name, device_type, collectives):
        for device in devices:
            init_rank(0, 1, store=None, device=torch.device(device))
    return joined


def test_fsdp_ranks_join_over_the_backends_collectives(miles_pm, monkeypatch) -> None:
    """A backend whose collectives are not gloo/nccl: the trainer's process group uses its name."""
    assert _rank_joins_over(miles_pm, monkeypatch, "cpu-mpi", "cpu", "mpi", ("cpu",)) == ["mpi"]


def test_host_ranks_under_an_accelerator_backend_join_over_gloo(miles_pm, monkeypatch) -> None:
    """``trainer.device = "cpu"`` on a GPU machine: NCCL cannot reduce host tensors, so the ranks'
    process group is gloo; ranks on the accelerator keep the backend's collectives."""
    joined = _rank_joins_over(miles_pm, monkeypatch, "fake-gpu", "cuda", "nccl", ("cpu", "cuda:1"))
    assert joined == ["gloo", "nccl"]


def test_megatron_on_the_host_of_an_accelerator_backend_is_refused_before_work(miles_pm_factory, monkeypatch) -> None:
    """megatron-core allocates on ``torch.cuda.current_device()``: only the cpu backend points it
    at the host, so ``trainer.device = "cpu"`` under another backend is refused at preflight."""
    from miles_core.errors import ConfigError
    from miles_core.rl.config import load_config
    from miles_core.rl.preflight import check_device

    miles_pm = miles_pm_factory(builtins=True)

    def config(backend: str):
        return load_config("tiny", overrides=[f'trainer.backend="{backend}"', 'trainer.device="cpu"'])

    with _active_backend(miles_pm, monkeypatch, "fake-gpu", "cuda", "nccl"):
        with pytest.raises(ConfigError, match=r"^trainer.device: trainer.backend = 'megatron' trains on the "
                                              r"selected hardware backend's device \(fake-gpu: cuda\), not 'cpu'"):
            check_device(config("megatron"), miles_pm)
        check_device(config("hf"), miles_pm)  # the hf trainer runs on the host under any backend
    with _active_backend(miles_pm, monkeypatch, "cpu-mpi", "cpu", "mpi"):
        check_device(config("megatron"), miles_pm)


def test_device_answers_on_the_host(miles_pm_factory) -> None:
    import torch

    from miles_core.errors import ConfigError
    from miles_core.hardware import devices, reset

    miles_pm_factory(builtins=True)
    reset()
    try:
        assert devices.resolve_device("auto").type in ("cpu", "cuda")
        assert devices.resolve_device("cpu", "trainer.device") == torch.device("cpu")
        assert devices.rank_device(torch.device("cpu"), 3) == torch.device("cpu")
        assert not devices.device_supports(torch.device("cpu"), "varlen_flash_attention")  # host memory
        host = {"w": torch.ones(2)}
        assert devices.to_host(host)["w"] is host["w"]  # already on the host: no copy
        if not torch.cuda.is_available():
            assert devices.device_rng_state() is None
            with pytest.raises(ConfigError, match=r"trainer.device: 'cuda' requested but CUDA is not available"):
                devices.resolve_device("cuda", "trainer.device")
    finally:
        reset()


def test_discovering_the_rl_step_concerns_stays_cheap() -> None:
    code = (
        "import sys\n"
        "from miles_core.plugins import MilesPluginManager\n"
        "from miles_core.testing.isolation import register_builtins\n"
        "pm = MilesPluginManager(); register_builtins(pm); pm.collect_all()\n"
        "assert {c.name for c in pm.contributions('trackers')} == {'jsonl', 'tensorboard', 'wandb', 'mlflow'}\n"
        "heavy = ('torch', 'transformers', 'ray', 'megatron', 'pydantic', 'wandb', 'mlflow', 'tensorboard')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
