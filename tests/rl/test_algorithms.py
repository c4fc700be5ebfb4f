import math

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.algorithms import (
    TrainDocument,
    clipped_policy_loss,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    pack_documents,
    token_logprobs,
)
from miles_core.rl.algorithms.builtin import BUILTIN_ALGORITHMS
from miles_core.rl.config import AlgorithmSection
from miles_core.rl.policy_update import UpdateSettings, policy_update, split_minibatches

register_cpu_ci(est_time=9, suite="stage-a-cpu")


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    expected_first = (1 - 0.25) / (math.sqrt(0.25 * 0.75) + 1e-6)
    assert adv[0].item() == pytest.approx(expected_first, rel=1e-5)
    assert adv[:4].sum().item() == pytest.approx(0.0, abs=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal in a uniform group
    assert group_advantages(rewards, 4, scale_by_std=False)[0].item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_clipped_loss_clips_only_in_the_direction_that_helps():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = clipped_policy_loss(new, old, adv, torch.ones(4), clip_low=0.2, clip_high=0.2)
    # ratio 1.5, A>0: clipped to 1.2; ratio 1.5, A<0: unclipped 1.5 (pessimistic);
    # ratio 0.5, A>0: unclipped 0.5; ratio 0.5, A<0: clipped 0.8
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert stats["clipped"].tolist() == [1.0, 0.0, 0.0, 1.0]
    masked, _ = clipped_policy_loss(new, old, adv, torch.tensor([1, 0, 1, 0]), clip_low=0.2, clip_high=0.2)
    assert masked.tolist() == pytest.approx([-1.2, 0.0, -0.5, 0.0])


def test_kl_and_logprobs():
    lp = torch.log(torch.tensor([0.5, 0.25]))
    assert torch.allclose(kl_k3(lp, lp), torch.zeros(2))
    assert (kl_k3(lp, lp.flip(0)) > 0).all()
    logits = torch.randn(3, 5)
    targets = torch.tensor([1, -100, 4])
    out = token_logprobs(logits, targets, temperature=2.0)
    ref = (logits / 2).log_softmax(-1)
    assert out[0] == ref[0, 1] and out[1] == 0 and out[2] == ref[2, 4]


def _doc(tokens, response, adv=1.0):
    return TrainDocument(tuple(tokens), response, (1,) * response, tuple([-0.5] * response), adv)


def test_packing_lists_trained_targets_and_restarts_positions():
    a, b = _doc([10, 11, 12, 13], 2, 1.0), _doc([20, 21, 22], 1, -1.0)
    (row,) = pack_documents([a, b], max_tokens_per_row=16)
    assert row.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    # each trained target with the position whose logits predict it (never across documents)
    assert list(zip(row.positions.tolist(), row.targets.tolist())) == [(1, 12), (2, 13), (5, 22)]
    assert row.loss_mask.tolist() == [1, 1, 1]
    assert row.rollout_logprobs.tolist() == [-0.5, -0.5, -0.5]
    assert row.advantages.tolist() == [1, 1, -1]
    assert row.doc_index.tolist() == [0, 0, 1]
    assert row.token_mask().tolist() == [0, 1, 1, 0, 0, 1, 0]  # per position, for megatron's MTP labels
    assert row.branches is None
    rows = pack_documents([a, b, a], max_tokens_per_row=7)
    assert [r.num_docs for r in rows] == [2, 1]
    assert [r.num_docs for r in pack_documents([a, b], 16, packing=False)] == [1, 1]
    long_doc = _doc(range(30), 5)
    assert pack_documents([long_doc], max_tokens_per_row=8)[0].num_tokens == 30  # never truncated
    masked = TrainDocument((1, 2, 3, 4, 5), 3, (1, 0, 1), (-1.0, 0.0, -2.0), 0.5)  # a tool token in the middle
    (row,) = pack_documents([masked], 16)
    assert list(zip(row.positions.tolist(), row.targets.tolist())) == [(1, 3), (3, 5)]


def test_shared_prompts_lay_a_group_out_after_one_prompt_copy():
    group = [_doc([7, 8, 9, r1, r2], 2, adv) for r1, r2, adv in ((1, 2, 1.0), (3, 4, -1.0), (5, 6, 0.0))]
    other = _doc([30, 31, 1], 1, 0.5)
    (row,) = pack_documents([group[0], other, group[1], group[2]], 64, share_prompts=True)
    # in a row, units of one shape (prompt length, documents, tokens) side by side, shortest prompt first
    assert row.input_ids.tolist() == [30, 31, 1, 7, 8, 9, 1, 2, 3, 4, 5, 6]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4, 3, 4]
    # every first response token is predicted by the prompt's last position (5)
    assert list(zip(row.positions.tolist(), row.targets.tolist())) == [
        (1, 1), (5, 1), (6, 2), (5, 3), (8, 4), (5, 5), (10, 6)]
    assert row.doc_index.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert row.advantages.tolist() == [0.5, 1, 1, -1, -1, 0, 0]
    assert row.branches == ((8, 3, 3), (10, 3, 3))
    assert row.num_docs == 4 and row.num_tokens == 12  # 20 tokens laid out whole
    with pytest.raises(ValueError, match="no per-position loss mask"):
        row.token_mask()
    # a group longer than a row is split, each part with its own prompt copy
    parts = pack_documents(group, 7, share_prompts=True)
    assert [r.input_ids.tolist() for r in parts] == [[7, 8, 9, 1, 2, 3, 4], [7, 8, 9, 5, 6]]


