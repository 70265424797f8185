"""SIGTERM handled as Ctrl-C: ``timeout``, a job scheduler or ``kill`` stop a run the way SIGINT does.

Python turns SIGINT into :class:`KeyboardInterrupt`, so every ``except BaseException`` / ``finally``
cleanup runs; SIGTERM's default kills the process in place and leaves half-made folders behind.
:func:`sigterm_as_interrupt` raises ``KeyboardInterrupt`` on SIGTERM while its block runs.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def raise_interrupt(signum: int, frame: object) -> None:
    """A signal handler: the signal as ``KeyboardInterrupt``."""
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
