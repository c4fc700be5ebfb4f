"""Model runners: what the engine loop calls to prefill prompts and decode a step.

A runner owns the per-row model state of every sequence. Rows ``[0, max_slots)`` are decode rows,
kept compact by the engine (a decode step runs rows ``[0, n)``); rows ``[max_slots, rows)`` are
staging rows for prompts whose prefill spans several chunks (``staging == 0``: whole prompts only).

* :class:`LeanRunner`: the engine's own forward (:mod:`miles_core.engine.lean_model`) over
  preallocated slot tensors (:mod:`miles_core.engine.state`), chunked prefill, and on CUDA the
  decode step replayed from CUDA graphs (:mod:`miles_core.engine.cuda_graphs`).
* :class:`HFRunner`: the model's own Hugging Face modules over :class:`~miles_core.engine.slot_cache.StepCache`,
  for architectures without a lean forward (and as a reference).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from miles_core.engine.lean_model import LeanModel, unsupported_reason
from miles_core.engine.slot_cache import SlotStore, StepCache
from miles_core.engine.state import SlotState
from miles_core.errors import ConfigError

RUNNERS = ("auto", "lean", "hf")
#: storage dtypes of the lean runner's GDN recurrent states (``EngineConfig.gdn_state_dtype``)
GDN_STATE_DTYPES = ("float32", "bfloat16")


class Runner(Protocol):
    """Rows of slot state and the model steps over them. Every method that touches the state runs
    in inference mode, whoever calls it (the engine's loop already does): autograd recording the
    state's in-place writes would chain every call's activations to a state that outlives them (a
    loop of prefills and steps driven from outside grew by ~270 live tensors a round), and a state
    regrown inside inference mode cannot be written outside it."""

    name: str
    max_slots: int
    staging: int
    rows: int
    lengths: list[int]  # tokens stored per row (host)

    def reset_rows(self, rows: list[int]) -> None: ...

    def prefill(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Run ``chunks[i]`` into row ``rows[i]`` from position ``starts[i]``; fp32 logits ``[S, vocab]``
        at each chunk's last token."""

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """One token per row of ``[0, len(ids))``; fp32 logits ``[n, vocab]``."""

    def copy_rows(self, sources: list[int], targets: list[int]) -> None: ...

    def clear_lengths(self, rows: range) -> None: ...

    def describe(self) -> dict[str, Any]: ...


def build_runner(model: Any, *, kind: str, max_slots: int, max_model_len: int, cuda_graphs: bool,
                 compile_decode: bool | None = None, gdn_state_dtype: str = "float32") -> Runner:
    """The runner ``kind`` asks for (``auto``: lean when the architecture has a lean forward)."""
    if kind not in RUNNERS:
        raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}; got {kind!r}")
    reason = unsupported_reason(model)
    if kind == "lean" and reason:
        raise ConfigError(f"runner 'lean' cannot run this model: {reason}")
    if kind == "hf" or reason:
        return HFRunner(model, max_slots=max_slots, max_model_len=max_model_len, fallback_reason=reason)
    return LeanRunner(model, max_slots=max_slots, max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                      compile_decode=compile_decode, gdn_state_dtype=getattr(torch, gdn_state_dtype))


