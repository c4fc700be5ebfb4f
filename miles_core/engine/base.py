"""The engine concern's data types and protocols (importable without torch).

One upstream contract, two implementations: the embedded engine (:mod:`miles_core.engine.engine`,
served over HTTP by :mod:`miles_core.engine.server`) and an SGLang server driven by
:mod:`miles_core.engine.sglang`. Both are contributed through the ``miles_inference_engines``
hook as :class:`EngineKind` descriptors (defined in :mod:`miles_core.engine.kind`, so plugin
discovery does not build this module's request types; importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from miles_core.engine.kind import EngineKind as EngineKind  # re-exported: the engine's public types
from miles_core.errors import ConfigError
from miles_core.frozen import quick_init

if TYPE_CHECKING:
    from pathlib import Path

FinishReason = Literal["stop", "length"]


class InvalidRequestError(ConfigError):
    """A request (or engine setting) that breaks a rule; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled. ``temperature == 0`` is greedy decoding.

    ``top_k <= 0`` and ``top_p == 1`` disable those filters. ``seed`` makes a completion
    reproducible whether it runs alone or batched with others; ``None`` lets the engine draw one
    from its own seeded generator.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # written out (no helper call per rule): a GRPO step builds one of these per sample
        if type(self.stop) is not tuple:
            object.__setattr__(self, "stop", tuple(self.stop))
        if type(self.stop_token_ids) is not tuple:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        max_tokens, temperature, top_p, seed = self.max_tokens, self.temperature, self.top_p, self.seed
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            _fail("max_tokens", "must be an integer >= 1", max_tokens)
        if not (_finite(temperature) and temperature >= 0):
            _fail("temperature", "must be a finite number >= 0", temperature)
        if not (_finite(top_p) and 0 < top_p <= 1):
            _fail("top_p", "must be in (0, 1]", top_p)
        if not isinstance(self.top_k, int):
            _fail("top_k", "must be an integer (<= 0 disables it)", self.top_k)
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < _SEED_LIMIT):
            _fail("seed", "must be an integer in [0, 2**63)", seed)
        if self.stop and not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "must be non-empty strings", self.stop)
        if self.stop_token_ids and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "must be integers >= 0", self.stop_token_ids)

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy with ``seed`` instead: only the seed is checked (the other fields were)."""
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < _SEED_LIMIT):
            _fail("seed", "must be an integer in [0, 2**63)", seed)
        copy = object.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.__dict__["seed"] = seed
        return copy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@quick_init
@dataclass(frozen=True)
class GenerationRequest:
    """A tokenized prompt and how to continue it."""

    input_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None


@quick_init
@dataclass(frozen=True)
class Timing:
    """Seconds from a request's submission to its admission (a slot), its first token and its last."""

    admitted_s: float
    first_token_s: float
    finished_s: float


@quick_init
@dataclass(frozen=True)
class Completion:
    """What the engine generated for one request, token-exact.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was sampled
    from (after temperature, top-k and top-p; for greedy decoding, the unmodified model
    distribution). ``weight_version`` names the weights that produced every token.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    matched_stop: int | str | None
    weight_version: str
    seed: int
    #: when it happened, in seconds since submission (``None`` where not measured)
    timing: Timing | None = field(default=None, compare=False)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class EngineServer(Protocol):
    """A running upstream that speaks the engine HTTP contract (embedded or SGLang)."""

    @property
    def base_url(self) -> str: ...

    def wait_until_healthy(self, timeout: float) -> None: ...

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str: ...

    def shutdown(self) -> None: ...


def require_model_dir(path: str | Path) -> Path:
    """``path`` as a Hugging Face model directory, or a :class:`ConfigError` saying what is missing."""
    from pathlib import Path  # not at module level: plugin discovery imports this module

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory}: not a model directory (config.json is missing)")
    return directory


_SEED_LIMIT = 2**63


def _finite(value: Any) -> bool:
    return (type(value) is float or (isinstance(value, (int, float)) and not isinstance(value, bool))) and math.isfinite(value)


def _fail(name: str, rule: str, value: Any) -> None:
    raise InvalidRequestError(name, f"{rule}, got {value!r}")
