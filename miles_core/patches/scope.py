"""The model-level packing scope: forward hooks that :func:`prepare_model` installs on a model.

Before every forward the pre-hook reads the call's ``position_ids`` and ``attention_mask``,
derives the :class:`~miles_core.patches.packing.PackedSequences` (or ``None``), enforces the rules
below, passes the context down the forward's keyword arguments and makes it current; the
after-hook (``always_call``, so it also runs when the forward raises) closes the scope.

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
from typing import Any

import torch

from miles_core.patches.packing import (
    PACKING_KWARG,
    PackingError,
    enter_model_scope,
    exit_model_scope,
    packed_sequences,
)

_HOOKED = "_miles_packing_scope_hooks"
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
_CACHE_NAMES = ("cache", "past_key_values")


def install_packing_scope(model: torch.nn.Module) -> bool:
    """Install the scope hooks on ``model`` (once); returns whether they were newly installed."""
    if has_packing_scope(model):
        return False
    handles = (
        model.register_forward_pre_hook(_enter, with_kwargs=True, prepend=True),
        model.register_forward_hook(_exit, always_call=True),
    )
    setattr(model, _HOOKED, tuple(h.id for h in handles))
    return True


def has_packing_scope(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries both scope hooks (checked on the hooks, not just the flag)."""
    ids = getattr(model, _HOOKED, None)
    return bool(ids) and ids[0] in model._forward_pre_hooks and ids[1] in model._forward_hooks


def _enter(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
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
    enter_model_scope(module, ctx)
    return args, kwargs


def _exit(module: torch.nn.Module, args: tuple, output: Any) -> None:
    exit_model_scope(module)
