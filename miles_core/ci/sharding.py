"""Split a suite's files into shards of near-equal estimated time.

:func:`plan_shards` starts from longest-processing-time-first greedy (LPT: each file, longest
first, goes to the least-loaded shard) and then repeatedly moves one file out of the most loaded
shard, or swaps one of its files for a shorter one elsewhere, while that lowers the pair's
larger load. On suites of up to :data:`EXACT_MAX_FILES` files it then searches for the optimum
(depth-first branch and bound over the files longest first, shards of equal load tried once,
within :data:`EXACT_NODE_BUDGET` nodes), which proves most small plans optimal and finds the
better split where the local moves get stuck. It is deterministic (ties break on file name,
then shard index; the search budget counts nodes, not seconds) and never worse than LPT, which
it starts from and only improves on.

Quality is reported against :func:`lower_bound`: no split can finish before the longest file,
before the average load, or before the two files that must share a shard once there are more
files than shards (rounded up to a whole second when every est_time is one).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

EPSILON = 1e-9
#: suites up to this many files get the exact search
EXACT_MAX_FILES = 40
#: search nodes (one file placed on one shard) before the best plan found so far is returned
EXACT_NODE_BUDGET = 60_000


@dataclass(frozen=True)
class ShardPlan:
    """Files per shard (each longest first) and the load of each shard, in seconds."""

    shards: tuple[tuple[str, ...], ...]
    loads: tuple[float, ...]
    lower_bound: float
    #: proved to have the smallest possible makespan
    optimal: bool = False

    @property
    def makespan(self) -> float:
        return max(self.loads, default=0.0)

    @property
    def ratio(self) -> float:
        """Makespan over the lower bound (1.0 is provably optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0


def lower_bound(times: Sequence[float], shards: int) -> float:
    if not times:
        return 0.0
    ordered = sorted(times, reverse=True)
    bound = max(sum(ordered) / shards, ordered[0])
    if len(ordered) > shards:
        bound = max(bound, ordered[shards - 1] + ordered[shards])
    if all(float(t).is_integer() for t in ordered):
        bound = float(math.ceil(bound - EPSILON))  # a load is a sum of whole seconds
    return bound


def _ordered(items: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("file names must be unique within a plan")
    return sorted(items, key=lambda item: (-item[1], item[0]))


def _lpt(ordered: list[tuple[str, float]], shards: int) -> list[list[tuple[str, float]]]:
    bins: list[list[tuple[str, float]]] = [[] for _ in range(shards)]
    loads = [0.0] * shards
    for item in ordered:
        target = min(range(shards), key=lambda i: (loads[i], i))
        bins[target].append(item)
        loads[target] += item[1]
    return bins


def _best_exchange(
    heavy: list[tuple[str, float]], light: list[tuple[str, float]], gap: float
) -> tuple[float, int, int | None] | None:
    """The move (``light`` index None) or swap from ``heavy`` to ``light`` that best evens a load
    ``gap``: it transfers ``d`` seconds with ``0 < d < gap``, as close to ``gap / 2`` as possible.
    Returns (balance, heavy index, light index) where larger balance is better."""
    best: tuple[float, int, int | None] | None = None
    light_times = [t for _, t in light]  # ascending (light is kept longest-first, so reverse)
    light_times.reverse()
    for h, (_, a) in enumerate(heavy):
        candidates: list[tuple[float, int | None]] = [(a, None)]
        pos = bisect.bisect_left(light_times, a - gap / 2)
        for j in (pos - 1, pos):
            if 0 <= j < len(light_times):
                candidates.append((a - light_times[j], len(light) - 1 - j))
        for d, l_index in candidates:
            if EPSILON < d < gap - EPSILON:
                balance = min(d, gap - d)
                if best is None or balance > best[0] + EPSILON:
                    best = (balance, h, l_index)
    return best


def _improve(bins: list[list[tuple[str, float]]]) -> None:
    shards = len(bins)
    loads = [sum(t for _, t in b) for b in bins]
    for _ in range(20 * sum(len(b) for b in bins) + 1):
        heavy = max(range(shards), key=lambda i: (loads[i], -i))
        choice: tuple[float, int, int, int | None] | None = None
        for other in range(shards):
            gap = loads[heavy] - loads[other]
            if other == heavy or gap <= EPSILON:
                continue
            found = _best_exchange(bins[heavy], bins[other], gap)
            if found and (choice is None or found[0] > choice[0] + EPSILON):
                choice = (found[0], other, found[1], found[2])
        if choice is None:
            return
        _, other, h_index, l_index = choice
        moved = bins[heavy].pop(h_index)
        bins[other].append(moved)
        loads[heavy] -= moved[1]
        loads[other] += moved[1]
        if l_index is not None:
            back = bins[other].pop(l_index)
            bins[heavy].append(back)
            loads[other] -= back[1]
            loads[heavy] += back[1]
        for index in (heavy, other):
            bins[index].sort(key=lambda item: (-item[1], item[0]))


def _exact(
    ordered: list[tuple[str, float]], shards: int, best: float, bound: float
) -> tuple[list[list[tuple[str, float]]] | None, bool]:
    """A split with makespan below ``best``, or None; and whether the search was exhaustive
    (so that None means ``best`` is optimal and a returned split is optimal)."""
    times = [t for _, t in ordered]
    loads = [0.0] * shards
    assignment = [0] * len(times)
    found: list[int] | None = None
    nodes = 0
    limit = best

    def search(i: int) -> bool:
        """False once the budget is spent or the lower bound is reached (stop everything)."""
        nonlocal nodes, found, limit
        if i == len(times):
            found, limit = list(assignment), max(loads)
            return limit > bound + EPSILON
        tried: set[float] = set()
        for j in sorted(range(shards), key=lambda j: (loads[j], j)):
            if loads[j] in tried or loads[j] + times[i] >= limit - EPSILON:
                continue
            tried.add(loads[j])
            nodes += 1
            if nodes > EXACT_NODE_BUDGET:
                return False
            loads[j] += times[i]
            assignment[i] = j
            go_on = search(i + 1)
            loads[j] -= times[i]
            if not go_on:
                return False
        return True

    exhaustive = search(0) or (found is not None and limit <= bound + EPSILON)
    if found is None:
        return None, exhaustive
    bins: list[list[tuple[str, float]]] = [[] for _ in range(shards)]
    for item, j in zip(ordered, found, strict=True):
        bins[j].append(item)
    return bins, exhaustive


def _plan(bins: list[list[tuple[str, float]]], bound: float, optimal: bool = False) -> ShardPlan:
    loads = tuple(sum(t for _, t in b) for b in bins)
    return ShardPlan(
        shards=tuple(tuple(name for name, _ in b) for b in bins),
        loads=loads,
        lower_bound=bound,
        optimal=optimal or max(loads, default=0.0) <= bound + EPSILON,
    )


def greedy_shards(items: Sequence[tuple[str, float]], shards: int) -> ShardPlan:
    """Plain longest-first greedy (the baseline the planner is measured against)."""
    _check_shards(shards)
    ordered = _ordered(items)
    return _plan(_lpt(ordered, shards), lower_bound([t for _, t in ordered], shards))


def plan_shards(items: Sequence[tuple[str, float]], shards: int) -> ShardPlan:
    """Split ``(file, est_time)`` items into ``shards`` shards; see the module docstring."""
    _check_shards(shards)
    ordered = _ordered(items)
    baseline = _lpt(ordered, shards)
    improved = [list(b) for b in baseline]
    _improve(improved)
    bound = lower_bound([t for _, t in ordered], shards)
    greedy, better = _plan(baseline, bound), _plan(improved, bound)
    best = better if better.makespan <= greedy.makespan else greedy
    if best.optimal or len(ordered) > EXACT_MAX_FILES:
        return best
    bins, exhaustive = _exact(ordered, shards, best.makespan, bound)
    if bins is None:
        return replace(best, optimal=exhaustive)
    for b in bins:
        b.sort(key=lambda item: (-item[1], item[0]))
    return _plan(bins, bound, optimal=exhaustive)


def _check_shards(shards: int) -> None:
    if shards < 1:
        raise ValueError(f"the number of shards must be >= 1, got {shards}")
