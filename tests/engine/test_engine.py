"""The embedded engine in-process: log-probs vs a teacher-forced forward, batching, seeds, stops."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import GenerationRequest, InvalidRequestError, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig

register_cpu_ci(est_time=40, suite="stage-a-cpu")

SETTINGS = [
    SamplingParams(max_tokens=24, temperature=1.0),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(max_tokens=24, temperature=1.3, top_p=0.5),
    SamplingParams(max_tokens=24, temperature=0.0),
]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _with_seed(params: SamplingParams, seed: int, **changes) -> SamplingParams:
    fields = {**params.__dict__, "seed": seed, **changes}
    return SamplingParams(**fields)


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.7-k20-p0.9", "t1.3-p0.5", "greedy"])
def test_logprobs_equal_teacher_forced_forward(engine: Engine, teacher_forced, params: SamplingParams) -> None:
    # 1- and 2-token prompts are shorter than the causal-conv window; 100 tokens span two GDN chunks
    prompts = [[5], [5, 6], list(range(100)), *_prompts(4)]
    requests = [GenerationRequest(p, _with_seed(params, seed=i, ignore_eos=True)) for i, p in enumerate(prompts)]
    worst = 0.0
    for request, completion in zip(requests, engine.generate(requests)):
        assert completion.completion_tokens == 24
        reference = teacher_forced(request.input_ids, completion.token_ids, request.sampling)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    assert worst <= 1e-5


def test_batched_equals_unbatched_for_the_same_seeds(engine: Engine) -> None:
    requests = [
        GenerationRequest(p, _with_seed(SETTINGS[i % 3], seed=100 + i)) for i, p in enumerate(_prompts(10, seed=1))
    ]
    batched = engine.generate(requests)
    for request, together in zip(requests, batched):
        alone = engine.generate([request])[0]
        assert alone.token_ids == together.token_ids
        assert alone.finish_reason == together.finish_reason
        assert max(abs(a - b) for a, b in zip(alone.logprobs, together.logprobs)) <= 1e-5


def test_seed_controls_sampling(engine: Engine) -> None:
    prompt = _prompts(1, seed=2)[0]
    same = [engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=16, seed=7, ignore_eos=True))])[0] for _ in range(2)]
    other = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=16, seed=8, ignore_eos=True))])[0]
    assert same[0].token_ids == same[1].token_ids
    assert other.token_ids != same[0].token_ids
    unseeded = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=4))] * 2)
    assert unseeded[0].seed != unseeded[1].seed  # the engine draws a seed and reports it
    replay = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=4, seed=unseeded[0].seed))])[0]
    assert replay.token_ids == unseeded[0].token_ids


def test_requests_join_and_leave_between_decode_steps(engine: Engine) -> None:
    """A request submitted while others decode joins the running batch; results are unaffected."""
    long = GenerationRequest(_prompts(1, seed=3)[0], SamplingParams(max_tokens=60, seed=1, ignore_eos=True))
    shorts = [GenerationRequest(p, SamplingParams(max_tokens=5, seed=i, ignore_eos=True)) for i, p in enumerate(_prompts(4, seed=4))]
    solo = [engine.generate([r])[0] for r in (long, *shorts)]
    before = engine.stats()
    long_future = engine.submit(long)
    while engine.stats()["prefills"] == before["prefills"]:
        threading.Event().wait(0.001)
    short_completions = [engine.submit(r).result() for r in shorts]  # joined the running batch
    long_completion = long_future.result()
    after = engine.stats()
    assert long_completion.token_ids == solo[0].token_ids
    assert [c.token_ids for c in short_completions] == [c.token_ids for c in solo[1:]]
    # 60 + 4*5 tokens: far fewer decode steps than tokens, because they shared steps
    assert after["decode_steps"] - before["decode_steps"] < 60 + 4 * 4
    assert after["running"] == 0


def test_stop_token_ids_stop_strings_and_max_tokens(engine: Engine) -> None:
    prompt = _prompts(1, seed=5)[0]
    free = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30, seed=3, ignore_eos=True))])[0]
    assert free.finish_reason == "length" and free.completion_tokens == 30

    stop_id = free.token_ids[10]
    first = free.token_ids.index(stop_id)
    by_id = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30, seed=3, ignore_eos=True, stop_token_ids=(stop_id,)))])[0]
    assert by_id.finish_reason == "stop" and by_id.matched_stop == stop_id
    assert by_id.token_ids == free.token_ids[: first + 1]

    text = engine.tokenizer.decode(list(free.token_ids[12:14]), skip_special_tokens=False)
    by_string = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30, seed=3, ignore_eos=True, stop=(text,)))])[0]
    assert by_string.finish_reason == "stop" and by_string.matched_stop == text
    assert text in engine.tokenizer.decode(list(by_string.token_ids), skip_special_tokens=False)
    assert by_string.token_ids == free.token_ids[: len(by_string.token_ids)]
    assert len(by_string.token_ids) <= 14


def test_eos_stops_unless_ignored(engine: Engine) -> None:
    eos = min(engine.eos_token_ids)
    prompts = _prompts(40, seed=6)
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=200, seed=i, temperature=1.5)) for i, p in enumerate(prompts)])
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped, "no completion sampled EOS; pick other seeds"
    assert all(c.token_ids[-1] == eos and c.matched_stop == eos for c in stopped)
    assert all(eos not in c.token_ids[:-1] for c in completions)


def test_bad_requests_are_rejected_before_queueing(engine: Engine) -> None:
    cases = {
        "input_ids": GenerationRequest([], SamplingParams()),
        "max_tokens": GenerationRequest([1] * 2000, SamplingParams(max_tokens=100)),
        "stop_token_ids": GenerationRequest([1], SamplingParams(stop_token_ids=(10**6,))),
    }
    for field, request in cases.items():
        with pytest.raises(InvalidRequestError) as info:
            engine.submit(request)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="input_ids"):
        engine.submit(GenerationRequest([engine.vocab_size], SamplingParams()))
    for field, kwargs in {"temperature": {"temperature": -1}, "top_p": {"top_p": 0}, "max_tokens": {"max_tokens": 0}, "seed": {"seed": -3}}.items():
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field
    assert engine.stats()["waiting"] == 0


def test_bf16_engine_runs_and_stays_close(tiny_dir) -> None:
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4, dtype="bfloat16")) as bf16:
        assert bf16.dtype == torch.bfloat16
        out = bf16.generate([GenerationRequest([1, 2, 3], SamplingParams(max_tokens=8, seed=0, ignore_eos=True))])[0]
    assert out.completion_tokens == 8 and all(lp <= 0 for lp in out.logprobs)


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_negative_control_dropping_the_recurrent_state_is_caught(tiny_dir, teacher_forced, monkeypatch, runner) -> None:
    """The teacher-forced comparison detects a broken hybrid state (it is not vacuous), on both runners."""
    if runner == "hf":
        from miles_core.engine.slot_cache import StepCache

        real = StepCache.get_recurrent_state

        def forgetful(self, layer_idx, state_idx=0):
            state = real(self, layer_idx, state_idx)
            return None if state is None else torch.zeros_like(state)

        monkeypatch.setattr(StepCache, "get_recurrent_state", forgetful)
    else:
        from miles_core.engine import gdn_ops

        real_step = gdn_ops.recurrent_decode

        def forgetful_step(q, k, v, g, beta, state, *args):
            state.zero_()
            return real_step(q, k, v, g, beta, state, *args)

        monkeypatch.setattr(gdn_ops, "recurrent_decode", forgetful_step)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=2, runner=runner)) as broken:
        assert broken.runner == runner
        request = GenerationRequest(_prompts(1, seed=9)[0], SamplingParams(max_tokens=16, seed=0, ignore_eos=True))
        completion = broken.generate([request])[0]
    reference = teacher_forced(request.input_ids, completion.token_ids, request.sampling)
    assert max(abs(a - b) for a, b in zip(reference, completion.logprobs)) > 1e-4


def test_a_dense_attention_model_works_too(tmp_path, monkeypatch) -> None:
    """Not only Qwen3.5: a plain attention-only decoder (Qwen3) through the same slot cache."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from miles_core.assets.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    requests = [GenerationRequest(p, SamplingParams(max_tokens=16, seed=i, ignore_eos=True)) for i, p in enumerate(_prompts(4, seed=7))]
    with Engine.from_pretrained(tmp_path, EngineConfig(max_batch_size=4)) as dense:
        completions = dense.generate(requests)
    for request, completion in zip(requests, completions):
        ids = torch.tensor([[*request.input_ids, *completion.token_ids]])
        with torch.no_grad():
            logprobs = reference(ids).logits[0, len(request.input_ids) - 1 : -1].log_softmax(-1)
        expected = logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert (expected - torch.tensor(completion.logprobs)).abs().max() <= 1e-5


