"""The cuda backend: NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

import os

from miles_core.hardware.base import ENV_OVERRIDE, CheckpointIOPolicy, Detection, HardwareBackend, torch_build


class CudaBackend(HardwareBackend):
    name = "cuda"
    device_type = "cuda"
    distributed_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_noset_envs = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",)
    capabilities = frozenset(
        {"pinned_memory_async_copy", "mm_out_dtype_fp32", "nvml", "triton", "device_graphs", "varlen_flash_attention"}
    )
    ci_hardware = "cuda"
    checkpoint_io = CheckpointIOPolicy(
        "pinned-non-blocking", "CUDA stages device-to-host copies in pinned memory, safe across fork"
    )

    def detect(self) -> Detection:
        import torch

        if torch.version.hip or not torch.version.cuda:
            return Detection(False, f"{torch_build()} is not a CUDA build")
        if not torch.cuda.is_available():
            return Detection(False, f"{torch_build()} sees no GPU")
        return Detection(True, f"{torch_build()} sees {torch.cuda.device_count()} GPU(s)")

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def verify(self) -> None:
        """The declarations, then that torch here is a CUDA build that sees a GPU: detection may
        have been overridden (``MILES_HARDWARE=cuda``), so this proves it rather than trusting it.

        It asks the runtime for its devices (no tensor is made on one): the Ray driver verifies
        its backend too, and must not hold a context on a GPU its actors train on.
        """
        super().verify()
        detection = self.detect()
        if not detection.claimed:
            chosen = f" ({ENV_OVERRIDE}={os.environ[ENV_OVERRIDE]})" if os.environ.get(ENV_OVERRIDE) else ""
            raise RuntimeError(f"CUDA is not usable here{chosen}: {detection.reason}")
