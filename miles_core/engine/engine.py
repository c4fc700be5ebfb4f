"""The embedded engine: continuous batching over a causal LM, token-in / token-out.

One background thread owns the model. Each loop iteration

1. admits waiting requests into free slots and plans a prefill of at most
   ``prefill_chunk_tokens`` prompt tokens (requests with an identical prompt, as GRPO sends them,
   share one prefill; a prompt longer than the budget is prefilled in chunks over several
   iterations, so running sequences keep decoding meanwhile);
2. runs that prefill as one batched forward and samples the first token of every prompt it
   finished;
3. runs one decode step over every running sequence: one forward, batched sampling on the
   device, one device-to-host copy of the sampled tokens and their log-probs;
4. retires the finished sequences and compacts the slots (the state of decoding sequences
   occupies rows ``[0, n)``, so the next step works on plain views).

The forward and the per-slot state belong to a runner (:mod:`miles_core.engine.runner`): the
engine's own lean forward for the architectures it knows (with CUDA graphs of the decode step on
a GPU), the Hugging Face modules for the others.

Weight updates are queued like requests: admission pauses, running sequences finish on the
weights they started with, then the new tensors are copied in (in place: the runner and its CUDA
graphs keep reading the same tensors) and admission resumes. A completion is thus produced by
exactly one weight version, which it reports.

Use it in-process (``Engine.generate``, ``Engine.update_weights``) or over HTTP
(:mod:`miles_core.engine.server`).
"""

from __future__ import annotations

import collections
import copy
import logging
import random
import threading
import time
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
    Timing,
)
from miles_core.engine.loader import LoadedModel, check_weights, load_model, read_safetensors_dir
from miles_core.engine.runner import RUNNERS, Runner, build_runner
from miles_core.engine.sampling import RowParams, filters, sample_rows
from miles_core.engine.stopping import Stop, StopChecker
from miles_core.errors import ConfigError
from miles_core.hardware.devices import bind_device, device_supports

logger = logging.getLogger(__name__)

#: a prompt that does not fit the rest of an iteration's budget starts chunked only if at least
#: this many of its tokens fit (shorter chunks cost a forward for little progress)
_MIN_CHUNK = 64


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
    #: ``lean`` (the engine's own forward), ``hf`` (the model's Hugging Face modules) or ``auto``
    #: (lean when the architecture has one)
    runner: str = "auto"
    #: replay the decode step from CUDA graphs (lean runner on a GPU; ignored elsewhere)
    cuda_graphs: bool = True
    #: prompt tokens prefilled per loop iteration (longer prompts are chunked); ``None``: 2048 on
    #: CPU, 8192 on a GPU
    prefill_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ConfigError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if self.runner not in RUNNERS:
            raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        chunk = self.prefill_chunk_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"prefill_chunk_tokens must be an integer >= 1, got {chunk!r}")


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stopper: StopChecker
    future: Future
    weight_version: str
    submitted: float
    filtering: bool  # needs the top-k / top-p sort
    rng: random.Random = field(init=False)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    row: int = -1  # where its state is (a decode row, or a staging row mid-prefill)
    target: int = -1  # the decode row it takes when its prefill completes
    prefilled: int = 0  # prompt tokens already in the row's state
    #: sequences with the same prompt that copy this one's state when its prefill completes
    followers: list[_Sequence] = field(default_factory=list)
    admitted: float = 0.0
    first_token: float = 0.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


