"""Termination signals as exceptions, so a killed run unwinds through the same cleanup paths as Ctrl-C.

SLURM, Kubernetes and ``timeout`` stop jobs with SIGTERM; a closed terminal sends SIGHUP. Python's
default for both is to die at once, leaving temporary outputs behind. Inside
:func:`signals_as_exceptions` they raise :class:`Terminated` instead (a ``BaseException``, like
``KeyboardInterrupt``, so ``except Exception`` blocks do not swallow it), and every ``finally`` /
``except BaseException`` on the way up removes its temporary files.

A signal must not cut that cleanup short: under torchrun, a rank that lost a peer is already unwinding (removing
its temporary output) when torchrun's SIGTERM arrives, and a :class:`Terminated` raised inside ``shutil.rmtree``
would leave half a temporary folder behind (seen once in CI). Cleanup runs inside :func:`uninterrupted`, which
holds a signal until the block is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["TERMINATING_SIGNALS", "Terminated", "received", "signals_as_exceptions", "uninterrupted"]

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


class _State:
    held = 0  # depth of uninterrupted() blocks in the main thread
    pending: int | None = None  # a signal that arrived while held, raised when the outermost block ends
    received: int | None = None  # the first terminating signal this process got inside signals_as_exceptions


def received() -> int | None:
    """The first terminating signal this process received inside :func:`signals_as_exceptions`, if any (the
    teardown of a ``--distributed`` run then does not wait for peers that torchrun is stopping too)."""
    return _State.received


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Run a cleanup block to its end even if a terminating signal arrives meanwhile: the signal is held and
    raised as :class:`Terminated` when the block ends, unless an exception is already on its way up (it is then
    the one that propagates; the process is being stopped either way). Outside the main thread, or outside
    :func:`signals_as_exceptions`, this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _State.held += 1
    try:
        yield
    except BaseException:
        _State.held -= 1
        if not _State.held:
            _State.pending = None
        raise
    _State.held -= 1
    if not _State.held and _State.pending is not None:
        signum, _State.pending = _State.pending, None
        raise Terminated(signum)


@contextlib.contextmanager
def signals_as_exceptions(signums: tuple[signal.Signals, ...] = TERMINATING_SIGNALS) -> Iterator[None]:
    """Raise :class:`Terminated` in the main thread on each of ``signums`` while the block runs.

    Only the first signal raises (held until the end of an :func:`uninterrupted` block); later ones are ignored so
    that cleanup is not itself interrupted.
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
        if _State.received is None:
            _State.received = signum
        if _State.held:
            _State.pending = signum
            return
        raise Terminated(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for s in signums:
            previous[s] = signal.signal(s, handler)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _State.pending = None
