"""miles: reinforcement-learning post-training for LLMs, as a minimal core plus plugins.

The core must stay importable without torch, transformers, ray, megatron or e2b; heavy imports
happen only when a concern is activated.
"""

__version__ = "0.1.0"

import time as _time

#: ``time.perf_counter()`` when this process first imported miles: the latest a run's clock may
#: start (:func:`miles_core.rl.cli.clock_origin`)
IMPORTED_AT = _time.perf_counter()
