"""Local images: a recipe run once into a directory named by its digest.

``base`` must be ``"host"`` (the host's userland is the base) and relative ``Copy.dest`` paths
land inside the image directory, which each sandbox gets a private copy of as its working
directory. Builds of one digest are serialised across processes with ``flock``; a build
happens in a scratch directory renamed into place only when every step succeeded, so an image
directory is either complete or absent.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from miles_core.sandbox.base import Copy, ImageSpec, Run
from miles_core.sandbox.errors import ImageBuildError, SandboxUnsupported
from miles_core.sandbox.local.store import Store, remove_tree

HOST_BASE = "host"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STDERR_TAIL = 2000


def check_spec(spec: ImageSpec) -> None:
    """Refuse what a directory image cannot honour, before anything is built."""
    if spec.base != HOST_BASE:
        raise SandboxUnsupported(
            f"ImageSpec.base {spec.base!r}: the local provider builds on the host's userland; "
            f"use base={HOST_BASE!r} or a provider with custom base images",
            provider="local",
        )
    me = getpass.getuser()
    if spec.user != me:
        raise SandboxUnsupported(
            f"ImageSpec.user {spec.user!r}: local build steps run as this process's user {me!r}",
            provider="local",
        )
    for index, step in enumerate(spec.steps):
        if isinstance(step, Copy) and step.dest.startswith("/"):
            raise SandboxUnsupported(
                f"ImageSpec.steps[{index}]: Copy.dest {step.dest!r} must be relative for a local image",
                provider="local",
            )


def build_env(workdir: Path) -> dict[str, str]:
    return {"PATH": DEFAULT_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}


def ensure_image(store: Store, spec: ImageSpec, *, step_timeout_s: float) -> Path:
    """The directory of ``spec``'s image, building it first if no process has."""
    check_spec(spec)
    final = store.image_dir(spec.digest)
    if final.is_dir():
        return final
    lock_fd = os.open(store.images / f"{spec.digest}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if final.is_dir():  # another process built it while we waited
            return final
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=store.images))
        try:
            _run_steps(spec, scratch, step_timeout_s)
            os.chmod(scratch, 0o755)
            (store.images / f"{spec.digest}.json").write_text(json.dumps(spec.canonical(), indent=1))
            os.rename(scratch, final)
        finally:
            remove_tree(scratch)
        return final
    finally:
        os.close(lock_fd)


def _run_steps(spec: ImageSpec, scratch: Path, step_timeout_s: float) -> None:
    for index, step in enumerate(spec.steps):
        if isinstance(step, Copy):
            target = scratch / step.dest
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(step.content)
            os.chmod(target, step.mode)
            continue
        assert isinstance(step, Run)
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", step.cmd],
                cwd=scratch,
                env=build_env(scratch),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=step_timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise ImageBuildError(
                f"image {spec.name}: step {index} ({step.cmd[:80]!r}) ran past {step_timeout_s:g}s",
                provider="local",
            ) from None
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace")[-STDERR_TAIL:]
            raise ImageBuildError(
                f"image {spec.name}: step {index} ({step.cmd[:80]!r}) exited {done.returncode}: {tail}",
                provider="local",
            )


def populate(image: Path | None, workdir: Path, uid: int | None) -> None:
    """Give a new sandbox its working directory: a private copy of the image (or empty)."""
    if image is None:
        workdir.mkdir(mode=0o700)
    else:
        shutil.copytree(image, workdir, symlinks=True)
        os.chmod(workdir, 0o700)
    if uid is not None:
        for directory, subdirs, files in os.walk(workdir):
            os.chown(directory, uid, uid, follow_symlinks=False)
            for name in (*subdirs, *files):
                os.chown(os.path.join(directory, name), uid, uid, follow_symlinks=False)
