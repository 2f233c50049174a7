"""What a reader will accept, written down once (STYLE habit 18).

A checkpoint may be downloaded, copied by a script or crafted. Every budget below is enforced *before*
the work it guards, is named in the error when exceeded (exit 3), and can be raised for a real
checkpoint that needs more::

    DSCKPT_LIMITS="max_depth=200,max_pickle_nbytes=4GiB" dsckpt to-fp32 CKPT OUT

The defaults are far above what DeepSpeed writes (its pickles hold names, shapes, configs and counters;
tensor bytes live in records of their own and are never unpickled) and far below what hurts a machine.

File kinds are part of the budget: every file dsckpt opens for reading is checked to be a regular file
(after following symlinks) before it is opened, and opened with ``O_NONBLOCK``, so a FIFO, a device or
a socket in place of a rank file is refused at once instead of blocking or streaming forever
(:func:`open_regular`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import CorruptCheckpointError, UsageError

__all__ = ["LIMITS_ENV", "LimitExceededError", "ReadLimits", "charge_parsed", "current", "exceeded", "open_parsed",
           "open_regular", "parsing", "read_small_file", "regular_file", "remember_parsed"]

LIMITS_ENV = "DSCKPT_LIMITS"

_KIB, _MIB, _GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class ReadLimits:
    """The budgets of one read. Field docs give each default's reason."""

    #: Containers nested inside one another in a pickle. DeepSpeed nests ~6 deep (``optimizer_state_dict``
    #: -> ``base_optimizer_state`` -> ``state`` -> index -> ``exp_avg``); client state and configs a few more.
    #: Walks of a tree and JSON output recurse, and Python's own recursion limit is 1,000.
    max_depth: int = 100
    #: Distinct containers, strings and numbers in one pickle. A 100k-parameter model's stage-0 optimizer
    #: state is ~1M; each object costs 50-100 bytes of memory.
    max_objects: int = 10_000_000
    #: Objects reached when every shared reference (the pickle memo) is followed again: what a walk that
    #: does not remember where it has been, or a JSON rendering, visits. Real pickles share almost nothing
    #: (tied tensors), so this is ~``max_objects``; a "billion laughs" pickle (a list holding one list ten
    #: times, nine levels deep) is a few KB with 10^9 references.
    max_references: int = 20_000_000
    #: Tensors reached the same way: what listing a file's tensors by key path yields (each path is kept, ~200
    #: bytes). Real files list each tensor once (twice where tied); a stage-0 optimizer state of a 100k-tensor
    #: model lists 300k.
    max_tensor_references: int = 1_000_000
    #: Bits of one integer. Counters, seeds and sizes fit 64 bits; Python refuses to print integers of more
    #: than 4,300 digits (``sys.get_int_max_str_digits``), which a JSON output would then fail on.
    max_int_bits: int = 4096
    #: Bytes (or characters) of one string or bytes object in a pickle. Names and configs are KBs; numpy
    #: arrays kept in client state (a sampler's indices) MBs.
    max_str_nbytes: int = 256 * _MIB
    #: Bytes of one pickle (``data.pkl`` or a legacy file's main pickle). It is parsed in memory (what it
    #: builds: ``max_parsed_nbytes``); DeepSpeed's largest are a few MB (names and shapes of every param).
    max_pickle_nbytes: int = 64 * _MIB
    #: Bytes of memory the objects of one pickle take, estimated from its opcodes *before* it is parsed
    #: (:mod:`dsckpt.pickle_scan`: containers, their slots, strings, numbers, the memo table) and charged again
    #: by every allow-listed call that copies what it is given (``bytearray(b)``, ``set(l)``, a stand-in's
    #: state ...), before it copies. An opcode of one byte builds an object of 50-100 bytes, so a pickle within
    #: ``max_pickle_nbytes`` could otherwise take GBs; DeepSpeed's pickles take a few MB.
    max_parsed_nbytes: int = 256 * _MIB
    #: Inflated bytes of a *compressed* zip record. ``torch.save`` stores records uncompressed, always; a
    #: deflated record is a repacked file at best and a zip bomb at worst. Checked against the size the
    #: zip directory declares and again while inflating.
    max_inflated_nbytes: int = 16 * _MIB
    #: Bytes of a small text file read whole (``latest``, ``config.json``, ``*.index.json``,
    #: ``trainer_state.json``).
    max_text_nbytes: int = 64 * _MIB
    #: Non-tensor items of a DCP folder's optimizer side parsed one by one (each its own small ``torch.save``
    #: stream: a param group's hyper-parameters, a step kept as a Python number). ``get_state_dict``'s default
    #: layout keeps ~12 per param group; its flattened layout ~12 per param, so a model of 100k param tensors ~1.2M
    #: (each parse costs ~0.1 ms, the same order as the tensors' own reads).
    max_dcp_values: int = 2_000_000

    def describe(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


class LimitExceededError(CorruptCheckpointError):
    """A file asks for more than a :class:`ReadLimits` budget allows; nothing beyond it was done."""


_SUFFIX = {"": 1, "k": _KIB, "kib": _KIB, "m": _MIB, "mib": _MIB, "g": _GIB, "gib": _GIB, "t": 1 << 40,
           "tib": 1 << 40}
_cached: tuple[str, ReadLimits] | None = None


def _parse(text: str) -> ReadLimits:
    names = {f.name for f in dataclasses.fields(ReadLimits)}
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, raw = part.partition("=")
        name = name.strip()
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", raw)
        if name not in names or m is None or m[2].lower() not in _SUFFIX:
            raise UsageError(f"{LIMITS_ENV}: cannot use {part!r}; expected NAME=NUMBER[K|M|G|KiB|MiB|GiB], "
                             f"NAME one of {', '.join(sorted(names))}")
        values[name] = int(float(m[1]) * _SUFFIX[m[2].lower()])
    return ReadLimits(**values)


def current() -> ReadLimits:
    """The limits in force: the defaults, with the fields ``DSCKPT_LIMITS`` names replaced."""
    global _cached
    text = os.environ.get(LIMITS_ENV, "")
    if _cached is None or _cached[0] != text:
        _cached = (text, _parse(text))
    return _cached[1]


def exceeded(where: object, what: str, value: int | str | None, name: str) -> LimitExceededError:
    """The error for ``what`` (``value``, None: ``what`` says it) in ``where`` going past limit ``name``: says how
    to raise it."""
    limit = getattr(current(), name)
    shown = "" if value is None else f" ({value})"
    return LimitExceededError(
        f"{where}: {what}{shown} exceeds dsckpt's read limit {name}={limit}; the file is corrupt or hostile. "
        f"If it is a real checkpoint, raise the limit: {LIMITS_ENV}={name}={limit * 4}")


# --------------------------------------------------------------------------------------------
# Memory while parsing

@dataclass
class _Parse:
    where: object  # the file being parsed
    nbytes: int  # bytes of objects counted so far


_parsing: contextvars.ContextVar[_Parse | None] = contextvars.ContextVar("dsckpt_parse", default=None)


@contextlib.contextmanager
def parsing(where: object, nbytes: int) -> Iterator[None]:
    """The parse of ``where``, whose opcodes were estimated to build ``nbytes`` (within ``max_parsed_nbytes``):
    :func:`charge_parsed` adds what allow-listed calls copy to it while the block runs."""
    token = _parsing.set(_Parse(where, nbytes))
    try:
        yield
    finally:
        _parsing.reset(token)


def charge_parsed(nbytes: int) -> None:
    """Count ``nbytes`` an allow-listed call is about to build against ``max_parsed_nbytes`` of the parse in
    progress (none: nothing to count), refusing it before it is built."""
    state = _parsing.get()
    if state is None:
        return
    state.nbytes += nbytes
    limit = current().max_parsed_nbytes
    if state.nbytes > limit:
        raise exceeded(state.where, f"a pickle building more than {limit} bytes of objects", None, "max_parsed_nbytes")


# --------------------------------------------------------------------------------------------
# File kinds


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """``os.stat`` of ``path`` (symlinks followed), refusing anything but a regular file: exit 3."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{p}: file not found"
                                     + (" (a dangling symlink)" if p.is_symlink() else "")) from e
    except OSError as e:
        raise CorruptCheckpointError(f"{p}: cannot be read ({e.strerror or e})") from e
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"{p}: is {_kind(st.st_mode)}, not a regular file; a checkpoint holds only "
                                     "regular files — replace it with the file it stands for")
    return st


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path``, checked to be a regular file before and after opening (a file
    swapped for a FIFO in between still does not block: ``O_NONBLOCK``). The caller closes it."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path}: is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a small file read whole (``latest``, JSON), within ``max_text_nbytes``."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        limit = current().max_text_nbytes
        if size > limit:
            raise exceeded(path, f"a file of {size} bytes where a small text file belongs", None, "max_text_nbytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)



# path -> (device, inode) of every file parsed: what a later read of its tensors must find there
_parsed_ids: dict[str, tuple[int, int]] = {}


def remember_parsed(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """Record that ``path`` was parsed as the regular file ``st`` (``os.fstat`` of the descriptor it was parsed
    from), for :func:`open_parsed`."""
    _parsed_ids[os.fspath(path)] = (st.st_dev, st.st_ino)


def open_parsed(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` for reading the tensors of a parsed file: opened without blocking (a FIFO
    swapped in since never blocks), then ``fstat`` of the descriptor must show the regular file that was parsed
    (same device and inode, :func:`remember_parsed`); anything else is refused (exit 3). The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot be read ({e.strerror or e}); it was there when it was "
                                     "parsed — the checkpoint changed while it was read, run the command again") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path}: is {_kind(st.st_mode)} now, not the regular file that was parsed; "
                                         "the checkpoint changed while it was read — run the command again")
        known = _parsed_ids.get(os.fspath(path))
        if known is not None and known != (st.st_dev, st.st_ino):
            raise CorruptCheckpointError(f"{path}: is another file than the one parsed (replaced while it was read); "
                                         "the checkpoint changed under the command — run it again")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
