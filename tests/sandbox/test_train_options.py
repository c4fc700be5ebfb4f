"""Provider options in `miles train`'s `[reward]` are checked against the installed provider
when the config is built: before any model, engine or sandbox starts."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.config import load_config
from miles_core.rl.sandboxes import tool_sandbox_settings

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_local_options_reach_the_config_and_the_tools_inherit_them() -> None:
    config = load_config("tiny", overrides=['reward.sandbox_options.isolation="process"', "reward.sandbox_options.tmpfs_mb=64"])
    assert config.reward.sandbox_options == {"isolation": "process", "tmpfs_mb": 64}
    assert tool_sandbox_settings(config.reward) == ("local", {"isolation": "process", "tmpfs_mb": 64})
    own = load_config("tiny", overrides=['reward.tool_sandbox_options.isolation="namespaces"'])
    assert tool_sandbox_settings(own.reward) == ("local", {"isolation": "namespaces"})


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ('reward.sandbox_options.isolation="vm"', "reward.sandbox_options: local provider option isolation"),
        ("reward.sandbox_options.nosuch=1", "reward.sandbox_options: sandbox provider 'local': unknown option(s) nosuch"),
        ('reward.sandbox_provider="nope"', "reward.sandbox_options: no sandbox named 'nope'"),
        ('reward.tool_sandbox_options.namespace_tool="docker"', "reward.tool_sandbox_options: local provider option namespace_tool"),
        ("reward.sandbox_options.tmpfs_mb=[1]", "reward.sandbox_options.tmpfs_mb"),
    ],
)
def test_bad_options_name_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config("tiny", overrides=[override])
    assert needle in str(raised.value)
