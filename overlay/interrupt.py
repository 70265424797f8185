"""SIGTERM handled as Ctrl-C (``timeout``, a job scheduler or ``kill`` stop a run as SIGINT does), and
children that die with the run.

Python turns SIGINT into :class:`KeyboardInterrupt`, so every ``except BaseException`` / ``finally``
cleanup runs; SIGTERM's default kills the process in place and leaves half-made folders behind.
:func:`sigterm_as_interrupt` raises ``KeyboardInterrupt`` on SIGTERM while its block runs.

SIGKILL runs no cleanup at all; what the tool can still do is bind its children to it
(:func:`bound_to_parent`), so none writes on, or serves on, after it is gone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def bound_to_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive this process: the kernel sends it ``sig``
    when the thread that starts it ends (a SIGKILLed build leaves no pip writing on into the cache, a
    killed ``regress`` no server holding the port and the GPUs).

    Call it in the parent (``preexec_fn=bound_to_parent()``): it records this process's pid and looks
    ``prctl`` up here, so the child only makes the call, and then exits at once if this process died
    before the child asked (the kernel would never signal it). Start such a child from a thread that
    waits for it (``subprocess.run``) or lives as long as it should (the main thread): the signal
    follows the starting thread, not the process. Linux only; elsewhere the child is not bound.
    """
    parent = os.getpid()
    prctl = _prctl()
    if prctl is None:
        return lambda: None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # this process died between the fork and the prctl
            os._exit(128 + sig)

    return preexec


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
