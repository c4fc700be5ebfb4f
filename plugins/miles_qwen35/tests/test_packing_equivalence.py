"""Packed documents [A, B, C] + padding give each document's own logits and gradients.

For every GDN architecture this plugin claims in the installed transformers, on a tiny random
model (one GDN layer, one attention layer), float32: with the plugin the max abs difference is
<= 1e-5; without it the same comparison fails (negative control); and activation checkpointing
(which replays layers in the backward pass) gives the same gradients.

prepare_model also switches sdpa to per-document packed attention (miles_core.patches.attention):
a packed forward takes that branch and equals transformers' masked sdpa path on the same weights;
an unpacked forward is plain sdpa. Spies make both assertions unable to pass vacuously.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from miles_qwen35.patch import is_gated_deltanet
from miles_qwen35.tiny import tiny_model

from miles_core.ci.register import register_cpu_ci
from miles_core.patches import attention, prepare_model
from miles_core.patches.packing import PACKING_KWARG

register_cpu_ci(est_time=13, suite="stage-a-cpu")

TOL = 1e-5


def packed_run(model: torch.nn.Module, docs: SimpleNamespace) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-document logits of the packed row, and the gradients of a loss over the documents."""
    model.zero_grad(set_to_none=True)
    logits = model(docs.ids, position_ids=docs.position_ids, use_cache=False).logits
    per_doc = [logits[:, s] for s in docs.slices]
    sum(loss(lg, docs, s) for lg, s in zip(per_doc, docs.slices)).backward()
    return [lg.detach() for lg in per_doc], grads(model)


def alone_run(model: torch.nn.Module, docs: SimpleNamespace) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each document on its own; the gradients of the same loss, accumulated over documents."""
    model.zero_grad(set_to_none=True)
    out = []
    for ids, s in zip(docs.alone, docs.slices):
        logits = model(ids, use_cache=False).logits
        loss(logits, docs, s).backward()
        out.append(logits.detach())
    return out, grads(model)


def loss(logits: torch.Tensor, docs: SimpleNamespace, part: slice) -> torch.Tensor:
    """A document's share of the batch's token-mean cross entropy (a trainer's loss)."""
    labels = docs.labels[0, part]
    return torch.nn.functional.cross_entropy(logits[0], labels, reduction="sum") / docs.num_real_tokens


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_diffs(a: tuple, b: tuple) -> tuple[float, float]:
    logits = max((x - y).abs().max().item() for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    gradients = max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])
    return logits, gradients


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_packed_equals_per_document(qwen_pm, docs, arch: str, checkpointing: bool) -> None:
    model = tiny_model(arch).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    report = prepare_model(model)
    assert arch in report["gdn-packing"].groups
    seen = []
    gdn = next(m for m in model.modules() if is_gated_deltanet(m))
    gdn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get(PACKING_KWARG)), with_kwargs=True)

    packed = packed_run(model, docs)
    # checkpointing replays the layer in the backward pass, with the very same context object
    assert len(seen) == (2 if checkpointing else 1) and seen[0] is not None
    assert all(ctx is seen[0] for ctx in seen)
    logit_diff, grad_diff = max_diffs(packed, alone_run(model, docs))
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)


def test_without_the_plugin_documents_mix(docs, arch: str) -> None:
    model = tiny_model(arch).train()  # not prepared: transformers' own kernels on the packed row
    logit_diff, grad_diff = max_diffs(packed_run(model, docs), alone_run(model, docs))
    assert logit_diff > 100 * TOL and grad_diff > 100 * TOL, (logit_diff, grad_diff)


def test_the_multimodal_qwen3_5_model_packs_text(qwen_pm, docs) -> None:
    from miles_qwen35.tiny import TINY_CONFIG
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TINY_CONFIG, vision_config=vision))
    model.train()
    prepare_model(model)
    logit_diff, grad_diff = max_diffs(packed_run(model, docs), alone_run(model, docs))
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)


@pytest.fixture
def per_document_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = attention._per_document

    def spy(q, k, v, ctx, scale, dropout):
        calls.append(ctx.num_sequences)
        return original(q, k, v, ctx, scale, dropout)

    monkeypatch.setattr(attention, "_per_document", spy)
    return calls


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_packed_attention_equals_the_masked_sdpa_path(qwen_pm, docs, per_document_calls, checkpointing) -> None:
    model = tiny_model("qwen3_5").train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    report = prepare_model(model)
    assert report.packed_attention and model.config._attn_implementation == attention.ATTENTION_NAME

    packed = packed_run(model, docs)
    # A, B, C and three 1-token pad segments; the replay under checkpointing runs it again
    assert per_document_calls == [6] * (2 if checkpointing else 1)

    model.set_attn_implementation("sdpa")  # same weights, transformers' block-diagonal mask
    masked = packed_run(model, docs)
    assert len(per_document_calls) == (2 if checkpointing else 1)
    logit_diff, grad_diff = max_diffs(packed, masked)
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diff)


