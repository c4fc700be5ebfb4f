"""Ray orchestration: the engine, the trainer and the rollout workers as actors in one placement group.

The driver keeps the loop, the prompt sampler and the rewards; it talks to the actors through
:class:`~miles_core.rl.runtime.Runtime`, exactly as in-process. Each actor, before building
anything, compares its own plugin fingerprint (``pm.fingerprint()``) with the driver's and
refuses to start on a mismatch; after building, the engine and trainer actors must report the
same applied patches (they load the same model). Weights move trainer -> engine as one object
reference, without passing through the driver. Actor environments come from the hardware
backend's ``worker_env(role)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_core.errors import ActivationError, MilesError
from miles_core.plugins import MilesPluginManager
from miles_core.rl import registry
from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import TrainConfig
from miles_core.rl.orchestrators.fingerprint import FingerprintMismatch, check_fingerprint
from miles_core.rl.rewards import RewardRunner
from miles_core.rl.rollout.types import Trajectory
from miles_core.rl.runtime import Parts, Runtime, engine_config, model_directory, resolve_task
from miles_core.rl.tasks import Prompt

if TYPE_CHECKING:
    from miles_core.session.client import ChatTurn, LocalSessions, SessionCallError
    from miles_core.session.trajectory import Sample


#: the batch calls of :class:`~miles_core.session.client.SessionClient` an engine actor serves
SESSION_BATCH_CALLS = frozenset({"create_many", "chat_many", "samples_many", "delete_many"})


class EngineWorker:
    """Hosts the embedded engine and, for the agentic path, the session service in front of it:
    called with Ray by the rollout workers (:class:`RaySessions`), and served over HTTP for
    rollout functions that speak HTTP (``serve_sessions``)."""

    def __init__(self, config: TrainConfig, model_dir: str, expected: dict[str, Any], num_prompts: int) -> None:
        import torch

        from miles_core.engine.engine import Engine
        from miles_core.rl.runtime import resolve_device

        check_fingerprint(expected, "engine")
        torch.set_num_threads(config.run.torch_threads)
        device = resolve_device(config.trainer.device)
        self.engine = Engine.from_pretrained(model_dir, engine_config(config, num_prompts, str(device)))
        self.config = config
        self.model_dir = model_dir
        self._stack: Any = None
        self._sessions: tuple[LocalSessions, BackgroundLoop] | None = None  # on the first session call

    def serve_sessions(self) -> str:
        """Start a session server calling this actor's engine in-process; its URL."""
        from contextlib import ExitStack

        from miles_core.plugins import get_plugin_manager
        from miles_core.session.config import SessionServerConfig
        from miles_core.session.embed import serve_in_thread
        from miles_core.session.upstream import EngineUpstream

        self._stack = ExitStack()
        url = self._stack.enter_context(serve_in_thread(
            SessionServerConfig(upstream_url="http://engine.in-process", tokenizer_dir=self.model_dir,
                                version=self.config.rollout.session_version),
            host="0.0.0.0", pm=get_plugin_manager(),
            upstream=lambda tokenizer: EngineUpstream(self.engine, vocab_size=tokenizer.vocab_size),
        ))
        import ray

        return url.replace("0.0.0.0", ray.util.get_node_ip_address())

    def sessions_call(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """One batch call (:data:`SESSION_BATCH_CALLS`) on this actor's in-process session service.
        A :class:`~miles_core.session.client.SessionCallError` it raises comes back as the value
        (pickled with its status); :class:`RaySessions` raises it again."""
        from miles_core.session.client import SessionCallError

        if method not in SESSION_BATCH_CALLS:
            raise ValueError(f"not a session batch call: {method!r} (one of {', '.join(sorted(SESSION_BATCH_CALLS))})")
        if self._sessions is None:
            from miles_core.plugins import get_plugin_manager
            from miles_core.session.client import LocalSessions

            local = LocalSessions.for_engine(self.engine, self.model_dir, version=self.config.rollout.session_version,
                                             pm=get_plugin_manager())
            self._sessions = (local, BackgroundLoop("miles-engine-sessions"))
        local, aio = self._sessions
        try:
            return aio.run(getattr(local, method)(*args, **kwargs))
        except SessionCallError as exc:
            return exc

    def fingerprint(self) -> dict[str, Any]:
        from miles_core.plugins import get_plugin_manager

        return get_plugin_manager().fingerprint()

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        return self.engine.generate(requests)

    def update_weights(self, weights: dict[str, Any], version: str) -> str:
        return self.engine.update_weights(weights, version)

    def weight_version(self) -> str:
        return self.engine.weight_version

    def close(self) -> None:
        if self._sessions is not None:
            local, aio = self._sessions
            try:
                aio.run(local.aclose())
            finally:
                aio.close()
        if self._stack is not None:
            self._stack.close()
        self.engine.close()


class TrainerWorker:
    def __init__(self, config: TrainConfig, model_dir: str, expected: dict[str, Any]) -> None:
        from pathlib import Path

        import torch

        from miles_core.plugins import get_plugin_manager
        from miles_core.rl.runtime import resolve_device

        check_fingerprint(expected, "trainer")
        pm = get_plugin_manager()
        backend, algorithm = registry.trainer_backend(pm, config), registry.algorithm(pm, config)
        torch.set_num_threads(config.run.torch_threads)
        torch.manual_seed(config.run.seed)
        self.trainer = backend.create(Path(model_dir), config, resolve_device(config.trainer.device), algorithm)

    def fingerprint(self) -> dict[str, Any]:
        from miles_core.plugins import get_plugin_manager

        return get_plugin_manager().fingerprint()

    def close(self) -> None:
        self.trainer.close()

    def report(self) -> dict[str, Any]:
        return dict(self.trainer.report)

    def train(self, docs: Sequence[Any]) -> dict[str, float]:
        return self.trainer.train(docs)

    def engine_weights(self) -> dict[str, Any]:
        from miles_core.hardware.devices import to_host

        weights = self.trainer.engine_weights()
        assert isinstance(weights, dict)
        return to_host(weights)  # the object store holds host memory; the backend says how to copy

    def save(self, directory: str) -> None:
        from pathlib import Path

        self.trainer.save(Path(directory))

    def load(self, directory: str) -> None:
        from pathlib import Path

        self.trainer.load(Path(directory))


class RolloutWorker:
    """Runs a slice of each step's rollouts with the configured rollout function, against the
    engine actor (direct) or the session server the engine actor hosts (``session_url``)."""

    def __init__(self, config: TrainConfig, model_dir: str, expected: dict[str, Any], engine: Any,
                 session_url: str | None) -> None:
        from pathlib import Path

        from miles_core.plugins import get_plugin_manager
        from miles_core.rl.rollout.base import RolloutContext, load_tokenizer

        check_fingerprint(expected, "rollout")
        pm = get_plugin_manager()
        function = registry.rollout_function(pm, config)
        tokenizer = load_tokenizer(model_dir)
        self.aio = BackgroundLoop()
        context = RolloutContext(config, resolve_task(config, pm), _RayEngine(engine), tokenizer, Path(model_dir),
                                 self.aio, pm, session_url, RaySessions(engine) if session_url else None)
        self.rollout = function.start(context)

    def run(self, prompts: Sequence[Prompt], step: int, first_index: int) -> list[Trajectory]:
        return self.rollout.run(prompts, step, first_index=first_index)

    def label(self) -> str:
        return self.rollout.label

    def close(self) -> None:
        self.rollout.close()
        self.aio.close()


class RaySessions:
    """The engine actor's session service as a :class:`~miles_core.session.client.SessionClient`,
    one Ray call per batch call: a phase's turns reach the engine as one batch, as in-process (the
    HTTP server gets one request per session and the engine batches them as they arrive). The
    actor runs one call at a time, so several workers' batches never merge either: the engine's
    batches, and with them the rollouts' numerics, do not depend on timing."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from miles_core.session.client import SessionCallError

        ref = self.actor.sessions_call.remote(method, args, kwargs)
        result = await asyncio.wrap_future(ref.future())
        if isinstance(result, SessionCallError):
            raise result
        return result

    async def create(self) -> str:
        return (await self.create_many(1))[0]

    async def chat(self, session_id: str, body: dict[str, Any]) -> ChatTurn:
        from miles_core.session.client import SessionCallError

        turn = (await self.chat_many([(session_id, body)]))[0]
        if isinstance(turn, SessionCallError):
            raise turn
        return turn

    async def samples(self, session_id: str) -> list[Sample]:
        return (await self.samples_many([session_id]))[0]

    async def delete(self, session_id: str) -> None:
        await self.delete_many([session_id])

    async def create_many(self, n: int) -> list[str]:
        created: list[str] = await self._call("create_many", n)
        return created

    async def chat_many(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                        seeds: Sequence[int | None] | None = None) -> list[ChatTurn | SessionCallError]:
        replies: list[ChatTurn | SessionCallError] = await self._call(
            "chat_many", list(turns), seeds=None if seeds is None else list(seeds))
        return replies

    async def samples_many(self, session_ids: Sequence[str]) -> list[list[Sample]]:
        samples: list[list[Sample]] = await self._call("samples_many", list(session_ids))
        return samples

    async def delete_many(self, session_ids: Sequence[str]) -> None:
        await self._call("delete_many", list(session_ids))

    async def aclose(self) -> None:
        """Nothing to close here: the engine actor owns the service."""


class _EngineHandle:
    """What DirectRollout needs from an engine, over a Ray actor handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        import ray

        return ray.get(self.actor.generate.remote(list(requests)))


class _RayEngine:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.handle = _EngineHandle(actor)

    @property
    def weight_version(self) -> str:
        import ray

        return ray.get(self.actor.weight_version.remote())

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        return self.handle.generate(requests)

    def update_weights(self, weights: Any, version: str) -> str:
        import ray

        return ray.get(self.actor.update_weights.remote(weights, version))


class _RayTrainer:
    """The trainer actor as a :class:`~miles_core.rl.trainers.base.Trainer` (closed by build_ray's closers)."""

    def __init__(self, actor: Any, report: dict[str, Any]) -> None:
        self.actor = actor
        self.report = report

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def train(self, docs: Sequence[Any]) -> dict[str, float]:
        return self._call("train", list(docs))

    def engine_weights(self) -> Any:
        return self.actor.engine_weights.remote()  # an object ref: the engine actor resolves it

    def save(self, directory: Any) -> None:
        self._call("save", str(directory))

    def load(self, directory: Any) -> None:
        self._call("load", str(directory))

    def close(self) -> None:
        """The actor is closed with the runtime (``build_ray``'s closers)."""


class _RayRollout:
    """Splits a batch across rollout workers in contiguous slices; results in batch order."""

    def __init__(self, workers: Sequence[Any], label: str) -> None:
        self.workers = list(workers)
        self.label = label

    def close(self) -> None:
        """The workers are closed with the runtime (``build_ray``'s closers)."""

    def run(self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0) -> list[Trajectory]:
        import ray

        n = len(self.workers)
        size = -(-len(prompts) // n)
        refs = [w.run.remote(list(prompts[i * size:(i + 1) * size]), step, first_index + i * size)
                for i, w in enumerate(self.workers) if prompts[i * size:(i + 1) * size]]
        return [t for part in ray.get(refs) for t in part]


def build_ray(config: TrainConfig, pm: MilesPluginManager, parts: Parts) -> Runtime:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles_core.hardware import activate
    from miles_core.rl.rollout.base import load_tokenizer
    from miles_core.rl.rollout.direct import DirectRollout

    task = parts.task
    model_dir = str(model_directory(config))
    orch = config.orchestrator
    hardware = activate()
    expected = pm.fingerprint()
    closers: list[Any] = []

    if not ray.is_initialized():
        ray.init(address=orch.address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": hardware.worker_env("rollout")})
        closers.append(ray.shutdown)
    cpu = orch.num_cpus_per_actor
    bundles = [{"CPU": cpu, **({"GPU": orch.num_gpus_engine} if orch.num_gpus_engine else {})},
               {"CPU": cpu, **({"GPU": orch.num_gpus_trainer} if orch.num_gpus_trainer else {})},
               *[{"CPU": cpu} for _ in range(orch.rollout_workers)]]
    group = placement_group(bundles, strategy="PACK")
    closers.append(lambda: remove_placement_group(group))
    try:
        ray.get(group.ready(), timeout=120)

        def actor(cls: type, index: int, role: str, gpus: float = 0.0) -> Any:
            return ray.remote(cls).options(
                num_cpus=cpu, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index),
                runtime_env={"env_vars": hardware.worker_env(role)},
            )

        trainer_actor = actor(TrainerWorker, 1, "train", orch.num_gpus_trainer).remote(config, model_dir, expected)
        engine_actor = actor(EngineWorker, 0, "rollout", orch.num_gpus_engine).remote(
            config, model_dir, expected, len(task.prompts))
        closers.append(lambda: ray.get(engine_actor.close.remote()))
        closers.append(lambda: ray.get(trainer_actor.close.remote()))
        report = ray.get(trainer_actor.report.remote())
        trainer_print, engine_print = ray.get([trainer_actor.fingerprint.remote(), engine_actor.fingerprint.remote()])
        if trainer_print["applied_patches"] != engine_print["applied_patches"]:
            raise FingerprintMismatch(
                f"trainer and engine applied different patches: {trainer_print['applied_patches']} vs "
                f"{engine_print['applied_patches']}")
        session_url = ray.get(engine_actor.serve_sessions.remote()) if parts.rollout.session_server else None
        workers = [actor(RolloutWorker, 2 + i, "rollout").remote(config, model_dir, expected, engine_actor, session_url)
                   for i in range(orch.rollout_workers)]
        closers.append(lambda: ray.get([w.close.remote() for w in workers]))
        aio = BackgroundLoop()
        closers.append(aio.close)
        rewards = RewardRunner(task.reward, config.reward, pm, aio)
        closers.append(rewards.close)
        tokenizer = load_tokenizer(model_dir)
        rewards.ready()
        engine = _RayEngine(engine_actor)
        evaluator = DirectRollout(engine, tokenizer, config.rollout, config.run.seed)
        labels = ray.get([w.label.remote() for w in workers])
        report = {**report, "orchestrator": "ray", "fingerprint": expected["digest"],
                  "actors": {"engine": 1, "trainer": 1, "rollout": orch.rollout_workers}}
        return Runtime(config, parts, engine, _RayTrainer(trainer_actor, report),
                       _RayRollout(workers, f"{labels[0]}_ray"), evaluator, rewards, aio, closers)
    except BaseException as exc:
        for close in reversed(closers):
            try:
                close()
            except Exception as cleanup:  # keep the original error; say what cleanup hit too
                exc.add_note(f"while cleaning up: {type(cleanup).__name__}: {cleanup}")
        cause = _unwrap(exc)
        if cause is not exc:
            raise cause from exc
        raise


def _unwrap(exc: BaseException) -> BaseException:
    """The miles error inside a Ray actor failure, so the CLI reports it plainly."""
    cause = getattr(exc, "cause", None)
    while cause is not None and not isinstance(cause, (MilesError, ActivationError)):
        cause = getattr(cause, "cause", None) or cause.__cause__
    return cause if isinstance(cause, MilesError) else exc
