"""The embedded engine: continuous batching over a causal LM, token-in / token-out.

One background thread owns the model. Each loop iteration

1. admits waiting requests into free slots and plans a prefill of at most
   ``prefill_chunk_tokens`` prompt tokens (requests with an identical prompt, as GRPO sends them,
   share one prefill; a prompt longer than the budget is prefilled in chunks over several
   iterations, so running sequences keep decoding meanwhile);
2. runs that prefill as one batched forward and samples the first token of every request whose
   prompt it finished (a request that stops there, like a one-token GRPO sample, never takes a
   decode row: only the requests that continue get one, with a copy of the prompt's state);
3. launches one decode step over every running sequence: one forward, batched sampling on the
   device, one device-to-host copy of the sampled tokens and their log-probs;
4. takes the tokens of a step, retires the finished sequences and compacts the slots (the state
   of decoding sequences occupies rows ``[0, n)``, so the next step works on plain views).

On a GPU, step 4 reads the tokens of the step launched in the *previous* iteration, after step 3
has queued the next one (``overlap_steps``): the host's bookkeeping runs while the device computes
instead of between its steps. The next step needs nothing from the host (its input tokens are the
sampled ones, already on the device; its random numbers depend only on each row's seed and
position), so the tokens are those of the plain loop; a sequence that stops at step ``t`` has had
one more row computed in step ``t + 1``, which is discarded.

The forward and the per-slot state belong to a runner (:mod:`miles_core.engine.runner`): the
engine's own lean forward for the architectures it knows (with CUDA graphs of the decode step on
a GPU), the Hugging Face modules for the others.

Weight updates are queued like requests: admission pauses, running sequences finish on the
weights they started with, then the new tensors are copied in (in place: the runner and its CUDA
graphs keep reading the same tensors) and admission resumes. A completion is thus produced by
exactly one weight version, which it reports.

Many short requests stay cheap: a request is validated once per distinct prompt and sampling
parameters in a call (a GRPO batch repeats each prompt 8-16 times with one set of parameters and
its own seed), requests with equal parameters share one :class:`~miles_core.engine.stopping.StopRule`,
the random numbers of a step are drawn for all rows at once (:func:`~miles_core.engine.sampling.uniforms`),
and :meth:`Engine.generate` waits for its whole batch with one wakeup instead of one future per
request (:meth:`Engine.submit_batch`: the same, for a caller that does not block on it).

Use it in-process (``Engine.generate``, ``Engine.update_weights``) or over HTTP
(:mod:`miles_core.engine.server`).
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_core.engine.base import (
    Completion,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    Timing,
)
from miles_core.engine.loader import LoadedModel, check_weights, load_model, read_safetensors_dir
from miles_core.engine.runner import GDN_STATE_DTYPES, RUNNERS, Runner, build_runner
from miles_core.engine.sampling import RowParams, filters, row_values, sample_rows, uniforms
from miles_core.engine.stopping import Stop, StopChecker, StopRule
from miles_core.errors import ConfigError
from miles_core.hardware.devices import bind_device, completion_event, device_supports

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
    #: fuse the decode step's elementwise work with ``torch.compile`` (lean runner on a GPU; ignored
    #: elsewhere); ``None``: on where the lean runner has device graphs and triton imports.
    #: Compiling takes a while the first time on a machine (Inductor caches it)
    compile_decode: bool | None = None
    #: prompt tokens prefilled per loop iteration (longer prompts are chunked); ``None``: 2048 on
    #: CPU, 8192 on a GPU
    prefill_chunk_tokens: int | None = None
    #: launch decode step ``t + 1`` before reading step ``t``'s tokens back, so the loop's host
    #: work (stop checks, retiring, the next launch) runs while the device computes: the same
    #: tokens, and a sequence that stops at ``t`` costs one discarded row of step ``t + 1``.
    #: ``None``: on where the device computes asynchronously (a GPU), off on CPU (nothing to hide)
    overlap_steps: bool | None = None
    #: storage of the Gated DeltaNet recurrent states (lean runner): ``float32`` (the trainer's
    #: precision) or ``bfloat16`` (half the memory and the decode step's largest traffic, at a
    #: rounding of the state after every token; the arithmetic stays fp32 either way)
    gdn_state_dtype: str = "float32"

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
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ConfigError(f"compile_decode must be true, false or unset, got {self.compile_decode!r}")
        if self.overlap_steps is not None and not isinstance(self.overlap_steps, bool):
            raise ConfigError(f"overlap_steps must be true, false or unset, got {self.overlap_steps!r}")
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            raise ConfigError(f"gdn_state_dtype must be one of {', '.join(GDN_STATE_DTYPES)}, got {self.gdn_state_dtype!r}")
        if self.runner == "hf" and self.gdn_state_dtype != "float32":
            raise ConfigError("gdn_state_dtype applies to the lean runner; runner 'hf' keeps the model's own cache")
        chunk = self.prefill_chunk_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"prefill_chunk_tokens must be an integer >= 1, got {chunk!r}")


class _Spec:
    """What requests with equal sampling parameters (their seeds aside) share, checked once."""

    __slots__ = ("filtering", "greedy", "needs_row", "rule", "values")

    def __init__(self, params: SamplingParams, rule: StopRule, vocab_size: int) -> None:
        self.rule = rule
        self.values = row_values(params, vocab_size)  # the RowParams entry
        self.filtering = filters(params, vocab_size)  # needs the top-k / top-p sort
        self.greedy = params.greedy
        #: whether it can continue past its first token (a one-token request never takes a decode row)
        self.needs_row = rule.limit > 1


class _Batch:
    """The outcome of requests queued together (:meth:`Engine.generate`, :meth:`Engine.submit_batch`):
    their caller wakes once, when the last request of the batch is done -- through ``event``, or
    through ``future``, which then resolves to every request's completion or error, in order.
    Written by the loop thread only."""

    __slots__ = ("errors", "event", "future", "left", "results")

    def __init__(self, n: int, results: list[Any] | None = None, future: Future[list[Any]] | None = None) -> None:
        self.results: list[Any] = results if results is not None else [None] * n
        self.errors: list[tuple[int, BaseException]] = []
        self.left = n
        self.future = future
        self.event = threading.Event()

    def _one_done(self) -> None:
        self.left -= 1
        if not self.left:
            if self.future is None:
                self.event.set()
                return
            for index, exc in self.errors:
                self.results[index] = exc
            self.future.set_result(self.results)

    def outcome(self) -> list[Completion]:
        if self.errors:
            raise min(self.errors, key=lambda e: e[0])[1]  # the first failed request's error, in order
        return self.results  # no error: every request set its result


class _Sequence:
    """One request inside the engine (``__slots__``: a GRPO step makes hundreds of them)."""

    __slots__ = (
        "admitted",
        "batch",
        "checker",
        "done",
        "first_token",
        "followers",
        "future",
        "index",
        "logprobs",
        "prefilled",
        "prompt",
        "prompt_hash",
        "request_id",
        "row",
        "seed",
        "spec",
        "submitted",
        "tokens",
        "weight_version",
    )

    def __init__(self, request_id: str, prompt: tuple[int, ...], prompt_hash: int, spec: _Spec, seed: int,
                 checker: StopChecker | None, submitted: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_hash = prompt_hash
        self.spec = spec
        self.seed = seed
        self.checker = checker  # only with stop strings (they need per-sequence state)
        self.submitted = submitted
        #: where the outcome goes: a future (``submit``) or a slot of a batch (``generate``, ``submit_batch``)
        self.future: Future[Completion] | None = None
        self.batch: _Batch | None = None
        self.index = 0
        self.weight_version = ""
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.row = -1  # where its state is (a decode row, or the prefill's row until its first token)
        self.prefilled = 0  # prompt tokens already in the row's state
        #: sequences with the same prompt that start from this one's state when its prefill completes
        self.followers: list[_Sequence] = []
        self.admitted = 0.0
        self.first_token = 0.0
        self.done = False

    def start(self) -> bool:
        """Claim it for running: ``False`` when its future was cancelled meanwhile."""
        return self.future is None or self.future.set_running_or_notify_cancel()

    def resolve(self, completion: Completion) -> None:
        self.done = True
        if self.batch is not None:
            self.batch.results[self.index] = completion
            self.batch._one_done()
        elif self.future is not None:
            self.future.set_result(completion)

    def fail(self, exc: BaseException) -> None:
        self.done = True
        if self.batch is not None:
            self.batch.errors.append((self.index, exc))
            self.batch._one_done()
        elif self.future is not None:
            self.future.set_exception(exc)


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


class _StepBuffers:
    """Host memory of one step's sampling: its random numbers (copied to the device) and its
    tokens and log-probs (copied back); pinned where the device copies asynchronously."""

    def __init__(self, rows: int, pinned: bool) -> None:
        self.uniforms = torch.zeros(rows, dtype=torch.float64, pin_memory=pinned)
        self.uniforms_view = self.uniforms.numpy()
        self.results = torch.zeros((2, rows), dtype=torch.float64, pin_memory=pinned)


@dataclass
class _Step:
    """A launched decode step: the sequence of each row at launch, and where its results land."""

    sequences: list[_Sequence]
    results: torch.Tensor  # [2, n] host: tokens and log-probs, valid once ``done`` has synchronised
    done: Any  # the device event recorded after the copy (None on the host: already there)


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
            compile_decode=self.config.compile_decode, gdn_state_dtype=self.config.gdn_state_dtype,
        )
        on_host = self.device.type == "cpu"
        self._chunk_tokens = self.config.prefill_chunk_tokens or (2048 if on_host else 8192)
        rows = self._runner.rows
        self._row_params = RowParams(rows, self.vocab_size, self.device)
        self._next_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        pinned = device_supports(self.device, "pinned_memory_async_copy")
        self._overlap = pinned if self.config.overlap_steps is None else self.config.overlap_steps
        # decode steps alternate between two sets of host buffers: while step t + 1 is launched,
        # step t's copies may still be queued behind it on the device
        self._step_buffers = (_StepBuffers(rows, pinned), _StepBuffers(rows, pinned))
        self._first_buffers = _StepBuffers(rows, pinned)  # first tokens, sampled after a prefill
        self._in_flight: _Step | None = None
        # per decode row: the request's seed and how many numbers its stream has given (moved with the row)
        self._row_seed = np.zeros(rows, dtype=np.uint64)
        self._row_drawn = np.zeros(rows, dtype=np.uint64)
        self._first_draws = np.zeros(rows, dtype=np.uint64)  # a first token is number 0 of its stream
        # the first tokens of a prefill are sampled in chunks of this many rows (bounds their logits' memory)
        self._sample_chunk = rows
        self._prefill_params = RowParams(rows, self.vocab_size, self.device)
        self._seed_source = random.Random(self.config.seed)
        self._request_ids = itertools.count()
        self._request_prefix = uuid.uuid4().hex[:12] + "-"
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
        """The runner and its state: ``runner``, ``cuda_graphs``, KV capacity, graph counts, and
        whether decode steps overlap (``overlap_steps``)."""
        return {**self._runner.describe(), "overlap_steps": self._overlap}

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
        sequences = self._sequences(requests)
        futures: list[Future[Completion]] = []
        for sequence in sequences:
            future: Future[Completion] = Future()
            sequence.future = future
            futures.append(future)
        self._enqueue(sequences)
        return futures

    def submit_batch(self, requests: Sequence[GenerationRequest]) -> Future[list[Completion | Exception]]:
        """Queue ``requests`` together, as :meth:`generate` does, without waiting for them: the
        future resolves once every one is done, to each one's :class:`Completion` or error, in
        order -- one wake-up for the batch instead of a future per request.

        A request that fails validation does not refuse the batch: its
        :class:`InvalidRequestError` is its outcome and the others run. :meth:`abort` on the
        future stops every request of the batch still running (each fails with
        :class:`RequestAborted`). Raises ``RuntimeError`` when the engine cannot take requests.
        """
        outcomes: list[Any] = [None] * len(requests)
        indices: Sequence[int]
        try:
            sequences = self._sequences(requests)
            indices = range(len(requests))
        except InvalidRequestError:  # find the refused ones; the rest run
            sequences, indices = [], []
            for index, request in enumerate(requests):
                try:
                    sequences.extend(self._sequences([request]))
                except InvalidRequestError as exc:
                    outcomes[index] = exc
                    continue
                indices.append(index)
        future: Future[list[Completion | Exception]] = Future()
        future.set_running_or_notify_cancel()  # only abort() stops it: it is queued at once
        if not sequences:
            future.set_result(outcomes)
            return future
        batch = _Batch(len(sequences), outcomes, future)
        for index, sequence in zip(indices, sequences):
            sequence.batch, sequence.index = batch, index
        self._enqueue(sequences)
        return future

    def abort(self, future: Future[Any]) -> None:
        """Stop generating for ``future`` (its caller went away): it fails with :class:`RequestAborted`
        before the next decode step, freeing its slot; for a :meth:`submit_batch` future, every
        request of the batch not yet done does. A finished request is left as it is."""
        with self._cond:
            self._aborted.add(future)
            self._cond.notify_all()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Generate every request (batched together) and return the completions in order.

        Validated like :meth:`submit_many`; if requests fail, the error of the first failed one
        (in order) is raised once every request is done."""
        sequences = self._sequences(requests)
        if not sequences:
            return []
        batch = _Batch(len(sequences))
        for index, sequence in enumerate(sequences):
            sequence.batch, sequence.index = batch, index
        self._enqueue(sequences)
        batch.event.wait()
        return batch.outcome()

    def _sequences(self, requests: Sequence[GenerationRequest]) -> list[_Sequence]:
        """Validate ``requests`` (raising before anything is queued) into sequences.

        Each distinct prompt object and each distinct sampling-parameter object is checked once
        (the caches hold the objects, so their ids stay theirs); equal prompts share one tuple
        and equal parameters (seed aside) one :class:`_Spec`."""
        prompts: dict[int, tuple[object, tuple[int, ...], int]] = {}
        prompt_values: dict[tuple[int, ...], tuple[object, tuple[int, ...], int]] = {}
        specs: dict[int, tuple[SamplingParams, _Spec]] = {}
        spec_values: dict[tuple[Any, ...], _Spec] = {}
        ids, prefix, seed_source = self._request_ids, self._request_prefix, self._seed_source
        max_model_len = self.max_model_len
        now = time.perf_counter()
        sequences: list[_Sequence] = []
        for request in requests:
            input_ids = request.input_ids
            entry = prompts.get(id(input_ids))
            if entry is None:
                prompt = self.check_prompt(input_ids)
                entry = prompt_values.get(prompt)
                if entry is None:
                    entry = prompt_values[prompt] = (input_ids, prompt, hash(prompt))
                prompts[id(input_ids)] = (input_ids, entry[1], entry[2])
            params = request.sampling
            known = specs.get(id(params))
            if known is None:
                key = (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop,
                       params.stop_token_ids, params.ignore_eos)
                spec = spec_values.get(key)
                if spec is None:
                    spec = spec_values[key] = self._spec(params)
                specs[id(params)] = (params, spec)
            else:
                spec = known[1]
            prompt = entry[1]
            if params.max_tokens > max_model_len - len(prompt):
                room = max_model_len - len(prompt)
                raise InvalidRequestError(
                    "max_tokens",
                    f"{params.max_tokens} new tokens after a {len(prompt)}-token prompt exceed max_model_len "
                    f"{max_model_len} (at most {room} allowed)",
                )
            seed = params.seed
            checker = None
            if params.stop:
                checker = StopChecker(params, eos_token_ids=(), room=max_model_len, decode=self._decode, rule=spec.rule)
            sequences.append(_Sequence(
                request.request_id or f"{prefix}{next(ids)}", prompt, entry[2], spec,
                seed if seed is not None else seed_source.getrandbits(63), checker, now,
            ))
        return sequences

    def _spec(self, params: SamplingParams) -> _Spec:
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"token ids {bad} are outside the vocabulary (size {self.vocab_size})")
        rule = StopRule(params, eos_token_ids=self.eos_token_ids, room=self.max_model_len)
        return _Spec(params, rule, self.vocab_size)

    def _enqueue(self, sequences: list[_Sequence]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self._broken_weights or self._crashed:
                raise RuntimeError(self._broken_weights or self._crashed)
            self._waiting.extend(sequences)
            self._cond.notify_all()

    def check_prompt(self, input_ids: Sequence[int]) -> tuple[int, ...]:
        prompt = tuple(input_ids)
        if not prompt:
            raise InvalidRequestError("input_ids", "must not be empty")
        if not all(type(t) is int or (isinstance(t, int) and not isinstance(t, bool)) for t in prompt):
            raise InvalidRequestError("input_ids", "must be a list of integers")
        vocab = self.vocab_size
        if not (min(prompt) >= 0 and max(prompt) < vocab):
            out_of_range = [t for t in prompt if not 0 <= t < vocab]
            raise InvalidRequestError("input_ids", f"token ids {out_of_range[:5]} are outside the vocabulary (size {vocab})")
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

    def _reserved_rows(self) -> int:
        """Decode rows in use or promised: decoding rows, and a row for each staged prompt and
        each of its followers that may continue past its first token."""
        return self._decoding + sum(1 + sum(f.spec.needs_row for f in s.followers) for s in self._staged)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug in the loop itself: nothing may wait forever on it
            logger.exception("the engine loop crashed")
            with self._cond:
                self._crashed = f"the engine loop crashed: {type(exc).__name__}: {exc}"
                for sequence in self._running():
                    if not sequence.done:
                        sequence.fail(RuntimeError(self._crashed))
                self._fail_waiting(RuntimeError(self._crashed))

    def _serve(self) -> None:
        bind_device(self.device)  # streams and graph captures of this thread go to the model's device
        with torch.inference_mode():
            while True:
                if self._in_flight is not None and not self._decoding:
                    self._drain()  # its rows all stopped meanwhile: nothing to overlap it with
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
                    launched = self._launch_step() if self._decoding else None
                    self._drain()  # step t's tokens, read while step t + 1 runs
                    self._in_flight = launched
                    if not self._overlap:
                        self._drain()
                except Exception as exc:  # fail the affected requests loudly, keep serving others
                    self._in_flight = None
                    with self._cond:
                        affected = {id(s): s for s in [*(seg.sequence for seg in plan), *self._running()]}
                        for sequence in affected.values():
                            for member in (sequence, *sequence.followers):
                                if not member.done:
                                    member.fail(exc)
                        self._slots = [None] * len(self._slots)
                        self._decoding = 0
                        self._staged.clear()

    def _fail_waiting(self, exc: Exception) -> None:
        while self._waiting:
            sequence = self._waiting.popleft()
            if sequence.start():
                sequence.fail(exc)
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
        admitted (first come, first served) while decode rows and the token budget last.

        A request whose prompt is being prefilled (now or in an earlier chunk) follows that
        prompt's request: it costs no prefill, and no row unless it may continue past its first
        token."""
        budget = self._chunk_tokens
        staging = self._runner.staging
        plan: list[_Segment] = []
        for staged in self._staged:
            if budget <= 0:
                break
            take = min(len(staged.prompt) - staged.prefilled, budget)
            plan.append(_Segment(staged, staged.prefilled, list(staged.prompt[staged.prefilled : staged.prefilled + take])))
            budget -= take
        free = self.config.max_batch_size - self._reserved_rows()
        leaders: dict[int, list[_Sequence]] = {}  # by prompt hash
        for staged in self._staged:
            leaders.setdefault(staged.prompt_hash, []).append(staged)
        now = time.perf_counter()
        waiting = self._waiting
        while waiting and not (self._updates or self._closed):
            sequence = waiting[0]
            prompt = sequence.prompt
            leader = None
            for candidate in leaders.get(sequence.prompt_hash, ()):
                if candidate.prompt is prompt or candidate.prompt == prompt:
                    leader = candidate
                    break
            cost = 1 if leader is None or sequence.spec.needs_row else 0
            if cost > free:
                break
            whole = len(prompt)
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
            waiting.popleft()
            if not sequence.start():
                continue
            sequence.weight_version = self._version
            sequence.admitted = now
            free -= cost
            if leader is not None:
                leader.followers.append(sequence)
                continue
            leaders.setdefault(sequence.prompt_hash, []).append(sequence)
            plan.append(_Segment(sequence, 0, list(prompt[:take])))
            budget -= take
            if take < whole:
                self._staged.append(sequence)
        self._assign_rows(plan)
        return plan

    def _assign_rows(self, plan: list[_Segment]) -> None:
        """A new prompt that completes in this prefill is prefilled in the decode row it would take
        if every one of its requests continued (leader first, then the followers that may), so in
        the usual case its state is already where it decodes; one that needs more chunks takes a
        free staging row."""
        offset = self._decoding
        busy = {s.row for s in self._staged}
        for segment in plan:
            leader = segment.sequence
            if segment.completes:
                if leader.row < 0:
                    leader.row = offset
                offset += 1 + sum(f.spec.needs_row for f in leader.followers)
            elif leader.row < 0:
                leader.row = next(r for r in range(self.config.max_batch_size, self._runner.rows) if r not in busy)
                busy.add(leader.row)

    # -- prefill and decode (outside the lock) -----------------------------------------------

    def _prefill(self, plan: list[_Segment]) -> None:
        """Run the planned chunks; for every prompt that completes, sample the first token of each
        of its requests, give a decode row (and a copy of the prompt's state) to those that
        continue, and retire the others."""
        runner = self._runner
        runner.reset_rows([seg.sequence.row for seg in plan if seg.start == 0])
        logits = runner.prefill([seg.sequence.row for seg in plan], [seg.start for seg in plan], [seg.tokens for seg in plan])
        counters = self._counters
        counters["prefill_steps"] += 1
        counters["prefill_tokens"] += sum(len(seg.tokens) for seg in plan)
        members: list[_Sequence] = []
        logit_rows: list[int] = []
        sources: list[int] = []  # the row holding each member's prompt state
        completed: list[_Sequence] = []
        for index, segment in enumerate(plan):
            leader = segment.sequence
            leader.prefilled += len(segment.tokens)
            if not segment.completes:
                continue
            completed.append(leader)
            members.append(leader)
            members.extend(leader.followers)
            group = 1 + len(leader.followers)
            logit_rows.extend(itertools.repeat(index, group))
            sources.extend(itertools.repeat(leader.row, group))
        if not members:
            return
        counters["prefills"] += len(completed)
        tokens, logprobs = self._sample_first(members, logits, logit_rows)
        counters["generated_tokens"] += len(members)
        now = time.perf_counter()
        finished: list[tuple[_Sequence, Stop]] = []
        continuing: list[_Sequence] = []
        moves: list[tuple[int, int]] = []
        first_tokens: list[int] = []
        target = self._decoding
        for member, source, token, logprob in zip(members, sources, tokens, logprobs):
            member.tokens.append(token)
            member.logprobs.append(logprob)
            member.first_token = now
            if member.checker is not None:
                stop = member.checker.check(member.tokens)
            else:
                stop = member.spec.rule.check_token(token, 1)
            if stop is not None:
                finished.append((member, stop))
                continue
            if source != target:
                moves.append((source, target))
            member.row = target
            target += 1
            continuing.append(member)
            first_tokens.append(token)
        start = self._decoding
        if moves:
            runner.copy_rows([m[0] for m in moves], [m[1] for m in moves])
        if continuing:
            rows = range(start, target)
            self._row_params.set_values(rows, [m.spec.values for m in continuing])
            self._next_tokens[start:target] = torch.tensor(first_tokens, dtype=torch.long).to(self.device, non_blocking=True)
            self._row_seed[start:target] = [m.seed for m in continuing]
            self._row_drawn[start:target] = 1
        # prefill rows that nobody decodes in keep no tokens (see Runner.clear_lengths)
        used = max((r for r in sources if r < self.config.max_batch_size), default=-1) + 1
        if used > target:
            runner.clear_lengths(range(target, used))
        with self._cond:
            for leader in completed:
                if leader in self._staged:
                    self._staged.remove(leader)
            slots = self._slots
            for member in continuing:
                slots[member.row] = member
            self._decoding = target
        self._retire(finished, now)

    def _sample_first(self, members: list[_Sequence], logits: torch.Tensor, logit_rows: list[int]) -> tuple[list[int], list[float]]:
        """The first token of each member from its prompt's logits (``logits[logit_rows[i]]``), in
        chunks of at most :attr:`_sample_chunk` rows."""
        tokens: list[int] = []
        logprobs: list[float] = []
        params = self._prefill_params
        chunk = self._sample_chunk
        for lo in range(0, len(members), chunk):
            part = members[lo : lo + chunk]
            n = len(part)
            params.set_values(range(n), [m.spec.values for m in part])
            buffers = self._first_buffers
            uniforms(np.fromiter((m.seed for m in part), dtype=np.uint64, count=n), self._first_draws[:n],
                     out=buffers.uniforms_view[:n])
            index = logit_rows[lo : lo + chunk]
            rows = logits if index == list(range(logits.shape[0])) else logits[torch.tensor(index, device=self.device)]
            specs = {m.spec for m in part}
            sampled, chosen = sample_rows(
                rows, params.temperature[:n], params.top_k[:n], params.top_p[:n], params.greedy[:n],
                buffers.uniforms[:n].to(self.device, non_blocking=True),
                filtering=any(s.filtering for s in specs), any_greedy=any(s.greedy for s in specs),
            )
            host = torch.stack([sampled.double(), chosen.double()]).cpu()
            tokens.extend(host[0].long().tolist())
            logprobs.extend(host[1].tolist())
        return tokens, logprobs

    def _launch_step(self) -> _Step:
        """Queue one decode step for every decoding row (forward, sampling, the copy of its tokens
        and log-probs to the host) without waiting for it."""
        n = self._decoding
        logits = self._runner.decode(self._next_tokens[:n])
        self._counters["decode_steps"] += 1
        sequences: list[_Sequence] = self._slots[:n]  # type: ignore[assignment]  # the first _decoding slots are filled
        buffers = self._step_buffers[self._counters["decode_steps"] % 2]
        p = self._row_params
        uniforms(self._row_seed[:n], self._row_drawn[:n], out=buffers.uniforms_view[:n])
        self._row_drawn[:n] += 1
        specs = {s.spec for s in sequences}
        tokens, logprobs = sample_rows(
            logits, p.temperature[:n], p.top_k[:n], p.top_p[:n], p.greedy[:n],
            buffers.uniforms[:n].to(self.device, non_blocking=True),
            filtering=any(s.filtering for s in specs), any_greedy=any(s.greedy for s in specs),
        )
        self._next_tokens[:n] = tokens
        results = buffers.results[:, :n]
        results[0].copy_(tokens, non_blocking=True)
        results[1].copy_(logprobs, non_blocking=True)
        done = completion_event(self.device)
        if done is not None:
            done.record()
        return _Step(sequences, results, done)

    def _finish_step(self, step: _Step) -> None:
        """Take a launched step's tokens: append them, retire the sequences that stop. Rows of
        sequences that finished (or were aborted) after the step was launched are discarded."""
        if step.done is not None:
            step.done.synchronize()
        finished: list[tuple[_Sequence, Stop]] = []
        accepted = 0
        for sequence, token, logprob in zip(step.sequences, step.results[0].long().tolist(), step.results[1].tolist()):
            if sequence.done:
                continue
            accepted += 1
            generated = sequence.tokens
            generated.append(token)
            sequence.logprobs.append(logprob)
            if sequence.checker is not None:
                stop = sequence.checker.check(generated)
            else:
                rule = sequence.spec.rule
                if token not in rule.stop_ids and len(generated) < rule.limit:
                    continue
                stop = rule.check_token(token, len(generated))
            if stop is not None:
                finished.append((sequence, stop))
        self._counters["generated_tokens"] += accepted
        if not finished:
            return
        with self._cond:
            for sequence, _ in finished:
                self._slots[sequence.row] = None
            self._compact()
        self._retire(finished, time.perf_counter())

    def _drain(self) -> None:
        """Finish the step in flight, if any."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._finish_step(step)

    def _retire(self, finished: list[tuple[_Sequence, Stop]], now: float) -> None:
        for sequence, stop in finished:
            submitted = sequence.submitted
            # positional: half the cost of keywords, hundreds of times per step
            sequence.resolve(Completion(
                sequence.request_id, sequence.prompt, tuple(sequence.tokens), tuple(sequence.logprobs), stop.reason,
                stop.matched, sequence.weight_version, sequence.seed,
                Timing(sequence.admitted - submitted, sequence.first_token - submitted, now - submitted),
            ))

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
        """Decode rows ``targets`` take everything of rows ``sources``: model state, sampling
        parameters, next token, random stream."""
        self._runner.copy_rows(sources, targets)
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        self._row_params.copy_rows(src, dst)
        self._next_tokens[dst] = self._next_tokens[src]
        self._row_seed[targets] = self._row_seed[sources]
        self._row_drawn[targets] = self._row_drawn[sources]

    def _drop_aborted(self) -> None:
        aborted = self._aborted

        def is_aborted(sequence: _Sequence) -> bool:
            return sequence.future in aborted or (sequence.batch is not None and sequence.batch.future in aborted)

        hit = [s for s in self._slots[: self._decoding] if s is not None and is_aborted(s)]
        for sequence in hit:
            self._slots[sequence.row] = None
        if hit:
            self._compact()
        for staged in list(self._staged):
            for follower in [f for f in staged.followers if is_aborted(f)]:
                staged.followers.remove(follower)
                hit.append(follower)
            if is_aborted(staged):  # its followers still need the prompt: one takes over
                self._staged.remove(staged)
                hit.append(staged)
                if staged.followers:
                    heir, *rest = staged.followers
                    heir.row, heir.prefilled, heir.followers = staged.row, staged.prefilled, rest
                    self._staged.append(heir)
        for sequence in hit:
            sequence.fail(RequestAborted(f"request {sequence.request_id} was aborted"))
        for sequence in [s for s in self._waiting if is_aborted(s)]:
            self._waiting.remove(sequence)
            if sequence.start():
                sequence.fail(RequestAborted(f"request {sequence.request_id} was aborted"))
        aborted.clear()

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._loop_tokenizer.decode(list(token_ids), skip_special_tokens=False)
