"""Atomic outputs: write beside the target, fsync, ``os.replace``. Inputs are never opened for writing.

Every writing command wraps its output in :func:`claim_output`, which

* takes a run-lock on OUT (``fcntl.flock`` on ``.OUT.dsckpt-lock`` beside it): a second dsckpt
  writing the same OUT is refused (:class:`~dsckpt.errors.OutputBusyError`), so two concurrent runs
  never both write it and OUT is never a mix;
* removes what a killed run (SIGKILL, power loss) left beside OUT. Temp names carry the writer's pid, host
  and pid space (``.OUT.<pid>@<host>+<space>.XXXXXXXX.tmp``; the space is this kernel boot + pid namespace,
  :func:`_pid_space`, so machines sharing a hostname differ); holding the lock proves no dsckpt is writing OUT,
  so leftovers of this pid space whose pid is dead are removed (and logged). A pid means nothing on another
  host (a shared filesystem), so ``--distributed`` writers hold a **lease** instead: their temp names
  say so (``.OUT.<pid>@<host>+<space>~lease.XXXXXXXX.tmp``) and rank 0 touches the temp's mtime every
  :data:`LEASE_RENEW_S` seconds while the run lives (:func:`lease`). Another host's leased leftover
  whose mtime is older than :func:`lease_expiry_s` is dead and removed; other leftovers of another host
  are left alone and logged with how to remove them. A previous OUT that a killed ``--force`` run had
  moved aside is put back;
* refuses before writing when the filesystem lacks the space the plan needs
  (:class:`~dsckpt.errors.NotEnoughSpaceError`), and turns ENOSPC/EDQUOT/EROFS/EACCES during the write
  into :class:`~dsckpt.errors.OutputWriteError` naming OUT (the temp is removed first).

Modes: every published file gets ``0666 & ~umask`` and every published folder ``0777 & ~umask``, as
``torch.save``, safetensors and DeepSpeed's own saves give them; a file copied unchanged from the input gets the
input's mode ``& ~umask``, as ``cp`` gives it (:func:`copy_file`). ``mkstemp``/``mkdtemp`` create the temporaries
0600/0700, so no one reads a half-written output; :func:`publish_modes` gives a temporary its final mode once it is
complete, just before it is renamed into place, so the published name is never private. Nothing is inherited from
an output that ``--force`` replaces (the new one is a fresh temporary).

Notes (leftovers removed or left) go to the ``dsckpt`` logger at WARNING; the CLI prints them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import (
    CorruptCheckpointError,
    NotEnoughSpaceError,
    OutputBusyError,
    OutputWriteError,
    UsageError,
)
from .interrupts import uninterrupted

__all__ = [
    "WRITE_ERRNOS",
    "atomic_dir",
    "atomic_file",
    "background_fsync",
    "check_can_write",
    "check_free_space",
    "claim_output",
    "copy_file",
    "copy_tree",
    "current_umask",
    "format_nbytes",
    "fsync_dir",
    "free_bytes",
    "lease",
    "lease_expiry_s",
    "leased_temp",
    "publish_modes",
    "refuse_overlap",
    "remove_leftovers",
    "replace_into_place",
    "scratch_dir",
    "verification_failed",
]

logger = logging.getLogger("dsckpt")

#: OS errors that mean "this output cannot be written here" (not a dsckpt bug).
WRITE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EACCES,
                                     errno.EPERM, errno.EFBIG) if e is not None)

_HOST = socket.gethostname() or "localhost"


def _pid_space() -> str:
    """8 hex digits naming the space this process's pids live in: this kernel boot (``boot_id``) and this pid
    namespace (a container's own). Two machines that share a hostname (or two containers on one host) differ
    here, so a pid in a temp name is only checked where it means this process table."""
    import hashlib

    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip() if path.endswith("boot_id") else str(os.stat(path).st_ino))
        except OSError:
            parts.append("")
    if not any(parts):  # not Linux: the hostname alone (as before)
        return ""
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:8]


_PID_SPACE = _pid_space()
#: Added to every planned output size: headers, pickles, zip directories, file-system rounding.
SPACE_MARGIN_NBYTES = 1 << 20


def _proc_umask() -> int | None:
    """This process's umask from ``/proc/self/status`` (Linux >= 4.7), or None where there is none."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _startup_umask() -> int:
    """The umask at import. Reading it without ``/proc`` means setting it and setting it back: ``os.umask`` is
    process-wide, so a thread creating a file in between would create it with the wrong mode. Done once here, at
    import (before any dsckpt command starts a thread), never while one writes."""
    found = _proc_umask()
    if found is not None:
        return found
    old = os.umask(0o077)  # meanwhile 077: a file another thread created in between is at worst more private
    os.umask(old)
    return old


_STARTUP_UMASK = _startup_umask()


def current_umask() -> int:
    """The process's umask, read without changing it: ``/proc/self/status`` where the kernel has it, else the umask
    at import. Read each time (about 25 us; ~30 us of CPU per published file, measured against a 1 KB
    ``atomic_file`` without fsync at ~150 us), so a library caller's later ``os.umask`` counts, and no thread ever
    sees the umask changed under it."""
    found = _proc_umask()
    return _STARTUP_UMASK if found is None else found


#: ``chmod`` errors of a filesystem that keeps no modes (some FUSE, CIFS and FAT mounts): ignored, as ``cp`` does.
_NO_MODES_ERRNOS = frozenset(e for e in (errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", None)) if e is not None)


def _chmod(path: Path, mode: int) -> None:
    """``chmod`` of a file or folder dsckpt made (never a symlink: callers check)."""
    try:
        os.chmod(path, mode)
    except OSError as e:
        if e.errno not in _NO_MODES_ERRNOS:
            raise


def publish_modes(path: str | os.PathLike[str], *, umask: int | None = None) -> None:
    """Give ``path`` (a complete temporary file or folder that dsckpt wrote, not a copy, about to be renamed into
    place) the mode the umask gives a new one: ``0666 & ~umask`` for a file, ``0777 & ~umask`` for a folder (the
    folder itself; what it holds got its modes as it was written). A symlink is left as it is."""
    path = Path(path)
    mask = current_umask() if umask is None else umask
    if path.is_symlink():
        return
    _chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keep_times: bool = True) -> Path:
    """Copy ``src`` to ``dst`` as ``cp`` does: its bytes, its times if ``keep_times`` (:func:`shutil.copy2`), and
    the mode of ``src`` (a link followed) ``& ~umask``, never more than ``0777`` (``copy2`` alone would copy the
    mode exactly, ignoring the umask; ``copyfile`` would ignore the source's). ``dst`` is inside a private
    temporary folder, so nobody reads it half-copied."""
    if keep_times:
        shutil.copy2(src, dst)
    else:
        shutil.copyfile(src, dst)
    _chmod(Path(dst), stat.S_IMODE(os.stat(src).st_mode) & 0o777 & ~current_umask())
    return Path(dst)


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str],
              copy_function: Callable[[str, str], object] = shutil.copy2) -> Path:
    """:func:`shutil.copytree` (each file copied by ``copy_function``) with :func:`copy_file`'s modes: each file
    the mode of its source ``& ~umask``, each folder ``0777 & ~umask`` (``copytree`` would copy the source
    folders' and files' modes exactly)."""
    def copy(s: str, d: str) -> object:
        copy_function(s, d)
        _chmod(Path(d), stat.S_IMODE(os.stat(s).st_mode) & 0o777 & ~mask)
        return d

    mask = current_umask()
    shutil.copytree(src, dst, copy_function=copy)
    for folder, _, _ in os.walk(dst):
        _chmod(Path(folder), 0o777 & ~mask)
    return Path(dst)


