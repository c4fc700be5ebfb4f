"""The one configuration of ``miles train``: validated, documented, layered.

Layers, later wins: a named preset (:data:`PRESETS`), a TOML file, then overrides
(``section.key=value``; the CLI's flags are overrides too). Every setting is a field below with its
meaning; an unknown key, a wrong type or an inconsistent combination raises
:class:`~miles_core.errors.ConfigError` naming the setting (``rollout.samples_per_prompt``) and the
rule, before any model, engine or worker starts.

``rollout.path``, ``algorithm.name``, ``trainer.backend``, ``orchestrator.kind`` and
``run.trackers`` name plugin contributions; :func:`load_config` checks them against what is
installed (:mod:`miles_core.rl.registry`: an unknown name gets the installed ones and a "did you
mean"), together with the rules that depend on the selected objects (a setting the selected one
does not read, an algorithm's smallest group, the rollout fields it needs).

Importing this module costs pydantic only (no torch).
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles_core.errors import ConfigError
from miles_core.sandbox.config import ProviderOptions, check_provider_options

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSection(_Section):
    """Which model is trained (and served to the engine). Exactly one of ``preset``/``path``;
    neither means the ``tiny`` preset, so ``--set model.dtype=...`` alone keeps the default model."""

    preset: str | None = Field(None, description="engine model preset built by code (tiny, small-gpu)")
    path: str | None = Field(None, description="local Hugging Face model directory (config, safetensors, tokenizer)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training and serving dtype")

    @model_validator(mode="before")
    @classmethod
    def _default_preset(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("preset") is None and data.get("path") is None:
            return {**data, "preset": "tiny"}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of model.preset and model.path")
        return self


class TaskSection(_Section):
    """The RL task (from the ``miles_tasks`` hook) and, optionally, a replacement reward."""

    name: str = Field("arith-add", description="task name, as listed by `miles plugins list`")
    reward: str | None = Field(
        None, description="'module:function' reward replacing the task's own (see docs/train.md)"
    )


class RolloutSection(_Section):
    """How completions are produced."""

    path: str = Field(
        "direct",
        description="rollout function (miles_rollout_functions): direct, batched token-in generation through "
        "the engine; agentic, episodes speak OpenAI chat through the session server",
    )
    prompts_per_step: int = Field(16, ge=1, description="prompts drawn per step")
    samples_per_prompt: int = Field(8, ge=1, description="completions per prompt (the GRPO group size)")
    max_new_tokens: int = Field(4, ge=1, description="token budget of one generated turn")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the trainer uses the same)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(-1, description="top-k filter; <= 0 disables it")
    session_version: str = Field("v1", description="session-server version for the agentic path")
    max_turns: int = Field(1, ge=1, description="assistant turns per agentic episode")
    concurrency: int | None = Field(
        None, ge=1,
        description="episodes in flight at once (agentic path), in groups of this many; unset: a step's episodes all "
        "at once (over HTTP, at most 64 connections)",
    )
    gdn_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="how the embedded engine stores Gated DeltaNet recurrent states: bfloat16 halves their memory "
        "and most of a GPU decode step's traffic, at one rounding per token (docs/engine.md)",
    )


class RewardSection(_Section):
    """Where rewards that execute model output run, and the agentic rollout's tool sandboxes."""

    sandbox_provider: str = Field("local", description="sandbox provider for sandboxed rewards")
    sandbox_options: ProviderOptions = Field(
        default_factory=dict,
        description="options of sandbox_provider (see `miles sandbox providers`); secrets by reference: env:NAME, file:/path",
    )
    tool_sandbox_provider: str | None = Field(
        None, description="sandbox provider of the agentic rollout's tools (default: sandbox_provider)"
    )
    tool_sandbox_options: ProviderOptions | None = Field(
        None, description="options of the tool sandboxes (default: sandbox_options when the provider is the same)"
    )
    timeout_s: float = Field(60.0, gt=0, description="time limit of one batched sandbox check")

    @model_validator(mode="after")
    def _sandbox_options_valid(self) -> RewardSection:
        """Options are checked against the installed provider now, not when the run starts."""
        if self.sandbox_options or self.sandbox_provider != "local":
            check_provider_options(self.sandbox_provider, self.sandbox_options, where="reward.sandbox_options")
        if self.tool_sandbox_provider is not None or self.tool_sandbox_options is not None:
            provider = self.tool_sandbox_provider or self.sandbox_provider
            check_provider_options(provider, self.tool_sandbox_options or {}, where="reward.tool_sandbox_options")
        return self


