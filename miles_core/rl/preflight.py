"""What ``miles train`` checks before it builds or writes anything, and where a run lives.

:func:`check` runs before the first write: the run directory can be made (and, without
``--resume``, holds no run), the model directory or preset exists and suits the device, and the
device ``trainer.device`` names exists here (the hardware backend is activated and verified).
Each failure is one :class:`~miles_core.errors.ConfigError` naming the setting; nothing is created.

The run directory: ``run.out_dir`` when set (a run already there is continued only with
``--resume``); otherwise a new directory ``<run.runs_dir>/<YYYYmmdd-HHMMSS>`` for every run, with
the link ``<run.runs_dir>/latest`` pointing at the newest, and ``--resume`` continues the run
``latest`` points at. :meth:`RunDir.create` makes the directory (and moves ``latest``) right
before the run starts; :meth:`RunDir.discard` undoes both when the run fails before its first
step is recorded, so a failed start leaves nothing behind.

Importing this module is cheap; torch is imported only to resolve the device.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles_core.errors import ConfigError
from miles_core.plugins import MilesPluginManager
from miles_core.rl.config import TrainConfig

#: the link to the newest run under ``run.runs_dir``
LATEST = "latest"
#: the record whose presence means a directory holds a run
METRICS = "metrics.jsonl"


@dataclass
class RunDir:
    """The directory a run writes to, and whether this run makes it."""

    path: Path
    #: the directory does not exist yet: :meth:`create` makes it
    new: bool
    #: set when the run's directory is one of ``run.runs_dir``'s (``latest`` is moved to it)
    runs_dir: Path | None = None
    _previous_latest: str | None = field(default=None, repr=False)
    _created: list[Path] = field(default_factory=list, repr=False)

    def create(self) -> Path:
        """Make the directory (a new run's gets a fresh name if another run took it meanwhile)
        and, under ``run.runs_dir``, point ``latest`` at it. A failure is a ConfigError."""
        if not self.new:
            return self.path
        setting = "run.runs_dir" if self.runs_dir is not None else "run.out_dir"
        missing_parents = [p for p in self.path.parents if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            made = [p for p in missing_parents if p.exists()]
            if self.runs_dir is not None:
                self.path = _make_unique(self.path)
                made.insert(0, self.path)
            else:
                try:
                    self.path.mkdir()
                    made.insert(0, self.path)
                except FileExistsError:  # made meanwhile by someone else: not ours to remove
                    pass
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot create {self.path}: {exc.strerror or exc}") from None
        self._created = made
        if self.runs_dir is not None:
            self._previous_latest = _read_latest(self.runs_dir)
            _point_latest(self.runs_dir, self.path.name)
        return self.path

    def discard(self) -> None:
        """Remove what :meth:`create` made (call only while the run has recorded nothing)."""
        if self.runs_dir is not None and self._created and _read_latest(self.runs_dir) == self.path.name:
            if self._previous_latest is None:
                (self.runs_dir / LATEST).unlink(missing_ok=True)
            else:
                _point_latest(self.runs_dir, self._previous_latest)
        if self._created:  # the outermost directory this run made, with everything below it
            shutil.rmtree(self._created[-1], ignore_errors=True)
        self._created = []


def check(config: TrainConfig, pm: MilesPluginManager, *, resume: bool) -> RunDir:
    """Everything that can be refused before the run writes or builds anything (module doc);
    returns the run's directory (not created yet)."""
    run_dir = choose_run_dir(config, resume=resume)
    check_model(config)
    check_device(config, pm)
    return run_dir


def choose_run_dir(config: TrainConfig, *, resume: bool, now: float | None = None) -> RunDir:
    """The run directory (module doc), checked to be creatable and, without ``resume``, free."""
    if config.run.out_dir is not None:
        path = Path(config.run.out_dir)
        _check_creatable(path, "run.out_dir")
        if not resume and (path / METRICS).exists():
            raise ConfigError(
                f"run.out_dir: {path} already holds a run ({METRICS}); pass --resume to continue it, or "
                "another --out (without --out every run gets a new directory under run.runs_dir)"
            )
        return RunDir(path, new=not path.exists())
    runs_dir = Path(config.run.runs_dir)
    _check_creatable(runs_dir, "run.runs_dir")
    latest = _read_latest(runs_dir)
    if resume and latest is not None:
        return RunDir(runs_dir / latest, new=False, runs_dir=runs_dir)
    if resume and (runs_dir / METRICS).exists():
        raise ConfigError(
            f"--resume: {runs_dir} has no {LATEST} run but holds a run itself ({METRICS}); "
            f"continue it with --out {runs_dir} --resume"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return RunDir(runs_dir / stamp, new=True, runs_dir=runs_dir)


def check_model(config: TrainConfig) -> None:
    if config.model.path is not None:
        path = Path(config.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")


def check_device(config: TrainConfig, pm: MilesPluginManager) -> None:
    """``trainer.device`` exists here and suits the model preset and the trainer backend.

    Skipped for a run on a remote cluster (``orchestrator.address``): its workers check their own
    devices. Otherwise the trainer and the engine run on this machine, in-process or in a local
    Ray cluster.
    """
    if config.orchestrator.address is not None:
        return
    from miles_core.hardware.devices import resolve_device

    device = resolve_device(config.trainer.device, "trainer.device")
    if config.model.preset is not None:
        from miles_core.engine.presets import get_preset

        preset = get_preset(config.model.preset)
        if preset.device != "cpu" and device.type == "cpu":
            raise ConfigError(
                f"model.preset: {preset.name!r} is built for {preset.device}, but trainer.device = "
                f"{config.trainer.device!r} is the CPU here; run it where a {preset.device} device is "
                "visible, or use a CPU preset (tiny-rl)"
            )
    world = config.trainer.world_size
    megatron = config.trainer.backend == "megatron"
    if not megatron and (device.type == "cpu" or world == 1):
        return
    from miles_core.hardware.activation import activate

    backend = activate().backend
    if megatron and device.type != backend.device_type:
        # megatron-core allocates its buffers on the current CUDA device, which only the cpu
        # backend's megatron fixes point at the host
        raise ConfigError(
            f"trainer.device: trainer.backend = 'megatron' trains on the selected hardware backend's device "
            f"({backend.name}: {backend.device_type}), not {config.trainer.device!r}; leave trainer.device = 'auto', "
            "or train on the CPU with trainer.backend = 'hf'"
        )
    if device.type != "cpu" and world > 1:
        visible = backend.device_count() if backend.device_type == device.type else 0
        if visible < world:
            raise ConfigError(f"trainer.world_size = {world} needs one {device.type} device per rank; {visible} visible")


def _check_creatable(path: Path, setting: str) -> None:
    """``path`` is a directory, or one can be made there (checked without writing)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{setting}: {path} exists and is not a directory")
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise ConfigError(f"{setting}: {probe} is a dangling link")
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{setting}: cannot create {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise ConfigError(f"{setting}: {path} {what}")


def _make_unique(path: Path) -> Path:
    """Create ``path``, or ``path-2``, ``path-3``, ... when another run took the name this second."""
    for n in range(1, 1000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{path}: 999 runs started within one second")


def _read_latest(runs_dir: Path) -> str | None:
    """The run directory name ``latest`` points at (None if there is no link or its run is gone)."""
    link = runs_dir / LATEST
    if not link.is_symlink():
        if link.exists():
            raise ConfigError(f"run.runs_dir: {link} is not a link (miles keeps a link to the newest run there)")
        return None
    target = os.readlink(link)
    return target if (runs_dir / target).is_dir() else None


def _point_latest(runs_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (readers see the old link or the new one)."""
    tmp = runs_dir / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, runs_dir / LATEST)