def test_document_validation():
    with pytest.raises(ValueError, match="response_length"):
        TrainDocument((1, 2), 2, (1, 1), (0.0, 0.0), 0.0)
    with pytest.raises(ValueError, match="loss_mask"):
        TrainDocument((1, 2, 3), 2, (1,), (0.0, 0.0), 0.0)


def test_split_minibatches():
    assert [len(m) for m in split_minibatches(list(range(10)), 3)] == [4, 3, 3]
    assert [len(m) for m in split_minibatches(list(range(2)), 2)] == [1, 1]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", BUILTIN_ALGORITHMS, ids=lambda a: a.name)
def test_packed_update_equals_unpacked_update(method):
    """Differential: the same documents packed in one row or one per row give the same loss,
    gradients and statistics, for every built-in algorithm (attention model: position_ids restarts
    are honoured; sequence-level algorithms find their documents in the row)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    docs = []
    for i, n in enumerate([5, 9, 4, 7]):
        tokens = torch.randint(0, 32, (n,), generator=gen).tolist()
        docs.append(TrainDocument(tuple(tokens), 3, (1, 0, 1), (-3.0, -3.1, -3.2), float(i % 2) - 0.5))
    algo = AlgorithmSection(lr=1e-2, entropy_coef=0.01)
    results = {}
    for packing in (True, False):
        model = _tiny_llama()

        def forward(row, model=model):
            return model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits[0]

        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: compare gradients, not moved weights
        stats = policy_update(docs, forward, opt, model.parameters(),
                              UpdateSettings(algo, 1.0, 64, packing, method=method, budget=4.0))
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[packing] = (stats, grads)
    (s_p, g_p), (s_u, g_u) = results[True], results[False]
    assert s_p["train_tokens"] == s_u["train_tokens"] == 25
    for key in ("loss", "entropy", "approx_kl", "grad_norm"):
        assert s_p[key] == pytest.approx(s_u[key], rel=1e-4, abs=1e-6), key
    assert torch.allclose(g_p, g_u, atol=1e-6)


def test_two_epochs_are_two_passes_over_the_same_minibatches():
    """``epochs = 2`` in one update moves the weights exactly as two one-epoch updates on the same
    documents (the minibatches are laid out once and trained twice); control: one epoch does not."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(2)
    docs = [TrainDocument(tuple(torch.randint(0, 32, (n,), generator=gen).tolist()), 2, (1, 1), (-3.3, -3.4), adv)
            for n, adv in ((5, 1.0), (6, -0.5), (4, 0.25), (7, 0.5))]

    def trained(epochs: int, calls: int) -> torch.Tensor:
        model = _tiny_llama()

        def forward(row):
            return model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits[0]

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        settings = UpdateSettings(AlgorithmSection(lr=1e-2, epochs=epochs, minibatches=2), 1.0, 64, True)
        for _ in range(calls):
            policy_update(docs, forward, opt, model.parameters(), settings)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    twice = trained(epochs=2, calls=1)
    assert torch.equal(twice, trained(epochs=1, calls=2))
    assert not torch.equal(twice, trained(epochs=1, calls=1))