@dataclass
class _Segment:
    """One prompt chunk of a planned prefill."""

    sequence: _Sequence
    start: int
    tokens: list[int]

    @property
    def completes(self) -> bool:
        return self.start + len(self.tokens) == len(self.sequence.prompt)


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
        self._runner: Runner = build_runner(
            self.model, kind=self.config.runner, max_slots=self.config.max_batch_size,
            max_model_len=self.max_model_len, cuda_graphs=self.config.cuda_graphs,
        )
        on_host = self.device.type == "cpu"
        self._chunk_tokens = self.config.prefill_chunk_tokens or (2048 if on_host else 8192)
        rows = self._runner.rows
        self._row_params = RowParams(rows, self.vocab_size, self.device)
        self._next_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._uniforms_host = torch.zeros(
            rows, dtype=torch.float64, pin_memory=device_supports(self.device, "pinned_memory_async_copy")
        )
        self._seed_source = random.Random(self.config.seed)
        self._version = self.config.weight_version
        self._updates_applied = 0
        self._broken_weights: str | None = None  # why generation is refused, after a failed update
        self._crashed: str | None = None  # why the loop stopped, if it died
        self._counters = {"prefills": 0, "prefill_steps": 0, "prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0}
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * self.config.max_batch_size  # decode rows
        self._decoding = 0  # decode rows [0, n) are occupied (compact between steps)
        self._staged: list[_Sequence] = []  # prompts part-way through a chunked prefill
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

    @property
    def runner(self) -> str:
        """Which forward serves the model: ``lean`` or ``hf``."""
        return self._runner.name

    def runner_info(self) -> dict[str, Any]:
        """The runner and its state: ``runner``, ``cuda_graphs``, KV capacity, graph counts."""
        return self._runner.describe()

    def stats(self) -> dict[str, int]:
        """Queue sizes and lifetime counters (prefills, decode steps, generated tokens, ...)."""
        with self._cond:
            return {
                "running": self._running_count(),
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
        now = time.perf_counter()
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
                        submitted=now,
                        filtering=filters(params, self.vocab_size),
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

    def _running(self) -> list[_Sequence]:
        """Every admitted, unfinished sequence (decoding, staged, and their followers)."""
        running = [s for s in self._slots[: self._decoding] if s is not None]
        for staged in self._staged:
            running.append(staged)
            running.extend(staged.followers)
        return running

    def _running_count(self) -> int:
        return self._decoding + sum(1 + len(s.followers) for s in self._staged)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug in the loop itself: nothing may wait forever on it
            logger.exception("the engine loop crashed")
            with self._cond:
                self._crashed = f"the engine loop crashed: {type(exc).__name__}: {exc}"
                for sequence in self._running():
                    if not sequence.future.done():
                        sequence.future.set_exception(RuntimeError(self._crashed))
                self._fail_waiting(RuntimeError(self._crashed))

    def _serve(self) -> None:
        bind_device(self.device)  # streams and graph captures of this thread go to the model's device
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._waiting or self._running_count() or self._updates or self._closed):
                        self._cond.wait()
                    if self._closed and not self._running_count():
                        self._fail_waiting(RuntimeError("the engine was closed before this request ran"))
                        return
                    if self._updates and not self._running_count():
                        self._apply_update(self._updates[0])
                        self._updates.popleft()  # only now: if applying crashed, the caller is failed
                        continue
                    if self._aborted:
                        self._drop_aborted()
                    plan = self._plan()
                try:
                    if plan:
                        self._prefill(plan)
                    if self._decoding:
                        self._decode_step()
                except Exception as exc:  # fail the affected requests loudly, keep serving others
                    with self._cond:
                        affected = {id(s): s for s in [*(seg.sequence for seg in plan), *self._running()]}
                        for sequence in affected.values():
                            for member in (sequence, *sequence.followers):
                                if not member.future.done():
                                    member.future.set_exception(exc)
                        self._slots = [None] * len(self._slots)
                        self._decoding = 0
                        self._staged.clear()

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

    # -- planning (under the lock) ----------------------------------------------------------

    def _plan(self) -> list[_Segment]:
        """This iteration's prefill: staged prompts continue first, then waiting requests are
        admitted (first come, first served) while slots and the token budget last."""
        budget = self._chunk_tokens
        staging = self._runner.staging
        plan: list[_Segment] = []
        for staged in self._staged:
            if budget <= 0:
                break
            take = min(len(staged.prompt) - staged.prefilled, budget)
            plan.append(_Segment(staged, staged.prefilled, list(staged.prompt[staged.prefilled : staged.prefilled + take])))
            budget -= take
        free = self.config.max_batch_size - self._running_count()
        # a request whose prompt is being prefilled (now or in an earlier chunk) copies that state
        leaders: dict[tuple[int, ...], _Sequence] = {s.prompt: s for s in self._staged}
        now = time.perf_counter()
        while self._waiting and free > 0 and not (self._updates or self._closed):
            sequence = self._waiting[0]
            leader = leaders.get(sequence.prompt)
            whole = len(sequence.prompt)
            if leader is not None:
                take = 0
            elif whole <= budget:
                take = whole
            elif staging == 0:  # no chunking: a long prompt gets a prefill of its own
                if plan:
                    break
                take = whole
            elif len(self._staged) < staging and budget >= min(whole, _MIN_CHUNK):
                take = budget
            else:
                break
            self._waiting.popleft()
            if not sequence.future.set_running_or_notify_cancel():
                continue
            sequence.weight_version = self._version
            sequence.admitted = now
            free -= 1
            if leader is not None:
                leader.followers.append(sequence)
                continue
            leaders[sequence.prompt] = sequence
            plan.append(_Segment(sequence, 0, list(sequence.prompt[:take])))
            budget -= take
            if take < whole:
                self._staged.append(sequence)
        self._assign_rows(plan)
        return plan

    def _assign_rows(self, plan: list[_Segment]) -> None:
        """Prompts that complete in this prefill get the decode rows after the current ones (leader,
        then its followers); a new prompt prefills in its decode row, or in a free staging row when
        it needs more chunks. Sets the sampling parameters of rows taken for the first time."""
        target = self._decoding
        busy = {s.row for s in self._staged}
        fresh: list[_Sequence] = []
        for segment in plan:
            leader = segment.sequence
            if segment.completes:
                for member in (leader, *leader.followers):
                    member.target = target
                    target += 1
                fresh.extend(leader.followers)
            if leader.row < 0:
                if segment.completes:
                    leader.row = leader.target
                else:
                    leader.row = next(r for r in range(self.config.max_batch_size, self._runner.rows) if r not in busy)
                    busy.add(leader.row)
                fresh.append(leader)
        rows = [s.target if s.row < 0 else s.row for s in fresh]
        self._row_params.set(rows, [s.params for s in fresh])

    # -- prefill and decode (outside the lock) -----------------------------------------------

    def _prefill(self, plan: list[_Segment]) -> None:
        runner = self._runner
        runner.reset_rows([seg.sequence.row for seg in plan if seg.start == 0])
        logits = runner.prefill([seg.sequence.row for seg in plan], [seg.start for seg in plan], [seg.tokens for seg in plan])
        self._counters["prefill_steps"] += 1
        self._counters["prefill_tokens"] += sum(len(seg.tokens) for seg in plan)
        sources, targets, members, logit_rows = [], [], [], []
        for index, segment in enumerate(plan):
            leader = segment.sequence
            leader.prefilled += len(segment.tokens)
            if not segment.completes:
                continue
            self._counters["prefills"] += 1
            prefill_row = leader.row
            for member in (leader, *leader.followers):
                if member.target != prefill_row:
                    sources.append(prefill_row)
                    targets.append(member.target)
                member.row = member.target
                members.append(member)
                logit_rows.append(index)
        if not members:
            return
        if sources:
            self._copy_rows(sources, targets)
        with self._cond:
            for segment in plan:
                if segment.completes and segment.sequence in self._staged:
                    self._staged.remove(segment.sequence)
            for member in members:
                self._slots[member.row] = member
            self._decoding += len(members)
        rows = torch.tensor([m.row for m in members], device=self.device)
        index = torch.tensor(logit_rows, device=self.device)
        self._sample_and_advance(members, logits[index], rows)

    def _decode_step(self) -> None:
        n = self._decoding
        logits = self._runner.decode(self._next_tokens[:n])
        self._counters["decode_steps"] += 1
        self._sample_and_advance(self._slots[:n], logits, None)  # type: ignore[arg-type]

    def _sample_and_advance(self, sequences: list[_Sequence], logits: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Sample a token for each sequence (``rows``: their rows; ``None``: rows ``[0, n)``), copy
        tokens and log-probs to the host in one transfer, retire finished sequences."""
        n = len(sequences)
        p = self._row_params
        if rows is None:
            temperature, top_k, top_p, greedy = p.temperature[:n], p.top_k[:n], p.top_p[:n], p.greedy[:n]
        else:
            temperature, top_k, top_p, greedy = p.temperature[rows], p.top_k[rows], p.top_p[rows], p.greedy[rows]
        uniforms = self._uniforms_host[:n]
        uniforms.copy_(torch.tensor([s.rng.random() for s in sequences], dtype=torch.float64))
        tokens, logprobs = sample_rows(
            logits, temperature, top_k, top_p, greedy, uniforms.to(self.device, non_blocking=True),
            filtering=any(s.filtering for s in sequences), any_greedy=any(s.params.greedy for s in sequences),
        )
        if rows is None:
            self._next_tokens[:n] = tokens
        else:
            self._next_tokens[rows] = tokens
        host = torch.stack([tokens.double(), logprobs.double()]).cpu()
        self._counters["generated_tokens"] += n
        now = time.perf_counter()
        finished: list[tuple[_Sequence, Stop]] = []
        for sequence, token, logprob in zip(sequences, host[0].long().tolist(), host[1].tolist()):
            generated = sequence.tokens
            generated.append(token)
            sequence.logprobs.append(logprob)
            if len(generated) == 1:
                sequence.first_token = now
            if sequence.stopper.may_stop(token, len(generated)):
                stop = sequence.stopper.check(generated)
                if stop is not None:
                    finished.append((sequence, stop))
        if not finished:
            return
        with self._cond:
            for sequence, _ in finished:
                self._slots[sequence.row] = None
            self._compact()
        for sequence, stop in finished:
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
                    timing=Timing(sequence.admitted - sequence.submitted, sequence.first_token - sequence.submitted,
                                  now - sequence.submitted),
                )
            )

    def _compact(self) -> None:
        """Move decoding sequences into the holes below ``n`` so they occupy rows ``[0, n)``."""
        used = self._decoding
        live = [s for s in self._slots[:used] if s is not None]
        n = len(live)
        holes = [r for r in range(n) if self._slots[r] is None]
        movers = [s for s in live if s.row >= n]
        if movers:
            sources = [s.row for s in movers]
            self._copy_rows(sources, holes)
            for sequence, row in zip(movers, holes):
                self._slots[sequence.row] = None
                sequence.row = row
                self._slots[row] = sequence
        self._decoding = n
        self._runner.clear_lengths(range(n, used))

    def _copy_rows(self, sources: list[int], targets: list[int]) -> None:
        self._runner.copy_rows(sources, targets)
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        self._row_params.copy_rows(src, dst)
        self._next_tokens[dst] = self._next_tokens[src]

    def _drop_aborted(self) -> None:
        aborted = RequestAborted
        hit = [s for s in self._slots[: self._decoding] if s is not None and s.future in self._aborted]
        for sequence in hit:
            self._slots[sequence.row] = None
        if hit:
            self._compact()
        for staged in list(self._staged):
            for follower in [f for f in staged.followers if f.future in self._aborted]:
                staged.followers.remove(follower)
                hit.append(follower)
            if staged.future in self._aborted:  # its followers still need the prompt: one takes over
                self._staged.remove(staged)
                hit.append(staged)
                if staged.followers:
                    heir, *rest = staged.followers
                    heir.row, heir.prefilled, heir.followers = staged.row, staged.prefilled, rest
                    self._row_params.set([heir.row], [heir.params])
                    self._staged.append(heir)
        for sequence in hit:
            sequence.future.set_exception(aborted(f"request {sequence.request_id} was aborted"))
        for sequence in [s for s in self._waiting if s.future in self._aborted]:
            self._waiting.remove(sequence)
            if sequence.future.set_running_or_notify_cancel():
                sequence.future.set_exception(aborted(f"request {sequence.request_id} was aborted"))
        self._aborted.clear()

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._loop_tokenizer.decode(list(token_ids), skip_special_tokens=False)
