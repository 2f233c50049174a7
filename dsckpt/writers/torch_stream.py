"""Write a ``torch.save``-compatible zip file one storage at a time, without importing torch.

``torch.save`` needs every tensor in memory at once. Rewritten DeepSpeed files (``reshard``) are
mostly bytes that already exist in the source files plus zero padding, so this writer takes a tree
whose tensor leaves are

* :class:`~dsckpt.tensor_ref.TensorRef` -- its whole source storage is copied (views of one storage
  stay views of one storage: tied weights, flat 16-bit buffers),
* :class:`StreamedTensor` -- a new contiguous tensor whose bytes are a list of :class:`Extent` s
  (byte ranges of source files, or zeros),
* :class:`CastTensor` -- a source tensor widened to float32 (numpy, in bounded chunks, while its
  storage is written): DeepSpeed's universal folders hold ``.float()`` copies of 16-bit and
  integer tensors,
* ``torch.Tensor`` -- written as is (only then is torch needed),

and produces the pickle stream ``torch.save`` would (``_rebuild_tensor_v2`` with persistent storage
ids, ``_rebuild_from_type_v2`` for tensors carrying Python attributes such as ZeRO-3's ``ds_id``),
with DeepSpeed stand-ins written under DeepSpeed's class paths and torch's own globals written by
name. The result loads with plain ``torch.load`` and with dsckpt's safe loader, and is a valid zip
file (``zipfile.ZipFile.testzip`` passes): stored entries, CRC-32 of every entry, data aligned to 64
bytes like torch's own writer, zip64 records where sizes or offsets need them.

Bytes move through a few small reused buffers: a reader thread does ``os.preadv`` from the source
and :func:`~dsckpt.crc.crc32`, the calling thread ``os.write`` s and starts write-back every
:data:`WRITEBACK_KICK_NBYTES`. Peak memory: :data:`BUFFERS` x :data:`COPY_CHUNK_NBYTES`, whatever
the size of the tensors.

Source bytes are checked while they are copied: an extent of a source zip record carries the
record's :class:`~dsckpt.crc.RecordCheck`, and the one CRC computed per extent serves both the
source check and the output entry's CRC (combined with :func:`~dsckpt.crc.crc32_combine`), so
checking costs no second pass.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import queue
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .. import limits
from ..atomic import atomic_file, verification_failed
from ..crc import RecordCheck, crc32, crc32_combine
from ..dtypes import DTYPES
from ..errors import CorruptCheckpointError, DsckptError

if TYPE_CHECKING:
    from .safetensors import TensorSpec

__all__ = ["CastTensor", "ChunkedTensor", "Extent", "Size", "StreamedTensor", "TensorView", "append_torch_tree",
           "dtype_name", "element_nbytes", "verify_torch_file", "write_torch_tree"]

# Small buffers on purpose: the CRC pass and the write then read bytes that are still in the CPU's
# cache. On the 2-core bench machine (1 MiB L2 per core) 4 x 512 KiB copied zero2-200m in 1.4-1.8 s,
# 4 x 1 MiB in 1.9-2.5 s, 4 x 4 MiB in 4.8-5.3 s (bench/README.md).
COPY_CHUNK_NBYTES = 512 << 10
BUFFERS = 4  # buffers in flight between the reader thread and the writer
WRITEBACK_KICK_NBYTES = 16 << 20


_ZIP64_LIMIT = 0xFFFFFFFF  # sizes / offsets at or above this need zip64 fields
_ALIGN = 64  # torch's writer (caffe2/serialize/inline_container.cc) aligns record data to 64 bytes


def dtype_name(x: Any) -> str:
    """``"float32"`` for a dtype name, a ``torch.dtype``, or anything with ``dtype_name``/``dtype``."""
    name = getattr(x, "dtype_name", None)
    if isinstance(name, str):
        return name
    if hasattr(x, "dtype") and not isinstance(x, str):
        x = x.dtype
    return str(x).removeprefix("torch.")


def element_nbytes(dtype: str) -> int:
    try:
        return DTYPES[dtype].itemsize
    except KeyError:
        raise CorruptCheckpointError(f"unsupported tensor dtype '{dtype}'") from None


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes at ``file_offset`` of ``path``; with ``path=None``, ``nbytes`` zero bytes.

    ``record``: the CRC check of the source zip record these bytes lie in (they start
    ``record_offset`` bytes into it); what is copied is accounted to it."""

    path: Path | None
    file_offset: int
    nbytes: int
    record: RecordCheck | None = field(default=None, compare=False)
    record_offset: int = 0


