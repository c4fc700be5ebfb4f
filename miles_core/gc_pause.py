"""Pausing Python's cyclic garbage collector while start-up builds objects that live for the run,
and sparing the exit a teardown walk of them.

Start-up (importing plugin modules, torch and transformers; resolving a config; building a run)
allocates hundreds of thousands of objects that stay alive until the process exits. Each
threshold-triggered collection during that phase walks the younger generations -- and every few
passes, everything built so far -- and finds almost nothing to free: before ``miles train
--preset tiny`` reached its first step, about 1,000 automatic collections took 0.7-0.8 s
(``gc.callbacks``, on a loaded 2-core machine). Inside :func:`gc_paused` no automatic collection
runs; ``gc.collect()`` still works (``miles train`` collects once and freezes the heap when the
runtime is built), and collection resumes as before when the outermost pause ends.

At exit the same objects cost again: interpreter shutdown collects and deallocates, cycle by
cycle, every module, class and function the process imported -- about a tenth of ``miles plugins
list``. :func:`freeze_at_exit` collects once (garbage that exists then is finalized as usual) and
freezes the rest, which the operating system reclaims with the process.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_enabled_before = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic garbage collection for the block; on leaving it (also by an exception)
    the collector is enabled again if it was enabled when the pause began.

    Pauses nest and may overlap across threads: the state is saved by the first pause to begin
    and restored by the last to end, so an inner pause never re-enables the collector under an
    outer one.
    """
    global _depth, _enabled_before
    with _lock:
        if _depth == 0:
            _enabled_before = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _enabled_before:
                    gc.enable()
                else:
                    gc.disable()


def freeze_at_exit() -> None:
    """Collect, then move every object left out of the collector's reach (``gc.freeze``).

    For an :mod:`atexit` handler of a process that ends with its command (the ``miles`` entry
    point registers it): handlers registered after it -- during the command -- run before it,
    those registered before it run after it, and all still run. Objects that are still alive
    keep their ordinary teardown where it is not the collector's (module globals are cleared,
    and what only they reference is deallocated); only reference cycles alive at exit are left
    to the operating system, as ``__del__`` at exit never promised otherwise.
    """
    gc.collect()
    gc.freeze()
