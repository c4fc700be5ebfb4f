"""The descriptor an engine plugin contributes through ``miles_inference_engines``.

Its own module, apart from :mod:`miles_core.engine.base` (which re-exports it): plugin discovery
imports this one only, without the request and completion types every engine call uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.engine.base import EngineServer


@dataclass(frozen=True)
class EngineKind:
    """An engine implementation contributed through ``miles_inference_engines``.

    ``launcher`` is ``"module:callable"``; the callable takes keyword options and returns an
    :class:`~miles_core.engine.base.EngineServer`. It is imported only when the engine is
    launched. ``check`` is ``"module:callable"`` too: it proves the implementation works on this
    machine (raises if not).
    """

    name: str
    description: str
    launcher: str
    check: str

    def launch(self, **options: Any) -> EngineServer:
        from miles_core.plugins import import_object

        return import_object(self.launcher)(**options)

    def verify(self) -> Any:
        from miles_core.plugins import import_object

        return import_object(self.check)()
