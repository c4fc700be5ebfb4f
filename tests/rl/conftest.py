from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory) -> Path:
    """The benchmark's character-level 2-layer hidden-64 Llama (HF layout), built once."""
    from miles_core.assets.char_model import write_char_model

    return write_char_model(tmp_path_factory.mktemp("char-model"), seed=0)


@pytest.fixture
def direct_overrides(char_model_dir, tmp_path):
    """Settings for a few fast direct-path steps on the char model, in-process reward."""
    return {
        "model": {"path": str(char_model_dir), "preset": None},
        "task": {"name": "arith-add", "reward": "miles_core.rl.builtin:first_token_reward"},
        "rollout": {"path": "direct", "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 2},
        "trainer": {"device": "cpu"},
        "run": {"steps": 3, "eval_every": 1, "progress": False, "out_dir": str(tmp_path / "run")},
    }


@pytest.fixture
def packed_lm(miles_pm):
    """Builds the update differentials' model: a seeded 2-layer, hidden-32 Llama or Qwen3
    (vocabulary 40) prepared for packed training, so that its attention reads shared-prompt rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from miles_core.patches import prepare_model

    def build(kind: str = "llama"):
        torch.manual_seed(0)
        common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
        model = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama"
                 else Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)))
        assert prepare_model(model, pm=miles_pm, packed=True).packed_attention
        return model

    return build


@pytest.fixture
def lr0_update():
    """``(model, docs, settings, reference=None, extra_loss=None) -> (stats, gradients)``: one
    ``policy_update`` through the hf trainer's row forward with learning rate 0, so the weights stay
    and runs on the same model compare; the gradients flattened into one tensor."""
    import torch

    from miles_core.rl.policy_update import policy_update
    from miles_core.rl.trainers.hf import row_inputs, target_logits

    def run(model, docs, settings, reference=None, extra_loss=None):
        def forward(row, m=model):
            return target_logits(m, row_inputs(row, torch.device("cpu")))

        model.zero_grad(set_to_none=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        ref = (lambda row: forward(row, reference)) if reference is not None else None
        stats = policy_update(docs, forward, optimizer, model.parameters(), settings, reference=ref,
                              extra_loss=extra_loss)
        return stats, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    return run