@dataclass(frozen=True, eq=False)
class StreamedTensor:
    """A new contiguous tensor of ``dtype`` (torch's name) and ``shape`` whose bytes are ``extents``
    concatenated; read from the sources only while its storage is being written."""

    dtype: str
    shape: tuple[int, ...]
    extents: tuple[Extent, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert sum(e.nbytes for e in self.extents) == self.nbytes, "extents do not cover the tensor"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_nbytes(self.dtype)


@dataclass(frozen=True, eq=False)
class CastTensor:
    """The contiguous source tensor ``ref`` (a :class:`~dsckpt.tensor_ref.TensorRef`) as float32, like
    torch's ``.float()``: floating types widen exactly, integers convert as numpy's ``astype`` does.
    Read through ``ref.read_numpy`` (CRC-checked) in chunks of :data:`CAST_CHUNK_NUMEL` elements."""

    ref: Any
    dtype: str = "float32"

    def __post_init__(self) -> None:
        assert self.dtype == "float32", "only casts to float32 are written"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ref.shape)

    @property
    def numel(self) -> int:
        return int(self.ref.numel)

    @property
    def nbytes(self) -> int:
        return self.numel * 4

    def chunks(self) -> Iterator[bytes]:
        from ..dtypes import to_float32

        src = dtype_name(self.ref)
        if not self.ref.is_contiguous():
            raise CorruptCheckpointError(f"{self.ref!r} is stored non-contiguously; cannot cast it in chunks")
        for lo in range(0, self.numel, CAST_CHUNK_NUMEL):
            raw = self.ref.read_numpy(lo, min(CAST_CHUNK_NUMEL, self.numel - lo))
            out = to_float32(raw, src) if DTYPES[src].is_floating else raw.astype("<f4")
            yield out.astype("<f4", copy=False).tobytes()


CAST_CHUNK_NUMEL = 1 << 20


@dataclass(frozen=True, eq=False)
class ChunkedTensor:
    """A new contiguous tensor of ``dtype`` and ``shape`` whose bytes ``chunks()`` yields (bytes-like, in order),
    called once, while its storage is being written: ``to-fp32``'s assembled tensors, produced one at a time."""

    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[Any]]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_nbytes(self.dtype)


@dataclass(frozen=True, eq=False)
class TensorView:
    """A contiguous view of ``shape`` at element ``offset`` of ``base`` (a 1-D :class:`StreamedTensor` or a
    contiguous CPU ``torch.Tensor``): views of one base share one storage in the file, as a state dict's params that
    live in one flat buffer do (DeepSpeed's stage-0 ``FP16_Optimizer`` module)."""

    base: Any
    offset: int
    shape: tuple[int, ...]


class Size(tuple):  # type: ignore[type-arg]
    """A ``torch.Size`` for trees written by :func:`write_torch_tree` without importing torch."""


