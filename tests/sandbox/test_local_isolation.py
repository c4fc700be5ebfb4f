"""What the local provider isolates, checked from inside the sandboxes."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import Limits, SandboxSpec
from miles_core.sandbox.errors import SandboxError, SandboxUnsupported
from miles_core.sandbox.local.isolation import is_root, sandbox_processes
from miles_core.sandbox.local.provider import LocalProvider

register_cpu_ci(est_time=4, suite="stage-a-cpu")


def run(root: Path, body):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        provider = LocalProvider(root)
        try:
            return await body(provider)
        finally:
            for info in await provider.list({}):
                await provider.destroy(info.id)
            await provider.aclose()

    return asyncio.run(main())


def test_destroy_kills_daemons_that_left_the_process_group(sandbox_root: Path) -> None:
    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec())
        await provider.exec(ref, "setsid sleep 321 >/dev/null 2>&1 & sleep 0.3; echo ok")
        await asyncio.sleep(0.2)
        assert len(sandbox_processes(ref.id)) >= 1, "the escaped daemon did not start"
        await provider.destroy(ref.id)
        await asyncio.sleep(0.1)
        assert sandbox_processes(ref.id) == []

    run(sandbox_root, body)


def test_files_do_not_follow_the_sandboxes_symlinks(sandbox_root: Path) -> None:
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

    run(sandbox_root, body)


def test_environment_is_scrubbed_and_output_capped(
    sandbox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_PLANTED_HOST_VAR", "host-only")

    async def body(provider: LocalProvider) -> None:
        ref = await provider.create(SandboxSpec(env={"KEEP": "1"}, limits=Limits(output_bytes=1000)))
        env = (await provider.exec(ref, "env")).stdout
        assert "KEEP=1" in env and "MILES_PLANTED_HOST_VAR" not in env and f"MILES_SANDBOX_ID={ref.id}" in env
        big = await provider.exec(ref, "head -c 5000 /dev/zero | tr '\\0' x")
        assert big.truncated and len(big.stdout) == 1000

    run(sandbox_root, body)


@pytest.mark.skipif(not is_root(), reason="per-sandbox uids need root")
def test_sandboxes_have_private_uids(sandbox_root: Path) -> None:
    async def body(provider: LocalProvider) -> None:
        first, second = await provider.create(SandboxSpec()), await provider.create(SandboxSpec())
        await provider.write_file(first, "private.txt", "mine")
        uid_a = (await provider.exec(first, "id -u")).stdout
        uid_b = (await provider.exec(second, "id -u")).stdout
        assert uid_a != uid_b and int(uid_a) != 0
        peek = await provider.exec(second, ["cat", f"{first.workdir}/private.txt"])
        assert peek.exit_code != 0 and "Permission denied" in peek.stderr

    run(sandbox_root, body)


def test_network_isolation_and_expose(sandbox_root: Path) -> None:
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

    run(sandbox_root, body)
