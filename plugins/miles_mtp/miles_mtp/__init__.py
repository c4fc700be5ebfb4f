"""miles-mtp: Multi-token-prediction label contract for megatron-core model paths."""

__version__ = "0.1.0"
