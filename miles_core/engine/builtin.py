"""Built-in engines (entry point ``core-engine``): the embedded engine and the SGLang adapter."""

from __future__ import annotations

from miles_core.engine.kind import EngineKind
from miles_core.hookspecs import hookimpl

EMBEDDED = EngineKind(
    name="embedded",
    description="in-process continuous-batching engine over a Hugging Face model (CPU or GPU)",
    launcher="miles_core.engine.server:launch_embedded",
    check="miles_core.engine.selfcheck:check_embedded",
)
SGLANG = EngineKind(
    name="sglang",
    description="an SGLang server, launched from config or attached to by URL",
    launcher="miles_core.engine.sglang:launch_sglang",
    check="miles_core.engine.sglang:check_sglang",
)


@hookimpl
def miles_inference_engines() -> list[EngineKind]:
    return [EMBEDDED, SGLANG]
