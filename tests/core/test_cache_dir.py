"""One cache root for everything miles builds once: presets, the tiny tokenizer, the entry-point scan."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core import entry_points
from miles_core.cache_dir import cache_root
from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.delenv("MILES_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_setting_then_xdg_then_the_home_directory(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_root() == str(tmp_path / "home" / ".cache" / "miles")
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "miles")
    env.setenv("MILES_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == str(tmp_path / "mine")


def test_the_tokenizer_and_the_entry_point_scan_share_it(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the tiny tokenizer needs the train extra")
    from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir

    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "miles"
    assert tiny_tokenizer_dir().parent == root
    assert Path(entry_points._cache_file("miles.plugins")).parent.parent == root