class AlgorithmSection(_Section):
    """The RL algorithm (advantage estimator + policy loss) and the update schedule."""

    name: str = Field("grpo", description="algorithm (miles_algorithms): grpo, dr-grpo, gspo, or a plugin's")
    scale_by_std: bool = Field(True, description="divide group-centred rewards by the group std (grpo, gspo)")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="ratio clipped above at 1 + clip_high")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL penalty to the initial policy")
    kl_bias_correction: bool = Field(
        True,
        description="weight each token's k3 KL by its importance ratio pi / pi_rollout (differentiable, 1 on-policy): "
        "the KL term's gradient becomes the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl)",
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    epochs: int = Field(1, ge=1, description="passes over each step's rollouts")
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")


class TrainerSection(_Section):
    """The trainer backend."""

    backend: str = Field(
        "hf", description="trainer backend (miles_trainer_backends): hf, transformers + torch; megatron, megatron-core"
    )
    device: str = Field("auto", description="auto (the selected hardware backend's device), cpu or cuda[:N]")
    max_tokens_per_row: int = Field(4096, ge=8, description="token budget of one packed training row")
    packing: bool = Field(True, description="pack documents into rows with position_ids restarting at 0")
    share_prompts: bool = Field(
        True,
        description="with packing, train a group's samples after one copy of their common prompt "
        "(hf backend; with recurrent layers only where they report supports_branches(), "
        "else whole documents are packed)",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    world_size: int = Field(
        1,
        ge=1,
        description="hf: data-parallel ranks; > 1 shards the model with FSDP2 over that many processes "
        "(one GPU each on CUDA, gloo on CPU)",
    )
    compile: bool = Field(
        False,
        description="torch.compile the norms and MLPs (hf only; fuses their elementwise work, first steps compile)",
    )
    mtp_num_layers: int = Field(0, ge=0, le=3, description="multi-token-prediction depths (megatron only)")
    mtp_loss_coef: float = Field(0.1, ge=0, description="weight of the MTP loss (megatron only)")


class OrchestratorSection(_Section):
    """Where the engine, trainer and rollout workers run."""

    kind: str = Field("inprocess", description="orchestrator (miles_orchestrators): inprocess (one process) or ray")
    address: str | None = Field(None, description="Ray cluster address; implies kind = ray")
    rollout_workers: int = Field(1, ge=1, description="rollout worker actors (ray)")
    num_cpus_per_actor: float = Field(0.5, gt=0, description="CPUs reserved per actor in the placement group")
    num_gpus_engine: float = Field(0.0, ge=0, description="GPUs reserved for the engine actor")
    num_gpus_trainer: float = Field(0.0, ge=0, description="GPUs reserved for the trainer actor")


class RunSection(_Section):
    """Length, seeds, outputs, evaluation and checkpoints."""

    steps: int = Field(100, ge=1, description="training steps")
    seed: int = Field(0, ge=0, description="seed of prompts order, sampling and initialisation")
    out_dir: str | None = Field(
        None,
        description="the run directory (metrics.jsonl, summary.json, plot.png, checkpoints/); unset: a new "
        "directory under run.runs_dir for each run, linked as <runs_dir>/latest",
    )
    runs_dir: str = Field(
        "runs/miles",
        description="where runs without run.out_dir get a directory each (YYYYmmdd-HHMMSS); --resume "
        "continues <runs_dir>/latest",
    )
    eval_every: int = Field(5, ge=0, description="greedy evaluation on every prompt each N steps (0: never)")
    stop_at_accuracy: float | None = Field(
        None, ge=0, le=1, description="stop once greedy accuracy reaches this (needs eval_every > 0)"
    )
    time_limit_s: float | None = Field(
        None, gt=0, description="stop after the step during which this much time (from the first step) passed"
    )
    checkpoint_every: int = Field(0, ge=0, description="checkpoint each N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="most recent checkpoints kept")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads on CPU")
    progress: bool = Field(True, description="live progress bar on stderr")
    plot: bool = Field(True, description="write plot.png when the run ends")
    trackers: tuple[str, ...] = Field(
        ("jsonl",),
        description="experiment trackers (miles_trackers) each step's metrics go to: jsonl (metrics.jsonl, "
        "always), tensorboard, wandb, mlflow",
    )
    tracker_options: dict[str, dict[str, str | int | float | bool]] = Field(
        default_factory=dict,
        description="per-tracker options, [run.tracker_options.<tracker>]; credentials only as references "
        "(env:NAME or file:/path)",
    )


class TrainConfig(_Section):
    """Everything ``miles train`` needs; see each section."""

    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    trainer: TrainerSection = TrainerSection()
    orchestrator: OrchestratorSection = OrchestratorSection()
    run: RunSection = RunSection()

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        """Rules between settings; the rules that depend on the selected plugin objects are in
        :func:`miles_core.rl.registry.check_config`."""
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if self.algorithm.minibatches > batch:
            raise ValueError(
                f"algorithm.minibatches ({self.algorithm.minibatches}) exceeds the samples per step ({batch})"
            )
        if self.run.stop_at_accuracy is not None and self.run.eval_every == 0:
            raise ValueError("run.stop_at_accuracy needs run.eval_every > 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def run_dir(self) -> Path:
        """The run directory; set once the loop has chosen it (:mod:`miles_core.rl.preflight`)."""
        if self.run.out_dir is None:
            raise RuntimeError("run.out_dir is not chosen yet: the loop sets it (miles_core.rl.preflight)")
        return Path(self.run.out_dir)


#: named starting points; a TOML file and overrides apply on top
PRESETS: dict[str, dict[str, Any]] = {
    # 2-core CPU, under a minute: a reply-format-warmed tiny Qwen3.5 learns "n+1=" through the session server.
    "tiny": {
        "model": {"preset": "tiny-rl", "dtype": "float32"},
        "task": {"name": "arith-next"},
        "rollout": {
            "path": "agentic",
            "prompts_per_step": 9,
            "samples_per_prompt": 16,
            "max_new_tokens": 1,
            "session_version": "v1",
        },
        "algorithm": {"lr": 3e-3, "kl_coef": 0.3},
        "trainer": {"backend": "hf", "device": "auto", "max_tokens_per_row": 1024},
        "run": {"steps": 60, "eval_every": 2, "stop_at_accuracy": 0.9, "time_limit_s": 150, "runs_dir": "runs/tiny"},
    },
    # One GPU: the ~0.5B Qwen3.5-architecture preset in bf16, in-process.
    "small-gpu": {
        "model": {"preset": "small-gpu", "dtype": "bfloat16"},
        "task": {"name": "arith-add"},
        "rollout": {"path": "direct", "prompts_per_step": 55, "samples_per_prompt": 16, "max_new_tokens": 64},
        "algorithm": {"lr": 1e-5},
        "trainer": {"backend": "hf", "device": "cuda", "max_tokens_per_row": 8192},
        "run": {"steps": 5, "eval_every": 5, "runs_dir": "runs/small-gpu", "checkpoint_every": 0},
    },
}


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"rollout.temperature=0.7"`` -> ``{"rollout": {"temperature": 0.7}}``.

    The value is parsed as a TOML value (numbers, booleans, quoted strings, arrays); anything that
    is not valid TOML is taken as a bare string.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected SECTION.KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    parts = key.split(".")
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


#: what a config file in another format is called, by extension
_OTHER_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".ini": "INI", ".cfg": "INI"}

_TOML_HINT = "config files are TOML: one [section] table per section, key = value lines (see docs/train.md)"


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    other = _OTHER_FORMATS.get(path.suffix.lower())
    if other is not None:
        raise ConfigError(f"config file {path}: {_TOML_HINT}; this file is named as {other}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        looks = _looks_like(text)
        hint = f"; {_TOML_HINT}; this file looks like {looks}" if looks else ""
        raise ConfigError(f"config file {path}: {exc}{hint}") from None


def _looks_like(text: str) -> str | None:
    """``"YAML"`` or ``"JSON"`` when ``text`` (not valid TOML) parses as a mapping in that format."""
    import json

    try:
        if isinstance(json.loads(text), dict):
            return "JSON"
    except ValueError:
        pass
    import yaml

    try:
        if isinstance(yaml.safe_load(text), dict):
            return "YAML"
    except yaml.YAMLError:
        pass
    return None


#: settings that exclude each other: a layer that sets one drops the other from the layers below
_EXCLUSIVE = (("model", "preset", "path"),)


def _apply_layer(data: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    for section, *keys in _EXCLUSIVE:
        given = layer.get(section, {})
        for key in keys:
            if isinstance(given, Mapping) and key in given:
                for other in keys:
                    if other != key and other not in given:
                        data.get(section, {}).pop(other, None)
    return _merge(data, layer)


def load_config(
    preset: str | None = None,
    file: str | Path | None = None,
    overrides: Iterable[str | Mapping[str, Any]] = (),
    *,
    pm: MilesPluginManager | None = None,
) -> TrainConfig:
    """Build and validate the configuration from its layers (see module doc).

    ``pm`` (default: the process-wide plugin manager) holds the algorithms, rollout functions,
    trainer backends, orchestrators and trackers the names are checked against. The selected
    algorithm's own defaults apply to the settings no layer sets.
    """
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl import registry

    pm = pm if pm is not None else get_plugin_manager()
    data: dict[str, Any] = {}
    source = "defaults"
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        data = _apply_layer(data, PRESETS[preset])
        source = f"preset {preset!r}"
    if file is not None:
        data = _apply_layer(data, read_toml(file))
        source = f"config file {file}"
    for override in overrides:
        data = _apply_layer(data, parse_override(override) if isinstance(override, str) else override)
        source = "overrides"
    data = _merge({"algorithm": registry.algorithm_defaults(pm, data)}, data)
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    problems = _check_names(config, pm)
    try:
        registry.check_config(config, pm, source)
    except ConfigError as exc:
        problems.append(str(exc).removeprefix(f"invalid training config ({source}): "))
    if problems:
        raise ConfigError(f"invalid training config ({source}): " + "; ".join(problems))
    return config


def _check_names(config: TrainConfig, pm: MilesPluginManager) -> list[str]:
    """The task, the engine model preset and the device type name something installed."""
    from miles_core.engine.presets import PRESETS as MODEL_PRESETS
    from miles_core.rl import registry

    problems = []
    try:
        registry.lookup(pm, "tasks", config.task.name, "task.name", "task")
    except ConfigError as exc:
        problems.append(str(exc))
    preset = config.model.preset
    if preset is not None and preset not in MODEL_PRESETS:
        problems.append(f"model.preset: unknown engine preset {preset!r}" + registry.did_you_mean(preset, list(MODEL_PRESETS)))
    problem = _device_problem(config.trainer.device, pm)
    if problem:
        problems.append(problem)
    return problems


def _device_problem(setting: str, pm: MilesPluginManager) -> str | None:
    """Why ``trainer.device`` names no device of the installed hardware backends (None if it does).

    Only the form is checked here (no torch): whether this machine has the device is checked
    when the run starts (:mod:`miles_core.rl.preflight`).
    """
    import re

    from miles_core.rl import registry

    types = sorted({"cpu", *(str(c.obj.device_type) for c in pm.contributions("hardware"))})
    match = re.fullmatch(r"([a-z_]+)(:\d+)?", setting)
    if setting == "auto" or (match is not None and match.group(1) in types):
        return None
    kind = match.group(1) if match else setting
    return (
        f"trainer.device: {setting!r} is neither auto nor TYPE[:INDEX] with a device type of the installed "
        f"hardware backends" + registry.did_you_mean(kind, types)
    )


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: ``rollout.samples_per_prompt: <rule> (got 1)``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in err["loc"][:-1])
            what = "section" if not section and isinstance(err["input"], Mapping) else "setting"
            message = f"unknown {what}{' in ' + section if section else ''}" + _setting_hint(err["loc"], err["input"])
        got = f" (got {err['input']!r})" if err["type"] not in ("extra_forbidden", "value_error") else ""
        lines.append(f"{where}: {message}{got}")
    return f"invalid training config ({source}): " + "; ".join(lines)


def _setting_hint(loc: tuple[int | str, ...], value: Any) -> str:
    """``; did you mean algorithm.lr?`` for an unknown setting: the settings of any section with
    that key, else the closest keys by spelling; for an unknown section, the settings its keys name
    or the closest section."""
    import difflib

    if len(loc) > 2:
        return ""  # inside a free-form table (run.tracker_options.<name>): checked where it is read
    by_key: dict[str, list[str]] = {}
    for dotted, _, _ in describe_settings():
        by_key.setdefault(dotted.split(".")[1], []).append(dotted)
    keys = [str(loc[-1])]
    if len(loc) == 1 and isinstance(value, Mapping):  # `traner.lr`: a section that does not exist
        keys = [str(k) for k in value]
        sections = list(TrainConfig.model_fields)
        named = sorted({d for k in keys for d in by_key.get(k, [])})
        if not named:
            named = difflib.get_close_matches(str(loc[0]), sections, n=1, cutoff=0.6)
        return f"; did you mean {' or '.join(named)}?" if named else ""
    named = sorted({d for k in keys for d in by_key.get(k, [])})
    if not named:
        close = difflib.get_close_matches(keys[0], list(by_key), n=2, cutoff=0.75)
        section = str(loc[0]) if len(loc) == 2 else None
        named = sorted({d for k in close for d in by_key[k] if section is None or d.startswith(section + ".")}) or sorted(
            {d for k in close for d in by_key[k]}
        )
    return f"; did you mean {' or '.join(named)}?" if named else ""


def describe_settings() -> list[tuple[str, str, Any]]:
    """Every setting as ``(dotted name, description, default)``, for docs and ``--help``."""
    rows: list[tuple[str, str, Any]] = []
    for section_name, section_field in TrainConfig.model_fields.items():
        section_cls = section_field.annotation
        for name, field in section_cls.model_fields.items():  # type: ignore[union-attr]  # each field is a section model
            rows.append((f"{section_name}.{name}", field.description or "", field.default))
    return rows
