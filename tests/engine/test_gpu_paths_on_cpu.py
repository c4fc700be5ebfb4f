"""The GPU code paths of the lean forward, checked on the CPU against the CPU paths.

On CUDA the lean forward attends through SDPA (query heads grouped per KV head), sends the Gated
DeltaNet kernels to fla (packed variable-length prefill with per-segment initial states, fused
recurrent decode whose final state is copied back into the slot), and replays decode steps whose
batch is padded up to a CUDA-graph bucket. None of that needs a GPU to be *shaped* right: here the
SDPA branch runs on CPU tensors, fla is replaced by a stand-in with fla's documented signature
and semantics built from transformers' torch kernels, and a padded step runs eagerly. Each must
give the logits of the CPU path (same fp32 arithmetic up to summation order: <= 1e-5).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import types
import weakref

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine import gdn_ops
from miles_core.engine.cuda_graphs import DecodeGraphs, batch_buckets
from miles_core.engine.lean_model import LeanModel
from miles_core.engine.state import SlotState

register_cpu_ci(est_time=12, suite="stage-a-cpu")

PROMPTS = [[5], [1, 2, 3], list(range(40, 110)), [random.Random(0).randrange(256) for _ in range(33)]]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from miles_core.engine.loader import load_model

    torch.set_num_threads(1)
    return load_model(tiny_dir, dtype="float32", device="cpu").model


def _run(model, *, sdpa: bool = False, chunk: int | None = None, steps: int = 6, pad_to: int | None = None,
         keys_transposed: bool | None = None, fused_norms: bool = False, packed: bool | None = None,
         perm: list[int] | None = None) -> list[torch.Tensor]:
    """Prefill PROMPTS (in chunks of ``chunk`` tokens) and decode ``steps`` fixed tokens; every step's
    logits, in prompt order. Prompt ``i`` lives in row ``perm[i]`` (default: row ``i``). Keys are
    stored as the runner stores them for that attention path unless ``keys_transposed`` says;
    ``packed`` overrides the model's choice of GDN prefill."""
    lean = LeanModel(model, max_model_len=512)
    lean.sdpa = sdpa
    lean.fuse_norms(fused_norms)
    if packed is not None:
        lean.packed_gdn_prefill = packed
    n = len(PROMPTS)
    perm = perm or list(range(n))
    rows = max(n, pad_to or 0)
    transposed = not sdpa if keys_transposed is None else keys_transposed
    state = SlotState(lean.state_shapes(), max_slots=rows, staging=0, max_model_len=512, dtype=torch.float32,
                      device=torch.device("cpu"), keys_transposed=transposed)
    out = []
    with torch.inference_mode():
        state.reset_rows(list(range(n)))
        done = [0] * n
        while any(d < len(p) for d, p in zip(done, PROMPTS)):
            live = [i for i in range(n) if done[i] < len(PROMPTS[i])]
            take = [PROMPTS[i][done[i] : done[i] + (chunk or len(PROMPTS[i]))] for i in live]
            out.append(lean.prefill(state, lean.prefill_batch([perm[i] for i in live], [done[i] for i in live], take)))
            for i, t in zip(live, take):
                done[i] += len(t)
        prompt_of = {row: i for i, row in enumerate(perm)}
        for step in range(steps):
            ids = torch.tensor([(7 * step + 3 * prompt_of.get(r, r)) % 256 for r in range(rows)])
            span = max(len(p) for p in PROMPTS) + step + 1
            logits = lean.decode(state, ids, span)[perm]
            if pad_to:
                state.lengths[n:pad_to] = 0  # what DecodeGraphs does after a padded replay
            out.append(logits)
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    # torch's max, not Python's: a NaN anywhere makes the result NaN (Python's max may skip it)
    return float(torch.stack([(x.log_softmax(-1) - y.log_softmax(-1)).abs().max() for x, y in zip(a, b)]).max())


def test_the_cuda_attention_and_norm_branches_equal_the_cpu_ones(tiny_model) -> None:
    reference = _run(tiny_model, sdpa=False, chunk=16)  # how the CPU runs: transposed keys, matmuls
    for sdpa, transposed in ((True, False), (True, True), (False, False)):
        assert _close(_run(tiny_model, sdpa=sdpa, chunk=16, keys_transposed=transposed), reference) <= 1e-5
    assert _close(_run(tiny_model, sdpa=True, chunk=16, fused_norms=True), reference) <= 1e-5  # as on CUDA


