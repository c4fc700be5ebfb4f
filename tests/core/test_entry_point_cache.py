"""The entry-point cache is used while sys.path is unchanged and rescanned when it changes."""

from __future__ import annotations

import json
import os
import sys

import pytest

from miles_core import entry_points as ep_module
from miles_core.ci.register import register_cpu_ci
from miles_core.entry_points import EntryPointInfo, entry_points

register_cpu_ci(est_time=2, suite="stage-a-cpu")

GROUP = "miles.plugins"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MILES_NO_ENTRY_POINT_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def scans(monkeypatch):
    calls: list[str] = []
    real = ep_module._scan

    def counting(group: str) -> list[EntryPointInfo]:
        calls.append(group)
        return real(group)

    monkeypatch.setattr(ep_module, "_scan", counting)
    return calls


def test_second_call_is_served_from_cache(cache_dir, scans) -> None:
    first = entry_points(GROUP)
    second = entry_points(GROUP)
    assert first == second
    assert scans == [GROUP]
    names = {e.name for e in first}
    assert {"miles-rocm", "miles-e2b", "miles-qwen35", "miles-mtp"} <= names


def test_a_changed_path_directory_invalidates(cache_dir, scans, tmp_path, monkeypatch) -> None:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site_dir)])
    entry_points(GROUP)
    (site_dir / "new_dist-1.0.dist-info").mkdir()  # what installing a distribution does
    os.utime(site_dir, ns=(0, os.stat(site_dir).st_mtime_ns + 1_000_000))
    entry_points(GROUP)
    assert scans == [GROUP, GROUP]


def test_a_corrupt_cache_is_rescanned(cache_dir, scans) -> None:
    entry_points(GROUP)
    (cache_file,) = (cache_dir / "entry-points").glob("*.json")
    cache_file.write_text("{not json")
    again = entry_points(GROUP)
    assert scans == [GROUP, GROUP] and again
    assert json.loads(cache_file.read_text())["version"] == ep_module.CACHE_VERSION


def test_cache_can_be_disabled(cache_dir, scans, monkeypatch) -> None:
    monkeypatch.setenv("MILES_NO_ENTRY_POINT_CACHE", "1")
    entry_points(GROUP)
    entry_points(GROUP)
    assert scans == [GROUP, GROUP]
    assert not cache_dir.exists()


def _distribution(site_dir, entry_points: str):
    dist_info = site_dir / "miles_cache_probe-1.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-cache-probe\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(entry_points)
    return dist_info


def test_an_in_place_edit_of_entry_points_txt_invalidates(cache_dir, scans, tmp_path, monkeypatch) -> None:
    group = "miles.cache-probe"
    site_dir = tmp_path / "site"
    dist_info = _distribution(site_dir, f"[{group}]\nfirst = probe.first\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(site_dir)])
    assert [e.name for e in entry_points(group)] == ["first"]
    dirs = {p: os.stat(p).st_mtime_ns for p in (site_dir, dist_info)}
    # what editing the file in place does: no directory changes, only the file's mtime and size
    (dist_info / "entry_points.txt").write_text(f"[{group}]\nfirst = probe.first\nsecond = probe.second\n")
    for path, mtime in dirs.items():
        os.utime(path, ns=(mtime, mtime))
    assert [e.name for e in entry_points(group)] == ["first", "second"]
    assert entry_points(group)[1].value == "probe.second"
    assert scans == [group, group]  # rescanned once for the edit, then served from the cache again


def test_a_distribution_gaining_entry_points_txt_invalidates(cache_dir, scans, tmp_path, monkeypatch) -> None:
    group = "miles.cache-probe"
    site_dir = tmp_path / "site"
    dist_info = _distribution(site_dir, "")
    (dist_info / "entry_points.txt").unlink()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site_dir)])
    assert entry_points(group) == []
    mtimes = {p: os.stat(p).st_mtime_ns for p in (site_dir, dist_info)}
    (dist_info / "entry_points.txt").write_text(f"[{group}]\nlate = probe.late\n")
    for path, mtime in mtimes.items():
        os.utime(path, ns=(mtime, mtime))
    assert [e.name for e in entry_points(group)] == ["late"]


def test_an_unrelated_file_in_a_path_directory_keeps_the_cache(cache_dir, scans, tmp_path, monkeypatch) -> None:
    # `python -m miles_core` from a working directory puts it on sys.path, and runs write there
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    monkeypatch.setattr(sys, "path", [str(work_dir), *sys.path])
    entry_points(GROUP)
    (work_dir / "runs").mkdir()
    (work_dir / "notes.txt").write_text("not a distribution")
    os.utime(work_dir, ns=(0, os.stat(work_dir).st_mtime_ns + 1_000_000))
    entry_points(GROUP)
    assert scans == [GROUP]


def test_a_new_distribution_without_entry_points_invalidates(cache_dir, scans, tmp_path, monkeypatch) -> None:
    # it holds no entry points, but a distribution of its name later on sys.path is now hidden
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    monkeypatch.setattr(sys, "path", [str(site_dir), *sys.path])
    entry_points(GROUP)
    dist_info = site_dir / "miles_rocm-9.9.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-rocm\nVersion: 9.9\n")
    rescanned = entry_points(GROUP)
    assert scans == [GROUP, GROUP]
    assert "miles-rocm" not in {e.distribution for e in rescanned}  # what importlib.metadata says, cached
    assert entry_points(GROUP) == rescanned and scans == [GROUP, GROUP]


def test_two_sys_paths_keep_a_cache_each(cache_dir, scans, tmp_path, monkeypatch) -> None:
    # `miles` (its bin directory first) and `python -m miles_core` (the working directory first)
    first, second = tmp_path / "bin", tmp_path / "work"
    first.mkdir()
    second.mkdir()
    base = list(sys.path)
    for _ in range(2):
        for front in (first, second):
            monkeypatch.setattr(sys, "path", [str(front), *base])
            entry_points(GROUP)
    assert scans == [GROUP, GROUP]  # one scan per sys.path, then each is served from its cache
    assert len(list((cache_dir / "entry-points").glob("*.json"))) == 2
