"""trainer.world_size > 1: the hf trainer sharded with FSDP2 over processes (gloo on CPU).

Differential: one policy update on the same documents gives the same statistics (loss, gradient
norm, entropy, KL, log-prob mismatch, token counts) and the same weights with 2 ranks as with 1.
Had the loss missed the all-rank token normalisation or the world-size scale, the gradient norm
would differ by that factor (AdamW's update alone would hide it). A checkpoint written by the
ranks restores their exact weights, one process resumes it and steps as the two ranks do, and a
failure on rank 0 stops the other ranks.

Why both sides start from a trained checkpoint, and the tolerance: the two computations are equal
in exact arithmetic and differ only in summation order (each rank packs its share into other rows,
so the matmuls accumulate in another order, and FSDP sums the gradient as two partial sums). AdamW's
*first* step is ``lr * g / |g|`` per element: an element whose gradient is float noise moves by
+-lr with the noise's sign, so every statistic of a second minibatch after a fresh start inherits
weight differences of order lr (measured: kl_ref 5.7e-6 relative, machine-dependent). After one
earlier step the update divides by the accumulated ``sqrt(v)`` and is linear in the gradient, so
what is left is summation order alone: a length-n fp32 reduction is off by at most ~n*u relative
(u = 6e-8; n = 128 to 265 for this model: its MLP width and its vocabulary), hence rel 1e-5 (~n*u), an order of
magnitude above the sqrt(n)*u ~ 1e-6 typically seen (measured: at most 1.3e-6).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from miles_core.ci.register import register_cpu_ci, register_cuda_ci
from miles_core.engine.presets import preset_dir
from miles_core.rl.algorithms import TrainDocument
from miles_core.rl.algorithms.builtin import GRPO
from miles_core.rl.config import load_config
from miles_core.rl.trainers.hf import HFTrainer

register_cpu_ci(est_time=18, suite="stage-b-cpu")
register_cuda_ci(est_time=240, suite="stage-c-2-gpu-h200", labels=["gpu"])

STATS = ("loss", "grad_norm", "entropy", "approx_kl", "kl_ref", "clip_fraction", "logprob_mismatch_mean",
         "logprob_mismatch_max", "train_tokens")


def _docs(n: int = 13) -> list[TrainDocument]:
    rng = random.Random(0)
    docs = []
    for _ in range(n):
        prompt, response = rng.randint(3, 12), rng.randint(1, 9)
        docs.append(
            TrainDocument(
                token_ids=tuple(rng.randrange(3, 90) for _ in range(prompt + response)),
                response_length=response,
                loss_mask=tuple(1 if rng.random() < 0.9 else 0 for _ in range(response)),
                rollout_logprobs=tuple(-rng.uniform(3.0, 6.0) for _ in range(response)),
                advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]),
            )
        )
    return docs


def _trainer(world_size: int, device: str = "cpu") -> HFTrainer:
    config = load_config(
        "tiny",
        overrides=[f"trainer.world_size={world_size}", f'trainer.device="{device}"', "trainer.max_tokens_per_row=48",
                   "algorithm.minibatches=2"],
    )
    return HFTrainer(preset_dir(config.model.preset), config, torch.device(device), GRPO())


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """A checkpoint one step in: the policy differs from the KL reference and AdamW has its ``v``."""
    trainer = _trainer(1)
    trainer.train(_docs(7))
    directory = tmp_path_factory.mktemp("warm") / "ckpt"
    trainer.save(directory)
    return directory


@pytest.fixture(scope="module")
def single(warm) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    trainer = _trainer(1)
    trainer.load(warm)
    stats = trainer.train(_docs())
    return stats, {k: v.clone() for k, v in trainer.engine_weights().items()}


def test_two_ranks_update_like_one(warm, single, tmp_path) -> None:
    stats_1, weights_1 = single
    trainer = _trainer(2)
    try:
        trainer.load(warm)
        assert trainer.report["world_size"] == 2 and trainer.report["fsdp_sharded"] == ["Qwen3_5DecoderLayer"]
        stats_2 = trainer.train(_docs())
        weights_2 = trainer.engine_weights()
        for key in STATS:
            assert stats_2[key] == pytest.approx(stats_1[key], rel=1e-5, abs=1e-7), key
        assert weights_2.keys() == weights_1.keys()
        assert stats_1["kl_ref"] > 0.01  # the penalty is exercised: policy and reference differ
        diff = torch.cat([(weights_2[k] - weights_1[k]).abs().flatten() for k in weights_1])
        # AdamW divides by sqrt(v): where v is still ~0 (a gradient that was ~0 both steps), float
        # noise moves the weight by up to ~lr, so a few elements differ; the rest agree to float precision.
        assert diff.mean().item() <= 1e-7 and (diff > 1e-6).float().mean().item() <= 0.01, diff.max()

        trainer.save(tmp_path / "ckpt")
        trainer.train(_docs(5))
        moved = trainer.engine_weights()
        assert any(not torch.equal(moved[k], weights_2[k]) for k in weights_2)
        trainer.load(tmp_path / "ckpt")
        restored = trainer.engine_weights()
        assert all(torch.equal(restored[k], weights_2[k]) for k in weights_2)

        # the checkpoint holds the whole optimizer state by parameter name: one process resumes it
        # and takes the next step as the two ranks do
        alone = _trainer(1)
        alone.load(tmp_path / "ckpt")
        assert all(torch.equal(alone.engine_weights()[k], weights_2[k]) for k in weights_2)
        next_1, next_2 = alone.train(_docs(5)), trainer.train(_docs(5))
        for key in STATS:
            assert next_1[key] == pytest.approx(next_2[key], rel=1e-5, abs=1e-7), key

        # rank 0 fails (a token id past the vocabulary): the other ranks are stopped, not waited for
        bad = [TrainDocument(token_ids=(3, 10**6, 4), response_length=1, loss_mask=(1,), rollout_logprobs=(-1.0,),
                             advantage=1.0)] * 2
        with pytest.raises(IndexError):
            trainer.train(bad)
        with pytest.raises(RuntimeError, match="stopped after an earlier failure"):
            trainer.train(_docs())
    finally:
        trainer.close()


def test_world_size_is_an_hf_setting() -> None:
    with pytest.raises(Exception, match=r"trainer\.world_size > 1 needs trainer\.backend = 'hf'"):
        load_config("tiny", overrides=['trainer.backend="megatron"', "trainer.world_size=2"])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs two CUDA GPUs"
)
def test_two_gpu_ranks_update_like_one_gpu() -> None:
    """The same differential on cuda:0 + cuda:1 over NCCL (fla's kernels run tf32, hence rel 1e-3)."""
    one = _trainer(1, "cuda")
    stats_1 = one.train(_docs())
    weights_1 = {k: v.detach().float().cpu() for k, v in one.engine_weights().items()}
    del one
    torch.cuda.empty_cache()
    two = _trainer(2, "cuda")
    try:
        stats_2 = two.train(_docs())
        weights_2 = {k: v.float().cpu() for k, v in two.engine_weights().items()}
    finally:
        two.close()
    for key in STATS:
        assert stats_2[key] == pytest.approx(stats_1[key], rel=1e-3, abs=1e-5), key
    diff = torch.cat([(weights_2[k] - weights_1[k]).abs().flatten() for k in weights_1])
    assert diff.mean().item() <= 1e-5, diff.max()
