"""Every hardware test starts and ends with no active backend and MILES_HARDWARE unset."""

from miles_core.testing.hardware import no_active_hardware  # noqa: F401
