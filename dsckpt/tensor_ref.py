"""Lazy tensors: a parsed tensor is a :class:`TensorRef` to a :class:`StorageRef`, which knows where its bytes are in
the file. ``TensorRef.read()`` reads exactly the elements asked for with ``pread`` (storages saved on a GPU are read
to CPU like any other), and every byte read of a zip record is checked against the record's CRC-32 while it is
read (:mod:`dsckpt.crc`; ``StorageRef.check``). Only :mod:`dsckpt.safe_load` creates them."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import crc, limits
from .dtypes import DTYPES
from .errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["SequentialRead", "StorageRef", "TensorRef", "byte_view", "pread_exact", "read_bytes"]

# --------------------------------------------------------------------------------------------
# Lazy tensors


@dataclass(frozen=True)
class StorageRef:
    """Where one pickled storage's bytes are: ``nbytes`` bytes at ``file_offset`` in ``path``.

    In a zip-format file the storage is the start of a record (``record``, ``record_nbytes`` bytes,
    stored CRC-32 ``crc32``) and ``check`` is the record's shared read-time check (None when
    ``DSCKPT_NO_CRC`` is set). Legacy (non-zip) files store no CRC: ``crc32`` is None.
    """

    path: Path
    key: str
    dtype_name: str
    numel: int
    file_offset: int
    location: str
    record: str | None = None
    record_nbytes: int | None = None
    crc32: int | None = None
    check: crc.RecordCheck | None = field(default=None, compare=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; use :attr:`dtype_name` on torch-free paths)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_name].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor in a checkpoint file, not yet read. ``read`` returns CPU tensors."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; use :attr:`dtype_name` on torch-free paths)."""
        return self.storage.dtype

    @property
    def dtype_name(self) -> str:
        return self.storage.dtype_name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.storage.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def _check_range(self, start: int, numel: int | None) -> int:
        total = self.numel
        if numel is None:
            numel = total - start
        if start < 0 or numel < 0 or start + numel > total:
            raise CorruptCheckpointError(
                f"{self.storage.path}: asked for elements [{start}, {start + numel}) of a tensor "
                f"with {total} elements; the checkpoint metadata does not match its tensors"
            )
        # Checked before any buffer is allocated: a corrupt shape may claim 1e12 elements.
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if total else 0
        if self.storage_offset < 0 or any(st < 0 for st in self.stride) or \
                self.storage_offset + span > self.storage.numel:
            raise CorruptCheckpointError(
                f"{self.storage.path}: a tensor of shape {list(self.shape)} at offset {self.storage_offset} "
                f"runs past the end of its storage {self.storage.key!r} ({self.storage.numel} elements); "
                "the file is corrupt")
        return numel

    def read(self, start: int = 0, numel: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``numel`` elements starting at flat element ``start`` (row-major order) as a torch
        tensor.

        With ``out`` (a contiguous 1-D tensor of this dtype and ``numel`` elements) the bytes are read
        straight into it.
        """
        import torch

        numel = self._check_range(start, numel)
        if not self.is_contiguous():
            full = self._read_strided()
            flat = full.reshape(-1)[start : start + numel]
            if out is None:
                return flat.clone()
            out.copy_(flat)
            return out
        if out is None:
            out = torch.empty(numel, dtype=self.dtype)
        read_bytes(self.storage, self.storage_offset + start, numel, byte_view(out.view(torch.uint8).numpy()))
        return out

    def read_numpy(self, start: int = 0, numel: int | None = None, *, out: np.ndarray | None = None,
                   fd: int | None = None) -> np.ndarray:
        """Like :meth:`read`, without torch: a 1-D numpy array of the stored bytes' numpy dtype
        (``uint16`` for bfloat16; see :mod:`dsckpt.dtypes`). Contiguous tensors only.

        ``fd``: a descriptor of this file, open for reading, to read with (``pread`` keeps no file
        position, so threads may share one); by default the file is opened for this read only."""
        numel = self._check_range(start, numel)
        if not self.is_contiguous():
            raise ValueError(f"{self!r} is strided; read it with read()")
        if out is None:
            out = np.empty(numel, dtype=DTYPES[self.dtype_name].numpy)
        read_bytes(self.storage, self.storage_offset + start, numel, byte_view(out), fd=fd)
        return out

    def sequential(self, start: int, numel: int, *, fd: int) -> SequentialRead:
        """Elements ``[start, start + numel)`` (contiguous tensors only), to be read front to back in blocks
        through ``fd`` (see :class:`SequentialRead`; bounds are checked here, before any read)."""
        numel = self._check_range(start, numel)
        if not self.is_contiguous():
            raise ValueError(f"{self!r} is strided; read it with read()")
        storage, first = self.storage, self.storage_offset + start
        _check_storage_range(storage, first, numel)
        return SequentialRead(fd, storage.file_offset + first * storage.itemsize, numel, storage.itemsize,
                              _truncated(storage), storage.check, first * storage.itemsize)

    def item(self) -> int | float:
        """The value of a one-element tensor (Adam's ``step``, a loss scale), read without torch and
        CRC-checked like every read: an int for integer and bool dtypes (exact, as torch's ``item()``),
        else a float (a complex value gives its real part)."""
        if self.numel != 1:
            raise ValueError(f"{self!r} has {self.numel} elements; item() reads one-element tensors")
        raw = self.read_numpy(0, 1)
        if self.dtype_name in ("bfloat16", "float16"):
            from .dtypes import to_float32

            raw = to_float32(raw, self.dtype_name)
        value = raw[0]
        if value.dtype.kind in "biu":
            return int(value)
        return float(value.real) if np.iscomplexobj(value) else float(value)

    def load(self) -> torch.Tensor:
        """The whole tensor, shaped, as a CPU tensor that owns its memory."""
        if self.is_contiguous():
            return self.read().view(self.shape)
        return self._read_strided().contiguous()

    def _read_strided(self) -> torch.Tensor:
        import torch

        self._check_range(0, None)

        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        flat = torch.empty(span, dtype=self.dtype)
        read_bytes(self.storage, self.storage_offset, span, byte_view(flat.view(torch.uint8).numpy()))
        return flat.as_strided(self.shape, self.stride)

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, {list(self.shape)}, {self.storage.path.name}:{self.storage.key})"


def byte_view(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data.cast("B")


def read_bytes(storage: StorageRef, first: int, numel: int, view: memoryview, *, fd: int | None = None) -> None:
    """``pread`` elements ``[first, first + numel)`` of ``storage`` into ``view`` (raw bytes), through
    ``fd`` if given (else the file is opened for this read)."""
    _check_storage_range(storage, first, numel)
    if numel == 0:
        return
    nbytes = numel * storage.itemsize
    own = fd is None
    if fd is None:
        fd = limits.open_parsed(storage.path)
    try:
        pread_exact(fd, view[:nbytes], storage.file_offset + first * storage.itemsize, _truncated(storage))
    finally:
        if own:
            os.close(fd)
    if storage.check is not None:
        storage.check.update(first * storage.itemsize, view[:nbytes])


def _check_storage_range(storage: StorageRef, first: int, numel: int) -> None:
    if first + numel > storage.numel:
        raise CorruptCheckpointError(
            f"{storage.path}: tensor runs past the end of its storage {storage.key!r} "
            f"({first + numel} > {storage.numel} elements); the file is corrupt"
        )


def _truncated(storage: StorageRef) -> str:
    return (f"{storage.path}: file ends inside tensor data (storage {storage.key!r}); "
            "the file is truncated — the save was probably interrupted")


def pread_exact(fd: int, view: memoryview, offset: int, truncated: str) -> None:
    """Fill ``view`` from byte ``offset`` of ``fd``; :class:`CorruptCheckpointError` (``truncated``) when the file
    ends first."""
    got, nbytes = 0, view.nbytes
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CorruptCheckpointError(truncated)
        got += n


class SequentialRead:
    """One range of a stored tensor read front to back in blocks the caller sizes (``scan``'s cache-sized blocks):
    :meth:`read_into` fills the caller's buffer with the next elements and chains their CRC-32 onto the previous
    blocks' while the bytes are still in cache; :meth:`close` hands the record's check the CRC of everything read,
    once (one :meth:`~dsckpt.crc.RecordCheck.add_crc` per range, not per block). Bounds were checked before the
    first read; a block past the range raises ``AssertionError`` (a caller bug, not a file's)."""

    __slots__ = ("_check", "_check_offset", "_crc", "_done", "_offset", "_truncated", "fd", "itemsize", "numel")

    def __init__(self, fd: int, offset: int, numel: int, itemsize: int, truncated: str,
                 check: crc.RecordCheck | None = None, check_offset: int = 0) -> None:
        self.fd = fd  # may be replaced between reads by another descriptor of the same file
        self._offset, self.numel, self.itemsize = offset, numel, itemsize
        self._truncated = truncated
        self._check = None if check is None or check.done else check  # a record verified already: no CRC
        self._check_offset = check_offset
        self._crc = 0
        self._done = 0  # elements read

    def read_into(self, out: np.ndarray, raw: memoryview | None = None) -> np.ndarray:
        """The next ``out.size`` elements, read into ``out`` (1-D, contiguous); ``raw``: its bytes, if the caller
        has them as a memoryview already (a block loop saves making one per block)."""
        n = out.size
        assert self._done + n <= self.numel, "read past the planned range"
        if raw is None:
            raw = byte_view(out)
        offset = self._offset + self._done * self.itemsize
        if os.preadv(self.fd, [raw], offset) != raw.nbytes:  # short read: finish it, or say the file ends
            pread_exact(self.fd, raw, offset, self._truncated)
        if self._check is not None:
            self._crc = crc.crc32(raw, self._crc)
        self._done += n
        return out

    def close(self) -> None:
        """Account for the CRC-32 of what was read (raises on a mismatch once its record is covered)."""
        if self._check is not None and self._done:
            check, self._check = self._check, None
            check.add_crc(self._check_offset, self._crc, self._done * self.itemsize)
