"""Write a ``torch.save``-compatible zip file one storage at a time (bounded memory).

``torch.save`` needs every tensor in memory at once. Rewritten DeepSpeed files (``reshard``) are
mostly bytes that already exist in the source files plus a few new flat partitions, so this writer
takes a tree whose tensor leaves are

* :class:`~dsckpt.safe_load.TensorRef` -- copied from the source storage in chunks (views of one
  storage stay views of one storage: tied weights, flat 16-bit buffers),
* :class:`LazyTensor` -- built by a callback right before its bytes are written, then dropped,
* ``torch.Tensor`` -- written as is,

and produces the same pickle stream ``torch.save`` would (``_rebuild_tensor_v2`` with persistent
storage ids, ``_rebuild_from_type_v2`` for tensors carrying Python attributes such as ZeRO-3's
``ds_id``), with DeepSpeed stand-ins written under DeepSpeed's class paths
(:mod:`dsckpt.safe_save`). The result loads with plain ``torch.load`` and with dsckpt's safe loader.
Peak memory: one :class:`LazyTensor` plus a copy chunk.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_file
from ..safe_load import StorageRef, TensorRef
from ..safe_save import _Pickler

__all__ = ["LazyTensor", "write_torch_tree"]

COPY_CHUNK_NBYTES = 64 << 20

_DTYPE_TO_STORAGE = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A 1-D tensor of ``numel`` elements of ``dtype`` that ``build()`` produces at write time."""

    numel: int
    dtype: torch.dtype
    build: Callable[[], torch.Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)


class _Storage:
    """One output storage: where its bytes come from."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, source: Any) -> None:
        self.key, self.dtype, self.numel, self.source = key, dtype, numel, source


class _TreePickler(_Pickler):  # type: ignore[misc]
    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[_Storage] = []
        self._by_source: dict[Any, _Storage] = {}

    def _storage(self, ident: Any, dtype: torch.dtype, numel: int, source: Any) -> _Storage:
        st = self._by_source.get(ident)
        if st is None:
            st = _Storage(str(len(self.storages)), dtype, numel, source)
            self.storages.append(st)
            self._by_source[ident] = st
        return st

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            storage_type = getattr(torch, _DTYPE_TO_STORAGE[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            ref = obj.storage
            st = self._storage(("ref", ref.path, ref.key), ref.dtype, ref.numel, ref)
            return _rebuild(st, obj.storage_offset, obj.shape, obj.stride, obj.requires_grad, obj.attrs)
        if isinstance(obj, LazyTensor):
            st = self._storage(("lazy", id(obj)), obj.dtype, obj.numel, obj)
            return _rebuild(st, 0, (obj.numel,), (1,), False, obj.attrs)
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            st = self._storage(("tensor", id(obj)), t.dtype, t.numel(), t)
            attrs = {k: v for k, v in getattr(obj, "__dict__", {}).items()}
            return _rebuild(st, 0, tuple(t.shape), tuple(t.stride()), False, attrs)
        return NotImplemented


def _rebuild(st: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
             requires_grad: bool, attrs: Any) -> tuple[Any, tuple[Any, ...]]:
    args: tuple[Any, ...] = (st, offset, torch.Size(shape), tuple(stride), requires_grad, OrderedDict())
    if attrs:
        return (torch._tensor._rebuild_from_type_v2,
                (torch._utils._rebuild_tensor_v2, torch.Tensor, args, dict(attrs)))
    return (torch._utils._rebuild_tensor_v2, args)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _copy_storage(ref: StorageRef, dst: Any) -> None:
    remaining = ref.nbytes
    offset = ref.file_offset
    with open(ref.path, "rb", buffering=0) as f:
        while remaining:
            chunk = os.pread(f.fileno(), min(remaining, COPY_CHUNK_NBYTES), offset)
            if not chunk:
                from ..errors import CorruptCheckpointError

                raise CorruptCheckpointError(f"{ref.path}: file ends inside storage {ref.key!r}; it is truncated")
            dst.write(chunk)
            offset += len(chunk)
            remaining -= len(chunk)


def write_torch_tree(path: str | os.PathLike[str], tree: Any) -> Path:
    """Write ``tree`` to ``path`` atomically in ``torch.save``'s zip format, one storage at a time."""
    path = Path(path)
    buf = io.BytesIO()
    pickler = _TreePickler(buf)
    pickler.dump(tree)
    prefix = "archive"
    with atomic_file(path) as f:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
            z.writestr(f"{prefix}/data.pkl", buf.getvalue())
            z.writestr(f"{prefix}/.format_version", "1")
            z.writestr(f"{prefix}/byteorder", "little")
            for st in pickler.storages:
                with z.open(f"{prefix}/data/{st.key}", "w", force_zip64=True) as out:
                    src = st.source
                    if isinstance(src, StorageRef):
                        _copy_storage(src, out)
                        continue
                    if isinstance(src, LazyTensor):
                        t = src.build()
                        if t.dtype != src.dtype or t.numel() != src.numel:
                            raise AssertionError(f"lazy tensor built {t.dtype}[{t.numel()}], "
                                                 f"promised {src.dtype}[{src.numel}]")
                    else:
                        t = src
                    out.write(_tensor_bytes(t.contiguous()))
                    del t
            z.writestr(f"{prefix}/version", "3\n")
    return path