def test_unpacked_forwards_are_plain_sdpa(qwen_pm, docs, per_document_calls) -> None:
    model = tiny_model("qwen3_5").eval()
    reference = tiny_model("qwen3_5").eval()  # same weights, never prepared
    prepare_model(model)
    batch = docs.ids[:, :40].repeat(2, 1)
    with torch.no_grad():
        assert torch.equal(model(batch, use_cache=False).logits, reference(batch, use_cache=False).logits)
    assert per_document_calls == []


def test_models_not_on_sdpa_keep_their_attention(qwen_pm) -> None:
    model = tiny_model("qwen3_5")
    model.set_attn_implementation("eager")
    assert not prepare_model(model).packed_attention
    assert model.config._attn_implementation == "eager"


def _shared_prompt_docs(vocab: int):
    from miles_core.rl.algorithms.batch import TrainDocument

    gen = torch.Generator().manual_seed(11)
    docs = []
    # prompts shorter and longer than the causal-conv window, responses of 1-70 tokens (past one
    # 64-token chunk), a tool token inside one response, a group of one
    for prompt_len, sizes in ((2, (1, 3, 2)), (9, (70, 1)), (5, (4,)), (30, (2, 6, 1, 1))):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
        for i, n in enumerate(sizes):
            response = torch.randint(1, vocab, (n,), generator=gen).tolist()
            mask = tuple(0 if (j == 1 and n == 3) else 1 for j in range(n))
            docs.append(TrainDocument(tuple(prompt + response), n, mask, tuple(-2.0 - 0.01 * j for j in range(n)),
                                      float(i % 3) - 1.0))
    order = torch.randperm(len(docs), generator=gen).tolist()
    return [docs[i] for i in order]


def test_a_shared_prompt_row_updates_like_whole_documents(qwen_pm, arch: str) -> None:
    """A GRPO group laid out after one prompt copy (each response's conv window reads the prompt's
    last inputs, its recurrent state starts from the prompt's final state) gives the update of the
    same documents laid out whole: loss and gradients (fp32; the two layouts differ in which
    chunks and batches the same terms are summed in, rel 1e-5), through GDN and attention layers."""
    from miles_core.patches.packing import packed_sequences
    from miles_core.rl.algorithms.batch import pack_documents
    from miles_core.rl.config import AlgorithmSection
    from miles_core.rl.policy_update import UpdateSettings, policy_update
    from miles_core.rl.trainers.packing_guard import branches_supported

    model = tiny_model(arch)
    assert prepare_model(model, pm=qwen_pm, packed=True).packed_attention
    assert branches_supported(model)
    vocab = model.config.get_text_config().vocab_size
    docs = _shared_prompt_docs(vocab)
    (row,) = pack_documents(docs, 4096, share_prompts=True)
    assert row.branches and row.num_tokens < sum(len(d.token_ids) for d in docs)

    def forward(row):
        extra = {PACKING_KWARG: packed_sequences(row.position_ids[None], branches=row.branches)} if row.branches else {}
        return model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                     logits_to_keep=row.positions, **extra).logits[0]

    results = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        stats = policy_update(docs, forward, torch.optim.SGD(model.parameters(), lr=0.0), model.parameters(),
                              UpdateSettings(AlgorithmSection(entropy_coef=0.01), 1.0, 4096, True, share_prompts=share))
        results[share] = stats, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    (shared, g_shared), (whole, g_whole) = results[True], results[False]
    for key in ("loss", "entropy", "approx_kl"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(g_shared, g_whole, rtol=1e-5, atol=1e-6)


def test_a_shared_prompt_row_without_its_branches_differs(qwen_pm, arch: str) -> None:
    """Negative control: the same row with its responses taken as independent segments (no
    branches: no prompt before them, a zero state) gives other logits."""
    from miles_core.patches.packing import packed_sequences
    from miles_core.rl.algorithms.batch import pack_documents

    model = tiny_model(arch)
    prepare_model(model, pm=qwen_pm, packed=True)
    (row,) = pack_documents(_shared_prompt_docs(model.config.get_text_config().vocab_size), 4096, share_prompts=True)
    ctx = packed_sequences(row.position_ids[None], branches=row.branches)
    with torch.no_grad():
        honoured = model(row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                         **{PACKING_KWARG: ctx}).logits
        ignored = model(row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits
    assert not torch.allclose(honoured, ignored, atol=1e-3)
