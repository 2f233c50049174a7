"""CRC-32 checks of torch zip records, made while the records are read.

``torch.save``'s zip format stores a CRC-32 for every record (``archive/data/7`` holds one storage's
bytes); the legacy non-zip format (DeepSpeed's ``"checkpoint_serialization": false``) has none.

Every storage of a zip file that :mod:`dsckpt.safe_load` parses gets a :class:`RecordCheck`. Each
read of tensor bytes -- in whatever order, in whatever thread, re-read or not -- hands the check the
CRC of what it read (:meth:`RecordCheck.update` computes it in the reading thread; :func:`crc32`
releases the GIL; a ``scan`` worker process returns its ranges' CRCs for the parent to hand over,
:mod:`dsckpt.scan_engine`), and the check keeps the CRC of every covered byte interval, merging neighbours
with :func:`crc32_combine`. Once an interval covers the whole record, its CRC is compared with the
stored one and a mismatch raises :class:`~dsckpt.errors.CorruptCheckpointError` at once. A command
that read records only partly calls :func:`finish` (``FileCache.finish_checks()``) before it
reports success: the bytes not yet read are read and combined, so nothing a command read goes
unchecked. Records a command never touched are not read for it; :func:`check_file_records` checks
every record of a file in one streaming pass.

``DSCKPT_NO_CRC=1`` turns the read-time checks off (a debugging escape hatch, e.g. to salvage what
is still readable from a damaged file); the stored CRCs are still reported.

:func:`crc32` is ISA-L's (the ``isal`` package, a dependency on x86-64 and ARM64) where it imports: the
same values as ``zlib.crc32`` at 2-3x its speed, and it too releases the GIL. Elsewhere, or with
``DSCKPT_CRC=zlib`` (for comparisons), it is ``zlib.crc32``; :data:`CRC32_IMPL` says which.
"""

from __future__ import annotations

import bisect
import functools
import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import limits
from .errors import CorruptCheckpointError

__all__ = [
    "CRC32_IMPL",
    "CRC_IMPL_ENV",
    "NO_CRC_ENV",
    "FileCrcReport",
    "RecordCheck",
    "RecordProblem",
    "check_file_records",
    "checks_enabled",
    "crc32",
    "crc32_combine",
    "finish",
    "has_record_crcs",
]

NO_CRC_ENV = "DSCKPT_NO_CRC"
CRC_IMPL_ENV = "DSCKPT_CRC"
FINISH_CHUNK_NBYTES = 8 << 20  # gaps and whole files are read this much at a time



def _crc32_impl() -> tuple[Callable[..., int], str]:
    if os.environ.get(CRC_IMPL_ENV, "") != "zlib":
        try:
            from isal.isal_zlib import crc32 as isal_crc32
        except ImportError:  # no wheel for this platform: the standard library's
            pass
        else:
            return isal_crc32, "isal"
    return zlib.crc32, "zlib"


crc32, CRC32_IMPL = _crc32_impl()
"""``crc32(data, value=0)``: ``zlib.crc32``'s signature and values (see the module docstring)."""

# --------------------------------------------------------------------------------------------
# crc32_combine: zlib's algorithm (zlib >= 1.2.12, crc32.c), which Python's zlib does not expose.
# CRC-32 is linear over GF(2): crc(A || B) = crc(A) * x^(8 * len(B)) mod P  xor  crc(B), with
# polynomials stored bit-reversed (x^0 is the top bit), P = 0xEDB88320.

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b mod P`` (``a`` must be non-zero)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(31):
        p = _multmodp(p, p)
        table.append(p)  # table[k] = x^(2^k) mod P
    return tuple(table)


_X2N = _x2n_table()


