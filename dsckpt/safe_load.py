"""The only place in dsckpt that unpickles.

``load(path)`` parses a ``torch.save`` file (zip format, or the legacy non-zip format that DeepSpeed
writes with ``"checkpoint_serialization": false``) with a restricted unpickler:

* globals are resolved from an allow-list; anything else raises :class:`UnsafeCheckpointError`
  naming the class and the file, before any of it runs;
* DeepSpeed's own classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address`` ...) become inert
  stand-ins (:class:`~dsckpt.stand_ins.DeepSpeedObject`), so deepspeed is never imported;
* tensors are not read: each becomes a :class:`~dsckpt.tensor_ref.TensorRef` that knows where its bytes are in
  the file; every byte later read of a zip record is checked against the record's CRC-32
  (:mod:`dsckpt.tensor_ref`, :mod:`dsckpt.crc`). Legacy non-zip files carry no CRCs;
* parsing does not import torch: dtypes are names (:mod:`dsckpt.dtypes`), and ``torch.Size``, torch dtypes and
  devices become the stand-ins of :mod:`dsckpt.stand_ins`;
* what is parsed is held to the budgets of :mod:`dsckpt.limits` (container sizes and kinds, compressed records,
  pickle size) and, in one pass over the tree, :func:`~dsckpt.parsed_tree.check_tree` (depth, objects,
  references, integer and string sizes). :mod:`dsckpt.parsed_tree` walks the parsed trees.

Nothing else in dsckpt calls ``torch.load`` or ``pickle.load``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from typing_extensions import deprecated

from . import crc, limits
from .dtypes import DTYPES, dtype_info
from .errors import CorruptCheckpointError, UnsafeCheckpointError, shorten
from .parsed_tree import check_tree, map_structure
from .parsed_tree import finish_checks as _finish_checks
from .pickle_scan import prescan
from .stand_ins import (
    ATTRIBUTE_DICTS,
    STAND_INS,
    DeepSpeedObject,
    TorchDtype,
    torch_device,
    torch_size,
)
from .tensor_ref import StorageRef, TensorRef

if TYPE_CHECKING:
    pass

__all__ = ["FileInfo", "load", "load_pickle", "load_raw", "load_window", "load_with_info", "load_work_batch"]

# --------------------------------------------------------------------------------------------
# Allow-listed globals

_STORAGE_DTYPES: dict[str, str] = {d.storage: d.name for d in DTYPES.values()} | {"UntypedStorage": "uint8"}


# Allow-listed objects are shared by every load, so none of them may be changed by a pickle's BUILD
# opcode (which writes into ``__dict__`` or calls ``setattr``): a BUILD on the shared FloatStorage
# marker once turned every later float32 storage into int8. Hence slots and frozen classes, and
# plain functions wrapped in :class:`_ReadOnlyCallable`.


def _refuse_build(self: Any, state: Any) -> None:
    raise pickle.UnpicklingError(f"refusing to set the state of the allow-listed {type(self).__name__}")


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class _TensorType:
    """Marker for ``torch.Tensor`` / ``torch.nn.Parameter`` used as ``new_type`` in rebuild calls."""

    name: str

    __setstate__ = _refuse_build


class _ReadOnlyCallable:
    __slots__ = ("_fn",)
    _fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # What the call may copy from its arguments (a shared list given to set() 10^6 times), counted before it
        # copies; the object it builds itself the pre-scan counted.
        limits.charge_parsed(sum(_copy_nbytes(a) + sum(_copy_nbytes(x) for x in a) if type(a) is tuple
                                 else _copy_nbytes(a) for a in args))
        return self._fn(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("allow-listed callables are read-only")

    __setstate__ = _refuse_build


def _copy_nbytes(x: Any) -> int:
    """Bytes a call copying ``x`` one level deep builds (see :mod:`dsckpt.pickle_scan` for the sizes)."""
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if isinstance(x, (list, tuple, dict, set, frozenset)):
        return 104 * len(x)
    return 0


def _rebuild_tensor_v2(
    storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
    backward_hooks: Any = None, metadata: Any = None,
) -> TensorRef:
    if not isinstance(storage, (StorageRef, _LegacyStorage)):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    shape, strides, offset = tuple(int(s) for s in size), tuple(int(s) for s in stride), int(storage_offset)
    # torch refuses these too (sizes and strides are int64, a size is never negative).
    if len(shape) != len(strides) or any(not 0 <= s < 1 << 63 for s in (*shape, offset)) or \
            any(not -(1 << 63) <= s < 1 << 63 for s in strides):
        raise pickle.UnpicklingError(f"a tensor with shape {shorten(list(shape))}, stride {shorten(list(strides))} "
                                     f"and offset {shorten(offset)}, which torch cannot hold")
    # A legacy-format placeholder is swapped for its located StorageRef by _replace_legacy.
    return TensorRef(storage, offset, shape, strides, bool(requires_grad))  # type: ignore[arg-type]


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any) -> TensorRef:
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: bool, backward_hooks: Any, *state: Any) -> Any:
    if isinstance(data, TensorRef):
        return TensorRef(data.storage, data.storage_offset, data.shape, data.stride, bool(requires_grad),
                         data.attrs)
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    ret = func(*args)
    if isinstance(ret, TensorRef) and isinstance(state, dict) and state:
        # Stage-3 fp32 flat groups carry a ``ds_id`` attribute (DeepSpeed 0.19.8, stage3.py).
        ret = TensorRef(ret.storage, ret.storage_offset, ret.shape, ret.stride, ret.requires_grad,
                        {**ret.attrs, **state})
    return ret


def _safe_reconstructor(cls: Any, base: Any, state: Any) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, DeepSpeedObject)) or base is not object:
        raise pickle.UnpicklingError(f"copyreg._reconstructor called with {cls!r}")
    obj = cls.__new__(cls)
    return obj


def _codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # numpy pickles bytes (the Mersenne Twister key of np.random.get_state(), saved in HF Trainer
    # rng_state_*.pth) as _codecs.encode(str, "latin1") for protocol-2 compatibility.
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError(f"_codecs.encode called with {type(obj).__name__}, {encoding!r}")
    return obj.encode("latin1")


def _bytearray(source: Any = b"", *args: Any) -> bytearray:
    # Protocols < 5 pickle a bytearray as bytearray(<str>, "latin-1"); bytearray(<int>) would allocate (and zero)
    # as many bytes as the pickle asks for.
    if not isinstance(source, (bytes, str)):
        raise pickle.UnpicklingError(f"bytearray built from {type(source).__name__}, not from bytes")
    return bytearray(source, *args)


# Classes called by REDUCE, as functions so that :class:`_ReadOnlyCallable` counts what they copy.
def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    return OrderedDict(*args)


def _set(*args: Any) -> set[Any]:
    return set(*args)


def _frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(*args)


def _numpy_globals() -> dict[tuple[str, str], Any]:

    out: dict[tuple[str, str], Any] = {}
    try:
        from numpy._core.multiarray import _reconstruct, scalar  # type: ignore[attr-defined]
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = _safe_np_reconstruct(_reconstruct)
        out[(mod, "scalar")] = scalar
    out[("numpy", "ndarray")] = np.ndarray
    out[("numpy", "dtype")] = np.dtype
    return out


def _safe_np_reconstruct(real: Callable[..., Any]) -> Callable[..., Any]:

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not np.ndarray:
            raise pickle.UnpicklingError(f"numpy reconstruct of {subtype!r} refused")
        if tuple(shape) != (0,):  # numpy pickles (0,) and sets the data with BUILD; a shape would allocate it
            raise pickle.UnpicklingError(f"numpy reconstruct of shape {shorten(shape)} refused (numpy writes (0,))")
        return real(subtype, shape, dtype)

    return reconstruct


def _layout_name(name: str) -> str:
    if not isinstance(name, str) or len(name) > 64:
        raise pickle.UnpicklingError("a torch layout is named by a short string")
    return name


def _path_text(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts) or sum(len(p) for p in parts) > 4096:
        raise pickle.UnpicklingError("a pickled path is made of a few strings")
    return "/".join(parts)


def _build_allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TensorType("Tensor"),
        ("torch.nn.parameter", "Parameter"): _TensorType("Parameter"),
        ("torch", "Size"): torch_size,
        ("torch", "device"): torch_device,
        ("copyreg", "_reconstructor"): _safe_reconstructor,
        ("builtins", "object"): object,
        ("collections", "OrderedDict"): _ordered_dict,
        ("builtins", "set"): _set,
        ("builtins", "frozenset"): _frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): _bytearray,
        ("__builtin__", "set"): set,
        ("_codecs", "encode"): _codecs_encode,
    }
    for name, dtype in _STORAGE_DTYPES.items():
        allowed[("torch", name)] = _StorageType(dtype)
    allowed[("torch.storage", "UntypedStorage")] = _StorageType("uint8")
    for name in [*DTYPES, "float", "double", "half", "long", "int", "short", "cfloat", "cdouble"]:
        allowed[("torch", name)] = TorchDtype(dtype_info(name).name)
    # DCP .metadata: TensorProperties pickles its layout as torch.serialization._get_layout("torch.strided")
    allowed[("torch.serialization", "_get_layout")] = _layout_name
    # ... and its StorageMeta.checkpoint_id is the path the writer was given: a pathlib path when it was one.
    # It becomes its string (no pathlib object is built).
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", cls)] = _path_text
    allowed.update(STAND_INS)
    allowed.update(ATTRIBUTE_DICTS)
    try:
        allowed.update(_numpy_globals())
    except ImportError:  # numpy is a dependency, but reading must not break without it
        pass
    return {k: _ReadOnlyCallable(v) if isinstance(v, types.FunctionType) else v for k, v in allowed.items()}


_ALLOWED = _build_allowed()


# --------------------------------------------------------------------------------------------
# The unpickler


class _AllowListed:
    """find_class / persistent_load of dsckpt's unpicklers (the C one below, and the pure-Python one
    for legacy files)."""

    _path: Path
    _resolve_storage: Callable[[tuple[Any, ...]], StorageRef]

    def __init__(self, file: Any, *, path: Path, resolve_storage: Callable[[tuple[Any, ...]], StorageRef]) -> None:
        super().__init__(file, encoding="utf-8")  # type: ignore[call-arg]
        self._path = path
        self._resolve_storage = resolve_storage

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._path}: refusing to unpickle global '{module}.{name}': it is not on dsckpt's "
                "allow-list of classes found in DeepSpeed checkpoints, and loading it could run code. "
                "Nothing was executed. If you trust this file, report the class so it can be added."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        typename = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if typename != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id type {typename!r}")
        return self._resolve_storage(pid[1:])


class _Unpickler(_AllowListed, pickle.Unpickler):
    pass


class _LegacyUnpickler(_AllowListed, pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Pure Python: every opcode's bytes come through ``read(n)``, so :class:`_BoundedReader` refuses a
    damaged length before anything is allocated (the C unpickler allocates BINBYTES/BYTEARRAY8 first).
    Legacy files carry no CRC, so their pickles are the ones damage reaches."""

    def _load_bytearray8(self) -> None:  # pickle's own allocates bytearray(len) before reading
        (n,) = struct.unpack("<Q", self.read(8))  # type: ignore[attr-defined]
        self.append(bytearray(self.read(n)))  # type: ignore[attr-defined]

    dispatch: ClassVar = {**pickle._Unpickler.dispatch,  # type: ignore[attr-defined,dict-item]
                          pickle.BYTEARRAY8[0]: _load_bytearray8}  # type: ignore[dict-item]


