"""Secret references: resolved where used, hidden from reprs, pickles, errors and logs."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.sandbox.errors import SandboxFatalError
from miles_core.sandbox.secrets import SecretRef, get_logger, redact

register_cpu_ci(est_time=2, suite="stage-a-cpu")

PLANTED = "e2b_0123456789abcdef0123456789abcdef01234567"


def test_references_parse_and_never_take_a_value() -> None:
    assert SecretRef.parse("env:E2B_API_KEY") == SecretRef.env("E2B_API_KEY")
    assert SecretRef.parse("file:/run/key") == SecretRef.file("/run/key")
    assert SecretRef.parse("~/.config/e2b/api_key").kind == "file"
    with pytest.raises(ConfigError) as raised:
        SecretRef.parse(PLANTED, field="api_key")
    assert PLANTED not in str(raised.value) and "api_key" in str(raised.value)
    with pytest.raises(ConfigError, match="not a variable name"):
        SecretRef.env("NOT-A-NAME")


def test_resolve_reads_the_worker_side_and_hides_the_value(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(PLANTED + "\n")
    ref = SecretRef.file(key_file)
    secret = ref.resolve()
    assert secret.reveal() == PLANTED
    assert PLANTED not in repr(secret) and PLANTED not in str(secret) and str(key_file) in repr(secret)
    assert str(ref) == f"file:{key_file}"  # what may travel to workers
    with pytest.raises(TypeError) as raised:
        pickle.dumps(secret)
    assert PLANTED not in str(raised.value)
    assert SecretRef.env("MILES_TEST_KEY").resolve({"MILES_TEST_KEY": PLANTED}).reveal() == PLANTED


@pytest.mark.parametrize("content", ["", "  \n"])
def test_empty_or_missing_secrets_fail_naming_the_reference(tmp_path: Path, content: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(content)
    with pytest.raises(ConfigError, match="is empty"):
        SecretRef.file(key_file).resolve()
    with pytest.raises(ConfigError, match="does not exist"):
        SecretRef.file(tmp_path / "absent").resolve()
    with pytest.raises(ConfigError, match="MILES_ABSENT_KEY is unset"):
        SecretRef.env("MILES_ABSENT_KEY").resolve({})


def test_resolved_values_are_redacted_from_errors_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    SecretRef.env("K").resolve({"K": PLANTED})
    assert redact(f"header X-API-Key: {PLANTED}") == "header X-API-Key: ***"
    error = SandboxFatalError(f"401 for key {PLANTED}", provider="x")
    assert PLANTED not in str(error) and "***" in str(error)
    log = get_logger("miles_core.sandbox.test")
    with caplog.at_level(logging.DEBUG, logger="miles_core.sandbox.test"):
        log.warning("calling with %s", PLANTED)
    assert caplog.records and PLANTED not in caplog.text and "***" in caplog.text
