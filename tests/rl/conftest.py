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
