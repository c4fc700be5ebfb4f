"""The cuda backend: NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

from miles_core.hardware.base import CheckpointIOPolicy, Detection, HardwareBackend, torch_build


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
