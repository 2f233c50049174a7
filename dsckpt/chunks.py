"""Bounded-memory streaming of tensors without torch (``to-fp32`` into safetensors).

:func:`plan_piece_chunks` cuts a tensor into bounded reads in output order and :func:`read_chunks`
performs them into a few reused numpy buffers, optionally with reader threads running ahead of the
consumer, so memory stays at a few chunks whatever the size of the tensor.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .dtypes import DTYPES
from .errors import CorruptCheckpointError
from .model import Fragment, Piece
from .readers.common import FileCache
from .tensor_ref import TensorRef

__all__ = ["DEFAULT_CHUNK_NBYTES", "ChunkRead", "GatherRead", "check_numel", "check_tiling", "fragment_views", "place",
           "plan_piece_chunks", "read_chunks", "tiling_problem"]

# Big enough that per-call overhead vanishes (~100 reads per GB), small enough to stay in cache
# between the read and the checks that follow it.
DEFAULT_CHUNK_NBYTES = 8 * 1024 * 1024
# Runs strided in the source (a TP split) are read with their gaps while the gaps hold at most this many times
# the runs' elements (see reads_span): a read then stays within 4 chunks' worth of bytes.
SPAN_GAP_RATIO = 3


def check_numel(piece: Piece, shape: tuple[int, ...], name: str) -> int:
    """The element count of ``shape``; raises if ``piece``'s fragments do not add up to it."""
    numel = 1
    for s in shape:
        numel *= s
    if piece.numel != numel:
        raise CorruptCheckpointError(
            f"tensor '{name}': its {piece.label} copy has {piece.numel} elements in the files, "
            f"the recorded shape {list(shape)} needs {numel}; the checkpoint metadata is inconsistent"
        )
    return numel


@dataclass(frozen=True, eq=False)
class ChunkRead:
    """``numel`` elements of ``ref`` from its flat element ``start``: one bounded read of a streamed
    tensor. ``name`` is the logical tensor it belongs to."""

    name: str
    ref: TensorRef
    start: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.ref.storage.itemsize


