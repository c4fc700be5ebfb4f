"""Load a Hugging Face causal LM directory (config + safetensors + tokenizer) for the engine."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.engine.base import InvalidRequestError, require_model_dir
from miles_core.engine.slot_cache import SUPPORTED_LAYER_TYPES
from miles_core.errors import ConfigError
from miles_core.hardware import devices

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, in eval mode, patches applied
    tokenizer: Any
    eos_token_ids: frozenset[int]
    patch_report: Any


def resolve_device(device: str) -> torch.device:
    return devices.resolve_device(device)  # auto: the active hardware backend's device


def resolve_dtype(dtype: str, config: Any) -> torch.dtype:
    if dtype == "auto":
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        declared = str(declared).removeprefix("torch.") if declared is not None else "float32"
        return DTYPES.get(declared, torch.float32)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def check_supported(config: Any, path: Path) -> None:
    """Reject architectures whose cache the engine cannot hold (named, before loading weights)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ["full_attention"]
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ConfigError(
            f"{path / 'config.json'}: layer_types {unsupported} are not supported by the embedded engine "
            f"(supported: {sorted(SUPPORTED_LAYER_TYPES)})"
        )
    if getattr(text, "is_encoder_decoder", False):
        raise ConfigError(f"{path / 'config.json'}: encoder-decoder models are not supported")


def load_model(path: str | Path, *, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load model and tokenizer from ``path`` and apply every matching model patch."""
    path = require_model_dir(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from miles_core.patches import prepare_model

    config = AutoConfig.from_pretrained(path)
    check_supported(config, path)
    torch_dtype = resolve_dtype(dtype, config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    # transformers decorates to() with functools.wraps(Module.to), which types it as the unbound method
    model.to(resolve_device(device)).eval()  # type: ignore[arg-type]
    report = prepare_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos: set[int] = set()
    if (path / "generation_config.json").is_file():
        eos |= _ids(GenerationConfig.from_pretrained(path).eos_token_id)
    eos |= _ids(getattr(model.config, "eos_token_id", None))
    eos |= _ids(tokenizer.eos_token_id)
    return LoadedModel(model, tokenizer, frozenset(eos), report)


def _ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


# -- weights ---------------------------------------------------------------------------------


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory (single file or sharded)."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise InvalidRequestError("model_path", f"{directory} is not a directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise InvalidRequestError("model_path", f"{directory} holds no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(directory / name)))
    return tensors


def check_weights(
    model: Any, named_tensors: Mapping[str, torch.Tensor], *, partial: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Match ``named_tensors`` to the model's tensors; raise naming the first problem.

    Returns ``(destination, source)`` pairs. Unless ``partial``, every parameter of the model
    (tied ones count once) must be covered, so a wrong checkpoint cannot half-apply.
    """
    state = model.state_dict(keep_vars=True)
    pairs = []
    for name, tensor in named_tensors.items():
        if name not in state:
            raise InvalidRequestError("weights", f"tensor {name!r} is not a parameter or buffer of the model")
        target = state[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise InvalidRequestError(
                "weights", f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        if tensor.is_floating_point() != target.is_floating_point():
            raise InvalidRequestError("weights", f"tensor {name!r} has dtype {tensor.dtype}, the model holds {target.dtype}")
        pairs.append((target, tensor))
    if not partial:
        covered = {dst.data_ptr() for dst, _ in pairs}
        missing = [n for n, p in model.named_parameters() if p.data_ptr() not in covered]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise InvalidRequestError("weights", f"update does not cover parameter(s) {shown}")
    return pairs

