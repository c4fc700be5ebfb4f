"""The engine's runners: chunked prefill, admission into freed slots, the Hugging Face fallback,
fused projections that stay the model's own parameters, and aborts part-way through a prefill.

Every generated log-prob is compared with a teacher-forced forward of an independent copy of the
model (``teacher_forced``: fp32, one forward over prompt + completion): 1e-5 is the contract, and
what separates the paths is float summation order (measured <= 1e-6 here).
"""

from __future__ import annotations

import gc
import random
import threading
import warnings

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig, RequestAborted
from miles_core.engine.loader import load_model
from miles_core.engine.runner import build_runner
from miles_core.errors import ConfigError

register_cpu_ci(est_time=15, suite="stage-a-cpu")

TOLERANCE = 1e-5


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _worst(teacher_forced, requests, completions) -> float:
    worst = 0.0
    for request, completion in zip(requests, completions):
        reference = teacher_forced(request.input_ids, completion.token_ids, request.sampling)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    return worst


def _wait(condition, timeout: float = 30.0) -> None:
    stop = threading.Event()
    for _ in range(int(timeout / 0.001)):
        if condition():
            return
        stop.wait(0.001)
    raise AssertionError("timed out waiting")


def test_chunked_prefill_equals_a_teacher_forced_forward_and_the_unchunked_engine(tiny_dir, teacher_forced) -> None:
    # 300 and 150 tokens take several 64-token chunks (continuing the conv window and recurrent
    # state across chunk boundaries that fall inside GDN chunks); 1 and 3 tokens are shorter than
    # the causal-conv window; two identical prompts share one (chunked) prefill.
    prompts = [_prompt(300, 1), _prompt(300, 1), _prompt(150, 2), [7], _prompt(3, 3)]
    requests = [GenerationRequest(p, SamplingParams(max_tokens=12, seed=i, ignore_eos=True)) for i, p in enumerate(prompts)]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8, prefill_chunk_tokens=64)) as chunked:
        in_chunks = chunked.generate(requests)
        stats = chunked.stats()
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8)) as whole:
        at_once = whole.generate(requests)
    assert stats["prefill_tokens"] == 300 + 150 + 1 + 3  # the repeated prompt was computed once
    assert stats["prefill_steps"] >= (300 + 150 + 4) // 64
    assert _worst(teacher_forced, requests, in_chunks) <= TOLERANCE
    assert [c.token_ids for c in in_chunks] == [c.token_ids for c in at_once]


def test_a_long_prefill_does_not_stall_running_decodes(tiny_dir) -> None:
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4, prefill_chunk_tokens=64)) as engine:
        short = engine.submit(GenerationRequest(_prompt(8, 4), SamplingParams(max_tokens=10, seed=0, ignore_eos=True)))
        _wait(lambda: engine.stats()["decode_steps"] > 0)
        long = engine.submit(GenerationRequest(_prompt(1500, 5), SamplingParams(max_tokens=2, seed=0, ignore_eos=True)))
        short_done, long_done = short.result(60), long.result(60)
    # the short request kept decoding (one step per 64-token chunk) and finished before the
    # 1500-token prompt (24 chunks) produced its first token
    assert short_done.timing.finished_s < long_done.timing.first_token_s


def test_requests_beyond_max_batch_size_join_as_slots_free_up(tiny_dir, teacher_forced) -> None:
    rng = random.Random(6)
    requests = [
        GenerationRequest(_prompt(rng.randint(2, 40), 10 + i), SamplingParams(max_tokens=rng.randint(1, 30), seed=i, temperature=1.2))
        for i in range(14)
    ]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4)) as engine:
        together = engine.generate(requests)
        alone = [engine.generate([r])[0] for r in requests]
        seen_running: list[int] = []
        futures = engine.submit_many(requests)
        while not all(f.done() for f in futures):
            seen_running.append(engine.stats()["running"])
        again = [f.result() for f in futures]
    assert max(seen_running) <= 4
    assert [c.token_ids for c in together] == [c.token_ids for c in alone] == [c.token_ids for c in again]
    assert _worst(teacher_forced, requests, together) <= TOLERANCE


def test_the_hf_runner_agrees_with_the_lean_runner_and_the_teacher(tiny_dir, teacher_forced) -> None:
    requests = [GenerationRequest(_prompt(n, 20 + n), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
                for n in (1, 5, 70)]
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4, runner="hf")) as hf:
        assert hf.runner == "hf" and hf.runner_info()["runner"] == "hf"
        by_hf = hf.generate(requests)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4, runner="lean")) as lean:
        assert lean.runner == "lean"
        by_lean = lean.generate(requests)
    assert [c.token_ids for c in by_hf] == [c.token_ids for c in by_lean]
    assert _worst(teacher_forced, requests, by_hf) <= TOLERANCE
    assert _worst(teacher_forced, requests, by_lean) <= TOLERANCE


