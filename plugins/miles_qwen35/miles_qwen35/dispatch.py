"""How a Gated DeltaNet class is patched.

transformers' GDN ``forward`` calls two module-level kernels, ``causal_conv1d_fn`` and
``torch_chunk_gated_delta_rule``, either itself or through a function of its module (from 5.25 the
convolution goes through ``causal_conv1d_forward``, which handles the cache and then calls
``causal_conv1d_fn``). Both are looked up in the module's globals at call time. Patching a class:

* replaces those two names in the modeling module with dispatchers that call the original kernel
  unchanged, except while a *packed* forward of a patched layer runs (a :mod:`contextvars` flag),
  when they call the variable-length kernels (fla on CUDA when importable, pure torch otherwise);
* wraps the class's ``forward``: it takes the packing context from the forward's keyword
  arguments (where the model-level scope put it, and where activation-checkpoint replays find it
  again), sets the flag for the duration of the original forward, and afterwards checks that both
  kernels were really called, so a transformers release that reroutes them fails loudly instead
  of mixing documents.

Patching a class changes it for the whole process, so a layer only takes the packed path once
``prepare_model`` has enabled it (:func:`enable_layer`): a model built or prepared without this
plugin keeps transformers' behaviour even after another model was prepared with it. Unpacked
forwards (no context) run the original forward with the original kernels, bit for bit, except
that CPU tensors skip the fla kernels transformers binds whenever fla imports (Triton cannot read
them) and go to transformers' torch implementation at the bottom of its wrappers.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.patches.base import qualname
from miles_core.patches.hf_functions import defined_function, global_names_reached
from miles_core.patches.packing import (
    PACKING_KWARG,
    PackedSequences,
    PackingError,
    current_packed_sequences,
    model_scope_open,
)
from miles_qwen35 import fla_varlen, torch_varlen

CONV = "causal_conv1d_fn"
CHUNK = "torch_chunk_gated_delta_rule"
KERNELS = (CONV, CHUNK)
#: attribute of a patched ``forward``: the original it wraps
FORWARD_MARK = "__miles_gdn_packing__"
#: attribute of a dispatcher: the original kernel it wraps
KERNEL_MARK = "__miles_gdn_kernel__"
#: attribute of a layer instance that prepare_model enabled for packed forwards
LAYER_FLAG = "_miles_gdn_packing_enabled"


def _fla_path(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_varlen.fla_available()


def supports_branches(layer: torch.nn.Module) -> bool:
    """Whether a layer runs rows with shared prompts (``PackedSequences.branches``) where it lives:
    an enabled layer on the pure-torch kernels does; the fla path has no tree kernels yet and
    refuses them. Installed on every patched class as its ``supports_branches()`` method, which
    trainers ask before laying out shared-prompt rows."""
    return layer_enabled(layer) and not _fla_path(next(layer.parameters()))


@dataclass
class _PackedCall:
    """One packed forward of one GDN layer: the context and which kernels it went through."""

    ctx: PackedSequences
    called: set[str] = field(default_factory=set)

    def _refuse_fla_branches(self, x: torch.Tensor) -> None:
        if self.ctx.branches is not None and _fla_path(x):
            raise PackingError("fla's kernels cannot run a row whose responses share one prompt copy (branches)")

    def conv(self, reference: Callable[..., Any], x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, activation: str | None = None, **_: Any) -> torch.Tensor:
        self.called.add(CONV)
        self._refuse_fla_branches(x)
        if _fla_path(x):
            return fla_varlen.causal_conv1d(x, weight, bias, activation, self.ctx)
        if self.ctx.branches is not None:
            return torch_varlen.causal_conv1d_branched(x, weight, bias, activation, self.ctx)
        return torch_varlen.causal_conv1d(x, weight, bias, activation, self.ctx.seq_idx)

    def chunk(self, reference: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
        self.called.add(CHUNK)
        if initial_state is not None or output_final_state:
            raise PackingError("a packed Gated DeltaNet forward cannot read or write a cache")
        if cu_seqlens is not None:
            raise PackingError("cu_seqlens passed to a packed forward: boundaries come from position_ids")
        self._refuse_fla_branches(query)
        if self.ctx.branches is not None:
            out = torch_varlen.chunk_gated_delta_rule_branched(
                query, key, value, g, beta, self.ctx, reference,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
            )
        elif _fla_path(query):
            out = fla_varlen.chunk_gated_delta_rule(
                query, key, value, g, beta, self.ctx, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
            )
        else:
            out = torch_varlen.chunk_gated_delta_rule(
                query, key, value, g, beta, self.ctx.seq_idx,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
            )
        return out, None


_ACTIVE: contextvars.ContextVar[_PackedCall | None] = contextvars.ContextVar("miles_gdn_packed_call", default=None)


def _reference_can_run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An unpacked call on CPU tensors. Boundaries passed by transformers itself stay with the
    original, which refuses them without fla (its torch implementation would ignore them)."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
        return False
    first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    return not first.is_cuda


def _dispatcher(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    route = _PackedCall.conv if name == CONV else _PackedCall.chunk

    # transformers binds the name to fla's Triton kernel whenever fla imports, whatever the device;
    # the function its modeling file defines, beneath the wrappers, is its own torch implementation
    # (where the binding hides no function of that name, the bottom of its __wrapped__ chain).
    reference = defined_function(original, name) or inspect.unwrap(original)

    @functools.wraps(original)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        call = _ACTIVE.get()
        if call is not None:
            return route(call, reference, *args, **kwargs)
        if reference is not original and _reference_can_run(args, kwargs):
            return reference(*args, **kwargs)  # Triton kernels cannot take CPU tensors
        return original(*args, **kwargs)

    setattr(kernel, KERNEL_MARK, original)
    return kernel


def _packing_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.pop(PACKING_KWARG, None)
        if not layer_enabled(self):
            return original(self, *args, **kwargs)
        if model_scope_open() and current_packed_sequences() is not ctx:
            raise PackingError(
                f"{qualname(type(self))}: this forward's packing context did not reach the layer "
                "(a caller between the model and the layer dropped its **kwargs)"
            )
        if ctx is None:
            return original(self, *args, **kwargs)
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if tuple(hidden_states.shape[:2]) != (ctx.batch_size, ctx.seq_len):
            raise PackingError(
                f"{qualname(type(self))} got hidden states of shape {tuple(hidden_states.shape)} but the "
                f"packed batch is {ctx.batch_size} x {ctx.seq_len}"
            )
        cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
        if cache is not None:
            raise PackingError(f"{qualname(type(self))}: a packed forward cannot use a cache")
        call = _PackedCall(ctx)
        token = _ACTIVE.set(call)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        skipped = [name for name in KERNELS if name not in call.called]
        if skipped:
            raise PackingError(
                f"{qualname(type(self))}.forward ran a packed batch without calling {', '.join(skipped)}: "
                "transformers changed how this layer calls its kernels, and documents would mix"
            )
        return out

    setattr(forward, FORWARD_MARK, original)
    return forward


def forward_owner(cls: type) -> type:
    """The class in ``cls``'s MRO that defines the ``forward`` it runs."""
    return next(c for c in cls.__mro__ if "forward" in c.__dict__)


