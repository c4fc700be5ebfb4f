"""The session conformance suite, run against v1 and v2 -- and against deliberately broken
stores, each of which must be caught (negative controls: the suite can fail)."""

from dataclasses import dataclass

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.session.linear import LinearStore
from miles_core.session.trajectory import SampleBatch, assemble_sample
from miles_core.session.tree import TreeStore
from miles_core.session.versions import ConformanceVerified, LinearVersion, TreeVersion
from miles_core.testing.session import CHECKS, ConformanceError, run_check, run_conformance

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("version", [LinearVersion(), TreeVersion()], ids=["v1", "v2"])
def test_builtin_versions_conform(version, check) -> None:
    run_check(version, check)


def test_verify_runs_every_check() -> None:
    assert LinearVersion().verify() == list(CHECKS) == TreeVersion().verify()


# -- negative controls ---------------------------------------------------------------------------


class RollsBackInPlan(LinearStore):
    """Truncates the trajectory while planning, before the request is validated (upstream v1)."""

    def plan(self, request, tokenizer):
        plan = super().plan(request, tokenizer)
        self._head = plan.parent
        return plan


class DropsStaleCommits(LinearStore):
    """Accepts a commit whose plan went stale and silently does not record it."""

    def commit(self, plan, completion, record):
        if plan.revision != self._revision:
            return None
        return super().commit(plan, completion, record)


class TrainsSharedTurnsTwice(TreeStore):
    def samples(self, options):
        from miles_core.session.tree import kept_leaves

        leaves = kept_leaves(tuple(self._turns))
        return SampleBatch([assemble_sample(leaf.chain(), options, set()) for leaf in leaves], None if leaves else "no_records")


class KeepsRetriedRoots(TreeStore):
    def samples(self, options):
        from miles_core.session.trajectory import assemble_samples

        parents = {t.parent.seq for t in self._turns if t.parent}
        return assemble_samples([t for t in self._turns if t.seq not in parents], options)


@dataclass(frozen=True)
class Broken(ConformanceVerified):
    store: type
    name: str = "broken"
    description: str = "a deliberately broken store"
    max_in_flight: int | None = None

    def create_store(self, *, max_turns):
        return self.store(max_turns=max_turns)


@pytest.mark.parametrize(
    ("store", "failing_check"),
    [
        (RollsBackInPlan, "plan_is_pure"),
        (DropsStaleCommits, "commit_never_drops"),
        (TrainsSharedTurnsTwice, "each_completion_trained_once"),
        (KeepsRetriedRoots, "first_turn_retry_yields_one_sample"),
    ],
    ids=lambda p: p if isinstance(p, str) else p.__name__,
)
def test_broken_stores_are_caught(store, failing_check) -> None:
    with pytest.raises(ConformanceError, match=f"fails conformance check '{failing_check}'"):
        run_check(Broken(store), failing_check)
    with pytest.raises(ConformanceError):
        run_conformance(Broken(store))
