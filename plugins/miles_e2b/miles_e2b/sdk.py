"""The E2B SDK surface miles-e2b depends on, checked against the installed package, and the
mapping of SDK exceptions onto the sandbox error taxonomy (by exception type, never by text).

:data:`SDK_CALLS` lists every SDK call the provider makes with the parameters it passes;
:func:`check_surface` (what ``verify()`` runs) resolves each in the installed ``e2b`` and checks
its signature accepts them. The tests record the calls actually made against the in-process
fake and bind each one to the real signature (:func:`bind`), so this list cannot drift from
the code.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from types import ModuleType
from typing import Any

from miles_core.sandbox.errors import (
    ImageBuildError,
    SandboxCapacityError,
    SandboxError,
    SandboxFatalError,
    SandboxNotFound,
    SandboxThrottled,
    SandboxTransientError,
)

PROVIDER = "e2b"
MIN_VERSION = (2, 63)

#: connection keywords passed to every call in :data:`WITH_API_PARAMS` (``E2BConfig.api_params``)
API_PARAMS = ("api_key", "domain", "api_url", "sandbox_url", "request_timeout", "retries")
#: call -> parameter names the provider passes (positionally or by keyword)
SDK_CALLS: dict[str, tuple[str, ...]] = {
    "AsyncSandbox.create": (
        "template",
        "timeout",
        "metadata",
        "envs",
        "allow_internet_access",
        "network",
        "idempotency_key",
    ),
    "AsyncSandbox.kill": ("sandbox_id",),
    "AsyncSandbox.set_timeout": ("sandbox_id", "timeout"),
    "AsyncSandbox.list": ("query", "limit"),
    "AsyncSandbox.get_host": ("port",),
    "AsyncSandboxPaginator.next_items": (),
    "AsyncCommandHandle.wait": (),
    "AsyncCommandHandle.kill": (),
    "Commands.run": ("cmd", "background", "envs", "user", "cwd", "timeout"),
    "Filesystem.read": ("path", "format", "user"),
    "Filesystem.write": ("path", "data", "user"),
    "AsyncTemplate": ("file_context_path",),
    "AsyncTemplate.from_image": ("image",),
    "TemplateBuilder.set_user": ("user",),
    "TemplateBuilder.set_workdir": ("workdir",),
    "TemplateBuilder.run_cmd": ("command",),
    "TemplateBuilder.copy": ("src", "dest", "mode"),
    "AsyncTemplate.build": (
        "template",
        "name",
        "cpu_count",
        "memory_mb",
        "min_free_disk_mb",
        "on_build_logs",
    ),
    "AsyncTemplate.exists": ("name",),
}
WITH_API_PARAMS = frozenset(
    {
        "AsyncSandbox.create",
        "AsyncSandbox.kill",
        "AsyncSandbox.set_timeout",
        "AsyncSandbox.list",
        "AsyncTemplate.build",
        "AsyncTemplate.exists",
    }
)
EXCEPTIONS = (
    "RateLimitException",
    "ServiceBusyException",
    "AuthenticationException",
    "InvalidArgumentException",
    "NotEnoughSpaceException",
    "TemplateException",
    "BuildException",
    "FileNotFoundException",
    "SandboxNotFoundException",
    "SandboxNotRunningException",
    "SandboxUnreachableException",
    "TimeoutException",
    "SandboxException",
    "CommandExitException",
)


def load() -> ModuleType:
    import e2b

    return e2b


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("e2b")


def _return_type(func: Callable[..., Any]) -> type:
    return typing.get_type_hints(func)["return"]


def resolve(sdk: ModuleType, name: str) -> Callable[..., Any]:
    """The callable of the installed SDK behind ``name`` in :data:`SDK_CALLS`."""
    owner, _, attr = name.partition(".")
    if owner == "Commands":
        cls = _return_type(sdk.AsyncSandbox.commands.fget)
    elif owner == "Filesystem":
        cls = _return_type(sdk.AsyncSandbox.files.fget)
    elif owner == "TemplateBuilder":
        cls = _return_type(sdk.AsyncTemplate.from_image)
    else:
        cls = getattr(sdk, owner)
    if not attr:
        return cls
    static = inspect.getattr_static(cls, attr)
    variant = getattr(static, "class_method_name", None)
    if variant is not None:  # SDK methods callable on the class with an id dispatch here
        return getattr(cls, variant)
    return getattr(cls, attr)


def _signature(func: Callable[..., Any]) -> tuple[inspect.Signature, bool]:
    """The signature, and whether its first parameter is an unbound ``self``."""
    signature = inspect.signature(func)
    params = list(signature.parameters)
    return signature, bool(params) and params[0] == "self" and not inspect.isclass(func)


def bind(sdk: ModuleType, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless the installed SDK accepts this exact call."""
    func = resolve(sdk, name)
    signature, unbound = _signature(func)
    signature.bind(*((object(),) if unbound else ()), *args, **kwargs)
    extra = set(kwargs) - set(signature.parameters)
    if extra and name in WITH_API_PARAMS:
        unknown = extra - set(typing.get_type_hints(sdk.ApiParams))
        if unknown:
            raise TypeError(f"{name}: connection parameters {sorted(unknown)} are not in e2b.ApiParams")


