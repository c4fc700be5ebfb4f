"""The miles plugin contract: every hook a plugin may implement.

A plugin is a plain module with ``@hookimpl`` functions, named by an entry point in the group
``miles.plugins``::

    [project.entry-points."miles.plugins"]
    my-plugin = "my_plugin.plugin"

The core's own implementations (the cpu and cuda backends, the local sandbox, session v1 and v2,
the built-in tasks) are registered exactly the same way, from ``miles``' own entry points.

Rules every implementation follows:

* **Discovery is cheap.** Importing the plugin module and calling any ``miles_*`` hook must not
  import torch, transformers, ray, megatron or e2b. Hooks return small descriptor objects; heavy
  imports happen inside their methods, when the concern is activated.
* **Hooks return sequences.** Every contribution hook returns a list (possibly empty) of objects.
  None of them is ``firstresult``. The core calls the hook once per implementing plugin, each
  time through pluggy's own hook caller restricted to that plugin's implementation plus every
  wrapper of the hook, so a contribution is always attributed to the plugin that made it, one
  plugin's failure never hides another's contributions, and pluggy's options mean what pluggy
  says: ``@hookimpl(tryfirst=True)`` / ``trylast=True`` order the calls, and a wrapper
  (``@hookimpl(wrapper=True)``) wraps each plugin's call and may filter or decorate that
  plugin's list (contribute your own objects from a plain implementation instead).
* **Names are unique per concern; priority decides on purpose.** Two plugins contributing the
  same name at the same priority is a conflict: the one registered later is broken for that
  concern. A ``tryfirst`` implementation's object *replaces* a plain (or ``trylast``) one of the
  same name -- a plugin's own ``grpo`` over the built-in, say -- and the replaced one is listed
  as shadowed by ``miles plugins list``.
* **Unknown hooks are errors.** A ``miles_*`` function that matches no hook below (a typo) fails
  pluggy's validation (``PluginManager.check_pending``) and breaks the plugin, unless it is marked
  ``@hookimpl(optionalhook=True)`` (a hook of a newer miles, say).
* **Every contribution has a unique** ``name`` (a ``str``) within its concern, and a ``verify``
  method that checks the *effect* of what it did (a patched class on the built model, an
  environment fix in place), never its intent. Verification failure stops the job (fail closed).
  An object whose ``verify()`` is cheap (pure Python, no heavy import, no network, milliseconds)
  says so with ``cheap_verify = True``: ``miles plugins list`` runs it, so a failure shows there;
  the others are listed as not verified (``miles doctor`` verifies everything).
* **A plugin is its (distribution, entry-point name).** Two distributions that declare the same
  entry-point name conflict: neither is loaded (a built-in's name stays the built-in's) until
  ``MILES_DISABLE_PLUGINS=DIST`` or ``DIST:NAME`` removes one.
* **A hook that raises** marks the plugin ``broken`` with the error text. Commands that do not
  need the plugin keep working; a command that activates a concern it may contribute to fails
  naming it (unless ``MILES_DISABLE_PLUGINS`` names it).

The object protocols live next to each concern: :mod:`miles_core.hardware.base`,
:mod:`miles_core.patches.base`, :mod:`miles_core.session.base`, :mod:`miles_core.sandbox.base`,
:mod:`miles_core.ci.base`, :mod:`miles_core.engine.base`, :mod:`miles_core.rl.tasks`, and for the
RL step :mod:`miles_core.rl.algorithms.base`, :mod:`miles_core.rl.rollout.base`,
:mod:`miles_core.rl.trainers.base`, :mod:`miles_core.rl.orchestrators.base` and
:mod:`miles_core.rl.trackers.base`. Conformance kits for authors are in :mod:`miles_core.testing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import click

    from miles_core.ci.base import CIHardware
    from miles_core.engine.kind import EngineKind
    from miles_core.hardware.base import HardwareBackend
    from miles_core.patches.base import ModelPatch
    from miles_core.rl.algorithms.base import Algorithm
    from miles_core.rl.orchestrators.base import Orchestrator
    from miles_core.rl.rollout.base import RolloutFunction
    from miles_core.rl.tasks import Task
    from miles_core.rl.trackers.base import Tracker
    from miles_core.rl.trainers.base import TrainerBackend
    from miles_core.sandbox.spec import SandboxProviderSpec
    from miles_core.session.base import SessionVersion

PROJECT_NAME = "miles"
ENTRY_POINT_GROUP = "miles.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def miles_hardware_backends() -> Sequence[HardwareBackend]:
    """Hardware backends this plugin provides (:class:`miles_core.hardware.base.HardwareBackend`).

    Called: by ``miles plugins list`` (names only) and when the hardware concern is activated
    (``miles doctor``, ``miles train``, any command that needs a device).

    Returns: a list of backend objects. Exactly one backend is active per process: among those
    whose ``detect()`` claims the machine, a plugin's backend beats a built-in one; two plugins
    claiming the machine is an error naming both; ``MILES_HARDWARE=<name>`` overrides detection.
    :func:`miles_core.hardware.activate` then calls the selected backend's ``apply()`` and
    ``verify()``, which must pass before any work starts.
    """


@hookspec
def miles_model_patches() -> Sequence[ModelPatch]:
    """Model patches this plugin provides (:class:`miles_core.patches.base.ModelPatch`).

    Called: by ``miles plugins list`` and by :func:`miles_core.patches.prepare_model` each time a
    model is prepared for training or inference.

    Returns: a list of patch objects. For each one whose ``matches(config)`` is true for the built
    model, the core calls ``apply(model)`` and then ``verify(model)``, which must fail if any
    matched class of the *instantiated* model lacks the patch, and runs its numeric ``probe``.
    Before that it runs ``check_environment()`` once per process, the first time the patch matches a
    model or finds its targets in one (a problem breaks the plugin),
    checks the declared kernel ``requires``, and refuses a patch that declines a model containing
    its ``targets(model)``. The full protocol is :class:`miles_core.patches.base.ModelPatch`.
    """


@hookspec
def miles_session_versions() -> Sequence[SessionVersion]:
    """Rollout session versions (:class:`miles_core.session.base.SessionVersion`).

    Called: by ``miles plugins list`` and when a session server starts (``miles session serve``,
    the agentic rollout path of ``miles train``).

    Returns: a list of session-version descriptors (name plus a trajectory-store factory). The
    selected version's ``verify()`` runs the session conformance invariants on a fresh store.
    """


@hookspec
def miles_sandbox_providers() -> Sequence[SandboxProviderSpec]:
    """Sandbox providers (:class:`miles_core.sandbox.spec.SandboxProviderSpec`).

    Called: by ``miles plugins list``, ``miles sandbox providers`` and when a sandbox is needed.

    Returns: a list of provider descriptors. ``create(config)`` imports the SDK and returns a
    :class:`miles_core.sandbox.base.SandboxProvider`; ``verify()`` checks the provider's effect
    (the SDK calls it makes exist with the parameters it passes; the local provider's limits and
    isolation as seen from inside a probe sandbox). Providers are used through the shared
    lifecycle layer, :mod:`miles_core.sandbox.lifecycle`.
    """


@hookspec
def miles_ci_hardware() -> Sequence[CIHardware]:
    """CI hardware kinds (:class:`miles_core.ci.base.CIHardware`).

    Called: by ``miles ci ...`` when test registrations are discovered and workflows generated.

    Returns: a list of hardware kinds: the registration marker (for example
    ``miles_rocm.ci:register_rocm_ci``), runner setup, default suites and the failure classes
    that may be retried. ``verify()`` checks the marker is a runtime no-op whose signature
    ``miles ci`` can parse and that the kind's default suites fit it; suites and registrations
    are checked against the kind when ``miles ci`` loads a tree.
    """


@hookspec
def miles_tasks() -> Sequence[Task]:
    """RL tasks and reward functions (:class:`miles_core.rl.tasks.Task`).

    Called: by ``miles plugins list`` and by ``miles train`` when it resolves the configured task.

    Returns: a list of task objects. ``miles train`` trains a task that has ``prompts()`` and a
    ``reward``; ``description``, ``has_accuracy`` and ``tools`` are optional (defaults: the
    task's name, ``True`` and no tools). A task that lacks what training needs is listed, and
    ``miles train`` refuses it before building anything, naming what is missing.
    ``verify()`` checks the task is trainable (prompts exist, the reward scores a known answer).
    """


@hookspec
def miles_inference_engines() -> Sequence[EngineKind]:
    """Inference engines (:class:`miles_core.engine.kind.EngineKind`).

    Called: by ``miles plugins list``, ``miles doctor`` and when an engine is launched
    (``miles engine serve``, the rollout side of ``miles train``).

    Returns: a list of engine kinds (built-ins: ``embedded`` and ``sglang``). Each names a
    launcher (``"module:callable"``, imported only when launched) that returns a running server
    speaking the engine HTTP contract, and a check. ``verify()`` proves the engine works on this
    machine: the embedded engine generates with its tiny preset and compares the log-probs to a
    teacher-forced forward.
    """


@hookspec
def miles_algorithms() -> Sequence[Algorithm]:
    """RL algorithms: an advantage estimator plus a policy loss
    (:class:`miles_core.rl.algorithms.base.Algorithm`).

    Called: by ``miles plugins list``, ``miles doctor``, and when ``miles train`` builds its
    config (``algorithm.name`` must name one) and its trainer.

    Returns: a list of algorithm objects (built-ins: ``grpo``, ``dr-grpo``, ``gspo``; each is
    defined in docs/train.md). Each declares the rollout fields it needs, the smallest group it
    works with, how per-token losses are aggregated, and the ``algorithm.*`` settings it reads.
    ``verify()`` computes the loss on the fixed tiny batch of
    :mod:`miles_core.rl.algorithms.probe` and checks it has the documented value and that its
    gradient raises the log-prob of the rewarded sample and lowers an unrewarded one's.
    """


@hookspec
def miles_rollout_functions() -> Sequence[RolloutFunction]:
    """How trajectories are produced (:class:`miles_core.rl.rollout.base.RolloutFunction`).

    Called: by ``miles plugins list``, ``miles doctor``, and by ``miles train``
    (``rollout.path`` must name one).

    Returns: a list of rollout functions (built-ins: ``direct``, batched token-in generation
    through the engine; ``agentic``, OpenAI-chat episodes through the session server). Each
    declares the rollout fields it provides and the ``rollout.*`` settings it reads;
    ``start(context)`` builds the rollout for a run (heavy imports there). ``verify()`` runs a
    tiny rollout against a scripted engine and checks its trajectories are token-exact
    (:mod:`miles_core.rl.rollout.probe`; a function that needs the session server, hence a real
    engine, checks its declarations and dependencies, and the conformance kit
    :mod:`miles_core.testing.rollout` takes a real engine for it).
    """


@hookspec
def miles_trainer_backends() -> Sequence[TrainerBackend]:
    """Trainer backends (:class:`miles_core.rl.trainers.base.TrainerBackend`).

    Called: by ``miles plugins list``, ``miles doctor``, and by ``miles train``
    (``trainer.backend`` must name one).

    Returns: a list of backends (built-ins: ``hf``, transformers + torch; ``megatron``,
    megatron-core). ``create(...)`` imports the framework and builds the trainer. ``verify()``
    runs one update on a tiny model and checks the weights moved as documented: the rewarded
    response's log-prob rose and the unrewarded one's fell, in the weights the engine would get.
    """


@hookspec
def miles_orchestrators() -> Sequence[Orchestrator]:
    """Where a run's engine, trainer and rollout workers live
    (:class:`miles_core.rl.orchestrators.base.Orchestrator`).

    Called: by ``miles plugins list``, ``miles doctor``, and by ``miles train``
    (``orchestrator.kind`` must name one).

    Returns: a list of orchestrators (built-ins: ``inprocess``, ``ray``). ``build(config, pm)``
    assembles the run's :class:`~miles_core.rl.runtime.Runtime`; every worker it starts checks the
    driver's plugin fingerprint before building anything. ``verify()`` checks the orchestrator can
    run here (its framework imports, at a supported version).
    """


@hookspec
def miles_trackers() -> Sequence[Tracker]:
    """Experiment-tracking sinks for per-step metrics (:class:`miles_core.rl.trackers.base.Tracker`).

    Called: by ``miles plugins list``, ``miles doctor``, and by ``miles train``
    (``run.trackers`` names the ones a run writes to).

    Returns: a list of trackers (built-ins: ``jsonl`` -- the run's own ``metrics.jsonl`` --,
    ``tensorboard``, ``wandb``, ``mlflow``). A tracker's SDK is imported only when it is selected
    (in ``open``); credentials are configured by reference (``env:NAME``, ``file:/path``) and never
    logged. ``verify()`` writes records through the tracker into a scratch directory and reads
    them back from the tracker's own store.
    """


@hookspec
def miles_commands(cli: click.Group) -> None:
    """Add subcommands to the ``miles`` command line.

    Called: once per process, when the CLI needs a command it does not define itself (or lists
    all commands for ``--help``). Implementations call ``cli.add_command(...)``; they must not do
    heavy work at that time. A name that collides with an existing command is an error that marks
    the plugin broken.
    """
