"""What the local provider isolates, checked from inside the sandboxes, per isolation mode."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import Limits, SandboxSpec
from miles_core.sandbox.errors import SandboxError, SandboxNotFound, SandboxUnsupported
from miles_core.sandbox.local import namespaces
from miles_core.sandbox.local.client import supervisor_env
from miles_core.sandbox.local.isolation import is_root, kill_sandbox_processes
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.testing.sandbox_probes import _processes_with_args

register_cpu_ci(est_time=9, suite="stage-a-cpu")


def run(root: Path, options: dict[str, Any], body):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        provider = LocalProvider(root, **options)
        try:
            return await body(provider)
        finally:
            for info in await provider.list({}):
                await provider.destroy(info.id)
            await provider.aclose()

    return asyncio.run(main())


def test_destroy_kills_daemons_that_left_the_process_group(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    marker = str(600_000 + secrets.randbelow(100_000))

    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec())
        await provider.exec(ref, f"setsid env -i sleep {marker} >/dev/null 2>&1 & sleep 0.3; echo ok")
        await asyncio.sleep(0.2)
        assert _processes_with_args([marker]), "the escaped daemon did not start"
        await provider.destroy(ref.id)
        assert _processes_with_args([marker]) == [], "a daemon survived destroy"

    run(sandbox_root, local_options, body)


@pytest.mark.skipif(not is_root(), reason="a sandbox's processes are told apart by its own uid only as root")
def test_destroy_returns_once_the_sandboxes_processes_have_exited(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    """Killed is not exited: a process that holds 1 GiB needs a few hundred milliseconds to free
    it after SIGKILL (a loaded machine gives every killed process such a delay). Destroy waits
    until each has exited (a zombie has: only its parent has not reaped it yet)."""

    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec(limits=Limits(memory_mb=4096)))
        hold = "import time; b = bytearray(b'x') * (1 << 30); open('held', 'w').close(); time.sleep(600)"
        await provider.exec(ref, ["setsid", "python3", "-c", hold], background=True)
        held = Path(provider.host_workdir(ref), "held")
        deadline = time.monotonic() + 60
        while not held.exists():
            assert time.monotonic() < deadline, "the process never held its memory"
            await asyncio.sleep(0.05)
        meta = provider.store.read_meta(ref.id)
        assert meta is not None and meta.uid is not None
        await provider.destroy(ref.id)
        assert _living_processes_of(meta.uid) == [], "destroy returned before its processes had exited"

    run(sandbox_root, local_options, body)


def test_killing_by_marker_waits_until_the_marked_processes_have_exited() -> None:
    """The process mode's destroy without a uid of its own (an unprivileged owner): every
    process carrying the sandbox's marker is killed and has exited when the call returns --
    one of them holds 512 MiB, slow to free -- and an unmarked one is left alone."""
    sandbox_id = secrets.token_hex(8)
    hold = "import sys, time; b = bytearray(b'x') * (512 << 20); print(flush=True); time.sleep(600)"
    marked = {**os.environ, "MILES_SANDBOX_ID": sandbox_id}
    procs = [subprocess.Popen([sys.executable, "-c", hold], env=marked, stdout=subprocess.PIPE)]
    procs += [subprocess.Popen(["sleep", "600"], env=marked) for _ in range(2)]
    control = subprocess.Popen(["sleep", "600"])
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline() == b"\n"
        pidfds = [os.pidfd_open(p.pid) for p in procs]
        assert kill_sandbox_processes(sandbox_id) == 3
        exited = select.select(pidfds, [], [], 0)[0]
        assert sorted(exited) == sorted(pidfds), "returned before the killed processes had exited"
        assert [p.wait() for p in procs] == [-signal.SIGKILL] * 3
        assert control.poll() is None
    finally:
        for p in [*procs, control]:
            p.kill()
            p.wait()


def _living_processes_of(uid: int) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{entry.name}/status").read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if str(uid) in status["Uid"].split() and not status["State"].strip().startswith(("Z", "X")):
            found.append(f"{entry.name} {status['Name'].strip()} {status['State'].strip()}")
    return found


def test_files_do_not_follow_the_sandboxes_symlinks(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec())
        await provider.exec(ref, "ln -s /etc/passwd leak.txt; ln -s /etc outside")
        with pytest.raises(SandboxError, match=r"leak\.txt"):
            await provider.read_file(ref, "leak.txt")
        with pytest.raises(SandboxError):
            await provider.write_file(ref, "outside/planted", b"x")
        assert not Path("/etc/planted").exists()
        with pytest.raises(SandboxError, match="outside the sandbox"):
            await provider.read_file(ref, "/etc/passwd")
        with pytest.raises(SandboxError):
            await provider.read_file(ref, "../meta.json")
        await provider.write_file(ref, f"{ref.workdir}/absolute.txt", b"in the workdir")
        assert (await provider.exec(ref, "cat absolute.txt")).stdout == "in the workdir"
        if is_root():  # a hard link to a host file (fs.protected_hardlinks=0 lets a sandbox make one)
            secret = Path(provider.host_workdir(ref)).parent / "host-secret"
            secret.write_text("host only")
            os.link(secret, Path(provider.host_workdir(ref), "hard.txt"))
            with pytest.raises(SandboxError, match="not owned by the sandbox"):
                await provider.read_file(ref, "hard.txt")

    run(sandbox_root, local_options, body)


def test_environment_is_scrubbed_and_output_capped(
    sandbox_root: Path, local_options, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setenv("MILES_PLANTED_HOST_VAR", "host-only")

    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec(env={"KEEP": "1"}, limits=Limits(output_bytes=1000)))
        env = (await provider.exec(ref, "env")).stdout
        assert "KEEP=1" in env and "MILES_PLANTED_HOST_VAR" not in env and f"MILES_SANDBOX_ID={ref.id}" in env
        big = await provider.exec(ref, "head -c 5000 /dev/zero | tr '\\0' x")
        assert big.truncated and len(big.stdout) == 1000

    run(sandbox_root, local_options, body)


def test_the_supervisor_starts_with_an_allow_listed_environment(
    sandbox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "planted-wandb-key")
    monkeypatch.setenv("E2B_API_KEY", "e2b_planted")

    async def body(provider: LocalProvider) -> None:
        await provider.create(SandboxSpec())
        environ = Path(f"/proc/{(await provider._client()).pid}/environ").read_bytes()
        names = {item.split(b"=", 1)[0].decode() for item in environ.split(b"\0") if item}
        assert names == set(supervisor_env()), names
        assert b"planted" not in environ

    run(sandbox_root, {}, body)


def test_python_is_the_callers_or_the_hosts(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        described = provider.describe()["interpreters"]
        assert described is not None, "this host has no python3 for sandboxes"
        ref = await provider.create(SandboxSpec())
        for name in ("python", "python3"):
            result = await provider.exec(ref, [name, "-c", "import platform; print(platform.python_version())"])
            assert result.ok and result.stdout.strip() == described["version"], result

    run(sandbox_root, local_options, body)


def test_network_isolation_and_expose(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        if not provider.capabilities.network_isolation:
            pytest.skip("this host does not permit network namespaces")
        host_server = socket.create_server(("127.0.0.1", 0))
        port = host_server.getsockname()[1]
        try:
            isolated = await provider.create(SandboxSpec())
            probe = (
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\""
            )
            assert (await provider.exec(isolated, probe)).exit_code != 0, (
                "an isolated sandbox reached the host"
            )
            inner = "python3 -c \"import socket; s=socket.create_server(('127.0.0.1',0)); socket.create_connection(s.getsockname())\""
            assert (await provider.exec(isolated, inner)).ok, "loopback inside the sandbox must work"
            with pytest.raises(SandboxUnsupported):
                await provider.expose(isolated, 8000)
            networked = await provider.create(SandboxSpec(network=True))
            assert (await provider.exec(networked, probe)).ok
        finally:
            host_server.close()
        free = socket.create_server(("127.0.0.1", 0))
        web_port = free.getsockname()[1]
        free.close()
        await provider.write_file(networked, "index.html", "hello from the sandbox")
        await provider.exec(
            networked, ["python3", "-m", "http.server", str(web_port), "--bind", "127.0.0.1"], background=True
        )
        endpoint = await provider.expose(networked, web_port)
        deadline = time.monotonic() + 10
        while True:
            try:
                body_text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(endpoint.url + "/index.html", timeout=2).read()
                )
                break
            except OSError:
                assert time.monotonic() < deadline, "the exposed server never answered"
                await asyncio.sleep(0.1)
        assert body_text == b"hello from the sandbox"

    run(sandbox_root, local_options, body)


@pytest.mark.skipif(not is_root(), reason="per-sandbox uids need root")
def test_process_sandboxes_have_private_uids(sandbox_root: Path) -> None:
    async def body(provider: LocalProvider) -> None:
        first, second = await provider.create(SandboxSpec()), await provider.create(SandboxSpec())
        await provider.write_file(first, "private.txt", "mine")
        uid_a = (await provider.exec(first, "id -u")).stdout
        uid_b = (await provider.exec(second, "id -u")).stdout
        assert uid_a != uid_b and int(uid_a) != 0
        peek = await provider.exec(second, ["cat", f"{first.workdir}/private.txt"])
        assert peek.exit_code != 0 and "Permission denied" in peek.stderr

    run(sandbox_root, {"isolation": "process"}, body)


# -- namespaces ---------------------------------------------------------------------------------------

INSIDE = """
echo "uid=$(id -u) host=$(hostname) procs=$(ls -d /proc/[0-9]* | wc -l)"
grep -E '^(CapEff|CapBnd|NoNewPrivs):' /proc/self/status
touch /x 2>/dev/null && echo root-writable
touch /usr/x 2>/dev/null && echo usr-writable
echo hi > /tmp/t && echo hi > /dev/shm/t && echo hi > /var/tmp/t && echo hi > work.txt && echo private-writable
test -e {host_root} && echo host-root-visible
test -e /etc/machine-id && echo machine-id-visible
test -e /root/.bashrc && echo root-home-visible
cut -d: -f1 /etc/passwd | tr '\\n' ' '; echo
cat /dev/null && echo dev-null-works
"""


def test_a_namespace_sandbox_sees_only_itself(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec())
        result = await provider.exec(ref, INSIDE.format(host_root=sandbox_root))
        out = result.stdout
        assert ref.workdir == namespaces.WORKDIR
        assert "uid=1000 host=sandbox" in out, out
        assert int(out.split("procs=")[1].split()[0]) <= 6, out  # init, its sleep, this shell, ls
        assert "CapEff:\t0000000000000000" in out and "NoNewPrivs:\t1" in out, out
        assert "CapBnd:\t0000000000000000" in out, out
        for leak in ("root-writable", "usr-writable", "host-root-visible", "machine-id-visible", "root-home-visible"):
            assert leak not in out, f"{leak}: {out}"
        assert "private-writable" in out and "dev-null-works" in out, (out, result.stderr)
        assert "root sandbox nobody" in out, out
        assert (await provider.read_file(ref, "work.txt")) == b"hi\n"

    run(sandbox_root, namespace_options, body)


@pytest.mark.skipif(not is_root(), reason="per-sandbox host uids need root")
def test_namespace_sandboxes_run_as_host_uids_of_their_own(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        boxes = [await provider.create(SandboxSpec()) for _ in range(2)]
        host_uids = []
        for ref in boxes:
            meta = provider.store.read_meta(ref.id)
            assert meta is not None and meta.init_pid is not None and meta.uid is not None
            await provider.exec(ref, ["sleep", "30"], background=True)
            status = Path(f"/proc/{meta.init_pid}/status").read_text()
            real = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            assert real == meta.uid
            host_uids.append(real)
        assert len(set(host_uids)) == 2 and 0 not in host_uids

    run(sandbox_root, namespace_options, body)


def test_a_sandbox_whose_init_dies_is_gone(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec())
        meta = provider.store.read_meta(ref.id)
        assert meta is not None and meta.init_pid is not None
        os.kill(meta.init_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while await provider.list({}):
            assert time.monotonic() < deadline, "the sandbox outlived its init"
            await asyncio.sleep(0.05)
        with pytest.raises(SandboxNotFound):
            await provider.exec(ref, "true")

    run(sandbox_root, namespace_options, body)


def test_namespaces_where_the_host_cannot_is_a_clear_error(
    sandbox_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unavailable = namespaces.Support(False, None, "unshare: EPERM (user namespaces are disabled)")
    monkeypatch.setattr(namespaces, "support", lambda tool="auto": unavailable)
    with pytest.raises(SandboxUnsupported, match=r"isolation='namespaces' is not available.*user namespaces are disabled"):
        LocalProvider(sandbox_root, isolation="namespaces")
    with caplog.at_level(logging.WARNING, logger="miles_core.sandbox.local.provider"):
        fallback = LocalProvider(sandbox_root)
    assert fallback.isolation == "process" and "fall back to isolation='process'" in caplog.text
    assert fallback.describe()["namespaces"]["detail"] == unavailable.detail
    with pytest.raises(SandboxUnsupported, match="isolation 'vm'"):
        LocalProvider(sandbox_root, isolation="vm")  # type: ignore[arg-type]
