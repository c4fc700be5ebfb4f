"""Templates: built with the Template API under the recipe digest, build user first, reused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miles_e2b.fake import FakeE2BServer
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import Copy, ImageSpec, Resources, Run
from miles_core.sandbox.lifecycle import SandboxManager

register_cpu_ci(est_time=2, suite="stage-a-cpu")

RECIPE = ImageSpec(
    "python:3.12-slim",
    (
        Run("mkdir -p cache && echo 1 > cache/stamp"),
        Copy("tools/run.sh", b"#!/bin/sh\necho ok\n", mode=0o755),
        Run("true"),
    ),
    user="root",
    resources=Resources(cpus=2, memory_mb=4096, disk_mb=10240),
)


def test_build_uses_the_digest_name_and_sets_the_user_before_any_step(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    ref = asyncio.run(make_provider().prepare_image(RECIPE))
    assert ref.name == RECIPE.name and ref.digest == RECIPE.digest and len(ref.name) >= len("miles-") + 16
    names = [name for name, _, _ in server.calls]
    steps = [
        (n, a, k) for n, a, k in server.calls if n.startswith(("AsyncTemplate.from_image", "TemplateBuilder"))
    ]
    assert [n for n, _, _ in steps] == [
        "AsyncTemplate.from_image",
        "TemplateBuilder.set_user",
        "TemplateBuilder.set_workdir",
        "TemplateBuilder.run_cmd",
        "TemplateBuilder.copy",
        "TemplateBuilder.run_cmd",
    ]
    assert steps[0][1] == ("python:3.12-slim",) and steps[1][1] == ("root",)
    copy_args, copy_kwargs = steps[4][1], steps[4][2]
    assert copy_args == (RECIPE.steps[1].sha256, "/home/user/tools/run.sh") and copy_kwargs["mode"] == 0o755  # type: ignore[union-attr]
    build = next(k for n, _, k in server.calls if n == "AsyncTemplate.build")
    assert (build["cpu_count"], build["memory_mb"], build["min_free_disk_mb"]) == (2, 4096, 10240)
    assert names.index("AsyncTemplate.exists") < names.index("AsyncTemplate.build")
    assert server.builds == [RECIPE.name]
    assert (server.templates[RECIPE.name] / "home/user/tools/run.sh").read_bytes() == b"#!/bin/sh\necho ok\n"


def test_existing_templates_are_reused_and_builds_are_single_flight(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    async def main() -> None:
        provider = make_provider()
        async with SandboxManager(provider) as manager:
            refs = await asyncio.gather(*(manager.prepare_image(RECIPE) for _ in range(8)))
            assert len(set(refs)) == 1
        await make_provider().prepare_image(RECIPE)  # another process: exists, no rebuild
        changed = ImageSpec(RECIPE.base, RECIPE.steps, user="user", resources=RECIPE.resources)
        await provider.prepare_image(changed)
        assert server.builds == [RECIPE.name, changed.name] and changed.name != RECIPE.name

    asyncio.run(main())
