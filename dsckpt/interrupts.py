"""Termination signals as exceptions, so a killed run unwinds through the same cleanup paths as Ctrl-C.

SLURM, Kubernetes and ``timeout`` stop jobs with SIGTERM; a closed terminal sends SIGHUP. Python's
default for both is to die at once, leaving temporary outputs behind. Inside
:func:`signals_as_exceptions` they raise :class:`Terminated` instead (a ``BaseException``, like
``KeyboardInterrupt``, so ``except Exception`` blocks do not swallow it), and every ``finally`` /
``except BaseException`` on the way up removes its temporary files.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["TERMINATING_SIGNALS", "Terminated", "signals_as_exceptions"]

TERMINATING_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """The process received a termination signal; ``exit_code`` is ``128 + signum`` as a shell reports."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"terminated by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def signals_as_exceptions(signums: tuple[signal.Signals, ...] = TERMINATING_SIGNALS) -> Iterator[None]:
    """Raise :class:`Terminated` in the main thread on each of ``signums`` while the block runs.

    Only the first signal raises; later ones are ignored so that cleanup is not itself interrupted.
    The previous handlers are restored on exit. Outside the main thread this does nothing (Python
    delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        raise Terminated(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for s in signums:
            previous[s] = signal.signal(s, handler)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
