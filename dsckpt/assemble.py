"""Fragments -> one full torch tensor at a time. Only the bytes of the tensor asked for are read.

For bounded-memory streaming without torch, see :mod:`dsckpt.chunks`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .chunks import check_numel, check_tiling, reads_span
from .errors import CorruptCheckpointError
from .model import DeprecatedStateRole, Fragment, LogicalCheckpoint, Piece, Role, TensorEntry
from .readers.common import FileCache
from .tensor_ref import TensorRef

__all__ = ["iter_tensors", "read_entry", "read_piece"]


def read_piece(piece: Piece, shape: tuple[int, ...], cache: FileCache, *, name: str = "?") -> torch.Tensor:
    """Assemble ``piece`` into a new tensor of ``shape`` in its stored dtype. Its fragments must cover every
    element once (checked first, O(fragments)): a gap would leave uninitialised memory in the result."""
    numel = check_numel(piece, shape, name)
    check_tiling(piece, numel, name)
    out: torch.Tensor | None = None
    for frag in piece.fragments:
        ref = cache.tensor(frag.file, frag.key)
        if out is None:
            out = torch.empty(numel, dtype=ref.dtype)
        if ref.dtype != out.dtype:
            raise CorruptCheckpointError(f"{frag.file}: tensor '{name}' fragments mix {ref.dtype} and {out.dtype}")
        if frag.strided:  # a tensor-parallel row slice
            _read_strided(frag, ref, out)
            continue
        ref.read(frag.src_offset, frag.numel, out=out[frag.dst_offset : frag.dst_offset + frag.numel])
    if out is None:
        out = torch.empty(0, dtype=getattr(torch, piece.dtype))
    return out.view(shape)


def _read_strided(frag: Fragment, ref: TensorRef, out: torch.Tensor) -> None:
    """Read the strided ``frag`` into ``out`` (flat): its source span in one read, gaps included, then one strided
    copy of its runs into place; where the source gaps are wide (:func:`~dsckpt.chunks.reads_span`), one read per
    run straight into place instead."""
    r, step = frag.run_numel, frag.src_step
    runs = frag.numel // r
    dst = out.as_strided((runs, r), (frag.dst_stride, 1), frag.dst_offset)
    if not reads_span(r, step):
        for i in range(runs):
            ref.read(frag.src_offset + i * step, r, out=dst[i])
        return
    span = frag.src_end - frag.src_offset
    tmp = torch.empty(span, dtype=ref.dtype)
    ref.read(frag.src_offset, span, out=tmp)
    dst.copy_(tmp.as_strided((runs, r), (step, 1)))


def read_entry(entry: TensorEntry, cache: FileCache, role: Role | DeprecatedStateRole | None = None, *,
               state: str | None = None) -> torch.Tensor:
    """The tensor of ``entry``: the copy with ``role``, or the optimizer state ``state`` ("exp_avg", ...), by default
    the most precise copy."""
    if state is not None:
        piece = entry.state_piece(state)
    else:
        piece = entry.source_for_fp32() if role is None else entry.piece(role)
    if piece is None:
        raise KeyError(f"'{entry.name}' has no {state or (role.value if role else '')} copy")
    return read_piece(piece, entry.shape, cache, name=entry.name)


def iter_tensors(ckpt: LogicalCheckpoint, cache: FileCache | None = None, *,
                 dtype: torch.dtype | None = torch.float32,
                 exclude_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every param and buffer, one at a time.

    Floating tensors come from the fp32 master where there is one and are cast to ``dtype``
    (``None`` keeps the stored dtype); integer buffers keep their dtype. After the last tensor the
    CRC-32 checks of every record read are completed (a damaged record raises
    :class:`~dsckpt.errors.CorruptCheckpointError` instead of ending the iteration).
    """
    cache = cache or FileCache()
    ckpt.require_unambiguous("reading the consolidated tensors", values=True, flags=exclude_frozen)
    for entry in ckpt.entries:
        if exclude_frozen and not entry.trainable and entry.kind.value == "param":
            continue
        t = read_entry(entry, cache)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield entry.name, t
    cache.finish_checks()
