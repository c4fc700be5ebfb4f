"""Looking up single tokens in a Hugging Face tokenizer's vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of ``token`` (``convert_tokens_to_ids`` of one token, which transformers types as
    ``int | list[int]``)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{type(tokenizer).__name__} maps the token {token!r} to {found!r}, not one id")
    return found
