"""Presets: built by code, deterministic, in Hugging Face layout, Qwen3.5 architecture."""

from __future__ import annotations

import json

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.presets import PRESETS, SMALL_GPU, TINY, get_preset, preset_dir
from miles_core.errors import ConfigError

register_cpu_ci(est_time=24, suite="stage-a-cpu")


def test_tiny_is_a_qwen35_model_in_hf_layout(tiny_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "miles_preset.json"} <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert config["hidden_size"] == 64
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert sum(p.numel() for p in model.parameters()) < 200_000
    decays = torch.cat([m.A_log.detach().exp() for m in model.modules() if hasattr(m, "A_log")])
    assert decays.numel() > 0 and float(decays.max()) <= TINY.gdn_decay_max


def test_building_twice_gives_identical_weights(tiny_dir, tmp_path) -> None:
    rebuilt = TINY.build(tmp_path / "again")
    assert (rebuilt / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert preset_dir("tiny", tiny_dir.parent) == tiny_dir  # cached: not rebuilt


def test_small_gpu_preset_is_a_half_billion_parameter_qwen35() -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=265, **SMALL_GPU.text_config)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert 0.4e9 < parameters < 0.6e9
    assert SMALL_GPU.dtype == "bfloat16" and SMALL_GPU.device == "cuda"
    assert config.layer_types.count("full_attention") * 4 == len(config.layer_types)


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="tiny"):
        get_preset("huge")
    assert set(PRESETS) == {"tiny", "tiny-rl", "small-gpu"}


def _first_reply_token_distribution(model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        for p in prompts
    ])
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    with torch.no_grad():
        probs = model(ids, use_cache=False).logits[:, -1].softmax(-1)
    return probs[:, digits]


def test_tiny_rl_answers_with_a_digit_but_not_a_particular_one(tiny_dir) -> None:
    """The warm-up teaches the reply format, not the answers: nearly all first-token mass on the ten
    digits, spread evenly, on prompts it never saw; the un-warmed tiny model is the control."""
    torch.set_num_threads(1)
    unseen = ["3+4?", "n+1=", "7*2=", "hi!!"]  # none is a warm-up prompt ("a+b=")
    warmed = _first_reply_token_distribution(preset_dir("tiny-rl", tiny_dir.parent), unseen)
    control = _first_reply_token_distribution(tiny_dir, unseen)
    assert float(warmed.sum(-1).min()) > 0.9
    assert float(control.sum(-1).max()) < 0.2
    assert float(warmed.max()) < 0.2  # no digit above 2x its uniform share: no answer was taught


def test_tiny_rl_builds_identically_whatever_the_thread_count(tmp_path) -> None:
    from miles_core.engine.presets import TINY_RL

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = TINY_RL.build(tmp_path / "a")
        torch.set_num_threads(1)
        second = TINY_RL.build(tmp_path / "b")
    finally:
        torch.set_num_threads(threads)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