class LeanRunner:
    name = "lean"

    def __init__(self, model: Any, *, max_slots: int, max_model_len: int, cuda_graphs: bool,
                 compile_decode: bool | None = None, staging: int = 2,
                 gdn_state_dtype: torch.dtype = torch.float32) -> None:
        self.model = LeanModel(model, max_model_len=max_model_len, max_rows=max_slots + staging)
        self.max_slots = max_slots
        self.staging = staging
        self.state = SlotState(
            self.model.state_shapes(), max_slots=max_slots, staging=staging, max_model_len=max_model_len,
            dtype=self.model.dtype, device=self.model.device, keys_transposed=not self.model.sdpa,
            recurrent_dtype=gdn_state_dtype,
        )
        self.rows = self.state.rows
        self.lengths = self.state.host_lengths
        # where the backend claims device graphs (CUDA, ROCm): decode steps padded to graph buckets,
        # replayed unless cuda_graphs=False
        # and (unless compile_decode=False) the step's regions compiled, on buckets of >= 2 rows
        self.graphs = None
        self.compiled = False
        from miles_core.hardware.devices import graph_runtime

        runtime = graph_runtime(self.model.device)
        if runtime is not None:
            from miles_core.engine.cuda_graphs import DecodeGraphs

            available = _inductor_available()
            if compile_decode and not available:
                raise ConfigError("compile_decode=true needs triton (torch.compile's GPU backend), which does not import here")
            self.compiled = available if compile_decode is None else compile_decode
            if self.compiled:
                self.model.compile_decode()
            self.graphs = DecodeGraphs(self.model.decode, self.state, runtime, capture=cuda_graphs,
                                       min_rows=2 if self.compiled else 1)

    @torch.inference_mode()
    def reset_rows(self, rows: list[int]) -> None:
        self.state.reset_rows(rows)

    @torch.inference_mode()
    def prefill(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        self.state.ensure_capacity(max(s + len(c) for s, c in zip(starts, chunks)))
        logits = self.model.prefill(self.state, self.model.prefill_batch(rows, starts, chunks))
        for row, start, chunk in zip(rows, starts, chunks):
            self.lengths[row] = start + len(chunk)
        return logits

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        span = max(self.lengths[:n]) + 1
        self.state.ensure_capacity(span)
        if self.graphs is not None:
            logits = self.graphs.run(ids, span)
        else:
            logits = self.model.decode(self.state, ids, span)
        for row in range(n):
            self.lengths[row] += 1
        return logits

    @torch.inference_mode()
    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        self.state.copy_rows(sources, targets)

    @torch.inference_mode()
    def clear_lengths(self, rows: range) -> None:
        self.state.clear_lengths(rows)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"runner": self.name, "kv_capacity": self.state.capacity,
                                "cuda_graphs": self.graphs is not None and self.graphs.capture,
                                "compiled_decode": self.compiled,
                                "gdn_state_dtype": str(self.state.recurrent.dtype).removeprefix("torch.")}
        if self.graphs is not None and self.graphs.capture:
            info.update(graphs=len(self.graphs.graphs), graph_captures=self.graphs.captures,
                        graph_replays=self.graphs.replays)
        return info


class HFRunner:
    """The Hugging Face modules over :class:`StepCache`: one forward per prompt, batched decode."""

    name = "hf"
    staging = 0

    def __init__(self, model: Any, *, max_slots: int, max_model_len: int, fallback_reason: str | None = None) -> None:
        self.model = model
        self.max_slots = self.rows = max_slots
        self.fallback_reason = fallback_reason
        self.store = SlotStore(max_slots, initial_capacity=min(256, max_model_len))
        self.lengths = self.store.lengths
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def reset_rows(self, rows: list[int]) -> None:
        self.store.clear_lengths(rows)

    def _forward(self, ids: torch.Tensor, cache: StepCache) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=cache.attention_mask(self.dtype, self.device),
            position_ids=cache.position_ids(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        cache.commit()
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def prefill(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        if any(starts):
            raise ValueError("the Hugging Face runner prefills whole prompts only")
        logits = []
        for row, chunk in zip(rows, chunks):
            self.store.ensure_capacity(len(chunk))
            ids = torch.tensor([chunk], device=self.device)
            logits.append(self._forward(ids, StepCache(self.store, prefill_row=row, query_len=len(chunk))))
        return torch.cat(logits)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        self.store.ensure_capacity(max(self.lengths[:n]) + 1)
        return self._forward(ids[:, None], StepCache(self.store, prefill_row=None, query_len=1, rows=n))

    @torch.inference_mode()
    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        self.store.copy_rows(sources, targets)

    @torch.inference_mode()
    def clear_lengths(self, rows: range) -> None:
        self.store.clear_lengths(rows)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"runner": self.name, "kv_capacity": self.store.capacity, "cuda_graphs": False}
        if self.fallback_reason:
            info["why_not_lean"] = self.fallback_reason
        return info


def _inductor_available() -> bool:
    """Whether ``torch.compile`` can build GPU kernels here (Inductor generates Triton)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None
