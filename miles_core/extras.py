"""What each optional part of miles needs installed, and the one-line error when it is missing.

The core distribution (``pip install miles``) holds the plugin manager, the CLI, CI tooling and
the local sandbox; everything heavier is an extra (``pyproject.toml``). torch is never installed
by miles: its build depends on the platform (CPU, CUDA, ROCm), so it is named separately.

:func:`require` checks an extra's modules (by ``find_spec``: nothing is imported) before a
command starts work; :func:`missing_module_message` turns a ``ModuleNotFoundError`` that still
escapes into the same one-line advice.
"""

from __future__ import annotations

import importlib.util

from miles_core.errors import MilesError

TORCH_ADVICE = (
    "install the torch build for your platform first (CPU: pip install torch==2.13.0; "
    "CUDA or ROCm: the command from pytorch.org)"
)

#: extra -> the top-level modules it installs (torch is listed where the extra needs it, though
#: no extra installs it)
EXTRAS: dict[str, tuple[str, ...]] = {
    "session": ("transformers", "tokenizers", "jinja2", "starlette", "uvicorn", "httptools", "httpx", "orjson"),
    "engine": ("torch", "transformers", "tokenizers", "jinja2", "safetensors", "starlette", "uvicorn",
               "httptools", "httpx", "orjson"),
    "train": ("torch", "transformers", "tokenizers", "jinja2", "safetensors", "starlette", "uvicorn",
              "httptools", "httpx", "orjson", "matplotlib", "numpy"),
    "megatron": ("torch", "megatron", "psutil"),
    "ray": ("ray",),
}

#: module -> the smallest extra that installs it (for errors raised past :func:`require`)
_PROVIDER: dict[str, str] = {}
for _extra in ("session", "engine", "train", "megatron", "ray"):
    for _module in EXTRAS[_extra]:
        _PROVIDER.setdefault(_module, _extra)


class MissingExtraError(MilesError):
    """A command needs an optional part of miles that is not installed."""

    exit_code = 2


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that are not importable here."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    return [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` (one line naming the extra) unless ``extra`` is installed."""
    absent = missing(extra)
    if not absent:
        return
    if absent == ["torch"]:
        raise MissingExtraError(f"{what} needs torch, which is not installed: {TORCH_ADVICE}")
    torch_too = f"; it also needs torch: {TORCH_ADVICE}" if "torch" in absent else ""
    names = ", ".join(m for m in absent if m != "torch")
    raise MissingExtraError(
        f"{what} needs the '{extra}' extra ({names} not installed): pip install 'miles[{extra}]'{torch_too}"
    )


def missing_module_message(exc: ModuleNotFoundError) -> str | None:
    """One-line advice for a missing module miles knows the extra of (``None`` otherwise)."""
    top = (exc.name or "").partition(".")[0]
    if top == "torch":
        return f"torch is not installed: {TORCH_ADVICE}"
    extra = _PROVIDER.get(top)
    if extra is None:
        return None
    return f"{top} is not installed; it comes with the '{extra}' extra: pip install 'miles[{extra}]'"
