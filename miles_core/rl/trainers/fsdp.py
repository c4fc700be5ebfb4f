"""Data-parallel ranks for the ``hf`` trainer: FSDP2 over ``trainer.world_size`` processes.

The run's process is rank 0; :class:`RankGroup` spawns ranks 1..N-1, each a process that builds
the same :class:`~miles_core.rl.trainers.hf.HFPolicy` (the model sharded with FSDP2's
``fully_shard``, one device per rank over the hardware backend's collectives: NCCL on CUDA, gloo
on CPU) and then executes the
commands rank 0 sends it, in the same order, since each one is a collective. A command is the name
of the ``HFPolicy`` method every rank calls (:data:`COMMANDS`): ``train`` (the step's whole document
list; every rank trains its share, see :class:`~miles_core.rl.policy_update.DataParallel`),
``full_state`` (gather the full weights to rank 0 for the engine), ``save`` and ``load``; ``stop``
ends a rank. A rank that fails replies with its traceback, which rank 0 raises naming the rank.
Every rank checks rank 0's plugin fingerprint before building. The ranks meet at a ``TCPStore``
that rank 0 opens on a free loopback port.
"""

from __future__ import annotations

import datetime
import os
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from miles_core.hardware.devices import bind_device, distributed_backend, rank_device
from miles_core.rl.config import TrainConfig

#: how long a collective waits for a rank that stopped answering before it fails
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
#: the ``HFPolicy`` methods rank 0 runs on every rank
COMMANDS = frozenset({"train", "full_state", "save", "load"})
HOST = "127.0.0.1"


def init_rank(rank: int, world_size: int, store: Any, device: torch.device) -> None:
    """Join the process group over the collectives for ``device`` (gloo on the host, nccl, ...)."""
    import torch.distributed as dist

    bind_device(device)
    dist.init_process_group(
        distributed_backend(device), store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def shard_model(model: torch.nn.Module, device: torch.device) -> list[str]:
    """``fully_shard`` every block transformers keeps whole (``_no_split_modules``), then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    sharded: set[str] = set()
    for module in list(model.modules()):
        name = type(module).__name__  # before fully_shard, which swaps in an FSDP subclass
        if name in blocks:
            sharded.add(name)
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sorted(sharded)


class RankGroup:
    """Ranks 1..N-1 of a data-parallel trainer, driven from rank 0 (this process)."""

    def __init__(self, world_size: int, model_dir: Path, config: TrainConfig, device: torch.device) -> None:
        """Spawn ranks 1..N-1; each resolves ``config.algorithm.name`` from its own plugins."""
        import torch.distributed as dist

        from miles_core.plugins import get_plugin_manager

        context = torch.multiprocessing.get_context("spawn")
        #: rank 0's end of the rendezvous (port 0: the OS picks a free one, no race)
        self.store = dist.TCPStore(
            HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
        )
        fingerprint = get_plugin_manager().fingerprint()
        self.pipes: list[Connection] = []
        self.processes = []
        self.killed = False
        for rank in range(1, world_size):
            here, there = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, world_size, self.store.port, Path(model_dir), config, device, fingerprint, there),
                name=f"miles-trainer-rank{rank}",
                daemon=True,
            )
            process.start()
            there.close()
            self.pipes.append(here)
            self.processes.append(process)

    def send(self, command: str, *args: Any) -> None:
        if command not in COMMANDS:
            raise ValueError(f"unknown trainer command {command!r} (known: {', '.join(sorted(COMMANDS))})")
        if self.killed:
            raise RuntimeError("the trainer's other ranks were stopped after an earlier failure; start a new run")
        for pipe in self.pipes:
            pipe.send((command, args))

    def replies(self) -> list[Any]:
        """Each rank's reply to the last command; a failed rank's traceback is raised here."""
        out = []
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                status, value = pipe.recv()
            except EOFError:
                raise RuntimeError(f"trainer rank {rank} exited (exit code {self.processes[rank - 1].exitcode})") from None
            if status == "error":
                raise RuntimeError(f"trainer rank {rank} failed:\n{value}")
            out.append(value)
        return out

    def run(self, policy: Any, command: str, *args: Any) -> Any:
        """Call ``policy.<command>(*args)`` on every rank (``policy`` is rank 0's); rank 0's result.

        If rank 0's part fails, the other ranks may be waiting for it inside a collective: they
        are killed rather than waited for, and the trainer is unusable afterwards.
        """
        self.send(command, *args)
        try:
            result = getattr(policy, command)(*args)
        except BaseException:
            self.kill()
            raise
        self.replies()
        return result

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        self.pipes, self.processes, self.killed = [], [], True

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass  # that rank is gone already; join() below reaps it
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    model_dir: Path,
    config: TrainConfig,
    device: torch.device,
    fingerprint: dict[str, Any],
    pipe: Connection,
) -> None:
    """A rank > 0: build the policy, then execute rank 0's commands until ``stop``."""
    import torch.distributed as dist

    from miles_core.plugins import get_plugin_manager
    from miles_core.rl import registry
    from miles_core.rl.orchestrators.fingerprint import check_fingerprint
    from miles_core.rl.policy_update import DataParallel
    from miles_core.rl.trainers.hf import HFPolicy

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a terminal's Ctrl-C reaches every process of the group: rank 0 decides (it finishes the step
    # in flight, or kills the ranks on a second one)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # checked before joining the group: rank 0 would otherwise wait for this rank in vain
        torch.set_num_threads(config.run.torch_threads)
        check_fingerprint(fingerprint, f"trainer rank {rank}")
        device = rank_device(device, rank)
        algorithm = registry.algorithm(get_plugin_manager(), config)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ok", "checked"))
    try:
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        init_rank(rank, world_size, store, device)
        policy = HFPolicy(model_dir, config, device, DataParallel(rank, world_size, device), algorithm)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ok", "built"))
    while True:
        command, args = pipe.recv()
        if command == "stop":
            break
        try:
            pipe.send(("ok", getattr(policy, command)(*args)))
        except BaseException:
            pipe.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