def check_surface(sdk: ModuleType) -> dict[str, Any]:
    """Every call in :data:`SDK_CALLS` exists and accepts the parameters the provider passes."""
    problems = []
    installed = version()
    if tuple(int(p) for p in installed.split(".")[:2]) < MIN_VERSION:
        problems.append(f"e2b {installed} is older than {'.'.join(map(str, MIN_VERSION))}")
    api_keys = set(typing.get_type_hints(sdk.ApiParams))
    missing_api = sorted(set(API_PARAMS) - api_keys)
    if missing_api:
        problems.append(f"e2b.ApiParams lacks {missing_api}")
    for name, params in SDK_CALLS.items():
        try:
            signature, _ = _signature(resolve(sdk, name))
        except (AttributeError, KeyError, TypeError) as exc:
            problems.append(f"{name}: not found ({type(exc).__name__}: {exc})")
            continue
        missing = [p for p in params if p not in signature.parameters]
        if missing:
            problems.append(f"{name}: no parameter(s) {missing}")
        if name in WITH_API_PARAMS and not any(
            p.kind is p.VAR_KEYWORD for p in signature.parameters.values()
        ):
            problems.append(f"{name}: accepts no connection parameters (**opts)")
    absent = [name for name in EXCEPTIONS if not isinstance(getattr(sdk, name, None), type)]
    if absent:
        problems.append(f"exception classes missing: {absent}")
    if problems:
        raise RuntimeError(
            f"the installed e2b {installed} lacks what miles-e2b calls: " + "; ".join(problems)
        )
    return {"e2b_version": installed, "calls_checked": len(SDK_CALLS), "exceptions_checked": len(EXCEPTIONS)}


def to_sandbox_error(exc: BaseException, sdk: ModuleType, what: str) -> SandboxError:
    """Map an SDK (or transport) exception to the taxonomy, by type. Messages are redacted."""
    import httpx

    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, sdk.RateLimitException):
        return SandboxThrottled(text, provider=PROVIDER)
    if isinstance(exc, sdk.ServiceBusyException):
        return SandboxCapacityError(text, provider=PROVIDER)
    if isinstance(exc, sdk.BuildException):
        return ImageBuildError(text, provider=PROVIDER)
    if isinstance(exc, sdk.FileNotFoundException):
        return SandboxFatalError(text, provider=PROVIDER)
    if isinstance(exc, (sdk.SandboxNotFoundException, sdk.SandboxNotRunningException)):
        return SandboxNotFound(text, provider=PROVIDER)
    if isinstance(exc, (sdk.SandboxUnreachableException, sdk.TimeoutException, httpx.TransportError)):
        return SandboxTransientError(text, provider=PROVIDER)
    status = getattr(exc, "status_code", None)
    if isinstance(exc, sdk.SandboxException) and isinstance(status, int) and status >= 500:
        return SandboxTransientError(text, provider=PROVIDER)
    return SandboxFatalError(text, provider=PROVIDER)
