"""miles-qwen35: Gated DeltaNet packing patch for Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models."""

__version__ = "0.1.0"
