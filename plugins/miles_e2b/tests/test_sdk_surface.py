"""Every SDK call miles-e2b makes exists with that signature in the installed ``e2b``.

The calls are the ones the provider really made against the fake SDK during a scenario that
uses every operation; each is bound to the installed SDK's signature. The declared surface
(what ``verify()`` checks) must equal the calls made."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable

import e2b
import pytest
from miles_e2b import sdk
from miles_e2b.fake import FakeE2BServer
from miles_e2b.plugin import E2BProviderSpec
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import Copy, ImageSpec, Run, SandboxSpec

register_cpu_ci(est_time=2, suite="stage-a-cpu")


async def every_operation(provider: E2BProvider) -> None:
    image = await provider.prepare_image(
        ImageSpec("e2bdev/base", (Copy("a.txt", b"a"), Run("cp a.txt b.txt")))
    )
    await provider.prepare_image(ImageSpec("e2bdev/base", (Copy("a.txt", b"a"), Run("cp a.txt b.txt"))))
    ref = await provider.create(SandboxSpec(image=image, labels={"t": "surface"}))
    assert (await provider.exec(ref, "cat b.txt")).stdout == "a"
    assert (await provider.exec(ref, ["false"])).exit_code == 1
    assert (await provider.exec(ref, "sleep 5", timeout=0.2)).timed_out
    await provider.exec(ref, "sleep 5", background=True)
    await provider.write_file(ref, "x.bin", b"\x00\x01")
    assert await provider.read_file(ref, "x.bin") == b"\x00\x01"
    await provider.expose(ref, 8000)
    await provider.extend(ref.id, 60)
    assert [i.id for i in await provider.list({"t": "surface"})] == [ref.id]
    assert await provider.destroy(ref.id)


def test_verify_checks_the_installed_sdk() -> None:
    facts = E2BProviderSpec().verify()
    assert facts["e2b_version"] == sdk.version() and facts["calls_checked"] == len(sdk.SDK_CALLS)


def test_every_call_made_binds_to_the_installed_sdk(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    asyncio.run(every_operation(make_provider(domain="example.test", api_url="https://api.example.test")))
    made = {name for name, _, _ in server.calls}
    assert made == set(sdk.SDK_CALLS), (
        f"undeclared: {made - set(sdk.SDK_CALLS)}, unused: {set(sdk.SDK_CALLS) - made}"
    )
    for name, args, kwargs in server.calls:
        sdk.bind(e2b, name, args, kwargs)  # raises TypeError on any mismatch
    for name, _, kwargs in server.calls:  # only the non-deprecated template API
        assert name != "AsyncTemplate.alias_exists" and "alias" not in kwargs


def test_binding_catches_a_call_the_sdk_does_not_accept() -> None:
    with pytest.raises(TypeError):
        sdk.bind(e2b, "AsyncTemplate.build", (object(), "name"), {"cpu": 2})
    with pytest.raises(TypeError, match="ApiParams"):
        sdk.bind(e2b, "AsyncSandbox.kill", ("id",), {"api_token": "x"})


def test_check_surface_names_what_a_different_sdk_lacks() -> None:
    class OldTemplate(e2b.AsyncTemplate):
        exists = None  # as before 2.12: only alias_exists

    fake_module = types.SimpleNamespace(**{n: getattr(e2b, n) for n in dir(e2b) if not n.startswith("_")})
    fake_module.AsyncTemplate = OldTemplate
    del fake_module.RateLimitException
    with pytest.raises(RuntimeError) as raised:
        sdk.check_surface(fake_module)
    assert "AsyncTemplate.exists: not found" in str(raised.value)
    assert "RateLimitException" in str(raised.value)
