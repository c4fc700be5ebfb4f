"""Replace one attribute of a class or module, remember the original, and put it back.

Backends patch the object that owns a behaviour (the class, or the module every caller looks the
function up on), never a name some other module bound at import time: a rebound name is only
seen by code that imports it later, which is how such fixes silently stop working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_NOT_APPLIED = object()
_INHERITED = object()


@dataclass
class AttributePatch:
    """``owner.name = replacement``, reversible. ``replacement`` is stored as given, so pass a
    ``staticmethod`` for a static method."""

    owner: Any
    name: str
    replacement: Any
    _original: Any = field(default=_NOT_APPLIED, init=False, repr=False)

    @property
    def applied(self) -> bool:
        return self._original is not _NOT_APPLIED

    def apply(self) -> None:
        if self.applied:
            return
        own = vars(self.owner)
        if self.name in own:
            original = own[self.name]
        elif hasattr(self.owner, self.name):
            original = _INHERITED
        else:
            raise AttributeError(f"{self.describe()} does not exist, so it cannot be patched")
        setattr(self.owner, self.name, self.replacement)
        self._original = original

    def revert(self) -> None:
        if not self.applied:
            return
        if self._original is _INHERITED:
            delattr(self.owner, self.name)  # uncover the parent's attribute again
        else:
            setattr(self.owner, self.name, self._original)
        self._original = _NOT_APPLIED

    def describe(self) -> str:
        return f"{qualname(self.owner)}.{self.name}"


def qualname(owner: Any) -> str:
    """``module.Class`` for a class, the module name for a module."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))
