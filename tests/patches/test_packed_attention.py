"""Per-document packed attention: documents of equal length are batched into one kernel call, and
the result equals each document attended alone (forward and gradients), in any length mix."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.patches import attention
from miles_core.patches.packing import PackedSequences, packed_sequences

register_cpu_ci(est_time=12, suite="stage-a-cpu")

HEADS, KV_HEADS, DIM = 4, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each document alone through causal sdpa (``[n, H, D]`` slices)."""
    outs, start = [], 0
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    for n in lengths:
        qd, kd, vd = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=0.3)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "lengths",
    [[5] * 40, [5, 6, 5, 6, 6, 1, 5, 1], [3, 9, 4], [17]],
    ids=["one-length", "mixed-repeats", "all-distinct", "single"],
)
def test_grouped_documents_equal_each_document_alone(lengths: list[int]) -> None:
    generator = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    q = torch.randn(total, HEADS, DIM, generator=generator, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(total, HEADS, DIM, generator=generator)

    grouped = attention._per_document(q, k, v, PackedSequences.from_lengths(lengths), 0.3, 0.0)
    grads = torch.autograd.grad((grouped * weight).sum(), (q, k, v))
    expected = reference(q, k, v, lengths)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))

    # the same fp32 kernel on the same rows: only its batching differs
    torch.testing.assert_close(grouped, expected, rtol=0, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_equal_lengths_take_one_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw))
    lengths = [5] * 30 + [6] * 10
    q = torch.randn(sum(lengths), HEADS, DIM)
    kv = torch.randn(sum(lengths), KV_HEADS, DIM)
    attention._per_document(q, kv, kv, PackedSequences.from_lengths(lengths), 0.3, 0.0)
    assert sorted(calls) == [torch.Size([10, HEADS, 6, DIM]), torch.Size([30, HEADS, 5, DIM])]


def test_a_model_prepared_for_packed_training_attends_per_document(tmp_path, miles_pm_factory, monkeypatch) -> None:
    """No patch needs the packing context on this Llama model: ``packed=True`` installs it anyway,
    so a packed row costs per document instead of a dense ``[T, T]`` mask, with the same logits."""
    from transformers import AutoModelForCausalLM

    from miles_core.assets.char_model import write_char_model
    from miles_core.patches import prepare_model

    model = AutoModelForCausalLM.from_pretrained(write_char_model(tmp_path / "model", 0)).eval()
    pm = miles_pm_factory(builtins=True)
    assert not prepare_model(model, pm=pm).packed_attention  # the negative control: HF's dense mask
    report = prepare_model(model, pm=pm, packed=True)
    assert report.packed_attention and report.packing_scope

    calls = []
    original = attention._per_document
    monkeypatch.setattr(attention, "_per_document", lambda *a: calls.append(a[3].lengths()) or original(*a))
    lengths = [4, 4, 6, 4]
    ids = torch.randint(3, 14, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=doc[None], use_cache=False).logits[0] for doc in ids.split(lengths)])
    assert calls and calls[0] == lengths
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def _against_own_prompt_copies(positions: torch.Tensor, branches: list[tuple[int, int, int]],
                               layouts: list[list[int]], seed: int) -> None:
    """``_per_document`` over a shared-prompt row equals, forward and gradients, the same attention
    with every response laid out after its own copy of the prompt (``layouts``: token offsets)."""
    generator = torch.Generator().manual_seed(seed)
    ctx = packed_sequences(positions[None], branches=branches)
    total = positions.numel()
    q = torch.randn(total, HEADS, DIM, generator=generator, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(total, HEADS, DIM, generator=generator)
    got = attention._per_document(q, k, v, ctx, 0.3, 0.0)
    grads = torch.autograd.grad((got * weight).sum(), (q, k, v))

    outputs = {}
    for layout in layouts:
        index = torch.tensor(layout)
        out = reference(q[index], k[index], v[index], [len(layout)])
        for row, token in enumerate(layout):
            outputs.setdefault(token, out[row])  # a prompt token's output: from its first layout
    want = torch.stack([outputs[t] for t in range(total)])
    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
    # the same fp32 kernel over the same keys; only the batching and the masking of other keys differ
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_a_branch_attends_to_its_prompt_then_to_itself() -> None:
    """A row [P r1 | r2 r3] + [Q s1 | s2]: each later response sees its root's prompt and itself,
    exactly as if it had been laid out after its own copy of the prompt. The first group's responses
    have one length (one masked block), the second's do not (a gather per response)."""
    # segments: [0, 6) = P(4) + r1(2), [6, 8) r2, [8, 10) r3, [10, 13) = Q(2) + s1(1), [13, 15) s2
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 0, 1, 2, 2, 3])
    branches = [(6, 0, 4), (8, 0, 4), (13, 10, 2)]
    layouts = [list(range(0, 6)), [0, 1, 2, 3, 6, 7], [0, 1, 2, 3, 8, 9], [10, 11, 12], [10, 11, 13, 14]]
    _against_own_prompt_copies(positions, branches, layouts, seed=9)


