"""Regional ``torch.compile`` for training: fuse the elementwise work around the matmuls.

In eager mode a transformers decoder spends much of a training step in small memory-bound
kernels: an RMSNorm upcasts to fp32, squares, reduces, rescales and casts back, each a kernel in
the forward and more in the backward; an MLP's activation and gate product are two more. Compiling
those modules alone (not the sequence mixers, whose custom kernels stay as they are) lets inductor
fuse each into one or two kernels. Shapes are compiled dynamic, since packed rows vary in length.
"""

from __future__ import annotations

from typing import Any

from miles_core.patches.base import qualname

#: class-name endings of the modules compiled: norms (plain and gated) and feed-forward blocks
COMPILED_SUFFIXES = ("RMSNorm", "RMSNormGated", "MLP")


def compile_regions(model: Any, backend: str = "inductor") -> list[str]:
    """Compile every norm and MLP module of ``model`` in place; returns the class names compiled.

    In place (``Module.compile``), so parameter names and the state dict stay as they were.
    """
    compiled: set[str] = set()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(COMPILED_SUFFIXES):
            module.compile(dynamic=True, backend=backend)
            compiled.add(qualname(type(module)))
    return sorted(compiled)
