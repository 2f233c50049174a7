"""Headerless tensor files: the bytes of one :class:`~dsckpt.writers.torch_stream.StreamedTensor` and nothing
else, as DeepSpeed's NVMe swap files hold them (:mod:`dsckpt.nvme_swap`). Written atomically; the source bytes
are CRC-checked against their zip records as they are copied, as in :mod:`.torch_stream`."""

from __future__ import annotations

import os
from pathlib import Path

from ..atomic import atomic_file
from ..crc import crc32
from ..errors import CorruptCheckpointError
from .torch_stream import COPY_CHUNK_NBYTES, StreamedTensor

__all__ = ["write_raw_tensor"]


def write_raw_tensor(path: str | os.PathLike[str], tensor: StreamedTensor, *, fsync: bool = True,
                     make_parent: bool = True) -> Path:
    """Write the elements of ``tensor`` to ``path`` as raw bytes (no header)."""
    path = Path(path)
    zeros = bytes(COPY_CHUNK_NBYTES)
    fds: dict[Path, int] = {}
    try:
        with atomic_file(path, fsync=fsync, make_parent=make_parent) as f:
            for ext in tensor.extents:
                left = ext.nbytes
                if ext.path is None:
                    while left:
                        n = min(left, len(zeros))
                        f.write(zeros[:n])
                        left -= n
                    continue
                fd = fds.get(ext.path)
                if fd is None:
                    fd = fds[ext.path] = os.open(ext.path, os.O_RDONLY)
                offset, ext_crc = ext.file_offset, 0
                while left:
                    data = os.pread(fd, min(left, COPY_CHUNK_NBYTES), offset)
                    if not data:
                        raise CorruptCheckpointError(f"{ext.path}: file ends inside tensor data; it is truncated")
                    ext_crc = crc32(data, ext_crc)
                    f.write(data)
                    offset += len(data)
                    left -= len(data)
                if ext.record is not None:
                    ext.record.add_crc(ext.record_offset, ext_crc, ext.nbytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    return path