def format_nbytes(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{nbytes} B"  # pragma: no cover


def check_can_write(target: Path, *, force: bool) -> None:
    """Refuse to overwrite an existing output unless ``force`` (a symlink at ``target``, dangling or not, is an
    existing output: ``--force`` replaces the link itself, never what it points to)."""
    if (target.exists() or target.is_symlink()) and not force:
        if target.is_dir() and not any(target.iterdir()):
            return
        raise UsageError(f"'{target}' already exists; pass --force to replace it")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged user may still write in ``directory``'s filesystem (``statvfs``
    ``f_bavail * f_frsize``). Quotas are not visible here; EDQUOT during the write is mapped too."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_free_space(directory: Path, nbytes: int) -> None:
    """Raise :class:`NotEnoughSpaceError` if ``directory`` cannot hold ``nbytes`` (+ a margin)."""
    need = nbytes + SPACE_MARGIN_NBYTES
    try:
        have = free_bytes(directory)
    except OSError:  # statvfs unsupported here: the write itself will tell
        return
    if have < need:
        raise NotEnoughSpaceError(
            f"needs {format_nbytes(need)} at '{directory}', {format_nbytes(have)} free; nothing was written. "
            "Free some space or choose another output location")


def _temp_prefix(target: Path, *, leased: bool = False) -> str:
    space = f"+{_PID_SPACE}" if _PID_SPACE else ""
    return f".{target.name}.{os.getpid()}@{_HOST}{space}{'~lease' if leased else ''}."


