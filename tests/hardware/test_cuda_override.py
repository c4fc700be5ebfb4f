"""``MILES_HARDWARE=cuda`` overrides detection, so the cuda backend's verify() must prove CUDA works:
on a CPU-only torch both ``miles doctor``'s hardware check and a run's activation fail, naming the
variable; on a machine with a CUDA build and a GPU (simulated) it passes."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError
from miles_core.hardware import activate
from miles_core.hardware import doctor as hardware_doctor
from miles_core.hardware.cuda import CudaBackend

register_cpu_ci(est_time=4, suite="stage-a-cpu")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: CUDA works here")


def test_the_override_on_a_cpu_only_torch_fails_activation(miles_pm_factory, monkeypatch):
    monkeypatch.setenv("MILES_HARDWARE", "cuda")
    with pytest.raises(ActivationError, match=r"CUDA is not usable here \(MILES_HARDWARE=cuda\): torch .* build") as err:
        activate(miles_pm_factory(builtins=True))
    assert err.value.exit_code == 2  # forced by the environment: bad input, every command exits 2


def test_doctor_fails_its_required_hardware_check(miles_pm_factory, monkeypatch):
    monkeypatch.setenv("MILES_HARDWARE", "cuda")
    results = hardware_doctor.check(miles_pm_factory(builtins=True))
    backend = next(r for r in results if r.item == "backend")
    assert backend.status == "fail" and backend.required and "MILES_HARDWARE=cuda" in backend.detail


def test_verify_passes_where_cuda_works(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    CudaBackend().verify()  # the negative control: the same check accepts a working CUDA build
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        CudaBackend().verify()
