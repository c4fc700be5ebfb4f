"""miles-e2b: E2B Cloud / self-hosted AgentENV sandbox provider."""

__version__ = "0.1.0"
