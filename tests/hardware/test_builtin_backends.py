"""The built-in cpu and cuda backends: conformance, detection, worker env, capabilities."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.hardware import activate
from miles_core.hardware.base import parse_visible_devices
from miles_core.hardware.cpu import CpuBackend
from miles_core.hardware.cuda import CudaBackend
from miles_core.testing.hardware import assert_backend_conforms, cpu_only_torch

register_cpu_ci(est_time=4, suite="stage-a-cpu")


@pytest.fixture
def simulated_cuda_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


@pytest.mark.parametrize("backend", [CpuBackend(), CudaBackend()], ids=lambda b: b.name)
def test_builtin_backends_conform(backend) -> None:
    assert_backend_conforms(backend)


def test_worker_env_snapshots() -> None:
    cpu, cuda = CpuBackend(), CudaBackend()
    for role in ("train", "rollout"):
        assert cpu.worker_env(role) == {"MILES_HARDWARE": "cpu"}
        assert cuda.worker_env(role) == {
            "MILES_HARDWARE": "cuda",
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        }


@cpu_only_torch
def test_this_cpu_machine_selects_cpu_with_its_reason(miles_pm_factory) -> None:
    hardware = activate(miles_pm_factory(builtins=True))
    assert hardware.name == "cpu"
    assert hardware.selection.selected_by == "detection"
    assert hardware.selection.reason == f"torch {torch.__version__} (CPU-only build) sees no GPU"
    assert hardware.device == torch.device("cpu")
    assert hardware.distributed_backend == "gloo"
    declined = {c.contribution.name: c.detection for c in hardware.selection.candidates}["cuda"]
    assert not declined.claimed and "is not a CUDA build" in declined.reason


def test_a_cuda_machine_selects_cuda_and_cpu_declines(simulated_cuda_machine) -> None:
    assert CudaBackend().detect().claimed
    assert CudaBackend().detect().reason == f"torch {torch.__version__} (CUDA 12.8 build) sees 8 GPU(s)"
    assert not CpuBackend().detect().claimed


def test_a_cuda_build_without_gpus_falls_back_to_cpu(simulated_cuda_machine, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not CudaBackend().detect().claimed
    assert CpuBackend().detect().reason == f"torch {torch.__version__} (CUDA 12.8 build) sees no GPU"


def test_capability_claims_match_what_torch_does_on_cpu() -> None:
    a = torch.ones(2, 2, dtype=torch.bfloat16)
    assert not CpuBackend().supports("mm_out_dtype_fp32")
    with pytest.raises(NotImplementedError):
        torch.mm(a, a, out_dtype=torch.float32)


def test_an_unparseable_visible_devices_variable_fails_verification(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0;1")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='0;1': '0;1' is not a device index"):
        CudaBackend().verify()


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("0,1", ["0", "1"]), ("", []), ("GPU-8f2a-11, MIG-3", ["GPU-8f2a-11", "MIG-3"]), ("-1", ["-1"])],
)
def test_visible_devices_parsing(value: str, parsed: list[str]) -> None:
    assert parse_visible_devices("CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": value}) == parsed
    assert parse_visible_devices("CUDA_VISIBLE_DEVICES", {}) is None


def test_each_builtin_backend_names_a_registered_ci_kind(miles_pm_factory) -> None:
    kinds = {c.name for c in miles_pm_factory(builtins=True).contributions("ci")}
    assert {CpuBackend.ci_hardware, CudaBackend.ci_hardware} <= kinds


def test_the_capabilities_table_of_the_docs_lists_every_capability_and_each_backends_claims() -> None:
    from pathlib import Path

    from miles_core.hardware.base import CAPABILITIES

    text = (Path(__file__).resolve().parents[2] / "docs" / "hardware.md").read_text()
    section = text.split("### Capabilities", 1)[1].split("\n### ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    table = {cells[0].strip().strip("`"): [c.strip() for c in cells[2:]] for cells in rows}
    assert table.keys() == CAPABILITIES.keys()
    backends = [CpuBackend, CudaBackend]
    try:
        from miles_rocm.backend import RocmBackend  # the plugin's column, where it is installed
    except ModuleNotFoundError:
        pass
    else:
        backends.append(RocmBackend)
    for column, backend in enumerate(backends):
        claimed = {name for name, marks in table.items() if marks[column] == "✓"}
        assert claimed == backend.capabilities, backend.name
