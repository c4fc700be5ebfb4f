"""Where a Gated DeltaNet model can run its forward in this process."""

from __future__ import annotations

import importlib.util


def gdn_model_device() -> str:
    """``"cuda"`` when fla is installed and a GPU is visible, else ``"cpu"``.

    With fla importable, transformers routes every Gated DeltaNet forward to fla's Triton kernels,
    which cannot take CPU tensors (seen on the H200: "Pointer argument cannot be accessed from
    Triton"); the GPU is where those kernels run anyway. Self-checks that build a small GDN model
    (the engine's, the qwen35 patch's example models) and the presets' warm-up put it here.
    """
    import torch

    return "cuda" if torch.cuda.is_available() and importlib.util.find_spec("fla") is not None else "cpu"
