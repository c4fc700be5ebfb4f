"""Every process of a run checks that it loaded the same plugins as the driver.

Ray actors and the FSDP trainer's ranks each discover plugins anew (their own import of the
installed distributions and ``MILES_DISABLE_PLUGINS``); a process that differs would train or serve
with other patches than the driver reported, so it refuses to start.
"""

from __future__ import annotations

from typing import Any

from miles_core.errors import MilesError


class FingerprintMismatch(MilesError):
    pass


def _plugin_set(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The plugins part of a fingerprint (patches are applied later, when a model is built)."""
    import hashlib
    import json

    plugins = fingerprint["plugins"]
    digest = hashlib.sha256(json.dumps(plugins, sort_keys=True).encode()).hexdigest()
    return {"plugins": plugins, "applied_patches": {}, "digest": digest}


def check_fingerprint(expected: dict[str, Any], role: str) -> dict[str, Any]:
    """This process's fingerprint, or :class:`FingerprintMismatch` naming every difference in the
    loaded plugins (names, distributions, versions, status). Applied patches are compared once the
    engine and trainer have built their models (Ray: ``build_ray``)."""
    from miles_core.plugins import fingerprint_mismatch, get_plugin_manager

    actual = get_plugin_manager().fingerprint()
    diffs = fingerprint_mismatch(_plugin_set(expected), _plugin_set(actual))
    if diffs:
        raise FingerprintMismatch(f"{role} worker loaded different plugins than the driver: " + "; ".join(diffs))
    return actual
