"""Running a scan plan (:mod:`dsckpt.scan_plan`): numpy only; every stored copy of a chunk of one logical tensor
is read and checked in worker threads or worker processes, and the results are tallied in plan order, so findings
are the same whatever the worker count or kind.

Threads or processes (:func:`use_processes`): threads share the parsed files and the CRC-32 checks, and
``os.preadv``, the CRC and numpy's loops release the GIL -- but Python holds it between those calls, a couple of
dozen times per block, and on a 16-core host eight threads kept only about four cores busy (issue 35: ``scan`` of
a 1B ZeRO-2 bf16 checkpoint 1.40-1.63x ``cat``). Worker processes each have their own interpreter. They cost a
start (a ``fork`` each, a few ms; ``forkserver`` where the calling process already runs other threads, e.g. a
``--distributed`` rank's gloo threads, which a fork must not copy mid-lock) and a pickle of every batch of tasks
and its results, so they are used only where they pay: at least :data:`PROCESS_MIN_WORKERS` workers and at least
:data:`PROCESS_MIN_NBYTES` to read (the 2-core machine gets 2 threads), never under ``--distributed`` (each rank
is one process of many already), and ``DSCKPT_SCAN_PROCESSES=1``/``0`` forces either way.

A worker process cannot add to the parent's :class:`~dsckpt.crc.RecordCheck` objects: each task is pickled with
its checks replaced by stand-ins (:class:`_CrcParts`) that record what the task's reads hand them -- ``(offset,
crc32, nbytes)`` per range read -- and the parent adds those to the real checks (``add_crc``, which chains
neighbouring ranges with :func:`~dsckpt.crc.crc32_combine`) in task order, before the task's tallies, so a
damaged record raises the same error, naming the same record, as with threads."""

from __future__ import annotations

import bisect
import io
import logging
import math
import os
import pickle
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import crc, limits
from .chunks import fragment_views, place
from .dtypes import DTYPES, from_float32, to_float32
from .errors import CorruptCheckpointError, WorkerLostError
from .model import (
    Fragment,
    reading_fragments,
)
from .readers.common import FileCache, lookup
from .safe_load import load_work_batch
from .scan_plan import FP16_MAX, MAX_INDICES, Check, Finding, RawScan, ScanPlan, StoredKind
from .tensor_ref import TensorRef, byte_view

logger = logging.getLogger(__name__)

__all__ = ["MAX_WORKERS", "PROCESSES_ENV", "default_workers", "run_pool", "scan_pass", "use_processes"]

MAX_WORKERS = 8
PROCESSES_ENV = "DSCKPT_SCAN_PROCESSES"  # "1": worker processes whenever workers > 0; "0": threads always
PROCESS_MIN_WORKERS = 4
PROCESS_MIN_NBYTES = 1 << 30


def default_workers() -> int:
    """Threads :func:`run_scan` uses when not told: one per core, at most :data:`MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


@dataclass
class _Where:
    name: str | None
    file: Path
    key: tuple[Any, ...]
    kind: StoredKind
    dtype: str
    rank: int | None
    replica: int
    aliases: tuple[str, ...]
    padding_rows: tuple[int, int] | None = None
    # a trained param's per-element optimizer state: whether every value is zero is tallied (a state reset)
    zero_check: bool = False
    state_key: str | None = None


@dataclass(frozen=True, eq=False)
class _Part:
    """``numel`` elements from element ``src`` of ``ref``, into element ``dst`` of piece ``slot``'s
    chunk buffer; ``lo`` is the first element's logical (or stored, for raw scans) index."""

    slot: int
    where: _Where
    ref: Any
    src: int
    numel: int
    dst: int
    lo: int
    overflow: bool
    padding: bool = False  # stage-3 partition padding (RawScan.partition_padding): read, never reported
    # A fragment strided in the logical tensor (a TP row slice): the part is its elements [k0, k0 + numel), read
    # in one go from ``src``; element i lands at logical ``frag.dst_index(k0 + i)`` (``dst``/``lo``: the first's).
    frag: Fragment | None = None
    k0: int = 0

    def logical(self, i: int) -> int:
        """Logical (or stored) index of this part's ``i``-th element."""
        return self.lo + i if self.frag is None else self.frag.dst_index(self.k0 + i)


@dataclass(frozen=True, eq=False)
class _Task:
    """One chunk ``[base, base + numel)`` of one logical tensor: every stored copy of it."""

    dtypes: tuple[str, ...]  # per slot
    parts: tuple[_Part, ...]  # in tally order: slot by slot, fragment by fragment
    base: int
    numel: int
    compare: tuple[int, int] | None  # (master slot, 16-bit slot)
    compare_wheres: tuple[_Part, ...]  # 16-bit fragments' parts, for where their elements are
    numel_scanned: int


@dataclass(frozen=True)
class _Update:
    check: Check
    where: _Where
    numel: int
    count: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    first: tuple[int, ...] = ()
    nbytes_read: int = 0
    nonzero: bool = False


