"""The embedded engine on a CUDA GPU: the tiny preset in fp32 and the small-gpu preset in bf16.

Skips without CUDA. The default runner there is the lean forward with its decode step replayed from
CUDA graphs; ``cuda_graphs=False`` runs the same step eagerly and must give the same tokens at
temperature 0 (the graph replays the very kernels the eager step launches). The 1e-5 log-prob contract is checked on CPU (test_engine.py); here the fp32
bound is the engine self-check's CUDA tolerance (5e-4): fla's Triton kernels run tf32 dot products
whatever torch's tf32 switches say (the reason the gdn-packing probe allows 2e-3 relative on CUDA),
and its recurrent decode kernel sums in another order than its chunked prefill. Measured on an H200
(2026-11-30): max 1.2e-4 over 384 tokens of log-probs around -5.5.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from miles_core.ci.register import register_cuda_ci
from miles_core.engine.base import GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.presets import preset_dir
from miles_core.engine.selfcheck import logprob_tolerance

register_cuda_ci(est_time=300, suite="stage-b-1-gpu-h200", labels=["gpu"])

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """One preset cache for the module: the small-gpu preset takes ~30 s to build."""
    return tmp_path_factory.mktemp("miles-cache")


def _requests(n: int, max_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest([(7 * i + j) % 256 for j in range(5 + i % 17)], SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True))
        for i in range(n)
    ]


@pytest.mark.parametrize("compile_decode", [True, False])
def test_tiny_fp32_on_gpu_matches_a_teacher_forced_forward(cache, compile_decode: bool) -> None:
    """The compiled step (the default on a GPU) and the eager one both give the model's log-probs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    requests = _requests(16, 24)
    config = EngineConfig(device="cuda", dtype="float32", max_batch_size=16, compile_decode=compile_decode)
    with Engine.from_pretrained(preset_dir("tiny", cache), config) as engine:
        assert engine.runner_info()["compiled_decode"] is compile_decode
        together = engine.generate(requests)
        alone = [engine.generate([r])[0] for r in requests[:4]]
        for request, completion in zip(requests, together):
            ids = torch.tensor([[*request.input_ids, *completion.token_ids]], device="cuda")
            with torch.inference_mode():
                logprobs = engine.model(ids).logits[0, len(request.input_ids) - 1 : -1].float().log_softmax(-1)
            expected = logprobs.gather(-1, torch.tensor(completion.token_ids, device="cuda")[:, None]).squeeze(-1).cpu()
            assert (expected - torch.tensor(completion.logprobs)).abs().max() <= logprob_tolerance("cuda")
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[:4]]


def test_small_gpu_preset_serves_64_concurrent_requests(cache) -> None:
    with Engine.from_pretrained(preset_dir("small-gpu", cache), EngineConfig(device="cuda", max_batch_size=64)) as engine:
        assert engine.dtype == torch.bfloat16
        completions = engine.generate(_requests(64, 32))
        assert engine.stats()["decode_steps"] < 64 * 32 // 4
    assert all(c.completion_tokens == 32 and all(-1e9 < lp <= 0 for lp in c.logprobs) for c in completions)


