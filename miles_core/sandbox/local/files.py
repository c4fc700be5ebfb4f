"""File transfer into and out of a local sandbox without following the sandbox's symlinks.

The owner may be root while the sandbox's files are written by untrusted code: a symlink
``answer.txt -> /etc/shadow`` must not turn ``read_file("answer.txt")`` into a host read. Paths
are walked one component at a time with ``O_NOFOLLOW`` below the sandbox's working directory;
``..`` and absolute paths outside it are refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from miles_core.sandbox.errors import SandboxFatalError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: opening a FIFO the sandbox planted must not hang the owner
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _require_regular(fd: int, path: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(0, f"{path!r} is not a regular file")


def _parts(visible: PurePosixPath, path: str) -> list[str]:
    """``path`` (relative, or absolute under ``visible``: the working directory as the sandbox
    sees it) as components below the working directory."""
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(visible)
        except ValueError:
            raise SandboxFatalError(
                f"path {path!r} is outside the sandbox's working directory {visible}", provider="local"
            ) from None
    parts = [p for p in pure.parts if p not in ("", ".")]
    if not parts or ".." in parts:
        raise SandboxFatalError(
            f"path {path!r} must name a file below the working directory", provider="local"
        )
    return parts


def _open_parent(workdir: Path, parts: list[str], *, create: bool, owner: int | None) -> int:
    fd = os.open(workdir, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_file(
    workdir: Path, path: str, data: bytes, *, mode: int, owner: int | None, visible: str | None = None
) -> None:
    """Write ``data`` to ``path`` (relative to ``workdir``), owned by the sandbox's uid.

    ``visible``: the working directory's path inside the sandbox (default: ``workdir``)."""
    parts = _parts(PurePosixPath(visible or workdir), path)
    try:
        parent = _open_parent(workdir, parts, create=True, owner=owner)
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE_FLAGS, mode, dir_fd=parent)
        finally:
            os.close(parent)
        _require_regular(fd, path)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
            if owner is not None:
                os.fchown(fh.fileno(), owner, owner)
    except OSError as exc:
        raise SandboxFatalError(f"cannot write {path!r}: {exc.strerror}", provider="local") from None


def read_file(workdir: Path, path: str, *, visible: str | None = None, owner: int | None = None) -> bytes:
    """The content of ``path`` below ``workdir``. With ``owner`` (the sandbox's own uid, as
    root) a file it does not own is refused: a hard link the sandbox made to a host file."""
    parts = _parts(PurePosixPath(visible or workdir), path)
    try:
        parent = _open_parent(workdir, parts, create=False, owner=None)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _FILE_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
        _require_regular(fd, path)
        if owner is not None and os.fstat(fd).st_uid != owner:
            os.close(fd)
            raise OSError(0, f"{path!r} is not owned by the sandbox (a link to a file of the host?)")
        with os.fdopen(fd, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise SandboxFatalError(f"cannot read {path!r}: {exc.strerror}", provider="local") from None
