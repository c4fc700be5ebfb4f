"""Reading a modeling module's functions beneath the objects transformers binds their names to."""

from __future__ import annotations

import importlib.util
import textwrap
import types

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.patches.hf_functions import defined_function, global_names_reached

register_cpu_ci(est_time=2, suite="stage-a-cpu")

#: the shapes transformers gives its kernel functions: a functools.wraps fallback wrapper, and
#: (with `kernels` importable) an instance whose class's forward closes over the function
MODELING = """
import functools


def fallback(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapped


def function_module(fn):
    class Func:
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)
    return Func()


@function_module
@fallback
def conv_kernel(x):
    return x + 1


@function_module
def conv_forward(x, cache):
    if cache is not None:
        return x
    return conv_kernel(x)


def chunk_kernel(x):
    return x * 2


def forward_direct(x):
    return chunk_kernel(conv_kernel(x))


def forward_through_helper(x):
    return chunk_kernel(conv_forward(x, None))


def level_3(x):
    return conv_kernel(x)


def level_2(x):
    return level_3(x)


def level_1(x):
    return level_2(x)
"""


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), module.__dict__)
    return module


def test_the_function_beneath_a_fallback_wrapper_and_a_function_module() -> None:
    modeling = _module("modeling_toy", MODELING)
    assert not isinstance(modeling.conv_kernel, types.FunctionType)  # an instance, as with `kernels`
    kernel = defined_function(modeling.conv_kernel, "conv_kernel")
    assert kernel is not None and kernel.__code__.co_name == "conv_kernel" and kernel.__globals__ is vars(modeling)
    assert kernel(1) == 2
    assert defined_function(modeling.chunk_kernel, "chunk_kernel") is modeling.chunk_kernel  # a plain function
    # nothing of that name beneath it, or nothing to look beneath
    assert defined_function(modeling.conv_kernel, "chunk_kernel") is None
    assert defined_function(None, "conv_kernel") is None
    assert defined_function(3, "conv_kernel") is None


def test_names_are_reached_directly_or_through_the_modules_own_functions() -> None:
    modeling = _module("modeling_toy", MODELING)
    assert {"conv_kernel", "chunk_kernel"} <= global_names_reached(modeling.forward_direct)
    through = global_names_reached(modeling.forward_through_helper)
    assert {"conv_forward", "conv_kernel", "chunk_kernel"} <= through
    assert "conv_kernel" not in global_names_reached(modeling.chunk_kernel)
    assert "conv_kernel" in global_names_reached(modeling.level_1)
    assert "conv_kernel" not in global_names_reached(modeling.level_1, depth=1)  # level_3 is two calls deeper


def test_a_function_of_another_module_is_not_followed() -> None:
    other = _module("other_toy", "def helper(x):\n    return conv_kernel(x)\n")
    modeling = _module("modeling_toy", "def forward(x):\n    return helper(x)\n")
    modeling.helper = other.helper  # imported from elsewhere: its calls are not this module's
    reached = global_names_reached(modeling.forward)
    assert "helper" in reached and "conv_kernel" not in reached


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="the kernels package is not installed")
def test_the_function_beneath_a_real_kernels_function_module() -> None:
    from kernels import use_kernel_forward_from_hub

    modeling = _module("modeling_toy", MODELING)
    bound = use_kernel_forward_from_hub("toy_kernel")(modeling.chunk_kernel)
    assert bound is not modeling.chunk_kernel and not isinstance(bound, types.FunctionType)
    assert defined_function(bound, "chunk_kernel") is modeling.chunk_kernel