def test_an_architecture_without_a_lean_forward_runs_on_the_hf_runner(tmp_path) -> None:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from miles_core.assets.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = CONFIG_MAPPING["qwen3_next"](
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(ConfigError, match="Qwen3NextForCausalLM has no lean forward"):
        Engine.from_pretrained(tmp_path, EngineConfig(max_batch_size=2, runner="lean"))
    requests = [GenerationRequest(_prompt(n, n), SamplingParams(max_tokens=8, seed=n, ignore_eos=True)) for n in (3, 20)]
    with Engine.from_pretrained(tmp_path, EngineConfig(max_batch_size=2)) as engine:
        assert engine.runner == "hf"
        assert "Qwen3NextForCausalLM" in engine.runner_info()["why_not_lean"]
        completions = engine.generate(requests)
    for request, completion in zip(requests, completions):
        ids = torch.tensor([[*request.input_ids, *completion.token_ids]])
        with torch.no_grad():
            logprobs = reference(ids).logits[0, len(request.input_ids) - 1 : -1].log_softmax(-1)
        expected = logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert (expected - torch.tensor(completion.logprobs)).abs().max() <= TOLERANCE


def test_fused_projections_are_the_models_own_parameters(tiny_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from miles_core.engine.loader import load_model

    loaded = load_model(tiny_dir)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    with Engine(loaded, EngineConfig(max_batch_size=2)) as engine:
        gdn = engine.model.model.layers[0].linear_attn
        fused = engine._runner.model.layers[0].mixer.projections.weight
        # the HF parameters are slices of the buffer the lean forward multiplies with
        assert gdn.in_proj_qkv.weight.data_ptr() == fused.data_ptr()
        assert gdn.in_proj_z.weight.data_ptr() == fused[gdn.in_proj_qkv.weight.shape[0]].data_ptr()
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
        z_rows = fused[gdn.in_proj_qkv.weight.shape[0] :][: gdn.in_proj_z.weight.shape[0]]
        saved = gdn.in_proj_z.weight.detach().clone()
        with torch.no_grad():
            gdn.in_proj_z.weight.fill_(0.5)  # an in-place change of a parameter is the buffer's
        assert bool((z_rows == 0.5).all())
        with torch.no_grad():
            gdn.in_proj_z.weight.copy_(saved)
        engine.model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(before[k], v) for k, v in reloaded.state_dict().items())


def test_aborting_a_prompt_part_way_through_its_chunked_prefill(tiny_dir, teacher_forced) -> None:
    prompt = _prompt(900, 7)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=4, prefill_chunk_tokens=64)) as engine:
        # a lone staged prompt: aborting frees everything
        lone = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4, seed=0)))
        _wait(lambda: engine.stats()["prefill_steps"] >= 2)
        engine.abort(lone)
        with pytest.raises(RequestAborted):
            lone.result(30)
        _wait(lambda: engine.stats()["running"] == 0)
        # a staged leader with a follower (same prompt): the follower takes over the prefill
        # (the follower samples differently: its own parameters must take over the staging row)
        requests = [GenerationRequest(prompt, SamplingParams(max_tokens=6, seed=1, ignore_eos=True)),
                    GenerationRequest(prompt, SamplingParams(max_tokens=6, seed=2, temperature=0.5, top_k=20, ignore_eos=True))]
        steps = engine.stats()["prefill_steps"]
        leader, follower = engine.submit_many(requests)
        _wait(lambda: engine.stats()["prefill_steps"] >= steps + 2)
        engine.abort(leader)
        with pytest.raises(RequestAborted):
            leader.result(30)
        completion = follower.result(60)
        assert engine.stats()["running"] == 0
    assert completion.completion_tokens == 6
    assert _worst(teacher_forced, requests[1:], [completion]) <= TOLERANCE


def test_engine_config_rejects_unknown_runners_and_bad_chunk_sizes() -> None:
    with pytest.raises(ConfigError, match="runner"):
        EngineConfig(runner="vllm")
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        EngineConfig(prefill_chunk_tokens=0)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_only_architectures_run_lean_and_match_a_teacher_forced_forward(tmp_path, arch, teacher_forced_on) -> None:
    """Llama (no q/k norms) and Qwen3 (per-head q/k norms) take the lean runner, and every sampled
    log-prob equals one forward of the Hugging Face model over prompt + completion."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from miles_core.assets.tiny_tokenizer import build_tokenizer

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, head_dim=16)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen3ForCausalLM(Qwen3Config(**common)))
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path)  # the engine loads it
    requests = [GenerationRequest(_prompt(n, i), SamplingParams(max_tokens=9, seed=i, temperature=0.9 if i % 2 else 0.0,
                                                                  ignore_eos=True))
                for i, n in enumerate([5, 17, 1, 40])]
    with Engine.from_pretrained(tmp_path, EngineConfig(max_batch_size=4)) as engine:
        assert engine.runner == "lean", engine.runner_info()
        completions = engine.generate(requests)
    reference = model.eval()
    worst = max(max(abs(a - b) for a, b in zip(teacher_forced_on(reference, r.input_ids, c.token_ids, r.sampling),
                                               c.logprobs)) for r, c in zip(requests, completions))
    assert worst <= TOLERANCE


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some lazily imported modules warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("kind", ["lean", "hf"])
def test_runner_calls_outside_inference_mode_keep_no_activations_alive(tiny_dir, kind: str) -> None:
    """A script or plugin driving a runner without the engine's inference mode: the parameters
    require grad (as a trainer's do), and the slot state outlives every call, so recorded autograd
    history through its in-place writes would keep each call's activations alive for good."""
    model = load_model(tiny_dir, dtype="auto", device="cpu").model
    assert any(p.requires_grad for p in model.parameters())
    runner = build_runner(model, kind=kind, max_slots=4, max_model_len=1024, cuda_graphs=False)
    rows = list(range(4))
    prompts = [_prompt(300, 0), *(_prompt(20 + i, i) for i in rows[1:])]  # 300 tokens outgrow the first KV capacity

    def one_round() -> int:
        runner.reset_rows(rows)
        assert not runner.prefill(rows, [0] * 4, prompts).requires_grad
        for _ in range(3):
            assert not runner.decode(torch.zeros(4, dtype=torch.long)).requires_grad
        return _live_tensors()

    first = one_round()
    assert [one_round() for _ in range(2)] == [first, first]
    runner.copy_rows([0], [3])
    runner.clear_lengths(range(3, 4))
