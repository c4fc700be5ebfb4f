"""A character-level tokenizer and a random-init 2-layer, hidden-64 Llama-architecture causal LM.

The model of ``benchmarks/rl_vs_trl.py`` and of the fast RL tests: small enough to train in
seconds on one CPU thread, with a vocabulary of just the characters arithmetic prompts need, so
a random policy already hits a digit often. Written in Hugging Face layout (config, safetensors,
tokenizer), loadable by transformers, the embedded engine and TRL alike. No chat template.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

CHARS = "0123456789+="
PAD, EOS = "<pad>", "<eos>"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def write_char_model(directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write tokenizer + model (weights drawn with ``seed``) into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
