"""Running a scan plan (:mod:`dsckpt.scan_plan`): numpy only; every stored copy of a chunk of one logical tensor
is read and checked in worker threads (``os.preadv``, ``zlib.crc32`` and numpy's loops release the GIL), and the
results are tallied in plan order, so findings are the same whatever the thread count."""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .chunks import fragment_views, place
from .dtypes import DTYPES, from_float32, to_float32
from .errors import CorruptCheckpointError
from .model import (
    Fragment,
    reading_fragments,
)
from .readers.common import FileCache, lookup
from .scan_plan import FP16_MAX, MAX_INDICES, Check, Finding, RawScan, ScanPlan, StoredKind
from .tensor_ref import TensorRef

logger = logging.getLogger(__name__)

__all__ = ["MAX_WORKERS", "default_workers", "run_pool", "scan_pass"]

MAX_WORKERS = 8


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


class _Tally:
    __slots__ = ("count", "first", "nan", "neginf", "numel", "posinf")

    def __init__(self) -> None:
        self.count = self.nan = self.posinf = self.neginf = self.numel = 0
        self.first: list[int] = []

    def add(self, u: _Update) -> None:
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


def scan_pass(plan: ScanPlan, cache: FileCache, *, on_progress: Callable[[int], None] | None,
               workers: int | None) -> tuple[list[Finding], set[tuple[Path, tuple[Any, ...]]], tuple[int, int]]:
    """The value pass of :func:`run_scan` (no CRC completion): findings in tally order, the stored
    tensors read, and (numel scanned, bytes read)."""
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
        return _run_task(task, chunk, pool, local.files)

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
        else:
            run_pool(tasks, work, apply, workers)
    finally:
        for files in opened:
            files.close()
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
            wheres.append([_Where(es.name, f.file, f.key, kind, piece.dtype, f.rank, piece.replica, es.aliases,
                                  es.padding_rows) for f in (*fs, *ss)])
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
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])


MAX_OPEN_FILES = 32  # per scan thread


def _run_task(task: _Task, chunk: int, pool: dict[Any, np.ndarray], files: _OpenFiles) -> list[_Update]:
    """Read and check one chunk (in a worker thread): the tally updates, in tally order.

    Each stored copy gets a buffer of its own only when the copies are compared with each other;
    otherwise every part goes through one buffer, in turn."""
    bufs = [_buffer(pool, slot, DTYPES[d].numpy, chunk)[: task.numel] for slot, d in enumerate(task.dtypes)
            ] if task.compare is not None else []
    out: list[_Update] = []
    for p in task.parts:
        dtype = task.dtypes[p.slot]
        if bufs and p.frag is None:
            part = bufs[p.slot][p.dst: p.dst + p.numel]
        else:
            part = _buffer(pool, "part", DTYPES[dtype].numpy, p.numel)
        _read_into(p.ref, p.src, p.numel, part, files)
        if bufs and p.frag is not None:
            place(part, bufs[p.slot], p.frag, p.k0, task.base)
        nan, posinf, neginf, first = _nonfinite(part, dtype, pool)
        if p.padding:
            if nan + posinf + neginf:
                logger.info("%s %s: non-finite leftover bytes in stage-3 partition padding (ignored)",
                            p.where.file.name, p.where.key)
            out.append(_Update(Check.NONFINITE, p.where, 0, nbytes_read=part.nbytes))
            continue
        out.append(_Update(Check.NONFINITE, p.where, p.numel, nan + posinf + neginf, nan, posinf, neginf,
                           tuple(p.logical(int(i)) for i in first), part.nbytes))
        if p.overflow:
            count, first = _fp16_overflow(part)
            out.append(_Update(Check.FP16_OVERFLOW, p.where, p.numel, count,
                               first=tuple(p.logical(int(i)) for i in first)))
    if task.compare is not None:
        mi, li = task.compare
        differ = _differ(bufs[mi], bufs[li], task.dtypes[li], pool, chunk)
        for p in task.compare_wheres:
            if differ is None:
                out.append(_Update(Check.MISMATCH, p.where, p.numel))
            elif p.frag is None:
                d = differ[p.dst: p.dst + p.numel]
                first = np.flatnonzero(d)[:MAX_INDICES]
                out.append(_Update(Check.MISMATCH, p.where, p.numel, int(np.count_nonzero(d)),
                                   first=tuple(int(i) + p.lo for i in first)))
            else:  # the part's elements, wherever they lie in the chunk, in order
                views = [(k, v.reshape(-1))
                         for k, v in fragment_views(differ, p.frag, p.k0, p.k0 + p.numel, task.base)]
                count = sum(int(np.count_nonzero(v)) for _, v in views)
                at = [p.frag.dst_index(k + int(i)) for k, v in views for i in np.flatnonzero(v)[:MAX_INDICES]]
                out.append(_Update(Check.MISMATCH, p.where, p.numel, count, first=tuple(at[:MAX_INDICES])))
    return out


