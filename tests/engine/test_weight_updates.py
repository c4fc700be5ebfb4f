"""Weight updates: they change outputs and the version, never mix versions, and reject bad input."""

from __future__ import annotations

import threading

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import GenerationRequest, InvalidRequestError, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig

register_cpu_ci(est_time=15, suite="stage-a-cpu")

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def _perturbed(model, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=generator, dtype=p.dtype)
        for name, p in model.named_parameters()
    }


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def fresh_engine(tiny_dir):
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8)) as e:
        yield e


def test_update_changes_outputs_and_version(fresh_engine: Engine, reference_model, teacher_forced) -> None:
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=20, seed=5, ignore_eos=True))
    before = fresh_engine.generate([request])[0]
    assert before.weight_version == fresh_engine.weight_version == "0"

    new_weights = _perturbed(fresh_engine.model)
    assert fresh_engine.update_weights(new_weights, "step-1") == "step-1"
    after = fresh_engine.generate([request])[0]
    assert after.weight_version == fresh_engine.weight_version == "step-1"
    assert after.logprobs != before.logprobs

    # the new log-probs are those of the new weights: teacher-forced forward of a model holding them
    original = _snapshot(reference_model)
    try:
        reference_model.load_state_dict(new_weights, strict=False)
        reference = teacher_forced(PROMPT, after.token_ids, request.sampling)
    finally:
        reference_model.load_state_dict(original)
    assert max(abs(a - b) for a, b in zip(reference, after.logprobs)) <= 1e-5

    # without a version the engine counts updates
    assert fresh_engine.update_weights(_perturbed(fresh_engine.model, seed=1)) == "2"


def test_in_flight_requests_finish_on_the_version_that_started_them(fresh_engine: Engine) -> None:
    requests = [GenerationRequest(PROMPT[: 4 + i], SamplingParams(max_tokens=80, seed=i, ignore_eos=True)) for i in range(4)]
    old_outputs = [fresh_engine.generate([r])[0] for r in requests]
    new_weights = _perturbed(fresh_engine.model)

    in_flight = [fresh_engine.submit(r) for r in requests]
    while fresh_engine.stats()["running"] < len(requests):
        threading.Event().wait(0.001)
    result: dict[str, str] = {}
    updater = threading.Thread(target=lambda: result.setdefault("version", fresh_engine.update_weights(new_weights, "v2")))
    updater.start()
    while fresh_engine.stats()["running"] and not fresh_engine._updates:  # the update is queued
        threading.Event().wait(0.001)
    late = fresh_engine.submit(requests[0])  # arrives while the update waits: runs on the new weights
    updater.join()
    finished = [f.result() for f in in_flight]

    assert result["version"] == "v2"
    for old, done in zip(old_outputs, finished):
        assert done.weight_version == "0"
        assert done.token_ids == old.token_ids
        assert max(abs(a - b) for a, b in zip(done.logprobs, old.logprobs)) <= 1e-5
    late_completion = late.result()
    assert late_completion.weight_version == "v2"
    assert max(abs(a - b) for a, b in zip(late_completion.logprobs, old_outputs[0].logprobs)) > 1e-3


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda w: w.update({"model.not_a_layer.weight": torch.zeros(2)}), "not a parameter"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), "has shape"),
        (lambda w: w.pop("model.norm.weight"), "does not cover"),
    ],
    ids=["unknown-name", "wrong-shape", "incomplete"],
)
def test_rejected_update_changes_nothing(fresh_engine: Engine, mutate, message: str) -> None:
    weights = _perturbed(fresh_engine.model)
    mutate(weights)
    before = _snapshot(fresh_engine.model)
    with pytest.raises(InvalidRequestError, match=message):
        fresh_engine.update_weights(weights, "bad")
    assert fresh_engine.weight_version == "0"
    after = _snapshot(fresh_engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_update_from_disk_equals_update_from_tensors(fresh_engine: Engine, tiny_dir, tmp_path) -> None:
    from safetensors.torch import save_file

    weights = _perturbed(fresh_engine.model, seed=3)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=12, seed=1, ignore_eos=True))
    assert fresh_engine.update_weights_from_disk(tmp_path, "disk-1") == "disk-1"
    from_disk = fresh_engine.generate([request])[0]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=2)) as other:
        other.update_weights(weights, "tensors-1")
        from_tensors = other.generate([request])[0]
    assert from_disk.token_ids == from_tensors.token_ids and from_disk.logprobs == from_tensors.logprobs
    with pytest.raises(InvalidRequestError, match="model_path"):
        fresh_engine.update_weights_from_disk(tmp_path / "missing")


def test_an_update_that_fails_half_way_blocks_generation_until_a_full_update(fresh_engine: Engine, monkeypatch) -> None:
    weights = _perturbed(fresh_engine.model)
    poisoned = next(iter(weights.values()))
    real_copy = torch.Tensor.copy_

    def copy_(target, source, *args, **kwargs):
        if source is poisoned:
            raise MemoryError("simulated out of memory")
        return real_copy(target, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(MemoryError):
        fresh_engine.update_weights(weights, "half")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed half-way"):
        fresh_engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=2)))
    assert "failed half-way" in fresh_engine.problem
    assert fresh_engine.update_weights(weights, "whole") == "whole"
    assert fresh_engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=2))])[0].weight_version == "whole"
    assert fresh_engine.problem is None


def test_a_crashed_loop_fails_waiting_callers_and_reports_itself(tiny_dir, monkeypatch) -> None:
    crashing = Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=2))

    def bug(update) -> None:
        raise SystemError("bug")

    monkeypatch.setattr(crashing, "_apply_update", bug)
    running = crashing.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)))
    while crashing.stats()["running"] == 0:
        threading.Event().wait(0.001)
    errors: list[BaseException] = []
    updater = threading.Thread(target=lambda: _record(errors, crashing.update_weights, _perturbed(crashing.model)))
    updater.start()
    while not crashing._updates:
        threading.Event().wait(0.001)
    queued = crashing.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=2)))
    updater.join(60)
    assert running.result().completion_tokens == 200  # finished before the update was applied
    assert [str(e) for e in errors] == ["the engine loop crashed: SystemError: bug"]
    with pytest.raises(RuntimeError, match="loop crashed"):
        queued.result(60)
    assert "loop crashed" in crashing.problem
    with pytest.raises(RuntimeError, match="loop crashed"):
        crashing.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=2)))


def _record(errors: list[BaseException], call, *args) -> None:
    try:
        call(*args)
    except BaseException as exc:
        errors.append(exc)