@dataclass(frozen=True)
class _Global:
    """A module-level name written into the pickle as ``GLOBAL module name`` (never imported here)."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce insists on a callable
        raise TypeError(f"{self.module}.{self.name} is only a name to pickle")


_REBUILD_TENSOR_V2 = _Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_FROM_TYPE_V2 = _Global("torch._tensor", "_rebuild_from_type_v2")
_TENSOR = _Global("torch", "Tensor")
_SIZE = _Global("torch", "Size")
_DEVICE = _Global("torch", "device")


class _Storage:
    """One output storage: its pickle key, dtype, element count, and where its bytes come from."""

    def __init__(self, key: str, dtype: str, numel: int, extents: tuple[Extent, ...] | None,
                 tensor: Any = None, cast: CastTensor | ChunkedTensor | None = None) -> None:
        self.key, self.dtype, self.numel, self.extents, self.tensor = key, dtype, numel, extents, tensor
        self.cast = cast

    @property
    def nbytes(self) -> int:
        return self.numel * element_nbytes(self.dtype)


def _torch_tensor_type() -> Any:
    torch = sys.modules.get("torch")  # a torch.Tensor leaf means torch is already imported
    return torch.Tensor if torch is not None else None


_PurePickler: Any = pickle._Pickler  # type: ignore[attr-defined]  # the Python pickler: dispatch is extensible


class _TreePickler(_PurePickler):
    dispatch: ClassVar[dict[type, Any]] = dict(_PurePickler.dispatch)

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[_Storage] = []
        self._by_source: dict[Any, _Storage] = {}
        self._tensor_type = _torch_tensor_type()

    def _storage(self, ident: Any, dtype: str, numel: int, extents: tuple[Extent, ...] | None,
                 tensor: Any = None, cast: CastTensor | ChunkedTensor | None = None) -> _Storage:
        st = self._by_source.get(ident)
        if st is None:
            st = _Storage(str(len(self.storages)), dtype, numel, extents, tensor, cast)
            self.storages.append(st)
            self._by_source[ident] = st
        return st

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", DTYPES[obj.dtype].storage), obj.key, "cpu", obj.numel)
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj).__name__ == "TorchDtype" and isinstance(getattr(obj, "name", None), str):
            obj = _Global("torch", obj.name)  # safe_load's stand-in for a pickled torch dtype
        super().save(obj, save_persistent_id)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        ds_module: Any = getattr(obj, "ds_module", None)
        if isinstance(obj, type) and isinstance(ds_module, str) and ds_module:  # DeepSpeed stand-ins
            self._write_global(ds_module, str(getattr(obj, "ds_name", "")))
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def _write_global(self, module: str, name: str) -> None:
        self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n")

    def _save_marker(self, obj: _Global) -> None:
        self._write_global(obj.module, obj.name)
        self.memoize(obj)

    dispatch[_Global] = _save_marker

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if isinstance(obj, tuple) and cls is not tuple and cls.__name__ in ("Size", "TorchSize"):
            return (_SIZE, (tuple(int(s) for s in obj),))
        if cls.__name__ == "TorchDevice" and isinstance(getattr(obj, "args", None), tuple):
            return (_DEVICE, tuple(obj.args))
        if isinstance(obj, (CastTensor, ChunkedTensor)):
            st = self._storage(("cast", id(obj)), obj.dtype, obj.numel, None, cast=obj)
            return _rebuild(st, 0, obj.shape, _contiguous_stride(obj.shape), False, None)
        if isinstance(obj, StreamedTensor):
            st = self._storage(("new", id(obj)), obj.dtype, obj.numel, obj.extents)
            return _rebuild(st, 0, obj.shape, _contiguous_stride(obj.shape), False, obj.attrs)
        if isinstance(obj, TensorView):
            base = obj.base
            if isinstance(base, StreamedTensor):
                st = self._storage(("new", id(base)), base.dtype, base.numel, base.extents)
            else:  # a torch.Tensor
                assert base.device.type == "cpu" and base.is_contiguous(), "a view's torch base is contiguous on CPU"
                st = self._storage(("tensor", id(base)), dtype_name(base.dtype), base.numel(), None, base)
            return _rebuild(st, obj.offset, obj.shape, _contiguous_stride(obj.shape), False, None)
        storage = getattr(obj, "storage", None)
        if storage is not None and hasattr(storage, "file_offset") and hasattr(obj, "storage_offset"):
            dtype = dtype_name(storage)
            extents = (Extent(Path(storage.path), int(storage.file_offset), int(storage.numel) * element_nbytes(dtype),
                              getattr(storage, "check", None)),)
            st = self._storage(("ref", storage.path, storage.key), dtype, int(storage.numel), extents)
            return _rebuild(st, obj.storage_offset, obj.shape, obj.stride, obj.requires_grad, obj.attrs)
        if self._tensor_type is not None and isinstance(obj, self._tensor_type):
            t = obj.detach().to("cpu").contiguous()
            st = self._storage(("tensor", id(obj)), dtype_name(t.dtype), t.numel(), None, t)
            attrs = dict(getattr(obj, "__dict__", {}))
            return _rebuild(st, 0, tuple(t.shape), tuple(t.stride()), False, attrs)
        return NotImplemented


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _rebuild(st: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
             requires_grad: bool, attrs: Any) -> tuple[Any, tuple[Any, ...]]:
    args: tuple[Any, ...] = (st, offset, Size(shape), tuple(stride), requires_grad, OrderedDict())
    if attrs:
        return (_REBUILD_FROM_TYPE_V2, (_REBUILD_TENSOR_V2, _TENSOR, args, dict(attrs)))
    return (_REBUILD_TENSOR_V2, args)


# --------------------------------------------------------------------------------------------
# The zip container


@dataclass(frozen=True)
class _EndOfEntry:
    crc32: int


@dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclass
class _Entry:
    name: bytes
    header_offset: int
    nbytes: int
    crc32: int


class _ZipStream:
    """Stored (uncompressed) zip entries written sequentially to ``fd``, whose file offset is ``base`` (the zip's
    first byte; its offsets are relative to it); CRCs patched in place."""

    def __init__(self, fd: int, buffer_nbytes: int, *, writeback: bool = True, base: int = 0) -> None:
        self.fd = fd
        self.base = base
        self.writeback = writeback and hasattr(os, "posix_fadvise")
        self.pos = 0
        self.entries: list[_Entry] = []
        self.bufs = [memoryview(bytearray(buffer_nbytes)) for _ in range(BUFFERS)]
        self.zeros = memoryview(bytes(min(buffer_nbytes, 1 << 20)))
        self._kicked = 0
        self._fds: dict[Path, int] = {}

    def close_sources(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.write(self.fd, view)
            view = view[n:]
            self.pos += n
        if self.writeback and self.pos - self._kicked >= WRITEBACK_KICK_NBYTES:
            # Start writing back what is already written (Linux: DONTNEED on dirty pages starts
            # asynchronous writeback and drops only pages that are already clean), so that the disk
            # works while we copy and the final fsync has little left to wait for.
            os.posix_fadvise(self.fd, self.base + self._kicked, self.pos - self._kicked, os.POSIX_FADV_DONTNEED)
            self._kicked = self.pos

    def _begin(self, name: str, nbytes: int) -> _Entry:
        raw = name.encode("utf-8")
        zip64 = nbytes >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, nbytes, nbytes) if zip64 else b""
        fixed = 30 + len(raw) + len(extra)
        pad = -(self.pos + fixed + 4) % _ALIGN
        extra += struct.pack("<HH", 0x4246, pad) + bytes(pad)  # "FB" padding field, as torch writes
        size32 = 0xFFFFFFFF if zip64 else nbytes
        entry = _Entry(raw, self.pos, nbytes, 0)
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, 0,
                                size32, size32, len(raw), len(extra)) + raw + extra)
        return entry

    def _end(self, entry: _Entry, crc: int, written: int) -> None:
        assert written == entry.nbytes, f"{entry.name!r}: wrote {written} bytes, promised {entry.nbytes}"
        entry.crc32 = crc
        os.pwrite(self.fd, struct.pack("<I", crc), self.base + entry.header_offset + 14)
        self.entries.append(entry)

    def add_bytes(self, name: str, data: Any) -> None:
        """One entry of ``data`` (bytes-like, contiguous)."""
        nbytes = memoryview(data).nbytes
        entry = self._begin(name, nbytes)
        self._write(data)
        self._end(entry, crc32(data), nbytes)

    def add_chunks(self, name: str, nbytes: int, chunks: Iterator[bytes]) -> None:
        entry = self._begin(name, nbytes)
        crc = written = 0
        for data in chunks:
            self._write(data)
            crc = crc32(data, crc)
            written += len(data)
        self._end(entry, crc, written)

    def add_storages(self, storages: list[tuple[str, tuple[Extent, ...], int]]) -> None:
        """Write ``(name, extents, nbytes)`` entries in order. A reader thread fills the buffers
        (``os.preadv`` and :func:`~dsckpt.crc.crc32` release the GIL) while this thread writes the previous one."""
        filled: queue.Queue[Any] = queue.Queue()
        free: queue.Queue[memoryview] = queue.Queue()
        for b in self.bufs:
            free.put(b)
        stop = threading.Event()

        def produce() -> None:
            try:
                for _, extents, _ in storages:
                    crc = 0
                    for ext in extents:
                        ext_crc = 0
                        for part in self._read(ext, free, stop):
                            ext_crc = crc32(part, ext_crc)
                            filled.put(part)
                        if ext.record is not None:  # the source record's check (raises on a mismatch)
                            ext.record.add_crc(ext.record_offset, ext_crc, ext.nbytes)
                        crc = crc32_combine(crc, ext_crc, ext.nbytes)
                    filled.put(_EndOfEntry(crc))
            except BaseException as e:  # noqa: BLE001 -- handed to the writer thread, which raises it
                filled.put(_Failed(e))

        reader = threading.Thread(target=produce, name="dsckpt-read", daemon=True)
        reader.start()
        try:
            for name, _extents, nbytes in storages:
                entry = self._begin(name, nbytes)
                written = 0
                while True:
                    item = filled.get()
                    if isinstance(item, _EndOfEntry):
                        self._end(entry, item.crc32, written)
                        break
                    if isinstance(item, _Failed):
                        raise item.error
                    self._write(item)
                    written += item.nbytes
                    if item.obj is not self.zeros.obj:
                        free.put(item.obj if isinstance(item.obj, memoryview) else memoryview(item.obj))
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for a free buffer
                free.put(self.bufs[0])
                reader.join(0.01)

    def _read(self, ext: Extent, free: queue.Queue[memoryview], stop: threading.Event) -> Iterator[memoryview]:
        if ext.path is None:
            left = ext.nbytes
            while left:
                part = self.zeros[: min(left, self.zeros.nbytes)]
                yield part
                left -= part.nbytes
            return
        fd = self._fds.get(ext.path)
        if fd is None:
            fd = self._fds[ext.path] = limits.open_parsed(ext.path)
        offset, left = ext.file_offset, ext.nbytes
        while left:
            buf = free.get()
            if stop.is_set():
                return
            n = os.preadv(fd, [buf[: min(left, buf.nbytes)]], offset)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{ext.path}: file ends at byte {offset}, inside tensor data that should run to byte "
                    f"{ext.file_offset + ext.nbytes}; the file is truncated — the save was probably interrupted")
            yield buf[:n]
            offset += n
            left -= n

    def finish(self) -> None:
        cd_offset = self.pos
        cd = bytearray()
        for e in self.entries:
            z64 = b""
            size32 = e.nbytes
            if e.nbytes >= _ZIP64_LIMIT:
                z64 += struct.pack("<QQ", e.nbytes, e.nbytes)
                size32 = 0xFFFFFFFF
            off32 = e.header_offset
            if e.header_offset >= _ZIP64_LIMIT:
                z64 += struct.pack("<Q", e.header_offset)
                off32 = 0xFFFFFFFF
            extra = struct.pack("<HH", 1, len(z64)) + z64 if z64 else b""
            cd += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if z64 else 20, 0, 0, 0, 0x21,
                              e.crc32, size32, size32, len(e.name), len(extra), 0, 0, 0, 0, off32)
            cd += e.name + extra
        self._write(cd)
        n = len(self.entries)
        if n >= 0xFFFF or cd_offset >= _ZIP64_LIMIT or len(cd) >= _ZIP64_LIMIT:
            eocd64 = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(cd), cd_offset))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(cd), cd_offset, 0))


def write_torch_tree(path: str | os.PathLike[str], tree: Any, *,
                     buffer_nbytes: int | None = None, fsync: bool = True, writeback: bool = True,
                     make_parent: bool = True, check: Callable[[Path], None] | None = None) -> Path:
    """Write ``tree`` to ``path`` atomically in ``torch.save``'s zip format, one storage at a time.

    Tensor leaves are described in the module docstring. Storages are written in the order the
    pickle first meets them, as ``torch.save`` does. Memory: :data:`BUFFERS` buffers of ``buffer_nbytes`` (default
    :data:`COPY_CHUNK_NBYTES`).
    ``fsync=False``: the file is not fsync'd before its rename (:func:`~dsckpt.atomic.atomic_file`; the
    caller fsyncs it later, or it is not crash-durable). ``writeback=False``: the kernel's write-back is
    not started every :data:`WRITEBACK_KICK_NBYTES` (it only serves an fsync to come). ``make_parent`` and
    ``check`` (run on the complete temporary file before the rename): see :func:`~dsckpt.atomic.atomic_file`.
    """
    path = Path(path)
    with atomic_file(path, fsync=fsync, make_parent=make_parent, check=check) as f:
        append_torch_tree(f.fileno(), tree, buffer_nbytes=buffer_nbytes, writeback=writeback)
    return path


def append_torch_tree(fd: int, tree: Any, *, buffer_nbytes: int | None = None, writeback: bool = True,
                      base: int = 0) -> int:
    """Write ``tree`` in ``torch.save``'s zip format at the current position of ``fd``, an open file whose offset
    there is ``base``, as :func:`write_torch_tree` does; returns the bytes written. Several trees written one after
    another into one file are what DCP's ``FileSystemWriter`` writes: each loads from its byte range."""
    buf = io.BytesIO()
    pickler = _TreePickler(buf)
    pickler.dump(tree)
    prefix = "archive"
    z = _ZipStream(fd, buffer_nbytes or COPY_CHUNK_NBYTES, writeback=writeback, base=base)
    try:
        z.add_bytes(f"{prefix}/data.pkl", buf.getvalue())
        z.add_bytes(f"{prefix}/.format_version", b"1")
        z.add_bytes(f"{prefix}/byteorder", b"little")
        streamed: list[tuple[str, tuple[Extent, ...], int]] = []
        for st in pickler.storages:
            name = f"{prefix}/data/{st.key}"
            if st.extents is not None:
                streamed.append((name, st.extents, st.nbytes))
                continue
            z.add_storages(streamed)
            streamed = []
            if st.cast is not None:
                z.add_chunks(name, st.nbytes, st.cast.chunks())
                continue
            z.add_bytes(name, st.tensor.reshape(-1).view(_uint8()).numpy())  # its own bytes, not a copy
        z.add_storages(streamed)
        z.add_bytes(f"{prefix}/version", b"3\n")
        z.finish()
    finally:
        z.close_sources()
    return z.pos


