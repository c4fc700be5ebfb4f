"""The async-checkpoint guard under a simulated HIP build, through every name of the writer."""

from __future__ import annotations

import re

import miles_rocm.plugin
import pytest
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from miles_rocm.checkpoint import WRITER_PATH, is_guarded, observe_copy_mode, verify_guard, writer_classes

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware import activate

register_cpu_ci(est_time=12, suite="stage-a-cpu")

Writer = filesystem_async.FileSystemWriterAsync


def copy_to_host(write_buckets, non_blocking):
    return [
        (
            file_name,
            key,
            (bytes_data, [(item, t.to("cpu", non_blocking=non_blocking)) for item, t in tensors]),
        )
        for file_name, key, (bytes_data, tensors) in write_buckets
    ]


def not_fixed_preload(write_buckets, non_blocking=True):
    """What megatron-core 0.16.1 does: the requested (non-blocking) copy, on every platform."""
    return copy_to_host(write_buckets, non_blocking)


def upstream_fixed_preload(write_buckets, non_blocking=True):
    """What Megatron-LM does since the fix moved upstream: blocking copies on HIP."""
    if torch.version.hip:
        non_blocking = False
    return copy_to_host(write_buckets, non_blocking)


@pytest.fixture
def hip_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43484")


def with_megatron(hardware):
    """The guard is megatron's fix: it is installed when a job prepares megatron-core."""
    hardware.prepare("megatron")
    return hardware


@pytest.fixture
def rocm(miles_pm_factory, monkeypatch):
    """Activate the ROCm backend (by override: this machine has no AMD GPU) and prepare megatron."""
    monkeypatch.setenv("MILES_HARDWARE", "rocm")
    pm = miles_pm_factory(plugins=[("miles-rocm", miles_rocm.plugin)], builtins=True)
    return lambda: with_megatron(activate(pm))