def plan_piece_chunks(piece: Piece, shape: tuple[int, ...], cache: FileCache, *, name: str = "?",
                      chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> tuple[ChunkRead, ...] | None:
    """The reads that yield ``piece`` front to back (flat, row-major) in chunks of at most
    ``chunk_nbytes``; their concatenation equals :func:`read_piece`.

    Returns None when the piece cannot be streamed that way (a strided stored tensor, or fragments
    that do not tile the tensor in order); use :func:`read_piece` for it. Reads no tensor data.
    Pieces with strided fragments (tensor-parallel row slices) get :class:`GatherRead` s: still one
    bounded chunk per read, each gathered from the row runs it covers.
    """
    numel = check_numel(piece, shape, name)
    if any(f.strided for f in piece.fragments):
        return _plan_gather_chunks(piece, numel, cache, name, chunk_nbytes)
    frags = sorted(piece.fragments, key=lambda f: f.dst_offset)
    reads: list[ChunkRead] = []
    expected = 0
    dtype = None
    for frag in frags:
        ref = cache.tensor(frag.file, frag.key)
        if dtype is not None and ref.dtype_name != dtype:
            raise CorruptCheckpointError(f"{frag.file}: tensor '{name}' fragments mix {ref.dtype_name} and {dtype}")
        dtype = ref.dtype_name
        if frag.dst_offset != expected or not ref.is_contiguous():
            return None
        if frag.src_offset < 0 or frag.numel < 0 or frag.src_offset + frag.numel > ref.numel:
            raise CorruptCheckpointError(
                f"{frag.file}: tensor '{name}' needs elements [{frag.src_offset}, {frag.src_offset + frag.numel}) "
                f"of a stored tensor with {ref.numel}; the checkpoint metadata does not match its tensors"
            )
        step = max(1, chunk_nbytes // ref.storage.itemsize)
        for start in range(frag.src_offset, frag.src_offset + frag.numel, step):
            reads.append(ChunkRead(name, ref, start, min(step, frag.src_offset + frag.numel - start)))
        expected += frag.numel
    return tuple(reads)


@dataclass(frozen=True, eq=False)
class GatherRead(ChunkRead):
    """Output elements ``[start, start + numel)`` of a piece with strided fragments (tensor-parallel row slices,
    see :class:`~dsckpt.model.Fragment`): gathered from every fragment's runs that overlap the window, one read
    per (partial) run. ``sources`` is the piece's fragments with their stored tensors, shared by all the
    piece's reads, so a plan stays a few objects per chunk however many rows a tensor has."""

    sources: tuple[tuple[Fragment, TensorRef], ...]


def _plan_gather_chunks(piece: Piece, numel: int, cache: FileCache, name: str,
                        chunk_nbytes: int) -> tuple[ChunkRead, ...] | None:
    sources: list[tuple[Fragment, TensorRef]] = []
    for frag in piece.fragments:
        ref = cache.tensor(frag.file, frag.key)
        if not ref.is_contiguous():
            return None
        if sources and ref.dtype_name != sources[0][1].dtype_name:
            raise CorruptCheckpointError(f"{frag.file}: tensor '{name}' fragments mix {ref.dtype_name} and "
                                         f"{sources[0][1].dtype_name}")
        if frag.src_offset < 0 or frag.src_end > ref.numel:
            raise CorruptCheckpointError(
                f"{frag.file}: tensor '{name}' needs elements [{frag.src_offset}, {frag.src_end}) "
                f"of a stored tensor with {ref.numel}; the checkpoint metadata does not match its tensors")
        sources.append((frag, ref))
    check_tiling(piece, numel, name)
    shared = tuple(sources)
    step = max(1, chunk_nbytes // shared[0][1].storage.itemsize)
    return tuple(GatherRead(name, shared[0][1], lo, min(step, numel - lo), shared) for lo in range(0, numel, step))


def check_tiling(piece: Piece, numel: int, name: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``piece``'s fragments (``numel`` elements in all, see
    :func:`check_numel`) cover its tensor once each."""
    why = tiling_problem(piece.fragments, numel)
    if why:
        raise CorruptCheckpointError(f"tensor '{name}': its {piece.label} copy's fragments do not tile its "
                                     f"{numel} elements ({why}); the checkpoint metadata is inconsistent")


def tiling_problem(frags: tuple[Fragment, ...], numel: int) -> str | None:
    """Why ``frags`` (strided ones among them, all of one destination stride) do not cover ``[0, numel)`` once
    each, or None; their element count is checked already, so in bounds and disjoint is enough. O(fragments), not
    O(rows): in the grid of rows of the common stride ``S`` a fragment strided in the destination is one rectangle
    (rows x a column range), a contiguous one at most three (a partial row, whole rows, a partial row), and
    rectangles are compared, not elements. Destinations only: how the source is laid out does not matter here."""
    strides = {f.dst_stride for f in frags if f.dst_strided}
    if len(strides) > 1 or min(strides, default=1) <= 0:
        return f"strided fragments with strides {sorted(strides)}"
    S = strides.pop() if strides else max(numel, 1)
    rects: list[tuple[int, int, int, int]] = []  # (first row, row count, first column, column count)
    for f in frags:
        if f.numel <= 0:
            continue
        if f.dst_offset < 0 or f.dst_index(f.numel - 1) >= numel:
            return f"elements [{f.dst_offset}, {f.dst_index(f.numel - 1) + 1}) reach outside the tensor"
        row, col = divmod(f.dst_offset, S)
        if f.dst_strided:
            if col + f.run_numel > S:
                return f"runs of {f.run_numel} at column {col} cross rows of {S}"
            rects.append((row, f.numel // f.run_numel, col, f.run_numel))
            continue
        head = min(f.numel, S - col)
        rects.append((row, 1, col, head))
        body, tail = divmod(f.numel - head, S)
        if body:
            rects.append((row + 1, body, 0, S))
        if tail:
            rects.append((row + 1 + body, 1, 0, tail))
    rects.sort()
    for i, (r0, nr, c0, nc) in enumerate(rects):
        j = i + 1
        while j < len(rects) and rects[j][0] < r0 + nr:  # the rectangles starting in this one's rows
            r1, _, c1, nc1 = rects[j]
            if c0 < c1 + nc1 and c1 < c0 + nc:
                return f"two fragments overlap in row {r1}, columns [{max(c0, c1)}, {min(c0 + nc, c1 + nc1)})"
            j += 1
    return None


def _gather(item: GatherRead, out: np.ndarray) -> np.ndarray:
    lo, hi = item.start, item.start + item.numel
    fds: dict[object, int] = {}
    try:
        for frag, ref in item.sources:
            path = ref.storage.path
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            if not frag.strided:
                s, e = max(lo, frag.dst_offset), min(hi, frag.dst_offset + frag.numel)
                if s < e:
                    ref.read_numpy(frag.src_offset + s - frag.dst_offset, e - s, out=out[s - lo: e - lo], fd=fd)
                continue
            _gather_strided(frag, ref, lo, hi, out, fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _gather_strided(frag: Fragment, ref: TensorRef, lo: int, hi: int, out: np.ndarray, fd: int) -> None:
    """Copy the runs of the strided ``frag`` that overlap output elements ``[lo, hi)`` into ``out``.

    The runs a window needs are consecutive in the fragment, so a row-parallel slice costs the same number of
    reads per chunk as a column slice, not one per row: where the source runs follow each other or their gaps are
    short (:func:`reads_span`), one ``pread`` of the source span (the first and last run may be cut by the
    window; gaps included) and one strided numpy copy; otherwise one ``pread`` per run, straight into place."""
    k0, k1 = frag.window(lo, hi)
    if k0 >= k1:
        return
    if not frag.src_strided:
        place(ref.read_numpy(frag.src_offset + k0, k1 - k0, fd=fd), out, frag, k0, lo)
        return
    r = frag.run_numel
    if not reads_span(r, frag.src_step):
        for i in range(k0 // r, (k1 - 1) // r + 1):
            a, e = max(k0, i * r), min(k1, (i + 1) * r)
            at = frag.dst_index(a) - lo
            ref.read_numpy(frag.src_index(a), e - a, out=out[at: at + e - a], fd=fd)
        return
    s0 = frag.src_index(k0)
    span = ref.read_numpy(s0, frag.src_index(k1 - 1) + 1 - s0, fd=fd)
    # the source side as a fragment strided in its destination: views of the span's runs, in order
    source = Fragment(frag.file, frag.key, 0, frag.numel, frag.src_offset, run_numel=r, dst_stride=frag.src_step)
    runs = [v.reshape(-1) for _, v in fragment_views(span, source, k0, k1, s0)]
    place(np.concatenate(runs) if len(runs) > 1 else runs[0], out, frag, k0, lo)


def fragment_views(arr: np.ndarray, frag: Fragment, k0: int, k1: int,
                   base: int) -> Iterator[tuple[int, np.ndarray]]:
    """Views into ``arr`` (whose element 0 is logical element ``base``) of ``frag``'s elements ``[k0, k1)``, in
    order, each with the fragment index of its first element: one view for a contiguous destination; else a
    partial first run, the whole runs between as one 2-D strided view, a partial last run. Assigning from (or
    reading through) them places a fragment's elements, read in one go, with one strided copy instead of one per
    row."""
    if k0 >= k1:
        return
    if not frag.dst_strided:
        start = frag.dst_offset + k0 - base
        yield k0, arr[start: start + k1 - k0]
        return
    r, stride = frag.run_numel, frag.dst_stride
    i0, i1 = k0 // r, (k1 - 1) // r  # the first and last run touched
    if i0 == i1:
        yield k0, arr[frag.dst_index(k0) - base:][: k1 - k0]
        return
    yield k0, arr[frag.dst_index(k0) - base:][: (i0 + 1) * r - k0]
    if i1 - i0 > 1:
        start = frag.dst_offset + (i0 + 1) * stride - base
        yield (i0 + 1) * r, np.lib.stride_tricks.as_strided(arr[start:], shape=(i1 - i0 - 1, r),
                                                           strides=(stride * arr.itemsize, arr.itemsize))
    yield i1 * r, arr[frag.dst_offset + i1 * stride - base:][: k1 - i1 * r]


def place(values: np.ndarray, arr: np.ndarray, frag: Fragment, k0: int, base: int) -> None:
    """Put ``values``, ``frag``'s elements from ``k0`` on, at their logical places in ``arr`` (element 0 of which
    is logical element ``base``)."""
    for k, view in fragment_views(arr, frag, k0, k0 + len(values), base):
        view[...] = values[k - k0: k - k0 + view.size].reshape(view.shape)


def reads_span(run_numel: int, src_step: int) -> bool:
    """Whether runs of ``run_numel`` elements, ``src_step`` apart in the stored tensor, are read in one go with
    the gaps between them rather than one read per run: when the gaps hold at most :data:`SPAN_GAP_RATIO` times
    the runs' elements, so a span read costs at most that much more I/O and buffer than the runs (a TP split
    halving rows, 2 -> 4 or 8 -> 16: gaps equal to the runs) and saves a syscall per row; wider gaps (a target
    rank taking a small part of each row, e.g. TP 1 -> 8) are read run by run."""
    return src_step - run_numel <= SPAN_GAP_RATIO * run_numel


def _fill(buf: np.ndarray, item: ChunkRead) -> np.ndarray:
    nbytes = item.nbytes
    if nbytes > buf.size:
        raise ValueError(f"a read of {nbytes} bytes does not fit in chunks of {buf.size} bytes")
    out = buf[:nbytes].view(DTYPES[item.ref.dtype_name].numpy)
    if isinstance(item, GatherRead):
        return _gather(item, out)
    return item.ref.read_numpy(item.start, item.numel, out=out)


def read_chunks(reads: Iterable[ChunkRead], *, workers: int = 1,
                chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> Generator[tuple[ChunkRead, np.ndarray], None, None]:
    """Perform ``reads`` in order, yielding ``(read, 1-D numpy array)`` of the stored bytes' numpy
    dtype (``uint16`` for bfloat16, see :mod:`dsckpt.dtypes`).

    The array is a view into a reused buffer: it is valid until the next item is requested (copy it
    to keep it). With ``workers`` > 0 that many threads read ahead of the consumer (``os.preadv``
    releases the GIL), so reading overlaps whatever the consumer does; memory is ``workers + 1``
    buffers of ``chunk_nbytes``. With 0, reads happen in the caller's thread into one buffer.
    """
    if workers <= 0:
        buf = np.empty(chunk_nbytes, dtype=np.uint8)
        for item in reads:
            yield item, _fill(buf, item)
        return
    it = iter(reads)
    free = deque(np.empty(chunk_nbytes, dtype=np.uint8) for _ in range(workers + 1))
    pending: deque[tuple[ChunkRead, np.ndarray, Future[np.ndarray]]] = deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="dsckpt-read") as pool:

        def submit() -> bool:
            item = next(it, None)
            if item is None:
                return False
            buf = free.popleft()
            pending.append((item, buf, pool.submit(_fill, buf, item)))
            return True

        try:
            while free and submit():
                pass
            while pending:
                item, buf, fut = pending.popleft()
                yield item, fut.result()
                free.append(buf)
                submit()
        finally:
            for _, _, fut in pending:
                fut.cancel()
