"""Test kit for hardware backends: a conformance check and an isolation fixture.

Plugin authors use it from their tests::

    # conftest.py: every test starts and ends with no active backend, MILES_HARDWARE unset
    from miles_core.testing.hardware import no_active_hardware  # noqa: F401

    # test_backend.py
    from miles_core.testing.hardware import assert_backend_conforms

    def test_my_backend_conforms():
        assert_backend_conforms(MyBackend())

It imports torch (device and collective names are checked against it) and runs the backend's
``apply -> verify -> revert`` cycle (verify may refuse a machine the backend does not claim), so call
it where the backend's dependencies are installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles_core.errors import ConfigError
from miles_core.hardware.activation import reset
from miles_core.hardware.base import (
    CAPABILITIES,
    ENV_OVERRIDE,
    WORKER_ROLES,
    CheckpointIOPolicy,
    Detection,
    FixReport,
    HardwareBackend,
)


def _gpu_build() -> bool:
    import torch

    return bool(torch.version.cuda or torch.version.hip)


#: marks a test of what a CPU-only torch build (the one CI installs) detects and selects; a CUDA or
#: HIP build of torch reports its own build, and on a GPU machine another backend is selected
cpu_only_torch = pytest.mark.skipif(_gpu_build(), reason="checks a CPU-only torch build; this torch is a GPU build")


@pytest.fixture(autouse=True)
def no_active_hardware(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Unset ``MILES_HARDWARE`` and revert any active backend before and after the test."""
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    reset()
    yield
    reset()


def assert_backend_conforms(backend: HardwareBackend) -> None:
    import torch
    import torch.distributed as dist

    assert isinstance(backend, HardwareBackend)
    assert isinstance(backend.name, str) and backend.name
    torch.device(backend.device_type)
    assert backend.distributed_backend in dist.Backend.backend_list, backend.distributed_backend
    assert isinstance(backend.checkpoint_io, CheckpointIOPolicy)
    assert isinstance(backend.ci_hardware, str) and backend.ci_hardware

    assert backend.capabilities <= CAPABILITIES.keys()
    for capability in CAPABILITIES:
        assert backend.supports(capability) == (capability in backend.capabilities)
    with pytest.raises(ConfigError, match="unknown hardware capability"):
        backend.supports("no-such-capability")

    for role in WORKER_ROLES:
        env = backend.worker_env(role)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        assert env[ENV_OVERRIDE] == backend.name
        for var in backend.ray_noset_envs:
            assert env[var] == "1"
    with pytest.raises(ConfigError, match="worker role"):
        backend.worker_env("no-such-role")

    detection = backend.detect()
    assert isinstance(detection, Detection) and detection.reason
    assert backend.device_count() >= 0

    try:
        reports = backend.apply()
        assert all(isinstance(r, FixReport) for r in reports)
        assert backend.apply() == reports, "apply() must be idempotent"
        if detection.claimed:
            backend.verify()
        else:  # selected by MILES_HARDWARE on a machine it does not claim: it may refuse, by name
            try:
                backend.verify()
            except Exception as exc:
                assert str(exc), "verify() refused this machine without saying why"
    finally:
        backend.revert()
