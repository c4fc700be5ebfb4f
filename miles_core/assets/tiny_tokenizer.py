"""A tiny byte-level tokenizer with a ChatML-style chat template (tool calls included).

Every byte is one token (no merges), so ASCII text is tokenized character by character and any
UTF-8 text round-trips exactly. It is the tokenizer of the embedded engine's ``tiny`` preset and
of the session-server tests. Generate it with::

    python -m miles_core.assets.tiny_tokenizer OUTPUT_DIR

or call :func:`tiny_tokenizer_dir`, which writes it once into a cache directory keyed by a digest
of this recipe. The output loads with ``transformers.AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.cache_dir import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

CHAT_TEMPLATE = (
    # No whitespace control and no newline right after a block tag: transformers renders chat
    # templates with trim_blocks, so every newline is emitted explicitly as {{ nl }}.
    "{% set nl = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system{{ nl }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}{{ nl }}{% endif %}"
    "# Tools{{ nl }}<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}"
    "{{ nl }}</tools><|im_end|>{{ nl }}"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system{{ nl }}{{ messages[0].content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}<|im_start|>system{{ nl }}{{ message.content }}<|im_end|>{{ nl }}{% endif %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{{ nl }}{{ message.content or '' }}"
    "{% for call in (message.tool_calls or []) %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>{{ nl }}{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}{{ nl }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ nl }}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user{{ nl }}<tool_response>{{ nl }}{{ message.content }}{{ nl }}</tool_response><|im_end|>{{ nl }}"
    "{% else %}"
    "<|im_start|>{{ message.role }}{{ nl }}{{ message.content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)

RECIPE_VERSION = 1


def recipe_digest() -> str:
    recipe = {"v": RECIPE_VERSION, "special": SPECIAL_TOKENS, "template": CHAT_TEMPLATE}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tokenizer in memory (imports ``tokenizers`` and ``transformers``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Fixed order (by byte value) so token ids never depend on set iteration order.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ordered = [bytes_to_unicode()[b] for b in range(256)]
    assert set(ordered) == set(byte_alphabet)
    vocab = {ch: i for i, ch in enumerate(ordered)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def write_tiny_tokenizer(directory: str | os.PathLike[str]) -> Path:
    """Write the tokenizer files into ``directory`` (created if missing) and return it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(out))
    (out / "miles_asset.json").write_text(json.dumps({"asset": "tiny-chatml", "digest": recipe_digest()}))
    return out


def tiny_tokenizer_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The tokenizer directory, generated once per recipe digest under the miles cache."""
    root = Path(cache_dir or cache_root())
    target = root / f"tiny-chatml-{recipe_digest()}"
    if (target / "miles_asset.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-chatml-", dir=root))
    write_tiny_tokenizer(staging)
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m miles_core.assets.tiny_tokenizer OUTPUT_DIR")
    print(write_tiny_tokenizer(sys.argv[1]))