def test_packing_matters_for_a_model_that_ignores_position_restarts():
    """Negative control for the differential above: without restarting positions the packed row
    attends across documents and the log-probs change."""
    model = _tiny_llama()
    a, b = _doc([1, 2, 3, 4, 5], 2), _doc([6, 7, 8, 9], 2)
    (row,) = pack_documents([a, b], 64)
    with torch.no_grad():
        honoured = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits
        leaking = model(input_ids=row.input_ids[None], use_cache=False).logits
        alone = model(input_ids=torch.tensor([b.token_ids]), use_cache=False).logits
    assert torch.allclose(honoured[0, 5:], alone[0], atol=1e-5)
    assert not torch.allclose(leaking[0, 5:], alone[0], atol=1e-3)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_grpo_update_is_the_formula_it_always_was(bias_correction: bool):
    """GRPO through the algorithm protocol: the minibatch loss is still
    (sum clipped-surrogate - entropy_coef * sum entropy + kl_coef * sum k3 [* ratio]) / trained
    tokens, with the gradient of that expression (computed here directly); ``kl_bias_correction``
    weights each token's k3 by its ratio to the rollout (here far from 1: the rollout log-probs
    are made up, so both forms differ)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(3)
    docs = [TrainDocument(tuple(torch.randint(0, 32, (n,), generator=gen).tolist()), 2, (1, 1), (-3.3, -3.4), adv)
            for n, adv in ((5, 1.0), (6, -0.5), (4, 0.25))]
    algo = AlgorithmSection(entropy_coef=0.01, kl_coef=0.1, clip_low=0.1, clip_high=0.3, max_grad_norm=1e9,
                            kl_bias_correction=bias_correction)
    model, reference = _tiny_llama(), _tiny_llama()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)

    def forward(row, model=model):
        return model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits[0]

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = policy_update(docs, forward, opt, model.parameters(), UpdateSettings(algo, 1.0, 64, True),
                          reference=lambda row: forward(row, reference))
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    model.zero_grad(set_to_none=True)
    (row,) = pack_documents(docs, 64)
    logits = forward(row)[row.positions]
    logprobs = token_logprobs(logits, row.targets)
    per_token, _ = clipped_policy_loss(logprobs, row.rollout_logprobs, row.advantages, row.loss_mask,
                                       clip_low=0.1, clip_high=0.3)
    with torch.no_grad():
        ref = token_logprobs(forward(row, reference)[row.positions], row.targets)
    entropy = (entropy_from_logits(logits) * row.loss_mask).sum()
    kl = kl_k3(logprobs, ref) * row.loss_mask
    if bias_correction:
        kl = kl * (logprobs - row.rollout_logprobs).exp()
    loss = (per_token.sum() - 0.01 * entropy + 0.1 * kl.sum()) / 6
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert stats["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_aggregations_weigh_tokens_as_documented():
    from miles_core.rl.algorithms.losses import MinibatchTotals, aggregation_weights

    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    doc = torch.tensor([0, 0, 0, 1, 1])
    totals = MinibatchTotals(tokens=3, sequences=2, budget=4)
    assert aggregation_weights("token-mean", mask, doc, 2, totals).tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3])
    assert aggregation_weights("sequence-mean", mask, doc, 2, totals).tolist() == pytest.approx([0, 1 / 4, 1 / 4, 0, 1 / 2])
    assert aggregation_weights("budget", mask, doc, 2, totals).tolist() == pytest.approx([0, 1 / 8, 1 / 8, 0, 1 / 8])
