"""One GRPO update of miles' hf trainer equals TRL's GRPOTrainer loss on the same batch.

``benchmarks/rl_vs_trl.py`` races the two with identical settings; this pins that "identical"
holds where it matters, on one update: the same model (the benchmark's char-level Llama), the same
55-prompt-shaped batch (groups of 8 one-token completions, their rewards, the same advantages),
lr/KL/clip as the benchmark, TRL's defaults otherwise (its ``use_bias_correction_kl``: miles'
``algorithm.kl_bias_correction``). miles trains through its real path (packed rows with shared prompts,
the packed attention, the k3 KL to its reference copy, token-mean aggregation); TRL through
``GRPOTrainer._compute_loss`` with its reference log-probs. The gradients must agree, with the
policy moved off its reference so that the KL term counts.

Tolerance: both sides run the same fp32 Llama on one thread; miles packs a group's eight
completions after one copy of the prompt (other matmul shapes, another summation order), so the
logits agree to ~1e-6 relative and the gradient, a sum of 48 such terms, to a few 1e-6 of its norm;
1e-4 of the norm leaves margin while a real difference (a loss term, a normaliser, a missing KL
term, the std's definition) moves it by percents. The advantages are TRL's (sample std + 1e-4):
miles' own (population std) differ by sqrt(8/7) on purpose-built groups and are checked apart.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-b-cpu")

# collected and skipped, not skipped at import: a file that collects nothing fails `miles ci run`
pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="TRL is the peer of benchmarks/rl_vs_trl.py (pip install -e '.[bench]')")

#: the race's settings, except that nothing is clipped: both sides clip with torch's clip_grad_norm_,
#: and a clipped gradient (norm 1) would hide a wrong scale, as between the two std definitions
SETTINGS = {"lr": 3e-3, "kl_coef": 0.3, "clip": 0.2, "max_grad_norm": 1e9}
GROUP = 8


def _moved(model: torch.nn.Module) -> None:
    """Move the policy away from its reference copy (the same noise on both sides): at the first
    step the two are equal and the KL term's gradient is zero, which would leave it untested."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _batch(tokenizer, seed: int = 0) -> tuple[list[list[int]], list[int], list[float]]:
    """Six prompts x 8 one-token completions (digits and EOS drawn at random) and their rewards."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    chosen = rng.sample(pairs, 6)
    prompts, completions, rewards = [], [], []
    candidates = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"] + [tokenizer.eos_token_id]
    for a, b in chosen:
        ids = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
        answer = tokenizer.convert_tokens_to_ids(str(a + b))
        for i in range(GROUP):
            token = answer if i < 1 + (a + b) % 4 else rng.choice(candidates)  # every group has a signal
            prompts.append(ids)
            completions.append(token)
            rewards.append(1.0 if token == answer else 0.0)
    return prompts, completions, rewards


def _trl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    grouped = rewards.view(-1, GROUP)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def _trl_gradients(model_dir, tmp_path, prompts, completions, advantages) -> dict[str, torch.Tensor]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(prompts), num_generations=GROUP,
        max_completion_length=1, temperature=1.0, learning_rate=SETTINGS["lr"], lr_scheduler_type="constant",
        weight_decay=0.0, beta=SETTINGS["kl_coef"], epsilon=SETTINGS["clip"], max_grad_norm=SETTINGS["max_grad_norm"],
        scale_rewards="group", num_iterations=1, gradient_checkpointing=False, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda **_: [0.0] * len(prompts), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * GROUP}), processing_class=tokenizer)
    prompt_ids = torch.tensor(prompts)
    completion_ids = torch.tensor(completions)[:, None]
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": torch.ones_like(completion_ids),
        "advantages": advantages, "num_items_in_batch": torch.tensor(float(len(prompts))),
    }
    with torch.no_grad():  # TRL keeps no reference model without a KL term
        if trainer.ref_model is not None:
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, torch.cat([prompt_ids, completion_ids], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), 1)
    _moved(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.training_step sets before computing the loss
    trainer.model.zero_grad(set_to_none=True)
    trainer._compute_loss(trainer.model, inputs).backward()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), SETTINGS["max_grad_norm"])
    return {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def _miles_gradients(model_dir, tmp_path, prompts, completions, advantages,
                     **algorithm: float | bool) -> tuple[dict[str, torch.Tensor], dict]:
    from miles_core.rl.algorithms.batch import TrainDocument
    from miles_core.rl.algorithms.builtin import GRPO
    from miles_core.rl.config import load_config
    from miles_core.rl.trainers.hf import HFPolicy

    config = load_config(overrides=[{
        "model": {"path": str(model_dir), "preset": None, "dtype": "float32"},
        "rollout": {"path": "direct", "samples_per_prompt": GROUP, "max_new_tokens": 1, "temperature": 1.0},
        "algorithm": {"lr": SETTINGS["lr"], "weight_decay": 0.0, "kl_coef": SETTINGS["kl_coef"],
                      "clip_low": SETTINGS["clip"], "clip_high": SETTINGS["clip"], "max_grad_norm": SETTINGS["max_grad_norm"],
                      **algorithm},
        "trainer": {"device": "cpu"},
        "run": {"out_dir": str(tmp_path / "miles")},
    }])
    policy = HFPolicy(model_dir, config, torch.device("cpu"), None, GRPO())
    _moved(policy.model)
    with torch.no_grad():  # the rollout's log-probs: the same weights, so every ratio is 1 (TRL's num_iterations=1)
        ids = torch.tensor([[*p, c] for p, c in zip(prompts, completions)])
        logprobs = policy.model(ids).logits[:, -2].float().log_softmax(-1).gather(-1, ids[:, -1:]).squeeze(-1)
    docs = [TrainDocument((*p, c), 1, (1,), (float(lp),), float(a))
            for p, c, lp, a in zip(prompts, completions, logprobs, advantages)]
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)  # keep the (clipped) gradients, move nothing
    stats = policy.train(docs)
    return {name: p.grad.detach().clone() for name, p in policy.model.named_parameters() if p.grad is not None}, {
        "shared_prompts": policy.report["shared_prompts"], **stats}


def _relative_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert set(ours) == set(theirs)
    norm = torch.sqrt(sum((g * g).sum() for g in theirs.values()))
    return float(torch.sqrt(sum(((ours[k] - theirs[k]) ** 2).sum() for k in theirs)) / norm)


def test_one_grpo_update_equals_trls(tmp_path) -> None:
    from transformers import AutoTokenizer

    from miles_core.assets.char_model import write_char_model
    from miles_core.rl.algorithms.losses import group_advantages

    torch.set_num_threads(1)
    model_dir = write_char_model(tmp_path / "model", seed=3)
    prompts, completions, rewards = _batch(AutoTokenizer.from_pretrained(model_dir))
    advantages = _trl_advantages(torch.tensor(rewards))
    theirs = _trl_gradients(model_dir, tmp_path, prompts, completions, advantages)
    ours, stats = _miles_gradients(model_dir, tmp_path, prompts, completions, advantages.tolist())
    assert stats["shared_prompts"] is True  # the path the race takes
    assert stats["logprob_mismatch_max"] < 1e-5 and stats["kl_ref"] > 1e-3  # on-policy, away from the reference
    assert _relative_difference(ours, theirs) <= 1e-4
    # negative controls: the test sees a 7 % advantage scale and a missing KL term
    own, _ = _miles_gradients(model_dir, tmp_path, prompts, completions, group_advantages(torch.tensor(rewards), GROUP).tolist())
    assert _relative_difference(own, theirs) > 1e-2
    for changed in ({"kl_coef": 0.0}, {"kl_bias_correction": False}):  # no KL term; k3's biased gradient
        other, _ = _miles_gradients(model_dir, tmp_path, prompts, completions, advantages.tolist(), **changed)
        assert _relative_difference(other, theirs) > 1e-2, changed


def test_the_advantages_differ_only_by_the_std_definition() -> None:
    """miles divides by the population std (+1e-6), TRL by the sample std (+1e-4): a constant
    factor sqrt(G / (G - 1)) on every group with a signal, so the race's advantages differ by 6.9 %."""
    from miles_core.rl.algorithms.losses import group_advantages

    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0] * 3 + [1.0] * 8)
    ours = group_advantages(rewards, GROUP)
    theirs = _trl_advantages(rewards)
    signal = rewards.view(-1, GROUP).std(1).repeat_interleave(GROUP) > 0
    ratio = ours[signal] / theirs[signal]
    assert torch.allclose(ratio[ours[signal] != 0], torch.full_like(ratio[ours[signal] != 0], (GROUP / (GROUP - 1)) ** 0.5), rtol=1e-3)
    assert torch.equal(ours[~signal], theirs[~signal]) and not ours[~signal].any()
