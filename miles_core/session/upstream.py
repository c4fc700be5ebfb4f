"""The engine edge of the chat pipeline: what :class:`~miles_core.session.service.SessionService`
needs from its engine, over HTTP or in-process.

An :class:`Upstream` turns a validated request and the prompt ids the store planned into a
:class:`Generation`: the typed :class:`~miles_core.session.completion.Completion` the store
commits, the record of the call, and the reply the agent receives. Two implementations:

* :class:`HTTPUpstream` -- an SGLang-compatible engine over HTTP (:class:`EngineClient`): the
  request goes out as JSON with the server-owned ``input_ids`` and the flags the recording needs,
  the reply comes back as JSON and is checked by :func:`extract_completion`; the record holds
  the exact bytes. This is what ``miles session serve`` uses.
* :class:`EngineUpstream` -- the embedded :class:`~miles_core.engine.engine.Engine` in this
  process: a :class:`GenerationRequest` in, the engine's typed completion out, held to the same
  rules (:func:`make_completion`, :func:`check_sampled`); no JSON is written unless someone asks
  for the record or the reply (``GET /sessions/{id}``, an HTTP agent). Requests handed over in
  one event-loop iteration reach the engine together (``submit_many``), as a batched
  ``generate`` would send them; a batch of turns handed over as one
  (:meth:`Upstream.generate_many`) is one ``submit_batch`` and one wake-up when it is done.

Both raise the same :class:`~miles_core.session.errors.SessionError` types: 400 for a request the
engine refuses, 502 for an engine that fails or breaks its contract.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from miles_core import strict_json
from miles_core.caching import BoundedCache, exact_json_key
from miles_core.engine.errors import EngineError, EngineHTTPError
from miles_core.frozen import quick_init
from miles_core.session.completion import (
    Completion,
    check_sampled,
    checked_message,
    client_reply,
    extract_completion,
    make_completion,
    sampled_plausibly,
)
from miles_core.session.errors import InvalidRequest, SessionError, UpstreamFailure
from miles_core.session.messages import Message
from miles_core.session.normalize import OWN, ChatRequest, forward_with, upstream_body
from miles_core.session.trajectory import DeferredRecord, Record, TurnRecord

#: results of requests submitted together reach the event loop together: when the last of them is
#: done, or this long after the first of the rest (each wake-up while the engine works costs it
#: time: the callbacks run on the event loop's thread, which then holds the GIL the engine's loop
#: needs between its operations). A lone request is delivered the moment it is done.
DELIVERY_WINDOW_S = 0.05

if TYPE_CHECKING:
    from miles_core.engine import base as engine_base
    from miles_core.engine.client import EngineClient
    from miles_core.engine.engine import Engine


class Generation(Protocol):
    """One engine call: what the store commits, what it records, what the agent receives."""

    @property
    def completion(self) -> Completion: ...

    @property
    def record(self) -> Record: ...

    def reply(self) -> dict[str, Any]:
        """The reply to the agent (replay data stripped), built when asked for."""
        ...


@quick_init
@dataclass(frozen=True, eq=False)
class Received:
    """A :class:`Generation` whose reply came over the wire."""

    completion: Completion
    record: TurnRecord
    answer: dict[str, Any]  # the reply to the agent

    def reply(self) -> dict[str, Any]:
        return self.answer


#: one turn for :meth:`Upstream.generate_many`: the request, its planned prompt ids, its routing key
#: and the seed it is sent with (:data:`~miles_core.session.normalize.OWN`: the request's own;
#: :func:`~miles_core.session.normalize.forward_with`)
UpstreamCall = tuple[ChatRequest, Sequence[int], str, Any]


class Upstream(Protocol):
    async def generate(self, request: ChatRequest, prompt_ids: Sequence[int], *, routing_key: str) -> Generation: ...

    async def generate_many(self, calls: Sequence[UpstreamCall]) -> list[Generation | SessionError]:
        """Each call as :meth:`generate` would answer it, its failure (a
        :class:`~miles_core.session.errors.SessionError`) in its place."""
        ...

    async def aclose(self) -> None: ...


class HTTPUpstream:
    """An SGLang-compatible engine over HTTP (see the module doc)."""

    def __init__(self, client: EngineClient, *, vocab_size: int) -> None:
        self.client = client
        self.vocab_size = vocab_size

    def generate(
        self, request: ChatRequest, prompt_ids: Sequence[int], *, routing_key: str
    ) -> Coroutine[Any, Any, Generation]:
        # the call itself, not a coroutine awaiting it: no frame of this method holds the request
        # while the engine generates (_generate lets it go once the body is encoded)
        return self._generate(request, prompt_ids, routing_key, OWN)

    async def _generate(self, request: ChatRequest, prompt_ids: Sequence[int], routing_key: str, seed: Any) -> Generation:
        try:
            sent = strict_json.dumps(upstream_body(request, prompt_ids, seed))
        except ValueError as exc:
            raise InvalidRequest(f"the request cannot be forwarded upstream: {exc}") from None
        asked_logprobs = request.forward.get("logprobs") is True
        # The parsed history is not needed while the engine generates. Released now, its ~100
        # objects per session in flight stay out of every young garbage collection.
        del request
        started = time.time()
        try:
            reply, received = await self.client.chat_completions_raw(sent, routing_key=routing_key)
        except EngineError as exc:
            raise upstream_error(exc) from exc
        completion = extract_completion(reply, vocab_size=self.vocab_size)
        answer = client_reply(reply, logprobs=asked_logprobs)
        return Received(completion, TurnRecord(sent, received, started, time.time()), answer)

    async def generate_many(self, calls: Sequence[UpstreamCall]) -> list[Generation | SessionError]:
        """The calls as concurrent requests (the engine client's pool bounds them)."""

        async def one(request: ChatRequest, prompt_ids: Sequence[int], routing_key: str, seed: Any) -> Generation | SessionError:
            try:
                return await self._generate(request, prompt_ids, routing_key, seed)
            except SessionError as exc:
                return exc

        return list(await asyncio.gather(*(one(*call) for call in calls)))

    async def aclose(self) -> None:
        await self.client.aclose()


def upstream_error(exc: EngineError) -> SessionError:
    """An engine failure as the agent sees it: its own request rejected (400) or upstream (502)."""
    if isinstance(exc, EngineHTTPError) and exc.status_code in (400, 422):
        return InvalidRequest(f"the engine rejected the request: {exc.detail}")
    return UpstreamFailure(f"{type(exc).__name__}: {exc.detail}")


class EngineUpstream:
    """The embedded engine called in-process (see the module doc).

    ``tokenizer`` decodes completions into the reply's text (the engine's own tokenizer is used
    by the threads that serve it; by default this is a copy of it). A call that takes longer
    than ``timeout`` seconds, or whose caller is cancelled, is aborted in the engine. Calls come
    from one event loop at a time.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        vocab_size: int,
        tokenizer: Any = None,
        timeout: float = 600.0,
        default_max_tokens: int | None = None,
    ) -> None:
        from miles_core.engine import protocol

        self.engine = engine
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.default_max_tokens = protocol.DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens
        self._protocol = protocol
        self._decoder = _Decoder(tokenizer if tokenizer is not None else copy.deepcopy(engine.tokenizer))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[engine_base.GenerationRequest, asyncio.Future[Any]]] = []
        self._waiters: dict[Future[Any], asyncio.Future[Any]] = {}  # engine future -> its caller's
        self._submitted: dict[asyncio.Future[Any], Future[Any]] = {}  # and back, for aborts
        self._batch_of: dict[Future[Any], _Batch] = {}
        self._lock = threading.Lock()
        self._requests: BoundedCache[tuple[Any, Any]] = BoundedCache(256, size=lambda _: 1)  # validated, by fields

    async def generate(self, request: ChatRequest, prompt_ids: Sequence[int], *, routing_key: str) -> Generation:
        from miles_core.engine.base import GenerationRequest, InvalidRequestError

        protocol = self._protocol
        prompt = tuple(prompt_ids)
        try:
            req, sampling = self._engine_request(request.forward, len(prompt))
        except InvalidRequestError as exc:
            raise InvalidRequest(f"the engine rejected the request: {exc}") from None
        started = time.time()
        done = await self._generate(GenerationRequest(input_ids=prompt, sampling=sampling, request_id=req.rid))
        assistant = protocol.assistant_message(req, done, self._decoder)
        message, finish_reason = assistant
        check_sampled(done.token_ids, done.logprobs, self.vocab_size)
        completion = make_completion(message, done.token_ids, done.logprobs, finish_reason, done.weight_version)
        return _Exchange(completion, request.forward, OWN, prompt, req, done, assistant, self._decoder, self.engine.name,
                         started, time.time())

    async def generate_many(self, calls: Sequence[UpstreamCall]) -> list[Generation | SessionError]:
        """The calls' requests as one ``submit_batch``, awaited as one (a timeout or a cancelled
        caller aborts the whole batch); each result held to the rules :meth:`generate` applies.

        What a batch repeats is done once: a request that varies the one before it but for its
        seed (:attr:`ChatRequest.variant_of`) reuses its validation and sampling parameters, the
        token ids and log-probs of all completions are checked in one pass, and each distinct
        completion of a request is parsed into its assistant message once."""
        from miles_core.engine.base import GenerationRequest, InvalidRequestError

        results: list[Generation | SessionError | None] = [None] * len(calls)
        prepared: list[tuple[int, ChatRequest, Any, tuple[int, ...], Any]] = []
        requests: list[engine_base.GenerationRequest] = []
        # the request last validated (the one its variants name), its prompt's length (what
        # sampling reads), the validated request and its sampling parameters
        last: ChatRequest | None = None
        last_length = -1
        req: Any = None  # set with last
        last_sampling: Any = None  # set with last
        for index, (request, prompt_ids, _, sent) in enumerate(calls):
            prompt = prompt_ids if type(prompt_ids) is tuple else tuple(prompt_ids)
            seed = request.forward.get("seed") if sent is OWN else sent
            if ((request is last or request.variant_of is last) and last is not None and len(prompt) == last_length
                    and (seed is None or (type(seed) is int and 0 <= seed < 2**63))):
                sampling = last_sampling.with_seed(seed)
            else:
                try:
                    req, sampling = self._engine_request(forward_with(request.forward, sent), len(prompt))
                except InvalidRequestError as exc:
                    results[index] = InvalidRequest(f"the engine rejected the request: {exc}")
                    last = None
                    continue
                last, last_length, last_sampling = request.variant_of or request, len(prompt), sampling
            prepared.append((index, request, sent, prompt, req))
            requests.append(GenerationRequest(prompt, sampling, req.rid))
        del last, last_sampling
        started = time.time()
        outcomes = await self._generate_batch(requests) if requests else []
        finished = time.time()
        sampled = [done for done in outcomes if not isinstance(done, BaseException)]
        checked = sampled_plausibly([d.token_ids for d in sampled], [d.logprobs for d in sampled], self.vocab_size)
        protocol, decoder, model, vocab_size = self._protocol, self._decoder, self.engine.name, self.vocab_size
        # by the identity of the validated request and what its assistant message is made of
        parsed: dict[tuple[Any, ...], tuple[tuple[dict[str, Any], str], Message, Any]] = {}
        for (index, request, sent, prompt, req), done in zip(prepared, outcomes, strict=True):
            if isinstance(done, BaseException):
                results[index] = done if isinstance(done, SessionError) else _engine_failure(done)
                continue
            token_ids = done.token_ids
            key = (id(req), token_ids, done.finish_reason, done.matched_stop)
            entry = parsed.get(key)
            if entry is None:
                try:
                    if not checked:
                        check_sampled(token_ids, done.logprobs, vocab_size)
                    assistant = protocol.assistant_message(req, done, decoder)
                    message = checked_message(assistant[0], bool(token_ids), assistant[1])
                except SessionError as exc:
                    results[index] = exc
                    continue
                parsed[key] = (assistant, message, req)
            else:  # each turn its own message, as if parsed for it (_Exchange copies the other)
                if not checked:  # the same tokens: only the log-probs may fail
                    try:
                        check_sampled(token_ids, done.logprobs, vocab_size)
                    except SessionError as exc:
                        results[index] = exc
                        continue
                assistant, message = entry[0], dict(entry[1])
            version = done.weight_version
            completion = Completion(message, token_ids, done.logprobs, assistant[1],
                                    version if type(version) is str or version is None else str(version))
            results[index] = _Exchange(completion, request.forward, sent, prompt, req, done, assistant, decoder, model, started,
                                       finished)
        return results  # type: ignore[return-value]  # every index was filled above

    async def _generate_batch(self, requests: list[engine_base.GenerationRequest]) -> list[Any]:
        """Each request's completion or error, from one ``submit_batch``."""
        try:
            future = self.engine.submit_batch(requests)
        except RuntimeError as exc:  # the engine is closed or broken: every request fails
            return [exc] * len(requests)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            self.engine.abort(future)
            failure = UpstreamFailure(f"EngineTimeoutError: the engine did not finish within {self.timeout:g} s")
            return [failure] * len(requests)
        except asyncio.CancelledError:
            self.engine.abort(future)
            raise

    async def aclose(self) -> None:
        return None

    def _engine_request(self, forward: dict[str, Any], prompt_tokens: int) -> tuple[Any, engine_base.SamplingParams]:
        """The request's fields (its messages aside: the prompt is ``input_ids``) validated as the
        engine's HTTP front validates them, and how to sample it.

        Requests that differ only in ``seed`` -- an RL batch -- share one validation (and, when
        they set ``max_tokens``, one set of sampling parameters, re-seeded); a seed that is not a
        plain int in range goes the whole way. The validated request is used for everything but
        sampling, which alone reads the seed."""
        protocol = self._protocol
        fields = {k: v for k, v in forward.items() if k != "messages" and k != "seed"}
        seed = forward.get("seed")
        key = exact_json_key(fields) if seed is None or (type(seed) is int and 0 <= seed < 2**63) else None
        if key is None:
            req = protocol.validate(protocol.ChatCompletionRequest, {**fields, "seed": seed} if "seed" in forward else fields)
            return req, self._sampling(req, prompt_tokens)
        entry = self._requests.get(key)
        if entry is None:
            req = protocol.validate(protocol.ChatCompletionRequest, fields)
            fixed = req.max_tokens is not None or req.max_completion_tokens is not None
            entry = (req, self._sampling(req, prompt_tokens) if fixed else None)  # else it depends on the prompt
            self._requests.put(key, entry)
        req, template = entry
        sampling = template if template is not None else self._sampling(req, prompt_tokens)
        if seed is None:
            return req, sampling
        # re-seeded without running the checks again: they passed on ``sampling``, and the seed is
        # a plain int in [0, 2**63) -- SamplingParams' own rule for it (key is None otherwise)
        return req, sampling.with_seed(seed)

    def _sampling(self, req: Any, prompt_tokens: int) -> engine_base.SamplingParams:
        return self._protocol.sampling_params(
            req, prompt_tokens=prompt_tokens, default_max_tokens=self.default_max_tokens, room=self.engine.max_model_len
        )

    # -- batching submissions, delivering completions ---------------------------------------

    async def _generate(self, request: engine_base.GenerationRequest) -> engine_base.Completion:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (the previous one has ended): start afresh
            self._loop, self._pending = loop, []
        waiter: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._submit)
        self._pending.append((request, waiter))
        expiry = loop.call_later(self.timeout, self._expire, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            self._abort(waiter)
            raise
        finally:
            expiry.cancel()

    def _submit(self) -> None:
        """Queue every request handed over since the last call, in one ``submit_many``."""
        from miles_core.engine.base import InvalidRequestError

        pending, self._pending = self._pending, []
        pending = [(request, waiter) for request, waiter in pending if not waiter.done()]
        if not pending:
            return
        futures: list[Future[Any] | None]
        try:
            futures = list(self.engine.submit_many([request for request, _ in pending]))
        except (InvalidRequestError, RuntimeError):
            futures = []  # one refused request refuses the batch: submit one by one to find it
            for request, waiter in pending:
                try:
                    futures.append(self.engine.submit(request))
                except (InvalidRequestError, RuntimeError) as exc:
                    waiter.set_exception(_engine_failure(exc))
                    futures.append(None)
        assert self._loop is not None
        batch = _Batch(self._loop, sum(future is not None for future in futures))
        for (_, waiter), future in zip(pending, futures, strict=True):
            if future is not None:
                self._waiters[future] = waiter
                self._submitted[waiter] = future
                self._batch_of[future] = batch
        for future in futures:
            if future is not None:
                future.add_done_callback(self._finish)

    def _finish(self, future: Future[Any]) -> None:
        """Engine thread: note ``future`` done; wake the event loop when its whole batch is done,
        or -- arming a timer on the first -- :data:`DELIVERY_WINDOW_S` after a part of it is."""
        with self._lock:
            batch = self._batch_of.pop(future)
            batch.finished.append(future)
            batch.remaining -= 1
            if batch.remaining == 0:
                callback = self._deliver
            elif not batch.armed:
                batch.armed, callback = True, self._arm
            else:
                return
        try:
            batch.loop.call_soon_threadsafe(callback, batch)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _arm(self, batch: _Batch) -> None:
        batch.loop.call_later(DELIVERY_WINDOW_S, self._deliver, batch)

    def _deliver(self, batch: _Batch) -> None:
        with self._lock:
            finished, batch.finished = batch.finished, []
            batch.armed = batch.armed and batch.remaining == 0  # the next result re-arms the window
        for future in finished:
            waiter = self._waiters.pop(future, None)
            if waiter is None:
                continue
            del self._submitted[waiter]
            if waiter.done():
                continue
            if future.cancelled():
                waiter.set_exception(UpstreamFailure("the engine dropped the request"))
            elif (error := future.exception()) is not None:
                waiter.set_exception(_engine_failure(error))
            else:
                waiter.set_result(future.result())

    def _expire(self, waiter: asyncio.Future[Any]) -> None:
        if not waiter.done():
            self._abort(waiter)
            waiter.set_exception(UpstreamFailure(f"EngineTimeoutError: the engine did not finish within {self.timeout:g} s"))

    def _abort(self, waiter: asyncio.Future[Any]) -> None:
        future = self._submitted.pop(waiter, None)
        if future is not None:
            del self._waiters[future]
            self.engine.abort(future)


@dataclass(eq=False)
class _Batch:
    """Requests submitted together; results are handed to the event loop together."""

    loop: asyncio.AbstractEventLoop
    remaining: int
    finished: list[Future[Any]] = field(default_factory=list)
    armed: bool = False  # a delivery of the results so far is scheduled


class _Exchange(DeferredRecord):
    """An in-process engine call: the :class:`Generation` (its own record) and, as the JSON it
    would have been, the request the engine's HTTP front would have received and its reply,
    built when first read and kept."""

    __slots__ = ("_json", "_parts", "completion")

    def __init__(self, completion: Completion, forward: dict[str, Any], seed: Any, prompt: tuple[int, ...], req: Any,
                 done: Any, assistant: tuple[dict[str, Any], str], decoder: _Decoder, model: str, started: float,
                 finished: float) -> None:
        self.completion = completion
        self.started_at = started
        self.finished_at = finished
        self._parts = (forward, seed, prompt, req, done, assistant, decoder, model)
        self._json: tuple[dict[str, Any], dict[str, Any]] | None = None

    def render(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self._json is None:
            from miles_core.engine import protocol

            forward, seed, prompt, req, done, (message, finish_reason), decoder, model = self._parts
            forward = forward_with(forward, seed)
            # the message may be shared with other turns of a batch (EngineUpstream.generate_many)
            response = protocol.chat_response(req, done, decoder, model=model, assistant=(dict(message), finish_reason),
                                              created=int(self.started_at))
            self._json = {**forward, "input_ids": list(prompt)}, response
        return self._json

    @property
    def record(self) -> _Exchange:
        return self

    def reply(self) -> dict[str, Any]:
        return client_reply(self.render()[1])


class _Decoder:
    """The tokenizer calls the engine's reply code makes: its special tokens listed once, and a
    fast tokenizer's decoding done by a private copy of its Rust backend (what ``decode`` does
    when it does not clean up spaces, without ~10 us of Python per call)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.all_special_tokens = tuple(tokenizer.all_special_tokens)
        self._backend = None
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return
        if (
            isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is TokenizersBackend.decode
            and not tokenizer.clean_up_tokenization_spaces
        ):
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _engine_failure(exc: BaseException) -> SessionError:
    from miles_core.engine.base import InvalidRequestError

    if isinstance(exc, InvalidRequestError):
        return InvalidRequest(f"the engine rejected the request: {exc}")
    return UpstreamFailure(f"{type(exc).__name__}: {exc}")
