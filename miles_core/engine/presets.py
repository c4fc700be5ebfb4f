"""Named models built by code in this repository (no hub downloads), in Hugging Face layout.

A preset is a Qwen3.5-architecture causal LM (transformers ``qwen3_5`` text model) with a fixed
seed and the byte-level ChatML tokenizer of :mod:`miles_core.assets.tiny_tokenizer`. Building one
writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files;
:func:`preset_dir` does it once per recipe digest under the miles cache and returns the
directory, which loads with ``AutoModelForCausalLM.from_pretrained`` (and ``miles engine serve``).

Add a preset by adding a :class:`Preset` to :data:`PRESETS`. Importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from miles_core.cache_dir import cache_root
from miles_core.errors import ConfigError
from miles_core.hardware.gdn import gdn_model_device

RECIPE_VERSION = 2  # 2: the tiny-rl warm-up runs on one thread
MARKER = "miles_preset.json"


@dataclass(frozen=True)
class ReplyFormatWarmup:
    """A few AdamW steps that teach a random-init model the *format* of a reply, not its content.

    The corpus is every chat prompt ``"a+b="`` (single digits ``a``, ``b``) rendered with the chat
    template and the generation prompt; the target of the first reply token is the *uniform*
    distribution over the ten digit tokens, whatever the prompt says. Afterwards the model answers
    with a digit (instead of one of 265 byte tokens) but knows nothing about which digit is right:
    every prompt gets the same ~1/10 chance for each answer. This is the "base model" RL starts
    from; without it a reward that checks one token hits almost never and teaches almost nothing.
    """

    steps: int = 30
    lr: float = 3e-3

    def apply(self, model: Any, tokenizer: Any) -> None:
        import torch

        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for a in range(10)
            for b in range(10)
        ]
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("reply-format warm-up: the rendered prompts differ in length; expected single tokens per digit")
        digits = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(str(d))) for d in range(10)]
        if any(len(d) != 1 for d in digits):
            raise ValueError("reply-format warm-up: the tokenizer does not encode each digit as one token")
        device = gdn_model_device()  # transformers sends GDN layers to fla's GPU-only kernels when fla imports
        inputs = torch.tensor(prompts, device=device)
        digit_ids = torch.tensor([d[0] for d in digits], device=device)
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same reduction order, so the same weights, on any CPU machine
        try:
            model.train()
            for _ in range(self.steps):
                logp = model(inputs, use_cache=False).logits[:, -1].float().log_softmax(-1)
                loss = -logp[:, digit_ids].mean()  # cross-entropy to uniform-over-digits
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            model.eval()
        finally:
            torch.set_num_threads(threads)
            model.to("cpu")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    #: ``Qwen3_5TextConfig`` arguments; vocabulary and special-token ids come from the tokenizer
    text_config: dict[str, Any] = field(hash=False)
    dtype: str  # the dtype the weights are saved in and served with
    device: str  # where the preset is meant to run: "cpu" or "cuda"
    seed: int = 0
    #: if set, Gated DeltaNet decay rates ``A`` are drawn from ``U(0.01, gdn_decay_max)`` instead of
    #: transformers' ``U(0.01, 16)``, so the recurrent state carries information across tokens
    gdn_decay_max: float | None = None
    #: if set, run after initialisation (see :class:`ReplyFormatWarmup`)
    warmup: ReplyFormatWarmup | None = None

    def digest(self) -> str:
        from miles_core.assets.tiny_tokenizer import recipe_digest

        recipe = {
            "v": RECIPE_VERSION,
            "preset": asdict(self),
            # a warm-up on the GPU (fla installed) ends in slightly different weights
            "warmup_device": gdn_model_device() if self.warmup is not None else None,
            "tokenizer": recipe_digest(),
            # Weight initialisation is only reproducible within one torch/transformers version.
            "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"),
        }
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]

    def build(self, directory: str | os.PathLike[str]) -> Path:
        """Write the preset into ``directory`` (created if missing) and return it."""
        import torch
        from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

        from miles_core.assets.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer
        from miles_core.assets.tokens import token_id

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tokenizer()
        eos, pad = token_id(tokenizer, EOS_TOKEN), token_id(tokenizer, PAD_TOKEN)
        config = Qwen3_5TextConfig(
            vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **self.text_config
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = Qwen3_5ForCausalLM(config)
            if self.gdn_decay_max is not None:
                with torch.no_grad():
                    for module in model.modules():
                        a_log = getattr(module, "A_log", None)
                        if isinstance(a_log, torch.nn.Parameter):
                            a_log.copy_(torch.empty_like(a_log).uniform_(0.01, self.gdn_decay_max).log())
            if self.warmup is not None:
                self.warmup.apply(model, tokenizer)
        model.to(getattr(torch, self.dtype)).save_pretrained(out)
        tokenizer.save_pretrained(out)
        GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)
        (out / MARKER).write_text(json.dumps({"preset": self.name, "digest": self.digest()}))
        return out


TINY = Preset(
    name="tiny",
    description="2-layer Qwen3.5 (one Gated DeltaNet + one attention layer, hidden 64), fp32, for CPU",
    text_config={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        # transformers' default initializer_range (0.02) on purpose: at 0.1 the model's own fp32
        # kernels (chunked prefill vs recurrent decode of Gated DeltaNet) already disagree by
        # ~2e-5 in log-prob, transformers' DynamicCache included, above the 1e-5 contract.
    },
    dtype="float32",
    device="cpu",
    # With A up to 16 the state decays within a token or two and dropping it changes log-probs
    # by ~1e-6: tests could not tell a broken recurrent cache from a working one.
    gdn_decay_max=1.0,
)

TINY_RL = Preset(
    name="tiny-rl",
    description="the tiny architecture as an RL starting point: init std 0.1, then a reply-format warm-up "
    "(answers a uniformly random digit), fp32, for CPU",
    # At transformers' 0.02 the signal from the prompt's digits reaches the last position too weakly
    # for RL to pick it up in minutes; at 0.1 the one-token log-probs of prefill still agree with the
    # trainer's to ~1e-6 (decode steps drift to ~2e-5, see TINY).
    text_config={**TINY.text_config, "initializer_range": 0.1},
    dtype="float32",
    device="cpu",
    gdn_decay_max=1.0,
    warmup=ReplyFormatWarmup(),
)

SMALL_GPU = Preset(
    name="small-gpu",
    description="24-layer Qwen3.5 (3 Gated DeltaNet : 1 attention, hidden 1024, ~0.47B parameters), bf16, for one GPU",
    text_config={
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    dtype="bfloat16",
    device="cuda",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TINY, TINY_RL, SMALL_GPU)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def preset_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The preset's model directory, built once per recipe digest under the miles cache."""
    preset = get_preset(name)
    root = Path(cache_dir or cache_root())
    target = root / f"preset-{preset.name}-{preset.digest()}"
    if (target / MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".preset-{preset.name}-", dir=root))
    try:
        preset.build(staging)
        staging.rename(target)
    except OSError:
        if not (target / MARKER).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when the rename won
    return target
