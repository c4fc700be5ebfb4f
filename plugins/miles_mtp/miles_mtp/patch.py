"""The ``mtp-labels`` model patch: every MTP model of the built model trains on the contract.

Imported at plugin discovery: no torch or megatron at the top. Activation, in the terms of
:mod:`miles_core.patches.base`:

* ``check_environment()`` probes every model path of the installed megatron-core; a path that
  trains MTP depths in a way no adapter can make correct is a registration error;
* ``apply(model)`` installs, on every megatron module of the model with MTP layers, the adapter
  for its class's observed convention;
* ``verify(model)`` feeds canonical batches through each installed adapter into its class's real
  ``forward`` and asserts the invariant of :mod:`miles_mtp.contract` (packed, padded rows, and a
  simulated 2-way context-parallel split);
* ``probe(model)`` runs a real forward of the model itself and checks what its depths train on.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.patches.base import AppliedPatch, ProbeResult

#: module prefix of every model class this patch can target
MEGATRON = "megatron.core"


def mtp_modules(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every megatron model path module of ``model`` that has MTP layers.

    A model holding megatron modules has imported megatron, so nothing is imported here.
    """
    if MEGATRON not in sys.modules:
        return []
    from miles_mtp.conventions import path_for

    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(getattr(module, "config", None), "mtp_num_layers", None) and path_for(type(module))
    ]


class MTPLabelPatch:
    """Installs and verifies one label adapter per MTP model path of the built model."""

    name = "mtp-labels"
    uses_packing_context = False
    requires = ()

    def matches(self, config: Any) -> bool:
        return type(config).__module__.startswith(MEGATRON) and bool(getattr(config, "mtp_num_layers", None))

    def check_environment(self) -> list[str]:
        from miles_mtp.probe import installed_conventions

        return [problem for _, problem in installed_conventions().values() if problem]

    def targets(self, model: Any) -> list[type]:
        return list(dict.fromkeys(type(module) for _, module in mtp_modules(model)))

    def apply(self, model: Any) -> AppliedPatch:
        from miles_core.patches.base import AppliedPatch, PatchError, qualname
        from miles_mtp.adapter import LabelAdapter, install
        from miles_mtp.probe import convention_of

        groups: dict[str, list[str]] = {}
        for _, module in mtp_modules(model):
            cls: type = type(module)
            convention = convention_of(cls)
            if convention is None:
                raise PatchError(
                    f"{qualname(cls)} has {module.config.mtp_num_layers} MTP layer(s) but takes "
                    "MTP labels through none of the interfaces its path is probed with"
                )
            install(module, LabelAdapter(convention))
            names = groups.setdefault(convention.interface.name, [])
            if qualname(cls) not in names:
                names.append(qualname(cls))
        classes = tuple(c for names in groups.values() for c in names)
        return AppliedPatch(classes=classes, groups={k: tuple(v) for k, v in groups.items()})

    def verify(self, model: Any) -> None:
        from miles_core.patches.base import PatchVerificationError, qualname
        from miles_mtp.adapter import installed_adapter
        from miles_mtp.contract import LabelContractError
        from miles_mtp.probe import convention_of
        from miles_mtp.verification import verify_adapter

        problems = []
        for name, module in mtp_modules(model):
            cls: type = type(module)
            where = f"{qualname(cls)} at {name or '<root>'}"
            adapter = installed_adapter(module)
            if adapter is None:
                problems.append(f"{where}: forward carries no MTP label adapter")
                continue
            try:
                convention = convention_of(cls)
                if convention is None:
                    raise LabelContractError("its class takes MTP labels through no known interface")
                verify_adapter(cls, convention, adapter, module.config.mtp_num_layers, module.config)
            except LabelContractError as exc:
                problems.append(f"{where}: {exc}")
        if problems:
            raise PatchVerificationError(self.name, problems)

    def probe(self, model: Any) -> ProbeResult:
        from miles_core.patches.base import PatchError, ProbeResult, qualname
        from miles_mtp.verification import check_model

        problems = []
        for name, module in mtp_modules(model):
            if not (getattr(module, "pre_process", True) and getattr(module, "post_process", True)):
                raise PatchError(
                    f"{qualname(type(module))} at {name or '<root>'} holds one pipeline stage and cannot "
                    "run a forward on its own: prepare it with probe=False (verify() still runs)"
                )
            vocab = module.vocab_size if hasattr(module, "vocab_size") else module.config.padded_vocab_size
            problems += [f"{name or '<root>'}: {p}" for p in check_model(module, vocab)]
        return ProbeResult(
            passed=not problems,
            max_abs_diff=float(len(problems)),
            tolerance=0.0,
            detail="; ".join(problems)
            or "a real forward trains every depth k on tokens[i+k+1], masked per document",
        )