class _Tally:
    __slots__ = ("count", "first", "nan", "neginf", "nonzero", "numel", "posinf")

    def __init__(self) -> None:
        self.count = self.nan = self.posinf = self.neginf = self.numel = 0
        self.first: list[int] = []
        self.nonzero = False

    def add(self, u: _Update) -> None:
        self.nonzero = self.nonzero or u.nonzero
        self.numel += u.numel
        self.count += u.count
        self.nan += u.nan
        self.posinf += u.posinf
        self.neginf += u.neginf
        if len(self.first) < MAX_INDICES:
            self.first += u.first[: MAX_INDICES - len(self.first)]


class _Collector:
    def __init__(self) -> None:
        self.tallies: dict[tuple[Check, str | None, Path, tuple[Any, ...], int, tuple[int, int] | None],
                           tuple[_Where, _Tally]] = {}

    def get(self, check: Check, where: _Where) -> _Tally:
        k = (check, where.name, where.file, where.key, where.replica, where.padding_rows)
        if k not in self.tallies:
            self.tallies[k] = (where, _Tally())
        return self.tallies[k][1]

    def findings(self) -> list[Finding]:
        out = []
        for (check, *_), (w, t) in self.tallies.items():
            if t.count:
                out.append(Finding(check, w.name, w.file, w.key, w.kind, w.dtype, t.count, t.numel,
                                   tuple(t.first), t.nan, t.posinf, t.neginf, w.rank, w.replica, w.aliases,
                                   w.padding_rows))
        return out

    def zero_states(self) -> dict[tuple[str, str], bool]:
        """``(param, state) -> any value not zero`` over every stored copy of each tallied optimizer state."""
        out: dict[tuple[str, str], bool] = {}
        for (check, *_), (w, t) in self.tallies.items():
            if check is Check.NONFINITE and w.zero_check and w.name is not None and t.numel:
                k = (w.name, w.state_key or w.kind.value)
                out[k] = out.get(k, False) or t.nonzero
        return out


def use_processes(plan: ScanPlan, workers: int, processes: bool | None = None) -> bool:
    """Whether :func:`scan_pass` runs its tasks in worker processes rather than threads: ``processes`` if given,
    else ``DSCKPT_SCAN_PROCESSES`` (``1``/``0``) if set, else at least :data:`PROCESS_MIN_WORKERS` workers and
    at least :data:`PROCESS_MIN_NBYTES` planned (never with ``workers <= 0``: that is this thread only).

    Why those numbers: processes free the work from the GIL, which only limits threads where there are enough
    cores to outrun it (two threads keep the 2-core machine busy); a pool costs a start and a pickle of every
    batch, which a checkpoint of a GiB or more (seconds of work at best) hides."""
    if workers <= 0:
        return False
    if processes is None:
        env = os.environ.get(PROCESSES_ENV, "")
        if env in ("0", "1"):
            return env == "1"
        return workers >= PROCESS_MIN_WORKERS and plan_nbytes(plan) >= PROCESS_MIN_NBYTES
    return processes


def plan_nbytes(plan: ScanPlan) -> int:
    """The bytes ``plan`` reads (every stored copy of every entry, and the raw ranges)."""
    return (sum(p.numel * DTYPES[p.dtype].itemsize for e in plan.entries for p in e.pieces)
            + sum(r.numel * DTYPES[r.dtype].itemsize for r in plan.raw))


def scan_pass(plan: ScanPlan, cache: FileCache, *, on_progress: Callable[[int], None] | None,
              workers: int | None, processes: bool | None = None,
              zero_states: dict[tuple[str, str], bool] | None = None
              ) -> tuple[list[Finding], set[tuple[Path, tuple[Any, ...]]], tuple[int, int]]:
    """The value pass of :func:`run_scan` (no CRC completion): findings in tally order, the stored
    tensors read, and (numel scanned, bytes read). ``processes``: see :func:`use_processes`. ``zero_states``, if
    given, receives ``(param, optimizer state key) -> whether any value is not zero`` for every trained param's
    per-element optimizer state read (found on the way: the check costs nothing more for fp32 states)."""
    col = _Collector()
    stored: set[tuple[Path, tuple[Any, ...]]] = set()
    totals = [0, 0]  # numel scanned, bytes read
    chunk = max(1, plan.chunk_numel)
    workers = default_workers() if workers is None else workers
    local = threading.local()
    opened: list[_OpenFiles] = []  # every thread's, closed at the end

    def work(task: _Task) -> list[_Update]:
        pool = getattr(local, "pool", None)
        if pool is None:
            pool = local.pool = {}
            local.files = _OpenFiles()
            opened.append(local.files)  # list.append is atomic
        return _run_task(task, pool, local.files)

    def apply(task: _Task, updates: list[_Update]) -> None:
        for u in updates:
            col.get(u.check, u.where).add(u)
            if u.nbytes_read:
                totals[1] += u.nbytes_read
                if on_progress is not None:
                    on_progress(u.nbytes_read)
        totals[0] += task.numel_scanned

    tasks = _tasks(plan, cache, chunk, stored)
    try:
        if workers <= 0:
            for task in tasks:
                apply(task, work(task))
        elif use_processes(plan, workers, processes):
            run_processes(tasks, apply, workers)
        else:
            run_pool(tasks, work, apply, workers)
    finally:
        for files in opened:
            files.close()
    if zero_states is not None:
        zero_states.update(col.zero_states())
    return col.findings(), stored, (totals[0], totals[1])


