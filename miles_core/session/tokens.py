"""Token invariants every session version relies on (neutral: imported by v1, v2 and the kit).

* A turn's prompt extends the parent turn's full token snapshot, except for at most ``trim``
  trailing completion tokens the chat template re-emits as the next message's opener
  (:func:`check_extends`).
* A completion carries exactly one log-prob per token id (:func:`check_aligned`).

Violations raise :class:`TokenInvariantError` (HTTP 422) with the first differing index and a few
tokens of context -- never the whole history.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_core.session.errors import Unprocessable

CONTEXT_TOKENS = 8


class TokenInvariantError(Unprocessable):
    """Token ids that would break token-in-token-out consistency."""


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix of
    the other); ``None`` when they are equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def check_extends(previous: Sequence[int], new: Sequence[int], *, trim: int = 0, what: str = "prompt") -> None:
    """Require ``new`` to start with ``previous`` minus its last ``trim`` tokens."""
    if not 0 <= trim <= len(previous):
        raise TokenInvariantError(f"{what}: trim={trim} is outside [0, {len(previous)}]")
    keep = len(previous) - trim
    head, prefix = tuple(new[:keep]), tuple(previous[:keep])
    if head == prefix:
        return
    i = first_mismatch(prefix, head)
    assert i is not None
    lo = max(0, i - CONTEXT_TOKENS)
    raise TokenInvariantError(
        f"{what} does not extend the previous {keep} token(s): first difference at index {i} "
        f"(previous[{lo}:{i + CONTEXT_TOKENS}]={list(prefix[lo : i + CONTEXT_TOKENS])}, "
        f"new[{lo}:{i + CONTEXT_TOKENS}]={list(head[lo : i + CONTEXT_TOKENS])}, len(new)={len(new)})"
    )


def check_aligned(token_ids: Sequence[int], logprobs: Sequence[float], *, what: str = "completion") -> None:
    """Require one log-prob per token id."""
    if len(token_ids) != len(logprobs):
        raise TokenInvariantError(f"{what} has {len(token_ids)} token id(s) but {len(logprobs)} log-prob(s)")
