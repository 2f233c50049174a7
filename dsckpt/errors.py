"""The exception hierarchy. Every error dsckpt raises on purpose is a :class:`DsckptError`.

Messages say what failed, where (file, rank, tensor), why, and what to do. The CLI maps each class to
one exit code (see :data:`EXIT_CODES`) and prints the message on one line, with no traceback.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "EXIT_BAD_CHECKPOINT",
    "EXIT_DISTRIBUTED",
    "EXIT_FINDINGS",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_USAGE",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DsckptError",
    "IncompleteCheckpointError",
    "NotEnoughSpaceError",
    "OutputBusyError",
    "OutputWriteError",
    "RepairError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
    "UsageError",
    "WorkerLostError",
    "first_of",
    "shorten",
    "shorten_runs",
]

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_BAD_CHECKPOINT = 3
EXIT_DISTRIBUTED = 4  # the ranks of a --distributed run could not work together (not a dsckpt bug)
EXIT_INTERNAL = 70


class DsckptError(Exception):
    """Root of every error dsckpt raises deliberately."""

    exit_code: int = EXIT_BAD_CHECKPOINT


class UsageError(DsckptError):
    """The request cannot be carried out as asked (bad option, output exists, ...)."""

    exit_code = EXIT_USAGE


class CheckpointNotFoundError(DsckptError):
    """The path is not a DeepSpeed checkpoint, or the requested tag does not exist."""


class IncompleteCheckpointError(DsckptError):
    """Rank files are missing (typically an interrupted save)."""


class CorruptCheckpointError(DsckptError):
    """A file is truncated, unreadable, or its metadata contradicts the rest of the checkpoint."""


class UnsupportedCheckpointError(DsckptError):
    """A layout dsckpt recognises but does not handle yet (tensor parallel, MoE, ...)."""


class UnsafeCheckpointError(DsckptError):
    """A pickle asked for a global that is not on the allow-list; nothing was executed."""


class RepairError(DsckptError):
    """A repair cannot be planned (e.g. non-finite tensors without a source value)."""


class OutputBusyError(UsageError):
    """Another dsckpt run holds the lock on the same output; nothing was written."""


class OutputWriteError(DsckptError):
    """The output cannot be written (disk full, quota, read-only filesystem, permissions); the
    temporary files were removed and nothing was written."""


class NotEnoughSpaceError(OutputWriteError):
    """The output's filesystem lacks the space the plan needs; checked before writing."""


class WorkerLostError(DsckptError):
    """A worker process of ``scan`` / ``verify`` ended without a result (killed by the system, e.g. its
    out-of-memory killer): not the checkpoint's fault, nothing was written."""

    exit_code = EXIT_INTERNAL


#: The most characters of one value (a file's content, a key, a config entry) an error message shows.
SHORTEN_CHARS = 80


def shorten(value: object, limit: int = SHORTEN_CHARS) -> str:
    """``repr``-like text of ``value`` for a message, cut to ``limit`` characters with the full length said
    (a 10 MB ``latest`` file must not become a 10 MB error line). Control characters come out escaped."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({len(text)} chars)"


#: A run of characters without a space longer than this in a message is a value (a name, a file's content)
#: that :func:`shorten_runs` cuts.
LONG_RUN_CHARS = 1000


def first_of(items: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then " and N more" for the rest: how a message names a
    list that may be long (missing files, params a change cannot handle)."""
    return sep.join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def shorten_runs(message: str) -> str:
    """``message`` with every run of more than ``LONG_RUN_CHARS`` non-space characters shortened (see
    :func:`shorten`): the CLI's last guard, so that no value a file holds makes an error line megabytes long."""
    import re

    return re.sub(rf"\S{{{LONG_RUN_CHARS + 1},}}", lambda m: shorten(m.group(), 400), message)