def load(path: str | os.PathLike[str]) -> Any:
    """Parse a ``torch.save`` file safely; tensors come back as :class:`TensorRef`.

    Raises :class:`UnsafeCheckpointError` for a global outside the allow-list and
    :class:`CorruptCheckpointError` for a truncated or malformed file.
    """
    return load_with_info(path)[0]


#: What the parsers raise on a damaged pickle or zip (zipfile: "zip file version 13.4").
_PARSE_ERRORS: tuple[type[Exception], ...] = (
    pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, ValueError, TypeError, KeyError,
    AttributeError, IndexError, UnicodeDecodeError, NotImplementedError, OverflowError)


@contextlib.contextmanager
def _parsing(p: Path, message: Callable[[BaseException], str], *also: type[Exception]) -> Iterator[None]:
    """Parsing ``p``: what a damaged file makes the parsers raise (:data:`_PARSE_ERRORS` and ``also``) becomes one
    :class:`CorruptCheckpointError` with ``message(e)``; a nesting that a guard missed is still a damaged file
    (the ``max_depth`` limit), never exit 70; dsckpt's own refusals pass unchanged."""
    try:
        yield
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except RecursionError as e:
        raise limits.exceeded(p, "nesting deeper than Python can follow", None, "max_depth") from e
    except (*_PARSE_ERRORS, *also) as e:
        raise CorruptCheckpointError(message(e)) from e


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {shorten(str(e), 200)}"


