"""Who owns a sandbox, and which listed sandboxes are orphans (``miles sandbox sweep``).

Every sandbox the lifecycle layer creates carries labels naming its owner: a run id
(``MILES_RUN_ID`` or one made up per process), the host, and the owning process's pid plus its
start time (so a recycled pid is not mistaken for the owner). A sandbox is an orphan when its
run is named for sweeping, its deadline has passed, or its owner process on this host is gone.
Owners on other hosts are never guessed at: name their run with ``--owner``.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from miles_core.sandbox.base import (
    LABEL_HOST,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_PID,
    LABEL_PID_START,
    SandboxInfo,
    SandboxProvider,
)
from miles_core.sandbox.retry import DEFAULT_RETRY, RetryPolicy, retrying

ENV_RUN_ID = "MILES_RUN_ID"


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[19].decode()


def process_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (a zombie is not: it has
    exited, only its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return False
    return start in (None, "", fields[19].decode())


@dataclass(frozen=True)
class Owner:
    """The identity stamped on sandboxes as labels."""

    run_id: str
    host: str
    pid: int
    pid_start: str

    @classmethod
    def current(cls, run_id: str | None = None) -> Owner:
        pid = os.getpid()
        run = run_id or os.environ.get(ENV_RUN_ID) or f"{socket.gethostname()}-{pid}-{secrets.token_hex(3)}"
        return cls(run, socket.gethostname(), pid, process_start_time(pid) or "")

    def labels(self) -> dict[str, str]:
        return {
            LABEL_MANAGED: "1",
            LABEL_OWNER: self.run_id,
            LABEL_HOST: self.host,
            LABEL_PID: str(self.pid),
            LABEL_PID_START: self.pid_start,
        }


def orphan_reason(info: SandboxInfo, *, owner: str | None, host: str, now: float) -> str | None:
    """Why ``info`` may be destroyed, or None to keep it."""
    labels = info.labels
    if labels.get(LABEL_MANAGED) != "1":
        return None
    if owner is not None:
        return f"owned by run {owner}" if labels.get(LABEL_OWNER) == owner else None
    if info.expires_at is not None and info.expires_at <= now:
        return "its TTL has passed"
    if labels.get(LABEL_HOST) == host:
        pid = labels.get(LABEL_PID, "")
        if pid.isdigit() and not process_alive(int(pid), labels.get(LABEL_PID_START)):
            return f"owner process {pid} on {host} is gone"
    return None


@dataclass
class SweepReport:
    destroyed: list[dict[str, str]] = field(default_factory=list)
    kept: list[dict[str, str]] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


async def sweep(
    provider: SandboxProvider,
    *,
    owner: str | None = None,
    dry_run: bool = False,
    labels: Mapping[str, str] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> SweepReport:
    """Destroy the managed sandboxes of ``provider`` that are orphans (see :func:`orphan_reason`)."""
    query = {**(labels or {}), LABEL_MANAGED: "1"}
    if owner is not None:
        query[LABEL_OWNER] = owner
    listed = await retrying(lambda: provider.list(query), retry, what=f"{provider.name} list")
    report = SweepReport(dry_run=dry_run)
    host, now = socket.gethostname(), time.time()
    for info in listed:
        reason = orphan_reason(info, owner=owner, host=host, now=now)
        row = {
            "id": info.id,
            "owner": info.labels.get(LABEL_OWNER, ""),
            "host": info.labels.get(LABEL_HOST, ""),
        }
        if reason is None:
            report.kept.append({**row, "reason": "owner may be alive (name its run with --owner)"})
            continue
        if not dry_run:
            await retrying(functools.partial(provider.destroy, info.id), retry, what=f"{provider.name} destroy")
        report.destroyed.append({**row, "reason": reason})
    return report
