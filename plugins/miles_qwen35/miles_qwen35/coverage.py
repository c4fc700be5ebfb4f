"""Which Gated DeltaNet architectures the installed transformers ships, and what this plugin does
with each.

An architecture is a ``transformers/models/<name>/`` directory whose modeling file uses the gated
delta rule. Each one found is

* ``supported`` -- listed in :data:`SUPPORTED`: its GDN classes are patched, and this plugin's
  tests check packed against per-document logits and gradients for it;
* ``unsupported`` -- listed in :data:`UNSUPPORTED` with the reason: preparing such a model fails
  (packed training would mix documents), every other model is unaffected;
* ``unknown`` -- anything else (a new transformers release): a registration error, so nobody
  trains it packed believing it patched.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles_core.patches.hf_functions import global_names_reached
from miles_qwen35.dispatch import CHUNK, unpatchable_reason

#: transformers model directories whose GDN layers this plugin patches and tests
SUPPORTED = ("lara_mini", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_next")
#: GDN architectures this plugin knowingly does not make packing-safe, and why
UNSUPPORTED = {
    "qwen4_exp": (
        "its per-layer-embedding block (Qwen4ExpTextPLELayer) runs a second causal short convolution "
        "that also reads across packed documents, which this plugin does not patch"
    ),
}

Status = Literal["supported", "unsupported", "unknown"]


@dataclass(frozen=True)
class Architecture:
    name: str
    module: str
    status: Status
    reason: str = ""


def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


@functools.cache
def gdn_architectures() -> tuple[Architecture, ...]:
    """Every GDN architecture of the installed transformers (found by reading, not importing)."""
    models = _models_dir()
    if models is None:
        return ()
    found = []
    for directory in sorted(p for p in models.iterdir() if p.is_dir()):
        modeling = directory / f"modeling_{directory.name}.py"
        if not modeling.is_file() or b"chunk_gated_delta_rule" not in modeling.read_bytes():
            continue
        name = directory.name
        module = f"transformers.models.{name}.modeling_{name}"
        if name in SUPPORTED:
            found.append(Architecture(name, module, "supported"))
        elif name in UNSUPPORTED:
            found.append(Architecture(name, module, "unsupported", UNSUPPORTED[name]))
        else:
            found.append(
                Architecture(name, module, "unknown", "not covered by this miles-qwen35 release")
            )
    return tuple(found)


def architecture_of(cls: type) -> Architecture | None:
    """The GDN architecture whose modeling module defines ``cls``."""
    return next((a for a in gdn_architectures() if a.module == cls.__module__), None)


def gdn_classes(arch: Architecture) -> list[type]:
    """The classes of ``arch``'s modeling module whose ``forward`` runs the gated delta rule."""
    module = importlib.import_module(arch.module)
    return [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and obj.__module__ == module.__name__
        and "forward" in obj.__dict__
        and CHUNK in global_names_reached(inspect.unwrap(obj.__dict__["forward"]))
    ]


def environment_problems() -> list[str]:
    """Registration errors: unknown GDN architectures, supported ones that cannot be patched."""
    problems = []
    for arch in gdn_architectures():
        if arch.status == "unknown":
            problems.append(
                f"transformers ships the Gated DeltaNet architecture {arch.name!r} ({arch.module}), which "
                "this miles-qwen35 release neither patches nor declares unsupported; packed training of "
                "it would mix documents. Upgrade miles-qwen35 or pin transformers."
            )
        elif arch.status == "supported":
            classes = gdn_classes(arch)
            if not classes:
                problems.append(f"{arch.module} no longer defines a class that runs {CHUNK}")
            problems.extend(r for r in map(unpatchable_reason, classes) if r)
    return problems