def run_pool(tasks: Iterator[_Task], work: Callable[[_Task], list[_Update]],
              apply: Callable[[_Task, list[_Update]], None], workers: int) -> None:
    """``work`` the tasks in ``workers`` threads and ``apply`` the results in task order, as
    ``for t in tasks: apply(t, work(t))`` would (an error raised for a task, or by ``tasks``, is raised
    once every earlier task is applied).

    The workers take the next task themselves (under a lock: ``tasks`` runs in one thread at a time)
    and whichever finishes the oldest pending task applies it and every finished one after it; at most
    ``4 * workers`` are taken ahead of the oldest. The calling thread only waits: it no longer competes
    with the workers for the GIL once per task (ZeRO-3 1B scan on the 16-core host, zlib's CRC:
    2.36 s vs 2.55 s with a producer/consumer calling thread; issue 12)."""
    claim, ordered = threading.Lock(), threading.Lock()
    room = threading.Semaphore(4 * workers)
    numbered = enumerate(tasks)
    finished: dict[int, tuple[_Task | None, list[_Update] | BaseException]] = {}
    state: dict[str, Any] = {"applied": 0, "error": None, "stop": False, "count": 0}

    def halt(error: BaseException) -> None:
        state["error"], state["stop"] = error, True
        room.release(workers)  # wake any worker waiting for room, to see the stop

    def finish(i: int, task: _Task | None, result: list[_Update] | BaseException) -> None:
        with ordered:
            finished[i] = (task, result)
            while state["error"] is None and state["applied"] in finished:
                t, r = finished.pop(state["applied"])
                if isinstance(r, BaseException):
                    halt(r)
                    break
                try:
                    assert t is not None
                    apply(t, r)
                except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
                    halt(e)
                    break
                state["applied"] += 1
                room.release()

    def run() -> None:
        while True:
            room.acquire()
            with claim:
                if state["stop"]:
                    return
                try:
                    i, task = next(numbered)
                except StopIteration:
                    state["stop"] = True
                    return
                except BaseException as e:  # noqa: BLE001 - a corrupt checkpoint found while planning a task
                    state["stop"] = True
                    finish(state["count"], None, e)
                    return
                state["count"] = i + 1
            try:
                result: list[_Update] | BaseException = work(task)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread, in task order
                result = e
            finish(i, task, result)

    threads = [threading.Thread(target=run, name=f"dsckpt-scan-{k}", daemon=True) for k in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # a timed join keeps Ctrl-C and SIGTERM prompt
    finally:
        state["stop"] = True
        room.release(workers)
        for t in threads:
            t.join()
    if state["error"] is not None:
        raise state["error"]


# --------------------------------------------------------------------------------------------
# Worker processes

# Consecutive tasks go to a worker process together, as one pickle each way: a ZeRO-2 chunk of 512K elements
# (every stored copy) is ~7 MB, so a batch holds a few; tasks of small tensors up to BATCH_TASKS.
BATCH_NBYTES = 32 << 20
BATCH_TASKS = 64

_CrcPart = tuple[int, int, int, int]  # (check token, offset in the record, CRC-32, nbytes)


def run_processes(tasks: Iterator[_Task], apply: Callable[[_Task, list[_Update]], None], workers: int) -> None:
    """:func:`run_pool` in ``workers`` worker processes: batches of tasks are pickled to them (each record's
    :class:`~dsckpt.crc.RecordCheck` replaced by a :class:`_CrcParts` stand-in), at most ``2 * workers`` batches
    ahead of the oldest, and every task's CRC-32 parts and tally updates are applied here, in task order; an
    error raised for a task, or by ``tasks``, is raised once every earlier task is applied."""
    import multiprocessing  # here, not at the top: a scan in threads (small checkpoints, few cores) never pays
    from concurrent.futures import ProcessPoolExecutor  # for importing them (~15 ms of start-up)
    from concurrent.futures.process import BrokenProcessPool

    checks: dict[int, crc.RecordCheck] = {}
    ctx = multiprocessing.get_context(_start_method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([__name__])  # each worker forked with dsckpt and numpy imported
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(BLOCK_NBYTES, COMPARE_BLOCK_NUMEL))
    batches = _batches(tasks)
    pending: deque[tuple[list[_Task], Future[Any]]] = deque()
    planning: BaseException | None = None
    more = True
    try:
        while True:
            while more and planning is None and len(pending) < 2 * workers:
                try:
                    batch = next(batches)
                except StopIteration:
                    more = False
                    break
                except BaseException as e:  # noqa: BLE001 - a corrupt checkpoint found while planning a task
                    planning = e
                    break
                buf = io.BytesIO()
                _TaskPickler(buf, checks).dump(batch)
                pending.append((batch, ex.submit(_work_batch, buf.getvalue())))
            if not pending:
                break
            batch, future = pending.popleft()
            try:
                results, failed = future.result()
            except BrokenProcessPool:
                raise WorkerLostError(
                    f"a {ctx.get_start_method()}-started worker process ended without a result (killed by the "
                    "system? the out-of-memory killer names it in the kernel log); nothing was written — rerun "
                    f"with fewer --workers, or with {PROCESSES_ENV}=0 for threads") from None
            for task, (updates, parts) in zip(batch, results):
                _add_crcs(checks, parts)
                apply(task, updates)
            if failed is not None:
                _add_crcs(checks, failed[1])
                raise failed[0]
        if planning is not None:
            raise planning
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _start_method() -> str:
    """``fork`` (a few ms a worker) on Linux while this process runs one thread; else ``forkserver``: a fork
    copies only the forking thread, and a lock another thread holds (gloo's under ``--distributed``, a logging
    handler's) would stay held in the child forever."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return "fork"
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _batches(tasks: Iterator[_Task]) -> Iterator[list[_Task]]:
    """``tasks`` in runs of about :data:`BATCH_NBYTES` read; an error raised by ``tasks`` comes after the run
    of the tasks before it."""
    batch: list[_Task] = []
    nbytes = 0
    try:
        for task in tasks:
            batch.append(task)
            nbytes += sum(p.numel * DTYPES[task.dtypes[p.slot]].itemsize for p in task.parts)
            if nbytes >= BATCH_NBYTES or len(batch) >= BATCH_TASKS:
                yield batch
                batch, nbytes = [], 0
    except BaseException:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def _add_crcs(checks: dict[int, crc.RecordCheck], parts: list[_CrcPart]) -> None:
    for token, offset, value, nbytes in parts:
        checks[token].add_crc(offset, value, nbytes)


class _TaskPickler(pickle.Pickler):
    """Pickles tasks with every :class:`~dsckpt.crc.RecordCheck` as a token (``checks`` maps it back)."""

    def __init__(self, file: io.BytesIO, checks: dict[int, crc.RecordCheck]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.checks = checks

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, crc.RecordCheck):
            self.checks[id(obj)] = obj
            return (id(obj), obj.done)
        return None


class _CrcParts:
    """A worker process's stand-in for one record's :class:`~dsckpt.crc.RecordCheck` (the reads' interface:
    ``done``, ``add_crc``, ``update``): it appends ``(token, offset, crc32, nbytes)`` for the parent to add.
    ``done``: the record was verified when the task was sent (the reads then skip the CRC, as with threads)."""

    __slots__ = ("done", "out", "token")

    def __init__(self, token: int, done: bool, out: list[_CrcPart]) -> None:
        self.token, self.done, self.out = token, done, out

    def add_crc(self, offset: int, value: int, nbytes: int) -> None:
        if nbytes:
            self.out.append((self.token, offset, value, nbytes))

    def update(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        if not self.done:
            self.add_crc(offset, crc.crc32(data), memoryview(data).nbytes)


_WORKER: dict[str, Any] = {}


def _init_worker(block_nbytes: int, compare_numel: int) -> None:
    """A worker process's start: Ctrl-C is the parent's to handle (it shuts the pool down); the block sizes are
    the parent's (a ``forkserver`` child would have the defaults); one buffer pool and file cache for all tasks."""
    global BLOCK_NBYTES, COMPARE_BLOCK_NUMEL
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    BLOCK_NBYTES, COMPARE_BLOCK_NUMEL = block_nbytes, compare_numel
    _WORKER.update(pool={}, files=_OpenFiles())


def _work_batch(data: bytes) -> tuple[list[tuple[list[_Update], list[_CrcPart]]],
                                      tuple[BaseException, list[_CrcPart]] | None]:
    """Run a pickled batch of tasks (in a worker process): each task's updates and CRC-32 parts, and the error
    that stopped the batch, if any, with the CRC parts of its task read before it."""
    out: list[_CrcPart] = []
    tasks = load_work_batch(data, lambda pid: _CrcParts(pid[0], pid[1], out))
    results: list[tuple[list[_Update], list[_CrcPart]]] = []
    for task in tasks:
        try:
            updates = _run_task(task, _WORKER["pool"], _WORKER["files"])
        except Exception as e:  # noqa: BLE001 - raised in the parent, in task order
            return results, (e, out)
        results.append((updates, out[:]))
        out.clear()
    return results, None


_STATE_KINDS = frozenset({StoredKind.EXP_AVG, StoredKind.EXP_AVG_SQ, StoredKind.OPTIM_STATE})


def _tasks(plan: ScanPlan, cache: FileCache, chunk: int,
           stored: set[tuple[Path, tuple[Any, ...]]]) -> Iterator[_Task]:
    """The chunks to check, in plan order. Resolves every stored tensor here, in the calling thread."""
    for es in plan.entries:
        wheres: list[list[_Where]] = []
        refs: list[list[Any]] = []
        # Contiguous fragments sorted by destination, for bisection; fragments strided in the logical tensor (TP
        # row slices) apart: each becomes one part per chunk it meets, read in one go, not one per row.
        frags, striding = [], []
        for piece in es.pieces:
            fs, ss = reading_fragments(piece)
            frags.append(fs)
            striding.append(ss)
        starts = [[f.dst_offset for f in fs] for fs in frags]
        for piece, kind, fs, ss in zip(es.pieces, es.kinds, frags, striding):
            zero_check = kind in _STATE_KINDS and es.padding_rows is None
            wheres.append([_Where(es.name, f.file, f.key, kind, piece.dtype, f.rank, piece.replica, es.aliases,
                                  es.padding_rows, zero_check, piece.state_key) for f in (*fs, *ss)])
            refs.append([cache.tensor(f.file, f.key) for f in (*fs, *ss)])
            for f in (*fs, *ss):
                stored.add((f.file, f.key))
            if piece.numel != es.numel:
                raise CorruptCheckpointError(
                    f"tensor '{es.name}': its {piece.label} copy has {piece.numel} elements in the files, "
                    f"its shape needs {es.numel}; the checkpoint metadata is inconsistent")
        dtypes = tuple(p.dtype for p in es.pieces)
        for a in range(0, es.numel, chunk):
            b = min(es.numel, a + chunk)
            slots = [_chunk_parts(pi, frags[pi], starts[pi], striding[pi], wheres[pi], refs[pi], a, b,
                                  pi in es.overflow_pieces) for pi in range(len(es.pieces))]
            compare = slots[es.compare[1]] if es.compare is not None else []
            yield _Task(dtypes, tuple(p for parts in slots for p in parts), a, b - a, es.compare, tuple(compare),
                        (b - a) * len(es.pieces))
    for r in plan.raw:
        stored.add((r.file, r.key))
        ref = _tree_ref(cache, r)
        kind = StoredKind.CLIENT_STATE if r.client_state else StoredKind.OTHER
        w = _Where(None, r.file, r.key, kind, r.dtype, None, 0, ())
        for a in range(0, r.numel, chunk):
            n = min(chunk, r.numel - a)
            yield _Task((r.dtype,), (_Part(0, w, ref, r.start + a, n, 0, r.start + a, False, r.partition_padding),),
                        r.start + a, n, None, (), n)


def _chunk_parts(slot: int, flat: list[Fragment], starts: list[int], striding: list[Fragment], wheres: list[_Where],
                 refs: list[Any], a: int, b: int, overflow: bool) -> list[_Part]:
    """The parts of one stored copy (``slot``) that chunk ``[a, b)`` reads: the contiguous fragments it meets
    (found by bisection), and for each fragment strided in the logical tensor the run of its elements landing in
    the chunk (consecutive in its source), in logical order of their first elements, so a finding lists its
    indices in increasing order."""
    parts = []
    for fi in range(max(0, bisect.bisect_right(starts, a) - 1), len(flat)):
        f = flat[fi]
        if f.dst_offset >= b:
            break
        lo, hi = max(a, f.dst_offset), min(b, f.dst_offset + f.numel)
        if lo < hi:
            parts.append(_Part(slot, wheres[fi], refs[fi], f.src_offset + lo - f.dst_offset, hi - lo, lo - a, lo,
                               overflow))
    for si, f in enumerate(striding, len(flat)):
        k0, k1 = f.window(a, b)
        if k0 < k1:
            lo = f.dst_index(k0)
            parts.append(_Part(slot, wheres[si], refs[si], f.src_offset + k0, k1 - k0, lo - a, lo, overflow,
                               frag=f, k0=k0))
    if striding:
        parts.sort(key=lambda p: p.lo)
    return parts


def _buffer(pool: dict[Any, np.ndarray], key: Any, dtype: Any, numel: int) -> np.ndarray:
    """``numel`` elements of ``dtype`` at the start of the reused byte buffer ``key`` of this thread's
    ``pool`` (grown when too small), for whatever dtype each use needs."""
    nbytes = numel * np.dtype(dtype).itemsize
    raw = pool.get(key)
    if raw is None or raw.nbytes < nbytes:
        raw = pool[key] = np.empty(nbytes, dtype=np.uint8)
    return raw[:nbytes].view(dtype)


class _OpenFiles:
    """The files one scan thread reads, each opened once (at most :data:`MAX_OPEN_FILES`): opening and
    closing a file for every 2 MiB read cost two more GIL round trips per read, which eight threads
    contend for (the 16-core host, issue 12)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self.fds.get(path)
        if fd is None:
            if len(self.fds) >= MAX_OPEN_FILES:
                os.close(self.fds.pop(next(iter(self.fds))))
            fd = self.fds[path] = limits.open_parsed(path)
        return fd

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])


MAX_OPEN_FILES = 32  # per scan thread


# Every byte is checked while it is in cache: a stored range is read in blocks of BLOCK_NBYTES into one reused
# buffer per thread, and each block's CRC-32 and inf/NaN (and fp16-overflow) checks run on it before the next block
# is read -- no second pass over memory, no chunk-sized buffers per stored copy; a master and its 16-bit copy are
# compared COMPARE_BLOCK_NUMEL elements at a time, both blocks read just before (issue 35). The sizes are a
# trade-off measured on a lent 16-core host (bench/results/scan-2026-11-26.md): eight threads each take the GIL a
# few times a block, so 1 MiB blocks (L2-sized) made `scan` of a 1B ZeRO-2 checkpoint 1.96x `cat`, 2 MiB 1.61x,
# 4 MiB 1.31x (before: 1.42x); a 4 MiB block (plus its exponent bits) stays in L3 there and on the 2-core machine.
BLOCK_NBYTES = 4 << 20
COMPARE_BLOCK_NUMEL = 1 << 19


class _Acc:
    """What one part's blocks found so far."""

    __slots__ = ("differ", "differ_first", "first", "nan", "neginf", "nonzero", "over", "over_first", "posinf")

    def __init__(self) -> None:
        self.nonzero = False
        self.nan = self.posinf = self.neginf = self.over = self.differ = 0
        self.first: list[int] = []
        self.over_first: list[int] = []
        self.differ_first: list[int] = []


def _run_task(task: _Task, pool: dict[Any, np.ndarray], files: _OpenFiles) -> list[_Update]:
    """Read and check one chunk (in a worker thread): the tally updates, in tally order (part by part, then the
    master/16-bit comparison), the same whatever the block sizes."""
    acc = [_Acc() for _ in task.parts]
    compare = task.compare
    for k, p in enumerate(task.parts):
        if compare is None or p.slot not in compare:
            _stream(task.dtypes[p.slot], p, acc[k], pool, files)
    if compare is not None:
        _compare(task, acc, pool, files)
    out: list[_Update] = []
    for p, a in zip(task.parts, acc):
        nbytes = p.numel * DTYPES[task.dtypes[p.slot]].itemsize
        count = a.nan + a.posinf + a.neginf
        if p.padding:
            if count:
                logger.info("%s %s: non-finite leftover bytes in stage-3 partition padding (ignored)",
                            p.where.file.name, p.where.key)
            out.append(_Update(Check.NONFINITE, p.where, 0, nbytes_read=nbytes))
            continue
        out.append(_Update(Check.NONFINITE, p.where, p.numel, count, a.nan, a.posinf, a.neginf, tuple(a.first),
                           nbytes, a.nonzero))
        if p.overflow:
            out.append(_Update(Check.FP16_OVERFLOW, p.where, p.numel, a.over, first=tuple(a.over_first)))
    if compare is not None:
        index = {id(p): k for k, p in enumerate(task.parts)}
        for p in task.compare_wheres:
            a = acc[index[id(p)]]
            out.append(_Update(Check.MISMATCH, p.where, p.numel, a.differ, first=tuple(a.differ_first)))
    return out


def _stream(dtype: str, p: _Part, a: _Acc, pool: dict[Any, np.ndarray], files: _OpenFiles) -> None:
    """Read part ``p`` block by block into one reused buffer, checking each block while it is in cache."""
    np_dtype = DTYPES[dtype].numpy
    step = max(1, BLOCK_NBYTES // np.dtype(np_dtype).itemsize)
    buf = _buffer(pool, "block", np_dtype, min(step, p.numel))
    raw = byte_view(buf)
    itemsize = buf.itemsize
    reader = _open(p.ref, p.src, p.numel, files)
    for off in range(0, p.numel, step):
        n = min(step, p.numel - off)
        _check(reader.read_into(buf[:n], raw[: n * itemsize]), dtype, p, off, a, pool)
    reader.close()


def _compare(task: _Task, acc: list[_Acc], pool: dict[Any, np.ndarray], files: _OpenFiles) -> None:
    """The master and 16-bit slots of a chunk, COMPARE_BLOCK_NUMEL logical elements at a time: each block of
    both copies is read (and checked) just before the two are compared."""
    assert task.compare is not None
    mi, li = task.compare
    step = COMPARE_BLOCK_NUMEL
    slots = [(slot, task.dtypes[slot], [(k, p) for k, p in enumerate(task.parts) if p.slot == slot])
             for slot in (mi, li)]
    readers = {k: _open(p.ref, p.src, p.numel, files) for _, _, parts in slots for k, p in parts}
    paths = {k: _path(p.ref) for _, _, parts in slots for k, p in parts}
    end = task.base + task.numel
    for s in range(task.base, end, step):
        e = min(end, s + step)
        bufs = []
        for slot, dtype, parts in slots:
            np_dtype = DTYPES[dtype].numpy
            buf = _buffer(pool, ("compare", slot == li), np_dtype, step)[: e - s]
            for k, p in parts:
                ka, kb = _clip(p, s, e)
                if ka >= kb:
                    continue
                path = paths[k]
                if path is not None:  # this thread's descriptor, re-fetched: other reads may have evicted it
                    readers[k].fd = files.fd(path)
                if p.frag is None:
                    x = readers[k].read_into(buf[p.lo + ka - s: p.lo + kb - s])
                else:
                    x = readers[k].read_into(_buffer(pool, "part", np_dtype, kb - ka))
                    place(x, buf, p.frag, p.k0 + ka, s)
                _check(x, dtype, p, ka, acc[k], pool)
            bufs.append(buf)
        differ = _differ(bufs[0], bufs[1], task.dtypes[li], pool, step)
        if differ is None:
            continue
        for k, p in slots[1][2]:
            ka, kb = _clip(p, s, e)
            if ka < kb:
                _add_differ(differ, p, ka, kb, s, acc[k])
    for reader in readers.values():
        reader.close()


def _clip(p: _Part, s: int, e: int) -> tuple[int, int]:
    """The elements ``[ka, kb)`` of part ``p`` (counted from its first) whose logical index lies in ``[s, e)``."""
    if p.frag is None:
        return max(s, p.lo) - p.lo, min(e, p.lo + p.numel) - p.lo
    w0, w1 = p.frag.window(s, e)
    return max(w0, p.k0) - p.k0, min(w1, p.k0 + p.numel) - p.k0


def _add_differ(differ: np.ndarray, p: _Part, ka: int, kb: int, s: int, a: _Acc) -> None:
    """Count the differing elements ``[ka, kb)`` of 16-bit part ``p`` in a block starting at logical ``s``."""
    need = MAX_INDICES - len(a.differ_first)
    if p.frag is None:
        d = differ[p.lo + ka - s: p.lo + kb - s]
        a.differ += int(np.count_nonzero(d))
        if need > 0:
            a.differ_first += [int(i) + p.lo + ka for i in np.flatnonzero(d)[:need]]
        return
    views = [(k, v.reshape(-1)) for k, v in fragment_views(differ, p.frag, p.k0 + ka, p.k0 + kb, s)]
    a.differ += sum(int(np.count_nonzero(v)) for _, v in views)
    if need > 0:
        at = [p.frag.dst_index(k + int(i)) for k, v in views for i in np.flatnonzero(v)[:need]]
        a.differ_first += at[:need]


class _WholeRead:
    """A range read in one go, then handed out block by block: strided stored tensors (never written by
    DeepSpeed; torch gathers them) and refs without :meth:`sequential`."""

    def __init__(self, ref: Any, start: int, numel: int) -> None:
        self.ref, self.start, self.numel, self.done = ref, start, numel, 0
        self.data: np.ndarray | None = None

    def read_into(self, out: np.ndarray, raw: memoryview | None = None) -> np.ndarray:
        if self.data is None:
            if isinstance(self.ref, TensorRef):
                import torch

                got = self.ref.read(self.start, self.numel).contiguous()
                self.data = got.reshape(-1).view(torch.uint8).numpy().view(out.dtype)
            else:
                self.data = self.ref.read_numpy(self.start, self.numel)
        out[...] = self.data[self.done: self.done + out.size]
        self.done += out.size
        return out

    def close(self) -> None:
        self.data = None


def _path(ref: Any) -> Path | None:
    """The file ``ref`` is read from block by block (:meth:`sequential`), or None (:class:`_WholeRead`)."""
    if isinstance(ref, TensorRef):
        return ref.storage.path if ref.is_contiguous() else None
    path = getattr(ref, "path", None)  # a SafetensorsRef
    return path if path is not None and hasattr(ref, "sequential") else None


def _open(ref: Any, start: int, numel: int, files: _OpenFiles) -> Any:
    """A reader of elements ``[start, start + numel)`` of ``ref``, front to back (``read_into``, ``close``)."""
    path = _path(ref)
    if path is None:
        return _WholeRead(ref, start, numel)
    return ref.sequential(start, numel, fd=files.fd(path))


# The exponent bits of each IEEE type: a value is inf/NaN exactly when all of them are set.
_EXPONENT = {"bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00), "float32": ("<u4", 0x7F800000)}
_MAX, _MIN = np.maximum.reduce, np.minimum.reduce


def _check(x: np.ndarray, dtype: str, p: _Part, off: int, a: _Acc, pool: dict[Any, np.ndarray]) -> None:
    """The inf/NaN (and for an fp32 master of an fp16 run, fp16-overflow) check of one block ``x``: elements
    ``[off, off + len(x))`` of part ``p``, added to ``a``.

    fp32/fp64 blocks cost two reductions (max and min: NaN and inf show in them, and so does |x| > 65504),
    16-bit ones one AND and one max over the exponent bits; no mask is built unless the block holds a
    finding."""
    if x.dtype.kind == "f" and x.dtype.itemsize >= 4:
        hi, lo = _MAX(x), _MIN(x)
        finite = -math.inf < lo and hi < math.inf  # False for NaN
        nan = posinf = neginf = 0
        if not finite:
            nan, posinf, neginf, first = _count_nonfinite(x)
            _add_first(a.first, p, off, first)
        if p.overflow and not (finite and -FP16_MAX <= lo and hi <= FP16_MAX):
            count, first = _fp16_overflow(x)
            a.over += count
            _add_first(a.over_first, p, off, first)
        if p.where.zero_check and not a.nonzero:
            a.nonzero = not (hi == 0 and lo == 0)  # NaN compares unequal: not zero
    else:
        nan, posinf, neginf, first = _nonfinite(x, dtype, pool)
        if nan + posinf + neginf:
            _add_first(a.first, p, off, first)
        if p.where.zero_check and not a.nonzero:
            a.nonzero = bool(nan + posinf + neginf) or _any_nonzero_bits(x, dtype)
    a.nan += nan
    a.posinf += posinf
    a.neginf += neginf


def _any_nonzero_bits(x: np.ndarray, dtype: str) -> bool:
    """A block of stored ``dtype`` values holds a value other than +-0 (sign bit ignored)."""
    if x.dtype.kind == "f":
        return bool(np.any(x))
    sign = np.array(1 << (8 * x.dtype.itemsize - 1), dtype=x.dtype)
    return bool(np.any(x & ~sign)) if x.dtype.kind == "u" else bool(np.any(x))


def _add_first(first: list[int], p: _Part, off: int, found: np.ndarray) -> None:
    need = MAX_INDICES - len(first)
    if need > 0:
        first += [p.logical(off + int(i)) for i in found[:need]]


def _nonfinite(x: np.ndarray, dtype: str, pool: dict[Any, np.ndarray]) -> tuple[int, int, int, np.ndarray]:
    """``(nan, +inf, -inf, first indices)`` of a block of stored ``dtype`` bytes (see :mod:`dsckpt.dtypes`).

    Proving a 16-bit block finite costs one AND and one max over its exponent bits (no float conversion,
    no mask); only a block that holds inf/NaN is counted exactly."""
    exp = _EXPONENT.get(dtype)
    if exp is not None:
        view, mask = exp
        bits = x.view(view)
        tmp = _buffer(pool, "exponent", view, len(bits))
        np.bitwise_and(bits, mask, out=tmp)
        if int(_MAX(tmp)) != mask:
            return 0, 0, 0, _NONE
        return _count_nonfinite(to_float32(x, dtype))
    if x.dtype.kind in "fc":
        with np.errstate(all="ignore"):
            if np.isfinite(np.sum(x)):
                return 0, 0, 0, _NONE
        return _count_nonfinite(x)
    return 0, 0, 0, _NONE


_NONE = np.empty(0, dtype=np.intp)


def _count_nonfinite(f: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """``(nan, +inf, -inf, first indices)`` of a float block, counted exactly."""
    bad = ~np.isfinite(f)
    vals = f[bad]
    if vals.dtype.kind == "c":
        nan = int(np.count_nonzero(np.isnan(vals)))
        posinf = int(np.count_nonzero((vals.real == np.inf) | (vals.imag == np.inf)))
        neginf = len(vals) - nan - posinf
    else:
        nan = int(np.count_nonzero(np.isnan(vals)))
        posinf = int(np.count_nonzero(vals == np.inf))
        neginf = int(np.count_nonzero(vals == -np.inf))
    return nan, posinf, neginf, np.flatnonzero(bad)[:MAX_INDICES]


def _fp16_overflow(x: np.ndarray) -> tuple[int, np.ndarray]:
    """Finite float32 values with ``|x| > FP16_MAX``: count and first indices."""
    with np.errstate(invalid="ignore"):
        over = np.isfinite(x) & (np.abs(x) > FP16_MAX)
    return int(np.count_nonzero(over)), np.flatnonzero(over)[:MAX_INDICES]


def _differ(master: np.ndarray, lowp: np.ndarray, lowp_dtype: str, pool: dict[Any, np.ndarray],
            chunk: int) -> np.ndarray | None:
    """Where the stored 16-bit values differ from the fp32 master rounded to ``lowp_dtype`` (all three
    finite), or None when the block is proven equal bit for bit (the common case: no mask is built, and
    every temporary is a reused buffer of the block's size)."""
    n = len(master)
    rounded = _buffer(pool, "rounded", "<u2", chunk)[:n]
    if lowp_dtype == "bfloat16":
        # from_float32's round to nearest even, in place in a reused buffer; NaN masters may come out
        # wrong here, which only sends the block to the exact comparison below.
        u = master.view(np.uint32)
        t = _buffer(pool, "round", "<u4", chunk)[:n]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(rounded, t, casting="unsafe")
    else:
        with np.errstate(over="ignore"):
            np.copyto(rounded.view(np.float16), master, casting="unsafe")
    same = _buffer(pool, "same", np.bool_, chunk)[:n]
    np.not_equal(rounded, lowp.view(np.uint16), out=same)
    if not np.logical_or.reduce(same):
        return None
    r = to_float32(from_float32(master, lowp_dtype), lowp_dtype)
    lo = to_float32(lowp, lowp_dtype)
    with np.errstate(invalid="ignore"):
        return np.isfinite(master) & np.isfinite(r) & np.isfinite(lo) & (r != lo)


def _tree_ref(cache: FileCache, r: RawScan) -> TensorRef:
    obj = lookup(cache.tree(r.file), r.key, r.file)
    assert isinstance(obj, TensorRef), "plan_scan only plans raw scans of tensors"
    return obj


