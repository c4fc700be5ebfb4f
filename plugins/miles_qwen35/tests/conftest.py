"""Fixtures for miles-qwen35's tests: one torch thread, the plugin registered, packed documents."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from miles_qwen35 import __version__
from miles_qwen35.coverage import gdn_architectures
from miles_qwen35.patch import GatedDeltaNetPackingPatch
from miles_qwen35.tiny import tiny_model

from miles_core.patches.packing import packed_position_ids
from miles_core.plugins import MilesPluginManager

#: every GDN architecture of the installed transformers that this plugin claims
SUPPORTED = [a.name for a in gdn_architectures() if a.status == "supported"]
#: documents A, B, C (B crosses a 64-token chunk boundary, C is shorter than nothing interesting)
LENGTHS = [13, 70, 5]
#: trailing pad tokens, all at position 0: each is a 1-token segment, as upstream trainers pad
PAD = 3


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", SUPPORTED)


@pytest.fixture(scope="session", autouse=True)
def cpu_forwards_with_fla_installed() -> None:
    """These tests run tiny models on the CPU. With fla importable (a GPU machine), transformers
    binds every Gated DeltaNet layer to fla's Triton kernels, which refuse CPU tensors. Patching
    the classes first -- as the first ``prepare_model`` of a process does anyway -- sends CPU calls
    to transformers' torch implementation, so the tests run the code they run in CI, whatever
    order they run in. (``test_gpu_fla.py`` covers the fla kernels.)"""
    if importlib.util.find_spec("fla") is None:
        return
    for arch in SUPPORTED:
        GatedDeltaNetPackingPatch().apply(tiny_model(arch))  # patches the classes of a throwaway model


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads stall small models on the 2-core CI machines
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def qwen_pm(miles_pm: MilesPluginManager) -> MilesPluginManager:
    import miles_qwen35.plugin

    miles_pm.register(miles_qwen35.plugin, name="miles-qwen35", distribution="miles-qwen35", version=__version__)
    return miles_pm


@pytest.fixture
def docs() -> SimpleNamespace:
    """Documents A, B, C packed into one row with trailing padding, and each on its own."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (1, sum(LENGTHS) + PAD), generator=generator)
    position_ids = torch.cat([packed_position_ids(LENGTHS), torch.zeros(1, PAD, dtype=torch.long)], dim=1)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    return SimpleNamespace(
        ids=ids,
        position_ids=position_ids,
        slices=[slice(a, b) for a, b in pairwise(starts)],
        alone=[ids[:, a:b] for a, b in pairwise(starts)],
        labels=torch.randint(0, 128, ids.shape, generator=generator),
        num_real_tokens=sum(LENGTHS),
    )
