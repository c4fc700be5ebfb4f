"""The ROCm async-checkpoint guard: no pinned-memory staging before the writer forks.

megatron-core's ``FileSystemWriterAsync.preload_tensors`` copies every tensor of a checkpoint to
the host before the async writer process forks. With ``non_blocking=True`` that copy stages
through pinned host memory, and on ROCm a process forked after such a copy segfaults. Newer
Megatron-LM (radixark's fork since #74) forces blocking copies itself when ``torch.version.hip``
is set; megatron-core 0.16.1 from PyPI does not.

When megatron-core is prepared (``activate().prepare("megatron")``), the guard asks the installed
megatron-core, by behaviour, whether it already copies blocking under HIP (:func:`observe_copy_mode`, under a simulated HIP build when this torch is
not one). Only if it does not, the guard wraps ``preload_tensors`` *on the class itself*, so the
class seen through every module that names it carries the guard, whatever the import order.
:func:`verify_guard` then observes the copy mode through each name of the writer
(:func:`writer_classes`).

This module imports torch and megatron-core; import it only when megatron is prepared.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import torch

from miles_core.hardware.base import CopyMode, FixReport
from miles_core.hardware.patching import AttributePatch, qualname

FIX_NAME = "checkpoint-guard"

#: megatron's async writer, in its own module
WRITER_PATH = "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync"
#: the module whose save strategy uses the writer
TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
#: the async save strategies of releases that resolve the writer per save
ASYNC_STRATEGIES = ("mcore", "nvrx")

_GUARD_MARK = "__miles_rocm_checkpoint_guard__"


def writer_classes() -> dict[str, type[Any]]:
    """The writer class each name of it in the installed megatron-core gives right now.

    Its own module's; the name ``strategies.torch`` binds at import time where a release does
    (0.16: a rebinding of one would not reach the other); and, where a release resolves the writer
    when a save starts (0.19: ``get_async_strategy``), the class each async strategy resolves:
    megatron's own ("mcore") and, when nvidia-resiliency-ext is installed, its writer ("nvrx", the
    default of those releases' async saves)."""
    own_module, _, attr = WRITER_PATH.rpartition(".")
    classes = {WRITER_PATH: getattr(importlib.import_module(own_module), attr)}
    strategy = importlib.import_module(TORCH_STRATEGY)
    if hasattr(strategy, "FileSystemWriterAsync"):
        classes[f"{TORCH_STRATEGY}.FileSystemWriterAsync"] = strategy.FileSystemWriterAsync
    if hasattr(strategy, "get_async_strategy"):
        for name in ASYNC_STRATEGIES:
            try:
                _, modules = strategy.get_async_strategy(name)
            except ModuleNotFoundError:  # nvrx without nvidia-resiliency-ext: a save cannot use it
                continue
            classes[f"{TORCH_STRATEGY}.get_async_strategy({name!r})"] = modules["FileSystemWriterAsync"]
    return classes


@contextlib.contextmanager
def simulated_hip() -> Iterator[None]:
    """Make ``torch.version.hip`` truthy for the block (a no-op on a real HIP build).

    It changes a process-wide attribute: use it only where nothing runs concurrently (hardware
    activation holds its lock; a probe call takes microseconds).
    """
    original = torch.version.hip
    if not original:
        torch.version.hip = "0.0-simulated"
    try:
        yield
    finally:
        torch.version.hip = original


class _CopyObserved(Exception):
    def __init__(self, non_blocking: bool) -> None:
        super().__init__(non_blocking)
        self.non_blocking = non_blocking


class _CopyProbe(torch.Tensor):
    """A tensor that reports the first copy made of it, then aborts the caller."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            _, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            raise _CopyObserved(bool(non_blocking))
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], _CopyProbe):
            raise _CopyObserved(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        if func is torch.Tensor.cpu:
            raise _CopyObserved(False)
        return super().__torch_function__(func, types, args, kwargs)


def observe_copy_mode(writer_cls: type[Any]) -> CopyMode:
    """How ``writer_cls.preload_tensors`` copies a tensor to the host on a HIP build of torch.

    Calls it the way the async save does (``non_blocking=True`` requested) on a one-tensor write
    bucket whose tensor reports the first copy made of it.
    """
    probe = torch.zeros(1).as_subclass(_CopyProbe)
    no_bytes: list[tuple[str, object]] = []  # a write bucket: (file, key, (byte items, tensor items))
    bucket = ("miles-probe.distcp", "miles-probe", (no_bytes, [("miles-probe-item", probe)]))
    with simulated_hip():
        try:
            writer_cls.preload_tensors([bucket], True)
        except _CopyObserved as observed:
            return "pinned-non-blocking" if observed.non_blocking else "pageable-blocking"
    raise RuntimeError(
        f"{qualname(writer_cls)}.preload_tensors returned without copying the tensor to the host"
    )


def is_guarded(writer_cls: type[Any]) -> bool:
    """Whether ``writer_cls`` carries this guard's fallback (its own or inherited)."""
    return bool(getattr(writer_cls.preload_tensors, _GUARD_MARK, False))


def _blocking_on_hip(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    if "non_blocking" not in signature.parameters:
        raise TypeError(f"preload_tensors{signature} has no non_blocking parameter to force")

    @functools.wraps(original)
    def preload_tensors(*args: Any, **kwargs: Any) -> Any:
        if torch.version.hip:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["non_blocking"] = False
            return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)

    setattr(preload_tensors, _GUARD_MARK, True)
    return preload_tensors


class CheckpointGuard:
    """Detect whether the guard is needed, install it only then, and remove it again."""

    def __init__(self) -> None:
        self._patches: list[AttributePatch] = []

    def install(self) -> FixReport:
        paths = writer_classes()
        classes = list(dict.fromkeys(paths.values()))
        for writer_cls in classes:
            if is_guarded(writer_cls) or observe_copy_mode(writer_cls) == "pageable-blocking":
                continue
            if not isinstance(inspect.getattr_static(writer_cls, "preload_tensors"), staticmethod):
                raise TypeError(
                    f"{qualname(writer_cls)}.preload_tensors is not a staticmethod; the guard cannot wrap it"
                )
            patch = AttributePatch(
                writer_cls, "preload_tensors", staticmethod(_blocking_on_hip(writer_cls.preload_tensors))
            )
            patch.apply()
            self._patches.append(patch)
        guarded = [qualname(c) for c in classes if is_guarded(c)]
        version = _megatron_version()
        checked = f"checked through {len(paths)} module paths naming the writer"
        if guarded:
            return FixReport(
                FIX_NAME,
                "fallback",
                f"{version} stages checkpoint copies in pinned memory under HIP; "
                f"forced blocking copies on {', '.join(guarded)}; {checked}",
            )
        return FixReport(
            FIX_NAME, "upstream", f"{version} already copies checkpoint tensors blocking under HIP; {checked}"
        )

    def remove(self) -> None:
        for patch in reversed(self._patches):
            patch.revert()
        self._patches.clear()


def verify_guard() -> None:
    """Raise unless the writer named by every path of :func:`writer_classes` copies blocking under HIP."""
    for path, writer_cls in writer_classes().items():
        mode = observe_copy_mode(writer_cls)
        if mode != "pageable-blocking":
            raise RuntimeError(
                f"{path} copies checkpoint tensors to the host as {mode} under HIP: the async writer "
                "would fork after pinned-memory staging, which segfaults on ROCm"
            )


def _megatron_version() -> str:
    try:
        return f"megatron-core {metadata.version('megatron-core')}"
    except metadata.PackageNotFoundError:
        return "megatron-core (version unknown: not installed as a distribution)"