def _kernel_globals(forward: Callable[..., Any]) -> dict[str, Any]:
    return inspect.unwrap(forward).__globals__


def unpatchable_reason(cls: type) -> str | None:
    """Why ``cls`` (a class defining ``forward``) cannot be patched, or ``None``."""
    forward = cls.__dict__["forward"]
    if is_patched(cls):
        return None
    reached = global_names_reached(inspect.unwrap(forward))
    not_called = [name for name in KERNELS if name not in reached]
    if not_called:
        return f"{qualname(cls)}.forward does not call {', '.join(not_called)} (itself or through its module's functions)"
    not_bound = [name for name in KERNELS if not callable(_kernel_globals(forward).get(name))]
    if not_bound:
        return f"{cls.__module__} defines no callable {', '.join(not_bound)}"
    return None


def is_patched(cls: type) -> bool:
    return getattr(cls.__dict__.get("forward"), FORWARD_MARK, None) is not None


def patch_class(cls: type[torch.nn.Module]) -> None:
    """Patch ``cls`` (which must define ``forward``, see :func:`unpatchable_reason`); idempotent."""
    if is_patched(cls):
        return
    reason = unpatchable_reason(cls)
    if reason:
        raise PackingError(reason)
    forward = cls.__dict__["forward"]
    kernel_globals = _kernel_globals(forward)
    for name in KERNELS:
        if getattr(kernel_globals[name], KERNEL_MARK, None) is None:
            kernel_globals[name] = _dispatcher(name, kernel_globals[name])
    cls.forward = _packing_forward(forward)
    cls.supports_branches = supports_branches  # type: ignore[attr-defined]  # the patch adds the method


def enable_layer(layer: torch.nn.Module) -> None:
    """Let ``layer`` (an instance of a patched class) take the packed path."""
    setattr(layer, LAYER_FLAG, True)


def layer_enabled(layer: torch.nn.Module) -> bool:
    return getattr(layer, LAYER_FLAG, False) is True


def patch_problems(cls: type[torch.nn.Module]) -> list[str]:
    """What is wrong with the patch as ``cls`` (a class of the built model) runs it."""
    forward = cls.forward
    original = getattr(forward, FORWARD_MARK, None)
    if original is None:
        owner = forward_owner(cls)
        return [f"{qualname(cls)} escaped patching: it runs {qualname(owner)}.forward, which is not packing-aware"]
    kernel_globals = _kernel_globals(original)
    return [
        f"{qualname(cls)}: {inspect.unwrap(original).__module__}.{name} is no longer the packing dispatcher"
        for name in KERNELS
        if getattr(kernel_globals.get(name), KERNEL_MARK, None) is None
    ]
