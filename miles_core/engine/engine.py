"""The embedded engine: continuous batching over a Hugging Face causal LM.

One background thread owns the model. Each loop iteration it admits waiting requests (a prefill
each, into a free row of the :class:`~miles_core.engine.slot_cache.SlotStore`), then runs one
batched decode step over every running sequence, samples a token per sequence and retires the
finished ones. Requests therefore join and leave between decode steps.

Weight updates are queued like requests: admission pauses, running sequences finish on the
weights they started with, then the new tensors are copied in and admission resumes. A
completion is thus produced by exactly one weight version, which it reports.

Use it in-process (``Engine.generate``, ``Engine.update_weights``) or over HTTP
(:mod:`miles_core.engine.server`).
"""

from __future__ import annotations

import collections
import copy
import logging
import random
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.engine.base import (
    Completion,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from miles_core.engine.loader import LoadedModel, check_weights, load_model, read_safetensors_dir
from miles_core.engine.sampling import sample
from miles_core.engine.slot_cache import SlotStore, StepCache
from miles_core.engine.stopping import StopChecker
from miles_core.errors import ConfigError

logger = logging.getLogger(__name__)


class RequestAborted(RuntimeError):
    """The request was aborted (:meth:`Engine.abort`) before it finished."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (all validated at construction)."""

    max_batch_size: int = 64
    #: longest prompt + completion; ``None`` uses the model's ``max_position_embeddings``
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    #: seeds the generator that picks a seed for requests that bring none
    seed: int = 0
    weight_version: str = "0"
    #: torch intra-op threads on CPU (one is steady on small machines); ``None`` leaves torch's setting
    cpu_threads: int | None = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ConfigError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stopper: StopChecker
    future: Future
    weight_version: str
    rng: random.Random = field(init=False)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


@dataclass
class _WeightUpdate:
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    version: str | None
    future: Future


class Engine:
    """Continuous-batching generation over one model; thread-safe; see the module doc."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *, name: str = "model") -> None:
        self.config = config or EngineConfig()
        self.name = name
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # The loop thread decodes with its own copy: a fast tokenizer used from two threads at
        # once can fail ("Already borrowed") while the other thread encodes.
        self._loop_tokenizer = copy.deepcopy(loaded.tokenizer)
        self.eos_token_ids = loaded.eos_token_ids
        self.patch_report = loaded.patch_report
        model_config = self.model.config.get_text_config()
        self.vocab_size: int = model_config.vocab_size
        limit = getattr(model_config, "max_position_embeddings", None)
        self.max_model_len: int = self.config.max_model_len or limit or 4096
        if limit is not None and self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cpu" and self.config.cpu_threads is not None:
            torch.set_num_threads(self.config.cpu_threads)
        self._cache_argument = "cache" if "cache" in _forward_parameters(self.model) else "past_key_values"
        self._store = SlotStore(self.config.max_batch_size, initial_capacity=min(256, self.max_model_len))
        self._seed_source = random.Random(self.config.seed)
        self._version = self.config.weight_version
        self._updates_applied = 0
        self._broken_weights: str | None = None  # why generation is refused, after a failed update
        self._crashed: str | None = None  # why the loop stopped, if it died
        self._counters = {"prefills": 0, "decode_steps": 0, "generated_tokens": 0}
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._updates: collections.deque[_WeightUpdate] = collections.deque()
        self._aborted: set[Future] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"miles-engine-{name}", daemon=True)
        self._thread.start()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, *, name: str | None = None) -> Engine:
        config = config or EngineConfig()
        loaded = load_model(path, dtype=config.dtype, device=config.device)
        return cls(loaded, config, name=name or Path(path).name)

    @classmethod
    def from_preset(cls, preset: str, config: EngineConfig | None = None, *, cache_dir: str | Path | None = None) -> Engine:
        from miles_core.engine.presets import preset_dir

        return cls.from_pretrained(preset_dir(preset, cache_dir), config, name=preset)

    # -- public API -------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def problem(self) -> str | None:
        """Why the engine cannot serve right now (``None`` when it can)."""
        if self._closed:
            return "the engine is closed"
        return self._crashed or self._broken_weights

    def stats(self) -> dict[str, int]:
        """Queue sizes and lifetime counters (prefills, decode steps, generated tokens)."""
        with self._cond:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting),
                "max_batch_size": self.config.max_batch_size,
                **self._counters,
            }

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Queue ``request``; the future resolves to its :class:`Completion`.

        Raises :class:`InvalidRequestError` (naming the field) before queueing anything.
        """
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[Future[Completion]]:
        """Queue ``requests`` together (admitted in the same step when slots allow).

        Every request is validated first: if one is invalid, none is queued.
        """
        checked = [self._check(request) for request in requests]
        futures: list[Future[Completion]] = []
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self._broken_weights or self._crashed:
                raise RuntimeError(self._broken_weights or self._crashed)
            for request, (prompt, room) in zip(requests, checked):
                params = request.sampling
                future: Future[Completion] = Future()
                self._waiting.append(
                    _Sequence(
                        request_id=request.request_id or uuid.uuid4().hex,
                        prompt=prompt,
                        params=params,
                        seed=params.seed if params.seed is not None else self._seed_source.getrandbits(63),
                        stopper=StopChecker(params, eos_token_ids=self.eos_token_ids, room=room, decode=self._decode),
                        future=future,
                        weight_version=self._version,
                    )
                )
                futures.append(future)
            self._cond.notify_all()
        return futures

    def abort(self, future: Future[Completion]) -> None:
        """Stop generating for ``future`` (its caller went away): it fails with :class:`RequestAborted`
        before the next decode step, freeing its slot. A finished request is left as it is."""
        with self._cond:
            self._aborted.add(future)
            self._cond.notify_all()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Generate every request (batched together) and return the completions in order."""
        return [f.result() for f in self.submit_many(requests)]

    def _check(self, request: GenerationRequest) -> tuple[tuple[int, ...], int]:
        prompt = self.check_prompt(request.input_ids)
        params = request.sampling
        room = self.max_model_len - len(prompt)
        if params.max_tokens > room:
            raise InvalidRequestError(
                "max_tokens",
                f"{params.max_tokens} new tokens after a {len(prompt)}-token prompt exceed max_model_len "
                f"{self.max_model_len} (at most {room} allowed)",
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"token ids {bad} are outside the vocabulary (size {self.vocab_size})")
        return prompt, room

    def check_prompt(self, input_ids: Sequence[int]) -> tuple[int, ...]:
        prompt = tuple(input_ids)
        if not prompt:
            raise InvalidRequestError("input_ids", "must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("input_ids", "must be a list of integers")
        out_of_range = [t for t in prompt if not 0 <= t < self.vocab_size]
        if out_of_range:
            raise InvalidRequestError("input_ids", f"token ids {out_of_range[:5]} are outside the vocabulary (size {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                "input_ids", f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}, leaving no room to generate"
            )
        return prompt

    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        *,
        partial: bool = False,
    ) -> str:
        """Copy new weights in once running sequences finish; return the new weight version.

        Every tensor is checked (name, shape, and full coverage unless ``partial``) before any is
        copied: a rejected update changes nothing. Without ``weight_version`` the engine names the
        version by the number of updates applied so far.
        """
        pairs = check_weights(self.model, dict(named_tensors), partial=partial)
        future: Future[str] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._updates.append(_WeightUpdate(pairs, weight_version, future))
            self._cond.notify_all()
        return future.result()

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> str:
        """Load every tensor of a safetensors directory and apply it like :meth:`update_weights`."""
        return self.update_weights(read_safetensors_dir(model_path), weight_version)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug in the loop itself: nothing may wait forever on it
            logger.exception("the engine loop crashed")
            with self._cond:
                self._crashed = f"the engine loop crashed: {type(exc).__name__}: {exc}"
                for sequence in self._running:
                    if not sequence.future.done():
                        sequence.future.set_exception(RuntimeError(self._crashed))
                self._fail_waiting(RuntimeError(self._crashed))

    def _serve(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._waiting or self._running or self._updates or self._closed):
                        self._cond.wait()
                    if self._closed and not self._running:
                        self._fail_waiting(RuntimeError("the engine was closed before this request ran"))
                        return
                    if self._updates and not self._running:
                        self._apply_update(self._updates[0])
                        self._updates.popleft()  # only now: if applying crashed, the caller is failed
                        continue
                    if self._aborted:
                        self._drop_aborted()
                    admitted = []
                    while (
                        not (self._updates or self._closed)
                        and self._waiting
                        and len(self._running) + len(admitted) < self.config.max_batch_size
                    ):
                        sequence = self._waiting.popleft()
                        if sequence.future.set_running_or_notify_cancel():
                            sequence.weight_version = self._version
                            admitted.append(sequence)
                try:
                    for group in _same_prompt_groups(admitted):
                        self._prefill(group)
                    if self._running:
                        self._decode_step()
                except Exception as exc:  # fail the affected requests loudly, keep serving others
                    for sequence in [*admitted, *self._running]:
                        if not sequence.future.done():
                            sequence.future.set_exception(exc)
                    self._running.clear()
                    self._store.clear()

    def _fail_waiting(self, exc: Exception) -> None:
        while self._waiting:
            sequence = self._waiting.popleft()
            if sequence.future.set_running_or_notify_cancel():
                sequence.future.set_exception(exc)
        while self._updates:
            self._updates.popleft().future.set_exception(exc)

    def _apply_update(self, update: _WeightUpdate) -> None:
        try:
            with torch.no_grad():
                for target, source in update.pairs:
                    target.copy_(source)
        except Exception as exc:  # validated already, so e.g. out of memory: the weights are now mixed
            self._broken_weights = f"a weight update failed half-way ({type(exc).__name__}: {exc}); apply a full update"
            update.future.set_exception(exc)
            return
        self._broken_weights = None
        self._updates_applied += 1
        self._version = update.version if update.version is not None else str(self._updates_applied)
        update.future.set_result(self._version)

    def _forward(self, input_ids: torch.Tensor, cache: StepCache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=cache.attention_mask(self.dtype, self.device),
            position_ids=cache.position_ids(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        cache.commit()
        return out.logits[:, -1]

    def _prefill(self, group: list[_Sequence]) -> None:
        """One forward over the group's common prompt; every member gets a copy of the state."""
        prompt = group[0].prompt
        row = self._store.add_row()
        self._running.append(group[0])
        self._store.ensure_capacity(len(prompt))
        ids = torch.tensor([prompt], device=self.device)
        logits = self._forward(ids, StepCache(self._store, prefill_row=row, query_len=len(prompt)))
        for sequence in group[1:]:
            self._store.copy_row(row, self._store.add_row())
            self._running.append(sequence)
        self._counters["prefills"] += 1
        self._advance(group, logits.expand(len(group), -1))

    def _decode_step(self) -> None:
        self._store.ensure_capacity(max(self._store.lengths) + 1)
        ids = torch.tensor([[s.tokens[-1]] for s in self._running], device=self.device)
        logits = self._forward(ids, StepCache(self._store, prefill_row=None, query_len=1))
        self._counters["decode_steps"] += 1
        self._advance(list(self._running), logits)

    def _advance(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample the next token of each sequence (rows of ``logits``); retire finished ones."""
        tokens, logprobs = sample(logits, [s.params for s in sequences], [s.rng.random() for s in sequences])
        self._counters["generated_tokens"] += len(tokens)
        finished = []
        for sequence, token, logprob in zip(sequences, tokens, logprobs):
            sequence.tokens.append(token)
            sequence.logprobs.append(logprob)
            stop = sequence.stopper.check(sequence.tokens)
            if stop is not None:
                finished.append((sequence, stop))
        for sequence, stop in finished:
            self._retire(sequence)
            sequence.future.set_result(
                Completion(
                    request_id=sequence.request_id,
                    prompt_ids=sequence.prompt,
                    token_ids=tuple(sequence.tokens),
                    logprobs=tuple(sequence.logprobs),
                    finish_reason=stop.reason,
                    matched_stop=stop.matched,
                    weight_version=sequence.weight_version,
                    seed=sequence.seed,
                )
            )

    def _retire(self, sequence: _Sequence) -> None:
        """Free the sequence's row (the last row moves into it, mirrored in ``_running``)."""
        row = self._running.index(sequence)
        self._store.remove_row(row)
        last = self._running.pop()
        if last is not sequence:
            self._running[row] = last

    def _drop_aborted(self) -> None:
        for sequence in [s for s in self._running if s.future in self._aborted]:
            self._retire(sequence)
            sequence.future.set_exception(RequestAborted(f"request {sequence.request_id} was aborted"))
        for sequence in [s for s in self._waiting if s.future in self._aborted]:
            self._waiting.remove(sequence)
            if sequence.future.set_running_or_notify_cancel():
                sequence.future.set_exception(RequestAborted(f"request {sequence.request_id} was aborted"))
        self._aborted.clear()

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._loop_tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _same_prompt_groups(sequences: list[_Sequence]) -> list[list[_Sequence]]:
    """Sequences grouped by identical prompt (GRPO samples a prompt many times), in order."""
    groups: dict[tuple[int, ...], list[_Sequence]] = {}
    for sequence in sequences:
        groups.setdefault(sequence.prompt, []).append(sequence)
    return list(groups.values())


def _forward_parameters(model: Any) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(model.forward).parameters)
