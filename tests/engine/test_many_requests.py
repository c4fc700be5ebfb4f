"""Many short requests (a GRPO step): shared prompts, one-token samples, batch-level completion.

Every check compares against the same request run alone (a request's tokens must not depend on
what it is batched with: its random stream is a function of its seed only) and against a
teacher-forced forward (log-probs within 1e-5: fp32, the same logits path, see test_engine.py).
"""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import GenerationRequest, InvalidRequestError, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig

register_cpu_ci(est_time=10, suite="stage-a-cpu")

TOLERANCE = 1e-5


def _worst(teacher_forced, requests, completions) -> float:
    worst = 0.0
    for request, completion in zip(requests, completions, strict=True):
        reference = teacher_forced(request.input_ids, completion.token_ids, request.sampling)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    return worst


def _same_as_alone(engine: Engine, requests, together) -> bool:
    """Tokens exactly as when each request runs alone; log-probs within the tolerance (a batched
    prefill pads and groups rows differently: the same sums in another order)."""
    for request, completion in zip(requests, together, strict=True):
        alone = engine.generate([request])[0]
        if alone.token_ids != completion.token_ids or alone.finish_reason != completion.finish_reason:
            return False
        if max(abs(a - b) for a, b in zip(alone.logprobs, completion.logprobs)) > TOLERANCE:
            return False
    return True


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_one_token_samples_take_no_decode_row(tiny_dir, teacher_forced, runner) -> None:
    """Two slots serve 2 prompts x 6 one-token samples in one prefill: the samples follow their
    prompt's request and stop at their first token, so only the prompts need rows."""
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    base = SamplingParams(max_tokens=1, temperature=1.0)
    requests = [GenerationRequest(prompts[i % 2], base.with_seed(i)) for i in range(12)]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=2, runner=runner)) as engine:
        before = engine.stats()
        together = engine.generate(requests)
        after = engine.stats()
        assert after["prefills"] - before["prefills"] == 2
        assert after["prefill_steps"] - before["prefill_steps"] == 1
        assert after["decode_steps"] == before["decode_steps"] and after["running"] == 0
        assert _same_as_alone(engine, requests, together)
    assert len({c.token_ids for c in together}) > 1  # different seeds, different samples
    assert all(c.completion_tokens == 1 and c.finish_reason in ("length", "stop") for c in together)
    assert _worst(teacher_forced, requests, together) <= TOLERANCE


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_groups_where_some_samples_stop_at_their_first_token(tiny_dir, teacher_forced, runner) -> None:
    """Samples of one prompt with different budgets: those that stop at the first token leave
    holes, so the ones that continue take rows other than where their prompt was prefilled (the
    state copies overlap the prefill rows of the next prompts)."""
    prompts = [[1, 2, 3, 4, 5], [9, 8], [30, 31, 32, 33]]
    budgets = [1, 5, 1, 3, 1, 1, 4, 2]
    requests = [GenerationRequest(p, SamplingParams(max_tokens=budgets[(i + j) % len(budgets)], seed=10 * i + j, ignore_eos=True))
                for i, p in enumerate(prompts) for j in range(4)]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8, runner=runner)) as engine:
        together = engine.generate(requests)
        assert _same_as_alone(engine, requests, together)
        assert engine.stats()["running"] == 0
    assert [c.completion_tokens for c in together] == [r.sampling.max_tokens for r in requests]
    assert _worst(teacher_forced, requests, together) <= TOLERANCE


def test_a_decode_batch_wider_than_the_context_length(tmp_path) -> None:
    """The char model's context is 64 positions; 80 sequences decode together all the same."""
    from miles_core.assets.char_model import write_char_model

    model = write_char_model(tmp_path / "char")
    with Engine.from_pretrained(model, EngineConfig(max_batch_size=80)) as engine:
        prompt = engine.tokenizer("3+4=", add_special_tokens=False)["input_ids"]
        requests = [GenerationRequest(prompt, SamplingParams(max_tokens=3, seed=i, ignore_eos=True)) for i in range(80)]
        before = engine.stats()["decode_steps"]
        together = engine.generate(requests)
        assert engine.stats()["decode_steps"] - before == 2  # all 80 in the same two steps
        assert _same_as_alone(engine, requests[::16], together[::16])


def test_requests_from_a_generator_keep_their_own_prompts(engine: Engine) -> None:
    """Validation is cached per prompt object: objects freed while the requests are read (a
    generator of fresh lists) must not be mistaken for one another."""
    prompts = [[1 + i % 5, 2 + i % 3, 3] for i in range(30)]
    completions = engine.generate(GenerationRequest(list(p), SamplingParams(max_tokens=1, seed=i)) for i, p in enumerate(prompts))
    assert [list(c.prompt_ids) for c in completions] == prompts


def test_an_invalid_request_among_shared_ones_queues_nothing(engine: Engine) -> None:
    prompt = [4, 5, 6]
    ok = SamplingParams(max_tokens=2)
    requests = [GenerationRequest(prompt, ok.with_seed(i)) for i in range(5)]
    before = engine.stats()
    for bad, field in ((GenerationRequest(prompt, SamplingParams(max_tokens=engine.max_model_len)), "max_tokens"),
                       (GenerationRequest(prompt, SamplingParams(stop_token_ids=(engine.vocab_size,))), "stop_token_ids"),
                       (GenerationRequest([*prompt, -1], ok), "input_ids")):
        with pytest.raises(InvalidRequestError) as info:
            engine.generate([*requests, bad])
        assert info.value.field == field
    after = engine.stats()
    assert after["waiting"] == 0 and after["prefills"] == before["prefills"]


def test_generate_raises_the_first_failure_and_the_engine_keeps_serving(tiny_dir, monkeypatch) -> None:
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4)) as engine:
        real = engine._runner.decode
        calls = []

        def failing_once(ids):
            calls.append(len(ids))
            if len(calls) == 1:
                raise RuntimeError("decode blew up")
            return real(ids)

        monkeypatch.setattr(engine._runner, "decode", failing_once)
        requests = [GenerationRequest([3, 4], SamplingParams(max_tokens=1, seed=0)),
                    GenerationRequest([5, 6], SamplingParams(max_tokens=3, seed=1, ignore_eos=True))]
        with pytest.raises(RuntimeError, match="decode blew up"):
            engine.generate(requests)
        again = engine.generate(requests)
        assert [c.completion_tokens for c in again] == [1, 3] and engine.stats()["running"] == 0


def test_with_seed_is_a_checked_copy() -> None:
    base = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, stop=("x",), stop_token_ids=(2,))
    assert base.with_seed(9) == SamplingParams(max_tokens=3, temperature=0.5, top_k=4, stop=("x",), stop_token_ids=(2,), seed=9)
    assert base.with_seed(9).seed == 9 and base.seed is None and base.with_seed(None) == base
    for bad in (-1, 2**63, 1.5, "7"):
        with pytest.raises(InvalidRequestError) as info:
            base.with_seed(bad)  # type: ignore[arg-type]
        assert info.value.field == "seed"