def _mixed(n: int, vocab: int = 256) -> list[GenerationRequest]:
    """Greedy requests whose lengths differ (the batch shrinks through several graph buckets); the
    250-token prompt grows the KV capacity past 256 (graphs recaptured on the new tensors)."""
    requests = [
        GenerationRequest([(11 * i + 3 * j) % vocab for j in range(3 + (i * 7) % 40)],
                          SamplingParams(max_tokens=4 + (i * 5) % 29, temperature=0.0, ignore_eos=True))
        for i in range(n)
    ]
    requests.append(GenerationRequest([(5 * j) % vocab for j in range(250)], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    return requests


@pytest.mark.parametrize("preset, dtype, state_dtype", [
    ("tiny", "float32", "float32"), ("small-gpu", "bfloat16", "float32"), ("small-gpu", "bfloat16", "bfloat16"),
])
def test_cuda_graphs_equal_the_eager_step_at_temperature_0(cache, preset: str, dtype: str, state_dtype: str) -> None:
    from miles_core.engine.loader import load_model

    loaded = load_model(preset_dir(preset, cache), dtype=dtype, device="cuda")
    requests = _mixed(40)
    with Engine(loaded, EngineConfig(max_batch_size=48, cuda_graphs=False, gdn_state_dtype=state_dtype)) as eager:
        assert eager.runner_info()["cuda_graphs"] is False
        by_eager = eager.generate(requests)
    with Engine(loaded, EngineConfig(max_batch_size=48, gdn_state_dtype=state_dtype)) as graphed:
        info = graphed.runner_info()
        assert info["runner"] == "lean" and info["cuda_graphs"] is True and info["gdn_state_dtype"] == state_dtype
        by_graph = graphed.generate(requests)
        again = graphed.generate(requests)  # replays only
        info = graphed.runner_info()
    assert info["graph_replays"] > 0 and info["graph_captures"] >= 2 and info["kv_capacity"] >= 512
    assert [c.token_ids for c in by_graph] == [c.token_ids for c in by_eager] == [c.token_ids for c in again]
    # Both paths launch the same kernels on the same padded shapes: equal up to cuBLAS choosing
    # another algorithm inside a capture (its workspace differs), i.e. the dtype's rounding.
    worst = max(abs(a - b) for g, e in zip(by_graph, by_eager) for a, b in zip(g.logprobs, e.logprobs))
    assert worst <= (1e-5 if dtype == "float32" else 5e-2)


def test_lean_and_hf_runners_on_gpu_match_a_teacher_forced_forward(cache) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    requests = _requests(8, 24)
    for runner in ("lean", "hf"):
        config = EngineConfig(device="cuda", dtype="float32", max_batch_size=8, runner=runner)
        with Engine.from_pretrained(preset_dir("tiny", cache), config) as engine:
            assert engine.runner == runner
            completions = engine.generate(requests)
            for request, completion in zip(requests, completions):
                ids = torch.tensor([[*request.input_ids, *completion.token_ids]], device="cuda")
                with torch.inference_mode():
                    logprobs = engine.model(ids).logits[0, len(request.input_ids) - 1 : -1].float().log_softmax(-1)
                expected = logprobs.gather(-1, torch.tensor(completion.token_ids, device="cuda")[:, None]).squeeze(-1).cpu()
                assert (expected - torch.tensor(completion.logprobs)).abs().max() <= logprob_tolerance("cuda")


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_in_place_recurrent_step_equals_fla_entry_point(state_dtype: torch.dtype, packed: bool, fresh: bool) -> None:
    """Decode (one token per row) and a packed prefill (segments of 1-40 tokens, ``cu_seqlens``) run
    fla's kernel with the states as their own final states, here rows 2-5 of eight (a slice, as the
    engine passes consecutive rows); the public entry point (new final states, copied back) runs the
    same kernel on the same inputs. The two tile the value axis differently (32 against fla's 8
    columns), which changes only the order of the fp32 sums over the key axis: states agree to
    their dtype's rounding and outputs to one bf16 rounding (``assert_close``'s defaults for those
    dtypes); tiles that overlapped would be far off, and the other rows must stay as they were. A
    bf16 state is loaded into fp32 and rounded once on the way back by both. ``fresh`` (a prefill of
    rows starting over): the step must not read the rows' stale states (NaN here) and equals the
    entry point given zero states."""
    from miles_core.engine import gdn_ops

    if gdn_ops.fla_ops() is None or gdn_ops._fla_recurrent_kernel() is None:
        pytest.skip("fla's recurrent kernel is not importable with the parameters the in-place step passes")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 5, 17, 40] if packed else [1] * 4
    tokens, hk, hv, dk, dv = sum(lengths), 8, 16, 128, 128
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if packed else None
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    qk = rand(tokens, 2 * hk, dk).bfloat16()
    v = rand(tokens, hv, dv).bfloat16()
    g = -torch.rand(tokens, hv, generator=gen, device="cuda")
    beta = torch.rand(tokens, hv, generator=gen, device="cuda").bfloat16()
    slots = rand(8, hv, dk, dv).to(state_dtype)
    in_place, by_copy = slots.clone(), slots.clone()
    if fresh:
        in_place[2:6], by_copy[2:6] = float("nan"), 0.0
    out = gdn_ops.fla_recurrent_step()(qk[:, :hk], qk[:, hk:], v, g, beta, in_place[2:6], cu, fresh=fresh)
    expected = gdn_ops._fla_entry_point(qk[:, :hk], qk[:, hk:], v, g, beta, by_copy[2:6], cu)
    assert not torch.equal(in_place[2:6], slots[2:6])  # the step did update the states
    assert torch.equal(in_place[:2], slots[:2]) and torch.equal(in_place[6:], slots[6:])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(in_place, by_copy)


def _triton_kernels():
    from miles_core.engine import lean_model

    kernels = lean_model._triton_kernels(torch.empty(0, device="cuda"))
    if kernels is None:
        pytest.skip("triton does not import")
    return kernels


@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_conv_step_equals_the_torch_one(with_bias: bool) -> None:
    """The decode step's conv and gates as one Triton kernel against the torch path it replaces
    (``conv_decode``, SiLU, the q/k/v split; ``sigmoid(b)``, ``-exp(A_log) * softplus(a + dt_bias)``),
    at the small-gpu shape with rows read from slices of a wider projection: the shifted windows are
    copies (equal); q, k, v and beta agree to one bf16 rounding of the same fp32 values
    (``assert_close``'s bf16 defaults; a wrong tap, weight, channel or head would be far off); g is
    fp32 through exp and log1p, a few fp32 ulps apart (rtol 1e-5)."""
    import torch.nn.functional as F

    from miles_core.engine import gdn_ops

    kernels = _triton_kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, key, value, taps, heads = 48, 1024, 2048, 4, 16
    channels = 2 * key + value
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").bfloat16()  # noqa: E731
    projection = rand(n, channels + 2 * heads + 64) * 4  # softplus inputs past its threshold (20) too
    x = projection[:, 32 : 32 + channels]
    b, a = projection[:, 32 + channels : 32 + channels + heads], projection[:, 32 + channels + heads : 32 + channels + 2 * heads]
    a_log, dt_bias = rand(heads), rand(heads)
    slots = rand(8 + n, taps, channels)
    weight, bias = rand(channels, 1, taps)[:, 0], rand(channels) if with_bias else None
    by_torch, by_triton = slots.clone(), slots.clone()
    expected = F.silu(gdn_ops.conv_decode(x, by_torch[4 : 4 + n], weight, bias)).bfloat16()
    q, k, v, g, beta = kernels.conv_step(x, b, a, by_triton[4 : 4 + n], weight, bias, a_log, dt_bias, key)
    assert torch.equal(by_triton, by_torch) and not torch.equal(by_triton, slots)
    torch.testing.assert_close(torch.cat([q, k, v], dim=1), expected)
    torch.testing.assert_close(beta, torch.sigmoid(b))
    torch.testing.assert_close(g, -a_log.float().exp() * F.softplus(a.float() + dt_bias), rtol=1e-5, atol=0)


def test_triton_kv_write_equals_the_indexed_assignment() -> None:
    """Keys and values read from strided views (as the attention region returns them) land where
    two indexed assignments put them, and nowhere else (a bit copy: equal)."""
    kernels = _triton_kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").bfloat16()  # noqa: E731
    tokens, heads, kv_heads, dim = 37, 8, 2, 128
    qk = rand(tokens, heads + kv_heads, dim)
    k = qk[:, heads:]
    v = rand(tokens, (heads + 2 * kv_heads) * dim)[:, (heads + kv_heads) * dim :].reshape(tokens, kv_heads, dim)
    rows = torch.randint(0, 6, (tokens,), generator=gen, device="cuda")
    positions = torch.randperm(64, generator=gen, device="cuda")[:tokens]  # distinct: no two writes collide
    keys, values = rand(6, kv_heads, 64, dim), rand(6, kv_heads, 64, dim)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[rows, :, positions] = k
    expected_values[rows, :, positions] = v
    kernels.kv_write(keys, values, k, v, rows, positions)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


@pytest.mark.parametrize("overlap_steps", [True, False])
def test_kv_growth_while_decoding_recaptures_the_graphs(cache, overlap_steps: bool) -> None:
    """Sequences that outgrow the initial KV capacity (256) mid-decode reallocate the state: every
    graph is dropped and recaptured while the last replay's logits may still be in use (overlapped
    steps). The engine must go on, and give the tokens of the eager step at temperature 0."""
    def tokens(cuda_graphs: bool) -> list[list[int]]:
        config = EngineConfig(device="cuda", max_batch_size=4, cuda_graphs=cuda_graphs, overlap_steps=overlap_steps)
        with Engine.from_pretrained(preset_dir("tiny", cache), config) as engine:
            requests = [
                GenerationRequest([(5 * i + j) % 256 for j in range(20 + i)],
                                  SamplingParams(max_tokens=300 + 20 * i, temperature=0.0, ignore_eos=True))
                for i in range(3)
            ]
            completions = engine.generate(requests)
            assert engine.runner_info()["kv_capacity"] >= 320 + 22 + 40
        assert [len(c.token_ids) for c in completions] == [300, 320, 340]
        return [c.token_ids for c in completions]

    assert tokens(cuda_graphs=True) == tokens(cuda_graphs=False)


@pytest.mark.parametrize("recurrent_width", [0, 64])
def test_packed_gdn_prefill_equals_the_padded_one(cache, recurrent_width: int) -> None:
    """The packed conv (a gather per tap) over the packed tokens against the padded torch conv,
    prompts prefilled in two chunks, the recurrence through fla's chunk kernel on both sides
    (``recurrent_width=0``) or, packed, through its recurrent kernel in place (every segment here is
    <= 64 tokens): the conv windows are copies of inputs (equal), and the logits agree to fp32 rounding
    carried through one forward (tf32 inside fla's chunk kernel). The recurrent kernel computes in
    fp32 throughout, so its states differ from the chunked ones by the chunk kernel's tf32 rounding:
    2 ** -11 relative per operand, twice per product (rtol 2e-3)."""
    from miles_core.engine import gdn_ops
    from miles_core.engine.lean_model import LeanModel
    from miles_core.engine.loader import load_model
    from miles_core.engine.state import SlotState

    if gdn_ops.fla_ops() is None:
        pytest.skip("fla's gated delta rule does not import")
    model = load_model(preset_dir("tiny", cache), dtype="float32", device="cuda").model
    prompts = [[(5 * i + j) % 256 for j in range(3 + 11 * i)] for i in range(4)]

    def prefill(packed: bool) -> tuple[list[torch.Tensor], SlotState]:
        lean = LeanModel(model, max_model_len=256, max_rows=4)
        assert lean.packed_gdn_prefill
        lean.packed_gdn_prefill = packed
        lean.recurrent_prefill_width = recurrent_width if packed else 0
        state = SlotState(lean.state_shapes(), max_slots=4, staging=0, max_model_len=256, dtype=torch.float32,
                          device=torch.device("cuda"), keys_transposed=False)
        logits = []
        with torch.inference_mode():
            state.reset_rows(list(range(4)))
            halves = [(p[: len(p) // 2 + 1], p[len(p) // 2 + 1 :]) for p in prompts]
            logits.append(lean.prefill(state, lean.prefill_batch(list(range(4)), [0] * 4, [h[0] for h in halves])))
            rows = [i for i, h in enumerate(halves) if h[1]]
            logits.append(lean.prefill(state, lean.prefill_batch(rows, [len(halves[i][0]) for i in rows],
                                                                 [halves[i][1] for i in rows])))
        return logits, state

    (packed, a), (padded, b) = prefill(True), prefill(False)
    assert torch.equal(a.conv, b.conv)
    for x, y in zip(packed, padded):
        assert (x.log_softmax(-1) - y.log_softmax(-1)).abs().max() <= logprob_tolerance("cuda")
    if recurrent_width:
        torch.testing.assert_close(a.recurrent, b.recurrent, rtol=2e-3, atol=2e-4)
    else:
        torch.testing.assert_close(a.recurrent, b.recurrent, rtol=1e-3, atol=1e-4)