class _FlaStandIn:
    """fla's two entry points with fla's documented semantics, on transformers' torch kernels."""

    def __init__(self) -> None:
        from transformers.models.qwen3_5 import modeling_qwen3_5

        from miles_core.patches.hf_functions import defined_function

        self.recurrent = defined_function(modeling_qwen3_5.torch_recurrent_gated_delta_rule, "torch_recurrent_gated_delta_rule")
        self.chunk = defined_function(modeling_qwen3_5.torch_chunk_gated_delta_rule, "torch_chunk_gated_delta_rule")
        assert self.recurrent is not None and self.chunk is not None
        self.calls: list[str] = []
        self.zero_starts = 0  # calls without an initial state (fla's zeros)

    def _initial(self, initial_state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """fla's reading of ``initial_state=None``: a zero state for every sequence."""
        if initial_state is not None:
            return initial_state
        self.zero_starts += 1
        n = v.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        return v.new_zeros((n, v.shape[-2], k.shape[-1], v.shape[-1]), dtype=torch.float32)

    def fused_recurrent_gated_delta_rule(self, *, q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, cu_seqlens=None):
        assert scale == k.shape[-1] ** -0.5 and output_final_state and use_qk_l2norm_in_kernel
        initial_state = self._initial(initial_state, k, v, cu_seqlens)
        assert initial_state.dtype == torch.float32
        q, k = _grouped_value_heads(q, k, v)
        if cu_seqlens is None:  # decode: one token for each of a batch of rows
            assert initial_state.shape[0] == q.shape[0]
            self.calls.append("recurrent")
            return self.recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state.clone(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        assert q.shape[0] == 1 and len(cu_seqlens) - 1 == initial_state.shape[0]  # packed segments
        self.calls.append("recurrent packed")
        outs, finals = [], []
        for i, (start, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
            o, f = self.recurrent(q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end],
                                  beta=beta[:, start:end], initial_state=initial_state[i : i + 1].clone(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, dim=1), torch.cat(finals)

    def chunk_gated_delta_rule(self, *, q, k, v, g, beta, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu=None):
        initial_state = self._initial(initial_state, k, v, cu_seqlens)
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and len(cu_seqlens) - 1 == initial_state.shape[0]
        assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        self.calls.append("chunk")
        q, k = _grouped_value_heads(q, k, v)
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            o, f = self.chunk(q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end], beta=beta[:, start:end],
                              initial_state=initial_state[i : i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, dim=1), torch.cat(finals)


def _grouped_value_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla reads value head ``j`` against key head ``j // (HV // H)``; transformers' torch kernels
    take equal head counts in some releases (5.17), so the key heads are expanded for them."""
    rep = v.shape[-2] // k.shape[-2]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2))


def _use_fla_stand_in(monkeypatch: pytest.MonkeyPatch) -> _FlaStandIn:
    """Route the lean forward's GDN kernels to :class:`_FlaStandIn`, as on CUDA with fla."""
    stand_in = _FlaStandIn()
    monkeypatch.setattr(gdn_ops, "fla_ops", lambda: stand_in)
    monkeypatch.setattr(gdn_ops, "use_fla", lambda t: True)
    monkeypatch.setattr(gdn_ops, "_chunk_parameters", lambda: frozenset({"cu_seqlens_cpu"}))
    return stand_in


def test_fla_glue_equals_the_torch_kernels(tiny_model, monkeypatch) -> None:
    """The GDN prefill through fla's chunked kernel, packed (the conv over gathered taps) or padded,
    and decode through its recurrent kernel: the CPU path's logits, continuations included (prompts
    of 70 and 33 tokens in chunks of 24 continue from stored windows and states)."""
    from miles_core.engine import lean_model

    reference = _run(tiny_model, chunk=24)
    stand_in = _use_fla_stand_in(monkeypatch)
    monkeypatch.setattr(lean_model, "RECURRENT_PREFILL_WIDTH", 0)  # the chunked form for every batch
    for packed in (True, False):
        stand_in.calls.clear()
        assert _close(_run(tiny_model, chunk=24, packed=packed), reference) <= 1e-5
        assert {"chunk", "recurrent"} <= set(stand_in.calls) and "recurrent packed" not in stand_in.calls


def test_rows_out_of_order_are_gathered_and_scattered(tiny_model, monkeypatch) -> None:
    """Prefill batches over consecutive rows read and write the rows' states in place (slices);
    others gather and scatter them. Prompts in rows 3, 0, 2, 1 (every batch of several prompts out
    of order) give the logits of prompts in rows 0-3, packed (both GDN kernels) and padded."""
    from miles_core.engine import lean_model

    perm = [3, 0, 2, 1]
    reference = _run(tiny_model, chunk=24)
    assert _close(_run(tiny_model, chunk=24, perm=perm), reference) <= 1e-5
    _use_fla_stand_in(monkeypatch)
    for width in (0, 30):
        monkeypatch.setattr(lean_model, "RECURRENT_PREFILL_WIDTH", width)
        assert _close(_run(tiny_model, chunk=24, perm=perm), reference) <= 1e-5


def test_zero_initial_states_are_one_buffer_grown_to_the_largest_batch() -> None:
    """The in-place step hands fla's kernel zeros for segments that start over (its variant without
    an initial state runs slower): views of one buffer, grown for a larger batch and reused for a
    smaller one, replaced for another dtype, never the stale states it is given the shape of."""
    zeros = gdn_ops._ZeroStates()
    stale = torch.full((5, 4, 3, 3), float("nan"))
    small, big, again = zeros.like(stale[:2]), zeros.like(stale), zeros.like(stale[:3])
    assert [t.shape[0] for t in (small, big, again)] == [2, 5, 3]
    assert torch.count_nonzero(big) == 0 and again.data_ptr() == big.data_ptr()
    other = zeros.like(stale.bfloat16())
    assert other.dtype == torch.bfloat16 and torch.count_nonzero(other) == 0 and other.data_ptr() != big.data_ptr()


@pytest.mark.parametrize("kernel", ["torch", "fla chunked", "fla recurrent"])
def test_rows_starting_over_never_read_their_stale_recurrent_states(tiny_model, monkeypatch, kernel: str) -> None:
    """``reset_rows`` leaves a row's recurrent state as its last sequence left it (zeroing it costs a
    write of 18.9 MB a row in ``small-gpu``, and reading it back as much again), so a prefill from
    position 0 must not read it: in a batch of fresh rows fla is asked for zero initial states, and
    beside a row that continues the fresh rows are zeroed first. Stale states of NaN give the logits
    of clean ones; the control: a continuing row's NaN state does reach its logits."""
    from miles_core.engine import lean_model

    stand_in = None
    if kernel != "torch":
        stand_in = _use_fla_stand_in(monkeypatch)
        monkeypatch.setattr(lean_model, "RECURRENT_PREFILL_WIDTH", 0 if kernel == "fla chunked" else 64)
    lean = LeanModel(tiny_model, max_model_len=128)
    assert lean.packed_gdn_prefill == (stand_in is not None)
    first, continued, fresh = PROMPTS[2][:10], PROMPTS[2][10:30], PROMPTS[3]

    def run(stale: list[int], stale_between: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Rows 0 and 1 start ``first`` and ``PROMPTS[1]``, then row 0 continues beside row 2
        starting ``fresh``; rows in ``stale`` hold NaN states from an earlier sequence, rows in
        ``stale_between`` get NaN states between the two batches."""
        state = SlotState(lean.state_shapes(), max_slots=3, staging=0, max_model_len=128, dtype=torch.float32,
                          device=torch.device("cpu"), keys_transposed=True)
        with torch.inference_mode():
            state.recurrent[:, stale] = float("nan")
            state.reset_rows([0, 1, 2])
            out = [lean.prefill(state, lean.prefill_batch([0, 1], [0, 0], [first, PROMPTS[1]]))]
            state.recurrent[:, list(stale_between)] = float("nan")
            out.append(lean.prefill(state, lean.prefill_batch([0, 2], [len(first), 0], [continued, fresh])))
        return out

    clean = run([])
    assert stand_in is None or stand_in.zero_starts > 0  # the first batch handed fla no initial state
    assert _close(run([0, 1, 2]), clean) == 0.0
    poisoned = run([], stale_between=(0,))[1]  # a continuing row's state is read: NaN there reaches its logits
    assert poisoned[0].isnan().all() and torch.equal(poisoned[1], clean[1][1])


def test_packed_conv_taps_equal_the_padded_conv() -> None:
    """The packed prefill's conv (a gather per tap from the stored windows and the new inputs)
    against the padded one, segments shorter and longer than the kernel, continuing non-zero
    windows: the same products summed in the same order (equal outputs), the same new windows."""
    gen = torch.Generator().manual_seed(0)
    lengths, kernel, channels = [1, 2, 7, 3, 12], 4, 6
    segments, width = len(lengths), max(lengths)
    x = torch.randn(sum(lengths), channels, generator=gen)
    windows = torch.randn(segments, kernel, channels, generator=gen)
    weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    taps = gdn_ops.conv_taps(cu, int(cu[-1]), kernel)
    out, new_windows = gdn_ops.conv_prefill_taps(x, windows, taps, taps[cu[1:] - 1], weight, bias)
    padded = torch.zeros(segments, width, channels)
    for s, (start, end) in enumerate(itertools.pairwise(cu.tolist())):
        padded[s, : end - start] = x[start:end]
    expected, expected_windows = gdn_ops.conv_prefill(padded, windows, torch.tensor(lengths), weight, bias)
    assert torch.equal(out, torch.cat([expected[s, :n] for s, n in enumerate(lengths)]))
    assert torch.equal(new_windows, expected_windows)


def test_short_segments_prefill_through_fla_recurrent_kernel(tiny_model, monkeypatch) -> None:
    """Packed prefills whose segments are all at most ``recurrent_prefill_width`` long run the
    recurrence token by token (fla's recurrent kernel over the packed segments, each from its row's
    state), longer ones chunked: both give the CPU path's logits, continuations included."""
    from miles_core.engine import lean_model

    reference, reference_40 = _run(tiny_model, chunk=24), _run(tiny_model, chunk=40)
    stand_in = _use_fla_stand_in(monkeypatch)
    monkeypatch.setattr(lean_model, "RECURRENT_PREFILL_WIDTH", 30)
    recurrent = _run(tiny_model, chunk=24)  # every batch <= 24 tokens wide
    assert "recurrent packed" in stand_in.calls and "chunk" not in stand_in.calls
    assert _close(recurrent, reference) <= 1e-5
    stand_in.calls.clear()
    mixed = _run(tiny_model, chunk=40)  # the first batch is 40 wide (chunked), the continuation 30 (recurrent)
    assert {"recurrent packed", "chunk"} <= set(stand_in.calls)
    assert _close(mixed, reference_40) <= 1e-5
    stand_in.calls.clear()
    monkeypatch.setattr(lean_model, "RECURRENT_PREFILL_TOKENS", 40)
    capped = _run(tiny_model, chunk=24)  # 52 tokens first (chunked), then 33 and 22 (recurrent)
    kernels = [c for c in stand_in.calls if c in ("chunk", "recurrent packed")]
    assert kernels == sorted(kernels) and {"chunk", "recurrent packed"} <= set(kernels)  # chunked, then recurrent
    assert _close(capped, reference) <= 1e-5


def test_the_torch_chunk_rule_is_transformers_own_function_not_its_binding() -> None:
    # the module-level name may be a wrapper (or, with the kernels package, a module object) that
    # routes CUDA tensors to fla; the engine's fallback must be the pure-torch function itself
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = gdn_ops.torch_chunk_rule()
    assert isinstance(rule, types.FunctionType) and rule.__code__.co_name == "torch_chunk_gated_delta_rule"
    assert rule.__globals__ is vars(modeling_qwen3_5)


def test_rows_padding_a_decode_batch_leave_the_real_rows_alone(tiny_model) -> None:
    """A CUDA graph captured for 8 rows serving 4 computes 4 free rows too: the real rows' logits
    and states must not depend on them."""
    assert _close(_run(tiny_model, pad_to=8, steps=10), _run(tiny_model, steps=10)) <= 1e-6


def test_batch_buckets_cover_every_batch_size() -> None:
    for max_rows in (1, 3, 64, 300, 880):
        buckets = batch_buckets(max_rows)
        assert buckets[-1] == max_rows and buckets == sorted(set(buckets))
        assert all(any(b >= n for b in buckets) for n in range(1, max_rows + 1))
    assert batch_buckets(64)[:5] == [1, 2, 4, 8, 16]


class _PoolRuntime:
    """``torch.cuda``'s graph API as :class:`DecodeGraphs` calls it, on the host, keeping the
    caching allocator's rule that broke a GPU run: a capture may not go into a pool whose graphs
    were all released (PyTorch asserts ``use_count > 0``; blocks of the pool were still alive)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # pool -> graphs captured into it and not yet released
        self.captured_into: list[int] = []

    def graph_pool_handle(self) -> int:
        handle = len(self.live)
        self.live[handle] = 0
        return handle

    @contextlib.contextmanager
    def graph(self, graph: object, pool: int, capture_error_mode: str):
        if pool in self.captured_into and self.live[pool] == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (capture into a released pool)")
        self.captured_into.append(pool)
        self.live[pool] += 1
        weakref.finalize(graph, self._release, pool)
        yield

    def _release(self, pool: int) -> None:
        self.live[pool] -= 1

    class CUDAGraph:
        def replay(self) -> None:
            pass

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    def current_stream(self) -> _PoolRuntime.Stream:
        return self.Stream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def device(self, device: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_graphs_dropped_when_the_state_grows_are_recaptured_into_a_new_pool(monkeypatch) -> None:
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    runtime = _PoolRuntime()
    state = types.SimpleNamespace(max_slots=4, device=torch.device("cpu"), generation=0, capacity=256,
                                  lengths=torch.zeros(4, dtype=torch.long))
    graphs = DecodeGraphs(lambda _state, ids, _span: ids[:, None] * 2.0, state, runtime)
    graphs.run(torch.tensor([1, 2]), 10)  # eager run and capture
    in_flight = graphs.run(torch.tensor([1, 2]), 10)  # a replay's logits, still held (overlapped steps)
    state.generation += 1  # the KV capacity grew: every graph is dropped
    logits = graphs.run(torch.tensor([3, 4]), 10)
    assert graphs.captures == 2 and len(set(runtime.captured_into)) == 2
    assert logits.tolist() == [[6.0], [8.0]] and in_flight.tolist() == [[2.0], [4.0]]


def test_compiled_decode_regions_trace_once_per_layer_kind_and_equal_the_plain_step() -> None:
    """On a GPU the decode step's (and prefill's) token-wise regions run through ``torch.compile``:
    each must be traced once for all layers of its kind, all graph buckets and prefill lengths
    (else every layer recompiles, and past dynamo's recompile limit it silently falls back to
    eager), and the compiled forward must give the plain one's logits. Here with ``aot_eager`` (dynamo's trace plus AOT functionalisation of the
    conv window's in-place update, run as aten ops): the fp32 arithmetic of the plain step up to
    the summation order of decomposed ops (<= 1e-5, as the other paths in this file)."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from miles_core.engine.presets import TINY

    text = {**TINY.text_config, "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(vocab_size=256, **text)).eval()

    def decode_steps(compiled: bool) -> list[torch.Tensor]:
        lean = LeanModel(model, max_model_len=128, max_rows=16)
        lean.sdpa = True
        lean.fuse_norms(True)
        if compiled:
            lean.compile_decode("aot_eager")
        state = SlotState(lean.state_shapes(), max_slots=16, staging=0, max_model_len=128, dtype=torch.float32,
                          device=torch.device("cpu"), keys_transposed=False)
        out = []
        with torch.inference_mode():
            state.reset_rows(list(range(16)))
            lean.prefill(state, lean.prefill_batch(list(range(16)), [0] * 16, [[i + 1, 2 * i + 3, 5] for i in range(16)]))
            for step, n in enumerate([16, 8, 2, 4, 16, 2]):  # graph buckets, shrinking and growing
                ids = torch.tensor([(7 * step + 3 * i) % 256 for i in range(n)])
                out.append(lean.decode(state, ids, 4 + step))
        return out

    torch._dynamo.reset()
    counters.clear()
    plain = decode_steps(compiled=False)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = decode_steps(compiled=True)
    # a region finishes the previous layer and starts the next: decode traces gdn_in after nothing
    # (layer 0) and after attention (layer 2), attention_in after GDN (layers 1 and 3), logits after
    # attention; the padded prefill adds gdn_project after nothing and after attention and shares
    # attention_in (its logits run plain)
    assert counters["stats"]["unique_graphs"] == 6
    assert _close(compiled, plain) <= 1e-5
    torch._dynamo.reset()
