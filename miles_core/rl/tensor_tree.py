"""Nested state (optimizer state, RNG state) on disk without pickle: tensors in safetensors, the
structure in JSON.

``save_tree(stem, tree)`` writes ``<stem>.safetensors`` and ``<stem>.json``; ``load_tree(stem)``
reads them back equal, types included (tuples stay tuples, integer dict keys stay integers).
Loading runs no code whatever the files hold: a tampered file is at worst a :class:`TreeError`.

Leaves are tensors, ``None``, ``bool``, ``int``, ``float`` and ``str``; containers are lists,
tuples and dicts keyed by ``str`` or ``int``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import MilesError

FORMAT = "miles-tensor-tree/1"


class TreeError(MilesError):
    """A tensor tree that cannot be written, or files that do not hold one."""


def paths(stem: Path) -> tuple[Path, Path]:
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def save_tree(stem: Path, tree: Any) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def encode(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = node.detach().to("cpu").contiguous().clone()
            return {"tensor": key}
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {"float": repr(node)}
        if isinstance(node, tuple):
            return {"tuple": [encode(v) for v in node]}
        if isinstance(node, list):
            return [encode(v) for v in node]
        if isinstance(node, dict):
            if any(not isinstance(k, (str, int)) or isinstance(k, bool) for k in node):
                raise TreeError(f"dict keys must be str or int, got {sorted({type(k).__name__ for k in node})}")
            return {"items": [[k, encode(v)] for k, v in node.items()]}
        raise TreeError(f"cannot store a {type(node).__name__} in a tensor tree")

    structure = {"format": FORMAT, "tree": encode(tree)}
    tensor_path, json_path = paths(stem)
    save_file(tensors, str(tensor_path), metadata={"format": FORMAT})
    json_path.write_text(json.dumps(structure, separators=(",", ":")))


def load_tree(stem: Path) -> Any:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensor_path, json_path = paths(stem)
    try:
        structure = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise TreeError(f"{json_path}: not readable as JSON ({exc})") from None
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        raise TreeError(f"{json_path}: not a {FORMAT} file")
    try:
        tensors = load_file(str(tensor_path))
    except (OSError, SafetensorError) as exc:
        raise TreeError(f"{tensor_path}: not a readable safetensors file ({exc})") from None

    def decode(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [decode(v) for v in node]
        if isinstance(node, dict) and len(node) == 1:
            (kind, value), = node.items()
            if kind == "tensor" and isinstance(value, str) and value in tensors:
                return tensors[value]
            if kind == "float" and value in ("inf", "-inf", "nan"):
                return float(value)
            if kind == "tuple" and isinstance(value, list):
                return tuple(decode(v) for v in value)
            if kind == "items" and isinstance(value, list) and all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int)) for item in value
            ):
                return {k: decode(v) for k, v in value}
        raise TreeError(f"{json_path}: malformed node {str(node)[:80]!r}")

    return decode(structure["tree"])
