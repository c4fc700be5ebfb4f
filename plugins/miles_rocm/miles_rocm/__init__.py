"""miles-rocm: ROCm hardware backend: detection, worker environment, ROCm CI suites and the async-checkpoint writer guard."""

__version__ = "0.1.0"
