"""Ctrl-C and the replay's processes.

* A second process (the prefill side of ``--backend nixl|mooncake``) is started with SIGINT ignored
  (:func:`sigint_ignored` around the spawn; an ignored disposition survives ``exec``, and Python keeps it), so
  Ctrl-C in a terminal, which signals the whole foreground process group, reaches only the parent: the child
  prints no ``KeyboardInterrupt`` traceback and is ended by the parent's cleanup (``close``).
* The parent's cleanup runs with SIGINT ignored too, so a second Ctrl-C cannot cut it short and leave a child
  behind; the CLI then prints one ``interrupted`` line and exits with status 130.
* SIGTERM is handled like Ctrl-C (:func:`sigterm_raises`, installed by the console script while a command runs):
  it raises :class:`Terminated`, a ``KeyboardInterrupt``, in the main thread, so the same cleanup runs (the
  second process is killed at once); the CLI then prints one ``terminated`` line and exits with status 143
  (128 + SIGTERM). :func:`cleanup_shielded` keeps a second Ctrl-C or SIGTERM from cutting a cleanup short. The
  children keep SIGTERM's default action (their parent's cleanup may still ``terminate`` them).
* Only the main thread can change signal handlers; elsewhere these context managers change nothing.
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


class Terminated(KeyboardInterrupt):
    """What SIGTERM raises in the app's main thread while :func:`sigterm_raises` is active: a ``KeyboardInterrupt``
    (every Ctrl-C cleanup applies) that the CLI reports as ``terminated``, exit status 143."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (main thread only; elsewhere a no-op), then the old
    handler is back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def cleanup_shielded() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside the block (a cleanup that must end every child; main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


__all__ = ["Terminated", "cleanup_shielded", "sigint_ignored", "sigterm_raises"]
