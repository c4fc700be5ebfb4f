"""Shared prompts: a GRPO group trained after one copy of its prompt gives the update of the same
documents laid out whole -- loss, gradients, every statistic -- while the row holds a fraction of
the tokens; a model's recurrent layers get such rows only where they say they can fork their state
(the GDN patch's torch kernels; miles-qwen35's tests hold the GDN differential).

Tolerance: both layouts compute the same attention and MLPs in fp32 and differ only in which rows
of which matmuls share a call (a reduction of the same terms in another order), so they agree to
a few ulps of the values involved (rel 1e-5; measured <= 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.algorithms.batch import TrainDocument, pack_documents
from miles_core.rl.algorithms.builtin import BUILTIN_ALGORITHMS
from miles_core.rl.config import AlgorithmSection
from miles_core.rl.policy_update import UpdateSettings

register_cpu_ci(est_time=10, suite="stage-a-cpu")


def _docs(equal: bool = False) -> list[TrainDocument]:
    """Three groups; their responses of 1-3 tokens, or (``equal``) of 3 tokens each: a group whose
    responses have one length is attended as one masked block (the packed attention's fast path)."""
    gen = torch.Generator().manual_seed(5)
    docs = []
    for prompt_len, group in ((6, 4), (3, 3), (9, 2)):
        prompt = torch.randint(1, 40, (prompt_len,), generator=gen).tolist()
        for i in range(group):
            n = 3 if equal else 1 + (i % 3)
            response = torch.randint(1, 40, (n,), generator=gen).tolist()
            mask = tuple(0 if (j == 1 and n == 3) else 1 for j in range(n))  # a tool token inside one
            docs.append(TrainDocument(tuple(prompt + response), n, mask, tuple(-2.0 - 0.1 * j for j in range(n)),
                                      float(i) - 1.0))
    gen_order = torch.randperm(len(docs), generator=gen).tolist()  # groups need not be contiguous
    return [docs[i] for i in gen_order]


def _settings(share: bool, method, reference) -> UpdateSettings:
    algo = AlgorithmSection(lr=1e-2, entropy_coef=0.01, kl_coef=0.1 if reference is not None else 0.0)
    return UpdateSettings(algo, 1.0, 64, True, method=method, budget=3.0, share_prompts=share)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("method", BUILTIN_ALGORITHMS, ids=lambda a: a.name)
@pytest.mark.parametrize("equal", [False, True], ids=["mixed-lengths", "equal-lengths"])
def test_a_shared_prompt_row_updates_like_whole_documents(packed_lm, lr0_update, kind, method, equal) -> None:
    torch.set_num_threads(1)
    docs = _docs(equal)
    model = packed_lm(kind)
    reference = packed_lm(kind)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02)
    whole, grads_whole = lr0_update(model, docs, _settings(False, method, reference), reference)
    shared, grads_shared = lr0_update(model, docs, _settings(True, method, reference), reference)
    assert shared["train_tokens"] < 0.6 * whole["train_tokens"]  # the rows really are smaller
    for key in ("loss", "entropy", "approx_kl", "kl_ref", "clip_fraction"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(grads_shared, grads_whole, rtol=1e-5, atol=1e-7)


def test_without_the_branches_a_shared_row_is_wrong(packed_lm) -> None:
    """Negative control: the same shared row attended as independent segments (no branches: each
    response alone, without its prompt) gives other log-probs."""
    model = packed_lm("llama")
    (row,) = pack_documents(_docs()[:6], 64, share_prompts=True)
    assert row.branches
    from miles_core.patches.packing import PACKING_KWARG, packed_sequences

    with torch.no_grad():
        honoured = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                         **{PACKING_KWARG: packed_sequences(row.position_ids[None], branches=row.branches)}).logits
        ignored = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False).logits
    assert not torch.allclose(honoured, ignored, atol=1e-3)


def test_the_tiny_preset_shares_prompts_through_its_gated_deltanet_layers(tmp_path) -> None:
    from miles_core.engine.presets import preset_dir
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.config import load_config
    from miles_core.rl.trainers.hf import HFTrainer

    config = load_config("tiny")
    algorithm = get_plugin_manager().contribution("algorithms", "grpo").obj
    trainer = HFTrainer(preset_dir(config.model.preset), config, torch.device("cpu"), algorithm)
    # the GDN patch's torch kernels fork the recurrent state and conv window after the prompt
    # (plugins/miles_qwen35/tests: shared == whole documents per architecture)
    assert trainer.report["shared_prompts"] is True


def test_the_policy_and_reference_forwards_of_a_row_build_one_attention_plan(tmp_path, monkeypatch) -> None:
    """The hf trainer's two forwards of a row (policy, then KL reference) share its inputs, so the
    packed attention plans the row's segments once; a second plan is a second context built."""
    from miles_core.assets.char_model import write_char_model
    from miles_core.patches import attention
    from miles_core.rl.algorithms.builtin import GRPO
    from miles_core.rl.config import load_config
    from miles_core.rl.trainers.hf import HFPolicy

    torch.set_num_threads(1)
    model_dir = write_char_model(tmp_path / "model", seed=0)
    config = load_config(overrides=[{
        "model": {"path": str(model_dir), "preset": None, "dtype": "float32"},
        "rollout": {"path": "direct", "samples_per_prompt": 4, "max_new_tokens": 2},
        "algorithm": {"kl_coef": 0.1},
        "trainer": {"device": "cpu"},
        "run": {"out_dir": str(tmp_path / "run")},
    }])
    policy = HFPolicy(model_dir, config, torch.device("cpu"), None, GRPO())
    assert policy.report["shared_prompts"] and policy.reference is not None
    docs = [TrainDocument((2, 3, 4, 5, 6 + i, 7), 2, (1, 1), (-1.0, -1.5), float(i) - 1.5) for i in range(4)]
    docs += [TrainDocument((8, 9, 10, 2 + i), 1, (1,), (-2.0,), float(i) - 1.5) for i in range(4)]
    plans = []
    make = attention._make_plan
    monkeypatch.setattr(attention, "_make_plan", lambda ctx, device: plans.append(ctx) or make(ctx, device))
    stats = policy.train(docs)
    assert stats["kl_ref"] >= 0 and len(pack_documents(docs, 4096, share_prompts=True)) == 1
    assert len(plans) == 1