#: A ``--distributed`` run's rank 0 renews its lease (touches its temp output) this often.
LEASE_RENEW_S = 10.0
DEFAULT_LEASE_EXPIRY_S = 120.0


def lease_expiry_s() -> float:
    """Seconds without renewal after which another host's leased leftover counts as dead (env
    ``DSCKPT_LEASE_EXPIRY_S``, default 120: twelve missed renewals; a live rank 0 renews every 10 s). Never less
    than three renewal periods: ``DSCKPT_LEASE_EXPIRY_S=0`` would otherwise remove live runs' outputs."""
    try:
        value = float(os.environ.get("DSCKPT_LEASE_EXPIRY_S", DEFAULT_LEASE_EXPIRY_S))
    except ValueError:
        return DEFAULT_LEASE_EXPIRY_S
    return max(value, 3 * LEASE_RENEW_S)


@contextlib.contextmanager
def lease(path: Path, *, renew_s: float = LEASE_RENEW_S) -> Iterator[None]:
    """Touch ``path``'s mtime every ``renew_s`` seconds while the block runs (a daemon thread): the
    proof, readable from any host, that the run owning this temp output is alive."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(renew_s):
            with contextlib.suppress(OSError):
                os.utime(path)

    thread = threading.Thread(target=renew, name="dsckpt-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def leased_temp(target: str | os.PathLike[str], *, directory: bool) -> Path:
    """Create the temp output of a ``--distributed`` run beside ``target`` (a folder, or an empty file),
    named as leased (see :func:`remove_leftovers`). The caller removes it on failure."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = _temp_prefix(target, leased=True)
    if directory:
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=target.parent))
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
    os.close(fd)
    return Path(tmp)