def _groups_then_a_document(groups: int, prefix: int, responses: int, length: int, document: int):
    """Positions, branches and own-prompt-copy layouts of ``groups`` shared-prompt groups laid out
    back to back, then a lone document."""
    span = prefix + responses * length
    positions, branches, layouts = [], [], []
    for g in range(groups):
        root = g * span
        positions += list(range(prefix + length)) + list(range(prefix, prefix + length)) * (responses - 1)
        prompt = list(range(root, root + prefix))
        for r in range(responses):
            start = root + prefix + r * length
            if r:
                branches.append((start, root, prefix))
            layouts.append(prompt + list(range(start, start + length)))
    layouts.append(list(range(groups * span, groups * span + document)))
    positions += list(range(document))
    return positions, branches, layouts


def _sdpa_calls(monkeypatch: pytest.MonkeyPatch, positions: list[int], branches: list[tuple[int, int, int]]) -> list:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((a[0].shape, kw.get("attn_mask") is not None)) or sdpa(*a, **kw))
    q, kv = torch.randn(len(positions), HEADS, DIM), torch.randn(len(positions), KV_HEADS, DIM)
    attention._per_document(q, kv, kv, packed_sequences(torch.tensor([positions]), branches=branches), 0.3, 0.0)
    return sorted(calls, key=str)


def test_groups_of_one_shape_take_one_masked_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five groups of a 3-token prompt and 4 responses of 2 tokens, then a lone 5-token document:
    the groups are one call over [5, H, 11, D] under the group mask, the document another, and the
    result equals each response after its own prompt copy."""
    positions, branches, layouts = _groups_then_a_document(5, 3, 4, 2, 5)
    _against_own_prompt_copies(torch.tensor(positions), branches, layouts, seed=3)
    assert _sdpa_calls(monkeypatch, positions, branches) == sorted(
        [(torch.Size([5, HEADS, 11, DIM]), True), (torch.Size([1, HEADS, 5, DIM]), False)], key=str)


def test_a_group_longer_than_a_block_is_attended_per_response(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``GROUP_BLOCK_MAX_TOKENS`` a block would compute the pairs across responses for nothing:
    the prompt with its first response is one causal call, the other responses one masked call."""
    prefix, responses, length = 30, 4, 10
    assert prefix + responses * length > attention.GROUP_BLOCK_MAX_TOKENS
    positions, branches, layouts = _groups_then_a_document(2, prefix, responses, length, 7)
    _against_own_prompt_copies(torch.tensor(positions), branches, layouts, seed=4)
    assert _sdpa_calls(monkeypatch, positions, branches) == sorted(
        [(torch.Size([2, HEADS, prefix + length, DIM]), False), (torch.Size([6, HEADS, length, DIM]), True),
         (torch.Size([1, HEADS, 7, DIM]), False)], key=str)


def test_branches_that_do_not_match_the_positions_are_refused() -> None:
    from miles_core.patches.packing import PackingError

    positions = torch.tensor([[0, 1, 2, 3, 2, 3]])
    packed_sequences(positions, branches=[(4, 0, 2)])
    with pytest.raises(PackingError, match="must continue the root"):
        packed_sequences(positions, branches=[(4, 0, 3)])
    with pytest.raises(PackingError, match="does not start a segment"):
        packed_sequences(positions, branches=[(3, 0, 2)])