@functools.lru_cache(maxsize=1024)  # read lengths repeat (chunk sizes), so this is mostly a lookup
def _x8nmodp(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``."""
    p = 1 << 31  # x^0
    k = 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = zlib.crc32(A)``, ``crc2 = zlib.crc32(B)`` and ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


# --------------------------------------------------------------------------------------------
# Read-time checks


def checks_enabled() -> bool:
    """False when ``DSCKPT_NO_CRC`` is set to anything but ``""``/``"0"`` (read at file parse time)."""
    return os.environ.get(NO_CRC_ENV, "") in ("", "0")


def mismatch_message(path: Path, record: str, stored: int, read: int) -> str:
    return (f"{path}: record '{record}' fails its CRC32 check (stored 0x{stored:08x}, read 0x{read:08x}); "
            "the file is damaged (bit rot or a bad copy) — restore it from a backup or use another tag")


class RecordCheck:
    """The CRC-32 check of one zip record: ``nbytes`` bytes at ``data_offset`` of ``path``, stored
    CRC ``crc32``. Thread-safe; shared by every :class:`~dsckpt.tensor_ref.StorageRef` of the record.

    Offsets given to :meth:`update` / :meth:`add_crc` are relative to the record's first byte. A
    read that overlaps bytes already covered adds nothing (re-reads never count twice); the bytes it
    would have added are read again by :meth:`finish` if still missing.
    """

    def __init__(self, path: Path, record: str, crc32: int, nbytes: int, data_offset: int) -> None:
        self.path = path
        self.record = record
        self.crc32 = crc32
        self.nbytes = nbytes
        self.data_offset = data_offset
        self._lock = threading.Lock()
        self._starts: list[int] = []  # disjoint, non-adjacent covered intervals, sorted
        self._ends: list[int] = []
        self._crcs: list[int] = []
        self._result: int | None = None  # the CRC read, once the record is covered
        # Audit mode (``verify``): problems are appended here instead of raised, so one pass finds all.
        self.sink: list[str] | None = None

    @property
    def done(self) -> bool:
        """Every byte was read and its CRC compared (a mismatch raised)."""
        return self._result is not None

    @property
    def ok(self) -> bool:
        return self._result == self.crc32

    @property
    def result(self) -> int | None:
        """The CRC-32 read, once :attr:`done`."""
        return self._result

    @property
    def touched(self) -> bool:
        """Some of the record was read."""
        return self._result is not None or bool(self._starts)

    def covered_nbytes(self) -> int:
        with self._lock:
            return self.nbytes if self._result is not None else sum(
                e - s for s, e in zip(self._starts, self._ends))

    def gaps(self) -> list[tuple[int, int]]:
        """``(start, end)`` byte ranges of the record not read yet (empty once done)."""
        with self._lock:
            if self._result is not None:
                return []
            out = []
            pos = 0
            for s, e in zip(self._starts, self._ends):
                if s > pos:
                    out.append((pos, s))
                pos = e
            if pos < self.nbytes:
                out.append((pos, self.nbytes))
            return out

    def segments(self) -> list[tuple[int, int, int]]:
        """``(start, end, crc32)`` of the byte ranges read so far (one range once done): what another
        process needs to complete this check with :meth:`add_crc` (``--distributed``)."""
        with self._lock:
            if self._result is not None:
                return [(0, self.nbytes, self._result)]
            return list(zip(self._starts, self._ends, self._crcs))

    def update(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Account for ``data``, just read from ``offset`` of the record (raises on a mismatch once
        the record is covered)."""
        if self._result is not None:
            return
        self.add_crc(offset, crc32(data), memoryview(data).nbytes)

    def add_crc(self, offset: int, crc: int, nbytes: int) -> None:
        """Account for ``nbytes`` read at ``offset`` whose CRC-32 is ``crc``."""
        assert 0 <= offset and offset + nbytes <= self.nbytes, (
            f"{self.record}: read [{offset}, {offset + nbytes}) outside a record of {self.nbytes} bytes")
        if nbytes == 0:
            return
        end = offset + nbytes
        with self._lock:
            if self._result is not None:
                return
            starts, ends, crcs = self._starts, self._ends, self._crcs
            i = bisect.bisect_right(starts, offset)
            if (i > 0 and ends[i - 1] > offset) or (i < len(starts) and starts[i] < end):
                return  # overlaps covered bytes
            if i > 0 and ends[i - 1] == offset:
                i -= 1
                crc = crc32_combine(crcs[i], crc, nbytes)
                offset = starts[i]
                del starts[i], ends[i], crcs[i]
            if i < len(starts) and starts[i] == end:
                crc = crc32_combine(crc, crcs[i], ends[i] - starts[i])
                end = ends[i]
                del starts[i], ends[i], crcs[i]
            if offset == 0 and end == self.nbytes:
                self._result = crc
            else:
                starts.insert(i, offset)
                ends.insert(i, end)
                crcs.insert(i, crc)
                return
        if crc != self.crc32:
            message = mismatch_message(self.path, self.record, self.crc32, crc)
            if self.sink is not None:
                self.sink.append(message)
                return
            raise CorruptCheckpointError(message)

    def finish(self, fd: int | None = None, *, buffer: memoryview | None = None) -> int:
        """Read the bytes not read yet and complete the check (raises on a mismatch). Returns the
        number of bytes read. Does nothing for a record never touched or already done."""
        if not self.touched or self.done:
            return 0
        own = fd is None
        if own:
            fd = limits.open_parsed(self.path)
        assert fd is not None
        buf = buffer if buffer is not None else memoryview(bytearray(FINISH_CHUNK_NBYTES))
        read = 0
        try:
            for lo, hi in self.gaps():
                pos = lo
                while pos < hi:
                    n = os.preadv(fd, [buf[: min(hi - pos, buf.nbytes)]], self.data_offset + pos)
                    if n == 0:
                        raise CorruptCheckpointError(
                            f"{self.path}: file ends inside record '{self.record}'; the file is truncated "
                            "— the save was probably interrupted")
                    self.update(pos, buf[:n])
                    pos += n
                    read += n
        finally:
            if own:
                os.close(fd)
        return read


def finish(checks: Iterable[RecordCheck | None]) -> int:
    """Complete every touched, unfinished check in ``checks`` (see :meth:`RecordCheck.finish`).

    Every check is completed before raising: a :class:`CorruptCheckpointError` names every damaged
    record. Returns the number of records whose CRC has been verified."""
    problems: list[str] = []
    buf = memoryview(bytearray(FINISH_CHUNK_NBYTES))
    seen: set[int] = set()
    verified = 0
    by_path: dict[Path, list[RecordCheck]] = {}
    for c in checks:
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        by_path.setdefault(c.path, []).append(c)
    for path, cs in by_path.items():
        fd = None
        try:
            for c in sorted(cs, key=lambda c: c.data_offset):
                if c.touched and not c.done:
                    if fd is None:
                        fd = limits.open_parsed(path)
                    try:
                        c.finish(fd, buffer=buf)
                    except CorruptCheckpointError as e:
                        if not c.done:  # truncated; a mismatch is reported below
                            (c.sink if c.sink is not None else problems).append(str(e))
                if c.done and c.ok:
                    verified += 1
                elif c.done and c.sink is None:  # also when a read-time error was caught and dropped
                    problems.append(mismatch_message(c.path, c.record, c.crc32, c.result or 0))
        finally:
            if fd is not None:
                os.close(fd)
    if problems:
        raise CorruptCheckpointError("; ".join(problems))
    return verified


# --------------------------------------------------------------------------------------------
# Whole-file checks (for ``verify``)


@dataclass(frozen=True)
class RecordProblem:
    """A record of ``path`` that is damaged: ``message`` says how, on one line."""

    path: Path
    record: str
    message: str


@dataclass(frozen=True)
class FileCrcReport:
    """The result of :func:`check_file_records` for one file. ``has_crc`` is False for the legacy
    (non-zip) format, which stores no checksums: then nothing was checked."""

    path: Path
    has_crc: bool
    records: int
    nbytes_checked: int
    problems: tuple[RecordProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def has_record_crcs(path: str | os.PathLike[str]) -> bool:
    """True for a zip-format torch file (records carry CRC-32s), False for the legacy format."""
    from .limits import open_regular

    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(4) == b"PK\x03\x04"


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


def check_file_records(path: str | os.PathLike[str], *, chunk_nbytes: int = FINISH_CHUNK_NBYTES,
                       skip: Iterable[str] = (),
                       on_progress: Callable[[int], None] | None = None) -> FileCrcReport:
    """Check the CRC-32 of every record of a torch zip file in one streaming pass (no unpickling).

    Every problem is collected (a record whose CRC does not match, a local header that disagrees
    with the central directory, a record running past the end of the file); an unreadable zip
    directory is one problem for the whole file. Legacy (non-zip) files: ``has_crc=False``.
    Records named in ``skip`` (already verified while they were read) are not read again nor counted.
    ``on_progress(nbytes)`` is called after each chunk.
    """
    p = Path(path)
    if not has_record_crcs(p):
        return FileCrcReport(p, False, 0, 0, ())
    problems: list[RecordProblem] = []
    try:
        with zipfile.ZipFile(p) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return FileCrcReport(p, True, 0, 0, (RecordProblem(
            p, "", f"{p}: the zip directory cannot be read ({e}); the file is truncated or corrupt"),))
    buf = memoryview(bytearray(chunk_nbytes))
    size = p.stat().st_size
    checked = 0
    done = set(skip)
    fd = os.open(p, os.O_RDONLY)
    try:
        for info in infos:
            name = info.filename
            if name in done:
                continue
            header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
            if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                problems.append(RecordProblem(p, name, f"{p}: record '{name}' has no valid local header; "
                                              "the file is damaged — restore it from a backup"))
                continue
            fields = _LOCAL_HEADER.unpack(header)
            flags, local_crc, name_len, extra_len = fields[2], fields[6], fields[9], fields[10]
            if not flags & 0x08 and local_crc != info.CRC:
                problems.append(RecordProblem(p, name, local_header_message(p, name, info.CRC, local_crc)))
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                # torch.save never compresses: inflate no more than the read limit (a zip bomb, or a lying header)
                from .limits import current

                bound = current().max_inflated_nbytes
                if info.file_size > bound:
                    problems.append(RecordProblem(p, name, f"{p}: compressed record '{name}' declares "
                                                  f"{info.file_size} bytes inflated, past dsckpt's read limit "
                                                  f"max_inflated_nbytes={bound}; the file is corrupt or hostile"))
                    continue
                try:
                    with zipfile.ZipFile(p) as zf, zf.open(info) as member:
                        got = 0
                        while chunk := member.read(min(chunk_nbytes, bound + 1 - got)):
                            got += len(chunk)
                            if got > bound:
                                raise zipfile.BadZipFile("inflates past its declared size")
                except zipfile.BadZipFile:
                    problems.append(RecordProblem(p, name, f"{p}: record '{name}' fails its CRC32 check; the file "
                                                  "is damaged (bit rot or a bad copy) — restore it from a backup"))
                checked += info.file_size
                continue
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if start + info.file_size > size:
                problems.append(RecordProblem(p, name, f"{p}: record '{name}' runs past the end of the file; the "
                                              "file is truncated — the save was probably interrupted"))
                continue
            crc = 0
            pos = 0
            while pos < info.file_size:
                n = os.preadv(fd, [buf[: min(info.file_size - pos, buf.nbytes)]], start + pos)
                if n == 0:
                    break
                crc = crc32(buf[:n], crc)
                pos += n
                if on_progress is not None:
                    on_progress(n)
            checked += pos
            if crc != info.CRC:
                problems.append(RecordProblem(p, name, mismatch_message(p, name, info.CRC, crc)))
    finally:
        os.close(fd)
    return FileCrcReport(p, True, sum(1 for i in infos if i.filename not in done), checked, tuple(problems))


def local_header_message(path: Path, record: str, central: int, local: int) -> str:
    return (f"{path}: record '{record}' has two different CRC32s (central directory 0x{central:08x}, local "
            f"header 0x{local:08x}); the file is damaged (bit rot or a bad copy) — restore it from a backup")
