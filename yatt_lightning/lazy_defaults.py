"""Class-typed defaults of the config (``model.advantage_estimator: GRPOAdvantage``, ...), as jsonargparse's
``lazy_instance`` makes them (the CLI prints, saves and overrides them like any ``class_path``).

``lazy_instance`` finds its caller through ``inspect.stack()``, which reads every frame's source and, for the
import machinery's frames, scans all of ``sys.modules`` per frame: 0.18 s a call at import time with vLLM,
Megatron and Lightning loaded (0.9 s of every process's start for the module's five defaults). Called from a
thread of its own, the stack is that thread's few frames: the same lazy instance, in milliseconds.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from jsonargparse import lazy_instance

T = TypeVar("T")


def lazy_default(class_type: type[T], **kwargs) -> T:
    """``jsonargparse.lazy_instance(class_type, **kwargs)``, called on a shallow stack (see above); its lazy
    class lives in this module."""
    made: list = []
    thread = threading.Thread(target=lambda: made.append(lazy_instance(class_type, **kwargs)), name="yatt-lazy-default")
    thread.start()
    thread.join()
    return made[0]
