"""Fragments -> one full tensor at a time. Only the bytes of the tensor asked for are read.

For streaming (``to-fp32``), :func:`plan_piece_chunks` cuts a tensor into bounded reads in output
order and :func:`read_chunks` performs them into a few reused buffers, optionally with reader threads
running ahead of the consumer, so memory stays at a few chunks whatever the size of the tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import CorruptCheckpointError
from .model import LogicalCheckpoint, Piece, Role, TensorEntry
from .readers.common import FileCache
from .safe_load import TensorRef

__all__ = ["read_piece", "read_entry", "iter_tensors", "ChunkRead", "plan_piece_chunks", "read_chunks",
           "DEFAULT_CHUNK_NBYTES"]

# Big enough that per-call overhead vanishes (~100 reads per GB), small enough to stay in cache
# between the read and the checks that follow it.
DEFAULT_CHUNK_NBYTES = 8 * 1024 * 1024


def _check_numel(piece: Piece, shape: tuple[int, ...], name: str) -> int:
    numel = 1
    for s in shape:
        numel *= s
    if piece.numel != numel:
        raise CorruptCheckpointError(
            f"tensor '{name}': its {piece.role.value} copy has {piece.numel} elements in the files, "
            f"the recorded shape {list(shape)} needs {numel}; the checkpoint metadata is inconsistent"
        )
    return numel


def read_piece(piece: Piece, shape: tuple[int, ...], cache: FileCache, *, name: str = "?") -> torch.Tensor:
    """Assemble ``piece`` into a new tensor of ``shape`` in its stored dtype."""
    numel = _check_numel(piece, shape, name)
    out: torch.Tensor | None = None
    for frag in piece.fragments:
        ref = cache.tensor(frag.file, frag.key)
        if out is None:
            out = torch.empty(numel, dtype=ref.dtype)
        if ref.dtype != out.dtype:
            raise CorruptCheckpointError(f"{frag.file}: tensor '{name}' fragments mix {ref.dtype} and {out.dtype}")
        ref.read(frag.src_offset, frag.numel, out=out[frag.dst_offset : frag.dst_offset + frag.numel])
    if out is None:
        out = torch.empty(0, dtype=getattr(torch, piece.dtype))
    return out.view(shape)


def read_entry(entry: TensorEntry, cache: FileCache, role: Role | None = None) -> torch.Tensor:
    """The tensor of ``entry``: the copy with ``role``, by default the most precise one."""
    piece = entry.source_for_fp32() if role is None else entry.piece(role)
    if piece is None:
        raise KeyError(f"'{entry.name}' has no {role.value if role else ''} copy")
    return read_piece(piece, entry.shape, cache, name=entry.name)


def iter_tensors(ckpt: LogicalCheckpoint, cache: FileCache | None = None, *,
                 dtype: torch.dtype | None = torch.float32,
                 exclude_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every param and buffer, one at a time.

    Floating tensors come from the fp32 master where there is one and are cast to ``dtype``
    (``None`` keeps the stored dtype); integer buffers keep their dtype.
    """
    cache = cache or FileCache()
    for entry in ckpt.entries:
        if exclude_frozen and not entry.trainable and entry.kind.value == "param":
            continue
        t = read_entry(entry, cache)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield entry.name, t


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
        return self.numel * self.ref.dtype.itemsize


def plan_piece_chunks(piece: Piece, shape: tuple[int, ...], cache: FileCache, *, name: str = "?",
                      chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> tuple[ChunkRead, ...] | None:
    """The reads that yield ``piece`` front to back (flat, row-major) in chunks of at most
    ``chunk_nbytes``; their concatenation equals :func:`read_piece`.

    Returns None when the piece cannot be streamed that way (a strided stored tensor, or fragments
    that do not tile the tensor in order); use :func:`read_piece` for it. Reads no tensor data.
    """
    _check_numel(piece, shape, name)
    frags = sorted(piece.fragments, key=lambda f: f.dst_offset)
    reads: list[ChunkRead] = []
    expected = 0
    dtype = None
    for frag in frags:
        ref = cache.tensor(frag.file, frag.key)
        if dtype is not None and ref.dtype != dtype:
            raise CorruptCheckpointError(f"{frag.file}: tensor '{name}' fragments mix {ref.dtype} and {dtype}")
        dtype = ref.dtype
        if frag.dst_offset != expected or not ref.is_contiguous():
            return None
        if frag.src_offset < 0 or frag.numel < 0 or frag.src_offset + frag.numel > ref.numel:
            raise CorruptCheckpointError(
                f"{frag.file}: tensor '{name}' needs elements [{frag.src_offset}, {frag.src_offset + frag.numel}) "
                f"of a stored tensor with {ref.numel}; the checkpoint metadata does not match its tensors"
            )
        step = max(1, chunk_nbytes // ref.storage.dtype.itemsize)
        for start in range(frag.src_offset, frag.src_offset + frag.numel, step):
            reads.append(ChunkRead(name, ref, start, min(step, frag.src_offset + frag.numel - start)))
        expected += frag.numel
    return tuple(reads)


def _fill(buf: torch.Tensor, item: ChunkRead) -> torch.Tensor:
    nbytes = item.nbytes
    if nbytes > buf.numel():
        raise ValueError(f"a read of {nbytes} bytes does not fit in chunks of {buf.numel()} bytes")
    return item.ref.read(item.start, item.numel, out=buf[:nbytes].view(item.ref.dtype))


def read_chunks(reads: Iterable[ChunkRead], *, workers: int = 1,
                chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> Iterator[tuple[ChunkRead, torch.Tensor]]:
    """Perform ``reads`` in order, yielding ``(read, 1-D tensor)``.

    The tensor is a view into a reused buffer: it is valid until the next item is requested (copy it
    to keep it). With ``workers`` > 0 that many threads read ahead of the consumer (``os.preadv``
    releases the GIL), so reading overlaps whatever the consumer does; memory is ``workers + 1``
    buffers of ``chunk_nbytes``. With 0, reads happen in the caller's thread into one buffer.
    """
    if workers <= 0:
        buf = torch.empty(chunk_nbytes, dtype=torch.uint8)
        for item in reads:
            yield item, _fill(buf, item)
        return
    it = iter(reads)
    free = deque(torch.empty(chunk_nbytes, dtype=torch.uint8) for _ in range(workers + 1))
    pending: deque[tuple[ChunkRead, torch.Tensor, Future[torch.Tensor]]] = deque()
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