def test_close_finishes_running_sequences_and_fails_waiting_ones(tiny_dir) -> None:
    one_slot = Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=1))
    running = one_slot.submit(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=400, seed=0, ignore_eos=True)))
    while one_slot.stats()["running"] == 0:
        threading.Event().wait(0.001)
    waiting = one_slot.submit(GenerationRequest([4, 5], SamplingParams(max_tokens=5, seed=0)))
    one_slot.close()
    assert running.result().completion_tokens == 400
    with pytest.raises(RuntimeError, match="closed before this request ran"):
        waiting.result()
    with pytest.raises(RuntimeError, match="closed"):
        one_slot.submit(GenerationRequest([1], SamplingParams()))


def test_identical_prompts_share_one_prefill(engine: Engine, teacher_forced) -> None:
    """GRPO samples each prompt many times: one prefill, state copied to every sample."""
    prompt = _prompts(1, seed=11)[0]
    group = [GenerationRequest(prompt, SamplingParams(max_tokens=12, seed=i, ignore_eos=True)) for i in range(8)]
    before = engine.stats()["prefills"]
    together = engine.generate(group)
    assert engine.stats()["prefills"] == before + 1
    assert len({c.token_ids for c in together}) > 1  # different seeds, different samples
    for request, completion in zip(group, together):
        assert engine.generate([request])[0].token_ids == completion.token_ids
        reference = teacher_forced(prompt, completion.token_ids, request.sampling)
        assert max(abs(a - b) for a, b in zip(reference, completion.logprobs)) <= 1e-5


