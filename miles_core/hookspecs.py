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
  None of them is ``firstresult``: the core calls each plugin's implementation separately, so a
  contribution is always attributed to the plugin that made it and one plugin's failure never
  hides another's contributions.
* **Every contribution has a unique** ``name`` (a ``str``) within its concern, and a ``verify``
  method that checks the *effect* of what it did (a patched class on the built model, an
  environment fix in place), never its intent. Verification failure stops the job (fail closed).
* **A hook that raises** marks the plugin ``broken`` with the error text. Commands that do not
  need the plugin keep working; a command that activates a concern it may contribute to fails
  naming it (unless ``MILES_DISABLE_PLUGINS`` names it).

The object protocols live next to each concern: :mod:`miles_core.hardware.base`,
:mod:`miles_core.patches.base`, :mod:`miles_core.session.base`, :mod:`miles_core.sandbox.base`,
:mod:`miles_core.ci.base`, :mod:`miles_core.engine.base` and :mod:`miles_core.rl.tasks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

PROJECT_NAME = "miles"
ENTRY_POINT_GROUP = "miles.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def miles_hardware_backends() -> Sequence[Any]:
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
def miles_model_patches() -> Sequence[Any]:
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
def miles_session_versions() -> Sequence[Any]:
    """Rollout session versions (:class:`miles_core.session.base.SessionVersion`).

    Called: by ``miles plugins list`` and when a session server starts (``miles session serve``,
    the agentic rollout path of ``miles train``).

    Returns: a list of session-version descriptors (name plus a trajectory-store factory). The
    selected version's ``verify()`` runs the session conformance invariants on a fresh store.
    """


@hookspec
def miles_sandbox_providers() -> Sequence[Any]:
    """Sandbox providers (:class:`miles_core.sandbox.spec.SandboxProviderSpec`).

    Called: by ``miles plugins list``, ``miles sandbox providers`` and when a sandbox is needed.

    Returns: a list of provider descriptors. ``create(config)`` imports the SDK and returns a
    :class:`miles_core.sandbox.base.SandboxProvider`; ``verify()`` checks the provider's effect
    (the SDK calls it makes exist with the parameters it passes; the local provider's limits and
    isolation as seen from inside a probe sandbox). Providers are used through the shared
    lifecycle layer, :mod:`miles_core.sandbox.lifecycle`.
    """


@hookspec
def miles_ci_hardware() -> Sequence[Any]:
    """CI hardware kinds (:class:`miles_core.ci.base.CIHardware`).

    Called: by ``miles ci ...`` when test registrations are discovered and workflows generated.

    Returns: a list of hardware kinds: the registration marker (for example
    ``miles_rocm.ci:register_rocm_ci``), runner setup, default suites and the failure classes
    that may be retried. ``verify()`` checks the marker is a runtime no-op whose signature
    ``miles ci`` can parse and that the kind's default suites fit it; suites and registrations
    are checked against the kind when ``miles ci`` loads a tree.
    """


@hookspec
def miles_tasks() -> Sequence[Any]:
    """RL tasks and reward functions (:class:`miles_core.rl.tasks.Task`).

    Called: by ``miles plugins list`` and by ``miles train`` when it resolves the configured task.

    Returns: a list of task objects (prompt source, reward function, optional greedy metric).
    """


@hookspec
def miles_inference_engines() -> Sequence[Any]:
    """Inference engines (:class:`miles_core.engine.base.EngineKind`).

    Called: by ``miles plugins list``, ``miles doctor`` and when an engine is launched
    (``miles engine serve``, the rollout side of ``miles train``).

    Returns: a list of engine kinds (built-ins: ``embedded`` and ``sglang``). Each names a
    launcher (``"module:callable"``, imported only when launched) that returns a running server
    speaking the engine HTTP contract, and a check. ``verify()`` proves the engine works on this
    machine: the embedded engine generates with its tiny preset and compares the log-probs to a
    teacher-forced forward.
    """


@hookspec
def miles_commands(cli: click.Group) -> None:
    """Add subcommands to the ``miles`` command line.

    Called: once per process, when the CLI needs a command it does not define itself (or lists
    all commands for ``--help``). Implementations call ``cli.add_command(...)``; they must not do
    heavy work at that time. A name that collides with an existing command is an error that marks
    the plugin broken.
    """