def _read_into(ref: Any, start: int, numel: int, out: np.ndarray, files: _OpenFiles) -> None:
    if isinstance(ref, TensorRef):
        if not ref.is_contiguous():
            import torch  # strided stored tensors only (never written by DeepSpeed): torch gathers them

            got = ref.read(start, numel).contiguous()
            out.view(np.uint8)[:] = got.reshape(-1).view(torch.uint8).numpy()
            return
        ref.read_numpy(start, numel, out=out, fd=files.fd(ref.storage.path))
    else:  # a SafetensorsRef
        path = getattr(ref, "path", None)
        ref.read_numpy(start, numel, out=out, fd=None if path is None else files.fd(path))


# The exponent bits of each IEEE type: a value is inf/NaN exactly when all of them are set.
_EXPONENT = {"bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00), "float32": ("<u4", 0x7F800000)}


def _nonfinite(x: np.ndarray, dtype: str, pool: dict[Any, np.ndarray]) -> tuple[int, int, int, np.ndarray]:
    """``(nan, +inf, -inf, first indices)`` of a chunk of stored ``dtype`` bytes (see :mod:`dsckpt.dtypes`).

    Proving a chunk finite costs one AND and one max over its exponent bits (no float conversion,
    no mask); only a chunk that holds inf/NaN is counted exactly."""
    none = np.empty(0, dtype=np.intp)
    exp = _EXPONENT.get(dtype)
    if exp is not None:
        view, mask = exp
        bits = x.view(view)
        tmp = _buffer(pool, "exponent", view, len(bits))
        np.bitwise_and(bits, mask, out=tmp)
        if int(tmp.max()) != mask:
            return 0, 0, 0, none
        f = to_float32(x, dtype)
    elif x.dtype.kind in "fc":
        with np.errstate(all="ignore"):
            if np.isfinite(np.sum(x)):
                return 0, 0, 0, none
        f = x
    else:
        return 0, 0, 0, none
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
        if x.max() <= FP16_MAX and x.min() >= -FP16_MAX:  # a NaN fails both: counted below
            return 0, np.empty(0, dtype=np.intp)
        over = np.isfinite(x) & (np.abs(x) > FP16_MAX)
    return int(np.count_nonzero(over)), np.flatnonzero(over)[:MAX_INDICES]


def _differ(master: np.ndarray, lowp: np.ndarray, lowp_dtype: str, pool: dict[Any, np.ndarray],
            chunk: int) -> np.ndarray | None:
    """Where the stored 16-bit values differ from the fp32 master rounded to ``lowp_dtype`` (all three
    finite), or None when the chunk is proven equal bit for bit (the common case: no mask is built)."""
    n = len(master)
    rounded = _buffer(pool, "rounded", "<u2", chunk)[:n]
    if lowp_dtype == "bfloat16":
        # from_float32's round to nearest even, in place in a reused buffer; NaN masters may come out
        # wrong here, which only sends the chunk to the exact comparison below.
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
    if np.array_equal(rounded, lowp.view(np.uint16)):
        return None
    r = to_float32(from_float32(master, lowp_dtype), lowp_dtype)
    lo = to_float32(lowp, lowp_dtype)
    with np.errstate(invalid="ignore"):
        return np.isfinite(master) & np.isfinite(r) & np.isfinite(lo) & (r != lo)


def _tree_ref(cache: FileCache, r: RawScan) -> TensorRef:
    obj = lookup(cache.tree(r.file), r.key, r.file)
    assert isinstance(obj, TensorRef), "plan_scan only plans raw scans of tensors"
    return obj