def load_pickle(path: str | os.PathLike[str]) -> Any:
    """Parse a plain pickle file (no storages: DCP's ``.metadata``) with the allow-listed unpickler, within
    ``max_pickle_nbytes``; the same refusals as :func:`load`."""
    p = Path(path)

    def no_storage(args: tuple[Any, ...]) -> StorageRef:
        raise pickle.UnpicklingError("a plain pickle holds no tensor storages")

    with _parsing(p, lambda e: f"{p}: cannot be parsed as a pickle ({_why(e)}); it is truncated or corrupt",
                  MemoryError):
        size = limits.regular_file(p).st_size
        if size > limits.current().max_pickle_nbytes:
            raise limits.exceeded(p, f"a pickle of {size} bytes", None, "max_pickle_nbytes")
        with os.fdopen(limits.open_regular(p), "rb") as f:
            obj = _Unpickler(_BoundedReader(f, p, size), path=p, resolve_storage=no_storage).load()
        check_tree(obj, p)
        return obj


class _Window:
    """``nbytes`` bytes of an open file from ``base``, as a file of its own (a ``torch.save`` stream stored inside
    a bigger file, as DCP's ``.distcp`` files hold them): reads stop at the window's end."""

    def __init__(self, f: Any, base: int, nbytes: int) -> None:
        self._f, self._base, self._nbytes, self._pos = f, base, nbytes, 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = {0: offset, 1: self._pos + offset, 2: self._nbytes + offset}[whence]
        if pos < 0:
            raise OSError(22, "seek before the start of the stored stream")
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._nbytes - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        self._f.seek(self._base + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return bytes(data)

    def seekable(self) -> bool:
        return True


def load_window(path: str | os.PathLike[str], offset: int, nbytes: int) -> Any:
    """Parse the ``torch.save`` stream stored at bytes ``[offset, offset + nbytes)`` of ``path`` (an item of a DCP
    ``.distcp`` file) as :func:`load` parses a file: the allow-list, the budgets, CRC-32 checks; its tensors'
    storages point at their absolute place in ``path``. A window past the end of the file is refused."""
    p = Path(path)
    with _parsing(p, lambda e: f"{p}: the item at bytes [{offset}, {offset + nbytes}) is not a readable torch.save "
                  f"stream ({_why(e)}); the file is corrupt or its .metadata is wrong", OSError):
        size = limits.regular_file(p).st_size
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise CorruptCheckpointError(f"{p}: an item at bytes [{offset}, {offset + nbytes}) runs past the end of "
                                         f"the file ({size} bytes); the checkpoint is truncated or its .metadata "
                                         "is wrong")
        with os.fdopen(limits.open_regular(p), "rb") as f:
            obj, _ = _load_zip(p, _Window(f, offset, nbytes), base=offset)
        check_tree(obj, p)
        return obj


@dataclass(frozen=True)
class FileInfo:
    """What the container of a parsed file says about the file itself.

    ``archive_name``: the folder its zip records sit in — ``torch.save`` names it after the file it
    saves to (``zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``), so a renamed copy still carries the
    old name (None: legacy format). ``records``: ``(record name without that folder, CRC-32, size)`` of
    every zip record, sorted; two files with equal records hold the same bytes."""

    archive_name: str | None
    records: tuple[tuple[str, int, int], ...] = ()


def load_with_info(path: str | os.PathLike[str]) -> tuple[Any, FileInfo]:
    """:func:`load`, and what the file's container says about it (:class:`FileInfo`)."""
    p = Path(path)
    try:
        with _parsing(p, lambda e: f"{p}: cannot be parsed as a torch checkpoint file ({_why(e)}); it is truncated "
                      "or corrupt — the save was probably interrupted"):
            with os.fdopen(limits.open_regular(p), "rb") as f:
                limits.remember_parsed(p, os.fstat(f.fileno()))
                head = f.read(4)
                if head[:2] == b"PK":
                    obj, info = _load_zip(p, f)
                else:
                    obj, info = _load_legacy(p, f), FileInfo(None)
            check_tree(obj, p)
            return obj, info
    except OSError as e:  # a zip directory pointing before the start of the file: seek() fails with EINVAL
        raise CorruptCheckpointError(
            f"{p}: cannot be read as a torch checkpoint file ({e.strerror or e}); its zip directory points "
            "outside the file — it is truncated or corrupt") from e


def load_raw(path: str | os.PathLike[str], dtype_name: str) -> tuple[TensorRef, FileInfo]:
    """A headerless file of ``dtype_name`` elements as one 1-D :class:`TensorRef` (nothing is unpickled):
    DeepSpeed's NVMe swap files (``<id>.tensor.swp``, written with async I/O, :mod:`dsckpt.nvme_swap`). The
    file carries no CRC; a size that is not a whole number of elements is a damaged file."""
    p = Path(path)
    fd = limits.open_regular(p)
    try:
        nbytes = os.fstat(fd).st_size
    finally:
        os.close(fd)
    itemsize = DTYPES[dtype_name].itemsize
    if nbytes % itemsize:
        raise CorruptCheckpointError(f"{p}: {nbytes} bytes is not a whole number of {dtype_name} elements; "
                                     "the swap file is truncated or corrupt")
    numel = nbytes // itemsize
    storage = StorageRef(p, "raw", dtype_name, numel, 0, "cpu")
    return TensorRef(storage, 0, (numel,), (1,)), FileInfo(None)


def _load_zip(path: Path, raw: Any, base: int = 0) -> tuple[Any, FileInfo]:
    """``base``: where ``raw`` (a window, :class:`_Window`) starts in ``path``; storages get absolute offsets."""
    with zipfile.ZipFile(raw) as zf:
        names = zf.namelist()
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CorruptCheckpointError(f"{path}: the zip archive holds {', '.join(dup)} more than once; it is "
                                         "corrupt (torch never writes a record twice)")
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{path}: zip archive without a single data.pkl; not a torch checkpoint")
        prefix = pkl[0][: -len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in names and _read_member(zf, byteorder, path).strip() not in (b"little", b""):
            raise CorruptCheckpointError(f"{path}: big-endian checkpoints are not supported")
        infos = {i.filename: i for i in zf.infolist()}
        data = _read_member(zf, pkl[0], path, "max_pickle_nbytes")
    checked = crc.checks_enabled()
    info = FileInfo(prefix[:-1] or None, tuple(sorted((i.filename[len(prefix):], i.CRC, i.file_size)
                                                      for i in infos.values())))

    def resolve(args: tuple[Any, ...]) -> StorageRef:
        storage_type, key, location, numel = args[:4]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
        info = infos.get(f"{prefix}data/{key}")
        if info is None:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is missing from the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is compressed; not a torch file")
        raw.seek(info.header_offset)
        header = raw.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{path}: bad zip entry header for data/{key}")
        flags, local_crc = struct.unpack("<H", header[6:8])[0], struct.unpack("<I", header[14:18])[0]
        if not flags & 0x08 and local_crc != info.CRC:  # torch's writer leaves it 0 (bit 3: data descriptor)
            raise CorruptCheckpointError(crc.local_header_message(path, info.filename, info.CRC, local_crc))
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = base + info.header_offset + 30 + name_len + extra_len
        if isinstance(raw, _Window) and offset - base + info.file_size > raw.nbytes:
            raise CorruptCheckpointError(f"{path}: storage data/{key} runs past the end of its item; the file is "
                                         "corrupt")
        dtype = storage_type.dtype
        count = int(numel) if numel is not None else info.file_size // DTYPES[dtype].itemsize
        check = crc.RecordCheck(path, info.filename, info.CRC, info.file_size, offset) if checked else None
        ref = StorageRef(path, str(key), dtype, count, offset, str(location), info.filename, info.file_size,
                         info.CRC, check)
        if ref.nbytes > info.file_size:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is shorter than its tensors")
        return ref

    cache: dict[str, StorageRef] = {}

    def resolve_cached(args: tuple[Any, ...]) -> StorageRef:
        key = str(args[1])
        if key not in cache:
            cache[key] = resolve(args)
        return cache[key]

    stream = _BoundedReader(io.BytesIO(data), path, len(data))
    try:
        with limits.parsing(path, prescan(data, path)[0]):
            return _Unpickler(stream, path=path, resolve_storage=resolve_cached).load(), info
    except MemoryError as e:  # a BINBYTES length far beyond the in-memory pickle (CRC-checked, so hostile)
        raise CorruptCheckpointError(f"{path}: data.pkl asks for more memory than it holds; the file is "
                                     "corrupt or hostile") from e


def _read_member(zf: zipfile.ZipFile, name: str, path: Path, budget: str = "max_text_nbytes") -> bytes:
    """A small record (the pickle, ``byteorder``), read whole within ``budget`` (a :class:`limits.ReadLimits`
    field); :mod:`zipfile` checks its CRC-32. A compressed record (``torch.save`` never compresses) is
    inflated only up to ``max_inflated_nbytes``, whatever its header declares."""
    info = zf.getinfo(name)
    lim = limits.current()
    what = f"record '{name}'"
    try:
        if info.compress_type != zipfile.ZIP_STORED:
            bound = min(lim.max_inflated_nbytes, getattr(lim, budget))
            name_of = "max_inflated_nbytes" if bound == lim.max_inflated_nbytes else budget
            if info.file_size > bound:
                raise limits.exceeded(path, f"compressed {what} declares {info.file_size} bytes inflated", None,
                                      name_of)
            with zf.open(info) as member:
                data = member.read(bound + 1)
                if len(data) > bound:  # the header lied about the inflated size
                    raise limits.exceeded(path, f"compressed {what} inflates past {bound} bytes", None, name_of)
                member.read()  # the rest (none, if the header is right) and zipfile's CRC check
            return data
        if info.file_size > getattr(lim, budget):
            raise limits.exceeded(path, f"{what} of {info.file_size} bytes", None, budget)
        return zf.read(name)
    except zipfile.BadZipFile as e:
        if "CRC" not in str(e):
            raise
        raise CorruptCheckpointError(
            f"{path}: record '{name}' fails its CRC32 check; the file is damaged (bit rot or a bad copy) "
            "— restore it from a backup or use another tag") from e


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def _load_legacy(path: Path, raw_file: Any) -> Any:
    """The pre-zip format: magic, protocol, sys_info, main pickle, storage keys, raw storages."""
    raw_file.seek(0)
    f = _BoundedReader(raw_file, path)
    # The pickles come first: none of them may run past max_pickle_nbytes into the file.
    f.limit_end = limits.current().max_pickle_nbytes
    plain = _PlainUnpickler(f, path)
    _prescan_next(f, path)
    if plain.load() != _LEGACY_MAGIC:
        raise CorruptCheckpointError(f"{path}: not a torch checkpoint (bad magic number)")
    _prescan_next(f, path)
    if _PlainUnpickler(f, path).load() != _LEGACY_PROTOCOL:
        raise CorruptCheckpointError(f"{path}: unsupported legacy torch protocol version")
    _prescan_next(f, path)
    sys_info = _PlainUnpickler(f, path).load()
    if isinstance(sys_info, dict) and not sys_info.get("little_endian", True):
        raise CorruptCheckpointError(f"{path}: big-endian checkpoints are not supported")

    placeholders: dict[str, _LegacyStorage] = {}

    def resolve(args: tuple[Any, ...]) -> Any:
        storage_type, key, location, numel, view_metadata = args
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
        key = str(key)
        if key not in placeholders:
            placeholders[key] = _LegacyStorage(key, storage_type.dtype, int(numel), str(location))
        if view_metadata is not None:
            raise CorruptCheckpointError(f"{path}: legacy storage views are not supported")
        return placeholders[key]

    with limits.parsing(path, _prescan_next(f, path)):
        obj = _LegacyUnpickler(f, path=path, resolve_storage=resolve).load()
    _prescan_next(f, path)
    keys = _PlainUnpickler(f, path).load()
    f.limit_end = None
    if not isinstance(keys, list) or len(keys) > limits.current().max_objects:
        raise CorruptCheckpointError(f"{path}: the storage key list is damaged")
    offset = f.tell()
    resolved: dict[str, StorageRef] = {}
    size = path.stat().st_size
    for key in keys:
        ph = placeholders[str(key)]
        f.seek(offset)
        (count,) = struct.unpack("<q", f.read(8))
        data_offset = offset + 8
        ref = StorageRef(path, ph.key, ph.dtype, int(count), data_offset, ph.location)
        if data_offset + ref.nbytes > size:
            raise CorruptCheckpointError(f"{path}: file ends inside storage {ph.key!r}; it is truncated")
        resolved[ph.key] = ref
        offset = data_offset + ref.nbytes
    return _replace_legacy(obj, resolved)


def _prescan_next(f: _BoundedReader, path: Path) -> int:
    """:func:`~dsckpt.pickle_scan.prescan` of the pickle starting at ``f``'s position (a legacy file's pickles
    lie one after the other, before the tensor data), read in chunks doubling from 64 KiB up to the pickle
    budget; ``f`` is left where it was."""
    start = f.tell()
    end = f.limit_end if f.limit_end is not None else limits.current().max_pickle_nbytes
    n = 1 << 16
    try:
        while True:
            data = f.raw_read(min(n, max(end - start, 0)))
            f.seek(start)
            nbytes, stopped = prescan(data, path, dict_memo=True)
            if stopped or len(data) < min(n, end - start) or start + n >= end:
                return nbytes
            n *= 2
    finally:
        f.seek(start)


class _BoundedReader:
    """A file for the unpickler that refuses reads past its end before anything is allocated: a
    damaged or hostile length in the pickle stream (BINUNICODE8, BINBYTES8, ...; legacy files have no
    CRC) would otherwise ask for up to 2**63 bytes."""

    #: reads may not go past this offset (the pickle budget, ``max_pickle_nbytes``); None: no budget
    limit_end: int | None = None

    def __init__(self, f: Any, path: Path, size: int | None = None) -> None:
        self._f = f
        self._path = path
        self._size = os.fstat(f.fileno()).st_size if size is None else size

    def _check(self, n: int | None) -> None:
        if n is not None and n > self._size - self._f.tell():  # the more precise answer first
            raise CorruptCheckpointError(
                f"{self._path}: the pickle stream asks for {n} bytes at offset {self._f.tell()}, past the end "
                "of the file; it is corrupt")
        if n is not None and self.limit_end is not None and self._f.tell() + n > self.limit_end:
            raise limits.exceeded(self._path, f"a pickle running past byte {self.limit_end}", None,
                                  "max_pickle_nbytes")

    def read(self, n: int = -1) -> bytes:
        self._check(n if n is not None and n >= 0 else None)
        return self._f.read(n)

    def raw_read(self, n: int) -> bytes:
        """Up to ``n`` bytes from here, unchecked (the pre-scan reads ahead)."""
        return self._f.read(n)

    def readinto(self, b: Any) -> int:
        return self._f.readinto(b)

    def peek(self, n: int = 0) -> bytes:  # lets the C unpickler prefetch instead of calling read() per opcode
        pos = self._f.tell()
        data = self._f.read(max(n, 1 << 16))
        self._f.seek(pos)
        return data

    def readline(self, limit: int = -1) -> bytes:
        return self._f.readline(limit)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


@dataclass(frozen=True)
class _LegacyStorage:
    key: str
    dtype: str
    numel: int
    location: str


class _PlainUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """For the legacy header pickles, which hold only plain Python values."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="utf-8")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(f"{self._path}: refusing global '{module}.{name}' in a legacy header")


def _replace_legacy(obj: Any, resolved: dict[str, StorageRef]) -> Any:
    """Swap the placeholder storages that legacy tensors were built on for located ones."""

    def fix(x: Any) -> Any:
        if isinstance(x, TensorRef) and isinstance(x.storage, _LegacyStorage):  # type: ignore[unreachable]
            return TensorRef(resolved[x.storage.key], x.storage_offset, x.shape, x.stride,  # type: ignore[unreachable]
                             x.requires_grad, x.attrs)
        return x

    return map_structure(fix, obj)


#: Besides classes defined in dsckpt's own modules, the globals a batch of dsckpt's own work may name when one of its
#: processes hands it to another (:mod:`dsckpt.scan_engine`'s worker processes).
_WORK_ALLOWED = frozenset({("pathlib", "PosixPath"), ("pathlib", "WindowsPath")})


class _WorkUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, persistent_load: Callable[[Any], Any]) -> None:
        super().__init__(file)
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _WORK_ALLOWED:
            return super().find_class(module, name)
        if module.startswith("dsckpt.") and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # a class of dsckpt's, not a name it imported
                return obj
        raise UnsafeCheckpointError(f"refusing to unpickle global '{module}.{name}' in a batch of dsckpt's own work: "
                                    "only dsckpt's own classes travel to its worker processes")

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)


def load_work_batch(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """A batch of dsckpt's own work that a parent process pickled for a worker (``scan_engine``'s task batches),
    its persistent ids mapped by ``persistent_load``. The bytes are dsckpt's, not a checkpoint's, yet they are
    unpickled here, allowing only classes defined in dsckpt's modules (not names they import, not dotted paths)
    and paths, so that this module stays the one place dsckpt unpickles anything."""
    return _WorkUnpickler(io.BytesIO(data), persistent_load).load()


@deprecated("dsckpt.safe_load.finish_checks is deprecated since dsckpt 0.2.0 and will be removed in 0.3.0: use "
            "dsckpt.parsed_tree.finish_checks(tree) (the walks over parsed trees moved to dsckpt.parsed_tree)")
def finish_checks(obj: Any) -> int:
    """Deprecated since 0.2.0 (removed in 0.3.0): :func:`dsckpt.parsed_tree.finish_checks`, where docs/api.md
    of 0.1.0 showed it."""
    return _finish_checks(obj)
