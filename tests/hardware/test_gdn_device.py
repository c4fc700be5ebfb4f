"""GDN self-check models go to the GPU exactly when fla is installed and a GPU is visible."""

import importlib.util

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware import gdn

register_cpu_ci(est_time=4, suite="stage-a-cpu")


@pytest.mark.parametrize(("cuda", "fla", "expected"), [
    (False, False, "cpu"), (False, True, "cpu"), (True, False, "cpu"), (True, True, "cuda"),
])
def test_gdn_model_device(monkeypatch, cuda, fla, expected):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "fla" and fla else (None if name == "fla" else real_find_spec(name, *a)))
    assert gdn.gdn_model_device() == expected