def test_activation_alone_leaves_megatron_unguarded(hip_build, miles_pm_factory, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    monkeypatch.setenv("MILES_HARDWARE", "rocm")
    hardware = activate(miles_pm_factory(plugins=[("miles-rocm", miles_rocm.plugin)], builtins=True))
    with pytest.raises(KeyError, match="checkpoint-guard"):
        hardware.fix("checkpoint-guard")
    assert not is_guarded(Writer)
    with_megatron(hardware)
    assert is_guarded(Writer) and hardware.fix("checkpoint-guard").status == "fallback"


def modes_through_every_path() -> list[str]:
    return [observe_copy_mode(cls) for cls in writer_classes().values()]


def every_path(mode: str) -> list[str]:
    return [mode] * len(writer_classes())


def rebind_in_the_torch_strategy(monkeypatch: pytest.MonkeyPatch, writer: type) -> str:
    """Make megatron's torch save strategy use ``writer``, the writer's own module left as it is;
    returns the path that now names ``writer``."""
    if hasattr(torch_strategy, "FileSystemWriterAsync"):  # bound when the module is imported (0.16)
        monkeypatch.setattr(torch_strategy, "FileSystemWriterAsync", writer)
        return "megatron.core.dist_checkpointing.strategies.torch.FileSystemWriterAsync"
    resolve = torch_strategy.get_async_strategy  # resolved when a save starts (0.19)

    def resolving(async_strategy: str = "nvrx", module: str | None = None) -> tuple:
        name, modules = resolve(async_strategy)
        modules = {**modules, "FileSystemWriterAsync": writer}
        return name, modules if module is None else modules[module]

    monkeypatch.setattr(torch_strategy, "get_async_strategy", resolving)
    return "megatron.core.dist_checkpointing.strategies.torch.get_async_strategy('mcore')"


def test_every_name_of_the_writer_is_found() -> None:
    names = writer_classes()
    # its own module's, and the torch save strategy's (an import-time name or a per-save resolution)
    assert next(iter(names)) == WRITER_PATH and len(names) >= 2, names
    assert set(names.values()) == {Writer}


def test_not_fixed_writer_gets_the_fallback_on_the_class(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    assert modes_through_every_path() == every_path("pinned-non-blocking")

    hardware = rocm()
    report = hardware.fix("checkpoint-guard")
    assert report.status == "fallback"
    assert "FileSystemWriterAsync" in report.detail
    assert modes_through_every_path() == every_path("pageable-blocking")
    assert all(is_guarded(cls) for cls in writer_classes().values())

    tensor = torch.arange(4.0)
    [(_, _, (_, [(_, copied)]))] = Writer.preload_tensors([("f", "k", ([], [("item", tensor)]))], True)
    assert torch.equal(copied, tensor), "the guard forwards the data unchanged"


def test_removing_the_fallback_brings_the_unsafe_copy_back(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    rocm().backend.revert()  # negative control: the check must see the guard gone
    assert Writer.__dict__["preload_tensors"].__func__ is not_fixed_preload
    with pytest.raises(
        RuntimeError,
        match=r"strategies.filesystem_async.FileSystemWriterAsync copies .* as pinned-non-blocking",
    ):
        verify_guard()


def test_upstream_fixed_writer_is_left_alone(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(upstream_fixed_preload))
    hardware = rocm()
    assert hardware.fix("checkpoint-guard").status == "upstream"
    assert Writer.__dict__["preload_tensors"].__func__ is upstream_fixed_preload
    assert not is_guarded(Writer)
    assert modes_through_every_path() == every_path("pageable-blocking")


def test_the_installed_megatron_is_guarded_either_way(hip_build, rocm) -> None:
    before = observe_copy_mode(Writer)
    status = rocm().fix("checkpoint-guard").status
    assert status == ("upstream" if before == "pageable-blocking" else "fallback")
    assert modes_through_every_path() == every_path("pageable-blocking")
    verify_guard()


def test_a_writer_rebound_in_one_module_is_caught_through_that_path(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    rocm()

    class RebindingWriter(Writer):  # what upstream's workaround did, in one module only
        preload_tensors = staticmethod(not_fixed_preload)

    path = rebind_in_the_torch_strategy(monkeypatch, RebindingWriter)
    with pytest.raises(RuntimeError, match=f"^{re.escape(path)} copies"):
        verify_guard()


def test_activation_guards_a_rebound_subclass_too(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))

    class RebindingWriter(Writer):
        preload_tensors = staticmethod(not_fixed_preload)

    rebind_in_the_torch_strategy(monkeypatch, RebindingWriter)
    detail = rocm().fix("checkpoint-guard").detail
    assert "filesystem_async.FileSystemWriterAsync" in detail and "RebindingWriter" in detail
    assert modes_through_every_path() == every_path("pageable-blocking")


def test_reactivation_does_not_wrap_twice(hip_build, rocm, miles_pm_factory, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    rocm()
    other = miles_pm_factory(plugins=[("miles-rocm", miles_rocm.plugin)], builtins=True)
    assert with_megatron(activate(other)).fix("checkpoint-guard").status == "fallback"
    assert Writer.preload_tensors.__wrapped__ is not_fixed_preload


def test_the_guard_does_nothing_on_a_build_that_is_not_hip(rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))
    rocm()
    calls = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(kw) or self.clone())
    Writer.preload_tensors([("f", "k", ([], [("item", torch.ones(1))]))], True)
    assert calls == [{"non_blocking": True}]


def resolving_per_save(nvrx_writer: type | None):
    """A ``get_async_strategy`` as releases that resolve the writer per save have it (0.19); with
    ``nvrx_writer=None`` nvidia-resiliency-ext is not installed."""

    def get_async_strategy(async_strategy: str = "nvrx", module: str | None = None) -> tuple:
        if async_strategy == "nvrx" and nvrx_writer is None:
            raise ModuleNotFoundError("A compatible `nvidia-resiliency-ext` installation is required")
        modules = {"FileSystemWriterAsync": nvrx_writer if async_strategy == "nvrx" else Writer}
        return async_strategy, modules if module is None else modules[module]

    return get_async_strategy


def test_the_writer_of_each_async_strategy_is_guarded(hip_build, rocm, monkeypatch) -> None:
    monkeypatch.setattr(Writer, "preload_tensors", staticmethod(not_fixed_preload))

    class ResilienceWriter:  # nvidia-resiliency-ext's writer: a class apart from megatron's
        preload_tensors = staticmethod(not_fixed_preload)

    monkeypatch.setattr(torch_strategy, "get_async_strategy", resolving_per_save(ResilienceWriter), raising=False)
    names = writer_classes()
    assert names["megatron.core.dist_checkpointing.strategies.torch.get_async_strategy('nvrx')"] is ResilienceWriter
    assert modes_through_every_path().count("pinned-non-blocking") == len(names)
    detail = rocm().fix("checkpoint-guard").detail
    assert "ResilienceWriter" in detail and "filesystem_async.FileSystemWriterAsync" in detail
    assert modes_through_every_path() == every_path("pageable-blocking")
    verify_guard()


def test_without_nvidia_resiliency_ext_its_strategy_is_not_a_name_of_the_writer(monkeypatch) -> None:
    monkeypatch.setattr(torch_strategy, "get_async_strategy", resolving_per_save(None), raising=False)
    names = writer_classes()
    assert "megatron.core.dist_checkpointing.strategies.torch.get_async_strategy('mcore')" in names
    assert not any("'nvrx'" in path for path in names)