def fsync_dir(path: Path) -> None:
    """Make the renames into ``path`` durable (where the platform lets a folder be fsync'd)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(target: Path, e: OSError) -> OutputWriteError:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return OutputWriteError(
        f"cannot write '{target}': {e.strerror or e} ({code}) in '{target.parent}'; nothing was written and no "
        "temporary files were left. Free space, fix permissions or choose another output location")


@contextlib.contextmanager
def _write_errors(target: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if e.errno in WRITE_ERRNOS:
            raise _write_error(target, e) from e
        raise


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike[str], *, fsync: bool = True, make_parent: bool = True,
                check: Callable[[Path], None] | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``target`` only if the block completes. ``make_parent=False``:
    never create ``target``'s folder (a ``--distributed`` rank writing into rank 0's temp folder must not
    bring it back after rank 0 removed it).

    ``check`` is called with the temporary file's path once it is complete (closed and fsync'd), before the
    rename: if it raises, the temporary file is removed and ``target`` is left as it was (absent, or the
    previous one), so a written file that fails its check never appears under ``target``'s name.

    ``fsync=False`` skips the fsyncs of the file and of its folder: ``target`` still appears complete
    or not at all to every process, but a power loss or kernel crash soon after may leave it empty
    or partial (the kernel writes it back later, as after ``cp``)."""
    target = Path(target)
    if make_parent:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if check is not None:
            check(Path(tmp))
        publish_modes(tmp)  # private while written and checked; never published private
        try:
            os.replace(tmp, target)  # a symlink at target is replaced as a link
        except OSError as e:
            raise OutputWriteError(f"cannot put the output in place at '{target}': {e.strerror or e}; nothing was "
                                   "written") from e
        if fsync:
            fsync_dir(target.parent)
    except BaseException:
        with uninterrupted(), contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def verification_failed(target: Path, what: str) -> CorruptCheckpointError:
    """The error for a written output that fails its check before being moved into place (``what``: what
    failed, e.g. ``"'w' was not written as planned"``), named by the path it would have had."""
    return CorruptCheckpointError(
        f"verification failed: '{target}': {what}; nothing was moved into place (an existing '{target.name}' is "
        "kept). This is a dsckpt bug or a disk fault: please report it")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str], *, fsync: bool = True, leased: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``target`` only if the block completes.

    An existing ``target`` (allowed by :func:`check_can_write`) is moved aside first and removed
    once the new one is in place. Every file is fsync'd before the rename, unless ``fsync=False``
    (see :func:`atomic_file`: atomic, not crash-durable). ``leased``: name the temporary directory
    as a ``--distributed`` run's (:func:`leased_temp`) and hold its :func:`lease` until it is renamed into place,
    through the final fsync of every file (on a slow shared filesystem that can outlast the lease expiry).
    """
    target = Path(target)
    if leased:
        tmp = leased_temp(target, directory=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent))
    try:
        with lease(tmp) if leased else contextlib.nullcontext():
            yield tmp
            for p in tmp.rglob("*") if fsync else ():
                if p.is_file():
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
            replace_into_place(tmp, target, fsync=fsync)
    except BaseException:
        with uninterrupted():  # a SIGTERM now (torchrun stopping a rank that is unwinding) waits for it
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_into_place(tmp: Path, target: Path, *, fsync: bool = True) -> None:
    """``os.replace(tmp, target)``; an existing ``target`` is moved aside first (named so that a killed
    run's is put back by :func:`remove_leftovers`) and removed once ``tmp`` is in place. ``tmp`` (a complete
    temporary file or folder dsckpt wrote) gets its published mode first (:func:`publish_modes`): the old
    ``target``'s modes are never inherited."""
    old = None
    with _write_errors(target):
        publish_modes(tmp)
    try:
        if target.exists() or target.is_symlink():  # a symlink is moved aside as a link (rename never follows it)
            old = target.with_name(f"{_temp_prefix(target)}old")
            os.replace(target, old)
        os.replace(tmp, target)
    except OSError as e:
        if old is not None and not (target.exists() or target.is_symlink()):
            with contextlib.suppress(OSError):
                os.replace(old, target)
        raise OutputWriteError(f"cannot put the output in place at '{target}': {e.strerror or e}; nothing was "
                               "written (an existing output is kept)") from e
    if fsync:
        fsync_dir(target.parent)
    if old is not None:
        _remove(old)


FSYNC_THREADS = 8  # files fsync'd at once by background_fsync: the disk queues their write-back together


@contextlib.contextmanager
def background_fsync(folder: Path, *, enabled: bool = True) -> Iterator[None]:
    """fsync every file under ``folder`` in background threads while the block runs; leaving the block
    waits for them and raises the first fsync error. For the end of an :func:`atomic_dir` block: the
    disk finishes writing the files while the caller checks them, instead of after.

    If the block raises (a failed check, a signal), its error propagates at once: the threads are
    daemons, so a slow disk delays neither the cleanup nor the exit."""
    files = [p for p in folder.rglob("*") if p.is_file()] if enabled else []
    if not files:
        yield
        return
    todo = list(reversed(files))
    errors: list[OSError] = []
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                path = todo.pop()
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=run, name="dsckpt-fsync", daemon=True)
               for _ in range(min(FSYNC_THREADS, len(files)))]
    for t in threads:
        t.start()
    yield
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def scratch_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder beside ``target``, named like :func:`atomic_dir`'s (so a killed run's copy is
    found by :func:`remove_leftovers`), always removed on exit. For outputs built and checked in a
    file of their own before an ``os.replace`` onto ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent))
    try:
        yield tmp
    finally:
        with uninterrupted():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Run-lock and leftovers


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.dsckpt-lock")


def _acquire_lock(target: Path) -> int:
    """An fd holding an exclusive ``flock`` on OUT's lock file, or :class:`OutputBusyError`."""
    path = _lock_path(target)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise OutputBusyError(
                f"another dsckpt is writing '{target}' ({owner}); wait for it to finish or choose another "
                "output") from None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us may have removed the file after we opened it: lock the live one.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            os.pwrite(fd, f"pid {os.getpid()} on host {_HOST}, started {stamp}\n".encode(), 0)
            return fd
        os.close(fd)