def test_every_served_model_goes_through_prepare_model(tiny_dir, monkeypatch) -> None:
    import miles_core.patches

    real = miles_core.patches.prepare_model
    prepared = []

    def recording(model, **kwargs):
        report = real(model, **kwargs)
        prepared.append((model, report))
        return report

    monkeypatch.setattr(miles_core.patches, "prepare_model", recording)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=1)) as served:
        assert [m for m, _ in prepared] == [served.model]
        assert served.patch_report is prepared[0][1]
        assert served.patch_report.model.endswith("Qwen3_5ForCausalLM")


def test_abort_frees_the_slot_of_a_running_request(engine: Engine) -> None:
    from miles_core.engine.engine import RequestAborted

    request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True))
    first, second = engine.submit_many([request, request])
    while engine.stats()["running"] < 2:
        threading.Event().wait(0.001)
    engine.abort(first)
    with pytest.raises(RequestAborted):
        first.result(30)
    assert engine.stats()["running"] == 1
    engine.abort(second)
    with pytest.raises(RequestAborted):
        second.result(30)
    assert engine.stats()["running"] == 0
    done = engine.generate([GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2))])[0]
    engine.abort(engine.submit(GenerationRequest([4], SamplingParams(max_tokens=1))))  # harmless either way
    assert done.completion_tokens == 2


def test_submit_batch_gives_what_generate_gives_and_refused_requests_fail_alone(engine: Engine) -> None:
    requests = [GenerationRequest(p, _with_seed(SETTINGS[i % 4], seed=200 + i)) for i, p in enumerate(_prompts(9, seed=7))]
    requests += [requests[0], requests[0]]  # a shared prompt: one prefill, as generate does
    expected = engine.generate(requests)
    outcomes = engine.submit_batch(requests).result(60)
    strip = [(c.prompt_ids, c.token_ids, c.logprobs, c.finish_reason, c.matched_stop, c.seed) for c in expected]
    assert [(c.prompt_ids, c.token_ids, c.logprobs, c.finish_reason, c.matched_stop, c.seed) for c in outcomes] == strip
    refused = [requests[1], GenerationRequest([1] * 2000, SamplingParams(max_tokens=100)), requests[2],
               GenerationRequest([], SamplingParams())]
    mixed = engine.submit_batch(refused).result(60)
    assert [c.token_ids for c in (mixed[0], mixed[2])] == [expected[1].token_ids, expected[2].token_ids]
    assert [(type(e), e.field) for e in (mixed[1], mixed[3])] == [(InvalidRequestError, "max_tokens"),
                                                                  (InvalidRequestError, "input_ids")]
    nothing = engine.submit_batch([GenerationRequest([], SamplingParams())]).result(1)
    assert isinstance(nothing[0], InvalidRequestError) and engine.submit_batch([]).result(1) == []


def test_aborting_a_submitted_batch_stops_every_request_still_running(engine: Engine) -> None:
    from miles_core.engine.engine import RequestAborted

    quick = GenerationRequest([7, 8], SamplingParams(max_tokens=1, seed=1))
    slow = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True, seed=2))
    future = engine.submit_batch([quick, slow, slow])
    while engine.stats()["running"] < 2:
        threading.Event().wait(0.001)
    engine.abort(future)
    done, *aborted = future.result(30)
    assert done.completion_tokens == 1  # finished before the abort: left as it is
    assert [type(e) for e in aborted] == [RequestAborted, RequestAborted]
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
