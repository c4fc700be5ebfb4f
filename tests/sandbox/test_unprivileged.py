"""The owner's side as an unprivileged user (uid 65534, run through setpriv from root): namespace
sandboxes still stop every hostile probe, and nothing of the owner reaches them."""

from __future__ import annotations

import json

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.local import namespaces
from miles_core.testing.sandbox_probes import PROBES, UnprivilegedPython

register_cpu_ci(est_time=9, suite="stage-a-cpu")


@pytest.mark.parametrize("tool", ["unshare", "bwrap"])
def test_no_hostile_probe_gets_through_as_an_unprivileged_owner(unprivileged: UnprivilegedPython, tool: str) -> None:
    if not namespaces.support(tool).available:
        pytest.skip(f"namespaces with {tool} are not available here: {namespaces.support(tool).detail}")
    done = unprivileged.miles(
        "sandbox", "probe", "--json", "-o", "isolation=namespaces", "-o", f"namespace_tool={tool}",
        env={"WANDB_API_KEY": "planted-wandb-key"},
    )  # fmt: skip
    if "is not available on this host" in done.stderr:
        pytest.skip(f"namespaces with {tool} are not available to an unprivileged user here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["user"] == unprivileged.uid and report["setup"]["tool"] == tool
    assert report["claims"] == sorted(PROBES)
    results = {p["name"]: p for p in report["probes"]}
    assert set(results) == set(PROBES)
    escaped = {name: p["evidence"] for name, p in results.items() if p["escaped"] or not p["observed"]}
    assert escaped == {}, escaped


def test_an_unprivileged_owners_sandbox_has_python_and_none_of_its_environment(
    unprivileged: UnprivilegedPython,
) -> None:
    done = unprivileged.miles(
        "sandbox", "run", "--json", "--", "sh", "-c",
        "python -c 'print(6 * 7)'; env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'",
        env={"WANDB_API_KEY": "planted-wandb-key"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"].startswith("42\n"), result
    assert "planted-wandb-key" not in result["stdout"] + result["stderr"]