def _release_lock(target: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(_lock_path(target))
    os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftover_owner(target: Path, name: str) -> tuple[int, str, bool] | None:
    """``(pid, host, leased)`` if ``name`` is a temp or moved-aside name of ``target``'s writers. ``host`` is
    ``_HOST`` only where the pid is one of this process table's: the same hostname *and* pid space (names written
    before pid spaces were recorded: the same hostname); otherwise the hostname with the writer's pid space."""
    m = re.fullmatch(re.escape(f".{target.name}.") + r"(\d+)@([^~+]+?)(?:\+([0-9a-f]{8}))?(~lease)?\."
                     r"(?:[A-Za-z0-9_]+\.tmp|old)", name)
    if not m:
        return None
    host = m[2] if m[3] is None or (m[2] == _HOST and m[3] == _PID_SPACE) else f"{m[2]}+{m[3]}"
    return int(m[1]), host, bool(m[4])


def _lease_expired(path: Path) -> bool:
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    return age > lease_expiry_s()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def remove_leftovers(target: Path) -> list[Path]:
    """Remove what killed runs left beside ``target``; call only while holding its lock.

    Returns the paths removed. Leftovers of other hosts, or of live processes, are kept and logged."""
    removed: list[Path] = []
    parent = target.parent
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return removed
    for name in names:
        owner = _leftover_owner(target, name)
        if owner is None:
            continue
        pid, host, leased = owner
        path = parent / name
        if host != _HOST and leased and _lease_expired(path):
            nbytes = _tree_nbytes(path)
            _remove(path)
            removed.append(path)
            logger.warning("removed '%s' (%s), left by a dead --distributed dsckpt run (pid %d on host %s; its lease "
                           "was not renewed for over %.0f s)", path, format_nbytes(nbytes), pid, host,
                           lease_expiry_s())
            continue
        if host != _HOST:
            logger.warning("'%s' was left by dsckpt pid %d on host %s; dsckpt cannot tell from here whether that "
                           "run is alive. If it is not, remove it: rm -rf '%s'", path, pid, host, path)
            continue
        if _pid_alive(pid):
            logger.warning("'%s' belongs to process %d, which is still running but does not hold the lock on "
                           "'%s'; left alone (remove it once that process is gone)", path, pid, target)
            continue
        if name.endswith(".old") and not target.exists():
            os.replace(path, target)
            logger.warning("restored '%s' from '%s', which a killed dsckpt run (pid %d) had moved aside",
                           target, path, pid)
            continue
        nbytes = _tree_nbytes(path)
        _remove(path)
        removed.append(path)
        logger.warning("removed '%s' (%s), left by a killed dsckpt run (pid %d)", path, format_nbytes(nbytes),
                       pid)
    return removed


def _tree_nbytes(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def refuse_overlap(output: str | os.PathLike[str], source: str | os.PathLike[str], hint: str) -> None:
    """Raise :class:`UsageError` when ``output`` is ``source``, lies inside it, or holds it: writing there (and,
    with ``--force``, moving the old OUT aside and deleting it) would modify or delete the input. ``hint`` ends
    the message (what to choose instead)."""
    out, src = Path(output).resolve(), Path(source).resolve()
    if out == src or src in out.parents or out in src.parents:
        raise UsageError(f"output '{output}' overlaps the input '{source}'; {hint}")


@contextlib.contextmanager
def claim_output(target: str | os.PathLike[str], *, force: bool = False,
                 nbytes: int | None = None) -> Iterator[Path]:
    """Hold ``target`` for one writing run: lock it, clean up killed runs' leftovers, refuse an
    existing ``target`` without ``force``, check free space for ``nbytes``; yield the target path.

    Write errors (full disk, quota, read-only filesystem, permissions) inside the block become
    :class:`OutputWriteError`."""
    target = Path(target)
    with _write_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire_lock(target)
    try:
        with _write_errors(target):
            remove_leftovers(target)
            check_can_write(target, force=force)
            if nbytes is not None:
                check_free_space(target.parent, nbytes)
            yield target
    finally:
        _release_lock(target, fd)
