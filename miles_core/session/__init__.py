"""Session server: token-in-token-out recording of multi-turn chats for RL training.

Layers, each in its own module:

* transport -- :mod:`.server` (an ASGI app: routes, SSE, JSON errors) and :mod:`.embed` (uvicorn)
* :mod:`.normalize` -- pure request normalizer (client body -> :class:`~.normalize.ChatRequest`)
* :mod:`.completion` -- typed completion extractor (upstream reply -> :class:`~.completion.Completion`)
* :mod:`.tokens` -- the token invariants every version relies on (neutral, shared)
* :mod:`.tokenizer` + :mod:`.families` -- prompt ids from a chat template, boundary rules as data
* :mod:`.trajectory` -- the turn model, attach-point search and sample assembly both versions share
* :mod:`.linear` (v1) and :mod:`.tree` (v2) -- trajectory stores with a pure ``plan`` and a ``commit``
* :mod:`.service` -- the chat pipeline and the session registry, transport-agnostic

Versions are contributed through the ``miles_session_versions`` hook (protocol in :mod:`.base`).

``from miles_core.session import SessionServerConfig, serve_in_thread, build_app`` works; the
names are imported on first use, so importing this package (plugin discovery does) stays cheap.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "SessionServerConfig": "miles_core.session.config",
    "serve_in_thread": "miles_core.session.embed",
    "build_app": "miles_core.session.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
