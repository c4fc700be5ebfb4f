"""Shared fixtures: the tiny preset (built once per session into a temporary cache) and an engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from miles_core.engine.presets import preset_dir

if TYPE_CHECKING:  # torch and the engine load only in files whose tests use these fixtures
    from miles_core.engine.base import SamplingParams
    from miles_core.engine.engine import Engine


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preset_dir("tiny", tmp_path_factory.mktemp("miles-cache"))


@pytest.fixture(scope="session")
def reference_model(tiny_dir: Path):
    """An independent fp32 copy of the tiny model for teacher-forced forwards."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    from miles_core.engine.engine import Engine, EngineConfig

    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=16)) as e:
        yield e


@pytest.fixture(scope="session")
def teacher_forced(reference_model):
    """``teacher_forced(prompt, tokens, params) -> list[float]`` on the reference model."""
    return lambda prompt, tokens, params: teacher_forced_logprobs(reference_model, prompt, tokens, params)


@pytest.fixture
def teacher_forced_on():
    """``teacher_forced_on(model, prompt, tokens, params)``: :func:`teacher_forced_logprobs` for any model."""
    return teacher_forced_logprobs


def teacher_forced_logprobs(model, prompt: Sequence[int], tokens: Sequence[int], params: SamplingParams) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt`` from ONE forward over the whole sequence.

    The filtering (temperature, then top-k by rank, then top-p on the renormalised rest) is
    written out independently of ``miles_core.engine.sampling``.
    """
    import torch

    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for position, token in enumerate(tokens):
        row = logits[position]
        if params.temperature == 0:
            out.append(float(row.log_softmax(-1)[token]))
            continue
        row = row / params.temperature
        order = sorted(range(row.numel()), key=lambda i: (-float(row[i]), i))
        keep = order[: params.top_k] if params.top_k > 0 else order
        probs = row[keep].softmax(-1)
        if params.top_p < 1:
            mass, kept = 0.0, []
            for i, p in zip(keep, probs.tolist()):
                kept.append(i)
                mass += p
                if mass >= params.top_p:
                    break
            keep = kept
        assert token in keep, f"sampled token {token} is outside the filtered set"
        out.append(float(row[keep].log_softmax(-1)[keep.index(token)]))
    return out
