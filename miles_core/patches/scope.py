"""The packing scope: forward hooks that :func:`prepare_model` installs on a model's entry points.

A trainer does not always call the model it prepared: RL trainers run the backbone
(``model.model``) and apply ``lm_head`` in chunks, tests call one decoder layer. So the hooks go
on every **entry point** of the prepared model, every module where a packed forward can start:

* the model itself;
* every module whose ``forward`` names a ``position_ids`` parameter and takes ``**kwargs`` (the
  decoder stack, each decoder layer): the packing context reaches the layers below through them;
* every module that reads the packing context (a patch's targets, such as the patched Gated
  DeltaNet layers), which may get ``position_ids`` through its ``**kwargs``;
* every module whose ``forward`` names ``position_ids`` but takes no ``**kwargs`` and contains a
  reader: a packed forward there cannot carry the boundaries down, so it raises.

Modules below that (an attention or MLP block on its own, a rotary embedding) see no packed rows
they could tell apart and are not entry points.

When a hooked forward starts while another prepared forward is running (it was called by one,
or an activation-checkpoint replay brings the context in its captured keyword arguments), the
running forward's context stands and the hook does nothing. Otherwise -- a forward that starts
here -- the pre-hook reads the call's ``position_ids`` and ``attention_mask``, derives the
:class:`~miles_core.patches.packing.PackedSequences` (or ``None``), enforces the rules below,
passes the context down the forward's keyword arguments and makes it current; the after-hook
(``always_call``, so it also runs when the forward raises) closes the scope.

Rules, each a clear :class:`~miles_core.patches.packing.PackingError` instead of silently mixed
documents:

* a packed forward cannot use a cache (``use_cache=True`` or a cache object): transformers drops
  the packed attention mask when a cache is in play;
* a training forward (module in training mode, gradients enabled) cannot ask for
  ``use_cache=True``;
* where either kind of forward leaves ``use_cache`` unset, it is set to ``False`` (the config
  default of these models is ``True``);
* ``cu_seq_lens_q``/``cu_seq_lens_k`` are refused: packed rows are described by ``position_ids``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from miles_core.patches.packing import (
    PACKING_KWARG,
    PackingError,
    enter_model_scope,
    exit_model_scope,
    model_scope_open,
    packed_sequences,
)

_HOOKED = "_miles_packing_scope_hooks"
#: attribute of an entry point: the prepared model it belongs to
_MODEL = "_miles_packing_scope_model"
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
_CACHE_NAMES = ("cache", "past_key_values")


def install_packing_scope(model: torch.nn.Module, readers: Iterable[torch.nn.Module] = ()) -> bool:
    """Install the scope hooks on every entry point of ``model`` (see the module docstring) that
    lacks them; ``readers`` are its modules that read the packing context. Returns whether any
    hooks were newly installed."""
    installed = False
    for module in packing_entry_points(model, readers):
        if not has_packing_scope(module):
            handles = (
                module.register_forward_pre_hook(_enter, with_kwargs=True, prepend=True),
                module.register_forward_hook(_exit, always_call=True),
            )
            setattr(module, _HOOKED, tuple(h.id for h in handles))
            installed = True
        if module is not model:
            object.__setattr__(module, _MODEL, model)  # not a submodule: no cycle in modules()
    return installed


def packing_entry_points(model: torch.nn.Module, readers: Iterable[torch.nn.Module] = ()) -> list[torch.nn.Module]:
    """``model`` and its modules where a packed forward can start (the module docstring's rules)."""
    reader_ids = {id(m) for m in readers}
    contains_reader: dict[int, bool] = {}

    def has_reader(module: torch.nn.Module) -> bool:
        if id(module) not in contains_reader:
            contains_reader[id(module)] = id(module) in reader_ids or any(
                has_reader(child) for child in module.children()
            )
        return contains_reader[id(module)]

    entries = []
    for module in model.modules():
        parameters = _forward_parameters(module)
        names_position_ids = "position_ids" in parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        if (
            module is model
            or (names_position_ids and var_kw)
            or (id(module) in reader_ids and var_kw)
            or (names_position_ids and has_reader(module))
        ):
            entries.append(module)
    return entries


def has_packing_scope(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries both scope hooks (checked on the hooks, not just the flag)."""
    ids = getattr(model, _HOOKED, None)
    if not ids:
        return False
    return ids[0] in model._forward_pre_hooks and ids[1] in model._forward_hooks


def _forward_parameters(module: torch.nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # a forward without a readable signature (a C extension)
        return {}


def _enter(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    model = getattr(module, _MODEL, module)
    if model_scope_open(model):
        return args, kwargs  # inside a forward of its model: that context stands
    if PACKING_KWARG in kwargs:
        # a checkpoint replay (the context it captured), or a caller that built the context itself
        # (a trainer's shared-prompt row, see packed_sequences(branches=...)): it stands, and is current
        enter_model_scope(module, kwargs[PACKING_KWARG], model=model)
        return args, kwargs
    signature = inspect.signature(module.forward)
    params = signature.bind_partial(*args, **kwargs).arguments
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = params.get(var_kw, {}) if var_kw else {}
    given = {**extra, **{k: v for k, v in params.items() if k != var_kw}}

    passed_varlen = [name for name in _VARLEN_KWARGS if given.get(name) is not None]
    if passed_varlen:
        raise PackingError(
            f"{type(module).__name__} got {', '.join(passed_varlen)}: describe packed rows with "
            "position_ids restarting at 0 instead (see docs/patches.md)"
        )
    ctx = packed_sequences(given.get("position_ids"), given.get("attention_mask"))
    training = module.training and torch.is_grad_enabled()
    if ctx is not None or training:
        kind = "a packed forward" if ctx is not None else "a training forward"
        if given.get("use_cache") is True:
            raise PackingError(
                f"{kind} of {type(module).__name__} was called with use_cache=True; pass "
                "use_cache=False (a cache drops the packed attention mask and wastes memory in training)"
            )
        if ctx is not None and any(given.get(name) is not None for name in _CACHE_NAMES):
            raise PackingError(
                f"{kind} of {type(module).__name__} was given a cache; packed rows cannot use one"
            )
        if "use_cache" not in given and ("use_cache" in signature.parameters or var_kw is not None):
            kwargs = {**kwargs, "use_cache": False}
    if ctx is not None:
        if var_kw is None:
            raise PackingError(
                f"{type(module).__name__}.forward takes no **kwargs, so the packing context cannot "
                "reach its layers"
            )
        kwargs = {**kwargs, PACKING_KWARG: ctx}
    enter_model_scope(module, ctx, model=model)
    return args, kwargs


def _exit(module: torch.nn.Module, args: tuple, output: Any) -> None:
    exit_model_scope(module)
