"""Ctrl-C and the replay's processes.

* A second process (the prefill side of ``--backend nixl|mooncake``) is started with SIGINT ignored
  (:func:`sigint_ignored` around the spawn; an ignored disposition survives ``exec``, and Python keeps it), so
  Ctrl-C in a terminal, which signals the whole foreground process group, reaches only the parent: the child
  prints no ``KeyboardInterrupt`` traceback and is ended by the parent's cleanup (``close``).
* The parent's cleanup runs with SIGINT ignored too, so a second Ctrl-C cannot cut it short and leave a child
  behind; the CLI then prints one ``interrupted`` line and exits with status 130.
* Only the main thread can change signal handlers; elsewhere :func:`sigint_ignored` changes nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT inside the block (main thread only; elsewhere a no-op), then restore the old handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


__all__ = ["sigint_ignored"]