def _uint8() -> Any:
    return sys.modules["torch"].uint8


def verify_torch_file(path: Path, specs: Sequence[TensorSpec], *, keys: tuple[str, ...] | None = None,
                      target: Path | None = None) -> None:
    """Reopen a written torch file through the safe loader and check its state dict: the planned names in order,
    shapes and dtypes. ``keys``: the file is a dict with these top-level keys in order, the state dict under
    ``"state_dict"`` (a Lightning checkpoint); ``None``: the file is the state dict. For a file not yet moved into
    place: errors (:func:`dsckpt.atomic.verification_failed`) name it ``target`` (default ``path``)."""
    from ..safe_load import load as safe_load_file
    from ..tensor_ref import TensorRef

    target = path if target is None else target
    try:
        tree = safe_load_file(path)
    except DsckptError as e:  # its message names the temporary file and blames an interrupted save: say why alone
        cause = e.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).removeprefix(f"{path}: ")
        raise verification_failed(target, f"the written file cannot be reopened ({why})") from e
    sd = tree if keys is None else tree.get("state_dict") if isinstance(tree, dict) else None
    if keys is not None and (not isinstance(tree, dict) or tuple(tree) != keys):
        raise verification_failed(target, "the written file holds other top-level keys than planned")
    if not isinstance(sd, dict) or list(sd) != [s.name for s in specs]:
        raise verification_failed(target, "the written state dict lists other tensors than planned")
    for spec in specs:
        t = sd[spec.name]
        if not isinstance(t, TensorRef) or tuple(t.shape) != spec.shape or t.dtype_name != spec.dtype:
            raise verification_failed(target, f"'{spec.name}' was not written as planned")
